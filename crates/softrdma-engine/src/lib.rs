//! # softrdma-engine: the verbs engine
//!
//! The RDMA "device" in software: protection domains, memory regions and
//! windows, completion queues, shared receive queues, queue pairs, and the
//! data path (direct sending, datamovers, direct placement). All IO and all
//! `unsafe` of softrdma live here, in the [`sys`] module, each block with a
//! `// SAFETY:` comment.
//!
//! The protocol rules come from [`softrdma_proto`] and the wire formats from
//! [`softrdma_wire`].

pub use softrdma_proto as proto;
pub use softrdma_wire as wire;

pub mod connect;
pub mod cq;
mod datamover;
pub mod device;
pub mod event;
pub mod loopback;
pub mod mr;
pub mod pd;
pub mod qp;
mod rx;
pub mod srq;
pub mod state;
mod sys;
mod tx;
pub mod wc;
pub mod wr;

pub use cq::{CompletionChannel, CompletionQueue};
pub use datamover::DatamoverStats;
pub use device::{Device, DeviceAttr, DeviceConfig, OpenError};
pub use event::{AsyncEvent, AsyncEventKind, AsyncEventQueue};
pub use mr::{Access, MemoryRegion, MemoryWindow};
pub use pd::ProtectionDomain;
pub use qp::{LinkParams, QpAttr, QpCap, QpInitAttr, QueuePair};
pub use srq::SharedReceiveQueue;
pub use state::QpState;
pub use sys::io::{process_context_switches, thread_context_switches};
pub use wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
pub use wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};
