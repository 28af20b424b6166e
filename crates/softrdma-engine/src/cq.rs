//! Completion queues and completion channels, like `ibv_cq` and
//! `ibv_comp_channel`.
//!
//! ```text
//!   send/receive path ──push──▶ ┌──────────── CQ ring ────────────┐ ──poll──▶ application
//!   (any thread)                │ lock-free, bounded (capacity)   │
//!                               └─────────────────────────────────┘
//!                                   │ armed (req_notify) and a matching
//!                                   ▼ completion arrives: one event
//!                             CompletionChannel ──get_event / fd──▶ application
//! ```
//!
//! A [`CompletionQueue`] is a bounded, lock-free ring of
//! [`WorkCompletion`]s. The data path pushes completions from whichever
//! thread finished the work; the application takes them with
//! [`poll`](CompletionQueue::poll), which never blocks. Completions pushed by
//! one thread come out in the order it pushed them.
//!
//! To sleep instead of spinning, create the CQ with a
//! [`CompletionChannel`], arm it with
//! [`req_notify`](CompletionQueue::req_notify), poll once more (completions
//! that arrived before arming do not raise an event), then wait with
//! [`get_event`](CompletionChannel::get_event) or on the channel's
//! [`fd`](CompletionChannel::fd). Arming is one-shot, as in ibverbs.
//!
//! Instead of a channel, a CQ may carry a completion callback
//! ([`CompletionQueue::with_callback`], [`CqBuilder::callback`]): its events
//! go to the CQ's completion event handler thread, which runs the callback.
//! Every CQ is bound to one handler of its device; see [`crate::handlers`]
//! for the handlers, the callback rules (poll, re-arm, poll again:
//! [`CompletionQueue::drain_and_arm`]) and the rule for unsignaled work.
//!
//! When the ring is full the completion is lost: the CQ is marked overflowed
//! and an [`AsyncEventKind::CqError`] event is queued on the device (once).
//! Size the CQ for all the work requests that may complete into it.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_queue::ArrayQueue;
use parking_lot::{Mutex, RwLock};

use crate::device::Device;
use crate::event::{AsyncEvent, AsyncEventKind, FdQueue};
use crate::handlers::{
    BindError, Binding, Callback, Handler, HandlerEvent, HandlerId, PollCounter,
};
use crate::sys::fd::Waker;
use crate::wc::WorkCompletion;

/// Longest single sleep of [`CompletionQueue::wait`] with a timeout before
/// it looks again, and how far the claim on the QPs' sockets reaches past
/// the start of a sleep. A wait without a timeout sleeps until woken, with
/// no kernel timer (see [`crate::wait_set`]).
const SLEEP_MAX: Duration = Duration::from_millis(10);

/// How long the QPs' sockets stay claimed from the engine's receive
/// threads after a [`CompletionQueue::wait`] ran out of time, as a [`WaitSet`](crate::wait_set::WaitSet) keeps them after every
/// wait: a caller that waits with a timeout in a loop (a server waiting
/// for requests, the target of a Write stream, whose CQ gets nothing) is
/// back within that time, and an engine thread that took the socket over
/// between two waits (the caller waiting for a CPU longer than the quiet
/// period) would receive beside it, a hand-off and a third busy thread on
/// a machine that has no CPU to spare.
const CLAIM_AFTER_TIMEOUT_NS: u64 = 10_000_000;

/// What a sleeping waiter watches ([`CompletionQueue::wait`]): kept per
/// thread, so a wait that sleeps allocates nothing.
#[derive(Default)]
struct SleepSet {
    /// The QPs whose sockets are in `fds` (kept alive while watched).
    hooks: Vec<Arc<dyn Progress>>,
    fds: crate::sys::poll::PollSet,
    /// The thread's own wake-up descriptor (see [`Waker`]), made by its
    /// first sleep, with the fork generation it was made in (a child
    /// makes its own: the descriptor would be shared with the parent).
    waker: Option<(Arc<Waker>, u64)>,
}

impl SleepSet {
    /// The thread's waker (`None`: no descriptor could be made).
    fn waker(&mut self) -> Option<Arc<Waker>> {
        let generation = crate::sys::epoll::fork_generation();
        if self.waker.as_ref().is_none_or(|w| w.1 != generation) {
            self.waker = Waker::new().ok().map(|w| (Arc::new(w), generation));
        }
        self.waker.as_ref().map(|w| Arc::clone(&w.0))
    }
}

thread_local! {
    static SLEEP_SET: std::cell::RefCell<SleepSet> = std::cell::RefCell::default();
}

/// Polls that take completions after which they write posts a QP of the
/// CQ deferred to its poster's next poll (see `qp::post::TxBatch`).
pub(crate) const DEFERRED_POLLS: u32 = 4;

/// Identifiers of completion queues, unique in the process.
static NEXT_CQ_ID: AtomicU32 = AtomicU32::new(1);

/// Not armed.
const ARM_NONE: u8 = 0;
/// Armed for a solicited receive completion or any error completion.
const ARM_SOLICITED: u8 = 1;
/// Armed for the next completion of any kind.
const ARM_NEXT: u8 = 2;

/// A hook the data path registers on a CQ so that polling an empty CQ can
/// drive receive processing (see [`DeviceConfig::poll_driven_receive`]).
///
/// [`DeviceConfig::poll_driven_receive`]: crate::DeviceConfig::poll_driven_receive
pub(crate) trait Progress: Send + Sync {
    /// Makes what progress can be made without blocking (implementations
    /// use try-locks and return at once if another thread is busy).
    /// `armed`: the CQ is armed, so its owner is about to wait for an event
    /// rather than busy-poll.
    /// Returns whether anything was done. May push to the CQ and attach or
    /// detach hooks (the poll runs on a snapshot of the hooks).
    fn progress(&self, armed: bool) -> bool;

    /// The CQ was armed: its owner is about to wait for an event instead of
    /// polling, so the engine thread must watch the QP's socket again.
    fn armed(&self) {}

    /// The socket a waiter sleeps on for this QP's incoming bytes until
    /// `until_ns` (see [`CompletionQueue::wait`]; the engine thread leaves
    /// it alone meanwhile); `None` if there is none to watch. Called with
    /// `None` when the waiter woke up.
    fn sleep_on(&self, _until_ns: Option<u64>) -> Option<RawFd> {
        None
    }

    /// Which connection of the QP the socket of [`sleep_on`](Self::sleep_on)
    /// belongs to, read before it: a QP connected again may have its new
    /// socket at its old socket's number, and a waiter that registered
    /// the old one (gone with its file) must register the new one.
    fn connection(&self) -> u64 {
        0
    }

    /// [`sleep_on`](Self::sleep_on) until `after_ns` from now (an
    /// implementation that reads the clock anyway reads it once; the
    /// QP's reads the coarse clock and adds its step).
    fn sleep_on_for(&self, after_ns: u64) -> Option<RawFd> {
        self.sleep_on(Some(crate::datamover::now_ns().saturating_add(after_ns)))
    }

    /// A waiter that slept on the socket of [`sleep_on`](Self::sleep_on)
    /// found it readable: receive now, without looking at the socket
    /// first (the waiter's `poll(2)` just did) and without counting as a
    /// busy poll (the waiter's claim on the socket stands). Returns
    /// whether anything was done, as [`progress`](Self::progress), whose
    /// unarmed form it falls back to.
    fn progress_readable(&self) -> bool {
        self.progress(false)
    }

    /// Extends a claim made with [`sleep_on`](Self::sleep_on) (whose
    /// socket the waiter keeps) until `until_ns`, without looking the
    /// socket up again.
    fn renew_claim(&self, until_ns: u64) {
        let _ = self.sleep_on(Some(until_ns));
    }

    /// A poll of the CQ took completions while a QP of the CQ had posts
    /// waiting for its poster's next poll ([`CompletionQueue::note_deferred`]):
    /// write them now (this is that poll).
    fn polled(&self) {}

    /// A waiter is about to register with the CQ (after which a push
    /// signals its wake-up descriptor) and to look at it: posts left for
    /// the poster's next poll are written first, so that the completions
    /// they make at once (a small Send on a socket with room) are found by
    /// that look instead of waking the waiter itself (a write to its event
    /// fd, a wait that returns at once, a read).
    fn write_deferred(&self) {}

    /// A waiter with the socket of [`sleep_on`](Self::sleep_on) claimed
    /// sleeps in the socket's `recv(2)` (at most `timeout`) and receives
    /// what it brings: one system call per wait instead of a `poll(2)`
    /// and a read. Nothing but bytes on the socket (or its end), a signal
    /// or the timeout ends the sleep: the caller makes sure nothing else
    /// can be waited for meanwhile. `ready` is asked once the receive is
    /// this waiter's (no other thread receives from then on): if it says
    /// yes (the waiter's CQ got completions from a receive that ended
    /// just before), nothing sleeps and `Received` is returned.
    ///
    /// `hand` (see [`WaitSet::wait_receiving_handed`]) is called at most
    /// once, with the QP's receive lock and connection's lock held, when
    /// bytes came and the receive completion the run produces could go
    /// straight to the waiter (the CQ is exclusive): it must not block.
    /// If it answers yes, the run's first successful receive completion
    /// is put into `handed` instead of the CQ if the CQ may take it
    /// directly when it is made (empty, unarmed, without waiters);
    /// everything after it goes to the CQ.
    ///
    /// [`WaitSet::wait_receiving_handed`]: crate::wait_set::WaitSet::wait_receiving_handed
    fn progress_sleep(
        &self,
        _timeout: std::time::Duration,
        _ready: &dyn Fn() -> bool,
        _hand: &mut dyn FnMut() -> bool,
        _handed: &mut Option<WorkCompletion>,
    ) -> RxSleep {
        RxSleep::Unable
    }
}

/// What [`Progress::progress_sleep`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RxSleep {
    /// Bytes (or the end of the stream, an error) came and were received.
    Received,
    /// The time was up, nothing came.
    TimedOut,
    /// A signal was handled (`EINTR`).
    Interrupted,
    /// No sleep: another thread receives, the QP has no socket to sleep
    /// on, or it cannot sleep in it (not a stream socket, or made
    /// non-blocking again by another holder of its descriptor).
    Unable,
}

/// Why a completion queue could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateCqError {
    /// `cqe` is 0 or above the device's `max_cqe`.
    #[error("invalid number of CQ entries {requested} (must be 1..={max})")]
    InvalidSize {
        /// The requested number of entries.
        requested: usize,
        /// The device's `max_cqe`.
        max: u32,
    },
    /// The completion channel belongs to another device.
    #[error("the completion channel belongs to another device")]
    ForeignChannel,
    /// No completion event handler has this identifier.
    #[error("the device has no completion event {0}")]
    NoSuchHandler(HandlerId),
    /// No completion event handler runs on this CPU.
    #[error("no completion event handler runs on CPU {0}")]
    NoHandlerOnCpu(usize),
    /// A CQ delivers its events either to a channel or to a callback.
    #[error("a completion queue takes a completion channel or a callback, not both")]
    ChannelAndCallback,
    /// The thread of the CQ's completion event handler could not be
    /// started. Not returned by [`CqBuilder::build`] any more: a handler's
    /// thread starts with the first arm of a callback CQ bound to it
    /// ([`NotifyError::HandlerThread`]).
    #[error("cannot start the completion event handler thread: {0}")]
    Thread(#[source] io::Error),
}

impl From<BindError> for CreateCqError {
    fn from(e: BindError) -> Self {
        match e {
            BindError::NoSuchHandler(id) => CreateCqError::NoSuchHandler(id),
            BindError::NoHandlerOnCpu(cpu) => CreateCqError::NoHandlerOnCpu(cpu),
        }
    }
}

/// Why [`CompletionQueue::req_notify`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotifyError {
    /// The CQ was created without a completion channel or callback: there
    /// is nowhere to deliver the event.
    #[error("the completion queue has no completion channel and no callback")]
    NoChannel,
    /// The thread of the CQ's completion event handler, which runs the
    /// callback, could not be started (it starts with the first arm of a
    /// CQ with a callback bound to the handler). The CQ is not armed.
    #[error("cannot start the completion event handler thread")]
    HandlerThread,
}

/// Why [`CompletionQueue::resize`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    /// `cqe` is 0 or above the device's `max_cqe`.
    #[error("invalid number of CQ entries {requested} (must be 1..={max})")]
    InvalidSize {
        /// The requested number of entries.
        requested: usize,
        /// The device's `max_cqe`.
        max: u32,
    },
    /// More completions are queued than the new size holds.
    #[error("{queued} completions are queued, more than the new size {requested}")]
    TooSmall {
        /// The requested number of entries.
        requested: usize,
        /// Completions queued at the time.
        queued: usize,
    },
    /// The CQ was made with [`CqBuilder::exclusive`]: its ring has a fixed
    /// size.
    #[error("an exclusive completion queue cannot be resized")]
    Exclusive,
}

/// Why [`CompletionChannel::get_event`] returned without an event.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GetEventError {
    /// No event arrived within the timeout.
    #[error("no completion event within the timeout")]
    TimedOut,
    /// Waiting on the channel's descriptor failed.
    #[error("waiting for a completion event failed: {0}")]
    Io(#[from] io::Error),
}

/// A completion did not fit: the CQ overflowed and the completion is lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("completion queue {cq_id} overflowed")]
#[allow(dead_code)] // used by the data path
pub(crate) struct CqOverflow {
    /// The CQ.
    pub(crate) cq_id: u32,
}

/// A completion queue (`ibv_cq`). A cheap, clonable handle; the queue lives
/// as long as a handle (the application's or a QP's) does.
///
/// # Example
///
/// ```
/// use softrdma_engine::Device;
/// use softrdma_engine::cq::CompletionQueue;
///
/// let dev = Device::open_default()?;
/// let cq = CompletionQueue::new(&dev, 64, None)?;
/// assert_eq!(cq.capacity(), 64);
/// assert!(cq.poll_one().is_none());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct CompletionQueue {
    shared: Arc<CqShared>,
}

/// A CQ's ring of completions. `ArrayQueue` is lock-free; the lock around
/// a resizable ring is for [`CompletionQueue::resize`] only (read-locked by
/// every push, poll and look: two locked instructions each), which an
/// exclusive CQ ([`CqBuilder::exclusive`]) refuses, so its ring needs none.
enum Ring {
    Resizable(RwLock<ArrayQueue<WorkCompletion>>),
    Fixed(ArrayQueue<WorkCompletion>),
}

impl Ring {
    #[inline]
    fn with<R>(&self, f: impl FnOnce(&ArrayQueue<WorkCompletion>) -> R) -> R {
        match self {
            Ring::Fixed(r) => f(r),
            Ring::Resizable(r) => f(&r.read()),
        }
    }
}

/// The state of a CQ shared by its handles.
struct CqShared {
    id: u32,
    device: Device,
    /// The ring (see [`Ring`]).
    ring: Ring,
    /// Made with [`CqBuilder::exclusive`].
    exclusive: bool,
    /// One of `ARM_*`.
    arm: AtomicU8,
    /// Set on the first lost completion; never cleared.
    overflowed: AtomicBool,
    channel: Option<CompletionChannel>,
    /// Events delivered by the channel for this CQ and not yet acknowledged.
    unacked: AtomicU32,
    /// Receive-progress hooks of the QPs using this CQ. Copy on write: a
    /// poll clones the `Arc` and runs the hooks without holding the lock.
    progress: RwLock<Arc<[Weak<dyn Progress>]>>,
    /// Counts the changes of `progress` (bumped under its write lock,
    /// after the change): a wait set that kept a hook of the list knows
    /// it is still there while this holds.
    progress_gen: AtomicU64,
    /// The completion event handler the CQ is bound to.
    handler: Arc<Handler>,
    /// Runs on the handler's thread when an armed CQ gets a completion.
    /// Only that thread locks it, so the lock is never contended.
    callback: Option<Mutex<CqCallback>>,
    /// Completions polled (for the handler's load accounting).
    polled: Arc<PollCounter>,
    /// The proxy this CQ belongs to ([`CqBuilder::proxy`]), by id.
    proxy: Option<u32>,
    /// Waiters asleep on [`wake`](Self::wake) (wait sets that wait with
    /// epoll); a push signals it while there are any.
    sleepers: AtomicU32,
    /// Woken by a push while `sleepers` is not 0 (created by the first
    /// such waiter): a [`Waker`] too, so a burst of completions is one
    /// write, but one read by every epoll waiter of the CQ (one may take
    /// another's wake-up: their sleeps stay bounded).
    wake: std::sync::OnceLock<Option<Waker>>,
    /// How many wakers `waiters` holds: a push looks at the list only
    /// when this is not 0 (no lock, no system call without sleepers).
    waiter_count: AtomicU32,
    /// The wakers of the waiters asleep on this CQ with a descriptor of
    /// their own ([`CompletionQueue::wait`], wait sets waiting with
    /// `ppoll(2)`): a push wakes each, at most one write per sleep and
    /// waiter. A waiter reads only its own descriptor, so no waiter can
    /// swallow another's wake-up, and they sleep with no timer.
    waiters: Mutex<Vec<Arc<Waker>>>,
    /// Whether `wait` busy-polls first or sleeps at once.
    spin_choice: SpinChoice,
    /// A QP of this CQ has posts waiting for its poster's next poll: the
    /// [`DEFERRED_POLLS`]th poll that takes completions runs the hooks'
    /// [`Progress::polled`] (one load when it is clear; a poll that finds
    /// the CQ empty runs every hook anyway).
    tx_deferred: AtomicBool,
    /// Polls that took completions while `tx_deferred` was set.
    tx_deferred_polls: AtomicU32,
}

/// Per CQ, whether [`CompletionQueue::wait`] busy-polls for
/// [`DeviceConfig::poll_spin`](crate::DeviceConfig::poll_spin) first or
/// sleeps at once: whichever gave the shorter waits lately (a moving
/// average of each), trying the other way every [`SPIN_EXPLORE`]-th wait
/// (every [`SPIN_EXPLORE_CLEAR`]-th when one way is at least twice as
/// fast).
///
/// Spinning pays off when the answer comes from a thread running on
/// another CPU. When the CPUs are busy (a neighbour keeps one busy, more
/// runnable threads than CPUs), the thread the waiter waits for often
/// cannot run *because* the waiter spins: it queues behind the spinner or
/// behind the neighbour, and the idle CPU it could be moved to is not idle
/// while the waiter spins. There a 50 µs spin made every hop of a
/// ping-pong take about 40 µs where sleeping at once takes about 10 µs.
#[derive(Debug, Default)]
struct SpinChoice {
    /// Moving average of waits that spun first, in ns (0: none yet).
    spin_ns: AtomicU64,
    /// Moving average of waits that slept at once, in ns (0: none yet).
    sleep_ns: AtomicU64,
    waits: AtomicU32,
}

/// One wait in this many tries the way that is not preferred, so the
/// choice follows when the machine gets quiet or busy again.
const SPIN_EXPLORE: u32 = 32;

/// One wait in this many tries the way that is not preferred when the
/// preferred way is at least [`CLEAR_WIN`] times faster. Trying costs: a
/// sleep tried on a quiet machine adds a wake-up (about 25 µs on a virtual
/// machine) to a 5 µs hop, a spin tried on a busy one up to `poll_spin`;
/// every 32nd wait, that was 1.5–4 µs on the mean of an 8-byte
/// ping-pong and most of its p99.
const SPIN_EXPLORE_CLEAR: u32 = 128;

/// How much faster the preferred way must be for [`SPIN_EXPLORE_CLEAR`].
const CLEAR_WIN: u64 = 2;

impl SpinChoice {
    /// How this wait starts: `Some(poll_spin)`: busy-poll first; `None`:
    /// sleep at once.
    ///
    /// (A spin tried while sleeping is preferred used to be cut to the
    /// sleeping average: a spin not answered by then has lost. With a CPU
    /// hogged that made the tried spins cheap when they failed and fast
    /// when they won, the spinning average drifted below the sleeping one,
    /// and the CQ flipped to spinning and back: 8-byte means 16–27 µs
    /// against 13–18 µs in the same hogged runs. A tried spin spins the
    /// whole `poll_spin` again.)
    fn start(&self, poll_spin: Duration) -> Option<Duration> {
        let n = self.waits.fetch_add(1, Ordering::Relaxed);
        let spin = self.spin_ns.load(Ordering::Relaxed);
        let sleep = self.sleep_ns.load(Ordering::Relaxed);
        let prefer_spin = spin == 0 || sleep == 0 || spin <= sleep;
        let (win, lose) = if prefer_spin {
            (spin, sleep)
        } else {
            (sleep, spin)
        };
        let every = if win > 0 && lose >= win.saturating_mul(CLEAR_WIN) {
            SPIN_EXPLORE_CLEAR
        } else {
            SPIN_EXPLORE
        };
        let explore = n % every == every - 1;
        if prefer_spin == explore {
            return None;
        }
        Some(poll_spin)
    }

    /// A wait that spun first (`spin`) or slept at once took `took`.
    fn record(&self, spin: bool, took: Duration) {
        let avg = if spin { &self.spin_ns } else { &self.sleep_ns };
        let old = avg.load(Ordering::Relaxed);
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let new = if old == 0 {
            ns.max(1)
        } else {
            // Quick to follow a faster way (the other way is tried only
            // now and then), slow to give it up: one stall (the
            // scheduler, a page fault) moves the average by at most half
            // of itself.
            if ns < old {
                (old / 2 + ns / 2).max(1)
            } else {
                let ns = ns.min(old.saturating_mul(4).max(100_000));
                old - old / 8 + ns / 8
            }
        };
        avg.store(new, Ordering::Relaxed);
    }
}

impl Drop for CqShared {
    fn drop(&mut self) {
        self.handler.unbind(&self.polled);
    }
}

/// A completion callback: runs on the CQ's handler thread, with the CQ.
pub type CqCallback = Box<dyn FnMut(&CompletionQueue) + Send>;

/// An event for a CQ with a callback, queued on its handler: the handler
/// runs the callback through this hook (it does not know CQs).
impl Callback for CqShared {
    fn run_callback(self: Arc<Self>) -> bool {
        let cq = CompletionQueue { shared: self };
        if let Some(cb) = &cq.shared.callback {
            (cb.lock())(&cq);
            true
        } else {
            false
        }
    }
}

/// Builds a [`CompletionQueue`] with the less common options: a handler
/// binding, a callback. From [`CompletionQueue::builder`].
///
/// ```
/// use softrdma_engine::Device;
/// use softrdma_engine::cq::CompletionQueue;
/// use softrdma_engine::handlers::{Binding, HandlerId};
///
/// let dev = Device::open_default()?;
/// let cq = CompletionQueue::builder(&dev, 64)
///     .binding(Binding::Handler(HandlerId::new(0)))
///     .callback(|cq: &CompletionQueue| {
///         cq.drain_and_arm(false, |_wc| {});
///     })
///     .build()?;
/// assert_eq!(cq.handler(), HandlerId::new(0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use]
pub struct CqBuilder<'a> {
    device: &'a Device,
    cqe: usize,
    channel: Option<&'a CompletionChannel>,
    binding: Binding,
    callback: Option<CqCallback>,
    /// Set by `CqBuilder::proxy` (in `proxy.rs`).
    pub(crate) proxy: Option<u32>,
    exclusive: bool,
}

impl fmt::Debug for CqBuilder<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqBuilder")
            .field("cqe", &self.cqe)
            .field("channel", &self.channel.is_some())
            .field("binding", &self.binding)
            .field("callback", &self.callback.is_some())
            .field("proxy", &self.proxy)
            .finish_non_exhaustive()
    }
}

impl<'a> CqBuilder<'a> {
    /// Events of the armed CQ go to this channel.
    pub fn channel(mut self, channel: &'a CompletionChannel) -> Self {
        self.channel = Some(channel);
        self
    }

    /// How the CQ chooses its completion event handler (default: the
    /// device's load-balancing policy).
    pub fn binding(mut self, binding: Binding) -> Self {
        self.binding = binding;
        self
    }

    /// An exclusive CQ: the completion queue of one QP (its send and
    /// receive queue may both use it), polled by one consumer at a time
    /// (whoever polls it serializes its polls and its posts on the QP, as
    /// the sockets layer does under its connection's lock). What it gives:
    ///
    /// - its ring has a fixed size: [`CompletionQueue::resize`] fails with
    ///   [`ResizeError::Exclusive`], and pushes, polls and looks take no
    ///   lock around the ring;
    /// - a send posted with [`QueuePair::post_send_now`] that the posting
    ///   thread writes entirely within the call, while the CQ is empty,
    ///   unarmed and has no waiter, completes in the call: its completion
    ///   is returned to the poster instead of being queued (as if it was
    ///   queued and the poster polled it at once).
    ///
    /// A second QP made with an exclusive CQ is refused
    /// ([`CreateQpError::CqInUse`](crate::qp::CreateQpError::CqInUse)).
    ///
    /// [`QueuePair::post_send_now`]: crate::QueuePair::post_send_now
    pub fn exclusive(mut self) -> Self {
        self.exclusive = true;
        self
    }

    /// Events of the armed CQ run `callback` on the CQ's handler thread
    /// (see [`crate::handlers`]).
    pub fn callback(mut self, callback: impl FnMut(&CompletionQueue) + Send + 'static) -> Self {
        self.callback = Some(Box::new(callback));
        self
    }

    /// Creates the CQ.
    ///
    /// # Errors
    ///
    /// As [`CompletionQueue::new`], plus [`CreateCqError::NoSuchHandler`] /
    /// [`CreateCqError::NoHandlerOnCpu`] for an explicit binding that does
    /// not exist and [`CreateCqError::ChannelAndCallback`].
    pub fn build(self) -> Result<CompletionQueue, CreateCqError> {
        let device = self.device;
        check_size(device, self.cqe)
            .map_err(|(requested, max)| CreateCqError::InvalidSize { requested, max })?;
        if let Some(ch) = self.channel
            && !Arc::ptr_eq(&ch.shared.device.inner, &device.inner)
        {
            return Err(CreateCqError::ForeignChannel);
        }
        if self.channel.is_some() && self.callback.is_some() {
            return Err(CreateCqError::ChannelAndCallback);
        }
        // A callback CQ's handler thread starts with its first arm.
        let handler = device.handlers().choose(self.binding)?;
        let polled = Arc::new(PollCounter::default());
        handler.bind(&polled);
        Ok(CompletionQueue {
            shared: Arc::new(CqShared {
                id: NEXT_CQ_ID.fetch_add(1, Ordering::Relaxed),
                device: device.clone(),
                ring: if self.exclusive {
                    Ring::Fixed(ArrayQueue::new(self.cqe))
                } else {
                    Ring::Resizable(RwLock::new(ArrayQueue::new(self.cqe)))
                },
                exclusive: self.exclusive,
                arm: AtomicU8::new(ARM_NONE),
                overflowed: AtomicBool::new(false),
                channel: self.channel.cloned(),
                unacked: AtomicU32::new(0),
                progress: RwLock::new(Arc::new([])),
                progress_gen: AtomicU64::new(0),
                handler,
                callback: self.callback.map(Mutex::new),
                polled,
                proxy: self.proxy,
                sleepers: AtomicU32::new(0),
                wake: std::sync::OnceLock::new(),
                waiter_count: AtomicU32::new(0),
                waiters: Mutex::new(Vec::new()),
                spin_choice: SpinChoice::default(),
                tx_deferred: AtomicBool::new(false),
                tx_deferred_polls: AtomicU32::new(0),
            }),
        })
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("id", &self.id())
            .field("capacity", &self.capacity())
            .field("len", &self.len())
            .field("overflowed", &self.is_overflowed())
            .field("has_channel", &self.shared.channel.is_some())
            .field("has_callback", &self.shared.callback.is_some())
            .field("handler", &self.shared.handler.id())
            .finish_non_exhaustive()
    }
}

fn check_size(device: &Device, cqe: usize) -> Result<(), (usize, u32)> {
    let max = device.attr().max_cqe;
    let max_usize = usize::try_from(max).unwrap_or(usize::MAX);
    if cqe == 0 || cqe > max_usize {
        return Err((cqe, max));
    }
    Ok(())
}

impl CompletionQueue {
    /// A completion queue of `cqe` entries (`ibv_create_cq`). Events of an
    /// armed CQ go to `channel`, if given.
    ///
    /// # Errors
    ///
    /// [`CreateCqError::InvalidSize`] if `cqe` is 0 or above the device's
    /// `max_cqe`; [`CreateCqError::ForeignChannel`] if `channel` was created
    /// on another device.
    pub fn new(
        device: &Device,
        cqe: usize,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue, CreateCqError> {
        let b = CompletionQueue::builder(device, cqe);
        match channel {
            Some(ch) => b.channel(ch).build(),
            None => b.build(),
        }
    }

    /// A builder for a CQ of `cqe` entries with a handler binding or a
    /// callback.
    pub fn builder(device: &Device, cqe: usize) -> CqBuilder<'_> {
        CqBuilder {
            device,
            cqe,
            channel: None,
            binding: Binding::Balanced,
            callback: None,
            proxy: None,
            exclusive: false,
        }
    }

    /// The id of the proxy this CQ belongs to, if it is a proxy CQ
    /// ([`CqBuilder::proxy`]).
    pub fn proxy_id(&self) -> Option<u32> {
        self.shared.proxy
    }

    /// A CQ of `cqe` entries whose events run `callback` on its completion
    /// event handler (chosen by the device's load-balancing policy). Arm it
    /// with [`req_notify`](Self::req_notify); see [`crate::handlers`].
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_callback(
        device: &Device,
        cqe: usize,
        callback: impl FnMut(&CompletionQueue) + Send + 'static,
    ) -> Result<CompletionQueue, CreateCqError> {
        CompletionQueue::builder(device, cqe)
            .callback(callback)
            .build()
    }

    /// The completion event handler the CQ is bound to.
    pub fn handler(&self) -> HandlerId {
        self.shared.handler.id()
    }

    /// The CPU of the CQ's completion event handler.
    pub fn handler_cpu(&self) -> usize {
        self.shared.handler.cpu()
    }

    /// Whether the CQ has a completion callback.
    pub fn has_callback(&self) -> bool {
        self.shared.callback.is_some()
    }

    /// Whether the CQ was made with [`CqBuilder::exclusive`].
    pub fn is_exclusive(&self) -> bool {
        self.shared.exclusive
    }

    /// Whether a completion produced now may go straight to the poster of
    /// its request instead of the ring ([`CqBuilder::exclusive`]): the CQ
    /// is exclusive, holds nothing (nothing older waits to be polled), is
    /// not armed and nobody waits on it (a push would raise no event and
    /// wake nobody). Its QP's connection lock must be held (every push of
    /// its only QP is made under it).
    pub(crate) fn may_complete_directly(&self) -> bool {
        let s = &*self.shared;
        s.exclusive
            && s.arm.load(Ordering::Relaxed) == ARM_NONE
            && s.sleepers.load(Ordering::Relaxed) == 0
            && s.waiter_count.load(Ordering::Relaxed) == 0
            && self.is_empty()
    }

    /// Takes every completion, arms the CQ and looks again, until a look
    /// after arming finds nothing: the verbs rule for event-driven
    /// consumers (a completion that arrives between the last poll and the
    /// arm raises no event, so it must be found by the poll after the arm).
    /// Calls `f` with each completion, oldest first; returns how many. When
    /// it returns, the CQ is armed (`solicited_only` as in
    /// [`req_notify`](Self::req_notify)) and was seen empty after arming.
    ///
    /// Without a channel or callback the CQ cannot be armed: this then just
    /// polls until empty (as when [`req_notify`](Self::req_notify) fails).
    pub fn drain_and_arm(&self, solicited_only: bool, mut f: impl FnMut(&WorkCompletion)) -> usize {
        let mut buf = [WorkCompletion::success(0, crate::wc::WcOpcode::Send, 0); 32];
        let mut total = 0;
        loop {
            let n = self.poll(&mut buf);
            buf[..n].iter().for_each(&mut f);
            total += n;
            if n == buf.len() {
                continue;
            }
            if self.req_notify(solicited_only).is_err() && n == 0 {
                return total;
            }
            let n = self.poll(&mut buf);
            if n == 0 {
                return total;
            }
            buf[..n].iter().for_each(&mut f);
            total += n;
        }
    }

    /// The CQ's identifier (unique in the process; used in async events).
    pub fn id(&self) -> u32 {
        self.shared.id
    }

    /// The number of completions the CQ holds.
    pub fn capacity(&self) -> usize {
        self.shared.ring.with(ArrayQueue::capacity)
    }

    /// The number of completions queued now.
    pub fn len(&self) -> usize {
        self.shared.ring.with(ArrayQueue::len)
    }

    /// Whether no completion is queued now.
    pub fn is_empty(&self) -> bool {
        // Two loads, where `len` loops until it reads head and tail of one
        // moment: waiters look here several times per wait.
        self.shared.ring.with(ArrayQueue::is_empty)
    }

    /// The device the CQ was created on.
    pub fn device(&self) -> &Device {
        &self.shared.device
    }

    /// Whether the CQ is the same queue as `other` (both are handles of it).
    pub fn same_as(&self, other: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Takes up to `out.len()` completions, oldest first, into `out`;
    /// returns how many (`ibv_poll_cq`). Never blocks.
    ///
    /// If the CQ is empty and the device was opened with
    /// [`poll_driven_receive`](crate::DeviceConfig::poll_driven_receive),
    /// the calling thread first processes whatever the QPs using this CQ
    /// have received (without blocking), then looks again.
    pub fn poll(&self, out: &mut [WorkCompletion]) -> usize {
        self.poll_progress(out).0
    }

    /// `poll`, and whether the receive path took in bytes.
    fn poll_progress(&self, out: &mut [WorkCompletion]) -> (usize, bool) {
        if out.is_empty() {
            return (0, false);
        }
        let mut n = self.poll_ring(out);
        let mut progressed = false;
        if n == 0 && self.shared.device.config().poll_driven_receive {
            // Every hook runs (and writes what its posts left).
            self.take_deferred_mark();
            if self.run_progress() {
                progressed = true;
                n = self.poll_ring(out);
            }
        } else if n > 0 {
            self.took_completions();
        }
        if n > 0 {
            self.shared.polled.add(n);
        }
        (n, progressed)
    }

    /// Like [`wait`](Self::wait), but also returns (0) as soon as the
    /// receive path took in bytes from a QP of this CQ, completion or not:
    /// for applications that poll memory for a peer's RDMA Write (which
    /// raises no completion at the target), so they can look at the memory
    /// and still sleep instead of spinning when nothing comes.
    pub fn wait_progress(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> usize {
        self.wait_inner(out, timeout, true)
    }

    /// The oldest completion, if any (see [`poll`](Self::poll)).
    pub fn poll_one(&self) -> Option<WorkCompletion> {
        let mut one = [WorkCompletion::success(0, crate::wc::WcOpcode::Send, 0)];
        (self.poll(&mut one) == 1).then_some(one[0])
    }

    /// Polls until a completion comes or `timeout` has passed (`None`: no
    /// limit); returns how many were taken (0: timed out). Made for
    /// applications that would otherwise busy-poll [`poll`](Self::poll) in
    /// a loop, and for shared machines:
    ///
    /// 1. it busy-polls for
    ///    [`DeviceConfig::poll_spin`](crate::DeviceConfig::poll_spin)
    ///    (driving the receive path itself, no thread hand-off), yielding
    ///    the CPU every
    ///    [`DeviceConfig::poll_yield_every`](crate::DeviceConfig::poll_yield_every)
    ///    empty polls so that a thread it waits for can run on the same CPU;
    /// 2. then it sleeps in `poll(2)` on the sockets of the CQ's QPs and on
    ///    an event fd that pushes from other threads signal (send
    ///    completions written by a datamover). Bytes arriving wake this
    ///    thread, which runs the receive path itself: no receive-thread
    ///    hand-off, one wake-up, as a blocking TCP `read` has (and the
    ///    scheduler favours a woken thread on a busy CPU). Without
    ///    [`DeviceConfig::poll_driven_receive`](crate::DeviceConfig::poll_driven_receive)
    ///    the engine threads watch the sockets and the push wakes it.
    ///
    /// With [`DeviceConfig::poll_spin_adaptive`](crate::DeviceConfig::poll_spin_adaptive)
    /// (the default) each wait either does both steps or goes to step 2 at
    /// once, whichever gave the shorter waits lately on this CQ. A wait
    /// that goes to step 2 at once looks only at the ring first (the
    /// `poll(2)` on the sockets returns at once if bytes are already
    /// there, so no `recv` is spent finding nothing).
    ///
    /// While the thread sleeps on the sockets, and for 10 ms after a wait
    /// that ran out of time (a caller waiting with a timeout in a loop is
    /// back by then), the engine threads leave those sockets to it; they
    /// receive for them once it has not polled for a while (a wait that
    /// returns completions gives the sockets back at once, so they are the
    /// engine threads' after the usual quiet period, or two of them when an
    /// engine thread had already left bytes to the wait), or at once when the
    /// CQ is armed.
    ///
    /// Needs no completion channel and does not arm the CQ (an armed CQ
    /// still raises its event).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> usize {
        self.wait_inner(out, timeout, false)
    }

    fn wait_inner(
        &self,
        out: &mut [WorkCompletion],
        timeout: Option<Duration>,
        on_progress: bool,
    ) -> usize {
        if out.is_empty() {
            return 0;
        }
        let config = self.shared.device.config();
        let choice = &self.shared.spin_choice;
        let adaptive = config.poll_spin_adaptive && config.poll_spin != Duration::MAX;
        let start = if adaptive {
            choice.start(config.poll_spin)
        } else {
            Some(config.poll_spin)
        };
        let spin = start.is_some();
        let budget = start.unwrap_or(Duration::ZERO);
        // A wait about to sleep on the sockets at once only looks at the
        // ring first: `poll(2)` on the sockets returns at once if bytes are
        // there, so a `recv` that most often finds nothing (one system
        // call, the socket's lock) is saved on every wait.
        let sleeps_on_sockets = budget.is_zero() && config.poll_driven_receive;
        let (n, progressed) = if sleeps_on_sockets {
            let n = self.poll_ring(out);
            if n > 0 {
                self.shared.polled.add(n);
                self.took_completions();
            }
            (n, false)
        } else {
            self.poll_progress(out)
        };
        if n > 0 || (on_progress && progressed) {
            return n;
        }
        let start = crate::sys::clock::now();
        let deadline = timeout.and_then(|t| start.checked_add(t));
        match self.wait_for(out, start, deadline, budget, on_progress) {
            Some(n) => {
                // Completions, or (`wait_progress`) bytes received.
                if adaptive {
                    choice.record(spin, crate::sys::clock::elapsed(start));
                }
                n
            }
            None => 0,
        }
    }

    /// Busy-polls for `spin`, then sleeps (see [`wait`](Self::wait)).
    /// `None`: the deadline passed first.
    fn wait_for(
        &self,
        out: &mut [WorkCompletion],
        start: std::time::Instant,
        deadline: Option<std::time::Instant>,
        spin: Duration,
        on_progress: bool,
    ) -> Option<usize> {
        let config = self.shared.device.config();
        // `None`: spin until the deadline, or for good.
        let spin_until = match (start.checked_add(spin), deadline) {
            (Some(s), Some(d)) => Some(s.min(d)),
            (Some(s), None) => Some(s),
            (None, d) => d,
        };
        let yield_every = config.poll_yield_every;
        let mut empty = 0u32;
        while spin_until.is_none_or(|u| crate::sys::clock::now() < u) {
            let (n, progressed) = self.poll_progress(out);
            if n > 0 || (on_progress && progressed) {
                return Some(n);
            }
            empty = empty.wrapping_add(1);
            if yield_every > 0 && empty.is_multiple_of(yield_every) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // The caller has just looked if there was no spinning.
        let mut look = !spin.is_zero();
        let mut sleep = |set: &mut SleepSet| {
            let waker = set.waker();
            let r = self.sleep_loop(out, deadline, on_progress, waker.as_ref(), &mut look, set);
            set.hooks.clear();
            set.fds.clear();
            r
        };
        // A nested wait (none is known) gets buffers of its own, as does a
        // wait after the thread's locals were destroyed: glibc's `exit`
        // destroys the exiting thread's before the exit handlers run,
        // which may wait.
        SLEEP_SET
            .try_with(|cell| cell.try_borrow_mut().ok().map(|mut set| sleep(&mut set)))
            .ok()
            .flatten()
            .unwrap_or_else(|| sleep(&mut SleepSet::default()))
    }

    /// The sleeping step of [`wait_for`](Self::wait_for).
    fn sleep_loop(
        &self,
        out: &mut [WorkCompletion],
        deadline: Option<std::time::Instant>,
        on_progress: bool,
        wake: Option<&Arc<Waker>>,
        look: &mut bool,
        set: &mut SleepSet,
    ) -> Option<usize> {
        let shared = &*self.shared;
        let config = shared.device.config();
        // Whether this wait has run the receive path yet: a wait that
        // sleeps at once has only looked at the ring; if its time is up
        // before it sleeps (a zero timeout), it still receives once.
        let mut received = *look || !config.poll_driven_receive;
        // Whether this wait claimed its QPs' sockets for a sleep: a wait
        // that then returns what it received gives them back (the claim
        // reaches up to `SLEEP_MAX` past the sleep's start, and a poll no
        // longer cuts it short; a caller that goes on without waiting, for
        // example spinning on memory for a Write, would see the bytes
        // placed only once it ran out).
        let mut claimed = false;
        loop {
            // Receive and look once more before sleeping.
            if *look {
                received = true;
                let (n, progressed) = self.poll_progress(out);
                if n > 0 || (on_progress && progressed) {
                    if claimed {
                        self.release_claims();
                    }
                    return Some(n);
                }
            }
            *look = true;
            // `None`: no deadline, a sleep until woken (no clock read, no
            // kernel timer).
            let nap = match deadline {
                None => None,
                Some(d) => {
                    let now = crate::sys::clock::now();
                    if now >= d {
                        if !received {
                            let (n, progressed) = self.poll_progress(out);
                            if n > 0 || (on_progress && progressed) {
                                return Some(n);
                            }
                        }
                        if config.poll_driven_receive && wake.is_some() {
                            self.claim_after_timeout();
                        }
                        return None;
                    }
                    Some(d.saturating_duration_since(now).min(SLEEP_MAX))
                }
            };
            // Sleep on the QPs' sockets and on `wake` (this thread's own
            // waker, registered with the CQ): bytes arriving wake
            // this thread, which then runs the receive path itself (no
            // hand-off to an engine thread); completions pushed by other
            // threads (send completions, another poller) signal `wake`. The
            // engine threads leave these sockets to us while we sleep
            // (`sleep_on`).
            set.hooks.clear();
            set.fds.clear();
            set.hooks
                .extend(shared.progress.read().iter().filter_map(Weak::upgrade));
            let on_sockets = config.poll_driven_receive && wake.is_some();
            if on_sockets {
                // QPs without a socket to watch receive nothing.
                let claim = nap.unwrap_or(SLEEP_MAX);
                let until = crate::datamover::now_ns()
                    .saturating_add(u64::try_from(claim.as_nanos()).unwrap_or(u64::MAX));
                for h in &set.hooks {
                    if let Some(fd) = h.sleep_on(Some(until)) {
                        set.fds.push(fd);
                        claimed = true;
                    }
                }
            } else {
                // This thread will not run the receive path: hand the
                // sockets to the engine threads.
                self.notify_armed();
            }
            if let Some(wake) = wake {
                set.fds.push(wake.as_raw_fd());
            }
            // From here a push signals `wake`. A push before it is in the
            // ring: look there (without receiving, which could push to this
            // CQ and signal this very thread) before sleeping.
            if let Some(w) = wake {
                self.waiter_enter(w);
            }
            let n = self.poll_ring(out);
            let mut woken = false;
            if n == 0 {
                if set.fds.is_empty() {
                    std::thread::sleep(nap.unwrap_or(SLEEP_MAX).min(Duration::from_micros(100)));
                } else {
                    // The hooks (and so the QPs owning the sockets) stay
                    // alive until after the wait.
                    woken = set.fds.wait_last(nap).is_ok_and(|r| r.1 && wake.is_some());
                }
            }
            if let Some(w) = wake {
                self.waiter_leave(w);
            }
            if on_sockets && n > 0 {
                // Returning without receiving: the sockets are the engine
                // threads' again after the usual quiet period. (Otherwise
                // the receive path that runs next, as a busy poller, says
                // the same.)
                for h in &set.hooks {
                    let _ = h.sleep_on(None);
                }
            }
            set.hooks.clear();
            if woken && let Some(wake) = wake {
                // Read, then let pushes write again; the look at the ring
                // that follows (the next round, or the caller's) sees
                // what a push that did not write announced.
                wake.reset();
            }
            if n > 0 {
                shared.polled.add(n);
                self.took_completions();
                return Some(n);
            }
        }
    }

    /// A wait that slept on its QPs' sockets returns what it received:
    /// the sockets are the engine threads' again after the usual quiet
    /// period.
    fn release_claims(&self) {
        let hooks = Arc::clone(&self.shared.progress.read());
        for hook in hooks.iter() {
            if let Some(hook) = hook.upgrade() {
                let _ = hook.sleep_on(None);
            }
        }
    }

    /// A wait ran out of time: the claim on its QPs' sockets reaches
    /// [`CLAIM_AFTER_TIMEOUT_NS`] further (see there).
    fn claim_after_timeout(&self) {
        let until = crate::datamover::now_ns().saturating_add(CLAIM_AFTER_TIMEOUT_NS);
        let hooks = Arc::clone(&self.shared.progress.read());
        for hook in hooks.iter() {
            if let Some(hook) = hook.upgrade() {
                hook.renew_claim(until);
            }
        }
    }

    fn poll_ring(&self, out: &mut [WorkCompletion]) -> usize {
        self.shared.ring.with(|ring| Self::pop_into(ring, out))
    }

    fn pop_into(ring: &ArrayQueue<WorkCompletion>, out: &mut [WorkCompletion]) -> usize {
        let mut n = 0;
        for slot in out.iter_mut() {
            // Two loads: `pop` finds the ring empty only after a full
            // fence (a locked instruction), which ended every poll.
            if ring.is_empty() {
                break;
            }
            match ring.pop() {
                Some(wc) => {
                    *slot = wc;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// A poll or a wait took completions from the ring: a poster whose CQ
    /// keeps returning completions (a server answering requests) polls
    /// all the same, so what its posts left for its polls goes after a
    /// few of them ([`deferred_polls_due`](Self::deferred_polls_due)), not
    /// at the backstop.
    fn took_completions(&self) {
        if self.deferred_polls_due() {
            self.run_polled();
        }
    }

    /// Clears the mark of [`note_deferred`](Self::note_deferred); whether
    /// it was set.
    fn take_deferred_mark(&self) -> bool {
        // SeqCst: a QP that defers after this swap sets the mark again;
        // one that deferred before it is seen by the hooks run after it.
        if self.shared.tx_deferred.load(Ordering::Relaxed)
            && self.shared.tx_deferred.swap(false, Ordering::SeqCst)
        {
            self.shared.tx_deferred_polls.store(0, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// A poll took completions: whether it is the [`DEFERRED_POLLS`]th
    /// since posts were deferred (then the mark is cleared and the caller
    /// runs the hooks). The posts of a burst wait for a few polls, not for
    /// the first: a message-rate loop whose CQ returns completions at every
    /// poll (its requests' and its peer's credits) would otherwise write a
    /// few requests per `writev` (measured: the 8-byte Send rate fell by
    /// about 13 % with the first poll writing them).
    fn deferred_polls_due(&self) -> bool {
        let s = &self.shared;
        s.tx_deferred.load(Ordering::Relaxed)
            && s.tx_deferred_polls.fetch_add(1, Ordering::Relaxed) + 1 >= DEFERRED_POLLS
            && self.take_deferred_mark()
    }

    /// A QP of this CQ deferred a post to its poster's next poll (see
    /// `qp::post::TxBatch`): the next poll, also one that takes
    /// completions, lets the CQ's QPs write theirs.
    pub(crate) fn note_deferred(&self) {
        // After the QP's count (SeqCst both): the poll that clears the
        // mark sees the count.
        if !self.shared.tx_deferred.load(Ordering::SeqCst) {
            self.shared.tx_deferred.store(true, Ordering::SeqCst);
        }
    }

    /// Runs the hooks' [`Progress::polled`].
    fn run_polled(&self) {
        let hooks = Arc::clone(&self.shared.progress.read());
        for hook in hooks.iter() {
            if let Some(hook) = hook.upgrade() {
                hook.polled();
            }
        }
    }

    fn run_progress(&self) -> bool {
        let armed = self.shared.arm.load(Ordering::Relaxed) != 0;
        self.run_progress_as(armed)
    }

    fn run_progress_as(&self, armed: bool) -> bool {
        let hooks = {
            let hooks = self.shared.progress.read();
            if hooks.is_empty() {
                return false;
            }
            Arc::clone(&hooks)
        };
        let mut any = false;
        for hook in hooks.iter() {
            if let Some(hook) = hook.upgrade() {
                any |= hook.progress(armed);
            }
        }
        any
    }

    /// Arms the CQ (`ibv_req_notify_cq`): the next completion
    /// (`solicited_only == false`), or the next solicited receive completion
    /// or error completion (`solicited_only == true`), raises one event on
    /// the CQ's channel and disarms it. Completions already queued do not
    /// raise an event: poll after arming. Arming for any completion while
    /// armed for solicited ones widens the arm; the reverse keeps it wide.
    ///
    /// With a callback, the event runs the callback on the CQ's handler
    /// thread instead (see [`crate::handlers`]).
    ///
    /// # Errors
    ///
    /// [`NotifyError::NoChannel`] if the CQ has neither a completion channel
    /// nor a callback; [`NotifyError::HandlerThread`] if the thread that
    /// would run the callback cannot be started (the CQ is not armed: its
    /// event would wait for ever).
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), NotifyError> {
        if self.shared.channel.is_none() {
            if self.shared.callback.is_none() {
                return Err(NotifyError::NoChannel);
            }
            // The handler's thread starts with the first arm of a callback
            // CQ (an event comes only after one): a thread that cannot
            // start is reported here, to the caller that waits for the
            // callback.
            self.shared
                .handler
                .ensure_started()
                .map_err(|_| NotifyError::HandlerThread)?;
        }
        let want = if solicited_only {
            ARM_SOLICITED
        } else {
            ARM_NEXT
        };
        self.shared.arm.fetch_max(want, Ordering::SeqCst);
        // The application's next poll (an Acquire load in the ring) must not
        // be satisfied before the arm is visible: see `push`.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.notify_armed();
        Ok(())
    }

    /// Tells the QPs of this CQ that their owner now waits for events.
    fn notify_armed(&self) {
        let hooks = Arc::clone(&self.shared.progress.read());
        for hook in hooks.iter() {
            if let Some(hook) = hook.upgrade() {
                hook.armed();
            }
        }
    }

    /// Changes the number of entries (`ibv_resize_cq`), keeping the queued
    /// completions in order. Pushes and polls wait for the move.
    ///
    /// # Errors
    ///
    /// [`ResizeError::InvalidSize`] if `cqe` is 0 or above `max_cqe`;
    /// [`ResizeError::TooSmall`] if more completions are queued than `cqe`.
    pub fn resize(&self, cqe: usize) -> Result<(), ResizeError> {
        check_size(&self.shared.device, cqe)
            .map_err(|(requested, max)| ResizeError::InvalidSize { requested, max })?;
        let Ring::Resizable(ring) = &self.shared.ring else {
            return Err(ResizeError::Exclusive);
        };
        let mut ring = ring.write();
        if ring.len() > cqe {
            return Err(ResizeError::TooSmall {
                requested: cqe,
                queued: ring.len(),
            });
        }
        let new = ArrayQueue::new(cqe);
        while let Some(wc) = ring.pop() {
            // Cannot fail: the new ring holds at least ring.len() entries and
            // nobody else touches it.
            let _ = new.push(wc);
        }
        *ring = new;
        Ok(())
    }

    /// Whether a completion was ever lost because the CQ was full.
    pub fn is_overflowed(&self) -> bool {
        self.shared.overflowed.load(Ordering::Relaxed)
    }

    /// Acknowledges `n` events taken from the channel for this CQ
    /// (`ibv_ack_cq_events`). Events need not be acknowledged before the CQ
    /// is dropped (nothing waits for them); the count is kept for
    /// [`unacked_events`](Self::unacked_events). Acknowledging more than
    /// were delivered leaves the count at 0.
    pub fn ack_events(&self, n: u32) {
        let _ = self
            .shared
            .unacked
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(n))
            });
    }

    /// Events delivered for this CQ and not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.shared.unacked.load(Ordering::Relaxed)
    }

    /// [`push`](Self::push) of a completion older than everything the CQ
    /// holds (one kept out of it, [`may_complete_directly`](Self::may_complete_directly),
    /// that its taker will not take): it goes first, before what is held,
    /// which is taken out and queued again after it. Only when nothing
    /// takes completions out of the CQ meanwhile (the taker of the kept
    /// one promised that) and under the QP's connection lock (nothing is
    /// pushed meanwhile).
    ///
    /// The completions taken out are queued again as new pushes: each
    /// runs the wake-ups again (a spurious wake at most: with a kept
    /// completion the CQ was not armed and had no waiters) and counts as
    /// not solicited. Used only where a kept completion would otherwise be
    /// lost (an unwind).
    ///
    /// # Errors
    ///
    /// As [`push`](Self::push), if one of them is lost (the CQ is full).
    pub(crate) fn push_oldest(&self, wc: WorkCompletion) -> Result<(), CqOverflow> {
        let held: Vec<WorkCompletion> = self
            .shared
            .ring
            .with(|r| std::iter::from_fn(|| r.pop()).collect());
        // Kept out because the CQ was empty, unarmed and without waiters:
        // an event it raises now is its own.
        let mut r = self.push(wc, false);
        for w in held {
            if let Err(e) = self.push(w, false) {
                r = Err(e);
            }
        }
        r
    }

    /// Queues a completion (the data path). `solicited`: the completion is of
    /// a receive that consumed a solicited Send (wakes solicited-only arms).
    ///
    /// # Errors
    ///
    /// [`CqOverflow`] if the CQ is full: the completion is not stored, the CQ
    /// is marked overflowed and, the first time, an
    /// [`AsyncEventKind::CqError`] event is queued on the device. The QP
    /// should go to ERROR.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn push(&self, wc: WorkCompletion, solicited: bool) -> Result<(), CqOverflow> {
        let shared = &*self.shared;
        let stored = shared.ring.with(|r| r.push(wc).is_ok());
        if !stored {
            if !shared.overflowed.swap(true, Ordering::Relaxed) {
                shared.device.events().push(
                    AsyncEvent::cq(AsyncEventKind::CqError, shared.id).with_detail(format!(
                        "completion queue overflow: a completion of QP {} was lost",
                        wc.qp_num
                    )),
                );
            }
            return Err(CqOverflow { cq_id: shared.id });
        }
        // Pairs with the fence in req_notify: either this load sees the arm,
        // or the application's poll after arming sees the completion. The
        // fence is needed: the ring publishes the completion with a Release
        // store, and a Release store followed by a SeqCst load may be
        // reordered (on x86 the store waits in the store buffer while the
        // load reads the old arm), so both sides could miss each other and
        // the event was lost (an armed, empty-looking CQ that never woke).
        std::sync::atomic::fence(Ordering::SeqCst);
        let arm = shared.arm.load(Ordering::SeqCst);
        if shared.sleepers.load(Ordering::SeqCst) > 0
            && let Some(Some(wake)) = shared.wake.get()
        {
            wake.wake();
        }
        if shared.waiter_count.load(Ordering::SeqCst) > 0 {
            for w in shared.waiters.lock().iter() {
                w.wake();
            }
        }
        let wakes = match arm {
            ARM_NONE => false,
            ARM_SOLICITED => solicited || !wc.status.is_success(),
            _ => true,
        };
        if wakes
            && shared
                .arm
                .compare_exchange(arm, ARM_NONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            if let Some(channel) = &shared.channel {
                channel.shared.queue.push(Arc::downgrade(&self.shared));
            } else if shared.callback.is_some() {
                shared
                    .handler
                    .deliver(HandlerEvent::new(Arc::<CqShared>::downgrade(&self.shared)));
            }
        }
        Ok(())
    }

    /// Whether a live QP uses this CQ (its hook is attached).
    pub(crate) fn serves_a_qp(&self) -> bool {
        self.shared
            .progress
            .read()
            .iter()
            .any(|h| h.strong_count() > 0)
    }

    /// Registers a QP's receive-progress hook (see [`Progress`]). Dead hooks
    /// are dropped on the way.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn attach_progress(&self, hook: Weak<dyn Progress>) {
        let mut hooks = self.shared.progress.write();
        let mut new: Vec<_> = hooks
            .iter()
            .filter(|h| h.strong_count() > 0)
            .cloned()
            .collect();
        new.push(hook);
        *hooks = new.into();
        self.shared.progress_gen.fetch_add(1, Ordering::Release);
    }

    /// Removes a hook registered with [`attach_progress`](Self::attach_progress).
    #[allow(dead_code)] // used by the data path
    pub(crate) fn detach_progress(&self, hook: &Weak<dyn Progress>) {
        let mut hooks = self.shared.progress.write();
        let new: Vec<_> = hooks
            .iter()
            .filter(|h| h.strong_count() > 0 && !Weak::ptr_eq(h, hook))
            .cloned()
            .collect();
        *hooks = new.into();
        self.shared.progress_gen.fetch_add(1, Ordering::Release);
    }
}

/// For [`crate::wait_set`]: a waiter that sleeps on several CQs at once.
impl CompletionQueue {
    /// Registers `waker`: from now on a push wakes it (pair with
    /// [`waiter_leave`](Self::waiter_leave)); the caller then looks at the
    /// ring, and sleeps on the waker's descriptor if it found nothing.
    pub(crate) fn waiter_enter(&self, waker: &Arc<Waker>) {
        self.shared.waiters.lock().push(Arc::clone(waker));
        // After the list holds it: a push that sees the count finds it.
        self.shared.waiter_count.fetch_add(1, Ordering::SeqCst);
    }

    /// Unregisters a waker of [`waiter_enter`](Self::waiter_enter).
    pub(crate) fn waiter_leave(&self, waker: &Arc<Waker>) {
        self.shared.waiter_count.fetch_sub(1, Ordering::SeqCst);
        let mut list = self.shared.waiters.lock();
        if let Some(i) = list.iter().position(|w| Arc::ptr_eq(w, waker)) {
            list.swap_remove(i);
        }
    }

    /// Counts the caller as a sleeper (a push signals the returned event
    /// fd from now on); pair with [`wait_set_leave`](Self::wait_set_leave).
    /// `None`: no event fd.
    pub(crate) fn wait_set_enter(&self) -> Option<RawFd> {
        let wake = self.shared.wake.get_or_init(|| Waker::new().ok());
        self.shared.sleepers.fetch_add(1, Ordering::SeqCst);
        wake.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Resets the event fd of [`wait_set_enter`](Self::wait_set_enter)
    /// (found readable).
    pub(crate) fn wait_set_drain(&self) {
        if let Some(Some(wake)) = self.shared.wake.get() {
            // Read, then let pushes write again (the caller looks at the
            // CQ after this).
            wake.reset();
        }
    }

    /// An identity of this CQ that keeps neither it nor its event fd
    /// alive (nor lets its address be reused while held): what a wait
    /// set's persistent registration of the event fd belongs to.
    pub(crate) fn wait_set_key(&self) -> Weak<dyn std::any::Any + Send + Sync> {
        let w: Weak<CqShared> = Arc::downgrade(&self.shared);
        w
    }

    /// The caller no longer sleeps (see [`wait_set_enter`](Self::wait_set_enter)).
    pub(crate) fn wait_set_leave(&self) {
        self.shared.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// The receive-progress hooks (QPs) of this CQ, if the calling thread
    /// may run the receive path (`poll_driven_receive`): the CQ's own
    /// copy-on-write list, shared (no allocation; a dead hook's `upgrade`
    /// fails). The list is replaced, never changed, when a hook comes or
    /// goes, so a wait set that keeps it knows the hooks are the same
    /// while `Arc::ptr_eq` holds.
    pub(crate) fn wait_set_hooks(&self) -> Option<Arc<[Weak<dyn Progress>]>> {
        if !self.shared.device.config().poll_driven_receive {
            return None;
        }
        Some(Arc::clone(&self.shared.progress.read()))
    }

    /// How many times the hook list of [`wait_set_hooks`](Self::wait_set_hooks)
    /// changed: while it holds, a hook taken from the list is still on it.
    pub(crate) fn hooks_generation(&self) -> u64 {
        self.shared.progress_gen.load(Ordering::Acquire)
    }

    /// The CQ's identity while it lives (the address of its shared state;
    /// held with [`wait_set_key`](Self::wait_set_key), which keeps the
    /// address from being reused): what a wait set finds its state of
    /// this CQ by, without touching a reference count.
    pub(crate) fn wait_set_id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }
}

/// A completion channel (`ibv_comp_channel`): where armed CQs deliver their
/// events. One channel may serve many CQs. A cheap, clonable handle.
///
/// Its [`fd`](Self::fd) is readable while an event is pending, so it can be
/// watched with `poll(2)`, `epoll(7)` or an async runtime; take the event
/// with [`try_get_event`](Self::try_get_event).
///
/// Events of a CQ that has been dropped meanwhile are discarded.
#[derive(Clone)]
pub struct CompletionChannel {
    shared: Arc<ChannelShared>,
}

struct ChannelShared {
    device: Device,
    queue: FdQueue<Weak<CqShared>>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.shared.queue.fd().as_raw_fd())
            .field("pending", &self.shared.queue.len())
            .finish_non_exhaustive()
    }
}

// The device's constructors of CQs and channels live here, so that the
// device (a lower layer) does not name this module.
impl Device {
    /// Creates a completion queue of `cqe` entries without a completion
    /// channel (`ibv_create_cq`); see [`CompletionQueue::new`].
    pub fn create_cq(&self, cqe: usize) -> Result<CompletionQueue, CreateCqError> {
        CompletionQueue::new(self, cqe, None)
    }

    /// Creates a completion channel (`ibv_create_comp_channel`).
    pub fn create_comp_channel(&self) -> io::Result<CompletionChannel> {
        CompletionChannel::new(self)
    }
}

impl CompletionChannel {
    /// A new channel (`ibv_create_comp_channel`).
    ///
    /// # Errors
    ///
    /// The event descriptor could not be created (descriptor limit).
    pub fn new(device: &Device) -> io::Result<CompletionChannel> {
        Ok(CompletionChannel {
            shared: Arc::new(ChannelShared {
                device: device.clone(),
                queue: FdQueue::new()?,
            }),
        })
    }

    /// The CQ of the next event, waiting up to `timeout` for one (`None`:
    /// no limit), like `ibv_get_cq_event`. Counts as one unacknowledged
    /// event of that CQ (see [`CompletionQueue::ack_events`]).
    ///
    /// # Errors
    ///
    /// [`GetEventError::TimedOut`] when the time is up,
    /// [`GetEventError::Io`] if waiting on the descriptor failed.
    pub fn get_event(&self, timeout: Option<Duration>) -> Result<CompletionQueue, GetEventError> {
        loop {
            match self.shared.queue.pop(timeout)? {
                None => return Err(GetEventError::TimedOut),
                Some(weak) => {
                    if let Some(cq) = Self::deliver(&weak) {
                        return Ok(cq);
                    }
                    // The CQ is gone; look for another event (the wait
                    // restarts, so a stream of dead events can stretch it).
                }
            }
        }
    }

    /// The CQ of the next event if one is pending, without waiting.
    pub fn try_get_event(&self) -> Option<CompletionQueue> {
        while let Some(weak) = self.shared.queue.try_pop() {
            if let Some(cq) = Self::deliver(&weak) {
                return Some(cq);
            }
        }
        None
    }

    fn deliver(weak: &Weak<CqShared>) -> Option<CompletionQueue> {
        let shared = weak.upgrade()?;
        shared.unacked.fetch_add(1, Ordering::Relaxed);
        Some(CompletionQueue { shared })
    }

    /// A descriptor that is readable while an event is pending. Reading it
    /// is not needed: take the event with
    /// [`try_get_event`](Self::try_get_event).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.queue.fd()
    }

    /// The event fd behind [`fd`](Self::fd), shared (for `async_cq`).
    #[cfg(feature = "tokio")]
    pub(crate) fn event_fd(&self) -> std::sync::Arc<crate::sys::fd::EventFd> {
        self.shared.queue.event_fd()
    }
}

impl AsFd for CompletionChannel {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd().as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wc::{WcOpcode, WcStatus};
    use crate::{DeviceConfig, WcFlags};
    use std::sync::atomic::AtomicUsize;

    fn dev() -> Device {
        Device::open_default().unwrap()
    }

    fn wc(wr_id: u64) -> WorkCompletion {
        WorkCompletion::success(wr_id, WcOpcode::Recv, 1)
    }

    /// Runs `waits` waits through `c`, each taking `spin` or `sleep` as
    /// chosen; returns how many spun.
    fn choose(c: &SpinChoice, waits: u32, spin: Duration, sleep: Duration) -> u32 {
        let mut spun = 0;
        for _ in 0..waits {
            let s = c.start(Duration::from_micros(50)).is_some();
            spun += u32::from(s);
            c.record(s, if s { spin } else { sleep });
        }
        spun
    }

    #[test]
    fn wait_sleeps_at_once_when_spinning_made_waits_longer() {
        // A busy machine: a hop takes 40 µs when the waiter spins, 10 µs
        // when it sleeps at once.
        let c = SpinChoice::default();
        let (spin, sleep) = (Duration::from_micros(40), Duration::from_micros(10));
        choose(&c, 64, spin, sleep);
        // From then on it spins only to check, one wait in
        // SPIN_EXPLORE_CLEAR (sleeping is 4 × faster).
        let spun = choose(&c, 320, spin, sleep);
        assert!((1..=320 / SPIN_EXPLORE_CLEAR + 1).contains(&spun), "{spun}");
        // The machine gets quiet: spinning answers in 5 µs; it comes back.
        let quiet = Duration::from_micros(5);
        choose(&c, 640, quiet, sleep);
        let spun = choose(&c, 320, quiet, sleep);
        assert!(spun >= 320 - 320 / SPIN_EXPLORE_CLEAR - 1, "{spun}");
    }

    #[test]
    fn a_clear_winner_is_tried_against_less_often() {
        // Spinning 6 × faster than sleeping: a sleep is tried one wait in
        // SPIN_EXPLORE_CLEAR.
        let c = SpinChoice::default();
        let (spin, sleep) = (Duration::from_micros(5), Duration::from_micros(30));
        choose(&c, 256, spin, sleep);
        let slept = 1280 - choose(&c, 1280, spin, sleep);
        assert_eq!(slept, 1280 / SPIN_EXPLORE_CLEAR);
        // Only a little faster: tried one wait in SPIN_EXPLORE.
        let c = SpinChoice::default();
        let sleep = Duration::from_micros(8);
        choose(&c, 256, spin, sleep);
        let slept = 1280 - choose(&c, 1280, spin, sleep);
        assert_eq!(slept, 1280 / SPIN_EXPLORE);
    }

    #[test]
    fn one_stall_does_not_flip_the_choice_for_long() {
        let c = SpinChoice::default();
        let (spin, sleep) = (Duration::from_micros(5), Duration::from_micros(12));
        choose(&c, 64, spin, sleep);
        // A 50 ms scheduler stall in one spinning wait.
        c.record(true, Duration::from_millis(50));
        choose(&c, 32, spin, sleep);
        let spun = choose(&c, 320, spin, sleep);
        assert!(spun >= 320 - 320 / SPIN_EXPLORE, "{spun}");
    }

    #[test]
    fn poll_in_batches_in_order() {
        let cq = CompletionQueue::new(&dev(), 8, None).unwrap();
        for i in 0..8 {
            cq.push(wc(i), false).unwrap();
        }
        let mut out = [wc(99); 3];
        assert_eq!(cq.poll(&mut out), 3);
        assert_eq!(out.map(|w| w.wr_id), [0, 1, 2]);
        assert_eq!(cq.poll(&mut out), 3);
        assert_eq!(out.map(|w| w.wr_id), [3, 4, 5]);
        assert_eq!(cq.poll(&mut out), 2);
        assert_eq!(out[..2].iter().map(|w| w.wr_id).collect::<Vec<_>>(), [6, 7]);
        assert_eq!(cq.poll(&mut out), 0);
        assert_eq!(cq.poll(&mut []), 0);
    }

    #[test]
    fn sizes() {
        let d = dev();
        assert!(matches!(
            CompletionQueue::new(&d, 0, None),
            Err(CreateCqError::InvalidSize { requested: 0, .. })
        ));
        let max = d.attr().max_cqe as usize;
        assert!(CompletionQueue::new(&d, max + 1, None).is_err());
        let cq = CompletionQueue::new(&d, 1, None).unwrap();
        assert!(matches!(cq.resize(0), Err(ResizeError::InvalidSize { .. })));
        assert!(matches!(
            cq.resize(max + 1),
            Err(ResizeError::InvalidSize { .. })
        ));
    }

    #[test]
    fn ids_differ() {
        let d = dev();
        let a = CompletionQueue::new(&d, 1, None).unwrap();
        let b = CompletionQueue::new(&d, 1, None).unwrap();
        assert_ne!(a.id(), b.id());
        assert!(a.same_as(&a.clone()));
        assert!(!a.same_as(&b));
    }

    #[test]
    fn overflow_loses_the_completion_and_raises_one_event() {
        let d = dev();
        let cq = CompletionQueue::new(&d, 2, None).unwrap();
        cq.push(wc(1), false).unwrap();
        cq.push(wc(2), false).unwrap();
        assert_eq!(cq.push(wc(3), false), Err(CqOverflow { cq_id: cq.id() }));
        assert_eq!(cq.push(wc(4), false), Err(CqOverflow { cq_id: cq.id() }));
        assert!(cq.is_overflowed());
        let e = d.events().try_get().unwrap();
        assert_eq!(e.kind, AsyncEventKind::CqError);
        assert_eq!(e.cq_id, Some(cq.id()));
        assert!(d.events().try_get().is_none());
        assert_eq!(cq.poll_one().unwrap().wr_id, 1);
        assert_eq!(cq.poll_one().unwrap().wr_id, 2);
        assert!(cq.poll_one().is_none());
    }

    #[test]
    fn notify_needs_a_channel() {
        let cq = CompletionQueue::new(&dev(), 2, None).unwrap();
        assert_eq!(cq.req_notify(false), Err(NotifyError::NoChannel));
    }

    #[test]
    fn arm_next_fires_once() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        cq.push(wc(0), false).unwrap();
        assert!(ch.try_get_event().is_none(), "not armed");
        cq.req_notify(false).unwrap();
        cq.push(wc(1), false).unwrap();
        cq.push(wc(2), false).unwrap();
        let got = ch.try_get_event().unwrap();
        assert!(got.same_as(&cq));
        assert!(ch.try_get_event().is_none(), "one event per arm");
        assert_eq!(cq.unacked_events(), 1);
        cq.ack_events(1);
        assert_eq!(cq.unacked_events(), 0);
        cq.ack_events(5);
        assert_eq!(cq.unacked_events(), 0);
    }

    #[test]
    fn arm_solicited_waits_for_solicited_or_error() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        cq.req_notify(true).unwrap();
        cq.push(wc(1), false).unwrap();
        assert!(ch.try_get_event().is_none());
        let mut solicited = wc(2);
        solicited.flags = WcFlags::SOLICITED;
        cq.push(solicited, true).unwrap();
        assert!(ch.try_get_event().is_some());

        cq.req_notify(true).unwrap();
        cq.push(
            WorkCompletion::error(3, WcOpcode::Send, 1, WcStatus::WrFlush),
            false,
        )
        .unwrap();
        assert!(ch.try_get_event().is_some());

        // Widening: solicited then next fires on any completion.
        cq.req_notify(true).unwrap();
        cq.req_notify(false).unwrap();
        cq.push(wc(4), false).unwrap();
        assert!(ch.try_get_event().is_some());
        // Next then solicited stays next.
        cq.req_notify(false).unwrap();
        cq.req_notify(true).unwrap();
        cq.push(wc(5), false).unwrap();
        assert!(ch.try_get_event().is_some());
    }

    #[test]
    fn events_of_dropped_cqs_are_discarded() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        cq.req_notify(false).unwrap();
        cq.push(wc(1), false).unwrap();
        drop(cq);
        assert!(ch.try_get_event().is_none());
        assert!(matches!(
            ch.get_event(Some(Duration::from_millis(1))),
            Err(GetEventError::TimedOut)
        ));
    }

    #[test]
    fn foreign_channel_is_refused() {
        let ch = CompletionChannel::new(&dev()).unwrap();
        assert!(matches!(
            CompletionQueue::new(&dev(), 8, Some(&ch)),
            Err(CreateCqError::ForeignChannel)
        ));
    }

    #[test]
    fn resize_keeps_order() {
        let cq = CompletionQueue::new(&dev(), 4, None).unwrap();
        for i in 0..3 {
            cq.push(wc(i), false).unwrap();
        }
        assert_eq!(
            cq.resize(2),
            Err(ResizeError::TooSmall {
                requested: 2,
                queued: 3
            })
        );
        cq.resize(3).unwrap();
        assert_eq!(cq.capacity(), 3);
        assert!(cq.push(wc(9), false).is_err());
        cq.resize(10).unwrap();
        for i in 3..10 {
            cq.push(wc(i), false).unwrap();
        }
        let mut out = [wc(0); 16];
        assert_eq!(cq.poll(&mut out), 10);
        assert!(out[..10].iter().map(|w| w.wr_id).eq(0..10));
    }

    /// Resizes while another thread pushes and this one polls lose no
    /// completion and keep the pusher's order, and the size holds after
    /// each resize.
    #[test]
    fn resizes_while_a_thread_pushes_lose_nothing() {
        const N: u64 = 20_000;
        let cq = CompletionQueue::new(&dev(), 256, None).unwrap();
        let pusher = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for i in 0..N {
                    // Never more than 100 queued: every size below holds them.
                    while cq.len() >= 100 {
                        std::thread::yield_now();
                    }
                    cq.push(wc(i), false).unwrap();
                }
            })
        };
        let mut out = [wc(0); 16];
        let mut next = 0;
        let mut round = 0usize;
        while next < N {
            round += 1;
            let size = [128, 1024, 101][round % 3];
            cq.resize(size).unwrap();
            assert_eq!(cq.capacity(), size);
            let n = cq.poll(&mut out);
            for w in &out[..n] {
                assert_eq!(w.wr_id, next, "in order, none lost");
                next += 1;
            }
            if n == 0 {
                std::thread::yield_now();
            }
        }
        pusher.join().unwrap();
        assert!(cq.is_empty());
        assert!(!cq.is_overflowed());
        // The bound of the last resize holds.
        cq.resize(2).unwrap();
        cq.push(wc(1), false).unwrap();
        cq.push(wc(2), false).unwrap();
        assert!(cq.push(wc(3), false).is_err());
        assert_eq!(cq.len(), 2);
    }

    /// `is_empty` (two loads) says what `len` says, a full ring and
    /// rings that went round several times included.
    #[test]
    fn is_empty_agrees_with_len_over_many_laps() {
        let cq = CompletionQueue::new(&dev(), 3, None).unwrap();
        let mut out = [wc(0); 3];
        for lap in 0..7u64 {
            assert!(cq.is_empty());
            assert_eq!(cq.len(), 0);
            for i in 0..3 {
                cq.push(wc(lap * 3 + i), false).unwrap();
                assert!(!cq.is_empty(), "lap {lap}, {} queued", i + 1);
            }
            assert_eq!(cq.len(), 3);
            assert_eq!(cq.poll(&mut out[..2]), 2);
            assert!(!cq.is_empty());
            assert_eq!(cq.poll(&mut out), 1);
            assert!(cq.is_empty(), "lap {lap} drained");
        }
    }

    struct Hook {
        cq: CompletionQueue,
        calls: AtomicUsize,
    }

    impl Progress for Hook {
        fn progress(&self, _armed: bool) -> bool {
            let n = self.calls.fetch_add(1, Ordering::Relaxed);
            if n == 0 {
                self.cq.push(wc(42), false).unwrap();
                true
            } else {
                false
            }
        }
    }

    /// A QP hook that records the claims on its socket; with a CQ, its
    /// receive takes a byte from the (non-blocking) socket and pushes a
    /// completion (`wr_id` 7) for it.
    struct ClaimHook {
        sock: std::os::unix::net::UnixStream,
        claimed: AtomicU64,
        cq: Option<CompletionQueue>,
    }

    impl Progress for ClaimHook {
        fn progress(&self, _armed: bool) -> bool {
            use std::io::Read;
            let Some(cq) = &self.cq else {
                return false;
            };
            let mut b = [0u8; 1];
            if (&self.sock).read(&mut b).is_ok_and(|n| n == 1) {
                cq.push(wc(7), false).unwrap();
                return true;
            }
            false
        }

        fn sleep_on(&self, until_ns: Option<u64>) -> Option<RawFd> {
            use std::os::fd::AsRawFd;
            self.claimed.store(until_ns.unwrap_or(0), Ordering::Relaxed);
            Some(self.sock.as_raw_fd())
        }

        fn renew_claim(&self, until_ns: u64) {
            self.claimed.store(until_ns, Ordering::Relaxed);
        }
    }

    /// A wait that runs out of time leaves its QPs' sockets claimed for
    /// `CLAIM_AFTER_TIMEOUT_NS` more (a caller waiting with a timeout in a
    /// loop is back by then), whether it spun first or slept at once. (The
    /// claim ended with the wait: an engine thread took the socket over whenever the caller
    /// waited for a CPU longer than the quiet period between two waits.)
    #[test]
    fn a_wait_that_times_out_keeps_its_sockets_claimed() {
        for spin in [Duration::ZERO, Duration::from_micros(50)] {
            let dev = Device::open_with(DeviceConfig {
                poll_spin: spin,
                poll_spin_adaptive: false,
                pin_threads: false,
                ..DeviceConfig::default()
            })
            .unwrap();
            let cq = CompletionQueue::new(&dev, 16, None).unwrap();
            let (sock, _peer) = std::os::unix::net::UnixStream::pair().unwrap();
            let hook = Arc::new(ClaimHook {
                sock,
                claimed: AtomicU64::new(0),
                cq: None,
            });
            let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
            cq.attach_progress(weak);
            let mut out = [wc(0); 4];
            let timeout = Duration::from_millis(3);
            let before = crate::datamover::now_ns();
            assert_eq!(cq.wait(&mut out, Some(timeout)), 0);
            let least = before + 3_000_000 + CLAIM_AFTER_TIMEOUT_NS;
            assert!(
                hook.claimed.load(Ordering::Relaxed) >= least,
                "spin {spin:?}: claimed until {} ns, at least {least} wanted",
                hook.claimed.load(Ordering::Relaxed)
            );
        }
    }

    /// A wait that slept on its QPs' sockets and returns what it received
    /// gives the sockets back (a poll no longer ends a claim: the claim of
    /// the sleep, up to `SLEEP_MAX` past its start, outlived the wait, and
    /// bytes for a caller that went on without waiting, a Write it spins
    /// for, were placed only once it ran out).
    #[test]
    fn a_wait_that_returns_what_woke_it_gives_its_sockets_back() {
        let dev = Device::open_with(DeviceConfig {
            poll_spin: Duration::ZERO,
            poll_spin_adaptive: false,
            pin_threads: false,
            ..DeviceConfig::default()
        })
        .unwrap();
        let cq = CompletionQueue::new(&dev, 16, None).unwrap();
        let (sock, mut peer) = std::os::unix::net::UnixStream::pair().unwrap();
        sock.set_nonblocking(true).unwrap();
        let hook = Arc::new(ClaimHook {
            sock,
            claimed: AtomicU64::new(0),
            cq: Some(cq.clone()),
        });
        let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
        cq.attach_progress(weak);
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            std::thread::sleep(Duration::from_millis(20));
            peer.write_all(&[1]).unwrap();
            peer
        });
        let mut out = [wc(0); 4];
        assert_eq!(cq.wait(&mut out, None), 1);
        assert_eq!(out[0].wr_id, 7);
        let _peer = writer.join().unwrap();
        assert_eq!(
            hook.claimed.load(Ordering::Relaxed),
            0,
            "the sockets stay claimed after the wait returned"
        );
    }

    /// A wait that sleeps at once looks only at the ring before sleeping on
    /// the sockets; with a zero timeout it never sleeps, and must still run
    /// the receive path once (it returned nothing before it did).
    #[test]
    fn a_zero_timeout_wait_that_sleeps_at_once_still_receives() {
        let cfg = crate::DeviceConfig {
            poll_spin: Duration::ZERO,
            ..crate::DeviceConfig::default()
        };
        let cq = CompletionQueue::new(&Device::open_with(cfg).unwrap(), 4, None).unwrap();
        let hook = Arc::new(Hook {
            cq: cq.clone(),
            calls: AtomicUsize::new(0),
        });
        let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
        cq.attach_progress(weak);
        let mut out = [wc(0); 4];
        assert_eq!(cq.wait(&mut out, Some(Duration::ZERO)), 1);
        assert_eq!(out[0].wr_id, 42);
        assert_eq!(cq.wait(&mut out, Some(Duration::ZERO)), 0);
    }

    #[test]
    fn progress_hook_runs_on_empty_poll() {
        let cq = CompletionQueue::new(&dev(), 4, None).unwrap();
        let hook = Arc::new(Hook {
            cq: cq.clone(),
            calls: AtomicUsize::new(0),
        });
        let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
        cq.attach_progress(weak.clone());
        assert_eq!(cq.poll_one().unwrap().wr_id, 42);
        assert_eq!(hook.calls.load(Ordering::Relaxed), 1);
        assert!(cq.poll_one().is_none());
        assert_eq!(hook.calls.load(Ordering::Relaxed), 2);
        cq.push(wc(1), false).unwrap();
        assert_eq!(cq.poll_one().unwrap().wr_id, 1);
        assert_eq!(
            hook.calls.load(Ordering::Relaxed),
            2,
            "not called when not empty"
        );
        cq.detach_progress(&weak);
        assert!(cq.poll_one().is_none());
        assert_eq!(hook.calls.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn progress_hook_off_without_poll_driven_receive() {
        let d = Device::open_with(DeviceConfig {
            poll_driven_receive: false,
            ..DeviceConfig::default()
        })
        .unwrap();
        let cq = CompletionQueue::new(&d, 4, None).unwrap();
        let hook = Arc::new(Hook {
            cq: cq.clone(),
            calls: AtomicUsize::new(0),
        });
        let arc: Arc<dyn Progress> = hook.clone();
        cq.attach_progress(Arc::downgrade(&arc));
        assert!(cq.poll_one().is_none());
        assert_eq!(hook.calls.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn dead_hooks_are_skipped() {
        let cq = CompletionQueue::new(&dev(), 4, None).unwrap();
        let arc: Arc<dyn Progress> = Arc::new(Hook {
            cq: cq.clone(),
            calls: AtomicUsize::new(0),
        });
        cq.attach_progress(Arc::downgrade(&arc));
        drop(arc);
        assert!(cq.poll_one().is_none());
    }

    fn readable(ch: &CompletionChannel) -> bool {
        crate::sys::fd::wait_readable(ch.fd(), Some(Duration::ZERO)).unwrap()
    }

    #[test]
    fn channel_fd_is_readable_while_an_event_is_pending() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let a = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        let b = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        assert!(!readable(&ch));
        a.req_notify(false).unwrap();
        b.req_notify(false).unwrap();
        b.push(wc(1), false).unwrap();
        a.push(wc(2), false).unwrap();
        assert!(readable(&ch));
        assert!(ch.try_get_event().unwrap().same_as(&b));
        assert!(readable(&ch));
        assert!(ch.get_event(Some(Duration::ZERO)).unwrap().same_as(&a));
        assert!(!readable(&ch));
        assert_eq!(a.unacked_events() + b.unacked_events(), 2);
    }

    #[test]
    fn get_event_times_out() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let _cq = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        let start = std::time::Instant::now();
        assert!(matches!(
            ch.get_event(Some(Duration::from_millis(30))),
            Err(GetEventError::TimedOut)
        ));
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn get_event_wakes_a_sleeping_consumer() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 8, Some(&ch)).unwrap();
        cq.req_notify(false).unwrap();
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10));
                cq.push(wc(5), false).unwrap();
            })
        };
        let got = ch.get_event(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(got.poll_one().unwrap().wr_id, 5);
        got.ack_events(1);
        producer.join().unwrap();
    }

    /// The usual event loop: arm, poll, sleep; no completion may be missed.
    #[test]
    fn arm_poll_wait_loop_misses_nothing() {
        const N: u64 = 20_000;
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 64, Some(&ch)).unwrap();
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for i in 0..N {
                    while cq.push(wc(i), false).is_err() {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        let mut out = [wc(0); 16];
        while next < N {
            let n = cq.poll(&mut out);
            for w in &out[..n] {
                assert_eq!(w.wr_id, next);
                next += 1;
            }
            if n == 0 {
                cq.req_notify(false).unwrap();
                let n = cq.poll(&mut out);
                for w in &out[..n] {
                    assert_eq!(w.wr_id, next);
                    next += 1;
                }
                if n == 0 {
                    let got = ch.get_event(Some(Duration::from_secs(10))).unwrap();
                    got.ack_events(1);
                }
            }
        }
        producer.join().unwrap();
    }

    #[test]
    fn many_producers_one_consumer_lose_nothing_and_keep_order() {
        const PRODUCERS: u32 = 8;
        const EACH: u64 = 20_000;
        let d = dev();
        let cq = CompletionQueue::new(&d, 256, None).unwrap();
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let cq = cq.clone();
                std::thread::spawn(move || {
                    for i in 0..EACH {
                        let w = WorkCompletion::success(i, WcOpcode::Send, p);
                        // A full CQ is an error for the data path; here the
                        // producers back off instead so that nothing is lost.
                        while cq.len() >= cq.capacity() || cq.push(w, false).is_err() {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = vec![0u64; PRODUCERS as usize];
        let mut total = 0;
        let mut out = [wc(0); 32];
        while total < u64::from(PRODUCERS) * EACH {
            let n = cq.poll(&mut out);
            for w in &out[..n] {
                let slot = &mut next[w.qp_num as usize];
                assert_eq!(w.wr_id, *slot, "per-producer order");
                *slot += 1;
            }
            total += n as u64;
        }
        for p in producers {
            p.join().unwrap();
        }
        assert!(next.iter().all(|&n| n == EACH));
    }

    #[test]
    fn resize_under_concurrent_pushes_keeps_order() {
        const N: u64 = 50_000;
        let d = dev();
        let cq = CompletionQueue::new(&d, 4096, None).unwrap();
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for i in 0..N {
                    while cq.push(wc(i), false).is_err() {
                        std::thread::yield_now();
                    }
                }
            })
        };
        let mut next = 0;
        let mut out = [wc(0); 8];
        let mut size = 4096;
        while next < N {
            let n = cq.poll(&mut out);
            for w in &out[..n] {
                assert_eq!(w.wr_id, next);
                next += 1;
            }
            if next % 1000 == 0 {
                size = if size == 4096 { 8192 } else { 4096 };
                let _ = cq.resize(size);
            }
        }
        producer.join().unwrap();
    }

    struct SelfDetaching {
        cq: CompletionQueue,
        me: parking_lot::Mutex<Option<Weak<dyn Progress>>>,
    }

    impl Progress for SelfDetaching {
        fn progress(&self, _armed: bool) -> bool {
            if let Some(me) = self.me.lock().take() {
                self.cq.detach_progress(&me);
                self.cq.push(wc(8), false).unwrap();
                return true;
            }
            false
        }
    }

    #[test]
    fn a_hook_may_detach_itself() {
        let cq = CompletionQueue::new(&dev(), 4, None).unwrap();
        let hook = Arc::new(SelfDetaching {
            cq: cq.clone(),
            me: parking_lot::Mutex::new(None),
        });
        let arc: Arc<dyn Progress> = hook.clone();
        let weak = Arc::downgrade(&arc);
        *hook.me.lock() = Some(weak.clone());
        cq.attach_progress(weak);
        assert_eq!(cq.poll_one().unwrap().wr_id, 8);
        assert!(cq.shared.progress.read().is_empty());
    }

    /// Runs `f` in a thread; fails (instead of hanging the test run) if
    /// it has not returned after a generous time: a lost wake-up.
    fn returns<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("{what}: lost wake-up (still asleep after 60 s)"))
    }

    /// Regression (waits without a timeout sleep with no timer, so a lost
    /// wake-up hangs): a completion pushed by another thread while the
    /// waiter goes to sleep, at every point of its way there, is seen.
    #[test]
    fn regression_a_push_while_the_waiter_goes_to_sleep_is_seen() {
        let cfg = crate::DeviceConfig {
            poll_spin: Duration::ZERO,
            poll_spin_adaptive: false,
            ..crate::DeviceConfig::default()
        };
        let cq = CompletionQueue::new(&Device::open_with(cfg).unwrap(), 4, None).unwrap();
        for i in 0..2000u64 {
            let waiter = {
                let cq = cq.clone();
                std::thread::spawn(move || {
                    let mut out = [wc(0); 4];
                    cq.wait(&mut out, None)
                })
            };
            // Now, or a moment later (while the waiter registers, looks,
            // or sleeps).
            for _ in 0..(i % 64) * 50 {
                std::hint::spin_loop();
            }
            cq.push(wc(i), false).unwrap();
            let n = returns("wait", move || waiter.join().unwrap());
            assert_eq!(n, 1);
        }
    }

    /// A burst of completions pushed while a waiter sleeps writes its
    /// wake-up descriptor once, which is readable after the push; with
    /// nobody asleep a push writes nothing.
    #[test]
    fn a_burst_of_completions_wakes_a_sleeper_once() {
        let cq = CompletionQueue::new(&dev(), 64, None).unwrap();
        let w = Arc::new(Waker::new().unwrap());
        let readable = |w: &Waker| {
            crate::sys::fd::wait_readable(std::os::fd::AsFd::as_fd(w), Some(Duration::ZERO))
                .unwrap()
        };
        cq.push(wc(0), false).unwrap();
        assert_eq!(w.writes(), 0, "nobody asleep: no write");
        cq.waiter_enter(&w);
        for i in 1..=20 {
            cq.push(wc(i), false).unwrap();
        }
        assert_eq!(w.writes(), 1, "one write for the burst");
        assert!(readable(&w));
        w.reset();
        assert!(!readable(&w));
        cq.push(wc(21), false).unwrap();
        assert_eq!(w.writes(), 2, "a push after the reset writes again");
        cq.waiter_leave(&w);
        w.reset();
        cq.push(wc(22), false).unwrap();
        assert_eq!(w.writes(), 2, "left: no write");
        assert!(!readable(&w));
        // An epoll wait set's sleep on the CQ's own descriptor: one write
        // for a burst too.
        cq.wait_set_enter().unwrap();
        for i in 23..=40 {
            cq.push(wc(i), false).unwrap();
        }
        let shared = cq.shared.wake.get().unwrap().as_ref().unwrap();
        assert_eq!(shared.writes(), 1, "one write for the burst");
        assert!(readable(shared));
        cq.wait_set_drain();
        assert!(!readable(shared));
        cq.wait_set_leave();
        cq.push(wc(41), false).unwrap();
        assert_eq!(shared.writes(), 1, "left: no write");
        assert_eq!(cq.len(), 42);
    }

    /// An armed CQ's burst of completions raises one event, and the
    /// channel's descriptor is readable after the push until the event is
    /// taken.
    #[test]
    fn an_armed_cq_burst_is_one_event_and_the_channel_fd_is_readable() {
        let d = dev();
        let ch = CompletionChannel::new(&d).unwrap();
        let cq = CompletionQueue::new(&d, 64, Some(&ch)).unwrap();
        let readable = || crate::sys::fd::wait_readable(ch.fd(), Some(Duration::ZERO)).unwrap();
        cq.req_notify(false).unwrap();
        assert!(!readable());
        for i in 0..10 {
            cq.push(wc(i), false).unwrap();
            assert!(readable(), "readable after push {i}");
        }
        assert!(ch.try_get_event().unwrap().same_as(&cq));
        assert!(ch.try_get_event().is_none(), "one event for the burst");
        assert!(!readable());
        cq.ack_events(1);
    }
}
