//! The table of offloaded connections (application descriptor →
//! connection), the switch of a connected kernel socket into sockets direct,
//! and the blocking rules of the data calls.
//!
//! The application's descriptor stays the kernel TCP socket; the switched
//! connection (a `softrdma_sockets::TcpStream`) uses a duplicate of it. The
//! kernel socket stays non-blocking underneath (the engine needs it); the
//! application's view of `O_NONBLOCK` is kept here, as is its view of
//! `FD_CLOEXEC`: an offloaded descriptor is always close-on-exec in the
//! kernel, so a program started with `exec` never reads the RDMA framing as
//! its data (see the crate docs).

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::FromRawFd;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};

use libc::c_int;
use softrdma_sockets::{Config, Known, TcpStream as SdStream};

use crate::interpose::{REAL_FCNTL, state};
use crate::scoped::as_internal;
pub(crate) use crate::scoped::{internal, signals_blocked};
use crate::stats::PlainReason;

/// One connection switched (or about to be switched) into sockets direct;
/// shared by every descriptor of it (`dup`).
#[derive(Debug)]
pub(crate) struct Conn {
    /// The switched stream, or the errno every call reports.
    sw: OnceLock<Result<SdStream, c_int>>,
    /// Until the first call that needs the stream: the switch to make
    /// (server) or to finish (client), with the application's
    /// `TCP_NODELAY` if it set it meanwhile (see [`Conn::nodelay_set`]).
    pending: Mutex<Option<PendingSwitch>>,
    /// A client's switch begun in `connect`: [`BEGUN`] until the first use
    /// takes it, [`FINISHING`] while a thread finishes it, then [`DONE`]
    /// ([`NOT_BEGUN`] for any other connection). Kept apart from the
    /// switch's lock, which other threads also hold a moment (a look at
    /// whether the Reply is in, a `TCP_NODELAY` kept): a held lock does not
    /// tell a finish in progress.
    stage: AtomicU8,
    /// Set while a thread makes or finishes the switch in
    /// [`stream`](Conn::stream) (either side; a server's switch takes up
    /// to the switch's time limit too), cleared by [`SwitchGuard`].
    switching: AtomicBool,
    /// The application's `TCP_NODELAY` for a switch not made yet (0: not
    /// known, 1: off, 2: on): answered without the switch's lock.
    app_nodelay: AtomicU8,
    /// The process that switched it (0 while pending). Another process (a
    /// forked child) has the memory but not the engine threads behind it.
    owner: AtomicI32,
    /// The application's view of `O_NONBLOCK` (shared, as by the kernel's
    /// open file description).
    pub(crate) nonblock: AtomicBool,
    /// `SO_RCVTIMEO` / `SO_SNDTIMEO` in microseconds (0: none).
    pub(crate) rcvtimeo: AtomicU64,
    pub(crate) sndtimeo: AtomicU64,
    rfd: AtomicI32,
    /// A reset was reported once: later writes fail with `EPIPE` (and
    /// `SIGPIPE`), as the kernel's do after `ECONNRESET`.
    pub(crate) reset_seen: AtomicBool,
    /// The stream is corked for a send with `MSG_MORE` (not by the
    /// application's `TCP_CORK`): the next send without it uncorks.
    pub(crate) more: AtomicBool,
    /// The stream is corked by the library to hold a small send for the
    /// next one of its burst (see `autocork`).
    pub(crate) auto: AtomicBool,
    /// Holds started so far (the flusher ends only the one it was told of).
    auto_gen: AtomicU64,
    /// Sends in the last finished burst and in the open one (see
    /// `autocork`).
    pub(crate) burst_last: AtomicU32,
    pub(crate) burst_cur: AtomicU32,
    /// Times a write found no room (would block): an edge-triggered epoll
    /// registration reports the connection writable again (see `emu`).
    pub(crate) write_blocked: AtomicU64,
}

/// How long a close before the connection's first use waits for the
/// server's MPA Reply, to finish the switch and close in order (a server
/// that uses its end at once answers within it; otherwise the switch is
/// aborted and the server's end reset).
const CLOSE_REPLY_WAIT: Duration = Duration::from_millis(50);

/// The step of a client's wait for the Reply of a listener of its own
/// process, between looks for the accepted end to switch (ms).
const OWN_STEP_MS: c_int = 20;

/// How many times [`Conn::stream_now`] yields between tries of a switch's
/// lock held a moment by another thread before it reports it busy (it
/// tries once more than that: `BRIEF_TRIES + 1` tries in all).
const BRIEF_TRIES: u32 = 8;

/// [`Conn::stage`]: not a client's switch begun in `connect`.
const NOT_BEGUN: u8 = 0;
/// [`Conn::stage`]: begun, to be finished on first use.
const BEGUN: u8 = 1;
/// [`Conn::stage`]: a thread is finishing it.
const FINISHING: u8 = 2;
/// [`Conn::stage`]: finished (switched, or plain in its place).
const DONE: u8 = 3;

/// Held while [`Conn::stream`] makes or finishes a switch: on the way
/// out (a panic too) a connection the switch left unset fails with `EIO`,
/// a client's switch is marked done, and the switch is no longer in
/// progress ([`Conn::finishing`]).
struct SwitchGuard<'a>(&'a Conn);

impl Drop for SwitchGuard<'_> {
    fn drop(&mut self) {
        if self.0.sw.get().is_none() {
            let _ = self.0.sw.set(Err(libc::EIO));
        }
        if self.0.stage.load(Ordering::Acquire) == FINISHING {
            self.0.stage.store(DONE, Ordering::Release);
        }
        self.0.switching.store(false, Ordering::Release);
    }
}

/// A switch not made yet, and the application's `TCP_NODELAY` if it set
/// it meanwhile.
type PendingSwitch = (Pending, Option<bool>);

/// A switch not made yet.
#[derive(Debug)]
enum Pending {
    /// Server side: the duplicate descriptor to switch (as responder). The
    /// switch is made by whichever process touches the connection first,
    /// so a server that forks after accept serves it from the child.
    Accepted(std::net::TcpStream, Known),
    /// Client side: the switch begun in `connect` (the MPA Request is
    /// sent), finished by this process (the owner) on first use.
    Connected(Box<Begun>),
}

/// A client's switch begun in `connect`, and what a plain connection in
/// its place needs if it fails.
#[derive(Debug)]
struct Begun {
    up: softrdma_sockets::Upgrade,
    /// The begun socket's identity (`st_dev`, `st_ino`): a failed switch
    /// puts a plain connection only on the connection's descriptors that
    /// still are this socket (the application may have closed the number
    /// `connect` was called with, after a `dup`, and reused it).
    ino: (u64, u64),
    addr: libc::sockaddr_storage,
    len: libc::socklen_t,
    /// This end's address and the peer's, when the peer is a listener of
    /// this process (see [`switch_own_server`]).
    own: Option<(SocketAddr, SocketAddr)>,
}

/// Connections of this process whose client gave up its switch before
/// this process accepted them: `accept` on their listener closes them and
/// takes the next (the client made a plain one in their place).
static ABANDONED: Mutex<Vec<Abandoned>> = Mutex::new(Vec::new());
/// Entries in [`ABANDONED`] (an `accept` looks only when it is not 0).
static ABANDONED_COUNT: AtomicUsize = AtomicUsize::new(0);
/// How long an entry of [`ABANDONED`] is kept: the connection is already
/// in its listener's queue, so its accept comes soon or never.
const ABANDONED_FOR: Duration = Duration::from_secs(10);

/// A connection in [`ABANDONED`].
struct Abandoned {
    /// The client's address (the peer its accept returns).
    peer: SocketAddr,
    /// The listener's twin (see [`twin_id`]): only an accept on a
    /// listener of that twin skips it.
    twin: usize,
    /// When it was given up.
    at: Instant,
}

/// A twin's identity in [`ABANDONED`]; its entries are forgotten
/// ([`forget_abandoned`]) when its last listener goes, before the address
/// can be another twin's.
pub(crate) fn twin_id(t: &Arc<crate::twin::Twin>) -> usize {
    Arc::as_ptr(t) as usize
}

/// Drops the expired entries of `a` and publishes its length.
fn abandoned_expire(a: &mut Vec<Abandoned>) {
    let now = Instant::now();
    a.retain(|e| now.duration_since(e.at) < ABANDONED_FOR);
    ABANDONED_COUNT.store(a.len(), Ordering::Release);
}

/// Whether any connection is in [`ABANDONED`] (one load).
pub(crate) fn abandoned_any() -> bool {
    ABANDONED_COUNT.load(Ordering::Acquire) != 0
}

/// Whether the connection from `peer` accepted on a listener of twin
/// `twin` ([`twin_id`]) is one its client (this process) gave up before
/// it was accepted; it is forgotten then (the caller closes it).
pub(crate) fn take_abandoned(peer: SocketAddr, twin: usize) -> bool {
    if ABANDONED_COUNT.load(Ordering::Acquire) == 0 {
        return false;
    }
    let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
    abandoned_expire(&mut a);
    let Some(i) = a.iter().position(|e| e.peer == peer && e.twin == twin) else {
        return false;
    };
    a.swap_remove(i);
    ABANDONED_COUNT.store(a.len(), Ordering::Release);
    true
}

/// Forgets the entries of twin `twin` ([`twin_id`]): its last listener
/// is closed, their connections are never accepted.
pub(crate) fn forget_abandoned(twin: usize) {
    if ABANDONED_COUNT.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
    a.retain(|e| e.twin != twin);
    abandoned_expire(&mut a);
}

/// Client side, the peer a listener of this process (`own`: this end's
/// address, the listener's): switches the accepted end of this very
/// connection if this process has accepted it and no thread switches it
/// yet. Its switch reads our MPA Request and answers it; a program that
/// connects to itself and uses both ends from one thread has no other
/// thread to do it. Whether one was switched (or failed to).
fn switch_own_server(own: (SocketAddr, SocketAddr)) -> bool {
    let found = {
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        t.values()
            .map(|s| &s.conn)
            .find(|c| {
                let Some(p) = c.try_pending() else {
                    return false;
                };
                matches!(
                    p.as_ref(),
                    Some((Pending::Accepted(d, k), _))
                        if k.peer == Some(own.0)
                            && d.local_addr().is_ok_and(|a| a.port() == own.1.port())
                )
            })
            .cloned()
    };
    match found {
        Some(c) => {
            let _ = c.stream();
            true
        }
        None => false,
    }
}

/// A descriptor's entry: its connection and its own `FD_CLOEXEC` view.
#[derive(Debug, Clone)]
pub(crate) struct Slot {
    pub(crate) conn: Arc<Conn>,
    pub(crate) cloexec: bool,
}

/// Hashes a descriptor with one multiplication (Fibonacci hashing): the
/// table is looked up on every data call of an offloaded descriptor, and
/// descriptors are small integers chosen by the kernel, not by a peer.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct FdHasher(u64);

impl std::hash::Hasher for FdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_i32(&mut self, fd: i32) {
        self.0 = u64::from(fd as u32).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub(crate) type FdMap<V> = HashMap<c_int, V, std::hash::BuildHasherDefault<FdHasher>>;

static TABLE: LazyLock<RwLock<FdMap<Slot>>> = LazyLock::new(RwLock::default);
static COUNT: AtomicUsize = AtomicUsize::new(0);

/// Descriptors below this have a membership bit: a call on a descriptor
/// that is not offloaded (the engine's own sockets and wake-up descriptors
/// in its `ppoll`, pipes, files) is answered by one atomic load, without
/// the table's lock, hashing or a reference count.
const BITMAP_FDS: usize = 65536;
/// Bit `fd` set: `fd` may be in [`TABLE`] (set and cleared under its
/// write lock, after the insert and after the removal).
static MEMBER: [AtomicU64; BITMAP_FDS / 64] = [const { AtomicU64::new(0) }; BITMAP_FDS / 64];

/// Whether `fd` may be in the table (false: it is not, no lock needed).
fn maybe_member(fd: c_int) -> bool {
    match usize::try_from(fd) {
        Ok(i) if i < BITMAP_FDS => MEMBER[i / 64].load(Ordering::Acquire) & (1 << (i % 64)) != 0,
        Ok(_) => true,
        Err(_) => false,
    }
}

/// Sets or clears the membership bit of `fd` (caller holds the write lock).
fn set_member(fd: c_int, on: bool) {
    if let Ok(i) = usize::try_from(fd)
        && i < BITMAP_FDS
    {
        let bit = 1u64 << (i % 64);
        if on {
            MEMBER[i / 64].fetch_or(bit, Ordering::Release);
        } else {
            MEMBER[i / 64].fetch_and(!bit, Ordering::Release);
        }
    }
}
/// The process whose engine was started (0: none yet). A forked child has
/// a started engine's memory without its threads: it cannot switch.
pub(crate) static ENGINE_PID: AtomicI32 = AtomicI32::new(0);

/// This process's id, cached (getpid is a system call, and the data calls
/// ask on every call); a forked child sets its own. It is set before
/// anything a `vfork` child must not touch exists (see [`in_vfork_child`]).
static MY_PID: AtomicI32 = AtomicI32::new(0);

extern "C" fn clear_pid() {
    // SAFETY: getpid has no preconditions (and is async-signal-safe).
    MY_PID.store(unsafe { libc::getpid() }, Ordering::Relaxed);
}

pub(crate) fn pid() -> i32 {
    let p = MY_PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registering a plain `extern "C" fn()` that stores to an
        // atomic, run in the child after fork.
        unsafe { libc::pthread_atfork(None, None, Some(clear_pid)) };
    });
    // SAFETY: getpid has no preconditions.
    let p = unsafe { libc::getpid() };
    MY_PID.store(p, Ordering::Relaxed);
    p
}

/// Whether this is the child of a `vfork` (Python's subprocess uses it):
/// it shares the parent's memory until it calls exec, so it must leave the
/// table alone (a close there would end the parent's connection).
pub(crate) fn in_vfork_child() -> bool {
    let cached = MY_PID.load(Ordering::Relaxed);
    // SAFETY: getpid has no preconditions.
    cached != 0 && cached != unsafe { libc::getpid() }
}

/// The connection behind `fd`, if it is offloaded (cheap when none is).
pub(crate) fn lookup(fd: c_int) -> Option<Arc<Conn>> {
    if COUNT.load(Ordering::Relaxed) != 0 {
        // Any call but a send on it ends the thread's burst of sends.
        crate::autocork::end_burst();
    }
    lookup_for_send(fd)
}

/// [`lookup`] for a send: the burst of sends goes on if `fd` is the
/// thread's last connection (see `autocork::before_send`); a send on
/// another descriptor ends it.
pub(crate) fn lookup_for_send(fd: c_int) -> Option<Arc<Conn>> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    if !maybe_member(fd) {
        crate::autocork::end_burst();
        return None;
    }
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    let c = t.get(&fd).map(|s| s.conn.clone());
    drop(t);
    if c.is_none() {
        crate::autocork::end_burst();
    }
    c
}

/// The slot of `fd`.
pub(crate) fn slot(fd: c_int) -> Option<Slot> {
    if COUNT.load(Ordering::Relaxed) != 0 {
        crate::autocork::end_burst();
    }
    if COUNT.load(Ordering::Relaxed) == 0 || !maybe_member(fd) {
        return None;
    }
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.get(&fd).cloned()
}

/// The offloaded descriptors in `first..=last`.
pub(crate) fn fds_in(first: c_int, last: c_int) -> Vec<c_int> {
    if !any() {
        return Vec::new();
    }
    let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
    t.keys()
        .copied()
        .filter(|&f| f >= first && f <= last)
        .collect()
}

/// Whether any descriptor is offloaded.
pub(crate) fn any() -> bool {
    COUNT.load(Ordering::Relaxed) != 0
}

/// Records `fd` as a descriptor of `conn`; the kernel descriptor is made
/// close-on-exec (the application's view is `cloexec`, which every caller
/// takes from the kernel's flag: when it is set, there is nothing to do).
pub(crate) fn insert(fd: c_int, conn: Arc<Conn>, cloexec: bool) {
    pid();
    if !cloexec && let Some(f) = REAL_FCNTL.get() {
        // SAFETY: F_SETFD with an int argument on a descriptor we were given.
        unsafe { f(fd, libc::F_SETFD, libc::FD_CLOEXEC as usize) };
    }
    let old = {
        let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
        let old = t.insert(fd, Slot { conn, cloexec });
        set_member(fd, true);
        COUNT.store(t.len(), Ordering::Relaxed);
        old
    };
    if let Some(s) = old {
        release(s.conn);
    }
}

/// Sets the application's `FD_CLOEXEC` view of `fd`.
pub(crate) fn set_cloexec(fd: c_int, on: bool) {
    if in_vfork_child() {
        return;
    }
    let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
    if let Some(s) = t.get_mut(&fd) {
        s.cloexec = on;
    }
}

/// Forgets `fd` (closed, or replaced by `dup2`); the connection ends with
/// its last descriptor.
pub(crate) fn remove(fd: c_int) {
    if lookup(fd).is_none() {
        return;
    }
    let old = {
        let mut t = TABLE.write().unwrap_or_else(|e| e.into_inner());
        let old = t.remove(&fd);
        set_member(fd, false);
        COUNT.store(t.len(), Ordering::Relaxed);
        old
    };
    if let Some(s) = old {
        release(s.conn);
    }
}

/// Drops a reference: in a forked child the memory of a connection the
/// parent switched is never torn down (that would run the parent's
/// protocol on a socket the parent still uses); it is left as it is.
pub(crate) fn release(c: Arc<Conn>) {
    let owner = c.owner.load(Ordering::Relaxed);
    if owner != 0 && owner != pid() {
        std::mem::forget(c);
    } else if Arc::strong_count(&c) == 1 {
        // The last reference: the close may start an engine thread (a
        // close timer), which must not inherit the application's mask.
        signals_blocked(|| {
            // A client's switch whose server Reply is in, or comes within
            // a moment (a server that uses its end at once), is finished
            // (and counted), so that the close is the orderly one of an
            // offloaded connection; one still waiting then is aborted (the
            // server's end is reset).
            if c.unfinished() && c.reply_within(CLOSE_REPLY_WAIT) {
                let _ = c.stream();
            }
            drop(c)
        });
    } else {
        drop(c);
    }
}

/// Lowest number for the library's own descriptors: they stay out of the
/// range programs size their tables by (wrk sizes its event loop for 3
/// descriptors per connection) and below `FD_SETSIZE` where the limit
/// allows (select).
pub(crate) fn high_base() -> c_int {
    static BASE: OnceLock<c_int> = OnceLock::new();
    *BASE.get_or_init(|| {
        // SAFETY: rlimit is plain data; getrlimit writes it.
        let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
        // SAFETY: valid resource and pointer.
        let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut rl) } == 0 {
            rl.rlim_cur.min(1 << 20) as c_int
        } else {
            1024
        };
        (soft / 2).min(512)
    })
}

/// Moves `fd`, made by this library while setting up a connection, to a
/// high number (close-on-exec); unchanged outside of that or if none is
/// free.
pub(crate) fn move_high(fd: c_int) -> c_int {
    if fd < 0 || fd >= high_base() || !internal() {
        return fd;
    }
    let (Some(fcntl), Some(close)) = (REAL_FCNTL.get(), crate::real::REAL_CLOSE.get()) else {
        return fd;
    };
    // SAFETY: duplicating a descriptor this library just made.
    let h = unsafe { fcntl(fd, libc::F_DUPFD_CLOEXEC, high_base() as usize) };
    if h < 0 {
        return fd;
    }
    // SAFETY: the original is ours and replaced by `h`.
    unsafe { close(fd) };
    h
}

fn config() -> Config {
    crate::policy::stream_config()
}

/// Why a switch could not be made (the connection is unusable: bytes of
/// the switch may already be on it). `known`: the peer's address and
/// whether the socket is non-blocking, if known; `nodelay`: the
/// application's `TCP_NODELAY`, if known (else it is asked here: the
/// application's setting, kept for its view).
fn switch(
    dup: std::net::TcpStream,
    initiator: bool,
    known: Known,
    nodelay: Option<bool>,
) -> Result<SdStream, c_int> {
    let me = pid();
    let started = ENGINE_PID.load(Ordering::Relaxed);
    if started != 0 && started != me {
        return Err(libc::ECONNRESET);
    }
    ENGINE_PID.store(me, Ordering::Relaxed);
    let nodelay = nodelay.unwrap_or_else(|| dup.nodelay().unwrap_or(false));
    let known = Known { nodelay, ..known };
    let s = signals_blocked(|| {
        as_internal(|| SdStream::upgrade_known(dup, initiator, &config(), &known))
    })
    .map_err(|_| libc::ECONNRESET)?;
    let _ = s.set_nonblocking(true);
    if nodelay {
        let _ = s.set_nodelay(true);
    }
    Ok(s)
}

/// A duplicate of the application's descriptor (close-on-exec), as a
/// std stream the switch can own.
pub(crate) fn dup_stream(fd: c_int) -> Option<std::net::TcpStream> {
    let f = REAL_FCNTL.get()?;
    // SAFETY: F_DUPFD_CLOEXEC on the caller's descriptor.
    let mut d = unsafe { f(fd, libc::F_DUPFD_CLOEXEC, high_base() as usize) };
    if d < 0 {
        // SAFETY: as above, any number.
        d = unsafe { f(fd, libc::F_DUPFD_CLOEXEC, 0) };
    }
    if d < 0 {
        return None;
    }
    // SAFETY: `d` is a fresh descriptor owned by nobody else.
    Some(unsafe { std::net::TcpStream::from_raw_fd(d) })
}

/// The identity (`st_dev`, `st_ino`) of what `fd` refers to.
fn inode(fd: c_int) -> Option<(u64, u64)> {
    // SAFETY: stat is plain data.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat writes the caller's descriptor's stat into `st`.
    if unsafe { libc::fstat(fd, &raw mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)]
    Some((st.st_dev as u64, st.st_ino as u64))
}

impl Conn {
    fn new(nonblock: bool) -> Conn {
        Conn {
            sw: OnceLock::new(),
            pending: Mutex::new(None),
            stage: AtomicU8::new(NOT_BEGUN),
            switching: AtomicBool::new(false),
            app_nodelay: AtomicU8::new(0),
            owner: AtomicI32::new(0),
            nonblock: AtomicBool::new(nonblock),
            rcvtimeo: AtomicU64::new(0),
            sndtimeo: AtomicU64::new(0),
            rfd: AtomicI32::new(-1),
            reset_seen: AtomicBool::new(false),
            more: AtomicBool::new(false),
            auto: AtomicBool::new(false),
            auto_gen: AtomicU64::new(0),
            burst_last: AtomicU32::new(0),
            burst_cur: AtomicU32::new(0),
            write_blocked: AtomicU64::new(0),
        }
    }

    /// Client side: begins the switch of `fd` (it is connected;
    /// `nonblock`: the application's `O_NONBLOCK`, the socket's as well;
    /// `peer`: the address it connected to, `addr`/`len` as the
    /// application gave it): the MPA Request with the SDP Hello is sent,
    /// and the first call that needs the stream finishes the switch (see
    /// [`Conn::stream`]). `Err` if it could not begin (the connection is
    /// then unusable).
    ///
    /// # Safety
    /// `addr` points to `len` readable bytes.
    pub(crate) unsafe fn connect_begin(
        fd: c_int,
        nonblock: bool,
        peer: Option<SocketAddr>,
        addr: *const libc::sockaddr,
        len: libc::socklen_t,
    ) -> Result<Arc<Conn>, c_int> {
        let me = pid();
        let started = ENGINE_PID.load(Ordering::Relaxed);
        if started != 0 && started != me {
            return Err(libc::ECONNRESET);
        }
        ENGINE_PID.store(me, Ordering::Relaxed);
        // SAFETY: sockaddr_storage is plain data.
        let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let n = (len as usize).min(size_of::<libc::sockaddr_storage>());
        // SAFETY: the caller's `len` readable bytes, at most the storage's.
        unsafe {
            std::ptr::copy_nonoverlapping(addr.cast::<u8>(), (&raw mut storage).cast::<u8>(), n)
        };
        let dup = dup_stream(fd).ok_or(libc::EMFILE)?;
        let ino = inode(fd).ok_or(libc::EBADF)?;
        // A listener of this process: its accepted end may have to be
        // switched from here (see `switch_own_server`). Only a peer on
        // this host can be one: loopback, or this end's own address (a
        // listener on 0.0.0.0:P does not make every host's port P ours).
        let own = peer.and_then(|p| {
            let me = dup.local_addr().ok()?;
            let local = p.ip().is_loopback() || p.ip() == me.ip();
            (local && crate::interpose::sibling_twin(p.ip(), p.port()).is_some()).then_some((me, p))
        });
        let nodelay = dup.nodelay().unwrap_or(false);
        let known = Known {
            peer,
            nonblocking: nonblock,
            nodelay,
        };
        let up = signals_blocked(|| {
            as_internal(|| SdStream::begin_upgrade_known(dup, true, &config(), &known))
        })
        .map_err(|_| libc::ECONNRESET)?;
        let c = Conn::new(nonblock);
        // This process finishes it: a forked child never reads the
        // parent's MPA Reply.
        c.owner.store(me, Ordering::Relaxed);
        let b = Begun {
            up,
            ino,
            addr: storage,
            len: n as libc::socklen_t,
            own,
        };
        *c.pending.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Pending::Connected(Box::new(b)), Some(nodelay)));
        c.app_nodelay
            .store(1 + u8::from(nodelay), Ordering::Relaxed);
        c.stage.store(BEGUN, Ordering::Release);
        Ok(Arc::new(c))
    }

    /// The stream if it can be had without waiting: `Ok(Err(Some(fd)))`
    /// while the client's switch begun in `connect` waits for the server's
    /// MPA Reply (with the descriptor to wait on for it), `Ok(Err(None))`
    /// while another thread holds the switch's lock after a few tries
    /// (look again shortly; [`finishing`](Self::finishing) tells a switch
    /// in progress, either side's, from a brief hold); a switch whose Reply is in is
    /// finished here, as is one that failed (the plain connection in its
    /// place). Anything else as [`stream`](Self::stream).
    pub(crate) fn stream_now(&self) -> Result<Result<&SdStream, Option<c_int>>, c_int> {
        let owner = self.owner.load(Ordering::Relaxed);
        if self.sw.get().is_none() && (owner == 0 || owner == pid()) {
            let Some(mut pending) = self.try_pending_briefly() else {
                if self.sw.get().is_some() {
                    return self.stream().map(Ok);
                }
                return Ok(Err(None));
            };
            if let Some((Pending::Connected(b), _)) = pending.as_mut() {
                // Done, or failed: finished below without a wait (a
                // failure's plain connection is made there).
                // A peer of this process whose accepted end waits for its
                // first use: switched here, its Reply is then in.
                if let Ok(false) = b.up.poll()
                    && (!b.own.is_some_and(switch_own_server) || matches!(b.up.poll(), Ok(false)))
                {
                    return Ok(Err(Some(b.up.wait_on().map_or(-1, |(fd, _)| fd))));
                }
            }
        }
        self.stream().map(Ok)
    }

    /// Whether a client's switch begun in `connect` has the server's Reply
    /// (it finishes without a wait), waiting for it up to `limit`; false if
    /// it still waits then, or failed.
    fn reply_within(&self, limit: Duration) -> bool {
        let end = Instant::now() + limit;
        loop {
            let (fd, write) = {
                let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
                match pending.as_mut() {
                    Some((Pending::Connected(b), _)) => match b.up.poll() {
                        Ok(true) => return true,
                        Err(_) => return false,
                        Ok(false) => match b.up.wait_on() {
                            Some(w) => w,
                            None => return false,
                        },
                    },
                    _ => return false,
                }
            };
            let left = end.saturating_duration_since(Instant::now());
            let Some(poll) = crate::interpose::REAL_POLL.get() else {
                return false;
            };
            if left.is_zero() {
                return false;
            }
            let mut p = libc::pollfd {
                fd,
                events: if write { libc::POLLOUT } else { libc::POLLIN },
                revents: 0,
            };
            let ms = c_int::try_from(left.as_millis().max(1)).unwrap_or(c_int::MAX);
            // SAFETY: one pollfd of ours; the switch's own descriptor.
            unsafe { poll(&raw mut p, 1, ms) };
        }
    }

    /// Whether this is a client's connection whose switch, begun in
    /// `connect`, is still to be finished by this process (false while a
    /// thread finishes it: the calls of the finish itself, a plain
    /// reconnect's, go to the kernel).
    pub(crate) fn unfinished(&self) -> bool {
        self.stage.load(Ordering::Acquire) == BEGUN
            && self.sw.get().is_none()
            && self.owner.load(Ordering::Relaxed) == pid()
    }

    /// Whether this is a client's connection whose switch, begun in
    /// `connect`, is not finished yet (begun, or a thread finishing it):
    /// the application's `TCP_NODELAY` is [`pending_nodelay`](Self::pending_nodelay),
    /// not the kernel socket's.
    pub(crate) fn begun(&self) -> bool {
        matches!(self.stage.load(Ordering::Acquire), BEGUN | FINISHING)
            && self.sw.get().is_none()
            && self.owner.load(Ordering::Relaxed) == pid()
    }

    /// Whether a thread is making a switch or finishing a client's switch
    /// begun in `connect` (it holds the switch's lock until the switch is
    /// made, the server's Reply is in, or the switch's time limit), not
    /// only holding the lock a moment.
    pub(crate) fn finishing(&self) -> bool {
        self.switching.load(Ordering::Acquire)
    }

    /// The pending switch's lock, tried a few times with a yield between
    /// while it is only held a moment (a look at the Reply, a
    /// `TCP_NODELAY` kept), not by a finish in progress.
    fn try_pending_briefly(&self) -> Option<std::sync::MutexGuard<'_, Option<PendingSwitch>>> {
        for _ in 0..BRIEF_TRIES {
            if let Some(g) = self.try_pending() {
                return Some(g);
            }
            if self.finishing() {
                return None;
            }
            std::thread::yield_now();
        }
        self.try_pending()
    }

    /// The pending switch's lock if no thread holds it.
    fn try_pending(&self) -> Option<std::sync::MutexGuard<'_, Option<PendingSwitch>>> {
        match self.pending.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// Server side: `fd` will be switched on first use; `nonblock`: its
    /// `O_NONBLOCK` as accepted; `peer`: the client's address, if known.
    /// (The socket stays non-blocking once it is: the application's
    /// `F_SETFL` keeps `O_NONBLOCK` on, `FIONBIO` only changes its view.)
    pub(crate) fn accepted(
        fd: c_int,
        nonblock: bool,
        peer: Option<SocketAddr>,
    ) -> Option<Arc<Conn>> {
        let dup = dup_stream(fd)?;
        let c = Conn::new(nonblock);
        let known = Known {
            peer,
            nonblocking: nonblock,
            ..Known::default()
        };
        *c.pending.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((Pending::Accepted(dup, known), None));
        Some(Arc::new(c))
    }

    /// The application set `TCP_NODELAY` to `on` on the socket (the kernel
    /// took it): a pending switch takes that as the application's setting
    /// instead of asking the kernel (a server commonly sets it right after
    /// the accept, and that call is the one that switches: a `getsockopt`
    /// less per connection).
    pub(crate) fn nodelay_set(&self, on: bool) {
        if self.sw.get().is_some() {
            return;
        }
        if let Some(p) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            p.1 = Some(on);
        }
        self.app_nodelay.store(1 + u8::from(on), Ordering::Relaxed);
    }

    /// The application's `TCP_NODELAY` as a switch not made yet keeps it.
    pub(crate) fn pending_nodelay(&self) -> Option<bool> {
        match self.app_nodelay.load(Ordering::Relaxed) {
            0 => None,
            v => Some(v == 2),
        }
    }

    fn adopt(&self, s: SdStream) {
        self.owner.store(pid(), Ordering::Relaxed);
        if !crate::interpose::engine_wait() {
            let rfd = as_internal(|| s.readiness_fd()).unwrap_or(-1);
            self.rfd.store(rfd, Ordering::Relaxed);
        }
        let _ = self.sw.set(Ok(s));
    }

    /// The switched stream (switching a pending one now), or the errno of
    /// a connection that cannot be used in this process.
    pub(crate) fn stream(&self) -> Result<&SdStream, c_int> {
        let owner = self.owner.load(Ordering::Relaxed);
        if owner != 0 && owner != pid() {
            // A forked child: the parent's connection (switched, or its
            // switch begun), not ours to use.
            return Err(libc::EIO);
        }
        if self.sw.get().is_none() {
            // Held during the switch: other threads' calls wait for it.
            let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
            if pending.is_some() {
                self.switching.store(true, Ordering::Release);
            }
            // A panic in the switch leaves the connection failed (`EIO`)
            // and its stage done, not switching for good (`EAGAIN`); the
            // switch is no longer in progress.
            let _unwind = SwitchGuard(self);
            match pending.take() {
                Some((Pending::Accepted(dup, known), nodelay)) => {
                    let r = switch(dup, false, known, nodelay);
                    match &r {
                        Ok(_) => state().stats.offloaded(),
                        Err(_) => state().stats.plain(PlainReason::SetupFailed),
                    }
                    match r {
                        Ok(s) => self.adopt(s),
                        Err(e) => {
                            let _ = self.sw.set(Err(e));
                        }
                    }
                }
                Some((Pending::Connected(b), nodelay)) => {
                    self.stage.store(FINISHING, Ordering::Release);
                    self.finish_connect(*b, nodelay);
                }
                None => {}
            }
        }
        match self.sw.get() {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(*e),
            // Another thread is switching it.
            None => Err(libc::EAGAIN),
        }
    }

    /// Client side: finishes the switch begun in `connect` (waits for the
    /// server's MPA Reply, at most the switch's time limit counted from
    /// the connect); if it fails, a new plain connection to the same
    /// address takes the application's descriptor number before any
    /// application byte (the server keeps it plain: it asks no twin), and
    /// the connection's calls go to it.
    fn finish_connect(&self, b: Begun, nodelay: Option<bool>) {
        let Begun {
            mut up,
            ino,
            addr,
            len,
            own,
        } = b;
        if let Some(own) = own {
            // The server is this process: its accepted end may be waiting
            // for its first use in this very thread. Wait for the Reply in
            // short steps, switching that end once it is accepted.
            while let Ok(false) = up.poll() {
                if switch_own_server(own) {
                    continue;
                }
                let Some((fd, write)) = up.wait_on() else {
                    break;
                };
                let Some(poll) = crate::interpose::REAL_POLL.get() else {
                    break;
                };
                let mut p = libc::pollfd {
                    fd,
                    events: if write { libc::POLLOUT } else { libc::POLLIN },
                    revents: 0,
                };
                // SAFETY: one pollfd of ours; the switch's own descriptor.
                unsafe { poll(&raw mut p, 1, OWN_STEP_MS) };
            }
        }
        let r = signals_blocked(|| as_internal(|| up.finish()));
        match r {
            Ok(s) => {
                let _ = s.set_nonblocking(true);
                if nodelay == Some(true) {
                    let _ = s.set_nodelay(true);
                }
                state().stats.offloaded();
                self.adopt(s);
            }
            Err(_) => {
                // Counted as a failed set-up whether or not a plain
                // connection takes its place (none if the application
                // closed it meanwhile): the connection the application
                // made stayed TCP.
                state().stats.plain(PlainReason::SetupFailed);
                if let Some((me, l)) = own
                    && let Some(t) = crate::interpose::sibling_twin(l.ip(), l.port())
                {
                    // The entry is pushed before the record is taken: an
                    // accept of this connection sees the record (and
                    // switches it) or, once the record is gone, the entry
                    // (and skips it); never neither, which would hand the
                    // application our MPA Request as data. Not accepted
                    // yet (the record was still there): its accept skips
                    // it, the plain connection made below comes next.
                    // Accepted already: the entry is withdrawn.
                    let twin = twin_id(&t);
                    {
                        let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
                        abandoned_expire(&mut a);
                        a.push(Abandoned {
                            peer: me,
                            twin,
                            at: Instant::now(),
                        });
                        ABANDONED_COUNT.store(a.len(), Ordering::Release);
                    }
                    if !t.take(me) {
                        let mut a = ABANDONED.lock().unwrap_or_else(|e| e.into_inner());
                        if let Some(i) = a.iter().rposition(|e| e.peer == me && e.twin == twin) {
                            a.swap_remove(i);
                        }
                        ABANDONED_COUNT.store(a.len(), Ordering::Release);
                    }
                }
                if !self.has_begun_socket(ino) {
                    // Closed meanwhile (the last close finishes the
                    // switch): no plain connection to open for it.
                    let _ = self.sw.set(Err(libc::ECONNRESET));
                    return;
                }
                let nb = self.nonblock.load(Ordering::Relaxed);
                // SAFETY: the address as the application gave it, copied.
                let ns = unsafe {
                    crate::interpose::plain_socket(
                        (&raw const addr).cast(),
                        len,
                        nb,
                        nodelay == Some(true),
                    )
                };
                let plain = ns.and_then(|ns| {
                    let placed = self.place_plain(Some(ns), ino);
                    // The stream's own duplicate of the new connection.
                    let d = placed.then(|| dup_stream(ns)).flatten();
                    if placed && d.is_none() {
                        // The descriptors have it, the calls report a
                        // reset: no live connection behind them.
                        if let Some(shutdown) = crate::interpose::REAL_SHUTDOWN.get() {
                            // SAFETY: our socket.
                            unsafe { shutdown(ns, libc::SHUT_RDWR) };
                        }
                    }
                    if let Some(close) = crate::interpose::REAL_CLOSE.get() {
                        // SAFETY: our socket (copies live at the descriptors).
                        unsafe { close(ns) };
                    }
                    d
                });
                let plain = plain.map(|d| {
                    let _ = d.set_nonblocking(true);
                    SdStream::plain_after_failed_setup(d)
                });
                match plain {
                    Some(p) => self.adopt(p),
                    None => {
                        eprintln!(
                            "softrdma-preload: switching a connection into sockets direct failed, and a plain reconnect too; it is reset"
                        );
                        if ns.is_none() {
                            // The begun socket, where the application
                            // still has it, carries no data.
                            self.place_plain(None, ino);
                        }
                        let _ = self.sw.set(Err(libc::ECONNRESET));
                    }
                }
            }
        }
    }

    /// Whether a descriptor of this connection is still the begun socket
    /// `ino`.
    fn has_begun_socket(&self, ino: (u64, u64)) -> bool {
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        t.iter()
            .filter(|(_, s)| std::ptr::eq(Arc::as_ptr(&s.conn), self))
            .any(|(&fd, _)| inode(fd) == Some(ino))
    }

    /// Puts the plain connection `ns` on each descriptor of this
    /// connection that is still the begun socket `ino` (under the table's
    /// lock: a close forgets its descriptor before it closes it, so none
    /// is closed meanwhile), or shuts each down if there is no `ns`; false
    /// if there is none (no descriptor is touched then).
    fn place_plain(&self, ns: Option<c_int>, ino: (u64, u64)) -> bool {
        let (Some(dup3), Some(shutdown)) = (
            crate::interpose::REAL_DUP3.get(),
            crate::interpose::REAL_SHUTDOWN.get(),
        ) else {
            return false;
        };
        let t = TABLE.read().unwrap_or_else(|e| e.into_inner());
        let mut placed = false;
        for &fd in t
            .iter()
            .filter(|(_, s)| std::ptr::eq(Arc::as_ptr(&s.conn), self))
            .map(|(fd, _)| fd)
        {
            if inode(fd) != Some(ino) {
                continue;
            }
            let Some(ns) = ns else {
                // SAFETY: a descriptor of this connection, still its socket.
                unsafe { shutdown(fd, libc::SHUT_RDWR) };
                placed = true;
                continue;
            };
            // The kernel's flag (an offloaded descriptor's is always set).
            let flags = if crate::interpose::fd_cloexec(fd) {
                libc::O_CLOEXEC
            } else {
                0
            };
            // SAFETY: the new connection takes a descriptor number of this
            // connection that is still its begun socket.
            placed |= unsafe { dup3(ns, fd, flags) } == fd;
        }
        placed
    }

    /// The stream if it is switched and this process's (a pending one is
    /// not switched by this).
    pub(crate) fn switched(&self) -> Option<&SdStream> {
        if self.owner.load(Ordering::Relaxed) != pid() {
            return None;
        }
        match self.sw.get() {
            Some(Ok(s)) => Some(s),
            _ => None,
        }
    }

    /// The readiness descriptor (-1 if not switched). Made on first use
    /// (epoll needs one; poll and select wait in the engine without): a
    /// connection with one has its CQ armed, so that the engine's threads
    /// keep it in sync.
    pub(crate) fn readiness(&self) -> c_int {
        let s = self.stream();
        let r = self.rfd.load(Ordering::Relaxed);
        if r >= 0 {
            return r;
        }
        let Ok(s) = s else { return -1 };
        // Idempotent: concurrent callers get the same descriptor.
        let rfd = as_internal(|| s.readiness_fd()).unwrap_or(-1);
        self.rfd.store(rfd, Ordering::Relaxed);
        rfd
    }

    /// The thread's burst of sends on this connection ended: the next
    /// burst is predicted as long, and a held send goes now.
    pub(crate) fn burst_end(&self) {
        let n = self.burst_cur.swap(0, Ordering::Relaxed);
        self.burst_last.store(n, Ordering::Relaxed);
        self.end_hold();
    }

    /// Corks the stream to hold a small send for the next one of its burst
    /// (unless the application corked it, or a hold is on already); the
    /// flusher is told. Returns whether the stream is held now.
    pub(crate) fn start_hold(self: &Arc<Self>, s: &SdStream) -> bool {
        if self.auto.load(Ordering::Relaxed) {
            return true;
        }
        if self.more.load(Ordering::Relaxed) || !s.cork().is_ok_and(|on| !on) {
            return false;
        }
        if s.set_cork(true).is_err() {
            return false;
        }
        self.auto.store(true, Ordering::Relaxed);
        let hold = self.auto_gen.fetch_add(1, Ordering::Relaxed) + 1;
        crate::autocork::watch(self, hold);
        true
    }

    /// Ends the library's hold, if on: the held octets go now.
    pub(crate) fn end_hold(&self) {
        if self.auto.swap(false, Ordering::Relaxed)
            && let Ok(s) = self.stream()
        {
            let _ = s.set_cork(false);
        }
    }

    /// Ends hold number `hold` if it is still on (the flusher).
    pub(crate) fn end_hold_if(&self, hold: u64) {
        if self.auto_gen.load(Ordering::Relaxed) == hold {
            self.end_hold();
        }
    }

    /// Ends hold number `hold` if it is still on, at exit: without waiting
    /// for the stream's lock, which the exiting thread may hold itself
    /// (`exit` from a signal handler that interrupted a send). A hold left
    /// on is sent by sockets direct's exit flush, which tries its locks in
    /// rounds.
    pub(crate) fn end_hold_at_exit(&self, hold: u64) {
        if self.auto_gen.load(Ordering::Relaxed) == hold
            && let Ok(s) = self.stream()
            && s.try_uncork().unwrap_or(false)
        {
            self.auto.store(false, Ordering::Relaxed);
        }
    }

    /// Whether the readiness descriptor was made.
    pub(crate) fn readiness_made(&self) -> bool {
        self.rfd.load(Ordering::Relaxed) >= 0
    }

    /// Runs `f` (a non-blocking attempt) until it does not report
    /// `WouldBlock`, waiting on the readiness descriptor in between unless
    /// the call is non-blocking; `out` says which readiness is awaited.
    pub(crate) fn blocking<T>(
        &self,
        dontwait: bool,
        out: bool,
        mut f: impl FnMut(&SdStream) -> io::Result<T>,
    ) -> Result<T, c_int> {
        let s = self.stream()?;
        let nb = dontwait || self.nonblock.load(Ordering::Relaxed);
        let us = if out {
            self.sndtimeo.load(Ordering::Relaxed)
        } else {
            self.rcvtimeo.load(Ordering::Relaxed)
        };
        let deadline = (us > 0).then(|| Instant::now() + Duration::from_micros(us));
        loop {
            match f(s) {
                Ok(v) => return Ok(v),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if out {
                        self.write_blocked.fetch_add(1, Ordering::Relaxed);
                    }
                    if nb {
                        return Err(libc::EAGAIN);
                    }
                    // At most 50 ms per sleep: a safety net against a lost
                    // readiness change.
                    let mut ms = 50;
                    if let Some(d) = deadline {
                        let left = d.saturating_duration_since(Instant::now());
                        if left.is_zero() {
                            return Err(libc::EAGAIN);
                        }
                        ms = ms.min(left.as_millis() as i32 + 1);
                    }
                    // In the engine: bytes arriving on the connection's
                    // socket wake this thread, which runs the receive path
                    // itself (credits for a writer come in the same way),
                    // without waiting for the engine's threads.
                    let mut e = [softrdma_sockets::poll::PollEntry::stream(
                        s,
                        if out {
                            softrdma_sockets::poll::POLLOUT
                        } else {
                            softrdma_sockets::poll::POLLIN
                        },
                    )];
                    let t = Duration::from_millis(ms as u64);
                    if let Err(e) = softrdma_sockets::poll::poll(&mut e, Some(t), None)
                        && e.raw_os_error() == Some(libc::EINTR)
                        && !restart_after_signal()
                    {
                        return Err(libc::EINTR);
                    }
                }
                Err(e) => return Err(errno_of(&e)),
            }
        }
    }
}

/// The errno for an error of the sockets-direct stream.
pub(crate) fn errno_of(e: &io::Error) -> c_int {
    if let Some(n) = e.raw_os_error() {
        return n;
    }
    use io::ErrorKind as K;
    match e.kind() {
        K::BrokenPipe => libc::EPIPE,
        K::ConnectionReset => libc::ECONNRESET,
        K::ConnectionAborted => libc::ECONNABORTED,
        K::NotConnected => libc::ENOTCONN,
        K::WouldBlock => libc::EAGAIN,
        K::TimedOut => libc::ETIMEDOUT,
        K::Interrupted => libc::EINTR,
        K::InvalidInput => libc::EINVAL,
        _ => libc::EIO,
    }
}

/// Whether a blocking call interrupted by a signal handler is restarted,
/// as the kernel does when the handler was installed with `SA_RESTART`.
/// The signal that ran is not known here: the call is restarted only when
/// every caught signal has `SA_RESTART` (otherwise `EINTR`, as the kernel
/// returns for a handler without it).
fn restart_after_signal() -> bool {
    for sig in 1..=libc::SIGRTMAX() {
        if sig == libc::SIGKILL || sig == libc::SIGSTOP {
            continue;
        }
        // SAFETY: sigaction with a null new action only reads the current one.
        let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
        // SAFETY: as above; `old` is writable.
        if unsafe { libc::sigaction(sig, std::ptr::null(), &raw mut old) } != 0 {
            continue;
        }
        let h = old.sa_sigaction;
        if h != libc::SIG_DFL && h != libc::SIG_IGN && old.sa_flags & libc::SA_RESTART == 0 {
            return false;
        }
    }
    true
}

/// Raises `SIGPIPE` in the calling thread, as the kernel does for a write
/// to a closed connection without `MSG_NOSIGNAL`.
pub(crate) fn raise_sigpipe() {
    // SAFETY: signalling the calling thread.
    unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGPIPE) };
}
