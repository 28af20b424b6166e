//! Two protocol-core connections over a real loopback TCP connection,
//! each driven by [`RxIo`] and [`TxIo`] over the engine's registered
//! memory.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use softrdma_proto::conn::Config;
use softrdma_proto::types::{
    Completion, LinkAction, Output, RecvWr, SendOp, SendWr, Sge, WcStatus,
};

use super::*;
use crate::mr::PdMemory;
use crate::state::QpState;
use crate::{Access, Device, DeviceConfig, MemoryRegion, ProtectionDomain};

fn device() -> Device {
    Device::open_with(DeviceConfig {
        pin_threads: false,
        ..DeviceConfig::default()
    })
    .unwrap()
}

fn sockets() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (b, _) = l.accept().unwrap();
    for s in [&a, &b] {
        s.set_nodelay(true).unwrap();
        s.set_nonblocking(true).unwrap();
    }
    (a, b)
}

/// One side: its connection, IO state, socket and completions.
struct Side {
    conn: Connection<Arc<Memory>>,
    rx: RxIo,
    tx: TxIo,
    sock: TcpStream,
    done: Vec<Completion>,
    fin_sent: bool,
}

impl Side {
    fn new(cfg: Config, sock: TcpStream) -> Side {
        Side {
            conn: Connection::new(cfg),
            rx: RxIo::new(&[]),
            tx: TxIo::new(),
            sock,
            done: Vec::new(),
            fin_sent: false,
        }
    }

    /// One round of IO; whether anything happened.
    fn turn(&mut self, mem: &mut PdMemory<'_>, now: u64) -> bool {
        let fd = self.sock.as_raw_fd();
        let (sent, got) = (self.tx.bytes_sent, self.rx.bytes_received);
        let _ = self.tx.progress(&mut self.conn, mem, fd, usize::MAX);
        let _ = self.rx.run(&mut self.conn, mem, fd, &|| now);
        let _ = self.tx.progress(&mut self.conn, mem, fd, usize::MAX);
        while let Some(o) = self.conn.poll_output() {
            if let Output::Link(LinkAction::SendFin | LinkAction::Shutdown) = o {
                assert_eq!(self.tx.pending(), 0, "FIN after every byte");
                crate::sys::io::shutdown_write(fd).unwrap();
                self.fin_sent = true;
            }
        }
        let before = self.done.len();
        self.done
            .extend(std::iter::from_fn(|| self.conn.poll_completion()));
        self.done.len() != before || sent != self.tx.bytes_sent || got != self.rx.bytes_received
    }
}

/// Runs both sides until `until` holds (10 s at most).
fn run(
    a: &mut Side,
    ma: &mut PdMemory<'_>,
    b: &mut Side,
    mb: &mut PdMemory<'_>,
    until: impl Fn(&Side, &Side) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut now = 1;
    while !until(a, b) {
        assert!(
            Instant::now() < deadline,
            "stuck: {:?} / {:?}",
            a.done,
            b.done
        );
        now += 1;
        if !(a.turn(ma, now) | b.turn(mb, now)) {
            std::thread::yield_now();
        }
    }
}

fn region(pd: &ProtectionDomain, len: usize, seed: u8) -> MemoryRegion {
    let m = pd
        .register(
            len,
            Access::LOCAL_WRITE
                | Access::REMOTE_WRITE
                | Access::REMOTE_READ
                | Access::REMOTE_ATOMIC,
        )
        .unwrap();
    let data: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect();
    m.write(0, &data).unwrap();
    m
}

fn sge(m: &MemoryRegion, at: u64, len: u32) -> [Sge; 1] {
    [Sge {
        lkey: m.lkey(),
        addr: m.addr() + at,
        len,
    }]
}

/// Where two byte strings first differ (and their lengths), if they do.
fn first_diff(a: &[u8], b: &[u8]) -> Option<(usize, usize, usize)> {
    let at = a.iter().zip(b).position(|(x, y)| x != y);
    match at {
        None if a.len() == b.len() => None,
        _ => Some((at.unwrap_or(a.len().min(b.len())), a.len(), b.len())),
    }
}

fn config(crc: bool) -> Config {
    Config {
        max_payload: 16 * 1024,
        ..Config::new(crc)
    }
}

#[test]
fn every_operation_over_a_socket() {
    for crc in [false, true] {
        let dev = device();
        let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
        const BIG: usize = 1 << 20;
        let src = region(&pa, BIG + 8192, 1);
        let dst = region(&pb, BIG + 8192, 2);
        dst.write(0, &40u64.to_ne_bytes()).unwrap();
        let rbuf = region(&pb, 4096, 3);
        let (sa, sb) = sockets();
        let mut a = Side::new(config(crc), sa);
        let mut b = Side::new(config(crc), sb);
        let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
        let mut mb = PdMemory::new(dev.stags(), pb.id(), None);

        b.conn
            .post_recv(
                &RecvWr {
                    wr_id: 50,
                    sgl: &sge(&rbuf, 0, 4096),
                },
                &mut mb,
            )
            .unwrap();
        let w = sge(&src, 0, BIG as u32);
        let small = sge(&src, 100, 3000);
        let sink = sge(&src, BIG as u64, 4096);
        let cell = sge(&src, BIG as u64 + 8184, 8);
        let posts = [
            SendWr::new(
                1,
                SendOp::Write {
                    rkey: dst.rkey(),
                    remote_addr: dst.addr() + 8,
                    imm: None,
                },
                &w,
            ),
            SendWr::new(
                2,
                SendOp::Send {
                    inv: None,
                    imm: Some(9),
                },
                &small,
            ),
            SendWr::new(
                3,
                SendOp::Read {
                    rkey: dst.rkey(),
                    remote_addr: dst.addr() + 8,
                },
                &sink,
            ),
            SendWr::new(
                4,
                SendOp::FetchAdd {
                    rkey: dst.rkey(),
                    remote_addr: dst.addr(),
                    add: 2,
                },
                &cell,
            ),
        ];
        for p in &posts {
            a.conn.post_send(p, &mut ma).unwrap();
        }
        run(&mut a, &mut ma, &mut b, &mut mb, |a, b| {
            a.done.len() == 4 && b.done.len() == 1
        });
        let st: Vec<(u64, WcStatus)> = a.done.iter().map(|c| (c.wr_id, c.status)).collect();
        assert_eq!(
            st,
            [
                (1, WcStatus::Success),
                (2, WcStatus::Success),
                (3, WcStatus::Success),
                (4, WcStatus::Success)
            ],
            "crc {crc}"
        );
        let r = b.done[0];
        assert_eq!(
            (r.wr_id, r.status, r.byte_len, r.imm),
            (50, WcStatus::Success, 3000, Some(9))
        );
        let (s, d) = (src.to_vec(), dst.to_vec());
        assert_eq!(
            first_diff(&d[8..8 + BIG], &s[..BIG]),
            None,
            "the Write, crc {crc}"
        );
        assert_eq!(
            first_diff(&rbuf.to_vec()[..3000], &s[100..3100]),
            None,
            "the Send"
        );
        assert_eq!(
            first_diff(&s[BIG..BIG + 4096], &d[8..8 + 4096]),
            None,
            "the Read"
        );
        assert_eq!(s[BIG + 8184..BIG + 8192], 40u64.to_ne_bytes());
        assert_eq!(d[..8], 42u64.to_ne_bytes());
        assert!(a.tx.bytes_sent > BIG as u64 && b.rx.bytes_received > BIG as u64);
        // How much goes straight into place depends on how the bytes
        // arrive; some of a 1 MiB Write always does.
        assert!(b.rx.bytes_placed > 0, "no payload read straight into place");
    }
}

#[test]
fn graceful_close_over_a_socket() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    let src = region(&pa, 4096, 1);
    let rbuf = region(&pb, 4096, 2);
    let (sa, sb) = sockets();
    let mut a = Side::new(config(true), sa);
    let mut b = Side::new(config(true), sb);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    for id in [7, 8] {
        b.conn
            .post_recv(
                &RecvWr {
                    wr_id: id,
                    sgl: &sge(&rbuf, 0, 4096),
                },
                &mut mb,
            )
            .unwrap();
    }
    let s = sge(&src, 0, 2000);
    a.conn
        .post_send(
            &SendWr::new(
                1,
                SendOp::Send {
                    inv: None,
                    imm: None,
                },
                &s,
            ),
            &mut ma,
        )
        .unwrap();
    a.conn.close(0);
    run(&mut a, &mut ma, &mut b, &mut mb, |a, b| {
        a.conn.state() == QpState::Idle && b.conn.state() == QpState::Idle
    });
    assert!(a.fin_sent && b.fin_sent);
    let got: Vec<(u64, WcStatus)> = b.done.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(got, [(7, WcStatus::Success), (8, WcStatus::WrFlush)]);
    assert_eq!(a.done.len(), 1);
}

/// Throughput of the two IO loops over loopback (a figure, not a check):
/// `cargo test --release -p softrdma-engine --lib conn_io::tests::write_bandwidth -- --ignored --nocapture`.
/// A large payload's read is handed out (`RxStep::Direct`) to be done
/// without the connection's lock; a connection reset meanwhile takes none
/// of the bytes read, and receiving stops.
fn direct_read_after(reset: bool) -> (u64, RxStep) {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    // Larger than the first read into the staging buffer (32 KiB): the
    // rest of the payload is read straight into place.
    let src = region(&pa, 48 * 1024, 1);
    let dst = region(&pb, 48 * 1024, 2);
    let (sa, sb) = sockets();
    // One FPDU: its payload's tail after the staging read goes into place.
    let cfg = Config {
        max_payload: 48 * 1024,
        ..Config::new(false)
    };
    let mut a = Side::new(cfg, sa);
    let mut b = Side::new(cfg, sb);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let w = sge(&src, 0, 48 * 1024);
    let wr = SendWr::new(
        1,
        SendOp::Write {
            rkey: dst.rkey(),
            remote_addr: dst.addr(),
            imm: None,
        },
        &w,
    );
    a.conn.post_send(&wr, &mut ma).unwrap();
    let fd_a = a.sock.as_raw_fd();
    let _ = a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX);
    let fd = b.sock.as_raw_fd();
    let deadline = Instant::now() + Duration::from_secs(10);
    b.rx.begin();
    let mut d = loop {
        assert!(Instant::now() < deadline, "no direct read");
        match b.rx.step(&mut b.conn, &mut mb, fd, &|| 1) {
            RxStep::Direct(d) => break d,
            RxStep::Stop(RxStop::Drained) => {
                b.rx.begin();
                std::thread::yield_now();
            }
            RxStep::Stop(s) => panic!("stopped: {s:?}"),
        }
    };
    if reset {
        b.conn.handle_reset();
    }
    let r = loop {
        match d.read(fd) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            r => break r,
        }
    };
    assert!(*r.as_ref().unwrap() > 0);
    let stop = b.rx.placed(&mut b.conn, &mut mb, d, r, &|| 1);
    let next = match stop {
        Some(s) => RxStep::Stop(s),
        None => b.rx.step(&mut b.conn, &mut mb, fd, &|| 1),
    };
    (b.rx.bytes_placed, next)
}

#[test]
fn direct_read_places_the_payload() {
    let (placed, _) = direct_read_after(false);
    assert!(placed > 0, "nothing placed");
}

#[test]
fn direct_read_after_a_reset_places_nothing_and_stops() {
    let (placed, next) = direct_read_after(true);
    assert_eq!(placed, 0);
    assert!(matches!(next, RxStep::Stop(RxStop::Done)), "{next:?}");
}

#[test]
#[ignore = "prints a throughput figure"]
fn write_bandwidth() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const MIB: usize = 1 << 20;
    let src = region(&pa, MIB, 1);
    let dst = region(&pb, MIB, 2);
    let (sa, sb) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut b = Side::new(config(false), sb);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let w = sge(&src, 0, MIB as u32);
    let rounds = 512u64;
    let t = Instant::now();
    for i in 0..rounds {
        let mut wr = SendWr::new(
            i,
            SendOp::Write {
                rkey: dst.rkey(),
                remote_addr: dst.addr(),
                imm: None,
            },
            &w,
        );
        wr.signaled = i % 16 == 15;
        while a.conn.post_send(&wr, &mut ma).is_err() {
            a.turn(&mut ma, 1);
            b.turn(&mut mb, 1);
        }
    }
    run(&mut a, &mut ma, &mut b, &mut mb, |a, b| {
        a.done.len() == (rounds / 16) as usize && b.rx.bytes_received >= rounds * MIB as u64
    });
    let secs = t.elapsed().as_secs_f64();
    eprintln!(
        "RDMA Write 1 MiB x {rounds}, one thread for both sides: {:.0} MB/s",
        (rounds * MIB as u64) as f64 / secs / 1e6
    );
}

/// The transmitter stops as soon as a request is written completely, so
/// that its completion is delivered before the requests queued behind it
/// are written (it used to write on until the socket was full or 256 KiB
/// more were written: a poster waiting for that completion to reuse its
/// buffer waited for the whole queue).
#[test]
fn transmit_stops_when_a_request_completes() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const BIG: usize = 16 << 20;
    let src = region(&pa, BIG, 1);
    let dst = region(&pb, BIG, 2);
    let (sa, _sb) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let small = sge(&src, 0, 4096);
    let big = sge(&src, 0, BIG as u32);
    for (id, sgl) in [(1, &small), (2, &big)] {
        let mut wr = SendWr::new(
            id,
            SendOp::Write {
                rkey: dst.rkey(),
                remote_addr: dst.addr(),
                imm: None,
            },
            sgl,
        );
        wr.signaled = true;
        a.conn.post_send(&wr, &mut ma).unwrap();
    }
    let fd = a.sock.as_raw_fd();
    let stop = a.tx.progress(&mut a.conn, &mut ma, fd, usize::MAX);
    assert!(matches!(stop, TxStop::Completed), "{stop:?}");
    let c = a.conn.poll_completion().expect("the first Write completed");
    assert_eq!((c.wr_id, c.status), (1, WcStatus::Success));
    assert!(a.tx.pending() > 0, "the second Write is not written yet");
    assert!(a.tx.bytes_sent < BIG as u64);
}

/// The FPDU size follows the socket's MSS while a connection runs: both
/// sides start with 1000-byte payloads, far below what the loopback MSS
/// allows, and change size within the first 4 MiB Write and within the
/// 4 MiB Read Response; every byte arrives in place and each request
/// completes once.
#[test]
fn fpdu_size_follows_the_mss_mid_message() {
    for crc in [false, true] {
        let dev = device();
        let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
        const BIG: usize = 4 << 20;
        let src = region(&pa, 2 * BIG, 1);
        let dst = region(&pb, BIG, 2);
        let (sa, sb) = sockets();
        let cfg = Config {
            max_payload: 1000,
            ..Config::new(crc)
        };
        let mut a = Side::new(cfg, sa);
        let mut b = Side::new(cfg, sb);
        // Off by default (SOFTRDMA_FPDU_FOLLOW_MSS=1 turns it on).
        a.tx = TxIo::new().following_mss(true);
        b.tx = TxIo::new().following_mss(true);
        let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
        let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
        let w = sge(&src, 0, BIG as u32);
        let sink = sge(&src, BIG as u64, BIG as u32);
        let mut write = SendWr::new(
            1,
            SendOp::Write {
                rkey: dst.rkey(),
                remote_addr: dst.addr(),
                imm: None,
            },
            &w,
        );
        write.signaled = true;
        let mut read = SendWr::new(
            2,
            SendOp::Read {
                rkey: dst.rkey(),
                remote_addr: dst.addr(),
            },
            &sink,
        );
        read.signaled = true;
        a.conn.post_send(&write, &mut ma).unwrap();
        a.conn.post_send(&read, &mut ma).unwrap();
        run(&mut a, &mut ma, &mut b, &mut mb, |a, _| a.done.len() >= 2);
        // Nothing more completes.
        for _ in 0..50 {
            a.turn(&mut ma, 1_000);
            b.turn(&mut mb, 1_000);
        }
        let ids: Vec<_> = a
            .done
            .iter()
            .map(|c| (c.wr_id, c.status, c.byte_len))
            .collect();
        let n = BIG as u32;
        assert_eq!(
            ids,
            [(1, WcStatus::Success, n), (2, WcStatus::Success, n)],
            "crc {crc}"
        );
        assert!(b.done.is_empty(), "{:?}", b.done);
        let (s, d) = (src.to_vec(), dst.to_vec());
        assert_eq!(first_diff(&d, &s[..BIG]), None, "the Write, crc {crc}");
        assert_eq!(first_diff(&s[BIG..], &d), None, "the Read, crc {crc}");
        for (who, side) in [("writer", &a), ("responder", &b)] {
            let mss = crate::sys::io::tcp_maxseg(side.sock.as_raw_fd()).unwrap();
            assert!(side.tx.mss_changes >= 1, "{who}: FPDU size never changed");
            assert!(
                side.conn.config().max_payload > 1000,
                "{who}: {} for MSS {mss}",
                side.conn.config().max_payload
            );
        }
    }
}

#[test]
fn max_payload_for_mss_keeps_one_fpdu_per_segment() {
    for mss in [536, 1448, 1460, 9000, 32_741, 65_483, 65_495, 1 << 20] {
        let p = max_payload_for_mss(mss);
        assert_eq!(p % 4, 0);
        assert!(p <= softrdma_proto::conn::MAX_PAYLOAD);
        let fpdu = softrdma_wire::fpdu::fpdu_len(p + softrdma_wire::ddp::UNTAGGED_HEADER_LEN);
        assert!(fpdu <= mss || mss > 65_535, "MSS {mss}: FPDU of {fpdu}");
    }
    assert_eq!(max_payload_for_mss(0), 64);
}

/// Regression: a Write whose last FPDU is short (the 808-byte tail of a
/// 1 MiB Write in 32 744-byte FPDUs) switched the reader to reading the
/// whole staging buffer, and the large FPDUs of the next Writes were then
/// copied through it, each 32 KiB read ending a few bytes further into
/// the next FPDU's payload, for a whole message or more. A short payload
/// after a direct read of a large one is now read into place too; only
/// the first read (before any large payload is known) and the read-ahead
/// after each direct read go through the staging buffer.
#[test]
fn writes_after_a_short_last_fpdu_are_placed_not_copied() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    // Not a divisor of the 32 KiB first read: the reader is in its
    // large-payload mode from the second read on.
    const FPDU: usize = 20_000;
    const FIRST: usize = 3 * FPDU + 600;
    const NEXT: usize = 3 * FPDU;
    const AT: usize = 256 * 1024;
    let src = region(&pa, AT + NEXT, 1);
    let dst = region(&pb, AT + NEXT, 2);
    let (sa, sb) = sockets();
    let cfg = Config {
        max_payload: FPDU,
        ..Config::new(false)
    };
    let mut a = Side::new(cfg, sa);
    let mut b = Side::new(cfg, sb);
    // Direct reads only (a reader that is behind would read in batches).
    b.rx.batch = false;
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let first = sge(&src, 0, FIRST as u32);
    let next = sge(&src, AT as u64, NEXT as u32);
    for (id, sgl, at) in [(1, &first, 0), (2, &next, AT), (3, &next, AT)] {
        let mut wr = SendWr::new(
            id,
            SendOp::Write {
                rkey: dst.rkey(),
                remote_addr: dst.addr() + at as u64,
                imm: None,
            },
            sgl,
        );
        wr.signaled = true;
        a.conn.post_send(&wr, &mut ma).unwrap();
    }
    // Everything written before the reader starts.
    let fd_a = a.sock.as_raw_fd();
    while !matches!(
        a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX),
        TxStop::WouldBlock | TxStop::Idle
    ) {}
    run(&mut a, &mut ma, &mut b, &mut mb, |a, b| {
        a.done.len() >= 3 && b.rx.bytes_received >= (FIRST + 2 * NEXT) as u64
    });
    let (s, d) = (src.to_vec(), dst.to_vec());
    assert_eq!(first_diff(&d[..FIRST], &s[..FIRST]), None);
    assert_eq!(first_diff(&d[AT..], &s[AT..]), None);
    let payload = (FIRST + 2 * NEXT) as u64;
    let copied = payload - b.rx.bytes_placed;
    // The first staging read (at most 32 KiB) and up to 256 bytes of
    // read-ahead per FPDU (10 FPDUs).
    assert!(
        copied <= (STAGING + 10 * READAHEAD_LARGE) as u64,
        "{copied} of {payload} payload bytes copied through the staging buffer"
    );
}

/// Sends of a few hundred bytes queued behind each other are read many
/// per read through the staging buffer, not one `readv` each (a short
/// payload after a full direct read of a short one is not read into
/// place).
#[test]
fn small_sends_queued_up_are_read_many_per_read() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const MSG: usize = 512;
    const N: usize = 120;
    let src = region(&pa, MSG, 1);
    let dst = region(&pb, MSG * N, 2);
    let (sa, sb) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut b = Side::new(config(false), sb);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    for i in 0..N {
        let r = sge(&dst, (i * MSG) as u64, MSG as u32);
        b.conn
            .post_recv(
                &RecvWr {
                    wr_id: i as u64,
                    sgl: &r,
                },
                &mut mb,
            )
            .unwrap();
    }
    let s = sge(&src, 0, MSG as u32);
    for i in 0..N {
        a.conn
            .post_send(
                &SendWr::new(
                    i as u64,
                    SendOp::Send {
                        inv: None,
                        imm: None,
                    },
                    &s,
                ),
                &mut ma,
            )
            .unwrap();
    }
    let fd_a = a.sock.as_raw_fd();
    while !matches!(
        a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX),
        TxStop::WouldBlock | TxStop::Idle
    ) {}
    run(&mut a, &mut ma, &mut b, &mut mb, |_, b| b.done.len() >= N);
    assert!(b.done.iter().all(|c| c.status == WcStatus::Success));
    assert!(
        b.rx.reads < (N / 10) as u64,
        "{} reads for {N} Sends of {MSG} bytes",
        b.rx.reads
    );
}

/// A reader that is behind (the socket full of large FPDUs) reads it in
/// batches: far fewer reads than FPDUs, every byte in place, each Write
/// complete once, with and without the CRC. With batching off the same
/// backlog takes about one read per FPDU.
#[test]
fn a_reader_that_is_behind_reads_in_batches() {
    for (batch, crc) in [(true, false), (true, true), (false, false)] {
        let dev = device();
        let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
        const MIB: usize = 1 << 20;
        const WRITES: usize = 4;
        let src = region(&pa, WRITES * MIB, 1);
        let dst = region(&pb, WRITES * MIB, 2);
        let (sa, sb) = sockets();
        // Room for the backlog (the kernel caps these at
        // `net.core.wmem_max` / `rmem_max`): with the autotuned sizes the
        // reader sometimes caught up with the writer, whose CRC is slow in
        // a debug build, and its batches came back short (219 reads).
        socket2::SockRef::from(&sa)
            .set_send_buffer_size(WRITES * MIB)
            .unwrap();
        socket2::SockRef::from(&sb)
            .set_recv_buffer_size(WRITES * MIB)
            .unwrap();
        let mut a = Side::new(config(crc), sa);
        let mut b = Side::new(config(crc), sb);
        b.rx.batch = batch;
        let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
        let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
        for i in 0..WRITES {
            let w = sge(&src, (i * MIB) as u64, MIB as u32);
            let mut wr = SendWr::new(
                i as u64,
                SendOp::Write {
                    rkey: dst.rkey(),
                    remote_addr: dst.addr() + (i * MIB) as u64,
                    imm: None,
                },
                &w,
            );
            wr.signaled = true;
            a.conn.post_send(&wr, &mut ma).unwrap();
        }
        // The writer fills the socket before the reader reads.
        let fd_a = a.sock.as_raw_fd();
        while !matches!(
            a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX),
            TxStop::WouldBlock | TxStop::Idle
        ) {}
        run(&mut a, &mut ma, &mut b, &mut mb, |a, b| {
            a.done.len() >= WRITES && b.rx.bytes_received >= (WRITES * MIB) as u64
        });
        let (s, d) = (src.to_vec(), dst.to_vec());
        assert_eq!(first_diff(&d, &s), None, "batch {batch}, crc {crc}");
        let ids: Vec<_> = a.done.iter().map(|c| (c.wr_id, c.status)).collect();
        let want: Vec<_> = (0..WRITES as u64).map(|i| (i, WcStatus::Success)).collect();
        assert_eq!(ids, want, "batch {batch}, crc {crc}");
        let fpdus = (WRITES * MIB / (16 * 1024)) as u64;
        eprintln!(
            "batch {batch}, crc {crc}: {} reads, {} batches, {fpdus} FPDUs",
            b.rx.reads, b.rx.batches
        );
        if batch {
            assert!(b.rx.batches > 0, "no batch");
            assert!(
                b.rx.reads < fpdus / 2,
                "{} reads for {fpdus} FPDUs ({} batches)",
                b.rx.reads,
                b.rx.batches
            );
        } else {
            assert_eq!(b.rx.batches, 0);
            // About one read per FPDU (the first read, into the staging
            // buffer, holds two).
            assert!(
                b.rx.reads >= fpdus * 3 / 4,
                "{} reads for {fpdus} FPDUs without batches",
                b.rx.reads
            );
        }
    }
}

/// A batch is read without the connection's lock like a direct read; a
/// reset meanwhile makes the connection take none of its bytes, and
/// receiving stops.
#[test]
fn a_batch_read_after_a_reset_takes_nothing_and_stops() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const MIB: usize = 1 << 20;
    let src = region(&pa, MIB, 1);
    let dst = region(&pb, MIB, 2);
    let (sa, sb) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut b = Side::new(config(false), sb);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let w = sge(&src, 0, MIB as u32);
    let wr = SendWr::new(
        1,
        SendOp::Write {
            rkey: dst.rkey(),
            remote_addr: dst.addr(),
            imm: None,
        },
        &w,
    );
    a.conn.post_send(&wr, &mut ma).unwrap();
    let (fd_a, fd) = (a.sock.as_raw_fd(), b.sock.as_raw_fd());
    let deadline = Instant::now() + Duration::from_secs(10);
    b.rx.begin();
    // Direct reads (each into place) until the reader is behind and the
    // next read is a batch.
    let mut d = loop {
        assert!(Instant::now() < deadline, "no batch");
        let _ = a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX);
        match b.rx.step(&mut b.conn, &mut mb, fd, &|| 1) {
            RxStep::Direct(d) if d.dst.is_none() => break d,
            RxStep::Direct(mut d) => {
                let r = d.read(fd);
                if let Some(s) = b.rx.placed(&mut b.conn, &mut mb, d, r, &|| 1) {
                    assert!(matches!(s, RxStop::Drained), "{s:?}");
                    b.rx.begin();
                }
            }
            RxStep::Stop(RxStop::Drained) => {
                b.rx.begin();
                std::thread::yield_now();
            }
            RxStep::Stop(s) => panic!("stopped: {s:?}"),
        }
    };
    let placed = b.rx.bytes_placed;
    b.conn.handle_reset();
    let r = loop {
        let _ = a.tx.progress(&mut a.conn, &mut ma, fd_a, usize::MAX);
        match d.read(fd) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::yield_now(),
            r => break r,
        }
    };
    assert!(*r.as_ref().unwrap() > 0);
    let stop = b.rx.placed(&mut b.conn, &mut mb, d, r, &|| 1);
    let next = match stop {
        Some(s) => RxStep::Stop(s),
        None => b.rx.step(&mut b.conn, &mut mb, fd, &|| 1),
    };
    assert!(matches!(next, RxStep::Stop(RxStop::Done)), "{next:?}");
    assert_eq!(b.rx.bytes_placed, placed);
    assert_eq!(b.rx.batches, 1);
}

/// The stream `a` writes for what was posted on it, read back from a
/// socket pair of its own.
fn wire_of(
    a: &mut Side,
    ma: &mut PdMemory<'_>,
    capture: &mut TcpStream,
    requests: usize,
) -> Vec<u8> {
    use std::io::Read;
    let fd_a = a.sock.as_raw_fd();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut wire = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        assert!(Instant::now() < deadline, "writer stuck");
        let stop = a.tx.progress(&mut a.conn, ma, fd_a, usize::MAX);
        a.done
            .extend(std::iter::from_fn(|| a.conn.poll_completion()));
        loop {
            match capture.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => wire.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        if matches!(stop, TxStop::Idle) && a.done.len() >= requests {
            // Written and read back.
            if a.tx.bytes_sent == wire.len() as u64 {
                return wire;
            }
        }
    }
}

/// A batch that comes back short (the socket drained) ends where a TCP
/// segment ended, which is more often than not a few hundred bytes before
/// the end of an FPDU. That short rest of a payload used to be read
/// through the 32 KiB staging buffer in the small-message mode, and with
/// FPDUs of 32 764 bytes (the loopback size) each of those reads ended 4
/// bytes further into the next FPDU, leaving again less than 1 KiB of its
/// payload: a chain of staging reads that copied the rest of an 8 MiB
/// Write through the buffer (a third of all bytes in `softrdma perf write
/// -s 8M`). The stream of a 3 MiB Write is fed to the reader in pieces
/// that each end 400 bytes before an FPDU's end, the reader draining the
/// socket after each: only batches and the first read copy payload.
#[test]
fn a_short_batch_does_not_start_a_chain_of_staging_reads() {
    use std::io::Write as _;
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const LEN: usize = 3 << 20;
    // FPDUs of 32 764 bytes on the wire: 2 (length) + 14 (tagged header)
    // + 32 744 + 4 (CRC field).
    const PAYLOAD: usize = 32_744;
    const FPDU: usize = PAYLOAD + 20;
    // Pieces of seven FPDUs, each ending 400 bytes before an FPDU's end:
    // four direct reads, then a batch that comes back short there.
    const PIECE: usize = 7 * FPDU;
    const SHORT: usize = 400;
    let src = region(&pa, LEN, 1);
    let dst = region(&pb, LEN, 2);
    let cfg = Config {
        max_payload: PAYLOAD,
        ..Config::new(false)
    };
    let (sa, mut sc) = sockets();
    let mut a = Side::new(cfg, sa);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let w = sge(&src, 0, LEN as u32);
    let mut wr = SendWr::new(
        1,
        SendOp::Write {
            rkey: dst.rkey(),
            remote_addr: dst.addr(),
            imm: None,
        },
        &w,
    );
    wr.signaled = true;
    a.conn.post_send(&wr, &mut ma).unwrap();
    let wire = wire_of(&mut a, &mut ma, &mut sc, 1);
    assert_eq!(a.done.len(), 1);
    // Feed the reader piece by piece.
    let (mut sd, sb) = sockets();
    for (s, rcv) in [(&sd, false), (&sb, true)] {
        let r = socket2::SockRef::from(s);
        if rcv {
            r.set_recv_buffer_size(1 << 20).unwrap();
        } else {
            r.set_send_buffer_size(1 << 20).unwrap();
        }
    }
    let mut b = Side::new(cfg, sb);
    assert!(b.rx.batch, "batching on (SOFTRDMA_RX_BATCH=0 set?)");
    let fd = b.sock.as_raw_fd();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut fed = 0u64;
    let mut ends: Vec<usize> = (1..)
        .map(|k| k * PIECE - SHORT)
        .take_while(|&e| e < wire.len())
        .collect();
    ends.push(wire.len());
    let mut start = 0;
    for end in ends {
        let piece = &wire[start..end];
        start = end;
        let mut at = 0;
        while at < piece.len() {
            assert!(Instant::now() < deadline, "feeding stuck");
            match sd.write(&piece[at..]) {
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let _ = b.rx.run(&mut b.conn, &mut mb, fd, &|| 1);
                }
                Err(e) => panic!("{e}"),
            }
        }
        fed += piece.len() as u64;
        // Until the reader has read it all (and found the socket empty).
        while b.rx.bytes_received < fed {
            assert!(Instant::now() < deadline, "reader stuck");
            if let RxStop::Drained = b.rx.run(&mut b.conn, &mut mb, fd, &|| 1) {
                std::thread::yield_now();
            }
        }
    }
    assert_eq!(b.rx.bytes_received, wire.len() as u64);
    let (s, d) = (src.to_vec(), dst.to_vec());
    assert_eq!(first_diff(&d, &s), None);
    assert!(b.rx.batches > 0, "no batch");
    // Bytes read through the staging buffer outside batches: the reads
    // at the connection's start (in its small-message mode, four 32 KiB
    // reads each ending 4 bytes further into the next FPDU's header) and
    // up to 256 bytes of read-ahead per FPDU (145 KB here). Without the
    // rule above: 2.8 of the 3.1 MB, in one batch and 95 other reads.
    let fpdus = LEN.div_ceil(PAYLOAD);
    let staged = b.rx.bytes_received - b.rx.bytes_placed - b.rx.bytes_batched;
    eprintln!(
        "{} reads, {} batches, {} bytes batched, {staged} staged, {fpdus} FPDUs",
        b.rx.reads, b.rx.batches, b.rx.bytes_batched
    );
    assert!(
        staged <= (4 * STAGING + fpdus * READAHEAD_LARGE) as u64,
        "{staged} of {} bytes read through the staging buffer outside batches",
        wire.len()
    );
    // Reads: the first staging reads, then per piece four direct reads
    // and a batch that comes back short, after which the rest of the FPDU
    // it ended in waits for the next piece (the socket is drained: no
    // read to find `EAGAIN`). Without that stop, one read more per piece
    // (85 here instead of 73).
    let pieces = wire.len().div_ceil(PIECE) as u64;
    assert!(
        b.rx.reads <= 4 + 5 * pieces,
        "{} reads for {pieces} pieces",
        b.rx.reads
    );
}

/// A read through the staging buffer that came back short said the
/// socket was drained, and still did after a direct read that came back
/// full (the socket held more): the short tail of a large Write after
/// that read was taken as "the socket is empty" and left unread until the
/// next wake-up. Here the reader's first read gets the start of a Write
/// (short), the rest arrives before its direct read of the first FPDU's
/// payload, and the whole Write must be read in the same run.
#[test]
fn a_short_read_before_a_full_direct_read_does_not_stop_the_run() {
    use std::io::Write as _;
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const PAYLOAD: usize = 16 * 1024;
    // Two FPDUs: a full one and a last one of 500 bytes (less than
    // `DIRECT_MIN`; what is left of it after the read-ahead too).
    const LEN: usize = PAYLOAD + 500;
    let src = region(&pa, LEN, 1);
    let dst = region(&pb, LEN, 2);
    let (sa, mut sc) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    let w = sge(&src, 0, LEN as u32);
    let wr = SendWr::new(
        1,
        SendOp::Write {
            rkey: dst.rkey(),
            remote_addr: dst.addr(),
            imm: None,
        },
        &w,
    );
    a.conn.post_send(&wr, &mut ma).unwrap();
    let wire = wire_of(&mut a, &mut ma, &mut sc, 0);
    assert!(wire.len() > LEN, "{} bytes", wire.len());
    let (mut sd, sb) = sockets();
    let mut b = Side::new(config(false), sb);
    let fd = b.sock.as_raw_fd();
    // The start of the first FPDU: read through the staging buffer,
    // short.
    const FIRST: usize = 1000;
    sd.write_all(&wire[..FIRST]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut rest = Some(&wire[FIRST..]);
    b.rx.begin();
    let stop = loop {
        assert!(Instant::now() < deadline, "reader stuck");
        match b.rx.step(&mut b.conn, &mut mb, fd, &|| 1) {
            RxStep::Stop(RxStop::Drained) if b.rx.bytes_received < FIRST as u64 => {
                // The first bytes are not there yet.
                b.rx.begin();
                std::thread::yield_now();
            }
            RxStep::Stop(stop) => break stop,
            RxStep::Direct(mut d) => {
                if let Some(rest) = rest.take() {
                    // The rest arrives before the direct read.
                    assert!(b.rx.drained_hint, "the first read was not short");
                    sd.write_all(rest).unwrap();
                    let mut peek = vec![0u8; 2 * rest.len()];
                    while b.sock.peek(&mut peek).unwrap_or(0) < rest.len() {
                        assert!(Instant::now() < deadline, "rest not arriving");
                        std::thread::yield_now();
                    }
                }
                let r = d.read(fd);
                if let Some(stop) = b.rx.placed(&mut b.conn, &mut mb, d, r, &|| 1) {
                    break stop;
                }
            }
        }
    };
    assert!(rest.is_none(), "no direct read");
    assert_eq!(
        b.rx.bytes_received,
        wire.len() as u64,
        "stopped ({stop:?}) before the end of the Write"
    );
    assert_eq!(first_diff(&dst.to_vec(), &src.to_vec()), None);
}

/// Queues `writes` Writes of `len` bytes each from `src` at `at` to `dst`
/// at `at` (wr_id `first` on) and lets `a` write what fits.
#[allow(clippy::too_many_arguments)]
fn queue_writes(
    a: &mut Side,
    ma: &mut PdMemory<'_>,
    src: &MemoryRegion,
    dst: &MemoryRegion,
    at: usize,
    len: usize,
    writes: usize,
    first: u64,
) {
    for i in 0..writes {
        let off = at + i * len;
        let w = sge(src, off as u64, len as u32);
        let mut wr = SendWr::new(
            first + i as u64,
            SendOp::Write {
                rkey: dst.rkey(),
                remote_addr: dst.addr() + off as u64,
                imm: None,
            },
            &w,
        );
        wr.signaled = true;
        a.conn.post_send(&wr, ma).unwrap();
    }
    let fd_a = a.sock.as_raw_fd();
    while !matches!(
        a.tx.progress(&mut a.conn, ma, fd_a, usize::MAX),
        TxStop::WouldBlock | TxStop::Idle
    ) {}
}

/// The staging buffer grows to 256 KiB for batches; once the reader has
/// gone back to reads into place for 1024 reads it shrinks to 32 KiB
/// again (it used to be kept for the connection's life), and grows again
/// when the reader falls behind again.
#[test]
fn the_batch_buffer_is_given_back_after_reads_without_batches() {
    let dev = device();
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    const MIB: usize = 1 << 20;
    const SMALL: usize = 4096;
    let src = region(&pa, 4 * MIB, 1);
    let dst = region(&pb, 4 * MIB, 2);
    let (sa, sb) = sockets();
    let mut a = Side::new(config(false), sa);
    let mut b = Side::new(config(false), sb);
    assert!(b.rx.batch, "batching on (SOFTRDMA_RX_BATCH=0 set?)");
    let mut ma = PdMemory::new(dev.stags(), pa.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pb.id(), None);
    assert!(
        b.rx.buf.len() <= STAGING,
        "no more than a staging buffer before any batch"
    );
    // A backlog of 2 MiB: the reader batches.
    queue_writes(&mut a, &mut ma, &src, &dst, 0, MIB, 2, 0);
    run(&mut a, &mut ma, &mut b, &mut mb, |a, _| a.done.len() >= 2);
    assert!(b.rx.batches > 0, "no batch");
    assert_eq!(b.rx.buf.len(), BATCH);
    // Writes of 4 KiB one at a time: reads into place and read-aheads.
    let mut n = 2;
    let mut kept_until = 0;
    while b.rx.buf.len() > STAGING {
        assert!(n < 2 + 2 * BATCH_RELEASE_READS, "never given back");
        kept_until = b.rx.reads - b.rx.batch_reads;
        let at = 2 * MIB + (n as usize % 256) * SMALL;
        queue_writes(&mut a, &mut ma, &src, &dst, at, SMALL, 1, n);
        n += 1;
        run(&mut a, &mut ma, &mut b, &mut mb, |a, _| {
            a.done.len() as u64 >= n
        });
    }
    let batches = b.rx.batches;
    assert!(
        (BATCH_RELEASE_READS - 8..=BATCH_RELEASE_READS + 8).contains(&kept_until),
        "given back after {kept_until} reads"
    );
    assert_eq!(batches, b.rx.batches, "batched meanwhile");
    assert!(b.rx.buf.capacity() < BATCH, "{}", b.rx.buf.capacity());
    // Behind again: batches in a buffer grown again, every byte in place.
    queue_writes(&mut a, &mut ma, &src, &dst, 0, MIB, 2, n);
    run(&mut a, &mut ma, &mut b, &mut mb, |a, _| {
        a.done.len() as u64 >= n + 2
    });
    assert!(
        b.rx.batches > batches,
        "no batch after the buffer was given back"
    );
    assert_eq!(b.rx.buf.len(), BATCH);
    assert!(a.done.iter().all(|c| c.status == WcStatus::Success));
    let (s, d) = (src.to_vec(), dst.to_vec());
    assert_eq!(first_diff(&d[..2 * MIB], &s[..2 * MIB]), None);
    assert_eq!(first_diff(&d[2 * MIB..3 * MIB], &s[2 * MIB..3 * MIB]), None);
}
