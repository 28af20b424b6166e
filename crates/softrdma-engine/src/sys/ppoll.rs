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

/// [`ppoll`] without a signal mask, for a timeout of whole milliseconds
/// (`None`: no limit): `poll(2)`, which neither copies a `timespec` in
/// nor writes the time left back out as `ppoll(2)` does (a clock read
/// and two copies per call). Other timeouts go to `ppoll(2)`.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<usize> {
    let ms = match timeout {
        None => Some(-1),
        Some(t) if t.subsec_nanos() % 1_000_000 == 0 => libc::c_int::try_from(t.as_millis()).ok(),
        Some(_) => None,
    };
    let Some(ms) = ms else {
        return ppoll(fds, timeout, None);
    };
    let n = libc::nfds_t::try_from(fds.len()).unwrap_or(libc::nfds_t::MAX);
    // SAFETY: `fds` is a valid array of `n` pollfd entries that lives
    // across the call (the kernel writes only their `revents`).
    let r = unsafe { libc::poll(fds.as_mut_ptr(), n, ms) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(r).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;

    fn pfd(s: &UnixStream) -> libc::pollfd {
        libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        }
    }

    /// Whole milliseconds, a zero and a fractional timeout all report a
    /// readable descriptor, and a quiet one times out with nothing.
    #[test]
    fn poll_reports_like_ppoll_for_every_kind_of_timeout() {
        let (a, mut b) = UnixStream::pair().unwrap();
        for t in [
            Duration::ZERO,
            Duration::from_millis(1),
            Duration::from_micros(1500),
        ] {
            let mut fds = [pfd(&a)];
            assert_eq!(poll(&mut fds, Some(t)).unwrap(), 0, "{t:?}");
            assert_eq!(fds[0].revents, 0);
        }
        b.write_all(b"x").unwrap();
        for t in [
            None,
            Some(Duration::ZERO),
            Some(Duration::from_millis(50)),
            Some(Duration::from_micros(1500)),
        ] {
            let mut fds = [pfd(&a)];
            assert_eq!(poll(&mut fds, t).unwrap(), 1, "{t:?}");
            assert_eq!(fds[0].revents & libc::POLLIN, libc::POLLIN);
        }
    }
}
