//! Shared setup of the loopback integration tests.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpInitAttr,
    QueuePair, WorkCompletion,
};

/// One side of a connection.
pub(crate) struct Side {
    pub(crate) pd: ProtectionDomain,
    pub(crate) cq: CompletionQueue,
    pub(crate) qp: QueuePair,
}

/// A connected pair of QPs on one device.
pub(crate) struct Pair {
    pub(crate) dev: Device,
    pub(crate) a: Side,
    pub(crate) b: Side,
}

pub(crate) fn device(force_dm: bool) -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.force_datamover = force_dm;
    cfg.pin_threads = false;
    Device::open_with(cfg).expect("device")
}

pub(crate) fn side(dev: &Device, tweak: impl Fn(&mut QpInitAttr)) -> Side {
    let pd = ProtectionDomain::new(dev);
    let cq = CompletionQueue::new(dev, 4096, None).expect("cq");
    let mut attr = QpInitAttr::new(&cq, &cq);
    tweak(&mut attr);
    let qp = QueuePair::new(&pd, &attr).expect("qp");
    Side { pd, cq, qp }
}

pub(crate) fn pair_with(dev: Device, crc: bool, tweak: impl Fn(&mut QpInitAttr)) -> Pair {
    let a = side(&dev, &tweak);
    let b = side(&dev, &tweak);
    let cfg = MpaConfig {
        crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::AcceptIfAsked
        },
        ..MpaConfig::default()
    };
    connect_pair(&a.qp, &b.qp, &cfg).expect("connect");
    Pair { dev, a, b }
}

pub(crate) fn pair(crc: bool) -> Pair {
    pair_with(device(false), crc, |_| {})
}

pub(crate) fn mr(side: &Side, len: usize) -> MemoryRegion {
    side.pd
        .register(
            len,
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
        )
        .expect("register")
}

/// Polls until `n` completions arrived (10 s limit).
pub(crate) fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::success(0, softrdma_engine::WcOpcode::Send, 0); 16];
    while out.len() < n {
        let k = cq.poll(&mut buf);
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "timed out with {} of {n} completions: {out:?}",
                out.len()
            );
            std::thread::yield_now();
        }
    }
    out
}

/// Deterministic test pattern.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Threads of the process (/proc/self/task) less the process-wide
/// singletons that start on first use and then live for good
/// (`softrdma-timer`, the close timers of every QP; `softrdma-cm`, the
/// reactor): whether the first one starts before or after the baseline
/// depends on which side of a warm-up connection closes first, and
/// neither grows with load.
pub(crate) fn threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|c| !matches!(c.trim(), "softrdma-timer" | "softrdma-cm"))
        .count()
}

/// Names of the threads, for failure messages.
pub(crate) fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect()
}

/// The thread count once transient threads are gone (at most 5 s).
pub(crate) fn settled_threads(at_most: usize) -> usize {
    let mut t = threads();
    for _ in 0..100 {
        if t <= at_most {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        t = threads();
    }
    t
}
