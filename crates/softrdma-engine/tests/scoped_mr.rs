//! Lent memory (`ProtectionDomain::lend` / `lend_mut`): a caller's buffer
//! registered for one call. While the call runs the peer reads or writes
//! it like any region; once it returns nothing touches the buffer: the
//! call waits for a Read Response still being transmitted from it, and a
//! Read or Write that comes later finds no STag (a Terminate, a remote
//! access error at the requester).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{device, mr, pair, pair_with, pattern, wait};
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::{MpaConfig, Negotiated};
use softrdma_engine::wire::ddp::{Msn, Stag};
use softrdma_engine::wire::errcode::{TermCode, TermError};
use softrdma_engine::wire::fpdu;
use softrdma_engine::wire::rdmap::read_request::ReadRequestRepr;
use softrdma_engine::wire::ulpdu::{UlpduBody, UlpduRepr};
use softrdma_engine::{
    Access, CompletionQueue, LinkParams, ProtectionDomain, QpInitAttr, QpState, QueuePair, SendOp,
    SendWr, WcStatus,
};

const DEADLINE: Duration = Duration::from_secs(20);

/// The peer RDMA-Reads a lent buffer while the call runs; after it
/// returned, a Read with the same STag fails at the requester and places
/// nothing.
#[test]
fn peer_reads_lent_buffer_then_stale_stag_fails() {
    let p = pair(false);
    let data = pattern(100_000, 3);
    let sink = mr(&p.b, data.len());
    let (rkey, addr) =
        p.a.pd
            .lend(&data, Access::REMOTE_READ, |r| {
                assert_eq!(r.len(), data.len());
                let sge = sink.sge(0, data.len() as u32).unwrap();
                p.b.qp
                    .post_send(
                        &SendWr::new(
                            1,
                            SendOp::Read {
                                remote_addr: r.addr(),
                                rkey: r.rkey(),
                            },
                        )
                        .sg_list(&[sge])
                        .signaled(),
                    )
                    .unwrap();
                let wc = wait(&p.b.cq, 1);
                assert_eq!(wc[0].status, WcStatus::Success);
                (r.rkey(), r.addr())
            })
            .unwrap();
    assert_eq!(sink.to_vec(), data);
    // Stale STag: the Read fails, the sink is untouched.
    let sink2 = mr(&p.b, 64);
    p.b.qp
        .post_send(
            &SendWr::new(
                2,
                SendOp::Read {
                    remote_addr: addr,
                    rkey,
                },
            )
            .sg_list(&[sink2.sge(0, 64).unwrap()])
            .signaled(),
        )
        .unwrap();
    let wc = wait(&p.b.cq, 1);
    assert_ne!(wc[0].status, WcStatus::Success);
    assert_eq!(sink2.to_vec(), vec![0u8; 64]);
}

/// A mutable loan receives RDMA Writes and Read Responses; a Write after
/// the call returned fails and changes nothing.
#[test]
fn lend_mut_takes_writes_and_read_responses_then_refuses() {
    lend_mut_case(pair(false));
}

/// The same through the datamovers' receive path.
#[test]
fn lend_mut_through_datamovers() {
    lend_mut_case(pair_with(device(true), false, |_| {}));
}

fn lend_mut_case(p: common::Pair) {
    let src = mr(&p.b, 8192);
    src.write(0, &pattern(8192, 9)).unwrap();
    let mut buf = vec![0u8; 16384];
    let (rkey, addr) =
        p.a.pd
            .lend_mut(&mut buf, Access::LOCAL_WRITE | Access::REMOTE_WRITE, |r| {
                // The peer writes the first half...
                p.b.qp
                    .post_send(
                        &SendWr::new(
                            1,
                            SendOp::Write {
                                remote_addr: r.addr(),
                                rkey: r.rkey(),
                            },
                        )
                        .sg_list(&[src.sge(0, 8192).unwrap()])
                        .signaled(),
                    )
                    .unwrap();
                assert_eq!(wait(&p.b.cq, 1)[0].status, WcStatus::Success);
                // ... and we read the second half from it.
                p.a.qp
                    .post_send(
                        &SendWr::new(
                            2,
                            SendOp::Read {
                                remote_addr: src.addr(),
                                rkey: src.rkey(),
                            },
                        )
                        .sg_list(&[r.sge(8192, 8192).unwrap()])
                        .signaled(),
                    )
                    .unwrap();
                assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::Success);
                assert!(r.sge(8192, 8193).is_err());
                (r.rkey(), r.addr())
            })
            .unwrap();
    assert_eq!(&buf[..8192], &pattern(8192, 9)[..]);
    assert_eq!(&buf[8192..], &pattern(8192, 9)[..]);
    buf.fill(0xEE);
    p.b.qp
        .post_send(
            &SendWr::new(
                3,
                SendOp::Write {
                    remote_addr: addr,
                    rkey,
                },
            )
            .sg_list(&[src.sge(0, 100).unwrap()])
            .signaled(),
        )
        .unwrap();
    // The Write itself completes locally; the victim answers with a
    // Terminate and the requester's QP ends in error.
    let _ = wait(&p.b.cq, 1);
    let deadline = Instant::now() + DEADLINE;
    while p.b.qp.state() != QpState::Error && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(p.b.qp.state(), QpState::Error);
    assert!(buf.iter().all(|&b| b == 0xEE));
}

/// Loans refuse rights they could not honour, and a panic in the closure
/// still removes the STag.
#[test]
fn lend_rights_and_panics() {
    let dev = device(false);
    let pd = ProtectionDomain::new(&dev);
    let data = [1u8; 16];
    assert!(pd.lend(&data, Access::REMOTE_WRITE, |_| ()).is_err());
    assert!(pd.lend(&data, Access::LOCAL_WRITE, |_| ()).is_err());
    assert!(pd.lend(&data, Access::NONE, |_| ()).is_ok());
    let mut m = [0u8; 16];
    assert!(pd.lend_mut(&mut m, Access::MW_BIND, |_| ()).is_err());
    assert!(pd.lend_mut(&mut m, Access::REMOTE_WRITE, |_| ()).is_err());
    let p = pair(false);
    let stag = std::sync::Mutex::new((0u32, 0u64));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        p.a.pd
            .lend(&data, Access::REMOTE_READ, |r| {
                *stag.lock().unwrap() = (r.rkey(), r.addr());
                panic!("inside the loan");
            })
            .unwrap();
    }));
    assert!(r.is_err());
    let (rkey, addr) = *stag.lock().unwrap();
    let sink = mr(&p.b, 16);
    p.b.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::Read {
                    remote_addr: addr,
                    rkey,
                },
            )
            .sg_list(&[sink.sge(0, 16).unwrap()])
            .signaled(),
        )
        .unwrap();
    assert_ne!(wait(&p.b.cq, 1)[0].status, WcStatus::Success);
    assert_eq!(sink.to_vec(), vec![0u8; 16]);
}

/// A victim QP connected to a raw peer that speaks the wire protocol by
/// hand (and can stop reading).
struct Raw {
    _pd: ProtectionDomain,
    _cq: CompletionQueue,
    qp: QueuePair,
    raw: TcpStream,
    n: Negotiated,
    got: Vec<u8>,
}

fn raw_victim(pd: ProtectionDomain) -> Raw {
    let dev = pd.device().clone();
    let cq = CompletionQueue::new(&dev, 64, None).expect("cq");
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).expect("qp");
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = l.local_addr().unwrap();
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let n = mpa_accept(&mut s, &MpaConfig::default(), &[], DEADLINE).unwrap();
        (s, n)
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let vn = mpa_connect(&mut s, &MpaConfig::default(), &[], DEADLINE).unwrap();
    let (raw, n) = acceptor.join().unwrap();
    qp.establish(s, &LinkParams::from(&vn)).unwrap();
    raw.set_read_timeout(Some(DEADLINE)).unwrap();
    // A small fixed receive buffer (no autotuning): a 32 MiB response
    // cannot fit into the socket buffers while the peer does not read.
    socket2::SockRef::from(&raw)
        .set_recv_buffer_size(64 * 1024)
        .unwrap();
    Raw {
        _pd: pd,
        _cq: cq,
        qp,
        raw,
        n,
        got: Vec::new(),
    }
}

impl Raw {
    fn read_request(&mut self, k: u32, stag: u32, to: u64, len: u32) {
        let req = ReadRequestRepr {
            sink_stag: Stag(0x4242_4200),
            sink_to: 0,
            read_size: len,
            src_stag: Stag(stag),
            src_to: to,
        };
        let msn = Msn(self.n.initial_msns().read_tx.0.wrapping_add(k));
        let repr = UlpduRepr::read_request(msn, req);
        let mut u = vec![0u8; repr.buffer_len()];
        let ul = repr.emit(&mut u).unwrap();
        let mut f = vec![0u8; fpdu::fpdu_len(ul)];
        let fl = fpdu::emit(&u[..ul], self.n.crc, &mut f).unwrap();
        self.raw.write_all(&f[..fl]).unwrap();
    }

    /// Reads FPDUs until `want` octets of Read Response payload arrived
    /// (returned) or a Terminate (its code), or the victim closed.
    fn collect(&mut self, want: usize) -> (Vec<u8>, Option<TermCode>) {
        let mut payload = Vec::new();
        let mut b = vec![0u8; 1 << 16];
        loop {
            while let Ok(f) = fpdu::decode(&self.got, self.n.crc) {
                let len = f.len;
                let repr = UlpduRepr::parse(f.ulpdu).expect("victim's ULPDU");
                let term = match repr.body {
                    UlpduBody::Payload(p) => {
                        payload.extend_from_slice(p);
                        None
                    }
                    UlpduBody::Terminate(t) => Some(t.code),
                    other => panic!("unexpected {other:?}"),
                };
                self.got.drain(..len);
                if term.is_some() {
                    return (payload, term);
                }
            }
            if payload.len() >= want && want > 0 {
                return (payload, None);
            }
            match self.raw.read(&mut b) {
                Ok(0) | Err(_) => return (payload, None),
                Ok(n) => self.got.extend_from_slice(&b[..n]),
            }
        }
    }
}

/// Regression guard for the loan's promise: the call must not return
/// while the engine still transmits a Read Response out of the buffer.
/// The raw peer asks for 32 MiB and does not read, so the response stalls
/// in the socket; the closure returns at once, the call keeps waiting
/// until the peer has read every octet (and they are the buffer's). A
/// Read Request after that gets a Terminate (invalid STag) and no data.
#[test]
fn return_waits_for_read_response_in_flight() {
    read_response_in_flight_case(false);
}

/// The same with the datamovers transmitting the response.
#[test]
fn return_waits_for_read_response_in_flight_datamovers() {
    read_response_in_flight_case(true);
}

fn read_response_in_flight_case(force_dm: bool) {
    const LEN: usize = 32 << 20;
    let dev = device(force_dm);
    let pd = ProtectionDomain::new(&dev);
    let mut raw = raw_victim(pd.clone());
    let (stag_tx, stag_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let lender = std::thread::spawn(move || {
        let data = pattern(LEN, 5);
        pd.lend(&data, Access::REMOTE_READ, |r| {
            stag_tx.send((r.rkey(), r.addr())).unwrap();
            // The request is on its way: the closure ends, the response
            // is still being transmitted.
            go_rx.recv().unwrap();
        })
        .unwrap();
        data
    });
    let (stag, addr) = stag_rx.recv().unwrap();
    raw.read_request(0, stag, addr, LEN as u32);
    // Let the victim start responding and fill the socket buffers.
    let mut peek = [0u8; 64];
    raw.raw.peek(&mut peek).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    go_tx.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !lender.is_finished(),
        "the loan ended while its Read Response was still being sent"
    );
    let (payload, term) = raw.collect(LEN);
    assert_eq!(term, None);
    let data = lender.join().unwrap();
    assert_eq!(payload.len(), LEN);
    assert!(payload == data, "Read Response differs from the buffer");
    // After the loan: a Terminate, no data.
    raw.read_request(1, stag, addr, 64);
    let (payload, term) = raw.collect(0);
    assert!(payload.is_empty());
    assert_eq!(term, Some(TermCode::from(TermError::RdmapInvalidStag)));
    let deadline = Instant::now() + DEADLINE;
    while raw.qp.state() != QpState::Error && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(raw.qp.state(), QpState::Error);
}

/// A Read Response stuck in a socket whose peer never reads: aborting the
/// connection lets the loan end (the engine drops the response).
#[test]
fn abort_releases_a_stuck_read_response() {
    const LEN: usize = 32 << 20;
    let dev = device(false);
    let pd = ProtectionDomain::new(&dev);
    let mut raw = raw_victim(pd.clone());
    let (stag_tx, stag_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (used_tx, used_rx) = mpsc::channel();
    let lender = std::thread::spawn(move || {
        let data = pattern(LEN, 6);
        pd.lend(&data, Access::REMOTE_READ, |r| {
            stag_tx.send((r.rkey(), r.addr())).unwrap();
            go_rx.recv().unwrap();
            r.revoke();
            used_tx.send(r.in_use()).unwrap();
        })
        .unwrap();
    });
    let (stag, addr) = stag_rx.recv().unwrap();
    raw.read_request(0, stag, addr, LEN as u32);
    let mut peek = [0u8; 64];
    raw.raw.peek(&mut peek).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    go_tx.send(()).unwrap();
    assert!(used_rx.recv().unwrap(), "a stuck response holds the buffer");
    std::thread::sleep(Duration::from_millis(200));
    assert!(!lender.is_finished());
    raw.qp.abort();
    let deadline = Instant::now() + DEADLINE;
    while !lender.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the loan never ended after abort"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    lender.join().unwrap();
}
