//! Readiness notification: epoll through the `polling` crate for the
//! connection manager's reactor, and a lean epoll set of its own
//! ([`EpollSet`]) for the engine threads. Registration is the one `unsafe` call of
//! `polling`: the caller promises to keep the file descriptor open while it
//! is registered.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use polling::{Event, Events, Poller};

use super::fd::{EventFd, TimerFd};

/// Waits until one of `fds` is readable (or has an error or hang-up), at
/// most `timeout`; `Ok(false)` when the time is up. For a CQ waiter that
/// sleeps on its QPs' sockets and its wake-up event fd. The caller keeps
/// the descriptors open for the duration of the call.
#[allow(dead_code)] // the CQ waiter uses `wait_readable_last`
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Duration) -> io::Result<bool> {
    wait_readable_last(fds, timeout).map(|(any, _)| any)
}

/// Interest in a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Interest {
    /// Readable.
    Read,
    /// Writable (send space, or a connect that finished).
    Write,
}

impl Interest {
    fn event(self, key: usize) -> Event {
        match self {
            Interest::Read => Event::readable(key),
            Interest::Write => Event::writable(key),
        }
    }
}

/// A one-shot readiness poller: after an event is delivered for a socket,
/// that socket must be re-armed with [`Reactor::arm`].
#[derive(Debug)]
pub(crate) struct Reactor {
    poller: Poller,
}

impl Reactor {
    pub(crate) fn new() -> io::Result<Reactor> {
        Ok(Reactor {
            poller: Poller::new()?,
        })
    }

    /// Arms one-shot interest in `fd` under `key`, registering it if needed.
    ///
    /// The owner of `fd` keeps it open while registered: QPs keep their
    /// socket open until the QP itself is freed, and sockets are removed
    /// with [`Reactor::remove`] or by the kernel when closed.
    pub(crate) fn arm(&self, fd: RawFd, key: usize, interest: Interest) -> io::Result<()> {
        // SAFETY: `fd` is an open socket for the duration of this call (the
        // caller holds the QP that owns it).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        match self.poller.modify(borrowed, interest.event(key)) {
            Ok(()) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => {
                // SAFETY: the socket stays open while registered (see above);
                // epoll drops the registration itself when it is closed.
                unsafe { self.poller.add(fd, interest.event(key)) }
            }
            Err(e) => Err(e),
        }
    }

    /// Removes `fd` (ignored if not registered).
    pub(crate) fn remove(&self, fd: RawFd) {
        // SAFETY: `fd` is open for the duration of this call (the caller
        // holds the QP that owns it).
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let _ = self.poller.delete(borrowed);
    }

    /// Waits for events (keys appended to `keys`).
    pub(crate) fn wait(
        &self,
        events: &mut Events,
        keys: &mut Vec<usize>,
        timeout: Option<Duration>,
    ) -> io::Result<()> {
        events.clear();
        self.poller.wait(events, timeout)?;
        keys.extend(events.iter().map(|e| e.key));
        Ok(())
    }

    /// Wakes a thread blocked in [`Reactor::wait`].
    pub(crate) fn notify(&self) {
        let _ = self.poller.notify();
    }
}

/// A socket's readiness reported by [`EpollSet::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ready {
    /// The key the socket was armed under.
    pub(crate) key: usize,
    /// Bytes to read, or an error or hang-up.
    pub(crate) readable: bool,
    /// Room to write, or an error or hang-up.
    pub(crate) writable: bool,
}

/// The key of the wake-up event fd in the epoll set.
const WAKE_KEY: u64 = u64::MAX;
/// The key of the deadline timer fd in the epoll set.
const TIMER_KEY: u64 = u64::MAX - 1;

/// The epoll set of an engine thread: its QPs' sockets, each armed one-shot
/// for reading, writing or both under one key, a wake-up event fd, and a
/// deadline timer fd other threads may set without waking the owner
/// ([`set_timer`](Self::set_timer)).
///
/// Leaner than [`Reactor`] (the `polling` crate) where it matters for a
/// thread that wakes once per message: a wait is one `epoll_wait` (the
/// crate's also sets a timer fd, re-arms it and reads and re-arms its
/// notifier: five system calls), and [`EpollSet::notify`] writes the event
/// fd only while the owner sleeps or is about to (a busy owner looks at its
/// inbox anyway), so a post that hands work to a running thread costs no
/// system call.
#[derive(Debug)]
pub(crate) struct EpollSet {
    epfd: OwnedFd,
    wake: EventFd,
    timer: TimerFd,
    /// The owner is in (or about to enter) a blocking `epoll_wait`.
    sleeping: AtomicBool,
    /// Someone called `notify` since the owner last cleared it.
    notified: AtomicBool,
}

impl EpollSet {
    pub(crate) fn new() -> io::Result<EpollSet> {
        // SAFETY: epoll_create1 takes no pointers; it returns a new
        // descriptor or -1.
        let raw = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a fresh descriptor nothing else owns.
        let epfd = unsafe { OwnedFd::from_raw_fd(raw) };
        let wake = EventFd::new()?;
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: WAKE_KEY,
        };
        // SAFETY: both descriptors are open (owned by the set, which keeps
        // the event fd as long as the epoll fd); `ev` is a valid event.
        let r = unsafe {
            libc::epoll_ctl(
                epfd.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                wake.as_raw_fd(),
                &raw mut ev,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        let timer = TimerFd::new()?;
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: TIMER_KEY,
        };
        // SAFETY: as above (the set keeps the timer fd as long as the
        // epoll fd).
        let r = unsafe {
            libc::epoll_ctl(
                epfd.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                timer.as_raw_fd(),
                &raw mut ev,
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(EpollSet {
            epfd,
            wake,
            timer,
            sleeping: AtomicBool::new(false),
            notified: AtomicBool::new(false),
        })
    }

    /// Arms one-shot interest in `fd` under `key` (registering it if
    /// needed): readable if `read`, writable if `write`; neither leaves it
    /// registered but silent. After an event the socket is silent until
    /// armed again (for both directions: the caller re-arms what it still
    /// wants).
    ///
    /// `fresh`: `fd` is probably not registered yet (a socket new to the
    /// caller): it is added first (one system call; a registration that
    /// exists after all is modified), where a known one is modified first
    /// (and added if the kernel had dropped it).
    ///
    /// The owner of `fd` keeps it open while registered (as for
    /// [`Reactor::arm`]); the kernel drops the registration when it closes.
    pub(crate) fn arm(
        &self,
        fd: RawFd,
        key: usize,
        read: bool,
        write: bool,
        fresh: bool,
    ) -> io::Result<()> {
        let mut events = libc::EPOLLONESHOT as u32;
        if read {
            events |= (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
        }
        if write {
            events |= libc::EPOLLOUT as u32;
        }
        let mut ev = libc::epoll_event {
            events,
            u64: key as u64,
        };
        let (first, then, missing) = if fresh {
            (libc::EPOLL_CTL_ADD, libc::EPOLL_CTL_MOD, libc::EEXIST)
        } else {
            (libc::EPOLL_CTL_MOD, libc::EPOLL_CTL_ADD, libc::ENOENT)
        };
        // SAFETY: `fd` is open for the duration of the call (the caller
        // holds the QP that owns it); `ev` is a valid event.
        let r = unsafe { libc::epoll_ctl(self.epfd.as_raw_fd(), first, fd, &raw mut ev) };
        if r == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(missing) {
            return Err(e);
        }
        // SAFETY: as above.
        let r = unsafe { libc::epoll_ctl(self.epfd.as_raw_fd(), then, fd, &raw mut ev) };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Clears the notification flag: call before looking at the inbox, so
    /// that a `notify` after this point makes the next `wait` return.
    pub(crate) fn clear_notified(&self) {
        self.notified.store(false, Ordering::SeqCst);
    }

    /// Sets the deadline timer to expire `after` from now (`None`: clears
    /// it), without waking the owner: its `wait` returns when the timer
    /// expires. An expiry not yet seen is forgotten (the timer fd is
    /// level-triggered: whoever sets or clears it makes it silent until
    /// the new deadline).
    pub(crate) fn set_timer(&self, after: Option<Duration>) -> io::Result<()> {
        self.timer.set(after)
    }

    /// Waits for sockets (appended to `out`) at most `timeout` (`None`: no
    /// limit; rounded up to milliseconds), or until [`notify`](Self::notify)
    /// or the deadline timer expires. `Ok(true)`: the timer expired (it
    /// stays readable until set or cleared again).
    pub(crate) fn wait(&self, out: &mut Vec<Ready>, timeout: Option<Duration>) -> io::Result<bool> {
        let mut ms: libc::c_int = timeout.map_or(-1, |t| {
            libc::c_int::try_from(t.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
        });
        if ms != 0 {
            self.sleeping.store(true, Ordering::SeqCst);
            if self.notified.load(Ordering::SeqCst) {
                ms = 0;
            }
        }
        let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 64];
        // SAFETY: `evs` is a writable array of 64 events that lives across
        // the call; the count says 64.
        let n = unsafe { libc::epoll_wait(self.epfd.as_raw_fd(), evs.as_mut_ptr(), 64, ms) };
        self.sleeping.store(false, Ordering::Relaxed);
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                return Ok(false);
            }
            return Err(e);
        }
        let mut timer = false;
        for ev in &evs[..usize::try_from(n).unwrap_or(0)] {
            let (flags, key) = (ev.events, ev.u64);
            if key == WAKE_KEY {
                self.wake.drain();
                continue;
            }
            if key == TIMER_KEY {
                timer = true;
                continue;
            }
            let err = flags & (libc::EPOLLERR | libc::EPOLLHUP) as u32 != 0;
            out.push(Ready {
                key: usize::try_from(key).unwrap_or(usize::MAX),
                readable: err || flags & (libc::EPOLLIN | libc::EPOLLRDHUP) as u32 != 0,
                writable: err || flags & libc::EPOLLOUT as u32 != 0,
            });
        }
        Ok(timer)
    }

    /// Makes the owner's current or next [`wait`](Self::wait) return.
    /// Returns whether it wrote the wake-up event fd (the owner slept, or
    /// was about to: a wake-up).
    pub(crate) fn notify(&self) -> bool {
        self.notified.store(true, Ordering::SeqCst);
        if self.sleeping.load(Ordering::SeqCst) {
            self.wake.signal();
            return true;
        }
        false
    }
}

/// [`wait_readable`], returning also whether the last of `fds` (a wake-up
/// event fd, which is then to be drained) is readable: `(any, last)`.
pub(crate) fn wait_readable_last(fds: &[RawFd], timeout: Duration) -> io::Result<(bool, bool)> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    poll_last(&mut pfds, Some(timeout))
}

/// Descriptors to wait on for reading with `poll(2)`, kept between waits
/// so that a CQ waiter that sleeps allocates nothing
/// ([`wait_readable_last`] builds its array on every call).
#[derive(Debug, Default)]
pub(crate) struct PollSet {
    pfds: Vec<libc::pollfd>,
}

impl PollSet {
    /// Forgets every descriptor.
    pub(crate) fn clear(&mut self) {
        self.pfds.clear();
    }

    /// Adds `fd`; the caller keeps it open while it is in the set.
    pub(crate) fn push(&mut self, fd: RawFd) {
        self.pfds.push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
    }

    /// Whether the set is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.pfds.is_empty()
    }

    /// [`wait_readable_last`] on the set's descriptors; `None`: until one
    /// is readable or a signal comes, with no kernel timer.
    pub(crate) fn wait_last(&mut self, timeout: Option<Duration>) -> io::Result<(bool, bool)> {
        for p in &mut self.pfds {
            p.revents = 0;
        }
        poll_last(&mut self.pfds, timeout)
    }
}

/// `poll(2)` for reading on `pfds`, at most `timeout` (`None`: no limit):
/// `(any, last)` as [`wait_readable_last`].
fn poll_last(pfds: &mut [libc::pollfd], timeout: Option<Duration>) -> io::Result<(bool, bool)> {
    let ms = timeout.map_or(-1, |t| {
        libc::c_int::try_from(t.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX)
    });
    let n = libc::nfds_t::try_from(pfds.len()).unwrap_or(libc::nfds_t::MAX);
    // SAFETY: `pfds` is a valid array of `n` pollfd entries that lives
    // across the call; the kernel writes only their `revents`.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), n, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok((true, false));
        }
        return Err(e);
    }
    let last = pfds.last().is_some_and(|p| p.revents != 0);
    Ok((r > 0, last))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set reused across waits reports each wait's readiness afresh (the
    /// `revents` of the previous wait do not leak into the next), and says
    /// whether the last descriptor was among the ready ones.
    #[test]
    fn a_reused_poll_set_reports_each_wait_afresh() {
        let a = EventFd::new().unwrap();
        let wake = EventFd::new().unwrap();
        let mut set = PollSet::default();
        assert!(set.is_empty());
        set.push(a.as_raw_fd());
        set.push(wake.as_raw_fd());
        assert_eq!(set.wait_last(Some(Duration::ZERO)).unwrap(), (false, false));
        wake.signal();
        assert_eq!(set.wait_last(Some(Duration::ZERO)).unwrap(), (true, true));
        wake.drain();
        a.signal();
        assert_eq!(set.wait_last(None).unwrap(), (true, false));
        a.drain();
        assert_eq!(
            set.wait_last(Some(Duration::from_millis(1))).unwrap(),
            (false, false)
        );
        set.clear();
        assert!(set.is_empty());
    }

    /// Arming works whatever the guess about the registration: a socket
    /// armed as fresh is added (and one armed again as fresh, registered
    /// already, is modified), one armed as known but never registered is
    /// added; each reports the readiness it was armed for, once.
    #[test]
    fn arming_as_fresh_or_known_registers_either_way() {
        let set = EpollSet::new().unwrap();
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let (c, d) = std::os::unix::net::UnixStream::pair().unwrap();
        let mut out = Vec::new();
        let ready = |set: &EpollSet, out: &mut Vec<Ready>| {
            out.clear();
            set.wait(out, Some(Duration::ZERO)).unwrap();
            let mut keys: Vec<usize> = out.iter().filter(|r| r.readable).map(|r| r.key).collect();
            keys.sort_unstable();
            keys
        };
        // Fresh: added with one call.
        set.arm(a.as_raw_fd(), 1, true, false, true).unwrap();
        // Known but not registered: modified first, then added.
        set.arm(c.as_raw_fd(), 2, true, false, false).unwrap();
        assert!(ready(&set, &mut out).is_empty());
        use std::io::Write;
        (&b).write_all(b"x").unwrap();
        (&d).write_all(b"y").unwrap();
        assert_eq!(ready(&set, &mut out), vec![1, 2]);
        // One-shot: silent until armed again; fresh again on a registered
        // socket modifies its registration.
        assert!(ready(&set, &mut out).is_empty());
        set.arm(a.as_raw_fd(), 3, true, false, true).unwrap();
        set.arm(c.as_raw_fd(), 4, true, false, false).unwrap();
        assert_eq!(ready(&set, &mut out), vec![3, 4]);
    }
}
