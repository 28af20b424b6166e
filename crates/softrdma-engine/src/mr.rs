//! Memory regions, memory windows and the registration (STag) table.
//!
//! RFC 5040 section 2.1 and RFC 5041 section 2: a Steering Tag (STag)
//! "identifies a Data Sink's tagged buffer"; with a Tagged Offset (TO) it
//! names a byte of registered memory. Here an STag is, as in Linux siw,
//!
//! ```text
//!  31                                8 7          0
//! +-----------------------------------+------------+
//! |     index (24 bits, never 0)      | key (8 b.) |
//! +-----------------------------------+------------+
//! ```
//!
//! The index selects an entry of the device's registration table and is
//! drawn at random from the whole 24-bit space (Linux siw likewise starts
//! each index allocation at a random value), so one STag says nothing about
//! the others; the key is random too and changes on every re-registration,
//! window bind and fast-register, so a stale or guessed STag fails with
//! "Invalid STag". A guess must find both (32 random bits), and each wrong
//! guess costs the peer its connection (a Terminate).
//! Index 0 is never used: STags 0 to 255 (among them the STag 1 used by
//! peer-to-peer RTR messages) are never valid. On iWARP the local key and the
//! remote key of a region are the same STag.
//!
//! Remote access checks follow RFC 5040 section 7.2 / RFC 5041 section 7.2
//! in this order (see `StagTable::remote`): the STag (exists, valid, key),
//! the protection domain, the access rights, then the range (Tagged Offset
//! wrap, base and bounds).
//!
//! The table itself, with [`Access`] and the errors of its checks (all
//! re-exported here), is a crate-private module below the device that owns
//! it; this module has the handles and the protocol core's view of memory.

use std::sync::Arc;

use softrdma_wire::rdmap::atomic::{AtomicOpcode, AtomicRequestRepr};

use crate::pd::ProtectionDomain;
pub use crate::stags::{
    Access, BindError, FastRegError, InvalidateError, LocalAccessError, RangeError, RegError,
    RemoteAccessError,
};
pub(crate) use crate::stags::{LocalSeg, NewEntry, NewKind, StagTable, WindowBind};
use crate::sys::mem::Memory;
#[cfg(test)] // table internals and a type the unit tests below use
use crate::{
    stags::{MAX_INDEX, Target, fresh_key, stag},
    wc::WcStatus,
};

/// A scatter/gather element: `length` bytes at address `addr` of the memory
/// region with local key `lkey` (`ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sge {
    /// Address within the region (the region's [`MemoryRegion::addr`] plus
    /// an offset).
    pub addr: u64,
    /// Number of bytes.
    pub length: u32,
    /// Local key of the region.
    pub lkey: u32,
}

// ---------------------------------------------------------------------------
// The table's entry points that take handles
// ---------------------------------------------------------------------------

// Here rather than in `stags.rs`: the table's module is below the handles.
impl StagTable {
    /// Binds type 2 window `mw` to `[addr, addr + len)` of region `mr`
    /// granting `access` (remote flags only), with a fresh key. Returns the
    /// window's new rkey.
    ///
    /// Rules: same device and protection domain; the region is valid and has
    /// [`Access::MW_BIND`]; the window is not bound; remote write or atomic
    /// on the window needs local write on the region; the range is inside the
    /// region. The window holds the region's memory until it is invalidated
    /// or dropped.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn bind_mw(
        &self,
        mw: &MemoryWindow,
        mr: &MemoryRegion,
        addr: u64,
        len: u64,
        access: Access,
    ) -> Result<u32, BindError> {
        self.bind_mw_with_key(mw, mr, addr, len, access, None)
    }

    /// [`StagTable::bind_mw`] with the key byte of the window's new STag
    /// chosen by the caller (`Some`; as `ibv_inc_rkey` does in verbs) or
    /// fresh (`None`).
    pub(crate) fn bind_mw_with_key(
        &self,
        mw: &MemoryWindow,
        mr: &MemoryRegion,
        addr: u64,
        len: u64,
        access: Access,
        key: Option<u8>,
    ) -> Result<u32, BindError> {
        if !std::ptr::eq(self, mw.pd.device().stags())
            || !std::ptr::eq(self, mr.pd.device().stags())
        {
            return Err(BindError::OtherDevice);
        }
        if mw.pd.id() != mr.pd.id() {
            return Err(BindError::PdMismatch);
        }
        self.bind_at(
            mw.pd.id(),
            mw.index,
            mr.index,
            WindowBind {
                addr,
                len,
                access,
                key,
            },
        )
    }

    /// Fast-registers region `mr` (from `alloc_mr`): it answers to `[iova,
    /// iova + len)` with `access` and a fresh key, mapped to the start of
    /// its memory. Returns the new STag. The region must be invalid (never
    /// registered or invalidated).
    #[allow(dead_code)] // used by the data path
    pub(crate) fn fast_reg(
        &self,
        mr: &MemoryRegion,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<u32, FastRegError> {
        if !std::ptr::eq(self, mr.pd.device().stags()) {
            return Err(FastRegError::OtherDevice);
        }
        self.fast_reg_at(None, mr.index, mr.mem.len(), iova, len, access)
    }
}

/// Why a region could not be deregistered. Gives the region back.
#[derive(Debug, thiserror::Error)]
#[error("cannot deregister: {windows} memory window(s) are still bound to the region")]
pub struct DeregError {
    region: MemoryRegion,
    windows: u32,
}

impl DeregError {
    /// Number of windows still bound.
    pub fn windows(&self) -> u32 {
        self.windows
    }

    /// The region, still registered.
    pub fn into_region(self) -> MemoryRegion {
        self.region
    }
}

// ---------------------------------------------------------------------------
// Public handles
// ---------------------------------------------------------------------------

/// A registered memory region (`ibv_mr`). Dropping it deregisters it.
///
/// The region owns (or, for [`ProtectionDomain::register_raw`], borrows) a
/// buffer that remote peers may write at any time once they know its rkey.
/// Local access is by copy ([`MemoryRegion::read`], [`MemoryRegion::write`])
/// or through [`MemoryRegion::as_ptr`]; no `&[u8]` over the buffer is ever
/// handed out. Offsets in these methods count from the start of the buffer;
/// addresses in SGEs and remote operations count from [`MemoryRegion::addr`].
///
/// Work requests that name the region keep its memory alive until they
/// complete, even if the region is deregistered meanwhile.
#[derive(Debug)]
pub struct MemoryRegion {
    pub(crate) pd: ProtectionDomain,
    pub(crate) index: u32,
    pub(crate) mem: Arc<Memory>,
    fast_reg: bool,
}

impl MemoryRegion {
    /// Registers `mem` in the table of `pd`'s device.
    pub(crate) fn new(
        pd: &ProtectionDomain,
        mem: Arc<Memory>,
        access: Access,
        fast_reg: bool,
    ) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        let max = pd.device().attr().max_mr_size;
        let len = mem.len() as u64;
        if len > max {
            return Err(RegError::TooLarge { len, max });
        }
        let (iova, kind, valid) = if fast_reg {
            (0, NewKind::FastRegRegion, false)
        } else {
            (mem.base() as u64, NewKind::Region, true)
        };
        let index = pd.device().stags().insert(NewEntry {
            pd: pd.id(),
            access,
            iova,
            len: if fast_reg { 0 } else { len },
            mem: Some(Arc::clone(&mem)),
            valid,
            kind,
        })?;
        Ok(MemoryRegion {
            pd: pd.clone(),
            index,
            mem,
            fast_reg,
        })
    }

    /// The local key (on iWARP the same STag as [`MemoryRegion::rkey`]).
    /// Changes on [`MemoryRegion::rereg`] and fast-register.
    pub fn lkey(&self) -> u32 {
        self.pd.device().stags().stag_of(self.index)
    }

    /// The remote key (STag) to give peers.
    pub fn rkey(&self) -> u32 {
        self.lkey()
    }

    /// The STag index (the upper 24 bits of the keys; constant).
    pub fn index(&self) -> u32 {
        self.index
    }

    fn info(&self) -> (bool, u64, u64, Access) {
        self.pd
            .device()
            .stags()
            .info(self.index)
            .unwrap_or((false, 0, 0, Access::NONE))
    }

    /// The address the region answers to (SGE addresses and remote Tagged
    /// Offsets): by default the real address of the buffer, as with
    /// `ibv_reg_mr`; for a fast-register region, the `iova` of the last
    /// fast-register.
    pub fn addr(&self) -> u64 {
        self.info().1
    }

    /// Registered length in bytes (for a fast-register region: of the last
    /// fast-register, 0 before).
    pub fn len(&self) -> usize {
        usize::try_from(self.info().2).unwrap_or(usize::MAX)
    }

    /// Whether the registered length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Size of the buffer in bytes.
    pub fn capacity(&self) -> usize {
        self.mem.len()
    }

    /// Access rights.
    pub fn access(&self) -> Access {
        self.info().3
    }

    /// Whether the STag is currently valid (false for a fast-register
    /// region that is not registered, or after invalidation).
    pub fn is_valid(&self) -> bool {
        self.info().0
    }

    /// Whether the region was allocated with
    /// [`ProtectionDomain::alloc_mr`].
    pub fn is_fast_reg(&self) -> bool {
        self.fast_reg
    }

    /// The protection domain's identifier.
    pub fn pd_id(&self) -> u32 {
        self.pd.id()
    }

    /// The protection domain.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// Number of memory windows bound to the region.
    pub fn bound_windows(&self) -> u32 {
        self.pd.device().stags().windows_of(self.index)
    }

    fn range_err(&self, offset: usize, len: usize) -> RangeError {
        RangeError {
            offset,
            len,
            region_len: self.mem.len(),
        }
    }

    /// Copies `dst.len()` bytes at `offset` of the buffer into `dst`.
    /// Races with remote writes like a DMA read.
    ///
    /// # Errors
    ///
    /// [`RangeError`] if the range is outside the buffer.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), RangeError> {
        if self.mem.copy_out(offset, dst) {
            Ok(())
        } else {
            Err(self.range_err(offset, dst.len()))
        }
    }

    /// Copies `src` into the buffer at `offset`. Races with remote writes.
    ///
    /// # Errors
    ///
    /// [`RangeError`] if the range is outside the buffer.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), RangeError> {
        if self.mem.copy_in(offset, src) {
            Ok(())
        } else {
            Err(self.range_err(offset, src.len()))
        }
    }

    /// A copy of the whole buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        self.mem.to_vec(0, self.mem.len()).unwrap_or_default()
    }

    /// Sets every byte of the buffer to `byte`.
    pub fn fill(&self, byte: u8) {
        self.mem.fill(0, self.mem.len(), byte);
    }

    /// The buffer's address, valid for [`MemoryRegion::capacity`] bytes while
    /// the region lives. Remote peers write through it at any time:
    /// creating a Rust reference over it is only sound while no remote
    /// access can happen (for example before the rkey is shared).
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.base()
    }

    /// An SGE of `len` bytes at `offset` of the buffer (address
    /// [`MemoryRegion::addr`] + `offset`, this region's lkey).
    ///
    /// # Errors
    ///
    /// [`RangeError`] if the range is outside the registered range.
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge, RangeError> {
        // One look at the table (a send or a repost per message).
        let (iova, reg_len, lkey) = self
            .pd
            .device()
            .stags()
            .sge_info(self.index)
            .unwrap_or((0, 0, 0));
        let err = self.range_err(offset, len as usize);
        let end = (offset as u64).checked_add(u64::from(len)).ok_or(err)?;
        if end > reg_len {
            return Err(err);
        }
        Ok(Sge {
            addr: iova.checked_add(offset as u64).ok_or(err)?,
            length: len,
            lkey,
        })
    }

    /// Re-registration with new access rights (`ibv_rereg_mr` with
    /// `IBV_REREG_MR_CHANGE_ACCESS`): the region gets a new key (same index
    /// and memory). Returns the new key.
    ///
    /// # Errors
    ///
    /// [`RegError::InvalidAccess`], or [`RegError::WindowsBound`] while
    /// windows are bound to the region.
    pub fn rereg(&mut self, access: Access) -> Result<u32, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.pd.device().stags().rereg(self.index, access)
    }

    /// Deregisters the region (`ibv_dereg_mr`). Work requests in flight keep
    /// the memory alive until they complete, and so does a receive buffer
    /// kept past its completion by a QP created with
    /// [`QpInitAttr::keep_recvs`](crate::QpInitAttr::keep_recvs), until
    /// the next post of that receive's `wr_id` or the end of its connection
    /// (its key is gone at once: that post checks the SGE and fails).
    ///
    /// # Errors
    ///
    /// [`DeregError`] (giving the region back) while memory windows are bound
    /// to it.
    pub fn deregister(self) -> Result<(), DeregError> {
        let windows = self.bound_windows();
        if windows > 0 {
            return Err(DeregError {
                region: self,
                windows,
            });
        }
        drop(self);
        Ok(())
    }
}

impl Drop for MemoryRegion {
    /// Removes the entry. Unlike [`MemoryRegion::deregister`] this cannot
    /// fail: windows still bound keep the memory and stay usable until they
    /// are invalidated or dropped.
    fn drop(&mut self) {
        self.pd.device().stags().remove(self.index);
    }
}

/// A type 2 memory window (`ibv_mw`, `IBV_MW_TYPE_2`): a remote view of part
/// of a region, bound and invalidated by work requests. Dropping it
/// deallocates it.
#[derive(Debug)]
pub struct MemoryWindow {
    pub(crate) pd: ProtectionDomain,
    pub(crate) index: u32,
}

impl MemoryWindow {
    /// Allocates an unbound window in the table of `pd`'s device.
    pub(crate) fn new(pd: &ProtectionDomain) -> Result<MemoryWindow, RegError> {
        let index = pd.device().stags().insert(NewEntry {
            pd: pd.id(),
            access: Access::NONE,
            iova: 0,
            len: 0,
            mem: None,
            valid: false,
            kind: NewKind::Window,
        })?;
        Ok(MemoryWindow {
            pd: pd.clone(),
            index,
        })
    }

    /// The remote key (STag); changes on every bind.
    pub fn rkey(&self) -> u32 {
        self.pd.device().stags().stag_of(self.index)
    }

    /// Whether the window is bound (and its rkey valid).
    pub fn is_bound(&self) -> bool {
        self.pd
            .device()
            .stags()
            .info(self.index)
            .is_some_and(|i| i.0)
    }

    /// The bound range's start address (0 when never bound).
    pub fn addr(&self) -> u64 {
        self.pd.device().stags().info(self.index).map_or(0, |i| i.1)
    }

    /// The bound range's length (0 when never bound).
    pub fn len(&self) -> u64 {
        self.pd.device().stags().info(self.index).map_or(0, |i| i.2)
    }

    /// Whether the bound length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The access the window grants.
    pub fn access(&self) -> Access {
        self.pd
            .device()
            .stags()
            .info(self.index)
            .map_or(Access::NONE, |i| i.3)
    }

    /// The protection domain's identifier.
    pub fn pd_id(&self) -> u32 {
        self.pd.id()
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        self.pd.device().stags().remove(self.index);
    }
}

// ---------------------------------------------------------------------------
// The protocol core's view of memory
// ---------------------------------------------------------------------------

/// Where a QP takes its receives from when it has a shared receive queue:
/// the SRQ implements it (`srq.rs`), so memory does not name the SRQ.
pub(crate) trait RecvSource: Sync + std::fmt::Debug {
    /// Takes the next posted receive, if any, as the protocol core takes
    /// it.
    fn pop_recv(&self) -> Option<softrdma_proto::mem::SharedRecv<Arc<Memory>>>;
}

/// A QP's memory as the sans-IO protocol core
/// (`softrdma_proto::conn::Connection`) sees it: lookups in the device's
/// STag table for the QP's protection domain, atomics, invalidation, binds
/// and fast-registers by key, the SRQ, and the copies and CRC over
/// registered memory. Regions are `Arc<Memory>`: a span keeps its memory
/// alive however long the core holds it.
#[cfg_attr(not(test), allow(dead_code))] // the protocol core's memory (the data path's next step)
#[derive(Debug, Clone, Copy)]
pub(crate) struct PdMemory<'a> {
    stags: &'a StagTable,
    pd: u32,
    srq: Option<&'a dyn RecvSource>,
}

#[cfg_attr(not(test), allow(dead_code))] // the protocol core's memory (the data path's next step)
impl<'a> PdMemory<'a> {
    /// The memory of protection domain `pd` in `stags`, with the SRQ the QP
    /// takes its receives from, if any.
    pub(crate) fn new(stags: &'a StagTable, pd: u32, srq: Option<&'a dyn RecvSource>) -> Self {
        PdMemory { stags, pd, srq }
    }
}

#[cfg_attr(not(test), allow(dead_code))] // the protocol core's memory (the data path's next step)
fn span(mem: Arc<Memory>, offset: usize, len: usize) -> softrdma_proto::mem::Span<Arc<Memory>> {
    softrdma_proto::mem::Span {
        region: mem,
        offset,
        len,
    }
}

#[cfg_attr(not(test), allow(dead_code))] // the protocol core's memory (the data path's next step)
/// Whether `[at, at + n)` lies inside `s`.
fn inside<R>(s: &softrdma_proto::mem::Span<R>, at: usize, n: usize) -> bool {
    at.checked_add(n).is_some_and(|end| end <= s.len)
}

impl softrdma_proto::mem::Memory for PdMemory<'_> {
    type Region = Arc<Memory>;

    fn remote(
        &mut self,
        stag: u32,
        access: softrdma_proto::mem::RemoteAccess,
        to: u64,
        len: u64,
    ) -> Result<softrdma_proto::mem::Span<Arc<Memory>>, softrdma_proto::mem::RemoteAccessError>
    {
        use softrdma_proto::mem::{RemoteAccess as A, RemoteAccessError as E};
        let need = match access {
            A::Write => Access::REMOTE_WRITE,
            A::Read => Access::REMOTE_READ,
            A::Atomic => Access::REMOTE_ATOMIC,
        };
        match self.stags.remote(stag, self.pd, need, to, len) {
            Ok(t) => Ok(span(t.mem, t.offset, t.len)),
            Err(RemoteAccessError::InvalidStag) => Err(E::InvalidStag),
            Err(RemoteAccessError::StagNotAssociated) => Err(E::StagNotAssociated),
            Err(RemoteAccessError::AccessRights) => Err(E::AccessRights),
            Err(RemoteAccessError::BaseOrBounds) => Err(E::BaseOrBounds),
            Err(RemoteAccessError::ToWrap) => Err(E::ToWrap),
        }
    }

    fn local(
        &mut self,
        lkey: u32,
        addr: u64,
        len: u32,
        write: bool,
    ) -> Result<softrdma_proto::mem::Span<Arc<Memory>>, softrdma_proto::mem::LocalAccessError> {
        use softrdma_proto::mem::LocalAccessError as E;
        match self.stags.local(lkey, self.pd, addr, len, write) {
            Ok(seg) => Ok(span(seg.mem, seg.offset, seg.len)),
            Err(LocalAccessError::InvalidLkey(_)) => Err(E::InvalidLkey),
            Err(LocalAccessError::PdMismatch(_)) => Err(E::PdMismatch),
            Err(LocalAccessError::OutOfBounds { .. }) => Err(E::OutOfBounds),
            Err(LocalAccessError::NoLocalWrite(_)) => Err(E::NoLocalWrite),
        }
    }

    fn atomic(
        &mut self,
        target: &softrdma_proto::mem::Span<Arc<Memory>>,
        req: &AtomicRequestRepr,
    ) -> Option<u64> {
        if target.len < 8 {
            return None;
        }
        let cell = target.region.atomic_u64(target.offset)?;
        Some(execute_atomic(cell, req))
    }

    fn invalidate(
        &mut self,
        stag: u32,
        remote: bool,
    ) -> Result<(), softrdma_proto::mem::InvalidateError> {
        self.stags
            .invalidate(stag, self.pd, remote)
            .map_err(InvalidateError::to_core)
    }

    fn local_op(&mut self, op: &softrdma_proto::mem::LocalOp) -> Result<(), ()> {
        use softrdma_proto::mem::LocalOp;
        match *op {
            LocalOp::Invalidate { rkey } => {
                self.stags.invalidate(rkey, self.pd, false).map_err(|_| ())
            }
            LocalOp::BindMw {
                mw,
                mr,
                addr,
                len,
                access,
                key,
            } => self
                .stags
                .bind_mw_by_key(
                    self.pd,
                    mw,
                    mr,
                    WindowBind {
                        addr,
                        len,
                        access: Access(access),
                        key,
                    },
                )
                .map(|_| ())
                .map_err(|_| ()),
            LocalOp::FastReg {
                mr,
                iova,
                len,
                access,
            } => self
                .stags
                .fast_reg_by_key(self.pd, mr, iova, len, Access(access))
                .map(|_| ())
                .map_err(|_| ()),
        }
    }

    fn srq_pop(&mut self) -> Option<softrdma_proto::mem::SharedRecv<Arc<Memory>>> {
        self.srq?.pop_recv()
    }

    fn recv_stamp(&mut self) -> Option<u64> {
        Some(self.stags.epoch())
    }

    fn may_keep(&mut self, span: &softrdma_proto::mem::Span<Arc<Memory>>) -> bool {
        span.region.is_owned()
    }

    fn copy_in(
        &mut self,
        dst: &softrdma_proto::mem::Span<Arc<Memory>>,
        at: usize,
        bytes: &[u8],
    ) -> bool {
        inside(dst, at, bytes.len()) && dst.region.copy_in(dst.offset + at, bytes)
    }

    fn copy_out(
        &mut self,
        src: &softrdma_proto::mem::Span<Arc<Memory>>,
        at: usize,
        out: &mut [u8],
    ) -> bool {
        inside(src, at, out.len()) && src.region.copy_out(src.offset + at, out)
    }

    fn crc_update(
        &mut self,
        src: &softrdma_proto::mem::Span<Arc<Memory>>,
        crc: &mut softrdma_wire::crc::Crc32c,
    ) -> bool {
        crate::sys::io::crc_update_mem(crc, &src.region, src.offset, src.len)
    }
}

/// Executes an atomic request on a 64-bit cell; returns the original value.
pub(crate) fn execute_atomic(cell: &std::sync::atomic::AtomicU64, req: &AtomicRequestRepr) -> u64 {
    match req.opcode {
        AtomicOpcode::FetchAdd if req.add_or_swap_mask == 0 => {
            cell.fetch_add(req.add_or_swap_data, std::sync::atomic::Ordering::SeqCst)
        }
        AtomicOpcode::FetchAdd => {
            let mask = req.add_or_swap_mask;
            let add = req.add_or_swap_data;
            cell.fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |v| Some(masked_add(v, add, mask)),
            )
            .unwrap_or_else(|v| v)
        }
        AtomicOpcode::Swap => {
            let mask = req.add_or_swap_mask;
            let data = req.add_or_swap_data;
            cell.fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |v| Some((v & !mask) | (data & mask)),
            )
            .unwrap_or_else(|v| v)
        }
        AtomicOpcode::CmpSwap => {
            let cmask = req.compare_mask;
            let smask = req.add_or_swap_mask;
            let cmp = req.compare_data;
            let data = req.add_or_swap_data;
            cell.fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |v| {
                    if (v ^ cmp) & cmask == 0 {
                        Some((v & !smask) | (data & smask))
                    } else {
                        None
                    }
                },
            )
            .unwrap_or_else(|v| v)
        }
    }
}

/// Masked fetch-and-add (RFC 7306): a set bit in `mask` marks the most
/// significant bit of a field; carries do not cross field boundaries.
pub(crate) fn masked_add(value: u64, add: u64, mask: u64) -> u64 {
    let mut result = 0u64;
    let mut start = 0u32;
    for bit in 0..64u32 {
        let end_of_field = bit == 63 || (mask >> bit) & 1 == 1;
        if end_of_field {
            let width = bit - start + 1;
            let fmask = if width == 64 {
                u64::MAX
            } else {
                ((1u64 << width) - 1) << start
            };
            let sum = ((value & fmask) >> start).wrapping_add((add & fmask) >> start);
            result |= (sum << start) & fmask;
            start = bit + 1;
        }
    }
    result
}

// ---------------------------------------------------------------------------
// Lent memory: registration of a caller's buffer for one call
// ---------------------------------------------------------------------------

/// A caller's buffer registered for the duration of one call
/// ([`ProtectionDomain::lend`], [`ProtectionDomain::lend_mut`]).
///
/// The registration ends when the closure that received it returns (or
/// unwinds): the STag is removed first, so a later remote access fails
/// with "Invalid STag" (a Terminate to the peer, a remote access error at
/// its requester), then the call waits until the engine is done with every
/// access already under way (a Read Response still being transmitted from
/// the buffer, a Write or Read Response being placed into it, a posted
/// work request naming it). Only then does `lend` return and the borrow
/// end: nothing touches the buffer afterwards.
///
/// Registration is cheap (one table insert, no allocation of the buffer,
/// no zeroing); the buffer has no other handle, so local access stays with
/// the caller's own slice once the call returns.
#[derive(Debug)]
pub struct LentRegion<'s> {
    pd: &'s ProtectionDomain,
    stag: u32,
    addr: u64,
    len: usize,
    mem: &'s Arc<Memory>,
    revoked: std::sync::atomic::AtomicBool,
}

impl LentRegion<'_> {
    /// The local key (the same STag as [`LentRegion::rkey`]).
    pub fn lkey(&self) -> u32 {
        self.stag
    }

    /// The remote key (STag) to give the peer.
    pub fn rkey(&self) -> u32 {
        self.stag
    }

    /// The address the region answers to (the buffer's address).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// An SGE of `len` bytes at `offset` of the buffer.
    ///
    /// # Errors
    ///
    /// [`RangeError`] if the range is outside the buffer.
    pub fn sge(&self, offset: usize, len: u32) -> Result<Sge, RangeError> {
        let err = RangeError {
            offset,
            len: len as usize,
            region_len: self.len,
        };
        let end = offset.checked_add(len as usize).ok_or(err)?;
        if end > self.len {
            return Err(err);
        }
        Ok(Sge {
            addr: self.addr + offset as u64,
            length: len,
            lkey: self.stag,
        })
    }

    /// Removes the STag now (before the closure returns): remote accesses
    /// that arrive from now on fail; those already under way finish.
    /// Work requests posted afterwards with its lkey fail too.
    pub fn revoke(&self) {
        if !self.revoked.swap(true, std::sync::atomic::Ordering::SeqCst) {
            self.pd.device().stags().remove_stag(self.stag);
        }
    }

    /// Whether the engine still holds the buffer besides the registration
    /// (work requests in flight, a Read Response being transmitted, a
    /// placement in progress): once revoked and no longer in use, ending
    /// the call does not wait. A snapshot; advisory only.
    pub fn in_use(&self) -> bool {
        let registered = !self.revoked.load(std::sync::atomic::Ordering::SeqCst);
        Arc::strong_count(self.mem) > 1 + usize::from(registered)
    }
}

impl Drop for LentRegion<'_> {
    fn drop(&mut self) {
        self.revoke();
    }
}

// The constructors of regions and windows: here, with the types they
// construct, so that `pd` does not import this module.
impl ProtectionDomain {
    /// Registers `len` fresh zeroed bytes, page aligned, owned by the region
    /// (`ibv_reg_mr` on a new buffer). `len` 0 is allowed.
    ///
    /// # Errors
    ///
    /// [`RegError::InvalidAccess`] (remote write or atomic without local
    /// write), [`RegError::TooLarge`], [`RegError::OutOfMemory`],
    /// [`RegError::TableFull`].
    ///
    /// # Example
    ///
    /// ```
    /// use softrdma_engine::{Access, Device, ProtectionDomain};
    /// let dev = Device::open_default()?;
    /// let pd = ProtectionDomain::new(&dev);
    /// let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// mr.write(0, b"hello")?;
    /// let mut out = [0u8; 5];
    /// mr.read(0, &mut out)?;
    /// assert_eq!(&out, b"hello");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register(&self, len: usize, access: Access) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(len)?;
        let mem = Memory::alloc_zeroed(len)?;
        MemoryRegion::new(self, mem, access, false)
    }

    /// As [`ProtectionDomain::register`], and a region of 2 MiB or more
    /// asks the kernel for transparent huge pages (`MADV_HUGEPAGE`, where
    /// `/sys/kernel/mm/transparent_hugepage/enabled` allows it): fewer page
    /// faults and TLB misses when megabytes are copied into it (an 8 MiB
    /// RDMA Write target), at the price of memory made resident 2 MiB at a
    /// time instead of 4 KiB where touched. The advice ends with the
    /// region.
    ///
    /// # Errors
    ///
    /// As [`ProtectionDomain::register`].
    pub fn register_huge(&self, len: usize, access: Access) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(len)?;
        let mem = Memory::alloc_zeroed_huge(len)?;
        MemoryRegion::new(self, mem, access, false)
    }

    /// Registers the bytes of `buf`, taking ownership (no copy). The
    /// region's length is `buf.len()`.
    ///
    /// # Errors
    ///
    /// As [`ProtectionDomain::register`].
    pub fn register_vec(&self, buf: Vec<u8>, access: Access) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(buf.len())?;
        MemoryRegion::new(self, Memory::from_vec(buf), access, false)
    }

    /// Allocates a fast-register region of up to `max_len` bytes
    /// (`ib_alloc_mr` with `IB_MR_TYPE_MEM_REG`): zeroed memory owned by
    /// the region, STag invalid until a fast-register work request gives it
    /// an address, a length, rights and a key.
    ///
    /// # Errors
    ///
    /// [`RegError::TooLarge`], [`RegError::OutOfMemory`],
    /// [`RegError::TableFull`].
    pub fn alloc_mr(&self, max_len: usize) -> Result<MemoryRegion, RegError> {
        self.check_len(max_len)?;
        let mem = Memory::alloc_zeroed(max_len)?;
        MemoryRegion::new(self, mem, Access::NONE, true)
    }

    /// Allocates an unbound type 2 memory window (`ibv_alloc_mw`).
    ///
    /// # Errors
    ///
    /// [`RegError::TableFull`].
    pub fn alloc_mw(&self) -> Result<MemoryWindow, RegError> {
        MemoryWindow::new(self)
    }
}

// `ProtectionDomain::register_raw`: its `unsafe` stays in a file of `sys/`.
#[allow(unsafe_code)]
#[path = "sys/register_raw.rs"]
mod register_raw;

impl ProtectionDomain {
    /// Registers `buf` for the duration of `f` with `access`, which may
    /// only grant reads ([`Access::REMOTE_READ`] or [`Access::NONE`]:
    /// gather from it in sends, let the peer RDMA-Read it), and returns
    /// what `f` returns once nothing can touch `buf` any more (see
    /// [`LentRegion`]): the STag is removed, then the call waits for the
    /// accesses under way. A peer that never lets a Read Response finish
    /// (its TCP window closed) keeps the call waiting: `f` can
    /// [`LentRegion::revoke`], look at [`LentRegion::in_use`] and abort the
    /// connection before it returns.
    ///
    /// # Errors
    ///
    /// [`RegError::InvalidAccess`] for a write, atomic or bind right,
    /// [`RegError::TooLarge`], [`RegError::TableFull`]; `f` is not called.
    pub fn lend<R>(
        &self,
        buf: &[u8],
        access: Access,
        f: impl FnOnce(&LentRegion<'_>) -> R,
    ) -> Result<R, RegError> {
        if !Access::REMOTE_READ.contains(access) {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(buf.len())?;
        crate::sys::mem::Lend::shared(buf, |mem| self.lend_in(mem, access, f))
    }

    /// Like [`ProtectionDomain::lend`] for a buffer the engine may write:
    /// `access` may hold any right but [`Access::MW_BIND`] (and follows
    /// the verbs rule: remote write or atomic need local write). Use it as
    /// the sink of an RDMA Read, for receives, or for the peer's RDMA
    /// Writes. The buffer holds what was placed once the call returns.
    ///
    /// # Errors
    ///
    /// As [`ProtectionDomain::lend`] ([`RegError::InvalidAccess`] for
    /// [`Access::MW_BIND`] or an invalid combination).
    pub fn lend_mut<R>(
        &self,
        buf: &mut [u8],
        access: Access,
        f: impl FnOnce(&LentRegion<'_>) -> R,
    ) -> Result<R, RegError> {
        if !access.is_valid() || access.contains(Access::MW_BIND) {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(buf.len())?;
        crate::sys::mem::Lend::exclusive(buf, |mem| self.lend_in(mem, access, f))
    }

    fn lend_in<R>(
        &self,
        mem: &Arc<Memory>,
        access: Access,
        f: impl FnOnce(&LentRegion<'_>) -> R,
    ) -> Result<R, RegError> {
        let addr = mem.base() as u64;
        let index = self.device().stags().insert(NewEntry {
            pd: self.id(),
            access,
            iova: addr,
            len: mem.len() as u64,
            mem: Some(Arc::clone(mem)),
            valid: true,
            kind: NewKind::Region,
        })?;
        let region = LentRegion {
            pd: self,
            stag: self.device().stags().stag_of(index),
            addr,
            len: mem.len(),
            mem,
            revoked: std::sync::atomic::AtomicBool::new(false),
        };
        // `region` is dropped (the STag removed) on return and on unwind,
        // before `Lend` waits for the other users.
        Ok(f(&region))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::device::Device;
    use crate::pd::ProtectionDomain;

    const RW: Access = Access(1 | 2 | 4 | 8);

    fn setup() -> (Device, ProtectionDomain) {
        let dev = Device::open_default().unwrap();
        let pd = ProtectionDomain::new(&dev);
        (dev, pd)
    }

    #[test]
    fn remote_ok_and_placement_through_target() {
        let (dev, pd) = setup();
        let mr = pd.register(4096, RW).unwrap();
        let t = dev
            .stags()
            .remote(mr.rkey(), pd.id(), Access::REMOTE_WRITE, mr.addr() + 100, 5)
            .unwrap();
        assert_eq!((t.offset, t.len), (100, 5));
        assert!(t.mem.copy_in(t.offset, b"hello"));
        let mut out = [0u8; 5];
        mr.read(100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        // The whole region, exactly.
        let t = dev
            .stags()
            .remote(mr.rkey(), pd.id(), Access::REMOTE_READ, mr.addr(), 4096)
            .unwrap();
        assert_eq!((t.offset, t.len), (0, 4096));
    }

    #[test]
    fn remote_checks_in_order() {
        let (dev, pd) = setup();
        let other = ProtectionDomain::new(&dev);
        let t = dev.stags();
        let mr = pd
            .register(64, Access::LOCAL_WRITE | Access::REMOTE_READ)
            .unwrap();
        let (k, a) = (mr.rkey(), mr.addr());
        let e = |r: Result<Target, RemoteAccessError>| r.unwrap_err();
        // Invalid STag: unknown index, wrong key, index 0 (STags 0 and 1).
        assert_eq!(
            e(t.remote(k ^ 1, pd.id(), Access::REMOTE_READ, a, 1)),
            RemoteAccessError::InvalidStag
        );
        assert_eq!(
            e(t.remote(0xffff_ff00, pd.id(), Access::REMOTE_READ, a, 1)),
            RemoteAccessError::InvalidStag
        );
        assert_eq!(
            e(t.remote(0, pd.id(), Access::NONE, 0, 0)),
            RemoteAccessError::InvalidStag
        );
        assert_eq!(
            e(t.remote(1, pd.id(), Access::NONE, 0, 0)),
            RemoteAccessError::InvalidStag
        );
        // The STag check comes before the PD check.
        assert_eq!(
            e(t.remote(k ^ 1, other.id(), Access::REMOTE_READ, a, 1)),
            RemoteAccessError::InvalidStag
        );
        // PD before access rights.
        assert_eq!(
            e(t.remote(k, other.id(), Access::REMOTE_WRITE, a, 1)),
            RemoteAccessError::StagNotAssociated
        );
        // Access rights before bounds.
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_WRITE, a + 1000, 1)),
            RemoteAccessError::AccessRights
        );
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_ATOMIC, a, 8)),
            RemoteAccessError::AccessRights
        );
        // Bounds.
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_READ, a - 1, 1)),
            RemoteAccessError::BaseOrBounds
        );
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_READ, a + 60, 5)),
            RemoteAccessError::BaseOrBounds
        );
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_READ, a + 64, 1)),
            RemoteAccessError::BaseOrBounds
        );
        assert!(t.remote(k, pd.id(), Access::REMOTE_READ, a + 60, 4).is_ok());
        // Wrap.
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_READ, u64::MAX - 1, 4)),
            RemoteAccessError::ToWrap
        );
        assert_eq!(
            e(t.remote(k, pd.id(), Access::REMOTE_READ, a, u64::MAX)),
            RemoteAccessError::ToWrap
        );
    }

    #[test]
    fn remote_zero_length() {
        let (dev, pd) = setup();
        let t = dev.stags();
        let mr = pd
            .register(16, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        // Zero length: any offset, but the STag checks still apply.
        let z = t
            .remote(mr.rkey(), pd.id(), Access::REMOTE_WRITE, u64::MAX, 0)
            .unwrap();
        assert_eq!(z.len, 0);
        assert_eq!(
            t.remote(mr.rkey(), pd.id(), Access::REMOTE_READ, mr.addr(), 0)
                .unwrap_err(),
            RemoteAccessError::AccessRights
        );
        assert_eq!(
            t.remote(mr.rkey() ^ 0x80, pd.id(), Access::NONE, 0, 0)
                .unwrap_err(),
            RemoteAccessError::InvalidStag
        );
        // A zero-length region.
        let empty = pd.register(0, Access::REMOTE_READ).unwrap();
        assert!(
            t.remote(empty.rkey(), pd.id(), Access::REMOTE_READ, empty.addr(), 0)
                .is_ok()
        );
        assert_eq!(
            t.remote(empty.rkey(), pd.id(), Access::REMOTE_READ, empty.addr(), 1)
                .unwrap_err(),
            RemoteAccessError::BaseOrBounds
        );
    }

    #[test]
    fn local_checks() {
        let (dev, pd) = setup();
        let other = ProtectionDomain::new(&dev);
        let t = dev.stags();
        let ro = pd.register(32, Access::NONE).unwrap();
        let rw = pd.register(32, Access::LOCAL_WRITE).unwrap();
        let seg = t.local(rw.lkey(), pd.id(), rw.addr() + 8, 8, true).unwrap();
        assert_eq!((seg.offset, seg.len), (8, 8));
        assert!(t.local(ro.lkey(), pd.id(), ro.addr(), 32, false).is_ok());
        assert_eq!(
            t.local(ro.lkey(), pd.id(), ro.addr(), 32, true)
                .unwrap_err(),
            LocalAccessError::NoLocalWrite(ro.lkey())
        );
        assert_eq!(
            t.local(rw.lkey() ^ 1, pd.id(), rw.addr(), 1, false)
                .unwrap_err(),
            LocalAccessError::InvalidLkey(rw.lkey() ^ 1)
        );
        assert_eq!(
            t.local(rw.lkey(), other.id(), rw.addr(), 1, false)
                .unwrap_err(),
            LocalAccessError::PdMismatch(rw.lkey())
        );
        assert!(matches!(
            t.local(rw.lkey(), pd.id(), rw.addr() + 30, 3, false),
            Err(LocalAccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.local(rw.lkey(), pd.id(), u64::MAX, 3, false),
            Err(LocalAccessError::OutOfBounds { .. })
        ));
        assert!(matches!(
            t.local(rw.lkey(), pd.id(), rw.addr() - 1, 1, false),
            Err(LocalAccessError::OutOfBounds { .. })
        ));
        // Zero length: any address with a valid lkey.
        assert_eq!(t.local(rw.lkey(), pd.id(), 0, 0, true).unwrap().len, 0);
        assert_eq!(
            LocalAccessError::InvalidLkey(0).wc_status(),
            WcStatus::LocalProtection
        );
        // The sge() helper produces SGEs that pass.
        let sge = rw.sge(4, 28).unwrap();
        let seg = t
            .local(sge.lkey, pd.id(), sge.addr, sge.length, true)
            .unwrap();
        assert_eq!((seg.offset, seg.len), (4, 28));
        assert!(rw.sge(4, 29).is_err());
    }

    #[test]
    fn memory_outlives_deregistration_through_local_seg() {
        let (dev, pd) = setup();
        let mr = pd.register(16, Access::LOCAL_WRITE).unwrap();
        mr.write(0, b"kept").unwrap();
        let lkey = mr.lkey();
        let seg = dev
            .stags()
            .local(lkey, pd.id(), mr.addr(), 4, true)
            .unwrap();
        mr.deregister().unwrap();
        assert_eq!(seg.mem.to_vec(seg.offset, 4).unwrap(), b"kept");
        assert!(seg.mem.copy_in(0, b"more"));
        assert!(dev.stags().local(lkey, pd.id(), 0, 0, false).is_err());
    }

    #[test]
    fn invalidate_rules() {
        let (dev, pd) = setup();
        let other = ProtectionDomain::new(&dev);
        let t = dev.stags();
        let mr = pd.register(64, RW | Access::MW_BIND).unwrap();
        // A registered region cannot be invalidated, locally or remotely.
        assert_eq!(
            t.invalidate(mr.rkey(), pd.id(), false),
            Err(InvalidateError::CannotInvalidate)
        );
        assert_eq!(
            t.invalidate(mr.rkey(), pd.id(), true),
            Err(InvalidateError::CannotInvalidate)
        );
        assert_eq!(
            t.invalidate(mr.rkey() ^ 1, pd.id(), true),
            Err(InvalidateError::InvalidStag)
        );
        assert_eq!(
            t.invalidate(0x1, pd.id(), true),
            Err(InvalidateError::InvalidStag)
        );
        // A window.
        let mw = pd.alloc_mw().unwrap();
        let rkey = t
            .bind_mw(&mw, &mr, mr.addr(), 64, Access::REMOTE_READ)
            .unwrap();
        assert_eq!(mr.bound_windows(), 1);
        assert_eq!(
            t.invalidate(rkey, other.id(), true),
            Err(InvalidateError::PdMismatch)
        );
        assert!(mw.is_bound());
        t.invalidate(rkey, pd.id(), true).unwrap();
        assert!(!mw.is_bound());
        assert_eq!(mw.rkey(), rkey, "the key is kept");
        assert_eq!(mr.bound_windows(), 0);
        assert_eq!(
            t.remote(rkey, pd.id(), Access::REMOTE_READ, mr.addr(), 1)
                .unwrap_err(),
            RemoteAccessError::InvalidStag
        );
        // Invalidating again is accepted.
        t.invalidate(rkey, pd.id(), false).unwrap();
        // A fast-register region.
        let fr = pd.alloc_mr(128).unwrap();
        let k = t.fast_reg(&fr, 0x1000, 128, Access::REMOTE_READ).unwrap();
        assert!(
            t.remote(k, pd.id(), Access::REMOTE_READ, 0x1000, 128)
                .is_ok()
        );
        assert_eq!(
            t.invalidate(k, other.id(), false),
            Err(InvalidateError::PdMismatch)
        );
        t.invalidate(k, pd.id(), false).unwrap();
        assert!(!fr.is_valid());
        assert_eq!(
            t.remote(k, pd.id(), Access::REMOTE_READ, 0x1000, 1)
                .unwrap_err(),
            RemoteAccessError::InvalidStag
        );
        assert_eq!(
            InvalidateError::PdMismatch.wc_status(),
            WcStatus::InvalidateError
        );
    }

    #[test]
    fn bind_rules() {
        let (dev, pd) = setup();
        let other = ProtectionDomain::new(&dev);
        let t = dev.stags();
        let mr = pd.register(256, RW | Access::MW_BIND).unwrap();
        let no_bind = pd.register(256, RW).unwrap();
        let read_only = pd
            .register(256, Access::REMOTE_READ | Access::MW_BIND)
            .unwrap();
        let mw = pd.alloc_mw().unwrap();
        let foreign_mw = other.alloc_mw().unwrap();
        let a = mr.addr();
        assert!(!mw.is_bound());
        assert_eq!(
            t.bind_mw(&foreign_mw, &mr, a, 16, Access::REMOTE_READ),
            Err(BindError::PdMismatch)
        );
        assert_eq!(
            t.bind_mw(&mw, &no_bind, no_bind.addr(), 16, Access::REMOTE_READ),
            Err(BindError::NoBindRight)
        );
        assert_eq!(
            t.bind_mw(&mw, &read_only, read_only.addr(), 16, Access::REMOTE_WRITE),
            Err(BindError::AccessExceedsRegion)
        );
        assert_eq!(
            t.bind_mw(&mw, &read_only, read_only.addr(), 16, Access::REMOTE_ATOMIC),
            Err(BindError::AccessExceedsRegion)
        );
        assert!(matches!(
            t.bind_mw(&mw, &mr, a, 16, Access::MW_BIND),
            Err(BindError::InvalidAccess(_))
        ));
        assert_eq!(
            t.bind_mw(&mw, &mr, a + 250, 16, Access::REMOTE_READ),
            Err(BindError::OutOfBounds)
        );
        assert_eq!(
            t.bind_mw(&mw, &mr, a - 1, 16, Access::REMOTE_READ),
            Err(BindError::OutOfBounds)
        );
        assert_eq!(
            t.bind_mw(&mw, &mr, u64::MAX, 16, Access::REMOTE_READ),
            Err(BindError::OutOfBounds)
        );
        let old = mw.rkey();
        let rkey = t
            .bind_mw(&mw, &mr, a + 16, 32, Access::REMOTE_WRITE)
            .unwrap();
        assert_ne!(rkey, old);
        assert_eq!(rkey >> 8, old >> 8, "same index");
        assert_eq!(mw.rkey(), rkey);
        assert!(mw.is_bound());
        assert_eq!(
            (mw.addr(), mw.len(), mw.access()),
            (a + 16, 32, Access::REMOTE_WRITE)
        );
        assert_eq!(
            t.bind_mw(&mw, &mr, a, 16, Access::REMOTE_READ),
            Err(BindError::AlreadyBound)
        );
        // Access through the window: its range, its rights.
        let tg = t
            .remote(rkey, pd.id(), Access::REMOTE_WRITE, a + 20, 4)
            .unwrap();
        assert_eq!((tg.offset, tg.len), (20, 4));
        assert!(tg.mem.copy_in(tg.offset, b"via!"));
        let mut out = [0u8; 4];
        mr.read(20, &mut out).unwrap();
        assert_eq!(&out, b"via!");
        assert_eq!(
            t.remote(rkey, pd.id(), Access::REMOTE_READ, a + 20, 4)
                .unwrap_err(),
            RemoteAccessError::AccessRights
        );
        assert_eq!(
            t.remote(rkey, pd.id(), Access::REMOTE_WRITE, a + 8, 16)
                .unwrap_err(),
            RemoteAccessError::BaseOrBounds
        );
        assert_eq!(
            t.remote(rkey, pd.id(), Access::REMOTE_WRITE, a + 40, 9)
                .unwrap_err(),
            RemoteAccessError::BaseOrBounds
        );
        // A window key is not an lkey.
        assert!(t.local(rkey, pd.id(), a + 20, 4, false).is_err());
        // Rebind after invalidation gives a different key.
        t.invalidate(rkey, pd.id(), false).unwrap();
        let rkey2 = t.bind_mw(&mw, &mr, a, 256, Access::REMOTE_READ).unwrap();
        assert_ne!(rkey2, rkey);
        assert_eq!(BindError::OutOfBounds.wc_status(), WcStatus::MwBind);
        // An invalid fast-register region cannot be bound to.
        let fr = pd.alloc_mr(64).unwrap();
        t.invalidate(rkey2, pd.id(), false).unwrap();
        assert_eq!(
            t.bind_mw(&mw, &fr, 0, 8, Access::REMOTE_READ),
            Err(BindError::InvalidRegion)
        );
        // Another device.
        let (_dev2, pd2) = setup();
        let mw2 = pd2.alloc_mw().unwrap();
        assert_eq!(
            t.bind_mw(&mw2, &mr, a, 8, Access::REMOTE_READ),
            Err(BindError::OtherDevice)
        );
    }

    #[test]
    fn deregister_while_windows_bound() {
        let (dev, pd) = setup();
        let t = dev.stags();
        let mr = pd.register(64, RW | Access::MW_BIND).unwrap();
        mr.write(0, b"window data").unwrap();
        let mw = pd.alloc_mw().unwrap();
        let rkey = t
            .bind_mw(&mw, &mr, mr.addr(), 64, Access::REMOTE_READ)
            .unwrap();
        let err = mr.deregister().unwrap_err();
        assert_eq!(err.windows(), 1);
        let mr = err.into_region();
        assert!(
            t.remote(mr.rkey(), pd.id(), Access::REMOTE_READ, mr.addr(), 1)
                .is_ok()
        );
        t.invalidate(rkey, pd.id(), false).unwrap();
        let rkey = t
            .bind_mw(&mw, &mr, mr.addr(), 64, Access::REMOTE_READ)
            .unwrap();
        // Dropping the window releases the region.
        drop(mw);
        assert_eq!(mr.bound_windows(), 0);
        assert!(
            t.remote(rkey, pd.id(), Access::REMOTE_READ, mr.addr(), 1)
                .is_err()
        );
        // Dropping a region with a bound window: the window keeps the memory.
        let mw = pd.alloc_mw().unwrap();
        let rkey = t
            .bind_mw(&mw, &mr, mr.addr(), 64, Access::REMOTE_READ)
            .unwrap();
        let (addr, lkey) = (mr.addr(), mr.lkey());
        drop(mr);
        assert!(t.local(lkey, pd.id(), addr, 1, false).is_err());
        let tg = t
            .remote(rkey, pd.id(), Access::REMOTE_READ, addr, 11)
            .unwrap();
        assert_eq!(tg.mem.to_vec(tg.offset, 11).unwrap(), b"window data");
    }

    #[test]
    fn rereg_blocked_by_windows() {
        let (dev, pd) = setup();
        let mut mr = pd.register(64, RW | Access::MW_BIND).unwrap();
        let mw = pd.alloc_mw().unwrap();
        let rkey = dev
            .stags()
            .bind_mw(&mw, &mr, mr.addr(), 8, Access::REMOTE_READ)
            .unwrap();
        assert_eq!(
            mr.rereg(Access::LOCAL_WRITE),
            Err(RegError::WindowsBound(1))
        );
        dev.stags().invalidate(rkey, pd.id(), false).unwrap();
        let old = mr.lkey();
        let new = mr.rereg(Access::LOCAL_WRITE).unwrap();
        assert_ne!(old, new);
        assert_eq!(mr.lkey(), new);
    }

    #[test]
    fn fast_reg_rules() {
        let (dev, pd) = setup();
        let t = dev.stags();
        let fr = pd.alloc_mr(4096).unwrap();
        assert!(fr.is_fast_reg());
        assert!(!fr.is_valid());
        let k0 = fr.rkey();
        assert_eq!(
            t.remote(k0, pd.id(), Access::NONE, 0, 0).unwrap_err(),
            RemoteAccessError::InvalidStag
        );
        assert!(t.local(k0, pd.id(), 0, 0, false).is_err());
        assert!(matches!(
            t.fast_reg(&fr, 0, 4097, Access::REMOTE_READ),
            Err(FastRegError::TooLong { .. })
        ));
        assert_eq!(
            t.fast_reg(&fr, u64::MAX, 2, Access::REMOTE_READ),
            Err(FastRegError::Wrap)
        );
        assert!(matches!(
            t.fast_reg(&fr, 0, 2, Access::REMOTE_WRITE),
            Err(FastRegError::InvalidAccess(_))
        ));
        let normal = pd.register(64, Access::LOCAL_WRITE).unwrap();
        assert_eq!(
            t.fast_reg(&normal, 0, 2, Access::LOCAL_WRITE),
            Err(FastRegError::NotFastReg)
        );
        let k1 = t.fast_reg(&fr, 0x10_0000, 1024, RW).unwrap();
        assert_ne!(k1, k0);
        assert_eq!(k1 >> 8, k0 >> 8);
        assert_eq!(
            (fr.addr(), fr.len(), fr.access(), fr.rkey()),
            (0x10_0000, 1024, RW, k1)
        );
        assert!(fr.is_valid());
        assert_eq!(t.fast_reg(&fr, 0, 8, RW), Err(FastRegError::AlreadyValid));
        let tg = t
            .remote(k1, pd.id(), Access::REMOTE_WRITE, 0x10_0010, 16)
            .unwrap();
        assert_eq!((tg.offset, tg.len), (16, 16));
        assert_eq!(
            t.remote(k1, pd.id(), Access::REMOTE_WRITE, 0x10_0000 + 1020, 8)
                .unwrap_err(),
            RemoteAccessError::BaseOrBounds
        );
        let seg = t.local(k1, pd.id(), 0x10_0100, 8, true).unwrap();
        assert_eq!(seg.offset, 0x100);
        let sge = fr.sge(8, 8).unwrap();
        assert_eq!(sge.addr, 0x10_0008);
        t.invalidate(k1, pd.id(), false).unwrap();
        let k2 = t.fast_reg(&fr, 0, 4096, Access::LOCAL_WRITE).unwrap();
        assert_ne!(k2, k1);
        assert!(t.remote(k2, pd.id(), Access::REMOTE_READ, 0, 1).is_err());
    }

    #[test]
    fn atomics_through_a_target() {
        let (dev, pd) = setup();
        let mr = pd.register(64, RW).unwrap();
        let t = dev
            .stags()
            .remote(mr.rkey(), pd.id(), Access::REMOTE_ATOMIC, mr.addr() + 8, 8)
            .unwrap();
        let a = t.mem.atomic_u64(t.offset).unwrap();
        a.fetch_add(41, std::sync::atomic::Ordering::SeqCst);
        a.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut out = [0u8; 8];
        mr.read(8, &mut out).unwrap();
        assert_eq!(u64::from_ne_bytes(out), 42);
        assert!(t.mem.atomic_u64(t.offset + 4).is_none());
    }

    #[test]
    fn index_reuse_gets_a_fresh_key_and_old_stag_fails() {
        let (dev, pd) = setup();
        let mr = pd.register(8, Access::REMOTE_READ).unwrap();
        let old = mr.rkey();
        drop(mr);
        assert!(
            dev.stags()
                .remote(old, pd.id(), Access::REMOTE_READ, 0, 0)
                .is_err()
        );
    }

    #[test]
    fn remote_bounds_match_a_model_exhaustively() {
        let (dev, pd) = setup();
        let t = dev.stags();
        let mr = pd.register(48, RW | Access::MW_BIND).unwrap();
        let mw = pd.alloc_mw().unwrap();
        let base = mr.addr();
        let wkey = t
            .bind_mw(&mw, &mr, base + 16, 16, Access::REMOTE_READ)
            .unwrap();
        for (key, start, len, off0) in [(mr.rkey(), base, 48u64, 0usize), (wkey, base + 16, 16, 16)]
        {
            for to in base.saturating_sub(3)..base + 52 {
                for n in 0..52u64 {
                    let got = t.remote(key, pd.id(), Access::REMOTE_READ, to, n);
                    let inside = to >= start && to + n <= start + len;
                    match got {
                        Ok(tg) if n == 0 => assert_eq!(tg.len, 0),
                        Ok(tg) => {
                            assert!(inside, "to {to:#x} len {n} accepted");
                            assert_eq!(tg.offset, off0 + (to - start) as usize);
                            assert_eq!(tg.len as u64, n);
                            assert!(tg.mem.ptr_at(tg.offset, tg.len).is_some());
                        }
                        Err(e) => {
                            assert!(!inside && n > 0, "to {to:#x} len {n} refused");
                            assert_eq!(e, RemoteAccessError::BaseOrBounds);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn lookups_race_with_registration_safely() {
        let (dev, pd) = setup();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mr = pd.register(64, RW).unwrap();
        let (key, addr, pd_id) = (mr.rkey(), mr.addr(), pd.id());
        let reader = {
            let dev = dev.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut hits = 0u64;
                loop {
                    if let Ok(tg) = dev
                        .stags()
                        .remote(key, pd_id, Access::REMOTE_WRITE, addr, 8)
                    {
                        assert!(tg.mem.copy_in(tg.offset, &[1; 8]));
                        hits += 1;
                    }
                    if stop.load(std::sync::atomic::Ordering::Relaxed) {
                        break;
                    }
                }
                hits
            })
        };
        for _ in 0..2000 {
            let m = pd.register(8, Access::REMOTE_READ).unwrap();
            drop(m);
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reader.join().unwrap() > 0);
        assert_eq!(&mr.to_vec()[..8], &[1; 8]);
    }

    #[test]
    fn access_rules() {
        assert!(Access::NONE.is_valid());
        assert!(Access::REMOTE_READ.is_valid());
        assert!(!Access::REMOTE_WRITE.is_valid());
        assert!(!Access::REMOTE_ATOMIC.is_valid());
        assert!((Access::REMOTE_WRITE | Access::LOCAL_WRITE).is_valid());
        assert_eq!(Access::from_bits(31), Some(Access::ALL));
        assert_eq!(Access::from_bits(32), None);
        assert_eq!(Access::ALL.bits(), 31);
        assert!(Access::ALL.contains(Access::MW_BIND));
        assert_eq!(
            Access::ALL.difference(Access::REMOTE),
            Access::LOCAL_WRITE | Access::MW_BIND
        );
    }

    #[test]
    fn term_error_table() {
        use RemoteAccessError as E;
        let tagged = [
            (E::InvalidStag, (1, 1, 0)),
            (E::StagNotAssociated, (1, 1, 2)),
            (E::AccessRights, (1, 1, 1)),
            (E::BaseOrBounds, (1, 1, 1)),
            (E::ToWrap, (1, 1, 3)),
        ];
        let untagged = [
            (E::InvalidStag, (0, 1, 0)),
            (E::StagNotAssociated, (0, 1, 3)),
            (E::AccessRights, (0, 1, 2)),
            (E::BaseOrBounds, (0, 1, 1)),
            (E::ToWrap, (0, 1, 4)),
        ];
        for (e, (l, t, c)) in tagged {
            let code = e.term_error(true).code();
            assert_eq!((code.layer_raw(), code.etype(), code.ecode()), (l, t, c));
        }
        for (e, (l, t, c)) in untagged {
            let code = e.term_error(false).code();
            assert_eq!((code.layer_raw(), code.etype(), code.ecode()), (l, t, c));
        }
        // "STag cannot be invalidated": Remote Operation (type 2, code 9)
        // unless the STag is another protection domain's (Remote
        // Protection, type 1, code 9), as the core sends it.
        for (e, (l, t, c)) in [
            (InvalidateError::InvalidStag, (0, 2, 9)),
            (InvalidateError::CannotInvalidate, (0, 2, 9)),
            (InvalidateError::PdMismatch, (0, 1, 9)),
        ] {
            let code = e.term_error().code();
            assert_eq!((code.layer_raw(), code.etype(), code.ecode()), (l, t, c));
        }
    }

    #[test]
    fn stag_layout() {
        assert_eq!(stag(1, 0), 0x100);
        assert_eq!(stag(MAX_INDEX, 0xff), u32::MAX);
        for prev in 0..=255u8 {
            assert_ne!(fresh_key(Some(prev)), prev);
        }
    }

    #[test]
    fn masked_add_without_mask_is_a_plain_add() {
        assert_eq!(masked_add(5, 7, 0), 12);
        assert_eq!(masked_add(u64::MAX, 1, 0), 0);
    }

    #[test]
    fn masked_add_keeps_carries_inside_fields() {
        // Two 32-bit fields: the low field wraps without carrying.
        let mask = 1u64 << 31 | 1u64 << 63;
        let v = 0x0000_0001_ffff_ffff;
        assert_eq!(masked_add(v, 1 | 1 << 32, mask), 0x0000_0002_0000_0000);
    }

    // -- PdMemory: the protocol core over the STag table ------------------

    mod core_memory {
        use super::*;
        use softrdma_proto::conn::{Config, Connection};
        use softrdma_proto::mem::{Memory as _, RemoteAccess, RemoteAccessError as E};
        use softrdma_proto::types::{
            RecvWr as CRecv, SendOp as COp, SendWr as CSend, Sge as CSge, WcStatus as CSt,
        };

        /// Moves every FPDU `from` has to `to` (whole stream, copying mode).
        fn pump(
            from: &mut Connection<Arc<Memory>>,
            fm: &mut PdMemory<'_>,
            to: &mut Connection<Arc<Memory>>,
            tm: &mut PdMemory<'_>,
        ) -> usize {
            let mut fpdu = softrdma_proto::conn::TxFpdu::new();
            let mut bytes = Vec::new();
            let mut n = 0;
            while from.poll_transmit(fm, &mut fpdu) {
                assert!(fpdu.write_to(fm, &mut bytes));
                n += 1;
            }
            from.handle_sent(n);
            assert_eq!(to.handle_rx_stream(&bytes, tm), bytes.len());
            n
        }

        #[test]
        fn core_pair_runs_over_the_stag_table() {
            let dev = Device::open_default().unwrap();
            let pa = ProtectionDomain::new(&dev);
            let pb = ProtectionDomain::new(&dev);
            let all = Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC;
            let src = pa.register(4096, all).unwrap();
            let dst = pb.register(4096, all).unwrap();
            let rbuf = pb.register(64, Access::LOCAL_WRITE).unwrap();
            let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
            src.write(0, &data).unwrap();
            dst.write(0, &42u64.to_ne_bytes()).unwrap();
            let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
            let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
            let mut a: Connection<Arc<Memory>> = Connection::new(Config::new(true));
            let mut b: Connection<Arc<Memory>> = Connection::new(Config::new(true));

            // A Write of 3000 bytes (three FPDUs), a Send into a posted
            // receive, a Read back and a Fetch-and-Add.
            let sge = [CSge {
                lkey: src.lkey(),
                addr: src.addr(),
                len: 3000,
            }];
            let w = CSend::new(
                1,
                COp::Write {
                    rkey: dst.rkey(),
                    remote_addr: dst.addr() + 8,
                    imm: None,
                },
                &sge,
            );
            a.post_send(&w, &mut ma).unwrap();
            let rsge = [CSge {
                lkey: rbuf.lkey(),
                addr: rbuf.addr(),
                len: 64,
            }];
            b.post_recv(
                &CRecv {
                    wr_id: 9,
                    sgl: &rsge,
                },
                &mut mb,
            )
            .unwrap();
            let ssge = [CSge {
                lkey: src.lkey(),
                addr: src.addr(),
                len: 16,
            }];
            a.post_send(
                &CSend::new(
                    2,
                    COp::Send {
                        inv: None,
                        imm: None,
                    },
                    &ssge,
                ),
                &mut ma,
            )
            .unwrap();
            let sink = [CSge {
                lkey: src.lkey(),
                addr: src.addr() + 3008,
                len: 100,
            }];
            a.post_send(
                &CSend::new(
                    3,
                    COp::Read {
                        rkey: dst.rkey(),
                        remote_addr: dst.addr() + 8,
                    },
                    &sink,
                ),
                &mut ma,
            )
            .unwrap();
            let asink = [CSge {
                lkey: src.lkey(),
                addr: src.addr() + 4088,
                len: 8,
            }];
            a.post_send(
                &CSend::new(
                    4,
                    COp::FetchAdd {
                        rkey: dst.rkey(),
                        remote_addr: dst.addr(),
                        add: 5,
                    },
                    &asink,
                ),
                &mut ma,
            )
            .unwrap();

            for _ in 0..4 {
                pump(&mut a, &mut ma, &mut b, &mut mb);
                pump(&mut b, &mut mb, &mut a, &mut ma);
            }
            let done: Vec<(u64, CSt)> = std::iter::from_fn(|| a.poll_completion())
                .map(|c| (c.wr_id, c.status))
                .collect();
            assert_eq!(
                done,
                [
                    (1, CSt::Success),
                    (2, CSt::Success),
                    (3, CSt::Success),
                    (4, CSt::Success)
                ]
            );
            let r = b.poll_completion().unwrap();
            assert_eq!((r.wr_id, r.status, r.byte_len), (9, CSt::Success, 16));
            assert_eq!(dst.to_vec()[8..3008], data[..]);
            assert_eq!(rbuf.to_vec()[..16], data[..16]);
            assert_eq!(src.to_vec()[3008..3108], data[..100]);
            assert_eq!(src.to_vec()[4088..4096], 42u64.to_ne_bytes());
            assert_eq!(dst.to_vec()[..8], 47u64.to_ne_bytes());
        }

        #[test]
        fn lookups_keep_the_protection_rules() {
            let dev = Device::open_default().unwrap();
            let pa = ProtectionDomain::new(&dev);
            let pb = ProtectionDomain::new(&dev);
            let ro = pa.register(100, Access::REMOTE_READ).unwrap();
            let mut m = PdMemory::new(dev.stags(), pa.id(), None);
            assert!(
                m.remote(ro.rkey(), RemoteAccess::Read, ro.addr(), 100)
                    .is_ok()
            );
            assert_eq!(
                m.remote(ro.rkey(), RemoteAccess::Write, ro.addr(), 1).err(),
                Some(E::AccessRights)
            );
            assert_eq!(
                m.remote(ro.rkey(), RemoteAccess::Read, ro.addr() + 1, 100)
                    .err(),
                Some(E::BaseOrBounds)
            );
            assert_eq!(
                m.remote(ro.rkey() ^ 1, RemoteAccess::Read, ro.addr(), 1)
                    .err(),
                Some(E::InvalidStag)
            );
            let mut other = PdMemory::new(dev.stags(), pb.id(), None);
            assert_eq!(
                other
                    .remote(ro.rkey(), RemoteAccess::Read, ro.addr(), 1)
                    .err(),
                Some(E::StagNotAssociated)
            );
            // Copies stay inside their span.
            let s = m
                .remote(ro.rkey(), RemoteAccess::Read, ro.addr() + 10, 20)
                .unwrap();
            assert!(m.copy_in(&s, 0, &[1; 20]));
            assert!(!m.copy_in(&s, 1, &[1; 20]));
            let mut out = [0u8; 21];
            assert!(!m.copy_out(&s, 0, &mut out));
            assert!(m.copy_out(&s, 0, &mut out[..20]));
            assert_eq!(out[..20], [1; 20]);
            assert_eq!(
                ro.to_vec()[9..31],
                [[0].as_slice(), &[1; 20], &[0]].concat()[..]
            );
        }

        #[test]
        fn binds_and_fast_registers_by_key() {
            use softrdma_proto::mem::LocalOp;
            let dev = Device::open_default().unwrap();
            let pd = ProtectionDomain::new(&dev);
            let mr = pd
                .register(4096, Access::LOCAL_WRITE | Access::MW_BIND)
                .unwrap();
            let mw = pd.alloc_mw().unwrap();
            let mut m = PdMemory::new(dev.stags(), pd.id(), None);
            let bind = LocalOp::BindMw {
                mw: mw.rkey(),
                mr: mr.lkey(),
                addr: mr.addr() + 100,
                len: 50,
                access: Access::REMOTE_WRITE.bits(),
                key: None,
            };
            assert_eq!(m.local_op(&bind), Ok(()));
            assert!(mw.is_bound());
            let s = m
                .remote(mw.rkey(), RemoteAccess::Write, mr.addr() + 100, 50)
                .unwrap();
            assert_eq!((s.offset, s.len), (100, 50));
            assert_eq!(m.local_op(&bind), Err(()), "already bound");
            assert_eq!(m.local_op(&LocalOp::Invalidate { rkey: mw.rkey() }), Ok(()));
            assert!(!mw.is_bound());
            let fr = pd.alloc_mr(256).unwrap();
            let reg = LocalOp::FastReg {
                mr: fr.rkey(),
                iova: 0x1000,
                len: 128,
                access: Access::REMOTE_READ.bits(),
            };
            assert_eq!(m.local_op(&reg), Ok(()));
            assert!(fr.is_valid());
            let too_long = LocalOp::FastReg {
                mr: fr.rkey(),
                iova: 0,
                len: 4096,
                access: 0,
            };
            assert_eq!(m.local_op(&too_long), Err(()));
        }
    }
}
