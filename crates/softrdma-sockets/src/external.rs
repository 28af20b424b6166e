//! The client half of the switch for code that connects descriptors it
//! does not own (an `LD_PRELOAD` library interposing on `connect`): ask the
//! server's UDP twin about a connection before the SYN, as
//! [`TcpStream::connect`](crate::TcpStream::connect) does, then switch the
//! connected stream with [`TcpStream::upgrade`](crate::TcpStream::upgrade).
//! The listener half (a twin answering queries) is the [`detect`]
//! wire format, which such a library can serve itself.
//!
//! A destination whose twin decides *late* queries (it said so in an
//! earlier answer: [`known_late_queries`]) can be asked without waiting:
//! [`send_query`] before the connect, [`PendingQuery::wait_late`] after it,
//! so that the query's round trip overlaps the TCP handshake and the
//! caller seldom sleeps for the answer.

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
/// answer is cached per destination). A query not answered in time is
/// withdrawn before this returns (see the [`detect`] module docs): the
/// caller then connects plain, from that port or another.
pub fn query(dest: SocketAddr, client_port: u16, timeout: Duration) -> PeerAnswer {
    // A socket of its own per query: no descriptor is kept open in the
    // application's process.
    match detect::query(dest, client_port, timeout, false) {
        Answer::Accept => PeerAnswer::Accept,
        Answer::Decline => PeerAnswer::Decline,
        Answer::NotCapable => PeerAnswer::NotCapable,
    }
}

/// Whether `dest`'s twin is known (cached from an earlier answer) to decide
/// queries that arrive after the connection was accepted: the query may
/// go just before the SYN ([`send_query`]).
pub fn known_late_queries(dest: SocketAddr) -> bool {
    detect::known_late_queries(dest)
}

/// A twin of this process now answers on `local` (the address its
/// listener bound; an unspecified IP means every address): the "no twin"
/// answers this process cached for that port are forgotten, so that its
/// connections to its own new listener ask the twin instead of going plain
/// for the rest of the cache's lifetime. A library serving its own twins
/// calls this once the twin's socket is bound.
pub fn forget_plain_at(local: SocketAddr) {
    detect::forget_plain_at(local)
}

/// A capability query on its way, its answer not read yet.
#[derive(Debug)]
pub struct PendingQuery(detect::Pending);

/// What a query sent before the connect found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LateAnswer {
    /// The listener switches the connection (the client is the initiator).
    Accept,
    /// The listener keeps it plain; `too_late`: the connection was accepted
    /// before the query came.
    Decline {
        /// The query came after the connection was accepted.
        too_late: bool,
    },
    /// No twin there (the query was refused): plain.
    NoTwin,
    /// No usable answer: the listener may switch the connection or not,
    /// so it must not carry data; make another one (that asks first, or
    /// asks nobody and stays plain).
    Unknown,
}

/// Sends the query for the connection from local TCP port `client_port`
/// to `dest` without waiting for the answer (on a socket of its own, closed
/// with the returned value); `None` if it could not be sent. Meant for a
/// destination that [`known_late_queries`].
pub fn send_query(dest: SocketAddr, client_port: u16) -> Option<PendingQuery> {
    detect::send_query_with(dest, client_port, false)
        .ok()
        .map(PendingQuery)
}

impl PendingQuery {
    /// Waits for the answer, at most `timeout` from the send (capped at
    /// [`detect::LATE_QUERY_MAX_WAIT`]); updates the cache.
    pub fn wait_late(self, timeout: Duration) -> LateAnswer {
        match self.0.wait_late(timeout) {
            detect::LateAnswer::Accept => LateAnswer::Accept,
            detect::LateAnswer::Decline { too_late } => LateAnswer::Decline { too_late },
            detect::LateAnswer::NoTwin => LateAnswer::NoTwin,
            detect::LateAnswer::Unknown => LateAnswer::Unknown,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{FLAG_LATE_QUERY, FLAG_TOO_LATE, Kind, Probe};
    use std::net::UdpSocket;

    /// A twin stand-in answering each query with `kind` and `flags`.
    fn answering(kind: Kind, flags: u8, n: usize) -> (SocketAddr, std::thread::JoinHandle<()>) {
        let s = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = s.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            for _ in 0..n {
                let (len, from) = s.recv_from(&mut b).unwrap();
                let q = Probe::decode(&b[..len]).unwrap();
                s.send_to(&Probe { kind, flags, ..q }.encode(), from)
                    .unwrap();
            }
        });
        (addr, th)
    }

    /// A twin that says it decides late queries is known as such after its
    /// first answer, and a query sent without waiting is answered after
    /// the caller's own work (the connect, for a real client).
    #[test]
    fn late_queries_are_learned_and_answered_after_the_connect() {
        let (addr, th) = answering(Kind::Accept, FLAG_LATE_QUERY, 2);
        assert!(!known_late_queries(addr));
        assert_eq!(
            query(addr, 40100, Duration::from_secs(5)),
            PeerAnswer::Accept
        );
        assert!(known_late_queries(addr));
        let p = send_query(addr, 40101).expect("sent");
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Accept);
        th.join().unwrap();
    }

    /// A late query that came after the accept is declined as too late (the
    /// connection stays plain at both ends).
    #[test]
    fn a_late_query_declined_too_late_says_so() {
        let (addr, th) = answering(Kind::Decline, FLAG_LATE_QUERY | FLAG_TOO_LATE, 1);
        let p = send_query(addr, 40102).expect("sent");
        assert_eq!(
            p.wait_late(Duration::from_secs(5)),
            LateAnswer::Decline { too_late: true }
        );
        th.join().unwrap();
    }

    /// A twin that accepts without deciding late queries (an older one):
    /// the listener may have decided the connection either way, so the
    /// answer is unknown.
    #[test]
    fn an_accept_without_the_late_flag_is_unknown() {
        let (addr, th) = answering(Kind::Accept, 0, 1);
        let p = send_query(addr, 40103).expect("sent");
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Unknown);
        th.join().unwrap();
    }
}
