//! One FPDU (length, ULPDU, pad, CRC) at the start of a buffer, with and
//! without CRC, and the ULPDU inside it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::fpdu;
use softrdma_wire::ulpdu::UlpduRepr;

fuzz_target!(|data: &[u8]| {
    for crc in [false, true] {
        if let Ok(d) = fpdu::decode(data, crc) {
            assert!(d.len <= data.len());
            assert_eq!(d.len, fpdu::fpdu_len(d.ulpdu.len()));
            let _ = UlpduRepr::parse(d.ulpdu);
        }
    }
});
