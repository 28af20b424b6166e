//! Completion event handlers: one thread per participating CPU that runs
//! the completion callbacks of the CQs bound to it, and one asynchronous
//! event handler per device.
//!
//! ```text
//!   Device ─┬─ handler 0 (CPU 0) ─┬─ CQ 3 ─┬─ QP 1
//!           │                     │        └─ QP 2
//!           │                     └─ CQ 5 ── QP 7
//!           ├─ handler 1 (CPU 1) ─── CQ 4 ── QP 3
//!           └─ async event handler ──▶ registered callback (QP/CQ/device errors)
//! ```
//!
//! A device has one completion event handler per participating CPU
//! ([`DeviceConfig::handler_cpus`]; by default every usable CPU: the
//! affinity mask, capped by the cgroup CPU quota), each with a
//! [`HandlerId`] (`0..n`). A handler's thread starts when a CQ with a
//! callback bound to it is first armed ([`CompletionQueue::req_notify`],
//! which reports a thread that cannot start; devices whose CQs use
//! channels or polling, or whose callback CQs are never armed, run no
//! handler threads), is pinned to its CPU only when
//! [`DeviceConfig::pin_threads`] is set, and blocks every signal. [`Device::handler_table`] maps identifiers to CPUs.
//!
//! Every CQ is bound to one handler when it is created: explicitly
//! ([`Binding::Handler`], [`Binding::Cpu`]) or by the device's
//! load-balancing policy ([`HandlerPolicy`]; by default the handler with the
//! fewest bound CQs, ties broken by the lower recent completion rate, then
//! by the lower identifier). The binding does not change;
//! [`CompletionQueue::handler`] tells it.
//!
//! # Completion callbacks
//!
//! A CQ created with a callback ([`CqBuilder::callback`],
//! [`CompletionQueue::with_callback`]) delivers its events to its handler
//! instead of a completion channel: when the CQ is armed
//! ([`CompletionQueue::req_notify`]) and a matching completion arrives, the
//! CQ is disarmed and the handler thread runs the callback once. Hence:
//!
//! - callbacks of CQs bound to different handlers run in parallel;
//! - callbacks of one CQ never run concurrently (they all run on its
//!   handler's thread, one after the other);
//! - every event is delivered (the handler's queue is unbounded); an arm
//!   raises at most one event.
//!
//! Arming is one-shot and completions that arrived before the arm raise no
//! event, so a callback must follow the verbs rule: **poll until empty,
//! re-arm, then poll again**; if that last poll finds a completion, process
//! it and repeat (the completion may have arrived before the arm, so no
//! event will come for it). [`CompletionQueue::drain_and_arm`] does exactly
//! this:
//!
//! ```
//! use softrdma_engine::*;
//!
//! let dev = Device::open_default()?;
//! let cq = CompletionQueue::with_callback(&dev, 256, |cq: &CompletionQueue| {
//!     cq.drain_and_arm(false, |wc| {
//!         // handle `wc`
//!         let _ = wc.wr_id;
//!     });
//! })?;
//! cq.req_notify(false)?; // first arm; from now on the callback re-arms
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A callback receives the CQ as an argument: it should not capture a
//! handle of its own CQ (or of a QP using it), which would keep the CQ alive
//! forever. A panicking callback is caught and counted
//! ([`HandlerStats::callback_panics`]); the CQ stays disarmed until the
//! application arms it again.
//!
//! CQs without a callback keep the completion-channel behaviour of
//! [`crate::cq`]; their handler binding only serves load accounting.
//!
//! # Unsignaled work
//!
//! A send-queue work request posted without
//! [`SendWr::signaled`](crate::SendWr::signaled) (on a QP without
//! `sq_sig_all`) produces no completion when it succeeds. As in verbs, it is
//! reported complete by the next *signaled* request of the same send queue:
//! send-queue requests complete in order, so when the completion of a
//! signaled request is polled, every unsignaled request posted before it on
//! that QP has completed too, and its send-queue slot is free again. Verbs
//! lets a provider keep those slots until then, so an application that posts
//! only unsignaled work must signal one request every so often (at least
//! once per send-queue depth), or the send queue may fill up. softrdma
//! retires a successful unsignaled request as soon as it and every request
//! before it are done (the slot is free at once,
//! [`QueuePair::send_queue_len`](crate::QueuePair::send_queue_len) drops),
//! which is allowed: applications must still follow the rule above. A
//! failed unsignaled request is always reported, with its error status, and
//! the QP goes to ERROR.
//!
//! # Asynchronous events
//!
//! Errors of QPs, CQs and the device go to the device's
//! [`AsyncEventQueue`]
//! ([`Device::async_events`]). With a callback registered
//! ([`Device::set_async_event_handler`]) they are instead delivered, in
//! order, to the callback, which runs on the device's asynchronous event
//! handler thread (started with the first registration).
//!
//! [`DeviceConfig::handler_cpus`]: crate::DeviceConfig::handler_cpus
//! [`DeviceConfig::pin_threads`]: crate::DeviceConfig::pin_threads
//! [`Device::handler_table`]: crate::Device::handler_table
//! [`Device::async_events`]: crate::Device::async_events
//! [`Device::set_async_event_handler`]: crate::Device::set_async_event_handler
//! [`CompletionQueue::handler`]: crate::CompletionQueue::handler
//! [`CompletionQueue::req_notify`]: crate::CompletionQueue::req_notify
//! [`CompletionQueue::with_callback`]: crate::CompletionQueue::with_callback
//! [`CompletionQueue::req_notify`]: crate::CompletionQueue::req_notify
//! [`CompletionQueue::drain_and_arm`]: crate::CompletionQueue::drain_and_arm
//! [`CqBuilder::callback`]: crate::cq::CqBuilder::callback

use std::fmt;
use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use crate::sys::clock;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;

use crate::event::{AsyncEvent, AsyncEventQueue};
#[cfg(doc)]
use crate::sys::io::usable_cpus;
use crate::sys::io::{pin_current_thread, spawn_engine_thread};

/// What a handler thread runs for an event: the callback of a completion
/// queue (implemented in `cq`, so that handlers need not know CQs).
pub(crate) trait Callback: Send + Sync {
    /// Runs the callback; false if there is none.
    fn run_callback(self: Arc<Self>) -> bool;
}

/// An event queued on a handler: the owner of the callback to run, held
/// weakly (an owner gone meanwhile runs nothing).
pub(crate) struct HandlerEvent(Weak<dyn Callback>);

impl HandlerEvent {
    /// An event for `owner`'s callback.
    pub(crate) fn new(owner: Weak<dyn Callback>) -> HandlerEvent {
        HandlerEvent(owner)
    }

    /// Runs the callback; false if the owner is gone or has none.
    fn run(&self) -> bool {
        self.0.upgrade().is_some_and(Callback::run_callback)
    }
}

/// Identifier of a completion event handler of a device (`0..n`, in the
/// order of [`DeviceConfig::handler_cpus`](crate::DeviceConfig::handler_cpus)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HandlerId(u32);

impl HandlerId {
    /// The identifier of the handler at `index` of the device's table.
    pub fn new(index: usize) -> HandlerId {
        HandlerId(u32::try_from(index).unwrap_or(u32::MAX))
    }

    /// The index of the handler in the device's table.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for HandlerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handler {}", self.0)
    }
}

/// How a new CQ chooses its completion event handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Binding {
    /// The device's load-balancing policy chooses ([`HandlerPolicy`]).
    #[default]
    Balanced,
    /// This handler.
    Handler(HandlerId),
    /// The (first) handler running on this CPU.
    Cpu(usize),
}

/// What a load-balancing policy knows of one handler when a CQ is created.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct HandlerLoad {
    /// The handler.
    pub id: HandlerId,
    /// Its CPU.
    pub cpu: usize,
    /// CQs bound to it now.
    pub cqs_bound: usize,
    /// Completions per second polled from its CQs, measured over the last
    /// second or so (0 until a second has passed since the device opened).
    pub recent_completion_rate: f64,
}

/// A load-balancing policy: chooses the handler of a new CQ (created with
/// [`Binding::Balanced`]).
pub trait BalancePolicy: Send + Sync + fmt::Debug {
    /// Chooses among `loads` (one per handler, never empty). An identifier
    /// that is not in `loads` falls back to [`FewestCqs`].
    fn choose(&self, loads: &[HandlerLoad]) -> HandlerId;
}

/// The default policy: the handler with the fewest bound CQs; ties go to
/// the lower recent completion rate, then to the lower identifier.
#[derive(Debug, Clone, Copy, Default)]
pub struct FewestCqs;

impl BalancePolicy for FewestCqs {
    fn choose(&self, loads: &[HandlerLoad]) -> HandlerId {
        loads
            .iter()
            .min_by(|a, b| {
                a.cqs_bound
                    .cmp(&b.cqs_bound)
                    .then(
                        a.recent_completion_rate
                            .total_cmp(&b.recent_completion_rate),
                    )
                    .then(a.id.cmp(&b.id))
            })
            .map_or(HandlerId(0), |l| l.id)
    }
}

/// Handlers in turn, whatever their load.
#[derive(Debug, Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl BalancePolicy for RoundRobin {
    fn choose(&self, loads: &[HandlerLoad]) -> HandlerId {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        loads
            .get(i % loads.len().max(1))
            .map_or(HandlerId(0), |l| l.id)
    }
}

/// The load-balancing policy of a device
/// ([`DeviceConfig::handler_policy`](crate::DeviceConfig::handler_policy)).
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum HandlerPolicy {
    /// [`FewestCqs`] (the default).
    #[default]
    FewestCqs,
    /// [`RoundRobin`].
    RoundRobin,
    /// An application-defined policy.
    Custom(Arc<dyn BalancePolicy>),
}

impl HandlerPolicy {
    /// An application-defined policy.
    pub fn custom(policy: impl BalancePolicy + 'static) -> HandlerPolicy {
        HandlerPolicy::Custom(Arc::new(policy))
    }

    fn build(&self) -> Arc<dyn BalancePolicy> {
        match self {
            HandlerPolicy::FewestCqs => Arc::new(FewestCqs),
            HandlerPolicy::RoundRobin => Arc::new(RoundRobin::default()),
            HandlerPolicy::Custom(p) => Arc::clone(p),
        }
    }
}

impl fmt::Debug for HandlerPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandlerPolicy::FewestCqs => f.write_str("FewestCqs"),
            HandlerPolicy::RoundRobin => f.write_str("RoundRobin"),
            HandlerPolicy::Custom(p) => f.debug_tuple("Custom").field(p).finish(),
        }
    }
}

impl PartialEq for HandlerPolicy {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (HandlerPolicy::FewestCqs, HandlerPolicy::FewestCqs)
            | (HandlerPolicy::RoundRobin, HandlerPolicy::RoundRobin) => true,
            (HandlerPolicy::Custom(a), HandlerPolicy::Custom(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

impl Eq for HandlerPolicy {}

/// Statistics of one completion event handler
/// ([`Device::handler_stats`](crate::Device::handler_stats)).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct HandlerStats {
    /// The handler.
    pub id: HandlerId,
    /// Its CPU.
    pub cpu: usize,
    /// Whether its thread is pinned to the CPU.
    pub pinned: bool,
    /// Whether its thread runs (it starts with the first arm of a CQ with
    /// a callback bound to the handler).
    pub running: bool,
    /// Completion events delivered to it (armed CQs with a callback that
    /// got a matching completion).
    pub events: u64,
    /// Callbacks it ran.
    pub callbacks: u64,
    /// Callbacks that panicked (caught).
    pub callback_panics: u64,
    /// CQs bound to it now.
    pub cqs_bound: usize,
    /// Completions polled from its CQs (by anyone), including CQs since
    /// dropped: an estimate for the load balancing, not an exact count
    /// (threads polling one CQ at the same moment may lose each other's
    /// additions).
    pub completions: u64,
}

/// One completion event handler, shared by its thread, the device and the
/// CQs bound to it.
pub(crate) struct Handler {
    id: HandlerId,
    cpu: usize,
    pinned: AtomicBool,
    /// Events to run, in arrival order.
    queue: SegQueue<HandlerEvent>,
    thread: OnceLock<Thread>,
    /// The thread, once started (by the first arm of a callback CQ bound
    /// to this handler).
    join: Mutex<Option<JoinHandle<()>>>,
    /// Pin the thread to `cpu` when it starts.
    pin: bool,
    stop: AtomicBool,
    /// Spin this long for more events before parking.
    spin: Duration,
    events: AtomicU64,
    callbacks: AtomicU64,
    panics: AtomicU64,
    cqs_bound: AtomicUsize,
    /// Poll counters of the bound CQs, and completions of dropped ones.
    counters: Mutex<Counters>,
}

/// A counter alone on its cache line (the poll counters of CQs polled by
/// different threads must not share one).
#[derive(Debug, Default)]
#[repr(align(128))]
pub(crate) struct PollCounter(pub(crate) AtomicU64);

impl PollCounter {
    /// Counts `n` completions polled: a load and a store, not a locked
    /// add (one per poll). The count feeds the handlers' load estimate
    /// (a rate); threads polling one CQ at the same moment may lose
    /// each other's additions (a thread delayed between its load and its
    /// store overwrites what was added meanwhile, so the count can even
    /// go back), which the rate (`saturating_sub`) tolerates.
    pub(crate) fn add(&self, n: usize) {
        let v = self.0.load(Ordering::Relaxed);
        self.0.store(v.wrapping_add(n as u64), Ordering::Relaxed);
    }
}

#[derive(Default)]
struct Counters {
    live: Vec<Weak<PollCounter>>,
    retired: u64,
    /// Last rate sample: when, total then, rate computed then.
    sample: Option<(Instant, u64, f64)>,
}

impl fmt::Debug for Handler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handler")
            .field("id", &self.id)
            .field("cpu", &self.cpu)
            .finish_non_exhaustive()
    }
}

impl Handler {
    /// The handler's identifier.
    pub(crate) fn id(&self) -> HandlerId {
        self.id
    }

    /// The handler's CPU.
    pub(crate) fn cpu(&self) -> usize {
        self.cpu
    }

    /// Queues an event for the handler thread (the data path: cheap, never
    /// blocks once the thread runs). The thread was started by the arm that
    /// let the event come ([`Handler::ensure_started`]); the start here
    /// only backs that up.
    pub(crate) fn deliver(self: &Arc<Self>, event: HandlerEvent) {
        self.events.fetch_add(1, Ordering::Relaxed);
        self.queue.push(event);
        if let Some(t) = self.thread.get() {
            // An atomic swap unless the thread is parked.
            t.unpark();
        } else {
            let _ = self.start();
        }
    }

    /// Starts the handler's thread if it is not running yet (called with
    /// the first arm of a callback CQ bound to it,
    /// [`Handler::ensure_started`]). The thread blocks every signal.
    pub(crate) fn start(self: &Arc<Self>) -> io::Result<()> {
        let mut join = self.join.lock();
        if join.is_some() || self.stop.load(Ordering::Acquire) {
            // Started by another caller meanwhile: the thread is known now
            // (set under this lock), and an event queued before it was may
            // have found it parked already.
            if let Some(t) = self.thread.get() {
                t.unpark();
            }
            return Ok(());
        }
        let h = Arc::clone(self);
        let pin = self.pin;
        let jh = spawn_engine_thread(format!("softrdma-cq{}", self.id.0), move || h.run(pin))?;
        let _ = self.thread.set(jh.thread().clone());
        *join = Some(jh);
        Ok(())
    }

    /// Starts the handler's thread unless it runs (one atomic load once it
    /// does): called when a CQ with a callback bound to it is armed.
    pub(crate) fn ensure_started(self: &Arc<Self>) -> io::Result<()> {
        if self.thread.get().is_some() {
            return Ok(());
        }
        self.start()
    }

    /// Whether the handler's thread is running.
    pub(crate) fn started(&self) -> bool {
        self.join.lock().is_some()
    }

    /// A CQ was bound; `counter` counts the completions polled from it.
    pub(crate) fn bind(&self, counter: &Arc<PollCounter>) {
        self.cqs_bound.fetch_add(1, Ordering::Relaxed);
        let mut c = self.counters.lock();
        c.live.retain(|w| w.strong_count() > 0);
        c.live.push(Arc::downgrade(counter));
    }

    /// A CQ is going away.
    pub(crate) fn unbind(&self, counter: &Arc<PollCounter>) {
        self.cqs_bound.fetch_sub(1, Ordering::Relaxed);
        let mut c = self.counters.lock();
        let target = Arc::downgrade(counter);
        c.live
            .retain(|w| w.strong_count() > 0 && !Weak::ptr_eq(w, &target));
        c.retired += counter.0.load(Ordering::Relaxed);
    }

    fn completions(c: &Counters) -> u64 {
        c.retired
            + c.live
                .iter()
                .filter_map(Weak::upgrade)
                .map(|a| a.0.load(Ordering::Relaxed))
                .sum::<u64>()
    }

    fn load(&self) -> HandlerLoad {
        let mut c = self.counters.lock();
        let total = Self::completions(&c);
        let now = clock::now();
        let rate = match c.sample {
            None => {
                c.sample = Some((now, total, 0.0));
                0.0
            }
            Some((then, before, rate)) => {
                let dt = now.duration_since(then);
                if dt >= Duration::from_secs(1) {
                    let rate = total.saturating_sub(before) as f64 / dt.as_secs_f64();
                    c.sample = Some((now, total, rate));
                    rate
                } else {
                    rate
                }
            }
        };
        HandlerLoad {
            id: self.id,
            cpu: self.cpu,
            cqs_bound: self.cqs_bound.load(Ordering::Relaxed),
            recent_completion_rate: rate,
        }
    }

    fn stats(&self) -> HandlerStats {
        HandlerStats {
            id: self.id,
            cpu: self.cpu,
            pinned: self.pinned.load(Ordering::Relaxed),
            running: self.started(),
            events: self.events.load(Ordering::Relaxed),
            callbacks: self.callbacks.load(Ordering::Relaxed),
            callback_panics: self.panics.load(Ordering::Relaxed),
            cqs_bound: self.cqs_bound.load(Ordering::Relaxed),
            completions: Self::completions(&self.counters.lock()),
        }
    }

    /// The handler thread.
    fn run(&self, pin: bool) {
        if pin {
            self.pinned
                .store(pin_current_thread(self.cpu).is_ok(), Ordering::Relaxed);
        }
        loop {
            while let Some(event) = self.queue.pop() {
                match catch_unwind(AssertUnwindSafe(|| event.run())) {
                    Ok(true) => {
                        self.callbacks.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(false) => {}
                    Err(_) => {
                        self.callbacks.fetch_add(1, Ordering::Relaxed);
                        self.panics.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if self.stop.load(Ordering::Acquire) {
                return;
            }
            if !self.spin.is_zero() {
                let until = clock::now() + self.spin;
                while self.queue.is_empty()
                    && !self.stop.load(Ordering::Relaxed)
                    && clock::now() < until
                {
                    std::hint::spin_loop();
                }
                if !self.queue.is_empty() {
                    continue;
                }
            }
            // A push after the last pop unparks us (the token makes this
            // park return at once), so no event is left behind.
            std::thread::park();
        }
    }
}

/// Why a CQ could not be bound to a handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BindError {
    NoSuchHandler(HandlerId),
    NoHandlerOnCpu(usize),
}

/// The completion event handlers and the asynchronous event handler of a
/// device.
pub(crate) struct Handlers {
    handlers: Vec<Arc<Handler>>,
    policy: Arc<dyn BalancePolicy>,
}

impl fmt::Debug for Handlers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Handlers")
            .field("handlers", &self.handlers)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// What [`Handlers::start`] takes of the device's configuration
/// (`DeviceConfig::handler_cpus`, `handler_policy`, `pin_threads`,
/// `handler_spin`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct HandlersConfig<'a> {
    /// CPUs, one handler each (all usable CPUs if empty).
    pub(crate) cpus: &'a [usize],
    /// The usable CPUs ([`usable_cpus`]).
    pub(crate) usable: &'a [usize],
    /// How new CQs choose their handler.
    pub(crate) policy: &'a HandlerPolicy,
    /// Pin each handler thread to its CPU.
    pub(crate) pin_threads: bool,
    /// How long an idle handler spins before it parks.
    pub(crate) spin: Duration,
}

impl Handlers {
    /// Sets up one handler per CPU of `config.cpus` (all usable CPUs if
    /// empty). A handler's thread starts when a CQ with a callback bound to
    /// it is first armed ([`Handler::ensure_started`]): a device whose CQs
    /// use channels or polling, or whose callback CQs are never armed, has
    /// no handler threads.
    pub(crate) fn start(config: HandlersConfig<'_>) -> io::Result<Handlers> {
        let cpus = if config.cpus.is_empty() {
            config.usable.to_vec()
        } else {
            config.cpus.to_vec()
        };
        let mut handlers = Handlers {
            handlers: Vec::with_capacity(cpus.len()),
            policy: config.policy.build(),
        };
        for (i, cpu) in cpus.into_iter().enumerate() {
            let h = Arc::new(Handler {
                id: HandlerId::new(i),
                cpu,
                pinned: AtomicBool::new(false),
                queue: SegQueue::new(),
                thread: OnceLock::new(),
                join: Mutex::new(None),
                pin: config.pin_threads,
                stop: AtomicBool::new(false),
                spin: config.spin,
                events: AtomicU64::new(0),
                callbacks: AtomicU64::new(0),
                panics: AtomicU64::new(0),
                cqs_bound: AtomicUsize::new(0),
                counters: Mutex::new(Counters::default()),
            });
            handlers.handlers.push(h);
        }
        Ok(handlers)
    }

    /// Chooses the handler of a new CQ.
    pub(crate) fn choose(&self, binding: Binding) -> Result<Arc<Handler>, BindError> {
        let h = match binding {
            Binding::Handler(id) => self
                .handlers
                .get(id.index())
                .ok_or(BindError::NoSuchHandler(id))?,
            Binding::Cpu(cpu) => self
                .handlers
                .iter()
                .find(|h| h.cpu == cpu)
                .ok_or(BindError::NoHandlerOnCpu(cpu))?,
            Binding::Balanced => {
                let loads: Vec<HandlerLoad> = self.handlers.iter().map(|h| h.load()).collect();
                let id = self.policy.choose(&loads);
                let id = if id.index() < self.handlers.len() {
                    id
                } else {
                    FewestCqs.choose(&loads)
                };
                self.handlers
                    .get(id.index())
                    .ok_or(BindError::NoSuchHandler(id))?
            }
        };
        Ok(Arc::clone(h))
    }

    /// Handler identifier → CPU, in identifier order.
    pub(crate) fn table(&self) -> Vec<(HandlerId, usize)> {
        self.handlers.iter().map(|h| (h.id, h.cpu)).collect()
    }

    /// Statistics of every handler, in identifier order.
    pub(crate) fn stats(&self) -> Vec<HandlerStats> {
        self.handlers.iter().map(|h| h.stats()).collect()
    }
}

impl Drop for Handlers {
    fn drop(&mut self) {
        for h in &self.handlers {
            h.stop.store(true, Ordering::Release);
            if let Some(t) = h.thread.get() {
                t.unpark();
            }
        }
        let me = std::thread::current().id();
        for jh in self.handlers.iter().filter_map(|h| h.join.lock().take()) {
            // The last device handle may be dropped by a callback on a
            // handler thread: that thread ends on its own.
            if jh.thread().id() != me {
                let _ = jh.join();
            }
        }
    }
}

/// A callback for asynchronous events.
pub type AsyncEventCallback = Box<dyn FnMut(&AsyncEvent) + Send>;

/// The device's asynchronous events: the application-visible queue, or,
/// with a callback registered, the asynchronous event handler thread.
/// Dereferences to the [`AsyncEventQueue`].
pub(crate) struct AsyncEvents {
    queue: AsyncEventQueue,
    handler: OnceLock<AsyncHandler>,
    /// Whether a callback is registered (events bypass the queue).
    active: AtomicBool,
}

struct AsyncHandler {
    shared: Arc<AsyncShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct AsyncShared {
    pending: SegQueue<AsyncEvent>,
    callback: Mutex<Option<AsyncEventCallback>>,
    stop: AtomicBool,
    delivered: AtomicU64,
}

impl fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncEvents")
            .field("queue", &self.queue)
            .field("callback", &self.active.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for AsyncEvents {
    type Target = AsyncEventQueue;
    fn deref(&self) -> &AsyncEventQueue {
        &self.queue
    }
}

impl AsyncEvents {
    /// No callback; events go to `queue`.
    pub(crate) fn new(queue: AsyncEventQueue) -> AsyncEvents {
        AsyncEvents {
            queue,
            handler: OnceLock::new(),
            active: AtomicBool::new(false),
        }
    }

    /// Reports an event: to the callback's thread if one is registered,
    /// else to the queue.
    pub(crate) fn push(&self, event: AsyncEvent) {
        if self.active.load(Ordering::Acquire)
            && let Some(h) = self.handler.get()
        {
            h.shared.pending.push(event);
            if let Some(t) = h.thread.lock().as_ref() {
                t.thread().unpark();
            }
            return;
        }
        self.queue.push(event);
    }

    /// Registers (replaces) the callback, starting the handler thread the
    /// first time. Events queued before stay in the queue.
    pub(crate) fn set_callback(&self, callback: AsyncEventCallback) -> io::Result<()> {
        let h = self.handler.get_or_init(|| AsyncHandler {
            shared: Arc::new(AsyncShared {
                pending: SegQueue::new(),
                callback: Mutex::new(None),
                stop: AtomicBool::new(false),
                delivered: AtomicU64::new(0),
            }),
            thread: Mutex::new(None),
        });
        *h.shared.callback.lock() = Some(callback);
        {
            let mut thread = h.thread.lock();
            if thread.is_none() {
                let shared = Arc::clone(&h.shared);
                *thread = Some(spawn_engine_thread(
                    "softrdma-async".to_string(),
                    move || {
                        run_async(&shared);
                    },
                )?);
            }
        }
        self.active.store(true, Ordering::Release);
        Ok(())
    }

    /// Removes the callback: later events go to the queue again (events
    /// already handed to the handler thread are still delivered to the
    /// old callback, or to the queue if it is gone).
    pub(crate) fn clear_callback(&self) {
        self.active.store(false, Ordering::Release);
        if let Some(h) = self.handler.get() {
            *h.shared.callback.lock() = None;
            while let Some(e) = h.shared.pending.pop() {
                self.queue.push(e);
            }
        }
    }

    /// Events delivered to callbacks so far.
    pub(crate) fn delivered(&self) -> u64 {
        self.handler
            .get()
            .map_or(0, |h| h.shared.delivered.load(Ordering::Relaxed))
    }
}

impl Drop for AsyncEvents {
    fn drop(&mut self) {
        if let Some(h) = self.handler.get() {
            h.shared.stop.store(true, Ordering::Release);
            if let Some(jh) = h.thread.lock().take() {
                jh.thread().unpark();
                if jh.thread().id() != std::thread::current().id() {
                    let _ = jh.join();
                }
            }
        }
    }
}

fn run_async(shared: &AsyncShared) {
    loop {
        while let Some(event) = shared.pending.pop() {
            let mut cb = shared.callback.lock();
            if let Some(cb) = cb.as_mut() {
                let _ = catch_unwind(AssertUnwindSafe(|| cb(&event)));
                shared.delivered.fetch_add(1, Ordering::Relaxed);
            }
        }
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        std::thread::park();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::AsyncEventKind;
    use crate::wc::{WcOpcode, WorkCompletion};
    use crate::{CompletionQueue, Device, DeviceConfig};
    use rand::Rng;
    use std::sync::atomic::AtomicU32;

    fn device(handlers: usize) -> Device {
        Device::open_with(DeviceConfig {
            handler_cpus: vec![0; handlers],
            pin_threads: false,
            ..DeviceConfig::default()
        })
        .unwrap()
    }

    fn wc(wr_id: u64, producer: u32) -> WorkCompletion {
        WorkCompletion::success(wr_id, WcOpcode::Recv, producer)
    }

    /// Waits (yielding) until `done` holds; fails after a generous deadline.
    fn wait_until(what: &str, done: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !done() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// What one stress CQ's callback saw.
    #[derive(Default)]
    struct Seen {
        next: Mutex<Vec<u64>>,
        total: AtomicU64,
        running: AtomicBool,
        overlaps: AtomicU64,
        runs: AtomicU64,
    }

    /// Takes up to `k` completions, checking per-producer order.
    fn take(cq: &CompletionQueue, seen: &Seen, k: usize) -> usize {
        let mut buf = [wc(0, 0); 64];
        let n = cq.poll(&mut buf[..k.clamp(1, 64)]);
        let mut next = seen.next.lock();
        for w in &buf[..n] {
            let slot = &mut next[w.qp_num as usize];
            assert_eq!(w.wr_id, *slot, "per-producer order");
            *slot += 1;
        }
        seen.total.fetch_add(n as u64, Ordering::Relaxed);
        n
    }

    /// One million completions from producer threads into two CQs on two
    /// handlers; the callbacks poll in random batches, re-arm at random
    /// points of the drain (always polling again after the last arm, the
    /// verbs rule), and a third thread arms at random. Nothing may be lost,
    /// order per producer holds, callbacks of one CQ never overlap.
    #[test]
    fn a_million_completions_with_random_arm_poll_interleavings() {
        const PRODUCERS: u32 = 4;
        const EACH: u64 = 250_000;
        let dev = device(2);
        let mut cqs = Vec::new();
        let mut seens = Vec::new();
        for h in 0..2 {
            let seen = Arc::new(Seen::default());
            *seen.next.lock() = vec![0; PRODUCERS as usize];
            let s = Arc::clone(&seen);
            let cq = CompletionQueue::builder(&dev, 1024)
                .binding(Binding::Handler(HandlerId::new(h)))
                .callback(move |cq: &CompletionQueue| {
                    if s.running.swap(true, Ordering::SeqCst) {
                        s.overlaps.fetch_add(1, Ordering::Relaxed);
                    }
                    s.runs.fetch_add(1, Ordering::Relaxed);
                    let mut rng = rand::rng();
                    loop {
                        // Random batches, sometimes arming early (an arm
                        // while completions are queued is allowed; it
                        // may raise an extra event).
                        while take(cq, &s, rng.random_range(1..64)) > 0 {
                            if rng.random_ratio(1, 50) {
                                cq.req_notify(rng.random_bool(0.1)).unwrap();
                            }
                            if rng.random_ratio(1, 200) {
                                std::thread::yield_now();
                            }
                        }
                        cq.req_notify(false).unwrap();
                        if rng.random_ratio(1, 20) {
                            std::thread::yield_now();
                        }
                        if take(cq, &s, rng.random_range(1..64)) == 0 {
                            break;
                        }
                    }
                    s.running.store(false, Ordering::SeqCst);
                })
                .build()
                .unwrap();
            assert_eq!(cq.handler(), HandlerId::new(h));
            cq.req_notify(false).unwrap();
            cqs.push(cq);
            seens.push(seen);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let chaos = {
            let cqs = cqs.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut rng = rand::rng();
                while !stop.load(Ordering::Relaxed) {
                    cqs[rng.random_range(0..2)]
                        .req_notify(rng.random_bool(0.5))
                        .unwrap();
                    std::thread::sleep(Duration::from_micros(rng.random_range(0..200)));
                }
            })
        };
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let cq = cqs[p as usize % 2].clone();
                std::thread::spawn(move || {
                    let mut rng = rand::rng();
                    for i in 0..EACH {
                        // Back off instead of overflowing.
                        while cq.len() >= cq.capacity() || cq.push(wc(i, p), false).is_err() {
                            std::thread::yield_now();
                        }
                        if rng.random_ratio(1, 5000) {
                            std::thread::sleep(Duration::from_micros(50));
                        }
                    }
                })
            })
            .collect();
        for p in producers {
            p.join().unwrap();
        }
        let per_cq = u64::from(PRODUCERS / 2) * EACH;
        for s in &seens {
            wait_until("every completion", || {
                s.total.load(Ordering::Relaxed) == per_cq
            });
        }
        stop.store(true, Ordering::Relaxed);
        chaos.join().unwrap();
        // Every callback returned armed and saw the CQ empty after arming:
        // one more completion must raise one more event.
        for (h, (cq, s)) in cqs.iter().zip(&seens).enumerate() {
            wait_until("the last callback", || !s.running.load(Ordering::SeqCst));
            let runs = s.runs.load(Ordering::Relaxed);
            // Producer `h` fed this CQ; its next completion is number EACH.
            cq.push(wc(EACH, h as u32), false).unwrap();
            wait_until("the final event", || s.runs.load(Ordering::Relaxed) > runs);
            wait_until("the final completion", || {
                s.total.load(Ordering::Relaxed) == per_cq + 1
            });
            assert_eq!(s.overlaps.load(Ordering::Relaxed), 0);
        }
        let stats = dev.handler_stats();
        for (st, s) in stats.iter().zip(&seens) {
            wait_until("stats", || {
                dev.handler_stats()[st.id.index()].callbacks == s.runs.load(Ordering::Relaxed)
            });
            assert_eq!(st.cqs_bound, 1);
            assert_eq!(st.callback_panics, 0);
        }
        let stats = dev.handler_stats();
        for st in &stats {
            // Every event ran a callback (none lost in the handler).
            assert_eq!(st.events, st.callbacks);
            assert_eq!(st.completions, per_cq + 1);
        }
    }

    #[test]
    fn handler_table_and_explicit_bindings() {
        let dev = Device::open_with(DeviceConfig {
            handler_cpus: vec![0, 0, 0],
            pin_threads: false,
            ..DeviceConfig::default()
        })
        .unwrap();
        assert_eq!(dev.attr().completion_handlers, 3);
        let table = dev.handler_table();
        assert_eq!(
            table,
            (0..3).map(|i| (HandlerId::new(i), 0)).collect::<Vec<_>>()
        );
        assert_eq!(dev.handler_cpu(HandlerId::new(2)), Some(0));
        assert_eq!(dev.handler_cpu(HandlerId::new(3)), None);
        let cq = CompletionQueue::builder(&dev, 4)
            .binding(Binding::Handler(HandlerId::new(2)))
            .build()
            .unwrap();
        assert_eq!(cq.handler(), HandlerId::new(2));
        assert_eq!(cq.handler_cpu(), 0);
        let by_cpu = CompletionQueue::builder(&dev, 4)
            .binding(Binding::Cpu(0))
            .build()
            .unwrap();
        assert_eq!(
            by_cpu.handler(),
            HandlerId::new(0),
            "first handler of the CPU"
        );
        assert!(matches!(
            CompletionQueue::builder(&dev, 4)
                .binding(Binding::Handler(HandlerId::new(3)))
                .build(),
            Err(crate::cq::CreateCqError::NoSuchHandler(_))
        ));
        assert!(matches!(
            CompletionQueue::builder(&dev, 4)
                .binding(Binding::Cpu(9999))
                .build(),
            Err(crate::cq::CreateCqError::NoHandlerOnCpu(9999))
        ));
        let ch = dev.create_comp_channel().unwrap();
        assert!(matches!(
            CompletionQueue::builder(&dev, 4)
                .channel(&ch)
                .callback(|_: &CompletionQueue| {})
                .build(),
            Err(crate::cq::CreateCqError::ChannelAndCallback)
        ));
        let bound: Vec<usize> = dev.handler_stats().iter().map(|s| s.cqs_bound).collect();
        assert_eq!(bound, [1, 0, 1]);
        drop(cq);
        let bound: Vec<usize> = dev.handler_stats().iter().map(|s| s.cqs_bound).collect();
        assert_eq!(bound, [1, 0, 0]);
    }

    #[test]
    fn fewest_cqs_then_lowest_rate() {
        let load = |id: usize, cqs: usize, rate: f64| HandlerLoad {
            id: HandlerId::new(id),
            cpu: id,
            cqs_bound: cqs,
            recent_completion_rate: rate,
        };
        let p = FewestCqs;
        assert_eq!(
            p.choose(&[load(0, 3, 0.0), load(1, 2, 9.0), load(2, 2, 5.0)]),
            HandlerId::new(2)
        );
        assert_eq!(
            p.choose(&[load(0, 1, 1.0), load(1, 1, 1.0)]),
            HandlerId::new(0)
        );
        let rr = RoundRobin::default();
        let loads = [load(0, 9, 0.0), load(1, 0, 0.0)];
        let picks: Vec<_> = (0..4).map(|_| rr.choose(&loads).index()).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }

    #[derive(Debug)]
    struct Last;
    impl BalancePolicy for Last {
        fn choose(&self, loads: &[HandlerLoad]) -> HandlerId {
            loads.last().unwrap().id
        }
    }

    #[derive(Debug)]
    struct Bogus;
    impl BalancePolicy for Bogus {
        fn choose(&self, _: &[HandlerLoad]) -> HandlerId {
            HandlerId::new(77)
        }
    }

    #[test]
    fn custom_policies() {
        for (policy, want) in [
            (HandlerPolicy::custom(Last), [2, 2, 2]),
            (HandlerPolicy::custom(Bogus), [0, 1, 2]), // falls back to FewestCqs
            (HandlerPolicy::RoundRobin, [0, 1, 2]),
        ] {
            let dev = Device::open_with(DeviceConfig {
                handler_cpus: vec![0, 0, 0],
                pin_threads: false,
                handler_policy: policy,
                ..DeviceConfig::default()
            })
            .unwrap();
            let cqs: Vec<_> = (0..3).map(|_| dev.create_cq(4).unwrap()).collect();
            let got: Vec<usize> = cqs.iter().map(|c| c.handler().index()).collect();
            assert_eq!(got, want);
        }
    }

    /// A CQ of 8 whose callback counts its calls.
    fn counting_cq(dev: &Device) -> (CompletionQueue, Arc<AtomicU32>) {
        let calls = Arc::new(AtomicU32::new(0));
        let c = Arc::clone(&calls);
        let cq = CompletionQueue::with_callback(dev, 8, move |_: &CompletionQueue| {
            c.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        (cq, calls)
    }

    #[test]
    fn a_panicking_callback_is_counted_and_the_handler_goes_on() {
        let dev = device(1);
        let calls = Arc::new(AtomicU32::new(0));
        let c = Arc::clone(&calls);
        let cq = CompletionQueue::with_callback(&dev, 8, move |_: &CompletionQueue| {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("first callback fails");
            }
        })
        .unwrap();
        // Silence the expected panic message.
        let hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        cq.req_notify(false).unwrap();
        cq.push(wc(1, 0), false).unwrap();
        wait_until("the first callback", || calls.load(Ordering::SeqCst) == 1);
        wait_until("the panic count", || {
            dev.handler_stats()[0].callback_panics == 1
        });
        std::panic::set_hook(hook);
        cq.req_notify(false).unwrap();
        cq.push(wc(2, 0), false).unwrap();
        wait_until("the second callback", || calls.load(Ordering::SeqCst) == 2);
        let st = &dev.handler_stats()[0];
        assert_eq!((st.events, st.callbacks), (2, 2));
    }

    /// Regression: a handler's thread started with the first event
    /// delivered to it, and one that could not start (the process at its
    /// thread limit) left the event queued with nothing to run it: the arm
    /// succeeded, the completion came, and the callback its caller waited
    /// for never ran (a CQ with a callback is not polled). The arm now
    /// starts the thread and fails if it cannot.
    #[test]
    fn arming_a_callback_cq_fails_when_its_handler_thread_cannot_start() {
        let ok = crate::sys::process::in_child(Duration::from_secs(20), || {
            let dev = device(1);
            let (cq, calls) = counting_cq(&dev);
            if !crate::sys::process::forbid_new_threads() {
                return false;
            }
            let armed = cq.req_notify(false);
            cq.push(wc(1, 0), false).unwrap();
            std::thread::sleep(Duration::from_millis(20));
            armed == Err(crate::cq::NotifyError::HandlerThread)
                && dev.handler_stats()[0].events == 0
                && !dev.handler_stats()[0].running
                && calls.load(Ordering::SeqCst) == 0
        });
        assert!(
            ok,
            "a callback CQ was armed with no thread to run its callback"
        );
    }

    #[test]
    fn an_unarmed_callback_cq_raises_nothing_and_solicited_arms_wait() {
        let dev = device(1);
        let (cq, calls) = counting_cq(&dev);
        cq.push(wc(1, 0), false).unwrap();
        cq.req_notify(true).unwrap();
        cq.push(wc(2, 0), false).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(calls.load(Ordering::SeqCst), 0);
        cq.push(wc(3, 0), true).unwrap();
        wait_until("the solicited event", || calls.load(Ordering::SeqCst) == 1);
        assert_eq!(cq.drain_and_arm(false, |_| {}), 3);
        cq.push(wc(4, 0), false).unwrap();
        wait_until("the next event", || calls.load(Ordering::SeqCst) == 2);
    }

    #[test]
    fn dropping_the_device_from_a_callback_does_not_hang() {
        let dev = device(2);
        let done = Arc::new(AtomicBool::new(false));
        let d = Arc::clone(&done);
        let cq = CompletionQueue::with_callback(&dev, 8, move |_: &CompletionQueue| {
            d.store(true, Ordering::SeqCst);
        })
        .unwrap();
        cq.req_notify(false).unwrap();
        cq.push(wc(1, 0), false).unwrap();
        // The event holds only a weak reference; dropping every handle
        // while it is queued or running ends the device cleanly.
        drop(cq);
        drop(dev);
    }

    #[test]
    fn async_events_go_to_the_callback_when_one_is_registered() {
        let dev = device(1);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        dev.set_async_event_handler(move |e: &AsyncEvent| s.lock().push(e.clone()))
            .unwrap();
        let cq = dev.create_cq(1).unwrap();
        cq.push(wc(1, 0), false).unwrap();
        assert!(cq.push(wc(2, 0), false).is_err());
        wait_until("the CQ error", || seen.lock().len() == 1);
        assert_eq!(seen.lock()[0].kind, AsyncEventKind::CqError);
        assert_eq!(seen.lock()[0].cq_id, Some(cq.id()));
        assert!(dev.async_events().try_get().is_none());
        assert_eq!(dev.async_events_delivered(), 1);
        dev.clear_async_event_handler();
        dev.events()
            .push(AsyncEvent::device(AsyncEventKind::DeviceFatal));
        assert_eq!(
            dev.async_events().try_get().unwrap().kind,
            AsyncEventKind::DeviceFatal
        );
        assert_eq!(seen.lock().len(), 1);
    }
}
