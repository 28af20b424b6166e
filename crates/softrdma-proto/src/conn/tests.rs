//! Scripted exchanges: one [`Connection`] fed hand-made FPDUs.

use softrdma_wire::ddp::{Msn, Stag};
use softrdma_wire::errcode::TermError;
use softrdma_wire::fpdu;
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::rdmap::atomic::AtomicRequestRepr;
use softrdma_wire::rdmap::immediate::ImmediateDataRepr;
use softrdma_wire::rdmap::read_request::ReadRequestRepr;
use softrdma_wire::rdmap::terminate::TerminateRepr;
use softrdma_wire::ulpdu::{UlpduBody, UlpduRepr};

use super::*;
use crate::sim::{LOCAL_WRITE, REMOTE_ATOMIC, REMOTE_READ, REMOTE_WRITE, SimMemory};
use crate::types::{RecvWr, Sge};

struct T {
    c: Connection<usize>,
    m: SimMemory,
    crc: bool,
    read: (usize, u32, u64),
    cell: (usize, u32, u64),
}

fn setup(crc: bool) -> T {
    let mut m = SimMemory::new(0x10);
    let read = m.add_region(256, REMOTE_READ, |i| i as u8);
    let cell = m.add_region(8, REMOTE_ATOMIC, |_| 0);
    let mut cfg = Config::new(crc);
    cfg.ird = 1;
    T {
        c: Connection::new(cfg),
        m,
        crc,
        read,
        cell,
    }
}

impl T {
    /// A receive of `len` octets in a region of its own, posted as `wr_id`:
    /// the region's (index, key, address).
    fn post_recv_buf(&mut self, wr_id: u64, len: u32) -> (usize, u32, u64) {
        let (region, key, addr) = self.m.add_region(len as usize, LOCAL_WRITE, |_| 0);
        let sge = [Sge {
            lkey: key,
            addr,
            len,
        }];
        self.c
            .post_recv(&RecvWr { wr_id, sgl: &sge }, &mut self.m)
            .unwrap();
        (region, key, addr)
    }

    fn feed_ulpdu(&mut self, ulpdu: &[u8]) -> usize {
        let mut buf = vec![0u8; ulpdu.len() + 16];
        let n = fpdu::emit(ulpdu, self.crc, &mut buf).unwrap();
        self.c.handle_rx_stream(&buf[..n], &mut self.m)
    }

    fn feed(&mut self, u: &UlpduRepr<'_>, patch: impl FnOnce(&mut Vec<u8>)) -> usize {
        let mut b = vec![0u8; u.buffer_len()];
        u.emit(&mut b).unwrap();
        patch(&mut b);
        self.feed_ulpdu(&b)
    }

    fn read_req(&self, msn: u32) -> UlpduRepr<'static> {
        UlpduRepr::read_request(
            Msn(msn),
            ReadRequestRepr {
                sink_stag: Stag(7),
                sink_to: 0x1000,
                read_size: 16,
                src_stag: Stag(self.read.1),
                src_to: self.read.2,
            },
        )
    }

    /// The next FPDU sent, as bytes.
    fn sent(&mut self) -> Option<Vec<u8>> {
        let mut f = TxFpdu::new();
        if !self.c.poll_transmit(&mut self.m, &mut f) {
            return None;
        }
        let mut v = Vec::new();
        assert!(f.write_to(&mut self.m, &mut v));
        Some(v)
    }

    /// The Terminate this side sent, decoded: (error, M, D header len,
    /// segment length, R header len).
    fn terminate(&mut self) -> (Option<TermError>, bool, usize, u16, usize) {
        let f = self.sent().expect("a Terminate is sent");
        let d = fpdu::decode(&f, self.crc).unwrap();
        let u = UlpduRepr::parse(d.ulpdu).unwrap();
        assert_eq!(u.opcode, Opcode::Terminate);
        let UlpduBody::Terminate(t) = u.body else {
            panic!("not a Terminate body")
        };
        let hdr = t.ddp.map_or(0, |x| x.header.len());
        let seg = t.ddp.map_or(0, |x| x.segment_length);
        (
            t.error(),
            t.segment_length_valid,
            hdr,
            seg,
            t.rdmap_header.map_or(0, <[u8]>::len),
        )
    }

    fn outputs(&mut self) -> Vec<Output> {
        std::iter::from_fn(|| self.c.poll_output()).collect()
    }
}

/// Byte offsets inside an untagged DDP header.
const QN: usize = 6;
const MO: usize = 14;

fn set_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

#[test]
fn read_request_is_answered_from_local_memory() {
    let mut t = setup(true);
    let rr = t.read_req(1);
    t.feed(&rr, |_| {});
    assert_eq!(t.c.ird_used(), 1);
    let mut f = TxFpdu::new();
    assert!(t.c.poll_transmit(&mut t.m, &mut f));
    // Zero copy: the payload is a span into the read region.
    assert_eq!(f.payload().len(), 1);
    assert_eq!(f.payload()[0].region, t.read.0);
    let mut v = Vec::new();
    f.write_to(&mut t.m, &mut v);
    let d = fpdu::decode(&v, true).unwrap();
    let u = UlpduRepr::parse(d.ulpdu).unwrap();
    assert_eq!(u.opcode, Opcode::RdmaReadResponse);
    assert_eq!(u.body, UlpduBody::Payload(&(0u8..16).collect::<Vec<_>>()));
}

#[test]
fn read_request_on_the_send_queue_gets_invalid_qn() {
    let mut t = setup(true);
    let rr = t.read_req(1);
    t.feed(&rr, |b| set_u32(b, QN, 0));
    let (e, m, hdr, seg, _) = t.terminate();
    assert_eq!(e, Some(TermError::DdpUntaggedInvalidQn));
    // D and M set, the segment's header and payload length, like siw.
    assert!(m);
    assert_eq!((hdr, seg), (18, 28));
    assert_eq!(t.c.state(), QpState::Terminate);
}

#[test]
fn read_request_with_nonzero_mo_or_without_last_flag_is_refused() {
    let mut t = setup(false);
    let rr = t.read_req(1);
    t.feed(&rr, |b| set_u32(b, MO, 4));
    assert_eq!(t.terminate().0, Some(TermError::DdpUntaggedInvalidMo));

    let mut t = setup(false);
    t.feed(&rr, |b| b[0] &= !0x40);
    assert_eq!(t.terminate().0, Some(crate::term::MALFORMED_HEADER));
}

#[test]
fn protection_error_on_read_request_copies_its_rdmap_header() {
    let mut t = setup(true);
    let mut rr = t.read_req(1);
    if let UlpduBody::ReadRequest(ref mut r) = rr.body {
        r.src_stag = Stag(0xdead);
    }
    t.feed(&rr, |_| {});
    let (e, m, hdr, seg, r) = t.terminate();
    assert_eq!(e, Some(TermError::RdmapInvalidStag));
    assert!(m);
    assert_eq!((hdr, seg, r), (18, 28, 28));
    let ev = t.outputs();
    assert!(ev.iter().any(|o| matches!(
        o,
        Output::Event(AsyncEvent {
            kind: AsyncKind::QpAccessError,
            ..
        })
    )));
}

#[test]
fn atomic_immediate_and_terminate_on_wrong_queues_get_invalid_qn() {
    let mut t = setup(true);
    let a = UlpduRepr::atomic_request(
        Msn(1),
        AtomicRequestRepr::fetch_add(1, Stag(t.cell.1), t.cell.2, 1),
    );
    t.feed(&a, |b| set_u32(b, QN, 0));
    assert_eq!(t.terminate().0, Some(TermError::DdpUntaggedInvalidQn));

    let mut t = setup(true);
    let i = UlpduRepr::immediate(Msn(1), ImmediateDataRepr::from_be_u64(5), false);
    t.feed(&i, |b| set_u32(b, QN, 1));
    assert_eq!(t.terminate().0, Some(TermError::DdpUntaggedInvalidQn));

    let mut t = setup(true);
    let term = UlpduRepr::terminate(Msn(1), TerminateRepr::new(TermError::RdmapInvalidStag));
    t.feed(&term, |b| set_u32(b, QN, 0));
    assert_eq!(t.terminate().0, Some(TermError::DdpUntaggedInvalidQn));
}

#[test]
fn unknown_atomic_opcode_gets_the_remote_operation_code() {
    let mut t = setup(true);
    let a = UlpduRepr::atomic_request(
        Msn(1),
        AtomicRequestRepr::fetch_add(1, Stag(t.cell.1), t.cell.2, 1),
    );
    // AOpCode is the low nibble of the first body word.
    t.feed(&a, |b| b[18 + 3] = 0x0f);
    let e = t.terminate().0;
    assert_eq!(e, Some(crate::term::UNSUPPORTED_ATOMIC));
    assert_ne!(e, Some(TermError::DdpLocalCatastrophic));
}

#[test]
fn ulpdu_shorter_than_its_ddp_header_gets_a_terminate() {
    let mut t = setup(false);
    // ULPDU length 4: cannot hold any DDP header.
    t.c.handle_rx_stream(&[0, 4, 0x41, 0x43, 0, 0, 0, 0, 0, 0], &mut t.m);
    let (e, m, hdr, _, _) = t.terminate();
    assert_eq!(e, Some(crate::term::MALFORMED_HEADER));
    assert!(!m && hdr == 0, "no complete header to copy");
    assert!(!t.outputs().contains(&Output::Link(LinkAction::Reset)));
    t.c.handle_sent(1);
    assert_eq!(t.c.state(), QpState::Error);
    assert!(t.outputs().contains(&Output::Link(LinkAction::Shutdown)));
}

#[test]
fn corrupted_consumed_header_with_crc_is_a_crc_error_not_a_peer_violation() {
    let mut t = setup(true);
    let rr = t.read_req(1);
    let mut b = vec![0u8; rr.buffer_len()];
    rr.emit(&mut b).unwrap();
    let mut w = vec![0u8; 96];
    let n = fpdu::emit(&b, true, &mut w).unwrap();
    w[2 + 10] ^= 0x10; // a bit of the MSN
    t.c.handle_rx_stream(&w[..n], &mut t.m);
    assert_eq!(t.terminate().0, Some(TermError::MpaCrcError));
    assert_eq!(t.c.ird_used(), 0);
}

/// Like Linux siw: a placed segment's header is refused before its payload
/// and CRC are read, so a bit flipped in transit in a Send's MSN (or a
/// Write's STag) is answered with the header's verdict, not "MPA CRC
/// Error", and nothing of the payload is placed.
#[test]
fn corrupted_placed_header_with_crc_gets_its_header_verdict_like_siw() {
    let mut t = setup(true);
    let (_, key, addr) = t.post_recv_buf(9, 64);
    let send = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"hello");
    let mut b = vec![0u8; send.buffer_len()];
    send.emit(&mut b).unwrap();
    let mut w = vec![0u8; 64];
    let n = fpdu::emit(&b, true, &mut w).unwrap();
    w[2 + 12] ^= 0x10; // a bit of the MSN
    // Only the header is taken: the rest of the FPDU is never read.
    let used = t.c.handle_rx_stream(&w[..n], &mut t.m);
    assert_eq!(used, 2 + 18);
    let (e, m, hdr, seg, _) = t.terminate();
    assert_eq!(e, Some(TermError::DdpUntaggedMsnRange));
    assert!(m && hdr == 18 && seg == 5);
    let c = t.c.poll_completion().expect("the receive is flushed");
    assert_eq!((c.wr_id, c.status), (9, WcStatus::WrFlush));
    let mut placed = [0u8; 5];
    let span = t.m.local(key, addr, 5, false).unwrap();
    assert!(t.m.copy_out(&span, 0, &mut placed));
    assert_eq!(placed, [0; 5]);
}

#[test]
fn ird_slot_is_free_once_the_response_is_handed_out() {
    let mut t = setup(true);
    let r1 = t.read_req(1);
    t.feed(&r1, |_| {});
    assert!(t.sent().is_some()); // the Read Response, not yet written
    assert_eq!(t.c.ird_used(), 0);
    // The peer got the response and asks again before our write returns.
    let r2 = t.read_req(2);
    t.feed(&r2, |_| {});
    assert_eq!(t.c.state(), QpState::Rts);
    assert!(t.sent().is_some());
}

#[test]
fn graceful_close_keeps_receive_completion_order() {
    let mut t = setup(false);
    let mut regs = Vec::new();
    for wr_id in 1..=2 {
        let (_, key, addr) = t.post_recv_buf(wr_id, 64);
        regs.push((key, addr));
    }
    // First segment of a two-segment Send, then a local close.
    let s1 = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, false, b"abcd");
    t.feed(&s1, |_| {});
    t.c.close(0);
    let s2 = UlpduRepr::send(Opcode::Send, None, Msn(1), 4, true, b"efgh");
    t.feed(&s2, |_| {});
    assert!(t.sent().is_none()); // nothing queued: FIN
    t.c.handle_fin(1);
    let c: Vec<(u64, WcStatus)> = std::iter::from_fn(|| t.c.poll_completion())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, [(1, WcStatus::Success), (2, WcStatus::WrFlush)]);
    assert_eq!(t.c.state(), QpState::Idle);
}

#[test]
fn terminate_received_fails_the_outstanding_read_with_its_code() {
    let mut t = setup(true);
    let (_, key, addr) = t.m.add_region(16, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 16,
    }];
    let wr = SendWr::new(
        9,
        SendOp::Read {
            rkey: 0x77,
            remote_addr: 0,
        },
        &sge,
    );
    t.c.post_send(&wr, &mut t.m).unwrap();
    assert!(t.sent().is_some());
    let term = UlpduRepr::terminate(Msn(1), TerminateRepr::new(TermError::RdmapInvalidStag));
    t.feed(&term, |_| {});
    let c = t.c.poll_completion().unwrap();
    assert_eq!((c.wr_id, c.status), (9, WcStatus::RemoteAccess));
    assert_eq!(c.vendor_err, 0x0100);
    assert_eq!(t.c.state(), QpState::Error);
    assert!(t.outputs().contains(&Output::Link(LinkAction::Reset)));
}

#[test]
fn send_with_immediate_marks_the_reserved_field() {
    let mut t = setup(false);
    let (_, key, addr) = t.m.add_region(4, 0, |_| 1);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 4,
    }];
    let wr = SendWr::new(
        1,
        SendOp::Send {
            inv: None,
            imm: Some(0xabcd),
        },
        &sge,
    );
    t.c.post_send(&wr, &mut t.m).unwrap();
    let f = t.sent().unwrap();
    assert_eq!(&f[4..8], &SEND_IMM_FOLLOWS.to_be_bytes());
    let g = t.sent().unwrap();
    let u = UlpduRepr::parse(fpdu::decode(&g, false).unwrap().ulpdu).unwrap();
    assert_eq!(u.opcode, Opcode::ImmediateData);
    assert_eq!(
        u.body,
        UlpduBody::Immediate(ImmediateDataRepr::from_be_u64(0xabcd))
    );
    // Completes when both FPDUs are written.
    t.c.handle_sent(1);
    assert!(t.c.poll_completion().is_none());
    t.c.handle_sent(1);
    assert_eq!(t.c.poll_completion().unwrap().status, WcStatus::Success);
}

#[test]
fn write_outside_the_granted_range_is_refused_before_placement() {
    let mut t = setup(true);
    let (r, key, addr) = t.m.add_region(8, REMOTE_WRITE, |_| 0);
    let w = UlpduRepr::tagged(Opcode::RdmaWrite, Stag(key), addr + 4, true, b"12345678");
    t.feed(&w, |_| {});
    assert_eq!(t.terminate().0, Some(TermError::DdpTaggedBaseOrBounds));
    assert_eq!(t.m.region(r), &[0; 8]);
    t.m.check_canaries().unwrap();
}

/// The engine's placement mode: payload read straight into the span
/// `rx_want` names, reported by length only; the core feeds it to the CRC
/// through `Memory::crc_update` (no copy). A byte that differs from what was sent (placed wrong, or changed in
/// transit) is a CRC error.
fn placed_in_place(corrupt: bool) -> (Connection<usize>, SimMemory, usize, Vec<u8>) {
    let mut m = SimMemory::new(0x10);
    let (r, stag, to) = m.add_region(10_000, REMOTE_WRITE, |_| 0);
    let mut c: Connection<usize> = Connection::new(Config::new(true));
    let data: Vec<u8> = (0..9000u32).map(|i| (i % 251) as u8).collect();
    let u = UlpduRepr::tagged(Opcode::RdmaWrite, Stag(stag), to + 500, true, &data);
    let mut b = vec![0u8; u.buffer_len()];
    u.emit(&mut b).unwrap();
    let mut f = vec![0u8; b.len() + 16];
    let n = fpdu::emit(&b, true, &mut f).unwrap();
    f.truncate(n);
    let mut at = 0;
    while at < f.len() {
        match c.rx_want() {
            RxWant::Bytes { len } => {
                let k = len.min(f.len() - at).min(7);
                at += c.handle_rx_bytes(&f[at..at + k], &mut m);
            }
            RxWant::Place { dst } => {
                let k = dst.len.min(f.len() - at).min(3000);
                let mut chunk = f[at..at + k].to_vec();
                if corrupt && at < 5000 && 5000 <= at + k {
                    chunk[5000 - at] ^= 0x10;
                }
                assert!(m.copy_in(&dst, 0, &chunk));
                assert_eq!(c.handle_rx_placed_in(k, &mut m), k);
                at += k;
            }
            RxWant::Closed => break,
        }
    }
    (c, m, r, data)
}

#[test]
fn placement_reported_by_length_is_checked_by_the_crc() {
    let (c, m, r, data) = placed_in_place(false);
    assert_eq!(c.state(), QpState::Rts);
    let region = m.region(r);
    assert_eq!(&region[500..9500], &data[..]);
    assert!(region[..500].iter().all(|&b| b == 0));

    let (mut c, mut m, _, _) = placed_in_place(true);
    assert_eq!(c.state(), QpState::Terminate);
    let mut t = TxFpdu::new();
    assert!(c.poll_transmit(&mut m, &mut t));
    let mut v = Vec::new();
    assert!(t.write_to(&mut m, &mut v));
    let f = fpdu::decode(&v, true).unwrap();
    let UlpduBody::Terminate(term) = UlpduRepr::parse(f.ulpdu).unwrap().body else {
        panic!("not a Terminate");
    };
    assert_eq!(term.code.known(), Some(TermError::MpaCrcError));
}

#[test]
fn inline_send_is_copied_at_post_and_framed_from_the_copy() {
    let mut t = setup(true);
    let data: Vec<u8> = (0..40u8).collect();
    let wr = SendWr::new(
        5,
        SendOp::Send {
            inv: None,
            imm: None,
        },
        &[],
    )
    .with_inline(&data);
    t.c.post_send(&wr, &mut t.m).unwrap();
    drop(data); // the caller's buffer is free at once
    let mut f = TxFpdu::new();
    assert!(t.c.poll_transmit(&mut t.m, &mut f));
    assert!(
        f.payload().is_empty(),
        "no span: the bytes are the core's copy"
    );
    let mut v = Vec::new();
    assert!(f.write_to(&mut t.m, &mut v));
    let d = fpdu::decode(&v, true).unwrap();
    let u = UlpduRepr::parse(d.ulpdu).unwrap();
    assert_eq!(u.opcode, Opcode::Send);
    assert!(u.last);
    let UlpduBody::Payload(p) = u.body else {
        panic!("no payload")
    };
    assert_eq!(p, (0..40u8).collect::<Vec<_>>().as_slice());
    t.c.handle_sent(1);
    let c = t.c.poll_completion().expect("the Send completes");
    assert_eq!((c.wr_id, c.status, c.byte_len), (5, WcStatus::Success, 40));
}

#[test]
fn inline_write_longer_than_one_head_buffer_is_segmented() {
    let mut t = setup(false);
    let mut cfg = *t.c.config();
    cfg.max_inline = 600;
    cfg.max_payload = 4096;
    t.c = Connection::new(cfg);
    let data: Vec<u8> = (0..600).map(|i| (i * 7) as u8).collect();
    let op = SendOp::Write {
        rkey: 0x77,
        remote_addr: 0x1000,
        imm: None,
    };
    t.c.post_send(&SendWr::new(6, op, &[]).with_inline(&data), &mut t.m)
        .unwrap();
    let mut got = Vec::new();
    let mut fpdus = 0;
    while let Some(v) = t.sent() {
        let d = fpdu::decode(&v, false).unwrap();
        let u = UlpduRepr::parse(d.ulpdu).unwrap();
        assert_eq!(u.opcode, Opcode::RdmaWrite);
        match u.address {
            softrdma_wire::ulpdu::DdpAddress::Tagged { stag, to } => {
                assert_eq!(stag, Stag(0x77));
                assert_eq!(to, 0x1000 + got.len() as u64);
            }
            a => panic!("untagged {a:?}"),
        }
        let UlpduBody::Payload(p) = u.body else {
            panic!("no payload")
        };
        got.extend_from_slice(p);
        fpdus += 1;
        assert_eq!(u.last, got.len() == data.len());
    }
    assert_eq!(got, data);
    assert_eq!(fpdus, 3, "256 + 256 + 88 bytes");
    t.c.handle_sent(fpdus);
    let c = t.c.poll_completion().expect("the Write completes");
    assert_eq!((c.wr_id, c.status, c.byte_len), (6, WcStatus::Success, 600));
}

#[test]
fn inline_payload_is_refused_when_too_long_or_on_a_read() {
    let mut t = setup(false);
    let data = [0u8; 65];
    let send = SendOp::Send {
        inv: None,
        imm: None,
    };
    assert_eq!(
        t.c.post_send(&SendWr::new(1, send, &[]).with_inline(&data), &mut t.m),
        Err(PostError::InlineTooLarge { len: 65, max: 64 })
    );
    let read = SendOp::Read {
        rkey: 1,
        remote_addr: 0,
    };
    assert!(matches!(
        t.c.post_send(&SendWr::new(2, read, &[]).with_inline(&data[..8]), &mut t.m),
        Err(PostError::Invalid(_))
    ));
    assert_eq!(t.c.send_queue_len(), 0);
}

#[test]
fn more_sges_than_the_caps_are_refused_at_post() {
    let mut t = setup(false);
    let (_, key, addr) = t.m.add_region(64, LOCAL_WRITE, |_| 0);
    let sge = Sge {
        lkey: key,
        addr,
        len: 8,
    };
    let five = [sge; 5];
    let send = SendOp::Send {
        inv: None,
        imm: None,
    };
    assert_eq!(
        t.c.post_send(&SendWr::new(1, send, &five), &mut t.m),
        Err(PostError::TooManySges { count: 5, max: 4 })
    );
    assert_eq!(
        t.c.post_recv(
            &RecvWr {
                wr_id: 2,
                sgl: &five
            },
            &mut t.m
        ),
        Err(PostError::TooManySges { count: 5, max: 4 })
    );
    assert!(
        t.c.post_send(&SendWr::new(3, send, &five[..4]), &mut t.m)
            .is_ok()
    );
    assert!(
        t.c.post_recv(
            &RecvWr {
                wr_id: 4,
                sgl: &five[..4]
            },
            &mut t.m
        )
        .is_ok()
    );
    assert_eq!((t.c.send_queue_len(), t.c.recv_queue_len()), (1, 1));
}

/// The proxy offload's view of a receive: with `Config::message_info` a
/// Send reports its first segment's opcode and header and the receive's
/// buffers, a Write with Immediate the Write before it.
#[test]
fn message_info_reports_a_sends_first_segment_and_the_write_before_an_immediate() {
    let mut t = setup(false);
    let mut cfg = *t.c.config();
    cfg.message_info = true;
    t.c = Connection::new(cfg);
    let (_, key, addr) = t.m.add_region(64, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 64,
    }];
    for wr_id in [1, 2] {
        t.c.post_recv(&RecvWr { wr_id, sgl: &sge }, &mut t.m)
            .unwrap();
    }
    let first = UlpduRepr::send(
        Opcode::SendWithSolicitedEvent,
        None,
        Msn(1),
        0,
        false,
        b"hello",
    );
    let mut first_hdr = vec![0u8; first.buffer_len()];
    first.emit(&mut first_hdr).unwrap();
    t.feed(&first, |_| {});
    t.feed(
        &UlpduRepr::send(
            Opcode::SendWithSolicitedEvent,
            None,
            Msn(1),
            5,
            true,
            b"!!!",
        ),
        |_| {},
    );
    let (c, info) = t.c.poll_completion_with_info().expect("the Send completes");
    assert_eq!((c.wr_id, c.status, c.byte_len), (1, WcStatus::Success, 8));
    let Some(MsgInfo::Send {
        opcode,
        header,
        segs,
        inv,
    }) = info
    else {
        panic!("no Send info: {info:?}")
    };
    assert_eq!(opcode, Opcode::SendWithSolicitedEvent);
    assert_eq!(header[..], first_hdr[..18]);
    assert_eq!(segs, vec![t.m.local(key, addr, 64, true).unwrap()]);
    assert_eq!(inv, None);

    // A Write in two segments, then Immediate Data (Write with Immediate).
    let (_, wkey, waddr) = t.m.add_region(16, REMOTE_WRITE, |_| 0);
    let w1 = UlpduRepr::tagged(Opcode::RdmaWrite, Stag(wkey), waddr, false, b"abcd");
    let mut w1_hdr = vec![0u8; w1.buffer_len()];
    w1.emit(&mut w1_hdr).unwrap();
    t.feed(&w1, |_| {});
    t.feed(
        &UlpduRepr::tagged(Opcode::RdmaWrite, Stag(wkey), waddr + 4, true, b"efgh"),
        |_| {},
    );
    t.feed(
        &UlpduRepr::immediate(Msn(2), ImmediateDataRepr::from_be_u64(77), false),
        |_| {},
    );
    let (c, info) =
        t.c.poll_completion_with_info()
            .expect("the Write with Immediate");
    assert_eq!(
        (c.wr_id, c.opcode, c.imm),
        (2, WcOpcode::RecvRdmaWithImm, Some(77))
    );
    let Some(MsgInfo::Write { write: Some(w) }) = info else {
        panic!("no Write info: {info:?}")
    };
    assert_eq!((w.stag, w.to, w.len), (wkey, waddr, 8));
    assert_eq!(w.header[..], w1_hdr[..14]);
}

#[test]
fn without_message_info_nothing_is_reported() {
    let mut t = setup(false);
    t.post_recv_buf(1, 64);
    t.feed(
        &UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"x"),
        |_| {},
    );
    let (c, info) = t.c.poll_completion_with_info().unwrap();
    assert_eq!(c.status, WcStatus::Success);
    assert_eq!(info, None);
}

/// A request that failed its checks at post time waits until the requests
/// framed before it are written: they complete (here: successfully), not
/// flushed by the ERROR the failure causes.
#[test]
fn failed_request_waits_for_the_requests_written_before_it() {
    let mut t = setup(false);
    let (_, key, addr) = t.m.add_region(64, LOCAL_WRITE, |_| 1);
    let good = [Sge {
        lkey: key,
        addr,
        len: 16,
    }];
    let bad = [Sge {
        lkey: key ^ 0x11,
        addr,
        len: 16,
    }];
    let send = |id, sgl| {
        SendWr::new(
            id,
            SendOp::Send {
                inv: None,
                imm: None,
            },
            sgl,
        )
    };
    t.c.post_send(&send(1, &good[..]), &mut t.m).unwrap();
    t.c.post_send(&send(2, &bad[..]), &mut t.m).unwrap();
    t.c.post_send(&send(3, &good[..]), &mut t.m).unwrap();
    assert!(t.sent().is_some(), "request 1 is framed");
    assert!(t.sent().is_none(), "request 2 waits for request 1's write");
    assert_eq!(t.c.state(), QpState::Rts);
    t.c.handle_sent(1);
    assert!(t.sent().is_none(), "request 2 fails, nothing more is sent");
    let c: Vec<(u64, WcStatus)> = std::iter::from_fn(|| t.c.poll_completion())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        c,
        [
            (1, WcStatus::Success),
            (2, WcStatus::LocalProtection),
            (3, WcStatus::WrFlush)
        ]
    );
    assert_eq!(t.c.state(), QpState::Error);
}

/// After a graceful close (IDLE) posts are accepted and flushed at once,
/// as in ERROR (the engine's rule, like siw's QP ending its close in
/// ERROR): the drain idiom works.
#[test]
fn posts_after_a_graceful_close_are_flushed() {
    let mut t = setup(false);
    t.c.close(0);
    assert!(t.sent().is_none());
    t.c.handle_fin(1);
    let _ = t.outputs();
    assert_eq!(t.c.state(), QpState::Idle);
    let (_, key, addr) = t.m.add_region(64, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 8,
    }];
    let send = SendWr::new(
        1,
        SendOp::Send {
            inv: None,
            imm: None,
        },
        &sge,
    );
    t.c.post_send(&send, &mut t.m).unwrap();
    t.c.post_recv(
        &RecvWr {
            wr_id: 2,
            sgl: &sge,
        },
        &mut t.m,
    )
    .unwrap();
    let c: Vec<(u64, WcStatus)> = std::iter::from_fn(|| t.c.poll_completion())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(c, [(1, WcStatus::WrFlush), (2, WcStatus::WrFlush)]);
    assert_eq!(t.c.recv_queue_len(), 0);
}

/// An SRQ-attached connection that sends a Terminate reports the SRQ's
/// last WQE event when it reaches ERROR (after the Terminate is written),
/// as it does on every other way into ERROR and as the engine does.
#[test]
fn terminate_sent_on_an_srq_connection_reports_the_last_wqe() {
    let mut t = setup(false);
    let mut cfg = *t.c.config();
    cfg.srq = true;
    t.c = Connection::new(cfg);
    let rr = t.read_req(1);
    t.feed(&rr, |b| set_u32(b, QN, 0));
    assert!(t.sent().is_some(), "the Terminate");
    t.c.handle_sent(1);
    assert_eq!(t.c.state(), QpState::Error);
    let kinds: Vec<AsyncKind> = t
        .outputs()
        .into_iter()
        .filter_map(|o| match o {
            Output::Event(e) => Some(e.kind),
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds,
        [AsyncKind::QpRequestError, AsyncKind::QpLastWqeReached]
    );
}

/// A request posted as the engine's own (`SendWr::internal`, a proxy's
/// reply) reports its completion even unsignaled and successful, flagged;
/// a prepared request is checked at once and queued only when posted.
#[test]
fn internal_and_prepared_requests() {
    let mut t = setup(false);
    let (_, key, addr) = t.m.add_region(64, LOCAL_WRITE, |_| 1);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 8,
    }];
    let mut wr = SendWr::new(
        1,
        SendOp::Send {
            inv: None,
            imm: None,
        },
        &sge,
    );
    wr.signaled = false;
    wr.internal = true;
    let p = t.c.prepare_send(&wr, &mut t.m).unwrap();
    assert_eq!(p.wr_id(), 1);
    assert_eq!(t.c.send_queue_len(), 0, "prepared, not queued");
    assert!(t.sent().is_none());
    let mut plain = SendWr::new(
        2,
        SendOp::Send {
            inv: None,
            imm: None,
        },
        &sge,
    );
    plain.signaled = false;
    t.c.post_prepared(p).unwrap();
    t.c.post_send(&plain, &mut t.m).unwrap();
    assert!(t.sent().is_some() && t.sent().is_some());
    t.c.handle_sent(2);
    let c: Vec<(u64, WcStatus, bool)> = std::iter::from_fn(|| t.c.poll_completion())
        .map(|c| (c.wr_id, c.status, c.internal))
        .collect();
    assert_eq!(
        c,
        [(1, WcStatus::Success, true)],
        "the unsignaled plain one is silent"
    );

    // Checked at preparation: a malformed request is refused then.
    let bad = SendWr::new(
        3,
        SendOp::Read {
            rkey: 1,
            remote_addr: 0,
        },
        &[],
    );
    assert!(matches!(
        t.c.prepare_send(&bad, &mut t.m),
        Err(PostError::Invalid(_))
    ));
    // And the state at posting: after an abort, a prepared request is
    // flushed like any post in ERROR.
    let p = t.c.prepare_send(&wr, &mut t.m).unwrap();
    t.c.abort();
    t.c.post_prepared(p).unwrap();
    let c: Vec<(u64, WcStatus, bool)> = std::iter::from_fn(|| t.c.poll_completion())
        .map(|c| (c.wr_id, c.status, c.internal))
        .collect();
    assert_eq!(c, [(1, WcStatus::WrFlush, true)]);
}

/// A consumed receive put back (a proxy recycling its buffer) is used by
/// the next Send; refused when receives are no longer accepted.
#[test]
fn reposted_receive_takes_the_next_send() {
    let mut t = setup(false);
    let (region, _, _) = t.post_recv_buf(7, 16);
    let s1 = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"first");
    t.feed(&s1, |_| {});
    let c = t.c.poll_completion().unwrap();
    assert_eq!((c.wr_id, c.byte_len), (7, 5));
    let span = Span {
        region,
        offset: 0,
        len: 16,
    };
    assert!(t.c.repost_recv(7, vec![span.clone()]));
    assert_eq!(t.c.recv_queue_len(), 1);
    let s2 = UlpduRepr::send(Opcode::Send, None, Msn(2), 0, true, b"second!");
    t.feed(&s2, |_| {});
    let c = t.c.poll_completion().unwrap();
    assert_eq!((c.wr_id, c.byte_len, c.status), (7, 7, WcStatus::Success));
    t.c.abort();
    assert!(!t.c.repost_recv(7, vec![span]), "not in ERROR");
}

/// The application's move to TERMINATE: a Terminate with the given code,
/// no header copied, everything flushed, ERROR once it is written.
#[test]
fn local_terminate_sends_its_code_then_errors() {
    let mut t = setup(false);
    t.post_recv_buf(7, 16);
    t.c.terminate(TermError::RdmapLocalCatastrophic);
    assert_eq!(t.c.state(), QpState::Terminate);
    let (e, m, hdr, _, _) = t.terminate();
    assert_eq!(e, Some(TermError::RdmapLocalCatastrophic));
    assert!(!m);
    assert_eq!(hdr, 0);
    t.c.handle_sent(1);
    assert_eq!(t.c.state(), QpState::Error);
    let c = t.c.poll_completion().unwrap();
    assert_eq!((c.wr_id, c.status), (7, WcStatus::WrFlush));
}

/// With `Config::confirm_fin` the close finishes only once the engine says
/// its FIN went out; a FIN that could not be sent (the peer's reset after
/// its own FIN) is a reset, not a graceful close.
#[test]
fn confirmed_fin_finishes_the_close_and_a_failed_one_is_a_reset() {
    for ok in [true, false] {
        let mut t = setup(false);
        let mut cfg = *t.c.config();
        cfg.confirm_fin = true;
        t.c = Connection::new(cfg);
        t.c.handle_fin(0); // the peer closes first
        assert!(t.sent().is_none());
        assert!(
            t.outputs().contains(&Output::Link(LinkAction::SendFin)),
            "our FIN is asked for"
        );
        assert_eq!(t.c.state(), QpState::Closing, "not before it is sent");
        t.c.handle_fin_sent(ok);
        let want = if ok { QpState::Idle } else { QpState::Error };
        assert_eq!(t.c.state(), want);
        let kinds: Vec<AsyncKind> = t
            .outputs()
            .into_iter()
            .filter_map(|o| match o {
                Output::Event(e) => Some(e.kind),
                _ => None,
            })
            .collect();
        let want = if ok {
            AsyncKind::LlpClosed
        } else {
            AsyncKind::LlpReset
        };
        assert_eq!(kinds, [want]);
    }
}

/// A consumed message longer than any valid one gets its Terminate at its
/// header, without waiting for bytes that may never come (as the engine).
#[test]
fn oversized_consumed_message_is_refused_at_its_header() {
    let mut t = setup(false);
    // An Atomic Request header claiming a 40000-byte ULPDU, and nothing
    // more of it.
    let mut b = vec![0u8; 2 + 18];
    b[..2].copy_from_slice(&40000u16.to_be_bytes());
    b[2] = 0x41;
    b[3] = softrdma_wire::rdmap::control_byte(Opcode::AtomicRequest);
    set_u32(&mut b[2..], QN, 1);
    t.c.handle_rx_stream(&b, &mut t.m);
    assert_eq!(t.terminate().0, Some(crate::term::MALFORMED_HEADER));
}

/// A `max_payload` of 65536 (the whole 16-bit ULPDU length, without room
/// for the DDP/RDMAP header) framed nothing: every FPDU's ULPDU length
/// overflowed, `poll_transmit` said "nothing to send" after moving the
/// request on, and the Write never completed. The connection now clamps
/// the payload to what fits beside the largest header.
#[test]
fn max_payload_of_65536_is_clamped_and_a_large_write_is_framed() {
    for crc in [false, true] {
        let mut t = setup(crc);
        let mut cfg = *t.c.config();
        cfg.max_payload = 65536;
        t.c = Connection::new(cfg);
        assert!(t.c.config().max_payload + softrdma_wire::ddp::UNTAGGED_HEADER_LEN <= 65535);
        let len = 200 * 1024;
        let (_, key, addr) = t.m.add_region(len, LOCAL_WRITE, |i| (i * 13) as u8);
        let sge = [Sge {
            lkey: key,
            addr,
            len: len as u32,
        }];
        let op = SendOp::Write {
            rkey: 0x77,
            remote_addr: 0,
            imm: None,
        };
        t.c.post_send(&SendWr::new(9, op, &sge), &mut t.m).unwrap();
        let mut got = Vec::new();
        let mut fpdus = 0;
        while let Some(v) = t.sent() {
            let d = fpdu::decode(&v, crc).unwrap();
            let u = UlpduRepr::parse(d.ulpdu).unwrap();
            let UlpduBody::Payload(p) = u.body else {
                panic!("no payload")
            };
            got.extend_from_slice(p);
            fpdus += 1;
            assert_eq!(u.last, got.len() == len);
        }
        assert_eq!(got.len(), len, "crc {crc}: every byte framed");
        assert!(got.iter().enumerate().all(|(i, &b)| b == (i * 13) as u8));
        assert_eq!(fpdus, 4, "crc {crc}: 3 full FPDUs and the rest");
        t.c.handle_sent(fpdus);
        let c = t.c.poll_completion().expect("the Write completes");
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (9, WcStatus::Success, len as u32)
        );
    }
}

/// A `max_payload` of 0 would frame empty FPDUs forever: it is at least 1.
#[test]
fn max_payload_of_zero_is_raised_to_one() {
    let mut cfg = Config::new(false);
    cfg.max_payload = 0;
    let c: Connection<usize> = Connection::new(cfg);
    assert_eq!(c.config().max_payload, 1);
}

/// The engine changes the largest FPDU payload of a live connection (it
/// follows the socket's MSS): a change takes effect at the next FPDU, also
/// inside a Write, a Send and a Read Response, and the peer still gets
/// every byte in place and every request completes exactly once.
#[test]
fn max_payload_changed_mid_message_delivers_byte_exact_data() {
    for crc in [false, true] {
        let len = 40_000usize;
        let mut cfg = Config::new(crc);
        cfg.max_payload = 1000;
        let mut a: Connection<usize> = Connection::new(cfg);
        let mut b: Connection<usize> = Connection::new(cfg);
        let mut ma = SimMemory::new(0x10);
        let mut mb = SimMemory::new(0x1000);
        let src_fill = |i: usize| (i * 7 + i / 251) as u8;
        let (_, src_key, src_addr) = ma.add_region(len, REMOTE_READ, src_fill);
        let (dst_r, dst_key, dst_addr) = mb.add_region(len, REMOTE_WRITE, |_| 0);
        let (recv_r, recv_key, recv_addr) = mb.add_region(len, LOCAL_WRITE, |_| 0);
        let (sink_r, sink_key, sink_addr) = mb.add_region(len, LOCAL_WRITE, |_| 0);
        let sge = |lkey, addr| {
            [Sge {
                lkey,
                addr,
                len: len as u32,
            }]
        };
        b.post_recv(
            &RecvWr {
                wr_id: 30,
                sgl: &sge(recv_key, recv_addr),
            },
            &mut mb,
        )
        .unwrap();
        let write = SendOp::Write {
            rkey: dst_key,
            remote_addr: dst_addr,
            imm: None,
        };
        a.post_send(&SendWr::new(10, write, &sge(src_key, src_addr)), &mut ma)
            .unwrap();
        let send = SendOp::Send {
            inv: None,
            imm: None,
        };
        a.post_send(&SendWr::new(11, send, &sge(src_key, src_addr)), &mut ma)
            .unwrap();
        let read = SendOp::Read {
            rkey: src_key,
            remote_addr: src_addr,
        };
        b.post_send(&SendWr::new(20, read, &sge(sink_key, sink_addr)), &mut mb)
            .unwrap();
        // Sizes cycled one FPDU at a time (0 and 65536 are clamped).
        let sizes = [1000, 7, 4096, 0, 333, 65_536, 1, 12_000, 64];
        let (mut fa, mut fb) = (0usize, 0usize);
        let mut step = 0;
        let mut f = TxFpdu::new();
        let mut seen = std::collections::BTreeSet::new();
        loop {
            let mut any = false;
            let max = sizes[step % sizes.len()];
            step += 1;
            let kept = a.set_max_payload(max);
            assert_eq!(kept, max.clamp(1, MAX_PAYLOAD));
            if a.poll_transmit(&mut ma, &mut f) {
                let payload: usize = f.payload().iter().map(|s| s.len).sum();
                assert!(payload <= kept, "{payload} > {kept}");
                seen.insert(payload);
                let mut v = Vec::new();
                assert!(f.write_to(&mut ma, &mut v));
                assert_eq!(b.handle_rx_stream(&v, &mut mb), v.len());
                fa += 1;
                any = true;
            }
            if b.poll_transmit(&mut mb, &mut f) {
                let mut v = Vec::new();
                assert!(f.write_to(&mut mb, &mut v));
                assert_eq!(a.handle_rx_stream(&v, &mut ma), v.len());
                fb += 1;
                any = true;
            }
            if !any {
                break;
            }
        }
        // Segments of 1, 7, 64, 333, 1000, 4096, 12 000 and more bytes.
        assert!(seen.len() >= 7, "crc {crc}: FPDU payloads {seen:?}");
        a.handle_sent(fa);
        b.handle_sent(fb);
        let ca: Vec<_> = std::iter::from_fn(|| a.poll_completion()).collect();
        let cb: Vec<_> = std::iter::from_fn(|| b.poll_completion()).collect();
        let ids = |c: &[Completion]| {
            c.iter()
                .map(|c| (c.wr_id, c.status, c.byte_len))
                .collect::<Vec<_>>()
        };
        let n = len as u32;
        assert_eq!(
            ids(&ca),
            [(10, WcStatus::Success, n), (11, WcStatus::Success, n)]
        );
        let mut got = ids(&cb);
        got.sort_unstable_by_key(|c| c.0);
        assert_eq!(
            got,
            [(20, WcStatus::Success, n), (30, WcStatus::Success, n)]
        );
        let want: Vec<u8> = (0..len).map(src_fill).collect();
        for (what, r) in [("write", dst_r), ("send", recv_r), ("read", sink_r)] {
            assert!(mb.region(r) == want.as_slice(), "crc {crc}: {what} data");
        }
        assert!(mb.check_canaries().is_ok() && ma.check_canaries().is_ok());
        assert_eq!(a.state(), QpState::Rts);
        assert_eq!(b.state(), QpState::Rts);
    }
}

/// Inline buffers and gather/scatter lists are reused from one request to
/// the next: a shorter message after a longer one carries its own bytes
/// only, and every receive lands in its own buffer.
#[test]
fn reused_request_buffers_carry_only_their_own_bytes() {
    let mut t = setup(true);
    let send = SendOp::Send {
        inv: None,
        imm: None,
    };
    assert!(!t.c.may_transmit(), "nothing posted");
    for (i, len) in [60usize, 3, 0, 64, 17].into_iter().enumerate() {
        let data: Vec<u8> = (0..len).map(|k| (k as u8) ^ (i as u8 * 31)).collect();
        let wr = SendWr::new(i as u64, send, &[]).with_inline(&data);
        t.c.post_send(&wr, &mut t.m).unwrap();
        assert!(t.c.may_transmit());
        let f = t.sent().expect("the Send is framed");
        assert!(!t.c.may_transmit(), "the only request is framed");
        let d = fpdu::decode(&f, true).unwrap();
        let u = UlpduRepr::parse(d.ulpdu).unwrap();
        let UlpduBody::Payload(p) = u.body else {
            panic!("no payload")
        };
        assert_eq!(p, data.as_slice(), "send {i}");
        t.c.handle_sent(1);
        let c = t.c.poll_completion().expect("the Send completes");
        assert_eq!((c.wr_id, c.byte_len), (i as u64, len as u32));
    }
    for (i, len) in [8u32, 40, 2].into_iter().enumerate() {
        let (region, _, _) = t.post_recv_buf(100 + i as u64, len);
        let msg: Vec<u8> = (0..len as u8).map(|k| k.wrapping_add(i as u8)).collect();
        let s = UlpduRepr::send(Opcode::Send, None, Msn(1 + i as u32), 0, true, &msg);
        t.feed(&s, |_| {});
        let c = t.c.poll_completion().expect("the receive completes");
        assert_eq!(
            (c.wr_id, c.status, c.byte_len),
            (100 + i as u64, WcStatus::Success, len)
        );
        assert_eq!(&t.m.region(region)[..len as usize], msg.as_slice());
    }
}

/// A receive run that completes more receives than the old pool bound
/// (32) keeps every emptied scatter list, and the reposts that follow
/// take them instead of allocating (`malloc` and `free` per message in a
/// message-rate run with a deep receive queue).
#[test]
fn a_deep_receive_window_keeps_its_scatter_lists_for_the_reposts() {
    let mut t = setup(false);
    let n = 100u32;
    let mut stream = Vec::new();
    for i in 0..n {
        t.post_recv_buf(u64::from(i), 16);
        let s = UlpduRepr::send(Opcode::Send, None, Msn(1 + i), 0, true, b"x");
        let mut b = vec![0u8; s.buffer_len()];
        s.emit(&mut b).unwrap();
        let mut f = vec![0u8; b.len() + 16];
        let k = fpdu::emit(&b, false, &mut f).unwrap();
        stream.extend_from_slice(&f[..k]);
    }
    assert!(t.c.seg_pool.is_empty());
    // One run over all of them, as after one large read of the socket.
    assert_eq!(t.c.handle_rx_stream(&stream, &mut t.m), stream.len());
    for i in 0..n {
        let c = t.c.poll_completion().expect("every receive completes");
        assert_eq!((c.wr_id, c.status), (u64::from(i), WcStatus::Success));
    }
    assert_eq!(t.c.seg_pool.len(), n as usize, "every list kept");
    for i in 0..n {
        t.post_recv_buf(1000 + u64::from(i), 16);
    }
    assert!(t.c.seg_pool.is_empty(), "every repost took a kept list");
    // Bounded by what the queues hold.
    let mut small = setup(false);
    small.c.cfg.max_recv_wr = 8;
    small.c.cfg.max_send_wr = 8;
    assert_eq!(small.c.seg_pool_max(), POOL_MAX);
}
