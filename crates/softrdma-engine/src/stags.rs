//! The registration (STag) table of a device: its entries, the access
//! rights they grant and the errors of their checks. [`crate::mr`]
//! documents the STag format and the order of the checks, and re-exports
//! the public types of this module. The table is a module of its own, below
//! the device that owns it, so that the device does not import `mr`.

use std::cell::Cell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;
use rand::rngs::OsRng;
use rand::{Rng, RngCore, TryRngCore};
use softrdma_wire::errcode::TermError;

use crate::sys::mem::{MemError, Memory};
use crate::wc::WcStatus;

/// Local memory checked at post time: `len` bytes at `offset` of `mem`.
/// Holding it keeps the memory alive.
#[derive(Debug, Clone)]
pub(crate) struct LocalSeg {
    /// The memory.
    pub(crate) mem: Arc<Memory>,
    /// Byte offset in `mem`.
    pub(crate) offset: usize,
    /// Length in bytes.
    pub(crate) len: usize,
}

impl LocalSeg {
    /// The segment as the protocol core sees it.
    pub(crate) fn into_span(self) -> softrdma_proto::mem::Span<Arc<Memory>> {
        softrdma_proto::mem::Span {
            region: self.mem,
            offset: self.offset,
            len: self.len,
        }
    }
}

/// Access rights of a memory region or window (`ibv_access_flags`; same bit
/// values).
///
/// A region always allows local reads. As in verbs, [`Access::REMOTE_WRITE`]
/// and [`Access::REMOTE_ATOMIC`] require [`Access::LOCAL_WRITE`]
/// ([`Access::is_valid`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub(crate) u32);

impl Access {
    /// No rights beyond local read.
    pub const NONE: Access = Access(0);
    /// The local side may write (receive into it, RDMA Read sink, atomics
    /// result).
    pub const LOCAL_WRITE: Access = Access(1);
    /// Remote peers may write (RDMA Write).
    pub const REMOTE_WRITE: Access = Access(2);
    /// Remote peers may read (RDMA Read).
    pub const REMOTE_READ: Access = Access(4);
    /// Remote peers may run atomic operations (RFC 7306).
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Memory windows may be bound to the region.
    pub const MW_BIND: Access = Access(16);
    /// Every defined flag.
    pub const ALL: Access = Access(31);
    /// The flags a memory window may grant.
    pub const REMOTE: Access = Access(2 | 4 | 8);

    /// Flags from their ibverbs bit values; `None` if an unknown bit is set.
    pub const fn from_bits(bits: u32) -> Option<Access> {
        if bits & !Access::ALL.0 == 0 {
            Some(Access(bits))
        } else {
            None
        }
    }

    /// The ibverbs bit values.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// Whether every flag of `other` is set.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether no flag is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Flags set in either.
    #[must_use]
    pub const fn union(self, other: Access) -> Access {
        Access(self.0 | other.0)
    }

    /// Flags set in both.
    #[must_use]
    pub const fn intersection(self, other: Access) -> Access {
        Access(self.0 & other.0)
    }

    /// Flags of `self` not in `other`.
    #[must_use]
    pub const fn difference(self, other: Access) -> Access {
        Access(self.0 & !other.0)
    }

    /// The verbs rule: remote write or remote atomic access requires local
    /// write access.
    pub const fn is_valid(self) -> bool {
        let needs_local = self.0 & (Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0;
        !needs_local || self.0 & Access::LOCAL_WRITE.0 != 0
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        self.union(rhs)
    }
}

impl core::ops::BitOrAssign for Access {
    fn bitor_assign(&mut self, rhs: Access) {
        *self = self.union(rhs);
    }
}

impl core::ops::BitAnd for Access {
    type Output = Access;
    fn bitand(self, rhs: Access) -> Access {
        self.intersection(rhs)
    }
}

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

/// Why a registration (or re-registration, or allocation of a window or
/// fast-register region) failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegError {
    /// The access flags break the verbs rule (remote write or atomic access
    /// without local write).
    #[error("invalid access flags {0:?}: remote write and remote atomic need local write")]
    InvalidAccess(Access),
    /// Longer than the device's `max_mr_size`.
    #[error("{len} bytes exceeds the largest region of {max} bytes")]
    TooLarge {
        /// Requested length.
        len: u64,
        /// The device limit.
        max: u64,
    },
    /// The memory could not be allocated.
    #[error("out of memory allocating {0} bytes")]
    OutOfMemory(usize),
    /// All 2^24 - 1 STag indices are in use.
    #[error("the registration table is full")]
    TableFull,
    /// A re-registration while memory windows are bound to the region.
    #[error("{0} memory window(s) are bound to the region")]
    WindowsBound(u32),
}

impl From<MemError> for RegError {
    fn from(e: MemError) -> Self {
        match e {
            MemError::TooLarge(len) => RegError::TooLarge {
                len: len as u64,
                max: isize::MAX as u64,
            },
            MemError::OutOfMemory(len) => RegError::OutOfMemory(len),
        }
    }
}

/// A local read or write of a region's buffer out of range.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bytes [{offset}, {offset}+{len}) are outside the region's {region_len} bytes")]
pub struct RangeError {
    /// Requested offset.
    pub offset: usize,
    /// Requested length.
    pub len: usize,
    /// Length of the region's buffer.
    pub region_len: usize,
}

/// Why a remote access (tagged placement, Read Request source, atomic)
/// was refused. The variants are the RFC 5040 / 5041 protection errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteAccessError {
    /// No such STag index, the entry is invalid (invalidated, unbound
    /// window, fast-register region not registered), or the key differs.
    #[error("invalid STag")]
    InvalidStag,
    /// The STag belongs to another protection domain than the stream's.
    #[error("STag not associated with the stream (protection domain mismatch)")]
    StagNotAssociated,
    /// The STag does not grant the access the operation needs.
    #[error("access rights violation")]
    AccessRights,
    /// `[to, to + len)` is not inside the registered range.
    #[error("base or bounds violation")]
    BaseOrBounds,
    /// `to + len` wraps around 2^64.
    #[error("tagged offset wrap")]
    ToWrap,
}

impl RemoteAccessError {
    /// The Terminate error code to report.
    ///
    /// `tagged`: true for DDP tagged-buffer errors (placement of RDMA Write
    /// and Read Response data, RFC 5041 section 7.2, layer DDP, type Tagged
    /// Buffer); false for RDMAP remote protection errors (the source of an
    /// RDMA Read Request, atomics; RFC 5040 section 7.2).
    ///
    /// RFC 5041 has no "access rights" code for tagged buffers; like Linux
    /// siw, [`RemoteAccessError::AccessRights`] is reported there as a base
    /// or bounds violation.
    ///
    /// The mapping is the protocol core's (the code the connection sends):
    /// [`softrdma_proto::mem::RemoteAccessError::term_error`].
    pub const fn term_error(self, tagged: bool) -> TermError {
        use softrdma_proto::mem::RemoteAccessError as Core;
        let core = match self {
            RemoteAccessError::InvalidStag => Core::InvalidStag,
            RemoteAccessError::StagNotAssociated => Core::StagNotAssociated,
            RemoteAccessError::AccessRights => Core::AccessRights,
            RemoteAccessError::BaseOrBounds => Core::BaseOrBounds,
            RemoteAccessError::ToWrap => Core::ToWrap,
        };
        core.term_error(tagged)
    }

    /// The completion status the requester sees when told of this error.
    pub const fn wc_status(self) -> WcStatus {
        WcStatus::RemoteAccess
    }
}

/// Why a local SGE was refused at post time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LocalAccessError {
    /// No such lkey, invalid entry, wrong key, or the key of a window.
    #[error("invalid lkey {0:#010x}")]
    InvalidLkey(u32),
    /// The region belongs to another protection domain.
    #[error("lkey {0:#010x} belongs to another protection domain")]
    PdMismatch(u32),
    /// `[addr, addr + len)` is not inside the region.
    #[error("SGE [{addr:#x}, +{len}) is outside the region")]
    OutOfBounds {
        /// SGE address.
        addr: u64,
        /// SGE length.
        len: u32,
    },
    /// The operation writes the memory but the region lacks local write.
    #[error("lkey {0:#010x} lacks local write access")]
    NoLocalWrite(u32),
}

impl LocalAccessError {
    /// The completion status of the refused work request.
    pub const fn wc_status(self) -> WcStatus {
        WcStatus::LocalProtection
    }
}

/// Why an STag could not be invalidated (Local Invalidate or Send with
/// Invalidate).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidateError {
    /// No such STag (index or key).
    #[error("invalid STag")]
    InvalidStag,
    /// The STag belongs to another protection domain.
    #[error("STag belongs to another protection domain")]
    PdMismatch,
    /// The STag names a region registered with `register*` (only windows
    /// and fast-register regions can be invalidated).
    #[error("STag cannot be invalidated")]
    CannotInvalidate,
}

impl InvalidateError {
    /// The Terminate code sent for a failed remote invalidation (Send with
    /// Invalidate), RFC 5040 section 7.2: "STag cannot be invalidated", a
    /// Remote Protection error for an STag of another protection domain, a
    /// Remote Operation error otherwise. The mapping is the protocol
    /// core's: [`softrdma_proto::mem::InvalidateError::term_error`].
    pub const fn term_error(self) -> TermError {
        self.to_core().term_error()
    }

    /// The protocol core's counterpart of this error.
    pub(crate) const fn to_core(self) -> softrdma_proto::mem::InvalidateError {
        use softrdma_proto::mem::InvalidateError as Core;
        match self {
            InvalidateError::InvalidStag => Core::InvalidStag,
            InvalidateError::PdMismatch => Core::PdMismatch,
            InvalidateError::CannotInvalidate => Core::CannotInvalidate,
        }
    }

    /// The completion status of a failed Local Invalidate.
    pub const fn wc_status(self) -> WcStatus {
        WcStatus::InvalidateError
    }
}

/// Why a memory window could not be bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BindError {
    /// The window or the region belongs to another device.
    #[error("window and region belong to another device")]
    OtherDevice,
    /// The window and the region are in different protection domains.
    #[error("window and region are in different protection domains")]
    PdMismatch,
    /// The region is not valid (invalidated fast-register region).
    #[error("the region is not valid")]
    InvalidRegion,
    /// The region was not registered with [`Access::MW_BIND`].
    #[error("the region does not allow window binding")]
    NoBindRight,
    /// The window is already bound (a type 2 window must be invalidated
    /// before it is bound again).
    #[error("the window is already bound")]
    AlreadyBound,
    /// The window access contains flags other than remote read, write and
    /// atomic.
    #[error("invalid window access {0:?}")]
    InvalidAccess(Access),
    /// The window grants remote write or atomic access but the region lacks
    /// local write.
    #[error("window access exceeds what the region allows")]
    AccessExceedsRegion,
    /// The window range is not inside the region.
    #[error("window range is outside the region")]
    OutOfBounds,
}

impl BindError {
    /// The completion status of the failed Bind work request.
    pub const fn wc_status(self) -> WcStatus {
        WcStatus::MwBind
    }
}

/// Why a fast-register work request failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FastRegError {
    /// The region belongs to another device or is gone.
    #[error("the region belongs to another device")]
    OtherDevice,
    /// The region was not allocated with `alloc_mr`.
    #[error("the region is not a fast-register region")]
    NotFastReg,
    /// The region is currently valid: invalidate it first.
    #[error("the region is still valid")]
    AlreadyValid,
    /// Longer than the region's capacity.
    #[error("{len} bytes exceeds the region's capacity of {capacity}")]
    TooLong {
        /// Requested length.
        len: u64,
        /// The region's capacity.
        capacity: usize,
    },
    /// `iova + len` wraps around 2^64.
    #[error("address range wraps")]
    Wrap,
    /// Invalid access flags (see [`Access::is_valid`]).
    #[error("invalid access flags {0:?}")]
    InvalidAccess(Access),
}

impl FastRegError {
    /// The completion status of the failed work request.
    pub const fn wc_status(self) -> WcStatus {
        WcStatus::LocalProtection
    }
}

// ---------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------

/// Largest STag index (24 bits).
pub(crate) const MAX_INDEX: u32 = 0x00ff_ffff;

/// The STag of `index` with `key`.
pub(crate) const fn stag(index: u32, key: u8) -> u32 {
    (index << 8) | key as u32
}

/// Random numbers from the kernel's generator (`getrandom(2)`), fetched
/// 256 bytes at a time: as hard to guess as a generator seeded from it
/// (STags stay unpredictable), one system call per 64 draws, and nothing
/// to set up. A ChaCha generator asks the CPU for its vector features on
/// its first use (`cpuid`, about 30 µs a process in a virtual machine),
/// in every process that registers memory, for the handful of STags of a
/// connection.
#[derive(Clone)]
struct KernelRandom {
    buf: [u8; 256],
    /// The first byte of `buf` not drawn yet.
    next: usize,
}

impl KernelRandom {
    fn new() -> KernelRandom {
        KernelRandom {
            buf: [0; 256],
            next: 256,
        }
    }

    fn take<const N: usize>(&mut self) -> [u8; N] {
        if self.next + N > self.buf.len() {
            OsRng
                .try_fill_bytes(&mut self.buf)
                .expect("the kernel's random generator");
            self.next = 0;
        }
        let mut out = [0; N];
        out.copy_from_slice(&self.buf[self.next..self.next + N]);
        self.next += N;
        out
    }
}

impl RngCore for KernelRandom {
    fn next_u32(&mut self) -> u32 {
        u32::from_ne_bytes(self.take())
    }

    fn next_u64(&mut self) -> u64 {
        u64::from_ne_bytes(self.take())
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(8) {
            let b: [u8; 8] = self.take();
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }
}

thread_local! {
    /// The calling thread's random numbers (see [`KernelRandom`]). Not
    /// `rand::rng()`: that is a thread-local with a destructor, and
    /// glibc's `exit` destroys the exiting thread's thread-locals before
    /// it runs the exit handlers, which may register memory or connect
    /// (`with` then panics). This one has no destructor. Kept with the
    /// fork generation that filled it: a `fork(2)`ed child (and each of
    /// its siblings) would otherwise draw the same STags as its parent's
    /// thread, which a peer of one could learn to predict another's.
    static RNG: Cell<Option<(u64, KernelRandom)>> = const { Cell::new(None) };
}

/// Runs `f` with random numbers: the thread's own (see [`RNG`]), new ones
/// for this call if they cannot be had (a nested call, or the thread's
/// locals already destroyed), or new ones after a fork.
fn with_rng<R>(f: impl FnOnce(&mut KernelRandom) -> R) -> R {
    let generation = crate::sys::epoll::fork_generation();
    let mut rng = RNG
        .try_with(Cell::take)
        .ok()
        .flatten()
        .filter(|(g, _)| *g == generation)
        .map_or_else(KernelRandom::new, |(_, rng)| rng);
    let r = f(&mut rng);
    let _ = RNG.try_with(|c| c.set(Some((generation, rng))));
    r
}

/// A random key different from `previous`.
pub(crate) fn fresh_key(previous: Option<u8>) -> u8 {
    with_rng(|rng| {
        loop {
            let k: u8 = rng.random();
            if Some(k) != previous {
                return k;
            }
        }
    })
}

/// What a window bind asks for: the range of the region, the rights, and
/// the key byte of the new STag (`None`: a fresh one).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowBind {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) key: Option<u8>,
}

/// What an entry is.
#[derive(Debug)]
enum Kind {
    /// A region; `fast_reg` if allocated with `alloc_mr`. `windows` counts
    /// windows bound to it (shared with their entries).
    Region {
        fast_reg: bool,
        windows: Arc<std::sync::atomic::AtomicU32>,
    },
    /// A type 2 window; `bound_to` is the window counter of the region it
    /// is bound to.
    Window {
        bound_to: Option<Arc<std::sync::atomic::AtomicU32>>,
    },
}

/// One registration.
#[derive(Debug)]
struct Entry {
    key: u8,
    valid: bool,
    pd: u32,
    access: Access,
    /// First address (Tagged Offset) the entry answers to.
    iova: u64,
    /// Registered length in bytes.
    len: u64,
    /// The memory (`None`: unbound window).
    mem: Option<Arc<Memory>>,
    /// Offset in `mem` of `iova`.
    mem_offset: usize,
    kind: Kind,
}

impl Entry {
    /// The offset in `mem` of `[addr, addr + len)`, if inside the range.
    fn offset_of(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        let reg_end = self.iova.checked_add(self.len)?;
        if addr < self.iova || end > reg_end {
            return None;
        }
        let rel = usize::try_from(addr - self.iova).ok()?;
        self.mem_offset.checked_add(rel)
    }
}

/// Hashes an STag index (already random) with one multiplication.
///
/// Not a keyed hash, and safe from hash flooding all the same: only the
/// engine inserts, with indices it draws at random from the 24-bit space
/// (`Slots::free_index`), so the table's layout is random whatever a peer
/// does. A peer chooses only which STags to *look up* (those of the RDMA
/// Writes, Reads and invalidations it sends): a look-up of a missing
/// index probes one run of occupied buckets, whose length the random
/// layout and the map's load factor bound, and cannot lengthen, so no
/// choice of keys makes look-ups slow. (SipHash's key would only matter
/// if a peer could choose the inserted keys.)
#[derive(Debug, Default, Clone, Copy)]
struct IndexHasher(u64);

impl std::hash::Hasher for IndexHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8 | u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u32(&mut self, i: u32) {
        self.0 = u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type IndexMap = std::collections::HashMap<u32, Entry, std::hash::BuildHasherDefault<IndexHasher>>;

#[derive(Debug, Default)]
struct Slots {
    /// The entries by STag index. Indices are drawn at random from the
    /// whole 24-bit space (never 0), so an STag cannot be guessed from
    /// another one (like Linux siw, which starts each allocation at a random
    /// index).
    entries: IndexMap,
}

impl Slots {
    fn get(&self, index: u32) -> Option<&Entry> {
        self.entries.get(&index)
    }

    fn get_mut(&mut self, index: u32) -> Option<&mut Entry> {
        self.entries.get_mut(&index)
    }

    /// A random unused index: random draws, then (if the table is very
    /// full) the next unused index after a random start.
    fn free_index(&self) -> Option<u32> {
        let start = with_rng(|rng| {
            for _ in 0..64 {
                let i = rng.random_range(1..=MAX_INDEX);
                if !self.entries.contains_key(&i) {
                    return Ok(i);
                }
            }
            Err(rng.random_range(1..=MAX_INDEX))
        });
        match start {
            Ok(i) => Some(i),
            Err(start) => (start..=MAX_INDEX)
                .chain(1..start)
                .find(|i| !self.entries.contains_key(i)),
        }
    }
}

/// Registered memory for remote or local access: `len` bytes at `offset` of
/// `mem`. Holding it keeps the memory alive.
#[allow(dead_code)] // used by the data path
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The memory.
    pub(crate) mem: Arc<Memory>,
    /// Byte offset in `mem`.
    pub(crate) offset: usize,
    /// Length in bytes.
    pub(crate) len: usize,
}

/// The registration table of a device: every region and window by STag
/// index. Lookups take a read lock and clone an `Arc`.
#[derive(Debug)]
pub(crate) struct StagTable {
    slots: RwLock<Slots>,
    /// Changes of existing entries so far ([`StagTable::epoch`]).
    epoch: AtomicU64,
}

/// What a new entry is registered as.
pub(crate) struct NewEntry {
    pub(crate) pd: u32,
    pub(crate) access: Access,
    pub(crate) iova: u64,
    pub(crate) len: u64,
    pub(crate) mem: Option<Arc<Memory>>,
    pub(crate) valid: bool,
    pub(crate) kind: NewKind,
}

/// Kind of a new entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum NewKind {
    /// A region registered with memory.
    Region,
    /// A fast-register region (invalid until fast-registered).
    FastRegRegion,
    /// A type 2 memory window.
    Window,
}

impl StagTable {
    /// An empty table.
    pub(crate) fn new() -> Self {
        StagTable {
            slots: RwLock::new(Slots::default()),
            epoch: AtomicU64::new(0),
        }
    }

    /// Adds an entry with a random key; returns its index.
    pub(crate) fn insert(&self, new: NewEntry) -> Result<u32, RegError> {
        let kind = match new.kind {
            NewKind::Region | NewKind::FastRegRegion => Kind::Region {
                fast_reg: new.kind == NewKind::FastRegRegion,
                windows: Arc::default(),
            },
            NewKind::Window => Kind::Window { bound_to: None },
        };
        let mut entry = Entry {
            key: 0,
            valid: new.valid,
            pd: new.pd,
            access: new.access,
            iova: new.iova,
            len: new.len,
            mem: new.mem,
            mem_offset: 0,
            kind,
        };
        let mut slots = self.slots.write();
        let index = slots.free_index().ok_or(RegError::TableFull)?;
        entry.key = fresh_key(None);
        slots.entries.insert(index, entry);
        Ok(index)
    }

    /// The table's write lock for a change of existing entries; the
    /// change is counted with [`StagTable::changed`] under it, once the
    /// change is certain (a refused change counts nothing).
    fn change(&self) -> parking_lot::RwLockWriteGuard<'_, Slots> {
        self.slots.write()
    }

    /// Counts a change of an existing entry ([`StagTable::epoch`]); called
    /// with the write lock of [`StagTable::change`] held.
    fn changed(&self) {
        self.epoch.fetch_add(1, Ordering::Release);
    }

    /// The number of changes of existing entries so far (removals,
    /// invalidations, binds, fast-registers, re-registrations; not
    /// insertions, which change no answer about an existing key, nor
    /// refused changes). Each change counts under the write lock, so a
    /// value read *before* a look-up is never newer than the table the
    /// look-up saw: a look-up made after reading `e`, whose answer is
    /// kept, gives that same answer again while `epoch()` is still `e`
    /// (the receive buffers a QP keeps past their completion,
    /// `Config::keep_recvs` of the protocol core). A plain load, no lock.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Removes the entry at `index`. A bound window releases its region.
    pub(crate) fn remove(&self, index: u32) {
        let mut slots = self.change();
        let Some(entry) = slots.entries.remove(&index) else {
            return;
        };
        self.changed();
        if let Kind::Window {
            bound_to: Some(count),
        } = entry.kind
        {
            count.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The current STag of the entry at `index` (0 if there is none).
    pub(crate) fn stag_of(&self, index: u32) -> u32 {
        self.slots
            .read()
            .get(index)
            .map_or(0, |e| stag(index, e.key))
    }

    /// `(iova, len, stag)` of the entry at `index`: what an SGE of it
    /// needs, in one look at the table.
    pub(crate) fn sge_info(&self, index: u32) -> Option<(u64, u64, u32)> {
        self.slots
            .read()
            .get(index)
            .map(|e| (e.iova, e.len, stag(index, e.key)))
    }

    /// `(valid, iova, len, access)` of the entry at `index`.
    pub(crate) fn info(&self, index: u32) -> Option<(bool, u64, u64, Access)> {
        self.slots
            .read()
            .get(index)
            .map(|e| (e.valid, e.iova, e.len, e.access))
    }

    /// Number of windows bound to the region at `index`.
    pub(crate) fn windows_of(&self, index: u32) -> u32 {
        match self.slots.read().get(index).map(|e| &e.kind) {
            Some(Kind::Region { windows, .. }) => {
                windows.load(std::sync::atomic::Ordering::Relaxed)
            }
            _ => 0,
        }
    }

    /// Remote access check (placement of RDMA Write and Read Response data,
    /// source of Read Response data, atomics).
    ///
    /// `need`: [`Access::REMOTE_WRITE`] to place an RDMA Write,
    /// [`Access::REMOTE_READ`] for the source of a Read Response,
    /// [`Access::REMOTE_ATOMIC`] for an atomic, and [`Access::LOCAL_WRITE`]
    /// to place a Read Response into the local sink the Read Request named.
    ///
    /// Checks, in this order: the STag index exists, the entry is valid and
    /// the key matches ([`RemoteAccessError::InvalidStag`]); the entry's
    /// protection domain is `pd` ([`RemoteAccessError::StagNotAssociated`]);
    /// its access contains `need` ([`RemoteAccessError::AccessRights`]);
    /// then, if `len > 0`, `to + len` does not wrap
    /// ([`RemoteAccessError::ToWrap`]) and `[to, to + len)` is inside the
    /// registered range ([`RemoteAccessError::BaseOrBounds`]).
    ///
    /// Zero length: the STag checks still apply and the range checks do not
    /// (the returned target is empty). Linux siw places a zero-length RDMA
    /// Write without looking its STag up at all (peer-to-peer RTR messages
    /// carry STag 1, which is never valid): a data path that wants that
    /// behaviour must not call this function for zero-length placement.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn remote(
        &self,
        stag_value: u32,
        pd: u32,
        need: Access,
        to: u64,
        len: u64,
    ) -> Result<Target, RemoteAccessError> {
        let index = stag_value >> 8;
        let key = (stag_value & 0xff) as u8;
        let slots = self.slots.read();
        let entry = slots
            .get(index)
            .filter(|e| e.valid && e.key == key)
            .ok_or(RemoteAccessError::InvalidStag)?;
        let mem = entry.mem.as_ref().ok_or(RemoteAccessError::InvalidStag)?;
        if entry.pd != pd {
            return Err(RemoteAccessError::StagNotAssociated);
        }
        if !entry.access.contains(need) {
            return Err(RemoteAccessError::AccessRights);
        }
        if len == 0 {
            return Ok(Target {
                mem: Arc::clone(mem),
                offset: 0,
                len: 0,
            });
        }
        if to.checked_add(len).is_none() {
            return Err(RemoteAccessError::ToWrap);
        }
        let offset = entry
            .offset_of(to, len)
            .ok_or(RemoteAccessError::BaseOrBounds)?;
        let len = usize::try_from(len).map_err(|_| RemoteAccessError::BaseOrBounds)?;
        if mem.ptr_at(offset, len).is_none() {
            return Err(RemoteAccessError::BaseOrBounds);
        }
        Ok(Target {
            mem: Arc::clone(mem),
            offset,
            len,
        })
    }

    /// Local SGE check at post time: `lkey` names a valid region (not a
    /// window) of protection domain `pd`, `[addr, addr + len)` is inside it,
    /// and, if `need_write`, the region allows local write.
    ///
    /// A zero-length SGE needs a valid lkey of the domain but no range; it
    /// yields an empty segment.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn local(
        &self,
        lkey: u32,
        pd: u32,
        addr: u64,
        len: u32,
        need_write: bool,
    ) -> Result<LocalSeg, LocalAccessError> {
        let index = lkey >> 8;
        let key = (lkey & 0xff) as u8;
        let slots = self.slots.read();
        let entry = slots
            .get(index)
            .filter(|e| e.valid && e.key == key && matches!(e.kind, Kind::Region { .. }))
            .ok_or(LocalAccessError::InvalidLkey(lkey))?;
        let mem = entry
            .mem
            .as_ref()
            .ok_or(LocalAccessError::InvalidLkey(lkey))?;
        if entry.pd != pd {
            return Err(LocalAccessError::PdMismatch(lkey));
        }
        if need_write && !entry.access.contains(Access::LOCAL_WRITE) {
            return Err(LocalAccessError::NoLocalWrite(lkey));
        }
        if len == 0 {
            return Ok(LocalSeg {
                mem: Arc::clone(mem),
                offset: 0,
                len: 0,
            });
        }
        let out = LocalAccessError::OutOfBounds { addr, len };
        let offset = entry.offset_of(addr, u64::from(len)).ok_or(out)?;
        let len = len as usize;
        if mem.ptr_at(offset, len).is_none() {
            return Err(out);
        }
        Ok(LocalSeg {
            mem: Arc::clone(mem),
            offset,
            len,
        })
    }

    /// Invalidates a memory window or a fast-register region (Local
    /// Invalidate, or `remote`: Send with Invalidate from the peer). The
    /// entry must belong to `pd`. Regions registered with memory
    /// (`register*`) cannot be invalidated. An invalidated window is unbound
    /// (it releases its region); the key is kept, lookups fail with "invalid
    /// STag". Invalidating an already invalid entry with the right key
    /// succeeds.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn invalidate(
        &self,
        stag_value: u32,
        pd: u32,
        remote: bool,
    ) -> Result<(), InvalidateError> {
        // Local and remote invalidation follow the same rules here; the
        // caller picks the error report (Terminate or completion status).
        let _ = remote;
        let index = stag_value >> 8;
        let key = (stag_value & 0xff) as u8;
        let mut slots = self.change();
        let entry = slots
            .get_mut(index)
            .filter(|e| e.key == key)
            .ok_or(InvalidateError::InvalidStag)?;
        if entry.pd != pd {
            return Err(InvalidateError::PdMismatch);
        }
        match &mut entry.kind {
            Kind::Region {
                fast_reg: false, ..
            } => return Err(InvalidateError::CannotInvalidate),
            Kind::Region { fast_reg: true, .. } => {
                entry.valid = false;
            }
            Kind::Window { bound_to } => {
                if let Some(count) = bound_to.take() {
                    count.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
                }
                entry.valid = false;
                entry.mem = None;
            }
        }
        self.changed();
        Ok(())
    }

    #[cfg_attr(not(test), allow(dead_code))] // see `PdMemory`
    /// [`StagTable::bind_mw`] by STag: window `mw_stag` (its index; the key
    /// is replaced by `bind.key`, or a fresh one) and region `mr_lkey`
    /// (index and key), both of `pd`.
    pub(crate) fn bind_mw_by_key(
        &self,
        pd: u32,
        mw_stag: u32,
        mr_lkey: u32,
        bind: WindowBind,
    ) -> Result<u32, BindError> {
        {
            let slots = self.slots.read();
            let key_ok = slots
                .get(mr_lkey >> 8)
                .is_some_and(|e| e.key == (mr_lkey & 0xff) as u8);
            if !key_ok {
                return Err(BindError::InvalidRegion);
            }
        }
        self.bind_at(pd, mw_stag >> 8, mr_lkey >> 8, bind)
    }

    /// The bind itself: both entries must belong to `pd`.
    pub(crate) fn bind_at(
        &self,
        pd: u32,
        mw_index: u32,
        mr_index: u32,
        bind: WindowBind,
    ) -> Result<u32, BindError> {
        let WindowBind {
            addr,
            len,
            access,
            key,
        } = bind;
        if !Access::REMOTE.contains(access) {
            return Err(BindError::InvalidAccess(access));
        }
        let mut slots = self.change();
        if slots.get(mw_index).is_some_and(|e| e.pd != pd)
            || slots.get(mr_index).is_some_and(|e| e.pd != pd)
        {
            return Err(BindError::PdMismatch);
        }
        let (mem, mem_offset, windows) = {
            let region = slots
                .get(mr_index)
                .filter(|e| e.valid)
                .ok_or(BindError::InvalidRegion)?;
            let Kind::Region { windows, .. } = &region.kind else {
                return Err(BindError::InvalidRegion);
            };
            if !region.access.contains(Access::MW_BIND) {
                return Err(BindError::NoBindRight);
            }
            if access.intersection(Access::REMOTE_WRITE | Access::REMOTE_ATOMIC) != Access::NONE
                && !region.access.contains(Access::LOCAL_WRITE)
            {
                return Err(BindError::AccessExceedsRegion);
            }
            let offset = region.offset_of(addr, len).ok_or(BindError::OutOfBounds)?;
            let mem = region.mem.clone().ok_or(BindError::InvalidRegion)?;
            (mem, offset, Arc::clone(windows))
        };
        let window = slots.get_mut(mw_index).ok_or(BindError::OtherDevice)?;
        let Kind::Window { bound_to } = &mut window.kind else {
            return Err(BindError::OtherDevice);
        };
        if bound_to.is_some() {
            return Err(BindError::AlreadyBound);
        }
        windows.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *bound_to = Some(windows);
        self.changed();
        window.key = key.unwrap_or_else(|| fresh_key(Some(window.key)));
        window.valid = true;
        window.access = access;
        window.iova = addr;
        window.len = len;
        window.mem = Some(mem);
        window.mem_offset = mem_offset;
        Ok(stag(mw_index, window.key))
    }

    #[cfg_attr(not(test), allow(dead_code))] // see `PdMemory`
    /// [`StagTable::fast_reg`] by key: region `mr_key` (its index; the key
    /// is replaced) of `pd`.
    pub(crate) fn fast_reg_by_key(
        &self,
        pd: u32,
        mr_key: u32,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<u32, FastRegError> {
        let capacity = {
            let slots = self.slots.read();
            slots
                .get(mr_key >> 8)
                .and_then(|e| e.mem.as_ref().map(|m| m.len()))
                .ok_or(FastRegError::NotFastReg)?
        };
        self.fast_reg_at(Some(pd), mr_key >> 8, capacity, iova, len, access)
    }

    /// The fast-register itself (`pd`: the entry must belong to it).
    pub(crate) fn fast_reg_at(
        &self,
        pd: Option<u32>,
        index: u32,
        capacity: usize,
        iova: u64,
        len: u64,
        access: Access,
    ) -> Result<u32, FastRegError> {
        if !access.is_valid() {
            return Err(FastRegError::InvalidAccess(access));
        }
        if usize::try_from(len).map_or(true, |l| l > capacity) {
            return Err(FastRegError::TooLong { len, capacity });
        }
        if iova.checked_add(len).is_none() {
            return Err(FastRegError::Wrap);
        }
        let mut slots = self.change();
        let entry = slots
            .get_mut(index)
            .filter(|e| pd.is_none_or(|pd| e.pd == pd))
            .ok_or(FastRegError::OtherDevice)?;
        if !matches!(entry.kind, Kind::Region { fast_reg: true, .. }) {
            return Err(FastRegError::NotFastReg);
        }
        if entry.valid {
            return Err(FastRegError::AlreadyValid);
        }
        self.changed();
        entry.key = fresh_key(Some(entry.key));
        entry.valid = true;
        entry.iova = iova;
        entry.len = len;
        entry.access = access;
        entry.mem_offset = 0;
        Ok(stag(index, entry.key))
    }

    /// Re-registration: new access and a fresh key for the region at
    /// `index`, same memory and range. Fails while windows are bound.
    pub(crate) fn rereg(&self, index: u32, access: Access) -> Result<u32, RegError> {
        let mut slots = self.change();
        let entry = slots.get_mut(index).ok_or(RegError::TableFull)?;
        if let Kind::Region { windows, .. } = &entry.kind {
            let n = windows.load(std::sync::atomic::Ordering::Relaxed);
            if n > 0 {
                return Err(RegError::WindowsBound(n));
            }
        }
        self.changed();
        entry.key = fresh_key(Some(entry.key));
        entry.access = access;
        Ok(stag(index, entry.key))
    }
}

impl StagTable {
    /// Removes the entry named by `stag_value` if its key still matches
    /// (the index may have been reused after an earlier removal).
    pub(crate) fn remove_stag(&self, stag_value: u32) {
        let index = stag_value >> 8;
        let key = (stag_value & 0xff) as u8;
        let mut slots = self.change();
        if slots.get(index).is_some_and(|e| e.key == key) {
            slots.entries.remove(&index);
            self.changed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Every change of an existing entry moves the change counter on (a
    /// kept receive buffer checked before it is checked again): removals,
    /// re-registrations, fast-registers, invalidations (local or remote),
    /// binds; an insertion does not, nor a change that is refused.
    #[test]
    fn the_epoch_counts_changes_of_existing_entries() {
        let t = StagTable::new();
        let new = |t: &StagTable, kind, access, valid| {
            t.insert(NewEntry {
                pd: 1,
                access,
                iova: 0x1000,
                len: 64,
                mem: Some(Memory::from_vec(vec![0; 64])),
                valid,
                kind,
            })
            .unwrap()
        };
        let region = |t: &StagTable| new(t, NewKind::Region, Access::LOCAL_WRITE, true);
        let e0 = t.epoch();
        let a = region(&t);
        let b = region(&t);
        assert_eq!(t.epoch(), e0, "an insertion counted");
        let lkey = t.stag_of(a);
        assert!(t.local(lkey, 1, 0x1000, 64, true).is_ok());
        t.rereg(a, Access::NONE).unwrap();
        assert_eq!(t.epoch(), e0 + 1);
        assert!(t.local(t.stag_of(a), 1, 0x1000, 64, true).is_err());
        t.remove(b);
        assert_eq!(t.epoch(), e0 + 2);
        t.remove_stag(t.stag_of(a));
        assert_eq!(t.epoch(), e0 + 3);
        assert!(t.local(lkey, 1, 0x1000, 64, false).is_err());

        // A fast-register region: fast-registered, invalidated with the
        // same key (the look-up's answer changes, the key does not),
        // fast-registered again, invalidated by the peer.
        let f = new(&t, NewKind::FastRegRegion, Access::NONE, false);
        let e = t.epoch();
        assert_eq!(e, e0 + 3, "an insertion counted");
        let fkey = t
            .fast_reg_at(Some(1), f, 64, 0x2000, 64, Access::LOCAL_WRITE)
            .unwrap();
        assert_eq!(t.epoch(), e + 1);
        assert!(t.local(fkey, 1, 0x2000, 64, true).is_ok());
        t.invalidate(fkey, 1, false).unwrap();
        assert_eq!(t.epoch(), e + 2);
        assert_eq!(t.stag_of(f), fkey, "the invalidation changed the key");
        assert!(t.local(fkey, 1, 0x2000, 64, true).is_err());
        let fkey = t
            .fast_reg_at(Some(1), f, 64, 0x2000, 64, Access::LOCAL_WRITE)
            .unwrap();
        assert_eq!(t.epoch(), e + 3);
        t.invalidate(fkey, 1, true).unwrap();
        assert_eq!(t.epoch(), e + 4);

        // A window bound to a region and invalidated.
        let m = new(
            &t,
            NewKind::Region,
            Access::LOCAL_WRITE | Access::MW_BIND,
            true,
        );
        let w = new(&t, NewKind::Window, Access::NONE, false);
        let e = t.epoch();
        let bind = WindowBind {
            addr: 0x1000,
            len: 64,
            access: Access::REMOTE_READ,
            key: None,
        };
        let wkey = t.bind_at(1, w, m, bind).unwrap();
        assert_eq!(t.epoch(), e + 1);
        t.invalidate(wkey, 1, false).unwrap();
        assert_eq!(t.epoch(), e + 2);

        // Refused changes count nothing.
        let e = t.epoch();
        assert!(t.bind_at(2, w, m, bind).is_err(), "another PD's bind");
        assert!(
            t.bind_at(1, w, f, bind).is_err(),
            "a bind to an invalid region"
        );
        assert!(
            t.invalidate(t.stag_of(m), 1, false).is_err(),
            "a registered region"
        );
        assert!(t.invalidate(fkey ^ 1, 1, false).is_err(), "a wrong key");
        assert!(t.invalidate(fkey, 2, false).is_err(), "another PD");
        assert!(t.fast_reg_at(Some(2), f, 64, 0, 64, Access::NONE).is_err());
        assert!(t.fast_reg_at(Some(1), m, 64, 0, 64, Access::NONE).is_err());
        assert!(t.fast_reg_at(Some(1), f, 64, 0, 65, Access::NONE).is_err());
        t.remove(9999);
        t.remove_stag(t.stag_of(m) ^ 1);
        assert_eq!(t.epoch(), e, "a refused change counted");
    }

    /// Keys and indices are drawn from their whole ranges.
    #[test]
    fn draws_are_spread_over_the_whole_range() {
        // 256 draws: more than one fetch of the buffer; every byte value
        // of a key is as likely (a constant or a repeating buffer would
        // fail), and the 24-bit indices differ.
        let keys: std::collections::HashSet<u8> = (0..256).map(|_| fresh_key(None)).collect();
        assert!(keys.len() > 100, "{} different keys of 256", keys.len());
        let idx: std::collections::HashSet<u32> = (0..256)
            .map(|_| with_rng(|r| r.random_range(1..=MAX_INDEX)))
            .collect();
        assert!(idx.len() > 250, "{} different indices of 256", idx.len());
        let mut b = [0u8; 13];
        with_rng(|r| r.fill_bytes(&mut b));
        assert_ne!(b, [0; 13]);
    }

    /// A `fork(2)`ed child draws other STags than its parent's thread
    /// would: the thread's random bytes are fetched anew in a new fork
    /// generation (copied ones would repeat the parent's draws in every
    /// child of a preforking server).
    #[test]
    fn a_forked_child_draws_other_stags_than_its_parent() {
        let _ = fresh_key(None);
        let parent = RNG
            .with(|c| {
                let v = c.take();
                let copy = v.clone();
                c.set(v);
                copy
            })
            .expect("the thread's generator");
        let ok = crate::sys::process::in_child(Duration::from_secs(20), move || {
            let mut twin = parent.1;
            let mine: Vec<u64> = (0..4).map(|_| with_rng(|r| r.random())).collect();
            let theirs: Vec<u64> = (0..4).map(|_| twin.random()).collect();
            mine != theirs
        });
        assert!(ok, "the child drew its parent's sequence");
    }
}
