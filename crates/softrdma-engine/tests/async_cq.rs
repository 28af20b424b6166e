//! The async completion adapter (feature `tokio`) over real loopback QPs:
//! completion streams, awaited Send/Recv, Write and Read, dropped futures,
//! many concurrent tasks, and the safety poll recovering lost wake-ups.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures_core::Stream;
use softrdma_engine::async_cq::{
    ASYNC_WR_ID_BIT, AsyncChannel, AsyncCq, AsyncCqError, AsyncQp, OpError, PostError,
};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    Access, CompletionChannel, CompletionQueue, Device, DeviceConfig, MemoryRegion,
    ProtectionDomain, QpInitAttr, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

/// Fails a test instead of hanging it.
const LIMIT: Duration = Duration::from_secs(20);

async fn within<T>(f: impl Future<Output = T>) -> T {
    tokio::time::timeout(LIMIT, f)
        .await
        .expect("timed out (a completion or wake-up was lost)")
}

fn device() -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.pin_threads = false;
    Device::open_with(cfg).expect("device")
}

struct Side {
    pd: ProtectionDomain,
    cq: AsyncCq,
    qp: AsyncQp,
}

fn side(dev: &Device, cq: AsyncCq) -> Side {
    let pd = ProtectionDomain::new(dev);
    let qp = AsyncQp::new(&pd, &QpInitAttr::new(cq.cq(), cq.cq()), &cq, &cq).expect("qp");
    Side { pd, cq, qp }
}

/// Two connected QPs, each with a CQ, channel and driver of its own.
fn pair(dev: &Device) -> (Side, Side) {
    let a = side(dev, AsyncCq::new(dev, 1024).expect("cq"));
    let b = side(dev, AsyncCq::new(dev, 1024).expect("cq"));
    connect_pair(a.qp.qp(), b.qp.qp(), &MpaConfig::default()).expect("connect");
    (a, b)
}

fn mr(side: &Side, len: usize) -> MemoryRegion {
    side.pd
        .register(
            len,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .expect("register")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

async fn next_of(stream: &mut (impl Stream<Item = WorkCompletion> + Unpin)) -> WorkCompletion {
    within(std::future::poll_fn(|cx| {
        Pin::new(&mut *stream).poll_next(cx)
    }))
    .await
    .expect("stream ended")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_yields_completions_in_order() {
    let dev = device();
    let (a, b) = pair(&dev);
    let src = mr(&a, 4096);
    let dst = mr(&b, 64 * 64);
    src.write(0, &pattern(4096, 1)).unwrap();
    const N: u64 = 64;
    for i in 0..N {
        let sge = [dst.sge(i as usize * 64, 64).unwrap()];
        b.qp.qp().post_recv(&RecvWr::new(i, &sge)).unwrap();
    }
    let mut sends = a.cq.completions();
    let mut recvs = b.cq.completions();
    for i in 0..N {
        let sge = [src.sge(i as usize, 64).unwrap()];
        a.qp.qp()
            .post_send(&SendWr::new(1000 + i, SendOp::Send).sg_list(&sge).signaled())
            .unwrap();
    }
    for i in 0..N {
        let wc = next_of(&mut sends).await;
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (1000 + i, WcStatus::Success, WcOpcode::Send)
        );
    }
    for i in 0..N {
        let wc = recvs.next().await.expect("stream ended");
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (i, WcStatus::Success, 64)
        );
    }
    let got = dst.to_vec();
    let want = pattern(4096, 1);
    for i in 0..N as usize {
        assert_eq!(&got[i * 64..i * 64 + 64], &want[i..i + 64]);
    }
    assert_eq!(a.cq.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_recv_write_read_await_their_completions() {
    let dev = device();
    let (a, b) = pair(&dev);
    let payload = pattern(3000, 7);

    // Send / Recv.
    let src = mr(&a, 4096);
    src.write(0, &payload).unwrap();
    let recv = b.qp.recv(mr(&b, 4096), 0, 4096);
    assert_ne!(recv.wr_id() & ASYNC_WR_ID_BIT, 0);
    let (sent, received) = within(async { tokio::join!(a.qp.send(src, 0, 3000), recv) }).await;
    let sent = sent.expect("send");
    let received = received.expect("recv");
    assert_eq!(sent.wc.opcode, WcOpcode::Send);
    assert_eq!(
        (received.wc.opcode, received.wc.byte_len),
        (WcOpcode::Recv, 3000)
    );
    assert!(received.buf.to_vec()[..3000] == payload[..], "received");
    let src = sent.buf;

    // RDMA Write into b's region (shared with an Arc: the caller keeps a handle).
    let target = Arc::new(mr(&b, 8192));
    let (addr, rkey) = (target.addr(), target.rkey());
    let done = within(a.qp.write(src, 0, 3000, addr + 100, rkey))
        .await
        .expect("write");
    assert_eq!(done.wc.opcode, WcOpcode::RdmaWrite);
    // (A Write's completion means the data left, not that it was placed:
    // the Read below, behind it on the same QP, checks the placement.)

    // RDMA Read back from b into a fresh region of a.
    let sink = mr(&a, 4096);
    let done = within(a.qp.read(sink, 10, 3000, addr + 100, rkey))
        .await
        .expect("read");
    assert_eq!(
        (done.wc.opcode, done.wc.byte_len),
        (WcOpcode::RdmaRead, 3000)
    );
    assert!(done.buf.to_vec()[10..3010] == payload[..], "read back");
    assert!(target.to_vec()[100..3100] == payload[..], "placed");

    // Nothing of the awaited operations reached the streams.
    assert_eq!(a.cq.in_flight() + b.cq.in_flight(), 0);
    assert!(a.cq.cq().is_empty());
    let mut s = a.cq.completions();
    let nothing = tokio::time::timeout(Duration::from_millis(50), s.next()).await;
    assert!(nothing.is_err(), "unexpected completion {nothing:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_errors_hand_the_buffer_back() {
    let dev = device();
    let (a, _b) = pair(&dev);
    let small = mr(&a, 64);
    let err = a.qp.send(small, 32, 64).await.expect_err("out of range");
    assert!(
        matches!(
            err,
            OpError::Post {
                error: PostError::Range(_),
                ..
            }
        ),
        "{err:?}"
    );
    let small = err.into_buf();
    assert_eq!(small.len(), 64);
    // An unconnected QP refuses work.
    let dev2 = device();
    let lone = side(&dev2, AsyncCq::new(&dev2, 16).unwrap());
    let buf = mr(&lone, 64);
    let err = lone.qp.send(buf, 0, 8).await.expect_err("QP not in RTS");
    assert!(
        matches!(
            err,
            OpError::Post {
                error: PostError::Send(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(lone.cq.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_future_keeps_its_buffer_until_the_operation_completes() {
    let dev = device();
    let (a, b) = pair(&dev);
    let first = pattern(500, 3);
    let second = pattern(700, 9);

    // b posts a receive and drops its future at once: nothing has arrived.
    let buf = Arc::new(mr(&b, 1024));
    let keep = Arc::clone(&buf);
    drop(b.qp.recv(buf, 0, 1024));
    assert_eq!(Arc::strong_count(&keep), 2, "the operation owns its buffer");
    assert_eq!(b.cq.in_flight(), 1);

    // A later receive, awaited.
    let later = b.qp.recv(mr(&b, 1024), 0, 1024);
    // Work posted directly: its completion goes to the stream.
    let direct = mr(&b, 64);
    let sge = [direct.sge(0, 64).unwrap()];
    b.qp.qp().post_recv(&RecvWr::new(42, &sge)).unwrap();

    let src = mr(&a, 2048);
    src.write(0, &first).unwrap();
    src.write(1024, &second).unwrap();
    let src = within(a.qp.send(src, 0, 500)).await.expect("send 1").buf;
    let src = within(a.qp.send(src, 1024, 700)).await.expect("send 2").buf;
    let got = within(later).await.expect("later receive");
    // Receives complete in order: the dropped one took the first message
    // into memory that stayed valid, the awaited one the second.
    assert_eq!(got.wc.byte_len, 700);
    assert_eq!(&got.buf.to_vec()[..700], &second[..]);
    assert_eq!(&keep.to_vec()[..500], &first[..]);

    // The dropped operation's completion was reaped and its buffer released.
    within(async {
        while b.cq.orphans_reaped() < 1 || Arc::strong_count(&keep) > 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert_eq!(b.cq.in_flight(), 0);

    // The stream sees the direct receive and nothing of the dropped one.
    let src = within(a.qp.send(src, 0, 10)).await.expect("send 3").buf;
    let wc = within(b.cq.next_completion()).await.expect("stream");
    assert_eq!((wc.wr_id, wc.byte_len), (42, 10));
    drop(src);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_after_completion_and_flushed_on_destroy() {
    let dev = device();
    let (a, b) = pair(&dev);
    // Completed but never awaited: dropping the future releases the buffer.
    let src = Arc::new(mr(&a, 64));
    let keep = Arc::clone(&src);
    let recv = b.qp.recv(mr(&b, 64), 0, 64);
    let op = a.qp.send(src, 0, 64);
    within(recv).await.expect("recv");
    // Give the send's completion time to reach its slot (not required).
    tokio::time::sleep(Duration::from_millis(5)).await;
    drop(op);
    // Either the completion was routed (the drop released the buffer) or it
    // is still on its way (the driver releases it); both end the same way.
    within(async {
        while Arc::strong_count(&keep) > 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;

    // A receive outstanding when its QP is destroyed completes flushed,
    // handing the buffer back.
    let pending = b.qp.recv(mr(&b, 64), 0, 64);
    let cq = b.cq.clone();
    drop(b);
    let err = within(pending).await.expect_err("flushed");
    assert_eq!(
        err.completion().map(|wc| wc.status),
        Some(WcStatus::WrFlush)
    );
    assert_eq!(err.into_buf().len(), 64);
    assert_eq!(cq.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_tasks_on_many_cqs_of_one_channel() {
    let dev = device();
    let chan = AsyncChannel::create(&dev).expect("channel");
    const PAIRS: usize = 4;
    const TASKS: usize = 8;
    const OPS: usize = 25;
    const SLOT: usize = 256;
    let mut joins = Vec::new();
    let mut keep = Vec::new();
    for p in 0..PAIRS {
        let a = side(&dev, AsyncCq::on_channel(&dev, &chan, 1024).unwrap());
        let b = side(&dev, AsyncCq::on_channel(&dev, &chan, 1024).unwrap());
        connect_pair(a.qp.qp(), b.qp.qp(), &MpaConfig::default()).unwrap();
        let target = Arc::new(mr(&b, TASKS * SLOT));
        let a = Arc::new(a);
        for t in 0..TASKS {
            let a = Arc::clone(&a);
            let target = Arc::clone(&target);
            joins.push(tokio::spawn(async move {
                let mut buf = mr(&a, SLOT);
                let mut sink = mr(&a, SLOT);
                for i in 0..OPS {
                    let data = pattern(SLOT, (p * 31 + t * 7 + i) as u8);
                    buf.write(0, &data).unwrap();
                    let at = target.addr() + (t * SLOT) as u64;
                    buf =
                        a.qp.write(buf, 0, SLOT as u32, at, target.rkey())
                            .await
                            .unwrap()
                            .buf;
                    let done =
                        a.qp.read(sink, 0, SLOT as u32, at, target.rkey())
                            .await
                            .unwrap();
                    assert!(done.buf.to_vec() == data, "read back");
                    sink = done.buf;
                }
            }));
        }
        keep.push((a, b, target));
    }
    for j in joins {
        within(j).await.expect("task");
    }
    for (a, b, _) in &keep {
        assert_eq!(a.cq.in_flight() + b.cq.in_flight(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safety_poll_recovers_lost_wake_ups() {
    let dev = device();
    // The CQs raise their events on a channel nobody watches: every event is
    // lost, only the safety poll finds the completions.
    let elsewhere = CompletionChannel::new(&dev).unwrap();
    let chan = AsyncChannel::with_safety_interval(
        CompletionChannel::new(&dev).unwrap(),
        Duration::from_millis(5),
    )
    .unwrap();
    let served = |_| {
        let cq = CompletionQueue::new(&dev, 64, Some(&elsewhere)).unwrap();
        AsyncCq::serve(&chan, cq).unwrap()
    };
    let a = side(&dev, served(0));
    let b = side(&dev, served(1));
    connect_pair(a.qp.qp(), b.qp.qp(), &MpaConfig::default()).unwrap();
    let src = mr(&a, 64);
    src.write(0, b"found by the safety poll").unwrap();
    // An operation whose completion is already there when it is first
    // polled needs no wake-up: the receive is polled first and the Send
    // posted 2 ms later, so its completion comes after the receive went to
    // sleep (the engine may deliver a completion as soon as the request is
    // written, so posting both at once often found it already there). Keep
    // going (a bounded number of rounds) until one had to be recovered by
    // the safety poll.
    for round in 0..50 {
        let recv = b.qp.recv(mr(&b, 64), 0, 64);
        let send = async {
            tokio::time::sleep(Duration::from_millis(2)).await;
            a.qp.send(mr(&a, 64), 0, 8).await
        };
        let (r, s) = within(async { tokio::join!(recv, send) }).await;
        s.expect("send");
        assert_eq!(r.expect("recv").wc.byte_len, 8);
        if round >= 2 && chan.recovered_by_safety_poll() > 0 {
            break;
        }
    }
    assert!(chan.recovered_by_safety_poll() > 0);
    // The same CQ served twice on one channel is refused.
    let again = AsyncCq::serve(&chan, a.cq.cq().clone());
    assert!(matches!(again, Err(AsyncCqError::AlreadyServed(_))));
    drop(src);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_taken_by_someone_else_are_recovered() {
    let dev = device();
    let chan = AsyncChannel::with_safety_interval(
        CompletionChannel::new(&dev).unwrap(),
        Duration::from_millis(5),
    )
    .unwrap();
    let a = side(&dev, AsyncCq::on_channel(&dev, &chan, 256).unwrap());
    let b = side(&dev, AsyncCq::on_channel(&dev, &chan, 256).unwrap());
    connect_pair(a.qp.qp(), b.qp.qp(), &MpaConfig::default()).unwrap();
    // A thread racing the driver for the channel's events.
    let thief = chan.channel().clone();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let th = std::thread::spawn(move || {
        while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok(cq) = thief.get_event(Some(Duration::from_millis(1))) {
                cq.ack_events(1);
            }
        }
    });
    let mut src = mr(&a, 64);
    for _ in 0..50 {
        let recv = b.qp.recv(mr(&b, 64), 0, 64);
        let (s, r) = within(async { tokio::join!(a.qp.send(src, 0, 16), recv) }).await;
        src = s.expect("send").buf;
        assert_eq!(r.expect("recv").wc.byte_len, 16);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    th.join().unwrap();
}

#[test]
fn outside_a_runtime_is_an_error() {
    let dev = device();
    assert!(matches!(
        AsyncCq::new(&dev, 16),
        Err(AsyncCqError::NoRuntime)
    ));
    // A CQ without a channel cannot be served.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let chan = AsyncChannel::create(&dev).unwrap();
        let cq = CompletionQueue::new(&dev, 16, None).unwrap();
        assert!(matches!(
            AsyncCq::serve(&chan, cq),
            Err(AsyncCqError::Notify(_))
        ));
        // Nor a CQ whose events run a completion callback.
        let cq = CompletionQueue::with_callback(&dev, 16, |_| {}).unwrap();
        assert!(matches!(
            AsyncCq::serve(&chan, cq),
            Err(AsyncCqError::HasCallback(_))
        ));
        // Nor an exclusive CQ (its one consumer polls it; an adapter
        // beside a `post_send_now` caller could reorder completions).
        let cq = CompletionQueue::builder(&dev, 16)
            .channel(chan.channel())
            .exclusive()
            .build()
            .unwrap();
        assert!(matches!(
            AsyncCq::serve(&chan, cq),
            Err(AsyncCqError::Exclusive(_))
        ));
    });
}

#[test]
fn current_thread_runtime_works_too() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let dev = device();
        let (a, b) = pair(&dev);
        let src = mr(&a, 64);
        src.write(0, b"ping").unwrap();
        let recv = b.qp.recv(mr(&b, 64), 0, 64);
        let (s, r) = within(async { tokio::join!(a.qp.send(src, 0, 4), recv) }).await;
        s.unwrap();
        assert_eq!(&r.unwrap().buf.to_vec()[..4], b"ping");
    });
}

#[test]
fn runtime_shutdown_resolves_waiting_operations_as_closed() {
    let dev = device();
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    // A receive on an unconnected QP: it cannot complete.
    let (s, op) = first.block_on(async {
        let s = side(&dev, AsyncCq::new(&dev, 16).unwrap());
        let op = s.qp.recv(mr(&s, 64), 0, 64);
        (s, op)
    });
    assert_eq!(s.cq.in_flight(), 1);
    drop(first); // the driver task goes with its runtime
    assert!(s.cq.channel().is_closed());
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let err = within(op).await.expect_err("closed");
        assert!(matches!(err, OpError::Closed { .. }), "{err:?}");
        assert_eq!(err.into_buf().len(), 64);
        assert_eq!(s.cq.next_completion().await, None);
    });
}

/// Regression: the driver's close guard was made by the driver's first
/// poll, so a runtime that shut down before it ever polled the driver (its
/// one worker busy or not yet scheduled, or a runtime that never ran) dropped
/// the driver without closing the channel, and waiting operations hung
/// instead of resolving as closed.
#[test]
fn runtime_shutdown_before_the_driver_first_ran_still_closes_the_channel() {
    let dev = device();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // Entered but never run: the driver task is spawned and never polled.
    let (s, op) = {
        let _enter = rt.enter();
        let s = side(&dev, AsyncCq::new(&dev, 16).unwrap());
        let op = s.qp.recv(mr(&s, 64), 0, 64);
        (s, op)
    };
    assert!(!s.cq.channel().is_closed(), "the driver has not run");
    assert_eq!(s.cq.in_flight(), 1);
    drop(rt); // drops the never-polled driver task
    assert!(s.cq.channel().is_closed());
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let err = within(op).await.expect_err("closed");
        assert!(matches!(err, OpError::Closed { .. }), "{err:?}");
        assert_eq!(err.into_buf().len(), 64);
        assert_eq!(s.cq.next_completion().await, None);
        assert_eq!(s.cq.in_flight(), 0);
    });
}
