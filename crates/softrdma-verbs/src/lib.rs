//! # softrdma-verbs: a drop-in `libibverbs.so.1` and `librdmacm.so.1`
//!
//! Unmodified rdma-core programs (`ibv_devinfo`, `rping`, perftest,
//! qperf, ...) run over the softrdma engine when this library comes first
//! in the library path under the names `libibverbs.so.1`,
//! `librdmacm.so.1`, `libmlx5.so.1` and `libefa.so.1` (one file; `softrdma
//! run` sets this up). The device, `softrdma0`, is an iWARP RNIC on
//! Ethernet whose GIDs are the host's IPv4 addresses (IPv4-mapped).
//!
//! * Exports: every symbol and version node of rdma-core 44's libibverbs
//!   (public nodes) and librdmacm, and the mlx5dv/efadv symbols perftest
//!   links, listed once in `abi/symbols.txt` (from which `build.rs`
//!   generates the version script and the stubs of unsupported calls).
//! * The context is an extended `verbs_context`: the inline
//!   `ibv_poll_cq`/`ibv_post_send`/... reach the ops table, and
//!   `ibv_create_qp_ex` / `ibv_qp_to_qp_ex` give the `ibv_wr_*` API.
//! * Descriptors (completion channels, async events, CM event channels)
//!   are blocking `eventfd`s that `poll`/`epoll` watch; an application
//!   that sets `O_NONBLOCK` gets `EAGAIN`.
//! * Process hygiene: nothing runs at load time; the engine starts on
//!   first use (`ibv_open_device`, `rdma_*`); every thread the library
//!   starts has all signals blocked; after `fork` the child opens a fresh
//!   engine on first use (objects of the parent are not usable there);
//!   every entry point catches panics and returns an errno.

// The C objects hold raw pointers and engine handles; Debug adds nothing.
#![allow(missing_debug_implementations)]
// The `extern "C"` entry points take the application's pointers: they are
// called from C with the C library's contract (validated where possible:
// NULL checks, our own objects), not from Rust.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod abi;
pub mod cm;
pub mod ffi;
pub mod qpex;
pub mod verbs;

/// The generated stubs of `abi/symbols.txt` (kind other than `impl`).
#[allow(missing_docs, clippy::missing_safety_doc)]
pub mod stubs {
    include!(concat!(env!("OUT_DIR"), "/stubs.rs"));
}
