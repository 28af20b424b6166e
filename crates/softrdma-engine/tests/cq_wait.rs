//! `CompletionQueue::wait`: bounded busy-poll, then sleep until a push.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::Duration;

use softrdma_engine::{
    CompletionQueue, Device, DeviceConfig, RecvWr, SendOp, SendWr, WcOpcode, WorkCompletion,
};

fn device(spin: Duration, poll_driven: bool) -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.poll_spin = spin;
    cfg.poll_driven_receive = poll_driven;
    Device::open_with(cfg).unwrap()
}

fn wcs() -> [WorkCompletion; 4] {
    [WorkCompletion::success(0, WcOpcode::Send, 0); 4]
}

#[test]
fn wait_on_an_empty_cq_returns_nothing_after_the_timeout() {
    let dev = device(Duration::from_micros(10), true);
    let cq = CompletionQueue::new(&dev, 4, None).unwrap();
    assert_eq!(cq.wait(&mut wcs(), Some(Duration::from_millis(20))), 0);
    assert_eq!(cq.wait(&mut wcs(), Some(Duration::ZERO)), 0);
    assert_eq!(cq.wait(&mut [], None), 0);
}

/// A sleeping waiter (no spin, no poll-driven receive: only the receive
/// thread can produce the completion) is woken by the push, for many
/// messages in a row; each message is waited for by a fresh sleep.
#[test]
fn a_sleeping_waiter_is_woken_by_each_completion() {
    for poll_driven in [false, true] {
        let p = common::pair_with(device(Duration::ZERO, poll_driven), false, |_| {});
        let src = common::mr(&p.a, 64);
        let dst = common::mr(&p.b, 64);
        let rounds = 200u64;
        for i in 0..rounds {
            p.b.qp
                .post_recv(&RecvWr::new(i, &[dst.sge(0, 64).unwrap()]))
                .unwrap();
        }
        let bcq = p.b.cq.clone();
        let waiter = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut buf = wcs();
            while got.len() < rounds as usize {
                let n = bcq.wait(&mut buf, Some(Duration::from_secs(10)));
                assert!(n > 0, "timed out after {} completions", got.len());
                got.extend(buf[..n].iter().map(|w| (w.wr_id, w.opcode, w.byte_len)));
            }
            got
        });
        for i in 0..rounds {
            if i % 16 == 0 {
                // Let the waiter fall asleep now and then.
                std::thread::sleep(Duration::from_millis(2));
            }
            p.a.qp
                .post_send(
                    &SendWr::new(i, SendOp::Send)
                        .sg_list(&[src.sge(0, 8).unwrap()])
                        .signaled(),
                )
                .unwrap();
            let mut buf = wcs();
            assert_eq!(p.a.cq.wait(&mut buf[..1], Some(Duration::from_secs(10))), 1);
            assert_eq!(buf[0].wr_id, i);
        }
        let got = waiter.join().unwrap();
        let want: Vec<_> = (0..rounds).map(|i| (i, WcOpcode::Recv, 8)).collect();
        assert_eq!(got, want, "poll-driven receive {poll_driven}");
    }
}

/// `wait_progress` returns when a peer's RDMA Write was placed (no
/// completion at the target), so a memory poller can sleep.
#[test]
fn wait_progress_returns_when_a_write_lands() {
    let p = common::pair_with(device(Duration::ZERO, true), false, |_| {});
    let src = common::mr(&p.a, 64);
    let dst = common::mr(&p.b, 64);
    for round in 1..=50u8 {
        src.write(0, &[round; 8]).unwrap();
        p.a.qp
            .post_send(
                &SendWr::new(
                    u64::from(round),
                    SendOp::Write {
                        remote_addr: dst.addr(),
                        rkey: dst.rkey(),
                    },
                )
                .sg_list(&[src.sge(0, 8).unwrap()])
                .signaled(),
            )
            .unwrap();
        let mut b = [0u8; 8];
        let mut calls = 0;
        loop {
            dst.read(0, &mut b).unwrap();
            if b == [round; 8] {
                break;
            }
            calls += 1;
            assert!(calls < 1000, "round {round}: the Write never landed");
            // Returns once bytes came in (or, if the receive thread took
            // them first, after the timeout): never with a completion, the
            // target of a Write gets none.
            assert_eq!(
                p.b.cq
                    .wait_progress(&mut wcs(), Some(Duration::from_secs(2))),
                0
            );
        }
        assert_eq!(p.a.cq.wait(&mut wcs(), Some(Duration::from_secs(10))), 1);
    }
}
