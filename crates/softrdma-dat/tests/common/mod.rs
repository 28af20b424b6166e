//! Shared by the test binaries that count the process's threads: the
//! counts, and two IAs on loopback with a connection between them.

// Each test binary uses its own part of it.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_dat::{Cr, Ep, Evd, EvdFlags, Event, Ia, IaConfig, Lmr, MemPriv, Psp, Pz};

/// Threads of this process, without the engine's connection-manager
/// reactor: one process-wide thread, started on first use and kept for the
/// life of the process (the provider is linked `-z nodelete`, so its code
/// stays mapped for that thread after libdat2's dlclose).
pub(crate) fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| {
        d.filter_map(Result::ok)
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .map_or(true, |c| c.trim() != "softrdma-cm")
            })
            .count()
    })
}

/// Names of this process's threads (for failure messages).
pub(crate) fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task").map_or(Vec::new(), |d| {
        d.filter_map(Result::ok)
            .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
            .map(|c| c.trim().to_string())
            .collect()
    })
}

/// Waits (up to 10 s) for the process to be back at `before` threads: the
/// engine's threads are told to stop and leave on their own. Fails naming
/// the threads left over.
pub(crate) fn assert_threads_back_to(before: usize) {
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

/// Drops every object of `k`, then closes both IAs abruptly.
pub(crate) fn drop_and_close(k: Connected) {
    let Connected {
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

/// One side's objects.
pub(crate) struct Side {
    pub(crate) pz: Pz,
    pub(crate) cr_evd: Evd,
    pub(crate) conn_evd: Evd,
    pub(crate) dto_evd: Evd,
    pub(crate) ep: Ep,
    pub(crate) lmr: Lmr,
}

/// Two IAs on loopback, a server side listening (`Psp`) and a client side
/// whose connect the server accepted; the connection events are not taken.
pub(crate) struct Connected {
    pub(crate) a: Ia,
    pub(crate) b: Ia,
    pub(crate) server: Side,
    pub(crate) client: Side,
    pub(crate) psp: Psp,
    pub(crate) cr: Cr,
}

pub(crate) fn connected(timeout: Option<Duration>) -> Connected {
    let open = |n: &str| {
        let mut c = IaConfig::loopback(n);
        c.connect_retry = None;
        Ia::open(c).unwrap()
    };
    let (a, b) = (open("a"), open("b"));
    let mk = |ia: &Ia| {
        let pz = Pz::new(ia);
        let cr_evd = Evd::new(ia, 4, EvdFlags::CR, None).unwrap();
        let conn_evd = Evd::new(ia, 4, EvdFlags::CONNECTION, None).unwrap();
        let dto_evd = Evd::new(ia, 16, EvdFlags::DTO, None).unwrap();
        let ep = Ep::new(
            ia,
            &pz,
            Some(&dto_evd),
            Some(&dto_evd),
            Some(&conn_evd),
            None,
        )
        .unwrap();
        let lmr = Lmr::alloc(&pz, 4096, MemPriv::ALL).unwrap();
        Side {
            pz,
            cr_evd,
            conn_evd,
            dto_evd,
            ep,
            lmr,
        }
    };
    let server = mk(&a);
    let client = mk(&b);
    let psp = Psp::new_any(&a, &server.cr_evd, 0).unwrap();
    let lo = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    client
        .ep
        .connect(lo, psp.conn_qual(), timeout, &[])
        .unwrap();
    let Event::ConnRequest { cr, .. } = server.cr_evd.wait(timeout, 1).unwrap().0 else {
        panic!("no request")
    };
    cr.accept(Some(&server.ep), &[]).unwrap();
    Connected {
        a,
        b,
        server,
        client,
        psp,
        cr,
    }
}
