//! The CM reactor: the bound on handshakes in progress, deadlines kept
//! without a thread, non-blocking connect/accept/reject, disconnect events
//! without polling, and error texts that name the cause.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::cm::{
    CmError, CmEvent, ConnectConfig, Connection, ListenConfig, Listener, connect,
};
use softrdma_engine::proto::mpa::{Initiator, MpaConfig};
use softrdma_engine::{QpState, RecvWr, SendOp, SendWr, WcStatus};

const T: Duration = Duration::from_secs(10);

fn cfg(private_data: &[u8]) -> ConnectConfig {
    ConnectConfig {
        private_data: private_data.to_vec(),
        timeout: T,
        ..ConnectConfig::default()
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + T;
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        thread::sleep(Duration::from_millis(2));
    }
}

/// Whether the listener closed `s` (EOF or reset), waiting up to `t`.
fn closed_within(s: &mut TcpStream, t: Duration) -> bool {
    s.set_read_timeout(Some(t)).unwrap();
    let mut buf = [0u8; 64];
    match s.read(&mut buf) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => !matches!(
            e.kind(),
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
        ),
    }
}

fn listener_error(l: &Listener) -> String {
    match l.wait_event(Some(T)) {
        Some(CmEvent::Error { reason, .. }) => reason,
        other => panic!("expected a listener error, got {other:?}"),
    }
}

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
    assert_eq!(wait(&a.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(&dst.to_vec()[..msg.len()], msg);
}

#[test]
fn handshake_limit_drops_the_oldest_silent_connection() {
    let dev = device(false);
    let l = Listener::bind(
        "127.0.0.1:0",
        4,
        ListenConfig {
            handshake_timeout: Duration::from_secs(600),
            max_handshakes: 4,
            ..ListenConfig::default()
        },
    )
    .unwrap();
    let addr = l.local_addr();
    let mut request = Initiator::new(MpaConfig::default(), b"slow").unwrap();
    let bytes = request.transmit().to_vec();
    request.consumed(bytes.len());
    // The oldest has sent part of a Request: it is not silent.
    let mut talker = TcpStream::connect(addr).unwrap();
    talker.write_all(&bytes[..8]).unwrap();
    wait_until("talker in handshake", || l.handshakes_in_progress() == 1);
    let mut silent: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
    wait_until("4 in handshake", || l.handshakes_in_progress() == 4);
    // A fifth connection: the oldest silent one makes room.
    let _fifth = TcpStream::connect(addr).unwrap();
    let reason = listener_error(&l);
    assert!(reason.contains("limit"), "{reason}");
    assert!(
        closed_within(&mut silent[0], T),
        "oldest silent not dropped"
    );
    assert!(!closed_within(&mut talker, Duration::from_millis(50)));
    assert!(!closed_within(&mut silent[1], Duration::from_millis(50)));
    assert_eq!(l.handshakes_in_progress(), 4);
    // The talker may still finish its Request and be served.
    talker.write_all(&bytes[8..]).unwrap();
    let req = l.get_request(Some(T)).expect("talker's request");
    assert_eq!(req.private_data(), b"slow");
    assert_eq!(l.handshakes_in_progress(), 3);
    // A real client gets in at the limit too.
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let _more: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"real")));
    let req = l.get_request(Some(T)).expect("real client's request");
    assert_eq!(req.private_data(), b"real");
    let _server = req.accept(&b.qp, b"", 4, 4).unwrap();
    h.join().unwrap().expect("connect");
    send_recv(&a, &b, b"through");
}

#[test]
fn backlog_counts_only_completed_handshakes() {
    let dev = device(false);
    let l = Listener::bind("127.0.0.1:0", 1, ListenConfig::default()).unwrap();
    let addr = l.local_addr();
    // Silent connections do not take the backlog's one slot.
    let _silent: Vec<TcpStream> = (0..8).map(|_| TcpStream::connect(addr).unwrap()).collect();
    wait_until("8 in handshake", || l.handshakes_in_progress() == 8);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"first")));
    wait_until("queued", || l.pending_requests() == 1);
    // A second completed Request is over the backlog: closed at once.
    let request = Initiator::new(MpaConfig::default(), b"second").unwrap();
    let mut second = TcpStream::connect(addr).unwrap();
    second.write_all(request.transmit()).unwrap();
    let reason = listener_error(&l);
    assert!(reason.contains("backlog"), "{reason}");
    assert!(closed_within(&mut second, T));
    let req = l.get_request(Some(T)).unwrap();
    let _server = req.accept(&b.qp, b"", 4, 4).unwrap();
    h.join().unwrap().expect("connect");
}

#[test]
fn handshake_deadline_expires_on_the_reactor() {
    let l = Listener::bind(
        "127.0.0.1:0",
        4,
        ListenConfig {
            handshake_timeout: Duration::from_millis(200),
            ..ListenConfig::default()
        },
    )
    .unwrap();
    let mut silent = TcpStream::connect(l.local_addr()).unwrap();
    wait_until("in handshake", || l.handshakes_in_progress() == 1);
    let reason = listener_error(&l);
    assert!(
        reason.contains("timed out: TCP connected but no MPA request within 0.2 s"),
        "{reason}"
    );
    assert!(closed_within(&mut silent, T));
    assert_eq!(l.handshakes_in_progress(), 0);
}

#[test]
fn nonblocking_connect_accept_and_disconnect_events() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = Listener::bind("127.0.0.1:0", 4, ListenConfig::default()).unwrap();
    // Connect and accept from one thread, nothing blocks.
    let client = Connection::start(&a.qp, l.local_addr(), cfg(b"nb")).unwrap();
    let mut req = None;
    wait_until("request", || {
        req = l.try_get_request();
        req.is_some()
    });
    let req = req.unwrap();
    assert_eq!(req.private_data(), b"nb");
    let server = req.accept_nonblocking(&b.qp, b"welcome", 4, 4).unwrap();
    let mut got = (None, None);
    wait_until("both established", || {
        if got.0.is_none() {
            got.0 = client.try_event();
        }
        if got.1.is_none() {
            got.1 = server.try_event();
        }
        got.0.is_some() && got.1.is_some()
    });
    assert!(
        matches!(got.0, Some(CmEvent::Established { .. })),
        "{got:?}"
    );
    assert!(
        matches!(got.1, Some(CmEvent::Established { .. })),
        "{got:?}"
    );
    assert_eq!(client.peer_private_data().unwrap(), b"welcome");
    send_recv(&a, &b, b"nonblocking");
    // Disconnect is reported on both sides from the QPs' own state
    // changes.
    client.disconnect().unwrap();
    assert_eq!(
        client.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: true })
    );
    assert!(matches!(
        server.wait_event(Some(T)),
        Some(CmEvent::Disconnected { .. })
    ));
    assert!(client.try_event().is_none());
}

#[test]
fn abort_is_reported_as_an_abortive_disconnect() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let l = Listener::bind("127.0.0.1:0", 4, ListenConfig::default()).unwrap();
    let client = Connection::start(&a.qp, l.local_addr(), cfg(b"")).unwrap();
    let server = l
        .get_request(Some(T))
        .unwrap()
        .accept(&b.qp, b"", 4, 4)
        .unwrap();
    assert!(matches!(
        client.wait_event(Some(T)),
        Some(CmEvent::Established { .. })
    ));
    server.abort();
    assert_eq!(
        client.wait_event(Some(T)),
        Some(CmEvent::Disconnected { graceful: false })
    );
    assert_eq!(a.qp.state(), QpState::Error);
}

#[test]
fn nonblocking_reject_carries_the_reason() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let l = Listener::bind("127.0.0.1:0", 4, ListenConfig::default()).unwrap();
    let client = Connection::start(&a.qp, l.local_addr(), cfg(b"let me in")).unwrap();
    let req = l.get_request(Some(T)).unwrap();
    req.reject_nonblocking(b"server full").unwrap();
    assert_eq!(
        client.wait_event(Some(T)),
        Some(CmEvent::Rejected {
            private_data: b"server full".to_vec()
        })
    );
    assert_eq!(
        client.failure().as_deref(),
        Some("rejected: \"server full\"")
    );
    // The blocking form says the same.
    let qp = a.qp.clone();
    let addr = l.local_addr();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"again")));
    l.get_request(Some(T))
        .unwrap()
        .reject(b"still full")
        .unwrap();
    let e = h.join().unwrap().unwrap_err();
    assert!(matches!(&e, CmError::Rejected { private_data } if private_data == b"still full"));
    assert_eq!(e.to_string(), "rejected: \"still full\"");
}

/// A plain TCP server that answers whatever it gets with `answer`.
fn fake_server(answer: &'static [u8]) -> std::net::SocketAddr {
    let srv = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = srv.local_addr().unwrap();
    thread::spawn(move || {
        for s in srv.incoming().take(2) {
            let Ok(mut s) = s else { return };
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
            let _ = s.write_all(answer);
            thread::sleep(Duration::from_millis(200));
        }
    });
    addr
}

#[test]
fn error_text_names_a_peer_that_is_not_mpa() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let addr = fake_server(b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
    let e = connect(&a.qp, addr, &cfg(b"")).unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with(
            "the peer is not an iWARP/MPA endpoint: it answered with text starting `HTTP/1.0"
        ),
        "{text}"
    );
    assert!(!text.contains("MPA negotiation: MPA negotiation"), "{text}");
    let c = Connection::start(&a.qp, addr, cfg(b"")).unwrap();
    match c.wait_event(Some(T)) {
        Some(CmEvent::Error { reason, .. }) => assert!(
            reason.contains("not an iWARP/MPA endpoint: it answered with text starting `HTTP/1.0"),
            "{reason}"
        ),
        other => panic!("{other:?}"),
    }
}

#[test]
fn error_text_names_a_silent_peer_and_a_closing_peer() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = cfg(b"");
    c.timeout = Duration::from_millis(200);
    let conn = Connection::start(&a.qp, silent.local_addr().unwrap(), c).unwrap();
    assert_eq!(conn.wait_event(Some(T)), Some(CmEvent::TimedOut));
    assert_eq!(
        conn.failure().as_deref(),
        Some("TCP connected but no MPA reply within 0.2 s")
    );
    // A peer that closes at once.
    let closer = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closer.local_addr().unwrap();
    thread::spawn(move || {
        for s in closer.incoming().take(2) {
            drop(s);
        }
    });
    let e = connect(&a.qp, addr, &cfg(b"")).unwrap_err();
    assert!(matches!(e, CmError::PeerClosed), "{e:?}");
    assert_eq!(e.to_string(), "the peer closed the connection");
    let conn = Connection::start(&a.qp, addr, cfg(b"")).unwrap();
    match conn.wait_event(Some(T)) {
        Some(CmEvent::Error { reason, .. }) => {
            assert!(
                reason.starts_with("the peer closed the connection"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn nonblocking_peer_to_peer_with_read_rtr_on_the_reactor() {
    use softrdma_engine::proto::mpa::RtrOffer;
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let mut lc = ListenConfig::default();
    lc.mpa.peer_to_peer = Some(RtrOffer::only(softrdma_engine::proto::rtr::RtrKind::Read));
    let l = Listener::bind("127.0.0.1:0", 4, lc).unwrap();
    let mut c = cfg(b"p2p");
    c.mpa.peer_to_peer = Some(RtrOffer::only(softrdma_engine::proto::rtr::RtrKind::Read));
    // Both sides on the reactor: the client's RTR Read and the server's
    // zero-length Read Response.
    let client = Connection::start(&a.qp, l.local_addr(), c).unwrap();
    let req = l.get_request(Some(T)).unwrap();
    assert_eq!(
        req.rtr_offer(),
        Some(RtrOffer::only(softrdma_engine::proto::rtr::RtrKind::Read))
    );
    let server = req.accept_nonblocking(&b.qp, b"", 4, 4).unwrap();
    assert!(matches!(
        server.wait_event(Some(T)),
        Some(CmEvent::Established { .. })
    ));
    assert!(matches!(
        client.wait_event(Some(T)),
        Some(CmEvent::Established { .. })
    ));
    assert_eq!(
        client.negotiated().unwrap().rtr,
        Some(softrdma_engine::proto::rtr::RtrKind::Read)
    );
    send_recv(&a, &b, b"after a Read RTR");
    send_recv(&b, &a, b"and back");
}

#[test]
fn nonblocking_accept_times_out_waiting_for_the_rtr() {
    use softrdma_engine::proto::mpa::RtrOffer;
    let dev = device(false);
    let b = side(&dev, |_| {});
    let lc = ListenConfig {
        handshake_timeout: Duration::from_millis(200),
        ..ListenConfig::default()
    };
    let l = Listener::bind("127.0.0.1:0", 4, lc).unwrap();
    // A client that asks for peer-to-peer mode and never sends its RTR.
    let request = Initiator::new(
        MpaConfig {
            peer_to_peer: Some(RtrOffer::only(softrdma_engine::proto::rtr::RtrKind::Write)),
            ..MpaConfig::default()
        },
        b"",
    )
    .unwrap();
    let mut s = TcpStream::connect(l.local_addr()).unwrap();
    s.write_all(request.transmit()).unwrap();
    let req = l.get_request(Some(T)).unwrap();
    let server = req.accept_nonblocking(&b.qp, b"", 4, 4).unwrap();
    assert_eq!(server.wait_event(Some(T)), Some(CmEvent::TimedOut));
    assert_eq!(
        server.failure().as_deref(),
        Some("TCP connected but no RTR (ready-to-receive) message within 0.2 s")
    );
    assert_eq!(b.qp.state(), QpState::Idle);
    // The connection was closed: the Reply, then the end of the stream.
    s.set_read_timeout(Some(T)).unwrap();
    let mut rest = Vec::new();
    if let Err(e) = s.read_to_end(&mut rest) {
        assert!(
            !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
            "connection left open: {e}"
        );
    }
}

/// A listener whose accept queue is full: the kernel drops further SYNs,
/// so a connect to it gets no TCP connection at all.
fn full_listener() -> (socket2::Socket, Vec<TcpStream>) {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(
        &"127.0.0.1:0"
            .parse::<std::net::SocketAddr>()
            .unwrap()
            .into(),
    )
    .unwrap();
    s.listen(0).unwrap();
    let addr = s.local_addr().unwrap().as_socket().unwrap();
    let mut fill = Vec::new();
    for _ in 0..2 {
        let c = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        c.set_nonblocking(true).unwrap();
        let _ = c.connect(&addr.into());
        fill.push(TcpStream::from(c));
    }
    thread::sleep(Duration::from_millis(50));
    (s, fill)
}

#[test]
fn tcp_connect_timeout_names_the_address_and_time() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let (l, _fill) = full_listener();
    let addr = l.local_addr().unwrap().as_socket().unwrap();
    let mut c = cfg(b"");
    c.timeout = Duration::from_millis(300);
    let e = connect(&a.qp, addr, &c).unwrap_err();
    let text = e.to_string();
    if !matches!(e, CmError::Unreachable(_)) {
        eprintln!("fallback: {text}");
        // The kernel accepted the SYN after all (backlog handling varies):
        // then it is the MPA timeout.
        assert!(matches!(e, CmError::TimedOut), "{e:?}");
        return;
    }
    assert_eq!(
        text,
        format!("peer unreachable: no TCP connection to {addr} within 0.3 s")
    );
    let conn = Connection::start(&a.qp, addr, c).unwrap();
    assert_eq!(conn.wait_event(Some(T)), Some(CmEvent::Unreachable));
    assert_eq!(
        conn.failure(),
        Some(format!(
            "peer unreachable: no TCP connection to {addr} within 0.3 s"
        ))
    );
}

#[test]
fn garbage_and_slow_drip_clients_in_numbers_leave_real_clients_served() {
    let dev = device(false);
    let l = Listener::bind("127.0.0.1:0", 8, ListenConfig::default()).unwrap();
    let addr = l.local_addr();
    let mut request = Initiator::new(MpaConfig::default(), b"drip").unwrap();
    let bytes = request.transmit().to_vec();
    request.consumed(bytes.len());
    // 30 garbage senders, 30 text (HTTP) senders, 30 slow drippers.
    let mut bad: Vec<TcpStream> = Vec::new();
    for i in 0..60 {
        let mut s = TcpStream::connect(addr).unwrap();
        if i < 30 {
            s.write_all(&[0xA5; 64]).unwrap();
        } else {
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        }
        bad.push(s);
    }
    let mut drip: Vec<TcpStream> = (0..30)
        .map(|_| {
            let s = TcpStream::connect(addr).unwrap();
            s.set_nodelay(true).unwrap();
            s
        })
        .collect();
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let qp = a.qp.clone();
    let h = thread::spawn(move || connect(&qp, addr, &cfg(b"real")));
    // The drippers send a few octets each while the real client connects.
    for k in 0..5 {
        for s in &mut drip {
            s.write_all(&bytes[k..k + 1]).unwrap();
        }
        thread::sleep(Duration::from_millis(10));
    }
    let req = l.get_request(Some(T)).expect("real client served");
    assert_eq!(req.private_data(), b"real");
    let _server = req.accept(&b.qp, b"", 4, 4).unwrap();
    h.join().unwrap().expect("connect");
    // Every garbage and text sender was refused with a reason naming it.
    let mut not_mpa = 0;
    while not_mpa < 60 {
        let reason = listener_error(&l);
        assert!(reason.contains("not an iWARP/MPA endpoint"), "{reason}");
        not_mpa += 1;
    }
    for s in &mut bad {
        assert!(closed_within(s, T));
    }
    // The drippers are still in their handshakes, and end when they close.
    assert_eq!(l.handshakes_in_progress(), 30);
    drop(drip);
    wait_until("drippers gone", || l.handshakes_in_progress() == 0);
}
