//! The engine's own threads: how many, when they start, pinning, signals.
//!
//! One test function (the steps count threads of the whole process, so
//! they must not run next to each other).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, ProtectionDomain, QpInitAttr, QueuePair, RecvWr,
    SendOp, SendWr,
};

/// (name, blocked-signal mask) of every thread of the process.
fn threads() -> Vec<(String, u64)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| {
            let dir = t.ok()?.path();
            let name = std::fs::read_to_string(dir.join("comm")).ok()?;
            let status = std::fs::read_to_string(dir.join("status")).ok()?;
            let blk = status
                .lines()
                .find_map(|l| l.strip_prefix("SigBlk:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .unwrap_or(0);
            Some((name.trim().to_string(), blk))
        })
        .collect()
}

fn named(prefix: &str) -> Vec<(String, u64)> {
    threads()
        .into_iter()
        .filter(|(n, _)| n.starts_with(prefix))
        .collect()
}

/// Threads named `prefix*` once there are at least `n` (a new thread sets
/// its name itself, shortly after it starts; at most 5 s).
fn named_eventually(prefix: &str, n: usize) -> Vec<(String, u64)> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let t = named(prefix);
        if t.len() >= n || Instant::now() > deadline {
            return t;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn usable_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Bits of SIGINT, SIGTERM, SIGALRM, SIGCHLD and SIGPROF in a
/// /proc SigBlk mask (bit `signo - 1`).
fn must_block() -> u64 {
    [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGALRM,
        libc::SIGCHLD,
        libc::SIGPROF,
        libc::SIGUSR1,
    ]
    .iter()
    .map(|&s| 1u64 << (s - 1))
    .fold(0, |a, b| a | b)
}

#[test]
fn engine_threads_start_lazily_are_not_pinned_and_block_signals() {
    // Defaults: no pinning.
    assert!(!DeviceConfig::default().pin_threads);

    // Opening a device starts no thread: a library that opens the device
    // inside someone else's process adds threads only when it is used.
    let dev = Device::open_default().unwrap();
    let h = dev.handler_stats();
    assert_eq!(h.len(), usable_cpus());
    assert!(h.iter().all(|s| !s.running && !s.pinned), "{h:?}");
    assert!(
        named("softrdma-cq").is_empty(),
        "handler threads at open: {:?}",
        threads()
    );
    assert!(named("softrdma-dm").is_empty());
    assert!(named("softrdma-rx").is_empty());
    assert!(dev.datamover_stats().is_empty());

    // A polled CQ needs no handler thread.
    let _polled = CompletionQueue::new(&dev, 16, None).unwrap();
    assert!(named("softrdma-cq").is_empty());

    // A CQ with a callback starts its handler's thread, which blocks
    // signals; the callback sees them blocked.
    let blocked_in_callback = Arc::new(AtomicBool::new(false));
    let ran = Arc::new(AtomicBool::new(false));
    let (b2, r2) = (blocked_in_callback.clone(), ran.clone());
    let cb = CompletionQueue::with_callback(&dev, 16, move |cq: &CompletionQueue| {
        b2.store(
            softrdma_engine::signal_blocked(libc::SIGINT),
            Ordering::SeqCst,
        );
        r2.store(true, Ordering::SeqCst);
        cq.drain_and_arm(false, |_| {});
    })
    .unwrap();
    let cq_threads = named_eventually("softrdma-cq", 1);
    assert_eq!(cq_threads.len(), 1, "{:?}", threads());
    assert_eq!(dev.handler_stats().iter().filter(|s| s.running).count(), 1);

    // The first QP starts the engine threads: one per usable CPU at most,
    // each both datamover and receiver (no separate receive threads),
    // none pinned. Side b's receive CQ is the callback CQ.
    let a = common::side(&dev, |_| {});
    let pd = ProtectionDomain::new(&dev);
    let send_cq = CompletionQueue::new(&dev, 16, None).unwrap();
    let qp_b = QueuePair::new(&pd, &QpInitAttr::new(&send_cq, &cb)).unwrap();
    connect_pair(&a.qp, &qp_b, &MpaConfig::default()).unwrap();
    let dm = named_eventually("softrdma-dm", dev.attr().datamovers as usize);
    assert!(!dm.is_empty() && dm.len() <= usable_cpus(), "{dm:?}");
    assert!(named("softrdma-rx").is_empty(), "{:?}", threads());
    assert_eq!(dev.attr().datamovers as usize, dm.len());

    // Every engine thread blocks the usual process signals; the test's
    // own thread does not. (Threads still named after this test are new
    // engine threads that have not named themselves yet.)
    for (name, blk) in threads() {
        if name.starts_with("softrdma-") {
            assert_eq!(
                blk & must_block(),
                must_block(),
                "{name} accepts signals: SigBlk {blk:016x}"
            );
        }
    }
    assert!(!softrdma_engine::signal_blocked(libc::SIGINT));

    // The callback runs on the handler thread, with signals blocked.
    let mr_a = common::mr(&a, 64);
    let mr_b = pd.register(64, Access::LOCAL_WRITE).unwrap();
    qp_b.post_recv(&RecvWr::new(1, &[mr_b.sge(0, 64).unwrap()]))
        .unwrap();
    cb.req_notify(false).unwrap();
    a.qp.post_send(
        &SendWr::new(2, SendOp::Send)
            .sg_list(&[mr_a.sge(0, 8).unwrap()])
            .signaled(),
    )
    .unwrap();
    common::wait(&a.cq, 1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ran.load(Ordering::SeqCst) {
        assert!(Instant::now() < deadline, "the callback did not run");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(blocked_in_callback.load(Ordering::SeqCst));
}
