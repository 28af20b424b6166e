//! The one-pass receive of a whole single-FPDU Send against the general
//! path: the same bytes, fed to two connections set up alike, one with
//! the one pass and one without, must leave both in the same state (the
//! whole connection and memory, compared by their `Debug` form) and make
//! them report the same completions, outputs and FPDUs (a Terminate).

use proptest::prelude::*;
use softrdma_wire::ddp;
use softrdma_wire::errcode::TermError;
use softrdma_wire::fpdu;
use softrdma_wire::rdmap::{Opcode, control_byte};
use softrdma_wire::ulpdu::{UlpduBody, UlpduRepr};

use crate::conn::{Config, Connection, SEND_IMM_FOLLOWS, TxFpdu};
use crate::sim::{LOCAL_WRITE, REMOTE_WRITE, SimMemory};
use crate::types::{Completion, Output, RecvWr, Sge, WcStatus};

/// Both connections' receives: one list of segment lengths per receive.
type Recvs = Vec<Vec<u32>>;

struct Side {
    c: Connection<usize>,
    m: SimMemory,
}

fn side(crc: bool, one_pass: bool, recvs: &Recvs) -> Side {
    let mut m = SimMemory::new(0x10);
    // STag 0x10: a Write target.
    m.add_region(64, REMOTE_WRITE, |_| 0);
    let mut c = Connection::new(Config::new(crc));
    c.set_one_pass_rx(one_pass);
    for (i, segs) in recvs.iter().enumerate() {
        let total: u32 = segs.iter().map(|&l| l + 3).sum();
        let (_, key, addr) = m.add_region(total as usize, LOCAL_WRITE, |_| 0xee);
        let mut at = addr;
        let sgl: Vec<Sge> = segs
            .iter()
            .map(|&len| {
                // A gap of 3 octets between segments: a write past one
                // shows in the memory compared.
                let s = Sge {
                    lkey: key,
                    addr: at,
                    len,
                };
                at += u64::from(len) + 3;
                s
            })
            .collect();
        c.post_recv(
            &RecvWr {
                wr_id: 100 + i as u64,
                sgl: &sgl,
            },
            &mut m,
        )
        .unwrap();
    }
    Side { c, m }
}

/// What a side did: its state, then everything it reports.
#[derive(Debug, PartialEq)]
struct Outcome {
    state: String,
    memory: String,
    completions: Vec<Completion>,
    outputs: Vec<Output>,
    sent: Vec<Vec<u8>>,
}

fn outcome(s: &mut Side) -> Outcome {
    // The switch itself (and the count of one passes) is not compared.
    let state = crate::sim::state_without_one_pass(&s.c);
    let memory = format!("{:?}", s.m);
    let completions = std::iter::from_fn(|| s.c.poll_completion()).collect();
    let outputs = std::iter::from_fn(|| s.c.poll_output()).collect();
    let mut sent = Vec::new();
    let mut f = TxFpdu::new();
    while s.c.poll_transmit(&mut s.m, &mut f) {
        let mut v = Vec::new();
        assert!(f.write_to(&mut s.m, &mut v));
        sent.push(v);
    }
    s.c.handle_sent(sent.len());
    assert!(s.m.violations.is_empty(), "{:?}", s.m.violations);
    s.m.check_canaries().unwrap();
    Outcome {
        state,
        memory,
        completions,
        outputs,
        sent,
    }
}

/// One FPDU of a test stream: a Send, or one of the ways a segment can
/// differ from the one the one pass takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Send,
    SendSe,
    WrongMsn,
    WrongQn(u32),
    NonZeroMo,
    NotLast,
    DdpVersion(u8),
    RdmapVersion(u8),
    SendInv,
    ImmFollows,
    /// The DDP reserved bits set (ignored on receipt).
    DdpReserved,
    CrcFlip,
    PayloadFlip,
    /// The ULPDU Length field changed by this much.
    Length(i8),
    /// A tagged Write into STag 0x10.
    Write,
    /// A Send of this many octets more than its receive holds.
    TooLong,
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        6 => Just(Kind::Send),
        2 => Just(Kind::SendSe),
        1 => Just(Kind::WrongMsn),
        1 => prop_oneof![Just(1u32), Just(2), Just(3), Just(4), Just(0x100)].prop_map(Kind::WrongQn),
        1 => Just(Kind::NonZeroMo),
        1 => Just(Kind::NotLast),
        1 => prop_oneof![Just(0u8), Just(2), Just(3)].prop_map(Kind::DdpVersion),
        1 => prop_oneof![Just(0u8), Just(2), Just(3)].prop_map(Kind::RdmapVersion),
        1 => Just(Kind::SendInv),
        1 => Just(Kind::ImmFollows),
        1 => Just(Kind::DdpReserved),
        1 => Just(Kind::CrcFlip),
        1 => Just(Kind::PayloadFlip),
        1 => (-20i8..=6).prop_map(Kind::Length),
        1 => Just(Kind::Write),
        1 => Just(Kind::TooLong),
    ]
}

/// The wire bytes of `specs`, the MSN and MO of each Send counted as a
/// sender that sent every segment before it would (the receive side's
/// expected MSN, when nothing went wrong earlier): a segment without the
/// last flag leaves its message open, so the next untagged segment
/// continues it (same MSN, MO after it). Half of those segments are
/// empty, so that the next one continues the message at MO 0.
fn stream(crc: bool, specs: &[(Kind, usize)], recvs: &Recvs) -> Vec<u8> {
    let mut wire = Vec::new();
    let mut msn = 1u32;
    // The open message's offset (the MO its next segment has).
    let mut open_mo = 0u32;
    for (i, &(k, len)) in specs.iter().enumerate() {
        let cap = recvs
            .get(i)
            .map_or(0, |s| s.iter().map(|&l| l as usize).sum());
        let len = match k {
            Kind::TooLong => cap + 1 + len % 4,
            Kind::NotLast if len % 2 == 0 => 0,
            _ => len,
        };
        let payload: Vec<u8> = (0..len).map(|j| (j as u8) ^ (i as u8 * 17)).collect();
        let mut u = if k == Kind::Write {
            let mut h = vec![0xc1, control_byte(Opcode::RdmaWrite), 0, 0, 0, 0x10];
            h.extend_from_slice(&(((1u64) << 32) + (len % 8) as u64).to_be_bytes());
            h.truncate(ddp::TAGGED_HEADER_LEN);
            h
        } else {
            let op = match k {
                Kind::SendSe => Opcode::SendWithSolicitedEvent,
                Kind::SendInv => Opcode::SendWithInvalidate,
                _ => Opcode::Send,
            };
            let mut h = vec![ddp::FLAG_LAST | ddp::DDP_VERSION, control_byte(op)];
            let rsvd = match k {
                Kind::ImmFollows => SEND_IMM_FOLLOWS,
                Kind::SendInv => 0x77,
                _ => 0,
            };
            let qn = if let Kind::WrongQn(q) = k { q } else { 0 };
            let m = if k == Kind::WrongMsn { msn + 1 } else { msn };
            let mo = if k == Kind::NonZeroMo {
                open_mo + 4
            } else {
                open_mo
            };
            for w in [rsvd, qn, m, mo] {
                h.extend_from_slice(&w.to_be_bytes());
            }
            match k {
                Kind::NotLast => h[0] &= !ddp::FLAG_LAST,
                Kind::DdpVersion(v) => h[0] = (h[0] & !ddp::VERSION_MASK) | v,
                Kind::DdpReserved => h[0] |= ddp::RESERVED_MASK,
                Kind::RdmapVersion(v) => h[1] = (h[1] & 0x3f) | (v << 6),
                _ => {}
            }
            h
        };
        match k {
            Kind::Write | Kind::WrongQn(_) => {}
            Kind::NotLast => open_mo += len as u32,
            _ => {
                msn += 1;
                open_mo = 0;
            }
        }
        u.extend_from_slice(&payload);
        let mut f = vec![0u8; fpdu::fpdu_len(u.len())];
        let n = fpdu::emit(&u, crc, &mut f).unwrap();
        f.truncate(n);
        match k {
            Kind::CrcFlip => {
                let last = f.len() - 1;
                f[last] ^= 0x01;
            }
            Kind::PayloadFlip if len > 0 => f[2 + u.len() - 1] ^= 0x80,
            Kind::Length(d) => {
                let l = u16::from_be_bytes([f[0], f[1]]).wrapping_add_signed(i16::from(d));
                f[..2].copy_from_slice(&l.to_be_bytes());
            }
            _ => {}
        }
        wire.extend_from_slice(&f);
    }
    wire
}

/// Feeds `wire` cut at `cuts` (each piece as one `handle_rx_stream`
/// call, what a piece leaves untaken fed again with the next).
fn feed(s: &mut Side, wire: &[u8], cuts: &[usize]) {
    let mut at = 0;
    for &end in cuts.iter().chain([&wire.len()]) {
        let end = end.clamp(at, wire.len());
        while at < end {
            let n = s.c.handle_rx_stream(&wire[at..end], &mut s.m);
            if n == 0 {
                return;
            }
            at += n;
        }
    }
}

/// Both sides fed `wire` with the same cuts (after an error the
/// deframer's position depends on the bytes of the failing call).
fn both(crc: bool, recvs: &Recvs, wire: &[u8], cuts: &[usize]) -> (Outcome, Outcome) {
    let mut one = side(crc, true, recvs);
    let mut general = side(crc, false, recvs);
    feed(&mut one, wire, cuts);
    feed(&mut general, wire, cuts);
    (outcome(&mut one), outcome(&mut general))
}

/// The Terminate a side sent: its error.
fn terminate_error(o: &Outcome, crc: bool) -> Option<TermError> {
    o.sent.iter().find_map(|f| {
        let d = fpdu::decode(f, crc).ok()?;
        let u = UlpduRepr::parse(d.ulpdu).ok()?;
        match u.body {
            UlpduBody::Terminate(t) => t.error(),
            _ => None,
        }
    })
}

fn recvs_of(lens: &[&[u32]]) -> Recvs {
    lens.iter().map(|s| s.to_vec()).collect()
}

#[test]
fn a_ping_pong_send_takes_the_one_pass_and_completes_as_the_general_path() {
    for crc in [false, true] {
        let recvs = recvs_of(&[&[64], &[64], &[16, 48], &[0, 70]]);
        let specs = [
            (Kind::Send, 64),
            (Kind::SendSe, 1),
            (Kind::Send, 63),
            (Kind::Send, 0),
        ];
        let wire = stream(crc, &specs, &recvs);
        let mut one = side(crc, true, &recvs);
        feed(&mut one, &wire, &[]);
        assert_eq!(one.c.rx.one_pass_taken, 4, "every FPDU in one pass");
        let mut general = side(crc, false, &recvs);
        feed(&mut general, &wire, &[]);
        assert_eq!(general.c.rx.one_pass_taken, 0);
        let (a, b) = (outcome(&mut one), outcome(&mut general));
        assert_eq!(a, b);
        let got: Vec<_> = a
            .completions
            .iter()
            .map(|c| (c.wr_id, c.status, c.byte_len, c.solicited))
            .collect();
        assert_eq!(
            got,
            [
                (100, WcStatus::Success, 64, false),
                (101, WcStatus::Success, 1, true),
                (102, WcStatus::Success, 63, false),
                (103, WcStatus::Success, 0, false),
            ]
        );
        // The payload is in the receive's segments, around their gaps.
        let r = one.m.region(3);
        assert_eq!(&r[..16], &(0..16).map(|j| j ^ 34).collect::<Vec<u8>>()[..]);
        assert_eq!(&r[16..19], &[0xee; 3]);
        assert_eq!(
            &r[19..66],
            &(16..63).map(|j| j ^ 34).collect::<Vec<u8>>()[..]
        );
        assert_eq!(r[66], 0xee);
    }
}

#[test]
fn every_byte_split_gives_the_general_paths_result() {
    let recvs = recvs_of(&[&[64], &[8, 8], &[20], &[64], &[64], &[64]]);
    let specs = [
        (Kind::Send, 64),
        (Kind::SendSe, 13),
        (Kind::Write, 5),
        (Kind::Send, 20),
        (Kind::Send, 0),
        (Kind::Send, 33),
        (Kind::Send, 64),
    ];
    for crc in [false, true] {
        let wire = stream(crc, &specs, &recvs);
        for cut in 0..=wire.len() {
            let (a, b) = both(crc, &recvs, &wire, &[cut]);
            assert_eq!(a, b, "cut at {cut}");
            assert_eq!(a.completions.len(), 6);
        }
        for cut in (0..wire.len()).step_by(7) {
            let (a, b) = both(crc, &recvs, &wire, &[cut, cut + 3, cut + 25]);
            assert_eq!(a, b, "cuts at {cut}");
        }
    }
}

/// Each hostile FPDU, as the first after a valid Send: the same
/// Terminate, the same completions (a receive too small completes with a
/// length error, the others are flushed), nothing placed differently.
#[test]
fn hostile_sends_get_the_general_paths_terminate() {
    let cases = [
        (Kind::WrongMsn, Some(TermError::DdpUntaggedMsnRange)),
        (Kind::WrongQn(1), Some(TermError::DdpUntaggedInvalidQn)),
        (Kind::WrongQn(4), Some(TermError::DdpUntaggedInvalidQn)),
        (Kind::NonZeroMo, Some(TermError::DdpUntaggedInvalidMo)),
        (Kind::TooLong, Some(TermError::DdpUntaggedMessageTooLong)),
        (Kind::DdpVersion(0), None),
        (Kind::RdmapVersion(2), None),
    ];
    for crc in [false, true] {
        let recvs = recvs_of(&[&[64], &[32], &[64]]);
        for (k, want) in cases {
            let wire = stream(crc, &[(Kind::Send, 40), (k, 20), (Kind::Send, 8)], &recvs);
            let (a, b) = both(crc, &recvs, &wire, &[]);
            assert_eq!(a, b, "{k:?}");
            let got = terminate_error(&a, crc);
            assert!(got.is_some(), "{k:?}: no Terminate");
            if let Some(w) = want {
                assert_eq!(got, Some(w), "{k:?}");
            }
            assert_eq!(a.completions[0].status, WcStatus::Success);
            assert!(
                a.completions[1..]
                    .iter()
                    .all(|c| c.status != WcStatus::Success)
            );
            if k == Kind::TooLong {
                assert_eq!(a.completions[1].status, WcStatus::LocalLength);
            }
        }
        // A bad CRC, or a ULPDU Length that puts the CRC field elsewhere:
        // a CRC error, when the CRC is on.
        if crc {
            for k in [
                Kind::CrcFlip,
                Kind::PayloadFlip,
                Kind::Length(-1),
                Kind::Length(-10),
                Kind::Length(3),
            ] {
                let wire = stream(crc, &[(Kind::Send, 40), (k, 20), (Kind::Send, 8)], &recvs);
                let (a, b) = both(crc, &recvs, &wire, &[]);
                assert_eq!(a, b, "{k:?}");
                assert_eq!(
                    terminate_error(&a, crc),
                    Some(TermError::MpaCrcError),
                    "{k:?}"
                );
            }
        }
    }
}

#[test]
fn a_send_without_a_receive_gets_the_general_paths_terminate() {
    let recvs = recvs_of(&[&[64]]);
    let wire = stream(true, &[(Kind::Send, 10), (Kind::Send, 10)], &recvs);
    let (a, b) = both(true, &recvs, &wire, &[]);
    assert_eq!(a, b);
    assert_eq!(
        terminate_error(&a, true),
        Some(TermError::DdpUntaggedNoBuffer)
    );
}

/// The last segment of a message whose first segment was empty has the
/// one-pass shape (untagged, last, the expected MSN, MO 0, a whole
/// FPDU), but it belongs to the receive the first segment took: the one
/// pass must leave it to the general path (which places it there), not
/// pop a new receive for it.
#[test]
fn the_end_of_a_message_begun_by_an_empty_segment_is_not_taken_as_a_new_send() {
    for crc in [false, true] {
        let recvs = recvs_of(&[&[64], &[64]]);
        let wire = stream(crc, &[(Kind::NotLast, 0), (Kind::Send, 10)], &recvs);
        // L = 0, MSN 1, MO 0, no payload; then L = 1, MSN 1, MO 0, 10 octets.
        let fpdus = {
            let mut v = Vec::new();
            let mut at = 0;
            while at < wire.len() {
                let l = usize::from(u16::from_be_bytes([wire[at], wire[at + 1]]));
                let n = fpdu::fpdu_len(l);
                v.push(&wire[at + 2..at + 2 + l]);
                at += n;
            }
            v
        };
        assert_eq!(fpdus.len(), 2);
        for (f, last, payload) in [(fpdus[0], false, 0), (fpdus[1], true, 10)] {
            assert_eq!(f[0] & ddp::FLAG_LAST != 0, last);
            assert_eq!(&f[6..18], &[0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0]);
            assert_eq!(f.len(), ddp::UNTAGGED_HEADER_LEN + payload);
        }
        let mut one = side(crc, true, &recvs);
        feed(&mut one, &wire, &[]);
        assert_eq!(one.c.rx.one_pass_taken, 0);
        let mut general = side(crc, false, &recvs);
        feed(&mut general, &wire, &[]);
        let (a, b) = (outcome(&mut one), outcome(&mut general));
        assert_eq!(a, b);
        let got: Vec<_> = a
            .completions
            .iter()
            .map(|c| (c.wr_id, c.status, c.byte_len))
            .collect();
        assert_eq!(got, [(100, WcStatus::Success, 10)]);
        assert_eq!(terminate_error(&a, crc), None);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn random_fpdus_give_the_general_paths_result(
        crc in any::<bool>(),
        specs in prop::collection::vec((kind(), 0usize..80), 1..8),
        recvs in prop::collection::vec(prop::collection::vec(0u32..48, 1..4), 0..9),
        cut in any::<prop::sample::Index>(),
    ) {
        let wire = stream(crc, &specs, &recvs);
        let (a, b) = both(crc, &recvs, &wire, &[]);
        prop_assert_eq!(a, b);
        let c = cut.index(wire.len() + 1);
        let (a, b) = both(crc, &recvs, &wire, &[c]);
        prop_assert_eq!(a, b);
        // The `core_rx` fuzz target's comparisons hold on the same stream.
        let input: Vec<u8> = [u8::from(crc)].into_iter().chain(wire).collect();
        if let Err(e) = crate::sim::fuzz_rx(&input) {
            return Err(TestCaseError::fail(e));
        }
    }
}

/// The fuzz seeds of whole Sends (`fuzz/seeds/core_rx/send_whole_*`, fed
/// by `sim::fuzz_rx` to a victim with two receives of 16 + 24 octets)
/// reach the one pass: the valid ones complete there, the hostile ones
/// get their Terminate from the general path.
#[test]
fn the_whole_send_fuzz_seeds_reach_the_one_pass() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/core_rx");
    let cases = [
        ("send_whole_fpdus", 2, None),
        ("send_whole_fpdus_crc", 2, None),
        (
            "send_whole_wrong_msn_crc",
            1,
            Some(TermError::DdpUntaggedMsnRange),
        ),
        (
            "send_whole_too_long_crc",
            0,
            Some(TermError::DdpUntaggedMessageTooLong),
        ),
        ("send_whole_bad_crc", 0, Some(TermError::MpaCrcError)),
    ];
    for (name, taken, term) in cases {
        let data = std::fs::read(dir.join(name)).unwrap();
        let crc = data[0] & 1 != 0;
        let recvs = recvs_of(&[&[16, 24], &[16, 24]]);
        let mut one = side(crc, true, &recvs);
        feed(&mut one, &data[1..], &[]);
        assert_eq!(one.c.rx.one_pass_taken, taken, "{name}");
        let o = outcome(&mut one);
        assert_eq!(terminate_error(&o, crc), term, "{name}");
    }
}
