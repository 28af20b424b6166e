//! The `ibv_*` entry points of libibverbs and the context ops table.

use std::collections::{HashMap, VecDeque};
use std::ffi::{CStr, c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::{Condvar, Mutex};
use softrdma_engine::cq::CompletionQueue;
use softrdma_engine::{
    Access, AsyncEvent, AsyncEventKind, Device, MemoryRegion, MemoryWindow, ProtectionDomain,
    QpCap, QpInitAttr, QpState, QueuePair, RecvWr, SendFlags, SendOp, SendWr, Sge,
    SharedReceiveQueue, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};

use crate::abi::*;
use crate::ffi::{self, SemFd, guard, guard_errno, guard_ptr, set_errno};
use crate::qpex::WrBuilder;

/// The device name reported to applications.
pub const DEVICE_NAME: &str = "softrdma0";
/// `IBV_NODE_RNIC`.
pub const NODE_RNIC: c_int = 4;
/// `IBV_TRANSPORT_IWARP`.
pub const TRANSPORT_IWARP: c_int = 1;
/// Node GUID (network order bytes 02:00:00:ff:fe:00:00:01: a locally
/// administered EUI-64).
pub const NODE_GUID: u64 = u64::from_be_bytes([0x02, 0, 0, 0xff, 0xfe, 0, 0, 0x01]);

// ---- enums of verbs.h ----
/// `IBV_QPT_RC`.
pub const QPT_RC: c_int = 2;
const QPS_RESET: c_int = 0;
const QPS_INIT: c_int = 1;
const QPS_RTR: c_int = 2;
const QPS_RTS: c_int = 3;
const QPS_SQD: c_int = 4;
const QPS_ERR: c_int = 6;
const QP_STATE_MASK: c_int = 1;
const QP_CAP_MASK: c_int = 1 << 19;

// ---- objects: the C struct first, then the Rust state ----

/// An open context: `struct verbs_context` (with the embedded
/// `ibv_context`) first.
#[repr(C)]
pub struct Ctx {
    /// The C view.
    pub vc: verbs_context,
    /// The engine device.
    pub dev: Device,
    /// Asynchronous events of this context.
    pub async_q: Arc<EventQueue<ibv_async_event>>,
    /// GIDs (IPv4-mapped addresses of the host).
    pub gids: Vec<[u8; 16]>,
}

/// Protection domain.
#[repr(C)]
pub struct Pd {
    pub(crate) pd: ibv_pd,
    pub(crate) inner: ProtectionDomain,
}

#[repr(C)]
struct Mr {
    mr: ibv_mr,
    inner: MemoryRegion,
}

/// A queue of events behind a blocking semaphore descriptor.
#[derive(Debug)]
pub struct EventQueue<T> {
    /// The descriptor applications read and poll.
    pub fd: SemFd,
    q: Mutex<VecDeque<T>>,
}

// SAFETY: the raw pointers queued are only handed back to the application
// that owns them; the queue itself is locked.
unsafe impl<T> Send for EventQueue<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for EventQueue<T> {}

impl<T> EventQueue<T> {
    /// A new empty queue.
    pub fn new() -> Result<Self, i32> {
        Ok(EventQueue {
            fd: SemFd::new()?,
            q: Mutex::new(VecDeque::new()),
        })
    }
    /// Queues an event and makes the descriptor readable.
    pub fn push(&self, v: T) {
        self.q.lock().push_back(v);
        self.fd.post();
    }
    /// Takes the next event: blocks on the descriptor (or EAGAIN if the
    /// application made it non-blocking).
    pub fn pop(&self) -> Result<T, i32> {
        loop {
            self.fd.wait()?;
            if let Some(v) = self.q.lock().pop_front() {
                return Ok(v);
            }
            // A token whose event was withdrawn (its object destroyed).
        }
    }
    /// Drops queued events matching `f`.
    pub fn retain(&self, f: impl FnMut(&T) -> bool) {
        self.q.lock().retain(f);
    }
}

#[repr(C)]
struct Channel {
    ch: ibv_comp_channel,
    q: Arc<EventQueue<usize>>,
}

/// Completion queue.
#[repr(C)]
pub struct Cq {
    pub(crate) cq: ibv_cq,
    pub(crate) inner: CompletionQueue,
    chan: Option<Arc<EventQueue<usize>>>,
    delivered: AtomicU32,
    acked: Mutex<u32>,
    acked_cv: Condvar,
}

/// Shared receive queue.
#[repr(C)]
pub struct Srq {
    pub(crate) srq: ibv_srq,
    pub(crate) inner: SharedReceiveQueue,
}

/// Queue pair: `struct ibv_qp_ex` (which starts with `ibv_qp`) first.
#[repr(C)]
pub struct Qp {
    pub(crate) qpx: ibv_qp_ex,
    pub(crate) inner: QueuePair,
    /// The verbs state set by `ibv_modify_qp` while the engine QP is idle
    /// (RESET or INIT).
    pub(crate) idle_state: AtomicI32,
    pub(crate) wr: std::cell::UnsafeCell<WrBuilder>,
    pub(crate) sq_sig_all: bool,
    pub(crate) max_inline: u32,
}

// ---- registries for async events (engine ids -> C objects) ----

static QPS: Mutex<Option<HashMap<u32, (usize, usize)>>> = Mutex::new(None);
/// Engine SRQ id -> (the `ibv_srq`, its context's async queue).
type SrqMap = HashMap<u32, (usize, Arc<EventQueue<ibv_async_event>>)>;
static SRQS: Mutex<Option<SrqMap>> = Mutex::new(None);
static CTXS: Mutex<Vec<std::sync::Weak<EventQueue<ibv_async_event>>>> = Mutex::new(Vec::new());
static ASYNC_HANDLER: Mutex<u64> = Mutex::new(u64::MAX);

fn async_type(k: AsyncEventKind) -> Option<c_int> {
    Some(match k {
        AsyncEventKind::CqError => 0,
        AsyncEventKind::QpFatal | AsyncEventKind::TerminateReceived => 1,
        AsyncEventKind::QpRequestError => 2,
        AsyncEventKind::QpAccessError => 3,
        AsyncEventKind::CommEstablished => 4,
        AsyncEventKind::SqDrained => 5,
        AsyncEventKind::DeviceFatal => 8,
        AsyncEventKind::SrqError => 14,
        AsyncEventKind::SrqLimitReached => 15,
        AsyncEventKind::QpLastWqeReached => 16,
        _ => return None,
    })
}

fn on_async(ev: &AsyncEvent) {
    ffi::debug(|| {
        format!(
            "async event {:?} (QP {:?}, CQ {:?}, SRQ {:?}, terminate {:?}){}",
            ev.kind,
            ev.qp_num,
            ev.cq_id,
            ev.srq_id,
            ev.term,
            ev.detail
                .as_deref()
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        )
    });
    let Some(t) = async_type(ev.kind) else { return };
    if let Some(id) = ev.srq_id {
        let found = SRQS.lock().as_ref().and_then(|m| m.get(&id).cloned());
        if let Some((srq, q)) = found {
            q.push(ibv_async_event {
                element: srq as *mut c_void,
                event_type: t,
            });
        }
        return;
    }
    if let Some(n) = ev.qp_num {
        let found = QPS.lock().as_ref().and_then(|m| m.get(&n).copied());
        if let Some((qp, q)) = found {
            // SAFETY: `q` is the address of the Arc'd queue of the QP's
            // context, kept alive by the context while the QP is registered.
            let q = unsafe { &*(q as *const EventQueue<ibv_async_event>) };
            q.push(ibv_async_event {
                element: qp as *mut c_void,
                event_type: t,
            });
        }
        return;
    }
    if t == 8 {
        for q in CTXS.lock().iter().filter_map(std::sync::Weak::upgrade) {
            q.push(ibv_async_event {
                element: null_mut(),
                event_type: t,
            });
        }
    }
}

/// The engine device with the async-event handler installed.
pub fn engine() -> Result<Device, i32> {
    let dev = ffi::engine()?;
    // One handler per engine device (a new one after a fork).
    let mut h = ASYNC_HANDLER.lock();
    let key = dev.attr() as *const _ as u64;
    if *h != key {
        ffi::with_signals_blocked(|| dev.set_async_event_handler(on_async))
            .map_err(|_| libc::EIO)?;
        *h = key;
    }
    Ok(dev)
}

// ---- the device list ----

static DEVICE: OnceLock<usize> = OnceLock::new();

fn the_device() -> *mut ibv_device {
    *DEVICE.get_or_init(|| {
        // SAFETY: ibv_device is plain data; zero is a valid value.
        let mut d: Box<ibv_device> = Box::new(unsafe { std::mem::zeroed() });
        d.node_type = NODE_RNIC;
        d.transport_type = TRANSPORT_IWARP;
        ffi::copy_cstr(&mut d.name, DEVICE_NAME);
        ffi::copy_cstr(&mut d.dev_name, "uverbs0");
        ffi::copy_cstr(&mut d.dev_path, "/sys/class/infiniband_verbs/uverbs0");
        ffi::copy_cstr(&mut d.ibdev_path, "/sys/class/infiniband/softrdma0");
        Box::into_raw(d) as usize
    }) as *mut ibv_device
}

/// `ibv_get_device_list`: one device, `softrdma0`. No engine thread is
/// started here.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_device_list(num: *mut c_int) -> *mut *mut ibv_device {
    guard_ptr(|| {
        // SAFETY: a two-entry array from calloc, freed by ibv_free_device_list.
        let list = unsafe { libc::calloc(2, size_of::<usize>()) } as *mut *mut ibv_device;
        if list.is_null() {
            return Err(libc::ENOMEM);
        }
        // SAFETY: list has two entries.
        unsafe { *list = the_device() };
        if !num.is_null() {
            // SAFETY: the caller passes a valid int pointer or NULL.
            unsafe { *num = 1 };
        }
        Ok(list)
    })
}

/// `ibv_free_device_list`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_free_device_list(list: *mut *mut ibv_device) {
    // SAFETY: `list` came from ibv_get_device_list (calloc) or is NULL.
    unsafe { libc::free(list.cast()) };
}

/// `ibv_get_device_name`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_device_name(device: *mut ibv_device) -> *const c_char {
    if device.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null();
    }
    // SAFETY: a device of our list.
    unsafe { (*device).name.as_ptr() }
}

/// `ibv_get_device_guid` (network order).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_device_guid(_device: *mut ibv_device) -> u64 {
    NODE_GUID.to_be()
}

/// `ibv_get_device_index`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_device_index(device: *mut ibv_device) -> c_int {
    if device.is_null() { -1 } else { 0 }
}

/// `ibv_get_sysfs_path`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `ibv_read_sysfs_file`: there is no sysfs entry for a software device.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_read_sysfs_file(
    _dir: *const c_char,
    _file: *const c_char,
    _buf: *mut c_char,
    _size: usize,
) -> c_int {
    set_errno(libc::ENOENT);
    -1
}

fn host_gids() -> Vec<[u8; 16]> {
    let mut v4 = vec![[127u8, 0, 0, 1]];
    // SAFETY: getifaddrs/freeifaddrs pair; entries read while the list lives.
    unsafe {
        let mut ifa: *mut libc::ifaddrs = null_mut();
        if libc::getifaddrs(&mut ifa) == 0 {
            let mut p = ifa;
            while !p.is_null() {
                let a = (*p).ifa_addr;
                if !a.is_null() && c_int::from((*a).sa_family) == libc::AF_INET {
                    let sin = &*(a as *const libc::sockaddr_in);
                    let ip = sin.sin_addr.s_addr.to_ne_bytes();
                    if !v4.contains(&ip) {
                        v4.push(ip);
                    }
                }
                p = (*p).ifa_next;
            }
            libc::freeifaddrs(ifa);
        }
    }
    v4.iter()
        .map(|ip| {
            let mut g = [0u8; 16];
            g[10] = 0xff;
            g[11] = 0xff;
            g[12..].copy_from_slice(ip);
            g
        })
        .collect()
}

// ---- context ----

/// The context behind an `ibv_context` pointer.
///
/// # Safety
///
/// `ctx` must come from [`ibv_open_device`] and be open.
pub unsafe fn ctx_of<'a>(ctx: *mut ibv_context) -> &'a Ctx {
    // SAFETY: the context is embedded at offset 320 of our Ctx, which is
    // repr(C) with verbs_context first.
    unsafe { &*(ctx.cast::<u8>().sub(size_of::<[Fp; vctx::WORDS]>()) as *const Ctx) }
}

fn fill_ops(ops: &mut [Fp; 32]) {
    ops[ops::POLL_CQ] = poll_cq as *const () as Fp;
    ops[ops::REQ_NOTIFY_CQ] = req_notify_cq as *const () as Fp;
    ops[ops::POST_SEND] = post_send as *const () as Fp;
    ops[ops::POST_RECV] = post_recv as *const () as Fp;
    ops[ops::POST_SRQ_RECV] = post_srq_recv as *const () as Fp;
    ops[ops::ALLOC_MW] = alloc_mw as *const () as Fp;
    ops[ops::BIND_MW] = bind_mw as *const () as Fp;
    ops[ops::DEALLOC_MW] = dealloc_mw as *const () as Fp;
}

/// Opens a context (also used by the CM for `cm_id->verbs`).
pub fn open_context() -> Result<*mut ibv_context, i32> {
    let dev = engine()?;
    let async_q = Arc::new(EventQueue::new()?);
    // SAFETY: verbs_context is plain data (pointers, ints, a zeroed
    // pthread mutex is PTHREAD_MUTEX_INITIALIZER on glibc).
    let mut vc: verbs_context = unsafe { std::mem::zeroed() };
    vc.ext[vctx::QUERY_PORT] = query_port_ex as *const () as Fp;
    vc.ext[vctx::QUERY_DEVICE_EX] = query_device_ex as *const () as Fp;
    vc.ext[vctx::CREATE_QP_EX] = create_qp_ex as *const () as Fp;
    vc.ext[vctx::SZ] = size_of::<verbs_context>();
    vc.context.device = the_device();
    fill_ops(&mut vc.context.ops);
    vc.context.cmd_fd = -1;
    vc.context.async_fd = async_q.fd.0;
    vc.context.num_comp_vectors = 1;
    vc.context.abi_compat = usize::MAX as *mut c_void;
    CTXS.lock().push(Arc::downgrade(&async_q));
    let ctx = Box::new(Ctx {
        vc,
        dev,
        async_q,
        gids: host_gids(),
    });
    let p = Box::into_raw(ctx);
    // SAFETY: just allocated.
    Ok(unsafe { &raw mut (*p).vc.context })
}

/// `ibv_open_device`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_open_device(device: *mut ibv_device) -> *mut ibv_context {
    guard_ptr(|| {
        if device.is_null() || device != the_device() {
            return Err(libc::ENODEV);
        }
        open_context()
    })
}

/// `ibv_close_device`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_close_device(ctx: *mut ibv_context) -> c_int {
    guard(-1, || {
        if ctx.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: the context is ours; freed once.
        let c = unsafe { Box::from_raw(ctx_of(ctx) as *const Ctx as *mut Ctx) };
        CTXS.lock()
            .retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), Arc::as_ptr(&c.async_q)));
        drop(c);
        0
    })
}

/// Fills `ibv_device_attr` from the engine.
fn device_attr(dev: &Device, a: &mut ibv_device_attr) {
    let e = dev.attr();
    let i = |v: u32| c_int::try_from(v).unwrap_or(c_int::MAX);
    ffi::copy_cstr(&mut a.fw_ver, &e.fw_ver);
    a.node_guid = NODE_GUID.to_be();
    a.sys_image_guid = NODE_GUID.to_be();
    a.max_mr_size = e.max_mr_size;
    a.page_size_cap = 4096;
    a.vendor_id = e.vendor_id;
    a.vendor_part_id = 0;
    a.hw_ver = 0;
    a.max_qp = i(e.max_qp);
    a.max_qp_wr = i(e.max_qp_wr);
    a.device_cap_flags = 0;
    a.max_sge = i(e.max_sge);
    a.max_sge_rd = i(e.max_sge_rd);
    a.max_cq = i(e.max_cq);
    a.max_cqe = i(e.max_cqe);
    a.max_mr = i(e.max_mr);
    a.max_pd = i(e.max_pd);
    a.max_qp_rd_atom = i(e.max_qp_rd_atom);
    a.max_res_rd_atom = i(e.max_qp_rd_atom.saturating_mul(e.max_qp));
    a.max_qp_init_rd_atom = i(e.max_qp_init_rd_atom);
    a.atomic_cap = c_int::from(e.atomic_cap);
    a.max_mw = i(e.max_mw);
    a.max_srq = i(e.max_srq);
    a.max_srq_wr = i(e.max_srq_wr);
    a.max_srq_sge = i(e.max_srq_sge);
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 0;
    a.phys_port_cnt = 1;
}

/// `ibv_query_device`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_device(ctx: *mut ibv_context, attr: *mut ibv_device_attr) -> c_int {
    guard_errno(|| {
        if ctx.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid context and caller's struct.
        unsafe {
            std::ptr::write_bytes(attr, 0, 1);
            device_attr(&ctx_of(ctx).dev, &mut *attr);
        }
        Ok(())
    })
}

extern "C" fn query_device_ex(
    _ctx: *mut ibv_context,
    _input: *const c_void,
    _attr: *mut c_void,
    _size: usize,
) -> c_int {
    // The inline ibv_query_device_ex falls back to ibv_query_device.
    libc::EOPNOTSUPP
}

fn port_attr(ctx: &Ctx) -> ibv_port_attr {
    ibv_port_attr {
        state: 4, // IBV_PORT_ACTIVE
        max_mtu: 5,
        active_mtu: 5, // 4096
        gid_tbl_len: c_int::try_from(ctx.gids.len()).unwrap_or(1),
        port_cap_flags: 1 << 16, // IBV_PORT_CM_SUP
        max_msg_sz: 0x7fff_ffff,
        bad_pkey_cntr: 0,
        qkey_viol_cntr: 0,
        pkey_tbl_len: 1,
        lid: 0,
        sm_lid: 0,
        lmc: 0,
        max_vl_num: 1,
        sm_sl: 0,
        subnet_timeout: 0,
        init_type_reply: 0,
        active_width: 1,  // 1X
        active_speed: 32, // 25 Gb/s lane class (EDR): a software link
        phys_state: 5,    // LinkUp
        link_layer: 2,    // IBV_LINK_LAYER_ETHERNET
        flags: 0,
        port_cap_flags2: 0,
    }
}

/// `ibv_query_port` (the exported compat entry: writes 48 bytes).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_port(ctx: *mut ibv_context, port: u8, attr: *mut c_void) -> c_int {
    query_port_ex(ctx, port, attr, 48)
}

extern "C" fn query_port_ex(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut c_void,
    len: usize,
) -> c_int {
    guard_errno(|| {
        if ctx.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        if port != 1 {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid context; the caller's buffer holds `len` bytes.
        unsafe {
            let a = port_attr(ctx_of(ctx));
            let n = len.min(size_of::<ibv_port_attr>());
            std::ptr::copy_nonoverlapping((&raw const a).cast::<u8>(), attr.cast::<u8>(), n);
        }
        Ok(())
    })
}

fn gid_of(ctx: *mut ibv_context, port: u8, index: c_int) -> Result<[u8; 16], i32> {
    if ctx.is_null() || port != 1 {
        return Err(libc::EINVAL);
    }
    // SAFETY: valid context.
    let c = unsafe { ctx_of(ctx) };
    usize::try_from(index)
        .ok()
        .and_then(|i| c.gids.get(i).copied())
        .ok_or(libc::EINVAL)
}

/// `ibv_query_gid`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_gid(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    gid: *mut [u8; 16],
) -> c_int {
    ffi::guard_neg(|| {
        let g = gid_of(ctx, port, index)?;
        if gid.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: caller's 16-byte union.
        unsafe { *gid = g };
        Ok(())
    })
}

/// `_ibv_query_gid_ex` (behind the inline `ibv_query_gid_ex`).
#[unsafe(no_mangle)]
pub extern "C" fn _ibv_query_gid_ex(
    ctx: *mut ibv_context,
    port: u32,
    index: u32,
    entry: *mut ibv_gid_entry,
    _flags: u32,
    entry_size: usize,
) -> c_int {
    guard_errno(|| {
        let port = u8::try_from(port).map_err(|_| libc::EINVAL)?;
        let g = gid_of(ctx, port, c_int::try_from(index).map_err(|_| libc::EINVAL)?)
            .map_err(|_| libc::ENODATA)?;
        if entry.is_null() || entry_size < size_of::<ibv_gid_entry>() {
            return Err(libc::EINVAL);
        }
        // SAFETY: caller's entry of at least our size.
        unsafe {
            *entry = ibv_gid_entry {
                gid: g,
                gid_index: index,
                port_num: u32::from(port),
                gid_type: 0, // IBV_GID_TYPE_IB, as the kernel reports for iWARP
                ndev_ifindex: 0,
            };
        }
        Ok(())
    })
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34, used by ibv_devinfo).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_gid_type(
    ctx: *mut ibv_context,
    port: u8,
    index: c_uint,
    ty: *mut c_int,
) -> c_int {
    ffi::guard_neg(|| {
        gid_of(ctx, port, c_int::try_from(index).map_err(|_| libc::EINVAL)?)?;
        if !ty.is_null() {
            // SAFETY: caller's int.
            unsafe { *ty = 0 };
        }
        Ok(())
    })
}
use std::ffi::c_uint;

/// `ibv_query_pkey`: one entry, the default 0xffff.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_pkey(
    ctx: *mut ibv_context,
    port: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    ffi::guard_neg(|| {
        if ctx.is_null() || port != 1 || index != 0 || pkey.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: caller's u16.
        unsafe { *pkey = 0xffffu16.to_be() };
        Ok(())
    })
}

// ---- fork ----

/// `ibv_fork_init`: nothing to do, memory is never pinned.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `ibv_is_fork_initialized`: `IBV_FORK_UNNEEDED`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    2
}

/// `ibv_dontfork_range`: nothing is pinned.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// `ibv_dofork_range`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

// ---- PD / MR ----

/// `ibv_alloc_pd`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    guard_ptr(|| {
        if ctx.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid context.
        let c = unsafe { ctx_of(ctx) };
        let inner = c.dev.alloc_pd();
        let pd = Box::new(Pd {
            pd: ibv_pd {
                context: ctx,
                handle: inner.id(),
            },
            inner,
        });
        Ok(Box::into_raw(pd).cast())
    })
}

/// Frees the object of this library behind `p` (its C view), as the
/// `ibv_dealloc_*`/`ibv_dereg_*` calls do: 0, or EINVAL for NULL.
///
/// # Safety
///
/// `p` is NULL or the C view at the start of a boxed `T` of this library
/// that is freed once.
unsafe fn free_ours<C, T>(p: *mut C) -> c_int {
    guard_errno(|| {
        if p.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's promise: a `T` of ours, freed once.
        drop(unsafe { Box::from_raw(p.cast::<T>()) });
        Ok(())
    })
}

/// `ibv_dealloc_pd`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    // SAFETY: `Pd` starts with the C view the application holds.
    unsafe { free_ours::<_, Pd>(pd) }
}

const ACCESS_OPTIONAL_RANGE: c_int = 0x3ff0_0000;

fn reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> Result<*mut ibv_mr, i32> {
    if pd.is_null() || (addr.is_null() && len != 0) {
        return Err(libc::EINVAL);
    }
    if iova != addr as u64 {
        // Only virtual-address based regions (iova == addr).
        return Err(libc::EOPNOTSUPP);
    }
    let access = access & !ACCESS_OPTIONAL_RANGE & !0x80; // HUGETLB is a hint
    if access & !0x1f != 0 {
        // ZERO_BASED, ON_DEMAND, ...
        return Err(libc::EOPNOTSUPP);
    }
    let access = Access::from_bits(access as u32).ok_or(libc::EINVAL)?;
    // SAFETY: a PD of ours.
    let p = unsafe { &*pd.cast::<Pd>() };
    // SAFETY: the application keeps `addr..addr+len` valid while the
    // region is registered (the ibv_reg_mr contract); the engine accesses
    // it through raw pointers only.
    let mr = unsafe { p.inner.register_raw(addr.cast(), len, access) }.map_err(|e| match e {
        softrdma_engine::mr::RegError::OutOfMemory(_) => libc::ENOMEM,
        _ => libc::EINVAL,
    })?;
    let m = Box::new(Mr {
        mr: ibv_mr {
            context: p.pd.context,
            pd,
            addr,
            length: len,
            handle: mr.index(),
            lkey: mr.lkey(),
            rkey: mr.rkey(),
        },
        inner: mr,
    });
    Ok(Box::into_raw(m).cast())
}

/// `ibv_reg_mr`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    access: c_int,
) -> *mut ibv_mr {
    guard_ptr(|| reg_mr(pd, addr, len, addr as u64, access))
}

/// `ibv_reg_mr_iova`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    guard_ptr(|| reg_mr(pd, addr, len, iova, access))
}

/// `ibv_reg_mr_iova2`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: c_uint,
) -> *mut ibv_mr {
    guard_ptr(|| reg_mr(pd, addr, len, iova, access as c_int))
}

/// `ibv_dereg_mr`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    // SAFETY: `Mr` starts with the C view the application holds.
    unsafe { free_ours::<_, Mr>(mr) }
}

/// A memory window: `struct ibv_mw` first.
#[repr(C)]
struct Mw {
    mw: ibv_mw,
    inner: MemoryWindow,
}

/// `IBV_MW_TYPE_2`.
const MW_TYPE_2: c_int = 2;

/// `ibv_alloc_mw` (ops table): type 2 windows, bound by posting
/// `IBV_WR_BIND_MW`; type 1: EOPNOTSUPP (the engine binds windows only
/// through work requests).
extern "C" fn alloc_mw(pd: *mut ibv_pd, ty: c_int) -> *mut ibv_mw {
    guard_ptr(|| {
        if pd.is_null() {
            return Err(libc::EINVAL);
        }
        if ty != MW_TYPE_2 {
            return Err(libc::EOPNOTSUPP);
        }
        // SAFETY: a PD of ours.
        let p = unsafe { &*pd.cast::<Pd>() };
        let inner = p.inner.alloc_mw().map_err(|_| libc::ENOMEM)?;
        let m = Box::new(Mw {
            mw: ibv_mw {
                context: p.pd.context,
                pd,
                rkey: inner.rkey(),
                handle: inner.rkey() >> 8,
                type_: ty,
            },
            inner,
        });
        Ok(Box::into_raw(m).cast())
    })
}

/// The ops table's `bind_mw` (`ibv_bind_mw`, type 1 windows only, which
/// this library does not allocate).
extern "C" fn bind_mw(_qp: *mut ibv_qp, _mw: *mut ibv_mw, _bind: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

/// `ibv_dealloc_mw` (ops table).
extern "C" fn dealloc_mw(mw: *mut ibv_mw) -> c_int {
    // SAFETY: `Mw` starts with the C view the application holds.
    unsafe { free_ours::<_, Mw>(mw) }
}

// ---- completion channel / CQ ----

/// `ibv_create_comp_channel`: a blocking descriptor (poll/epoll-able;
/// O_NONBLOCK honoured by `ibv_get_cq_event`).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    guard_ptr(|| {
        if ctx.is_null() {
            return Err(libc::EINVAL);
        }
        let q = Arc::new(EventQueue::new()?);
        let ch = Box::new(Channel {
            ch: ibv_comp_channel {
                context: ctx,
                fd: q.fd.0,
                refcnt: 0,
            },
            q,
        });
        Ok(Box::into_raw(ch).cast())
    })
}

/// `ibv_destroy_comp_channel`: EBUSY while CQs use it.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    guard_errno(|| {
        if ch.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a channel of ours.
        if unsafe { (*ch).refcnt } != 0 {
            return Err(libc::EBUSY);
        }
        // SAFETY: freed once.
        drop(unsafe { Box::from_raw(ch.cast::<Channel>()) });
        Ok(())
    })
}

/// `ibv_create_cq`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    guard_ptr(|| {
        if ctx.is_null() || cqe <= 0 {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid context.
        let c = unsafe { ctx_of(ctx) };
        let chan = if channel.is_null() {
            None
        } else {
            // SAFETY: a channel of ours.
            Some(unsafe { (*channel.cast::<Channel>()).q.clone() })
        };
        let slot = Arc::new(AtomicUsize::new(0));
        let mut b = CompletionQueue::builder(&c.dev, cqe as usize);
        if let Some(q) = chan.clone() {
            let slot = slot.clone();
            // The event of an armed CQ: queue it on the application's
            // channel (the CQ pointer is set below, before any arming).
            b = b.callback(move |_cq: &CompletionQueue| {
                let p = slot.load(Ordering::Acquire);
                if p != 0 {
                    q.push(p);
                }
            });
        }
        let inner = ffi::with_signals_blocked(|| b.build()).map_err(|_| libc::EINVAL)?;
        let cq = Box::new(Cq {
            cq: ibv_cq {
                context: ctx,
                channel,
                cq_context,
                handle: inner.id(),
                cqe,
                mutex: [0; 5],
                cond: [0; 6],
                comp_events_completed: 0,
                async_events_completed: 0,
            },
            inner,
            chan,
            delivered: AtomicU32::new(0),
            acked: Mutex::new(0),
            acked_cv: Condvar::new(),
        });
        if !channel.is_null() {
            // SAFETY: a channel of ours; refcnt is only changed here.
            unsafe { (*channel).refcnt += 1 };
        }
        let p = Box::into_raw(cq);
        slot.store(p as usize, Ordering::Release);
        Ok(p.cast())
    })
}

/// `ibv_resize_cq`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    guard_errno(|| {
        if cq.is_null() || cqe <= 0 {
            return Err(libc::EINVAL);
        }
        // SAFETY: a CQ of ours.
        let c = unsafe { &mut *cq.cast::<Cq>() };
        c.inner.resize(cqe as usize).map_err(|_| libc::EINVAL)?;
        c.cq.cqe = cqe;
        Ok(())
    })
}

/// `ibv_destroy_cq`: waits until every event delivered for the CQ is
/// acknowledged (as libibverbs does).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    guard_errno(|| {
        if cq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a CQ of ours.
        let c = unsafe { &*cq.cast::<Cq>() };
        {
            let mut acked = c.acked.lock();
            while *acked < c.delivered.load(Ordering::Acquire) {
                c.acked_cv.wait(&mut acked);
            }
        }
        if let Some(q) = &c.chan {
            q.retain(|&p| p != cq as usize);
            // SAFETY: the channel outlives its CQs (EBUSY otherwise).
            unsafe { (*c.cq.channel).refcnt -= 1 };
        }
        // SAFETY: freed once.
        drop(unsafe { Box::from_raw(cq.cast::<Cq>()) });
        Ok(())
    })
}

/// `ibv_get_cq_event`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut c_void,
) -> c_int {
    ffi::guard_neg(|| {
        if ch.is_null() || cq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a channel of ours.
        let q = unsafe { &(*ch.cast::<Channel>()).q };
        let p = q.pop()?;
        // SAFETY: the CQ is alive: destroy withdraws its queued events.
        let c = unsafe { &*(p as *const Cq) };
        c.delivered.fetch_add(1, Ordering::AcqRel);
        // SAFETY: caller's out pointers.
        unsafe {
            *cq = p as *mut ibv_cq;
            if !cq_context.is_null() {
                *cq_context = c.cq.cq_context;
            }
        }
        Ok(())
    })
}

/// `ibv_ack_cq_events`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) {
    guard((), || {
        if cq.is_null() {
            return;
        }
        // SAFETY: a CQ of ours.
        let c = unsafe { &mut *cq.cast::<Cq>() };
        let mut a = c.acked.lock();
        *a = a.wrapping_add(n);
        c.cq.comp_events_completed = *a;
        c.acked_cv.notify_all();
    });
}

fn wc_status(s: WcStatus) -> c_int {
    match s {
        WcStatus::Success => 0,
        WcStatus::LocalLength => 1,
        WcStatus::LocalQpOperation => 2,
        WcStatus::LocalProtection => 4,
        WcStatus::WrFlush => 5,
        WcStatus::MwBind => 6,
        WcStatus::RemoteInvalidRequest => 9,
        WcStatus::RemoteAccess => 10,
        WcStatus::RemoteOperation => 11,
        WcStatus::InvalidateError => 17,
        WcStatus::Fatal => 19,
        _ => 21,
    }
}

fn wc_opcode(o: WcOpcode) -> c_int {
    match o {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::CompSwap => 3,
        WcOpcode::FetchAdd => 4,
        WcOpcode::BindMw => 5,
        WcOpcode::LocalInv => 6,
        WcOpcode::Recv => 128,
        WcOpcode::RecvRdmaWithImm => 129,
        _ => 0,
    }
}

/// Converts an engine completion to `ibv_wc`.
pub fn to_wc(w: &WorkCompletion) -> ibv_wc {
    let mut flags = 0;
    let mut imm = 0;
    if w.flags.contains(WcFlags::WITH_IMM) {
        flags |= 2;
        imm = w.imm_data.to_be();
    }
    if w.flags.contains(WcFlags::WITH_INV) {
        flags |= 8;
        imm = w.invalidated_rkey;
    }
    ibv_wc {
        wr_id: w.wr_id,
        status: wc_status(w.status),
        opcode: wc_opcode(w.opcode),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: imm,
        qp_num: w.qp_num,
        src_qp: 0,
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl: 0,
        dlid_path_bits: 0,
    }
}

extern "C" fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    guard(-1, || {
        if cq.is_null() || n < 0 || (wc.is_null() && n > 0) {
            return -1;
        }
        // SAFETY: a CQ of ours.
        let c = unsafe { &*cq.cast::<Cq>() };
        let n = n as usize;
        // The engine's completions land in this thread's buffer first (set
        // up once: busy-polling applications call this millions of times).
        thread_local!(static WCS: std::cell::RefCell<[WorkCompletion; 32]> =
            const { std::cell::RefCell::new([WorkCompletion::success(0, WcOpcode::Send, 0); 32]) });
        WCS.with(|b| {
            let Ok(mut buf) = b.try_borrow_mut() else {
                return -1;
            };
            let mut done = 0;
            while done < n {
                let want = (n - done).min(buf.len());
                let got = c.inner.poll(&mut buf[..want]);
                for (i, w) in buf[..got].iter().enumerate() {
                    // SAFETY: the caller's array holds n entries.
                    unsafe { *wc.add(done + i) = to_wc(w) };
                }
                done += got;
                if got < want {
                    break;
                }
            }
            done as c_int
        })
    })
}

extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        if cq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: a CQ of ours.
        let c = unsafe { &*cq.cast::<Cq>() };
        if c.chan.is_none() {
            // No channel: arming has no visible effect (as with the kernel).
            return 0;
        }
        match c.inner.req_notify(solicited_only != 0) {
            Ok(()) => 0,
            Err(_) => libc::EINVAL,
        }
    })
}

// ---- async events ----

/// `ibv_get_async_event`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_get_async_event(ctx: *mut ibv_context, ev: *mut ibv_async_event) -> c_int {
    ffi::guard_neg(|| {
        if ctx.is_null() || ev.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: valid context.
        let e = unsafe { ctx_of(ctx) }.async_q.pop()?;
        // SAFETY: caller's struct.
        unsafe { *ev = e };
        Ok(())
    })
}

/// `ibv_ack_async_event`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_ack_async_event(ev: *mut ibv_async_event) {
    guard((), || {
        if ev.is_null() {
            return;
        }
        // SAFETY: caller's event naming one of our objects.
        unsafe {
            let e = &*ev;
            match e.event_type {
                0 if !e.element.is_null() => {
                    (*e.element.cast::<ibv_cq>()).async_events_completed += 1
                }
                1..=5 | 16 if !e.element.is_null() => {
                    (*e.element.cast::<ibv_qp>()).events_completed += 1
                }
                14 | 15 if !e.element.is_null() => {
                    (*e.element.cast::<ibv_srq>()).events_completed += 1
                }
                _ => {}
            }
        }
    });
}

// ---- SRQ ----

/// `ibv_create_srq`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq {
    guard_ptr(|| {
        if pd.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a PD of ours and the caller's attributes.
        let (p, a) = unsafe { (&*pd.cast::<Pd>(), &mut *attr) };
        let inner = SharedReceiveQueue::new(
            &p.inner,
            a.attr.max_wr,
            a.attr.max_sge.max(1),
            a.attr.srq_limit,
        )
        .map_err(|_| libc::EINVAL)?;
        let s = Box::new(Srq {
            srq: ibv_srq {
                context: p.pd.context,
                srq_context: a.srq_context,
                pd,
                handle: inner.id(),
                mutex: [0; 5],
                cond: [0; 6],
                events_completed: 0,
            },
            inner,
        });
        let id = s.inner.id();
        let p = Box::into_raw(s);
        // SAFETY: the PD's context is a context of ours.
        let q = unsafe { ctx_of((*pd).context) }.async_q.clone();
        SRQS.lock()
            .get_or_insert_with(HashMap::new)
            .insert(id, (p as usize, q));
        Ok(p.cast())
    })
}

/// `ibv_modify_srq`: the limit (IBV_SRQ_LIMIT); resizing is not supported.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int {
    guard_errno(|| {
        if srq.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        if mask & 1 != 0 {
            return Err(libc::EOPNOTSUPP); // IBV_SRQ_MAX_WR: resize
        }
        if mask & 2 != 0 {
            // SAFETY: ours / caller's.
            let (s, a) = unsafe { (&*srq.cast::<Srq>(), &*attr) };
            s.inner
                .modify_limit(a.srq_limit)
                .map_err(|_| libc::EINVAL)?;
        }
        Ok(())
    })
}

/// `ibv_query_srq`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    guard_errno(|| {
        if srq.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ours / caller's.
        unsafe {
            let s = &*srq.cast::<Srq>();
            *attr = ibv_srq_attr {
                max_wr: s.inner.max_wr(),
                max_sge: s.inner.max_sge(),
                srq_limit: s.inner.limit(),
            };
        }
        Ok(())
    })
}

/// `ibv_destroy_srq`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    guard_errno(|| {
        if srq.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: freed once.
        let b = unsafe { Box::from_raw(srq.cast::<Srq>()) };
        // Its events not yet taken are withdrawn (the pointer dies here).
        if let Some((_, q)) = SRQS.lock().as_mut().and_then(|m| m.remove(&b.inner.id())) {
            q.retain(|e| e.element != srq.cast::<c_void>());
        }
        drop(b);
        Ok(())
    })
}

fn sges<'a>(list: *mut ibv_sge, n: c_int) -> Result<&'a [Sge], i32> {
    if n <= 0 {
        return Ok(&[]);
    }
    if list.is_null() {
        return Err(libc::EINVAL);
    }
    // SAFETY: ibv_sge and the engine's Sge are both {u64 addr; u32 length;
    // u32 lkey} (checked by the layout test); the caller's array holds n.
    Ok(unsafe { std::slice::from_raw_parts(list.cast::<Sge>(), n as usize) })
}

extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        if srq.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ours.
        let s = unsafe { &*srq.cast::<Srq>() };
        post_recv_list(wr, bad, |r| {
            s.inner.post_recv(r).map_err(|e| match e {
                softrdma_engine::srq::PostRecvError::Full => libc::ENOMEM,
                _ => libc::EINVAL,
            })
        })
    })
}

/// Posts the caller's receive list with `post`, one request at a time; on
/// the first error sets `*bad` to that request and returns the errno.
fn post_recv_list(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    post: impl Fn(&RecvWr<'_>) -> Result<(), c_int>,
) -> c_int {
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: the caller's list.
        let r = unsafe { &*w };
        let e = sges(r.sg_list, r.num_sge).and_then(|sg| post(&RecvWr::new(r.wr_id, sg)));
        if let Err(e) = e {
            if !bad.is_null() {
                // SAFETY: caller's out pointer.
                unsafe { *bad = w };
            }
            return e;
        }
        w = r.next;
    }
    0
}

// ---- QP ----

fn qp_state_of(q: &Qp) -> c_int {
    match q.inner.state() {
        QpState::Idle => q.idle_state.load(Ordering::Relaxed),
        QpState::Rtr => QPS_RTR,
        QpState::Rts => QPS_RTS,
        QpState::Closing => QPS_SQD,
        _ => QPS_ERR,
    }
}

/// Creates a QP from the fields `ibv_qp_init_attr` and
/// `ibv_qp_init_attr_ex` share.
///
/// # Safety
///
/// Pointers in `a` are NULL or objects of this library.
#[allow(clippy::too_many_arguments)]
pub unsafe fn create_qp_common(
    pd: *mut ibv_pd,
    qp_context: *mut c_void,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    cap: &mut ibv_qp_cap,
    qp_type: c_int,
    sq_sig_all: c_int,
) -> Result<*mut ibv_qp, i32> {
    if pd.is_null() || send_cq.is_null() || recv_cq.is_null() {
        return Err(libc::EINVAL);
    }
    if qp_type != QPT_RC {
        // UC, UD, raw packet, XRC: not on iWARP.
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: objects of ours (caller's contract).
    let (p, scq, rcq) = unsafe {
        (
            &*pd.cast::<Pd>(),
            &*send_cq.cast::<Cq>(),
            &*recv_cq.cast::<Cq>(),
        )
    };
    let dev = p.inner.device();
    let max_inline = dev.attr().max_inline_data;
    let mut attr = QpInitAttr::new(&scq.inner, &rcq.inner);
    attr.cap = QpCap {
        max_send_wr: cap.max_send_wr.max(1),
        max_recv_wr: cap.max_recv_wr.max(1),
        max_send_sge: cap.max_send_sge.max(1),
        max_recv_sge: cap.max_recv_sge.max(1),
        max_inline_data: cap.max_inline_data,
    };
    if !srq.is_null() {
        // SAFETY: ours.
        attr.srq = Some(unsafe { &*srq.cast::<Srq>() }.inner.clone());
    }
    attr.sq_sig_all = sq_sig_all != 0;
    let a = dev.attr();
    attr.ird = u16::try_from(a.max_qp_rd_atom.min(128)).unwrap_or(16);
    attr.ord = attr.ird;
    let inner =
        ffi::with_signals_blocked(|| QueuePair::new(&p.inner, &attr)).map_err(|e| match e {
            softrdma_engine::qp::CreateQpError::Capability { .. } => libc::EINVAL,
            _ => libc::ENOMEM,
        })?;
    cap.max_send_wr = attr.cap.max_send_wr;
    cap.max_recv_wr = attr.cap.max_recv_wr;
    cap.max_send_sge = attr.cap.max_send_sge;
    cap.max_recv_sge = attr.cap.max_recv_sge;
    let ctx = p.pd.context;
    // SAFETY: ibv_qp_ex is plain data.
    let mut qpx: ibv_qp_ex = unsafe { std::mem::zeroed() };
    qpx.qp_base = ibv_qp {
        context: ctx,
        qp_context,
        pd,
        send_cq,
        recv_cq,
        srq,
        handle: inner.qp_num(),
        qp_num: inner.qp_num(),
        state: QPS_RESET,
        qp_type,
        mutex: [0; 5],
        cond: [0; 6],
        events_completed: 0,
    };
    crate::qpex::fill(&mut qpx);
    let q = Box::new(Qp {
        qpx,
        inner,
        idle_state: AtomicI32::new(QPS_RESET),
        wr: std::cell::UnsafeCell::new(WrBuilder::default()),
        sq_sig_all: sq_sig_all != 0,
        max_inline: max_inline.min(cap.max_inline_data),
    });
    let qp_num = q.inner.qp_num();
    let raw = Box::into_raw(q);
    // SAFETY: valid context.
    let aq = Arc::as_ptr(&unsafe { ctx_of(ctx) }.async_q) as usize;
    QPS.lock()
        .get_or_insert_with(HashMap::new)
        .insert(qp_num, (raw as usize, aq));
    Ok(raw.cast())
}

/// `ibv_create_qp`: RC only (UC/UD: EOPNOTSUPP, as on iWARP).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_create_qp(pd: *mut ibv_pd, attr: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    guard_ptr(|| {
        if attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *attr };
        // SAFETY: the pointers are the application's objects of this library.
        unsafe {
            create_qp_common(
                pd,
                a.qp_context,
                a.send_cq,
                a.recv_cq,
                a.srq,
                &mut a.cap,
                a.qp_type,
                a.sq_sig_all,
            )
        }
    })
}

/// Masks of `ibv_qp_init_attr_ex.comp_mask` accepted.
const QP_INIT_ATTR_PD: u32 = 1;
const QP_INIT_ATTR_CREATE_FLAGS: u32 = 4;
const QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 64;

/// `create_qp_ex` op (behind the inline `ibv_create_qp_ex`).
pub extern "C" fn create_qp_ex(
    _ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    guard_ptr(|| {
        if attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *attr };
        create_qp_from_ex(a)
    })
}

/// Creates a QP from `ibv_qp_init_attr_ex`.
pub fn create_qp_from_ex(a: &mut ibv_qp_init_attr_ex) -> Result<*mut ibv_qp, i32> {
    let ok = QP_INIT_ATTR_PD | QP_INIT_ATTR_CREATE_FLAGS | QP_INIT_ATTR_SEND_OPS_FLAGS;
    if a.comp_mask & !ok != 0 || a.comp_mask & QP_INIT_ATTR_PD == 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if a.comp_mask & QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0 {
        return Err(libc::EOPNOTSUPP);
    }
    if a.comp_mask & QP_INIT_ATTR_SEND_OPS_FLAGS != 0
        && a.send_ops_flags & !crate::qpex::SUPPORTED_SEND_OPS != 0
    {
        return Err(libc::EOPNOTSUPP);
    }
    // SAFETY: the application's objects of this library.
    unsafe {
        create_qp_common(
            a.pd,
            a.qp_context,
            a.send_cq,
            a.recv_cq,
            a.srq,
            &mut a.cap,
            a.qp_type,
            a.sq_sig_all,
        )
    }
}

/// `ibv_qp_to_qp_ex`: every QP of this library is extended.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    qp.cast()
}

/// How long the close of a connected QP (`ibv_destroy_qp`, and the FIN of
/// `rdma_disconnect`) waits at most for the peer to acknowledge the last
/// bytes sent: above Linux's longest delayed acknowledgement (200 ms), so a
/// live peer always answers in time. The engine waits, not the caller.
pub const DESTROY_LINGER: std::time::Duration = std::time::Duration::from_millis(250);

/// `ibv_destroy_qp`: a connected QP closes its connection in order (FIN, as
/// kernel siw does) once the peer has acknowledged the bytes sent, at most
/// [`DESTROY_LINGER`] later. The call does not wait for that: the engine
/// does, and closes the socket (`QueuePair::close_acknowledged`; a process
/// that exits right after waits at exit).
#[unsafe(no_mangle)]
pub extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    guard_errno(|| {
        if qp.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a QP of ours, freed once.
        let q = unsafe { Box::from_raw(qp.cast::<Qp>()) };
        if let Some(m) = QPS.lock().as_mut() {
            m.remove(&q.inner.qp_num());
        }
        // SAFETY: valid context.
        unsafe { ctx_of(q.qpx.qp_base.context) }
            .async_q
            .retain(|e| e.element != qp.cast());
        // A connected QP closes in order once the peer has acknowledged
        // what was sent (kernel siw, as the peer, fails a Send it was still
        // completing when the close arrives: `QueuePair::close_acknowledged`,
        // which leaves the wait to the engine and returns at once).
        match q.inner.state() {
            // (CLOSING: `rdma_disconnect`'s FIN may still wait for it.)
            QpState::Rts | QpState::Closing => q.inner.close_acknowledged(DESTROY_LINGER),
            QpState::Rtr => q.inner.abort(),
            _ => {}
        }
        drop(q);
        Ok(())
    })
}

/// `ibv_modify_qp`. On iWARP the connection manager moves a QP to RTR/RTS;
/// here RESET/INIT are recorded, RTS on a connected QP is accepted, ERR
/// aborts, SQD disconnects gracefully and RESET from ERR resets. RTR/RTS
/// on an unconnected QP fail with EINVAL, as on kernel iWARP devices.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: c_int) -> c_int {
    guard_errno(|| {
        if qp.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ours / caller's.
        let (q, a) = unsafe { (&*qp.cast::<Qp>(), &*attr) };
        if mask & QP_STATE_MASK == 0 {
            // Attributes without a state change (MIN_RNR_TIMER, ...): nothing
            // to do on iWARP.
            return Ok(());
        }
        let cur = qp_state_of(q);
        let to = a.qp_state;
        let r = match (cur, to) {
            (QPS_RESET | QPS_INIT, QPS_RESET | QPS_INIT) => {
                q.idle_state.store(to, Ordering::Relaxed);
                Ok(())
            }
            (QPS_RTS, QPS_RTS) | (QPS_RTR | QPS_RTS, QPS_RTR) => Ok(()),
            (_, QPS_ERR) => {
                q.inner.abort();
                Ok(())
            }
            // The FIN waits for the peer's acknowledgement, as
            // `rdma_disconnect`'s.
            (QPS_RTS, QPS_SQD) => q
                .inner
                .disconnect_acknowledged(DESTROY_LINGER)
                .map_err(|_| libc::EINVAL),
            (QPS_ERR | QPS_SQD, QPS_RESET) => {
                let r = q.inner.modify(QpState::Idle).map_err(|_| libc::EINVAL);
                if r.is_ok() {
                    q.idle_state.store(QPS_RESET, Ordering::Relaxed);
                }
                r
            }
            _ => Err(libc::EINVAL),
        };
        if r.is_ok() {
            // SAFETY: the state field of our ibv_qp.
            unsafe { (*qp).state = qp_state_of(q) };
        }
        r
    })
}

/// `ibv_query_qp`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    guard_errno(|| {
        if qp.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ours / caller's.
        let q = unsafe { &*qp.cast::<Qp>() };
        let e = q.inner.query();
        let cap = ibv_qp_cap {
            max_send_wr: e.cap.max_send_wr,
            max_recv_wr: e.cap.max_recv_wr,
            max_send_sge: e.cap.max_send_sge,
            max_recv_sge: e.cap.max_recv_sge,
            max_inline_data: q.max_inline,
        };
        // SAFETY: caller's structs.
        unsafe {
            std::ptr::write_bytes(attr, 0, 1);
            let a = &mut *attr;
            a.qp_state = qp_state_of(q);
            a.cur_qp_state = a.qp_state;
            a.path_mtu = 5;
            a.qp_access_flags = 0x7;
            a.cap = cap;
            a.max_rd_atomic = u8::try_from(e.ord).unwrap_or(u8::MAX);
            a.max_dest_rd_atomic = u8::try_from(e.ird).unwrap_or(u8::MAX);
            a.port_num = 1;
            if !init.is_null() {
                let i = &mut *init;
                let b = &q.qpx.qp_base;
                i.qp_context = b.qp_context;
                i.send_cq = b.send_cq;
                i.recv_cq = b.recv_cq;
                i.srq = b.srq;
                i.cap = cap;
                i.qp_type = b.qp_type;
                i.sq_sig_all = c_int::from(q.sq_sig_all);
            }
        }
        Ok(())
    })
}
// Keep the constant referenced (documented mask of ibv_query_qp).
const _: c_int = QP_CAP_MASK;

/// Converts one `ibv_send_wr` and posts it.
fn post_one(q: &Qp, r: &ibv_send_wr) -> Result<(), i32> {
    let sg = sges(r.sg_list, r.num_sge)?;
    let rkey = r.compare_add as u32;
    let op = match r.opcode {
        0 => SendOp::Write {
            remote_addr: r.remote_addr,
            rkey,
        },
        1 => SendOp::WriteWithImm {
            remote_addr: r.remote_addr,
            rkey,
            imm: u32::from_be(r.imm_data),
        },
        2 => SendOp::Send,
        3 => SendOp::SendWithImm {
            imm: u32::from_be(r.imm_data),
        },
        4 => SendOp::Read {
            remote_addr: r.remote_addr,
            rkey,
        },
        5 => SendOp::CmpSwap {
            remote_addr: r.remote_addr,
            rkey: r.atomic_rkey,
            compare: r.compare_add,
            swap: r.swap,
        },
        6 => SendOp::FetchAdd {
            remote_addr: r.remote_addr,
            rkey: r.atomic_rkey,
            add: r.compare_add,
        },
        7 => SendOp::LocalInv { rkey: r.imm_data },
        8 => return post_bind_mw(q, r),
        9 => SendOp::SendWithInv {
            invalidate_rkey: r.imm_data,
        },
        _ => return Err(libc::EINVAL),
    };
    let flags = send_flags(r.send_flags);
    let wr = SendWr::new(r.wr_id, op).flags(flags);
    let post = |wr: &SendWr<'_>| {
        q.inner.post_send(wr).map_err(|e| {
            ffi::debug(|| format!("ibv_post_send: {e}"));
            post_send_errno(e)
        })
    };
    if r.send_flags & 8 == 0 || matches!(op, SendOp::Read { .. }) {
        return post(&wr.sg_list(sg));
    }
    let total: usize = sg.iter().map(|s| s.length as usize).sum();
    if total > q.max_inline.max(q.inner.device().attr().max_inline_data) as usize {
        return Err(libc::EINVAL);
    }
    // Inline data is read from the application's buffers at post time (the
    // IBV_SEND_INLINE contract: the buffers may be reused as soon as the post
    // returns, and their lkeys are not checked); the engine copies inline
    // data before post_send returns.
    if let [s] = sg {
        // SAFETY: the application's buffer of `length` bytes (see above).
        let data = unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
        return post(&wr.inline(data));
    }
    // Several pieces: gathered into this thread's buffer (no allocation per
    // post once it has grown).
    thread_local!(static GATHER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) });
    GATHER.with(|g| {
        let mut v = g.try_borrow_mut().map_err(|_| libc::EAGAIN)?;
        v.clear();
        for s in sg {
            // SAFETY: the application's buffer of `length` bytes (see above).
            v.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
            });
        }
        post(&wr.inline(&v))
    })
}

/// `IBV_WR_BIND_MW`: binds a type 2 window (`wr.bind_mw`: the window, the
/// new rkey, then `bind_info` = region, address, length, access).
fn post_bind_mw(q: &Qp, r: &ibv_send_wr) -> Result<(), i32> {
    let [mw, rkey, mr, addr, length, access] = r.bind_mw;
    // `rkey` is a uint32_t and `mw_access_flags` an unsigned int, each in the
    // low half of its word.
    let bind = BindMw {
        mw: mw as *mut ibv_mw,
        rkey: rkey as u32,
        mr: mr as *mut ibv_mr,
        addr,
        length,
        access: access as u32,
    };
    bind.post(q, r.wr_id, r.send_flags)
}

/// A type 2 window bind as verbs describes it (`ibv_post_send` with
/// `IBV_WR_BIND_MW`, or `ibv_wr_bind_mw`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct BindMw {
    /// The window (`struct ibv_mw *` of this library).
    pub(crate) mw: *mut ibv_mw,
    /// The window's new rkey: its index bits must be the window's (as
    /// `ibv_inc_rkey(mw->rkey)` computes), its low byte is the new key.
    pub(crate) rkey: u32,
    /// `bind_info.mr`.
    pub(crate) mr: *mut ibv_mr,
    /// `bind_info.addr`.
    pub(crate) addr: u64,
    /// `bind_info.length`.
    pub(crate) length: u64,
    /// `bind_info.mw_access_flags`.
    pub(crate) access: u32,
}

impl BindMw {
    /// Posts the bind on `q`. The bind takes effect at post, so `mw->rkey`
    /// holds the new rkey when this returns. An rkey whose index bits are
    /// not the window's is refused with EINVAL.
    pub(crate) fn post(&self, q: &Qp, wr_id: u64, flags: c_uint) -> Result<(), i32> {
        let (mw, mr) = (self.mw.cast::<Mw>(), self.mr.cast::<Mr>());
        if mw.is_null() || mr.is_null() {
            return Err(libc::EINVAL);
        }
        let access = Access::from_bits(self.access).ok_or(libc::EINVAL)?;
        // SAFETY: a window and a region of this library (the application's
        // objects, alive while it posts with them).
        let (w, m) = unsafe { (&*mw, &*mr) };
        if self.rkey >> 8 != w.inner.rkey() >> 8 {
            ffi::debug(|| {
                format!(
                    "ibv_post_send (bind MW): rkey {:#x} does not name window {:#x}",
                    self.rkey,
                    w.inner.rkey()
                )
            });
            return Err(libc::EINVAL);
        }
        let wr = SendWr::new(
            wr_id,
            SendOp::BindMw {
                mw: &w.inner,
                mr: &m.inner,
                addr: self.addr,
                length: self.length,
                access,
                key: Some(self.rkey as u8),
            },
        )
        .flags(send_flags(flags));
        q.inner.post_send(&wr).map_err(|e| {
            ffi::debug(|| format!("ibv_post_send (bind MW): {e}"));
            post_send_errno(e)
        })?;
        // SAFETY: as above; the C view is the application's to read.
        unsafe { (*mw).mw.rkey = w.inner.rkey() };
        Ok(())
    }
}

/// Send flags of `ibv_send_wr`/`ibv_qp_ex` to the engine's.
pub fn send_flags(f: c_uint) -> SendFlags {
    let mut flags = SendFlags::NONE;
    if f & 1 != 0 {
        flags = flags | SendFlags::FENCE;
    }
    if f & 2 != 0 {
        flags = flags | SendFlags::SIGNALED;
    }
    if f & 4 != 0 {
        flags = flags | SendFlags::SOLICITED;
    }
    flags
}

/// The errno of a failed post.
pub fn post_send_errno(e: softrdma_engine::qp::PostSendError) -> i32 {
    use softrdma_engine::qp::PostSendError as E;
    match e {
        E::QueueFull { .. } => libc::ENOMEM,
        _ => libc::EINVAL,
    }
}

extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ours.
        let q = unsafe { &*qp.cast::<Qp>() };
        let mut w = wr;
        while !w.is_null() {
            // SAFETY: the caller's list.
            let r = unsafe { &*w };
            if let Err(e) = post_one(q, r) {
                if !bad.is_null() {
                    // SAFETY: caller's out pointer.
                    unsafe { *bad = w };
                }
                return e;
            }
            w = r.next;
        }
        0
    })
}

extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard(libc::EIO, || {
        if qp.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: ours.
        let q = unsafe { &*qp.cast::<Qp>() };
        post_recv_list(wr, bad, |r| {
            q.inner.post_recv(r).map_err(|e| {
                ffi::debug(|| format!("ibv_post_recv: {e}"));
                match e {
                    softrdma_engine::qp::PostRecvError::QueueFull { .. } => libc::ENOMEM,
                    _ => libc::EINVAL,
                }
            })
        })
    })
}

// ---- strings ----

/// `ibv_wc_status_str`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    const S: [&CStr; 24] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
        c"TM error",
        c"TM software rendezvous",
    ];
    usize::try_from(status)
        .ok()
        .and_then(|i| S.get(i))
        .unwrap_or(&c"unknown")
        .as_ptr()
}

/// `ibv_event_type_str`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_event_type_str(ev: c_int) -> *const c_char {
    const S: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    usize::try_from(ev)
        .ok()
        .and_then(|i| S.get(i))
        .unwrap_or(&c"unknown")
        .as_ptr()
}

/// `ibv_node_type_str`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_node_type_str(t: c_int) -> *const c_char {
    const S: [&CStr; 7] = [
        c"unknown",
        c"InfiniBand channel adapter",
        c"InfiniBand switch",
        c"InfiniBand router",
        c"iWARP NIC",
        c"usNIC",
        c"usNIC UDP",
    ];
    usize::try_from(t)
        .ok()
        .and_then(|i| S.get(i))
        .unwrap_or(&c"unknown")
        .as_ptr()
}

/// `ibv_port_state_str`.
#[unsafe(no_mangle)]
pub extern "C" fn ibv_port_state_str(s: c_int) -> *const c_char {
    const S: [&CStr; 6] = [
        c"PORT_NOP",
        c"PORT_DOWN",
        c"PORT_INIT",
        c"PORT_ARMED",
        c"PORT_ACTIVE",
        c"PORT_ACTIVE_DEFER",
    ];
    usize::try_from(s)
        .ok()
        .and_then(|i| S.get(i))
        .unwrap_or(&c"invalid state")
        .as_ptr()
}
