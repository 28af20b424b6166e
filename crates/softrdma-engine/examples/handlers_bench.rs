//! Completion processing with callbacks on the per-CPU completion event
//! handlers: throughput with 1 handler vs all handlers, and the latency
//! callback delivery adds to busy polling.
//!
//! ```text
//! cargo run --release -p softrdma-engine --example handlers_bench [-- --runs 5 --per-cq 100000 --work-ns 1000]
//! ```
//!
//! Throughput: two CQs (one per QP of a loopback pair) are filled with
//! `per-cq` Write completions while unarmed, then armed and given one more
//! completion each; their callbacks drain them (the verbs way, with
//! `drain_and_arm`) doing `work-ns` of computation per completion. With one
//! handler both callbacks run on the same thread; with all handlers the CQs
//! are bound to different handlers. The time from arming to the last
//! completion processed gives completions per second; the scaling factor is
//! the median of per-run ratios.
//!
//! Latency: one signaled inline Write at a time; the time from posting it
//! until the application sees its completion, by busy polling the CQ in the
//! posting thread vs by a callback on a handler thread (the posting thread
//! spins on a flag the callback sets). The difference of the medians is
//! what callback delivery adds (the hand-off to the handler thread and its
//! wake-up), with the handler sleeping at once (`handler_spin` 0) and
//! spinning 50 µs before it sleeps.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use softrdma_engine::handlers::{Binding, HandlerId};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, QpInitAttr, QueuePair, SendOp,
    SendWr, WcStatus,
};

type Error = Box<dyn std::error::Error>;

struct Args {
    runs: usize,
    per_cq: u64,
    work_ns: u64,
    samples: usize,
}

fn args() -> Args {
    let mut a = Args {
        runs: 5,
        per_cq: 100_000,
        work_ns: 1000,
        samples: 20_000,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    for pair in v.chunks(2) {
        let n = pair.get(1).and_then(|s| s.parse().ok());
        match (pair[0].as_str(), n) {
            ("--runs", Some(n)) => a.runs = n as usize,
            ("--per-cq", Some(n)) => a.per_cq = n,
            ("--work-ns", Some(n)) => a.work_ns = n,
            ("--samples", Some(n)) => a.samples = n as usize,
            _ => {
                eprintln!(
                    "usage: handlers_bench [--runs N] [--per-cq N] [--work-ns N] [--samples N]"
                );
                std::process::exit(2);
            }
        }
    }
    a
}

/// Fixed work: `iters` rounds of a multiply-xorshift mix.
fn work(iters: u64, seed: u64) -> u64 {
    let mut x = seed | 1;
    for _ in 0..iters {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x = x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    black_box(x)
}

/// Iterations of [`work`] that take about `ns` nanoseconds.
fn calibrate(ns: u64) -> u64 {
    let iters = 1_000_000;
    let t = Instant::now();
    work(iters, 1);
    let per = t.elapsed().as_nanos() as f64 / iters as f64;
    ((ns as f64 / per) as u64).max(1)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p) as usize]
}

fn write_wr(id: u64, dst: &MemoryRegion) -> SendWr<'static> {
    SendWr::new(
        id,
        SendOp::Write {
            remote_addr: dst.addr(),
            rkey: dst.rkey(),
        },
    )
    .inline(b"12345678")
    .signaled()
}

/// Posts `n` signaled Writes, waiting for send-queue room.
fn post_n(qp: &QueuePair, dst: &MemoryRegion, n: u64) {
    let mut i = 0;
    while i < n {
        if qp.post_send(&write_wr(i, dst)).is_ok() {
            i += 1;
        } else {
            std::thread::yield_now();
        }
    }
}

/// State shared by the throughput callbacks of one run.
struct Run {
    processed: AtomicU64,
    total: u64,
    iters: u64,
    done: std::sync::Mutex<Option<mpsc::Sender<Instant>>>,
}

/// One throughput setup: a device, two CQs with callbacks bound to one
/// handler or to two, a connected QP pair filling them.
struct Throughput {
    _dev: Device,
    dst: MemoryRegion,
    slot: Arc<std::sync::Mutex<Option<Arc<Run>>>>,
    cqs: [CompletionQueue; 2],
    qps: [QueuePair; 2],
    per_cq: u64,
    iters: u64,
}

fn throughput(handlers: usize, a: &Args, iters: u64) -> Result<Throughput, Error> {
    let mut cfg = DeviceConfig::default();
    cfg.pin_threads = true;
    let dev = Device::open_with(cfg)?;
    let n_handlers = dev.handler_table().len();
    let pd = dev.alloc_pd();
    let dst = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let slot: Arc<std::sync::Mutex<Option<Arc<Run>>>> = Arc::default();
    let make_cq = |h: usize| {
        let slot = Arc::clone(&slot);
        CompletionQueue::builder(&dev, a.per_cq as usize + 64)
            .binding(Binding::Handler(HandlerId::new(h)))
            .callback(move |cq: &CompletionQueue| {
                let Some(run) = slot.lock().unwrap().clone() else {
                    return;
                };
                let n = cq.drain_and_arm(false, |wc| {
                    debug_assert_eq!(wc.status, WcStatus::Success);
                    work(run.iters, wc.wr_id);
                });
                let before = run.processed.fetch_add(n as u64, Ordering::AcqRel);
                if before + n as u64 == run.total
                    && let Some(tx) = run.done.lock().unwrap().take()
                {
                    let _ = tx.send(Instant::now());
                }
            })
            .build()
    };
    let cq0 = make_cq(0)?;
    let cq1 = make_cq(if handlers == 1 { 0 } else { 1 % n_handlers })?;
    let rcq = dev.create_cq(64)?;
    let mut attr0 = QpInitAttr::new(&cq0, &rcq);
    attr0.cap.max_send_wr = 1024;
    let mut attr1 = QpInitAttr::new(&cq1, &rcq);
    attr1.cap.max_send_wr = 1024;
    let q0 = QueuePair::new(&pd, &attr0)?;
    let q1 = QueuePair::new(&pd, &attr1)?;
    connect_pair(&q0, &q1, &MpaConfig::default())?;
    Ok(Throughput {
        _dev: dev,
        dst,
        slot,
        cqs: [cq0, cq1],
        qps: [q0, q1],
        per_cq: a.per_cq,
        iters,
    })
}

impl Throughput {
    /// Completions per second of one run.
    fn run(&self) -> Result<f64, Error> {
        let [cq0, cq1] = &self.cqs;
        let [q0, q1] = &self.qps;
        let (dst, slot, iters) = (&self.dst, &self.slot, self.iters);
        post_n(q0, dst, self.per_cq);
        post_n(q1, dst, self.per_cq);
        while cq0.len() < self.per_cq as usize || cq1.len() < self.per_cq as usize {
            std::thread::sleep(Duration::from_millis(1));
        }
        let total = 2 * (self.per_cq + 1);
        let (tx, rx) = mpsc::channel();
        *slot.lock().unwrap() = Some(Arc::new(Run {
            processed: AtomicU64::new(0),
            total,
            iters,
            done: std::sync::Mutex::new(Some(tx)),
        }));
        std::thread::sleep(Duration::from_millis(20));
        let start = Instant::now();
        cq0.req_notify(false)?;
        cq1.req_notify(false)?;
        q0.post_send(&write_wr(u64::MAX, dst))?;
        q1.post_send(&write_wr(u64::MAX, dst))?;
        let end = rx.recv_timeout(Duration::from_secs(120))?;
        *slot.lock().unwrap() = None;
        Ok(total as f64 / end.duration_since(start).as_secs_f64())
    }
}

/// Median, p99 of post → completion seen, in µs: by busy polling
/// (`spin == None`) or by a callback.
fn latency(a: &Args, spin: Option<Duration>) -> Result<(f64, f64), Error> {
    let mut cfg = DeviceConfig::default();
    cfg.pin_threads = true;
    cfg.handler_spin = spin.unwrap_or(Duration::ZERO);
    let dev = Device::open_with(cfg)?;
    let pd = dev.alloc_pd();
    let dst = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let seen = Arc::new(AtomicBool::new(false));
    let last = dev.handler_table().len() - 1;
    let cq = match spin {
        None => dev.create_cq(64)?,
        Some(_) => {
            let seen = Arc::clone(&seen);
            CompletionQueue::builder(&dev, 64)
                .binding(Binding::Handler(HandlerId::new(last)))
                .callback(move |cq: &CompletionQueue| {
                    if cq.drain_and_arm(false, |_| {}) > 0 {
                        seen.store(true, Ordering::Release);
                    }
                })
                .build()?
        }
    };
    let rcq = dev.create_cq(64)?;
    let q0 = QueuePair::new(&pd, &QpInitAttr::new(&cq, &rcq))?;
    let q1 = QueuePair::new(&pd, &QpInitAttr::new(&rcq, &rcq))?;
    connect_pair(&q0, &q1, &MpaConfig::default())?;
    if spin.is_some() {
        cq.req_notify(false)?;
    }
    let mut lat = Vec::with_capacity(a.samples);
    for i in 0..a.samples + a.samples / 10 {
        // Let the handler fall asleep between samples, as between bursts.
        if i % 2 == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
        let t = Instant::now();
        q0.post_send(&write_wr(i as u64, &dst))?;
        match spin {
            None => while cq.poll_one().is_none() {},
            Some(_) => {
                while !seen.swap(false, Ordering::Acquire) {
                    std::hint::spin_loop();
                }
            }
        }
        let us = t.elapsed().as_secs_f64() * 1e6;
        if i >= a.samples / 10 {
            lat.push(us);
        }
    }
    let p99 = percentile(&mut lat, 0.99);
    Ok((median(&mut lat), p99))
}

fn main() -> Result<(), Error> {
    let a = args();
    let cpus = Device::open_default()?.handler_table().len();
    let iters = calibrate(a.work_ns);
    let t = Instant::now();
    for i in 0..10_000 {
        work(iters, i);
    }
    let work_ns = t.elapsed().as_nanos() as f64 / 10_000.0;
    println!(
        "completion handlers: {cpus} (one per CPU); work per completion {work_ns:.0} ns; \
         {} completions per CQ, 2 CQs, {} runs",
        a.per_cq, a.runs
    );
    // Alternate the two setups so that both see the same background load.
    let (one_t, all_t) = (throughput(1, &a, iters)?, throughput(cpus, &a, iters)?);
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for _ in 0..a.runs {
        one.push(one_t.run()?);
        all.push(all_t.run()?);
    }
    let mut ratios: Vec<f64> = one.iter().zip(&all).map(|(o, x)| x / o).collect();
    let (mut one_s, mut all_s) = (one.clone(), all.clone());
    println!(
        "throughput, 1 handler:      median {:>8.0} completions/s  (runs: {})",
        median(&mut one_s),
        one.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "throughput, {cpus} handlers:     median {:>8.0} completions/s  (runs: {})",
        median(&mut all_s),
        all.iter()
            .map(|r| format!("{r:.0}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "scaling factor {cpus} handlers / 1 handler: median {:.2}x (runs: {})",
        median(&mut ratios),
        ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut polls = Vec::new();
    let mut cbs = Vec::new();
    let mut spins = Vec::new();
    for _ in 0..a.runs {
        polls.push(latency(&a, None)?);
        cbs.push(latency(&a, Some(Duration::ZERO))?);
        spins.push(latency(&a, Some(Duration::from_micros(50)))?);
    }
    let med = |v: &[(f64, f64)], p99: bool| {
        let mut x: Vec<f64> = v.iter().map(|s| if p99 { s.1 } else { s.0 }).collect();
        median(&mut x)
    };
    let (poll, cb, spin) = (med(&polls, false), med(&cbs, false), med(&spins, false));
    println!(
        "latency post -> completion seen (median of {} run medians; p99 in brackets):",
        a.runs
    );
    println!(
        "  busy polling:                     {poll:>7.2} us  [{:.2}]",
        med(&polls, true)
    );
    println!(
        "  callback, handler sleeps:         {cb:>7.2} us  [{:.2}]  added {:+.2} us",
        med(&cbs, true),
        cb - poll
    );
    println!(
        "  callback, handler spins 50 us:    {spin:>7.2} us  [{:.2}]  added {:+.2} us",
        med(&spins, true),
        spin - poll
    );
    Ok(())
}
