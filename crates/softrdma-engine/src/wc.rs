//! Work completions: what a completion queue hands back, like `ibv_wc`.

/// Outcome of a work request, like `ibv_wc_status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// The work request completed successfully.
    Success,
    /// Local length error: a received message was longer than the posted
    /// receive buffer, or a work request exceeded a size limit.
    LocalLength,
    /// Local QP operation error: an internal inconsistency of the QP, such as
    /// a work request that is not valid for the QP's state or configuration.
    LocalQpOperation,
    /// Local protection error: an SGE names an invalid lkey, memory outside
    /// its region, or lacks the access the operation needs.
    LocalProtection,
    /// The work request was flushed because the QP entered the ERROR state.
    WrFlush,
    /// Memory window bind error.
    MwBind,
    /// The remote peer found the request invalid (bad opcode, message too
    /// long for its receive, no receive posted, ...).
    RemoteInvalidRequest,
    /// The remote peer refused access (bad STag, bounds, rights).
    RemoteAccess,
    /// The remote peer failed to execute the operation.
    RemoteOperation,
    /// The connection failed (lost, reset) while the request was in flight.
    Fatal,
    /// A memory region or window could not be invalidated.
    InvalidateError,
    /// General error not covered by another status.
    General,
    /// softrdma: a message addressed to a proxy QP's proxy was discarded
    /// because the proxy no longer runs (a proxy mismatch); an
    /// [`AsyncEventKind::ProxyMismatch`](crate::AsyncEventKind::ProxyMismatch)
    /// event reports it too. The receive buffer holds the message's bytes,
    /// but the message was not processed.
    ProxyDiscarded,
}

impl WcStatus {
    /// Whether the request succeeded.
    pub const fn is_success(self) -> bool {
        matches!(self, WcStatus::Success)
    }

    /// The name ibverbs uses for this status.
    pub const fn name(self) -> &'static str {
        match self {
            WcStatus::Success => "IBV_WC_SUCCESS",
            WcStatus::LocalLength => "IBV_WC_LOC_LEN_ERR",
            WcStatus::LocalQpOperation => "IBV_WC_LOC_QP_OP_ERR",
            WcStatus::LocalProtection => "IBV_WC_LOC_PROT_ERR",
            WcStatus::WrFlush => "IBV_WC_WR_FLUSH_ERR",
            WcStatus::MwBind => "IBV_WC_MW_BIND_ERR",
            WcStatus::RemoteInvalidRequest => "IBV_WC_REM_INV_REQ_ERR",
            WcStatus::RemoteAccess => "IBV_WC_REM_ACCESS_ERR",
            WcStatus::RemoteOperation => "IBV_WC_REM_OP_ERR",
            WcStatus::Fatal => "IBV_WC_FATAL_ERR",
            WcStatus::InvalidateError => "IBV_WC_INV_EECN_ERR",
            WcStatus::General => "IBV_WC_GENERAL_ERR",
            WcStatus::ProxyDiscarded => "SOFTRDMA_WC_PROXY_DISCARDED",
        }
    }
}

impl core::fmt::Display for WcStatus {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a completed work request did, like `ibv_wc_opcode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A Send (any variant) from the send queue.
    Send,
    /// An RDMA Write (with or without immediate data).
    RdmaWrite,
    /// An RDMA Read.
    RdmaRead,
    /// An atomic compare-and-swap.
    CompSwap,
    /// An atomic fetch-and-add.
    FetchAdd,
    /// A memory window bind.
    BindMw,
    /// A local invalidate.
    LocalInv,
    /// A fast-register of a memory region.
    RegMr,
    /// A receive that consumed a Send (with or without immediate data).
    Recv,
    /// A receive consumed by an RDMA Write with immediate data.
    RecvRdmaWithImm,
    /// softrdma: a received message that a proxy handler served completely
    /// (see [`crate::proxy`]). Nothing is left for the application to do;
    /// `wr_id` names the receive it consumed, so its buffer can be reposted.
    ProxyNoop,
}

/// Completion flags (`ibv_wc_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WcFlags(u8);

impl WcFlags {
    /// No flag.
    pub const NONE: WcFlags = WcFlags(0);
    /// `imm_data` is valid.
    pub const WITH_IMM: WcFlags = WcFlags(1);
    /// `invalidated_rkey` is valid: the Send carried an Invalidate STag.
    pub const WITH_INV: WcFlags = WcFlags(2);
    /// The received Send was a solicited one.
    pub const SOLICITED: WcFlags = WcFlags(4);
    /// softrdma: a proxy handler served part of this received message;
    /// `proxy_note` says what remains (see [`crate::proxy`]).
    pub const PROXY_PARTIAL: WcFlags = WcFlags(8);
    /// softrdma: the proxy already reposted this completion's receive
    /// buffer (a proxy QP attached with
    /// [`ProxyAttach::recycle_receives`](crate::proxy::ProxyAttach::recycle_receives));
    /// the application must not post it again.
    pub const PROXY_RECYCLED: WcFlags = WcFlags(16);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: WcFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets of flags.
    #[must_use]
    pub const fn union(self, other: WcFlags) -> WcFlags {
        WcFlags(self.0 | other.0)
    }
}

impl core::ops::BitOr for WcFlags {
    type Output = WcFlags;
    fn bitor(self, rhs: WcFlags) -> WcFlags {
        self.union(rhs)
    }
}

/// One work completion, like `ibv_wc`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The `wr_id` of the work request.
    pub wr_id: u64,
    /// Success or the error that ended the request.
    pub status: WcStatus,
    /// What the request was. For error completions of receives this is
    /// [`WcOpcode::Recv`].
    pub opcode: WcOpcode,
    /// Bytes transferred: received bytes for receives, the payload length for
    /// RDMA Read; 0 for other send-queue completions.
    pub byte_len: u32,
    /// Immediate data, valid when `flags` contains [`WcFlags::WITH_IMM`]
    /// (host byte order).
    pub imm_data: u32,
    /// The STag invalidated by a Send with Invalidate, valid when `flags`
    /// contains [`WcFlags::WITH_INV`].
    pub invalidated_rkey: u32,
    /// The number of the QP the request was posted to.
    pub qp_num: u32,
    /// Completion flags.
    pub flags: WcFlags,
    /// Vendor error: the raw Terminate code (layer, type, code) when the
    /// error came from a Terminate, else 0.
    pub vendor_err: u32,
    /// For completions of a proxy QP: the completion's sequence number, its
    /// position (from 0) in the QP's completion order kept by the proxy.
    /// 0 on other QPs.
    pub proxy_seq: u64,
    /// With [`WcFlags::PROXY_PARTIAL`]: the note the proxy handler returned.
    pub proxy_note: u64,
}

impl WorkCompletion {
    /// A successful completion with no byte count and no flags.
    pub const fn success(wr_id: u64, opcode: WcOpcode, qp_num: u32) -> Self {
        WorkCompletion {
            wr_id,
            status: WcStatus::Success,
            opcode,
            byte_len: 0,
            imm_data: 0,
            invalidated_rkey: 0,
            qp_num,
            flags: WcFlags::NONE,
            vendor_err: 0,
            proxy_seq: 0,
            proxy_note: 0,
        }
    }

    /// An error completion.
    pub const fn error(wr_id: u64, opcode: WcOpcode, qp_num: u32, status: WcStatus) -> Self {
        WorkCompletion {
            status,
            ..WorkCompletion::success(wr_id, opcode, qp_num)
        }
    }
}
