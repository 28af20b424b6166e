//! Event dispatchers ([`Evd`]), their events ([`Event`]) and consumer
//! notification objects ([`Cno`]).

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use softrdma_engine::{CompletionQueue, WorkCompletion};
use softrdma_proto::dat::cno::{self as cno_rules, CnoOp, CnoState};
use softrdma_proto::dat::ep::ConnEvent;
use softrdma_proto::dat::evd::{self as rules, EvdOp, EvdState, Push};

use crate::cm::{Cr, ServicePoint};
use crate::ep::{DtoOp, DtoStatus, Ep, EpInner};
use crate::fd::Signal;
use crate::ia::{Ia, IaInner};
use crate::mem::Rmr;
use crate::{ErrorType, Result, Subtype, err};

/// Empty dequeues in a row after which each further one yields the CPU.
const SPIN_BEFORE_YIELD: u32 = 64;

/// Kinds of events an EVD takes (`DAT_EVD_FLAGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct EvdFlags(pub u32);

impl EvdFlags {
    /// `DAT_EVD_SOFTWARE_FLAG`.
    pub const SOFTWARE: EvdFlags = EvdFlags(0x001);
    /// `DAT_EVD_CR_FLAG`.
    pub const CR: EvdFlags = EvdFlags(0x010);
    /// `DAT_EVD_DTO_FLAG`.
    pub const DTO: EvdFlags = EvdFlags(0x020);
    /// `DAT_EVD_CONNECTION_FLAG`.
    pub const CONNECTION: EvdFlags = EvdFlags(0x040);
    /// `DAT_EVD_RMR_BIND_FLAG`.
    pub const RMR_BIND: EvdFlags = EvdFlags(0x080);
    /// `DAT_EVD_ASYNC_FLAG`.
    pub const ASYNC: EvdFlags = EvdFlags(0x100);

    /// Whether any flag of `other` is set.
    pub const fn intersects(self, other: EvdFlags) -> bool {
        self.0 & other.0 != 0
    }

    /// Both sets.
    #[must_use]
    pub const fn union(self, other: EvdFlags) -> EvdFlags {
        EvdFlags(self.0 | other.0)
    }
}

/// Asynchronous errors (`DAT_ASYNC_ERROR_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncKind {
    /// An EVD overflowed: an event was lost.
    EvdOverflow,
    /// The IA can no longer work.
    IaCatastrophic,
    /// An EP's connection broke (Terminate, protocol or access error).
    EpBroken,
    /// A timeout expired.
    TimedOut,
    /// The provider failed internally.
    ProviderInternalError,
}

impl AsyncKind {
    /// The `DAT_EVENT_NUMBER`.
    pub const fn event_number(self) -> u32 {
        match self {
            AsyncKind::EvdOverflow => 0x8001,
            AsyncKind::IaCatastrophic => 0x8002,
            AsyncKind::EpBroken => 0x8003,
            AsyncKind::TimedOut => 0x8004,
            AsyncKind::ProviderInternalError => 0x8005,
        }
    }
}

/// An event taken from an EVD.
#[derive(Debug, Clone)]
pub enum Event {
    /// A data transfer completed (`DAT_DTO_COMPLETION_EVENT`).
    Dto {
        /// The EP the transfer was posted on.
        ep: Ep,
        /// The consumer's cookie.
        cookie: u64,
        /// How it ended.
        status: DtoStatus,
        /// Bytes transferred (received bytes for a receive; the posted
        /// length for the others).
        len: u32,
        /// The operation.
        op: DtoOp,
    },
    /// An RMR bind completed (`DAT_RMR_BIND_COMPLETION_EVENT`).
    RmrBind {
        /// The RMR.
        rmr: Rmr,
        /// The consumer's cookie.
        cookie: u64,
        /// How it ended.
        status: DtoStatus,
    },
    /// A connection request arrived (`DAT_CONNECTION_REQUEST_EVENT`).
    ConnRequest {
        /// The service point it arrived at.
        sp: ServicePoint,
        /// The service point's connection qualifier.
        conn_qual: u64,
        /// The request.
        cr: Cr,
    },
    /// A connection event of an EP (`DAT_CONNECTION_EVENT_*`).
    Connection {
        /// The EP.
        ep: Ep,
        /// What happened.
        kind: ConnEvent,
        /// The peer's private data (accept or consumer reject).
        private_data: Vec<u8>,
    },
    /// An asynchronous error.
    Async {
        /// What happened.
        kind: AsyncKind,
        /// The EP concerned, if any.
        ep: Option<Ep>,
        /// The EVD concerned, if any (overflow).
        evd: Option<Evd>,
    },
    /// A software event (`dat_evd_post_se`).
    Software(u64),
}

impl Event {
    /// The `DAT_EVENT_NUMBER`.
    pub fn event_number(&self) -> u32 {
        match self {
            Event::Dto { .. } => 0x1,
            Event::RmrBind { .. } => 0x1001,
            Event::ConnRequest { .. } => 0x2001,
            Event::Connection { kind, .. } => kind.event_number(),
            Event::Async { kind, .. } => kind.event_number(),
            Event::Software(_) => 0x10001,
        }
    }
}

#[derive(Debug)]
struct EvdQ {
    events: VecDeque<Event>,
    qlen: usize,
    st: EvdState,
    cno: Option<Cno>,
}

#[derive(Debug)]
pub(crate) struct EvdInner {
    id: u64,
    flags: EvdFlags,
    q: Mutex<EvdQ>,
    cv: Condvar,
    signal: Signal,
    pub(crate) cq: Option<CompletionQueue>,
    /// Held while completions are taken from the CQ and queued, so the
    /// callback thread and a polling consumer keep their order.
    reap: Mutex<()>,
    ia: Weak<IaInner>,
    /// EPs whose completions arrive here, by QP number.
    pub(crate) eps: Mutex<HashMap<u32, Weak<EpInner>>>,
    /// EPs and service points using the EVD.
    pub(crate) users: AtomicUsize,
    /// Dequeues in a row that found the EVD empty.
    empty_polls: AtomicU32,
    /// Completions must become events without a consumer call: the EVD
    /// has a CNO or its descriptor was handed out.
    notify_always: AtomicBool,
    /// Threads in `wait`.
    waiters: AtomicUsize,
    user: AtomicUsize,
    _ia_ref: Option<crate::ia::ObjRef>,
}

/// An event dispatcher (`DAT_EVD_HANDLE`): a queue of at most `qlen`
/// events of the kinds of its [`EvdFlags`]. DTO and RMR-bind EVDs own a
/// completion queue whose completions are turned into events as they
/// arrive. Its [`fd`](Evd::fd) is readable exactly while an event is
/// queued.
#[derive(Debug, Clone)]
pub struct Evd {
    pub(crate) inner: Arc<EvdInner>,
}

impl PartialEq for Evd {
    fn eq(&self, other: &Evd) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Evd {
    /// Creates an EVD of `qlen` entries on `ia`, notifying `cno` if given
    /// (`dat_evd_create`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` for a `qlen` of 0 or no flag;
    /// `DAT_INSUFFICIENT_RESOURCES` if the completion queue cannot be made.
    pub fn new(ia: &Ia, qlen: usize, flags: EvdFlags, cno: Option<&Cno>) -> Result<Evd> {
        Evd::create(&ia.inner, qlen, flags, cno, true)
    }

    pub(crate) fn create(
        ia: &Arc<IaInner>,
        qlen: usize,
        flags: EvdFlags,
        cno: Option<&Cno>,
        counted: bool,
    ) -> Result<Evd> {
        if qlen == 0 {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg2));
        }
        if flags.0 == 0 || flags.0 & !0x1f1 != 0 {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg4));
        }
        let signal =
            Signal::new().map_err(|_| err(ErrorType::InsufficientResources, Subtype::None))?;
        let inner = Arc::new_cyclic(|weak: &Weak<EvdInner>| {
            let cq = if flags.intersects(EvdFlags::DTO.union(EvdFlags::RMR_BIND)) {
                let max = ia.device.attr().max_cqe as usize;
                let cqe = qlen.max(64).min(max);
                let w = weak.clone();
                CompletionQueue::with_callback(&ia.device, cqe, move |cq| {
                    if let Some(e) = w.upgrade() {
                        let _g = e.reap.lock();
                        if e.must_arm() {
                            cq.drain_and_arm(false, |wc| e.on_completion(wc));
                        } else {
                            e.drain_cq(cq);
                        }
                    }
                })
                .ok()
            } else {
                None
            };
            EvdInner {
                id: crate::next_id(),
                flags,
                q: Mutex::new(EvdQ {
                    events: VecDeque::new(),
                    qlen,
                    st: EvdState::NEW,
                    cno: cno.cloned(),
                }),
                cv: Condvar::new(),
                signal,
                cq,
                reap: Mutex::new(()),
                ia: Arc::downgrade(ia),
                eps: Mutex::new(HashMap::new()),
                users: AtomicUsize::new(0),
                empty_polls: AtomicU32::new(0),
                notify_always: AtomicBool::new(cno.is_some()),
                waiters: AtomicUsize::new(0),
                user: AtomicUsize::new(0),
                _ia_ref: counted.then(|| crate::ia::ObjRef::new(ia)),
            }
        });
        {
            let mut evds = ia.evds.lock();
            evds.retain(|w| w.strong_count() > 0);
            evds.push(Arc::downgrade(&inner));
        }
        if flags.intersects(EvdFlags::DTO.union(EvdFlags::RMR_BIND)) {
            let Some(cq) = &inner.cq else {
                return Err(err(ErrorType::InsufficientResources, Subtype::ResourceTevd));
            };
            // Armed once first: a callback CQ's handler thread starts at its
            // first arm, and an EVD whose completions could never be
            // delivered must not be created (`drain_and_arm` drops the
            // error).
            cq.req_notify(false)
                .map_err(|_| err(ErrorType::InsufficientResources, Subtype::ResourceTevd))?;
            let e = inner.clone();
            let _g = e.reap.lock();
            cq.drain_and_arm(false, |wc| e.on_completion(wc));
        }
        Ok(Evd { inner })
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The flags it was created with.
    pub fn flags(&self) -> EvdFlags {
        self.inner.flags
    }

    /// The queue length.
    pub fn qlen(&self) -> usize {
        self.inner.q.lock().qlen
    }

    /// Events queued now.
    pub fn len(&self) -> usize {
        self.inner.q.lock().events.len()
    }

    /// Whether no event is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The CNO it notifies.
    pub fn cno(&self) -> Option<Cno> {
        self.inner.q.lock().cno.clone()
    }

    /// The state (enabled, waitable, waiting).
    pub fn state(&self) -> EvdState {
        self.inner.q.lock().st
    }

    /// A word the owner may keep with the object (the C provider keeps its
    /// handle here).
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// A descriptor readable exactly while an event is queued (for
    /// `poll(2)`/`epoll(7)`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.notify_always.store(true, Ordering::Release);
        self.inner.arm_and_reap();
        self.inner.signal.as_fd()
    }

    /// Waits until `threshold` events are queued, then takes the first;
    /// returns it with the number still queued (`dat_evd_wait`). `None`
    /// waits without limit.
    ///
    /// # Errors
    ///
    /// `DAT_TIMEOUT_EXPIRED`; `DAT_INVALID_PARAMETER` for a threshold of 0
    /// or above `qlen`; `DAT_INVALID_STATE` for a second waiter or an
    /// unwaitable EVD (also if it becomes unwaitable during the wait).
    pub fn wait(&self, timeout: Option<Duration>, threshold: usize) -> Result<(Event, usize)> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        // While a thread waits, the CQ's callback turns completions into
        // events (and re-arms the CQ); completions already in the CQ are
        // taken here, then the CQ is armed and looked at once more.
        self.inner.waiters.fetch_add(1, Ordering::AcqRel);
        let _waiting = WaiterGuard(&self.inner);
        if self.inner.q.lock().events.len() < threshold {
            self.inner.arm_and_reap();
        }
        let mut q = self.inner.q.lock();
        rules::check_threshold(threshold, q.qlen)?;
        q.st = rules::apply(q.st, EvdOp::WaitBegin)?;
        let result = loop {
            if !q.st.waitable {
                break Err(err(ErrorType::InvalidState, Subtype::EvdUnwaitable));
            }
            if rules::satisfied(q.events.len(), threshold.min(q.qlen)) {
                let ev = q.events.pop_front();
                if q.events.is_empty() {
                    self.inner.signal.clear();
                }
                let more = q.events.len();
                break ev
                    .map(|e| (e, more))
                    .ok_or_else(|| err(ErrorType::InternalError, Subtype::None));
            }
            match (timeout, deadline) {
                (Some(_), Some(d)) => {
                    if self.inner.cv.wait_until(&mut q, d).timed_out()
                        && !rules::satisfied(q.events.len(), threshold)
                    {
                        break Err(err(ErrorType::TimeoutExpired, Subtype::None));
                    }
                }
                _ => self.inner.cv.wait(&mut q),
            }
        };
        q.st = rules::apply(q.st, EvdOp::WaitEnd).unwrap_or(q.st);
        result
    }

    /// Takes the first event without waiting (`dat_evd_dequeue`).
    ///
    /// # Errors
    ///
    /// `DAT_QUEUE_EMPTY`; `DAT_INVALID_STATE` while a thread waits.
    pub fn dequeue(&self) -> Result<Event> {
        {
            let q = self.inner.q.lock();
            rules::apply(q.st, EvdOp::Dequeue)?;
            if q.events.is_empty() {
                drop(q);
                // A polling consumer takes completions itself instead of
                // waiting for the CQ's callback thread (which may hold the
                // reap lock: then it is queueing them right now).
                self.inner.reap_now();
            }
        }
        let mut q = self.inner.q.lock();
        rules::apply(q.st, EvdOp::Dequeue)?;
        let ev = q.events.pop_front();
        if q.events.is_empty() {
            self.inner.signal.clear();
        }
        drop(q);
        match ev {
            Some(ev) => {
                self.inner.empty_polls.store(0, Ordering::Relaxed);
                Ok(ev)
            }
            None => {
                // Consumers poll an empty EVD in a loop (dtestcm, dapltest
                // -m p); what fills it runs on other threads (the IA's and
                // the connection manager's reactors, the data path), which
                // a spinning consumer would starve on a machine with few
                // cores. A consumer that looks once before it waits
                // (dapltest -m b) is not slowed down.
                let n = self.inner.empty_polls.fetch_add(1, Ordering::Relaxed);
                if n >= SPIN_BEFORE_YIELD {
                    std::thread::yield_now();
                }
                Err(err(ErrorType::QueueEmpty, Subtype::None))
            }
        }
    }

    /// Queues a software event (`dat_evd_post_se`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` if the EVD is not a software EVD;
    /// `DAT_QUEUE_FULL` if it is full.
    pub fn post_software(&self, context: u64) -> Result<()> {
        if !self.inner.flags.intersects(EvdFlags::SOFTWARE) {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg1));
        }
        if self.inner.push(Event::Software(context)) {
            Ok(())
        } else {
            Err(err(ErrorType::QueueFull, Subtype::None))
        }
    }

    fn op(&self, op: EvdOp) -> Result<()> {
        let mut q = self.inner.q.lock();
        q.st = rules::apply(q.st, op)?;
        if op == EvdOp::SetUnwaitable {
            self.inner.cv.notify_all();
        }
        Ok(())
    }

    /// `dat_evd_enable`: arrivals notify the CNO again.
    ///
    /// # Errors
    ///
    /// None today (the signature follows DAT).
    pub fn enable(&self) -> Result<()> {
        self.op(EvdOp::Enable)
    }

    /// `dat_evd_disable`: arrivals are queued without notifying the CNO.
    ///
    /// # Errors
    ///
    /// None today.
    pub fn disable(&self) -> Result<()> {
        self.op(EvdOp::Disable)
    }

    /// `dat_evd_set_unwaitable`: a waiter returns with
    /// `DAT_INVALID_STATE`, later waits fail.
    ///
    /// # Errors
    ///
    /// None today.
    pub fn set_unwaitable(&self) -> Result<()> {
        self.op(EvdOp::SetUnwaitable)
    }

    /// `dat_evd_clear_unwaitable`.
    ///
    /// # Errors
    ///
    /// None today.
    pub fn clear_unwaitable(&self) -> Result<()> {
        self.op(EvdOp::ClearUnwaitable)
    }

    /// `dat_evd_modify_cno`.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` while a thread waits.
    pub fn modify_cno(&self, cno: Option<&Cno>) -> Result<()> {
        let mut q = self.inner.q.lock();
        rules::apply(q.st, EvdOp::ModifyCno)?;
        q.cno = cno.cloned();
        drop(q);
        if cno.is_some() {
            self.inner.notify_always.store(true, Ordering::Release);
            self.inner.arm_and_reap();
        }
        Ok(())
    }

    /// `dat_evd_resize`.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` for 0, `DAT_INVALID_STATE` below the events
    /// queued or while a thread waits, `DAT_INSUFFICIENT_RESOURCES` if the
    /// completion queue cannot grow.
    pub fn resize(&self, qlen: usize) -> Result<()> {
        let mut q = self.inner.q.lock();
        rules::apply(q.st, EvdOp::Resize)?;
        rules::check_resize(qlen, q.events.len())?;
        if let Some(cq) = &self.inner.cq
            && qlen > cq.capacity()
        {
            cq.resize(qlen)
                .map_err(|_| err(ErrorType::InsufficientResources, Subtype::ResourceTevd))?;
        }
        q.qlen = qlen;
        Ok(())
    }

    /// `dat_evd_free`: refused while EPs or service points use it or a
    /// thread waits.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` (`EVD_IN_USE`).
    pub fn free(self) -> Result<()> {
        if self.inner.users.load(Ordering::Acquire) > 0 {
            return Err(err(ErrorType::InvalidState, Subtype::EvdInUse));
        }
        let q = self.inner.q.lock();
        rules::apply(q.st, EvdOp::Free)?;
        Ok(())
    }

    /// Drops every queued event (they may hold EPs and CRs alive); used
    /// when the EVD or its IA goes away.
    pub fn drain(&self) {
        EvdInner::discard_events(&self.inner);
    }

    /// Pushes an event (crate use: connection, CR and async events).
    pub(crate) fn push(&self, ev: Event) -> bool {
        self.inner.push(ev)
    }
}

impl EvdInner {
    /// Drops every queued event (outside the queue's lock: dropping an
    /// event may drop the last handle of an EP, which detaches from its
    /// EVDs).
    pub(crate) fn discard_events(e: &EvdInner) {
        let mut q = e.q.lock();
        let old = std::mem::take(&mut q.events);
        e.signal.clear();
        drop(q);
        drop(old);
    }

    /// Queues `ev`; on overflow drops it and reports the overflow on the
    /// IA's async EVD. Returns whether it was queued.
    fn push(self: &Arc<Self>, ev: Event) -> bool {
        let mut q = self.q.lock();
        if rules::push(q.events.len(), q.qlen) == Push::Overflow {
            drop(q);
            if !self.flags.intersects(EvdFlags::ASYNC)
                && let Some(ia) = self.ia.upgrade()
                && let Some(a) = ia.async_evd()
            {
                a.push(Event::Async {
                    kind: AsyncKind::EvdOverflow,
                    ep: None,
                    evd: Some(Evd {
                        inner: self.clone(),
                    }),
                });
            }
            return false;
        }
        q.events.push_back(ev);
        self.signal.raise();
        self.cv.notify_all();
        let cno = if q.st.enabled { q.cno.clone() } else { None };
        drop(q);
        if let Some(c) = cno {
            c.trigger(self);
        }
        true
    }

    /// Whether the CQ's callback must re-arm the CQ: without a CNO, a
    /// descriptor in use or a waiting thread, completions stay in the CQ
    /// until a consumer call takes them (as in DAPL), and the callback
    /// thread is not woken for each one.
    fn must_arm(&self) -> bool {
        self.notify_always.load(Ordering::Acquire) || self.waiters.load(Ordering::Acquire) > 0
    }

    /// Takes every completion (callback thread; the reap lock is held).
    fn drain_cq(self: &Arc<Self>, cq: &CompletionQueue) {
        let mut buf = [WorkCompletion::success(0, softrdma_engine::WcOpcode::Send, 0); 16];
        loop {
            let n = cq.poll(&mut buf);
            buf[..n].iter().for_each(|wc| self.on_completion(wc));
            if n < buf.len() {
                break;
            }
        }
    }

    /// Takes what the CQ holds and arms it (looking again after arming).
    fn arm_and_reap(self: &Arc<Self>) {
        let Some(cq) = &self.cq else { return };
        let _g = self.reap.lock();
        cq.drain_and_arm(false, |wc| self.on_completion(wc));
    }

    /// Takes what the CQ holds now, unless another thread is doing so.
    fn reap_now(self: &Arc<Self>) {
        let Some(cq) = &self.cq else { return };
        let Some(_g) = self.reap.try_lock() else {
            return;
        };
        self.drain_cq(cq);
    }

    fn on_completion(self: &Arc<Self>, wc: &WorkCompletion) {
        let ep = self.eps.lock().get(&wc.qp_num).and_then(Weak::upgrade);
        if let Some(ep) = ep
            && let Some(ev) = EpInner::completion_event(&ep, wc)
        {
            self.push(ev);
        }
    }
}

/// Counts a thread out of `Evd::wait` however it leaves.
struct WaiterGuard<'a>(&'a Arc<EvdInner>);

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
struct CnoQ {
    st: CnoState,
    fired: VecDeque<Weak<EvdInner>>,
    /// Triggered without an EVD.
    manual: bool,
}

#[derive(Debug)]
pub(crate) struct CnoInner {
    id: u64,
    q: Mutex<CnoQ>,
    cv: Condvar,
    signal: Signal,
    user: AtomicUsize,
    _ia_ref: crate::ia::ObjRef,
}

/// A consumer notification object (`DAT_CNO_HANDLE`): the EVDs created
/// with it trigger it when an event arrives while they are enabled;
/// [`wait`](Cno::wait) returns such an EVD. Its [`fd`](Cno::fd) is
/// readable while it is triggered.
#[derive(Debug, Clone)]
pub struct Cno {
    inner: Arc<CnoInner>,
}

impl PartialEq for Cno {
    fn eq(&self, other: &Cno) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Cno {
    /// Creates a CNO (`dat_cno_create`).
    ///
    /// # Errors
    ///
    /// `DAT_INSUFFICIENT_RESOURCES`.
    pub fn new(ia: &Ia) -> Result<Cno> {
        let signal =
            Signal::new().map_err(|_| err(ErrorType::InsufficientResources, Subtype::None))?;
        Ok(Cno {
            inner: Arc::new(CnoInner {
                id: crate::next_id(),
                q: Mutex::new(CnoQ {
                    st: CnoState {
                        waiting: false,
                        triggered: false,
                    },
                    fired: VecDeque::new(),
                    manual: false,
                }),
                cv: Condvar::new(),
                signal,
                user: AtomicUsize::new(0),
                _ia_ref: crate::ia::ObjRef::new(&ia.inner),
            }),
        })
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// See [`Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// A descriptor readable while the CNO is triggered.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.signal.as_fd()
    }

    /// Triggers the CNO without an EVD (`dat_cno_trigger`).
    pub fn trigger_empty(&self) {
        let mut q = self.inner.q.lock();
        q.st = cno_rules::apply(q.st, CnoOp::Trigger).unwrap_or(q.st);
        q.manual = true;
        self.inner.signal.raise();
        self.inner.cv.notify_all();
    }

    pub(crate) fn trigger(&self, evd: &Arc<EvdInner>) {
        let mut q = self.inner.q.lock();
        q.st = cno_rules::apply(q.st, CnoOp::Trigger).unwrap_or(q.st);
        if !q.fired.iter().any(|w| w.as_ptr() == Arc::as_ptr(evd)) {
            q.fired.push_back(Arc::downgrade(evd));
        }
        self.inner.signal.raise();
        self.inner.cv.notify_all();
    }

    /// Waits until an EVD of the CNO has an event and returns that EVD
    /// (`dat_cno_wait`; `None` as timeout waits without limit). `Ok(None)`
    /// after a [`trigger_empty`](Self::trigger_empty).
    ///
    /// # Errors
    ///
    /// `DAT_TIMEOUT_EXPIRED`; `DAT_INVALID_STATE` for a second waiter.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Option<Evd>> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut q = self.inner.q.lock();
        q.st = cno_rules::apply(q.st, CnoOp::WaitBegin)?;
        loop {
            // Triggers of EVDs emptied since (by a dequeue) are stale.
            while let Some(w) = q.fired.front() {
                match w.upgrade() {
                    Some(e) if !e.q.lock().events.is_empty() => break,
                    _ => {
                        q.fired.pop_front();
                    }
                }
            }
            let found = q.fired.pop_front().and_then(|w| w.upgrade());
            if found.is_some() || q.manual {
                q.manual = false;
                q.st.triggered = true;
                q.st = cno_rules::apply(q.st, CnoOp::Collect)?;
                if q.fired.is_empty() {
                    self.inner.signal.clear();
                }
                return Ok(found.map(|inner| Evd { inner }));
            }
            q.st.triggered = false;
            self.inner.signal.clear();
            match (timeout, deadline) {
                (Some(_), Some(d)) => {
                    if self.inner.cv.wait_until(&mut q, d).timed_out()
                        && q.fired.is_empty()
                        && !q.manual
                    {
                        q.st = cno_rules::apply(q.st, CnoOp::WaitTimeout)?;
                        return Err(err(ErrorType::TimeoutExpired, Subtype::None));
                    }
                }
                _ => self.inner.cv.wait(&mut q),
            }
        }
    }

    /// `dat_cno_free`.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` while a thread waits.
    pub fn free(self) -> Result<()> {
        let q = self.inner.q.lock();
        cno_rules::apply(q.st, CnoOp::Free)?;
        Ok(())
    }
}
