//! `WaitSet`: one thread waits on several CQs and foreign descriptors.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use softrdma_engine::wait_set::{WaitError, WaitSet};
use softrdma_engine::{
    CompletionQueue, Device, DeviceConfig, RecvWr, SendOp, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

fn device(poll_driven: bool) -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.poll_spin = Duration::ZERO;
    cfg.poll_driven_receive = poll_driven;
    Device::open_with(cfg).unwrap()
}

fn pipe() -> (OwnedFd, std::fs::File) {
    let (r, w) = std::io::pipe().unwrap();
    (r.into(), OwnedFd::from(w).into())
}

fn take(cq: &CompletionQueue) -> Vec<WorkCompletion> {
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 8];
    let n = cq.poll(&mut buf);
    buf[..n].to_vec()
}

fn send(side: &common::Side, mr: &softrdma_engine::MemoryRegion, id: u64) {
    side.qp
        .post_send(
            &SendWr::new(id, SendOp::Send)
                .sg_list(&[mr.sge(0, 8).unwrap()])
                .signaled(),
        )
        .unwrap();
}

/// Several QPs (each with its CQ) and a pipe in one set: each becomes
/// ready on its own, and only the one that got something is reported.
#[test]
fn several_qps_and_a_pipe() {
    for poll_driven in [true, false] {
        let dev = device(poll_driven);
        let p1 = common::pair_with(dev.clone(), false, |_| {});
        let p2 = common::pair_with(dev, false, |_| {});
        let (src1, dst1) = (common::mr(&p1.a, 64), common::mr(&p1.b, 64));
        let (src2, dst2) = (common::mr(&p2.a, 64), common::mr(&p2.b, 64));
        for i in 0..4 {
            p1.b.qp
                .post_recv(&RecvWr::new(i, &[dst1.sge(0, 64).unwrap()]))
                .unwrap();
            p2.b.qp
                .post_recv(&RecvWr::new(i, &[dst2.sge(0, 64).unwrap()]))
                .unwrap();
        }
        let (r, mut w) = pipe();
        let mut set = WaitSet::new();
        let c1 = set.add_cq(&p1.b.cq);
        let c2 = set.add_cq(&p2.b.cq);
        let f = set.add_fd(r.as_raw_fd(), libc::POLLIN);
        assert_eq!(set.wait(Some(Duration::from_millis(20))).unwrap(), 0);

        send(&p2.a, &src2, 7);
        let n = set.wait(Some(Duration::from_secs(10))).unwrap();
        assert_eq!(n, 1, "poll-driven receive {poll_driven}");
        assert!(set.cq_ready(c2) && !set.cq_ready(c1));
        assert_eq!(set.fd_revents(f), 0);
        let got = take(&p2.b.cq);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].opcode, got[0].byte_len), (WcOpcode::Recv, 8));

        std::io::Write::write_all(&mut w, b"x").unwrap();
        assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
        assert!(!set.cq_ready(c1) && !set.cq_ready(c2));
        assert_eq!(set.fd_revents(f) & libc::POLLIN, libc::POLLIN);
        let mut b = [0u8; 1];
        std::io::Read::read_exact(&mut std::fs::File::from(r.try_clone().unwrap()), &mut b)
            .unwrap();

        send(&p1.a, &src1, 8);
        assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
        assert!(set.cq_ready(c1) && !set.cq_ready(c2));
        assert_eq!(take(&p1.b.cq).len(), 1);
        // Both sends completed at the senders too.
        assert_eq!(common::wait(&p1.a.cq, 1).len(), 1);
        assert_eq!(common::wait(&p2.a.cq, 1).len(), 1);
    }
}

#[test]
fn timeout_and_an_empty_set() {
    let mut set = WaitSet::new();
    let t = Instant::now();
    assert_eq!(set.wait(Some(Duration::from_millis(30))).unwrap(), 0);
    assert!(t.elapsed() >= Duration::from_millis(30));
    assert_eq!(set.wait(Some(Duration::ZERO)).unwrap(), 0);
    let dev = device(true);
    let cq = CompletionQueue::new(&dev, 4, None).unwrap();
    set.add_cq(&cq);
    // A negative descriptor is ignored, as by poll(2).
    set.add_fd(-1, libc::POLLIN);
    assert_eq!(set.wait(Some(Duration::from_millis(10))).unwrap(), 0);
    assert!(!set.cq_ready(0));
    set.clear();
    assert!(set.is_empty());
}

static HANDLED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    HANDLED.fetch_add(1, Ordering::SeqCst);
}

fn install_usr1() {
    // SAFETY: plain data, filled below.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
    // No SA_RESTART: a blocking call returns EINTR.
    sa.sa_flags = 0;
    // SAFETY: a valid sigaction with an async-signal-safe handler.
    let r = unsafe { libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()) };
    assert_eq!(r, 0);
}

/// A signal handled while the set sleeps ends the wait with `EINTR`.
#[test]
fn a_signal_interrupts_the_wait() {
    install_usr1();
    let dev = device(true);
    let p = common::pair_with(dev, false, |_| {});
    let cq = p.b.cq.clone();
    let done = Arc::new(AtomicBool::new(false));
    let d = done.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let waiter = std::thread::spawn(move || {
        // SAFETY: pthread_self has no preconditions.
        tx.send(unsafe { libc::pthread_self() }).unwrap();
        let (r, _w) = pipe();
        let mut set = WaitSet::new();
        set.add_cq(&cq);
        set.add_fd(r.as_raw_fd(), libc::POLLIN);
        let res = set.wait(Some(Duration::from_secs(20)));
        d.store(true, Ordering::SeqCst);
        res
    });
    let tid = rx.recv().unwrap();
    // The signal may come before the wait starts: send until it ends.
    while !done.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
        if !done.load(Ordering::SeqCst) {
            // SAFETY: the thread is alive until it sets `done`, and joined
            // only after.
            unsafe { libc::pthread_kill(tid, libc::SIGUSR1) };
        }
    }
    let res = waiter.join().unwrap();
    assert!(matches!(res, Err(WaitError::Interrupted)), "{res:?}");
    assert_eq!(res.unwrap_err().raw_os_error(), libc::EINTR);
    assert!(HANDLED.load(Ordering::SeqCst) > 0);
}

/// `wait_masked`: a signal the thread blocks, pending, is delivered once
/// the wait's mask unblocks it (as with `ppoll`/`pselect`), and not
/// before.
#[test]
fn the_mask_applies_during_the_wait_only() {
    install_usr1();
    let res = std::thread::spawn(|| {
        // SAFETY: plain data, set up with the sigset functions.
        let mut block: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut empty: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: valid sigset pointers; this thread's own mask.
        unsafe {
            libc::sigemptyset(&mut block);
            libc::sigaddset(&mut block, libc::SIGUSR1);
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_BLOCK, &block, std::ptr::null_mut());
            libc::pthread_kill(libc::pthread_self(), libc::SIGUSR1);
        }
        let before = HANDLED.load(Ordering::SeqCst);
        let mut set = WaitSet::new();
        // Blocked by the thread's mask: the wait times out.
        let first = set.wait(Some(Duration::from_millis(20)));
        let still_pending = HANDLED.load(Ordering::SeqCst) == before;
        // Unblocked by the wait's mask: delivered, EINTR.
        let second = set.wait_masked(Some(Duration::from_secs(20)), Some(&empty));
        // SAFETY: this thread's own mask.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &block, std::ptr::null_mut()) };
        (first.ok(), still_pending, second.is_err())
    })
    .join()
    .unwrap();
    assert_eq!(res, (Some(0), true, true));
}

/// No lost wake-up: completions that arrive at any moment (before the
/// waiter looks, between its look and its sleep, while it sleeps) all
/// wake it; a pipe written at the same time too. Each round's wait
/// would take the full 10 s if a wake-up were lost.
#[test]
fn no_lost_wake_up() {
    for poll_driven in [true, false] {
        let dev = device(poll_driven);
        let p = common::pair_with(dev, false, |_| {});
        let src = common::mr(&p.a, 64);
        let dst = common::mr(&p.b, 64);
        let rounds = 200u64;
        for i in 0..rounds {
            p.b.qp
                .post_recv(&RecvWr::new(i, &[dst.sge(0, 64).unwrap()]))
                .unwrap();
        }
        let (r, mut w) = pipe();
        let cq = p.b.cq.clone();
        let waiter = std::thread::spawn(move || {
            let mut set = WaitSet::new();
            set.add_cq(&cq);
            let f = set.add_fd(r.as_raw_fd(), libc::POLLIN);
            let mut got = 0u64;
            let mut bytes = 0usize;
            let mut file = std::fs::File::from(r.try_clone().unwrap());
            while got < rounds || bytes < rounds as usize {
                let t = Instant::now();
                let n = set.wait(Some(Duration::from_secs(10))).unwrap();
                // A wake-up without a result (bytes that made no
                // completion yet) is allowed; a full timeout is not.
                assert!(
                    n > 0 || t.elapsed() < Duration::from_secs(10),
                    "lost wake-up after {got} completions, {bytes} bytes"
                );
                got += take(&cq).len() as u64;
                if set.fd_revents(f) != 0 {
                    let mut b = [0u8; 64];
                    bytes += std::io::Read::read(&mut file, &mut b).unwrap();
                }
            }
            got
        });
        for i in 0..rounds {
            match i % 5 {
                0 => std::thread::sleep(Duration::from_millis(1)),
                1 => std::thread::yield_now(),
                _ => {}
            }
            send(&p.a, &src, i);
            std::io::Write::write_all(&mut w, b"y").unwrap();
            assert_eq!(common::wait(&p.a.cq, 1).len(), 1);
        }
        assert_eq!(waiter.join().unwrap(), rounds, "poll-driven {poll_driven}");
    }
}

/// A descriptor closed and its number reused for another file, while the
/// set (large enough to keep persistent epoll registrations) still knows
/// the number: the new file is watched (not taken as registered already),
/// and the old file, kept open by a duplicate, is not reported under the
/// number (its stale registration is not mistaken for the new one).
#[test]
fn a_closed_descriptor_number_reused_is_watched_anew() {
    let others: Vec<_> = (0..3).map(|_| pipe()).collect();
    let fill = |set: &mut WaitSet, fd: libc::c_int| -> usize {
        set.clear();
        for (r, _) in &others {
            set.add_fd(r.as_raw_fd(), libc::POLLIN);
        }
        set.add_fd(fd, libc::POLLIN)
    };
    let (ra, mut wa) = pipe();
    let x = ra.as_raw_fd();
    let mut set = WaitSet::new();
    let i = fill(&mut set, x);
    assert_eq!(set.wait(Some(Duration::from_millis(20))).unwrap(), 0);
    std::io::Write::write_all(&mut wa, b"a").unwrap();
    assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
    assert_eq!(set.fd_revents(i) & libc::POLLIN, libc::POLLIN);
    let mut a = std::fs::File::from(ra.try_clone().unwrap());
    let mut b1 = [0u8; 1];
    std::io::Read::read_exact(&mut a, &mut b1).unwrap();
    // Registered and armed again, nothing to read.
    assert_eq!(set.wait(Some(Duration::ZERO)).unwrap(), 0);

    // Pipe A stays open through its duplicate `a`; its number goes to B.
    // `dup2` moves the number in one step: closing `ra` first would free
    // the number for the test threads running beside this one, and
    // `dup2` would then close a descriptor one of them owns.
    let (rb, mut wb) = pipe();
    // SAFETY: `x` is `ra`'s open descriptor and `rb`'s is open; dup2
    // closes A's read end at `x` (A stays open through `a`) and makes `x`
    // name B's read end. `ra` is forgotten: `x` is owned by `rb_x` below.
    assert_eq!(unsafe { libc::dup2(rb.as_raw_fd(), x) }, x);
    std::mem::forget(ra);
    // SAFETY: `x` is open (B's read end) and owned by nothing else.
    let rb_x = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(x) };
    drop(rb);
    // A becomes readable: not B, so not the number's entry.
    std::io::Write::write_all(&mut wa, b"a").unwrap();
    let i = fill(&mut set, x);
    assert_eq!(set.wait(Some(Duration::from_millis(50))).unwrap(), 0);
    assert_eq!(set.fd_revents(i), 0);
    // B becomes readable: reported.
    std::io::Write::write_all(&mut wb, b"b").unwrap();
    assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
    assert_eq!(set.fd_revents(i) & libc::POLLIN, libc::POLLIN);
    let mut b = std::fs::File::from(rb_x);
    std::io::Read::read_exact(&mut b, &mut b1).unwrap();
    assert_eq!(&b1, b"b");
    // Closed while in the set: POLLNVAL, as poll(2) reports.
    drop(b);
    assert_eq!(set.wait(Some(Duration::from_secs(10))).unwrap(), 1);
    assert_eq!(set.fd_revents(i), libc::POLLNVAL);
}

/// A set large enough to wait with its own epoll instance keeps what it
/// knows of each CQ from one wait to the next (its QPs' sockets
/// registered and claimed, the claim renewed only now and then): every
/// message still wakes it, whether the waits follow each other at once or
/// with pauses longer than the claim's renewal margin, and also after one
/// of the QPs closed (its socket at its end leaves the set instead of
/// waking every wait) and the set was rebuilt with a CQ fewer.
#[test]
fn a_large_set_keeps_its_cqs_across_waits() {
    let dev = device(true);
    let pairs: Vec<_> = (0..5)
        .map(|_| common::pair_with(dev.clone(), false, |_| {}))
        .collect();
    let rounds = 40u64;
    let mrs: Vec<_> = pairs
        .iter()
        .map(|p| {
            let dst = common::mr(&p.b, 64);
            for i in 0..rounds {
                p.b.qp
                    .post_recv(&RecvWr::new(i, &[dst.sge(0, 64).unwrap()]))
                    .unwrap();
            }
            (common::mr(&p.a, 64), dst)
        })
        .collect();
    let mut set = WaitSet::new();
    let fill = |set: &mut WaitSet, from: usize| {
        set.clear();
        for p in &pairs[from..] {
            set.add_cq(&p.b.cq);
        }
    };
    let mut got = vec![0u64; pairs.len()];
    let mut receive = |set: &mut WaitSet, k: usize, from: usize, id: u64| {
        send(&pairs[k].a, &mrs[k].0, id);
        let mut seen = 0;
        while seen == 0 {
            fill(set, from);
            let t = Instant::now();
            let n = set.wait(Some(Duration::from_secs(10))).unwrap();
            assert!(
                n > 0 || t.elapsed() < Duration::from_secs(10),
                "lost wake-up for QP {k}, message {id}"
            );
            for (j, p) in pairs.iter().enumerate().skip(from) {
                let c = take(&p.b.cq);
                if j == k {
                    seen += c.len();
                } else {
                    // The closed QP's flushed receives, nothing else.
                    assert!(
                        c.iter().all(|c| j == 0 && c.status != WcStatus::Success),
                        "QP {j} got a completion meant for {k}: {c:?}"
                    );
                }
            }
        }
        got[k] += seen as u64;
        assert_eq!(common::wait(&pairs[k].a.cq, 1).len(), 1);
    };
    for id in 0..rounds / 2 {
        let k = id as usize % pairs.len();
        if id % 7 == 3 {
            // Past half the claim's time after the last wait: renewed.
            std::thread::sleep(Duration::from_millis(8));
        }
        receive(&mut set, k, 0, id);
    }
    // QP 0's peer goes: its socket reaches its end. The set goes on with
    // that CQ still in it, then without it (as a program drops a closed
    // connection).
    let _ = pairs[0].a.qp.disconnect();
    let others = pairs.len() - 1;
    for id in rounds / 2..rounds {
        let k = 1 + id as usize % others;
        let from = usize::from(id >= 3 * rounds / 4);
        receive(&mut set, k, from, id);
    }
    assert_eq!(got.iter().sum::<u64>(), rounds);
}

/// Connects `a` to `b` over loopback with `b`'s socket at descriptor
/// number `at` (closed before: asserted).
fn connect_at(a: &softrdma_engine::QueuePair, b: &softrdma_engine::QueuePair, at: libc::c_int) {
    use softrdma_engine::LinkParams;
    use softrdma_engine::connect::{mpa_accept, mpa_connect};
    use softrdma_engine::proto::mpa::MpaConfig;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};
    const T: Duration = Duration::from_secs(10);
    // SAFETY: `F_GETFD` only asks about the number.
    let flags = unsafe { libc::fcntl(at, libc::F_GETFD) };
    assert_eq!(flags, -1, "{at} is free");
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        // SAFETY: `s` is open and `at` free (asserted above): `at` then
        // names `s`'s socket, owned by the stream made from it below.
        assert_eq!(unsafe { libc::dup2(s.as_raw_fd(), at) }, at);
        drop(s);
        // SAFETY: `at` is open and owned by nothing else.
        let mut s = unsafe { <TcpStream as std::os::fd::FromRawFd>::from_raw_fd(at) };
        let n = mpa_accept(&mut s, &MpaConfig::default(), &[], T).unwrap();
        (s, n)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let n = mpa_connect(&mut s, &MpaConfig::default(), &[], T).unwrap();
    let (rs, rn) = acceptor.join().unwrap();
    a.establish(s, &LinkParams::from(&n)).unwrap();
    b.establish(rs, &LinkParams::from(&rn)).unwrap();
}

/// Aborts both QPs of `p` and resets them to IDLE (their sockets closed).
fn abort_and_reset(p: &common::Pair) {
    use softrdma_engine::QpState;
    p.a.qp.abort();
    p.b.qp.abort();
    let deadline = Instant::now() + Duration::from_secs(10);
    while p.a.qp.state() != QpState::Error || p.b.qp.state() != QpState::Error {
        assert!(Instant::now() < deadline, "not in ERROR");
        std::thread::sleep(Duration::from_millis(1));
    }
    p.a.qp.modify(QpState::Idle).unwrap();
    p.b.qp.modify(QpState::Idle).unwrap();
}

/// A QP reset and connected again, its new socket at the number its old
/// one had, in a set large enough to keep persistent epoll registrations
/// (and the old socket's registration went with its file): the new socket
/// is watched, and a message on it wakes the wait.
#[test]
fn a_qp_connected_again_at_its_old_descriptor_number_wakes_the_wait() {
    const AT: libc::c_int = 911;
    let p = common::pair_with(device(true), false, |_| {});
    abort_and_reset(&p);
    connect_at(&p.a.qp, &p.b.qp, AT);
    let mut set = WaitSet::new();
    set.add_cq(&p.b.cq);
    // Three foreign descriptors that never become ready: with the CQ, a
    // set that waits with its own epoll instance.
    let others: Vec<_> = (0..3).map(|_| pipe()).collect();
    for (r, _) in &others {
        set.add_fd(r.as_raw_fd(), libc::POLLIN);
    }
    let (src, dst) = (common::mr(&p.a, 64), common::mr(&p.b, 64));
    for round in 0..2 {
        if round == 1 {
            // The old socket (registered with the set) closed, the new
            // one at its number.
            abort_and_reset(&p);
            assert!(take(&p.b.cq).is_empty());
            connect_at(&p.a.qp, &p.b.qp, AT);
        }
        p.b.qp
            .post_recv(&RecvWr::new(round, &[dst.sge(0, 64).unwrap()]))
            .unwrap();
        // A wait first, with nothing to find (the sockets are claimed and
        // registered), then the message.
        assert_eq!(set.wait(Some(Duration::from_millis(20))).unwrap(), 0);
        send(&p.a, &src, 100 + round);
        let start = Instant::now();
        let n = set.wait(Some(Duration::from_secs(3))).unwrap();
        assert_eq!(n, 1, "round {round}: the message did not wake the wait");
        assert!(start.elapsed() < Duration::from_secs(3));
        let mut got = take(&p.b.cq);
        while got.is_empty() {
            got = take(&p.b.cq);
        }
        assert_eq!((got[0].wr_id, got[0].status), (round, WcStatus::Success));
        while take(&p.a.cq).is_empty() {}
    }
}
