//! # softrdma-engine: the verbs engine
//!
//! The RDMA "device" in software: protection domains, memory regions and
//! windows, completion queues, shared receive queues, queue pairs, and the
//! data path (direct sending, datamovers, direct placement). All IO, all
//! clock readings and all `unsafe` of softrdma live here, in the private
//! `sys/` directory, each block with a `// SAFETY:` comment (the private
//! `sys` module, and `sys/register_raw.rs`, which defines
//! [`ProtectionDomain::register_raw`] as a child of `mr`).
//!
//! The protocol rules come from [`softrdma_proto`] and the wire formats from
//! [`softrdma_wire`]: each connected QP is driven by the protocol core's
//! sans-IO `softrdma_proto::conn::Connection` (DDP/RDMAP rules, ORD/IRD,
//! send, receive and completion queues, Terminates, close), behind one
//! lock per connection; the engine does the socket IO, places payload
//! straight from the socket into registered memory and delivers the
//! core's completions and events (`docs/protocol-core.md`).
//!
//! ```text
//!  QueuePair (verbs)  ──post/modify──▶  qp: one lock per connection
//!                                         │ handle_* ▲ poll_*
//!                                         ▼          │
//!                                   Connection (softrdma-proto)
//!  datapath: conn_io (readv/writev, placement), datamover threads
//! ```
//!
//! ## Example: two QPs over loopback, a Send and an RDMA Write
//!
//! ```
//! use softrdma_engine::loopback::connect_pair;
//! use softrdma_engine::proto::mpa::MpaConfig;
//! use softrdma_engine::*;
//!
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd();
//! let cq = dev.create_cq(256)?;
//! let a = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))?;
//! let b = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))?;
//! connect_pair(&a, &b, &MpaConfig::default())?; // MPA v2, both in RTS
//!
//! let src = pd.register(4096, Access::LOCAL_WRITE)?;
//! let dst = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! src.write(0, b"hello, RDMA")?;
//!
//! // Send/Recv: b posts a receive, a sends 11 bytes from `src`.
//! b.post_recv(&RecvWr::new(7, &[dst.sge(0, 64)?]))?;
//! a.post_send(&SendWr::new(1, SendOp::Send).sg_list(&[src.sge(0, 11)?]).signaled())?;
//! let mut wcs = Vec::new();
//! while wcs.len() < 2 {
//!     wcs.extend(cq.poll_one()); // busy polling; see CompletionChannel for events
//! }
//! assert!(wcs.iter().all(|wc| wc.status == WcStatus::Success));
//! assert_eq!(&dst.to_vec()[..11], b"hello, RDMA");
//!
//! // One-sided RDMA Write into b's region at offset 100, with its rkey.
//! let write = SendOp::Write { remote_addr: dst.addr() + 100, rkey: dst.rkey() };
//! a.post_send(&SendWr::new(2, write).inline(b"direct").signaled())?;
//! while cq.poll_one().is_none() {}
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Memory safety
//!
//! A peer writes into registered memory at any time, like a NIC's DMA, so
//! the engine never hands out `&mut [u8]` over it: regions own their buffer
//! ([`ProtectionDomain::register`]) and local access copies in and out
//! ([`MemoryRegion::read`], [`MemoryRegion::write`]) or goes through a raw
//! pointer documented as racing with remote access. Posted work holds a
//! reference to the memory its SGEs name, checked against the registration
//! table when posted, so memory outlives the work even if the region is
//! deregistered. Registering memory the engine does not own is the one
//! `unsafe` call ([`ProtectionDomain::register_raw`]). STag keys are random
//! and change on every re-registration, window bind and fast-register.

//!
//! ## Behaviour notes
//!
//! * Every accepted work request completes (success or flush) or the post
//!   is refused; after a graceful close posts complete at once with a flush
//!   error, as in ERROR (see [`QueuePair::post_recv`]).
//! * Close timers share one engine timer thread; no thread per connection.
//! * STag indices are random over 24 bits, keys random over 8 bits.
//! * The async event queue is bounded
//!   ([`DeviceConfig::async_event_capacity`]) and reports its overflow.
//! * [`QueuePair::last_terminate`] keeps the Terminate that ended a
//!   connection.
//!
//! The repository's `docs/engine.md` has the details, the lock order and
//! the hand-off protocol.

#![deny(unsafe_code)]
// The clock is read through `sys::clock` (clippy.toml); unit tests may read
// it directly.
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub use softrdma_proto as proto;
pub use softrdma_proto::qp_state as state;
pub use softrdma_wire as wire;

#[cfg(feature = "tokio")]
pub mod async_cq;
pub mod cm;
pub mod connect;
pub mod cq;
#[cfg(all(test, loom))]
mod cq_loom;
mod datapath;
pub mod device;
mod error;
pub mod event;
#[cfg(all(test, loom))]
mod handback_loom;
pub mod handlers;
mod handoff;
pub mod handshake;
pub mod loopback;
pub mod mr;
pub mod pd;
pub mod proxy;
pub mod qp;
pub mod remote;
#[cfg(all(test, loom))]
mod rx_loom;
pub mod srq;
mod stags;
#[allow(unsafe_code)] // the one module with `unsafe`: see its docs
mod sys;
mod timer;
pub mod transition;
pub mod wait_set;
pub mod wc;
pub mod wr;

pub(crate) use datapath::datamover;

pub use cq::{CompletionChannel, CompletionQueue, CqBuilder};
pub use datamover::DatamoverStats;
pub use device::{Device, DeviceAttr, DeviceConfig, OpenError};
pub use error::Error;
pub use event::{AsyncEvent, AsyncEventKind, AsyncEventQueue};
pub use handlers::{Binding, HandlerId, HandlerPolicy, HandlerStats};
pub use mr::{Access, MemoryRegion, MemoryWindow, Sge};
pub use pd::ProtectionDomain;
pub use qp::post::flush_posts_at_exit;
pub use qp::{LinkParams, QpAttr, QpCap, QpInitAttr, QueuePair, TerminateDirection, TerminateInfo};
pub use remote::{RemoteBuf, RemoteBufError};
pub use srq::SharedReceiveQueue;
pub use state::QpState;
pub use sys::io::{
    process_context_switches, signal_blocked, spawn_engine_thread, thread_context_switches,
};
pub use sys::process::{PerFork, at_exit};

/// How many `fork(2)`s lie between the process that first called this and
/// the calling process (0 in that process, 1 in its child, ...): state
/// kept per process (a socket, a descriptor shared with the parent) is made
/// again when it changes. Cheaper than comparing process ids (no system
/// call).
pub fn fork_generation() -> u64 {
    sys::epoll::fork_generation()
}
pub use wait_set::WaitSet;
pub use wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
pub use wr::{RecvWr, SendFlags, SendOp, SendWr};
