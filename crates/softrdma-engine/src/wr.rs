//! Work requests: what applications post to send and receive queues, like
//! `ibv_send_wr` / `ibv_recv_wr`.
//!
//! Scatter/gather elements name memory by `lkey` and address exactly as in
//! ibverbs ([`Sge`]). They are checked against the registration table when
//! the request is posted; a bad one completes with
//! [`WcStatus::LocalProtection`](crate::WcStatus::LocalProtection). A posted
//! request holds a reference to the memory it names, so memory stays alive
//! until the request completes even if the region is deregistered meanwhile.

// An SGE names memory: it is defined in `mr` (which builds it), so that
// `mr` does not import this module.
#[doc(inline)]
pub use crate::mr::Sge;

pub(crate) use crate::mr::LocalSeg;
use crate::mr::{Access, MemoryRegion, MemoryWindow};

/// Send flags (`ibv_send_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SendFlags(u8);

impl SendFlags {
    /// No flag: an unsignaled request (unless the QP signals all).
    pub const NONE: SendFlags = SendFlags(0);
    /// Generate a completion when the request completes.
    pub const SIGNALED: SendFlags = SendFlags(1);
    /// Solicited event for Sends: the receiver's CQ wakes solicited-only
    /// waiters.
    pub const SOLICITED: SendFlags = SendFlags(2);
    /// Fence: do not start this request until all earlier RDMA Reads and
    /// atomics of the queue have completed.
    pub const FENCE: SendFlags = SendFlags(4);
    /// Inline: the payload is copied when posted (see [`SendWr::inline`]).
    pub const INLINE: SendFlags = SendFlags(8);

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: SendFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Both sets of flags.
    #[must_use]
    pub const fn union(self, other: SendFlags) -> SendFlags {
        SendFlags(self.0 | other.0)
    }
}

impl core::ops::BitOr for SendFlags {
    type Output = SendFlags;
    fn bitor(self, rhs: SendFlags) -> SendFlags {
        self.union(rhs)
    }
}

/// The operation of a send-queue work request, with its own fields.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum SendOp<'a> {
    /// Send: the payload goes to the peer's next posted receive.
    Send,
    /// Send with immediate data, delivered in the peer's receive completion.
    SendWithImm {
        /// Immediate data (host order).
        imm: u32,
    },
    /// Send with Invalidate: the peer invalidates `invalidate_rkey` before
    /// completing the receive.
    SendWithInv {
        /// The peer's STag to invalidate.
        invalidate_rkey: u32,
    },
    /// RDMA Write of the payload to the peer's memory.
    Write {
        /// Remote address (Tagged Offset).
        remote_addr: u64,
        /// Remote key (STag).
        rkey: u32,
    },
    /// RDMA Write followed by immediate data that consumes a receive.
    WriteWithImm {
        /// Remote address (Tagged Offset).
        remote_addr: u64,
        /// Remote key (STag).
        rkey: u32,
        /// Immediate data (host order).
        imm: u32,
    },
    /// RDMA Read of `sg_list[0].length` bytes from the peer into the single
    /// local SGE.
    Read {
        /// Remote address (Tagged Offset).
        remote_addr: u64,
        /// Remote key (STag).
        rkey: u32,
    },
    /// Atomic fetch-and-add of a 64-bit value at an 8-byte aligned remote
    /// address; the original value lands in the single 8-byte local SGE.
    FetchAdd {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key (STag).
        rkey: u32,
        /// Value to add.
        add: u64,
    },
    /// Atomic compare-and-swap of a 64-bit value; the original value lands in
    /// the single 8-byte local SGE.
    CmpSwap {
        /// Remote address (8-byte aligned).
        remote_addr: u64,
        /// Remote key (STag).
        rkey: u32,
        /// Value to compare with.
        compare: u64,
        /// Value to store if equal.
        swap: u64,
    },
    /// Invalidate a local memory window or fast-register region.
    LocalInv {
        /// The STag to invalidate.
        rkey: u32,
    },
    /// Bind a type 2 memory window to part of a region.
    BindMw {
        /// The window.
        mw: &'a MemoryWindow,
        /// The region (must allow [`Access::MW_BIND`]).
        mr: &'a MemoryRegion,
        /// Start address of the window within the region.
        addr: u64,
        /// Length of the window.
        length: u64,
        /// Remote access the window grants.
        access: Access,
        /// The key byte (low 8 bits) of the window's new STag: `Some` to
        /// choose it, as a verbs application does with `ibv_inc_rkey`;
        /// `None` lets the engine pick a fresh one. Read the new STag with
        /// [`MemoryWindow::rkey`](crate::MemoryWindow::rkey) after posting.
        key: Option<u8>,
    },
    /// Fast-register a region allocated with
    /// [`ProtectionDomain::alloc_mr`](crate::ProtectionDomain::alloc_mr):
    /// give it an address, a length, rights and a fresh key.
    FastReg {
        /// The region.
        mr: &'a MemoryRegion,
        /// The address the region will answer to.
        iova: u64,
        /// Length in bytes (at most the region's capacity).
        length: u64,
        /// Access rights.
        access: Access,
    },
}

/// A send-queue work request (`ibv_send_wr`).
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// What to do.
    pub op: SendOp<'a>,
    /// The local memory: payload source for Send and Write, sink for Read and
    /// atomics.
    pub sg_list: &'a [Sge],
    /// Inline payload: with [`SendFlags::INLINE`], Send and Write take their
    /// payload from here (copied at post time, at most the QP's
    /// `max_inline_data` bytes) and ignore `sg_list`.
    pub inline: &'a [u8],
    /// Flags.
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    /// A request with no SGEs and no flags.
    pub const fn new(wr_id: u64, op: SendOp<'a>) -> Self {
        SendWr {
            wr_id,
            op,
            sg_list: &[],
            inline: &[],
            flags: SendFlags::NONE,
        }
    }

    /// With this scatter/gather list.
    #[must_use]
    pub const fn sg_list(mut self, sg_list: &'a [Sge]) -> Self {
        self.sg_list = sg_list;
        self
    }

    /// With this inline payload (sets [`SendFlags::INLINE`]).
    #[must_use]
    pub const fn inline(mut self, data: &'a [u8]) -> Self {
        self.inline = data;
        self.flags = self.flags.union(SendFlags::INLINE);
        self
    }

    /// With these flags added.
    #[must_use]
    pub const fn flags(mut self, flags: SendFlags) -> Self {
        self.flags = self.flags.union(flags);
        self
    }

    /// Signaled (a completion is generated).
    #[must_use]
    pub const fn signaled(self) -> Self {
        self.flags(SendFlags::SIGNALED)
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Caller's identifier, returned in the completion.
    pub wr_id: u64,
    /// Where an incoming Send's payload goes, in order.
    pub sg_list: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive into these SGEs.
    pub const fn new(wr_id: u64, sg_list: &'a [Sge]) -> Self {
        RecvWr { wr_id, sg_list }
    }
}

/// A posted receive, validated: ready for the receive path or an SRQ.
#[derive(Debug)]
pub(crate) struct RecvWqe {
    /// Caller's identifier.
    pub(crate) wr_id: u64,
    /// The validated SGEs.
    pub(crate) segs: RecvSegs,
    /// Sum of the SGE lengths.
    #[cfg_attr(not(test), allow(dead_code))] // checked by the SRQ's tests
    pub(crate) total_len: usize,
}

/// The validated SGEs of a receive: one (the usual case) without an
/// allocation per posted receive.
#[derive(Debug)]
pub(crate) enum RecvSegs {
    /// A single SGE.
    One(LocalSeg),
    /// Any other number.
    Many(Vec<LocalSeg>),
}

impl RecvSegs {
    /// As a vector (the proxy's message data).
    pub(crate) fn into_vec(self) -> Vec<LocalSeg> {
        match self {
            RecvSegs::One(s) => vec![s],
            RecvSegs::Many(v) => v,
        }
    }
}

impl From<Vec<LocalSeg>> for RecvSegs {
    fn from(mut v: Vec<LocalSeg>) -> RecvSegs {
        match v.pop() {
            Some(s) if v.is_empty() => RecvSegs::One(s),
            Some(s) => {
                v.push(s);
                RecvSegs::Many(v)
            }
            None => RecvSegs::Many(v),
        }
    }
}

impl std::ops::Deref for RecvSegs {
    type Target = [LocalSeg];
    fn deref(&self) -> &[LocalSeg] {
        match self {
            RecvSegs::One(s) => std::slice::from_ref(s),
            RecvSegs::Many(v) => v,
        }
    }
}

impl IntoIterator for RecvSegs {
    type Item = LocalSeg;
    type IntoIter = std::vec::IntoIter<LocalSeg>;
    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
    }
}
