//! Loom models of the completion queue's wake-up rule (`docs/engine.md`,
//! "Lost completion wake-ups"): a push against `req_notify` followed by a
//! poll, and a push against a sleeping `wait`; and the per-waiter waker
//! (`sys::fd::Waker`) that lets a waiter sleep with no timer: one write per
//! sleep however many completions come, and never a sleep through one
//! ([`loom_waker_read_then_clear_never_loses_the_wakeup`] and its negative
//! twin). Build with `RUSTFLAGS="--cfg loom"` (see `.ci/run`).
//!
//! The CQ's ring is a `crossbeam_queue::ArrayQueue`, which loom cannot
//! instrument, and the CQ's atomics are `std` ones; so this is a stand-in
//! with the same atomic operations in the same order as the real code:
//!
//! * [`Ring`]: `ArrayQueue::push` (`tail` CAS SeqCst, then the slot's
//!   `stamp` Release store) and `ArrayQueue::pop` (`stamp` Acquire load; on
//!   an empty slot a SeqCst fence and a Relaxed `tail` load), for one slot
//!   of a ring of capacity 2 (crossbeam-queue 0.3, `array_queue.rs`,
//!   `push_or_else` and `pop`).
//! * [`Cq::push`]: `CompletionQueue::push` in `cq.rs` after the ring push:
//!   the SeqCst fence, the `arm` load, the `sleepers` check that signals
//!   `wake`, and the `arm` compare-exchange that raises one event.
//! * [`Cq::req_notify`]: `CompletionQueue::req_notify`: the `arm`
//!   `fetch_max` and the SeqCst fence.
//! * [`Ring::poll`]: `CompletionQueue::poll_ring`, a look at the ring
//!   (`ArrayQueue::is_empty`, SeqCst loads of `head` and `tail`) before
//!   each pop, so that a poll of an empty ring does not reach `pop`'s
//!   fence: the consumer's polls around `req_notify` are made so.
//! * [`Cq::sleep`]: the sleeping step of `CompletionQueue::wait`
//!   (`sleep_loop`): `sleepers` incremented, one look at the ring.
//!
//! Loom treats SeqCst loads, stores and read-modify-writes as
//! Acquire/Release (weaker than the language's rules) but models SeqCst
//! fences; so in this model the CQ's own fences carry the protocol, as
//! `cq.rs` intends, rather than the ring's internal `tail` CAS and fence.
//! [`loom_cq_without_fences_loses_the_wakeup`] shows the model finds the
//! lost wake-up once the fences are taken out.

use loom::sync::Arc;
use loom::sync::atomic::{AtomicU8, AtomicU32, AtomicUsize, Ordering, fence};
use loom::thread;

/// `cq.rs`: not armed.
const ARM_NONE: u8 = 0;
/// `cq.rs`: armed for a solicited receive completion or any error
/// completion.
const ARM_SOLICITED: u8 = 1;
/// `cq.rs`: armed for the next completion of any kind.
const ARM_NEXT: u8 = 2;

/// One slot of an `ArrayQueue` of capacity 2 (index 0, lap 0): `tail` and
/// `head` start at 0, the slot's stamp at its index (0); a push makes the
/// stamp `tail + 1`.
struct Ring {
    head: AtomicUsize,
    tail: AtomicUsize,
    stamp: AtomicUsize,
}

impl Ring {
    fn new() -> Self {
        Ring {
            head: AtomicUsize::new(0),
            tail: AtomicUsize::new(0),
            stamp: AtomicUsize::new(0),
        }
    }

    /// `ArrayQueue::push` into the empty slot 0.
    fn push(&self) {
        let tail = self.tail.load(Ordering::Relaxed);
        let stamp = self.stamp.load(Ordering::Acquire);
        assert_eq!(tail, stamp, "one push into an empty ring");
        self.tail
            .compare_exchange(tail, tail + 1, Ordering::SeqCst, Ordering::Relaxed)
            .expect("the only producer");
        // (the value is written into the slot here)
        self.stamp.store(tail + 1, Ordering::Release);
    }

    /// `ArrayQueue::is_empty`: `head`, then `tail`, both SeqCst loads.
    fn is_empty(&self) -> bool {
        let head = self.head.load(Ordering::SeqCst);
        let tail = self.tail.load(Ordering::SeqCst);
        head == tail
    }

    /// `CompletionQueue::poll_ring` for one completion: a look first, and
    /// a pop only if the look found the ring not empty (a look that finds
    /// it empty ends the poll without `pop`'s fence).
    fn poll(&self) -> bool {
        !self.is_empty() && self.pop()
    }

    /// `ArrayQueue::pop`: whether a completion was taken.
    fn pop(&self) -> bool {
        let mut head = self.head.load(Ordering::Relaxed);
        loop {
            let stamp = self.stamp.load(Ordering::Acquire);
            if head + 1 == stamp {
                match self.head.compare_exchange(
                    head,
                    head + 1,
                    Ordering::SeqCst,
                    Ordering::Relaxed,
                ) {
                    // (the value is read and the stamp moved a lap on;
                    // no second push comes in these models)
                    Ok(_) => return true,
                    Err(h) => head = h,
                }
            } else if stamp == head {
                fence(Ordering::SeqCst);
                let tail = self.tail.load(Ordering::Relaxed);
                if tail == head {
                    return false;
                }
                // A push moved the tail and has not yet stored the stamp.
                thread::yield_now();
                head = self.head.load(Ordering::Relaxed);
            } else {
                // The slot was taken by another pop (not in these models).
                thread::yield_now();
                head = self.head.load(Ordering::Relaxed);
            }
        }
    }
}

/// The CQ's shared state that the wake-up rule touches.
struct Cq {
    ring: Ring,
    arm: AtomicU8,
    sleepers: AtomicU32,
    /// Events pushed to the completion channel (or handed to the handler).
    events: AtomicUsize,
    /// Signals of the `wake` event fd.
    signals: AtomicUsize,
    /// Whether push and req_notify have their SeqCst fences (the rule).
    fences: bool,
}

impl Cq {
    fn new(fences: bool) -> Arc<Self> {
        Arc::new(Cq {
            ring: Ring::new(),
            arm: AtomicU8::new(ARM_NONE),
            sleepers: AtomicU32::new(0),
            events: AtomicUsize::new(0),
            signals: AtomicUsize::new(0),
            fences,
        })
    }

    /// `CompletionQueue::push` of a successful completion, `solicited` or
    /// not.
    fn push(&self, solicited: bool) {
        self.ring.push();
        if self.fences {
            fence(Ordering::SeqCst);
        }
        let arm = self.arm.load(Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            self.signals.fetch_add(1, Ordering::SeqCst);
        }
        let wakes = match arm {
            ARM_NONE => false,
            ARM_SOLICITED => solicited,
            _ => true,
        };
        if wakes
            && self
                .arm
                .compare_exchange(arm, ARM_NONE, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            self.events.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// `CompletionQueue::req_notify(false)`.
    fn req_notify(&self) {
        self.arm.fetch_max(ARM_NEXT, Ordering::SeqCst);
        if self.fences {
            fence(Ordering::SeqCst);
        }
    }

    /// The sleeping step of `CompletionQueue::wait` up to the sleep:
    /// whether the look before sleeping found a completion. The thread
    /// then sleeps and stays counted in `sleepers` for the rest of the
    /// model (its `fetch_sub` comes after it wakes; a push after that is
    /// found by the next round of `sleep_loop`).
    ///
    /// The look here is `pop` (its SeqCst fence on an empty ring), not
    /// `poll_ring`'s look first ([`Ring::poll`]): the code's look is two
    /// SeqCst loads after the SeqCst increment, and what makes the push
    /// see the sleeper or the look see the push is the single order of
    /// SeqCst operations (the look reading the tail from before the push
    /// puts it before the push's compare-exchange in that order, and the
    /// increment before it, so the push's later load of the count sees
    /// the increment), which loom does not model: it treats SeqCst loads
    /// as Acquire and, with the look first, reports the signal lost. A
    /// SeqCst fence after the increment would make the rule one of
    /// fences, which loom checks.
    fn sleep(&self) -> bool {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        self.ring.pop()
    }
}

/// The verbs consumer (`CompletionQueue::drain_and_arm`): poll, arm, and,
/// with `poll_after_arm`, poll again before waiting for the event.
/// Whether a poll found the completion.
fn consumer(cq: &Cq, poll_after_arm: bool) -> bool {
    if cq.ring.poll() {
        return true;
    }
    cq.req_notify();
    poll_after_arm && cq.ring.poll()
}

/// A completion pushed by the data path while the consumer arms: it must
/// be found by a poll or raise an event; otherwise the consumer waits on an
/// armed, empty-looking CQ that never wakes.
fn push_against_arm(fences: bool, poll_after_arm: bool) {
    loom::model(move || {
        let cq = Cq::new(fences);
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || cq.push(true))
        };
        let found = consumer(&cq, poll_after_arm);
        pusher.join().unwrap();
        let events = cq.events.load(Ordering::SeqCst);
        assert!(
            found || events == 1,
            "lost completion wake-up: armed, nothing found, no event"
        );
        assert!(events <= 1, "one arm raised {events} events");
    });
}

/// The rule as `cq.rs` has it: no interleaving loses the wake-up.
#[test]
fn loom_cq_push_against_req_notify_never_loses_the_wakeup() {
    push_against_arm(true, true);
}

/// Without the SeqCst fences in `push` and `req_notify` the model finds
/// the lost wake-up: each side's store is not yet visible to the other's
/// load.
#[test]
#[should_panic(expected = "lost completion wake-up")]
fn loom_cq_without_fences_loses_the_wakeup() {
    push_against_arm(false, true);
}

/// Without the poll after arming (the verbs rule `drain_and_arm` follows),
/// a completion pushed before the arm raises no event and is never seen.
#[test]
#[should_panic(expected = "lost completion wake-up")]
fn loom_cq_arm_without_poll_after_loses_the_wakeup() {
    push_against_arm(true, false);
}

/// A thread about to sleep in `wait` either finds the completion in its
/// look after counting itself a sleeper, or the push signals `wake`.
#[test]
fn loom_cq_push_against_sleeping_wait_never_loses_the_signal() {
    loom::model(|| {
        let cq = Cq::new(true);
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || cq.push(true))
        };
        let found = cq.sleep();
        pusher.join().unwrap();
        assert!(
            found || cq.signals.load(Ordering::SeqCst) > 0,
            "lost wait wake-up: asleep, nothing found, no signal"
        );
    });
}

/// A CQ armed for solicited completions is widened to any completion
/// (`req_notify(false)`, the `fetch_max`) while an unsolicited completion
/// is pushed: the push either sees the wide arm and raises the event, or
/// the poll after widening finds the completion.
#[test]
fn loom_cq_widening_arm_against_unsolicited_push_never_loses_the_wakeup() {
    loom::model(|| {
        let cq = Cq::new(true);
        cq.arm.store(ARM_SOLICITED, Ordering::SeqCst);
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || cq.push(false))
        };
        cq.req_notify();
        let found = cq.ring.poll();
        pusher.join().unwrap();
        assert!(
            found || cq.events.load(Ordering::SeqCst) == 1,
            "lost completion wake-up: armed, nothing found, no event"
        );
    });
}

/// The kernel's `eventfd(2)` as the waker uses it: a counter under the
/// wait queue's lock; a write adds and wakes the pollers, a read takes
/// the count, a `poll(2)` without a timeout sleeps until it is not 0.
struct EventFd {
    count: loom::sync::Mutex<u32>,
    readable: loom::sync::Condvar,
}

impl EventFd {
    fn write(&self) {
        *self.count.lock().unwrap() += 1;
        self.readable.notify_all();
    }

    fn read(&self) {
        *self.count.lock().unwrap() = 0;
    }

    /// `poll(2)` with no timeout: a lost wake-up is a sleep nobody ends
    /// (loom reports the deadlock).
    fn poll(&self) {
        let mut c = self.count.lock().unwrap();
        while *c == 0 {
            c = self.readable.wait(c).unwrap();
        }
    }
}

/// `sys::fd::Waker` over [`EventFd`], with the CQ side of
/// `CompletionQueue::push` / `waiter_enter` (`cq.rs`): the ring is a
/// counter of pushed completions here (its own ordering is modelled
/// above), followed by the push's SeqCst fence.
struct WakerCq {
    pushed: AtomicUsize,
    waiter_count: AtomicU32,
    pending: loom::sync::atomic::AtomicBool,
    fd: EventFd,
    /// The waker's reset in the order of `Waker::reset` (read, then clear
    /// `pending`), or the other way round.
    read_first: bool,
}

impl WakerCq {
    /// `CompletionQueue::push`: the completion, the fence, and a wake of
    /// the registered waiter (`Waker::wake`: one write per sleep).
    fn push(&self) {
        self.pushed.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        if self.waiter_count.load(Ordering::SeqCst) > 0
            && !self.pending.swap(true, Ordering::SeqCst)
        {
            self.fd.write();
        }
    }

    /// A look at the ring that finds it empty: `ArrayQueue::pop` on an
    /// empty slot is a SeqCst fence and a Relaxed load of `tail` (see
    /// [`Ring::pop`]); that fence, after the reset's clear of `pending`,
    /// is what orders the look after a push whose wake saw `pending` set.
    fn look(&self) -> usize {
        fence(Ordering::SeqCst);
        self.pushed.load(Ordering::Relaxed)
    }

    /// `Waker::reset`.
    fn reset(&self) {
        if self.read_first {
            self.fd.read();
            self.pending.swap(false, Ordering::SeqCst);
        } else {
            self.pending.swap(false, Ordering::SeqCst);
            self.fd.read();
        }
    }
}

/// A waiter sleeping with no timeout (`CompletionQueue::wait`, a wait set
/// with `ppoll(2)`) against three pushes: it registers, looks, sleeps
/// until its descriptor is readable, resets it, looks again, until it has
/// seen every completion. A lost wake-up leaves it asleep for good.
fn waiter_against_pushes(read_first: bool) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(move || {
        let cq = Arc::new(WakerCq {
            pushed: AtomicUsize::new(0),
            waiter_count: AtomicU32::new(0),
            pending: loom::sync::atomic::AtomicBool::new(false),
            fd: EventFd {
                count: loom::sync::Mutex::new(0),
                readable: loom::sync::Condvar::new(),
            },
            read_first,
        });
        const N: usize = 3;
        let pusher = {
            let cq = cq.clone();
            thread::spawn(move || {
                for _ in 0..N {
                    cq.push();
                }
            })
        };
        // `waiter_enter`, then the look before every sleep.
        cq.waiter_count.fetch_add(1, Ordering::SeqCst);
        while cq.look() < N {
            cq.fd.poll();
            cq.reset();
        }
        cq.waiter_count.fetch_sub(1, Ordering::SeqCst);
        pusher.join().unwrap();
    });
}

/// The waker's rule (read the descriptor, then clear `pending`, then
/// look): a burst of pushes writes once per sleep and the waiter never
/// sleeps through a completion.
#[test]
fn loom_waker_read_then_clear_never_loses_the_wakeup() {
    waiter_against_pushes(true);
}

/// Its negative twin: clearing `pending` before the read lets the read
/// swallow the write of a push that came in between; the next push skips
/// its write (`pending` is set) and the waiter sleeps for good.
#[test]
#[should_panic(expected = "deadlock")]
fn loom_waker_clear_then_read_loses_the_wakeup() {
    waiter_against_pushes(false);
}
