//! Completion event handlers and callbacks over real loopback QPs, and the
//! verbs rule for unsignaled work.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use softrdma_engine::handlers::{Binding, HandlerId};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    Access, AsyncEvent, AsyncEventKind, CompletionQueue, Device, DeviceConfig, MemoryRegion,
    ProtectionDomain, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

const DEADLINE: Duration = Duration::from_secs(20);

/// A device with `n` completion event handlers (unpinned: the tests do not
/// depend on the machine's CPUs).
fn device(n: usize) -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.pin_threads = false;
    cfg.handler_cpus = (0..n).collect();
    Device::open_with(cfg).expect("device")
}

/// Two connected QPs with these CQs (send, recv) each.
fn connect(
    pd: &ProtectionDomain,
    a: (&CompletionQueue, &CompletionQueue),
    b: (&CompletionQueue, &CompletionQueue),
    tweak: impl Fn(&mut QpInitAttr),
) -> (QueuePair, QueuePair) {
    let mut attr_a = QpInitAttr::new(a.0, a.1);
    tweak(&mut attr_a);
    let mut attr_b = QpInitAttr::new(b.0, b.1);
    tweak(&mut attr_b);
    let qa = QueuePair::new(pd, &attr_a).expect("qp");
    let qb = QueuePair::new(pd, &attr_b).expect("qp");
    connect_pair(&qa, &qb, &MpaConfig::default()).expect("connect");
    (qa, qb)
}

fn region(pd: &ProtectionDomain, len: usize) -> MemoryRegion {
    pd.register(len, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .expect("register")
}

fn write_wr(id: u64, dst: &MemoryRegion, off: u64) -> SendWr<'static> {
    SendWr::new(
        id,
        SendOp::Write {
            remote_addr: dst.addr() + off,
            rkey: dst.rkey(),
        },
    )
}

fn wait_until(what: &str, done: impl Fn() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Polls until `n` completions arrived.
fn wait_polled(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + DEADLINE;
    let mut out = Vec::new();
    while out.len() < n {
        match cq.poll_one() {
            Some(wc) => out.push(wc),
            None => {
                assert!(
                    Instant::now() < deadline,
                    "{} of {n} completions",
                    out.len()
                );
                std::thread::yield_now();
            }
        }
    }
    out
}

/// Each callback raises its flag and waits for the other's: both can only
/// finish if they run at the same time, on different handler threads.
#[test]
fn callbacks_of_cqs_on_different_handlers_run_concurrently() {
    let dev = device(2);
    let pd = dev.alloc_pd();
    let flags = Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
    let met = Arc::new([AtomicBool::new(false), AtomicBool::new(false)]);
    let threads = Arc::new(Mutex::new(Vec::new()));
    let cq_for = |me: usize| {
        let (flags, met, threads) = (flags.clone(), met.clone(), threads.clone());
        CompletionQueue::builder(&dev, 64)
            .binding(Binding::Handler(HandlerId::new(me)))
            .callback(move |cq: &CompletionQueue| {
                cq.drain_and_arm(false, |_| {});
                threads.lock().unwrap().push(std::thread::current().id());
                flags[me].store(true, Ordering::SeqCst);
                let deadline = Instant::now() + DEADLINE;
                while !flags[1 - me].load(Ordering::SeqCst) && Instant::now() < deadline {
                    std::thread::yield_now();
                }
                met[me].store(flags[1 - me].load(Ordering::SeqCst), Ordering::SeqCst);
            })
            .build()
            .expect("cq")
    };
    let (cq0, cq1) = (cq_for(0), cq_for(1));
    assert_eq!((cq0.handler().index(), cq1.handler().index()), (0, 1));
    assert_eq!(dev.handler_cpu(cq1.handler()), Some(1));
    let rcq = dev.create_cq(64).unwrap();
    let (qa, qb) = connect(&pd, (&cq0, &rcq), (&cq1, &rcq), |_| {});
    let dst = region(&pd, 64);
    cq0.req_notify(false).unwrap();
    cq1.req_notify(false).unwrap();
    qa.post_send(&write_wr(1, &dst, 0).inline(b"a").signaled())
        .unwrap();
    qb.post_send(&write_wr(2, &dst, 8).inline(b"b").signaled())
        .unwrap();
    wait_until("both callbacks", || {
        threads.lock().unwrap().len() == 2 && dev.handler_stats().iter().all(|s| s.callbacks == 1)
    });
    assert!(
        met[0].load(Ordering::SeqCst) && met[1].load(Ordering::SeqCst),
        "the callbacks did not overlap"
    );
    let t = threads.lock().unwrap();
    assert_ne!(t[0], t[1]);
    for s in dev.handler_stats() {
        assert_eq!((s.events, s.callbacks, s.callback_panics), (1, 1, 0));
    }
}

/// Completions reach the callback in the order the work completed, across
/// many callback runs.
#[test]
fn callback_sees_completions_in_order() {
    const N: u64 = 2000;
    let dev = device(2);
    let pd = dev.alloc_pd();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let runs = Arc::new(AtomicU64::new(0));
    let cq = {
        let (seen, runs) = (seen.clone(), runs.clone());
        CompletionQueue::with_callback(&dev, 4096, move |cq: &CompletionQueue| {
            runs.fetch_add(1, Ordering::Relaxed);
            let mut seen = seen.lock().unwrap();
            cq.drain_and_arm(false, |wc| {
                assert_eq!(wc.status, WcStatus::Success);
                seen.push(wc.wr_id);
            });
        })
        .expect("cq")
    };
    assert!(cq.has_callback());
    let other = dev.create_cq(4096).unwrap();
    let (qa, _qb) = connect(&pd, (&cq, &other), (&other, &other), |a| {
        a.cap.max_send_wr = 512;
    });
    let dst = region(&pd, 4096);
    cq.req_notify(false).unwrap();
    let mut next = 0;
    while next < N {
        match qa.post_send(
            &write_wr(next, &dst, next % 4000)
                .inline(&[next as u8])
                .signaled(),
        ) {
            Ok(()) => next += 1,
            Err(_) => std::thread::yield_now(), // send queue full
        }
    }
    wait_until("every completion", || {
        seen.lock().unwrap().len() as u64 == N
    });
    assert!(seen.lock().unwrap().iter().copied().eq(0..N));
    assert!(runs.load(Ordering::Relaxed) >= 1);
    let h = &dev.handler_stats()[cq.handler().index()];
    assert!(h.completions >= N);
}

#[test]
fn load_balancing_spreads_64_cqs_evenly() {
    let dev = device(4);
    assert_eq!(dev.attr().completion_handlers, 4);
    let cqs: Vec<_> = (0..64).map(|_| dev.create_cq(16).unwrap()).collect();
    let per: Vec<usize> = dev.handler_stats().iter().map(|s| s.cqs_bound).collect();
    assert_eq!(per, [16; 4]);
    let mut count = [0usize; 4];
    for cq in &cqs {
        count[cq.handler().index()] += 1;
    }
    assert_eq!(count, [16; 4]);
    // Freed slots are refilled first.
    let mut cqs = cqs;
    cqs.retain(|cq| cq.handler().index() != 2);
    let refill: Vec<_> = (0..16).map(|_| dev.create_cq(16).unwrap()).collect();
    assert!(refill.iter().all(|cq| cq.handler().index() == 2));
    let per: Vec<usize> = dev.handler_stats().iter().map(|s| s.cqs_bound).collect();
    assert_eq!(per, [16; 4]);
}

#[test]
fn default_device_has_one_handler_per_cpu() {
    let dev = Device::open_default().unwrap();
    let table = dev.handler_table();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    assert_eq!(table.len(), cpus);
    for (i, (id, _cpu)) in table.iter().enumerate() {
        assert_eq!(id.index(), i);
    }
    let stats = dev.handler_stats();
    assert_eq!(stats.len(), cpus);
    assert!(stats.iter().all(|s| s.cqs_bound == 0 && s.events == 0));
}

/// A receive loop driven by the callback: every receive completion is
/// checked and its buffer posted again, until all messages arrived.
#[test]
fn callback_driven_receive_loop() {
    const MSGS: u64 = 500;
    const SLOTS: u64 = 16;
    let dev = device(2);
    let pd = dev.alloc_pd();
    let buf = Arc::new(region(&pd, 64 * SLOTS as usize));
    let got = Arc::new(Mutex::new(Vec::new()));
    let qp_slot: Arc<Mutex<Option<QueuePair>>> = Arc::new(Mutex::new(None));
    let rcq = {
        let (got, qp_slot, buf) = (got.clone(), qp_slot.clone(), buf.clone());
        CompletionQueue::builder(&dev, 256)
            .binding(Binding::Handler(HandlerId::new(1)))
            .callback(move |cq: &CompletionQueue| {
                let qp = qp_slot.lock().unwrap();
                let qp = qp.as_ref().expect("QP set before the first Send");
                cq.drain_and_arm(false, |wc| {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    assert_eq!(wc.opcode, WcOpcode::Recv);
                    let slot = wc.wr_id % SLOTS;
                    let mut msg = vec![0; wc.byte_len as usize];
                    buf.read(slot as usize * 64, &mut msg).unwrap();
                    // Post the buffer again, as the next use of this slot,
                    // before counting the message: the sender sends again
                    // as soon as it is counted.
                    let sge = [buf.sge(slot as usize * 64, 64).unwrap()];
                    qp.post_recv(&RecvWr::new(wc.wr_id + SLOTS, &sge)).unwrap();
                    got.lock().unwrap().push(String::from_utf8(msg).unwrap());
                });
            })
            .build()
            .expect("cq")
    };
    let scq = dev.create_cq(1024).unwrap();
    let (qa, qb) = connect(&pd, (&scq, &scq), (&scq, &rcq), |_| {});
    for slot in 0..SLOTS {
        let sge = [buf.sge(slot as usize * 64, 64).unwrap()];
        qb.post_recv(&RecvWr::new(slot, &sge)).unwrap();
    }
    *qp_slot.lock().unwrap() = Some(qb);
    rcq.req_notify(false).unwrap();
    let deadline = Instant::now() + DEADLINE;
    let mut sent = 0;
    while sent < MSGS {
        // Never more in flight than receives posted.
        if sent - got.lock().unwrap().len() as u64 >= SLOTS {
            assert!(Instant::now() < deadline, "receiver stalled at {sent}");
            std::thread::yield_now();
            continue;
        }
        let msg = format!("message {sent}");
        qa.post_send(
            &SendWr::new(sent, SendOp::Send)
                .inline(msg.as_bytes())
                .signaled(),
        )
        .unwrap();
        sent += 1;
        // Reap our send completions now and then.
        while scq.poll_one().is_some() {}
    }
    wait_until("every message", || got.lock().unwrap().len() as u64 == MSGS);
    let got = got.lock().unwrap();
    for (i, m) in got.iter().enumerate() {
        assert_eq!(*m, format!("message {i}"));
    }
    let h = &dev.handler_stats()[1];
    assert_eq!(h.cqs_bound, 1);
    assert!(h.callbacks >= 1 && h.callbacks <= MSGS);
    // Break the cycle QP → CQ → callback → QP.
    qp_slot.lock().unwrap().take();
}

/// Verbs: an unsignaled send request produces no completion of its own; the
/// next signaled request of the send queue reports it complete (its slot is
/// freed with that completion).
#[test]
fn unsignaled_work_is_completed_by_the_next_signaled_request() {
    let dev = device(1);
    let pd = dev.alloc_pd();
    let scq = dev.create_cq(64).unwrap();
    let rcq = dev.create_cq(64).unwrap();
    let (qa, _qb) = connect(&pd, (&scq, &rcq), (&rcq, &rcq), |a| {
        a.cap.max_send_wr = 16;
    });
    let dst = region(&pd, 4096);
    for i in 0..10u64 {
        qa.post_send(&write_wr(i, &dst, i * 8).inline(&[0xA0 + i as u8; 8]))
            .unwrap();
    }
    // The Writes land at the peer and produce no completion. (Verbs lets
    // the provider keep their slots until the next signaled completion;
    // softrdma frees them as soon as they are done, in order.)
    wait_until("the unsignaled Writes", || dst.to_vec()[72] == 0xA9);
    std::thread::sleep(Duration::from_millis(20));
    assert!(scq.poll_one().is_none());
    assert!(qa.send_queue_len() <= 10);
    // One signaled request completes all of them: one completion, and the
    // send queue is empty again.
    qa.post_send(&write_wr(10, &dst, 80).inline(b"signaled").signaled())
        .unwrap();
    let wcs = wait_polled(&scq, 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (10, WcStatus::Success));
    assert_eq!(wcs[0].opcode, WcOpcode::RdmaWrite);
    assert_eq!(qa.send_queue_len(), 0);
    // A full send queue of unsignaled work needs one signaled request to
    // drain: 15 unsignaled and 1 signaled fill the 16 slots ...
    for i in 11..26u64 {
        qa.post_send(&write_wr(i, &dst, 128 + i).inline(&[1]))
            .unwrap();
    }
    qa.post_send(&write_wr(26, &dst, 200).inline(&[2]).signaled())
        .unwrap();
    // ... and the signaled completion frees all 16 at once.
    let wcs = wait_polled(&scq, 1);
    assert_eq!(wcs[0].wr_id, 26);
    assert_eq!(qa.send_queue_len(), 0);
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        scq.poll_one().is_none(),
        "unsignaled work has no completion"
    );
}

/// QP / CQ / device errors reach the registered asynchronous event
/// callback, on the device's asynchronous event thread.
#[test]
fn async_event_callback_gets_the_cq_overflow() {
    let dev = device(1);
    let pd = dev.alloc_pd();
    let events = Arc::new(Mutex::new(Vec::<AsyncEvent>::new()));
    let on_thread = Arc::new(AtomicUsize::new(0));
    {
        let (events, on_thread) = (events.clone(), on_thread.clone());
        let me = std::thread::current().id();
        dev.set_async_event_handler(move |e: &AsyncEvent| {
            if std::thread::current().id() != me {
                on_thread.fetch_add(1, Ordering::Relaxed);
            }
            events.lock().unwrap().push(e.clone());
        })
        .unwrap();
    }
    let tiny = dev.create_cq(1).unwrap();
    let rcq = dev.create_cq(64).unwrap();
    let (qa, _qb) = connect(&pd, (&tiny, &rcq), (&rcq, &rcq), |_| {});
    let dst = region(&pd, 64);
    for i in 0..3 {
        let _ = qa.post_send(&write_wr(i, &dst, 0).inline(b"x").signaled());
    }
    wait_until("the CQ error", || {
        events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.kind == AsyncEventKind::CqError && e.cq_id == Some(tiny.id()))
    });
    let n = events.lock().unwrap().len();
    assert_eq!(on_thread.load(Ordering::Relaxed), n);
    assert!(dev.async_events_delivered() >= n as u64);
}
