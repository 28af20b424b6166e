//! Connection manager over real loopback TCP: listen, connect, accept and
//! reject with private data, events (blocking, polling, eventfd), and the
//! handshakes that must fail without disturbing the listener.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::cm::{
    CmError, CmEvent, ConnectConfig, Connection, ListenConfig, Listener, connect,
};
use softrdma_engine::proto::mpa::{Initiator, MpaConfig, RtrOffer};
use softrdma_engine::{QpState, RecvWr, SendOp, SendWr, WcOpcode, WcStatus};

/// Generous limit: only to fail instead of hanging.
const T: Duration = Duration::from_secs(10);

fn listen(cfg: ListenConfig) -> Listener {
    Listener::bind("127.0.0.1:0", 16, cfg).expect("bind")
}

fn short_listen() -> Listener {
    listen(ListenConfig {
        handshake_timeout: Duration::from_millis(300),
        ..ListenConfig::default()
    })
}

fn cfg(private_data: &[u8]) -> ConnectConfig {
    ConnectConfig {
        private_data: private_data.to_vec(),
        timeout: T,
        ..ConnectConfig::default()
    }
}

/// Sends `msg` from `a` to `b` and checks it arrived.
fn send_recv(a: &Side, b: &Side, msg: &[u8]) {
    let src = mr(a, 256);
    let dst = mr(b, 256);
    src.write(0, msg).unwrap();
    b.qp.post_recv(&RecvWr::new(7, &[dst.sge(0, 256).unwrap()]))
        .unwrap();
    a.qp.post_send(
        &SendWr::new(1, SendOp::Send)
            .sg_list(&[src.sge(0, msg.len() as u32).unwrap()])
            .signaled(),
    )
    .unwrap();
    let s = wait(&a.cq, 1);
    assert_eq!(s[0].status, WcStatus::Success, "{s:?}");
    let r = wait(&b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].byte_len as usize, msg.len());
    assert_eq!(&dst.to_vec()[..msg.len()], msg);
}

/// The next listener event, which must be an error; returns its reason.
fn listener_error(l: &Listener) -> String {
    match l.wait_event(Some(T)) {
        Some(CmEvent::Error { reason, .. }) => reason,
        other => panic!("expected a listener error, got {other:?}"),
    }
}

/// The peer end of a connection the listener ended: reads until EOF/reset.
fn assert_closed(mut s: TcpStream) {
    s.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 512];
    let start = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => assert!(start.elapsed() < T, "connection not closed"),
        }
    }
}

/// Connects a good client to `l` and accepts it with `server`; checks a
/// Send both ways.
fn good_client(l: &Listener, dev: &softrdma_engine::Device) {
    let a = side(dev, |_| {});
    let b = side(dev, |_| {});
    let addr = l.local_addr();
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"good")).map(|_| ()));
    let req = l.get_request(Some(T)).expect("request");
    assert_eq!(req.private_data(), b"good");
    let _conn = req.accept(&b.qp, b"ok", 4, 4).expect("accept");
    h.join().unwrap().expect("connect");
    send_recv(&a, &b, b"ping");
    send_recv(&b, &a, b"pong");
}

#[test]
fn connect_accept_private_data_ird_ord_send_recv_and_disconnect() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = listen(ListenConfig::default());
    let addr = l.local_addr();

    let qp = a.qp.clone();
    let client = thread::spawn(move || {
        let mut c = cfg(b"hello from the initiator");
        c.mpa.ird = 4;
        c.mpa.ord = 8;
        connect(&qp, addr, &c)
    });
    let req = l.get_request(Some(T)).expect("request");
    assert_eq!(req.private_data(), b"hello from the initiator");
    assert_eq!(req.ird(), Some(4));
    assert_eq!(req.ord(), Some(8));
    assert!(!req.crc());
    assert_eq!(req.rtr_offer(), None);
    assert!(req.peer_addr().ip().is_loopback());
    let server = req
        .accept(&b.qp, b"hello from the responder", 8, 2)
        .expect("accept");
    let client = client.join().unwrap().expect("connect");

    assert_eq!(
        client.peer_private_data().as_deref(),
        Some(&b"hello from the responder"[..])
    );
    assert_eq!(
        server.peer_private_data().as_deref(),
        Some(&b"hello from the initiator"[..])
    );
    let cn = client.negotiated().unwrap();
    assert_eq!((cn.ird, cn.ord), (4, 8));
    assert_eq!((cn.peer_ird, cn.peer_ord), (Some(8), Some(2)));
    let sn = server.negotiated().unwrap();
    assert_eq!((sn.ird, sn.ord), (8, 2));
    assert_eq!((sn.peer_ird, sn.peer_ord), (Some(4), Some(8)));
    assert_eq!(client.peer_addr(), Some(addr));
    assert!(matches!(
        client.try_event(),
        Some(CmEvent::Established { peer }) if peer == addr
    ));
    assert!(matches!(
        server.wait_event(Some(T)),
        Some(CmEvent::Established { .. })
    ));
    assert_eq!(a.qp.state(), QpState::Rts);
    assert_eq!(b.qp.state(), QpState::Rts);

    send_recv(&a, &b, b"initiator to responder");
    send_recv(&b, &a, b"responder to initiator");

    client.disconnect().expect("disconnect");
    assert_eq!(
        client.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: true })
    );
    assert_eq!(
        server.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: true })
    );
    assert!(client.try_event().is_none());
}

#[test]
fn peer_to_peer_mode_with_crc() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = listen(ListenConfig::default());
    let addr = l.local_addr();
    let qp = a.qp.clone();
    let client = thread::spawn(move || {
        let mut c = cfg(b"p2p");
        c.mpa.peer_to_peer = Some(RtrOffer::WRITE_READ);
        c.mpa.crc = softrdma_engine::proto::mpa::CrcPolicy::Required;
        connect(&qp, addr, &c)
    });
    let req = l.get_request(Some(T)).expect("request");
    assert_eq!(req.rtr_offer(), Some(RtrOffer::WRITE_READ));
    assert!(req.crc());
    let server = req.accept(&b.qp, b"", 16, 16).expect("accept");
    let client = client.join().unwrap().expect("connect");
    assert!(client.negotiated().unwrap().rtr.is_some());
    assert!(server.negotiated().unwrap().crc);
    send_recv(&a, &b, b"after the RTR");
    send_recv(&b, &a, b"and back");
    assert!(matches!(
        server.try_event(),
        Some(CmEvent::Established { .. })
    ));
    server.abort();
    assert_eq!(
        server.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: false })
    );
    assert!(matches!(
        client.wait_event(Some(T)),
        Some(CmEvent::Established { .. })
    ));
    assert_eq!(
        client.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: false })
    );
}

#[test]
fn reject_with_private_data() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let l = listen(ListenConfig::default());
    let addr = l.local_addr();
    let h = thread::spawn(move || {
        let req = l.get_request(Some(T)).expect("request");
        assert_eq!(req.private_data(), b"let me in");
        req.reject(b"go away").expect("reject");
        let req = l.get_request(Some(T)).expect("second request");
        req.reject(b"still no").expect("reject");
    });
    match connect(&a.qp, addr, &cfg(b"let me in")) {
        Err(CmError::Rejected { private_data }) => assert_eq!(private_data, b"go away"),
        other => panic!("expected a reject, got {other:?}"),
    }
    assert_eq!(a.qp.state(), QpState::Idle);
    // The same through events.
    let c = Connection::start(&a.qp, addr, cfg(b"let me in")).unwrap();
    assert_eq!(
        c.wait_event(Some(T)),
        Some(CmEvent::Rejected {
            private_data: b"still no".to_vec()
        })
    );
    h.join().unwrap();
}

#[test]
fn connect_to_closed_port_is_unreachable() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let addr = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    assert!(matches!(
        connect(&a.qp, addr, &cfg(b"")),
        Err(CmError::Unreachable(_))
    ));
    let c = Connection::start(&a.qp, addr, cfg(b"")).unwrap();
    // Refused (nobody listens), told apart from no route or no answer.
    assert_eq!(c.wait_event(Some(T)), Some(CmEvent::Refused));
    assert_eq!(a.qp.state(), QpState::Idle);
}

#[test]
fn connect_times_out_against_a_silent_peer() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    // Accepts TCP (the kernel does) but never answers the Request.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = silent.local_addr().unwrap();
    let mut c = cfg(b"anyone?");
    c.timeout = Duration::from_millis(200);
    let start = Instant::now();
    assert!(matches!(connect(&a.qp, addr, &c), Err(CmError::TimedOut)));
    assert!(start.elapsed() < T);
    let conn = Connection::start(&a.qp, addr, c).unwrap();
    assert_eq!(conn.wait_event(Some(T)), Some(CmEvent::TimedOut));
    assert_eq!(a.qp.state(), QpState::Idle);
}

#[test]
fn silent_client_times_out_while_others_are_served() {
    let dev = device(false);
    let l = short_listen();
    let silent = TcpStream::connect(l.local_addr()).unwrap();
    good_client(&l, &dev);
    let reason = listener_error(&l);
    assert!(reason.contains("timed out"), "{reason}");
    assert_closed(silent);
    good_client(&l, &dev);
}

#[test]
fn garbage_handshake_ends_that_connection_only() {
    let dev = device(false);
    let l = short_listen();
    let mut bad = TcpStream::connect(l.local_addr()).unwrap();
    bad.write_all(&[0xA5; 64]).unwrap();
    let reason = listener_error(&l);
    assert!(reason.contains("MPA"), "{reason}");
    assert_closed(bad);
    // Connect, then close at once.
    drop(TcpStream::connect(l.local_addr()).unwrap());
    let reason = listener_error(&l);
    assert!(reason.contains("closed"), "{reason}");
    good_client(&l, &dev);
    assert!(l.try_event().is_none());
}

#[test]
fn slow_drip_handshake_runs_out_of_time() {
    let dev = device(false);
    let l = short_listen();
    let mut request = Initiator::new(MpaConfig::default(), &[7u8; 200]).unwrap();
    let bytes = request.transmit().to_vec();
    request.consumed(bytes.len());
    let mut drip = TcpStream::connect(l.local_addr()).unwrap();
    drip.set_nodelay(true).unwrap();
    let reader = drip.try_clone().unwrap();
    let dripper = thread::spawn(move || {
        for b in bytes {
            if drip.write_all(&[b]).is_err() {
                return true;
            }
            thread::sleep(Duration::from_millis(20));
        }
        false
    });
    good_client(&l, &dev);
    let reason = listener_error(&l);
    assert!(reason.contains("timed out"), "{reason}");
    assert_closed(reader);
    assert!(
        dripper.join().unwrap(),
        "the dripped request was not cut off"
    );
    assert!(l.try_get_request().is_none());
}

#[test]
fn oversized_private_data_is_rejected_cleanly() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = listen(ListenConfig {
        private_data_cap: 16,
        ..ListenConfig::default()
    });
    let addr = l.local_addr();
    // More than the listener takes: a reject without private data.
    match connect(&a.qp, addr, &cfg(&[1u8; 100])) {
        Err(CmError::Rejected { private_data }) => assert!(private_data.is_empty()),
        other => panic!("expected a reject, got {other:?}"),
    }
    let reason = listener_error(&l);
    assert!(reason.contains("private data"), "{reason}");
    // More than this side may send: refused before connecting.
    assert!(matches!(
        connect(&a.qp, addr, &cfg(&[1u8; 300])),
        Err(CmError::Config(_))
    ));
    // An answer over the cap is refused locally.
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"small")));
    let req = l.get_request(Some(T)).expect("request");
    assert!(matches!(
        req.accept(&b.qp, &[2u8; 17], 4, 4),
        Err(CmError::Config(_))
    ));
    assert!(h.join().unwrap().is_err());
    assert_eq!(b.qp.state(), QpState::Idle);
    good_client(&l, &dev);
}

#[test]
fn events_on_pollable_fds() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = listen(ListenConfig::default());
    let poller = polling::Poller::new().unwrap();
    let mut events = polling::Events::new();

    // SAFETY: the listener outlives the registration, deleted below.
    unsafe { poller.add(&l.fd(), polling::Event::readable(1)) }.unwrap();
    poller
        .wait(&mut events, Some(Duration::from_millis(5)))
        .unwrap();
    assert!(events.is_empty());

    let conn = Connection::start(&a.qp, l.local_addr(), cfg(b"evented")).unwrap();
    // SAFETY: the connection outlives the registration, deleted below.
    unsafe { poller.add(&conn.fd(), polling::Event::readable(2)) }.unwrap();

    events.clear();
    poller.wait(&mut events, Some(T)).unwrap();
    assert_eq!(events.iter().next().map(|e| e.key), Some(1));
    let req = l.try_get_request().expect("request ready");
    assert!(l.try_get_request().is_none());
    let server = req.accept(&b.qp, b"", 4, 4).unwrap();

    // The listener's fd is drained; the connection's becomes readable.
    poller.delete(l.fd()).unwrap();
    events.clear();
    poller.wait(&mut events, Some(T)).unwrap();
    assert_eq!(events.iter().next().map(|e| e.key), Some(2));
    assert!(matches!(
        conn.try_event(),
        Some(CmEvent::Established { .. })
    ));
    assert!(conn.try_event().is_none());
    poller.delete(conn.as_fd()).unwrap();
    assert!(!poll_readable(&conn), "fd readable with no event queued");
    drop(server);
    send_recv(&a, &b, b"evented send");
}

fn poll_readable(c: &Connection) -> bool {
    let poller = polling::Poller::new().unwrap();
    // SAFETY: `c` outlives the poller and the registration.
    unsafe { poller.add(&c.fd(), polling::Event::readable(0)) }.unwrap();
    let mut events = polling::Events::new();
    poller
        .wait(&mut events, Some(Duration::from_millis(5)))
        .unwrap();
    poller.delete(c.fd()).unwrap();
    !events.is_empty()
}

#[test]
fn connect_by_host_name() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = listen(ListenConfig::default());
    let port = l.local_addr().port();
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, format!("localhost:{port}"), &cfg(b"by name")));
    let req = l.get_request(Some(T)).expect("request");
    assert_eq!(req.private_data(), b"by name");
    let _server = req.accept(&b.qp, b"", 4, 4).unwrap();
    let client = h.join().unwrap().expect("connect");
    assert_eq!(
        client.peer_addr(),
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    );
    send_recv(&a, &b, b"named");
    let c = side(&dev, |_| {});
    assert!(matches!(
        connect(&c.qp, "no-such-host.invalid:1", &cfg(b"")),
        Err(CmError::Resolve(_))
    ));
}

#[test]
fn oversized_length_in_header_is_refused() {
    let dev = device(false);
    let l = short_listen();
    let mut request = Initiator::new(MpaConfig::default(), b"").unwrap();
    let mut bytes = request.transmit().to_vec();
    request.consumed(bytes.len());
    // Private data length (octets 18..20 of the frame header): 0xFFFF.
    bytes[18] = 0xFF;
    bytes[19] = 0xFF;
    let mut bad = TcpStream::connect(l.local_addr()).unwrap();
    bad.write_all(&bytes[..20]).unwrap();
    let reason = listener_error(&l);
    assert!(reason.contains("private data"), "{reason}");
    assert_closed(bad);
    good_client(&l, &dev);
}

#[test]
fn backlog_bounds_pending_handshakes_and_is_freed() {
    let dev = device(false);
    let l = Listener::bind(
        "127.0.0.1:0",
        1,
        ListenConfig {
            handshake_timeout: Duration::from_millis(300),
            ..ListenConfig::default()
        },
    )
    .unwrap();
    // The first connection holds the only slot until it times out.
    let silent = TcpStream::connect(l.local_addr()).unwrap();
    let refused = TcpStream::connect(l.local_addr()).unwrap();
    assert_closed(refused);
    let reason = listener_error(&l);
    assert!(reason.contains("timed out"), "{reason}");
    assert_closed(silent);
    // The slot is free again.
    good_client(&l, &dev);
    good_client(&l, &dev);
}

#[test]
fn revision_1_listener_and_busy_qp() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let mut lc = ListenConfig::default();
    lc.mpa.revision = 1;
    let l = listen(lc);
    let addr = l.local_addr();
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"v2 asks")));
    let req = l.get_request(Some(T)).expect("request");
    assert_eq!(req.request().revision, 2);
    let server = req.accept(&b.qp, b"v1 answers", 4, 4).expect("accept");
    let client = h.join().unwrap().expect("connect");
    assert_eq!(client.negotiated().unwrap().revision, 1);
    assert_eq!(server.negotiated().unwrap().peer_ird, None);
    send_recv(&a, &b, b"revision 1");

    // A QP already connected cannot take another connection.
    let c = side(&dev, |_| {});
    let qp = c.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"")));
    let req = l.get_request(Some(T)).expect("request");
    assert!(matches!(req.accept(&b.qp, b"", 4, 4), Err(CmError::Qp(_))));
    assert!(h.join().unwrap().is_err());
    assert_eq!(c.qp.state(), QpState::Idle);
}

#[test]
fn dropping_the_listener_closes_what_it_holds() {
    let l = listen(ListenConfig {
        handshake_timeout: Duration::from_secs(600),
        ..ListenConfig::default()
    });
    let addr = l.local_addr();
    let in_handshake = TcpStream::connect(addr).unwrap();
    let request = Initiator::new(MpaConfig::default(), b"queued").unwrap();
    let bytes = request.transmit().to_vec();
    let mut queued = TcpStream::connect(addr).unwrap();
    queued.write_all(&bytes).unwrap();
    let deadline = Instant::now() + T;
    while l.pending_requests() == 0 {
        assert!(Instant::now() < deadline);
        thread::sleep(Duration::from_millis(1));
    }
    drop(l);
    assert_closed(queued);
    // The handshake in progress is ended long before its timeout.
    assert_closed(in_handshake);
    assert!(TcpStream::connect(addr).is_err());
}
