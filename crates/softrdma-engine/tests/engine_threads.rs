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
    let dm = dev.datamover_stats();
    assert_eq!(dm.len(), dev.attr().datamovers as usize);
    assert!(dm.iter().all(|s| !s.running), "{dm:?}");

    // A polled CQ needs no handler thread.
    let _polled = CompletionQueue::new(&dev, 16, None).unwrap();
    assert!(named("softrdma-cq").is_empty());

    // A CQ with a callback starts no thread either: its handler's thread
    // starts with the first event (below). The callback sees signals
    // blocked.
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
    std::thread::sleep(Duration::from_millis(20));
    assert!(named("softrdma-cq").is_empty(), "{:?}", threads());
    assert!(dev.handler_stats().iter().all(|s| !s.running));

    // The first QP starts one engine thread (the one it is assigned to),
    // not one per CPU; each later QP goes to the least-loaded thread,
    // which starts then. Each thread is both datamover and receiver (no
    // separate receive threads); none is pinned. Side b's receive CQ is
    // the callback CQ.
    let a = common::side(&dev, |_| {});
    let dm = named_eventually("softrdma-dm", 1);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(named("softrdma-dm").len(), 1, "{:?}", threads());
    let running = |dev: &Device| dev.datamover_stats().iter().filter(|s| s.running).count();
    assert_eq!(running(&dev), 1, "{dm:?}");
    let pd = ProtectionDomain::new(&dev);
    let send_cq = CompletionQueue::new(&dev, 16, None).unwrap();
    let qp_b = QueuePair::new(&pd, &QpInitAttr::new(&send_cq, &cb)).unwrap();
    connect_pair(&a.qp, &qp_b, &MpaConfig::default()).unwrap();
    let want = usable_cpus().min(2);
    let dm = named_eventually("softrdma-dm", want);
    assert_eq!(dm.len(), want, "{:?}", threads());
    assert_eq!(running(&dev), want);
    assert!(named("softrdma-rx").is_empty(), "{:?}", threads());
    assert!(dm.len() <= dev.attr().datamovers as usize);

    // The callback runs on the handler thread, started by its first event.
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
    let cq_threads = named_eventually("softrdma-cq", 1);
    assert_eq!(cq_threads.len(), 1, "{:?}", threads());
    assert_eq!(dev.handler_stats().iter().filter(|s| s.running).count(), 1);

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
}
