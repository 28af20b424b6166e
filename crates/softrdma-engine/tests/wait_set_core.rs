//! `WaitSet` over QPs driven by the protocol core: a waiter woken by
//! bytes on a QP's socket receives them itself without looking at the
//! socket again first.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use softrdma_engine::wait_set::WaitSet;
use softrdma_engine::{
    CompletionQueue, DeviceConfig, MemoryRegion, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

const ROUNDS: usize = 300;
const SIZE: usize = 64;

/// Waits in `set` until `cq` gives one completion of `opcode` (others,
/// send completions, are counted into `sends`).
fn wait_for(
    set: &mut WaitSet,
    cq: &CompletionQueue,
    opcode: WcOpcode,
    sends: &mut usize,
) -> WorkCompletion {
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
    loop {
        if cq.poll(&mut buf) == 1 {
            assert_eq!(buf[0].status, WcStatus::Success, "{:?}", buf[0]);
            if buf[0].opcode == opcode {
                return buf[0];
            }
            *sends += 1;
            continue;
        }
        // A wake-up without a result (bytes that made no completion yet)
        // is allowed; the 10 s are a hang detector only.
        set.wait(Some(Duration::from_secs(10))).expect("wait");
    }
}

fn post_recv(side: &common::Side, mr: &MemoryRegion, i: usize) {
    side.qp
        .post_recv(&RecvWr::new(i as u64, &[mr.sge(0, SIZE as u32).unwrap()]))
        .unwrap();
}

/// One side of the ping-pong: receives into `dst`, checks the bytes,
/// answers with them plus one from `src`.
fn echo(side: common::Side, src: MemoryRegion, dst: MemoryRegion, extra: usize) {
    let quiet: Vec<_> = (0..extra).map(|_| UnixStream::pair().unwrap()).collect();
    let mut set = WaitSet::new();
    set.add_cq(&side.cq);
    for q in &quiet {
        set.add_fd(q.0.as_raw_fd(), libc::POLLIN);
    }
    let mut sends = 0;
    let mut msg = [0u8; SIZE];
    for i in 0..ROUNDS {
        let wc = wait_for(&mut set, &side.cq, WcOpcode::Recv, &mut sends);
        assert_eq!(wc.byte_len as usize, SIZE);
        dst.read(0, &mut msg).unwrap();
        assert_eq!(msg, common::pattern(SIZE, i as u8)[..], "round {i}");
        post_recv(&side, &dst, i + 1);
        let answer = common::pattern(SIZE, (i as u8).wrapping_add(100));
        src.write(0, &answer).unwrap();
        side.qp
            .post_send(
                &SendWr::new(i as u64, SendOp::Send)
                    .sg_list(&[src.sge(0, SIZE as u32).unwrap()])
                    .signaled(),
            )
            .unwrap();
        // The send completes before the source buffer is written again.
        while sends <= i {
            let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
            if side.cq.poll(&mut buf) == 1 {
                assert_eq!(buf[0].opcode, WcOpcode::Send);
                sends += 1;
            } else {
                set.wait(Some(Duration::from_secs(10))).expect("wait");
            }
        }
    }
}

/// A 64-byte ping-pong in which both ends wait only in wait sets, on
/// the core path: every message arrives byte-exact, none is lost, no
/// wait hangs; in a set that sleeps in `ppoll(2)` (the CQ alone) and in
/// one that sleeps in epoll (the CQ and three quiet descriptors).
#[test]
fn ping_pong_through_wait_sets_on_the_core_path() {
    for extra in [0, 3] {
        let mut cfg = DeviceConfig::default();
        cfg.poll_spin = Duration::ZERO;
        cfg.pin_threads = false;
        let dev = softrdma_engine::Device::open_with(cfg).unwrap();
        let p = common::pair_with(dev, false, |_| {});
        let (a_src, a_dst) = (common::mr(&p.a, SIZE), common::mr(&p.a, SIZE));
        let (b_src, b_dst) = (common::mr(&p.b, SIZE), common::mr(&p.b, SIZE));
        post_recv(&p.a, &a_dst, 0);
        post_recv(&p.b, &b_dst, 0);
        let common::Pair { a, b, dev: _dev } = p;
        let echoer = std::thread::spawn(move || echo(b, b_src, b_dst, extra));
        let mut set = WaitSet::new();
        set.add_cq(&a.cq);
        let quiet: Vec<_> = (0..extra).map(|_| UnixStream::pair().unwrap()).collect();
        for q in &quiet {
            set.add_fd(q.0.as_raw_fd(), libc::POLLIN);
        }
        let mut sends = 0;
        let mut msg = [0u8; SIZE];
        for i in 0..ROUNDS {
            a_src.write(0, &common::pattern(SIZE, i as u8)).unwrap();
            a.qp.post_send(
                &SendWr::new(i as u64, SendOp::Send)
                    .sg_list(&[a_src.sge(0, SIZE as u32).unwrap()])
                    .signaled(),
            )
            .unwrap();
            let wc = wait_for(&mut set, &a.cq, WcOpcode::Recv, &mut sends);
            assert_eq!(wc.byte_len as usize, SIZE);
            a_dst.read(0, &mut msg).unwrap();
            let want = common::pattern(SIZE, (i as u8).wrapping_add(100));
            assert_eq!(msg, want[..], "answer {i}, set of {} entries", 1 + extra);
            post_recv(&a, &a_dst, i + 1);
            while sends <= i {
                let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
                if a.cq.poll(&mut buf) == 1 {
                    assert_eq!(buf[0].opcode, WcOpcode::Send);
                    sends += 1;
                } else {
                    set.wait(Some(Duration::from_secs(10))).expect("wait");
                }
            }
        }
        echoer.join().unwrap();
    }
}

/// [`wait_for`] with the sleep in the QP's socket's `recv`
/// (`WaitSet::wait_receiving`); counts the waits that slept there.
fn wait_receiving_for(
    set: &mut WaitSet,
    cq: &CompletionQueue,
    opcode: WcOpcode,
    sends: &mut usize,
    slept: &mut usize,
) -> WorkCompletion {
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
    loop {
        if cq.poll(&mut buf) == 1 {
            assert_eq!(buf[0].status, WcStatus::Success, "{:?}", buf[0]);
            if buf[0].opcode == opcode {
                return buf[0];
            }
            *sends += 1;
            continue;
        }
        // The 10 s are a hang detector only.
        match set.wait_receiving(Duration::from_secs(10)).expect("wait") {
            Some(_) => *slept += usize::from(set.slept_in_recv()),
            None => {
                set.wait(Some(Duration::from_secs(10))).expect("wait");
            }
        }
    }
}

/// A 64-byte ping-pong in which the initiator waits for each answer in
/// its socket's `recv` (`WaitSet::wait_receiving`: one system call per
/// wait) and the echoing side in `poll(2)`: every message byte-exact,
/// and the waits did sleep in `recv`.
#[test]
fn ping_pong_sleeping_in_recv_on_the_core_path() {
    let mut cfg = DeviceConfig::default();
    cfg.poll_spin = Duration::ZERO;
    cfg.pin_threads = false;
    let dev = softrdma_engine::Device::open_with(cfg).unwrap();
    let p = common::pair_with(dev, false, |_| {});
    let (a_src, a_dst) = (common::mr(&p.a, SIZE), common::mr(&p.a, SIZE));
    let (b_src, b_dst) = (common::mr(&p.b, SIZE), common::mr(&p.b, SIZE));
    post_recv(&p.a, &a_dst, 0);
    post_recv(&p.b, &b_dst, 0);
    let common::Pair { a, b, dev: _dev } = p;
    let echoer = std::thread::spawn(move || echo(b, b_src, b_dst, 0));
    let mut set = WaitSet::new();
    set.add_cq(&a.cq);
    let (mut sends, mut slept) = (0, 0);
    let mut msg = [0u8; SIZE];
    for i in 0..ROUNDS {
        a_src.write(0, &common::pattern(SIZE, i as u8)).unwrap();
        a.qp.post_send(
            &SendWr::new(i as u64, SendOp::Send)
                .sg_list(&[a_src.sge(0, SIZE as u32).unwrap()])
                .signaled(),
        )
        .unwrap();
        // The send's completion first (a sleep in `recv` would not end
        // for it): written by this thread's post or the next poll.
        while sends <= i {
            let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
            if a.cq.poll(&mut buf) == 1 {
                assert_eq!(buf[0].opcode, WcOpcode::Send);
                sends += 1;
            } else {
                set.wait(Some(Duration::from_secs(10))).expect("wait");
            }
        }
        let wc = wait_receiving_for(&mut set, &a.cq, WcOpcode::Recv, &mut sends, &mut slept);
        assert_eq!(wc.byte_len as usize, SIZE);
        a_dst.read(0, &mut msg).unwrap();
        let want = common::pattern(SIZE, (i as u8).wrapping_add(100));
        assert_eq!(msg, want[..], "answer {i}");
        post_recv(&a, &a_dst, i + 1);
    }
    echoer.join().unwrap();
    assert!(slept > 0, "no wait slept in recv");
}

/// A wait in `recv` that `changed` ended before the sleep (what it waits
/// for came another way) used to report that it slept there
/// (`slept_in_recv`), and the callers' counts of sleeps in `recv` counted
/// sleeps that never were. A wait that did sleep (nothing came, its time
/// ran out) still says so.
#[test]
fn a_wait_ended_by_changed_before_its_sleep_did_not_sleep_in_recv() {
    let mut cfg = DeviceConfig::default();
    cfg.poll_spin = Duration::ZERO;
    cfg.pin_threads = false;
    let dev = softrdma_engine::Device::open_with(cfg).unwrap();
    let p = common::pair_with(dev, false, |_| {});
    let a_dst = common::mr(&p.a, SIZE);
    post_recv(&p.a, &a_dst, 0);
    let mut set = WaitSet::new();
    set.add_cq(&p.a.cq);
    let short = Duration::from_millis(20);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    // (`None`: an engine thread held the receive; tried again.)
    let mut wait = |changed: bool| loop {
        assert!(std::time::Instant::now() < deadline, "never waited in recv");
        match set.wait_receiving_handed(short, &|| changed, &mut || false, &mut None) {
            Ok(Some(n)) => {
                assert_eq!(n, 0);
                return set.slept_in_recv();
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(1)),
            Err(e) => panic!("wait: {e}"),
        }
    };
    assert!(!wait(true), "a wait ended before its sleep counted as one");
    assert!(wait(false), "a wait that slept in recv not counted");
}
