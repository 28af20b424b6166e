//! # softrdma-preload: sockets direct for unmodified programs
//!
//! An `LD_PRELOAD` library (`softrdma run --sockets -- CMD ARGS...`) that is
//! to give an unmodified socket program sockets direct over softrdma when
//! both ends can, and plain TCP otherwise. The application's file descriptor
//! always stays the kernel TCP socket.
//!
//! What this build does: it interposes on the connection calls (`connect`,
//! `accept`, `accept4`), decides each TCP connection's mode from the policy
//! (`SOFTRDMA_SOCKETS=auto|offload|tcp`, rules in `SOFTRDMA_SOCKETS_CONF`;
//! see the `policy` module), counts connections by outcome and reason, and
//! appends one JSON line per process at exit to `SOFTRDMA_SOCKETS_STATS`:
//!
//! ```text
//! {"pid":1234,"exe":"/usr/bin/iperf3","offloaded":0,"plain":2,"refused":0,"reasons":{"no offload protocol":2}}
//! ```
//!
//! No offload protocol is wired in yet: every connection stays plain TCP,
//! byte for byte as the program sent it (reason `no offload protocol`), and
//! a connection whose policy is `offload` (required) is refused with
//! `EOPNOTSUPP` and a message on standard error. The data calls (`read`,
//! `write`, `poll`, `epoll_*`, ...) are not interposed until offloaded
//! connections exist, so they cost nothing.
//!
//! Safe inside someone else's process: at load time the library only copies
//! its three environment variables (servers such as nginx clear the
//! environment of the worker processes that accept connections); its state
//! is made on the first interposed call; every entry point catches panics and
//! keeps `errno` as the real call left it, and a forked child reports only
//! its own connections.

mod policy;
mod stats;
mod twin;

#[cfg(not(test))]
mod conn;
#[cfg(not(test))]
pub mod data;
#[cfg(not(test))]
pub mod events;
#[cfg(not(test))]
pub mod interpose;
#[cfg(not(test))]
mod real;
