//! The entry points of the provider table.
//!
//! Every function: catches panics (`DAT_INTERNAL_ERROR`), looks its
//! handles up in the live-handle map (`DAT_INVALID_HANDLE` for anything
//! else), checks its out-pointers, and maps the Rust result to
//! `DAT_RETURN`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use softrdma_dat::{
    Cno, CompletionFlags, Cr, DatError, Ep, EpAttr, EpAttrChange, ErrorType, Evd, EvdFlags, Event,
    Ia, IaConfig, Lmr, LmrTriplet, MAX_PRIVATE_DATA, MemPriv, Psp, Pz, Rmr, RmrTriplet, Rsp, Srq,
    Subtype,
};

use crate::handles::{self, HandleMem, Kind, Obj, ProvPtr};
use crate::table::SLOTS;
use crate::types::*;

type H = DAT_HANDLE;
type R<T = ()> = Result<T, DatError>;

const INTERNAL_ERROR: u32 = 0x0004_0000;

/// The smallest queue a DTO EVD created through the C API gets.
const MIN_EVD_QLEN: usize = 256;

/// The smallest queue of other EVDs created through the C API (software
/// queues: they cost memory only for the events actually queued).
const MIN_CM_EVD_QLEN: usize = 4096;

fn run(f: impl FnOnce() -> R) -> u32 {
    match std::panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        Ok(Err(e)) => e.to_return(),
        Err(_) => INTERNAL_ERROR,
    }
}

/// Whether `SOFTRDMA_DAT_DEBUG` is set.
fn debug_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SOFTRDMA_DAT_DEBUG").is_some())
}

/// `SOFTRDMA_DAT_DEBUG=1` traces the data-path entry points on stderr.
fn traced(name: &str, f: impl FnOnce() -> R) -> u32 {
    let r = run(f);
    if debug_on() {
        eprintln!("softrdma-dapl: {name} -> {r:#x}");
    }
    r
}

fn bad(ty: ErrorType, sub: Subtype) -> DatError {
    DatError::new(ty, sub)
}

fn param(sub: Subtype) -> DatError {
    bad(ErrorType::InvalidParameter, sub)
}

/// Writes `v` to `p`.
fn out<T>(p: *mut T, v: T, sub: Subtype) -> R {
    if p.is_null() {
        return Err(param(sub));
    }
    // SAFETY: non-null; the caller (C) promises a writable T there.
    unsafe { p.write(v) };
    Ok(())
}

/// Makes a handle for `obj`, owned by IA handle `ia`, and writes it to
/// `p`.
fn out_handle(p: *mut H, provider: ProvPtr, obj: Obj, ia: H, sub: Subtype) -> R {
    out(p, as_h(handles::make(provider, obj, ia as usize)), sub)
}

/// Writes `v` to `p` if it is not NULL.
fn out_opt<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: as in `out`.
        unsafe { p.write(v) };
    }
}

fn timeout(t: DAT_TIMEOUT) -> Option<Duration> {
    (t != u32::MAX).then(|| Duration::from_micros(u64::from(t)))
}

fn as_h(v: usize) -> H {
    v as H
}

macro_rules! obj {
    ($m:expr, $v:ident, $sub:expr) => {
        match &$m.obj {
            Obj::$v(x) => x.clone(),
            _ => return Err(bad(ErrorType::InvalidHandle, $sub)),
        }
    };
}

/// A Rust object type a handle can stand for.
trait Typed: Sized {
    const KIND: Kind;
    fn of(o: &Obj) -> Option<Self>;
}

macro_rules! typed {
    ($($v:ident),*) => {
        $(impl Typed for $v {
            const KIND: Kind = Kind::$v;
            fn of(o: &Obj) -> Option<Self> {
                match o {
                    Obj::$v(x) => Some(x.clone()),
                    _ => None,
                }
            }
        })*
    };
}
typed!(Ia, Pz, Lmr, Rmr, Evd, Cno, Ep, Psp, Rsp, Cr, Srq);

/// Looks `h` up as a live `T`: `DAT_INVALID_HANDLE` with the kind's
/// subtype for a freed handle or one of another kind.
fn lookup<T: Typed>(h: H) -> R<(Arc<HandleMem>, T)> {
    let m = handles::get(h, T::KIND)?;
    let x = T::of(&m.obj).ok_or_else(|| bad(ErrorType::InvalidHandle, T::KIND.subtype()))?;
    Ok((m, x))
}

/// A `dat_*_free` whose free can refuse (object in use): the handle
/// stays valid then.
fn free_checked<T: Typed>(h: H, free: impl FnOnce(T) -> R) -> u32 {
    run(|| {
        let (_, x) = lookup::<T>(h)?;
        free(x)?;
        handles::remove(h as usize);
        Ok(())
    })
}

/// A `dat_*_free` that always succeeds: the handle goes first.
fn free_now<T: Typed>(h: H, free: impl FnOnce(T)) -> u32 {
    run(|| {
        let (_, x) = lookup::<T>(h)?;
        handles::remove(h as usize);
        free(x);
        Ok(())
    })
}

fn ia_h(h: H) -> R<(Arc<HandleMem>, Ia)> {
    lookup(h)
}

fn evd_h(h: H, sub: Subtype) -> R<(Arc<HandleMem>, Evd)> {
    let m = handles::get_sub(h, Kind::Evd, sub)?;
    let e = obj!(m, Evd, sub);
    Ok((m, e))
}

fn opt_evd(h: H, sub: Subtype) -> R<Option<Evd>> {
    if h.is_null() {
        return Ok(None);
    }
    Ok(Some(evd_h(h, sub)?.1))
}

fn ep_h(h: H) -> R<(Arc<HandleMem>, Ep)> {
    lookup(h)
}

/// The consumer's IA handle for our IA handle `ia` (libdat2 gives
/// consumers small integers; `dats_get_ia_handle` maps them to ours).
fn consumer_ia(ia: usize) -> H {
    let Ok(m) = handles::get(as_h(ia), Kind::Ia) else {
        return std::ptr::null_mut();
    };
    let cached = m.consumer_ia.load(Ordering::Acquire);
    if cached != 0 {
        return as_h(cached);
    }
    type GetFn = unsafe extern "C" fn(H, *mut H) -> u32;
    // SAFETY: dlsym with RTLD_DEFAULT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"dats_get_ia_handle".as_ptr()) };
    if f.is_null() {
        return as_h(ia);
    }
    // SAFETY: libdat2's dats_get_ia_handle(DAT_IA_HANDLE, DAT_IA_HANDLE*).
    let f: GetFn = unsafe { std::mem::transmute::<*mut c_void, GetFn>(f) };
    for i in 0..4096usize {
        let mut p: H = std::ptr::null_mut();
        // SAFETY: `p` is a valid out-pointer; libdat2 checks the index.
        if unsafe { f(as_h(i), &mut p) } == 0 && p as usize == ia {
            m.consumer_ia.store(i, Ordering::Release);
            return as_h(i);
        }
    }
    as_h(ia)
}

fn triplets(n: DAT_COUNT, p: *const DAT_LMR_TRIPLET) -> R<Vec<LmrTriplet>> {
    if n < 0 || (n > 0 && p.is_null()) {
        return Err(param(Subtype::Arg2));
    }
    if n == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the caller passes `n` triplets at `p` (checked non-null).
    let s = unsafe { std::slice::from_raw_parts(p, n as usize) };
    Ok(s.iter()
        .map(|t| LmrTriplet {
            lmr_context: t.lmr_context,
            virtual_address: t.virtual_address,
            segment_length: t.segment_length,
        })
        .collect())
}

fn rmr_triplet(p: *const DAT_RMR_TRIPLET) -> R<RmrTriplet> {
    if p.is_null() {
        return Err(param(Subtype::Arg5));
    }
    // SAFETY: non-null pointer to a triplet from the caller.
    let t = unsafe { *p };
    Ok(RmrTriplet {
        rmr_context: t.rmr_context,
        virtual_address: t.virtual_address,
        segment_length: t.segment_length,
    })
}

fn pdata<'a>(n: DAT_COUNT, p: *const c_void) -> R<&'a [u8]> {
    if n < 0 || n as usize > MAX_PRIVATE_DATA {
        return Err(param(Subtype::Arg3));
    }
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(param(Subtype::Arg4));
    }
    // SAFETY: the caller passes `n` bytes at `p`.
    Ok(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), n as usize) })
}

fn sockaddr(p: *const libc::sockaddr) -> R<SocketAddr> {
    if p.is_null() {
        return Err(param(Subtype::AddressMalformed));
    }
    // SAFETY: the caller passes a socket address; its family says which.
    let fam = c_int::from(unsafe { (*p).sa_family });
    match fam {
        libc::AF_INET => {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let a = unsafe { *p.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(a.sin_addr.s_addr.to_ne_bytes());
            Ok(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
        }
        libc::AF_INET6 => {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let a = unsafe { *p.cast::<libc::sockaddr_in6>() };
            let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
            Ok(SocketAddr::new(IpAddr::V6(ip), u16::from_be(a.sin6_port)))
        }
        _ => Err(bad(
            ErrorType::InvalidParameter,
            Subtype::AddressUnsupported,
        )),
    }
}

fn copy_name(dst: &mut [c_char], s: &str) {
    for (d, b) in dst.iter_mut().zip(s.bytes().chain(std::iter::once(0))) {
        *d = b as c_char;
    }
    if let Some(last) = dst.last_mut() {
        *last = 0;
    }
}

// ---------------------------------------------------------------- IA

unsafe extern "C" fn ia_open(
    name: *const c_char,
    qlen: DAT_COUNT,
    async_evd: *mut H,
    ia: *mut H,
) -> u32 {
    run(|| {
        if name.is_null() || ia.is_null() {
            return Err(param(Subtype::Arg1));
        }
        // SAFETY: libdat2 passes the NUL-terminated IA name.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        let p = crate::provider_by_name(&name)
            .ok_or_else(|| bad(ErrorType::ProviderNotFound, Subtype::NameNotRegistered))?;
        let mut cfg = IaConfig::new(name, p.addr);
        cfg.async_qlen = usize::try_from(qlen).unwrap_or(8).max(MIN_CM_EVD_QLEN);
        let i = Ia::open(cfg)?;
        let prov = ProvPtr(&p.table);
        let ih = handles::make(prov, Obj::Ia(i.clone()), 0);
        let eh = handles::make(prov, Obj::Evd(i.async_evd()), ih);
        if !async_evd.is_null() {
            // SAFETY: non-null out-pointer from the caller.
            let cur = unsafe { *async_evd };
            if cur.is_null() {
                // SAFETY: as above.
                unsafe { *async_evd = as_h(eh) };
            }
        }
        // SAFETY: checked non-null above.
        unsafe { *ia = as_h(ih) };
        Ok(())
    })
}

/// A named attribute table that may be shared between threads.
struct Attrs([DAT_NAMED_ATTR; 3]);
// SAFETY: the pointers are to static C strings.
unsafe impl Sync for Attrs {}

static PROVIDER_ATTRS: Attrs = Attrs([
    DAT_NAMED_ATTR {
        name: c"DAT_IB_RDMA_READ".as_ptr(),
        value: c"TRUE".as_ptr(),
    },
    // dtestsrq sizes its messages from it.
    DAT_NAMED_ATTR {
        name: c"DAT_IB_TRANSPORT_MTU".as_ptr(),
        value: c"4096".as_ptr(),
    },
    DAT_NAMED_ATTR {
        name: c"SOFTRDMA_TRANSPORT".as_ptr(),
        value: c"iWARP over TCP".as_ptr(),
    },
]);

unsafe extern "C" fn ia_query(
    ia: H,
    async_evd: *mut H,
    _ia_mask: u64,
    ia_attr: *mut DAT_IA_ATTR,
    _p_mask: u64,
    p_attr: *mut DAT_PROVIDER_ATTR,
) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        out_opt(async_evd, as_h(i.async_evd().user_data()));
        if !ia_attr.is_null() {
            let d = i.attr().device;
            let c = |v: u32| v.min(i32::MAX as u32) as DAT_COUNT;
            // SAFETY: DAT_IA_ATTR is plain data; all-zero is valid.
            let mut a: DAT_IA_ATTR = unsafe { std::mem::zeroed() };
            copy_name(&mut a.adapter_name, "softrdma");
            copy_name(&mut a.vendor_name, "softrdma");
            a.ia_address_ptr = m.addr.set(SocketAddr::new(i.addr(), 0));
            a.max_eps = c(d.max_qp);
            a.max_dto_per_ep = c(d.max_qp_wr);
            a.max_rdma_read_per_ep_in = c(d.max_qp_rd_atom);
            a.max_rdma_read_per_ep_out = c(d.max_qp_init_rd_atom);
            a.max_evds = c(d.max_cq);
            a.max_evd_qlen = c(d.max_cqe);
            a.max_iov_segments_per_dto = c(d.max_sge);
            a.max_lmrs = c(d.max_mr);
            a.max_lmr_block_size = d.max_mr_size.min(u64::from(u32::MAX)) as u32;
            a.max_lmr_virtual_address = u64::MAX;
            a.max_pzs = c(d.max_pd);
            a.max_message_size = 1 << 31;
            a.max_rdma_size = 1 << 31;
            a.max_rmrs = c(d.max_mw);
            a.max_rmr_target_address = u64::MAX;
            a.max_srqs = c(d.max_srq);
            a.max_ep_per_srq = c(d.max_qp);
            a.max_recv_per_srq = c(d.max_srq_wr);
            a.max_iov_segments_per_rdma_read = c(d.max_sge);
            a.max_iov_segments_per_rdma_write = c(d.max_sge);
            a.max_rdma_read_in = c(d.max_qp_rd_atom);
            a.max_rdma_read_out = c(d.max_qp_init_rd_atom);
            a.max_rdma_read_per_ep_in_guaranteed = 1;
            a.max_rdma_read_per_ep_out_guaranteed = 1;
            // SAFETY: non-null out-pointer from the caller.
            unsafe { ia_attr.write(a) };
        }
        if !p_attr.is_null() {
            // SAFETY: DAT_PROVIDER_ATTR is plain data; all-zero is valid.
            let mut a: DAT_PROVIDER_ATTR = unsafe { std::mem::zeroed() };
            copy_name(&mut a.provider_name, "softrdma");
            a.provider_version_major = 0;
            a.provider_version_minor = 1;
            a.dapl_version_major = 2;
            a.dapl_version_minor = 0;
            a.lmr_mem_types_supported = 0x3;
            a.completion_flags_supported = 0x1f;
            a.is_thread_safe = 0;
            a.max_private_data_size = MAX_PRIVATE_DATA as DAT_COUNT;
            a.ep_creator = 0;
            a.optimal_buffer_alignment = 64;
            a.srq_supported = 1;
            a.dto_async_return_guaranteed = 1;
            a.num_provider_specific_attr = PROVIDER_ATTRS.0.len() as DAT_COUNT;
            a.provider_specific_attr = PROVIDER_ATTRS.0.as_ptr().cast_mut();
            // SAFETY: non-null out-pointer from the caller.
            unsafe { p_attr.write(a) };
        }
        Ok(())
    })
}

fn release(h: usize) {
    if let Some(m) = handles::remove(h) {
        match &m.obj {
            Obj::Evd(e) => e.drain(),
            Obj::Ep(e) => e.clone().free(),
            _ => {}
        }
    }
}

unsafe extern "C" fn ia_close(ia: H, flags: u32) -> u32 {
    run(|| {
        let (_, i) = ia_h(ia)?;
        let graceful = flags == 1;
        let async_h = i.async_evd().user_data();
        let owned = handles::owned_by(ia as usize);
        if graceful && owned.iter().any(|h| *h != async_h) {
            return Err(bad(ErrorType::InvalidState, Subtype::IaInUse));
        }
        // EPs first (their connections end), then the rest.
        for h in &owned {
            if handles::get(as_h(*h), Kind::Ep).is_ok() {
                release(*h);
            }
        }
        for h in owned {
            release(h);
        }
        handles::remove(ia as usize);
        i.close(false)
    })
}

unsafe extern "C" fn set_consumer_context(h: H, ctx: u64) -> u32 {
    run(|| {
        let m = handles::get_any(h)?;
        m.context.store(ctx, Ordering::Release);
        m.has_context.store(1, Ordering::Release);
        Ok(())
    })
}

unsafe extern "C" fn get_consumer_context(h: H, ctx: *mut u64) -> u32 {
    run(|| {
        let m = handles::get_any(h)?;
        out(ctx, m.context.load(Ordering::Acquire), Subtype::Arg2)
    })
}

unsafe extern "C" fn get_handle_type(h: H, t: *mut u32) -> u32 {
    run(|| {
        let m = handles::get_any(h)?;
        out(t, handles::kind_of(&m) as u32, Subtype::Arg2)
    })
}

// ---------------------------------------------------------------- CNO

unsafe extern "C" fn cno_create(ia: H, _agent: DAT_OS_WAIT_PROXY_AGENT, cno: *mut H) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        if cno.is_null() {
            return Err(param(Subtype::Arg3));
        }
        let c = Cno::new(&i)?;
        out_handle(cno, m.provider, Obj::Cno(c), ia, Subtype::Arg3)
    })
}

unsafe extern "C" fn cno_query(cno: H, _mask: u32, p: *mut DAT_CNO_PARAM) -> u32 {
    run(|| {
        let m = handles::get(cno, Kind::Cno)?;
        // SAFETY: DAT_CNO_PARAM is plain data; all-zero is valid.
        let mut v: DAT_CNO_PARAM = unsafe { std::mem::zeroed() };
        v.ia_handle = consumer_ia(m.ia);
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn cno_free(cno: H) -> u32 {
    free_checked(cno, Cno::free)
}

unsafe extern "C" fn cno_wait(cno: H, t: DAT_TIMEOUT, evd: *mut H) -> u32 {
    run(|| {
        let (_, c) = lookup::<Cno>(cno)?;
        let e = c.wait(timeout(t))?;
        out(evd, as_h(e.map_or(0, |e| e.user_data())), Subtype::Arg3)
    })
}

unsafe extern "C" fn cno_fd_create(ia: H, fd: *mut c_int, cno: *mut H) -> u32 {
    run(|| {
        use std::os::fd::AsRawFd;
        let (m, i) = ia_h(ia)?;
        if fd.is_null() || cno.is_null() {
            return Err(param(Subtype::Arg2));
        }
        let c = Cno::new(&i)?;
        out(fd, c.fd().as_raw_fd(), Subtype::Arg2)?;
        out_handle(cno, m.provider, Obj::Cno(c), ia, Subtype::Arg3)
    })
}

// ---------------------------------------------------------------- CR

unsafe extern "C" fn cr_query(cr: H, _mask: u32, p: *mut DAT_CR_PARAM) -> u32 {
    run(|| {
        let (m, c) = lookup::<Cr>(cr)?;
        let prm = c.param();
        let local_ep = match &prm.sp {
            softrdma_dat::ServicePoint::Rsp(r) => r.ep().map_or(0, |e| e.user_data()),
            softrdma_dat::ServicePoint::Psp(_) => 0,
        };
        let pd = m.pdata.lock();
        let v = DAT_CR_PARAM {
            remote_ia_address_ptr: m.addr2.set(prm.remote_addr),
            remote_port_qual: u64::from(prm.remote_addr.port()),
            private_data_size: pd.len() as DAT_COUNT,
            private_data: pd.as_ptr().cast_mut().cast(),
            local_ep_handle: as_h(local_ep),
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn cr_accept(cr: H, ep: H, n: DAT_COUNT, pd: *const c_void) -> u32 {
    traced("cr_accept", || {
        let (_, c) = lookup::<Cr>(cr)?;
        let data = pdata(n, pd)?;
        let e = if ep.is_null() {
            None
        } else {
            Some(ep_h(ep)?.1)
        };
        c.accept(e.as_ref(), data)?;
        handles::remove(cr as usize);
        Ok(())
    })
}

unsafe extern "C" fn cr_reject(cr: H, n: DAT_COUNT, pd: *const c_void) -> u32 {
    run(|| {
        let (_, c) = lookup::<Cr>(cr)?;
        c.reject(pdata(n, pd)?)?;
        handles::remove(cr as usize);
        Ok(())
    })
}

unsafe extern "C" fn cr_handoff(cr: H, qual: u64) -> u32 {
    run(|| {
        let (_, c) = lookup::<Cr>(cr)?;
        c.handoff(qual)?;
        handles::remove(cr as usize);
        Ok(())
    })
}

// ---------------------------------------------------------------- EVD

unsafe extern "C" fn evd_create(ia: H, qlen: DAT_COUNT, cno: H, flags: u32, evd: *mut H) -> u32 {
    traced("evd_create", || {
        let (m, i) = ia_h(ia)?;
        if evd.is_null() {
            return Err(param(Subtype::Arg5));
        }
        let c = if cno.is_null() {
            None
        } else {
            Some(lookup::<Cno>(cno)?.1)
        };
        let qlen = usize::try_from(qlen).map_err(|_| param(Subtype::Arg2))?;
        if qlen == 0 {
            return Err(param(Subtype::Arg2));
        }
        // DAT's qlen is a minimum (DAPL rounds it up to its CQ sizes too):
        // consumers such as dtestcm size their connection EVD below the
        // number of EPs whose events may be queued at once.
        // Connection and CR EVDs may see an event per EP at once (dtestcm's
        // 1000 disconnects): those queues start larger.
        let min = if flags & (EvdFlags::DTO.0 | EvdFlags::RMR_BIND.0) == 0 {
            MIN_CM_EVD_QLEN
        } else {
            MIN_EVD_QLEN
        };
        let e = Evd::new(&i, qlen.max(min), EvdFlags(flags), c.as_ref())?;
        out_handle(evd, m.provider, Obj::Evd(e), ia, Subtype::Arg5)
    })
}

unsafe extern "C" fn evd_query(evd: H, _mask: u32, p: *mut DAT_EVD_PARAM) -> u32 {
    run(|| {
        let (m, e) = evd_h(evd, Subtype::None)?;
        let st = e.state();
        let state = (if st.enabled { 1 } else { 2 }) | (if st.waitable { 4 } else { 8 });
        let v = DAT_EVD_PARAM {
            ia_handle: consumer_ia(m.ia),
            evd_qlen: e.qlen() as DAT_COUNT,
            evd_state: state,
            cno_handle: as_h(e.cno().map_or(0, |c| c.user_data())),
            evd_flags: e.flags().0,
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn evd_modify_cno(evd: H, cno: H) -> u32 {
    run(|| {
        let (_, e) = evd_h(evd, Subtype::None)?;
        let c = if cno.is_null() {
            None
        } else {
            Some(lookup::<Cno>(cno)?.1)
        };
        e.modify_cno(c.as_ref())
    })
}

unsafe extern "C" fn evd_enable(evd: H) -> u32 {
    run(|| evd_h(evd, Subtype::None)?.1.enable())
}

unsafe extern "C" fn evd_disable(evd: H) -> u32 {
    run(|| evd_h(evd, Subtype::None)?.1.disable())
}

unsafe extern "C" fn evd_set_unwaitable(evd: H) -> u32 {
    run(|| evd_h(evd, Subtype::None)?.1.set_unwaitable())
}

unsafe extern "C" fn evd_clear_unwaitable(evd: H) -> u32 {
    run(|| evd_h(evd, Subtype::None)?.1.clear_unwaitable())
}

unsafe extern "C" fn evd_resize(evd: H, qlen: DAT_COUNT) -> u32 {
    run(|| {
        let q = usize::try_from(qlen).map_err(|_| param(Subtype::Arg2))?;
        evd_h(evd, Subtype::None)?.1.resize(q)
    })
}

unsafe extern "C" fn evd_post_se(evd: H, ev: *const DAT_EVENT) -> u32 {
    run(|| {
        let (_, e) = evd_h(evd, Subtype::None)?;
        if ev.is_null() {
            return Err(param(Subtype::Arg2));
        }
        // SAFETY: non-null event from the caller; the software member is
        // what a software event carries.
        let (num, ptr) = unsafe { ((*ev).event_number, (*ev).event_data.software_event_data) };
        if num != 0x10001 {
            return Err(param(Subtype::Arg2));
        }
        e.post_software(ptr as u64)
    })
}

/// Translates a Rust event into `out`.
fn fill(evd: &Arc<HandleMem>, ev: Event, out_ev: *mut DAT_EVENT) -> R {
    // SAFETY: DAT_EVENT is plain data; all-zero is valid.
    let mut e: DAT_EVENT = unsafe { std::mem::zeroed() };
    e.event_number = ev.event_number();
    e.evd_handle = Arc::as_ptr(evd) as H;
    match ev {
        Event::Dto {
            ep,
            cookie,
            status,
            len,
            op,
        } => {
            e.event_data.dto_completion_event_data = DAT_DTO_COMPLETION_EVENT_DATA {
                ep_handle: as_h(ep.user_data()),
                user_cookie: cookie,
                status: status as u32,
                transfered_length: len,
                operation: op as u32,
                rmr_context: 0,
            };
        }
        Event::RmrBind {
            rmr,
            cookie,
            status,
        } => {
            e.event_data.rmr_completion_event_data = DAT_RMR_BIND_COMPLETION_EVENT_DATA {
                rmr_handle: as_h(rmr.user_data()),
                user_cookie: cookie,
                status: status as u32,
            };
        }
        Event::ConnRequest { sp, conn_qual, cr } => {
            let prm = cr.param();
            let ch = handles::make(evd.provider, Obj::Cr(cr), evd.ia);
            let cm = handles::get(as_h(ch), Kind::Cr)?;
            *cm.pdata.lock() = prm.private_data.clone();
            e.event_data.cr_arrival_event_data = DAT_CR_ARRIVAL_EVENT_DATA {
                sp_handle: as_h(sp.user_data()),
                local_ia_address_ptr: cm.addr.set(prm.local_addr),
                conn_qual,
                cr_handle: as_h(ch),
                truncate_flag: 0,
            };
        }
        Event::Connection {
            ep, private_data, ..
        } => {
            let mut pd = evd.pdata.lock();
            *pd = private_data;
            e.event_data.connect_event_data = DAT_CONNECTION_EVENT_DATA {
                ep_handle: as_h(ep.user_data()),
                private_data_size: pd.len() as DAT_COUNT,
                private_data: if pd.is_empty() {
                    std::ptr::null_mut()
                } else {
                    pd.as_ptr().cast_mut().cast()
                },
            };
        }
        Event::Async {
            ep, evd: bad_evd, ..
        } => {
            let h = ep
                .map(|x| x.user_data())
                .or(bad_evd.map(|x| x.user_data()))
                .unwrap_or(evd.ia);
            e.event_data.asynch_error_event_data = DAT_ASYNCH_ERROR_EVENT_DATA {
                dat_handle: as_h(h),
                reason: 0,
            };
        }
        Event::Software(p) => {
            e.event_data.software_event_data = p as usize as *mut c_void;
        }
    }
    out(out_ev, e, Subtype::Arg4)
}

unsafe extern "C" fn evd_wait(
    evd: H,
    t: DAT_TIMEOUT,
    threshold: DAT_COUNT,
    ev: *mut DAT_EVENT,
    nmore: *mut DAT_COUNT,
) -> u32 {
    traced("evd_wait", || {
        let (m, e) = evd_h(evd, Subtype::None)?;
        if ev.is_null() {
            return Err(param(Subtype::Arg4));
        }
        let th = usize::try_from(threshold).map_err(|_| param(Subtype::Arg3))?;
        let (x, more) = e.wait(timeout(t), th)?;
        out_opt(nmore, more as DAT_COUNT);
        if debug_on() {
            eprintln!("softrdma-dapl: evd {evd:?} event {:#x}", x.event_number());
        }
        fill(&m, x, ev)
    })
}

unsafe extern "C" fn evd_dequeue(evd: H, ev: *mut DAT_EVENT) -> u32 {
    traced("evd_dequeue", || {
        let (m, e) = evd_h(evd, Subtype::None)?;
        if ev.is_null() {
            return Err(param(Subtype::Arg2));
        }
        let x = e.dequeue()?;
        fill(&m, x, ev)
    })
}

unsafe extern "C" fn evd_free(evd: H) -> u32 {
    run(|| {
        let (m, e) = evd_h(evd, Subtype::None)?;
        if let Ok(ia) = handles::get(as_h(m.ia), Kind::Ia)
            && let Obj::Ia(i) = &ia.obj
            && i.async_evd() == e
        {
            // The async EVD goes with its IA.
            return Err(bad(ErrorType::InvalidState, Subtype::EvdAsync));
        }
        e.clone().free()?;
        e.drain();
        handles::remove(evd as usize);
        Ok(())
    })
}

// ---------------------------------------------------------------- EP

fn ep_attr(p: *const DAT_EP_ATTR) -> Option<EpAttr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null attribute block from the caller.
    let a = unsafe { *p };
    let d = EpAttr::default();
    let pick = |v: DAT_COUNT, def: u32| if v > 0 { v as u32 } else { def };
    Some(EpAttr {
        max_message_size: if a.max_message_size > 0 {
            u64::from(a.max_message_size)
        } else {
            d.max_message_size
        },
        max_rdma_size: if a.max_rdma_size > 0 {
            u64::from(a.max_rdma_size)
        } else {
            d.max_rdma_size
        },
        max_recv_dtos: pick(a.max_recv_dtos, d.max_recv_dtos),
        max_request_dtos: pick(a.max_request_dtos, d.max_request_dtos),
        max_recv_iov: pick(a.max_recv_iov, d.max_recv_iov),
        max_request_iov: pick(a.max_request_iov, d.max_request_iov),
        max_rdma_read_in: pick(a.max_rdma_read_in, d.max_rdma_read_in),
        max_rdma_read_out: pick(a.max_rdma_read_out, d.max_rdma_read_out),
        max_rdma_read_iov: pick(a.max_rdma_read_iov, d.max_rdma_read_iov),
        max_rdma_write_iov: pick(a.max_rdma_write_iov, d.max_rdma_write_iov),
    })
}

#[allow(clippy::too_many_arguments)]
fn ep_create_common(
    ia: H,
    pz: H,
    recv: H,
    req: H,
    conn: H,
    srq: H,
    attr: *const DAT_EP_ATTR,
    ep: *mut H,
) -> R {
    let (m, i) = ia_h(ia)?;
    if ep.is_null() {
        return Err(param(Subtype::Arg7));
    }
    let (_, p) = lookup::<Pz>(pz)?;
    let recv = opt_evd(recv, Subtype::HandleEvdRecv)?;
    let req = opt_evd(req, Subtype::HandleEvdRequest)?;
    let conn = opt_evd(conn, Subtype::HandleEvdConn)?;
    let a = ep_attr(attr);
    let e = if srq.is_null() {
        Ep::new(&i, &p, recv.as_ref(), req.as_ref(), conn.as_ref(), a)?
    } else {
        let (_, s) = lookup::<Srq>(srq)?;
        Ep::with_srq(&i, &p, recv.as_ref(), req.as_ref(), conn.as_ref(), &s, a)?
    };
    out_handle(ep, m.provider, Obj::Ep(e), ia, Subtype::Arg7)
}

unsafe extern "C" fn ep_create(
    ia: H,
    pz: H,
    recv: H,
    req: H,
    conn: H,
    attr: *const DAT_EP_ATTR,
    ep: *mut H,
) -> u32 {
    run(|| ep_create_common(ia, pz, recv, req, conn, std::ptr::null_mut(), attr, ep))
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn ep_create_with_srq(
    ia: H,
    pz: H,
    recv: H,
    req: H,
    conn: H,
    srq: H,
    attr: *const DAT_EP_ATTR,
    ep: *mut H,
) -> u32 {
    traced("ep_create_with_srq", || {
        if srq.is_null() {
            return Err(bad(ErrorType::InvalidHandle, Subtype::HandleSrq));
        }
        ep_create_common(ia, pz, recv, req, conn, srq, attr, ep)
    })
}

unsafe extern "C" fn ep_query(ep: H, _mask: u64, p: *mut DAT_EP_PARAM) -> u32 {
    run(|| {
        let (m, e) = ep_h(ep)?;
        let q = e.query();
        let a = q.attr;
        let c = |v: u32| v.min(i32::MAX as u32) as DAT_COUNT;
        let v = DAT_EP_PARAM {
            ia_handle: consumer_ia(m.ia),
            ep_state: q.state.dat_state(),
            comm: DAT_COMM {
                domain: 0,
                type_: 0,
                protocol: 0,
            },
            local_ia_address_ptr: m.addr.set(q.local_addr),
            local_port_qual: q.conn_qual,
            remote_ia_address_ptr: q
                .remote_addr
                .map_or(std::ptr::null_mut(), |r| m.addr2.set(r)),
            remote_port_qual: q.remote_addr.map_or(0, |r| u64::from(r.port())),
            pz_handle: as_h(q.pz.user_data()),
            recv_evd_handle: as_h(q.recv_evd.map_or(0, |x| x.user_data())),
            request_evd_handle: as_h(q.request_evd.map_or(0, |x| x.user_data())),
            connect_evd_handle: as_h(q.connect_evd.map_or(0, |x| x.user_data())),
            srq_handle: as_h(q.srq.map_or(0, |x| x.user_data())),
            ep_attr: DAT_EP_ATTR {
                service_type: 0,
                max_message_size: a.max_message_size.min(u64::from(u32::MAX)) as u32,
                max_rdma_size: a.max_rdma_size.min(u64::from(u32::MAX)) as u32,
                qos: 0,
                recv_completion_flags: 0,
                request_completion_flags: 0,
                max_recv_dtos: c(a.max_recv_dtos),
                max_request_dtos: c(a.max_request_dtos),
                max_recv_iov: c(a.max_recv_iov),
                max_request_iov: c(a.max_request_iov),
                max_rdma_read_in: c(a.max_rdma_read_in),
                max_rdma_read_out: c(a.max_rdma_read_out),
                srq_soft_hw: 0,
                max_rdma_read_iov: c(a.max_rdma_read_iov),
                max_rdma_write_iov: c(a.max_rdma_write_iov),
                ep_transport_specific_count: 0,
                ep_transport_specific: std::ptr::null_mut(),
                ep_provider_specific_count: 0,
                ep_provider_specific: std::ptr::null_mut(),
            },
        };
        out(p, v, Subtype::Arg3)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn ep_connect(
    ep: H,
    addr: *mut libc::sockaddr,
    qual: u64,
    t: DAT_TIMEOUT,
    n: DAT_COUNT,
    pd: *const c_void,
    _qos: u32,
    _flags: u32,
) -> u32 {
    traced("ep_connect", || {
        let (_, e) = ep_h(ep)?;
        let data = pdata(n, pd)?;
        let a = sockaddr(addr)?;
        e.connect(a, qual, timeout(t), data)
    })
}

unsafe extern "C" fn ep_disconnect(ep: H, flags: u32) -> u32 {
    traced("ep_disconnect", || {
        let (_, e) = ep_h(ep)?;
        match e.disconnect(flags == 1) {
            // Disconnecting an EP that never connected is a no-op in DAPL.
            Err(x) if x.sub == Subtype::EpUnconnected => Ok(()),
            r => r,
        }
    })
}

/// The data-transfer posts of an EP: the local triplets (and for RDMA the
/// remote one) converted, the EP looked up, the call traced.
macro_rules! post_entry {
    ($name:ident, $method:ident) => {
        unsafe extern "C" fn $name(
            ep: H,
            n: DAT_COUNT,
            t: *mut DAT_LMR_TRIPLET,
            cookie: u64,
            flags: u32,
        ) -> u32 {
            traced(stringify!($name), || {
                let (_, e) = ep_h(ep)?;
                e.$method(&triplets(n, t)?, cookie, CompletionFlags(flags))
            })
        }
    };
    ($name:ident, $method:ident, remote) => {
        unsafe extern "C" fn $name(
            ep: H,
            n: DAT_COUNT,
            t: *mut DAT_LMR_TRIPLET,
            cookie: u64,
            r: *const DAT_RMR_TRIPLET,
            flags: u32,
        ) -> u32 {
            traced(stringify!($name), || {
                let (_, e) = ep_h(ep)?;
                let local = triplets(n, t)?;
                e.$method(&local, cookie, &rmr_triplet(r)?, CompletionFlags(flags))
            })
        }
    };
}
post_entry!(ep_post_send, post_send);
post_entry!(ep_post_recv, post_recv);
post_entry!(ep_post_rdma_read, post_rdma_read, remote);
post_entry!(ep_post_rdma_write, post_rdma_write, remote);

unsafe extern "C" fn ep_get_status(ep: H, st: *mut u32, rq: *mut u32, sq: *mut u32) -> u32 {
    run(|| {
        let (_, e) = ep_h(ep)?;
        let (s, r, q) = e.status();
        out_opt(st, s.dat_state());
        out_opt(rq, u32::from(r));
        out_opt(sq, u32::from(q));
        Ok(())
    })
}

unsafe extern "C" fn ep_free(ep: H) -> u32 {
    run(|| {
        ep_h(ep)?;
        release(ep as usize);
        Ok(())
    })
}

/// `DAT_EP_FIELD_*` bits no EP can change (IA, state, communicator,
/// addresses, qualifiers).
const EP_FIELDS_FIXED: u64 = 0x7f;
/// The attribute bits `dat_ep_modify` changes here, with their fields.
const EP_FIELDS_MODIFIABLE: u64 = EP_FIELD_RDMA_READ_IN
    | EP_FIELD_RDMA_READ_OUT
    | EP_FIELD_RECV_DTOS
    | EP_FIELD_REQUEST_DTOS
    | EP_FIELD_RECV_IOV
    | EP_FIELD_REQUEST_IOV
    | EP_FIELD_RDMA_READ_IOV
    | EP_FIELD_RDMA_WRITE_IOV;
const EP_FIELD_RECV_DTOS: u64 = 0x0004_0000;
const EP_FIELD_REQUEST_DTOS: u64 = 0x0008_0000;
const EP_FIELD_RECV_IOV: u64 = 0x0010_0000;
const EP_FIELD_REQUEST_IOV: u64 = 0x0020_0000;
const EP_FIELD_RDMA_READ_IN: u64 = 0x0040_0000;
const EP_FIELD_RDMA_READ_OUT: u64 = 0x0080_0000;
const EP_FIELD_RDMA_READ_IOV: u64 = 0x0200_0000;
const EP_FIELD_RDMA_WRITE_IOV: u64 = 0x0400_0000;

/// `dat_ep_modify`: the attributes of [`EP_FIELDS_MODIFIABLE`] (see
/// `Ep::modify`); a fixed field is `DAT_INVALID_PARAMETER`, a changeable
/// one softrdma does not change (EVDs, PZ, SRQ, service type, QoS,
/// completion flags, provider attributes) `DAT_NOT_IMPLEMENTED`.
unsafe extern "C" fn ep_modify(ep: H, mask: u64, p: *const DAT_EP_PARAM) -> u32 {
    traced("ep_modify", || {
        let (_, e) = ep_h(ep)?;
        if mask & EP_FIELDS_FIXED != 0 || mask & !0x7fff_ffff != 0 {
            return Err(param(Subtype::Arg2));
        }
        if mask & !EP_FIELDS_MODIFIABLE != 0 {
            return Err(DatError::of(ErrorType::NotImplemented));
        }
        if p.is_null() {
            return Err(param(Subtype::Arg3));
        }
        // SAFETY: non-null parameter block from the caller.
        let a = unsafe { (*p).ep_attr };
        let f = |bit: u64, v: DAT_COUNT| -> R<Option<u32>> {
            if mask & bit == 0 {
                return Ok(None);
            }
            u32::try_from(v).map(Some).map_err(|_| param(Subtype::Arg3))
        };
        e.modify(&EpAttrChange {
            max_rdma_read_in: f(EP_FIELD_RDMA_READ_IN, a.max_rdma_read_in)?,
            max_rdma_read_out: f(EP_FIELD_RDMA_READ_OUT, a.max_rdma_read_out)?,
            max_recv_dtos: f(EP_FIELD_RECV_DTOS, a.max_recv_dtos)?,
            max_request_dtos: f(EP_FIELD_REQUEST_DTOS, a.max_request_dtos)?,
            max_recv_iov: f(EP_FIELD_RECV_IOV, a.max_recv_iov)?,
            max_request_iov: f(EP_FIELD_REQUEST_IOV, a.max_request_iov)?,
            max_rdma_read_iov: f(EP_FIELD_RDMA_READ_IOV, a.max_rdma_read_iov)?,
            max_rdma_write_iov: f(EP_FIELD_RDMA_WRITE_IOV, a.max_rdma_write_iov)?,
        })
    })
}

/// `DAT_VALUE_UNKNOWN`.
const VALUE_UNKNOWN: DAT_COUNT = -2;

/// `dat_ep_recv_query`: receives posted and not completed; the span (and
/// the count of an EP on an SRQ) is `DAT_VALUE_UNKNOWN`.
unsafe extern "C" fn ep_recv_query(ep: H, nbufs: *mut DAT_COUNT, span: *mut DAT_COUNT) -> u32 {
    run(|| {
        let (_, e) = ep_h(ep)?;
        let n = e
            .recv_query()
            .map_or(VALUE_UNKNOWN, |n| n.min(i32::MAX as usize) as DAT_COUNT);
        out_opt(nbufs, n);
        out_opt(span, VALUE_UNKNOWN);
        Ok(())
    })
}

unsafe extern "C" fn ep_reset(ep: H) -> u32 {
    run(|| ep_h(ep)?.1.reset())
}

// ---------------------------------------------------------------- memory

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn lmr_create(
    ia: H,
    mem_type: u32,
    region: DAT_REGION_DESCRIPTION,
    len: u64,
    pz: H,
    privs: u32,
    _va_type: u32,
    lmr: *mut H,
    lmr_ctx: *mut u32,
    rmr_ctx: *mut u32,
    reg_len: *mut u64,
    reg_addr: *mut u64,
) -> u32 {
    run(|| {
        let (m, _) = ia_h(ia)?;
        if lmr.is_null() {
            return Err(param(Subtype::Arg8));
        }
        let (_, p) = lookup::<Pz>(pz)?;
        let len = usize::try_from(len).map_err(|_| bad(ErrorType::LengthError, Subtype::None))?;
        let ptr: *mut u8 = match mem_type {
            // SAFETY: the member a virtual or shared region uses.
            0 | 2 => unsafe { region.for_va }.cast(),
            1 => {
                // SAFETY: the member an LMR-type region uses.
                let (_, o) = lookup::<Lmr>(unsafe { region.for_lmr_handle })?;
                o.address() as *mut u8
            }
            _ => return Err(param(Subtype::Arg2)),
        };
        // SAFETY: DAT's contract: the consumer's memory stays valid while
        // the LMR exists and transfers naming it are outstanding.
        let l = unsafe { Lmr::register(&p, ptr, len, MemPriv(privs)) }?;
        out_opt(lmr_ctx, l.lmr_context());
        out_opt(rmr_ctx, l.rmr_context());
        out_opt(reg_len, l.len() as u64);
        out_opt(reg_addr, l.address());
        out_handle(lmr, m.provider, Obj::Lmr(l), ia, Subtype::Arg8)
    })
}

unsafe extern "C" fn lmr_query(lmr: H, _mask: u32, p: *mut DAT_LMR_PARAM) -> u32 {
    run(|| {
        let (m, l) = lookup::<Lmr>(lmr)?;
        let v = DAT_LMR_PARAM {
            ia_handle: consumer_ia(m.ia),
            mem_type: 0,
            region_desc: DAT_REGION_DESCRIPTION {
                for_va: l.address() as *mut c_void,
            },
            length: l.len() as u64,
            pz_handle: as_h(l.pz().user_data()),
            mem_priv: l.privileges().0,
            va_type: 0,
            lmr_context: l.lmr_context(),
            rmr_context: l.rmr_context(),
            registered_size: l.len() as u64,
            registered_address: l.address(),
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn lmr_free(lmr: H) -> u32 {
    free_now(lmr, drop::<Lmr>)
}

unsafe extern "C" fn lmr_sync(ia: H, t: *const DAT_LMR_TRIPLET, _n: u64) -> u32 {
    // softrdma places data directly in the registered memory: nothing to
    // flush or invalidate.
    run(|| {
        ia_h(ia)?;
        if t.is_null() {
            return Err(param(Subtype::Arg2));
        }
        Ok(())
    })
}

unsafe extern "C" fn rmr_create(pz: H, rmr: *mut H) -> u32 {
    run(|| {
        let (pm, p) = lookup::<Pz>(pz)?;
        if rmr.is_null() {
            return Err(param(Subtype::Arg2));
        }
        let r = Rmr::new(&p)?;
        out(
            rmr,
            as_h(handles::make(pm.provider, Obj::Rmr(r), pm.ia)),
            Subtype::Arg2,
        )
    })
}

unsafe extern "C" fn rmr_query(rmr: H, _mask: u32, p: *mut DAT_RMR_PARAM) -> u32 {
    run(|| {
        let (m, r) = lookup::<Rmr>(rmr)?;
        let b = r.binding();
        let v = DAT_RMR_PARAM {
            ia_handle: consumer_ia(m.ia),
            pz_handle: as_h(r.pz().user_data()),
            lmr_triplet: DAT_LMR_TRIPLET {
                virtual_address: b.as_ref().map_or(0, |x| x.1),
                segment_length: b.as_ref().map_or(0, |x| x.2 as u32),
                lmr_context: b.as_ref().map_or(0, |x| x.0.lmr_context()),
            },
            mem_priv: b.as_ref().map_or(0, |x| x.3.0),
            rmr_context: r.rmr_context(),
            rmr_scope: 0,
            va_type: 0,
        };
        out(p, v, Subtype::Arg3)
    })
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn rmr_bind(
    rmr: H,
    lmr: H,
    t: *const DAT_LMR_TRIPLET,
    privs: u32,
    _va_type: u32,
    ep: H,
    cookie: u64,
    flags: u32,
    ctx: *mut u32,
) -> u32 {
    run(|| {
        let (_, r) = lookup::<Rmr>(rmr)?;
        let (_, e) = ep_h(ep)?;
        let target = if lmr.is_null() {
            None
        } else {
            let (_, l) = lookup::<Lmr>(lmr)?;
            if t.is_null() {
                return Err(param(Subtype::Arg3));
            }
            // SAFETY: non-null triplet from the caller.
            let t = unsafe { *t };
            Some((l, t.virtual_address, u64::from(t.segment_length)))
        };
        let c = e.bind_rmr(
            &r,
            target.as_ref().map(|(l, a, n)| (l, *a, *n)),
            MemPriv(privs),
            cookie,
            CompletionFlags(flags),
        )?;
        out_opt(ctx, c);
        Ok(())
    })
}

unsafe extern "C" fn rmr_free(rmr: H) -> u32 {
    free_now(rmr, drop::<Rmr>)
}

unsafe extern "C" fn pz_create(ia: H, pz: *mut H) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        if pz.is_null() {
            return Err(param(Subtype::Arg2));
        }
        let p = Pz::new(&i);
        out_handle(pz, m.provider, Obj::Pz(p), ia, Subtype::Arg2)
    })
}

unsafe extern "C" fn pz_query(pz: H, _mask: u32, p: *mut DAT_PZ_PARAM) -> u32 {
    run(|| {
        let m = handles::get(pz, Kind::Pz)?;
        out(
            p,
            DAT_PZ_PARAM {
                ia_handle: consumer_ia(m.ia),
            },
            Subtype::Arg3,
        )
    })
}

unsafe extern "C" fn pz_free(pz: H) -> u32 {
    free_checked(pz, Pz::free)
}

// ---------------------------------------------------------------- SPs

unsafe extern "C" fn psp_create(ia: H, qual: u64, evd: H, flags: u32, psp: *mut H) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        let (_, e) = evd_h(evd, Subtype::HandleEvdCr)?;
        if psp.is_null() {
            return Err(param(Subtype::Arg5));
        }
        let p = Psp::new(&i, qual, &e, flags)?;
        out_handle(psp, m.provider, Obj::Psp(p), ia, Subtype::Arg5)
    })
}

unsafe extern "C" fn psp_create_any(ia: H, qual: *mut u64, evd: H, flags: u32, psp: *mut H) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        let (_, e) = evd_h(evd, Subtype::HandleEvdCr)?;
        if psp.is_null() || qual.is_null() {
            return Err(param(Subtype::Arg2));
        }
        let p = Psp::new_any(&i, &e, flags)?;
        out(qual, p.conn_qual(), Subtype::Arg2)?;
        out_handle(psp, m.provider, Obj::Psp(p), ia, Subtype::Arg5)
    })
}

unsafe extern "C" fn psp_query(psp: H, _mask: u32, p: *mut DAT_PSP_PARAM) -> u32 {
    run(|| {
        let (m, s) = lookup::<Psp>(psp)?;
        let v = DAT_PSP_PARAM {
            ia_handle: consumer_ia(m.ia),
            conn_qual: s.conn_qual(),
            evd_handle: as_h(s.evd().user_data()),
            psp_flags: s.flags(),
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn psp_free(psp: H) -> u32 {
    free_now(psp, Psp::free)
}

unsafe extern "C" fn rsp_create(ia: H, qual: u64, ep: H, evd: H, rsp: *mut H) -> u32 {
    run(|| {
        let (m, i) = ia_h(ia)?;
        let (_, e) = ep_h(ep)?;
        let (_, v) = evd_h(evd, Subtype::HandleEvdCr)?;
        if rsp.is_null() {
            return Err(param(Subtype::Arg5));
        }
        let r = Rsp::new(&i, qual, &e, &v)?;
        out_handle(rsp, m.provider, Obj::Rsp(r), ia, Subtype::Arg5)
    })
}

unsafe extern "C" fn rsp_query(rsp: H, _mask: u32, p: *mut DAT_RSP_PARAM) -> u32 {
    run(|| {
        let (m, s) = lookup::<Rsp>(rsp)?;
        let v = DAT_RSP_PARAM {
            ia_handle: consumer_ia(m.ia),
            conn_qual: s.conn_qual(),
            evd_handle: as_h(s.evd().user_data()),
            ep_handle: as_h(s.ep().map_or(0, |e| e.user_data())),
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn rsp_free(rsp: H) -> u32 {
    free_now(rsp, Rsp::free)
}

// ---------------------------------------------------------------- SRQ

unsafe extern "C" fn srq_create(ia: H, pz: H, attr: *mut DAT_SRQ_ATTR, srq: *mut H) -> u32 {
    traced("srq_create", || {
        let (m, i) = ia_h(ia)?;
        let (_, p) = lookup::<Pz>(pz)?;
        if attr.is_null() || srq.is_null() {
            return Err(param(Subtype::Arg3));
        }
        // SAFETY: non-null attribute block from the caller.
        let a = unsafe { *attr };
        let n = u32::try_from(a.max_recv_dtos).map_err(|_| param(Subtype::Arg3))?;
        let iov = u32::try_from(a.max_recv_iov.max(1)).map_err(|_| param(Subtype::Arg3))?;
        let s = Srq::new(&i, &p, n, iov)?;
        if a.low_watermark > 0 {
            s.set_low_watermark(a.low_watermark as u32)?;
        }
        out_handle(srq, m.provider, Obj::Srq(s), ia, Subtype::Arg4)
    })
}

unsafe extern "C" fn srq_free(srq: H) -> u32 {
    free_now(srq, |s: Srq| s.free())
}

unsafe extern "C" fn srq_post_recv(
    srq: H,
    n: DAT_COUNT,
    t: *mut DAT_LMR_TRIPLET,
    cookie: u64,
) -> u32 {
    traced("srq_post_recv", || {
        let (_, s) = lookup::<Srq>(srq)?;
        s.post_recv(&triplets(n, t)?, cookie)
    })
}

unsafe extern "C" fn srq_query(srq: H, _mask: u32, p: *mut DAT_SRQ_PARAM) -> u32 {
    run(|| {
        let (m, s) = lookup::<Srq>(srq)?;
        let out_n = s.outstanding() as DAT_COUNT;
        let v = DAT_SRQ_PARAM {
            ia_handle: consumer_ia(m.ia),
            srq_state: 1,
            pz_handle: std::ptr::null_mut(),
            max_recv_dtos: s.max_recv_dtos() as DAT_COUNT,
            max_recv_iov: s.max_recv_iov() as DAT_COUNT,
            low_watermark: 0,
            available_dto_count: out_n,
            outstanding_dto_count: out_n,
        };
        out(p, v, Subtype::Arg3)
    })
}

unsafe extern "C" fn srq_set_lw(srq: H, lw: DAT_COUNT) -> u32 {
    run(|| {
        let (_, s) = lookup::<Srq>(srq)?;
        s.set_low_watermark(u32::try_from(lw).map_err(|_| param(Subtype::Arg2))?)
    })
}

/// The answer of every slot softrdma does not implement. Its C callers
/// pass arguments it ignores: on x86-64 (and every C ABI Linux uses) the
/// caller owns the argument area, so a function taking none may be called
/// with any.
unsafe extern "C" fn not_implemented() -> u32 {
    0x3fff_0000
}

/// The 79 slots.
pub(crate) fn table() -> [*const c_void; SLOTS] {
    let ni = not_implemented as *const c_void;
    let mut t = [ni; SLOTS];
    macro_rules! set {
        ($($i:expr => $f:ident),* $(,)?) => { $( t[$i] = $f as *const c_void; )* };
    }
    set! {
        0 => ia_open, 1 => ia_query, 2 => ia_close, 3 => set_consumer_context,
        4 => get_consumer_context, 5 => get_handle_type, 6 => cno_create,
        8 => cno_query, 9 => cno_free, 10 => cno_wait, 11 => cr_query, 12 => cr_accept,
        13 => cr_reject, 14 => cr_handoff, 15 => evd_create, 16 => evd_query,
        17 => evd_modify_cno, 18 => evd_enable, 19 => evd_disable, 20 => evd_wait,
        21 => evd_resize, 22 => evd_post_se, 23 => evd_dequeue, 24 => evd_free,
        25 => ep_create, 26 => ep_query, 27 => ep_modify, 28 => ep_connect, 30 => ep_disconnect,
        31 => ep_post_send, 32 => ep_post_recv, 33 => ep_post_rdma_read,
        34 => ep_post_rdma_write, 35 => ep_get_status, 36 => ep_free, 37 => lmr_create,
        38 => lmr_query, 39 => lmr_free, 40 => rmr_create, 41 => rmr_query, 42 => rmr_bind,
        43 => rmr_free, 44 => psp_create, 45 => psp_query, 46 => psp_free, 47 => rsp_create,
        48 => rsp_query, 49 => rsp_free, 50 => pz_create, 51 => pz_query, 52 => pz_free,
        53 => psp_create_any, 54 => ep_reset, 55 => evd_set_unwaitable,
        56 => evd_clear_unwaitable, 57 => lmr_sync, 58 => lmr_sync,
        59 => ep_create_with_srq, 60 => ep_recv_query, 62 => srq_create, 63 => srq_free, 64 => srq_post_recv,
        65 => srq_query, 67 => srq_set_lw, 75 => cno_fd_create,
    }
    t
}
