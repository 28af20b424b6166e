//! The `softrdma` command.

#![forbid(unsafe_code)]

use std::ffi::OsString;
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
    /// Loopback demonstration of the whole stack: connection setup,
    /// Send/Recv, RDMA Write, RDMA Read, an atomic, a verified checksum, and
    /// a short bandwidth/latency comparison with plain TCP. No arguments.
    Demo,
    /// Show the device: attributes (like `ibv_devinfo -v`), datamover and
    /// completion-handler threads with their CPUs, negotiation defaults.
    Info {
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// perftest-style measurements (ib_write_bw, ib_read_lat, ...), with an
    /// optional plain-TCP baseline in the same run.
    Perf(Box<PerfArgs>),
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
    /// `rping` on kernel siw or to another `softrdma ping`. The flags are
    /// rping's.
    Ping {
        /// Run the server (waits for a client; skips connections that fail
        /// to set up, like a port scan's).
        #[arg(short = 's', long, conflicts_with = "client")]
        server: bool,
        /// Run the client (the default).
        #[arg(short = 'c', long)]
        client: bool,
        /// Address to connect to (client) or to bind (server; default all).
        #[arg(short = 'a', long = "addr", value_name = "ADDRESS")]
        addr: Option<String>,
        /// Client: the source address to bind to (rping's -I).
        #[arg(
            short = 'I',
            long = "source",
            value_name = "ADDRESS",
            conflicts_with = "server"
        )]
        source: Option<String>,
        /// TCP port.
        #[arg(short = 'p', long, default_value_t = softrdma_cli::ping::DEFAULT_PORT)]
        port: u16,
        /// Iterations (0: client runs until interrupted, server until the
        /// client leaves).
        #[arg(short = 'C', long, default_value_t = 0)]
        count: u64,
        /// Buffer size in bytes (suffixes K, M as for perf; 24 .. 64K).
        #[arg(short = 'S', long, default_value = "64", value_parser = softrdma_cli::perf::parse_size)]
        size: usize,
        /// Server: serve clients one after another until interrupted
        /// (rping's persistent server mode).
        #[arg(short = 'P', long, requires = "server")]
        persistent: bool,
        /// Print each iteration's data.
        #[arg(short = 'v', long)]
        verbose: bool,
        /// Verify the data (always done; accepted for rping compatibility).
        #[arg(short = 'V', long)]
        validate: bool,
        /// Debug output on stderr: the connection steps (rping's -d; more
        /// with RUST_LOG).
        #[arg(short = 'd', long, action = clap::ArgAction::Count)]
        debug: u8,
        /// rping's "use a self-created, non-CM QP": accepted, no effect
        /// (softrdma sets the QP up the same way either way).
        #[arg(short = 'q')]
        self_created_qp: bool,
        /// Print nothing on success.
        #[arg(long)]
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
        /// Send (kernel siw as the server can leave an FPDU that arrives
        /// right after its MPA Reply unread).
        #[arg(long, default_value_t = 200)]
        start_delay_ms: u64,
    },
    /// Run an unmodified program over softrdma: the drop-in libibverbs /
    /// librdmacm first on the library path, a generated dat.conf for DAT
    /// programs (IAs `softrdma-lo` and `softrdma0`), and with --sockets the
    /// sockets preload library. The program replaces this process.
    Run(RunArgs),
}

/// Arguments of `softrdma run`.
#[derive(Debug, Default, PartialEq, Eq, clap::Args)]
#[command(after_help = "Examples:\n  \
    softrdma run -- ibv_devinfo -v\n  \
    softrdma run -- rping -s -a 127.0.0.1 -C 10\n  \
    softrdma run -- dtest -P softrdma-lo -s\n  \
    softrdma run --sockets -- iperf3 -c 127.0.0.1\n  \
    eval \"$(softrdma run --print-env)\"        # the same settings for a shell\n\
The libraries are found in --lib-dir, else $SOFTRDMA_LIB_DIR, else next to the softrdma \
executable (target/release after `cargo build --release`). A --print-env path under the \
temporary directory (when the library directory cannot be written) may be removed by a tmp \
cleaner: do not keep it in long-lived shells.")]
struct RunArgs {
    /// Require the drop-in verbs libraries (default: used when built).
    #[arg(long, conflicts_with = "no_verbs")]
    verbs: bool,
    /// Leave the drop-in verbs libraries out.
    #[arg(long)]
    no_verbs: bool,
    /// Require the DAT provider (default: used when built).
    #[arg(long, conflicts_with = "no_dat")]
    dat: bool,
    /// Leave the DAT provider out.
    #[arg(long)]
    no_dat: bool,
    /// Preload the sockets library (sockets direct for unmodified socket
    /// programs).
    #[arg(long)]
    sockets: bool,
    /// The sockets preload's policy: auto (offload when the peer can),
    /// offload (required), tcp (plain). Sets SOFTRDMA_SOCKETS; a rules file
    /// can be named with SOFTRDMA_SOCKETS_CONF.
    #[arg(long, value_name = "MODE", requires = "sockets", value_parser = ["auto", "offload", "tcp"])]
    sockets_policy: Option<String>,
    /// Directory holding the softrdma libraries.
    #[arg(long, value_name = "DIR")]
    lib_dir: Option<PathBuf>,
    /// IPv4 address of the `softrdma0` DAT IA (default: $SOFTRDMA_IA_ADDR,
    /// else the first non-loopback IPv4 address, else 127.0.0.1).
    #[arg(long, value_name = "IPV4")]
    ia_addr: Option<std::net::Ipv4Addr>,
    /// Print the environment as shell assignments instead of running a
    /// program.
    #[arg(long)]
    print_env: bool,
    /// The program and its arguments.
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    command: Vec<OsString>,
}

fn run_run_cmd(a: &RunArgs) -> ExitCode {
    use softrdma_cli::run::{RunOptions, Use, prepare, shell_quote};
    use std::os::unix::process::CommandExt;
    let pick = |on: bool, off: bool| match (on, off) {
        (true, _) => Use::Required,
        (_, true) => Use::Off,
        _ => Use::IfPresent,
    };
    if a.command.is_empty() && !a.print_env {
        eprintln!("softrdma run: error: no program given (softrdma run -- CMD ARGS...)");
        return ExitCode::from(USAGE);
    }
    let opts = RunOptions {
        verbs: pick(a.verbs, a.no_verbs),
        dat: pick(a.dat, a.no_dat),
        sockets: a.sockets,
        sockets_policy: a.sockets_policy.clone(),
        lib_dir: a.lib_dir.clone(),
        ia_addr: a.ia_addr,
    };
    let prepared = match prepare(&opts, |k| std::env::var_os(k)) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("softrdma run: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    if a.print_env {
        for (k, v) in &prepared.vars {
            println!("export {k}={}", shell_quote(v));
        }
        return ExitCode::SUCCESS;
    }
    let mut cmd = std::process::Command::new(&a.command[0]);
    cmd.args(&a.command[1..]);
    for (k, v) in &prepared.vars {
        cmd.env(k, v);
    }
    let err = cmd.exec();
    eprintln!(
        "softrdma run: error: cannot run {}: {err}",
        a.command[0].to_string_lossy()
    );
    // As a shell does: 127 not found, 126 found but not runnable.
    ExitCode::from(if err.kind() == ErrorKind::NotFound {
        127
    } else {
        126
    })
}

/// Arguments of `softrdma perf`.
#[derive(Debug, clap::Args)]
#[command(
    after_help = "Two-process mode (like perftest's ib_write_bw / ib_write_bw HOST):\n  \
    softrdma perf write --server                  # waits for one client, then exits\n  \
    softrdma perf write --connect HOST -s 1M      # the client chooses the test and measures\n\
The server accepts whatever test the client asks for unless it conflicts with the test options \
given to the server itself (it refuses then, with the reason on both sides)."
)]
struct PerfArgs {
    /// The operation to measure (optional with --server: the client
    /// chooses; given there, the client must ask for it).
    #[arg(value_enum, required_unless_present = "server")]
    test: Option<softrdma_cli::perf::Test>,
    /// The server to measure against, as perftest's `ib_write_bw HOST`
    /// (same as --connect HOST).
    #[arg(value_name = "HOST", conflicts_with_all = ["server", "connect"])]
    host: Option<String>,
    /// Latency mode (one operation at a time) instead of bandwidth.
    #[arg(long)]
    lat: bool,
    /// Message size in bytes (suffixes K, M, G: 8, 64K, 1M). Default 64K for
    /// bandwidth, 8 for latency and atomics. With -a: the largest size.
    #[arg(short = 's', long, value_parser = softrdma_cli::perf::parse_size)]
    size: Option<usize>,
    /// Sweep sizes 2 B .. 8 MiB (or .. the -s size) in powers of two
    /// (atomic: 8 only).
    #[arg(short = 'a', long)]
    all: bool,
    /// Messages per size [default: 1000].
    #[arg(short = 'n', long, conflicts_with = "duration")]
    iters: Option<u64>,
    /// Run each size for this many seconds instead of a message count.
    #[arg(short = 'D', long, value_name = "SECS")]
    duration: Option<f64>,
    /// Outstanding operations per QP (bandwidth mode; perftest's -t)
    /// [default: 16].
    #[arg(short = 't', long, visible_alias = "tx-depth")]
    depth: Option<usize>,
    /// Queue pairs (bandwidth mode; in two-process mode one connection
    /// each; perftest's -q) [default: 1].
    #[arg(short = 'q', long)]
    qps: Option<usize>,
    /// Messages up to this many bytes are posted inline (at most 256;
    /// perftest's -I) [default: 64].
    #[arg(
        short = 'I',
        long = "inline",
        visible_alias = "inline_size",
        value_name = "N"
    )]
    inline_size: Option<u32>,
    /// The device (perftest's -d): softrdma has one, `softrdma0`.
    #[arg(short = 'd', long = "ib-dev", value_name = "DEVICE")]
    device: Option<String>,
    /// Bidirectional test (perftest's -b): not supported; an error.
    #[arg(short = 'b', long)]
    bidirectional: bool,
    /// Connect with the RDMA CM (perftest's -R): accepted, no effect;
    /// softrdma always sets connections up that way.
    #[arg(short = 'R', long = "rdma_cm")]
    rdma_cm: bool,
    /// Report bandwidth in MiB/s (2^20 bytes per second, what perftest
    /// calls MB/sec) in the table; JSON and CSV always carry both.
    #[arg(long, visible_alias = "report_mib")]
    report_mib: bool,
    /// Ask for the MPA CRC32C on every FPDU (on a server: require it).
    #[arg(long)]
    crc: bool,
    /// Send everything through the datamover threads (no direct sending).
    #[arg(long)]
    force_datamover: bool,
    /// Wait on a completion channel instead of busy polling.
    #[arg(long)]
    event: bool,
    /// Busy-poll the CQ without ever sleeping. By default a wait busy-polls
    /// for 50 µs, then sleeps until a completion comes, which keeps
    /// latency low on a machine with other work on it.
    #[arg(long, conflicts_with = "event")]
    spin: bool,
    /// Measure the same pattern over plain TCP sockets too and print the
    /// ratio softrdma / TCP (bandwidth ratio in bw mode, mean-latency ratio
    /// in lat mode). `tcp`: blocking sockets; `tcp-spin`: non-blocking
    /// sockets polled in a loop, as softrdma busy-polls its CQ. In
    /// two-process mode over a TCP connection to the same server (the
    /// client decides; ignored on a server).
    #[arg(long, value_parser = ["tcp", "tcp-spin"], value_name = "tcp|tcp-spin")]
    baseline: Option<String>,
    /// One JSON object per line.
    #[arg(long, conflicts_with = "csv")]
    json: bool,
    /// Comma-separated values with a header.
    #[arg(long)]
    csv: bool,
    /// Draw bandwidth and latency against message size into this SVG file
    /// (checked before the run).
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Two-process mode: wait for a `--connect` client, serve its run, exit.
    /// Prints `listening on ADDR:PORT` first.
    #[arg(long, conflicts_with = "connect")]
    server: bool,
    /// Two-process mode: run the test against the `--server` at HOST
    /// (HOST, HOST:PORT, IPV6 in brackets:PORT).
    #[arg(long, value_name = "HOST[:PORT]")]
    connect: Option<String>,
    /// TCP port of the two-process mode (0 on a server: any free port).
    #[arg(short = 'p', long, default_value_t = softrdma_cli::perf::DEFAULT_PORT)]
    port: u16,
    /// Server: the address to listen on.
    #[arg(
        long,
        value_name = "ADDR",
        default_value = "0.0.0.0",
        requires = "server"
    )]
    bind: String,
    /// Server: serve clients one after another until interrupted.
    #[arg(long, requires = "server")]
    persist: bool,
    /// Server: most memory one client's run may make it allocate (buffers
    /// of all QPs, the TCP baseline); larger requests are refused
    /// (suffixes K, M, G) [default: 1G].
    #[arg(long, value_name = "BYTES", requires = "server", value_parser = softrdma_cli::perf::parse_size)]
    max_mem: Option<usize>,
    /// Seconds to wait for any step: a client to connect (server), the
    /// connections, control messages, and any progress during a run
    /// [default: 30 in two-process mode, 10 in loopback].
    #[arg(long, value_name = "SECS")]
    timeout: Option<f64>,
    /// Log the steps on stderr: connections, negotiated parameters, each
    /// test's start and end (-vv: more; RUST_LOG overrides).
    #[arg(short = 'v', long, action = clap::ArgAction::Count)]
    verbose: u8,
}

/// Exit status of usage errors (as clap's).
const USAGE: u8 = 2;

/// Exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
const INTERRUPTED: u8 = 130;

/// A flag that Ctrl-C (SIGINT) sets instead of ending the process, so a
/// run can print what it has before it exits.
fn interrupt_flag() -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    if let Err(e) = signal_hook::flag::register(signal_hook::consts::SIGINT, flag.clone()) {
        eprintln!("softrdma: cannot handle Ctrl-C: {e}");
    }
    flag
}

/// Diagnostics on stderr: `RUST_LOG` when set (e.g.
/// `RUST_LOG=softrdma_engine=debug`), else by `-v`/`-d` count: warnings,
/// then info (1), debug (2), trace (3 and more).
fn init_tracing(verbosity: u8) {
    use tracing_subscriber::EnvFilter;
    let level = match verbosity {
        0 => "warn",
        1 => "info",
        2 => "debug",
        _ => "trace",
    };
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(io::stderr)
        .with_ansi(io::IsTerminal::is_terminal(&io::stderr()))
        .with_target(true)
        .try_init();
}

fn run_perf_cmd(a: &PerfArgs) -> ExitCode {
    use softrdma_cli::perf::{
        self, Constraints, Format, Mode, Params, PerfError, PerfOptions, Role, ServerOptions, Test,
    };
    init_tracing(a.verbose);
    let usage = |m: &str| {
        eprintln!("softrdma perf: error: {m}");
        ExitCode::from(USAGE)
    };
    let positive = |d: Option<f64>, what: &str| match d {
        Some(d) if !(d.is_finite() && d > 0.0 && d < 1e6) => {
            Err(format!("{what} must be a positive number of seconds"))
        }
        d => Ok(d.map(std::time::Duration::from_secs_f64)),
    };
    let duration = match positive(a.duration, "--duration") {
        Ok(d) => d,
        Err(m) => return usage(&m),
    };
    let two_process = a.server || a.connect.is_some() || a.host.is_some();
    let timeout = match positive(a.timeout, "--timeout") {
        Ok(t) => t.unwrap_or(std::time::Duration::from_secs(if two_process {
            30
        } else {
            10
        })),
        Err(m) => return usage(&m),
    };
    if a.bidirectional {
        return usage("bidirectional tests (-b) are not supported");
    }
    if let Some(d) = &a.device
        && d != softrdma_engine::device::DEFAULT_DEVICE_NAME
    {
        return usage(&format!(
            "no device '{d}': softrdma's device is '{}'",
            softrdma_engine::device::DEFAULT_DEVICE_NAME
        ));
    }
    let _ = a.rdma_cm;
    let connect = a.connect.clone().or_else(|| a.host.clone());
    let test = a.test.unwrap_or(Test::Write);
    let mode = if a.lat { Mode::Lat } else { Mode::Bw };
    let sizes = if a.all {
        perf::sweep_to(test, a.size.unwrap_or(1 << 23))
    } else {
        vec![a.size.unwrap_or(if test == Test::Atomic || a.lat {
            8
        } else {
            65536
        })]
    };
    let role = if a.server {
        Role::Server(ServerOptions {
            bind: a.bind.clone(),
            port: a.port,
            persist: a.persist,
            require: Constraints {
                test: a.test,
                lat: a.lat,
                sizes: (a.all || a.size.is_some()).then(|| sizes.clone()),
                iters: a.iters,
                duration,
                depth: a.depth,
                qps: a.qps,
                inline: a.inline_size,
                crc: a.crc,
            },
            max_mem: a.max_mem.map_or(perf::DEFAULT_MAX_MEM, |m| m as u64),
        })
    } else if let Some(server) = &connect {
        Role::Client {
            server: server.clone(),
            port: a.port,
        }
    } else {
        Role::Loopback
    };
    let opts = PerfOptions {
        params: Params {
            test,
            mode,
            size: sizes[0],
            iters: a.iters.unwrap_or(1000),
            duration,
            depth: a.depth.unwrap_or(16),
            qps: a.qps.unwrap_or(1),
            inline: a.inline_size.unwrap_or(64),
            crc: a.crc,
            force_datamover: a.force_datamover,
            event: a.event,
            spin: a.spin,
            timeout,
            tcp_spin: false,
        },
        sizes,
        baseline: a.baseline.as_deref().map(|b| {
            if b == "tcp-spin" {
                perf::Baseline::TcpSpin
            } else {
                perf::Baseline::Tcp
            }
        }),
        mib: a.report_mib,
        format: if a.json {
            Format::Json
        } else if a.csv {
            Format::Csv
        } else {
            Format::Human
        },
        plot: a.plot.clone(),
        role,
    };
    perf::set_interrupt(interrupt_flag());
    let stdout = io::stdout();
    let mut out = stdout.lock();
    match perf::run_perf(&opts, &mut out) {
        Ok(_) if perf::interrupted() => {
            eprintln!("softrdma perf: interrupted; the results above are those measured so far");
            ExitCode::from(INTERRUPTED)
        }
        Ok(_) => ExitCode::SUCCESS,
        Err(PerfError::Usage(m)) => usage(&m),
        Err(PerfError::Io { source, .. }) if source.kind() == ErrorKind::BrokenPipe => {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("softrdma perf: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `softrdma run`'s arguments (those after `run`) read without building
/// the command line interface of every subcommand: `run` starts other
/// programs, and each of them pays for what this process does before its
/// `exec`. Only the plain cases are taken: the options of `run` each at
/// most once (with `=VALUE` or the value as the next argument), then `--`
/// or the program. Anything else (help, unknown or repeated options,
/// conflicts, values that are not allowed, no program) is `None`, and the
/// full parser takes it with its own messages; it reads the cases taken
/// here the same way (a test compares the two).
fn quick_run_args(args: &[OsString]) -> Option<RunArgs> {
    let mut a = RunArgs::default();
    let mut i = 0;
    while let Some(arg) = args.get(i) {
        let bytes = arg.as_encoded_bytes();
        if bytes == b"--" {
            i += 1;
            break;
        }
        if !bytes.starts_with(b"-") {
            break;
        }
        let (name, inline) = match arg.to_str()?.split_once('=') {
            Some((n, v)) => (n, Some(v)),
            None => (arg.to_str()?, None),
        };
        let flag = |seen: &mut bool| {
            if *seen || inline.is_some() {
                return None;
            }
            *seen = true;
            Some(())
        };
        match name {
            "--verbs" => flag(&mut a.verbs)?,
            "--no-verbs" => flag(&mut a.no_verbs)?,
            "--dat" => flag(&mut a.dat)?,
            "--no-dat" => flag(&mut a.no_dat)?,
            "--sockets" => flag(&mut a.sockets)?,
            "--print-env" => flag(&mut a.print_env)?,
            "--sockets-policy" | "--lib-dir" | "--ia-addr" => {
                let value = match inline {
                    Some(v) => v.to_owned().into(),
                    None => {
                        i += 1;
                        args.get(i)?.clone()
                    }
                };
                // Empty, or an option where a value belongs: the full
                // parser's error.
                if value.is_empty() || value.as_encoded_bytes().starts_with(b"-") {
                    return None;
                }
                match name {
                    "--sockets-policy" if a.sockets_policy.is_none() => {
                        let v = value.to_str()?;
                        if !["auto", "offload", "tcp"].contains(&v) {
                            return None;
                        }
                        a.sockets_policy = Some(v.to_owned());
                    }
                    "--lib-dir" if a.lib_dir.is_none() => a.lib_dir = Some(value.into()),
                    "--ia-addr" if a.ia_addr.is_none() => {
                        a.ia_addr = Some(value.to_str()?.parse().ok()?);
                    }
                    _ => return None,
                }
            }
            _ => return None,
        }
        i += 1;
    }
    a.command = args.get(i..)?.to_vec();
    let conflict = (a.verbs && a.no_verbs)
        || (a.dat && a.no_dat)
        || (a.sockets_policy.is_some() && !a.sockets);
    (!conflict && !a.command.is_empty()).then_some(a)
}

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == "run")
        && let Some(a) = quick_run_args(&argv[2..])
    {
        return run_run_cmd(&a);
    }
    // `softrdma perf stream ...` has its own options (sockets direct).
    if argv.get(1).is_some_and(|a| a == "perf") && argv.get(2).is_some_and(|a| a == "stream") {
        let argv: Vec<String> = std::env::args().collect();
        return softrdma_cli::perf::stream::main_with_args(&argv[2..]);
    }
    let cli = Cli::parse_from(argv);
    match cli.command {
        Command::Info { json } => {
            let stdout = io::stdout();
            let mut out = stdout.lock();
            match softrdma_cli::info::run_info(json, &mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("softrdma info: error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Demo => {
            let stdout = io::stdout();
            let mut out = stdout.lock();
            match softrdma_cli::demo::run_demo(&mut out) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("softrdma demo: FAILED at step '{e}'");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Perf(a) => run_perf_cmd(&a),
        Command::Run(a) => run_run_cmd(&a),
        Command::Ping {
            server,
            client: _,
            addr,
            source,
            port,
            count,
            size,
            persistent,
            verbose,
            validate: _,
            debug,
            self_created_qp: _,
            quiet,
            mpa_rev,
            crc,
            p2p,
            timeout,
            start_delay_ms,
        } => {
            use softrdma_cli::ping::{PingError, PingOptions, run_ping};
            use softrdma_engine::proto::mpa::CrcPolicy;
            // rping's -d: the debug messages.
            init_tracing(if debug > 0 { debug + 1 } else { 0 });
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
                persistent,
                source,
                stop: Some(interrupt_flag()),
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
                Err(PingError::Interrupted { iterations }) => {
                    println!("softrdma ping: interrupted; {iterations} iterations verified");
                    ExitCode::from(INTERRUPTED)
                }
                Err(e @ PingError::Usage(_)) => {
                    eprintln!("softrdma ping: error: {e}");
                    ExitCode::from(USAGE)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn os(args: &[&[u8]]) -> Vec<OsString> {
        args.iter()
            .map(|a| OsString::from_vec(a.to_vec()))
            .collect()
    }

    /// `softrdma run ARGS` as the full parser reads it.
    fn full(args: &[OsString]) -> Option<RunArgs> {
        let argv = [OsString::from("softrdma"), OsString::from("run")]
            .into_iter()
            .chain(args.iter().cloned());
        match Cli::try_parse_from(argv).ok()?.command {
            Command::Run(a) => Some(a),
            _ => None,
        }
    }

    #[test]
    fn the_quick_reading_of_run_takes_the_plain_cases_as_the_full_parser_does() {
        let taken: &[&[&[u8]]] = &[
            &[b"--", b"true"],
            &[b"true"],
            &[
                b"--no-verbs",
                b"--no-dat",
                b"--sockets",
                b"--",
                b"/bin/true",
            ],
            &[b"--sockets", b"--", b"redis-server", b"--port", b"7000"],
            &[b"--sockets", b"--sockets-policy", b"tcp", b"--", b"x"],
            &[b"--sockets-policy=offload", b"--sockets", b"x", b"-y"],
            &[b"--sockets", b"--sockets-policy", b"auto", b"x"],
            &[b"--lib-dir", b"/my libs", b"--", b"x"],
            &[b"--lib-dir=/l", b"x"],
            &[b"--lib-dir", b"/l\xff", b"x"],
            &[b"--ia-addr", b"10.0.0.1", b"x"],
            &[b"--ia-addr=192.0.2.1", b"--", b"x"],
            &[b"--verbs", b"--dat", b"x", b"--verbs", b"--verbs"],
            &[b"--print-env", b"x"],
            &[b"x", b"--", b"y"],
            &[b"--", b"--", b"x"],
            &[b"--", b"-x"],
            &[b"--", b"--verbs"],
            &[b"x", b"\xff"],
            &[b"--no-verbs", b"--dat", b"--print-env", b"--sockets", b"x"],
        ];
        for args in taken {
            let args = os(args);
            let quick = quick_run_args(&args);
            assert!(quick.is_some(), "not taken: {args:?}");
            assert_eq!(quick, full(&args), "{args:?}");
        }
        // Left to the full parser (its help, errors and messages).
        let left: &[&[&[u8]]] = &[
            &[],
            &[b"--"],
            &[b"--sockets"],
            &[b"--sockets", b"--print-env"],
            &[b"--help"],
            &[b"-h", b"x"],
            &[b"--verbs", b"--no-verbs", b"x"],
            &[b"--dat", b"--no-dat", b"x"],
            &[b"--verbs", b"--verbs", b"x"],
            &[b"--sockets-policy", b"tcp", b"x"],
            &[b"--sockets", b"--sockets-policy", b"bogus", b"x"],
            &[
                b"--sockets",
                b"--sockets-policy=tcp",
                b"--sockets-policy=tcp",
                b"x",
            ],
            &[b"--lib-dir"],
            &[b"--lib-dir", b"--", b"x"],
            &[b"--lib-dir=", b"x"],
            &[b"--lib-dir=-l", b"x"],
            &[b"--lib-dir", b"/a", b"--lib-dir", b"/b", b"x"],
            &[b"--ia-addr", b"300.1.1.1", b"x"],
            &[b"--ia-addr", b"::1", b"x"],
            &[b"--verbs=1", b"x"],
            &[b"--bogus", b"x"],
            &[b"--sock", b"x"],
            &[b"-x", b"y"],
            &[b"-", b"y"],
            &[b"--\xff", b"x"],
        ];
        for args in left {
            let args = os(args);
            assert_eq!(quick_run_args(&args), None, "taken: {args:?}");
        }
    }
}
