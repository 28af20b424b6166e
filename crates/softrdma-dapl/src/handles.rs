//! DAT handles: every handle points to a [`HandleMem`] whose first word is
//! the provider table (`DAT_HANDLE_TO_PROVIDER`). Live handles are kept in
//! a process-wide map, so a freed or foreign pointer is recognised by
//! lookup, never dereferenced.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, LazyLock};

use parking_lot::{Mutex, RwLock};
use softrdma_dat::{
    Cno, Cr, DatError, Ep, ErrorType, Evd, Ia, Lmr, Psp, Pz, Rmr, Rsp, Srq, Subtype,
};

use crate::types::DAT_PROVIDER;

/// `DAT_HANDLE_TYPE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum Kind {
    /// CR.
    Cr = 0,
    /// EP.
    Ep = 1,
    /// EVD.
    Evd = 2,
    /// IA.
    Ia = 3,
    /// LMR.
    Lmr = 4,
    /// PSP.
    Psp = 5,
    /// PZ.
    Pz = 6,
    /// RMR.
    Rmr = 7,
    /// RSP.
    Rsp = 8,
    /// CNO.
    Cno = 9,
    /// SRQ.
    Srq = 10,
}

impl Kind {
    /// The `DAT_INVALID_HANDLE` subtype for a bad handle of this kind.
    pub fn subtype(self) -> Subtype {
        match self {
            Kind::Cr => Subtype::HandleCr,
            Kind::Ep => Subtype::HandleEp,
            Kind::Evd => Subtype::None,
            Kind::Ia => Subtype::HandleIa,
            Kind::Lmr => Subtype::HandleLmr,
            Kind::Psp => Subtype::HandlePsp,
            Kind::Pz => Subtype::HandlePz,
            Kind::Rmr => Subtype::HandleRmr,
            Kind::Rsp => Subtype::HandleRsp,
            Kind::Cno => Subtype::HandleCno,
            Kind::Srq => Subtype::HandleSrq,
        }
    }
}

/// The Rust object behind a handle.
#[derive(Debug, Clone)]
pub enum Obj {
    /// IA.
    Ia(Ia),
    /// PZ.
    Pz(Pz),
    /// LMR.
    Lmr(Lmr),
    /// RMR.
    Rmr(Rmr),
    /// EVD.
    Evd(Evd),
    /// CNO.
    Cno(Cno),
    /// EP.
    Ep(Ep),
    /// PSP.
    Psp(Psp),
    /// RSP.
    Rsp(Rsp),
    /// CR.
    Cr(Cr),
    /// SRQ.
    Srq(Srq),
}

impl Obj {
    fn kind(&self) -> Kind {
        match self {
            Obj::Ia(_) => Kind::Ia,
            Obj::Pz(_) => Kind::Pz,
            Obj::Lmr(_) => Kind::Lmr,
            Obj::Rmr(_) => Kind::Rmr,
            Obj::Evd(_) => Kind::Evd,
            Obj::Cno(_) => Kind::Cno,
            Obj::Ep(_) => Kind::Ep,
            Obj::Psp(_) => Kind::Psp,
            Obj::Rsp(_) => Kind::Rsp,
            Obj::Cr(_) => Kind::Cr,
            Obj::Srq(_) => Kind::Srq,
        }
    }
}

/// The provider pointer, shared between threads (it points to a table
/// that lives as long as the library).
#[derive(Debug, Clone, Copy)]
#[repr(transparent)]
pub struct ProvPtr(pub *const DAT_PROVIDER);

// SAFETY: the table it points to is leaked and never written after
// registration, so sharing the pointer between threads is sound.
unsafe impl Send for ProvPtr {}
// SAFETY: as above.
unsafe impl Sync for ProvPtr {}

/// Storage for a socket address handed out by pointer.
#[derive(Debug)]
pub struct AddrBox(pub Mutex<Box<libc::sockaddr_storage>>);

impl AddrBox {
    fn new() -> AddrBox {
        // SAFETY: sockaddr_storage is plain data; all-zero is valid.
        AddrBox(Mutex::new(Box::new(unsafe { std::mem::zeroed() })))
    }

    /// Stores `a`, returns the stable pointer to it.
    pub fn set(&self, a: std::net::SocketAddr) -> *mut libc::sockaddr {
        let mut g = self.0.lock();
        // SAFETY: as in `new`.
        **g = unsafe { std::mem::zeroed() };
        match a {
            std::net::SocketAddr::V4(v4) => {
                let p = (&mut **g as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                // SAFETY: sockaddr_storage is larger than and aligned for
                // sockaddr_in; `p` points into the box.
                unsafe {
                    (*p).sin_family = libc::AF_INET as libc::sa_family_t;
                    (*p).sin_port = v4.port().to_be();
                    (*p).sin_addr.s_addr = u32::from_ne_bytes(v4.ip().octets());
                }
            }
            std::net::SocketAddr::V6(v6) => {
                let p = (&mut **g as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                // SAFETY: as above, for sockaddr_in6.
                unsafe {
                    (*p).sin6_family = libc::AF_INET6 as libc::sa_family_t;
                    (*p).sin6_port = v6.port().to_be();
                    (*p).sin6_addr.s6_addr = v6.ip().octets();
                }
            }
        }
        (&mut **g as *mut libc::sockaddr_storage).cast()
    }
}

/// What a handle points to. `provider` must stay the first field.
#[repr(C)]
#[derive(Debug)]
pub struct HandleMem {
    /// `DAT_HANDLE_TO_PROVIDER`.
    pub provider: ProvPtr,
    /// The object.
    pub obj: Obj,
    /// The owning IA handle (the IA's own for an IA).
    pub ia: usize,
    /// `dat_set_consumer_context`.
    pub context: AtomicU64,
    /// Whether a context was set.
    pub has_context: AtomicU64,
    /// Local address storage.
    pub addr: AddrBox,
    /// Remote address storage.
    pub addr2: AddrBox,
    /// Private data handed out by pointer (last connection event of an
    /// EVD, a CR's request).
    pub pdata: Mutex<Vec<u8>>,
    /// The consumer's IA handle (libdat2's small integer), once known.
    pub consumer_ia: AtomicUsize,
}

/// Read on every call, written when objects come and go.
static HANDLES: LazyLock<RwLock<HashMap<usize, Arc<HandleMem>>>> =
    LazyLock::new(|| RwLock::new(HashMap::new()));

/// Makes a handle for `obj` owned by IA handle `ia` (0: itself).
pub fn make(provider: ProvPtr, obj: Obj, ia: usize) -> usize {
    let h = Arc::new(HandleMem {
        provider,
        obj,
        ia,
        context: AtomicU64::new(0),
        has_context: AtomicU64::new(0),
        addr: AddrBox::new(),
        addr2: AddrBox::new(),
        pdata: Mutex::new(Vec::new()),
        consumer_ia: AtomicUsize::new(0),
    });
    let p = Arc::as_ptr(&h) as usize;
    set_user(&h.obj, p);
    HANDLES.write().insert(p, h);
    p
}

fn set_user(o: &Obj, p: usize) {
    match o {
        Obj::Ia(x) => x.set_user_data(p),
        Obj::Pz(x) => x.set_user_data(p),
        Obj::Lmr(x) => x.set_user_data(p),
        Obj::Rmr(x) => x.set_user_data(p),
        Obj::Evd(x) => x.set_user_data(p),
        Obj::Cno(x) => x.set_user_data(p),
        Obj::Ep(x) => x.set_user_data(p),
        Obj::Psp(x) => x.set_user_data(p),
        Obj::Rsp(x) => x.set_user_data(p),
        Obj::Cr(x) => x.set_user_data(p),
        Obj::Srq(x) => x.set_user_data(p),
    }
}

/// The live handle `h` of kind `kind`.
///
/// # Errors
///
/// `DAT_INVALID_HANDLE` with the kind's subtype if `h` is not a live
/// handle of that kind.
pub fn get(h: *mut std::ffi::c_void, kind: Kind) -> Result<Arc<HandleMem>, DatError> {
    get_sub(h, kind, kind.subtype())
}

/// As [`get`], with the subtype to report.
///
/// # Errors
///
/// As [`get`].
pub fn get_sub(
    h: *mut std::ffi::c_void,
    kind: Kind,
    sub: Subtype,
) -> Result<Arc<HandleMem>, DatError> {
    let m = HANDLES.read().get(&(h as usize)).cloned();
    match m {
        Some(m) if m.obj.kind() == kind => Ok(m),
        _ => Err(DatError::new(ErrorType::InvalidHandle, sub)),
    }
}

/// Any live handle.
///
/// # Errors
///
/// `DAT_INVALID_HANDLE`.
pub fn get_any(h: *mut std::ffi::c_void) -> Result<Arc<HandleMem>, DatError> {
    HANDLES
        .read()
        .get(&(h as usize))
        .cloned()
        .ok_or_else(|| DatError::of(ErrorType::InvalidHandle))
}

/// The kind of a live handle.
pub fn kind_of(m: &HandleMem) -> Kind {
    m.obj.kind()
}

/// Forgets handle `h` (the object goes when its last user does).
pub fn remove(h: usize) -> Option<Arc<HandleMem>> {
    HANDLES.write().remove(&h)
}

/// Handles owned by IA handle `ia` (not the IA itself).
pub fn owned_by(ia: usize) -> Vec<usize> {
    HANDLES
        .read()
        .iter()
        .filter(|(k, m)| m.ia == ia && **k != ia)
        .map(|(k, _)| *k)
        .collect()
}
