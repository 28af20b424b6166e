//! MPA connection setup over real loopback TCP.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use softrdma_engine::connect::{ConnectError, mpa_accept, mpa_connect, mpa_reject};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig, MpaNegotiationError, RtrOffer};
use softrdma_engine::proto::rtr::RtrKind;
use softrdma_engine::wire::mpa::MpaError;

const T: Duration = Duration::from_secs(5);

fn listener() -> (TcpListener, std::net::SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Runs `server` on the accepted stream in a thread and `client` on the
/// connecting one; returns both results.
fn run<A: Send + 'static, B>(
    server: impl FnOnce(TcpStream) -> A + Send + 'static,
    client: impl FnOnce(TcpStream) -> B,
) -> (A, B) {
    let (l, addr) = listener();
    let h = thread::spawn(move || server(l.accept().unwrap().0));
    let b = client(TcpStream::connect(addr).unwrap());
    (h.join().unwrap(), b)
}

/// Connects with `ic`/`rc`; after the helpers return, each side sends a
/// marker and reads the other's, proving the streams are positioned at the
/// first FPDU of full operation.
fn handshake(
    ic: MpaConfig,
    rc: MpaConfig,
) -> (
    Result<softrdma_engine::proto::mpa::Negotiated, ConnectError>,
    Result<softrdma_engine::proto::mpa::Negotiated, ConnectError>,
) {
    let (a, b) = run(
        move |mut s| {
            let r = mpa_accept(&mut s, &rc, b"from responder", T);
            let mut marker = None;
            if r.is_ok() {
                let _ = s.write_all(b"RESP-FPDU");
                let mut m = [0u8; 9];
                marker = Some(s.read_exact(&mut m).is_ok() && &m == b"INIT-FPDU");
            }
            (r, marker)
        },
        move |mut s| {
            let r = mpa_connect(&mut s, &ic, b"from initiator", T);
            if r.is_ok() {
                assert!(s.nodelay().unwrap());
                assert_eq!(s.read_timeout().unwrap(), None);
                s.write_all(b"INIT-FPDU").unwrap();
                let mut m = [0u8; 9];
                s.read_exact(&mut m).unwrap();
                assert_eq!(&m, b"RESP-FPDU");
            }
            r
        },
    );
    let (r, marker) = a;
    if b.is_ok() && r.is_ok() {
        assert_eq!(
            marker,
            Some(true),
            "responder not positioned at the first FPDU"
        );
    }
    (b, r)
}

#[test]
fn v2_both_sides_private_data_both_ways() {
    let (i, r) = handshake(MpaConfig::default(), MpaConfig::default());
    let (i, r) = (i.unwrap(), r.unwrap());
    assert_eq!(i.peer_private_data, b"from responder");
    assert_eq!(r.peer_private_data, b"from initiator");
    assert_eq!(
        (i.revision, i.enhanced, i.crc, i.rtr),
        (2, true, false, None)
    );
    assert!(i.initiator && !r.initiator);
    assert_eq!((i.peer_ird, r.peer_ird), (Some(16), Some(16)));
}

#[test]
fn v1_both_sides_and_mixed() {
    let v1 = MpaConfig {
        revision: 1,
        ..MpaConfig::default()
    };
    let (i, r) = handshake(v1.clone(), v1.clone());
    assert_eq!((i.unwrap().revision, r.unwrap().enhanced), (1, false));
    let (i, r) = handshake(MpaConfig::default(), v1);
    assert_eq!((i.unwrap().revision, r.unwrap().revision), (1, 1));
}

#[test]
fn crc_combinations() {
    use CrcPolicy::*;
    for (ip, rp, want) in [
        (AcceptIfAsked, AcceptIfAsked, false),
        (Required, AcceptIfAsked, true),
        (AcceptIfAsked, Required, true),
        (Off, Off, false),
    ] {
        let (i, r) = handshake(
            MpaConfig {
                crc: ip,
                ..MpaConfig::default()
            },
            MpaConfig {
                crc: rp,
                ..MpaConfig::default()
            },
        );
        assert_eq!(
            (i.unwrap().crc, r.unwrap().crc),
            (want, want),
            "{ip:?} {rp:?}"
        );
    }
    // The responder refuses CRC: it rejects, the initiator sees the reject.
    let (i, r) = handshake(
        MpaConfig {
            crc: Required,
            ..MpaConfig::default()
        },
        MpaConfig {
            crc: Off,
            ..MpaConfig::default()
        },
    );
    assert!(matches!(i, Err(ConnectError::Rejected { .. })), "{i:?}");
    assert!(matches!(
        r,
        Err(ConnectError::Negotiation(MpaNegotiationError::CrcRefused))
    ));
    // The initiator refuses CRC asked by the responder.
    let (i, r) = handshake(
        MpaConfig {
            crc: Off,
            ..MpaConfig::default()
        },
        MpaConfig {
            crc: Required,
            ..MpaConfig::default()
        },
    );
    assert!(matches!(
        i,
        Err(ConnectError::Negotiation(MpaNegotiationError::CrcRefused))
    ));
    // The responder considers itself established; the initiator has gone.
    assert!(
        r.is_ok() || matches!(r, Err(ConnectError::PeerClosed { .. })),
        "{r:?}"
    );
}

#[test]
fn peer_to_peer_rtr_kinds() {
    for (offer, accept, kind) in [
        (RtrOffer::WRITE_READ, None, RtrKind::Write),
        (RtrOffer::only(RtrKind::Read), None, RtrKind::Read),
        (
            RtrOffer::only(RtrKind::Send),
            Some(RtrOffer::only(RtrKind::Send)),
            RtrKind::Send,
        ),
    ] {
        for crc in [CrcPolicy::AcceptIfAsked, CrcPolicy::Required] {
            let (i, r) = handshake(
                MpaConfig {
                    crc,
                    peer_to_peer: Some(offer),
                    ..MpaConfig::default()
                },
                MpaConfig {
                    peer_to_peer: accept,
                    ..MpaConfig::default()
                },
            );
            assert_eq!(i.unwrap().rtr, Some(kind));
            assert_eq!(r.unwrap().rtr, Some(kind));
        }
    }
}

#[test]
fn reject_variant() {
    let (req, i) = run(
        |mut s| mpa_reject(&mut s, &MpaConfig::default(), b"go away", T),
        |mut s| mpa_connect(&mut s, &MpaConfig::default(), b"hello", T),
    );
    assert_eq!(req.unwrap().private_data, b"hello");
    match i {
        Err(ConnectError::Rejected { private_data }) => assert_eq!(private_data, b"go away"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn oversized_private_data() {
    // Locally: refused before anything is sent.
    let (l, addr) = listener();
    let mut s = TcpStream::connect(addr).unwrap();
    let e = mpa_connect(&mut s, &MpaConfig::default(), &[0; 300], T).unwrap_err();
    assert!(matches!(e, ConnectError::Config(_)), "{e:?}");
    drop(l);
    // From the peer: a responder with a 100-octet cap refuses and rejects.
    let small = MpaConfig {
        max_private_data: 100,
        ..MpaConfig::default()
    };
    let (r, i) = run(
        move |mut s| mpa_accept(&mut s, &small, &[], T),
        |mut s| mpa_connect(&mut s, &MpaConfig::default(), &[1; 200], T),
    );
    assert!(
        matches!(
            r,
            Err(ConnectError::Negotiation(MpaNegotiationError::Frame(
                MpaError::PrivateDataTooLong { .. }
            )))
        ),
        "{r:?}"
    );
    // The reject is sent, but the responder closes with the rest of the
    // Request unread, which may reset the connection before it is read.
    assert!(
        matches!(
            i,
            Err(ConnectError::Rejected { .. } | ConnectError::PeerClosed { .. })
        ),
        "{i:?}"
    );
}

#[test]
fn garbage_from_the_peer() {
    let (r, _) = run(
        |mut s| mpa_accept(&mut s, &MpaConfig::default(), &[], T),
        |mut s| {
            s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink);
        },
    );
    assert!(
        matches!(
            r,
            Err(ConnectError::Negotiation(MpaNegotiationError::Frame(
                MpaError::BadKey { .. }
            )))
        ),
        "{r:?}"
    );
    let (_, i) = run(
        |mut s| {
            s.write_all(&[0xffu8; 64]).unwrap();
            thread::sleep(Duration::from_millis(200));
        },
        |mut s| mpa_connect(&mut s, &MpaConfig::default(), &[], T),
    );
    assert!(matches!(i, Err(ConnectError::Negotiation(_))), "{i:?}");
}

/// A peer that reads and never answers until the other side closes (a
/// fixed sleep instead let a loaded machine see the close before the
/// timeout).
fn silent_until_closed(mut s: TcpStream) {
    let mut b = [0u8; 256];
    while matches!(s.read(&mut b), Ok(n) if n > 0) {}
}

#[test]
fn timeout_when_the_peer_is_silent() {
    let short = Duration::from_millis(200);
    let (r, _) = run(
        move |mut s| {
            let t = Instant::now();
            let r = mpa_accept(&mut s, &MpaConfig::default(), &[], short);
            assert!(t.elapsed() < Duration::from_secs(3));
            r
        },
        silent_until_closed,
    );
    assert!(matches!(r, Err(ConnectError::TimedOut { .. })), "{r:?}");
    let (_, i) = run(silent_until_closed, move |mut s| {
        mpa_connect(&mut s, &MpaConfig::default(), &[], short)
    });
    assert!(matches!(i, Err(ConnectError::TimedOut { .. })), "{i:?}");
}

#[test]
fn peer_closes() {
    let (_, i) = run(drop, |mut s| {
        mpa_connect(&mut s, &MpaConfig::default(), &[], T)
    });
    assert!(matches!(i, Err(ConnectError::PeerClosed { .. })), "{i:?}");
    // Closing halfway through a Request.
    let (r, _) = run(
        |mut s| mpa_accept(&mut s, &MpaConfig::default(), &[], T),
        |mut s| s.write_all(b"MPA ID Req Fr").unwrap(),
    );
    assert!(matches!(r, Err(ConnectError::PeerClosed { .. })), "{r:?}");
    // The responder waits for the RTR and the initiator leaves instead.
    let (r, _) = run(
        |mut s| mpa_accept(&mut s, &MpaConfig::default(), &[], T),
        |mut s| {
            let mut i = softrdma_engine::proto::mpa::Initiator::new(
                MpaConfig {
                    peer_to_peer: Some(RtrOffer::WRITE_READ),
                    ..MpaConfig::default()
                },
                &[],
            )
            .unwrap();
            s.write_all(i.transmit()).unwrap();
            let mut reply = [0u8; 24];
            s.read_exact(&mut reply).unwrap();
            i.consumed(24);
        },
    );
    assert!(matches!(r, Err(ConnectError::PeerClosed { .. })), "{r:?}");
}
