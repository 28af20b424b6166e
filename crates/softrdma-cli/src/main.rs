//! The `softrdma` command.

use std::io::{self, ErrorKind};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use softrdma_cli::{DissectError, OutputOptions, run_dissect};

/// RDMA in software over TCP, speaking iWARP.
#[derive(Debug, Parser)]
#[command(name = "softrdma", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Decode the iWARP traffic (MPA, DDP, RDMAP) of a pcap/pcapng capture:
    /// one line per FPDU, then a summary per TCP stream.
    Dissect {
        /// The capture file (pcap or pcapng; Ethernet, Linux SLL/SLL2, BSD
        /// loopback link types).
        file: PathBuf,
        /// Print JSON lines (one object per FPDU, MPA frame, note and stream
        /// summary) instead of text.
        #[arg(long)]
        json: bool,
        /// Print only the per-stream summaries.
        #[arg(long)]
        summary: bool,
        /// Only this TCP stream (0-based, in order of first appearance).
        #[arg(long, value_name = "N")]
        stream: Option<usize>,
    },
    /// rping-compatible ping over softrdma: Send, RDMA Read, Send, Send,
    /// RDMA Write, Send per iteration, data verified. Talks to rdma-core's
    /// `rping` on kernel siw or to another `softrdma ping`.
    Ping {
        /// Run the server (waits for one client).
        #[arg(short = 's', long, conflicts_with = "client")]
        server: bool,
        /// Run the client (the default).
        #[arg(short = 'c', long)]
        client: bool,
        /// Address to connect to (client) or to bind (server; default all).
        #[arg(short = 'a', long = "addr", value_name = "ADDRESS")]
        addr: Option<String>,
        /// TCP port.
        #[arg(short = 'p', long, default_value_t = softrdma_cli::ping::DEFAULT_PORT)]
        port: u16,
        /// Iterations (0: client runs forever, server until the client leaves).
        #[arg(short = 'C', long, default_value_t = 0)]
        count: u64,
        /// Buffer size in bytes.
        #[arg(short = 'S', long, default_value_t = softrdma_cli::ping::DEFAULT_SIZE)]
        size: usize,
        /// Print each iteration's data.
        #[arg(short = 'v', long)]
        verbose: bool,
        /// Verify the data (always done; accepted for rping compatibility).
        #[arg(short = 'V', long)]
        validate: bool,
        /// Quiet: print nothing on success (rping's -q).
        #[arg(short = 'q', long)]
        quiet: bool,
        /// MPA revision to request: 2 (enhanced, IRD/ORD) or 1.
        #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u8).range(1..=2))]
        mpa_rev: u8,
        /// CRC: off, accept (on if the peer asks), required.
        #[arg(long, default_value = "accept", value_parser = ["off", "accept", "required"])]
        crc: String,
        /// Offer MPA peer-to-peer mode (RTR) as the client.
        #[arg(long)]
        p2p: bool,
        /// Seconds to wait for any one step.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// Client: milliseconds to wait after connecting before the first
        /// Send (rping's server can lose a message that arrives before it has
        /// handled its connection-established event).
        #[arg(long, default_value_t = 200)]
        start_delay_ms: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Ping {
            server,
            client: _,
            addr,
            port,
            count,
            size,
            verbose,
            validate: _,
            quiet,
            mpa_rev,
            crc,
            p2p,
            timeout,
            start_delay_ms,
        } => {
            use softrdma_cli::ping::{PingOptions, run_ping};
            use softrdma_engine::proto::mpa::CrcPolicy;
            let opts = PingOptions {
                server,
                addr,
                port,
                count,
                size,
                verbose,
                mpa_revision: mpa_rev,
                crc: match crc.as_str() {
                    "off" => CrcPolicy::Off,
                    "required" => CrcPolicy::Required,
                    _ => CrcPolicy::AcceptIfAsked,
                },
                p2p,
                timeout: std::time::Duration::from_secs(timeout),
                start_delay: std::time::Duration::from_millis(start_delay_ms),
            };
            let stdout = io::stdout();
            let mut out = stdout.lock();
            match run_ping(&opts, &mut out) {
                Ok(s) => {
                    if !quiet {
                        println!(
                            "softrdma ping: {} iterations with {} verified (MPA rev {}, CRC {})",
                            s.iterations,
                            s.peer,
                            s.mpa_revision,
                            if s.crc { "on" } else { "off" }
                        );
                    }
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("softrdma ping: error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Dissect {
            file,
            json,
            summary,
            stream,
        } => {
            let opts = OutputOptions {
                json,
                summary_only: summary,
                stream,
            };
            let stdout = io::stdout();
            let mut out = io::BufWriter::new(stdout.lock());
            match run_dissect(&file, &opts, &mut out) {
                Ok(_) => ExitCode::SUCCESS,
                // `softrdma dissect x.pcap | head` is not an error.
                Err(DissectError::Output(e)) if e.kind() == ErrorKind::BrokenPipe => {
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("softrdma dissect: error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
