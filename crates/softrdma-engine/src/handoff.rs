//! The direct-send hand-off: a lock over transmit state plus a "work was
//! announced" flag, so that a thread that cannot take the lock can leave its
//! work to the holder without the work being forgotten.
//!
//! The protocol, for every thread:
//!
//! * A thread that queued work (a posted request, a response owed to the
//!   peer) calls [`HandOff::announce`] and then tries to claim the lock
//!   ([`HandOff::try_claim`]). If the lock is busy it returns at once: the
//!   holder will see the announcement.
//! * A claimer clears the announcement when it gets the lock, *before* it
//!   drains the queues, so anything announced later is seen on release.
//! * Every holder, also one that took the lock for another reason
//!   ([`HandOff::lock`], e.g. to read a counter), releases it with
//!   [`HandOff::release`], which says whether work was announced meanwhile;
//!   if so, the holder must try to claim it (loop), because the announcer
//!   has already given up.
//!
//! Forgetting the re-check after release is the classic lost wake-up: the
//! work sits queued until some later post happens to take the lock. The
//! `cfg(loom)` tests below check the protocol on every interleaving of a
//! poster, a claimer and a plain holder (build with `RUSTFLAGS="--cfg loom"`,
//! see `docs/engine.md`).

#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, Ordering, fence};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, Ordering, fence};

#[cfg(loom)]
type Lock<T> = loom::sync::Mutex<T>;
/// The guard of a [`HandOff`]'s lock.
#[cfg(loom)]
pub(crate) type Guard<'a, T> = loom::sync::MutexGuard<'a, T>;
#[cfg(not(loom))]
type Lock<T> = parking_lot::Mutex<T>;
/// The guard of a [`HandOff`]'s lock.
#[cfg(not(loom))]
pub(crate) type Guard<'a, T> = parking_lot::MutexGuard<'a, T>;

/// A lock with a hand-off flag (see the module documentation).
#[derive(Debug)]
pub(crate) struct HandOff<T> {
    lock: Lock<T>,
    announced: AtomicBool,
}

impl<T> HandOff<T> {
    /// A hand-off over `value`, nothing announced.
    pub(crate) fn new(value: T) -> Self {
        HandOff {
            lock: Lock::new(value),
            announced: AtomicBool::new(false),
        }
    }

    /// Work was queued for whoever holds (or next claims) the lock.
    pub(crate) fn announce(&self) {
        // Release: a claimer whose clearing swap reads this store sees the
        // work queued before it.
        self.announced.store(true, Ordering::Release);
        // The store must be ordered before the try-lock that follows
        // (store-load), the mirror of the fence in `release`: of the two
        // fences one comes first, so either the announcer's try-lock sees
        // the lock free or the holder's re-check sees the announcement.
        fence(Ordering::SeqCst);
    }

    /// Takes the lock if it is free, to do the announced work: the
    /// announcement is cleared (the caller drains the queues next).
    pub(crate) fn try_claim(&self) -> Option<Guard<'_, T>> {
        let g = self.try_lock_raw()?;
        // A read-modify-write (acquire): if it overwrites an announcement,
        // it reads it, so the work queued before that announcement is
        // visible to the drain that follows.
        self.announced.swap(false, Ordering::AcqRel);
        Some(g)
    }

    /// Takes the lock (blocking) without claiming announced work: release it
    /// with [`release`](Self::release) and act on its answer.
    pub(crate) fn lock(&self) -> Guard<'_, T> {
        #[cfg(loom)]
        {
            self.lock.lock().unwrap()
        }
        #[cfg(not(loom))]
        {
            self.lock.lock()
        }
    }

    fn try_lock_raw(&self) -> Option<Guard<'_, T>> {
        #[cfg(loom)]
        {
            self.lock.try_lock().ok()
        }
        #[cfg(not(loom))]
        {
            self.lock.try_lock()
        }
    }

    /// Unlocks; `true` if work was announced that no claimer has taken: the
    /// caller must then try to claim it.
    #[must_use = "announced work is lost unless the caller claims it"]
    pub(crate) fn release(&self, guard: Guard<'_, T>) -> bool {
        drop(guard);
        // The unlock must be ordered before the load (store-load): a
        // poster announces, then fails the try-lock; we unlock, then read.
        fence(Ordering::SeqCst);
        self.announced.load(Ordering::Acquire)
    }

    /// Whether work is announced and unclaimed (a hint).
    #[allow(dead_code)]
    pub(crate) fn is_announced(&self) -> bool {
        self.announced.load(Ordering::SeqCst)
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    //! Every interleaving of a poster, a plain holder (like `query()`) and a
    //! second poster: every posted item ends up processed.
    use super::*;
    use loom::sync::Arc;
    use loom::sync::Mutex;
    use loom::sync::atomic::AtomicUsize;
    use loom::thread;

    struct Qp {
        tx: HandOff<Vec<u32>>,
        incoming: Mutex<Vec<u32>>,
        /// Touched inside the reader's critical section: a scheduling point
        /// while it holds the lock (real threads are preempted anywhere).
        reads: AtomicUsize,
    }

    fn qp() -> Arc<Qp> {
        Arc::new(Qp {
            tx: HandOff::new(Vec::new()),
            incoming: Mutex::new(Vec::new()),
            reads: AtomicUsize::new(0),
        })
    }

    /// The engine's `kick`: claim, drain, release, re-check.
    fn kick(qp: &Qp) {
        qp.tx.announce();
        loop {
            let Some(mut g) = qp.tx.try_claim() else {
                return;
            };
            g.extend(qp.incoming.lock().unwrap().drain(..));
            if !qp.tx.release(g) {
                return;
            }
        }
    }

    fn post(qp: &Qp, v: u32) {
        qp.incoming.lock().unwrap().push(v);
        kick(qp);
    }

    /// A holder that only reads (like `QueuePair::query`), with or without
    /// the re-check after release.
    fn query(qp: &Qp, recheck: bool) {
        let g = qp.tx.lock();
        qp.reads.fetch_add(g.len(), Ordering::Relaxed);
        thread::yield_now();
        if qp.tx.release(g) && recheck {
            kick(qp);
        }
    }

    fn run(recheck: bool) {
        loom::model(move || {
            let qp = qp();
            let q2 = qp.clone();
            let poster = thread::spawn(move || post(&q2, 1));
            let q3 = qp.clone();
            let reader = thread::spawn(move || query(&q3, recheck));
            poster.join().unwrap();
            reader.join().unwrap();
            let sent = qp.tx.lock();
            assert_eq!(*sent, vec![1], "a posted item was never processed");
        });
    }

    #[test]
    fn hand_off_never_loses_a_post() {
        run(true);
    }

    /// Without the re-check after release the model finds the lost
    /// wake-up: the test documents that the check matters.
    #[test]
    #[should_panic(expected = "a posted item was never processed")]
    fn hand_off_without_recheck_loses_a_post() {
        run(false);
    }

    /// Two posters and a reader.
    #[test]
    fn two_posters_and_a_reader() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(2);
        model.check(|| {
            let qp = qp();
            let a = {
                let q = qp.clone();
                thread::spawn(move || post(&q, 1))
            };
            let b = {
                let q = qp.clone();
                thread::spawn(move || post(&q, 2))
            };
            query(&qp, true);
            a.join().unwrap();
            b.join().unwrap();
            let mut sent = qp.tx.lock().clone();
            sent.sort_unstable();
            assert_eq!(sent, vec![1, 2]);
        });
    }
}

#[cfg(all(test, loom))]
mod loom_post_vs_close {
    //! Receives posted before a connection exists (`QpInner::post_recv`
    //! in IDLE/RTR, queued in `pre_rq`) against the abort of a QP that was
    //! never connected (`core_abort`: ERROR, then flush `pre_rq`). The
    //! poster checks the state and queues under the connection's lock; the
    //! closer changes the state and flushes under the same lock. (A
    //! connected QP's receives are the connection's, posted and flushed
    //! under that lock by the protocol core: `loom_one_connection_lock`.)
    //! Every accepted receive completes exactly once.
    use loom::sync::atomic::{AtomicBool, Ordering};
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    struct Qp {
        /// The connection's lock.
        core: Mutex<()>,
        closed: AtomicBool,
        rq: Mutex<Vec<u32>>,
        done: Mutex<Vec<u32>>,
    }

    fn flush(qp: &Qp) {
        let items: Vec<u32> = qp.rq.lock().unwrap().drain(..).collect();
        qp.done.lock().unwrap().extend(items);
    }

    /// `post_recv`: `true` if accepted.
    fn post(qp: &Qp, id: u32) -> bool {
        let _g = qp.core.lock().unwrap();
        if qp.closed.load(Ordering::SeqCst) {
            return false;
        }
        qp.rq.lock().unwrap().push(id);
        true
    }

    /// `core_abort` of a never-connected QP; `locked`: under the lock.
    fn close(qp: &Qp, locked: bool) {
        let g = qp.core.lock().unwrap();
        if !locked {
            drop(g);
            qp.closed.store(true, Ordering::SeqCst);
            flush(qp);
            return;
        }
        qp.closed.store(true, Ordering::SeqCst);
        flush(qp);
    }

    fn run(locked: bool) {
        loom::model(move || {
            let qp = Arc::new(Qp {
                core: Mutex::new(()),
                closed: AtomicBool::new(false),
                rq: Mutex::new(Vec::new()),
                done: Mutex::new(Vec::new()),
            });
            let q = qp.clone();
            let closer = thread::spawn(move || close(&q, locked));
            let accepted = post(&qp, 7);
            closer.join().unwrap();
            let done = qp.done.lock().unwrap().clone();
            if accepted {
                assert_eq!(done, vec![7], "an accepted receive never completed");
            } else {
                assert!(done.is_empty());
            }
        });
    }

    #[test]
    fn accepted_receive_racing_a_close_completes() {
        run(true);
    }

    #[test]
    #[should_panic(expected = "an accepted receive never completed")]
    fn without_the_lock_a_receive_is_lost() {
        run(false);
    }
}

#[cfg(all(test, loom))]
mod loom_one_connection_lock {
    //! The shape the data path takes once receive and transmit share one
    //! protocol core per connection (`docs/protocol-core.md`, "Switching
    //! the engine over"): the whole connection behind one [`HandOff`].
    //! Posters queue a request on a lock-free queue, announce and try to
    //! claim; a claimer drains the queue into the connection (posting
    //! checks the state under the lock: an accepted request is queued, one
    //! that arrives after the close is flushed at once) and transmits. The
    //! receive path takes the lock blocking, handles input that makes the
    //! connection owe a response, or closes it (flushing what is queued),
    //! transmits, releases and re-checks. Checked: every post completes
    //! exactly once (sent or flushed), the response is sent exactly once,
    //! nothing stays in the post queue.
    use super::*;
    use loom::sync::Arc;
    use loom::sync::Mutex;
    use loom::thread;

    /// A stand-in for the core's `Connection`: its send queue, the
    /// responses it owes, its state, and what it produced.
    #[derive(Default)]
    struct Conn {
        closed: bool,
        sq: Vec<u32>,
        resp: Vec<u32>,
        /// Requests and responses handed to the socket.
        wire: Vec<u32>,
        /// Completions: (id, flushed).
        done: Vec<(u32, bool)>,
    }

    impl Conn {
        fn post(&mut self, id: u32) {
            if self.closed {
                self.done.push((id, true));
            } else {
                self.sq.push(id);
            }
        }

        /// `poll_transmit` until nothing is left, then `handle_sent`.
        fn transmit(&mut self) {
            for r in self.resp.drain(..) {
                self.wire.push(r);
            }
            for id in std::mem::take(&mut self.sq) {
                self.wire.push(id);
                self.done.push((id, false));
            }
        }

        fn close(&mut self) {
            self.closed = true;
            for id in self.sq.drain(..) {
                self.done.push((id, true));
            }
        }
    }

    struct Qp {
        conn: HandOff<Conn>,
        incoming: Mutex<Vec<u32>>,
    }

    /// Drains posted requests into the connection and transmits; loops
    /// while work was announced during the hold.
    fn claim(qp: &Qp, recheck: bool) {
        loop {
            let Some(mut c) = qp.conn.try_claim() else {
                return;
            };
            let posted: Vec<u32> = qp.incoming.lock().unwrap().drain(..).collect();
            for id in posted {
                c.post(id);
            }
            c.transmit();
            if !qp.conn.release(c) || !recheck {
                return;
            }
        }
    }

    fn post(qp: &Qp, id: u32) {
        qp.incoming.lock().unwrap().push(id);
        qp.conn.announce();
        claim(qp, true);
    }

    /// The receive path: bytes arrived that make the connection owe a
    /// response (`close`: the peer's FIN instead), handled under the lock.
    fn receive(qp: &Qp, close: bool, recheck: bool) {
        let mut c = qp.conn.lock();
        if close {
            c.close();
        } else {
            c.resp.push(100);
        }
        thread::yield_now();
        c.transmit();
        if qp.conn.release(c) && recheck {
            claim(qp, true);
        }
    }

    fn run(close: bool, recheck: bool) {
        loom::model(move || {
            let qp = Arc::new(Qp {
                conn: HandOff::new(Conn::default()),
                incoming: Mutex::new(Vec::new()),
            });
            let q = qp.clone();
            let poster = thread::spawn(move || post(&q, 1));
            receive(&qp, close, recheck);
            poster.join().unwrap();
            assert!(
                qp.incoming.lock().unwrap().is_empty(),
                "a post stayed in the queue"
            );
            let c = qp.conn.lock();
            assert_eq!(c.done.len(), 1, "post completed {} times", c.done.len());
            let sent = c.wire.iter().filter(|&&x| x == 1).count();
            assert_eq!(sent, usize::from(!c.done[0].1), "sent iff not flushed");
            if !close {
                assert_eq!(c.wire.iter().filter(|&&x| x == 100).count(), 1);
            }
        });
    }

    #[test]
    fn post_against_receive_under_one_lock() {
        run(false, true);
    }

    #[test]
    fn post_against_close_under_one_lock() {
        run(true, true);
    }

    /// The receive path must re-check after releasing, like every holder.
    #[test]
    #[should_panic(expected = "a post stayed in the queue")]
    fn receive_without_recheck_loses_a_post() {
        run(false, false);
    }
}
