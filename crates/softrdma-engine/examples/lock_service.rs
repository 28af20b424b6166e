//! A lock service on proxy QPs: lock acquisitions and releases are served by
//! a proxy handler, record updates by the application.
//!
//! ```text
//! cargo run --release -p softrdma-engine --example lock_service            # the demo
//! cargo run --release -p softrdma-engine --example lock_service -- bench [--requests N] [--runs R] [--depth D]
//! ```
//!
//! **Demo.** Four clients each send "acquire lock K" and "update record K"
//! back to back, then "release lock K". A proxy handler answers acquire and
//! release (a compare-and-swap on a lock word in registered memory, then a
//! reply Send); the application, woken by its completion channel, applies an
//! update only if the client holds the lock. Because completions of a proxy
//! QP come out in message order, the application always sees the no-op
//! completion of the acquisition before the update's completion — the demo
//! checks this for every update, and at the end that every record equals the
//! number of updates acknowledged and that no lock is left held.
//!
//! **Bench.** One client, request/response: each request (acquire or
//! release, 16 bytes) waits for its reply (`--depth 1`, latency) or keeps
//! `--depth` requests in flight (throughput). Served by the proxy handler,
//! vs by the application thread answering from its CQ — woken by the
//! completion channel, or busy-polling. Prints requests per second, median
//! and p99 latency, and how often the application thread woke per request.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::proxy::{
    Criterion, Field, FilterEntry, HandlerError, MatchPolicy, Proxy, ProxyAttach, ProxyConfig,
    ProxyFilter, ProxyOutcome, ProxyStats,
};
use softrdma_engine::{
    Access, CompletionChannel, CompletionQueue, Device, DeviceConfig, MemoryRegion,
    ProtectionDomain, QpInitAttr, QueuePair, RecvWr, SendOp, SendWr, WcFlags, WcOpcode, WcStatus,
    WorkCompletion,
};

type Error = Box<dyn std::error::Error>;

const LOCKS: usize = 8;
const REQ: usize = 16;
const SLOT: usize = 64;
const RECVS: usize = 256;
const ACQUIRE: u8 = b'A';
const RELEASE: u8 = b'R';
const UPDATE: u8 = b'U';
const GRANTED: u8 = b'G';
const BUSY: u8 = b'B';
const OK: u8 = b'K';
const DENIED: u8 = b'D';

/// `[op, key, client, 0 x5, value u64]`.
fn request(op: u8, key: u8, client: u8, value: u64) -> [u8; REQ] {
    let mut r = [0u8; REQ];
    r[0] = op;
    r[1] = key;
    r[2] = client;
    r[8..].copy_from_slice(&value.to_le_bytes());
    r
}

/// Acquire and release go to the proxy.
fn lock_filter() -> Result<ProxyFilter, Error> {
    Ok(ProxyFilter::new(MatchPolicy::MatchesToProxy)
        .entry(FilterEntry::any().and(Criterion::ternary(Field::Payload, 0, &[ACQUIRE], &[0xff])?))
        .entry(FilterEntry::any().and(Criterion::ternary(Field::Payload, 0, &[RELEASE], &[0xff])?)))
}

/// The server: lock words and records in one region, receive buffers per QP.
struct Server {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    channel: CompletionChannel,
    proxy: Option<Proxy>,
    /// `LOCKS` lock words, then `LOCKS` records.
    table: MemoryRegion,
    qps: Vec<(QueuePair, MemoryRegion)>,
}

impl Server {
    fn new(dev: &Device, proxy: Option<ProxyConfig>) -> Result<Server, Error> {
        let pd = ProtectionDomain::new(dev);
        let channel = CompletionChannel::new(dev)?;
        let proxy = match proxy {
            Some(cfg) => Some(Proxy::start(dev, cfg)?),
            None => None,
        };
        let mut b = CompletionQueue::builder(dev, 8192).channel(&channel);
        if let Some(p) = &proxy {
            b = b.proxy(p);
        }
        let cq = b.build()?;
        let table = pd.register(16 * LOCKS, Access::LOCAL_WRITE)?;
        Ok(Server {
            pd,
            cq,
            channel,
            proxy,
            table,
            qps: Vec::new(),
        })
    }

    /// A server QP (a proxy QP if the server has a proxy), connected to
    /// `client`.
    fn accept(&mut self, client: &QueuePair) -> Result<(), Error> {
        let attr = QpInitAttr::new(&self.cq, &self.cq);
        let qp = match &self.proxy {
            Some(p) => {
                let lkey = self.table.lkey();
                let base = self.table.addr();
                let attach = ProxyAttach::new(p, lock_filter()?, move |ctx, msg| {
                    let mut req = [0u8; REQ];
                    if msg.read_payload(0, &mut req) != REQ {
                        return Ok(ProxyOutcome::NotHandled);
                    }
                    let (op, key, client) = (req[0], req[1], u64::from(req[2]));
                    if usize::from(key) >= LOCKS {
                        return Err(HandlerError::failed("no such lock"));
                    }
                    let word = base + 8 * u64::from(key);
                    let status = match op {
                        ACQUIRE => match ctx.compare_swap(lkey, word, 0, client)? {
                            0 => GRANTED,
                            _ => BUSY,
                        },
                        RELEASE if ctx.compare_swap(lkey, word, client, 0)? == client => OK,
                        RELEASE => DENIED,
                        _ => return Ok(ProxyOutcome::NotHandled),
                    };
                    ctx.post_send(&SendWr::new(0, SendOp::Send).inline(&[status, key]))?;
                    Ok(ProxyOutcome::Done)
                })
                // The proxy reposts the buffers of the messages it serves.
                .recycle_receives();
                QueuePair::new_proxy(&self.pd, &attr, attach)?
            }
            None => QueuePair::new(&self.pd, &attr)?,
        };
        let bufs = self.pd.register(RECVS * SLOT, Access::LOCAL_WRITE)?;
        for i in 0..RECVS {
            qp.post_recv(&RecvWr::new(i as u64, &[bufs.sge(i * SLOT, SLOT as u32)?]))?;
        }
        connect_pair(client, &qp, &MpaConfig::default())?;
        self.qps.push((qp, bufs));
        Ok(())
    }

    fn word(&self, i: usize) -> u64 {
        let mut b = [0u8; 8];
        let _ = self.table.read(8 * i, &mut b);
        u64::from_ne_bytes(b)
    }

    fn set_word(&self, i: usize, v: u64) {
        let _ = self.table.write(8 * i, &v.to_ne_bytes());
    }

    /// Serves one completion: replies to requests, reposts the receive.
    fn serve(&self, wc: &WorkCompletion, check: &mut OrderCheck) -> Result<(), Error> {
        match wc.status {
            WcStatus::Success => {}
            // A client that finished closed its connection.
            WcStatus::WrFlush => return Ok(()),
            _ => return Err(format!("completion failed: {wc:?}").into()),
        }
        let Some((qp, bufs)) = self.qps.iter().find(|(q, _)| q.qp_num() == wc.qp_num) else {
            return Ok(()); // a send completion of another QP
        };
        if !matches!(wc.opcode, WcOpcode::Recv | WcOpcode::ProxyNoop) {
            return Ok(());
        }
        let slot = wc.wr_id as usize * SLOT;
        let mut req = [0u8; REQ];
        bufs.read(slot, &mut req)?;
        let (op, key, client) = (req[0], usize::from(req[1]), u64::from(req[2]));
        let value = u64::from_le_bytes(req[8..].try_into()?);
        let reply = match (wc.opcode, op) {
            (WcOpcode::ProxyNoop, _) => {
                check.noop(wc, op, key);
                None
            }
            (_, ACQUIRE) if key < LOCKS => {
                // Application-served (no proxy): the same lock logic.
                if self.word(key) == 0 {
                    self.set_word(key, client);
                    Some(GRANTED)
                } else {
                    Some(BUSY)
                }
            }
            (_, RELEASE) if key < LOCKS => {
                if self.word(key) == client {
                    self.set_word(key, 0);
                    Some(OK)
                } else {
                    Some(DENIED)
                }
            }
            (_, UPDATE) if key < LOCKS => {
                check.update(wc, key);
                if self.word(key) == client {
                    self.set_word(LOCKS + key, self.word(LOCKS + key) + value);
                    Some(OK)
                } else {
                    Some(DENIED)
                }
            }
            _ => Some(DENIED),
        };
        if !wc.flags.contains(WcFlags::PROXY_RECYCLED) {
            qp.post_recv(&RecvWr::new(wc.wr_id, &[bufs.sge(slot, SLOT as u32)?]))?;
        }
        if let Some(status) = reply {
            qp.post_send(&SendWr::new(0, SendOp::Send).inline(&[status, key as u8]))?;
        }
        Ok(())
    }

    /// Serves until `stop`; returns the wake-ups that found completions.
    fn run(&self, stop: &AtomicBool, wait: Wait, check: &mut OrderCheck) -> Result<u64, Error> {
        let mut wakeups = 0u64;
        let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 32];
        if wait == Wait::Channel {
            self.cq.req_notify(false)?;
        }
        // Arm, then drain, then wait: a completion that arrived before the
        // arm is found by the drain, any later one raises an event.
        while !stop.load(Ordering::Acquire) {
            let mut found = false;
            loop {
                let n = self.cq.poll(&mut buf);
                found |= n > 0;
                for wc in &buf[..n] {
                    self.serve(wc, check)?;
                }
                if n < buf.len() {
                    break;
                }
            }
            if found && wait != Wait::Busy {
                wakeups += 1;
            }
            match wait {
                Wait::Channel => {
                    if let Ok(cq) = self.channel.get_event(Some(Duration::from_millis(20))) {
                        cq.ack_events(1);
                        cq.req_notify(false)?;
                    }
                }
                Wait::Busy => {}
                Wait::Every(d) => std::thread::sleep(d),
            }
        }
        Ok(wakeups)
    }
}

/// How the application thread waits for completions.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wait {
    /// Woken by the completion channel.
    Channel,
    /// Busy-polling.
    Busy,
    /// Draining every so often.
    Every(Duration),
}

/// What the demo checks: the acquisition's no-op completion comes before
/// the update's completion on the same QP.
#[derive(Default)]
struct OrderCheck {
    /// Per QP: (proxy_seq, op, key) of the last no-op completion.
    last_noop: Vec<(u32, u64, u8, usize)>,
    updates_checked: u64,
    violations: u64,
}

impl OrderCheck {
    fn noop(&mut self, wc: &WorkCompletion, op: u8, key: usize) {
        self.last_noop.retain(|e| e.0 != wc.qp_num);
        self.last_noop.push((wc.qp_num, wc.proxy_seq, op, key));
    }

    fn update(&mut self, wc: &WorkCompletion, key: usize) {
        self.updates_checked += 1;
        let ok = self.last_noop.iter().any(|&(qp, seq, op, k)| {
            qp == wc.qp_num && op == ACQUIRE && k == key && seq < wc.proxy_seq
        });
        if !ok {
            self.violations += 1;
        }
    }
}

/// A client QP with its receive buffers.
struct Client {
    qp: QueuePair,
    cq: CompletionQueue,
    bufs: MemoryRegion,
}

impl Client {
    fn new(dev: &Device) -> Result<Client, Error> {
        let pd = ProtectionDomain::new(dev);
        let cq = CompletionQueue::new(dev, 4096, None)?;
        let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))?;
        let bufs = pd.register(RECVS * SLOT, Access::LOCAL_WRITE)?;
        for i in 0..RECVS {
            qp.post_recv(&RecvWr::new(i as u64, &[bufs.sge(i * SLOT, SLOT as u32)?]))?;
        }
        Ok(Client { qp, cq, bufs })
    }

    fn send(&self, req: &[u8; REQ]) -> Result<(), Error> {
        self.qp
            .post_send(&SendWr::new(0, SendOp::Send).inline(req))?;
        Ok(())
    }

    /// Waits for the next reply: `(status, key)`.
    fn reply(&self) -> Result<(u8, u8), Error> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(wc) = self.cq.poll_one() {
                if wc.opcode != WcOpcode::Recv {
                    if wc.status != WcStatus::Success {
                        return Err(format!("client: {wc:?}").into());
                    }
                    continue;
                }
                let slot = wc.wr_id as usize * SLOT;
                let mut r = [0u8; 2];
                self.bufs.read(slot, &mut r)?;
                self.qp
                    .post_recv(&RecvWr::new(wc.wr_id, &[self.bufs.sge(slot, SLOT as u32)?]))?;
                return Ok((r[0], r[1]));
            }
            if Instant::now() > deadline {
                let a = self.qp.query();
                return Err(format!(
                    "client: no reply in 10 s (client QP {:?}, sent {} B, received {} B)",
                    a.state, a.bytes_sent, a.bytes_received
                )
                .into());
            }
            // Polling, but giving the CPU away: on a small machine the
            // server's threads need it.
            std::thread::yield_now();
        }
    }
}

fn device() -> Result<Device, Error> {
    let mut cfg = DeviceConfig::default();
    cfg.pin_threads = false;
    Ok(Device::open_with(cfg)?)
}

fn demo() -> Result<(), Error> {
    const CLIENTS: usize = 4;
    const ROUNDS: usize = 500;
    let dev = device()?;
    let mut server = Server::new(&dev, Some(ProxyConfig::default()))?;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let c = Client::new(&dev)?;
        server.accept(&c.qp)?;
        clients.push(c);
    }
    println!(
        "lock service: {CLIENTS} clients x {ROUNDS} rounds of acquire K + update K (back to back), then release K"
    );
    println!("  acquire/release: served by the proxy thread (compare-and-swap + reply)");
    println!("  update:          served by the application, only if the client holds lock K\n");
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(AtomicU64::new(0));
    let busy = Arc::new(AtomicU64::new(0));
    let server = Arc::new(server);
    let check = Arc::new(Mutex::new(OrderCheck::default()));
    let srv = {
        let (server, stop, check) = (server.clone(), stop.clone(), check.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let mut c = check.lock().map_err(|e| e.to_string())?;
            server
                .run(&stop, Wait::Channel, &mut c)
                .map_err(|e| e.to_string())
        })
    };
    let start = Instant::now();
    let threads: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let (acked, busy) = (acked.clone(), busy.clone());
            std::thread::spawn(move || -> Result<(), String> {
                let me = i as u8 + 1;
                let run = || -> Result<(), Error> {
                    for r in 0..ROUNDS {
                        let key = ((r * 7 + i * 3) % LOCKS) as u8;
                        c.send(&request(ACQUIRE, key, me, 0))?;
                        c.send(&request(UPDATE, key, me, 1))?;
                        let (grant, _) = c.reply()?;
                        let (upd, _) = c.reply()?;
                        match (grant, upd) {
                            (GRANTED, OK) => {
                                acked.fetch_add(1, Ordering::Relaxed);
                                c.send(&request(RELEASE, key, me, 0))?;
                                let (rel, _) = c.reply()?;
                                if rel != OK {
                                    return Err(format!("release refused: {rel}").into());
                                }
                            }
                            (BUSY, DENIED) => {
                                busy.fetch_add(1, Ordering::Relaxed);
                            }
                            other => return Err(format!("inconsistent replies {other:?}").into()),
                        }
                    }
                    Ok(())
                };
                run().map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut failure = None;
    for t in threads {
        if let Err(e) = t
            .join()
            .map_err(|_| "client panicked".to_string())
            .and_then(|r| r)
        {
            failure.get_or_insert(e);
        }
    }
    let elapsed = start.elapsed();
    stop.store(true, Ordering::Release);
    let served = srv.join().map_err(|_| "server panicked")?;
    let wakeups = served?;
    if let Some(e) = failure {
        if let Some(p) = &server.proxy {
            print_stats(&p.stats());
        }
        return Err(e.into());
    }
    let check = check.lock().map_err(|e| e.to_string())?;
    let records: u64 = (0..LOCKS).map(|k| server.word(LOCKS + k)).sum();
    let held = (0..LOCKS).filter(|&k| server.word(k) != 0).count();
    let st = server.proxy.as_ref().map(Proxy::stats).unwrap_or_default();
    let acked = acked.load(Ordering::Relaxed);
    println!(
        "done in {:.1} ms: {} updates applied, {} refused (lock busy)",
        elapsed.as_secs_f64() * 1e3,
        acked,
        busy.load(Ordering::Relaxed)
    );
    print_stats(&st);
    println!(
        "  application: {wakeups} wake-ups for {} messages",
        st.offloaded + st.passed_through
    );
    println!(
        "  order check: {} updates, acquisition no-op completion seen first for {} ({} violations)",
        check.updates_checked,
        check.updates_checked - check.violations,
        check.violations
    );
    println!("  records sum {records} = updates applied {acked}; locks still held: {held}");
    if check.violations != 0 || records != acked || held != 0 || st.failed != 0 {
        return Err("lock service check FAILED".into());
    }
    println!("OK");
    Ok(())
}

fn print_stats(st: &ProxyStats) {
    println!(
        "  proxy: {} offloaded, {} passed through, {} declined, {} failed, {} replies, {} completions held back for order, no-offload entries {}",
        st.offloaded,
        st.passed_through,
        st.declined,
        st.failed,
        st.replies_posted,
        st.reordered,
        st.no_offload_entries
    );
}

/// Who answers and how the application waits.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
struct Mode {
    proxy: Option<ProxyConfig>,
    wait: Wait,
}

struct BenchResult {
    rps: f64,
    median_us: f64,
    p99_us: f64,
    wakeups_per_req: f64,
}

fn bench_once(mode: Mode, requests: usize, depth: usize) -> Result<BenchResult, Error> {
    let dev = device()?;
    let mut server = Server::new(&dev, mode.proxy)?;
    let client = Client::new(&dev)?;
    server.accept(&client.qp)?;
    let server = Arc::new(server);
    let stop = Arc::new(AtomicBool::new(false));
    let srv = {
        let (server, stop) = (server.clone(), stop.clone());
        std::thread::spawn(move || -> Result<u64, String> {
            let mut c = OrderCheck::default();
            server
                .run(&stop, mode.wait, &mut c)
                .map_err(|e| e.to_string())
        })
    };
    // Acquire then release each lock in turn: every request succeeds.
    let req = |i: usize| {
        let key = (i % LOCKS) as u8;
        let op = if (i / LOCKS).is_multiple_of(2) {
            ACQUIRE
        } else {
            RELEASE
        };
        request(op, key, 1, 0)
    };
    let warm = 200.min(requests);
    let diag = |e: Error| -> Error {
        let (q, _) = &server.qps[0];
        let a = q.query();
        format!(
            "{e}; server QP {:?} sent {} B received {} B, server CQ holds {}",
            a.state,
            a.bytes_sent,
            a.bytes_received,
            server.cq.len()
        )
        .into()
    };
    for i in 0..warm {
        client.send(&req(i))?;
        client.reply().map_err(diag)?;
    }
    let mut lat = Vec::with_capacity(requests);
    let mut sent_at = std::collections::VecDeque::with_capacity(depth);
    let start = Instant::now();
    let mut sent = 0;
    let mut done = 0;
    while done < requests {
        while sent < requests && sent - done < depth {
            sent_at.push_back(Instant::now());
            client.send(&req(warm + sent))?;
            sent += 1;
        }
        let (status, _) = client.reply().map_err(diag)?;
        if status != GRANTED && status != OK {
            return Err(format!("request {done} refused: {}", status as char).into());
        }
        if let Some(t) = sent_at.pop_front() {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
        done += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Release);
    let wakeups = srv.join().map_err(|_| "server panicked")??;
    lat.sort_by(f64::total_cmp);
    let pct = |p: f64| lat[((lat.len() as f64 - 1.0) * p).round() as usize];
    Ok(BenchResult {
        rps: requests as f64 / elapsed,
        median_us: pct(0.5),
        p99_us: pct(0.99),
        wakeups_per_req: wakeups as f64 / (requests + warm) as f64,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn bench(args: &[String]) -> Result<(), Error> {
    let mut requests = 20_000usize;
    let mut runs = 5usize;
    let mut depths = vec![1usize, 16];
    let mut spin = Duration::from_micros(50);
    for pair in args.chunks(2) {
        let v = pair.get(1).ok_or("missing value")?;
        match pair[0].as_str() {
            "--requests" => requests = v.parse()?,
            "--runs" => runs = v.parse()?,
            "--depth" => depths = vec![v.parse()?],
            "--proxy-spin-us" => spin = Duration::from_micros(v.parse()?),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    println!(
        "lock service request/response on loopback: {requests} requests x {runs} runs (medians)\n"
    );
    println!(
        "{:<44} {:>5} {:>11} {:>10} {:>9} {:>12}",
        "served by", "depth", "requests/s", "median µs", "p99 µs", "app wake/req"
    );
    let spun = ProxyConfig::default().spin(spin);
    let modes = [
        (
            "application, woken by completion channel",
            None,
            Wait::Channel,
        ),
        ("application, busy-polling its CQ", None, Wait::Busy),
        (
            "proxy; app woken per completion",
            Some(ProxyConfig::default()),
            Wait::Channel,
        ),
        (
            "proxy; app drains no-ops every 1 ms",
            Some(ProxyConfig::default()),
            Wait::Every(Duration::from_millis(1)),
        ),
        (
            "proxy spinning; app drains every 1 ms",
            Some(spun),
            Wait::Every(Duration::from_millis(1)),
        ),
    ];
    for &depth in &depths {
        let mut base = None;
        for (name, proxy, wait) in modes {
            let mode = Mode { proxy, wait };
            let rs: Vec<BenchResult> = (0..runs)
                .map(|_| bench_once(mode, requests, depth))
                .collect::<Result<_, _>>()?;
            let rps = median(rs.iter().map(|r| r.rps).collect());
            let med = median(rs.iter().map(|r| r.median_us).collect());
            let p99 = median(rs.iter().map(|r| r.p99_us).collect());
            let wake = median(rs.iter().map(|r| r.wakeups_per_req).collect());
            let ratio = match base {
                Some(b) if proxy.is_some() => {
                    format!("  {:.2}x req/s of the channel-woken app", rps / b)
                }
                _ => String::new(),
            };
            if base.is_none() {
                base = Some(rps);
            }
            println!(
                "{name:<44} {depth:>5} {rps:>11.0} {med:>10.1} {p99:>9.1} {wake:>12.3}{ratio}"
            );
        }
    }
    Ok(())
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("demo") => demo(),
        Some("bench") => bench(&args[1..]),
        Some(other) => Err(format!("unknown command {other}; use demo or bench").into()),
    }
}
