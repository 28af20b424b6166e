//! Registering an event descriptor with tokio, together with the object
//! it signals for (a completion channel, for `async_cq`).

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;

use tokio::io::unix::AsyncFd;

use super::fd::EventFd;

/// `inner` with the event descriptor that becomes readable for it.
#[derive(Debug)]
pub(crate) struct WithFd<T> {
    fd: Arc<EventFd>,
    inner: T,
}

impl<T> WithFd<T> {
    /// The object the descriptor signals for.
    pub(crate) fn get(&self) -> &T {
        &self.inner
    }
}

impl<T> AsRawFd for WithFd<T> {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// Registers `fd` with the current tokio runtime, keeping `inner` beside
/// it (readable while `inner` has an event queued).
pub(crate) fn register<T>(inner: T, fd: Arc<EventFd>) -> io::Result<AsyncFd<WithFd<T>>> {
    // SAFETY: the AsyncFd owns the `WithFd`, whose `Arc` keeps the eventfd
    // open for the AsyncFd's whole life, and an `EventFd` never changes its
    // descriptor, so `as_raw_fd` always returns that same eventfd.
    unsafe { AsyncFd::register(WithFd { fd, inner }) }.map_err(io::Error::from)
}
