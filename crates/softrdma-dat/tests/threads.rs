//! Closing the last IA leaves no thread of the IA running (the provider
//! may be unloaded after it). Own test binary: it counts the process's
//! threads.

mod common;

use std::time::Duration;

use common::{connected, threads};
use softrdma_dat::CompletionFlags;

#[test]
fn closing_the_ias_ends_their_threads() {
    let before = threads();
    {
        let t = Some(Duration::from_secs(10));
        let k = connected(t);
        let (s, c) = (&k.server, &k.client);
        s.conn_evd.wait(t, 1).unwrap();
        c.conn_evd.wait(t, 1).unwrap();
        let seg = softrdma_dat::LmrTriplet {
            lmr_context: c.lmr.lmr_context(),
            virtual_address: c.lmr.address(),
            segment_length: 8,
        };
        c.ep.post_send(&[seg], 1, CompletionFlags::DEFAULT).unwrap();
        c.dto_evd.wait(t, 1).unwrap();
        assert!(threads() > before);
        c.ep.disconnect(false).unwrap();
        for side in [s, c] {
            side.dto_evd.drain();
            side.conn_evd.drain();
        }
        common::drop_and_close(k);
    }
    // The engine's threads are told to stop and leave on their own: give
    // them a moment, then every thread of the two IAs must be gone.
    common::assert_threads_back_to(before);
}
