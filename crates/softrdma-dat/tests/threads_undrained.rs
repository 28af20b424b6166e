//! Closing an IA whose EVDs still hold events that name their EPs (an EP
//! holds its EVDs, so such an event kept both, and the device under them,
//! alive) leaves no thread of the IA running. Own test binary: it counts
//! the process's threads.

mod common;

use std::time::{Duration, Instant};

use common::{connected, threads};

#[test]
fn closing_an_ia_with_undrained_connection_events_ends_its_threads() {
    let before = threads();
    {
        let k = connected(Some(Duration::from_secs(10)));
        // The ESTABLISHED events stay queued: each names its EP.
        let (s, c) = (&k.server.conn_evd, &k.client.conn_evd);
        let deadline = Instant::now() + Duration::from_secs(10);
        while (s.is_empty() || c.is_empty()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!s.is_empty() && !c.is_empty(), "no connection events");
        common::drop_and_close(k);
    }
    common::assert_threads_back_to(before);
}
