//! Two protocol cores joined by a simulated stream, driven by
//! fuzzer-chosen actions (posts, transmits, deliveries at any byte, bit
//! flips, truncation, resets, closes, time); `softrdma_proto::sim::fuzz_pair`
//! says what is checked. Seeds: `crates/softrdma-proto/tests/fuzz_seeds/core_pair`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = softrdma_proto::sim::fuzz_pair(data) {
        panic!("{e}");
    }
});
