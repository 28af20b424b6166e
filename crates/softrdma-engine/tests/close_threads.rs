//! Regression test (alone in its binary: it counts the process's threads,
//! which tests running beside it would disturb).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::QpState;

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn threads_of_this_process() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap()
}

/// Every graceful close used to start an OS thread that slept for the whole
/// close timeout (5 s), also when the peer started the close: thousands of
/// closed connections meant thousands of threads. Close timers now share
/// the engine's timer thread.
#[test]
fn graceful_closes_do_not_start_a_thread_each() {
    let dev = device(false);
    // Warm up: the device's threads and the timer thread exist.
    {
        let p = pair_with(dev.clone(), false, |_| {});
        p.b.qp.disconnect().unwrap();
        until("IDLE", || {
            p.a.qp.state() == QpState::Idle && p.b.qp.state() == QpState::Idle
        });
    }
    let before = threads_of_this_process();
    for _ in 0..150 {
        let p = pair_with(dev.clone(), false, |_| {});
        // Closed by the peer (b): a's close is started by b's FIN.
        p.b.qp.disconnect().unwrap();
        until("IDLE", || {
            p.a.qp.state() == QpState::Idle && p.b.qp.state() == QpState::Idle
        });
    }
    let after = threads_of_this_process();
    assert!(
        after <= before + 20,
        "150 closed connections left {} more threads ({before} -> {after})",
        after.saturating_sub(before)
    );
}
