//! Work requests, completions and events: the values that cross the
//! boundary between the protocol core ([`crate::conn::Connection`]) and the
//! engine. They mirror the engine's verbs types (`wr.rs`, `wc.rs`,
//! `event.rs`) without depending on it.

use softrdma_wire::errcode::TermCode;

use crate::qp_state::QpState;

/// A scatter/gather element of a posted work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Local key of the region.
    pub lkey: u32,
    /// Start address.
    pub addr: u64,
    /// Length.
    pub len: u32,
}

/// What a send-queue work request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SendOp {
    /// Send, optionally with Invalidate (`inv`) or Immediate Data (`imm`);
    /// not both (like the engine's verbs).
    Send {
        /// STag the peer invalidates (Send with Invalidate).
        inv: Option<u32>,
        /// Immediate data (Send with Immediate).
        imm: Option<u32>,
    },
    /// RDMA Write, optionally with Immediate Data.
    Write {
        /// Remote STag.
        rkey: u32,
        /// Remote tagged offset.
        remote_addr: u64,
        /// Immediate data (Write with Immediate).
        imm: Option<u32>,
    },
    /// RDMA Read into the single SGE.
    Read {
        /// Remote STag.
        rkey: u32,
        /// Remote tagged offset.
        remote_addr: u64,
    },
    /// Atomic Fetch and Add; the original value goes to the 8-byte SGE.
    FetchAdd {
        /// Remote STag.
        rkey: u32,
        /// Remote tagged offset (8-byte aligned).
        remote_addr: u64,
        /// Value added.
        add: u64,
    },
    /// Atomic Compare and Swap; the original value goes to the 8-byte SGE.
    CmpSwap {
        /// Remote STag.
        rkey: u32,
        /// Remote tagged offset (8-byte aligned).
        remote_addr: u64,
        /// Compared value.
        compare: u64,
        /// Value stored if equal.
        swap: u64,
    },
    /// Local operation (invalidate, bind, fast-register), executed at post.
    Local(crate::mem::LocalOp),
}

/// A send-queue work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendWr<'a> {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
    /// The local buffers.
    pub sgl: &'a [Sge],
    /// Report a completion on success (errors are always reported).
    pub signaled: bool,
    /// Wait for all earlier Reads and atomics to complete first.
    pub fence: bool,
    /// Ask for a solicited event at the peer (Send, Immediate Data).
    pub solicited: bool,
    /// Inline payload (Send and Write only): copied when posted, so the
    /// caller may reuse the buffer at once; `sgl` is then ignored. At most
    /// [`crate::conn::Config::max_inline`] bytes.
    pub inline: Option<&'a [u8]>,
    /// Posted by the engine itself (a proxy handler's reply), not by the
    /// application: its completion is always reported, whatever its status
    /// and `signaled`, with [`Completion::internal`] set, for the engine to
    /// route to the proxy instead of the application's CQ.
    pub internal: bool,
}

impl<'a> SendWr<'a> {
    /// A signaled request with no flags.
    #[must_use]
    pub const fn new(wr_id: u64, op: SendOp, sgl: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            op,
            sgl,
            signaled: true,
            fence: false,
            solicited: false,
            inline: None,
            internal: false,
        }
    }

    /// The same request with an inline payload (see [`SendWr::inline`]).
    #[must_use]
    pub const fn with_inline(mut self, data: &'a [u8]) -> Self {
        self.inline = Some(data);
        self
    }
}

/// A receive work request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecvWr<'a> {
    /// Caller's id.
    pub wr_id: u64,
    /// The buffers, filled in order.
    pub sgl: &'a [Sge],
}

/// Completion opcode (the engine's `WcOpcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcOpcode {
    /// Send (any variant).
    Send,
    /// RDMA Write (with or without immediate).
    RdmaWrite,
    /// RDMA Read.
    RdmaRead,
    /// Compare and Swap.
    CompSwap,
    /// Fetch and Add.
    FetchAdd,
    /// Local Invalidate.
    LocalInv,
    /// Bind memory window.
    BindMw,
    /// Fast-register.
    RegMr,
    /// A receive consumed by a Send.
    Recv,
    /// A receive consumed by a Write with Immediate.
    RecvRdmaWithImm,
}

/// Completion status (the engine's `WcStatus`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WcStatus {
    /// Success.
    Success,
    /// Message longer than the receive buffer.
    LocalLength,
    /// Local QP operation error.
    LocalQpOperation,
    /// An SGE failed its checks.
    LocalProtection,
    /// Flushed: the QP left full operation.
    WrFlush,
    /// Memory window bind failed.
    MwBind,
    /// The peer found the request invalid.
    RemoteInvalidRequest,
    /// The peer refused access.
    RemoteAccess,
    /// The peer failed to execute the request.
    RemoteOperation,
    /// The connection failed.
    Fatal,
    /// Invalidation failed.
    InvalidateError,
    /// Any other error.
    General,
}

impl WcStatus {
    /// Whether this is [`WcStatus::Success`].
    #[must_use]
    pub const fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }
}

/// Which completion queue a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CqKind {
    /// The send queue's CQ.
    Send,
    /// The receive queue's CQ.
    Recv,
}

/// A work completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Completion {
    /// Send or receive side.
    pub cq: CqKind,
    /// Work request id.
    pub wr_id: u64,
    /// Status.
    pub status: WcStatus,
    /// Opcode.
    pub opcode: WcOpcode,
    /// Bytes transferred (receives: bytes placed; Read: bytes read).
    pub byte_len: u32,
    /// Immediate data, if any.
    pub imm: Option<u32>,
    /// STag the peer's Send with Invalidate invalidated.
    pub invalidated: Option<u32>,
    /// The message asked for a solicited event.
    pub solicited: bool,
    /// Raw Terminate code (Layer/EType/Code) for a request a Terminate
    /// answered, else 0.
    pub vendor_err: u32,
    /// The request was posted with [`SendWr::internal`].
    pub internal: bool,
}

/// Asynchronous event kinds the core reports (a subset of the engine's
/// `AsyncEventKind`, same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AsyncKind {
    /// Local catastrophic error (e.g. CRC error).
    QpFatal,
    /// The peer sent an invalid request.
    QpRequestError,
    /// The peer violated memory protection.
    QpAccessError,
    /// The connection closed gracefully.
    LlpClosed,
    /// The connection was reset or lost (or aborted locally).
    LlpReset,
    /// The connection closed in a way that is not a graceful close.
    BadClose,
    /// A Terminate arrived from the peer.
    TerminateReceived,
    /// QP with an SRQ entered ERROR: the last WQE was reached.
    QpLastWqeReached,
}

/// An asynchronous event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    /// Kind.
    pub kind: AsyncKind,
    /// The Terminate code sent or received, if any.
    pub term: Option<TermCode>,
}

/// Something the engine must do with the connection's TCP stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkAction {
    /// Half-close: send FIN after every byte already handed out (graceful
    /// close).
    SendFin,
    /// Close both directions in order after every byte handed out (after a
    /// Terminate went out).
    Shutdown,
    /// Reset the connection (abortive close).
    Reset,
}

/// An output of the connection besides bytes and completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Output {
    /// The QP changed state.
    State {
        /// Old state.
        from: QpState,
        /// New state.
        to: QpState,
    },
    /// An asynchronous event for the application.
    Event(AsyncEvent),
    /// An action on the TCP stream.
    Link(LinkAction),
}

/// Why a post was refused (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// The QP state does not accept posts of this kind.
    #[error("QP in state {0} does not accept this post")]
    InvalidState(QpState),
    /// The queue is full.
    #[error("queue full (depth {0})")]
    QueueFull(u32),
    /// The request is malformed (local misuse).
    #[error("invalid work request: {0}")]
    Invalid(&'static str),
    /// A receive posted to a QP that uses a shared receive queue.
    #[error("the QP uses a shared receive queue")]
    HasSrq,
    /// More scatter/gather elements than the QP accepts.
    #[error("{count} SGEs exceed the maximum of {max}")]
    TooManySges {
        /// SGEs given.
        count: usize,
        /// [`crate::conn::Config::max_send_sge`] or `max_recv_sge`.
        max: usize,
    },
    /// Inline payload longer than the QP accepts.
    #[error("inline payload of {len} bytes exceeds the maximum of {max}")]
    InlineTooLarge {
        /// Bytes given.
        len: usize,
        /// [`crate::conn::Config::max_inline`].
        max: usize,
    },
}
