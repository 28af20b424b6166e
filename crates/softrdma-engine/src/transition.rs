//! Switching a live TCP byte stream into RDMA mode.
//!
//! An application may first use a connection as a plain byte stream (a
//! login or negotiation phase, as iSCSI does before iSER takes over, RFC
//! 7145 section 5) and then switch the same connection into RDMA mode.
//! [`StreamConnection`] wraps the connected [`TcpStream`] for that:
//!
//! ```text
//!  Streaming ──request_switch──▶ SwitchRequested ──post_recv_and_switch──▶ Transitioning
//!   read/write                    write only (last                          │         │
//!   reserve, set_ird_ord          streaming messages)                       ▼         ▼
//!                                 reserve, set_ird_ord                     Rdma     Failed
//!                                                                          (QP RTS)  (torn down)
//! ```
//!
//! 1. Resources first: [`StreamConnection::reserve`] takes a QP in IDLE (or
//!    RTR); its IRD/ORD may be changed with
//!    [`StreamConnection::set_ird_ord`] until the switch starts. From then on
//!    they are fixed by the negotiation at the switch (the QP is in RTS,
//!    where [`QueuePair::set_ird_ord`] refuses).
//! 2. [`StreamConnection::request_switch`]: from now on stream reads are
//!    refused ([`TransitionError::ReadAfterSwitchRequest`]); the application
//!    may still write its last streaming message(s).
//! 3. [`StreamConnection::post_recv_and_switch`] (or
//!    [`StreamConnection::post_srq_recv_and_switch`] for a QP with a shared
//!    receive queue): posts the first receive (at least one must be
//!    pre-posted; more may be posted on the QP before) and performs the
//!    switch, blocking until RDMA mode or failure (so
//!    [`ConnState::Transitioning`] is seen only by a failed call's
//!    teardown; the `&mut self` receiver keeps other calls out meanwhile). All
//!    streaming writes are blocking and complete (the octets are in the
//!    socket, in order) before the switch starts, so no RDMA frame can
//!    overtake or interleave with streaming octets.
//! 4. Or, from an event loop: [`StreamConnection::post_recv_and_begin_switch`]
//!    starts the same switch without blocking, and
//!    [`StreamConnection::poll_switch`] advances it whenever
//!    [`StreamConnection::switch_fd`] is ready (and at the switch timeout).
//!    Both forms run the one handshake driver of [`crate::handshake`] that
//!    the connection manager uses.
//!
//! ## Protocol at the switch
//!
//! [`SwitchMode::Mpa`] (the default choice, as iSER over iWARP does): after
//! its last streaming message each side runs an MPA exchange (RFC 5044
//! section 7.1, RFC 6581) on the same stream, one side as initiator, the
//! other as responder; it settles CRC, the IRD/ORD of the reserved QP (RFC
//! 6581 enhanced mode) and, if configured, the peer-to-peer RTR. The MPA
//! Request therefore follows the initiator's last streaming octet, and the
//! Reply follows the responder's.
//!
//! [`SwitchMode::Direct`]: the parameters were agreed during the streaming
//! phase (by the application's own login keys); full operation starts with
//! the octet right after each side's last streaming message, with the given
//! [`LinkParams`] and no MPA frames.
//!
//! ## Read-ahead
//!
//! Stream reads are buffered: the connection reads up to
//! [`READ_AHEAD`] octets from the socket at a time, so the buffer may hold
//! octets past the peer's last streaming message (its MPA frame or, in
//! direct mode, its first FPDUs, which a peer that switched first may send
//! at once). Those octets are never returned by a read after
//! [`StreamConnection::request_switch`]; at the switch they go to the MPA
//! exchange and then to the RDMA receive path
//! ([`QueuePair::establish_with_prefix`]), in order, before anything else
//! read from the socket. The application frames its own messages: it reads
//! exactly a message's length ([`StreamConnection::read_exact`]), and
//! returns octets it read too far with [`StreamConnection::unread`].
//!
//! ## Failure
//!
//! A failure once the switch started (peer closed, garbage, timeout, MPA
//! refusal, local setup error) tears the connection down: the socket is
//! shut down in both directions, the QP enters ERROR (the pre-posted
//! receives complete with flush errors) and the connection is
//! [`ConnState::Failed`]. It never falls back to streaming.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use softrdma_proto::mpa::{ConfigError, MpaConfig, MpaNegotiationError, Negotiated};

use crate::handshake::{
    Answer, Handshake, HandshakeError, Outcome, Step, describe_negotiation, describe_reject,
};
use crate::qp::{EstablishError, LinkParams, ModifyError, PostRecvError, QueuePair};
use crate::srq::SharedReceiveQueue;
use crate::state::QpState;
use crate::sys::clock;
use crate::sys::wait::{Readiness, wait_ready};
use crate::wr::RecvWr;

/// Octets read from the socket at a time in streaming mode; also the most
/// the read-ahead buffer holds (well below the 16 KiB that
/// [`QueuePair::establish_with_prefix`] takes).
pub const READ_AHEAD: usize = 8 * 1024;

/// Most octets the read-ahead buffer may hold including octets given back
/// with [`StreamConnection::unread`].
pub const READ_AHEAD_MAX: usize = 16 * 1024;

/// Default time limit of the switch ([`StreamConnection::set_switch_timeout`]).
pub const DEFAULT_SWITCH_TIMEOUT: Duration = Duration::from_secs(10);

/// The side this end takes in the MPA exchange at the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpaRole {
    /// Sends the MPA Request (and the RTR in peer-to-peer mode).
    Initiator,
    /// Answers the Request with a Reply.
    Responder,
}

/// How the connection enters full operation.
#[derive(Debug, Clone)]
pub enum SwitchMode {
    /// MPA exchange on the stream after the last streaming message. The
    /// `config`'s IRD/ORD are replaced by the reserved QP's at the switch.
    Mpa {
        /// Initiator or responder.
        role: MpaRole,
        /// Revision, CRC policy, peer-to-peer mode, private data cap.
        config: MpaConfig,
        /// Private data of the Request or Reply.
        private_data: Vec<u8>,
    },
    /// No MPA frames: full operation starts right after the last streaming
    /// message with these parameters, agreed during the streaming phase.
    Direct(LinkParams),
}

impl SwitchMode {
    /// MPA exchange with the default [`MpaConfig`] (revision 2, CRC if the
    /// peer asks) and no private data.
    pub fn mpa(role: MpaRole) -> Self {
        SwitchMode::Mpa {
            role,
            config: MpaConfig::default(),
            private_data: Vec::new(),
        }
    }
}

/// Where a [`StreamConnection`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnState {
    /// Byte stream: reads and writes.
    Streaming,
    /// Switch requested: writes only (the last streaming messages).
    SwitchRequested,
    /// The switch is running.
    Transitioning,
    /// RDMA mode: the QP owns the connection.
    Rdma,
    /// The switch failed and the connection was torn down.
    Failed,
}

impl fmt::Display for ConnState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConnState::Streaming => "streaming",
            ConnState::SwitchRequested => "switch requested",
            ConnState::Transitioning => "transition in progress",
            ConnState::Rdma => "RDMA mode",
            ConnState::Failed => "failed (connection torn down)",
        })
    }
}

/// Why a call on a [`StreamConnection`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// The call is not allowed in the connection's state.
    #[error("{op} is not allowed: the connection is in state {state}")]
    NotAllowed {
        /// The call.
        op: &'static str,
        /// The connection's state.
        state: ConnState,
    },
    /// A stream read after [`StreamConnection::request_switch`]: the octets
    /// that follow belong to RDMA mode.
    #[error("stream reads are refused once the switch to RDMA mode is requested")]
    ReadAfterSwitchRequest,
    /// The switch needs a QP: call [`StreamConnection::reserve`].
    #[error("no QP reserved for the switch")]
    NoQpReserved,
    /// The QP to reserve is not in IDLE or RTR.
    #[error("QP {qp_num} is in state {state}; reserving it needs IDLE or RTR")]
    QpNotIdle {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// IRD/ORD could not be changed (fixed once the switch started).
    #[error("{0}")]
    IrdOrd(#[from] ModifyError),
    /// The first receive could not be posted (the switch did not start).
    #[error("posting the first receive: {0}")]
    PostRecv(#[from] PostRecvError),
    /// The first receive could not be posted to the shared receive queue
    /// (the switch did not start).
    #[error("posting the first receive to the SRQ: {0}")]
    SrqPostRecv(#[from] crate::srq::PostRecvError),
    /// [`StreamConnection::unread`] would overflow the read-ahead buffer.
    #[error("read-ahead buffer full: {len} octets, at most {READ_AHEAD_MAX}")]
    ReadAheadFull {
        /// Octets it would hold.
        len: usize,
    },
    /// An earlier streaming write failed part way: the stream is not at a
    /// message boundary, the switch cannot start.
    #[error("an earlier streaming write was incomplete; the stream cannot be switched")]
    IncompleteWrite,
    /// The peer closed the connection.
    #[error("the peer closed the connection")]
    PeerClosed,
    /// The switch did not complete in time.
    #[error("switch to RDMA mode timed out")]
    TimedOut,
    /// The local MPA settings cannot be used.
    #[error("MPA settings: {0}")]
    MpaConfig(#[from] ConfigError),
    /// The peer's MPA exchange is wrong (garbage, refusal of the terms).
    #[error("MPA exchange at the switch: {}", describe_negotiation(.0))]
    Mpa(#[from] MpaNegotiationError),
    /// The peer rejected the MPA Request.
    #[error("the peer rejected the switch: {}", describe_reject(private_data))]
    Rejected {
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The QP refused the connection.
    #[error("{0}")]
    Establish(#[from] EstablishError),
    /// A socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

impl From<HandshakeError> for TransitionError {
    fn from(e: HandshakeError) -> Self {
        match e {
            HandshakeError::Config(e) => TransitionError::MpaConfig(e),
            HandshakeError::Negotiation(e) => TransitionError::Mpa(e),
            HandshakeError::Rejected { private_data } => TransitionError::Rejected { private_data },
            HandshakeError::TimedOut { .. } => TransitionError::TimedOut,
            HandshakeError::PeerClosed { .. } => TransitionError::PeerClosed,
            HandshakeError::Io(e) => io_error(e),
        }
    }
}

fn io_error(e: io::Error) -> TransitionError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => TransitionError::TimedOut,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::ConnectionAborted
        | io::ErrorKind::BrokenPipe => TransitionError::PeerClosed,
        _ => TransitionError::Io(e),
    }
}

/// A connected TCP stream used as a byte stream first and switched into
/// RDMA mode later (see the [module documentation](self)).
#[derive(Debug)]
pub struct StreamConnection {
    stream: Option<TcpStream>,
    /// Read-ahead: the unread octets are `rbuf[rpos..]`.
    rbuf: Vec<u8>,
    rpos: usize,
    state: ConnState,
    qp: Option<QueuePair>,
    mode: SwitchMode,
    timeout: Duration,
    write_broken: bool,
    negotiated: Option<Negotiated>,
    /// The switch in progress.
    pending: Option<PendingSwitch>,
    /// The caller said the socket has `TCP_NODELAY` (`.0`) and
    /// `O_NONBLOCK` (`.1`) set ([`StreamConnection::socket_already_set`]).
    socket_set: (bool, bool),
    /// The peer's address, as the caller knows it
    /// ([`StreamConnection::peer_already_known`]).
    peer: Option<SocketAddr>,
}

/// A switch in progress: the stream (non-blocking), the handshake (MPA
/// mode) or the parameters (direct mode, or once negotiated).
#[derive(Debug)]
struct PendingSwitch {
    stream: TcpStream,
    hs: Option<Handshake>,
    params: Option<LinkParams>,
    deadline: Instant,
    wait: Readiness,
}

impl StreamConnection {
    /// Wraps a connected stream in streaming mode; `mode` says how the
    /// switch will be done.
    pub fn new(stream: TcpStream, mode: SwitchMode) -> Self {
        StreamConnection {
            stream: Some(stream),
            rbuf: Vec::new(),
            rpos: 0,
            state: ConnState::Streaming,
            qp: None,
            mode,
            timeout: DEFAULT_SWITCH_TIMEOUT,
            write_broken: false,
            negotiated: None,
            pending: None,
            socket_set: (false, false),
            peer: None,
        }
    }

    /// Tells the switch that the socket already has `TCP_NODELAY`
    /// (`nodelay`) and `O_NONBLOCK` (`nonblocking`) set, and keeps them
    /// until the switch, so that it does not set them again: a system call
    /// less per switch for each, for a caller that knows (an interposing
    /// library that saw the application's flags). A stream said to be
    /// non-blocking must not be written in the streaming phase (its writes
    /// could be partial).
    pub fn socket_already_set(&mut self, nodelay: bool, nonblocking: bool) {
        self.socket_set = (nodelay, nonblocking);
    }

    /// Tells the switch the peer's address (what `getpeername(2)` says of
    /// the socket, as the `accept` or the `connect` that made it gave it):
    /// the QP takes it for [`QueuePair::query`]'s `peer` instead of asking
    /// the kernel, a system call less per switch.
    pub fn peer_already_known(&mut self, peer: SocketAddr) {
        self.peer = Some(peer);
    }

    /// The connection's state.
    pub fn state(&self) -> ConnState {
        self.state
    }

    /// The reserved QP.
    pub fn qp(&self) -> Option<&QueuePair> {
        self.qp.as_ref()
    }

    /// What the MPA exchange at the switch settled ([`SwitchMode::Mpa`],
    /// once in RDMA mode).
    pub fn negotiated(&self) -> Option<&Negotiated> {
        self.negotiated.as_ref()
    }

    /// Octets read ahead from the socket and not yet returned by a read.
    pub fn buffered(&self) -> usize {
        self.rbuf.len().saturating_sub(self.rpos)
    }

    /// The peer's address (streaming phase).
    pub fn peer_addr(&self) -> Result<SocketAddr, TransitionError> {
        Ok(self.stream("peer_addr")?.peer_addr()?)
    }

    /// Limits the whole switch (MPA exchange included) to `timeout`.
    pub fn set_switch_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Read and write timeouts of the streaming phase (`None`: block).
    pub fn set_stream_timeout(&mut self, timeout: Option<Duration>) -> Result<(), TransitionError> {
        let s = self.stream_mut("set_stream_timeout")?;
        s.set_read_timeout(timeout)?;
        s.set_write_timeout(timeout)?;
        Ok(())
    }

    fn not_allowed(&self, op: &'static str) -> TransitionError {
        TransitionError::NotAllowed {
            op,
            state: self.state,
        }
    }

    fn stream(&self, op: &'static str) -> Result<&TcpStream, TransitionError> {
        match (&self.stream, self.state) {
            (Some(s), ConnState::Streaming | ConnState::SwitchRequested) => Ok(s),
            _ => Err(self.not_allowed(op)),
        }
    }

    fn stream_mut(&mut self, op: &'static str) -> Result<&mut TcpStream, TransitionError> {
        let state = self.state;
        match (&mut self.stream, state) {
            (Some(s), ConnState::Streaming | ConnState::SwitchRequested) => Ok(s),
            _ => Err(TransitionError::NotAllowed { op, state }),
        }
    }

    fn check_read(&self, op: &'static str) -> Result<(), TransitionError> {
        match self.state {
            ConnState::Streaming => Ok(()),
            ConnState::SwitchRequested => Err(TransitionError::ReadAfterSwitchRequest),
            _ => Err(self.not_allowed(op)),
        }
    }

    /// Reads stream octets (streaming state only): from the read-ahead
    /// buffer, refilled with up to [`READ_AHEAD`] octets when empty. Returns
    /// 0 at the end of the stream.
    pub fn read(&mut self, buf: &mut [u8]) -> Result<usize, TransitionError> {
        self.check_read("read")?;
        if buf.is_empty() {
            return Ok(0);
        }
        if self.buffered() == 0 {
            self.rbuf.clear();
            self.rpos = 0;
            let mut chunk = [0u8; READ_AHEAD];
            let s = self.stream_mut("read")?;
            let n = loop {
                match s.read(&mut chunk) {
                    Ok(n) => break n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(TransitionError::Io(e)),
                }
            };
            self.rbuf
                .extend_from_slice(chunk.get(..n).unwrap_or_default());
        }
        let avail = self.rbuf.get(self.rpos..).unwrap_or_default();
        let n = avail.len().min(buf.len());
        if let (Some(dst), Some(src)) = (buf.get_mut(..n), avail.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.rpos += n;
        Ok(n)
    }

    /// Reads exactly `buf.len()` octets (streaming state only): one
    /// message of the application's framing.
    pub fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), TransitionError> {
        let mut done = 0;
        while let Some(rest) = buf.get_mut(done..).filter(|r| !r.is_empty()) {
            match self.read(rest)? {
                0 => return Err(TransitionError::PeerClosed),
                n => done += n,
            }
        }
        Ok(())
    }

    /// Gives back octets the application read past the end of its last
    /// streaming message: they are put in front of the read-ahead buffer
    /// (so, after a switch request, they go to the RDMA side). Allowed while
    /// streaming or after the switch request.
    pub fn unread(&mut self, octets: &[u8]) -> Result<(), TransitionError> {
        if !matches!(
            self.state,
            ConnState::Streaming | ConnState::SwitchRequested
        ) {
            return Err(self.not_allowed("unread"));
        }
        let len = self.buffered() + octets.len();
        if len > READ_AHEAD_MAX {
            return Err(TransitionError::ReadAheadFull { len });
        }
        let mut v = Vec::with_capacity(len);
        v.extend_from_slice(octets);
        v.extend_from_slice(self.rbuf.get(self.rpos..).unwrap_or_default());
        self.rbuf = v;
        self.rpos = 0;
        Ok(())
    }

    /// Writes all of `buf` to the stream (blocking). Allowed while
    /// streaming and after the switch request (last streaming messages).
    /// If it fails part way, the stream cannot be switched any more.
    pub fn write_all(&mut self, buf: &[u8]) -> Result<(), TransitionError> {
        let s = self.stream_mut("write")?;
        match s.write_all(buf) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.write_broken = true;
                Err(io_error(e))
            }
        }
    }

    /// Flushes the stream (streaming writes are not buffered by this type;
    /// kept for symmetry with [`Write`]).
    pub fn flush(&mut self) -> Result<(), TransitionError> {
        Ok(self.stream_mut("flush")?.flush()?)
    }

    /// Reserves `qp` (in IDLE or RTR) for the switch, replacing an earlier
    /// reservation. Allowed while streaming and after the switch request.
    pub fn reserve(&mut self, qp: &QueuePair) -> Result<(), TransitionError> {
        if !matches!(
            self.state,
            ConnState::Streaming | ConnState::SwitchRequested
        ) {
            return Err(self.not_allowed("reserve"));
        }
        let state = qp.state();
        if !matches!(state, QpState::Idle | QpState::Rtr) {
            return Err(TransitionError::QpNotIdle {
                qp_num: qp.qp_num(),
                state,
            });
        }
        self.qp = Some(qp.clone());
        Ok(())
    }

    /// Changes the reserved QP's IRD/ORD before the switch. Once the switch
    /// started they are fixed by the negotiation:
    /// [`TransitionError::IrdOrd`] then.
    pub fn set_ird_ord(&mut self, ird: u16, ord: u16) -> Result<(), TransitionError> {
        let qp = self.qp.as_ref().ok_or(TransitionError::NoQpReserved)?;
        match self.state {
            ConnState::Streaming | ConnState::SwitchRequested => Ok(qp.set_ird_ord(ird, ord)?),
            ConnState::Transitioning | ConnState::Rdma => Err(ModifyError::IrdOrdFixed {
                qp_num: qp.qp_num(),
            }
            .into()),
            ConnState::Failed => Err(self.not_allowed("set_ird_ord")),
        }
    }

    /// Requests the switch: stream reads are refused from now on; writes
    /// (the last streaming messages) are still allowed.
    pub fn request_switch(&mut self) -> Result<(), TransitionError> {
        if self.state != ConnState::Streaming {
            return Err(self.not_allowed("request_switch"));
        }
        self.state = ConnState::SwitchRequested;
        Ok(())
    }

    /// Posts the first receive on the reserved QP and switches the
    /// connection into RDMA mode (blocking, at most the switch timeout).
    ///
    /// Only after [`request_switch`](Self::request_switch). If the receive
    /// is refused, nothing else happens (the connection stays in
    /// [`ConnState::SwitchRequested`]). Any later failure tears the
    /// connection down ([`ConnState::Failed`]). On success the QP is in RTS
    /// and the connection is in [`ConnState::Rdma`].
    pub fn post_recv_and_switch(&mut self, wr: &RecvWr<'_>) -> Result<(), TransitionError> {
        self.start_switch("post_recv_and_switch", true, |qp| Ok(qp.post_recv(wr)?))
            .map(|_| ())
    }

    /// As [`post_recv_and_switch`](Self::post_recv_and_switch), for a QP
    /// created with a shared receive queue: the receive is posted to `srq`
    /// (which must be the reserved QP's).
    pub fn post_srq_recv_and_switch(
        &mut self,
        srq: &SharedReceiveQueue,
        wr: &RecvWr<'_>,
    ) -> Result<(), TransitionError> {
        self.start_switch("post_srq_recv_and_switch", true, |_| Ok(srq.post_recv(wr)?))
            .map(|_| ())
    }

    /// Posts the first receive on the reserved QP and starts the switch
    /// without blocking (for event loops; the sockets-direct library uses
    /// it). Returns `true` if the connection is already in RDMA mode (a
    /// [`SwitchMode::Direct`] switch, or an MPA exchange whose peer was
    /// quick); otherwise call [`poll_switch`](Self::poll_switch) whenever
    /// [`switch_fd`](Self::switch_fd) is readable (or writable, if
    /// [`switch_wants_write`](Self::switch_wants_write)) and at the switch
    /// timeout. Failures tear the connection down as with
    /// [`post_recv_and_switch`](Self::post_recv_and_switch).
    pub fn post_recv_and_begin_switch(&mut self, wr: &RecvWr<'_>) -> Result<bool, TransitionError> {
        self.start_switch("post_recv_and_begin_switch", false, |qp| {
            Ok(qp.post_recv(wr)?)
        })
    }

    /// As [`post_recv_and_begin_switch`](Self::post_recv_and_begin_switch),
    /// posting the first receive to `srq`.
    pub fn post_srq_recv_and_begin_switch(
        &mut self,
        srq: &SharedReceiveQueue,
        wr: &RecvWr<'_>,
    ) -> Result<bool, TransitionError> {
        self.start_switch("post_srq_recv_and_begin_switch", false, |_| {
            Ok(srq.post_recv(wr)?)
        })
    }

    /// Advances a switch started with
    /// [`post_recv_and_begin_switch`](Self::post_recv_and_begin_switch)
    /// without blocking: `true` once in RDMA mode, `false` while it waits
    /// for the socket. After the switch timeout it fails with
    /// [`TransitionError::TimedOut`] (and the connection is torn down).
    pub fn poll_switch(&mut self) -> Result<bool, TransitionError> {
        if self.state == ConnState::Rdma {
            return Ok(true);
        }
        if self.state != ConnState::Transitioning || self.pending.is_none() {
            return Err(self.not_allowed("poll_switch"));
        }
        self.drive_switch(false)
    }

    /// The socket of a switch in progress, for `poll(2)`/`epoll(7)`.
    pub fn switch_fd(&self) -> Option<BorrowedFd<'_>> {
        self.pending.as_ref().map(|p| p.stream.as_fd())
    }

    /// Whether the switch in progress waits for room to write (else for
    /// octets to read).
    pub fn switch_wants_write(&self) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| p.wait == Readiness::Write)
    }

    fn start_switch(
        &mut self,
        op: &'static str,
        blocking: bool,
        post: impl FnOnce(&QueuePair) -> Result<(), TransitionError>,
    ) -> Result<bool, TransitionError> {
        if self.state != ConnState::SwitchRequested {
            return Err(self.not_allowed(op));
        }
        let qp = self.qp.clone().ok_or(TransitionError::NoQpReserved)?;
        let state = qp.state();
        if !matches!(state, QpState::Idle | QpState::Rtr) {
            return Err(TransitionError::QpNotIdle {
                qp_num: qp.qp_num(),
                state,
            });
        }
        post(&qp)?;
        self.state = ConnState::Transitioning;
        if let Err(e) = self.begin(&qp) {
            self.tear_down(&qp);
            return Err(e);
        }
        self.drive_switch(blocking)
    }

    /// Runs the switch as far as it goes (to the end if `blocking`).
    fn drive_switch(&mut self, blocking: bool) -> Result<bool, TransitionError> {
        let Some(qp) = self.qp.clone() else {
            return Err(TransitionError::NoQpReserved);
        };
        match self.step(&qp, blocking) {
            Ok(true) => {
                self.state = ConnState::Rdma;
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                self.pending = None;
                self.tear_down(&qp);
                Err(e)
            }
        }
    }

    fn tear_down(&mut self, qp: &QueuePair) {
        if let Some(s) = self.stream.take() {
            // Best effort: the connection is being discarded.
            let _ = s.shutdown(Shutdown::Both);
        }
        self.rbuf = Vec::new();
        self.rpos = 0;
        // Flushes the pre-posted receives; the QP may already be in ERROR.
        let _ = qp.modify(QpState::Error);
        self.state = ConnState::Failed;
    }

    /// Prepares the switch: the stream goes non-blocking into `pending`,
    /// with the handshake (fed first with the read-ahead) in MPA mode.
    fn begin(&mut self, qp: &QueuePair) -> Result<(), TransitionError> {
        if self.write_broken {
            return Err(TransitionError::IncompleteWrite);
        }
        let deadline = clock::now() + self.timeout;
        let mut stream = self.stream.take().ok_or(TransitionError::PeerClosed)?;
        // Streaming writes were blocking: every streaming octet is in the
        // socket before anything of RDMA mode.
        stream.flush()?;
        // Read and write timeouts of the streaming phase stay set: they
        // apply to blocking calls only, and from here on every call on the
        // socket is non-blocking (the handshake's and the QP's; the stream
        // is not handed back). Two system calls less per side.
        if !self.socket_set.0 {
            stream.set_nodelay(true)?;
        }
        if !self.socket_set.1 {
            stream.set_nonblocking(true)?;
        }
        let (hs, params) = match self.mode.clone() {
            SwitchMode::Direct(params) => (None, Some(params)),
            SwitchMode::Mpa {
                role,
                mut config,
                private_data,
            } => {
                let a = qp.query();
                config.ird = a.ird;
                config.ord = a.ord;
                (Some(self.handshake(role, config, &private_data)?), None)
            }
        };
        self.pending = Some(PendingSwitch {
            stream,
            hs,
            params,
            deadline,
            wait: Readiness::Read,
        });
        Ok(())
    }

    /// Advances the pending switch; `true` once the QP is in RTS.
    fn step(&mut self, qp: &QueuePair, blocking: bool) -> Result<bool, TransitionError> {
        let Some(p) = self.pending.as_mut() else {
            return Err(TransitionError::PeerClosed);
        };
        while let Some(hs) = p.hs.as_mut() {
            match hs.advance(&mut p.stream) {
                Ok(Step::Wait(r)) => {
                    p.wait = r;
                    let left = remaining(p.deadline)?;
                    if !blocking {
                        return Ok(false);
                    }
                    wait_ready(p.stream.as_fd(), r, left)?;
                }
                Ok(Step::Done(Outcome::Established(n))) => {
                    p.params = Some(LinkParams::from(&n));
                    self.negotiated = Some(n);
                    self.rbuf = hs.take_prefix_rest();
                    self.rpos = 0;
                    p.hs = None;
                }
                Ok(Step::Done(_)) => return Err(MpaNegotiationError::Over.into()),
                Err(e) => return Err(e.into()),
            }
        }
        let Some(p) = self.pending.take() else {
            return Err(TransitionError::PeerClosed);
        };
        let params = p.params.ok_or(TransitionError::PeerClosed)?;
        let prefix = self.rbuf.get(self.rpos..).unwrap_or_default();
        // The stream is non-blocking with `TCP_NODELAY` already (`begin`).
        qp.establish_prepared(p.stream, &params, prefix, self.peer)?;
        self.rbuf = Vec::new();
        self.rpos = 0;
        Ok(true)
    }

    /// The handshake of the switch, fed first with the read-ahead octets.
    fn handshake(
        &mut self,
        role: MpaRole,
        config: MpaConfig,
        private_data: &[u8],
    ) -> Result<Handshake, TransitionError> {
        let (ird, ord) = (config.ird, config.ord);
        let hs = match role {
            MpaRole::Initiator => Handshake::initiator(config, private_data)?,
            MpaRole::Responder => Handshake::responder(
                config,
                Answer::Accept {
                    private_data: private_data.to_vec(),
                    ird,
                    ord,
                },
            )?,
        };
        let prefix = self.rbuf.get(self.rpos..).unwrap_or_default().to_vec();
        self.rbuf = Vec::new();
        self.rpos = 0;
        // The octets read past the handshake go to the QP with the rest
        // of the read-ahead (`step`).
        Ok(hs.with_prefix(prefix).reading_ahead())
    }
}

fn remaining(deadline: Instant) -> Result<Duration, TransitionError> {
    let left = deadline.saturating_duration_since(clock::now());
    if left.is_zero() {
        Err(TransitionError::TimedOut)
    } else {
        Ok(left)
    }
}
