//! A whole ULPDU (DDP header + RDMAP message) as a peer may send it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::ulpdu::UlpduRepr;

fuzz_target!(|data: &[u8]| {
    let Ok(repr) = UlpduRepr::parse(data) else {
        return;
    };
    let mut out = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut out).expect("a parsed ULPDU re-encodes");
    assert_eq!(UlpduRepr::parse(&out[..n]), Ok(repr));
});
