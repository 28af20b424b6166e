//! The body of a Terminate message (after its untagged DDP header).
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::rdmap::terminate::{Terminate, TerminateRepr};

fuzz_target!(|data: &[u8]| {
    let Ok(view) = Terminate::new_checked(data) else {
        return;
    };
    let _ = view.error();
    let Ok(repr) = TerminateRepr::parse(&view) else {
        return;
    };
    let _ = repr.error();
    let mut out = vec![0u8; repr.buffer_len()];
    // Copied headers of the wrong size may be refused on encode; never a panic.
    if let Ok(n) = repr.emit(&mut out) {
        let again = Terminate::new_checked(&out[..n]).expect("re-encoded Terminate is whole");
        let again = TerminateRepr::parse(&again).expect("re-encoded Terminate decodes");
        assert_eq!(again.code, repr.code);
        assert_eq!(again.ddp, repr.ddp);
    }
});
