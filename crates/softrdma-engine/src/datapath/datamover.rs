//! Engine threads: one per usable CPU, each both the *datamover* of its
//! QPs (transmitting what direct sending left) and their *receiver*
//! (reading their sockets when no CQ poller does), over one epoll set.
//!
//! As a datamover, a thread keeps a list of *active* QPs (work ready,
//! socket writable) and a set of *paused* QPs (socket full). It serves
//! active QPs round robin, one slice of
//! [`DeviceConfig::slice_size`](crate::DeviceConfig::slice_size) bytes each
//! per turn, so one large transfer or one congested peer never starves the
//! others. A QP that is the only active one gets turns of 64 slices (fewer,
//! larger writes; new QPs join the round at the next turn). A QP whose
//! socket would block is paused: its socket is armed for writability, and
//! the kernel reports it only once the socket has a useful amount of free
//! space (for TCP, at least a third of the send buffer — the resume
//! threshold that avoids unproductive wake-ups); then the QP becomes active
//! again.
//!
//! As a receiver, the same thread watches the sockets of its QPs for
//! incoming bytes and runs the receive path when one is readable, unless a
//! CQ poller drives that QP (it polled recently, or sleeps on the socket in
//! [`CompletionQueue::wait`](crate::CompletionQueue::wait)): then the
//! thread leaves the socket alone until the poller has been quiet for
//! [`POLL_QUIET_NS`] (re-checking with a back-off while it keeps polling).
//! A socket has one registration, armed one-shot for reading, writing or
//! both (see [`EpollSet`]).
//!
//! A newly connected QP is not handed to its thread at once: the thread
//! that connected it counts as its CQ poller at that moment, so the engine
//! thread takes the socket over only once nobody has polled for
//! [`POLL_QUIET_NS`], or at once when the CQ is armed for notification
//! (the caller leaves the socket to the engine). Registering and
//! unregistering a socket queue the change for the thread without waking
//! it: the thread picks it up at its next turn. If it sleeps past the
//! time the hand-over is due, the registering thread sets the thread's
//! *hand-over timer* (a timer fd in its epoll set: setting it does not
//! wake the thread) to that time, and the QP's unregistering clears it
//! again if no other registration waits for it (see
//! [`Threads::register_rx`]). A short-lived connection whose caller
//! drives it (a connect, a few messages, a close, all within the quiet
//! period) thus never wakes its engine thread: two `timerfd_settime`
//! calls at most, instead of a wake-up (an event fd write, a context
//! switch, the thread's reads) per QP when the thread was idle. A
//! connection that lives longer is looked at once when the hand-over is
//! due, a look that also covers every connection made meanwhile.
//!
//! Each QP is assigned at creation to the thread with the fewest QPs (the
//! lowest-numbered of those with as few). There are never more engine
//! threads than usable CPUs (affinity mask and cgroup CPU quota): a second
//! thread per CPU would only compete with the first (and with the
//! application) for the same CPU time. A thread (its epoll set and its OS
//! thread) is started when the first QP is assigned to it: a process with
//! one connection at a time runs one engine thread, not one per CPU (each
//! thread cost its process about 0.35 ms of CPU to start and end: the
//! clone, its stack, the allocator's per-thread state, the exit).

use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

#[cfg(doc)]
use crate::sys::io::usable_cpus;
use crate::sys::io::{pin_current_thread, spawn_engine_thread};
use crate::sys::poll::{EpollSet, Ready};

/// What the engine threads need from a QP: its keys, the flags they share
/// with it, and its transmit and receive progress. The QP layer implements
/// it (`qp/dm.rs`); the threads hold QPs only as `dyn DmQp`, as the CQ
/// holds them as [`Progress`](crate::cq::Progress).
pub(crate) trait DmQp: Send + Sync + std::fmt::Debug {
    /// The QP number (the key of its socket in an engine thread's table).
    fn qp_num(&self) -> u32;
    /// The engine thread the QP is assigned to ([`Threads::assign`]).
    fn datamover(&self) -> usize;
    /// Set while a datamover lists the QP (active or paused).
    fn dm_listed(&self) -> &AtomicBool;
    /// Set while the QP is registered with the receive threads.
    fn rx_registered(&self) -> &AtomicBool;
    /// The socket it was registered with ([`Threads::register_rx`]):
    /// what [`Threads::claim_rx`] hands a waiter, read without the engine
    /// thread's table (its lock and hash per wait).
    fn rx_fd(&self) -> &AtomicI32;
    /// When a CQ poll last drove the QP's receive path ([`now_ns`] clock).
    fn last_poll(&self) -> &AtomicU64;
    /// Whether CQ pollers drive the receive path
    /// ([`poll_driven_receive`](crate::DeviceConfig::poll_driven_receive)).
    fn poll_driven_receive(&self) -> bool;
    /// Whether the QP still receives: in RTS or CLOSING.
    fn receiving(&self) -> bool;
    /// Whether another thread runs (or is to run) its receive path now.
    fn rx_busy(&self) -> bool;
    /// Transmits for one slice of `slice` bytes.
    fn serve(&self, slice: usize) -> Served;
    /// Receive progress, only if nobody else is receiving (`busy`: the
    /// caller busy-polls).
    fn rx_poll(&self, busy: bool) -> bool;
}

/// Statistics of one engine thread (datamover and receiver).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DatamoverStats {
    /// CPU the thread runs on (pinned if configured).
    pub cpu: usize,
    /// Whether the thread runs: it starts with the first QP assigned to it.
    pub running: bool,
    /// QPs assigned.
    pub qps: usize,
    /// Slices served.
    pub slices: u64,
    /// Times a QP was paused because its socket was full.
    pub pauses: u64,
    /// Times a paused QP was resumed.
    pub resumes: u64,
    /// Times the thread ran the receive path of a readable socket.
    pub receives: u64,
    /// Times another thread woke it (wrote its event fd while it slept)
    /// about a socket to watch: the registration of a QP nobody else
    /// receives for, or a CQ armed for notification. A registration
    /// driven by its caller's polls never wakes it (it sets the hand-over
    /// timer instead).
    pub rx_wakeups: u64,
    /// Times its hand-over timer woke it: a registered QP's quiet period
    /// ended while the thread slept.
    pub handover_timeouts: u64,
}

/// A QP whose socket an engine thread receives from, and the socket.
type RxEntry = (Weak<dyn DmQp>, RawFd);

/// Registrations the engine thread has not looked at yet, and its
/// hand-over timer.
#[derive(Debug, Default)]
struct Handover {
    /// Keys registered lazily and not yet taken from the receive inbox.
    pending: std::collections::HashSet<usize>,
    /// When the hand-over timer is set to expire (engine clock), if set.
    timer_at: Option<u64>,
}

impl Handover {
    /// Clears the hand-over timer of `e`, if set.
    fn clear_timer(&mut self, e: &Engine) {
        if self.timer_at.take().is_some() {
            let _ = e.poll.set_timer(None);
        }
    }
}

#[derive(Debug)]
struct Engine {
    cpu: usize,
    /// QPs with transmit work, handed over by other threads.
    inbox: SegQueue<Arc<dyn DmQp>>,
    /// Keys of QPs whose socket is to be watched for reading (again).
    rx_inbox: SegQueue<usize>,
    /// Connected QPs whose sockets this thread receives from.
    qps: Mutex<HashMap<usize, RxEntry>>,
    /// Lazy registrations not yet seen by the thread, and the hand-over
    /// timer (taken after `qps` when both are held).
    handover: Mutex<Handover>,
    poll: EpollSet,
    /// When the thread's current (or last) sleep ends at the latest (engine
    /// clock): a hand-over due earlier must wake it
    /// ([`Threads::register_rx`]).
    sleep_until: AtomicU64,
    stop: AtomicBool,
    slices: AtomicU64,
    pauses: AtomicU64,
    resumes: AtomicU64,
    receives: AtomicU64,
    rx_wakeups: AtomicU64,
    handover_timeouts: AtomicU64,
}

impl Engine {
    /// An engine thread's state for CPU slot `cpu`, before its thread runs.
    fn new(cpu: usize) -> std::io::Result<Engine> {
        Ok(Engine {
            cpu,
            inbox: SegQueue::new(),
            rx_inbox: SegQueue::new(),
            qps: Mutex::new(HashMap::new()),
            handover: Mutex::new(Handover::default()),
            poll: EpollSet::new()?,
            sleep_until: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            slices: AtomicU64::new(0),
            pauses: AtomicU64::new(0),
            resumes: AtomicU64::new(0),
            receives: AtomicU64::new(0),
            rx_wakeups: AtomicU64::new(0),
            handover_timeouts: AtomicU64::new(0),
        })
    }

    /// Wakes the thread about a socket to watch (counted if it slept).
    fn notify_rx(&self) {
        if self.poll.notify() {
            self.rx_wakeups.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One engine thread of a device: its CPU and load, and the thread's
/// state once started (by the first QP assigned to it).
#[derive(Debug)]
struct Slot {
    cpu: usize,
    /// QPs assigned (kept here: the least-loaded choice looks at threads
    /// not started yet too).
    load: AtomicUsize,
    engine: std::sync::OnceLock<Arc<Engine>>,
}

/// The engine threads of a device.
#[derive(Debug)]
pub(crate) struct Threads {
    slots: Vec<Slot>,
    /// Bytes served per turn, and whether to pin: for threads started later.
    slice: usize,
    pin: bool,
    /// Serialises the starts (a second caller finds the first's thread).
    /// The device's own: a process-wide one, held by a thread starting
    /// one at a `fork(2)`, stayed held in the child, whose own devices
    /// then could start no thread.
    starting: Mutex<()>,
}

/// The CPUs of the engine threads for the configured `datamover_cpus`:
/// one thread per entry, or one per CPU of `usable` (the usable CPUs,
/// [`usable_cpus`]) if empty, and never more than usable CPUs.
pub(crate) fn engine_cpus(datamover_cpus: &[usize], usable: &[usize]) -> Vec<usize> {
    if datamover_cpus.is_empty() {
        usable.to_vec()
    } else {
        let mut cpus = datamover_cpus.to_vec();
        cpus.truncate(usable.len().max(1));
        cpus
    }
}

impl Threads {
    /// The engine threads for `cpus` (one each, from [`engine_cpus`]),
    /// serving `slice` bytes per turn, pinned if `pin`. None is started
    /// yet: each starts with the first QP assigned to it
    /// ([`Threads::assign`]).
    pub(crate) fn new(cpus: Vec<usize>, slice: usize, pin: bool) -> Threads {
        Threads {
            slots: cpus
                .into_iter()
                .map(|cpu| Slot {
                    cpu,
                    load: AtomicUsize::new(0),
                    engine: std::sync::OnceLock::new(),
                })
                .collect(),
            slice,
            pin,
            starting: Mutex::new(()),
        }
    }

    /// Engine thread `idx`, if started.
    fn engine(&self, idx: usize) -> Option<&Arc<Engine>> {
        self.slots.get(idx).and_then(|s| s.engine.get())
    }

    /// Starts engine thread `idx` (its epoll set and its OS thread) unless
    /// it runs already.
    fn start(&self, idx: usize) -> std::io::Result<&Arc<Engine>> {
        let slot = &self.slots[idx];
        if let Some(e) = slot.engine.get() {
            return Ok(e);
        }
        let _starting = self.starting.lock();
        if let Some(e) = slot.engine.get() {
            return Ok(e);
        }
        let e = Arc::new(Engine::new(slot.cpu)?);
        {
            let e = e.clone();
            let (slice, pin) = (self.slice, self.pin);
            spawn_engine_thread(format!("softrdma-dm{idx}"), move || {
                run_engine(&e, slice, pin);
            })?;
        }
        Ok(slot.engine.get_or_init(|| e))
    }

    /// Assigns a new QP to the least-loaded engine thread (the
    /// lowest-numbered of those with as few QPs), starting it if it is not
    /// running yet.
    ///
    /// If that thread cannot be started (the process can create no more
    /// threads or epoll instances now), the QP goes to the least-loaded
    /// thread that runs: a process that reached its thread limit after its
    /// first QPs keeps making connections, as when every thread started
    /// with the first QP.
    ///
    /// # Panics
    ///
    /// If no thread runs and none can be started: without one the device
    /// cannot move data.
    pub(crate) fn assign(&self) -> usize {
        let least = |running_only: bool| {
            self.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| !running_only || s.engine.get().is_some())
                .min_by_key(|(_, s)| s.load.load(Ordering::Relaxed))
                .map(|(i, _)| i)
        };
        let mut idx = least(false).unwrap_or(0);
        if let Err(e) = self.start(idx) {
            match least(true) {
                Some(i) => idx = i,
                None => panic!("softrdma: cannot start the device threads: {e}"),
            }
        }
        self.slots[idx].load.fetch_add(1, Ordering::Relaxed);
        idx
    }

    /// A QP assigned to `idx` is gone.
    pub(crate) fn release(&self, idx: usize) {
        if let Some(e) = self.slots.get(idx) {
            let _ = e
                .load
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// Hands a QP with work to its engine thread (no-op if already listed).
    pub(crate) fn schedule<Q: DmQp + 'static>(&self, qp: &Arc<Q>) {
        if qp.dm_listed().swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(e) = self.engine(qp.datamover()) {
            e.inbox.push(qp.clone());
            e.poll.notify();
        }
    }

    /// Starts watching a connected QP's socket for incoming bytes, lazily:
    /// the calling thread (which just connected the QP) counts as its CQ
    /// poller now, so the engine thread watches the socket only once
    /// nobody has polled for [`POLL_QUIET_NS`], or when the CQ is armed
    /// ([`Threads::wake_rx`]). The engine thread is never woken for this:
    /// if it sleeps past that time, its hand-over timer is set to it
    /// (which does not wake it), and cleared again when the QP is
    /// unregistered before the thread looked at it
    /// ([`Threads::unregister`]). A QP driven by its caller from the
    /// connection to its close within the quiet period thus costs its
    /// engine thread nothing. Without
    /// [`poll_driven_receive`](crate::DeviceConfig::poll_driven_receive)
    /// nobody else receives: the thread is woken to watch the socket at
    /// once.
    pub(crate) fn register_rx<Q: DmQp + 'static>(&self, qp: &Arc<Q>, fd: RawFd) {
        let Some(e) = self.engine(qp.datamover()) else {
            return;
        };
        let key = qp.qp_num() as usize;
        let lazy = qp.poll_driven_receive();
        let now = now_ns().max(1);
        if lazy {
            // A claim by a waiter may already reach further.
            qp.last_poll().fetch_max(now, Ordering::Relaxed);
        }
        let weak: Weak<Q> = Arc::downgrade(qp);
        let weak: Weak<dyn DmQp> = weak;
        // In the table before the pending mark: the thread may take an
        // older copy of this key from the inbox (an earlier registration's
        // unregister) at any point and clear the mark; it then finds this
        // entry in the table and watches it.
        e.qps.lock().insert(key, (weak, fd));
        // Before the flag that publishes it (`claim_rx` reads it after).
        qp.rx_fd().store(fd, Ordering::Relaxed);
        if lazy {
            // Before the key is in the inbox: the thread forgets it when it
            // takes it from there.
            e.handover.lock().pending.insert(key);
        }
        qp.rx_registered().store(true, Ordering::Release);
        e.rx_inbox.push(key);
        if !lazy {
            e.notify_rx();
            return;
        }
        // Against the thread's check of the inbox before it sleeps (it
        // publishes `sleep_until`, then looks): either it sees this key,
        // or this sees its deadline.
        std::sync::atomic::fence(Ordering::SeqCst);
        let due = now.saturating_add(POLL_QUIET_NS);
        if e.sleep_until.load(Ordering::SeqCst) > due {
            let mut h = e.handover.lock();
            // (Unregistered meanwhile, or taken by the thread: nothing to
            // hand over.)
            if h.pending.contains(&key) && h.timer_at.is_none_or(|t| t > due) {
                if e.poll
                    .set_timer(Some(Duration::from_nanos(POLL_QUIET_NS)))
                    .is_ok()
                {
                    h.timer_at = Some(due);
                } else {
                    drop(h);
                    e.notify_rx();
                }
            }
        }
    }

    /// The socket of a connected QP, for a CQ waiter that sleeps on it
    /// until `until_ns` (on the [`now_ns`] clock): meanwhile the engine
    /// thread leaves the socket to the waiter (two threads woken by the
    /// same bytes would fight for the receive lock). `None`: the waiter is
    /// awake again and polls (the usual quiet period applies).
    pub(crate) fn claim_rx(&self, qp: &dyn DmQp, until_ns: Option<u64>) -> Option<RawFd> {
        // A QP that no longer receives (closed, in error) may have a socket
        // at end of file: always readable, it would wake the waiter at once,
        // again and again.
        if !qp.rx_registered().load(Ordering::Acquire) || !qp.receiving() {
            return None;
        }
        // The socket it was registered with, as the engine thread's table
        // holds it (stored before the flag, which was set with `Release`
        // and read above with `Acquire`; the QP keeps it open while
        // registered, as for the table).
        self.engine(qp.datamover())?;
        let fd = qp.rx_fd().load(Ordering::Relaxed);
        if fd < 0 {
            return None;
        }
        qp.last_poll()
            .store(until_ns.unwrap_or_else(now_ns), Ordering::Relaxed);
        Some(fd)
    }

    /// Wakes engine thread `idx` so it re-checks the QPs it left to CQ
    /// pollers.
    pub(crate) fn wake_rx(&self, idx: usize) {
        if let Some(e) = self.engine(idx) {
            e.notify_rx();
        }
    }

    /// Stops watching a QP's socket for reading.
    pub(crate) fn unregister(&self, qp: &dyn DmQp) {
        if !qp.rx_registered().swap(false, Ordering::AcqRel) {
            return;
        }
        let Some(e) = self.engine(qp.datamover()) else {
            return;
        };
        // The engine thread arms a socket for reading only under the
        // table's lock while the QP is in the table, so once removed it is
        // not armed for reading again (the QP keeps its socket open until
        // then, so the descriptor is never a recycled one). An armed
        // registration fires at most once more and is ignored; the socket
        // may still be armed for writing (its last bytes go out on it).
        // The thread need not be woken for this: a stale watch is dropped
        // at its next event or turn, whichever comes first (an armed
        // registration is ignored once the key left the table).
        let key = qp.qp_num() as usize;
        e.qps.lock().remove(&key);
        let mut h = e.handover.lock();
        if h.pending.remove(&key) {
            // The thread never looked at the registration (its key, still
            // in the inbox, now finds nothing in the table): nothing to
            // tell it, and its hand-over timer is cleared if nothing else
            // waits for it.
            if h.pending.is_empty() {
                h.clear_timer(e);
            }
            return;
        }
        drop(h);
        e.rx_inbox.push(key);
    }

    /// Statistics of every engine thread (zero for those not started).
    pub(crate) fn stats(&self) -> Vec<DatamoverStats> {
        self.slots
            .iter()
            .map(|s| {
                let qps = s.load.load(Ordering::Relaxed);
                let Some(e) = s.engine.get() else {
                    return DatamoverStats {
                        cpu: s.cpu,
                        qps,
                        ..DatamoverStats::default()
                    };
                };
                DatamoverStats {
                    cpu: s.cpu,
                    running: true,
                    qps,
                    slices: e.slices.load(Ordering::Relaxed),
                    pauses: e.pauses.load(Ordering::Relaxed),
                    resumes: e.resumes.load(Ordering::Relaxed),
                    receives: e.receives.load(Ordering::Relaxed),
                    rx_wakeups: e.rx_wakeups.load(Ordering::Relaxed),
                    handover_timeouts: e.handover_timeouts.load(Ordering::Relaxed),
                }
            })
            .collect()
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        for e in self.slots.iter().filter_map(|s| s.engine.get()) {
            e.stop.store(true, Ordering::Release);
            e.poll.notify();
        }
    }
}

/// What serving a QP for one slice left it as.
pub(crate) enum Served {
    /// More work, socket writable: stays active.
    Active,
    /// Socket full: pause until writable.
    Paused(RawFd),
    /// Nothing left: leaves the lists.
    Done,
}

/// While transmitting, an engine thread looks at its sockets (readable,
/// writable again) at most this often.
const LOOK_EVERY_NS: u64 = 50_000;

/// Slices one turn may take when its QP is the only active one.
const ALONE_SLICES: usize = 64;

/// `d` in nanoseconds, rounded up to milliseconds as
/// [`EpollSet::wait`] sleeps.
fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000))
        .unwrap_or(u64::MAX)
        .saturating_mul(1_000_000)
}

/// The fine clock's reading when the engine's clock started.
fn start_ns() -> u64 {
    static START: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *START.get_or_init(crate::sys::clock::monotonic_ns)
}

/// Nanoseconds since the engine's clock started.
pub(crate) fn now_ns() -> u64 {
    let start = start_ns();
    crate::sys::clock::monotonic_ns().saturating_sub(start)
}

/// [`now_ns`] from the coarse clock: `(earliest, step)`, the time is at
/// least `earliest` and usually less than `earliest + step` (the coarse
/// clock trails by about its step, more when the CPU that keeps the time
/// was not run; see `sys::clock::monotonic_coarse_ns`). A reading
/// without the time-stamp counter (about 3 against 20 ns on a virtual
/// machine), for stamps that need no better than the kernel's tick: a
/// waiter's claim on its socket before and after a sleep in `recv`
/// (twice per message of a blocking ping-pong), a heuristic whose end
/// only decides when an engine thread takes the socket over.
pub(crate) fn now_ns_coarse() -> (u64, u64) {
    let start = start_ns();
    (
        crate::sys::clock::monotonic_coarse_ns().saturating_sub(start),
        crate::sys::clock::coarse_resolution_ns(),
    )
}

/// A QP whose CQ was polled this recently is left to the poller: its
/// socket is not watched for reading, so the sender does not pay for waking
/// this thread, and the poller does not fight it for the receive lock.
const POLL_QUIET_NS: u64 = 1_000_000;

/// When another thread holds a QP's receive lock (it is receiving), look
/// again this much later rather than wait for the lock: the thread also
/// transmits for other QPs.
const RX_BUSY_RETRY_NS: u64 = 1_000_000;

/// The longest a thread waits before it looks again whether a CQ poller
/// still drives a QP it left to it.
const RECHECK_MAX_NS: u64 = 16_000_000;

/// Reading left to a poller that polled at `polled`, seen at `now`.
///
/// A claim that reaches past `now` (a CQ waiter sleeping on the socket,
/// [`Threads::claim_rx`]) is looked at again two quiet periods from `now`,
/// not at its end: the waiter, woken by the bytes that brought this thread
/// here, gives the socket back when it returns with what they completed,
/// and its quiet period has then ended by that look. (Looked at only at
/// the claim's end, the socket stayed unwatched up to 10 ms after the
/// waiter returned: a caller that then waited for a Write without
/// polling, spinning on memory, saw it placed that late.)
fn poller_defer(polled: u64, now: u64) -> Defer {
    let recheck = if polled > now {
        now.saturating_add(2 * POLL_QUIET_NS)
    } else {
        polled.saturating_add(POLL_QUIET_NS)
    };
    Defer::Poller {
        recheck,
        step: POLL_QUIET_NS,
    }
}

/// Why an engine thread does not watch a socket for reading for now.
#[derive(Clone, Copy)]
enum Defer {
    /// A CQ poller drives the QP: until it has been quiet for
    /// [`POLL_QUIET_NS`] (or the CQ is armed: [`Threads::wake_rx`]). The
    /// thread looks again at `recheck`, backing off (`step` doubles up to
    /// [`RECHECK_MAX_NS`]) while the poller keeps polling: a thread woken
    /// a thousand times a second for nothing loses its place with the
    /// scheduler on a busy machine, where it must preempt the pollers to
    /// transmit.
    Poller { recheck: u64, step: u64 },
    /// Another thread held the receive lock: until then.
    Busy(u64),
}

/// What an engine thread watches on one socket.
struct Watch {
    fd: RawFd,
    /// Watched for reading (the receive path).
    read: bool,
    /// Reading left to someone else for now.
    deferred: Option<Defer>,
    /// How long the last [`Defer::Busy`] was (0: the last look found the
    /// receive lock free): doubles, up to [`RECHECK_MAX_NS`], while
    /// another thread keeps receiving (a CQ poller reading a long stream
    /// in one go does not update its poll time meanwhile).
    busy_step: u64,
    /// Paused for lack of send space: watched for writing.
    paused: Option<Arc<dyn DmQp>>,
    /// Armed in this thread's epoll set before (else the next arm adds
    /// the socket rather than modify a registration first).
    registered: bool,
}

impl Watch {
    fn new(fd: RawFd) -> Watch {
        Watch {
            fd,
            registered: false,
            read: false,
            deferred: None,
            busy_step: 0,
            paused: None,
        }
    }
}

/// The thread-local state of an engine thread.
struct Local {
    active: VecDeque<Arc<dyn DmQp>>,
    watches: HashMap<usize, Watch>,
    /// Watches with reading deferred.
    deferred: usize,
}

impl Local {
    /// Re-arms `key`'s socket with what is still wanted; forgets a key that
    /// wants nothing any more (its registration is then silent — one-shot
    /// after its last event — or fires once more, ignored).
    fn rearm(&mut self, e: &Engine, key: usize) {
        let Some(w) = self.watches.get_mut(&key) else {
            return;
        };
        let write = w.paused.is_some();
        if w.read && w.deferred.is_none() {
            // Under the table's lock: while the QP is in it, its socket is
            // open (unregistering takes the lock before the socket can be
            // closed), so the descriptor is not a recycled one.
            let table = e.qps.lock();
            if table.get(&key).is_some_and(|(_, fd)| *fd == w.fd)
                && e.poll.arm(w.fd, key, true, write, !w.registered).is_ok()
            {
                w.registered = true;
                return;
            }
            drop(table);
            w.read = false;
        }
        if w.paused.is_some() {
            // The paused QP (held) keeps its socket open.
            if e.poll.arm(w.fd, key, false, true, !w.registered).is_ok() {
                w.registered = true;
                return;
            }
            // The socket is gone: back to the round (its next write fails
            // and closes the QP).
            if let Some(qp) = w.paused.take() {
                self.active.push_back(qp);
            }
        }
        if !w.read {
            if w.deferred.is_some() {
                self.deferred -= 1;
            }
            self.watches.remove(&key);
        }
    }

    fn set_deferred(&mut self, key: usize, d: Option<Defer>) {
        if let Some(w) = self.watches.get_mut(&key) {
            match (w.deferred.is_some(), d.is_some()) {
                (false, true) => self.deferred += 1,
                (true, false) => self.deferred -= 1,
                _ => {}
            }
            w.deferred = d;
        }
    }

    /// A key from the receive inbox: start (or stop) watching its socket
    /// for reading, as the shared table says.
    fn rx_update(&mut self, e: &Engine, key: usize) {
        let entry = e.qps.lock().get(&key).map(|(_, fd)| *fd);
        match entry {
            Some(fd) => {
                let w = self.watches.entry(key).or_insert_with(|| Watch::new(fd));
                // (A new socket after a reconnect: the old one is closed.)
                if w.fd != fd {
                    w.fd = fd;
                    w.registered = false;
                }
                w.read = true;
                // Registered lazily: left to the thread that connected it
                // (its poller) until nobody has polled for a while.
                let polled = e
                    .qps
                    .lock()
                    .get(&key)
                    .and_then(|(q, _)| q.upgrade())
                    .map_or(0, |qp| qp.last_poll().load(Ordering::Relaxed));
                let now = now_ns();
                let defer =
                    (polled.saturating_add(POLL_QUIET_NS) > now).then(|| poller_defer(polled, now));
                self.set_deferred(key, defer);
            }
            None => {
                let Some(w) = self.watches.get_mut(&key) else {
                    return;
                };
                w.read = false;
                self.set_deferred(key, None);
            }
        }
        self.rearm(e, key);
    }

    /// `key`'s socket is readable: run its receive path here, unless a CQ
    /// poller drives it.
    fn receive(&mut self, e: &Engine, key: usize, now: u64) {
        let entry = e.qps.lock().get(&key).map(|(w, _)| w.clone());
        let Some(qp) = entry.and_then(|w| w.upgrade()) else {
            if let Some(w) = self.watches.get_mut(&key) {
                w.read = false;
            }
            return;
        };
        let polled = qp.last_poll().load(Ordering::Relaxed);
        if polled.saturating_add(POLL_QUIET_NS) > now {
            // A CQ poller drives this QP (it may sleep on this very
            // socket and is woken by the same bytes): leave them to it.
            self.set_deferred(key, Some(poller_defer(polled, now)));
            return;
        }
        e.receives.fetch_add(1, Ordering::Relaxed);
        qp.rx_poll(false);
        let receiving = qp.rx_registered().load(Ordering::Acquire) && qp.receiving();
        if !receiving {
            // Closed or in error: its socket may stay readable (end of
            // file) for good.
            if let Some(w) = self.watches.get_mut(&key) {
                w.read = false;
            }
        } else if qp.rx_busy() {
            // Another thread is receiving for it right now, or (core path)
            // the thread holding its connection receives when it lets go.
            let step = self.watches.get_mut(&key).map_or(RX_BUSY_RETRY_NS, |w| {
                w.busy_step = if w.busy_step == 0 {
                    RX_BUSY_RETRY_NS
                } else {
                    w.busy_step.saturating_mul(2).min(RECHECK_MAX_NS)
                };
                w.busy_step
            });
            self.set_deferred(key, Some(Defer::Busy(now.saturating_add(step))));
        } else {
            if let Some(w) = self.watches.get_mut(&key) {
                w.busy_step = 0;
            }
            let polled = qp.last_poll().load(Ordering::Relaxed);
            if polled.saturating_add(POLL_QUIET_NS) > now {
                self.set_deferred(key, Some(poller_defer(polled, now)));
            }
        }
    }

    /// Watches again the deferred sockets whose time has come; returns the
    /// earliest time one is still deferred to.
    fn undefer(&mut self, e: &Engine, now: u64) -> Option<u64> {
        if self.deferred == 0 {
            return None;
        }
        let mut next: Option<u64> = None;
        let mut due = Vec::new();
        {
            let table = e.qps.lock();
            for (&key, w) in &mut self.watches {
                let wake_at = match &mut w.deferred {
                    None => continue,
                    Some(Defer::Busy(t)) => {
                        if *t <= now {
                            due.push(key);
                            continue;
                        }
                        *t
                    }
                    Some(Defer::Poller { recheck, step }) => {
                        let quiet_at =
                            table
                                .get(&key)
                                .and_then(|(q, _)| q.upgrade())
                                .map_or(0, |qp| {
                                    qp.last_poll()
                                        .load(Ordering::Relaxed)
                                        .saturating_add(POLL_QUIET_NS)
                                });
                        if quiet_at <= now {
                            due.push(key);
                            continue;
                        }
                        if *recheck <= now {
                            // Still polled: look again later, each time
                            // later.
                            *step = step.saturating_mul(2).min(RECHECK_MAX_NS);
                            *recheck = now.saturating_add(*step).max(quiet_at);
                        }
                        *recheck
                    }
                };
                next = Some(next.map_or(wake_at, |n: u64| n.min(wake_at)));
            }
        }
        for key in due {
            self.set_deferred(key, None);
            self.rearm(e, key);
        }
        next
    }
}

fn run_engine(e: &Engine, slice: usize, pin: bool) {
    if pin {
        let _ = pin_current_thread(e.cpu);
    }
    let mut l = Local {
        active: VecDeque::new(),
        watches: HashMap::new(),
        deferred: 0,
    };
    let mut ready: Vec<Ready> = Vec::new();
    let mut last_look = 0u64;
    let mut timer_fired = false;
    while !e.stop.load(Ordering::Acquire) {
        e.poll.clear_notified();
        while let Some(qp) = e.inbox.pop() {
            l.active.push_back(qp);
        }
        let mut took = false;
        while let Some(key) = e.rx_inbox.pop() {
            e.handover.lock().pending.remove(&key);
            l.rx_update(e, key);
            took = true;
        }
        let now = now_ns();
        if took || timer_fired {
            // The registrations seen are deferred (or watched) here now:
            // the hand-over timer is needed no more, unless one came after
            // the inbox was emptied. An expired timer is cleared (its fd
            // stays readable until then).
            let mut h = e.handover.lock();
            if h.pending.is_empty() || h.timer_at.is_some_and(|t| t <= now) {
                h.clear_timer(e);
            }
        }
        if std::mem::take(&mut timer_fired) {
            e.handover_timeouts.fetch_add(1, Ordering::Relaxed);
        }
        let next_deferred = l.undefer(e, now);
        // With transmit work, only look at the sockets, at most every
        // LOOK_EVERY_NS (a round of one QP's turn is a quarter of a MiB:
        // looking every round was four system calls per MiB sent); without,
        // sleep until an event, a hand-over or the next deferred socket is
        // due.
        let timeout = if !l.active.is_empty() {
            (!l.watches.is_empty() && now.saturating_sub(last_look) >= LOOK_EVERY_NS)
                .then_some(Duration::ZERO)
        } else {
            Some(next_deferred.map_or(Duration::from_millis(500), |t| {
                Duration::from_nanos(t.saturating_sub(now))
            }))
        };
        ready.clear();
        if let Some(mut t) = timeout {
            if !t.is_zero() {
                // Registrations queued without a wake-up (see
                // `Threads::register_rx`): publish the deadline, then look.
                e.sleep_until
                    .store(now.saturating_add(duration_ns(t)), Ordering::SeqCst);
                std::sync::atomic::fence(Ordering::SeqCst);
                if !e.rx_inbox.is_empty() {
                    t = Duration::ZERO;
                }
            }
            timer_fired = e.poll.wait(&mut ready, Some(t)).unwrap_or(false);
            last_look = now;
        }
        if !ready.is_empty() {
            let now = now_ns();
            for r in &ready {
                let Some(w) = l.watches.get_mut(&r.key) else {
                    continue;
                };
                if r.writable
                    && let Some(qp) = w.paused.take()
                {
                    e.resumes.fetch_add(1, Ordering::Relaxed);
                    tracing::trace!(qp = qp.qp_num(), "datamover resumes a QP (socket writable)");
                    l.active.push_back(qp);
                }
                if r.readable && w.read && w.deferred.is_none() {
                    l.receive(e, r.key, now);
                }
                l.rearm(e, r.key);
            }
        }
        if l.active.is_empty() {
            continue;
        }
        // Alone, a QP has no one to be fair to: it gets a longer turn (fewer,
        // larger writes), and the inbox is still checked every turn.
        let budget = if l.active.len() == 1 {
            slice.saturating_mul(ALONE_SLICES)
        } else {
            slice
        };
        for _ in 0..l.active.len() {
            let Some(qp) = l.active.pop_front() else {
                break;
            };
            e.slices.fetch_add(1, Ordering::Relaxed);
            match qp.serve(budget) {
                Served::Active => l.active.push_back(qp),
                Served::Paused(fd) => {
                    let key = qp.qp_num() as usize;
                    e.pauses.fetch_add(1, Ordering::Relaxed);
                    tracing::trace!(qp = qp.qp_num(), "datamover pauses a QP (socket full)");
                    let w = l.watches.entry(key).or_insert_with(|| Watch::new(fd));
                    w.fd = fd;
                    w.paused = Some(qp);
                    l.rearm(e, key);
                }
                Served::Done => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connected QP as an engine thread's receive side sees it: its
    /// claim (`last_poll`) is the test's to set.
    #[derive(Debug, Default)]
    struct PolledQp {
        listed: AtomicBool,
        registered: AtomicBool,
        fd: AtomicI32,
        last_poll: AtomicU64,
    }

    impl DmQp for PolledQp {
        fn qp_num(&self) -> u32 {
            7
        }
        fn datamover(&self) -> usize {
            0
        }
        fn dm_listed(&self) -> &AtomicBool {
            &self.listed
        }
        fn rx_registered(&self) -> &AtomicBool {
            &self.registered
        }
        fn rx_fd(&self) -> &AtomicI32 {
            &self.fd
        }
        fn last_poll(&self) -> &AtomicU64 {
            &self.last_poll
        }
        fn poll_driven_receive(&self) -> bool {
            true
        }
        fn receiving(&self) -> bool {
            true
        }
        fn rx_busy(&self) -> bool {
            false
        }
        fn serve(&self, _slice: usize) -> Served {
            Served::Done
        }
        fn rx_poll(&self, _busy: bool) -> bool {
            false
        }
    }

    /// Regression: a readable socket whose QP a CQ waiter had claimed (it
    /// sleeps on the socket, woken by the same bytes) was looked at again
    /// only at the claim's end, up to 10 ms on, although the waiter gives
    /// the socket back as it returns with what the bytes completed: a
    /// caller that then waited for a Write without polling (spinning on
    /// memory) saw it placed up to 10 ms late.
    #[test]
    fn a_claim_given_back_early_was_waited_out_to_its_end() {
        let e = Engine::new(0).unwrap();
        let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&sock);
        let qp = Arc::new(PolledQp::default());
        qp.registered.store(true, Ordering::Relaxed);
        qp.fd.store(fd, Ordering::Relaxed);
        let key = 7;
        let weak: Weak<dyn DmQp> = Arc::downgrade(&(qp.clone() as Arc<dyn DmQp>));
        e.qps.lock().insert(key, (weak, fd));
        let mut l = Local {
            active: VecDeque::new(),
            watches: HashMap::new(),
            deferred: 0,
        };
        let mut w = Watch::new(fd);
        w.read = true;
        l.watches.insert(key, w);

        let now = 5_000_000_000;
        // A waiter sleeps on the socket, its claim reaching 10 ms on; bytes
        // come: this thread leaves them to the waiter.
        qp.last_poll.store(now + 10_000_000, Ordering::Relaxed);
        l.receive(&e, key, now);
        assert!(l.watches[&key].deferred.is_some());
        assert_eq!(e.receives.load(Ordering::Relaxed), 0);
        // The waiter received them and returned, giving the socket back.
        let returned = now + 50_000;
        qp.last_poll.store(returned, Ordering::Relaxed);
        let next = l.undefer(&e, returned).expect("still deferred");
        assert!(
            next <= now + 2 * POLL_QUIET_NS,
            "looked at again {} µs on, not within two quiet periods",
            (next - now) / 1000
        );
        // Nobody polled since: at that look the socket is watched again.
        assert_eq!(l.undefer(&e, next), None);
        assert!(l.watches[&key].deferred.is_none());
    }

    /// Regression: engine threads start with the first QP assigned to each,
    /// and a QP whose thread could not be started (the process at its
    /// thread limit) panicked in `assign`, though a running thread could
    /// serve it: a process that reached the limit after its first
    /// connection could make no more (when every thread started with the
    /// first QP, later QPs needed none).
    #[test]
    fn a_qp_whose_thread_cannot_start_goes_to_a_running_one() {
        let ok = crate::sys::process::in_child(Duration::from_secs(20), || {
            let t = Threads::new(vec![0, 1], 1 << 16, false);
            let first = t.assign();
            if !crate::sys::process::forbid_new_threads() {
                return false;
            }
            let second = t.assign();
            let st = t.stats();
            first == 0 && second == 0 && st[0].running && !st[1].running && st[0].qps == 2
        });
        assert!(ok, "the second QP found no engine thread");
    }

    /// Regression: engine thread starts were serialised by one lock of the
    /// process, held while the thread was made: a `fork(2)` while another
    /// thread started one (for any device) left the lock held for ever in
    /// the child, whose first QP of a device of its own then waited for
    /// it. Each device has its own lock now.
    #[test]
    fn a_forked_child_starts_its_own_devices_threads_while_the_parent_starts_others() {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let starter = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let t = Threads::new(vec![0], 1 << 16, false);
                t.assign();
            }
        });
        let mut hung = 0;
        for _ in 0..40 {
            let ok = crate::sys::process::in_child(Duration::from_secs(2), || {
                let t = Threads::new(vec![0], 1 << 16, false);
                t.assign() == 0 && t.stats()[0].running
            });
            if !ok {
                hung += 1;
                break;
            }
        }
        stop.store(true, Ordering::Relaxed);
        starter.join().unwrap();
        assert_eq!(hung, 0, "a forked child waited for its parent's start lock");
    }
}
