//! Readiness of offloaded descriptors: poll, ppoll, select, pselect and
//! epoll.
//!
//! Every offloaded connection has a readiness descriptor (a datagram
//! socket the sockets-direct library keeps readable when data, end of
//! stream or an error is there, and writable when a write would not
//! block). poll and select wait on it in place of the application's
//! descriptor and report the result under the application's descriptor.
//! `epoll_ctl` registers the readiness descriptor in the application's own
//! epoll instance with the application's event data, so the kernel's
//! edge-triggered, one-shot and level-triggered rules apply unchanged and
//! `epoll_wait`/`epoll_pwait` need no interposition.

use libc::{c_int, nfds_t, pollfd};

use crate::conn;
use crate::real::*;

/// The readiness descriptor to wait on for `fd` (itself if not offloaded).
fn target(fd: c_int) -> c_int {
    match conn::lookup(fd) {
        Some(c) => {
            let r = c.readiness();
            if r >= 0 { r } else { fd }
        }
        None => fd,
    }
}

/// Runs `f` on a copy of `fds` with offloaded descriptors replaced, then
/// copies the results back.
///
/// # Safety
/// `fds` points to `n` pollfds (or is null with `n` 0).
unsafe fn with_poll_fds(
    fds: *mut pollfd,
    n: nfds_t,
    f: impl FnOnce(*mut pollfd, nfds_t) -> c_int,
) -> c_int {
    if !conn::any() || fds.is_null() || n == 0 {
        return f(fds, n);
    }
    // SAFETY: the caller's array.
    let app = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    if !app.iter().any(|p| conn::lookup(p.fd).is_some()) {
        return f(fds, n);
    }
    let mut mine: Vec<pollfd> = app
        .iter()
        .map(|p| pollfd {
            fd: if p.fd >= 0 { target(p.fd) } else { p.fd },
            events: p.events,
            revents: 0,
        })
        .collect();
    let r = f(mine.as_mut_ptr(), n);
    let e = errno();
    for (a, m) in app.iter_mut().zip(&mine) {
        a.revents = m.revents;
    }
    set_errno(e);
    r
}

/// `poll(2)`.
///
/// # Safety
/// As `poll(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn poll(fds: *mut pollfd, n: nfds_t, timeout: c_int) -> c_int {
    let Some(real) = REAL_POLL.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: the caller's array, and the real poll on it or our copy.
    unsafe { with_poll_fds(fds, n, |p, n| real(p, n, timeout)) }
}

/// `__poll_chk` (fortified `poll`).
///
/// # Safety
/// As `poll(2)`; `fdslen` is the size of the array in octets.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __poll_chk(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: c_int,
    fdslen: usize,
) -> c_int {
    if (fdslen / size_of::<pollfd>()) < n as usize {
        unsafe extern "C" {
            fn __chk_fail() -> !;
        }
        // SAFETY: glibc's fortify failure handler.
        unsafe { __chk_fail() }
    }
    // SAFETY: as poll.
    unsafe { poll(fds, n, timeout) }
}

/// `ppoll(2)`.
///
/// # Safety
/// As `ppoll(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ppoll(
    fds: *mut pollfd,
    n: nfds_t,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some(real) = REAL_PPOLL.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: the caller's array, and the real ppoll on it or our copy.
    unsafe { with_poll_fds(fds, n, |p, n| real(p, n, ts, mask)) }
}

/// New nfds, (application fd, readiness fd) pairs, and the mapped sets.
type Mapped = (c_int, Vec<(c_int, c_int)>, [libc::fd_set; 3]);

/// Maps the fd_sets: every offloaded descriptor set in one of them is
/// replaced by its readiness descriptor; returns the new nfds and the
/// (application fd, readiness fd) pairs, or `None` if nothing changes.
fn map_sets(nfds: c_int, sets: [*mut libc::fd_set; 3]) -> Option<Mapped> {
    if !conn::any() || nfds <= 0 {
        return None;
    }
    let limit = nfds.min(libc::FD_SETSIZE as c_int);
    let mut pairs = Vec::new();
    for fd in 0..limit {
        // SAFETY: FD_ISSET on the caller's sets, fd < FD_SETSIZE.
        let used = sets
            .iter()
            .any(|s| !s.is_null() && unsafe { libc::FD_ISSET(fd, *s) });
        if used && conn::lookup(fd).is_some() {
            let t = target(fd);
            if t != fd && (t as usize) < libc::FD_SETSIZE {
                pairs.push((fd, t));
            }
        }
    }
    if pairs.is_empty() {
        return None;
    }
    // SAFETY: fd_set is plain data.
    let mut copies: [libc::fd_set; 3] = unsafe { std::mem::zeroed() };
    let mut n = nfds;
    for (i, s) in sets.iter().enumerate() {
        if s.is_null() {
            continue;
        }
        // SAFETY: the caller's set.
        copies[i] = unsafe { **s };
        for &(a, t) in &pairs {
            // SAFETY: both below FD_SETSIZE.
            unsafe {
                if libc::FD_ISSET(a, &raw const copies[i]) {
                    libc::FD_CLR(a, &raw mut copies[i]);
                    // Exceptional conditions (urgent data) never happen
                    // on an offloaded stream.
                    if i < 2 {
                        libc::FD_SET(t, &raw mut copies[i]);
                    }
                }
            }
            n = n.max(t + 1);
        }
    }
    Some((n, pairs, copies))
}

/// Writes the results of a select on the copies back to the caller's sets.
fn unmap_sets(
    sets: [*mut libc::fd_set; 3],
    pairs: &[(c_int, c_int)],
    copies: &mut [libc::fd_set; 3],
) {
    for (i, s) in sets.iter().enumerate() {
        if s.is_null() {
            continue;
        }
        for &(a, t) in pairs {
            // SAFETY: both below FD_SETSIZE.
            unsafe {
                let was = libc::FD_ISSET(t, &raw const copies[i]);
                libc::FD_CLR(t, &raw mut copies[i]);
                if was {
                    libc::FD_SET(a, &raw mut copies[i]);
                }
            }
        }
        // SAFETY: the caller's set.
        unsafe { **s = copies[i] };
    }
}

/// Number of descriptors set in the (mapped back) sets, as select counts.
fn count_sets(nfds: c_int, sets: [*mut libc::fd_set; 3]) -> c_int {
    let mut n = 0;
    for s in sets.iter().filter(|s| !s.is_null()) {
        for fd in 0..nfds.min(libc::FD_SETSIZE as c_int) {
            // SAFETY: the caller's set, fd < FD_SETSIZE.
            if unsafe { libc::FD_ISSET(fd, *s) } {
                n += 1;
            }
        }
    }
    n
}

/// `select(2)`.
///
/// # Safety
/// As `select(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn select(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    x: *mut libc::fd_set,
    tv: *mut libc::timeval,
) -> c_int {
    let Some(real) = REAL_SELECT.get() else {
        return fail(libc::ENOSYS);
    };
    let sets = [r, w, x];
    let Some((n, pairs, mut copies)) = map_sets(nfds, sets) else {
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real(nfds, r, w, x, tv) };
    };
    let p = |i: usize, c: &mut [libc::fd_set; 3]| {
        if sets[i].is_null() {
            std::ptr::null_mut()
        } else {
            &raw mut c[i]
        }
    };
    let (a, b, c) = (p(0, &mut copies), p(1, &mut copies), p(2, &mut copies));
    // SAFETY: our copies of the sets and the caller's timeout.
    let ret = unsafe { real(n, a, b, c, tv) };
    if ret <= 0 {
        return ret;
    }
    let e = errno();
    unmap_sets(sets, &pairs, &mut copies);
    set_errno(e);
    count_sets(nfds, sets)
}

/// `pselect(2)`.
///
/// # Safety
/// As `pselect(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pselect(
    nfds: c_int,
    r: *mut libc::fd_set,
    w: *mut libc::fd_set,
    x: *mut libc::fd_set,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    let Some(real) = REAL_PSELECT.get() else {
        return fail(libc::ENOSYS);
    };
    let sets = [r, w, x];
    let Some((n, pairs, mut copies)) = map_sets(nfds, sets) else {
        // SAFETY: forwarding the caller's arguments unchanged.
        return unsafe { real(nfds, r, w, x, ts, mask) };
    };
    let p = |i: usize, c: &mut [libc::fd_set; 3]| {
        if sets[i].is_null() {
            std::ptr::null_mut()
        } else {
            &raw mut c[i]
        }
    };
    let (a, b, c) = (p(0, &mut copies), p(1, &mut copies), p(2, &mut copies));
    // SAFETY: our copies of the sets and the caller's timeout and mask.
    let ret = unsafe { real(n, a, b, c, ts, mask) };
    if ret <= 0 {
        return ret;
    }
    let e = errno();
    unmap_sets(sets, &pairs, &mut copies);
    set_errno(e);
    count_sets(nfds, sets)
}

/// `epoll_ctl(2)`: an offloaded descriptor is registered as its readiness
/// descriptor (with the application's event mask and data).
///
/// # Safety
/// As `epoll_ctl(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    ev: *mut libc::epoll_event,
) -> c_int {
    let Some(real) = REAL_EPOLL_CTL.get() else {
        return fail(libc::ENOSYS);
    };
    let fd = if conn::any() { target(fd) } else { fd };
    // SAFETY: forwarding the caller's arguments (descriptor mapped).
    unsafe { real(epfd, op, fd, ev) }
}
