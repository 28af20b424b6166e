//! Service points, connection requests, and the per-IA connection
//! reactor.
//!
//! One thread per IA serves every listener, connection and retry timer of
//! the IA from one `poll(2)` loop, plus the device's asynchronous events:
//! this layer costs no thread per connection. (The engine's connection
//! manager underneath still runs a thread per connect, per incoming
//! handshake and per established connection.)

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustix::event::{PollFd, PollFlags};
use softrdma_engine::cm::{CmEvent, ConnRequest, Connection, ListenConfig, Listener};
use softrdma_engine::{AsyncEventKind, Device, QpState};
use softrdma_proto::dat::addr;
use softrdma_proto::dat::ep::{self as rules, EpEvent, EpPolicy, EpState};
use softrdma_proto::dat::sp::{OnRequest, SpKind, SpState, on_request};

use crate::ep::{Ep, EpInner};
use crate::evd::{AsyncKind, Evd, EvdFlags, Event};
use crate::fd::Signal;
use crate::ia::{Ia, IaInner, ObjRef};
use crate::{ErrorType, Result, Subtype, err};

/// The engine's private data cap (Linux siw's).
pub(crate) const ENGINE_PDATA_CAP: usize = 256;

/// Prefix of the private data of a consumer's reject, so the initiator
/// tells it from a provider's (`PEER_REJECTED` vs `NON_PEER_REJECTED`).
pub(crate) const REJECT_MAGIC: [u8; 4] = *b"sRdJ";

const MAX_BACKOFF: Duration = Duration::from_millis(500);

#[derive(Debug, Default)]
struct Registry {
    sps: Vec<Weak<SpInner>>,
    conns: Vec<(Weak<EpInner>, Connection)>,
    eps: HashMap<u32, Weak<EpInner>>,
    timers: Vec<(Instant, Weak<EpInner>)>,
}

#[derive(Debug)]
struct RShared {
    reg: Mutex<Registry>,
    wake: Signal,
    stop: AtomicBool,
    device: Device,
    ia: Mutex<Weak<IaInner>>,
}

/// The per-IA connection reactor.
#[derive(Debug)]
pub(crate) struct Reactor {
    shared: Arc<RShared>,
    thread: Mutex<Option<(JoinHandle<()>, ThreadId)>>,
}

impl Reactor {
    pub(crate) fn start(device: &Device) -> std::io::Result<Reactor> {
        let shared = Arc::new(RShared {
            reg: Mutex::new(Registry::default()),
            wake: Signal::new()?,
            stop: AtomicBool::new(false),
            device: device.clone(),
            ia: Mutex::new(Weak::new()),
        });
        let s = shared.clone();
        let h = std::thread::Builder::new()
            .name("softrdma-dat-cm".into())
            .spawn(move || run(&s))?;
        let id = h.thread().id();
        Ok(Reactor {
            shared,
            thread: Mutex::new(Some((h, id))),
        })
    }

    pub(crate) fn attach(&self, ia: Weak<IaInner>) {
        *self.shared.ia.lock() = ia;
    }

    pub(crate) fn wake(&self) {
        self.shared.wake.raise();
    }

    pub(crate) fn add_ep(&self, qpn: u32, ep: Weak<EpInner>) {
        self.shared.reg.lock().eps.insert(qpn, ep);
    }

    pub(crate) fn remove_ep(&self, ep: &Arc<EpInner>) {
        let mut r = self.shared.reg.lock();
        r.eps.remove(&ep.qp.qp_num());
        r.conns.retain(|(w, _)| w.as_ptr() != Arc::as_ptr(ep));
        r.timers.retain(|(_, w)| w.as_ptr() != Arc::as_ptr(ep));
    }

    pub(crate) fn add_conn(&self, ep: Weak<EpInner>, conn: Connection) {
        self.shared.reg.lock().conns.push((ep, conn));
        self.wake();
    }

    fn add_sp(&self, sp: Weak<SpInner>) {
        self.shared.reg.lock().sps.push(sp);
        self.wake();
    }

    fn add_timer(&self, at: Instant, ep: Weak<EpInner>) {
        self.shared.reg.lock().timers.push((at, ep));
        self.wake();
    }

    fn find_sp(&self, conn_qual: u64) -> Option<Arc<SpInner>> {
        let r = self.shared.reg.lock();
        r.sps
            .iter()
            .filter_map(Weak::upgrade)
            .find(|s| s.conn_qual == conn_qual)
    }

    /// Resets every connection of the IA (abrupt close).
    pub(crate) fn abort_all(&self) {
        let conns: Vec<Connection> = self
            .shared
            .reg
            .lock()
            .conns
            .iter()
            .map(|(_, c)| c.clone())
            .collect();
        for c in conns {
            c.abort();
        }
    }

    /// Stops the thread and joins it (unless called from it).
    pub(crate) fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.wake();
        if let Some((h, id)) = self.thread.lock().take() {
            if std::thread::current().id() == id {
                return;
            }
            let _ = h.join();
        }
    }
}

fn run(s: &Arc<RShared>) {
    while !s.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        let (sps, conns, timeout) = {
            let mut r = s.reg.lock();
            r.sps.retain(|w| w.strong_count() > 0);
            r.conns.retain(|(w, _)| w.strong_count() > 0);
            r.timers.retain(|(_, w)| w.strong_count() > 0);
            let sps: Vec<Arc<SpInner>> = r.sps.iter().filter_map(Weak::upgrade).collect();
            let conns = r.conns.clone();
            let next = r.timers.iter().map(|(t, _)| *t).min();
            let timeout = next.map(|t| t.saturating_duration_since(now));
            (sps, conns, timeout)
        };
        {
            let listeners: Vec<Arc<Listener>> = sps
                .iter()
                .filter_map(|sp| sp.listener.lock().clone())
                .collect();
            let mut fds = Vec::with_capacity(2 + sps.len() + conns.len());
            fds.push(PollFd::new(&s.wake, PollFlags::IN));
            fds.push(PollFd::from_borrowed_fd(
                s.device.async_events().fd(),
                PollFlags::IN,
            ));
            for l in &listeners {
                fds.push(PollFd::from_borrowed_fd(l.fd(), PollFlags::IN));
            }
            for (_, c) in &conns {
                fds.push(PollFd::from_borrowed_fd(c.fd(), PollFlags::IN));
            }
            let ts = timeout.map(|t| rustix::time::Timespec {
                tv_sec: t.as_secs() as i64,
                tv_nsec: i64::from(t.subsec_nanos()),
            });
            let _ = rustix::event::poll(&mut fds, ts.as_ref());
        }
        // Read every round: raisers share no lock with this thread, and a
        // raise written after a clear leaves the descriptor readable under
        // a lowered flag, which `clear` would skip (the poll above would
        // return at once round after round); `fd.rs`'s test
        // `regression_a_raise_written_after_a_clear_left_the_descriptor_readable_with_the_flag_down`.
        s.wake.drain();
        if s.stop.load(Ordering::Acquire) {
            break;
        }
        let ia = s.ia.lock().upgrade();
        while let Some(ev) = s.device.async_events().try_get() {
            if matches!(
                ev.kind,
                AsyncEventKind::LlpClosed | AsyncEventKind::LlpReset | AsyncEventKind::BadClose
            ) {
                // The connection's end, in the order the data path saw
                // it (the connection's own Disconnected event comes later,
                // from a sampling thread, and is then a no-op).
                let ep = ev
                    .qp_num
                    .and_then(|q| s.reg.lock().eps.get(&q).and_then(Weak::upgrade));
                if let Some(ep) = ep {
                    // Its ESTABLISHED first, if the connection manager has
                    // it queued still (a peer that closes at once).
                    drain_conn_events(&ep);
                    // A failed connection (reset, bad close) of an SRQ EP
                    // enters ERROR, and LAST_WQE_REACHED follows: its end
                    // is reported together with that (below).
                    if !(ep.has_srq() && ev.kind != AsyncEventKind::LlpClosed) {
                        on_llp_end(&ep);
                    }
                }
                continue;
            }
            let kind = match ev.kind {
                AsyncEventKind::QpFatal
                | AsyncEventKind::QpRequestError
                | AsyncEventKind::QpAccessError
                | AsyncEventKind::TerminateReceived => AsyncKind::EpBroken,
                // The last receive of an SRQ EP that left the connected
                // state was consumed or flushed: DAT consumers (dtestsrq)
                // wait for it on the async EVD before freeing the EP.
                AsyncEventKind::QpLastWqeReached => AsyncKind::EpBroken,
                AsyncEventKind::DeviceFatal => AsyncKind::IaCatastrophic,
                AsyncEventKind::CqError => AsyncKind::EvdOverflow,
                _ => continue,
            };
            let ep = ev
                .qp_num
                .and_then(|q| s.reg.lock().eps.get(&q).and_then(Weak::upgrade));
            if let Some(ep) = &ep {
                if ev.kind == AsyncEventKind::QpLastWqeReached {
                    ep.last_wqe.store(true, Ordering::Release);
                    drain_conn_events(ep);
                    // The connection's end first, then the async event, both
                    // from here: consumers (dtestsrq) take a connection event
                    // and then an async event and expect the same EP. The
                    // data path pushes "link reset" and LAST_WQE_REACHED of
                    // two QPs from two threads, so reporting the end at the
                    // reset could order the two queues differently.
                    on_llp_end(ep);
                } else {
                    ep.fatal.store(true, Ordering::Release);
                }
            }
            if let Some(a) = ia.as_ref().and_then(|ia| ia.async_evd()) {
                a.push(Event::Async {
                    kind,
                    ep: ep.map(|inner| Ep { inner }),
                    evd: None,
                });
            }
        }
        for sp in &sps {
            loop {
                let l = sp.listener.lock().clone();
                let req = match l {
                    Some(l) => {
                        while let Some(e) = l.try_event() {
                            if debug() {
                                eprintln!("softrdma-dat: listener {}: {e:?}", sp.conn_qual);
                            }
                        }
                        l.try_get_request()
                    }
                    None => None,
                };
                match req {
                    Some(req) => SpInner::on_request(sp, req),
                    None => break,
                }
            }
        }
        drop(sps);
        let mut done = HashSet::new();
        for (w, c) in &conns {
            while let Some(ev) = c.try_event() {
                let terminal = !matches!(ev, CmEvent::Established { .. });
                if let Some(ep) = w.upgrade() {
                    on_cm_event(&ep, c, ev);
                }
                if terminal {
                    done.insert(c.fd().as_raw_fd());
                }
            }
        }
        drop(conns);
        if !done.is_empty() {
            s.reg
                .lock()
                .conns
                .retain(|(_, c)| !done.contains(&c.fd().as_raw_fd()));
        }
        let now = Instant::now();
        let due: Vec<Weak<EpInner>> = {
            let mut r = s.reg.lock();
            let (due, keep): (Vec<_>, Vec<_>) = r.timers.drain(..).partition(|(t, _)| *t <= now);
            r.timers = keep;
            due.into_iter().map(|(_, w)| w).collect()
        };
        for w in due {
            if let Some(ep) = w.upgrade() {
                let ok = {
                    let mut c = ep.conn.lock();
                    match rules::step(c.state, EpEvent::RetryDue, EpPolicy::default()) {
                        Ok(st) => {
                            c.state = st.next;
                            true
                        }
                        Err(_) => false,
                    }
                };
                if ok {
                    ep.start_attempt();
                }
            }
        }
    }
}

/// `SOFTRDMA_DAT_DEBUG=1` traces connection events on stderr.
fn debug() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SOFTRDMA_DAT_DEBUG").is_some())
}

fn same(a: &Connection, b: &Connection) -> bool {
    a.fd().as_raw_fd() == b.fd().as_raw_fd()
}

/// What a connect that found no route or no answer reports: TIMED_OUT if
/// the connect timeout (`deadline`) is what ended it, else UNREACHABLE.
fn unreachable_event(now: Instant, deadline: Option<Instant>) -> EpEvent {
    if deadline.is_some_and(|d| now >= d) {
        EpEvent::TimedOut
    } else {
        EpEvent::Unreachable
    }
}

/// Handles the events the EP's connection has queued now.
fn drain_conn_events(ep: &Arc<EpInner>) {
    let conn = ep.conn.lock().conn.clone();
    if let Some(conn) = conn {
        while let Some(ev) = conn.try_event() {
            on_cm_event(ep, &conn, ev);
        }
    }
}

/// The transport connection of a connected EP ended.
fn on_llp_end(ep: &Arc<EpInner>) {
    let mut c = ep.conn.lock();
    if !matches!(c.state, EpState::Connected | EpState::DisconnectPending) {
        return;
    }
    if ep.qp.state() == QpState::Rts {
        // The event is older than the connection: the EP was reset and
        // connected again before this thread saw it. (A "link reset" event
        // can also come just before its QP leaves RTS: the connection
        // manager's Disconnected then reports the end.)
        return;
    }
    let e = if ep.fatal.load(Ordering::Acquire) {
        EpEvent::Broken
    } else {
        EpEvent::Closed
    };
    if debug() {
        eprintln!(
            "softrdma-dat: qp {} state {:?}: LLP end",
            ep.qp.qp_num(),
            c.state
        );
    }
    if let Ok(st) = rules::step(c.state, e, EpPolicy::default()) {
        c.state = st.next;
        drop(c);
        if let Some(r) = st.report {
            ep.report(r, Vec::new());
        }
    }
}

fn on_cm_event(ep: &Arc<EpInner>, conn: &Connection, ev: CmEvent) {
    let ia = &ep.ia.0;
    if debug() {
        eprintln!(
            "softrdma-dat: qp {} state {:?}: {ev:?}",
            ep.qp.qp_num(),
            ep.conn.lock().state
        );
    }
    let policy = EpPolicy {
        retry_refused: ia.config.connect_retry.is_some(),
    };
    let mut c = ep.conn.lock();
    if !c.conn.as_ref().is_some_and(|x| same(x, conn)) {
        // A connection the EP gave up on (disconnected or reset since).
        if matches!(ev, CmEvent::Established { .. }) {
            conn.abort();
        }
        return;
    }
    let mut pdata = Vec::new();
    if matches!(ev, CmEvent::Established { .. }) && c.state == EpState::Connected {
        // The passive side reported it when the accept returned.
        return;
    }
    let passive = c.state == EpState::PassiveConnectionPending;
    let e = match ev {
        CmEvent::Established { peer } => {
            c.remote = Some(peer);
            if !passive {
                pdata = conn.peer_private_data().unwrap_or_default();
            }
            EpEvent::Established
        }
        // The handshake of an accepted request failed.
        _ if passive => EpEvent::AcceptFailed,
        CmEvent::Rejected { private_data } => {
            if private_data.starts_with(&REJECT_MAGIC) {
                pdata = private_data[REJECT_MAGIC.len()..].to_vec();
                EpEvent::PeerRejected
            } else {
                EpEvent::NonPeerRejected
            }
        }
        CmEvent::Unreachable => unreachable_event(Instant::now(), c.target.as_ref().map(|t| t.2)),
        CmEvent::Refused => {
            let now = Instant::now();
            let budget_left = c.retry_until.is_some_and(|t| now + c.backoff < t);
            let deadline = c.target.as_ref().map(|t| t.2);
            if !budget_left && c.retry_until.is_some() && c.retry_until == deadline {
                // Retrying until the connect timeout: the timeout ran out.
                EpEvent::TimedOut
            } else {
                EpEvent::Refused { budget_left }
            }
        }
        CmEvent::TimedOut => EpEvent::TimedOut,
        CmEvent::Disconnected { .. } if ep.has_srq() && !ep.last_wqe.load(Ordering::Acquire) => {
            // Reported from the device's events: LLP_CLOSED (graceful) or
            // LAST_WQE_REACHED (ERROR), see `run`. The connection manager
            // can see the end before the data path has entered ERROR.
            // (If LAST_WQE_REACHED came while the EP was still waiting for
            // its ESTABLISHED, this event reports the end.)
            return;
        }
        CmEvent::Disconnected { .. } => {
            // A Terminate (sent or received) ended it: its async event is
            // queued before this (the QP records the Terminate and raises
            // the event before it enters ERROR), but this thread may have
            // looked at the async events just before it came.
            if ep.fatal.load(Ordering::Acquire) || ep.qp.last_terminate().is_some() {
                EpEvent::Broken
            } else {
                EpEvent::Closed
            }
        }
        _ => {
            if c.state == EpState::Connected {
                EpEvent::Broken
            } else {
                EpEvent::NonPeerRejected
            }
        }
    };
    match rules::step(c.state, e, policy) {
        Ok(st) => {
            c.state = st.next;
            if st.next == EpState::ConnectRetry {
                let at = Instant::now() + c.backoff;
                c.backoff = (c.backoff * 2).min(MAX_BACKOFF);
                c.conn = None;
                drop(c);
                ia.reactor.add_timer(at, ep.weak());
            } else {
                drop(c);
            }
            if let Some(r) = st.report {
                ep.report(r, pdata);
            }
        }
        Err(_) => {
            if e == EpEvent::Established {
                conn.abort();
            }
        }
    }
}

#[derive(Debug)]
pub(crate) struct SpInner {
    id: u64,
    kind: SpKind,
    conn_qual: u64,
    evd: Evd,
    local: SocketAddr,
    /// Taken (closed) when the SP is freed.
    listener: Mutex<Option<Arc<Listener>>>,
    state: Mutex<SpState>,
    ep: Mutex<Option<Ep>>,
    closed: AtomicBool,
    flags: u32,
    user: AtomicUsize,
    ia: ObjRef,
}

impl Drop for SpInner {
    fn drop(&mut self) {
        self.close();
    }
}

impl SpInner {
    /// Stops listening and lets go of the EVD and the EP (once).
    fn close(&self) {
        if self.closed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.evd.inner.users.fetch_sub(1, Ordering::AcqRel);
        if let Some(ep) = self.ep.lock().take() {
            let mut c = ep.inner.conn.lock();
            if c.state == EpState::Reserved {
                c.state = EpState::Unconnected;
            }
        }
        // The reactor holds a clone while it polls: wake it, then wait
        // (briefly) for it to let go, so the port is free when this returns.
        let l = self.listener.lock().take();
        self.ia.0.reactor.wake();
        if let Some(mut l) = l {
            for _ in 0..1000 {
                match Arc::try_unwrap(l) {
                    Ok(x) => {
                        drop(x);
                        return;
                    }
                    Err(a) => {
                        l = a;
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
        }
    }

    fn create(
        ia: &Ia,
        kind: SpKind,
        conn_qual: Option<u64>,
        evd: &Evd,
        ep: Option<&Ep>,
        flags: u32,
    ) -> Result<Arc<SpInner>> {
        if !evd.flags().intersects(EvdFlags::CR) {
            return Err(err(ErrorType::InvalidHandle, Subtype::HandleEvdCr));
        }
        let base = ia.inner.config.port_base;
        let port = match conn_qual {
            Some(q) => addr::port_of(q, base)
                .ok_or_else(|| err(ErrorType::InvalidParameter, Subtype::Arg2))?,
            None => 0,
        };
        let lc = ListenConfig {
            private_data_cap: ENGINE_PDATA_CAP,
            ..ListenConfig::default()
        };
        let listener = Listener::bind(SocketAddr::new(ia.addr(), port), evd.qlen().max(8), lc)
            .map_err(|e| match e {
                softrdma_engine::cm::CmError::Io(io)
                    if io.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    err(ErrorType::ConnQualInUse, Subtype::None)
                }
                _ => err(ErrorType::InsufficientResources, Subtype::None),
            })?;
        let local = listener.local_addr();
        let conn_qual = conn_qual.unwrap_or_else(|| addr::conn_qual_of(local.port(), base));
        if let Some(ep) = ep {
            ep.inner.local_event(EpEvent::Reserve)?;
        }
        evd.inner.users.fetch_add(1, Ordering::AcqRel);
        let sp = Arc::new(SpInner {
            id: crate::next_id(),
            kind,
            conn_qual,
            evd: evd.clone(),
            local,
            listener: Mutex::new(Some(Arc::new(listener))),
            state: Mutex::new(SpState::Listening),
            ep: Mutex::new(ep.cloned()),
            closed: AtomicBool::new(false),
            flags,
            user: AtomicUsize::new(0),
            ia: ObjRef::new(&ia.inner),
        });
        ia.inner.reactor.add_sp(Arc::downgrade(&sp));
        Ok(sp)
    }

    fn handle(self: &Arc<Self>) -> ServicePoint {
        match self.kind {
            SpKind::Psp => ServicePoint::Psp(Psp {
                inner: self.clone(),
            }),
            SpKind::Rsp => ServicePoint::Rsp(Rsp {
                inner: self.clone(),
            }),
        }
    }

    fn on_request(self: &Arc<Self>, req: ConnRequest) {
        let action = {
            let mut st = self.state.lock();
            let (next, action) = on_request(self.kind, *st);
            *st = next;
            action
        };
        if action == OnRequest::Reject {
            let _ = req.reject(&[]);
            return;
        }
        let ep = self.ep.lock().clone();
        if let Some(ep) = &ep
            && ep.inner.local_event(EpEvent::RequestArrived).is_err()
        {
            let _ = req.reject(&[]);
            return;
        }
        self.deliver(req);
    }

    fn deliver(self: &Arc<Self>, req: ConnRequest) {
        let cr = Cr {
            inner: Arc::new(CrInner {
                id: crate::next_id(),
                peer: req.peer_addr(),
                pdata: req.private_data().to_vec(),
                local: self.local,
                req: Mutex::new(Some(req)),
                sp: self.handle(),
                conn_qual: self.conn_qual,
                user: AtomicUsize::new(0),
            }),
        };
        self.evd.push(Event::ConnRequest {
            sp: self.handle(),
            conn_qual: self.conn_qual,
            cr,
        });
    }
}

/// A public service point (`DAT_PSP_HANDLE`): a listener on the TCP port
/// of its connection qualifier; every request becomes a CR event.
#[derive(Debug, Clone)]
pub struct Psp {
    pub(crate) inner: Arc<SpInner>,
}

/// A reserved service point (`DAT_RSP_HANDLE`): one EP, one request; later
/// requests are rejected.
#[derive(Debug, Clone)]
pub struct Rsp {
    pub(crate) inner: Arc<SpInner>,
}

/// The service point of a connection request.
#[derive(Debug, Clone)]
pub enum ServicePoint {
    /// A PSP.
    Psp(Psp),
    /// An RSP.
    Rsp(Rsp),
}

impl ServicePoint {
    fn inner(&self) -> &Arc<SpInner> {
        match self {
            ServicePoint::Psp(p) => &p.inner,
            ServicePoint::Rsp(r) => &r.inner,
        }
    }

    /// Its connection qualifier.
    pub fn conn_qual(&self) -> u64 {
        self.inner().conn_qual
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner().user.load(Ordering::Acquire)
    }
}

macro_rules! sp_common {
    ($t:ty) => {
        impl $t {
            /// A process-unique identifier.
            pub fn id(&self) -> u64 {
                self.inner.id
            }

            /// The connection qualifier.
            pub fn conn_qual(&self) -> u64 {
                self.inner.conn_qual
            }

            /// The TCP address listened on.
            pub fn local_addr(&self) -> SocketAddr {
                self.inner.local
            }

            /// The CR EVD.
            pub fn evd(&self) -> Evd {
                self.inner.evd.clone()
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

            /// Stops listening (`dat_*sp_free`) at once; requests already
            /// delivered stay usable.
            pub fn free(self) {
                self.inner.close();
            }
        }

        impl PartialEq for $t {
            fn eq(&self, other: &Self) -> bool {
                Arc::ptr_eq(&self.inner, &other.inner)
            }
        }
    };
}

sp_common!(Psp);
sp_common!(Rsp);

impl Psp {
    /// Listens on `conn_qual` (`dat_psp_create`); requests go to `evd`
    /// (a CR EVD).
    ///
    /// # Errors
    ///
    /// `DAT_CONN_QUAL_IN_USE`; `DAT_INVALID_HANDLE EVD_CR` for an EVD
    /// without the CR flag; `DAT_INVALID_PARAMETER` for a qualifier
    /// without a port.
    pub fn new(ia: &Ia, conn_qual: u64, evd: &Evd, flags: u32) -> Result<Psp> {
        SpInner::create(ia, SpKind::Psp, Some(conn_qual), evd, None, flags)
            .map(|inner| Psp { inner })
    }

    /// Listens on a free qualifier (`dat_psp_create_any`).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn new_any(ia: &Ia, evd: &Evd, flags: u32) -> Result<Psp> {
        SpInner::create(ia, SpKind::Psp, None, evd, None, flags).map(|inner| Psp { inner })
    }

    /// The flags given at creation (`DAT_PSP_FLAGS`).
    pub fn flags(&self) -> u32 {
        self.inner.flags
    }
}

impl Rsp {
    /// Reserves `ep` for one request on `conn_qual` (`dat_rsp_create`).
    ///
    /// # Errors
    ///
    /// As [`Psp::new`]; `DAT_INVALID_STATE` unless `ep` is UNCONNECTED.
    pub fn new(ia: &Ia, conn_qual: u64, ep: &Ep, evd: &Evd) -> Result<Rsp> {
        SpInner::create(ia, SpKind::Rsp, Some(conn_qual), evd, Some(ep), 0)
            .map(|inner| Rsp { inner })
    }

    /// The reserved EP (until the RSP is freed).
    pub fn ep(&self) -> Option<Ep> {
        self.inner.ep.lock().clone()
    }
}

#[derive(Debug)]
pub(crate) struct CrInner {
    id: u64,
    req: Mutex<Option<ConnRequest>>,
    sp: ServicePoint,
    peer: SocketAddr,
    local: SocketAddr,
    pdata: Vec<u8>,
    conn_qual: u64,
    user: AtomicUsize,
}

/// A connection request (`DAT_CR_HANDLE`), answered once by
/// [`accept`](Cr::accept), [`reject`](Cr::reject) or
/// [`handoff`](Cr::handoff).
#[derive(Debug, Clone)]
pub struct Cr {
    pub(crate) inner: Arc<CrInner>,
}

/// What [`Cr::param`] reports (`DAT_CR_PARAM`).
#[derive(Debug, Clone)]
pub struct CrParam {
    /// The initiator's address and TCP port.
    pub remote_addr: SocketAddr,
    /// The local address and port it arrived at.
    pub local_addr: SocketAddr,
    /// The initiator's private data.
    pub private_data: Vec<u8>,
    /// The service point's qualifier.
    pub conn_qual: u64,
    /// The service point.
    pub sp: ServicePoint,
}

impl Cr {
    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// Whether it was answered.
    pub fn is_answered(&self) -> bool {
        self.inner.req.lock().is_none()
    }

    /// `dat_cr_query`.
    pub fn param(&self) -> CrParam {
        CrParam {
            remote_addr: self.inner.peer,
            local_addr: self.inner.local,
            private_data: self.inner.pdata.clone(),
            conn_qual: self.inner.conn_qual,
            sp: self.inner.sp.clone(),
        }
    }

    fn take(&self) -> Result<ConnRequest> {
        self.inner
            .req
            .lock()
            .take()
            .ok_or_else(|| err(ErrorType::InvalidHandle, Subtype::HandleCr))
    }

    /// Accepts the request on `ep` (`dat_cr_accept`; `None`: the RSP's EP)
    /// with `private_data`. Sends the MPA Reply and takes the initiator's
    /// RTR; the ESTABLISHED event follows on the EP's connect EVD (or
    /// ACCEPT_COMPLETION_ERROR if the handshake fails).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_HANDLE CR` once answered; `DAT_INVALID_PARAMETER` for
    /// private data over the maximum or no EP; `DAT_INVALID_STATE` for an
    /// EP not UNCONNECTED (or TENTATIVE for an RSP).
    pub fn accept(&self, ep: Option<&Ep>, private_data: &[u8]) -> Result<()> {
        crate::check_private_data(private_data)?;
        let rsp_ep = match &self.inner.sp {
            ServicePoint::Rsp(r) => r.ep(),
            ServicePoint::Psp(_) => None,
        };
        let ep = ep
            .cloned()
            .or(rsp_ep)
            .ok_or_else(|| err(ErrorType::InvalidParameter, Subtype::Arg2))?;
        let req = self.take()?;
        if let Err(e) = ep.inner.local_event(EpEvent::Accept) {
            *self.inner.req.lock() = Some(req);
            return Err(e);
        }
        {
            let mut c = ep.inner.conn.lock();
            c.conn_qual = self.inner.conn_qual;
            c.remote = Some(self.inner.peer);
        }
        let q = ep.query().attr;
        // Blocking until the initiator's RTR: ESTABLISHED is queued before
        // this call returns. (Reporting it later, from the reactor, lets a
        // fast peer's disconnect of another EP overtake it, and dtestcm
        // counts any connection event after its accepts as an
        // establishment.)
        let r = req.accept(
            &ep.inner.qp,
            private_data,
            q.max_rdma_read_in as u16,
            q.max_rdma_read_out as u16,
        );
        match r {
            Ok(conn) => {
                let report = {
                    let mut c = ep.inner.conn.lock();
                    c.conn = Some(conn.clone());
                    match rules::step(c.state, EpEvent::Established, EpPolicy::default()) {
                        Ok(st) => {
                            c.state = st.next;
                            st.report
                        }
                        Err(_) => None,
                    }
                };
                ep.inner.ia.0.reactor.add_conn(ep.inner.weak(), conn);
                if let Some(r) = report {
                    ep.inner.report(r, Vec::new());
                }
            }
            Err(_) => {
                let mut c = ep.inner.conn.lock();
                if let Ok(st) = rules::step(c.state, EpEvent::AcceptFailed, EpPolicy::default()) {
                    c.state = st.next;
                    drop(c);
                    if let Some(rep) = st.report {
                        ep.inner.report(rep, Vec::new());
                    }
                }
            }
        }
        Ok(())
    }

    /// Rejects the request with `private_data` (`dat_cr_reject`): the
    /// initiator sees `PEER_REJECTED` with that private data.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_HANDLE CR` once answered; `DAT_INVALID_PARAMETER` for
    /// too much private data.
    pub fn reject(&self, private_data: &[u8]) -> Result<()> {
        crate::check_private_data(private_data)?;
        let req = self.take()?;
        if let ServicePoint::Rsp(r) = &self.inner.sp
            && let Some(ep) = r.ep()
        {
            let _ = ep.inner.local_event(EpEvent::Reject);
        }
        let mut pd = REJECT_MAGIC.to_vec();
        pd.extend_from_slice(private_data);
        // The initiator may be gone already: the reject is answered either way.
        let _ = req.reject(&pd);
        Ok(())
    }

    /// Hands the request to the service point of `conn_qual` on the same
    /// IA (`dat_cr_handoff`): a new CR event is queued on its EVD.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_HANDLE CR` once answered; `DAT_INVALID_PARAMETER` if
    /// no service point has that qualifier.
    pub fn handoff(&self, conn_qual: u64) -> Result<()> {
        let ia = self.inner.sp.inner().ia.0.clone();
        let sp = ia
            .reactor
            .find_sp(conn_qual)
            .ok_or_else(|| err(ErrorType::InvalidParameter, Subtype::Arg2))?;
        let req = self.take()?;
        sp.deliver(req);
        Ok(())
    }
}

impl PartialEq for Cr {
    fn eq(&self, other: &Cr) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_route_is_unreachable_and_an_expired_connect_timeout_timed_out() {
        let t = Instant::now();
        let later = t + Duration::from_secs(5);
        assert_eq!(unreachable_event(t, Some(later)), EpEvent::Unreachable);
        assert_eq!(unreachable_event(t, None), EpEvent::Unreachable);
        assert_eq!(unreachable_event(later, Some(later)), EpEvent::TimedOut);
        assert_eq!(
            unreachable_event(later + Duration::from_millis(1), Some(later)),
            EpEvent::TimedOut
        );
    }
}
