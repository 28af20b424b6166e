//! Proxy QP offload: incoming requests served by a proxy thread, completions
//! kept in order.
//!
//! Some messages that arrive on a connection need no application attention
//! — a lock acquisition, a counter update, a small lookup — yet each one
//! would wake the application. A [`Proxy`] is a dedicated thread (optionally
//! pinned to its own CPU, the "proxy CPU") that runs an application handler
//! on the incoming messages a QP's [`ProxyFilter`] selects; everything else
//! flows to the application as usual.
//!
//! * **Setup.** Create the proxy ([`Proxy::start`]), its CQs
//!   ([`CqBuilder::proxy`](crate::CqBuilder::proxy)) and the QP on them, then
//!   make the QP a proxy QP while it is IDLE ([`QueuePair::attach_proxy`] or
//!   [`QueuePair::new_proxy`]) with a filter and a handler. A proxy QP whose
//!   CQ is not a proxy CQ of the same proxy is refused at setup
//!   ([`ProxySetupError`]).
//! * **Which messages.** Messages that consume a posted receive: the Send
//!   variants and RDMA Write with Immediate Data. The filter is evaluated
//!   once the message has fully arrived (on the receive path) and sees its
//!   RDMAP opcode, length, STag / Tagged Offset, its DDP/RDMAP header and the
//!   first bytes of its payload (see [`softrdma_proto::proxy`]). RDMA Read
//!   and atomic requests are answered by the engine itself and never wake
//!   the application, so they are not offered to proxies.
//! * **The handler** runs on the proxy thread with a [`ProxyContext`] — read
//!   and write registered memory of the QP's protection domain, local
//!   atomics, post replies on the same QP — and returns
//!   [`ProxyOutcome::Done`], [`ProxyOutcome::Partial`] or
//!   [`ProxyOutcome::NotHandled`]. If it declines, returns an error or
//!   panics, every effect it made through the context is rolled back
//!   (writes restored, atomics undone, replies never posted) and the message
//!   completes to the application as if it had never matched.
//! * **Completions in order.** Every completion of a proxy QP passes through
//!   the proxy's sequencer and carries its sequence number
//!   ([`WorkCompletion::proxy_seq`]). An offloaded message holds back every
//!   later completion until its handler returns; completions with nothing
//!   earlier outstanding are written at once by the thread that produced
//!   them. An offloaded message completes as [`WcOpcode::ProxyNoop`] (done)
//!   or with [`WcFlags::PROXY_PARTIAL`] and the handler's note (partially
//!   done), so the application accounts for it (and reposts its receive
//!   buffer) without acting on it. Replies a handler posts are the proxy's:
//!   their completions never reach the application's CQ (they do take send
//!   queue slots while outstanding).
//! * **Load protection.** When [`ProxyConfig::max_queue`] messages wait for
//!   the proxy, the filter switches to no-offload mode — matching messages
//!   go to the application — until the proxy has caught up (its queue is
//!   empty). Entries, messages passed in the mode and time spent in it are
//!   in [`ProxyStats`].
//! * **A stopped proxy.** After [`Proxy::shutdown`] (or when the last
//!   `Proxy` handle is dropped) the queued messages are still served; a
//!   message that later matches a filter has no proxy to go to: it is
//!   discarded — its receive completes with [`WcStatus::ProxyDiscarded`]
//!   and an [`AsyncEventKind::ProxyMismatch`] event is raised — never
//!   silently processed.
//!
//! ```
//! use softrdma_engine::proxy::{
//!     Criterion, Field, FilterEntry, MatchPolicy, Proxy, ProxyAttach, ProxyConfig, ProxyFilter,
//!     ProxyOutcome,
//! };
//! use softrdma_engine::{CompletionQueue, Device, QpInitAttr, QueuePair};
//!
//! let dev = Device::open_default()?;
//! let proxy = Proxy::start(&dev, ProxyConfig::default())?;
//! let cq = CompletionQueue::builder(&dev, 64).proxy(&proxy).build()?;
//! let pd = dev.alloc_pd();
//! // Sends whose payload starts with b'L' go to the proxy.
//! let filter = ProxyFilter::new(MatchPolicy::MatchesToProxy).entry(
//!     FilterEntry::any().and(Criterion::ternary(Field::Payload, 0, b"L", &[0xff])?),
//! );
//! let attach = ProxyAttach::new(&proxy, filter, |_ctx, _msg| Ok(ProxyOutcome::Done));
//! let qp = QueuePair::new_proxy(&pd, &QpInitAttr::new(&cq, &cq), attach)?;
//! assert!(qp.is_proxy());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::io;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use softrdma_proto::conn::Prepared;
use softrdma_proto::proxy::{Admission, LoadGuard, MessageView, Route, Sequencer};
pub use softrdma_proto::proxy::{
    Criterion, Field, FilterEntry, FilterError, MAX_MATCH_BYTES, MatchPolicy, OpcodeSet,
    ProxyFilter, Ternary,
};
use softrdma_wire::rdmap::Opcode;

use crate::device::Device;
use crate::event::{AsyncEvent, AsyncEventKind};
use crate::mr::{Access, LocalAccessError};
use crate::pd::ProtectionDomain;
use crate::qp::offload::CompletionRoute;
use crate::qp::{CreateQpError, PostSendError, QpInitAttr, QpInner, QueuePair};
use crate::state::QpState;
use crate::sys::io::pin_current_thread;
use crate::sys::mem::Memory;
use crate::wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{LocalSeg, SendWr};

/// How a proxy runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProxyConfig {
    /// Pin the proxy thread to this CPU (the "proxy CPU"); `None` leaves it
    /// to the scheduler.
    pub cpu: Option<usize>,
    /// Messages that may wait for the proxy before its filters switch to
    /// no-offload mode.
    pub max_queue: usize,
    /// How long the idle proxy thread polls its queue before it sleeps:
    /// lower hand-off latency for a CPU spent spinning. 0 sleeps at once.
    pub spin: Duration,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        ProxyConfig {
            cpu: None,
            max_queue: 1024,
            spin: Duration::ZERO,
        }
    }
}

impl ProxyConfig {
    /// With the thread pinned to `cpu`.
    #[must_use]
    pub fn cpu(mut self, cpu: usize) -> Self {
        self.cpu = Some(cpu);
        self
    }

    /// With this queue depth.
    #[must_use]
    pub fn max_queue(mut self, depth: usize) -> Self {
        self.max_queue = depth;
        self
    }

    /// Polling the queue for `spin` before sleeping.
    #[must_use]
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }
}

/// What a handler did with a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ProxyOutcome {
    /// Served completely: the application gets a [`WcOpcode::ProxyNoop`]
    /// completion.
    Done,
    /// Served in part: the application gets the message's normal completion
    /// flagged [`WcFlags::PROXY_PARTIAL`] with `note` in
    /// [`WorkCompletion::proxy_note`]. The handler's effects stay.
    Partial {
        /// What remains, in the application's own terms.
        note: u64,
    },
    /// Not served: effects are rolled back and the message completes to the
    /// application normally.
    NotHandled,
}

/// Why a [`ProxyContext`] memory operation was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyMemError {
    /// The lkey, protection domain, bounds or rights do not allow it.
    #[error(transparent)]
    Access(#[from] LocalAccessError),
    /// An atomic on an address that is not 8-byte aligned.
    #[error("atomic at {addr:#x} is not 8-byte aligned")]
    Misaligned {
        /// The address.
        addr: u64,
    },
    /// More than 4 GiB in one access.
    #[error("access of {len} bytes is too long")]
    TooLong {
        /// The length asked for.
        len: usize,
    },
}

/// A handler failure: the message goes to the application and the
/// handler's effects are rolled back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// A memory access through the context failed.
    #[error("proxy handler memory access: {0}")]
    Memory(#[from] ProxyMemError),
    /// A reply could not be posted.
    #[error("proxy handler reply: {0}")]
    Post(#[from] PostSendError),
    /// The handler's own reason.
    #[error("proxy handler failed: {0}")]
    Failed(String),
}

impl HandlerError {
    /// A failure with this reason.
    pub fn failed(why: impl std::fmt::Display) -> Self {
        HandlerError::Failed(why.to_string())
    }
}

/// A proxy handler: runs on the proxy thread for each offloaded message.
pub type ProxyHandler = Box<
    dyn FnMut(&mut ProxyContext<'_>, &ProxyMessage<'_>) -> Result<ProxyOutcome, HandlerError>
        + Send,
>;

// Defined beside the QP, whose `CreateQpError::Proxy` carries it.
pub use crate::qp::offload::ProxySetupError;

/// Proxy counters ([`Proxy::stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ProxyStats {
    /// Messages a handler served completely.
    pub offloaded: u64,
    /// Messages a handler served in part.
    pub partial: u64,
    /// Messages a handler declined ([`ProxyOutcome::NotHandled`]).
    pub declined: u64,
    /// Messages whose handler returned an error or panicked.
    pub failed: u64,
    /// Messages of proxy QPs that went to the application directly: not
    /// matched, or matched in no-offload mode.
    pub passed_through: u64,
    /// Completions written later than they were produced because an earlier
    /// offloaded message was still with the proxy.
    pub reordered: u64,
    /// Matching messages discarded because the proxy no longer runs.
    pub mismatched: u64,
    /// Times the filters switched to no-offload mode.
    pub no_offload_entries: u64,
    /// Matching messages passed to the application in no-offload mode.
    pub no_offload_passed: u64,
    /// Time spent in no-offload mode (including the current stretch).
    pub no_offload_time: Duration,
    /// In no-offload mode now.
    pub no_offload: bool,
    /// Messages waiting for (or with) the proxy now.
    pub queued: usize,
    /// Most messages ever waiting at once.
    pub max_queued: usize,
    /// Replies handlers posted.
    pub replies_posted: u64,
    /// Replies that could not be posted or completed in error.
    pub reply_errors: u64,
    /// Handler effects undone (writes and atomics).
    pub rolled_back: u64,
    /// Atomic compare-and-swap effects that could not be undone because the
    /// word changed again meanwhile.
    pub rollback_conflicts: u64,
}

#[derive(Debug, Default)]
struct Counters {
    offloaded: AtomicU64,
    partial: AtomicU64,
    declined: AtomicU64,
    failed: AtomicU64,
    passed_through: AtomicU64,
    reordered: AtomicU64,
    mismatched: AtomicU64,
    no_offload_passed: AtomicU64,
    replies_posted: AtomicU64,
    reply_errors: AtomicU64,
    rolled_back: AtomicU64,
    rollback_conflicts: AtomicU64,
}

fn inc(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

#[derive(Debug)]
struct GuardState {
    guard: LoadGuard,
    since: Option<Instant>,
    total: Duration,
}

/// One offloaded message on its way to the proxy thread.
struct Job {
    qp: Arc<QpInner>,
    seq: u64,
    wc: WorkCompletion,
    solicited: bool,
    meta: MsgMeta,
}

/// State shared by the proxy thread, its handles and its QPs.
struct ProxyShared {
    id: u32,
    cpu: Option<usize>,
    /// The queue to the thread; `None` once shut down. Submitters hold the
    /// read lock while sending, so no message slips in after shutdown.
    gate: RwLock<Option<mpsc::Sender<Job>>>,
    queued: AtomicUsize,
    max_queued: AtomicUsize,
    no_offload: AtomicBool,
    guard: Mutex<GuardState>,
    counters: Counters,
    last_failure: Mutex<Option<String>>,
}

impl ProxyShared {
    /// Whether a message may be offloaded now (load protection).
    fn admit(&self) -> bool {
        let queued = self.queued.load(Ordering::Acquire);
        let mut g = self.guard.lock();
        let was = g.guard.is_no_offload();
        match g.guard.admit(queued) {
            Admission::Offload => {
                if was {
                    Self::end_no_offload(&mut g, &self.no_offload);
                }
                true
            }
            Admission::NoOffload { entered } => {
                if entered {
                    g.since = Some(crate::sys::clock::now());
                    self.no_offload.store(true, Ordering::Release);
                }
                false
            }
        }
    }

    fn end_no_offload(g: &mut GuardState, flag: &AtomicBool) {
        if let Some(t) = g.since.take() {
            g.total += crate::sys::clock::elapsed(t);
        }
        flag.store(false, Ordering::Release);
    }

    /// The proxy finished a message; `left` remain.
    fn finished_one(&self) {
        let left = self.queued.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0 && self.no_offload.load(Ordering::Acquire) {
            let mut g = self.guard.lock();
            if g.guard.drained(self.queued.load(Ordering::Acquire)) {
                Self::end_no_offload(&mut g, &self.no_offload);
            }
        }
    }

    fn stats(&self) -> ProxyStats {
        let c = &self.counters;
        let g = self.guard.lock();
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            offloaded: ld(&c.offloaded),
            partial: ld(&c.partial),
            declined: ld(&c.declined),
            failed: ld(&c.failed),
            passed_through: ld(&c.passed_through),
            reordered: ld(&c.reordered),
            mismatched: ld(&c.mismatched),
            no_offload_entries: g.guard.entries(),
            no_offload_passed: ld(&c.no_offload_passed),
            no_offload_time: g.total + g.since.map_or(Duration::ZERO, crate::sys::clock::elapsed),
            no_offload: g.guard.is_no_offload(),
            queued: self.queued.load(Ordering::Relaxed),
            max_queued: self.max_queued.load(Ordering::Relaxed),
            replies_posted: ld(&c.replies_posted),
            reply_errors: ld(&c.reply_errors),
            rolled_back: ld(&c.rolled_back),
            rollback_conflicts: ld(&c.rollback_conflicts),
        }
    }
}

/// Owns the proxy thread: the last [`Proxy`] handle going away stops it.
struct ProxyOwner {
    shared: Arc<ProxyShared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl ProxyOwner {
    fn shutdown(&self) {
        // Closing the queue ends the thread once it has served what was
        // queued.
        drop(self.shared.gate.write().take());
        if let Some(t) = self.thread.lock().take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

impl Drop for ProxyOwner {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A proxy: a thread that serves the messages proxy QPs offload to it.
/// Cloning gives another handle; the thread stops when
/// [`shutdown`](Self::shutdown) is called or the last handle is dropped.
#[derive(Clone)]
pub struct Proxy {
    owner: Arc<ProxyOwner>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("id", &self.id())
            .field("cpu", &self.cpu())
            .field("running", &self.is_running())
            .finish_non_exhaustive()
    }
}

static NEXT_PROXY_ID: AtomicU32 = AtomicU32::new(1);

impl crate::cq::CqBuilder<'_> {
    /// Makes the CQ a proxy CQ of `proxy`: the CQ that proxy QPs served by
    /// `proxy` must use (see [`crate::proxy`]).
    pub fn proxy(mut self, proxy: &Proxy) -> Self {
        self.proxy = Some(proxy.id());
        self
    }
}

impl Proxy {
    /// Starts a proxy thread.
    ///
    /// # Errors
    ///
    /// `InvalidInput` if `config.cpu` is not a CPU the process may use; the
    /// error of spawning the thread.
    pub fn start(device: &Device, config: ProxyConfig) -> io::Result<Proxy> {
        if let Some(cpu) = config.cpu
            && !crate::sys::io::allowed_cpus().contains(&cpu)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("proxy CPU {cpu} is not available to this process"),
            ));
        }
        let _ = device;
        let (tx, rx) = mpsc::channel::<Job>();
        let id = NEXT_PROXY_ID.fetch_add(1, Ordering::Relaxed);
        let shared = Arc::new(ProxyShared {
            id,
            cpu: config.cpu,
            gate: RwLock::new(Some(tx)),
            queued: AtomicUsize::new(0),
            max_queued: AtomicUsize::new(0),
            no_offload: AtomicBool::new(false),
            guard: Mutex::new(GuardState {
                guard: LoadGuard::new(config.max_queue),
                since: None,
                total: Duration::ZERO,
            }),
            counters: Counters::default(),
            last_failure: Mutex::new(None),
        });
        let thread_shared = Arc::clone(&shared);
        let spin = config.spin;
        let thread = std::thread::Builder::new()
            .name(format!("softrdma-proxy-{id}"))
            .spawn(move || {
                if let Some(cpu) = thread_shared.cpu {
                    let _ = pin_current_thread(cpu);
                }
                let mut to_kick: Vec<Arc<QpInner>> = Vec::new();
                while let Some(first) = next_job(&rx, spin) {
                    // Serve what is already queued too (up to a batch),
                    // then send the replies of the batch together.
                    let mut job = Some(first);
                    let mut n = 0;
                    while let Some(j) = job.take() {
                        if let Some(qp) = serve(&thread_shared, j)
                            && !to_kick.iter().any(|q| Arc::ptr_eq(q, &qp))
                        {
                            to_kick.push(qp);
                        }
                        n += 1;
                        if n < BATCH {
                            job = rx.try_recv().ok();
                        }
                    }
                    for qp in to_kick.drain(..) {
                        qp.kick();
                    }
                }
            })?;
        Ok(Proxy {
            owner: Arc::new(ProxyOwner {
                shared,
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// The proxy's id (what [`CompletionQueue::proxy_id`] reports for its
    /// CQs).
    ///
    /// [`CompletionQueue::proxy_id`]: crate::CompletionQueue::proxy_id
    pub fn id(&self) -> u32 {
        self.owner.shared.id
    }

    /// The CPU the thread is pinned to.
    pub fn cpu(&self) -> Option<usize> {
        self.owner.shared.cpu
    }

    /// Whether the thread still accepts messages.
    pub fn is_running(&self) -> bool {
        self.owner.shared.gate.read().is_some()
    }

    /// Whether the filters are in no-offload mode now.
    pub fn is_no_offload(&self) -> bool {
        self.owner.shared.no_offload.load(Ordering::Acquire)
    }

    /// The counters.
    pub fn stats(&self) -> ProxyStats {
        self.owner.shared.stats()
    }

    /// The reason of the last handler failure (error or panic message).
    pub fn last_failure(&self) -> Option<String> {
        self.owner.shared.last_failure.lock().clone()
    }

    /// Stops the proxy once it has served the messages already queued (it
    /// waits for that). Messages that match a filter afterwards are
    /// discarded with [`WcStatus::ProxyDiscarded`] and an
    /// [`AsyncEventKind::ProxyMismatch`] event.
    pub fn shutdown(&self) {
        self.owner.shutdown();
    }
}

/// What the receive path knows of a message for the proxy filter and
/// handler.
#[derive(Debug)]
pub(crate) struct MsgMeta {
    opcode: Opcode,
    header: [u8; 18],
    header_len: usize,
    stag: Option<u32>,
    to: Option<u64>,
    imm: Option<u32>,
    /// Bytes the Write of a Write with Immediate placed.
    written: u64,
    data: MsgData,
}

#[derive(Debug)]
enum MsgData {
    /// A Send: the bytes are in the receive buffer.
    Recv(Vec<LocalSeg>),
    /// A Write with Immediate: the bytes are at the Write's STag/TO.
    Tagged,
    /// Nothing known.
    None,
}

impl MsgMeta {
    /// A Send (any variant); `inv` is a Send with Invalidate's STag.
    pub(crate) fn send(
        opcode: Opcode,
        header: [u8; 18],
        segs: Vec<LocalSeg>,
        inv: Option<u32>,
    ) -> MsgMeta {
        MsgMeta {
            opcode,
            header,
            header_len: 18,
            stag: inv,
            to: None,
            imm: None,
            written: 0,
            data: MsgData::Recv(segs),
        }
    }

    /// The RDMA Write of a Write with Immediate Data.
    pub(crate) fn write(stag: u32, to: u64, len: u64, header: &[u8]) -> MsgMeta {
        let mut h = [0u8; 18];
        let n = header.len().min(18);
        h[..n].copy_from_slice(&header[..n]);
        MsgMeta {
            opcode: Opcode::RdmaWrite,
            header: h,
            header_len: n,
            stag: Some(stag),
            to: Some(to),
            imm: None,
            written: len,
            data: MsgData::Tagged,
        }
    }

    /// A Write with Immediate Data whose Write was not seen.
    pub(crate) fn empty_write() -> MsgMeta {
        MsgMeta {
            opcode: Opcode::RdmaWrite,
            header: [0; 18],
            header_len: 0,
            stag: None,
            to: None,
            imm: None,
            written: 0,
            data: MsgData::None,
        }
    }

    /// With immediate data.
    pub(crate) fn with_imm(mut self, imm: u32) -> MsgMeta {
        self.imm = Some(imm);
        self
    }

    /// What the protocol core reported of a receive
    /// (`Connection::poll_completion_with_info`, `Config::message_info`)
    /// as the receive path's `MsgMeta` (`imm`: the completion's immediate
    /// data).
    pub(crate) fn from_core(
        info: softrdma_proto::conn::MsgInfo<Arc<Memory>>,
        imm: Option<u32>,
    ) -> MsgMeta {
        use softrdma_proto::conn::MsgInfo;
        let meta = match info {
            MsgInfo::Send {
                opcode,
                header,
                segs,
                inv,
            } => MsgMeta::send(
                opcode,
                header,
                segs.into_iter()
                    .map(|s| LocalSeg {
                        mem: s.region,
                        offset: s.offset,
                        len: s.len,
                    })
                    .collect(),
                inv,
            ),
            MsgInfo::Write { write: Some(w) } => MsgMeta::write(w.stag, w.to, w.len, &w.header),
            MsgInfo::Write { write: None } => MsgMeta::empty_write(),
        };
        match imm {
            Some(imm) => meta.with_imm(imm),
            None => meta,
        }
    }

    /// Payload length: the bytes received by a Send (`wc.byte_len`), the
    /// bytes written by a Write with Immediate.
    fn payload_len(&self, wc: &WorkCompletion) -> u64 {
        match self.data {
            MsgData::Recv(_) => wc.byte_len.into(),
            MsgData::Tagged | MsgData::None => self.written,
        }
    }

    /// Copies payload bytes from `off` into `buf`; the payload is `len`
    /// bytes long. Returns the bytes copied.
    fn read_payload(&self, qp: &QpInner, len: u64, off: u64, buf: &mut [u8]) -> usize {
        let Some(avail) = len.checked_sub(off) else {
            return 0;
        };
        let n = buf.len().min(usize::try_from(avail).unwrap_or(usize::MAX));
        match &self.data {
            MsgData::Recv(segs) => {
                let mut skip = usize::try_from(off).unwrap_or(usize::MAX);
                let mut done = 0;
                for s in segs {
                    if done == n {
                        break;
                    }
                    if skip >= s.len {
                        skip -= s.len;
                        continue;
                    }
                    let k = (s.len - skip).min(n - done);
                    if !s.mem.copy_out(s.offset + skip, &mut buf[done..done + k]) {
                        break;
                    }
                    done += k;
                    skip = 0;
                }
                done
            }
            MsgData::Tagged => {
                let (Some(stag), Some(to)) = (self.stag, self.to) else {
                    return 0;
                };
                let t = qp.device.stags().remote(
                    stag,
                    qp.pd.id(),
                    Access::REMOTE_WRITE,
                    to.wrapping_add(off),
                    n as u64,
                );
                match t {
                    Ok(t) if t.mem.copy_out(t.offset, &mut buf[..n]) => n,
                    _ => 0,
                }
            }
            MsgData::None => 0,
        }
    }
}

/// A message handed to a proxy handler.
pub struct ProxyMessage<'a> {
    seq: u64,
    wc: &'a WorkCompletion,
    meta: &'a MsgMeta,
    qp: &'a QpInner,
}

impl std::fmt::Debug for ProxyMessage<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyMessage")
            .field("seq", &self.seq)
            .field("opcode", &self.meta.opcode)
            .field("len", &self.wc.byte_len)
            .field("recv_wr_id", &self.wc.wr_id)
            .finish_non_exhaustive()
    }
}

impl ProxyMessage<'_> {
    /// The completion sequence number the message's completion will carry.
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// RDMAP opcode: a Send variant, or [`Opcode::RdmaWrite`] for a Write
    /// with Immediate Data.
    pub fn opcode(&self) -> Opcode {
        self.meta.opcode
    }

    /// The QP the message arrived on.
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num
    }

    /// Payload length: the bytes of a Send, or the bytes the Write of a
    /// Write with Immediate placed.
    pub fn len(&self) -> usize {
        usize::try_from(self.meta.payload_len(self.wc)).unwrap_or(usize::MAX)
    }

    /// Whether the payload is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The `wr_id` of the receive the message consumed.
    pub fn recv_wr_id(&self) -> u64 {
        self.wc.wr_id
    }

    /// Immediate data, if the message carried some.
    pub fn immediate(&self) -> Option<u32> {
        self.meta.imm
    }

    /// The message's STag (Write with Immediate, or Send with Invalidate).
    pub fn stag(&self) -> Option<u32> {
        self.meta.stag
    }

    /// The Tagged Offset a Write with Immediate started at.
    pub fn tagged_offset(&self) -> Option<u64> {
        self.meta.to
    }

    /// Whether the message asked for a solicited event.
    pub fn solicited(&self) -> bool {
        self.wc.flags.contains(WcFlags::SOLICITED)
    }

    /// The DDP/RDMAP header of the message's first segment.
    pub fn header(&self) -> &[u8] {
        &self.meta.header[..self.meta.header_len]
    }

    /// Copies payload bytes from `offset` into `buf`; returns how many.
    pub fn read_payload(&self, offset: usize, buf: &mut [u8]) -> usize {
        self.meta
            .read_payload(self.qp, self.meta.payload_len(self.wc), offset as u64, buf)
    }

    /// The whole payload.
    pub fn payload(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.len()];
        let n = self.read_payload(0, &mut v);
        v.truncate(n);
        v
    }
}

/// An effect of a handler, with what undoes it.
enum Undo {
    Bytes {
        mem: Arc<Memory>,
        offset: usize,
        old: Vec<u8>,
    },
    Add {
        mem: Arc<Memory>,
        offset: usize,
        add: u64,
    },
    Swap {
        mem: Arc<Memory>,
        offset: usize,
        original: u64,
        swapped_in: u64,
    },
}

/// What a handler may do: memory of the QP's protection domain, local
/// atomics, replies on the QP. Every effect is recorded so that it can be
/// rolled back if the handler declines or fails.
pub struct ProxyContext<'a> {
    qp: &'a QpInner,
    undo: Vec<Undo>,
    replies: Vec<Reply>,
}

/// A reply checked by [`ProxyContext::post_send`]
/// (`Connection::prepare_send`), posted at commit.
type Reply = Prepared<Arc<Memory>>;

impl std::fmt::Debug for ProxyContext<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyContext")
            .field("qp_num", &self.qp.qp_num)
            .field("effects", &self.undo.len())
            .field("replies", &self.replies.len())
            .finish()
    }
}

impl ProxyContext<'_> {
    /// The QP the message arrived on.
    pub fn qp_num(&self) -> u32 {
        self.qp.qp_num
    }

    fn local(
        &self,
        lkey: u32,
        addr: u64,
        len: usize,
        write: bool,
    ) -> Result<LocalSeg, ProxyMemError> {
        let n = u32::try_from(len).map_err(|_| ProxyMemError::TooLong { len })?;
        Ok(self
            .qp
            .device
            .stags()
            .local(lkey, self.qp.pd.id(), addr, n, write)?)
    }

    fn cell(&self, lkey: u32, addr: u64) -> Result<LocalSeg, ProxyMemError> {
        let seg = self.local(lkey, addr, 8, true)?;
        if seg.mem.atomic_u64(seg.offset).is_none() {
            return Err(ProxyMemError::Misaligned { addr });
        }
        Ok(seg)
    }

    /// Reads `buf.len()` bytes at `addr` of region `lkey`.
    pub fn read(&self, lkey: u32, addr: u64, buf: &mut [u8]) -> Result<(), ProxyMemError> {
        let seg = self.local(lkey, addr, buf.len(), false)?;
        seg.mem.copy_out(seg.offset, buf);
        Ok(())
    }

    /// Reads the 64-bit word at `addr` (8-byte aligned) atomically.
    pub fn read_u64(&self, lkey: u32, addr: u64) -> Result<u64, ProxyMemError> {
        let seg = self.local(lkey, addr, 8, false)?;
        let cell = seg
            .mem
            .atomic_u64(seg.offset)
            .ok_or(ProxyMemError::Misaligned { addr })?;
        Ok(cell.load(Ordering::SeqCst))
    }

    /// Writes `data` at `addr` of region `lkey` (needs local write access).
    pub fn write(&mut self, lkey: u32, addr: u64, data: &[u8]) -> Result<(), ProxyMemError> {
        let seg = self.local(lkey, addr, data.len(), true)?;
        let mut old = vec![0u8; data.len()];
        seg.mem.copy_out(seg.offset, &mut old);
        seg.mem.copy_in(seg.offset, data);
        self.undo.push(Undo::Bytes {
            mem: seg.mem,
            offset: seg.offset,
            old,
        });
        Ok(())
    }

    /// Atomically adds `add` to the 64-bit word at `addr`; returns the
    /// original value. Atomic with respect to remote atomics on the word.
    pub fn fetch_add(&mut self, lkey: u32, addr: u64, add: u64) -> Result<u64, ProxyMemError> {
        let seg = self.cell(lkey, addr)?;
        let cell = seg
            .mem
            .atomic_u64(seg.offset)
            .ok_or(ProxyMemError::Misaligned { addr })?;
        let original = cell.fetch_add(add, Ordering::SeqCst);
        self.undo.push(Undo::Add {
            mem: seg.mem.clone(),
            offset: seg.offset,
            add,
        });
        Ok(original)
    }

    /// Atomically replaces the 64-bit word at `addr` with `swap` if it equals
    /// `compare`; returns the original value.
    pub fn compare_swap(
        &mut self,
        lkey: u32,
        addr: u64,
        compare: u64,
        swap: u64,
    ) -> Result<u64, ProxyMemError> {
        let seg = self.cell(lkey, addr)?;
        let cell = seg
            .mem
            .atomic_u64(seg.offset)
            .ok_or(ProxyMemError::Misaligned { addr })?;
        let original =
            match cell.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            };
        if original == compare && compare != swap {
            self.undo.push(Undo::Swap {
                mem: seg.mem.clone(),
                offset: seg.offset,
                original,
                swapped_in: swap,
            });
        }
        Ok(original)
    }

    /// Posts a reply on the QP — checked now, sent only if the handler
    /// returns [`ProxyOutcome::Done`] or [`ProxyOutcome::Partial`]. Its
    /// completion is the proxy's, not the application's.
    pub fn post_send(&mut self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        let p = self.qp.core_prepare_send(wr)?;
        self.replies.push(p);
        Ok(())
    }

    /// Effects recorded so far (writes and atomics; replies not counted).
    pub fn recorded_effects(&self) -> usize {
        self.undo.len()
    }

    /// Queues the replies (the caller starts transmission); true if any.
    fn commit(self, shared: &ProxyShared) -> bool {
        let qp = self.qp;
        let mut any = false;
        for r in self.replies {
            if qp.core_post_prepared(r) {
                any = true;
                inc(&shared.counters.replies_posted);
            } else {
                inc(&shared.counters.reply_errors);
            }
        }
        any
    }

    fn rollback(self, shared: &ProxyShared) {
        for u in self.undo.into_iter().rev() {
            inc(&shared.counters.rolled_back);
            match u {
                Undo::Bytes { mem, offset, old } => {
                    mem.copy_in(offset, &old);
                }
                Undo::Add { mem, offset, add } => {
                    if let Some(c) = mem.atomic_u64(offset) {
                        c.fetch_sub(add, Ordering::SeqCst);
                    }
                }
                Undo::Swap {
                    mem,
                    offset,
                    original,
                    swapped_in,
                } => {
                    let undone = mem.atomic_u64(offset).is_some_and(|c| {
                        c.compare_exchange(swapped_in, original, Ordering::SeqCst, Ordering::SeqCst)
                            .is_ok()
                    });
                    if !undone {
                        inc(&shared.counters.rollback_conflicts);
                    }
                }
            }
        }
    }
}

/// A completion waiting in a proxy QP's sequencer.
#[derive(Debug)]
struct Pending {
    wc: WorkCompletion,
    send: bool,
    solicited: bool,
}

/// A QP's proxy attachment: filter, handler, completion order.
pub(crate) struct ProxyLink {
    shared: Arc<ProxyShared>,
    filter: ProxyFilter,
    prefix: usize,
    recycle: bool,
    handler: Mutex<ProxyHandler>,
    seq: Mutex<Sequencer<Pending>>,
}

impl std::fmt::Debug for ProxyLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyLink")
            .field("proxy", &self.shared.id)
            .field("filter", &self.filter)
            .finish_non_exhaustive()
    }
}

impl ProxyLink {
    /// Delivers a completion of the QP in order; true if a CQ overflowed.
    pub(crate) fn deliver(
        &self,
        qp: &QpInner,
        wc: WorkCompletion,
        send: bool,
        solicited: bool,
    ) -> bool {
        let mut s = self.seq.lock();
        if s.pending() > 0 {
            inc(&self.shared.counters.reordered);
        }
        s.push(Pending {
            wc,
            send,
            solicited,
        });
        Self::flush(qp, &mut s)
    }

    /// Writes the completions that are now in order.
    fn flush(qp: &QpInner, s: &mut Sequencer<Pending>) -> bool {
        let mut lost = false;
        while let Some((seq, p)) = s.pop_ready() {
            let mut wc = p.wc;
            wc.proxy_seq = seq;
            let cq = if p.send { &qp.send_cq } else { &qp.recv_cq };
            if cq.push(wc, p.solicited).is_err() {
                lost = true;
            }
        }
        lost
    }

    /// Fills the reserved completion `seq`.
    fn fill(&self, qp: &QpInner, seq: u64, wc: WorkCompletion, solicited: bool) {
        let lost = {
            let mut s = self.seq.lock();
            let _ = s.fill(
                seq,
                Pending {
                    wc,
                    send: false,
                    solicited,
                },
            );
            Self::flush(qp, &mut s)
        };
        if lost {
            qp.cq_overflow();
        }
    }

    /// A proxy-owned reply completed.
    pub(crate) fn reply_completed(&self, status: WcStatus) {
        if !status.is_success() {
            inc(&self.shared.counters.reply_errors);
        }
    }

    /// A completion the protocol core produced for this proxy QP (`wc` is
    /// its verbs form, `info` what a successful receive carried): a reply's
    /// goes to the proxy, a successful receive to the filter, everything
    /// else in order to the CQs. True if a CQ overflowed.
    pub(crate) fn core_completion(
        &self,
        qp: &QpInner,
        c: &softrdma_proto::types::Completion,
        wc: WorkCompletion,
        info: Option<softrdma_proto::conn::MsgInfo<Arc<Memory>>>,
    ) -> bool {
        use softrdma_proto::types::CqKind;
        match (c.cq, info) {
            (CqKind::Send, _) if c.internal => {
                self.reply_completed(wc.status);
                false
            }
            (CqKind::Send, _) => self.deliver(qp, wc, true, false),
            (CqKind::Recv, Some(info)) => {
                self.on_message(qp, wc, c.solicited, MsgMeta::from_core(info, c.imm));
                false
            }
            (CqKind::Recv, None) => self.deliver(qp, wc, false, c.solicited),
        }
    }

    /// A message that consumed a receive has fully arrived: filter it, then
    /// offload it or complete it normally.
    pub(crate) fn on_message(
        &self,
        qp: &QpInner,
        wc: WorkCompletion,
        solicited: bool,
        meta: MsgMeta,
    ) {
        let mut prefix = [0u8; MAX_MATCH_BYTES];
        let len = meta.payload_len(&wc);
        let want = usize::try_from(len).map_or(self.prefix, |l| l.min(self.prefix));
        let n = meta.read_payload(qp, len, 0, &mut prefix[..want]);
        let view = MessageView {
            opcode: meta.opcode,
            len,
            stag: meta.stag,
            to: meta.to,
            header: &meta.header[..meta.header_len],
            payload: &prefix[..n],
        };
        let c = &self.shared.counters;
        if self.filter.route(&view) == Route::Application {
            inc(&c.passed_through);
            qp.complete_recv(wc, solicited);
            return;
        }
        let Some(qp_arc) = qp.self_weak.upgrade() else {
            inc(&c.passed_through);
            qp.complete_recv(wc, solicited);
            return;
        };
        let gate = self.shared.gate.read();
        let Some(tx) = gate.as_ref() else {
            drop(gate);
            inc(&c.mismatched);
            qp.device
                .events()
                .push(AsyncEvent::qp(AsyncEventKind::ProxyMismatch, qp.qp_num));
            let mut w = wc;
            w.status = WcStatus::ProxyDiscarded;
            qp.complete_recv(w, solicited);
            return;
        };
        if !self.shared.admit() {
            drop(gate);
            inc(&c.passed_through);
            inc(&c.no_offload_passed);
            qp.complete_recv(wc, solicited);
            return;
        }
        let seq = self.seq.lock().reserve();
        let q = self.shared.queued.fetch_add(1, Ordering::AcqRel) + 1;
        self.shared.max_queued.fetch_max(q, Ordering::Relaxed);
        let job = Job {
            qp: qp_arc,
            seq,
            wc,
            solicited,
            meta,
        };
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // Cannot happen while the gate is open; never lose the message.
            drop(gate);
            self.shared.queued.fetch_sub(1, Ordering::AcqRel);
            self.fill(qp, seq, job.wc, job.solicited);
        }
    }
}

/// The QP's completions go through its proxy link (one indirect call per
/// completion of a proxy QP, where it was a direct one).
impl CompletionRoute for ProxyLink {
    fn deliver(&self, qp: &QpInner, wc: WorkCompletion, send: bool, solicited: bool) -> bool {
        ProxyLink::deliver(self, qp, wc, send, solicited)
    }

    fn core_completion(
        &self,
        qp: &QpInner,
        c: &softrdma_proto::types::Completion,
        wc: WorkCompletion,
        info: Option<softrdma_proto::conn::MsgInfo<Arc<Memory>>>,
    ) -> bool {
        ProxyLink::core_completion(self, qp, c, wc, info)
    }
}

impl ProxyLink {
    /// The proxy link of a proxy QP.
    fn of(qp: &QpInner) -> Option<&ProxyLink> {
        let route: &dyn std::any::Any = &**qp.proxy.get()?;
        route.downcast_ref()
    }
}

/// The next message for the proxy thread: polled for `spin`, then waited
/// for; `None` once the queue is closed and empty.
fn next_job(rx: &mpsc::Receiver<Job>, spin: Duration) -> Option<Job> {
    match rx.try_recv() {
        Ok(job) => return Some(job),
        Err(mpsc::TryRecvError::Disconnected) => return None,
        Err(mpsc::TryRecvError::Empty) => {}
    }
    if !spin.is_zero() {
        let until = crate::sys::clock::now() + spin;
        while crate::sys::clock::now() < until {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) => std::hint::spin_loop(),
            }
        }
    }
    rx.recv().ok()
}

/// Messages the proxy thread serves before it sends their replies.
const BATCH: usize = 32;

/// Runs the handler on one offloaded message (proxy thread). Returns the
/// QP if replies were queued on it (to be sent by the caller).
fn serve(shared: &ProxyShared, job: Job) -> Option<Arc<QpInner>> {
    let Job {
        qp,
        seq,
        wc,
        solicited,
        meta,
    } = job;
    let Some(link) = ProxyLink::of(&qp) else {
        shared.finished_one();
        return None;
    };
    let msg = ProxyMessage {
        seq,
        wc: &wc,
        meta: &meta,
        qp: &qp,
    };
    let mut ctx = ProxyContext {
        qp: &qp,
        undo: Vec::new(),
        replies: Vec::new(),
    };
    let result = {
        let mut h = link.handler.lock();
        catch_unwind(AssertUnwindSafe(|| (h)(&mut ctx, &msg)))
    };
    let c = &shared.counters;
    let mut replied = false;
    let out = match result {
        Ok(Ok(ProxyOutcome::Done)) => {
            replied = ctx.commit(shared);
            inc(&c.offloaded);
            let mut w = WorkCompletion {
                opcode: WcOpcode::ProxyNoop,
                ..wc
            };
            if link.recycle
                && let MsgData::Recv(segs) = meta.data
                && qp.core_repost_recv(wc.wr_id, segs)
            {
                w.flags = w.flags | WcFlags::PROXY_RECYCLED;
            }
            w
        }
        Ok(Ok(ProxyOutcome::Partial { note })) => {
            replied = ctx.commit(shared);
            inc(&c.partial);
            let mut w = wc;
            w.flags = w.flags | WcFlags::PROXY_PARTIAL;
            w.proxy_note = note;
            w
        }
        Ok(Ok(ProxyOutcome::NotHandled)) => {
            ctx.rollback(shared);
            inc(&c.declined);
            wc
        }
        Ok(Err(e)) => {
            ctx.rollback(shared);
            inc(&c.failed);
            *shared.last_failure.lock() = Some(e.to_string());
            wc
        }
        Err(panic) => {
            ctx.rollback(shared);
            inc(&c.failed);
            let why = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "handler panicked".to_string());
            *shared.last_failure.lock() = Some(format!("handler panicked: {why}"));
            wc
        }
    };
    link.fill(&qp, seq, out, solicited);
    shared.finished_one();
    replied.then_some(qp)
}

/// Makes a QP a proxy QP: the proxy, the filter and the handler.
pub struct ProxyAttach {
    proxy: Proxy,
    filter: ProxyFilter,
    handler: ProxyHandler,
    recycle: bool,
}

impl std::fmt::Debug for ProxyAttach {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyAttach")
            .field("proxy", &self.proxy.id())
            .field("filter", &self.filter)
            .finish_non_exhaustive()
    }
}

impl ProxyAttach {
    /// Serve messages that `filter` routes to the proxy with `handler`.
    pub fn new(
        proxy: &Proxy,
        filter: ProxyFilter,
        handler: impl FnMut(
            &mut ProxyContext<'_>,
            &ProxyMessage<'_>,
        ) -> Result<ProxyOutcome, HandlerError>
        + Send
        + 'static,
    ) -> ProxyAttach {
        ProxyAttach {
            proxy: proxy.clone(),
            filter,
            handler: Box::new(handler),
            recycle: false,
        }
    }

    /// The proxy reposts the receive buffer of every Send it serves
    /// completely, at the end of the QP's receive queue, before writing the
    /// no-op completion (flagged [`WcFlags::PROXY_RECYCLED`]): the
    /// application then need not wake to keep receives posted for offloaded
    /// traffic. Not done for QPs on an SRQ or no longer receiving (the
    /// completion then lacks the flag).
    #[must_use]
    pub fn recycle_receives(mut self) -> ProxyAttach {
        self.recycle = true;
        self
    }
}

impl QueuePair {
    /// Creates a QP (in IDLE) and makes it a proxy QP.
    ///
    /// # Errors
    ///
    /// As [`QueuePair::new`], and [`CreateQpError::Proxy`] if the CQs are
    /// not proxy CQs of the proxy or the proxy is shut down.
    pub fn new_proxy(
        pd: &ProtectionDomain,
        attr: &QpInitAttr,
        attach: ProxyAttach,
    ) -> Result<QueuePair, CreateQpError> {
        let qp = QueuePair::new(pd, attr)?;
        qp.attach_proxy(attach)?;
        Ok(qp)
    }

    /// Makes this IDLE QP a proxy QP: from now on the messages its filter
    /// selects are served by the proxy's handler and all its completions
    /// pass through the proxy's sequencer.
    ///
    /// # Errors
    ///
    /// [`ProxySetupError`]: not IDLE, already a proxy QP, a CQ that is not a
    /// proxy CQ of this proxy, or a proxy that is shut down.
    pub fn attach_proxy(&self, attach: ProxyAttach) -> Result<(), ProxySetupError> {
        let qp = &self.inner.qp;
        let state = qp.state();
        if state != QpState::Idle {
            return Err(ProxySetupError::NotIdle {
                qp_num: qp.qp_num,
                state,
            });
        }
        let id = attach.proxy.id();
        for (queue, cq) in [("send", &qp.send_cq), ("receive", &qp.recv_cq)] {
            if cq.proxy_id() != Some(id) {
                return Err(ProxySetupError::CqNotProxy {
                    qp_num: qp.qp_num,
                    queue,
                    cq_id: cq.id(),
                    proxy: id,
                    found: cq.proxy_id(),
                });
            }
        }
        if !attach.proxy.is_running() {
            return Err(ProxySetupError::ProxyStopped(id));
        }
        let link = ProxyLink {
            shared: Arc::clone(&attach.proxy.owner.shared),
            prefix: attach.filter.payload_prefix_len(),
            recycle: attach.recycle,
            filter: attach.filter,
            handler: Mutex::new(attach.handler),
            seq: Mutex::new(Sequencer::new()),
        };
        qp.proxy
            .set(Box::new(link))
            .map_err(|_| ProxySetupError::AlreadyProxy { qp_num: qp.qp_num })
    }

    /// Whether this is a proxy QP.
    pub fn is_proxy(&self) -> bool {
        self.inner.qp.proxy.get().is_some()
    }
}

#[cfg(test)]
mod core_info_tests {
    use super::*;
    use softrdma_proto::conn::{MsgInfo, WriteInfo};
    use softrdma_proto::mem::Span;

    #[test]
    fn core_message_info_becomes_the_receive_paths_meta() {
        let mem = Memory::from_vec(vec![0; 64]);
        let mut header = [0u8; 18];
        header[1] = 0x43;
        let send = MsgInfo::Send {
            opcode: Opcode::SendWithInvalidate,
            header,
            segs: vec![Span {
                region: mem.clone(),
                offset: 8,
                len: 32,
            }],
            inv: Some(0x1234_5678),
        };
        let m = MsgMeta::from_core(send, None);
        assert_eq!(m.opcode, Opcode::SendWithInvalidate);
        assert_eq!((m.header, m.header_len), (header, 18));
        assert_eq!((m.stag, m.to, m.imm), (Some(0x1234_5678), None, None));
        let MsgData::Recv(segs) = &m.data else {
            panic!("a Send's bytes are in its receive")
        };
        assert_eq!(segs.len(), 1);
        assert!(Arc::ptr_eq(&segs[0].mem, &mem));
        assert_eq!((segs[0].offset, segs[0].len), (8, 32));

        let mut th = [0u8; 14];
        th[0] = 0x80;
        let w = MsgInfo::Write {
            write: Some(WriteInfo {
                stag: 7,
                to: 0x1000,
                len: 300,
                header: th,
            }),
        };
        let m = MsgMeta::from_core(w, Some(99));
        assert_eq!(m.opcode, Opcode::RdmaWrite);
        assert_eq!(
            (m.stag, m.to, m.imm, m.written),
            (Some(7), Some(0x1000), Some(99), 300)
        );
        assert_eq!((&m.header[..14], m.header_len), (&th[..], 14));
        assert!(matches!(m.data, MsgData::Tagged));

        let m = MsgMeta::from_core(MsgInfo::Write { write: None }, Some(5));
        assert!(matches!(m.data, MsgData::None));
        assert_eq!(
            (m.stag, m.imm, m.written, m.header_len),
            (None, Some(5), 0, 0)
        );
    }
}
