//! The interposed C entry points and the process-wide state behind them.
//!
//! Each entry point resolves the real function with `dlsym(RTLD_NEXT)` on
//! first use, makes its decision in Rust under `catch_unwind`, and restores
//! `errno` to what the real call set before returning.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Duration;

use libc::{c_int, c_ulong, c_void, sockaddr, socklen_t};
use softrdma_sockets::external::{self, LateAnswer, PeerAnswer, PendingQuery};

use crate::conn::{self, Conn, ENGINE_PID};
use crate::policy::{Mode, Policy, Role};
pub(crate) use crate::real::*;
use crate::stats::{PlainReason, Stats, json_line};
use crate::twin::Twin;

/// Process-wide state, made on the first interposed call.
pub(crate) struct State {
    policy: Policy,
    program: String,
    exe: String,
    pub(crate) stats: Stats,
    stats_file: Option<std::path::PathBuf>,
}

static STATE: OnceLock<State> = OnceLock::new();

/// The library's environment variables as the process started with them:
/// servers such as nginx clear the environment of their worker processes,
/// which are the ones that accept connections.
struct Env {
    mode: Option<String>,
    conf: Option<std::ffi::OsString>,
    stats: Option<std::ffi::OsString>,
    /// `SOFTRDMA_SOCKETS_WAIT=kernel`: poll, select and epoll wait on the
    /// readiness descriptors in the kernel (the engine's threads deliver
    /// every message), for comparison; default: in the engine.
    kernel_wait: bool,
    /// `SOFTRDMA_SOCKETS_AUTOCORK=MS`: the longest hold of a small write
    /// for the next one of its burst (see `autocork`); `0`: never hold.
    autocork_ms: Option<u64>,
}

static ENV: OnceLock<Env> = OnceLock::new();

fn read_env() -> Env {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    Env {
        mode: var("SOFTRDMA_SOCKETS").map(|m| m.to_string_lossy().into_owned()),
        conf: var("SOFTRDMA_SOCKETS_CONF"),
        stats: var("SOFTRDMA_SOCKETS_STATS"),
        kernel_wait: var("SOFTRDMA_SOCKETS_WAIT").is_some_and(|v| v == "kernel"),
        autocork_ms: var("SOFTRDMA_SOCKETS_AUTOCORK")
            .and_then(|v| v.to_str().and_then(|v| v.trim().parse().ok())),
    }
}

/// The longest hold of a small write for the next write of its burst
/// (see `autocork`); zero: never hold.
pub(crate) fn autocork_limit() -> std::time::Duration {
    ENV.get_or_init(read_env).autocork_ms.map_or(
        crate::autocork::HOLD_LIMIT,
        std::time::Duration::from_millis,
    )
}

/// Whether poll, select and epoll wait in the engine (the default; see
/// `Env::kernel_wait`).
pub(crate) fn engine_wait() -> bool {
    !ENV.get_or_init(read_env).kernel_wait
}

/// Runs when the library is loaded: copies the library's environment
/// variables, keeps the library's panics out of the application's stderr
/// (`stats::quiet_panics`), and has the engine count the process's forks
/// from here on
/// (a forked child's close waits for the peer's FIN, see the sockets
/// crate's README, *The close of the side that closes first*; the count
/// starts at the engine's first use otherwise, which a server that forks
/// before its first connection is switched would miss).
extern "C" fn capture_env() {
    let print = std::env::var_os("SOFTRDMA_SOCKETS_PANICS").is_some_and(|v| v == "print");
    crate::stats::quiet_panics(print);
    let _ = catch_unwind(|| {
        ENV.get_or_init(read_env);
        softrdma_sockets::count_forks();
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static CAPTURE_ENV: extern "C" fn() = capture_env;

pub(crate) fn state() -> &'static State {
    STATE.get_or_init(|| {
        let env = ENV.get_or_init(read_env);
        let default = env
            .mode
            .as_ref()
            .and_then(|m| {
                let mode = Mode::parse(m);
                if mode.is_none() {
                    eprintln!(
                        "softrdma-preload: SOFTRDMA_SOCKETS={m:?} is not auto, offload or tcp; using auto"
                    );
                }
                mode
            })
            .unwrap_or(Mode::Auto);
        let mut policy = Policy::new(default);
        if let Some(path) = &env.conf {
            match std::fs::read_to_string(path) {
                Ok(text) => {
                    for e in policy.add_rules(&text) {
                        eprintln!(
                            "softrdma-preload: {}:{}: {} (line ignored)",
                            path.to_string_lossy(),
                            e.line,
                            e.what
                        );
                    }
                }
                Err(e) => eprintln!(
                    "softrdma-preload: cannot read {}: {e}; using SOFTRDMA_SOCKETS only",
                    path.to_string_lossy()
                ),
            }
        }
        let exe = std::fs::read_link("/proc/self/exe")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let program = exe.rsplit('/').next().unwrap_or("").to_string();
        let stats_file = env.stats.clone().map(Into::into);
        if stats_file.is_some() {
            // SAFETY: registering a plain `extern "C" fn()` with no
            // arguments; it runs at most once per process at exit.
            unsafe { libc::atexit(write_stats) };
        }
        // SAFETY: registering an `extern "C" fn()` run in the child after
        // fork; it stores to atomics and takes no lock another thread could
        // have held at the fork (the first panic's only with `try_lock`).
        unsafe { libc::pthread_atfork(None, None, Some(after_fork_child)) };
        State {
            policy,
            program,
            exe,
            stats: Stats::default(),
            stats_file,
        }
    })
}

extern "C" fn after_fork_child() {
    let _ = catch_unwind(|| {
        if let Some(s) = STATE.get() {
            s.stats.reset();
        }
        crate::stats::reset_panics();
    });
}

extern "C" fn write_stats() {
    let _ = catch_unwind(|| {
        let Some(s) = STATE.get() else { return };
        let Some(path) = &s.stats_file else { return };
        let mut counts = s.stats.snapshot();
        counts.panics = crate::stats::panics();
        counts.first_panic = crate::stats::first_panic();
        let line = json_line(std::process::id(), &s.exe, &counts) + "\n";
        // One write with O_APPEND: lines of concurrent processes never mix.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = f.write_all(line.as_bytes());
        }
    });
}

/// The IP address and port of a socket address (AF_INET / AF_INET6 only).
///
/// # Safety
/// `addr` is null or points to `len` readable bytes.
unsafe fn ip_port(addr: *const sockaddr, len: socklen_t) -> Option<(IpAddr, u16)> {
    if addr.is_null() {
        return None;
    }
    let len = usize::try_from(len).ok()?;
    // SAFETY: the caller guarantees `len` readable bytes at `addr`; the
    // family field is read only if it is inside them, and each struct only
    // if the whole struct is.
    unsafe {
        if len < size_of::<libc::sa_family_t>() {
            return None;
        }
        match c_int::from((*addr).sa_family) {
            libc::AF_INET if len >= size_of::<libc::sockaddr_in>() => {
                let a = &*addr.cast::<libc::sockaddr_in>();
                Some((
                    IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
                    u16::from_be(a.sin_port),
                ))
            }
            libc::AF_INET6 if len >= size_of::<libc::sockaddr_in6>() => {
                let a = &*addr.cast::<libc::sockaddr_in6>();
                Some((
                    IpAddr::V6(Ipv6Addr::from(a.sin6_addr.s6_addr)),
                    u16::from_be(a.sin6_port),
                ))
            }
            _ => None,
        }
    }
}

/// Whether `fd` is a stream socket.
fn is_stream(fd: c_int) -> bool {
    let mut ty: c_int = 0;
    let mut len = size_of::<c_int>() as socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `ty`.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&raw mut ty).cast(),
            &raw mut len,
        )
    };
    r == 0 && ty == libc::SOCK_STREAM
}

/// The local address of `fd`.
fn local_ip_port(fd: c_int) -> Option<(IpAddr, u16)> {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: getsockname writes at most `len` bytes into `ss`.
    let r = unsafe { libc::getsockname(fd, (&raw mut ss).cast(), &raw mut len) };
    if r != 0 {
        return None;
    }
    // SAFETY: `ss` holds `len` bytes written by the kernel.
    unsafe { ip_port((&raw const ss).cast(), len) }
}

/// The peer address of `fd`.
fn peer_ip_port(fd: c_int) -> Option<(IpAddr, u16)> {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = size_of::<libc::sockaddr_storage>() as socklen_t;
    // SAFETY: getpeername writes at most `len` bytes into `ss`.
    let r = unsafe { libc::getpeername(fd, (&raw mut ss).cast(), &raw mut len) };
    if r != 0 {
        return None;
    }
    // SAFETY: `ss` holds `len` bytes written by the kernel.
    unsafe { ip_port((&raw const ss).cast(), len) }
}

/// Runs an entry point's Rust part: a panic never unwinds into C; it
/// fails the call with `EIO`.
pub(crate) fn guard<T: From<i8>>(f: impl FnOnce() -> Result<T, c_int>) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => fail(e),
        Err(_) => fail(libc::EIO),
    }
}

/// How long a capability query waits for the twin of a host not asked
/// before (a host without sockets direct answers at once with ICMP port
/// unreachable on loopback and LANs; the answer is cached).
const PROBE_TIMEOUT: Duration = Duration::from_millis(250);
/// How long `connect` waits for a non-blocking connection to be made
/// before it is switched.
const CONNECT_WAIT_MS: c_int = 5000;

/// The decision for a new client connection.
enum ClientPlan {
    /// Not ours (not TCP over IP, or already connected): the real call.
    Pass,
    /// Plain TCP, counted with this reason.
    Plain(PlainReason),
    /// Offload required and impossible: refuse before any byte.
    Refuse(&'static str),
    /// The peer's twin agreed: connect and switch.
    Switch,
    /// The peer's twin decides late queries (it said so before): the query
    /// is on its way; connect, then read the answer (the query's round
    /// trip overlaps the handshake, and the answer is mostly there by then:
    /// no sleep for it).
    SwitchLate(PendingQuery),
}

/// An `int` socket option of `fd` (`None` if it cannot be read).
fn int_opt(fd: c_int, level: c_int, name: c_int) -> Option<c_int> {
    let mut v: c_int = 0;
    let mut l = size_of::<c_int>() as socklen_t;
    // SAFETY: reading an int option into `v`, `l` its size.
    let r = unsafe { libc::getsockopt(fd, level, name, (&raw mut v).cast(), &raw mut l) };
    (r == 0).then_some(v)
}

/// Sets an `int` socket option of `fd`; whether it took.
fn set_int_opt(fd: c_int, level: c_int, name: c_int, v: c_int) -> bool {
    // SAFETY: an int option from `v`, its size given.
    let r = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const v).cast(),
            size_of::<c_int>() as socklen_t,
        )
    };
    r == 0
}

/// How many chosen ports a bind tries before it lets the kernel pick one.
const CHOSEN_PORT_TRIES: usize = 16;

/// Binds the application's socket `fd` (unbound; a bound one keeps its
/// port) so that the capability query can name its port; returns the port
/// and whether it was chosen here. `choose`: a random port of the
/// ephemeral range ([`softrdma_sockets::choose_port`], one look-up in the
/// kernel), bound as the socket is first (a port nobody holds, the usual
/// case, takes it: no socket option read, set and put back), then, on
/// `EADDRINUSE`, with `SO_REUSEADDR` for the bind only (the application's
/// value of the option is put back; a port whose other connections are
/// closing takes it), another one on `EADDRINUSE`, and
/// port 0 after [`CHOSEN_PORT_TRIES`]: a `bind` to port 0 searches the
/// range for a port no socket holds, those in `TIME_WAIT` included, which
/// takes milliseconds once a client making short connections has filled
/// it. A chosen port may still have a connection to the same address in
/// `TIME_WAIT`: `connect` then fails with `EADDRNOTAVAIL`, and is made
/// again from a port the kernel picks ([`connect`]).
/// `bound`: the socket's local port, as `getsockname` gave it (0: unbound).
fn bind_for_query(fd: c_int, v6: bool, choose: bool, bound: u16) -> Option<(u16, bool)> {
    if bound != 0 {
        return Some((bound, false));
    }
    let bind = |port: u16| -> c_int {
        let any: SocketAddr = if v6 {
            (Ipv6Addr::UNSPECIFIED, port).into()
        } else {
            (Ipv4Addr::UNSPECIFIED, port).into()
        };
        let sa = socket2::SockAddr::from(any);
        // The real call: this library's `bind` would look at the
        // socket's type on a failure.
        let Some(real) = REAL_BIND.get() else {
            return libc::ENOSYS;
        };
        // SAFETY: binding the caller's socket to a valid address of its
        // family.
        let r = unsafe { real(fd, sa.as_ptr().cast(), sa.len()) };
        if r == 0 { 0 } else { errno() }
    };
    let mut tries = CHOSEN_PORT_TRIES;
    if choose {
        let port = softrdma_sockets::choose_port();
        match bind(port) {
            0 => return Some((port, true)),
            libc::EADDRINUSE => tries -= 1,
            _ => tries = 0,
        }
    }
    if choose
        && tries > 0
        && let Some(old) = int_opt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR)
        && set_int_opt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)
    {
        let mut got = None;
        for _ in 0..tries {
            let port = softrdma_sockets::choose_port();
            match bind(port) {
                0 => {
                    got = Some(port);
                    break;
                }
                libc::EADDRINUSE => {}
                _ => break,
            }
        }
        if old == 0 {
            set_int_opt(fd, libc::SOL_SOCKET, libc::SO_REUSEADDR, 0);
        }
        if let Some(p) = got {
            return Some((p, true));
        }
    }
    if bind(0) != 0 {
        return None;
    }
    local_ip_port(fd).map(|(_, p)| (p, false))
}

/// Options an application may set on a socket before `connect`, copied to
/// the socket that replaces it when a chosen port cannot connect
/// ([`fresh_socket`]). Buffer sizes are not (a copy would turn the kernel's
/// automatic sizing off).
const COPIED_OPTS: [(c_int, c_int); 10] = [
    (libc::SOL_SOCKET, libc::SO_KEEPALIVE),
    (libc::SOL_SOCKET, libc::SO_PRIORITY),
    (libc::SOL_SOCKET, libc::SO_OOBINLINE),
    (libc::IPPROTO_TCP, libc::TCP_NODELAY),
    (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
    (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
    (libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
    (libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
    (libc::IPPROTO_IP, libc::IP_TOS),
    (libc::IPPROTO_IPV6, libc::IPV6_TCLASS),
];

/// Puts a new, unbound TCP socket of `fd`'s family in place of `fd` (same
/// number), with its `O_NONBLOCK`, close-on-exec flag, `IPV6_V6ONLY` and
/// the [`COPIED_OPTS`]; whether it did (`fd` is untouched otherwise).
fn fresh_socket(fd: c_int) -> bool {
    let (Some(dup3), Some(close), Some(fcntl)) =
        (REAL_DUP3.get(), REAL_CLOSE.get(), REAL_FCNTL.get())
    else {
        return false;
    };
    let Some(family) = int_opt(fd, libc::SOL_SOCKET, libc::SO_DOMAIN) else {
        return false;
    };
    // SAFETY: a new socket.
    let ns = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if ns < 0 {
        return false;
    }
    if family == libc::AF_INET6
        && let Some(v) = int_opt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY)
    {
        set_int_opt(ns, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, v);
    }
    for (level, name) in COPIED_OPTS {
        if (level == libc::IPPROTO_IP && family != libc::AF_INET)
            || (level == libc::IPPROTO_IPV6 && family != libc::AF_INET6)
        {
            continue;
        }
        if let Some(v) = int_opt(fd, level, name) {
            set_int_opt(ns, level, name, v);
        }
    }
    // SAFETY: F_GETFL/F_SETFL on the caller's socket and on ours.
    unsafe {
        let fl = fcntl(fd, libc::F_GETFL, 0);
        if fl >= 0 && fl & libc::O_NONBLOCK != 0 {
            let nfl = fcntl(ns, libc::F_GETFL, 0);
            fcntl(ns, libc::F_SETFL, (nfl | libc::O_NONBLOCK) as usize);
        }
    }
    let flags = if fd_cloexec(fd) { libc::O_CLOEXEC } else { 0 };
    // SAFETY: the new socket takes the caller's descriptor number.
    let r = unsafe { dup3(ns, fd, flags) };
    // SAFETY: our socket (a copy now lives at `fd`).
    unsafe { close(ns) };
    r == fd
}

/// The plan for `fd`'s connection to `target`; and whether `fd` was bound
/// to a port chosen here (see [`bind_for_query`]; `choose`: it may be).
fn client_plan(fd: c_int, target: Option<(IpAddr, u16)>, choose: bool) -> (ClientPlan, bool) {
    let mut chosen = false;
    let plan = client_plan_bound(fd, target, choose, &mut chosen);
    (plan, chosen)
}

fn client_plan_bound(
    fd: c_int,
    target: Option<(IpAddr, u16)>,
    choose: bool,
    chosen: &mut bool,
) -> ClientPlan {
    let Some((ip, port)) = target else {
        return ClientPlan::Pass;
    };
    if !is_stream(fd) || conn::lookup(fd).is_some() {
        return ClientPlan::Pass;
    }
    // A connected socket has a local port: an unbound one (the usual
    // client's) needs no `getpeername` to know it is not connected.
    let Some((_, bound)) = local_ip_port(fd) else {
        return ClientPlan::Pass;
    };
    if bound != 0 && peer_ip_port(fd).is_some() {
        return ClientPlan::Pass;
    }
    let s = state();
    let mode = s.policy.decide(&s.program, Role::Client, ip, port);
    if mode == Mode::Tcp {
        return ClientPlan::Plain(PlainReason::Policy);
    }
    let required = mode == Mode::Offload;
    let plain = |why: PlainReason, msg: &'static str| {
        if required {
            ClientPlan::Refuse(msg)
        } else {
            ClientPlan::Plain(why)
        }
    };
    let started = ENGINE_PID.load(Ordering::Relaxed);
    if started != 0 && started != conn::pid() {
        return plain(
            PlainReason::EngineInherited,
            "this process was forked from one whose engine runs",
        );
    }
    let dest = SocketAddr::new(ip, port);
    let not_capable = "the peer does not run sockets direct";
    if external::known_plain(dest) {
        return plain(PlainReason::PeerNotCapable, not_capable);
    }
    // The address's family is the socket's (connect takes no other for an
    // IP stream socket, and a mismatch fails the bind and the connect).
    let v6 = ip.is_ipv6();
    let Some((local_port, was_chosen)) = bind_for_query(fd, v6, choose, bound) else {
        return plain(PlainReason::PeerNotCapable, not_capable);
    };
    *chosen = was_chosen;
    if !required
        && external::known_late_queries(dest)
        && let Some(p) = external::send_query(dest, local_port)
    {
        return ClientPlan::SwitchLate(p);
    }
    match external::query(dest, local_port, PROBE_TIMEOUT) {
        PeerAnswer::Accept => ClientPlan::Switch,
        PeerAnswer::Decline => plain(PlainReason::PeerDeclined, "the peer declined offload"),
        PeerAnswer::NotCapable => plain(PlainReason::PeerNotCapable, not_capable),
    }
}

/// Waits until a non-blocking connect completes; whether it connected
/// (without consuming `SO_ERROR`, which the application reads): writable
/// without an error or hang-up (a failed connect reports both), which
/// needs no `getpeername`.
fn wait_connected(fd: c_int) -> bool {
    let Some(poll) = REAL_POLL.get() else {
        return false;
    };
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLOUT,
        revents: 0,
    };
    loop {
        // SAFETY: one valid pollfd.
        let r = unsafe { poll(&raw mut p, 1, CONNECT_WAIT_MS) };
        if r < 0 && errno() == libc::EINTR {
            continue;
        }
        return r > 0
            && p.revents & libc::POLLOUT != 0
            && p.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) == 0;
    }
}

/// `connect(2)`: a TCP connection whose policy allows offload asks the
/// server's UDP twin first; if it agrees, the connection is made (a
/// non-blocking one is waited for) and its switch into sockets direct
/// begun (the MPA Request sent) before `connect` returns, with the result
/// the real call gave; the switch is finished on the connection's first
/// use (see `Conn::stream`). Otherwise it
/// stays plain TCP; a connection that must be offloaded but cannot is
/// refused with `EOPNOTSUPP` before any byte.
///
/// # Safety
/// As `connect(2)`: `addr` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(real) = REAL_CONNECT.get() else {
        return fail(libc::ENOSYS);
    };
    let plan_for = |choose: bool| {
        catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: the caller's guarantee for `addr`/`len`.
            client_plan(fd, unsafe { ip_port(addr, len) }, choose)
        }))
        .unwrap_or((ClientPlan::Pass, false))
    };
    let refuse = |why: &str| {
        let _ = catch_unwind(|| {
            state().stats.refused();
            eprintln!(
                "softrdma-preload: connection refused: the policy requires offload, and {why}"
            );
        });
        fail(libc::EOPNOTSUPP)
    };
    let (mut plan, chosen) = plan_for(true);
    if let ClientPlan::Refuse(why) = plan {
        return refuse(why);
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    let mut r = unsafe { real(fd, addr, len) };
    let mut e = errno();
    if r != 0 && e == libc::EADDRNOTAVAIL && chosen && fresh_socket(fd) {
        // The chosen port's earlier connection to this address is still
        // in TIME_WAIT: a fresh socket takes the descriptor, asks again
        // from a port the kernel picks, and connects from there.
        (plan, _) = plan_for(false);
        if let ClientPlan::Refuse(why) = plan {
            return refuse(why);
        }
        // SAFETY: as above.
        r = unsafe { real(fd, addr, len) };
        e = errno();
    }
    if r != 0 && e != libc::EINPROGRESS {
        set_errno(e);
        return r;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| match plan {
        ClientPlan::Plain(why) => state().stats.plain(why),
        plan @ (ClientPlan::Switch | ClientPlan::SwitchLate(_)) => {
            if r != 0 && !wait_connected(fd) {
                // The connection failed: the application learns it from
                // SO_ERROR as usual.
                return;
            }
            let app_nonblock = REAL_FCNTL.get().is_some_and(|f| {
                // SAFETY: F_GETFL has no argument.
                let fl = unsafe { f(fd, libc::F_GETFL, 0) };
                fl >= 0 && fl & libc::O_NONBLOCK != 0
            });
            if let ClientPlan::SwitchLate(p) = plan {
                match p.wait_late(PROBE_TIMEOUT) {
                    LateAnswer::Accept => {}
                    LateAnswer::Decline { .. } => {
                        // Too late (accepted before the query came) or
                        // declined: the listener keeps it plain too.
                        state().stats.plain(PlainReason::PeerDeclined);
                        return;
                    }
                    LateAnswer::NoTwin => {
                        state().stats.plain(PlainReason::PeerNotCapable);
                        return;
                    }
                    LateAnswer::Unknown => {
                        // The listener may switch this connection or not:
                        // it must not carry data. A fresh plain connection,
                        // which asks nobody (so the listener keeps it
                        // plain), takes its place; the next connection
                        // asks first.
                        state().stats.plain(PlainReason::SetupFailed);
                        // SAFETY: the caller's address, as for the real call.
                        if !unsafe { reconnect_plain(fd, addr, len, app_nonblock) } {
                            // SAFETY: shutting down the caller's socket.
                            unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                        }
                        return;
                    }
                }
            }
            // SAFETY: the caller's guarantee for `addr`/`len`.
            let peer = unsafe { ip_port(addr, len) }.map(|(ip, port)| SocketAddr::new(ip, port));
            // SAFETY: the caller's guarantee for `addr`/`len`.
            match unsafe { Conn::connect_begin(fd, app_nonblock, peer, addr, len) } {
                Ok(c) => {
                    // Counted once the switch is finished (first use).
                    let cloexec = fd_cloexec(fd);
                    conn::insert(fd, c, cloexec);
                }
                Err(_) => {
                    state().stats.plain(PlainReason::SetupFailed);
                    // The switch's bytes may be on the stream: it must not
                    // carry application data. A fresh plain connection
                    // takes its place (it asks no twin, so the server keeps
                    // it plain).
                    // SAFETY: the caller's address, as for the real call.
                    if !unsafe { reconnect_plain(fd, addr, len, app_nonblock) } {
                        eprintln!(
                            "softrdma-preload: switching a connection into sockets direct failed, and a plain reconnect too; it is reset"
                        );
                        // SAFETY: shutting down the caller's socket.
                        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                    }
                }
            }
        }
        ClientPlan::Pass | ClientPlan::Refuse(_) => {}
    }));
    set_errno(e);
    r
}

/// Replaces the connection of `fd` (whose switch failed) by a new plain
/// one to the same address, with the application's non-blocking mode
/// (`nonblock`, as it was before the switch made the socket non-blocking),
/// close-on-exec flag and `TCP_NODELAY`.
///
/// # Safety
/// `addr` points to `len` readable bytes.
pub(crate) unsafe fn reconnect_plain(
    fd: c_int,
    addr: *const sockaddr,
    len: socklen_t,
    nonblock: bool,
) -> bool {
    let (Some(dup3), Some(close)) = (REAL_DUP3.get(), REAL_CLOSE.get()) else {
        return false;
    };
    let mut nodelay: c_int = 0;
    let mut l = size_of::<c_int>() as socklen_t;
    // SAFETY: reading an int option of the caller's socket.
    unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw mut nodelay).cast(),
            &raw mut l,
        )
    };
    // SAFETY: the caller's guarantee for `addr`/`len`.
    let Some(ns) = (unsafe { plain_socket(addr, len, nonblock, nodelay != 0) }) else {
        return false;
    };
    let flags = if fd_cloexec(fd) { libc::O_CLOEXEC } else { 0 };
    // SAFETY: the new connection takes the caller's descriptor number.
    let r = unsafe { dup3(ns, fd, flags) };
    // SAFETY: our socket (a copy now lives at `fd`).
    unsafe { close(ns) };
    r == fd
}

/// A new plain connection to `addr` (a blocking connect), close-on-exec,
/// with `nonblock` and `TCP_NODELAY` as given; the caller owns it.
///
/// # Safety
/// `addr` points to `len` readable bytes.
pub(crate) unsafe fn plain_socket(
    addr: *const sockaddr,
    len: socklen_t,
    nonblock: bool,
    nodelay: bool,
) -> Option<c_int> {
    let (Some(connect), Some(close), Some(fcntl)) =
        (REAL_CONNECT.get(), REAL_CLOSE.get(), REAL_FCNTL.get())
    else {
        return None;
    };
    // SAFETY: the caller's address; the family is its first field.
    let family = c_int::from(unsafe { (*addr).sa_family });
    // SAFETY: a new socket.
    let ns = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if ns < 0 {
        return None;
    }
    // SAFETY: a blocking connect of our new socket to the caller's address.
    if unsafe { connect(ns, addr, len) } != 0 {
        // SAFETY: our socket.
        unsafe { close(ns) };
        return None;
    }
    if nodelay {
        let one: c_int = 1;
        // SAFETY: setting an int option of our socket.
        unsafe {
            libc::setsockopt(
                ns,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                (&raw const one).cast(),
                size_of::<c_int>() as socklen_t,
            )
        };
    }
    if nonblock {
        // SAFETY: F_GETFL/F_SETFL on our socket.
        unsafe {
            let nfl = fcntl(ns, libc::F_GETFL, 0);
            fcntl(ns, libc::F_SETFL, (nfl | libc::O_NONBLOCK) as usize);
        }
    }
    Some(ns)
}

pub(crate) fn fd_cloexec(fd: c_int) -> bool {
    REAL_FCNTL.get().is_some_and(|f| {
        // SAFETY: F_GETFD has no argument.
        let fl = unsafe { f(fd, libc::F_GETFD, 0) };
        fl >= 0 && fl & libc::FD_CLOEXEC != 0
    })
}

/// Listening sockets with a capability twin.
static LISTENERS: LazyLock<Mutex<HashMap<c_int, Arc<Twin>>>> = LazyLock::new(Mutex::default);
static LISTENER_COUNT: AtomicUsize = AtomicUsize::new(0);

fn listener_twin(fd: c_int) -> Option<Arc<Twin>> {
    if LISTENER_COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    l.get(&fd).cloned()
}

fn drop_listener(fd: c_int) {
    if LISTENER_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let t = {
        let mut l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let t = l.remove(&fd);
        LISTENER_COUNT.store(l.len(), Ordering::Relaxed);
        released(&l, t.as_ref());
        t
    };
    drop(t);
}

/// A twin removed from `l` (the map, locked): if no listener has it any
/// more, the connections given up on it are forgotten (see
/// `conn::take_abandoned`).
fn released(l: &HashMap<c_int, Arc<Twin>>, t: Option<&Arc<Twin>>) {
    if let Some(t) = t
        && !l.values().any(|o| Arc::ptr_eq(o, t))
    {
        conn::forget_abandoned(conn::twin_id(t));
    }
}

/// `listen(2)`: a TCP listener whose policy allows offload gets a UDP twin
/// on the same address and port answering clients' capability queries.
/// The twin of a bound socket starts before the port listens: a client
/// that connected in between would find no twin to ask and go plain (and
/// a listener that requires offload would refuse it).
///
/// # Safety
/// As `listen(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn listen(fd: c_int, backlog: c_int) -> c_int {
    let Some(real) = REAL_LISTEN.get() else {
        return fail(libc::ENOSYS);
    };
    let e = errno();
    let early = catch_unwind(|| listener_twin_start(fd, false)).unwrap_or(TwinStart::No);
    set_errno(e);
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(fd, backlog) };
    if r != 0 {
        let e = errno();
        drop(early);
        set_errno(e);
        return r;
    }
    let e = errno();
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let t = match early {
            TwinStart::Started(t) => Some(t),
            // Not bound before `listen`: the kernel picked its port now.
            TwinStart::Unbound => match listener_twin_start(fd, true) {
                TwinStart::Started(t) => Some(t),
                _ => None,
            },
            TwinStart::No => None,
        };
        if let Some(t) = t {
            let mut l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
            l.insert(fd, t);
            LISTENER_COUNT.store(l.len(), Ordering::Relaxed);
        }
    }));
    set_errno(e);
    0
}

/// What [`listener_twin_start`] did.
enum TwinStart {
    /// The twin answers on the socket's address and port (its own, or
    /// that of another listener of this process on the port).
    Started(Arc<Twin>),
    /// The socket has no port yet (`listen` binds it): ask again after.
    Unbound,
    /// No twin: one runs already, not a TCP socket, policy `tcp`, a forked
    /// child of a process whose engine runs, or the twin could not start.
    No,
}

/// Starts a twin for the TCP socket `fd` if its policy allows offload;
/// `listening`: `listen` has bound it already.
fn listener_twin_start(fd: c_int, listening: bool) -> TwinStart {
    if listener_twin(fd).is_some() || !is_stream(fd) {
        return TwinStart::No;
    }
    let Some((ip, port)) = local_ip_port(fd) else {
        return TwinStart::No;
    };
    if port == 0 && !listening {
        return TwinStart::Unbound;
    }
    let s = state();
    if s.policy.decide(&s.program, Role::Server, ip, port) == Mode::Tcp {
        return TwinStart::No;
    }
    let started = ENGINE_PID.load(Ordering::Relaxed);
    if started != 0 && started != conn::pid() {
        // Forked from a process whose engine runs: this one cannot
        // switch, so its listener does not offer it.
        return TwinStart::No;
    }
    conn::pid();
    let v6only = ip
        .is_ipv6()
        .then(|| int_opt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY))
        .flatten()
        .map(|v| v != 0);
    let start = || {
        let was = TWIN_BIND.with(|b| b.replace(true));
        let r = Twin::start(SocketAddr::new(ip, port), v6only);
        TWIN_BIND.with(|b| b.set(was));
        r
    };
    match conn::signals_blocked(start) {
        Ok(t) => TwinStart::Started(Arc::new(t)),
        // The port's twin runs already: another listener of this process
        // shares the port (`SO_REUSEPORT`, nginx's `reuseport`), and the
        // kernel spreads the connections among them. Its twin answers for
        // both (the records are the process's): without one, a client that
        // asked it and came to this listener was accepted plain.
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            sibling_twin(ip, port).map_or(TwinStart::No, TwinStart::Started)
        }
        Err(_) => TwinStart::No,
    }
}

thread_local! {
    /// Set while this thread binds a twin's socket: its `EADDRINUSE` is
    /// the twin's own (another twin or a socket of the application holds
    /// the port), never a reason to stop a twin.
    static TWIN_BIND: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// How long a `bind` waits for the twin it stops to let go of the port.
const TWIN_STOP_WAIT: Duration = Duration::from_secs(1);

/// `bind(2)`: a UDP socket of the application gets its port even when a
/// listener's twin of this process holds it (the application listened on
/// the TCP port first, then binds UDP to the same port, as DNS, syslog or
/// SIP servers do): when the real call fails with `EADDRINUSE` and a twin
/// this process started is bound to an overlapping address and the same
/// port, the twin is stopped (its listeners offer offload to no new
/// client) and the real call made once more; its result is returned.
/// Every other call is the real one, with no system call added.
///
/// # Safety
/// As `bind(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn bind(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(real) = REAL_BIND.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(fd, addr, len) };
    if r == 0 || LISTENER_COUNT.load(Ordering::Relaxed) == 0 {
        return r;
    }
    let e = errno();
    if e != libc::EADDRINUSE || TWIN_BIND.with(std::cell::Cell::get) {
        return r;
    }
    // SAFETY: the caller's `addr` points to `len` readable bytes (or the
    // real call would have failed with `EFAULT`).
    let Some((ip, port)) = (unsafe { ip_port(addr, len) }) else {
        set_errno(e);
        return r;
    };
    let stopped =
        catch_unwind(|| release_twin_port(fd, SocketAddr::new(ip, port))).unwrap_or(false);
    if !stopped {
        set_errno(e);
        return r;
    }
    // SAFETY: forwarding the caller's arguments unchanged; errno is the
    // real call's.
    unsafe { real(fd, addr, len) }
}

/// Stops the twins this process started that hold `addr`'s port on an
/// address overlapping `addr`, if `fd` is a datagram socket; whether any
/// was stopped (their listeners keep listening, plain from now on).
fn release_twin_port(fd: c_int, addr: SocketAddr) -> bool {
    if int_opt(fd, libc::SOL_SOCKET, libc::SO_TYPE) != Some(libc::SOCK_DGRAM) {
        return false;
    }
    let v6only = addr.is_ipv6()
        && int_opt(fd, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY).is_some_and(|v| v != 0);
    let found: Vec<Arc<Twin>> = {
        let mut l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
        let mut found: Vec<Arc<Twin>> = Vec::new();
        for t in l.values() {
            if t.is_own() && t.overlaps(addr, v6only) && !found.iter().any(|f| Arc::ptr_eq(f, t)) {
                found.push(t.clone());
            }
        }
        // Every listener of the twin (listeners sharing a port share it).
        l.retain(|_, t| !found.iter().any(|f| Arc::ptr_eq(f, t)));
        LISTENER_COUNT.store(l.len(), Ordering::Relaxed);
        for t in &found {
            released(&l, Some(t));
        }
        found
    };
    if found.is_empty() {
        return false;
    }
    for t in found {
        // False if an accept still held it, or its thread did not stop in
        // time: the second bind then fails as the first did.
        let _ = Twin::stop_and_release(t, TWIN_STOP_WAIT);
    }
    true
}

/// The twin of a listener of this process that answers the queries for
/// `ip` and `port` (bound to that address, or to the wildcard address of
/// its family).
pub(crate) fn sibling_twin(ip: IpAddr, port: u16) -> Option<Arc<Twin>> {
    let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
    l.values()
        .find(|t| {
            let a = t.addr;
            a.port() == port
                && (a.ip() == ip || (a.ip().is_unspecified() && a.is_ipv4() == ip.is_ipv4()))
        })
        .cloned()
}

/// Bookkeeping for a connection `fd` accepted on `lfd`: pending switch if
/// its client asked the twin, plain otherwise (or refused when offload is
/// required). `peer`: the peer's address as the real call returned it, if
/// the caller asked for it (saves a `getpeername`).
fn on_accepted(lfd: c_int, fd: c_int, flags: c_int, peer: Option<(IpAddr, u16)>) -> c_int {
    if fd < 0 {
        return fd;
    }
    let e = errno();
    let refused = catch_unwind(|| {
        // A listener with a twin is a TCP listener (see `listen`): its
        // connections are streams without asking the kernel.
        let twin = listener_twin(lfd);
        if twin.is_none() && !is_stream(fd) {
            return false;
        }
        // The local address of a connection accepted by a listener bound
        // to one address is that address (no `getsockname`).
        let local = match &twin {
            Some(t) if !t.addr.ip().is_unspecified() => Some((t.addr.ip(), t.addr.port())),
            _ => local_ip_port(fd),
        };
        let Some((ip, port)) = local else {
            return false;
        };
        let s = state();
        let mode = s.policy.decide(&s.program, Role::Server, ip, port);
        let why = if mode == Mode::Tcp {
            PlainReason::Policy
        } else {
            match twin {
                None => PlainReason::NoTwin,
                Some(t) => {
                    let peer = peer
                        .or_else(|| peer_ip_port(fd))
                        .map(|(pip, pport)| SocketAddr::new(pip, pport));
                    let asked = peer.is_some_and(|p| t.take(p));
                    // A socket from accept is blocking unless accept4 was
                    // asked for SOCK_NONBLOCK (it does not inherit the
                    // listener's flags).
                    let nonblock = flags & libc::SOCK_NONBLOCK != 0;
                    if asked && let Some(c) = Conn::accepted(fd, nonblock, peer) {
                        // Counted when it is switched (first use).
                        conn::insert(fd, c, flags & libc::SOCK_CLOEXEC != 0);
                        return false;
                    }
                    PlainReason::ClientPlain
                }
            }
        };
        if mode == Mode::Offload {
            s.stats.refused();
            return true;
        }
        s.stats.plain(why);
        false
    })
    .unwrap_or(false);
    if refused {
        // The client is told by a reset; the application never sees it.
        if let Some(close) = REAL_CLOSE.get() {
            // SAFETY: closing the descriptor the real accept just returned.
            unsafe { close(fd) };
        }
        set_errno(libc::ECONNABORTED);
        return -1;
    }
    set_errno(e);
    fd
}

/// `accept(2)`.
///
/// # Safety
/// As `accept(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept(fd: c_int, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    let Some(real) = REAL_ACCEPT.get() else {
        return fail(libc::ENOSYS);
    };
    let cap = addr_room(addr, len);
    loop {
        // SAFETY: forwarding the caller's arguments unchanged.
        let r = unsafe { real(fd, addr, len) };
        // SAFETY: the caller's buffer, as the real call filled it.
        let peer = unsafe { accepted_peer(r, addr, len, cap) };
        // SAFETY: the caller's `len`, as for the real call.
        if !unsafe { skip_abandoned(fd, r, peer, len, cap) } {
            return on_accepted(fd, r, 0, peer);
        }
    }
}

/// Whether the connection `r` just accepted on `lfd` is one its client,
/// this process, gave up before it was accepted (see
/// `conn::take_abandoned`): it is closed, and the caller accepts again
/// (the client's plain connection in its place is queued behind it). The
/// caller's `len` is given its room `cap` back for that.
///
/// # Safety
/// `len` is the caller's argument of the accept that returned `r`.
unsafe fn skip_abandoned(
    lfd: c_int,
    r: c_int,
    peer: Option<(IpAddr, u16)>,
    len: *mut socklen_t,
    cap: socklen_t,
) -> bool {
    if r < 0 || !conn::abandoned_any() {
        return false;
    }
    let skip = catch_unwind(|| {
        let Some(t) = listener_twin(lfd) else {
            return false;
        };
        let peer = peer.or_else(|| peer_ip_port(r));
        peer.is_some_and(|(ip, port)| {
            conn::take_abandoned(SocketAddr::new(ip, port), conn::twin_id(&t))
        })
    })
    .unwrap_or(false);
    if skip {
        if let Some(close) = REAL_CLOSE.get() {
            // SAFETY: the descriptor the real accept just returned.
            unsafe { close(r) };
        }
        if !len.is_null() {
            // SAFETY: the caller's `len`, writable for accept.
            unsafe { *len = cap };
        }
    }
    skip
}

/// The room of an address buffer given to `accept` (0 without one).
fn addr_room(addr: *mut sockaddr, len: *mut socklen_t) -> socklen_t {
    if addr.is_null() || len.is_null() {
        return 0;
    }
    // SAFETY: the caller of accept guarantees `len` is readable.
    unsafe { *len }
}

/// The peer address accept wrote into the caller's buffer of `cap` octets
/// (`None` without a buffer, after a failure, or if it did not fit).
///
/// # Safety
/// `addr`/`len` are the caller's arguments of the accept that returned `r`.
unsafe fn accepted_peer(
    r: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    cap: socklen_t,
) -> Option<(IpAddr, u16)> {
    if r < 0 || addr.is_null() || len.is_null() {
        return None;
    }
    // SAFETY: as for the real call; the kernel sets `*len` to the full
    // length, which is only read within the `cap` octets it filled.
    let got = unsafe { *len };
    if got > cap {
        return None;
    }
    // SAFETY: `got` octets of the caller's buffer were written.
    unsafe { ip_port(addr, got) }
}

/// `accept4(2)`.
///
/// # Safety
/// As `accept4(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn accept4(
    fd: c_int,
    addr: *mut sockaddr,
    len: *mut socklen_t,
    flags: c_int,
) -> c_int {
    let Some(real) = REAL_ACCEPT4.get() else {
        return fail(libc::ENOSYS);
    };
    let cap = addr_room(addr, len);
    loop {
        // SAFETY: forwarding the caller's arguments unchanged.
        let r = unsafe { real(fd, addr, len, flags) };
        // SAFETY: the caller's buffer, as the real call filled it.
        let peer = unsafe { accepted_peer(r, addr, len, cap) };
        // SAFETY: the caller's `len`, as for the real call.
        if !unsafe { skip_abandoned(fd, r, peer, len, cap) } {
            return on_accepted(fd, r, flags, peer);
        }
    }
}

/// `close(2)`: an offloaded connection ends with its last descriptor; a
/// listener's twin stops.
///
/// # Safety
/// As `close(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    let Some(real) = REAL_CLOSE.get() else {
        return fail(libc::ENOSYS);
    };
    // Only for descriptors of ours: the vfork check is a system call
    // (getpid), and programs close other descriptors per request (nginx
    // its files).
    let ours =
        || conn::lookup(fd).is_some() || listener_twin(fd).is_some() || crate::events::is_epoll(fd);
    if (conn::any() || LISTENER_COUNT.load(Ordering::Relaxed) != 0)
        && catch_unwind(ours).unwrap_or(true)
        && !conn::in_vfork_child()
    {
        let _ = catch_unwind(|| {
            conn::remove(fd);
            drop_listener(fd);
            crate::events::forget_epoll(fd);
        });
    }
    // SAFETY: forwarding the caller's argument unchanged.
    unsafe { real(fd) }
}

/// Forgets every offloaded descriptor and listener in `first..=last`
/// (they are about to be closed together).
fn forget_range(first: c_int, last: c_int) {
    if (!conn::any() && LISTENER_COUNT.load(Ordering::Relaxed) == 0) || conn::in_vfork_child() {
        return;
    }
    let _ = catch_unwind(|| {
        for fd in conn::fds_in(first, last) {
            conn::remove(fd);
        }
        let ls: Vec<c_int> = {
            let l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
            l.keys()
                .copied()
                .filter(|&f| f >= first && f <= last)
                .collect()
        };
        for fd in ls {
            drop_listener(fd);
        }
        for fd in crate::events::epolls_in(first, last) {
            crate::events::forget_epoll(fd);
        }
    });
}

/// `close_range(2)`: offloaded descriptors in the range end as with
/// `close` (unless only close-on-exec is set: they always have it).
///
/// # Safety
/// As `close_range(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn close_range(
    first: libc::c_uint,
    last: libc::c_uint,
    flags: c_int,
) -> c_int {
    let Some(real) = REAL_CLOSE_RANGE.get() else {
        return fail(libc::ENOSYS);
    };
    if flags & libc::CLOSE_RANGE_CLOEXEC as c_int == 0 {
        let last = c_int::try_from(last).unwrap_or(c_int::MAX);
        forget_range(c_int::try_from(first).unwrap_or(c_int::MAX), last);
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(first, last, flags) }
}

/// `closefrom(3)`.
///
/// # Safety
/// As `closefrom(3)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn closefrom(low: c_int) {
    forget_range(low.max(0), c_int::MAX);
    if let Some(real) = REAL_CLOSEFROM.get() {
        // SAFETY: forwarding the caller's argument unchanged.
        unsafe { real(low) };
    }
}

/// `shutdown(2)`: offloaded, writing ends with an SDP DisConn after the
/// queued data (the kernel socket is left alone).
///
/// # Safety
/// As `shutdown(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shutdown(fd: c_int, how: c_int) -> c_int {
    if let Some(c) = conn::lookup(fd) {
        return guard(|| {
            let how = match how {
                libc::SHUT_RD => std::net::Shutdown::Read,
                libc::SHUT_WR => std::net::Shutdown::Write,
                libc::SHUT_RDWR => std::net::Shutdown::Both,
                _ => return Err(libc::EINVAL),
            };
            c.stream()?.shutdown(how).map_err(|e| conn::errno_of(&e))?;
            Ok(0)
        });
    }
    let Some(real) = REAL_SHUTDOWN.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, how) }
}

/// A new descriptor `new` of `old` (from dup, dup2, dup3, F_DUPFD).
fn duplicated(old: c_int, new: c_int, cloexec: bool) {
    if new < 0 {
        return;
    }
    let e = errno();
    let _ = catch_unwind(|| {
        // A duplicate of a listener accepts its connections: their clients
        // asked its twin (the number it replaced, if a listener, is not
        // one any more).
        if LISTENER_COUNT.load(Ordering::Relaxed) != 0 && !conn::in_vfork_child() && old != new {
            let mut l = LISTENERS.lock().unwrap_or_else(|e| e.into_inner());
            let gone = match l.get(&old).cloned() {
                Some(t) => l.insert(new, t),
                None => l.remove(&new),
            };
            LISTENER_COUNT.store(l.len(), Ordering::Relaxed);
            released(&l, gone.as_ref());
            drop(l);
            // (A twin is dropped outside the lock: its drop wakes its thread.)
            drop(gone);
        }
        if let Some(c) = conn::lookup(old) {
            if conn::in_vfork_child() {
                // The parent's memory: only the kernel's close-on-exec
                // (the program about to be started must not get it).
                if let Some(f) = REAL_FCNTL.get() {
                    // SAFETY: F_SETFD with an int argument.
                    unsafe { f(new, libc::F_SETFD, libc::FD_CLOEXEC as usize) };
                }
            } else {
                conn::insert(new, c, cloexec);
            }
        }
    });
    set_errno(e);
}

/// `dup(2)`.
///
/// # Safety
/// As `dup(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup(fd: c_int) -> c_int {
    let Some(real) = REAL_DUP.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's argument unchanged.
    let r = unsafe { real(fd) };
    duplicated(fd, r, false);
    r
}

/// `dup2(2)`: the descriptor replaced is forgotten first.
///
/// # Safety
/// As `dup2(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup2(old: c_int, new: c_int) -> c_int {
    let Some(real) = REAL_DUP2.get() else {
        return fail(libc::ENOSYS);
    };
    if old != new && conn::any() && !conn::in_vfork_child() {
        let _ = catch_unwind(|| {
            conn::remove(new);
        });
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(old, new) };
    if old != new {
        duplicated(old, r, false);
    }
    r
}

/// `dup3(2)`.
///
/// # Safety
/// As `dup3(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dup3(old: c_int, new: c_int, flags: c_int) -> c_int {
    let Some(real) = REAL_DUP3.get() else {
        return fail(libc::ENOSYS);
    };
    if old != new && conn::any() && !conn::in_vfork_child() {
        let _ = catch_unwind(|| {
            conn::remove(new);
        });
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(old, new, flags) };
    duplicated(old, r, flags & libc::O_CLOEXEC != 0);
    r
}

fn fcntl_common(
    real: unsafe extern "C" fn(c_int, c_int, usize) -> c_int,
    fd: c_int,
    cmd: c_int,
    arg: usize,
) -> c_int {
    if (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC) && conn::internal() {
        // A duplicate made while setting up a connection: high numbers.
        // SAFETY: F_DUPFD* with an int argument.
        let r = unsafe { real(fd, cmd, arg.max(conn::high_base() as usize)) };
        if r >= 0 {
            return r;
        }
    }
    let Some(slot) = conn::slot(fd) else {
        // SAFETY: forwarding the caller's arguments unchanged.
        let r = unsafe { real(fd, cmd, arg) };
        if (cmd == libc::F_DUPFD || cmd == libc::F_DUPFD_CLOEXEC)
            && LISTENER_COUNT.load(Ordering::Relaxed) != 0
        {
            // A listener's duplicate (see `duplicated`).
            duplicated(fd, r, cmd == libc::F_DUPFD_CLOEXEC);
        }
        return r;
    };
    let c = &slot.conn;
    match cmd {
        libc::F_GETFL => {
            // SAFETY: F_GETFL has no argument.
            let fl = unsafe { real(fd, cmd, 0) };
            if fl < 0 {
                return fl;
            }
            let nb = c.nonblock.load(Ordering::Relaxed);
            (fl & !libc::O_NONBLOCK) | if nb { libc::O_NONBLOCK } else { 0 }
        }
        libc::F_SETFL => {
            let fl = arg as c_int;
            c.nonblock
                .store(fl & libc::O_NONBLOCK != 0, Ordering::Relaxed);
            // The kernel socket stays non-blocking for the engine.
            // SAFETY: F_SETFL with an int argument.
            unsafe { real(fd, cmd, (fl | libc::O_NONBLOCK) as usize) }
        }
        libc::F_GETFD => {
            // SAFETY: F_GETFD has no argument.
            let fl = unsafe { real(fd, cmd, 0) };
            if fl < 0 {
                return fl;
            }
            (fl & !libc::FD_CLOEXEC) | if slot.cloexec { libc::FD_CLOEXEC } else { 0 }
        }
        libc::F_SETFD => {
            let fl = arg as c_int;
            let _ = catch_unwind(|| conn::set_cloexec(fd, fl & libc::FD_CLOEXEC != 0));
            // Close-on-exec stays on in the kernel (see the crate docs).
            // SAFETY: F_SETFD with an int argument.
            unsafe { real(fd, cmd, (fl | libc::FD_CLOEXEC) as usize) }
        }
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            // SAFETY: forwarding the caller's arguments unchanged.
            let r = unsafe { real(fd, cmd, arg) };
            duplicated(fd, r, cmd == libc::F_DUPFD_CLOEXEC);
            r
        }
        // SAFETY: forwarding the caller's arguments unchanged.
        _ => unsafe { real(fd, cmd, arg) },
    }
}

/// `fcntl(2)`: `O_NONBLOCK` and `FD_CLOEXEC` of an offloaded descriptor
/// are the application's view; `F_DUPFD` duplicates the connection.
///
/// # Safety
/// As `fcntl(2)`; `arg` is the optional third argument.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let Some(real) = REAL_FCNTL.get() else {
        return fail(libc::ENOSYS);
    };
    fcntl_common(real, fd, cmd, arg)
}

/// `fcntl64`: as [`fcntl`].
///
/// # Safety
/// As `fcntl(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fcntl64(fd: c_int, cmd: c_int, arg: usize) -> c_int {
    let Some(real) = REAL_FCNTL64.get().or(REAL_FCNTL.get()) else {
        return fail(libc::ENOSYS);
    };
    fcntl_common(real, fd, cmd, arg)
}

/// `ioctl(2)`: `FIONBIO` sets the application's view of non-blocking mode;
/// `FIONREAD` reports the octets readable now; `FIOCLEX`/`FIONCLEX` set the
/// application's view of close-on-exec.
///
/// # Safety
/// As `ioctl(2)`; `arg` is the optional third argument.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ioctl(fd: c_int, req: c_ulong, arg: usize) -> c_int {
    if let Some(c) = conn::lookup(fd) {
        if req == libc::FIONBIO {
            let p = arg as *const c_int;
            if p.is_null() {
                return fail(libc::EFAULT);
            }
            // SAFETY: FIONBIO's argument points to an int.
            let on = unsafe { *p } != 0;
            c.nonblock.store(on, Ordering::Relaxed);
            return 0;
        }
        if req == libc::FIOCLEX || req == libc::FIONCLEX {
            // Close-on-exec stays on in the kernel (see the crate docs).
            let _ = catch_unwind(|| conn::set_cloexec(fd, req == libc::FIOCLEX));
            return 0;
        }
        if req == libc::FIONREAD {
            let p = arg as *mut c_int;
            if p.is_null() {
                return fail(libc::EFAULT);
            }
            return guard(|| {
                let mut buf = vec![0u8; 256 * 1024];
                let n = match c.stream()?.peek(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
                    Err(e) => return Err(conn::errno_of(&e)),
                };
                // SAFETY: FIONREAD's argument points to an int.
                unsafe { *p = c_int::try_from(n).unwrap_or(c_int::MAX) };
                Ok(0)
            });
        }
    }
    let Some(real) = REAL_IOCTL.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, req, arg) }
}

/// `setsockopt(2)`: on an offloaded socket `TCP_ULP` fails with
/// `ENOPROTOOPT` (TLS libraries then stay in user space), `TCP_NODELAY`,
/// `TCP_CORK`, `SO_RCVTIMEO` and `SO_SNDTIMEO` also apply to the offloaded
/// stream;
/// everything goes to the kernel socket as well.
///
/// An on/off socket option's `int` value: `EFAULT` for a null pointer,
/// `EINVAL` for a length shorter than an `int`, as the kernel answers.
///
/// # Safety
/// `val` is null or points to `len` readable bytes.
unsafe fn int_flag(val: *const c_void, len: socklen_t) -> Result<bool, c_int> {
    if val.is_null() {
        return Err(libc::EFAULT);
    }
    if (len as usize) < size_of::<c_int>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: not null and at least an `int` long (checked); read
    // unaligned, as the caller's buffer may be any bytes.
    Ok(unsafe { val.cast::<c_int>().read_unaligned() } != 0)
}

/// # Safety
/// As `setsockopt(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn setsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *const c_void,
    len: socklen_t,
) -> c_int {
    let Some(real) = REAL_SETSOCKOPT.get() else {
        return fail(libc::ENOSYS);
    };
    if let Some(c) = conn::lookup(fd) {
        if level == libc::IPPROTO_TCP && name == libc::TCP_ULP {
            return fail(libc::ENOPROTOOPT);
        }
        if level == libc::IPPROTO_TCP && name == libc::TCP_CORK {
            // The stream's only: corking the kernel socket would hold the
            // engine's own messages (credit updates, other data) too.
            // SAFETY: the caller's option value, as `setsockopt(2)` has it.
            let on = match unsafe { int_flag(val, len) } {
                Ok(on) => on,
                Err(e) => return fail(e),
            };
            return guard(|| {
                let s = c.stream()?;
                // The application's cork from now on (a MSG_MORE send's
                // cork is its own, or ends here).
                c.more.store(false, Ordering::Relaxed);
                c.auto.store(false, Ordering::Relaxed);
                s.set_cork(on)
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
                Ok(0)
            });
        }
        if level == libc::IPPROTO_TCP
            && name == libc::TCP_NODELAY
            && let Some(s) = c.switched()
        {
            // The stream's only: the kernel socket carries the engine's
            // framed messages and keeps the engine's TCP_NODELAY (turned
            // off, Nagle would hold them behind unacknowledged data).
            // SAFETY: the caller's option value, as `setsockopt(2)` has it.
            let on = match unsafe { int_flag(val, len) } {
                Ok(on) => on,
                Err(e) => return fail(e),
            };
            return guard(|| {
                s.set_nodelay(on)
                    .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
                Ok(0)
            });
        }
        // SAFETY: forwarding the caller's arguments unchanged.
        let r = unsafe { real(fd, level, name, val, len) };
        if r == 0 && !val.is_null() {
            let e = errno();
            let _ = catch_unwind(AssertUnwindSafe(|| {
                if level == libc::IPPROTO_TCP
                    && name == libc::TCP_NODELAY
                    && len as usize >= size_of::<c_int>()
                {
                    // SAFETY: TCP_NODELAY's value is an int, `len` checked;
                    // read unaligned, as the caller's buffer may be any bytes.
                    let on = unsafe { val.cast::<c_int>().read_unaligned() } != 0;
                    c.nodelay_set(on);
                    // A client's switch begun in `connect` takes it when
                    // it is finished (not finished by this call).
                    if !c.unfinished()
                        && let Ok(s) = c.stream()
                    {
                        let _ = s.set_nodelay(on);
                    }
                }
                if level == libc::SOL_SOCKET
                    && (name == libc::SO_RCVTIMEO || name == libc::SO_SNDTIMEO)
                    && len as usize >= size_of::<libc::timeval>()
                {
                    // SAFETY: the value is a timeval, `len` checked; read
                    // unaligned, as the caller's buffer may be any bytes.
                    let tv = unsafe { val.cast::<libc::timeval>().read_unaligned() };
                    let us = (tv.tv_sec.max(0) as u64) * 1_000_000 + tv.tv_usec.max(0) as u64;
                    let slot = if name == libc::SO_RCVTIMEO {
                        &c.rcvtimeo
                    } else {
                        &c.sndtimeo
                    };
                    slot.store(us, Ordering::Relaxed);
                }
            }));
            set_errno(e);
        }
        return r;
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, level, name, val, len) }
}

/// `getsockopt(2)`: the kernel socket's options (names, buffers,
/// `SO_ERROR` of the TCP connection); `TCP_ULP` on an offloaded socket
/// fails with `ENOPROTOOPT`.
///
/// # Safety
/// As `getsockopt(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn getsockopt(
    fd: c_int,
    level: c_int,
    name: c_int,
    val: *mut c_void,
    len: *mut socklen_t,
) -> c_int {
    if level == libc::IPPROTO_TCP && name == libc::TCP_ULP && conn::lookup(fd).is_some() {
        return fail(libc::ENOPROTOOPT);
    }
    if level == libc::IPPROTO_TCP
        && name == libc::TCP_CORK
        && let Some(c) = conn::lookup(fd)
    {
        if val.is_null() || len.is_null() {
            return fail(libc::EFAULT);
        }
        let on: c_int = match catch_unwind(AssertUnwindSafe(|| {
            c.stream()?
                .cork()
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))
        })) {
            // A MSG_MORE send's cork is not the option's (as the kernel's).
            Ok(Ok(v)) => {
                c_int::from(v && !c.more.load(Ordering::Relaxed) && !c.auto.load(Ordering::Relaxed))
            }
            Ok(Err(e)) => return fail(e),
            Err(_) => return fail(libc::EIO),
        };
        // SAFETY: the caller's `len` slot and `val` of `*len` bytes, as
        // getsockopt(2) writes them (a shorter buffer gets the first bytes).
        unsafe {
            let room = (*len as usize).min(size_of::<c_int>());
            std::ptr::copy_nonoverlapping((&raw const on).cast::<u8>(), val.cast::<u8>(), room);
            *len = room as socklen_t;
        }
        return 0;
    }
    if level == libc::IPPROTO_TCP
        && name == libc::TCP_NODELAY
        && let Some(c) = conn::lookup(fd)
        && (c.switched().is_some() || c.begun())
    {
        if val.is_null() || len.is_null() {
            return fail(libc::EFAULT);
        }
        // A client's switch begun in `connect`: the application's setting
        // (the kernel socket has the switch's).
        let on: c_int = match catch_unwind(AssertUnwindSafe(|| match c.switched() {
            Some(s) => s.nodelay(),
            None => Ok(c.pending_nodelay().unwrap_or(false)),
        })) {
            Ok(Ok(v)) => c_int::from(v),
            Ok(Err(e)) => return fail(e.raw_os_error().unwrap_or(libc::EIO)),
            Err(_) => return fail(libc::EIO),
        };
        // SAFETY: as for TCP_CORK above.
        unsafe {
            let room = (*len as usize).min(size_of::<c_int>());
            std::ptr::copy_nonoverlapping((&raw const on).cast::<u8>(), val.cast::<u8>(), room);
            *len = room as socklen_t;
        }
        return 0;
    }
    let Some(real) = REAL_GETSOCKOPT.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, level, name, val, len) }
}

/// `socketpair(2)`: pairs made while setting up an offloaded connection
/// (its readiness and wake-up sockets) get high descriptor numbers.
///
/// # Safety
/// As `socketpair(2)`: `sv` points to two ints.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn socketpair(
    domain: c_int,
    ty: c_int,
    proto: c_int,
    sv: *mut c_int,
) -> c_int {
    let Some(real) = REAL_SOCKETPAIR.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(domain, ty, proto, sv) };
    if r == 0 && !sv.is_null() && conn::internal() {
        // SAFETY: the kernel filled both ints.
        unsafe {
            *sv = conn::move_high(*sv);
            *sv.add(1) = conn::move_high(*sv.add(1));
        }
    }
    r
}

/// `eventfd(2)`: as [`socketpair`], high numbers during a set-up.
///
/// # Safety
/// As `eventfd(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn eventfd(init: libc::c_uint, flags: c_int) -> c_int {
    let Some(real) = REAL_EVENTFD.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(init, flags) };
    conn::move_high(r)
}
