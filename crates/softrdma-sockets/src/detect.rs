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
//!  0       4   5   6   7   8               16      18  20      22  24                40
//!  +-------+---+---+---+---+---------------+-------+---+-------+---+-----------------+
//!  | "SRSD"|ver|knd|flg| 0 |     nonce     | cport | 0 | sport | 0 |  client address |
//!  +-------+---+---+---+---+---------------+-------+---+-------+---+-----------------+
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
//! later connections to a plain peer cost nothing (a listener of the same
//! process that binds the port, with its twin, ends the cached answer at
//! once, and an answer to a query sent before that bind is not cached). A
//! plain client never queries, so the listener never finds a record and
//! keeps its connection plain: every byte flows exactly as sent, whoever
//! speaks first.
//!
//! ## Giving up: the withdraw
//!
//! Silence does not prove there is no twin: a twin whose process is
//! starved past the client's wait (stopped, or on a very busy machine)
//! still takes the query from its socket when it runs again, and would
//! record a connection the client has by then made plain. So a client that
//! hears nothing in time sends a *withdraw* (kind 4: the query's octets,
//! same nonce, client port and address, only the kind changed) from the
//! query's socket *before* it connects plain, and the twin answers nothing
//! to it. The twin turns the record of that query into a plain mark (a
//! retry of the query that comes after it is declined, and the connection
//! from the port is kept plain); a record of another query (another nonce)
//! is left alone. The withdraw is queued on the twin's socket behind the
//! query and ahead of the SYN, and the listener reads what is queued there
//! before it decides an accepted connection, in every case (also when the
//! twin thread took the query already: the withdraw may still be queued
//! behind it), so the query and the withdraw are seen in order, by the
//! twin thread or by the accepting one. [`crate::TcpStream`] connects plain
//! from another port after silence too, and the withdraw keeps the query's
//! record from switching a later connection from the port it named (another
//! program's, within [`RECORD_TTL`]); the `LD_PRELOAD` library connects
//! from the port the application's socket has, which may be the
//! application's own choice, so the withdraw is what keeps it plain. A
//! query sent with the SYN and not answered in time (below) is withdrawn
//! as well. New kinds are added under the same [`VERSION`]: a twin that
//! does not know a kind ignores the datagram (no answer, no record), so an
//! older twin ignores a withdraw (and may still switch such a connection
//! from the port the query named, as before); the version changes only for
//! a layout an older twin would misread. A withdraw that is lost (a LAN) leaves the
//! case as it was before withdraws: the twin's record may switch the plain
//! connection.
//!
//! ## Query and SYN together
//!
//! The query costs a round trip of its own before the TCP connect. A twin
//! that can decide a query arriving *after* its connection was accepted
//! sets [`FLAG_LATE_QUERY`] in its answers: when it accepts a connection no
//! query asked for, it keeps a *plain mark* for it (for [`RECORD_TTL`]),
//! and a query that finds the mark is declined; a query and an accept
//! decide under one lock, so an *accept* answer always means the listener
//! switches the connection. Before it decides an accepted connection the
//! listener also reads the queries (and withdraws) already queued on its
//! twin's socket, so a query sent before the SYN is never overtaken by the
//! twin thread's scheduling. Flags were zero before: an older twin leaves the flag clear
//! and is always asked first.
//!
//! A client that got the flag from a destination (cached for
//! [`NEGATIVE_TTL`]) sends the next query and then connects at once, and
//! waits for the answer only after the connect: *accept* switches,
//! *decline* or a refused query (no twin at all) keep the connection plain.
//! Silence (no answer within the wait) leaves it undecided on the
//! listener's side: the client withdraws the query, closes that connection
//! without a byte and connects again plain from another port, as before. Offload-required
//! connections always ask first (a late query's decline would fail them).
//!
//! [`Config::probe_timeout`]: crate::Config::probe_timeout

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
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
/// How long a listener keeps a query's record waiting for its connection,
/// and the plain mark of a connection no query asked for.
pub const RECORD_TTL: Duration = Duration::from_secs(10);
/// Longest wait for the answer to a query sent with the SYN: it must end
/// well before the listener forgets the plain mark of the connection.
pub const LATE_QUERY_MAX_WAIT: Duration = Duration::from_secs(2);
/// Flag of an answer: the twin decides late queries (see the module docs).
pub const FLAG_LATE_QUERY: u8 = 0x01;
/// Flag of a decline: the connection was accepted (plain) before the query
/// came.
pub const FLAG_TOO_LATE: u8 = 0x02;

/// Kind of a detection message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Client: "this connection will speak SDP if you agree".
    Query = 1,
    /// Listener: agreed, the connection will be switched.
    Accept = 2,
    /// Listener: keep this connection plain.
    Decline = 3,
    /// Client: "I gave up waiting for the answer to this query (same
    /// nonce); the connection from that port will be plain". Not answered.
    Withdraw = 4,
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
    /// Flags ([`FLAG_LATE_QUERY`]); zero in queries and withdraws.
    pub flags: u8,
}

impl Probe {
    /// Encodes the 40 octets.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4] = VERSION;
        b[5] = self.kind as u8;
        b[6] = self.flags;
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
            4 => Kind::Withdraw,
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
            flags: b[6],
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

/// What is remembered of a destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Known {
    /// No twin answered: plain, without asking.
    Plain,
    /// Its twin decides late queries: query and SYN may go together.
    LateQueries,
}

fn cache() -> &'static Mutex<HashMap<SocketAddr, (Known, Instant)>> {
    static CACHE: OnceLock<Mutex<HashMap<SocketAddr, (Known, Instant)>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn known(dest: SocketAddr) -> Option<Known> {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    match c.get(&dest) {
        Some(&(k, until)) if until > Instant::now() => Some(k),
        Some(_) => {
            c.remove(&dest);
            None
        }
        None => None,
    }
}

/// Whether `dest` is known not to run sockets direct.
pub(crate) fn known_plain(dest: SocketAddr) -> bool {
    known(dest) == Some(Known::Plain)
}

/// Whether `dest`'s twin is known to decide queries that arrive after the
/// connection (the query may go with the SYN).
pub(crate) fn known_late_queries(dest: SocketAddr) -> bool {
    known(dest) == Some(Known::LateQueries)
}

fn remember(dest: SocketAddr, k: Known) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    insert(&mut c, dest, k);
}

/// Twins this process has started ([`forget_plain_at`]; counted under the
/// cache's lock).
static TWINS_STARTED: AtomicU64 = AtomicU64::new(0);

/// The ports twins of this process started on, with the count of
/// [`TWINS_STARTED`] each was started as (locked inside the cache's lock).
/// Past 1 024 ports it starts again, from a floor: an answer to a query
/// sent before the floor is not cached.
#[derive(Default)]
struct TwinStarts {
    by_port: HashMap<u16, u64>,
    floor: u64,
}

fn twin_starts() -> &'static Mutex<TwinStarts> {
    static STARTS: OnceLock<Mutex<TwinStarts>> = OnceLock::new();
    STARTS.get_or_init(Mutex::default)
}

/// The count of twins started, read before a query is sent: see
/// [`remember_plain`].
fn twins_started() -> u64 {
    TWINS_STARTED.load(Ordering::Relaxed)
}

/// Remembers `dest` as plain (no twin answered a query sent when
/// [`twins_started`] said `twins_then`), unless a twin of this process
/// started on its port since: the answer may be older than that twin, and
/// [`forget_plain_at`] has already run for it.
fn remember_plain(dest: SocketAddr, twins_then: u64) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    let starts = twin_starts().lock().unwrap_or_else(|e| e.into_inner());
    let newer = starts
        .by_port
        .get(&dest.port())
        .is_some_and(|&n| n > twins_then);
    if newer || twins_then < starts.floor {
        return;
    }
    drop(starts);
    insert(&mut c, dest, Known::Plain);
}

fn insert(c: &mut HashMap<SocketAddr, (Known, Instant)>, dest: SocketAddr, k: Known) {
    if c.len() > 4096 {
        let now = Instant::now();
        c.retain(|_, (_, until)| *until > now);
    }
    c.insert(dest, (k, Instant::now() + NEGATIVE_TTL));
}

fn forget(dest: SocketAddr) {
    cache()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&dest);
}

/// A twin now answers on `local` (a listener of this process bound it):
/// a "no twin" answer this process remembers for that port there (on any
/// address if `local`'s is unspecified) is stale. The port may have been
/// another server's (an ephemeral port, a restarted server): its clients
/// would otherwise connect plain for the rest of [`NEGATIVE_TTL`], and a
/// listener requiring offload would drop them. (Another process's cache
/// keeps its answer until then.)
pub(crate) fn forget_plain_at(local: SocketAddr) {
    let ip = local.ip().to_canonical();
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    // A query to the port on its way now may have been refused before
    // this twin was there: its answer is not cached (`remember_plain`).
    let n = TWINS_STARTED.fetch_add(1, Ordering::Relaxed) + 1;
    let mut starts = twin_starts().lock().unwrap_or_else(|e| e.into_inner());
    if starts.by_port.len() >= 1024 {
        starts.by_port.clear();
        starts.floor = n;
    }
    starts.by_port.insert(local.port(), n);
    drop(starts);
    c.retain(|dest, (k, _)| {
        !(*k == Known::Plain
            && dest.port() == local.port()
            && (ip.is_unspecified() || dest.ip().to_canonical() == ip))
    });
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

/// A query on its way: sent, its answer not read yet.
#[derive(Debug)]
pub(crate) struct Pending {
    dest: SocketAddr,
    /// Always `Some` until dropped (then kept for the thread's next
    /// query, see [`QUERY_SOCK`]).
    sock: Option<UdpSocket>,
    client_addr: Ipv6Addr,
    /// Keep the socket for the thread's next query.
    keep: bool,
    /// The fork generation the socket was made in.
    generation: u64,
    /// [`twins_started`] before the query was sent.
    twins: u64,
    q: Probe,
    sent: Instant,
    /// The socket's read timeout as last set, if known (see
    /// [`set_wait`]).
    rcvtimeo: std::cell::Cell<Option<Duration>>,
}

impl Pending {
    fn sock(&self) -> &UdpSocket {
        self.sock.as_ref().expect("query socket")
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if let Some(s) = self.sock.take()
            && self.keep
        {
            let kept = (
                self.dest,
                s,
                self.client_addr,
                self.generation,
                self.rcvtimeo.get(),
            );
            // Not kept (closed) after the thread's locals were destroyed
            // (see [`QUERY_SOCK`]).
            let _ = QUERY_SOCK.try_with(|c| {
                if let Ok(mut c) = c.try_borrow_mut() {
                    *c = Some(kept);
                }
            });
        }
    }
}

thread_local! {
    /// The query socket of this thread's last query (connected to its
    /// destination), the local address it names and the process that
    /// made it: the next query to the same destination reuses it (four
    /// system calls less per connection: socket, bind, connect,
    /// getsockname; close once). Only [`crate::TcpStream`]'s own
    /// connects keep one (not [`crate::external`]'s callers, which
    /// interpose on applications that may count or close descriptors),
    /// and a forked child makes its own (a shared socket would let parent
    /// and child take each other's answers). Used with `try_with`: glibc's
    /// `exit` destroys the exiting thread's locals before it runs the exit
    /// handlers, which may connect (a new socket then, not kept).
    static QUERY_SOCK: std::cell::RefCell<Option<QuerySock>> =
        const { std::cell::RefCell::new(None) };
}

/// A kept query socket: destination, socket, local address, the fork
/// generation ([`softrdma_engine::fork_generation`]) it was made in, its
/// read timeout as last set.
type QuerySock = (SocketAddr, UdpSocket, Ipv6Addr, u64, Option<Duration>);

/// A query socket, its local address, fork generation and read timeout
/// as last set (if known), and whether it is a kept one reused.
type QuerySocket = (UdpSocket, Ipv6Addr, u64, Option<Duration>, bool);

/// A query socket for `dest`: with `reuse`, this thread's last one if it
/// was for `dest` and made by this process (not by a parent it was forked
/// from), else a new one (`true`: reused). Late answers to earlier queries
/// queued on a reused socket are skipped by nonce when the answer is read
/// (no read to empty it first: one system call less per connection); an
/// earlier query's error is handled where it shows (see
/// [`send_query_with`]).
fn query_socket(dest: SocketAddr, reuse: bool) -> io::Result<QuerySocket> {
    let kept = if reuse {
        QUERY_SOCK
            .try_with(|c| c.try_borrow_mut().ok()?.take())
            .ok()
            .flatten()
    } else {
        None
    };
    let me = softrdma_engine::fork_generation();
    if let Some((d, s, a, generation, rcvtimeo)) = kept
        && d == dest
        && generation == me
    {
        return Ok((s, a, me, rcvtimeo, true));
    }
    // Made and connected with system calls of its own (rustix), not
    // through the C library's `connect`: in a process running the
    // `LD_PRELOAD` library that symbol is the library's, which looked at
    // the socket's type first (a `getsockopt` per query). The connect
    // binds the socket (no `bind` to port 0 first): two system calls less
    // per query socket.
    let family = if dest.is_ipv4() {
        rustix::net::AddressFamily::INET
    } else {
        rustix::net::AddressFamily::INET6
    };
    let fd = rustix::net::socket_with(
        family,
        rustix::net::SocketType::DGRAM,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )?;
    rustix::net::connect(&fd, &dest)?;
    let s = UdpSocket::from(fd);
    let client_addr = match s.local_addr()?.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    Ok((s, client_addr, me, None, false))
}

/// Sends the query for the connection from `client_port` to `dest`.
/// `Err`: the query could not be sent (no answer will come).
pub(crate) fn send_query(dest: SocketAddr, client_port: u16) -> io::Result<Pending> {
    send_query_with(dest, client_port, true)
}

/// [`send_query`]; `keep`: the socket is kept for the thread's next
/// query (see [`QUERY_SOCK`]).
pub(crate) fn send_query_with(
    dest: SocketAddr,
    client_port: u16,
    keep: bool,
) -> io::Result<Pending> {
    let twins = twins_started();
    let (s, client_addr, generation, rcvtimeo, reused) = query_socket(dest, keep)?;
    let q = Probe {
        kind: Kind::Query,
        nonce: nonce(),
        client_port,
        server_port: dest.port(),
        client_addr,
        flags: 0,
    };
    match s.send(&q.encode()) {
        // An earlier query's refusal (its ICMP error, reported once) shows
        // on the next call on the socket: this query is sent again. A
        // refusal that comes later than that is taken for this query's:
        // the connection stays plain, as for a twin that is gone.
        Err(e) if reused && e.kind() == io::ErrorKind::ConnectionRefused => {
            s.send(&q.encode())?;
        }
        r => {
            r?;
        }
    }
    Ok(Pending {
        dest,
        sock: Some(s),
        client_addr,
        keep,
        generation,
        twins,
        q,
        sent: Instant::now(),
        rcvtimeo: std::cell::Cell::new(rcvtimeo),
    })
}

/// How much later than asked a wait for an answer may end (see
/// [`set_wait`]).
const RCVTIMEO_SLACK: Duration = Duration::from_millis(1);

/// Sets the query socket's read timeout for a wait of `left`, unless the
/// one set already ends it at most [`RCVTIMEO_SLACK`] late. The wait's
/// whole span (`full`, from the send) is set when `left` is within the
/// slack of it: a thread's kept socket then waits each connection's
/// answer (which mostly comes within a millisecond of the send) with the
/// timeout set for the first one, a system call less per connection.
fn set_wait(p: &Pending, left: Duration, full: Duration) -> io::Result<()> {
    if let Some(t) = p.rcvtimeo.get()
        && t >= left
        && t - left <= RCVTIMEO_SLACK
    {
        return Ok(());
    }
    let t = if full >= left && full - left <= RCVTIMEO_SLACK {
        full
    } else {
        left
    };
    p.rcvtimeo.set(None);
    p.sock().set_read_timeout(Some(t))?;
    p.rcvtimeo.set(Some(t));
    Ok(())
}

/// The answer to a query (`timeout` counted from the send), and whether it
/// said the twin decides late queries.
fn wait_answer(p: &Pending, timeout: Duration) -> io::Result<(Answer, u8)> {
    let deadline = p.sent + timeout;
    // Two tries, half the time each (a lost datagram on a LAN).
    for attempt in 0..2 {
        if attempt == 1 {
            p.sock().send(&p.q.encode())?;
        }
        let until = if attempt == 0 {
            p.sent + timeout / 2
        } else {
            deadline
        };
        // A query sent with the SYN is mostly answered by the time the
        // connect returns: look once without a wait (no timeout to set).
        let mut first = attempt == 0;
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut b = [0u8; 64];
            let got = if std::mem::take(&mut first) {
                rustix::net::recv(p.sock(), &mut b[..], rustix::net::RecvFlags::DONTWAIT)
                    .map(|(n, _)| n)
                    .map_err(io::Error::from)
            } else {
                set_wait(p, left, until.saturating_duration_since(p.sent))?;
                p.sock().recv(&mut b)
            };
            match got {
                Ok(n) => match Probe::decode(&b[..n]) {
                    Some(a) if a.nonce == p.q.nonce && a.kind == Kind::Accept => {
                        return Ok((Answer::Accept, a.flags));
                    }
                    Some(a) if a.nonce == p.q.nonce && a.kind == Kind::Decline => {
                        return Ok((Answer::Decline, a.flags));
                    }
                    _ => {}
                },
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    return Ok((Answer::NotCapable, 0));
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
    Err(io::ErrorKind::TimedOut.into())
}

/// What a query sent with the SYN found out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LateAnswer {
    /// The listener switches the connection.
    Accept,
    /// The listener keeps it plain; `too_late`: it accepted the connection
    /// before the query came.
    Decline {
        /// The query came after the connection was accepted.
        too_late: bool,
    },
    /// No twin there any more (the query was refused): plain.
    NoTwin,
    /// No answer: the listener's decision is unknown, the connection must
    /// not be used.
    Unknown,
}

impl Pending {
    /// Waits (at most `timeout` from the send, capped at
    /// [`LATE_QUERY_MAX_WAIT`]) for the answer to a query sent with the
    /// SYN; updates the cache.
    pub(crate) fn wait_late(self, timeout: Duration) -> LateAnswer {
        match wait_answer(&self, timeout.min(LATE_QUERY_MAX_WAIT)) {
            Ok((Answer::Accept, flags)) if flags & FLAG_LATE_QUERY != 0 => LateAnswer::Accept,
            Ok((Answer::Accept, _)) => {
                // A twin (restarted, older) that may have accepted the
                // query after the connection was decided plain.
                forget(self.dest);
                LateAnswer::Unknown
            }
            Ok((Answer::Decline, flags)) => {
                if flags & FLAG_TOO_LATE == 0 {
                    forget(self.dest);
                }
                LateAnswer::Decline {
                    too_late: flags & FLAG_TOO_LATE != 0,
                }
            }
            Ok((Answer::NotCapable, _)) => {
                remember_plain(self.dest, self.twins);
                LateAnswer::NoTwin
            }
            Err(_) => {
                // The connection is closed without a byte; the query's
                // record, if the twin accepts it yet, must not switch a
                // later connection from the port.
                self.withdraw();
                forget(self.dest);
                LateAnswer::Unknown
            }
        }
    }

    /// Withdraws the query (see the module docs): sent when its answer did
    /// not come in time, before the connection from its port is made plain.
    /// Best effort: a lost withdraw is a lost datagram like any other.
    fn withdraw(&self) {
        let w = Probe {
            kind: Kind::Withdraw,
            ..self.q
        };
        let _ = self.sock().send(&w.encode());
    }

    /// Waits (at most `timeout` from the send) for the answer to a query
    /// sent before the connect; updates the cache.
    pub(crate) fn wait(self, timeout: Duration) -> Answer {
        match wait_answer(&self, timeout) {
            Ok((a, flags)) => {
                if a == Answer::NotCapable {
                    remember_plain(self.dest, self.twins);
                } else if a == Answer::Accept && flags & FLAG_LATE_QUERY != 0 {
                    remember(self.dest, Known::LateQueries);
                }
                a
            }
            Err(_) => {
                // Silence: the twin may still take the query (a starved
                // process), and the connection that follows from the same
                // port is plain. Withdrawn before it is made.
                self.withdraw();
                remember_plain(self.dest, self.twins);
                Answer::NotCapable
            }
        }
    }
}

/// Asks `dest`'s twin whether the connection from `client_port` may be
/// offloaded; `keep`: the query socket is kept for the thread's next
/// query. Caches a negative answer.
pub(crate) fn query(dest: SocketAddr, client_port: u16, timeout: Duration, keep: bool) -> Answer {
    let twins = twins_started();
    match send_query_with(dest, client_port, keep) {
        Ok(p) => p.wait(timeout),
        Err(_) => {
            remember_plain(dest, twins);
            Answer::NotCapable
        }
    }
}

/// What a twin knows of a connection from a client address and port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// A query (its nonce) asked for it (accepted): the listener switches
    /// it, unless the query is withdrawn first.
    Asked(u64),
    /// Accepted before any query asked: plain, a late query is declined.
    Plain,
}

/// The records of a twin, and the size at which expired ones are swept
/// next (amortized: a live record, a plain mark above all, is never
/// dropped early, or a late query could be accepted for a connection
/// decided plain).
#[derive(Debug, Default)]
struct Table {
    map: HashMap<SocketAddr, (Record, Instant)>,
    sweep_at: usize,
}

type Records = Arc<Mutex<Table>>;

/// A listener's UDP twin: answers queries on its own thread (a query must
/// be answered while the application is busy elsewhere) and keeps the
/// records of connections that will be switched.
#[derive(Debug)]
pub(crate) struct Twin {
    records: Records,
    sock: Arc<UdpSocket>,
    accept: bool,
    stop: Arc<AtomicBool>,
}

fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

impl Twin {
    /// Binds the twin to `addr` (the TCP listener's address) and starts
    /// answering; `accept` false answers every query with a decline.
    pub(crate) fn start(addr: SocketAddr, accept: bool) -> io::Result<Twin> {
        let sock = Arc::new(UdpSocket::bind(addr)?);
        sock.set_read_timeout(Some(Duration::from_millis(100)))?;
        forget_plain_at(sock.local_addr()?);
        let records: Records = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s, k) = (records.clone(), stop.clone(), sock.clone());
        std::thread::Builder::new()
            .name("softrdma-sd-twin".into())
            .spawn(move || serve(&k, &r, &s, accept))?;
        Ok(Twin {
            records,
            sock,
            accept,
            stop,
        })
    }

    /// Whether a client queried for the connection from `peer` (the record
    /// is consumed). Reads the datagrams already queued first (a query sent
    /// with the SYN, or a withdraw sent before it, is there by now); a
    /// connection no query asked for is marked plain, so that a later
    /// query for it is declined.
    pub(crate) fn take(&self, peer: SocketAddr) -> bool {
        let key = canonical(peer);
        let mut r = self.records.lock().unwrap_or_else(|e| e.into_inner());
        // Read even when the twin thread accepted the query already: a
        // client that gave up on the answer sent a withdraw before its
        // SYN, which may still be queued behind the query the twin thread
        // took (a twin thread starved past the client's wait).
        drain(&self.sock, &mut r, &self.stop, self.accept);
        let now = Instant::now();
        match r.map.remove(&key) {
            Some((Record::Asked(_), until)) if until > now => true,
            _ => {
                insert_record(&mut r, key, Record::Plain, now);
                false
            }
        }
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        {
            // Under the records lock: no query is accepted after this (the
            // listener that would take the record is gone).
            let _r = self.records.lock().unwrap_or_else(|e| e.into_inner());
            self.stop.store(true, Ordering::Relaxed);
        }
        // Wake the thread so that it leaves and the port closes (queries
        // are refused again) now rather than at its next read timeout.
        if let Ok(mut to) = self.sock.local_addr() {
            if to.ip().is_unspecified() {
                to.set_ip(match to {
                    SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                });
            }
            let bind: SocketAddr = if to.is_ipv4() {
                (Ipv4Addr::UNSPECIFIED, 0).into()
            } else {
                (Ipv6Addr::UNSPECIFIED, 0).into()
            };
            if let Ok(w) = UdpSocket::bind(bind) {
                let _ = w.send_to(&[], to);
            }
        }
    }
}

fn insert_record(r: &mut Table, key: SocketAddr, rec: Record, now: Instant) {
    if r.map.len() >= r.sweep_at.max(4096) {
        r.map.retain(|_, (_, until)| *until > now);
        r.sweep_at = 2 * r.map.len();
    }
    r.map.insert(key, (rec, now + RECORD_TTL));
}

/// Reads and answers the queued datagrams without blocking. Called with
/// the records locked: a query is either still queued or decided, so an
/// accepting thread never misses one that a twin thread holds undecided.
fn drain(sock: &UdpSocket, r: &mut Table, stop: &AtomicBool, accept: bool) {
    let mut b = [0u8; 64];
    loop {
        match rustix::net::recvfrom(sock, &mut b[..], rustix::net::RecvFlags::DONTWAIT) {
            Ok((n, _, Some(from))) => {
                if let Ok(from) = SocketAddr::try_from(from) {
                    answer(sock, r, stop, accept, &b[..n.min(b.len())], from);
                }
            }
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => break,
        }
    }
}

/// Answers one datagram (if it is a query).
fn answer(
    sock: &UdpSocket,
    r: &mut Table,
    stop: &AtomicBool,
    accept: bool,
    b: &[u8],
    from: SocketAddr,
) {
    if let Some(a) = decide(r, stop, accept, b, from) {
        // A lost answer makes the client time out and stay plain.
        let _ = sock.send_to(&a, from);
    }
}

/// Decides one datagram (a query: its record is kept or its plain mark
/// consumed; a withdraw: the connection is marked plain) and returns the
/// answer to send to `from` (none to a withdraw).
fn decide(
    r: &mut Table,
    stop: &AtomicBool,
    accept: bool,
    b: &[u8],
    from: SocketAddr,
) -> Option<[u8; MSG_LEN]> {
    let q = Probe::decode(b)?;
    if q.kind == Kind::Withdraw {
        withdraw(r, &q, from);
        return None;
    }
    if q.kind != Kind::Query {
        return None;
    }
    let mut flags = FLAG_LATE_QUERY;
    let kind = if accept {
        let key = SocketAddr::new(from.ip().to_canonical(), q.client_port);
        let now = Instant::now();
        match r.map.get(&key) {
            // The listener is closed: nobody would take a record.
            _ if stop.load(Ordering::Relaxed) => Kind::Decline,
            Some(&(Record::Plain, until)) if until > now => {
                // Accepted before this query came: it stays plain.
                r.map.remove(&key);
                flags |= FLAG_TOO_LATE;
                Kind::Decline
            }
            _ => {
                insert_record(r, key, Record::Asked(q.nonce), now);
                Kind::Accept
            }
        }
    } else {
        Kind::Decline
    };
    Some(Probe { kind, flags, ..q }.encode())
}

/// A withdraw of query `w` (same nonce) from `from`: the client connects
/// plain from that port, so its connection is marked plain (the query's
/// record, if it was accepted, is dropped). A query reordered behind the
/// withdraw (a retry) then finds the mark and is declined. A record of
/// another query (another nonce) is left alone.
fn withdraw(r: &mut Table, w: &Probe, from: SocketAddr) {
    let key = SocketAddr::new(from.ip().to_canonical(), w.client_port);
    let now = Instant::now();
    match r.map.get(&key) {
        Some(&(Record::Asked(n), until)) if until > now && n != w.nonce => {}
        Some(&(Record::Plain, until)) if until > now => {}
        _ => insert_record(r, key, Record::Plain, now),
    }
}

/// The twin thread: waits (peeking) until a datagram is there, then reads
/// and decides it with the records locked, answers it once the lock is let
/// go, and peeks again (a peek finds the next one queued at once: no read
/// that finds the queue empty, one system call less per query). The
/// answer's send is outside the lock: on loopback it delivers the answer
/// and wakes the client, and an accepting thread that came meanwhile
/// waited for it (a sleep on the lock and a wake-up per connection). The
/// peek reads no sender address: std's `peek_from` parses the address
/// memory even when the kernel wrote none (a shut-down socket), and
/// panics when that memory held an earlier `AF_INET`.
fn serve(sock: &UdpSocket, records: &Records, stop: &AtomicBool, accept: bool) {
    let mut b = [0u8; 1];
    let mut q = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        if sock.peek(&mut b).is_err() {
            continue;
        }
        let mut r = records.lock().unwrap_or_else(|e| e.into_inner());
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // An accepting thread may have taken it meanwhile (`drain`).
        let decided =
            match rustix::net::recvfrom(sock, &mut q[..], rustix::net::RecvFlags::DONTWAIT) {
                Ok((n, _, Some(from))) => SocketAddr::try_from(from).ok().and_then(|from| {
                    Some((
                        decide(&mut r, stop, accept, &q[..n.min(q.len())], from)?,
                        from,
                    ))
                }),
                _ => None,
            };
        drop(r);
        if let Some((a, from)) = decided {
            // A lost answer makes the client time out and stay plain.
            let _ = sock.send_to(&a, from);
        }
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
            flags: 0,
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

    fn twin_addr(t: &Twin) -> SocketAddr {
        t.sock.local_addr().unwrap()
    }

    /// Regression: a "no twin" answer (the query refused) read after a
    /// listener of this process started its twin on the port was cached
    /// anyway: the twin had already ended the port's cached answers, so the
    /// stale one stayed for [`NEGATIVE_TTL`] (a client thread connecting
    /// while another thread started the server connected plain for a
    /// minute, and a listener requiring offload dropped it).
    #[test]
    fn a_refusal_read_after_the_ports_twin_started_was_cached() {
        let dest = UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let p = send_query_with(dest, 40010, false).unwrap();
        // The refusal (an ICMP error on loopback) is on the query's socket.
        std::thread::sleep(Duration::from_millis(20));
        let t = Twin::start(dest, true).unwrap();
        assert_eq!(p.wait(Duration::from_secs(5)), Answer::NotCapable);
        assert!(
            !known_plain(dest),
            "a refusal from before the twin outlived it"
        );
        // A query sent now asks the twin.
        let p = send_query_with(dest, 40011, false).unwrap();
        assert_eq!(p.wait(Duration::from_secs(5)), Answer::Accept);
        drop(t);
    }

    /// A connection accepted before its query came is marked plain, and the
    /// query that comes then is declined as too late: both ends keep it
    /// plain.
    #[test]
    fn late_query_after_plain_accept_is_declined() {
        let t = Twin::start("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let addr = twin_addr(&t);
        let peer: SocketAddr = "127.0.0.1:40000".parse().unwrap();
        assert!(!t.take(peer));
        let p = send_query(addr, 40000).unwrap();
        assert_eq!(
            p.wait_late(Duration::from_secs(5)),
            LateAnswer::Decline { too_late: true }
        );
        // The mark was consumed: a new query for the port is accepted.
        let p = send_query(addr, 40000).unwrap();
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Accept);
        assert!(t.take(peer));
    }

    /// A query answered before the accept switches the connection, and
    /// the answer teaches the client that query and SYN may go together.
    #[test]
    fn query_before_accept_switches_and_is_cached() {
        let t = Twin::start("127.0.0.1:0".parse().unwrap(), true).unwrap();
        let addr = twin_addr(&t);
        assert!(!known_late_queries(addr));
        let p = send_query(addr, 40001).unwrap();
        assert_eq!(p.wait(Duration::from_secs(5)), Answer::Accept);
        assert!(known_late_queries(addr));
        assert!(t.take("127.0.0.1:40001".parse().unwrap()));
        // Consumed.
        assert!(!t.take("127.0.0.1:40001".parse().unwrap()));
    }

    /// An accepting twin with no answering thread: only the listener's
    /// own reads of its socket answer queries.
    fn threadless_twin() -> Twin {
        Twin {
            records: Records::default(),
            sock: Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap()),
            accept: true,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// A query already queued on the twin's socket when the listener
    /// decides is answered by the listener itself: here the twin has no
    /// thread, so only the listener's own read can find the query.
    #[test]
    fn accept_reads_queued_queries_first() {
        let t = threadless_twin();
        let addr = twin_addr(&t);
        let p = send_query(addr, 40002).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(t.take("127.0.0.1:40002".parse().unwrap()));
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Accept);
    }

    /// Regression: a client that gave up waiting for the answer (a twin
    /// starved past its wait) connected plain, and the twin then took the
    /// query as accepted: the listener switched the plain connection from
    /// that port (the preload's, from the port it named) or a later one
    /// from it ([`crate::TcpStream`]'s, which connects from another port
    /// but left the record behind). Here the twin has no thread, so the
    /// client hears nothing; its withdraw is read with the query when the
    /// listener decides.
    #[test]
    fn a_query_the_client_gave_up_on_switched_its_plain_connection() {
        let t = threadless_twin();
        let addr = twin_addr(&t);
        let p = send_query_with(addr, 40040, false).unwrap();
        assert_eq!(p.wait(Duration::from_millis(40)), Answer::NotCapable);
        assert!(!t.take("127.0.0.1:40040".parse().unwrap()));
        // The mark stays: the query's retry, if it came late, is declined.
        let q = Probe {
            kind: Kind::Query,
            nonce: 7,
            client_port: 40040,
            server_port: addr.port(),
            client_addr: Ipv6Addr::LOCALHOST,
            flags: 0,
        };
        let mut r = t.records.lock().unwrap();
        let a = decide(
            &mut r,
            &t.stop,
            true,
            &q.encode(),
            "127.0.0.1:9".parse().unwrap(),
        );
        let a = Probe::decode(&a.unwrap()).unwrap();
        assert_eq!(a.kind, Kind::Decline);
        assert_ne!(a.flags & FLAG_TOO_LATE, 0);
    }

    /// Regression: the twin thread took the query after the client had
    /// given up, and the listener accepted the connection before the twin
    /// thread read the withdraw behind it: the listener took the record
    /// without reading its socket and switched the plain connection. It
    /// now reads the queued datagrams first in every case.
    #[test]
    fn a_withdraw_queued_behind_a_query_the_twin_thread_took_is_read() {
        let t = threadless_twin();
        let addr = twin_addr(&t);
        let p = send_query_with(addr, 40041, false).unwrap();
        assert_eq!(p.wait(Duration::from_millis(40)), Answer::NotCapable);
        // The query (and its retry) as the twin thread takes them: the
        // withdraw stays queued.
        let mut q = [0u8; 64];
        for _ in 0..2 {
            let (n, from) = t.sock.recv_from(&mut q).unwrap();
            let mut r = t.records.lock().unwrap();
            let a = decide(&mut r, &t.stop, true, &q[..n], from).unwrap();
            assert_eq!(Probe::decode(&a).unwrap().kind, Kind::Accept);
        }
        assert!(!t.take("127.0.0.1:40041".parse().unwrap()));
    }

    /// A withdraw is answered with nothing, and one naming another query
    /// (another nonce) leaves that query's record alone. A datagram of a
    /// kind the twin does not know (as a withdraw is to a twin older than
    /// it) is ignored: no answer, no record.
    #[test]
    fn a_withdraw_of_another_query_or_an_unknown_kind_changes_nothing() {
        let t = threadless_twin();
        let from: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let q = Probe {
            kind: Kind::Query,
            nonce: 1,
            client_port: 40042,
            server_port: 1,
            client_addr: Ipv6Addr::LOCALHOST,
            flags: 0,
        };
        let mut r = t.records.lock().unwrap();
        assert!(decide(&mut r, &t.stop, true, &q.encode(), from).is_some());
        let w = Probe {
            kind: Kind::Withdraw,
            nonce: 2,
            ..q
        };
        assert!(decide(&mut r, &t.stop, true, &w.encode(), from).is_none());
        let mut unknown = w.encode();
        unknown[5] = 9;
        assert!(decide(&mut r, &t.stop, true, &unknown, from).is_none());
        assert_eq!(r.map.len(), 1);
        drop(r);
        assert!(t.take("127.0.0.1:40042".parse().unwrap()));
    }

    /// A thread's kept query socket keeps the read timeout set for its
    /// first wait, and knows it: the next connection's wait (within the
    /// slack of the same span) sets none. (The kernel keeps the timeout in
    /// clock ticks, so its value cannot tell a second setting within the
    /// slack; the system calls are counted in the crate's README.)
    #[test]
    fn a_kept_query_socket_sets_its_read_timeout_once() {
        let fake = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            for _ in 0..2 {
                let (n, from) = fake.recv_from(&mut b).unwrap();
                let q = Probe::decode(&b[..n]).unwrap();
                let a = Probe {
                    kind: Kind::Accept,
                    flags: FLAG_LATE_QUERY,
                    ..q
                };
                // Late enough that the client sleeps for it.
                std::thread::sleep(Duration::from_millis(30));
                fake.send_to(&a.encode(), from).unwrap();
            }
        });
        let wait = Duration::from_secs(1);
        let p = send_query(addr, 40030).unwrap();
        assert_eq!(p.rcvtimeo.get(), None, "a new socket");
        assert_eq!(p.wait_late(wait), LateAnswer::Accept);
        let p = send_query(addr, 40031).unwrap();
        // The same socket, its timeout known: the first wait's whole span.
        assert_eq!(p.rcvtimeo.get(), Some(wait / 2));
        assert_eq!(p.sock().read_timeout().unwrap(), Some(wait / 2));
        let dest = p.dest;
        assert_eq!(p.wait_late(wait), LateAnswer::Accept);
        th.join().unwrap();
        let kept = QUERY_SOCK.with(|c| c.borrow_mut().take()).unwrap();
        assert_eq!(kept.0, dest);
        assert_eq!(kept.4, Some(wait / 2));
        assert_eq!(kept.1.read_timeout().unwrap(), Some(wait / 2));
    }

    /// A thread's next query to the same destination goes from the same
    /// socket: a duplicate answer to the first query left on it is skipped
    /// (its nonce), not taken for the second's.
    #[test]
    fn query_socket_is_reused_and_late_answers_skipped() {
        let fake = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            let (n, from1) = fake.recv_from(&mut b).unwrap();
            let q = Probe::decode(&b[..n]).unwrap();
            let a = Probe {
                kind: Kind::Accept,
                flags: FLAG_LATE_QUERY,
                ..q
            };
            // The answer, and a duplicate the next query's read skips.
            fake.send_to(&a.encode(), from1).unwrap();
            fake.send_to(&a.encode(), from1).unwrap();
            let (n, from2) = fake.recv_from(&mut b).unwrap();
            let q = Probe::decode(&b[..n]).unwrap();
            let d = Probe {
                kind: Kind::Decline,
                flags: FLAG_LATE_QUERY,
                ..q
            };
            fake.send_to(&d.encode(), from2).unwrap();
            (from1, from2)
        });
        let p = send_query(addr, 40010).unwrap();
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Accept);
        // Let the duplicate arrive before the next query.
        std::thread::sleep(Duration::from_millis(20));
        let p = send_query(addr, 40011).unwrap();
        assert_eq!(
            p.wait_late(Duration::from_secs(5)),
            LateAnswer::Decline { too_late: false }
        );
        let (from1, from2) = th.join().unwrap();
        assert_eq!(from1, from2, "the query socket was not reused");
    }

    /// An accept without the late-query flag (an older twin) does not say
    /// whether the listener switched a connection it may already have
    /// accepted: undecided.
    #[test]
    fn late_accept_without_the_flag_is_undecided() {
        let fake = UdpSocket::bind("127.0.0.1:0").unwrap();
        let addr = fake.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            let (n, from) = fake.recv_from(&mut b).unwrap();
            let q = Probe::decode(&b[..n]).unwrap();
            let a = Probe {
                kind: Kind::Accept,
                flags: 0,
                ..q
            };
            fake.send_to(&a.encode(), from).unwrap();
        });
        let p = send_query(addr, 40003).unwrap();
        assert_eq!(p.wait_late(Duration::from_secs(5)), LateAnswer::Unknown);
        th.join().unwrap();
    }

    /// Plain marks are never dropped before their time, however many
    /// plain connections a listener accepts: the first of 5 000 still
    /// declines its late query.
    #[test]
    fn plain_marks_outlive_a_full_table() {
        let t = threadless_twin();
        let addr = twin_addr(&t);
        for i in 0..5000u16 {
            let peer = SocketAddr::from((Ipv4Addr::LOCALHOST, 20000 + i));
            assert!(!t.take(peer));
        }
        let p = send_query(addr, 20000).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        // The twin has no thread: the next accept answers the query.
        assert!(!t.take(SocketAddr::from((Ipv4Addr::LOCALHOST, 30000))));
        assert_eq!(
            p.wait_late(Duration::from_secs(5)),
            LateAnswer::Decline { too_late: true }
        );
    }
}
