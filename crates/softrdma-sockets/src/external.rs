//! The client half of the switch for code that connects descriptors it
//! does not own (an `LD_PRELOAD` library interposing on `connect`): ask the
//! server's UDP twin about a connection before the SYN, as
//! [`TcpStream::connect`](crate::TcpStream::connect) does, then switch the
//! connected stream with [`TcpStream::upgrade`](crate::TcpStream::upgrade).
//! The listener half (a twin answering queries) is the [`detect`]
//! wire format, which such a library can serve itself.

use std::net::SocketAddr;
use std::time::Duration;

use crate::detect::{self, Answer};

/// What a capability query found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerAnswer {
    /// The listener agreed: the connection from the queried port is to be
    /// switched (the client is the initiator).
    Accept,
    /// The listener runs sockets direct but keeps this connection plain.
    Decline,
    /// No twin answered (or the host refused the query): plain.
    NotCapable,
}

/// Whether `dest` is known (cached) not to run sockets direct.
pub fn known_plain(dest: SocketAddr) -> bool {
    detect::known_plain(dest)
}

/// Asks `dest`'s twin whether the connection from local TCP port
/// `client_port` may be offloaded, waiting at most `timeout` (a negative
/// answer is cached per destination).
pub fn query(dest: SocketAddr, client_port: u16, timeout: Duration) -> PeerAnswer {
    // A socket of its own per query: no descriptor is kept open in the
    // application's process.
    match detect::query(dest, client_port, timeout, false) {
        Answer::Accept => PeerAnswer::Accept,
        Answer::Decline => PeerAnswer::Decline,
        Answer::NotCapable => PeerAnswer::NotCapable,
    }
}
