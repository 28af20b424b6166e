//! Queue pairs (reliable connected, iWARP): creation, states, posting,
//! closing, and the glue between the protocol core's connection
//! (`softrdma_proto::conn::Connection`, `core_path`), the socket IO
//! (`datapath::conn_io`), the datamovers and the completion queues.
//!
//! ```text
//!  verbs API (QueuePair)          qp/: mod.rs, post.rs, close.rs
//!        │ post / modify / close
//!        ▼
//!  QpInner::core: HandOff<CoreConn>   qp/core_path.rs (one lock)
//!        │ handle_* / poll_*            ┌────────────────────────────┐
//!        ├─────────────────────────────►│ Connection (softrdma-proto)│
//!        │ completions, events, state   │ DDP/RDMAP rules, ORD/IRD,  │
//!        │◄─────────────────────────────│ SQ/RQ, completion order,   │
//!        │                              │ Terminates, close          │
//!        ▼                              └────────────────────────────┘
//!  datapath/conn_io.rs: RxIo (readv, placement), TxIo (writev)
//!  datapath/datamover.rs: engine threads (transmit slices, receive)
//! ```
//!
//! Posting never blocks for long: a send request is checked and queued by
//! the core under the connection's lock (held by others only for short,
//! non-blocking steps: the receive path lets it go across its `readv` into
//! registered memory); the posting thread then announces work and
//! try-claims the lock to frame and write the FPDUs itself (direct
//! sending). If the lock is held, the holder claims the announced work
//! when it lets go; if the socket would block, the QP is handed to its
//! datamover.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use softrdma_proto::mpa::{InitialMsns, Negotiated};
use softrdma_wire::ddp::Msn;
use softrdma_wire::errcode::{TermCode, TermError};

use crate::cq::{CompletionQueue, Progress};
use crate::device::Device;
use crate::event::{AsyncEvent, AsyncEventKind, StateWatch};
use crate::handoff::{Guard, HandOff};
use crate::pd::ProtectionDomain;
use crate::srq::SharedReceiveQueue;
use crate::state::{PostPolicy, QpState};
use crate::sys::io::tcp_maxseg;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{RecvSegs, RecvWqe, RecvWr, SendOp, SendWr};

mod close;
mod conn;
mod core_path;
mod dm;
mod linger;
pub(crate) mod offload;
pub(crate) mod post;

/// How long a graceful close waits for the peer's FIN before it resets the
/// connection, unless changed with [`QueuePair::set_close_timeout`].
pub const DEFAULT_CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Requested sizes of a QP's queues (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Inline payload bytes per send request.
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// What a QP is created with (`ibv_qp_init_attr`).
#[derive(Debug, Clone)]
pub struct QpInitAttr {
    /// CQ of send-queue completions.
    pub send_cq: CompletionQueue,
    /// CQ of receive completions.
    pub recv_cq: CompletionQueue,
    /// Shared receive queue instead of the QP's own.
    pub srq: Option<SharedReceiveQueue>,
    /// Queue sizes.
    pub cap: QpCap,
    /// Every send request is signaled, whatever its flags.
    pub sq_sig_all: bool,
    /// Inbound RDMA Read / atomic requests the QP accepts outstanding (IRD).
    pub ird: u16,
    /// Outbound RDMA Read / atomic requests the QP keeps outstanding (ORD).
    pub ord: u16,
    /// Keep the buffer of each receive that completed successfully, already
    /// checked, for the same receive's next post: a receive posted again
    /// with the same `wr_id` and the same single SGE (a ring of receive
    /// slots numbered from 0, reposted as they are consumed; `wr_id`s from
    /// `cap.max_recv_wr` up are never kept) then skips the look-up of its
    /// key in the registration table. The result of every post is the same
    /// as without it: the kept buffer is used only if no registration of
    /// the device changed since it was checked (a deregistration,
    /// invalidation, re-registration or bind in between makes the post
    /// check the SGE again, and fail as it would have), and state checks
    /// (ERROR, a full queue) are made as for any post. Only memory the
    /// engine allocated is kept (not memory registered with
    /// `register_raw` or lent for one call). A kept buffer holds its
    /// region's memory (all of it, also after the region is deregistered)
    /// until the next accepted post of its `wr_id`, whatever that post's
    /// SGEs (a post that does not take it lets it go; one refused before
    /// its checks, by a full queue, the state or too many SGEs, leaves it
    /// kept), or until the connection ends. Off by default.
    pub keep_recvs: bool,
}

impl QpInitAttr {
    /// Default capabilities with these CQs, IRD = ORD = 16.
    pub fn new(send_cq: &CompletionQueue, recv_cq: &CompletionQueue) -> Self {
        QpInitAttr {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
            ird: 16,
            ord: 16,
            keep_recvs: false,
        }
    }
}

/// What the connection settled, given to [`QueuePair::establish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkParams {
    /// MPA CRC is used in both directions.
    pub crc: bool,
    /// The peer's IRD: this QP keeps at most `min(ord, peer_ird)` Reads and
    /// atomics outstanding.
    pub peer_ird: u16,
    /// The peer's ORD (informational: the QP's own IRD is what it enforces).
    pub peer_ord: u16,
    /// First MSNs of full operation (an RTR may have used MSN 1 of a queue).
    pub msns: InitialMsns,
}

impl Default for LinkParams {
    fn default() -> Self {
        LinkParams {
            crc: false,
            peer_ird: u16::MAX,
            peer_ord: u16::MAX,
            msns: InitialMsns {
                send_tx: Msn::INITIAL,
                read_tx: Msn::INITIAL,
                send_rx: Msn::INITIAL,
                read_rx: Msn::INITIAL,
            },
        }
    }
}

impl From<&Negotiated> for LinkParams {
    fn from(n: &Negotiated) -> Self {
        LinkParams {
            crc: n.crc,
            peer_ird: n.peer_ird.unwrap_or(u16::MAX),
            peer_ord: n.peer_ord.unwrap_or(u16::MAX),
            msns: n.initial_msns(),
        }
    }
}

/// Why a QP could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateQpError {
    /// A capability exceeds the device limit.
    #[error("{what} = {value} exceeds the device limit {max}")]
    Capability {
        /// Which capability.
        what: &'static str,
        /// Requested.
        value: u32,
        /// Device limit.
        max: u32,
    },
    /// A CQ, the SRQ or the PD belong to another device.
    #[error("the CQs, SRQ and PD of a QP must belong to the same device")]
    WrongDevice,
    /// The QP could not become a proxy QP.
    #[error(transparent)]
    Proxy(#[from] offload::ProxySetupError),
    /// An exclusive CQ ([`CqBuilder::exclusive`](crate::cq::CqBuilder::exclusive))
    /// already serves another QP.
    #[error("the exclusive completion queue {cq_id} already serves a QP")]
    CqInUse {
        /// The CQ.
        cq_id: u32,
    },
}

/// Why a send request was refused (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostSendError {
    /// The QP state does not accept send requests.
    #[error("QP {qp_num} is in state {state}: send requests need RTS")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The send queue is full.
    #[error("send queue full ({depth} requests outstanding)")]
    QueueFull {
        /// The queue depth.
        depth: u32,
    },
    /// More SGEs than the QP was created for.
    #[error("{count} SGEs, the QP allows {max}")]
    TooManySges {
        /// SGEs in the request.
        count: usize,
        /// Limit.
        max: u32,
    },
    /// Inline payload larger than the QP allows.
    #[error("inline payload of {len} bytes, the QP allows {max}")]
    InlineTooLarge {
        /// Payload length.
        len: usize,
        /// Limit.
        max: u32,
    },
    /// The request's shape is invalid for its operation.
    #[error("invalid {op} request: {why}")]
    Invalid {
        /// Operation.
        op: &'static str,
        /// Reason.
        why: &'static str,
    },
}

/// Why [`QueuePair::post_send_list`] stopped: the request at `index` was
/// refused; the ones before it are posted (ibverbs' `bad_wr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("send request {index} of the list not posted (the {index} before it are): {error}")]
pub struct PostSendListError {
    /// Index of the first request not posted.
    pub index: usize,
    /// Why it was refused.
    #[source]
    pub error: PostSendError,
}

/// Why a receive request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostRecvError {
    /// The QP state does not accept receives.
    #[error("QP {qp_num} is in state {state}: receives are not accepted")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The receive queue is full.
    #[error("receive queue full ({depth} requests posted)")]
    QueueFull {
        /// Queue depth.
        depth: u32,
    },
    /// More SGEs than the QP was created for.
    #[error("{count} SGEs, the QP allows {max}")]
    TooManySges {
        /// SGEs in the request.
        count: usize,
        /// Limit.
        max: u32,
    },
    /// The QP uses a shared receive queue: post to the SRQ.
    #[error("the QP uses a shared receive queue; post receives to it")]
    HasSrq,
}

/// Why a state change was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifyError {
    /// The transition is not one an application may request.
    #[error("QP {qp_num}: {from} -> {to} is not a valid transition")]
    InvalidTransition {
        /// The QP.
        qp_num: u32,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// RTS needs a connection.
    #[error("QP {qp_num} has no connection: RTS is reached by connecting")]
    NotConnected {
        /// The QP.
        qp_num: u32,
    },
    /// IRD/ORD may change only before the connection is established.
    #[error("QP {qp_num}: IRD/ORD can change only in IDLE or RTR")]
    IrdOrdFixed {
        /// The QP.
        qp_num: u32,
    },
}

/// Why [`QueuePair::establish`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EstablishError {
    /// The QP is not in IDLE or RTR.
    #[error("QP {qp_num} is in state {state}; a connection needs IDLE or RTR")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The socket could not be set up.
    #[error("socket setup failed: {0}")]
    Io(#[from] io::Error),
}

/// What [`QueuePair::query`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttr {
    /// QP number.
    pub qp_num: u32,
    /// Current state.
    pub state: QpState,
    /// Capabilities.
    pub cap: QpCap,
    /// Inbound Read/atomic limit.
    pub ird: u16,
    /// Outbound Read/atomic limit (the effective one once connected).
    pub ord: u16,
    /// Every send request signaled.
    pub sq_sig_all: bool,
    /// CRC in use (once connected).
    pub crc: bool,
    /// Largest ULPDU payload per FPDU (once connected).
    pub max_fpdu_payload: usize,
    /// The datamover the QP is assigned to.
    pub datamover: usize,
    /// Peer address (once connected).
    pub peer: Option<SocketAddr>,
    /// Bytes written to the connection.
    pub bytes_sent: u64,
    /// Bytes read from the connection.
    pub bytes_received: u64,
}

/// Which side sent a Terminate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TerminateDirection {
    /// This QP sent it (it found an error in what the peer sent, or the
    /// application moved it to TERMINATE).
    Sent,
    /// The peer sent it.
    Received,
}

/// The Terminate message that ended a connection, kept on the QP
/// ([`QueuePair::last_terminate`]) so that tools can say what happened
/// beyond the flush errors of the work requests.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TerminateInfo {
    /// Sent or received.
    pub direction: TerminateDirection,
    /// Layer, error type and error code (RFC 5040 section 7.2 / 5041 / 5044).
    pub code: TermCode,
}

impl TerminateInfo {
    /// A readable description, e.g. "received Terminate: DDP Tagged Buffer
    /// Error / Invalid Steering Tag (0x1/0x1/0x00, RFC 5041)".
    pub fn description(&self) -> String {
        self.to_string()
    }
}

impl std::fmt::Display for TerminateInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dir = match self.direction {
            TerminateDirection::Sent => "sent",
            TerminateDirection::Received => "received",
        };
        write!(f, "{dir} Terminate: {}", self.code)
    }
}

/// Connection parameters of a connected QP (for [`QueuePair::query`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxLink {
    /// CRC in use.
    pub(crate) crc: bool,
    /// Largest ULPDU payload per FPDU.
    pub(crate) max_payload: usize,
}

/// A queue pair handle. Cloning gives another handle to the same QP; the QP
/// is destroyed (its connection closed, outstanding work flushed) when the
/// last handle is dropped.
#[derive(Debug, Clone)]
pub struct QueuePair {
    pub(crate) inner: Arc<QpHandle>,
}

/// Owner of a QP: destroying it tears the QP down.
#[derive(Debug)]
pub(crate) struct QpHandle {
    pub(crate) qp: Arc<QpInner>,
}

impl Drop for QpHandle {
    fn drop(&mut self) {
        self.qp.destroy();
    }
}

/// Serializes the making of QPs on exclusive CQs (see `QueuePair::new`):
/// the check that such a CQ serves no QP and the attachment of the new one.
static EXCLUSIVE_ATTACH: Mutex<()> = Mutex::new(());

/// The shared state of a QP.
///
/// Lock order (never the reverse): `rx` (who receives) → `state_lock` →
/// `core` (the connection, through the hand-off) → `pre_rq`'s users,
/// CQ/SRQ internals, the event queue; `peer`, `close_timer`,
/// `last_terminate` and `state_watch` are leaves. `establish` and the move
/// to RTR take `state_lock` → `core` raw (no request is accepted before
/// RTS); the reset ERROR → IDLE takes `rx` first (a receive path can still
/// be finishing then) and never `state_lock` with `core`. A `CoreGuard` is
/// never dropped under `state_lock` (its drop may claim announced work).
/// A proxy QP adds the proxy link's locks (`proxy.rs`): its `handler` →
/// `core` (a handler's reply is checked under `core`), and `core` → the
/// proxy's `gate` (read) → its load guard or the link's `seq` → CQ
/// internals (completions through the sequencer).
/// See `docs/engine.md`.
#[derive(Debug)]
pub(crate) struct QpInner {
    pub(crate) qp_num: u32,
    pub(crate) device: Device,
    pub(crate) pd: ProtectionDomain,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) srq: Option<SharedReceiveQueue>,
    pub(crate) cap: QpCap,
    sq_sig_all: bool,
    /// [`QpInitAttr::keep_recvs`].
    keep_recvs: bool,
    state: AtomicU8,
    state_lock: Mutex<()>,
    /// The IRD the QP negotiates (inbound Reads/atomics accepted at once;
    /// the connection counts them).
    ird: AtomicU32,
    /// The ORD requested (the connection's limit is min(ord, peer IRD)).
    ord: AtomicU32,
    pub(crate) datamover: usize,
    peer: Mutex<Option<SocketAddr>>,
    /// Send requests outstanding on the connection (for
    /// [`QueuePair::send_queue_len`]).
    sq_outstanding: AtomicU32,
    /// Receives posted before the connection exists (IDLE, RTR); moved
    /// into it when it is established. The connection holds the receive
    /// queue.
    pre_rq: Mutex<std::collections::VecDeque<RecvWqe>>,
    /// The connection (the protocol core's state machine and the socket
    /// IO), behind the direct-send hand-off; `None` before the first
    /// connection and after a reset.
    pub(crate) core: HandOff<Option<Box<core_path::CoreConn>>>,
    /// Its socket (-1: none), to look for bytes without the lock.
    pub(crate) core_fd: std::sync::atomic::AtomicI32,
    /// The epoch of the last connection (`CoreConn::epoch`), for
    /// [`Progress::connection`](crate::cq::Progress::connection).
    pub(crate) core_epoch: AtomicU64,
    /// Bytes wait on the socket for whoever holds `core` (a receiver
    /// found it busy and left them to it, `core_rx`).
    pub(crate) core_rx_wanted: AtomicBool,
    /// Held by whoever runs the receive path (engine thread or CQ poller).
    pub(crate) rx: Mutex<()>,
    /// A waiter holds `rx` while it sleeps in the socket's `recv`
    /// (`core_rx_sleep`): the receive threads do not wait for it.
    pub(crate) core_rx_sleeping: AtomicBool,
    /// Set while the QP is registered with the receive threads.
    pub(crate) rx_registered: AtomicBool,
    /// The socket it was registered with (-1: never registered).
    pub(crate) rx_fd: std::sync::atomic::AtomicI32,
    /// Set while a datamover lists the QP (active or paused).
    pub(crate) dm_listed: AtomicBool,
    /// When a CQ poll last drove this QP's receive path (engine clock, ns).
    pub(crate) last_poll: AtomicU64,
    /// Small posts of a burst written together (`post.rs`).
    pub(crate) tx_batch: post::TxBatch,
    /// Entering ERROR closes the connection in order instead of resetting
    /// it (QP destroyed by its owner).
    orderly_close: AtomicBool,
    /// The QP reached IDLE through a graceful close: until it is connected,
    /// moved to RTR or reset, posts are flushed as in ERROR.
    closed: AtomicBool,
    /// How long a graceful close waits for the peer's FIN (ms).
    close_timeout_ms: AtomicU64,
    /// The last Terminate sent or received (kept until the QP is connected
    /// again).
    last_terminate: Mutex<Option<TerminateInfo>>,
    /// The close timer armed by the current close, if any.
    close_timer: Mutex<Option<crate::timer::TimerId>>,
    /// Proxy offload, once attached (IDLE only): filter, handler and the
    /// completion sequencer (`proxy::ProxyLink`).
    pub(crate) proxy: std::sync::OnceLock<Box<dyn offload::CompletionRoute>>,
    pub(crate) self_weak: Weak<QpInner>,
    /// The connection manager's watch: told of every state change.
    state_watch: Mutex<Option<Box<dyn StateWatch>>>,
}

impl QueuePair {
    /// Creates a QP in IDLE.
    pub fn new(pd: &ProtectionDomain, attr: &QpInitAttr) -> Result<QueuePair, CreateQpError> {
        let device = pd.device().clone();
        let a = device.attr();
        let check = |what, value: u32, max: u32| {
            if value > max {
                Err(CreateQpError::Capability { what, value, max })
            } else {
                Ok(())
            }
        };
        check("max_send_wr", attr.cap.max_send_wr, a.max_qp_wr)?;
        check("max_recv_wr", attr.cap.max_recv_wr, a.max_qp_wr)?;
        check("max_send_sge", attr.cap.max_send_sge, a.max_sge)?;
        check("max_recv_sge", attr.cap.max_recv_sge, a.max_sge)?;
        check(
            "max_inline_data",
            attr.cap.max_inline_data,
            a.max_inline_data,
        )?;
        check("ird", u32::from(attr.ird), a.max_qp_rd_atom)?;
        check("ord", u32::from(attr.ord), a.max_qp_init_rd_atom)?;
        // Held from the check until the QP is attached to its CQs: two QPs
        // made at once on one exclusive CQ could otherwise both pass it.
        let _exclusive = (attr.send_cq.is_exclusive() || attr.recv_cq.is_exclusive())
            .then(|| EXCLUSIVE_ATTACH.lock());
        for cq in [&attr.send_cq, &attr.recv_cq] {
            if cq.is_exclusive() && cq.serves_a_qp() {
                return Err(CreateQpError::CqInUse { cq_id: cq.id() });
            }
        }
        let qp_num = device.alloc_qp_num();
        let datamover = device.threads().assign();
        let inner = Arc::new_cyclic(|weak| QpInner {
            qp_num,
            device: device.clone(),
            pd: pd.clone(),
            send_cq: attr.send_cq.clone(),
            recv_cq: attr.recv_cq.clone(),
            srq: attr.srq.clone(),
            cap: attr.cap,
            sq_sig_all: attr.sq_sig_all,
            keep_recvs: attr.keep_recvs,
            state: AtomicU8::new(QpState::Idle.as_u8()),
            state_lock: Mutex::new(()),
            ird: AtomicU32::new(u32::from(attr.ird)),
            ord: AtomicU32::new(u32::from(attr.ord)),
            datamover,
            peer: Mutex::new(None),
            sq_outstanding: AtomicU32::new(0),
            pre_rq: Mutex::new(std::collections::VecDeque::new()),
            core: HandOff::new(None),
            core_fd: std::sync::atomic::AtomicI32::new(-1),
            core_epoch: AtomicU64::new(0),
            core_rx_wanted: AtomicBool::new(false),
            rx: Mutex::new(()),
            core_rx_sleeping: AtomicBool::new(false),
            rx_registered: AtomicBool::new(false),
            rx_fd: std::sync::atomic::AtomicI32::new(-1),
            dm_listed: AtomicBool::new(false),
            last_poll: AtomicU64::new(0),
            tx_batch: post::TxBatch::default(),
            orderly_close: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            close_timeout_ms: AtomicU64::new(DEFAULT_CLOSE_TIMEOUT.as_millis() as u64),
            close_timer: Mutex::new(None),
            last_terminate: Mutex::new(None),
            proxy: std::sync::OnceLock::new(),
            self_weak: weak.clone(),
            state_watch: Mutex::new(None),
        });
        let hook: Weak<dyn Progress> = Arc::downgrade(&inner) as Weak<dyn Progress>;
        inner.recv_cq.attach_progress(hook.clone());
        if !inner.send_cq.same_as(&inner.recv_cq) {
            inner.send_cq.attach_progress(hook);
        }
        Ok(QueuePair {
            inner: Arc::new(QpHandle { qp: inner }),
        })
    }

    fn qp(&self) -> &Arc<QpInner> {
        &self.inner.qp
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp().qp_num
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.qp().state()
    }

    /// The QP's attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        let qp = self.qp();
        let (bytes_sent, bytes_received) = qp.core_counters().map_or((0, 0), |c| (c.0, c.1));
        let link = qp.core_link();
        QpAttr {
            qp_num: qp.qp_num,
            state: qp.state(),
            cap: qp.cap,
            ird: u16::try_from(qp.ird_limit()).unwrap_or(u16::MAX),
            ord: u16::try_from(qp.ord_limit()).unwrap_or(u16::MAX),
            sq_sig_all: qp.sq_sig_all,
            crc: link.is_some_and(|l| l.crc),
            max_fpdu_payload: link.map_or(0, |l| l.max_payload),
            datamover: qp.datamover,
            peer: *qp.peer.lock(),
            bytes_sent,
            bytes_received,
        }
    }

    /// Changes the IRD and ORD the QP will negotiate (IDLE or RTR only).
    pub fn set_ird_ord(&self, ird: u16, ord: u16) -> Result<(), ModifyError> {
        let qp = self.qp();
        let _g = qp.lock_state();
        if !matches!(qp.state(), QpState::Idle | QpState::Rtr) {
            return Err(ModifyError::IrdOrdFixed { qp_num: qp.qp_num });
        }
        qp.ird.store(u32::from(ird), Ordering::Relaxed);
        qp.ord.store(u32::from(ord), Ordering::Relaxed);
        Ok(())
    }

    /// Requests a state change (`ibv_modify_qp` with `IBV_QP_STATE`).
    ///
    /// * IDLE → RTR: receives may be posted before the connection exists.
    /// * → ERROR: outstanding work completes with flush errors, the
    ///   connection is closed abortively.
    /// * RTS → TERMINATE: a Terminate (RDMAP local catastrophic) is sent,
    ///   then the QP enters ERROR.
    /// * RTS → CLOSING: graceful disconnect, as [`QueuePair::disconnect`].
    /// * → ERROR from RTS: abortive disconnect (the connection is reset).
    /// * ERROR → IDLE: the QP is reset and can be connected again.
    pub fn modify(&self, to: QpState) -> Result<(), ModifyError> {
        let qp = self.qp();
        let from = qp.state();
        if !from.user_may_modify(to) {
            return Err(ModifyError::InvalidTransition {
                qp_num: qp.qp_num,
                from,
                to,
            });
        }
        match to {
            QpState::Rts if from != QpState::Rts => {
                Err(ModifyError::NotConnected { qp_num: qp.qp_num })
            }
            QpState::Error => {
                qp.abort();
                Ok(())
            }
            QpState::Terminate => {
                qp.fail(TermError::RdmapLocalCatastrophic);
                Ok(())
            }
            QpState::Closing => {
                qp.begin_close(None);
                Ok(())
            }
            QpState::Idle if from == QpState::Error => {
                qp.reset();
                Ok(())
            }
            QpState::Rtr => {
                let _g = qp.lock_state();
                if !matches!(qp.state(), QpState::Idle | QpState::Rtr) {
                    return Err(ModifyError::InvalidTransition {
                        qp_num: qp.qp_num,
                        from: qp.state(),
                        to,
                    });
                }
                // A closed QP becomes reusable: receives are queued again.
                qp.closed.store(false, Ordering::SeqCst);
                // The closed connection is forgotten.
                let mut g = qp.core.lock();
                qp.core_fd.store(-1, Ordering::Release);
                *g = None;
                let _ = qp.core.release(g);
                qp.set_state(to);
                Ok(())
            }
            _ => {
                qp.set_state(to);
                Ok(())
            }
        }
    }

    /// Graceful disconnect: RTS → CLOSING. Posted receives are flushed, the
    /// send requests posted before the call still go out, then FIN is sent;
    /// when the peer's FIN has arrived too the QP reaches IDLE and the device
    /// reports [`AsyncEventKind::LlpClosed`]. If the peer's FIN does not come
    /// within the close timeout, the connection is reset: ERROR,
    /// everything flushed, [`AsyncEventKind::BadClose`].
    pub fn disconnect(&self) -> Result<(), ModifyError> {
        self.disconnect_with(None)
    }

    /// [`disconnect`](Self::disconnect), its FIN waiting for the peer's
    /// acknowledgement at most `linger` if given.
    fn disconnect_with(&self, linger: Option<std::time::Duration>) -> Result<(), ModifyError> {
        let qp = self.qp();
        let from = qp.state();
        if from != QpState::Rts {
            return Err(ModifyError::InvalidTransition {
                qp_num: qp.qp_num,
                from,
                to: QpState::Closing,
            });
        }
        qp.begin_close(linger);
        Ok(())
    }

    /// [`disconnect`](Self::disconnect) whose FIN waits until the peer's
    /// TCP has acknowledged every byte handed to the socket (the requests
    /// posted before the call included), at most `linger` after the call:
    /// for peers that fail a request they are still completing when a
    /// close arrives (kernel siw, see
    /// [`close_acknowledged`](Self::close_acknowledged); its check counts
    /// a FIN as a close). Returns at once: the engine's timer looks every
    /// millisecond. The close timer runs from the call, as for
    /// [`disconnect`](Self::disconnect); a QP destroyed while its FIN
    /// waits should be closed with
    /// [`close_acknowledged`](Self::close_acknowledged), which keeps
    /// waiting. A process that exits (`exit(3)`) while the FIN waits, the
    /// QP not destroyed, waits at exit for the acknowledgement too (at
    /// most `linger`), as after [`close_acknowledged`](Self::close_acknowledged),
    /// once the FIN is ready: requests still in the engine's own queue at
    /// exit (the socket full, a slow peer) are not waited for (the process
    /// may end before they reach the socket), as a device flushes posted
    /// requests that never completed.
    pub fn disconnect_acknowledged(&self, linger: std::time::Duration) -> Result<(), ModifyError> {
        self.disconnect_with(Some(linger))
    }

    /// The Terminate message that ended the last connection, sent or
    /// received, with its layer, type and code; `None` if the connection
    /// did not end by a Terminate. Kept through ERROR and the reset to IDLE,
    /// cleared when the QP is connected again. The async event of the
    /// failure ([`AsyncEventKind::TerminateReceived`], or the access /
    /// request error event for a sent one) carries the same code.
    pub fn last_terminate(&self) -> Option<TerminateInfo> {
        self.qp().last_terminate.lock().clone()
    }

    /// Abortive disconnect: the connection is reset (RST), the QP enters
    /// ERROR and every outstanding request completes with a flush error;
    /// the device reports [`AsyncEventKind::LlpReset`].
    pub fn abort(&self) {
        self.qp().abort();
    }

    /// Closes the connection of a QP that is about to be destroyed, the way
    /// destroying a connected QP does in kernel siw: in order (FIN after the
    /// bytes already in the socket, no reset; the QP enters ERROR and every
    /// outstanding request is flushed, without an async event), but not
    /// before the peer's TCP has acknowledged every byte handed to the
    /// socket, or `linger` has passed. Does nothing unless the QP is in
    /// RTS or CLOSING (a FIN that still waits, see
    /// [`disconnect_acknowledged`](Self::disconnect_acknowledged), goes
    /// with the close).
    ///
    /// Returns at once: the QP is in ERROR on return, and the engine waits
    /// for the acknowledgement (its timer looks every millisecond) and then
    /// sends the FIN and lets the socket go (its descriptor is closed once
    /// the QP is destroyed or reset too). A process that exits
    /// (`exit(3)`) right after waits at exit until those sockets are
    /// closed, at most `linger`; one that ends without exit handlers
    /// (`_exit(2)`, a fatal signal) leaves them to the kernel, which closes
    /// them at once (a FIN after the bytes sent, without waiting for the
    /// acknowledgement).
    ///
    /// The wait is for peers that cannot take a close right after their last
    /// message was answered. Kernel siw (Linux 6.1) checks after handing the
    /// last segment of a work request to TCP whether the connection went
    /// down meanwhile, and if it did completes that request with
    /// `IB_WC_LOC_QP_OP_ERR` although all of it went out
    /// (`siw_qp_sq_proc_tx`, `drivers/infiniband/sw/siw/siw_qp_tx.c`; a FIN
    /// and an RST count alike). On a slow host the answer to that request
    /// and a close sent right after it can both be processed before the
    /// check (in an emulated guest its send call outlasted the answer and
    /// the close of a fast peer): a request/answer exchange that ends with
    /// a close right after the answer fails on siw's side. siw's TCP
    /// acknowledges the answer only once it has processed it, so a close
    /// sent after that acknowledgement arrives after the check (unless
    /// siw's thread is stalled between the two).
    pub fn close_acknowledged(&self, linger: std::time::Duration) {
        self.qp().close_acknowledged(linger);
    }

    /// How long a graceful close waits for the peer's FIN
    /// ([`DEFAULT_CLOSE_TIMEOUT`] unless set).
    pub fn set_close_timeout(&self, timeout: std::time::Duration) {
        self.qp().close_timeout_ms.store(
            u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Moves the QP to RTS over a connected TCP stream positioned at the
    /// first FPDU of full operation (the MPA exchange is done), with what
    /// the negotiation settled.
    pub fn establish(&self, stream: TcpStream, params: &LinkParams) -> Result<(), EstablishError> {
        self.establish_with_prefix(stream, params, &[])
    }

    /// Like [`establish`](Self::establish), for a stream from which the
    /// caller has already read the first bytes of full operation (read-ahead
    /// of a stream-to-RDMA transition, or of an MPA exchange that read past
    /// the handshake): `already_read` is processed as FPDUs before anything
    /// read from the socket. At most 16 KiB.
    pub fn establish_with_prefix(
        &self,
        stream: TcpStream,
        params: &LinkParams,
        already_read: &[u8],
    ) -> Result<(), EstablishError> {
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        self.establish_prepared(stream, params, already_read, None)
    }

    /// [`establish_with_prefix`](Self::establish_with_prefix) for a stream
    /// that is non-blocking with `TCP_NODELAY` set already (a stream-to-RDMA
    /// transition set both for its handshake): two system calls less.
    /// `peer`: the stream's peer address if the caller knows it (one more
    /// system call less); asked of the kernel otherwise.
    pub(crate) fn establish_prepared(
        &self,
        stream: TcpStream,
        params: &LinkParams,
        already_read: &[u8],
        peer: Option<SocketAddr>,
    ) -> Result<(), EstablishError> {
        if already_read.len() > 16 * 1024 {
            return Err(EstablishError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more than 16 KiB of read-ahead",
            )));
        }
        let qp = self.qp();
        let _g = qp.lock_state();
        let state = qp.state();
        if !matches!(state, QpState::Idle | QpState::Rtr) {
            return Err(EstablishError::InvalidState {
                qp_num: qp.qp_num,
                state,
            });
        }
        let fd = stream.as_raw_fd();
        // The first FPDU size; the transmitter follows the MSS from then
        // on (`datapath::conn_io::TxIo`: right after the handshake the
        // MSS is bounded by half the peer's small first window).
        let mss = tcp_maxseg(fd);
        // (A `TCP_MAXSEG` only a TCP socket answers: a stream socket.)
        let tcp = mss.is_ok();
        let max_payload = crate::datapath::conn_io::max_payload_for_mss(mss.unwrap_or(1460));
        *qp.peer.lock() = peer.or_else(|| stream.peer_addr().ok());
        let stream = Arc::new(linger::LinkStream::new(stream));
        qp.core_establish(stream, params, max_payload, already_read, tcp);
        qp.closed.store(false, Ordering::SeqCst);
        *qp.last_terminate.lock() = None;
        qp.set_state(QpState::Rts);
        drop(_g);
        qp.device.threads().register_rx(qp, fd);
        if !already_read.is_empty() {
            // Bytes already here: the socket may never become readable for
            // them, so process them now.
            qp.rx_thread_progress();
        }
        qp.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::CommEstablished, qp.qp_num));
        Ok(())
    }

    /// Installs (or removes) the connection manager's state watch.
    pub(crate) fn set_state_watch(&self, w: Option<Box<dyn StateWatch>>) {
        *self.qp().state_watch.lock() = w;
    }

    /// Posts one send-queue request (`ibv_post_send`). Never blocks.
    ///
    /// Accepted in RTS; flushed at once ([`WcStatus::WrFlush`]) in ERROR
    /// and in IDLE after a graceful close; refused in other states
    /// ([`PostSendError::InvalidState`]). See [`post_recv`](Self::post_recv).
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        self.post_send_list(std::slice::from_ref(wr))
            .map_err(|e| e.error)
    }

    /// Posts one send-queue request and, where it can, writes it in the
    /// calling thread at once and returns its completion: `Ok(Some(wc))`
    /// when the request was written entirely within the call and its send
    /// CQ is exclusive ([`CqBuilder::exclusive`](crate::cq::CqBuilder::exclusive)),
    /// empty, unarmed and without waiters. That completion is not queued
    /// on the CQ and raises no event: it is the caller's, as if the CQ had
    /// queued it and the caller polled it at once. Otherwise (`Ok(None)`)
    /// the request is posted as by [`post_send`](Self::post_send) and
    /// completes through the CQ (an unsignaled request produces no
    /// completion either way).
    ///
    /// When nothing else is outstanding on the send queue (and the CQ is
    /// exclusive), the request is queued and written under one hold of
    /// the connection's lock, never deferred to the poster's next poll
    /// ([`DeviceConfig::tx_batch`](crate::DeviceConfig::tx_batch)): the
    /// fast path of a ping-pong, with no hand-off between threads and no
    /// completion queued and polled back. An inline Send without
    /// Immediate Data whose payload fits one FPDU, with nothing queued or
    /// unwritten before it, is not even queued: it is framed, written and
    /// completed in one pass (the same bytes, MSN and completion order).
    ///
    /// The caller must serialize this call with every poll, arm and wait
    /// of the exclusive CQ (as the CQ's one consumer): a completion
    /// returned here while another thread holds completions it polled but
    /// has not handled yet would be handled ahead of them. An exclusive CQ
    /// cannot be served by `AsyncCq` (the `tokio` feature) for that
    /// reason.
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send).
    pub fn post_send_now(&self, wr: &SendWr<'_>) -> Result<Option<WorkCompletion>, PostSendError> {
        match self.qp().core_post_send_now(wr) {
            Some(r) => r,
            None => self.post_send(wr).map(|()| None),
        }
    }

    /// Posts several send-queue requests in order; they are framed and
    /// written together (one vectored write for many small messages). On
    /// error, says which request was not posted (the earlier ones are),
    /// like ibverbs' `bad_wr`.
    pub fn post_send_list(&self, wrs: &[SendWr<'_>]) -> Result<(), PostSendListError> {
        let qp = self.qp();
        let _mark = post::UrgentScope::enter();
        let mut posted = 0usize;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            match qp.post_one(wr) {
                Ok(()) => posted += 1,
                Err(e) => {
                    result = Err(PostSendListError { index: i, error: e });
                    break;
                }
            }
        }
        if posted > 0 {
            qp.kick_posted();
        }
        result
    }

    /// Posts a receive (`ibv_post_recv`). Never blocks.
    ///
    /// What happens by state (as kernel siw): IDLE, RTR and RTS queue the
    /// receive; CLOSING and TERMINATE refuse it
    /// ([`PostRecvError::InvalidState`], siw's `ENOTCONN`); ERROR accepts it
    /// and completes it at once with [`WcStatus::WrFlush`]. A QP that
    /// reached IDLE through a graceful close treats posts as ERROR does
    /// (flushed at once, like siw, whose QP ends its LLP close in ERROR), so
    /// the usual drain idiom works and nothing waits for a connection that
    /// is gone; connecting it again, moving it to RTR or resetting it (ERROR
    /// → IDLE) makes it queue receives again. Every accepted receive
    /// completes: if a close or an error overtakes the post, the receive is
    /// flushed.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        self.qp().post_recv(wr)
    }

    /// The device of the QP.
    pub fn device(&self) -> &Device {
        &self.qp().device
    }

    /// Number of send requests posted and not yet completed.
    pub fn send_queue_len(&self) -> u32 {
        self.qp().core_counters().map_or(0, |c| c.2 as u32)
    }

    /// Number of receives posted and not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        match self.qp().core_counters() {
            Some(c) => c.3,
            None => self.qp().pre_rq.lock().len(),
        }
    }
}

/// Debug builds count the QP locks each thread holds and check the lock
/// order: `state_lock` before the connection's (transmit) lock `core`, and
/// no `CoreGuard` dropped (which may claim announced work) under
/// `state_lock`.
#[cfg(debug_assertions)]
mod lock_order {
    use std::cell::Cell;

    thread_local! {
        static STATE: Cell<u32> = const { Cell::new(0) };
        static TX: Cell<u32> = const { Cell::new(0) };
    }

    pub(in crate::qp) fn state_acquired() {
        debug_assert_eq!(
            TX.with(Cell::get),
            0,
            "lock order: state_lock taken while holding the transmit lock"
        );
        STATE.with(|c| c.set(c.get() + 1));
    }

    pub(in crate::qp) fn state_released() {
        STATE.with(|c| c.set(c.get().saturating_sub(1)));
    }

    pub(in crate::qp) fn tx_acquired() {
        TX.with(|c| c.set(c.get() + 1));
    }

    pub(in crate::qp) fn tx_released() {
        debug_assert_eq!(
            STATE.with(Cell::get),
            0,
            "lock order: a transmit guard dropped under state_lock"
        );
        TX.with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// `state_lock` held (see [`QpInner::lock_state`]).
pub(crate) struct StateGuard<'a> {
    _guard: parking_lot::MutexGuard<'a, ()>,
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        lock_order::state_released();
    }
}

impl QpInner {
    /// Takes `state_lock` (state transitions); see the lock order on
    /// [`QpInner`].
    pub(crate) fn lock_state(&self) -> StateGuard<'_> {
        let guard = self.state_lock.lock();
        #[cfg(debug_assertions)]
        lock_order::state_acquired();
        StateGuard { _guard: guard }
    }

    pub(crate) fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire)).unwrap_or(QpState::Error)
    }

    fn set_state(&self, s: QpState) {
        let from = self.state.swap(s.as_u8(), Ordering::SeqCst);
        if from != s.as_u8() {
            tracing::debug!(
                qp = self.qp_num,
                from = %QpState::from_u8(from).unwrap_or(QpState::Error),
                to = %s,
                "QP state change"
            );
        }
        // Pairs with the fence in `post_recv`: a poster that queued a
        // receive and then reads the old state is seen by our flush.
        std::sync::atomic::fence(Ordering::SeqCst);
        if let Some(w) = self.state_watch.lock().as_ref() {
            w.notify(s);
        }
    }

    /// What posting a send request does now.
    fn send_policy(&self) -> PostPolicy {
        let state = self.state();
        if state == QpState::Idle && self.closed.load(Ordering::SeqCst) {
            PostPolicy::Flush
        } else {
            state.send_policy()
        }
    }

    /// What posting a receive does now.
    fn recv_policy(&self) -> PostPolicy {
        let state = self.state();
        if state == QpState::Idle && self.closed.load(Ordering::SeqCst) {
            PostPolicy::Flush
        } else {
            state.recv_policy()
        }
    }

    /// The ORD: the connection's (min of ours and the peer's IRD) once
    /// connected, else the one the QP will negotiate.
    pub(crate) fn ord_limit(&self) -> u32 {
        self.core_ord()
            .unwrap_or_else(|| self.ord.load(Ordering::Relaxed))
    }

    pub(crate) fn ird_limit(&self) -> u32 {
        self.ird.load(Ordering::Relaxed)
    }
}

impl QpInner {
    /// Receive progress from a CQ poll: only if nobody else is receiving.
    /// `busy`: the caller busy-polls (the receive thread may leave the
    /// socket to it for a while).
    pub(crate) fn rx_poll(&self, busy: bool) -> bool {
        if busy {
            self.last_poll
                .store(crate::datamover::now_ns(), Ordering::Relaxed);
        }
        self.core_rx(false).0
    }

    /// Receive progress from a receive thread. Returns `false` once the QP
    /// no longer receives (no need to wait for the socket again).
    pub(crate) fn rx_thread_progress(&self) -> bool {
        self.core_rx(true).1
    }
}

impl Progress for QpInner {
    fn armed(&self) {
        // The owner now waits for an event: nothing may wait for its poll.
        self.batch_poll();
        // Not busy-polled any more: let the receive thread watch the socket
        // now, not after the quiet period.
        if self.last_poll.swap(0, Ordering::Relaxed) != 0 {
            self.device.threads().wake_rx(self.datamover);
        }
    }

    fn sleep_on(&self, until_ns: Option<u64>) -> Option<std::os::fd::RawFd> {
        // The waiter sleeps: what its posts left is written first (not
        // when it returns without sleeping, `None`: that is no poll).
        if until_ns.is_some() {
            self.batch_poll();
        }
        self.device.threads().claim_rx(self, until_ns)
    }

    fn connection(&self) -> u64 {
        // Stored before the connection's socket is registered: a waiter
        // that reads the new epoch here claims the new socket after it.
        self.core_epoch.load(Ordering::Acquire)
    }

    fn sleep_on_for(&self, after_ns: u64) -> Option<std::os::fd::RawFd> {
        // As `sleep_on(Some(now + after_ns))`, with one reading of the
        // coarse clock (a sleep in `recv` per message; the fine clock's
        // reading was about as dear as the rest of the claim): the poll
        // is stamped with the earliest time it may be, the claim reaches
        // `after_ns` past the latest it usually is (the clock's step
        // added, so up to a tick longer). That stamp trails by about
        // half a step, far more than `BATCH_POLLED_NS`: it almost never
        // lets posts batch (a later poll's stamp does). The fine clock's
        // stamp was measured: no gain, and the ping-pong slower.
        let (now, step) = crate::datamover::now_ns_coarse();
        let now = self.batch_poll_at(now);
        self.device.threads().claim_rx(
            self,
            Some(now.saturating_add(step).saturating_add(after_ns)),
        )
    }

    fn progress(&self, armed: bool) -> bool {
        let now = self.batch_poll();
        if !self.device.config().poll_driven_receive {
            return false;
        }
        // `rx_poll`, with the clock read once for both. A claim of a
        // waiter that reaches further stands (the waiter's own polls
        // between its sleeps cut it short, and an engine thread took the
        // socket over whenever the waiter then waited for a CPU for longer
        // than the quiet period); `sleep_on(None)` and `armed` end it.
        if !armed {
            self.last_poll.fetch_max(now, Ordering::Relaxed);
        }
        self.core_rx(false).0
    }

    fn renew_claim(&self, until_ns: u64) {
        // What `claim_rx` stores, without its table look-up (the waiter
        // has the socket); a QP that stopped receiving is not watched by
        // its engine thread, whatever is stored.
        if self.rx_registered.load(Ordering::Acquire) {
            self.last_poll.store(until_ns, Ordering::Relaxed);
        }
    }

    fn polled(&self) {
        self.batch_poll();
    }

    fn write_deferred(&self) {
        if self.tx_batch.take_deferred() {
            self.tx_batch.stats[1].fetch_add(1, Ordering::Relaxed);
            self.core_kick();
        }
    }

    fn progress_readable(&self) -> bool {
        self.batch_poll();
        if !self.device.config().poll_driven_receive {
            return false;
        }
        self.core_rx_readable().0
    }

    fn progress_sleep(
        &self,
        timeout: std::time::Duration,
        ready: &dyn Fn() -> bool,
        hand: &mut dyn FnMut() -> bool,
        handed: &mut Option<WorkCompletion>,
    ) -> crate::cq::RxSleep {
        if !self.device.config().poll_driven_receive {
            return crate::cq::RxSleep::Unable;
        }
        self.core_rx_sleep(timeout, ready, hand, handed)
    }
}

/// A QP on a device of its own with unpinned threads, not connected (for
/// unit tests of the QP's own locking).
#[cfg(test)]
pub(crate) fn unconnected_qp() -> QueuePair {
    let dev = Device::open_with(crate::DeviceConfig {
        pin_threads: false,
        ..crate::DeviceConfig::default()
    })
    .unwrap();
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 16, None).unwrap();
    QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap()
}

#[cfg(all(test, debug_assertions))]
mod lock_order_tests {
    use super::unconnected_qp as qp;

    #[test]
    fn state_then_tx_is_the_order() {
        let qp = qp();
        let inner = qp.qp();
        let s = inner.lock_state();
        let t = inner.core.lock();
        let _ = inner.core.release(t);
        drop(s);
        drop(inner.lock_core());
    }

    #[test]
    #[should_panic(expected = "lock order: state_lock taken while holding the transmit lock")]
    fn state_lock_under_a_tx_guard_is_caught() {
        let qp = qp();
        let inner = qp.qp();
        let _t = inner.lock_core();
        let _s = inner.lock_state();
    }
}

#[cfg(test)]
mod claim_tests {
    use std::sync::atomic::Ordering;

    /// A QP's claim renewed by a waiter is stored while the QP receives
    /// from its socket, and ignored once it no longer does.
    #[test]
    fn renewing_a_claim_needs_a_receiving_qp() {
        let qp = super::unconnected_qp();
        let inner = qp.qp();
        let p: &dyn crate::cq::Progress = &**inner;
        p.renew_claim(123);
        assert_eq!(inner.last_poll.load(Ordering::Relaxed), 0, "not receiving");
        inner.rx_registered.store(true, Ordering::Release);
        p.renew_claim(456);
        assert_eq!(inner.last_poll.load(Ordering::Relaxed), 456);
        inner.rx_registered.store(false, Ordering::Release);
    }

    /// A waiter's claim hands out the socket the QP was registered with
    /// (read from the QP, not the engine thread's table), and nothing
    /// before the registration or after it ended.
    #[test]
    fn a_claim_hands_out_the_registered_socket_while_registered() {
        use std::os::fd::AsRawFd;
        let qp = super::unconnected_qp();
        let inner = qp.qp();
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        inner.set_state(crate::state::QpState::Rts);
        let threads = inner.device.threads();
        assert_eq!(threads.claim_rx(&**inner, Some(1)), None, "not registered");
        threads.register_rx(inner, ours.as_raw_fd());
        assert_eq!(threads.claim_rx(&**inner, Some(1)), Some(ours.as_raw_fd()));
        threads.unregister(&**inner);
        assert_eq!(threads.claim_rx(&**inner, Some(1)), None, "unregistered");
        inner.set_state(crate::state::QpState::Error);
    }

    /// A waiter about to sleep in `recv` (`sleep_on_for`) stamps the QP's
    /// poll with a reading of the coarse clock and claims the socket
    /// until that reading plus the clock's step plus the time asked:
    /// both bracketed by coarse readings before and after the call. (With
    /// the fine clock's reading instead, the claim falls short of the
    /// lower bound and the stamp passes the upper one whenever the coarse
    /// clock trails by less than its step, as it nearly always does: one
    /// of 50 calls suffices.)
    #[test]
    fn a_waiters_claim_and_poll_stamp_come_from_the_coarse_clock() {
        use std::os::fd::AsRawFd;
        const AFTER_NS: u64 = 10_000_000;
        let qp = super::unconnected_qp();
        let inner = qp.qp();
        let p: &dyn crate::cq::Progress = &**inner;
        let (ours, _theirs) = std::os::unix::net::UnixStream::pair().unwrap();
        inner.set_state(crate::state::QpState::Rts);
        inner.device.threads().register_rx(inner, ours.as_raw_fd());
        for _ in 0..50 {
            let (before, step) = crate::datamover::now_ns_coarse();
            assert_eq!(p.sleep_on_for(AFTER_NS), Some(ours.as_raw_fd()));
            let (after, _) = crate::datamover::now_ns_coarse();
            let claim = inner.last_poll.load(Ordering::Relaxed);
            let stamp = inner.tx_batch.polled_ns();
            assert!(
                (before + step + AFTER_NS..=after + step + AFTER_NS).contains(&claim),
                "claim until {claim}, coarse clock at {before} and {after}, step {step}"
            );
            assert!(
                (before..=after).contains(&stamp),
                "poll stamped {stamp}, coarse clock at {before} and {after}"
            );
        }
        inner.device.threads().unregister(&**inner);
        inner.set_state(crate::state::QpState::Error);
    }

    /// A poll of the CQ (the waiter's own look between two sleeps, or a
    /// busy poll) marks the QP as polled now without cutting short a
    /// waiter's claim that reaches further; only the waiter's release
    /// (`sleep_on(None)`) and arming the CQ end it. (A poll stored its
    /// time over the claim: an engine thread took the socket over
    /// whenever the waiter then waited for a CPU longer than the quiet
    /// period.)
    #[test]
    fn a_poll_does_not_cut_a_waiters_claim_short() {
        let qp = super::unconnected_qp();
        let inner = qp.qp();
        let p: &dyn crate::cq::Progress = &**inner;
        inner.rx_registered.store(true, Ordering::Release);
        let far = crate::datamover::now_ns() + 60_000_000_000;
        p.renew_claim(far);
        p.progress(false);
        assert_eq!(
            inner.last_poll.load(Ordering::Relaxed),
            far,
            "the claim stands"
        );
        inner.last_poll.store(1, Ordering::Relaxed);
        p.progress(false);
        assert!(
            inner.last_poll.load(Ordering::Relaxed) > 1,
            "a poll after the claim is marked"
        );
        inner.rx_registered.store(false, Ordering::Release);
    }
}
