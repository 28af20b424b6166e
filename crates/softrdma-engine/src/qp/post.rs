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
/// * no request of the same `post_send_list` call is large (more than
///   [`BATCH_MAX_BYTES`] of payload) or a Read or atomic (which wait for a
///   response), and the call found no Read or atomic outstanding on the
///   connection (posts behind one go out at once, as without batching,
///   also when its error ends the connection); this is the call's own
///   (kept per thread, not on the QP: another thread's post on the QP
///   cannot take it),
/// * no other thread is the CQ's poller (the posting thread is the one
///   whose poll last found the CQ empty, or none did yet: a thread whose
///   completions another thread waits for keeps writing at once), and the
///   poster polls again soon: it found the CQ empty within the last
///   [`BATCH_POLLED_NS`], or the send CQ holds completions not taken yet,
///   or posts are deferred already,
/// * fewer than [`BATCH_MAX`] posts are deferred (the post that reaches it
///   writes them all).
///
/// The poster's next poll of the QP's CQ that finds it empty writes them,
/// or the [`DEFERRED_POLLS`]th that takes completions (the QP marks its
/// CQs, [`CompletionQueue::note_deferred`]: a poll that takes completions
/// and finds no mark costs one load). A
/// backstop timer ([`BATCH_BACKSTOP`], one for all QPs) writes what a
/// poster left if it stops polling; a process that exits (`exit(3)`, a
/// return from `main`) writes what its QPs left first
/// ([`flush_at_exit`]). [`DeviceConfig::tx_batch`] off
/// (`SOFTRDMA_TX_BATCH=0` in the environment) turns batching off (every
/// post writes at once, as before).
///
/// Whoever transmits on the connection for any reason (a receive path's
/// responses, the datamover) writes the deferred requests too: they are in
/// the connection's queue.
///
/// [`DeviceConfig::tx_batch`]: crate::DeviceConfig::tx_batch
/// [`DEFERRED_POLLS`]: crate::cq::DEFERRED_POLLS
#[derive(Debug)]
pub(crate) struct TxBatch {
    /// Posts queued and not written by their poster (an upper bound: a
    /// transmit by someone else may have written them).
    deferred: AtomicU32,
    /// A CQ poll found nothing deferred: the next post is written at once.
    idle: AtomicBool,
    /// The QP is in the list written at exit ([`flush_at_exit`]).
    listed: AtomicBool,
    /// The thread that last polled the CQ (a [`thread_token`]), 0: none.
    polled_by: AtomicU64,
    /// When it did, after the poll's own transmit (engine clock, ns).
    polled_ns: AtomicU64,
    /// The QP is on the backstop's list (the shared timer is armed).
    backstop: AtomicBool,
    /// A post was deferred since the backstop last ran (it arms the next
    /// one itself, from the timer thread, which needs no wake-up then).
    used: AtomicBool,
    /// Posts deferred, and flushes by a poll and by the backstop (its
    /// timer, or its arming when no timer could be armed) (tests,
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

    /// Counts the QP's backstop as armed without a timer: only polls and
    /// arms write its deferred posts, whatever the machine's timing
    /// (tests of what a poll writes: a backstop that fires amid a burst
    /// would write part of it).
    #[cfg(test)]
    pub(crate) fn hold_backstop(&self) {
        self.backstop.store(true, Ordering::SeqCst);
    }

    /// When the CQ was last polled (engine clock, ns; 0: never), as the
    /// post that follows compares it with the time.
    #[cfg(test)]
    pub(crate) fn polled_ns(&self) -> u64 {
        self.polled_ns.load(Ordering::Relaxed)
    }

    /// The calling thread's `post_send_list` call must not defer: Reads or
    /// atomics are outstanding (`core_post_send`, under the connection's
    /// lock).
    pub(crate) fn mark_urgent(&self) {
        URGENT.with(|u| u.set(true));
    }
}

thread_local! {
    /// The calling thread's current `post_send_list` call posted a request
    /// not to defer or found Reads or atomics outstanding (set by
    /// `post_one` and `core_post_send`, taken by the call's kick). Per
    /// thread, as the call: a flag on the QP could be taken by another
    /// thread's kick between this call's post and its kick, leaving this
    /// call's request deferred.
    static URGENT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The urgency mark of one `post_send_list` call: a call made inside
/// another on the same thread (a callback that posts) starts without the
/// outer call's mark and gives it back when it ends (it could otherwise
/// take it, and the outer call's request not to defer would be deferred).
pub(crate) struct UrgentScope(bool);

impl UrgentScope {
    /// Keeps the thread's mark (set by an outer call) aside until dropped.
    pub(crate) fn enter() -> UrgentScope {
        UrgentScope(URGENT.with(|u| u.replace(false)))
    }
}

impl Drop for UrgentScope {
    fn drop(&mut self) {
        URGENT.with(|u| u.set(self.0));
    }
}

impl Default for TxBatch {
    fn default() -> Self {
        TxBatch {
            deferred: AtomicU32::new(0),
            idle: AtomicBool::new(true),
            listed: AtomicBool::new(false),
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

/// The shared backstop of a fork generation: QPs waiting for it (their
/// `backstop` flag set), one timer for all of them, not one per QP. Many
/// short connections (each deferring a few posts while it is set up and
/// closed) then cost the timer thread one wake-up per [`BATCH_BACKSTOP`]
/// at most, not one per connection. A forked child has one of its own
/// (found without a lock, see [`PerFork`]): it writes none of its
/// parent's QPs (their sockets are the parent's too), and never waits for
/// the parent's list lock, which a parent thread may have held at the
/// fork.
///
/// [`PerFork`]: crate::sys::process::PerFork
#[derive(Default)]
struct Backstop {
    qps: parking_lot::Mutex<Vec<Weak<QpInner>>>,
    /// The timer is armed (or its callback has not yet taken the list).
    armed: AtomicBool,
}

/// This fork generation's backstop.
fn backstop() -> &'static Backstop {
    static BACKSTOP: crate::sys::process::PerFork<Backstop> = crate::sys::process::PerFork::new();
    BACKSTOP.get(Backstop::default)
}

/// Puts a QP on the backstop's list (its `backstop` flag was just set) and
/// arms the shared timer if it is not; `false` if no timer could be armed
/// (the caller writes its posts now).
fn arm_backstop(qp: Weak<QpInner>) -> bool {
    let bs = backstop();
    bs.qps.lock().push(qp);
    // After the push: a callback that cleared the mark takes the list
    // after this push, or this sees the mark clear and arms.
    if bs.armed.swap(true, Ordering::SeqCst) {
        return true;
    }
    if crate::timer::arm(BATCH_BACKSTOP, backstop_fired).is_ok() {
        return true;
    }
    // No timer. QPs another thread listed since the swap above were
    // listed on the word of this call (they saw the mark set): written
    // now with this one's, as the mark is cleared (the next deferral
    // tries to arm again).
    bs.armed.store(false, Ordering::SeqCst);
    let listed = std::mem::take(&mut *bs.qps.lock());
    for qp in listed.iter().filter_map(Weak::upgrade) {
        qp.tx_batch.backstop.store(false, Ordering::SeqCst);
        if qp.tx_batch.deferred.swap(0, Ordering::SeqCst) > 0 {
            // The backstop's flush, made without its timer.
            qp.tx_batch.stats[2].fetch_add(1, Ordering::Relaxed);
            qp.core_kick();
        }
    }
    false
}

/// The backstop ran (timer thread): writes what the listed QPs deferred;
/// QPs whose posts keep being deferred stay listed (the timer is armed
/// again from here, which needs no wake-up of this thread).
fn backstop_fired() {
    let bs = backstop();
    bs.armed.store(false, Ordering::SeqCst);
    let qps = std::mem::take(&mut *bs.qps.lock());
    let mut again = Vec::new();
    for weak in qps {
        let Some(qp) = weak.upgrade() else {
            continue;
        };
        let b = &qp.tx_batch;
        if b.deferred.swap(0, Ordering::SeqCst) > 0 {
            b.stats[2].fetch_add(1, Ordering::Relaxed);
            qp.core_kick();
        }
        // Still batching: listed again.
        if b.used.swap(false, Ordering::Relaxed) {
            again.push(weak);
            continue;
        }
        b.backstop.store(false, Ordering::SeqCst);
        // A post deferred meanwhile saw the flag set and listed nothing.
        if b.deferred.load(Ordering::SeqCst) > 0 && !b.backstop.swap(true, Ordering::SeqCst) {
            again.push(weak);
        }
    }
    for weak in again {
        // No timer: `arm_backstop` wrote them (the next deferral lists
        // them again).
        arm_backstop(weak);
    }
}

/// QPs that deferred posts, of this fork generation (a child writes none
/// of its parent's, and never waits for the parent's lock, see
/// [`Backstop`]).
static EXIT_LIST: crate::sys::process::PerFork<parking_lot::Mutex<Vec<Weak<QpInner>>>> =
    crate::sys::process::PerFork::new();

/// The process is exiting ([`flush_at_exit`] began): no post is deferred
/// any more. Exit handlers registered before the engine's run after it
/// (`atexit(3)` runs the last registered first), and other threads still
/// run: a post one of them makes is written at once, not left to a poll
/// that never comes.
static EXITING: AtomicBool = AtomicBool::new(false);

/// Puts a QP that defers posts in the list written at exit (once; the
/// exit handler is registered with the first).
fn list_for_exit(qp: &QpInner) {
    if qp.tx_batch.listed.load(Ordering::Relaxed)
        || qp.tx_batch.listed.swap(true, Ordering::Relaxed)
    {
        return;
    }
    // (Not a `Once`: a forked child could wait for a parent thread that
    // was in it at the fork.)
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.load(Ordering::Relaxed) && !REGISTERED.swap(true, Ordering::Relaxed) {
        crate::sys::process::at_exit(flush_at_exit);
    }
    let mut list = EXIT_LIST.get(Default::default).lock();
    if list.len() == list.capacity() {
        // Destroyed QPs go before the list grows.
        list.retain(|w| w.strong_count() > 0);
    }
    list.push(qp.self_weak.clone());
}

/// Longest wait for the exit list's lock at exit.
pub(crate) const EXIT_LIST_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// At `exit(3)`: writes the posts the process's QPs deferred to their
/// posters' next polls. A request posted is sent as without batching,
/// also if its poster exits right after posting, without polling or
/// destroying the QP (the kernel then closes the socket in order, after
/// what was written). From here no post is deferred ([`EXITING`]): a post
/// made by a later exit handler, or by another thread meanwhile, is
/// written by its poster. The other threads still run: as any transmit,
/// this one writes only if no other thread holds the connection (which
/// then writes them itself, unless the process ends first), and leaves a
/// connection the datamover has to it. Not at `_exit(2)`, a fatal signal
/// or an abort.
pub(crate) extern "C" fn flush_at_exit() {
    // First (SeqCst, as the posters' count and check): a post deferred
    // before this is seen below, one after it is not deferred.
    EXITING.store(true, Ordering::SeqCst);
    let _ = std::panic::catch_unwind(|| {
        // A generation that listed no QP takes no lock (a forked child
        // must not wait for its parent's).
        let Some(list) = EXIT_LIST.peek() else {
            return;
        };
        // Bounded: the exiting thread itself may hold it (`exit` called
        // from a signal handler that interrupted `list_for_exit`), or
        // another thread that is stuck; the deferred posts then go with
        // their posters' polls, if any come.
        let Some(list) = list.try_lock_for(EXIT_LIST_WAIT) else {
            return;
        };
        let qps: Vec<Arc<QpInner>> = list.iter().filter_map(Weak::upgrade).collect();
        drop(list);
        for qp in qps {
            if qp.tx_batch.take_deferred() {
                qp.core_kick();
            }
        }
    });
}

/// Writes now the posts that the process's queue pairs deferred to their
/// posters' next polls, and from here on defers none (a post is written
/// by its poster): what the engine's own exit handler does at `exit(3)`.
/// For exit handlers of the layers above that post (run before or after
/// the engine's, see [`at_exit`](crate::at_exit)): calling it first makes
/// their posts written whatever the order. Idempotent; the process is
/// taken as exiting from the first call (batching stays off), so call it
/// only from an exit handler. Never blocks on another thread's work: a
/// connection another thread is transmitting on is written by that
/// thread.
pub fn flush_posts_at_exit() {
    flush_at_exit();
}

impl QpInner {
    pub(super) fn post_one(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        // What the earlier requests of the call set, kept if this one is
        // refused (a call that posts nothing kicks nothing and must leave
        // no mark for the thread's next call).
        let before = URGENT.with(|u| {
            let before = u.get();
            if !deferrable(wr) {
                u.set(true);
            }
            before
        });
        let r = self.post_one_inner(wr);
        if r.is_err() {
            URGENT.with(|u| u.set(before));
        }
        r
    }

    fn post_one_inner(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
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
        // Stored only when not 0 already (a SeqCst store is a locked
        // instruction; a count another poster raises meanwhile is then
        // left for the next poll, as if it came after this store).
        let deferred = &self.tx_batch.deferred;
        if deferred.load(Ordering::Relaxed) != 0 {
            deferred.store(0, Ordering::SeqCst);
        }
        self.core_kick();
    }

    /// Whether the requests just posted wait for the next poll.
    fn batch_defer(&self) -> bool {
        let b = &self.tx_batch;
        let urgent = URGENT.with(|u| u.replace(false));
        // The first post after a poll that found nothing to write: at once.
        // Batching needs the CQ polls' hooks, which run only with
        // poll-driven receive: without it a poll would never write them.
        let config = self.device.config();
        // A load, and a store only when set (a swap is a locked
        // instruction): two posters that both find it set both write at
        // once, as posts that found it clear one after the other would.
        let idle = b.idle.load(Ordering::Relaxed);
        if idle {
            b.idle.store(false, Ordering::Relaxed);
        }
        if idle || urgent || !config.tx_batch || !config.poll_driven_receive {
            return false;
        }
        // Another thread polls the CQ: it may be the one waiting for these.
        let by = b.polled_by.load(Ordering::Relaxed);
        if by != 0 && by != thread_token() {
            return false;
        }
        // The poster polls again soon: it did lately, or the send CQ holds
        // completions not taken yet (a stream whose requests complete as
        // they are posted may never find the CQ empty, and a poll that
        // takes completions stamps a time only if posts were deferred),
        // or posts are deferred already (the poll that writes them is due
        // anyway).
        // (The clock last: most posts of a burst find posts deferred.)
        if b.deferred.load(Ordering::Relaxed) == 0
            && self.send_cq.is_empty()
            && (by == 0
                || crate::datamover::now_ns().saturating_sub(b.polled_ns.load(Ordering::Relaxed))
                    > BATCH_POLLED_NS)
        {
            return false;
        }
        if b.deferred.fetch_add(1, Ordering::SeqCst) + 1 >= BATCH_MAX
            // After the count (SeqCst both): the exit flush sees the count
            // or this sees the flag (the caller writes them all).
            || EXITING.load(Ordering::SeqCst)
        {
            return false;
        }
        b.stats[0].fetch_add(1, Ordering::Relaxed);
        b.used.store(true, Ordering::Relaxed);
        // After the count: a poll of either CQ that takes completions
        // writes them (the poster may poll only one of them).
        self.send_cq.note_deferred();
        if !self.recv_cq.same_as(&self.send_cq) {
            self.recv_cq.note_deferred();
        }
        list_for_exit(self);
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
        self.batch_poll_at(crate::datamover::now_ns())
    }

    /// [`batch_poll`](Self::batch_poll) stamping `now`, a reading of the
    /// engine clock the caller made (a coarse one may be earlier than the
    /// time: the poll then counts as that much older, and posts are
    /// deferred less, never more).
    pub(super) fn batch_poll_at(&self, now: u64) -> u64 {
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use softrdma_proto::mpa::MpaConfig;

    use super::Ordering;
    use crate::{
        Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpInitAttr,
        QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
    };

    /// A device whose CQ polls drive the receive path (batching is on).
    fn device() -> Device {
        device_with(DeviceConfig::default())
    }

    /// [`device`] with the rest of its configuration from `cfg`.
    fn device_with(cfg: DeviceConfig) -> Device {
        Device::open_with(DeviceConfig {
            pin_threads: false,
            poll_driven_receive: true,
            ..cfg
        })
        .unwrap()
    }

    /// A connected pair and the resources its tests use.
    type Pair = (
        QueuePair,
        QueuePair,
        CompletionQueue,
        CompletionQueue,
        ProtectionDomain,
    );

    /// `a` (both queues on `cqa`) connected on loopback to `b` (on `cqb`).
    fn pair() -> Pair {
        pair_on(&device())
    }

    /// [`pair`] on `dev`.
    fn pair_on(dev: &Device) -> Pair {
        let dev = dev.clone();
        let pd = ProtectionDomain::new(&dev);
        let cqa = CompletionQueue::new(&dev, 256, None).unwrap();
        let cqb = CompletionQueue::new(&dev, 256, None).unwrap();
        let a = QueuePair::new(&pd, &QpInitAttr::new(&cqa, &cqa)).unwrap();
        let b = QueuePair::new(&pd, &QpInitAttr::new(&cqb, &cqb)).unwrap();
        crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
        (a, b, cqa, cqb, pd)
    }

    /// The QP's backstop counts as armed: only polls (and the tests) write
    /// deferred posts, whatever the machine's timing.
    fn no_backstop(q: &QueuePair) {
        q.qp().tx_batch.backstop.store(true, Ordering::SeqCst);
    }

    fn deferred(q: &QueuePair) -> u64 {
        q.qp().tx_batch.stats[0].load(Ordering::Relaxed)
    }

    /// Times a CQ poll wrote a QP's deferred posts.
    fn poll_flushes(q: &QueuePair) -> u64 {
        q.qp().tx_batch.stats[1].load(Ordering::Relaxed)
    }

    fn send(q: &QueuePair, id: u64) {
        let m = (1000 + id).to_le_bytes();
        q.post_send(&SendWr::new(id, SendOp::Send).inline(&m).signaled())
            .unwrap();
    }

    /// Posts `n` receives of 64 bytes, slot `i` at `i * 64`, ids from 100.
    fn post_receives(q: &QueuePair, dst: &MemoryRegion, n: u64) {
        for i in 0..n {
            let sge = [Sge {
                lkey: dst.lkey(),
                addr: dst.addr() + i * 64,
                length: 64,
            }];
            q.post_recv(&RecvWr::new(100 + i, &sge)).unwrap();
        }
    }

    /// Takes `n` receive completions of 8-byte Sends from `cq` and checks
    /// them: in order, byte for byte (the first carrying `1000 + first`).
    /// Send completions of the CQ's own QP are skipped.
    fn check_received(cq: &CompletionQueue, dst: &MemoryRegion, n: usize, first: u64) {
        let mut got: Vec<WorkCompletion> = Vec::new();
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < n {
            assert!(Instant::now() < deadline, "{} of {n} received", got.len());
            let k = cq.poll(&mut wc);
            got.extend(
                wc[..k]
                    .iter()
                    .filter(|w| w.opcode != WcOpcode::Send)
                    .copied(),
            );
        }
        for (i, wc) in got.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
                (100 + i as u64, WcStatus::Success, WcOpcode::Recv, 8),
                "receive {i}"
            );
            let mut m = [0u8; 8];
            dst.read(i * 64, &mut m).unwrap();
            assert_eq!(
                u64::from_le_bytes(m),
                1000 + first + i as u64,
                "message {i}"
            );
        }
    }

    /// For the tests of polls and waits that take completions: `a` (no
    /// backstop) polled its CQ and found it empty (its thread will poll
    /// again), then `n` requests of `b` came in (`a`'s CQ holds their
    /// receive completions), and `b` has 4 receives posted for the
    /// answers. Returns the receive regions, `a`'s and `b`'s.
    fn requests_came_in(
        a: &QueuePair,
        b: &QueuePair,
        cqa: &CompletionQueue,
        pd: &ProtectionDomain,
        n: u64,
    ) -> (MemoryRegion, MemoryRegion) {
        no_backstop(a);
        let adst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        let bdst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(a, &adst, n);
        post_receives(b, &bdst, 4);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        // `a`'s thread polls its CQ (and will again).
        assert_eq!(cqa.poll(&mut wc), 0);
        // Requests come in: `a`'s CQ holds their receive completions.
        for i in 0..n {
            send(b, 50 + i);
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while cqa.len() < n as usize {
            assert!(Instant::now() < deadline, "{} requests", cqa.len());
            std::thread::sleep(Duration::from_millis(1));
        }
        (adst, bdst)
    }

    /// After [`requests_came_in`]: `a` takes one request (`take`, which
    /// takes at most `wc.len()` completions, as a CQ poll or wait does) and
    /// answers four: the first at once, three deferred (its CQ is not
    /// empty: it polls again soon). Then `take` called for one completion
    /// at a time (`what`: "polls", "waits") writes the three within
    /// `max` calls, and `b` receives the four in `dst`.
    fn answers_written_by(
        a: &QueuePair,
        cqb: &CompletionQueue,
        dst: &MemoryRegion,
        max: u64,
        what: &str,
        take: impl Fn(&mut [WorkCompletion]) -> usize,
    ) {
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        assert_eq!(take(&mut wc[..1]), 1);
        for i in 0..4 {
            send(a, i);
        }
        assert_eq!(deferred(a), 3);
        let f0 = poll_flushes(a);
        let mut calls = 0;
        while poll_flushes(a) == f0 {
            assert!(
                calls < max,
                "{calls} {what} took completions, nothing written"
            );
            assert_eq!(take(&mut wc[..1]), 1);
            calls += 1;
        }
        assert_eq!(a.qp().tx_batch.deferred.load(Ordering::SeqCst), 0);
        check_received(cqb, dst, 4, 0);
    }

    /// For the urgency tests: a pair whose `a` (no backstop) is its CQ's
    /// poller and posted lately (a small post of its own would be
    /// deferred: Send 0 went), `b` with 4 receives posted in `dst`
    /// (remotely writable), and `src`, 4 KiB to write from.
    fn poster_that_defers() -> (Pair, MemoryRegion, MemoryRegion) {
        let (a, b, cqa, cqb, pd) = pair();
        no_backstop(&a);
        let dst = pd
            .register(64 * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        post_receives(&b, &dst, 4);
        let src = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        // This thread is the CQ's poller and posted lately: a small post
        // of its own would be deferred.
        assert_eq!(cqa.poll(&mut wc), 0);
        send(&a, 0);
        ((a, b, cqa, cqb, pd), dst, src)
    }

    /// The first 1 KiB of `src`, for [`large_write`].
    fn large_sge(src: &MemoryRegion) -> [Sge; 1] {
        [Sge {
            lkey: src.lkey(),
            addr: src.addr(),
            length: 1024,
        }]
    }

    /// A 1 KiB Write (never deferred) of `big` to `dst` at 1024, id 50.
    fn large_write<'a>(big: &'a [Sge], dst: &MemoryRegion) -> SendWr<'a> {
        SendWr::new(
            50,
            SendOp::Write {
                remote_addr: dst.addr() + 1024,
                rkey: dst.rkey(),
            },
        )
        .sg_list(big)
        .signaled()
    }

    /// A CQ poll that took completions ran no `Progress` hook: a poster
    /// whose CQ kept returning completions (a server answering requests
    /// while receive completions keep coming) left its posts to the 1 ms
    /// backstop. The few polls that take completions after the posts
    /// were deferred now write them.
    #[test]
    fn a_poll_that_takes_completions_writes_the_deferred_posts() {
        const N: u64 = crate::cq::DEFERRED_POLLS as u64;
        let (a, b, cqa, cqb, pd) = pair();
        let (_adst, bdst) = requests_came_in(&a, &b, &cqa, &pd, N + 1);
        // Polls that each take one completion write the three.
        answers_written_by(&a, &cqb, &bdst, N, "polls", |wc| cqa.poll(wc));
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        // Polls that take completions with nothing deferred run no hook.
        let f1 = poll_flushes(&a);
        let mut got = 0;
        while got < 4 {
            got += cqa.poll(&mut wc);
        }
        assert_eq!(poll_flushes(&a), f1);
    }

    /// The shared urgent flag raced: a request not to defer (a large one,
    /// a Read) posted by one thread was marked on the QP; another
    /// thread's post on the QP took the mark in its kick, and the first
    /// thread's kick then deferred its request. The mark is the call's now.
    #[test]
    fn an_urgent_post_is_not_deferred_when_another_thread_posts_meanwhile() {
        let ((a, _b, cqa, cqb, _pd), dst, src) = poster_that_defers();
        let qp = a.qp();
        // Its next call posts a 1 KiB Write (never deferred) ...
        let big = large_sge(&src);
        let write = large_write(&big, &dst);
        let d0 = deferred(&a);
        qp.post_one(&write).unwrap();
        // ... while another thread posts on the QP (and kicks) before this
        // call's kick.
        std::thread::scope(|s| {
            s.spawn(|| send(&a, 1));
        });
        qp.kick_posted();
        assert_eq!(deferred(&a), d0, "the large Write's kick deferred");
        check_received(&cqb, &dst, 2, 0);
        let _ = cqa;
    }

    /// The backstop is one timer for every QP: posts deferred on several
    /// QPs whose posters stop polling are all written by it, and a QP that
    /// keeps deferring stays on its list.
    #[test]
    fn one_backstop_writes_the_deferred_posts_of_several_qps() {
        let pairs: Vec<_> = (0..3).map(|_| pair()).collect();
        let mut dsts = Vec::new();
        for (a, b, cqa, _, pd) in &pairs {
            let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
            post_receives(b, &dst, 4);
            let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
            assert_eq!(cqa.poll(&mut wc), 0);
            for i in 0..4 {
                send(a, i);
            }
            assert_eq!(deferred(a), 3);
            dsts.push(dst);
        }
        // Nobody polls the senders' CQs: the backstop writes all three.
        for ((a, _, _, cqb, _), dst) in pairs.iter().zip(&dsts) {
            check_received(cqb, dst, 4, 0);
            assert!(a.qp().tx_batch.stats[2].load(Ordering::Relaxed) >= 1);
        }
        // A second burst on one of them, still without polling.
        let (a, _, _, cqb, pd) = &pairs[0];
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        let b = &pairs[0].1;
        post_receives(b, &dst, 4);
        for i in 0..4 {
            send(a, 4 + i);
        }
        check_received(cqb, &dst, 4, 4);
    }

    /// In a child process: a QP connected to the listener at `addr`
    /// (the active side), which posted eight Sends (ids 0 to 7) without
    /// polling after a poll that found nothing: seven are deferred.
    fn eight_sends_deferred(addr: &str) -> (QueuePair, CompletionQueue) {
        let dev = device();
        let pd = ProtectionDomain::new(&dev);
        let cq = CompletionQueue::new(&dev, 64, None).unwrap();
        let a = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        let mut cfg = MpaConfig::default();
        let q = a.query();
        (cfg.ird, cfg.ord) = (q.ird, q.ord);
        let n = crate::connect::mpa_connect(&mut s, &cfg, &[], Duration::from_secs(20)).unwrap();
        a.establish(s, &crate::LinkParams::from(&n)).unwrap();
        no_backstop(&a);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cq.poll(&mut wc), 0);
        for i in 0..8 {
            send(&a, i);
        }
        assert_eq!(deferred(&a), 7, "posts deferred");
        (a, cq)
    }

    /// Child half of `deferred_posts_are_written_when_the_process_exits`
    /// (run in a process of its own).
    #[test]
    #[ignore = "the child process of deferred_posts_are_written_when_the_process_exits"]
    fn exit_child() {
        let Ok(addr) = std::env::var("SOFTRDMA_TEST_EXIT_PEER") else {
            return;
        };
        let (_a, _cq) = eight_sends_deferred(&addr);
        // Exits without polling, destroying the QP or closing the device.
        std::process::exit(0);
    }

    /// Runs the ignored test `child` in a child process that connects to
    /// a listener here (its address in the environment variable `env`),
    /// accepts its connection as the passive side, and checks that the
    /// child's `n` Sends (wr_ids from 100, payloads 1000 + i) all arrive
    /// in order before the child exits successfully.
    fn child_sends_arrive(child: &str, env: &str, n: usize) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                child,
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(env, addr.to_string())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let dev = device();
        let pd = ProtectionDomain::new(&dev);
        let cq = CompletionQueue::new(&dev, 64, None).unwrap();
        let b = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, n as u64);
        let mut cfg = MpaConfig::default();
        let q = b.query();
        (cfg.ird, cfg.ord) = (q.ird, q.ord);
        let m = crate::connect::mpa_accept(&mut s, &cfg, &[], Duration::from_secs(20)).unwrap();
        b.establish(s, &crate::LinkParams::from(&m)).unwrap();
        let mut got = Vec::new();
        let mut wc = vec![WorkCompletion::success(0, WcOpcode::Send, 0); n];
        let deadline = Instant::now() + Duration::from_secs(30);
        while got.len() < n && Instant::now() < deadline {
            let k = cq.wait(&mut wc, Some(Duration::from_millis(10)));
            got.extend_from_slice(&wc[..k]);
            if got.last().is_some_and(|w| w.status != WcStatus::Success) {
                break;
            }
        }
        let status = child.wait().unwrap();
        assert!(status.success(), "child: {status}");
        let ok: Vec<u64> = got
            .iter()
            .filter(|w| w.status == WcStatus::Success)
            .map(|w| w.wr_id)
            .collect();
        assert_eq!(ok, (100..100 + n as u64).collect::<Vec<u64>>(), "{got:?}");
        for i in 0..n {
            let mut m = [0u8; 8];
            dst.read(i * 64, &mut m).unwrap();
            assert_eq!(u64::from_le_bytes(m), 1000 + i as u64, "message {i}");
        }
    }

    /// A process that exited right after posting (no poll, no destroy)
    /// lost the posts it had deferred to its next poll: the peer got only
    /// the first. They are written at exit now.
    #[test]
    fn deferred_posts_are_written_when_the_process_exits() {
        child_sends_arrive("qp::post::tests::exit_child", "SOFTRDMA_TEST_EXIT_PEER", 8);
    }

    /// Child half of `a_post_made_by_an_exit_handler_after_the_engines_is_written`.
    static LATE_QP: std::sync::OnceLock<QueuePair> = std::sync::OnceLock::new();

    extern "C" fn late_post() {
        if let Some(a) = LATE_QP.get() {
            send(a, 8);
        }
    }

    /// Child half of `a_post_made_by_an_exit_handler_after_the_engines_is_written`
    /// (run in a process of its own).
    #[test]
    #[ignore = "the child process of a_post_made_by_an_exit_handler_after_the_engines_is_written"]
    fn late_exit_child() {
        let Ok(addr) = std::env::var("SOFTRDMA_TEST_LATE_EXIT_PEER") else {
            return;
        };
        // Registered before the engine's (which comes with the first
        // deferral): runs after it.
        assert!(crate::sys::process::at_exit(late_post));
        let (a, _cq) = eight_sends_deferred(&addr);
        let _ = LATE_QP.set(a);
        std::process::exit(0);
    }

    /// Exit handlers run last registered first: one registered before the
    /// engine's (a preload's, which releases held sends into posts) ran
    /// after the engine's flush, and its small Send was deferred to a poll
    /// that never came (lost). No post is deferred once the exit began.
    #[test]
    fn a_post_made_by_an_exit_handler_after_the_engines_is_written() {
        child_sends_arrive(
            "qp::post::tests::late_exit_child",
            "SOFTRDMA_TEST_LATE_EXIT_PEER",
            9,
        );
    }

    /// `wait` took completions without running the hooks when it slept
    /// at once (no spinning): it looked only at the ring, so a poster
    /// that waits instead of polling left its posts to the backstop.
    #[test]
    fn a_wait_that_takes_completions_writes_the_deferred_posts() {
        const N: u64 = crate::cq::DEFERRED_POLLS as u64;
        let (a, b, cqa, cqb, pd) = pair_on(&device_with(DeviceConfig {
            poll_spin: Duration::ZERO,
            poll_spin_adaptive: false,
            ..DeviceConfig::default()
        }));
        let (_adst, bdst) = requests_came_in(&a, &b, &cqa, &pd, N + 1);
        answers_written_by(&a, &cqb, &bdst, N, "waits", |wc| {
            cqa.wait(wc, Some(Duration::from_secs(5)))
        });
    }

    /// A post made inside another `post_send_list` call of the same
    /// thread (a callback that posts) took the outer call's urgency mark
    /// in its kick: the outer call's large Write was then deferred.
    #[test]
    fn a_nested_post_does_not_take_the_outer_calls_urgency_mark() {
        let ((a, _b, _cqa, cqb, _pd), dst, src) = poster_that_defers();
        let qp = a.qp();
        let big = large_sge(&src);
        let write = large_write(&big, &dst);
        let d0 = deferred(&a);
        // The outer call (as `post_send_list`): posts the Write ...
        let outer = super::UrgentScope::enter();
        qp.post_one(&write).unwrap();
        // ... then a post made inside it on this thread ...
        send(&a, 1);
        // ... then the outer call's kick.
        let d1 = deferred(&a);
        qp.kick_posted();
        drop(outer);
        assert_eq!(deferred(&a), d1, "the large Write's kick deferred");
        assert!(d1 >= d0);
        check_received(&cqb, &dst, 2, 0);
    }

    /// Fails an arming of the shared backstop's timer (once it is not
    /// armed: other tests share it) while `a` is listed (as by another
    /// thread) on the word of the mark that arming set.
    fn fail_the_arming_while_listing(a: &QueuePair) {
        // Other tests share the backstop: wait until it is not armed, then
        // fail the arming and list `a` (as another thread) meanwhile.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "the backstop stayed armed");
            let weak = a.qp().self_weak.clone();
            let listed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let l2 = listed.clone();
            crate::timer::FAIL_NEXT_ARM.with(|c| {
                c.set(Some(Box::new(move || {
                    l2.store(super::arm_backstop(weak), Ordering::SeqCst);
                })))
            });
            let armed = super::arm_backstop(std::sync::Weak::new());
            // The hook is left if the timer was not armed by this call.
            if crate::timer::FAIL_NEXT_ARM.with(|c| c.take()).is_some() {
                // The mark was set (another test's timer): try again.
                assert!(armed);
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            assert!(!armed, "the arming failed");
            assert!(listed.load(Ordering::SeqCst), "listed on the mark");
            break;
        }
    }

    /// A QP whose poster stopped polling, with three posts deferred (its
    /// backstop counts as armed: only what the test does writes them).
    fn three_deferred() -> (Pair, MemoryRegion) {
        let (a, b, cqa, cqb, pd) = pair();
        no_backstop(&a);
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 4);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        assert_eq!(cqa.poll(&mut wc), 0);
        for i in 0..4 {
            send(&a, i);
        }
        assert_eq!(deferred(&a), 3);
        ((a, b, cqa, cqb, pd), dst)
    }

    /// Regression: the backstop's flush made by an arming that failed (no
    /// timer) was not counted as the backstop's: a test that checked the
    /// backstop had written its posts failed when another test's failed
    /// arming wrote them (a test-only lock kept the two apart).
    #[test]
    fn a_flush_by_a_backstop_that_could_not_arm_its_timer_was_not_counted() {
        let ((a, _b, _cqa, cqb, _pd), dst) = three_deferred();
        let flushed = a.qp().tx_batch.stats[2].load(Ordering::Relaxed);
        fail_the_arming_while_listing(&a);
        assert_eq!(a.qp().tx_batch.deferred.load(Ordering::SeqCst), 0);
        assert!(
            a.qp().tx_batch.stats[2].load(Ordering::Relaxed) > flushed,
            "counted as the backstop's flush"
        );
        check_received(&cqb, &dst, 4, 0);
    }

    /// `arm_backstop` cleared the armed mark when its timer could not be
    /// armed, also when another QP had been listed meanwhile on the word
    /// of that mark: that QP was left listed with no timer (its posts
    /// waited for someone else's deferral). They are written now.
    #[test]
    fn a_qp_listed_while_the_backstop_failed_to_arm_is_written() {
        // (It writes the QPs other tests list meanwhile too, and counts
        // those flushes as the backstop's, as its timer does.)
        let ((a, _b, _cqa, cqb, _pd), dst) = three_deferred();
        fail_the_arming_while_listing(&a);
        assert_eq!(
            a.qp().tx_batch.deferred.load(Ordering::SeqCst),
            0,
            "a QP listed with no timer"
        );
        check_received(&cqb, &dst, 4, 0);
    }

    /// Runs `f` in a forked child while another thread of this process
    /// holds `lock` across the fork; whether the child finished (a child
    /// that waits for the lock is killed after a while).
    fn in_child_while_held<T>(
        lock: &'static parking_lot::Mutex<T>,
        f: impl FnOnce() -> bool,
    ) -> bool
    where
        T: Send + 'static,
    {
        let (locked_tx, locked_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _g = lock.lock();
            locked_tx.send(()).unwrap();
            let _ = release_rx.recv();
        });
        locked_rx.recv().unwrap();
        let ok = crate::sys::process::in_child(Duration::from_secs(20), f);
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        ok
    }

    /// The backstop's list was one process-wide lock: a forked child whose
    /// parent's timer thread held it at the fork waited for ever at its
    /// first deferral. A child lists on a backstop of its own.
    #[test]
    fn a_forked_child_does_not_wait_for_the_backstop_list_a_parent_thread_held() {
        let ok = in_child_while_held(&super::backstop().qps, || {
            // Listed, the child's timer armed; it fires and takes the list.
            if !super::arm_backstop(std::sync::Weak::new()) {
                return false;
            }
            let deadline = Instant::now() + Duration::from_secs(5);
            while super::backstop().armed.load(Ordering::SeqCst) {
                if Instant::now() >= deadline {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            true
        });
        assert!(ok, "the child waited for its parent's backstop list");
    }

    /// The exit flush locked the process-wide list of QPs before looking
    /// at the fork generation: a forked child that exited while a parent
    /// thread held the list at the fork waited for ever. A child that
    /// listed no QP takes no lock.
    #[test]
    fn a_forked_child_does_not_wait_for_the_exit_list_a_parent_thread_held() {
        let ok = in_child_while_held(super::EXIT_LIST.get(Default::default), || {
            super::flush_at_exit();
            true
        });
        assert!(ok, "the child waited for its parent's exit list");
    }

    /// The exit flush took the exit list with a blocking lock: a process
    /// whose exiting thread held it already (`exit` from a signal handler
    /// that interrupted the listing of a QP) hung for ever at exit. The
    /// lock is now tried for a bounded time. (In a child: the flush marks
    /// the process as exiting.)
    #[test]
    fn the_exit_flush_does_not_hang_on_an_exit_list_the_exiting_thread_holds() {
        let ok = crate::sys::process::in_child(Duration::from_secs(20), || {
            let held = super::EXIT_LIST.get(Default::default).lock();
            super::flush_at_exit();
            drop(held);
            true
        });
        assert!(ok, "the exit flush hung on the exit list's lock");
    }
}
