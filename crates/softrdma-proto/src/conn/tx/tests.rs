//! The one-pass send (`post_send_framed`, `handle_sent_framed`) against
//! the general path (`post_send`, `poll_transmit`, `handle_sent`): the
//! same bytes, MSNs, completions and order, and a decline that changes
//! nothing.

use softrdma_wire::ddp::{Msn, Stag};
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::ulpdu::UlpduRepr;

use super::super::{Config, Connection};
use super::{SEND_NOW_MAX, TxFpdu};
use crate::qp_state::QpState;
use crate::sim::{LOCAL_WRITE, SimMemory};
use crate::types::{Completion, SendOp, SendWr, Sge};

fn conn(crc: bool, max_payload: usize) -> (Connection<usize>, SimMemory) {
    let mut cfg = Config::new(crc);
    cfg.max_inline = 256;
    cfg.max_payload = max_payload;
    (Connection::new(cfg), SimMemory::new(0x10))
}

const SEND: SendOp = SendOp::Send {
    inv: None,
    imm: None,
};

/// Every FPDU the general path hands out now, each reported written.
fn drain(c: &mut Connection<usize>, m: &mut SimMemory) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut f = TxFpdu::new();
    while c.poll_transmit(m, &mut f) {
        let mut v = Vec::new();
        assert!(f.write_to(m, &mut v));
        out.push(v);
        c.handle_sent(1);
    }
    out
}

fn completions(c: &mut Connection<usize>) -> Vec<Completion> {
    std::iter::from_fn(|| c.poll_completion()).collect()
}

/// Posts `wr` by the one pass if it is taken; `None` if declined (then
/// nothing was posted).
fn framed(c: &mut Connection<usize>, wr: &SendWr<'_>) -> Option<Vec<u8>> {
    let mut buf = [0xeeu8; SEND_NOW_MAX];
    let n = c.post_send_framed(wr, &mut buf)?;
    Some(buf[..n].to_vec())
}

#[test]
fn a_framed_send_is_golden() {
    let (mut c, _) = conn(true, 1024);
    let f = framed(&mut c, &SendWr::new(1, SEND, &[]).with_inline(b"hello")).unwrap();
    let want: &[u8] = &[
        0x00, 0x17, // ULPDU length: 18 + 5
        0x41, 0x43, // DDP: untagged, last, version 1; RDMAP: version 1, Send
        0, 0, 0, 0, // RsvdULP[8:39]
        0, 0, 0, 0, // QN 0
        0, 0, 0, 1, // MSN 1
        0, 0, 0, 0, // MO 0
        b'h', b'e', b'l', b'l', b'o', // payload
        0, 0, 0, // pad
        0xb9, 0x90, 0xb1, 0x0c, // CRC32C 0x0cb190b9, least significant byte first
    ];
    assert_eq!(f, want);
    let done = c.handle_sent_framed().expect("the completion, returned");
    assert_eq!((done.wr_id, done.byte_len), (1, 5));
    assert!(c.poll_completion().is_none(), "a completion given twice");
}

#[test]
fn a_framed_send_with_solicited_event_and_invalidate_is_golden() {
    let (mut c, _) = conn(false, 1024);
    let op = SendOp::Send {
        inv: Some(0xaabb_ccdd),
        imm: None,
    };
    let mut wr = SendWr::new(2, op, &[]).with_inline(b"abc");
    wr.solicited = true;
    let f = framed(&mut c, &wr).unwrap();
    let want: &[u8] = &[
        0x00, 0x15, // 18 + 3
        0x41, 0x46, // Send with Solicited Event and Invalidate
        0xaa, 0xbb, 0xcc, 0xdd, // the STag to invalidate
        0, 0, 0, 0, // QN 0
        0, 0, 0, 1, // MSN 1
        0, 0, 0, 0, // MO 0
        b'a', b'b', b'c', // payload
        0,    // pad
        0, 0, 0, 0, // no CRC
    ];
    assert_eq!(f, want);
}

/// Over every inline size, both CRC settings, two FPDU sizes, every Send
/// variant and signaled or not: each request posted by the one pass where
/// it is taken and by the general path on a second connection, the next
/// request (an inline one, and one from registered memory) always by the
/// general path on both; the bytes on the wire and the completions must
/// be the same, and the one pass must be taken exactly where one FPDU
/// holds the payload.
#[test]
fn framed_sends_put_the_general_paths_bytes_on_the_wire() {
    let variants = [
        (false, None),
        (true, None),
        (false, Some(0x1234_5678)),
        (true, Some(0x0102_0304)),
    ];
    for crc in [false, true] {
        for max_payload in [64, 1024] {
            let (mut g, mut gm) = conn(crc, max_payload);
            let (mut f, mut fm) = conn(crc, max_payload);
            let (_, gkey, gaddr) = gm.add_region(300, LOCAL_WRITE, |i| i as u8);
            let (_, fkey, faddr) = fm.add_region(300, LOCAL_WRITE, |i| i as u8);
            let mut id = 0u64;
            for len in 0..=256usize {
                let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
                let (solicited, inv) = variants[len % variants.len()];
                let mut wr =
                    SendWr::new(id, SendOp::Send { inv, imm: None }, &[]).with_inline(&data);
                wr.solicited = solicited;
                wr.signaled = len % 3 != 0;
                id += 1;
                g.post_send(&wr, &mut gm).unwrap();
                let want = drain(&mut g, &mut gm);
                let fits = len <= max_payload.min(256);
                match framed(&mut f, &wr) {
                    Some(bytes) => {
                        assert!(fits, "taken for {len} octets in FPDUs of {max_payload}");
                        assert_eq!(vec![bytes], want, "len {len} crc {crc} mp {max_payload}");
                        let c = f.handle_sent_framed();
                        assert_eq!(c.is_some(), wr.signaled);
                        let mut got: Vec<Completion> = c.into_iter().collect();
                        got.extend(completions(&mut f));
                        assert_eq!(got, completions(&mut g));
                    }
                    None => {
                        assert!(!fits, "declined for {len} octets");
                        f.post_send(&wr, &mut fm).unwrap();
                        assert_eq!(drain(&mut f, &mut fm), want);
                        assert_eq!(completions(&mut f), completions(&mut g));
                    }
                }
                // The general path after it: same MSNs, same bytes.
                let gs = [Sge {
                    lkey: gkey,
                    addr: gaddr,
                    len: 40,
                }];
                let fs = [Sge {
                    lkey: fkey,
                    addr: faddr,
                    len: 40,
                }];
                g.post_send(&SendWr::new(id, SEND, &gs), &mut gm).unwrap();
                f.post_send(&SendWr::new(id, SEND, &fs), &mut fm).unwrap();
                id += 1;
                assert_eq!(drain(&mut f, &mut fm), drain(&mut g, &mut gm));
                assert_eq!(completions(&mut f), completions(&mut g));
                assert_eq!(f.send_queue_len(), 0);
                assert_eq!(f.fpdus_in_flight(), 0);
            }
        }
    }
}

/// A request queued before it (an RDMA Write), or framed and not yet
/// written, makes the one pass decline without changing anything: the
/// Send goes by the general path, after the Write, with the next MSN.
#[test]
fn a_framed_send_waits_for_what_was_posted_before_it() {
    let (mut c, mut m) = conn(true, 1024);
    let (_, key, addr) = m.add_region(100, LOCAL_WRITE, |i| i as u8);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 100,
    }];
    let write = SendOp::Write {
        rkey: 0x99,
        remote_addr: 0x1000,
        imm: None,
    };
    let send = SendWr::new(2, SEND, &[]).with_inline(b"after the write");
    // Queued, not framed yet.
    c.post_send(&SendWr::new(1, write, &sge), &mut m).unwrap();
    assert_eq!(framed(&mut c, &send), None);
    assert_eq!(c.send_queue_len(), 1);
    // Framed, not yet written.
    let mut w = TxFpdu::new();
    assert!(c.poll_transmit(&mut m, &mut w));
    assert_eq!(framed(&mut c, &send), None);
    assert_eq!(c.send_queue_len(), 1);
    // The general path: the Send after the Write, MSN 1.
    c.post_send(&send, &mut m).unwrap();
    let rest = drain(&mut c, &mut m);
    assert_eq!(rest.len(), 1);
    let d = softrdma_wire::fpdu::decode(&rest[0], true).unwrap();
    let u = UlpduRepr::parse(d.ulpdu).unwrap();
    assert_eq!(u.opcode, Opcode::Send);
    assert_eq!(
        u.ddp_header(),
        UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, &[]).ddp_header()
    );
    c.handle_sent(1); // both FPDUs written (the last report)
    let ids: Vec<u64> = completions(&mut c).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [1, 2], "completions in posting order");
    // Idle again: the one pass is taken, with MSN 2.
    let f = framed(&mut c, &SendWr::new(3, SEND, &[]).with_inline(b"x")).unwrap();
    assert_eq!(&f[12..16], &[0, 0, 0, 2]);
}

/// What the one pass does not frame is declined, and nothing changes.
#[test]
fn a_framed_send_declines_what_it_does_not_frame() {
    let (mut c, mut m) = conn(false, 1024);
    let (_, key, addr) = m.add_region(64, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 8,
    }];
    let data = [5u8; 257];
    let imm = SendOp::Send {
        inv: None,
        imm: Some(7),
    };
    let write = SendOp::Write {
        rkey: 1,
        remote_addr: 0,
        imm: None,
    };
    let five = [sge[0]; 5];
    let cases: Vec<(&str, SendWr<'_>)> = vec![
        (
            "Immediate Data",
            SendWr::new(1, imm, &[]).with_inline(&data[..8]),
        ),
        ("not inline", SendWr::new(1, SEND, &sge)),
        (
            "an inline Write",
            SendWr::new(1, write, &[]).with_inline(&data[..8]),
        ),
        (
            "longer than one FPDU",
            SendWr::new(1, SEND, &[]).with_inline(&data),
        ),
        (
            "too many SGEs",
            SendWr::new(1, SEND, &five).with_inline(&data[..8]),
        ),
    ];
    for (what, wr) in &cases {
        assert_eq!(framed(&mut c, wr), None, "{what}");
        assert_eq!(c.send_queue_len(), 0, "{what}");
        assert_eq!(c.fpdus_in_flight(), 0, "{what}");
    }
    // Longer than the inline limit, or than the FPDU's payload.
    let (mut small, _) = conn(false, 1024);
    let mut cfg = *small.config();
    cfg.max_inline = 16;
    small = Connection::new(cfg);
    let wr = SendWr::new(1, SEND, &[]).with_inline(&data[..17]);
    assert_eq!(framed(&mut small, &wr), None);
    let (mut short, _) = conn(false, 8);
    let wr = SendWr::new(1, SEND, &[]).with_inline(&data[..9]);
    assert_eq!(framed(&mut short, &wr), None);
    // A buffer too short for the FPDU.
    let wr = SendWr::new(1, SEND, &[]).with_inline(&data[..8]);
    let mut buf = [0u8; 30];
    assert_eq!(c.post_send_framed(&wr, &mut buf), None);
    // The send queue full (one slot, held by an unanswered Read).
    let (mut full, mut fm) = conn(false, 1024);
    let mut cfg = *full.config();
    cfg.max_send_wr = 1;
    full = Connection::new(cfg);
    let (_, k, a) = fm.add_region(16, LOCAL_WRITE, |_| 0);
    let rs = [Sge {
        lkey: k,
        addr: a,
        len: 16,
    }];
    let read = SendOp::Read {
        rkey: 9,
        remote_addr: 0,
    };
    full.post_send(&SendWr::new(1, read, &rs), &mut fm).unwrap();
    drain(&mut full, &mut fm);
    assert_eq!(framed(&mut full, &wr), None);
    assert_eq!(full.send_queue_len(), 1);
    // Fenced behind that Read (with room on the queue).
    let (mut fenced, mut fdm) = conn(false, 1024);
    let (_, k, a) = fdm.add_region(16, LOCAL_WRITE, |_| 0);
    let rs = [Sge {
        lkey: k,
        addr: a,
        len: 16,
    }];
    fenced
        .post_send(&SendWr::new(1, read, &rs), &mut fdm)
        .unwrap();
    drain(&mut fenced, &mut fdm);
    let mut fwr = wr;
    fwr.fence = true;
    assert_eq!(framed(&mut fenced, &fwr), None);
    assert_eq!(fenced.send_queue_len(), 1);
    // Not fenced: taken (the Read stays outstanding).
    assert!(framed(&mut fenced, &wr).is_some());
    // In ERROR.
    c.abort();
    assert_eq!(c.state(), QpState::Error);
    assert_eq!(framed(&mut c, &wr), None);
}

/// A Send framed in one pass while a Read is outstanding completes after
/// the Read, in posting order, as by the general path.
#[test]
fn a_framed_send_completes_after_an_outstanding_read() {
    let (mut c, mut m) = conn(false, 1024);
    let (_, key, addr) = m.add_region(16, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 16,
    }];
    let read = SendOp::Read {
        rkey: 0x55,
        remote_addr: 0x2000,
    };
    c.post_send(&SendWr::new(1, read, &sge), &mut m).unwrap();
    assert_eq!(drain(&mut c, &mut m).len(), 1);
    let f = framed(&mut c, &SendWr::new(2, SEND, &[]).with_inline(b"ping")).unwrap();
    assert_eq!(&f[12..16], &[0, 0, 0, 1], "MSN 1 on the Send queue");
    assert_eq!(c.handle_sent_framed(), None, "not alone: held");
    assert!(
        c.poll_completion().is_none(),
        "the Send may not pass the Read"
    );
    // The Read's answer, into `addr` (its sink's STag is the lkey).
    let payload = [9u8; 16];
    let resp = UlpduRepr::tagged(Opcode::RdmaReadResponse, Stag(key), addr, true, &payload);
    let mut u = vec![0u8; resp.buffer_len()];
    resp.emit(&mut u).unwrap();
    let mut fpdu = vec![0u8; u.len() + 16];
    let n = softrdma_wire::fpdu::emit(&u, false, &mut fpdu).unwrap();
    assert_eq!(c.handle_rx_stream(&fpdu[..n], &mut m), n);
    let ids: Vec<u64> = completions(&mut c).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [1, 2]);
}

/// A completion waiting in the connection (a receive's) is delivered
/// before the framed Send's: the Send's is then queued behind it, not
/// returned.
#[test]
fn a_framed_sends_completion_waits_behind_one_already_queued() {
    let (mut c, mut m) = conn(false, 1024);
    let (_, key, addr) = m.add_region(64, LOCAL_WRITE, |_| 0);
    let sge = [Sge {
        lkey: key,
        addr,
        len: 64,
    }];
    c.post_recv(
        &crate::types::RecvWr {
            wr_id: 10,
            sgl: &sge,
        },
        &mut m,
    )
    .unwrap();
    let send = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"incoming");
    let mut u = vec![0u8; send.buffer_len()];
    send.emit(&mut u).unwrap();
    let mut fpdu = vec![0u8; u.len() + 16];
    let n = softrdma_wire::fpdu::emit(&u, false, &mut fpdu).unwrap();
    assert_eq!(c.handle_rx_stream(&fpdu[..n], &mut m), n);
    assert!(framed(&mut c, &SendWr::new(2, SEND, &[]).with_inline(b"out")).is_some());
    assert_eq!(c.handle_sent_framed(), None);
    let ids: Vec<u64> = completions(&mut c).iter().map(|c| c.wr_id).collect();
    assert_eq!(ids, [10, 2]);
    // Unsignaled and alone: no completion at all.
    let mut wr = SendWr::new(3, SEND, &[]).with_inline(b"quiet");
    wr.signaled = false;
    assert!(framed(&mut c, &wr).is_some());
    assert_eq!(c.handle_sent_framed(), None);
    assert!(c.poll_completion().is_none());
    assert_eq!(c.send_queue_len(), 0);
}

/// Two connections brought to the same state by `setup`; on the first the
/// one pass must decline `wr` without changing anything; then both post
/// `wr` by the general path and must agree on everything after it: the
/// post's result, the bytes handed out, the completions, the outputs and
/// the state. Returns the general path's (result, FPDUs, completions,
/// outputs) for the caller's checks.
#[allow(clippy::type_complexity)]
fn declines_and_changes_nothing(
    what: &str,
    crc: bool,
    setup: impl Fn(&mut Connection<usize>, &mut SimMemory),
    wr: &SendWr<'_>,
) -> (
    Result<(), crate::types::PostError>,
    Vec<Vec<u8>>,
    Vec<Completion>,
    Vec<crate::types::Output>,
) {
    let (mut f, mut fm) = conn(crc, 1024);
    let (mut g, mut gm) = conn(crc, 1024);
    setup(&mut f, &mut fm);
    setup(&mut g, &mut gm);
    let before = (f.state(), f.ird_used(), f.ord_outstanding());
    assert_eq!(framed(&mut f, wr), None, "{what}: taken");
    assert_eq!(
        (f.state(), f.ird_used(), f.ord_outstanding()),
        before,
        "{what}"
    );
    assert_eq!(f.send_queue_len(), g.send_queue_len(), "{what}");
    assert_eq!(f.fpdus_in_flight(), g.fpdus_in_flight(), "{what}");
    let r = f.post_send(wr, &mut fm);
    assert_eq!(r, g.post_send(wr, &mut gm), "{what}");
    let bytes = drain(&mut f, &mut fm);
    assert_eq!(bytes, drain(&mut g, &mut gm), "{what}: bytes");
    let done = completions(&mut f);
    assert_eq!(done, completions(&mut g), "{what}: completions");
    let outputs: Vec<_> = std::iter::from_fn(|| f.poll_output()).collect();
    let gout: Vec<_> = std::iter::from_fn(|| g.poll_output()).collect();
    assert_eq!(outputs, gout, "{what}: outputs");
    assert_eq!(f.state(), g.state(), "{what}");
    (r, bytes, done, outputs)
}

/// A way to bring a connection into the state under test.
type Setup = dyn Fn(&mut Connection<usize>, &mut SimMemory);

/// Feeds `u` to `c` as one FPDU; all of it must be taken.
fn feed(c: &mut Connection<usize>, m: &mut SimMemory, crc: bool, u: &UlpduRepr<'_>) {
    let mut b = vec![0u8; u.buffer_len()];
    u.emit(&mut b).unwrap();
    let mut fpdu = vec![0u8; b.len() + 16];
    let n = softrdma_wire::fpdu::emit(&b, crc, &mut fpdu).unwrap();
    assert_eq!(c.handle_rx_stream(&fpdu[..n], m), n);
}

/// The opcodes of `fpdus`, in order.
fn opcodes(fpdus: &[Vec<u8>], crc: bool) -> Vec<Opcode> {
    fpdus
        .iter()
        .map(|f| {
            let d = softrdma_wire::fpdu::decode(f, crc).unwrap();
            UlpduRepr::parse(d.ulpdu).unwrap().opcode
        })
        .collect()
}

/// Checks what the general path did with a Send (`wr_id` 1) posted
/// while a `response` was owed: the post was taken, the Send and the
/// response went out (in either order), and the Send completed.
fn sent_the_send_and_the_response(
    r: Result<(), crate::types::PostError>,
    bytes: &[Vec<u8>],
    done: &[Completion],
    crc: bool,
    response: Opcode,
) {
    assert_eq!(r, Ok(()));
    let mut ops = opcodes(bytes, crc);
    ops.sort_by_key(|o| *o as u8);
    let mut want = vec![Opcode::Send, response];
    want.sort_by_key(|o| *o as u8);
    assert_eq!(ops, want);
    assert_eq!(done.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [1]);
}

/// In CLOSING (after `close`) the one pass declines; the general path
/// refuses the post, and the FIN still goes out after what was queued.
#[test]
fn a_framed_send_declines_in_closing() {
    let wr = SendWr::new(1, SEND, &[]).with_inline(b"too late");
    let (r, bytes, done, outputs) = declines_and_changes_nothing(
        "closing",
        true,
        |c, _| {
            c.close(0);
            assert_eq!(c.state(), QpState::Closing);
        },
        &wr,
    );
    assert_eq!(
        r,
        Err(crate::types::PostError::InvalidState(QpState::Closing))
    );
    assert!(bytes.is_empty());
    assert!(done.is_empty());
    assert!(
        outputs.contains(&crate::types::Output::Link(
            crate::types::LinkAction::SendFin
        )),
        "{outputs:?}"
    );
}

/// With a Read Response owed (an RDMA Read Request received, not yet
/// answered) the one pass declines; the general path sends the Send and
/// the response, and the Send completes.
#[test]
fn a_framed_send_declines_with_a_read_response_owed() {
    let wr = SendWr::new(1, SEND, &[]).with_inline(b"meanwhile");
    let (r, bytes, done, _) = declines_and_changes_nothing(
        "read response",
        true,
        |c, m| {
            let (_, key, addr) = m.add_region(64, crate::sim::REMOTE_READ, |i| i as u8);
            let req = UlpduRepr::read_request(
                Msn(1),
                softrdma_wire::rdmap::read_request::ReadRequestRepr {
                    sink_stag: Stag(7),
                    sink_to: 0x1000,
                    read_size: 48,
                    src_stag: Stag(key),
                    src_to: addr,
                },
            );
            feed(c, m, true, &req);
            assert_eq!(c.ird_used(), 1);
        },
        &wr,
    );
    sent_the_send_and_the_response(r, &bytes, &done, true, Opcode::RdmaReadResponse);
}

/// With an Atomic Response owed (an Atomic Request received and
/// executed, not yet answered) the one pass declines; the general path
/// sends the Send and the response, and the Send completes.
#[test]
fn a_framed_send_declines_with_an_atomic_response_owed() {
    let wr = SendWr::new(1, SEND, &[]).with_inline(b"meanwhile");
    let (r, bytes, done, _) = declines_and_changes_nothing(
        "atomic response",
        false,
        |c, m| {
            let (_, key, addr) = m.add_region(8, crate::sim::REMOTE_ATOMIC, |_| 0);
            let req = UlpduRepr::atomic_request(
                Msn(1),
                softrdma_wire::rdmap::atomic::AtomicRequestRepr::fetch_add(5, Stag(key), addr, 1),
            );
            feed(c, m, false, &req);
            assert_eq!(c.ird_used(), 1);
            assert_eq!(c.state(), QpState::Rts);
        },
        &wr,
    );
    sent_the_send_and_the_response(r, &bytes, &done, false, Opcode::AtomicResponse);
}

/// With a Terminate waiting to go out (the application's move to
/// TERMINATE, or the peer's violation) the one pass declines; the general
/// path refuses the post, sends the Terminate alone, and the QP enters
/// ERROR.
#[test]
fn a_framed_send_declines_with_a_terminate_pending() {
    let wr = SendWr::new(1, SEND, &[]).with_inline(b"after the end");
    let local = |c: &mut Connection<usize>, _: &mut SimMemory| {
        c.terminate(softrdma_wire::errcode::TermError::RdmapLocalCatastrophic);
    };
    // A Send with no receive posted: "no buffer" (the receive stops
    // there, whatever of the FPDU it took).
    let peer = |c: &mut Connection<usize>, m: &mut SimMemory| {
        let u = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"unexpected");
        let mut b = vec![0u8; u.buffer_len()];
        u.emit(&mut b).unwrap();
        let mut fpdu = vec![0u8; b.len() + 16];
        let n = softrdma_wire::fpdu::emit(&b, true, &mut fpdu).unwrap();
        c.handle_rx_stream(&fpdu[..n], m);
    };
    let cases: [(&str, &Setup); 2] = [("local", &local), ("peer", &peer)];
    for (what, setup) in cases {
        let (r, bytes, done, outputs) = declines_and_changes_nothing(
            what,
            true,
            |c, m| {
                setup(c, m);
                assert_eq!(c.state(), QpState::Terminate, "{what}");
            },
            &wr,
        );
        assert_eq!(
            r,
            Err(crate::types::PostError::InvalidState(QpState::Terminate)),
            "{what}"
        );
        assert_eq!(opcodes(&bytes, true), [Opcode::Terminate], "{what}");
        assert!(done.is_empty(), "{what}: {done:?}");
        assert!(
            outputs.contains(&crate::types::Output::Link(
                crate::types::LinkAction::Shutdown
            )),
            "{what}: {outputs:?}"
        );
    }
}
