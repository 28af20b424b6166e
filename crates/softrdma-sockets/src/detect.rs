//! Finding out whether the peer runs sockets direct, without putting a
//! byte on the TCP connection.
//!
//! Every listener that may offload has a *UDP twin*: a UDP socket bound to
//! the same address and port number as the TCP listener (UDP and TCP port
//! spaces are separate, as the iWARP port mapper of the SDP-for-iWARP
//! specification and `iwpmd` use UDP beside TCP). Before it connects, a
//! client that wants offload binds its TCP socket (so its port is known)
//! and sends a 40-octet *query* from a UDP socket connected to the
//! server's address and port:
//!
//! ```text
//!  0       4   5   6       8               16      18  20      22  24                40
//!  +-------+---+---+-------+---------------+-------+---+-------+---+-----------------+
//!  | "SRSD"|ver|knd|  0    |     nonce     | cport | 0 | sport | 0 |  client address |
//!  +-------+---+---+-------+---------------+-------+---+-------+---+-----------------+
//! ```
//!
//! The twin records `(source address of the datagram, cport)` as a
//! connection that will speak SDP and answers *accept* (kind 2) with the
//! same nonce; a listener whose policy is plain TCP answers *decline*
//! (kind 3). Only then does the client connect; the listener finds the
//! record when it accepts the connection from that address and port, so
//! both ends know before the first byte whether the stream is switched.
//!
//! A host without sockets direct has no twin: the query draws an ICMP port
//! unreachable (the connected UDP socket reports `ECONNREFUSED` at once) or
//! nothing (a firewall): after [`Config::probe_timeout`] the client gives
//! up. Either answer is cached per destination for [`NEGATIVE_TTL`], so
//! later connections to a plain peer cost nothing. A plain client never
//! queries, so the listener never finds a record and keeps its connection
//! plain: every byte flows exactly as sent, whoever speaks first.
//!
//! [`Config::probe_timeout`]: crate::Config::probe_timeout

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Length of a query or answer.
pub const MSG_LEN: usize = 40;
/// Magic at the start of every query and answer.
pub const MAGIC: [u8; 4] = *b"SRSD";
/// Protocol version.
pub const VERSION: u8 = 1;
/// How long a negative answer (no twin) is remembered per destination.
pub const NEGATIVE_TTL: Duration = Duration::from_secs(60);
/// Least wait for an answer on loopback, where a host without a twin
/// answers at once (ICMP port unreachable) and silence means a busy twin.
pub const LOOPBACK_PROBE_WAIT: Duration = Duration::from_secs(1);
/// How long a listener keeps a query's record waiting for its connection.
pub const RECORD_TTL: Duration = Duration::from_secs(10);

/// Kind of a detection message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Client: "this connection will speak SDP if you agree".
    Query = 1,
    /// Listener: agreed, the connection will be switched.
    Accept = 2,
    /// Listener: keep this connection plain.
    Decline = 3,
}

/// A detection message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    /// Kind.
    pub kind: Kind,
    /// Matches an answer to its query.
    pub nonce: u64,
    /// The client's TCP port.
    pub client_port: u16,
    /// The server's TCP port.
    pub server_port: u16,
    /// The client's address as it knows it (informational).
    pub client_addr: Ipv6Addr,
}

impl Probe {
    /// Encodes the 40 octets.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[8..16].copy_from_slice(&self.nonce.to_be_bytes());
        b[16..18].copy_from_slice(&self.client_port.to_be_bytes());
        b[20..22].copy_from_slice(&self.server_port.to_be_bytes());
        b[24..40].copy_from_slice(&self.client_addr.octets());
        b
    }

    /// Decodes; `None` for anything that is not a detection message.
    pub fn decode(b: &[u8]) -> Option<Probe> {
        if b.len() != MSG_LEN || b[0..4] != MAGIC || b[4] != VERSION {
            return None;
        }
        let kind = match b[5] {
            1 => Kind::Query,
            2 => Kind::Accept,
            3 => Kind::Decline,
            _ => return None,
        };
        let mut nonce = [0u8; 8];
        nonce.copy_from_slice(&b[8..16]);
        let mut addr = [0u8; 16];
        addr.copy_from_slice(&b[24..40]);
        Some(Probe {
            kind,
            nonce: u64::from_be_bytes(nonce),
            client_port: u16::from_be_bytes([b[16], b[17]]),
            server_port: u16::from_be_bytes([b[20], b[21]]),
            client_addr: Ipv6Addr::from(addr),
        })
    }
}

/// What a query found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Answer {
    Accept,
    Decline,
    NotCapable,
}

fn cache() -> &'static Mutex<HashMap<SocketAddr, Instant>> {
    static CACHE: OnceLock<Mutex<HashMap<SocketAddr, Instant>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether `dest` is known not to run sockets direct.
pub(crate) fn known_plain(dest: SocketAddr) -> bool {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    match c.get(&dest) {
        Some(&until) if until > Instant::now() => true,
        Some(_) => {
            c.remove(&dest);
            false
        }
        None => false,
    }
}

fn remember_plain(dest: SocketAddr) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    if c.len() > 4096 {
        let now = Instant::now();
        c.retain(|_, until| *until > now);
    }
    c.insert(dest, Instant::now() + NEGATIVE_TTL);
}

/// Forgets the cached answers (tests, or after a configuration change).
pub fn clear_cache() {
    cache().lock().unwrap_or_else(|e| e.into_inner()).clear();
}

fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// Asks `dest`'s twin whether the connection from `client_port` may be
/// offloaded. Caches a negative answer.
pub(crate) fn query(dest: SocketAddr, client_port: u16, timeout: Duration) -> Answer {
    let bind: SocketAddr = if dest.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let answer = (|| -> io::Result<Answer> {
        let s = UdpSocket::bind(bind)?;
        s.connect(dest)?;
        let client_addr = match s.local_addr()?.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        let q = Probe {
            kind: Kind::Query,
            nonce: nonce(),
            client_port,
            server_port: dest.port(),
            client_addr,
        };
        let deadline = Instant::now() + timeout;
        // Two tries, half the time each (a lost datagram on a LAN).
        for attempt in 0..2 {
            s.send(&q.encode())?;
            let until = if attempt == 0 {
                Instant::now() + timeout / 2
            } else {
                deadline
            };
            loop {
                let left = until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                s.set_read_timeout(Some(left))?;
                let mut b = [0u8; 64];
                match s.recv(&mut b) {
                    Ok(n) => match Probe::decode(&b[..n]) {
                        Some(a) if a.nonce == q.nonce && a.kind == Kind::Accept => {
                            return Ok(Answer::Accept);
                        }
                        Some(a) if a.nonce == q.nonce && a.kind == Kind::Decline => {
                            return Ok(Answer::Decline);
                        }
                        _ => {}
                    },
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        return Ok(Answer::NotCapable);
                    }
                    Err(e)
                        if matches!(
                            e.kind(),
                            io::ErrorKind::WouldBlock
                                | io::ErrorKind::TimedOut
                                | io::ErrorKind::Interrupted
                        ) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        Ok(Answer::NotCapable)
    })()
    .unwrap_or(Answer::NotCapable);
    if answer == Answer::NotCapable {
        remember_plain(dest);
    }
    answer
}

/// A listener's UDP twin: answers queries on its own thread (a query must
/// be answered while the application is busy elsewhere) and keeps the
/// records of connections that will be switched.
#[derive(Debug)]
pub(crate) struct Twin {
    records: Arc<Mutex<HashMap<SocketAddr, Instant>>>,
    stop: Arc<AtomicBool>,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl Twin {
    /// Binds the twin to `addr` (the TCP listener's address) and starts
    /// answering; `accept` false answers every query with a decline.
    pub(crate) fn start(addr: SocketAddr, accept: bool) -> io::Result<Twin> {
        let sock = UdpSocket::bind(addr)?;
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        let records: Arc<Mutex<HashMap<SocketAddr, Instant>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (records.clone(), stop.clone());
        std::thread::Builder::new()
            .name("softrdma-sd-twin".into())
            .spawn(move || serve(sock, r, s, accept))?;
        Ok(Twin { records, stop })
    }

    /// Whether a client queried for the connection from `peer` (the record
    /// is consumed).
    pub(crate) fn take(&self, peer: SocketAddr) -> bool {
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        matches!(r.remove(&canonical(peer)), Some(until) if until > Instant::now())
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

fn serve(
    sock: UdpSocket,
    records: Arc<Mutex<HashMap<SocketAddr, Instant>>>,
    stop: Arc<AtomicBool>,
    accept: bool,
) {
    let mut b = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        let (n, from) = match sock.recv_from(&mut b) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let Some(q) = Probe::decode(&b[..n]) else {
            continue;
        };
        if q.kind != Kind::Query {
            continue;
        }
        let kind = if accept {
            let key = SocketAddr::new(from.ip().to_canonical(), q.client_port);
            let mut r = records.lock().unwrap_or_else(|e| e.into_inner());
            let now = Instant::now();
            if r.len() > 4096 {
                r.retain(|_, until| *until > now);
            }
            r.insert(key, now + RECORD_TTL);
            Kind::Accept
        } else {
            Kind::Decline
        };
        let a = Probe { kind, ..q };
        // A lost answer makes the client time out and stay plain.
        let _ = sock.send_to(&a.encode(), from);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_golden() {
        let p = Probe {
            kind: Kind::Query,
            nonce: 0x0102_0304_0506_0708,
            client_port: 0xABCD,
            server_port: 80,
            client_addr: Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(),
        };
        let b = p.encode();
        let mut want = b"SRSD".to_vec();
        want.extend_from_slice(&[
            1, 1, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0xAB, 0xCD, 0, 0, 0, 80, 0, 0,
        ]);
        want.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1]);
        assert_eq!(b.to_vec(), want);
        assert_eq!(Probe::decode(&b), Some(p));
        let mut bad = b;
        bad[0] = b'X';
        assert_eq!(Probe::decode(&bad), None);
        assert_eq!(Probe::decode(&b[..39]), None);
        let mut bad = b;
        bad[5] = 9;
        assert_eq!(Probe::decode(&bad), None);
    }
}
