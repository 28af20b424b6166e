//! `softrdma perf`: perftest-style bandwidth and latency tests (`ib_write_bw`,
//! `ib_read_lat`, ...) over softrdma, with the same transfer pattern over
//! plain TCP sockets as a baseline in the same run.
//!
//! Loopback mode (the default) runs both ends in this process: the numbers
//! include the CPU time of both ends (`cpu_us_per_msg` is the process's
//! user + system time from `getrusage` divided by the messages).
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

use std::io::{IsTerminal, Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::{
    Access, CompletionChannel, CompletionQueue, Device, DeviceConfig, MemoryRegion,
    ProtectionDomain, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
    WorkCompletion,
};

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
    fn pct(&self, p: f64) -> f64 {
        if self.lat_us.is_empty() {
            return 0.0;
        }
        let i = ((self.lat_us.len() - 1) as f64 * p).round() as usize;
        self.lat_us[i.min(self.lat_us.len() - 1)]
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
    /// Largest latency, µs.
    pub fn lat_max(&self) -> f64 {
        self.pct(1.0)
    }
    /// CPU µs per message.
    pub fn cpu_us_per_msg(&self) -> f64 {
        self.cpu_secs * 1e6 / (self.iters.max(1) as f64)
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

/// Process CPU time (user + system), seconds.
pub fn cpu_time() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a valid, writable rusage; getrusage only writes it.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: zero-initialised and filled by a successful getrusage.
    let ru = unsafe { ru.assume_init() };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
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
        done < self.iters && self.deadline.is_none_or(|d| Instant::now() < d)
    }
}

/// A watchdog: fails instead of hanging when nothing completes.
struct Watchdog {
    last: Instant,
    what: &'static str,
}

impl Watchdog {
    fn new(what: &'static str) -> Self {
        Watchdog {
            last: Instant::now(),
            what,
        }
    }
    fn kick(&mut self) {
        self.last = Instant::now();
    }
    fn check(&self) -> Result<(), PerfError> {
        if self.last.elapsed() > Duration::from_secs(10) {
            Err(PerfError::Timeout(format!(
                "no progress for 10 s waiting for {}",
                self.what
            )))
        } else {
            Ok(())
        }
    }
}

fn access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE
}

/// One end: PD, CQ (with a channel in event mode), QPs.
struct End {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    ch: Option<CompletionChannel>,
}

impl End {
    fn new(dev: &Device, cqe: usize, event: bool) -> Result<End, PerfError> {
        let pd = ProtectionDomain::new(dev);
        let ch = if event {
            Some(CompletionChannel::new(dev).map_err(io("completion channel"))?)
        } else {
            None
        };
        let cq = CompletionQueue::new(dev, cqe, ch.as_ref()).map_err(eng)?;
        Ok(End { pd, cq, ch })
    }
    fn qp(&self, p: &Params) -> Result<QueuePair, PerfError> {
        let mut attr = QpInitAttr::new(&self.cq, &self.cq);
        let wr = (p.depth as u32).saturating_mul(2) + 16;
        attr.cap.max_send_wr = wr;
        attr.cap.max_recv_wr = wr;
        attr.cap.max_inline_data = p.inline.min(256);
        let rd = (p.depth.clamp(16, 128)) as u16;
        attr.ird = rd;
        attr.ord = rd;
        QueuePair::new(&self.pd, &attr).map_err(eng)
    }
    fn mr(&self, len: usize) -> Result<MemoryRegion, PerfError> {
        let m = self.pd.register(len.max(8), access()).map_err(eng)?;
        m.fill(0);
        Ok(m)
    }
    /// Polls; in event mode sleeps on the channel when the CQ is empty.
    fn poll(&self, buf: &mut [WorkCompletion]) -> Result<usize, PerfError> {
        let k = self.cq.poll(buf);
        let Some(ch) = &self.ch else { return Ok(k) };
        if k > 0 {
            return Ok(k);
        }
        self.cq.req_notify(false).map_err(eng)?;
        let k = self.cq.poll(buf);
        if k > 0 {
            return Ok(k);
        }
        if let Ok(cq) = ch.get_event(Some(Duration::from_millis(100))) {
            cq.ack_events(1);
        }
        Ok(self.cq.poll(buf))
    }
}

fn check_wc(wc: &WorkCompletion) -> Result<(), PerfError> {
    if wc.status == WcStatus::Success {
        Ok(())
    } else {
        Err(PerfError::Engine(format!(
            "completion error: {} ({:?}, wr_id {})",
            wc.status, wc.opcode, wc.wr_id
        )))
    }
}

fn device(p: &Params) -> Result<Device, PerfError> {
    let mut cfg = DeviceConfig::default();
    cfg.force_datamover = p.force_datamover;
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

fn validate(p: &Params) -> Result<(), PerfError> {
    if p.size == 0 {
        return Err(PerfError::Usage("message size must be at least 1".into()));
    }
    if p.test == Test::Atomic && p.size != 8 {
        return Err(PerfError::Usage(
            "atomic operations are 8 bytes (-s 8)".into(),
        ));
    }
    if p.size > u32::MAX as usize {
        return Err(PerfError::Usage("message size too large".into()));
    }
    if p.depth == 0 || p.qps == 0 || p.qps > 255 {
        return Err(PerfError::Usage(
            "--depth must be at least 1 and --qps between 1 and 255".into(),
        ));
    }
    if p.duration.is_none() && p.iters == 0 {
        return Err(PerfError::Usage("--iters must be at least 1".into()));
    }
    Ok(())
}

/// Runs one softrdma measurement over loopback (both ends in-process).
///
/// # Errors
///
/// [`PerfError`] on bad parameters, engine errors, failed completions or a
/// stall of more than 10 s.
pub fn measure_rdma(p: &Params) -> Result<Measurement, PerfError> {
    validate(p)?;
    match p.mode {
        Mode::Bw => rdma_bw(p),
        Mode::Lat => match p.test {
            Test::Send => rdma_send_lat(p),
            Test::Write => rdma_write_lat(p),
            Test::Read | Test::Atomic => rdma_rtt_lat(p),
        },
    }
}

struct Pair {
    a: QueuePair,
    b: QueuePair,
    /// Remote buffer on b (shared with b's thread in write latency).
    remote: Arc<MemoryRegion>,
    /// Local buffer on a.
    local: MemoryRegion,
}

fn pairs(p: &Params, a: &End, b: &End) -> Result<Vec<Pair>, PerfError> {
    let mut v = Vec::new();
    for _ in 0..p.qps {
        let qa = a.qp(p)?;
        let qb = b.qp(p)?;
        connect_pair(&qa, &qb, &mpa(p)).map_err(eng)?;
        v.push(Pair {
            a: qa,
            b: qb,
            remote: Arc::new(b.mr(p.size)?),
            local: a.mr(p.size)?,
        });
    }
    Ok(v)
}

fn op<'a>(p: &Params, pair: &Pair) -> SendOp<'a> {
    let remote_addr = pair.remote.addr();
    let rkey = pair.remote.rkey();
    match p.test {
        Test::Write => SendOp::Write { remote_addr, rkey },
        Test::Read => SendOp::Read { remote_addr, rkey },
        Test::Send => SendOp::Send,
        Test::Atomic => SendOp::FetchAdd {
            remote_addr,
            rkey,
            add: 1,
        },
    }
}

fn rdma_bw(p: &Params) -> Result<Measurement, PerfError> {
    let dev = device(p)?;
    let cqe = p.depth * p.qps * 2 + 64;
    let a = End::new(&dev, cqe, p.event)?;
    let b = End::new(&dev, cqe, false)?;
    let pairs = pairs(p, &a, &b)?;
    let size = p.size as u32;
    let sges: Vec<[Sge; 1]> = pairs
        .iter()
        .map(|x| x.local.sge(0, size).map(|s| [s]).map_err(eng))
        .collect::<Result<_, _>>()?;
    let payload = vec![0x5au8; p.size];
    let use_inline = matches!(p.test, Test::Write | Test::Send) && size <= p.inline.min(256);

    // Receiver for Send (reposts) and the fence of Write.
    let target = Arc::new(AtomicU64::new(u64::MAX));
    let stop = Arc::new(AtomicBool::new(false));
    let rbufs: Vec<MemoryRegion> = pairs
        .iter()
        .map(|_| b.mr(p.size))
        .collect::<Result<_, _>>()?;
    let recv_per_qp = p.depth * 2 + 8;
    for (i, x) in pairs.iter().enumerate() {
        let n = if p.test == Test::Send { recv_per_qp } else { 1 };
        // At least 8 bytes: the Write fence is a 3-byte Send.
        let s = [rbufs[i].sge(0, size.max(8)).map_err(eng)?];
        for _ in 0..n {
            x.b.post_recv(&RecvWr::new(i as u64, &s)).map_err(eng)?;
        }
    }
    // Sends consume receives: the sender stays within the receives the
    // receiver has (re)posted (iWARP has no receiver-not-ready retry).
    let recvd: Arc<Vec<AtomicU64>> = Arc::new((0..p.qps).map(|_| AtomicU64::new(0)).collect());
    let mut sent = vec![0u64; p.qps];
    let receiver = {
        let recvd = recvd.clone();
        let cq = b.cq.clone();
        let qps: Vec<QueuePair> = pairs.iter().map(|x| x.b.clone()).collect();
        let sges: Vec<Sge> = rbufs
            .iter()
            .map(|m| m.sge(0, size.max(8)).map_err(eng))
            .collect::<Result<_, _>>()?;
        let target = target.clone();
        let stop = stop.clone();
        let repost = p.test == Test::Send;
        std::thread::spawn(move || -> Result<u64, PerfError> {
            let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 64];
            let mut got = 0u64;
            loop {
                let k = cq.poll(&mut buf);
                for wc in &buf[..k] {
                    check_wc(wc)?;
                    if wc.opcode == WcOpcode::Recv {
                        got += 1;
                        if repost {
                            let i = wc.wr_id as usize;
                            recvd[i].fetch_add(1, Ordering::Release);
                            let s = [sges[i]];
                            qps[i].post_recv(&RecvWr::new(i as u64, &s)).map_err(eng)?;
                        }
                    }
                }
                if got >= target.load(Ordering::Acquire) || stop.load(Ordering::Acquire) {
                    return Ok(got);
                }
                if k == 0 {
                    std::hint::spin_loop();
                }
            }
        })
    };

    let ring = (p.depth * p.qps).next_power_of_two() * 2;
    let mut post_time = vec![Instant::now(); ring];
    let mut outstanding = vec![0usize; p.qps];
    let mut lat = Vec::with_capacity(p.iters.min(10_000_000) as usize);
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 64];
    let mut dog = Watchdog::new("send completions");
    let cpu0 = cpu_time();
    let start = Instant::now();
    let limit = Limit::new(p);
    let (mut posted, mut done) = (0u64, 0u64);
    let run = (|| -> Result<(), PerfError> {
        loop {
            let mut more = limit.more(posted);
            if more {
                for (i, x) in pairs.iter().enumerate() {
                    while outstanding[i] < p.depth
                        && more
                        && (p.test != Test::Send
                            || sent[i] - recvd[i].load(Ordering::Acquire) < recv_per_qp as u64)
                    {
                        let wr = SendWr::new((posted << 8) | i as u64, op(p, x)).signaled();
                        let wr = if use_inline {
                            wr.inline(&payload)
                        } else {
                            wr.sg_list(&sges[i])
                        };
                        post_time[(posted as usize) & (ring - 1)] = Instant::now();
                        x.a.post_send(&wr).map_err(eng)?;
                        outstanding[i] += 1;
                        sent[i] += 1;
                        posted += 1;
                        more = limit.more(posted);
                    }
                }
            }
            let k = a.poll(&mut buf)?;
            if k > 0 {
                let now = Instant::now();
                for wc in &buf[..k] {
                    check_wc(wc)?;
                    let seq = wc.wr_id >> 8;
                    outstanding[(wc.wr_id & 0xff) as usize] -= 1;
                    lat.push((now - post_time[(seq as usize) & (ring - 1)]).as_secs_f64() * 1e6);
                }
                done += k as u64;
                PROGRESS.fetch_add(k as u64, Ordering::Relaxed);
                dog.kick();
            } else {
                dog.check()?;
            }
            if !more && done == posted {
                return Ok(());
            }
        }
    })();
    if let Err(e) = run {
        stop.store(true, Ordering::Release);
        let _ = receiver.join();
        return Err(e);
    }
    // Fence: Writes are placed when a following Send arrives.
    if p.test == Test::Write {
        for x in &pairs {
            x.a.post_send(&SendWr::new(u64::MAX, SendOp::Send).inline(b"end"))
                .map_err(eng)?;
        }
        target.store(p.qps as u64, Ordering::Release);
    } else if p.test == Test::Send {
        target.store(posted, Ordering::Release);
    } else {
        stop.store(true, Ordering::Release);
    }
    let wait = Instant::now();
    while !receiver.is_finished() {
        if wait.elapsed() > Duration::from_secs(10) {
            stop.store(true, Ordering::Release);
            let _ = receiver.join();
            return Err(PerfError::Timeout("the receiving side".into()));
        }
        std::thread::yield_now();
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu0;
    receiver
        .join()
        .map_err(|_| PerfError::Engine("receiver thread panicked".into()))??;
    lat.sort_by(f64::total_cmp);
    Ok(Measurement {
        size: p.size,
        iters: done,
        secs,
        lat_us: lat,
        cpu_secs: cpu,
    })
}

fn rdma_send_lat(p: &Params) -> Result<Measurement, PerfError> {
    let dev = device(p)?;
    let a = End::new(&dev, 256, p.event)?;
    let b = End::new(&dev, 256, p.event)?;
    let pairs = pairs(p, &a, &b)?;
    let x = &pairs[0];
    let size = p.size as u32;
    let ra = a.mr(p.size)?;
    let rb = b.mr(p.size)?;
    let sa = [ra.sge(0, size).map_err(eng)?];
    let sb = [rb.sge(0, size).map_err(eng)?];
    for _ in 0..8 {
        x.a.post_recv(&RecvWr::new(0, &sa)).map_err(eng)?;
        x.b.post_recv(&RecvWr::new(0, &sb)).map_err(eng)?;
    }
    let use_inline = size <= p.inline.min(256);
    let payload = vec![0x5au8; p.size];
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let stop = stop.clone();
        let qp = x.b.clone();
        let src = x.remote.sge(0, size).map_err(eng)?;
        let payload = payload.clone();
        std::thread::spawn(move || -> Result<(), PerfError> {
            let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
            let src = [src];
            while !stop.load(Ordering::Acquire) {
                let k = b.poll(&mut buf)?;
                for wc in &buf[..k] {
                    check_wc(wc)?;
                    if wc.opcode == WcOpcode::Recv {
                        qp.post_recv(&RecvWr::new(0, &sb)).map_err(eng)?;
                        let wr = SendWr::new(1, SendOp::Send).signaled();
                        let wr = if use_inline {
                            wr.inline(&payload)
                        } else {
                            wr.sg_list(&src)
                        };
                        qp.post_send(&wr).map_err(eng)?;
                    }
                }
            }
            Ok(())
        })
    };
    let src = [x.local.sge(0, size).map_err(eng)?];
    let r = ping_pong(p, |_| {
        let wr = SendWr::new(1, SendOp::Send).signaled();
        let wr = if use_inline {
            wr.inline(&payload)
        } else {
            wr.sg_list(&src)
        };
        x.a.post_send(&wr).map_err(eng)?;
        let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
        let dog = Watchdog::new("the echo");
        loop {
            let k = a.poll(&mut buf)?;
            let mut got = false;
            for wc in &buf[..k] {
                check_wc(wc)?;
                got |= wc.opcode == WcOpcode::Recv;
            }
            if got {
                x.a.post_recv(&RecvWr::new(0, &sa)).map_err(eng)?;
                return Ok(2.0);
            }
            dog.check()?;
        }
    });
    finish_echo(&stop, echo, r)
}

/// Runs `one` (one exchange; returns the divisor of its time: 2 for a
/// round trip reported as one-way latency, 1 for a full round trip) under
/// the limit of `p`, timing each.
fn ping_pong(
    p: &Params,
    mut one: impl FnMut(u64) -> Result<f64, PerfError>,
) -> Result<Measurement, PerfError> {
    let limit = Limit::new(p);
    let mut lat = Vec::new();
    let cpu0 = cpu_time();
    let start = Instant::now();
    let mut i = 0u64;
    while limit.more(i) {
        let t = Instant::now();
        let div = one(i)?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / div);
        i += 1;
        PROGRESS.fetch_add(1, Ordering::Relaxed);
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu0;
    lat.sort_by(f64::total_cmp);
    Ok(Measurement {
        size: p.size,
        iters: i,
        secs,
        lat_us: lat,
        cpu_secs: cpu,
    })
}

/// Write ping-pong: each side polls the last byte of its buffer for the
/// iteration's mark, then writes back (perftest's `ib_write_lat`).
fn rdma_write_lat(p: &Params) -> Result<Measurement, PerfError> {
    let dev = device(p)?;
    let a = End::new(&dev, 256, false)?;
    let b = End::new(&dev, 256, false)?;
    let pairs = pairs(p, &a, &b)?;
    let x = &pairs[0];
    let size = p.size as u32;
    let last = p.size - 1;
    let use_inline = size <= p.inline.min(256);
    let stop = Arc::new(AtomicBool::new(false));
    let a_buf = a.mr(p.size)?; // where b writes
    let echo = {
        let stop = stop.clone();
        let qp = x.b.clone();
        let mine = x.remote.sge(0, size).map_err(eng)?; // b's source = its own target buffer
        let (raddr, rkey) = (a_buf.addr(), a_buf.rkey());
        let watch = x.remote.clone();
        std::thread::spawn(move || -> Result<(), PerfError> {
            let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
            let mut expect = 1u8;
            let mut payload = vec![0u8; size as usize];
            let src = [mine];
            let mut b1 = [0u8; 1];
            while !stop.load(Ordering::Acquire) {
                let k = b.cq.poll(&mut buf);
                for wc in &buf[..k] {
                    check_wc(wc)?;
                }
                watch.read(last, &mut b1).map_err(eng)?;
                if b1[0] == expect {
                    let wr = SendWr::new(
                        1,
                        SendOp::Write {
                            remote_addr: raddr,
                            rkey,
                        },
                    )
                    .signaled();
                    let wr = if use_inline {
                        payload[last] = expect;
                        wr.inline(&payload)
                    } else {
                        wr.sg_list(&src)
                    };
                    qp.post_send(&wr).map_err(eng)?;
                    expect = expect % 255 + 1;
                }
            }
            Ok(())
        })
    };
    let mut payload = vec![0u8; p.size];
    let src = [x.local.sge(0, size).map_err(eng)?];
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
    let r = ping_pong(p, |i| {
        let mark = (i % 255) as u8 + 1;
        let wr = SendWr::new(
            1,
            SendOp::Write {
                remote_addr: x.remote.addr(),
                rkey: x.remote.rkey(),
            },
        )
        .signaled();
        let wr = if use_inline {
            payload[last] = mark;
            wr.inline(&payload)
        } else {
            x.local.write(last, &[mark]).map_err(eng)?;
            wr.sg_list(&src)
        };
        x.a.post_send(&wr).map_err(eng)?;
        let dog = Watchdog::new("the peer's Write");
        let mut b1 = [0u8; 1];
        loop {
            let k = a.cq.poll(&mut buf);
            for wc in &buf[..k] {
                check_wc(wc)?;
            }
            a_buf.read(last, &mut b1).map_err(eng)?;
            if b1[0] == mark {
                return Ok(2.0);
            }
            dog.check()?;
        }
    });
    finish_echo(&stop, echo, r)
}

/// Stops the echo thread of a ping-pong and combines its outcome with the
/// measurement's.
fn finish_echo(
    stop: &AtomicBool,
    echo: std::thread::JoinHandle<Result<(), PerfError>>,
    r: Result<Measurement, PerfError>,
) -> Result<Measurement, PerfError> {
    stop.store(true, Ordering::Release);
    let e = echo
        .join()
        .map_err(|_| PerfError::Engine("echo thread panicked".into()))?;
    let m = r?;
    e?;
    Ok(m)
}

/// Read / atomic latency: one operation at a time, full round trip.
fn rdma_rtt_lat(p: &Params) -> Result<Measurement, PerfError> {
    let dev = device(p)?;
    let a = End::new(&dev, 256, p.event)?;
    let b = End::new(&dev, 256, false)?;
    let pairs = pairs(p, &a, &b)?;
    let x = &pairs[0];
    let src = [x.local.sge(0, p.size as u32).map_err(eng)?];
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
    ping_pong(p, |_| {
        x.a.post_send(&SendWr::new(1, op(p, x)).sg_list(&src).signaled())
            .map_err(eng)?;
        let dog = Watchdog::new("the response");
        loop {
            let k = a.poll(&mut buf)?;
            for wc in &buf[..k] {
                check_wc(wc)?;
            }
            if k > 0 {
                return Ok(1.0);
            }
            dog.check()?;
        }
    })
}

fn tcp_pair() -> Result<(TcpStream, TcpStream), PerfError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("tcp bind"))?;
    let addr = l.local_addr().map_err(io("tcp bind"))?;
    let a = TcpStream::connect(addr).map_err(io("tcp connect"))?;
    let (b, _) = l.accept().map_err(io("tcp accept"))?;
    a.set_nodelay(true).map_err(io("nodelay"))?;
    b.set_nodelay(true).map_err(io("nodelay"))?;
    Ok((a, b))
}

/// Runs the TCP baseline of `p` (same sizes, iterations and depth; with a
/// duration, the same duration).
///
/// # Errors
///
/// [`PerfError::Io`] when a socket fails.
pub fn measure_tcp(p: &Params) -> Result<Measurement, PerfError> {
    validate(p)?;
    let (mut a, mut b) = tcp_pair()?;
    let size = p.size;
    let limit = Limit::new(p);
    let reqrep = matches!(p.test, Test::Read | Test::Atomic);
    match p.mode {
        Mode::Bw if !reqrep => {
            let done = Arc::new(AtomicU64::new(u64::MAX));
            let rx = {
                let done = done.clone();
                std::thread::spawn(move || -> std::io::Result<()> {
                    let mut buf = vec![0u8; size.max(65536)];
                    let mut got = 0u64;
                    loop {
                        if got >= done.load(Ordering::Acquire) {
                            return Ok(());
                        }
                        let n = b.read(&mut buf)?;
                        if n == 0 {
                            return Ok(());
                        }
                        got += n as u64;
                    }
                })
            };
            let data = vec![0x5au8; size];
            let cpu0 = cpu_time();
            let start = Instant::now();
            let mut i = 0u64;
            while limit.more(i) {
                a.write_all(&data).map_err(io("tcp write"))?;
                i += 1;
            }
            done.store(i * size as u64, Ordering::Release);
            // Wake the reader if it is blocked with everything read.
            a.shutdown(std::net::Shutdown::Write)
                .map_err(io("tcp shutdown"))?;
            rx.join()
                .map_err(|_| PerfError::Engine("reader panicked".into()))?
                .map_err(io("tcp read"))?;
            Ok(Measurement {
                size,
                iters: i,
                secs: start.elapsed().as_secs_f64(),
                lat_us: Vec::new(),
                cpu_secs: cpu_time() - cpu0,
            })
        }
        _ => {
            // Responder: echoes `size` bytes for each request (8 bytes for
            // read/atomic requests, `size` for ping-pong).
            let req = if reqrep { 8 } else { size };
            let server = std::thread::spawn(move || -> std::io::Result<()> {
                let mut r = vec![0u8; req];
                let resp = vec![0xa5u8; size];
                loop {
                    match b.read_exact(&mut r) {
                        Ok(()) => b.write_all(&resp)?,
                        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                        Err(e) => return Err(e),
                    }
                }
            });
            let depth = if p.mode == Mode::Bw { p.depth } else { 1 };
            let div = if reqrep { 1.0 } else { 2.0 };
            let q = vec![0x11u8; req];
            let mut r = vec![0u8; size];
            let mut times = std::collections::VecDeque::new();
            let mut lat = Vec::new();
            let cpu0 = cpu_time();
            let start = Instant::now();
            let (mut sent, mut done) = (0u64, 0u64);
            loop {
                while times.len() < depth && limit.more(sent) {
                    times.push_back(Instant::now());
                    a.write_all(&q).map_err(io("tcp write"))?;
                    sent += 1;
                }
                let Some(t) = times.pop_front() else { break };
                a.read_exact(&mut r).map_err(io("tcp read"))?;
                lat.push(t.elapsed().as_secs_f64() * 1e6 / div);
                done += 1;
            }
            let secs = start.elapsed().as_secs_f64();
            let cpu = cpu_time() - cpu0;
            a.shutdown(std::net::Shutdown::Write)
                .map_err(io("tcp shutdown"))?;
            server
                .join()
                .map_err(|_| PerfError::Engine("responder panicked".into()))?
                .map_err(io("tcp responder"))?;
            lat.sort_by(f64::total_cmp);
            Ok(Measurement {
                size,
                iters: done,
                secs,
                lat_us: lat,
                cpu_secs: cpu,
            })
        }
    }
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

/// Everything `softrdma perf` was asked to do.
#[derive(Debug, Clone)]
pub struct PerfOptions {
    /// Per-measurement parameters (`size` is replaced by each of `sizes`).
    pub params: Params,
    /// Message sizes to run.
    pub sizes: Vec<usize>,
    /// Also run the TCP baseline.
    pub baseline_tcp: bool,
    /// Output format.
    pub format: Format,
    /// Write an SVG plot here.
    pub plot: Option<PathBuf>,
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
    /// Gbit/s.
    pub gbit_s: f64,
    /// Millions of messages per second.
    pub mmsg_s: f64,
    /// Latency minimum, µs.
    pub lat_min_us: f64,
    /// Latency median, µs.
    pub lat_median_us: f64,
    /// Latency 99th percentile, µs.
    pub lat_p99_us: f64,
    /// Latency maximum, µs.
    pub lat_max_us: f64,
    /// Process CPU µs per message (both ends in loopback mode).
    pub cpu_us_per_msg: f64,
    /// TCP baseline MB/s.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_mb_s: Option<f64>,
    /// TCP baseline median latency, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tcp_lat_median_us: Option<f64>,
    /// softrdma / TCP: bandwidth ratio in bw mode, latency ratio in lat mode.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
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
    fn new(p: &Params, m: &Measurement, tcp: Option<&Measurement>) -> Row {
        let ratio = tcp.map(|t| match p.mode {
            Mode::Bw => m.mb_s() / t.mb_s().max(1e-9),
            Mode::Lat => m.lat_median() / t.lat_median().max(1e-9),
        });
        Row {
            test: p.test,
            mode: p.mode,
            size: m.size,
            iters: m.iters,
            mb_s: r3(m.mb_s()),
            gbit_s: r3(m.gbit_s()),
            mmsg_s: r3(m.mmsg_s()),
            lat_min_us: r3(m.lat_min()),
            lat_median_us: r3(m.lat_median()),
            lat_p99_us: r3(m.lat_p99()),
            lat_max_us: r3(m.lat_max()),
            cpu_us_per_msg: r3(m.cpu_us_per_msg()),
            tcp_mb_s: tcp.map(|t| r3(t.mb_s())),
            tcp_lat_median_us: tcp.map(|t| r3(t.lat_median())),
            ratio: ratio.map(r3),
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

fn human_size(n: usize) -> String {
    if n >= 1 << 20 && n.is_multiple_of(1 << 20) {
        format!("{}M", n >> 20)
    } else if n >= 1 << 10 && n.is_multiple_of(1 << 10) {
        format!("{}K", n >> 10)
    } else {
        n.to_string()
    }
}

/// Shows progress on stderr (when it is a terminal) for runs over 2 s.
struct Progress {
    stop: Arc<AtomicBool>,
    label: Arc<std::sync::Mutex<String>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Progress {
    fn start() -> Progress {
        let stop = Arc::new(AtomicBool::new(false));
        let label = Arc::new(std::sync::Mutex::new(String::new()));
        let thread = std::io::stderr().is_terminal().then(|| {
            let stop = stop.clone();
            let label = label.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let mut shown = false;
                while !stop.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(250));
                    if t0.elapsed() > Duration::from_secs(2) {
                        let l = label.lock().map(|g| g.clone()).unwrap_or_default();
                        eprint!(
                            "\r\x1b[K[{:5.1} s] {l}: {} messages",
                            t0.elapsed().as_secs_f64(),
                            PROGRESS.load(Ordering::Relaxed)
                        );
                        shown = true;
                    }
                }
                if shown {
                    eprint!("\r\x1b[K");
                }
            })
        });
        Progress {
            stop,
            label,
            thread,
        }
    }
    fn set(&self, s: String) {
        PROGRESS.store(0, Ordering::Relaxed);
        if let Ok(mut g) = self.label.lock() {
            *g = s;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

const CSV_HEADER: &str = "test,mode,size,iters,mb_s,gbit_s,mmsg_s,lat_min_us,lat_median_us,lat_p99_us,lat_max_us,cpu_us_per_msg,tcp_mb_s,tcp_lat_median_us,ratio";

fn opt(x: Option<f64>) -> String {
    x.map_or(String::new(), |v| format!("{v}"))
}

fn header(out: &mut dyn Write, o: &PerfOptions) -> std::io::Result<()> {
    match o.format {
        Format::Json => Ok(()),
        Format::Csv => writeln!(out, "{CSV_HEADER}"),
        Format::Human => {
            let p = &o.params;
            writeln!(
                out,
                "# softrdma perf {} {} (loopback), depth {}, qps {}, inline {}, CRC {}, {}{}",
                p.test.name(),
                if p.mode == Mode::Bw {
                    "bandwidth"
                } else {
                    "latency"
                },
                if p.mode == Mode::Bw { p.depth } else { 1 },
                p.qps,
                p.inline,
                if p.crc { "on" } else { "off" },
                if p.event {
                    "event-driven"
                } else {
                    "busy polling"
                },
                if p.force_datamover {
                    ", datamover forced"
                } else {
                    ""
                },
            )?;
            write!(
                out,
                "{:>8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8}",
                "size",
                "iters",
                "MB/s",
                "Gbit/s",
                "Mmsg/s",
                "min_us",
                "med_us",
                "p99_us",
                "max_us",
                "cpu_us"
            )?;
            if o.baseline_tcp {
                write!(out, " {:>10} {:>8} {:>6}", "tcp_MB/s", "tcp_med", "ratio")?;
            }
            writeln!(out)
        }
    }
}

fn line(out: &mut dyn Write, o: &PerfOptions, r: &Row) -> std::io::Result<()> {
    match o.format {
        Format::Json => {
            let s = serde_json::to_string(r).map_err(std::io::Error::other)?;
            writeln!(out, "{s}")
        }
        Format::Csv => writeln!(
            out,
            "{},{},{},{},{},{},{},{},{},{},{},{},{},{},{}",
            r.test.name(),
            if r.mode == Mode::Bw { "bw" } else { "lat" },
            r.size,
            r.iters,
            r.mb_s,
            r.gbit_s,
            r.mmsg_s,
            r.lat_min_us,
            r.lat_median_us,
            r.lat_p99_us,
            r.lat_max_us,
            r.cpu_us_per_msg,
            opt(r.tcp_mb_s),
            opt(r.tcp_lat_median_us),
            opt(r.ratio)
        ),
        Format::Human => {
            write!(
                out,
                "{:>8} {:>9} {:>10.1} {:>8.3} {:>8.3} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
                human_size(r.size),
                r.iters,
                r.mb_s,
                r.gbit_s,
                r.mmsg_s,
                r.lat_min_us,
                r.lat_median_us,
                r.lat_p99_us,
                r.lat_max_us,
                r.cpu_us_per_msg
            )?;
            if let (Some(t), Some(l), Some(q)) = (r.tcp_mb_s, r.tcp_lat_median_us, r.ratio) {
                write!(out, " {t:>10.1} {l:>8.2} {q:>6.2}")?;
            }
            writeln!(out)
        }
    }
}

/// Runs `softrdma perf` in loopback mode, writing results to `out` as they
/// come; returns the rows.
///
/// # Errors
///
/// [`PerfError`] from a measurement, the output or the plot file.
pub fn run_perf(o: &PerfOptions, out: &mut dyn Write) -> Result<Vec<Row>, PerfError> {
    for &s in &o.sizes {
        validate(&Params {
            size: s,
            ..o.params.clone()
        })?;
    }
    let progress = Progress::start();
    header(out, o).map_err(io("output"))?;
    let mut rows = Vec::new();
    for &size in &o.sizes {
        let p = Params {
            size,
            ..o.params.clone()
        };
        progress.set(format!(
            "{} {} {}",
            p.test.name(),
            human_size(size),
            if p.mode == Mode::Bw { "bw" } else { "lat" }
        ));
        let m = measure_rdma(&p)?;
        let tcp = if o.baseline_tcp {
            progress.set(format!("tcp baseline {}", human_size(size)));
            // Same number of messages as the softrdma run did.
            let tp = Params {
                iters: m.iters.max(1),
                duration: None,
                ..p.clone()
            };
            Some(measure_tcp(&tp)?)
        } else {
            None
        };
        let r = Row::new(&p, &m, tcp.as_ref());
        line(out, o, &r).map_err(io("output"))?;
        out.flush().map_err(io("output"))?;
        rows.push(r);
    }
    drop(progress);
    if let Some(path) = &o.plot {
        std::fs::write(path, svg(&rows)).map_err(io("writing the plot"))?;
    }
    Ok(rows)
}

/// A plot panel: title, softrdma value, TCP value.
type Panel = (&'static str, fn(&Row) -> f64, fn(&Row) -> Option<f64>);

/// Draws bandwidth (left) and median latency (right) against message size
/// (log2 axis), with the TCP baseline dashed when present.
pub fn svg(rows: &[Row]) -> String {
    use std::fmt::Write as _;
    const W: f64 = 440.0;
    const H: f64 = 300.0;
    const ML: f64 = 60.0;
    const MT: f64 = 30.0;
    const PW: f64 = W - ML - 20.0;
    const PH: f64 = H - MT - 50.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{H}" font-family="sans-serif" font-size="11">"#,
        2.0 * W
    );
    let _ = write!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let test = rows.first().map_or("", |r| r.test.name());
    let panels: [Panel; 2] = [
        ("bandwidth, MB/s", |r| r.mb_s, |r| r.tcp_mb_s),
        (
            "median latency, µs",
            |r| r.lat_median_us,
            |r| r.tcp_lat_median_us,
        ),
    ];
    let xs: Vec<f64> = rows.iter().map(|r| (r.size as f64).log2()).collect();
    let (x0, x1) = xs
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
    let (x0, x1) = if xs.is_empty() {
        (0.0, 1.0)
    } else if x1 - x0 < 1.0 {
        (x0 - 0.5, x1 + 0.5)
    } else {
        (x0, x1)
    };
    for (k, (title, f, g)) in panels.iter().enumerate() {
        let ox = k as f64 * W + ML;
        let ymax = rows
            .iter()
            .map(|r| f(r).max(g(r).unwrap_or(0.0)))
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.1;
        let px = |x: f64| ox + (x - x0) / (x1 - x0) * PW;
        let py = |y: f64| MT + PH - y / ymax * PH;
        let _ = write!(
            s,
            r#"<text x="{}" y="18" text-anchor="middle" font-size="13">softrdma {test}: {title}</text>"#,
            ox + PW / 2.0
        );
        let _ = write!(
            s,
            r##"<rect x="{ox}" y="{MT}" width="{PW}" height="{PH}" fill="none" stroke="#444"/>"##
        );
        for i in 0..=4 {
            let y = ymax * f64::from(i) / 4.0;
            let yy = py(y);
            let _ = write!(
                s,
                r##"<line x1="{ox}" x2="{}" y1="{yy}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                ox + PW,
                ox - 4.0,
                yy + 4.0,
                if y >= 100.0 {
                    format!("{y:.0}")
                } else {
                    format!("{y:.2}")
                },
            );
        }
        let mut e = x0.ceil() as i64;
        let step = (((x1 - x0) / 8.0).ceil() as i64).max(1);
        while (e as f64) <= x1 {
            let x = px(e as f64);
            let _ = write!(
                s,
                r#"<text x="{x}" y="{}" text-anchor="middle">{}</text>"#,
                MT + PH + 14.0,
                human_size(1usize << e.clamp(0, 62))
            );
            e += step;
        }
        let _ = write!(
            s,
            r#"<text x="{}" y="{}" text-anchor="middle">message size (bytes, log2)</text>"#,
            ox + PW / 2.0,
            MT + PH + 32.0
        );
        let mut series = |vals: Vec<Option<f64>>, color: &str, dash: &str, name: &str, n: usize| {
            let pts: Vec<String> = xs
                .iter()
                .zip(&vals)
                .filter_map(|(&x, v)| v.map(|v| format!("{:.1},{:.1}", px(x), py(v))))
                .collect();
            if pts.is_empty() {
                return;
            }
            let _ = write!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2" {dash}/>"#,
                pts.join(" ")
            );
            for pt in &pts {
                let (cx, cy) = pt.split_once(',').unwrap_or(("0", "0"));
                let _ = write!(s, r#"<circle cx="{cx}" cy="{cy}" r="2.5" fill="{color}"/>"#);
            }
            let ly = MT + 14.0 + 14.0 * n as f64;
            let _ = write!(
                s,
                r#"<text x="{}" y="{ly}" fill="{color}">{name}</text>"#,
                ox + 8.0
            );
        };
        series(
            rows.iter().map(|r| Some(f(r))).collect(),
            "#1f77b4",
            "",
            "softrdma",
            0,
        );
        if rows.iter().any(|r| g(r).is_some()) {
            series(
                rows.iter().map(g).collect(),
                "#d62728",
                r#"stroke-dasharray="5,3""#,
                "TCP",
                1,
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// The sizes of `-a`: powers of two from 2 to 8 MiB (8 only for atomic).
pub fn sweep(test: Test) -> Vec<usize> {
    if test == Test::Atomic {
        vec![8]
    } else {
        (1..=23).map(|e| 1usize << e).collect()
    }
}
