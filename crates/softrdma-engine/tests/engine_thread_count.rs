//! Never more engine data-path threads than usable CPUs: each engine thread
//! both transmits (datamover) and receives for its QPs, and asking for more
//! threads than CPUs gets one per usable CPU.
//!
//! One test function: it counts the threads of the whole process.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::{Duration, Instant};

use softrdma_engine::{Device, DeviceConfig, RecvWr, SendOp, SendWr};

fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Data-path threads of the process: datamovers, receive threads, or
/// anything else the engine names after its per-CPU data path.
fn data_path_threads() -> Vec<String> {
    common::thread_names()
        .into_iter()
        .filter(|n| n.starts_with("softrdma-dm") || n.starts_with("softrdma-rx"))
        .collect()
}

#[test]
fn no_more_engine_threads_than_usable_cpus() {
    let cpus = usable_cpus();
    // Ask for three times as many threads as there are usable CPUs.
    let mut cfg = DeviceConfig::default();
    cfg.datamover_cpus = (0..3 * cpus).map(|i| i % cpus).collect();
    let dev = Device::open_with(cfg).unwrap();
    assert!(
        dev.attr().datamovers as usize <= cpus,
        "{} engine threads for {cpus} usable CPUs",
        dev.attr().datamovers
    );

    // Connected QPs, traffic both ways through the threads (every QP of
    // its own: the least-loaded assignment spreads them over every thread).
    let mut pairs = Vec::new();
    for _ in 0..2 * cpus {
        let a = common::side(&dev, |_| {});
        let b = common::side(&dev, |_| {});
        softrdma_engine::loopback::connect_pair(
            &a.qp,
            &b.qp,
            &softrdma_engine::proto::mpa::MpaConfig::default(),
        )
        .unwrap();
        pairs.push((a, b));
    }
    for (a, b) in &pairs {
        let ma = common::mr(a, 64);
        let mb = common::mr(b, 64);
        b.qp.post_recv(&RecvWr::new(1, &[mb.sge(0, 64).unwrap()]))
            .unwrap();
        a.qp.post_send(
            &SendWr::new(2, SendOp::Send)
                .sg_list(&[ma.sge(0, 8).unwrap()])
                .signaled(),
        )
        .unwrap();
        common::wait(&a.cq, 1);
        common::wait(&b.cq, 1);
    }

    // Every thread the device starts has named itself by now (a new thread
    // sets its name shortly after it starts).
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut seen = data_path_threads();
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        seen = data_path_threads();
    }
    assert!(
        !seen.is_empty(),
        "no engine thread: {:?}",
        common::thread_names()
    );
    assert!(
        seen.len() <= cpus,
        "{} data-path threads for {cpus} usable CPUs: {seen:?}",
        seen.len()
    );
    assert_eq!(seen.len(), dev.attr().datamovers as usize, "{seen:?}");
    let stats = dev.datamover_stats();
    assert_eq!(stats.len(), seen.len());
    assert_eq!(stats.iter().map(|s| s.qps).sum::<usize>(), 4 * cpus);
}
