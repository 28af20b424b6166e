//! The memory trait: how the protocol core asks the engine about
//! registered memory without ever touching it.
//!
//! The core names memory only by [`Span`]s: an opaque region handle chosen
//! by the implementation ([`Memory::Region`], for the engine an
//! `Arc<Memory>`, for the simulation an index) plus an offset and a length
//! inside it. It asks the implementation to
//!
//! * check an STag the peer used ([`Memory::remote`]: valid, same protection
//!   domain, access rights, bounds) and an lkey the application used
//!   ([`Memory::local`]);
//! * execute an atomic on an 8-byte target ([`Memory::atomic`]);
//! * invalidate an STag, bind a window, fast-register a region
//!   ([`Memory::invalidate`], [`Memory::local_op`]);
//! * take a receive from a shared receive queue ([`Memory::srq_pop`]);
//! * and, only where the engine is not zero-copy or for the CRC, copy bytes
//!   in and out ([`Memory::copy_in`], [`Memory::copy_out`],
//!   [`Memory::crc_update`]).
//!
//! An implementation is per QP: it knows the QP's protection domain, so the
//! PD is never an argument.

use core::fmt;

use softrdma_wire::crc::Crc32c;
use softrdma_wire::errcode::TermError;
use softrdma_wire::rdmap::atomic::AtomicRequestRepr;

/// A range of registered memory: `len` bytes at `offset` inside `region`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span<R> {
    /// The region handle (opaque to the core).
    pub region: R,
    /// Byte offset inside the region.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

impl<R: Clone> Span<R> {
    /// The sub-span `[at, at + len)` of this span (clamped to it).
    #[must_use]
    pub fn slice(&self, at: usize, len: usize) -> Span<R> {
        let at = at.min(self.len);
        Span {
            region: self.region.clone(),
            offset: self.offset + at,
            len: len.min(self.len - at),
        }
    }
}

/// The access a remote peer asks for with an STag.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RemoteAccess {
    /// RDMA Write target.
    Write,
    /// RDMA Read source.
    Read,
    /// Atomic target (RFC 7306).
    Atomic,
}

/// Why an STag the peer used was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum RemoteAccessError {
    /// No such STag, invalidated, or wrong key.
    #[error("invalid STag")]
    InvalidStag,
    /// The STag belongs to another protection domain (or a window bound to
    /// another QP).
    #[error("STag not associated with this stream")]
    StagNotAssociated,
    /// The region lacks the access asked for.
    #[error("access rights violation")]
    AccessRights,
    /// The range is outside the region.
    #[error("base or bounds violation")]
    BaseOrBounds,
    /// Tagged offset plus length wraps.
    #[error("tagged offset wrap")]
    ToWrap,
}

impl RemoteAccessError {
    /// The Terminate error for this refusal: DDP Tagged Buffer errors for a
    /// tagged segment (RDMA Write, Read Response), RDMAP Remote Protection
    /// errors for a Read Request or atomic (the engine's mapping).
    #[must_use]
    pub const fn term_error(self, tagged: bool) -> TermError {
        match (tagged, self) {
            (true, Self::InvalidStag) => TermError::DdpTaggedInvalidStag,
            (true, Self::StagNotAssociated) => TermError::DdpTaggedStagNotAssociated,
            (true, Self::AccessRights | Self::BaseOrBounds) => TermError::DdpTaggedBaseOrBounds,
            (true, Self::ToWrap) => TermError::DdpTaggedToWrap,
            (false, Self::InvalidStag) => TermError::RdmapInvalidStag,
            (false, Self::StagNotAssociated) => TermError::RdmapStagNotAssociated,
            (false, Self::AccessRights) => TermError::RdmapAccessRights,
            (false, Self::BaseOrBounds) => TermError::RdmapBaseOrBounds,
            (false, Self::ToWrap) => TermError::RdmapToWrap,
        }
    }
}

/// Why an SGE was refused at post time (the request completes with
/// [`crate::types::WcStatus::LocalProtection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum LocalAccessError {
    /// No such lkey, or wrong key.
    #[error("invalid lkey")]
    InvalidLkey,
    /// The region belongs to another protection domain.
    #[error("lkey of another protection domain")]
    PdMismatch,
    /// The SGE is outside the region.
    #[error("SGE outside the region")]
    OutOfBounds,
    /// The operation writes but the region lacks local write access.
    #[error("no local write access")]
    NoLocalWrite,
}

/// Why an STag could not be invalidated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum InvalidateError {
    /// No such STag.
    #[error("invalid STag")]
    InvalidStag,
    /// The STag belongs to another protection domain.
    #[error("STag of another protection domain")]
    PdMismatch,
    /// The STag cannot be invalidated (a plain registered region).
    #[error("STag cannot be invalidated")]
    CannotInvalidate,
}

impl InvalidateError {
    /// The Terminate error for a Send with Invalidate whose STag could not
    /// be invalidated (RFC 5040 section 7.2): "STag cannot be invalidated"
    /// as a Remote Protection error when the STag belongs to another
    /// protection domain, as a Remote Operation error otherwise (as Linux
    /// siw reports it).
    #[must_use]
    pub const fn term_error(self) -> TermError {
        match self {
            Self::PdMismatch => TermError::RdmapProtectionCannotInvalidate,
            Self::InvalidStag | Self::CannotInvalidate => TermError::RdmapOperationCannotInvalidate,
        }
    }
}

/// A local memory operation executed when posted (like the engine: bind,
/// fast-register and local invalidate take effect at post time and
/// complete in send-queue order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LocalOp {
    /// Local Invalidate of `rkey`.
    Invalidate {
        /// The STag.
        rkey: u32,
    },
    /// Bind memory window `mw` to `[addr, addr + len)` of region `mr`.
    BindMw {
        /// Window STag.
        mw: u32,
        /// Region lkey.
        mr: u32,
        /// Start address.
        addr: u64,
        /// Length.
        len: u64,
        /// Access flags (engine encoding).
        access: u32,
        /// The window's new 8-bit key (`None`: the engine picks one, at
        /// random in the engine).
        key: Option<u8>,
    },
    /// Fast-register region `mr` at `iova`.
    FastReg {
        /// Region key.
        mr: u32,
        /// I/O virtual address.
        iova: u64,
        /// Length.
        len: u64,
        /// Access flags (engine encoding).
        access: u32,
    },
}

/// A receive taken from a shared receive queue, its SGEs already checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedRecv<R> {
    /// Work request id.
    pub wr_id: u64,
    /// The buffers, in order.
    pub segs: Vec<Span<R>>,
}

/// What the core needs from the engine's memory (one implementation per QP;
/// it knows the QP's protection domain). See the [module docs](self).
pub trait Memory {
    /// The engine's handle of a registered range (for example an
    /// `Arc<Memory>`); the core only clones and passes it back.
    type Region: Clone + fmt::Debug;

    /// Checks `[to, to + len)` of STag `stag` for a remote `access` and
    /// returns where it is.
    ///
    /// # Errors
    ///
    /// The [`RemoteAccessError`] the peer is told about.
    fn remote(
        &mut self,
        stag: u32,
        access: RemoteAccess,
        to: u64,
        len: u64,
    ) -> Result<Span<Self::Region>, RemoteAccessError>;

    /// Checks an SGE of a posted work request (`write`: the operation writes
    /// into it: receives, Read sinks, atomic result buffers).
    ///
    /// # Errors
    ///
    /// The [`LocalAccessError`] the work request completes with.
    fn local(
        &mut self,
        lkey: u32,
        addr: u64,
        len: u32,
        write: bool,
    ) -> Result<Span<Self::Region>, LocalAccessError>;

    /// Executes `req` on the 8-byte `target` (checked by
    /// [`Memory::remote`]) and returns the original value, or `None` if the
    /// target is not usable.
    fn atomic(&mut self, target: &Span<Self::Region>, req: &AtomicRequestRepr) -> Option<u64>;

    /// Invalidates `stag` (`remote`: asked by the peer's Send with
    /// Invalidate; else a Local Invalidate).
    ///
    /// # Errors
    ///
    /// Why it could not be invalidated.
    fn invalidate(&mut self, stag: u32, remote: bool) -> Result<(), InvalidateError>;

    /// Executes a bind or fast-register. `Err(())`: the operation failed
    /// (the request completes with an error status).
    #[allow(clippy::result_unit_err)]
    fn local_op(&mut self, op: &LocalOp) -> Result<(), ()>;

    /// A stamp of the registrations ([`crate::conn::Config::keep_recvs`]):
    /// a value that changes whenever a change of any registration could
    /// change what [`Memory::local`] answers (a region deregistered,
    /// invalidated, re-registered with other rights or another range), and
    /// is read before the check it stamps. `None` (the default): receive
    /// buffers are never kept.
    fn recv_stamp(&mut self) -> Option<u64> {
        None
    }

    /// Whether a checked span may be kept past its receive's completion
    /// ([`crate::conn::Config::keep_recvs`]): holding it must not keep
    /// anyone waiting (memory lent for one call waits for every
    /// reference). `false` by default.
    fn may_keep(&mut self, span: &Span<Self::Region>) -> bool {
        let _ = span;
        false
    }

    /// Takes the next receive of the shared receive queue (only asked when
    /// the connection was configured with an SRQ).
    fn srq_pop(&mut self) -> Option<SharedRecv<Self::Region>> {
        None
    }

    /// Copies `bytes` into `dst` at `at` (copying-mode placement, atomic
    /// results). `false` if out of range.
    fn copy_in(&mut self, dst: &Span<Self::Region>, at: usize, bytes: &[u8]) -> bool;

    /// Copies `out.len()` bytes from `src` at `at` into `out` (small payloads,
    /// the byte-stream transmit mode). `false` if out of range.
    fn copy_out(&mut self, src: &Span<Self::Region>, at: usize, out: &mut [u8]) -> bool;

    /// Feeds the bytes of `src` to `crc` (transmit CRC of a gathered
    /// payload). `false` if out of range.
    fn crc_update(&mut self, src: &Span<Self::Region>, crc: &mut Crc32c) -> bool {
        let mut buf = [0u8; 256];
        let mut at = 0;
        while at < src.len {
            let n = (src.len - at).min(buf.len());
            let Some(b) = buf.get_mut(..n) else {
                return false;
            };
            if !self.copy_out(src, at, b) {
                return false;
            }
            crc.update(b);
            at += n;
        }
        true
    }
}
