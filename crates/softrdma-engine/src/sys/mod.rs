//! Everything `unsafe` in softrdma: raw registered memory, vectored socket IO
//! on raw pointers, event file descriptors and thread pinning. Each block
//! carries a `// SAFETY:` comment; nothing outside this module uses `unsafe`.

#[cfg(feature = "tokio")]
pub(crate) mod async_fd;
#[cfg(feature = "tokio")]
pub(crate) mod async_wait;
pub(crate) mod clock;
pub(crate) mod epoll;
pub(crate) mod fd;
pub(crate) mod io;
pub(crate) mod mem;
pub(crate) mod poll;
pub(crate) mod ppoll;
pub(crate) mod wait;
