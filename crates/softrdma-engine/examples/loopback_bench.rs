//! Loopback benchmark of the engine against plain TCP sockets doing the same
//! transfer pattern, in the same process and the same run.
//!
//! ```text
//! cargo run --release -p softrdma-engine --example loopback_bench -- [TEST] [--runs N] [--quick]
//! TEST: all (default) | write | pingpong | rate | fairness | dm
//! ```
//!
//! Every figure is the median of `--runs` runs (default 5) and is printed
//! with its ratio to TCP.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpInitAttr,
    QueuePair, RecvWr, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
    process_context_switches,
};

struct Side {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

fn device(force_dm: bool) -> Device {
    let mut cfg = DeviceConfig::default();
    cfg.force_datamover = force_dm;
    cfg.pin_threads = std::env::var_os("SOFTRDMA_PIN").is_some();
    Device::open_with(cfg).expect("device")
}

fn side(dev: &Device, cq: Option<&CompletionQueue>, depth: u32) -> Side {
    let pd = ProtectionDomain::new(dev);
    let cq = match cq {
        Some(c) => c.clone(),
        None => CompletionQueue::new(dev, 65536, None).expect("cq"),
    };
    let mut attr = QpInitAttr::new(&cq, &cq);
    attr.cap.max_send_wr = depth.max(16);
    attr.cap.max_recv_wr = depth.max(16);
    attr.cap.max_inline_data = 64;
    let qp = QueuePair::new(&pd, &attr).expect("qp");
    Side { pd, cq, qp }
}

fn connect(a: &Side, b: &Side, crc: bool) {
    let cfg = MpaConfig {
        crc: if crc {
            CrcPolicy::Required
        } else {
            CrcPolicy::AcceptIfAsked
        },
        ..MpaConfig::default()
    };
    connect_pair(&a.qp, &b.qp, &cfg).expect("connect");
}

fn mr(s: &Side, len: usize) -> MemoryRegion {
    s.pd.register(
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )
    .expect("mr")
}

fn poll_n(cq: &CompletionQueue, n: usize) {
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 32];
    let mut got = 0;
    while got < n {
        let k = cq.poll(&mut buf);
        for wc in &buf[..k] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        got += k;
    }
}

fn tcp_pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("bind");
    let a = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (b, _) = l.accept().expect("accept");
    a.set_nodelay(true).expect("nodelay");
    b.set_nodelay(true).expect("nodelay");
    (a, b)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// RDMA Write bandwidth, MB/s, `count` messages of `size` bytes, `depth`
/// outstanding.
fn rdma_write_bw(size: usize, count: usize, depth: usize, crc: bool) -> f64 {
    let dev = device(false);
    let a = side(&dev, None, depth as u32 + 1);
    let b = side(&dev, None, depth as u32 + 1);
    connect(&a, &b, crc);
    let src = mr(&a, size);
    src.fill(0x5a);
    let dst = mr(&b, size);
    let flag = mr(&b, 8);
    let fsge = [flag.sge(0, 8).expect("sge")];
    b.qp.post_recv(&RecvWr::new(0, &fsge)).expect("recv");
    let sge = [src.sge(0, size as u32).expect("sge")];
    let wr = SendWr::new(
        1,
        SendOp::Write {
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
        },
    )
    .sg_list(&sge)
    .signaled();
    let start = Instant::now();
    let mut posted = 0;
    let mut done = 0;
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 32];
    while done < count {
        while posted < count && posted - done < depth {
            a.qp.post_send(&wr).expect("post");
            posted += 1;
        }
        let k = a.cq.poll(&mut buf);
        done += k;
    }
    a.qp.post_send(&SendWr::new(2, SendOp::Send).inline(b"end").signaled())
        .expect("post");
    poll_n(&b.cq, 1);
    let secs = start.elapsed().as_secs_f64();
    (size * count) as f64 / secs / 1e6
}

fn tcp_bw(size: usize, count: usize) -> f64 {
    let (mut a, mut b) = tcp_pair();
    let total = size * count;
    let start = Instant::now();
    let rx = std::thread::spawn(move || {
        let mut buf = vec![0u8; size];
        let mut got = 0;
        while got < total {
            let n = b.read(&mut buf).expect("read");
            assert!(n > 0);
            got += n;
        }
    });
    let data = vec![0x5au8; size];
    for _ in 0..count {
        a.write_all(&data).expect("write");
    }
    rx.join().expect("rx");
    let secs = start.elapsed().as_secs_f64();
    total as f64 / secs / 1e6
}

/// 8-byte Send/Recv ping-pong with busy polling: half round trips in µs
/// (median, p99) and context switches per round trip.
fn rdma_pingpong(iters: usize, force_dm: bool) -> (f64, f64, f64) {
    let dev = device(force_dm);
    let a = side(&dev, None, 64);
    let b = side(&dev, None, 64);
    connect(&a, &b, false);
    let ra = mr(&a, 64);
    let rb = mr(&b, 64);
    let sa = [ra.sge(0, 8).expect("sge")];
    let sb = [rb.sge(0, 8).expect("sge")];
    for _ in 0..16 {
        a.qp.post_recv(&RecvWr::new(0, &sa)).expect("recv");
        b.qp.post_recv(&RecvWr::new(0, &sb)).expect("recv");
    }
    let bq = b.qp.clone();
    let bcq = b.cq.clone();
    let echo = std::thread::spawn(move || {
        let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 8];
        let mut n = 0;
        while n < iters {
            let k = bcq.poll(&mut buf);
            for wc in &buf[..k] {
                if wc.opcode == WcOpcode::Recv {
                    bq.post_recv(&RecvWr::new(0, &sb)).expect("recv");
                    bq.post_send(&SendWr::new(1, SendOp::Send).inline(b"pongpong"))
                        .expect("send");
                    n += 1;
                }
            }
        }
    });
    let mut lat = Vec::with_capacity(iters);
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 8];
    let cs0 = process_context_switches();
    for _ in 0..iters {
        let t = Instant::now();
        a.qp.post_send(&SendWr::new(1, SendOp::Send).inline(b"pingping"))
            .expect("send");
        'wait: loop {
            let k = a.cq.poll(&mut buf);
            for wc in &buf[..k] {
                if wc.opcode == WcOpcode::Recv {
                    break 'wait;
                }
            }
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        a.qp.post_recv(&RecvWr::new(0, &sa)).expect("recv");
    }
    let cs1 = process_context_switches();
    echo.join().expect("echo");
    let cs = ((cs1.0 - cs0.0) + (cs1.1 - cs0.1)) as f64 / iters as f64;
    lat.sort_by(|x, y| x.total_cmp(y));
    (lat[iters / 2], lat[iters * 99 / 100], cs)
}

/// Reads exactly `m.len()` bytes, spinning on a non-blocking socket.
fn spin_read(s: &mut TcpStream, m: &mut [u8]) {
    let mut got = 0;
    while got < m.len() {
        match s.read(&mut m[got..]) {
            Ok(0) => panic!("closed"),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("{e}"),
        }
    }
}

/// TCP ping-pong; `spin`: non-blocking sockets, busy-polled like the CQ.
fn tcp_pingpong_mode(iters: usize, spin: bool) -> (f64, f64, f64) {
    let (mut a, mut b) = tcp_pair();
    if spin {
        a.set_nonblocking(true).expect("nb");
        b.set_nonblocking(true).expect("nb");
        let echo = std::thread::spawn(move || {
            let mut m = [0u8; 8];
            for _ in 0..iters {
                spin_read(&mut b, &mut m);
                b.write_all(&m).expect("write");
            }
        });
        let mut lat = Vec::with_capacity(iters);
        let mut m = *b"pingping";
        let cs0 = process_context_switches();
        for _ in 0..iters {
            let t = Instant::now();
            a.write_all(&m).expect("write");
            spin_read(&mut a, &mut m);
            lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
        let cs1 = process_context_switches();
        echo.join().expect("echo");
        let cs = ((cs1.0 - cs0.0) + (cs1.1 - cs0.1)) as f64 / iters as f64;
        lat.sort_by(|x, y| x.total_cmp(y));
        return (lat[iters / 2], lat[iters * 99 / 100], cs);
    }
    let echo = std::thread::spawn(move || {
        let mut m = [0u8; 8];
        for _ in 0..iters {
            b.read_exact(&mut m).expect("read");
            b.write_all(&m).expect("write");
        }
    });
    let mut lat = Vec::with_capacity(iters);
    let mut m = *b"pingping";
    let cs0 = process_context_switches();
    for _ in 0..iters {
        let t = Instant::now();
        a.write_all(&m).expect("write");
        a.read_exact(&mut m).expect("read");
        lat.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
    }
    let cs1 = process_context_switches();
    echo.join().expect("echo");
    let cs = ((cs1.0 - cs0.0) + (cs1.1 - cs0.1)) as f64 / iters as f64;
    lat.sort_by(|x, y| x.total_cmp(y));
    (lat[iters / 2], lat[iters * 99 / 100], cs)
}

/// 8-byte RDMA Write message rate (messages/s), one signaled per `batch`.
fn rdma_rate(count: usize, batch: usize, list: bool) -> f64 {
    let dev = device(false);
    let a = side(&dev, None, 4096);
    let b = side(&dev, None, 64);
    connect(&a, &b, false);
    let dst = mr(&b, 4096);
    let flag = mr(&b, 8);
    let fsge = [flag.sge(0, 8).expect("sge")];
    b.qp.post_recv(&RecvWr::new(0, &fsge)).expect("recv");
    let payload = 0x0102_0304_0506_0708u64.to_ne_bytes();
    let mk = |signaled: bool| {
        let wr = SendWr::new(
            1,
            SendOp::Write {
                remote_addr: dst.addr(),
                rkey: dst.rkey(),
            },
        )
        .inline(&payload);
        if signaled {
            wr.flags(SendFlags::SIGNALED)
        } else {
            wr
        }
    };
    let mut wrs: Vec<SendWr<'_>> = (0..batch).map(|i| mk(i == batch - 1)).collect();
    wrs.shrink_to_fit();
    let start = Instant::now();
    let mut posted = 0;
    let mut done = 0;
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 32];
    while done < count {
        // Keep at most 8 batches in flight.
        while posted < count && posted - done < 8 * batch {
            if list {
                a.qp.post_send_list(&wrs).expect("post");
            } else {
                for wr in &wrs {
                    a.qp.post_send(wr).expect("post");
                }
            }
            posted += batch;
        }
        let k = a.cq.poll(&mut buf);
        done += k * batch;
    }
    a.qp.post_send(&SendWr::new(2, SendOp::Send).inline(b"end").signaled())
        .expect("post");
    poll_n(&b.cq, 1);
    count as f64 / start.elapsed().as_secs_f64()
}

fn tcp_rate(count: usize) -> f64 {
    let (mut a, mut b) = tcp_pair();
    let total = count * 8;
    let start = Instant::now();
    let rx = std::thread::spawn(move || {
        let mut buf = vec![0u8; 65536];
        let mut got = 0;
        while got < total {
            got += b.read(&mut buf).expect("read");
        }
    });
    let m = 0x0102_0304_0506_0708u64.to_ne_bytes();
    for _ in 0..count {
        a.write_all(&m).expect("write");
    }
    rx.join().expect("rx");
    count as f64 / start.elapsed().as_secs_f64()
}

/// `qps` QPs each writing 64 KiB messages for `dur`: aggregate MB/s and
/// Jain's fairness index of the per-QP byte counts.
fn rdma_fairness(qps: usize, dur: Duration) -> (f64, f64) {
    const SIZE: usize = 64 * 1024;
    const DEPTH: usize = 4;
    let dev = device(false);
    let cq = CompletionQueue::new(&dev, 65536, None).expect("cq");
    let mut senders = Vec::new();
    let mut receivers = Vec::new();
    for _ in 0..qps {
        let a = side(&dev, Some(&cq), DEPTH as u32 * 2);
        let b = side(&dev, None, 16);
        connect(&a, &b, false);
        senders.push(a);
        receivers.push(b);
    }
    let src = mr(&senders[0], SIZE);
    // One destination per receiver, all Writes of a QP go to it.
    let dsts: Vec<MemoryRegion> = receivers.iter().map(|r| mr(r, SIZE)).collect();
    // Touch every page before measuring.
    for d in &dsts {
        d.fill(0);
    }
    let sges: Vec<[softrdma_engine::Sge; 1]> = senders
        .iter()
        .map(|s| {
            let m = s.pd.register(SIZE, Access::LOCAL_WRITE).expect("mr");
            m.fill(1);
            let sge = [m.sge(0, SIZE as u32).expect("sge")];
            std::mem::forget(m);
            sge
        })
        .collect();
    drop(src);
    let post = |i: usize| {
        let wr = SendWr::new(
            i as u64,
            SendOp::Write {
                remote_addr: dsts[i].addr(),
                rkey: dsts[i].rkey(),
            },
        )
        .sg_list(&sges[i])
        .signaled();
        senders[i].qp.post_send(&wr).expect("post");
    };
    let mut bytes = vec![0u64; qps];
    let start = Instant::now();
    for i in 0..qps {
        for _ in 0..DEPTH {
            post(i);
        }
    }
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 64];
    let mut outstanding = qps * DEPTH;
    let mut running = true;
    while outstanding > 0 {
        if running && start.elapsed() >= dur {
            running = false;
        }
        let k = cq.poll(&mut buf);
        for wc in &buf[..k] {
            assert_eq!(wc.status, WcStatus::Success);
            let i = wc.wr_id as usize;
            if running {
                bytes[i] += SIZE as u64;
                post(i);
            } else {
                outstanding -= 1;
            }
        }
    }
    let secs = dur.as_secs_f64();
    let total: f64 = bytes.iter().map(|&b| b as f64).sum();
    let sumsq: f64 = bytes.iter().map(|&b| (b as f64) * (b as f64)).sum();
    let jain = if sumsq > 0.0 {
        total * total / (qps as f64 * sumsq)
    } else {
        0.0
    };
    (total / secs / 1e6, jain)
}

struct Opts {
    runs: usize,
    quick: bool,
}

fn bench_write(o: &Opts) {
    let count = if o.quick { 256 } else { 2048 };
    for crc in [false, true] {
        let mut r = Vec::new();
        let mut t = Vec::new();
        let mut q = Vec::new();
        for _ in 0..o.runs {
            let a = rdma_write_bw(1 << 20, count, 8, crc);
            let b = tcp_bw(1 << 20, count);
            r.push(a);
            t.push(b);
            q.push(a / b);
        }
        let (r, t) = (median(&mut r), median(&mut t));
        println!(
            "write 1 MiB, 1 QP, CRC {:3}: softrdma {:8.0} MB/s  TCP {:8.0} MB/s  ratio {:.2} (median of per-run ratios {:.2})",
            if crc { "on" } else { "off" },
            r,
            t,
            r / t,
            median(&mut q)
        );
    }
}

fn bench_pingpong(o: &Opts) {
    let iters = if o.quick { 2000 } else { 20000 };
    let mut rm = Vec::new();
    let mut rp = Vec::new();
    let mut tm = Vec::new();
    let mut tp = Vec::new();
    let mut sm = Vec::new();
    for _ in 0..o.runs {
        let (m, p, _) = rdma_pingpong(iters, false);
        rm.push(m);
        rp.push(p);
        let (m, p, _) = tcp_pingpong_mode(iters, false);
        tm.push(m);
        tp.push(p);
        sm.push(tcp_pingpong_mode(iters, true).0);
    }
    let (r, t) = (median(&mut rm), median(&mut tm));
    println!(
        "send/recv 8 B ping-pong, half RTT: softrdma {:.2} µs (p99 {:.2})  TCP {:.2} µs (p99 {:.2})  ratio {:.2}",
        r,
        median(&mut rp),
        t,
        median(&mut tp),
        r / t
    );
    let s = median(&mut sm);
    println!(
        "    vs TCP with busy-polled non-blocking sockets: {:.2} µs  ratio {:.2}",
        s,
        r / s
    );
}

fn bench_rate(o: &Opts) {
    let count = if o.quick { 100_000 } else { 1_000_000 };
    let mut single = Vec::new();
    let mut list = Vec::new();
    let mut tcp = Vec::new();
    for _ in 0..o.runs {
        single.push(rdma_rate(count, 64, false));
        list.push(rdma_rate(count, 64, true));
        tcp.push(tcp_rate(count));
    }
    let (s, l, t) = (median(&mut single), median(&mut list), median(&mut tcp));
    println!(
        "write 8 B rate, 1 of 64 signaled: softrdma {:.2} M/s (one post per request) / {:.2} M/s (lists of 64)  TCP {:.2} M/s  ratios {:.2} / {:.2}",
        s / 1e6,
        l / 1e6,
        t / 1e6,
        s / t,
        l / t
    );
}

fn bench_fairness(o: &Opts) {
    let dur = Duration::from_millis(if o.quick { 300 } else { 1500 });
    let mut one = Vec::new();
    let mut many = Vec::new();
    let mut jain = Vec::new();
    for _ in 0..o.runs {
        one.push(rdma_fairness(1, dur).0);
        let (bw, j) = rdma_fairness(256, dur);
        many.push(bw);
        jain.push(j);
    }
    let (one, many) = (median(&mut one), median(&mut many));
    println!(
        "write 64 KiB: 1 QP {:.0} MB/s, 256 QPs {:.0} MB/s aggregate (ratio {:.2}), Jain's fairness index {:.3}",
        one,
        many,
        many / one,
        median(&mut jain)
    );
}

fn bench_dm(o: &Opts) {
    let iters = if o.quick { 2000 } else { 20000 };
    for force in [false, true] {
        let mut m = Vec::new();
        let mut p = Vec::new();
        let mut c = Vec::new();
        for _ in 0..o.runs {
            let (a, b, cs) = rdma_pingpong(iters, force);
            m.push(a);
            p.push(b);
            c.push(cs);
        }
        println!(
            "{}: ping-pong half RTT {:.2} µs (p99 {:.2}), {:.2} context switches per round trip",
            if force {
                "forced datamover"
            } else {
                "direct sending  "
            },
            median(&mut m),
            median(&mut p),
            median(&mut c)
        );
    }
    let (m, p, c) = tcp_pingpong_mode(iters, false);
    println!(
        "plain TCP       : ping-pong half RTT {m:.2} µs (p99 {p:.2}), {c:.2} context switches per round trip"
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut test = "all".to_string();
    let mut o = Opts {
        runs: 5,
        quick: false,
    };
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--runs" => {
                i += 1;
                o.runs = args.get(i).and_then(|s| s.parse().ok()).unwrap_or(5).max(1);
            }
            "--quick" => o.quick = true,
            t => test = t.to_string(),
        }
        i += 1;
    }
    println!(
        "softrdma engine loopback benchmark, median of {} runs, {} CPUs",
        o.runs,
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    match test.as_str() {
        "write" => bench_write(&o),
        "pingpong" => bench_pingpong(&o),
        "rate" => bench_rate(&o),
        "fairness" => bench_fairness(&o),
        "dm" => bench_dm(&o),
        "all" => {
            bench_write(&o);
            bench_pingpong(&o);
            bench_rate(&o);
            bench_fairness(&o);
            bench_dm(&o);
        }
        other => {
            eprintln!("unknown test {other:?}: all | write | pingpong | rate | fairness | dm");
            std::process::exit(2);
        }
    }
}
