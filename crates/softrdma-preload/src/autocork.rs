//! Small writes of a burst go as one SDP message.
//!
//! A server that answers with two writes, a header and then its body (nginx
//! with `tcp_nopush off`: `writev` of the header, `sendfile` of the file),
//! makes two SDP messages even with `TCP_NODELAY`, where the kernel makes
//! two segments. A message costs far more than a segment (a send and a
//! completion at each end, and the reader, woken by the first, often sleeps
//! again before the second comes): 1 KiB responses took a third more CPU
//! than with the two writes corked into one message.
//!
//! So the library learns, per connection, how many sends a *burst* has
//! (sends of one thread on the connection with no other interposed call of
//! that thread in between), and holds a small send (at most
//! [`HOLD_MAX`] octets) that is not the last one the previous burst had:
//! the stream is corked for it (as for `MSG_MORE`) and the burst's next
//! send uncorks it after appending its own octets, so both go as one
//! message. The hold ends, whatever comes next:
//!
//! - with the burst's next send on the connection (one message);
//! - at the thread's next interposed call of any other kind (a read, a
//!   wait, a send on another descriptor, `close`, a socket option...): the
//!   burst ended earlier than predicted, the held octets go at once;
//! - after [`HOLD_LIMIT`] at most (1 ms), by the library's flusher thread, for a
//!   thread that blocks outside the library (`nanosleep`, a futex, a raw
//!   system call) right after a send.
//!
//! A program whose bursts are single sends (request/response: redis, an
//! RPC client) never holds. The application's own `TCP_CORK` and
//! `MSG_MORE` take precedence (a held send is never corked by the library
//! while the stream is corked by them, and `setsockopt(TCP_CORK)` ends the
//! library's hold); `getsockopt(TCP_CORK)` does not see the library's
//! hold. Only the timing of messages changes, never the octets or their
//! order: every send and cork change goes through the stream's lock.
//! `SOFTRDMA_SOCKETS_AUTOCORK=MS` sets the flusher's limit, `0` turns
//! holds off.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Duration;

use crate::conn::{self, Conn};

/// Largest send that is held for the next one of its burst.
pub(crate) const HOLD_MAX: usize = 4096;
/// Longest time the flusher lets a held send wait, by default
/// (`SOFTRDMA_SOCKETS_AUTOCORK=MS` sets it; `0` turns holds off).
pub(crate) const HOLD_LIMIT: Duration = Duration::from_millis(1);

thread_local! {
    /// The connection this thread sent on last, while no other interposed
    /// call of the thread came since (its burst is still open). Weak: a
    /// connection another thread closes meanwhile ends with its last
    /// descriptor, as ever.
    static LAST_SEND: Cell<Option<Weak<Conn>>> = const { Cell::new(None) };
}

/// The calling thread makes an interposed call other than a send on its
/// last connection: that connection's burst ended (a held send goes now).
/// Cheap when nothing is open (a thread-local read).
pub(crate) fn end_burst() {
    if let Ok(Some(w)) = LAST_SEND.try_with(Cell::take)
        && let Some(c) = w.upgrade()
    {
        c.burst_end();
        // Possibly the last reference now (closed by another thread).
        conn::release(c);
    }
}

/// Before a send of `len` octets on `c` (with `MSG_MORE` if `more`):
/// the burst bookkeeping; returns whether this send should be held for
/// the next one (the caller corks the stream for it).
pub(crate) fn before_send(c: &Arc<Conn>, len: usize, more: bool) -> bool {
    let prev = LAST_SEND
        .try_with(Cell::take)
        .ok()
        .flatten()
        .and_then(|w| w.upgrade());
    match prev {
        Some(p) if Arc::ptr_eq(&p, c) => {}
        Some(p) => {
            p.burst_end();
            conn::release(p);
        }
        None => {}
    }
    let pos = c.burst_cur.fetch_add(1, Ordering::Relaxed) + 1;
    !more && len <= HOLD_MAX && pos < c.burst_last.load(Ordering::Relaxed) && enabled()
}

/// After a send on `c`: its burst stays open until the thread's next call.
pub(crate) fn after_send(c: &Arc<Conn>) {
    let _ = LAST_SEND.try_with(|l| l.set(Some(Arc::downgrade(c))));
}

/// Whether holds are allowed in this process: on (unless turned off) in
/// the process whose flusher thread runs (started here, on the first
/// hold; a forked child has none, and holds nothing).
fn enabled() -> bool {
    if crate::interpose::autocork_limit().is_zero() {
        return false;
    }
    let f = flusher();
    f.running && f.pid == conn::pid()
}

/// The flusher thread's queue: held connections and their hold number.
struct Flusher {
    pid: i32,
    /// The thread started (else nothing is held: no one would end a hold
    /// of a thread blocked elsewhere).
    running: bool,
    q: Mutex<Vec<(Weak<Conn>, u64)>>,
    cv: Condvar,
    /// The thread sleeps with nothing queued (a push must wake it).
    idle: AtomicBool,
}

static FLUSHER: OnceLock<Flusher> = OnceLock::new();

fn flusher() -> &'static Flusher {
    FLUSHER.get_or_init(|| {
        // SAFETY: registering a plain `extern "C" fn()` with no arguments;
        // it runs once at exit.
        unsafe { libc::atexit(at_exit) };
        let running = conn::signals_blocked(|| {
            std::thread::Builder::new()
                .name("softrdma-cork".into())
                .spawn(run)
                .is_ok()
        });
        Flusher {
            pid: conn::pid(),
            running,
            q: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            idle: AtomicBool::new(false),
        }
    })
}

/// A hold (number `hold`) started on `c`: the flusher ends it after
/// [`HOLD_LIMIT`] unless it ended before.
pub(crate) fn watch(c: &Arc<Conn>, hold: u64) {
    let f = flusher();
    let mut q = f.q.lock().unwrap_or_else(|e| e.into_inner());
    q.push((Arc::downgrade(c), hold));
    if f.idle.load(Ordering::Relaxed) {
        f.cv.notify_one();
    }
}

/// At `exit(3)`: every hold of the process ends, its octets go. The
/// holds are taken from the flusher's list (process-wide), not from the
/// exiting thread's `LAST_SEND`: glibc's `exit` destroys the exiting
/// thread's locals before the exit handlers run. Registered at the first
/// hold, after the process's first offloaded connection, so it runs
/// before sockets direct's exit flush (its `offload/exit.rs`), which then
/// sends the DisConn behind these octets; with that flush off
/// (`SOFTRDMA_SOCKETS_EXIT_FLUSH_MS=0`) the octets still go, then the
/// connection ends as the process does.
extern "C" fn at_exit() {
    let _ = std::panic::catch_unwind(|| {
        end_burst();
        end_all_holds();
    });
}

/// Longest wait for the flusher's list at exit (another thread may be
/// adding to it).
const EXIT_LIST_WAIT: Duration = Duration::from_millis(100);

/// Ends every hold the flusher watches (at exit).
fn end_all_holds() {
    let Some(f) = FLUSHER.get() else {
        return;
    };
    // A forked child holds nothing (its parent's list, and lock, are not
    // its own).
    if f.pid != conn::pid() {
        return;
    }
    let deadline = std::time::Instant::now() + EXIT_LIST_WAIT;
    let batch = loop {
        match f.q.try_lock() {
            Ok(mut q) => break std::mem::take(&mut *q),
            Err(std::sync::TryLockError::Poisoned(e)) => {
                break std::mem::take(&mut *e.into_inner());
            }
            Err(std::sync::TryLockError::WouldBlock) => {
                if std::time::Instant::now() >= deadline {
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    };
    for (w, hold) in batch {
        if let Some(c) = w.upgrade() {
            c.end_hold_at_exit(hold);
            conn::release(c);
        }
    }
}

/// Ends the holds of `batch` that are still on.
fn end_holds(batch: Vec<(Weak<Conn>, u64)>) {
    for (w, hold) in batch {
        if let Some(c) = w.upgrade() {
            c.end_hold_if(hold);
            conn::release(c);
        }
    }
}

fn run() {
    let f = loop {
        // `FLUSHER` is set once `flusher()` returns (this thread may start
        // before).
        match FLUSHER.get() {
            Some(f) => break f,
            None => std::thread::sleep(Duration::from_micros(100)),
        }
    };
    loop {
        // The holds queued now; they stay listed while the thread sleeps
        // (the exit handler ends them if the process exits meanwhile).
        let n = {
            let mut q = f.q.lock().unwrap_or_else(|e| e.into_inner());
            while q.is_empty() {
                f.idle.store(true, Ordering::Relaxed);
                q = f.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
            f.idle.store(false, Ordering::Relaxed);
            q.len()
        };
        // Every hold of the batch is at least this old afterwards.
        std::thread::sleep(crate::interpose::autocork_limit());
        let batch: Vec<_> = {
            let mut q = f.q.lock().unwrap_or_else(|e| e.into_inner());
            // (Fewer if the exit handler took them: a later hold ended
            // early costs only its coalescing.)
            let n = n.min(q.len());
            q.drain(..n).collect()
        };
        end_holds(batch);
    }
}
