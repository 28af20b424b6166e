//! The engine's receive path against a peer that sends whatever the fuzzer
//! wants, over real loopback TCP. Per input: a fresh QP (on one device
//! shared by the whole process) with an arena region cut into a memory
//! window, receive buffers with gaps between their SGEs and a Read sink,
//! a region with every right and a guard region of another protection
//! domain; the victim posts two receives and one RDMA Read. The raw peer
//! connects (MPA), sends the input, and closes its sending direction.
//!
//! Input: byte 0 holds flags (bit 0: CRC; bit 1: framed mode). In framed
//! mode the rest is a list of `len_hi len_lo ulpdu...` records, each sent
//! as a well-framed FPDU (length, pad, CRC computed here), so the fuzzer
//! works on DDP/RDMAP headers; an STag field whose first byte is 0xff
//! names a real STag (last byte picks which) and a Tagged Offset whose
//! first two bytes are 0xffff is relative to that region (signed 32-bit
//! offset in the last four bytes): real regions, offsets near their bounds.
//! Otherwise the rest is the raw stream.
//!
//! Checked after each input: the QP reaches ERROR, or IDLE if the input
//! ended at an FPDU boundary and nothing in it was an error (the peer's FIN
//! then is a graceful close; no panic, no hang), each
//! posted receive and the Read complete exactly once, no byte outside a
//! granted range changed, and no Read Response carried a byte the peer was
//! never granted.
#![no_main]

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::wire::fpdu;
use softrdma_engine::wire::rdmap::Opcode;
use softrdma_engine::wire::ulpdu::{UlpduBody, UlpduRepr};
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, LinkParams, ProtectionDomain, QpInitAttr,
    QpState, QueuePair, RecvWr, SendOp, SendWr, WorkCompletion,
};

const DEADLINE: Duration = Duration::from_secs(10);
const CANARY: u8 = 0xa5;
const GRANT: u8 = 0x3c;
const ARENA_LEN: usize = 8192;
const WINDOW: Range<usize> = 1000..1600;
const RECV: [[Range<usize>; 2]; 2] = [[2000..2300, 2400..2700], [3000..3300, 3400..3700]];
const READ_SINK: Range<usize> = 5000..5400;
const FULL_LEN: usize = 2048;
const GUARD_LEN: usize = 256;

fn device() -> &'static Device {
    static DEV: OnceLock<Device> = OnceLock::new();
    DEV.get_or_init(|| {
        let mut cfg = DeviceConfig::default();
        cfg.pin_threads = false;
        Device::open_with(cfg).expect("device")
    })
}

fn full_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// Puts a real STag / a Tagged Offset relative to its region where the
/// input asks for one.
fn patch(u: &mut [u8], stag_at: usize, to_at: Option<usize>, regions: &[(u32, u64, usize)]) {
    let Some(s) = u.get(stag_at..stag_at + 4) else {
        return;
    };
    if s[0] != 0xff {
        return;
    }
    let (stag, base, _) = regions[usize::from(s[3]) % regions.len()];
    u[stag_at..stag_at + 4].copy_from_slice(&stag.to_be_bytes());
    let Some(to_at) = to_at else { return };
    let Some(t) = u.get(to_at..to_at + 8) else {
        return;
    };
    if t[0] == 0xff && t[1] == 0xff {
        let off = i32::from_be_bytes([t[4], t[5], t[6], t[7]]);
        let to = base.wrapping_add_signed(i64::from(off));
        u[to_at..to_at + 8].copy_from_slice(&to.to_be_bytes());
    }
}

fn stream(data: &[u8], crc: bool, regions: &[(u32, u64, usize)]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = data;
    while rest.len() >= 2 {
        let len = usize::from(u16::from_be_bytes([rest[0], rest[1]]) & 0x1fff);
        let take = len.min(rest.len() - 2);
        let mut u = rest[2..2 + take].to_vec();
        rest = &rest[2 + take..];
        if u.len() >= 14 && u[0] & 0x80 != 0 {
            patch(&mut u, 2, Some(6), regions);
        } else if u.len() >= 18 {
            match u[1] & 0x0f {
                // Read Request: Data Source STag and TO.
                1 => patch(&mut u, 18 + 16, Some(18 + 20), regions),
                // Atomic Request: Remote STag and TO.
                10 => patch(&mut u, 18 + 8, Some(18 + 12), regions),
                // Send with Invalidate: the Invalidate STag.
                4 | 6 => patch(&mut u, 2, None, regions),
                _ => {}
            }
        }
        let mut f = vec![0u8; fpdu::fpdu_len(u.len())];
        let n = fpdu::emit(&u, crc, &mut f).expect("frame");
        out.extend_from_slice(&f[..n]);
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let Some((&flags, body)) = data.split_first() else {
        return;
    };
    if body.len() > 64 * 1024 {
        return;
    }
    let dev = device();
    let pd = ProtectionDomain::new(dev);
    let other_pd = ProtectionDomain::new(dev);
    let cq = CompletionQueue::new(dev, 64, None).expect("cq");
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).expect("qp");
    let arena = pd
        .register(ARENA_LEN, Access::LOCAL_WRITE | Access::MW_BIND)
        .expect("arena");
    arena.fill(CANARY);
    let mut writable = vec![WINDOW, READ_SINK];
    writable.extend(RECV.iter().flatten().cloned());
    for r in &writable {
        arena.write(r.start, &vec![GRANT; r.len()]).expect("grant");
    }
    let full = pd.register(FULL_LEN, full_access()).expect("full");
    full.fill(GRANT);
    let guard = other_pd.register(GUARD_LEN, full_access()).expect("guard");
    guard.fill(CANARY);

    // Connect: the raw peer is the initiator.
    let crc = flags & 1 != 0;
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let n = mpa_accept(&mut s, &MpaConfig::default(), &[], DEADLINE).expect("accept");
        (s, n)
    });
    let mut raw = TcpStream::connect(addr).expect("connect");
    let cfg = MpaConfig {
        crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::AcceptIfAsked
        },
        ..MpaConfig::default()
    };
    let raw_n = mpa_connect(&mut raw, &cfg, &[], DEADLINE).expect("mpa_connect");
    let (vs, vn) = acceptor.join().expect("acceptor");
    qp.establish(vs, &LinkParams::from(&vn)).expect("establish");

    let mw = pd.alloc_mw().expect("mw");
    qp.post_send(&SendWr::new(
        9,
        SendOp::BindMw {
            mw: &mw,
            mr: &arena,
            addr: arena.addr() + WINDOW.start as u64,
            length: WINDOW.len() as u64,
            access: Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
            key: None,
        },
    ))
    .expect("bind");
    for (i, segs) in RECV.iter().enumerate() {
        let sges: Vec<_> = segs
            .iter()
            .map(|r| arena.sge(r.start, r.len() as u32).expect("sge"))
            .collect();
        qp.post_recv(&RecvWr::new(100 + i as u64, &sges))
            .expect("recv");
    }
    let sink = [arena
        .sge(READ_SINK.start, READ_SINK.len() as u32)
        .expect("sink")];
    qp.post_send(
        &SendWr::new(
            1,
            SendOp::Read {
                remote_addr: 0x1000,
                rkey: 0x1234_5601,
            },
        )
        .sg_list(&sink)
        .signaled(),
    )
    .expect("read");
    // The bind completes before anything the peer sends is seen (its
    // completion is unsignaled; wait until the window is usable).
    let deadline = Instant::now() + DEADLINE;
    while !mw.is_bound() {
        assert!(Instant::now() < deadline, "bind never completed");
        std::thread::yield_now();
    }

    let regions = [
        (mw.rkey(), mw.addr(), WINDOW.len()),
        (full.rkey(), full.addr(), FULL_LEN),
        (arena.rkey(), arena.addr(), ARENA_LEN),
        (guard.rkey(), guard.addr(), GUARD_LEN),
        // The victim's Read sink (its STag is the arena's).
        (
            arena.lkey(),
            arena.addr() + READ_SINK.start as u64,
            READ_SINK.len(),
        ),
    ];
    let bytes = if flags & 2 != 0 {
        stream(body, raw_n.crc, &regions)
    } else {
        body.to_vec()
    };

    raw.set_read_timeout(Some(DEADLINE)).expect("timeout");
    raw.set_write_timeout(Some(DEADLINE)).expect("timeout");
    let mut reader = raw.try_clone().expect("clone");
    let drain = std::thread::spawn(move || {
        let mut got = Vec::new();
        let _ = reader.read_to_end(&mut got);
        got
    });
    let _ = raw.write_all(&bytes);
    let _ = raw.shutdown(Shutdown::Write);

    let deadline = Instant::now() + DEADLINE;
    while !matches!(qp.state(), QpState::Error | QpState::Idle) {
        assert!(Instant::now() < deadline, "QP stuck in {}", qp.state());
        std::thread::sleep(Duration::from_micros(200));
    }
    let want = [1u64, 100, 101];
    let mut seen: Vec<WorkCompletion> = Vec::new();
    while !want.iter().all(|id| seen.iter().any(|c| c.wr_id == *id)) {
        match cq.poll_one() {
            Some(wc) => seen.push(wc),
            None => {
                assert!(Instant::now() < deadline, "completions missing: {seen:?}");
                std::thread::yield_now();
            }
        }
    }
    while let Some(wc) = cq.poll_one() {
        seen.push(wc);
    }
    for id in want {
        assert_eq!(
            seen.iter().filter(|c| c.wr_id == id).count(),
            1,
            "wr {id}: {seen:?}"
        );
    }
    assert_eq!(seen.len(), want.len(), "unknown completions {seen:?}");

    let out = drain.join().expect("drain");
    let mut at = 0;
    while let Ok(f) = fpdu::decode(&out[at..], raw_n.crc) {
        at += f.len;
        if let Ok(r) = UlpduRepr::parse(f.ulpdu) {
            if let (Opcode::RdmaReadResponse, UlpduBody::Payload(p)) = (r.opcode, r.body) {
                assert!(!p.contains(&CANARY), "a Read Response leaked memory");
            }
        }
    }

    let after = arena.to_vec();
    for (i, &b) in after.iter().enumerate() {
        let granted = writable.iter().any(|r| r.contains(&i));
        assert!(granted || b == CANARY, "arena byte {i} changed to {b:#x}");
    }
    assert!(guard.to_vec().iter().all(|&b| b == CANARY), "guard changed");
    // Drop order: the QP before the memory it names.
    drop(qp);
});
