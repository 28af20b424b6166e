//! Stream-to-RDMA transition over real loopback TCP: a streaming phase,
//! the switch (MPA exchange or direct), then RDMA traffic verified.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::proto::mpa::{MpaConfig, RtrOffer};
use softrdma_engine::proto::rtr::RtrKind;
use softrdma_engine::transition::{
    ConnState, MpaRole, StreamConnection, SwitchMode, TransitionError,
};
use softrdma_engine::{
    LinkParams, QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

fn conn(s: TcpStream, mode: SwitchMode) -> StreamConnection {
    let mut c = StreamConnection::new(s, mode);
    c.set_stream_timeout(Some(Duration::from_secs(10))).unwrap();
    c
}

fn read_msg(c: &mut StreamConnection, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    c.read_exact(&mut v).unwrap();
    v
}

/// Waits until `n` octets are readable on `peek` (not consumed).
fn wait_readable(peek: &TcpStream, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut buf = vec![0u8; n];
    loop {
        let got = peek.peek(&mut buf).unwrap();
        if got >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "only {got} of {n} octets arrived"
        );
        thread::sleep(Duration::from_millis(1));
    }
}

/// Checks the RDMA data path after a switch: Send/Recv both ways and an
/// RDMA Write, data verified. `a`/`b` have a receive posted with wr_id 100
/// into `ra`/`rb` offset 0 (256 octets).
fn verify_rdma(
    a: &Side,
    b: &Side,
    ra: &softrdma_engine::MemoryRegion,
    rb: &softrdma_engine::MemoryRegion,
) {
    let src = mr(a, 4096);
    let data = pattern(200, 5);
    src.write(0, &data).unwrap();
    let sge = [src.sge(0, 200).unwrap()];
    // The Write first: its data is placed before the Send completes.
    let write = SendOp::Write {
        remote_addr: rb.addr() + 1024,
        rkey: rb.rkey(),
    };
    a.qp.post_send(&SendWr::new(2, write).sg_list(&sge).signaled())
        .unwrap();
    a.qp.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    let s = wait(&a.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    let r = wait(&b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].wr_id, 100);
    assert_eq!(r[0].byte_len, 200);
    assert_eq!(rb.to_vec()[..200], data[..]);
    assert_eq!(rb.to_vec()[1024..1224], data[..]);
    // And back.
    let src_b = mr(b, 64);
    src_b.write(0, b"reply from b").unwrap();
    let sge = [src_b.sge(0, 12).unwrap()];
    b.qp.post_send(&SendWr::new(3, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    let r = wait(&a.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].wr_id, 100);
    assert_eq!(&ra.to_vec()[..12], b"reply from b");
}

fn recv_wr(m: &softrdma_engine::MemoryRegion) -> [softrdma_engine::Sge; 1] {
    [m.sge(0, 256).unwrap()]
}

fn login_then_switch(mode_a: SwitchMode, mode_b: SwitchMode) {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let (qb, rb_sge) = (b.qp.clone(), recv_wr(&rb));
    // b: the target of the login.
    let tb = thread::spawn(move || {
        let mut c = conn(sb, mode_b);
        c.reserve(&qb).unwrap();
        for i in 0..3u8 {
            let m = read_msg(&mut c, 6);
            assert_eq!(m, [b'L', b'O', b'G', b'I', b'N', b'0' + i]);
            c.write_all(&[b'O', b'K', b'0' + i]).unwrap();
        }
        c.request_switch().unwrap();
        c.write_all(b"FINAL-B").unwrap();
        c.post_recv_and_switch(&RecvWr::new(100, &rb_sge)).unwrap();
        assert_eq!(c.state(), ConnState::Rdma);
        c
    });
    let mut c = conn(sa, mode_a);
    c.reserve(&a.qp).unwrap();
    for i in 0..3u8 {
        c.write_all(&[b'L', b'O', b'G', b'I', b'N', b'0' + i])
            .unwrap();
        assert_eq!(read_msg(&mut c, 3), [b'O', b'K', b'0' + i]);
    }
    assert_eq!(read_msg(&mut c, 7), b"FINAL-B");
    c.request_switch().unwrap();
    c.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let cb = tb.join().unwrap();
    assert_eq!(c.state(), ConnState::Rdma);
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);
    verify_rdma(&a, &b, &ra, &rb);
    drop(cb);
}

#[test]
fn login_then_switch_mpa() {
    login_then_switch(
        SwitchMode::mpa(MpaRole::Initiator),
        SwitchMode::mpa(MpaRole::Responder),
    );
}

#[test]
fn login_then_switch_mpa_crc() {
    let crc = MpaConfig {
        crc: softrdma_engine::proto::mpa::CrcPolicy::Required,
        ..MpaConfig::default()
    };
    login_then_switch(
        SwitchMode::Mpa {
            role: MpaRole::Initiator,
            config: crc,
            private_data: b"iser".to_vec(),
        },
        SwitchMode::mpa(MpaRole::Responder),
    );
}

fn p2p(role: MpaRole, kind: RtrKind) -> SwitchMode {
    SwitchMode::Mpa {
        role,
        config: MpaConfig {
            peer_to_peer: Some(RtrOffer::only(kind)),
            ..MpaConfig::default()
        },
        private_data: Vec::new(),
    }
}

#[test]
fn login_then_switch_mpa_peer_to_peer() {
    for kind in [RtrKind::Write, RtrKind::Read, RtrKind::Send] {
        login_then_switch(p2p(MpaRole::Initiator, kind), p2p(MpaRole::Responder, kind));
    }
}

#[test]
fn login_then_switch_direct() {
    login_then_switch(
        SwitchMode::Direct(LinkParams::default()),
        SwitchMode::Direct(LinkParams::default()),
    );
}

/// The peer switches first (direct mode) and sends RDMA frames at once
/// after its last streaming message; the local side is still to read that
/// message, so its read-ahead takes the frames too. They must reach the
/// RDMA receive path, not the stream.
#[test]
fn race_peer_sends_rdma_right_after_last_message_direct() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let peek = sa.try_clone().unwrap();
    let mut cb = conn(sb, SwitchMode::Direct(LinkParams::default()));
    cb.reserve(&b.qp).unwrap();
    cb.request_switch().unwrap();
    cb.write_all(b"LAST-B").unwrap();
    cb.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&rb)))
        .unwrap();
    // b sends at once: a Send and an RDMA Write into a's memory.
    let src = mr(&b, 4096);
    let data = pattern(300, 9);
    src.write(0, &data).unwrap();
    let sge = [src.sge(0, 200).unwrap()];
    b.qp.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    let write = SendOp::Write {
        remote_addr: ra.addr() + 2048,
        rkey: ra.rkey(),
    };
    let sge = [src.sge(0, 300).unwrap()];
    b.qp.post_send(&SendWr::new(2, write).sg_list(&sge).signaled())
        .unwrap();
    // Both FPDUs (> 500 octets) are in a's socket behind the last message.
    wait_readable(&peek, 6 + 500);
    let mut ca = conn(sa, SwitchMode::Direct(LinkParams::default()));
    ca.reserve(&a.qp).unwrap();
    assert_eq!(read_msg(&mut ca, 6), b"LAST-B");
    assert!(ca.buffered() >= 500, "frames read ahead: {}", ca.buffered());
    ca.request_switch().unwrap();
    let mut one = [0u8; 1];
    assert!(matches!(
        ca.read(&mut one),
        Err(TransitionError::ReadAfterSwitchRequest)
    ));
    ca.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let r = wait(&a.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].byte_len, 200);
    assert_eq!(ra.to_vec()[..200], data[..200]);
    // The Write came after the Send: placed by the time the Send completed
    // is not promised by the wire, so poll for its data.
    let deadline = Instant::now() + Duration::from_secs(10);
    while ra.to_vec()[2048..2348] != data[..] {
        assert!(Instant::now() < deadline, "write data not placed");
        thread::yield_now();
    }
    let s = wait(&b.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
}

/// MPA mode: the peer (initiator) writes its last streaming message and
/// its MPA Request at once, and then its first RDMA frames as soon as the
/// Reply is there; the local side reads its last message with the Request
/// already read ahead.
#[test]
fn race_peer_sends_mpa_and_rdma_right_after_last_message() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let peek = sa.try_clone().unwrap();
    let (qb, cqb, rb_sge) = (b.qp.clone(), b.cq.clone(), recv_wr(&rb));
    let src = mr(&b, 4096);
    let data = pattern(200, 1);
    src.write(0, &data).unwrap();
    let (ra_addr, ra_rkey) = (ra.addr(), ra.rkey());
    let tb = thread::spawn(move || {
        let mut c = conn(sb, SwitchMode::mpa(MpaRole::Initiator));
        c.reserve(&qb).unwrap();
        c.request_switch().unwrap();
        c.write_all(b"LAST-B").unwrap();
        c.post_recv_and_switch(&RecvWr::new(100, &rb_sge)).unwrap();
        let sge = [src.sge(0, 200).unwrap()];
        // The Write first: placed before the Send completes at a.
        let write = SendOp::Write {
            remote_addr: ra_addr + 1024,
            rkey: ra_rkey,
        };
        qb.post_send(&SendWr::new(2, write).sg_list(&sge).signaled())
            .unwrap();
        qb.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
            .unwrap();
        let s = wait(&cqb, 2);
        assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
        c
    });
    // The last message and the whole Request (20-octet header, 4-octet
    // IRD/ORD word) are in a's socket before a reads.
    wait_readable(&peek, 6 + 24);
    let mut ca = conn(sa, SwitchMode::mpa(MpaRole::Responder));
    ca.reserve(&a.qp).unwrap();
    assert_eq!(read_msg(&mut ca, 6), b"LAST-B");
    assert_eq!(ca.buffered(), 24, "the MPA Request was read ahead");
    ca.request_switch().unwrap();
    ca.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let r = wait(&a.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].byte_len, 200);
    assert_eq!(ra.to_vec()[..200], data[..]);
    let _cb = tb.join().unwrap();
    assert_eq!(ra.to_vec()[1024..1224], data[..]);
    assert!(ca.negotiated().is_some_and(|n| !n.initiator));
}

/// A big last streaming message written after the switch request arrives
/// whole and before the first RDMA frame, which follows it at once.
#[test]
fn last_message_after_request_precedes_rdma_frames() {
    const LEN: usize = 1 << 20;
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let (qb, rb_sge) = (b.qp.clone(), recv_wr(&rb));
    let tb = thread::spawn(move || {
        let mut c = conn(sb, SwitchMode::Direct(LinkParams::default()));
        c.reserve(&qb).unwrap();
        let m = read_msg(&mut c, LEN);
        assert!(m == pattern(LEN, 77), "last streaming message corrupted");
        c.request_switch().unwrap();
        c.post_recv_and_switch(&RecvWr::new(100, &rb_sge)).unwrap();
        c
    });
    let mut c = conn(sa, SwitchMode::Direct(LinkParams::default()));
    c.reserve(&a.qp).unwrap();
    c.request_switch().unwrap();
    // Larger than the socket buffers: blocks until b has read most of it.
    c.write_all(&pattern(LEN, 77)).unwrap();
    c.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let src = mr(&a, 64);
    src.write(0, b"first RDMA frame").unwrap();
    let sge = [src.sge(0, 16).unwrap()];
    a.qp.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    let _cb = tb.join().unwrap();
    let r = wait(&b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(&rb.to_vec()[..16], b"first RDMA frame");
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn calls_enforced_per_state() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let mut c = conn(sa, SwitchMode::mpa(MpaRole::Initiator));
    let sge = recv_wr(&ra);
    // Switching needs a request first, and a QP.
    assert!(matches!(
        c.post_recv_and_switch(&RecvWr::new(1, &sge)),
        Err(TransitionError::NotAllowed {
            state: ConnState::Streaming,
            ..
        })
    ));
    assert!(matches!(
        c.set_ird_ord(1, 1),
        Err(TransitionError::NoQpReserved)
    ));
    c.request_switch().unwrap();
    assert!(matches!(
        c.request_switch(),
        Err(TransitionError::NotAllowed { .. })
    ));
    assert!(matches!(
        c.post_recv_and_switch(&RecvWr::new(1, &sge)),
        Err(TransitionError::NoQpReserved)
    ));
    // Reads refused after the request, with the octets kept for RDMA.
    let mut buf = [0u8; 4];
    let e = c.read(&mut buf).unwrap_err();
    assert!(matches!(e, TransitionError::ReadAfterSwitchRequest));
    assert!(e.to_string().contains("refused"), "{e}");
    assert!(matches!(
        c.read_exact(&mut buf),
        Err(TransitionError::ReadAfterSwitchRequest)
    ));
    // Writes (last streaming messages) still allowed; reserving too.
    c.write_all(b"last").unwrap();
    c.reserve(&a.qp).unwrap();
    // A QP not in IDLE cannot be reserved.
    let other = side(&dev, |_| {});
    other.qp.modify(QpState::Error).unwrap();
    assert!(matches!(
        c.reserve(&other.qp),
        Err(TransitionError::QpNotIdle { .. })
    ));
    let tb = thread::spawn(move || {
        let mut c = conn(sb, SwitchMode::mpa(MpaRole::Responder));
        c.reserve(&b.qp).unwrap();
        assert_eq!(read_msg(&mut c, 4), b"last");
        c.request_switch().unwrap();
        c.post_recv_and_switch(&RecvWr::new(1, &recv_wr(&rb)))
            .unwrap();
        (c, b)
    });
    c.post_recv_and_switch(&RecvWr::new(1, &sge)).unwrap();
    let _b = tb.join().unwrap();
    // RDMA mode: no stream calls, IRD/ORD fixed.
    assert_eq!(c.state(), ConnState::Rdma);
    assert!(matches!(
        c.read(&mut buf),
        Err(TransitionError::NotAllowed {
            state: ConnState::Rdma,
            ..
        })
    ));
    assert!(matches!(
        c.write_all(b"x"),
        Err(TransitionError::NotAllowed { .. })
    ));
    assert!(matches!(
        c.set_ird_ord(4, 4),
        Err(TransitionError::IrdOrd(_))
    ));
    assert!(matches!(
        c.request_switch(),
        Err(TransitionError::NotAllowed { .. })
    ));
}

/// Octets read too far are given back and go to the RDMA side.
#[test]
fn unread_octets_go_to_rdma_side() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let peek = sa.try_clone().unwrap();
    let mut cb = conn(sb, SwitchMode::Direct(LinkParams::default()));
    cb.reserve(&b.qp).unwrap();
    cb.request_switch().unwrap();
    cb.write_all(b"END").unwrap();
    cb.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&rb)))
        .unwrap();
    let src = mr(&b, 64);
    src.write(0, b"after END").unwrap();
    let sge = [src.sge(0, 9).unwrap()];
    b.qp.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    wait_readable(&peek, 3 + 20);
    let mut ca = conn(sa, SwitchMode::Direct(LinkParams::default()));
    ca.reserve(&a.qp).unwrap();
    // The application reads with a large buffer and gets more than "END".
    let mut big = [0u8; 512];
    let n = ca.read(&mut big).unwrap();
    assert!(n > 3);
    assert_eq!(&big[..3], b"END");
    ca.unread(&big[3..n]).unwrap();
    ca.request_switch().unwrap();
    ca.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let r = wait(&a.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(&ra.to_vec()[..9], b"after END");
}

/// IRD/ORD set before the switch are what the MPA exchange announces.
#[test]
fn ird_ord_changed_before_switch_are_honoured() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let (qb, rb_sge) = (b.qp.clone(), recv_wr(&rb));
    let tb = thread::spawn(move || {
        let mut c = conn(sb, SwitchMode::mpa(MpaRole::Responder));
        c.reserve(&qb).unwrap();
        c.set_ird_ord(1, 1).unwrap();
        c.request_switch().unwrap();
        // Still allowed after the request.
        c.set_ird_ord(7, 2).unwrap();
        c.post_recv_and_switch(&RecvWr::new(100, &rb_sge)).unwrap();
        c
    });
    let mut c = conn(sa, SwitchMode::mpa(MpaRole::Initiator));
    c.reserve(&a.qp).unwrap();
    c.set_ird_ord(3, 5).unwrap();
    c.request_switch().unwrap();
    c.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&ra)))
        .unwrap();
    let cb = tb.join().unwrap();
    let na = c.negotiated().unwrap();
    let nb = cb.negotiated().unwrap();
    assert_eq!((na.ird, na.peer_ird, na.peer_ord), (3, Some(7), Some(2)));
    assert_eq!(na.ord, 5);
    assert_eq!((nb.ird, nb.peer_ird, nb.peer_ord), (7, Some(3), Some(5)));
    assert_eq!(nb.ord, 2);
    let qa = a.qp.query();
    assert_eq!((qa.ird, qa.ord), (3, 5));
    let qb = b.qp.query();
    assert_eq!((qb.ird, qb.ord), (7, 2));
    verify_rdma(&a, &b, &ra, &rb);
}

fn expect_torn_down(c: &StreamConnection, side: &Side) {
    assert_eq!(c.state(), ConnState::Failed);
    assert_eq!(side.qp.state(), QpState::Error);
    let wc: Vec<WorkCompletion> = wait(&side.cq, 1);
    assert_eq!(wc[0].status, WcStatus::WrFlush, "{wc:?}");
}

#[test]
fn peer_closes_during_switch_tears_down() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let (sa, sb) = tcp_pair();
    let mut c = conn(sa, SwitchMode::mpa(MpaRole::Initiator));
    c.reserve(&a.qp).unwrap();
    c.request_switch().unwrap();
    drop(sb);
    let e = c
        .post_recv_and_switch(&RecvWr::new(9, &recv_wr(&ra)))
        .unwrap_err();
    assert!(matches!(e, TransitionError::PeerClosed), "{e}");
    expect_torn_down(&c, &a);
    // Never back to streaming.
    let mut buf = [0u8; 1];
    assert!(matches!(
        c.read(&mut buf),
        Err(TransitionError::NotAllowed {
            state: ConnState::Failed,
            ..
        })
    ));
    assert!(matches!(
        c.write_all(b"x"),
        Err(TransitionError::NotAllowed { .. })
    ));
}

#[test]
fn garbage_during_switch_tears_down() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let (sa, mut sb) = tcp_pair();
    let mut c = conn(sa, SwitchMode::mpa(MpaRole::Responder));
    c.reserve(&a.qp).unwrap();
    c.request_switch().unwrap();
    std::io::Write::write_all(&mut sb, b"GET / HTTP/1.1\r\nHost: example\r\n\r\n").unwrap();
    let e = c
        .post_recv_and_switch(&RecvWr::new(9, &recv_wr(&ra)))
        .unwrap_err();
    assert!(matches!(e, TransitionError::Mpa(_)), "{e}");
    expect_torn_down(&c, &a);
    // The peer sees the connection closed.
    let mut buf = [0u8; 64];
    sb.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(std::io::Read::read(&mut sb, &mut buf).unwrap_or(0), 0);
}

#[test]
fn silent_peer_times_out_and_tears_down() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let (sa, _sb) = tcp_pair();
    let mut c = conn(sa, SwitchMode::mpa(MpaRole::Initiator));
    c.set_switch_timeout(Duration::from_millis(200));
    c.reserve(&a.qp).unwrap();
    c.request_switch().unwrap();
    let e = c
        .post_recv_and_switch(&RecvWr::new(9, &recv_wr(&ra)))
        .unwrap_err();
    assert!(matches!(e, TransitionError::TimedOut), "{e}");
    expect_torn_down(&c, &a);
}

/// A QP with a shared receive queue: the first receive goes to the SRQ;
/// posting it to the QP is refused without starting the switch.
#[test]
fn switch_with_shared_receive_queue() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let pd = softrdma_engine::ProtectionDomain::new(&dev);
    let cq = softrdma_engine::CompletionQueue::new(&dev, 64, None).unwrap();
    let srq = softrdma_engine::SharedReceiveQueue::new(&pd, 16, 1, 0).unwrap();
    let mut attr = softrdma_engine::QpInitAttr::new(&cq, &cq);
    attr.srq = Some(srq.clone());
    let qp = softrdma_engine::QueuePair::new(&pd, &attr).unwrap();
    let b = Side { pd, cq, qp };
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let mut cb = conn(sb, SwitchMode::mpa(MpaRole::Responder));
    cb.reserve(&b.qp).unwrap();
    cb.request_switch().unwrap();
    assert!(matches!(
        cb.post_recv_and_switch(&RecvWr::new(100, &recv_wr(&rb))),
        Err(TransitionError::PostRecv(_))
    ));
    assert_eq!(cb.state(), ConnState::SwitchRequested);
    let qa = a.qp.clone();
    let ra_sge = recv_wr(&ra);
    let ta = thread::spawn(move || {
        let mut c = conn(sa, SwitchMode::mpa(MpaRole::Initiator));
        c.reserve(&qa).unwrap();
        c.request_switch().unwrap();
        c.post_recv_and_switch(&RecvWr::new(100, &ra_sge)).unwrap();
        c
    });
    cb.post_srq_recv_and_switch(&srq, &RecvWr::new(100, &recv_wr(&rb)))
        .unwrap();
    let _ca = ta.join().unwrap();
    verify_rdma(&a, &b, &ra, &rb);
}

/// The initiator posts right after sending its RTR, before the responder
/// has read the RTR: the responder's handshake reads the RTR and the
/// FPDUs behind it in one read (it reads ahead). The FPDUs go to the QP,
/// each delivered exactly once.
#[test]
fn octets_read_past_the_rtr_by_the_handshake_go_to_the_qp_once() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 4096);
    let rb = mr(&b, 4096);
    let (sa, sb) = tcp_pair();
    let peek = sb.try_clone().unwrap();
    let mode = |role| p2p(role, RtrKind::Write);
    let mut ca = conn(sa, mode(MpaRole::Initiator));
    let mut cb = conn(sb, mode(MpaRole::Responder));
    ca.reserve(&a.qp).unwrap();
    cb.reserve(&b.qp).unwrap();
    ca.request_switch().unwrap();
    cb.request_switch().unwrap();
    // b waits for the Request; a sends it.
    assert!(
        !cb.post_recv_and_begin_switch(&RecvWr::new(100, &recv_wr(&rb)))
            .unwrap()
    );
    let rb2 = [rb.sge(1024, 256).unwrap()];
    b.qp.post_recv(&RecvWr::new(101, &rb2)).unwrap();
    let rb3 = [rb.sge(2048, 256).unwrap()];
    b.qp.post_recv(&RecvWr::new(102, &rb3)).unwrap();
    assert!(
        !ca.post_recv_and_begin_switch(&RecvWr::new(100, &recv_wr(&ra)))
            .unwrap()
    );
    // b answers; a reads the Reply and sends its RTR. b is not driven
    // once a is in RDMA mode: the RTR stays in b's socket.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        assert!(!cb.poll_switch().unwrap(), "b switched before the RTR");
        if ca.poll_switch().unwrap() {
            break;
        }
        assert!(Instant::now() < deadline, "a did not switch");
        thread::sleep(Duration::from_millis(1));
    }
    // a sends two messages at once, behind its RTR.
    let src = mr(&a, 4096);
    let data = pattern(64, 3);
    src.write(0, &data).unwrap();
    for (id, off) in [(1u64, 0usize), (2, 32)] {
        let sge = [src.sge(off, 32).unwrap()];
        a.qp.post_send(&SendWr::new(id, SendOp::Send).sg_list(&sge).signaled())
            .unwrap();
    }
    let s = wait(&a.cq, 2);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    // The RTR (a zero-length Write, 20 octets framed) and both Sends (32
    // octets of payload each, 56 framed) are in b's socket.
    wait_readable(&peek, 20 + 2 * 56);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cb.poll_switch().unwrap() {
        assert!(Instant::now() < deadline, "b did not switch");
        thread::sleep(Duration::from_millis(1));
    }
    let r = wait(&b.cq, 2);
    assert!(
        r.iter()
            .all(|w| w.status == WcStatus::Success && w.byte_len == 32),
        "{r:?}"
    );
    assert_eq!(r.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [100, 101]);
    let got = rb.to_vec();
    assert_eq!(got[..32], data[..32]);
    assert_eq!(got[1024..1056], data[32..]);
    // Nothing more: the octets were not given to the QP twice.
    thread::sleep(Duration::from_millis(50));
    let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
    assert_eq!(b.cq.poll(&mut wc), 0, "{:?}", &wc[..1]);
    assert_eq!(b.qp.state(), QpState::Rts);
    assert_eq!(got[2048..2080], [0u8; 32]);
    verify_rdma_after(&a, &b, &ra);
}

/// One more Send from b to a after the switch (the connection works both
/// ways).
fn verify_rdma_after(a: &Side, b: &Side, ra: &softrdma_engine::MemoryRegion) {
    let src = mr(b, 64);
    src.write(0, b"reply from b").unwrap();
    let sge = [src.sge(0, 12).unwrap()];
    b.qp.post_send(&SendWr::new(3, SendOp::Send).sg_list(&sge).signaled())
        .unwrap();
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    let r = wait(&a.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].wr_id, 100);
    assert_eq!(&ra.to_vec()[..12], b"reply from b");
}
