//! Async connect and accept for tokio (feature `tokio`): the CM reactor
//! does the work; these futures wait on the listener's and connections'
//! event descriptors with [`AsyncFd`], so no task blocks and no blocking
//! pool thread is used.
//!
//! ```no_run
//! # async fn demo(qp: softrdma_engine::QueuePair, server_qp: softrdma_engine::QueuePair)
//! # -> Result<(), Box<dyn std::error::Error>> {
//! use softrdma_engine::cm::{ConnectConfig, ListenConfig, Listener, connect_async};
//!
//! let listener = Listener::bind("127.0.0.1:0", 16, ListenConfig::default())?;
//! let addr = listener.local_addr();
//! let client = tokio::spawn(async move {
//!     connect_async(&qp, addr, ConnectConfig::default()).await
//! });
//! let request = listener.next_request().await?;
//! let server = request.accept_async(&server_qp, b"hello", 4, 4).await?;
//! let client = client.await??;
//! # Ok(()) }
//! ```

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};

use super::{CmError, CmEvent, ConnRequest, ConnectConfig, Connection, Listener};
use crate::qp::QueuePair;

/// Waits until `take` returns something, sleeping on `fd` (an eventfd that
/// is readable while something is queued).
async fn wait_for<T>(fd: BorrowedFd<'_>, mut take: impl FnMut() -> Option<T>) -> io::Result<T> {
    let afd = crate::sys::async_wait::readable(fd)?;
    loop {
        if let Some(t) = take() {
            return Ok(t);
        }
        let mut guard = afd.readable().await?;
        if let Some(t) = take() {
            return Ok(t);
        }
        guard.clear_ready();
    }
}

/// The outcome of a connect or an accept from the connection's first
/// event.
async fn established(c: Connection) -> Result<Connection, CmError> {
    match c.next_event().await? {
        CmEvent::Established { .. } => Ok(c),
        other => Err(c.take_failure().unwrap_or_else(|| {
            CmError::Io(io::Error::other(format!(
                "connection setup ended with {other:?}"
            )))
        })),
    }
}

/// Connects `qp` to a listener at `addr` without blocking: the CM reactor
/// does the TCP connect and the handshake, the future waits for the
/// outcome (its [`CmEvent::Established`] event is taken). As
/// [`super::connect`] otherwise, with the same error variants
/// (the address is a [`SocketAddr`]: resolve host names first, e.g. with
/// `tokio::net::lookup_host`).
///
/// # Errors
///
/// As [`super::connect`].
pub async fn connect_async(
    qp: &QueuePair,
    addr: SocketAddr,
    config: ConnectConfig,
) -> Result<Connection, CmError> {
    let c = Connection::start(qp, addr, config)?;
    established(c).await
}

impl Connection {
    /// Waits for the next event without blocking the task's thread.
    ///
    /// # Errors
    ///
    /// The descriptor could not be registered with tokio's reactor.
    pub async fn next_event(&self) -> io::Result<CmEvent> {
        wait_for(self.fd(), || self.try_event()).await
    }
}

impl Listener {
    /// Waits for the next connection request without blocking the task's
    /// thread.
    ///
    /// # Errors
    ///
    /// The descriptor could not be registered with tokio's reactor.
    pub async fn next_request(&self) -> io::Result<ConnRequest> {
        wait_for(self.as_fd(), || self.try_get_request()).await
    }

    /// Waits for the next listener event without blocking.
    ///
    /// # Errors
    ///
    /// The descriptor could not be registered with tokio's reactor.
    pub async fn next_event(&self) -> io::Result<CmEvent> {
        wait_for(self.event_fd(), || self.try_event()).await
    }
}

impl ConnRequest {
    /// Accepts without blocking (see [`ConnRequest::accept_nonblocking`])
    /// and waits for the connection to be established (that
    /// [`CmEvent::Established`] event is taken: the next event of the
    /// connection is its disconnect).
    ///
    /// # Errors
    ///
    /// As [`ConnRequest::accept`].
    pub async fn accept_async(
        self,
        qp: &QueuePair,
        private_data: &[u8],
        ird: u16,
        ord: u16,
    ) -> Result<Connection, CmError> {
        let c = self.accept_nonblocking(qp, private_data, ird, ord)?;
        established(c).await
    }
}
