//! Connection-manager benchmark: connections per second for N sequential
//! connect+accept pairs over the softrdma CM, next to N plain TCP
//! connect/accept pairs (and TCP pairs with one request/reply exchange,
//! the round trip an MPA handshake adds) in the same run; then the time to
//! serve a real client under a flood of half-open connections, with the
//! process's thread count.
//!
//! ```text
//! cargo run --release -p softrdma-engine --example cm_bench -- [N] [FLOOD] [ROUNDS]
//! ```
//!
//! Defaults: N = 1000, FLOOD = 1000, ROUNDS = 5 (the three rates are
//! measured in interleaved rounds; medians are printed). Everything runs on loopback in this
//! one process; the QPs are created before the timed loop (as a DAPL
//! connection-rate test creates its endpoints first).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::error::Error;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softrdma_engine::cm::{CmEvent, ConnectConfig, Connection, ListenConfig, Listener};
use softrdma_engine::{CompletionQueue, Device, QpInitAttr, QueuePair};

type BoxError = Box<dyn Error>;

const T: Duration = Duration::from_secs(30);

fn threads() -> usize {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Threads:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn qps(dev: &Device, n: usize) -> Result<(Vec<QueuePair>, CompletionQueue), BoxError> {
    let pd = dev.alloc_pd();
    let cq = dev.create_cq(1024)?;
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))?);
    }
    Ok((v, cq))
}

/// N sequential softrdma CM connections from one thread: non-blocking
/// connect, blocking accept, wait for the client's Established event.
fn cm_rate(dev: &Device, n: usize) -> Result<f64, BoxError> {
    let (clients, _cq1) = qps(dev, n)?;
    let (servers, _cq2) = qps(dev, n)?;
    let l = Listener::bind((Ipv4Addr::LOCALHOST, 0), 128, ListenConfig::default())?;
    let addr = l.local_addr();
    let mut conns = Vec::with_capacity(2 * n);
    let start = Instant::now();
    for (c, s) in clients.iter().zip(&servers) {
        let cfg = ConnectConfig {
            timeout: T,
            ..ConnectConfig::default()
        };
        let client = Connection::start(c, addr, cfg)?;
        let req = l.get_request(Some(T)).ok_or("no request")?;
        let server = req.accept(s, b"", 4, 4)?;
        match client.wait_event(Some(T)) {
            Some(CmEvent::Established { .. }) => {}
            other => return Err(format!("client: {other:?}").into()),
        }
        conns.push(client);
        conns.push(server);
    }
    let secs = start.elapsed().as_secs_f64();
    for c in &conns {
        c.abort();
    }
    Ok(n as f64 / secs)
}

/// N sequential plain TCP connect/accept pairs; with `exchange`, one
/// 24-octet request and reply on each (the round trip of MPA).
fn tcp_rate(n: usize, exchange: bool) -> Result<f64, BoxError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    let addr = l.local_addr()?;
    let mut keep = Vec::with_capacity(2 * n);
    let start = Instant::now();
    for _ in 0..n {
        let mut c = TcpStream::connect(addr)?;
        let (mut s, _) = l.accept()?;
        if exchange {
            c.set_nodelay(true)?;
            s.set_nodelay(true)?;
            let mut buf = [0u8; 24];
            c.write_all(&[1u8; 24])?;
            s.read_exact(&mut buf)?;
            s.write_all(&buf)?;
            c.read_exact(&mut buf)?;
        }
        keep.push(c);
        keep.push(s);
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Time to serve a real client while `flood` half-open connections sit in
/// their handshakes; thread counts before and during.
fn flood(dev: &Device, flood: usize) -> Result<(), BoxError> {
    let (qs, _cq) = qps(dev, 2)?;
    let l = Listener::bind(
        (Ipv4Addr::LOCALHOST, 0),
        8,
        ListenConfig {
            handshake_timeout: T,
            ..ListenConfig::default()
        },
    )?;
    let addr = l.local_addr();
    let before = threads();
    let mut half_open = Vec::with_capacity(flood);
    for _ in 0..flood {
        half_open.push(TcpStream::connect(addr)?);
    }
    let deadline = Instant::now() + T;
    while l.handshakes_in_progress() < flood.min(ListenConfig::default().max_handshakes) {
        if Instant::now() > deadline {
            return Err("the flood was not accepted".into());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let during = threads();
    let start = Instant::now();
    let client = Connection::start(&qs[0], addr, ConnectConfig::default())?;
    let req = l.get_request(Some(T)).ok_or("real client not served")?;
    let _server = req.accept(&qs[1], b"", 4, 4)?;
    match client.wait_event(Some(T)) {
        Some(CmEvent::Established { .. }) => {}
        other => return Err(format!("client: {other:?}").into()),
    }
    let took = start.elapsed();
    println!(
        "half-open flood: {flood} silent connections ({} in handshake), real client served in {:.2} ms; threads {before} before, {during} during, {} after",
        l.handshakes_in_progress(),
        took.as_secs_f64() * 1e3,
        threads()
    );
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn main() -> Result<(), BoxError> {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse())
        .collect::<Result<_, _>>()?;
    let n = args.first().copied().unwrap_or(1000);
    let f = args.get(1).copied().unwrap_or(1000);
    let rounds = args.get(2).copied().unwrap_or(5).max(1);
    let dev = Device::open_default()?;
    // Interleaved rounds, medians: the three see the same machine load.
    let (mut tcp, mut tcp_rt, mut cm) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        tcp.push(tcp_rate(n, false)?);
        tcp_rt.push(tcp_rate(n, true)?);
        cm.push(cm_rate(&dev, n)?);
    }
    let (tcp, tcp_rt, cm) = (median(tcp), median(tcp_rt), median(cm));
    println!("{n} sequential connections, loopback, one process, median of {rounds} rounds:");
    println!("  plain TCP connect/accept:            {tcp:>9.0} conn/s");
    println!("  TCP connect/accept + 1 round trip:   {tcp_rt:>9.0} conn/s");
    println!(
        "  softrdma CM connect/accept (MPA v2): {cm:>9.0} conn/s ({:.2}x plain TCP, {:.2}x TCP + round trip)",
        cm / tcp,
        cm / tcp_rt
    );
    flood(&dev, f)?;
    Ok(())
}
