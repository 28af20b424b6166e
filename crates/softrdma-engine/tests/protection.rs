//! Protection checks, error handling and memory windows end to end over
//! real loopback TCP: every remote violation ends in a Terminate with the
//! RFC 5040 / RFC 5041 error code, both QPs in ERROR and the outstanding
//! work flushed in order.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::qp::{PostRecvError, PostSendError};
use softrdma_engine::wire::ddp::Stag;
use softrdma_engine::wire::errcode::TermError;
use softrdma_engine::wire::fpdu;
use softrdma_engine::wire::rdmap::atomic::AtomicRequestRepr;
use softrdma_engine::wire::ulpdu::{UlpduBody, UlpduRepr};
use softrdma_engine::{
    Access, AsyncEvent, AsyncEventKind, CompletionQueue, Device, LinkParams, MemoryRegion,
    MemoryWindow, ProtectionDomain, QpInitAttr, QpState, QueuePair, RecvWr, SendFlags, SendOp,
    SendWr, Sge, SharedReceiveQueue, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};

const DEADLINE: Duration = Duration::from_secs(10);

/// The device's async events, kept once seen so that tests can wait for
/// them in any order.
struct Events<'a> {
    dev: &'a Device,
    seen: Vec<AsyncEvent>,
}

impl<'a> Events<'a> {
    fn new(dev: &'a Device) -> Self {
        Events {
            dev,
            seen: Vec::new(),
        }
    }

    /// Waits for an event satisfying `pred` (10 s limit) and removes it.
    fn wait(&mut self, what: &str, pred: impl Fn(&AsyncEvent) -> bool) -> AsyncEvent {
        let deadline = Instant::now() + DEADLINE;
        loop {
            if let Some(i) = self.seen.iter().position(&pred) {
                return self.seen.remove(i);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "no {what} event; saw {:?}", self.seen);
            if let Some(ev) = self.dev.async_events().get(Some(left)) {
                self.seen.push(ev);
            }
        }
    }

    /// Waits for a QP event of `kind`.
    fn qp(&mut self, kind: AsyncEventKind, qp_num: u32) -> AsyncEvent {
        self.wait(&format!("{kind:?} on QP {qp_num}"), |e| {
            e.kind == kind && e.qp_num == Some(qp_num)
        })
    }

    /// Collects what arrived so far without waiting.
    fn drain(&mut self) -> &[AsyncEvent] {
        while let Some(ev) = self.dev.async_events().try_get() {
            self.seen.push(ev);
        }
        &self.seen
    }
}

fn wait_state(qp: &QueuePair, want: QpState) {
    let deadline = Instant::now() + DEADLINE;
    while qp.state() != want {
        assert!(
            Instant::now() < deadline,
            "QP {} in {}, expected {want}",
            qp.qp_num(),
            qp.state()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// B detected `code` in A's traffic: B reports it with `b_kind`, A receives
/// the Terminate, both QPs end in ERROR.
fn expect_terminate(p: &Pair, ev: &mut Events<'_>, b_kind: AsyncEventKind, code: TermError) {
    let e = ev.qp(b_kind, p.b.qp.qp_num());
    assert_eq!(e.term.and_then(|t| t.known()), Some(code), "sent: {e:?}");
    let e = ev.qp(AsyncEventKind::TerminateReceived, p.a.qp.qp_num());
    assert_eq!(
        e.term.and_then(|t| t.known()),
        Some(code),
        "received: {e:?}"
    );
    wait_state(&p.a.qp, QpState::Error);
    wait_state(&p.b.qp, QpState::Error);
}

/// Asserts that nothing more completes on `cq` (short grace period).
fn assert_quiet(cq: &CompletionQueue) {
    std::thread::sleep(Duration::from_millis(20));
    let left: Vec<WorkCompletion> = std::iter::from_fn(|| cq.poll_one()).collect();
    assert!(left.is_empty(), "unexpected completions {left:?}");
}

fn write_wr<'a>(id: u64, remote_addr: u64, rkey: u32, data: &'a [u8]) -> SendWr<'a> {
    SendWr::new(id, SendOp::Write { remote_addr, rkey })
        .inline(data)
        .signaled()
}

fn read_wr<'a>(id: u64, remote_addr: u64, rkey: u32, sink: &'a [Sge]) -> SendWr<'a> {
    SendWr::new(id, SendOp::Read { remote_addr, rkey })
        .sg_list(sink)
        .signaled()
}

// ---------------------------------------------------------------------------
// RDMA Write: the Data Sink's tagged-buffer checks (RFC 5041 section 7.2).
// The Write completes at the requester once on the wire; the Terminate that
// answers it moves the QP to ERROR.

fn bad_write(target: impl Fn(&Pair) -> (u64, u32, Vec<MemoryRegion>), code: TermError) {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (addr, rkey, keep) = target(&p);
    let before: Vec<Vec<u8>> = keep.iter().map(MemoryRegion::to_vec).collect();
    p.a.qp
        .post_send(&write_wr(1, addr, rkey, b"forbidden"))
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{c:?}");
    assert_eq!(c[0].opcode, WcOpcode::RdmaWrite);
    expect_terminate(&p, &mut ev, AsyncEventKind::QpAccessError, code);
    for (mr, old) in keep.iter().zip(before) {
        assert_eq!(mr.to_vec(), old, "no byte placed");
    }
    assert_quiet(&p.a.cq);
    assert_quiet(&p.b.cq);
}

#[test]
fn write_to_invalid_stag() {
    bad_write(
        |p| {
            let dst = mr(&p.b, 64);
            // An index that was never allocated.
            (dst.addr(), 0x00ff_fe00 | (dst.rkey() & 0xff), vec![dst])
        },
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn write_to_deregistered_region() {
    bad_write(
        |p| {
            let dst = mr(&p.b, 64);
            let (addr, rkey) = (dst.addr(), dst.rkey());
            dst.deregister().unwrap();
            (addr, rkey, Vec::new())
        },
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn write_with_wrong_key() {
    bad_write(
        |p| {
            let dst = mr(&p.b, 64);
            (dst.addr(), dst.rkey() ^ 0x5a, vec![dst])
        },
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn write_past_the_end() {
    bad_write(
        |p| {
            let dst = mr(&p.b, 64);
            // 9 bytes at offset 60 of 64.
            (dst.addr() + 60, dst.rkey(), vec![dst])
        },
        TermError::DdpTaggedBaseOrBounds,
    );
}

#[test]
fn write_before_the_start() {
    bad_write(
        |p| {
            let dst = mr(&p.b, 64);
            (dst.addr() - 1, dst.rkey(), vec![dst])
        },
        TermError::DdpTaggedBaseOrBounds,
    );
}

#[test]
fn write_without_remote_write() {
    // RFC 5041 has no tagged-buffer code for access rights; like Linux siw,
    // a missing REMOTE_WRITE is reported as a base or bounds violation.
    bad_write(
        |p| {
            let dst =
                p.b.pd
                    .register(64, Access::LOCAL_WRITE | Access::REMOTE_READ)
                    .unwrap();
            (dst.addr(), dst.rkey(), vec![dst])
        },
        TermError::DdpTaggedBaseOrBounds,
    );
}

#[test]
fn write_to_region_of_another_pd() {
    bad_write(
        |p| {
            let other = ProtectionDomain::new(&p.dev);
            let dst = other
                .register(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                .unwrap();
            (dst.addr(), dst.rkey(), vec![dst])
        },
        TermError::DdpTaggedStagNotAssociated,
    );
}

#[test]
fn write_error_flushes_later_work() {
    // A second Write posted behind the bad one is on the wire too (it
    // completes), but after the Terminate everything posted is flushed.
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let dst = mr(&p.b, 64);
    p.a.qp
        .post_send_list(&[
            write_wr(1, dst.addr(), dst.rkey() ^ 1, b"bad"),
            write_wr(2, dst.addr(), dst.rkey(), b"good"),
        ])
        .unwrap();
    let c = wait(&p.a.cq, 2);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
    assert!(
        dst.to_vec().iter().all(|&b| b == 0),
        "nothing after the violation is placed"
    );
    p.a.qp
        .post_send(&write_wr(3, dst.addr(), dst.rkey(), b"late"))
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (3, WcStatus::WrFlush));
}

// ---------------------------------------------------------------------------
// RDMA Read: the Data Source checks the Read Request (RFC 5040 section
// 7.4.1, RDMAP Remote Protection codes); the Read completes with a remote
// access error.

fn bad_read(target: impl Fn(&Pair) -> (u64, u32, Vec<MemoryRegion>), code: TermError) {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (addr, rkey, _keep) = target(&p);
    let sink = mr(&p.a, 64);
    sink.fill(0xee);
    let sge = [sink.sge(0, 16).unwrap()];
    p.a.qp.post_send(&read_wr(7, addr, rkey, &sge)).unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].wr_id, 7);
    assert_eq!(c[0].status, WcStatus::RemoteAccess, "{c:?}");
    assert_eq!(c[0].opcode, WcOpcode::RdmaRead);
    expect_terminate(&p, &mut ev, AsyncEventKind::QpAccessError, code);
    assert!(sink.to_vec().iter().all(|&b| b == 0xee), "sink untouched");
    assert_quiet(&p.a.cq);
    assert_quiet(&p.b.cq);
}

#[test]
fn read_from_invalid_stag() {
    bad_read(
        |p| {
            let src = mr(&p.b, 64);
            (src.addr(), src.rkey() ^ 0x80, vec![src])
        },
        TermError::RdmapInvalidStag,
    );
}

#[test]
fn read_without_remote_read() {
    bad_read(
        |p| {
            let src =
                p.b.pd
                    .register(64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
                    .unwrap();
            (src.addr(), src.rkey(), vec![src])
        },
        TermError::RdmapAccessRights,
    );
}

#[test]
fn read_out_of_bounds() {
    bad_read(
        |p| {
            let src = mr(&p.b, 64);
            (src.addr() + 56, src.rkey(), vec![src])
        },
        TermError::RdmapBaseOrBounds,
    );
}

#[test]
fn read_from_region_of_another_pd() {
    bad_read(
        |p| {
            let other = ProtectionDomain::new(&p.dev);
            let src = other.register(64, Access::REMOTE_READ).unwrap();
            (src.addr(), src.rkey(), vec![src])
        },
        TermError::RdmapStagNotAssociated,
    );
}

// ---------------------------------------------------------------------------
// Atomics (RFC 7306).

#[test]
fn atomic_without_remote_atomic() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let remote =
        p.b.pd
            .register(
                64,
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
            )
            .unwrap();
    remote.write(8, &41u64.to_ne_bytes()).unwrap();
    let local = mr(&p.a, 8);
    let sge = [local.sge(0, 8).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::FetchAdd {
                    remote_addr: remote.addr() + 8,
                    rkey: remote.rkey(),
                    add: 1,
                },
            )
            .sg_list(&sge)
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::RemoteAccess, "{c:?}");
    assert_eq!(c[0].opcode, WcOpcode::FetchAdd);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::RdmapAccessRights,
    );
    let mut v = [0u8; 8];
    remote.read(8, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 41, "not executed");
}

#[test]
fn atomic_to_misaligned_address_is_refused_at_post() {
    let p = pair(false);
    let remote = mr(&p.b, 64);
    let local = mr(&p.a, 8);
    let sge = [local.sge(0, 8).unwrap()];
    let e =
        p.a.qp
            .post_send(
                &SendWr::new(
                    1,
                    SendOp::CmpSwap {
                        remote_addr: remote.addr() + 4,
                        rkey: remote.rkey(),
                        compare: 0,
                        swap: 1,
                    },
                )
                .sg_list(&sge)
                .signaled(),
            )
            .unwrap_err();
    assert!(matches!(e, PostSendError::Invalid { .. }), "{e:?}");
    assert_eq!(p.a.qp.state(), QpState::Rts, "nothing happened");
    assert_eq!(p.a.qp.send_queue_len(), 0);
}

/// A peer that is not softrdma may send a misaligned Atomic Request: speak
/// the protocol by hand and read the Terminate that answers it.
#[test]
fn atomic_to_misaligned_address_on_the_wire() {
    let dev = device(false);
    let b = side(&dev, |_| {});
    let mut ev = Events::new(&dev);
    let region = mr(&b, 64);
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let n = mpa_accept(&mut s, &MpaConfig::default(), &[], DEADLINE).unwrap();
        (s, n)
    });
    let mut raw = TcpStream::connect(addr).unwrap();
    let n = mpa_connect(&mut raw, &MpaConfig::default(), &[], DEADLINE).unwrap();
    let (s, rn) = accept.join().unwrap();
    b.qp.establish(s, &LinkParams::from(&rn)).unwrap();

    let req = AtomicRequestRepr::fetch_add(9, Stag(region.rkey()), region.addr() + 4, 1);
    let ulpdu = UlpduRepr::atomic_request(n.initial_msns().read_tx, req);
    let mut u = vec![0u8; ulpdu.buffer_len()];
    let k = ulpdu.emit(&mut u).unwrap();
    let mut frame = vec![0u8; k + 16];
    let k = fpdu::emit(&u[..k], n.crc, &mut frame).unwrap();
    raw.write_all(&frame[..k]).unwrap();

    // The Terminate, then the connection is closed.
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut got = Vec::new();
    let _ = raw.read_to_end(&mut got);
    let f = fpdu::decode(&got, n.crc).expect("a whole FPDU");
    let repr = UlpduRepr::parse(f.ulpdu).unwrap();
    let UlpduBody::Terminate(t) = repr.body else {
        panic!("expected a Terminate, got {repr:?}");
    };
    assert_eq!(t.code.known(), Some(TermError::RdmapBaseOrBounds));
    let e = ev.qp(AsyncEventKind::QpAccessError, b.qp.qp_num());
    assert_eq!(
        e.term.and_then(|t| t.known()),
        Some(TermError::RdmapBaseOrBounds)
    );
    wait_state(&b.qp, QpState::Error);
    assert!(region.to_vec().iter().all(|&x| x == 0), "not executed");
}

// ---------------------------------------------------------------------------
// Sends and receives (RFC 5041 untagged buffers).

#[test]
fn send_longer_than_the_receive() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let dst = mr(&p.b, 64);
    let rsge = [dst.sge(0, 4).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(5, &rsge)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(1, SendOp::Send)
                .inline(b"0123456789abcdef")
                .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpRequestError,
        TermError::DdpUntaggedMessageTooLong,
    );
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].wr_id, 5);
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert!(!r[0].status.is_success(), "{r:?}");
    assert!(
        dst.to_vec()[4..].iter().all(|&b| b == 0),
        "nothing placed past the receive buffer"
    );
    assert_quiet(&p.b.cq);
}

/// Verbs: a receive too small for the message completes with a local
/// length error (siw: `SIW_WC_LOC_LEN_ERR`), not a flush.
#[test]
fn send_longer_than_the_receive_is_a_local_length_error() {
    let p = pair(false);
    let dst = mr(&p.b, 64);
    let rsge = [dst.sge(0, 4).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(5, &rsge)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).inline(b"0123456789abcdef"))
        .unwrap();
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].status, WcStatus::LocalLength, "{r:?}");
}

#[test]
fn send_without_a_posted_receive() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).inline(b"x").signaled())
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpRequestError,
        TermError::DdpUntaggedNoBuffer,
    );
    assert_quiet(&p.b.cq);
}

// ---------------------------------------------------------------------------
// Flushing after a Terminate.

#[test]
fn terminate_flushes_everything_in_posting_order() {
    // ORD 1: the second Read waits for the first, so everything behind it
    // is still in the send queue when the Terminate arrives.
    let p = pair_with(device(false), false, |a| a.ord = 1);
    let mut ev = Events::new(&p.dev);
    let remote = mr(&p.b, 4096);
    let local = mr(&p.a, 4096);
    let rbuf_a = mr(&p.a, 256);
    let rbuf_b = mr(&p.b, 256);
    for i in 0..3u64 {
        let s = [rbuf_a.sge(i as usize * 64, 64).unwrap()];
        p.a.qp.post_recv(&RecvWr::new(100 + i, &s)).unwrap();
        let s = [rbuf_b.sge(i as usize * 64, 64).unwrap()];
        p.b.qp.post_recv(&RecvWr::new(200 + i, &s)).unwrap();
    }
    let s0 = [local.sge(0, 64).unwrap()];
    let s1 = [local.sge(64, 64).unwrap()];
    let s2 = [local.sge(128, 32).unwrap()];
    p.a.qp
        .post_send_list(&[
            read_wr(1, remote.addr(), remote.rkey() ^ 0x33, &s0),
            read_wr(2, remote.addr(), remote.rkey(), &s1),
            SendWr::new(3, SendOp::Send).sg_list(&s2).signaled(),
            // Unsignaled: still reported when flushed.
            write_wr(4, remote.addr(), remote.rkey(), b"w").flags(SendFlags::NONE),
            SendWr::new(
                5,
                SendOp::Write {
                    remote_addr: remote.addr(),
                    rkey: remote.rkey(),
                },
            )
            .inline(b"unsignaled"),
            SendWr::new(6, SendOp::Send).inline(b"last").signaled(),
        ])
        .unwrap();
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::RdmapInvalidStag,
    );
    let a = wait(&p.a.cq, 6 + 3);
    let sq: Vec<(u64, WcStatus)> = a
        .iter()
        .filter(|c| c.opcode != WcOpcode::Recv)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        sq,
        [
            (1, WcStatus::RemoteAccess),
            (2, WcStatus::WrFlush),
            (3, WcStatus::WrFlush),
            (4, WcStatus::WrFlush),
            (5, WcStatus::WrFlush),
            (6, WcStatus::WrFlush),
        ]
    );
    let rq: Vec<(u64, WcStatus)> = a
        .iter()
        .filter(|c| c.opcode == WcOpcode::Recv)
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        rq,
        [
            (100, WcStatus::WrFlush),
            (101, WcStatus::WrFlush),
            (102, WcStatus::WrFlush)
        ]
    );
    assert!(a.iter().all(|c| c.qp_num == p.a.qp.qp_num()));
    let b: Vec<(u64, WcStatus, WcOpcode)> = wait(&p.b.cq, 3)
        .iter()
        .map(|c| (c.wr_id, c.status, c.opcode))
        .collect();
    assert_eq!(
        b,
        [
            (200, WcStatus::WrFlush, WcOpcode::Recv),
            (201, WcStatus::WrFlush, WcOpcode::Recv),
            (202, WcStatus::WrFlush, WcOpcode::Recv)
        ]
    );
    assert_eq!(p.a.qp.send_queue_len(), 0);
    assert_eq!(p.a.qp.recv_queue_len(), 0);
    assert_eq!(p.b.qp.recv_queue_len(), 0);

    // Posted in ERROR: flushed at once, in order, on both queues.
    p.a.qp
        .post_send_list(&[
            SendWr::new(7, SendOp::Send).inline(b"a"),
            read_wr(8, remote.addr(), remote.rkey(), &s1),
        ])
        .unwrap();
    let s = [rbuf_a.sge(0, 8).unwrap()];
    p.a.qp.post_recv(&RecvWr::new(103, &s)).unwrap();
    let s = [rbuf_b.sge(0, 8).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(203, &s)).unwrap();
    let a: Vec<(u64, WcStatus)> = std::iter::from_fn(|| p.a.cq.poll_one())
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(
        a,
        [
            (7, WcStatus::WrFlush),
            (8, WcStatus::WrFlush),
            (103, WcStatus::WrFlush)
        ],
        "completed before post returned"
    );
    let b = p.b.cq.poll_one().unwrap();
    assert_eq!((b.wr_id, b.status), (203, WcStatus::WrFlush));
    assert_quiet(&p.a.cq);
    assert_quiet(&p.b.cq);
    assert_eq!(p.a.qp.state(), QpState::Error);
}

/// `WorkCompletion::vendor_err` is documented to carry the raw Terminate
/// code when the error came from a Terminate.
#[test]
fn remote_error_completion_carries_the_terminate_code() {
    let p = pair(false);
    let remote = mr(&p.b, 64);
    let local = mr(&p.a, 64);
    let s = [local.sge(0, 8).unwrap()];
    p.a.qp
        .post_send(&read_wr(1, remote.addr(), remote.rkey() ^ 1, &s))
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::RemoteAccess);
    assert_ne!(c[0].vendor_err, 0, "{c:?}");
}

#[test]
fn posting_before_connection() {
    let dev = device(false);
    let s = side(&dev, |_| {});
    let buf = mr(&s, 64);
    let sge = [buf.sge(0, 8).unwrap()];
    let e =
        s.qp.post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
            .unwrap_err();
    assert_eq!(
        e,
        PostSendError::InvalidState {
            qp_num: s.qp.qp_num(),
            state: QpState::Idle
        }
    );
    // Receives may be posted before the connection exists (IDLE and RTR).
    s.qp.post_recv(&RecvWr::new(1, &sge)).unwrap();
    s.qp.modify(QpState::Rtr).unwrap();
    assert!(matches!(
        s.qp.post_send(&SendWr::new(2, SendOp::Send).inline(b"x")),
        Err(PostSendError::InvalidState {
            state: QpState::Rtr,
            ..
        })
    ));
    s.qp.post_recv(&RecvWr::new(2, &sge)).unwrap();
    assert_eq!(s.qp.recv_queue_len(), 2);
    assert!(s.cq.poll_one().is_none(), "refused requests leave no trace");
    // Moving to ERROR flushes the receives.
    s.qp.modify(QpState::Error).unwrap();
    let c = wait(&s.cq, 2);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::WrFlush), (2, WcStatus::WrFlush)]
    );
}

// ---------------------------------------------------------------------------
// Local protection errors: a bad SGE completes with LocalProtection and the
// QP enters ERROR.

fn local_error(sge_of: impl Fn(&Pair) -> (SendOp<'static>, Sge, MemoryRegion), opcode: WcOpcode) {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    // The region stays registered: the SGE fails for its own reason.
    let (op, sge, _region) = sge_of(&p);
    let sg = [sge];
    p.a.qp
        .post_send(&SendWr::new(1, op).sg_list(&sg).signaled())
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::LocalProtection, opcode),
        "{c:?}"
    );
    wait_state(&p.a.qp, QpState::Error);
    ev.qp(AsyncEventKind::QpFatal, p.a.qp.qp_num());
    // The peer sees the connection go away.
    wait_state(&p.b.qp, QpState::Error);
    p.a.qp
        .post_send(&SendWr::new(2, SendOp::Send).inline(b"x").signaled())
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::WrFlush));
}

#[test]
fn send_with_a_bad_lkey() {
    local_error(
        |p| {
            let src = mr(&p.a, 64);
            let mut s = src.sge(0, 8).unwrap();
            s.lkey ^= 0x11;
            (SendOp::Send, s, src)
        },
        WcOpcode::Send,
    );
}

#[test]
fn write_from_outside_the_local_region() {
    local_error(
        |p| {
            let src = mr(&p.a, 64);
            let mut s = src.sge(0, 8).unwrap();
            s.addr += 60;
            (
                SendOp::Write {
                    remote_addr: 0,
                    rkey: 0,
                },
                s,
                src,
            )
        },
        WcOpcode::RdmaWrite,
    );
}

#[test]
fn send_from_a_region_of_another_pd() {
    local_error(
        |p| {
            let other = ProtectionDomain::new(&p.dev);
            let src = other.register(64, Access::LOCAL_WRITE).unwrap();
            let s = src.sge(0, 8).unwrap();
            (SendOp::Send, s, src)
        },
        WcOpcode::Send,
    );
}

#[test]
fn read_into_a_region_without_local_write() {
    local_error(
        |p| {
            let sink = p.a.pd.register(64, Access::REMOTE_READ).unwrap();
            let s = sink.sge(0, 8).unwrap();
            (
                SendOp::Read {
                    remote_addr: 0,
                    rkey: 0,
                },
                s,
                sink,
            )
        },
        WcOpcode::RdmaRead,
    );
}

/// A request that fails its local checks behind an outstanding Read: the
/// Read never got its response and must be flushed, not reported with the
/// later request's error.
#[test]
fn local_error_behind_an_outstanding_read() {
    let p = pair(false);
    let remote = mr(&p.b, 1 << 20);
    let local = mr(&p.a, 1 << 20);
    let s0 = [local.sge(0, 1 << 20).unwrap()];
    let mut bad = local.sge(0, 8).unwrap();
    bad.lkey ^= 0x11;
    let s1 = [bad];
    p.a.qp
        .post_send_list(&[
            read_wr(1, remote.addr(), remote.rkey(), &s0),
            SendWr::new(2, SendOp::Send).sg_list(&s1).signaled(),
        ])
        .unwrap();
    let c = wait(&p.a.cq, 2);
    assert_eq!(c[0].wr_id, 1);
    assert!(
        matches!(c[0].status, WcStatus::WrFlush | WcStatus::Success),
        "{c:?}"
    );
    assert_eq!((c[1].wr_id, c[1].status), (2, WcStatus::LocalProtection));
}

/// A receive with a bad SGE completes with LocalProtection; like any error
/// completion this leaves the QP in ERROR, and the receives posted before it
/// complete (flushed) before it.
#[test]
fn receive_with_a_bad_lkey() {
    let p = pair(false);
    let buf = mr(&p.b, 64);
    let good = [buf.sge(0, 8).unwrap()];
    let mut b = buf.sge(8, 8).unwrap();
    b.lkey ^= 0x11;
    let bad = [b];
    p.b.qp.post_recv(&RecvWr::new(1, &good)).unwrap();
    p.b.qp.post_recv(&RecvWr::new(2, &bad)).unwrap();
    let c = wait(&p.b.cq, 2);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::WrFlush), (2, WcStatus::LocalProtection)]
    );
    wait_state(&p.b.qp, QpState::Error);
}

#[test]
fn receive_with_a_bad_lkey_completes_with_local_protection() {
    let p = pair(false);
    let buf = mr(&p.b, 64);
    let mut b = buf.sge(8, 8).unwrap();
    b.lkey ^= 0x11;
    p.b.qp.post_recv(&RecvWr::new(2, &[b])).unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (2, WcStatus::LocalProtection, WcOpcode::Recv)
    );
    assert_eq!(p.b.qp.recv_queue_len(), 0, "not posted");
}

// ---------------------------------------------------------------------------
// Memory windows (type 2), bound and invalidated by work requests.

/// A region on B that only allows binding windows (its own rkey grants no
/// remote access), and a window bound to bytes [4096, 8192) of it.
fn bound_window(p: &Pair) -> (MemoryRegion, MemoryWindow) {
    let region =
        p.b.pd
            .register(3 * 4096, Access::LOCAL_WRITE | Access::MW_BIND)
            .unwrap();
    let mw = p.b.pd.alloc_mw().unwrap();
    assert!(!mw.is_bound());
    bind(p, &mw, &region, 4096, 4096, 50);
    (region, mw)
}

fn bind(p: &Pair, mw: &MemoryWindow, region: &MemoryRegion, off: u64, len: u64, id: u64) {
    let before = mw.rkey();
    p.b.qp
        .post_send(
            &SendWr::new(
                id,
                SendOp::BindMw {
                    mw,
                    mr: region,
                    addr: region.addr() + off,
                    length: len,
                    access: Access::REMOTE_WRITE | Access::REMOTE_READ,
                    key: None,
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (id, WcStatus::Success, WcOpcode::BindMw)
    );
    assert!(mw.is_bound());
    assert_ne!(mw.rkey(), before, "every bind gives a new key");
    assert_eq!(mw.rkey() >> 8, before >> 8, "same index");
    assert_eq!((mw.addr(), mw.len()), (region.addr() + off, len));
}

/// Write then Read through the window; the data lands at the window's
/// place in the region.
fn use_window(p: &Pair, mw: &MemoryWindow, region: &MemoryRegion) {
    let data = pattern(100, 9);
    let src = mr(&p.a, 4096);
    src.write(0, &data).unwrap();
    let s = [src.sge(0, 100).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::Write {
                    remote_addr: mw.addr() + 8,
                    rkey: mw.rkey(),
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
    let r = [src.sge(1024, 100).unwrap()];
    p.a.qp
        .post_send(&read_wr(2, mw.addr() + 8, mw.rkey(), &r))
        .unwrap();
    let c = wait(&p.a.cq, 2);
    assert!(c.iter().all(|c| c.status.is_success()), "{c:?}");
    let at = (mw.addr() - region.addr()) as usize + 8;
    assert_eq!(&region.to_vec()[at..at + 100], &data[..]);
    assert_eq!(&src.to_vec()[1024..1124], &data[..]);
}

#[test]
fn window_write_and_read() {
    let p = pair(false);
    let (region, mw) = bound_window(&p);
    use_window(&p, &mw, &region);
    // The region's own key grants nothing remotely.
    let mut ev = Events::new(&p.dev);
    p.a.qp
        .post_send(&write_wr(3, region.addr(), region.rkey(), b"no"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedBaseOrBounds,
    );
}

#[test]
fn window_access_past_its_end() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (region, mw) = bound_window(&p);
    // Inside the region, but 4 bytes past the window.
    p.a.qp
        .post_send(&write_wr(1, mw.addr() + 4092, mw.rkey(), b"12345678"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedBaseOrBounds,
    );
    assert!(region.to_vec().iter().all(|&b| b == 0));
}

#[test]
fn window_read_before_its_start() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (_region, mw) = bound_window(&p);
    let sink = mr(&p.a, 64);
    let s = [sink.sge(0, 16).unwrap()];
    p.a.qp
        .post_send(&read_wr(1, mw.addr() - 8, mw.rkey(), &s))
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::RemoteAccess);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::RdmapBaseOrBounds,
    );
}

#[test]
fn window_rebind_refuses_the_old_key() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (region, mw) = bound_window(&p);
    let old = mw.rkey();
    // Bind again (elsewhere): a new key; the old one is dead.
    p.b.qp
        .post_send(&SendWr::new(9, SendOp::LocalInv { rkey: old }).signaled())
        .unwrap();
    assert_eq!(wait(&p.b.cq, 1)[0].status, WcStatus::Success);
    bind(&p, &mw, &region, 0, 4096, 51);
    assert_ne!(mw.rkey(), old);
    use_window(&p, &mw, &region);
    p.a.qp
        .post_send(&write_wr(3, mw.addr(), old, b"stale"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn window_local_invalidate_then_access_refused() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (region, mw) = bound_window(&p);
    use_window(&p, &mw, &region);
    let rkey = mw.rkey();
    p.b.qp
        .post_send(&SendWr::new(60, SendOp::LocalInv { rkey }).signaled())
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (60, WcStatus::Success, WcOpcode::LocalInv)
    );
    assert!(!mw.is_bound());
    let sink = mr(&p.a, 64);
    let s = [sink.sge(0, 8).unwrap()];
    p.a.qp.post_send(&read_wr(4, mw.addr(), rkey, &s)).unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (4, WcStatus::RemoteAccess));
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::RdmapInvalidStag,
    );
}

#[test]
fn send_with_invalidate_invalidates_the_window() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (region, mw) = bound_window(&p);
    use_window(&p, &mw, &region);
    let rkey = mw.rkey();
    let rbuf = mr(&p.b, 64);
    let rs = [rbuf.sge(0, 64).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(70, &rs)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(
                8,
                SendOp::SendWithInv {
                    invalidate_rkey: rkey,
                },
            )
            .inline(b"done with it")
            .signaled(),
        )
        .unwrap();
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].wr_id, 70);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].byte_len, 12);
    assert!(r[0].flags.contains(WcFlags::WITH_INV), "{r:?}");
    assert_eq!(r[0].invalidated_rkey, rkey);
    assert!(!mw.is_bound(), "invalidated before the receive completed");
    assert_eq!(&rbuf.to_vec()[..12], b"done with it");
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (8, WcStatus::Success));
    p.a.qp
        .post_send(&write_wr(9, mw.addr(), rkey, b"too late"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn bind_with_a_chosen_key_gives_the_window_that_key() {
    let p = pair(false);
    let region =
        p.b.pd
            .register(4096, Access::LOCAL_WRITE | Access::MW_BIND)
            .unwrap();
    let mw = p.b.pd.alloc_mw().unwrap();
    let want = (mw.rkey() as u8).wrapping_add(1);
    p.b.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::BindMw {
                    mw: &mw,
                    mr: &region,
                    addr: region.addr(),
                    length: 64,
                    access: Access::REMOTE_WRITE,
                    key: Some(want),
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (1, WcStatus::Success));
    assert_eq!(mw.rkey() & 0xff, u32::from(want), "the chosen key byte");
    let rkey = mw.rkey();
    p.a.qp
        .post_send(&write_wr(2, region.addr(), rkey, b"by chosen key"))
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (2, WcStatus::Success));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while &region.to_vec()[..13] != b"by chosen key" && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(&region.to_vec()[..13], b"by chosen key");
}

#[test]
fn bind_without_mw_bind_right_fails() {
    let p = pair(false);
    let region = mr(&p.b, 4096);
    let mw = p.b.pd.alloc_mw().unwrap();
    p.b.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::BindMw {
                    mw: &mw,
                    mr: &region,
                    addr: region.addr(),
                    length: 64,
                    access: Access::REMOTE_READ,
                    key: None,
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (1, WcStatus::MwBind, WcOpcode::BindMw)
    );
    assert!(!mw.is_bound());
    wait_state(&p.b.qp, QpState::Error);
}

// ---------------------------------------------------------------------------
// Fast-register regions and re-registration.

fn fast_reg(p: &Pair, fmr: &MemoryRegion, iova: u64, id: u64) {
    p.b.qp
        .post_send(
            &SendWr::new(
                id,
                SendOp::FastReg {
                    mr: fmr,
                    iova,
                    length: 8192,
                    access: Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (id, WcStatus::Success, WcOpcode::RegMr)
    );
    assert!(fmr.is_valid());
    assert_eq!(fmr.addr(), iova);
}

#[test]
fn fast_register_then_remote_access() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let fmr = p.b.pd.alloc_mr(16384).unwrap();
    assert!(!fmr.is_valid());
    let iova = 0x7_0000_0000;
    fast_reg(&p, &fmr, iova, 1);
    let first = fmr.rkey();
    p.a.qp
        .post_send(&write_wr(2, iova + 16, first, b"fast"))
        .unwrap();
    let sink = mr(&p.a, 64);
    let s = [sink.sge(0, 4).unwrap()];
    p.a.qp.post_send(&read_wr(3, iova + 16, first, &s)).unwrap();
    let c = wait(&p.a.cq, 2);
    assert!(c.iter().all(|c| c.status.is_success()), "{c:?}");
    assert_eq!(&fmr.to_vec()[16..20], b"fast");
    assert_eq!(&sink.to_vec()[..4], b"fast");

    // Invalidate and register again: a new key, the old one is refused.
    p.b.qp
        .post_send(&SendWr::new(4, SendOp::LocalInv { rkey: first }).signaled())
        .unwrap();
    assert_eq!(wait(&p.b.cq, 1)[0].opcode, WcOpcode::LocalInv);
    assert!(!fmr.is_valid());
    fast_reg(&p, &fmr, iova, 5);
    assert_ne!(fmr.rkey(), first, "fast-register gives a new key");
    p.a.qp
        .post_send(&write_wr(6, iova + 32, fmr.rkey(), b"new"))
        .unwrap();
    assert!(wait(&p.a.cq, 1)[0].status.is_success());
    p.a.qp
        .post_send(&write_wr(7, iova + 48, first, b"old"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
    let got = fmr.to_vec();
    assert_eq!(&got[32..35], b"new");
    assert_eq!(&got[48..51], &[0, 0, 0], "the old key placed nothing");
}

#[test]
fn fast_register_region_is_invalid_before_registration() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let fmr = p.b.pd.alloc_mr(4096).unwrap();
    p.a.qp
        .post_send(&write_wr(1, fmr.addr(), fmr.rkey(), b"early"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
}

#[test]
fn fast_register_of_a_valid_region_fails() {
    let p = pair(false);
    let fmr = p.b.pd.alloc_mr(16384).unwrap();
    fast_reg(&p, &fmr, 0x1000, 1);
    p.b.qp
        .post_send(
            &SendWr::new(
                2,
                SendOp::FastReg {
                    mr: &fmr,
                    iova: 0x2000,
                    length: 4096,
                    access: Access::REMOTE_READ,
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].opcode),
        (2, WcStatus::LocalProtection, WcOpcode::RegMr)
    );
    wait_state(&p.b.qp, QpState::Error);
}

#[test]
fn reregistration_refuses_the_old_key() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let mut dst = mr(&p.b, 64);
    let old = dst.rkey();
    let new = dst
        .rereg(Access::LOCAL_WRITE | Access::REMOTE_WRITE)
        .unwrap();
    assert_ne!(new, old);
    assert_eq!(dst.rkey(), new);
    p.a.qp
        .post_send(&write_wr(1, dst.addr(), new, b"new key"))
        .unwrap();
    assert!(wait(&p.a.cq, 1)[0].status.is_success());
    p.a.qp
        .post_send(&write_wr(2, dst.addr() + 8, old, b"old key"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedInvalidStag,
    );
    let got = dst.to_vec();
    assert_eq!(&got[..7], b"new key");
    assert!(got[8..].iter().all(|&b| b == 0));
}

// ---------------------------------------------------------------------------
// Shared receive queues.

#[test]
fn srq_shared_by_two_qps() {
    let dev = device(false);
    let mut ev = Events::new(&dev);
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 64, None).unwrap();
    let srq = SharedReceiveQueue::new(&pd, 16, 1, 0).unwrap();
    let mut attr = QpInitAttr::new(&cq, &cq);
    attr.srq = Some(srq.clone());
    let b1 = QueuePair::new(&pd, &attr).unwrap();
    let b2 = QueuePair::new(&pd, &attr).unwrap();
    let a1 = side(&dev, |_| {});
    let a2 = side(&dev, |_| {});
    connect_pair(&a1.qp, &b1, &MpaConfig::default()).unwrap();
    connect_pair(&a2.qp, &b2, &MpaConfig::default()).unwrap();

    let buf = pd.register(16 * 64, Access::LOCAL_WRITE).unwrap();
    for i in 0..6u64 {
        let s = [buf.sge(i as usize * 64, 64).unwrap()];
        srq.post_recv(&RecvWr::new(i, &s)).unwrap();
    }
    assert_eq!(srq.len(), 6);
    let s = [buf.sge(0, 8).unwrap()];
    assert_eq!(
        b1.post_recv(&RecvWr::new(99, &s)),
        Err(PostRecvError::HasSrq)
    );
    // Armed at 4: the consumption that leaves 3 fires it, once.
    srq.modify_limit(4).unwrap();

    let msgs: [(&QueuePair, &QueuePair, &[u8]); 4] = [
        (&a1.qp, &b1, b"one"),
        (&a2.qp, &b2, b"two"),
        (&a2.qp, &b2, b"three"),
        (&a1.qp, &b1, b"four"),
    ];
    for (i, (tx, rx, msg)) in msgs.iter().enumerate() {
        tx.post_send(&SendWr::new(i as u64, SendOp::Send).inline(msg))
            .unwrap();
        let r = wait(&cq, 1);
        assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
        assert_eq!(r[0].wr_id, i as u64, "SRQ receives are taken in order");
        assert_eq!(r[0].qp_num, rx.qp_num(), "completion names the QP");
        assert_eq!(r[0].byte_len as usize, msg.len());
        let got = buf.to_vec();
        assert_eq!(&got[i * 64..i * 64 + msg.len()], *msg);
        if i == 2 {
            let e = ev.wait("SrqLimitReached", |e| {
                e.kind == AsyncEventKind::SrqLimitReached
            });
            assert_eq!(e.srq_id, Some(srq.id()));
            assert_eq!(srq.limit(), 0, "disarmed");
        }
    }
    assert_eq!(srq.len(), 2);
    assert!(
        ev.drain()
            .iter()
            .all(|e| e.kind != AsyncEventKind::SrqLimitReached),
        "fired once"
    );
    // An error on one QP does not flush the shared queue.
    b1.modify(QpState::Error).unwrap();
    ev.qp(AsyncEventKind::QpLastWqeReached, b1.qp_num());
    assert_eq!(srq.len(), 2);
    a2.qp
        .post_send(&SendWr::new(5, SendOp::Send).inline(b"five"))
        .unwrap();
    let r = wait(&cq, 1);
    assert_eq!((r[0].wr_id, r[0].qp_num), (4, b2.qp_num()));
}

// ---------------------------------------------------------------------------
// CQ overflow.

#[test]
fn cq_overflow_is_an_error() {
    let dev = device(false);
    let mut ev = Events::new(&dev);
    let a = side(&dev, |_| {});
    let pd = ProtectionDomain::new(&dev);
    let scq = CompletionQueue::new(&dev, 64, None).unwrap();
    let rcq = CompletionQueue::new(&dev, 2, None).unwrap();
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&scq, &rcq)).unwrap();
    connect_pair(&a.qp, &qp, &MpaConfig::default()).unwrap();
    let n = rcq.capacity() + 2;
    let buf = pd.register(n * 8, Access::LOCAL_WRITE).unwrap();
    for i in 0..n {
        let s = [buf.sge(i * 8, 8).unwrap()];
        qp.post_recv(&RecvWr::new(i as u64, &s)).unwrap();
    }
    for i in 0..n {
        a.qp.post_send(&SendWr::new(i as u64, SendOp::Send).inline(b"12345678"))
            .unwrap();
    }
    let e = ev.wait("CqError", |e| e.kind == AsyncEventKind::CqError);
    assert_eq!(e.cq_id, Some(rcq.id()));
    assert!(rcq.is_overflowed());
    wait_state(&qp, QpState::Error);
    ev.qp(AsyncEventKind::QpFatal, qp.qp_num());
    // What fit is delivered, in order.
    let got: Vec<u64> = std::iter::from_fn(|| rcq.poll_one())
        .map(|c| c.wr_id)
        .collect();
    assert_eq!(got, (0..rcq.capacity() as u64).collect::<Vec<_>>());
    assert!(scq.poll_one().is_none());
}

// ---------------------------------------------------------------------------
// ORD and fences.

#[test]
fn ord_of_one_completes_many_reads_in_order() {
    let p = pair_with(device(false), false, |a| a.ord = 1);
    assert_eq!(p.a.qp.query().ord, 1);
    let n = 48usize;
    let len = 3000usize;
    let remote = mr(&p.b, n * len);
    let data = pattern(n * len, 5);
    remote.write(0, &data).unwrap();
    let local = mr(&p.a, n * len);
    let sges: Vec<[Sge; 1]> = (0..n)
        .map(|i| [local.sge((n - 1 - i) * len, len as u32).unwrap()])
        .collect();
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| read_wr(i as u64, remote.addr() + (i * len) as u64, remote.rkey(), s))
        .collect();
    p.a.qp.post_send_list(&wrs).unwrap();
    let c = wait(&p.a.cq, n);
    for (i, c) in c.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.opcode, c.byte_len as usize),
            (i as u64, WcStatus::Success, WcOpcode::RdmaRead, len)
        );
    }
    let got = local.to_vec();
    for i in 0..n {
        let at = (n - 1 - i) * len;
        assert_eq!(
            &got[at..at + len],
            &data[i * len..(i + 1) * len],
            "read {i}"
        );
    }
}

#[test]
fn fenced_write_waits_for_the_read() {
    // Read remote X into L, then Write L to remote Y with a fence: Y must
    // hold X's data, not what L held before the Read.
    let p = pair(false);
    let len = 256 * 1024;
    let x = mr(&p.b, len);
    let y = mr(&p.b, len);
    let data = pattern(len, 77);
    x.write(0, &data).unwrap();
    let l = mr(&p.a, len);
    let s = [l.sge(0, len as u32).unwrap()];
    let flag = mr(&p.b, 8);
    let fs = [flag.sge(0, 8).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(1, &fs)).unwrap();
    p.a.qp
        .post_send_list(&[
            read_wr(1, x.addr(), x.rkey(), &s),
            SendWr::new(
                2,
                SendOp::Write {
                    remote_addr: y.addr(),
                    rkey: y.rkey(),
                },
            )
            .sg_list(&s)
            .flags(SendFlags::FENCE)
            .signaled(),
            SendWr::new(3, SendOp::Send).inline(b"done"),
        ])
        .unwrap();
    let c = wait(&p.a.cq, 2);
    assert_eq!(
        c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(1, WcStatus::Success), (2, WcStatus::Success)]
    );
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success);
    assert!(
        y.to_vec() == data,
        "the fenced Write carried the Read's data"
    );
}

// ---------------------------------------------------------------------------
// Invalidation errors and offset wrap.

/// A Send with Invalidate naming an STag the receiver cannot invalidate:
/// the Terminate says so (RFC 5040 section 7.4.1, "STag cannot be
/// invalidated") and the QPs end in ERROR.
fn bad_send_with_invalidate(target: impl Fn(&Pair) -> (u32, Vec<MemoryRegion>), code: TermError) {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let (stag, _keep) = target(&p);
    let rbuf = mr(&p.b, 64);
    let rs = [rbuf.sge(0, 64).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(70, &rs)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(
                8,
                SendOp::SendWithInv {
                    invalidate_rkey: stag,
                },
            )
            .inline(b"bye")
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!((c[0].wr_id, c[0].status), (8, WcStatus::Success));
    expect_terminate(&p, &mut ev, AsyncEventKind::QpAccessError, code);
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].wr_id, 70);
    assert!(!r[0].flags.contains(WcFlags::WITH_INV), "{r:?}");
}

#[test]
fn send_with_invalidate_of_a_registered_region() {
    // Regions from `register` cannot be invalidated remotely.
    bad_send_with_invalidate(
        |p| {
            let region = mr(&p.b, 64);
            (region.rkey(), vec![region])
        },
        TermError::RdmapOperationCannotInvalidate,
    );
}

#[test]
fn send_with_invalidate_of_an_unknown_stag() {
    bad_send_with_invalidate(
        |_| (0x00ff_fe42, Vec::new()),
        TermError::RdmapOperationCannotInvalidate,
    );
}

/// Like Linux siw: the receive of a Send with Invalidate whose invalidation
/// fails completes with a remote invalid request error, and an STag of
/// another protection domain is a Remote Protection error.
#[test]
fn send_with_invalidate_of_a_window_of_another_pd() {
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let other = ProtectionDomain::new(&p.dev);
    let mw = other.alloc_mw().unwrap();
    // An unbound window's STag names an entry of the other PD.
    let rbuf = mr(&p.b, 64);
    let rs = [rbuf.sge(0, 64).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(70, &rs)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(
                8,
                SendOp::SendWithInv {
                    invalidate_rkey: mw.rkey(),
                },
            )
            .inline(b"bye"),
        )
        .unwrap();
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::RdmapProtectionCannotInvalidate,
    );
    let r = wait(&p.b.cq, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status),
        (70, WcStatus::RemoteInvalidRequest)
    );
}

#[test]
fn local_invalidate_of_a_registered_region_fails() {
    let p = pair(false);
    let region = mr(&p.b, 64);
    p.b.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::LocalInv {
                    rkey: region.rkey(),
                },
            )
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!((c[0].wr_id, c[0].opcode), (1, WcOpcode::LocalInv));
    assert!(!c[0].status.is_success(), "{c:?}");
    wait_state(&p.b.qp, QpState::Error);
    assert!(region.is_valid(), "the region is untouched");
}

#[test]
fn write_wrapping_the_tagged_offset() {
    // A fast-register region at the very top of the 64-bit offset space:
    // a Write whose last byte would be past 2^64 - 1 is a TO wrap.
    let p = pair(false);
    let mut ev = Events::new(&p.dev);
    let fmr = p.b.pd.alloc_mr(4096).unwrap();
    // The last byte of the region is at 2^64 - 2.
    let iova = u64::MAX - 4095;
    p.b.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::FastReg {
                    mr: &fmr,
                    iova,
                    length: 4095,
                    access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                },
            )
            .signaled(),
        )
        .unwrap();
    assert_eq!(wait(&p.b.cq, 1)[0].status, WcStatus::Success);
    p.a.qp
        .post_send(&write_wr(2, iova + 8, fmr.rkey(), b"fits"))
        .unwrap();
    assert!(wait(&p.a.cq, 1)[0].status.is_success());
    p.a.qp
        .post_send(&write_wr(3, u64::MAX - 3, fmr.rkey(), b"12345678"))
        .unwrap();
    wait(&p.a.cq, 1);
    expect_terminate(
        &p,
        &mut ev,
        AsyncEventKind::QpAccessError,
        TermError::DdpTaggedToWrap,
    );
    let got = fmr.to_vec();
    assert_eq!(&got[8..12], b"fits");
    assert!(got[4091..].iter().all(|&b| b == 0));
}

/// A request failing its local checks behind a long Write: the transmit
/// path may hit a full socket after reaching it; the QP must still enter
/// ERROR.
#[test]
fn local_error_behind_a_long_write() {
    for force_dm in [false, true] {
        let p = pair_with(device(force_dm), false, |_| {});
        let len = 16 << 20;
        let src = mr(&p.a, len);
        let dst = mr(&p.b, len);
        let s0 = [src.sge(0, len as u32).unwrap()];
        let mut bad = src.sge(0, 8).unwrap();
        bad.lkey ^= 0x11;
        let s1 = [bad];
        p.a.qp
            .post_send_list(&[
                SendWr::new(
                    1,
                    SendOp::Write {
                        remote_addr: dst.addr(),
                        rkey: dst.rkey(),
                    },
                )
                .sg_list(&s0)
                .signaled(),
                SendWr::new(2, SendOp::Send).sg_list(&s1).signaled(),
            ])
            .unwrap();
        let c = wait(&p.a.cq, 2);
        assert_eq!(
            c.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
            [(1, WcStatus::Success), (2, WcStatus::LocalProtection)]
        );
        wait_state(&p.a.qp, QpState::Error);
    }
}
