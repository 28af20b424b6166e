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
use std::sync::OnceLock;
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

/// The timers of this process: the table made in the fork generation
/// ([`fork_generation`](crate::sys::epoll::fork_generation)) that first
/// used timers, or, in a forked child, one of its own.
fn timers() -> &'static Timers {
    static FIRST: OnceLock<(u64, Timers)> = OnceLock::new();
    let generation = crate::sys::epoll::fork_generation();
    let first = FIRST.get_or_init(|| (generation, Timers::new()));
    if first.0 == generation {
        return &first.1;
    }
    child_timers(generation)
}

/// The table of a forked child (made once per generation, and kept for
/// the process's life, as the first one).
#[cold]
fn child_timers(generation: u64) -> &'static Timers {
    static CHILD: Mutex<Option<(u64, &'static Timers)>> = Mutex::new(None);
    let mut child = CHILD.lock();
    match *child {
        Some((g, t)) if g == generation => t,
        _ => {
            let t: &'static Timers = Box::leak(Box::new(Timers::new()));
            *child = Some((generation, t));
            t
        }
    }
}

/// Runs `f` on the timer thread once `after` has passed, unless cancelled.
/// `Err` if the timer thread could not be started (the caller acts at once
/// instead).
pub(crate) fn arm(after: Duration, f: impl FnOnce() + Send + 'static) -> std::io::Result<TimerId> {
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

    #[test]
    fn timers_fire_in_deadline_order_and_cancelled_ones_do_not() {
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
        assert!(cancel(c));
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
        // Later than the cancelled one.
        let near = arm(Duration::from_millis(30), fire(2)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(cancel(near));
        arm(Duration::from_millis(80), fire(3)).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while fired.lock().len() < 2 {
            assert!(
                std::time::Instant::now() < deadline,
                "timers did not fire: {:?}",
                fired.lock()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(*fired.lock(), vec![1, 3]);
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
}
