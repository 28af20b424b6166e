//! Registering a completion channel's descriptor with tokio.

use tokio::io::unix::AsyncFd;

use crate::cq::CompletionChannel;

/// Wraps the channel in an [`AsyncFd`] (readable while an event is queued).
pub(crate) fn register(channel: CompletionChannel) -> std::io::Result<AsyncFd<CompletionChannel>> {
    // SAFETY: the AsyncFd owns a handle of the channel, which keeps the
    // channel's eventfd open for the AsyncFd's whole life, and `as_raw_fd`
    // always returns that same eventfd.
    unsafe { AsyncFd::register(channel) }.map_err(std::io::Error::from)
}
