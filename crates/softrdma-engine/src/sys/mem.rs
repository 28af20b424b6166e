//! Registered memory: a buffer that remote peers may write at any time.
//!
//! A [`Memory`] is a fixed range of bytes with a stable address for its
//! whole life. It is shared (`Arc<Memory>`) by the memory region that owns
//! it, by memory windows bound to that region and by every posted work
//! request that names it, so it outlives a deregistration while work is in
//! flight.
//!
//! Remote peers place data into registered memory concurrently with the
//! application, exactly like hardware DMA. This module therefore never hands
//! out `&[u8]` or `&mut [u8]` over the buffer: local access is by copy in and
//! copy out through raw pointers ([`Memory::copy_in`], [`Memory::copy_out`])
//! or by 64-bit atomics ([`Memory::atomic_u64`]). A copy that overlaps a
//! concurrent placement may observe a mix of old and new bytes, as with a
//! DMA engine; ordering between the two is the protocol's business
//! (completions), not this module's.

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// Alignment of memory allocated by [`Memory::alloc_zeroed`].
pub(crate) const PAGE_SIZE: usize = 4096;

/// Allocations of at least this many bytes are anonymous mappings (zeroed
/// lazily by the kernel) instead of allocator memory.
const MAP_MIN: usize = 64 * 1024;

/// Regions asked for with [`Memory::alloc_zeroed_huge`] of at least this
/// many bytes are backed by transparent huge pages where the kernel allows
/// it (`madvise(MADV_HUGEPAGE)` on their 2 MiB-aligned interior): far
/// fewer page faults at first touch and TLB misses as the data path copies
/// megabytes into them, at the price of memory made resident 2 MiB at a
/// time. Only on request and only on mappings the engine makes and
/// unmaps itself, so the advice ends with the region: other regions are
/// backed only where touched, 4 KiB at a time, and users rely on that (a
/// socket's 4 MiB receive ring of which an idle connection touches
/// 512 KiB, `softrdma-sockets`); a buffer taken over from a `Vec` goes
/// back to the allocator, where advice would outlive it.
pub(crate) const HUGE_MIN: usize = 2 * 1024 * 1024;

/// Asks for transparent huge pages on the 2 MiB-aligned interior of the
/// `len` bytes at `base` (a hint: the kernel's `transparent_hugepage`
/// setting decides; `never` ignores it, `always` needs no hint). Returns
/// whether the kernel took the hint for a non-empty range.
fn advise_huge(base: *mut u8, len: usize) -> bool {
    if len < HUGE_MIN {
        return false;
    }
    let start = (base as usize).next_multiple_of(HUGE_MIN);
    let end = (base as usize + len) / HUGE_MIN * HUGE_MIN;
    if end <= start {
        return false;
    }
    // SAFETY: the range lies inside memory this module owns (a mapping or
    // an allocation of at least `len` bytes at `base`); MADV_HUGEPAGE
    // changes how its pages are backed, never their contents.
    unsafe {
        libc::madvise(
            std::ptr::without_provenance_mut(start),
            end - start,
            libc::MADV_HUGEPAGE,
        ) == 0
    }
}

/// Who frees the buffer when the [`Memory`] is dropped.
#[derive(Debug)]
enum Owner {
    /// Allocated with the global allocator with this layout (size > 0).
    Alloc(Layout),
    /// An anonymous private mapping of this many bytes (`mmap`).
    Map(usize),
    /// The buffer of a `Vec<u8>` taken apart: its capacity (its length is
    /// `Memory::len`).
    Vec { capacity: usize },
    /// Not owned: the caller of [`Memory::external`] keeps it valid, or the
    /// buffer is empty and there is nothing to free.
    None,
}

/// Why memory could not be allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum MemError {
    /// The length cannot be allocated at page alignment (larger than
    /// `isize::MAX` once rounded).
    #[error("{0} bytes is too large to allocate")]
    TooLarge(usize),
    /// The allocator returned no memory.
    #[error("out of memory allocating {0} bytes")]
    OutOfMemory(usize),
}

/// A range of bytes with a stable address that may be written by remote
/// peers at any time (see the module documentation).
///
/// Invariant: `base` is valid for reads and writes of `len` bytes for the
/// whole life of the value (owned buffers are freed only in `Drop`; external
/// ones are guaranteed by the caller of [`Memory::external`]).
pub(crate) struct Memory {
    base: NonNull<u8>,
    len: usize,
    owner: Owner,
}

// SAFETY: `Memory` is a raw buffer with no thread affinity; all access goes
// through raw pointer copies or atomics and is documented as racing like DMA.
// The owner (a layout or a Vec capacity) is plain data.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`: shared access never creates references to the
// bytes except `&AtomicU64`, which is designed for shared mutation.
unsafe impl Sync for Memory {}

impl core::fmt::Debug for Memory {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Memory")
            .field("base", &self.base)
            .field("len", &self.len)
            .field("owner", &self.owner)
            .finish()
    }
}

impl Memory {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_SIZE`]. `len` 0 gives an
    /// empty buffer at a dangling, page-aligned address.
    ///
    /// # Errors
    ///
    /// [`MemError::TooLarge`] if the layout is not representable,
    /// [`MemError::OutOfMemory`] if the allocator fails.
    pub(crate) fn alloc_zeroed(len: usize) -> Result<Arc<Memory>, MemError> {
        if len == 0 {
            let base = NonNull::new(std::ptr::without_provenance_mut::<u8>(PAGE_SIZE))
                .ok_or(MemError::OutOfMemory(0))?;
            return Ok(Arc::new(Memory {
                base,
                len: 0,
                owner: Owner::None,
            }));
        }
        let layout =
            Layout::from_size_align(len, PAGE_SIZE).map_err(|_| MemError::TooLarge(len))?;
        if len >= MAP_MIN {
            // Page-aligned `alloc_zeroed` is an aligned allocation plus a
            // memset: every page becomes resident at once. An anonymous
            // mapping is zeroed lazily by the kernel, page by page, when
            // first touched, so a large region costs memory only where it
            // is used.
            // SAFETY: a new anonymous private mapping: no address hint, no
            // descriptor; it returns MAP_FAILED or a fresh, page-aligned
            // range of `len` bytes that nothing else uses.
            let ptr = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if ptr != libc::MAP_FAILED
                && let Some(base) = NonNull::new(ptr.cast::<u8>())
            {
                return Ok(Arc::new(Memory {
                    base,
                    len,
                    owner: Owner::Map(len),
                }));
            }
            // Out of mappings: fall back to the allocator.
        }
        // SAFETY: the layout has a non-zero size (len > 0 checked above).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let base = NonNull::new(ptr).ok_or(MemError::OutOfMemory(len))?;
        Ok(Arc::new(Memory {
            base,
            len,
            owner: Owner::Alloc(layout),
        }))
    }

    /// As [`Memory::alloc_zeroed`], and a region of at least [`HUGE_MIN`]
    /// bytes that is a mapping of its own asks for transparent huge pages
    /// (see [`HUGE_MIN`]).
    ///
    /// # Errors
    ///
    /// As [`Memory::alloc_zeroed`].
    pub(crate) fn alloc_zeroed_huge(len: usize) -> Result<Arc<Memory>, MemError> {
        let m = Memory::alloc_zeroed(len)?;
        if matches!(m.owner, Owner::Map(_)) {
            advise_huge(m.base(), m.len());
        }
        Ok(m)
    }

    /// Takes ownership of the bytes of `v` (no copy). The memory is
    /// `v.len()` bytes long; spare capacity is kept and freed with it.
    pub(crate) fn from_vec(v: Vec<u8>) -> Arc<Memory> {
        let mut v = std::mem::ManuallyDrop::new(v);
        let len = v.len();
        let capacity = v.capacity();
        // A Vec's pointer is never null (dangling but non-null when empty).
        let base = NonNull::new(v.as_mut_ptr()).unwrap_or(NonNull::dangling());
        let owner = if capacity == 0 {
            Owner::None
        } else {
            Owner::Vec { capacity }
        };
        Arc::new(Memory { base, len, owner })
    }

    /// Memory owned by someone else: `len` bytes at `ptr`, not freed on drop.
    ///
    /// # Safety
    ///
    /// `ptr` must be non-null (unless `len` is 0) and valid for reads and
    /// writes of `len` bytes, and stay valid and not be freed or reused for as
    /// long as the returned `Memory` lives (including every clone of the
    /// `Arc`, which posted work requests and bound windows hold). The caller
    /// must accept that remote peers write the bytes at any time.
    pub(crate) unsafe fn external(ptr: *mut u8, len: usize) -> Arc<Memory> {
        let base = NonNull::new(ptr).unwrap_or(NonNull::dangling());
        let len = if ptr.is_null() { 0 } else { len };
        Arc::new(Memory {
            base,
            len,
            owner: Owner::None,
        })
    }

    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the memory is empty.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the memory is the engine's own (allocated, mapped or taken
    /// over from a `Vec`, freed with the last reference): holding a
    /// reference longer only delays the free. Memory of
    /// [`Memory::external`] (an application's registration, memory lent
    /// for one call) is not: its owner may wait for every reference.
    pub(crate) fn is_owned(&self) -> bool {
        !matches!(self.owner, Owner::None)
    }

    /// Address of the first byte (for the IO layer: vectored reads and
    /// writes straight from and into registered memory). Valid for `len()`
    /// bytes while `self` lives.
    pub(crate) fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// Address of byte `offset`, if `[offset, offset + len)` lies inside the
    /// memory. `len` 0 is accepted for any `offset <= self.len()`.
    pub(crate) fn ptr_at(&self, offset: usize, len: usize) -> Option<*mut u8> {
        let end = offset.checked_add(len)?;
        if end > self.len {
            return None;
        }
        // `wrapping_add` keeps provenance and never is UB; the check above
        // makes it stay in bounds (or one past the end).
        Some(self.base.as_ptr().wrapping_add(offset))
    }

    /// Copies `dst.len()` bytes starting at `offset` into `dst`. Returns
    /// `false` (and copies nothing) if the range is outside the memory.
    ///
    /// Races with remote placement like a DMA read: bytes being written
    /// concurrently may be old or new.
    pub(crate) fn copy_out(&self, offset: usize, dst: &mut [u8]) -> bool {
        let Some(src) = self.ptr_at(offset, dst.len()) else {
            return false;
        };
        // SAFETY: `src` is valid for `dst.len()` bytes (checked by `ptr_at`
        // and the struct invariant); `dst` is a distinct Rust buffer, which
        // cannot overlap registered memory because this module never hands
        // out references to it.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        true
    }

    /// Copies `src` into the memory starting at `offset`. Returns `false`
    /// (and copies nothing) if the range is outside the memory.
    ///
    /// Races with remote placement like a DMA write. The last byte is
    /// written last, after a full fence: a program that polls the last byte
    /// of a buffer for an RDMA Write to land (as DAPL's `dtest` and many
    /// MPI libraries do with hardware RNICs, which place in order) sees
    /// every earlier byte once it sees that one. A plain `memcpy` gives no
    /// such order: it may store the tail of a block before its middle, and
    /// large copies may use non-temporal stores.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) -> bool {
        let Some(dst) = self.ptr_at(offset, src.len()) else {
            return false;
        };
        let Some((last, body)) = src.split_last() else {
            return true;
        };
        // SAFETY: `dst` is valid for `src.len()` bytes (checked by `ptr_at`
        // and the struct invariant), so for `body.len()` bytes and at
        // `body.len()`; `src` cannot overlap registered memory (no
        // references to it are ever handed out).
        unsafe {
            std::ptr::copy_nonoverlapping(body.as_ptr(), dst, body.len());
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            dst.add(body.len()).write_volatile(*last);
        }
        true
    }

    /// Sets `len` bytes at `offset` to `byte`. Returns `false` (and writes
    /// nothing) if the range is outside the memory.
    pub(crate) fn fill(&self, offset: usize, len: usize, byte: u8) -> bool {
        let Some(dst) = self.ptr_at(offset, len) else {
            return false;
        };
        // SAFETY: `dst` is valid for `len` bytes (checked by `ptr_at`).
        unsafe { std::ptr::write_bytes(dst, byte, len) };
        true
    }

    /// The 64-bit word at `offset` as an atomic, if it is inside the memory
    /// and its address is 8-byte aligned (RDMA atomics, RFC 7306).
    ///
    /// Atomic with respect to other atomics through this function; plain
    /// copies and remote placement of the same bytes race with it.
    pub(crate) fn atomic_u64(&self, offset: usize) -> Option<&AtomicU64> {
        let ptr = self.ptr_at(offset, 8)?;
        if !(ptr as usize).is_multiple_of(8) {
            return None;
        }
        // SAFETY: `ptr` is 8-byte aligned (checked), valid for 8 bytes for
        // as long as `self` lives (the returned lifetime is tied to `&self`),
        // and all other access to these bytes goes through raw pointers, never
        // through `&`/`&mut` references, so no reference aliasing rule is
        // broken. Mixed atomic and non-atomic access races like DMA
        // (documented above).
        Some(unsafe { AtomicU64::from_ptr(ptr.cast::<u64>()) })
    }

    /// A copy of `len` bytes at `offset`, if inside the memory.
    pub(crate) fn to_vec(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        self.ptr_at(offset, len)?;
        let mut v = vec![0u8; len];
        self.copy_out(offset, &mut v).then_some(v)
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        match self.owner {
            Owner::Alloc(layout) => {
                // SAFETY: `base` was returned by `alloc_zeroed(layout)` and is
                // freed only here, once.
                unsafe { std::alloc::dealloc(self.base.as_ptr(), layout) };
            }
            Owner::Map(len) => {
                // SAFETY: `base` and `len` are the range returned by `mmap`
                // in `alloc_zeroed`, unmapped only here, once.
                unsafe { libc::munmap(self.base.as_ptr().cast(), len) };
            }
            Owner::Vec { capacity } => {
                // SAFETY: `base`, `len` and `capacity` are the parts of a
                // `Vec<u8>` taken apart in `from_vec` and never used to build
                // another one; rebuilding it here frees the buffer once.
                drop(unsafe { Vec::from_raw_parts(self.base.as_ptr(), self.len, capacity) });
            }
            Owner::None => {}
        }
    }
}

/// Memory lent by the caller for the duration of one call (see
/// `ProtectionDomain::lend` in `mr.rs`, the only user).
///
/// The `Arc<Memory>` handed to `f` points into the caller's buffer. When
/// `f` returns (or unwinds), this function waits until every clone of that
/// `Arc` is gone before it returns: the engine holds a clone for as long as
/// it may touch the bytes (the registration table entry, posted work
/// requests, a Read Response being transmitted, a placement in progress),
/// so once the registration is removed (by `f`, on every path) and the last
/// user let go, nothing can reach the buffer any more and the borrow may
/// end. A clone that is never dropped makes this function never return,
/// never touch freed memory. Weak references would allow a clone to be
/// made after the check; [`Arc::get_mut`] rules them out too.
pub(crate) struct Lend;

impl Lend {
    /// Lends `buf` for reading only: the caller registers it without any
    /// write right (local or remote), so neither the data path nor the
    /// application writes through the pointer (it comes from a shared
    /// reference).
    pub(crate) fn shared<R>(buf: &[u8], f: impl FnOnce(&Arc<Memory>) -> R) -> R {
        Self::raw(buf.as_ptr().cast_mut(), buf.len(), f)
    }

    /// Lends `buf` for reading and writing.
    pub(crate) fn exclusive<R>(buf: &mut [u8], f: impl FnOnce(&Arc<Memory>) -> R) -> R {
        Self::raw(buf.as_mut_ptr(), buf.len(), f)
    }

    fn raw<R>(ptr: *mut u8, len: usize, f: impl FnOnce(&Arc<Memory>) -> R) -> R {
        /// Waits for the other clones on every way out of `raw` (a panic
        /// of `f` included).
        struct Scope(Arc<Memory>);
        impl Drop for Scope {
            fn drop(&mut self) {
                let mut round = 0u32;
                while Arc::get_mut(&mut self.0).is_none() {
                    round = round.saturating_add(1);
                    if round < 64 {
                        std::thread::yield_now();
                    } else {
                        let us = 10u64 << (round - 64).min(7);
                        std::thread::sleep(std::time::Duration::from_micros(us));
                    }
                }
            }
        }
        // SAFETY: `ptr` comes from a reference the caller holds for the
        // whole call, so it is valid for `len` bytes until this function
        // returns; `Scope` makes the function return only once the `Arc`
        // (and so every pointer derived from it by the engine) is unique
        // again, on every path. The memory is not owned, so dropping it
        // frees nothing. For `shared`, no write right is ever granted on it
        // (see there), so nothing writes through the pointer.
        let scope = Scope(unsafe { Memory::external(ptr, len) });
        f(&scope.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    /// The kernel backs `madvise(MADV_HUGEPAGE)` ranges with huge pages
    /// (`transparent_hugepage` is `always` or `madvise`).
    fn thp_on_advice() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[always]") || s.contains("[madvise]"))
    }

    /// Transparent huge pages only where advised (`madvise`), so memory
    /// without advice must show none.
    fn thp_only_on_advice() -> bool {
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
            .is_ok_and(|s| s.contains("[madvise]"))
    }

    /// `AnonHugePages` (kB) of the mapping holding `addr`, from
    /// `/proc/self/smaps`.
    fn huge_kb_at(addr: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for l in smaps.lines() {
            let head = l.split_whitespace().next().unwrap_or("");
            if let Some((a, b)) = head.split_once('-')
                && let (Ok(a), Ok(b)) = (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
            {
                inside = (a..b).contains(&addr);
                continue;
            }
            if inside && let Some(v) = l.strip_prefix("AnonHugePages:") {
                return v.trim().trim_end_matches("kB").trim().parse().unwrap();
            }
        }
        0
    }

    /// `thp_fault_fallback` of `/proc/vmstat`: faults that wanted a huge
    /// page and got small ones (memory too fragmented).
    fn thp_fallbacks() -> u64 {
        std::fs::read_to_string("/proc/vmstat")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("thp_fault_fallback "))
                    .and_then(|v| v.trim().parse().ok())
            })
            .unwrap_or(0)
    }

    /// Large regions asked for with huge pages are backed by them once
    /// touched (2048 page faults fewer per 8 MiB, and the TLB misses of
    /// copying into them); the 2 MiB-aligned interior only.
    #[test]
    fn huge_regions_are_backed_by_huge_pages() {
        if !thp_on_advice() {
            eprintln!("transparent huge pages off: nothing to check");
            return;
        }
        const LEN: usize = 8 << 20;
        let fallbacks = thp_fallbacks();
        let v = Memory::alloc_zeroed_huge(LEN).unwrap();
        assert!(v.fill(0, LEN, 1));
        let kb = huge_kb_at(v.base() as usize + LEN / 2);
        if kb == 0 && thp_fallbacks() > fallbacks {
            eprintln!("the kernel fell back to small pages (fragmented memory)");
            return;
        }
        assert!(kb >= 2048, "{kb} kB in huge pages");
        // Small ones are left alone.
        let s = Memory::alloc_zeroed_huge(HUGE_MIN - PAGE_SIZE).unwrap();
        assert!(s.fill(0, s.len(), 1));
        assert!(!advise_huge(s.base(), s.len()));
    }

    /// A buffer taken over from a `Vec` gets no huge-page advice: its
    /// memory goes back to the allocator with the region, where the
    /// advice would outlive it (later allocations there, malloc's trims).
    #[test]
    fn vec_buffers_get_no_huge_page_advice() {
        if !thp_only_on_advice() {
            eprintln!("transparent huge pages not on advice: nothing to check");
            return;
        }
        const LEN: usize = 8 << 20;
        let v = Memory::from_vec(vec![0u8; LEN]);
        assert!(v.fill(0, LEN, 1));
        assert_eq!(huge_kb_at(v.base() as usize + LEN / 2), 0);
    }

    /// A large region the engine maps stays backed 4 KiB at a time where
    /// touched (a socket's 4 MiB receive ring of which an idle connection
    /// uses 512 KiB): no huge page, which would make 2 MiB resident.
    #[test]
    fn mapped_regions_stay_backed_only_where_touched() {
        if !thp_only_on_advice() {
            eprintln!("transparent huge pages not on advice: nothing to check");
            return;
        }
        const LEN: usize = 8 << 20;
        let m = Memory::alloc_zeroed(LEN).unwrap();
        let mid = LEN / 2;
        assert!(m.copy_in(mid, b"x"));
        assert_eq!(huge_kb_at(m.base() as usize + mid), 0);
    }

    #[test]
    fn large_allocations_are_mapped_lazily() {
        let len = 64 << 20;
        let m = Memory::alloc_zeroed(len).unwrap();
        assert!(matches!(m.owner, Owner::Map(l) if l == len));
        assert_eq!(m.base.as_ptr() as usize % PAGE_SIZE, 0);
        // Zero where never touched, and usable.
        assert_eq!(m.to_vec(len - 16, 16).unwrap(), vec![0u8; 16]);
        assert!(m.copy_in(len - 3, b"end"));
        assert_eq!(m.to_vec(len - 3, 3).unwrap(), b"end");
        // Not resident: a 64 MiB region touched in two pages adds far less
        // than 64 MiB to the resident set (VmRSS, kB).
        let rss = || -> usize {
            std::fs::read_to_string("/proc/self/status")
                .unwrap()
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap()
        };
        let before = rss();
        let m2 = Memory::alloc_zeroed(len).unwrap();
        assert!(m2.copy_in(0, b"x"));
        assert!(rss() < before + 32 * 1024, "64 MiB became resident");
        drop((m, m2));
    }

    #[test]
    fn alloc_is_zeroed_and_page_aligned() {
        let m = Memory::alloc_zeroed(10_000).unwrap();
        assert_eq!(m.len(), 10_000);
        assert_eq!(m.base() as usize % PAGE_SIZE, 0);
        assert_eq!(m.to_vec(0, 10_000).unwrap(), vec![0u8; 10_000]);
    }

    #[test]
    fn zero_length() {
        let m = Memory::alloc_zeroed(0).unwrap();
        assert_eq!(m.len(), 0);
        assert!(m.is_empty());
        assert!(m.ptr_at(0, 0).is_some());
        assert!(m.ptr_at(0, 1).is_none());
        assert!(m.ptr_at(1, 0).is_none());
        assert!(m.copy_in(0, &[]));
        assert!(!m.copy_in(0, &[1]));
        assert_eq!(m.to_vec(0, 0).unwrap(), Vec::<u8>::new());
        assert!(m.atomic_u64(0).is_none());
        let v = Memory::from_vec(Vec::new());
        assert_eq!(v.len(), 0);
        assert!(v.copy_out(0, &mut []));
    }

    #[test]
    fn too_large() {
        assert_eq!(
            Memory::alloc_zeroed(usize::MAX).unwrap_err(),
            MemError::TooLarge(usize::MAX)
        );
    }

    #[test]
    fn copy_in_out_and_bounds() {
        let m = Memory::alloc_zeroed(16).unwrap();
        assert!(m.copy_in(4, b"abcd"));
        let mut out = [0u8; 6];
        assert!(m.copy_out(3, &mut out));
        assert_eq!(&out, b"\0abcd\0");
        assert!(m.copy_in(12, b"wxyz"));
        assert!(!m.copy_in(13, b"wxyz"));
        assert!(!m.copy_out(usize::MAX, &mut out));
        assert!(m.ptr_at(usize::MAX, 2).is_none());
        assert!(m.ptr_at(16, 0).is_some());
        assert!(m.ptr_at(17, 0).is_none());
        assert_eq!(m.to_vec(12, 4).unwrap(), b"wxyz");
        assert!(m.to_vec(12, 5).is_none());
        assert!(m.fill(0, 4, 0xaa));
        assert!(!m.fill(15, 2, 0xaa));
        assert_eq!(m.to_vec(0, 5).unwrap(), [0xaa, 0xaa, 0xaa, 0xaa, b'a']);
    }

    #[test]
    fn from_vec_keeps_contents_and_frees_with_capacity() {
        let mut v = Vec::with_capacity(64);
        v.extend_from_slice(b"hello");
        let p = v.as_ptr();
        let m = Memory::from_vec(v);
        assert_eq!(m.len(), 5);
        assert_eq!(m.base().cast_const(), p);
        assert_eq!(m.to_vec(0, 5).unwrap(), b"hello");
        assert!(m.copy_in(0, b"J"));
        assert_eq!(m.to_vec(0, 5).unwrap(), b"Jello");
        drop(m);
    }

    #[test]
    fn external_memory_is_not_freed() {
        let mut buf = vec![7u8; 32];
        // SAFETY: `buf` outlives `m` (dropped below before `buf`).
        let m = unsafe { Memory::external(buf.as_mut_ptr(), buf.len()) };
        assert!(m.copy_in(0, &[1, 2]));
        drop(m);
        assert_eq!(&buf[..3], &[1, 2, 7]);
        // SAFETY: null with any length is an empty memory.
        let n = unsafe { Memory::external(std::ptr::null_mut(), 100) };
        assert_eq!(n.len(), 0);
    }

    #[test]
    fn atomics_alignment_and_bounds() {
        let m = Memory::alloc_zeroed(24).unwrap();
        assert!(m.atomic_u64(1).is_none());
        assert!(m.atomic_u64(4).is_none());
        assert!(m.atomic_u64(20).is_none());
        assert!(m.atomic_u64(24).is_none());
        assert!(m.atomic_u64(usize::MAX - 3).is_none());
        let a = m.atomic_u64(16).unwrap();
        assert_eq!(a.fetch_add(5, Ordering::SeqCst), 0);
        assert_eq!(
            a.compare_exchange(5, 9, Ordering::SeqCst, Ordering::SeqCst),
            Ok(5)
        );
        assert_eq!(m.to_vec(16, 8).unwrap(), 9u64.to_ne_bytes());
    }

    #[test]
    fn concurrent_atomics_from_threads() {
        let m = Memory::alloc_zeroed(8).unwrap();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = Arc::clone(&m);
                std::thread::spawn(move || {
                    for _ in 0..1000 {
                        m.atomic_u64(0).unwrap().fetch_add(1, Ordering::Relaxed);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(m.atomic_u64(0).unwrap().load(Ordering::SeqCst), 4000);
    }
}
