//! SDP over a softrdma queue pair: one offloaded connection.
//!
//! The kernel TCP connection is switched into RDMA mode with the engine's
//! transition ([`StreamConnection`]): an MPA exchange whose private data
//! carries the SDP Hello (client) and HelloAck (server). From then on the
//! QP owns the socket; this module keeps a duplicate descriptor of it for
//! names, options and `AsRawFd`.
//!
//! Buffered copy: receives of `buf_size` octets are posted, 8 at first
//! and the rest of the `rx_bufs` ring once the connection has received
//! 512 KiB of data (bulk transfers get the credits, short connections do
//! not set them up); a
//! Data message is copied into a send staging buffer, its BSDH written in
//! front, and sent when the credits allow ([`crate::sdp::Session`]); a
//! small write with nothing queued before it and no cork goes out at once
//! as an inline Data message instead (header and payload copied into the
//! send request). The application reads straight out of the receive
//! buffers, which are reposted once read (they are the socket receive
//! buffer).
//!
//! Progress: completions are processed by whichever thread calls in. A
//! blocked call (after `Config::spin` of busy polling) waits in the CQ
//! itself ([`CompletionQueue::wait`]) if no other thread does: the engine
//! then sleeps in `poll(2)` on the QP's socket and runs the receive path
//! in this thread when bytes come, so a message reaches a blocked reader
//! with one wake-up and no thread hand-off. When nothing but bytes can
//! end its wait (see `Shared::may_sleep_in_recv`), it sleeps in the
//! socket's `recv` instead ([`WaitSet::wait_receiving`]): one system call
//! per wait, as a blocking TCP read. That thread holds the
//! connection's `poller` gate while it waits, handles what it took out of
//! the CQ, updates the readiness descriptor and async wakers, and wakes
//! the calls that sleep meanwhile (a `try_clone`d writer, say); one of
//! them drives next. When a readiness descriptor is registered, an async
//! task waits, or data waits for credits, and no call is blocked, the
//! CQ's completion callback on the engine's handler thread does the same.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, OnceLock, Weak};
use std::time::{Duration, Instant};

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::transition::{MpaRole, StreamConnection, SwitchMode, TransitionError};
use softrdma_engine::wait_set::{WaitError, WaitSet};
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpCap,
    QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
};

use crate::config::Config;
use crate::sdp::{
    self, AVAIL_LEN, Action, Avail, BSDH_LEN, CAP_READ_ZCOPY, Hello, HelloAck, Message, Session,
};

mod exit;

const SEND_DATA: u64 = 1 << 32;
const SEND_CTRL: u64 = 2 << 32;
/// The RDMA Read of a zero-copy transfer (at most one at a time).
const ZC_READ: u64 = 3 << 32;
/// A read buffer smaller than this (and than the rest of the peer's
/// SrcAvail) is not worth an RDMA Read round trip: the reader asks for
/// buffered copy (SendSm) instead.
const ZC_MIN_CHUNK: usize = 128 * 1024;
/// Largest write sent inline (header and payload copied into the send
/// request; see `Shared::send_small`); the QP's `max_inline_data` is
/// this plus the header.
const INLINE_PAYLOAD: usize = 240;
/// Receive buffers a connection starts with (at most `Config::rx_bufs`):
/// the rest of the ring is posted once the connection has received
/// [`RING_GROW_AFTER`] octets of data, so that a short connection does not
/// post (and set up) a bulk transfer's ring.
const RX_INITIAL: usize = 8;
/// Data octets received before the receive ring grows to `Config::rx_bufs`
/// (eight full messages of the default size).
const RING_GROW_AFTER: u64 = 512 * 1024;
/// Completions a connection's CQ has room for beyond its posted receives
/// and its send buffers: the send queue's other requests (`sq_cap` is the
/// send buffers and 6 more; the zero-copy Read; an AbortConn) and a margin.
const CQ_SPARE: usize = 16;

/// Entries of a connection's CQ while `rx_slots` receive buffers are in
/// use: every posted receive and every outstanding send completes once
/// and is taken from the CQ before its buffer is posted again (a receive)
/// or counted free (`State::tx_inflight`), so this many can be queued at
/// most. The CQ is exclusive (a fixed ring, see
/// `CqBuilder::exclusive`), so it is made for the full ring at set-up: 84
/// slots for the default ring and 4 send buffers (152 before this bound).
fn cq_entries(rx_slots: usize, tx_bufs: usize) -> usize {
    rx_slots + tx_bufs + CQ_SPARE
}

/// Large writes copied without an offer after the peer declined one.
const ZC_SKIP_AFTER_DECLINE: u32 = 64;
/// Longest time corked data is held (`TCP_CORK`), as the kernel's
/// ceiling (`tcp(7)`).
const CORK_MAX: Duration = Duration::from_millis(200);

/// The engine device shared by the offloaded connections of the process,
/// opened on first use with unpinned threads (a library lives inside
/// someone else's process).
struct Engine {
    pd: ProtectionDomain,
}

fn engine() -> io::Result<&'static Engine> {
    static ENGINE: OnceLock<Result<Engine, String>> = OnceLock::new();
    let e = ENGINE.get_or_init(|| {
        let mut cfg = DeviceConfig::default();
        cfg.pin_threads = false;
        cfg.name = "softrdma-sd".to_string();
        // A blocked call busy-polls for `Config::spin` itself (none by
        // default) before it waits in the CQ: the engine's wait must not
        // add its own busy poll (on a busy machine it took the CPU from
        // the thread that would send the answer: 64 B ping-pong 38 µs
        // instead of 9 µs).
        cfg.poll_spin = Duration::ZERO;
        match Device::open_with(cfg) {
            Ok(dev) => Ok(Engine { pd: dev.alloc_pd() }),
            Err(e) => Err(e.to_string()),
        }
    });
    e.as_ref()
        .map_err(|e| io::Error::other(format!("softrdma engine: {e}")))
}

/// Registered buffer regions of closed connections, kept for the next
/// ones: registering (allocating and zeroing) the 768 KiB of a default
/// connection took about 240 µs of its setup, and unmapping a region at
/// close 7–12 µs (half of it the TLB shoot-down on the other CPUs).
///
/// The pool follows the working set: of each size (a connection takes a
/// receive and a send region) it keeps as many regions as the most
/// connections this process had open at once, at least [`MR_POOL_MIN`]
/// (one count per size: when a connection's receive and send regions
/// have the same size, half as many connections), so that a server whose
/// clients come and go in waves (redis-benchmark's 50) finds every new
/// connection's regions there. It is bounded by memory twice: a region is
/// kept only if what its connection can have touched of it
/// ([`PooledMr::resident_max`]) is at most [`POOL_REGION_RESIDENT_MAX`]
/// (a connection that took regions from the pool then stays under the
/// 1 MiB per idle connection; a bulk connection's grown receive ring is
/// unmapped), and the pool's regions together at most [`POOL_RESIDENT_MAX`].
const MR_POOL_MIN: usize = 16;

/// The most a pooled region can hold resident (see [`MR_POOL_MIN`]).
const POOL_REGION_RESIDENT_MAX: usize = 640 * 1024;

/// The most the pool's regions together can hold resident.
const POOL_RESIDENT_MAX: usize = 64 * 1024 * 1024;

#[derive(Debug, Default)]
struct MrPool {
    /// Each region with its registered length and the most of it that
    /// can be resident. The length is kept here: asking a region for it
    /// takes the engine's STag table lock, and every return to the pool
    /// asked each pooled region twice: the 102 regions of 51 connections
    /// closing made 10 004 look-ups (0.84 M instructions of the 18.3 M of
    /// a preloaded `redis-benchmark -n 800 -c 50 -t get -P 16`,
    /// `valgrind --tool=callgrind`).
    regions: Vec<Pooled>,
    /// Sum of the regions' resident bounds.
    resident: usize,
}

/// A region in the pool.
#[derive(Debug)]
struct Pooled {
    mr: MemoryRegion,
    /// `mr.len()`, its registered length.
    len: usize,
    /// The most of it that can be resident.
    resident: usize,
}

fn mr_pool() -> &'static Mutex<MrPool> {
    static POOL: OnceLock<Mutex<MrPool>> = OnceLock::new();
    POOL.get_or_init(|| Mutex::new(MrPool::default()))
}

/// Offloaded connections open now, and the most open at once (sizes the
/// pool; see [`MR_POOL_MIN`]).
static LIVE_CONNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
static PEAK_CONNS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

fn conn_opened() {
    let live = LIVE_CONNS.fetch_add(1, Ordering::Relaxed) + 1;
    PEAK_CONNS.fetch_max(live, Ordering::Relaxed);
}

fn conn_closed() {
    LIVE_CONNS.fetch_sub(1, Ordering::Relaxed);
}

/// How many regions of one size the pool keeps at most now.
fn pool_max_regions() -> usize {
    PEAK_CONNS.load(Ordering::Relaxed).max(MR_POOL_MIN)
}

impl MrPool {
    fn take(&mut self, len: usize) -> Option<MemoryRegion> {
        let i = self.regions.iter().position(|p| p.len == len)?;
        let p = self.regions.swap_remove(i);
        self.resident -= p.resident;
        Some(p.mr)
    }

    /// Regions of registered length `len` in the pool.
    fn count(&self, len: usize) -> usize {
        self.regions.iter().filter(|p| p.len == len).count()
    }

    /// Keeps `mr` if the bounds allow (`max_regions` of its size); else it
    /// is handed back, for the caller to unregister (drop) after it let
    /// go of the pool's lock (an unmap takes microseconds).
    #[must_use]
    fn give(
        &mut self,
        mr: MemoryRegion,
        resident: usize,
        max_regions: usize,
    ) -> Option<MemoryRegion> {
        let len = mr.len();
        let resident = resident.min(len);
        if resident <= POOL_REGION_RESIDENT_MAX
            && self.resident + resident <= POOL_RESIDENT_MAX
            && self.count(len) < max_regions
        {
            self.resident += resident;
            self.regions.push(Pooled { mr, len, resident });
            None
        } else {
            Some(mr)
        }
    }
}

/// A buffer region that goes back to the pool when its connection ended
/// cleanly (its QP idle or in error, so no receive can still land in it and
/// no send still reads it; a new user overwrites what it sends and reads
/// only what arrived, so old contents never leave the process).
#[derive(Debug)]
struct PooledMr {
    mr: Option<MemoryRegion>,
    reusable: std::sync::atomic::AtomicBool,
    /// The most of the region its users can have touched (made resident),
    /// in octets: the whole region unless the connection says less.
    resident_max: std::sync::atomic::AtomicUsize,
}

impl PooledMr {
    fn take(pd: &ProtectionDomain, len: usize) -> Result<PooledMr, softrdma_engine::mr::RegError> {
        let pooled = mr_pool().lock().take(len);
        let mr = match pooled {
            Some(mr) => mr,
            None => pd.register(len, Access::LOCAL_WRITE)?,
        };
        Ok(PooledMr {
            mr: Some(mr),
            reusable: std::sync::atomic::AtomicBool::new(false),
            resident_max: std::sync::atomic::AtomicUsize::new(len),
        })
    }
}

impl std::ops::Deref for PooledMr {
    type Target = MemoryRegion;
    fn deref(&self) -> &MemoryRegion {
        self.mr.as_ref().expect("region")
    }
}

impl Drop for PooledMr {
    fn drop(&mut self) {
        if self.reusable.load(Ordering::Relaxed)
            && let Some(mr) = self.mr.take()
        {
            let resident = self.resident_max.load(Ordering::Relaxed);
            let max = pool_max_regions();
            let rejected = mr_pool().lock().give(mr, resident, max);
            drop(rejected);
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        conn_closed();
        let done = matches!(
            self.qp.state(),
            softrdma_engine::QpState::Idle | softrdma_engine::QpState::Error
        );
        // Receives land only in the slots posted at least once (a buffer
        // fills from its start, so one that took only small messages
        // touched a page or two of it; the bound counts it whole).
        let rx_slots = self.st.get_mut().rx_slots as usize;
        self.rx_mr
            .resident_max
            .store(rx_slots.saturating_mul(self.buf_size), Ordering::Relaxed);
        self.rx_mr.reusable.store(done, Ordering::Relaxed);
        self.tx_mr.reusable.store(done, Ordering::Relaxed);
    }
}

/// Why an offload setup failed (before any application data).
#[derive(Debug, thiserror::Error)]
pub(crate) enum SetupError {
    /// Local resources (engine, QP, memory).
    #[error("local resources: {0}")]
    Local(String),
    /// The switch into RDMA mode failed (the TCP connection is torn down).
    #[error("switch to RDMA mode: {0}")]
    Switch(#[from] TransitionError),
    /// The peer's Hello/HelloAck is wrong (the connection was reset).
    #[error("peer's SDP hello: {0}")]
    Hello(#[from] sdp::ProtocolError),
}

fn local(e: impl std::fmt::Display) -> SetupError {
    SetupError::Local(e.to_string())
}

/// A received message waiting for the application.
#[derive(Debug)]
struct RxMsg {
    slot: u32,
    /// Next unread octet (offset in the receive region).
    pos: usize,
    /// End of the payload (offset in the receive region).
    end: usize,
    /// A zero-copy offer (SrcAvail) instead of buffered data (`slot`,
    /// `pos` and `end` unused).
    zc: Option<ZcRx>,
}

/// The peer's SrcAvail, as the reader works through it.
#[derive(Debug, Clone, Copy)]
struct ZcRx {
    avail: Avail,
    /// Octets RDMA-Read so far.
    done: u32,
    /// The peer withdrew the offer (SrcAvailCancel) while a read of it
    /// was under way: acknowledge with SendSm once that read is done.
    cancelled: bool,
}

/// Our outstanding SrcAvail (a zero-copy write waits on it).
#[derive(Debug, Clone, Copy)]
struct ZcTx {
    len: u32,
    /// Octets the peer reported read (RdmaRdCompl).
    read: u32,
    /// The peer asked for buffered copy (or acknowledged our cancel).
    send_sm: bool,
}

/// Readiness descriptor: a datagram socket pair; `app` is given out.
#[derive(Debug)]
struct Readiness {
    app: UnixDatagram,
    lib: UnixDatagram,
    readable: bool,
    writable: bool,
}

impl Readiness {
    fn new() -> io::Result<Readiness> {
        let (app, lib) = UnixDatagram::pair()?;
        app.set_nonblocking(true)?;
        lib.set_nonblocking(true)?;
        // A tiny send buffer on `app`: a few token datagrams make it
        // unwritable.
        socket2::SockRef::from(&app).set_send_buffer_size(1)?;
        Ok(Readiness {
            app,
            lib,
            readable: false,
            writable: true,
        })
    }

    fn set(&mut self, readable: bool, writable: bool) {
        // Best effort: a failure here only affects wake-ups, never data.
        if readable != self.readable {
            if readable {
                let _ = self.lib.send(&[1]);
            } else {
                let mut b = [0u8; 8];
                while self.app.recv(&mut b).is_ok() {}
            }
            self.readable = readable;
        }
        if writable != self.writable {
            if writable {
                let mut b = [0u8; 8];
                while self.lib.recv(&mut b).is_ok() {}
            } else {
                for _ in 0..1024 {
                    if self.app.send(&[0]).is_err() {
                        break;
                    }
                }
            }
            self.writable = writable;
        }
    }
}

#[derive(Debug)]
struct State {
    sdp: Session,
    rx: VecDeque<RxMsg>,
    tx_free: Vec<u32>,
    /// Filled staging buffers not yet sent (slot, payload length); the
    /// last one may still be appended to.
    tx_queue: VecDeque<(u32, usize)>,
    tx_inflight: u32,
    disconn_wanted: bool,
    /// The exit flush wants the DisConn (`disconn_wanted` is its): a
    /// write of another thread meanwhile is no error (see `exit`).
    exit_flush: bool,
    /// Link lost (flushed work, QP no longer accepting work): messages
    /// that completed before are still delivered; then calls fail.
    link: Option<LinkLost>,
    /// First error: later calls report it.
    err: Option<(io::ErrorKind, String)>,
    rd_shut: bool,
    wr_shut: bool,
    nodelay: bool,
    /// `TCP_CORK`: a partial buffer is held (even with `nodelay`, and with
    /// nothing in flight) until the cork is taken out, the buffer fills,
    /// or it has been held for [`CORK_MAX`].
    cork: bool,
    /// When the held data was first seen corked (for [`CORK_MAX`]).
    corked_at: Option<Instant>,
    /// The last flush stopped at a buffer held by the cork alone: no
    /// completion event is needed to send it (taking the cork out does).
    cork_held: bool,
    /// Send a corked buffer now (flush requested).
    push: bool,
    /// The `poller` gate: held by whoever takes completions out of the
    /// CQ, from the poll until they are handled under this lock (so they
    /// are handled in order). A blocked call holds it while it waits in
    /// the CQ ([`CompletionQueue::wait`]), driving the receive path in its
    /// own thread; the others only try it: if it is taken, its holder
    /// handles the completions, syncs the readiness descriptor and wakes
    /// sleepers. It is the wait set (this connection's CQ) its holder
    /// sleeps in, taken out (`None`: held) and put back under this lock:
    /// every try is made, and every release, with this lock held, so a
    /// flag under it serves as a mutex would, without the two locked
    /// instructions of a mutex's try and release per wait.
    poller: Option<Box<WaitSet>>,
    waiters: u32,
    /// The call driving the connection (holding `poller`) sleeps in the
    /// QP's socket's `recv` ([`WaitSet::wait_receiving`]): it holds no
    /// completion taken out of the CQ, and a completion pushed meanwhile
    /// does not wake it, so whoever holds this lock handles completions
    /// without `poller` (see [`Shared::progress`]).
    recv_sleeping: bool,
    /// Waits made in the socket's `recv` (see [`recv_sleeps`]).
    recv_sleeps: u64,
    /// Receive completions the wait in `recv` handed straight to its
    /// caller (`WaitSet::wait_receiving_handed`) instead of the CQ.
    handed_back: u64,
    /// Completions handled so far: a call that let go of the lock while
    /// waiting sees from it that another thread (the one driving the
    /// connection, or the callback) handled some, and looks again.
    handled: u64,
    /// The CQ is armed (a completion will run the callback).
    armed: bool,
    ready: Option<Readiness>,
    /// The readiness descriptor is brought up to date by its waiters
    /// ([`crate::poll`]): no CQ arm for it (see `set_readiness_polled`).
    ready_polled: bool,
    /// Async tasks waiting to read / to write (woken when that becomes
    /// possible; see [`Offload::poll_ready`]).
    wakers: [Option<std::task::Waker>; 2],
    /// Our SrcAvail while a zero-copy write waits for the peer.
    zc_tx: Option<ZcTx>,
    /// Result of the zero-copy RDMA Read in flight (octets, or why not).
    zc_read_done: Option<Result<usize, String>>,
    /// A reader is RDMA-Reading the front SrcAvail (the state lock is let
    /// go while it waits).
    zc_reading: bool,
    /// Large writes still to copy without offering zero copy, after the
    /// peer declined an offer without reading any of it (its reader uses
    /// small buffers, peeks or does not block: each offer would cost a
    /// round trip for nothing).
    zc_skip: u32,
    /// Offers the peer declined without reading (SendSm), for tests.
    zc_declined: u64,
    /// Writes sent inline (`Shared::send_small`), for tests.
    inline_sends: u64,
    /// Of those, the ones whose completion came back from the post
    /// (`QueuePair::post_send_now`), for tests.
    direct_sends: u64,
    /// The application read data since its last write: the next small
    /// write answers it and may complete in the call (`send_small`). A
    /// write that follows a write goes the usual way, its completion
    /// handled later, so that a stream of small writes without
    /// `TCP_NODELAY` is still held behind the one in flight and sent
    /// together, and posts made with `TCP_NODELAY` are still batched by
    /// the engine.
    read_since_write: bool,
    /// Receive buffers in use (posted at least once): slots `0..rx_slots`.
    rx_slots: u32,
    /// Data octets received (until the ring is full grown).
    rx_data: u64,
    /// Control messages (RdmaRdCompl, SendSm, SrcAvailCancel) waiting for
    /// a credit.
    ctrl_pending: VecDeque<Message>,
    #[cfg(test)]
    test: TestHooks,
}

/// Misbehaviour switches for tests.
#[cfg(test)]
#[derive(Debug, Default, Clone)]
struct TestHooks {
    /// As a receiver: keep SrcAvail offers without ever reading them or
    /// answering a cancel (their adverts are kept in `ignored`).
    ignore_src_avail: bool,
    ignored: Vec<Avail>,
    /// As a receiver: answer a SrcAvail with a RdmaRdCompl for more than
    /// it offered.
    overread_src_avail: bool,
}

impl State {
    fn failed(&self) -> bool {
        self.err.is_some() || self.link.is_some()
    }

    fn link_lost(&mut self, why: impl Into<LinkLost>) {
        if self.link.is_none() {
            self.link = Some(why.into());
        }
    }

    /// The error a call reports: a protocol error or reset first, else a
    /// lost link.
    fn error(&self) -> Option<io::Error> {
        if let Some((k, m)) = &self.err {
            return Some(io::Error::new(*k, m.clone()));
        }
        self.link
            .as_ref()
            .map(|m| io::Error::new(io::ErrorKind::ConnectionReset, m.to_string()))
    }
}

/// Why the link was lost, said in words only when a call reports it:
/// every connection loses its link at the close (the receives still
/// posted are flushed, a repost is refused), and formatting the message
/// there cost about 2 000 instructions a connection for a message that is
/// rarely read.
#[derive(Debug, Clone, PartialEq, Eq)]
enum LinkLost {
    /// A work request completed with this status (not success).
    Status(WcStatus),
    /// A receive buffer could not be posted again.
    PostRecv(softrdma_engine::qp::PostRecvError),
    /// Anything else.
    Message(String),
}

impl std::fmt::Display for LinkLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkLost::Status(s) => write!(f, "connection lost ({})", s.name()),
            LinkLost::PostRecv(e) => e.fmt(f),
            LinkLost::Message(m) => f.write_str(m),
        }
    }
}

impl From<String> for LinkLost {
    fn from(m: String) -> LinkLost {
        LinkLost::Message(m)
    }
}

/// An offloaded (SDP) connection. Clones share it.
#[derive(Debug, Clone)]
pub(crate) struct Offload {
    sh: Arc<Shared>,
    /// Held by the application's handles only: the last one closes the
    /// connection, in the application's thread.
    _close: Arc<CloseOnDrop>,
}

/// Closes the connection when the application's last handle goes.
///
/// Not `Drop` of [`Shared`]: the completion callback upgrades its weak
/// reference while it runs, so the last strong reference can be the
/// engine's handler thread's. A close there ran (DisConn, lingering)
/// while the application's thread went on, and a process exiting right
/// after closing its stream killed it halfway: the peer saw the TCP
/// connection end without a DisConn, and lost the data still queued.
#[derive(Debug)]
struct CloseOnDrop(Arc<Shared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        // Connections closed earlier whose peer's FIN came since.
        exit::reap_closing();
        if let Some(deadline) = self.0.close() {
            // Our DisConn and FIN are out; the peer's FIN is waited for
            // after the call returns (`exit::defer_fin`), or here when the
            // list of such connections is full or no exit flush would wait
            // for it at the exit.
            if !exit::defer_fin(&self.0, deadline) {
                let mut st = self.0.lock();
                self.0.wait_fin(&mut st, deadline);
            }
        }
        // After the close (an exit meanwhile still flushes it).
        exit::unregister(&self.0);
    }
}

#[derive(Debug)]
struct Shared {
    qp: QueuePair,
    cq: CompletionQueue,
    // After `qp` (fields drop in order): the QP is gone before the
    // regions go back to the pool.
    rx_mr: PooledMr,
    /// The receive region's whole span: a slot's SGE is its part (no look
    /// at the region's table entry per repost; the post checks it as it
    /// checks every SGE).
    rx_span: softrdma_engine::Sge,
    tx_mr: PooledMr,
    buf_size: usize,
    crc: bool,
    /// We offered Read zero copy (we accept SrcAvail).
    zc_recv: bool,
    /// The peer offered it too: large blocking writes use it.
    zc_send: bool,
    zc_threshold: usize,
    zc_timeout: Duration,
    /// Receive buffers of a full ring (`Config::rx_bufs`); the connection
    /// starts with fewer (see [`RX_INITIAL`]).
    rx_max: u32,
    /// Send staging buffers (`Config::tx_bufs`; the CQ's size counts them).
    tx_bufs: usize,
    /// Largest write sent inline (see `Shared::send_small`).
    inline_max: usize,
    /// Sends (`State::tx_inflight`) the send queue takes: its depth less
    /// room for the zero-copy Read and a reset's AbortConn. While this
    /// many are outstanding, small writes wait in staging buffers and
    /// control messages wait for the next `flush_tx`.
    sq_cap: u32,
    spin: Duration,
    linger: Duration,
    /// Duplicate of the kernel socket (the QP owns the original).
    sock: TcpStream,
    st: Mutex<State>,
    /// A completion event whose callback found the state locked: the
    /// thread holding the lock handles it when it lets go.
    event_pending: AtomicBool,
    /// Polls of the CQ made beside a call that sleeps in `recv`
    /// (`State::recv_sleeping`), counted before each such poll: that call
    /// does not sleep once one was made since it let the state lock go
    /// (what it waits for may have been taken in by the poll).
    polled_beside: AtomicU64,
    /// Messages received and failed completions handled so far (see
    /// [`Offload::arrivals`]).
    arrivals: AtomicU64,
    /// Wakes sleeping calls: (receiving end polled by them, sending end).
    /// Made by the first call that sleeps while another drives the
    /// connection (most connections never have two calls blocked at once:
    /// five system calls per connection saved).
    waker: OnceLock<(UnixDatagram, UnixDatagram)>,
    /// A blocked call may sleep in the QP's socket's `recv` (see
    /// [`Shared::wait_inner`]); off for descriptors the application owns
    /// ([`Offload::no_recv_sleep`]).
    recv_sleep: AtomicBool,
}

/// The locked state of a connection. Letting go of it (dropping it, or
/// [`unlocked`](Self::unlocked)) handles a completion event whose
/// callback found the lock taken (see [`Shared::on_event`]).
struct Locked<'a> {
    sh: &'a Shared,
    g: Option<MutexGuard<'a, State>>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.g.as_ref().expect("locked")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.g.as_mut().expect("locked")
    }
}

impl Locked<'_> {
    /// Handles pending events (the lock is held).
    fn settle(&mut self) {
        let sh = self.sh;
        // A load first: a swap is a locked instruction, and the flag is
        // rarely set (every lock held and let go settles, several times
        // per message). A load that reads false is ordered before the
        // callback's store as a swap that returns false would be.
        while sh.event_pending.load(Ordering::SeqCst)
            && sh.event_pending.swap(false, Ordering::SeqCst)
        {
            sh.handle_event(self);
        }
    }

    /// Runs `f` without the lock.
    fn unlocked<R>(&mut self, f: impl FnOnce() -> R) -> R {
        self.settle();
        let g = self.g.as_mut().expect("locked");
        let r = MutexGuard::unlocked(g, f);
        self.settle();
        r
    }

    /// Runs `f` without the lock, giving it a way to take the lock back
    /// before it returns: a try (it never waits), which `f` may call
    /// (`true`: the lock is this holder's again, and nobody else holds it
    /// from then on). Otherwise the lock is taken once `f` has returned.
    /// Unlike [`unlocked`](Self::unlocked), events are not settled after:
    /// the caller settles once it has handled what `f` returned (an event
    /// handled first would poll the CQ ahead of it).
    fn unlocked_taking_back<R>(&mut self, f: impl FnOnce(&mut dyn FnMut() -> bool) -> R) -> R {
        self.settle();
        let sh = self.sh;
        self.g = None;
        // Held again when `f` returns or unwinds (as `unlocked` does).
        let back = TakeBack { sh, g: &mut self.g };
        f(&mut || {
            if back.g.is_none() {
                *back.g = sh.st.try_lock();
            }
            back.g.is_some()
        })
    }
}

/// The lock of [`Locked::unlocked_taking_back`] (its guard's place `g`):
/// taken back by the try, or else when this is dropped.
struct TakeBack<'l, 'a> {
    sh: &'a Shared,
    g: &'l mut Option<MutexGuard<'a, State>>,
}

impl Drop for TakeBack<'_, '_> {
    fn drop(&mut self) {
        if self.g.is_none() {
            *self.g = Some(self.sh.st.lock());
        }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // Settle, bring the readiness descriptor (and the arm it needs) up
        // to date with whatever this holder changed, let go, then look
        // again: a callback that failed to take the lock before it was
        // released set the flag before trying, so it is seen here.
        self.settle();
        if self.ready.is_some() {
            let sh = self.sh;
            sh.after(self);
        }
        self.g = None;
        while self.sh.event_pending.load(Ordering::SeqCst) {
            match self.sh.st.try_lock() {
                Some(g) => {
                    self.g = Some(g);
                    self.settle();
                    self.g = None;
                }
                // Another thread holds it and will look when it lets go.
                None => break,
            }
        }
    }
}

impl Offload {
    /// Switches a connected stream into RDMA mode and sets up SDP.
    /// `initiator`: the connecting side (sends the Hello).
    pub(crate) fn establish(
        stream: TcpStream,
        initiator: bool,
        cfg: &Config,
        known: &crate::net::Known,
    ) -> Result<Offload, SetupError> {
        Self::begin(stream, initiator, cfg, known)?.finish()
    }

    /// Starts the switch of a connected stream: the resources are made and
    /// the MPA frame (the initiator's Request with the Hello, or the
    /// responder's Reply) is written; [`Begun::poll`] or [`Begun::finish`]
    /// ends it once the peer's frame is in.
    pub(crate) fn begin(
        stream: TcpStream,
        initiator: bool,
        cfg: &Config,
        known: &crate::net::Known,
    ) -> Result<Begun, SetupError> {
        cfg.checked().map_err(local)?;
        // Connections closed earlier whose peer's FIN came since: their
        // regions go back to the pool before this one takes its own.
        exit::reap_closing();
        let eng = engine().map_err(local)?;
        let dev = eng.pd.device().clone();
        let rx_bufs = usize::from(cfg.rx_bufs);
        let tx_bufs = usize::from(cfg.tx_bufs);
        let size = cfg.buf_size;
        let slot: Arc<OnceLock<Weak<Shared>>> = Arc::new(OnceLock::new());
        let cb_slot = slot.clone();
        // The ring posted at first; grown with it.
        let initial = rx_bufs.min(RX_INITIAL.max(usize::from(crate::sdp::MIN_RING)));
        // Exclusive: the connection's QP is its only user and every poll is
        // made under the connection's lock (a fixed ring without a lock,
        // and sends that complete in the writing call: `send_small`). A
        // fixed ring cannot grow with the receive ring: it is made for the
        // full ring's completions (`cq_entries`).
        let cq = CompletionQueue::builder(&dev, cq_entries(rx_bufs, tx_bufs))
            .exclusive()
            .callback(move |cq| {
                if let Some(sh) = cb_slot.get().and_then(Weak::upgrade) {
                    sh.on_event(cq);
                }
            })
            .build()
            .map_err(local)?;
        let mut attr = QpInitAttr::new(&cq, &cq);
        attr.cap = QpCap {
            // `Shared::sq_cap` sends, the zero-copy Read, an AbortConn.
            max_send_wr: u32::try_from(tx_bufs + 8).unwrap_or(u32::MAX),
            max_recv_wr: u32::try_from(rx_bufs).unwrap_or(u32::MAX),
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: ((BSDH_LEN + INLINE_PAYLOAD) as u32).min(dev.attr().max_inline_data),
        };
        // Every receive is slot `i`'s buffer, posted again as it is
        // consumed (`Shared::repost`): the engine keeps the checked buffer
        // and skips the key's look-up.
        attr.keep_recvs = true;
        let inline_max = (attr.cap.max_inline_data as usize).saturating_sub(BSDH_LEN);
        let qp = QueuePair::new(&eng.pd, &attr).map_err(local)?;
        let rx_mr = PooledMr::take(&eng.pd, rx_bufs * size).map_err(local)?;
        let rx_span = rx_mr
            .sge(0, u32::try_from(rx_bufs * size).map_err(local)?)
            .map_err(local)?;
        // Slot `i`'s buffer, from the span checked above (as
        // `Shared::repost` does): no look-up of the region's key per slot.
        let slot_sge = |i: usize| softrdma_engine::Sge {
            addr: rx_span.addr + (i * size) as u64,
            length: size as u32,
            lkey: rx_span.lkey,
        };
        let post_rx = |i: usize| -> Result<(), SetupError> {
            qp.post_recv(&RecvWr::new(i as u64, &[slot_sge(i)]))
                .map_err(local)?;
            Ok(())
        };
        // The MPA frame goes out as early as it can, and the resources it
        // does not need are made while it travels. The responder's switch
        // may end as soon as its Reply is written (no RTR to wait for), so
        // all its receives are posted first; the initiator's cannot end
        // before the peer's Reply, so it posts all but the first later.
        let early = if initiator { 1 } else { initial };
        for i in 0..early - 1 {
            post_rx(i)?;
        }
        let dup = stream.try_clone().map_err(local)?;
        // The addresses go into the initiator's Hello; the responder needs
        // only the family, which a known peer address tells (a socket's
        // local and peer addresses have the same family): no system call.
        // (A connect to the unspecified address reaches a local one: the
        // kernel says which.)
        let peer = known.peer.filter(|p| !p.ip().is_unspecified());
        let (local_addr, peer_addr) = match (initiator, peer) {
            (true, Some(p)) => (stream.local_addr(), Ok(p)),
            (true, None) => (stream.local_addr(), stream.peer_addr()),
            (false, Some(p)) => (Err(io::ErrorKind::Unsupported.into()), Ok(p)),
            (false, None) => (stream.local_addr(), Err(io::ErrorKind::Unsupported.into())),
        };
        let v6 = |a: &io::Result<std::net::SocketAddr>| a.as_ref().is_ok_and(|a| a.is_ipv6());
        let ipv = if v6(&local_addr) || v6(&peer_addr) {
            0x60
        } else {
            0x40
        };
        let zc = cfg.zcopy_threshold > 0;
        let cap = if zc { CAP_READ_ZCOPY } else { 0 };
        let private_data = if initiator {
            let addr16 = |a: &std::io::Result<std::net::SocketAddr>| match a {
                Ok(std::net::SocketAddr::V4(v4)) => v4.ip().to_ipv6_mapped().octets(),
                Ok(std::net::SocketAddr::V6(v6)) => v6.ip().octets(),
                Err(_) => [0; 16],
            };
            Hello {
                bufs: initial as u16,
                ipv_cap: ipv | cap,
                max_adverts: u8::from(zc),
                desremrcvsz: size as u32,
                localrcvsz: size as u32,
                port: local_addr.as_ref().map(|a| a.port()).unwrap_or(0),
                src_addr: addr16(&local_addr),
                dst_addr: addr16(&peer_addr),
            }
            .encode()
            .to_vec()
        } else {
            HelloAck {
                bufs: initial as u16,
                ipv_cap: ipv | cap,
                ext_max_adverts: u8::from(zc),
                actrcvsz: size as u32,
            }
            .encode()
            .to_vec()
        };
        let config = MpaConfig {
            crc: if cfg.crc {
                CrcPolicy::Required
            } else {
                CrcPolicy::AcceptIfAsked
            },
            ..MpaConfig::default()
        };
        let mut sc = StreamConnection::new(
            stream,
            SwitchMode::Mpa {
                role: if initiator {
                    MpaRole::Initiator
                } else {
                    MpaRole::Responder
                },
                config,
                private_data,
            },
        );
        sc.set_switch_timeout(cfg.setup_timeout);
        sc.socket_already_set(known.nodelay, known.nonblocking);
        // The QP's peer for its `query`: the one known or asked above.
        if let Ok(p) = peer_addr {
            sc.peer_already_known(p);
        }
        sc.reserve(&qp)?;
        sc.request_switch()?;
        let first = early - 1;
        let switched =
            sc.post_recv_and_begin_switch(&RecvWr::new(first as u64, &[slot_sge(first)]))?;
        // While the peer answers.
        for i in early..initial {
            if let Err(e) = post_rx(i) {
                qp.abort();
                return Err(e);
            }
        }
        let tx_mr = PooledMr::take(&eng.pd, tx_bufs * size).map_err(|e| {
            qp.abort();
            local(e)
        })?;
        Ok(Begun {
            parts: Some(BegunParts {
                sc,
                qp,
                cq,
                rx_mr,
                rx_span,
                tx_mr,
                dup,
                slot,
                initiator,
                initial,
                inline_max,
                zc,
                cfg: cfg.clone(),
            }),
            switched,
        })
    }
}

/// A switch started by [`Offload::begin`]: the frame of this side is
/// written, the peer's is awaited. Dropped unfinished, the QP is aborted
/// (the peer sees its connection reset).
#[derive(Debug)]
pub(crate) struct Begun {
    /// Taken by [`Begun::finish`].
    parts: Option<BegunParts>,
    switched: bool,
}

#[derive(Debug)]
struct BegunParts {
    sc: StreamConnection,
    qp: QueuePair,
    cq: CompletionQueue,
    rx_mr: PooledMr,
    rx_span: softrdma_engine::Sge,
    tx_mr: PooledMr,
    dup: TcpStream,
    slot: Arc<OnceLock<Weak<Shared>>>,
    initiator: bool,
    initial: usize,
    inline_max: usize,
    zc: bool,
    cfg: Config,
}

impl Drop for Begun {
    fn drop(&mut self) {
        if let Some(p) = self.parts.take() {
            p.qp.abort();
        }
    }
}

impl Begun {
    /// Advances the switch without blocking: whether the peer's frame is
    /// in (then [`finish`](Self::finish) does not wait). Fails as the
    /// switch does (its time limit included).
    pub(crate) fn poll(&mut self) -> Result<bool, SetupError> {
        if !self.switched {
            let Some(p) = self.parts.as_mut() else {
                return Err(SetupError::Local("switch already finished".into()));
            };
            self.switched = p.sc.poll_switch()?;
        }
        Ok(self.switched)
    }

    /// The socket the switch waits on, and whether it waits for room to
    /// write (else for octets to read); `None` once switched.
    pub(crate) fn wait_on(&self) -> Option<(std::os::fd::BorrowedFd<'_>, bool)> {
        if self.switched {
            return None;
        }
        let p = self.parts.as_ref()?;
        p.sc.switch_fd().map(|fd| (fd, p.sc.switch_wants_write()))
    }

    /// Waits for the end of the switch (at most its time limit) and sets
    /// up SDP.
    pub(crate) fn finish(mut self) -> Result<Offload, SetupError> {
        while !self.poll()? {
            if let Some((fd, write)) = self.wait_on() {
                let flags = if write {
                    rustix::event::PollFlags::OUT
                } else {
                    rustix::event::PollFlags::IN
                };
                let mut fds = [rustix::event::PollFd::new(&fd, flags)];
                // The switch's own deadline ends it; this only bounds one
                // sleep.
                let ts = rustix::time::Timespec {
                    tv_sec: 0,
                    tv_nsec: 100_000_000,
                };
                let _ = rustix::event::poll(&mut fds, Some(&ts));
            }
        }
        let Some(p) = self.parts.take() else {
            return Err(SetupError::Local("switch already finished".into()));
        };
        p.setup()
    }
}

impl BegunParts {
    /// SDP over the switched QP.
    fn setup(self) -> Result<Offload, SetupError> {
        let BegunParts {
            sc,
            qp,
            cq,
            rx_mr,
            rx_span,
            tx_mr,
            dup,
            slot,
            initiator,
            initial,
            inline_max,
            zc,
            cfg,
        } = self;
        let cfg = &cfg;
        let rx_bufs = usize::from(cfg.rx_bufs);
        let tx_bufs = usize::from(cfg.tx_bufs);
        let size = cfg.buf_size;
        let n = sc
            .negotiated()
            .ok_or_else(|| SetupError::Local("no negotiation result".into()))?;
        let crc = n.crc;
        let peer = &n.peer_private_data;
        let (peer_bufs, peer_rcv, peer_cap) = if initiator {
            match HelloAck::decode(peer) {
                Ok(a) => (a.bufs, a.actrcvsz, a.ipv_cap),
                Err(e) => {
                    qp.abort();
                    return Err(e.into());
                }
            }
        } else {
            match Hello::decode(peer) {
                Ok(h) => (h.bufs, h.localrcvsz, h.ipv_cap),
                Err(e) => {
                    qp.abort();
                    return Err(e.into());
                }
            }
        };
        // We never send more than our own staging buffer holds.
        let peer_rcv = peer_rcv.min(size as u32);
        let session = Session::new(initial as u16, size as u32, peer_bufs, peer_rcv);
        let mut poller_set = Box::new(WaitSet::new());
        poller_set.add_cq(&cq);
        conn_opened();
        let sh = Arc::new(Shared {
            qp,
            cq,
            rx_mr,
            rx_span,
            tx_mr,
            buf_size: size,
            crc,
            zc_recv: zc,
            zc_send: zc && peer_cap & CAP_READ_ZCOPY != 0,
            zc_threshold: cfg.zcopy_threshold.max(1),
            rx_max: rx_bufs as u32,
            tx_bufs,
            zc_timeout: cfg.zcopy_timeout,
            inline_max,
            sq_cap: u32::try_from(tx_bufs + 6).unwrap_or(u32::MAX),
            spin: cfg.spin,
            linger: cfg.linger,
            sock: dup,
            st: Mutex::new(State {
                sdp: session,
                rx: VecDeque::new(),
                tx_free: (0..u32::from(cfg.tx_bufs)).rev().collect(),
                tx_queue: VecDeque::new(),
                tx_inflight: 0,
                disconn_wanted: false,
                exit_flush: false,
                err: None,
                link: None,
                rd_shut: false,
                wr_shut: false,
                nodelay: false,
                cork: false,
                corked_at: None,
                cork_held: false,
                push: false,
                poller: Some(poller_set),
                waiters: 0,
                recv_sleeping: false,
                recv_sleeps: 0,
                handed_back: 0,
                handled: 0,
                armed: false,
                ready: None,
                ready_polled: false,
                wakers: [None, None],
                zc_tx: None,
                zc_read_done: None,
                zc_reading: false,
                zc_skip: 0,
                zc_declined: 0,
                inline_sends: 0,
                direct_sends: 0,
                read_since_write: false,
                rx_slots: initial as u32,
                rx_data: 0,
                ctrl_pending: VecDeque::new(),
                #[cfg(test)]
                test: TestHooks::default(),
            }),
            event_pending: AtomicBool::new(false),
            polled_beside: AtomicU64::new(0),
            arrivals: AtomicU64::new(0),
            waker: OnceLock::new(),
            recv_sleep: AtomicBool::new(true),
        });
        let _ = slot.set(Arc::downgrade(&sh));
        // Flushed at `exit(3)` until closed (see `exit`).
        exit::register(&sh);
        {
            // Messages that arrived with the switch (the read-ahead the
            // engine processed when it took the stream over) are in the
            // CQ. No receive attempt: bytes still in the socket wake the
            // first wait, and an attempt here mostly found nothing (a
            // `recvfrom` saying EAGAIN per connection).
            let mut st = sh.lock();
            sh.progress_completions(&mut st, false);
        }
        Ok(Offload {
            _close: Arc::new(CloseOnDrop(sh.clone())),
            sh,
        })
    }
}

impl Offload {
    /// MPA CRC in use.
    pub(crate) fn crc(&self) -> bool {
        self.sh.crc
    }

    /// Read zero copy in use (both ends offered it).
    pub(crate) fn zero_copy(&self) -> bool {
        self.sh.zc_send
    }

    /// Blocked calls never sleep in the socket's `recv`: the descriptor
    /// is the application's (an interposed one), whose `O_NONBLOCK` the
    /// engine must not clear (see [`Shared::wait_inner`]).
    pub(crate) fn no_recv_sleep(&self) {
        self.sh.recv_sleep.store(false, Ordering::Relaxed);
    }

    /// The duplicate kernel socket (names, options, descriptor).
    pub(crate) fn socket(&self) -> &TcpStream {
        &self.sh.sock
    }

    pub(crate) fn read(
        &self,
        buf: &mut [u8],
        peek: bool,
        nonblocking: bool,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        self.read_as(buf, peek, nonblocking, timeout, false)
    }

    /// [`read`](Self::read) by the connection's only handle, borrowed
    /// exclusively (`Read` of a `&mut TcpStream` that has no clones): no
    /// other thread can make a call on the connection until it returns,
    /// so nothing that wakes no sleeper (another call's `shutdown(Read)`,
    /// its corked or queued data, a readiness descriptor or task it
    /// registers) can happen meanwhile, and a sleep in the socket's `recv`
    /// needs no time limit (see [`wait_holding`](Shared::wait_holding)).
    /// A clone made before counts (the handles' close guard is shared);
    /// none can be made during the call.
    pub(crate) fn read_sole(
        &self,
        buf: &mut [u8],
        nonblocking: bool,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let sole = Arc::strong_count(&self._close) == 1;
        self.read_as(buf, false, nonblocking, timeout, sole)
    }

    fn read_as(
        &self,
        buf: &mut [u8],
        peek: bool,
        nonblocking: bool,
        timeout: Option<Duration>,
        sole: bool,
    ) -> io::Result<usize> {
        let sh = &*self.sh;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = sh.lock();
        loop {
            // A blocking read that finds nothing waits, and the wait looks
            // at the CQ and the socket itself: no receive attempt here.
            if st.rx.is_empty() {
                if nonblocking {
                    sh.progress(&mut st);
                } else if !sh.cq.is_empty() {
                    sh.progress_completions(&mut st, true);
                }
            }
            if st.rd_shut || buf.is_empty() {
                return Ok(0);
            }
            if st.rx.front().is_some_and(|m| m.zc.is_some()) {
                match sh.read_zc(&mut st, buf, peek, nonblocking, deadline)? {
                    Some(n) => return Ok(n),
                    None => continue,
                }
            }
            if !st.rx.is_empty() {
                let n = if peek {
                    sh.peek_rx(&st, buf)
                } else {
                    sh.take_rx(&mut st, buf)
                };
                sh.after(&mut st);
                return Ok(n);
            }
            if st.sdp.close.peer_disconn {
                return Ok(0);
            }
            if let Some(e) = st.error() {
                return Err(e);
            }
            match sh.wait_inner(&mut st, nonblocking, deadline, false, sole) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                r => r?,
            }
        }
    }

    pub(crate) fn write(
        &self,
        buf: &[u8],
        nonblocking: bool,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        self.write_vectored(&[io::IoSlice::new(buf)], nonblocking, timeout)
    }

    /// A gathering write: the pieces are copied straight into the send
    /// staging buffers (or an inline message), as one write of their
    /// concatenation would be; returns the octets taken (a prefix of the
    /// concatenation). Zero copy (SrcAvail) is offered for a single piece
    /// only.
    pub(crate) fn write_vectored(
        &self,
        bufs: &[io::IoSlice<'_>],
        nonblocking: bool,
        timeout: Option<Duration>,
    ) -> io::Result<usize> {
        let total: usize = bufs.iter().map(|b| b.len()).sum();
        let sh = &*self.sh;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = sh.lock();
        let reply = std::mem::take(&mut st.read_since_write);
        // Completions are only looked at when the buffers are full: the
        // fast path is a copy and a post.
        let mut polled = false;
        let mut zc_ok = sh.zc_send && !nonblocking && bufs.len() == 1 && total >= sh.zc_threshold;
        loop {
            if st.exit_flush && !st.wr_shut {
                // The process is exiting: accepted until the exit flush's
                // DisConn goes (sent before it, by copy: no zero copy
                // offer may follow the DisConn), then dropped (see `exit`),
                // also once the peer has closed in turn.
                zc_ok = false;
                if st.sdp.close.local_disconn || st.disconn_wanted && st.failed() {
                    drop(st);
                    return exit::write_after_exit_flush(total);
                }
            } else if st.wr_shut || st.sdp.close.local_disconn || st.disconn_wanted {
                return Err(io::Error::new(
                    io::ErrorKind::BrokenPipe,
                    "connection shut down for writing",
                ));
            }
            if let Some(e) = st.error() {
                return Err(e);
            }
            if total == 0 {
                return Ok(0);
            }
            if st.zc_tx.is_some() {
                // Another thread's zero-copy write is under way: the
                // stream's order is its order.
                sh.wait(&mut st, nonblocking, deadline)?;
                continue;
            }
            if zc_ok && st.zc_skip > 0 {
                st.zc_skip -= 1;
                zc_ok = false;
            }
            if zc_ok {
                if !st.tx_queue.is_empty() {
                    // Buffered data first (the SrcAvail follows it).
                    st.push = true;
                    sh.flush_tx(&mut st);
                    if !st.tx_queue.is_empty() {
                        sh.wait(&mut st, false, deadline)?;
                        continue;
                    }
                }
                match sh.write_zc(&mut st, &bufs[0], deadline)? {
                    // The peer asked for buffered copy: this call copies,
                    // and the next large writes do not offer.
                    0 => {
                        zc_ok = false;
                        st.zc_declined += 1;
                        st.zc_skip = ZC_SKIP_AFTER_DECLINE;
                    }
                    n => {
                        sh.after(&mut st);
                        return Ok(n);
                    }
                }
                continue;
            }
            if sh.send_small(&mut st, bufs, total, reply) {
                sh.after(&mut st);
                return Ok(total);
            }
            let n = sh.fill_tx(&mut st, bufs);
            if n > 0 {
                sh.flush_tx(&mut st);
                sh.after(&mut st);
                return Ok(n);
            }
            if !polled {
                polled = true;
                sh.progress(&mut st);
                continue;
            }
            polled = false;
            sh.wait(&mut st, nonblocking, deadline)?;
        }
    }

    /// Lets corked data go out as soon as credits allow (the completion
    /// callback sends it), without waiting.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn push(&self) -> io::Result<()> {
        let sh = &*self.sh;
        let mut st = sh.lock();
        if let Some(e) = st.error() {
            return Err(e);
        }
        st.push = true;
        sh.flush_tx(&mut st);
        sh.after(&mut st);
        Ok(())
    }

    /// Waits until every queued octet has been handed to the QP.
    pub(crate) fn flush(&self, timeout: Option<Duration>) -> io::Result<()> {
        let sh = &*self.sh;
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = sh.lock();
        st.push = true;
        sh.flush_tx(&mut st);
        loop {
            sh.progress(&mut st);
            if let Some(e) = st.error() {
                return Err(e);
            }
            if st.tx_queue.is_empty() {
                return Ok(());
            }
            sh.wait(&mut st, false, deadline)?;
        }
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        let sh = &*self.sh;
        let mut st = sh.lock();
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            st.rd_shut = true;
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) && !st.wr_shut {
            st.wr_shut = true;
            st.disconn_wanted = true;
            sh.flush_tx(&mut st);
        }
        sh.after(&mut st);
        Ok(())
    }

    /// Resets the connection: AbortConn, then the QP is aborted (RST).
    pub(crate) fn abort(&self) {
        let sh = &*self.sh;
        let mut st = sh.lock();
        sh.reset(
            &mut st,
            io::ErrorKind::ConnectionAborted,
            "connection aborted",
        );
    }

    pub(crate) fn set_nodelay(&self, on: bool) {
        let sh = &*self.sh;
        let mut st = sh.lock();
        st.nodelay = on;
        if on {
            sh.flush_tx(&mut st);
        }
    }

    pub(crate) fn nodelay(&self) -> bool {
        self.sh.lock().nodelay
    }

    /// `TCP_CORK`: on, writes are held in the staging buffers (a full
    /// buffer still goes) until it is turned off, which sends what is held
    /// at once; as the kernel's, held data goes anyway after
    /// [`CORK_MAX`] (seen by the next call on the connection or wait
    /// that looks at it).
    pub(crate) fn set_cork(&self, on: bool) {
        let sh = &*self.sh;
        let mut st = sh.lock();
        st.cork = on;
        if !on {
            st.corked_at = None;
            if !st.tx_queue.is_empty() {
                st.push = true;
                sh.flush_tx(&mut st);
            }
        }
        sh.after(&mut st);
    }

    /// The `TCP_CORK` setting.
    pub(crate) fn cork(&self) -> bool {
        self.sh.lock().cork
    }

    pub(crate) fn take_error(&self) -> Option<io::Error> {
        let st = self.sh.lock();
        st.error()
    }

    /// Whether a read (`write`: a write) would not block now; if not,
    /// `waker` is woken when it would (the completion callback wakes it,
    /// as it updates the readiness descriptor).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn poll_ready(&self, write: bool, waker: &std::task::Waker) -> bool {
        let sh = &*self.sh;
        let mut st = sh.lock();
        if st.rx.is_empty() {
            sh.progress(&mut st);
        }
        let (r, w) = Shared::readiness(&st);
        if (write && w) || (!write && r) {
            return true;
        }
        st.wakers[usize::from(write)] = Some(waker.clone());
        sh.after(&mut st);
        // The arm's poll may have changed things.
        let (r, w) = Shared::readiness(&st);
        (write && w) || (!write && r)
    }

    /// The readiness descriptor (created on first use and kept in sync from
    /// then on).
    pub(crate) fn readiness_fd(&self) -> io::Result<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        let sh = &*self.sh;
        let mut st = sh.lock();
        if st.ready.is_none() {
            st.ready = Some(Readiness::new()?);
        }
        sh.progress(&mut st);
        sh.after(&mut st);
        Ok(st.ready.as_ref().map(|r| r.app.as_raw_fd()).unwrap_or(-1))
    }
}

impl Shared {
    fn slot_base(&self, slot: u32) -> usize {
        slot as usize * self.buf_size
    }

    /// Locks the connection state; see [`Locked`].
    fn lock(&self) -> Locked<'_> {
        Locked {
            sh: self,
            g: Some(self.st.lock()),
        }
    }

    /// Completion callback (engine handler thread). Never waits for the
    /// state lock: the handler thread runs the callbacks of every CQ bound
    /// to it one after the other, so a callback waiting for a lock an
    /// application thread holds for a while (copying 64 KiB buffers,
    /// sending) delayed the wake-ups of other connections by as long.
    /// If the lock is taken, its holder handles the event when it lets go.
    fn on_event(&self, _cq: &CompletionQueue) {
        self.event_pending.store(true, Ordering::SeqCst);
        if let Some(g) = self.st.try_lock() {
            let mut st = Locked {
                sh: self,
                g: Some(g),
            };
            st.settle();
        }
    }

    /// Handles a completion event: the CQ is disarmed; process what it
    /// holds, re-arm if someone needs events, wake sleepers. Not inlined:
    /// [`Locked::settle`] runs at every letting go of the lock, and calls
    /// this rarely.
    #[inline(never)]
    fn handle_event(&self, st: &mut State) {
        st.armed = false;
        self.progress(st);
        if self.wants_events(st) {
            self.arm(st, &self.cq);
        }
        self.sync_ready(st);
        self.wake_sleepers(st);
    }

    /// Arms the CQ unless it is armed, then looks at the CQ once more
    /// (completions that came before the arm raise no event).
    fn arm(&self, st: &mut State, cq: &CompletionQueue) {
        if !st.armed {
            st.armed = cq.req_notify(false).is_ok();
            self.progress(st);
        }
    }

    fn wants_events(&self, st: &State) -> bool {
        // Not for calls sleeping while another drives the connection: the
        // driving thread wakes them, and an armed CQ would hand the socket
        // back to the engine's receive thread.
        !st.failed()
            && ((st.ready.is_some() && !st.ready_polled)
                || st.wakers.iter().any(Option::is_some)
                || (!st.tx_queue.is_empty() && !st.cork_held)
                || !st.ctrl_pending.is_empty()
                || st.tx_inflight >= self.sq_cap
                || (st.disconn_wanted && !st.sdp.close.local_disconn))
    }

    /// After a call: arm the CQ if someone (readiness, corked data) needs
    /// events without calling in, and update the readiness descriptor.
    /// Inlined for its usual case, a blocking call with nothing queued,
    /// held or served (three calls per message): nothing to do, found
    /// without a call.
    #[inline]
    fn after(&self, st: &mut State) {
        // Everything `after_slow` acts on is false here: no cork, nothing
        // `wants_events` asks for events for, and nothing `sync_ready`
        // updates.
        if !st.cork
            && st.ready.is_none()
            && st.wakers[0].is_none()
            && st.wakers[1].is_none()
            && st.tx_queue.is_empty()
            && st.ctrl_pending.is_empty()
            && st.tx_inflight < self.sq_cap
            && !st.disconn_wanted
        {
            return;
        }
        self.after_slow(st);
    }

    #[inline(never)]
    fn after_slow(&self, st: &mut State) {
        if st.cork {
            self.cork_ceiling(st);
        }
        if self.wants_events(st) {
            self.arm(st, &self.cq);
        }
        self.sync_ready(st);
    }

    /// Held corked data goes once it has waited [`CORK_MAX`].
    fn cork_ceiling(&self, st: &mut State) {
        if st.tx_queue.is_empty() {
            st.corked_at = None;
            return;
        }
        match st.corked_at {
            None => st.corked_at = Some(Instant::now()),
            Some(t) if t.elapsed() >= CORK_MAX => {
                st.corked_at = None;
                st.push = true;
                self.flush_tx(st);
            }
            Some(_) => {}
        }
    }

    /// Whether a read, and a write, would not block now.
    fn readiness(st: &State) -> (bool, bool) {
        let readable = !st.rx.is_empty() || st.sdp.close.peer_disconn || st.failed() || st.rd_shut;
        let writable = st.failed()
            || st.wr_shut
            || !st.tx_free.is_empty()
            || st
                .tx_queue
                .back()
                .is_some_and(|&(_, len)| len < st.sdp.max_payload());
        // After the exit flush's DisConn a write is accepted and dropped
        // (see `exit`): writable.
        let writable = writable || st.exit_flush && st.sdp.close.local_disconn;
        (readable, writable)
    }

    /// Inlined for its usual case: nothing to bring up to date (a
    /// blocking call), found without a call.
    #[inline]
    fn sync_ready(&self, st: &mut State) {
        if st.ready.is_none() && st.wakers[0].is_none() && st.wakers[1].is_none() {
            return;
        }
        self.sync_ready_slow(st);
    }

    #[inline(never)]
    fn sync_ready_slow(&self, st: &mut State) {
        let (readable, writable) = Self::readiness(st);
        if let Some(r) = st.ready.as_mut() {
            r.set(readable, writable);
        }
        for (i, now) in [readable, writable].into_iter().enumerate() {
            if now && let Some(w) = st.wakers[i].take() {
                w.wake();
            }
        }
    }

    /// Processes completions; returns whether any was found. Does nothing
    /// while a blocked call waits in the CQ (see [`State::poller`]): that
    /// call handles them.
    fn progress(&self, st: &mut State) -> bool {
        // The gate is free (and stays so: this runs under the state lock
        // throughout), or the driving call sleeps in `recv` and holds no
        // completion: handled here, in order, under the state lock.
        if st.poller.is_none() && !st.recv_sleeping {
            return false;
        }
        self.note_poll_beside(st);
        let mut any = false;
        // In batches, until one comes back short: a CQ found empty runs
        // the receive path (a read of the socket), so polling it once more
        // after the last completion cost a read that said EAGAIN.
        let mut out = [softrdma_engine::WorkCompletion::success(0, WcOpcode::Send, 0); WC_BATCH];
        loop {
            let n = self.cq.poll(&mut out);
            for wc in &out[..n] {
                any = true;
                self.on_wc(st, wc);
            }
            if n < out.len() {
                break;
            }
        }
        if any {
            self.flush_tx(st);
        }
        any
    }

    /// Handles the completions the CQ holds, without a receive attempt;
    /// nothing if another thread drives the connection. `seen`: see
    /// [`take_completions`](Self::take_completions).
    fn progress_completions(&self, st: &mut State, seen: bool) {
        if st.poller.is_none() && !st.recv_sleeping {
            return;
        }
        self.note_poll_beside(st);
        if self.take_completions(st, seen) > 0 {
            self.flush_tx(st);
        }
    }

    /// Counts a poll about to be made beside a call that sleeps in `recv`
    /// (see [`Shared::polled_beside`]). Before the poll, SeqCst: a
    /// sleeper that finds the CQ empty after the poll took a completion
    /// out reads the count after it (its look at the CQ, then the count).
    fn note_poll_beside(&self, st: &State) {
        if st.recv_sleeping {
            self.polled_beside.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Handles one completion (the `poller` gate is held, or the
    /// completion was returned to the writing call: `send_small`).
    fn on_wc(&self, st: &mut State, wc: &softrdma_engine::WorkCompletion) {
        st.handled = st.handled.wrapping_add(1);
        if wc.opcode == WcOpcode::Recv || wc.status != WcStatus::Success {
            // Only here, under the state lock: a load and a store, not a
            // locked add.
            let n = self.arrivals.load(Ordering::Relaxed);
            self.arrivals.store(n.wrapping_add(1), Ordering::Relaxed);
        }
        if wc.wr_id == ZC_READ {
            st.zc_read_done = Some(if wc.status == WcStatus::Success {
                Ok(wc.byte_len as usize)
            } else {
                Err(format!("zero-copy read failed ({})", wc.status.name()))
            });
            if wc.status != WcStatus::Success {
                st.link_lost(LinkLost::Status(wc.status));
            }
            return;
        }
        {
            if wc.status != WcStatus::Success {
                if wc.opcode == WcOpcode::Send && wc.wr_id & SEND_DATA != 0 {
                    st.tx_free.push(wc.wr_id as u32);
                }
                if wc.opcode == WcOpcode::Send {
                    st.tx_inflight = st.tx_inflight.saturating_sub(1);
                }
                // (Every posted receive is flushed at the close: the
                // first status is kept, put in words only if a call
                // reports it.)
                st.link_lost(LinkLost::Status(wc.status));
                return;
            }
            match wc.opcode {
                WcOpcode::Recv => self.on_recv(st, wc.wr_id as u32, wc.byte_len as usize),
                _ => {
                    if wc.wr_id & SEND_DATA != 0 {
                        st.tx_free.push(wc.wr_id as u32);
                    }
                    st.tx_inflight = st.tx_inflight.saturating_sub(1);
                }
            }
        }
    }

    fn on_recv(&self, st: &mut State, slot: u32, len: usize) {
        if st.err.is_some() {
            return;
        }
        let base = self.slot_base(slot);
        let mut head = [0u8; AVAIL_LEN];
        let hl = len.min(AVAIL_LEN);
        if self.rx_mr.read(base, &mut head[..hl]).is_err() {
            self.reset(st, io::ErrorKind::InvalidData, "receive out of range");
            return;
        }
        match st.sdp.receive_parts(&head[..hl], len) {
            Ok(Action::Deliver { offset, len }) => {
                if st.rx_slots < self.rx_max {
                    st.rx_data += len as u64;
                }
                st.rx.push_back(RxMsg {
                    slot,
                    pos: base + offset,
                    end: base + offset + len,
                    zc: None,
                })
            }
            Ok(Action::SrcAvail(avail)) => {
                if !self.zc_recv {
                    self.reset(st, io::ErrorKind::InvalidData, "SrcAvail not offered");
                    return;
                }
                if len != AVAIL_LEN || st.rx.iter().any(|m| m.zc.is_some()) {
                    // Data in the SrcAvail message, or a second advert
                    // (we allow one).
                    self.reset(st, io::ErrorKind::InvalidData, "unexpected SrcAvail");
                    return;
                }
                self.repost(st, slot);
                #[cfg(test)]
                if st.test.ignore_src_avail {
                    st.test.ignored.push(avail);
                    return;
                }
                #[cfg(test)]
                if st.test.overread_src_avail {
                    self.send_ctrl(st, &Message::RdmaRdCompl { len: avail.len + 1 });
                    return;
                }
                st.rx.push_back(RxMsg {
                    slot,
                    pos: 0,
                    end: 0,
                    zc: Some(ZcRx {
                        avail,
                        done: 0,
                        cancelled: false,
                    }),
                });
            }
            Ok(Action::SrcAvailCancel) => {
                self.repost(st, slot);
                #[cfg(test)]
                if st.test.ignore_src_avail {
                    return;
                }
                // Acknowledge with SendSm unless a read of it is under way
                // (it acknowledges when done); an offer already read in
                // full is gone: nothing to answer.
                let reading = st.zc_reading;
                if let Some(i) = st.rx.iter().position(|m| m.zc.is_some()) {
                    if reading && i == 0 {
                        if let Some(z) = st.rx[0].zc.as_mut() {
                            z.cancelled = true;
                        }
                    } else {
                        ZC_FALLBACKS.fetch_add(1, Ordering::Relaxed);
                        st.rx.remove(i);
                        self.send_ctrl(st, &Message::SendSm);
                    }
                }
            }
            Ok(Action::RdmaRdCompl(n)) => {
                self.repost(st, slot);
                match st.zc_tx.as_mut() {
                    Some(z) if !z.send_sm && n > 0 && z.len - z.read >= n => z.read += n,
                    _ => self.reset(st, io::ErrorKind::InvalidData, "unexpected RdmaRdCompl"),
                }
            }
            Ok(Action::SendSm) => {
                self.repost(st, slot);
                match st.zc_tx.as_mut() {
                    Some(z) if !z.send_sm => z.send_sm = true,
                    _ => self.reset(st, io::ErrorKind::InvalidData, "unexpected SendSm"),
                }
            }
            Ok(Action::Repost | Action::PeerDisConn) => self.repost(st, slot),
            Ok(Action::Aborted) => {
                st.err = Some((
                    io::ErrorKind::ConnectionReset,
                    "connection reset by peer (AbortConn)".into(),
                ));
                self.qp.abort();
            }
            Err(e) => {
                let msg = format!("malformed SDP message from peer: {e}");
                self.reset(st, io::ErrorKind::InvalidData, &msg);
            }
        }
    }

    /// Posts receive buffer `slot` (its work request id is the slot).
    fn post_slot(&self, slot: u32) -> Result<(), LinkLost> {
        let sge = self
            .slot_sge(slot)
            .ok_or_else(|| LinkLost::Message(format!("receive slot {slot} out of range")))?;
        self.qp
            .post_recv(&RecvWr::new(u64::from(slot), &[sge]))
            .map_err(LinkLost::PostRecv)
    }

    /// The SGE of receive buffer `slot` (`None` past the ring): its part
    /// of the region's span, which holds `rx_max` buffers.
    fn slot_sge(&self, slot: u32) -> Option<softrdma_engine::Sge> {
        (slot < self.rx_max).then(|| softrdma_engine::Sge {
            addr: self.rx_span.addr + self.slot_base(slot) as u64,
            length: self.buf_size as u32,
            lkey: self.rx_span.lkey,
        })
    }

    fn repost(&self, st: &mut State, slot: u32) {
        match self.post_slot(slot) {
            Ok(()) => st.sdp.credits.on_repost(1),
            Err(e) => st.link_lost(e),
        }
        if st.rx_slots < self.rx_max && st.rx_data >= RING_GROW_AFTER {
            self.grow_ring(st);
        }
    }

    /// Posts the rest of the receive ring (a connection that carries bulk
    /// data): the peer learns of the buffers with the next message, a
    /// credit update at once (the posted buffers are then at least half the
    /// ring ahead of the peer's view, see `sdp::Credits::wants_update`).
    fn grow_ring(&self, st: &mut State) {
        // Room in the CQ for every receive of the grown ring first (see
        // `cq_entries`: the exclusive CQ has it from the start); a CQ that
        // cannot grow keeps the ring as it is.
        let want = cq_entries(self.rx_max as usize, self.tx_bufs);
        if self.cq.capacity() < want && self.cq.resize(want).is_err() {
            return;
        }
        while st.rx_slots < self.rx_max {
            if let Err(e) = self.post_slot(st.rx_slots) {
                st.link_lost(e);
                return;
            }
            st.rx_slots += 1;
            st.sdp.credits.on_repost(1);
        }
    }

    /// Reset: best-effort AbortConn, then RST.
    fn reset(&self, st: &mut State, kind: io::ErrorKind, why: &str) {
        if st.err.is_none() {
            st.err = Some((kind, why.to_string()));
        }
        if !st.sdp.close.aborted {
            let mut out = [0u8; AVAIL_LEN];
            if let Some(n) = st.sdp.header(&Message::AbortConn, &mut out) {
                let _ = self.qp.post_send(
                    &SendWr::new(SEND_CTRL, SendOp::Send)
                        .inline(&out[..n])
                        .signaled(),
                );
            }
            st.sdp.close.aborted = true;
        }
        self.qp.abort();
    }

    fn take_rx(&self, st: &mut State, buf: &mut [u8]) -> usize {
        let mut done = 0;
        while done < buf.len() {
            let Some(m) = st.rx.front_mut() else { break };
            if m.zc.is_some() {
                break;
            }
            let n = (m.end - m.pos).min(buf.len() - done);
            if self.rx_mr.read(m.pos, &mut buf[done..done + n]).is_err() {
                break;
            }
            m.pos += n;
            done += n;
            if m.pos == m.end {
                let slot = m.slot;
                st.rx.pop_front();
                self.repost(st, slot);
            }
        }
        if done > 0 {
            st.read_since_write = true;
            self.flush_tx(st);
        }
        done
    }

    /// A read whose next data is the peer's SrcAvail: RDMA-Reads (part of)
    /// it straight into `buf`, reports it (RdmaRdCompl) and returns the
    /// octets; or asks for buffered copy (SendSm: a peek, a non-blocking
    /// read, a small buffer, an offer withdrawn) and returns `None` (look
    /// again: the data comes as Data messages).
    fn read_zc(
        &self,
        st: &mut Locked<'_>,
        buf: &mut [u8],
        peek: bool,
        nonblocking: bool,
        deadline: Option<Instant>,
    ) -> io::Result<Option<usize>> {
        if st.zc_reading {
            // Another reader of this connection is at it.
            self.wait(st, nonblocking, deadline)?;
            return Ok(None);
        }
        let Some(z) = st.rx.front().and_then(|m| m.zc) else {
            return Ok(None);
        };
        let rest = (z.avail.len - z.done) as usize;
        if z.cancelled || peek || nonblocking || (buf.len() < rest && buf.len() < ZC_MIN_CHUNK) {
            ZC_FALLBACKS.fetch_add(1, Ordering::Relaxed);
            st.rx.pop_front();
            self.send_ctrl(st, &Message::SendSm);
            self.flush_tx(st);
            return Ok(None);
        }
        let n = rest.min(buf.len());
        let eng = engine()?;
        st.zc_reading = true;
        st.zc_read_done = None;
        let res = eng
            .pd
            .lend_mut(&mut buf[..n], Access::LOCAL_WRITE, |r| {
                let posted = r
                    .sge(0, n as u32)
                    .map_err(|e| e.to_string())
                    .and_then(|sge| {
                        self.qp
                            .post_send(
                                &SendWr::new(
                                    ZC_READ,
                                    SendOp::Read {
                                        remote_addr: z.avail.vaddr.wrapping_add(u64::from(z.done)),
                                        rkey: z.avail.rkey,
                                    },
                                )
                                .sg_list(&[sge])
                                .signaled(),
                            )
                            .map_err(|e| e.to_string())
                    });
                if let Err(e) = posted {
                    st.link_lost(e.clone());
                    return Err(io::Error::new(io::ErrorKind::ConnectionReset, e));
                }
                // The Read cannot be abandoned (the buffer is lent until
                // it completes): a peer that never answers gets the
                // connection reset after the zero-copy timeout, which
                // flushes the Read.
                let limit = Instant::now() + self.zc_timeout;
                loop {
                    if let Some(done) = st.zc_read_done.take() {
                        return done.map_err(|e| io::Error::new(io::ErrorKind::ConnectionReset, e));
                    }
                    let now = Instant::now();
                    if now >= limit && st.err.is_none() {
                        self.reset(st, io::ErrorKind::TimedOut, "zero-copy read timed out");
                    }
                    let until = if now >= limit {
                        now + Duration::from_millis(10)
                    } else {
                        limit
                    };
                    match self.wait(st, false, Some(until)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => return Err(e),
                    }
                }
            })
            .map_err(io::Error::other);
        st.zc_reading = false;
        let got = res??.min(n);
        ZC_OCTETS.fetch_add(got as u64, Ordering::Relaxed);
        let mut fin = false;
        let mut cancelled = false;
        if let Some(z) = st.rx.front_mut().and_then(|m| m.zc.as_mut()) {
            z.done += got as u32;
            fin = z.done >= z.avail.len;
            cancelled = z.cancelled;
        }
        self.send_ctrl(st, &Message::RdmaRdCompl { len: got as u32 });
        if fin || cancelled {
            st.rx.pop_front();
        }
        if cancelled && !fin {
            self.send_ctrl(st, &Message::SendSm);
        }
        self.flush_tx(st);
        self.after(st);
        Ok(Some(got))
    }

    /// A blocking write by Read zero copy: offers `buf` (SrcAvail) and
    /// waits until the peer has read it (RdmaRdCompl), or asked for
    /// buffered copy (SendSm), or the offer was withdrawn after the
    /// zero-copy timeout or the write timeout and the peer acknowledged
    /// that; a peer that does not acknowledge gets the connection reset.
    /// A signal handled while the offer is pending withdraws it too: once
    /// the peer acknowledged, the call returns what it read, or
    /// `ErrorKind::Interrupted` (`EINTR`) if nothing. Returns the octets
    /// the peer read (0: copy them instead). `buf` is registered for this
    /// call only: nothing reads it after it returns.
    fn write_zc(
        &self,
        st: &mut Locked<'_>,
        buf: &[u8],
        deadline: Option<Instant>,
    ) -> io::Result<usize> {
        let len = buf.len().min(1 << 30);
        let eng = engine()?;
        eng.pd
            .lend(&buf[..len], Access::REMOTE_READ, |r| {
                loop {
                    if let Some(e) = st.error() {
                        return Err(e);
                    }
                    // A credit, and room in the send queue as for Data
                    // (`sq_cap`: the queue also holds this side's
                    // zero-copy Read and an AbortConn).
                    if st.sdp.credits.can_send_data()
                        && st.ctrl_pending.is_empty()
                        && st.tx_inflight < self.sq_cap
                    {
                        break;
                    }
                    self.wait(st, false, deadline)?;
                }
                let avail = Avail {
                    len: len as u32,
                    rkey: r.rkey(),
                    vaddr: r.addr(),
                };
                let mut out = [0u8; AVAIL_LEN];
                let Some(hl) = st.sdp.header(
                    &Message::SrcAvail {
                        avail,
                        payload_len: 0,
                    },
                    &mut out,
                ) else {
                    return Err(io::Error::other("no credit for SrcAvail"));
                };
                if let Err(e) = self.qp.post_send(
                    &SendWr::new(SEND_CTRL, SendOp::Send)
                        .inline(&out[..hl])
                        .signaled(),
                ) {
                    st.link_lost(e.to_string());
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        e.to_string(),
                    ));
                }
                st.tx_inflight += 1;
                st.zc_tx = Some(ZcTx {
                    len: len as u32,
                    read: 0,
                    send_sm: false,
                });
                let mut cancel_at = Instant::now() + self.zc_timeout;
                if let Some(d) = deadline {
                    cancel_at = cancel_at.min(d);
                }
                let mut give_up: Option<Instant> = None;
                // A signal handled while the offer was pending withdrew it.
                let mut interrupted = false;
                let res = loop {
                    self.progress(st);
                    let Some(z) = st.zc_tx else {
                        break Err(io::Error::other("zero-copy state lost"));
                    };
                    if z.read == z.len {
                        break Ok(len);
                    }
                    if z.send_sm {
                        if interrupted && z.read == 0 {
                            // Nothing was read: EINTR, as a write the
                            // kernel interrupts before sending anything.
                            break Err(io::Error::from(io::ErrorKind::Interrupted));
                        }
                        break Ok(z.read as usize);
                    }
                    if let Some(e) = st.error() {
                        break Err(e);
                    }
                    let now = Instant::now();
                    match give_up {
                        None if now >= cancel_at => {
                            self.send_ctrl(st, &Message::SrcAvailCancel);
                            self.flush_tx(st);
                            give_up = Some(now + self.zc_timeout);
                        }
                        // Without a write timeout the write keeps waiting
                        // for the answer, as a plain write waits for a
                        // peer that does not read; after a signal it does
                        // not (the caller is to get control back).
                        Some(t) if now >= t && (deadline.is_some() || interrupted) => {
                            self.reset(
                                st,
                                io::ErrorKind::TimedOut,
                                "peer did not answer a withdrawn zero-copy offer",
                            );
                            break Err(io::Error::new(
                                io::ErrorKind::TimedOut,
                                "peer did not answer a withdrawn zero-copy offer",
                            ));
                        }
                        _ => {}
                    }
                    let until = match give_up {
                        None => Some(cancel_at),
                        Some(t) => (deadline.is_some() || interrupted).then_some(t),
                    };
                    match self.wait_interruptible(st, until) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {
                            // Withdraw the offer; the peer's answer (what it
                            // read, SendSm) ends the call. Later signals
                            // change nothing: the buffer stays lent until
                            // the peer answers or the connection is reset.
                            if give_up.is_none() {
                                interrupted = true;
                                self.send_ctrl(st, &Message::SrcAvailCancel);
                                self.flush_tx(st);
                                give_up = Some(Instant::now() + self.zc_timeout);
                            }
                        }
                        Err(e) => break Err(e),
                    }
                };
                st.zc_tx = None;
                // No new Read of it from here on; the loan's end waits for
                // a Read Response still leaving (a reset drops it).
                r.revoke();
                res
            })
            .map_err(io::Error::other)?
    }

    fn peek_rx(&self, st: &State, buf: &mut [u8]) -> usize {
        let mut done = 0;
        for m in &st.rx {
            if done == buf.len() || m.zc.is_some() {
                break;
            }
            let n = (m.end - m.pos).min(buf.len() - done);
            if self.rx_mr.read(m.pos, &mut buf[done..done + n]).is_err() {
                break;
            }
            done += n;
        }
        done
    }

    /// Sends a small write at once as an inline Data message (its header
    /// and payload copied into the request: no staging buffer, no look-up
    /// of the send region), if nothing is queued before it, it would not
    /// be corked, and a credit allows. Returns whether it was sent.
    fn send_small(
        &self,
        st: &mut State,
        bufs: &[io::IoSlice<'_>],
        total: usize,
        reply: bool,
    ) -> bool {
        if total > self.inline_max
            || st.tx_inflight >= self.sq_cap
            || !st.tx_queue.is_empty()
            || !st.ctrl_pending.is_empty()
            || st.failed()
            || st.cork
            || !(st.nodelay || st.push || st.tx_inflight == 0)
        {
            return false;
        }
        // The header straight into the message's first octets (a Data
        // header is `BSDH_LEN` of them; the payload is copied after it).
        let mut frame = [0u8; BSDH_LEN + INLINE_PAYLOAD];
        let Some(hl) = <&mut [u8; AVAIL_LEN]>::try_from(&mut frame[..AVAIL_LEN])
            .ok()
            .and_then(|head| st.sdp.header(&Message::Data { payload_len: total }, head))
        else {
            return false;
        };
        let mut at = hl;
        for b in bufs {
            frame[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
        // The credit is taken: the message is sent, or the link is lost.
        // A write that answers a read is written by this call if the
        // socket takes it at once: then its completion comes back here,
        // not through the CQ (`read_since_write`).
        let wr = SendWr::new(SEND_CTRL, SendOp::Send)
            .inline(&frame[..hl + total])
            .signaled();
        let posted = if reply {
            self.qp.post_send_now(&wr)
        } else {
            self.qp.post_send(&wr).map(|()| None)
        };
        match posted {
            Ok(done) => {
                st.tx_inflight += 1;
                st.inline_sends += 1;
                if let Some(wc) = done {
                    self.on_wc(st, &wc);
                    st.direct_sends += 1;
                }
            }
            Err(e) => st.link_lost(e.to_string()),
        }
        if st.sdp.wants_credit_update() && st.tx_inflight < self.sq_cap {
            self.send_ctrl(st, &Message::Data { payload_len: 0 });
        }
        true
    }

    /// Copies as much of the concatenation of `bufs` as fits into staging
    /// buffers (each piece straight into them).
    fn fill_tx(&self, st: &mut State, bufs: &[io::IoSlice<'_>]) -> usize {
        let mut done = 0;
        for b in bufs {
            let n = self.fill_tx_one(st, b);
            done += n;
            if n < b.len() {
                break;
            }
        }
        done
    }

    /// Copies as much of `buf` as fits into staging buffers: the free room
    /// of the last queued (unsent) buffer first, then free ones.
    fn fill_tx_one(&self, st: &mut State, buf: &[u8]) -> usize {
        let max = st.sdp.max_payload();
        let mut done = 0;
        // Append to the last queued (not yet sent) buffer first.
        if let Some((slot, len)) = st.tx_queue.back_mut()
            && *len < max
        {
            let n = (max - *len).min(buf.len());
            let at = slot_base(self.buf_size, *slot) + BSDH_LEN + *len;
            if self.tx_mr.write(at, &buf[..n]).is_ok() {
                *len += n;
                done += n;
            }
        }
        while done < buf.len() {
            let Some(slot) = st.tx_free.pop() else { break };
            let n = max.min(buf.len() - done);
            let at = self.slot_base(slot) + BSDH_LEN;
            if self.tx_mr.write(at, &buf[done..done + n]).is_err() {
                st.tx_free.push(slot);
                break;
            }
            st.tx_queue.push_back((slot, n));
            done += n;
        }
        done
    }

    /// Sends queued buffers as credits allow; corks a small last buffer
    /// while earlier sends are still queued in the engine (unless NODELAY).
    /// Sends what waits: control messages, queued data, a DisConn wanted,
    /// a credit update. Inlined for its usual case (nothing queued: two
    /// or three calls per message), which does what the whole would.
    #[inline]
    fn flush_tx(&self, st: &mut State) {
        if st.ctrl_pending.is_empty() && st.tx_queue.is_empty() && !st.disconn_wanted {
            if st.failed() {
                return;
            }
            st.cork_held = false;
            st.push = false;
            if st.sdp.wants_credit_update() && st.tx_inflight < self.sq_cap {
                self.send_ctrl(st, &Message::Data { payload_len: 0 });
            }
            return;
        }
        self.flush_tx_slow(st);
    }

    #[inline(never)]
    fn flush_tx_slow(&self, st: &mut State) {
        if st.failed() {
            return;
        }
        while let Some(m) = st.ctrl_pending.front().copied() {
            if st.tx_inflight >= self.sq_cap {
                break;
            }
            let mut out = [0u8; AVAIL_LEN];
            let Some(n) = st.sdp.header(&m, &mut out) else {
                break;
            };
            st.ctrl_pending.pop_front();
            match self.qp.post_send(
                &SendWr::new(SEND_CTRL, SendOp::Send)
                    .inline(&out[..n])
                    .signaled(),
            ) {
                Ok(()) => st.tx_inflight += 1,
                Err(e) => {
                    st.link_lost(e.to_string());
                    return;
                }
            }
        }
        let max = st.sdp.max_payload();
        st.cork_held = false;
        while let Some(&(slot, len)) = st.tx_queue.front() {
            if st.tx_inflight >= self.sq_cap {
                // A completion (every send is signaled) flushes again.
                break;
            }
            let last = st.tx_queue.len() == 1;
            // Held: a partial last buffer while corked (TCP_CORK), or
            // while earlier sends are in flight (no TCP_NODELAY).
            let hold =
                !st.push && !st.disconn_wanted && (st.cork || (!st.nodelay && st.tx_inflight > 0));
            if last && hold && len < max {
                // Held by the cork alone (not by a send in flight whose
                // completion would release it): nothing to wait for.
                st.cork_held = st.cork;
                break;
            }
            let mut out = [0u8; AVAIL_LEN];
            let Some(hl) = st.sdp.header(&Message::Data { payload_len: len }, &mut out) else {
                break;
            };
            let base = self.slot_base(slot);
            let res = self
                .tx_mr
                .write(base, &out[..hl])
                .map_err(|e| e.to_string())
                .and_then(|()| {
                    self.tx_mr
                        .sge(base, (hl + len) as u32)
                        .map_err(|e| e.to_string())
                })
                .and_then(|sge| {
                    self.qp
                        .post_send(
                            &SendWr::new(SEND_DATA | u64::from(slot), SendOp::Send)
                                .sg_list(&[sge])
                                .signaled(),
                        )
                        .map_err(|e| e.to_string())
                });
            if let Err(e) = res {
                st.link_lost(e);
                return;
            }
            st.tx_queue.pop_front();
            st.tx_inflight += 1;
        }
        if st.tx_queue.is_empty() {
            st.push = false;
        }
        if st.tx_queue.is_empty()
            && st.disconn_wanted
            && !st.sdp.close.local_disconn
            && st.tx_inflight < self.sq_cap
        {
            self.send_ctrl(st, &Message::DisConn);
        }
        // Also after the peer's DisConn: it needs credits for its own
        // updates while our data still flows (see `sdp`'s credit rules).
        // With the send queue full it goes with the next flush.
        if st.sdp.wants_credit_update() && st.tx_inflight < self.sq_cap {
            self.send_ctrl(st, &Message::Data { payload_len: 0 });
        }
    }

    fn send_ctrl(&self, st: &mut State, m: &Message) {
        let mut out = [0u8; AVAIL_LEN];
        let zc_ctrl = matches!(
            m,
            Message::SendSm | Message::RdmaRdCompl { .. } | Message::SrcAvailCancel
        );
        if zc_ctrl && (!st.ctrl_pending.is_empty() || st.tx_inflight >= self.sq_cap) {
            st.ctrl_pending.push_back(*m);
            return;
        }
        let Some(n) = st.sdp.header(m, &mut out) else {
            if zc_ctrl {
                // Sent when a credit comes back (`flush_tx`).
                st.ctrl_pending.push_back(*m);
            }
            return;
        };
        {
            match self.qp.post_send(
                &SendWr::new(SEND_CTRL, SendOp::Send)
                    .inline(&out[..n])
                    .signaled(),
            ) {
                Ok(()) => st.tx_inflight += 1,
                Err(e) => st.link_lost(e.to_string()),
            }
        }
    }

    /// Waits for progress: busy-polls for the spin time, then, if no
    /// other thread drives the connection, sleeps in this thread on the
    /// QP's socket and the CQ's wake-up descriptor (a [`WaitSet`]: no
    /// receive attempt before the sleep; when bytes come, this thread runs
    /// the receive path, so a message needs no receive-thread and
    /// handler-thread hand-off); else sleeps until the thread that drives
    /// it wakes this one. A signal handled meanwhile is a spurious
    /// wake-up (the call goes on, as the kernel restarts a call
    /// interrupted by an `SA_RESTART` handler); see
    /// [`wait_interruptible`](Self::wait_interruptible).
    fn wait(
        &self,
        st: &mut Locked<'_>,
        nonblocking: bool,
        deadline: Option<Instant>,
    ) -> io::Result<()> {
        match self.wait_inner(st, nonblocking, deadline, false, false) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            r => r,
        }
    }

    /// [`wait`](Self::wait) that returns `ErrorKind::Interrupted` when a
    /// signal was handled while it slept (`EINTR`).
    fn wait_interruptible(&self, st: &mut Locked<'_>, deadline: Option<Instant>) -> io::Result<()> {
        self.wait_inner(st, false, deadline, true, false)
    }

    /// `sole`: the caller is the connection's only possible caller (see
    /// [`Offload::read_sole`]): a sleep in `recv` has no time limit.
    fn wait_inner(
        &self,
        st: &mut Locked<'_>,
        nonblocking: bool,
        deadline: Option<Instant>,
        interruptible: bool,
        sole: bool,
    ) -> io::Result<()> {
        if nonblocking {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        // The caller looked at the state under the lock just now: whatever
        // is handled from here on may be what it waits for.
        let seen = st.handled;
        // The clock is read only when it is needed (spinning, a
        // deadline): a blocking call without either goes straight to its
        // wait (a clock read costs about as much as the rest of a call's
        // own work on a virtual machine).
        if !self.spin.is_zero() {
            let spin_until = Instant::now() + self.spin;
            let mut empty = 0u32;
            loop {
                // Yield now and then: on a busy machine the thread that
                // sends what this one waits for may need this CPU.
                empty = empty.wrapping_add(1);
                if empty.is_multiple_of(SPIN_YIELD_EVERY) {
                    st.unlocked(std::thread::yield_now);
                    // The clock once per round of polls.
                    if Instant::now() >= spin_until {
                        break;
                    }
                } else {
                    st.unlocked(std::hint::spin_loop);
                }
                self.progress(st);
                if st.handled != seen {
                    return Ok(());
                }
            }
        }
        let nap = match deadline {
            Some(d) => d.saturating_duration_since(Instant::now()).min(repoll()),
            None => repoll(),
        };
        // Taken with the state lock held, held while waiting without it,
        // and given back once the state lock is taken again (see
        // `State::poller`).
        if st.handled != seen {
            return Ok(());
        }
        let Some(mut gate) = st.poller.take() else {
            return self.sleep(st, nap, deadline, seen, interruptible);
        };
        // The gate goes back even if what follows panics (a caller may
        // turn the panic into an error and go on using the connection):
        // without it every later blocking call would find it held for
        // good. No cost unless it unwinds.
        let section = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.wait_holding(st, &mut gate, nap, deadline, sole)
        }));
        let (res, n) = match section {
            Ok(r) => r,
            Err(panic) => {
                st.recv_sleeping = false;
                st.poller = Some(gate);
                self.wake_sleepers(st);
                std::panic::resume_unwind(panic);
            }
        };
        st.poller = Some(gate);
        if n > 0 {
            self.flush_tx(st);
        }
        // Completions handled here are nobody else's to see: bring the
        // readiness descriptor and async tasks up to date, and wake the
        // calls that sleep because this one drove (one of them drives
        // next if this call returns).
        self.after(st);
        self.wake_sleepers(st);
        match res {
            Err(WaitError::Interrupted) if n == 0 => {
                return Err(io::Error::from(io::ErrorKind::Interrupted));
            }
            Err(WaitError::Io(e)) if n == 0 => return Err(e),
            _ => {}
        }
        if n == 0 && deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
        }
        Ok(())
    }

    /// The part of [`wait_inner`](Self::wait_inner) run holding the
    /// `poller` gate (taken out of the state as `gate`): the wait, then
    /// the completions taken out of the CQ; returns the wait's result and
    /// how many completions were handled.
    fn wait_holding(
        &self,
        st: &mut Locked<'_>,
        gate: &mut WaitSet,
        nap: Duration,
        deadline: Option<Instant>,
        sole: bool,
    ) -> (Result<usize, WaitError>, usize) {
        #[cfg(test)]
        drive_tests::panic_in_wait_if_asked();
        // A bounded sleep even without a deadline (`nap`): a completion
        // wakes it, but data held by a cork (its `CORK_MAX` ceiling is
        // checked after a wait) or another thread's change of the state
        // push nothing, and this call must look again. The one exception:
        // the only handle's sleep in `recv` (`sole`, below) has no time
        // limit, as nothing of that kind can happen meanwhile.
        // The wait's last look found the CQ non-empty (no second look
        // before the first poll).
        let mut seen = false;
        let mut handed = 0;
        let res = if self.may_sleep_in_recv(st, deadline) {
            // One system call per wait, as a blocking TCP read: the
            // sleep in the socket's `recv`, bounded by the same re-poll
            // time, or by nothing for the connection's only possible
            // caller (`sole`: nobody else can change what it waits for; a
            // time limit arms a kernel timer per sleep, 3-4 % of the CPU
            // of a 64-byte ping-pong on one CPU). Whoever comes meanwhile
            // handles completions itself (`recv_sleeping`).
            let recv_limit = if sole { Duration::MAX } else { nap };
            st.recv_sleeping = true;
            // Polls beside this call count from here (under the lock).
            let beside = self.polled_beside.load(Ordering::Relaxed);
            let handled = st.handled;
            // The receive completion of what the sleep brings comes back
            // straight to this call when the wait could take this lock
            // back (a try) while it still held the QP's connection and
            // the CQ was empty: every poll of the CQ is made under this
            // lock, so none can take a newer completion before this call
            // has handled it (see `WaitSet::wait_receiving_handed`).
            let mut wc = None;
            let r = st.unlocked_taking_back(|hand| {
                #[cfg(test)]
                drive_tests::panic_in_recv_wait_if_asked(hand);
                // Looked at once the receive is this call's, before it
                // sleeps: a poll beside it since it let the lock go may
                // have taken in what it waits for (and left the CQ
                // empty); it then does not sleep, and looks again.
                let polled = || self.polled_beside.load(Ordering::SeqCst) != beside;
                gate.wait_receiving_handed(recv_limit, &polled, hand, &mut wc)
            });
            st.recv_sleeping = false;
            // The oldest completion: before anything polled, whatever the
            // wait returned (the engine hands one back only with a
            // receive, but a completion taken out of the CQ must never be
            // dropped: its slot would never be posted again).
            if let Some(wc) = wc {
                st.handed_back += 1;
                handed = 1;
                self.on_wc(st, &wc);
            }
            let r = match r {
                Ok(Some(n)) => {
                    seen = n > 0;
                    if gate.slept_in_recv() {
                        st.recv_sleeps += 1;
                        count_recv_sleep();
                    }
                    Ok(n + handed)
                }
                Err(e) => Err(e),
                // No sleep in `recv` (another thread received): what
                // the calls beside it handled meanwhile is looked at
                // first (the wait in `poll(2)` would not end for it).
                Ok(None) if st.handled != handled => Ok(0),
                Ok(None) => st.unlocked(|| gate.wait(Some(nap))),
            };
            st.settle();
            r
        } else {
            st.unlocked(|| gate.wait(Some(nap)))
        };
        // Completions only (the wait ran the receive path if bytes came):
        // no receive attempt that would find the socket empty.
        let n = handed + self.take_completions(st, seen);
        (res, n)
    }

    /// Whether a blocked call (holding `poller`) may sleep in the QP's
    /// socket's `recv`, which nothing but bytes (or the socket's end), a
    /// signal or the time limit wakes: only while this call is the only
    /// one waiting, no deadline is to be kept (the socket's time limit is
    /// the re-poll time, or none for a read by the only handle: see
    /// [`Offload::read_sole`]), and nothing it might wait for can come
    /// as a completion pushed by another thread or as a timer: no send in
    /// flight (the engine's thread completes sends the socket could not
    /// take at once), no data queued or held by the cork (its ceiling is
    /// checked after a wait), no control message waiting, no zero-copy
    /// transfer under way, and no async task or readiness descriptor to
    /// serve. What could still happen meanwhile (another thread's
    /// `shutdown(Read)`) is seen after the re-poll time at the latest, as
    /// with the `poll(2)` wait (for the only handle's read nothing can,
    /// and its sleep has no such end); a call that comes meanwhile handles
    /// completions itself (`State::recv_sleeping`).
    fn may_sleep_in_recv(&self, st: &State, deadline: Option<Instant>) -> bool {
        self.recv_sleep.load(Ordering::Relaxed)
            && deadline.is_none()
            && st.waiters == 0
            && st.tx_inflight == 0
            && st.tx_queue.is_empty()
            && st.ctrl_pending.is_empty()
            && st.zc_tx.is_none()
            && !st.zc_reading
            && st.zc_read_done.is_none()
            && st.corked_at.is_none()
            && !st.push
            && !st.disconn_wanted
            && st.ready.is_none()
            && st.wakers.iter().all(Option::is_none)
            && !st.failed()
            && !st.rd_shut
            && !self.event_pending.load(Ordering::SeqCst)
    }

    /// Handles the completions the CQ holds, without a receive attempt
    /// (the `poller` gate is held, or its holder sleeps in `recv`); returns
    /// how many. `seen`: the caller found the CQ non-empty just now (no
    /// second look before the first poll).
    fn take_completions(&self, st: &mut State, mut seen: bool) -> usize {
        let mut n = 0;
        // In batches: a look at the ring per batch, not per completion (a
        // poll of a non-empty CQ makes no receive attempt).
        let mut out = [softrdma_engine::WorkCompletion::success(0, WcOpcode::Send, 0); WC_BATCH];
        while std::mem::take(&mut seen) || !self.cq.is_empty() {
            let k = self.cq.poll(&mut out);
            for wc in &out[..k] {
                self.on_wc(st, wc);
            }
            n += k;
            if k < out.len() {
                break;
            }
        }
        n
    }

    fn wake_sleepers(&self, st: &State) {
        // A sleeper made the pair before it counted itself.
        if st.waiters > 0
            && let Some(w) = self.waker.get()
        {
            for _ in 0..st.waiters {
                let _ = w.1.send(&[1]);
            }
        }
    }

    /// The wake-up pair of sleeping calls, made on first use.
    fn waker(&self) -> io::Result<&(UnixDatagram, UnixDatagram)> {
        if let Some(w) = self.waker.get() {
            return Ok(w);
        }
        let w = UnixDatagram::pair()?;
        w.0.set_nonblocking(true)?;
        w.1.set_nonblocking(true)?;
        // Another sleeper may have won: its pair is the one.
        let _ = self.waker.set(w);
        Ok(self.waker.get().expect("set"))
    }

    /// Sleeps while another thread drives the connection (waits in the
    /// CQ): that thread wakes this one after it handled completions and
    /// when it stops driving; at most `nap`, as a safety net.
    fn sleep(
        &self,
        st: &mut Locked<'_>,
        nap: Duration,
        deadline: Option<Instant>,
        seen: u64,
        interruptible: bool,
    ) -> io::Result<()> {
        if st.handled != seen {
            // Handled while this call had let go of the lock (before it
            // counted as a sleeper, so nobody wakes it): look again.
            return Ok(());
        }
        let waker = match self.waker() {
            Ok(w) => w,
            Err(_) => {
                // No descriptors for the pair: a short nap instead (the
                // driving thread's wake-up is lost, not the data).
                st.unlocked(|| std::thread::sleep(nap.min(Duration::from_millis(1))));
                self.progress(st);
                return Ok(());
            }
        };
        st.waiters += 1;
        if st.recv_sleeping {
            // The driving call sleeps in the socket's `recv`, which a
            // completion does not end: this call waits for the CQ's
            // completions itself (and for the driver's wake-up), and
            // handles them (`progress` without the gate).
            let mut set = WaitSet::new();
            set.add_cq_completions(&self.cq);
            set.add_fd(
                std::os::fd::AsRawFd::as_raw_fd(&waker.0),
                rustix::event::PollFlags::IN.bits() as i16,
            );
            let r = st.unlocked(|| {
                let r = set.wait(Some(nap));
                if set.fd_revents(1) != 0 {
                    let mut b = [0u8; 1];
                    let _ = waker.0.recv(&mut b);
                }
                r
            });
            st.waiters -= 1;
            let found = self.progress(st);
            if found {
                self.after(st);
                self.wake_sleepers(st);
            }
            if matches!(r, Err(WaitError::Interrupted)) && interruptible && !found {
                return Err(io::Error::from(io::ErrorKind::Interrupted));
            }
            let timed_out = matches!(r, Ok(0)) && deadline.is_some_and(|d| Instant::now() >= d);
            if timed_out && !found {
                return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
            }
            return Ok(());
        }
        let ts = rustix::time::Timespec {
            tv_sec: nap.as_secs() as i64,
            tv_nsec: i64::from(nap.subsec_nanos()),
        };
        let (n, intr) = st.unlocked(|| {
            let mut fds = [rustix::event::PollFd::new(
                &waker.0,
                rustix::event::PollFlags::IN,
            )];
            let r = rustix::event::poll(&mut fds, Some(&ts));
            if !fds[0].revents().is_empty() {
                let mut b = [0u8; 1];
                let _ = waker.0.recv(&mut b);
            }
            (
                r.unwrap_or(0),
                matches!(r, Err(e) if e == rustix::io::Errno::INTR),
            )
        });
        st.waiters -= 1;
        let found = self.progress(st);
        if intr && interruptible && !found {
            return Err(io::Error::from(io::ErrorKind::Interrupted));
        }
        let timed_out = n == 0 && deadline.is_some_and(|d| Instant::now() >= d);
        if n == 0 && !timed_out && found {
            LOST_WAKEUPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        if timed_out && !found {
            return Err(io::Error::new(io::ErrorKind::WouldBlock, "timed out"));
        }
        Ok(())
    }
}

/// Completions taken from the CQ per poll: a connection's calls find one
/// or two at a time (a message and the completion of the last send), and
/// the batch is made (initialised) at every look, several per message; a
/// larger backlog is taken in several polls.
const WC_BATCH: usize = 4;

/// A busy-polling call yields the CPU after this many empty polls.
const SPIN_YIELD_EVERY: u32 = 4;

/// Longest sleep of a blocked call before it looks at the CQ again: a
/// safety net, not a wake-up mechanism (the thread driving the connection
/// wakes sleepers). Not for a read by the stream's only handle that
/// sleeps in the socket's `recv`: that sleep has no time limit (see
/// [`Offload::read_sole`]). Tests raise it so that a lost wake-up hangs.
const REPOLL: Duration = Duration::from_millis(50);

/// A [`REPOLL`] override in milliseconds (0: none), for tests.
static REPOLL_MS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn repoll() -> Duration {
    match REPOLL_MS.load(std::sync::atomic::Ordering::Relaxed) {
        0 => REPOLL,
        ms => Duration::from_millis(ms),
    }
}

/// Waits of blocked calls that slept in the socket's `recv` (see
/// [`recv_sleeps`]), counted per thread: each thread adds to its own
/// counter with a load and a store (a shared counter's locked add was one
/// locked instruction per message). The counters of the threads that
/// live, and what the ended ones counted.
#[derive(Default)]
struct RecvSleeps {
    live: Vec<Arc<AtomicU64>>,
    ended: u64,
}

fn recv_sleep_counters() -> &'static Mutex<RecvSleeps> {
    static COUNTERS: OnceLock<Mutex<RecvSleeps>> = OnceLock::new();
    COUNTERS.get_or_init(Mutex::default)
}

/// Sleeps in `recv` counted by threads that could not list a counter of
/// their own (see [`ThreadRecvSleeps`]): a locked add each, on that rare
/// path only.
static UNLISTED_RECV_SLEEPS: AtomicU64 = AtomicU64::new(0);

/// Tries of the counters' list's lock made by a thread's start and end
/// of counting before it gives up: the lock is held only for a push, a
/// removal or a sum, so it stays taken for good only in a child forked
/// while another thread of its parent held it (and there a thread's end
/// must not block: its locals are torn down at its exit).
const RECV_SLEEP_LOCK_TRIES: u32 = 1000;

/// The counters' list, if its lock is taken within
/// [`RECV_SLEEP_LOCK_TRIES`] tries (only a compare-and-swap each, no
/// sleep on the lock: a forked child finds no waiter to wake it).
fn try_lock_recv_sleep_counters() -> Option<MutexGuard<'static, RecvSleeps>> {
    let list = recv_sleep_counters();
    for _ in 0..RECV_SLEEP_LOCK_TRIES {
        if let Some(g) = list.try_lock() {
            return Some(g);
        }
        std::thread::yield_now();
    }
    None
}

/// A thread's counter, listed at its first sleep in `recv`; at the
/// thread's end its count goes to `ended` and it leaves the list (both
/// under the list's lock, so a sum counts it once). If the list's lock
/// cannot be taken (see [`RECV_SLEEP_LOCK_TRIES`]), the thread counts in
/// [`UNLISTED_RECV_SLEEPS`] instead, or, at its end, leaves its counter
/// listed (still counted once).
enum ThreadRecvSleeps {
    Listed(Arc<AtomicU64>),
    Unlisted,
}

impl ThreadRecvSleeps {
    fn new() -> ThreadRecvSleeps {
        match try_lock_recv_sleep_counters() {
            Some(mut all) => {
                let c = Arc::new(AtomicU64::new(0));
                all.live.push(Arc::clone(&c));
                ThreadRecvSleeps::Listed(c)
            }
            None => ThreadRecvSleeps::Unlisted,
        }
    }
}

impl Drop for ThreadRecvSleeps {
    fn drop(&mut self) {
        if let ThreadRecvSleeps::Listed(c) = self
            && let Some(mut all) = try_lock_recv_sleep_counters()
        {
            all.ended += c.load(Ordering::Relaxed);
            all.live.retain(|l| !Arc::ptr_eq(l, c));
        }
    }
}

thread_local! {
    static THREAD_RECV_SLEEPS: ThreadRecvSleeps = ThreadRecvSleeps::new();
}

/// Counts a wait that slept in `recv` (only this thread writes its
/// counter: a load and a store lose nothing).
fn count_recv_sleep() {
    // (A thread whose locals are being torn down counts nothing more.)
    let _ = THREAD_RECV_SLEEPS.try_with(|c| match c {
        ThreadRecvSleeps::Listed(c) => {
            let n = c.load(Ordering::Relaxed);
            c.store(n.wrapping_add(1), Ordering::Relaxed);
        }
        ThreadRecvSleeps::Unlisted => {
            UNLISTED_RECV_SLEEPS.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Sleeps that ended by the re-poll timer and found completions; see
/// [`lost_wakeups`].
static LOST_WAKEUPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Octets received by Read zero copy, see [`zero_copy_octets`].
static ZC_OCTETS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Zero-copy offers answered with SendSm, see [`zero_copy_fallbacks`].
static ZC_FALLBACKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Octets this process received by Read zero copy (RDMA-Read straight
/// into the reader's buffer) on all its connections so far.
pub fn zero_copy_octets() -> u64 {
    ZC_OCTETS.load(Ordering::Relaxed)
}

/// Zero-copy offers this process answered with a request for buffered
/// copy (SendSm: a peek, a non-blocking or small read, a withdrawn
/// offer) so far.
pub fn zero_copy_fallbacks() -> u64 {
    ZC_FALLBACKS.load(Ordering::Relaxed)
}

/// Number of times a blocked call found completions only through its
/// periodic re-poll, before the completion callback woke it (the
/// callback ran late: the engine's handler thread was not scheduled, or,
/// before the callback stopped waiting for busy connections, was held up
/// by another connection). Kept under its old name; ideally 0.
pub fn lost_wakeups() -> u64 {
    LOST_WAKEUPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Number of waits in which a blocked call slept in the QP's socket's
/// `recv` (one system call per wait, as a blocking TCP read) rather than
/// in `poll(2)` and read after it; see the crate's README, *Ping-pong*.
pub fn recv_sleeps() -> u64 {
    let all = recv_sleep_counters().lock();
    let unlisted = UNLISTED_RECV_SLEEPS.load(Ordering::Relaxed);
    all.live
        .iter()
        .fold(all.ended.wrapping_add(unlisted), |n, c| {
            n.wrapping_add(c.load(Ordering::Relaxed))
        })
}

fn slot_base(size: usize, slot: u32) -> usize {
    slot as usize * size
}

/// How long an abortive close (`SO_LINGER` on, zero time) keeps sending
/// queued data while no credit comes from the peer; see [`Shared::close`].
const LINGER_ZERO_STALL: Duration = Duration::from_millis(100);

impl Shared {
    /// Closes gracefully (queued data, DisConn, FIN; bounded by the
    /// linger time), or resets with unread data or after an error.
    /// `Some(deadline)`: our FIN is sent and the peer's is still to come;
    /// the caller waits for it ([`Shared::wait_fin`]) or has it waited
    /// for later ([`exit::defer_fin`]), until `deadline`.
    fn close(&self) -> Option<Instant> {
        let mut st = self.lock();
        if st.err.is_some() || st.sdp.close.aborted {
            self.qp.abort();
            return None;
        }
        // `SO_LINGER` on with a zero time (set by the application on its
        // socket, which the QP's shares): an abortive close, as the
        // kernel's: the peer is reset (AbortConn, then RST) and nothing is
        // listed. The kernel has by then transmitted what the application
        // wrote (on loopback, all of it): the data queued here waits only
        // for the peer's credits, so it is sent first, while the peer
        // keeps granting credits; what is still stuck then (no credit for
        // `LINGER_ZERO_STALL`, or the linger time is up), a buffer held by
        // `TCP_CORK`, and everything if unread data is here, is dropped.
        if socket2::SockRef::from(&self.sock)
            .linger()
            .is_ok_and(|l| l == Some(Duration::ZERO))
        {
            self.progress(&mut st);
            if st.rx.is_empty() {
                self.flush_tx(&mut st);
                let deadline = Instant::now() + self.linger;
                let mut moved = Instant::now();
                while ((!st.tx_queue.is_empty() && !st.cork_held) || st.tx_inflight > 0)
                    && !st.failed()
                {
                    let now = Instant::now();
                    if now >= deadline || now - moved >= LINGER_ZERO_STALL {
                        break;
                    }
                    if self.progress(&mut st) {
                        moved = now;
                    } else {
                        st.unlocked(|| std::thread::sleep(Duration::from_micros(50)));
                    }
                }
            }
            self.reset(
                &mut st,
                io::ErrorKind::ConnectionAborted,
                "closed with SO_LINGER 0",
            );
            return None;
        }
        self.progress(&mut st);
        if !st.rx.is_empty() {
            // Unread data at close: reset, as TCP does.
            self.reset(
                &mut st,
                io::ErrorKind::ConnectionReset,
                "closed with unread data",
            );
            return None;
        }
        st.disconn_wanted = true;
        st.nodelay = true;
        self.flush_tx(&mut st);
        let deadline = Instant::now() + self.linger;
        while (!st.tx_queue.is_empty() || !st.sdp.close.local_disconn || st.tx_inflight > 0)
            && !st.failed()
            && Instant::now() < deadline
        {
            if !self.progress(&mut st) {
                st.unlocked(|| std::thread::sleep(Duration::from_micros(50)));
            }
        }
        let sent_all = st.err.is_none() && st.sdp.close.local_disconn && st.tx_inflight == 0;
        if st.link.is_some() && sent_all && st.sdp.close.peer_disconn {
            // Both DisConns were exchanged and the peer closed its TCP side
            // first: the engine answers its FIN; nothing to reset.
        } else if st.failed() || !sent_all {
            // (After the peer's complete close, DisConn then FIN, which the
            // engine answered, the QP is idle: the engine's abort of an
            // idle QP makes no system call and sends nothing.)
            self.qp.abort();
        } else if self.qp.disconnect().is_ok() && !self.peer_fin_seen() {
            // The peer's FIN is to be waited for (bounded): if the process
            // exited, or the QP's socket were closed, before it came, the
            // kernel would reset a connection whose last octets (a credit
            // update) were not read, and the peer could lose data. The
            // caller waits (`wait_fin`: this thread receives it itself,
            // sleeping on the socket in the CQ; an engine thread leaves a
            // socket that was just polled alone for a while, and waiting
            // for it made every close take milliseconds), or lists the
            // connection to be waited for later (`exit::defer_fin`).
            return Some(deadline);
        }
        None
    }

    /// After our FIN (`QueuePair::disconnect`): waits until the peer's
    /// FIN has come too (the QP is idle, or in error), or `deadline`;
    /// returns whether it came.
    fn wait_fin(&self, st: &mut Locked<'_>, deadline: Instant) -> bool {
        let mut out = [softrdma_engine::WorkCompletion::success(0, WcOpcode::Send, 0); 16];
        loop {
            if matches!(
                self.qp.state(),
                softrdma_engine::QpState::Idle | softrdma_engine::QpState::Error
            ) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            let step = (deadline - now).min(Duration::from_millis(2));
            match st.poller.take() {
                Some(gate) => {
                    // The gate goes back even if this panics (see
                    // `wait_inner`).
                    let section = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let n = st.unlocked(|| self.cq.wait_progress(&mut out, Some(step)));
                        for wc in &out[..n] {
                            self.on_wc(st, wc);
                        }
                    }));
                    st.poller = Some(gate);
                    if let Err(panic) = section {
                        std::panic::resume_unwind(panic);
                    }
                }
                // A completion callback is handling the CQ right now.
                None => st.unlocked(|| std::thread::sleep(Duration::from_micros(50))),
            }
        }
    }
}

/// For [`crate::poll`]: readiness over several connections.
impl Offload {
    /// The connection's completion queue (a wait set sleeps on it).
    pub(crate) fn cq(&self) -> &CompletionQueue {
        &self.sh.cq
    }

    /// Whether a read, and a write, would not block now, after handling
    /// the completions the CQ holds (none: no receive attempt, no system
    /// call); the readiness descriptor, if any, is brought up to date.
    pub(crate) fn ready_now(&self) -> (bool, bool) {
        let sh = &*self.sh;
        let mut st = sh.lock();
        if !sh.cq.is_empty() {
            sh.progress(&mut st);
        }
        sh.after(&mut st);
        Shared::readiness(&st)
    }

    /// See [`crate::TcpStream::arrivals`].
    pub(crate) fn arrivals(&self) -> u64 {
        self.sh.arrivals.load(Ordering::Relaxed)
    }

    /// See [`crate::TcpStream::set_readiness_polled`].
    pub(crate) fn set_readiness_polled(&self, on: bool) {
        let sh = &*self.sh;
        let mut st = sh.lock();
        st.ready_polled = on;
        sh.after(&mut st);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn pair() -> (Offload, Offload) {
        pair_with(&Config::default())
    }

    pub(super) fn pair_with(cfg: &Config) -> (Offload, Offload) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let cfg = cfg.clone();
        let c = cfg.clone();
        let t = std::thread::spawn(move || {
            Offload::establish(
                TcpStream::connect(addr).unwrap(),
                true,
                &c,
                &crate::net::Known::default(),
            )
            .unwrap()
        });
        let s = Offload::establish(
            l.accept().unwrap().0,
            false,
            &cfg,
            &crate::net::Known::default(),
        )
        .unwrap();
        (t.join().unwrap(), s)
    }

    /// `TCP_CORK`: small writes with `TCP_NODELAY` on and nothing in
    /// flight are held while corked and go as one message when the cork is
    /// taken out (an HTTP server's header and body: one message, one
    /// arrival at the reader).
    /// A receive slot's SGE, computed from the region's span, is the one
    /// the region gives for the slot's range, for every slot of the ring;
    /// none past it.
    #[test]
    fn slot_sges_are_the_regions_own() {
        let (c, s) = pair();
        for o in [&c, &s] {
            let sh = &o.sh;
            for slot in 0..sh.rx_max {
                let want = sh
                    .rx_mr
                    .sge(sh.slot_base(slot), sh.buf_size as u32)
                    .unwrap();
                assert_eq!(sh.slot_sge(slot), Some(want), "slot {slot}");
            }
            assert_eq!(sh.slot_sge(sh.rx_max), None);
            assert!(sh.post_slot(sh.rx_max).is_err());
        }
        close_pair(c, s);
    }

    /// A connection whose QP went into error reports the lost link in the
    /// words it always had (the status of the first flushed work request),
    /// though they are made only when a call reports them; a refused
    /// repost is said in the engine's words.
    #[test]
    fn a_lost_link_is_reported_with_the_first_flushed_status() {
        let (c, s) = pair();
        c.sh.qp.abort();
        let mut b = [0u8; 8];
        let e = c.read(&mut b, false, false, Some(Duration::from_secs(10)));
        let e = e.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(e.to_string(), "connection lost (IBV_WC_WR_FLUSH_ERR)");
        // A second loss does not replace the first.
        c.sh.lock().link_lost(String::from("later"));
        assert_eq!(
            c.sh.lock().error().unwrap().to_string(),
            "connection lost (IBV_WC_WR_FLUSH_ERR)"
        );
        let refused = softrdma_engine::qp::PostRecvError::QueueFull { depth: 4 };
        assert_eq!(LinkLost::PostRecv(refused).to_string(), refused.to_string());
        close_pair(c, s);
    }

    #[test]
    fn cork_holds_small_writes_and_uncork_sends_them_as_one_message() {
        let (c, s) = pair();
        c.set_nodelay(true);
        c.set_cork(true);
        assert!(c.cork());
        assert_eq!(
            c.write(b"HTTP/1.1 200 OK\r\n\r\n", false, None).unwrap(),
            19
        );
        assert_eq!(c.write(b"body", false, None).unwrap(), 4);
        // Held: nothing was posted for them.
        {
            let st = c.sh.lock();
            assert_eq!(st.tx_queue.len(), 1);
            assert_eq!(st.tx_queue[0].1, 23);
            // Held by the cork alone: the CQ is not armed for it (an armed
            // CQ costs a wake-up of the engine's threads per completion).
            assert!(!st.armed);
        }
        let before = s.arrivals();
        c.set_cork(false);
        assert!(c.sh.lock().tx_queue.is_empty());
        let mut got = Vec::new();
        let mut b = [0u8; 64];
        while got.len() < 23 {
            let n = s.read(&mut b, false, false, None).unwrap();
            assert!(n > 0);
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, b"HTTP/1.1 200 OK\r\n\r\nbody");
        assert_eq!(s.arrivals() - before, 1, "one message");
        // Uncorked, with TCP_NODELAY: a small write goes at once again.
        assert_eq!(c.write(b"next", false, None).unwrap(), 4);
        assert!(c.sh.lock().tx_queue.is_empty());
        close_pair(c, s);
    }

    /// Corked data is not held for ever: after the kernel's ceiling of
    /// 200 ms the next call on the connection sends it.
    #[test]
    fn corked_data_goes_after_the_ceiling() {
        let (c, s) = pair();
        c.set_nodelay(true);
        c.set_cork(true);
        assert_eq!(c.write(b"held", false, None).unwrap(), 4);
        assert_eq!(c.sh.lock().tx_queue.len(), 1);
        std::thread::sleep(CORK_MAX + Duration::from_millis(20));
        // Any call that looks at the connection (a wait's readiness look).
        let _ = c.ready_now();
        assert!(c.sh.lock().tx_queue.is_empty());
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b, false, false, None).unwrap(), 4);
        assert_eq!(&b[..4], b"held");
        close_pair(c, s);
    }

    /// Closes the two ends of a pair at the same time, one from another
    /// thread.
    pub(super) fn close_pair(c: Offload, s: Offload) {
        let t = std::thread::spawn(move || drop(c));
        drop(s);
        t.join().unwrap();
    }

    /// A server that closes after its client closed completely (DisConn,
    /// then FIN, answered by the engine: redis-benchmark's connections at
    /// the end of a run) finds a connection that ended in order: its QP
    /// is idle, and closing it resets nothing (the engine's abort of an
    /// idle QP makes no system call: its own tests).
    #[test]
    fn close_after_the_peers_complete_close_does_not_reset() {
        let (c, s) = pair();
        assert_eq!(c.write(b"q", false, None).unwrap(), 1);
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b, false, false, None).unwrap(), 1);
        assert_eq!(s.write(b"a", false, None).unwrap(), 1);
        assert_eq!(c.read(&mut b, false, false, None).unwrap(), 1);
        drop(c);
        assert_eq!(s.read(&mut b, false, false, None).unwrap(), 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.sh.qp.state() != softrdma_engine::QpState::Idle && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(s.sh.qp.state(), softrdma_engine::QpState::Idle);
        let sh = s.sh.clone();
        drop(s);
        assert!(matches!(
            sh.qp.state(),
            softrdma_engine::QpState::Idle | softrdma_engine::QpState::Error
        ));
    }

    /// Regression: a close with `SO_LINGER` on and a zero time sent the
    /// queued data, the DisConn and the FIN: the peer read the data and
    /// EOF, where the kernel's TCP resets the connection (`ECONNRESET`).
    /// It now resets (AbortConn, RST), and the connection is not listed to
    /// wait for the peer's FIN.
    #[test]
    fn a_close_with_so_linger_zero_sent_eof_instead_of_a_reset() {
        let (c, s) = pair();
        assert_eq!(c.write(b"dropped", false, None).unwrap(), 7);
        socket2::SockRef::from(&c.sh.sock)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        let kept = Arc::downgrade(&c.sh);
        drop(c);
        let mut b = [0u8; 16];
        let end = loop {
            match s.read(&mut b, false, false, Some(Duration::from_secs(20))) {
                Ok(0) => break Ok(0),
                Ok(_) => {}
                Err(e) => break Err(e.kind()),
            }
        };
        assert_eq!(
            end,
            Err(io::ErrorKind::ConnectionReset),
            "the peer was not reset"
        );
        assert_eq!(kept.strong_count(), 0, "listed after an abortive close");
        drop(s);
    }

    /// Regression: a close with `SO_LINGER` on and a zero time dropped
    /// all the data still queued, also what waited only for the peer's
    /// credits (they run out after a few messages), where the kernel's
    /// abortive close has transmitted what was written: a concurrent
    /// reader got a fraction, then the reset. It now gets every octet,
    /// then the reset (not EOF).
    #[test]
    fn a_close_with_so_linger_zero_dropped_data_waiting_for_credits() {
        const N: usize = 40;
        const SZ: usize = 1000;
        // Few receive buffers: the peer's credits run out after 4 messages.
        let (c, s) = pair_with(&Config {
            buf_size: 16 * 1024,
            rx_bufs: 4,
            tx_bufs: 8,
            ..Config::default()
        });
        c.set_nodelay(true);
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut b = [0u8; 4096];
            let end = loop {
                match s.read(&mut b, false, false, Some(Duration::from_secs(20))) {
                    Ok(0) => break Ok(0),
                    Ok(n) => got.extend_from_slice(&b[..n]),
                    Err(e) => break Err(e.kind()),
                }
            };
            (got, end)
        });
        let all: Vec<u8> = (0..N * SZ).map(|i| (i % 251) as u8).collect();
        for m in all.chunks(SZ) {
            let mut done = 0;
            while done < m.len() {
                done += c.write(&m[done..], false, None).unwrap();
            }
        }
        socket2::SockRef::from(&c.sh.sock)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(c);
        let (got, end) = reader.join().unwrap();
        assert_eq!(got.len(), all.len(), "octets read before the end");
        assert!(got == all, "the octets read differ from those written");
        assert_eq!(
            end,
            Err(io::ErrorKind::ConnectionReset),
            "the peer was not reset"
        );
    }

    /// A close that returned before the peer's FIN keeps the connection
    /// (its QP, socket and regions) only until that FIN has come: the
    /// peer reads everything and EOF, and a later close or setup lets the
    /// connection go.
    #[test]
    fn a_connection_closed_before_the_peers_fin_is_let_go_once_it_came() {
        let (c, s) = pair();
        assert_eq!(c.write(b"last", false, None).unwrap(), 4);
        let kept = Arc::downgrade(&c.sh);
        drop(c);
        let mut b = [0u8; 8];
        assert_eq!(s.read(&mut b, false, false, None).unwrap(), 4);
        assert_eq!(&b[..4], b"last");
        assert_eq!(s.read(&mut b, false, false, None).unwrap(), 0);
        // Our FIN went, the peer's engine answers it; the engine receives
        // for the closed connection (no one polls it here).
        let deadline = Instant::now() + Duration::from_secs(20);
        while kept.strong_count() > 0 && Instant::now() < deadline {
            exit::reap_closing();
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(kept.strong_count(), 0, "the closed connection was kept");
        drop(s);
    }

    /// Regression: the completion callback waited for the connection's
    /// state lock; one engine handler thread runs the callbacks of all the
    /// CQs bound to it in turn, so while an application thread held one
    /// connection's lock (tens of ms in a debug build, copying and
    /// sending 64 KiB buffers) other connections' wake-ups waited too, and
    /// sleepers only saw their completions on the periodic re-poll (the
    /// "lost wake-ups"). The callback now returns at once and the lock's
    /// holder handles the event when it lets go.
    #[test]
    fn callback_never_waits_for_the_state_lock() {
        let (c, s) = pair();
        let held = s.sh.lock();
        let sh = s.sh.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            sh.on_event(&sh.cq);
            let _ = tx.send(());
        });
        // Generous: this fails only if the callback blocks on the lock.
        rx.recv_timeout(Duration::from_secs(20))
            .expect("the callback waited for the state lock");
        assert!(s.sh.event_pending.load(Ordering::SeqCst));
        // Letting go handles it: the CQ is re-armed for whoever needs it.
        drop(held);
        assert!(!s.sh.event_pending.load(Ordering::SeqCst));
        // Data still flows both ways.
        assert_eq!(c.write(b"ping", false, None).unwrap(), 4);
        c.flush(None).unwrap();
        let mut b = [0u8; 4];
        let mut n = 0;
        while n < 4 {
            n += s
                .read(&mut b[n..], false, false, Some(Duration::from_secs(20)))
                .unwrap();
        }
        assert_eq!(&b, b"ping");
    }
}

/// Tests of blocked calls driving the connection from their own thread.
#[cfg(test)]
mod drive_tests {
    use super::*;

    std::thread_local! {
        /// The next wait of this thread holding the `poller` gate panics
        /// (see [`panic_in_wait_if_asked`]).
        static PANIC_IN_WAIT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Called by a wait holding the `poller` gate: panics once if this
    /// thread asked for it (a panic anywhere in the wait, as a failed
    /// assertion in the receive path would).
    pub(super) fn panic_in_wait_if_asked() {
        if PANIC_IN_WAIT.with(|p| p.replace(false)) {
            panic!("panic asked for in the wait");
        }
    }

    std::thread_local! {
        /// The next sleep in `recv` of this thread panics without the
        /// state lock (1), or after taking it back with `hand` (2).
        static PANIC_IN_RECV_WAIT: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    }

    /// Called by a wait about to sleep in `recv`, the state lock let go:
    /// panics once as this thread asked ([`PANIC_IN_RECV_WAIT`]).
    pub(super) fn panic_in_recv_wait_if_asked(hand: &mut dyn FnMut() -> bool) {
        match PANIC_IN_RECV_WAIT.with(|p| p.replace(0)) {
            0 => {}
            1 => panic!("panic asked for in the sleep in recv"),
            _ => {
                assert!(hand(), "the state lock was not free");
                panic!("panic asked for in the sleep in recv, the lock taken back");
            }
        }
    }

    /// A panic in the wait in `recv`, where the state lock is let go (and
    /// may be taken back early, `Locked::unlocked_taking_back`), with or
    /// without the lock taken back: the lock is held again when the
    /// panic reaches the wait's handler, which puts the gate back (a
    /// handler that found the lock let go panicked again, and the gate
    /// stayed taken out: a later blocking read slept for good).
    #[test]
    fn a_panic_in_the_sleep_in_recv_does_not_leave_the_poller_gate_taken() {
        no_safety_net();
        within(Duration::from_secs(60), || {
            let (c, s) = nodelay_pair();
            let mut buf = [0u8; 64];
            for (round, mode) in [1u8, 2].into_iter().enumerate() {
                PANIC_IN_RECV_WAIT.with(|p| p.set(mode));
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    c.read(&mut buf, false, false, None)
                }));
                let msg = r.expect_err("the read did not panic");
                let msg = msg
                    .downcast_ref::<&str>()
                    .copied()
                    .or(msg.downcast_ref::<String>().map(String::as_str))
                    .unwrap_or("")
                    .to_string();
                assert!(
                    msg.starts_with("panic asked for in the sleep in recv"),
                    "{msg}"
                );
                assert!(c.sh.lock().poller.is_some(), "the gate was not put back");
                assert!(!c.sh.lock().recv_sleeping);
                let s2 = s.clone();
                let writer = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(20));
                    s2.write(&ping_message(round), false, None).unwrap();
                });
                read_full(&c, &mut buf);
                assert_eq!(&buf[..], &ping_message(round)[..]);
                writer.join().unwrap();
            }
            super::tests::close_pair(c, s);
        });
    }

    /// A panic while a blocked read held the `poller` gate (turned into an
    /// error by its caller, as the preload's guard does) left the gate
    /// taken out for good: every later blocking call on the connection
    /// slept forever. The gate goes back on unwind: a later blocking read
    /// gets the data.
    #[test]
    fn a_panic_in_the_wait_does_not_leave_the_poller_gate_taken() {
        no_safety_net();
        within(Duration::from_secs(60), || {
            let (c, s) = nodelay_pair();
            PANIC_IN_WAIT.with(|p| p.set(true));
            let mut buf = [0u8; 64];
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                c.read(&mut buf, false, false, None)
            }));
            assert!(r.is_err(), "the read did not panic");
            assert!(c.sh.lock().poller.is_some(), "the gate was not put back");
            assert!(!c.sh.lock().recv_sleeping);
            let writer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                s.write(&ping_message(1), false, None).unwrap();
                s
            });
            read_full(&c, &mut buf);
            assert_eq!(&buf[..], &ping_message(1)[..]);
            let s = writer.join().unwrap();
            super::tests::close_pair(c, s);
        });
    }

    /// Makes the safety-net re-poll of sleeping calls 10 minutes: a
    /// wake-up the driving thread fails to give then hangs the test
    /// instead of costing 50 ms.
    fn no_safety_net() {
        REPOLL_MS.store(600_000, Ordering::Relaxed);
    }

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(31) ^ (i >> 9)) as u8
    }

    /// A connected pair, `TCP_NODELAY` at both ends: for ping-pongs.
    fn nodelay_pair() -> (Offload, Offload) {
        let (c, s) = super::tests::pair();
        c.set_nodelay(true);
        s.set_nodelay(true);
        (c, s)
    }

    /// The 64-octet message of round `i` of a ping-pong.
    fn ping_message(i: usize) -> Vec<u8> {
        (0..64).map(|k| pattern(i * 64 + k)).collect()
    }

    /// The server end of a ping-pong: reads `rounds` 64-octet messages
    /// and writes each back.
    fn echo_rounds(s: &Offload, rounds: usize) {
        let mut buf = [0u8; 64];
        for _ in 0..rounds {
            read_full(s, &mut buf);
            s.write(&buf, false, None).unwrap();
        }
    }

    /// The client end of a ping-pong against [`echo_rounds`]: writes
    /// `rounds` messages, each after the echo of the one before, and
    /// checks each echo is byte-exact.
    fn ping_rounds(c: &Offload, rounds: usize) {
        let mut back = [0u8; 64];
        for i in 0..rounds {
            let msg = ping_message(i);
            c.write(&msg, false, None).unwrap();
            read_full(c, &mut back);
            assert_eq!(&back[..], &msg[..], "round {i}");
        }
    }

    /// Runs `f` on a thread of its own; fails the test if it has not
    /// ended within `limit` (a lost wake-up hangs it: see
    /// [`no_safety_net`]). A panic of `f` is the test's.
    fn within(limit: Duration, f: impl FnOnce() + Send + 'static) {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            f();
            let _ = tx.send(());
        });
        match rx.recv_timeout(limit) {
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => t.join().unwrap(),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("hung for {limit:?}"),
        }
    }

    /// Waits (bounded) until a read of `o` sleeps in the socket's `recv`.
    fn until_sleeping_in_recv(o: &Offload) {
        for _ in 0..20_000 {
            if o.sh.lock().recv_sleeping {
                return;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        panic!("the blocked read never slept in recv");
    }

    /// A blocked read sleeps in the QP's socket's `recv` (one system call
    /// per wait, as a blocking TCP read) and a 64-octet ping-pong stays
    /// byte-exact, both ends sleeping that way.
    #[test]
    fn a_blocked_read_sleeps_in_recv_and_a_ping_pong_is_byte_exact() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = nodelay_pair();
            const ROUNDS: usize = 300;
            let server = std::thread::spawn(move || {
                echo_rounds(&s, ROUNDS);
                s.sh.lock().recv_sleeps
            });
            ping_rounds(&c, ROUNDS);
            let server_sleeps = server.join().unwrap();
            let client_sleeps = c.sh.lock().recv_sleeps;
            assert!(client_sleeps > 0, "the client never slept in recv");
            assert!(server_sleeps > 0, "the server never slept in recv");
        });
    }

    /// Reads by each end's only handle ([`Offload::read_sole`]) sleep in
    /// the socket's `recv` with no time limit (not the re-poll time, here
    /// 10 minutes: no safety net), and the peer's data ends each sleep: a
    /// read that sleeps before the peer writes gets the data, and a
    /// 64-octet ping-pong stays byte-exact, both ends sleeping that way.
    #[test]
    fn reads_by_the_only_handle_sleep_in_recv_untimed_and_the_peers_data_wakes_them() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = nodelay_pair();
            assert_eq!(Arc::strong_count(&c._close), 1, "the client has a clone");
            assert_eq!(Arc::strong_count(&s._close), 1, "the server has a clone");
            fn read_full_sole(o: &Offload, buf: &mut [u8]) {
                let mut got = 0;
                while got < buf.len() {
                    let n = o.read_sole(&mut buf[got..], false, None).unwrap();
                    assert!(n > 0, "early end after {got} octets");
                    got += n;
                }
            }
            const ROUNDS: usize = 300;
            // The server's state, looked at from here while it sleeps
            // (not a handle: its reads stay the only handle's).
            let server_sh = Arc::clone(&s.sh);
            let server = std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                read_full_sole(&s, &mut buf);
                assert_eq!(&buf[..], &ping_message(0)[..]);
                s.write(&buf, false, None).unwrap();
                for _ in 0..ROUNDS {
                    read_full_sole(&s, &mut buf);
                    s.write(&buf, false, None).unwrap();
                }
                let limit = socket2::SockRef::from(s.socket()).read_timeout().unwrap();
                let sleeps = s.sh.lock().recv_sleeps;
                (sleeps, limit, s)
            });
            // The first message comes only once the server sleeps in
            // `recv`, its time limit set: none.
            for _ in 0..20_000 {
                if server_sh.lock().recv_sleeping {
                    break;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            assert!(
                server_sh.lock().recv_sleeping,
                "the server never slept in recv"
            );
            drop(server_sh);
            c.write(&ping_message(0), false, None).unwrap();
            let mut back = [0u8; 64];
            read_full_sole(&c, &mut back);
            assert_eq!(&back[..], &ping_message(0)[..]);
            for i in 0..ROUNDS {
                let msg = ping_message(i + 1);
                c.write(&msg, false, None).unwrap();
                read_full_sole(&c, &mut back);
                assert_eq!(&back[..], &msg[..], "round {i}");
            }
            let (server_sleeps, server_limit, s) = server.join().unwrap();
            let client_sleeps = c.sh.lock().recv_sleeps;
            let client_limit = socket2::SockRef::from(c.socket()).read_timeout().unwrap();
            assert!(client_sleeps > 0, "the client never slept in recv");
            assert!(server_sleeps > 0, "the server never slept in recv");
            assert_eq!(client_limit, None, "the client slept with a time limit");
            assert_eq!(server_limit, None, "the server slept with a time limit");
            super::tests::close_pair(c, s);
        });
    }

    /// Serializes the tests that look at (or hold) the list of per-thread
    /// counters of sleeps in `recv`.
    static RECV_SLEEP_LIST_TESTS: Mutex<()> = Mutex::new(());

    /// This thread's counter of sleeps in `recv` (listed at its first use),
    /// or `None` if it counts unlisted.
    fn this_threads_recv_sleep_counter() -> Option<Arc<AtomicU64>> {
        THREAD_RECV_SLEEPS.with(|c| match c {
            ThreadRecvSleeps::Listed(c) => Some(Arc::clone(c)),
            ThreadRecvSleeps::Unlisted => None,
        })
    }

    /// The process's count of sleeps in `recv` (counted per thread) holds
    /// the sleeps of both ends of a ping-pong whose threads have ended,
    /// and counts each once: each end's thread's counter held its sleeps
    /// and left the list of live ones at the thread's end (its count went
    /// to the ended threads').
    #[test]
    fn recv_sleeps_counts_the_sleeps_of_threads_that_ended() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let _serial = RECV_SLEEP_LIST_TESTS.lock();
            let before = super::recv_sleeps();
            let (c, s) = nodelay_pair();
            const ROUNDS: usize = 200;
            let server = std::thread::spawn(move || {
                echo_rounds(&s, ROUNDS);
                let n = s.sh.lock().recv_sleeps;
                (n, this_threads_recv_sleep_counter(), s)
            });
            let client = std::thread::spawn(move || {
                ping_rounds(&c, ROUNDS);
                let n = c.sh.lock().recv_sleeps;
                (n, this_threads_recv_sleep_counter(), c)
            });
            let (server_sleeps, server_counter, s) = server.join().unwrap();
            let (client_sleeps, client_counter, c) = client.join().unwrap();
            assert!(server_sleeps > 0 && client_sleeps > 0, "no sleep in recv");
            let server_counter = server_counter.expect("the server's thread counted unlisted");
            let client_counter = client_counter.expect("the client's thread counted unlisted");
            // Each thread slept only in its own end's reads.
            assert_eq!(server_counter.load(Ordering::Relaxed), server_sleeps);
            assert_eq!(client_counter.load(Ordering::Relaxed), client_sleeps);
            // Other tests of this process may sleep meanwhile: at least
            // these.
            let after = super::recv_sleeps();
            assert!(
                after - before >= server_sleeps + client_sleeps,
                "{} counted, the ends slept {server_sleeps} + {client_sleeps}",
                after - before
            );
            let list = super::recv_sleep_counters().lock();
            for (who, counter) in [("server", &server_counter), ("client", &client_counter)] {
                assert!(
                    !list.live.iter().any(|l| Arc::ptr_eq(l, counter)),
                    "the ended {who} thread's counter is still listed as live"
                );
            }
            drop(list);
            super::tests::close_pair(c, s);
        });
    }

    /// A child forked while another thread held the lock of the list of
    /// per-thread counters of sleeps in `recv` keeps it locked for good:
    /// a thread's first count (listing its counter) and its end (its
    /// counter leaving the list, run by its locals' destructors at exit)
    /// blocked on it forever. Here the lock is held by this test instead:
    /// a thread that starts counting and one that ends meanwhile both go
    /// on, and the sleeps they counted are still counted once.
    #[test]
    fn a_thread_neither_starts_nor_ends_blocked_on_a_held_recv_sleep_list_lock() {
        within(Duration::from_secs(60), || {
            let _serial = RECV_SLEEP_LIST_TESTS.lock();
            let before = super::recv_sleeps();
            // Listed before the lock is taken; ends while it is held.
            let (listed_tx, listed_rx) = std::sync::mpsc::channel();
            let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
            let listed = std::thread::spawn(move || {
                count_recv_sleep();
                listed_tx.send(this_threads_recv_sleep_counter()).unwrap();
                end_rx.recv().unwrap();
            });
            let counter = listed_rx
                .recv()
                .unwrap()
                .expect("counted unlisted with the lock free");
            let held = super::recv_sleep_counters().lock();
            // Starts counting while it is held.
            let unlisted = std::thread::spawn(|| {
                count_recv_sleep();
                this_threads_recv_sleep_counter().is_none()
            });
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let was_unlisted = unlisted.join().unwrap();
                end_tx.send(()).unwrap();
                listed.join().unwrap();
                let _ = done_tx.send(was_unlisted);
            });
            let was_unlisted = done_rx
                .recv_timeout(Duration::from_secs(30))
                .expect("a thread blocked on the held lock");
            drop(held);
            assert!(was_unlisted, "listed with the lock held by another");
            let list = super::recv_sleep_counters().lock();
            assert!(
                list.live.iter().any(|l| Arc::ptr_eq(l, &counter)),
                "the counter of the thread that ended with the lock held left the list"
            );
            drop(list);
            assert_eq!(counter.load(Ordering::Relaxed), 1);
            let after = super::recv_sleeps();
            assert!(after - before >= 2, "{} counted, 2 made", after - before);
        });
    }

    /// In a ping-pong the small writes complete in the writing call
    /// (`QueuePair::post_send_now` on the exclusive CQ): nothing in flight
    /// after a write, so the read that follows still sleeps in `recv`, and
    /// the stream stays byte-exact both ways.
    #[test]
    fn ping_pong_writes_complete_in_the_writing_call() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = nodelay_pair();
            const ROUNDS: usize = 300;
            let server = std::thread::spawn(move || {
                let mut buf = [0u8; 64];
                for i in 0..ROUNDS {
                    read_full(&s, &mut buf);
                    assert_eq!(&buf[..], &ping_message(i)[..], "round {i} at the server");
                    buf.iter_mut().for_each(|b| *b = !*b);
                    s.write(&buf, false, None).unwrap();
                    let st = s.sh.lock();
                    assert_eq!(st.tx_inflight, 0, "a completed write left in flight");
                }
                let st = s.sh.lock();
                (st.direct_sends, st.inline_sends)
            });
            let mut back = [0u8; 64];
            for i in 0..ROUNDS {
                let msg = ping_message(i);
                c.write(&msg, false, None).unwrap();
                read_full(&c, &mut back);
                let want: Vec<u8> = msg.iter().map(|b| !*b).collect();
                assert_eq!(&back[..], &want[..], "round {i}");
            }
            let (s_direct, s_inline) = server.join().unwrap();
            let (c_direct, c_inline) = {
                let st = c.sh.lock();
                (st.direct_sends, st.inline_sends)
            };
            assert!(c_inline >= ROUNDS as u64 && s_inline >= ROUNDS as u64);
            // Loopback takes 68 octets at once: (nearly) every write.
            assert!(
                c_direct * 10 >= c_inline * 9 && s_direct * 10 >= s_inline * 9,
                "writes completed in the call: client {c_direct} of {c_inline}, \
                 server {s_direct} of {s_inline}"
            );
        });
    }

    /// A ping-pong's reads sleep in `recv` and get their receive
    /// completions handed straight back, while the connection's other
    /// completions and receives keep their order.
    #[test]
    fn a_ping_pong_read_gets_its_receive_completion_handed_back() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = nodelay_pair();
            const ROUNDS: usize = 300;
            let server = std::thread::spawn(move || {
                echo_rounds(&s, ROUNDS);
                let st = s.sh.lock();
                (st.handed_back, st.recv_sleeps)
            });
            let mut back = [0u8; 64];
            for i in 0..ROUNDS {
                let msg = ping_message(i);
                c.write(&msg, false, None).unwrap();
                read_full(&c, &mut back);
                assert_eq!(&back[..], &msg[..], "round {i}");
            }
            let (s_handed, s_sleeps) = server.join().unwrap();
            let (c_handed, c_sleeps) = {
                let st = c.sh.lock();
                (st.handed_back, st.recv_sleeps)
            };
            // Loopback: (nearly) every read that slept gets its own.
            assert!(
                c_handed * 10 >= c_sleeps * 9 && s_handed * 10 >= s_sleeps * 9,
                "handed back: client {c_handed} of {c_sleeps} sleeps, server {s_handed} of \
                 {s_sleeps}"
            );
            assert!(c_sleeps > 0 && s_sleeps > 0, "no read slept in recv");
        });
    }

    /// A ping-pong of `rounds` 64-octet messages (each answer as two
    /// writes of 32 octets if `split`) while two more threads at each end
    /// peek without blocking all along (taking the CQ's completions, and
    /// receiving, under the state lock while the reader sleeps in
    /// `recv`). Every answer byte-exact and in its round. Returns the
    /// completions handed back to the reads (client, server).
    fn ping_pong_beside_peekers(rounds: usize, split: bool) -> (u64, u64) {
        let (c, s) = nodelay_pair();
        let stop = Arc::new(AtomicBool::new(false));
        let peekers: Vec<_> = [c.clone(), c.clone(), s.clone(), s.clone()]
            .into_iter()
            .map(|o| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 64];
                    while !stop.load(Ordering::Relaxed) {
                        match o.read(&mut buf, true, true, None) {
                            Ok(n) => assert!(n > 0, "end of stream"),
                            Err(e) => assert_eq!(e.kind(), io::ErrorKind::WouldBlock),
                        }
                        std::thread::yield_now();
                    }
                })
            })
            .collect();
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            for i in 0..rounds {
                read_full(&s, &mut buf);
                assert_eq!(&buf[..], &ping_message(i)[..], "round {i} at the server");
                buf.iter_mut().for_each(|b| *b = !*b);
                if split {
                    s.write(&buf[..32], false, None).unwrap();
                    s.write(&buf[32..], false, None).unwrap();
                } else {
                    s.write(&buf, false, None).unwrap();
                }
            }
            let handed = s.sh.lock().handed_back;
            (s, handed)
        });
        let mut back = [0u8; 64];
        for i in 0..rounds {
            let msg = ping_message(i);
            c.write(&msg, false, None).unwrap();
            read_full(&c, &mut back);
            let want: Vec<u8> = msg.iter().map(|b| !*b).collect();
            assert_eq!(&back[..], &want[..], "round {i}");
        }
        let (s, s_handed) = server.join().unwrap();
        stop.store(true, Ordering::Relaxed);
        for t in peekers {
            t.join().unwrap();
        }
        assert!(c.sh.lock().error().is_none() && s.sh.lock().error().is_none());
        let c_handed = c.sh.lock().handed_back;
        (c_handed, s_handed)
    }

    /// Regression: a read about to sleep in `recv` let the state lock go;
    /// another thread of the connection (a non-blocking read, here a
    /// peek) then polled the CQ, received the awaited message itself and
    /// handled its completion (the data queued for the reader), and the
    /// reader went to sleep (in `recv`, or in `poll(2)` when that thread
    /// still held the receive) with the CQ and the socket empty: it slept
    /// until the re-poll time (50 ms; with the tests' 10 minutes, the
    /// ping-pong hung). A poll made beside a reader asleep in `recv` is
    /// now counted, and the reader looks at the count once the receive
    /// is its own, before it sleeps (and at what was handled, before a
    /// `poll(2)` wait).
    #[test]
    fn regression_a_read_does_not_sleep_past_data_another_thread_took_in() {
        no_safety_net();
        within(Duration::from_secs(240), || {
            ping_pong_beside_peekers(20_000, false);
        });
    }

    /// Stress of the receive completions handed back: a ping-pong whose
    /// answers come as two messages (a sleep's receive run may take
    /// both: the first handed back, the second queued behind it) beside
    /// peeking threads at both ends. A completion handled out of its
    /// order, lost or handled twice would show as a wrong, missing or
    /// repeated half (or as the connection's reset), a deadlock as the
    /// time limit; and completions were handed back.
    #[test]
    fn handed_back_receives_stay_in_order_among_peeking_threads() {
        no_safety_net();
        within(Duration::from_secs(240), || {
            let (c_handed, s_handed) = ping_pong_beside_peekers(5_000, true);
            assert!(
                c_handed > 0 && s_handed > 0,
                "nothing handed back: client {c_handed}, server {s_handed}"
            );
        });
    }

    /// Small writes without `TCP_NODELAY` that follow a write (not a
    /// read) keep their completions on the CQ, handled later: the next
    /// ones are held behind the one in flight and go together. Completing
    /// each in its call (as a write that answers a read does) sent every
    /// 64-octet write as a message of its own: `perf stream -s 64 -D 1`
    /// fell from 160–360 to 60–110 MB/s.
    #[test]
    fn small_writes_after_writes_are_still_held_behind_the_one_in_flight() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = super::tests::pair();
            const WRITES: usize = 2000;
            let reader = std::thread::spawn(move || {
                let mut got = vec![0u8; WRITES * 64];
                let mut at = 0;
                while at < got.len() {
                    let n = s.read(&mut got[at..], false, false, None).unwrap();
                    assert!(n > 0);
                    at += n;
                }
                got
            });
            for i in 0..WRITES {
                c.write(&ping_message(i), false, None).unwrap();
            }
            let got = reader.join().unwrap();
            let want: Vec<u8> = (0..WRITES * 64).map(pattern).collect();
            assert!(got == want, "stream not byte-exact");
            let st = c.sh.lock();
            assert_eq!(
                st.direct_sends, 0,
                "a write that answers no read completed in its call"
            );
            assert!(
                (st.inline_sends as usize) < WRITES / 2,
                "{} of {WRITES} small writes went as messages of their own",
                st.inline_sends
            );
        });
    }

    /// A writer on a clone of a connection whose reader sleeps in the
    /// socket's `recv` needs the completions of its own sends (two
    /// staging buffers for four buffers' worth): the reader's sleep does
    /// not end for them, so the writer handles them itself. Before it
    /// could, the writer waited for the reader to wake it: until the
    /// re-poll time (here 10 minutes, a hang).
    #[test]
    fn a_writer_beside_a_reader_sleeping_in_recv_handles_its_own_completions() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let cfg = Config {
                tx_bufs: 2,
                zcopy_threshold: 0,
                ..Config::default()
            };
            let (c, s) = super::tests::pair_with(&cfg);
            c.set_nodelay(true);
            // Three full messages: the third needs a staging buffer the
            // first one's send completion frees (the peer's first credits
            // cover all three).
            let payload = cfg.buf_size - BSDH_LEN;
            let total = 3 * payload;
            let reader = c.clone();
            let r = std::thread::spawn(move || {
                let mut b = [0u8; 8];
                let n = reader.read(&mut b, false, false, None).unwrap();
                (n, b[0])
            });
            until_sleeping_in_recv(&c);
            let data: Vec<u8> = (0..total).map(pattern).collect();
            for k in 0..3 {
                let mut off = 0;
                while off < payload {
                    off += c
                        .write(&data[k * payload + off..(k + 1) * payload], false, None)
                        .unwrap();
                }
            }
            recv_all(&s, total);
            s.write(b"x", false, None).unwrap();
            s.flush(None).unwrap();
            assert_eq!(r.join().unwrap(), (1, b'x'));
        });
    }

    /// Another thread's abort ends a read that sleeps in the socket's
    /// `recv` (the reset shuts the socket down), at once.
    #[test]
    fn an_abort_ends_a_read_sleeping_in_recv() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, _s) = super::tests::pair();
            let reader = c.clone();
            let r = std::thread::spawn(move || {
                let mut b = [0u8; 8];
                reader.read(&mut b, false, false, None)
            });
            until_sleeping_in_recv(&c);
            c.abort();
            match r.join().unwrap() {
                Ok(0) | Err(_) => {}
                Ok(n) => panic!("read {n} octets from an aborted connection"),
            }
        });
    }

    /// The application may make its descriptor (a duplicate of the QP's
    /// socket: one open file) non-blocking: a read whose wait then finds
    /// the socket empty sees its `recv` return at once, and the
    /// connection's reads stop sleeping in `recv` (they would spin: no
    /// further wait counts as one) and wait in `poll(2)` again; the
    /// traffic goes on.
    #[test]
    fn reads_go_on_when_the_application_makes_the_socket_non_blocking() {
        no_safety_net();
        within(Duration::from_secs(120), || {
            let (c, s) = super::tests::pair();
            c.set_nodelay(true);
            s.set_nodelay(true);
            let server = std::thread::spawn(move || {
                let mut buf = [0u8; 1];
                loop {
                    let n = s.read(&mut buf, false, false, None).unwrap();
                    if n == 0 {
                        return;
                    }
                    if buf[0] == 20 {
                        // The client's read waits on an empty socket.
                        std::thread::sleep(Duration::from_millis(200));
                    }
                    s.write(&buf[..n], false, None).unwrap();
                }
            });
            let mut b = [0u8; 1];
            let ping = |i: u8, b: &mut [u8; 1]| {
                c.write(&[i], false, None).unwrap();
                assert_eq!(c.read(b, false, false, None).unwrap(), 1);
                assert_eq!(b[0], i);
            };
            for i in 0..20 {
                ping(i, &mut b);
            }
            let sock = socket2::SockRef::from(c.socket());
            assert!(
                !sock.nonblocking().unwrap(),
                "the reads did not make it blocking"
            );
            sock.set_nonblocking(true).unwrap();
            let before = c.sh.lock().recv_sleeps;
            for i in 20..60 {
                ping(i, &mut b);
            }
            assert_eq!(
                c.sh.lock().recv_sleeps,
                before,
                "reads still slept in a non-blocking recv"
            );
            c.shutdown(Shutdown::Write).unwrap();
            server.join().unwrap();
        });
    }

    fn send_all(o: &Offload, total: usize) {
        send_all_watching(o, total, || {});
    }

    /// [`send_all`] with `after` called after every write.
    fn send_all_watching(o: &Offload, total: usize, mut after: impl FnMut()) {
        let mut sent = 0;
        let mut chunk = vec![0u8; 3000];
        while sent < total {
            let n = chunk.len().min(total - sent);
            for (k, b) in chunk[..n].iter_mut().enumerate() {
                *b = pattern(sent + k);
            }
            let mut off = 0;
            while off < n {
                off += o.write(&chunk[off..n], false, None).unwrap();
                after();
            }
            sent += n;
        }
        o.flush(None).unwrap();
    }

    /// Reads until `buf` is full (the stream must not end first).
    fn read_full(o: &Offload, buf: &mut [u8]) {
        let mut got = 0;
        while got < buf.len() {
            let n = o.read(&mut buf[got..], false, false, None).unwrap();
            assert!(n > 0, "early end after {got} octets");
            got += n;
        }
    }

    fn recv_all(o: &Offload, total: usize) {
        let mut got = 0;
        let mut buf = vec![0u8; 5000];
        while got < total {
            let n = o.read(&mut buf, false, false, None).unwrap();
            assert!(n > 0, "early end after {got} octets");
            for (k, &b) in buf[..n].iter().enumerate() {
                assert_eq!(b, pattern(got + k), "octet {}", got + k);
            }
            got += n;
        }
    }

    /// A connection starts with a short receive ring (a short connection
    /// posts and advertises 8 buffers) and grows it to the configured ring
    /// once it has received bulk data; the peer learns of the new buffers
    /// (its credits go beyond the first 8) and every octet arrives in order.
    #[test]
    fn the_receive_ring_grows_after_bulk_data() {
        let (c, s) = super::tests::pair();
        assert_eq!(s.sh.rx_max, u32::from(Config::default().rx_bufs));
        assert!(s.sh.rx_max > RX_INITIAL as u32);
        c.write(b"hello", false, None).unwrap();
        c.flush(None).unwrap();
        let mut b = [0u8; 5];
        let mut n = 0;
        while n < 5 {
            n += s.read(&mut b[n..], false, false, None).unwrap();
        }
        assert_eq!(&b, b"hello");
        {
            let st = s.sh.lock();
            assert_eq!(st.rx_slots, RX_INITIAL as u32);
            assert!(st.sdp.credits.posted() <= RX_INITIAL as u32);
        }
        assert!(c.sh.lock().sdp.credits.tx_credits() <= RX_INITIAL as u32);
        const TOTAL: usize = 3 << 20;
        let reader = std::thread::spawn(move || {
            recv_all(&s, TOTAL);
            s
        });
        // The writer's credits, after every write: a credit update tells
        // it of the grown ring.
        let mut most = 0;
        send_all_watching(&c, TOTAL, || {
            most = most.max(c.sh.lock().sdp.credits.tx_credits());
        });
        let s = reader.join().unwrap();
        assert_eq!(s.sh.lock().rx_slots, s.sh.rx_max);
        assert!(most > RX_INITIAL as u32, "{most}");
    }

    /// A connection's exclusive CQ is made for every receive of the full
    /// ring and its sends (`cq_entries`), while the receive ring starts
    /// small: a bulk transfer whose reader lets its completions queue
    /// grows the ring and loses none.
    #[test]
    fn the_cq_holds_every_completion_of_the_grown_ring() {
        let (c, s) = super::tests::pair();
        let tx = usize::from(Config::default().tx_bufs);
        for e in [&c, &s] {
            assert!(e.sh.cq.is_exclusive());
            assert_eq!(e.sh.cq.capacity(), e.sh.rx_max as usize + tx + CQ_SPARE);
            assert!(e.sh.lock().rx_slots < e.sh.rx_max, "the ring starts small");
        }
        const TOTAL: usize = 3 << 20;
        let reader = std::thread::spawn(move || {
            // Let the first messages' completions queue unpolled.
            std::thread::sleep(Duration::from_millis(20));
            recv_all(&s, TOTAL);
            s
        });
        send_all_watching(&c, TOTAL, || {});
        let s = reader.join().unwrap();
        assert_eq!(s.sh.lock().rx_slots, s.sh.rx_max);
        assert_eq!(
            s.sh.cq.capacity(),
            s.sh.rx_max as usize + tx + CQ_SPARE,
            "the CQ holds the grown ring's completions"
        );
        for e in [&c, &s] {
            assert!(!e.sh.cq.is_overflowed());
        }
        // Both ends still carry data both ways.
        s.write(b"back", false, None).unwrap();
        s.flush(None).unwrap();
        let mut b = [0u8; 4];
        let mut n = 0;
        while n < 4 {
            n += c.read(&mut b[n..], false, false, None).unwrap();
        }
        assert_eq!(&b, b"back");
    }

    /// The wake-up pair of sleeping calls is made only when a call sleeps
    /// while another drives the connection: a connection whose calls are
    /// one at a time never makes it.
    #[test]
    fn one_call_at_a_time_makes_no_wakeup_pair() {
        let (c, s) = super::tests::pair();
        let echo = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            for _ in 0..100 {
                let n = s.read(&mut b, false, false, None).unwrap();
                assert!(n > 0);
                let mut off = 0;
                while off < n {
                    off += s.write(&b[off..n], false, None).unwrap();
                }
            }
            s
        });
        c.set_nodelay(true);
        let mut b = [0u8; 64];
        for i in 0..100u8 {
            assert_eq!(c.write(&[i; 64], false, None).unwrap(), 64);
            let mut got = 0;
            while got < 64 {
                got += c.read(&mut b[got..], false, false, None).unwrap();
            }
            assert_eq!(b, [i; 64]);
        }
        let s = echo.join().unwrap();
        assert!(c.sh.waker.get().is_none() && s.sh.waker.get().is_none());
    }

    /// Small writes go inline when nothing is queued before them and
    /// they would not be corked, staged otherwise: mixed with corked small
    /// writes and large buffered ones, in both NODELAY settings, every
    /// octet arrives once and in order.
    #[test]
    fn inline_small_writes_keep_the_stream_order() {
        let (c, s) = super::tests::pair();
        const TOTAL: usize = 600_000;
        let reader = std::thread::spawn(move || {
            recv_all(&s, TOTAL);
            s
        });
        let sizes = [
            1usize,
            64,
            INLINE_PAYLOAD,
            INLINE_PAYLOAD + 1,
            7,
            70_000,
            3,
            200,
        ];
        let mut sent = 0;
        let mut k = 0;
        while sent < TOTAL {
            c.set_nodelay(k % 3 != 0);
            let n = sizes[k % sizes.len()].min(TOTAL - sent);
            let chunk: Vec<u8> = (sent..sent + n).map(pattern).collect();
            let mut off = 0;
            while off < n {
                off += c.write(&chunk[off..], false, None).unwrap();
            }
            sent += n;
            k += 1;
        }
        c.flush(None).unwrap();
        let _s = reader.join().unwrap();
        assert!(c.sh.lock().inline_sends > 0, "no write went inline");
    }

    /// Gathering writes of 1 to 5 pieces of every size (empty, inline,
    /// just over inline, across staging buffers), copied straight into
    /// the send buffers or an inline message, in both NODELAY settings:
    /// every octet arrives once and in order.
    #[test]
    fn vectored_writes_are_byte_exact() {
        let (c, s) = super::tests::pair();
        const TOTAL: usize = 900_000;
        let reader = std::thread::spawn(move || {
            recv_all(&s, TOTAL);
            s
        });
        let sizes = [
            0usize,
            1,
            13,
            100,
            INLINE_PAYLOAD - 1,
            INLINE_PAYLOAD,
            INLINE_PAYLOAD + 1,
            5000,
            70_000,
            3,
        ];
        let (mut sent, mut k) = (0, 0);
        while sent < TOTAL {
            c.set_nodelay(k % 2 == 0);
            let mut data = Vec::new();
            let mut lens = Vec::new();
            for j in 0..1 + k % 5 {
                let n = sizes[(k + j * 3) % sizes.len()].min(TOTAL - sent - data.len());
                let at = sent + data.len();
                data.extend((at..at + n).map(pattern));
                lens.push(n);
            }
            let mut off = 0;
            while off < data.len() {
                let mut pieces = Vec::new();
                let mut at = 0;
                for &n in &lens {
                    if at + n > off {
                        pieces.push(io::IoSlice::new(&data[at.max(off)..at + n]));
                    }
                    at += n;
                }
                off += c.write_vectored(&pieces, false, None).unwrap();
            }
            sent += data.len();
            k += 1;
        }
        c.flush(None).unwrap();
        let _s = reader.join().unwrap();
        assert!(
            c.sh.lock().inline_sends > 0,
            "no gathered write went inline"
        );
    }

    /// Regression for the hand-off of the blocked call driving the
    /// connection: a reader and a writer thread on each end of one
    /// connection (a `try_clone` pair), all calls blocking without
    /// timeout, small buffers so that writers wait for send completions
    /// and credits that the reader, waiting in the CQ, takes out. A
    /// wake-up lost between them hangs a thread (the safety net is off).
    #[test]
    fn reader_and_writer_threads_wake_each_other() {
        no_safety_net();
        let cfg = Config {
            rx_bufs: crate::sdp::MIN_RING,
            tx_bufs: 2,
            buf_size: 4096,
            ..Config::default()
        };
        let (c, s) = super::tests::pair_with(&cfg);
        const TOTAL: usize = 3 << 20;
        let (tx, rx) = std::sync::mpsc::channel();
        let mut threads = Vec::new();
        for (o, write) in [(c.clone(), true), (c, false), (s.clone(), true), (s, false)] {
            let tx = tx.clone();
            threads.push(std::thread::spawn(move || {
                if write {
                    send_all(&o, TOTAL);
                } else {
                    recv_all(&o, TOTAL);
                }
                let _ = tx.send(write);
                o
            }));
        }
        for _ in 0..4 {
            rx.recv_timeout(Duration::from_secs(300))
                .expect("a blocked call was never woken");
        }
        // Close from this thread, both ends at once.
        let ends: Vec<Offload> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let closer = std::thread::spawn(move || drop(ends));
        closer.join().unwrap();
    }

    /// A blocked read that drives the connection takes the completions
    /// out of the CQ itself: what it leaves unread must still make the
    /// readiness descriptor readable (no completion event is left for the
    /// callback to do it).
    #[test]
    fn readiness_follows_data_taken_in_by_a_blocked_read() {
        no_safety_net();
        let (c, s) = super::tests::pair();
        s.readiness_fd().unwrap();
        let reader = s.clone();
        let t = std::thread::spawn(move || {
            let mut one = [0u8; 1];
            reader.read(&mut one, false, false, None).unwrap();
            one[0]
        });
        // Let the reader block (not needed for correctness: either way one
        // octet is left unread).
        std::thread::sleep(Duration::from_millis(20));
        c.set_nodelay(true);
        assert_eq!(c.write(b"ab", false, None).unwrap(), 2);
        assert_eq!(t.join().unwrap(), b'a');
        let fd =
            s.sh.st
                .lock()
                .ready
                .as_ref()
                .unwrap()
                .app
                .try_clone()
                .unwrap();
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::IN,
        )];
        let limit = rustix::time::Timespec {
            tv_sec: 20,
            tv_nsec: 0,
        };
        let n = rustix::event::poll(&mut fds, Some(&limit)).unwrap();
        assert_eq!(n, 1, "readiness descriptor not readable with data unread");
        let mut b = [0u8; 4];
        assert_eq!(s.read(&mut b, false, true, None).unwrap(), 1);
        assert_eq!(b[0], b'b');
        super::tests::close_pair(c, s);
    }
}

#[cfg(test)]
mod pool_tests {
    use super::*;

    fn pooled(len: usize) -> usize {
        mr_pool().lock().count(len)
    }

    /// The buffer regions of a cleanly closed connection serve the next
    /// one instead of a new registration.
    #[test]
    fn closed_connections_buffers_are_reused() {
        // Sizes no other test uses, so the pool counts are this test's.
        let cfg = Config {
            rx_bufs: 5,
            tx_bufs: 3,
            buf_size: 12288,
            ..Config::default()
        };
        let (rx_len, tx_len) = (5 * 12288, 3 * 12288);
        let (c, s) = super::tests::pair_with(&cfg);
        assert_eq!(c.write(b"x", false, None).unwrap(), 1);
        super::tests::close_pair(c, s);
        let deadline = Instant::now() + Duration::from_secs(20);
        while pooled(rx_len) < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!((pooled(rx_len), pooled(tx_len)), (2, 2));
        let (_c, _s) = super::tests::pair_with(&cfg);
        assert_eq!((pooled(rx_len), pooled(tx_len)), (0, 0));
    }

    /// The pool follows the working set: after more connections than
    /// [`MR_POOL_MIN`] were open at once, all their regions are kept (the
    /// pool of 16 regions unmapped the rest, and the next wave of
    /// connections mapped them again).
    #[test]
    fn pool_keeps_the_regions_of_every_connection_of_a_wave() {
        let cfg = Config {
            rx_bufs: 4,
            tx_bufs: 2,
            buf_size: 20480,
            ..Config::default()
        };
        let (rx_len, tx_len) = (4 * 20480, 2 * 20480);
        let pairs: Vec<_> = (0..12).map(|_| super::tests::pair_with(&cfg)).collect();
        assert!(PEAK_CONNS.load(Ordering::Relaxed) >= 24);
        for (c, s) in pairs {
            super::tests::close_pair(c, s);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        // Each region whose connection ended cleanly (on a loaded machine
        // a close can end by its linger time, and its regions go).
        while pooled(rx_len) + pooled(tx_len) <= MR_POOL_MIN && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(pooled(rx_len) + pooled(tx_len) > MR_POOL_MIN);
        // The next wave takes them all.
        let again: Vec<_> = (0..12).map(|_| super::tests::pair_with(&cfg)).collect();
        assert_eq!((pooled(rx_len), pooled(tx_len)), (0, 0));
        for (c, s) in again {
            super::tests::close_pair(c, s);
        }
    }

    /// A region is kept only within the memory bounds: one whose users
    /// can have touched more than [`POOL_REGION_RESIDENT_MAX`] of it (a
    /// grown receive ring) is unregistered, and so is one past the pool's
    /// total [`POOL_RESIDENT_MAX`].
    #[test]
    fn pool_keeps_regions_within_the_memory_bounds() {
        let pd = &engine().unwrap().pd;
        let mut pool = MrPool::default();
        let len = 2 * POOL_REGION_RESIDENT_MAX;
        let mr = pd.register(len, Access::LOCAL_WRITE).unwrap();
        assert!(pool.give(mr, len, 100).is_some());
        assert!(pool.regions.is_empty(), "a region that can be all resident");
        let mr = pd.register(len, Access::LOCAL_WRITE).unwrap();
        assert!(pool.give(mr, 4096, 100).is_none());
        assert_eq!((pool.regions.len(), pool.resident), (1, 4096));
        // The count bound, per size.
        let mr = pd.register(len, Access::LOCAL_WRITE).unwrap();
        assert!(pool.give(mr, 4096, 1).is_some());
        assert_eq!(pool.regions.len(), 1);
        let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        assert!(pool.give(mr, 4096, 1).is_none());
        assert_eq!((pool.regions.len(), pool.resident), (2, 8192));
        assert!(pool.take(4096).is_some());
        // The total bound.
        pool.resident = POOL_RESIDENT_MAX - 4096;
        let mr = pd.register(8192, Access::LOCAL_WRITE).unwrap();
        assert!(pool.give(mr, 8192, 100).is_some());
        assert_eq!(pool.regions.len(), 1);
        pool.resident = 4096;
        assert!(pool.take(len).is_some());
        assert_eq!((pool.regions.len(), pool.resident), (0, 0));
        assert!(pool.take(len).is_none());
    }

    /// A connection's receive region is bounded by the slots it posted:
    /// a short connection's (the first ring) is kept, a grown ring's is not.
    #[test]
    fn receive_region_bound_is_the_posted_slots() {
        let cfg = Config {
            rx_bufs: 40,
            tx_bufs: 2,
            buf_size: 36864,
            ..Config::default()
        };
        let rx_len = 40 * 36864;
        let (c, s) = super::tests::pair_with(&cfg);
        let slots = s.sh.lock().rx_slots as usize;
        assert!(slots * 36864 <= POOL_REGION_RESIDENT_MAX && rx_len > POOL_REGION_RESIDENT_MAX);
        super::tests::close_pair(c, s);
        let deadline = Instant::now() + Duration::from_secs(20);
        while pooled(rx_len) < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        // Both ends' regions, unless a close ended by its linger time on a
        // loaded machine (its regions go).
        assert!(pooled(rx_len) >= 1);
        let bound: usize = mr_pool()
            .lock()
            .regions
            .iter()
            .filter(|p| p.len == rx_len)
            .map(|p| p.resident)
            .sum();
        assert!(bound <= 2 * POOL_REGION_RESIDENT_MAX);
    }
}

#[cfg(test)]
mod zcopy_tests {
    use super::*;

    fn zc_cfg() -> Config {
        Config {
            zcopy_threshold: 64 * 1024,
            zcopy_timeout: Duration::from_millis(300),
            ..Config::default()
        }
    }

    /// A large write while the exit flush runs (another thread's) goes by
    /// copy, queued ahead of the flush's DisConn: a zero-copy offer could
    /// follow the DisConn (the write failed with a lost link). The peer
    /// ignores offers here, so an offer would never complete.
    #[test]
    fn a_large_write_during_the_exit_flush_goes_by_copy() {
        let (c, s) = super::tests::pair_with(&zc_cfg());
        assert!(c.zero_copy() && s.zero_copy());
        s.sh.lock().test.ignore_src_avail = true;
        c.sh.lock().exit_flush = true;
        let reader = std::thread::spawn(move || {
            let mut got = 0;
            let mut b = vec![0u8; 65536];
            while got < 200_000 {
                let k = s
                    .read(&mut b, false, false, Some(Duration::from_secs(60)))
                    .unwrap();
                assert!(k > 0 && b[..k].iter().all(|&x| x == 0x5a));
                got += k;
            }
            s.sh.lock().test.ignored.len()
        });
        let data = vec![0x5au8; 200_000];
        let n = c
            .write(&data, false, Some(Duration::from_secs(60)))
            .expect("written by copy");
        assert_eq!(n, data.len());
        assert_eq!(reader.join().unwrap(), 0, "a zero-copy offer was made");
    }

    /// A receiver that takes SrcAvail offers and never reads them nor
    /// answers the cancel: a write with a timeout withdraws its offer,
    /// then resets the connection, and returns (no hang beyond the two
    /// timeouts); the receiver's late RDMA Read of the advertised buffer
    /// gets no data.
    #[test]
    fn peer_that_never_reads_gets_reset() {
        let (c, s) = super::tests::pair_with(&zc_cfg());
        assert!(c.zero_copy() && s.zero_copy());
        s.sh.lock().test.ignore_src_avail = true;
        s.readiness_fd().unwrap();
        let data = vec![0x5au8; 200_000];
        let t0 = Instant::now();
        let err = c
            .write(&data, false, Some(Duration::from_millis(300)))
            .expect_err("the write must fail");
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        // Bounded (generous: this only catches a hang).
        assert!(t0.elapsed() < Duration::from_secs(60));
        assert!(c.write(b"x", false, None).is_err(), "connection not reset");
        let avail = s.sh.lock().test.ignored.first().copied().expect("offer");
        assert_eq!(avail.len, 200_000);
        // The receiver tries to read the old offer now: nothing arrives.
        let eng = engine().unwrap();
        let sink = eng.pd.register(4096, Access::LOCAL_WRITE).unwrap();
        let posted = s.sh.qp.post_send(
            &SendWr::new(
                77,
                SendOp::Read {
                    remote_addr: avail.vaddr,
                    rkey: avail.rkey,
                },
            )
            .sg_list(&[sink.sge(0, 4096).unwrap()])
            .signaled(),
        );
        // Whether or not the post is refused (the reset may have reached
        // this end already), the Read ends in error: the connection is
        // reset and the offer's STag is gone. Its completion may be taken
        // by the callback (the readiness descriptor keeps the CQ armed), so
        // wait for the QP's state instead.
        let _ = posted;
        let deadline = Instant::now() + Duration::from_secs(20);
        while s.sh.qp.state() != softrdma_engine::QpState::Error {
            assert!(
                Instant::now() < deadline,
                "the receiver's QP is {}",
                s.sh.qp.state()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            sink.to_vec().iter().all(|&b| b == 0),
            "data after the write returned"
        );
        super::tests::close_pair(c, s);
    }

    /// A reader with small buffers declines every offer (SendSm): after
    /// the first decline the writer stops offering for a while instead of
    /// paying a round trip per large write.
    #[test]
    fn declined_offers_are_not_repeated() {
        let (c, s) = super::tests::pair_with(&zc_cfg());
        let reader = std::thread::spawn(move || {
            let mut b = [0u8; 1000];
            let mut got = 0usize;
            while got < 20 * 100_000 {
                let n = s.read(&mut b, false, false, None).unwrap();
                assert!(n > 0);
                assert!(b[..n].iter().all(|&x| x == 7));
                got += n;
            }
            s
        });
        let data = vec![7u8; 100_000];
        for _ in 0..20 {
            let mut off = 0;
            while off < data.len() {
                off += c.write(&data[off..], false, None).unwrap();
            }
        }
        c.flush(None).unwrap();
        let s = reader.join().unwrap();
        let declined = c.sh.lock().zc_declined;
        assert_eq!(declined, 1, "declined offers: {declined}");
        super::tests::close_pair(c, s);
    }

    /// A receiver that reports reading more than offered gets the
    /// connection reset; the write returns an error at once.
    #[test]
    fn garbage_rdma_rd_compl_resets() {
        let (c, s) = super::tests::pair_with(&zc_cfg());
        s.sh.lock().test.overread_src_avail = true;
        s.readiness_fd().unwrap();
        let data = vec![1u8; 100_000];
        let err = c
            .write(&data, false, None)
            .expect_err("the write must fail");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{err}");
        super::tests::close_pair(c, s);
    }

    /// Regression: a zero-copy write waited for a credit but not for room
    /// in the send queue: with `sq_cap` sends outstanding its SrcAvail
    /// went over the bound Data sends keep (the queue of `tx_bufs + 8`
    /// also has to hold an AbortConn). It now waits for room as Data does.
    #[test]
    fn a_zero_copy_offer_waits_for_room_in_the_send_queue() {
        let (c, s) = super::tests::pair_with(&zc_cfg());
        assert!(c.zero_copy() && s.zero_copy());
        s.sh.lock().test.ignore_src_avail = true;
        s.readiness_fd().unwrap();
        // Sends the test counts as outstanding: the queue is at its bound.
        let phantom = {
            let mut st = c.sh.lock();
            let k = c.sh.sq_cap - st.tx_inflight;
            st.tx_inflight += k;
            k
        };
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let err = c
            .write(&data, false, Some(Duration::from_millis(200)))
            .expect_err("no room: the write must time out");
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock, "{err}");
        // Time for an offer to arrive, had one been sent.
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            s.sh.lock().test.ignored.is_empty(),
            "SrcAvail sent with the send queue full"
        );
        assert!(c.sh.lock().tx_inflight <= c.sh.sq_cap);
        // Room again: the same write goes by zero copy and arrives.
        c.sh.lock().tx_inflight -= phantom;
        s.sh.lock().test.ignore_src_avail = false;
        let want = data.clone();
        let reader = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut b = vec![0u8; 65536];
            while got.len() < want.len() {
                let n = s.read(&mut b, false, false, None).unwrap();
                assert!(n > 0, "early end");
                got.extend_from_slice(&b[..n]);
            }
            assert!(got == want, "data differs");
            s
        });
        let mut off = 0;
        while off < data.len() {
            off += c.write(&data[off..], false, None).unwrap();
        }
        let s = reader.join().unwrap();
        super::tests::close_pair(c, s);
    }
}

/// Tests of the send queue's bound.
#[cfg(test)]
mod send_queue_tests {

    fn pattern(i: usize) -> u8 {
        (i.wrapping_mul(131) ^ (i >> 7)) as u8
    }

    /// Regression: with `TCP_NODELAY`, every small write went at once as
    /// an inline message, limited only by the peer's credits (up to its
    /// receive ring, 64), while the send queue holds `tx_bufs + 8`
    /// requests: a writer faster than the engine's socket filled it, the
    /// post failed ("send queue full") and the connection was lost
    /// (`softrdma perf stream -s 64 --nodelay`). Writes now wait in the
    /// staging buffers while the queue is full; every octet arrives.
    #[test]
    fn nodelay_small_writes_never_overrun_the_send_queue() {
        let (c, s) = super::tests::pair();
        c.set_nodelay(true);
        const N: usize = 40_000;
        const SZ: usize = 64;
        let reader = std::thread::spawn(move || {
            let mut got = 0;
            let mut buf = vec![0u8; 65536];
            while got < N * SZ {
                let n = s.read(&mut buf, false, false, None).unwrap();
                assert!(n > 0, "early end after {got} octets");
                for (k, &b) in buf[..n].iter().enumerate() {
                    assert_eq!(b, pattern(got + k), "octet {}", got + k);
                }
                got += n;
            }
            s
        });
        let mut sent = 0;
        let mut most = 0;
        for _ in 0..N {
            let chunk: Vec<u8> = (sent..sent + SZ).map(pattern).collect();
            let mut off = 0;
            while off < SZ {
                off += c.write(&chunk[off..], false, None).unwrap();
            }
            sent += SZ;
            most = most.max(c.sh.lock().tx_inflight);
        }
        c.flush(None).unwrap();
        let s = reader.join().unwrap();
        assert!(most <= c.sh.sq_cap, "{most} sends outstanding");
        super::tests::close_pair(c, s);
    }
}
