//! # softrdma-engine: the verbs engine
//!
//! This crate will hold the RDMA "device" in software: protection domains,
//! memory regions and windows, completion and queue pairs, direct sending,
//! datamovers and direct placement. All IO and all `unsafe` of softrdma live
//! here, in one module, each block with a `// SAFETY:` comment.
//!
//! Status: not yet implemented; it builds on [`softrdma_proto`].

pub use softrdma_proto as proto;
