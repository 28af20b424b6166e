//! An eventfd that is readable exactly while its owner has something
//! queued.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::event::{EventfdFlags, eventfd};

#[derive(Debug)]
pub(crate) struct Signal {
    fd: OwnedFd,
}

impl Signal {
    pub(crate) fn new() -> std::io::Result<Signal> {
        let fd = eventfd(0, EventfdFlags::CLOEXEC | EventfdFlags::NONBLOCK)?;
        Ok(Signal { fd })
    }

    /// Makes the descriptor readable.
    pub(crate) fn raise(&self) {
        // EAGAIN means the counter is already huge: readable anyway.
        let _ = rustix::io::write(&self.fd, &1u64.to_ne_bytes());
    }

    /// Makes the descriptor not readable.
    pub(crate) fn clear(&self) {
        let mut buf = [0u8; 8];
        let _ = rustix::io::read(&self.fd, &mut buf);
    }
}

impl AsFd for Signal {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
