//! The `rdma_*` entry points of librdmacm, on the engine's connection
//! manager: asynchronous ids (on an application's event channel) and
//! synchronous ones (created with a NULL channel: each has a channel of its
//! own, and `rdma_resolve_addr`/`route`, `rdma_connect`, `rdma_accept` and
//! `rdma_get_request` return once the outcome's event arrived, as in
//! librdmacm).
//!
//! Each listening id has a thread taking connection requests from its
//! [`Listener`]; each connected id a thread turning its [`Connection`]'s
//! events into `rdma_cm_event`s. Both poll a `closed` flag every
//! [`POLL`] so `rdma_destroy_id` can stop them.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6, UdpSocket};
use std::ptr::null_mut;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use softrdma_engine::cm::{
    CmEvent, ConnRequest, ConnectConfig, Connection, ListenConfig, Listener,
};
use softrdma_engine::proto::mpa::MpaConfig;

use crate::abi::*;
use crate::ffi::{self, guard, guard_neg, set_errno};
use crate::verbs::{self, EventQueue, Qp};

/// How long an active connect is retried while the peer refuses the TCP
/// connection (see `watch`).
pub const REFUSED_RETRY: Duration = Duration::from_secs(2);

/// How often CM threads look at their id's `closed` flag.
pub const POLL: Duration = Duration::from_millis(20);

const PS_TCP: c_int = 0x0106;

// rdma_cm_event_type
const EV_ADDR_RESOLVED: c_int = 0;
const EV_ROUTE_RESOLVED: c_int = 2;
const EV_CONNECT_REQUEST: c_int = 4;
const EV_CONNECT_ERROR: c_int = 6;
const EV_UNREACHABLE: c_int = 7;
const EV_REJECTED: c_int = 8;
const EV_ESTABLISHED: c_int = 9;
const EV_DISCONNECTED: c_int = 10;

#[repr(C)]
struct Chan {
    c: rdma_event_channel,
    q: Arc<EventQueue<usize>>,
}

#[repr(C)]
struct Ev {
    e: rdma_cm_event,
    data: Vec<u8>,
}

#[derive(Default)]
struct IdState {
    closed: AtomicBool,
    unacked: AtomicU32,
    listener: Mutex<Option<Arc<Listener>>>,
    request: Mutex<Option<ConnRequest>>,
    conn: Mutex<Option<Connection>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    own_cqs: AtomicBool,
}

#[repr(C)]
struct Id {
    id: rdma_cm_id,
    st: Arc<IdState>,
    q: Arc<EventQueue<usize>>,
    /// A synchronous id (created without an event channel): `id.channel`
    /// is its own, and the calls wait for their outcome.
    sync: bool,
}

/// Addresses of objects handed to CM threads (they outlive the threads:
/// `rdma_destroy_id` joins them first).
#[derive(Clone, Copy)]
struct SendPtr(usize);

static CM_CTX: Mutex<Option<(u64, usize)>> = Mutex::new(None);

/// The context `cm_id->verbs` points to (one per process, as librdmacm
/// keeps one per device).
fn cm_ctx() -> Result<*mut ibv_context, i32> {
    let generation = ffi::fork_generation();
    let mut g = CM_CTX.lock();
    if let Some((g0, c)) = *g
        && g0 == generation
    {
        return Ok(c as *mut ibv_context);
    }
    let c = verbs::open_context()?;
    *g = Some((generation, c as usize));
    Ok(c)
}

fn to_storage(a: &SocketAddr) -> libc::sockaddr_storage {
    // SAFETY: sockaddr_storage is plain data; the sockaddr_in/in6 written
    // fit in it.
    unsafe {
        let mut s: libc::sockaddr_storage = std::mem::zeroed();
        match a {
            SocketAddr::V4(v) => {
                let p = (&raw mut s).cast::<libc::sockaddr_in>();
                (*p).sin_family = libc::AF_INET as libc::sa_family_t;
                (*p).sin_port = v.port().to_be();
                (*p).sin_addr.s_addr = u32::from_ne_bytes(v.ip().octets());
            }
            SocketAddr::V6(v) => {
                let p = (&raw mut s).cast::<libc::sockaddr_in6>();
                (*p).sin6_family = libc::AF_INET6 as libc::sa_family_t;
                (*p).sin6_port = v.port().to_be();
                (*p).sin6_addr.s6_addr = v.ip().octets();
                (*p).sin6_scope_id = v.scope_id();
            }
        }
        s
    }
}

/// Reads a `struct sockaddr` of the application.
///
/// # Safety
///
/// `p` is NULL or points to a sockaddr of its family's size.
unsafe fn from_sockaddr(p: *const libc::sockaddr) -> Option<SocketAddr> {
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    unsafe {
        match c_int::from((*p).sa_family) {
            libc::AF_INET => {
                let s = &*p.cast::<libc::sockaddr_in>();
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes()),
                    u16::from_be(s.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let s = &*p.cast::<libc::sockaddr_in6>();
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(s.sin6_addr.s6_addr),
                    u16::from_be(s.sin6_port),
                    0,
                    s.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

fn src_of(id: &Id) -> Option<SocketAddr> {
    // SAFETY: our own storage.
    unsafe { from_sockaddr((&raw const id.id.route.addr.src).cast()) }
}

fn dst_of(id: &Id) -> Option<SocketAddr> {
    // SAFETY: our own storage.
    unsafe { from_sockaddr((&raw const id.id.route.addr.dst).cast()) }
}

/// # Safety
///
/// `id` is an id of this library.
unsafe fn id_ref<'a>(id: *mut rdma_cm_id) -> &'a mut Id {
    // SAFETY: caller's contract; Id starts with rdma_cm_id.
    unsafe { &mut *id.cast::<Id>() }
}

#[allow(clippy::too_many_arguments)]
fn push_event(
    q: &EventQueue<usize>,
    st: &IdState,
    id: *mut rdma_cm_id,
    listen_id: *mut rdma_cm_id,
    ty: c_int,
    status: c_int,
    data: Vec<u8>,
    ird_ord: (u8, u8),
) {
    // SAFETY: rdma_cm_event is plain data.
    let mut e: rdma_cm_event = unsafe { std::mem::zeroed() };
    e.id = id;
    e.listen_id = listen_id;
    e.event = ty;
    e.status = status;
    let mut ev = Box::new(Ev { e, data });
    ev.e.conn.private_data = if ev.data.is_empty() {
        std::ptr::null()
    } else {
        ev.data.as_ptr().cast()
    };
    ev.e.conn.private_data_len = u8::try_from(ev.data.len()).unwrap_or(u8::MAX);
    ev.e.conn.responder_resources = ird_ord.0;
    ev.e.conn.initiator_depth = ird_ord.1;
    st.unacked.fetch_add(1, Ordering::AcqRel);
    q.push(Box::into_raw(ev) as usize);
}

fn spawn(st: &IdState, name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), i32> {
    let h = ffi::with_signals_blocked(|| std::thread::Builder::new().name(name.into()).spawn(f))
        .map_err(|_| libc::EAGAIN)?;
    st.threads.lock().push(h);
    Ok(())
}

// ---- channels ----

/// `rdma_create_event_channel`: a blocking descriptor (poll/epoll-able,
/// O_NONBLOCK honoured by `rdma_get_cm_event`).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    ffi::guard_ptr(|| {
        let q = Arc::new(EventQueue::new()?);
        Ok(Box::into_raw(Box::new(Chan {
            c: rdma_event_channel { fd: q.fd.0 },
            q,
        }))
        .cast())
    })
}

/// `rdma_destroy_event_channel`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    guard((), || {
        if !ch.is_null() {
            // SAFETY: a channel of ours, freed once.
            drop(unsafe { Box::from_raw(ch.cast::<Chan>()) });
        }
    });
}

/// `rdma_get_cm_event`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_cm_event(
    ch: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    guard_neg(|| {
        if ch.is_null() || event.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: a channel of ours.
        let q = unsafe { &(*ch.cast::<Chan>()).q };
        let p = q.pop()? as *mut Ev;
        // SAFETY: the event and its id are alive (ids wait for their
        // events to be acknowledged before going away).
        unsafe {
            (*(*p).e.id).event = p.cast();
            *event = p.cast();
        }
        Ok(())
    })
}

/// `rdma_ack_cm_event`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    guard_neg(|| {
        if event.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an event of ours, freed once.
        let ev = unsafe { Box::from_raw(event.cast::<Ev>()) };
        // SAFETY: the id is alive while it has unacknowledged events.
        let id = unsafe { id_ref(ev.e.id) };
        if id.id.event == event {
            id.id.event = null_mut();
        }
        id.st.unacked.fetch_sub(1, Ordering::AcqRel);
        Ok(())
    })
}

/// `rdma_event_str`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_event_str(event: c_int) -> *const c_char {
    const S: [&CStr; 16] = [
        c"RDMA_CM_EVENT_ADDR_RESOLVED",
        c"RDMA_CM_EVENT_ADDR_ERROR",
        c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        c"RDMA_CM_EVENT_ROUTE_ERROR",
        c"RDMA_CM_EVENT_CONNECT_REQUEST",
        c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        c"RDMA_CM_EVENT_CONNECT_ERROR",
        c"RDMA_CM_EVENT_UNREACHABLE",
        c"RDMA_CM_EVENT_REJECTED",
        c"RDMA_CM_EVENT_ESTABLISHED",
        c"RDMA_CM_EVENT_DISCONNECTED",
        c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        c"RDMA_CM_EVENT_MULTICAST_JOIN",
        c"RDMA_CM_EVENT_MULTICAST_ERROR",
        c"RDMA_CM_EVENT_ADDR_CHANGE",
        c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
    ];
    usize::try_from(event)
        .ok()
        .and_then(|i| S.get(i))
        .unwrap_or(&c"UNKNOWN EVENT")
        .as_ptr()
}

// ---- ids ----

fn new_id(
    chan: &Arc<EventQueue<usize>>,
    ch: *mut rdma_event_channel,
    context: *mut c_void,
    ps: c_int,
    sync: bool,
) -> *mut Id {
    // SAFETY: rdma_cm_id is plain data.
    let mut id: rdma_cm_id = unsafe { std::mem::zeroed() };
    id.channel = ch;
    id.context = context;
    id.ps = ps;
    id.qp_type = verbs::QPT_RC;
    Box::into_raw(Box::new(Id {
        id,
        st: Arc::new(IdState::default()),
        q: chan.clone(),
        sync,
    }))
}

/// A new channel for a synchronous id (freed with the id).
fn own_channel() -> Result<(*mut rdma_event_channel, Arc<EventQueue<usize>>), i32> {
    let ch = rdma_create_event_channel();
    if ch.is_null() {
        return Err(ffi::errno());
    }
    // SAFETY: just created by us.
    let q = unsafe { (*ch.cast::<Chan>()).q.clone() };
    Ok((ch, q))
}

/// For a synchronous id: takes the id's next event and acknowledges it;
/// an error unless it is `want` (its status as the errno, as librdmacm).
fn wait_sync(i: &Id, want: c_int) -> Result<(), i32> {
    if !i.sync {
        return Ok(());
    }
    let p = i.q.pop()? as *mut Ev;
    // SAFETY: an event of ours, alive until acknowledged below.
    let (ty, status) = unsafe { ((*p).e.event, (*p).e.status) };
    rdma_ack_cm_event(p.cast());
    if ty == want {
        Ok(())
    } else if status < 0 {
        Err(-status)
    } else {
        Err(libc::ECONNREFUSED)
    }
}

/// `rdma_create_id`: `RDMA_PS_TCP`, on an event channel or, with a NULL
/// channel, synchronous (UDP/IB port spaces: EOPNOTSUPP).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_id(
    ch: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: c_int,
) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        if ps != PS_TCP {
            return Err(libc::EOPNOTSUPP);
        }
        let p = if ch.is_null() {
            // Synchronous: a channel of its own; the calls wait.
            let (ch, q) = own_channel()?;
            new_id(&q, ch, context, ps, true)
        } else {
            // SAFETY: a channel of ours.
            let q = unsafe { &(*ch.cast::<Chan>()).q };
            new_id(q, ch, context, ps, false)
        };
        // SAFETY: caller's out pointer.
        unsafe { *id = p.cast() };
        Ok(())
    })
}

/// `rdma_destroy_id`: stops the id's threads, waits until its events are
/// acknowledged, closes its listener or connection handle (the QP must be
/// destroyed first, with `rdma_destroy_qp`).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        i.st.closed.store(true, Ordering::Release);
        let threads: Vec<_> = i.st.threads.lock().drain(..).collect();
        for t in threads {
            let _ = t.join();
        }
        // Events queued and not yet taken are withdrawn (freed here).
        i.q.retain(|&e| {
            // SAFETY: queued events are ours.
            let mine = unsafe { (*(e as *const Ev)).e.id } == id;
            if mine {
                // SAFETY: freed once (removed from the queue).
                drop(unsafe { Box::from_raw(e as *mut Ev) });
                i.st.unacked.fetch_sub(1, Ordering::AcqRel);
            }
            !mine
        });
        while i.st.unacked.load(Ordering::Acquire) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        // SAFETY: freed once.
        let b = unsafe { Box::from_raw(id.cast::<Id>()) };
        drop(b.st.request.lock().take());
        drop(b.st.listener.lock().take());
        drop(b.st.conn.lock().take());
        if b.sync {
            rdma_destroy_event_channel(b.id.channel);
        }
        Ok(())
    })
}

/// `rdma_bind_addr`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut libc::sockaddr) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the application's sockaddr.
        let mut a = unsafe { from_sockaddr(addr) }.ok_or(libc::EAFNOSUPPORT)?;
        if a.port() == 0 {
            // Applications read the port (rdma_get_src_port) between bind
            // and listen: pick a free one now. The listener binds it again
            // in rdma_listen (another process could take it in between;
            // rdma_listen then fails with EADDRINUSE).
            let l = std::net::TcpListener::bind(a)
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EADDRINUSE))?;
            a = l.local_addr().map_err(|_| libc::EADDRINUSE)?;
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        i.id.route.addr.src = to_storage(&a);
        i.id.port_num = 1;
        if !a.ip().is_unspecified() {
            i.id.verbs = cm_ctx()?;
        }
        Ok(())
    })
}

/// `rdma_listen`: a TCP listener on the bound address.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        let addr = src_of(i).unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        verbs::engine()?;
        let l = ffi::with_signals_blocked(|| {
            Listener::bind(
                addr,
                usize::try_from(backlog.max(8)).unwrap_or(8),
                ListenConfig::default(),
            )
        })
        .map_err(|e| match e {
            softrdma_engine::cm::CmError::Io(e) => e.raw_os_error().unwrap_or(libc::EADDRINUSE),
            _ => libc::EINVAL,
        })?;
        let local = l.local_addr();
        i.id.route.addr.src = to_storage(&local);
        let l = Arc::new(l);
        *i.st.listener.lock() = Some(l.clone());
        let st = i.st.clone();
        let q = i.q.clone();
        let me = SendPtr(id as usize);
        let ctx = SendPtr(cm_ctx()? as usize);
        spawn(&i.st, "softrdma-rdmacm-listen", move || {
            let (me, ctx) = (me, ctx);
            while !st.closed.load(Ordering::Acquire) {
                let Some(req) = l.get_request(Some(POLL)) else {
                    continue;
                };
                // SAFETY: the listening id is alive while this thread runs.
                let parent = unsafe { id_ref(me.0 as *mut rdma_cm_id) };
                // The request goes to the listener's channel; a synchronous
                // listener's new ids are synchronous with a channel each.
                let child = if parent.sync {
                    let Ok((ch, cq)) = own_channel() else {
                        drop(req.reject(&[]));
                        continue;
                    };
                    new_id(&cq, ch, parent.id.context, parent.id.ps, true)
                } else {
                    new_id(
                        &q,
                        parent.id.channel,
                        parent.id.context,
                        parent.id.ps,
                        false,
                    )
                };
                // SAFETY: just created.
                let c = unsafe { &mut *child };
                c.id.verbs = ctx.0 as *mut ibv_context;
                c.id.port_num = 1;
                let mut src = local;
                if src.ip().is_unspecified() {
                    src.set_ip(req.peer_addr().ip());
                }
                c.id.route.addr.src = to_storage(&src);
                c.id.route.addr.dst = to_storage(&req.peer_addr());
                let data = req.private_data().to_vec();
                let ird_ord = (
                    u8::try_from(req.ord().unwrap_or(1)).unwrap_or(u8::MAX),
                    u8::try_from(req.ird().unwrap_or(1)).unwrap_or(u8::MAX),
                );
                *c.st.request.lock() = Some(req);
                push_event(
                    &q,
                    &c.st,
                    child.cast(),
                    me.0 as *mut rdma_cm_id,
                    EV_CONNECT_REQUEST,
                    0,
                    data,
                    ird_ord,
                );
            }
        })?;
        Ok(())
    })
}

/// `rdma_resolve_addr`: records the destination, picks the source address
/// the host would route from, and queues ADDR_RESOLVED.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src: *mut libc::sockaddr,
    dst: *mut libc::sockaddr,
    _timeout_ms: c_int,
) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the application's sockaddrs.
        let d = unsafe { from_sockaddr(dst) }.ok_or(libc::EINVAL)?;
        // SAFETY: as above.
        let s = match unsafe { from_sockaddr(src) } {
            Some(s) => s,
            None => {
                let any: SocketAddr = if d.is_ipv4() {
                    "0.0.0.0:0".parse().map_err(|_| libc::EINVAL)?
                } else {
                    "[::]:0".parse().map_err(|_| libc::EINVAL)?
                };
                let u = UdpSocket::bind(any).map_err(|_| libc::EADDRNOTAVAIL)?;
                u.connect(d)
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::ENETUNREACH))?;
                let mut l = u.local_addr().map_err(|_| libc::EADDRNOTAVAIL)?;
                l.set_port(0);
                l
            }
        };
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        i.id.route.addr.src = to_storage(&s);
        i.id.route.addr.dst = to_storage(&d);
        i.id.verbs = cm_ctx()?;
        i.id.port_num = 1;
        push_event(
            &i.q,
            &i.st,
            id,
            null_mut(),
            EV_ADDR_RESOLVED,
            0,
            Vec::new(),
            (0, 0),
        );
        wait_sync(i, EV_ADDR_RESOLVED)
    })
}

/// `rdma_resolve_route`: nothing to resolve on iWARP; queues
/// ROUTE_RESOLVED.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        if dst_of(i).is_none() {
            return Err(libc::EINVAL);
        }
        push_event(
            &i.q,
            &i.st,
            id,
            null_mut(),
            EV_ROUTE_RESOLVED,
            0,
            Vec::new(),
            (0, 0),
        );
        wait_sync(i, EV_ROUTE_RESOLVED)
    })
}

fn ensure_pd_and_cqs(
    i: &mut Id,
    pd: *mut ibv_pd,
    send_cq: &mut *mut ibv_cq,
    recv_cq: &mut *mut ibv_cq,
) -> Result<*mut ibv_pd, i32> {
    if i.id.verbs.is_null() {
        return Err(libc::EINVAL);
    }
    let pd = if pd.is_null() { i.id.pd } else { pd };
    if pd.is_null() {
        return Err(libc::EINVAL);
    }
    if send_cq.is_null() || recv_cq.is_null() {
        // As librdmacm: a channel and a CQ per direction.
        for (cq, ch, which) in [
            (&mut i.id.recv_cq, &mut i.id.recv_cq_channel, 0),
            (&mut i.id.send_cq, &mut i.id.send_cq_channel, 1),
        ] {
            let _ = which;
            if cq.is_null() {
                *ch = verbs::ibv_create_comp_channel(i.id.verbs);
                if ch.is_null() {
                    return Err(ffi::errno());
                }
                *cq = verbs::ibv_create_cq(i.id.verbs, 256, i.id.context, *ch, 0);
                if cq.is_null() {
                    return Err(ffi::errno());
                }
            }
        }
        i.st.own_cqs.store(true, Ordering::Relaxed);
        if send_cq.is_null() {
            *send_cq = i.id.send_cq;
        }
        if recv_cq.is_null() {
            *recv_cq = i.id.recv_cq;
        }
    }
    Ok(pd)
}

fn attach_qp(i: &mut Id, qp: *mut ibv_qp, pd: *mut ibv_pd) {
    i.id.qp = qp;
    i.id.pd = pd;
    // SAFETY: a QP of ours; librdmacm moves iWARP QPs to INIT.
    unsafe {
        (*qp.cast::<Qp>()).idle_state.store(1, Ordering::Relaxed);
        (*qp).state = 1;
    }
}

/// `rdma_create_qp` (RC; creates CQs when the attributes name none).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> c_int {
    guard_neg(|| {
        if id.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ours / caller's.
        let (i, a) = unsafe { (id_ref(id), &mut *attr) };
        let pd = ensure_pd_and_cqs(i, pd, &mut a.send_cq, &mut a.recv_cq)?;
        // SAFETY: the application's objects of this library.
        let qp = unsafe {
            verbs::create_qp_common(
                pd,
                a.qp_context,
                a.send_cq,
                a.recv_cq,
                a.srq,
                &mut a.cap,
                a.qp_type,
                a.sq_sig_all,
            )
        }?;
        attach_qp(i, qp, pd);
        Ok(())
    })
}

/// `rdma_create_qp_ex`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_create_qp_ex(id: *mut rdma_cm_id, attr: *mut ibv_qp_init_attr_ex) -> c_int {
    guard_neg(|| {
        if id.is_null() || attr.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: ours / caller's.
        let (i, a) = unsafe { (id_ref(id), &mut *attr) };
        let pd = ensure_pd_and_cqs(i, a.pd, &mut a.send_cq, &mut a.recv_cq)?;
        a.pd = pd;
        a.comp_mask |= 1;
        let qp = verbs::create_qp_from_ex(a)?;
        attach_qp(i, qp, pd);
        Ok(())
    })
}

/// `rdma_destroy_qp`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    guard((), || {
        if id.is_null() {
            return;
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        if !i.id.qp.is_null() {
            verbs::ibv_destroy_qp(i.id.qp);
            i.id.qp = null_mut();
        }
        if i.st.own_cqs.swap(false, Ordering::Relaxed) {
            for cq in [&mut i.id.send_cq, &mut i.id.recv_cq] {
                if !cq.is_null() {
                    verbs::ibv_destroy_cq(*cq);
                    *cq = null_mut();
                }
            }
            for ch in [&mut i.id.send_cq_channel, &mut i.id.recv_cq_channel] {
                if !ch.is_null() {
                    verbs::ibv_destroy_comp_channel(*ch);
                    *ch = null_mut();
                }
            }
        }
    });
}

/// How long an active side holds its ESTABLISHED event after the MPA
/// Reply: `SOFTRDMA_CONNECT_SETTLE_MS` (default 0).
///
/// For peers that cannot take an FPDU right after their Reply: kernel siw
/// (Linux 6.1) as the responder sends the Reply and only then installs
/// its receive callback on the socket (`siw_accept` in
/// `drivers/infiniband/sw/siw/siw_cm.c`); a first message that arrives in
/// between stays unread until more bytes come, and an application that
/// sends one message and waits for the answer (rping) hangs. On real
/// hardware that window lasts microseconds; on a slow (emulated) siw host
/// it can last milliseconds.
fn connect_settle() -> Duration {
    static SETTLE: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SETTLE.get_or_init(|| {
        std::env::var("SOFTRDMA_CONNECT_SETTLE_MS")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Duration::ZERO, Duration::from_millis)
    })
}

/// Starts the thread turning a connection's events into CM events.
///
/// `retry`: for an active connect, what to connect again with when the
/// peer refuses the TCP connection within [`REFUSED_RETRY`] (an
/// application may tell its peer the port between `rdma_bind_addr` and
/// `rdma_listen`; a kernel listener would queue the SYN in that window).
fn watch(
    i: &Id,
    id: *mut rdma_cm_id,
    conn: Connection,
    retry: Option<(softrdma_engine::QueuePair, SocketAddr, ConnectConfig)>,
) -> Result<(), i32> {
    let st = i.st.clone();
    let q = i.q.clone();
    let me = SendPtr(id as usize);
    spawn(&i.st, "softrdma-rdmacm-conn", move || {
        let me = me;
        let id = me.0 as *mut rdma_cm_id;
        let mut conn = conn;
        let started = std::time::Instant::now();
        while !st.closed.load(Ordering::Acquire) {
            let Some(ev) = conn.wait_event(Some(POLL)) else {
                continue;
            };
            ffi::debug(|| format!("connection event {ev:?}"));
            if ev == CmEvent::Refused
                && started.elapsed() < REFUSED_RETRY
                && let Some((qp, dst, config)) = &retry
            {
                std::thread::sleep(Duration::from_millis(10));
                if let Ok(c) = Connection::start(qp, *dst, config.clone()) {
                    *st.conn.lock() = Some(c.clone());
                    conn = c;
                    continue;
                }
            }
            if matches!(ev, CmEvent::Established { .. }) && retry.is_some() {
                let settle = connect_settle();
                if !settle.is_zero() {
                    std::thread::sleep(settle);
                }
            }
            let (ty, status, data, end) = match ev {
                CmEvent::Established { .. } => (
                    EV_ESTABLISHED,
                    0,
                    conn.peer_private_data().unwrap_or_default(),
                    false,
                ),
                CmEvent::Rejected { private_data } => {
                    (EV_REJECTED, -libc::ECONNREFUSED, private_data, true)
                }
                // As the kernel's iWARP CM: a refused TCP connection is
                // REJECTED, an unreachable peer UNREACHABLE.
                CmEvent::Refused => (EV_REJECTED, -libc::ECONNREFUSED, Vec::new(), true),
                CmEvent::Unreachable => (EV_UNREACHABLE, -libc::EHOSTUNREACH, Vec::new(), true),
                CmEvent::TimedOut => (EV_UNREACHABLE, -libc::ETIMEDOUT, Vec::new(), true),
                CmEvent::Disconnected { .. } => (EV_DISCONNECTED, 0, Vec::new(), true),
                _ => (EV_CONNECT_ERROR, -libc::ECONNRESET, Vec::new(), true),
            };
            let n = conn.negotiated();
            let ird_ord = n.map_or((0, 0), |n| {
                (
                    u8::try_from(n.peer_ord.unwrap_or(0)).unwrap_or(u8::MAX),
                    u8::try_from(n.peer_ird.unwrap_or(0)).unwrap_or(u8::MAX),
                )
            });
            push_event(&q, &st, id, null_mut(), ty, status, data, ird_ord);
            if end {
                break;
            }
        }
    })
}

fn conn_param<'a>(p: *mut rdma_conn_param) -> Option<&'a rdma_conn_param> {
    // SAFETY: NULL or the application's parameters.
    unsafe { p.as_ref() }
}

fn private_data(p: Option<&rdma_conn_param>) -> Vec<u8> {
    match p {
        Some(p) if !p.private_data.is_null() && p.private_data_len > 0 => {
            // SAFETY: the application's buffer of private_data_len bytes.
            unsafe {
                std::slice::from_raw_parts(
                    p.private_data.cast::<u8>(),
                    usize::from(p.private_data_len),
                )
            }
            .to_vec()
        }
        _ => Vec::new(),
    }
}

/// `rdma_connect`: MPA connect on a thread; the outcome is an event.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_connect(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        if i.id.qp.is_null() {
            return Err(libc::EINVAL);
        }
        let dst = dst_of(i).ok_or(libc::EINVAL)?;
        let p = conn_param(param);
        let (ird, ord) = p.map_or((16, 16), |p| {
            (
                u16::from(p.responder_resources),
                u16::from(p.initiator_depth),
            )
        });
        let config = ConnectConfig {
            mpa: MpaConfig {
                ird,
                ord,
                ..MpaConfig::default()
            },
            private_data: private_data(p),
            ..ConnectConfig::default()
        };
        // SAFETY: a QP of ours.
        let qp = unsafe { &(*i.id.qp.cast::<Qp>()).inner };
        let conn = ffi::with_signals_blocked(|| Connection::start(qp, dst, config.clone()))
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        *i.st.conn.lock() = Some(conn.clone());
        watch(i, id, conn, Some((qp.clone(), dst, config)))?;
        wait_sync(i, EV_ESTABLISHED)
    })
}

/// `rdma_accept`: answers the connection request with the id's QP.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_accept(id: *mut rdma_cm_id, param: *mut rdma_conn_param) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        if i.id.qp.is_null() {
            return Err(libc::EINVAL);
        }
        let req = i.st.request.lock().take().ok_or(libc::EINVAL)?;
        let p = conn_param(param);
        let (ird, ord) = p.map_or((req.ord().unwrap_or(16), req.ird().unwrap_or(16)), |p| {
            (
                u16::from(p.responder_resources),
                u16::from(p.initiator_depth),
            )
        });
        let data = private_data(p);
        // SAFETY: a QP of ours.
        let qp = unsafe { &(*i.id.qp.cast::<Qp>()).inner };
        let conn = ffi::with_signals_blocked(|| req.accept(qp, &data, ird, ord)).map_err(|e| {
            ffi::debug(|| format!("rdma_accept (ird {ird}, ord {ord}): {e}"));
            match e {
                softrdma_engine::cm::CmError::TimedOut => libc::ETIMEDOUT,
                softrdma_engine::cm::CmError::PeerClosed => libc::ECONNRESET,
                _ => libc::EINVAL,
            }
        })?;
        *i.st.conn.lock() = Some(conn.clone());
        watch(i, id, conn, None)?;
        wait_sync(i, EV_ESTABLISHED)
    })
}

/// `rdma_reject`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_reject(id: *mut rdma_cm_id, data: *const c_void, len: u8) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        let req = i.st.request.lock().take().ok_or(libc::EINVAL)?;
        let d = if data.is_null() || len == 0 {
            Vec::new()
        } else {
            // SAFETY: the application's buffer.
            unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }.to_vec()
        };
        req.reject(&d).map_err(|_| libc::EINVAL)
    })
}

/// `rdma_disconnect`: graceful close of the connection (DISCONNECTED
/// follows once the QP has left RTS).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    guard_neg(|| {
        if id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let i = unsafe { id_ref(id) };
        let conn = i.st.conn.lock().clone().ok_or(libc::ENOTCONN)?;
        // The FIN waits for the peer's acknowledgement of what was sent, as
        // `ibv_destroy_qp`'s close does (kernel siw fails a Send it is still
        // completing when a FIN arrives); the call returns at once.
        if conn
            .qp()
            .disconnect_acknowledged(crate::verbs::DESTROY_LINGER)
            .is_err()
        {
            // Not in RTS any more (peer closed, error): nothing to close.
        }
        Ok(())
    })
}

/// `rdma_establish`: nothing to do on iWARP.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_establish(_id: *mut rdma_cm_id) -> c_int {
    0
}

/// `rdma_init_qp_attr`: INIT and RTR attributes as the iWARP CM gives
/// them; RTS: EINVAL (as `iw_cm_init_qp_attr`).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    attr: *mut ibv_qp_attr,
    mask: *mut c_int,
) -> c_int {
    guard_neg(|| {
        if id.is_null() || attr.is_null() || mask.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: the caller's structs.
        let (a, m) = unsafe { (&mut *attr, &mut *mask) };
        match a.qp_state {
            1 => {
                a.port_num = 1;
                a.qp_access_flags = 1 | 2 | 4;
                *m = 1 | 8 | 32; // STATE | ACCESS_FLAGS | PORT
                Ok(())
            }
            2 => {
                *m = 1;
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    })
}

/// `rdma_set_option`: TOS, REUSEADDR, AFONLY and the others are accepted
/// and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    _level: c_int,
    _opt: c_int,
    _val: *mut c_void,
    _len: usize,
) -> c_int {
    if id.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    0
}

fn port_of(s: *const libc::sockaddr_storage) -> u16 {
    // SAFETY: our own storage.
    unsafe { from_sockaddr(s.cast()) }.map_or(0, |a| a.port().to_be())
}

/// `rdma_get_src_port` (network order).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    if id.is_null() {
        return 0;
    }
    // SAFETY: an id of ours.
    port_of(unsafe { &raw const (*id).route.addr.src })
}

/// `rdma_get_dst_port` (network order).
#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    if id.is_null() {
        return 0;
    }
    // SAFETY: an id of ours.
    port_of(unsafe { &raw const (*id).route.addr.dst })
}

/// `rdma_get_devices`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_devices(num: *mut c_int) -> *mut *mut ibv_context {
    ffi::guard_ptr(|| {
        let c = cm_ctx()?;
        // SAFETY: a NULL-terminated array from calloc.
        let list = unsafe { libc::calloc(2, size_of::<usize>()) } as *mut *mut ibv_context;
        if list.is_null() {
            return Err(libc::ENOMEM);
        }
        // SAFETY: two entries; caller's int or NULL.
        unsafe {
            *list = c;
            if !num.is_null() {
                *num = 1;
            }
        }
        Ok(list)
    })
}

/// `rdma_free_devices`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    // SAFETY: from rdma_get_devices or NULL.
    unsafe { libc::free(list.cast()) };
}

/// `rpoll`: rsockets are not provided; for ordinary descriptors this is
/// `poll(2)`.
#[unsafe(no_mangle)]
pub extern "C" fn rpoll(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int {
    // SAFETY: forwarded as is.
    unsafe { libc::poll(fds, nfds, timeout) }
}

// ---- rdma_getaddrinfo ----

const RAI_PASSIVE: c_int = 1;

/// `rdma_getaddrinfo`: one entry (the first address `getaddrinfo`
/// gives), RC over `RDMA_PS_TCP`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    guard_neg(|| {
        if res.is_null() || (node.is_null() && service.is_null()) {
            return Err(libc::EINVAL);
        }
        // SAFETY: NULL or the application's hints.
        let h = unsafe { hints.as_ref() };
        let flags = h.map_or(0, |h| h.ai_flags);
        let passive = flags & RAI_PASSIVE != 0;
        // SAFETY: addrinfo is plain data.
        let mut ah: libc::addrinfo = unsafe { std::mem::zeroed() };
        ah.ai_family = h.map_or(0, |h| h.ai_family);
        ah.ai_socktype = libc::SOCK_STREAM;
        if passive {
            ah.ai_flags |= libc::AI_PASSIVE;
        }
        if flags & 2 != 0 {
            ah.ai_flags |= libc::AI_NUMERICHOST;
        }
        let mut out: *mut libc::addrinfo = null_mut();
        // SAFETY: C strings of the caller; freed below.
        let rc = unsafe { libc::getaddrinfo(node, service, &ah, &mut out) };
        if rc != 0 || out.is_null() {
            return Err(libc::EADDRNOTAVAIL);
        }
        // SAFETY: the first entry of the list just returned.
        let a = unsafe { from_sockaddr((*out).ai_addr) };
        // SAFETY: freeing getaddrinfo's list.
        unsafe { libc::freeaddrinfo(out) };
        let a = a.ok_or(libc::EAFNOSUPPORT)?;
        // SAFETY: calloc'ed, freed by rdma_freeaddrinfo.
        unsafe {
            let r = libc::calloc(1, size_of::<rdma_addrinfo>()).cast::<rdma_addrinfo>();
            let s = libc::calloc(1, size_of::<libc::sockaddr_storage>())
                .cast::<libc::sockaddr_storage>();
            if r.is_null() || s.is_null() {
                libc::free(r.cast());
                libc::free(s.cast());
                return Err(libc::ENOMEM);
            }
            *s = to_storage(&a);
            let len = if a.is_ipv4() {
                size_of::<libc::sockaddr_in>()
            } else {
                size_of::<libc::sockaddr_in6>()
            } as libc::socklen_t;
            (*r).ai_flags = flags;
            (*r).ai_family = if a.is_ipv4() {
                libc::AF_INET
            } else {
                libc::AF_INET6
            };
            (*r).ai_qp_type = verbs::QPT_RC;
            (*r).ai_port_space = PS_TCP;
            if passive {
                (*r).ai_src_addr = s.cast();
                (*r).ai_src_len = len;
            } else {
                (*r).ai_dst_addr = s.cast();
                (*r).ai_dst_len = len;
            }
            *res = r;
        }
        Ok(())
    })
}

/// `rdma_freeaddrinfo`.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    let mut r = res;
    while !r.is_null() {
        // SAFETY: entries from rdma_getaddrinfo.
        unsafe {
            let next = (*r).ai_next;
            libc::free((*r).ai_src_addr.cast());
            libc::free((*r).ai_dst_addr.cast());
            libc::free(r.cast());
            r = next;
        }
    }
}

/// `rdma_get_request`: the next connection request of a synchronous
/// listening id (blocks); the new id is synchronous too.
#[unsafe(no_mangle)]
pub extern "C" fn rdma_get_request(listen: *mut rdma_cm_id, id: *mut *mut rdma_cm_id) -> c_int {
    guard_neg(|| {
        if listen.is_null() || id.is_null() {
            return Err(libc::EINVAL);
        }
        // SAFETY: an id of ours.
        let l = unsafe { id_ref(listen) };
        if !l.sync || l.st.listener.lock().is_none() {
            return Err(libc::EINVAL);
        }
        loop {
            let p = l.q.pop()? as *mut Ev;
            // SAFETY: an event of ours, alive until acknowledged below.
            let (ty, new) = unsafe { ((*p).e.event, (*p).e.id) };
            rdma_ack_cm_event(p.cast());
            if ty == EV_CONNECT_REQUEST {
                // SAFETY: caller's out pointer.
                unsafe { *id = new };
                return Ok(());
            }
        }
    })
}
