//! Faults of the byte stream between two QPs: a relay (two loopback TCP
//! connections and a thread per direction copying bytes) sits between them
//! and re-segments, stalls, corrupts or cuts the stream. Send, Write and Read
//! data is verified byte for byte, with MPA CRC on and off.
//!
//! The relay forwards up to a byte limit per direction; the tests move the
//! limit and wait for the receiving QP's `bytes_received` to reach it, so the
//! receiver provably sees the stream cut at each chosen point. No test
//! relies on timing for correctness: sleeps only make a stall last, and
//! deadlines only turn a hang into a failure.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::connect::{mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::wire::errcode::TermError;
use softrdma_engine::{
    AsyncEvent, AsyncEventKind, Device, LinkParams, MemoryRegion, QpState, QueuePair, RecvWr,
    SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const TIMEOUT: Duration = Duration::from_secs(10);

/// Direction through the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    /// From QP `a` (initiator) to QP `b`.
    AtoB = 0,
    /// From QP `b` to QP `a`.
    BtoA = 1,
}

const DIRS: [Dir; 2] = [Dir::AtoB, Dir::BtoA];

#[derive(Debug)]
struct DirState {
    /// Bytes forwarded (or being written) so far, MPA exchange included.
    fwd: u64,
    /// Forward no byte at or beyond this offset until the limit moves.
    limit: u64,
    /// The pump holds bytes it may not forward yet.
    pending: bool,
    /// Flip `mask` in the byte at this stream offset (once).
    flip: Option<(u64, u8)>,
    /// Sizes of successive writes (cycled); `None`: as read.
    chunks: Option<Vec<usize>>,
    /// Copy of the forwarded bytes, if recording.
    log: Option<Vec<u8>>,
}

#[derive(Debug)]
struct Shared {
    st: Mutex<[DirState; 2]>,
    cv: Condvar,
    dead: AtomicBool,
}

/// A byte relay with fault injection.
struct Relay {
    sh: Arc<Shared>,
    /// The relay's ends: towards `a` and towards `b`.
    socks: [TcpStream; 2],
    threads: Vec<JoinHandle<()>>,
}

impl Relay {
    fn start(to_a: TcpStream, to_b: TcpStream) -> Relay {
        to_a.set_nodelay(true).unwrap();
        to_b.set_nodelay(true).unwrap();
        let fresh = || DirState {
            fwd: 0,
            limit: u64::MAX,
            pending: false,
            flip: None,
            chunks: None,
            log: None,
        };
        let sh = Arc::new(Shared {
            st: Mutex::new([fresh(), fresh()]),
            cv: Condvar::new(),
            dead: AtomicBool::new(false),
        });
        let mut threads = Vec::new();
        for (d, src, dst) in [(Dir::AtoB, &to_a, &to_b), (Dir::BtoA, &to_b, &to_a)] {
            let (src, dst) = (src.try_clone().unwrap(), dst.try_clone().unwrap());
            let sh = sh.clone();
            threads.push(std::thread::spawn(move || pump(&sh, d, src, dst)));
        }
        Relay {
            sh,
            socks: [to_a, to_b],
            threads,
        }
    }

    fn with<R>(&self, d: Dir, f: impl FnOnce(&mut DirState) -> R) -> R {
        let mut g = self.sh.st.lock().unwrap();
        let r = f(&mut g[d as usize]);
        self.sh.cv.notify_all();
        r
    }

    fn forwarded(&self, d: Dir) -> u64 {
        self.with(d, |s| s.fwd)
    }

    /// Forward at most `n` more bytes, then hold.
    fn hold_after(&self, d: Dir, n: u64) {
        self.with(d, |s| s.limit = s.fwd + n);
    }

    /// Forward `n` more bytes than the current limit allows.
    fn allow(&self, d: Dir, n: u64) {
        self.with(d, |s| s.limit += n);
    }

    fn release(&self, d: Dir) {
        self.with(d, |s| s.limit = u64::MAX);
    }

    /// Flip the bits of `mask` in the byte `n` bytes from now.
    fn flip_after(&self, d: Dir, n: u64, mask: u8) {
        self.with(d, |s| s.flip = Some((s.fwd + n, mask)));
    }

    fn set_chunks(&self, d: Dir, chunks: &[usize]) {
        self.with(d, |s| s.chunks = Some(chunks.to_vec()));
    }

    /// Starts recording forwarded bytes.
    fn record(&self, d: Dir) {
        self.with(d, |s| s.log = Some(Vec::new()));
    }

    /// The bytes recorded so far.
    fn recorded(&self, d: Dir) -> Vec<u8> {
        self.with(d, |s| s.log.clone().unwrap_or_default())
    }

    /// Whether the pump holds bytes at the limit.
    fn is_held(&self, d: Dir) -> bool {
        self.with(d, |s| s.pending && s.fwd == s.limit)
    }

    /// Waits until the pump holds bytes at the limit.
    fn wait_held(&self, d: Dir) {
        let deadline = Instant::now() + TIMEOUT;
        let mut g = self.sh.st.lock().unwrap();
        while !(g[d as usize].pending && g[d as usize].fwd == g[d as usize].limit) {
            let left = deadline
                .checked_duration_since(Instant::now())
                .expect("the relay never held bytes at its limit");
            g = self.sh.cv.wait_timeout(g, left).unwrap().0;
        }
    }

    /// Waits until `target` bytes have been forwarded in direction `d`.
    fn wait_forwarded(&self, d: Dir, target: u64) {
        let deadline = Instant::now() + TIMEOUT;
        let mut g = self.sh.st.lock().unwrap();
        while g[d as usize].fwd < target {
            let left = deadline
                .checked_duration_since(Instant::now())
                .expect("the relay never forwarded that far");
            g = self.sh.cv.wait_timeout(g, left).unwrap().0;
        }
    }

    /// Cuts both connections: the QPs see the stream end (or a reset)
    /// wherever it was.
    fn abort(&self) {
        self.sh.dead.store(true, Ordering::Release);
        for s in &self.socks {
            reset(s);
            let _ = s.shutdown(Shutdown::Both);
        }
        let _g = self.sh.st.lock().unwrap();
        self.sh.cv.notify_all();
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.abort();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Resets a TCP connection (RST), as a crashed peer or a middlebox does:
/// `SO_LINGER {1, 0}` then `connect(AF_UNSPEC)`, which disconnects the
/// socket at once even while other descriptors of it are open.
fn reset(s: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = s.as_raw_fd();
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: `linger` is a valid `struct linger` of the size passed, and
    // `fd` is open (borrowed from `s`).
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
    // SAFETY: all-zero is a valid `sockaddr`; AF_UNSPEC dissolves the
    // association; `fd` is open.
    unsafe {
        let mut addr: libc::sockaddr = std::mem::zeroed();
        addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
        libc::connect(
            fd,
            &raw const addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        );
    }
}

/// Copies `src` to `dst` under the rules of direction `d`.
fn pump(sh: &Shared, d: Dir, mut src: TcpStream, mut dst: TcpStream) {
    let i = d as usize;
    let mut buf = vec![0u8; 256 * 1024];
    let mut chunk_idx = 0usize;
    loop {
        let n = match src.read(&mut buf) {
            Ok(0) => {
                if sh.dead.load(Ordering::Acquire) {
                    reset(&dst);
                } else {
                    let _ = dst.shutdown(Shutdown::Write);
                }
                return;
            }
            Ok(n) => n,
            Err(_) => {
                if sh.dead.load(Ordering::Acquire) {
                    reset(&dst);
                }
                let _ = dst.shutdown(Shutdown::Both);
                return;
            }
        };
        let mut pos = 0;
        while pos < n {
            let take = {
                let mut g = sh.st.lock().unwrap();
                loop {
                    if sh.dead.load(Ordering::Acquire) {
                        return;
                    }
                    if g[i].fwd < g[i].limit {
                        break;
                    }
                    g[i].pending = true;
                    sh.cv.notify_all();
                    g = sh.cv.wait(g).unwrap();
                }
                let s = &mut g[i];
                s.pending = false;
                let mut take =
                    (n - pos).min(usize::try_from(s.limit - s.fwd).unwrap_or(usize::MAX));
                if let Some(c) = &s.chunks {
                    take = take.min(c[chunk_idx % c.len()]).max(1);
                    chunk_idx += 1;
                }
                if let Some((at, mask)) = s.flip
                    && at >= s.fwd
                    && at < s.fwd + take as u64
                {
                    buf[pos + (at - s.fwd) as usize] ^= mask;
                    s.flip = None;
                }
                // Counted before the write: a receiver never has more
                // bytes than `fwd` says.
                s.fwd += take as u64;
                if let Some(log) = &mut s.log {
                    log.extend_from_slice(&buf[pos..pos + take]);
                }
                take
            };
            if dst.write_all(&buf[pos..pos + take]).is_err() {
                let _ = src.shutdown(Shutdown::Both);
                return;
            }
            pos += take;
            let _g = sh.st.lock().unwrap();
            sh.cv.notify_all();
        }
    }
}

/// Two QPs connected through a relay.
struct Conn {
    dev: Device,
    a: Side,
    b: Side,
    relay: Relay,
    /// Relay offset of the first byte each receiver counts
    /// (`bytes_received` starts after the MPA exchange).
    off: [u64; 2],
    /// Async events taken from the device so far.
    events: Mutex<Vec<AsyncEvent>>,
}

impl Conn {
    fn new(crc: bool) -> Conn {
        let dev = device(false);
        let a = side(&dev, |_| {});
        let b = side(&dev, |_| {});
        let la = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let lb = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let relay_b = TcpStream::connect(lb.local_addr().unwrap()).unwrap();
        let (mut sb, _) = lb.accept().unwrap();
        let mut sa = TcpStream::connect(la.local_addr().unwrap()).unwrap();
        let (relay_a, _) = la.accept().unwrap();
        let relay = Relay::start(relay_a, relay_b);
        let cfg = |qp: &QueuePair| {
            let q = qp.query();
            MpaConfig {
                crc: if crc {
                    CrcPolicy::Required
                } else {
                    CrcPolicy::AcceptIfAsked
                },
                ird: q.ird,
                ord: q.ord,
                ..MpaConfig::default()
            }
        };
        let bcfg = cfg(&b.qp);
        let acc = std::thread::spawn(move || {
            let n = mpa_accept(&mut sb, &bcfg, &[], TIMEOUT).expect("mpa_accept");
            (sb, n)
        });
        let na = mpa_connect(&mut sa, &cfg(&a.qp), &[], TIMEOUT).expect("mpa_connect");
        let (sb, nb) = acc.join().unwrap();
        assert_eq!(na.crc, crc);
        assert_eq!(nb.crc, crc);
        a.qp.establish(sa, &LinkParams::from(&na)).unwrap();
        b.qp.establish(sb, &LinkParams::from(&nb)).unwrap();
        assert_eq!(a.qp.query().crc, crc);
        let off = [relay.forwarded(Dir::AtoB), relay.forwarded(Dir::BtoA)];
        Conn {
            dev,
            a,
            b,
            relay,
            off,
            events: Mutex::new(Vec::new()),
        }
    }

    /// The QP that receives direction `d`.
    fn receiver(&self, d: Dir) -> &QueuePair {
        match d {
            Dir::AtoB => &self.b.qp,
            Dir::BtoA => &self.a.qp,
        }
    }

    /// Whether the receiver of `d` has read everything the relay forwarded.
    fn caught_up(&self, d: Dir) -> bool {
        let fwd = self.relay.forwarded(d);
        self.receiver(d).query().bytes_received + self.off[d as usize] == fwd
    }

    fn wait_caught_up(&self, d: Dir) {
        let deadline = Instant::now() + TIMEOUT;
        while !self.caught_up(d) {
            assert!(
                Instant::now() < deadline,
                "{d:?}: receiver read {} of {} bytes",
                self.receiver(d).query().bytes_received,
                self.relay.forwarded(d) - self.off[d as usize]
            );
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Waits until both QPs are in ERROR.
    fn wait_both_error(&self) {
        let deadline = Instant::now() + TIMEOUT;
        while self.a.qp.state() != QpState::Error || self.b.qp.state() != QpState::Error {
            assert!(
                Instant::now() < deadline,
                "states {} {}",
                self.a.qp.state(),
                self.b.qp.state()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for an async event of QP `qp_num` matching `pred` (events
    /// seen before count too).
    fn wait_event(&self, qp_num: u32, pred: impl Fn(&AsyncEvent) -> bool) -> AsyncEvent {
        let deadline = Instant::now() + TIMEOUT;
        let mut log = self.events.lock().unwrap();
        loop {
            if let Some(ev) = log.iter().find(|e| e.qp_num == Some(qp_num) && pred(e)) {
                return ev.clone();
            }
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                panic!("no such event for QP {qp_num}; saw {log:?}");
            };
            if let Some(ev) = self.dev.async_events().get(Some(left)) {
                log.push(ev);
            }
        }
    }
}

/// Polls whatever is there.
fn drain(cq: &softrdma_engine::CompletionQueue, out: &mut Vec<WorkCompletion>) {
    while let Some(wc) = cq.poll_one() {
        out.push(wc);
    }
}

/// A Send, a Write and a Read from `a` to `b`, with their buffers.
struct Ops {
    lens: [usize; 3],
    send_src: MemoryRegion,
    write_src: MemoryRegion,
    read_dst: MemoryRegion,
    recv_dst: MemoryRegion,
    write_dst: MemoryRegion,
    read_src: MemoryRegion,
}

const SEND_ID: u64 = 1;
const WRITE_ID: u64 = 2;
const READ_ID: u64 = 3;
const RECV_ID: u64 = 10;

impl Ops {
    fn new(c: &Conn, lens: [usize; 3]) -> Ops {
        Ops {
            lens,
            send_src: mr(&c.a, lens[0]),
            write_src: mr(&c.a, lens[1]),
            read_dst: mr(&c.a, lens[2]),
            recv_dst: mr(&c.b, lens[0]),
            write_dst: mr(&c.b, lens[1]),
            read_src: mr(&c.b, lens[2]),
        }
    }

    /// Fills the sources with patterns of `seed`, clears the sinks, posts
    /// the receive at `b` and the three requests at `a`.
    fn post(&self, c: &Conn, seed: u8) {
        let [ls, lw, lr] = self.lens;
        self.send_src.write(0, &pattern(ls, seed)).unwrap();
        self.write_src
            .write(0, &pattern(lw, seed.wrapping_add(1)))
            .unwrap();
        self.read_src
            .write(0, &pattern(lr, seed.wrapping_add(2)))
            .unwrap();
        for m in [&self.recv_dst, &self.write_dst, &self.read_dst] {
            m.fill(0);
        }
        let rsge = [self.recv_dst.sge(0, ls as u32).unwrap()];
        c.b.qp.post_recv(&RecvWr::new(RECV_ID, &rsge)).unwrap();
        let s = [self.send_src.sge(0, ls as u32).unwrap()];
        let w = [self.write_src.sge(0, lw as u32).unwrap()];
        let r = [self.read_dst.sge(0, lr as u32).unwrap()];
        let wrs = [
            SendWr::new(SEND_ID, SendOp::Send).sg_list(&s).signaled(),
            SendWr::new(
                WRITE_ID,
                SendOp::Write {
                    remote_addr: self.write_dst.addr(),
                    rkey: self.write_dst.rkey(),
                },
            )
            .sg_list(&w)
            .signaled(),
            SendWr::new(
                READ_ID,
                SendOp::Read {
                    remote_addr: self.read_src.addr(),
                    rkey: self.read_src.rkey(),
                },
            )
            .sg_list(&r)
            .signaled(),
        ];
        c.a.qp.post_send_list(&wrs).unwrap();
    }

    /// Checks the completions and every byte.
    fn check(&self, seed: u8, a_wcs: &[WorkCompletion], b_wcs: &[WorkCompletion]) {
        let ids: Vec<(u64, WcOpcode, WcStatus)> = a_wcs
            .iter()
            .map(|w| (w.wr_id, w.opcode, w.status))
            .collect();
        assert_eq!(
            ids,
            [
                (SEND_ID, WcOpcode::Send, WcStatus::Success),
                (WRITE_ID, WcOpcode::RdmaWrite, WcStatus::Success),
                (READ_ID, WcOpcode::RdmaRead, WcStatus::Success),
            ],
            "{a_wcs:?}"
        );
        assert_eq!(b_wcs.len(), 1, "{b_wcs:?}");
        assert_eq!(b_wcs[0].wr_id, RECV_ID);
        assert_eq!(b_wcs[0].status, WcStatus::Success, "{b_wcs:?}");
        assert_eq!(b_wcs[0].byte_len as usize, self.lens[0]);
        let [ls, lw, lr] = self.lens;
        assert!(self.recv_dst.to_vec() == pattern(ls, seed), "Send data");
        assert!(
            self.write_dst.to_vec() == pattern(lw, seed.wrapping_add(1)),
            "Write data"
        );
        assert!(
            self.read_dst.to_vec() == pattern(lr, seed.wrapping_add(2)),
            "Read data"
        );
    }

    /// Waits for the completions (the Write is known placed once the Read
    /// behind it completed) and checks them.
    fn finish(&self, c: &Conn, seed: u8) {
        let a_wcs = wait(&c.a.cq, 3);
        let b_wcs = wait(&c.b.cq, 1);
        self.check(seed, &a_wcs, &b_wcs);
    }
}

// ---------------------------------------------------------------------------
// Re-segmentation
// ---------------------------------------------------------------------------

/// Every byte forwarded alone, and the receiver reads it before the next
/// one is forwarded.
fn one_byte_at_a_time(crc: bool) {
    let c = Conn::new(crc);
    let ops = Ops::new(&c, [1500, 1501, 1502]);
    for d in DIRS {
        c.relay.hold_after(d, 0);
    }
    ops.post(&c, 5);
    let (mut aw, mut bw) = (Vec::new(), Vec::new());
    let deadline = Instant::now() + TIMEOUT;
    let mut steps = 0u64;
    while aw.len() < 3 || bw.is_empty() {
        let mut moved = false;
        for d in DIRS {
            if c.relay.is_held(d) {
                c.relay.allow(d, 1);
                c.wait_caught_up(d);
                steps += 1;
                moved = true;
            }
        }
        drain(&c.a.cq, &mut aw);
        drain(&c.b.cq, &mut bw);
        if !moved {
            assert!(Instant::now() < deadline, "stuck: {aw:?} {bw:?}");
            std::thread::sleep(Duration::from_micros(50));
        }
    }
    assert!(steps > 4500, "{steps} bytes forwarded one by one");
    ops.check(5, &aw, &bw);
    // The connection is still sound.
    for d in DIRS {
        c.relay.release(d);
    }
    ops.post(&c, 6);
    ops.finish(&c, 6);
}

#[test]
fn one_byte_at_a_time_no_crc() {
    one_byte_at_a_time(false);
}

#[test]
fn one_byte_at_a_time_crc() {
    one_byte_at_a_time(true);
}

/// The whole FPDU sequence of a Send, a Write and a Read, cut at every byte
/// offset `k` (the receiver has read exactly the first `k` bytes before it
/// gets the rest), in both directions.
fn split_at_every_point(crc: bool) {
    let c = Conn::new(crc);
    let ops = Ops::new(&c, [13, 29, 37]);
    // Measure the exchange.
    let f0 = [c.relay.forwarded(Dir::AtoB), c.relay.forwarded(Dir::BtoA)];
    for d in DIRS {
        c.relay.record(d);
    }
    ops.post(&c, 0);
    ops.finish(&c, 0);
    for d in DIRS {
        c.wait_caught_up(d);
    }
    // The Read Response carries the Read's data.
    let resp = c.relay.recorded(Dir::BtoA);
    assert_eq!(resp[TAGGED_HDR as usize..][..37], pattern(37, 2)[..]);
    let len = [
        c.relay.forwarded(Dir::AtoB) - f0[0],
        c.relay.forwarded(Dir::BtoA) - f0[1],
    ];
    // MPA length + header + payload + pad + CRC field (present, zero,
    // without CRC): Send 2+18+13+3+4, Write 2+14+29+3+4, Read Request
    // 2+18+28+0+4; Read Response 2+14+37+3+4.
    assert_eq!(len, [40 + 52 + 52, 60]);
    let total = len[0].max(len[1]);
    for k in 1..total {
        let seed = k as u8;
        let ks = [k.min(len[0]), k.min(len[1])];
        for d in DIRS {
            c.relay.hold_after(d, ks[d as usize]);
        }
        let base = [c.relay.forwarded(Dir::AtoB), c.relay.forwarded(Dir::BtoA)];
        ops.post(&c, seed);
        // A to B first: the Read Response only starts once the request
        // is in.
        for d in DIRS {
            c.relay.wait_forwarded(d, base[d as usize] + ks[d as usize]);
            c.wait_caught_up(d);
            // The rest of this direction's exchange.
            c.relay.allow(d, len[d as usize] - ks[d as usize]);
        }
        ops.finish(&c, seed);
        for d in DIRS {
            c.wait_caught_up(d);
        }
    }
}

#[test]
fn split_at_every_point_no_crc() {
    split_at_every_point(false);
}

#[test]
fn split_at_every_point_crc() {
    split_at_every_point(true);
}

/// Large multi-FPDU messages forwarded in odd-sized pieces.
fn odd_pieces(crc: bool) {
    let c = Conn::new(crc);
    let chunks = [1, 2, 3, 5, 7, 11, 13, 17, 4093, 1, 65_521, 6];
    for d in DIRS {
        c.relay.set_chunks(d, &chunks);
    }
    let ops = Ops::new(&c, [1 << 20, (1 << 20) + 3, (1 << 20) - 1]);
    ops.post(&c, 9);
    ops.finish(&c, 9);
    assert!(c.a.qp.query().max_fpdu_payload < 1 << 20, "multi-FPDU");
}

#[test]
fn odd_pieces_no_crc() {
    odd_pieces(false);
}

#[test]
fn odd_pieces_crc() {
    odd_pieces(true);
}

// ---------------------------------------------------------------------------
// Stall
// ---------------------------------------------------------------------------

/// The stream stops in the middle of an FPDU for a while, in each
/// direction; nothing completes early and everything arrives intact.
fn stall(crc: bool) {
    let c = Conn::new(crc);
    let ops = Ops::new(&c, [300_000, 300_001, 300_002]);
    // 70 000 bytes in: inside the second FPDU of the Send.
    c.relay.hold_after(Dir::AtoB, 70_000);
    c.relay.hold_after(Dir::BtoA, 100_000);
    ops.post(&c, 21);
    c.relay.wait_held(Dir::AtoB);
    c.wait_caught_up(Dir::AtoB);
    std::thread::sleep(Duration::from_millis(20));
    assert!(c.b.cq.poll_one().is_none(), "the Send is not complete yet");
    c.relay.release(Dir::AtoB);
    c.relay.wait_held(Dir::BtoA);
    c.wait_caught_up(Dir::BtoA);
    std::thread::sleep(Duration::from_millis(20));
    let mut aw = Vec::new();
    drain(&c.a.cq, &mut aw);
    assert!(
        aw.iter().all(|w| w.opcode != WcOpcode::RdmaRead),
        "the Read is not complete yet: {aw:?}"
    );
    c.relay.release(Dir::BtoA);
    aw.extend(wait(&c.a.cq, 3 - aw.len()));
    let bw = wait(&c.b.cq, 1);
    ops.check(21, &aw, &bw);
}

#[test]
fn stall_mid_fpdu_no_crc() {
    stall(false);
}

#[test]
fn stall_mid_fpdu_crc() {
    stall(true);
}

// ---------------------------------------------------------------------------
// Corruption
// ---------------------------------------------------------------------------

/// Bytes before the payload in the FPDU carrying a Send (MPA length + DDP
/// untagged header + RDMAP), RFC 5041 section 4.
const UNTAGGED_HDR: u64 = 2 + 18;
/// The same for a Write or Read Response (DDP tagged header).
const TAGGED_HDR: u64 = 2 + 14;
/// Payload byte that gets a bit flipped.
const FLIP_AT: usize = 100;
const FLIP_MASK: u8 = 0x10;

#[derive(Debug, Clone, Copy)]
enum Op {
    Send,
    Write,
    Read,
}

/// Sets up `op` of 4096 bytes with one payload bit flipped on the wire.
/// Returns the connection, the source and sink regions and the expected
/// data.
fn flipped(crc: bool, op: Op) -> (Conn, MemoryRegion, MemoryRegion, Vec<u8>) {
    const LEN: usize = 4096;
    let c = Conn::new(crc);
    let data = pattern(LEN, 77);
    let src_side = if matches!(op, Op::Read) { &c.b } else { &c.a };
    let sink_side = if matches!(op, Op::Read) { &c.a } else { &c.b };
    let src = mr(src_side, LEN);
    src.write(0, &data).unwrap();
    let sink = mr(sink_side, LEN);
    let (d, hdr) = match op {
        Op::Send => (Dir::AtoB, UNTAGGED_HDR),
        Op::Write => (Dir::AtoB, TAGGED_HDR),
        Op::Read => (Dir::BtoA, TAGGED_HDR),
    };
    c.relay.flip_after(d, hdr + FLIP_AT as u64, FLIP_MASK);
    let sge_src = [src.sge(0, LEN as u32).unwrap()];
    let sge_sink = [sink.sge(0, LEN as u32).unwrap()];
    match op {
        Op::Send => {
            c.b.qp.post_recv(&RecvWr::new(RECV_ID, &sge_sink)).unwrap();
            c.a.qp
                .post_send(
                    &SendWr::new(SEND_ID, SendOp::Send)
                        .sg_list(&sge_src)
                        .signaled(),
                )
                .unwrap();
        }
        Op::Write => {
            c.a.qp
                .post_send(
                    &SendWr::new(
                        WRITE_ID,
                        SendOp::Write {
                            remote_addr: sink.addr(),
                            rkey: sink.rkey(),
                        },
                    )
                    .sg_list(&sge_src)
                    .signaled(),
                )
                .unwrap();
        }
        Op::Read => {
            c.a.qp
                .post_send(
                    &SendWr::new(
                        READ_ID,
                        SendOp::Read {
                            remote_addr: src.addr(),
                            rkey: src.rkey(),
                        },
                    )
                    .sg_list(&sge_sink)
                    .signaled(),
                )
                .unwrap();
        }
    }
    (c, src, sink, data)
}

/// With CRC, the receiver of the corrupted FPDU sends a Terminate (MPA CRC
/// error), both QPs end in ERROR, and no receive or Read completes with
/// success.
fn flipped_bit_with_crc(op: Op) {
    let (c, _src, _sink, _data) = flipped(true, op);
    let (detector, peer) = match op {
        Op::Read => (&c.a, &c.b),
        _ => (&c.b, &c.a),
    };
    let ev = c.wait_event(peer.qp.qp_num(), |e| {
        e.kind == AsyncEventKind::TerminateReceived
    });
    assert_eq!(
        ev.term.and_then(|t| t.known()),
        Some(TermError::MpaCrcError),
        "{ev:?}"
    );
    c.wait_both_error();
    let ev = c.wait_event(detector.qp.qp_num(), |e| e.term.is_some());
    assert_eq!(
        ev.term.and_then(|t| t.known()),
        Some(TermError::MpaCrcError)
    );
    match op {
        Op::Send => {
            // The sender's Send may have completed before the Terminate.
            let s = wait(&c.a.cq, 1);
            assert!(
                matches!(s[0].status, WcStatus::Success | WcStatus::WrFlush),
                "{s:?}"
            );
            let r = wait(&c.b.cq, 1);
            assert_eq!(r[0].wr_id, RECV_ID);
            assert_eq!(r[0].status, WcStatus::WrFlush, "{r:?}");
        }
        Op::Write => {
            let s = wait(&c.a.cq, 1);
            assert!(
                matches!(s[0].status, WcStatus::Success | WcStatus::WrFlush),
                "{s:?}"
            );
        }
        Op::Read => {
            let s = wait(&c.a.cq, 1);
            assert_eq!(s[0].wr_id, READ_ID);
            assert_ne!(s[0].status, WcStatus::Success, "{s:?}");
        }
    }
    std::thread::sleep(Duration::from_millis(10));
    assert!(c.a.cq.poll_one().is_none());
    assert!(c.b.cq.poll_one().is_none());
}

#[test]
fn flipped_bit_with_crc_send() {
    flipped_bit_with_crc(Op::Send);
}

#[test]
fn flipped_bit_with_crc_write() {
    flipped_bit_with_crc(Op::Write);
}

#[test]
fn flipped_bit_with_crc_read() {
    flipped_bit_with_crc(Op::Read);
}

/// Without CRC nothing can notice: the corrupted byte is placed and the
/// operation succeeds. This documents why MPA CRC matters on paths that
/// can corrupt data (TCP's own checksum is weak, and offloads skip it).
fn flipped_bit_without_crc(op: Op) {
    let (c, _src, sink, data) = flipped(false, op);
    match op {
        Op::Send => {
            let r = wait(&c.b.cq, 1);
            assert_eq!(r[0].status, WcStatus::Success, "{r:?}");
            assert_eq!(wait(&c.a.cq, 1)[0].status, WcStatus::Success);
        }
        Op::Write => {
            assert_eq!(wait(&c.a.cq, 1)[0].status, WcStatus::Success);
            // A Send behind the Write: once it is in, the Write is placed.
            let flag = mr(&c.b, 8);
            let fsge = [flag.sge(0, 8).unwrap()];
            c.b.qp.post_recv(&RecvWr::new(RECV_ID, &fsge)).unwrap();
            c.a.qp
                .post_send(&SendWr::new(SEND_ID, SendOp::Send).inline(b"flag"))
                .unwrap();
            assert_eq!(wait(&c.b.cq, 1)[0].status, WcStatus::Success);
        }
        Op::Read => {
            let s = wait(&c.a.cq, 1);
            assert_eq!(s[0].status, WcStatus::Success, "{s:?}");
        }
    }
    let got = sink.to_vec();
    let mut want = data;
    want[FLIP_AT] ^= FLIP_MASK;
    assert!(got == want, "exactly the flipped bit differs");
    assert_eq!(c.a.qp.state(), QpState::Rts);
    assert_eq!(c.b.qp.state(), QpState::Rts);
}

#[test]
fn flipped_bit_without_crc_send_is_delivered() {
    flipped_bit_without_crc(Op::Send);
}

#[test]
fn flipped_bit_without_crc_write_is_delivered() {
    flipped_bit_without_crc(Op::Write);
}

#[test]
fn flipped_bit_without_crc_read_is_delivered() {
    flipped_bit_without_crc(Op::Read);
}

/// A flipped bit in a Write's header with CRC on. The receive path checks
/// the header before the payload arrives (direct placement), as Linux siw
/// does, so a corrupted Tagged Offset that still lies inside the region is
/// only caught by the CRC (Terminate: MPA CRC error), while a corrupted
/// STag is refused as such (Terminate: invalid STag) before the CRC is
/// known. Either way both QPs end in ERROR.
fn flipped_header_bit_with_crc(at: u64, mask: u8, want: TermError) {
    const LEN: usize = 4096;
    let c = Conn::new(true);
    let src = mr(&c.a, LEN);
    src.write(0, &pattern(LEN, 3)).unwrap();
    let dst = mr(&c.b, 2 * LEN);
    c.relay.flip_after(Dir::AtoB, at, mask);
    let s = [src.sge(0, LEN as u32).unwrap()];
    c.a.qp
        .post_send(
            &SendWr::new(
                WRITE_ID,
                SendOp::Write {
                    remote_addr: dst.addr(),
                    rkey: dst.rkey(),
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
    let ev = c.wait_event(c.a.qp.qp_num(), |e| {
        e.kind == AsyncEventKind::TerminateReceived
    });
    assert_eq!(ev.term.and_then(|t| t.known()), Some(want), "{ev:?}");
    c.wait_both_error();
}

#[test]
fn flipped_tagged_offset_bit_with_crc_is_a_crc_error() {
    // MPA length (2), DDP/RDMAP control (2), STag (4), TO (8): the low
    // byte of the TO, +8.
    flipped_header_bit_with_crc(15, 0x08, TermError::MpaCrcError);
}

#[test]
fn flipped_stag_bit_with_crc_is_an_invalid_stag() {
    // The low byte of the STag: its key.
    flipped_header_bit_with_crc(7, 0x01, TermError::DdpTaggedInvalidStag);
}

// ---------------------------------------------------------------------------
// Connection cut
// ---------------------------------------------------------------------------

fn is_link_event(e: &AsyncEvent) -> bool {
    matches!(
        e.kind,
        AsyncEventKind::LlpReset | AsyncEventKind::LlpClosed | AsyncEventKind::BadClose
    )
}

/// The connection is cut in the middle of a large transfer: what was
/// placed is correct, outstanding work completes with flush errors (in
/// order, after the successes), both QPs report the loss and end in ERROR.
fn reset_mid_transfer(crc: bool) {
    const WRITES: u64 = 8;
    const LEN: usize = 2 << 20;
    const CUT: u64 = 300_000;
    let c = Conn::new(crc);
    let src = mr(&c.a, LEN);
    let data = pattern(LEN, 33);
    src.write(0, &data).unwrap();
    let dst = mr(&c.b, LEN);
    let recv = mr(&c.b, 64);
    let rsge = [recv.sge(0, 64).unwrap()];
    for i in 0..2 {
        c.b.qp.post_recv(&RecvWr::new(RECV_ID + i, &rsge)).unwrap();
    }
    c.relay.hold_after(Dir::AtoB, CUT);
    let sge = [src.sge(0, LEN as u32).unwrap()];
    for i in 0..WRITES {
        c.a.qp
            .post_send(
                &SendWr::new(
                    100 + i,
                    SendOp::Write {
                        remote_addr: dst.addr(),
                        rkey: dst.rkey(),
                    },
                )
                .sg_list(&sge)
                .signaled(),
            )
            .unwrap();
    }
    let rd = mr(&c.a, 64);
    let rdsge = [rd.sge(0, 64).unwrap()];
    c.a.qp
        .post_send(
            &SendWr::new(
                READ_ID,
                SendOp::Read {
                    remote_addr: dst.addr(),
                    rkey: dst.rkey(),
                },
            )
            .sg_list(&rdsge)
            .signaled(),
        )
        .unwrap();
    c.a.qp
        .post_send(
            &SendWr::new(SEND_ID, SendOp::Send)
                .inline(b"never")
                .signaled(),
        )
        .unwrap();
    c.relay.wait_held(Dir::AtoB);
    c.wait_caught_up(Dir::AtoB);
    c.relay.abort();
    c.wait_both_error();
    // Send queue: successes (requests fully written into the socket before
    // the cut) then flushes, in posting order; the last ones cannot have
    // fit in the socket buffers.
    let aw = wait(&c.a.cq, WRITES as usize + 2);
    let ids: Vec<u64> = aw.iter().map(|w| w.wr_id).collect();
    let mut want_ids: Vec<u64> = (0..WRITES).map(|i| 100 + i).collect();
    want_ids.extend([READ_ID, SEND_ID]);
    assert_eq!(ids, want_ids);
    let first_flush = aw
        .iter()
        .position(|w| w.status != WcStatus::Success)
        .expect("some requests flushed");
    assert!(
        aw[first_flush..]
            .iter()
            .all(|w| w.status == WcStatus::WrFlush),
        "{aw:?}"
    );
    assert!(first_flush < WRITES as usize, "{aw:?}");
    // Receive queue: flushed.
    let bw = wait(&c.b.cq, 2);
    assert!(bw.iter().all(|w| w.status == WcStatus::WrFlush), "{bw:?}");
    // What arrived before the cut was placed correctly (at most a few
    // headers of the first CUT bytes were not payload).
    let got = dst.to_vec();
    let placed = (CUT - 4096) as usize;
    assert!(got[..placed] == data[..placed], "data before the cut");
    c.wait_event(c.a.qp.qp_num(), is_link_event);
    c.wait_event(c.b.qp.qp_num(), is_link_event);
    // Posting after the loss completes with a flush error at once.
    c.a.qp
        .post_send(&SendWr::new(7, SendOp::Send).inline(b"x").signaled())
        .unwrap();
    let f = wait(&c.a.cq, 1);
    assert_eq!((f[0].wr_id, f[0].status), (7, WcStatus::WrFlush));
}

#[test]
fn reset_mid_transfer_no_crc() {
    reset_mid_transfer(false);
}

#[test]
fn reset_mid_transfer_crc() {
    reset_mid_transfer(true);
}

/// The peer's side of the relay is cut while a Read is outstanding and its
/// response half way: the Read completes with a flush error.
#[test]
fn reset_during_read_response() {
    const LEN: usize = 1 << 20;
    let c = Conn::new(true);
    let remote = mr(&c.b, LEN);
    remote.write(0, &pattern(LEN, 1)).unwrap();
    let local = mr(&c.a, LEN);
    let sge = [local.sge(0, LEN as u32).unwrap()];
    c.relay.hold_after(Dir::BtoA, 200_001);
    c.a.qp
        .post_send(
            &SendWr::new(
                READ_ID,
                SendOp::Read {
                    remote_addr: remote.addr(),
                    rkey: remote.rkey(),
                },
            )
            .sg_list(&sge)
            .signaled(),
        )
        .unwrap();
    c.relay.wait_held(Dir::BtoA);
    c.wait_caught_up(Dir::BtoA);
    c.relay.abort();
    c.wait_both_error();
    let s = wait(&c.a.cq, 1);
    assert_eq!((s[0].wr_id, s[0].status), (READ_ID, WcStatus::WrFlush));
    c.wait_event(c.a.qp.qp_num(), is_link_event);
    let got = local.to_vec();
    assert!(got[..190_000] == pattern(LEN, 1)[..190_000]);
}

#[test]
fn relay_passes_a_clean_stream() {
    for crc in [false, true] {
        let c = Conn::new(crc);
        let ops = Ops::new(&c, [70_000, 200_000, 140_000]);
        for seed in 0..3 {
            ops.post(&c, seed);
            ops.finish(&c, seed);
        }
    }
}
