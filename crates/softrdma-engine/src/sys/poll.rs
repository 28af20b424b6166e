//! Readiness notification (epoll through the `polling` crate) for the
//! datamover and receive threads. Registration is the one `unsafe` call of
//! `polling`: the caller promises to keep the file descriptor open while it
//! is registered.

use std::io;
use std::os::fd::{BorrowedFd, RawFd};
use std::time::Duration;

use polling::{Event, Events, Poller};

/// Waits until one of `fds` is readable (or has an error or hang-up), at
/// most `timeout`; `Ok(false)` when the time is up. For a CQ waiter that
/// sleeps on its QPs' sockets and its wake-up event fd. The caller keeps
/// the descriptors open for the duration of the call.
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Duration) -> io::Result<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = libc::c_int::try_from(timeout.as_micros().div_ceil(1000)).unwrap_or(libc::c_int::MAX);
    let n = libc::nfds_t::try_from(pfds.len()).unwrap_or(libc::nfds_t::MAX);
    // SAFETY: `pfds` is a valid array of `n` pollfd entries that lives
    // across the call; the kernel writes only their `revents`.
    let r = unsafe { libc::poll(pfds.as_mut_ptr(), n, ms) };
    if r < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(true);
        }
        return Err(e);
    }
    Ok(r > 0)
}

/// Interest in a socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Interest {
    /// Readable (receive threads).
    Read,
    /// Writable (datamovers: send space).
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
