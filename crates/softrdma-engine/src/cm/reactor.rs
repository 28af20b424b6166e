//! The CM reactor: one engine thread that drives every listening socket's
//! accepts and every handshake in progress, with `epoll` (the engine's
//! one-shot [`Reactor`](crate::sys::poll::Reactor)) and a timer set of
//! per-connection deadlines. Other threads hand it work through a command
//! list and a wake-up; nothing here blocks except the `epoll` wait.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock, mpsc};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use polling::Events;

use super::{CmError, CmEvent, ConnRequest, Connection, ListenerShared, connect_error};
use crate::handshake::{Answer, Handshake, HandshakeError, Outcome, Step};
use crate::sys::clock;
use crate::sys::poll::{Interest, Reactor};
use crate::sys::wait::Readiness;

/// Connections accepted per listener readiness before others get a turn.
const ACCEPT_BATCH: usize = 256;

/// Pause before retrying accepts after an error such as `EMFILE`.
const ACCEPT_RETRY: Duration = Duration::from_millis(20);

/// How long dropping a listener waits for the reactor to close it.
const UNLISTEN_WAIT: Duration = Duration::from_secs(5);

/// A handshake to finish (non-blocking accept or reject).
#[derive(Debug)]
pub(super) struct Job {
    pub(super) stream: TcpStream,
    pub(super) hs: Handshake,
    /// The connection to establish (`None`: a reject, closed when sent).
    pub(super) conn: Option<Connection>,
    pub(super) peer: Option<SocketAddr>,
    pub(super) timeout: Duration,
}

/// A connect to run.
#[derive(Debug)]
pub(super) struct Outgoing {
    pub(super) addrs: Vec<SocketAddr>,
    pub(super) hs: Handshake,
    pub(super) conn: Connection,
    pub(super) timeout: Duration,
}

#[derive(Debug)]
enum Cmd {
    Listen {
        id: u64,
        sock: TcpListener,
        shared: Arc<ListenerShared>,
    },
    Unlisten {
        id: u64,
        done: mpsc::Sender<()>,
    },
    Drive(Job),
    Connect(Outgoing),
}

#[derive(Debug)]
struct Handle {
    poll: Reactor,
    cmds: Mutex<Vec<Cmd>>,
    next_listener: std::sync::atomic::AtomicU64,
}

static HANDLE: OnceLock<&'static Handle> = OnceLock::new();
static START: Mutex<()> = Mutex::new(());

/// The reactor, started on first use.
fn handle() -> io::Result<&'static Handle> {
    if let Some(h) = HANDLE.get() {
        return Ok(h);
    }
    let _g = START.lock();
    if let Some(h) = HANDLE.get() {
        return Ok(h);
    }
    let h: &'static Handle = Box::leak(Box::new(Handle {
        poll: Reactor::new()?,
        cmds: Mutex::new(Vec::new()),
        next_listener: std::sync::atomic::AtomicU64::new(1),
    }));
    crate::sys::io::spawn_engine_thread("softrdma-cm".into(), move || run(h))?;
    let _ = HANDLE.set(h);
    Ok(h)
}

fn send(cmd: Cmd) -> io::Result<()> {
    let h = handle()?;
    h.cmds.lock().push(cmd);
    h.poll.notify();
    Ok(())
}

/// Hands a listening socket to the reactor; returns its id.
pub(super) fn listen(sock: TcpListener, shared: Arc<ListenerShared>) -> io::Result<u64> {
    let id = handle()?.next_listener.fetch_add(1, Ordering::Relaxed);
    send(Cmd::Listen { id, sock, shared })?;
    Ok(id)
}

/// Closes a listener and its handshakes in progress; returns once done.
pub(super) fn unlisten(id: u64) {
    let (tx, rx) = mpsc::channel();
    if send(Cmd::Unlisten { id, done: tx }).is_ok() {
        let _ = rx.recv_timeout(UNLISTEN_WAIT);
    }
}

/// Hands a handshake to finish to the reactor.
pub(super) fn drive(job: Job) -> Result<(), CmError> {
    Ok(send(Cmd::Drive(job))?)
}

/// Hands a connect to the reactor.
pub(super) fn connect(o: Outgoing) -> io::Result<()> {
    send(Cmd::Connect(o))
}

#[derive(Debug)]
struct Listening {
    sock: TcpListener,
    shared: Arc<ListenerShared>,
    key: usize,
    /// Handshakes in progress, oldest first.
    inflight: VecDeque<usize>,
}

#[derive(Debug)]
enum Entry {
    /// A listening socket.
    Listener(u64),
    /// An incoming connection before its Request is complete.
    Incoming {
        stream: TcpStream,
        peer: SocketAddr,
        hs: Handshake,
        listener: u64,
        deadline: Instant,
    },
    /// An outgoing connect, or an answered incoming connection.
    Setup {
        stream: TcpStream,
        hs: Handshake,
        conn: Option<Connection>,
        peer: Option<SocketAddr>,
        timeout: Duration,
        deadline: Instant,
        /// TCP connect in progress to `peer`; other addresses to try.
        connecting: Option<Vec<SocketAddr>>,
    },
}

impl Entry {
    fn deadline(&self) -> Option<Instant> {
        match self {
            Entry::Listener(_) => None,
            Entry::Incoming { deadline, .. } | Entry::Setup { deadline, .. } => Some(*deadline),
        }
    }

    fn fd(&self, listeners: &HashMap<u64, Listening>) -> Option<RawFd> {
        match self {
            Entry::Listener(id) => listeners.get(id).map(|l| l.sock.as_raw_fd()),
            Entry::Incoming { stream, .. } | Entry::Setup { stream, .. } => {
                Some(stream.as_raw_fd())
            }
        }
    }
}

struct State {
    h: &'static Handle,
    entries: HashMap<usize, Entry>,
    listeners: HashMap<u64, Listening>,
    timers: BTreeSet<(Instant, usize)>,
    next_key: usize,
}

fn deadline_after(t: Duration) -> Instant {
    let now = clock::now();
    now.checked_add(t)
        .unwrap_or(now + Duration::from_secs(86_400 * 365))
}

fn interest(r: Readiness) -> Interest {
    match r {
        Readiness::Read => Interest::Read,
        Readiness::Write => Interest::Write,
    }
}

fn run(h: &'static Handle) {
    let mut st = State {
        h,
        entries: HashMap::new(),
        listeners: HashMap::new(),
        timers: BTreeSet::new(),
        next_key: 1,
    };
    let mut events = Events::new();
    let mut keys = Vec::new();
    loop {
        let timeout = st
            .timers
            .first()
            .map(|(t, _)| t.saturating_duration_since(clock::now()));
        keys.clear();
        if h.poll.wait(&mut events, &mut keys, timeout).is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        let cmds = std::mem::take(&mut *h.cmds.lock());
        for c in cmds {
            st.command(c);
        }
        for &k in &keys {
            st.ready(k);
        }
        let now = clock::now();
        while let Some(&(t, k)) = st.timers.first() {
            if t > now {
                break;
            }
            st.timers.remove(&(t, k));
            st.expired(k);
        }
    }
}

impl State {
    fn alloc(&mut self) -> usize {
        let k = self.next_key;
        self.next_key = self.next_key.wrapping_add(1).max(1);
        k
    }

    fn arm(&self, fd: RawFd, key: usize, r: Readiness) -> io::Result<()> {
        self.h.poll.arm(fd, key, interest(r))
    }

    /// Inserts an entry with its timer.
    fn insert(&mut self, key: usize, e: Entry) {
        if let Some(d) = e.deadline() {
            self.timers.insert((d, key));
        }
        self.entries.insert(key, e);
    }

    /// Takes an entry out (timer and epoll registration with it).
    fn take(&mut self, key: usize) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        if let Some(d) = e.deadline() {
            self.timers.remove(&(d, key));
        }
        if let Some(fd) = e.fd(&self.listeners) {
            self.h.poll.remove(fd);
        }
        Some(e)
    }

    fn command(&mut self, c: Cmd) {
        match c {
            Cmd::Listen { id, sock, shared } => {
                let key = self.alloc();
                let fd = sock.as_raw_fd();
                self.listeners.insert(
                    id,
                    Listening {
                        sock,
                        shared,
                        key,
                        inflight: VecDeque::new(),
                    },
                );
                self.entries.insert(key, Entry::Listener(id));
                if self.arm(fd, key, Readiness::Read).is_err() {
                    self.timers.insert((deadline_after(ACCEPT_RETRY), key));
                }
            }
            Cmd::Unlisten { id, done } => {
                if let Some(l) = self.listeners.get(&id) {
                    let key = l.key;
                    let inflight: Vec<usize> = l.inflight.iter().copied().collect();
                    for k in inflight {
                        if let Some(Entry::Incoming { stream, .. }) = self.take(k) {
                            let _ = stream.shutdown(Shutdown::Both);
                        }
                    }
                    self.take(key);
                    self.timers.retain(|&(_, k)| k != key);
                    if let Some(l) = self.listeners.remove(&id) {
                        l.shared.handshakes.store(0, Ordering::Relaxed);
                    }
                }
                let _ = done.send(());
            }
            Cmd::Drive(job) => {
                let key = self.alloc();
                self.insert(
                    key,
                    Entry::Setup {
                        stream: job.stream,
                        hs: job.hs,
                        conn: job.conn,
                        peer: job.peer,
                        timeout: job.timeout,
                        deadline: deadline_after(job.timeout),
                        connecting: None,
                    },
                );
                self.ready(key);
            }
            Cmd::Connect(o) => {
                let key = self.alloc();
                let deadline = deadline_after(o.timeout);
                let mut addrs = o.addrs;
                addrs.reverse();
                self.start_connect(key, o.hs, o.conn, o.timeout, deadline, addrs, None);
            }
        }
    }

    /// Starts a TCP connect to the next address in `rest` (popped from the
    /// back); reports the failure when there is none left.
    #[allow(clippy::too_many_arguments)]
    fn start_connect(
        &mut self,
        key: usize,
        hs: Handshake,
        conn: Connection,
        timeout: Duration,
        deadline: Instant,
        mut rest: Vec<SocketAddr>,
        last: Option<io::Error>,
    ) {
        let Some(addr) = rest.pop() else {
            let e = connect_error(last.unwrap_or_else(|| io::Error::other("no address")));
            conn.on_setup_error(e, None);
            return;
        };
        match start_tcp(addr) {
            Ok(stream) => {
                let fd = stream.as_raw_fd();
                // Loopback connects usually finish inside connect(2): go on
                // at once rather than through an epoll round.
                let connected = stream.peer_addr().is_ok();
                self.insert(
                    key,
                    Entry::Setup {
                        stream,
                        hs,
                        conn: Some(conn),
                        peer: Some(addr),
                        timeout,
                        deadline,
                        connecting: Some(rest),
                    },
                );
                if connected {
                    self.setup(key);
                    return;
                }
                if let Err(e) = self.arm(fd, key, Readiness::Write)
                    && let Some(Entry::Setup {
                        hs,
                        conn: Some(conn),
                        connecting: Some(rest),
                        ..
                    }) = self.take(key)
                {
                    self.start_connect(key, hs, conn, timeout, deadline, rest, Some(e));
                }
            }
            Err(e) => self.start_connect(key, hs, conn, timeout, deadline, rest, Some(e)),
        }
    }

    fn ready(&mut self, key: usize) {
        match self.entries.get(&key) {
            None => {}
            Some(Entry::Listener(id)) => {
                let id = *id;
                self.accept(id);
            }
            Some(Entry::Incoming { .. }) => self.incoming(key),
            Some(Entry::Setup { .. }) => self.setup(key),
        }
    }

    fn accept(&mut self, id: u64) {
        let mut retry_later = false;
        for _ in 0..ACCEPT_BATCH {
            let Some(l) = self.listeners.get(&id) else {
                return;
            };
            match l.sock.accept() {
                Ok((stream, peer)) => self.on_incoming(id, stream, peer),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(_) => {
                    // EMFILE and the like: try again a little later rather
                    // than spin on a listener that stays readable.
                    retry_later = true;
                    break;
                }
            }
        }
        let Some(l) = self.listeners.get(&id) else {
            return;
        };
        let (fd, key) = (l.sock.as_raw_fd(), l.key);
        if retry_later || self.arm(fd, key, Readiness::Read).is_err() {
            self.timers.insert((deadline_after(ACCEPT_RETRY), key));
        }
    }

    fn on_incoming(&mut self, id: u64, stream: TcpStream, peer: SocketAddr) {
        let Some(l) = self.listeners.get(&id) else {
            return;
        };
        let shared = l.shared.clone();
        let config = &shared.config;
        if l.inflight.len() >= config.max_handshakes {
            // At the limit: the oldest connection that sent nothing makes
            // room (else the oldest).
            let victim = l
                .inflight
                .iter()
                .copied()
                .find(|k| {
                    matches!(self.entries.get(k), Some(Entry::Incoming { hs, .. }) if hs.received() == 0)
                })
                .or_else(|| l.inflight.front().copied());
            if let Some(v) = victim {
                let max = config.max_handshakes;
                self.end_incoming(v, |peer| {
                    format!(
                        "incoming connection from {peer} dropped: {max} handshakes in progress (the limit), it was the oldest"
                    )
                });
            }
        }
        let started = (|| -> Result<Handshake, CmError> {
            stream.set_nonblocking(true)?;
            stream.set_nodelay(true)?;
            Ok(Handshake::responder(config.mpa.clone(), Answer::Hold)?)
        })();
        let hs = match started {
            Ok(hs) => hs,
            Err(e) => {
                let _ = stream.shutdown(Shutdown::Both);
                shared.event(CmEvent::Error {
                    peer: Some(peer),
                    reason: format!("incoming connection from {peer}: {e}"),
                });
                return;
            }
        };
        let key = self.alloc();
        let deadline = deadline_after(config.handshake_timeout);
        self.insert(
            key,
            Entry::Incoming {
                stream,
                peer,
                hs,
                listener: id,
                deadline,
            },
        );
        if let Some(l) = self.listeners.get_mut(&id) {
            l.inflight.push_back(key);
            l.shared
                .handshakes
                .store(l.inflight.len(), Ordering::Relaxed);
        }
        self.incoming(key);
    }

    /// Forgets an incoming handshake of its listener's in-progress list.
    fn forget_inflight(&mut self, id: u64, key: usize) {
        if let Some(l) = self.listeners.get_mut(&id) {
            if l.inflight.front() == Some(&key) {
                l.inflight.pop_front();
            } else {
                l.inflight.retain(|&k| k != key);
            }
            l.shared
                .handshakes
                .store(l.inflight.len(), Ordering::Relaxed);
        }
    }

    /// Ends an incoming handshake: closes it and reports `reason`.
    fn end_incoming(&mut self, key: usize, reason: impl FnOnce(SocketAddr) -> String) {
        if let Some(Entry::Incoming {
            stream,
            peer,
            listener,
            ..
        }) = self.take(key)
        {
            let _ = stream.shutdown(Shutdown::Both);
            drop(stream);
            self.forget_inflight(listener, key);
            if let Some(l) = self.listeners.get(&listener) {
                l.shared.event(CmEvent::Error {
                    peer: Some(peer),
                    reason: reason(peer),
                });
            }
        }
    }

    fn incoming(&mut self, key: usize) {
        let Some(Entry::Incoming { stream, hs, .. }) = self.entries.get_mut(&key) else {
            return;
        };
        let step = hs.advance(stream);
        match step {
            Ok(Step::Wait(r)) => {
                let fd = stream.as_raw_fd();
                if let Err(e) = self.arm(fd, key, r) {
                    self.end_incoming(key, |peer| format!("incoming connection from {peer}: {e}"));
                }
            }
            Ok(Step::Done(Outcome::Request(request))) => {
                let Some(Entry::Incoming {
                    stream,
                    peer,
                    hs,
                    listener,
                    ..
                }) = self.take(key)
                else {
                    return;
                };
                self.forget_inflight(listener, key);
                let Some(l) = self.listeners.get(&listener) else {
                    return;
                };
                let shared = &l.shared;
                if shared.requests.len() >= shared.backlog {
                    let _ = stream.shutdown(Shutdown::Both);
                    shared.event(CmEvent::Error {
                        peer: Some(peer),
                        reason: format!(
                            "incoming connection from {peer} closed: backlog of {} requests full",
                            shared.backlog
                        ),
                    });
                    return;
                }
                shared.requests.push(ConnRequest {
                    peer,
                    request,
                    hs,
                    stream,
                    config: shared.config.clone(),
                });
            }
            Ok(Step::Done(_)) => self.end_incoming(key, |peer| {
                format!("incoming connection from {peer}: handshake ended without a Request")
            }),
            Err(e) => {
                self.end_incoming(key, |peer| format!("incoming connection from {peer}: {e}"))
            }
        }
    }

    fn setup(&mut self, key: usize) {
        let Some(Entry::Setup {
            stream,
            connecting,
            peer,
            ..
        }) = self.entries.get_mut(&key)
        else {
            return;
        };
        if connecting.is_some() {
            let failed = match stream.take_error() {
                Ok(None) => stream.peer_addr().err(),
                Ok(Some(e)) | Err(e) => Some(e),
            };
            if let Some(e) = failed {
                if let Some(Entry::Setup {
                    hs,
                    conn: Some(conn),
                    timeout,
                    deadline,
                    connecting: Some(rest),
                    ..
                }) = self.take(key)
                {
                    self.start_connect(key, hs, conn, timeout, deadline, rest, Some(e));
                }
                return;
            }
            *connecting = None;
            if let Ok(p) = stream.peer_addr() {
                *peer = Some(p);
            }
        }
        let Some(Entry::Setup { stream, hs, .. }) = self.entries.get_mut(&key) else {
            return;
        };
        match hs.advance(stream) {
            Ok(Step::Wait(r)) => {
                let fd = stream.as_raw_fd();
                if let Err(e) = self.arm(fd, key, r) {
                    self.fail_setup(key, HandshakeError::Io(e));
                }
            }
            Ok(Step::Done(Outcome::Established(n))) => {
                let Some(Entry::Setup {
                    stream, conn, peer, ..
                }) = self.take(key)
                else {
                    return;
                };
                match (conn, peer) {
                    (Some(conn), Some(peer)) => {
                        if let Err(e) = conn.on_established(stream, n, peer) {
                            conn.on_setup_error(e, Some(peer));
                        }
                    }
                    _ => {
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                }
            }
            Ok(Step::Done(Outcome::RejectSent(_))) => {
                if let Some(Entry::Setup { stream, .. }) = self.take(key) {
                    let _ = stream.shutdown(Shutdown::Write);
                }
            }
            Ok(Step::Done(Outcome::Request(_))) => {
                self.fail_setup(key, softrdma_proto::mpa::MpaNegotiationError::Over.into());
            }
            Err(e) => self.fail_setup(key, e),
        }
    }

    fn fail_setup(&mut self, key: usize, e: HandshakeError) {
        if let Some(Entry::Setup {
            stream, conn, peer, ..
        }) = self.take(key)
        {
            let _ = stream.shutdown(Shutdown::Both);
            if let Some(conn) = conn {
                conn.on_failure(e, peer);
            }
        }
    }

    fn expired(&mut self, key: usize) {
        match self.entries.get(&key) {
            None => {}
            Some(Entry::Listener(id)) => {
                let id = *id;
                self.accept(id);
            }
            Some(Entry::Incoming { hs, listener, .. }) => {
                let after = self
                    .listeners
                    .get(listener)
                    .map_or(Duration::ZERO, |l| l.shared.config.handshake_timeout);
                let e = hs.timed_out(after);
                self.end_incoming(key, |peer| {
                    format!("incoming connection from {peer} timed out: {e}")
                });
            }
            Some(Entry::Setup {
                hs,
                timeout,
                connecting,
                peer,
                ..
            }) => {
                if connecting.is_some() {
                    let e = CmError::Unreachable(super::tcp_timeout(*peer, *timeout));
                    if let Some(Entry::Setup {
                        stream,
                        conn: Some(conn),
                        ..
                    }) = self.take(key)
                    {
                        drop(stream);
                        conn.on_setup_error(e, None);
                    }
                } else {
                    let e = hs.timed_out(*timeout);
                    self.fail_setup(key, e);
                }
            }
        }
    }
}

/// Starts a non-blocking TCP connect.
fn start_tcp(addr: SocketAddr) -> io::Result<TcpStream> {
    let s = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    s.set_nonblocking(true)?;
    match s.connect(&addr.into()) {
        Ok(()) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
        Err(e) => return Err(e),
    }
    let stream = TcpStream::from(s);
    stream.set_nodelay(true)?;
    Ok(stream)
}
