//! Datamovers (one transmit thread per CPU) and receive threads.
//!
//! A datamover keeps a list of *active* QPs (work ready, socket writable) and
//! a set of *paused* QPs (socket full). It serves active QPs round robin, one
//! slice of [`DeviceConfig::slice_size`](crate::DeviceConfig::slice_size)
//! bytes each per turn, so one large transfer or one congested peer never
//! starves the others. A QP that is the only active one gets turns of 64
//! slices (fewer, larger writes; new QPs join the round at the next turn). A QP whose socket would block is paused: its socket
//! is armed for writability, and the kernel reports it only once the socket
//! has a useful amount of free space (for TCP, at least a third of the send
//! buffer — the resume threshold that avoids unproductive wake-ups); then
//! the QP becomes active again.
//!
//! Each QP is assigned at creation to the datamover with the fewest QPs, and
//! to the receive thread of the same index, which reads its socket whenever
//! it is readable and no CQ poller is already doing so.

use std::collections::{HashMap, VecDeque};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crossbeam_queue::SegQueue;
use parking_lot::Mutex;
use polling::Events;

use crate::device::DeviceConfig;
use crate::qp::QpInner;
use crate::sys::io::{pin_current_thread, spawn_engine_thread, usable_cpus};
use crate::sys::poll::{Interest, Reactor};
use crate::tx::TxOutcome;

/// Statistics of one datamover.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DatamoverStats {
    /// CPU the thread runs on (pinned if configured).
    pub cpu: usize,
    /// QPs assigned.
    pub qps: usize,
    /// Slices served.
    pub slices: u64,
    /// Times a QP was paused because its socket was full.
    pub pauses: u64,
    /// Times a paused QP was resumed.
    pub resumes: u64,
}

#[derive(Debug)]
struct Datamover {
    cpu: usize,
    load: AtomicUsize,
    inbox: SegQueue<Arc<QpInner>>,
    reactor: Reactor,
    stop: AtomicBool,
    slices: AtomicU64,
    pauses: AtomicU64,
    resumes: AtomicU64,
}

#[derive(Debug)]
struct RxThread {
    reactor: Reactor,
    qps: Mutex<HashMap<usize, (Weak<QpInner>, RawFd)>>,
    stop: AtomicBool,
}

/// The threads of a device.
#[derive(Debug)]
pub(crate) struct Threads {
    dms: Vec<Arc<Datamover>>,
    rxs: Vec<Arc<RxThread>>,
}

impl Threads {
    /// Starts the threads for `config`.
    pub(crate) fn start(config: &DeviceConfig) -> std::io::Result<Threads> {
        let cpus = if config.datamover_cpus.is_empty() {
            usable_cpus()
        } else {
            config.datamover_cpus.clone()
        };
        let mut dms = Vec::new();
        let mut rxs = Vec::new();
        for (i, &cpu) in cpus.iter().enumerate() {
            let dm = Arc::new(Datamover {
                cpu,
                load: AtomicUsize::new(0),
                inbox: SegQueue::new(),
                reactor: Reactor::new()?,
                stop: AtomicBool::new(false),
                slices: AtomicU64::new(0),
                pauses: AtomicU64::new(0),
                resumes: AtomicU64::new(0),
            });
            let rx = Arc::new(RxThread {
                reactor: Reactor::new()?,
                qps: Mutex::new(HashMap::new()),
                stop: AtomicBool::new(false),
            });
            let slice = config.slice_size;
            let pin = config.pin_threads;
            {
                let dm = dm.clone();
                spawn_engine_thread(format!("softrdma-dm{i}"), move || {
                    run_datamover(&dm, slice, pin);
                })?;
            }
            {
                let rx = rx.clone();
                spawn_engine_thread(format!("softrdma-rx{i}"), move || run_rx(&rx, cpu, pin))?;
            }
            dms.push(dm);
            rxs.push(rx);
        }
        Ok(Threads { dms, rxs })
    }

    /// Assigns a new QP to the least-loaded datamover.
    pub(crate) fn assign(&self) -> usize {
        let (idx, dm) = self
            .dms
            .iter()
            .enumerate()
            .min_by_key(|(_, d)| d.load.load(Ordering::Relaxed))
            .unwrap_or((0, &self.dms[0]));
        dm.load.fetch_add(1, Ordering::Relaxed);
        idx
    }

    /// A QP assigned to `idx` is gone.
    pub(crate) fn release(&self, idx: usize) {
        if let Some(d) = self.dms.get(idx) {
            let _ = d
                .load
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        }
    }

    /// Hands a QP with work to its datamover (no-op if already listed).
    pub(crate) fn schedule(&self, qp: &Arc<QpInner>) {
        if qp.dm_listed.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(d) = self.dms.get(qp.datamover) {
            d.inbox.push(qp.clone());
            d.reactor.notify();
        }
    }

    /// Starts watching a connected QP's socket for incoming bytes.
    pub(crate) fn register_rx(&self, qp: &Arc<QpInner>, fd: RawFd) {
        let Some(rx) = self.rxs.get(qp.datamover) else {
            return;
        };
        let key = qp.qp_num as usize;
        rx.qps.lock().insert(key, (Arc::downgrade(qp), fd));
        qp.rx_registered.store(true, Ordering::Release);
        let _ = rx.reactor.arm(fd, key, Interest::Read);
    }

    /// The socket of a connected QP, for a CQ waiter that sleeps on it
    /// until `until_ns` (on the [`now_ns`] clock): meanwhile the receive
    /// thread leaves the socket to the waiter (two threads woken by the
    /// same bytes would fight for the receive lock). `None`: the waiter is
    /// awake again and polls (the usual quiet period applies).
    pub(crate) fn claim_rx(&self, qp: &QpInner, until_ns: Option<u64>) -> Option<RawFd> {
        // A QP that no longer receives (closed, in error) may have a socket
        // at end of file: always readable, it would wake the waiter at once,
        // again and again.
        if !qp.rx_registered.load(Ordering::Acquire)
            || !matches!(
                qp.state(),
                crate::state::QpState::Rts | crate::state::QpState::Closing
            )
        {
            return None;
        }
        let rx = self.rxs.get(qp.datamover)?;
        let fd = rx
            .qps
            .lock()
            .get(&(qp.qp_num as usize))
            .map(|(_, fd)| *fd)?;
        qp.last_poll
            .store(until_ns.unwrap_or_else(now_ns), Ordering::Relaxed);
        Some(fd)
    }

    /// Wakes receive thread `idx` so it re-checks the QPs it left to CQ
    /// pollers.
    pub(crate) fn wake_rx(&self, idx: usize) {
        if let Some(rx) = self.rxs.get(idx) {
            rx.reactor.notify();
        }
    }

    /// Stops watching a QP's socket.
    pub(crate) fn unregister(&self, qp: &QpInner) {
        if !qp.rx_registered.swap(false, Ordering::AcqRel) {
            return;
        }
        let Some(rx) = self.rxs.get(qp.datamover) else {
            return;
        };
        let entry = rx.qps.lock().remove(&(qp.qp_num as usize));
        if let Some((_, fd)) = entry {
            rx.reactor.remove(fd);
        }
    }

    /// Statistics of every datamover.
    pub(crate) fn stats(&self) -> Vec<DatamoverStats> {
        self.dms
            .iter()
            .map(|d| DatamoverStats {
                cpu: d.cpu,
                qps: d.load.load(Ordering::Relaxed),
                slices: d.slices.load(Ordering::Relaxed),
                pauses: d.pauses.load(Ordering::Relaxed),
                resumes: d.resumes.load(Ordering::Relaxed),
            })
            .collect()
    }
}

impl Drop for Threads {
    fn drop(&mut self) {
        for d in &self.dms {
            d.stop.store(true, Ordering::Release);
            d.reactor.notify();
        }
        for r in &self.rxs {
            r.stop.store(true, Ordering::Release);
            r.reactor.notify();
        }
    }
}

/// What serving a QP for one slice left it as.
enum Served {
    /// More work, socket writable: stays active.
    Active,
    /// Socket full: pause until writable.
    Paused(RawFd),
    /// Nothing left: leaves the lists.
    Done,
}

fn serve(qp: &Arc<QpInner>, slice: usize) -> Served {
    let mut tx = qp.lock_tx();
    qp.drain_incoming(&mut tx);
    let outcome = tx.progress(&**qp, slice);
    // Acted on only once the FPDUs framed before the failed request are
    // written (Idle); until then it stays set.
    let fatal = if matches!(outcome, TxOutcome::Idle) {
        tx.fatal.take()
    } else {
        None
    };
    let fd = tx.link.map(|l| l.fd);
    match outcome {
        TxOutcome::Budget => Served::Active,
        TxOutcome::WouldBlock => match fd {
            Some(fd) => Served::Paused(fd),
            None => Served::Done,
        },
        TxOutcome::FinSent => {
            tx.on_dm = false;
            qp.dm_listed.store(false, Ordering::Release);
            drop(tx);
            qp.fin_sent();
            Served::Done
        }
        TxOutcome::Idle | TxOutcome::Failed(_) => {
            tx.on_dm = false;
            qp.dm_listed.store(false, Ordering::Release);
            drop(tx);
            if let TxOutcome::Failed(e) = outcome {
                qp.link_failed(&e);
            } else if fatal.is_some() {
                qp.enter_error(None, Some(crate::event::AsyncEventKind::QpFatal));
            } else {
                // Work posted while we held the lock.
                qp.kick();
            }
            Served::Done
        }
    }
}

/// Slices one turn may take when its QP is the only active one.
const ALONE_SLICES: usize = 64;

fn run_datamover(dm: &Datamover, slice: usize, pin: bool) {
    if pin {
        let _ = pin_current_thread(dm.cpu);
    }
    let mut active: VecDeque<Arc<QpInner>> = VecDeque::new();
    let mut paused: HashMap<usize, Arc<QpInner>> = HashMap::new();
    let mut events = Events::new();
    let mut keys = Vec::new();
    while !dm.stop.load(Ordering::Acquire) {
        while let Some(qp) = dm.inbox.pop() {
            active.push_back(qp);
        }
        let timeout = if active.is_empty() {
            Some(Duration::from_millis(500))
        } else if paused.is_empty() {
            None
        } else {
            Some(Duration::ZERO)
        };
        if active.is_empty() || !paused.is_empty() {
            keys.clear();
            let _ = dm.reactor.wait(&mut events, &mut keys, timeout);
            for k in &keys {
                if let Some(qp) = paused.remove(k) {
                    dm.resumes.fetch_add(1, Ordering::Relaxed);
                    tracing::trace!(qp = qp.qp_num, "datamover resumes a QP (socket writable)");
                    active.push_back(qp);
                }
            }
            if active.is_empty() {
                continue;
            }
        }
        // Alone, a QP has no one to be fair to: it gets a longer turn (fewer,
        // larger writes), and the inbox is still checked every turn.
        let budget = if active.len() == 1 {
            slice.saturating_mul(ALONE_SLICES)
        } else {
            slice
        };
        for _ in 0..active.len() {
            let Some(qp) = active.pop_front() else { break };
            dm.slices.fetch_add(1, Ordering::Relaxed);
            match serve(&qp, budget) {
                Served::Active => active.push_back(qp),
                Served::Paused(fd) => {
                    let key = qp.qp_num as usize;
                    if dm.reactor.arm(fd, key, Interest::Write).is_ok() {
                        dm.pauses.fetch_add(1, Ordering::Relaxed);
                        tracing::trace!(qp = qp.qp_num, "datamover pauses a QP (socket full)");
                        paused.insert(key, qp);
                    } else {
                        active.push_back(qp);
                    }
                }
                Served::Done => {}
            }
        }
    }
}

/// Nanoseconds since the engine's clock started.
pub(crate) fn now_ns() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(crate::sys::clock::now);
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A QP whose CQ was polled this recently is left to the poller: its
/// socket is not watched, so the sender does not pay for waking this thread.
const POLL_QUIET_NS: u64 = 1_000_000;

fn run_rx(rx: &RxThread, cpu: usize, pin: bool) {
    if pin {
        let _ = pin_current_thread(cpu);
    }
    let mut events = Events::new();
    let mut keys = Vec::new();
    // QPs being driven by CQ polling: (key, fd, qp), re-armed once polling
    // stops.
    let mut deferred: Vec<(usize, RawFd, Weak<QpInner>)> = Vec::new();
    while !rx.stop.load(Ordering::Acquire) {
        keys.clear();
        let timeout = if deferred.is_empty() {
            Duration::from_millis(500)
        } else {
            Duration::from_micros(POLL_QUIET_NS / 1000)
        };
        if rx
            .reactor
            .wait(&mut events, &mut keys, Some(timeout))
            .is_err()
        {
            continue;
        }
        let now = now_ns();
        deferred.retain(|(k, fd, weak)| {
            let Some(qp) = weak.upgrade() else {
                return false;
            };
            if now.saturating_sub(qp.last_poll.load(Ordering::Relaxed)) < POLL_QUIET_NS {
                return true;
            }
            if rx.qps.lock().contains_key(k) {
                let _ = rx.reactor.arm(*fd, *k, Interest::Read);
            }
            false
        });
        for &k in &keys {
            let entry = rx.qps.lock().get(&k).map(|(w, fd)| (w.clone(), *fd));
            let Some((weak, fd)) = entry else { continue };
            let Some(qp) = weak.upgrade() else {
                rx.qps.lock().remove(&k);
                continue;
            };
            if qp.rx_thread_progress() {
                let polled = qp.last_poll.load(Ordering::Relaxed);
                if now_ns().saturating_sub(polled) < POLL_QUIET_NS {
                    deferred.push((k, fd, weak));
                } else {
                    let _ = rx.reactor.arm(fd, k, Interest::Read);
                }
            } else {
                let removed = rx.qps.lock().remove(&k);
                if removed.is_some() {
                    rx.reactor.remove(fd);
                }
            }
        }
    }
}
