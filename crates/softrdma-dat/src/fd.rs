//! An eventfd that is readable exactly while its owner has something
//! queued.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::event::{EventfdFlags, eventfd};

/// The owner raises and clears it under its own queue lock, or (the
/// connection reactor's wake-up) raises it from any thread after changing
/// what the one clearing thread looks at next; `raised` remembers the
/// descriptor's state so that only a change costs a system call (a
/// polling consumer clears an empty queue millions of times).
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
        self.raise_with(|| {});
    }

    /// `raise`, with `between` run after the flag is raised and before the
    /// write (the window the tests put a racing clear in).
    fn raise_with(&self, between: impl FnOnce()) {
        if self.raised.swap(true, Ordering::AcqRel) {
            return;
        }
        between();
        // EAGAIN means the counter is already huge: readable anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Makes the descriptor not readable.
    ///
    /// The descriptor is drained before the flag is lowered: a raise that
    /// comes in between sees the flag still up and writes nothing, and the
    /// clearing thread, which looks at everything after `clear`, sees
    /// what that raise announced (the swap reads the raise's write). The
    /// other order let such a raise's write be eaten by the read and left
    /// the flag up over an empty descriptor, and then every later raise
    /// skipped its write: the reactor slept for good.
    pub(crate) fn clear(&self) {
        self.clear_with(|| {});
    }

    /// Makes the descriptor not readable whatever the flag says: reads it
    /// even with the flag down, then lowers the flag. For a consumer that
    /// does not share a lock with its raisers (the connection reactor): a
    /// raise whose flag went up before a `clear` and whose write landed
    /// after it leaves the flag down over a readable descriptor, which
    /// `clear` would never read again (the poller would spin until the
    /// next raise); one read per round costs nothing there.
    pub(crate) fn drain(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
        self.raised.swap(false, Ordering::AcqRel);
    }

    /// `clear`, with `between` run after the read and before the flag is
    /// lowered (the window the tests put a racing raise in).
    fn clear_with(&self, between: impl FnOnce()) {
        if !self.raised.load(Ordering::Acquire) {
            return;
        }
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
        between();
        self.raised.swap(false, Ordering::AcqRel);
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

    /// The connection reactor's wake-up is raised by any thread, with no
    /// lock in common with the reactor that clears it. A raise inside the
    /// clear (the flag lowered, the descriptor not yet read) had its
    /// write eaten by the read and left the flag up over an empty
    /// descriptor; every later raise then skipped its write and the
    /// reactor slept for good (`dat_psp_free` waits up to a second per
    /// service point for the reactor to let go of it: dapltest's
    /// `limit_psp` hung now and then).
    #[test]
    fn regression_a_raise_inside_a_clear_left_the_flag_up_over_an_empty_descriptor() {
        let s = Signal::new().unwrap();
        s.raise();
        s.clear_with(|| s.raise());
        assert!(
            !s.is_raised() || readable(&s),
            "the flag is up over an empty descriptor: every later raise is lost"
        );
        s.raise();
        assert!(readable(&s), "a raise after the race wakes the poller");
        s.clear();
        assert!(!readable(&s) && !s.is_raised());
    }

    /// A raise whose flag went up before a clear and whose write landed
    /// after it leaves the flag down over a readable descriptor: `clear`
    /// skips it (the reactor's `poll` returned at once, round after
    /// round, until the next raise); `drain` reads it.
    #[test]
    fn regression_a_raise_written_after_a_clear_left_the_descriptor_readable_with_the_flag_down() {
        let s = Signal::new().unwrap();
        s.raise_with(|| s.clear());
        assert!(readable(&s) && !s.is_raised(), "the race's state");
        s.clear();
        assert!(readable(&s), "clear skips a descriptor whose flag is down");
        s.drain();
        assert!(!readable(&s) && !s.is_raised(), "drain reads it");
        s.raise();
        assert!(readable(&s), "raises work again");
        s.drain();
        assert!(!readable(&s));
    }
}
