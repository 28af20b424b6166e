//! Connection manager: listen, connect, accept and reject iWARP
//! connections, with events.
//!
//! The MPA negotiation (RFC 5044 section 7.1, RFC 6581) is run by the one
//! handshake driver of [`crate::handshake`] over the sans-IO machines of
//! [`softrdma_proto::mpa`]. One engine thread, the CM reactor (`epoll`),
//! drives every listening socket's accepts and every handshake in progress
//! (incoming, outgoing, non-blocking accepts and rejects), each with its
//! deadline in a timer set; no thread is started per connection:
//!
//! ```text
//!  connect() / Connection::start()            Listener (CM reactor)
//!  TCP connect ───────────────────────────────▶ accept (non-blocking)
//!  ── MPA Request (private data, IRD/ORD) ────▶ handshake in progress
//!                                               (bounded: max_handshakes)
//!                                               ConnRequest queued (backlog)
//!                                               get_request → accept / reject
//!  ◀──────────────────────── MPA Reply / reject ┘
//!  peer-to-peer: ── RTR ──▶ (◀── Read Response)
//!  QP in RTS: Established                       QP in RTS: Established
//! ```
//!
//! Each accepted TCP connection must deliver its whole Request within
//! [`ListenConfig::handshake_timeout`] (so slow-dripping bytes run out of
//! time too); a connection that sends garbage, closes, is too slow or asks
//! for terms this side refuses (too much private data, CRC when it is off,
//! markers) is ended (refused Requests are answered with a reject) and
//! reported as [`CmEvent::Error`] on the listener's event channel, while the
//! listener keeps serving the others. At most
//! [`ListenConfig::max_handshakes`] handshakes are in progress per listener:
//! when a new connection arrives at the limit, the oldest one that has sent
//! nothing (else the oldest) is dropped, so a flood of silent connections
//! cannot keep real clients out. The backlog counts only connections whose
//! Request arrived and waits for [`Listener::get_request`].
//!
//! Events ([`CmEvent`]) are queued per listener and per connection, and can
//! be taken blocking ([`Connection::wait_event`]), by polling
//! ([`Connection::try_event`]) or from an event loop: the descriptor of
//! [`Connection::fd`] (an `eventfd`) is readable exactly while an event is
//! queued. A connection reports [`CmEvent::Disconnected`] when its QP
//! leaves RTS for good (graceful close finished in IDLE, or ERROR): the QP
//! tells the connection manager of its state changes as they happen (no
//! polling thread).

#[cfg(feature = "tokio")]
mod async_cm;
mod reactor;

#[cfg(feature = "tokio")]
pub use async_cm::connect_async;

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use softrdma_proto::mpa::{
    ConfigError, MpaConfig, MpaNegotiationError, Negotiated, Request, Responder, RtrOffer,
};

use crate::event::StateWatch;
use crate::handshake::{
    Answer, Handshake, HandshakeError, Outcome, Secs, describe_negotiation, describe_reject,
    drive_blocking,
};
use crate::qp::LinkParams;
use crate::qp::{EstablishError, ModifyError, QueuePair};
use crate::state::QpState;
use crate::sys::clock;
use crate::sys::fd::EventFd;

/// Default handshake timeout of listeners and connects.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Default bound on a listener's handshakes in progress.
pub const DEFAULT_MAX_HANDSHAKES: usize = 1024;

/// Most listener events kept queued; later ones are counted
/// ([`Listener::dropped_events`]) and discarded.
pub const MAX_LISTENER_EVENTS: usize = 1024;

/// Why a connection could not be set up or answered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmError {
    /// The local settings or private data cannot be used.
    #[error("MPA settings: {0}")]
    Config(#[from] ConfigError),
    /// The host name could not be resolved (or resolved to nothing).
    #[error("cannot resolve address: {0}")]
    Resolve(io::Error),
    /// Nobody listens there, or no route (connection refused, host or
    /// network unreachable, or no TCP connection within the timeout: the
    /// error's kind is then `TimedOut` and its text names the address and
    /// the time).
    #[error("peer unreachable: {0}")]
    Unreachable(io::Error),
    /// TCP connected but the MPA handshake did not complete in time (no
    /// Reply, or no RTR). [`Connection::failure`] and the CM events name
    /// the stage and the time ("TCP connected but no MPA reply within
    /// 30 s").
    #[error("timed out: TCP connected but no MPA reply (or RTR) within the timeout")]
    TimedOut,
    /// The peer rejected the connection.
    #[error("rejected: {}", describe_reject(private_data))]
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The peer sent something unacceptable during the handshake (or is
    /// not an MPA endpoint at all).
    #[error("{}", describe_negotiation(.0))]
    Negotiation(#[from] MpaNegotiationError),
    /// The peer closed the connection during the handshake.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// The QP cannot take the connection (not in IDLE or RTR).
    #[error("{0}")]
    Qp(#[from] ModifyError),
    /// The QP could not be moved to RTS over the connection.
    #[error("cannot move the QP to RTS: {0}")]
    Establish(#[from] EstablishError),
    /// The listener was dropped during the handshake.
    #[error("listener closed")]
    ListenerClosed,
    /// A socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

impl From<HandshakeError> for CmError {
    fn from(e: HandshakeError) -> Self {
        match e {
            HandshakeError::Config(e) => CmError::Config(e),
            HandshakeError::Negotiation(e) => CmError::Negotiation(e),
            HandshakeError::Rejected { private_data } => CmError::Rejected { private_data },
            HandshakeError::TimedOut { .. } => CmError::TimedOut,
            HandshakeError::PeerClosed { .. } => CmError::PeerClosed,
            HandshakeError::Io(e) => CmError::Io(e),
        }
    }
}

/// What happened to a listener or a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CmEvent {
    /// The connection is established: its QP is in RTS.
    Established {
        /// The peer's address.
        peer: SocketAddr,
    },
    /// The peer rejected the connection.
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// Nobody listens at the address: the TCP connection was refused
    /// (a server that is not up yet; worth retrying).
    Refused,
    /// The address cannot be reached (no route, no such address), or no
    /// TCP connection came within the timeout.
    Unreachable,
    /// TCP connected but the handshake did not complete in time
    /// ([`Connection::failure`] names the stage and the time).
    TimedOut,
    /// The connection ended: its QP left RTS for IDLE (graceful close,
    /// `graceful` set) or ERROR (reset, lost connection, error).
    Disconnected {
        /// Whether the QP reached IDLE (FIN exchanged).
        graceful: bool,
    },
    /// Connection setup failed for another reason (on a listener: an
    /// incoming connection's handshake failed and that connection was
    /// ended).
    Error {
        /// The peer, if known.
        peer: Option<SocketAddr>,
        /// What went wrong.
        reason: String,
    },
}

/// A queue whose eventfd is readable exactly while it holds an entry.
#[derive(Debug)]
struct Queue<T> {
    items: Mutex<VecDeque<T>>,
    efd: EventFd,
}

impl<T> Queue<T> {
    fn new() -> io::Result<Self> {
        Ok(Self {
            items: Mutex::new(VecDeque::new()),
            efd: EventFd::new()?,
        })
    }

    fn push(&self, item: T) {
        let mut q = self.items.lock();
        q.push_back(item);
        self.efd.signal();
    }

    fn try_take(&self) -> Option<T> {
        let mut q = self.items.lock();
        let item = q.pop_front();
        if q.is_empty() {
            self.efd.drain();
        }
        item
    }

    fn take(&self, timeout: Option<Duration>) -> Option<T> {
        let deadline = timeout.and_then(|t| clock::now().checked_add(t));
        loop {
            if let Some(item) = self.try_take() {
                return Some(item);
            }
            let left = match (timeout, deadline) {
                (None, _) | (Some(_), None) => None,
                (Some(_), Some(d)) => {
                    let left = d.saturating_duration_since(clock::now());
                    if left.is_zero() {
                        return None;
                    }
                    Some(left)
                }
            };
            if self.efd.wait(left).is_err() {
                // poll(2) itself failed: do not spin.
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    fn len(&self) -> usize {
        self.items.lock().len()
    }
}

impl<T> Queue<T> {
    /// Pushes unless `cap` entries are queued; returns whether it did.
    fn push_capped(&self, item: T, cap: usize) -> bool {
        let mut q = self.items.lock();
        if q.len() >= cap {
            return false;
        }
        q.push_back(item);
        self.efd.signal();
        true
    }

    /// Drops everything queued.
    fn clear(&self) -> Vec<T> {
        let mut q = self.items.lock();
        self.efd.drain();
        q.drain(..).collect()
    }
}

/// Settings of a [`Listener`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenConfig {
    /// MPA settings (revision, CRC policy, RTR kinds accepted; the IRD/ORD
    /// are given per connection to [`ConnRequest::accept`]).
    pub mpa: MpaConfig,
    /// Most private data accepted in a Request and allowed in an answer
    /// (default 256, as Linux siw; at most 508). Replaces
    /// `mpa.max_private_data`.
    pub private_data_cap: usize,
    /// Time for an incoming connection to deliver its whole Request, and
    /// for the RTR after an accept in peer-to-peer mode.
    pub handshake_timeout: Duration,
    /// Most handshakes in progress (TCP accepted, Request not complete);
    /// at the limit a new connection displaces the oldest silent one (or
    /// the oldest). Default [`DEFAULT_MAX_HANDSHAKES`].
    pub max_handshakes: usize,
}

impl Default for ListenConfig {
    fn default() -> Self {
        let mpa = MpaConfig::default();
        Self {
            private_data_cap: mpa.max_private_data,
            mpa,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
        }
    }
}

#[derive(Debug)]
pub(crate) struct ListenerShared {
    requests: Queue<ConnRequest>,
    events: Queue<CmEvent>,
    dropped_events: AtomicU64,
    /// Handshakes in progress (kept by the reactor).
    handshakes: AtomicUsize,
    backlog: usize,
    config: ListenConfig,
}

impl ListenerShared {
    fn event(&self, e: CmEvent) {
        if !self.events.push_capped(e, MAX_LISTENER_EVENTS) {
            self.dropped_events.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// A listening endpoint (`rdma_listen`): the CM reactor accepts its TCP
/// connections, reads their MPA Requests and queues them as
/// [`ConnRequest`]s. Dropping it stops accepting and closes the
/// connections it holds; requests already taken stay usable.
#[derive(Debug)]
pub struct Listener {
    shared: Arc<ListenerShared>,
    local: SocketAddr,
    id: u64,
}

impl Listener {
    /// Listens on `addr` (port 0: any free port, see
    /// [`local_addr`](Self::local_addr)). `backlog` bounds the connections
    /// whose Request arrived and that wait for [`get_request`]'s caller;
    /// connections completing their Request beyond it are closed at once.
    /// Handshakes in progress are bounded separately by
    /// [`ListenConfig::max_handshakes`].
    ///
    /// [`get_request`]: Self::get_request
    ///
    /// # Errors
    ///
    /// Bad MPA settings or private-data cap, or the socket errors of
    /// binding.
    pub fn bind(
        addr: impl ToSocketAddrs,
        backlog: usize,
        config: ListenConfig,
    ) -> Result<Listener, CmError> {
        let mut config = config;
        config.mpa.max_private_data = config.private_data_cap;
        config.max_handshakes = config.max_handshakes.max(1);
        // Validates the settings once, here.
        Responder::new(config.mpa.clone())?;
        let listener = std::net::TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let shared = Arc::new(ListenerShared {
            requests: Queue::new()?,
            events: Queue::new()?,
            dropped_events: AtomicU64::new(0),
            handshakes: AtomicUsize::new(0),
            backlog: backlog.max(1),
            config,
        });
        let id = reactor::listen(listener, shared.clone())?;
        Ok(Listener { shared, local, id })
    }

    /// The address the listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the next connection request (`None` after `timeout`;
    /// `None` as timeout waits without limit).
    pub fn get_request(&self, timeout: Option<Duration>) -> Option<ConnRequest> {
        self.shared.requests.take(timeout)
    }

    /// The next connection request if one is queued; never blocks.
    pub fn try_get_request(&self) -> Option<ConnRequest> {
        self.shared.requests.try_take()
    }

    /// How many requests are queued.
    pub fn pending_requests(&self) -> usize {
        self.shared.requests.len()
    }

    /// How many handshakes of this listener are in progress.
    pub fn handshakes_in_progress(&self) -> usize {
        self.shared.handshakes.load(Ordering::Relaxed)
    }

    /// How many listener events were discarded because
    /// [`MAX_LISTENER_EVENTS`] were queued.
    pub fn dropped_events(&self) -> u64 {
        self.shared.dropped_events.load(Ordering::Relaxed)
    }

    /// A descriptor readable exactly while a request is queued (for
    /// `poll(2)`/`epoll(7)`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.requests.efd.as_fd()
    }

    /// Waits for the next listener event: [`CmEvent::Error`] for an
    /// incoming connection whose handshake failed.
    pub fn wait_event(&self, timeout: Option<Duration>) -> Option<CmEvent> {
        self.shared.events.take(timeout)
    }

    /// The next listener event if one is queued; never blocks.
    pub fn try_event(&self) -> Option<CmEvent> {
        self.shared.events.try_take()
    }

    /// A descriptor readable exactly while a listener event is queued.
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.shared.events.efd.as_fd()
    }
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Closes the listening socket and the handshakes in progress before
        // returning; then the queued requests.
        reactor::unlisten(self.id);
        drop(self.shared.requests.clear());
    }
}

/// An incoming connection whose MPA Request arrived (`rdma_cm_event`
/// CONNECT_REQUEST): inspect it, then [`accept`](Self::accept) or
/// [`reject`](Self::reject) it (or their non-blocking forms). Dropping it
/// closes the TCP connection.
#[derive(Debug)]
pub struct ConnRequest {
    peer: SocketAddr,
    request: Request,
    hs: Handshake,
    stream: TcpStream,
    config: ListenConfig,
}

impl ConnRequest {
    /// The initiator's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The initiator's private data.
    pub fn private_data(&self) -> &[u8] {
        &self.request.private_data
    }

    /// The initiator's IRD (revision 2 enhanced mode only).
    pub fn ird(&self) -> Option<u16> {
        self.request.ird_ord.map(|w| w.ird)
    }

    /// The initiator's ORD (revision 2 enhanced mode only).
    pub fn ord(&self) -> Option<u16> {
        self.request.ird_ord.map(|w| w.ord)
    }

    /// Whether the initiator asked for the MPA CRC.
    pub fn crc(&self) -> bool {
        self.request.crc
    }

    /// The RTR kinds offered, if the initiator asks for peer-to-peer mode.
    pub fn rtr_offer(&self) -> Option<RtrOffer> {
        self.request.rtr_offer
    }

    /// The whole Request.
    pub fn request(&self) -> &Request {
        &self.request
    }

    /// Accepts with `private_data` and this side's `ird`/`ord` (the ORD is
    /// lowered to the initiator's IRD): sets the QP's IRD/ORD, sends the
    /// Reply, takes the RTR in peer-to-peer mode (blocking the caller up
    /// to the handshake timeout), and moves `qp` (in IDLE or RTR) to RTS.
    /// The returned connection has [`CmEvent::Established`] queued.
    ///
    /// # Errors
    ///
    /// The QP is not in IDLE/RTR, the private data is over the cap, or the
    /// handshake failed; the TCP connection is closed then.
    pub fn accept(
        mut self,
        qp: &QueuePair,
        private_data: &[u8],
        ird: u16,
        ord: u16,
    ) -> Result<Connection, CmError> {
        self.answer_accept(qp, private_data, ird, ord)?;
        let out = drive_blocking(
            &mut self.hs,
            &mut self.stream,
            self.config.handshake_timeout,
        )?;
        let Outcome::Established(n) = out else {
            return Err(MpaNegotiationError::Over.into());
        };
        Connection::established(qp, self.stream, n, self.peer)
    }

    fn answer_accept(
        &mut self,
        qp: &QueuePair,
        private_data: &[u8],
        ird: u16,
        ord: u16,
    ) -> Result<(), CmError> {
        qp.set_ird_ord(ird, ord)?;
        self.hs.answer(Answer::Accept {
            private_data: private_data.to_vec(),
            ird,
            ord,
        })?;
        Ok(())
    }

    /// Accepts without blocking: as [`accept`](Self::accept), but the
    /// Reply, the RTR and the move to RTS are done by the CM reactor. The
    /// returned connection's first event is [`CmEvent::Established`] or,
    /// if the handshake fails, [`CmEvent::Error`] / [`CmEvent::TimedOut`].
    ///
    /// # Errors
    ///
    /// The QP is not in IDLE/RTR or the private data is over the cap
    /// (checked at once; the TCP connection is closed then).
    pub fn accept_nonblocking(
        mut self,
        qp: &QueuePair,
        private_data: &[u8],
        ird: u16,
        ord: u16,
    ) -> Result<Connection, CmError> {
        self.answer_accept(qp, private_data, ird, ord)?;
        let conn = Connection::new(qp)?;
        reactor::drive(reactor::Job {
            stream: self.stream,
            hs: self.hs,
            conn: Some(conn.clone()),
            peer: Some(self.peer),
            timeout: self.config.handshake_timeout,
        })?;
        Ok(conn)
    }

    /// Rejects with `private_data` (at most the cap) and closes the TCP
    /// connection once the reject is written.
    ///
    /// # Errors
    ///
    /// The private data is over the cap (nothing was sent; the connection
    /// is closed), or writing failed.
    pub fn reject(mut self, private_data: &[u8]) -> Result<(), CmError> {
        if let Err(e) = self.hs.answer(Answer::Reject(private_data.to_vec())) {
            let _ = self.stream.shutdown(Shutdown::Both);
            return Err(e.into());
        }
        drive_blocking(
            &mut self.hs,
            &mut self.stream,
            self.config.handshake_timeout,
        )?;
        let _ = self.stream.shutdown(Shutdown::Write);
        Ok(())
    }

    /// Rejects without blocking: the reject is written (and the connection
    /// closed) by the CM reactor.
    ///
    /// # Errors
    ///
    /// The private data is over the cap (nothing was sent; the connection
    /// is closed).
    pub fn reject_nonblocking(mut self, private_data: &[u8]) -> Result<(), CmError> {
        if let Err(e) = self.hs.answer(Answer::Reject(private_data.to_vec())) {
            let _ = self.stream.shutdown(Shutdown::Both);
            return Err(e.into());
        }
        reactor::drive(reactor::Job {
            stream: self.stream,
            hs: self.hs,
            conn: None,
            peer: Some(self.peer),
            timeout: self.config.handshake_timeout,
        })?;
        Ok(())
    }
}

/// Settings of [`connect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectConfig {
    /// MPA settings, with this side's IRD/ORD (set on the QP) and the RTR
    /// kinds offered for peer-to-peer mode.
    pub mpa: MpaConfig,
    /// Private data of the Request (at most `mpa.max_private_data`).
    pub private_data: Vec<u8>,
    /// Time for the TCP connection and the whole handshake.
    pub timeout: Duration,
}

impl Default for ConnectConfig {
    fn default() -> Self {
        Self {
            mpa: MpaConfig::default(),
            private_data: Vec::new(),
            timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

fn resolve(addr: impl ToSocketAddrs) -> Result<Vec<SocketAddr>, CmError> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(CmError::Resolve)?.collect();
    if addrs.is_empty() {
        return Err(CmError::Resolve(io::Error::new(
            io::ErrorKind::NotFound,
            "no address",
        )));
    }
    Ok(addrs)
}

/// The error of a failed TCP connect.
fn connect_error(e: io::Error) -> CmError {
    match e.kind() {
        io::ErrorKind::ConnectionRefused
        | io::ErrorKind::HostUnreachable
        | io::ErrorKind::NetworkUnreachable
        | io::ErrorKind::AddrNotAvailable
        | io::ErrorKind::TimedOut => CmError::Unreachable(e),
        _ => CmError::Io(e),
    }
}

/// No TCP connection to `addr` within `timeout`.
fn tcp_timeout(addr: Option<SocketAddr>, timeout: Duration) -> io::Error {
    let text = match addr {
        Some(a) => format!("no TCP connection to {a} within {}", Secs(timeout)),
        None => format!("no TCP connection within {}", Secs(timeout)),
    };
    io::Error::new(io::ErrorKind::TimedOut, text)
}

fn tcp_connect(
    addrs: &[SocketAddr],
    deadline: Instant,
    timeout: Duration,
) -> Result<TcpStream, CmError> {
    let mut last = None;
    for a in addrs {
        let left = deadline.saturating_duration_since(clock::now());
        if left.is_zero() {
            return Err(CmError::Unreachable(tcp_timeout(Some(*a), timeout)));
        }
        match TcpStream::connect_timeout(a, left) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
                ) =>
            {
                last = Some(tcp_timeout(Some(*a), timeout));
            }
            Err(e) => last = Some(e),
        }
    }
    Err(connect_error(
        last.unwrap_or_else(|| io::Error::other("no address")),
    ))
}

/// Connects `qp` (in IDLE or RTR) to a listener at `addr` (a
/// [`SocketAddr`], `"host:port"` with a host name or address, ...): TCP
/// connect, MPA Request with the private data, Reply, RTR in peer-to-peer
/// mode; on success the QP is in RTS and the connection has
/// [`CmEvent::Established`] queued. Blocks the calling thread (and no
/// other) for at most about `config.timeout` (plus name resolution).
///
/// # Errors
///
/// [`CmError::Unreachable`] (connection refused, no route),
/// [`CmError::TimedOut`], [`CmError::Rejected`] with the peer's private
/// data, and the others of [`CmError`].
pub fn connect(
    qp: &QueuePair,
    addr: impl ToSocketAddrs,
    config: &ConnectConfig,
) -> Result<Connection, CmError> {
    let mut hs = Handshake::initiator(config.mpa.clone(), &config.private_data)?;
    qp.set_ird_ord(config.mpa.ird, config.mpa.ord)?;
    let start = clock::now();
    let deadline = start
        .checked_add(config.timeout)
        .unwrap_or(start + Duration::from_secs(86_400 * 365));
    let addrs = resolve(addr)?;
    let mut stream = tcp_connect(&addrs, deadline, config.timeout)?;
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?;
    let left = deadline.saturating_duration_since(clock::now());
    let out = drive_blocking(&mut hs, &mut stream, left)?;
    let Outcome::Established(n) = out else {
        return Err(MpaNegotiationError::Over.into());
    };
    Connection::established(qp, stream, n, peer)
}

/// The event a failed connect reports.
fn failure_event(e: &CmError, peer: Option<SocketAddr>) -> CmEvent {
    match e {
        CmError::Rejected { private_data } => CmEvent::Rejected {
            private_data: private_data.clone(),
        },
        CmError::Unreachable(e) if e.kind() == io::ErrorKind::ConnectionRefused => CmEvent::Refused,
        CmError::Unreachable(_) => CmEvent::Unreachable,
        CmError::TimedOut => CmEvent::TimedOut,
        other => CmEvent::Error {
            peer,
            reason: other.to_string(),
        },
    }
}

#[derive(Debug)]
struct ConnShared {
    qp: QueuePair,
    events: Queue<CmEvent>,
    negotiated: Mutex<Option<Negotiated>>,
    peer: Mutex<Option<SocketAddr>>,
    /// Why the last connect/accept failed, in the driver's words.
    failure: Mutex<Option<String>>,
    /// The same failure, typed (taken by the async calls).
    failure_err: Mutex<Option<CmError>>,
}

/// The connection manager's watch on a connected QP: told of each state
/// change by the QP itself; reports the first move to IDLE or ERROR as
/// [`CmEvent::Disconnected`].
#[derive(Debug)]
struct CmStateWatch {
    conn: Weak<ConnShared>,
    fired: Arc<AtomicBool>,
}

impl StateWatch for CmStateWatch {
    /// Called by the QP with its new state (under the QP's own locks: only
    /// queues an event).
    fn notify(&self, s: QpState) {
        let graceful = match s {
            QpState::Idle => true,
            QpState::Error => false,
            _ => return,
        };
        if self.fired.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(c) = self.conn.upgrade() {
            c.events.push(CmEvent::Disconnected { graceful });
        }
    }
}

/// A connection of a QP (`rdma_cm_id`): its events, what was negotiated,
/// and the disconnect calls. Dropping it does not close the connection
/// (the QP owns it); it stops the events.
#[derive(Debug, Clone)]
pub struct Connection {
    shared: Arc<ConnShared>,
}

impl Connection {
    fn new(qp: &QueuePair) -> Result<Connection, CmError> {
        Ok(Connection {
            shared: Arc::new(ConnShared {
                qp: qp.clone(),
                events: Queue::new()?,
                negotiated: Mutex::new(None),
                peer: Mutex::new(None),
                failure: Mutex::new(None),
                failure_err: Mutex::new(None),
            }),
        })
    }

    fn established(
        qp: &QueuePair,
        stream: TcpStream,
        n: Negotiated,
        peer: SocketAddr,
    ) -> Result<Connection, CmError> {
        let c = Connection::new(qp)?;
        c.on_established(stream, n, peer)?;
        Ok(c)
    }

    fn on_established(
        &self,
        stream: TcpStream,
        n: Negotiated,
        peer: SocketAddr,
    ) -> Result<(), CmError> {
        self.shared.qp.establish(stream, &LinkParams::from(&n))?;
        *self.shared.negotiated.lock() = Some(n);
        *self.shared.peer.lock() = Some(peer);
        self.shared.events.push(CmEvent::Established { peer });
        let watch = CmStateWatch {
            conn: Arc::downgrade(&self.shared),
            fired: Arc::new(AtomicBool::new(false)),
        };
        let check = CmStateWatch {
            conn: watch.conn.clone(),
            fired: watch.fired.clone(),
        };
        self.shared.qp.set_state_watch(Some(Box::new(watch)));
        // The QP may have left RTS before the watch was there (the shared
        // flag reports it once either way).
        check.notify(self.shared.qp.state());
        Ok(())
    }

    /// Records a failed setup and reports it as the connection's event.
    fn fail(&self, event: CmEvent, text: String, err: CmError) {
        *self.shared.failure.lock() = Some(text);
        *self.shared.failure_err.lock() = Some(err);
        self.shared.events.push(event);
    }

    fn on_failure(&self, e: HandshakeError, peer: Option<SocketAddr>) {
        let text = e.to_string();
        let event = match &e {
            HandshakeError::Rejected { private_data } => CmEvent::Rejected {
                private_data: private_data.clone(),
            },
            HandshakeError::TimedOut { .. } => CmEvent::TimedOut,
            _ => CmEvent::Error {
                peer,
                reason: text.clone(),
            },
        };
        self.fail(event, text, e.into());
    }

    fn on_setup_error(&self, e: CmError, peer: Option<SocketAddr>) {
        self.fail(failure_event(&e, peer), e.to_string(), e);
    }

    /// The typed error of a failed setup (once).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    fn take_failure(&self) -> Option<CmError> {
        self.shared.failure_err.lock().take()
    }

    /// Starts connecting `qp` to `addr` and returns at once (after name
    /// resolution, which blocks for host names); the CM reactor does the
    /// TCP connect and the handshake, no thread is started. The outcome is
    /// the connection's first event: [`CmEvent::Established`],
    /// [`CmEvent::Rejected`], [`CmEvent::Refused`], [`CmEvent::Unreachable`],
    /// [`CmEvent::TimedOut`] or [`CmEvent::Error`]; its descriptor
    /// ([`fd`](Self::fd)) becomes readable then, and
    /// [`failure`](Self::failure) names the cause of a failure.
    ///
    /// # Errors
    ///
    /// The event descriptor could not be created, or the CM reactor could
    /// not be started.
    pub fn start(
        qp: &QueuePair,
        addr: impl ToSocketAddrs + Send + 'static,
        config: ConnectConfig,
    ) -> io::Result<Connection> {
        let c = Connection::new(qp).map_err(|e| match e {
            CmError::Io(e) => e,
            other => io::Error::other(other.to_string()),
        })?;
        let prepared = (|| -> Result<(Handshake, Vec<SocketAddr>), CmError> {
            let hs = Handshake::initiator(config.mpa.clone(), &config.private_data)?;
            qp.set_ird_ord(config.mpa.ird, config.mpa.ord)?;
            Ok((hs, resolve(addr)?))
        })();
        match prepared {
            Ok((hs, addrs)) => reactor::connect(reactor::Outgoing {
                addrs,
                hs,
                conn: c.clone(),
                timeout: config.timeout,
            })?,
            Err(e) => c.on_setup_error(e, None),
        }
        Ok(c)
    }

    /// The QP of the connection.
    pub fn qp(&self) -> &QueuePair {
        &self.shared.qp
    }

    /// The peer's address, once established.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        *self.shared.peer.lock()
    }

    /// What the MPA negotiation settled, once established.
    pub fn negotiated(&self) -> Option<Negotiated> {
        self.shared.negotiated.lock().clone()
    }

    /// Why the connection could not be set up, in words naming the cause
    /// ("TCP connected but no MPA reply within 30 s", "the peer is not an
    /// iWARP/MPA endpoint: ...", "rejected: ...", "the peer closed the
    /// connection ..."), once a failure event was queued.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure.lock().clone()
    }

    /// The peer's private data (from its Request or Reply), once
    /// established.
    pub fn peer_private_data(&self) -> Option<Vec<u8>> {
        self.shared
            .negotiated
            .lock()
            .as_ref()
            .map(|n| n.peer_private_data.clone())
    }

    /// Graceful disconnect ([`QueuePair::disconnect`]); completion is
    /// reported as [`CmEvent::Disconnected`] (`graceful` if the QP reached
    /// IDLE).
    ///
    /// # Errors
    ///
    /// The QP is not in RTS.
    pub fn disconnect(&self) -> Result<(), CmError> {
        Ok(self.shared.qp.disconnect()?)
    }

    /// Abortive disconnect ([`QueuePair::abort`]); reported as
    /// [`CmEvent::Disconnected`] with `graceful: false`.
    pub fn abort(&self) {
        self.shared.qp.abort();
    }

    /// Waits for the next event (`None` after `timeout`; `None` as timeout
    /// waits without limit).
    pub fn wait_event(&self, timeout: Option<Duration>) -> Option<CmEvent> {
        self.shared.events.take(timeout)
    }

    /// The next event if one is queued; never blocks.
    pub fn try_event(&self) -> Option<CmEvent> {
        self.shared.events.try_take()
    }

    /// A descriptor readable exactly while an event is queued (for
    /// `poll(2)`/`epoll(7)`).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.shared.events.efd.as_fd()
    }
}

impl AsFd for Connection {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd()
    }
}
