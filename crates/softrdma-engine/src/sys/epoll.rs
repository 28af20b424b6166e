//! A private epoll instance for [`crate::wait_set`]: registrations that
//! persist across waits, and a wait with the caller's signal mask
//! (`epoll_pwait(2)`).
//!
//! The calls are made as raw system calls, not through the C library's
//! functions: a library that interposes the epoll functions (the sockets
//! preload, which keeps the application's epoll registrations of
//! offloaded connections itself and treats an epoll instance added to
//! another as nested) must not see this instance, which is the engine's
//! own and never the application's.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Once;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// An epoll instance owned by one wait set (closed on drop).
#[derive(Debug)]
pub(crate) struct Epoll {
    fd: OwnedFd,
}

impl Epoll {
    /// A new instance (close-on-exec).
    pub(crate) fn new() -> io::Result<Epoll> {
        // SAFETY: epoll_create1 takes no pointers; it returns a new
        // descriptor or -1.
        let raw = unsafe { libc::syscall(libc::SYS_epoll_create1, libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        let raw = RawFd::try_from(raw).map_err(|_| io::Error::from_raw_os_error(libc::EMFILE))?;
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(Epoll { fd })
    }

    /// Leaves the descriptor open: it was closed by someone else, and its
    /// number may name another file by now.
    pub(crate) fn forget(self) {
        std::mem::forget(self.fd);
    }

    /// `epoll_ctl(2)` of `fd` with `events` and `data`; `Err(errno)` on
    /// failure (`ENOENT`, `EEXIST`, `EBADF`, `EPERM`, ...).
    pub(crate) fn ctl(
        &self,
        op: libc::c_int,
        fd: RawFd,
        events: u32,
        data: u64,
    ) -> Result<(), i32> {
        let mut ev = libc::epoll_event { events, u64: data };
        // SAFETY: `ev` is a valid event that outlives the call; a closed
        // or reused `fd` is the kernel's to check (EBADF, or the new
        // file), never memory of ours.
        let r = unsafe {
            libc::syscall(
                libc::SYS_epoll_ctl,
                self.fd.as_raw_fd(),
                op,
                fd,
                &raw mut ev,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO));
        }
        Ok(())
    }

    /// Waits at most `timeout` (rounded up to a millisecond; `None`: until
    /// an event or a signal, with no kernel timer) with the
    /// signal mask `mask` in force during the wait; fills `buf` and returns
    /// how many events it holds. A signal handled meanwhile is
    /// `ErrorKind::Interrupted`.
    pub(crate) fn wait(
        &self,
        buf: &mut [libc::epoll_event],
        timeout: Option<Duration>,
        mask: Option<&libc::sigset_t>,
    ) -> io::Result<usize> {
        // `None`: -1, a sleep with no kernel timer.
        let ms = timeout.map_or(-1, |t| {
            libc::c_int::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(libc::c_int::MAX)
        });
        let max = libc::c_int::try_from(buf.len().max(1)).unwrap_or(libc::c_int::MAX);
        if buf.is_empty() {
            return Ok(0);
        }
        let mask_ptr = mask.map_or(std::ptr::null(), std::ptr::from_ref);
        // SAFETY: `buf` has room for `max` events and lives across the
        // call; `mask_ptr` is null or the caller's mask, valid for the call
        // (the kernel reads its first `KERNEL_SIGSET` octets, the size
        // glibc's epoll_pwait passes).
        let r = unsafe {
            libc::syscall(
                libc::SYS_epoll_pwait,
                self.fd.as_raw_fd(),
                buf.as_mut_ptr(),
                max,
                ms,
                mask_ptr,
                KERNEL_SIGSET,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(usize::try_from(r).unwrap_or(0))
    }
}

/// The kernel's signal set size (`_NSIG / 8`), the last argument of the
/// `epoll_pwait` system call.
const KERNEL_SIGSET: libc::size_t = 8;

static FORKS: AtomicU64 = AtomicU64::new(0);
static AT_FORK: Once = Once::new();

extern "C" fn forked_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Counts the `fork(2)`s this process came from (in the child): an epoll
/// instance made before a fork is shared with the parent and must not be
/// used (nor changed) by the child.
pub(crate) fn fork_generation() -> u64 {
    AT_FORK.call_once(|| {
        // SAFETY: registers a handler that only increments an atomic
        // (async-signal-safe); no pointers but the function's.
        unsafe {
            libc::pthread_atfork(None, None, Some(forked_child));
        }
    });
    FORKS.load(Ordering::Relaxed)
}
