//! epoll for offloaded connections, kept in this library.
//!
//! An offloaded connection registered in an epoll instance is not put in
//! the kernel's instance at all: its registration (interest, event data,
//! level-triggered, edge-triggered or one-shot) lives here, and
//! `epoll_wait` on the instance reports it from the connection's own state
//! next to what the kernel's instance reports for the other descriptors.
//! So a message costs no system call on any readiness descriptor (setting
//! one readable, draining it): the connection's socket wakes the thread
//! in `epoll_wait`, which runs the receive path, and its data is reported
//! from memory.
//!
//! The kernel's rules, applied here:
//! - level-triggered: reported on every wait while readable (data, end of
//!   stream, error) or writable, as asked;
//! - edge-triggered (`EPOLLET`): reported when it is ready and something
//!   happened since the last report: for `EPOLLIN` a message arrived (data,
//!   the end of the stream or a failure: every arrival is an edge, as the
//!   kernel's socket makes one per arriving segment, so a reader that stops
//!   at a short read, as nginx does, hears of the next request); for
//!   `EPOLLOUT` a write found no room (`EAGAIN`) since;
//! - one-shot (`EPOLLONESHOT`): reported once, then disabled until
//!   `EPOLL_CTL_MOD`;
//! - with `EPOLLRDHUP` asked for: `EPOLLRDHUP` with the end of the stream,
//!   and `EPOLLERR | EPOLLHUP` too with an error (otherwise a failed
//!   connection is reported readable and writable, and the calls on it
//!   return the error).
//!
//! A registration ends with `EPOLL_CTL_DEL` or when the connection's last
//! descriptor is closed (as the kernel's ends with the open file
//! description). The events of both kinds are merged in one result (the
//! connections round robin among them; when both kinds have events they
//! take turns going first, and the connections take at most half the
//! room).
//!
//! An instance added to another epoll instance (nested) cannot be waited
//! on by the kernel with registrations kept here: its registrations are
//! then moved into the kernel's instance as readiness descriptors kept in
//! sync by the engine (`events::expose`), as with
//! `SOFTRDMA_SOCKETS_WAIT=kernel`.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};

use libc::c_int;
use softrdma_sockets::poll::{self as sdpoll, PollEntry};

use crate::conn::{Conn, FdMap};

const EPOLLIN: u32 = libc::EPOLLIN as u32;
const EPOLLOUT: u32 = libc::EPOLLOUT as u32;
const EPOLLERR: u32 = libc::EPOLLERR as u32;
const EPOLLHUP: u32 = libc::EPOLLHUP as u32;
const EPOLLRDHUP: u32 = libc::EPOLLRDHUP as u32;
const EPOLLET: u32 = libc::EPOLLET as u32;
const EPOLLONESHOT: u32 = libc::EPOLLONESHOT as u32;
const EPOLLEXCLUSIVE: u32 = libc::EPOLLEXCLUSIVE as u32;

/// One registration of an offloaded connection.
#[derive(Debug)]
struct Reg {
    conn: Weak<Conn>,
    /// Interest and flags as given (`EPOLLIN | EPOLLET | ...`).
    events: u32,
    data: u64,
    /// Changes with every `EPOLL_CTL_ADD`/`MOD` (a wait's snapshot of an
    /// older registration is not reported).
    version: u64,
    /// One-shot, reported: silent until `EPOLL_CTL_MOD`.
    disabled: bool,
    /// Edge-triggered: the connection's [`marks`] when last reported for
    /// reading and for writing (`None`: not reported yet).
    fired: [Option<u64>; 2],
}

impl Reg {
    /// The interest a wait looks for now (0: nothing can be reported).
    fn interest(&self, c: &Conn) -> u32 {
        interest(self.events, self.disabled, self.fired, c)
    }
}

/// The interest a registration with `events`, `disabled` and `fired` (see
/// [`Reg`]) looks for now on `c` (0: nothing can be reported).
fn interest(events: u32, disabled: bool, fired: [Option<u64>; 2], c: &Conn) -> u32 {
    if disabled {
        return 0;
    }
    let mut want = 0;
    for (i, bit) in [EPOLLIN, EPOLLOUT].into_iter().enumerate() {
        if events & bit == 0 {
            continue;
        }
        let fresh = events & EPOLLET == 0 || fired[i] != Some(marks(c)[i]);
        if fresh {
            want |= bit;
        }
    }
    want
}

/// The registrations of one epoll instance.
#[derive(Debug, Default)]
struct Instance {
    regs: FdMap<Reg>,
    /// Where the next result starts (round robin).
    cursor: usize,
    /// When both have events: whether the connections' go first this time
    /// (turns alternate, so that neither kind starves with a small
    /// `maxevents`).
    ours_first: bool,
    /// Changes with every change of `regs` (a registration added, changed,
    /// removed, reported edge-triggered or one-shot): a wait that finds it
    /// as it was at its snapshot uses the snapshot's copies of the
    /// registrations instead of looking each one up again.
    generation: u64,
}

/// The longest sleep of a wait while a client's switch waits for the
/// server's Reply (its time limit ends it even if no octet comes).
const SWITCH_LOOK: Duration = Duration::from_millis(100);

/// The longest sleep of a wait while another thread holds a connection's
/// switch lock a moment (not to finish it): the connection is looked at
/// again soon after.
const BUSY_LOOK: Duration = Duration::from_millis(2);

static INSTANCES: LazyLock<RwLock<FdMap<Arc<Mutex<Instance>>>>> = LazyLock::new(RwLock::default);
/// Entries of [`INSTANCES`] (0: nothing to look up).
static COUNT: AtomicUsize = AtomicUsize::new(0);
static VERSION: AtomicU64 = AtomicU64::new(1);

fn instance(epfd: c_int) -> Option<Arc<Mutex<Instance>>> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return None;
    }
    INSTANCES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .get(&epfd)
        .cloned()
}

fn lock(i: &Mutex<Instance>) -> std::sync::MutexGuard<'_, Instance> {
    i.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether `epfd` has registrations kept here.
pub(crate) fn is_instance(epfd: c_int) -> bool {
    instance(epfd).is_some()
}

/// The instances in `first..=last` (about to be closed together).
pub(crate) fn instances_in(first: c_int, last: c_int) -> Vec<c_int> {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return Vec::new();
    }
    INSTANCES
        .read()
        .unwrap_or_else(|e| e.into_inner())
        .keys()
        .copied()
        .filter(|&f| f >= first && f <= last)
        .collect()
}

/// `epfd` is closed: its registrations go.
pub(crate) fn forget(epfd: c_int) {
    if COUNT.load(Ordering::Relaxed) == 0 {
        return;
    }
    let mut t = INSTANCES.write().unwrap_or_else(|e| e.into_inner());
    t.remove(&epfd);
    COUNT.store(t.len(), Ordering::Relaxed);
}

/// Whether `epfd` is an epoll instance (the kernel's checks of
/// `epoll_ctl`): known here, or named so by `/proc/self/fd`.
fn is_epoll_fd(epfd: c_int) -> Result<(), c_int> {
    if is_instance(epfd) {
        return Ok(());
    }
    match std::fs::read_link(format!("/proc/self/fd/{epfd}")) {
        Ok(p) if p.as_os_str() == "anon_inode:[eventpoll]" => Ok(()),
        Ok(_) => Err(libc::EINVAL),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Err(libc::EBADF),
        // No /proc: trust the caller.
        Err(_) => Ok(()),
    }
}

/// `epoll_ctl` of offloaded connection `c` (descriptor `fd`) kept here.
pub(crate) fn ctl(
    epfd: c_int,
    op: c_int,
    fd: c_int,
    c: &Arc<Conn>,
    ev: Option<libc::epoll_event>,
) -> Result<(), c_int> {
    // Programs change their interest often (per request): the instance is
    // looked up under the read lock, made under the write lock once.
    let inst = match instance(epfd) {
        Some(i) => i,
        None => {
            is_epoll_fd(epfd)?;
            let mut t = INSTANCES.write().unwrap_or_else(|e| e.into_inner());
            let i = t.entry(epfd).or_default().clone();
            COUNT.store(t.len(), Ordering::Relaxed);
            i
        }
    };
    let mut inst = lock(&inst);
    // A registration whose connection is gone (its descriptors closed,
    // the number reused) does not count (the others are swept by waits).
    if inst
        .regs
        .get(&fd)
        .is_some_and(|r| r.conn.strong_count() == 0)
    {
        inst.regs.remove(&fd);
        inst.generation += 1;
    }
    let mine = inst
        .regs
        .get(&fd)
        .is_some_and(|r| std::ptr::eq(r.conn.as_ptr(), Arc::as_ptr(c)));
    match op {
        libc::EPOLL_CTL_ADD | libc::EPOLL_CTL_MOD => {
            let ev = ev.ok_or(libc::EFAULT)?;
            let events = ev.events;
            if op == libc::EPOLL_CTL_ADD && mine {
                return Err(libc::EEXIST);
            }
            if op == libc::EPOLL_CTL_MOD {
                if !mine {
                    return Err(libc::ENOENT);
                }
                if events & EPOLLEXCLUSIVE != 0 {
                    return Err(libc::EINVAL);
                }
            }
            inst.generation += 1;
            inst.regs.insert(
                fd,
                Reg {
                    conn: Arc::downgrade(c),
                    events,
                    data: ev.u64,
                    version: VERSION.fetch_add(1, Ordering::Relaxed),
                    disabled: false,
                    fired: [None, None],
                },
            );
            Ok(())
        }
        libc::EPOLL_CTL_DEL => {
            if !mine {
                return Err(libc::ENOENT);
            }
            inst.regs.remove(&fd);
            inst.generation += 1;
            Ok(())
        }
        _ => Err(libc::EINVAL),
    }
}

/// Takes the registrations of `epfd` out (the instance is nested in
/// another and goes back to the kernel): (descriptor, connection, events,
/// data) of each live one.
pub(crate) fn take_all(epfd: c_int) -> Vec<(c_int, Arc<Conn>, u32, u64)> {
    let inst = {
        let mut t = INSTANCES.write().unwrap_or_else(|e| e.into_inner());
        let i = t.remove(&epfd);
        COUNT.store(t.len(), Ordering::Relaxed);
        i
    };
    let Some(inst) = inst else {
        return Vec::new();
    };
    let inst = lock(&inst);
    inst.regs
        .iter()
        .filter_map(|(&fd, r)| {
            let c = r.conn.upgrade()?;
            // A disabled one-shot registration stays silent.
            let events = if r.disabled {
                r.events & (EPOLLET | EPOLLONESHOT)
            } else {
                r.events
            };
            Some((fd, c, events, r.data))
        })
        .collect()
}

/// What a wait saw of one registration: its descriptor and version, its
/// connection, and a copy of its rules (valid while the instance's
/// generation is the snapshot's).
struct Seen {
    fd: c_int,
    version: u64,
    conn: Arc<Conn>,
    events: u32,
    data: u64,
    disabled: bool,
    fired: [Option<u64>; 2],
}

/// `epoll_wait` on an instance with registrations kept here: `kernel(ptr,
/// max)` looks at the kernel's instance without waiting (the real call
/// with timeout 0); `others` are connections whose readiness descriptors
/// are in the kernel's instance (waited on too; their descriptors are
/// brought up to date by the wait). `None`: not handled here.
///
/// # Safety
/// `events` points to room for `maxevents` events.
pub(crate) unsafe fn wait(
    epfd: c_int,
    events: *mut libc::epoll_event,
    maxevents: c_int,
    timeout: Option<Duration>,
    mask: Option<&libc::sigset_t>,
    others: &[Arc<Conn>],
    kernel: impl Fn(*mut libc::epoll_event, c_int) -> c_int,
) -> Option<Result<c_int, c_int>> {
    if maxevents <= 0 || events.is_null() {
        return None;
    }
    let inst = instance(epfd)?;
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    let max = maxevents as usize;
    let mut switching: Vec<c_int> = Vec::new();
    loop {
        // Snapshot: the live, usable registrations and what they wait for.
        let mut seen: Vec<Seen>;
        let mut interest: Vec<u32>;
        let generation;
        {
            let mut g = lock(&inst);
            let before = g.regs.len();
            g.regs.retain(|_, r| r.conn.strong_count() > 0);
            if g.regs.len() != before {
                g.generation += 1;
            }
            generation = g.generation;
            // Sized once (an event loop with many connections grew them
            // step by step on every call).
            seen = Vec::with_capacity(g.regs.len());
            interest = Vec::with_capacity(g.regs.len());
            switching.clear();
            for (&fd, r) in &g.regs {
                let Some(c) = r.conn.upgrade() else { continue };
                seen.push(Seen {
                    fd,
                    version: r.version,
                    conn: c,
                    events: r.events,
                    data: r.data,
                    disabled: r.disabled,
                    fired: r.fired,
                });
            }
        }
        // The connections are looked at without the instance's lock: a
        // switch finished here (its Reply in, or failed: a plain connect)
        // must not hold up the instance's other calls.
        let mut busy = false;
        let mut busy_brief = false;
        seen.retain(|s| match s.conn.stream_now() {
            Ok(Ok(_)) => true,
            // A client's switch waiting for the server's Reply: nothing to
            // report; its socket wakes the wait.
            Ok(Err(Some(sfd))) => {
                if sfd >= 0 && !s.disabled {
                    switching.push(sfd);
                }
                false
            }
            // Another thread is making or finishing the switch, or holds
            // its lock a moment: looked at again shortly (very shortly if
            // no switch is in progress: its readiness is not held up).
            Ok(Err(None)) => {
                if !s.disabled {
                    if s.conn.finishing() {
                        busy = true;
                    } else {
                        busy_brief = true;
                    }
                }
                false
            }
            Err(_) => false,
        });
        interest.extend(seen.iter().map(interest_of_seen));
        let mut entries: Vec<PollEntry<'_>> = Vec::with_capacity(seen.len() + others.len() + 1);
        entries.push(PollEntry::fd(epfd, sdpoll::POLLIN));
        for (s, &i) in seen.iter().zip(&interest) {
            if let Ok(st) = s.conn.stream() {
                entries.push(PollEntry::stream(st, poll_bits(i)));
            }
        }
        for c in others {
            if let Ok(st) = c.stream() {
                entries.push(PollEntry::stream(st, 0));
            }
        }
        for &sfd in &switching {
            entries.push(PollEntry::fd(sfd, sdpoll::POLLIN));
        }
        let mut left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if !switching.is_empty() || busy {
            // A switch's time limit, or another thread's finish of one, is
            // looked at by the next round.
            left = Some(left.map_or(SWITCH_LOOK, |l| l.min(SWITCH_LOOK)));
        }
        if busy_brief {
            left = Some(left.map_or(BUSY_LOOK, |l| l.min(BUSY_LOOK)));
        }
        if let Err(e) = sdpoll::wait_progress(&mut entries, left, mask) {
            return Some(Err(e.raw_os_error().unwrap_or(libc::EIO)));
        }
        let kernel_ready = entries[0].revents() != 0 || !others.is_empty();
        // Which registrations report, from their state now. An
        // edge-triggered one with nothing new before the wait may have had
        // its edge during it: its interest and readiness are looked at
        // again (no system call), so one wait-up is one round.
        let mut hits: Vec<(usize, u32)> = Vec::new();
        {
            let g = lock(&inst);
            // Nothing changed meanwhile: the snapshot's copies serve (no
            // look-up per registration).
            let same = g.generation == generation;
            for (k, &pre) in interest.iter().enumerate() {
                let Some(e) = entries.get(k + 1) else { break };
                let s = &seen[k];
                let want = if same {
                    interest_of_seen(s)
                } else {
                    match g.regs.get(&s.fd) {
                        Some(r) if r.version == s.version => r.interest(&s.conn),
                        _ => 0,
                    }
                };
                let got = if want == pre {
                    epoll_bits(e.revents()) & want
                } else if want == 0 {
                    0
                } else {
                    let (rd, wr) = s
                        .conn
                        .stream()
                        .ok()
                        .and_then(|st| st.ready_now())
                        .unwrap_or((false, false));
                    let mut b = 0;
                    if rd {
                        b |= EPOLLIN;
                    }
                    if wr {
                        b |= EPOLLOUT;
                    }
                    b & want
                };
                if got != 0 {
                    hits.push((k, got));
                }
            }
        }
        // Both kinds: turns alternate; the connections take at most half
        // the room when the kernel's instance has events too.
        let ours_first = kernel_ready && !hits.is_empty() && {
            let mut g = lock(&inst);
            g.ours_first = !g.ours_first;
            g.ours_first
        };
        let ours_cap = if kernel_ready {
            (max - max / 2).max(1)
        } else {
            max
        };
        let mut n = 0usize;
        if kernel_ready && !ours_first {
            let room = max.saturating_sub(hits.len().min(ours_cap)).max(1);
            let k = kernel(events, room as c_int);
            if k < 0 {
                return Some(Err(crate::real::errno()));
            }
            n = k as usize;
        }
        if !hits.is_empty() && n < max {
            let mut g = lock(&inst);
            let same = g.generation == generation;
            let len = hits.len();
            let start = g.cursor % len;
            let mut used = 0;
            let limit = if ours_first { ours_cap } else { max };
            for j in 0..len {
                if n >= limit {
                    break;
                }
                let (k, got) = hits[(start + j) % len];
                let s = &seen[k];
                let (ev, data) = if same && s.events & (EPOLLET | EPOLLONESHOT) == 0 {
                    // Level-triggered and unchanged since the snapshot:
                    // reporting it changes nothing of the registration.
                    (got | closed_bits(&s.conn, got, s.events), s.data)
                } else {
                    let Some(r) = g.regs.get_mut(&s.fd) else {
                        continue;
                    };
                    if r.version != s.version || r.disabled {
                        continue;
                    }
                    let ev = got | closed_bits(&s.conn, got, r.events);
                    let m = marks(&s.conn);
                    for (i, bit) in [EPOLLIN, EPOLLOUT].into_iter().enumerate() {
                        if ev & bit != 0 {
                            r.fired[i] = Some(m[i]);
                        }
                    }
                    if r.events & EPOLLONESHOT != 0 {
                        r.disabled = true;
                    }
                    let data = r.data;
                    if r.events & (EPOLLET | EPOLLONESHOT) != 0 {
                        g.generation += 1;
                    }
                    (ev, data)
                };
                let e = libc::epoll_event {
                    events: ev,
                    u64: data,
                };
                // SAFETY: `n < maxevents`: within the caller's array (an
                // epoll_event may be packed: written unaligned).
                unsafe { events.add(n).write_unaligned(e) };
                n += 1;
                used = j + 1;
            }
            g.cursor = start + used;
        }
        if kernel_ready && ours_first && n < max {
            // SAFETY: the rest of the caller's array.
            let k = kernel(unsafe { events.add(n) }, (max - n) as c_int);
            if k < 0 {
                return Some(Err(crate::real::errno()));
            }
            n += k as usize;
        }
        if n > 0 || deadline.is_some_and(|d| Instant::now() >= d) {
            return Some(Ok(n as c_int));
        }
    }
}

/// [`interest`] from a wait's copy of a registration.
fn interest_of_seen(s: &Seen) -> u32 {
    interest(s.events, s.disabled, s.fired, &s.conn)
}

/// What makes an edge: for reading, the messages the connection took in
/// (data, end of stream, failure: [`softrdma_sockets::TcpStream::arrivals`]);
/// for writing, the writes that found no room.
fn marks(c: &Conn) -> [u64; 2] {
    let a = c.stream().map_or(0, |s| s.arrivals());
    [a, c.write_blocked.load(Ordering::Relaxed)]
}

/// poll(2) bits for an epoll interest.
fn poll_bits(i: u32) -> i16 {
    let mut p = 0;
    if i & EPOLLIN != 0 {
        p |= sdpoll::POLLIN;
    }
    if i & EPOLLOUT != 0 {
        p |= sdpoll::POLLOUT;
    }
    p
}

/// epoll bits for poll(2) `revents` of a stream.
fn epoll_bits(r: i16) -> u32 {
    let mut e = 0;
    if r & sdpoll::POLLIN != 0 {
        e |= EPOLLIN;
    }
    if r & sdpoll::POLLOUT != 0 {
        e |= EPOLLOUT;
    }
    e
}

/// With `EPOLLRDHUP` asked for: `EPOLLRDHUP` for a readable stream at its
/// end, and `EPOLLERR | EPOLLHUP` too for one that failed (a look at the
/// stream's first byte, no system call).
fn closed_bits(c: &Conn, got: u32, events: u32) -> u32 {
    if got & EPOLLIN == 0 || events & EPOLLRDHUP == 0 {
        return 0;
    }
    let Ok(s) = c.stream() else { return 0 };
    let mut one = [0u8; 1];
    match s.peek(&mut one) {
        Ok(0) => EPOLLRDHUP,
        Ok(_) => 0,
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => 0,
        Err(_) => EPOLLERR | EPOLLHUP | EPOLLRDHUP,
    }
}
