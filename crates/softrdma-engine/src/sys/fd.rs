//! Event file descriptors: the readiness signal behind completion channels
//! and the device's async event queue.
//!
//! An [`EventFd`] is a Linux `eventfd(2)` created with `EFD_CLOEXEC |
//! EFD_NONBLOCK`. It is readable (for `poll(2)`, `epoll(7)`, an async
//! runtime) while its counter is non-zero. The queues that own one keep the
//! counter non-zero exactly while they hold an entry, so an application can
//! put the descriptor in its own event loop, like the `fd` of an
//! `ibv_comp_channel`.

use super::clock;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// A non-blocking, close-on-exec `eventfd(2)`.
#[derive(Debug)]
pub(crate) struct EventFd {
    fd: OwnedFd,
}

impl EventFd {
    /// A new event fd with its counter at 0 (not readable).
    pub(crate) fn new() -> io::Result<EventFd> {
        // SAFETY: eventfd takes no pointers; it returns a new descriptor or -1.
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(EventFd { fd })
    }

    /// Adds 1 to the counter: the descriptor becomes readable.
    ///
    /// If the counter is saturated (`EAGAIN`, about 2^64 signals without a
    /// drain) the descriptor is readable anyway, so that is not an error.
    pub(crate) fn signal(&self) {
        let one: u64 = 1;
        loop {
            // SAFETY: the pointer is to an 8-byte local that lives across the
            // call, and the length says 8; the descriptor is owned by `self`.
            let n = unsafe {
                libc::write(
                    self.fd.as_raw_fd(),
                    (&raw const one).cast::<libc::c_void>(),
                    size_of::<u64>(),
                )
            };
            if n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                return;
            }
        }
    }

    /// Reads and resets the counter: the descriptor is no longer readable.
    /// Returns the counter's value (0 if it was already 0).
    pub(crate) fn drain(&self) -> u64 {
        let mut value: u64 = 0;
        loop {
            // SAFETY: the pointer is to an 8-byte local that lives across the
            // call and is valid for writes of 8 bytes; the descriptor is
            // owned by `self`.
            let n = unsafe {
                libc::read(
                    self.fd.as_raw_fd(),
                    (&raw mut value).cast::<libc::c_void>(),
                    size_of::<u64>(),
                )
            };
            if n == 8 {
                return value;
            }
            if n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // EAGAIN: the counter was 0.
            return 0;
        }
    }

    /// Waits until the descriptor is readable or `timeout` has passed
    /// (`None`: no time limit). Returns whether it is readable. Does not
    /// change the counter.
    ///
    /// # Errors
    ///
    /// The error of `poll(2)` other than `EINTR`.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> io::Result<bool> {
        wait_readable(self.fd.as_fd(), timeout)
    }
}

/// A non-blocking, close-on-exec `timerfd(2)` on the monotonic clock: a
/// deadline another thread can set or clear for a thread that sleeps in
/// `epoll_wait` on it, without waking that thread (an engine thread's
/// hand-over deadline, see `datapath/datamover.rs`).
#[derive(Debug)]
pub(crate) struct TimerFd {
    fd: OwnedFd,
}

impl TimerFd {
    /// A new, disarmed timer.
    pub(crate) fn new() -> io::Result<TimerFd> {
        // SAFETY: timerfd_create takes no pointers; it returns a new
        // descriptor or -1.
        let raw = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
            )
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `raw` is a freshly created descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        Ok(TimerFd { fd })
    }

    /// Arms the timer to expire once, `after` from now (`None`: disarms
    /// it). Either way an expiry not yet read is forgotten: the descriptor
    /// is not readable until the new deadline passes.
    pub(crate) fn set(&self, after: Option<Duration>) -> io::Result<()> {
        let value = match after {
            // A zero value disarms: expire at once instead.
            Some(d) => libc::timespec {
                tv_sec: libc::time_t::try_from(d.as_secs()).unwrap_or(libc::time_t::MAX),
                tv_nsec: libc::c_long::from(d.subsec_nanos().max(u32::from(d.is_zero()))),
            },
            None => libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
        };
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: value,
        };
        // SAFETY: `spec` is a valid itimerspec that lives across the call;
        // the old value is not asked for (null); the descriptor is owned by
        // `self`.
        let r = unsafe {
            libc::timerfd_settime(
                self.fd.as_raw_fd(),
                0,
                &raw const spec,
                std::ptr::null_mut(),
            )
        };
        if r < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }
}

impl AsRawFd for TimerFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// The wake-up descriptor of one sleeping waiter (a thread in
/// `CompletionQueue::wait`, a wait set): an [`EventFd`] written at most
/// once per sleep, however many completions are pushed meanwhile.
///
/// The rule (`cq_loom.rs` models it): [`wake`](Self::wake) sets `pending`
/// and writes the descriptor only if `pending` was clear; the waiter,
/// having found the descriptor readable, reads it first and clears
/// `pending` after ([`reset`](Self::reset)), then looks at what it waits
/// for before it sleeps again. So outside a reset `pending` is set only
/// while the write of the wake that set it is under way or its count is
/// still in the descriptor: a wake that skips its write either leaves the
/// waiter a readable descriptor, or came before the waiter's clear, and
/// the look after the reset sees what it announced. Clearing before the
/// read would let the read swallow the write of a wake that came in
/// between; a later wake would then skip its write on a descriptor that is
/// not readable, and the waiter would sleep through it.
#[derive(Debug)]
pub(crate) struct Waker {
    fd: EventFd,
    pending: AtomicBool,
    /// Writes made (tests: one per burst).
    #[cfg(test)]
    writes: std::sync::atomic::AtomicU32,
}

impl Waker {
    /// A waker that is not readable.
    pub(crate) fn new() -> io::Result<Waker> {
        Ok(Waker {
            fd: EventFd::new()?,
            pending: AtomicBool::new(false),
            #[cfg(test)]
            writes: std::sync::atomic::AtomicU32::new(0),
        })
    }

    /// Makes the descriptor readable: one `write(2)` per sleep, none while
    /// an earlier wake's count is unread. (The caller has made what it
    /// announces visible before: a push, then a SeqCst fence.)
    pub(crate) fn wake(&self) {
        if !self.pending.swap(true, Ordering::SeqCst) {
            #[cfg(test)]
            self.writes.fetch_add(1, Ordering::Relaxed);
            self.fd.signal();
        }
    }

    /// The descriptor was found readable: reads its count, then lets the
    /// next wake write again. The caller looks at what it waits for after
    /// this, before it sleeps again.
    pub(crate) fn reset(&self) {
        self.fd.drain();
        // A read-modify-write, not a store: it reads the `true` of every
        // wake that skipped its write, and so acquires what that wake's
        // push made visible before (a SeqCst store is an `xchg` on x86
        // anyway).
        self.pending.swap(false, Ordering::SeqCst);
    }

    /// Whether no wake is pending: the descriptor is not readable (the
    /// count of a wake is read, by [`reset`](Self::reset), before the wake
    /// may write again).
    pub(crate) fn quiet(&self) -> bool {
        !self.pending.load(Ordering::SeqCst)
    }

    /// Writes made so far.
    #[cfg(test)]
    pub(crate) fn writes(&self) -> u32 {
        self.writes.load(Ordering::Relaxed)
    }
}

impl AsFd for Waker {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for Waker {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Waits until `fd` is readable (`POLLIN`) or `timeout` has passed (`None`:
/// no time limit), with `poll(2)`. Returns whether it is readable.
/// Interrupted waits are resumed with the time left.
///
/// # Errors
///
/// The error of `poll(2)` other than `EINTR`.
pub(crate) fn wait_readable(fd: BorrowedFd<'_>, timeout: Option<Duration>) -> io::Result<bool> {
    let deadline = timeout.map(|t| clock::now().checked_add(t));
    loop {
        let ms: libc::c_int = match deadline {
            None | Some(None) => -1,
            Some(Some(deadline)) => {
                let left = deadline.saturating_duration_since(clock::now());
                // Round up so that a short timeout still sleeps.
                let ms = left.as_nanos().div_ceil(1_000_000);
                libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
            }
        };
        let mut pfd = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
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
            // poll(2) may wake a little early; go round with what is left.
            continue;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

impl AsFd for EventFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A timer expires once; clearing it (or setting it again) forgets an
    /// expiry not yet read, so a sleeper on it is not woken for nothing.
    #[test]
    fn timer_expires_once_and_clearing_forgets_an_expiry() {
        let t = TimerFd::new().unwrap();
        let ready = |ms| wait_readable(t.fd.as_fd(), Some(Duration::from_millis(ms))).unwrap();
        assert!(!ready(0));
        t.set(Some(Duration::from_millis(1))).unwrap();
        // Generous: only a hang fails.
        assert!(ready(20_000));
        t.set(None).unwrap();
        assert!(!ready(0));
        t.set(Some(Duration::ZERO)).unwrap();
        assert!(ready(20_000));
        t.set(Some(Duration::from_secs(3600))).unwrap();
        assert!(!ready(5));
        t.set(None).unwrap();
        assert!(!ready(5));
    }

    #[test]
    fn signal_wait_drain() {
        let fd = EventFd::new().unwrap();
        assert!(!fd.wait(Some(Duration::ZERO)).unwrap());
        assert_eq!(fd.drain(), 0);
        fd.signal();
        fd.signal();
        assert!(fd.wait(Some(Duration::ZERO)).unwrap());
        assert!(fd.wait(None).unwrap());
        assert_eq!(fd.drain(), 2);
        assert!(!fd.wait(Some(Duration::from_millis(5))).unwrap());
    }

    #[test]
    fn wait_times_out_after_the_timeout() {
        let fd = EventFd::new().unwrap();
        let start = std::time::Instant::now();
        assert!(!fd.wait(Some(Duration::from_millis(30))).unwrap());
        assert!(start.elapsed() >= Duration::from_millis(30));
    }

    #[test]
    fn wakes_a_waiter_in_another_thread() {
        let fd = std::sync::Arc::new(EventFd::new().unwrap());
        let waiter = {
            let fd = fd.clone();
            std::thread::spawn(move || fd.wait(Some(Duration::from_secs(10))).unwrap())
        };
        std::thread::sleep(Duration::from_millis(10));
        fd.signal();
        assert!(waiter.join().unwrap());
    }

    #[test]
    fn is_close_on_exec_and_non_blocking() {
        let fd = EventFd::new().unwrap();
        // SAFETY: fcntl with F_GETFD / F_GETFL on a valid descriptor.
        let fd_flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFD) };
        // SAFETY: as above.
        let fl_flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        assert_ne!(fd_flags & libc::FD_CLOEXEC, 0);
        assert_ne!(fl_flags & libc::O_NONBLOCK, 0);
    }

    #[test]
    fn epoll_sees_readiness() {
        let fd = EventFd::new().unwrap();
        let poller = polling::Poller::new().unwrap();
        // SAFETY: the descriptor stays open until it is deleted from the
        // poller below.
        unsafe { poller.add(&fd, polling::Event::readable(7)) }.unwrap();
        let mut events = polling::Events::new();
        poller
            .wait(&mut events, Some(Duration::from_millis(1)))
            .unwrap();
        assert!(events.is_empty());
        fd.signal();
        events.clear();
        poller
            .wait(&mut events, Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(events.iter().next().map(|e| e.key), Some(7));
        poller.delete(&fd).unwrap();
    }

    /// A burst of wakes before the sleeper reads is one write; after the
    /// reset the next wake writes again; the descriptor is readable after
    /// every wake and not after a reset.
    #[test]
    fn a_burst_of_wakes_is_one_write_and_a_reset_rearms() {
        let w = Waker::new().unwrap();
        let readable = || wait_readable(w.fd.as_fd(), Some(Duration::ZERO)).unwrap();
        assert!(!readable());
        for _ in 0..100 {
            w.wake();
        }
        assert_eq!(w.writes(), 1, "one write for the burst");
        assert!(readable());
        w.reset();
        assert!(!readable());
        w.wake();
        assert_eq!(w.writes(), 2);
        assert!(readable());
    }

    #[test]
    fn wait_readable_on_a_borrowed_fd() {
        let fd = EventFd::new().unwrap();
        assert!(!wait_readable(fd.as_fd(), Some(Duration::ZERO)).unwrap());
        fd.signal();
        assert!(wait_readable(fd.as_fd(), Some(Duration::ZERO)).unwrap());
    }
}
