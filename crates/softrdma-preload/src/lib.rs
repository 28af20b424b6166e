//! # softrdma-preload: sockets direct for unmodified programs
//!
//! An `LD_PRELOAD` library (`softrdma run --sockets -- CMD ARGS...`) that
//! gives an unmodified socket program sockets direct over softrdma when
//! both ends can, and plain TCP otherwise. The application's file descriptor
//! always stays the kernel TCP socket.
//!
//! A client's `connect` asks the server's UDP twin (a UDP socket on the
//! listener's address and port, started by the interposed `listen`) whether
//! the connection may be offloaded; if so, the connection is made and the
//! engine's stream-to-RDMA switch runs on it (SDP over a softrdma queue
//! pair, `softrdma-sockets`); the accepted end switches on its first use. A
//! peer without the library never asks or answers, so its connection stays
//! plain TCP carrying exactly the program's bytes. The data calls, `dup`,
//! `fcntl`, `ioctl`, socket options, poll/select and `epoll_ctl` act on the
//! offloaded stream for offloaded descriptors and pass everything else
//! straight through. See `README.md` for the interposed calls, fork, exec
//! and signals.
//!
//! The policy is `SOFTRDMA_SOCKETS=auto|offload|tcp` with rules in
//! `SOFTRDMA_SOCKETS_CONF` (see the `policy` module); connections are
//! counted by outcome and reason, and one JSON line per process is appended
//! at exit to `SOFTRDMA_SOCKETS_STATS`:
//!
//! ```text
//! {"pid":1234,"exe":"/usr/bin/iperf3","offloaded":2,"plain":0,"refused":0,"reasons":{}}
//! ```
//!
//! Safe inside someone else's process: at load time the library only copies
//! its environment variables (servers such as nginx clear the environment
//! of the worker processes that accept connections) and sets its panic
//! hook, which prints nothing (panics are counted in the stats line); its state
//! is made on the first interposed call, the engine on the first switch
//! (its threads, and the twins', start with every signal blocked); every
//! entry point catches panics and sets `errno` as the kernel would, and a
//! forked child reports only its own connections.

mod policy;
mod scoped;
mod stats;
mod twin;

#[cfg(not(test))]
mod autocork;
#[cfg(not(test))]
mod conn;
#[cfg(not(test))]
pub mod data;
#[cfg(not(test))]
mod emu;
#[cfg(not(test))]
pub mod events;
#[cfg(not(test))]
pub mod interpose;
#[cfg(not(test))]
mod real;
