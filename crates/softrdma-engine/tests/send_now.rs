//! Exclusive CQs and `QueuePair::post_send_now`: a send the posting thread
//! writes at once completes in the call, on an exclusive CQ only, and only
//! when nothing older waits in the CQ, nobody waits on it and it is not
//! armed; everything else completes through the CQ as before.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::{Duration, Instant};

use common::{Side, device, mr, wait};
use softrdma_engine::cq::{CompletionChannel, CompletionQueue, ResizeError};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::qp::CreateQpError;
use softrdma_engine::{
    Device, ProtectionDomain, QpInitAttr, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
    WcStatus,
};

fn end(dev: &Device, cq: CompletionQueue) -> Side {
    let pd = ProtectionDomain::new(dev);
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).expect("qp");
    Side { pd, cq, qp }
}

/// `a` on an exclusive CQ (or a plain one), `b` on a plain one, connected.
fn pair(exclusive: bool, channel: Option<&CompletionChannel>) -> (Device, Side, Side) {
    let dev = device(false);
    let mut b = CompletionQueue::builder(&dev, 256);
    if exclusive {
        b = b.exclusive();
    }
    if let Some(ch) = channel {
        b = b.channel(ch);
    }
    let a = end(&dev, b.build().expect("cq"));
    let b = end(&dev, CompletionQueue::new(&dev, 256, None).expect("cq"));
    connect_pair(&a.qp, &b.qp, &MpaConfig::default()).expect("connect");
    (dev, a, b)
}

fn post_recvs(e: &Side, mr: &softrdma_engine::MemoryRegion, n: u64) {
    for i in 0..n {
        let sge = mr.sge(i as usize * 64, 64).unwrap();
        e.qp.post_recv(&RecvWr::new(i, &[sge])).unwrap();
    }
}

fn inline_send(id: u64, data: &[u8]) -> SendWr<'_> {
    SendWr::new(id, SendOp::Send).inline(data).signaled()
}

#[test]
fn a_send_written_at_once_completes_in_the_call() {
    let (_dev, a, b) = pair(true, None);
    let dst = mr(&b, 64 * 8);
    post_recvs(&b, &dst, 8);
    let mut direct = 0;
    for i in 0..8u64 {
        let msg = [i as u8 + 1; 40];
        match a.qp.post_send_now(&inline_send(100 + i, &msg)).unwrap() {
            Some(wc) => {
                direct += 1;
                assert_eq!(wc.wr_id, 100 + i);
                assert_eq!(wc.opcode, WcOpcode::Send);
                assert_eq!(wc.status, WcStatus::Success);
                assert_eq!(wc.qp_num, a.qp.qp_num());
            }
            // The socket did not take it at once: through the CQ.
            None => {
                let got = wait(&a.cq, 1);
                assert_eq!(got[0].wr_id, 100 + i);
            }
        }
        // Nothing queued for a completion returned by the call.
        assert!(a.cq.is_empty(), "a completion given twice");
        let got = wait(&b.cq, 1);
        assert_eq!(got[0].wr_id, i);
        assert_eq!(got[0].byte_len, 40);
        let mut back = [0u8; 40];
        dst.read(i as usize * 64, &mut back).unwrap();
        assert_eq!(back, msg);
    }
    // Loopback with an empty socket buffer takes 40 octets at once.
    assert_eq!(direct, 8, "no send completed in its call");
    assert_eq!(a.qp.send_queue_len(), 0);
}

#[test]
fn a_plain_cq_gets_the_completion_as_before() {
    let (_dev, a, b) = pair(false, None);
    let dst = mr(&b, 64);
    post_recvs(&b, &dst, 1);
    assert_eq!(a.qp.post_send_now(&inline_send(7, b"plain")).unwrap(), None);
    let got = wait(&a.cq, 1);
    assert_eq!(got[0].wr_id, 7);
    assert_eq!(got[0].status, WcStatus::Success);
    assert_eq!(wait(&b.cq, 1)[0].byte_len, 5);
}

#[test]
fn an_older_completion_in_the_cq_keeps_the_order() {
    let (_dev, a, b) = pair(true, None);
    let dst = mr(&b, 64 * 2);
    post_recvs(&b, &dst, 2);
    // The first completes through the CQ (left there, not polled).
    a.qp.post_send(&inline_send(1, b"first")).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.cq.is_empty() {
        assert!(Instant::now() < deadline, "the first send never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    // The second may not overtake it: it is queued behind it.
    assert_eq!(
        a.qp.post_send_now(&inline_send(2, b"second")).unwrap(),
        None
    );
    let got = wait(&a.cq, 2);
    assert_eq!(
        got.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![1, 2],
        "completions out of order"
    );
    assert_eq!(wait(&b.cq, 2).len(), 2);
}

#[test]
fn an_armed_cq_gets_the_completion_and_its_event() {
    let dev = device(false);
    let ch = CompletionChannel::new(&dev).unwrap();
    let cq = CompletionQueue::builder(&dev, 64)
        .exclusive()
        .channel(&ch)
        .build()
        .unwrap();
    let a = end(&dev, cq);
    let b = end(&dev, CompletionQueue::new(&dev, 64, None).unwrap());
    connect_pair(&a.qp, &b.qp, &MpaConfig::default()).unwrap();
    let dst = mr(&b, 64);
    post_recvs(&b, &dst, 1);
    a.cq.req_notify(false).unwrap();
    assert_eq!(a.qp.post_send_now(&inline_send(3, b"armed")).unwrap(), None);
    let ev = ch.get_event(Some(Duration::from_secs(10))).expect("event");
    assert!(ev.same_as(&a.cq));
    a.cq.ack_events(1);
    assert_eq!(wait(&a.cq, 1)[0].wr_id, 3);
}

#[test]
fn a_send_on_a_qp_in_error_is_flushed_through_the_cq() {
    let (_dev, a, _b) = pair(true, None);
    a.qp.modify(QpState::Error).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while a.qp.state() != QpState::Error {
        assert!(Instant::now() < deadline, "never reached ERROR");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(a.qp.post_send_now(&inline_send(9, b"late")).unwrap(), None);
    let got = wait(&a.cq, 1);
    assert_eq!(got[0].wr_id, 9);
    assert_eq!(got[0].status, WcStatus::WrFlush);
}

#[test]
fn an_exclusive_cq_serves_one_qp_and_keeps_its_size() {
    let dev = device(false);
    let cq = CompletionQueue::builder(&dev, 32)
        .exclusive()
        .build()
        .unwrap();
    assert!(cq.is_exclusive());
    assert_eq!(cq.resize(64), Err(ResizeError::Exclusive));
    assert_eq!(cq.capacity(), 32);
    let pd = ProtectionDomain::new(&dev);
    let first = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
    let other = CompletionQueue::new(&dev, 32, None).unwrap();
    assert!(matches!(
        QueuePair::new(&pd, &QpInitAttr::new(&other, &cq)),
        Err(CreateQpError::CqInUse { cq_id }) if cq_id == cq.id()
    ));
    drop(first);
    // Once the first is gone the CQ may serve another.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)) {
            Ok(_) => break,
            Err(CreateQpError::CqInUse { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => panic!("{e}"),
        }
    }
    let plain = CompletionQueue::new(&dev, 32, None).unwrap();
    assert!(!plain.is_exclusive());
    let _q1 = QueuePair::new(&pd, &QpInitAttr::new(&plain, &plain)).unwrap();
    let _q2 = QueuePair::new(&pd, &QpInitAttr::new(&plain, &plain)).unwrap();
}

/// Two QPs created at the same moment on one exclusive CQ: the check that
/// the CQ serves no QP yet and the QP's attachment to it were two steps,
/// so both could pass the check and both be made.
#[test]
fn two_qps_created_at_once_on_an_exclusive_cq_are_not_both_made() {
    const THREADS: usize = 4;
    let dev = device(false);
    let pd = ProtectionDomain::new(&dev);
    for round in 0..1000 {
        let cq = CompletionQueue::builder(&dev, 32)
            .exclusive()
            .build()
            .unwrap();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(THREADS));
        let made = std::thread::scope(|s| {
            let ts: Vec<_> = (0..THREADS)
                .map(|_| {
                    let (cq, pd, barrier) = (&cq, &pd, barrier.clone());
                    s.spawn(move || {
                        barrier.wait();
                        QueuePair::new(pd, &QpInitAttr::new(cq, cq)).ok()
                    })
                })
                .collect();
            ts.into_iter()
                .map(|t| t.join().unwrap())
                .collect::<Vec<_>>()
        });
        let n = made.iter().filter(|q| q.is_some()).count();
        assert_eq!(n, 1, "round {round}: {n} QPs made on one exclusive CQ");
    }
}

/// A Send posted with `post_send_now` behind an RDMA Write still being
/// written goes after it (the one-pass send declines: the send queue is
/// not empty): the peer's receive completes with every byte of the Write
/// in place, and the poster's completions come in posting order.
#[test]
fn a_send_now_behind_a_large_write_goes_after_it() {
    let (_dev, a, b) = pair(true, None);
    const BIG: usize = 8 << 20;
    let src = mr(&a, BIG);
    let data: Vec<u8> = (0..BIG).map(|i| (i * 13 + i / 251) as u8).collect();
    src.write(0, &data).unwrap();
    let dst = mr(&b, BIG);
    let rbuf = mr(&b, 64);
    post_recvs(&b, &rbuf, 1);
    let sge = [src.sge(0, BIG as u32).unwrap()];
    let write = SendWr::new(
        1,
        SendOp::Write {
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
        },
    )
    .sg_list(&sge)
    .signaled();
    a.qp.post_send(&write).unwrap();
    let done = a.qp.post_send_now(&inline_send(2, b"after")).unwrap();
    let got = wait(&b.cq, 1);
    assert_eq!((got[0].wr_id, got[0].byte_len), (0, 5));
    let mut back = vec![0u8; BIG];
    dst.read(0, &mut back).unwrap();
    assert!(
        back == data,
        "the Send's receive completed before the Write was placed"
    );
    let mut ids: Vec<u64> = wait(&a.cq, if done.is_some() { 1 } else { 2 })
        .iter()
        .map(|c| c.wr_id)
        .collect();
    ids.extend(done.map(|c| c.wr_id));
    assert_eq!(ids, [1, 2]);
}
