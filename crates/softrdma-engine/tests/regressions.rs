//! Regression tests, each named after the bug it pins down.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::{
    AsyncEventKind, LinkParams, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
};

const TIMEOUT: Duration = Duration::from_secs(10);

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A Send posted while another thread is inside `QueuePair::query()` (which
/// takes the transmit lock) used to stay unsent until a later post: the
/// poster's try-lock failed and `query()` released the lock without
/// re-checking for work. Each Send here is the only one outstanding, so a
/// lost hand-off shows as a receive that never completes.
#[test]
fn send_posted_during_query_is_not_left_unsent() {
    let p = pair(false);
    let stop = Arc::new(AtomicBool::new(false));
    let started = Arc::new(AtomicBool::new(false));
    let querier = {
        let qp = p.a.qp.clone();
        let stop = stop.clone();
        let started = started.clone();
        std::thread::spawn(move || {
            started.store(true, Ordering::Release);
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                n = n.wrapping_add(qp.query().bytes_sent);
            }
            n
        })
    };
    until("the querying thread", || started.load(Ordering::Acquire));
    let src = mr(&p.a, 64);
    let dst = mr(&p.b, 64);
    for i in 0..20_000u64 {
        p.b.qp
            .post_recv(&RecvWr::new(i, &[dst.sge(0, 64).unwrap()]))
            .unwrap();
        p.a.qp
            .post_send(
                &SendWr::new(i, SendOp::Send)
                    .sg_list(&[src.sge(0, 8).unwrap()])
                    .signaled(),
            )
            .unwrap();
        // Both completions (send on a, receive on b) with no further post.
        let wa = wait(&p.a.cq, 1);
        let wb = wait(&p.b.cq, 1);
        assert_eq!((wa[0].wr_id, wa[0].status), (i, WcStatus::Success));
        assert_eq!((wb[0].wr_id, wb[0].opcode), (i, WcOpcode::Recv));
    }
    stop.store(true, Ordering::Relaxed);
    querier.join().unwrap();
    assert_eq!(p.a.qp.state(), QpState::Rts);
}

/// After a graceful close (both QPs in IDLE) a receive used to be accepted
/// and never completed; a send was refused. Both now complete at once with
/// a flush error (as in ERROR), so nothing waits for a gone connection.
#[test]
fn requests_posted_after_graceful_close_complete_with_flush() {
    let p = pair(false);
    p.a.qp.disconnect().unwrap();
    until("both QPs in IDLE", || {
        p.a.qp.state() == QpState::Idle && p.b.qp.state() == QpState::Idle
    });
    let buf = mr(&p.a, 64);
    p.a.qp
        .post_recv(&RecvWr::new(77, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(78, SendOp::Send)
                .sg_list(&[buf.sge(0, 8).unwrap()])
                .signaled(),
        )
        .unwrap();
    let mut ids: Vec<(u64, WcStatus)> = wait(&p.a.cq, 2)
        .iter()
        .map(|w| (w.wr_id, w.status))
        .collect();
    ids.sort_unstable_by_key(|x| x.0);
    assert_eq!(ids, [(77, WcStatus::WrFlush), (78, WcStatus::WrFlush)]);
    assert_eq!(p.a.qp.recv_queue_len(), 0);
    // Moving the QP to RTR makes it queue receives again.
    p.a.qp.modify(QpState::Rtr).unwrap();
    p.a.qp
        .post_recv(&RecvWr::new(79, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    assert_eq!(p.a.qp.recv_queue_len(), 1);
}

/// A receive posted while the peer's close is under way used to be lost:
/// the state was read as RTS, the close flushed the queue and reached IDLE,
/// then the receive was queued and never completed. Every receive accepted
/// here must complete (success or flush).
#[test]
fn recv_posted_racing_the_peers_close_always_completes() {
    for round in 0..40u64 {
        let p = pair(false);
        let buf = mr(&p.a, 64);
        let stop = Arc::new(AtomicBool::new(false));
        let poster = {
            let qp = p.a.qp.clone();
            let sge = buf.sge(0, 64).unwrap();
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut accepted = 0usize;
                let mut id = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    id += 1;
                    match qp.post_recv(&RecvWr::new(id, &[sge])) {
                        Ok(()) => accepted += 1,
                        Err(_) => std::thread::yield_now(),
                    }
                    // Keep the queue from filling up while RTS.
                    if qp.recv_queue_len() > 200 {
                        std::thread::yield_now();
                    }
                    if qp.state() == QpState::Idle && id > 64 {
                        break;
                    }
                }
                accepted
            })
        };
        std::thread::sleep(Duration::from_micros(200 * (round % 5)));
        p.b.qp.disconnect().unwrap();
        until("a in IDLE", || p.a.qp.state() == QpState::Idle);
        stop.store(true, Ordering::Relaxed);
        let accepted = poster.join().unwrap();
        let done = wait(&p.a.cq, accepted);
        assert!(
            done.iter().all(|w| w.status == WcStatus::WrFlush),
            "round {round}: {:?}",
            done.iter().find(|w| w.status != WcStatus::WrFlush)
        );
        assert_eq!(p.a.qp.recv_queue_len(), 0, "round {round}");
    }
}

/// The peer's FIN followed by its RST (it closed with unread data): the
/// close used to stall in CLOSING for the whole close timeout, because
/// sending our FIN failed with ENOTCONN and nothing acted on it, and was
/// then misreported as "the peer did not close in time". The reset is
/// reported at once now (LLP reset, ERROR, flush).
#[test]
fn peer_rst_after_its_fin_is_reported_at_once() {
    use std::io::Write;
    use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
    let dev = device(false);
    let s = side(&dev, |_| {});
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let mut ours = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (peer, _) = listener.accept().unwrap();
    // Bytes the peer never reads: closing with them unread sends an RST.
    ours.write_all(b"unread").unwrap();
    peer.shutdown(Shutdown::Write).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    drop(peer);
    // Both the FIN and the RST are in before the QP reads the socket.
    std::thread::sleep(Duration::from_millis(100));
    let buf = mr(&s, 64);
    s.qp.post_recv(&RecvWr::new(9, &[buf.sge(0, 64).unwrap()]))
        .unwrap();
    s.qp.set_close_timeout(Duration::from_secs(120));
    s.qp.establish(ours, &LinkParams::default()).unwrap();
    until("ERROR after the peer's reset", || {
        s.qp.state() == QpState::Error
    });
    let mut kinds = Vec::new();
    while let Some(ev) = dev.async_events().try_get() {
        if ev.qp_num == Some(s.qp.qp_num()) {
            kinds.push(ev.kind);
        }
    }
    assert!(kinds.contains(&AsyncEventKind::LlpReset), "{kinds:?}");
    assert!(!kinds.contains(&AsyncEventKind::BadClose), "{kinds:?}");
    let w = wait(&s.cq, 1);
    assert_eq!((w[0].wr_id, w[0].status), (9, WcStatus::WrFlush));
}

/// STag indices used to be handed out in sequence (1, 2, 3, ...), so one
/// STag told a peer the others' indices and left only the 8-bit key to
/// guess. Indices are now drawn from the whole 24-bit space.
#[test]
fn stag_indices_are_not_sequential() {
    use softrdma_engine::Access;
    let dev = device(false);
    let pd = dev.alloc_pd();
    let regions: Vec<_> = (0..64)
        .map(|_| {
            pd.register(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap()
        })
        .collect();
    let idx: Vec<u32> = regions.iter().map(|r| r.rkey() >> 8).collect();
    assert!(idx.iter().all(|&i| i != 0 && i <= 0x00ff_ffff));
    let neighbours = idx.windows(2).filter(|w| w[0].abs_diff(w[1]) <= 1).count();
    assert!(neighbours < 4, "indices in sequence: {idx:?}");
    let spread = idx.iter().max().unwrap() - idx.iter().min().unwrap();
    assert!(spread > 1 << 20, "indices bunched together: {idx:?}");
    let mut unique = idx.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), idx.len());
}

/// The async event queue used to keep every event nobody read (4 per
/// closed connection pair: thousands after a few thousand connections). It
/// is bounded now, and says so with an overflow event.
#[test]
fn unread_async_events_are_bounded() {
    let mut cfg = softrdma_engine::DeviceConfig::default();
    cfg.pin_threads = false;
    cfg.async_event_capacity = 64;
    let dev = softrdma_engine::Device::open_with(cfg).unwrap();
    for _ in 0..40 {
        let p = pair_with(dev.clone(), false, |_| {});
        p.a.qp.disconnect().unwrap();
        until("IDLE", || {
            p.a.qp.state() == QpState::Idle && p.b.qp.state() == QpState::Idle
        });
    }
    let q = dev.async_events();
    assert_eq!(q.len(), 64);
    assert!(q.lost() > 0);
    let kinds: Vec<AsyncEventKind> = std::iter::from_fn(|| q.try_get()).map(|e| e.kind).collect();
    assert_eq!(kinds.last(), Some(&AsyncEventKind::EventQueueOverflow));
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == AsyncEventKind::EventQueueOverflow)
            .count(),
        1
    );
}

/// A remote failure used to surface only as flush / remote-access
/// completions: the Terminate's reason (layer, type, code) was reported in
/// an async event at most. Both QPs now keep the Terminate they sent or
/// received.
#[test]
fn terminate_reason_is_kept_on_both_qps() {
    use softrdma_engine::TerminateDirection;
    use softrdma_engine::wire::errcode::TermError;
    let p = pair(false);
    let dst = mr(&p.b, 64);
    let bad_rkey = dst.rkey() ^ 0x5a;
    p.a.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::Write {
                    remote_addr: dst.addr(),
                    rkey: bad_rkey,
                },
            )
            .inline(b"x")
            .signaled(),
        )
        .unwrap();
    until("both QPs in ERROR", || {
        p.a.qp.state() == QpState::Error && p.b.qp.state() == QpState::Error
    });
    let got = p.a.qp.last_terminate().expect("a received a Terminate");
    assert_eq!(got.direction, TerminateDirection::Received);
    assert_eq!(got.code, TermError::DdpTaggedInvalidStag.code());
    let sent = p.b.qp.last_terminate().expect("b sent a Terminate");
    assert_eq!(sent.direction, TerminateDirection::Sent);
    assert_eq!(sent.code, got.code);
    assert!(
        got.description().contains("Invalid Steering Tag"),
        "{}",
        got.description()
    );
}

/// With the responder's IRD equal to the requester's ORD (1 and 1, as
/// rping runs against kernel siw), the responder freed its IRD slot only
/// after `writev` returned for the last Read Response FPDU; the requester
/// could receive that response and send its next Read Request first, which
/// the responder then refused with a Terminate ("MSN range is not valid").
#[test]
fn read_request_right_after_the_last_response_is_within_ird() {
    let p = pair_with(device(false), false, |a| {
        a.ird = 1;
        a.ord = 1;
    });
    let n = 3000usize;
    let remote = mr(&p.b, 8 * n);
    let local = mr(&p.a, 8 * n);
    let sges: Vec<[softrdma_engine::Sge; 1]> =
        (0..n).map(|i| [local.sge(8 * i, 8).unwrap()]).collect();
    for chunk in sges.chunks(100) {
        let base = (chunk.as_ptr() as usize - sges.as_ptr() as usize)
            / std::mem::size_of::<[softrdma_engine::Sge; 1]>();
        let wrs: Vec<SendWr<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let i = base + k;
                SendWr::new(
                    i as u64,
                    SendOp::Read {
                        remote_addr: remote.addr() + 8 * i as u64,
                        rkey: remote.rkey(),
                    },
                )
                .sg_list(s)
                .signaled()
            })
            .collect();
        p.a.qp.post_send_list(&wrs).unwrap();
        let c = wait(&p.a.cq, wrs.len());
        assert!(
            c.iter().all(|c| c.status == WcStatus::Success),
            "a Read failed: {:?}; Terminate: {:?}",
            c.iter().find(|c| c.status != WcStatus::Success),
            p.b.qp.last_terminate()
        );
    }
}
