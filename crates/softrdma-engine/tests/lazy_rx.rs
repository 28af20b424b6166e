//! A connected QP's socket is handed to its engine thread lazily (the
//! connecting thread counts as its poller at first): receive progress must
//! still never be lost. A QP nobody polls, one whose poller stops right
//! after the connection, one whose CQ is armed at once, and one connected
//! after many short-lived connections (whose sockets' descriptors are
//! reused) all get their bytes placed without the owner polling. Deadlines
//! only turn a hang into a failure.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    CompletionChannel, CompletionQueue, MemoryRegion, QpInitAttr, QueuePair, RecvWr, SendOp,
    SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const TIMEOUT: Duration = Duration::from_secs(20);

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A writes `data` into `dst` (B's memory) and waits for its own
/// completion; B is not touched.
fn write_to(p: &Pair, dst: &MemoryRegion, data: &[u8], id: u64) {
    let src = mr(&p.a, data.len());
    src.write(0, data).unwrap();
    let sge = [src.sge(0, data.len() as u32).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                id,
                SendOp::Write {
                    remote_addr: dst.addr(),
                    rkey: dst.rkey(),
                },
            )
            .sg_list(&sge)
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{c:?}");
}

/// A connection of `dev` used by its pollers for one 8-byte Send (filled
/// with `i`), both completions polled, then closed.
fn short_connection(dev: &softrdma_engine::Device, i: u8) {
    let p = pair_with(dev.clone(), false, |_| {});
    let buf = mr(&p.b, 8);
    let sge = [buf.sge(0, 8).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(1, &sge)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).inline(&[i; 8]).signaled())
        .unwrap();
    assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&p.b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(buf.to_vec(), [i; 8]);
}

#[test]
fn a_qp_nobody_polls_after_its_connection_still_receives() {
    let p = pair(false);
    let dst = mr(&p.b, 4096);
    let data = pattern(4096, 3);
    write_to(&p, &dst, &data, 1);
    // Only B's engine thread can place it: nobody polls B's CQ.
    until("the Write placed by the engine thread", || {
        dst.to_vec() == data
    });
}

#[test]
fn a_qp_whose_poller_stops_right_after_the_connection_still_receives() {
    let p = pair(false);
    let dst = mr(&p.b, 64 << 10);
    let flag = mr(&p.b, 16);
    let fsge = [flag.sge(0, 16).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(7, &fsge)).unwrap();
    // B's owner polls for a few milliseconds (longer than the engine
    // thread leaves a polled QP alone), then goes away.
    let mut out = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
    let stop = Instant::now() + Duration::from_millis(5);
    while Instant::now() < stop {
        assert_eq!(p.b.cq.poll(&mut out), 0);
    }
    let data = pattern(64 << 10, 9);
    write_to(&p, &dst, &data, 1);
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::Send).inline(b"done").signaled())
        .unwrap();
    assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::Success);
    until("the Write and the Send placed by the engine thread", || {
        dst.to_vec() == data && flag.to_vec()[..4] == *b"done"
    });
    // The receive completed without a poll driving it.
    until("the receive completion queued", || p.b.cq.len() == 1);
    let c = wait(&p.b.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (7, WcStatus::Success));
}

#[test]
fn a_cq_armed_right_after_the_connection_gets_its_event() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let ch = CompletionChannel::new(&dev).unwrap();
    let pd = softrdma_engine::ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 64, Some(&ch)).unwrap();
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
    let b = Side { pd, cq, qp };
    connect_pair(&a.qp, &b.qp, &MpaConfig::default()).expect("connect");
    let buf = mr(&b, 64);
    let sge = [buf.sge(0, 64).unwrap()];
    b.qp.post_recv(&RecvWr::new(5, &sge)).unwrap();
    b.cq.req_notify(false).unwrap();
    a.qp.post_send(&SendWr::new(1, SendOp::Send).inline(b"ping").signaled())
        .unwrap();
    let got = ch.get_event(Some(TIMEOUT)).expect("completion event");
    assert!(got.same_as(&b.cq));
    b.cq.ack_events(1);
    let c = wait(&b.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (5, WcStatus::Success));
    assert_eq!(&buf.to_vec()[..4], b"ping");
}

#[test]
fn an_unpolled_qp_after_many_short_connections_still_receives() {
    let dev = device(false);
    // Connections opened, used by their pollers and closed before the
    // engine thread took them over: their sockets' descriptors are reused.
    for i in 0..40u8 {
        short_connection(&dev, i);
    }
    let p = pair_with(dev, false, |_| {});
    let dst = mr(&p.b, 8192);
    let data = pattern(8192, 77);
    write_to(&p, &dst, &data, 1);
    until("the Write placed by the engine thread", || {
        dst.to_vec() == data
    });
}

/// Connections whose owners drive them with CQ polls, from the connection
/// to the close, never wake an engine thread: a registration only sets the
/// thread's hand-over timer (before, the first connection after the thread
/// went idle woke it through its event fd, and so did most connections of
/// a sparse stream: the idle thread sleeps 500 ms, longer than the
/// hand-over is due). A connection that outlives the quiet period is
/// looked at when the timer expires, which is not counted here.
#[test]
fn connections_driven_by_their_pollers_never_wake_the_engine_threads() {
    let dev = device(false);
    for i in 0..20u8 {
        short_connection(&dev, i);
        // Between connections the threads go idle (sleeping 500 ms).
        std::thread::sleep(Duration::from_millis(3));
    }
    let stats = dev.datamover_stats();
    let woken: u64 = stats.iter().map(|s| s.rx_wakeups).sum();
    assert_eq!(woken, 0, "{stats:?}");
}

/// The hand-over of a QP nobody polls comes from the engine thread's
/// hand-over timer (the thread is not woken at the registration): the
/// Write is placed, and the timer expired for it.
///
/// The case needs the thread asleep when the QP registers: the threads are
/// started first (a thread starts with the first QP assigned to it, so one
/// started by the pair itself was still starting when the pair's QPs
/// registered and took them without a timer). On a busy
/// machine it may still be awake then and take the registration itself
/// (placed, no timer, no wake-up): such a try is repeated with a new
/// device. A thread woken through its event fd fails at once; a timer that
/// never fires leaves every try to the end of the thread's 500 ms sleep,
/// and the test fails after the last.
#[test]
fn an_unpolled_qp_is_handed_over_by_the_timer() {
    const TRIES: usize = 8;
    let mut seen = Vec::new();
    for _ in 0..TRIES {
        let dev = device(false);
        // An engine thread starts with the first QP assigned to it: QPs
        // held on every thread at once start them all (each goes to the
        // least-loaded thread), and are gone again before the pair's.
        let threads = dev.datamover_stats().len();
        let starters: Vec<Side> = (0..threads).map(|_| side(&dev, |_| {})).collect();
        assert!(
            dev.datamover_stats().iter().all(|s| s.running),
            "{:?}",
            dev.datamover_stats()
        );
        drop(starters);
        // The engine threads start their first (500 ms) sleep; the QPs are
        // registered during it, well before it ends.
        std::thread::sleep(Duration::from_millis(20));
        let p = pair_with(dev, false, |_| {});
        let dst = mr(&p.b, 4096);
        let data = pattern(4096, 5);
        write_to(&p, &dst, &data, 1);
        until("the Write placed by the engine thread", || {
            dst.to_vec() == data
        });
        let stats = p.dev.datamover_stats();
        assert_eq!(
            stats.iter().map(|s| s.rx_wakeups).sum::<u64>(),
            0,
            "{stats:?}"
        );
        if stats.iter().map(|s| s.handover_timeouts).sum::<u64>() >= 1 {
            return;
        }
        seen.push(stats);
    }
    panic!("no hand-over by the timer in {TRIES} tries: {seen:?}");
}
