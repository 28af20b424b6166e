//! The receive path sizes its reads by what it saw last (read ahead after
//! small messages, little after large ones, no read after a short one):
//! streams that mix long messages with short tail FPDUs, small and inline
//! messages and RDMA Writes arrive intact whatever the read sizes were.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use common::*;
use softrdma_engine::{RecvWr, SendOp, SendWr, WcOpcode, WcStatus};

/// 64 KiB + 16: on loopback one FPDU of 65 456 octets and a 96-octet tail.
const LONG: usize = 64 * 1024 + 16;
const SLOT: usize = LONG + 64;
const MSGS: usize = 48;

fn len_of(i: usize) -> usize {
    match i % 6 {
        0 | 1 => LONG,
        2 => 8,
        3 => 256,
        4 => 1000,
        // One FPDU of 65 456 and a tail of 144.
        _ => SLOT,
    }
}

fn mixed_stream(crc: bool) {
    let p = pair_with(device(false), crc, |a| {
        a.cap.max_send_wr = 256;
        a.cap.max_recv_wr = 256;
        a.cap.max_inline_data = 256;
    });
    let src = mr(&p.a, SLOT * MSGS);
    let dst = mr(&p.b, SLOT * MSGS);
    let wdst = mr(&p.b, SLOT * MSGS);
    let data = pattern(SLOT * MSGS, 11);
    src.write(0, &data).unwrap();
    for i in 0..MSGS {
        let rsge = [dst.sge(i * SLOT, SLOT as u32).unwrap()];
        p.b.qp.post_recv(&RecvWr::new(i as u64, &rsge)).unwrap();
    }
    // Everything posted at once: the receiver finds many FPDUs of every
    // kind queued behind each other in its socket.
    for i in 0..MSGS {
        let len = len_of(i);
        let at = i * SLOT;
        let sge = [src.sge(at, len as u32).unwrap()];
        let wr = if i % 6 == 3 {
            SendWr::new(i as u64, SendOp::Send).inline(&data[at..at + len])
        } else {
            SendWr::new(i as u64, SendOp::Send).sg_list(&sge)
        };
        p.a.qp.post_send(&wr.signaled()).unwrap();
        // A Write of the same bytes between the Sends (tagged FPDUs,
        // their tails too).
        let wr = SendWr::new(
            1000 + i as u64,
            SendOp::Write {
                remote_addr: wdst.addr() + at as u64,
                rkey: wdst.rkey(),
            },
        )
        .sg_list(&sge)
        .signaled();
        p.a.qp.post_send(&wr).unwrap();
    }
    let s = wait(&p.a.cq, 2 * MSGS);
    assert!(s.iter().all(|c| c.status == WcStatus::Success), "{s:?}");
    let r = wait(&p.b.cq, MSGS);
    let got = dst.to_vec();
    for (i, c) in r.iter().enumerate() {
        assert_eq!(c.status, WcStatus::Success, "{c:?}");
        assert_eq!(c.opcode, WcOpcode::Recv);
        assert_eq!(c.wr_id, i as u64, "in order");
        let len = len_of(i);
        assert_eq!(c.byte_len as usize, len, "message {i}");
        let at = i * SLOT;
        assert!(
            got[at..at + len] == data[at..at + len],
            "message {i} ({len} octets) differs"
        );
    }
    // The last Send's receive completes before the Write after it is
    // known to be placed: one more Send behind everything.
    let flag = mr(&p.b, 8);
    let fsge = [flag.sge(0, 8).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(999, &fsge)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(999, SendOp::Send)
                .inline(b"flushed!")
                .signaled(),
        )
        .unwrap();
    wait(&p.a.cq, 1);
    wait(&p.b.cq, 1);
    let wgot = wdst.to_vec();
    for i in 0..MSGS {
        let (at, len) = (i * SLOT, len_of(i));
        assert!(
            wgot[at..at + len] == data[at..at + len],
            "write {i} ({len} octets) differs"
        );
    }
}

#[test]
fn long_messages_with_short_tails_between_small_ones_arrive_intact() {
    mixed_stream(false);
}

#[test]
fn long_messages_with_short_tails_between_small_ones_arrive_intact_with_crc() {
    mixed_stream(true);
}
