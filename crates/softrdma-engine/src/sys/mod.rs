//! Everything `unsafe` in softrdma: raw registered memory, vectored socket IO
//! on raw pointers, event file descriptors and thread pinning. Each block
//! carries a `// SAFETY:` comment; nothing outside this module uses `unsafe`
//! except the declaration of the public API's one `unsafe` entry point,
//! `ProtectionDomain::register_raw` in `pd.rs`, a thin wrapper over
//! `mem::Memory::external`. `sys` imports nothing else of the engine: it is
//! the bottom layer (`scripts/module-graph.py`).

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
