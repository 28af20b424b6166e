//! Closing an IA whose EVDs still hold events that name their EPs (an EP
//! holds its EVDs, so such an event kept both, and the device under them,
//! alive) leaves no thread of the IA running. Own test binary: it counts
//! the process's threads.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_dat::{Ep, Evd, EvdFlags, Event, Ia, IaConfig, Psp, Pz};

/// Threads of this process, without the engine's connection-manager
/// reactor: one process-wide thread, started on first use and kept for the
/// life of the process (the provider is linked `-z nodelete`, so its code
/// stays mapped for that thread after libdat2's dlclose).
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| {
        d.filter_map(Result::ok)
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .map_or(true, |c| c.trim() != "softrdma-cm")
            })
            .count()
    })
}

#[test]
fn closing_an_ia_with_undrained_connection_events_ends_its_threads() {
    let before = threads();
    {
        let t = Some(Duration::from_secs(10));
        let open = |n: &str| {
            let mut c = IaConfig::loopback(n);
            c.connect_retry = None;
            Ia::open(c).unwrap()
        };
        let (a, b) = (open("a"), open("b"));
        let mk = |ia: &Ia| {
            let pz = Pz::new(ia);
            let cr = Evd::new(ia, 4, EvdFlags::CR, None).unwrap();
            let conn = Evd::new(ia, 4, EvdFlags::CONNECTION, None).unwrap();
            let dto = Evd::new(ia, 16, EvdFlags::DTO, None).unwrap();
            let ep = Ep::new(ia, &pz, Some(&dto), Some(&dto), Some(&conn), None).unwrap();
            (pz, cr, conn, dto, ep)
        };
        let s = mk(&a);
        let c = mk(&b);
        let psp = Psp::new_any(&a, &s.1, 0).unwrap();
        let lo = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
        c.4.connect(lo, psp.conn_qual(), t, &[]).unwrap();
        let Event::ConnRequest { cr, .. } = s.1.wait(t, 1).unwrap().0 else {
            panic!("no request")
        };
        cr.accept(Some(&s.4), &[]).unwrap();
        // The ESTABLISHED events stay queued: each names its EP.
        let deadline = Instant::now() + Duration::from_secs(10);
        while (s.2.is_empty() || c.2.is_empty()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(!s.2.is_empty() && !c.2.is_empty(), "no connection events");
        drop((cr, psp, s, c));
        a.close(false).unwrap();
        b.close(false).unwrap();
    }
    let until = Instant::now() + Duration::from_secs(10);
    while threads() > before && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(threads(), before, "threads left after the IAs closed");
}
