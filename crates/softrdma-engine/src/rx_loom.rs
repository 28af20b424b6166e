//! Loom models of the receive path's two flags (`qp/core_path.rs`):
//!
//! * `core_rx_wanted`: a CQ poller that finds the socket readable but the
//!   connection's lock held (a poster transmits) leaves the bytes to the
//!   holder: it lets the receive lock go, sets the flag (SeqCst) and claims
//!   the connection like a poster (`core_kick`); whoever claims it next
//!   (`core_kick`, after the holder's release saw the announcement)
//!   receives if the flag is set and the receive lock is free. With a
//!   holder of the lock, a poster that sends directly and the poller, the
//!   model finds one interleaving that leaves the bytes on the socket
//!   ([`loom_a_claimer_that_read_its_own_announcement_can_miss_the_flag`]):
//!   the holder's release sees the poster's announcement and kicks; the
//!   poller sets the flag and announces; the holder announces too and
//!   claims, its clearing swap reading its own announcement (a plain
//!   store, which ends the release sequence of the poller's), so it
//!   synchronizes with nothing of the poller's and reads the flag still
//!   clear; the poller's claim fails (the holder has the lock), and the
//!   holder's release finds nothing announced (its swap cleared it). Loom
//!   treats SeqCst loads and stores as acquire/release, weaker than the
//!   language; on x86-64 (TSO) it cannot happen: the flag's store (an
//!   `xchg`) is visible before the poller's announcement, which the
//!   holder's locked swap orders after. An announcement made with a
//!   read-modify-write would continue the release sequence (one more
//!   locked instruction per post); left as it is.
//!   [`loom_flag_set_after_the_claim_strands_the_bytes`]: setting the flag
//!   after the poller's claim instead of before strands the bytes in
//!   plain interleavings too.
//! * `core_rx_sleeping`: a waiter that sleeps in the socket's `recv`
//!   (`core_rx_sleep`) holds the receive lock, sets the flag (a Release
//!   store, not SeqCst) and reads into the staging buffer taken out of the
//!   connection, without the connection's lock; a receive thread
//!   (`core_rx` blocking) backs off while it sees the flag and otherwise
//!   waits a timed try for the receive lock, looking again after each.
//!   [`loom_a_sleep_in_recv_and_a_receive_thread`]: the staging buffer is
//!   never touched by both (each use marks it taken, and finds it free), the
//!   flag is always cleared, and the bytes are received by one of them
//!   whichever way the flag's store becomes visible: the flag only keeps
//!   the receive thread from waiting, nothing depends on its ordering.
//!
//! The socket is a counter of bytes waiting (`readable_now`: a look at it;
//! a receive: a swap to 0; a system call in the real code, here a SeqCst
//! read-modify-write). The connection's lock is the real [`HandOff`]; the
//! receive lock a loom `Mutex`. Build with `RUSTFLAGS="--cfg loom"` (see
//! `.ci/run`).

use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;

use crate::handoff::HandOff;

/// The parts of a QP the receive path's flags involve.
struct Qp {
    /// `QpInner::core`: the connection behind the direct-send hand-off.
    core: HandOff<()>,
    /// Transmissions made under `core`.
    sent: AtomicUsize,
    /// `QpInner::rx`: who receives.
    rx: Mutex<()>,
    /// `QpInner::core_rx_wanted`.
    wanted: AtomicBool,
    /// `QpInner::core_rx_sleeping`.
    sleeping: AtomicBool,
    /// Bytes waiting on the socket.
    socket: AtomicUsize,
    /// Bytes received.
    received: AtomicUsize,
    /// The staging buffer a sleeper reads into: its fill, and whether a
    /// receiver uses it now.
    staging: AtomicUsize,
    staging_used: AtomicBool,
}

impl Qp {
    fn new(bytes: usize) -> Arc<Qp> {
        Arc::new(Qp {
            core: HandOff::new(()),
            sent: AtomicUsize::new(0),
            rx: Mutex::new(()),
            wanted: AtomicBool::new(false),
            sleeping: AtomicBool::new(false),
            socket: AtomicUsize::new(bytes),
            received: AtomicUsize::new(0),
            staging: AtomicUsize::new(0),
            staging_used: AtomicBool::new(false),
        })
    }

    /// Uses the staging buffer: `f` on its fill, with a check that
    /// nobody else uses it meanwhile (a scheduling point in between).
    fn with_staging(&self, f: impl FnOnce(usize) -> usize) {
        assert!(
            !self.staging_used.swap(true, Ordering::SeqCst),
            "two receivers use the staging buffer"
        );
        let fill = self.staging.load(Ordering::Relaxed);
        self.staging.store(f(fill), Ordering::Relaxed);
        self.staging_used.store(false, Ordering::SeqCst);
    }

    /// The receive run (`core_rx_locked`), receive lock and connection
    /// held: what was staged and what the socket has.
    fn receive_locked(&self) {
        self.with_staging(|staged| {
            let n = self.socket.swap(0, Ordering::SeqCst);
            self.received.fetch_add(staged + n, Ordering::SeqCst);
            0
        });
    }

    /// `core_kick`: claim the connection if free, receive what a poller
    /// left (the flag, and the receive lock free), transmit, and go again
    /// while the release finds work announced.
    fn kick(&self) {
        self.core.announce();
        loop {
            let Some(g) = self.core.try_claim() else {
                return;
            };
            if self.wanted.load(Ordering::SeqCst)
                && let Ok(receiving) = self.rx.try_lock()
            {
                self.wanted.store(false, Ordering::SeqCst);
                self.receive_locked();
                drop(receiving);
            }
            // Transmit what was posted.
            self.sent.fetch_add(1, Ordering::Relaxed);
            if !self.core.release(g) {
                return;
            }
        }
    }

    /// A holder of the connection's lock (taken blocking, as `lock_core`:
    /// a post, the datamover's slice), which transmits and then acts on
    /// the release's answer (`CoreGuard`).
    fn hold(&self) {
        let g = self.core.lock();
        self.sent.fetch_add(1, Ordering::Relaxed);
        // Real holders are preempted anywhere (as the hand-off's own
        // models' reader).
        thread::yield_now();
        if self.core.release(g) {
            self.kick();
        }
    }

    /// `core_rx(false)`, a CQ poller's receive; `flag_first`: the flag is
    /// set before the poller claims the connection (the real order).
    fn poll_receive(&self, flag_first: bool) {
        let Ok(receiving) = self.rx.try_lock() else {
            return;
        };
        if self.socket.load(Ordering::SeqCst) == 0 {
            return;
        }
        match self.core.try_claim() {
            Some(g) => {
                self.wanted.store(false, Ordering::SeqCst);
                self.receive_locked();
                drop(receiving);
                if self.core.release(g) {
                    self.kick();
                }
            }
            None => {
                drop(receiving);
                if flag_first {
                    self.wanted.store(true, Ordering::SeqCst);
                    self.kick();
                } else {
                    self.kick();
                    self.wanted.store(true, Ordering::SeqCst);
                }
            }
        }
    }
}

/// A holder of the connection (a post, the datamover), a poster that
/// sends directly (`core_kick`), and a CQ poller that finds bytes on the
/// socket (`flag_first` as in [`Qp::poll_receive`]): the bytes must be
/// received, in every interleaving.
fn left_to_the_holder(flag_first: bool) {
    // Three preemptions: the stranding the negative twin shows takes
    // three (the holder takes the lock, the poster fails to claim, the
    // poller is stopped between its claim and the flag).
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(move || {
        let qp = Qp::new(1);
        let holder = {
            let qp = qp.clone();
            thread::spawn(move || qp.hold())
        };
        let poster = {
            let qp = qp.clone();
            thread::spawn(move || qp.kick())
        };
        let poller = {
            let qp = qp.clone();
            thread::spawn(move || qp.poll_receive(flag_first))
        };
        holder.join().unwrap();
        poster.join().unwrap();
        poller.join().unwrap();
        assert_eq!(
            qp.received.load(Ordering::SeqCst),
            1,
            "bytes left on the socket"
        );
    });
}

/// See the module's documentation: a finding of the model, kept as one.
#[test]
#[should_panic(expected = "bytes left on the socket")]
fn loom_a_claimer_that_read_its_own_announcement_can_miss_the_flag() {
    left_to_the_holder(true);
}

#[test]
#[should_panic(expected = "bytes left on the socket")]
fn loom_flag_set_after_the_claim_strands_the_bytes() {
    left_to_the_holder(false);
}

#[test]
fn loom_a_sleep_in_recv_and_a_receive_thread() {
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(3);
    model.check(|| {
        let qp = Qp::new(0);
        // The peer's message comes, and wakes the receive thread
        // (`core_rx(true)`): it backs off while a sleeper has the socket,
        // else waits for the receive lock (a timed try: looked at again
        // after each).
        let receiver = {
            let qp = qp.clone();
            thread::spawn(move || {
                qp.socket.fetch_add(1, Ordering::SeqCst);
                loop {
                    if qp.sleeping.load(Ordering::SeqCst) {
                        // Back off; looked at again later (the engine
                        // thread's retry, or its next readiness).
                        thread::yield_now();
                        continue;
                    }
                    if let Ok(receiving) = qp.rx.try_lock() {
                        let g = qp.core.lock();
                        qp.receive_locked();
                        drop(receiving);
                        let _ = qp.core.release(g);
                        return;
                    }
                    thread::yield_now();
                }
            })
        };
        // The waiter: one sleep in `recv` (it gets what is there, or times
        // out with nothing), then the receive run on what came.
        if let Ok(receiving) = qp.rx.try_lock() {
            qp.sleeping.store(true, Ordering::Release);
            // The staging buffer taken out under the connection's lock,
            // filled without it.
            let g = qp.core.lock();
            let _ = qp.core.release(g);
            qp.with_staging(|fill| fill + qp.socket.swap(0, Ordering::SeqCst));
            let g = qp.core.lock();
            qp.receive_locked();
            qp.sleeping.store(false, Ordering::Release);
            drop(receiving);
            let _ = qp.core.release(g);
        }
        receiver.join().unwrap();
        assert!(!qp.sleeping.load(Ordering::SeqCst), "the flag stays set");
        // Received by the sleeper or by the receive thread, which ran
        // after they came.
        assert_eq!(qp.received.load(Ordering::SeqCst), 1);
    });
}
