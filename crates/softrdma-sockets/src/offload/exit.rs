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
//!   `SOFTRDMA_SOCKETS_EXIT_FLUSH_MS` says otherwise (`0`: no exit flush,
//!   held data is lost as before). A peer that is gone or does not read
//!   costs the exit that long at most, and what could not be sent by then
//!   is lost (the kernel would have kept sending it after the exit).
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
//! Other threads still run while exit handlers do: a connection another
//! thread works on is shared through its lock as always (taken with the
//! deadline: a lock held past it leaves that connection alone), and a
//! write after the exit flush started fails with `EPIPE` (the DisConn is
//! sent or about to be).
//!
//! **Order of exit handlers.** `atexit(3)` runs the last registered first.
//! Around this one:
//!
//! - the engine's handler writes the posts it deferred to their posters'
//!   next polls and ends deferral. This one calls it first itself
//!   ([`softrdma_engine::flush_posts_at_exit`]): run before the engine's,
//!   its own posts would otherwise be deferred to polls that only its wait
//!   makes (they would still go, later); run after it, nothing changes.
//! - the preload's autocork handler ends the exiting thread's hold (it
//!   uncorks the stream, which sends the held octets). Its holds are a
//!   cork on the stream, data already queued here: run before this one, the
//!   data is sent and this handler finds the stream uncorked; run after
//!   it, this handler has sent the data already (the DisConn ends the
//!   holds whatever the cork says) and the uncork finds nothing queued.
//!   Either way the octets go, in order, before the DisConn.
//! - an application's handler that writes to a connection and runs after
//!   this one (registered before the process's first offloaded
//!   connection) gets `EPIPE`: the connection has been shut down for
//!   writing. Registered after that connection is made, it runs before
//!   this one, and what it writes is flushed with the rest.
//!
//! Fork: the list is per fork generation ([`PerFork`]): a `fork(2)`ed
//! child never takes a lock its parent's threads may have held at the
//! fork, and does not flush its parent's connections (their bytes are the
//! parent's to send); it flushes the connections it made itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use softrdma_engine::PerFork;

use super::{Locked, Shared};

/// How long the exit flush may make the exit wait, unless
/// [`EXIT_FLUSH_ENV`] says otherwise.
pub(crate) const DEFAULT_EXIT_FLUSH: Duration = Duration::from_secs(1);

/// Environment variable: the exit flush's bound in milliseconds (`0`:
/// off). Read at the exit.
pub(crate) const EXIT_FLUSH_ENV: &str = "SOFTRDMA_SOCKETS_EXIT_FLUSH_MS";

/// Longest single wait of one connection while several are flushed (they
/// are served in turn).
const STEP: Duration = Duration::from_millis(2);

/// The live offloaded connections of this fork generation, by address.
type Live = Mutex<HashMap<usize, Weak<Shared>>>;

static LIVE: PerFork<Live> = PerFork::new();

fn key(sh: &Shared) -> usize {
    std::ptr::from_ref(sh) as usize
}

/// A connection was set up: listed until it is closed. The exit handler
/// is registered with the first one.
pub(super) fn register(sh: &Arc<Shared>) {
    // (Not a `Once`: a forked child could wait for a parent thread that
    // was in it at the fork. A child inherits the registration.)
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.load(Ordering::Relaxed) && !REGISTERED.swap(true, Ordering::Relaxed) {
        softrdma_engine::at_exit(flush_at_exit);
    }
    LIVE.get(Default::default)
        .lock()
        .insert(key(sh), Arc::downgrade(sh));
}

/// A connection was closed: no longer listed (a child leaves its parent's
/// list alone).
pub(super) fn unregister(sh: &Shared) {
    if let Some(live) = LIVE.peek() {
        live.lock().remove(&key(sh));
    }
}

/// The exit flush's bound: [`EXIT_FLUSH_ENV`] in milliseconds, else
/// [`DEFAULT_EXIT_FLUSH`].
pub(crate) fn exit_flush_limit() -> Duration {
    std::env::var(EXIT_FLUSH_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_EXIT_FLUSH, Duration::from_millis)
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
    // A generation that made no connection takes no lock.
    let Some(live) = LIVE.peek() else {
        return;
    };
    let deadline = Instant::now() + limit;
    // What we post from here is written by us, whichever exit handler
    // runs first (see the module docs).
    softrdma_engine::flush_posts_at_exit();
    let Some(list) = live.try_lock_until(deadline) else {
        return;
    };
    let streams: Vec<Arc<Shared>> = list.values().filter_map(Weak::upgrade).collect();
    drop(list);
    flush_streams(&streams, deadline);
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

/// Flushes `streams` until all are done or `deadline`, serving them in
/// turn (a connection whose peer does not read does not hold up the
/// others' until the deadline).
pub(super) fn flush_streams(streams: &[Arc<Shared>], deadline: Instant) {
    let mut phases = vec![Phase::Start; streams.len()];
    loop {
        let mut busy = false;
        for (sh, phase) in streams.iter().zip(phases.iter_mut()) {
            if *phase == Phase::Done {
                continue;
            }
            // (Also within a round: with many streams whose peers do not
            // read, a round takes a step of each.)
            if Instant::now() >= deadline {
                return;
            }
            *phase = match sh.try_lock_until(deadline) {
                Some(mut st) => sh.exit_step(&mut st, *phase, deadline),
                None => Phase::Done,
            };
            busy |= *phase != Phase::Done;
        }
        if !busy || Instant::now() >= deadline {
            return;
        }
    }
}

impl Shared {
    /// The connection state, if its lock can be had by `deadline`.
    fn try_lock_until(&self, deadline: Instant) -> Option<Locked<'_>> {
        self.st.try_lock_until(deadline).map(|g| Locked {
            sh: self,
            g: Some(g),
        })
    }

    /// One step of the exit flush (see the module docs); waits at most
    /// [`STEP`] for progress.
    pub(super) fn exit_step(&self, st: &mut Locked<'_>, phase: Phase, deadline: Instant) -> Phase {
        let step_end = deadline.min(Instant::now() + STEP);
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
                self.exit_step(st, Phase::Flush { fin }, deadline)
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
                    // pushes what its socket held.
                    st.disconn_wanted = true;
                    st.push = true;
                    st.nodelay = true;
                    self.flush_tx(st);
                }
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
                // Credits, completions (a timeout or error ends the wait
                // only; the next step looks again).
                let _ = self.wait(st, false, Some(step_end));
                phase
            }
            Phase::Fin => {
                if self.wait_fin(st, step_end) {
                    Phase::Done
                } else {
                    Phase::Fin
                }
            }
            Phase::Done => Phase::Done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{close_pair, pair};
    use super::*;

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
        // Writing after the exit flush: the stream is shut for writing.
        assert_eq!(
            c.write(b"late", false, None).unwrap_err().kind(),
            std::io::ErrorKind::BrokenPipe
        );
    }
}
