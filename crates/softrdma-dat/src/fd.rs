//! An eventfd that is readable exactly while its owner has something
//! queued.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::event::{EventfdFlags, eventfd};

/// The owner raises and clears it under its own queue lock; `raised`
/// remembers the descriptor's state so that only a change costs a system
/// call (a polling consumer clears an empty queue millions of times).
#[derive(Debug)]
pub(crate) struct Signal {
    fd: OwnedFd,
    raised: AtomicBool,
}

impl Signal {
    pub(crate) fn new() -> std::io::Result<Signal> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Signal {
            fd,
            raised: AtomicBool::new(false),
        })
    }

    /// Makes the descriptor readable.
    pub(crate) fn raise(&self) {
        if self.raised.swap(true, Ordering::AcqRel) {
            return;
        }
        // EAGAIN means the counter is already huge: readable anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Makes the descriptor not readable.
    pub(crate) fn clear(&self) {
        if !self.raised.swap(false, Ordering::AcqRel) {
            return;
        }
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
    }

    /// Whether the descriptor is readable now (as far as the owner made it).
    #[cfg(test)]
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
    }
}

impl AsFd for Signal {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(s: &Signal) -> bool {
        let mut fds = [rustix::event::PollFd::new(s, rustix::event::PollFlags::IN)];
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        rustix::event::poll(&mut fds, Some(&zero)).unwrap() == 1
    }

    #[test]
    fn raise_and_clear_follow_the_state_however_often_repeated() {
        let s = Signal::new().unwrap();
        assert!(!readable(&s));
        s.clear();
        s.clear();
        assert!(!readable(&s) && !s.is_raised());
        s.raise();
        s.raise();
        assert!(readable(&s) && s.is_raised());
        s.clear();
        assert!(!readable(&s), "one clear undoes any number of raises");
        s.raise();
        assert!(readable(&s));
    }
}
