//! Closing the last IA leaves no thread of the IA running (the provider
//! may be unloaded after it). Own test binary: it counts the process's
//! threads.

mod common;

use std::time::{Duration, Instant};

use common::{connected, thread_names, threads};
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
        let common::Connected {
            a,
            b,
            server,
            client,
            psp,
            cr,
        } = k;
        drop((cr, psp, server, client));
        a.close(false).unwrap();
        b.close(false).unwrap();
    }
    // The engine's threads are told to stop and leave on their own: give
    // them a moment, then every thread of the two IAs must be gone.
    let until = Instant::now() + Duration::from_secs(10);
    while threads() > before && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        threads(),
        before,
        "threads left after the IAs closed: {:?}",
        thread_names()
    );
}
