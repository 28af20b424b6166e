//! MPA Request/Reply frames and the v2 IRD/ORD word: arbitrary bytes from a
//! connecting peer. Decoding must never panic, and whatever decodes must
//! encode back to something that decodes to the same value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::mpa::{self, Frame, FrameRepr, IrdOrd, MPA_MAX_PRIVATE_DATA};

fuzz_target!(|data: &[u8]| {
    // The first byte picks the receiver's private-data cap, as a listener would.
    let Some((&cap, data)) = data.split_first() else {
        return;
    };
    let cap = usize::from(cap) * 4;
    // Incremental discovery over every prefix agrees with the whole buffer.
    let whole = mpa::frame_len(data, cap);
    if let Some(Ok(len)) = whole {
        assert!(len <= data.len());
        assert_eq!(mpa::frame_len(&data[..len], cap), Some(Ok(len)));
    }
    let Ok(frame) = Frame::new_checked(data) else {
        return;
    };
    let Ok(repr) = FrameRepr::parse(&frame, cap) else {
        return;
    };
    assert!(repr.private_data.len() <= cap.min(MPA_MAX_PRIVATE_DATA));
    let mut out = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut out).expect("a parsed frame re-encodes");
    let again = Frame::new_checked(&out[..n]).expect("re-encoded frame is whole");
    assert_eq!(FrameRepr::parse(&again, cap), Ok(repr));
    if let Some(Ok(ird_ord)) = repr.ird_ord() {
        let bytes = ird_ord.to_bytes().expect("parsed IRD/ORD re-encodes");
        assert_eq!(IrdOrd::parse(&bytes), Ok(ird_ord));
    }
});
