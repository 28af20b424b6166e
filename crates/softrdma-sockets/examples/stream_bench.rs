//! Byte-stream benchmark: sockets direct (SDP over softrdma) against plain
//! kernel TCP in the same run.
//!
//! ```text
//! stream_bench [--sizes 64,4096,131072] [--bytes N] [--lat] [--iters N]
//!              [--runs R] [--nodelay] [--setup N] [--idle N]
//!              [--server ADDR --mode auto|offload|tcp]
//!              [--connect ADDR --mode auto|offload|tcp]
//! ```
//!
//! Without `--server`/`--connect`, one process runs a server thread per
//! transport on 127.0.0.1 and measures both, printing medians of `--runs`
//! and the ratio to TCP (`--mode tcp|offload`: that transport only;
//! `--sizes ""`: no bandwidth or latency run, e.g. for `--setup` alone).
//! `--server` serves every connection (both
//! transports: the listener takes plain and offloaded clients);
//! `--connect` measures against such a server with the given mode. Every
//! result is also printed as a JSON line (prefix `{`).

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::thread;
use std::time::{Duration, Instant};

use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

#[derive(Debug, Clone)]
struct Args {
    sizes: Vec<usize>,
    bytes: u64,
    lat: bool,
    iters: u32,
    runs: usize,
    nodelay: bool,
    setup: u32,
    idle: u32,
    server: Option<String>,
    connect: Option<String>,
    mode: Mode,
    spin_us: Option<u64>,
}

fn parse() -> Args {
    let mut a = Args {
        sizes: vec![64, 4096, 131072],
        bytes: 256 << 20,
        lat: false,
        iters: 20_000,
        runs: 3,
        nodelay: false,
        setup: 200,
        idle: 0,
        server: None,
        connect: None,
        mode: Mode::Auto,
        spin_us: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().expect("missing value");
        match k.as_str() {
            "--sizes" => {
                a.sizes = v()
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().expect("size"))
                    .collect()
            }
            "--bytes" => a.bytes = v().parse().expect("bytes"),
            "--lat" => a.lat = true,
            "--iters" => a.iters = v().parse().expect("iters"),
            "--runs" => a.runs = v().parse().expect("runs"),
            "--nodelay" => a.nodelay = true,
            "--setup" => a.setup = v().parse().expect("setup"),
            "--idle" => a.idle = v().parse().expect("idle"),
            "--spin-us" => a.spin_us = Some(v().parse().expect("spin")),
            "--server" => a.server = Some(v()),
            "--connect" => a.connect = Some(v()),
            "--mode" => {
                a.mode = match v().as_str() {
                    "offload" | "sdp" => Mode::Offload,
                    "tcp" => Mode::Tcp,
                    _ => Mode::Auto,
                }
            }
            "-h" | "--help" => {
                println!("see the source header for usage");
                std::process::exit(0);
            }
            other => panic!("unknown argument {other}"),
        }
    }
    a
}

/// Serves one connection: a command byte, then the test.
fn handle(mut s: TcpStream) -> std::io::Result<()> {
    let mut cmd = [0u8; 13];
    loop {
        match s.read_exact(&mut cmd) {
            Ok(()) => {}
            Err(_) => return Ok(()),
        }
        let size = u32::from_be_bytes(cmd[1..5].try_into().unwrap_or_default()) as usize;
        let n = u64::from_be_bytes(cmd[5..13].try_into().unwrap_or_default());
        match cmd[0] {
            b'B' => {
                let mut buf = vec![0u8; size.max(1 << 16)];
                let mut left = n;
                while left > 0 {
                    let want = left.min(buf.len() as u64) as usize;
                    let k = s.read(&mut buf[..want])?;
                    if k == 0 {
                        return Ok(());
                    }
                    left -= k as u64;
                }
                s.write_all(b"k")?;
                s.flush()?;
            }
            b'L' => {
                s.set_nodelay(true)?;
                let mut buf = vec![0u8; size];
                for _ in 0..n {
                    s.read_exact(&mut buf)?;
                    s.write_all(&buf)?;
                }
            }
            _ => return Ok(()),
        }
    }
}

fn serve(l: TcpListener) {
    for s in l.incoming() {
        match s {
            Ok(s) => {
                thread::spawn(move || {
                    let _ = handle(s);
                });
            }
            Err(e) => eprintln!("accept: {e}"),
        }
    }
}

fn cmd(kind: u8, size: usize, n: u64) -> [u8; 13] {
    let mut c = [0u8; 13];
    c[0] = kind;
    c[1..5].copy_from_slice(&(size as u32).to_be_bytes());
    c[5..13].copy_from_slice(&n.to_be_bytes());
    c
}

static SPIN_US: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();

fn config(mode: Mode) -> Config {
    let mut c = Config::with_mode(mode);
    if let Some(us) = SPIN_US.get().copied().flatten() {
        c.spin = Duration::from_micros(us);
    }
    c
}

fn connect(addr: SocketAddr, mode: Mode) -> TcpStream {
    let s = TcpStream::connect_with(addr, &config(mode)).expect("connect");
    if mode == Mode::Offload {
        assert!(s.transport().is_offloaded(), "{}", s.transport());
    }
    s
}

/// MB/s of `bytes` written in `size` pieces.
fn bandwidth(addr: SocketAddr, mode: Mode, size: usize, bytes: u64, nodelay: bool) -> f64 {
    let mut s = connect(addr, mode);
    s.set_nodelay(nodelay).expect("nodelay");
    let buf = vec![0x5au8; size];
    let total = bytes / size as u64 * size as u64;
    s.write_all(&cmd(b'B', size, total)).expect("cmd");
    s.flush().expect("flush");
    let t = Instant::now();
    let mut left = total;
    while left > 0 {
        s.write_all(&buf).expect("write");
        left -= size as u64;
    }
    s.flush().expect("flush");
    let mut k = [0u8; 1];
    s.read_exact(&mut k).expect("ack");
    total as f64 / t.elapsed().as_secs_f64() / 1e6
}

/// Mean round trip of `size`-byte ping-pong, µs.
fn latency(addr: SocketAddr, mode: Mode, size: usize, iters: u32) -> f64 {
    let mut s = connect(addr, mode);
    s.set_nodelay(true).expect("nodelay");
    s.write_all(&cmd(b'L', size, u64::from(iters)))
        .expect("cmd");
    s.flush().expect("flush");
    let mut buf = vec![1u8; size];
    let warm = iters / 10;
    let mut t = Instant::now();
    for i in 0..iters {
        if i == warm {
            t = Instant::now();
        }
        s.write_all(&buf).expect("write");
        s.read_exact(&mut buf).expect("read");
    }
    t.elapsed().as_secs_f64() * 1e6 / f64::from(iters - warm)
}

/// Mean connect time (µs) including the transport setup and a first
/// round trip.
fn setup(addr: SocketAddr, mode: Mode, n: u32) -> f64 {
    let t = Instant::now();
    let (mut c, mut r, mut d) = (0.0, 0.0, 0.0);
    for _ in 0..n {
        let t0 = Instant::now();
        let mut s = connect(addr, mode);
        let t1 = Instant::now();
        s.write_all(&cmd(b'L', 1, 1)).expect("cmd");
        s.write_all(b"x").expect("w");
        let mut b = [0u8; 1];
        s.read_exact(&mut b).expect("r");
        let t2 = Instant::now();
        drop(s);
        let t3 = Instant::now();
        c += (t1 - t0).as_secs_f64();
        r += (t2 - t1).as_secs_f64();
        d += (t3 - t2).as_secs_f64();
    }
    let per = |x: f64| x * 1e6 / f64::from(n);
    eprintln!(
        "setup {}: connect {:.1} us, first round trip {:.1} us, close {:.1} us",
        name(mode),
        per(c),
        per(r),
        per(d)
    );
    t.elapsed().as_secs_f64() * 1e6 / f64::from(n)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(|pages| pages * 4)
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn name(m: Mode) -> &'static str {
    match m {
        Mode::Tcp => "tcp",
        Mode::Offload => "sdp",
        _ => "auto",
    }
}

fn report(test: &str, size: usize, unit: &str, vals: &[(Mode, f64)]) {
    let tcp = vals.iter().find(|(m, _)| *m == Mode::Tcp).map(|x| x.1);
    for (m, v) in vals {
        let ratio = tcp.map(|t| v / t);
        println!(
            "{test:<6} {size:>7} B  {:<4} {v:>10.2} {unit}{}",
            name(*m),
            ratio
                .filter(|_| *m != Mode::Tcp)
                .map(|r| format!("  ({r:.3}x tcp)"))
                .unwrap_or_default()
        );
        println!(
            "{{\"test\":\"{test}\",\"size\":{size},\"transport\":\"{}\",\"value\":{v:.3},\"unit\":\"{unit}\",\"ratio_vs_tcp\":{}}}",
            name(*m),
            ratio.map(|r| format!("{r:.4}")).unwrap_or("null".into())
        );
    }
}

fn main() {
    let a = parse();
    let _ = SPIN_US.set(a.spin_us);
    if let Some(addr) = &a.server {
        let l = TcpListener::bind_with(addr.as_str(), &config(a.mode)).expect("bind");
        eprintln!(
            "serving on {} (offload capable: {})",
            l.local_addr().expect("addr"),
            l.offload_capable()
        );
        serve(l);
        return;
    }
    // Targets: (mode, address).
    let targets: Vec<(Mode, SocketAddr)> = match &a.connect {
        Some(addr) => {
            let addr: SocketAddr = addr.parse().expect("address");
            if a.mode == Mode::Auto {
                vec![(Mode::Tcp, addr), (Mode::Offload, addr)]
            } else {
                vec![(a.mode, addr)]
            }
        }
        // `--mode tcp|offload` without `--connect`: that transport only.
        None => [Mode::Tcp, Mode::Offload]
            .into_iter()
            .filter(|&m| a.mode == Mode::Auto || m == a.mode)
            .map(|m| {
                let l = TcpListener::bind_with("127.0.0.1:0", &config(Mode::Auto)).expect("bind");
                let addr = l.local_addr().expect("addr");
                thread::spawn(move || serve(l));
                (m, addr)
            })
            .collect(),
    };
    for &size in &a.sizes {
        if a.lat {
            let vals: Vec<(Mode, f64)> = targets
                .iter()
                .map(|&(m, addr)| {
                    let runs = (0..a.runs)
                        .map(|_| latency(addr, m, size, a.iters))
                        .collect();
                    (m, median(runs))
                })
                .collect();
            report("rtt", size, "us", &vals);
        } else {
            let vals: Vec<(Mode, f64)> = targets
                .iter()
                .map(|&(m, addr)| {
                    let bytes = if size < 1024 { a.bytes / 16 } else { a.bytes };
                    let runs = (0..a.runs)
                        .map(|_| bandwidth(addr, m, size, bytes, a.nodelay))
                        .collect();
                    (m, median(runs))
                })
                .collect();
            report("bw", size, "MB/s", &vals);
        }
    }
    if a.setup > 0 {
        let vals: Vec<(Mode, f64)> = targets
            .iter()
            .map(|&(m, addr)| {
                let runs = (0..a.runs).map(|_| setup(addr, m, a.setup)).collect();
                (m, median(runs))
            })
            .collect();
        report("setup", 0, "us", &vals);
    }
    eprintln!(
        "(blocked calls woken by the re-poll timer: {})",
        softrdma_sockets::lost_wakeups()
    );
    if a.idle > 0 {
        for &(m, addr) in &targets {
            let before = rss_kib();
            let conns: Vec<TcpStream> = (0..a.idle).map(|_| connect(addr, m)).collect();
            thread::sleep(Duration::from_millis(200));
            let after = rss_kib();
            // Both ends live in this process when no --connect was given.
            let ends = if a.connect.is_some() { 1 } else { 2 };
            let per = (after.saturating_sub(before)) as f64 / f64::from(a.idle) / f64::from(ends);
            report("idle", 0, "KiB/conn", &[(m, per)]);
            drop(conns);
            // Idle connections whose buffers come from the pool of
            // closed ones: a wave that sent 256 KiB over every
            // connection is closed first, then the same number opened.
            // What they hold counts from before the first wave.
            let before = rss_kib();
            let wave: Vec<TcpStream> = (0..a.idle)
                .map(|_| {
                    let mut s = connect(addr, m);
                    let data = vec![0x5au8; 256 * 1024];
                    s.write_all(&cmd(b'B', 64 * 1024, data.len() as u64))
                        .expect("cmd");
                    s.write_all(&data).expect("w");
                    let mut k = [0u8; 1];
                    s.read_exact(&mut k).expect("r");
                    s
                })
                .collect();
            drop(wave);
            thread::sleep(Duration::from_millis(500));
            let conns: Vec<TcpStream> = (0..a.idle).map(|_| connect(addr, m)).collect();
            thread::sleep(Duration::from_millis(200));
            let after = rss_kib();
            let per = (after.saturating_sub(before)) as f64 / f64::from(a.idle) / f64::from(ends);
            report("idle-reused", 0, "KiB/conn", &[(m, per)]);
            drop(conns);
        }
        println!(
            "(configured buffers per offloaded connection: {} KiB)",
            Config::default().buffer_memory() / 1024
        );
    }
}
