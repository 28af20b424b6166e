//! `softrdma perf`: perftest-style bandwidth and latency tests (`ib_write_bw`,
//! `ib_read_lat`, ...) over softrdma, with the same transfer pattern over
//! plain TCP sockets as a baseline in the same run.
//!
//! Loopback mode (the default) runs both ends in this process: the numbers
//! include the CPU time of both ends (`cpu_us_per_msg` is the process's
//! user + system time from `getrusage` divided by the messages).
//! Two-process mode ([`Role::Server`], [`Role::Client`]) runs one end per
//! process, like perftest's `ib_write_bw` / `ib_write_bw HOST`: the client
//! chooses the test and measures, the server serves it (see [`remote`]);
//! each process reports its own CPU time.
//!
//! Patterns:
//!
//! | test   | bw (depth outstanding)            | lat                                   |
//! |--------|-----------------------------------|---------------------------------------|
//! | write  | RDMA Write stream, fenced by Send | Write ping-pong polling memory, RTT/2 |
//! | send   | Send stream, receiver reposts     | Send/Recv ping-pong, RTT/2            |
//! | read   | RDMA Read stream                  | one Read at a time, full RTT          |
//! | atomic | Fetch-and-Add stream (8 bytes)    | one Fetch-and-Add at a time, full RTT |
//!
//! TCP baseline: write/send: a byte stream of the same messages (bw) or a
//! ping-pong of the same size (lat, RTT/2); read/atomic: 8-byte requests
//! answered by `size`-byte responses, `depth` in flight (bw) or one at a
//! time (lat, full RTT).

mod msg;
mod output;
mod rdma;
pub mod remote;
pub mod stream;
mod tcp;

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::{Device, DeviceConfig};

pub use output::svg;
pub use rdma::measure_rdma;
pub use tcp::measure_tcp;

use output::{Progress, header, human_size, line};

/// Default TCP port of the two-process mode (perftest's).
pub const DEFAULT_PORT: u16 = 18515;

/// Which operation is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Test {
    /// RDMA Write.
    Write,
    /// RDMA Read.
    Read,
    /// Send / Recv.
    Send,
    /// Atomic Fetch-and-Add (8 bytes).
    Atomic,
}

impl Test {
    /// The lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Test::Write => "write",
            Test::Read => "read",
            Test::Send => "send",
            Test::Atomic => "atomic",
        }
    }
}

/// Bandwidth or latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Many operations outstanding.
    Bw,
    /// One operation at a time.
    Lat,
}

/// Parameters of one measurement (one message size).
/// Parameters of one measurement (one message size).
#[derive(Debug, Clone)]
pub struct Params {
    /// The operation.
    pub test: Test,
    /// Bandwidth or latency.
    pub mode: Mode,
    /// Message size in bytes.
    pub size: usize,
    /// Iterations (messages; ignored when `duration` is set).
    pub iters: u64,
    /// Run for this long instead of `iters`.
    pub duration: Option<Duration>,
    /// Outstanding operations per QP (bandwidth mode).
    pub depth: usize,
    /// Queue pairs (bandwidth mode spreads the messages over them).
    pub qps: usize,
    /// Messages up to this size are posted inline.
    pub inline: u32,
    /// Ask for the MPA CRC.
    pub crc: bool,
    /// Force every transmission through the datamover threads.
    pub force_datamover: bool,
    /// Wait on a completion channel instead of busy polling.
    pub event: bool,
    /// Busy-poll without ever sleeping (`--spin`). By default a wait for
    /// completions busy-polls for the device's `poll_spin` (50 µs), then
    /// sleeps until a completion comes (`CompletionQueue::wait`).
    pub spin: bool,
    /// Fail when nothing progresses for this long (and, in two-process
    /// mode, the limit of each connection step and control message).
    pub timeout: Duration,
    /// The TCP baseline busy-polls non-blocking sockets instead of
    /// blocking in `read`.
    pub tcp_spin: bool,
}

impl Params {
    /// QPs used: `qps` in bandwidth mode, 1 in latency mode.
    pub fn nqps(&self) -> usize {
        if self.mode == Mode::Bw { self.qps } else { 1 }
    }

    /// IRD and ORD of each QP.
    fn rd(&self) -> u16 {
        self.depth.clamp(16, 128) as u16
    }
}

impl Default for Params {
    fn default() -> Self {
        Params {
            test: Test::Write,
            mode: Mode::Bw,
            size: 65536,
            iters: 1000,
            duration: None,
            depth: 16,
            qps: 1,
            inline: 64,
            crc: false,
            force_datamover: false,
            event: false,
            spin: false,
            timeout: Duration::from_secs(10),
            tcp_spin: false,
        }
    }
}

/// The result of one measurement.
#[derive(Debug, Clone, Default)]
pub struct Measurement {
    /// Message size.
    pub size: usize,
    /// Messages completed.
    pub iters: u64,
    /// Wall time.
    pub secs: f64,
    /// Per-operation latencies in µs, sorted (bw: post to completion).
    pub lat_us: Vec<f64>,
    /// Process CPU time (user + system) during the run, seconds.
    pub cpu_secs: f64,
}

impl Measurement {
    /// Megabytes (10^6) per second.
    pub fn mb_s(&self) -> f64 {
        self.size as f64 * self.iters as f64 / self.secs.max(1e-9) / 1e6
    }
    /// Gigabits per second.
    pub fn gbit_s(&self) -> f64 {
        self.mb_s() * 8.0 / 1000.0
    }
    /// Millions of messages per second.
    pub fn mmsg_s(&self) -> f64 {
        self.iters as f64 / self.secs.max(1e-9) / 1e6
    }
    /// Percentile `p` (0..=1) by nearest rank: the smallest sample with
    /// at least `p` of the samples at or below it (0 without samples).
    fn pct(&self, p: f64) -> f64 {
        percentile(&self.lat_us, p)
    }
    /// Smallest latency, µs.
    pub fn lat_min(&self) -> f64 {
        self.pct(0.0)
    }
    /// Median latency, µs.
    pub fn lat_median(&self) -> f64 {
        self.pct(0.5)
    }
    /// 99th percentile latency, µs.
    pub fn lat_p99(&self) -> f64 {
        self.pct(0.99)
    }
    /// 99.9th percentile latency, µs.
    pub fn lat_p999(&self) -> f64 {
        self.pct(0.999)
    }
    /// Largest latency, µs.
    pub fn lat_max(&self) -> f64 {
        self.pct(1.0)
    }
    /// Mean latency, µs (0 without samples).
    pub fn lat_mean(&self) -> f64 {
        if self.lat_us.is_empty() {
            return 0.0;
        }
        self.lat_us.iter().sum::<f64>() / self.lat_us.len() as f64
    }
    /// Sample standard deviation of the latencies, µs (0 with fewer than
    /// two samples).
    pub fn lat_stdev(&self) -> f64 {
        let n = self.lat_us.len();
        if n < 2 {
            return 0.0;
        }
        let m = self.lat_mean();
        (self.lat_us.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1) as f64).sqrt()
    }
    /// CPU µs per message.
    pub fn cpu_us_per_msg(&self) -> f64 {
        self.cpu_secs * 1e6 / (self.iters.max(1) as f64)
    }

    /// The numbers a row needs.
    pub fn summary(&self) -> Summary {
        Summary {
            size: self.size,
            iters: self.iters,
            secs: self.secs,
            lat_n: self.lat_us.len() as u64,
            lat_min_us: self.lat_min(),
            lat_mean_us: self.lat_mean(),
            lat_stdev_us: self.lat_stdev(),
            lat_p50_us: self.lat_median(),
            lat_p99_us: self.lat_p99(),
            lat_p999_us: self.lat_p999(),
            lat_max_us: self.lat_max(),
            cpu_secs: self.cpu_secs,
        }
    }
}

/// Percentile `p` (0..=1) of sorted `v` by nearest rank (0 if empty).
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let rank = (p * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

/// What a row shows of a [`Measurement`] (what the client of a two-process
/// run sends to the server).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Summary {
    /// Message size.
    pub size: usize,
    /// Messages completed.
    pub iters: u64,
    /// Wall time, seconds.
    pub secs: f64,
    /// Latency samples (0: the pattern has none, e.g. a TCP stream).
    pub lat_n: u64,
    /// Latency minimum, µs.
    pub lat_min_us: f64,
    /// Latency mean, µs.
    pub lat_mean_us: f64,
    /// Latency sample standard deviation, µs.
    pub lat_stdev_us: f64,
    /// Latency median, µs.
    pub lat_p50_us: f64,
    /// Latency 99th percentile, µs.
    pub lat_p99_us: f64,
    /// Latency 99.9th percentile, µs.
    pub lat_p999_us: f64,
    /// Latency maximum, µs.
    pub lat_max_us: f64,
    /// CPU time (user + system) of this process during the run, seconds.
    pub cpu_secs: f64,
}

impl Summary {
    /// Megabytes (10^6) per second.
    pub fn mb_s(&self) -> f64 {
        self.size as f64 * self.iters as f64 / self.secs.max(1e-9) / 1e6
    }
}

/// Why a measurement failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PerfError {
    /// Bad arguments.
    #[error("{0}")]
    Usage(String),
    /// The engine refused something or a completion failed.
    #[error("{0}")]
    Engine(String),
    /// A socket or file failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// Nothing happened for too long.
    #[error("timed out: {0}")]
    Timeout(String),
    /// Two-process mode: the server refused the client's test (the reason
    /// is the server's).
    #[error("{0}")]
    Refused(String),
    /// Two-process mode: the peer failed, left, or sent something invalid.
    #[error("{0}")]
    Peer(String),
}

fn eng(e: impl std::fmt::Display) -> PerfError {
    PerfError::Engine(e.to_string())
}

fn io(what: &str) -> impl Fn(std::io::Error) -> PerfError + '_ {
    move |source| PerfError::Io {
        what: what.to_string(),
        source,
    }
}

/// Operations completed so far, for the progress indicator.
static PROGRESS: AtomicU64 = AtomicU64::new(0);

/// Process CPU time (user + system), seconds (0 if getrusage fails).
pub fn cpu_time() -> f64 {
    use nix::sys::resource::{UsageWho, getrusage};
    use nix::sys::time::TimeValLike;
    getrusage(UsageWho::RUSAGE_SELF).map_or(0.0, |u| {
        (u.user_time().num_microseconds() + u.system_time().num_microseconds()) as f64 / 1e6
    })
}

/// Limit of a run: a count or a deadline.
#[derive(Clone, Copy)]
struct Limit {
    iters: u64,
    deadline: Option<Instant>,
}

impl Limit {
    fn new(p: &Params) -> Limit {
        Limit {
            iters: if p.duration.is_some() {
                u64::MAX
            } else {
                p.iters
            },
            deadline: p.duration.map(|d| Instant::now() + d),
        }
    }
    fn more(&self, done: u64) -> bool {
        done < self.iters && self.deadline.is_none_or(|d| Instant::now() < d) && !interrupted()
    }
}

/// A watchdog: fails instead of hanging when nothing completes.
/// A watchdog: fails instead of hanging when nothing completes.
struct Watchdog {
    last: Instant,
    what: &'static str,
    limit: Duration,
}

impl Watchdog {
    fn new(what: &'static str, limit: Duration) -> Self {
        Watchdog {
            last: Instant::now(),
            what,
            limit,
        }
    }
    fn kick(&mut self) {
        self.last = Instant::now();
    }
    fn check(&self) -> Result<(), PerfError> {
        if self.last.elapsed() > self.limit {
            Err(PerfError::Timeout(format!(
                "no progress for {:.0} s waiting for {}",
                self.limit.as_secs_f64(),
                self.what
            )))
        } else {
            Ok(())
        }
    }
}

fn device(p: &Params) -> Result<Device, PerfError> {
    let mut cfg = DeviceConfig::default();
    cfg.force_datamover = p.force_datamover;
    if p.spin {
        cfg.poll_spin = Duration::MAX;
        cfg.poll_yield_every = 0;
    }
    if let Some(us) = std::env::var("SOFTRDMA_POLL_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.poll_spin = Duration::from_micros(us);
    }
    if let Some(on) = std::env::var("SOFTRDMA_POLL_ADAPTIVE")
        .ok()
        .and_then(|v| v.parse::<u8>().ok())
    {
        cfg.poll_spin_adaptive = on != 0;
    }
    if let Some(n) = std::env::var("SOFTRDMA_POLL_YIELD")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        cfg.poll_yield_every = n;
    }
    Device::open_with(cfg).map_err(eng)
}

fn mpa(p: &Params) -> MpaConfig {
    MpaConfig {
        crc: if p.crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::AcceptIfAsked
        },
        ..MpaConfig::default()
    }
}

/// Largest message size.
pub const MAX_SIZE: usize = 1 << 30;

/// Largest `--inline` (the engine's inline limit).
pub const MAX_INLINE: u32 = 256;

/// Largest `--depth`.
pub const MAX_DEPTH: usize = 4096;

/// Largest `--qps`.
pub const MAX_QPS: usize = 255;

fn validate(p: &Params) -> Result<(), PerfError> {
    if p.size == 0 {
        return Err(PerfError::Usage("message size must be at least 1".into()));
    }
    if p.test == Test::Atomic && p.size != 8 {
        return Err(PerfError::Usage(
            "atomic operations are 8 bytes (-s 8)".into(),
        ));
    }
    if p.size > MAX_SIZE {
        return Err(PerfError::Usage(
            "message size too large (at most 1G)".into(),
        ));
    }
    if p.depth == 0 || p.depth > MAX_DEPTH || p.qps == 0 || p.qps > MAX_QPS {
        return Err(PerfError::Usage(format!(
            "--depth must be between 1 and {MAX_DEPTH} and --qps between 1 and {MAX_QPS}"
        )));
    }
    if p.inline > MAX_INLINE {
        return Err(PerfError::Usage(format!(
            "--inline {} is above the largest inline size, {MAX_INLINE}",
            p.inline
        )));
    }
    if p.duration.is_none() && p.iters == 0 {
        return Err(PerfError::Usage("--iters must be at least 1".into()));
    }
    Ok(())
}

/// Output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// A table for people.
    #[default]
    Human,
    /// One JSON object per line.
    Json,
    /// Comma-separated values with a header line.
    Csv,
}

/// Where the two ends run.
#[derive(Debug, Clone, Default)]
pub enum Role {
    /// Both in this process.
    #[default]
    Loopback,
    /// Measure against a server (`host`, `host:port`, `[v6]:port`; the
    /// port defaults to `port`).
    Client {
        /// The server's address.
        server: String,
        /// Port when `server` has none.
        port: u16,
    },
    /// Serve clients.
    Server(ServerOptions),
}

/// Default of [`ServerOptions::max_mem`]: 1 GiB.
pub const DEFAULT_MAX_MEM: u64 = 1 << 30;

/// Settings of `softrdma perf --server`.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Address to listen on (`0.0.0.0` for all).
    pub bind: String,
    /// Port (0: any free one; the line `listening on ADDR:PORT` tells).
    pub port: u16,
    /// Serve one client after another instead of one run.
    pub persist: bool,
    /// Test settings given to the server: a client asking for something
    /// else is refused.
    pub require: Constraints,
    /// Most bytes of buffers one client's run may make the server
    /// allocate (all QPs, the TCP baseline, the control connection); a
    /// client asking for more is refused.
    pub max_mem: u64,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            bind: "0.0.0.0".into(),
            port: DEFAULT_PORT,
            persist: false,
            require: Constraints::default(),
            max_mem: DEFAULT_MAX_MEM,
        }
    }
}

/// Test settings given explicitly to the server; `None`/`false`: anything
/// the client asks.
#[derive(Debug, Clone, Default)]
pub struct Constraints {
    /// The test.
    pub test: Option<Test>,
    /// Latency mode.
    pub lat: bool,
    /// The message sizes (`-s`, `-a`).
    pub sizes: Option<Vec<usize>>,
    /// Messages per size.
    pub iters: Option<u64>,
    /// Seconds per size.
    pub duration: Option<Duration>,
    /// Outstanding operations.
    pub depth: Option<usize>,
    /// Queue pairs.
    pub qps: Option<usize>,
    /// Inline threshold.
    pub inline: Option<u32>,
    /// The MPA CRC.
    pub crc: bool,
}

/// Everything `softrdma perf` was asked to do.
#[derive(Debug, Clone)]
pub struct PerfOptions {
    /// Per-measurement parameters (`size` is replaced by each of `sizes`).
    /// On a server only the local settings (`event`, `force_datamover`,
    /// `timeout`) are used: the client chooses the test.
    pub params: Params,
    /// Message sizes to run.
    pub sizes: Vec<usize>,
    /// Also run this TCP baseline.
    pub baseline: Option<Baseline>,
    /// Output format.
    pub format: Format,
    /// Write an SVG plot here.
    pub plot: Option<PathBuf>,
    /// Loopback, client or server.
    pub role: Role,
    /// The human table's bandwidth in MiB/s (2^20 bytes/s, perftest's
    /// "MB/sec") instead of MB/s (10^6).
    pub mib: bool,
}

impl PerfOptions {
    fn style(&self) -> output::Style {
        output::Style {
            format: self.format,
            mib: self.mib,
            baseline: self.baseline,
        }
    }
}

/// Set by Ctrl-C (see [`set_interrupt`]).
static INTERRUPT: std::sync::OnceLock<std::sync::Arc<std::sync::atomic::AtomicBool>> =
    std::sync::OnceLock::new();

/// Makes `flag` (set by a Ctrl-C handler) end the runs early: the current
/// measurement stops and prints what it measured, no further size runs, a
/// server stops waiting for clients.
pub fn set_interrupt(flag: std::sync::Arc<std::sync::atomic::AtomicBool>) {
    let _ = INTERRUPT.set(flag);
}

/// Whether the run was interrupted.
pub fn interrupted() -> bool {
    INTERRUPT
        .get()
        .is_some_and(|f| f.load(std::sync::atomic::Ordering::Relaxed))
}

/// Server: waits for the next connection request (at most `limit`);
/// false only when interrupted first (a timeout is left to the caller's
/// own wait, which reports it).
fn wait_for_request(l: &softrdma_engine::cm::Listener, limit: Option<Duration>) -> bool {
    let start = Instant::now();
    loop {
        if interrupted() {
            return false;
        }
        if l.pending_requests() > 0 || limit.is_some_and(|t| start.elapsed() > t) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// One output line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    /// The test.
    pub test: Test,
    /// bw or lat.
    pub mode: Mode,
    /// Message size, bytes.
    pub size: usize,
    /// Messages completed.
    pub iters: u64,
    /// MB/s (10^6 bytes).
    pub mb_s: f64,
    /// MiB/s (2^20 bytes, perftest's "MB").
    pub mib_s: f64,
    /// Gbit/s.
    pub gbit_s: f64,
    /// Millions of messages per second.
    pub mmsg_s: f64,
    /// What the latency columns measure: `one-way (RTT/2)`, `round trip`,
    /// or (bandwidth mode) `post to completion, N outstanding`.
    pub lat_kind: String,
    /// Latency minimum, µs.
    pub lat_min_us: f64,
    /// Latency mean, µs.
    pub lat_mean_us: f64,
    /// Latency sample standard deviation, µs.
    pub lat_stdev_us: f64,
    /// Latency median, µs.
    pub lat_p50_us: f64,
    /// Latency 99th percentile, µs.
    pub lat_p99_us: f64,
    /// Latency 99.9th percentile, µs.
    pub lat_p999_us: f64,
    /// Latency maximum, µs.
    pub lat_max_us: f64,
    /// Process CPU µs per message (both ends in loopback mode).
    pub cpu_us_per_msg: f64,
    /// The baseline: `tcp` (blocking sockets) or `tcp-spin` (busy-polled
    /// non-blocking sockets).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline: Option<&'static str>,
    /// TCP baseline MB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_mb_s: Option<f64>,
    /// TCP baseline latency mean, µs (none for a stream: it has no
    /// per-message latency).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_mean_us: Option<f64>,
    /// TCP baseline latency standard deviation, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_stdev_us: Option<f64>,
    /// TCP baseline median latency, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_p50_us: Option<f64>,
    /// TCP baseline latency 99th percentile, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_p99_us: Option<f64>,
    /// TCP baseline latency 99.9th percentile, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_p999_us: Option<f64>,
    /// TCP baseline latency maximum, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_max_us: Option<f64>,
    /// softrdma / TCP, see `ratio_of`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// What `ratio` compares and which way is better.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio_of: Option<&'static str>,
}

/// `ratio_of` in bandwidth mode.
pub const RATIO_BW: &str = "bandwidth softrdma/TCP (above 1: softrdma faster)";
/// `ratio_of` in latency mode.
pub const RATIO_LAT: &str = "mean latency softrdma/TCP (below 1: softrdma faster)";

/// What the latency columns of `p` measure.
pub fn lat_kind(p: &Params) -> String {
    match (p.mode, p.test) {
        (Mode::Bw, _) => format!("post to completion, {} outstanding", p.depth),
        (Mode::Lat, Test::Write | Test::Send) => "one-way (RTT/2)".into(),
        (Mode::Lat, Test::Read | Test::Atomic) => "round trip".into(),
    }
}

/// Rounds to 4 significant digits (small rates stay non-zero).
fn r3(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let scale = 10f64.powi(3 - x.abs().log10().floor() as i32);
    (x * scale).round() / scale
}

impl Row {
    fn new(p: &Params, m: &Summary, tcp: Option<&Summary>, baseline: Option<Baseline>) -> Row {
        let tl = |f: fn(&Summary) -> f64| tcp.filter(|t| t.lat_n > 0).map(|t| r3(f(t)));
        let ratio = tcp.and_then(|t| match p.mode {
            Mode::Bw => Some(m.mb_s() / t.mb_s().max(1e-9)),
            Mode::Lat if t.lat_n > 0 => Some(m.lat_mean_us / t.lat_mean_us.max(1e-9)),
            Mode::Lat => None,
        });
        let mb_s = m.mb_s();
        Row {
            test: p.test,
            mode: p.mode,
            size: m.size,
            iters: m.iters,
            mb_s: r3(mb_s),
            mib_s: r3(mb_s * 1e6 / f64::from(1u32 << 20)),
            gbit_s: r3(mb_s * 8.0 / 1000.0),
            mmsg_s: r3(m.iters as f64 / m.secs.max(1e-9) / 1e6),
            lat_kind: lat_kind(p),
            lat_min_us: r3(m.lat_min_us),
            lat_mean_us: r3(m.lat_mean_us),
            lat_stdev_us: r3(m.lat_stdev_us),
            lat_p50_us: r3(m.lat_p50_us),
            lat_p99_us: r3(m.lat_p99_us),
            lat_p999_us: r3(m.lat_p999_us),
            lat_max_us: r3(m.lat_max_us),
            cpu_us_per_msg: r3(m.cpu_secs * 1e6 / (m.iters.max(1) as f64)),
            baseline: tcp.and(baseline).map(Baseline::name),
            tcp_mb_s: tcp.map(|t| r3(t.mb_s())),
            tcp_lat_mean_us: tl(|t| t.lat_mean_us),
            tcp_lat_stdev_us: tl(|t| t.lat_stdev_us),
            tcp_lat_p50_us: tl(|t| t.lat_p50_us),
            tcp_lat_p99_us: tl(|t| t.lat_p99_us),
            tcp_lat_p999_us: tl(|t| t.lat_p999_us),
            tcp_lat_max_us: tl(|t| t.lat_max_us),
            ratio: ratio.map(r3),
            ratio_of: ratio.map(|_| {
                if p.mode == Mode::Bw {
                    RATIO_BW
                } else {
                    RATIO_LAT
                }
            }),
        }
    }
}

/// The TCP baseline's flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Baseline {
    /// Blocking sockets: the thread sleeps in `read` (`--baseline tcp`).
    #[default]
    Tcp,
    /// Non-blocking sockets polled in a loop, as softrdma polls its CQ
    /// (`--baseline tcp-spin`).
    TcpSpin,
}

impl Baseline {
    /// `tcp` or `tcp-spin`.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Tcp => "tcp",
            Baseline::TcpSpin => "tcp-spin",
        }
    }
}

/// Parses a size: `8`, `64K`, `1M`, `2G` (binary multiples; `k`, `KiB`,
/// `KB` also accepted).
///
/// # Errors
///
/// A message for anything else.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 8, 64K, 1M)"))?;
    let mult: usize = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("'{s}': unknown size suffix (use K, M or G)")),
    };
    n.checked_mul(mult)
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("'{s}' is not a valid size"))
}

/// Runs `softrdma perf` (loopback, client or server), writing results to
/// `out` as they come; returns the rows.
///
/// # Errors
///
/// [`PerfError`] from a measurement, the peer, the output or the plot file.
pub fn run_perf(o: &PerfOptions, out: &mut dyn Write) -> Result<Vec<Row>, PerfError> {
    // The plot's path is checked before the run, not after it.
    let plot = match &o.plot {
        Some(path) => Some(
            std::fs::File::create(path)
                .map_err(io(&format!("cannot write the plot to {}", path.display())))?,
        ),
        None => None,
    };
    let (rows, place) = match &o.role {
        Role::Loopback => (run_loopback(o, out)?, "loopback".to_string()),
        Role::Client { server, port } => (
            remote::run_client(o, server, *port, out)?,
            format!("client of {server}"),
        ),
        Role::Server(s) => (remote::run_server(o, s, out)?, "server".to_string()),
    };
    if let Some(mut f) = plot {
        let p = rows.first().map_or(o.params.clone(), |r| Params {
            test: r.test,
            mode: r.mode,
            ..o.params.clone()
        });
        f.write_all(svg(&rows, &output::title(&p, &place)).as_bytes())
            .map_err(io("writing the plot"))?;
    }
    Ok(rows)
}

/// Checks every size of `o` before anything runs.
fn validate_all(o: &PerfOptions) -> Result<(), PerfError> {
    if o.sizes.is_empty() {
        return Err(PerfError::Usage("no message size".into()));
    }
    for &s in &o.sizes {
        validate(&Params {
            size: s,
            ..o.params.clone()
        })?;
    }
    Ok(())
}

/// The progress label of a measurement.
fn label(p: &Params) -> String {
    format!(
        "{} {} {}",
        p.test.name(),
        human_size(p.size),
        if p.mode == Mode::Bw { "bw" } else { "lat" }
    )
}

fn run_loopback(o: &PerfOptions, out: &mut dyn Write) -> Result<Vec<Row>, PerfError> {
    validate_all(o)?;
    let progress = Progress::start();
    header(out, o.style(), &o.params, "loopback").map_err(io("output"))?;
    let mut rows = Vec::new();
    for &size in &o.sizes {
        let p = Params {
            size,
            ..o.params.clone()
        };
        progress.set(label(&p));
        tracing::info!(test = p.test.name(), size, "loopback measurement");
        let m = measure_rdma(&p)?;
        tracing::info!(size, iters = m.iters, secs = m.secs, "measured");
        let tcp = if o.baseline.is_some() {
            progress.set(format!("tcp baseline {}", human_size(size)));
            // Same number of messages as the softrdma run did.
            Some(measure_tcp(&tcp_params(&p, &m, o.baseline))?)
        } else {
            None
        };
        let r = Row::new(
            &p,
            &m.summary(),
            tcp.map(|t| t.summary()).as_ref(),
            o.baseline,
        );
        line(out, o.style(), &r).map_err(io("output"))?;
        out.flush().map_err(io("output"))?;
        rows.push(r);
    }
    Ok(rows)
}

/// The TCP baseline's parameters: the same number of messages as the
/// softrdma run `m` did.
fn tcp_params(p: &Params, m: &Measurement, baseline: Option<Baseline>) -> Params {
    Params {
        iters: m.iters.max(1),
        duration: None,
        tcp_spin: baseline == Some(Baseline::TcpSpin),
        ..p.clone()
    }
}

/// The sizes of `-a`: powers of two from 2 to 8 MiB (8 only for atomic).
pub fn sweep(test: Test) -> Vec<usize> {
    sweep_to(test, 1 << 23)
}

/// The sizes of `-a -s MAX`: powers of two from 2 to `max` (8 only for
/// atomic; `max` itself if it is below 2).
pub fn sweep_to(test: Test, max: usize) -> Vec<usize> {
    if test == Test::Atomic {
        vec![8]
    } else if max < 2 {
        vec![max]
    } else {
        (1..usize::BITS)
            .map(|e| 1usize << e)
            .take_while(|&s| s <= max)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statistics_of_known_samples() {
        let m = Measurement {
            size: 8,
            iters: 1000,
            secs: 1.0,
            lat_us: (1..=1000).map(f64::from).collect(),
            cpu_secs: 0.0,
        };
        assert_eq!(m.lat_min(), 1.0);
        assert_eq!(m.lat_median(), 500.0);
        assert_eq!(m.lat_p99(), 990.0);
        assert_eq!(m.lat_p999(), 999.0);
        assert_eq!(m.lat_max(), 1000.0);
        assert_eq!(m.lat_mean(), 500.5);
        // Sample standard deviation of 1..=n: sqrt(n (n + 1) / 12).
        assert!((m.lat_stdev() - (1000.0f64 * 1001.0 / 12.0).sqrt()).abs() < 1e-9);
        let one = Measurement {
            lat_us: vec![3.0],
            ..m.clone()
        };
        assert_eq!((one.lat_p999(), one.lat_stdev()), (3.0, 0.0));
        let none = Measurement {
            lat_us: vec![],
            ..m
        };
        assert_eq!(none.summary().lat_n, 0);
    }
}
