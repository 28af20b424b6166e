//! The protocol core's receive path (`softrdma_proto::conn::Connection`),
//! no sockets: one connection after a valid negotiation is fed arbitrary
//! bytes, whole and byte by byte (`softrdma_proto::sim::fuzz_rx` says what
//! is checked). Seeds: `crates/softrdma-proto/tests/fuzz_seeds/core_rx`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = softrdma_proto::sim::fuzz_rx(data) {
        panic!("{e}");
    }
});
