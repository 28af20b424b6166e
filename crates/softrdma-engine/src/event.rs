//! Asynchronous events of a device, like `ibv_get_async_event`.
//!
//! Errors that do not belong to one work request — a QP that went to ERROR
//! because its peer sent a Terminate, a completion queue that overflowed, a
//! shared receive queue that fell below its limit — are reported as an
//! [`AsyncEvent`] on the device's event queue. The queue has a file
//! descriptor that is readable while an event is pending, so it can sit in
//! an application's `poll(2)` / `epoll(7)` loop.
//!
//! ```text
//!   data path ──push──▶ [ AsyncEvent, AsyncEvent, … ] ──get / try_get──▶ application
//!                              │
//!                              └─ eventfd: readable while not empty
//! ```
//!
//! Unlike ibverbs there is nothing to acknowledge: an event is a plain value
//! and resources may be destroyed while events naming them are queued.

use std::collections::VecDeque;
use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use crate::sys::clock;

use parking_lot::Mutex;
use softrdma_wire::errcode::TermCode;

use crate::sys::fd::EventFd;

/// What happened, like `ibv_event_type` (the kinds that make sense for
/// iWARP, plus the connection events of the LLP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEventKind {
    /// The QP went to ERROR because of an error not tied to one work request
    /// (`IBV_EVENT_QP_FATAL`).
    QpFatal,
    /// The peer's request violated the protocol (`IBV_EVENT_QP_REQ_ERR`):
    /// bad opcode, DDP/RDMAP error, too long a message.
    QpRequestError,
    /// The peer's request violated access rights
    /// (`IBV_EVENT_QP_ACCESS_ERR`): bad STag, bounds, rights.
    QpAccessError,
    /// The connection is established: the QP reached RTS
    /// (`IBV_EVENT_COMM_EST`).
    CommEstablished,
    /// The send queue drained after a move to SQD (`IBV_EVENT_SQ_DRAINED`).
    SqDrained,
    /// The last work request of a QP attached to an SRQ was consumed or
    /// flushed (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    QpLastWqeReached,
    /// A completion queue overflowed (`IBV_EVENT_CQ_ERR`); completions were
    /// lost.
    CqError,
    /// The number of work requests posted to an SRQ dropped below its limit
    /// (`IBV_EVENT_SRQ_LIMIT_REACHED`); the limit is now disarmed.
    SrqLimitReached,
    /// An SRQ failed (`IBV_EVENT_SRQ_ERR`).
    SrqError,
    /// The device can no longer work (`IBV_EVENT_DEVICE_FATAL`).
    DeviceFatal,
    /// The LLP (TCP) connection was closed in an orderly way while the QP
    /// was in use.
    LlpClosed,
    /// The LLP (TCP) connection was reset or failed.
    LlpReset,
    /// The peer closed the stream at a point that is not an FPDU boundary,
    /// or with work outstanding.
    BadClose,
    /// The peer sent a Terminate message; [`AsyncEvent::term`] has its code.
    TerminateReceived,
    /// softrdma: the async event queue was full (nobody read it): events
    /// were dropped. [`AsyncEventQueue::lost`] counts them; this event is
    /// queued once each time the queue fills up.
    EventQueueOverflow,
    /// softrdma: a message for a proxy QP's proxy reached a proxy that no
    /// longer runs; the message was discarded (its receive completed with
    /// [`WcStatus::ProxyDiscarded`](crate::WcStatus::ProxyDiscarded)).
    ProxyMismatch,
}

impl AsyncEventKind {
    /// The ibverbs name of the event, or a softrdma name for the iWARP
    /// connection events ibverbs does not have.
    pub const fn name(self) -> &'static str {
        match self {
            AsyncEventKind::QpFatal => "IBV_EVENT_QP_FATAL",
            AsyncEventKind::QpRequestError => "IBV_EVENT_QP_REQ_ERR",
            AsyncEventKind::QpAccessError => "IBV_EVENT_QP_ACCESS_ERR",
            AsyncEventKind::CommEstablished => "IBV_EVENT_COMM_EST",
            AsyncEventKind::SqDrained => "IBV_EVENT_SQ_DRAINED",
            AsyncEventKind::QpLastWqeReached => "IBV_EVENT_QP_LAST_WQE_REACHED",
            AsyncEventKind::CqError => "IBV_EVENT_CQ_ERR",
            AsyncEventKind::SrqLimitReached => "IBV_EVENT_SRQ_LIMIT_REACHED",
            AsyncEventKind::SrqError => "IBV_EVENT_SRQ_ERR",
            AsyncEventKind::DeviceFatal => "IBV_EVENT_DEVICE_FATAL",
            AsyncEventKind::LlpClosed => "LLP_CLOSED",
            AsyncEventKind::LlpReset => "LLP_RESET",
            AsyncEventKind::BadClose => "BAD_CLOSE",
            AsyncEventKind::TerminateReceived => "TERMINATE_RECEIVED",
            AsyncEventKind::ProxyMismatch => "PROXY_MISMATCH",
            AsyncEventKind::EventQueueOverflow => "EVENT_QUEUE_OVERFLOW",
        }
    }
}

impl fmt::Display for AsyncEventKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One asynchronous event (`ibv_async_event`): what happened and to which
/// resource.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct AsyncEvent {
    /// What happened.
    pub kind: AsyncEventKind,
    /// The QP concerned, for QP and connection events.
    pub qp_num: Option<u32>,
    /// The completion queue concerned, for [`AsyncEventKind::CqError`].
    pub cq_id: Option<u32>,
    /// The shared receive queue concerned, for SRQ events.
    pub srq_id: Option<u32>,
    /// The Terminate code that caused the event: the one received for
    /// [`AsyncEventKind::TerminateReceived`], the one sent for local
    /// detection of a peer's error.
    pub term: Option<TermCode>,
    /// A human-readable explanation, if there is more to say.
    pub detail: Option<String>,
}

impl AsyncEvent {
    /// An event of the device itself (no resource named).
    pub const fn device(kind: AsyncEventKind) -> AsyncEvent {
        AsyncEvent {
            kind,
            qp_num: None,
            cq_id: None,
            srq_id: None,
            term: None,
            detail: None,
        }
    }

    /// An event of QP `qp_num`.
    pub fn qp(kind: AsyncEventKind, qp_num: u32) -> AsyncEvent {
        AsyncEvent {
            qp_num: Some(qp_num),
            ..AsyncEvent::device(kind)
        }
    }

    /// An event of completion queue `cq_id`.
    pub fn cq(kind: AsyncEventKind, cq_id: u32) -> AsyncEvent {
        AsyncEvent {
            cq_id: Some(cq_id),
            ..AsyncEvent::device(kind)
        }
    }

    /// An event of shared receive queue `srq_id`.
    pub fn srq(kind: AsyncEventKind, srq_id: u32) -> AsyncEvent {
        AsyncEvent {
            srq_id: Some(srq_id),
            ..AsyncEvent::device(kind)
        }
    }

    /// With the Terminate code that caused it.
    #[must_use]
    pub fn with_term(mut self, term: TermCode) -> AsyncEvent {
        self.term = Some(term);
        self
    }

    /// With an explanation.
    #[must_use]
    pub fn with_detail(mut self, detail: impl Into<String>) -> AsyncEvent {
        self.detail = Some(detail.into());
        self
    }
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind.name())?;
        if let Some(qp) = self.qp_num {
            write!(f, " qp {qp}")?;
        }
        if let Some(cq) = self.cq_id {
            write!(f, " cq {cq}")?;
        }
        if let Some(srq) = self.srq_id {
            write!(f, " srq {srq}")?;
        }
        if let Some(term) = self.term {
            write!(f, " (terminate: {term})")?;
        }
        if let Some(detail) = &self.detail {
            write!(f, ": {detail}")?;
        }
        Ok(())
    }
}

/// A FIFO queue with an event fd that is readable exactly while the queue is
/// not empty. Shared by completion channels and the async event queue.
///
/// Invariant: the fd's counter is non-zero if and only if `items` is not
/// empty. Both are changed under the `items` lock, so a consumer that
/// empties the queue and drains the counter cannot lose a concurrent push.
#[derive(Debug)]
pub(crate) struct FdQueue<T> {
    items: Mutex<VecDeque<T>>,
    fd: Arc<EventFd>,
}

impl<T> FdQueue<T> {
    /// An empty queue.
    pub(crate) fn new() -> io::Result<FdQueue<T>> {
        Ok(FdQueue {
            items: Mutex::new(VecDeque::new()),
            fd: Arc::new(EventFd::new()?),
        })
    }

    /// Appends an item; the fd becomes readable.
    pub(crate) fn push(&self, item: T) {
        let mut items = self.items.lock();
        if items.is_empty() {
            self.fd.signal();
        }
        items.push_back(item);
    }

    /// The oldest item, without waiting.
    pub(crate) fn try_pop(&self) -> Option<T> {
        let mut items = self.items.lock();
        let item = items.pop_front();
        if item.is_some() && items.is_empty() {
            self.fd.drain();
        }
        item
    }

    /// The oldest item, waiting up to `timeout` (`None`: forever) for one.
    /// `None` when the time is up.
    ///
    /// # Errors
    ///
    /// The error of `poll(2)` on the fd.
    pub(crate) fn pop(&self, timeout: Option<Duration>) -> io::Result<Option<T>> {
        let deadline = timeout.map(|t| clock::now().checked_add(t));
        loop {
            if let Some(item) = self.try_pop() {
                return Ok(Some(item));
            }
            let left = match deadline {
                None | Some(None) => None,
                Some(Some(deadline)) => Some(deadline.saturating_duration_since(clock::now())),
            };
            if !self.fd.wait(left)? {
                // Timed out; one last look (a push may have raced the wait).
                return Ok(self.try_pop());
            }
        }
    }

    /// Appends an item if fewer than `cap` are queued. With `cap - 1`
    /// queued, the last slot takes `overflow()` instead (the item is
    /// dropped); with `cap` queued the item is dropped. `false` if the item
    /// was dropped.
    pub(crate) fn push_bounded(&self, item: T, cap: usize, overflow: impl FnOnce() -> T) -> bool {
        let mut items = self.items.lock();
        if items.len() + 1 >= cap {
            if items.len() + 1 == cap {
                items.push_back(overflow());
            }
            return false;
        }
        if items.is_empty() {
            self.fd.signal();
        }
        items.push_back(item);
        true
    }

    /// Number of queued items.
    pub(crate) fn len(&self) -> usize {
        self.items.lock().len()
    }

    /// The fd, readable while the queue is not empty.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// The event fd itself, shared (to register it with an async runtime
    /// for as long as the registration lives).
    #[cfg(feature = "tokio")]
    pub(crate) fn event_fd(&self) -> Arc<EventFd> {
        Arc::clone(&self.fd)
    }
}

/// A watch on a QP's state, told of each change by the QP itself (under
/// the QP's own locks: it may only queue an event). The connection manager
/// installs one on each connection it makes (`QueuePair::set_state_watch`).
pub(crate) trait StateWatch: Send + Sync + fmt::Debug {
    /// The QP moved to `state`.
    fn notify(&self, state: crate::state::QpState);
}

/// The async event queue of a device. Reached through the device; the
/// events are read with [`get`](AsyncEventQueue::get),
/// [`try_get`](AsyncEventQueue::try_get) or by watching
/// [`fd`](AsyncEventQueue::fd).
///
/// The queue holds at most [`ASYNC_EVENT_QUEUE_CAPACITY`] events: an
/// application that never reads it (every connection adds an event or two)
/// does not grow without bound. When it is full, new events are dropped and
/// counted ([`lost`](AsyncEventQueue::lost)); the last slot holds an
/// [`AsyncEventKind::EventQueueOverflow`] event saying so.
#[derive(Debug)]
pub struct AsyncEventQueue {
    queue: FdQueue<AsyncEvent>,
    capacity: usize,
    lost: std::sync::atomic::AtomicU64,
}

/// How many events an [`AsyncEventQueue`] holds (the last slot is kept for
/// the overflow event).
pub const ASYNC_EVENT_QUEUE_CAPACITY: usize = 4096;

impl AsyncEventQueue {
    /// An empty queue.
    ///
    /// # Errors
    ///
    /// The event fd could not be created (descriptor limit).
    #[cfg(test)]
    pub(crate) fn new() -> io::Result<AsyncEventQueue> {
        Self::with_capacity(ASYNC_EVENT_QUEUE_CAPACITY)
    }

    /// An empty queue holding at most `capacity` (at least 2) events.
    pub(crate) fn with_capacity(capacity: usize) -> io::Result<AsyncEventQueue> {
        Ok(AsyncEventQueue {
            queue: FdQueue::new()?,
            capacity: capacity.max(2),
            lost: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// Queues an event for the application (dropped and counted if the
    /// queue is full).
    #[allow(dead_code)] // used by the data path
    pub(crate) fn push(&self, event: AsyncEvent) {
        let capacity = self.capacity;
        let kept = self.queue.push_bounded(event, capacity, || {
            AsyncEvent::device(AsyncEventKind::EventQueueOverflow).with_detail(format!(
                "the async event queue is full ({capacity} events): newer events are dropped until it is read"
            ))
        });
        if !kept {
            self.lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Events dropped so far because the queue was full.
    pub fn lost(&self) -> u64 {
        self.lost.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The most events the queue holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The next event, waiting up to `timeout` for one (`None`: no limit),
    /// like `ibv_get_async_event`. `None` when the time is up.
    pub fn get(&self, timeout: Option<Duration>) -> Option<AsyncEvent> {
        // poll(2) on our own eventfd fails only for lack of kernel memory;
        // report that as "no event" after falling back to a plain look.
        self.queue
            .pop(timeout)
            .unwrap_or_else(|_| self.queue.try_pop())
    }

    /// The next event if one is queued, without waiting.
    pub fn try_get(&self) -> Option<AsyncEvent> {
        self.queue.try_pop()
    }

    /// Number of queued events.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether no event is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A descriptor that is readable while an event is queued (for
    /// `poll(2)`, `epoll(7)` or an async runtime). Reading it is not needed
    /// and not useful: take events with [`try_get`](Self::try_get).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.queue.fd()
    }
}

impl AsRawFd for AsyncEventQueue {
    fn as_raw_fd(&self) -> RawFd {
        self.queue.fd().as_raw_fd()
    }
}

impl AsFd for AsyncEventQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.queue.fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn fifo_and_fd_mirror_the_queue() {
        let q = AsyncEventQueue::new().unwrap();
        assert!(q.try_get().is_none());
        assert!(q.queue.fd.wait(Some(Duration::ZERO)).is_ok_and(|r| !r));
        q.push(AsyncEvent::qp(AsyncEventKind::QpFatal, 7));
        q.push(AsyncEvent::cq(AsyncEventKind::CqError, 3).with_detail("overflow"));
        assert_eq!(q.len(), 2);
        assert!(q.queue.fd.wait(Some(Duration::ZERO)).unwrap());
        assert_eq!(q.try_get().unwrap().qp_num, Some(7));
        assert!(q.queue.fd.wait(Some(Duration::ZERO)).unwrap());
        let e = q.get(Some(Duration::ZERO)).unwrap();
        assert_eq!(e.kind, AsyncEventKind::CqError);
        assert_eq!(e.cq_id, Some(3));
        assert_eq!(e.to_string(), "IBV_EVENT_CQ_ERR cq 3: overflow");
        assert!(q.is_empty());
        assert!(!q.queue.fd.wait(Some(Duration::ZERO)).unwrap());
    }

    #[test]
    fn full_queue_drops_events_and_reports_the_overflow_once() {
        let q = AsyncEventQueue::with_capacity(4).unwrap();
        for i in 0..10 {
            q.push(AsyncEvent::qp(AsyncEventKind::LlpClosed, i));
        }
        assert_eq!(q.len(), 4);
        assert_eq!(q.lost(), 7);
        let kinds: Vec<_> = std::iter::from_fn(|| q.try_get()).map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                AsyncEventKind::LlpClosed,
                AsyncEventKind::LlpClosed,
                AsyncEventKind::LlpClosed,
                AsyncEventKind::EventQueueOverflow
            ]
        );
        // Read: room again.
        q.push(AsyncEvent::qp(AsyncEventKind::LlpClosed, 99));
        assert_eq!(q.try_get().and_then(|e| e.qp_num), Some(99));
    }

    #[test]
    fn get_times_out() {
        let q = AsyncEventQueue::new().unwrap();
        let start = Instant::now();
        assert!(q.get(Some(Duration::from_millis(20))).is_none());
        assert!(start.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn get_wakes_on_push_from_another_thread() {
        let q = std::sync::Arc::new(AsyncEventQueue::new().unwrap());
        let pusher = {
            let q = q.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(10));
                q.push(AsyncEvent::srq(AsyncEventKind::SrqLimitReached, 1));
            })
        };
        let e = q.get(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(e.srq_id, Some(1));
        pusher.join().unwrap();
    }
}
