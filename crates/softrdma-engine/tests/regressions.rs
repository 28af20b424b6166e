//! Regression tests, each named after the bug it pins down.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::{QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus};

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
