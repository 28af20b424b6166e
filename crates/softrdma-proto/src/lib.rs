//! # softrdma-proto: the sans-IO protocol core
//!
//! This crate will hold the protocol state machines that sit between the wire
//! codecs ([`softrdma_wire`]) and the engine: MPA negotiation, the QP state
//! machine, DDP/RDMAP sequencing and validation rules, ORD/IRD accounting and
//! Terminate generation. Like the wire codecs it does no IO, reads no clock
//! (time is passed in), spawns no threads and contains no `unsafe`.
//!
//! Status: not yet implemented. Today it only fixes the crate boundary so that
//! the layering of the workspace is visible and enforced (see `clippy.toml`).
#![forbid(unsafe_code)]

pub use softrdma_wire as wire;
