//! Data held at `exit(3)`: the process's live offloaded connections, and
//! the exit handler that sends what they still hold.
//!
//! A kernel TCP socket that the process never closed is closed by the
//! kernel when the process ends, and the kernel still sends what it
//! holds: a corked socket's data, a segment Nagle held back, the queue
//! behind a full window, then its FIN. An offloaded connection holds such
//! data in the library, before it is posted (a staged write held by
//! `TCP_CORK` for up to 200 ms, by Nagle while a send is in flight, or
//! waiting for the peer's SDP credits), and nothing of the library
//! outlives the process to send it. So the process's live connections are
//! listed here ([`register`] at setup, [`unregister`] at close: weak
//! references, nothing per message), and an exit handler
//! ([`softrdma_engine::at_exit`], registered with the first connection)
//! does what the kernel's implicit close would, bounded in time:
//!
//! - it releases the cork and Nagle holds and posts the held data, then
//!   the DisConn behind it (the peer reads EOF after the last octet, as
//!   after the kernel's FIN); a queue waiting for credits goes as the
//!   peer's credits come (the peer still reads);
//! - it waits until every post is written to the socket (the send
//!   completed: the kernel then has it in order, before the FIN it sends
//!   at the implicit close);
//! - for a connection that still had data to send, it also waits for the
//!   peer's FIN after its own, as a close does: the peer's credit updates
//!   for our last messages would otherwise reach a socket closed by the
//!   exit, whose reset could cut off the peer's reading of them. A
//!   connection with nothing left to send gets its DisConn only (the exit
//!   of a process with idle connections does not wait for their peers);
//! - the whole wait is bounded: [`DEFAULT_EXIT_FLUSH`] (1 s) unless
//!   `SOFTRDMA_SOCKETS_EXIT_FLUSH_MS` says otherwise (read once, at the
//!   process's first offloaded connection, not at the exit, which must not
//!   take the environment's lock; `0`: no exit flush, no handler, no
//!   listing, held data is lost as before; a value that is not a number
//!   is reported on standard error and means the default). A peer that
//!   is gone or does not read costs the exit that long at most, and what
//!   could not be sent by then is lost (the kernel would have kept
//!   sending it after the exit);
//! - the connections are served together, in rounds: a round takes one
//!   step of each (post what can be posted, handle what has come, never
//!   wait), and a round that changed nothing is followed by one wait on
//!   all their completion queues at once ([`WaitSet`]). However many
//!   connections have a peer that does not read, every other one gets
//!   its data and DisConn in the first round.
//!
//! As the kernel's implicit close:
//!
//! - `SO_LINGER` on with a zero time (an abortive close: the kernel resets
//!   the connection and drops its queue): nothing is flushed; the kernel's
//!   reset at the exit ends the connection;
//! - `SO_LINGER` on with a longer time does not make the exit wait longer
//!   (the kernel does not linger in the close of an exiting process
//!   either, it sends in the background, which the library cannot): the
//!   bound above holds;
//! - unread received data: the connection is reset (AbortConn), as a
//!   close with unread data is, and as the kernel resets a socket closed
//!   with unread data.
//!
//! Other threads still run while exit handlers do:
//!
//! - a connection's lock is only tried: one another thread holds (or the
//!   exiting thread itself: `exit` called from a signal handler or a
//!   panic hook inside a call on that connection) is tried again next
//!   round, the others go meanwhile; a connection whose completion gate
//!   (`poller`) another thread holds gets its posts, and its completions
//!   are handled by that thread (if it does not, the connection waits
//!   until the bound). The engine's list of QPs is taken with a bounded
//!   try too;
//! - a write of another thread is no error (the kernel's TCP takes such
//!   writes until the process ends; `EPIPE` would raise `SIGPIPE` under
//!   the preload and kill the exiting process): until the exit flush's
//!   DisConn is sent, it is queued (by copy: no zero-copy offer may
//!   follow the DisConn) and sent before it; after that, from any thread,
//!   it is accepted and dropped and the stream stays writable: nothing
//!   can follow the DisConn, a wait would never return to an exit
//!   handler that joins the writer (and a non-blocking writer would spin
//!   on `WouldBlock`);
//! - the exiting thread's own locals are gone (glibc's `exit` destroys
//!   them before it runs the exit handlers): nothing here uses one that
//!   has a destructor, and the engine's CQ wait falls back to a sleep set
//!   of its own.
//!
//! **Order of exit handlers.** `atexit(3)` runs the last registered first.
//! Around this one:
//!
//! - the engine's handler writes the posts it deferred to their posters'
//!   next polls and ends deferral. This one calls it first itself
//!   ([`softrdma_engine::flush_posts_at_exit`]): run before the engine's,
//!   its own posts would otherwise be deferred to polls that only its wait
//!   makes (they would still go, later); run after it, nothing changes.
//! - the preload's autocork handler ends every hold of the process (it
//!   uncorks the streams, which posts the held octets). It is registered
//!   at the first hold, which comes after the process's first offloaded
//!   connection, so it runs before this one; this one then finds the
//!   octets posted or queued and sends the DisConn behind them. (Were it
//!   to run after this one, it would find nothing held: the DisConn ends
//!   the holds whatever the cork says.) It finds the holds in its
//!   flusher's process-wide list, not through the exiting thread's
//!   locals, so with this flush off the held octets still go.
//! - an application's handler that writes to a connection and runs after
//!   this one (registered before the process's first offloaded
//!   connection) gets `EPIPE` once the DisConn is sent: the connection
//!   has been shut down for writing (the exiting thread is told apart
//!   from the others, which wait instead, see above). Registered after that connection is made, it runs before
//!   this one, and what it writes is flushed with the rest.
//!
//! Fork: the list is per fork generation ([`PerFork`]): a `fork(2)`ed
//! child never takes a lock its parent's threads may have held at the
//! fork, and does not flush its parent's connections (their bytes are the
//! parent's to send); it flushes the connections it made itself.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use softrdma_engine::{PerFork, WaitSet};

use super::{Locked, Offload, Shared};

/// How long the exit flush may make the exit wait, unless
/// [`EXIT_FLUSH_ENV`] says otherwise.
pub(crate) const DEFAULT_EXIT_FLUSH: Duration = Duration::from_secs(1);

/// Environment variable: the exit flush's bound in milliseconds (`0`:
/// off). Read once, at the process's first offloaded connection.
pub(crate) const EXIT_FLUSH_ENV: &str = "SOFTRDMA_SOCKETS_EXIT_FLUSH_MS";

/// Longest sleep between two rounds over the connections when a round
/// made no progress (a completion or bytes on any of them end it
/// sooner).
const NAP: Duration = Duration::from_millis(10);

/// Longest wait for the list of connections at exit.
const LIST_WAIT: Duration = Duration::from_millis(100);

/// The live offloaded connections of this fork generation, by address.
type Live = Mutex<HashMap<usize, Weak<Shared>>>;

static LIVE: PerFork<Live> = PerFork::new();

/// Connections of this fork generation that the application closed
/// before the peer's FIN came (see [`defer_fin`]), with the time after
/// which they are no longer waited for.
type Closing = Mutex<Vec<(Arc<Shared>, Instant)>>;

static CLOSING: PerFork<Closing> = PerFork::new();

/// Most connections waiting for the peer's FIN after their close at once:
/// a close beyond it waits for its peer in the call, as it did before.
pub(super) const CLOSING_MAX: usize = 64;

/// The exit flush has started (set before it takes its snapshot of
/// [`CLOSING`]): a close from then on (an exit handler or destructor
/// that runs after the flush, another thread) is not listed, it waits
/// for the peer's FIN in the call, as nothing would wait for it later.
static EXIT_STARTED: AtomicBool = AtomicBool::new(false);

/// The bound in milliseconds, read at the first connection (`u64::MAX`:
/// not read yet).
static LIMIT_MS: AtomicU64 = AtomicU64::new(u64::MAX);

fn key(sh: &Shared) -> usize {
    std::ptr::from_ref(sh) as usize
}

/// A connection was set up: listed until it is closed. The bound is read
/// and the exit handler registered with the first one; with the exit
/// flush off, nothing is listed.
pub(super) fn register(sh: &Arc<Shared>) {
    // (Not a `Once`: a forked child could wait for a parent thread that
    // was in it at the fork. A child inherits the registration.)
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.load(Ordering::Relaxed) && !REGISTERED.swap(true, Ordering::Relaxed) {
        let limit = parse_limit(std::env::var(EXIT_FLUSH_ENV).ok().as_deref());
        LIMIT_MS.store(
            u64::try_from(limit.as_millis()).unwrap_or(u64::MAX - 1),
            Ordering::Relaxed,
        );
        if !limit.is_zero() {
            softrdma_engine::at_exit(flush_at_exit);
        }
    }
    if exit_flush_limit().is_zero() {
        return;
    }
    LIVE.get(Default::default)
        .lock()
        .insert(key(sh), Arc::downgrade(sh));
}

/// A connection was closed: no longer listed (a child leaves its parent's
/// list alone).
pub(super) fn unregister(sh: &Shared) {
    if let Some(live) = LIVE.peek() {
        let mut live = live.lock();
        live.remove(&key(sh));
        // Many connections once, few now: the memory goes back.
        if live.capacity() > 64 && live.len() < live.capacity() / 4 {
            let len = live.len();
            live.shrink_to(len * 2);
        }
    }
}

/// A close sent our DisConn and FIN, and the peer's FIN has not come
/// yet: the connection is kept (its QP, socket and regions) until it
/// comes or `deadline`, instead of the closing call waiting for it.
/// Until then the engine receives for it (its thread takes the socket
/// over once nobody polls it); [`reap_closing`] (at closes and setups)
/// or the reaper thread ([`start_reaper`]) lets it go, and the exit
/// handler waits for the peer's FINs of all such connections together
/// (bounded as the rest of the exit flush). `false`: not listed (no exit
/// flush, so nothing would wait for it at the exit; a forked child, which
/// often ends with `_exit(2)` and no exit handler, as the children of a
/// server forking per connection do; the exit flush has started, and its
/// list of connections to wait for is taken; or [`CLOSING_MAX`]
/// connections wait already): the caller waits.
pub(super) fn defer_fin(sh: &Arc<Shared>, deadline: Instant) -> bool {
    if exit_flush_limit().is_zero() || softrdma_engine::fork_generation() != 0 {
        return false;
    }
    let mut closing = CLOSING.get(Default::default).lock();
    // Under the list's lock: the exit flush sets the flag before it takes
    // the lock, so a connection is either in its snapshot or not listed.
    if closing.len() >= CLOSING_MAX || EXIT_STARTED.load(Ordering::SeqCst) {
        return false;
    }
    closing.push((sh.clone(), deadline));
    if closing.len() == 1 {
        // The reaper sleeps while nothing is listed.
        REAP_WAKE.notify_one();
    }
    drop(closing);
    start_reaper();
    true
}

/// Wakes the reaper when the list of closed connections is no longer
/// empty.
static REAP_WAKE: Condvar = Condvar::new();

/// How often the reaper looks at the listed connections while any is
/// listed: the longest a connection is kept after its peer's FIN came
/// (or its linger time is up) in a process that neither closes nor sets
/// up another.
const REAP_PERIOD: Duration = Duration::from_millis(50);

/// Starts, once, the thread that lets go of listed connections whose
/// peer's FIN came or whose time is up, when no close or setup comes to
/// do it ([`reap_closing`]): without it a process that closes a burst of
/// connections and goes quiet kept their sockets and regions. The engine's
/// thread reads the FIN (it takes over the socket of a QP nobody polls);
/// the reaper only looks at the QP's state and the deadline, and the
/// connections go (their QPs, sockets and regions) in its thread, not in
/// the engine's. It sleeps while nothing is listed, with every signal
/// blocked (it is started by whichever thread closes first). Only this fork
/// generation lists connections (a forked child never does), so no
/// child needs one.
fn start_reaper() {
    static STARTED: AtomicBool = AtomicBool::new(false);
    if STARTED.load(Ordering::Relaxed) || STARTED.swap(true, Ordering::Relaxed) {
        return;
    }
    // With every signal blocked, as the engine's threads: the closing
    // thread's mask (an application thread's) is not inherited, so no
    // process-wide signal runs the application's handlers here.
    let spawned = softrdma_engine::spawn_engine_thread("softrdma-reap".into(), reaper);
    if spawned.is_err() {
        // Closes and setups still reap; the exit still waits.
        STARTED.store(false, Ordering::Relaxed);
    }
}

fn reaper() {
    let closing = CLOSING.get(Default::default);
    loop {
        {
            let mut list = closing.lock();
            while list.is_empty() {
                REAP_WAKE.wait(&mut list);
            }
        }
        std::thread::sleep(REAP_PERIOD);
        let done = take_done(&mut closing.lock(), 0);
        // Outside the list's lock.
        drop(done);
    }
}

/// Takes out of `list` the connections whose peer's FIN has come or whose
/// time is up (to be dropped by the caller outside the list's lock),
/// reading the sockets of the `steps` oldest still waiting first (without
/// waiting; a connection whose lock another thread holds is left for
/// later: its last handle is gone, only the engine's completion callback
/// or an exit flush takes it).
fn take_done(list: &mut Vec<(Arc<Shared>, Instant)>, mut steps: usize) -> Vec<Arc<Shared>> {
    let now = Instant::now();
    let mut done = Vec::new();
    list.retain(|(sh, deadline)| {
        if steps > 0 && !sh.peer_fin_seen() && now < *deadline {
            steps -= 1;
            if let Some(mut st) = sh.try_lock_now() {
                sh.progress(&mut st);
            }
        }
        let keep = !sh.peer_fin_seen() && now < *deadline;
        if !keep {
            done.push(sh.clone());
        }
        keep
    });
    done
}

/// Closed connections whose socket [`reap_closing`] reads (without
/// waiting) per call, the oldest first: the peer's FIN is usually there
/// by the next close or setup, and read here it costs one receive, where
/// the engine's thread taking the socket over (after its quiet period)
/// costs a wake-up and its epoll set's changes, and keeps the
/// connection's regions out of the pool meanwhile.
const REAP_STEPS: usize = 4;

/// Lets go of the closed connections whose peer's FIN has come (or whose
/// time is up): their QPs and sockets are closed and their regions go
/// back to the pool. Reads the sockets of the [`REAP_STEPS`] oldest
/// first, without waiting; called at each close and setup.
pub(super) fn reap_closing() {
    let Some(closing) = CLOSING.peek() else {
        return;
    };
    let done: Vec<Arc<Shared>> = {
        let Some(mut list) = closing.try_lock() else {
            // Another thread reaps (or defers) right now.
            return;
        };
        if list.is_empty() {
            return;
        }
        take_done(&mut list, REAP_STEPS)
    };
    // Dropped outside the list's lock (a QP's and its regions' ends).
    drop(done);
}

/// The bound [`EXIT_FLUSH_ENV`] sets (`None`: not set): milliseconds,
/// else (with a warning for a value that is not a number)
/// [`DEFAULT_EXIT_FLUSH`].
pub(crate) fn parse_limit(v: Option<&str>) -> Duration {
    let Some(v) = v else {
        return DEFAULT_EXIT_FLUSH;
    };
    match v.trim().parse::<u64>() {
        Ok(ms) => Duration::from_millis(ms),
        Err(_) => {
            eprintln!(
                "softrdma-sockets: {EXIT_FLUSH_ENV}={v:?} is not a number of milliseconds; \
                 the exit flush is bounded by {} ms",
                DEFAULT_EXIT_FLUSH.as_millis()
            );
            DEFAULT_EXIT_FLUSH
        }
    }
}

/// The exit flush's bound, as read at the first connection (before it:
/// the default).
pub(crate) fn exit_flush_limit() -> Duration {
    match LIMIT_MS.load(Ordering::Relaxed) {
        u64::MAX => DEFAULT_EXIT_FLUSH,
        ms => Duration::from_millis(ms),
    }
}

/// `now + limit`, or a time as good as never for a limit too large for
/// the clock.
fn deadline_after(now: Instant, limit: Duration) -> Instant {
    now.checked_add(limit)
        .or_else(|| now.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(now)
}

/// The exit handler (see the module docs).
extern "C" fn flush_at_exit() {
    // No unwinding into libc.
    let _ = std::panic::catch_unwind(flush_live);
}

fn flush_live() {
    let limit = exit_flush_limit();
    if limit.is_zero() {
        return;
    }
    // Closes from here on wait for the peer's FIN in the call.
    EXIT_STARTED.store(true, Ordering::SeqCst);
    // A generation that made no connection takes no lock.
    let Some(live) = LIVE.peek() else {
        return;
    };
    let deadline = deadline_after(Instant::now(), limit);
    // What we post from here is written by us, whichever exit handler
    // runs first (see the module docs).
    softrdma_engine::flush_posts_at_exit();
    // Bounded below the deadline too: the exiting thread itself may hold
    // it (`exit` from a signal handler that interrupted a setup or close).
    let Some(list) = live.try_lock_until(deadline.min(deadline_after(Instant::now(), LIST_WAIT)))
    else {
        return;
    };
    let mut streams: Vec<Arc<Shared>> = list.values().filter_map(Weak::upgrade).collect();
    drop(list);
    let mut phases = vec![Phase::Start; streams.len()];
    // Closed connections still waiting for the peer's FIN: waited for
    // with the others (their DisConn and FIN are out).
    if let Some(closing) = CLOSING.peek()
        && let Some(closing) =
            closing.try_lock_until(deadline.min(deadline_after(Instant::now(), LIST_WAIT)))
    {
        for (sh, _) in closing.iter() {
            streams.push(sh.clone());
            phases.push(Phase::Fin);
        }
    }
    flush_streams_from(&streams, phases, deadline);
}

/// A write of `len` octets on a connection whose exit-flush DisConn was
/// sent: accepted and dropped, by any thread (an exit handler that runs
/// after the flush, or a thread still running while the process ends).
/// Nothing can follow the DisConn on the wire, and the process is ending
/// (a kernel socket would still send them, which is not possible here).
/// Not an error: `EPIPE` would raise `SIGPIPE` under the preload and kill
/// the process in the middle of its exit. Not a wait: a thread waiting
/// for the process to end would never return to an exit handler that
/// joins it, and a waiting non-blocking writer would spin on `WouldBlock`.
pub(super) fn write_after_exit_flush(len: usize) -> io::Result<usize> {
    Ok(len)
}

/// Where a connection's exit flush stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// Not looked at yet.
    Start,
    /// Held data and the DisConn go out; `fin`: wait for the peer's FIN
    /// afterwards (there was data to send).
    Flush { fin: bool },
    /// Waiting for the peer's FIN after ours.
    Fin,
    /// Nothing more to do (or nothing can be done).
    Done,
}

/// Flushes `streams` until all are done or `deadline`, in rounds: each
/// round takes one step of every connection whose lock is free (a step
/// posts what it can and handles what has come, without waiting; a
/// connection whose lock another thread, or the exiting thread itself,
/// holds keeps its phase for the next round), and a round that made no
/// progress is followed by one wait on all their completion queues
/// together. A connection whose peer does not read costs the others
/// nothing.
#[cfg(test)]
pub(super) fn flush_streams(streams: &[Arc<Shared>], deadline: Instant) {
    flush_streams_from(streams, vec![Phase::Start; streams.len()], deadline);
}

/// [`flush_streams`], each connection from its phase in `phases`.
fn flush_streams_from(streams: &[Arc<Shared>], mut phases: Vec<Phase>, deadline: Instant) {
    let mut set = WaitSet::new();
    // The connections in `set` (rebuilt when one is done).
    let mut in_set = usize::MAX;
    // The last round made no progress after a wait that ended early.
    let mut stalled = false;
    loop {
        let mut busy = 0;
        let mut progressed = false;
        for (sh, phase) in streams.iter().zip(phases.iter_mut()) {
            if *phase == Phase::Done {
                continue;
            }
            if let Some(mut st) = sh.try_lock_now() {
                let handled = st.handled;
                let next = sh.exit_step(&mut st, *phase);
                progressed |= next != *phase || st.handled != handled;
                *phase = next;
            }
            if *phase != Phase::Done {
                busy += 1;
            }
        }
        let now = Instant::now();
        if busy == 0 || now >= deadline {
            return;
        }
        if progressed {
            stalled = false;
            continue;
        }
        if busy != in_set {
            set.clear();
            for (sh, phase) in streams.iter().zip(&phases) {
                if *phase != Phase::Done {
                    set.add_cq(&sh.cq);
                }
            }
            in_set = busy;
        }
        let nap = (deadline - now).min(NAP);
        let woken = set.wait(Some(nap)).unwrap_or(0) > 0;
        if stalled {
            // Woken for completions this thread cannot take (another
            // thread handles that connection): not a busy loop.
            std::thread::sleep(nap.min(Duration::from_millis(1)));
        }
        stalled = woken;
    }
}

impl Offload {
    /// Ends the cork (`TCP_CORK` off: the held octets are posted) if the
    /// stream's lock is free now; `false` if it is not. For exit handlers:
    /// the exiting thread may hold the lock itself (`exit` from a signal
    /// handler that interrupted a send), and waiting for it would never
    /// end.
    pub(crate) fn try_uncork(&self) -> bool {
        let sh = &*self.sh;
        let Some(mut st) = sh.try_lock_now() else {
            return false;
        };
        st.cork = false;
        st.corked_at = None;
        if !st.tx_queue.is_empty() {
            st.push = true;
            sh.flush_tx(&mut st);
        }
        sh.after(&mut st);
        true
    }
}

impl Shared {
    /// The connection state, if its lock is free now.
    fn try_lock_now(&self) -> Option<Locked<'_>> {
        self.st.try_lock().map(|g| Locked {
            sh: self,
            g: Some(g),
        })
    }

    /// One step of the exit flush (see the module docs): posts what can
    /// be posted and handles what has come, without waiting.
    pub(super) fn exit_step(&self, st: &mut Locked<'_>, phase: Phase) -> Phase {
        match phase {
            Phase::Start => {
                if st.failed() || st.sdp.close.aborted {
                    return Phase::Done;
                }
                // SO_LINGER with a zero time: the kernel resets the
                // connection at the exit, as at any close.
                if socket2::SockRef::from(&self.sock)
                    .linger()
                    .is_ok_and(|l| l == Some(Duration::ZERO))
                {
                    return Phase::Done;
                }
                self.progress(st);
                if !st.rx.is_empty() {
                    // Unread data at the (implicit) close: reset, as a
                    // close does, and as TCP does.
                    self.reset(
                        st,
                        std::io::ErrorKind::ConnectionReset,
                        "process exited with unread data",
                    );
                    return Phase::Done;
                }
                let fin = !st.tx_queue.is_empty()
                    || st.tx_inflight > 0
                    || !st.ctrl_pending.is_empty()
                    || st.zc_tx.is_some()
                    || (st.disconn_wanted && !st.sdp.close.local_disconn);
                self.exit_step(st, Phase::Flush { fin })
            }
            Phase::Flush { fin } => {
                if st.failed() {
                    return Phase::Done;
                }
                // Not while another thread's zero-copy write waits for the
                // peer: its octets come before the DisConn (that thread
                // still runs and ends it).
                if st.zc_tx.is_none() {
                    // Holds end: a DisConn is wanted (`flush_tx` holds
                    // nothing then, cork or Nagle), as the kernel's FIN
                    // pushes what its socket held. Other threads' writes
                    // are still taken until it goes.
                    if !st.disconn_wanted {
                        st.exit_flush = true;
                    }
                    st.disconn_wanted = true;
                    st.push = true;
                    st.nodelay = true;
                    self.flush_tx(st);
                }
                // Credits, completions.
                self.progress(st);
                // Another thread's write may have come since the start.
                let fin = fin || !st.tx_queue.is_empty();
                if st.tx_queue.is_empty()
                    && st.ctrl_pending.is_empty()
                    && st.sdp.close.local_disconn
                    && st.tx_inflight == 0
                {
                    // All of it is in the socket, in order.
                    return if fin && self.qp.disconnect().is_ok() {
                        Phase::Fin
                    } else {
                        Phase::Done
                    };
                }
                Phase::Flush { fin }
            }
            Phase::Fin => {
                if self.peer_fin_seen() {
                    return Phase::Done;
                }
                self.progress(st);
                if self.peer_fin_seen() {
                    Phase::Done
                } else {
                    Phase::Fin
                }
            }
            Phase::Done => Phase::Done,
        }
    }

    /// The connection has ended (the peer's FIN came after ours, or it
    /// failed).
    pub(super) fn peer_fin_seen(&self) -> bool {
        matches!(
            self.qp.state(),
            softrdma_engine::QpState::Idle | softrdma_engine::QpState::Error
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{close_pair, pair, pair_with};
    use super::*;
    use crate::Config;

    /// Small buffers: a few writes use up the peer's credits.
    fn small() -> Config {
        Config {
            buf_size: 4096,
            rx_bufs: 4,
            tx_bufs: 2,
            ..Config::default()
        }
    }

    /// Regression: the reaper thread was started with the closing
    /// thread's signal mask (a plain spawn), so a last drop in an
    /// application thread (not under the preload's blocked signals) gave
    /// it the application's mask, and process-wide signals could run the
    /// application's handlers on it. Started from a thread that blocks
    /// no signal, it now blocks every signal, as the engine's threads.
    #[test]
    fn the_reaper_thread_inherited_the_closing_threads_signal_mask() {
        std::thread::spawn(|| {
            // SIGINT and SIGTERM are open in a test's thread.
            assert!(!softrdma_engine::signal_blocked(libc::SIGINT));
            assert!(!softrdma_engine::signal_blocked(libc::SIGTERM));
            start_reaper();
        })
        .join()
        .unwrap();
        let mut found = None;
        for _ in 0..200 {
            for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
                let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
                if comm.trim_end() == "softrdma-reap" {
                    let status =
                        std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
                    found = status
                        .lines()
                        .find_map(|l| l.strip_prefix("SigBlk:"))
                        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok());
                }
            }
            if found.is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let blocked = found.expect("no softrdma-reap thread");
        for sig in [
            libc::SIGINT,
            libc::SIGUSR1,
            libc::SIGALRM,
            libc::SIGTERM,
            libc::SIGCHLD,
        ] {
            assert!(
                blocked & (1 << (sig - 1)) != 0,
                "signal {sig} not blocked in the reaper: SigBlk {blocked:016x}"
            );
        }
    }

    /// A connection whose peer does not read: writes until out of
    /// credits (data stays queued).
    fn stuck_pair() -> (Offload, Offload) {
        let (c, s) = pair_with(&small());
        let chunk = vec![7u8; 4096];
        while c.write(&chunk, true, None).is_ok() {}
        assert!(!c.sh.lock().tx_queue.is_empty() || c.sh.lock().tx_inflight > 0);
        (c, s)
    }

    /// A corked connection with `data` held.
    fn corked_pair(data: &[u8]) -> (Offload, Offload) {
        let (c, s) = pair();
        c.set_cork(true);
        assert_eq!(c.write(data, false, None).unwrap(), data.len());
        assert_eq!(c.sh.lock().tx_queue.len(), 1);
        (c, s)
    }

    /// What `s` reads until EOF (within a generous limit: a hang guard).
    fn read_to_eof(s: &Offload) -> Vec<u8> {
        let mut got = Vec::new();
        let mut b = [0u8; 4096];
        loop {
            let n = s
                .read(&mut b, false, false, Some(Duration::from_secs(30)))
                .unwrap();
            if n == 0 {
                return got;
            }
            got.extend_from_slice(&b[..n]);
        }
    }

    /// Regression: the exit flush waited up to 2 ms for each connection
    /// in turn; with many connections whose peers do not read, the
    /// bound passed before a later connection's held data and DisConn
    /// were posted (lost). One round now posts everything without
    /// waiting, then the flush waits on all connections together.
    #[test]
    fn many_stuck_streams_do_not_keep_a_corked_one_from_its_data_at_exit() {
        const STUCK: usize = 60;
        let stuck: Vec<_> = (0..STUCK).map(|_| stuck_pair()).collect();
        let (c, s) = corked_pair(b"held behind the stuck ones");
        let mut all: Vec<Arc<Shared>> = stuck.iter().map(|(c, _)| c.sh.clone()).collect();
        // Last: served after every stuck one.
        all.push(c.sh.clone());
        // Far less than 2 ms a stuck stream, far more than a round of
        // posts takes.
        flush_streams(&all, Instant::now() + Duration::from_millis(60));
        assert_eq!(read_to_eof(&s), b"held behind the stuck ones");
        drop(all);
        // Reset: a close would wait for the stuck data.
        for (c, s) in stuck {
            c.abort();
            s.abort();
        }
        close_pair(c, s);
    }

    /// Regression: the exit flush waited for each connection's lock up to
    /// its deadline; one the exiting thread holds itself (`exit` from a
    /// signal handler or a panic hook inside a call on it) used up the
    /// whole bound and left every other connection's data unsent. A held
    /// lock is now tried again next round, the others go meanwhile.
    #[test]
    fn a_stream_locked_by_the_exiting_thread_does_not_keep_the_others_from_their_data() {
        let (lc, ls) = corked_pair(b"locked");
        let (c, s) = corked_pair(b"free to go");
        let all = [lc.sh.clone(), c.sh.clone()];
        {
            let _held = lc.sh.lock();
            let reader = std::thread::spawn(move || {
                let got = read_to_eof(&s);
                (got, s)
            });
            flush_streams(&all, Instant::now() + Duration::from_millis(500));
            let (got, s) = reader.join().unwrap();
            assert_eq!(got, b"free to go");
            drop(all);
            close_pair(c, s);
        }
        close_pair(lc, ls);
    }

    /// The bound: milliseconds; a value that is not a number means the
    /// default; a huge one does not overflow the clock.
    #[test]
    fn the_bound_is_read_from_the_environment_value() {
        assert_eq!(parse_limit(None), DEFAULT_EXIT_FLUSH);
        assert_eq!(parse_limit(Some(" 250 ")), Duration::from_millis(250));
        assert_eq!(parse_limit(Some("0")), Duration::ZERO);
        assert_eq!(parse_limit(Some("1s")), DEFAULT_EXIT_FLUSH);
        let now = Instant::now();
        let huge = parse_limit(Some(&u64::MAX.to_string()));
        assert!(deadline_after(now, huge) > now + Duration::from_secs(86_400));
    }

    /// A connection is listed from its setup to its close (nothing of it
    /// is flushed at the exit after the close).
    #[test]
    fn connections_are_listed_from_setup_to_close() {
        let (c, s) = pair();
        let (kc, ks) = (key(&c.sh), key(&s.sh));
        {
            let live = LIVE.peek().expect("listed").lock();
            assert!(live.contains_key(&kc) && live.contains_key(&ks));
        }
        close_pair(c, s);
        let live = LIVE.peek().expect("listed").lock();
        assert!(!live.contains_key(&kc) && !live.contains_key(&ks));
    }

    /// The exit flush of a corked connection, run in place (as the exit
    /// handler runs it): the held octets, then the DisConn, reach the
    /// peer, which reads them and EOF.
    #[test]
    fn the_exit_flush_sends_corked_data_and_disconn() {
        let (c, s) = pair();
        c.set_cork(true);
        assert_eq!(c.write(b"held by the cork", false, None).unwrap(), 16);
        assert_eq!(c.sh.lock().tx_queue.len(), 1);
        let sh = c.sh.clone();
        let t = std::thread::spawn(move || {
            flush_streams(&[sh], Instant::now() + Duration::from_secs(60));
        });
        let mut got = Vec::new();
        let mut b = [0u8; 64];
        loop {
            let n = s
                .read(&mut b, false, false, Some(Duration::from_secs(60)))
                .unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&b[..n]);
        }
        assert_eq!(got, b"held by the cork");
        // The flush waits for the peer's FIN (it had data to send).
        drop(s);
        t.join().unwrap();
        // A write after the exit flush's DisConn, now that the peer has
        // closed too (the connection failed): accepted and dropped, not an
        // error (`EPIPE` would raise `SIGPIPE` under the preload), not a
        // wait (a thread joined by an exit handler must return), and the
        // stream is writable (a poller must not spin on `WouldBlock`).
        assert_eq!(c.write(b"late", true, None).unwrap(), 4);
        assert_eq!(c.write(b"late", false, None).unwrap(), 4);
        assert!(
            Shared::readiness(&c.sh.lock()).1,
            "not writable after the exit flush"
        );
    }
}
