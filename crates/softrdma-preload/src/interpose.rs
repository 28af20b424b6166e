//! The interposed C entry points and the process-wide state behind them.
//!
//! Each entry point resolves the real function with `dlsym(RTLD_NEXT)` on
//! first use, makes its decision in Rust under `catch_unwind`, and restores
//! `errno` to what the real call set before returning.

use std::ffi::CStr;
use std::io::Write as _;
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_int, sockaddr, socklen_t};

use crate::policy::{Mode, Policy, Role};
use crate::stats::{PlainReason, Stats, json_line};

/// A real libc function, found with `dlsym(RTLD_NEXT)` on first use.
struct Real<F> {
    addr: AtomicUsize,
    name: &'static CStr,
    _f: PhantomData<F>,
}

impl<F: Copy> Real<F> {
    const fn new(name: &'static CStr) -> Real<F> {
        Real {
            addr: AtomicUsize::new(0),
            name,
            _f: PhantomData,
        }
    }

    fn get(&self) -> Option<F> {
        const { assert!(size_of::<F>() == size_of::<usize>()) };
        let mut a = self.addr.load(Ordering::Relaxed);
        if a == 0 {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the
            // definition after this library's (libc's).
            a = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
            if a == 0 {
                return None;
            }
            self.addr.store(a, Ordering::Relaxed);
        }
        // SAFETY: `F` is the `extern "C" fn` type of the symbol named
        // `self.name` (each `Real` is declared with its C prototype below),
        // and the assertion above checks it is pointer-sized.
        Some(unsafe { std::mem::transmute_copy::<usize, F>(&a) })
    }
}

type ConnectFn = unsafe extern "C" fn(c_int, *const sockaddr, socklen_t) -> c_int;
type AcceptFn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
type Accept4Fn = unsafe extern "C" fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;

static REAL_CONNECT: Real<ConnectFn> = Real::new(c"connect");
static REAL_ACCEPT: Real<AcceptFn> = Real::new(c"accept");
static REAL_ACCEPT4: Real<Accept4Fn> = Real::new(c"accept4");

/// Process-wide state, made on the first interposed call.
struct State {
    policy: Policy,
    program: String,
    exe: String,
    stats: Stats,
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
}

static ENV: OnceLock<Env> = OnceLock::new();

fn read_env() -> Env {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    Env {
        mode: var("SOFTRDMA_SOCKETS").map(|m| m.to_string_lossy().into_owned()),
        conf: var("SOFTRDMA_SOCKETS_CONF"),
        stats: var("SOFTRDMA_SOCKETS_STATS"),
    }
}

/// Runs when the library is loaded: copies three environment variables,
/// nothing else.
extern "C" fn capture_env() {
    let _ = catch_unwind(|| ENV.get_or_init(read_env));
}

#[used]
#[unsafe(link_section = ".init_array")]
static CAPTURE_ENV: extern "C" fn() = capture_env;

fn state() -> &'static State {
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
        // fork; it only stores to atomics (no lock another thread could
        // have held at the fork).
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
    });
}

extern "C" fn write_stats() {
    let _ = catch_unwind(|| {
        let Some(s) = STATE.get() else { return };
        let Some(path) = &s.stats_file else { return };
        let line = json_line(std::process::id(), &s.exe, &s.stats.snapshot()) + "\n";
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

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
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

/// What to do with a new connection.
enum Verdict {
    /// Not a TCP connection over IP: not ours to count.
    NotTcp,
    /// Stays plain TCP.
    Plain(PlainReason),
    /// Offload required but not possible: refuse.
    Refuse,
}

fn verdict(role: Role, fd: c_int, target: Option<(IpAddr, u16)>) -> Verdict {
    let Some((ip, port)) = target else {
        return Verdict::NotTcp;
    };
    if !is_stream(fd) {
        return Verdict::NotTcp;
    }
    let s = state();
    match s.policy.decide(&s.program, role, ip, port) {
        Mode::Tcp => Verdict::Plain(PlainReason::Policy),
        Mode::Auto => Verdict::Plain(PlainReason::NoOffloadProtocol),
        Mode::Offload => Verdict::Refuse,
    }
}

fn count(v: &Verdict) {
    match v {
        Verdict::NotTcp => {}
        Verdict::Plain(why) => state().stats.plain(*why),
        Verdict::Refuse => state().stats.refused(),
    }
}

/// `connect(2)`: the policy decides before the real connect; a connection
/// that must be offloaded but cannot is refused with `EOPNOTSUPP`.
///
/// # Safety
/// As `connect(2)`: `addr` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn connect(fd: c_int, addr: *const sockaddr, len: socklen_t) -> c_int {
    let Some(real) = REAL_CONNECT.get() else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    let v = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller's guarantee for `addr`/`len`.
        verdict(Role::Client, fd, unsafe { ip_port(addr, len) })
    }))
    .unwrap_or(Verdict::NotTcp);
    if matches!(v, Verdict::Refuse) {
        let _ = catch_unwind(|| {
            count(&v);
            eprintln!(
                "softrdma-preload: connection refused: the policy requires offload, and no offload protocol is available"
            );
        });
        set_errno(libc::EOPNOTSUPP);
        return -1;
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    let r = unsafe { real(fd, addr, len) };
    let e = errno();
    if r == 0 || e == libc::EINPROGRESS {
        let _ = catch_unwind(AssertUnwindSafe(|| count(&v)));
    }
    set_errno(e);
    r
}

/// Bookkeeping for an accepted connection `fd` (when it is one).
fn on_accepted(fd: c_int) -> c_int {
    if fd < 0 {
        return fd;
    }
    let e = errno();
    let refused = catch_unwind(|| {
        let v = verdict(Role::Server, fd, local_ip_port(fd));
        count(&v);
        matches!(v, Verdict::Refuse)
    })
    .unwrap_or(false);
    if refused {
        // The client is told by a reset; the application never sees it.
        // SAFETY: closing the descriptor the real accept just returned.
        unsafe { libc::close(fd) };
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
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    on_accepted(unsafe { real(fd, addr, len) })
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
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    on_accepted(unsafe { real(fd, addr, len, flags) })
}
