//! Everything `unsafe` in softrdma: raw registered memory, vectored socket IO
//! on raw pointers, event file descriptors and thread pinning. Each block
//! carries a `// SAFETY:` comment; no file outside `sys/` uses `unsafe`.
//! `sys` imports nothing else of the engine: it is the bottom layer
//! (`scripts/module-graph.py`). The public API's one `unsafe` entry point,
//! `ProtectionDomain::register_raw`, is in `sys/register_raw.rs`, compiled
//! as a child of `mr` so that this module never names the PD or region
//! types.

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
pub(crate) mod process;
pub(crate) mod tcp;
pub(crate) mod wait;
