//! Helpers of the C boundary: errno, panic guards, signal masks, the
//! process-wide engine device and the fork handler.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use softrdma_engine::Device;

/// Sets the calling thread's `errno`.
pub fn set_errno(e: i32) {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Runs `f`; a panic becomes `on_panic` (never unwinds into C).
pub fn guard<T>(on_panic: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(_) => {
            set_errno(libc::EIO);
            on_panic
        }
    }
}

/// For functions returning an errno (0 on success).
pub fn guard_errno(f: impl FnOnce() -> Result<(), i32>) -> i32 {
    guard(libc::EIO, || match f() {
        Ok(()) => 0,
        Err(e) => e,
    })
}

/// For functions returning 0, or -1 with errno set.
pub fn guard_neg(f: impl FnOnce() -> Result<(), i32>) -> i32 {
    guard(-1, || match f() {
        Ok(()) => 0,
        Err(e) => {
            set_errno(e);
            -1
        }
    })
}

/// For functions returning a pointer, or NULL with errno set.
pub fn guard_ptr<T>(f: impl FnOnce() -> Result<*mut T, i32>) -> *mut T {
    guard(std::ptr::null_mut(), || match f() {
        Ok(p) => p,
        Err(e) => {
            set_errno(e);
            std::ptr::null_mut()
        }
    })
}

/// Runs `f` with every signal blocked in the calling thread, so that the
/// threads it starts (engine, connection manager) inherit a full mask and
/// never take the application's signals (perftest's SIGALRM, ...).
pub fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: plain sigset manipulation on local storage; pthread_sigmask
    // only changes the calling thread's mask, restored below.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        let r = catch_unwind(AssertUnwindSafe(f));
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        match r {
            Ok(v) => v,
            Err(p) => std::panic::resume_unwind(p),
        }
    }
}

/// Bumped in the child of every fork: state of the parent is not used
/// there.
static FORK_GEN: AtomicU64 = AtomicU64::new(0);
static ENGINE: Mutex<Option<(u64, Device)>> = Mutex::new(None);
static ATFORK: Once = Once::new();

extern "C" fn atfork_child() {
    FORK_GEN.fetch_add(1, Ordering::SeqCst);
}

/// How many forks the process has gone through (in this process's line).
pub fn fork_generation() -> u64 {
    FORK_GEN.load(Ordering::SeqCst)
}

/// The process-wide engine device, opened (threads started) on first use,
/// never at load time. After a fork the child opens a fresh device on first
/// use; objects inherited from the parent must not be used in the child
/// (as with kernel verbs without `ibv_fork_init`).
pub fn engine() -> Result<Device, i32> {
    ATFORK.call_once(|| {
        // SAFETY: registering a handler that only touches an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(atfork_child)) };
    });
    let generation = FORK_GEN.load(Ordering::SeqCst);
    let mut g = ENGINE.lock();
    if let Some((g0, d)) = g.as_ref()
        && *g0 == generation
    {
        return Ok(d.clone());
    }
    if let Some((_, old)) = g.take() {
        // The parent's device: its threads do not exist here; never drop
        // it (dropping would wait for them).
        std::mem::forget(old);
    }
    let mut config = softrdma_engine::DeviceConfig::default();
    // Not pinned unless asked: the engine's threads share the CPUs of a
    // process that has its own plans for them.
    config.pin_threads = std::env::var("SOFTRDMA_PIN_THREADS").is_ok_and(|v| v == "1");
    if let Ok(n) = std::env::var("SOFTRDMA_THREADS")
        && let Ok(n) = n.parse::<usize>()
        && n > 0
    {
        config.datamover_cpus = (0..n).collect();
        config.handler_cpus = (0..n).collect();
    }
    let dev = with_signals_blocked(|| Device::open_with(config)).map_err(|_| libc::ENODEV)?;
    *g = Some((generation, dev.clone()));
    Ok(dev)
}

/// Copies `s` into a C char array, NUL-terminated, truncating.
pub fn copy_cstr(dst: &mut [core::ffi::c_char], s: &str) {
    let n = s.len().min(dst.len().saturating_sub(1));
    for (d, b) in dst.iter_mut().zip(s.as_bytes()[..n].iter()) {
        *d = *b as core::ffi::c_char;
    }
    if let Some(d) = dst.get_mut(n) {
        *d = 0;
    }
}

/// An `eventfd` in semaphore mode, blocking unless the application sets
/// `O_NONBLOCK` on it: the descriptor of completion channels, async events
/// and CM event channels.
#[derive(Debug)]
pub struct SemFd(pub i32);

impl SemFd {
    /// A new descriptor.
    pub fn new() -> Result<SemFd, i32> {
        // SAFETY: eventfd has no memory arguments.
        let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if fd < 0 { Err(errno()) } else { Ok(SemFd(fd)) }
    }

    /// Adds one token (makes the descriptor readable).
    pub fn post(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local.
        unsafe { libc::write(self.0, (&raw const one).cast(), 8) };
    }

    /// Takes one token: blocks while none, or EAGAIN if the descriptor is
    /// non-blocking; EINTR is returned to the caller like a kernel read.
    pub fn wait(&self) -> Result<(), i32> {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a local.
        let r = unsafe { libc::read(self.0, (&raw mut v).cast(), 8) };
        if r == 8 { Ok(()) } else { Err(errno()) }
    }
}

impl Drop for SemFd {
    fn drop(&mut self) {
        // SAFETY: we own the descriptor.
        unsafe { libc::close(self.0) };
    }
}

/// The calling thread's errno.
pub fn errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// Writes `f()` to stderr when `SOFTRDMA_VERBS_DEBUG` is set.
pub fn debug(f: impl FnOnce() -> String) {
    static ON: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let Some(to) = ON.get_or_init(|| std::env::var("SOFTRDMA_VERBS_DEBUG").ok()) else {
        return;
    };
    let line = format!("softrdma-verbs[{}]: {}\n", std::process::id(), f());
    // A path: append there (some programs close stderr); else stderr.
    if to.starts_with('/') {
        use std::io::Write as _;
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(to)
        {
            let _ = file.write_all(line.as_bytes());
        }
    } else {
        eprint!("{line}");
    }
}
