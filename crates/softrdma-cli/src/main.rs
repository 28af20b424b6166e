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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
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
