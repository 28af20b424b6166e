//! The software RDMA device: its configuration, attributes (like
//! `ibv_query_device`) and the per-device shared state (registration table,
//! async events, completion event handlers, engine threads).

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use std::time::Duration;

use crate::datamover::{DatamoverStats, Threads};
use crate::event::{AsyncEvent, AsyncEventQueue};
use crate::handlers::{
    AsyncEvents, HandlerId, HandlerPolicy, HandlerStats, Handlers, HandlersConfig,
};
use crate::stags::StagTable;

/// Name of the default device.
pub const DEFAULT_DEVICE_NAME: &str = "softrdma0";

/// How a device is set up. [`DeviceConfig::default`] is what
/// [`Device::open_default`] uses.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceConfig {
    /// Device name (reported by [`Device::name`]).
    pub name: String,
    /// CPUs that run an engine thread each (the datamover and receiver of
    /// its QPs). Empty: one per usable CPU (the CPUs of the affinity mask,
    /// at most as many as the cgroup CPU quota lets the process keep busy).
    /// Never more threads than usable CPUs: extra entries are ignored.
    pub datamover_cpus: Vec<usize>,
    /// Pin engine and completion event handler threads to their
    /// CPU. Off by default: on a machine shared with other work, a pinned
    /// thread waits for its CPU even when another one is idle (the
    /// scheduler cannot move it), which turns a busy neighbour into
    /// millisecond stalls.
    pub pin_threads: bool,
    /// CPUs that run a completion event handler thread each (handler `i`
    /// runs on `handler_cpus[i]`; a CPU may appear twice). Empty: one per
    /// usable CPU (as for `datamover_cpus`). See [`crate::handlers`].
    pub handler_cpus: Vec<usize>,
    /// How CQs created without an explicit binding choose their handler.
    pub handler_policy: HandlerPolicy,
    /// How long a completion event handler keeps looking for more events
    /// before it sleeps (0: sleep at once). Spinning lowers the latency of
    /// callback delivery under steady load at the cost of CPU time.
    pub handler_spin: Duration,
    /// Bytes of one QP's work a datamover transmits before moving on to the
    /// next active QP (round robin). Also the segmentation unit.
    pub slice_size: usize,
    /// Force every transmission through the datamovers (no direct sending in
    /// the posting thread). For measuring what direct sending saves.
    pub force_datamover: bool,
    /// Let `poll_cq` drive the receive path of the QPs using the CQ when it
    /// finds the CQ empty (busy-polling applications get data without a
    /// thread hand-off).
    pub poll_driven_receive: bool,
    /// How long [`CompletionQueue::wait`](crate::CompletionQueue::wait)
    /// busy-polls before it sleeps until a completion is pushed. Default
    /// 50 µs: long enough that a ping-pong partner on another CPU answers
    /// while we spin, short enough that a waiter on a busy machine gives
    /// its CPU back quickly. `Duration::MAX`: spin until the timeout.
    pub poll_spin: Duration,
    /// Let each CQ choose per wait between spinning for `poll_spin` and
    /// sleeping at once, by which gave the shorter waits lately (trying the
    /// other way now and then). On a machine where the CPUs are busy, the
    /// thread a waiter waits for often cannot run while the waiter spins,
    /// and sleeping at once is several times faster; on a quiet machine
    /// spinning wins and is kept. Default on; off: always spin for
    /// `poll_spin` first. (No effect with `poll_spin = Duration::MAX`.)
    pub poll_spin_adaptive: bool,
    /// While busy-polling in `wait`, yield the CPU (`sched_yield`) every
    /// this many empty polls, so a thread the poller waits for (its peer,
    /// a datamover) can run on the same CPU. 0: never yield.
    pub poll_yield_every: u32,
    /// How many events the async event queue holds before it drops new ones
    /// (see [`AsyncEventQueue`]).
    pub async_event_capacity: usize,
    /// Let small Sends and Writes (at most 256 bytes) that a thread posts
    /// between two polls of its CQ go out together, in one `writev`, at
    /// its next poll, wait or `req_notify` (1 ms at the latest). The first
    /// post after a poll that found nothing to write, and every post while
    /// a Read or atomic is outstanding or another thread polls the CQ, is
    /// written at once, so a ping-pong is never delayed. Default on, unless
    /// the environment has `SOFTRDMA_TX_BATCH=0`; off: every post is
    /// written as it is posted. Batching needs `poll_driven_receive` (the
    /// polls' hooks write the deferred posts); without it, it is off.
    pub tx_batch: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            name: DEFAULT_DEVICE_NAME.to_string(),
            datamover_cpus: Vec::new(),
            pin_threads: false,
            slice_size: 4096,
            force_datamover: false,
            poll_driven_receive: true,
            poll_spin: Duration::from_micros(50),
            poll_spin_adaptive: true,
            poll_yield_every: 64,
            handler_cpus: Vec::new(),
            handler_policy: HandlerPolicy::default(),
            handler_spin: Duration::ZERO,
            async_event_capacity: crate::event::ASYNC_EVENT_QUEUE_CAPACITY,
            tx_batch: std::env::var("SOFTRDMA_TX_BATCH").map_or(true, |v| v.trim() != "0"),
        }
    }
}

/// Device attributes, like `ibv_device_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeviceAttr {
    /// Firmware version string (the crate version).
    pub fw_ver: String,
    /// Vendor identifier (0: none).
    pub vendor_id: u32,
    /// Largest memory region, bytes.
    pub max_mr_size: u64,
    /// Page size used for segmentation and by the datamovers.
    pub page_size: usize,
    /// Max QPs.
    pub max_qp: u32,
    /// Max outstanding work requests per queue.
    pub max_qp_wr: u32,
    /// Max SGEs per send or receive work request.
    pub max_sge: u32,
    /// Max SGEs of an RDMA Read sink.
    pub max_sge_rd: u32,
    /// Max inline payload bytes.
    pub max_inline_data: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max entries per CQ.
    pub max_cqe: u32,
    /// Max memory regions.
    pub max_mr: u32,
    /// Max protection domains.
    pub max_pd: u32,
    /// Max memory windows.
    pub max_mw: u32,
    /// Max inbound RDMA Reads / atomics outstanding per QP (IRD).
    pub max_qp_rd_atom: u32,
    /// Max outbound RDMA Reads / atomics outstanding per QP (ORD).
    pub max_qp_init_rd_atom: u32,
    /// Max SRQs.
    pub max_srq: u32,
    /// Max work requests per SRQ.
    pub max_srq_wr: u32,
    /// Max SGEs per SRQ work request.
    pub max_srq_sge: u32,
    /// Atomic operations are supported and atomic with respect to other
    /// atomics on this device (`IBV_ATOMIC_HCA`).
    pub atomic_cap: bool,
    /// Max pages of a fast-register region.
    pub max_fast_reg_page_list_len: u32,
    /// Number of engine threads (each the datamover and receiver of its
    /// QPs; each starts with the first QP assigned to it).
    pub datamovers: u32,
    /// Number of completion event handlers.
    pub completion_handlers: u32,
}

impl DeviceAttr {
    fn new(config: &DeviceConfig, datamovers: u32, completion_handlers: u32) -> Self {
        DeviceAttr {
            fw_ver: env!("CARGO_PKG_VERSION").to_string(),
            vendor_id: 0,
            max_mr_size: 1 << 40,
            page_size: config.slice_size,
            max_qp: 1 << 16,
            max_qp_wr: 1 << 15,
            max_sge: 16,
            max_sge_rd: 1,
            max_inline_data: 256,
            max_cq: 1 << 16,
            max_cqe: 1 << 20,
            max_mr: 1 << 20,
            max_pd: 1 << 16,
            max_mw: 1 << 20,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            max_srq: 1 << 12,
            max_srq_wr: 1 << 15,
            max_srq_sge: 16,
            atomic_cap: true,
            max_fast_reg_page_list_len: 1 << 16,
            datamovers,
            completion_handlers,
        }
    }
}

/// An open software RDMA device. Cheap to clone (a shared handle); the device
/// and its threads go away when the last handle and the last object created
/// from it are dropped.
#[derive(Debug, Clone)]
pub struct Device {
    pub(crate) inner: Arc<DeviceInner>,
}

/// Shared state of a device.
#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) config: DeviceConfig,
    pub(crate) attr: DeviceAttr,
    pub(crate) stags: StagTable,
    pub(crate) events: AsyncEvents,
    handlers: Handlers,
    next_qp_num: AtomicU32,
    next_pd_id: AtomicU32,
    /// The engine threads, each started with the first QP assigned to it.
    threads: Threads,
}

/// Why a device could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// No device has this name.
    #[error("no softrdma device named {0:?} (the software device is {DEFAULT_DEVICE_NAME:?})")]
    NoSuchDevice(String),
    /// The configuration is not usable.
    #[error("invalid device configuration: {0}")]
    InvalidConfig(&'static str),
    /// A resource (thread, event fd) could not be created.
    #[error("cannot set up the device: {0}")]
    Io(#[from] std::io::Error),
}

impl Device {
    /// Opens the default software device with the default configuration.
    pub fn open_default() -> Result<Device, OpenError> {
        Device::open_with(DeviceConfig::default())
    }

    /// Opens the device called `name` (the software device answers to
    /// [`DEFAULT_DEVICE_NAME`]).
    pub fn open(name: &str) -> Result<Device, OpenError> {
        if name != DEFAULT_DEVICE_NAME {
            return Err(OpenError::NoSuchDevice(name.to_string()));
        }
        Device::open_default()
    }

    /// Opens a device with this configuration.
    pub fn open_with(config: DeviceConfig) -> Result<Device, OpenError> {
        if config.slice_size < 512 || !config.slice_size.is_power_of_two() {
            return Err(OpenError::InvalidConfig(
                "slice_size must be a power of two of at least 512",
            ));
        }
        // Read once: the affinity mask and the cgroup quota (a few files).
        let usable = crate::sys::io::usable_cpus();
        let engine_cpus = crate::datamover::engine_cpus(&config.datamover_cpus, &usable);
        let datamovers = engine_cpus.len();
        let handlers = Handlers::start(HandlersConfig {
            cpus: &config.handler_cpus,
            usable: &usable,
            policy: &config.handler_policy,
            pin_threads: config.pin_threads,
            spin: config.handler_spin,
        })?;
        let (slice, pin) = (config.slice_size, config.pin_threads);
        let attr = DeviceAttr::new(
            &config,
            u32::try_from(datamovers).unwrap_or(u32::MAX),
            u32::try_from(handlers.table().len()).unwrap_or(u32::MAX),
        );
        let events = AsyncEvents::new(AsyncEventQueue::with_capacity(config.async_event_capacity)?);
        Ok(Device {
            inner: Arc::new(DeviceInner {
                config,
                attr,
                stags: StagTable::new(),
                events,
                handlers,
                next_qp_num: AtomicU32::new(1),
                next_pd_id: AtomicU32::new(1),
                threads: Threads::new(engine_cpus, slice, pin),
            }),
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// Device attributes (`ibv_query_device`).
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// The configuration the device was opened with.
    pub fn config(&self) -> &DeviceConfig {
        &self.inner.config
    }

    /// The device's async event queue: QP errors, CQ overflow, SRQ limit,
    /// connection events (`ibv_get_async_event`). Its file descriptor is
    /// readable while an event is queued.
    pub fn async_events(&self) -> &AsyncEventQueue {
        &self.inner.events
    }

    /// Registers `callback` as the device's asynchronous event handler:
    /// from now on QP, CQ, SRQ and device events are delivered to it, in
    /// order, on the device's asynchronous event thread (started by the
    /// first call) instead of being queued on [`async_events`](Self::async_events).
    /// Events queued before stay queued. Replaces an earlier callback; must
    /// not be called from inside the callback.
    ///
    /// # Errors
    ///
    /// The thread could not be started.
    pub fn set_async_event_handler(
        &self,
        callback: impl FnMut(&AsyncEvent) + Send + 'static,
    ) -> std::io::Result<()> {
        self.inner.events.set_callback(Box::new(callback))
    }

    /// Removes the asynchronous event callback: later events are queued on
    /// [`async_events`](Self::async_events) again (as are events not yet
    /// handed to the callback).
    pub fn clear_async_event_handler(&self) {
        self.inner.events.clear_callback();
    }

    /// Asynchronous events delivered to callbacks so far.
    pub fn async_events_delivered(&self) -> u64 {
        self.inner.events.delivered()
    }

    /// The completion event handlers: identifier → CPU, in identifier
    /// order.
    pub fn handler_table(&self) -> Vec<(HandlerId, usize)> {
        self.inner.handlers.table()
    }

    /// The CPU of a completion event handler.
    pub fn handler_cpu(&self, id: HandlerId) -> Option<usize> {
        self.inner
            .handlers
            .table()
            .get(id.index())
            .map(|&(_, cpu)| cpu)
    }

    /// Statistics of the completion event handlers, in identifier order.
    pub fn handler_stats(&self) -> Vec<HandlerStats> {
        self.inner.handlers.stats()
    }

    /// Statistics of the datamover threads, one per engine thread (each
    /// starts with the first QP assigned to it: see
    /// [`DatamoverStats::running`](crate::DatamoverStats::running)).
    pub fn datamover_stats(&self) -> Vec<DatamoverStats> {
        self.inner.threads.stats()
    }

    /// The engine threads.
    pub(crate) fn threads(&self) -> &Threads {
        &self.inner.threads
    }

    /// The registration table of the device.
    pub(crate) fn stags(&self) -> &StagTable {
        &self.inner.stags
    }

    /// The async events of the device: `push` reports an event (to the
    /// callback if one is registered, else to the queue).
    pub(crate) fn events(&self) -> &AsyncEvents {
        &self.inner.events
    }

    /// The completion event handlers of the device.
    pub(crate) fn handlers(&self) -> &Handlers {
        &self.inner.handlers
    }

    /// A fresh QP number.
    pub(crate) fn alloc_qp_num(&self) -> u32 {
        self.inner.next_qp_num.fetch_add(1, Ordering::Relaxed)
    }

    /// A fresh protection domain identifier.
    pub(crate) fn alloc_pd_id(&self) -> u32 {
        self.inner.next_pd_id.fetch_add(1, Ordering::Relaxed)
    }
}
