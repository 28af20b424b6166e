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
//! They run the one handshake driver of [`crate::handshake`] (the same the
//! connection manager and the stream-to-RDMA switch use) in the caller's
//! thread. Both read exactly the octets of the handshake (frame headers
//! first, then the announced private data; FPDU length first, then the
//! rest), never more, so when they return the next octet read from the
//! stream is the first octet of the first FPDU of full operation, and
//! everything they had to send has been written. They set `TCP_NODELAY`,
//! leave the stream blocking and restore the read and write timeouts they
//! found.

use std::io;
use std::net::TcpStream;
use std::time::Duration;

use softrdma_proto::mpa::{ConfigError, MpaConfig, MpaNegotiationError, Negotiated, Request};

use crate::handshake::{
    Answer, Handshake, HandshakeError, Outcome, Secs, Stage, describe_negotiation, describe_reject,
    drive_blocking,
};

/// Why a connection could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectError {
    /// The local settings or private data cannot be used.
    #[error("MPA settings: {0}")]
    Config(#[from] ConfigError),
    /// The peer sent something unacceptable (or is not an MPA endpoint at
    /// all). A responder has answered a well-formed but refused Request
    /// with a reject before returning this.
    #[error("{}", describe_negotiation(.0))]
    Negotiation(#[from] MpaNegotiationError),
    /// The responder rejected the connection.
    #[error("rejected: {}", describe_reject(private_data))]
    Rejected {
        /// The responder's private data.
        private_data: Vec<u8>,
    },
    /// The handshake did not complete within the timeout.
    #[error("TCP connected but no {stage} within {} (is the peer an iWARP/MPA endpoint?)", Secs(*after))]
    TimedOut {
        /// What was missing.
        stage: Stage,
        /// The time allowed.
        after: Duration,
    },
    /// The peer closed the connection during the handshake.
    #[error("the peer closed the connection (while waiting for the {stage})")]
    PeerClosed {
        /// What was expected.
        stage: Stage,
    },
    /// A socket error.
    #[error("socket: {0}")]
    Io(#[from] io::Error),
}

impl From<HandshakeError> for ConnectError {
    fn from(e: HandshakeError) -> Self {
        match e {
            HandshakeError::Config(e) => ConnectError::Config(e),
            HandshakeError::Negotiation(e) => ConnectError::Negotiation(e),
            HandshakeError::Rejected { private_data } => ConnectError::Rejected { private_data },
            HandshakeError::TimedOut { stage, after } => ConnectError::TimedOut { stage, after },
            HandshakeError::PeerClosed { stage } => ConnectError::PeerClosed { stage },
            HandshakeError::Io(e) => ConnectError::Io(e),
        }
    }
}

/// Runs `hs` on `stream` with TCP_NODELAY, leaving the stream blocking
/// with the timeouts it had.
fn run(
    stream: &mut TcpStream,
    mut hs: Handshake,
    timeout: Duration,
) -> Result<Outcome, ConnectError> {
    stream.set_nodelay(true)?;
    let saved = (stream.read_timeout()?, stream.write_timeout()?);
    let r = drive_blocking(&mut hs, stream, timeout);
    let restored = stream
        .set_nonblocking(false)
        .and_then(|()| stream.set_read_timeout(saved.0))
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
    let hs = Handshake::initiator(config.clone(), private_data)?;
    match run(stream, hs, timeout)? {
        Outcome::Established(n) => Ok(n),
        _ => Err(MpaNegotiationError::Over.into()),
    }
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
    let answer = Answer::Accept {
        private_data: private_data.to_vec(),
        ird: config.ird,
        ord: config.ord,
    };
    let hs = Handshake::responder(config.clone(), answer)?;
    match run(stream, hs, timeout)? {
        Outcome::Established(n) => Ok(n),
        _ => Err(MpaNegotiationError::Over.into()),
    }
}

/// Runs the responder side on `stream` and rejects the Request with
/// `private_data`; returns the Request once the reject has been written.
pub fn mpa_reject(
    stream: &mut TcpStream,
    config: &MpaConfig,
    private_data: &[u8],
    timeout: Duration,
) -> Result<Request, ConnectError> {
    let hs = Handshake::responder(config.clone(), Answer::Reject(private_data.to_vec()))?;
    match run(stream, hs, timeout)? {
        Outcome::RejectSent(Some(r)) => Ok(r),
        _ => Err(MpaNegotiationError::Over.into()),
    }
}
