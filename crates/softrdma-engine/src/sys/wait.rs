//! Waiting for one socket's readiness with `poll(2)`, for the blocking
//! handshake calls of the connection manager.

use super::clock;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::Duration;

/// The readiness a handshake waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Readiness {
    /// Octets to read (or the end of the stream).
    Read,
    /// Room to write (or a connect that finished).
    Write,
}

/// Waits until `fd` has `r` (or an error/hang-up) or `timeout` passed.
/// Returns whether it is ready. Interrupted waits resume with the time
/// left.
///
/// # Errors
///
/// The error of `poll(2)` other than `EINTR`.
pub(crate) fn wait_ready(fd: BorrowedFd<'_>, r: Readiness, timeout: Duration) -> io::Result<bool> {
    let deadline = clock::now().checked_add(timeout);
    let events = match r {
        Readiness::Read => libc::POLLIN,
        Readiness::Write => libc::POLLOUT,
    };
    loop {
        let left = deadline.map_or(Duration::from_secs(86_400), |d| {
            d.saturating_duration_since(clock::now())
        });
        let ms =
            libc::c_int::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(libc::c_int::MAX);
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events,
            revents: 0,
        };
        // SAFETY: `pfd` is one valid, writable pollfd for the duration of
        // the call, and the count says 1.
        let n = unsafe { libc::poll(&raw mut pfd, 1, ms) };
        if n > 0 {
            return Ok(true);
        }
        if n == 0 {
            if ms == 0 {
                return Ok(false);
            }
            continue;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
