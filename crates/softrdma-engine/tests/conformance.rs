//! RFC 5040/5041/7306 conformance of the receive path against a raw peer:
//! well-framed FPDUs that break one rule each, and the Terminate the engine
//! answers with (its code from the one table of `softrdma_proto::term`, and
//! the D/M/R shape kernel siw uses). Each test is named after the bug it
//! guards against.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::device;
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::proto::term::{MALFORMED_HEADER, UNSUPPORTED_ATOMIC};
use softrdma_engine::wire::ddp::{Msn, Stag};
use softrdma_engine::wire::errcode::{TermCode, TermError};
use softrdma_engine::wire::fpdu;
use softrdma_engine::wire::rdmap::Opcode;
use softrdma_engine::wire::rdmap::atomic::AtomicRequestRepr;
use softrdma_engine::wire::rdmap::immediate::ImmediateDataRepr;
use softrdma_engine::wire::rdmap::read_request::ReadRequestRepr;
use softrdma_engine::wire::ulpdu::{UlpduBody, UlpduRepr};
use softrdma_engine::{
    Access, CompletionQueue, Device, LinkParams, MemoryRegion, ProtectionDomain, QpInitAttr,
    QpState, QueuePair, RecvWr, WcStatus, WorkCompletion,
};

const DEADLINE: Duration = Duration::from_secs(10);
/// DDP control byte: untagged, last, version 1.
const UNTAGGED_LAST: u8 = 0x41;
/// The L flag in the DDP control byte.
const DDP_LAST: u8 = 0x40;
/// Untagged DDP header: QN, MSN and MO fields.
const QN_AT: usize = 6;
const MO_AT: usize = 14;

/// An engine QP connected to a raw peer that writes bytes by hand.
struct Victim {
    _dev: Device,
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    raw: TcpStream,
    crc: bool,
}

fn victim(crc: bool) -> Victim {
    let dev = device(false);
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 64, None).expect("cq");
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).expect("qp");
    let mr = pd
        .register(
            4096,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )
        .expect("mr");
    let raw_cfg = MpaConfig {
        crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::AcceptIfAsked
        },
        ..MpaConfig::default()
    };
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let n = mpa_accept(&mut s, &raw_cfg, &[], DEADLINE).expect("mpa_accept");
        (s, n)
    });
    let mut s = TcpStream::connect(addr).expect("connect");
    let vn = mpa_connect(&mut s, &MpaConfig::default(), &[], DEADLINE).expect("mpa_connect");
    let (raw, rn) = acceptor.join().expect("acceptor");
    assert_eq!(rn.crc, crc);
    qp.establish(s, &LinkParams::from(&vn)).expect("establish");
    raw.set_read_timeout(Some(DEADLINE)).expect("timeout");
    Victim {
        _dev: dev,
        _pd: pd,
        cq,
        qp,
        mr,
        raw,
        crc,
    }
}

fn ulpdu(repr: &UlpduRepr<'_>) -> Vec<u8> {
    let mut u = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut u).expect("emit");
    u.truncate(n);
    u
}

fn framed(ulpdu: &[u8], crc: bool) -> Vec<u8> {
    let mut f = vec![0u8; fpdu::fpdu_len(ulpdu.len())];
    let n = fpdu::emit(ulpdu, crc, &mut f).expect("frame");
    f.truncate(n);
    f
}

/// A Terminate the victim sent: code, D and M flags, the copied DDP
/// segment length and header, the copied RDMAP header.
type Term = (
    TermCode,
    bool,
    bool,
    Option<(u16, Vec<u8>)>,
    Option<Vec<u8>>,
);

/// What the peer saw after its hostile FPDU: the victim's Terminate (if
/// any), whether the stream ended with a FIN (not a reset).
struct Answer {
    term: Option<Term>,
    fin: bool,
}

impl Victim {
    fn send(&mut self, bytes: &[u8]) {
        self.raw.write_all(bytes).expect("write");
    }

    /// Reads until the victim closes; decodes its Terminate.
    fn answer(&mut self) -> Answer {
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        let fin = loop {
            match self.raw.read(&mut b) {
                Ok(0) => break true,
                Ok(n) => got.extend_from_slice(&b[..n]),
                Err(e) if e.kind() == ErrorKind::ConnectionReset => break false,
                Err(e) => panic!("reading the victim: {e}"),
            }
        };
        let mut at = 0;
        let mut term = None;
        while let Ok(f) = fpdu::decode(&got[at..], self.crc) {
            at += f.len;
            let repr = UlpduRepr::parse(f.ulpdu).expect("victim's ULPDU");
            if let UlpduBody::Terminate(t) = repr.body {
                term = Some((
                    t.code,
                    t.ddp.is_some(),
                    t.segment_length_valid,
                    t.ddp.map(|d| (d.segment_length, d.header.to_vec())),
                    t.rdmap_header.map(<[u8]>::to_vec),
                ));
            }
        }
        Answer { term, fin }
    }

    fn wait_state(&self, want: &[QpState]) {
        let deadline = Instant::now() + DEADLINE;
        while !want.contains(&self.qp.state()) {
            assert!(Instant::now() < deadline, "QP in {}", self.qp.state());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

fn read_request(msn: u32, mr: &MemoryRegion) -> Vec<u8> {
    let req = ReadRequestRepr {
        sink_stag: Stag(0x1234_5600),
        sink_to: 0,
        read_size: 16,
        src_stag: Stag(mr.rkey()),
        src_to: mr.addr(),
    };
    ulpdu(&UlpduRepr::read_request(Msn(msn), req))
}

/// Sends `u` and checks the Terminate: `code`, and the copied DDP header
/// (D=1, M=1, the segment's real length) when `copied`.
fn expect_terminate(mut v: Victim, u: &[u8], code: TermError, copied: bool) {
    let f = framed(u, v.crc);
    v.send(&f);
    let a = v.answer();
    let (got, d, m, ddp, _) = a.term.expect("a Terminate");
    assert_eq!(got, TermCode::from(code), "code");
    if copied {
        assert!(d && m, "D and M set");
        let (len, hdr) = ddp.expect("copied header");
        let hdr_len = if u[0] & 0x80 != 0 { 14 } else { 18 };
        assert_eq!(usize::from(len), u.len() - hdr_len, "DDP segment length");
        assert_eq!(hdr, u[..hdr_len], "copied DDP header");
    } else {
        assert!(!d && !m, "nothing copied");
    }
    assert!(a.fin, "the Terminate ends with a FIN, not a reset");
    v.wait_state(&[QpState::Error]);
}

#[test]
fn read_request_on_queue_0_or_7_gets_invalid_qn() {
    for qn in [0u32, 7] {
        let v = victim(qn == 7);
        let mut u = read_request(1, &v.mr);
        u[QN_AT..QN_AT + 4].copy_from_slice(&qn.to_be_bytes());
        expect_terminate(v, &u, TermError::DdpUntaggedInvalidQn, true);
    }
}

#[test]
fn atomic_immediate_and_terminate_on_wrong_queue_get_invalid_qn() {
    let v = victim(false);
    let mut u = ulpdu(&UlpduRepr::atomic_request(
        Msn(1),
        AtomicRequestRepr::fetch_add(1, Stag(v.mr.rkey()), v.mr.addr(), 1),
    ));
    u[QN_AT..QN_AT + 4].copy_from_slice(&0u32.to_be_bytes());
    expect_terminate(v, &u, TermError::DdpUntaggedInvalidQn, true);

    let v = victim(true);
    let mut u = ulpdu(&UlpduRepr::immediate(
        Msn(1),
        ImmediateDataRepr::from_be_u64(7),
        false,
    ));
    u[QN_AT..QN_AT + 4].copy_from_slice(&1u32.to_be_bytes());
    expect_terminate(v, &u, TermError::DdpUntaggedInvalidQn, true);

    let v = victim(false);
    let mut u = ulpdu(&UlpduRepr::terminate(
        Msn(1),
        softrdma_engine::wire::rdmap::terminate::TerminateRepr::new(
            TermError::RdmapLocalCatastrophic,
        ),
    ));
    u[QN_AT..QN_AT + 4].copy_from_slice(&1u32.to_be_bytes());
    expect_terminate(v, &u, TermError::DdpUntaggedInvalidQn, true);
}

#[test]
fn read_request_with_nonzero_mo_gets_invalid_mo() {
    let v = victim(true);
    let mut u = read_request(1, &v.mr);
    u[MO_AT..MO_AT + 4].copy_from_slice(&28u32.to_be_bytes());
    expect_terminate(v, &u, TermError::DdpUntaggedInvalidMo, true);
}

#[test]
fn read_request_without_last_flag_gets_a_terminate() {
    let v = victim(false);
    let mut u = read_request(1, &v.mr);
    u[0] &= !DDP_LAST;
    expect_terminate(v, &u, MALFORMED_HEADER, true);
}

#[test]
fn ulpdu_shorter_than_its_ddp_header_gets_a_terminate_not_a_reset() {
    for crc in [false, true] {
        let v = victim(crc);
        // An untagged Send whose ULPDU ends after 10 of its 18 header bytes.
        let mut u = vec![0u8; 10];
        u[0] = UNTAGGED_LAST;
        u[1] = softrdma_engine::wire::rdmap::control_byte(Opcode::Send);
        expect_terminate(v, &u, MALFORMED_HEADER, false);
    }
}

#[test]
fn unknown_atomic_opcode_is_not_a_local_catastrophe() {
    let v = victim(true);
    let mut u = ulpdu(&UlpduRepr::atomic_request(
        Msn(1),
        AtomicRequestRepr::fetch_add(1, Stag(v.mr.rkey()), v.mr.addr(), 1),
    ));
    // The atomic opcode: low 4 bits of the first word after the DDP header.
    u[18 + 3] = 0x0f;
    let a = {
        let mut v = v;
        let f = framed(&u, true);
        v.send(&f);
        let a = v.answer();
        v.wait_state(&[QpState::Error]);
        a
    };
    let (code, d, m, _, _) = a.term.expect("a Terminate");
    assert_eq!(code, TermCode::from(UNSUPPORTED_ATOMIC));
    assert_ne!(code, TermCode::from(TermError::DdpLocalCatastrophic));
    // "Unexpected OpCode": the layout is unknown, nothing copied (siw).
    assert!(!d && !m);
}

#[test]
fn terminate_for_a_bad_stag_carries_segment_length_and_header() {
    let v = victim(false);
    let payload = [7u8; 100];
    let u = ulpdu(&UlpduRepr::tagged(
        Opcode::RdmaWrite,
        Stag(v.mr.rkey() ^ 0xff),
        v.mr.addr(),
        true,
        &payload,
    ));
    expect_terminate(v, &u, TermError::DdpTaggedInvalidStag, true);
}

#[test]
fn terminate_for_a_protected_read_request_copies_its_rdmap_header() {
    let mut v = victim(false);
    let mut u = read_request(1, &v.mr);
    // Source STag with a wrong key: RDMAP Remote Protection "Invalid STag".
    let bad = (v.mr.rkey() ^ 0x5a).to_be_bytes();
    u[18 + 16..18 + 20].copy_from_slice(&bad);
    let f = framed(&u, false);
    v.send(&f);
    let a = v.answer();
    let (code, d, m, _, rdmap) = a.term.expect("a Terminate");
    assert_eq!(code, TermCode::from(TermError::RdmapInvalidStag));
    assert!(d && m);
    assert_eq!(
        rdmap.as_deref(),
        Some(&u[18..18 + 28]),
        "R: the Read Request header"
    );
}

#[test]
fn header_verdict_waits_for_the_crc() {
    let mut v = victim(true);
    // A Read Request from a wrong STag whose CRC is also wrong: the bits
    // were flipped in transit, so the verdict is the CRC error, not
    // "Invalid STag" blamed on the peer.
    let mut u = read_request(1, &v.mr);
    let bad = (v.mr.rkey() ^ 0x01).to_be_bytes();
    u[18 + 16..18 + 20].copy_from_slice(&bad);
    let mut f = framed(&u, true);
    let last = f.len() - 1;
    f[last] ^= 0x01;
    v.send(&f);
    let a = v.answer();
    let (code, d, m, _, _) = a.term.expect("a Terminate");
    assert_eq!(code, TermCode::from(TermError::MpaCrcError));
    assert!(!d && !m);
}

fn recv(v: &Victim, wr_id: u64, off: usize, len: u32) {
    let sge = [v.mr.sge(off, len).expect("sge")];
    v.qp.post_recv(&RecvWr::new(wr_id, &sge))
        .expect("post_recv");
}

fn wait_wc(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    common::wait(cq, n)
}

#[test]
fn graceful_close_keeps_receives_for_sends_already_sent() {
    let mut v = victim(false);
    recv(&v, 1, 0, 64);
    recv(&v, 2, 64, 64);
    recv(&v, 3, 128, 64);
    // The first half of a two-segment Send arrives before the close...
    let first = ulpdu(&UlpduRepr::send(
        Opcode::Send,
        None,
        Msn(1),
        0,
        false,
        b"hello, ",
    ));
    v.send(&framed(&first, false));
    // ... let it be placed before the close starts.
    std::thread::sleep(Duration::from_millis(50));
    v.qp.modify(QpState::Closing).expect("close");
    // The peer reads our FIN, then finishes its Send and sends another one
    // it had queued before it saw the FIN, then closes.
    let mut b = [0u8; 256];
    loop {
        match v.raw.read(&mut b) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!("reading the FIN: {e}"),
        }
    }
    let second = ulpdu(&UlpduRepr::send(
        Opcode::Send,
        None,
        Msn(1),
        7,
        true,
        b"world",
    ));
    let third = ulpdu(&UlpduRepr::send(
        Opcode::Send,
        None,
        Msn(2),
        0,
        true,
        b"bye",
    ));
    let mut bytes = framed(&second, false);
    bytes.extend(framed(&third, false));
    v.send(&bytes);
    v.raw.shutdown(Shutdown::Write).expect("FIN");
    v.wait_state(&[QpState::Idle, QpState::Error]);
    let wc = wait_wc(&v.cq, 3);
    let got: Vec<(u64, WcStatus)> = wc.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        got,
        [
            (1, WcStatus::Success),
            (2, WcStatus::Success),
            (3, WcStatus::WrFlush)
        ],
        "receive completions in posting order, nothing refused"
    );
    assert_eq!(wc[0].byte_len, 12);
    assert_eq!(&v.mr.to_vec()[..12], b"hello, world");
    assert_eq!(
        v.qp.state(),
        QpState::Idle,
        "a graceful close, no Terminate"
    );
}

/// A large payload is read from the socket straight into its destination
/// (`readv`) and reported to the deframer by length, the CRC computed over
/// the placed bytes. Delivered in pieces (the header with the first payload
/// bytes, a large middle, the end, then the CRC field alone, as siw sends
/// it), a good FPDU places every byte; one byte changed in the directly
/// placed part is an MPA CRC error.
#[test]
fn crc_covers_payload_placed_straight_from_the_socket() {
    for corrupt in [false, true] {
        let mut v = victim(true);
        recv(&v, 1, 3800, 64);
        let payload: Vec<u8> = (0..3500u32).map(|i| (i * 13 % 251) as u8).collect();
        let u = ulpdu(&UlpduRepr::tagged(
            Opcode::RdmaWrite,
            Stag(v.mr.rkey()),
            v.mr.addr(),
            true,
            &payload,
        ));
        let mut f = framed(&u, true);
        if corrupt {
            f[2 + 14 + 2000] ^= 0x20;
        }
        let crc_at = f.len() - 4;
        for piece in [&f[..40], &f[40..2600], &f[2600..crc_at], &f[crc_at..]] {
            v.send(piece);
            std::thread::sleep(Duration::from_millis(20));
        }
        if corrupt {
            let a = v.answer();
            let (code, ..) = a.term.expect("a Terminate");
            assert_eq!(code, TermCode::from(TermError::MpaCrcError));
            continue;
        }
        let s = ulpdu(&UlpduRepr::send(
            Opcode::Send,
            None,
            Msn(1),
            0,
            true,
            b"done",
        ));
        v.send(&framed(&s, true));
        let wc = wait_wc(&v.cq, 1);
        assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
        assert_eq!(&v.mr.to_vec()[..3500], &payload[..]);
    }
}

/// A Send of two segments into a receive of two SGEs with a gap between
/// them, CRC on, the stream cut once at every byte offset (the receiver
/// reads the first part before the rest arrives): the direct `readv` into
/// several pieces, its CRC fed from each piece, the read-ahead spanning
/// the next segment's header, and the staging copy all place every byte
/// where it belongs and nothing in the gap.
#[test]
fn send_into_two_sges_split_at_every_offset_places_every_byte() {
    const A: usize = 700;
    const B_AT: usize = 1024;
    const B: usize = 900;
    let mut v = victim(true);
    let seg1: Vec<u8> = (0..1300u32).map(|i| (i * 7 % 253) as u8).collect();
    let seg2: Vec<u8> = (0..300u32).map(|i| (i * 11 % 241) as u8 ^ 0x55).collect();
    let mut want = seg1.clone();
    want.extend_from_slice(&seg2);
    // The two FPDUs of the Send of MSN `msn`.
    let wire_of = |msn: u32| {
        let mut w = framed(
            &ulpdu(&UlpduRepr::send(
                Opcode::Send,
                None,
                Msn(msn),
                0,
                false,
                &seg1,
            )),
            true,
        );
        let first = w.len();
        let mo = seg1.len() as u32;
        let last = UlpduRepr::send(Opcode::Send, None, Msn(msn), mo, true, &seg2);
        w.extend(framed(&ulpdu(&last), true));
        (w, first)
    };
    let (w, first) = wire_of(0);
    let cuts = (1..w.len())
        .step_by(7)
        .chain([w.len() - 1, first, first + 1]);
    for (msn, k) in (1u32..).zip(cuts) {
        v.mr.fill(0xee);
        let sge = [
            v.mr.sge(0, A as u32).expect("sge"),
            v.mr.sge(B_AT, B as u32).expect("sge"),
        ];
        v.qp.post_recv(&RecvWr::new(u64::from(msn), &sge))
            .expect("post_recv");
        let (wire, _) = wire_of(msn);
        v.send(&wire[..k]);
        std::thread::sleep(Duration::from_millis(1));
        v.send(&wire[k..]);
        let wc = wait_wc(&v.cq, 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status, wc[0].byte_len as usize),
            (u64::from(msn), WcStatus::Success, want.len()),
            "cut at {k}"
        );
        let mem = v.mr.to_vec();
        assert_eq!(&mem[..A], &want[..A], "first SGE, cut at {k}");
        assert!(mem[A..B_AT].iter().all(|&b| b == 0xee), "gap, cut at {k}");
        assert_eq!(&mem[B_AT..B_AT + B], &want[A..], "second SGE, cut at {k}");
        assert!(
            mem[B_AT + B..].iter().all(|&b| b == 0xee),
            "after, cut at {k}"
        );
    }
}

/// The peer's FIN inside an FPDU (in its length field, its DDP header,
/// payload staged with the header, payload read straight into the receive,
/// pad and CRC) is a bad close, never a graceful one: the QP enters ERROR
/// and the receive the partial Send was being placed into completes once,
/// flushed.
#[test]
fn fin_inside_an_fpdu_is_a_bad_close_at_every_part_of_it() {
    let payload: Vec<u8> = (0..1501u32).map(|i| (i % 199) as u8).collect();
    for crc in [false, true] {
        let f = framed(
            &ulpdu(&UlpduRepr::send(
                Opcode::Send,
                None,
                Msn(1),
                0,
                true,
                &payload,
            )),
            crc,
        );
        for cut in [1, 10, 20, 100, 1400, f.len() - 5, f.len() - 2] {
            let mut v = victim(crc);
            recv(&v, 7, 0, 2048);
            v.send(&f[..cut]);
            std::thread::sleep(Duration::from_millis(5));
            v.raw.shutdown(Shutdown::Write).expect("shutdown");
            v.wait_state(&[QpState::Error]);
            let wc = wait_wc(&v.cq, 1);
            assert_eq!(
                (wc[0].wr_id, wc[0].status),
                (7, WcStatus::WrFlush),
                "crc {crc}, FIN after {cut} bytes"
            );
            std::thread::sleep(Duration::from_millis(5));
            assert!(v.cq.poll_one().is_none(), "one completion only");
        }
    }
}

/// A Terminate between two segments of a Send whose first segment was
/// placed straight from the socket (read-ahead holding the Terminate):
/// the QP enters ERROR with the peer's code, the half-filled receive
/// completes once, flushed, and nothing after the first segment's bytes is
/// written.
#[test]
fn terminate_between_segments_of_a_send_flushes_the_receive_once() {
    use softrdma_engine::TerminateDirection;
    use softrdma_engine::wire::rdmap::terminate::TerminateRepr;
    for crc in [false, true] {
        let mut v = victim(crc);
        v.mr.fill(0xee);
        recv(&v, 5, 0, 3000);
        let seg: Vec<u8> = (0..1300u32).map(|i| (i % 251) as u8).collect();
        let mut wire = framed(
            &ulpdu(&UlpduRepr::send(Opcode::Send, None, Msn(1), 0, false, &seg)),
            crc,
        );
        let code = TermCode::from(TermError::RdmapUnexpectedOpcode);
        wire.extend(framed(
            &ulpdu(&UlpduRepr::terminate(Msn(1), TerminateRepr::new(code))),
            crc,
        ));
        // The header alone first: the payload then goes straight into the
        // receive, the Terminate into the read-ahead.
        v.send(&wire[..20]);
        std::thread::sleep(Duration::from_millis(5));
        v.send(&wire[20..]);
        v.wait_state(&[QpState::Error]);
        let wc = wait_wc(&v.cq, 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status),
            (5, WcStatus::WrFlush),
            "crc {crc}"
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(v.cq.poll_one().is_none(), "one completion only");
        let t = v.qp.last_terminate().expect("the peer's Terminate");
        assert_eq!((t.direction, t.code), (TerminateDirection::Received, code));
        let mem = v.mr.to_vec();
        assert_eq!(&mem[..1300], &seg[..]);
        assert!(mem[1300..].iter().all(|&b| b == 0xee));
    }
}
