//! Waiting on several completion queues and foreign file descriptors at
//! once, in the calling thread.
//!
//! [`CompletionQueue::wait`] lets one thread sleep on one CQ and run the
//! receive path itself when bytes come. A [`WaitSet`] does the same for
//! many CQs and any other descriptors (pipes, an epoll instance, plain
//! sockets), the way `poll(2)` waits on many descriptors: the thread
//! sleeps in one system call on the sockets of the CQs' queue pairs, on the
//! CQs' wake-up event fds and on the foreign descriptors. Bytes arriving on
//! a QP's socket wake this thread, which then runs that QP's receive path
//! itself (the device's receive thread leaves the socket to it while it
//! sleeps), so a message reaches an event loop with one wake-up and no
//! hand-off between threads. Completions pushed by other threads (send
//! completions written by a datamover, another poller) wake it through the
//! CQ's event fd.
//!
//! A CQ counts as *ready* when it holds a completion; the wait set never
//! takes completions out (poll the CQ afterwards). A foreign descriptor is
//! ready when `poll(2)` reports events for it (its `revents`).
//!
//! ```no_run
//! # fn demo(cq: &softrdma_engine::CompletionQueue, pipe: std::os::fd::RawFd) {
//! use std::time::Duration;
//! use softrdma_engine::wait_set::WaitSet;
//!
//! let mut set = WaitSet::new();
//! let c = set.add_cq(cq);
//! let p = set.add_fd(pipe, libc::POLLIN);
//! match set.wait(Some(Duration::from_millis(100))) {
//!     Ok(0) => { /* timed out */ }
//!     Ok(_) => {
//!         if set.cq_ready(c) { /* poll the CQ */ }
//!         if set.fd_revents(p) != 0 { /* read the pipe */ }
//!     }
//!     Err(e) => { /* interrupted by a signal (EINTR), or poll failed */ }
//! }
//! # }
//! ```
//!
//! How it sleeps: a set of 4 entries or more keeps its own epoll instance,
//! in which the QPs' sockets and the CQs' event fds stay registered from
//! one wait to the next (keyed by the QP and the CQ they belong to, so a
//! descriptor number closed and reused is registered anew), and foreign
//! descriptors are re-armed one-shot on every wait (which checks that the
//! number still names the registered file); a registration the set no
//! longer knows (its file open elsewhere, a duplicate or a forked child)
//! makes it start over with a new instance. The kernel's work in a wait is
//! then per ready descriptor. What the set knows of each CQ (its QPs'
//! sockets, their claim from the engine's receive threads, its event fd)
//! is kept from one wait to the next too, found by the CQ's identity: a
//! wait claims a CQ's sockets again only when its QPs changed, when it
//! had something the last time (its owner polled it since, which ends
//! the claim), or when the claim runs short; so the set's own work per
//! wait is a look-up per CQ, and a walk over QPs only for the busy ones.
//! Smaller sets sleep in one `ppoll(2)` over
//! their descriptors (`poll(2)`, which copies no timeout in or out, when
//! no signal mask is given and the timeout is whole milliseconds); they
//! claim the QPs' sockets before the sleep and only renew the claim's time
//! after it. A socket found readable is received from at once, without
//! another look at it. `SOFTRDMA_WAIT_SET=ppoll` (or `epoll`) chooses one
//! way for every set.
//!
//! A set of one CQ with one QP can also sleep in that QP's socket's
//! `recv` ([`WaitSet::wait_receiving`]), as a blocking TCP read does: one
//! system call per wait instead of `poll(2)` and a read, for callers that
//! know nothing but bytes on that socket can end their wait.
//!
//! Wake-ups: a `ppoll(2)` set sleeps on one wake-up descriptor of its own
//! for all its CQs (`sys::fd::Waker`, registered with each CQ for the
//! sleep; a push writes it at most once per sleep), which no other waiter
//! reads, so no waiter can take another's wake-up and a wait without a
//! timeout sleeps with no timer at all (a kernel timer armed and cancelled
//! per sleep cost 3–4 % of a blocking ping-pong's CPU). A set waiting with
//! epoll sleeps on the CQs' own event fds, which every epoll waiter of a
//! CQ shares: its sleeps stay bounded (`NAP_MAX`) as a safety net.
//!
//! Signals: a signal handled while the thread waits ends the wait with
//! [`WaitError::Interrupted`], as `poll(2)` returns `EINTR`;
//! [`WaitSet::wait_masked`] installs a signal mask for the duration of the
//! wait, as `ppoll(2)` and `pselect(2)` do.

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use crate::cq::{CompletionQueue, Progress};
use crate::sys::clock;
use crate::sys::fd::Waker;
use crate::wc::WorkCompletion;

/// `poll(2)` reports a file that epoll refuses (a regular file) ready for
/// reading and writing.
const ALWAYS_READY: i16 = libc::POLLIN | libc::POLLOUT | libc::POLLRDNORM | libc::POLLWRNORM;

/// A signal set (`sigset_t`), for [`WaitSet::wait_masked`].
pub type SigSet = libc::sigset_t;

/// How far the claim on the QPs' sockets reaches past the start of a
/// sleep, and the longest sleep before the set looks again, with or
/// without a timeout. Every way a CQ becomes ready wakes a sleeper (bytes
/// on a claimed socket, a push signalling its waker), but a caller may
/// wait for more than its CQs: another thread's `shutdown` of a stream it
/// reads, or data held for a later flush, pushes nothing, so a sleep
/// without a bound could last for good. (A `poll(2)` with a timeout arms a
/// kernel timer per sleep, 3–4 % of the CPU of a blocking 64-byte
/// ping-pong whose threads share a CPU: the price of that safety.)
const NAP_MAX: Duration = Duration::from_millis(100);

/// How long the QPs' sockets stay claimed from the engine's receive threads
/// after a wait returns (their bytes wait in the kernel for the next wait
/// meanwhile, as a plain socket's wait for the program's next call): an
/// event loop back within that time receives every message itself, and
/// the receive threads are not woken for those sockets (nor re-arm them)
/// per message. A program that stops waiting leaves its QPs to the
/// receive threads after this plus their quiet period (sets waiting with
/// epoll: after between half of this and this plus the last nap, their
/// claims being renewed only when half of this is left).
const CLAIM_AFTER_NS: u64 = 10_000_000;

/// Why [`WaitSet::wait`] returned without a result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WaitError {
    /// A signal was handled during the wait (`EINTR`).
    #[error("interrupted by a signal")]
    Interrupted,
    /// `ppoll(2)` or `epoll_pwait(2)` failed (for example `ENOMEM`, or
    /// `EINVAL` for too many descriptors).
    #[error("wait failed: {0}")]
    Io(io::Error),
}

impl WaitError {
    /// The `errno` the kernel's `poll(2)` would have set.
    pub fn raw_os_error(&self) -> i32 {
        match self {
            WaitError::Interrupted => libc::EINTR,
            WaitError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
        }
    }
}

/// A set of completion queues and foreign file descriptors to wait on
/// together; see the [module docs](self). Reusable: [`clear`](Self::clear)
/// it and add again (the buffers are kept).
#[derive(Default)]
pub struct WaitSet {
    cqs: Vec<CompletionQueue>,
    cq_ready: Vec<bool>,
    /// CQs added with [`add_cq_completions`](WaitSet::add_cq_completions):
    /// their QPs' sockets are not watched.
    cq_quiet: Vec<bool>,
    /// The last [`wait_receiving`](WaitSet::wait_receiving) slept in `recv`.
    slept_in_recv: bool,
    /// The foreign descriptors, with their interest and last `revents`.
    fds: Vec<libc::pollfd>,
    /// Scratch: the `ppoll` array (foreign, then QP sockets, then wake fds).
    pfds: Vec<libc::pollfd>,
    /// Scratch: the QPs whose sockets are watched, by CQ index.
    hooks: Vec<(usize, Arc<dyn Progress>)>,
    /// Scratch: the CQ of each wake fd in `pfds`.
    wakes: Vec<usize>,
    /// Scratch: each CQ's wake-up event fd this round.
    wake_fds: Vec<Option<RawFd>>,
    /// The persistent epoll registrations (large sets; see [`Mode`]).
    ep: Option<EpState>,
    /// The epoll wait failed in a way a `ppoll(2)` would not: this set
    /// waits with `ppoll(2)` from now on.
    ep_off: bool,
    /// The set's own wake-up descriptor for `ppoll(2)` waits (registered
    /// with each CQ for the sleep: one descriptor for all its CQs, read
    /// by nobody else), with the fork generation it was made in.
    waker: Option<(Arc<Waker>, u64)>,
    /// [`wait_receiving`](Self::wait_receiving)'s QP: the one hook of the
    /// set's one CQ, with the CQ's hook generation it was taken at. While
    /// the generation holds, the hook is the same, and a wait upgrades it
    /// without taking the list (a read lock, a reference count taken and
    /// dropped). Forgotten when the set's CQs change.
    one_hook: Option<(u64, std::sync::Weak<dyn crate::cq::Progress>)>,
}

/// Wakers most kept for reuse.
const SPARE_WAKERS: usize = 64;

/// The wakers of dropped wait sets, for the next ones (a wait set per
/// connection made an event fd at its first wait and closed it with the
/// connection: two system calls per connection). One list per fork
/// generation (a child never takes its parent's lock).
fn spare_wakers() -> &'static parking_lot::Mutex<Vec<Waker>> {
    static SPARE: crate::sys::process::PerFork<parking_lot::Mutex<Vec<Waker>>> =
        crate::sys::process::PerFork::new();
    SPARE.get(|| parking_lot::Mutex::new(Vec::new()))
}

/// A spare waker of `spare`, or a new one.
fn take_waker(spare: &parking_lot::Mutex<Vec<Waker>>) -> io::Result<Waker> {
    match spare.lock().pop() {
        Some(w) => Ok(w),
        None => Waker::new(),
    }
}

/// Keeps `w` in `spare` for the next wait set if nobody else holds it (no
/// CQ lists it as a waiter), it is not readable (no wake count left in it
/// for the next set to find) and fewer than [`SPARE_WAKERS`] are kept.
fn give_waker(spare: &parking_lot::Mutex<Vec<Waker>>, w: Arc<Waker>) {
    if let Some(w) = Arc::into_inner(w)
        && w.quiet()
    {
        let mut spare = spare.lock();
        if spare.len() < SPARE_WAKERS {
            spare.push(w);
        }
    }
}

impl Drop for WaitSet {
    fn drop(&mut self) {
        // (Not one made by a parent before a fork: its list is the
        // parent's.)
        if let Some((w, generation)) = self.waker.take()
            && generation == crate::sys::epoll::fork_generation()
        {
            give_waker(spare_wakers(), w);
        }
    }
}

/// How a wait set sleeps (`SOFTRDMA_WAIT_SET`: `ppoll`, `epoll` or
/// `auto`, the default).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One `ppoll(2)` over every descriptor on every wait.
    Ppoll,
    /// A persistent epoll instance for every set.
    Epoll,
    /// epoll for sets of at least [`EPOLL_MIN`] entries, `ppoll(2)` below
    /// (a set of a CQ or two costs one descriptor less, and a `ppoll` of
    /// two or three descriptors is as cheap as an `epoll_wait`).
    Auto,
}

/// Entries (CQs plus foreign descriptors) from which `Mode::Auto` waits
/// with epoll.
const EPOLL_MIN: usize = 4;

fn mode() -> Mode {
    static MODE: std::sync::OnceLock<Mode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("SOFTRDMA_WAIT_SET").as_deref() {
        Ok("ppoll") => Mode::Ppoll,
        Ok("epoll") => Mode::Epoll,
        _ => Mode::Auto,
    })
}

/// What a persistent registration is for; a registration is reused only
/// for the same thing (the same connection of the same QP, the same CQ),
/// never for a descriptor number that merely matches.
enum What {
    /// A QP's socket (the QP's receive hook, by identity, and its
    /// connection: a QP connected again may have its new socket at the
    /// number of its old one, whose registration went with its file).
    Socket(std::sync::Weak<dyn Progress>, u64),
    /// A CQ's wake-up event fd (the CQ, by identity).
    Wake(std::sync::Weak<dyn std::any::Any + Send + Sync>),
    /// A foreign descriptor: registered one-shot and re-armed (`MOD`) on
    /// every wait, which checks that the number still names the
    /// registered file (`ENOENT` otherwise: registered anew).
    Foreign,
}

impl Clone for What {
    fn clone(&self) -> What {
        match self {
            What::Socket(w, c) => What::Socket(w.clone(), *c),
            What::Wake(w) => What::Wake(w.clone()),
            What::Foreign => What::Foreign,
        }
    }
}

impl What {
    fn same(&self, other: &What) -> bool {
        match (self, other) {
            (What::Socket(a, x), What::Socket(b, y)) => std::sync::Weak::ptr_eq(a, b) && x == y,
            (What::Wake(a), What::Wake(b)) => std::sync::Weak::ptr_eq(a, b),
            (What::Foreign, What::Foreign) => true,
            _ => false,
        }
    }

    fn dead(&self) -> bool {
        match self {
            What::Socket(w, _) => w.strong_count() == 0,
            What::Wake(w) => w.strong_count() == 0,
            What::Foreign => false,
        }
    }
}

/// One persistent registration (the slot of its descriptor number).
struct Reg {
    /// Unique per registration: an event whose token differs comes from
    /// a registration this table no longer knows (a stale one).
    token: u32,
    what: What,
    /// The wait round that last used it (a foreign descriptor: an event
    /// of one not given for the current round is dropped, and so is the
    /// registration; a QP's socket and a CQ's event fd go by their
    /// [`Member`]'s round).
    round: u64,
    /// A QP's socket or a CQ's event fd: the [`Member`] (CQ) it serves,
    /// by id; a foreign descriptor: its index this round.
    slot: usize,
    interest: i16,
}

/// What a set's epoll instance keeps of one CQ from one wait to the next
/// (found by [`CompletionQueue::wait_set_id`]; keeps neither the CQ nor
/// its QPs alive). A wait looks at its QPs' sockets only when the CQ's
/// hooks changed or their claim runs short: the work per CQ and wait is a
/// look-up, not a walk over its QPs with a claim each.
struct Member {
    /// The CQ's identity (keeps its address from being reused meanwhile).
    key: std::sync::Weak<dyn std::any::Any + Send + Sync>,
    /// The CQ's hook list when its sockets were last claimed (the same
    /// `Arc` while no QP came or went).
    hooks: Option<Arc<[std::sync::Weak<dyn Progress>]>>,
    /// The socket of each hook then, with its connection (`None`:
    /// nothing to watch).
    fds: Vec<Option<(RawFd, u64)>>,
    /// The claim on those sockets runs until then ([`crate::datamover::now_ns`]).
    claimed_until: u64,
    /// The CQ's wake-up event fd, registered.
    wake: Option<RawFd>,
    /// The CQ had something the last time (a completion, bytes on a QP's
    /// socket): its owner polls it after the wait, and a poll that finds
    /// it empty marks its QPs as busy-polled *now*, which ends the claim
    /// a moment later. The next wait claims them again.
    dirty: bool,
    /// The round that last used it, and the CQ's index in that round.
    round: u64,
    slot: usize,
}

/// Hashes a CQ's identity (an address, not chosen by a peer) with one
/// multiplication: looked up once per CQ and wait.
#[derive(Default, Clone, Copy)]
struct IdHash;

impl std::hash::BuildHasher for IdHash {
    type Hasher = IdHasher;
    fn build_hasher(&self) -> IdHasher {
        IdHasher(0)
    }
}

struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, id: usize) {
        // The low bits of an aligned address are zero: the high half of
        // the product is folded into the low one (the bucket index).
        let x = (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        self.0 = x ^ (x >> 32);
    }
}

/// The epoll instance of a set and what is registered in it.
struct EpState {
    ep: crate::sys::epoll::Epoll,
    /// The process's fork generation when made (a child leaves it alone).
    fork_gen: u64,
    /// Registrations by descriptor number.
    regs: Vec<Option<Reg>>,
    /// The CQs' state, by [`CompletionQueue::wait_set_id`].
    members: std::collections::HashMap<usize, Member, IdHash>,
    round: u64,
    next_token: u32,
    buf: Vec<libc::epoll_event>,
}

/// Every this many rounds, registrations of QPs and CQs that are gone are
/// forgotten (their descriptors closed, which removed them from epoll).
const SWEEP_ROUNDS: u64 = 4096;

impl EpState {
    fn new() -> io::Result<EpState> {
        Ok(EpState {
            ep: crate::sys::epoll::Epoll::new()?,
            fork_gen: crate::sys::epoll::fork_generation(),
            regs: Vec::new(),
            members: std::collections::HashMap::default(),
            round: 0,
            next_token: 0,
            buf: Vec::new(),
        })
    }

    fn data(fd: RawFd, token: u32) -> u64 {
        (u64::from(token) << 32) | u64::from(fd as u32)
    }

    /// Makes sure `fd` is registered for `what` with `events` (a known
    /// registration is modified, and added anew if the kernel says its
    /// number now names another file: `ENOENT`; a new one is added, and
    /// modified if the instance has it already: `EEXIST`); `Err(errno)` if
    /// epoll refuses it. A foreign descriptor is re-armed every time
    /// (one-shot).
    fn want(&mut self, fd: RawFd, what: What, events: u32, slot: usize) -> Result<(), i32> {
        let i = usize::try_from(fd).map_err(|_| libc::EBADF)?;
        if i >= self.regs.len() {
            self.regs.resize_with(i + 1, || None);
        }
        let round = self.round;
        if let Some(r) = &mut self.regs[i]
            && r.what.same(&what)
        {
            if r.round == round {
                // Twice in one round (a QP of two CQs of the set, a
                // descriptor given twice): the first use serves.
                if matches!(r.what, What::Foreign) {
                    let union = (events as i16) | r.interest;
                    if union != r.interest {
                        r.interest = union;
                        let d = Self::data(fd, r.token);
                        self.ep.ctl(
                            libc::EPOLL_CTL_MOD,
                            fd,
                            u32::from(union as u16) | libc::EPOLLONESHOT as u32,
                            d,
                        )?;
                    }
                }
                return Ok(());
            }
            r.round = round;
            r.slot = slot;
            r.interest = events as i16;
            if !matches!(r.what, What::Foreign) {
                return Ok(());
            }
            let d = Self::data(fd, r.token);
            match self.ep.ctl(libc::EPOLL_CTL_MOD, fd, events, d) {
                Ok(()) => return Ok(()),
                Err(libc::ENOENT) => {}
                Err(e) => {
                    self.regs[i] = None;
                    return Err(e);
                }
            }
        }
        let token = self.next_token;
        self.next_token = self.next_token.wrapping_add(1);
        let d = Self::data(fd, token);
        // Not registered for this set's records: mostly not in the
        // instance either (one `ADD`); one still there (a record swept while
        // its file lived) is modified.
        let r = match self.ep.ctl(libc::EPOLL_CTL_ADD, fd, events, d) {
            Err(libc::EEXIST) => self.ep.ctl(libc::EPOLL_CTL_MOD, fd, events, d),
            r => r,
        };
        match r {
            Ok(()) => {
                self.regs[i] = Some(Reg {
                    token,
                    what,
                    round,
                    slot,
                    interest: events as i16,
                });
                Ok(())
            }
            Err(e) => {
                self.regs[i] = None;
                Err(e)
            }
        }
    }

    /// Forgets the registrations of QPs and CQs that are gone, and the
    /// state of CQs gone or not waited on for a while (their
    /// registrations are dropped when they fire).
    fn sweep(&mut self) {
        for r in &mut self.regs {
            if r.as_ref().is_some_and(|r| r.what.dead()) {
                *r = None;
            }
        }
        let round = self.round;
        self.members.retain(|_, m| {
            m.key.strong_count() > 0 && m.round.saturating_add(SWEEP_ROUNDS) > round
        });
    }

    /// Removes the registration of `fd` (made for `what`) from the instance.
    fn drop_reg(&mut self, fd: RawFd, what: &What) {
        let Ok(i) = usize::try_from(fd) else { return };
        if self
            .regs
            .get(i)
            .and_then(Option::as_ref)
            .is_some_and(|r| r.what.same(what))
        {
            let _ = self.ep.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0);
            self.regs[i] = None;
        }
    }

    /// Claims the sockets of the QPs of `cq` (member `id`) until `until`
    /// and makes sure each is registered; a QP that no longer has one to
    /// watch (closed, in error) leaves the instance. Whether epoll refused
    /// a registration for a reason other than a closed descriptor.
    fn claim(
        &mut self,
        m: &mut Member,
        id: usize,
        hooks: Option<Arc<[std::sync::Weak<dyn Progress>]>>,
        until: u64,
    ) -> bool {
        let same = match (&m.hooks, &hooks) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if !same {
            m.fds.clear();
        }
        let mut broken = false;
        if let Some(list) = &hooks {
            m.fds.resize(list.len(), None);
            for (w, slot) in list.iter().zip(m.fds.iter_mut()) {
                // The connection before its socket (a newer one than the
                // socket's is only registered again at the next claim).
                let h = w.upgrade();
                let mut fd = None;
                // Twice at most: a connection made meanwhile is claimed
                // again at once.
                for _ in 0..2 {
                    let Some((fd_now, c)) = h.as_ref().and_then(|h| {
                        let c = h.connection();
                        h.sleep_on(Some(until)).map(|fd| (fd, c))
                    }) else {
                        break;
                    };
                    let what = What::Socket(w.clone(), c);
                    match self.want(fd_now, what.clone(), libc::EPOLLIN as u32, id) {
                        Ok(()) | Err(libc::EBADF) => {}
                        Err(_) => broken = true,
                    }
                    // The claim named the socket by its number: a QP reset
                    // and connected again between the claim and the
                    // registration had its old socket closed, and the
                    // number may name another file now (another QP's
                    // socket), which must not stay registered as this
                    // QP's. Registered, the file is held by the instance:
                    // a connection still the same now was the same then.
                    if h.as_ref().is_some_and(|h| h.connection() != c) {
                        self.drop_reg(fd_now, &what);
                        continue;
                    }
                    fd = Some((fd_now, c));
                    break;
                }
                // The socket of an earlier connection (or none any more):
                // its registration goes (its number may name another file).
                if let Some((old, c)) = *slot
                    && fd.is_none_or(|f| f != (old, c))
                {
                    self.drop_reg(old, &What::Socket(w.clone(), c));
                }
                *slot = fd;
            }
        }
        m.hooks = hooks;
        m.claimed_until = until;
        broken
    }
}

impl std::fmt::Debug for WaitSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitSet")
            .field("cqs", &self.cqs.len())
            .field("fds", &self.fds.len())
            .finish()
    }
}

impl WaitSet {
    /// An empty set.
    pub fn new() -> WaitSet {
        WaitSet::default()
    }

    /// Empties the set (keeps its buffers).
    pub fn clear(&mut self) {
        self.one_hook = None;
        self.cqs.clear();
        self.cq_ready.clear();
        self.cq_quiet.clear();
        self.fds.clear();
    }

    /// Whether the set has nothing to wait on.
    pub fn is_empty(&self) -> bool {
        self.cqs.is_empty() && self.fds.is_empty()
    }

    /// Adds a completion queue; returns its index for
    /// [`cq_ready`](Self::cq_ready).
    pub fn add_cq(&mut self, cq: &CompletionQueue) -> usize {
        self.one_hook = None;
        self.cqs.push(cq.clone());
        self.cq_ready.push(false);
        self.cq_quiet.push(false);
        self.cqs.len() - 1
    }

    /// Adds a completion queue whose completions alone are waited for:
    /// the sockets of its QPs are not watched (nor claimed from the
    /// receive threads), so bytes arriving for them do not end the wait
    /// until they are received (by the receive threads, or by another
    /// thread that waits on the CQ with [`add_cq`](Self::add_cq) or
    /// [`wait_receiving`](Self::wait_receiving)). Such a set sleeps in
    /// `ppoll(2)`. Returns its index for [`cq_ready`](Self::cq_ready).
    pub fn add_cq_completions(&mut self, cq: &CompletionQueue) -> usize {
        let i = self.add_cq(cq);
        self.cq_quiet[i] = true;
        i
    }

    /// Adds a foreign descriptor with `poll(2)` interest `events`
    /// (`POLLIN`, `POLLOUT`, ...; errors and hang-ups are always reported);
    /// returns its index for [`fd_revents`](Self::fd_revents). The caller
    /// keeps `fd` open during waits (a closed one reports `POLLNVAL`, as
    /// with `poll(2)`); a negative `fd` is ignored, as by `poll(2)`.
    pub fn add_fd(&mut self, fd: RawFd, events: i16) -> usize {
        self.fds.push(libc::pollfd {
            fd,
            events,
            revents: 0,
        });
        self.fds.len() - 1
    }

    /// Whether CQ `i` held a completion when the last wait returned.
    pub fn cq_ready(&self, i: usize) -> bool {
        self.cq_ready.get(i).copied().unwrap_or(false)
    }

    /// The `poll(2)` `revents` of foreign descriptor `i` after the last
    /// wait (0: not ready).
    pub fn fd_revents(&self, i: usize) -> i16 {
        self.fds.get(i).map_or(0, |p| p.revents)
    }

    /// Waits until a CQ of the set holds a completion or a foreign
    /// descriptor has events, at most `timeout` (`None`: no limit;
    /// zero: look once without sleeping). Returns how many entries are
    /// ready; see [`cq_ready`](Self::cq_ready) and
    /// [`fd_revents`](Self::fd_revents). 0: the time is up, or a CQ got a
    /// completion (or its QP received bytes) that another thread took out
    /// meanwhile: a spurious wake-up, on which the caller looks at what
    /// that thread may have changed (as after a condition variable's).
    ///
    /// # Errors
    ///
    /// [`WaitError::Interrupted`] if a signal was handled meanwhile
    /// (`EINTR`); [`WaitError::Io`] if `ppoll(2)` failed.
    pub fn wait(&mut self, timeout: Option<Duration>) -> Result<usize, WaitError> {
        self.wait_masked(timeout, None)
    }

    /// [`wait`](Self::wait) with the signal mask `mask` in force while the
    /// thread sleeps, as `ppoll(2)`/`pselect(2)` do (a signal unblocked by
    /// `mask` and pending, or arriving, ends the wait with
    /// [`WaitError::Interrupted`] once its handler ran). Between the
    /// set's internal naps the thread's own mask applies, so a signal
    /// blocked by it stays pending until the next nap.
    ///
    /// # Errors
    ///
    /// As [`wait`](Self::wait).
    pub fn wait_masked(
        &mut self,
        timeout: Option<Duration>,
        mask: Option<&SigSet>,
    ) -> Result<usize, WaitError> {
        if let Some(t) = timeout
            && t <= NAP_MAX
        {
            // One sleep covers it: the kernel's timeout is the deadline
            // (it ends the sleep no earlier), so no clock is read here.
            let off = self.ep_off;
            let (n, woke) = self.round(Some(t), mask)?;
            if n == 0 && !woke && self.ep_off != off {
                // epoll gave up without sleeping: the sleep in `ppoll(2)`.
                return self.round(Some(t), mask).map(|(n, _)| n);
            }
            return Ok(n);
        }
        let Some(timeout) = timeout else {
            // No timeout: sleeps of at most `NAP_MAX`, no clock read. Not
            // until woken: a change that pushes nothing (another thread's
            // `shutdown` of a stream a caller waits on, data it holds for
            // a later flush) wakes no one, and the caller must still look
            // again (see `NAP_MAX`).
            loop {
                let (n, woke) = self.round(Some(NAP_MAX), mask)?;
                if n > 0 || woke {
                    return Ok(n);
                }
            }
        };
        let deadline = clock::now().checked_add(timeout);
        loop {
            let nap = match deadline {
                Some(d) => d.saturating_duration_since(clock::now()).min(NAP_MAX),
                None => NAP_MAX,
            };
            let (n, woke) = self.round(Some(nap), mask)?;
            if n > 0 || woke || deadline.is_some_and(|d| clock::now() >= d) {
                return Ok(n);
            }
        }
    }

    /// [`wait`](Self::wait) for a set of one CQ with one QP (added with
    /// [`add_cq`](Self::add_cq), no foreign descriptor), sleeping in the
    /// QP's socket's `recv(2)` instead of `poll(2)`, as a blocking TCP
    /// reader does: one system call per wait (`poll(2)` and then a read
    /// otherwise), and the bytes received are processed at once. At most
    /// `timeout` (the socket's receive time limit, set when it changes;
    /// `Duration::MAX`: none, and no kernel timer armed per sleep, for a
    /// caller whom nothing but the socket's bytes can concern meanwhile);
    /// 0 ready entries when the time is up. The first such sleep makes the
    /// QP's socket blocking (clears `O_NONBLOCK` of the open socket, which
    /// every holder of a duplicate of its descriptor sees; the engine's
    /// own reads and writes say `MSG_DONTWAIT`) and sets its
    /// `SO_RCVTIMEO`: a caller that changes those on its duplicate
    /// changes the sleep (non-blocking ends these sleeps for the QP).
    ///
    /// Nothing but bytes on the socket (or its end, an error), a signal
    /// or the time limit ends that sleep: not a completion pushed to the
    /// CQ by another thread (a send the engine's thread finished, a post
    /// of another thread, a flush). Use it only while nothing of that
    /// kind can be needed before the time limit; another thread that
    /// waits meanwhile can wait for the CQ's completions with
    /// [`add_cq_completions`](Self::add_cq_completions).
    ///
    /// `Ok(None)`: it could not wait that way (another thread receives,
    /// the set is not one CQ with one QP, the QP has no socket or its
    /// socket cannot block: another holder of its descriptor made it
    /// non-blocking); nothing was waited for, and the caller waits with
    /// [`wait`](Self::wait).
    ///
    /// # Errors
    ///
    /// [`WaitError::Interrupted`] if a signal was handled meanwhile.
    pub fn wait_receiving(&mut self, timeout: Duration) -> Result<Option<usize>, WaitError> {
        self.wait_receiving_handed(timeout, &|| false, &mut || false, &mut None)
    }

    /// [`wait_receiving`](Self::wait_receiving) that may hand the receive
    /// completion of the bytes it received straight to the caller instead
    /// of queuing it on the CQ, saving the CQ's push and the caller's poll:
    /// that completion is put into `handed` (`None` there: none was), and
    /// the count of ready entries is the set's after it.
    ///
    /// `changed` is asked once the receive is the waiter's, just before
    /// it would sleep, after the look at the CQ (as that look): `true`
    /// (what the caller waits for may have come some other way, another
    /// of its threads took it in) ends the wait without a sleep, as a
    /// non-empty CQ does.
    ///
    /// `hand` is how the caller keeps every other consumer of the CQ away
    /// until it has handled the completion (typically: a try of the lock
    /// under which the caller's threads poll the CQ). It is called at most
    /// once, from inside the wait, with the QP's locks held, when bytes
    /// came and the CQ is exclusive ([`CqBuilder::exclusive`]). It must
    /// not block (nor use the QP or the CQ). If it answers `true`, the
    /// caller promises that no completion is taken out of the CQ, by any
    /// thread, before it has handled `handed`; the wait then keeps the
    /// run's first successful receive completion out of the CQ if the CQ
    /// may take it directly when it is made (it holds nothing, is not
    /// armed and nobody waits on it), and queues everything after it.
    /// Whoever holds the QP's connection makes every push of the CQ's
    /// only QP, and the wait holds it from that look to the capture: the
    /// caller sees what it would have seen had the completion been queued
    /// and polled at once. Anything else (a CQ that holds a completion, is
    /// armed or has waiters, `hand` answering `false`, an error
    /// completion) is queued as by [`wait_receiving`](Self::wait_receiving).
    /// `handed` stays `None` whenever `hand` was not called or answered
    /// `false`.
    ///
    /// Sends completed straight to their poster
    /// ([`QueuePair::post_send_now`](crate::QueuePair::post_send_now)) and
    /// a kept receive completion never pass each other: while the wait
    /// may keep one (from `hand`'s yes to the capture's end, a time in
    /// which the QP's connection lock may be let go around a large
    /// payload's read), a send's completion goes to the CQ (behind the
    /// kept one when the CQ is the receive's too), whoever posts it. If
    /// the wait unwinds (a panic) after keeping a completion, that one is
    /// queued on the CQ ahead of what the run queued after it.
    ///
    /// [`CqBuilder::exclusive`]: crate::cq::CqBuilder::exclusive
    ///
    /// # Errors
    ///
    /// As [`wait_receiving`](Self::wait_receiving).
    pub fn wait_receiving_handed(
        &mut self,
        timeout: Duration,
        changed: &dyn Fn() -> bool,
        hand: &mut dyn FnMut() -> bool,
        handed: &mut Option<WorkCompletion>,
    ) -> Result<Option<usize>, WaitError> {
        self.slept_in_recv = false;
        if self.cqs.len() != 1 || !self.fds.is_empty() || self.cq_quiet[0] {
            return Ok(None);
        }
        let Some(hook) = self.one_hook() else {
            return Ok(None);
        };
        // The claim (the receive threads leave the socket alone), and
        // what the waiter's own posts left is written. Not for the whole
        // sleep, as a `poll(2)` wait's: the sleeper holds the QP's receive
        // lock, which keeps the receive threads out meanwhile, and a
        // receive thread that met the claim leaves the socket until the
        // claim's end (bytes that come after this thread stopped waiting,
        // a peer's close, are served by it that much later).
        if hook.sleep_on_for(CLAIM_AFTER_NS).is_none() {
            return Ok(None);
        }
        let ready = self.look_cqs();
        let r = if ready > 0 {
            crate::cq::RxSleep::Received
        } else {
            // Looked at again once the receive is this waiter's: a
            // receive thread that held it when the CQ was looked at above
            // may have pushed a completion since (it would wait for the
            // sleep's timeout).
            let cq = &self.cqs[0];
            // Whether that look ended the wait (no sleep then).
            let found = std::cell::Cell::new(false);
            let ready = || {
                let r = !cq.is_empty() || changed();
                found.set(r);
                r
            };
            let r = hook.progress_sleep(timeout, &ready, hand, handed);
            self.slept_in_recv = r != crate::cq::RxSleep::Unable && !found.get();
            r
        };
        // The coarse clock, its step added (the claim outlasts the wait by
        // `CLAIM_AFTER_NS` while the clock trails by at most its step, a
        // little less otherwise): a fine reading per message cost about
        // 20 ns on a virtual machine.
        let (now, step) = crate::datamover::now_ns_coarse();
        hook.renew_claim(now.saturating_add(step).saturating_add(CLAIM_AFTER_NS));
        match r {
            crate::cq::RxSleep::Unable => Ok(None),
            crate::cq::RxSleep::Interrupted if self.look_cqs() == 0 && handed.is_none() => {
                Err(WaitError::Interrupted)
            }
            _ => Ok(Some(self.look_cqs())),
        }
    }

    /// The one QP hook of the set's one CQ (`None`: none, or more than
    /// one), from the cache while the CQ's hooks are unchanged.
    fn one_hook(&mut self) -> Option<Arc<dyn crate::cq::Progress>> {
        let cq = &self.cqs[0];
        // Before the list: a change after this is seen at the next wait.
        let generation = cq.hooks_generation();
        if let Some((g, w)) = &self.one_hook
            && *g == generation
        {
            return w.upgrade();
        }
        self.one_hook = None;
        let list = cq.wait_set_hooks()?;
        let [one] = &list[..] else {
            return None;
        };
        self.one_hook = Some((generation, one.clone()));
        one.upgrade()
    }

    /// Whether the last [`wait_receiving`](Self::wait_receiving) slept in
    /// the socket's `recv` (not: it found a completion first, or could not).
    pub fn slept_in_recv(&self) -> bool {
        self.slept_in_recv
    }

    /// One sleep of at most `nap` (`None`: until woken); returns the number
    /// of ready entries and whether a CQ's socket or event fd woke it.
    fn round(
        &mut self,
        nap: Option<Duration>,
        mask: Option<&SigSet>,
    ) -> Result<(usize, bool), WaitError> {
        let epoll = !self.ep_off
            && !self.cq_quiet.contains(&true)
            && match mode() {
                Mode::Ppoll => false,
                Mode::Epoll => true,
                Mode::Auto => self.cqs.len() + self.fds.len() >= EPOLL_MIN,
            };
        if epoll {
            if let Some(r) = self.round_epoll(nap, mask) {
                return r;
            }
            self.ep_off = true;
            self.ep = None;
        }
        self.round_ppoll(nap, mask)
    }

    /// [`round`](Self::round) with one `ppoll(2)` over every descriptor.
    fn round_ppoll(
        &mut self,
        nap: Option<Duration>,
        mask: Option<&SigSet>,
    ) -> Result<(usize, bool), WaitError> {
        self.pfds.clear();
        self.hooks.clear();
        self.wakes.clear();
        for p in &mut self.fds {
            p.revents = 0;
        }
        self.pfds.extend_from_slice(&self.fds);
        // From here a push to any of the CQs wakes the set's waker (or
        // signals the CQ's event fd): a completion that arrives after the
        // look below wakes the sleep.
        let generation = crate::sys::epoll::fork_generation();
        if self.waker.as_ref().is_none_or(|w| w.1 != generation) {
            self.waker = take_waker(spare_wakers())
                .ok()
                .map(|w| (Arc::new(w), generation));
        }
        let waker = self.waker.as_ref().map(|w| Arc::clone(&w.0));
        // What the waiter's own posts left for its next poll is written
        // before it registers: their completions are found by the look
        // below, not signalled to this very thread.
        for (i, cq) in self.cqs.iter().enumerate() {
            if !self.cq_quiet[i]
                && let Some(list) = cq.wait_set_hooks()
            {
                for hook in list.iter().filter_map(std::sync::Weak::upgrade) {
                    hook.write_deferred();
                }
            }
        }
        let mut wake_fds = std::mem::take(&mut self.wake_fds);
        wake_fds.clear();
        for cq in &self.cqs {
            match &waker {
                Some(w) => cq.waiter_enter(w),
                None => wake_fds.push(cq.wait_set_enter()),
            }
        }
        let mut ready = self.look_cqs();
        let nap = if ready > 0 {
            Some(Duration::ZERO)
        } else if waker.is_none() {
            // The CQs' shared event fds: a waiter that reads one may take
            // another's wake-up, so the sleep stays bounded.
            Some(nap.unwrap_or(NAP_MAX))
        } else {
            nap
        };
        // The QPs' sockets, claimed from the receive threads until the end
        // of the nap: bytes arriving wake this thread, which runs the
        // receive path itself. Also when a CQ is ready already (a look
        // without sleeping): a thread that keeps waiting on the set keeps
        // receiving for its QPs, and the engine's threads keep out of them
        // (no hand-off, no re-arm of their registrations per message).
        let claim = nap.unwrap_or(NAP_MAX);
        let until = crate::datamover::now_ns()
            .saturating_add(u64::try_from(claim.as_nanos()).unwrap_or(u64::MAX))
            .saturating_add(1_000_000);
        for (i, cq) in self.cqs.iter().enumerate() {
            if self.cq_quiet[i] {
                continue;
            }
            let Some(list) = cq.wait_set_hooks() else {
                continue;
            };
            for hook in list.iter().filter_map(std::sync::Weak::upgrade) {
                if let Some(fd) = hook.sleep_on(Some(until)) {
                    self.pfds.push(libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    self.hooks.push((i, hook));
                }
            }
        }
        if ready == 0 {
            if let Some(w) = &waker {
                self.pfds.push(libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&**w),
                    events: libc::POLLIN,
                    revents: 0,
                });
                self.wakes.push(usize::MAX);
            }
            for (i, fd) in wake_fds.iter().enumerate() {
                if let Some(fd) = *fd {
                    self.pfds.push(libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                    self.wakes.push(i);
                }
            }
        }
        self.wake_fds = wake_fds;
        let res = match mask {
            Some(_) => crate::sys::ppoll::ppoll(&mut self.pfds, nap, mask),
            None => crate::sys::ppoll::poll(&mut self.pfds, nap),
        };
        // Awake: completions pushed from here on (by the receive path run
        // below in this very thread, above all) need not signal the event
        // fds (a write, and a read to drain it, per message otherwise).
        for cq in &self.cqs {
            match &waker {
                Some(w) => cq.waiter_leave(w),
                None => cq.wait_set_leave(),
            }
        }
        let nf = self.fds.len();
        let mut woke = false;
        let res = match res {
            Ok(_) => {
                for (p, r) in self.fds.iter_mut().zip(&self.pfds[..nf]) {
                    p.revents = r.revents;
                }
                let sockets = &self.pfds[nf..nf + self.hooks.len()];
                for ((_, hook), p) in self.hooks.iter().zip(sockets) {
                    if p.revents != 0 {
                        // Bytes (or an error) on the QP's socket: receive
                        // in this thread (no second look at the socket).
                        hook.progress_readable();
                        woke = true;
                    }
                }
                let wakes = &self.pfds[nf + self.hooks.len()..];
                for (&i, p) in self.wakes.iter().zip(wakes) {
                    if p.revents != 0 {
                        match (&waker, self.cqs.get(i)) {
                            // Read, then let pushes write again: the look
                            // at the CQs below sees what a push that did
                            // not write announced.
                            (Some(w), None) => w.reset(),
                            (_, Some(cq)) => cq.wait_set_drain(),
                            (None, None) => {}
                        }
                        woke = true;
                    }
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(WaitError::Interrupted),
            Err(e) => Err(WaitError::Io(e)),
        };
        // The hooks (and so the sockets' owners) were alive across the
        // wait. The claim outlasts it by `CLAIM_AFTER_NS` (then the receive
        // threads' usual quiet period): an event loop that waits again
        // within that time keeps receiving for its QPs itself.
        // The sockets were found before the wait: only the time is renewed.
        let after = crate::datamover::now_ns().saturating_add(CLAIM_AFTER_NS);
        for (_, hook) in &self.hooks {
            hook.renew_claim(after);
        }
        self.hooks.clear();
        res?;
        ready = self.look_cqs();
        ready += self.fds.iter().filter(|p| p.revents != 0).count();
        Ok((ready, woke))
    }

    /// [`round`](Self::round) in the set's own epoll instance: the QPs'
    /// sockets and the CQs' event fds stay registered from one wait to
    /// the next (a system call only when one comes or changes), the
    /// foreign descriptors are re-armed one-shot (one `epoll_ctl` each);
    /// the kernel's work in the wait is per ready descriptor, not per
    /// descriptor of the set. `None`: epoll failed where `ppoll(2)` would
    /// not (nothing was waited on; the caller falls back).
    fn round_epoll(
        &mut self,
        nap: Option<Duration>,
        mask: Option<&SigSet>,
    ) -> Option<Result<(usize, bool), WaitError>> {
        // The CQs' event fds are shared by every epoll waiter of a CQ (a
        // waiter that reads one may take another's wake-up): the sleep
        // stays bounded.
        let nap = nap.unwrap_or(NAP_MAX);
        let fork_gen = crate::sys::epoll::fork_generation();
        if self.ep.as_ref().is_some_and(|e| e.fork_gen != fork_gen) {
            // Made before a fork: shared with the parent; this process
            // closes its copy and makes its own.
            self.ep = None;
        }
        if self.ep.is_none() {
            self.ep = Some(EpState::new().ok()?);
        }
        let mut ep = self.ep.take()?;
        ep.round += 1;
        if ep.round.is_multiple_of(SWEEP_ROUNDS) {
            ep.sweep();
        }
        self.hooks.clear();
        // Foreign descriptors first (nothing else is changed yet if one
        // fails in an unexpected way).
        let mut ready = 0;
        for k in 0..self.fds.len() {
            let p = self.fds[k];
            self.fds[k].revents = 0;
            if p.fd < 0 {
                continue;
            }
            let ev = u32::from(p.events as u16) | libc::EPOLLONESHOT as u32;
            match ep.want(p.fd, What::Foreign, ev, k) {
                Ok(()) => {}
                Err(libc::EBADF) => self.fds[k].revents = libc::POLLNVAL,
                Err(libc::EPERM) => self.fds[k].revents = ALWAYS_READY & p.events,
                Err(_) => return None,
            }
            ready += usize::from(self.fds[k].revents != 0);
        }
        // The claims on the QPs' sockets cover the nap and
        // `CLAIM_AFTER_NS` after it; they are renewed (a walk over the
        // CQ's QPs) only when less than half of that after-time is left,
        // not on every wait, so that a wait costs a look-up per CQ.
        let now = crate::datamover::now_ns();
        let nap_ns = u64::try_from(nap.as_nanos()).unwrap_or(u64::MAX);
        let need = now
            .saturating_add(nap_ns)
            .saturating_add(CLAIM_AFTER_NS / 2);
        let until = now.saturating_add(nap_ns).saturating_add(CLAIM_AFTER_NS);
        let round = ep.round;
        let mut members = std::mem::take(&mut ep.members);
        // A registration epoll refused for a reason other than a closed
        // descriptor: this round does not sleep, the next ones use ppoll.
        let mut broken = false;
        for (i, cq) in self.cqs.iter().enumerate() {
            // From here a push to the CQ signals its event fd: a
            // completion that arrives after the look below wakes the sleep.
            let wake = cq.wait_set_enter();
            let id = cq.wait_set_id();
            let m = members.entry(id).or_insert_with(|| Member {
                key: cq.wait_set_key(),
                hooks: None,
                fds: Vec::new(),
                claimed_until: 0,
                wake: None,
                dirty: false,
                round: 0,
                slot: 0,
            });
            if m.round == round {
                // The same CQ twice in the set: the first serves.
                continue;
            }
            m.round = round;
            m.slot = i;
            // A quiet CQ whose claim holds is not looked at any further
            // (a QP that joins it meanwhile is found at the next renewal;
            // until then the receive threads serve it and its completions
            // wake the set through the event fd).
            if m.hooks.is_none() || m.dirty || m.claimed_until < need {
                broken |= ep.claim(m, id, cq.wait_set_hooks(), until);
                m.dirty = false;
            }
            if let Some(fd) = wake
                && m.wake != Some(fd)
            {
                match ep.want(fd, What::Wake(m.key.clone()), libc::EPOLLIN as u32, id) {
                    Ok(()) => m.wake = Some(fd),
                    Err(libc::EBADF) => {}
                    Err(_) => broken = true,
                }
            }
        }
        ready += self.look_cqs();
        let nap = if ready > 0 || broken {
            Duration::ZERO
        } else {
            nap
        };
        let want = (self.cqs.len() * 2 + self.fds.len()).clamp(16, 1024);
        if ep.buf.len() < want {
            ep.buf.resize(want, libc::epoll_event { events: 0, u64: 0 });
        }
        let res = {
            let EpState { ep: e, buf, .. } = &mut ep;
            e.wait(buf, Some(nap), mask)
        };
        // Awake: completions pushed from here on (by the receive path run
        // below in this very thread, above all) need not signal the event
        // fds.
        for cq in &self.cqs {
            cq.wait_set_leave();
        }
        let mut woke = false;
        let mut stale = false;
        let mut lost = false;
        let res = match res {
            Ok(n) => {
                for k in 0..n {
                    let e = ep.buf[k];
                    let (data, bits) = (e.u64, e.events);
                    let fd = data as u32 as RawFd;
                    let token = (data >> 32) as u32;
                    let Some(r) = usize::try_from(fd)
                        .ok()
                        .and_then(|i| ep.regs.get(i))
                        .and_then(Option::as_ref)
                        .filter(|r| r.token == token)
                    else {
                        // A registration this table does not know: of a
                        // file closed here but open elsewhere (a
                        // duplicate, a child), under a number now reused.
                        stale = true;
                        continue;
                    };
                    // Whether the registration belongs to this wait: a
                    // foreign descriptor given for it, or a QP's socket or
                    // CQ's event fd of a CQ in it.
                    let member = match r.what {
                        What::Foreign => None,
                        _ => Some(r.slot),
                    };
                    let current = match member {
                        None => r.round == round,
                        Some(id) => members.get(&id).is_some_and(|m| m.round == round),
                    };
                    let what = r.what.clone();
                    if !current {
                        // Not part of this wait (a connection the caller
                        // no longer waits on): dropped until it is, and
                        // the CQ's state with it (made anew, with every
                        // registration, when it comes back).
                        let i = fd as usize;
                        match ep.ep.ctl(libc::EPOLL_CTL_DEL, fd, 0, 0) {
                            Ok(()) => ep.regs[i] = None,
                            Err(_) => stale = true,
                        }
                        if let Some(id) = member {
                            members.remove(&id);
                        }
                        continue;
                    }
                    match &what {
                        What::Socket(w, c) if w.upgrade().is_some_and(|h| h.connection() != *c) => {
                            // A socket of the QP's earlier connection (its
                            // number may name another file now): not this
                            // QP's to receive for, nor to end the wait.
                            ep.drop_reg(fd, &what);
                        }
                        What::Socket(w, _) => {
                            // Bytes (or an error) on the QP's socket:
                            // receive in this thread.
                            let hook = w.upgrade();
                            let done = hook.as_ref().is_some_and(|h| h.progress_readable());
                            woke = true;
                            if let Some(m) = member.and_then(|id| members.get_mut(&id)) {
                                m.dirty = true;
                            }
                            // Nothing to do for a readable socket: a QP
                            // that stopped receiving (closed, in error; its
                            // socket at its end stays readable) leaves the
                            // instance rather than wake every wait.
                            let gone = !done
                                && hook
                                    .as_ref()
                                    .and_then(|h| {
                                        let until = member
                                            .and_then(|id| members.get(&id))
                                            .map_or(0, |m| m.claimed_until);
                                        h.sleep_on(Some(until))
                                    })
                                    .is_none();
                            if gone {
                                ep.drop_reg(fd, &what);
                                if let Some(m) = member.and_then(|id| members.get_mut(&id)) {
                                    for f in &mut m.fds {
                                        if f.is_some_and(|(f, _)| f == fd) {
                                            *f = None;
                                        }
                                    }
                                }
                            }
                        }
                        What::Wake(_) => {
                            if let Some(cq) =
                                member.and_then(|id| members.get_mut(&id)).and_then(|m| {
                                    m.dirty = true;
                                    self.cqs.get(m.slot)
                                })
                            {
                                cq.wait_set_drain();
                                woke = true;
                            }
                        }
                        What::Foreign => {
                            let got = bits as u16 as i16;
                            for p in self.fds.iter_mut().filter(|p| p.fd == fd) {
                                p.revents |= got & (p.events | libc::POLLERR | libc::POLLHUP);
                            }
                        }
                    }
                }
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(WaitError::Interrupted),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBADF | libc::EINVAL)) => {
                // The instance's descriptor was closed (or its number
                // reused) by someone else, as a program that closes every
                // descriptor does: not this set's to close any more. A
                // spurious wake-up; `ppoll(2)` from now on.
                lost = true;
                woke = true;
                Ok(())
            }
            Err(e) => Err(WaitError::Io(e)),
        };
        let ready = self.look_cqs();
        if ready > 0 {
            for (cq, _) in self.cqs.iter().zip(&self.cq_ready).filter(|(_, r)| **r) {
                if let Some(m) = members.get_mut(&cq.wait_set_id()) {
                    m.dirty = true;
                }
            }
        }
        ep.members = members;
        if lost {
            ep.ep.forget();
            self.ep_off = true;
        } else if stale {
            // Start over with a fresh instance (everything of the next
            // wait registered anew, once): the stale registration goes
            // with the old one.
            drop(ep);
        } else {
            self.ep = Some(ep);
        }
        if broken {
            self.ep_off = true;
            self.ep = None;
        }
        if let Err(e) = res {
            return Some(Err(e));
        }
        let ready = ready + self.fds.iter().filter(|p| p.revents != 0).count();
        Some(Ok((ready, woke)))
    }

    /// Marks the CQs holding completions; returns how many do.
    fn look_cqs(&mut self) -> usize {
        let mut n = 0;
        for (cq, r) in self.cqs.iter().zip(self.cq_ready.iter_mut()) {
            *r = !cq.is_empty();
            n += usize::from(*r);
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cq::Progress;
    use crate::{Device, WcOpcode, WorkCompletion};
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::Weak;
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    /// A QP's stand-in: its "socket" is one end of a stream pair; a byte
    /// on it is a message, received into a completion.
    struct Hook {
        cq: CompletionQueue,
        sock: UnixStream,
        progress: AtomicUsize,
        readable: AtomicUsize,
        sleep_on: AtomicUsize,
        renewed: AtomicU64,
        /// A Send left for the poster's next poll (a completion at once
        /// when written).
        deferred: std::sync::atomic::AtomicBool,
    }

    impl Hook {
        fn write_deferred_send(&self) {
            if self.deferred.swap(false, Ordering::SeqCst) {
                self.cq
                    .push(WorkCompletion::success(99, WcOpcode::Send, 0), false)
                    .unwrap();
            }
        }

        fn receive(&self) -> bool {
            receive_ids(&self.sock, &self.cq)
        }
    }

    /// Reads what the socket has and completes a receive per octet (its
    /// value the request id); whether it read anything.
    fn receive_ids(sock: &UnixStream, cq: &CompletionQueue) -> bool {
        let mut b = [0u8; 16];
        match (&*sock).read(&mut b) {
            Ok(n) if n > 0 => {
                for &id in &b[..n] {
                    cq.push(
                        WorkCompletion::success(u64::from(id), WcOpcode::Recv, 1),
                        false,
                    )
                    .unwrap();
                }
                true
            }
            _ => false,
        }
    }

    impl Progress for Hook {
        fn progress(&self, _armed: bool) -> bool {
            self.progress.fetch_add(1, Ordering::Relaxed);
            self.receive()
        }

        fn progress_readable(&self) -> bool {
            self.readable.fetch_add(1, Ordering::Relaxed);
            self.receive()
        }

        fn write_deferred(&self) {
            self.write_deferred_send();
        }

        fn sleep_on(&self, until_ns: Option<u64>) -> Option<RawFd> {
            // A sleeping waiter is a poll: deferred posts go (as a QP's).
            self.write_deferred_send();
            self.sleep_on.fetch_add(1, Ordering::Relaxed);
            if let Some(u) = until_ns {
                self.renewed.store(u, Ordering::Relaxed);
            }
            Some(self.sock.as_raw_fd())
        }

        fn renew_claim(&self, until_ns: u64) {
            self.renewed.store(until_ns, Ordering::Relaxed);
        }
    }

    type Quiet = Vec<(UnixStream, UnixStream)>;

    /// A device whose threads neither spin nor are pinned.
    fn quiet_device() -> Device {
        Device::open_with(crate::DeviceConfig {
            poll_spin: Duration::ZERO,
            pin_threads: false,
            ..crate::DeviceConfig::default()
        })
        .unwrap()
    }

    /// A CQ with a [`Hook`], the hook's peer end, and `extra_fds` quiet
    /// stream pairs (both ends kept open: never readable).
    fn hooked(extra_fds: usize) -> (CompletionQueue, Arc<Hook>, UnixStream, Quiet) {
        let dev = quiet_device();
        let cq = CompletionQueue::new(&dev, 64, None).unwrap();
        let (ours, theirs) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let hook = Arc::new(Hook {
            cq: cq.clone(),
            sock: ours,
            progress: AtomicUsize::new(0),
            readable: AtomicUsize::new(0),
            sleep_on: AtomicUsize::new(0),
            renewed: AtomicU64::new(0),
            deferred: std::sync::atomic::AtomicBool::new(false),
        });
        let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
        cq.attach_progress(weak);
        let quiet = (0..extra_fds)
            .map(|_| UnixStream::pair().unwrap())
            .collect();
        (cq, hook, theirs, quiet)
    }

    /// A descriptor new to a set's records is added (the common case, one
    /// `epoll_ctl`), and one the instance has already (a record forgotten
    /// while its file lived) is modified instead; either way it reports
    /// its readiness. A known foreign descriptor is re-armed.
    #[test]
    fn new_registrations_are_added_and_known_ones_modified() {
        use std::io::Write;
        let mut st = EpState::new().unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        let (c, d) = UnixStream::pair().unwrap();
        let ev = libc::EPOLLIN as u32 | libc::EPOLLONESHOT as u32;
        // In the instance, unknown to the records.
        st.ep.ctl(libc::EPOLL_CTL_ADD, c.as_raw_fd(), 0, 0).unwrap();
        st.want(a.as_raw_fd(), What::Foreign, ev, 0).unwrap();
        st.want(c.as_raw_fd(), What::Foreign, ev, 1).unwrap();
        let ready = |st: &mut EpState| {
            let mut buf = [libc::epoll_event { events: 0, u64: 0 }; 8];
            let n = st.ep.wait(&mut buf, Some(Duration::ZERO), None).unwrap();
            let mut fds: Vec<RawFd> = buf[..n].iter().map(|e| e.u64 as u32 as RawFd).collect();
            fds.sort_unstable();
            fds
        };
        assert!(ready(&mut st).is_empty());
        (&b).write_all(b"x").unwrap();
        (&d).write_all(b"y").unwrap();
        let mut both = vec![a.as_raw_fd(), c.as_raw_fd()];
        both.sort_unstable();
        assert_eq!(ready(&mut st), both);
        // One-shot: silent until re-armed in the next round.
        assert!(ready(&mut st).is_empty());
        st.round += 1;
        st.want(a.as_raw_fd(), What::Foreign, ev, 0).unwrap();
        assert_eq!(ready(&mut st), vec![a.as_raw_fd()]);
    }

    /// A wait woken by bytes on a QP's socket receives through
    /// `progress_readable` (no second look at the socket, no busy-poll
    /// mark that would end the waiter's claim), never `progress`, and
    /// renews the claim after the wait without looking the socket up
    /// again: one `sleep_on` per wait (before the sleep). In both ways of
    /// sleeping (a small set: `ppoll`; four entries or more: epoll).
    #[test]
    fn a_readable_socket_is_received_without_a_second_look() {
        for extra in [0, 3] {
            let (cq, hook, mut peer, quiet) = hooked(extra);
            let mut set = WaitSet::new();
            set.add_cq(&cq);
            for q in &quiet {
                set.add_fd(q.0.as_raw_fd(), libc::POLLIN);
            }
            let mut out = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
            for id in 1..=20u8 {
                peer.write_all(&[id]).unwrap();
                let before = crate::datamover::now_ns();
                let mut got = 0;
                while got == 0 {
                    let n = set.wait(Some(Duration::from_secs(10))).unwrap();
                    assert!(n <= 1, "only the CQ is ready");
                    got = cq.poll(&mut out[..1]);
                }
                assert_eq!(out[0].wr_id, u64::from(id), "set of {} entries", 1 + extra);
                assert!(
                    hook.renewed.load(Ordering::Relaxed) >= before + CLAIM_AFTER_NS,
                    "the claim outlasts the wait"
                );
            }
            assert_eq!(hook.progress.load(Ordering::Relaxed), 0, "extra {extra}");
            assert!(hook.readable.load(Ordering::Relaxed) >= 20);
            if extra == 0 {
                // ppoll: the socket is looked up once per wait, not twice.
                assert_eq!(
                    hook.sleep_on.load(Ordering::Relaxed),
                    hook.readable.load(Ordering::Relaxed)
                );
            }
        }
    }

    /// A waiter whose own Send was left for its next poll finds the Send's
    /// completion when it looks at the CQ, without waking itself: the Send
    /// is written before the waiter registers with the CQ. (It was written
    /// when the waiter claimed the socket, after it registered: its
    /// completion wrote the waiter's own event fd, and the wait returned
    /// at once to read it: two system calls and a wasted wait per
    /// connection of sockets direct.)
    #[test]
    fn a_waiters_own_deferred_send_does_not_wake_it() {
        let (cq, hook, _peer, _) = hooked(0);
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        // A first wait makes the set's waker (or takes a spare one).
        assert_eq!(set.wait(Some(Duration::from_millis(1))).unwrap(), 0);
        let writes = set.waker.as_ref().expect("the set's waker").0.writes();
        hook.deferred.store(true, Ordering::SeqCst);
        assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
        assert_eq!(cq.poll_one().map(|wc| wc.wr_id), Some(99));
        let waker = set.waker.as_ref().expect("the set's waker");
        assert_eq!(waker.0.writes(), writes, "the waiter woke itself");
    }

    /// A dropped wait set's waker is kept for the next set (no event fd
    /// made and closed per connection), unless another holder still has
    /// it or a wake count is left in it; a new one is made when none is
    /// kept.
    #[test]
    fn wakers_of_dropped_sets_are_reused() {
        let spare = parking_lot::Mutex::new(Vec::new());
        let w = Arc::new(take_waker(&spare).unwrap());
        let fd = std::os::fd::AsRawFd::as_raw_fd(&*w);
        give_waker(&spare, w);
        assert_eq!(spare.lock().len(), 1);
        let again = take_waker(&spare).unwrap();
        assert_eq!(std::os::fd::AsRawFd::as_raw_fd(&again), fd);
        assert!(spare.lock().is_empty());
        // Readable (a wake not yet read): not kept.
        again.wake();
        give_waker(&spare, Arc::new(again));
        assert!(spare.lock().is_empty());
        // Held elsewhere (a CQ's waiter list): not kept.
        let held = Arc::new(take_waker(&spare).unwrap());
        let other = Arc::clone(&held);
        give_waker(&spare, held);
        assert!(spare.lock().is_empty());
        drop(other);
    }

    /// A timeout within one nap ends the wait after one sleep with nothing
    /// ready (no clock is read for it); a completion pushed meanwhile by
    /// another thread still ends it early through the CQ's event fd.
    #[test]
    fn a_short_timeout_is_one_sleep_and_a_push_still_wakes_it() {
        let (cq, hook, _peer, _) = hooked(0);
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        assert_eq!(set.wait(Some(Duration::from_millis(2))).unwrap(), 0);
        assert_eq!(hook.sleep_on.load(Ordering::Relaxed), 1, "one sleep");
        let pusher = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cq.push(WorkCompletion::success(7, WcOpcode::Send, 0), false)
                    .unwrap();
            })
        };
        let mut n = 0;
        while n == 0 {
            n = set.wait(Some(NAP_MAX)).unwrap();
        }
        assert!(set.cq_ready(0));
        pusher.join().unwrap();
    }

    /// Regression (waits without a timeout sleep with no timer): two
    /// threads waiting on one CQ with sets of their own are both woken by
    /// one push. With one shared descriptor, the first to read it could
    /// take the other's wake-up, which then slept on.
    #[test]
    fn regression_two_waiters_on_one_cq_are_both_woken() {
        let cq = CompletionQueue::new(&Device::open_default().unwrap(), 8, None).unwrap();
        for i in 0..200u64 {
            let (tx, rx) = std::sync::mpsc::channel();
            for _ in 0..2 {
                let cq = cq.clone();
                let tx = tx.clone();
                std::thread::spawn(move || {
                    let mut set = WaitSet::new();
                    set.add_cq(&cq);
                    let n = set.wait(None).unwrap();
                    let _ = tx.send((n, set.cq_ready(0)));
                });
            }
            for _ in 0..(i % 32) * 100 {
                std::hint::spin_loop();
            }
            cq.push(WorkCompletion::success(i, WcOpcode::Recv, 1), false)
                .unwrap();
            for _ in 0..2 {
                let r = rx.recv_timeout(Duration::from_secs(60));
                assert_eq!(r.ok(), Some((1, true)), "round {i}: a waiter slept on");
            }
            assert!(cq.poll_one().is_some());
        }
    }

    /// A QP's stand-in that is reset and connected again between its
    /// first claim and that claim's use: the claim names `stale` (the
    /// number of its old socket, which another socket took once the old
    /// one was closed), its connection changes meanwhile, and its later
    /// claims name its new socket, `sock`.
    struct Reconnects {
        cq: CompletionQueue,
        sock: UnixStream,
        stale: RawFd,
        connection: AtomicU64,
        claimed: std::sync::atomic::AtomicBool,
        readable: AtomicUsize,
    }

    impl Progress for Reconnects {
        fn progress(&self, _armed: bool) -> bool {
            self.progress_readable()
        }

        fn progress_readable(&self) -> bool {
            self.readable.fetch_add(1, Ordering::Relaxed);
            receive_ids(&self.sock, &self.cq)
        }

        fn connection(&self) -> u64 {
            self.connection.load(Ordering::Relaxed)
        }

        fn sleep_on(&self, until_ns: Option<u64>) -> Option<RawFd> {
            if until_ns.is_some() && !self.claimed.swap(true, Ordering::Relaxed) {
                // Read before the reset; the QP is connected again by the
                // time the number is used.
                self.connection.store(1, Ordering::Relaxed);
                return Some(self.stale);
            }
            Some(self.sock.as_raw_fd())
        }
    }

    /// Regression (a wait's claim names the QP's socket by its number): a
    /// QP reset and connected again between its claim and the wait's
    /// registration of the number had its old socket closed, and the
    /// number, taken by another QP's socket meanwhile, stayed registered
    /// as this QP's: every byte for the other QP woke the set and ran this
    /// QP's receive path, for as long as that socket lived. The claim's
    /// connection is checked once the number is registered (and a
    /// registration of an earlier connection is dropped when it fires).
    #[test]
    fn a_claimed_number_that_names_another_socket_by_its_use_is_not_watched() {
        let dev = quiet_device();
        let cq = CompletionQueue::new(&dev, 64, None).unwrap();
        // The other QP's socket, with bytes its own receiver has not read.
        let (other, mut other_peer) = UnixStream::pair().unwrap();
        other_peer.write_all(b"x").unwrap();
        let (ours, mut our_peer) = UnixStream::pair().unwrap();
        ours.set_nonblocking(true).unwrap();
        let hook = Arc::new(Reconnects {
            cq: cq.clone(),
            sock: ours,
            stale: other.as_raw_fd(),
            connection: AtomicU64::new(0),
            claimed: std::sync::atomic::AtomicBool::new(false),
            readable: AtomicUsize::new(0),
        });
        let weak: Weak<dyn Progress> = Arc::downgrade(&(hook.clone() as Arc<dyn Progress>));
        cq.attach_progress(weak);
        // Four entries: the set sleeps in epoll.
        let quiet: Vec<_> = (0..3).map(|_| UnixStream::pair().unwrap()).collect();
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        for q in &quiet {
            set.add_fd(q.0.as_raw_fd(), libc::POLLIN);
        }
        for _ in 0..5 {
            assert_eq!(set.wait(Some(Duration::from_millis(5))).unwrap(), 0);
        }
        assert_eq!(
            hook.readable.load(Ordering::Relaxed),
            0,
            "the other QP's bytes ran this QP's receive path"
        );
        // Its own socket is watched.
        our_peer.write_all(&[7]).unwrap();
        let mut out = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while cq.poll(&mut out) == 0 {
            assert!(std::time::Instant::now() < deadline, "never received");
            let _ = set.wait(Some(Duration::from_millis(50))).unwrap();
        }
        assert_eq!(out[0].wr_id, 7);
        drop(other);
    }

    /// A wait in `recv` renews the QP's claim on its socket until
    /// `CLAIM_AFTER_NS` past the coarse clock's reading at the wait's end
    /// plus the clock's step (the coarse clock trails the time by up to
    /// about a step): bracketed by the coarse readings before and after.
    #[test]
    fn a_wait_in_recv_renews_the_claim_past_its_end_from_the_coarse_clock() {
        let (cq, hook, _peer, _) = hooked(0);
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        for _ in 0..50 {
            let (before, step) = crate::datamover::now_ns_coarse();
            assert_eq!(set.wait_receiving(Duration::from_millis(1)).unwrap(), None);
            let (after, _) = crate::datamover::now_ns_coarse();
            let renewed = hook.renewed.load(Ordering::Relaxed);
            assert!(
                renewed >= before + step + CLAIM_AFTER_NS,
                "claim until {renewed}, coarse clock at {before} before the wait, step {step}"
            );
            assert!(
                renewed <= after + step + CLAIM_AFTER_NS,
                "claim until {renewed}, coarse clock at {after} after the wait, step {step}"
            );
        }
    }

    /// A wait that sleeps in a QP's `recv` takes the CQ's one hook from
    /// the set's cache while the CQ's hooks are unchanged, and the new one
    /// once they changed (a hook gone, another one come); with two hooks
    /// it takes none. (The stand-in cannot sleep in `recv`: each wait
    /// claims the hook's socket, `sleep_on`, and returns `None`.)
    #[test]
    fn a_wait_in_recv_follows_a_change_of_the_cqs_hook() {
        let (cq, first, _peer, _) = hooked(0);
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        let short = Duration::from_millis(1);
        assert_eq!(set.wait_receiving(short).unwrap(), None);
        assert_eq!(set.wait_receiving(short).unwrap(), None);
        assert_eq!(first.sleep_on.load(Ordering::Relaxed), 2);
        // Another QP's hook instead of the first one.
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let second = Arc::new(Hook {
            cq: cq.clone(),
            sock: ours,
            progress: AtomicUsize::new(0),
            readable: AtomicUsize::new(0),
            sleep_on: AtomicUsize::new(0),
            renewed: AtomicU64::new(0),
            deferred: std::sync::atomic::AtomicBool::new(false),
        });
        let first_weak: Weak<dyn Progress> = Arc::downgrade(&(first.clone() as Arc<dyn Progress>));
        let second_weak: Weak<dyn Progress> =
            Arc::downgrade(&(second.clone() as Arc<dyn Progress>));
        cq.detach_progress(&first_weak);
        cq.attach_progress(second_weak);
        assert_eq!(set.wait_receiving(short).unwrap(), None);
        assert_eq!(first.sleep_on.load(Ordering::Relaxed), 2, "the old hook");
        assert_eq!(second.sleep_on.load(Ordering::Relaxed), 1, "the new hook");
        // Two hooks: no sleep in `recv` (the caller waits with `ppoll`).
        cq.attach_progress(first_weak);
        assert_eq!(set.wait_receiving(short).unwrap(), None);
        assert_eq!(first.sleep_on.load(Ordering::Relaxed), 2);
        assert_eq!(second.sleep_on.load(Ordering::Relaxed), 1);
    }
}
