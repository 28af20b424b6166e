//! # softrdma-proto: the sans-IO protocol core
//!
//! The protocol state machines that sit between the wire codecs
//! ([`softrdma_wire`]) and the engine. Like the wire codecs this crate does
//! no IO, reads no clock (time is passed in), spawns no threads and contains
//! no `unsafe`: bytes go in, bytes and events come out.
//!
//! * [`mpa`]: MPA connection setup (RFC 5044 section 7, RFC 6581): the
//!   [`mpa::Initiator`] and [`mpa::Responder`] negotiation machines;
//! * [`rtr`]: the peer-to-peer "Ready to Receive" messages of RFC 6581;
//! * [`qp_state`]: the iWARP QP states and which transitions and posts each
//!   allows;
//! * [`proxy`]: proxy offload rules — the message filter, the completion
//!   reorder buffer and the no-offload load guard.
//!
//! The DDP/RDMAP sequencing and validation rules, ORD/IRD accounting and
//! Terminate generation currently live in the engine's receive and transmit
//! paths (`softrdma-engine`, modules `rx` and `tx`), written as plain checks
//! on decoded headers; moving them here as pure functions is planned.
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::panic, clippy::unwrap_used, clippy::expect_used)
)]

pub use softrdma_wire as wire;

pub mod conn;
pub mod mem;
pub mod mpa;
pub mod proxy;
pub mod qp_state;
pub mod rtr;
pub mod sim;
pub mod term;
pub mod types;
