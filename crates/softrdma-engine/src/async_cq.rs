//! Async completions for tokio (feature `tokio`): a [`Stream`] of
//! completions per CQ and work requests you can `.await`.
//!
//! ```text
//!   data path ──push──▶ CQ ring ──(armed)──▶ CompletionChannel fd
//!                                                  │ readable (AsyncFd)
//!                                                  ▼
//!                              driver task (one per AsyncChannel)
//!                 try_get_event + ack_events, poll the CQ dry, re-arm, poll again
//!                       │ wr_id of an awaited operation     │ any other wr_id
//!                       ▼                                    ▼
//!                   that operation's future             the CQ's CompletionStream
//! ```
//!
//! An [`AsyncChannel`] wraps a [`CompletionChannel`] in a
//! [`tokio::io::unix::AsyncFd`] and runs one small driver task on the
//! current tokio runtime. Each [`AsyncCq`] is a [`CompletionQueue`] whose
//! completions that driver takes: the driver is the CQ's only poller (do not
//! poll the CQ yourself, and do not arm it: the driver keeps it armed). It
//! follows the verbs rule for sleeping on a CQ: poll until empty, arm
//! ([`CompletionQueue::req_notify`]), poll again, then sleep until the
//! channel's descriptor is readable. Events are taken with
//! [`CompletionChannel::try_get_event`] and acknowledged at once.
//!
//! Every completion goes to exactly one place: the future of the operation
//! that posted it (see [`AsyncQp`]) or, for work posted any other way, the
//! CQ's [`CompletionStream`] (all streams of one CQ share one queue, in CQ
//! order).
//!
//! ## The safety poll
//!
//! A wake-up can be lost outside the adapter's control (an event taken from
//! the channel by someone else, a CQ whose channel is not the one the driver
//! watches, a device polled for receive progress). So the driver also polls
//! every CQ it serves every [`safety_interval`](AsyncChannel::with_safety_interval)
//! (default [`DEFAULT_SAFETY_INTERVAL`]): a lost event delays completions by
//! at most that long, it never loses them.
//!
//! ## Awaited operations own their buffers
//!
//! [`AsyncQp`]'s helpers take the buffer by value: anything that borrows as a
//! [`MemoryRegion`] (`MemoryRegion`, `Arc<MemoryRegion>`, ...). The work
//! request is posted when the helper is called (not when the future is first
//! polled) and the returned [`Op`] future resolves to its completion, handing
//! the buffer back in [`Completed`] (or in the error).
//!
//! **Cancellation.** Dropping an [`Op`] before it resolves does not cancel
//! the work request: RDMA has no way to recall posted work, so it goes on and
//! completes (successfully, with an error, or flushed if the QP goes to
//! ERROR or is destroyed). Until then the buffer stays owned by the adapter
//! (in the CQ's table of operations), so the region stays registered, keeps
//! its keys and its memory is neither freed nor reused: a peer's Write into
//! it or a Read from it still succeeds. When the completion arrives the
//! driver takes it out of the CQ, discards it (it does not appear on the
//! stream) and drops the buffer (a `MemoryRegion` is deregistered then; an
//! `Arc<MemoryRegion>` just loses one reference). Completions after it are
//! delivered as usual. If the tokio runtime shuts down (or every handle of
//! the CQ is dropped and the driver stops) before that completion arrives,
//! the buffer is dropped with the driver's state; the engine still holds
//! the memory of posted work until the work completes, so no memory is
//! freed under the data path, but a deregistered region no longer answers
//! to its keys.

use std::any::Any;
use std::borrow::Borrow;
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use futures_core::Stream;
use parking_lot::Mutex;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;

use crate::cq::{CompletionChannel, CompletionQueue, CreateCqError, NotifyError};
use crate::device::Device;
use crate::mr::{MemoryRegion, RangeError};
use crate::pd::ProtectionDomain;
use crate::qp::{CreateQpError, PostRecvError, PostSendError, QpInitAttr, QueuePair};
use crate::sys::async_fd::WithFd;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{RecvWr, SendOp, SendWr};

/// How often, by default, the driver polls every CQ it serves even without
/// an event (see the module documentation).
pub const DEFAULT_SAFETY_INTERVAL: Duration = Duration::from_millis(100);

/// `wr_id`s with this bit set are the adapter's own (awaited operations).
/// Work posted to a served CQ's QPs by other means should leave it clear;
/// a completion with the bit set that belongs to no awaited operation goes
/// to the stream like any other.
pub const ASYNC_WR_ID_BIT: u64 = 1 << 63;

/// Identifiers of awaited operations (below [`ASYNC_WR_ID_BIT`]).
static NEXT_OP: AtomicU64 = AtomicU64::new(1);

/// Completions taken from a CQ per poll call.
const POLL_BATCH: usize = 32;

/// Why an [`AsyncChannel`] or [`AsyncCq`] could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AsyncCqError {
    /// Not called from within a tokio runtime.
    #[error("no tokio runtime: call from within a runtime (with IO and time enabled)")]
    NoRuntime,
    /// Registering the channel's descriptor with the runtime failed, or the
    /// channel could not be created.
    #[error("completion channel: {0}")]
    Io(#[from] io::Error),
    /// The CQ could not be created.
    #[error(transparent)]
    CreateCq(#[from] CreateCqError),
    /// The CQ has no completion channel (it cannot be armed).
    #[error(transparent)]
    Notify(#[from] NotifyError),
    /// The CQ is already served by an adapter.
    #[error("CQ {0} is already served by an async adapter")]
    AlreadyServed(u32),
    /// The CQ has a completion callback: its events run the callback, and
    /// the callback polls it.
    #[error("CQ {0} has a completion callback; it cannot also be served asynchronously")]
    HasCallback(u32),
    /// The CQ is exclusive ([`CqBuilder::exclusive`](crate::cq::CqBuilder::exclusive)):
    /// its one consumer polls it, and `QueuePair::post_send_now` relies on
    /// that; the adapter's driver would be a second one.
    #[error("CQ {0} is exclusive; it cannot be served asynchronously")]
    Exclusive(u32),
}

/// Why posting an awaited operation failed (nothing was posted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The buffer range is outside the region.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// The send queue refused the request.
    #[error(transparent)]
    Send(#[from] PostSendError),
    /// The receive queue refused the request.
    #[error(transparent)]
    Recv(#[from] PostRecvError),
}

/// An awaited operation completed successfully: its completion and its
/// buffer, handed back.
#[derive(Debug)]
pub struct Completed<B> {
    /// The completion (status [`WcStatus::Success`]; `wr_id` is the
    /// adapter's own).
    pub wc: WorkCompletion,
    /// The buffer the operation owned.
    pub buf: B,
}

/// An awaited operation failed. Every variant hands the buffer back.
#[non_exhaustive]
pub enum OpError<B> {
    /// The work request was not posted.
    Post {
        /// Why.
        error: PostError,
        /// The buffer.
        buf: B,
    },
    /// The work request completed with an error status (including
    /// [`WcStatus::WrFlush`] when the QP went to ERROR).
    Completion {
        /// The error completion.
        wc: WorkCompletion,
        /// The buffer.
        buf: B,
    },
    /// The adapter's driver stopped (the tokio runtime is shutting down or
    /// waiting on the channel failed) before the completion arrived. The
    /// work may still be in flight.
    Closed {
        /// The buffer.
        buf: B,
    },
}

impl<B> OpError<B> {
    /// The buffer, handed back.
    pub fn into_buf(self) -> B {
        match self {
            OpError::Post { buf, .. }
            | OpError::Completion { buf, .. }
            | OpError::Closed { buf } => buf,
        }
    }

    /// The error completion, if the request completed with an error.
    pub fn completion(&self) -> Option<&WorkCompletion> {
        match self {
            OpError::Completion { wc, .. } => Some(wc),
            _ => None,
        }
    }
}

impl<B> fmt::Debug for OpError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Post { error, .. } => f.debug_struct("Post").field("error", error).finish(),
            OpError::Completion { wc, .. } => f.debug_struct("Completion").field("wc", wc).finish(),
            OpError::Closed { .. } => f.write_str("Closed"),
        }
    }
}

impl<B> fmt::Display for OpError<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Post { error, .. } => write!(f, "posting failed: {error}"),
            OpError::Completion { wc, .. } => write!(
                f,
                "{:?} completed with status {:?} (vendor error {:#x})",
                wc.opcode, wc.status, wc.vendor_err
            ),
            OpError::Closed { .. } => {
                f.write_str("the async completion driver stopped before the completion")
            }
        }
    }
}

impl<B> std::error::Error for OpError<B> {}

// ---------------------------------------------------------------------------
// Shared state

/// An awaited operation in a CQ's table.
struct OpSlot {
    /// The buffer, owned here until the operation completes.
    buf: Option<Box<dyn Any + Send>>,
    /// The completion, once routed.
    wc: Option<WorkCompletion>,
    /// The future to wake.
    waker: Option<Waker>,
    /// The future was dropped: discard the completion, drop the buffer.
    orphaned: bool,
}

/// What the driver and the futures of one CQ share.
#[derive(Default)]
struct CqTable {
    ops: HashMap<u64, OpSlot>,
    /// Completions for the stream.
    queue: VecDeque<WorkCompletion>,
    stream_wakers: Vec<Waker>,
    /// Orphaned operations whose completion arrived (for tests and stats).
    orphans_reaped: u64,
}

struct CqState {
    cq: CompletionQueue,
    table: Mutex<CqTable>,
    /// Handles ([`AsyncCq`], [`Op`], [`CompletionStream`]) alive.
    handles: AtomicUsize,
}

struct ChanShared {
    channel: CompletionChannel,
    cqs: Mutex<HashMap<u32, Arc<CqState>>>,
    /// Wakes the driver: a CQ was added or a handle dropped.
    notify: Notify,
    /// [`AsyncChannel`] handles alive.
    handles: AtomicUsize,
    /// Set when the driver has stopped.
    closed: AtomicBool,
    safety_interval: Duration,
    /// Safety polls that found completions (a wake-up had been missed).
    recovered: AtomicU64,
}

impl ChanShared {
    fn wake_all_closed(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let cqs: Vec<_> = self.cqs.lock().values().cloned().collect();
        for state in cqs {
            let wakers = {
                let mut t = state.table.lock();
                let mut w: Vec<Waker> = t.stream_wakers.drain(..).collect();
                w.extend(t.ops.values_mut().filter_map(|s| s.waker.take()));
                w
            };
            wakers.into_iter().for_each(Waker::wake);
        }
    }
}

// ---------------------------------------------------------------------------
// AsyncChannel

/// A [`CompletionChannel`] watched by the tokio runtime; serves any number of
/// [`AsyncCq`]s. A cheap, clonable handle.
///
/// Creating one spawns its driver task on the current runtime (which needs
/// IO and time enabled, e.g. `#[tokio::main]` or
/// `Builder::new_multi_thread().enable_all()`). The driver stops when every
/// handle of the channel and of its CQs is gone and no awaited operation is
/// in flight, or when the runtime shuts down (see
/// [`is_closed`](Self::is_closed) for when that is visible).
pub struct AsyncChannel {
    shared: Arc<ChanShared>,
}

impl fmt::Debug for AsyncChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncChannel")
            .field("channel", &self.shared.channel)
            .field("cqs", &self.shared.cqs.lock().len())
            .field("safety_interval", &self.shared.safety_interval)
            .field("closed", &self.shared.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Clone for AsyncChannel {
    fn clone(&self) -> Self {
        self.shared.handles.fetch_add(1, Ordering::SeqCst);
        AsyncChannel {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl Drop for AsyncChannel {
    fn drop(&mut self) {
        self.shared.handles.fetch_sub(1, Ordering::SeqCst);
        self.shared.notify.notify_one();
    }
}

impl AsyncChannel {
    /// Watches `channel` with the default safety interval. Events of CQs
    /// the adapter does not serve are acknowledged and dropped, so give the
    /// adapter a channel of its own.
    ///
    /// # Errors
    ///
    /// [`AsyncCqError::NoRuntime`] outside a tokio runtime,
    /// [`AsyncCqError::Io`] if the runtime cannot watch the descriptor.
    pub fn new(channel: CompletionChannel) -> Result<AsyncChannel, AsyncCqError> {
        Self::with_safety_interval(channel, DEFAULT_SAFETY_INTERVAL)
    }

    /// Like [`new`](Self::new), polling every served CQ every `interval`
    /// even without an event (at least 1 ms).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_safety_interval(
        channel: CompletionChannel,
        interval: Duration,
    ) -> Result<AsyncChannel, AsyncCqError> {
        let rt = tokio::runtime::Handle::try_current().map_err(|_| AsyncCqError::NoRuntime)?;
        let afd = {
            let _enter = rt.enter();
            // Registration is the one unsafe step; it lives in `sys`.
            crate::sys::async_fd::register(channel.clone(), channel.event_fd())?
        };
        let shared = Arc::new(ChanShared {
            channel,
            cqs: Mutex::new(HashMap::new()),
            notify: Notify::new(),
            handles: AtomicUsize::new(1),
            closed: AtomicBool::new(false),
            safety_interval: interval.max(Duration::from_millis(1)),
            recovered: AtomicU64::new(0),
        });
        rt.spawn(drive(CloseOnDrop(Arc::clone(&shared)), afd));
        Ok(AsyncChannel { shared })
    }

    /// A new channel on `device`, watched (see [`new`](Self::new)).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new), and [`AsyncCqError::Io`] if the channel
    /// cannot be created.
    pub fn create(device: &Device) -> Result<AsyncChannel, AsyncCqError> {
        Self::new(CompletionChannel::new(device)?)
    }

    /// The underlying channel (to create CQs on it; see
    /// [`AsyncCq::on_channel`]).
    pub fn channel(&self) -> &CompletionChannel {
        &self.shared.channel
    }

    /// The safety-poll interval.
    pub fn safety_interval(&self) -> Duration {
        self.shared.safety_interval
    }

    /// How many safety polls found completions no event had announced (yet):
    /// wake-ups that were lost, or late, and that the safety poll recovered.
    pub fn recovered_by_safety_poll(&self) -> u64 {
        self.shared.recovered.load(Ordering::Relaxed)
    }

    /// Whether the driver has stopped (runtime shut down or the channel's
    /// descriptor failed).
    ///
    /// Once the runtime that ran the driver has shut down (its `drop` has
    /// returned, or a `shutdown_timeout` that did not time out), this is
    /// `true`, also if the driver never got to run, and every waiting
    /// [`Op`] and stream has been woken: they resolve as
    /// [`OpError::Closed`] and `None`. `Runtime::shutdown_background` (and
    /// a `shutdown_timeout` that timed out) returns without waiting for the
    /// runtime's threads: the channel closes when they drop the driver.
    pub fn is_closed(&self) -> bool {
        self.shared.closed.load(Ordering::SeqCst)
    }
}

/// Routes the completions of one CQ; polls it dry, arms it, polls again.
/// Returns how many completions were taken.
fn serve(state: &CqState) -> usize {
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); POLL_BATCH];
    let mut total = 0;
    let mut armed = false;
    loop {
        let n = state.cq.poll(&mut buf);
        if n > 0 {
            total += n;
            route(state, &buf[..n]);
        }
        if n < buf.len() {
            if armed {
                return total;
            }
            // The verbs rule: arm, then look once more (completions queued
            // before the arm raise no event). Cannot fail: checked when the
            // CQ was added.
            let _ = state.cq.req_notify(false);
            armed = true;
        }
    }
}

fn route(state: &CqState, wcs: &[WorkCompletion]) {
    let mut wakers = Vec::new();
    let mut dropped: Vec<Box<dyn Any + Send>> = Vec::new();
    {
        let mut t = state.table.lock();
        let mut to_stream = false;
        for wc in wcs {
            match t.ops.get_mut(&wc.wr_id) {
                Some(slot) if slot.orphaned => {
                    if let Some(slot) = t.ops.remove(&wc.wr_id) {
                        dropped.extend(slot.buf);
                    }
                    t.orphans_reaped += 1;
                }
                Some(slot) => {
                    slot.wc = Some(*wc);
                    wakers.extend(slot.waker.take());
                }
                None => {
                    t.queue.push_back(*wc);
                    to_stream = true;
                }
            }
        }
        if to_stream {
            wakers.append(&mut t.stream_wakers);
        }
    }
    // Buffers (and their deregistration) and wake-ups outside the lock.
    drop(dropped);
    wakers.into_iter().for_each(Waker::wake);
}

/// Whether the driver may stop: nobody can ask for anything any more.
fn finished(shared: &ChanShared) -> bool {
    if shared.handles.load(Ordering::SeqCst) > 0 {
        return false;
    }
    let mut cqs = shared.cqs.lock();
    cqs.retain(|_, s| s.handles.load(Ordering::SeqCst) > 0 || !s.table.lock().ops.is_empty());
    cqs.is_empty()
}

/// Marks the channel closed and wakes every waiter when the driver ends,
/// also when its task is dropped (the runtime shuts down).
///
/// Made before the task is spawned and passed to [`drive`] as an argument:
/// an async fn's arguments are part of its future from the start, so the
/// guard goes with the task even if the runtime drops it before its first
/// poll. (A guard made inside the body exists only once the body has run,
/// and a task dropped unpolled would leave the channel open for good.)
struct CloseOnDrop(Arc<ChanShared>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.wake_all_closed();
    }
}

fn serve_all(shared: &ChanShared) -> usize {
    let all: Vec<Arc<CqState>> = shared.cqs.lock().values().cloned().collect();
    all.iter().map(|state| serve(state)).sum()
}

/// The driver task of one channel.
async fn drive(close: CloseOnDrop, afd: AsyncFd<WithFd<CompletionChannel>>) {
    let shared: &ChanShared = &close.0;
    let mut tick = tokio::time::interval(shared.safety_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first round (and one after each notification: a CQ added, a
    // handle dropped) serves every CQ: a new CQ gets armed.
    let mut serve_everything = true;
    loop {
        if serve_everything {
            serve_all(shared);
            serve_everything = false;
        }
        if finished(shared) {
            break;
        }
        tokio::select! {
            ready = afd.readable() => {
                let Ok(mut guard) = ready else { break };
                let mut events: Vec<Arc<CqState>> = Vec::new();
                while let Some(cq) = afd.get_ref().get().try_get_event() {
                    cq.ack_events(1);
                    if let Some(state) = shared.cqs.lock().get(&cq.id())
                        && !events.iter().any(|s| Arc::ptr_eq(s, state))
                    {
                        events.push(Arc::clone(state));
                    }
                }
                // The queue is empty, so the eventfd is drained: clear the
                // readiness (a later push is a new edge and is not lost).
                guard.clear_ready();
                for state in &events {
                    serve(state);
                }
            }
            _ = tick.tick() => {
                if serve_all(shared) > 0 {
                    shared.recovered.fetch_add(1, Ordering::Relaxed);
                }
            }
            () = shared.notify.notified() => serve_everything = true,
        }
    }
}

// ---------------------------------------------------------------------------
// AsyncCq

/// A completion queue served by an [`AsyncChannel`]'s driver: a
/// [`Stream`] of its completions ([`completions`](Self::completions)) and
/// the CQ of [`AsyncQp`]s. A cheap, clonable handle.
pub struct AsyncCq {
    state: Arc<CqState>,
    chan: AsyncChannel,
}

impl fmt::Debug for AsyncCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.state.table.lock();
        f.debug_struct("AsyncCq")
            .field("cq", &self.state.cq)
            .field("in_flight", &t.ops.len())
            .field("queued", &t.queue.len())
            .finish_non_exhaustive()
    }
}

impl Clone for AsyncCq {
    fn clone(&self) -> Self {
        self.state.handles.fetch_add(1, Ordering::SeqCst);
        AsyncCq {
            state: Arc::clone(&self.state),
            chan: self.chan.clone(),
        }
    }
}

impl Drop for AsyncCq {
    fn drop(&mut self) {
        self.state.handles.fetch_sub(1, Ordering::SeqCst);
        self.chan.shared.notify.notify_one();
    }
}

impl AsyncCq {
    /// A new CQ of `cqe` entries with a channel and a driver of its own.
    ///
    /// # Errors
    ///
    /// See [`AsyncCqError`].
    pub fn new(device: &Device, cqe: usize) -> Result<AsyncCq, AsyncCqError> {
        let chan = AsyncChannel::create(device)?;
        Self::on_channel(device, &chan, cqe)
    }

    /// A new CQ of `cqe` entries on `device` whose events go to `channel`
    /// (which must belong to `device`).
    ///
    /// # Errors
    ///
    /// See [`AsyncCqError`].
    pub fn on_channel(
        device: &Device,
        channel: &AsyncChannel,
        cqe: usize,
    ) -> Result<AsyncCq, AsyncCqError> {
        let cq = CompletionQueue::new(device, cqe, Some(channel.channel()))?;
        Self::serve(channel, cq)
    }

    /// Serves an existing CQ. Its completion channel should be
    /// `channel`'s: otherwise no event reaches the driver and completions
    /// are found by the safety poll only. The adapter becomes the CQ's only
    /// poller.
    ///
    /// # Errors
    ///
    /// [`AsyncCqError::Notify`] if the CQ has no completion channel,
    /// [`AsyncCqError::HasCallback`] if it has a completion callback,
    /// [`AsyncCqError::AlreadyServed`] if an adapter on this channel already
    /// serves it, [`AsyncCqError::Exclusive`] if it is exclusive.
    pub fn serve(channel: &AsyncChannel, cq: CompletionQueue) -> Result<AsyncCq, AsyncCqError> {
        if cq.has_callback() {
            return Err(AsyncCqError::HasCallback(cq.id()));
        }
        if cq.is_exclusive() {
            return Err(AsyncCqError::Exclusive(cq.id()));
        }
        // Arming checks that the CQ has a channel; the driver re-arms.
        cq.req_notify(false)?;
        let state = Arc::new(CqState {
            cq,
            table: Mutex::new(CqTable::default()),
            handles: AtomicUsize::new(1),
        });
        {
            let mut cqs = channel.shared.cqs.lock();
            let id = state.cq.id();
            if cqs.contains_key(&id) {
                return Err(AsyncCqError::AlreadyServed(id));
            }
            cqs.insert(id, Arc::clone(&state));
        }
        channel.shared.notify.notify_one();
        Ok(AsyncCq {
            state,
            chan: channel.clone(),
        })
    }

    /// The CQ (to create QPs on; do not poll or arm it).
    pub fn cq(&self) -> &CompletionQueue {
        &self.state.cq
    }

    /// The channel serving this CQ.
    pub fn channel(&self) -> &AsyncChannel {
        &self.chan
    }

    /// A stream of the CQ's completions that belong to no awaited
    /// operation, in CQ order. Streams of one CQ share one queue: each
    /// completion goes to one of them. The stream ends only if the driver
    /// stops.
    pub fn completions(&self) -> CompletionStream {
        CompletionStream { cq: self.clone() }
    }

    /// The next completion of the stream queue (see
    /// [`completions`](Self::completions)); `None` if the driver stopped.
    pub async fn next_completion(&self) -> Option<WorkCompletion> {
        std::future::poll_fn(|cx| self.poll_completion(cx)).await
    }

    /// Polls for the next completion of the stream queue.
    pub fn poll_completion(&self, cx: &mut Context<'_>) -> Poll<Option<WorkCompletion>> {
        let mut t = self.state.table.lock();
        if let Some(wc) = t.queue.pop_front() {
            return Poll::Ready(Some(wc));
        }
        if self.chan.is_closed() {
            return Poll::Ready(None);
        }
        if !t.stream_wakers.iter().any(|w| w.will_wake(cx.waker())) {
            t.stream_wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }

    /// Awaited operations posted on this CQ's QPs and not yet reaped
    /// (including those whose future was dropped).
    pub fn in_flight(&self) -> usize {
        self.state.table.lock().ops.len()
    }

    /// Operations whose future was dropped and whose completion has since
    /// arrived and been discarded.
    pub fn orphans_reaped(&self) -> u64 {
        self.state.table.lock().orphans_reaped
    }

    /// Registers an awaited operation before its request is posted.
    fn register(&self, buf: Box<dyn Any + Send>) -> u64 {
        let wr_id = ASYNC_WR_ID_BIT | NEXT_OP.fetch_add(1, Ordering::Relaxed);
        self.state.table.lock().ops.insert(
            wr_id,
            OpSlot {
                buf: Some(buf),
                wc: None,
                waker: None,
                orphaned: false,
            },
        );
        wr_id
    }

    /// Takes the buffer back of an operation that was not posted.
    fn unregister(&self, wr_id: u64) -> Option<Box<dyn Any + Send>> {
        self.state.table.lock().ops.remove(&wr_id)?.buf
    }
}

/// A [`Stream`] of one CQ's completions (see [`AsyncCq::completions`]).
#[derive(Debug)]
pub struct CompletionStream {
    cq: AsyncCq,
}

impl CompletionStream {
    /// The next completion; `None` if the driver stopped.
    pub async fn next(&mut self) -> Option<WorkCompletion> {
        self.cq.next_completion().await
    }
}

impl Stream for CompletionStream {
    type Item = WorkCompletion;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<WorkCompletion>> {
        self.cq.poll_completion(cx)
    }
}

// ---------------------------------------------------------------------------
// Awaited operations

/// A posted work request, resolving to its completion (see [`AsyncQp`]).
///
/// The request was posted when the `Op` was created. Dropping the `Op`
/// before it resolves does not cancel the request; the buffer stays owned by
/// the adapter until the request completes, and is dropped then (see the
/// module documentation, "Cancellation").
#[must_use = "the request is posted already; dropping the future only stops waiting for it"]
pub struct Op<B> {
    /// The CQ the completion goes to; `None` once resolved.
    cq: Option<AsyncCq>,
    wr_id: u64,
    /// Posting failed: the result, ready.
    failed: Option<OpError<B>>,
    _buf: PhantomData<fn() -> B>,
}

// The buffer is never pinned: it lives in the CQ's table or moves out whole.
impl<B> Unpin for Op<B> {}

impl<B> fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Op")
            .field("wr_id", &self.wr_id)
            .field("resolved", &self.cq.is_none())
            .field("failed", &self.failed)
            .finish()
    }
}

impl<B> Op<B> {
    /// The `wr_id` the request was posted with (the adapter's own, with
    /// [`ASYNC_WR_ID_BIT`] set); 0 if posting failed.
    pub fn wr_id(&self) -> u64 {
        self.wr_id
    }
}

fn take_buf<B: 'static>(buf: Option<Box<dyn Any + Send>>) -> B {
    match buf.map(|b| b.downcast::<B>()) {
        Some(Ok(b)) => *b,
        // The slot was filled with a `B` by the `Op<B>` that owns it, and
        // only that `Op` takes it out.
        _ => unreachable!("an awaited operation's buffer is taken once, as its own type"),
    }
}

impl<B: Send + 'static> Future for Op<B> {
    type Output = Result<Completed<B>, OpError<B>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if let Some(err) = this.failed.take() {
            return Poll::Ready(Err(err));
        }
        let Some(cq) = this.cq.as_ref() else {
            panic!("softrdma Op polled after it resolved");
        };
        let mut t = cq.state.table.lock();
        let done = match t.ops.get_mut(&this.wr_id) {
            Some(slot) if slot.wc.is_some() => true,
            Some(_) if cq.chan.is_closed() => true,
            Some(slot) => {
                if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    slot.waker = Some(cx.waker().clone());
                }
                false
            }
            None => unreachable!("an awaited operation's slot is removed only by its Op"),
        };
        if !done {
            return Poll::Pending;
        }
        let slot = t.ops.remove(&this.wr_id);
        drop(t);
        this.cq = None;
        let (wc, buf) = match slot {
            Some(slot) => (slot.wc, take_buf::<B>(slot.buf)),
            None => unreachable!("checked above"),
        };
        Poll::Ready(match wc {
            Some(wc) if wc.status == WcStatus::Success => Ok(Completed { wc, buf }),
            Some(wc) => Err(OpError::Completion { wc, buf }),
            None => Err(OpError::Closed { buf }),
        })
    }
}

impl<B> Drop for Op<B> {
    fn drop(&mut self) {
        let Some(cq) = self.cq.take() else {
            return;
        };
        let mut t = cq.state.table.lock();
        let reap = match t.ops.get_mut(&self.wr_id) {
            // Completed, not collected: the buffer goes now.
            Some(slot) if slot.wc.is_some() => true,
            // In flight: the driver drops the buffer when it completes.
            Some(slot) => {
                slot.orphaned = true;
                slot.waker = None;
                false
            }
            None => false,
        };
        let slot = if reap {
            t.ops.remove(&self.wr_id)
        } else {
            None
        };
        drop(t);
        drop(slot);
    }
}

/// A queue pair whose send and receive completions go to [`AsyncCq`]s, with
/// helpers that post a signaled work request and return an [`Op`] future of
/// its completion.
///
/// Each helper takes the buffer by value (a [`MemoryRegion`], an
/// `Arc<MemoryRegion>`, or anything else that borrows as one) with the byte
/// range the request uses, posts at once, and hands the buffer back when the
/// request completes. Work may also be posted directly on
/// [`qp`](Self::qp); its completions go to the CQs' streams.
///
/// ```no_run
/// # async fn demo(qp: softrdma_engine::async_cq::AsyncQp, mr: softrdma_engine::MemoryRegion)
/// # -> Result<(), Box<dyn std::error::Error>> {
/// let done = qp.send(mr, 0, 11).await?; // the Send's completion
/// let mr = done.buf; // the region, handed back
/// # let _ = mr; Ok(()) }
/// ```
pub struct AsyncQp {
    qp: QueuePair,
    send_cq: AsyncCq,
    recv_cq: AsyncCq,
}

impl fmt::Debug for AsyncQp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncQp")
            .field("qp", &self.qp)
            .field("send_cq", &self.send_cq.cq().id())
            .field("recv_cq", &self.recv_cq.cq().id())
            .finish()
    }
}

impl AsyncQp {
    /// Creates a QP with `attr`, its send and receive CQs replaced by
    /// `send_cq`'s and `recv_cq`'s (which may be the same).
    ///
    /// # Errors
    ///
    /// Those of [`QueuePair::new`].
    pub fn new(
        pd: &ProtectionDomain,
        attr: &QpInitAttr,
        send_cq: &AsyncCq,
        recv_cq: &AsyncCq,
    ) -> Result<AsyncQp, CreateQpError> {
        let mut attr = attr.clone();
        attr.send_cq = send_cq.cq().clone();
        attr.recv_cq = recv_cq.cq().clone();
        Ok(AsyncQp {
            qp: QueuePair::new(pd, &attr)?,
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
        })
    }

    /// The queue pair (to connect it, query it, or post other work).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The CQ of send-queue completions.
    pub fn send_cq(&self) -> &AsyncCq {
        &self.send_cq
    }

    /// The CQ of receive completions.
    pub fn recv_cq(&self) -> &AsyncCq {
        &self.recv_cq
    }

    /// Posts a signaled send-queue request `op` whose single SGE is `len`
    /// bytes at `offset` of `buf` (source of Send and Write, sink of Read
    /// and atomics); resolves to its completion.
    pub fn post_send<B>(&self, op: SendOp<'_>, buf: B, offset: usize, len: u32) -> Op<B>
    where
        B: Borrow<MemoryRegion> + Send + 'static,
    {
        let sge = match buf.borrow().sge(offset, len) {
            Ok(sge) => sge,
            Err(e) => return failed(e.into(), buf),
        };
        let cq = &self.send_cq;
        let wr_id = cq.register(Box::new(buf));
        let sges = [sge];
        let wr = SendWr::new(wr_id, op).sg_list(&sges).signaled();
        match self.qp.post_send(&wr) {
            Ok(()) => posted(cq, wr_id),
            Err(e) => failed(e.into(), take_buf(cq.unregister(wr_id))),
        }
    }

    /// Sends `len` bytes at `offset` of `buf` to the peer's next receive.
    pub fn send<B>(&self, buf: B, offset: usize, len: u32) -> Op<B>
    where
        B: Borrow<MemoryRegion> + Send + 'static,
    {
        self.post_send(SendOp::Send, buf, offset, len)
    }

    /// RDMA Write of `len` bytes at `offset` of `buf` to the peer's
    /// `remote_addr` under `rkey`.
    pub fn write<B>(&self, buf: B, offset: usize, len: u32, remote_addr: u64, rkey: u32) -> Op<B>
    where
        B: Borrow<MemoryRegion> + Send + 'static,
    {
        self.post_send(SendOp::Write { remote_addr, rkey }, buf, offset, len)
    }

    /// RDMA Read of `len` bytes from the peer's `remote_addr` under `rkey`
    /// into `buf` at `offset`.
    pub fn read<B>(&self, buf: B, offset: usize, len: u32, remote_addr: u64, rkey: u32) -> Op<B>
    where
        B: Borrow<MemoryRegion> + Send + 'static,
    {
        self.post_send(SendOp::Read { remote_addr, rkey }, buf, offset, len)
    }

    /// Posts a receive of up to `len` bytes into `buf` at `offset`; resolves
    /// when a Send has been received into it (`wc.byte_len` bytes).
    pub fn recv<B>(&self, buf: B, offset: usize, len: u32) -> Op<B>
    where
        B: Borrow<MemoryRegion> + Send + 'static,
    {
        let sge = match buf.borrow().sge(offset, len) {
            Ok(sge) => sge,
            Err(e) => return failed(e.into(), buf),
        };
        let cq = &self.recv_cq;
        let wr_id = cq.register(Box::new(buf));
        let sges = [sge];
        match self.qp.post_recv(&RecvWr::new(wr_id, &sges)) {
            Ok(()) => posted(cq, wr_id),
            Err(e) => failed(e.into(), take_buf(cq.unregister(wr_id))),
        }
    }
}

fn posted<B>(cq: &AsyncCq, wr_id: u64) -> Op<B> {
    Op {
        cq: Some(cq.clone()),
        wr_id,
        failed: None,
        _buf: PhantomData,
    }
}

fn failed<B>(error: PostError, buf: B) -> Op<B> {
    Op {
        cq: None,
        wr_id: 0,
        failed: Some(OpError::Post { error, buf }),
        _buf: PhantomData,
    }
}
