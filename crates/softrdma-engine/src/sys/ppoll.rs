//! `ppoll(2)` with the caller's signal mask, for [`crate::wait_set`].

use std::io;
use std::time::Duration;

/// Waits on `fds` (their `revents` are written) for at most `timeout`
/// (`None`: no limit) with the signal mask `mask` in force during the
/// wait, as `ppoll(2)` does; returns how many entries have events.
/// A signal handled meanwhile is `ErrorKind::Interrupted`.
pub(crate) fn ppoll(
    fds: &mut [libc::pollfd],
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
) -> io::Result<usize> {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: libc::time_t::try_from(t.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(t.subsec_nanos() as i32),
    });
    let n = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
    let ts_ptr = ts.as_ref().map_or(std::ptr::null(), std::ptr::from_ref);
    let mask_ptr = mask.map_or(std::ptr::null(), std::ptr::from_ref);
    // SAFETY: `fds` is a valid array of `n` pollfd entries that lives
    // across the call (the kernel writes only their `revents`); `ts_ptr`
    // and `mask_ptr` are null or point to locals / the caller's mask that
    // outlive the call.
    let r = unsafe { libc::ppoll(fds.as_mut_ptr(), n, ts_ptr, mask_ptr) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(r).unwrap_or(0))
}
