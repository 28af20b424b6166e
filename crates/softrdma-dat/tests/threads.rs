//! Closing the last IA leaves no thread of the IA running (the provider
//! may be unloaded after it). Own test binary: it counts the process's
//! threads.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_dat::{
    CompletionFlags, Ep, Evd, EvdFlags, Event, Ia, IaConfig, Lmr, MemPriv, Psp, Pz,
};

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

/// Names of this process's threads (for the failure message).
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task").map_or(Vec::new(), |d| {
        d.filter_map(Result::ok)
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    })
}

#[test]
fn closing_the_ias_ends_their_threads() {
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
            let lmr = Lmr::alloc(&pz, 4096, MemPriv::ALL).unwrap();
            (pz, cr, conn, dto, ep, lmr)
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
        s.2.wait(t, 1).unwrap();
        c.2.wait(t, 1).unwrap();
        let seg = softrdma_dat::LmrTriplet {
            lmr_context: c.5.lmr_context(),
            virtual_address: c.5.address(),
            segment_length: 8,
        };
        c.4.post_send(&[seg], 1, CompletionFlags::DEFAULT).unwrap();
        c.3.wait(t, 1).unwrap();
        assert!(threads() > before);
        c.4.disconnect(false).unwrap();
        for side in [&s, &c] {
            side.3.drain();
            side.2.drain();
        }
        drop((cr, psp, s, c));
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
