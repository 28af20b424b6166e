//! MPA negotiation machines: scripted byte for byte against the frames of
//! Linux siw in /work/shared/captures, and machine against machine.

use softrdma_proto::mpa::{
    ConfigError, CrcPolicy, Initiator, InitiatorEvent, MpaConfig, MpaNegotiationError, Negotiated,
    Responder, ResponderEvent, RtrOffer,
};
use softrdma_proto::rtr::{self, RtrKind};
use softrdma_wire::ddp::Msn;
use softrdma_wire::mpa::MpaError;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// rping.txt: frames 4 and 6 (rev 2, H, IRD 1 / ORD 1, no CRC).
const RPING_REQ: &str = "4d504120494420526571204672616d651002000400010001";
const RPING_REP: &str = "4d504120494420526570204672616d651002000400010001";
// ib_write_bw.txt: IRD 0 / ORD 0.
const IB_WRITE_BW_REQ: &str = "4d504120494420526571204672616d651002000400000000";
const IB_WRITE_BW_REP: &str = "4d504120494420526570204672616d651002000400000000";
// rping-crc-p2p.txt: CRC, peer-to-peer offering Write and Read; Write picked.
const P2P_REQ: &str = "4d504120494420526571204672616d65500200048001c001";
const P2P_REP: &str = "4d504120494420526570204672616d655002000480018001";
// Frame 8 of rping-crc-p2p: the Write RTR.
const P2P_RTR: &str = "000ec140000000010000000000000000ebd34c5f";

fn rping_config() -> MpaConfig {
    MpaConfig {
        ird: 1,
        ord: 1,
        ..MpaConfig::default()
    }
}

fn p2p_config() -> MpaConfig {
    MpaConfig {
        crc: CrcPolicy::Required,
        peer_to_peer: Some(RtrOffer::WRITE_READ),
        ..rping_config()
    }
}

fn take_tx_i(i: &mut Initiator) -> Vec<u8> {
    let v = i.transmit().to_vec();
    i.consumed(v.len());
    v
}

fn take_tx_r(r: &mut Responder) -> Vec<u8> {
    let v = r.transmit().to_vec();
    r.consumed(v.len());
    v
}

fn established_i(i: &mut Initiator) -> Negotiated {
    match i.poll() {
        Some(InitiatorEvent::Established(n)) => n,
        other => panic!("{other:?}"),
    }
}

fn established_r(r: &mut Responder) -> Negotiated {
    match r.poll() {
        Some(ResponderEvent::Established(n)) => n,
        other => panic!("{other:?}"),
    }
}

#[test]
fn rping_initiator_byte_for_byte() {
    let mut i = Initiator::new(rping_config(), &[]).unwrap();
    assert_eq!(take_tx_i(&mut i), hex(RPING_REQ));
    assert_eq!(i.want(), 20);
    let rep = hex(RPING_REP);
    // One byte at a time, never asking for more than the frame.
    for (k, b) in rep.iter().enumerate() {
        let frame_end = if k < 20 { 20 } else { rep.len() };
        assert_eq!(i.want(), frame_end - k);
        assert_eq!(i.receive(&[*b]), Ok(1));
    }
    assert_eq!(i.want(), 0);
    let n = established_i(&mut i);
    assert_eq!(
        n,
        Negotiated {
            revision: 2,
            enhanced: true,
            crc: false,
            ird: 1,
            ord: 1,
            peer_ird: Some(1),
            peer_ord: Some(1),
            rtr: None,
            peer_private_data: vec![],
            initiator: true,
        }
    );
    assert!(i.transmit().is_empty());
    assert!(i.is_over());
    assert_eq!(i.receive(&[0]), Err(MpaNegotiationError::Over));
}

#[test]
fn rping_responder_byte_for_byte() {
    let mut r = Responder::new(rping_config()).unwrap();
    let req = hex(RPING_REQ);
    // Trailing bytes (an FPDU) are not consumed.
    let mut bytes = req.clone();
    bytes.extend_from_slice(&[0, 0x12, 0x41]);
    assert_eq!(r.receive(&bytes), Ok(req.len()));
    let Some(ResponderEvent::Request(q)) = r.poll() else {
        panic!()
    };
    assert_eq!((q.revision, q.crc, q.rtr_offer), (2, false, None));
    assert_eq!(q.ird_ord.map(|w| (w.ird, w.ord)), Some((1, 1)));
    assert_eq!(r.want(), 0);
    r.accept(&[], 1, 1).unwrap();
    assert_eq!(take_tx_r(&mut r), hex(RPING_REP));
    let n = established_r(&mut r);
    assert_eq!(
        (n.crc, n.ird, n.ord, n.rtr, n.initiator),
        (false, 1, 1, None, false)
    );
    assert_eq!(r.accept(&[], 1, 1), Err(ConfigError::NotAwaitingAnswer));
}

#[test]
fn ib_write_bw_zero_ird_ord() {
    let cfg = MpaConfig {
        ird: 0,
        ord: 0,
        ..MpaConfig::default()
    };
    let mut i = Initiator::new(cfg.clone(), &[]).unwrap();
    assert_eq!(take_tx_i(&mut i), hex(IB_WRITE_BW_REQ));
    i.receive(&hex(IB_WRITE_BW_REP)).unwrap();
    let n = established_i(&mut i);
    assert_eq!(
        (n.ird, n.ord, n.peer_ird, n.peer_ord),
        (0, 0, Some(0), Some(0))
    );

    let mut r = Responder::new(MpaConfig::default()).unwrap();
    r.receive(&hex(IB_WRITE_BW_REQ)).unwrap();
    r.accept(&[], 0, 0).unwrap();
    assert_eq!(take_tx_r(&mut r), hex(IB_WRITE_BW_REP));
}

#[test]
fn siw_p2p_initiator_sends_the_write_rtr() {
    let mut i = Initiator::new(p2p_config(), &[]).unwrap();
    assert_eq!(take_tx_i(&mut i), hex(P2P_REQ));
    i.receive(&hex(P2P_REP)).unwrap();
    let n = established_i(&mut i);
    assert_eq!((n.crc, n.rtr), (true, Some(RtrKind::Write)));
    // The RTR is queued: it must be written before any FPDU.
    assert_eq!(take_tx_i(&mut i), hex(P2P_RTR));
    assert_eq!(i.want(), 0);
    assert_eq!(n.initial_msns().send_tx, Msn(1));
}

#[test]
fn siw_p2p_responder_picks_write_and_waits_for_the_rtr() {
    let mut r = Responder::new(rping_config()).unwrap();
    r.receive(&hex(P2P_REQ)).unwrap();
    let Some(ResponderEvent::Request(q)) = r.poll() else {
        panic!()
    };
    assert!(q.crc);
    assert_eq!(q.rtr_offer, Some(RtrOffer::WRITE_READ));
    r.accept(&[], 1, 1).unwrap();
    assert_eq!(take_tx_r(&mut r), hex(P2P_REP));
    assert_eq!(r.poll(), None, "not established before the RTR");
    assert_eq!(r.want(), 2);
    let mut bytes = hex(P2P_RTR);
    // The first Send of frame 9 follows at once: not consumed.
    bytes.extend_from_slice(&[0x00, 0x22, 0x41, 0x43]);
    assert_eq!(r.receive(&bytes), Ok(20));
    let n = established_r(&mut r);
    assert_eq!((n.crc, n.rtr), (true, Some(RtrKind::Write)));
    assert!(r.transmit().is_empty());
}

#[test]
fn bad_rtr_fails_the_responder() {
    let mut r = Responder::new(rping_config()).unwrap();
    r.receive(&hex(P2P_REQ)).unwrap();
    r.accept(&[], 1, 1).unwrap();
    let mut rtr = hex(P2P_RTR);
    rtr[19] ^= 0xff;
    assert!(matches!(
        r.receive(&rtr),
        Err(MpaNegotiationError::Rtr(rtr::RtrError::BadCrc { .. }))
    ));
    assert!(r.is_over());
    // A huge FPDU is refused at its length prefix.
    let mut r = Responder::new(rping_config()).unwrap();
    r.receive(&hex(P2P_REQ)).unwrap();
    r.accept(&[], 1, 1).unwrap();
    assert!(matches!(
        r.receive(&[0xff, 0xff]),
        Err(MpaNegotiationError::Rtr(rtr::RtrError::TooLong { .. }))
    ));
}

/// Runs both machines against each other until neither has anything to do.
fn pump(i: &mut Initiator, r: &mut Responder) -> Result<(), MpaNegotiationError> {
    for _ in 0..16 {
        let to_r = take_tx_i(i);
        if !to_r.is_empty() && r.want() > 0 {
            let used = r.receive(&to_r)?;
            assert_eq!(used, to_r.len());
        }
        if r.request().is_some() {
            assert!(matches!(r.poll(), Some(ResponderEvent::Request(_))));
            r.accept(b"resp", 4, 2)
                .map_err(|_| MpaNegotiationError::Over)?;
        }
        let to_i = take_tx_r(r);
        if !to_i.is_empty() && i.want() > 0 {
            let used = i.receive(&to_i)?;
            assert_eq!(used, to_i.len());
        }
        if i.transmit().is_empty() && r.transmit().is_empty() && i.is_over() && r.is_over() {
            break;
        }
    }
    Ok(())
}

fn pair(ic: MpaConfig, rc: MpaConfig) -> Result<(Negotiated, Negotiated), MpaNegotiationError> {
    let mut i = Initiator::new(ic, b"init").unwrap();
    let mut r = Responder::new(rc).unwrap();
    pump(&mut i, &mut r)?;
    Ok((established_i(&mut i), established_r(&mut r)))
}

#[test]
fn ird_ord_and_private_data_both_ways() {
    let ic = MpaConfig {
        ird: 3,
        ord: 8,
        ..MpaConfig::default()
    };
    let (a, b) = pair(ic, MpaConfig::default()).unwrap();
    assert_eq!(a.peer_private_data, b"resp");
    assert_eq!(b.peer_private_data, b"init");
    // Responder accepted with IRD 4, ORD 2 (lowered to the initiator's IRD 3: 2).
    assert_eq!(
        (a.ird, a.ord, a.peer_ird, a.peer_ord),
        (3, 4, Some(4), Some(2))
    );
    assert_eq!(
        (b.ird, b.ord, b.peer_ird, b.peer_ord),
        (4, 2, Some(3), Some(8))
    );
}

#[test]
fn crc_combinations() {
    use CrcPolicy::*;
    for (ip, rp, want) in [
        (Off, Off, Ok(false)),
        (Off, AcceptIfAsked, Ok(false)),
        (AcceptIfAsked, AcceptIfAsked, Ok(false)),
        (Required, AcceptIfAsked, Ok(true)),
        (AcceptIfAsked, Required, Ok(true)),
        (Required, Required, Ok(true)),
        (Off, Required, Err(MpaNegotiationError::CrcRefused)),
        (Required, Off, Err(MpaNegotiationError::CrcRefused)),
    ] {
        let ic = MpaConfig {
            crc: ip,
            ..MpaConfig::default()
        };
        let rc = MpaConfig {
            crc: rp,
            ..MpaConfig::default()
        };
        let got = pair(ic, rc).map(|(a, b)| {
            assert_eq!(a.crc, b.crc);
            a.crc
        });
        assert_eq!(got, want, "{ip:?} {rp:?}");
    }
}

#[test]
fn responder_refusing_crc_can_reject() {
    let ic = MpaConfig {
        crc: CrcPolicy::Required,
        ..MpaConfig::default()
    };
    let mut i = Initiator::new(ic, b"x").unwrap();
    let mut r = Responder::new(MpaConfig {
        crc: CrcPolicy::Off,
        ..MpaConfig::default()
    })
    .unwrap();
    let err = r.receive(&take_tx_i(&mut i)).unwrap_err();
    assert_eq!(err, MpaNegotiationError::CrcRefused);
    assert!(err.is_refusal());
    assert!(r.request().is_some());
    r.reject(b"no crc").unwrap();
    i.receive(&take_tx_r(&mut r)).unwrap();
    assert_eq!(
        i.poll(),
        Some(InitiatorEvent::Rejected {
            revision: 2,
            private_data: b"no crc".to_vec()
        })
    );
    assert!(i.is_over());
}

#[test]
fn revision_1_both_and_mixed() {
    let v1 = MpaConfig {
        revision: 1,
        ..MpaConfig::default()
    };
    let (a, b) = pair(v1.clone(), v1.clone()).unwrap();
    assert_eq!((a.revision, a.enhanced, a.peer_ird), (1, false, None));
    assert_eq!((b.revision, b.enhanced, b.ord), (1, false, 2));
    // v2 initiator, v1 responder: revision 1, no IRD/ORD.
    let (a, b) = pair(MpaConfig::default(), v1.clone()).unwrap();
    assert_eq!((a.revision, a.enhanced), (1, false));
    assert_eq!(b.peer_private_data, b"init");
    // v1 initiator, v2 responder.
    let (a, b) = pair(v1, MpaConfig::default()).unwrap();
    assert_eq!((a.revision, b.revision, b.enhanced), (1, 1, false));
}

#[test]
fn peer_to_peer_every_kind() {
    for (offer, accept, want) in [
        (RtrOffer::WRITE_READ, None, RtrKind::Write),
        (RtrOffer::only(RtrKind::Read), None, RtrKind::Read),
        (
            RtrOffer::WRITE_READ,
            Some(RtrOffer::only(RtrKind::Read)),
            RtrKind::Read,
        ),
        (
            RtrOffer::only(RtrKind::Send),
            Some(RtrOffer::only(RtrKind::Send)),
            RtrKind::Send,
        ),
    ] {
        for crc in [CrcPolicy::AcceptIfAsked, CrcPolicy::Required] {
            let ic = MpaConfig {
                crc,
                peer_to_peer: Some(offer),
                ..MpaConfig::default()
            };
            let rc = MpaConfig {
                peer_to_peer: accept,
                ..MpaConfig::default()
            };
            let (a, b) = pair(ic, rc).unwrap();
            assert_eq!((a.rtr, b.rtr), (Some(want), Some(want)));
            let (ma, mb) = (a.initial_msns(), b.initial_msns());
            match want {
                RtrKind::Read => {
                    assert_eq!((ma.read_tx, mb.read_rx), (Msn(2), Msn(2)));
                    assert_eq!((ma.send_tx, mb.send_rx), (Msn(1), Msn(1)));
                }
                RtrKind::Send => {
                    assert_eq!((ma.send_tx, mb.send_rx), (Msn(2), Msn(2)));
                }
                RtrKind::Write => {
                    assert_eq!(
                        (ma.send_tx, ma.read_tx, mb.read_rx),
                        (Msn(1), Msn(1), Msn(1))
                    );
                }
            }
        }
    }
}

#[test]
fn read_rtr_exchange_step_by_step() {
    let ic = MpaConfig {
        peer_to_peer: Some(RtrOffer::only(RtrKind::Read)),
        ..MpaConfig::default()
    };
    let mut i = Initiator::new(ic, &[]).unwrap();
    let mut r = Responder::new(MpaConfig::default()).unwrap();
    r.receive(&take_tx_i(&mut i)).unwrap();
    r.poll();
    r.accept(&[], 1, 1).unwrap();
    i.receive(&take_tx_r(&mut r)).unwrap();
    // The initiator sent the Read RTR and waits for the Read Response.
    assert_eq!(i.poll(), None);
    let rtr_bytes = take_tx_i(&mut i);
    assert_eq!(rtr_bytes, rtr::rtr_fpdu(RtrKind::Read, false));
    assert_eq!(i.want(), 2);
    r.receive(&rtr_bytes).unwrap();
    let n = established_r(&mut r);
    assert_eq!(n.rtr, Some(RtrKind::Read));
    let resp = take_tx_r(&mut r);
    assert_eq!(resp.len(), 20);
    i.receive(&resp).unwrap();
    assert_eq!(established_i(&mut i).rtr, Some(RtrKind::Read));
}

#[test]
fn peer_to_peer_refusals() {
    // No common kind: the responder refuses and can reject.
    let ic = MpaConfig {
        peer_to_peer: Some(RtrOffer::only(RtrKind::Send)),
        ..MpaConfig::default()
    };
    let err = pair(ic.clone(), MpaConfig::default()).unwrap_err();
    assert!(matches!(err, MpaNegotiationError::NoCommonRtr { .. }));
    // A v1 responder cannot do peer-to-peer.
    let v1 = MpaConfig {
        revision: 1,
        ..MpaConfig::default()
    };
    let ic = MpaConfig {
        peer_to_peer: Some(RtrOffer::WRITE_READ),
        ..MpaConfig::default()
    };
    assert_eq!(
        pair(ic.clone(), v1).unwrap_err(),
        MpaNegotiationError::PeerToPeerRefused
    );
    // Reply selecting both, or one not offered, or none.
    let mut base = hex(P2P_REP);
    for (ord_hi, want_refused) in [(0xc0u8, false), (0x40, false), (0x00, true)] {
        let mut i = Initiator::new(
            MpaConfig {
                peer_to_peer: Some(RtrOffer::only(RtrKind::Write)),
                crc: CrcPolicy::Required,
                ..rping_config()
            },
            &[],
        )
        .unwrap();
        base[22] = ord_hi;
        let err = i.receive(&base).unwrap_err();
        if want_refused {
            assert_eq!(err, MpaNegotiationError::PeerToPeerRefused);
        } else {
            assert!(
                matches!(err, MpaNegotiationError::BadRtrSelection { .. }),
                "{err:?}"
            );
        }
    }
    // A Reply choosing an RTR nobody asked for.
    let mut i = Initiator::new(rping_config(), &[]).unwrap();
    assert!(matches!(
        i.receive(&hex(P2P_REP)).unwrap_err(),
        MpaNegotiationError::BadRtrSelection { .. }
    ));
}

#[test]
fn initiator_refuses_bad_replies() {
    let check = |bytes: Vec<u8>, want: fn(&MpaNegotiationError) -> bool| {
        let mut i = Initiator::new(rping_config(), &[]).unwrap();
        let err = i.receive(&bytes).unwrap_err();
        assert!(want(&err), "{err:?}");
        assert!(i.is_over());
    };
    // Garbage key: refused at the first wrong byte.
    let mut i = Initiator::new(rping_config(), &[]).unwrap();
    assert!(matches!(
        i.receive(b"HTTP/1.1 200 OK\r\n"),
        Err(MpaNegotiationError::Frame(MpaError::BadKey { .. }))
    ));
    // A Request where a Reply is expected.
    check(hex(RPING_REQ), |e| {
        matches!(
            e,
            MpaNegotiationError::Frame(MpaError::UnexpectedKind { .. })
        )
    });
    // Markers.
    let mut m = hex(RPING_REP);
    m[16] |= 0x80;
    check(m, |e| *e == MpaNegotiationError::MarkersRequested);
    // Revision 3.
    let mut m = hex(RPING_REP);
    m[17] = 3;
    check(m, |e| {
        matches!(
            e,
            MpaNegotiationError::Frame(MpaError::BadRevision { revision: 3 })
        )
    });
    // Responder ORD above our IRD 1.
    let mut m = hex(RPING_REP);
    m[23] = 5;
    check(m, |e| {
        *e == MpaNegotiationError::IrdOrdMismatch {
            peer_ord: 5,
            local_ird: 1,
        }
    });
    // H with a 2-octet private data.
    let mut m = hex(RPING_REP);
    m[19] = 2;
    m.truncate(22);
    check(m, |e| matches!(e, MpaNegotiationError::IrdOrd(_)));
    // Private data above the cap (refused at the header).
    let mut m = hex(RPING_REP);
    m[18] = 0x01;
    m[19] = 0x05; // 261 octets
    m.truncate(20);
    check(m, |e| {
        matches!(
            e,
            MpaNegotiationError::Frame(MpaError::PrivateDataTooLong { .. })
        )
    });
    // v1 initiator receiving a v2 Reply.
    let mut i = Initiator::new(
        MpaConfig {
            revision: 1,
            ..rping_config()
        },
        &[],
    )
    .unwrap();
    assert_eq!(
        i.receive(&hex(RPING_REP)),
        Err(MpaNegotiationError::RevisionMismatch {
            sent: 1,
            received: 2
        })
    );
}

#[test]
fn private_data_limits() {
    let cfg = MpaConfig::default();
    assert!(Initiator::new(cfg.clone(), &[7; 256]).is_ok());
    assert_eq!(
        Initiator::new(cfg.clone(), &[7; 257]).unwrap_err(),
        ConfigError::PrivateDataTooLong { len: 257, max: 256 }
    );
    // 256 octets of ULP data (260 on the wire with IRD/ORD) are accepted.
    let mut i = Initiator::new(cfg.clone(), &[7; 256]).unwrap();
    let mut r = Responder::new(cfg.clone()).unwrap();
    r.receive(&take_tx_i(&mut i)).unwrap();
    let Some(ResponderEvent::Request(q)) = r.poll() else {
        panic!()
    };
    assert_eq!(q.private_data, vec![7; 256]);
    assert_eq!(
        r.accept(&[0; 257], 1, 1),
        Err(ConfigError::PrivateDataTooLong { len: 257, max: 256 })
    );
    // A responder with a smaller cap refuses, and can still reject.
    let mut i = Initiator::new(cfg.clone(), &[7; 100]).unwrap();
    let mut r = Responder::new(MpaConfig {
        max_private_data: 50,
        ..cfg.clone()
    })
    .unwrap();
    let err = r.receive(&take_tx_i(&mut i)).unwrap_err();
    assert!(err.is_refusal());
    assert!(r.request().is_some());
    r.reject(&[]).unwrap();
    assert!(matches!(
        err,
        MpaNegotiationError::Frame(MpaError::PrivateDataTooLong { .. })
    ));
    // Over 512 on the wire is not a frame at all.
    assert!(matches!(
        Initiator::new(
            MpaConfig {
                max_private_data: 600,
                ..cfg
            },
            &[]
        ),
        Err(ConfigError::PrivateDataCapTooLarge { .. })
    ));
}

#[test]
fn config_errors() {
    let bad = |c: MpaConfig| Initiator::new(c, &[]).unwrap_err();
    assert_eq!(
        bad(MpaConfig {
            revision: 3,
            ..MpaConfig::default()
        }),
        ConfigError::BadRevision { revision: 3 }
    );
    assert!(matches!(
        bad(MpaConfig {
            ird: 0x4000,
            ..MpaConfig::default()
        }),
        ConfigError::IrdOrdTooLarge { .. }
    ));
    assert_eq!(
        bad(MpaConfig {
            revision: 1,
            peer_to_peer: Some(RtrOffer::WRITE_READ),
            ..MpaConfig::default()
        }),
        ConfigError::PeerToPeerNeedsRevision2
    );
    assert_eq!(
        bad(MpaConfig {
            peer_to_peer: Some(RtrOffer::default()),
            ..MpaConfig::default()
        }),
        ConfigError::EmptyRtrOffer
    );
    let mut r = Responder::new(MpaConfig::default()).unwrap();
    assert_eq!(r.reject(&[]), Err(ConfigError::NotAwaitingAnswer));
    assert_eq!(r.accept(&[], 1, 1), Err(ConfigError::NotAwaitingAnswer));
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    /// Feeds `bytes` in chunks of the given sizes; returns what was consumed
    /// and the first error.
    fn feed_chunks<F: FnMut(&[u8]) -> Result<usize, MpaNegotiationError>>(
        bytes: &[u8],
        sizes: &[usize],
        mut receive: F,
    ) -> (usize, Option<MpaNegotiationError>) {
        let mut at = 0;
        let mut k = 0;
        while at < bytes.len() {
            let n = sizes.get(k).copied().unwrap_or(bytes.len()).max(1);
            k += 1;
            let end = (at + n).min(bytes.len());
            match receive(&bytes[at..end]) {
                Ok(used) => {
                    assert!(used <= end - at);
                    at += used;
                    if at < end {
                        break;
                    }
                }
                Err(e) => return (at, Some(e)),
            }
        }
        (at, None)
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600),
                                    sizes in proptest::collection::vec(1usize..64, 0..40)) {
            let mut r = Responder::new(MpaConfig::default()).unwrap();
            let _ = feed_chunks(&bytes, &sizes, |b| r.receive(b));
            let _ = r.poll();
            let _ = r.reject(&[]);
            let mut i = Initiator::new(MpaConfig { peer_to_peer: Some(RtrOffer::WRITE_READ), ..MpaConfig::default() }, &[]).unwrap();
            let _ = feed_chunks(&bytes, &sizes, |b| i.receive(b));
            let _ = i.poll();
        }

        #[test]
        fn random_headers_never_panic(flags in any::<u8>(), rev in 0u8..4, len in 0u16..600,
                                      tail in proptest::collection::vec(any::<u8>(), 0..600)) {
            for key in [*b"MPA ID Req Frame", *b"MPA ID Rep Frame"] {
                let mut bytes = key.to_vec();
                bytes.extend_from_slice(&[flags, rev]);
                bytes.extend_from_slice(&len.to_be_bytes());
                bytes.extend_from_slice(&tail);
                let mut r = Responder::new(MpaConfig::default()).unwrap();
                if r.receive(&bytes).is_ok() && r.request().is_some() {
                    r.accept(&[], 1, 1).unwrap();
                    let _ = r.receive(&tail);
                }
                let mut i = Initiator::new(p2p_config(), &[]).unwrap();
                let _ = i.receive(&bytes);
                let _ = i.poll();
            }
        }

        #[test]
        fn chunking_does_not_matter(sizes in proptest::collection::vec(1usize..30, 0..20)) {
            let mut r = Responder::new(rping_config()).unwrap();
            let (used, err) = feed_chunks(&hex(P2P_REQ), &sizes, |b| r.receive(b));
            prop_assert_eq!((used, err), (24, None));
            r.accept(&[], 1, 1).unwrap();
            prop_assert_eq!(take_tx_r(&mut r), hex(P2P_REP));
            let mut rtr = hex(P2P_RTR);
            rtr.extend_from_slice(b"next FPDU");
            let mut total = 0;
            for chunk in rtr.chunks(sizes.first().copied().unwrap_or(3)) {
                let used = r.receive(chunk).unwrap_or(0);
                total += used;
                if used < chunk.len() {
                    break;
                }
            }
            prop_assert_eq!(total, 20);
            prop_assert!(matches!(r.poll(), Some(ResponderEvent::Established(_))));
        }
    }
}
