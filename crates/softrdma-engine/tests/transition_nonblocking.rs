//! The non-blocking stream-to-RDMA switch: both ends of one connection
//! switched from a single thread, each step driven by readiness.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::transition::{
    ConnState, MpaRole, StreamConnection, SwitchMode, TransitionError,
};
use softrdma_engine::{MemoryRegion, RecvWr, SendOp, SendWr, WcStatus};

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    (a, b)
}

/// Waits (a little) until one of the switches' sockets is ready.
fn wait_either(a: &StreamConnection, b: &StreamConnection) {
    let mut fds: Vec<Watched> = Vec::new();
    for c in [a, b] {
        if let Some(fd) = c.switch_fd() {
            fds.push(Watched {
                fd: fd.as_raw_fd(),
                write: c.switch_wants_write(),
            });
        }
    }
    let poller = polling::Poller::new().unwrap();
    for (i, p) in fds.iter().enumerate() {
        let ev = if p.write {
            polling::Event::writable(i)
        } else {
            polling::Event::readable(i)
        };
        // SAFETY: the descriptors stay open (their connections are
        // borrowed) until the poller is dropped at the end of this call.
        unsafe { poller.add(p.fd, ev) }.unwrap();
    }
    let mut events = polling::Events::new();
    poller
        .wait(&mut events, Some(Duration::from_millis(100)))
        .unwrap();
}

struct Watched {
    fd: i32,
    write: bool,
}

/// Switches both ends from this thread (each posts one 256-octet receive
/// from its region), driven by readiness.
fn switch_both(
    ca: &mut StreamConnection,
    cb: &mut StreamConnection,
    (a, b): (&Side, &Side),
    (ra, rb): (&MemoryRegion, &MemoryRegion),
) {
    ca.reserve(&a.qp).unwrap();
    cb.reserve(&b.qp).unwrap();
    ca.request_switch().unwrap();
    cb.request_switch().unwrap();
    let mut done_b = cb
        .post_recv_and_begin_switch(&RecvWr::new(100, &[rb.sge(0, 256).unwrap()]))
        .unwrap();
    let mut done_a = ca
        .post_recv_and_begin_switch(&RecvWr::new(100, &[ra.sge(0, 256).unwrap()]))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(done_a && done_b) {
        assert!(Instant::now() < deadline, "switch did not finish");
        wait_either(ca, cb);
        if !done_a {
            done_a = ca.poll_switch().unwrap();
        }
        if !done_b {
            done_b = cb.poll_switch().unwrap();
        }
    }
}

#[test]
fn both_ends_switch_without_blocking_from_one_thread() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 256);
    let rb = mr(&b, 256);
    let (sa, sb) = tcp_pair();
    let mut ca = StreamConnection::new(sa, SwitchMode::mpa(MpaRole::Initiator));
    let mut cb = StreamConnection::new(sb, SwitchMode::mpa(MpaRole::Responder));
    ca.write_all(b"LOGIN").unwrap();
    let mut m = [0u8; 5];
    cb.read_exact(&mut m).unwrap();
    assert_eq!(&m, b"LOGIN");
    ca.reserve(&a.qp).unwrap();
    cb.reserve(&b.qp).unwrap();
    ca.request_switch().unwrap();
    cb.request_switch().unwrap();
    // Neither call blocks: the responder's Request has not even been sent
    // when the responder starts.
    let mut done_b = cb
        .post_recv_and_begin_switch(&RecvWr::new(100, &[rb.sge(0, 256).unwrap()]))
        .unwrap();
    assert!(!done_b, "the responder cannot be done before the Request");
    assert_eq!(cb.state(), ConnState::Transitioning);
    let mut done_a = ca
        .post_recv_and_begin_switch(&RecvWr::new(100, &[ra.sge(0, 256).unwrap()]))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(done_a && done_b) {
        assert!(Instant::now() < deadline, "switch did not finish");
        wait_either(&ca, &cb);
        if !done_a {
            done_a = ca.poll_switch().unwrap();
        }
        if !done_b {
            done_b = cb.poll_switch().unwrap();
        }
    }
    assert_eq!(ca.state(), ConnState::Rdma);
    assert_eq!(cb.state(), ConnState::Rdma);
    assert!(ca.negotiated().is_some());
    // RDMA traffic over the switched connection.
    let src = mr(&a, 64);
    src.write(0, b"after switch").unwrap();
    a.qp.post_send(
        &SendWr::new(1, SendOp::Send)
            .sg_list(&[src.sge(0, 12).unwrap()])
            .signaled(),
    )
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    let r = wait(&b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success);
    assert_eq!(&rb.to_vec()[..12], b"after switch");
}

#[test]
fn nonblocking_switch_times_out_against_a_silent_peer() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let ra = mr(&a, 256);
    let (sa, _silent) = tcp_pair();
    let mut ca = StreamConnection::new(sa, SwitchMode::mpa(MpaRole::Initiator));
    ca.set_switch_timeout(Duration::from_millis(100));
    ca.reserve(&a.qp).unwrap();
    ca.request_switch().unwrap();
    let done = ca
        .post_recv_and_begin_switch(&RecvWr::new(1, &[ra.sge(0, 256).unwrap()]))
        .unwrap();
    assert!(!done);
    let deadline = Instant::now() + Duration::from_secs(10);
    let e = loop {
        match ca.poll_switch() {
            Ok(false) => {}
            Ok(true) => panic!("switched with a silent peer"),
            Err(e) => break e,
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(matches!(e, TransitionError::TimedOut), "{e:?}");
    assert_eq!(ca.state(), ConnState::Failed);
    // The pre-posted receive was flushed.
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::WrFlush);
}

/// The switch sets `TCP_NODELAY` and `O_NONBLOCK` itself, unless its
/// caller says the socket has them already
/// (`StreamConnection::socket_already_set`): then it leaves the socket's
/// options alone (a system call less for each). Here the initiator's
/// caller says so of a socket it made non-blocking but left without
/// `TCP_NODELAY` (which only costs latency): the option is still off after
/// the switch, and the connection works; the responder's is set as before.
#[test]
fn a_socket_said_to_be_set_is_left_alone_by_the_switch() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 256);
    let rb = mr(&b, 256);
    let (sa, sb) = tcp_pair();
    sa.set_nonblocking(true).unwrap();
    let (ka, kb) = (sa.try_clone().unwrap(), sb.try_clone().unwrap());
    assert!(!ka.nodelay().unwrap() && !kb.nodelay().unwrap());
    let mut ca = StreamConnection::new(sa, SwitchMode::mpa(MpaRole::Initiator));
    let mut cb = StreamConnection::new(sb, SwitchMode::mpa(MpaRole::Responder));
    ca.socket_already_set(true, true);
    switch_both(&mut ca, &mut cb, (&a, &b), (&ra, &rb));
    assert!(!ka.nodelay().unwrap(), "the switch set TCP_NODELAY again");
    assert!(kb.nodelay().unwrap());
    let src = mr(&a, 64);
    src.write(0, b"left alone").unwrap();
    a.qp.post_send(
        &SendWr::new(1, SendOp::Send)
            .sg_list(&[src.sge(0, 10).unwrap()])
            .signaled(),
    )
    .unwrap();
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(&rb.to_vec()[..10], b"left alone");
}

/// A caller that knows the peer's address (from its `accept` or its
/// `connect`) says so, and the QP takes it instead of asking the kernel
/// (`getpeername`, a system call less per switch). The address said here
/// is not the socket's, to tell where the QP's `peer` came from; the end
/// that said nothing gets the kernel's answer as before.
#[test]
fn a_peer_said_to_be_known_is_taken_without_asking_the_kernel() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let ra = mr(&a, 256);
    let rb = mr(&b, 256);
    let (sa, sb) = tcp_pair();
    let a_addr = sa.local_addr().unwrap();
    let said: std::net::SocketAddr = "192.0.2.7:4242".parse().unwrap();
    let mut ca = StreamConnection::new(sa, SwitchMode::mpa(MpaRole::Initiator));
    let mut cb = StreamConnection::new(sb, SwitchMode::mpa(MpaRole::Responder));
    ca.peer_already_known(said);
    switch_both(&mut ca, &mut cb, (&a, &b), (&ra, &rb));
    assert_eq!(a.qp.query().peer, Some(said), "the QP asked the kernel");
    assert_eq!(b.qp.query().peer, Some(a_addr));
}
