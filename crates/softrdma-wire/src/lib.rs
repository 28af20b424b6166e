//! # softrdma-wire: the iWARP wire codecs
//!
//! Pure encode/decode of every header and message that softrdma puts on the
//! wire, and the incremental stream deframer that cuts a TCP byte stream back
//! into FPDUs. No IO, no clock, no threads, no `unsafe`: every function here is
//! deterministic, so every protocol behaviour above it can be tested byte for
//! byte and fuzzed.
//!
//! ```text
//!  TCP byte stream
//!   └─ MPA (RFC 5044, RFC 6581)   mpa::Frame (Request/Reply/reject), mpa::IrdOrd (v2)
//!       └─ FPDU                    fpdu: ULPDU length | ULPDU | pad | CRC32C, markers
//!           └─ DDP (RFC 5041)      ddp: tagged (STag, TO) / untagged (QN, MSN, MO)
//!               └─ RDMAP (RFC 5040, RFC 7306)
//!                                  rdmap: opcodes, Read Request, Terminate,
//!                                  Atomic Request/Response, Immediate Data
//! ```
//!
//! ## Conventions
//!
//! Every wire format comes as two types, after smoltcp's `wire` module:
//!
//! * a zero-copy *view* `Xxx<T: AsRef<[u8]>>` over a buffer, built with
//!   `new_checked`, which validates the length once; after it no accessor can
//!   panic, whatever the bytes are;
//! * a plain *representation* `XxxRepr` with `parse` (view → value, validating
//!   field contents) and `emit` (value → caller-provided buffer, never
//!   allocating), plus `buffer_len` telling how many bytes `emit` writes.
//!
//! Decoding never panics on any input; "need more bytes" in the deframer is
//! `None`, never an error. Errors are typed: [`DecodeError`] for bytes that do
//! not form a valid message, [`EncodeError`] for a value that cannot be written.
//! All Terminate error codes of RFC 5040, RFC 5041, RFC 5044 and RFC 7306 are
//! declared once, in [`errcode`].
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::panic, clippy::unwrap_used, clippy::expect_used)
)]

pub mod crc;
pub mod ddp;
pub mod deframer;
pub mod errcode;
mod error;
pub mod fpdu;
pub mod markers;
pub mod mpa;
pub mod rdmap;
#[cfg(test)]
mod testutil;
pub mod ulpdu;
mod view;

pub use error::{DecodeError, EncodeError};
