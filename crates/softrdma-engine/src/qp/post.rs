//! Posting: send and receive requests go to the connection (the protocol
//! core checks and queues them, `core_path`); receives posted before a
//! connection exists wait in `pre_rq`; the direct-send hand-off (`kick`)
//! transmits in the posting thread; small posts of a burst are written
//! together ([`TxBatch`]).

use super::*;
use crate::wr::SendFlags;

/// Small posts of a burst written with one `writev` (one system call for
/// several messages instead of one each).
///
/// A thread that polls a QP's CQ and posts to it in a loop (the usual
/// message-rate loop: poll completions, post as many new requests) makes
/// bursts of posts between two polls. The first post after a poll that
/// found nothing left to write goes out at once (latency is unchanged for
/// a ping-pong); the later small posts of a burst are queued on the
/// connection and written by the poster's next CQ poll or wait (the QP's
/// [`Progress`] hooks), all in one `writev`. A post is deferred only when
///
/// * it is small (at most [`BATCH_MAX_BYTES`] of payload, no Read or
///   atomic, which wait for a response) and no Read or atomic is
///   outstanding on the connection (posts behind one go out at once, as
///   without batching, also when its error ends the connection),
/// * no other thread is the CQ's poller (the posting thread is the one
///   whose poll last found the CQ empty, or none did yet: a thread whose
///   completions another thread waits for keeps writing at once), and the
///   poster polls again soon: it found the CQ empty within the last
///   [`BATCH_POLLED_NS`], or the send CQ holds completions not taken yet,
///   or posts are deferred already,
/// * fewer than [`BATCH_MAX`] posts are deferred (the post that reaches it
///   writes them all).
///
/// A backstop timer ([`BATCH_BACKSTOP`], one per QP at a time) writes what
/// a poster left if it stops polling. [`DeviceConfig::tx_batch`] off
/// (`SOFTRDMA_TX_BATCH=0` in the environment) turns batching off (every
/// post writes at once, as before).
///
/// [`DeviceConfig::tx_batch`]: crate::DeviceConfig::tx_batch Whoever transmits on the connection
/// for any reason (a receive path's responses, the datamover) writes the
/// deferred requests too: they are in the connection's queue.
#[derive(Debug)]
pub(crate) struct TxBatch {
    /// Posts queued and not written by their poster (an upper bound: a
    /// transmit by someone else may have written them).
    deferred: AtomicU32,
    /// A CQ poll found nothing deferred: the next post is written at once.
    idle: AtomicBool,
    /// A request not to defer was posted, or Reads or atomics are
    /// outstanding (set by `post_one` and `core_post_send`, read by the
    /// kick after the list).
    pub(super) urgent: AtomicBool,
    /// The thread that last polled the CQ (a [`thread_token`]), 0: none.
    polled_by: AtomicU64,
    /// When it did, after the poll's own transmit (engine clock, ns).
    polled_ns: AtomicU64,
    /// The backstop timer is armed.
    backstop: AtomicBool,
    /// A post was deferred since the backstop last ran (it arms the next
    /// one itself, from the timer thread, which needs no wake-up then).
    used: AtomicBool,
    /// Posts deferred, and flushes by a poll and by the backstop (tests,
    /// measurements).
    pub(crate) stats: [AtomicU64; 3],
}

/// Most payload bytes of a post that may be deferred.
pub(crate) const BATCH_MAX_BYTES: usize = crate::datapath::conn_io::COPY_MAX;
/// Most posts deferred at once.
pub(crate) const BATCH_MAX: u32 = 32;
/// A poster that polled the CQ this recently (ns) polls again soon.
pub(crate) const BATCH_POLLED_NS: u64 = 200_000;
/// A poster that stopped polling has its deferred posts written after this.
pub(crate) const BATCH_BACKSTOP: std::time::Duration = std::time::Duration::from_millis(1);

impl TxBatch {
    /// Whether posts were deferred (and now are not: the caller writes
    /// them).
    pub(crate) fn take_deferred(&self) -> bool {
        self.deferred.swap(0, Ordering::SeqCst) > 0
    }
}

impl Default for TxBatch {
    fn default() -> Self {
        TxBatch {
            deferred: AtomicU32::new(0),
            idle: AtomicBool::new(true),
            urgent: AtomicBool::new(false),
            polled_by: AtomicU64::new(0),
            polled_ns: AtomicU64::new(0),
            backstop: AtomicBool::new(false),
            used: AtomicBool::new(false),
            stats: [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)],
        }
    }
}

/// A number naming the calling thread (never 0).
fn thread_token() -> u64 {
    use std::cell::Cell;
    static NEXT: AtomicU64 = AtomicU64::new(1);
    thread_local! {
        static TOKEN: Cell<u64> = const { Cell::new(0) };
    }
    TOKEN.with(|t| {
        let mut v = t.get();
        if v == 0 {
            v = NEXT.fetch_add(1, Ordering::Relaxed);
            t.set(v);
        }
        v
    })
}

/// Whether a request may wait for the poster's next CQ poll.
fn deferrable(wr: &SendWr<'_>) -> bool {
    let len = if wr.flags.contains(SendFlags::INLINE) {
        wr.inline.len()
    } else {
        wr.sg_list.iter().map(|s| s.length as usize).sum()
    };
    len <= BATCH_MAX_BYTES
        && matches!(
            wr.op,
            SendOp::Send
                | SendOp::SendWithImm { .. }
                | SendOp::SendWithInv { .. }
                | SendOp::Write { .. }
                | SendOp::WriteWithImm { .. }
        )
}

/// Arms the backstop of a QP's deferred posts; `false` if no timer could
/// be armed.
fn arm_backstop(weak: Weak<QpInner>) -> bool {
    crate::timer::arm(BATCH_BACKSTOP, move || backstop_fired(weak)).is_ok()
}

/// The backstop ran (timer thread): writes what is deferred; while posts
/// keep being deferred it stays armed.
fn backstop_fired(weak: Weak<QpInner>) {
    let Some(qp) = weak.upgrade() else {
        return;
    };
    let b = &qp.tx_batch;
    if b.deferred.swap(0, Ordering::SeqCst) > 0 {
        b.stats[2].fetch_add(1, Ordering::Relaxed);
        qp.core_kick();
    }
    // Still batching: armed again from here (no wake-up of this thread).
    if b.used.swap(false, Ordering::Relaxed) && arm_backstop(weak.clone()) {
        return;
    }
    b.backstop.store(false, Ordering::SeqCst);
    // A post deferred meanwhile saw the flag set and armed nothing.
    if b.deferred.load(Ordering::SeqCst) > 0
        && !b.backstop.swap(true, Ordering::SeqCst)
        && !arm_backstop(weak)
    {
        b.backstop.store(false, Ordering::SeqCst);
        if b.deferred.swap(0, Ordering::SeqCst) > 0 {
            qp.core_kick();
        }
    }
}

impl QpInner {
    pub(super) fn post_one(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        if !deferrable(wr) {
            self.tx_batch.urgent.store(true, Ordering::Relaxed);
        }
        match self.core_post_send(wr) {
            Err(PostSendError::QueueFull { .. })
                if self.tx_batch.deferred.swap(0, Ordering::SeqCst) > 0 =>
            {
                // The queue is full of our own deferred posts: written
                // now, they complete and make room (a poster that retries
                // without polling must not wait for the backstop).
                self.core_kick();
                self.core_post_send(wr)
            }
            r => r,
        }
    }

    /// After `post_send`: transmits now, or leaves the requests to the
    /// poster's next CQ poll (see [`TxBatch`]).
    pub(crate) fn kick_posted(&self) {
        if self.batch_defer() {
            return;
        }
        self.tx_batch.deferred.store(0, Ordering::SeqCst);
        self.core_kick();
    }

    /// Whether the requests just posted wait for the next poll.
    fn batch_defer(&self) -> bool {
        let b = &self.tx_batch;
        let urgent = b.urgent.swap(false, Ordering::Relaxed);
        // The first post after a poll that found nothing to write: at once.
        // Batching needs the CQ polls' hooks, which run only with
        // poll-driven receive: without it a poll would never write them.
        let config = self.device.config();
        if b.idle.swap(false, Ordering::Relaxed)
            || urgent
            || !config.tx_batch
            || !config.poll_driven_receive
        {
            return false;
        }
        // Another thread polls the CQ: it may be the one waiting for these.
        let by = b.polled_by.load(Ordering::Relaxed);
        if by != 0 && by != thread_token() {
            return false;
        }
        // The poster polls again soon: it did lately, or the send CQ holds
        // completions not taken yet (a poll that finds some runs no hook:
        // a stream whose requests complete as they are posted never finds
        // the CQ empty, and stamps no time), or posts are deferred already
        // (the poll that writes them is due anyway).
        // (The clock last: most posts of a burst find posts deferred.)
        if b.deferred.load(Ordering::Relaxed) == 0
            && self.send_cq.is_empty()
            && (by == 0
                || crate::datamover::now_ns().saturating_sub(b.polled_ns.load(Ordering::Relaxed))
                    > BATCH_POLLED_NS)
        {
            return false;
        }
        if b.deferred.fetch_add(1, Ordering::SeqCst) + 1 >= BATCH_MAX {
            return false;
        }
        b.stats[0].fetch_add(1, Ordering::Relaxed);
        b.used.store(true, Ordering::Relaxed);
        // After the count (SeqCst both): a backstop that has just let go
        // of its flag sees the count, or this sees the flag clear and arms.
        if !b.backstop.swap(true, Ordering::SeqCst) && !arm_backstop(self.self_weak.clone()) {
            // No timer thread: write now.
            b.backstop.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// A CQ poll or a wait about to sleep in the calling thread (the QP's
    /// [`Progress`] hooks): writes what its posts left (see [`TxBatch`]);
    /// if there was nothing, the next post goes out at once. Returns the
    /// engine clock's time (ns) it stamped.
    pub(super) fn batch_poll(&self) -> u64 {
        let b = &self.tx_batch;
        if b.deferred.load(Ordering::SeqCst) > 0 && b.deferred.swap(0, Ordering::SeqCst) > 0 {
            b.stats[1].fetch_add(1, Ordering::Relaxed);
            self.core_kick();
        } else {
            b.idle.store(true, Ordering::Relaxed);
        }
        let me = thread_token();
        if b.polled_by.load(Ordering::Relaxed) != me {
            b.polled_by.store(me, Ordering::Relaxed);
        }
        let now = crate::datamover::now_ns();
        b.polled_ns.store(now, Ordering::Relaxed);
        now
    }

    pub(super) fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        if self.srq.is_some() {
            return Err(PostRecvError::HasSrq);
        }
        // The connection's lock is held across the check and the queuing:
        // `establish` moves the receives queued before the connection into
        // it under the same lock, so none is left behind.
        let mut g = self.lock_core();
        if let Some(cc) = g.as_mut() {
            return self.core_post_recv(cc, wr);
        }
        let policy = self.recv_policy();
        if policy == PostPolicy::Reject {
            return Err(PostRecvError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            });
        }
        if wr.sg_list.len() > self.cap.max_recv_sge as usize {
            return Err(PostRecvError::TooManySges {
                count: wr.sg_list.len(),
                max: self.cap.max_recv_sge,
            });
        }
        let stags = self.device.stags();
        let pd = self.pd.id();
        let mut bad = None;
        // One SGE (the usual case): no allocation.
        let segs = if let [sge] = wr.sg_list {
            match stags.local(sge.lkey, pd, sge.addr, sge.length, true) {
                Ok(s) => RecvSegs::One(s),
                Err(e) => {
                    bad = Some(e.wc_status());
                    RecvSegs::Many(Vec::new())
                }
            }
        } else {
            let mut segs = Vec::with_capacity(wr.sg_list.len());
            for sge in wr.sg_list {
                match stags.local(sge.lkey, pd, sge.addr, sge.length, true) {
                    Ok(s) => segs.push(s),
                    Err(e) => {
                        bad = Some(e.wc_status());
                        break;
                    }
                }
            }
            RecvSegs::Many(segs)
        };
        if let Some(status) = bad {
            // Hardware finds a bad receive when a Send uses it; softrdma
            // finds it at once. Like any error completion it puts the QP in
            // ERROR: the receives posted before it are flushed first
            // (completion order), then it completes with the error.
            drop(g);
            self.enter_error(Some(AsyncEventKind::QpFatal));
            self.complete_recv(
                WorkCompletion::error(wr.wr_id, WcOpcode::Recv, self.qp_num, status),
                false,
            );
            return Ok(());
        }
        let total_len = segs.iter().map(|s| s.len).sum();
        let wqe = RecvWqe {
            wr_id: wr.wr_id,
            segs,
            total_len,
        };
        if policy == PostPolicy::Flush {
            drop(g);
            self.flush_recv_one(wqe.wr_id);
            return Ok(());
        }
        let mut q = self.pre_rq.lock();
        if q.len() >= self.cap.max_recv_wr.max(1) as usize {
            return Err(PostRecvError::QueueFull {
                depth: self.cap.max_recv_wr,
            });
        }
        q.push_back(wqe);
        Ok(())
    }

    pub(super) fn flush_recv_one(&self, wr_id: u64) {
        self.complete_recv(
            WorkCompletion::error(wr_id, WcOpcode::Recv, self.qp_num, WcStatus::WrFlush),
            false,
        );
    }

    /// Flushes the receives queued before a connection (a QP that never
    /// connected enters ERROR).
    pub(super) fn flush_rq(&self) {
        let q = std::mem::take(&mut *self.pre_rq.lock());
        for w in q {
            self.flush_recv_one(w.wr_id);
        }
    }

    /// Direct sending: transmit in the calling thread if no one else is.
    pub(crate) fn kick(&self) {
        self.core_kick();
    }

    pub(super) fn schedule_dm(&self) {
        if let Some(me) = self.self_weak.upgrade() {
            self.device.threads().schedule(&me);
        }
    }
}
