//! The engine's timers: one thread for every timer of every device (the
//! graceful close timer today), instead of one sleeping thread per timer.
//!
//! Timers are kept in a binary heap ordered by deadline; the thread sleeps
//! on a condition variable until the earliest deadline or until a sooner
//! timer is armed, runs the callbacks that are due (outside the lock), and
//! sleeps without deadline when no timer is armed. A cancelled timer is
//! removed from the callback table and skipped when its deadline comes.
//! The thread is started on first use and lives as long as the process; it
//! costs nothing while idle.
//!
//! A `fork(2)`ed child has no timer thread (only the forking thread lives
//! on in it): its first timer starts one, on a table of its own (the
//! parent's table may have been locked at the fork, and its condition
//! variable still counts the parent's sleeping thread). Timers the parent
//! had armed do not run in the child: they belong to the parent's
//! connections.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::sys::clock;

type Callback = Box<dyn FnOnce() + Send>;

/// Identifies an armed timer (for [`cancel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TimerId(u64);

#[derive(Default)]
struct Table {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    callbacks: HashMap<u64, Callback>,
    thread_started: bool,
    /// While the thread sleeps: until when (`None`: no deadline). A timer
    /// due no sooner needs no wake-up, even if the timer the thread sleeps
    /// for was cancelled meanwhile (the thread then wakes for nothing, once,
    /// instead of once per timer armed).
    sleeps_until: Option<Option<Instant>>,
}

struct Timers {
    table: Mutex<Table>,
    wake: Condvar,
}

impl Timers {
    fn new() -> Timers {
        Timers {
            table: Mutex::new(Table::default()),
            wake: Condvar::new(),
        }
    }
}

/// Timer identifiers, unique in the process and in its forked children
/// (a child's table never takes an identifier the parent handed out).
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// The timers of this process: the table of this fork generation
/// ([`fork_generation`](crate::sys::epoll::fork_generation)); a forked
/// child makes one of its own on first use. No lock is taken to find it
/// (one atomic load): a child never waits for a lock a thread of its
/// parent held at the fork, and a pre-forked server's children pay
/// nothing per timer for being children.
fn timers() -> &'static Timers {
    static TIMERS: crate::sys::process::PerFork<Timers> = crate::sys::process::PerFork::new();
    TIMERS.get(Timers::new)
}

/// Runs `f` on the timer thread once `after` has passed, unless cancelled.
/// `Err` if the timer thread could not be started (the caller acts at once
/// instead).
pub(crate) fn arm(after: Duration, f: impl FnOnce() + Send + 'static) -> std::io::Result<TimerId> {
    #[cfg(test)]
    if let Some(f) = FAIL_NEXT_ARM.with(|c| c.take()) {
        f();
        return Err(std::io::Error::other("timer failure injected by a test"));
    }
    let t = timers();
    let deadline = clock::now()
        .checked_add(after)
        .unwrap_or_else(|| clock::now() + Duration::from_secs(365 * 24 * 3600));
    let mut table = t.table.lock();
    if !table.thread_started {
        crate::sys::io::spawn_engine_thread("softrdma-timer".into(), move || run(t))?;
        table.thread_started = true;
    }
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let wake = match table.sleeps_until {
        Some(until) => until.is_none_or(|u| deadline < u),
        // Awake: it looks at the heap before it sleeps again.
        None => false,
    };
    table.heap.push(Reverse((deadline, id)));
    table.callbacks.insert(id, Box::new(f));
    if wake {
        // One wake-up per sleep is enough.
        table.sleeps_until = Some(Some(deadline));
    }
    drop(table);
    if wake {
        t.wake.notify_one();
    }
    Ok(TimerId(id))
}

#[cfg(test)]
thread_local! {
    /// Tests: the calling thread's next [`arm`] runs this and fails (as
    /// when no timer thread can be started).
    pub(crate) static FAIL_NEXT_ARM: std::cell::Cell<Option<Box<dyn FnOnce()>>> =
        const { std::cell::Cell::new(None) };
}

/// Cancels a timer; `false` if it already ran (or is running).
pub(crate) fn cancel(id: TimerId) -> bool {
    let t = timers();
    let mut table = t.table.lock();
    let removed = table.callbacks.remove(&id.0).is_some();
    // Drop cancelled entries at the top of the heap now; the others go
    // when their deadline comes.
    while let Some(Reverse((_, top))) = table.heap.peek() {
        if table.callbacks.contains_key(top) {
            break;
        }
        table.heap.pop();
    }
    removed
}

/// Timers armed and not yet run or cancelled.
#[allow(dead_code)]
pub(crate) fn armed() -> usize {
    timers().table.lock().callbacks.len()
}

fn run(t: &'static Timers) {
    let mut due: Vec<Callback> = Vec::new();
    let mut table = t.table.lock();
    loop {
        let now = clock::now();
        while let Some(Reverse((deadline, id))) = table.heap.peek().copied() {
            if deadline > now {
                break;
            }
            table.heap.pop();
            if let Some(f) = table.callbacks.remove(&id) {
                due.push(f);
            }
        }
        if !due.is_empty() {
            drop(table);
            for f in due.drain(..) {
                // A panicking callback must not stop every other timer.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            }
            table = t.table.lock();
            continue;
        }
        let until = table.heap.peek().map(|Reverse((d, _))| *d);
        table.sleeps_until = Some(until);
        match until {
            Some(deadline) => {
                let _ = t.wake.wait_until(&mut table, deadline);
            }
            None => t.wake.wait(&mut table),
        }
        table.sleeps_until = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A deadline is taken when its timer is armed: a test thread that is
    /// not scheduled for 20 ms between its arms (a busy machine) gives its
    /// timers other deadlines than the ones meant (timer 1 then rightly
    /// fires after timer 0). Such a round is cancelled and done again; a
    /// round armed within 20 ms has its deadlines in the order meant.
    #[test]
    fn timers_fire_in_deadline_order_and_cancelled_ones_do_not() {
        const WINDOW: Duration = Duration::from_millis(20);
        let mut rounds = 0;
        let (order, ids, fired) = loop {
            rounds += 1;
            assert!(rounds <= 100, "no round armed its timers within {WINDOW:?}");
            let start = std::time::Instant::now();
            let order = Arc::new(Mutex::new(Vec::new()));
            let mut ids = Vec::new();
            for (i, ms) in [(0u32, 60u64), (1, 20), (2, 40)] {
                let order = order.clone();
                ids.push(arm(Duration::from_millis(ms), move || order.lock().push(i)).unwrap());
            }
            let fired = Arc::new(AtomicUsize::new(0));
            let f2 = fired.clone();
            let c = arm(Duration::from_millis(30), move || {
                f2.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
            let cancelled = cancel(c);
            if start.elapsed() >= WINDOW {
                for id in ids {
                    let _ = cancel(id);
                }
                continue;
            }
            // Cancelled within 20 ms of being armed for 30.
            assert!(cancelled);
            break (order, ids, fired);
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while order.lock().len() < 3 {
            assert!(std::time::Instant::now() < deadline, "timers did not fire");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*order.lock(), vec![1, 2, 0]);
        assert_eq!(fired.load(Ordering::SeqCst), 0);
        assert!(!cancel(ids[0]), "already ran");
    }

    /// The thread sleeps until a timer that is then cancelled: a timer armed
    /// for sooner wakes it, one armed for later is run when the thread wakes
    /// for the cancelled one (no wake-up per timer armed).
    #[test]
    fn timers_armed_after_the_one_the_thread_sleeps_for_was_cancelled_fire() {
        let fired = Arc::new(Mutex::new(Vec::new()));
        let fire = |i: u32| {
            let fired = fired.clone();
            move || fired.lock().push(i)
        };
        // Sooner than the cancelled one (which is an hour away).
        let far = arm(Duration::from_secs(3600), fire(0)).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert!(cancel(far));
        arm(Duration::from_millis(10), fire(1)).unwrap();
        // Later than the cancelled one, which is cancelled before its
        // deadline. A test thread not scheduled for those 30 ms (a busy
        // machine) tries again, and the timer of that try (numbered from
        // 100) may have fired.
        let mut tries = 0;
        loop {
            tries += 1;
            assert!(tries <= 100, "could not cancel a timer within 30 ms");
            let armed = std::time::Instant::now();
            let near = arm(Duration::from_millis(30), fire(99 + tries)).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            let cancelled = cancel(near);
            if armed.elapsed() < Duration::from_millis(30) {
                assert!(cancelled);
                break;
            }
        }
        arm(Duration::from_millis(80), fire(3)).unwrap();
        // The timers of this test, without those of the tries given up on.
        let ours = || -> Vec<u32> {
            let mut v = fired.lock().clone();
            v.retain(|&i| i < 100 || i == 99 + tries);
            v
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while ours().len() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "timers did not fire: {:?}",
                fired.lock()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(ours(), vec![1, 3]);
    }

    /// A `fork(2)`ed child inherited the started flag of the parent's
    /// timer thread but not the thread: its timers never fired (a batching
    /// backstop, a close timer). Its first timer now starts a thread of
    /// its own.
    #[test]
    fn timers_fire_in_a_forked_child() {
        // The parent's thread runs (the flag the child inherits is set).
        let fired = Arc::new(AtomicUsize::new(0));
        let f2 = fired.clone();
        arm(Duration::from_millis(1), move || {
            f2.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fired.load(Ordering::SeqCst) == 0 {
            assert!(std::time::Instant::now() < deadline, "parent timer");
            std::thread::sleep(Duration::from_millis(1));
        }
        // A timer the parent armed for later does not run in the child.
        let parents = Arc::new(AtomicUsize::new(0));
        let p2 = parents.clone();
        let later = arm(Duration::from_millis(200), move || {
            p2.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        let ok = crate::sys::process::in_child(Duration::from_secs(20), || {
            let fired = Arc::new(AtomicUsize::new(0));
            let f2 = fired.clone();
            if arm(Duration::from_millis(5), move || {
                f2.fetch_add(1, Ordering::SeqCst);
            })
            .is_err()
            {
                return false;
            }
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while fired.load(Ordering::SeqCst) == 0 {
                if std::time::Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            // The parent's timer is not the child's to run or cancel.
            std::thread::sleep(Duration::from_millis(300));
            parents.load(Ordering::SeqCst) == 0 && !cancel(later)
        });
        assert!(ok, "the child's timer did not fire (or ran the parent's)");
        let _ = cancel(later);
    }

    /// Fires a timer armed `ms` from now in this process; whether it ran
    /// within a few seconds.
    fn fires(ms: u64) -> bool {
        let fired = Arc::new(AtomicUsize::new(0));
        let f2 = fired.clone();
        let armed = arm(Duration::from_millis(ms), move || {
            f2.fetch_add(1, Ordering::SeqCst);
        });
        if armed.is_err() {
            return false;
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while fired.load(Ordering::SeqCst) == 0 {
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// A forked child found its timer table under a process-wide lock
    /// that every arm and cancel took: a thread of its parent that held
    /// it (or the parent's table lock) at the fork made the child's first
    /// timer wait for ever. The child's table is found without a lock now.
    #[test]
    fn a_forked_child_does_not_wait_for_timer_locks_a_parent_thread_held() {
        // A parent thread holds this process's table lock across the fork.
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _g = timers().table.lock();
            locked_tx.send(()).unwrap();
            let _ = release_rx.recv();
        });
        locked_rx.recv().unwrap();
        let ok = crate::sys::process::in_child(Duration::from_secs(60), || {
            if !fires(1) {
                return false;
            }
            // A child's thread arms and cancels without pause while the
            // child forks grandchildren: each must arm its own timers
            // (a lock every arm took in a child, held by that thread at
            // one of the forks, hung a grandchild within 200 forks).
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let s2 = stop.clone();
            let busy = std::thread::spawn(move || {
                while !s2.load(Ordering::Relaxed) {
                    if let Ok(id) = arm(Duration::from_secs(60), || {}) {
                        cancel(id);
                    }
                }
            });
            let mut all = true;
            for _ in 0..200 {
                all &= crate::sys::process::in_child(Duration::from_secs(5), || fires(1));
            }
            stop.store(true, Ordering::Relaxed);
            let _ = busy.join();
            all
        });
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        assert!(
            ok,
            "a forked child waited for a lock its parent's thread held"
        );
    }
}
