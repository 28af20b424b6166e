//! Datamovers: many QPs on one transmit thread, a congested QP next to a
//! healthy one, direct sending against forced datamover transmission, and
//! the pause/resume statistics. Data is verified byte for byte; deadlines
//! only turn a hang into a failure.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    Device, DeviceConfig, LinkParams, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus,
};

const TIMEOUT: Duration = Duration::from_secs(20);

/// A device with one datamover (and one receive thread) through which
/// every transmission goes.
fn one_datamover() -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.datamover_cpus = vec![0];
    cfg.force_datamover = true;
    cfg.pin_threads = false;
    Device::open_with(cfg).expect("device")
}

fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn write_wr(id: u64, sge: &[Sge], remote_addr: u64, rkey: u32) -> SendWr<'_> {
    SendWr::new(id, SendOp::Write { remote_addr, rkey })
        .sg_list(sge)
        .signaled()
}

/// Seed of message `m` of QP pair `q`.
fn seed(q: usize, m: usize) -> u8 {
    (q * 7 + m * 3) as u8
}

#[test]
fn many_qps_share_one_datamover() {
    const QPS: usize = 64;
    const MSGS: usize = 4;
    const LEN: usize = 64 << 10;
    let dev = one_datamover();
    let pairs: Vec<Pair> = (0..QPS)
        .map(|_| pair_with(dev.clone(), false, |_| {}))
        .collect();
    let mut bufs = Vec::new();
    for (q, p) in pairs.iter().enumerate() {
        assert_eq!(p.a.qp.query().datamover, 0);
        let src = mr(&p.a, MSGS * LEN);
        for m in 0..MSGS {
            src.write(m * LEN, &pattern(LEN, seed(q, m))).unwrap();
        }
        let dst = mr(&p.b, MSGS * LEN);
        let flag = mr(&p.b, 8);
        let fsge = [flag.sge(0, 8).unwrap()];
        p.b.qp.post_recv(&RecvWr::new(99, &fsge)).unwrap();
        bufs.push((src, dst, flag));
    }
    // Post everything first: all QPs are active on the datamover at once.
    for (p, (src, dst, _)) in pairs.iter().zip(&bufs) {
        let sges: Vec<[Sge; 1]> = (0..MSGS)
            .map(|m| [src.sge(m * LEN, LEN as u32).unwrap()])
            .collect();
        let mut wrs: Vec<SendWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(m, s)| write_wr(m as u64, s, dst.addr() + (m * LEN) as u64, dst.rkey()))
            .collect();
        wrs.push(
            SendWr::new(MSGS as u64, SendOp::Send)
                .inline(b"all done")
                .signaled(),
        );
        p.a.qp.post_send_list(&wrs).unwrap();
    }
    for (q, (p, (_, dst, flag))) in pairs.iter().zip(&bufs).enumerate() {
        let s = wait(&p.a.cq, MSGS + 1);
        assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
        let ids: Vec<u64> = s.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..=MSGS as u64).collect::<Vec<_>>());
        let r = wait(&p.b.cq, 1);
        assert_eq!(r[0].status, WcStatus::Success);
        assert_eq!(flag.to_vec(), b"all done");
        let got = dst.to_vec();
        for m in 0..MSGS {
            assert!(
                got[m * LEN..(m + 1) * LEN] == pattern(LEN, seed(q, m)),
                "QP pair {q} message {m}"
            );
        }
    }
    let stats = dev.datamover_stats();
    assert_eq!(stats.len(), 1, "{stats:?}");
    assert_eq!(stats[0].qps, 2 * QPS, "{stats:?}");
    // Every sending QP was served by the datamover.
    assert!(stats[0].slices >= QPS as u64, "{stats:?}");
}

/// A QP that joins a datamover busy with a large transfer gets its turn at
/// once: a small Write posted right after a 64 MiB one on another QP of the
/// same datamover completes first (with turns unbounded by the slice size,
/// the large transfer would run to its end first).
#[test]
fn a_small_transfer_is_not_starved_by_a_large_one() {
    const LEN: usize = 64 << 20;
    let dev = one_datamover();
    let p1 = pair_with(dev.clone(), false, |_| {});
    let p2 = pair_with(dev.clone(), false, |_| {});
    let src1 = mr(&p1.a, LEN);
    let dst1 = mr(&p1.b, LEN);
    let src2 = mr(&p2.a, 4096);
    src2.write(0, &pattern(4096, 9)).unwrap();
    let dst2 = mr(&p2.b, 4096);
    let s1 = [src1.sge(0, LEN as u32).unwrap()];
    let s2 = [src2.sge(0, 4096).unwrap()];
    let before = dev.datamover_stats()[0].slices;
    p1.a.qp
        .post_send(&write_wr(1, &s1, dst1.addr(), dst1.rkey()))
        .unwrap();
    p2.a.qp
        .post_send(&write_wr(2, &s2, dst2.addr(), dst2.rkey()))
        .unwrap();
    let mut first = None;
    let mut done = (false, false);
    let deadline = Instant::now() + TIMEOUT;
    while !(done.0 && done.1) {
        assert!(Instant::now() < deadline, "timed out");
        if !done.0 && p1.a.cq.poll_one().is_some() {
            done.0 = true;
            first.get_or_insert(1);
        }
        if !done.1 && p2.a.cq.poll_one().is_some() {
            done.1 = true;
            first.get_or_insert(2);
        }
    }
    assert_eq!(first, Some(2), "the 4 KiB Write waited for the 64 MiB one");
    // A Write completes for its sender once sent; the target places it
    // when its receive path gets to it.
    let deadline = Instant::now() + TIMEOUT;
    while dst2.to_vec() != pattern(4096, 9) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(dst2.to_vec(), pattern(4096, 9));
    let slices = dev.datamover_stats()[0].slices - before;
    assert!(slices > 2, "{slices} turns");
}

/// Connects `qp` to a raw peer that only does the MPA exchange; returns
/// the peer's stream (nobody reads it yet) once the QP is in RTS.
fn connect_raw(qp: &softrdma_engine::QueuePair) -> TcpStream {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = listener.local_addr().unwrap();
    let accept = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        mpa_accept(&mut s, &MpaConfig::default(), &[], TIMEOUT).expect("mpa_accept");
        s
    });
    let mut s = TcpStream::connect(addr).unwrap();
    let q = qp.query();
    let cfg = MpaConfig {
        ird: q.ird,
        ord: q.ord,
        ..MpaConfig::default()
    };
    let n = mpa_connect(&mut s, &cfg, &[], TIMEOUT).expect("mpa_connect");
    assert!(!n.crc);
    qp.establish(s, &LinkParams::from(&n)).unwrap();
    accept.join().unwrap()
}

/// Reads FPDUs of tagged Writes (no CRC, no markers) from `s` until the
/// stream ends, placing each payload at its Tagged Offset in a buffer of
/// `len` bytes. Returns the buffer and the payload byte count.
fn collect_writes(mut s: TcpStream, len: usize) -> (Vec<u8>, u64) {
    let mut out = vec![0u8; len];
    let mut total = 0u64;
    let mut len_field = [0u8; 2];
    let mut ulpdu = vec![0u8; 1 << 17];
    loop {
        if s.read_exact(&mut len_field).is_err() {
            return (out, total);
        }
        let ulen = usize::from(u16::from_be_bytes(len_field));
        let pad = (4 - (2 + ulen) % 4) % 4;
        // ULPDU, pad, CRC field.
        let body = &mut ulpdu[..ulen + pad + 4];
        s.read_exact(body).expect("a whole FPDU");
        // DDP tagged header: control (2), STag (4), Tagged Offset (8);
        // RFC 5041 section 4.2.
        assert_eq!(body[0] & 0x80, 0x80, "tagged: a Write");
        assert_eq!(body[1] & 0x0f, 0, "RDMAP opcode Write");
        let to = u64::from_be_bytes(body[6..14].try_into().unwrap()) as usize;
        let payload = &body[14..ulen];
        out[to..to + payload.len()].copy_from_slice(payload);
        total += payload.len() as u64;
    }
}

/// A QP whose peer does not read fills its socket and is paused; another
/// QP on the same (only) datamover keeps moving data. When the peer reads
/// again, the paused QP resumes and every byte arrives.
#[test]
fn congested_qp_does_not_stall_its_neighbour() {
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 32;
    let dev = one_datamover();
    let x = side(&dev, |_| {});
    let peer = connect_raw(&x.qp);
    let src = mr(&x, CHUNK * CHUNKS);
    let data = pattern(CHUNK * CHUNKS, 5);
    src.write(0, &data).unwrap();
    let sges: Vec<[Sge; 1]> = (0..CHUNKS)
        .map(|i| [src.sge(i * CHUNK, CHUNK as u32).unwrap()])
        .collect();
    let wrs: Vec<SendWr<'_>> = sges
        .iter()
        .enumerate()
        .map(|(i, s)| write_wr(i as u64, s, (i * CHUNK) as u64, 0x0100_0001))
        .collect();
    x.qp.post_send_list(&wrs).unwrap();
    until("the congested QP to be paused", || {
        dev.datamover_stats()[0].pauses >= 1
    });

    // A healthy pair on the same datamover.
    let y = pair_with(dev.clone(), false, |_| {});
    assert_eq!(y.a.qp.query().datamover, x.qp.query().datamover);
    const YLEN: usize = 256 << 10;
    let ysrc = mr(&y.a, YLEN);
    let ydst = mr(&y.b, YLEN);
    let yread = mr(&y.a, YLEN);
    for round in 0..4u8 {
        ysrc.write(0, &pattern(YLEN, round)).unwrap();
        let s = [ysrc.sge(0, YLEN as u32).unwrap()];
        y.a.qp
            .post_send(&write_wr(1, &s, ydst.addr(), ydst.rkey()))
            .unwrap();
        // Read it back: the Write is placed before the Read Response.
        let r = [yread.sge(0, YLEN as u32).unwrap()];
        y.a.qp
            .post_send(
                &SendWr::new(
                    2,
                    SendOp::Read {
                        remote_addr: ydst.addr(),
                        rkey: ydst.rkey(),
                    },
                )
                .sg_list(&r)
                .signaled(),
            )
            .unwrap();
        let c = wait(&y.a.cq, 2);
        assert!(c.iter().all(|w| w.status == WcStatus::Success), "{c:?}");
        assert_eq!(c[1].opcode, WcOpcode::RdmaRead);
        assert!(ydst.to_vec() == pattern(YLEN, round));
        assert!(yread.to_vec() == pattern(YLEN, round));
    }
    // The congested QP is still stuck: its peer has not read a byte, and
    // 32 MiB do not fit in the socket buffers.
    assert!(x.qp.send_queue_len() > 0, "the congested QP finished?");
    let resumes_before = dev.datamover_stats()[0].resumes;

    // The peer reads again.
    let reader = std::thread::spawn(move || collect_writes(peer, CHUNK * CHUNKS));
    until("the congested QP to finish", || x.qp.send_queue_len() == 0);
    let done = wait(&x.cq, CHUNKS);
    assert!(
        done.iter().all(|w| w.status == WcStatus::Success),
        "{done:?}"
    );
    let stats = dev.datamover_stats();
    assert!(stats[0].resumes > resumes_before, "{stats:?}");
    assert!(stats[0].pauses >= stats[0].resumes, "{stats:?}");
    assert_eq!(x.qp.state(), softrdma_engine::QpState::Rts);
    // Closing the QP ends the stream at an FPDU boundary.
    drop(x);
    let (got, total) = reader.join().unwrap();
    assert_eq!(total, (CHUNK * CHUNKS) as u64);
    assert!(got == data, "the congested QP's data");
}

/// Returns the sink bytes of a fixed workload of Sends (gathered and
/// scattered), Writes and Reads of awkward sizes.
fn workload(dev: Device) -> Vec<u8> {
    const SIZES: [usize; 9] = [0, 1, 7, 4095, 4096, 4097, 65_543, 300_001, (1 << 20) + 3];
    let p = pair_with(dev, false, |a| a.cap.max_send_wr = 1024);
    let total: usize = SIZES.iter().sum();
    let src = mr(&p.a, total);
    src.write(0, &pattern(total, 42)).unwrap();
    let remote = mr(&p.b, total);
    remote.write(0, &pattern(total, 43)).unwrap();
    let recv_sink = mr(&p.b, total + 64);
    let write_sink = mr(&p.b, total);
    let read_sink = mr(&p.a, total);
    let mut off = 0usize;
    let mut sends = 0;
    for (i, &len) in SIZES.iter().enumerate() {
        let i = i as u64;
        // Send gathered from two pieces into two scattered pieces.
        let h = len / 3;
        let g = [
            src.sge(off, h as u32).unwrap(),
            src.sge(off + h, (len - h) as u32).unwrap(),
        ];
        let sc = [
            recv_sink.sge(off, (len - h) as u32).unwrap(),
            recv_sink.sge(off + (len - h), (h + 1) as u32).unwrap(),
        ];
        p.b.qp.post_recv(&RecvWr::new(i, &sc)).unwrap();
        p.a.qp
            .post_send(&SendWr::new(i, SendOp::Send).sg_list(&g).signaled())
            .unwrap();
        sends += 1;
        let w = [src.sge(off, len as u32).unwrap()];
        p.a.qp
            .post_send(&write_wr(
                100 + i,
                &w,
                write_sink.addr() + off as u64,
                write_sink.rkey(),
            ))
            .unwrap();
        if len > 0 {
            let r = [read_sink.sge(off, len as u32).unwrap()];
            p.a.qp
                .post_send(
                    &SendWr::new(
                        200 + i,
                        SendOp::Read {
                            remote_addr: remote.addr() + off as u64,
                            rkey: remote.rkey(),
                        },
                    )
                    .sg_list(&r)
                    .signaled(),
                )
                .unwrap();
        }
        off += len;
    }
    let reads = SIZES.iter().filter(|&&l| l > 0).count();
    let s = wait(&p.a.cq, sends * 2 + reads);
    assert!(s.iter().all(|w| w.status == WcStatus::Success), "{s:?}");
    let r = wait(&p.b.cq, sends);
    assert!(r.iter().all(|w| w.status == WcStatus::Success), "{r:?}");
    for (w, &len) in r.iter().zip(&SIZES) {
        assert_eq!(w.byte_len as usize, len);
    }
    // All Writes were placed before the last Read's response arrived.
    let mut out = recv_sink.to_vec();
    out.extend(write_sink.to_vec());
    out.extend(read_sink.to_vec());
    out
}

#[test]
fn direct_sending_and_forced_datamover_give_identical_data() {
    let direct = workload(device(false));
    let forced = workload(one_datamover());
    assert!(direct == forced, "direct and forced differ");
    // And both are what was sent.
    let sizes_total = direct.len() - 64;
    let total = sizes_total / 3;
    let mut want_recv = pattern(total, 42);
    want_recv.extend([0u8; 64]);
    assert!(direct[..total + 64] == want_recv[..], "Send data");
    assert!(
        direct[total + 64..2 * total + 64] == pattern(total, 42)[..],
        "Write data"
    );
    assert!(
        direct[2 * total + 64..] == pattern(total, 43)[..],
        "Read data"
    );
}
