//! Connection manager: listen, connect, accept and reject iWARP
//! connections, with events.
//!
//! The MPA negotiation (RFC 5044 section 7.1, RFC 6581) is run by the
//! sans-IO machines of [`softrdma_proto::mpa`]; this module does the
//! sockets, the threads, the timeouts and the events:
//!
//! ```text
//!  connect()                                  Listener (acceptor thread)
//!  TCP connect ───────────────────────────────▶ accept, worker thread
//!  ── MPA Request (private data, IRD/ORD) ────▶ ConnRequest (get_request)
//!                                               accept(qp, pd, ird, ord)
//!  ◀──────────────────────── MPA Reply / reject ┘ or reject(pd)
//!  peer-to-peer: ── RTR ──▶ (◀── Read Response)
//!  QP in RTS: Established                       QP in RTS: Established
//! ```
//!
//! Each accepted TCP connection's Request is read on a worker thread within
//! [`ListenConfig::handshake_timeout`] (for the whole Request, so
//! slow-dripping bytes run out of time too); a connection that sends
//! garbage, closes, is too slow or asks for terms this side refuses (too much
//! private data, CRC when it is off, markers) is ended (refused Requests are
//! answered with a reject) and reported as [`CmEvent::Error`] on the
//! listener's event channel, while the listener keeps serving the others.
//!
//! Events ([`CmEvent`]) are queued per listener and per connection, and can
//! be taken blocking ([`Connection::wait_event`]), by polling
//! ([`Connection::try_event`]) or from an event loop: the descriptor of
//! [`Connection::fd`] (an `eventfd`) is readable exactly while an event is
//! queued. A connection reports [`CmEvent::Disconnected`] when its QP
//! leaves RTS for good (graceful close finished in IDLE, or ERROR); the
//! QP's state is sampled every [`MONITOR_INTERVAL`] by a small thread per
//! connection.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use softrdma_proto::mpa::{
    ConfigError, Initiator, InitiatorEvent, MpaConfig, MpaNegotiationError, Negotiated, Request,
    Responder, ResponderEvent, RtrOffer,
};

use crate::connect::{Deadline, HandshakeIoError, RX_CHUNK, never, recv_some, send_all};
use crate::qp::{EstablishError, LinkParams, ModifyError, QueuePair};
use crate::state::QpState;
use crate::sys::fd::EventFd;

/// How often a connection's QP state is sampled to report
/// [`CmEvent::Disconnected`].
pub const MONITOR_INTERVAL: Duration = Duration::from_millis(10);

/// Default handshake timeout of listeners and connects.
pub const DEFAULT_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How often the acceptor thread checks whether its listener was dropped.
const ACCEPT_POLL: Duration = Duration::from_millis(20);

impl From<HandshakeIoError> for CmError {
    fn from(e: HandshakeIoError) -> Self {
        match e {
            HandshakeIoError::TimedOut => CmError::TimedOut,
            HandshakeIoError::PeerClosed => CmError::PeerClosed,
            HandshakeIoError::Cancelled => CmError::ListenerClosed,
            HandshakeIoError::Io(e) => CmError::Io(e),
        }
    }
}

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
    /// network unreachable).
    #[error("peer unreachable: {0}")]
    Unreachable(io::Error),
    /// The TCP connection or the MPA handshake did not complete in time.
    #[error("connection setup timed out")]
    TimedOut,
    /// The peer rejected the connection.
    #[error("connection rejected by the peer ({} octets of private data)", private_data.len())]
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The peer sent something unacceptable during the handshake.
    #[error("MPA negotiation: {0}")]
    Negotiation(#[from] MpaNegotiationError),
    /// The peer closed the connection during the handshake.
    #[error("peer closed the connection during the handshake")]
    PeerClosed,
    /// The QP cannot take the connection (not in IDLE or RTR).
    #[error("QP: {0}")]
    Qp(#[from] ModifyError),
    /// The QP could not be moved to RTS over the connection.
    #[error("establish: {0}")]
    Establish(#[from] EstablishError),
    /// The listener was dropped during the handshake.
    #[error("listener closed")]
    ListenerClosed,
    /// A socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
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
    /// Nobody listens at the address, or it cannot be reached.
    Unreachable,
    /// The connection or its handshake did not complete in time.
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
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            if let Some(item) = self.try_take() {
                return Some(item);
            }
            let left = match (timeout, deadline) {
                (None, _) | (Some(_), None) => None,
                (Some(_), Some(d)) => {
                    let left = d.saturating_duration_since(Instant::now());
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

/// Writes what the responder has to send.
fn flush_responder(m: &mut Responder, stream: &mut TcpStream, d: &Deadline) -> Result<(), CmError> {
    let out = m.transmit().to_vec();
    send_all(stream, &out, d)?;
    m.consumed(out.len());
    Ok(())
}

/// Reads the Request: `Ok` once it is there and acceptable. A refused
/// Request is answered with a reject before the error is returned.
fn read_request(
    m: &mut Responder,
    stream: &mut TcpStream,
    d: &Deadline,
    cancelled: &dyn Fn() -> bool,
) -> Result<Request, CmError> {
    let mut buf = [0u8; RX_CHUNK];
    loop {
        if let Some(ResponderEvent::Request(r)) = m.poll() {
            return Ok(r);
        }
        let want = m.want();
        if want == 0 {
            return Err(MpaNegotiationError::Over.into());
        }
        let got = recv_some(stream, &mut buf, want, d, cancelled)?;
        if let Err(e) = m.receive(got) {
            if m.request().is_some() && m.reject(&[]).is_ok() {
                // Best effort: the error is what matters.
                let _ = flush_responder(m, stream, d);
            }
            return Err(e.into());
        }
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
}

impl Default for ListenConfig {
    fn default() -> Self {
        let mpa = MpaConfig::default();
        Self {
            private_data_cap: mpa.max_private_data,
            mpa,
            handshake_timeout: DEFAULT_HANDSHAKE_TIMEOUT,
        }
    }
}

#[derive(Debug)]
struct ListenerShared {
    requests: Queue<ConnRequest>,
    events: Queue<CmEvent>,
    closed: AtomicBool,
    /// Connections in handshake or waiting for an answer.
    pending: Arc<AtomicUsize>,
    backlog: usize,
    config: ListenConfig,
}

/// A listening endpoint (`rdma_listen`): accepts TCP connections, reads
/// their MPA Requests on worker threads and queues them as
/// [`ConnRequest`]s. Dropping it stops accepting; requests already taken
/// stay usable.
#[derive(Debug)]
pub struct Listener {
    shared: Arc<ListenerShared>,
    local: SocketAddr,
    acceptor: Option<JoinHandle<()>>,
}

/// Decrements the pending count when a request is answered or dropped.
#[derive(Debug)]
struct PendingGuard(Arc<AtomicUsize>);

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Listener {
    /// Listens on `addr` (port 0: any free port, see
    /// [`local_addr`](Self::local_addr)). `backlog` bounds the connections
    /// that are in their handshake or wait for [`get_request`]'s caller to
    /// answer; connections beyond it are closed at once.
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
        // Validates the settings once, here.
        Responder::new(config.mpa.clone())?;
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let shared = Arc::new(ListenerShared {
            requests: Queue::new()?,
            events: Queue::new()?,
            closed: AtomicBool::new(false),
            pending: Arc::new(AtomicUsize::new(0)),
            backlog: backlog.max(1),
            config,
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("softrdma-cm-listen".into())
            .spawn(move || accept_loop(&listener, &s))?;
        Ok(Listener {
            shared,
            local,
            acceptor: Some(acceptor),
        })
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
        self.shared.closed.store(true, Ordering::Release);
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<ListenerShared>) {
    while !shared.closed.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, peer)) => {
                if shared.pending.load(Ordering::Acquire) >= shared.backlog {
                    // Over the backlog: refuse by closing at once.
                    drop(stream);
                    continue;
                }
                shared.pending.fetch_add(1, Ordering::AcqRel);
                let guard = PendingGuard(shared.pending.clone());
                let weak = Arc::downgrade(shared);
                let spawned = std::thread::Builder::new()
                    .name("softrdma-cm-handshake".into())
                    .spawn(move || handshake(stream, peer, guard, &weak));
                if let Err(e) = spawned {
                    shared.events.push(CmEvent::Error {
                        peer: Some(peer),
                        reason: format!("cannot start a handshake thread: {e}"),
                    });
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                let _ = crate::sys::fd::wait_readable(listener.as_fd(), Some(ACCEPT_POLL));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => {
                // Transient (EMFILE, ECONNABORTED, ...): back off a little.
                std::thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Worker of one incoming connection: reads its Request and queues it.
fn handshake(
    mut stream: TcpStream,
    peer: SocketAddr,
    guard: PendingGuard,
    shared: &Weak<ListenerShared>,
) {
    let Some(s) = shared.upgrade() else { return };
    let config = s.config.clone();
    drop(s);
    let result = (|| -> Result<(Responder, Request), CmError> {
        stream.set_nodelay(true)?;
        let mut m = Responder::new(config.mpa.clone())?;
        let d = Deadline::after(config.handshake_timeout);
        let cancelled = || {
            shared
                .upgrade()
                .is_none_or(|s| s.closed.load(Ordering::Acquire))
        };
        let r = read_request(&mut m, &mut stream, &d, &cancelled)?;
        Ok((m, r))
    })();
    let Some(s) = shared.upgrade() else { return };
    match result {
        Ok((responder, request)) => s.requests.push(ConnRequest {
            peer,
            request,
            responder,
            stream,
            config,
            _guard: guard,
        }),
        Err(e) => {
            let _ = stream.shutdown(Shutdown::Both);
            drop(stream);
            // The slot is free before the failure is reported.
            drop(guard);
            s.events.push(CmEvent::Error {
                peer: Some(peer),
                reason: format!("incoming connection from {peer}: {e}"),
            });
        }
    }
}

/// An incoming connection whose MPA Request arrived (`rdma_cm_event`
/// CONNECT_REQUEST): inspect it, then [`accept`](Self::accept) or
/// [`reject`](Self::reject) it. Dropping it closes the TCP connection.
#[derive(Debug)]
pub struct ConnRequest {
    peer: SocketAddr,
    request: Request,
    responder: Responder,
    stream: TcpStream,
    config: ListenConfig,
    _guard: PendingGuard,
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
    /// Reply, takes the RTR in peer-to-peer mode, and moves `qp` (in IDLE
    /// or RTR) to RTS. The returned connection has
    /// [`CmEvent::Established`] queued.
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
        qp.set_ird_ord(ird, ord)?;
        self.responder.accept(private_data, ird, ord)?;
        let d = Deadline::after(self.config.handshake_timeout);
        let n = self.finish(&d)?;
        let peer = self.peer;
        Connection::established(qp, self.stream, n, peer)
    }

    fn finish(&mut self, d: &Deadline) -> Result<Negotiated, CmError> {
        let m = &mut self.responder;
        let stream = &mut self.stream;
        let mut buf = [0u8; RX_CHUNK];
        loop {
            flush_responder(m, stream, d)?;
            if let Some(ResponderEvent::Established(n)) = m.poll() {
                // A Read RTR's response may have been queued with it.
                flush_responder(m, stream, d)?;
                stream.set_read_timeout(None)?;
                stream.set_write_timeout(None)?;
                return Ok(n);
            }
            let want = m.want();
            if want == 0 {
                return Err(MpaNegotiationError::Over.into());
            }
            let got = recv_some(stream, &mut buf, want, d, &never)?;
            m.receive(got)?;
        }
    }

    /// Rejects with `private_data` (at most the cap) and closes the TCP
    /// connection once the reject is written.
    ///
    /// # Errors
    ///
    /// The private data is over the cap (nothing was sent; the connection
    /// is closed), or writing failed.
    pub fn reject(mut self, private_data: &[u8]) -> Result<(), CmError> {
        let r = self.responder.reject(private_data);
        if let Err(e) = r {
            let _ = self.stream.shutdown(Shutdown::Both);
            return Err(e.into());
        }
        let d = Deadline::after(self.config.handshake_timeout);
        flush_responder(&mut self.responder, &mut self.stream, &d)?;
        let _ = self.stream.shutdown(Shutdown::Write);
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

fn tcp_connect(addr: impl ToSocketAddrs, d: &Deadline) -> Result<TcpStream, CmError> {
    let addrs: Vec<SocketAddr> = addr.to_socket_addrs().map_err(CmError::Resolve)?.collect();
    if addrs.is_empty() {
        return Err(CmError::Resolve(io::Error::new(
            io::ErrorKind::NotFound,
            "no address",
        )));
    }
    let mut last = None;
    for a in addrs {
        let left = d.remaining()?;
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    let e = last.unwrap_or_else(|| io::Error::other("no address"));
    Err(match e.kind() {
        io::ErrorKind::ConnectionRefused
        | io::ErrorKind::HostUnreachable
        | io::ErrorKind::NetworkUnreachable
        | io::ErrorKind::AddrNotAvailable => CmError::Unreachable(e),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => CmError::TimedOut,
        _ => CmError::Io(e),
    })
}

/// The initiator's handshake; returns the stream in full operation.
fn run_connect(
    qp: &QueuePair,
    addr: impl ToSocketAddrs,
    config: &ConnectConfig,
) -> Result<(TcpStream, Negotiated, SocketAddr), CmError> {
    let mut m = Initiator::new(config.mpa.clone(), &config.private_data)?;
    qp.set_ird_ord(config.mpa.ird, config.mpa.ord)?;
    let d = Deadline::after(config.timeout);
    let mut stream = tcp_connect(addr, &d)?;
    stream.set_nodelay(true)?;
    let peer = stream.peer_addr()?;
    let mut buf = [0u8; RX_CHUNK];
    let n = loop {
        let out = m.transmit().to_vec();
        send_all(&mut stream, &out, &d)?;
        m.consumed(out.len());
        match m.poll() {
            Some(InitiatorEvent::Established(n)) => break n,
            Some(InitiatorEvent::Rejected { private_data, .. }) => {
                return Err(CmError::Rejected { private_data });
            }
            _ => {}
        }
        let want = m.want();
        if want == 0 {
            return Err(MpaNegotiationError::Over.into());
        }
        let got = recv_some(&mut stream, &mut buf, want, &d, &never)?;
        m.receive(got)?;
    };
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok((stream, n, peer))
}

/// Connects `qp` (in IDLE or RTR) to a listener at `addr` (a
/// [`SocketAddr`], `"host:port"` with a host name or address, ...): TCP
/// connect, MPA Request with the private data, Reply, RTR in peer-to-peer
/// mode; on success the QP is in RTS and the connection has
/// [`CmEvent::Established`] queued. Blocks for at most about
/// `config.timeout` (plus name resolution).
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
    let (stream, n, peer) = run_connect(qp, addr, config)?;
    Connection::established(qp, stream, n, peer)
}

/// The event a failed connect reports.
fn failure_event(e: &CmError) -> CmEvent {
    match e {
        CmError::Rejected { private_data } => CmEvent::Rejected {
            private_data: private_data.clone(),
        },
        CmError::Unreachable(_) => CmEvent::Unreachable,
        CmError::TimedOut => CmEvent::TimedOut,
        other => CmEvent::Error {
            peer: None,
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
        let weak = Arc::downgrade(&self.shared);
        std::thread::Builder::new()
            .name("softrdma-cm-monitor".into())
            .spawn(move || monitor(&weak))?;
        Ok(())
    }

    /// Starts connecting `qp` to `addr` on a thread and returns at once;
    /// the outcome is the connection's first event: [`CmEvent::Established`],
    /// [`CmEvent::Rejected`], [`CmEvent::Unreachable`],
    /// [`CmEvent::TimedOut`] or [`CmEvent::Error`].
    ///
    /// # Errors
    ///
    /// The event descriptor or the thread could not be created.
    pub fn start(
        qp: &QueuePair,
        addr: impl ToSocketAddrs + Send + 'static,
        config: ConnectConfig,
    ) -> io::Result<Connection> {
        let c = Connection::new(qp).map_err(|e| match e {
            CmError::Io(e) => e,
            other => io::Error::other(other.to_string()),
        })?;
        let this = c.clone();
        std::thread::Builder::new()
            .name("softrdma-cm-connect".into())
            .spawn(move || {
                let r = run_connect(&this.shared.qp, addr, &config)
                    .and_then(|(stream, n, peer)| this.on_established(stream, n, peer));
                if let Err(e) = r {
                    this.shared.events.push(failure_event(&e));
                }
            })?;
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

/// Samples the QP's state until it leaves RTS/CLOSING/TERMINATE, then
/// reports the disconnect; ends when the connection is dropped.
fn monitor(shared: &Weak<ConnShared>) {
    loop {
        let Some(s) = shared.upgrade() else { return };
        match s.qp.state() {
            QpState::Idle => {
                s.events.push(CmEvent::Disconnected { graceful: true });
                return;
            }
            QpState::Error => {
                s.events.push(CmEvent::Disconnected { graceful: false });
                return;
            }
            _ => {}
        }
        drop(s);
        std::thread::sleep(MONITOR_INTERVAL);
    }
}
