//! Registering a borrowed descriptor with tokio for one wait (the
//! connection manager's async calls wait on its eventfds).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};

use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// A descriptor borrowed for as long as it is registered.
#[derive(Debug)]
pub(crate) struct Borrowed<'a>(BorrowedFd<'a>);

impl AsRawFd for Borrowed<'_> {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Registers `fd` for readability; the registration cannot outlive the
/// borrow.
pub(crate) fn readable(fd: BorrowedFd<'_>) -> io::Result<AsyncFd<Borrowed<'_>>> {
    // SAFETY: the AsyncFd holds the borrow of `fd`, so the descriptor stays
    // open for the registration's whole life, and `as_raw_fd` always
    // returns that same descriptor.
    unsafe { AsyncFd::register_with_interest(Borrowed(fd), Interest::READABLE) }
        .map_err(io::Error::from)
}
