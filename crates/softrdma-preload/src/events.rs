//! Readiness of offloaded descriptors: poll, ppoll, select, pselect and
//! epoll.
//!
//! poll, ppoll, select and pselect wait in the engine when the call
//! includes an offloaded descriptor (`softrdma_sockets::poll`): the thread
//! sleeps in one `ppoll(2)` on the other descriptors and on the offloaded
//! connections' own sockets, and when bytes come it runs the receive path
//! and SDP itself, so an event loop is woken by the bytes on the wire with
//! no engine thread in between. The results are reported under the
//! application's descriptors, with `poll(2)`'s and `select(2)`'s rules
//! (level-triggered; `EINTR` on a signal, never restarted).
//!
//! epoll: every offloaded connection registered in an epoll instance has
//! a readiness descriptor (a datagram socket the sockets-direct library
//! keeps readable when data, end of stream or an error is there, and
//! writable when a write would not block); `epoll_ctl` registers it in the
//! application's epoll instance with the application's event data, so the
//! kernel's edge-triggered, one-shot and level-triggered rules apply
//! unchanged. `epoll_wait`, `epoll_pwait` and `epoll_pwait2` on an
//! instance holding offloaded connections look at the instance without
//! waiting; if nothing is there they sleep in the engine on the instance
//! and on the connections (as poll does), bring the readiness descriptors
//! of connections that received something up to date, and look again:
//! what they return is always what the kernel's instance reports.
//!
//! `SOFTRDMA_SOCKETS_WAIT=kernel` restores the kernel wait on readiness
//! descriptors everywhere (the engine's receive and completion threads
//! then carry every message; for comparison).

use std::panic::catch_unwind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, RwLock, Weak};
use std::time::{Duration, Instant};

use libc::{c_int, nfds_t, pollfd};
use softrdma_sockets::poll::{self as sdpoll, PollEntry};

use crate::conn::{self, Conn};
use crate::interpose::{engine_wait, guard};
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
    crate::autocork::end_burst();
    let Some(real) = REAL_POLL.get() else {
        return fail(libc::ENOSYS);
    };
    let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: the caller's array.
    if let Some(r) = unsafe { engine_poll(fds, n, t, std::ptr::null()) } {
        return r;
    }
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
    crate::autocork::end_burst();
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
    crate::autocork::end_burst();
    let Some(real) = REAL_PPOLL.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: the caller's timeout, if not null.
    if let Some(t) = unsafe { duration_ts(ts) } {
        // SAFETY: the caller's array and mask.
        if let Some(r) = unsafe { engine_poll(fds, n, t, mask) } {
            return r;
        }
    }
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
    crate::autocork::end_burst();
    let Some(real) = REAL_SELECT.get() else {
        return fail(libc::ENOSYS);
    };
    let sets = [r, w, x];
    // `Some(None)`: no timeout (wait until ready), as `duration_ts`; `None`:
    // an invalid timeout, left to the real call (`EINVAL`).
    let t = if tv.is_null() {
        Some(None)
    } else {
        // SAFETY: not null, the caller's timeout.
        let v = unsafe { *tv };
        (v.tv_sec >= 0 && (0..1_000_000).contains(&v.tv_usec))
            .then(|| Some(Duration::new(v.tv_sec as u64, v.tv_usec as u32 * 1000)))
    };
    if let Some(t) = t {
        let start = Instant::now();
        // SAFETY: the caller's sets.
        if let Some(ret) = unsafe { engine_select(nfds, sets, t, std::ptr::null()) } {
            if let Some(t) = t {
                // Linux leaves the time not slept in the timeout.
                let left = t.saturating_sub(start.elapsed());
                // SAFETY: the caller's timeout (not null: `t` is set).
                unsafe {
                    (*tv).tv_sec = left.as_secs() as libc::time_t;
                    (*tv).tv_usec = libc::suseconds_t::from(left.subsec_micros());
                }
            }
            return ret;
        }
    }
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
    crate::autocork::end_burst();
    let Some(real) = REAL_PSELECT.get() else {
        return fail(libc::ENOSYS);
    };
    let sets = [r, w, x];
    // SAFETY: the caller's timeout, if not null.
    if let Some(t) = unsafe { duration_ts(ts) } {
        // SAFETY: the caller's sets and mask.
        if let Some(ret) = unsafe { engine_select(nfds, sets, t, mask) } {
            return ret;
        }
    }
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
    crate::autocork::end_burst();
    let Some(real) = REAL_EPOLL_CTL.get() else {
        return fail(libc::ENOSYS);
    };
    let c = if conn::any() { conn::lookup(fd) } else { None };
    let Some(c) = c else {
        // SAFETY: forwarding the caller's arguments unchanged.
        let r = unsafe { real(epfd, op, fd, ev) };
        if r == 0 && (EPOLL_COUNT.load(Ordering::Relaxed) != 0 || crate::emu::is_instance(fd)) {
            let e = errno();
            let _ = std::panic::catch_unwind(|| match op {
                libc::EPOLL_CTL_DEL => untrack(epfd, fd),
                // An epoll instance holding offloaded connections nested
                // in another: waited on without this library's epoll_wait.
                _ => expose(fd),
            });
            set_errno(e);
        }
        return r;
    };
    // Kept in this library (no readiness descriptor), unless the instance
    // is nested in another or the wait is the kernel's.
    let exposed = || {
        EXPOSED
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&epfd)
    };
    // A client's switch begun in `connect` is not finished by its
    // registration: the wait finishes it once the server's Reply is in.
    if engine_wait()
        && (c.unfinished() || c.stream().is_ok())
        && !catch_unwind(exposed).unwrap_or(true)
    {
        let e = if ev.is_null() {
            None
        } else {
            // SAFETY: the caller's event, not null.
            Some(unsafe { *ev })
        };
        let r = catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::emu::ctl(epfd, op, fd, &c, e)
        }))
        .unwrap_or(Err(libc::EIO));
        match r {
            Ok(()) => return 0,
            // Registered in the kernel's instance before: below.
            Err(libc::ENOENT) if c.readiness_made() => {}
            Err(e) => return fail(e),
        }
    }
    let t = c.readiness();
    let t = if t >= 0 { t } else { fd };
    // SAFETY: forwarding the caller's arguments (descriptor mapped).
    let r = unsafe { real(epfd, op, t, ev) };
    if r == 0 {
        let e = errno();
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match op {
            libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => track(epfd, fd, &c),
            libc::EPOLL_CTL_DEL => untrack(epfd, fd),
            _ => {}
        }));
        set_errno(e);
    }
    r
}

/// The offloaded connections registered in each epoll instance (by the
/// application's descriptors); weak: registration keeps no connection
/// open.
type EpollTable = conn::FdMap<conn::FdMap<Weak<Conn>>>;

static EPOLLS: LazyLock<RwLock<EpollTable>> = LazyLock::new(RwLock::default);
/// Epoll instances in [`EPOLLS`] (0: nothing to look up).
static EPOLL_COUNT: AtomicUsize = AtomicUsize::new(0);

/// Epoll instances nested in another epoll instance: the readiness
/// descriptors of their connections are kept in sync by the engine.
static EXPOSED: LazyLock<RwLock<std::collections::HashSet<c_int>>> = LazyLock::new(RwLock::default);

fn track(epfd: c_int, fd: c_int, c: &Arc<Conn>) {
    {
        let mut t = EPOLLS.write().unwrap_or_else(|e| e.into_inner());
        let set = t.entry(epfd).or_default();
        // Forget connections closed meanwhile.
        set.retain(|_, w| w.strong_count() > 0);
        set.insert(fd, Arc::downgrade(c));
        EPOLL_COUNT.store(t.len(), Ordering::Relaxed);
    }
    // Every wait on this instance goes through `engine_epoll`, which
    // brings the readiness descriptors up to date: the engine's threads
    // need not (no CQ arm, no hand-off per message).
    let exposed = EXPOSED
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&epfd);
    if engine_wait()
        && !exposed
        && let Ok(s) = c.stream()
    {
        s.set_readiness_polled(true);
    }
}

/// `epfd` was added to another epoll instance: the readiness descriptors
/// of its connections go back to being kept in sync by the engine.
fn expose(epfd: c_int) {
    if crate::emu::is_instance(epfd) {
        EXPOSED
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(epfd);
        // Its registrations kept here move into the kernel's instance.
        if let Some(real) = REAL_EPOLL_CTL.get() {
            for (fd, c, events, data) in crate::emu::take_all(epfd) {
                let t = c.readiness();
                if t < 0 {
                    continue;
                }
                let mut ev = libc::epoll_event { events, u64: data };
                // SAFETY: registering our readiness descriptor with the
                // application's event.
                if unsafe { real(epfd, libc::EPOLL_CTL_ADD, t, &raw mut ev) } == 0 {
                    track(epfd, fd, &c);
                }
            }
        }
    }
    let conns: Vec<Arc<Conn>> = {
        let t = EPOLLS.read().unwrap_or_else(|e| e.into_inner());
        match t.get(&epfd) {
            Some(set) => set.values().filter_map(Weak::upgrade).collect(),
            None => return,
        }
    };
    EXPOSED
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .insert(epfd);
    for c in conns {
        if let Ok(s) = c.stream() {
            s.set_readiness_polled(false);
        }
    }
}

fn untrack(epfd: c_int, fd: c_int) {
    let mut t = EPOLLS.write().unwrap_or_else(|e| e.into_inner());
    if let Some(set) = t.get_mut(&epfd) {
        set.remove(&fd);
        if set.is_empty() {
            t.remove(&epfd);
        }
    }
    EPOLL_COUNT.store(t.len(), Ordering::Relaxed);
}

/// Whether `fd` is an epoll instance holding offloaded connections.
pub(crate) fn is_epoll(fd: c_int) -> bool {
    crate::emu::is_instance(fd)
        || EPOLL_COUNT.load(Ordering::Relaxed) != 0
            && EPOLLS
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .contains_key(&fd)
}

/// `fd` is being closed: if it is an epoll instance, forget it.
pub(crate) fn forget_epoll(fd: c_int) {
    crate::emu::forget(fd);
    if EPOLL_COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut t = EPOLLS.write().unwrap_or_else(|e| e.into_inner());
    if t.remove(&fd).is_some() {
        EPOLL_COUNT.store(t.len(), Ordering::Relaxed);
    }
    drop(t);
    EXPOSED
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&fd);
}

/// The epoll instances holding offloaded connections in `first..=last`.
pub(crate) fn epolls_in(first: c_int, last: c_int) -> Vec<c_int> {
    let mut v = crate::emu::instances_in(first, last);
    if EPOLL_COUNT.load(Ordering::Relaxed) != 0 {
        let t = EPOLLS.read().unwrap_or_else(|e| e.into_inner());
        v.extend(t.keys().copied().filter(|&f| f >= first && f <= last));
    }
    v
}

/// The live offloaded connections of epoll instance `epfd` usable in this
/// process.
fn epoll_conns(epfd: c_int) -> Vec<Arc<Conn>> {
    if EPOLL_COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    let t = EPOLLS.read().unwrap_or_else(|e| e.into_inner());
    let Some(set) = t.get(&epfd) else {
        return Vec::new();
    };
    set.values()
        .filter_map(Weak::upgrade)
        .filter(|c| c.stream().is_ok())
        .collect()
}

/// The connection behind `fd` if it is offloaded and usable here.
fn usable(fd: c_int) -> Option<Arc<Conn>> {
    let c = conn::lookup(fd)?;
    c.stream().ok()?;
    Some(c)
}

/// A `timespec` timeout as a duration: `Some(None)` for none (null),
/// `None` if invalid (the real call reports `EINVAL`).
///
/// # Safety
/// `ts` is null or points to a timespec.
unsafe fn duration_ts(ts: *const libc::timespec) -> Option<Option<Duration>> {
    if ts.is_null() {
        return Some(None);
    }
    // SAFETY: not null, the caller's timespec.
    let t = unsafe { *ts };
    if t.tv_sec < 0 || !(0..1_000_000_000).contains(&t.tv_nsec) {
        return None;
    }
    Some(Some(Duration::new(t.tv_sec as u64, t.tv_nsec as u32)))
}

/// The signal mask argument as a reference.
///
/// # Safety
/// `mask` is null or points to a sigset.
unsafe fn mask_ref<'a>(mask: *const libc::sigset_t) -> Option<&'a libc::sigset_t> {
    // SAFETY: the caller's mask, if not null, valid for the call.
    unsafe { mask.as_ref() }
}

/// Sets errno from a failed wait and returns -1.
fn wait_failed(e: &std::io::Error) -> c_int {
    set_errno(e.raw_os_error().unwrap_or(libc::EIO));
    -1
}

/// poll/ppoll in the engine if `fds` holds an offloaded descriptor usable
/// here; `None`: not handled (the kernel path applies).
///
/// # Safety
/// `fds` points to `n` pollfds (or is null); `mask` is null or a sigset.
unsafe fn engine_poll(
    fds: *mut pollfd,
    n: nfds_t,
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    if !conn::any() || fds.is_null() || n == 0 || !engine_wait() {
        return None;
    }
    // SAFETY: the caller's array.
    let app = unsafe { std::slice::from_raw_parts_mut(fds, n as usize) };
    // No offloaded descriptor (the engine's own waits come here too): no
    // allocation.
    if !app.iter().any(|p| conn::lookup(p.fd).is_some()) {
        return None;
    }
    let conns: Vec<Option<Arc<Conn>>> = app.iter().map(|p| usable(p.fd)).collect();
    if conns.iter().all(Option::is_none) {
        return None;
    }
    // SAFETY: the caller's mask.
    let mask = unsafe { mask_ref(mask) };
    Some(guard(|| {
        let mut entries: Vec<PollEntry<'_>> = app
            .iter()
            .zip(&conns)
            .map(|(p, c)| match c.as_ref().and_then(|c| c.stream().ok()) {
                Some(s) => PollEntry::stream(s, p.events),
                None => PollEntry::fd(if p.fd >= 0 { target(p.fd) } else { p.fd }, p.events),
            })
            .collect();
        match sdpoll::poll(&mut entries, timeout, mask) {
            Ok(k) => {
                for (a, e) in app.iter_mut().zip(&entries) {
                    a.revents = e.revents();
                }
                Ok(k as c_int)
            }
            Err(e) => Ok(wait_failed(&e)),
        }
    }))
}

/// select/pselect in the engine if the sets hold an offloaded descriptor
/// usable here; `None`: not handled.
///
/// # Safety
/// The non-null sets are the caller's fd_sets; `mask` is null or a sigset.
unsafe fn engine_select(
    nfds: c_int,
    sets: [*mut libc::fd_set; 3],
    timeout: Option<Duration>,
    mask: *const libc::sigset_t,
) -> Option<c_int> {
    if !conn::any() || nfds <= 0 || !engine_wait() {
        return None;
    }
    let limit = nfds.min(libc::FD_SETSIZE as c_int);
    let isset = |i: usize, fd: c_int| {
        // SAFETY: the caller's set, fd < FD_SETSIZE.
        !sets[i].is_null() && unsafe { libc::FD_ISSET(fd, sets[i]) }
    };
    // (fd, in read, write, except set, connection)
    let mut want = Vec::new();
    let mut any = false;
    for fd in 0..limit {
        let (r, w, x) = (isset(0, fd), isset(1, fd), isset(2, fd));
        if r || w || x {
            let c = usable(fd);
            any |= c.is_some();
            want.push((fd, [r, w, x], c));
        }
    }
    if !any {
        return None;
    }
    // SAFETY: the caller's mask.
    let mask = unsafe { mask_ref(mask) };
    Some(guard(|| {
        let mut entries: Vec<PollEntry<'_>> = want
            .iter()
            .map(|(fd, rwx, c)| {
                let mut ev = 0;
                if rwx[0] {
                    ev |= sdpoll::POLLIN;
                }
                if rwx[1] {
                    ev |= sdpoll::POLLOUT;
                }
                if rwx[2] {
                    ev |= sdpoll::POLLPRI;
                }
                match c.as_ref().and_then(|c| c.stream().ok()) {
                    Some(s) => PollEntry::stream(s, ev),
                    None => PollEntry::fd(target(*fd), ev),
                }
            })
            .collect();
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = sdpoll::poll(&mut entries, left, mask) {
                return Ok(wait_failed(&e));
            }
            if entries.iter().any(|e| e.revents() & sdpoll::POLLNVAL != 0) {
                return Err(libc::EBADF);
            }
            // select(2)'s sets: readable on data, hang-up or error;
            // writable on space or error; exceptional on urgent data.
            let rd = sdpoll::POLLIN | sdpoll::POLLRDNORM | sdpoll::POLLHUP | sdpoll::POLLERR;
            let wr = sdpoll::POLLOUT | sdpoll::POLLWRNORM | sdpoll::POLLWRBAND | sdpoll::POLLERR;
            let mut out: [libc::fd_set; 3] = [zeroed_set(), zeroed_set(), zeroed_set()];
            let mut count = 0;
            for ((fd, rwx, _), e) in want.iter().zip(&entries) {
                let r = e.revents();
                let hit = [
                    rwx[0] && r & rd != 0,
                    rwx[1] && r & wr != 0,
                    rwx[2] && r & sdpoll::POLLPRI != 0,
                ];
                for i in 0..3 {
                    if hit[i] {
                        // SAFETY: fd < FD_SETSIZE.
                        unsafe { libc::FD_SET(*fd, &raw mut out[i]) };
                        count += 1;
                    }
                }
            }
            // Ready only in a way select does not report (a hang-up of a
            // descriptor watched for writing): wait on, as the kernel's.
            if count == 0 && deadline.is_none_or(|d| Instant::now() < d) {
                continue;
            }
            for (i, s) in sets.iter().enumerate() {
                if !s.is_null() {
                    // SAFETY: the caller's set.
                    unsafe { **s = out[i] };
                }
            }
            return Ok(count);
        }
    }))
}

fn zeroed_set() -> libc::fd_set {
    // SAFETY: fd_set is plain data; all zero is the empty set.
    let mut s: libc::fd_set = unsafe { std::mem::zeroed() };
    // SAFETY: a valid set.
    unsafe { libc::FD_ZERO(&raw mut s) };
    s
}

/// epoll_wait and its variants on an instance holding offloaded
/// connections: look without waiting (`peek`: the real call with timeout
/// 0), and while nothing is there sleep in the engine on the instance and
/// the connections, whose readiness descriptors are brought up to date
/// when they receive, then look again. `None`: not handled (`pass`: the
/// real call as made).
fn engine_epoll(
    epfd: c_int,
    maxevents: c_int,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    peek: impl Fn() -> c_int,
) -> Option<c_int> {
    if !engine_wait() || maxevents <= 0 {
        return None;
    }
    if epoll_conns(epfd).is_empty() {
        return None;
    }
    Some(guard(|| {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut first = true;
        loop {
            // Again every round: connections added by another thread
            // meanwhile are waited on too.
            let conns = epoll_conns(epfd);
            let mut entries: Vec<PollEntry<'_>> = Vec::with_capacity(conns.len() + 1);
            entries.push(PollEntry::fd(epfd, sdpoll::POLLIN));
            for c in &conns {
                if let Ok(s) = c.stream() {
                    entries.push(PollEntry::stream(s, 0));
                }
            }
            if first {
                // Take in what already came, then look.
                first = false;
                let _ = sdpoll::wait_progress(&mut entries, Some(Duration::ZERO), None);
                let n = peek();
                if n != 0 || timeout == Some(Duration::ZERO) {
                    return Ok(n);
                }
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = sdpoll::wait_progress(&mut entries, left, mask) {
                return Ok(wait_failed(&e));
            }
            let n = peek();
            if n != 0 || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(n);
            }
        }
    }))
}

/// epoll_wait and its variants on an instance with registrations kept in
/// this library (`emu`); `None`: not handled.
///
/// # Safety
/// `events` points to room for `maxevents` events.
unsafe fn emu_epoll(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    look: impl Fn(*mut libc::epoll_event, c_int) -> c_int,
) -> Option<c_int> {
    if !engine_wait() || !crate::emu::is_instance(epfd) {
        return None;
    }
    let r = catch_unwind(std::panic::AssertUnwindSafe(|| {
        let others = epoll_conns(epfd);
        // SAFETY: the caller's array.
        unsafe { crate::emu::wait(epfd, events, maxevents, timeout, mask, &others, look) }
    }));
    match r {
        Ok(Some(Ok(n))) => Some(n),
        Ok(Some(Err(e))) => Some(fail(e)),
        Ok(None) => None,
        Err(_) => Some(fail(libc::EIO)),
    }
}

/// `epoll_wait(2)`.
///
/// # Safety
/// As `epoll_wait(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
) -> c_int {
    crate::autocork::end_burst();
    let Some(real) = REAL_EPOLL_WAIT.get() else {
        return fail(libc::ENOSYS);
    };
    let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: the caller's array (or a part of it), timeout 0.
    let look = |p, m| unsafe { real(epfd, p, m, 0) };
    // SAFETY: the caller's array.
    if let Some(r) = unsafe { emu_epoll(epfd, events, maxevents, t, None, look) } {
        return r;
    }
    // SAFETY: the caller's array, timeout 0.
    let peek = || unsafe { real(epfd, events, maxevents, 0) };
    if let Some(r) = engine_epoll(epfd, maxevents, t, None, peek) {
        return r;
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(epfd, events, maxevents, timeout) }
}

/// `epoll_pwait(2)`.
///
/// # Safety
/// As `epoll_pwait(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: c_int,
    mask: *const libc::sigset_t,
) -> c_int {
    crate::autocork::end_burst();
    let Some(real) = REAL_EPOLL_PWAIT.get() else {
        return fail(libc::ENOSYS);
    };
    let t = (timeout >= 0).then(|| Duration::from_millis(timeout as u64));
    // SAFETY: the caller's array (or a part of it) and mask, timeout 0.
    let look = |p, m| unsafe { real(epfd, p, m, 0, mask) };
    // SAFETY: the caller's array and mask.
    if let Some(r) = unsafe { emu_epoll(epfd, events, maxevents, t, mask_ref(mask), look) } {
        return r;
    }
    // SAFETY: the caller's array and mask, timeout 0.
    let peek = || unsafe { real(epfd, events, maxevents, 0, mask) };
    // SAFETY: the caller's mask.
    if let Some(r) = engine_epoll(epfd, maxevents, t, unsafe { mask_ref(mask) }, peek) {
        return r;
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(epfd, events, maxevents, timeout, mask) }
}

/// `epoll_pwait2(2)`.
///
/// # Safety
/// As `epoll_pwait2(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn epoll_pwait2(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    ts: *const libc::timespec,
    mask: *const libc::sigset_t,
) -> c_int {
    crate::autocork::end_burst();
    let Some(real) = REAL_EPOLL_PWAIT2.get() else {
        return fail(libc::ENOSYS);
    };
    // SAFETY: the caller's timeout, if not null.
    if let Some(t) = unsafe { duration_ts(ts) } {
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: the caller's array (or a part of it) and mask, timeout 0.
        let look = |p, m| unsafe { real(epfd, p, m, &zero, mask) };
        // SAFETY: the caller's array and mask.
        if let Some(r) = unsafe { emu_epoll(epfd, events, maxevents, t, mask_ref(mask), look) } {
            return r;
        }
        // SAFETY: the caller's array and mask, timeout 0.
        let peek = || unsafe { real(epfd, events, maxevents, &zero, mask) };
        // SAFETY: the caller's mask.
        if let Some(r) = engine_epoll(epfd, maxevents, t, unsafe { mask_ref(mask) }, peek) {
            return r;
        }
    }
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(epfd, events, maxevents, ts, mask) }
}
