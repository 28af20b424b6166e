//! `TcpStream` and `TcpListener`: the offload protocol switch behind
//! `std::net`-like types.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use socket2::{Domain, SockAddr, Socket, Type};

use crate::config::{Config, Mode, PlainReason, Transport};
use crate::detect::{self, Answer, LateAnswer, Twin};
use crate::offload::Offload;

#[derive(Debug)]
enum Inner {
    Plain(std::net::TcpStream),
    Offload(Offload),
}

/// Options shared by clones (as a socket's file description shares them).
#[derive(Debug, Default)]
struct Opts {
    nonblocking: AtomicBool,
    read_timeout: Timeout,
    write_timeout: Timeout,
}

/// A read or write time limit, asked for by every read and write: a
/// stream without one (the usual case) answers with one plain load, no
/// lock (a lock and unlock, two locked instructions, per call).
#[derive(Debug, Default)]
struct Timeout {
    /// Whether `limit` holds one.
    set: AtomicBool,
    limit: Mutex<Option<Duration>>,
}

impl Timeout {
    fn get(&self) -> Option<Duration> {
        if !self.set.load(Ordering::Acquire) {
            return None;
        }
        *self.limit.lock()
    }

    fn put(&self, t: Option<Duration>) {
        let mut limit = self.limit.lock();
        *limit = t;
        self.set.store(t.is_some(), Ordering::Release);
    }
}

/// What an async reactor watches for a stream.
#[cfg_attr(not(feature = "tokio"), allow(dead_code))]
pub(crate) enum ReadinessClone {
    /// Plain: a duplicate of the kernel socket.
    Tcp(std::net::TcpStream),
    /// Offloaded: wakers left with the library
    /// ([`TcpStream::poll_offload_ready`]).
    Offload,
}

/// A switch into sockets direct begun by
/// [`TcpStream::begin_upgrade_known`]: this side's frame is written, the
/// peer's is awaited.
#[derive(Debug)]
pub struct Upgrade {
    begun: crate::offload::Begun,
}

impl Upgrade {
    /// Reads what the peer sent so far, without blocking: whether the
    /// switch is done (then [`finish`](Self::finish) does not wait).
    /// Fails as the switch does, its time limit
    /// ([`Config::setup_timeout`], counted from the begin) included; the
    /// connection is unusable then, and every later `poll` or `finish`
    /// fails too (with a message of its own).
    pub fn poll(&mut self) -> io::Result<bool> {
        self.begun
            .poll()
            .map_err(|e| io::Error::other(format!("offload setup failed: {e}")))
    }

    /// The descriptor the switch waits on and whether it waits for room
    /// to write (else for octets to read); `None` once done, and after a
    /// failure. The descriptor is valid only while this `Upgrade` lives.
    pub fn wait_on(&self) -> Option<(RawFd, bool)> {
        self.begun.wait_on().map(|(fd, w)| (fd.as_raw_fd(), w))
    }

    /// Waits for the peer's frame (at most the switch's time limit) and
    /// sets up the offloaded stream, as
    /// [`TcpStream::upgrade_known`] does.
    pub fn finish(self) -> io::Result<TcpStream> {
        self.begun
            .finish()
            .map(|o| {
                // Not our descriptor: its `O_NONBLOCK` stays as it is.
                o.no_recv_sleep();
                TcpStream::offloaded(o)
            })
            .map_err(|e| io::Error::other(format!("offload setup failed: {e}")))
    }
}

/// A TCP connection that is offloaded (SDP over a softrdma queue pair on
/// the same TCP connection) when both ends can, and plain kernel TCP
/// otherwise. Mirrors [`std::net::TcpStream`].
#[derive(Debug)]
pub struct TcpStream {
    inner: Inner,
    transport: Transport,
    opts: Arc<Opts>,
}

fn not_capable() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionRefused,
        "offload required but the peer does not run sockets direct",
    )
}

fn each_addr<A: ToSocketAddrs, T>(
    addr: A,
    mut f: impl FnMut(SocketAddr) -> io::Result<T>,
) -> io::Result<T> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        match f(a) {
            Ok(t) => return Ok(t),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidInput, "no addresses to connect to")
    }))
}

fn plain_connect(
    sock: Option<Socket>,
    addr: SocketAddr,
    timeout: Option<Duration>,
) -> io::Result<std::net::TcpStream> {
    let sock = match sock {
        Some(s) => s,
        None => Socket::new(Domain::for_address(addr), Type::STREAM, None)?,
    };
    let sa = SockAddr::from(addr);
    match timeout {
        Some(t) => sock.connect_timeout(&sa, t)?,
        None => sock.connect(&sa)?,
    }
    Ok(sock.into())
}

/// A stream socket bound to an ephemeral port (the query names it), and
/// the port. `choose`: the port is picked here (see [`choose_port`]), else
/// by the kernel.
fn bound_socket(addr: SocketAddr, choose: bool) -> io::Result<(Socket, u16)> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    let any = |port: u16| -> SocketAddr {
        if addr.is_ipv4() {
            (std::net::Ipv4Addr::UNSPECIFIED, port).into()
        } else {
            (std::net::Ipv6Addr::UNSPECIFIED, port).into()
        }
    };
    if choose {
        sock.set_reuse_address(true)?;
        for _ in 0..16 {
            let port = choose_port();
            match sock.bind(&any(port).into()) {
                Ok(()) => return Ok((sock, port)),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse => {}
                Err(e) => return Err(e),
            }
        }
    }
    sock.bind(&any(0).into())?;
    let port = sock
        .local_addr()?
        .as_socket()
        .map(|a| a.port())
        .unwrap_or(0);
    Ok((sock, port))
}

/// The ephemeral port range (first, last) and reserved port ranges.
type PortSpace = (u16, u16, Vec<(u16, u16)>);

/// The ephemeral port range and reserved ports of the host.
fn port_space() -> &'static PortSpace {
    static SPACE: std::sync::OnceLock<PortSpace> = std::sync::OnceLock::new();
    SPACE.get_or_init(|| {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|t| {
                let mut it = t.split_whitespace().map(|n| n.parse::<u16>().ok());
                Some((it.next()??, it.next()??))
            })
            .filter(|(lo, hi)| lo < hi)
            .unwrap_or((32768, 60999));
        let reserved = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_reserved_ports")
            .unwrap_or_default()
            .trim()
            .split(',')
            .filter_map(|r| {
                let mut it = r.split('-').map(|n| n.trim().parse::<u16>().ok());
                let lo = it.next()??;
                let hi = it.next().flatten().unwrap_or(lo);
                Some((lo, hi))
            })
            .collect();
        (range.0, range.1, reserved)
    })
}

/// A random port of the ephemeral range, not reserved. Binding one chosen
/// port (with `SO_REUSEADDR`) costs one look-up in the kernel, where
/// `bind` to port 0 searches the range for a port no socket holds, in
/// `TIME_WAIT` included: a client making short connections at a few
/// hundred a second fills half the range (the half the kernel gives to
/// `bind`) within the 60 s of `TIME_WAIT`, and each `bind` then took
/// milliseconds.
///
/// For clients that bind before they connect (a capability query names
/// the port): bind the chosen port with `SO_REUSEADDR`, choose again on
/// `EADDRINUSE` (a few times), then fall back to port 0; a connect that
/// fails with `EADDRNOTAVAIL` (the chosen port's connection to the same
/// address is still in `TIME_WAIT`) is made again from a port the kernel
/// picks.
pub fn choose_port() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let (lo, hi, reserved) = port_space();
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(SEQ.fetch_add(1, Ordering::Relaxed));
    let span = u64::from(hi - lo) + 1;
    let mut port = lo + (h.finish() % span) as u16;
    for _ in 0..reserved.len() + 1 {
        match reserved.iter().find(|(a, b)| (*a..=*b).contains(&port)) {
            Some((_, b)) => port = if *b >= *hi { *lo } else { b + 1 },
            None => break,
        }
    }
    port
}

/// What the caller of [`TcpStream::upgrade_known`] knows of the stream's
/// socket, so that the switch need not ask the kernel (a system call less
/// for each). Wrong values make a wrong Hello (addresses) or a switch on a
/// blocking socket: give only what is certain.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Known {
    /// The peer's address, as `getpeername(2)` says it.
    pub peer: Option<SocketAddr>,
    /// `TCP_NODELAY` is set on the socket.
    pub nodelay: bool,
    /// `O_NONBLOCK` is set on the socket.
    pub nonblocking: bool,
}

fn declined() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionRefused,
        "offload required but the peer declined it",
    )
}

/// What a connect with the query sent beside the SYN came to.
enum Late {
    /// The listener switches the connection.
    Switch(std::net::TcpStream),
    /// The connection stays plain.
    Plain(std::net::TcpStream, PlainReason),
    /// Undecided: the connection was closed without a byte; ask first.
    AskFirst,
}

impl TcpStream {
    /// Connects with the default [`Config`] ([`Mode::Auto`]).
    pub fn connect<A: ToSocketAddrs>(addr: A) -> io::Result<TcpStream> {
        Self::connect_with(addr, &Config::default())
    }

    /// Connects with `cfg`.
    pub fn connect_with<A: ToSocketAddrs>(addr: A, cfg: &Config) -> io::Result<TcpStream> {
        each_addr(addr, |a| Self::connect_one(a, cfg, None))
    }

    /// Connects with a time limit on the TCP connect (the capability query
    /// and the switch have their own limits in [`Config`]).
    pub fn connect_timeout(addr: &SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
        Self::connect_timeout_with(addr, timeout, &Config::default())
    }

    /// [`connect_timeout`](Self::connect_timeout) with `cfg`.
    pub fn connect_timeout_with(
        addr: &SocketAddr,
        timeout: Duration,
        cfg: &Config,
    ) -> io::Result<TcpStream> {
        if timeout.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot set a 0 duration timeout",
            ));
        }
        Self::connect_one(*addr, cfg, Some(timeout))
    }

    fn plain(s: std::net::TcpStream, why: PlainReason) -> TcpStream {
        TcpStream {
            inner: Inner::Plain(s),
            transport: Transport::Plain(why),
            opts: Arc::default(),
        }
    }

    fn offloaded(o: Offload) -> TcpStream {
        TcpStream {
            transport: Transport::Offloaded {
                protocol: "sdp",
                crc: o.crc(),
                zero_copy: o.zero_copy(),
            },
            inner: Inner::Offload(o),
            opts: Arc::default(),
        }
    }

    fn connect_one(
        addr: SocketAddr,
        cfg: &Config,
        timeout: Option<Duration>,
    ) -> io::Result<TcpStream> {
        if cfg.mode == Mode::Tcp {
            return Ok(Self::plain(
                plain_connect(None, addr, timeout)?,
                PlainReason::Policy,
            ));
        }
        cfg.checked()?;
        let required = cfg.mode == Mode::Offload;
        if detect::known_plain(addr) {
            if required {
                return Err(not_capable());
            }
            return Ok(Self::plain(
                plain_connect(None, addr, timeout)?,
                PlainReason::PeerNotCapable,
            ));
        }
        // Waiting longer costs a plain peer nothing where its answer is an
        // immediate ICMP port unreachable (loopback), nor where offload is
        // required anyway; a short wait there only turns a busy twin
        // thread into a wrong answer.
        let wait = if required {
            cfg.probe_timeout.max(cfg.setup_timeout)
        } else if addr.ip().is_loopback() {
            cfg.probe_timeout.max(detect::LOOPBACK_PROBE_WAIT)
        } else {
            cfg.probe_timeout
        };
        let mut stream = None;
        if detect::known_late_queries(addr) {
            match Self::connect_late(addr, timeout, wait, required) {
                // The chosen port's connection to `addr` is still in
                // TIME_WAIT: ask first, from a port the kernel picks.
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {}
                Err(e) => return Err(e),
                Ok(Late::Switch(s)) => stream = Some(s),
                Ok(Late::Plain(s, why)) => return Ok(Self::plain(s, why)),
                Ok(Late::AskFirst) => {}
            }
        }
        for choose in [true, false] {
            if stream.is_some() {
                break;
            }
            let (sock, port) = match bound_socket(addr, choose) {
                Ok(x) => x,
                // No port to name in a query (the range is full): a plain
                // connection may still find one (the kernel reuses ports
                // whose other connections are closing).
                Err(e) if !required && e.kind() == io::ErrorKind::AddrInUse => {
                    return Ok(Self::plain(
                        plain_connect(None, addr, timeout)?,
                        PlainReason::LocalResources,
                    ));
                }
                Err(e) => return Err(e),
            };
            match detect::query(addr, port, wait, true) {
                Answer::Accept => {}
                Answer::Decline => {
                    if required {
                        return Err(declined());
                    }
                    return Ok(Self::plain(
                        plain_connect(Some(sock), addr, timeout)?,
                        PlainReason::PeerDeclined,
                    ));
                }
                Answer::NotCapable => {
                    if required {
                        return Err(not_capable());
                    }
                    // A fresh socket (another port): if the query was only
                    // slow, the listener's record of it names the bound
                    // port and must not match this plain connection.
                    drop(sock);
                    return Ok(Self::plain(
                        plain_connect(None, addr, timeout)?,
                        PlainReason::PeerNotCapable,
                    ));
                }
            }
            match plain_connect(Some(sock), addr, timeout) {
                Ok(s) => stream = Some(s),
                // As above: once more from a port the kernel picks.
                Err(e) if choose && e.kind() == io::ErrorKind::AddrNotAvailable => {}
                Err(e) => return Err(e),
            }
        }
        let Some(stream) = stream else {
            return Err(io::ErrorKind::AddrNotAvailable.into());
        };
        let known = Known {
            peer: Some(addr),
            ..Known::default()
        };
        match Offload::establish(stream, true, cfg, &known) {
            Ok(o) => Ok(Self::offloaded(o)),
            Err(e) => {
                if required {
                    return Err(io::Error::new(
                        io::ErrorKind::ConnectionRefused,
                        format!("offload setup failed: {e}"),
                    ));
                }
                // The switch failed before any application data: a fresh
                // plain connection (no query, so the listener keeps it
                // plain).
                Ok(Self::plain(
                    plain_connect(None, addr, timeout)?,
                    PlainReason::SetupFailed,
                ))
            }
        }
    }

    /// Connects with the query sent just before the SYN (the twin of
    /// `addr` is known to decide late queries): the answer is read after
    /// the connect, so the query's round trip overlaps the handshake.
    fn connect_late(
        addr: SocketAddr,
        timeout: Option<Duration>,
        wait: Duration,
        required: bool,
    ) -> io::Result<Late> {
        let Ok((sock, port)) = bound_socket(addr, true) else {
            return Ok(Late::AskFirst);
        };
        let Ok(pending) = detect::send_query(addr, port) else {
            return Ok(Late::AskFirst);
        };
        let stream = plain_connect(Some(sock), addr, timeout)?;
        Ok(match pending.wait_late(wait) {
            LateAnswer::Accept => Late::Switch(stream),
            LateAnswer::Decline { too_late } => {
                if too_late {
                    // The listener took the connection before the query
                    // (a reordered or lost datagram): a connection of its
                    // own, asked for first, may still be switched. Only
                    // worth it where offload is required.
                    if required {
                        drop(stream);
                        return Ok(Late::AskFirst);
                    }
                } else if required {
                    return Err(declined());
                }
                Late::Plain(stream, PlainReason::PeerDeclined)
            }
            LateAnswer::NoTwin => {
                if required {
                    return Err(not_capable());
                }
                Late::Plain(stream, PlainReason::PeerNotCapable)
            }
            LateAnswer::Unknown => {
                // The listener may switch this connection or not: it is
                // closed without a byte, and the next one asks first.
                drop(stream);
                Late::AskFirst
            }
        })
    }

    /// Switches an application's own connected kernel TCP stream into
    /// offloaded mode (both ends must call this at the same point of their
    /// byte stream, one with `initiator` true; see the crate docs). The
    /// ports, names and socket options stay those of `stream`.
    pub fn upgrade(stream: std::net::TcpStream, initiator: bool, cfg: &Config) -> io::Result<Self> {
        Self::upgrade_known(stream, initiator, cfg, &Known::default())
    }

    /// [`upgrade`](Self::upgrade) of a stream whose socket the caller
    /// knows something of (see [`Known`]): the switch does not ask the
    /// kernel for it.
    pub fn upgrade_known(
        stream: std::net::TcpStream,
        initiator: bool,
        cfg: &Config,
        known: &Known,
    ) -> io::Result<Self> {
        // Its blocking mode is left as it is: nothing before the switch
        // reads or writes it, and the switch makes it non-blocking (one
        // system call less per side).
        Self::begin_upgrade_known(stream, initiator, cfg, known)?.finish()
    }

    /// [`upgrade_known`](Self::upgrade_known) without waiting for the
    /// peer: the resources are made and this side's switch frame (the
    /// initiator's MPA Request with the SDP Hello, or the responder's
    /// Reply) is written before this returns; the peer's frame is read by
    /// [`Upgrade::poll`] or [`Upgrade::finish`]. Dropping the
    /// [`Upgrade`] unfinished aborts the switch and closes its descriptor:
    /// the connection is reset, unless another descriptor of the same
    /// socket is still open (then it ends when the last one closes).
    pub fn begin_upgrade_known(
        stream: std::net::TcpStream,
        initiator: bool,
        cfg: &Config,
        known: &Known,
    ) -> io::Result<Upgrade> {
        Offload::begin(stream, initiator, cfg, known)
            .map(|begun| Upgrade { begun })
            .map_err(|e| io::Error::other(format!("offload setup failed: {e}")))
    }

    /// A plain stream that replaces a connection whose switch failed
    /// before any application data (a new connection to the same peer,
    /// made by the caller): its transport says
    /// [`PlainReason::SetupFailed`].
    pub fn plain_after_failed_setup(stream: std::net::TcpStream) -> TcpStream {
        Self::plain(stream, PlainReason::SetupFailed)
    }

    /// What carries the connection, and why.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    fn kernel(&self) -> &std::net::TcpStream {
        match &self.inner {
            Inner::Plain(s) => s,
            Inner::Offload(o) => o.socket(),
        }
    }

    /// The peer's address (of the kernel TCP connection either way).
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.kernel().peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.kernel().local_addr()
    }

    /// Shuts down reading, writing or both. Offloaded: writing ends with
    /// an SDP DisConn after the queued data (the peer reads EOF after it).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(s) => s.shutdown(how),
            Inner::Offload(o) => o.shutdown(how),
        }
    }

    /// Resets the connection (offloaded: SDP AbortConn then RST; plain:
    /// `SO_LINGER` 0 and close). The peer's calls fail with
    /// `ConnectionReset`.
    pub fn abort(self) {
        match &self.inner {
            Inner::Plain(s) => {
                let _ = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO));
            }
            Inner::Offload(o) => o.abort(),
        }
    }

    /// Reads without consuming.
    pub fn peek(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Plain(s) => s.peek(buf),
            Inner::Offload(o) => o.read(buf, true, self.nonblocking(), self.read_timeout()?),
        }
    }

    fn nonblocking(&self) -> bool {
        self.opts.nonblocking.load(Ordering::Relaxed)
    }

    /// Non-blocking mode: calls that would wait fail with `WouldBlock`.
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(s) => s.set_nonblocking(on)?,
            // The engine's IO does not depend on the kernel socket's
            // mode (every read and write says `MSG_DONTWAIT`); a blocked
            // call may make it blocking to sleep in its `recv`.
            Inner::Offload(_) => {}
        }
        self.opts.nonblocking.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Read time limit (`None`: wait forever). A timed-out read fails with
    /// `WouldBlock`, as `std` does on Unix.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot set a 0 duration timeout",
            ));
        }
        if let Inner::Plain(s) = &self.inner {
            s.set_read_timeout(t)?;
        }
        self.opts.read_timeout.put(t);
        Ok(())
    }

    /// Write time limit.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "cannot set a 0 duration timeout",
            ));
        }
        if let Inner::Plain(s) = &self.inner {
            s.set_write_timeout(t)?;
        }
        self.opts.write_timeout.put(t);
        Ok(())
    }

    /// The read time limit.
    pub fn read_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.opts.read_timeout.get())
    }

    /// The write time limit.
    pub fn write_timeout(&self) -> io::Result<Option<Duration>> {
        Ok(self.opts.write_timeout.get())
    }

    /// `TCP_NODELAY`: offloaded, small writes are no longer corked while
    /// earlier data is queued.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(s) => s.set_nodelay(on),
            Inner::Offload(o) => {
                o.set_nodelay(on);
                Ok(())
            }
        }
    }

    /// The `TCP_NODELAY` setting.
    pub fn nodelay(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Plain(s) => s.nodelay(),
            Inner::Offload(o) => Ok(o.nodelay()),
        }
    }

    /// `TCP_CORK`: while on, small writes are held and go together as one
    /// message (offloaded: in the staging buffers; plain: the kernel's
    /// option) when it is turned off, when a buffer fills, or after at
    /// most 200 ms (offloaded: seen by the next call on the stream or
    /// wait that looks at it).
    pub fn set_cork(&self, on: bool) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(s) => rustix::net::sockopt::set_tcp_cork(s, on).map_err(io::Error::from),
            Inner::Offload(o) => {
                o.set_cork(on);
                Ok(())
            }
        }
    }

    /// `TCP_CORK` off, as [`set_cork(false)`](Self::set_cork), unless that
    /// would wait for another call on the stream to finish (an offloaded
    /// stream's lock is taken): then `Ok(false)` and nothing changes. For
    /// exit handlers and signal handlers, which may have interrupted a
    /// call on the same stream in their own thread.
    ///
    /// # Errors
    ///
    /// As [`set_cork`](Self::set_cork) for a plain connection.
    pub fn try_uncork(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Plain(s) => rustix::net::sockopt::set_tcp_cork(s, false)
                .map(|()| true)
                .map_err(io::Error::from),
            Inner::Offload(o) => Ok(o.try_uncork()),
        }
    }

    /// The `TCP_CORK` setting.
    pub fn cork(&self) -> io::Result<bool> {
        match &self.inner {
            Inner::Plain(s) => rustix::net::sockopt::tcp_cork(s).map_err(io::Error::from),
            Inner::Offload(o) => Ok(o.cork()),
        }
    }

    /// Another handle to the same connection.
    pub fn try_clone(&self) -> io::Result<TcpStream> {
        Ok(TcpStream {
            inner: match &self.inner {
                Inner::Plain(s) => Inner::Plain(s.try_clone()?),
                Inner::Offload(o) => Inner::Offload(o.clone()),
            },
            transport: self.transport,
            opts: self.opts.clone(),
        })
    }

    /// The pending error, if any (cleared for plain sockets as
    /// `SO_ERROR`; offloaded connections keep reporting it).
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        match &self.inner {
            Inner::Plain(s) => s.take_error(),
            Inner::Offload(o) => Ok(o.take_error()),
        }
    }

    /// A descriptor for poll/epoll: readable when data, end of stream or an
    /// error is there, writable when a write would not block. Plain: the
    /// kernel socket. Offloaded: a socket the library keeps in sync (from
    /// the first call of this method on; it must not be read or written).
    pub fn readiness_fd(&self) -> io::Result<RawFd> {
        match &self.inner {
            Inner::Plain(s) => Ok(s.as_raw_fd()),
            Inner::Offload(o) => o.readiness_fd(),
        }
    }

    /// Whether the readiness descriptor ([`readiness_fd`](Self::readiness_fd))
    /// is looked at only by callers of [`crate::poll`] (an epoll instance
    /// waited on with [`crate::poll::wait_progress`] and a look after it),
    /// which bring it up to date themselves: on, the library no longer has
    /// the engine's threads keep it in sync (no CQ arm for it, so no thread
    /// hand-off per message); a thread that waits on the descriptor any
    /// other way then misses changes until a call into the library. Off
    /// (the default): kept in sync by the engine. No effect on plain
    /// streams.
    pub fn set_readiness_polled(&self, on: bool) {
        if let Inner::Offload(o) = &self.inner {
            o.set_readiness_polled(on);
        }
    }

    /// Offloaded: how many messages (data, end of stream) and failures the
    /// connection has taken in so far; a change means new data may be
    /// readable (an edge, for edge-triggered readiness kept by the
    /// caller). Always 0 for a plain stream.
    pub fn arrivals(&self) -> u64 {
        match &self.inner {
            Inner::Plain(_) => 0,
            Inner::Offload(o) => o.arrivals(),
        }
    }

    /// Offloaded: whether a read, and a write, would not block now (the
    /// completions already in the CQ are handled first; no system call).
    /// `None` for a plain stream (ask the kernel).
    pub fn ready_now(&self) -> Option<(bool, bool)> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Offload(o) => Some(o.ready_now()),
        }
    }

    /// The offloaded connection, if any (for [`crate::poll`]).
    pub(crate) fn offload(&self) -> Option<&Offload> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Offload(o) => Some(o),
        }
    }

    /// What an async reactor watches (plain: another descriptor of the
    /// kernel socket).
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn readiness_clone(&self) -> io::Result<ReadinessClone> {
        match &self.inner {
            Inner::Plain(s) => Ok(ReadinessClone::Tcp(s.try_clone()?)),
            Inner::Offload(_) => Ok(ReadinessClone::Offload),
        }
    }

    /// Offloaded: whether a read (`write`: a write) would not block now,
    /// else `waker` is woken when it would. `None` for a plain stream.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn poll_offload_ready(&self, write: bool, waker: &std::task::Waker) -> Option<bool> {
        match &self.inner {
            Inner::Plain(_) => None,
            Inner::Offload(o) => Some(o.poll_ready(write, waker)),
        }
    }

    /// Lets corked data go out as soon as credits allow, without waiting.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn push(&self) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(_) => Ok(()),
            Inner::Offload(o) => o.push(),
        }
    }

    /// Sends everything queued now (a corked small write included).
    fn flush_inner(&self) -> io::Result<()> {
        match &self.inner {
            Inner::Plain(_) => Ok(()),
            Inner::Offload(o) => o.flush(self.opts.write_timeout.get()),
        }
    }

    fn read_inner(&self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Plain(s) => (&*s).read(buf),
            Inner::Offload(o) => o.read(buf, false, self.nonblocking(), self.read_timeout()?),
        }
    }

    /// `read` through the handle borrowed exclusively (`Read` of a
    /// `TcpStream`, not of a `&TcpStream`): with no clone of it, no other
    /// thread can call on the connection meanwhile, and a blocked read
    /// sleeps in the socket's `recv` without a time limit (see
    /// `Offload::read_sole`).
    fn read_exclusive(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Plain(s) => (&*s).read(buf),
            Inner::Offload(o) => o.read_sole(buf, self.nonblocking(), self.read_timeout()?),
        }
    }

    fn write_inner(&self, buf: &[u8]) -> io::Result<usize> {
        match &self.inner {
            Inner::Plain(s) => (&*s).write(buf),
            Inner::Offload(o) => o.write(buf, self.nonblocking(), self.write_timeout()?),
        }
    }

    fn write_vectored_inner(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match &self.inner {
            Inner::Plain(s) => (&*s).write_vectored(bufs),
            Inner::Offload(o) => o.write_vectored(bufs, self.nonblocking(), self.write_timeout()?),
        }
    }
}

impl Read for TcpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_exclusive(buf)
    }
}

impl Read for &TcpStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.read_inner(buf)
    }
}

impl Write for TcpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }
    /// Offloaded: the pieces are copied straight into the send buffers.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.write_vectored_inner(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flush_inner()
    }
}

impl Write for &TcpStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_inner(buf)
    }
    /// Offloaded: the pieces are copied straight into the send buffers.
    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.write_vectored_inner(bufs)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flush_inner()
    }
}

impl AsRawFd for TcpStream {
    /// The kernel TCP socket (offloaded: a duplicate of the one the queue
    /// pair uses; for names and options only, never for reading/writing;
    /// the engine owns its `O_NONBLOCK`, `SO_RCVTIMEO` and `SO_RCVLOWAT`,
    /// which a blocked call's sleep in `recv` relies on).
    fn as_raw_fd(&self) -> RawFd {
        self.kernel().as_raw_fd()
    }
}

impl AsFd for TcpStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.kernel().as_fd()
    }
}

/// The backlog `std::net::TcpListener::bind` gives a listener.
const LISTEN_BACKLOG: i32 = 128;

/// A TCP socket bound to `a` as `std::net::TcpListener::bind` binds one
/// (`SO_REUSEADDR`, close-on-exec), not listening yet.
fn bound_unlistened(a: SocketAddr) -> io::Result<Socket> {
    let sock = Socket::new(
        Domain::for_address(a),
        Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    sock.set_reuse_address(true)?;
    sock.bind(&a.into())?;
    Ok(sock)
}

/// A listener accepting plain TCP clients and offloaded clients alike on
/// one port. Mirrors [`std::net::TcpListener`].
#[derive(Debug)]
pub struct TcpListener {
    inner: std::net::TcpListener,
    cfg: Config,
    twin: Option<Arc<Twin>>,
}

impl TcpListener {
    /// Binds with the default [`Config`] ([`Mode::Auto`]).
    pub fn bind<A: ToSocketAddrs>(addr: A) -> io::Result<TcpListener> {
        Self::bind_with(addr, &Config::default())
    }

    /// Binds with `cfg`. Unless the mode is [`Mode::Tcp`], a UDP twin on
    /// the same address and port answers clients' capability queries (for
    /// port 0 a port free for both is picked); the port listens only once
    /// its twin answers, so no client connects without being able to ask.
    pub fn bind_with<A: ToSocketAddrs>(addr: A, cfg: &Config) -> io::Result<TcpListener> {
        if cfg.mode != Mode::Tcp {
            cfg.checked()?;
        }
        each_addr(addr, |a| {
            if cfg.mode == Mode::Tcp {
                return Ok(TcpListener {
                    inner: std::net::TcpListener::bind(a)?,
                    cfg: cfg.clone(),
                    twin: None,
                });
            }
            let mut tries = 0;
            loop {
                tries += 1;
                // Bound but not yet listening while the twin starts: a
                // client that connected in between would have found no
                // twin to ask and gone plain (dropped by an offload-only
                // listener). Until `listen` it is refused, as by a server
                // not started yet.
                let sock = bound_unlistened(a)?;
                let local = sock.local_addr()?.as_socket().ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "not an IP address")
                })?;
                #[cfg(test)]
                tests_hooks::before_twin(local);
                let twin = match Twin::start(local, true) {
                    Ok(t) => Some(Arc::new(t)),
                    Err(_) if a.port() == 0 && tries < 16 => continue,
                    Err(e) if cfg.mode == Mode::Offload => return Err(e),
                    // Plain only: clients' queries go unanswered.
                    Err(_) => None,
                };
                sock.listen(LISTEN_BACKLOG)?;
                return Ok(TcpListener {
                    inner: sock.into(),
                    cfg: cfg.clone(),
                    twin,
                });
            }
        })
    }

    /// Whether this listener can accept offloaded clients.
    pub fn offload_capable(&self) -> bool {
        self.twin.is_some()
    }

    /// Accepts a connection: offloaded if the client asked for it (the
    /// switch runs here, bounded by [`Config::setup_timeout`]), plain
    /// otherwise. With [`Mode::Offload`], plain clients are dropped; a
    /// client whose switch fails is dropped (it reconnects plain).
    pub fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        loop {
            let (s, peer) = self.inner.accept()?;
            if let Some(t) = self.decide(s, peer) {
                return Ok((t, peer));
            }
        }
    }

    /// Decides an accepted kernel connection: switched if its client asked
    /// (blocks for the switch), plain otherwise; `None` if it was dropped
    /// (failed switch, or a plain client of an offload-only listener).
    pub(crate) fn decide(&self, s: std::net::TcpStream, peer: SocketAddr) -> Option<TcpStream> {
        let asked = self.twin.as_ref().is_some_and(|t| t.take(peer));
        if asked {
            // No `set_nonblocking(false)`: the switch makes the stream
            // non-blocking before its first read or write.
            let known = Known {
                peer: Some(peer),
                ..Known::default()
            };
            return Offload::establish(s, false, &self.cfg, &known)
                .ok()
                .map(TcpStream::offloaded);
        }
        if self.cfg.mode == Mode::Offload {
            return None;
        }
        let why = if self.cfg.mode == Mode::Tcp {
            PlainReason::Policy
        } else if self.twin.is_none() {
            PlainReason::LocalResources
        } else {
            PlainReason::ClientPlain
        };
        Some(TcpStream::plain(s, why))
    }

    /// Another descriptor of the kernel listener.
    #[cfg_attr(not(feature = "tokio"), allow(dead_code))]
    pub(crate) fn kernel_clone(&self) -> io::Result<std::net::TcpListener> {
        self.inner.try_clone()
    }

    /// An iterator over accepted connections.
    pub fn incoming(&self) -> impl Iterator<Item = io::Result<TcpStream>> + '_ {
        std::iter::from_fn(move || Some(self.accept().map(|(s, _)| s)))
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Non-blocking accept (`WouldBlock` when no client waits).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        self.inner.set_nonblocking(on)
    }

    /// Another handle to the same listener.
    pub fn try_clone(&self) -> io::Result<TcpListener> {
        Ok(TcpListener {
            inner: self.inner.try_clone()?,
            cfg: self.cfg.clone(),
            twin: self.twin.clone(),
        })
    }

    /// The pending error, if any.
    pub fn take_error(&self) -> io::Result<Option<io::Error>> {
        self.inner.take_error()
    }
}

impl AsRawFd for TcpListener {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

impl AsFd for TcpListener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.as_fd()
    }
}

/// Test hooks inside [`TcpListener::bind_with`].
#[cfg(test)]
mod tests_hooks {
    use std::cell::RefCell;
    use std::net::SocketAddr;

    type Hook = Box<dyn Fn(SocketAddr)>;

    thread_local! {
        static BEFORE_TWIN: RefCell<Option<Hook>> = const { RefCell::new(None) };
    }

    /// Runs `f` (on this thread) just before each twin of a listener bound
    /// by this thread starts, with the listener's address.
    pub(super) fn set_before_twin(f: Option<Hook>) {
        BEFORE_TWIN.with(|h| *h.borrow_mut() = f);
    }

    pub(super) fn before_twin(a: SocketAddr) {
        BEFORE_TWIN.with(|h| {
            if let Some(f) = h.borrow().as_ref() {
                f(a)
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that connected between the listener's `listen` and its
    /// twin's start found no twin to ask: it went plain, and an
    /// offload-only listener dropped it. The port now listens only once
    /// the twin answers.
    #[test]
    fn a_client_connecting_before_the_listeners_twin_started_was_accepted_plain() {
        let refused = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let r = refused.clone();
        tests_hooks::set_before_twin(Some(Box::new(move |a| {
            let e = std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2));
            r.store(
                matches!(&e, Err(e) if e.kind() == io::ErrorKind::ConnectionRefused),
                std::sync::atomic::Ordering::SeqCst,
            );
        })));
        let cfg = Config {
            mode: Mode::Offload,
            ..Config::default()
        };
        let l = TcpListener::bind_with("127.0.0.1:0", &cfg);
        tests_hooks::set_before_twin(None);
        let l = l.expect("bind");
        assert!(
            refused.load(std::sync::atomic::Ordering::SeqCst),
            "the port took a connection before its twin answered queries"
        );
        assert!(l.offload_capable());
        // It listens now, with its twin.
        let a = l.local_addr().unwrap();
        let server = std::thread::spawn(move || l.accept().map(|(s, _)| s.transport()));
        let c = TcpStream::connect_with(a, &cfg).expect("connect");
        let t = server.join().unwrap().expect("accept");
        assert!(t.is_offloaded(), "{t:?}");
        assert!(c.transport().is_offloaded());
    }

    /// A time limit reads back as set, changed and cleared (the lock-free
    /// answer is `None` only while none is set).
    #[test]
    fn time_limits_read_back_as_set() {
        let t = Timeout::default();
        assert_eq!(t.get(), None);
        t.put(Some(Duration::from_millis(5)));
        assert_eq!(t.get(), Some(Duration::from_millis(5)));
        t.put(Some(Duration::MAX));
        assert_eq!(t.get(), Some(Duration::MAX));
        t.put(None);
        assert_eq!(t.get(), None);
    }

    /// Chosen ports are in the host's ephemeral range and not reserved,
    /// and a socket bound to one connects (the switch's bind path).
    #[test]
    fn chosen_ports_are_ephemeral_and_usable() {
        let (lo, hi, reserved) = port_space();
        for _ in 0..1000 {
            let p = choose_port();
            assert!((*lo..=*hi).contains(&p), "{p}");
            assert!(!reserved.iter().any(|(a, b)| (*a..=*b).contains(&p)));
        }
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        for _ in 0..50 {
            let (sock, port) = bound_socket(addr, true).unwrap();
            let s = plain_connect(Some(sock), addr, None).unwrap();
            assert_eq!(s.local_addr().unwrap().port(), port);
            let (a, _) = l.accept().unwrap();
            assert_eq!(a.peer_addr().unwrap().port(), port);
        }
    }
}
