//! Blocking MPA connection setup over a [`TcpStream`].
//!
//! Small helpers that run the sans-IO MPA machines of
//! [`softrdma_proto::mpa`] over an already connected stream, until the
//! connection is in full operation (RFC 5044 section 7.1, RFC 6581):
//!
//! ```text
//!  mpa_connect (initiator)                 mpa_accept (responder)
//!  ── MPA Request ──────────────────────────▶
//!  ◀────────────────────────────────── MPA Reply
//!  peer-to-peer mode only:
//!  ── RTR FPDU (zero-length Write/Read/Send) ▶
//!  ◀──────────── zero-length Read Response     (Read RTR only)
//! ```
//!
//! Both read exactly the octets of the handshake (frame headers first, then
//! the announced private data; FPDU length first, then the rest), never
//! more, so when they return the next octet read from the stream is the
//! first octet of the first FPDU of full operation, and everything they had
//! to send has been written. They set `TCP_NODELAY` and restore the read and
//! write timeouts they found. A connection manager will replace them.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use softrdma_proto::mpa::{
    ConfigError, Initiator, InitiatorEvent, MpaConfig, MpaNegotiationError, Negotiated, Request,
    Responder, ResponderEvent,
};
use softrdma_proto::wire::mpa::{HEADER_LEN, MPA_MAX_PRIVATE_DATA};

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The local settings or private data cannot be used.
    #[error("MPA settings: {0}")]
    Config(#[from] ConfigError),
    /// The peer sent something unacceptable. A responder has answered a
    /// well-formed but refused Request with a reject before returning this.
    #[error("MPA negotiation: {0}")]
    Negotiation(#[from] MpaNegotiationError),
    /// The responder rejected the connection.
    #[error("connection rejected by the peer ({} octets of private data)", private_data.len())]
    Rejected {
        /// The responder's private data.
        private_data: Vec<u8>,
    },
    /// The handshake did not complete within the timeout.
    #[error("MPA negotiation timed out")]
    TimedOut,
    /// The peer closed the connection during the handshake.
    #[error("peer closed the connection during MPA negotiation")]
    PeerClosed,
    /// A socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

/// The larger of a frame and an RTR exchange FPDU.
pub(crate) const RX_CHUNK: usize = HEADER_LEN + MPA_MAX_PRIVATE_DATA;

/// How often a blocked handshake read checks whether it was cancelled.
pub(crate) const CANCEL_POLL: Duration = Duration::from_millis(100);

/// Why a handshake read or write stopped (shared by the blocking helpers
/// here and the connection manager, which map it to their own errors).
#[derive(Debug)]
pub(crate) enum HandshakeIoError {
    /// The deadline passed.
    TimedOut,
    /// The peer closed or reset the connection.
    PeerClosed,
    /// The caller cancelled (listener going away).
    Cancelled,
    /// Another socket error.
    Io(io::Error),
}

impl From<io::Error> for HandshakeIoError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => HandshakeIoError::TimedOut,
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => HandshakeIoError::PeerClosed,
            _ => HandshakeIoError::Io(e),
        }
    }
}

impl From<HandshakeIoError> for ConnectError {
    fn from(e: HandshakeIoError) -> Self {
        match e {
            HandshakeIoError::TimedOut | HandshakeIoError::Cancelled => ConnectError::TimedOut,
            HandshakeIoError::PeerClosed => ConnectError::PeerClosed,
            HandshakeIoError::Io(e) => ConnectError::Io(e),
        }
    }
}

/// A point in time a handshake must finish by.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline(Instant);

impl Deadline {
    /// `t` from now (saturating far in the future).
    pub(crate) fn after(t: Duration) -> Self {
        let now = Instant::now();
        Deadline(
            now.checked_add(t)
                .unwrap_or(now + Duration::from_secs(86_400 * 365)),
        )
    }

    /// Time left, or `TimedOut`.
    pub(crate) fn remaining(&self) -> Result<Duration, HandshakeIoError> {
        let left = self.0.saturating_duration_since(Instant::now());
        if left.is_zero() {
            Err(HandshakeIoError::TimedOut)
        } else {
            Ok(left)
        }
    }
}

/// Writes all of `bytes` before the deadline.
pub(crate) fn send_all(
    stream: &mut TcpStream,
    mut bytes: &[u8],
    d: &Deadline,
) -> Result<(), HandshakeIoError> {
    while !bytes.is_empty() {
        stream.set_write_timeout(Some(d.remaining()?))?;
        match stream.write(bytes) {
            Ok(0) => return Err(HandshakeIoError::PeerClosed),
            Ok(n) => bytes = bytes.get(n..).unwrap_or_default(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Reads at most `want` octets (at least one) before the deadline, giving
/// up early once `cancelled` says so (checked every [`CANCEL_POLL`]).
pub(crate) fn recv_some<'b>(
    stream: &mut TcpStream,
    buf: &'b mut [u8; RX_CHUNK],
    want: usize,
    d: &Deadline,
    cancelled: &dyn Fn() -> bool,
) -> Result<&'b [u8], HandshakeIoError> {
    let limit = want.clamp(1, RX_CHUNK);
    loop {
        let left = d.remaining()?;
        if cancelled() {
            return Err(HandshakeIoError::Cancelled);
        }
        stream.set_read_timeout(Some(left.min(CANCEL_POLL)))?;
        let dst = buf.get_mut(..limit).unwrap_or_default();
        match stream.read(dst) {
            Ok(0) => return Err(HandshakeIoError::PeerClosed),
            Ok(n) => return Ok(buf.get(..n).unwrap_or_default()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::Interrupted
                        | io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// Never cancelled.
pub(crate) fn never() -> bool {
    false
}

/// Runs `f` with TCP_NODELAY set and the stream's timeouts restored after.
fn with_stream<T>(
    stream: &mut TcpStream,
    f: impl FnOnce(&mut TcpStream) -> Result<T, ConnectError>,
) -> Result<T, ConnectError> {
    stream.set_nodelay(true)?;
    let saved = (stream.read_timeout()?, stream.write_timeout()?);
    let r = f(stream);
    let restored = stream
        .set_read_timeout(saved.0)
        .and_then(|()| stream.set_write_timeout(saved.1));
    let value = r?;
    restored?;
    Ok(value)
}

/// Runs the initiator side on `stream`: sends the MPA Request carrying
/// `private_data`, takes the Reply and, in peer-to-peer mode, sends the RTR
/// (and, for a Read RTR, takes the zero-length Read Response). On success
/// the stream is positioned at the first FPDU of full operation and the RTR
/// has been written.
///
/// # Errors
///
/// [`ConnectError::Rejected`] if the responder rejects; the other
/// variants as documented on [`ConnectError`].
pub fn mpa_connect(
    stream: &mut TcpStream,
    config: &MpaConfig,
    private_data: &[u8],
    timeout: Duration,
) -> Result<Negotiated, ConnectError> {
    let mut m = Initiator::new(config.clone(), private_data)?;
    let d = Deadline::after(timeout);
    with_stream(stream, |stream| {
        let mut buf = [0u8; RX_CHUNK];
        loop {
            let out = m.transmit().to_vec();
            send_all(stream, &out, &d)?;
            m.consumed(out.len());
            match m.poll() {
                Some(InitiatorEvent::Established(n)) => return Ok(n),
                Some(InitiatorEvent::Rejected { private_data, .. }) => {
                    return Err(ConnectError::Rejected { private_data });
                }
                _ => {}
            }
            let want = m.want();
            if want == 0 {
                return Err(MpaNegotiationError::Over.into());
            }
            let got = recv_some(stream, &mut buf, want, &d, &never)?;
            m.receive(got)?;
        }
    })
}

/// Runs the responder side on `stream`: takes the MPA Request, accepts it
/// with `private_data` and the IRD/ORD of `config`, and in peer-to-peer
/// mode takes the RTR (answering a Read RTR with a zero-length Read
/// Response). On success the Reply (and the Read Response) have been
/// written and the stream is positioned at the first FPDU of full
/// operation.
///
/// A well-formed Request whose terms are refused (CRC switched off,
/// markers, no common RTR kind, too much private data) is answered with a
/// reject carrying no private data before the error is returned.
pub fn mpa_accept(
    stream: &mut TcpStream,
    config: &MpaConfig,
    private_data: &[u8],
    timeout: Duration,
) -> Result<Negotiated, ConnectError> {
    respond(stream, config, timeout, |m| {
        m.accept(private_data, config.ird, config.ord)
    })?
    .ok_or(ConnectError::Negotiation(MpaNegotiationError::Over))
}

/// Runs the responder side on `stream` and rejects the Request with
/// `private_data`; returns the Request once the reject has been written.
pub fn mpa_reject(
    stream: &mut TcpStream,
    config: &MpaConfig,
    private_data: &[u8],
    timeout: Duration,
) -> Result<Request, ConnectError> {
    let mut request = None;
    respond(stream, config, timeout, |m| {
        request = m.request().cloned();
        m.reject(private_data)
    })?;
    request.ok_or(ConnectError::Negotiation(MpaNegotiationError::Over))
}

/// The responder loop; `answer` is called once, when the Request is there.
/// Returns the negotiated connection, or `None` if `answer` rejected.
fn respond(
    stream: &mut TcpStream,
    config: &MpaConfig,
    timeout: Duration,
    answer: impl FnOnce(&mut Responder) -> Result<(), ConfigError>,
) -> Result<Option<Negotiated>, ConnectError> {
    let mut m = Responder::new(config.clone())?;
    let d = Deadline::after(timeout);
    let mut answer = Some(answer);
    with_stream(stream, |stream| {
        let mut buf = [0u8; RX_CHUNK];
        loop {
            let out = m.transmit().to_vec();
            send_all(stream, &out, &d)?;
            m.consumed(out.len());
            match m.poll() {
                Some(ResponderEvent::Established(n)) => return Ok(Some(n)),
                Some(ResponderEvent::Request(_)) => {
                    if let Some(f) = answer.take() {
                        f(&mut m)?;
                    }
                    continue;
                }
                _ => {}
            }
            if m.is_over() && m.transmit().is_empty() {
                return Ok(None);
            }
            let want = m.want();
            if want == 0 {
                return Err(MpaNegotiationError::Over.into());
            }
            let got = recv_some(stream, &mut buf, want, &d, &never)?;
            if let Err(e) = m.receive(got) {
                if m.request().is_some() && m.reject(&[]).is_ok() {
                    let out = m.transmit().to_vec();
                    // Best effort: the error is what the caller needs.
                    let _ = send_all(stream, &out, &d);
                }
                return Err(e.into());
            }
        }
    })
}
