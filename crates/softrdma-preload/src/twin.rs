//! A preloaded listener's UDP twin: answers the capability queries of
//! sockets-direct clients (the wire format of `softrdma_sockets::detect`)
//! and records which connections are to be switched.
//!
//! The records live in shared anonymous memory made at `listen`: servers
//! that fork their workers after listening (nginx) accept in processes
//! other than the one whose thread answers, and every one of them must
//! find the record of the connection it accepts.
//!
//! The twin decides *late* queries, and says so in its answers
//! ([`FLAG_LATE_QUERY`]): a sockets-direct client that saw the flag sends
//! its next query just before its SYN and reads the answer after its
//! connect. What that promises, and how it is kept:
//!
//! - A query and an accept of the same connection decide under one lock
//!   (a spin lock in the shared memory, taken over from a process that
//!   died holding it): an *accept* answer always means the listener
//!   switches the connection.
//! - An accepted connection no query asked for gets a *plain mark* (for
//!   the records' lifetime); a query that finds it is declined
//!   ([`FLAG_TOO_LATE`]): both ends keep it plain.
//! - Before an accept decides, the queries queued on the twin's socket are
//!   answered (the accepting process reads them under the lock), so a
//!   query sent just before the SYN is not overtaken by the twin thread's
//!   scheduling; the twin thread itself only peeks until it holds the lock.
//! - A client that heard no answer in time *withdraws* its query (same
//!   nonce) before it connects plain from the port it named: the withdraw
//!   turns the query's record into a plain mark (a record of another
//!   query is left alone) and is not answered. It is queued behind the
//!   query and ahead of the SYN, so the twin thread and an accept's read
//!   see it in that order (a twin starved past the client's wait no
//!   longer switches the plain connection).
//! - When a plain mark finds no room (the table is full), no query is
//!   accepted for the records' lifetime (every answer declines): a late
//!   query could otherwise be accepted for a connection decided plain.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use softrdma_sockets::detect::{FLAG_LATE_QUERY, FLAG_TOO_LATE, Kind, Probe};

/// Number of record slots (connections queried and not yet accepted, and
/// plain marks of connections accepted within the records' lifetime).
const SLOTS: usize = 16384;
/// Slots a record may be placed in, from the one its key hashes to.
const WINDOW: usize = 64;
/// Seconds a record waits for its connection, and a plain mark lives.
const RECORD_SECS: u64 = 10;
/// Slot state: free.
const FREE: u64 = 0;
/// Kind of a record (bit 32 of `port`): a query asked for the connection.
const ASKED: u64 = 0;
/// Kind of a record: accepted with no query, plain.
const PLAIN: u64 = 1 << 32;

/// One record: state is FREE or the expiry (monotonic seconds + 2).
#[derive(Debug)]
#[repr(C)]
struct Record {
    state: AtomicU64,
    addr_hi: AtomicU64,
    addr_lo: AtomicU64,
    /// The client's port, and the kind ([`ASKED`] or [`PLAIN`]).
    port: AtomicU64,
    /// The nonce of the query that asked (a withdraw names it).
    nonce: AtomicU64,
}

/// The start of the shared memory.
#[derive(Debug)]
#[repr(C)]
struct Header {
    /// 0, or the process id of the holder.
    lock: AtomicU32,
    _pad: AtomicU32,
    /// Until then (monotonic seconds + 2) no query is accepted: a plain
    /// mark found no room.
    overflow_until: AtomicU64,
}

/// Records shared by the processes of one listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Records {
    head: &'static Header,
    slots: &'static [Record],
}

fn now_secs() -> u64 {
    // SAFETY: timespec is plain data; clock_gettime writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and pointer. CLOCK_MONOTONIC is one clock for
    // every process of the host.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 + 2
}

fn key(peer: SocketAddr) -> (u64, u64, u64) {
    let o = match peer.ip().to_canonical() {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let hi = u64::from_be_bytes(o[..8].try_into().unwrap_or([0; 8]));
    let lo = u64::from_be_bytes(o[8..].try_into().unwrap_or([0; 8]));
    (hi, lo, u64::from(peer.port()))
}

/// The records' lock, held (released on drop).
struct Held<'a>(&'a AtomicU32);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.store(0, Ordering::Release);
    }
}

/// This process's id: the library's cached one (a forked child sets its
/// own), not a `getpid` per query and per accept.
#[cfg(not(test))]
fn my_pid() -> u32 {
    crate::conn::pid() as u32
}

#[cfg(test)]
fn my_pid() -> u32 {
    std::process::id()
}

/// Whether process `pid` exists.
fn alive(pid: u32) -> bool {
    let Ok(p) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 sends nothing; it only checks the process exists.
    let r = unsafe { libc::kill(p, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl Records {
    /// Shared memory for the records (inherited by forked children); `None`
    /// if it cannot be mapped.
    pub(crate) fn new_shared() -> Option<Records> {
        let len = Self::MAP_LEN;
        // SAFETY: a fresh anonymous shared mapping; zero-filled, which is
        // an unlocked header and FREE for every slot. A process unmaps its
        // mapping only once nothing of it uses the records any more
        // ([`Records::unmap`]; other processes keep theirs: an accept in
        // any of them may read them at any time), so 'static holds while
        // they are used; the slots follow the header, 8-aligned as both
        // are.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return None;
            }
            let head = &*p.cast::<Header>();
            let slots = p.cast::<u8>().add(size_of::<Header>()).cast::<Record>();
            Some(Records {
                head,
                slots: std::slice::from_raw_parts(slots, SLOTS),
            })
        }
    }

    /// Octets of the mapping.
    const MAP_LEN: usize = size_of::<Header>() + SLOTS * size_of::<Record>();

    /// Unmaps this process's mapping of the records (other processes
    /// keep theirs).
    ///
    /// # Safety
    /// Nothing in this process uses these records (any copy) afterwards.
    unsafe fn unmap(self) {
        // SAFETY: the mapping `new_shared` made (its start and length),
        // unused from now on (the caller's promise).
        unsafe {
            libc::munmap(
                std::ptr::from_ref(self.head).cast_mut().cast(),
                Self::MAP_LEN,
            );
        }
    }

    /// Takes the lock (a holder that died is replaced).
    fn lock(&self) -> Held<'_> {
        let me = my_pid();
        let l = &self.head.lock;
        let mut spins = 0u32;
        loop {
            match l.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Held(l),
                Err(owner) => {
                    spins = spins.wrapping_add(1);
                    if spins.is_multiple_of(64) {
                        std::thread::yield_now();
                    }
                    if spins.is_multiple_of(4096) && owner != 0 && owner != me && !alive(owner) {
                        // Died holding it (the sections are a few hundred
                        // loads and stores, nothing half done matters).
                        let _ = l.compare_exchange(owner, 0, Ordering::AcqRel, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// The window of slots of `peer`'s key.
    fn window(&self, k: (u64, u64, u64)) -> impl Iterator<Item = &'static Record> + use<> {
        let h =
            (k.0 ^ k.1.rotate_left(17) ^ k.2.rotate_left(41)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let start = (h >> 32) as usize % SLOTS;
        let slots = self.slots;
        (0..WINDOW).map(move |i| &slots[(start + i) % SLOTS])
    }

    /// The live record of `k` (lock held).
    fn find(&self, k: (u64, u64, u64), now: u64) -> Option<&'static Record> {
        self.window(k).find(|r| {
            let s = r.state.load(Ordering::Relaxed);
            s != FREE
                && s >= now
                && r.port.load(Ordering::Relaxed) & 0xffff == k.2
                && r.addr_lo.load(Ordering::Relaxed) == k.1
                && r.addr_hi.load(Ordering::Relaxed) == k.0
        })
    }

    /// Records `k` as `kind` (lock held; `nonce`: the query's, for
    /// [`ASKED`]); false if its window is full.
    fn insert(&self, k: (u64, u64, u64), kind: u64, nonce: u64, now: u64) -> bool {
        let slot = self.find(k, now).or_else(|| {
            self.window(k).find(|r| {
                let s = r.state.load(Ordering::Relaxed);
                s == FREE || s < now
            })
        });
        let Some(r) = slot else {
            return false;
        };
        r.addr_hi.store(k.0, Ordering::Relaxed);
        r.addr_lo.store(k.1, Ordering::Relaxed);
        r.port.store(k.2 | kind, Ordering::Relaxed);
        r.nonce.store(nonce, Ordering::Relaxed);
        r.state.store(now + RECORD_SECS, Ordering::Relaxed);
        true
    }

    /// Decides a query (its `nonce`) for a connection from `peer` (lock
    /// held): the kind and flags of the answer.
    fn answer(&self, peer: SocketAddr, nonce: u64) -> (Kind, u8) {
        let k = key(peer);
        let now = now_secs();
        if self.head.overflow_until.load(Ordering::Relaxed) >= now {
            return (Kind::Decline, FLAG_LATE_QUERY);
        }
        match self.find(k, now) {
            Some(r) if r.port.load(Ordering::Relaxed) & PLAIN != 0 => {
                // Accepted before this query came: it stays plain.
                r.state.store(FREE, Ordering::Relaxed);
                (Kind::Decline, FLAG_LATE_QUERY | FLAG_TOO_LATE)
            }
            _ if self.insert(k, ASKED, nonce, now) => (Kind::Accept, FLAG_LATE_QUERY),
            _ => (Kind::Decline, FLAG_LATE_QUERY),
        }
    }

    /// Records a coming connection from `peer` (as a query does); false if
    /// it was declined.
    #[cfg(test)]
    pub(crate) fn put(&self, peer: SocketAddr) -> bool {
        let _g = self.lock();
        self.answer(peer, 0).0 == Kind::Accept
    }

    /// A withdraw of the query `nonce` for the connection from `peer` (lock
    /// held): the client gave up on the answer and connects plain from
    /// that port, so the connection is marked plain (the query's record,
    /// if it was accepted, becomes the mark; a retry of the query that
    /// comes later is declined). A record of another query is left alone.
    fn withdraw(&self, peer: SocketAddr, nonce: u64) {
        let k = key(peer);
        let now = now_secs();
        match self.find(k, now) {
            Some(r) if r.port.load(Ordering::Relaxed) & PLAIN != 0 => {}
            Some(r) if r.nonce.load(Ordering::Relaxed) != nonce => {}
            _ => self.mark_plain(k, now),
        }
    }

    /// Marks `k` plain (lock held); with no room for the mark, no query is
    /// accepted for the records' lifetime.
    fn mark_plain(&self, k: (u64, u64, u64), now: u64) {
        if !self.insert(k, PLAIN, 0, now) {
            self.head
                .overflow_until
                .store(now + RECORD_SECS, Ordering::Relaxed);
        }
    }

    /// Whether a query asked for the connection from `peer` (the record is
    /// consumed); the queries queued on `sock` (the twin's socket, if this
    /// process has it) are answered first. A connection no query asked
    /// for is marked plain, so that a later query for it is declined.
    pub(crate) fn take(&self, peer: SocketAddr, sock: Option<&UdpSocket>) -> bool {
        let _g = self.lock();
        if let Some(sock) = sock {
            self.drain(sock);
        }
        let k = key(peer);
        let now = now_secs();
        match self.find(k, now) {
            Some(r) if r.port.load(Ordering::Relaxed) & PLAIN == 0 => {
                r.state.store(FREE, Ordering::Relaxed);
                true
            }
            Some(_) => false,
            None => {
                self.mark_plain(k, now);
                false
            }
        }
    }

    /// Reads and answers the queries queued on `sock` without blocking
    /// (lock held).
    fn drain(&self, sock: &UdpSocket) {
        while self.answer_one(sock) {}
    }

    /// Reads and answers one query queued on `sock` without blocking (lock
    /// held); false if none was there.
    fn answer_one(&self, sock: &UdpSocket) -> bool {
        let sr = socket2::SockRef::from(sock);
        let mut b = [std::mem::MaybeUninit::<u8>::uninit(); 64];
        loop {
            match sr.recv_from_with_flags(&mut b, libc::MSG_DONTWAIT) {
                Ok((n, from)) => {
                    let n = n.min(b.len());
                    // SAFETY: the kernel initialized the first `n` octets.
                    let got: &[u8] = unsafe { std::slice::from_raw_parts(b.as_ptr().cast(), n) };
                    // No sender: the socket was shut down (its twin was
                    // stopped for an application's own UDP socket), and
                    // every read returns at once from now on.
                    let Some(from) = from.as_socket() else {
                        return false;
                    };
                    self.reply(sock, got, from);
                    return true;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }

    /// Answers one datagram (if it is a query; a withdraw is decided and
    /// not answered; lock held).
    fn reply(&self, sock: &UdpSocket, b: &[u8], from: SocketAddr) {
        let Some(q) = Probe::decode(b) else {
            return;
        };
        let peer = SocketAddr::new(from.ip(), q.client_port);
        if q.kind == Kind::Withdraw {
            self.withdraw(peer, q.nonce);
            return;
        }
        if q.kind != Kind::Query {
            return;
        }
        let (kind, flags) = self.answer(peer, q.nonce);
        // A lost answer makes the client time out and stay plain.
        let _ = sock.send_to(&Probe { kind, flags, ..q }.encode(), from);
    }
}

/// A running twin; dropping it stops the answering thread.
#[derive(Debug)]
#[cfg_attr(test, allow(dead_code))]
pub(crate) struct Twin {
    pub(crate) records: Records,
    /// The twin's socket (forked children have it too: their accepts
    /// answer the queued queries).
    pub(crate) sock: Arc<UdpSocket>,
    /// The listener's address (as bound: its IP may be unspecified).
    pub(crate) addr: SocketAddr,
    /// The twin's `IPV6_V6ONLY` as the kernel has it (false for IPv4).
    v6only: bool,
    /// The process that started the twin (its thread runs there only).
    owner: u32,
    stop: Arc<AtomicBool>,
    /// Set by the twin's thread once it has let go of the socket.
    done: Arc<AtomicBool>,
}

#[cfg_attr(test, allow(dead_code))]
impl Twin {
    /// Binds a UDP socket to the listener's address `addr` and answers
    /// queries on a thread (started with every signal blocked by the
    /// caller). `v6only`: the IPv6 listener's `IPV6_V6ONLY`, which the
    /// twin takes (a dual-stack twin of a listener for IPv6 only took the
    /// port's IPv4 queries from the IPv4 listener of the port).
    pub(crate) fn start(addr: SocketAddr, v6only: Option<bool>) -> std::io::Result<Twin> {
        // The port first: a twin that cannot have it maps nothing.
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::DGRAM,
            None,
        )?;
        if let (true, Some(only)) = (addr.is_ipv6(), v6only) {
            sock.set_only_v6(only)?;
        }
        sock.bind(&addr.into())?;
        let v6only = addr.is_ipv6() && sock.only_v6()?;
        let sock = Arc::new(UdpSocket::from(sock));
        let records = Records::new_shared().ok_or_else(std::io::Error::last_os_error)?;
        sock.set_read_timeout(Some(Duration::from_millis(200)))?;
        // This process may have cached the port as plain (another server
        // had it): its own connections would not ask this twin.
        softrdma_sockets::external::forget_plain_at(sock.local_addr()?);
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicBool::new(false));
        let (s2, k2, d2) = (stop.clone(), sock.clone(), done.clone());
        std::thread::Builder::new()
            .name("softrdma-sd-twin".into())
            .spawn(move || {
                serve(&k2, records, &s2);
                drop(k2);
                d2.store(true, Ordering::Release);
            })?;
        Ok(Twin {
            records,
            sock,
            addr,
            v6only,
            owner: my_pid(),
            stop,
            done,
        })
    }

    /// Whether this process started the twin (a forked child has a copy
    /// of its socket but not its thread).
    pub(crate) fn is_own(&self) -> bool {
        self.owner == my_pid()
    }

    /// Whether the twin's port and address overlap those of a UDP socket
    /// bound (or to be bound) to `other` with `other_v6only` (its
    /// `IPV6_V6ONLY`, for an IPv6 address): the kernel would refuse the
    /// second of the two the port, unless both share it.
    pub(crate) fn overlaps(&self, other: SocketAddr, other_v6only: bool) -> bool {
        self.addr.port() == other.port()
            && Covers::of(self.addr.ip(), self.v6only).meets(Covers::of(other.ip(), other_v6only))
    }

    /// Stops the twin `t` (already taken out of every listener of this
    /// process) and waits, at most `limit`, until its socket is closed and
    /// its port free. False if the twin is still used elsewhere (an accept
    /// in progress) or did not stop in time.
    pub(crate) fn stop_and_release(t: Arc<Twin>, limit: Duration) -> bool {
        let until = std::time::Instant::now() + limit;
        // An accept of another thread may hold the twin for a moment: its
        // records must stay mapped until it is done.
        while Arc::strong_count(&t) > 1 {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let sock = Arc::downgrade(&t.sock);
        let done = t.done.clone();
        // The last holder: dropping it tells the thread to stop.
        drop(t);
        if let Some(s) = sock.upgrade() {
            // Wakes the thread from its wait at once (on an unconnected
            // datagram socket the call reports `ENOTCONN` but still ends
            // every wait for a datagram); the thread then sees the stop.
            let _ = socket2::SockRef::from(&*s).shutdown(std::net::Shutdown::Read);
        }
        while !done.load(Ordering::Acquire) {
            if std::time::Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Whether a query asked for the connection from `peer`; see
    /// [`Records::take`].
    pub(crate) fn take(&self, peer: SocketAddr) -> bool {
        self.records.take(peer, Some(&self.sock))
    }
}

/// How long dropping a twin waits for its thread to let go of the port.
const STOP_WAIT: Duration = Duration::from_secs(1);

impl Drop for Twin {
    /// Stops the thread and, in the process that started it, waits (at
    /// most [`STOP_WAIT`]) until the thread has let go of the socket: the
    /// port is free once the last listener's `close` returns (a `listen`
    /// or UDP `bind` right after on the port found it held for up to the
    /// thread's read timeout: no twin, or `EADDRINUSE`). A forked child
    /// only marks it (the socket is its parent's too: a shutdown would
    /// wake the parent's thread for ever).
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if !self.is_own() {
            return;
        }
        // Wakes the thread from its wait at once (see `stop_and_release`).
        let _ = socket2::SockRef::from(&*self.sock).shutdown(std::net::Shutdown::Read);
        let until = std::time::Instant::now() + STOP_WAIT;
        while !self.done.load(Ordering::Acquire) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// The addresses a UDP socket bound to an address takes its port on, as
/// the kernel compares them: per family none, one, or all (the wildcard).
#[derive(Debug, Clone, Copy)]
struct Covers {
    v4: Part<std::net::Ipv4Addr>,
    v6: Part<std::net::Ipv6Addr>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part<A> {
    None,
    One(A),
    All,
}

impl<A: PartialEq> Part<A> {
    fn meets(self, o: Part<A>) -> bool {
        match (self, o) {
            (Part::None, _) | (_, Part::None) => false,
            (Part::All, _) | (_, Part::All) => true,
            (Part::One(a), Part::One(b)) => a == b,
        }
    }
}

impl Covers {
    /// A socket bound to `ip`; `v6only`: its `IPV6_V6ONLY` (IPv6 only).
    fn of(ip: IpAddr, v6only: bool) -> Covers {
        match ip {
            IpAddr::V4(a) if a.is_unspecified() => Covers {
                v4: Part::All,
                v6: Part::None,
            },
            IpAddr::V4(a) => Covers {
                v4: Part::One(a),
                v6: Part::None,
            },
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                // An IPv4-mapped address is an IPv4 socket's.
                Some(m) => Covers::of(IpAddr::V4(m), false),
                None if a.is_unspecified() => Covers {
                    v4: if v6only { Part::None } else { Part::All },
                    v6: Part::All,
                },
                None => Covers {
                    v4: Part::None,
                    v6: Part::One(a),
                },
            },
        }
    }

    fn meets(self, o: Covers) -> bool {
        self.v4.meets(o.v4) || self.v6.meets(o.v6)
    }
}

/// The twin thread: waits (peeking) until a datagram is there, then reads
/// and answers what is queued with the records locked.
///
/// The wait reads no sender address (`recv` with `MSG_PEEK`, on the
/// unconnected socket): the stop's `shutdown(Read)` ends it with none, and
/// std's `peek_from` parsed the address memory the kernel had not written
/// (a panic when it held an earlier datagram's `AF_INET`).
#[cfg_attr(test, allow(dead_code))]
fn serve(sock: &UdpSocket, records: Records, stop: &AtomicBool) {
    let mut b = [0u8; 1];
    while !stop.load(Ordering::Acquire) {
        if sock.peek(&mut b).is_err() {
            continue;
        }
        if stop.load(Ordering::Acquire) {
            break;
        }
        // One datagram per look: a next one queued makes the next peek
        // return at once, and none costs no receive that finds nothing.
        let _g = records.lock();
        records.answer_one(sock);
    }
    // Stopped: the twin is dropped (its last listener of this process is
    // closed), and with it every use of the records in this process but
    // this thread's. Kept mapped, they were a mapping per listener ever
    // opened, up to the kernel's limit on a process's mappings.
    // SAFETY: nothing in this process uses them after this.
    unsafe { records.unmap() };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Overlap of bound UDP addresses as the kernel sees it: same address
    /// or a wildcard of the family; an IPv6 wildcard takes IPv4 too unless
    /// `IPV6_V6ONLY`; an IPv4-mapped address is IPv4.
    #[test]
    fn covers_meet_as_the_kernel_compares_bound_addresses() {
        let m = |a: &str, a6: bool, b: &str, b6: bool| {
            Covers::of(a.parse().unwrap(), a6).meets(Covers::of(b.parse().unwrap(), b6))
        };
        assert!(m("127.0.0.1", false, "127.0.0.1", false));
        assert!(!m("127.0.0.1", false, "127.0.0.2", false));
        assert!(m("0.0.0.0", false, "127.0.0.2", false));
        assert!(m("::", false, "127.0.0.1", false));
        assert!(!m("::", true, "127.0.0.1", false));
        assert!(!m("::", true, "0.0.0.0", false));
        assert!(m("::", true, "::1", true));
        assert!(m("::", true, "::", false));
        assert!(!m("::1", false, "0.0.0.0", false));
        assert!(m("::ffff:127.0.0.1", false, "0.0.0.0", false));
        assert!(m("::ffff:127.0.0.1", false, "127.0.0.1", false));
        assert!(!m("::ffff:127.0.0.1", false, "::1", false));
    }

    #[test]
    fn records_are_taken_once_and_match_address_and_port() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        assert!(r.put(a));
        assert!(!r.take(b, None));
        assert!(r.take(mapped, None), "v4-mapped is the same peer");
        assert!(!r.take(a, None), "consumed");
    }

    #[test]
    fn records_are_shared_with_a_forked_child() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        // SAFETY: the child only touches atomics in the shared mapping and
        // exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let ok = r.put(a);
            // SAFETY: ends the child without running the parent's handlers.
            unsafe { libc::_exit(i32::from(!ok)) };
        }
        let mut st = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &raw mut st, 0) };
        assert_eq!(st, 0);
        assert!(r.take(a, None), "the child's record is seen by the parent");
    }

    /// An accept no query asked for leaves a plain mark: the query that
    /// comes afterwards (sent beside the SYN, overtaken) is declined as too
    /// late, so both ends keep the connection plain; the mark is consumed.
    #[test]
    fn a_query_after_its_accept_is_declined_too_late() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "127.0.0.1:4100".parse().unwrap();
        assert!(!r.take(a, None));
        let g = r.lock();
        assert_eq!(
            r.answer(a, 1),
            (Kind::Decline, FLAG_LATE_QUERY | FLAG_TOO_LATE)
        );
        assert_eq!(
            r.answer(a, 1),
            (Kind::Accept, FLAG_LATE_QUERY),
            "mark consumed"
        );
        drop(g);
        assert!(r.take(a, None));
    }

    fn query(client_port: u16) -> [u8; softrdma_sockets::detect::MSG_LEN] {
        Probe {
            kind: Kind::Query,
            nonce: 0x1234_5678,
            client_port,
            server_port: 1,
            client_addr: std::net::Ipv6Addr::UNSPECIFIED,
            flags: 0,
        }
        .encode()
    }

    /// Regression: the twin thread waited for a datagram with `peek_from`,
    /// and the stop's `shutdown(Read)` ends that wait with no sender
    /// address (length 0): std parsed the address memory it had left
    /// unwritten, which held an earlier IPv4 address's family (the
    /// thread's stack after datagrams it answered), and its length
    /// assertion panicked. The panic was printed into the application's
    /// stderr (a preloaded server shutting down) and the thread died
    /// without unmapping the records or saying it was done (the listener's
    /// close waited its full second). The wait now reads no address.
    ///
    /// The thread's stack is filled with `AF_INET` first, as an earlier
    /// address leaves it, and the socket is shut down before the stop is
    /// set, so that the wait is woken by the shutdown whenever it starts.
    #[test]
    fn regression_the_twin_thread_panicked_when_its_stop_woke_a_peek_with_no_address() {
        let sock = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
        let records = Records::new_shared().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let (k, s) = (sock.clone(), stop.clone());
        let t = std::thread::spawn(move || {
            #[inline(never)]
            fn leave_inet_families_on_the_stack() {
                let families = [libc::AF_INET as u16; 32 * 1024];
                std::hint::black_box(&families);
            }
            leave_inet_families_on_the_stack();
            serve(&k, records, &s);
        });
        std::thread::sleep(Duration::from_millis(50));
        let _ = socket2::SockRef::from(&*sock).shutdown(std::net::Shutdown::Read);
        std::thread::sleep(Duration::from_millis(50));
        stop.store(true, Ordering::Release);
        assert!(t.join().is_ok(), "the twin thread panicked");
    }

    /// A query still queued on the twin's socket when the connection is
    /// accepted (the twin thread not scheduled yet) is answered by the
    /// accept first: the connection is switched and the client told so,
    /// with the late-query flag.
    #[test]
    fn an_accept_answers_the_queued_queries_first() {
        let r = Records::new_shared().unwrap();
        let twin = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.connect(twin.local_addr().unwrap()).unwrap();
        client.send(&query(4200)).unwrap();
        // Queued (loopback delivers at once); no thread reads it.
        assert!(r.take("127.0.0.1:4200".parse().unwrap(), Some(&twin)));
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 64];
        let n = client.recv(&mut b).unwrap();
        let a = Probe::decode(&b[..n]).unwrap();
        assert_eq!(
            (a.kind, a.nonce, a.client_port),
            (Kind::Accept, 0x1234_5678, 4200)
        );
        assert_eq!(a.flags & FLAG_LATE_QUERY, FLAG_LATE_QUERY);
    }

    /// Regression: a client that heard no answer in time (the twin's
    /// process starved past its wait) connected plain from the port it had
    /// named, and the twin then took its query as accepted: the listener
    /// switched the plain connection. The client's withdraw, queued behind
    /// the query, is read before the accept decides, whether the twin
    /// thread took the query already or not, and is not answered.
    #[test]
    fn a_query_the_client_withdrew_switched_its_plain_connection() {
        let r = Records::new_shared().unwrap();
        let twin = UdpSocket::bind("127.0.0.1:0").unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client.connect(twin.local_addr().unwrap()).unwrap();
        for (port, thread_took_the_query) in [(4300, false), (4301, true)] {
            let mut w = Probe::decode(&query(port)).unwrap();
            w.kind = Kind::Withdraw;
            client.send(&query(port)).unwrap();
            client.send(&w.encode()).unwrap();
            if thread_took_the_query {
                let _g = r.lock();
                assert!(r.answer_one(&twin));
            }
            assert!(
                !r.take(SocketAddr::from(([127, 0, 0, 1], port)), Some(&twin)),
                "switched (the twin thread took the query: {thread_took_the_query})"
            );
            // Only the query was answered (an accept, read by nobody).
            client
                .set_read_timeout(Some(Duration::from_millis(50)))
                .unwrap();
            let mut b = [0u8; 64];
            let n = client.recv(&mut b).unwrap();
            assert_eq!(Probe::decode(&b[..n]).unwrap().kind, Kind::Accept);
            assert!(client.recv(&mut b).is_err(), "a withdraw was answered");
        }
    }

    /// A withdraw naming another query (another nonce) leaves that query's
    /// record: its connection is still switched.
    #[test]
    fn a_withdraw_of_another_query_leaves_the_record() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "127.0.0.1:4400".parse().unwrap();
        let g = r.lock();
        assert_eq!(r.answer(a, 1), (Kind::Accept, FLAG_LATE_QUERY));
        r.withdraw(a, 2);
        drop(g);
        assert!(r.take(a, None));
    }

    /// Once a plain mark finds no room, no query is accepted for the
    /// records' lifetime (a late one could be accepted for a connection
    /// decided plain).
    #[test]
    fn a_full_table_declines_every_query() {
        let r = Records::new_shared().unwrap();
        let b: SocketAddr = "10.9.9.9:7".parse().unwrap();
        let mut i = 0u32;
        while r.head.overflow_until.load(Ordering::Relaxed) == 0 {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i / 60000);
            assert!(!r.take(SocketAddr::new(ip.into(), (i % 60000) as u16 + 1), None));
            i += 1;
            assert!(i < 4 * SLOTS as u32, "the table never filled");
        }
        assert!(!r.put(b));
    }
}
