//! The switch: detection, fallback matrix, dual listen, malformed peers.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, UdpSocket};
use std::thread;
use std::time::Duration;

use softrdma_sockets::detect::{Kind, Probe};
use softrdma_sockets::{Config, Mode, PlainReason, TcpListener, TcpStream, Transport, external};

const BANNER: &[u8] = b"220 server speaks first\r\n";

/// A TCP listener and a UDP socket on the same loopback port (a fake
/// capability twin or a query sink). The TCP port the kernel picks may be
/// taken for UDP (another test's twin): then try another. So is a port
/// this process still remembers an answer for (an earlier test's server
/// had it: plain, or a twin deciding late queries, cached per destination
/// for `NEGATIVE_TTL`): a client would not ask the fake as the test
/// expects, but connect plain at once, or send its query beside the SYN.
fn tcp_and_udp_on_one_port() -> (std::net::TcpListener, UdpSocket, SocketAddr) {
    for _ in 0..64 {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        if external::known_plain(addr) || external::known_late_queries(addr) {
            continue;
        }
        match UdpSocket::bind(addr) {
            Ok(u) => return (l, u, addr),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => continue,
            Err(e) => panic!("udp bind {addr}: {e}"),
        }
    }
    panic!("no loopback port free for both TCP and UDP in 64 tries");
}

/// Server side of a session: banner first, then echo until EOF.
/// Auto mode with a capability query that waits long enough for a
/// listener's answer on a loaded machine (the default 50 ms gives up and
/// connects plain, as it should, but these tests expect an offload).
fn patient() -> Config {
    let mut cfg = Config::default();
    cfg.probe_timeout = Duration::from_secs(5);
    cfg
}

fn serve<S: Read + Write>(s: S) {
    common::serve(s, BANNER);
}

/// A twin's side of one capability query on `twin`: answers Accept.
fn accept_one_query(twin: &UdpSocket) {
    let mut b = [0u8; 64];
    let (n, from) = twin.recv_from(&mut b).unwrap();
    let q = Probe::decode(&b[..n]).unwrap();
    let a = Probe {
        kind: Kind::Accept,
        ..q
    };
    twin.send_to(&a.encode(), from).unwrap();
}

/// Client side: read the banner, send data, half-close, read the echo.
fn session<S: Read + Write>(s: S, half_close: impl FnOnce(&S)) {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7 + i / 251) as u8).collect();
    common::session(s, BANNER, &data, 50_000, half_close);
}

#[test]
fn offload_client_offload_server() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        assert!(s.transport().is_offloaded(), "{}", s.transport());
        serve(s);
    });
    let c = TcpStream::connect_with(addr, &patient()).unwrap();
    assert!(c.transport().is_offloaded(), "{}", c.transport());
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    t.join().unwrap();
}

#[test]
fn offload_client_plain_server_speaks_first() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        // Exactly the client's bytes arrive (echo compares them).
        serve(s);
    });
    let c = TcpStream::connect(addr).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    t.join().unwrap();
}

#[test]
fn plain_client_dual_listener_speaks_first() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        // A plain client and an offloaded one on the same listener.
        for _ in 0..2 {
            let (s, _) = l.accept().unwrap();
            let tr = s.transport();
            thread::spawn(move || serve(s));
            eprintln!("accepted: {tr}");
        }
    });
    let plain = thread::spawn(move || {
        let c = std::net::TcpStream::connect(addr).unwrap();
        session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    });
    let off = thread::spawn(move || {
        let c = TcpStream::connect_with(addr, &Config::with_mode(Mode::Offload)).unwrap();
        assert!(c.transport().is_offloaded());
        session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    });
    plain.join().unwrap();
    off.join().unwrap();
    t.join().unwrap();
}

#[test]
fn plain_client_sees_plain_transport_on_server() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let c = std::net::TcpStream::connect(addr).unwrap();
    let (s, peer) = l.accept().unwrap();
    assert_eq!(peer, c.local_addr().unwrap());
    assert_eq!(s.transport(), Transport::Plain(PlainReason::ClientPlain));
}

#[test]
fn offload_required_against_plain_server_fails_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let e = TcpStream::connect_with(addr, &Config::with_mode(Mode::Offload)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionRefused, "{e}");
    // No TCP connection was even made.
    assert_eq!(
        l.accept().unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
}

#[test]
fn tcp_mode_listener_declines() {
    let l = TcpListener::bind_with("127.0.0.1:0", &Config::with_mode(Mode::Tcp)).unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || l.accept().unwrap().0.transport());
    let c = TcpStream::connect(addr).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    assert_eq!(t.join().unwrap(), Transport::Plain(PlainReason::Policy));
}

#[test]
fn offload_listener_drops_plain_clients() {
    let l = TcpListener::bind_with("127.0.0.1:0", &Config::with_mode(Mode::Offload)).unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        assert!(s.transport().is_offloaded());
        s.write_all(b"ok").unwrap();
    });
    let mut plain = std::net::TcpStream::connect(addr).unwrap();
    plain
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut b = [0u8; 4];
    // Dropped: EOF (or reset), never data.
    assert!(matches!(plain.read(&mut b), Ok(0) | Err(_)));
    let mut c = TcpStream::connect(addr).unwrap();
    let mut ok = [0u8; 2];
    c.read_exact(&mut ok).unwrap();
    assert_eq!(&ok, b"ok");
    t.join().unwrap();
}

/// A host whose firewall swallows the query: the client waits the probe
/// time once (on loopback at least `LOOPBACK_PROBE_WAIT`), then remembers
/// the host as plain and never asks again.
#[test]
fn silent_host_costs_one_probe_then_cached() {
    let (l, sink, addr) = tcp_and_udp_on_one_port();
    sink.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let t = thread::spawn(move || {
        for _ in 0..2 {
            let (s, _) = l.accept().unwrap();
            serve(s);
        }
    });
    let mut cfg = Config::default();
    cfg.probe_timeout = Duration::from_millis(40);
    let c = TcpStream::connect_with(addr, &cfg).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    let mut b = [0u8; 64];
    let mut queries = 0;
    let mut withdraws = 0;
    while let Ok(n) = sink.recv(&mut b) {
        match Probe::decode(&b[..n]).map(|p| p.kind) {
            Some(Kind::Query) => queries += 1,
            Some(Kind::Withdraw) => withdraws += 1,
            k => panic!("{k:?}"),
        }
    }
    assert!((1..=2).contains(&queries), "{queries} queries");
    assert_eq!(withdraws, 1, "the unanswered query was not withdrawn");
    let c = TcpStream::connect_with(addr, &cfg).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    assert!(sink.recv(&mut b).is_err(), "asked again");
    t.join().unwrap();
}

/// Regression: a client that heard no answer in time connected plain (from
/// another port) and left its query standing: a twin that took it late
/// (its process starved past the client's wait) kept a record that
/// switched the next connection from the named port (another program's,
/// plain) within the record's lifetime. The query is now withdrawn (same
/// nonce and port) before the plain connection is made: the withdraw is
/// on the twin's socket when the listener accepts.
#[test]
fn a_query_the_client_gave_up_on_was_left_standing() {
    let (l, sink, addr) = tcp_and_udp_on_one_port();
    let t = thread::spawn(move || {
        let (s, peer) = l.accept().unwrap();
        sink.set_nonblocking(true).unwrap();
        let mut b = [0u8; 64];
        let mut got = Vec::new();
        while let Ok(n) = sink.recv(&mut b) {
            got.push(Probe::decode(&b[..n]).unwrap());
        }
        serve(s);
        (got, peer)
    });
    let mut cfg = Config::default();
    cfg.probe_timeout = Duration::from_millis(40);
    let c = TcpStream::connect_with(addr, &cfg).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    let (got, peer) = t.join().unwrap();
    let (last, queries) = got.split_last().expect("no datagram");
    assert!(!queries.is_empty(), "{got:?}");
    assert_eq!(last.kind, Kind::Withdraw, "not withdrawn first: {got:?}");
    for q in queries {
        assert_eq!(q.kind, Kind::Query);
        assert_eq!((q.nonce, q.client_port), (last.nonce, last.client_port));
    }
    assert_ne!(
        peer.port(),
        last.client_port,
        "connected from the named port"
    );
}

/// A twin that accepts, but a TCP side that cannot switch (it closes the
/// first connection): the client reconnects plain before any data.
#[test]
fn failed_setup_falls_back_before_data() {
    let (l, twin, addr) = tcp_and_udp_on_one_port();
    let tw = thread::spawn(move || accept_one_query(&twin));
    let t = thread::spawn(move || {
        // First connection: garbage instead of an MPA Reply.
        let (mut s, _) = l.accept().unwrap();
        let _ = s.write_all(b"this is not MPA at all, sorry\r\n");
        drop(s);
        // Second: a plain server speaking first.
        let (s, _) = l.accept().unwrap();
        serve(s);
    });
    let mut cfg = Config::default();
    cfg.setup_timeout = Duration::from_secs(2);
    let c = TcpStream::connect_with(addr, &cfg).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::SetupFailed));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    tw.join().unwrap();
    t.join().unwrap();
}

/// A peer that passes the Hello exchange and then sends malformed SDP
/// messages: that connection is reset, another one is untouched, nothing
/// panics.
#[test]
fn malformed_sdp_resets_only_that_connection() {
    use softrdma_engine::proto::mpa::MpaConfig;
    use softrdma_engine::transition::{MpaRole, StreamConnection, SwitchMode};
    use softrdma_engine::*;
    use softrdma_sockets::sdp::HelloAck;

    // A healthy offloaded pair, in use throughout.
    let good_l = TcpListener::bind("127.0.0.1:0").unwrap();
    let good_addr = good_l.local_addr().unwrap();
    let good_srv = thread::spawn(move || {
        for s in good_l.incoming() {
            let s = s.unwrap();
            thread::spawn(move || serve(s));
        }
    });

    let bad_cases: Vec<Vec<u8>> = vec![
        // Unknown MID.
        vec![0x77, 0, 0, 8, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 0],
        // Length field lies.
        vec![0xFF, 0, 0, 8, 0, 0, 0, 99, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2, 3],
        // Wrong sequence number.
        vec![0xFF, 0, 0, 8, 0, 0, 0, 17, 0, 0, 0, 5, 0, 0, 0, 0, 1],
        // Acknowledges messages never sent.
        vec![0xFF, 0, 0, 8, 0, 0, 0, 17, 0, 0, 0, 1, 0, 0, 0, 9, 1],
        // Hello in the data phase.
        vec![0x00, 0, 0, 8, 0, 0, 0, 16, 0, 0, 0, 1, 0, 0, 0, 0],
        // Too short for a BSDH.
        vec![0xFF, 0, 0],
        // SrcAvail although zero copy was not offered.
        vec![
            0xFE, 0, 0, 8, 0, 0, 0, 32, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0,
            0, 0, 0, 0,
        ],
    ];
    for bad in bad_cases {
        let good = TcpStream::connect_with(good_addr, &patient()).unwrap();
        assert!(good.transport().is_offloaded());
        // Fake SDP server: twin accepts, then an engine QP answers with a
        // valid HelloAck and sends `bad`.
        let (l, twin, addr) = tcp_and_udp_on_one_port();
        let bad2 = bad.clone();
        let fake = thread::spawn(move || {
            accept_one_query(&twin);
            let (s, _) = l.accept().unwrap();
            let dev = Device::open_default().unwrap();
            let pd = dev.alloc_pd();
            let cq = dev.create_cq(64).unwrap();
            let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
            let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
            let ack = HelloAck {
                bufs: 8,
                ipv_cap: 0x40,
                ext_max_adverts: 0,
                actrcvsz: 4096,
            };
            let mut sc = StreamConnection::new(
                s,
                SwitchMode::Mpa {
                    role: MpaRole::Responder,
                    config: MpaConfig::default(),
                    private_data: ack.encode().to_vec(),
                },
            );
            sc.reserve(&qp).unwrap();
            sc.request_switch().unwrap();
            sc.post_recv_and_switch(&RecvWr::new(0, &[mr.sge(0, 4096).unwrap()]))
                .unwrap();
            mr.write(1024, &bad2).unwrap();
            qp.post_send(
                &SendWr::new(1, SendOp::Send)
                    .sg_list(&[mr.sge(1024, bad2.len() as u32).unwrap()])
                    .signaled(),
            )
            .unwrap();
            // Keep the QP until the client has reacted.
            thread::sleep(Duration::from_millis(300));
        });
        let mut c = TcpStream::connect_with(addr, &patient()).unwrap();
        assert!(c.transport().is_offloaded(), "{}", c.transport());
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut b = [0u8; 16];
        let e = c.read(&mut b).expect_err("malformed message must reset");
        assert!(
            matches!(
                e.kind(),
                std::io::ErrorKind::InvalidData | std::io::ErrorKind::ConnectionReset
            ),
            "{bad:?}: {e}"
        );
        fake.join().unwrap();
        // The other connection still works.
        session(good, |s| s.shutdown(Shutdown::Write).unwrap());
    }
    drop(good_srv);
}

/// From the second connection on, the query goes beside the SYN (the
/// twin said it decides late queries): every connection is still decided
/// alike on both ends, offloaded for sockets-direct clients (auto and
/// required), plain for plain clients of the same listener.
#[test]
fn query_beside_syn_keeps_both_ends_agreed() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let rounds = 12;
    let t = thread::spawn(move || {
        let mut kinds = Vec::new();
        for _ in 0..rounds {
            let (mut s, _) = l.accept().unwrap();
            kinds.push(s.transport().is_offloaded());
            s.write_all(BANNER).unwrap();
            let mut b = [0u8; 1];
            while s.read(&mut b).unwrap() == 1 {
                s.write_all(&b).unwrap();
            }
        }
        kinds
    });
    let mut want = Vec::new();
    for i in 0..rounds {
        let mode = [Mode::Auto, Mode::Offload, Mode::Tcp][i % 3];
        let mut c = TcpStream::connect_with(addr, &Config::with_mode(mode)).unwrap();
        let offloaded = c.transport().is_offloaded();
        assert_eq!(offloaded, mode != Mode::Tcp, "{i}: {}", c.transport());
        want.push(offloaded);
        let mut banner = vec![0u8; BANNER.len()];
        c.read_exact(&mut banner).unwrap();
        assert_eq!(banner, BANNER);
        c.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        c.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"x");
        c.shutdown(Shutdown::Write).unwrap();
        assert_eq!(c.read(&mut b).unwrap(), 0);
    }
    assert_eq!(t.join().unwrap(), want);
}

/// A destination cached as deciding late queries whose listener came back
/// plain (no twin): the query beside the SYN is refused and the connection
/// made meanwhile stays plain, every byte as sent, server speaking first.
#[test]
fn query_beside_syn_to_a_listener_back_plain() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        assert!(s.transport().is_offloaded());
        serve(s);
        l
    });
    let c = TcpStream::connect(addr).unwrap();
    assert!(c.transport().is_offloaded());
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    drop(t.join().unwrap());
    // Same port, plain server now.
    let l = std::net::TcpListener::bind(addr).unwrap();
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        serve(s);
    });
    let c = TcpStream::connect(addr).unwrap();
    // Refused, or declined by the closed listener's twin in its last
    // moments: plain either way, before any byte.
    assert!(
        matches!(
            c.transport(),
            Transport::Plain(PlainReason::PeerNotCapable | PlainReason::PeerDeclined)
        ),
        "{}",
        c.transport()
    );
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    t.join().unwrap();
}

/// Regression: a destination remembered as plain (no twin answered) stayed
/// plain for `NEGATIVE_TTL` although this process then bound a listener,
/// with its twin, on that very port: a client connected plain to it (and
/// a listener requiring offload dropped the connection). A listener's
/// twin now makes the process forget what it knew of its address.
#[test]
fn cached_not_capable_answer_outlived_a_new_listener_on_the_port() {
    let (l, udp, addr) = tcp_and_udp_on_one_port();
    // No twin: the query is refused, the answer cached.
    drop(udp);
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        serve(s);
    });
    let c = TcpStream::connect_with(addr, &patient()).unwrap();
    assert_eq!(c.transport(), Transport::Plain(PlainReason::PeerNotCapable));
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    t.join().unwrap();
    assert!(external::known_plain(addr));
    // A sockets-direct listener (offload required) on the same port now.
    let l = TcpListener::bind_with(addr, &Config::with_mode(Mode::Offload)).unwrap();
    assert!(!external::known_plain(addr), "the stale answer is kept");
    let t = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        assert!(s.transport().is_offloaded(), "{}", s.transport());
        serve(s);
    });
    let c = TcpStream::connect_with(addr, &patient()).unwrap();
    assert!(c.transport().is_offloaded(), "{}", c.transport());
    session(c, |s| s.shutdown(Shutdown::Write).unwrap());
    t.join().unwrap();
}
