//! Every operation end to end over real loopback TCP, data verified.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use common::*;
use softrdma_engine::{RecvWr, SendFlags, SendOp, SendWr, WcFlags, WcOpcode, WcStatus};

fn send_recv(crc: bool, len: usize) {
    let p = pair(crc);
    let src = mr(&p.a, len.max(1));
    let dst = mr(&p.b, len.max(1));
    let data = pattern(len, 7);
    src.write(0, &data).unwrap();
    let rsge = [dst.sge(0, len as u32).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(42, &rsge)).unwrap();
    let ssge = [src.sge(0, len as u32).unwrap()];
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).sg_list(&ssge).signaled())
        .unwrap();
    let s = wait(&p.a.cq, 1);
    assert_eq!(s[0].status, WcStatus::Success, "{s:?}");
    assert_eq!(s[0].opcode, WcOpcode::Send);
    assert_eq!(s[0].wr_id, 1);
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].wr_id, 42);
    assert_eq!(r[0].byte_len as usize, len);
    assert_eq!(r[0].qp_num, p.b.qp.qp_num());
    assert_eq!(dst.to_vec()[..len], data[..]);
}

#[test]
fn send_recv_small() {
    send_recv(false, 8);
}

#[test]
fn send_recv_zero_length() {
    send_recv(false, 0);
}

#[test]
fn send_recv_large_multi_fpdu() {
    send_recv(false, 1 << 20);
}

#[test]
fn send_recv_large_with_crc() {
    send_recv(true, 300_001);
}

fn write(crc: bool, len: usize) {
    let p = pair(crc);
    let src = mr(&p.a, len);
    let dst = mr(&p.b, len + 64);
    let data = pattern(len, 3);
    src.write(0, &data).unwrap();
    let sge = [src.sge(0, len as u32).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                9,
                SendOp::Write {
                    remote_addr: dst.addr() + 64,
                    rkey: dst.rkey(),
                },
            )
            .sg_list(&sge)
            .signaled(),
        )
        .unwrap();
    let s = wait(&p.a.cq, 1);
    assert_eq!(s[0].status, WcStatus::Success, "{s:?}");
    assert_eq!(s[0].opcode, WcOpcode::RdmaWrite);
    // The Write completes at the sender once on the wire; a Send after it
    // arrives after the data (ordering on one connection).
    let flag = mr(&p.b, 8);
    let fsge = [flag.sge(0, 8).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(1, &fsge)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(10, SendOp::Send).inline(b"done!!!!").signaled())
        .unwrap();
    wait(&p.b.cq, 1);
    let got = dst.to_vec();
    assert_eq!(&got[64..64 + len], &data[..]);
    assert!(
        got[..64].iter().all(|&b| b == 0),
        "bytes before the target untouched"
    );
}

#[test]
fn write_small() {
    write(false, 100);
}

#[test]
fn write_large() {
    write(false, 4 << 20);
}

#[test]
fn write_large_crc() {
    write(true, 1 << 20);
}

fn read(crc: bool, len: usize) {
    let p = pair(crc);
    let remote = mr(&p.b, len);
    let data = pattern(len, 11);
    remote.write(0, &data).unwrap();
    let local = mr(&p.a, len);
    let sge = [local.sge(0, len as u32).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                5,
                SendOp::Read {
                    remote_addr: remote.addr(),
                    rkey: remote.rkey(),
                },
            )
            .sg_list(&sge)
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::Success, "{c:?}");
    assert_eq!(c[0].opcode, WcOpcode::RdmaRead);
    assert_eq!(c[0].byte_len as usize, len);
    assert_eq!(local.to_vec(), data);
}

#[test]
fn read_small() {
    read(false, 16);
}

#[test]
fn read_large() {
    read(false, 3 << 20);
}

#[test]
fn read_crc() {
    read(true, 200_000);
}

#[test]
fn atomics_fetch_add_and_cmp_swap() {
    let p = pair(false);
    let remote = mr(&p.b, 64);
    remote.write(8, &100u64.to_ne_bytes()).unwrap();
    let local = mr(&p.a, 16);
    let s0 = [local.sge(0, 8).unwrap()];
    p.a.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::FetchAdd {
                    remote_addr: remote.addr() + 8,
                    rkey: remote.rkey(),
                    add: 5,
                },
            )
            .sg_list(&s0)
            .signaled(),
        )
        .unwrap();
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].status, WcStatus::Success);
    assert_eq!(c[0].opcode, WcOpcode::FetchAdd);
    let mut v = [0u8; 8];
    local.read(0, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 100);
    remote.read(8, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 105);
    // CmpSwap that fails, then one that succeeds.
    let s1 = [local.sge(8, 8).unwrap()];
    for (id, compare, expect_after) in [(2u64, 7u64, 105u64), (3, 105, 999)] {
        p.a.qp
            .post_send(
                &SendWr::new(
                    id,
                    SendOp::CmpSwap {
                        remote_addr: remote.addr() + 8,
                        rkey: remote.rkey(),
                        compare,
                        swap: 999,
                    },
                )
                .sg_list(&s1)
                .signaled(),
            )
            .unwrap();
        let c = wait(&p.a.cq, 1);
        assert_eq!(c[0].status, WcStatus::Success);
        assert_eq!(c[0].opcode, WcOpcode::CompSwap);
        local.read(8, &mut v).unwrap();
        assert_eq!(u64::from_ne_bytes(v), 105, "original value returned");
        remote.read(8, &mut v).unwrap();
        assert_eq!(u64::from_ne_bytes(v), expect_after);
    }
}

#[test]
fn write_with_immediate_consumes_a_receive() {
    let p = pair(false);
    let dst = mr(&p.b, 64);
    let rsge = [dst.sge(0, 0).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(77, &rsge)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::WriteWithImm {
                    remote_addr: dst.addr(),
                    rkey: dst.rkey(),
                    imm: 0xdead_beef,
                },
            )
            .inline(b"hello")
            .signaled(),
        )
        .unwrap();
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].status, WcStatus::Success);
    assert_eq!(r[0].opcode, WcOpcode::RecvRdmaWithImm);
    assert!(r[0].flags.contains(WcFlags::WITH_IMM));
    assert_eq!(r[0].imm_data, 0xdead_beef);
    assert_eq!(&dst.to_vec()[..5], b"hello");
    assert_eq!(wait(&p.a.cq, 1)[0].status, WcStatus::Success);
}

#[test]
fn send_with_immediate_uses_one_receive() {
    let p = pair(false);
    let dst = mr(&p.b, 64);
    let rsge = [dst.sge(0, 64).unwrap()];
    p.b.qp.post_recv(&RecvWr::new(1, &rsge)).unwrap();
    p.b.qp.post_recv(&RecvWr::new(2, &rsge)).unwrap();
    p.a.qp
        .post_send(
            &SendWr::new(1, SendOp::SendWithImm { imm: 5 })
                .inline(b"abc")
                .signaled(),
        )
        .unwrap();
    let r = wait(&p.b.cq, 1);
    assert_eq!(r[0].wr_id, 1);
    assert_eq!(r[0].opcode, WcOpcode::Recv);
    assert_eq!(r[0].byte_len, 3);
    assert_eq!(r[0].imm_data, 5);
    assert!(r[0].flags.contains(WcFlags::WITH_IMM));
    assert_eq!(
        p.b.qp.recv_queue_len(),
        1,
        "the second receive is still posted"
    );
}

#[test]
fn scatter_gather_send_into_scattered_receive() {
    let p = pair(false);
    let src = mr(&p.a, 10_000);
    let data = pattern(10_000, 1);
    src.write(0, &data).unwrap();
    // Gather 3 pieces (3000 + 1 + 4999 bytes) from different offsets.
    let s = [
        src.sge(0, 3000).unwrap(),
        src.sge(5000, 1).unwrap(),
        src.sge(5001, 4999).unwrap(),
    ];
    let expect: Vec<u8> = [&data[0..3000], &data[5000..5001], &data[5001..10_000]].concat();
    let dst = mr(&p.b, 20_000);
    // Scatter into 4 pieces: 1 + 4000 + 2999 + rest.
    let r = [
        dst.sge(100, 1).unwrap(),
        dst.sge(1000, 4000).unwrap(),
        dst.sge(9000, 2999).unwrap(),
        dst.sge(15_000, 5000).unwrap(),
    ];
    p.b.qp.post_recv(&RecvWr::new(1, &r)).unwrap();
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).sg_list(&s))
        .unwrap();
    let c = wait(&p.b.cq, 1);
    assert_eq!(c[0].byte_len, 8000);
    let got = dst.to_vec();
    let mut placed = Vec::new();
    placed.extend_from_slice(&got[100..101]);
    placed.extend_from_slice(&got[1000..5000]);
    placed.extend_from_slice(&got[9000..11_999]);
    placed.extend_from_slice(&got[15_000..15_000]);
    assert_eq!(placed.len(), 7000);
    let mut placed_all = placed.clone();
    placed_all.extend_from_slice(&got[15_000..16_000]);
    assert_eq!(placed_all, expect);
}

#[test]
fn unsignaled_requests_complete_with_the_next_signaled_one() {
    let p = pair(false);
    let dst = mr(&p.b, 4096);
    for i in 0..10u64 {
        let bytes = i.to_ne_bytes();
        let mut wr = SendWr::new(
            i,
            SendOp::Write {
                remote_addr: dst.addr() + i * 8,
                rkey: dst.rkey(),
            },
        )
        .inline(&bytes);
        if i == 9 {
            wr = wr.flags(SendFlags::SIGNALED);
        }
        p.a.qp.post_send(&wr).unwrap();
    }
    let c = wait(&p.a.cq, 1);
    assert_eq!(c[0].wr_id, 9);
    assert_eq!(
        p.a.qp.send_queue_len(),
        0,
        "the unsignaled ones are retired too"
    );
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        p.a.cq.poll_one().is_none(),
        "no completions for unsignaled requests"
    );
}

#[test]
fn send_to_a_qp_without_a_receive_is_a_terminate() {
    let p = pair(false);
    p.a.qp
        .post_send(&SendWr::new(1, SendOp::Send).inline(b"x").signaled())
        .unwrap();
    // The sender's Send completes (it is on the wire); the receiver finds no
    // buffer, sends a Terminate and both QPs end in ERROR.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while p.b.qp.state() != softrdma_engine::QpState::Error
        || p.a.qp.state() != softrdma_engine::QpState::Error
    {
        assert!(
            std::time::Instant::now() < deadline,
            "states {} {}",
            p.a.qp.state(),
            p.b.qp.state()
        );
        p.a.cq.poll_one();
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let mut saw_term = false;
    while let Some(ev) = p.dev.async_events().try_get() {
        if ev.kind == softrdma_engine::AsyncEventKind::TerminateReceived
            && ev.qp_num == Some(p.a.qp.qp_num())
        {
            let t = ev.term.expect("code");
            assert_eq!(
                t.known(),
                Some(softrdma_engine::wire::errcode::TermError::DdpUntaggedNoBuffer)
            );
            saw_term = true;
        }
    }
    assert!(saw_term, "the sender was told why");
}

/// Regression: in forced-datamover mode, a request posted while another
/// thread held the transmit lock (and found nothing to do) was never handed
/// to the datamover; a ping-pong then stopped after some 10^5 round trips.
#[test]
fn forced_datamover_ping_pong_never_strands_a_request() {
    let p = pair_with(device(true), false, |_| {});
    let ma = mr(&p.a, 64);
    let mb = mr(&p.b, 64);
    let sa = [ma.sge(0, 8).unwrap()];
    let sb = [mb.sge(0, 8).unwrap()];
    for _ in 0..16 {
        p.a.qp.post_recv(&RecvWr::new(0, &sa)).unwrap();
        p.b.qp.post_recv(&RecvWr::new(0, &sb)).unwrap();
    }
    const ITERS: usize = 30_000;
    let (qb, cb) = (p.b.qp.clone(), p.b.cq.clone());
    let echo = std::thread::spawn(move || {
        let mut n = 0;
        while n < ITERS {
            for wc in wait(&cb, 1) {
                if wc.opcode == WcOpcode::Recv {
                    qb.post_recv(&RecvWr::new(0, &sb)).unwrap();
                    qb.post_send(&SendWr::new(1, SendOp::Send).inline(b"pong"))
                        .unwrap();
                    n += 1;
                }
            }
        }
    });
    for _ in 0..ITERS {
        p.a.qp
            .post_send(&SendWr::new(1, SendOp::Send).inline(b"ping"))
            .unwrap();
        let wc = wait(&p.a.cq, 1);
        assert_eq!(wc[0].opcode, WcOpcode::Recv);
        p.a.qp.post_recv(&RecvWr::new(0, &sa)).unwrap();
    }
    echo.join().unwrap();
}

/// Bytes of full operation read before `establish` (read-ahead) are
/// processed as FPDUs first: a Send whose first bytes were consumed by the
/// application's own read arrives intact.
#[test]
fn establish_with_prefix_processes_read_ahead_bytes() {
    use softrdma_engine::LinkParams;
    use softrdma_engine::connect::{mpa_accept, mpa_connect};
    use softrdma_engine::proto::mpa::MpaConfig;
    use std::io::Read;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};
    use std::time::Duration;
    let dev = device(false);
    let a = side(&dev, |_| {});
    let b = side(&dev, |_| {});
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let n = mpa_accept(&mut s, &MpaConfig::default(), &[], Duration::from_secs(5)).unwrap();
        (s, n)
    });
    let mut sa = TcpStream::connect(addr).unwrap();
    let na = mpa_connect(&mut sa, &MpaConfig::default(), &[], Duration::from_secs(5)).unwrap();
    let (mut sb, nb) = t.join().unwrap();
    a.qp.establish(sa, &LinkParams::from(&na)).unwrap();
    let dst = mr(&b, 64);
    b.qp.post_recv(&RecvWr::new(3, &[dst.sge(0, 64).unwrap()]))
        .unwrap();
    a.qp.post_send(
        &SendWr::new(1, SendOp::Send)
            .inline(b"read ahead!")
            .signaled(),
    )
    .unwrap();
    // The application reads the first 10 bytes of the FPDU itself.
    let mut head = [0u8; 10];
    sb.read_exact(&mut head).unwrap();
    b.qp.establish_with_prefix(sb, &LinkParams::from(&nb), &head)
        .unwrap();
    let c = wait(&b.cq, 1);
    assert_eq!(
        (c[0].wr_id, c[0].status, c[0].byte_len),
        (3, WcStatus::Success, 11)
    );
    assert_eq!(&dst.to_vec()[..11], b"read ahead!");
}
