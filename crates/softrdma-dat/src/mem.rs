//! Protection zones and memory regions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use softrdma_engine::{Access, MemoryRegion, MemoryWindow, ProtectionDomain};

use crate::ia::{Ia, ObjRef};
use crate::{ErrorType, Result, Subtype, err};

/// Memory privileges (`DAT_MEM_PRIV_FLAGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct MemPriv(pub u32);

impl MemPriv {
    /// `DAT_MEM_PRIV_LOCAL_READ_FLAG`.
    pub const LOCAL_READ: MemPriv = MemPriv(0x01);
    /// `DAT_MEM_PRIV_REMOTE_READ_FLAG`.
    pub const REMOTE_READ: MemPriv = MemPriv(0x02);
    /// `DAT_MEM_PRIV_LOCAL_WRITE_FLAG`.
    pub const LOCAL_WRITE: MemPriv = MemPriv(0x10);
    /// `DAT_MEM_PRIV_REMOTE_WRITE_FLAG`.
    pub const REMOTE_WRITE: MemPriv = MemPriv(0x20);
    /// `DAT_MEM_PRIV_ALL_FLAG`.
    pub const ALL: MemPriv = MemPriv(0x33);

    fn has(self, f: MemPriv) -> bool {
        self.0 & f.0 != 0
    }

    /// The engine access rights (local write is always granted for
    /// registrations; windows take only the remote rights).
    pub fn access(self, region: bool) -> Access {
        let mut a = if region {
            Access::LOCAL_WRITE | Access::MW_BIND
        } else {
            Access::NONE
        };
        if self.has(MemPriv::REMOTE_READ) {
            a |= Access::REMOTE_READ;
        }
        if self.has(MemPriv::REMOTE_WRITE) {
            a |= Access::REMOTE_WRITE;
        }
        a
    }
}

#[derive(Debug)]
pub(crate) struct PzInner {
    id: u64,
    pub(crate) pd: ProtectionDomain,
    pub(crate) users: AtomicUsize,
    user: AtomicUsize,
    pub(crate) ia: ObjRef,
}

/// A protection zone (`DAT_PZ_HANDLE`).
#[derive(Debug, Clone)]
pub struct Pz {
    pub(crate) inner: Arc<PzInner>,
}

impl PartialEq for Pz {
    fn eq(&self, other: &Pz) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Counts a user of a PZ while alive.
#[derive(Debug)]
pub(crate) struct PzRef(pub(crate) Pz);

impl PzRef {
    pub(crate) fn new(pz: &Pz) -> PzRef {
        pz.inner.users.fetch_add(1, Ordering::AcqRel);
        PzRef(pz.clone())
    }
}

impl Drop for PzRef {
    fn drop(&mut self) {
        self.0.inner.users.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Pz {
    /// Creates a PZ (`dat_pz_create`).
    pub fn new(ia: &Ia) -> Pz {
        Pz {
            inner: Arc::new(PzInner {
                id: crate::next_id(),
                pd: ProtectionDomain::new(&ia.inner.device),
                users: AtomicUsize::new(0),
                user: AtomicUsize::new(0),
                ia: ObjRef::new(&ia.inner),
            }),
        }
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The IA.
    pub fn ia(&self) -> Ia {
        Ia {
            inner: self.inner.ia.0.clone(),
        }
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// `dat_pz_free`: refused while LMRs, RMRs, EPs or SRQs use it.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` (`PZ_IN_USE`).
    pub fn free(self) -> Result<()> {
        if self.inner.users.load(Ordering::Acquire) > 0 {
            return Err(err(ErrorType::InvalidState, Subtype::PzInUse));
        }
        Ok(())
    }
}

#[derive(Debug)]
pub(crate) struct LmrInner {
    id: u64,
    pub(crate) mr: MemoryRegion,
    priv_: MemPriv,
    user: AtomicUsize,
    pz: PzRef,
}

/// A local memory region (`DAT_LMR_HANDLE`): registered memory, named
/// locally by its `lmr_context` and remotely by its `rmr_context`.
#[derive(Debug, Clone)]
pub struct Lmr {
    pub(crate) inner: Arc<LmrInner>,
}

fn reg_err(e: softrdma_engine::mr::RegError) -> crate::DatError {
    use softrdma_engine::mr::RegError as R;
    match e {
        R::InvalidAccess(_) => err(ErrorType::InvalidParameter, Subtype::Arg5),
        R::TooLarge { .. } => err(ErrorType::LengthError, Subtype::None),
        _ => err(
            ErrorType::InsufficientResources,
            Subtype::ResourceMemoryRegion,
        ),
    }
}

impl Lmr {
    fn wrap(pz: &Pz, mr: MemoryRegion, priv_: MemPriv) -> Lmr {
        Lmr {
            inner: Arc::new(LmrInner {
                id: crate::next_id(),
                mr,
                priv_,
                user: AtomicUsize::new(0),
                pz: PzRef::new(pz),
            }),
        }
    }

    /// Registers `len` zeroed bytes owned by the region.
    ///
    /// # Errors
    ///
    /// `DAT_LENGTH_ERROR`, `DAT_INSUFFICIENT_RESOURCES`.
    pub fn alloc(pz: &Pz, len: usize, priv_: MemPriv) -> Result<Lmr> {
        let mr = pz
            .inner
            .pd
            .register(len, priv_.access(true))
            .map_err(reg_err)?;
        Ok(Lmr::wrap(pz, mr, priv_))
    }

    /// Registers the caller's memory (`dat_lmr_create` with
    /// `DAT_MEM_TYPE_VIRTUAL`).
    ///
    /// # Safety
    ///
    /// As [`ProtectionDomain::register_raw`]: `ptr` valid for reads and
    /// writes of `len` bytes until the LMR and every transfer naming it
    /// are gone.
    ///
    /// # Errors
    ///
    /// As [`alloc`](Self::alloc).
    pub unsafe fn register(pz: &Pz, ptr: *mut u8, len: usize, priv_: MemPriv) -> Result<Lmr> {
        if ptr.is_null() && len > 0 {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg3));
        }
        // SAFETY: the caller's contract is register_raw's.
        let mr =
            unsafe { pz.inner.pd.register_raw(ptr, len, priv_.access(true)) }.map_err(reg_err)?;
        Ok(Lmr::wrap(pz, mr, priv_))
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The local key (`DAT_LMR_CONTEXT`).
    pub fn lmr_context(&self) -> u32 {
        self.inner.mr.lkey()
    }

    /// The remote key (`DAT_RMR_CONTEXT`).
    pub fn rmr_context(&self) -> u32 {
        self.inner.mr.rkey()
    }

    /// The registered address (the virtual address of the memory).
    pub fn address(&self) -> u64 {
        self.inner.mr.addr()
    }

    /// The registered length.
    pub fn len(&self) -> usize {
        self.inner.mr.len()
    }

    /// Whether the length is 0.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The privileges.
    pub fn privileges(&self) -> MemPriv {
        self.inner.priv_
    }

    /// The PZ.
    pub fn pz(&self) -> Pz {
        self.inner.pz.0.clone()
    }

    /// The engine region.
    pub fn region(&self) -> &MemoryRegion {
        &self.inner.mr
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }
}

#[derive(Debug)]
pub(crate) struct RmrInner {
    id: u64,
    pub(crate) mw: MemoryWindow,
    pub(crate) bound: Mutex<Option<(Lmr, u64, u64, MemPriv)>>,
    user: AtomicUsize,
    pz: PzRef,
}

/// A remote memory region (`DAT_RMR_HANDLE`): a memory window, bound to
/// part of an LMR by a work request on an EP's send queue
/// ([`Ep::bind_rmr`](crate::Ep::bind_rmr)).
#[derive(Debug, Clone)]
pub struct Rmr {
    pub(crate) inner: Arc<RmrInner>,
}

impl Rmr {
    /// Creates an unbound RMR (`dat_rmr_create`).
    ///
    /// # Errors
    ///
    /// `DAT_INSUFFICIENT_RESOURCES`.
    pub fn new(pz: &Pz) -> Result<Rmr> {
        let mw = pz.inner.pd.alloc_mw().map_err(reg_err)?;
        Ok(Rmr {
            inner: Arc::new(RmrInner {
                id: crate::next_id(),
                mw,
                bound: Mutex::new(None),
                user: AtomicUsize::new(0),
                pz: PzRef::new(pz),
            }),
        })
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The remote key (changes on every bind).
    pub fn rmr_context(&self) -> u32 {
        self.inner.mw.rkey()
    }

    /// Whether it is bound (the window's state in the engine).
    pub fn is_bound(&self) -> bool {
        self.inner.mw.is_bound()
    }

    /// What the last bind asked for: LMR, address, length, privileges.
    pub fn binding(&self) -> Option<(Lmr, u64, u64, MemPriv)> {
        self.inner.bound.lock().clone()
    }

    /// The PZ.
    pub fn pz(&self) -> Pz {
        self.inner.pz.0.clone()
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }
}
