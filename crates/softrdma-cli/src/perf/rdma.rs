//! The softrdma measurement loops, one function per side: the measuring
//! side ([`Active`], [`run_active`]) and the serving side ([`Passive`],
//! [`serve`]). Loopback mode runs the serving side on a thread of the same
//! process; two-process mode runs it in the server. The loops only see
//! their own QPs, buffers and the peer's buffer addresses, plus a small
//! interface to the peer's control ([`Peer`] for the measuring side, a
//! control function for the serving side).
//!
//! Flow control of Send streams: iWARP has no receiver-not-ready retry (a
//! Send without a posted receive ends the connection), so the serving side
//! keeps [`recv_window`] receives posted per QP, reposts each one as it
//! completes, and returns credits with a small Send every
//! [`credit_batch`] receives; the sender never has more Sends out than it
//! has credits.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::{
    Access, CompletionChannel, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpInitAttr,
    QpState, QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

use super::{
    Limit, Measurement, Mode, PROGRESS, Params, PerfError, Test, Watchdog, cpu_time, device, eng,
    io, mpa, validate,
};

/// A buffer of the peer: where Writes go, where Reads and atomics come
/// from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RemoteBuf {
    /// Address (tagged offset).
    pub(super) addr: u64,
    /// STag.
    pub(super) rkey: u32,
    /// Length in bytes.
    pub(super) len: u64,
}

impl RemoteBuf {
    /// No buffer: what a side advertises where the test gives the peer no
    /// access.
    pub(super) const NONE: RemoteBuf = RemoteBuf {
        addr: 0,
        rkey: 0,
        len: 0,
    };

    fn of(m: &MemoryRegion) -> RemoteBuf {
        RemoteBuf {
            addr: m.addr(),
            rkey: m.rkey(),
            len: m.len() as u64,
        }
    }
}

/// A buffer a side needs: its length and rights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Need {
    len: usize,
    access: Access,
}

/// Rounds up to whole pages (what registering `len` bytes allocates).
fn pages(len: usize) -> u64 {
    (len.max(1) as u64).div_ceil(4096) * 4096
}

/// The measuring side's buffers per QP: the source of Writes and Sends or
/// the destination of Reads and atomics; and the sink of credits, echoes
/// and (write latency) the peer's Writes, if the test has one.
fn active_needs(p: &Params) -> (Need, Option<Need>) {
    let local = Need {
        len: p.size,
        access: match p.test {
            Test::Read | Test::Atomic => Access::LOCAL_WRITE,
            Test::Write | Test::Send => Access::NONE,
        },
    };
    let sink = match (p.mode, p.test) {
        (Mode::Bw, Test::Send) => Some(Need {
            len: 8,
            access: Access::LOCAL_WRITE,
        }),
        (Mode::Lat, Test::Send) => Some(Need {
            len: p.size,
            access: Access::LOCAL_WRITE,
        }),
        (Mode::Lat, Test::Write) => Some(Need {
            len: p.size,
            access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        }),
        _ => None,
    };
    (local, sink)
}

/// The serving side's buffers per QP: the target of the peer's operation
/// (only the right that operation needs; none in a Send stream), and the
/// receive buffer (Sends; the fence of a Write stream).
fn passive_needs(p: &Params) -> (Option<Need>, Option<Need>) {
    let buf = match (p.mode, p.test) {
        (Mode::Bw, Test::Send) => None,
        (Mode::Lat, Test::Send) => Some(Access::NONE),
        (_, Test::Write) => Some(Access::LOCAL_WRITE | Access::REMOTE_WRITE),
        (_, Test::Read) => Some(Access::REMOTE_READ),
        (_, Test::Atomic) => Some(Access::LOCAL_WRITE | Access::REMOTE_ATOMIC),
    }
    .map(|access| Need {
        len: p.size,
        access,
    });
    let rbuf = match (p.mode, p.test) {
        (_, Test::Send) => Some(p.size),
        (Mode::Bw, Test::Write) => Some(8),
        _ => None,
    }
    .map(|len| Need {
        len,
        access: Access::LOCAL_WRITE,
    });
    (buf, rbuf)
}

/// Bytes of buffers the serving side registers for `p` (all QPs).
pub(super) fn passive_bytes(p: &Params) -> u64 {
    let (buf, rbuf) = passive_needs(p);
    let per_qp: u64 = [buf, rbuf].iter().flatten().map(|n| pages(n.len)).sum();
    per_qp * p.nqps() as u64
}

/// Receives the serving side keeps posted per QP in a Send stream.
pub(super) fn recv_window(p: &Params) -> usize {
    (p.depth * 2 + 8).max(RECV_WINDOW_MIN)
}

/// The fewest receives the serving side keeps posted in a Send stream:
/// 512, as perftest's `ib_send_bw` posts (its `--rx-depth`). With only
/// `2 × depth + 8` (40 at the default depth), a sender of small messages
/// waited for a credit every ten messages, and on a busy machine each
/// credit waited for the serving thread to be scheduled: the message rate
/// measured the scheduler. 256 still cost a credit Send (and its receive
/// and completion) every 64 messages: 512 took the CPU time per 8-byte
/// message from 3.3–4.4 to 2.7–4.2 µs in four alternated runs. All
/// receives share one buffer, so the window costs no memory.
const RECV_WINDOW_MIN: usize = 512;

/// The serving side returns credits every this many receives.
pub(super) fn credit_batch(p: &Params) -> u64 {
    (recv_window(p) / 4).max(1) as u64
}

/// Credit receives the measuring side keeps posted per QP: more than can
/// be in flight (at most `recv_window / credit_batch + 1`).
fn credit_recvs(p: &Params) -> usize {
    recv_window(p) / credit_batch(p) as usize + 4
}

/// Completion queue entries of one side.
fn cqe(p: &Params) -> usize {
    (p.depth * 2 + 40 + recv_window(p)) * p.nqps() + 64
}

/// One side's PD and CQ (with a channel in event mode).
pub(super) struct End {
    pub(super) pd: ProtectionDomain,
    pub(super) cq: CompletionQueue,
    ch: Option<CompletionChannel>,
}

impl End {
    pub(super) fn new(dev: &Device, cqe: usize, event: bool) -> Result<End, PerfError> {
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
        attr.cap.max_recv_wr = wr.max(u32::try_from(recv_window(p)).unwrap_or(u32::MAX) + 16);
        attr.cap.max_inline_data = p.inline.min(256);
        let rd = p.rd();
        attr.ird = rd;
        attr.ord = rd;
        QueuePair::new(&self.pd, &attr).map_err(eng)
    }

    /// Registers `len` bytes (at least 8) with `access`, zeroed memory the
    /// kernel backs only once touched, so a large buffer costs memory only
    /// as far as the test uses it; from 2 MiB on, backed by transparent
    /// huge pages where the kernel allows it
    /// (`ProtectionDomain::register_huge`: an 8 MiB Write target took 10.6
    /// page faults per MiB instead of 1.7).
    pub(super) fn mr(&self, len: usize, access: Access) -> Result<MemoryRegion, PerfError> {
        let len = len.max(8);
        if len >= 2 << 20 {
            self.pd.register_huge(len, access).map_err(eng)
        } else {
            self.pd.register_vec(vec![0u8; len], access).map_err(eng)
        }
    }

    fn need(&self, n: Need) -> Result<MemoryRegion, PerfError> {
        self.mr(n.len, n.access)
    }

    /// Polls while the peer's Writes are polled for in memory: returns on a
    /// completion or as soon as bytes came in, busy-polling for the
    /// device's `poll_spin`, then sleeping on the sockets (at most 1 ms).
    fn poll_mem(&self, buf: &mut [WorkCompletion]) -> usize {
        self.cq.wait_progress(buf, Some(Duration::from_millis(1)))
    }

    /// Polls; in event mode sleeps on the channel when the CQ is empty.
    fn poll(&self, buf: &mut [WorkCompletion]) -> Result<usize, PerfError> {
        let Some(ch) = &self.ch else {
            // Busy-polls for the device's `poll_spin`, then sleeps until a
            // completion comes (at most 1 ms, so callers' watchdogs run).
            return Ok(self.cq.wait(buf, Some(Duration::from_millis(1))));
        };
        let k = self.cq.poll(buf);
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

impl End {
    /// A failed completion as an error that says why: the peer closed the
    /// connection or sent a Terminate, or this side sent one (from the
    /// engine's asynchronous events of the QP), else the status.
    pub(super) fn check(&self, wc: &WorkCompletion) -> Result<(), PerfError> {
        if wc.status == WcStatus::Success {
            return Ok(());
        }
        let why = crate::why::connection_end(self.cq.device(), wc.qp_num);
        Err(match (wc.status, why) {
            (WcStatus::WrFlush, Some(why)) => PerfError::Peer(why),
            (WcStatus::WrFlush, None) => PerfError::Peer(
                "the peer closed the connection (outstanding work requests were flushed)".into(),
            ),
            (status, Some(why)) => {
                PerfError::Peer(format!("{:?} failed with {status}: {why}", wc.opcode))
            }
            (status, None) => PerfError::Engine(format!(
                "completion error: {status} ({:?}, wr_id {})",
                wc.opcode, wc.wr_id
            )),
        })
    }
}

/// A refused post: when the QP has left RTS, the peer left (with the
/// reason the engine reported), else the engine's error.
fn left(qp: &QueuePair, e: impl std::fmt::Display) -> PerfError {
    if qp.state() == QpState::Rts {
        return eng(e);
    }
    PerfError::Peer(
        crate::why::connection_end(qp.device(), qp.qp_num())
            .unwrap_or_else(|| "the peer closed the connection".into()),
    )
}

fn wcs<const N: usize>() -> [WorkCompletion; N] {
    [WorkCompletion::success(0, WcOpcode::Send, 0); N]
}

/// `p.nqps()` QPs of `end`.
fn qps(end: &End, p: &Params) -> Result<Vec<QueuePair>, PerfError> {
    (0..p.nqps()).map(|_| end.qp(p)).collect()
}

/// One buffer per QP of `p` if `n` names one, else none.
fn bufs(end: &End, p: &Params, n: Option<Need>) -> Result<Vec<MemoryRegion>, PerfError> {
    match n {
        Some(n) => (0..p.nqps()).map(|_| end.need(n)).collect(),
        None => Ok(Vec::new()),
    }
}

/// The measuring side of one measurement.
pub(super) struct Active {
    pub(super) end: End,
    /// The QPs (one in latency mode).
    pub(super) qps: Vec<QueuePair>,
    /// Source of Writes and Sends, destination of Reads and atomics.
    local: Vec<MemoryRegion>,
    /// Receives (credits, echoes) and the peer's Writes (write latency);
    /// empty when the test has none.
    sink: Vec<MemoryRegion>,
    /// The peer's buffer per QP.
    pub(super) remote: Vec<RemoteBuf>,
}

impl Active {
    /// QPs (not connected) and buffers for `p`.
    pub(super) fn new(p: &Params, dev: &Device) -> Result<Active, PerfError> {
        let polls_memory = p.mode == Mode::Lat && p.test == Test::Write;
        let end = End::new(dev, cqe(p), p.event && !polls_memory)?;
        let (local, sink) = active_needs(p);
        let (qps, local, sink) = (
            qps(&end, p)?,
            bufs(&end, p, Some(local))?,
            bufs(&end, p, sink)?,
        );
        Ok(Active {
            qps,
            local,
            sink,
            remote: Vec::new(),
            end,
        })
    }

    /// The buffers the peer writes into (write latency; none otherwise),
    /// one per QP.
    pub(super) fn sinks(&self) -> Vec<RemoteBuf> {
        self.qps
            .iter()
            .enumerate()
            .map(|(i, _)| match self.sink.get(i) {
                Some(m) if m.access().contains(Access::REMOTE_WRITE) => RemoteBuf::of(m),
                _ => RemoteBuf::NONE,
            })
            .collect()
    }

    /// Posts the receives of this side; before the peer starts.
    pub(super) fn prepare(&self, p: &Params) -> Result<(), PerfError> {
        match (p.mode, p.test) {
            (Mode::Bw, Test::Send) => {
                for (i, (qp, m)) in self.qps.iter().zip(&self.sink).enumerate() {
                    let s = [m.sge(0, 8).map_err(eng)?];
                    for _ in 0..credit_recvs(p) {
                        qp.post_recv(&RecvWr::new(i as u64, &s)).map_err(eng)?;
                    }
                }
            }
            (Mode::Lat, Test::Send) => {
                let s = [self.sink[0].sge(0, p.size as u32).map_err(eng)?];
                for _ in 0..8 {
                    self.qps[0].post_recv(&RecvWr::new(0, &s)).map_err(eng)?;
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// The serving side of one measurement.
pub(super) struct Passive {
    end: End,
    /// The QPs (one in latency mode).
    pub(super) qps: Vec<QueuePair>,
    /// Target of Writes, source of Reads, atomics and echoes; empty in a
    /// Send stream.
    buf: Vec<MemoryRegion>,
    /// Receives; empty when the test has none.
    rbuf: Vec<MemoryRegion>,
    /// The measuring side's sinks (write latency writes back there).
    pub(super) remote: Vec<RemoteBuf>,
}

impl Passive {
    /// QPs (not connected) and buffers for `p`.
    pub(super) fn new(p: &Params, dev: &Device) -> Result<Passive, PerfError> {
        let end = End::new(
            dev,
            cqe(p),
            p.event && p.mode == Mode::Lat && p.test == Test::Send,
        )?;
        let (buf, rbuf) = passive_needs(p);
        let (qps, buf, rbuf) = (qps(&end, p)?, bufs(&end, p, buf)?, bufs(&end, p, rbuf)?);
        Ok(Passive {
            qps,
            buf,
            rbuf,
            remote: Vec::new(),
            end,
        })
    }

    /// The buffers the measuring side writes, reads and updates.
    pub(super) fn targets(&self) -> Vec<RemoteBuf> {
        self.qps
            .iter()
            .enumerate()
            .map(|(i, _)| match self.buf.get(i) {
                Some(m) if !m.access().intersection(Access::REMOTE).is_empty() => RemoteBuf::of(m),
                _ => RemoteBuf::NONE,
            })
            .collect()
    }

    /// Posts the receives of this side; before the peer starts.
    pub(super) fn prepare(&self, p: &Params) -> Result<(), PerfError> {
        let n = match (p.mode, p.test) {
            (Mode::Bw, Test::Send) => recv_window(p),
            // The fence of a Write stream.
            (Mode::Bw, Test::Write) => 1,
            (Mode::Lat, Test::Send) => 8,
            _ => 0,
        };
        for (i, (qp, m)) in self.qps.iter().zip(&self.rbuf).enumerate() {
            let s = [m.sge(0, m.len() as u32).map_err(eng)?];
            for _ in 0..n {
                qp.post_recv(&RecvWr::new(i as u64, &s)).map_err(eng)?;
            }
        }
        Ok(())
    }
}

/// How the serving side learns that a run is over: called in its loop,
/// returns the number of receives to wait for once the measuring side has
/// finished (0: stop now). Errors end the serving loop.
pub(super) type Control<'a> = dyn FnMut() -> Result<Option<u64>, PerfError> + 'a;

/// The serving side's loop: reposts receives and returns credits (Send
/// stream), echoes (Send and Write ping-pong), or just keeps the QPs up
/// (Reads, atomics), until `control` says the run is over and the
/// receives it names have arrived. Returns the receives completed.
pub(super) fn serve(p: &Params, s: &Passive, control: &mut Control<'_>) -> Result<u64, PerfError> {
    let size = p.size as u32;
    let rsges: Vec<Sge> = s
        .rbuf
        .iter()
        .map(|m| m.sge(0, m.len() as u32).map_err(eng))
        .collect::<Result<_, _>>()?;
    let src = match s.buf.first() {
        Some(b) => vec![b.sge(0, size).map_err(eng)?],
        None => Vec::new(),
    };
    let use_inline = size <= p.inline.min(256);
    // Only inline posts copy from it (at most 256 bytes): an 8 MiB
    // `memset` here ran beside the measuring side's clock.
    let mut payload = vec![0x5au8; if use_inline { p.size } else { 0 }];
    let last = p.size - 1;
    let mut expect = 1u8;
    let mut b1 = [0u8; 1];
    let batch = credit_batch(p);
    let mut counts = vec![0u64; s.qps.len()];
    let mut buf = wcs::<64>();
    let (mut got, mut target) = (0u64, u64::MAX);
    loop {
        let k = if p.mode == Mode::Lat && p.test == Test::Write {
            s.end.poll_mem(&mut buf)
        } else {
            s.end.poll(&mut buf)?
        };
        for wc in &buf[..k] {
            s.end.check(wc)?;
            if wc.opcode != WcOpcode::Recv {
                continue;
            }
            got += 1;
            let i = wc.wr_id as usize;
            let (Some(qp), Some(sge)) = (s.qps.get(i), rsges.get(i)) else {
                continue;
            };
            match (p.mode, p.test) {
                (Mode::Bw, Test::Send) => {
                    qp.post_recv(&RecvWr::new(i as u64, &[*sge]))
                        .map_err(|e| left(qp, e))?;
                    counts[i] += 1;
                    if counts[i].is_multiple_of(batch) {
                        let c = counts[i].to_le_bytes();
                        qp.post_send(&SendWr::new(u64::MAX, SendOp::Send).inline(&c).signaled())
                            .map_err(|e| left(qp, e))?;
                    }
                }
                (Mode::Lat, Test::Send) => {
                    qp.post_recv(&RecvWr::new(i as u64, &[*sge]))
                        .map_err(|e| left(qp, e))?;
                    let wr = SendWr::new(1, SendOp::Send).signaled();
                    let wr = if use_inline {
                        wr.inline(&payload)
                    } else {
                        wr.sg_list(&src)
                    };
                    qp.post_send(&wr).map_err(|e| left(qp, e))?;
                }
                _ => {}
            }
        }
        if p.mode == Mode::Lat && p.test == Test::Write {
            // Write ping-pong: the mark of the iteration arrives in the last
            // byte; write it back (the buffer is also the source).
            s.buf[0].read(last, &mut b1).map_err(eng)?;
            if b1[0] == expect {
                let r = s.remote[0];
                let wr = SendWr::new(
                    1,
                    SendOp::Write {
                        remote_addr: r.addr,
                        rkey: r.rkey,
                    },
                )
                .signaled();
                let wr = if use_inline {
                    payload[last] = expect;
                    wr.inline(&payload)
                } else {
                    wr.sg_list(&src)
                };
                s.qps[0].post_send(&wr).map_err(|e| left(&s.qps[0], e))?;
                expect = expect % 255 + 1;
            }
        }
        if let Some(t) = control()? {
            target = t;
        }
        if got >= target {
            return Ok(got);
        }
    }
}

/// The measuring side's view of the serving side at the end of a run.
pub(super) trait Peer {
    /// The run is over: the serving side has `recvs` receives to wait for
    /// (the fences of a Write stream, the messages of a Send stream, 0
    /// otherwise). Returns once it has them.
    fn finish(&mut self, recvs: u64) -> Result<(), PerfError>;

    /// Called often during the run: tells the serving side that the
    /// measuring side is still there (a heartbeat every
    /// [`HEARTBEAT`]), and fails if the serving side gave up.
    fn alive(&mut self) -> Result<(), PerfError> {
        Ok(())
    }
}

/// Interval of the measuring side's heartbeats in two-process mode: a
/// server that hears nothing from its client for its `--timeout` ends the
/// run (a client that went silent, a network partition without a reset).
pub(super) const HEARTBEAT: Duration = Duration::from_millis(250);

/// Calls [`Peer::alive`] once per [`HEARTBEAT`], cheaply enough for the
/// measuring loops.
struct Beat {
    last: Instant,
    calls: u32,
}

impl Beat {
    fn new() -> Beat {
        Beat {
            last: Instant::now(),
            calls: 0,
        }
    }
    fn tick(&mut self, peer: &mut dyn Peer) -> Result<(), PerfError> {
        self.calls = self.calls.wrapping_add(1);
        if self.calls.is_multiple_of(16) && self.last.elapsed() >= HEARTBEAT {
            self.last = Instant::now();
            peer.alive()?;
        }
        Ok(())
    }
}

/// Runs the measuring side of `p`.
pub(super) fn run_active(
    p: &Params,
    a: &Active,
    peer: &mut dyn Peer,
) -> Result<Measurement, PerfError> {
    match p.mode {
        Mode::Bw => active_bw(p, a, peer),
        Mode::Lat => {
            let m = match p.test {
                Test::Send => send_lat(p, a, peer)?,
                Test::Write => write_lat(p, a, peer)?,
                Test::Read | Test::Atomic => rtt_lat(p, a, peer)?,
            };
            peer.finish(0)?;
            Ok(m)
        }
    }
}

fn op<'a>(p: &Params, r: &RemoteBuf) -> SendOp<'a> {
    let (remote_addr, rkey) = (r.addr, r.rkey);
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

/// Bandwidth: `depth` operations outstanding per QP; latencies are post
/// to completion. The clock stops when the serving side has everything
/// (Write: the fence Sends behind the Writes arrived; Send: every message).
fn active_bw(p: &Params, a: &Active, peer: &mut dyn Peer) -> Result<Measurement, PerfError> {
    let n = a.qps.len();
    let size = p.size as u32;
    let sges: Vec<[Sge; 1]> = a
        .local
        .iter()
        .map(|m| m.sge(0, size).map(|s| [s]).map_err(eng))
        .collect::<Result<_, _>>()?;
    let credit_sges: Vec<[Sge; 1]> = a
        .sink
        .iter()
        .map(|m| m.sge(0, 8).map(|s| [s]).map_err(eng))
        .collect::<Result<_, _>>()?;
    let use_inline = matches!(p.test, Test::Write | Test::Send) && size <= p.inline.min(256);
    // Only inline posts copy from it (at most 256 bytes).
    let payload = vec![0x5au8; if use_inline { p.size } else { 0 }];
    let batch = credit_batch(p);
    let mut credit = vec![recv_window(p) as u64; n];
    let mut sent = vec![0u64; n];
    let ring = (p.depth * n).next_power_of_two() * 2;
    let mut post_time = vec![Instant::now(); ring];
    let mut outstanding = vec![0usize; n];
    let mut lat = Vec::with_capacity(p.iters.min(10_000_000) as usize);
    let mut buf = wcs::<64>();
    let mut dog = Watchdog::new("send completions", p.timeout);
    let cpu0 = cpu_time();
    let start = Instant::now();
    let limit = Limit::new(p);
    let (mut posted, mut done) = (0u64, 0u64);
    let mut beat = Beat::new();
    loop {
        beat.tick(peer)?;
        let mut more = limit.more(posted);
        if more {
            for (i, qp) in a.qps.iter().enumerate() {
                while outstanding[i] < p.depth
                    && more
                    && (p.test != Test::Send || sent[i] < credit[i])
                {
                    let wr = SendWr::new((posted << 8) | i as u64, op(p, &a.remote[i])).signaled();
                    let wr = if use_inline {
                        wr.inline(&payload)
                    } else {
                        wr.sg_list(&sges[i])
                    };
                    post_time[(posted as usize) & (ring - 1)] = Instant::now();
                    qp.post_send(&wr).map_err(|e| left(qp, e))?;
                    outstanding[i] += 1;
                    sent[i] += 1;
                    posted += 1;
                    more = limit.more(posted);
                }
            }
        }
        let k = a.end.poll(&mut buf)?;
        if k > 0 {
            let now = Instant::now();
            for wc in &buf[..k] {
                a.end.check(wc)?;
                if wc.opcode == WcOpcode::Recv {
                    // Credits from the serving side.
                    let i = wc.wr_id as usize;
                    if let (Some(c), Some(s)) = (credit.get_mut(i), credit_sges.get(i)) {
                        *c += batch;
                        a.qps[i]
                            .post_recv(&RecvWr::new(i as u64, s))
                            .map_err(|e| left(&a.qps[i], e))?;
                    }
                    continue;
                }
                let seq = wc.wr_id >> 8;
                let i = (wc.wr_id & 0xff) as usize;
                if let Some(o) = outstanding.get_mut(i) {
                    *o = o.saturating_sub(1);
                }
                lat.push((now - post_time[(seq as usize) & (ring - 1)]).as_secs_f64() * 1e6);
                done += 1;
                PROGRESS.fetch_add(1, Ordering::Relaxed);
            }
            dog.kick();
        } else {
            dog.check()?;
        }
        if !more && done == posted {
            break;
        }
    }
    let recvs = match p.test {
        Test::Write => {
            // Fence: the Writes are placed when the Send behind them arrives.
            for qp in &a.qps {
                qp.post_send(&SendWr::new(u64::MAX, SendOp::Send).inline(b"end"))
                    .map_err(|e| left(qp, e))?;
            }
            n as u64
        }
        Test::Send => posted,
        Test::Read | Test::Atomic => 0,
    };
    peer.finish(recvs)?;
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu0;
    lat.sort_by(f64::total_cmp);
    Ok(Measurement {
        size: p.size,
        iters: done,
        secs,
        lat_us: lat,
        cpu_secs: cpu,
    })
}

/// Runs `one` (one exchange; returns the divisor of its time: 2 for a
/// round trip reported as one-way latency, 1 for a full round trip) under
/// the limit of `p`, timing each.
fn ping_pong(
    p: &Params,
    peer: &mut dyn Peer,
    mut one: impl FnMut(u64, &mut dyn FnMut() -> Result<(), PerfError>) -> Result<f64, PerfError>,
) -> Result<Measurement, PerfError> {
    let limit = Limit::new(p);
    let mut beat = Beat::new();
    let mut lat = Vec::new();
    let cpu0 = cpu_time();
    let start = Instant::now();
    let mut i = 0u64;
    while limit.more(i) {
        let t = Instant::now();
        let div = one(i, &mut || beat.tick(peer))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / div);
        beat.tick(peer)?;
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

/// Send/Recv ping-pong, RTT/2.
fn send_lat(p: &Params, a: &Active, peer: &mut dyn Peer) -> Result<Measurement, PerfError> {
    let qp = &a.qps[0];
    let size = p.size as u32;
    let src = [a.local[0].sge(0, size).map_err(eng)?];
    let sink = [a.sink[0].sge(0, size).map_err(eng)?];
    let use_inline = size <= p.inline.min(256);
    let payload = vec![0x5au8; p.size];
    let mut buf = wcs::<16>();
    ping_pong(p, peer, |_, alive| {
        let wr = SendWr::new(1, SendOp::Send).signaled();
        let wr = if use_inline {
            wr.inline(&payload)
        } else {
            wr.sg_list(&src)
        };
        qp.post_send(&wr).map_err(|e| left(qp, e))?;
        let dog = Watchdog::new("the echo", p.timeout);
        loop {
            let k = a.end.poll(&mut buf)?;
            let mut got = false;
            for wc in &buf[..k] {
                a.end.check(wc)?;
                got |= wc.opcode == WcOpcode::Recv;
            }
            if got {
                qp.post_recv(&RecvWr::new(0, &sink))
                    .map_err(|e| left(qp, e))?;
                return Ok(2.0);
            }
            dog.check()?;
            alive()?;
        }
    })
}

/// Write ping-pong: each side polls the last byte of its buffer for the
/// iteration's mark, then writes back (perftest's `ib_write_lat`); RTT/2.
fn write_lat(p: &Params, a: &Active, peer: &mut dyn Peer) -> Result<Measurement, PerfError> {
    let qp = &a.qps[0];
    let (local, sink, remote) = (&a.local[0], &a.sink[0], a.remote[0]);
    let size = p.size as u32;
    let last = p.size - 1;
    let use_inline = size <= p.inline.min(256);
    let mut payload = vec![0u8; p.size];
    let src = [local.sge(0, size).map_err(eng)?];
    let mut buf = wcs::<16>();
    ping_pong(p, peer, |i, alive| {
        let mark = (i % 255) as u8 + 1;
        let wr = SendWr::new(
            1,
            SendOp::Write {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
        )
        .signaled();
        let wr = if use_inline {
            payload[last] = mark;
            wr.inline(&payload)
        } else {
            local.write(last, &[mark]).map_err(eng)?;
            wr.sg_list(&src)
        };
        qp.post_send(&wr).map_err(|e| left(qp, e))?;
        let dog = Watchdog::new("the peer's Write", p.timeout);
        let mut b1 = [0u8; 1];
        loop {
            let k = a.end.poll_mem(&mut buf);
            for wc in &buf[..k] {
                a.end.check(wc)?;
            }
            sink.read(last, &mut b1).map_err(eng)?;
            if b1[0] == mark {
                return Ok(2.0);
            }
            dog.check()?;
            alive()?;
        }
    })
}

/// Read / atomic latency: one operation at a time, full round trip.
fn rtt_lat(p: &Params, a: &Active, peer: &mut dyn Peer) -> Result<Measurement, PerfError> {
    let qp = &a.qps[0];
    let src = [a.local[0].sge(0, p.size as u32).map_err(eng)?];
    let mut buf = wcs::<16>();
    ping_pong(p, peer, |_, alive| {
        qp.post_send(&SendWr::new(1, op(p, &a.remote[0])).sg_list(&src).signaled())
            .map_err(|e| left(qp, e))?;
        let dog = Watchdog::new("the response", p.timeout);
        loop {
            let k = a.end.poll(&mut buf)?;
            for wc in &buf[..k] {
                a.end.check(wc)?;
            }
            if k > 0 {
                return Ok(1.0);
            }
            dog.check()?;
            alive()?;
        }
    })
}

/// The serving side on a thread of this process.
struct LocalPeer {
    /// Receives to wait for; `u64::MAX` while the run goes on.
    target: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<u64, PerfError>>>,
    timeout: Duration,
}

impl LocalPeer {
    fn join(&mut self) -> Result<(), PerfError> {
        let Some(t) = self.thread.take() else {
            return Ok(());
        };
        t.join()
            .map_err(|_| PerfError::Engine("the serving thread panicked".into()))?
            .map(|_| ())
    }
}

impl Peer for LocalPeer {
    fn finish(&mut self, recvs: u64) -> Result<(), PerfError> {
        self.target.store(recvs, Ordering::Release);
        let wait = Instant::now();
        while self.thread.as_ref().is_some_and(|t| !t.is_finished()) {
            if wait.elapsed() > self.timeout {
                self.target.store(0, Ordering::Release);
                let _ = self.join();
                return Err(PerfError::Timeout("the receiving side".into()));
            }
            std::thread::yield_now();
        }
        self.join()
    }
}

impl Drop for LocalPeer {
    /// Ends the serving thread when the measuring side failed.
    fn drop(&mut self) {
        self.target.store(0, Ordering::Release);
        let _ = self.join();
    }
}

/// Runs one softrdma measurement over loopback (both ends in-process,
/// connected over 127.0.0.1).
///
/// # Errors
///
/// [`PerfError`] on bad parameters, engine errors, failed completions or a
/// stall longer than `p.timeout`.
pub fn measure_rdma(p: &Params) -> Result<Measurement, PerfError> {
    validate(p)?;
    let dev = device(p)?;
    let mut a = Active::new(p, &dev)?;
    let mut b = Passive::new(p, &dev)?;
    for (qa, qb) in a.qps.iter().zip(&b.qps) {
        connect_pair(qa, qb, &mpa(p)).map_err(eng)?;
    }
    a.remote = b.targets();
    b.remote = a.sinks();
    a.prepare(p)?;
    b.prepare(p)?;
    let target = Arc::new(AtomicU64::new(u64::MAX));
    let thread = {
        let target = target.clone();
        let p = p.clone();
        std::thread::spawn(move || {
            let mut control = || {
                Ok(match target.load(Ordering::Acquire) {
                    u64::MAX => None,
                    t => Some(t),
                })
            };
            serve(&p, &b, &mut control)
        })
    };
    let mut peer = LocalPeer {
        target,
        thread: Some(thread),
        timeout: p.timeout,
    };
    run_active(p, &a, &mut peer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn receive_only_buffers_had_remote_access() {
        let p = |test, mode| Params {
            test,
            mode,
            size: 1 << 20,
            ..Params::default()
        };
        // A Send stream: no target buffer, receives without remote rights.
        let (buf, rbuf) = passive_needs(&p(Test::Send, Mode::Bw));
        assert!(buf.is_none());
        assert_eq!(rbuf.unwrap().access, Access::LOCAL_WRITE);
        // Each one-sided test grants only its own right.
        let right = |t| passive_needs(&p(t, Mode::Bw)).0.unwrap().access;
        assert_eq!(
            right(Test::Write),
            Access::LOCAL_WRITE | Access::REMOTE_WRITE
        );
        assert_eq!(right(Test::Read), Access::REMOTE_READ);
        assert_eq!(
            right(Test::Atomic),
            Access::LOCAL_WRITE | Access::REMOTE_ATOMIC
        );
        // The measuring side exposes a sink only for write latency.
        assert!(active_needs(&p(Test::Write, Mode::Bw)).1.is_none());
        assert!(active_needs(&p(Test::Read, Mode::Lat)).1.is_none());
        let sink = active_needs(&p(Test::Write, Mode::Lat)).1.unwrap();
        assert!(sink.access.contains(Access::REMOTE_WRITE));
        let sink = active_needs(&p(Test::Send, Mode::Lat)).1.unwrap();
        assert_eq!(sink.access, Access::LOCAL_WRITE);
    }

    #[test]
    fn one_request_made_the_server_allocate_8_gib() {
        // 4 QPs x 1 GiB write bandwidth: one 1 GiB target per QP and an
        // 8-byte fence receive, not two 1 GiB buffers each.
        let p = Params {
            size: 1 << 30,
            qps: 4,
            ..Params::default()
        };
        assert_eq!(passive_bytes(&p), 4 * ((1 << 30) + 4096));
        let send = Params {
            test: Test::Send,
            ..p
        };
        assert_eq!(passive_bytes(&send), 4 << 30);
    }
}
