//! The data path: each connected QP is driven by the protocol core. The
//! connection's whole state is the core's `Connection` behind one lock
//! (`QpInner::core`, a [`HandOff`], the direct-send hand-off: posters try
//! to claim it and transmit directly, every holder re-checks announced
//! work on release); the engine does the socket IO ([`RxIo`], [`TxIo`]),
//! delivers completions and events, and acts on the link actions and the
//! close timer.

use std::net::Shutdown;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use softrdma_proto::conn::{Connection, Prepared};
use softrdma_proto::types::{self as ct, LinkAction, Output};

use super::conn::{
    ConnSetup, config, core_inline_send, recv_error, send_error, with_core_recv, with_core_send,
};
use super::*;
use crate::datapath::conn_io::{RxIo, RxStep, RxStop, SendNow, TxIo, TxStop};
use crate::mr::PdMemory;
use crate::sys::mem::Memory;

/// One connection driven by the protocol core.
#[derive(Debug)]
pub(crate) struct CoreConn {
    conn: Connection<Arc<Memory>>,
    rx: RxIo,
    tx: TxIo,
    stream: Arc<super::linger::LinkStream>,
    fd: RawFd,
    /// The QP is listed with its datamover for transmission.
    pub(crate) on_dm: bool,
    /// A FIN or shutdown to do once the framed FPDUs are written.
    link: Option<LinkAction>,
    /// The link was shut down or reset.
    link_done: bool,
    /// The connection closed in order (both FINs went: the QP reached
    /// IDLE) before a reset was asked for: the reset makes no system call
    /// (nobody can sleep in the socket's `recv`, which returns end of
    /// file, and every octet was handed to the kernel in order). The
    /// kernel would still have sent an RST, and dropped what it had not
    /// transmitted yet, for a socket in `LAST_ACK` or `CLOSING` whose last
    /// data or FIN was still unsent (the peer's window closed); without
    /// the reset those octets, all of them already completed to the
    /// application, still go out after the close.
    ended_in_order: bool,
    /// Resets made on the socket (`SO_LINGER` 0 and a disconnect).
    pub(crate) resets: u32,
    /// Close in order instead of resetting (the QP is destroyed).
    orderly: bool,
    /// With `orderly`: the socket is closed once the peer has acknowledged
    /// every byte in it, at most this long after (`close_acknowledged`),
    /// by the engine (`linger`); `None`: shut down at once.
    linger: Option<std::time::Duration>,
    /// The FIN of a graceful close waits until the peer has acknowledged
    /// every byte in the socket, at most until this time ([`now_ns`]
    /// clock; `disconnect_acknowledged`).
    ///
    /// [`now_ns`]: crate::datamover::now_ns
    fin_after_ack: Option<u64>,
    /// A timer looks again at a FIN that waits (`fin_after_ack`).
    fin_timer: bool,
    /// The FIN that waits holds the process's exit until the peer's
    /// acknowledgement (`linger::hold_exit_until_ack`).
    fin_holds_exit: bool,
    /// Detail of the next reset event (the socket error).
    reset_detail: Option<String>,
    /// The core's `LlpReset` of an abort is not reported (the QP is
    /// destroyed, or the engine reports the cause itself).
    quiet_reset: bool,
    /// The close timer's deadline armed.
    timer_at: Option<u64>,
    /// Which connection this is (a receive path that let the lock go
    /// checks it is still the same one).
    epoch: u64,
    /// The socket was made blocking with this receive time limit for
    /// waiters that sleep in its `recv` (`core_rx_sleep`; `None`: still
    /// non-blocking).
    sleep_timeout: Option<std::time::Duration>,
    /// Waiters do not sleep in the socket's `recv` (it is no stream
    /// socket, or another holder of its descriptor made it non-blocking
    /// again).
    sleep_off: bool,
    /// The socket answered `TCP_MAXSEG` at the connection: a TCP socket
    /// (the first sleep in its `recv` need not ask its type).
    tcp: bool,
    /// `Some` while a [`core_post_send_now`](QpInner::core_post_send_now)
    /// transmits: the first send completion delivered meanwhile that may go
    /// straight to the poster ([`CompletionQueue::may_complete_directly`])
    /// is kept here instead of being queued on the send CQ.
    direct_wc: Option<Option<WorkCompletion>>,
    /// `Some` while a waiter that slept in the socket's `recv` runs the
    /// receive path and may take its receive completion itself
    /// ([`core_rx_sleep`](QpInner::core_rx_sleep)'s `hand`): the first
    /// successful receive completion delivered meanwhile that may go
    /// straight to the waiter ([`CompletionQueue::may_complete_directly`])
    /// is kept here instead of being queued on the receive CQ.
    direct_rwc: Option<Option<WorkCompletion>>,
}

/// Undoes what [`QpInner::core_rx_sleep`] set when it unwinds before its
/// end: the "a waiter sleeps in `recv`" flag (left set, it would keep the
/// receive threads and `poll(2)` waiters backing off from a connection
/// nobody receives on), and a receive completion's capture
/// (`CoreConn::direct_rwc`): a completion kept is queued on the receive
/// CQ, first (it is older than whatever the run pushed after it; the
/// taker, unwinding, has not let anything take completions out of the
/// CQ), and the field is cleared (a later run, or a poster's delivery,
/// would otherwise keep a completion that nobody takes, or drop this
/// one). It runs no connection code itself (that may be what panicked):
/// work a poster announced meanwhile goes to the datamover.
struct KeptOnUnwind<'a> {
    /// `None`: nothing to undo (the sleep ended normally).
    qp: Option<&'a QpInner>,
    /// `Some(epoch)`: a capture was set, on the connection of `epoch`.
    capture: Option<u64>,
}

impl Drop for KeptOnUnwind<'_> {
    fn drop(&mut self) {
        let Some(qp) = self.qp.take() else {
            return;
        };
        qp.core_rx_sleeping.store(false, Ordering::Release);
        let Some(epoch) = self.capture else {
            return;
        };
        let mut g = qp.core.lock();
        if let Some(cc) = g.as_mut().filter(|cc| cc.epoch == epoch) {
            qp.end_capture(cc);
        }
        if qp.core.release(g) {
            qp.schedule_dm();
        }
    }
}

impl CoreConn {
    /// Ends the exit hold of a FIN that waited (`fin_holds_exit`).
    fn release_exit_hold(&mut self) {
        if std::mem::take(&mut self.fin_holds_exit) {
            super::linger::release_exit_hold(&self.stream);
        }
    }
}

impl Drop for CoreConn {
    fn drop(&mut self) {
        // The connection is gone (the QP reset to IDLE, or dropped): its
        // FIN no longer holds the exit.
        self.release_exit_hold();
    }
}

/// The next [`CoreConn::epoch`].
static NEXT_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The core lock taken for anything but claiming posted work; on drop it
/// releases the lock and claims work announced meanwhile.
pub(crate) struct CoreGuard<'a> {
    qp: &'a QpInner,
    guard: Option<Guard<'a, Option<Box<CoreConn>>>>,
}

impl std::ops::Deref for CoreGuard<'_> {
    type Target = Option<Box<CoreConn>>;
    fn deref(&self) -> &Self::Target {
        self.guard.as_deref().expect("guard held until drop")
    }
}

impl std::ops::DerefMut for CoreGuard<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.guard.as_deref_mut().expect("guard held until drop")
    }
}

impl Drop for CoreGuard<'_> {
    fn drop(&mut self) {
        #[cfg(debug_assertions)]
        super::lock_order::tx_released();
        if let Some(g) = self.guard.take()
            && self.qp.core.release(g)
        {
            self.qp.core_kick();
        }
    }
}

impl QpInner {
    /// Takes the connection's lock (blocking); see [`CoreGuard`].
    pub(crate) fn lock_core(&self) -> CoreGuard<'_> {
        #[cfg(debug_assertions)]
        super::lock_order::tx_acquired();
        CoreGuard {
            qp: self,
            guard: Some(self.core.lock()),
        }
    }

    fn core_mem(&self) -> PdMemory<'_> {
        PdMemory::new(
            self.device.stags(),
            self.pd.id(),
            self.srq.as_ref().map(|s| s as &dyn crate::mr::RecvSource),
        )
    }

    /// `establish` on the core path (state lock held, QP in IDLE or RTR);
    /// `tcp`: the stream is known to be a TCP socket.
    pub(crate) fn core_establish(
        &self,
        stream: Arc<super::linger::LinkStream>,
        params: &LinkParams,
        max_payload: usize,
        already_read: &[u8],
        tcp: bool,
    ) {
        let setup = ConnSetup {
            cap: self.cap,
            ird: self.ird_limit(),
            ord: self.ord.load(Ordering::Relaxed),
            max_payload,
            srq: self.srq.is_some(),
            message_info: self.proxy.get().is_some(),
            keep_recvs: self.keep_recvs,
            close_timeout: self
                .close_timeout_ms
                .load(Ordering::Relaxed)
                .saturating_mul(1_000_000),
        };
        let conn = Connection::new(config(&setup, params));
        let fd = stream.as_raw_fd();
        let cc = CoreConn {
            conn,
            rx: RxIo::new(already_read),
            tx: TxIo::new(),
            stream,
            fd,
            on_dm: false,
            link: None,
            link_done: false,
            orderly: false,
            linger: None,
            fin_after_ack: None,
            fin_timer: false,
            fin_holds_exit: false,
            reset_detail: None,
            quiet_reset: false,
            ended_in_order: false,
            resets: 0,
            timer_at: None,
            epoch: NEXT_EPOCH.fetch_add(1, Ordering::Relaxed),
            sleep_timeout: None,
            sleep_off: false,
            tcp,
            direct_wc: None,
            direct_rwc: None,
        };
        // Raw lock: the state lock is held, nothing to hand off yet.
        let mut g = self.core.lock();
        // Receives posted before the connection (IDLE, RTR) move into it,
        // under the lock `post_recv` queues them with.
        let mut cc = Box::new(cc);
        for w in std::mem::take(&mut *self.pre_rq.lock()) {
            let _ = cc.conn.repost_recv(w.wr_id, spans_of(w.segs));
        }
        self.core_epoch.store(cc.epoch, Ordering::Release);
        *g = Some(cc);
        let _ = self.core.release(g);
        self.core_rx_wanted.store(false, Ordering::SeqCst);
        self.core_fd.store(fd, Ordering::Release);
    }

    /// `post_send` on the core path.
    pub(crate) fn core_post_send(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        let mut g = self.lock_core();
        let Some(cc) = g.as_mut() else {
            drop(g);
            // Never connected: IDLE and RTR refuse, ERROR flushes.
            return match self.send_policy() {
                PostPolicy::Reject => Err(PostSendError::InvalidState {
                    qp_num: self.qp_num,
                    state: self.state(),
                }),
                _ => {
                    let opcode = wc_opcode_of(&wr.op);
                    let wc =
                        WorkCompletion::error(wr.wr_id, opcode, self.qp_num, WcStatus::WrFlush);
                    if self.send_cq.push(wc, false).is_err() {
                        self.cq_overflow();
                    }
                    Ok(())
                }
            };
        };
        let mut mem = self.core_mem();
        let r = with_core_send(wr, self.sq_sig_all, self.device.stags(), |w| {
            cc.conn.post_send(w, &mut mem)
        });
        if cc.conn.ord_outstanding() > 0 {
            // Reads or atomics await their responses (or an error that
            // ends the connection): what is posted behind them goes out
            // at once, as the poster expects (`TxBatch`).
            self.tx_batch.mark_urgent();
        }
        // A queued request produces nothing until it is written (the
        // usual case); a local operation, a refusal's flush or an error
        // does.
        if cc.conn.has_output() {
            self.core_outputs(cc);
        }
        r.map_err(|e| send_error(e, self.qp_num, wr))
    }

    /// [`QueuePair::post_send_now`] on the core path: the request is
    /// queued and transmitted under one hold of the connection's lock (no
    /// hand-off: no announcement, no claim, no second lock); its
    /// completion, if it is produced meanwhile and may go straight to the
    /// poster, is returned. A small inline Send on an idle connection is
    /// not queued at all: `TxIo::send_now` posts, frames, writes and
    /// completes it in one pass. Whatever does not fit that path (no
    /// connection, the datamover's socket, a receive left to the holder,
    /// other requests outstanding, a proxy, a CQ that is not exclusive)
    /// is left to an ordinary post: `None`.
    pub(crate) fn core_post_send_now(
        &self,
        wr: &SendWr<'_>,
    ) -> Option<Result<Option<WorkCompletion>, PostSendError>> {
        let direct = self.send_cq.is_exclusive()
            && self.proxy.get().is_none()
            && !self.device.config().force_datamover
            && !self.core_rx_wanted.load(Ordering::Relaxed);
        let mut g = self.lock_core();
        let cc = g
            .as_mut()
            .filter(|cc| direct && !cc.on_dm && !cc.link_done && cc.conn.send_queue_len() == 0)?;
        // A small inline Send: posted, framed, written and completed in
        // one pass if the connection is idle (`TxIo::send_now`).
        let fast = core_inline_send(wr, self.sq_sig_all).map(|w| {
            cc.direct_wc = Some(None);
            match cc.tx.send_now(&mut cc.conn, cc.fd, &w) {
                SendNow::Declined => None,
                SendNow::Written(c) => {
                    if let Some(c) = c {
                        self.core_send_now_done(cc, &c);
                    }
                    if cc.conn.has_output() {
                        self.core_outputs(cc);
                    }
                    Some(TxStop::Idle)
                }
                // The rest by the general path, from where the write stopped.
                SendNow::Rest => Some(self.core_transmit(cc, usize::MAX)),
                SendNow::Failed(e) => {
                    cc.reset_detail = Some(format!("connection failed: {e}"));
                    cc.conn.handle_reset();
                    self.core_outputs(cc);
                    Some(TxStop::Failed(e))
                }
            }
        });
        let stop = if let Some(Some(stop)) = fast {
            stop
        } else {
            cc.direct_wc = None;
            let mut mem = self.core_mem();
            let r = with_core_send(wr, self.sq_sig_all, self.device.stags(), |w| {
                cc.conn.post_send(w, &mut mem)
            });
            if let Err(e) = r {
                if cc.conn.has_output() {
                    self.core_outputs(cc);
                }
                return Some(Err(send_error(e, self.qp_num, wr)));
            }
            cc.direct_wc = Some(None);
            if cc.conn.has_output() {
                self.core_outputs(cc);
            }
            self.core_transmit(cc, usize::MAX)
        };
        let wc = cc.direct_wc.take().flatten();
        if matches!(stop, TxStop::WouldBlock) {
            // The rest goes with the datamover (as `core_kick`).
            cc.on_dm = true;
            drop(g);
            self.schedule_dm();
        }
        Some(Ok(wc))
    }

    /// Delivers the completion of a send written by
    /// [`core_post_send_now`](Self::core_post_send_now)'s one pass, which
    /// the core returned instead of queuing it (nothing was queued before
    /// it): as [`core_outputs`](Self::core_outputs) delivers a send
    /// completion without a proxy.
    fn core_send_now_done(&self, cc: &mut CoreConn, c: &ct::Completion) {
        let wc = super::conn::work_completion(c, self.qp_num);
        if matches!(cc.direct_wc, Some(None))
            && cc.direct_rwc.is_none()
            && self.send_cq.may_complete_directly()
        {
            cc.direct_wc = Some(Some(wc));
        } else if self.send_cq.push(wc, false).is_err() {
            self.cq_overflow();
        }
        self.sq_outstanding.store(
            u32::try_from(cc.conn.send_queue_len()).unwrap_or(u32::MAX),
            Ordering::Relaxed,
        );
    }

    /// `post_recv` once connected (the caller holds the lock).
    pub(crate) fn core_post_recv(
        &self,
        cc: &mut CoreConn,
        wr: &RecvWr<'_>,
    ) -> Result<(), PostRecvError> {
        let mut mem = self.core_mem();
        let r = with_core_recv(wr, |w| cc.conn.post_recv(w, &mut mem));
        // A queued receive produces nothing (a flushed or refused one
        // does).
        if cc.conn.has_output() {
            self.core_outputs(cc);
        }
        r.map_err(|e| {
            recv_error(e, self.qp_num).unwrap_or(PostRecvError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            })
        })
    }

    /// A proxy handler's reply on the core path: checked now
    /// (`Connection::prepare_send`, as the engine's own request, unsignaled
    /// and `internal` so that its completion goes to the proxy), queued by
    /// [`core_post_prepared`](Self::core_post_prepared) only if the
    /// handler succeeds.
    pub(crate) fn core_prepare_send(
        &self,
        wr: &SendWr<'_>,
    ) -> Result<Prepared<Arc<Memory>>, PostSendError> {
        let mut g = self.lock_core();
        let Some(cc) = g.as_mut() else {
            return Err(PostSendError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            });
        };
        let mut mem = self.core_mem();
        let r = with_core_send(wr, false, self.device.stags(), |w| {
            let w = ct::SendWr {
                signaled: false,
                internal: true,
                ..*w
            };
            cc.conn.prepare_send(&w, &mut mem)
        });
        // A local operation executed now may have produced outputs.
        self.core_outputs(cc);
        r.map_err(|e| send_error(e, self.qp_num, wr))
    }

    /// Queues a reply checked by [`core_prepare_send`](Self::core_prepare_send);
    /// false if the connection refuses it now (gone, or its queue full).
    pub(crate) fn core_post_prepared(&self, p: Prepared<Arc<Memory>>) -> bool {
        let mut g = self.lock_core();
        let Some(cc) = g.as_mut() else {
            return false;
        };
        let ok = cc.conn.post_prepared(p).is_ok();
        self.core_outputs(cc);
        ok
    }

    /// Puts a consumed receive back at the end of the connection's receive
    /// queue (a proxy recycling the buffer of a message it served).
    pub(crate) fn core_repost_recv(&self, wr_id: u64, segs: Vec<crate::wr::LocalSeg>) -> bool {
        let mut g = self.lock_core();
        let Some(cc) = g.as_mut() else {
            return false;
        };
        cc.conn.repost_recv(wr_id, spans_of(segs))
    }

    /// Direct sending on the core path: transmit in the calling thread if
    /// no one else holds the connection.
    pub(crate) fn core_kick(&self) {
        self.core.announce();
        loop {
            let Some(mut g) = self.core.try_claim() else {
                return;
            };
            if self.core_rx_wanted.load(Ordering::SeqCst)
                && let Some(receiving) = self.rx.try_lock()
            {
                // A receiver found the connection busy and left the bytes
                // waiting on the socket to us (`core_rx`). (A try-lock: we
                // hold `core`, taken after `rx` everywhere else.)
                self.core_rx_wanted.store(false, Ordering::SeqCst);
                let (g2, _, to_dm) = self.core_rx_locked(g);
                drop(receiving);
                if to_dm {
                    // The datamover has the socket now.
                    let again = self.core.release(g2);
                    self.schedule_dm();
                    if !again {
                        return;
                    }
                    continue;
                }
                // The claim cleared the announcements: transmit below
                // whatever was posted (usually nothing is left).
                g = g2;
            }
            let Some(cc) = g.as_mut() else {
                if !self.core.release(g) {
                    return;
                }
                continue;
            };
            if cc.on_dm {
                let _ = self.core.release(g);
                return;
            }
            if self.device.config().force_datamover {
                // No direct sending: the datamover transmits.
                cc.on_dm = true;
                let _ = self.core.release(g);
                self.schedule_dm();
                return;
            }
            let stop = self.core_transmit(cc, usize::MAX);
            if matches!(stop, TxStop::WouldBlock) {
                cc.on_dm = true;
                let _ = self.core.release(g);
                self.schedule_dm();
                return;
            }
            if !self.core.release(g) {
                return;
            }
        }
    }

    /// Frames and writes (at most `budget` bytes), then acts on what the
    /// core produced: completions are delivered as soon as a request is
    /// written (and at least every 256 KiB), not after the whole queue.
    fn core_transmit(&self, cc: &mut CoreConn, budget: usize) -> TxStop {
        /// Completions of what was written are delivered at least this
        /// often.
        const DELIVER_EVERY: usize = 256 * 1024;
        let start = cc.tx.bytes_sent;
        loop {
            let used = usize::try_from(cc.tx.bytes_sent - start).unwrap_or(usize::MAX);
            let left = budget.saturating_sub(used);
            if left == 0 {
                return TxStop::Budget;
            }
            let chunk = left.min(DELIVER_EVERY);
            let mut mem = self.core_mem();
            // Nothing framed and waiting, nothing to frame: idle without
            // a round through the transmit path (after a receive, and after
            // the write that completed the only request).
            let stop = if cc.link_done || (cc.tx.pending() == 0 && !cc.conn.may_transmit()) {
                TxStop::Idle
            } else {
                cc.tx.progress(&mut cc.conn, &mut mem, cc.fd, chunk)
            };
            if let TxStop::Failed(e) = &stop {
                cc.reset_detail = Some(format!("connection failed: {e}"));
                cc.conn.handle_reset();
            }
            self.core_outputs(cc);
            match stop {
                TxStop::Completed if cc.tx.pending() == 0 && !cc.conn.may_transmit() => {
                    return TxStop::Idle;
                }
                TxStop::Budget | TxStop::Completed => {}
                _ => return stop,
            }
        }
    }

    /// Delivers the core's completions and acts on its outputs.
    ///
    /// One pass, unless the pass itself made the core produce more (the
    /// FIN it asked for was sent or failed): delivering completions and
    /// events never calls into the connection, so a second look, which
    /// every call of the data path made (four per message), found nothing.
    fn core_outputs(&self, cc: &mut CoreConn) {
        loop {
            let mut again = false;
            // Events and state changes first, as the engine raises them:
            // whoever has seen a flush completion can see its event.
            while let Some(o) = cc.conn.poll_output() {
                match o {
                    Output::State { to, .. } => {
                        if to == QpState::Idle {
                            self.closed.store(true, Ordering::SeqCst);
                        }
                        self.set_state(to);
                        if matches!(to, QpState::Idle | QpState::Error) {
                            self.device.threads().unregister(self);
                            self.core_cancel_timer(cc);
                        }
                    }
                    Output::Event(e) => self.core_event(cc, &e),
                    Output::Link(LinkAction::Reset) => {
                        cc.link_done = true;
                        cc.tx.discard();
                        // The FIN that waited goes now (or a reset): the
                        // exit no longer waits for it.
                        cc.release_exit_hold();
                        if cc.ended_in_order {
                            // Nothing left to reset (see `ended_in_order`).
                        } else if cc.orderly {
                            match cc.linger.take() {
                                Some(linger) => {
                                    super::linger::close_after_ack(cc.stream.clone(), linger);
                                }
                                None => {
                                    let _ = cc.stream.shutdown(Shutdown::Both);
                                }
                            }
                        } else {
                            cc.resets += 1;
                            let _ = crate::sys::io::reset_connection(cc.fd);
                        }
                    }
                    Output::Link(a) => cc.link = Some(a),
                }
            }
            while let Some((c, info)) = cc.conn.poll_completion_with_info() {
                let wc = super::conn::work_completion(&c, self.qp_num);
                let lost = match self.proxy.get() {
                    Some(link) => link.core_completion(self, &c, wc, info),
                    None => match c.cq {
                        // Not while a receive completion may be kept (the
                        // receive run of `core_rx_sleep`, which may let the
                        // lock go meanwhile): with one CQ for both, the
                        // kept one is older and the CQ looks empty.
                        ct::CqKind::Send
                            if matches!(cc.direct_wc, Some(None))
                                && cc.direct_rwc.is_none()
                                && self.send_cq.may_complete_directly() =>
                        {
                            cc.direct_wc = Some(Some(wc));
                            false
                        }
                        ct::CqKind::Send => self.send_cq.push(wc, false).is_err(),
                        ct::CqKind::Recv
                            if matches!(cc.direct_rwc, Some(None))
                                && wc.status.is_success()
                                && self.recv_cq.may_complete_directly() =>
                        {
                            cc.direct_rwc = Some(Some(wc));
                            false
                        }
                        ct::CqKind::Recv => self.recv_cq.push(wc, c.solicited).is_err(),
                    },
                };
                if c.cq == ct::CqKind::Send {
                    self.sq_outstanding.store(
                        u32::try_from(cc.conn.send_queue_len()).unwrap_or(u32::MAX),
                        Ordering::Relaxed,
                    );
                }
                if lost {
                    self.cq_overflow();
                }
            }
            if let Some(a) = cc.link
                && cc.tx.pending() == 0
                && !cc.link_done
                && !(matches!(a, LinkAction::SendFin) && self.core_fin_waits(cc))
            {
                cc.link = None;
                match a {
                    LinkAction::SendFin => {
                        // The core's answer (state, events) is delivered
                        // by the next pass.
                        again = true;
                        match crate::sys::io::shutdown_write(cc.fd) {
                            Ok(()) => cc.conn.handle_fin_sent(true),
                            Err(e) => {
                                // The peer's RST after its FIN: a reset now.
                                cc.reset_detail = Some(format!("connection failed: {e}"));
                                cc.conn.handle_fin_sent(false);
                            }
                        }
                    }
                    _ => {
                        cc.link_done = true;
                        let _ = cc.stream.shutdown(Shutdown::Both);
                    }
                }
            }
            if !again {
                break;
            }
        }
        self.core_arm_timer(cc);
    }

    /// Whether the FIN the connection asked for waits for the peer's
    /// acknowledgement of every byte in the socket (`fin_after_ack`): a
    /// timer then looks again every [`ACK_POLL`](super::linger::ACK_POLL).
    /// Once acknowledged, past the deadline, or without a timer, it goes.
    fn core_fin_waits(&self, cc: &mut CoreConn) -> bool {
        let Some(deadline) = cc.fin_after_ack else {
            return false;
        };
        if cc.fin_timer {
            return true;
        }
        let unacked = crate::sys::tcp::unacked_bytes(cc.fd).is_ok_and(|n| n > 0);
        if unacked && crate::datamover::now_ns() < deadline {
            let weak = self.self_weak.clone();
            let epoch = cc.epoch;
            cc.fin_timer = crate::timer::arm(super::linger::ACK_POLL, move || {
                if let Some(qp) = weak.upgrade() {
                    let mut g = qp.lock_core();
                    if let Some(cc) = g.as_mut().filter(|cc| cc.epoch == epoch) {
                        cc.fin_timer = false;
                        qp.core_outputs(cc);
                    }
                }
            })
            .is_ok();
            if cc.fin_timer {
                if !cc.fin_holds_exit {
                    // A process that exits meanwhile (without destroying
                    // the QP) waits for the acknowledgement too.
                    cc.fin_holds_exit = true;
                    let left = deadline.saturating_sub(crate::datamover::now_ns());
                    super::linger::hold_exit_until_ack(
                        cc.stream.clone(),
                        std::time::Duration::from_nanos(left),
                    );
                }
                return true;
            }
        }
        cc.fin_after_ack = None;
        false
    }

    fn core_event(&self, cc: &mut CoreConn, e: &ct::AsyncEvent) {
        let mut ev = super::conn::async_event(e, self.qp_num);
        match e.kind {
            ct::AsyncKind::TerminateReceived => {
                if let Some(code) = e.term {
                    tracing::info!(qp = self.qp_num, %code, "Terminate received");
                    *self.last_terminate.lock() = Some(TerminateInfo {
                        direction: TerminateDirection::Received,
                        code,
                    });
                }
            }
            ct::AsyncKind::LlpReset if cc.quiet_reset => return,
            ct::AsyncKind::LlpReset => {
                let detail = cc
                    .reset_detail
                    .take()
                    .unwrap_or_else(|| "local abort".into());
                ev = ev.with_detail(detail);
            }
            ct::AsyncKind::BadClose if self.state() == QpState::Closing => {
                ev = ev.with_detail("the peer did not close in time; connection reset");
            }
            _ => {
                if let Some(code) = e.term {
                    tracing::info!(qp = self.qp_num, %code, "Terminate sent");
                    *self.last_terminate.lock() = Some(TerminateInfo {
                        direction: TerminateDirection::Sent,
                        code,
                    });
                    if let Some(err) = code.known() {
                        ev = ev.with_detail(format!("sent Terminate: {}", err.name()));
                    }
                }
            }
        }
        self.device.events().push(ev);
    }

    fn core_cancel_timer(&self, cc: &mut CoreConn) {
        cc.timer_at = None;
        if let Some(id) = self.close_timer.lock().take() {
            crate::timer::cancel(id);
        }
    }

    /// Arms the close timer for the core's deadline.
    fn core_arm_timer(&self, cc: &mut CoreConn) {
        let Some(at) = cc.conn.next_timeout() else {
            return;
        };
        if cc.timer_at == Some(at) {
            return;
        }
        cc.timer_at = Some(at);
        let now = crate::datamover::now_ns();
        let after = std::time::Duration::from_nanos(at.saturating_sub(now));
        let weak = self.self_weak.clone();
        if let Ok(id) = crate::timer::arm(after, move || {
            if let Some(qp) = weak.upgrade() {
                let mut g = qp.lock_core();
                if let Some(cc) = g.as_mut() {
                    cc.conn.handle_timeout(crate::datamover::now_ns());
                    qp.core_outputs(cc);
                }
            }
        }) && let Some(old) = self.close_timer.lock().replace(id)
        {
            crate::timer::cancel(old);
        }
    }

    /// Receive progress on the core path (`blocking`: wait for the lock).
    /// Returns (bytes came in, the QP still receives).
    pub(crate) fn core_rx(&self, blocking: bool) -> (bool, bool) {
        // The receive lock says who receives: an engine thread that finds it held
        // backs off (`datamover` `receive`, `Defer::Busy`) instead of
        // re-arming the still readable socket and spinning on it while a
        // CQ poller reads.
        let receiving = if blocking {
            // Not behind a waiter that sleeps in the socket's `recv`
            // (`core_rx_sleep`): it receives what comes (a receive thread
            // woken for those bytes would wait for it, and the other QPs
            // with it). A short timed try, so that a sleep that starts
            // after the look below is seen too.
            loop {
                if self.core_rx_sleeping.load(Ordering::SeqCst) {
                    return (false, true);
                }
                if let Some(r) = self.rx.try_lock_for(std::time::Duration::from_micros(500)) {
                    break r;
                }
            }
        } else {
            match self.rx.try_lock() {
                Some(r) => r,
                None => return (false, true),
            }
        };
        let (receiving, g) = if blocking {
            (receiving, self.core.lock())
        } else {
            // A CQ poller looks at the socket first, without the lock: an
            // idle socket (the usual case while it waits for completions)
            // costs one `poll` and leaves the lock to whoever transmits.
            let fd = self.core_fd.load(Ordering::Acquire);
            if fd < 0 || !crate::sys::io::readable_now(fd) {
                return (false, true);
            }
            match self.core.try_claim() {
                Some(g) => (receiving, g),
                None => {
                    // Busy (a poster or the datamover transmits): the bytes
                    // are left to the holder, which receives them when it
                    // lets go (`core_kick`), instead of waiting here for a
                    // lock that a posting thread takes again at once. The
                    // receive lock goes first: the holder takes it next.
                    // The holder may have let go before the flag was set:
                    // claim the connection like a poster (`core_kick`
                    // receives, since the flag is set, and transmits what
                    // was posted; a claim that only received would clear
                    // a poster's announcement and strand its request).
                    drop(receiving);
                    self.core_rx_wanted.store(true, Ordering::SeqCst);
                    self.core_kick();
                    return (false, true);
                }
            }
        };
        self.core_rx_wanted.store(false, Ordering::SeqCst);
        let (g, r, to_dm) = self.core_rx_locked(g);
        drop(receiving);
        if self.core.release(g) {
            self.core_kick();
        }
        if to_dm {
            self.schedule_dm();
        }
        r
    }

    /// The receive run of [`core_rx`](Self::core_rx) with the receive lock
    /// and the connection's lock `g` held (the latter is let go across a
    /// direct read and taken again). Returns the lock, (bytes came in, the
    /// QP still receives), and whether the datamover must be scheduled
    /// (after the lock is let go).
    fn core_rx_locked<'a>(
        &'a self,
        mut g: Guard<'a, Option<Box<CoreConn>>>,
    ) -> (Guard<'a, Option<Box<CoreConn>>>, (bool, bool), bool) {
        let Some(cc) = g.as_mut() else {
            return (g, (false, false), false);
        };
        let epoch = cc.epoch;
        let mut got = false;
        cc.rx.begin();
        let stop = loop {
            let Some(cc) = g.as_mut().filter(|cc| cc.epoch == epoch) else {
                // Reset (and maybe connected again) while the lock was let
                // go: the bytes read belonged to the old connection.
                return (g, (true, false), false);
            };
            let before = cc.rx.bytes_received;
            let mut mem = self.core_mem();
            let step = cc
                .rx
                .step(&mut cc.conn, &mut mem, cc.fd, &crate::datamover::now_ns);
            got |= cc.rx.bytes_received != before;
            let mut direct = match step {
                RxStep::Stop(stop) => break stop,
                RxStep::Direct(d) => d,
            };
            // The large payload's `readv` goes straight into registered
            // memory: without the connection's lock, so that posters and
            // the datamover transmit meanwhile (the receive lock keeps
            // other receivers out; nothing but the receive path changes
            // what the connection wants to read). The stream's `Arc`
            // keeps the descriptor open across a reset meanwhile.
            let fd = cc.fd;
            let stream = cc.stream.clone();
            if self.core.release(g) {
                self.core_kick();
            }
            let r = direct.read(fd);
            g = self.core.lock();
            drop(stream);
            let Some(cc) = g.as_mut().filter(|cc| cc.epoch == epoch) else {
                return (g, (true, false), false);
            };
            let before = cc.rx.bytes_received;
            let mut mem = self.core_mem();
            let stop = cc
                .rx
                .placed(&mut cc.conn, &mut mem, direct, r, &crate::datamover::now_ns);
            got |= cc.rx.bytes_received != before;
            if let Some(stop) = stop {
                break stop;
            }
        };
        let Some(cc) = g.as_mut() else {
            return (g, (got, false), false);
        };
        if let RxStop::Failed(e) = &stop {
            // `run` reported it with `handle_reset`; the event's detail.
            cc.reset_detail = Some(format!("connection failed: {e}"));
        }
        self.core_outputs(cc);
        #[cfg(test)]
        tests::panic_after_capture_if_asked(matches!(cc.direct_rwc, Some(Some(_))));
        // Responses the receive path queued (Read and Atomic Responses, a
        // Terminate) go out now, unless the datamover has the socket.
        if self.device.config().force_datamover && !cc.on_dm {
            cc.on_dm = true;
            return (g, (true, true), true);
        }
        // Nothing framed and waiting, nothing to frame (a receive that
        // queued no response, the usual case): `core_transmit` would stop
        // at once, and its look at the outputs would find none (they were
        // delivered just now).
        let idle = cc.link_done || (cc.tx.pending() == 0 && !cc.conn.may_transmit());
        if !cc.on_dm && !idle {
            let stop = self.core_transmit(cc, usize::MAX);
            if matches!(stop, TxStop::WouldBlock) {
                cc.on_dm = true;
                return (g, (true, true), true);
            }
        }
        (g, (got, matches!(stop, RxStop::Drained)), false)
    }

    /// Ends a receive completion's capture (`CoreConn::direct_rwc`): a
    /// completion it kept and nobody will take is queued on the receive
    /// CQ ahead of what it holds ([`CompletionQueue::push_oldest`]); an
    /// overflow there puts the QP in ERROR as any push's.
    fn end_capture(&self, cc: &mut CoreConn) {
        if let Some(Some(wc)) = cc.direct_rwc.take()
            && self.recv_cq.push_oldest(wc).is_err()
        {
            self.cq_overflow();
        }
    }

    /// [`Progress::progress_sleep`] on the core path: sleeps in the
    /// socket's `recv(2)` (at most `timeout`, its `SO_RCVTIMEO`;
    /// `Duration::MAX`: no limit, no kernel timer per sleep) with the
    /// receive lock held and the connection's lock let go, into the
    /// staging buffer taken out of the connection, then runs the receive
    /// path on what came (as [`core_rx`](Self::core_rx)). The socket is
    /// made blocking on the first sleep; every other read and write of
    /// the engine passes `MSG_DONTWAIT` (`sys::io`), so only this `recv`
    /// sleeps. A socket made non-blocking again (another holder of its
    /// descriptor) ends these sleeps for the connection: `Unable`, and
    /// the caller waits with `poll(2)` as before.
    ///
    /// The receive completion handed back (`hand`, `handed`: see
    /// [`Progress::progress_sleep`]): once bytes came, with both locks
    /// held, if the receive CQ is exclusive (and the QP no proxy QP),
    /// `hand` is asked; if it says yes, [`core_outputs`](Self::core_outputs)
    /// keeps the run's first successful receive completion in
    /// `CoreConn::direct_rwc` instead of pushing it, if the CQ still may
    /// take it directly then. Every push of the QP (an exclusive CQ has
    /// no other) is made under the connection's lock while the connection
    /// exists, and the connection exists as long as the receive lock is
    /// held (`core_reset`, the only place that drops it, takes that lock
    /// first): so nothing is pushed between the look that found the CQ
    /// empty and the capture, and whatever is pushed after the capture is
    /// newer. `hand`'s yes is the caller's promise that nobody takes a
    /// completion out of the CQ before it has handled the one handed
    /// back: the two together make the hand-back a push followed at once
    /// by the caller's poll. (docs/engine.md, *Receive completions handed
    /// to the reader*.)
    pub(crate) fn core_rx_sleep(
        &self,
        timeout: std::time::Duration,
        ready: &dyn Fn() -> bool,
        hand: &mut dyn FnMut() -> bool,
        handed: &mut Option<WorkCompletion>,
    ) -> crate::cq::RxSleep {
        use crate::cq::RxSleep;
        let Some(receiving) = self.rx.try_lock() else {
            return RxSleep::Unable;
        };
        // What a receive that held the lock until now completed is seen
        // here (the lock orders it before): not slept on.
        if ready() {
            return RxSleep::Received;
        }
        // Release, not SeqCst (an `xchg`): the flag orders nothing for its
        // readers, a receive thread that met the receive lock held
        // (`core_rx`); one that reads it late waits a timed try for the
        // lock and looks again.
        self.core_rx_sleeping.store(true, Ordering::Release);
        // An unwind from here on must not leave the flag set, nor a
        // capture set below (dropped after every connection-lock guard
        // below, declared before them; before the receive lock).
        let mut keep = KeptOnUnwind {
            qp: Some(self),
            capture: None,
        };
        let g = self.core.lock();
        let mut g = g;
        let prepared = g.as_mut().and_then(|cc| {
            if cc.sleep_off {
                return None;
            }
            if cc.sleep_timeout != Some(timeout) {
                let r = match cc.sleep_timeout {
                    // A TCP socket: its time limit and one `ioctl(FIONBIO)`
                    // (two system calls; asking its type and changing its
                    // flags with `F_GETFL`/`F_SETFL` took four).
                    None if cc.tcp => crate::sys::io::set_recv_timeout(cc.fd, timeout)
                        .and_then(|()| cc.stream.set_nonblocking(false)),
                    None => crate::sys::io::make_blocking(cc.fd, timeout),
                    Some(_) => crate::sys::io::set_recv_timeout(cc.fd, timeout),
                };
                if r.is_err() {
                    cc.sleep_off = true;
                    return None;
                }
                cc.sleep_timeout = Some(timeout);
            }
            // Bytes staged already (the connection stopped taking them):
            // nothing to sleep for.
            let buf = cc.rx.take_staging()?;
            Some((cc.epoch, cc.fd, buf))
        });
        let Some((epoch, fd, mut buf)) = prepared else {
            keep.qp = None;
            self.core_rx_sleeping.store(false, Ordering::Release);
            drop(receiving);
            if self.core.release(g) {
                self.core_kick();
            }
            return RxSleep::Unable;
        };
        if self.core.release(g) {
            self.core_kick();
        }
        // The descriptor stays open while this thread sleeps on it with
        // the connection's lock let go: the connection, and the stream in
        // it, is dropped only by `core_reset`, which takes the receive
        // lock (held here until after the connection's lock is taken
        // again) first, so it waits for this sleep to end (the move to
        // ERROR before it shuts the socket down, which ends the sleep).
        // (No clone of the stream's `Arc` for the sleep: two locked
        // instructions per message.)
        let r = crate::sys::io::recv_wait(fd, &mut buf);
        let mut g = self.core.lock();
        let end = |g, receiving, out, keep: &mut KeptOnUnwind<'_>| {
            keep.qp = None;
            self.core_rx_sleeping.store(false, Ordering::Release);
            drop(receiving);
            if self.core.release(g) {
                self.core_kick();
            }
            out
        };
        let Some(cc) = g.as_mut().filter(|cc| cc.epoch == epoch) else {
            // Reset (and maybe connected again) meanwhile: the bytes read
            // belonged to the old connection.
            return end(g, receiving, RxSleep::Received, &mut keep);
        };
        let mut direct = false;
        match r {
            Ok(n) => {
                cc.rx.put_staging(buf, n);
                // Asked last: `hand` takes the caller's lock (a try). No
                // look at the CQ here: the capture looks (the caller
                // would take its lock right after anyway).
                direct =
                    n > 0 && self.recv_cq.is_exclusive() && self.proxy.get().is_none() && hand();
                if direct {
                    // Set and taken back under the receive lock, with a
                    // guard for an unwind in between (below).
                    debug_assert!(cc.direct_rwc.is_none(), "a kept receive completion left");
                    self.end_capture(cc);
                    cc.direct_rwc = Some(None);
                }
            }
            Err(e) => match e.kind() {
                io::ErrorKind::WouldBlock => {
                    cc.rx.put_staging(buf, 0);
                    if crate::sys::io::is_nonblocking(fd) {
                        cc.sleep_off = true;
                        return end(g, receiving, RxSleep::Unable, &mut keep);
                    }
                    return end(g, receiving, RxSleep::TimedOut, &mut keep);
                }
                io::ErrorKind::Interrupted => {
                    cc.rx.put_staging(buf, 0);
                    return end(g, receiving, RxSleep::Interrupted, &mut keep);
                }
                // The run acts on it (a reset: the socket now reads as
                // at its end, which would pass for the peer's FIN).
                _ => cc.rx.put_staging_error(buf, e),
            },
        }
        // Cleared only when set (a SeqCst store is a locked instruction):
        // a receiver that sets it after this look leaves it set, and the
        // next holder receives once more than needed, as when it sets it
        // after the receive below.
        if self.core_rx_wanted.load(Ordering::SeqCst) {
            self.core_rx_wanted.store(false, Ordering::SeqCst);
        }
        // An unwind out of the run (or the transmit after it) must not
        // leave the capture set, nor lose what it kept: the guard ends it.
        if direct {
            keep.capture = Some(epoch);
        }
        let (mut g, _, to_dm) = self.core_rx_locked(g);
        if direct && let Some(cc) = g.as_mut() {
            // Under the same hold as the run (the receive lock held
            // throughout: the connection is the one the field was set on).
            *handed = cc.direct_rwc.take().flatten();
        }
        let out = end(g, receiving, RxSleep::Received, &mut keep);
        if to_dm {
            self.schedule_dm();
        }
        out
    }

    /// [`core_rx`](Self::core_rx) for a waiter whose `poll(2)` found the
    /// socket readable (`wait_set`): no look at the socket first (that
    /// `poll(2)` per message otherwise). Backs off when another thread
    /// receives, as the non-blocking form; waits for the connection's lock
    /// if a poster holds it (it holds it briefly, and the bytes are there:
    /// backing off would only wake the waiter again at once).
    pub(crate) fn core_rx_readable(&self) -> (bool, bool) {
        if self.rx.is_locked() {
            return (false, true);
        }
        self.core_rx(true)
    }

    /// The datamover's transmit slice on the core path.
    pub(crate) fn core_serve(&self, slice: usize) -> crate::datamover::Served {
        use crate::datamover::Served as S;
        let mut g = self.lock_core();
        let Some(cc) = g.as_mut() else {
            return S::Done;
        };
        let stop = self.core_transmit(cc, slice);
        match stop {
            TxStop::Budget | TxStop::Completed => S::Active,
            TxStop::WouldBlock => S::Paused(cc.fd),
            TxStop::Idle | TxStop::Failed(_) => {
                cc.on_dm = false;
                self.dm_listed.store(false, Ordering::Release);
                S::Done
            }
        }
    }

    /// RTS → CLOSING on the core path; `fin_linger`: the FIN waits until
    /// the peer has acknowledged every byte in the socket, at most this
    /// long.
    pub(crate) fn core_close(&self, fin_linger: Option<std::time::Duration>) {
        let mut g = self.lock_core();
        if let Some(cc) = g.as_mut() {
            let now = crate::datamover::now_ns();
            cc.fin_after_ack = fin_linger
                .map(|l| now.saturating_add(u64::try_from(l.as_nanos()).unwrap_or(u64::MAX)));
            cc.release_exit_hold();
            cc.conn.close(now);
            self.core_outputs(cc);
        }
        drop(g);
        self.core_kick();
    }

    /// Abort (reset) on the core path; `orderly`: close in order instead
    /// (the QP is destroyed). `event`: raised if this moves the QP to
    /// ERROR (instead of the core's `LlpReset`).
    pub(crate) fn core_abort(&self, orderly: bool, event: Option<AsyncEventKind>) {
        let mut g = self.lock_core();
        match g.as_mut() {
            Some(cc) => {
                cc.orderly = orderly;
                cc.quiet_reset = orderly || event.is_some();
                if let Some(kind) = event
                    && cc.conn.state() != QpState::Error
                {
                    self.device.events().push(AsyncEvent::qp(kind, self.qp_num));
                }
                // An abort after the close completed (IDLE) only moves the QP
                // to ERROR: its connection is over on both sides.
                cc.ended_in_order = cc.conn.state() == QpState::Idle;
                cc.conn.abort();
                self.core_outputs(cc);
            }
            None => {
                // Never connected: the receives queued for the connection
                // are flushed, under the lock `post_recv` queues them with.
                if self.state() != QpState::Error {
                    self.set_state(QpState::Error);
                }
                self.flush_rq();
            }
        }
    }

    /// The application's move to TERMINATE on the core path.
    pub(crate) fn core_terminate(&self, err: TermError) {
        let mut g = self.lock_core();
        if let Some(cc) = g.as_mut() {
            cc.conn.terminate(err);
            self.core_outputs(cc);
        }
        drop(g);
        self.core_kick();
    }

    /// ERROR → IDLE on the core path: the connection is forgotten.
    pub(crate) fn core_reset(&self) {
        // The receive lock first (see the lock order on `QpInner`): a receive
        // path still running (it holds it, see `core_rx`, and may enter
        // ERROR on a failed link) finishes before the QP goes to IDLE.
        let _receiving = self.rx.lock();
        let mut g = self.lock_core();
        self.core_fd.store(-1, Ordering::Release);
        *g = None;
        drop(g);
        self.closed.store(false, Ordering::SeqCst);
        self.set_state(QpState::Idle);
    }

    /// The next orderly close of the connection (`core_abort` with
    /// `orderly`) leaves its socket to the engine, which closes it once
    /// the peer has acknowledged every byte in it, at most `linger` later.
    pub(crate) fn core_linger(&self, linger: std::time::Duration) {
        let mut g = self.lock_core();
        if let Some(cc) = g.as_mut() {
            cc.linger = Some(linger);
        }
    }

    /// The connection's ORD (min of ours and the peer's IRD), once
    /// connected.
    pub(crate) fn core_ord(&self) -> Option<u32> {
        let g = self.lock_core();
        g.as_ref().map(|cc| cc.conn.config().ord)
    }

    /// The link parameters on the core path (for `query`).
    pub(crate) fn core_link(&self) -> Option<TxLink> {
        let g = self.lock_core();
        g.as_ref().map(|cc| TxLink {
            crc: cc.conn.config().crc,
            max_payload: cc.conn.config().max_payload,
        })
    }

    /// Bytes written and read on the core path.
    pub(crate) fn core_counters(&self) -> Option<(u64, u64, usize, usize)> {
        let g = self.lock_core();
        g.as_ref().map(|cc| {
            (
                cc.tx.bytes_sent,
                cc.rx.bytes_received,
                cc.conn.send_queue_len(),
                cc.conn.recv_queue_len(),
            )
        })
    }
}

/// The completion opcode of a verbs request (a flush before any
/// connection).
fn wc_opcode_of(op: &SendOp<'_>) -> WcOpcode {
    match op {
        SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => WcOpcode::Send,
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => WcOpcode::RdmaWrite,
        SendOp::Read { .. } => WcOpcode::RdmaRead,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
        SendOp::CmpSwap { .. } => WcOpcode::CompSwap,
        SendOp::LocalInv { .. } => WcOpcode::LocalInv,
        SendOp::BindMw { .. } => WcOpcode::BindMw,
        SendOp::FastReg { .. } => WcOpcode::RegMr,
    }
}

/// A receive's checked segments as the core's spans (a receive queued
/// before the connection, a recycled proxy receive).
fn spans_of(
    segs: impl IntoIterator<Item = crate::wr::LocalSeg>,
) -> Vec<softrdma_proto::mem::Span<std::sync::Arc<crate::sys::mem::Memory>>> {
    segs.into_iter()
        .map(|s| softrdma_proto::mem::Span {
            region: s.mem,
            offset: s.offset,
            len: s.len,
        })
        .collect()
}

#[cfg(test)]
mod keep_recvs;

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use softrdma_proto::mpa::MpaConfig;

    use crate::{
        Access, CompletionQueue, Device, DeviceConfig, ProtectionDomain, QpInitAttr, QueuePair,
        RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
    };

    /// A device for these tests (threads not pinned); without
    /// `poll_driven_receive` a CQ poll receives nothing.
    fn test_device(poll_driven_receive: bool) -> Device {
        Device::open_with(DeviceConfig {
            pin_threads: false,
            poll_driven_receive,
            ..DeviceConfig::default()
        })
        .unwrap()
    }

    /// `a` (on `pda`, with `attr_a`) connected on loopback to `b` (on
    /// `pdb`, both queues on `cqb`).
    fn connected(
        pda: &ProtectionDomain,
        pdb: &ProtectionDomain,
        attr_a: &QpInitAttr,
        cqb: &CompletionQueue,
    ) -> (QueuePair, QueuePair) {
        let a = QueuePair::new(pda, attr_a).unwrap();
        let b = QueuePair::new(pdb, &QpInitAttr::new(cqb, cqb)).unwrap();
        crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
        (a, b)
    }

    /// A connected pair whose receiving side (`b`) no
    /// engine thread watches and no CQ poll receives for: only what the
    /// test calls receives.
    fn quiet_core_pair() -> (QueuePair, QueuePair, CompletionQueue, ProtectionDomain) {
        let dev = test_device(false);
        let pd = ProtectionDomain::new(&dev);
        let cqa = CompletionQueue::new(&dev, 16, None).unwrap();
        let cqb = CompletionQueue::new(&dev, 16, None).unwrap();
        let (a, b) = connected(&pd, &pd, &QpInitAttr::new(&cqa, &cqa), &cqb);
        b.qp().device.threads().unregister(&**b.qp());
        (a, b, cqb, pd)
    }

    /// A receiver (a CQ poller, an engine thread) that finds the core
    /// path's connection held by a poster used to give up and leave the
    /// bytes on the socket; an engine thread then re-armed the still
    /// readable socket and woke at once, over and over, while the credits
    /// of `perf send` waited. It now leaves them to the holder, which
    /// receives them when it lets go.
    #[test]
    fn bytes_a_busy_connection_left_are_received_by_its_holder() {
        let (a, b, cqb, pd) = quiet_core_pair();
        let dst = send_seven(&a, &b, &pd);
        let fd = b.qp().core_fd.load(super::Ordering::Acquire);
        wait_while("the Send never arrived", || {
            !crate::sys::io::readable_now(fd)
        });
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        let held = b.qp().lock_core();
        // The receiver finds the connection busy: nothing received yet.
        assert_eq!(b.qp().core_rx(false), (false, true));
        assert_eq!(cqb.poll(&mut wc), 0);
        // The holder lets go and receives what was left to it.
        drop(held);
        assert_eq!(cqb.poll(&mut wc), 1, "the holder received the Send");
        assert_eq!(
            (wc[0].wr_id, wc[0].status, wc[0].opcode, wc[0].byte_len),
            (1, WcStatus::Success, WcOpcode::Recv, 8)
        );
        let mut got = [0u8; 8];
        dst.read(0, &mut got).unwrap();
        assert_eq!(got, [7u8; 8]);
    }

    /// A Send from `a` (8 octets of 7) to `b`, whose receive is posted.
    fn send_seven(a: &QueuePair, b: &QueuePair, pd: &ProtectionDomain) -> crate::MemoryRegion {
        let src = pd.register(64, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[7u8; 8]).unwrap();
        let dst = pd.register(64, Access::LOCAL_WRITE).unwrap();
        let rsge = [Sge {
            lkey: dst.lkey(),
            addr: dst.addr(),
            length: 64,
        }];
        b.post_recv(&RecvWr::new(1, &rsge)).unwrap();
        let ssge = [Sge {
            lkey: src.lkey(),
            addr: src.addr(),
            length: 8,
        }];
        a.post_send(&SendWr::new(2, SendOp::Send).sg_list(&ssge).signaled())
            .unwrap();
        dst
    }

    /// Runs `f` on a thread of its own; fails if it has not returned
    /// within a minute (a call that waited for a sleeper, or slept itself
    /// when it should not, hangs the test).
    fn bounded<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the call did not return")
    }

    /// A waiter sleeps in the socket's `recv` (made blocking for it) and
    /// receives what comes into the connection: the Send completes
    /// byte-exact.
    #[test]
    fn a_receive_sleeping_in_recv_takes_what_comes() {
        let (a, b, cqb, pd) = quiet_core_pair();
        let sleeper = b.clone();
        let t = std::thread::spawn(move || {
            sleeper.qp().core_rx_sleep(
                Duration::from_secs(600),
                &|| false,
                &mut || false,
                &mut None,
            )
        });
        let dst = send_seven(&a, &b, &pd);
        assert_eq!(t.join().unwrap(), crate::cq::RxSleep::Received);
        let fd = b.qp().core_fd.load(super::Ordering::Acquire);
        assert!(!crate::sys::io::is_nonblocking(fd));
        // The bytes the sleep read count as received, as any read's (they
        // did not: the sleep's read went around the run's accounting).
        assert!(b.qp().core_counters().unwrap().1 > 0, "bytes received");
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqb.poll(&mut wc), 1);
        assert_eq!(
            (wc[0].wr_id, wc[0].status, wc[0].opcode, wc[0].byte_len),
            (1, WcStatus::Success, WcOpcode::Recv, 8)
        );
        let mut got = [0u8; 8];
        dst.read(0, &mut got).unwrap();
        assert_eq!(got, [7u8; 8]);
    }

    /// A waiter looked at its CQ (empty) while a receive thread still
    /// held the receive; the thread pushed a completion and let go, and
    /// the waiter slept in `recv` beside it until the sleep's timeout. The
    /// CQ is looked at again once the receive is the sleeper's.
    #[test]
    fn a_sleep_in_recv_looks_at_the_cq_once_the_receive_is_its_own() {
        let (_a, b, _cqb, _pd) = quiet_core_pair();
        // Nothing comes: without the look the sleep would end by its
        // timeout (`TimedOut`), not `Received`.
        let asked = std::sync::atomic::AtomicUsize::new(0);
        let r = b.qp().core_rx_sleep(
            Duration::from_millis(50),
            &|| {
                asked.fetch_add(1, super::Ordering::SeqCst);
                true
            },
            &mut || false,
            &mut None,
        );
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(asked.load(super::Ordering::SeqCst), 1);
        // The receive lock was let go: the next sleep may take it.
        assert_eq!(
            b.qp().core_rx_sleep(
                Duration::from_millis(20),
                &|| false,
                &mut || false,
                &mut None
            ),
            crate::cq::RxSleep::TimedOut
        );
    }

    /// A receive thread woken for a QP whose waiter sleeps in `recv`
    /// leaves the bytes to it at once instead of waiting for its receive
    /// lock (held through the sleep): other QPs of that thread would wait
    /// as long.
    #[test]
    fn a_receive_thread_does_not_wait_behind_a_sleep_in_recv() {
        let (a, b, cqb, pd) = quiet_core_pair();
        let sleeper = b.clone();
        let t = std::thread::spawn(move || {
            sleeper.qp().core_rx_sleep(
                Duration::from_secs(600),
                &|| false,
                &mut || false,
                &mut None,
            )
        });
        wait_while("the waiter never slept", || {
            !b.qp().core_rx_sleeping.load(super::Ordering::SeqCst)
        });
        let thread = b.clone();
        assert_eq!(bounded(move || thread.qp().core_rx(true)), (false, true));
        let _dst = send_seven(&a, &b, &pd);
        assert_eq!(t.join().unwrap(), crate::cq::RxSleep::Received);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqb.poll(&mut wc), 1);
    }

    /// Regression: a reset that ended a sleep in `recv` was taken by that
    /// `recv` (`ECONNRESET`), and the receive run after it read the end
    /// of the socket: the connection began to close as if the peer had
    /// sent its FIN, and failed only when its own FIN could not go out
    /// ("not connected"). The run now acts on the sleep's error: the QP
    /// reports the peer's reset.
    #[test]
    fn a_reset_that_ends_a_sleep_in_recv_is_reported_as_the_peers_reset() {
        let (a, b, _cqb, _pd) = quiet_core_pair();
        let sleeper = b.clone();
        let t = std::thread::spawn(move || {
            sleeper.qp().core_rx_sleep(
                Duration::from_secs(600),
                &|| false,
                &mut || false,
                &mut None,
            )
        });
        wait_while("the waiter never slept", || {
            !b.qp().core_rx_sleeping.load(super::Ordering::SeqCst)
        });
        // The peer's connection is reset (RST), as by a process that died.
        let fd = a.qp().core_fd.load(super::Ordering::Acquire);
        crate::sys::io::reset_connection(fd).unwrap();
        assert_eq!(t.join().unwrap(), crate::cq::RxSleep::Received);
        assert_eq!(b.state(), crate::QpState::Error);
        let mut resets = Vec::new();
        while let Some(ev) = b.qp().device.async_events().try_get() {
            if ev.qp_num == Some(b.qp_num()) && ev.kind == crate::AsyncEventKind::LlpReset {
                resets.push(ev.detail.unwrap_or_default());
            }
        }
        assert!(
            resets.iter().any(|d| d.contains("reset by peer")),
            "no reset by the peer reported: {resets:?}"
        );
    }

    /// Another holder of the socket's open file may make it non-blocking
    /// again: the sleep's `recv` then returns at once, which is told from
    /// its time limit, and the connection's waiters stop sleeping in
    /// `recv` (they would spin) and wait in `poll(2)` again.
    #[test]
    fn a_socket_made_non_blocking_again_ends_sleeps_in_recv() {
        let (_a, b, _cqb, _pd) = quiet_core_pair();
        assert_eq!(
            b.qp().core_rx_sleep(
                Duration::from_millis(20),
                &|| false,
                &mut || false,
                &mut None
            ),
            crate::cq::RxSleep::TimedOut
        );
        let fd = b.qp().core_fd.load(super::Ordering::Acquire);
        crate::sys::io::set_nonblocking(fd, true).unwrap();
        let q = b.clone();
        let r = bounded(move || {
            [
                q.qp().core_rx_sleep(
                    Duration::from_secs(600),
                    &|| false,
                    &mut || false,
                    &mut None,
                ),
                q.qp().core_rx_sleep(
                    Duration::from_secs(600),
                    &|| false,
                    &mut || false,
                    &mut None,
                ),
            ]
        });
        assert_eq!(r, [crate::cq::RxSleep::Unable; 2]);
    }

    /// A pair whose both sides have their engine threads (for the batching
    /// tests) and CQs of their own.
    fn batch_pair() -> (
        QueuePair,
        QueuePair,
        CompletionQueue,
        CompletionQueue,
        ProtectionDomain,
    ) {
        let dev = test_device(true);
        let pd = ProtectionDomain::new(&dev);
        let cqa = CompletionQueue::new(&dev, 256, None).unwrap();
        let cqb = CompletionQueue::new(&dev, 256, None).unwrap();
        let (a, b) = connected(&pd, &pd, &QpInitAttr::new(&cqa, &cqa), &cqb);
        (a, b, cqa, cqb, pd)
    }

    /// A burst of signaled 8-byte Sends of the CQ's poller (ids from 0,
    /// each carrying `1000 + id`): the first goes out at once; the rest
    /// are posted once its completion is in the send CQ (a poll will take
    /// it: they are deferred whatever the time since this thread's last
    /// poll, which a loaded machine may stretch past `BATCH_POLLED_NS`
    /// before the second post).
    fn post_small_burst(q: &QueuePair, cq: &CompletionQueue, n: u64) {
        post_small_sends(q, 0..1);
        let deadline = Instant::now() + Duration::from_secs(20);
        while cq.is_empty() {
            assert!(Instant::now() < deadline, "the first post never completed");
            std::thread::yield_now();
        }
        post_small_sends(q, 1..n);
    }

    /// Posts signaled 8-byte Sends with the ids of `ids`, each carrying
    /// `1000 + id` (what `check_received` expects).
    fn post_small_sends(q: &QueuePair, ids: std::ops::Range<u64>) {
        for i in ids {
            let m = (1000 + i).to_le_bytes();
            q.post_send(&SendWr::new(i, SendOp::Send).inline(&m).signaled())
                .unwrap();
        }
    }

    /// (bytes written, `writev` calls) of a QP's connection.
    fn tx_counts(q: &QueuePair) -> (u64, u64) {
        let g = q.qp().lock_core();
        let cc = g.as_ref().expect("connected");
        (cc.tx.bytes_sent, cc.tx.writes)
    }

    /// Polls `cq` until `n` completions came (20 s at most).
    fn take(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.len() < n {
            assert!(
                Instant::now() < deadline,
                "{} of {n} completions",
                got.len()
            );
            let k = cq.poll(&mut wc);
            got.extend_from_slice(&wc[..k]);
        }
        got
    }

    /// Receives `n` 8-byte Sends on `b` into slots of `dst` and checks
    /// them: in order, exactly once, byte for byte.
    fn check_received(b: &QueuePair, cqb: &CompletionQueue, dst: &crate::MemoryRegion, n: u64) {
        let got = take(cqb, n as usize);
        for (i, wc) in got.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
                (100 + i as u64, WcStatus::Success, WcOpcode::Recv, 8),
                "receive {i}"
            );
            let mut m = [0u8; 8];
            dst.read(i * 64, &mut m).unwrap();
            assert_eq!(u64::from_le_bytes(m), 1000 + i as u64, "message {i}");
        }
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqb.poll(&mut wc), 0, "no receive completes twice");
        let _ = b;
    }

    /// Posts `b` `n` receives of 64 bytes each, slot `i` at `i * 64`.
    fn post_receives(b: &QueuePair, dst: &crate::MemoryRegion, n: u64) {
        for i in 0..n {
            let sge = [Sge {
                lkey: dst.lkey(),
                addr: dst.addr() + i * 64,
                length: 64,
            }];
            b.post_recv(&RecvWr::new(100 + i, &sge)).unwrap();
        }
    }

    /// A burst of small posts between two CQ polls of the posting thread
    /// goes out in one `writev` at the next poll (the first post of the
    /// burst at once), and every message arrives byte for byte, in order,
    /// exactly once, with one send completion each, in order.
    #[test]
    fn a_burst_of_small_posts_goes_out_in_one_writev_at_the_next_poll() {
        let (a, b, cqa, cqb, pd) = batch_pair();
        // Only the poll writes (the 1 ms backstop, shared with every other
        // QP of the process, could fire amid the burst on a busy machine).
        a.qp().tx_batch.hold_backstop();
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 10);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        // This thread polls the sending CQ: it will poll again.
        assert_eq!(cqa.poll(&mut wc), 0);
        let (bytes0, writes0) = tx_counts(&a);
        post_small_burst(&a, &cqa, 10);
        let (bytes1, writes1) = tx_counts(&a);
        assert_eq!(writes1 - writes0, 1, "only the first post wrote");
        let one = bytes1 - bytes0;
        let deferred = a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed);
        assert_eq!(deferred, 9);
        let polled = a.qp().tx_batch.stats[1].load(super::Ordering::Relaxed);
        let sends = take(&cqa, 10);
        let (bytes2, writes2) = tx_counts(&a);
        assert_eq!(bytes2 - bytes0, 10 * one, "every message written once");
        assert_eq!(writes2 - writes1, 1, "the nine in one writev");
        assert_eq!(
            a.qp().tx_batch.stats[1].load(super::Ordering::Relaxed),
            polled + 1,
            "written by a poll"
        );
        for (i, wc) in sends.iter().enumerate() {
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode),
                (i as u64, WcStatus::Success, WcOpcode::Send)
            );
        }
        assert_eq!(cqa.poll(&mut wc), 0, "no send completes twice");
        check_received(&b, &cqb, &dst, 10);
    }

    /// A poster that stops polling its CQ has its deferred posts written
    /// by the backstop timer.
    #[test]
    fn deferred_posts_are_written_when_the_poster_stops_polling() {
        let (a, b, cqa, cqb, pd) = batch_pair();
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 5);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqa.poll(&mut wc), 0);
        post_small_burst(&a, &cqa, 5);
        assert_eq!(a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed), 4);
        // `a`'s CQ is not polled: the peer gets the messages all the same.
        check_received(&b, &cqb, &dst, 5);
        assert!(a.qp().tx_batch.stats[2].load(super::Ordering::Relaxed) >= 1);
        // Another burst, still without polling (the send CQ holds the
        // first burst's completions): the backstop, armed again, writes it.
        let deferred = a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed);
        let dst2 = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst2, 5);
        for i in 0..5u64 {
            let m = (1000 + i).to_le_bytes();
            a.post_send(&SendWr::new(5 + i, SendOp::Send).inline(&m).signaled())
                .unwrap();
        }
        assert!(a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed) > deferred);
        check_received(&b, &cqb, &dst2, 5);
        let sends = take(&cqa, 10);
        let ids: Vec<u64> = sends.iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..10).collect::<Vec<u64>>());
    }

    /// A poster that arms its CQ (to wait for the event) has its deferred
    /// posts written at once, not by the backstop.
    #[test]
    fn arming_the_cq_writes_the_deferred_posts() {
        let dev = test_device(true);
        let pd = ProtectionDomain::new(&dev);
        let ch = crate::CompletionChannel::new(&dev).unwrap();
        let cqa = CompletionQueue::new(&dev, 256, Some(&ch)).unwrap();
        let cqb = CompletionQueue::new(&dev, 256, None).unwrap();
        let (a, b) = connected(&pd, &pd, &QpInitAttr::new(&cqa, &cqa), &cqb);
        // No backstop: what the arm does not write is never written (a
        // timer could otherwise write them first on a busy machine).
        a.qp().tx_batch.hold_backstop();
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 5);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqa.poll(&mut wc), 0);
        post_small_burst(&a, &cqa, 5);
        let st = &a.qp().tx_batch.stats;
        assert_eq!(st[0].load(super::Ordering::Relaxed), 4);
        let polls = st[1].load(super::Ordering::Relaxed);
        cqa.req_notify(false).unwrap();
        assert_eq!(
            st[1].load(super::Ordering::Relaxed),
            polls + 1,
            "written by the arm"
        );
        assert!(tx_counts(&a).1 >= 2);
        check_received(&b, &cqb, &dst, 5);
    }

    /// Posts from a thread that is not the CQ's poller are written at once
    /// (its completions may be waited for by the other thread).
    #[test]
    fn posts_of_a_thread_that_does_not_poll_are_written_at_once() {
        let (a, b, cqa, cqb, pd) = batch_pair();
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 5);
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
                assert_eq!(cqa.poll(&mut wc), 0);
            });
        });
        let (_, writes0) = tx_counts(&a);
        post_small_sends(&a, 0..5u64);
        assert_eq!(a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed), 0);
        assert_eq!(tx_counts(&a).1 - writes0, 5, "one writev per post");
        check_received(&b, &cqb, &dst, 5);
    }

    /// Bursts framed together while the peer does not read: a coalesced
    /// `writev` that fills the socket hands the rest to the datamover, and
    /// nothing is lost or written twice (each 256-byte Write lands at its
    /// own offset, byte for byte; every post completes once, in order).
    #[test]
    fn a_coalesced_transmit_that_hits_would_block_loses_nothing() {
        let (a, b, cqa, cqb, pda, pdb) = quiet_core_pair_batching();
        const SIZE: usize = 256;
        const N: usize = 40_000;
        let dst = pdb
            .register(N * SIZE, Access::LOCAL_WRITE | Access::REMOTE_WRITE)
            .unwrap();
        let src = pda.register(N * SIZE, Access::LOCAL_WRITE).unwrap();
        for i in 0..N {
            src.write(i * SIZE, &[(i % 251) as u8; SIZE]).unwrap();
            src.write(i * SIZE, &(i as u64).to_le_bytes()).unwrap();
        }
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 64];
        let mut done = Vec::with_capacity(N);
        let mut posted = 0usize;
        let mut blocked = false;
        let deadline = Instant::now() + Duration::from_secs(60);
        while done.len() < N {
            assert!(Instant::now() < deadline, "{} of {N} written", done.len());
            let k = cqa.poll(&mut wc);
            done.extend(wc[..k].iter().map(|w| (w.wr_id, w.status)));
            // Bursts of up to 31 (deferred, then one writev at the poll).
            let mut burst = 0;
            while posted < N && burst < 31 && posted - done.len() < 100 {
                let sge = [Sge {
                    lkey: src.lkey(),
                    addr: src.addr() + (posted * SIZE) as u64,
                    length: SIZE as u32,
                }];
                let op = SendOp::Write {
                    remote_addr: dst.addr() + (posted * SIZE) as u64,
                    rkey: dst.rkey(),
                };
                a.post_send(&SendWr::new(posted as u64, op).sg_list(&sge).signaled())
                    .unwrap();
                posted += 1;
                burst += 1;
            }
            if !blocked {
                let g = a.qp().lock_core();
                blocked = g.as_ref().is_some_and(|cc| cc.on_dm);
            }
            if blocked || posted == N {
                // The peer reads now and then once the socket backed up.
                while b.qp().core_rx(false).0 {}
            }
        }
        assert!(blocked, "the socket never filled");
        assert!(a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed) > 0);
        for (i, (id, st)) in done.iter().enumerate() {
            assert_eq!((*id, *st), (i as u64, WcStatus::Success), "completion {i}");
        }
        assert_eq!(cqa.poll(&mut wc), 0, "no request completes twice");
        // Everything arrives: a fence Send behind the Writes.
        let rsge = [Sge {
            lkey: dst.lkey(),
            addr: dst.addr(),
            length: 8,
        }];
        let mut fence = [0u8; 8];
        src.read(0, &mut fence).unwrap();
        b.post_recv(&RecvWr::new(7, &rsge)).unwrap();
        a.post_send(&SendWr::new(u64::MAX, SendOp::Send).inline(&fence))
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let _ = b.qp().core_rx(true);
            let mut one = [WorkCompletion::success(0, WcOpcode::Send, 0)];
            if cqb.poll(&mut one) == 1 {
                assert_eq!((one[0].wr_id, one[0].status), (7, WcStatus::Success));
                break;
            }
            let _ = cqa.poll(&mut wc);
            assert!(Instant::now() < deadline, "the fence never arrived");
        }
        let mut got = vec![0u8; N * SIZE];
        dst.read(0, &mut got).unwrap();
        let mut want = vec![0u8; N * SIZE];
        src.read(0, &mut want).unwrap();
        // Slot 0 was overwritten by the fence with its own first bytes.
        for i in 0..N {
            assert!(
                got[i * SIZE..(i + 1) * SIZE] == want[i * SIZE..(i + 1) * SIZE],
                "Write {i} differs"
            );
        }
    }

    /// A ping-pong (post, then poll until the answer comes) defers
    /// nothing: each post follows a poll that found nothing to write, so
    /// it is written at once and no backstop timer is armed.
    #[test]
    fn a_ping_pong_defers_nothing() {
        let (a, b, cqa, cqb, pd) = batch_pair();
        let abuf = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        let bbuf = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&a, &abuf, 50);
        post_receives(&b, &bbuf, 50);
        for i in 0..50u64 {
            let m = (1000 + i).to_le_bytes();
            a.post_send(&SendWr::new(i, SendOp::Send).inline(&m).signaled())
                .unwrap();
            // `a` waits for the answer (its send completion comes first).
            let got = take(&cqa, 1);
            assert_eq!(got[0].opcode, WcOpcode::Send);
            let got = take(&cqb, 1);
            assert_eq!((got[0].wr_id, got[0].opcode), (100 + i, WcOpcode::Recv));
            b.post_send(&SendWr::new(i, SendOp::Send).inline(&m).signaled())
                .unwrap();
            assert_eq!(take(&cqb, 1)[0].opcode, WcOpcode::Send);
            assert_eq!(take(&cqa, 1)[0].wr_id, 100 + i);
        }
        for q in [&a, &b] {
            assert_eq!(q.qp().tx_batch.stats[0].load(super::Ordering::Relaxed), 0);
        }
    }

    /// A poster that fills the send queue with deferred posts and retries
    /// without polling gets its post in: the full queue is written first.
    #[test]
    fn a_send_queue_full_of_deferred_posts_is_written_to_make_room() {
        let dev = test_device(true);
        let pd = ProtectionDomain::new(&dev);
        let cqa = CompletionQueue::new(&dev, 256, None).unwrap();
        let cqb = CompletionQueue::new(&dev, 256, None).unwrap();
        let mut attr = QpInitAttr::new(&cqa, &cqa);
        attr.cap.max_send_wr = 4;
        let (a, b) = connected(&pd, &pd, &attr, &cqb);
        let dst = pd.register(64 * 64, Access::LOCAL_WRITE).unwrap();
        post_receives(&b, &dst, 12);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqa.poll(&mut wc), 0);
        post_small_sends(&a, 0..12u64);
        assert!(a.qp().tx_batch.stats[0].load(super::Ordering::Relaxed) > 0);
        check_received(&b, &cqb, &dst, 12);
        let ids: Vec<u64> = take(&cqa, 12).iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, (0..12).collect::<Vec<u64>>());
    }

    /// A pair whose sending side (`a`) batches as usual and whose
    /// receiving side (`b`, on a device of its own) receives only when the
    /// test says so; the two PDs.
    fn quiet_core_pair_batching() -> (
        QueuePair,
        QueuePair,
        CompletionQueue,
        CompletionQueue,
        ProtectionDomain,
        ProtectionDomain,
    ) {
        let deva = test_device(true);
        let devb = test_device(false);
        let pda = ProtectionDomain::new(&deva);
        let pdb = ProtectionDomain::new(&devb);
        let cqa = CompletionQueue::new(&deva, 256, None).unwrap();
        let cqb = CompletionQueue::new(&devb, 256, None).unwrap();
        let (a, b) = connected(&pda, &pdb, &QpInitAttr::new(&cqa, &cqa), &cqb);
        b.qp().device.threads().unregister(&**b.qp());
        (a, b, cqa, cqb, pda, pdb)
    }

    /// A pair on one device whose CQs are exclusive (for
    /// `post_send_now`), with room for 256-byte inline Sends and
    /// `recv_wr` receives; no engine thread watches `b` and no CQ poll
    /// receives for it: only what the test calls receives.
    fn quiet_exclusive_pair(
        recv_wr: u32,
    ) -> (
        QueuePair,
        QueuePair,
        CompletionQueue,
        CompletionQueue,
        ProtectionDomain,
    ) {
        let dev = test_device(false);
        let pd = ProtectionDomain::new(&dev);
        let cq = |n: u32| {
            CompletionQueue::builder(&dev, n as usize)
                .exclusive()
                .build()
                .unwrap()
        };
        let (cqa, cqb) = (cq(64), cq(recv_wr));
        let mut attr = QpInitAttr::new(&cqa, &cqa);
        attr.cap.max_inline_data = 256;
        let mut attr_b = QpInitAttr::new(&cqb, &cqb);
        attr_b.cap.max_inline_data = 256;
        attr_b.cap.max_recv_wr = recv_wr;
        let a = QueuePair::new(&pd, &attr).unwrap();
        let b = QueuePair::new(&pd, &attr_b).unwrap();
        crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
        b.qp().device.threads().unregister(&**b.qp());
        for q in [&a, &b] {
            // The one pass is never declined for a look at the MSS.
            let mut g = q.qp().lock_core();
            let cc = g.as_mut().expect("connected");
            let tx = std::mem::replace(&mut cc.tx, super::TxIo::new());
            cc.tx = tx.following_mss(false);
        }
        (a, b, cqa, cqb, pd)
    }

    /// Whether `q`'s connection is idle as the one-pass send needs it:
    /// nothing queued, framed or unwritten, RTS, not on the datamover.
    fn idle_for_one_pass(q: &QueuePair) -> bool {
        let g = q.qp().lock_core();
        let cc = g.as_ref().expect("connected");
        cc.tx.pending() == 0
            && cc.conn.send_queue_len() == 0
            && cc.conn.fpdus_in_flight() == 0
            && cc.conn.state() == crate::QpState::Rts
            && !cc.on_dm
            && !cc.link_done
    }

    /// What `post_send_now` of a Send left on a QP whose peer had reset
    /// the connection (nobody had read the reset yet): by the one pass
    /// (an inline Send) or the general path (the same Send from
    /// registered memory).
    fn send_now_into_a_reset(one_pass: bool) -> ResetEnd {
        let (a, b, _cqa, cqb, pd) = quiet_exclusive_pair(16);
        let src = pd.register(64, Access::LOCAL_WRITE).unwrap();
        src.write(0, b"into a reset").unwrap();
        let sge = [Sge {
            lkey: src.lkey(),
            addr: src.addr(),
            length: 12,
        }];
        let wr = if one_pass {
            SendWr::new(5, SendOp::Send)
                .inline(b"into a reset")
                .signaled()
        } else {
            SendWr::new(5, SendOp::Send).sg_list(&sge).signaled()
        };
        // The peer's connection is reset (RST), as by a process that died.
        let fd = a.qp().core_fd.load(super::Ordering::Acquire);
        crate::sys::io::reset_connection(fd).unwrap();
        let bfd = b.qp().core_fd.load(super::Ordering::Acquire);
        wait_while("the reset never arrived", || {
            !crate::sys::io::readable_now(bfd)
        });
        assert!(idle_for_one_pass(&b), "not idle before the post");
        let wc = b
            .post_send_now(&wr)
            .unwrap()
            .unwrap_or_else(|| take(&cqb, 1)[0]);
        let state = b.state();
        let mut resets = Vec::new();
        while let Some(ev) = b.qp().device.async_events().try_get() {
            if ev.qp_num == Some(b.qp_num()) && ev.kind == crate::AsyncEventKind::LlpReset {
                resets.push(ev.detail.unwrap_or_default());
            }
        }
        // A later post is flushed.
        let later = b
            .post_send_now(&SendWr::new(6, SendOp::Send).inline(b"later").signaled())
            .unwrap()
            .unwrap_or_else(|| take(&cqb, 1)[0]);
        assert_eq!(later.wr_id, 6);
        let mut wcs = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqb.poll(&mut wcs), 0, "a completion given twice");
        ResetEnd {
            wc: (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.vendor_err),
            state,
            resets,
            later: later.status,
        }
    }

    /// What [`send_now_into_a_reset`] found.
    #[derive(Debug, PartialEq)]
    struct ResetEnd {
        /// The post's completion: (id, status, opcode, length, vendor error).
        wc: (u64, WcStatus, WcOpcode, u32, u32),
        state: crate::QpState,
        /// The details of the QP's reset events.
        resets: Vec<String>,
        /// The status of a second post's completion.
        later: WcStatus,
    }

    /// The one-pass send's write fails (the peer reset the connection):
    /// the post returns, the QP is in ERROR, the reset is reported with
    /// the socket's error, and the request completes flushed, exactly as
    /// by the general path.
    #[test]
    fn a_one_pass_send_into_a_reset_fails_as_the_general_path() {
        let one = send_now_into_a_reset(true);
        assert_eq!(
            one.wc,
            (5, WcStatus::WrFlush, WcOpcode::Send, 0, 0),
            "{one:?}"
        );
        assert_eq!(one.state, crate::QpState::Error);
        assert_eq!(one.resets.len(), 1, "{:?}", one.resets);
        assert!(
            one.resets[0].starts_with("connection failed:")
                && one.resets[0].contains("reset by peer"),
            "{:?}",
            one.resets
        );
        assert_eq!(one.later, WcStatus::WrFlush);
        assert_eq!(one, send_now_into_a_reset(false));
    }

    /// The one-pass send into a socket the peer does not read: the posts
    /// complete in their calls until the socket is full; the one that
    /// finds it full returns with the rest queued, which goes out once the
    /// peer reads. The peer gets every message byte for byte, in order,
    /// once; that post completes once, through the CQ.
    #[test]
    fn a_one_pass_send_into_a_full_socket_is_finished_later() {
        const MAX: u64 = 8192;
        const LEN: usize = 256;
        let (a, b, cqa, cqb, pd) = quiet_exclusive_pair(MAX as u32);
        let dst = pd
            .register(MAX as usize * LEN, Access::LOCAL_WRITE)
            .unwrap();
        for i in 0..MAX {
            let sge = [Sge {
                lkey: dst.lkey(),
                addr: dst.addr() + i * LEN as u64,
                length: LEN as u32,
            }];
            b.post_recv(&RecvWr::new(i, &sge)).unwrap();
        }
        {
            // A small send buffer: the socket fills sooner.
            let g = a.qp().lock_core();
            let cc = g.as_ref().expect("connected");
            socket2::SockRef::from(&**cc.stream)
                .set_send_buffer_size(4096)
                .unwrap();
        }
        let msg = |i: u64| -> Vec<u8> { (0..LEN).map(|k| (i as usize * 7 + k) as u8).collect() };
        let mut last = None;
        for i in 0..MAX {
            assert!(idle_for_one_pass(&a), "post {i}: not idle");
            let m = msg(i);
            let wr = SendWr::new(i, SendOp::Send).inline(&m).signaled();
            match a.post_send_now(&wr).unwrap() {
                Some(wc) => {
                    assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
                    assert_eq!(wc.byte_len, LEN as u32);
                }
                None => {
                    let g = a.qp().lock_core();
                    let cc = g.as_ref().expect("connected");
                    assert!(
                        cc.tx.pending() > 0 || !cqa.is_empty(),
                        "post {i}: neither written nor queued"
                    );
                    last = Some(i);
                    break;
                }
            }
        }
        let last = last.expect("the socket never filled");
        // The peer reads now: every message arrives, in order, once.
        let mut got = Vec::new();
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 64];
        let deadline = Instant::now() + Duration::from_secs(60);
        while got.len() < (last + 1) as usize {
            assert!(
                Instant::now() < deadline,
                "{} of {} received",
                got.len(),
                last + 1
            );
            let _ = b.qp().core_rx(false);
            let k = cqb.poll(&mut wc);
            got.extend_from_slice(&wc[..k]);
            if k == 0 {
                std::thread::yield_now();
            }
        }
        for (i, w) in got.iter().enumerate() {
            assert_eq!(
                (w.wr_id, w.status, w.opcode, w.byte_len),
                (i as u64, WcStatus::Success, WcOpcode::Recv, LEN as u32),
                "receive {i}"
            );
            let mut back = vec![0u8; LEN];
            dst.read(i * LEN, &mut back).unwrap();
            assert!(back == msg(i as u64), "message {i} differs");
        }
        // The post that found the socket full completes once.
        let done = take(&cqa, 1);
        assert_eq!(
            (done[0].wr_id, done[0].status, done[0].byte_len),
            (last, WcStatus::Success, LEN as u32)
        );
        std::thread::sleep(Duration::from_millis(50));
        let _ = b.qp().core_rx(false);
        assert_eq!(cqa.poll(&mut wc), 0, "a send completed twice");
        assert_eq!(cqb.poll(&mut wc), 0, "a message received twice");
        assert_eq!(a.send_queue_len(), 0);
    }

    /// A connected pair on exclusive CQs (`b`'s optionally with a
    /// completion channel), `b` quiet (no engine thread receives for it),
    /// with one receive posted on each side.
    fn handing_pair(channel: bool) -> Handing {
        let dev = test_device(false);
        let pd = ProtectionDomain::new(&dev);
        let ch = channel.then(|| crate::cq::CompletionChannel::new(&dev).unwrap());
        let cqa = CompletionQueue::builder(&dev, 16)
            .exclusive()
            .build()
            .unwrap();
        let mut cqb = CompletionQueue::builder(&dev, 16).exclusive();
        if let Some(ch) = &ch {
            cqb = cqb.channel(ch);
        }
        let cqb = cqb.build().unwrap();
        let a = QueuePair::new(&pd, &QpInitAttr::new(&cqa, &cqa)).unwrap();
        let b = QueuePair::new(&pd, &QpInitAttr::new(&cqb, &cqb)).unwrap();
        crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
        b.qp().device.threads().unregister(&**b.qp());
        let (dsta, dstb) = (
            pd.register(64, Access::LOCAL_WRITE).unwrap(),
            pd.register(64, Access::LOCAL_WRITE).unwrap(),
        );
        for (q, dst, id) in [(&a, &dsta, 11), (&b, &dstb, 1)] {
            let sge = [Sge {
                lkey: dst.lkey(),
                addr: dst.addr(),
                length: 64,
            }];
            q.post_recv(&RecvWr::new(id, &sge)).unwrap();
        }
        Handing {
            a,
            b,
            cqa,
            cqb,
            ch,
            pd,
            dstb,
            _dsta: dsta,
        }
    }

    std::thread_local! {
        /// [`panic_after_capture_if_asked`] panics (once) on this thread.
        static PANIC_AFTER_CAPTURE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }

    /// Called by the receive run once it delivered its completions: panics
    /// if asked on this thread and a receive completion was kept.
    pub(super) fn panic_after_capture_if_asked(kept: bool) {
        if kept && PANIC_AFTER_CAPTURE.with(|p| p.replace(false)) {
            panic!("injected: unwinding with a receive completion kept");
        }
    }

    /// What [`handing_pair`] made.
    struct Handing {
        a: QueuePair,
        b: QueuePair,
        cqa: CompletionQueue,
        cqb: CompletionQueue,
        ch: Option<crate::cq::CompletionChannel>,
        pd: ProtectionDomain,
        dstb: crate::MemoryRegion,
        /// `a`'s receive's buffer (kept while `a` may receive).
        _dsta: crate::MemoryRegion,
    }

    /// Waits while `pending()` holds, looking every millisecond; fails with
    /// `what` after 20 s.
    fn wait_while(what: &str, mut pending: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while pending() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A Send of 8 octets of `byte` from `q` (`wr_id`), unsignaled
    /// unless `signaled`.
    fn send_eight(q: &QueuePair, pd: &ProtectionDomain, byte: u8, wr_id: u64, signaled: bool) {
        let src = pd.register(64, Access::LOCAL_WRITE).unwrap();
        src.write(0, &[byte; 8]).unwrap();
        let sge = [Sge {
            lkey: src.lkey(),
            addr: src.addr(),
            length: 8,
        }];
        let mut wr = SendWr::new(wr_id, SendOp::Send).sg_list(&sge);
        if signaled {
            wr = wr.signaled();
        }
        q.post_send(&wr).unwrap();
    }

    /// One sleep in `recv` on `b`'s connection in this thread that may
    /// keep a receive completion (10 s at most): its outcome and the
    /// completion handed back.
    fn sleep_once(b: &QueuePair) -> (crate::cq::RxSleep, Option<WorkCompletion>) {
        let mut handed = None;
        let r = b.qp().core_rx_sleep(
            Duration::from_secs(10),
            &|| false,
            &mut || true,
            &mut handed,
        );
        (r, handed)
    }

    /// `b` sleeps in its socket's `recv` on a thread of its own with a
    /// `hand` that answers `yes` (and counts its calls); returns once the
    /// sleep has begun, with the thread's handle (what the sleep returned,
    /// what it handed back) and the count.
    #[allow(clippy::type_complexity)]
    fn sleep_handing(
        b: &QueuePair,
        yes: bool,
    ) -> (
        std::thread::JoinHandle<(crate::cq::RxSleep, Option<WorkCompletion>)>,
        std::sync::Arc<std::sync::atomic::AtomicUsize>,
    ) {
        let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (sleeper, count) = (b.clone(), asked.clone());
        let t = std::thread::spawn(move || {
            let mut handed = None;
            let r = sleeper.qp().core_rx_sleep(
                Duration::from_secs(60),
                &|| false,
                &mut || {
                    count.fetch_add(1, super::Ordering::SeqCst);
                    yes
                },
                &mut handed,
            );
            (r, handed)
        });
        wait_while("the waiter never slept", || {
            !b.qp().core_rx_sleeping.load(super::Ordering::SeqCst)
        });
        (t, asked)
    }

    /// A waiter that sleeps in `recv` and may keep the CQ's other
    /// consumers away (`hand` says yes) gets the receive completion of
    /// what came straight back; the CQ stays empty.
    #[test]
    fn a_receive_completion_is_handed_to_the_sleeper() {
        let p = handing_pair(false);
        let (a, b, cqb, pd, dstb) = (&p.a, &p.b, &p.cqb, &p.pd, &p.dstb);
        let (t, asked) = sleep_handing(b, true);
        send_eight(a, pd, 7, 2, false);
        let (r, handed) = t.join().unwrap();
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(asked.load(super::Ordering::SeqCst), 1);
        let wc = handed.expect("nothing handed back");
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num),
            (1, WcStatus::Success, WcOpcode::Recv, 8, b.qp_num())
        );
        let mut none = [WorkCompletion::success(0, WcOpcode::Send, 0)];
        assert_eq!(cqb.poll(&mut none), 0, "a completion given twice");
        let mut got = [0u8; 8];
        dstb.read(0, &mut got).unwrap();
        assert_eq!(got, [7u8; 8]);
    }

    /// A `hand` that says no (the caller could not keep the others away):
    /// the completion is queued as without one.
    #[test]
    fn a_receive_completion_is_queued_when_the_sleeper_cannot_take_it() {
        let p = handing_pair(false);
        let (a, b, cqb, pd) = (&p.a, &p.b, &p.cqb, &p.pd);
        let (t, asked) = sleep_handing(b, false);
        send_eight(a, pd, 7, 2, false);
        let (r, handed) = t.join().unwrap();
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(asked.load(super::Ordering::SeqCst), 1);
        assert!(handed.is_none());
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 2];
        assert_eq!(cqb.poll(&mut wc), 1);
        assert_eq!((wc[0].wr_id, wc[0].opcode), (1, WcOpcode::Recv));
    }

    /// A completion pushed while the waiter slept (its own Send's, made by
    /// another thread's post) is older than the receive's: the receive's
    /// is queued behind it, not handed back ahead of it. Without the look
    /// at the CQ before the capture, the waiter's caller would handle the
    /// receive before the Send that completed first.
    #[test]
    fn an_older_completion_in_the_cq_keeps_the_order_of_a_receive() {
        let p = handing_pair(false);
        let (a, b, cqa, cqb, pd) = (&p.a, &p.b, &p.cqa, &p.cqb, &p.pd);
        let (t, _asked) = sleep_handing(b, true);
        // `b`'s own Send, posted by this thread while `b` sleeps: written
        // and completed at once, its completion on `b`'s CQ.
        send_eight(b, pd, 5, 5, true);
        wait_while("the Send never completed", || cqb.is_empty());
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        // `a` takes the Send, then answers.
        wait_while("`a` never received the Send", || cqa.poll(&mut wc) == 0);
        assert_eq!((wc[0].wr_id, wc[0].opcode), (11, WcOpcode::Recv));
        send_eight(a, pd, 7, 2, false);
        let (r, handed) = t.join().unwrap();
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(handed, None, "the receive handed back ahead of the Send");
        assert_eq!(cqb.poll(&mut wc), 2);
        assert_eq!(
            [(wc[0].wr_id, wc[0].opcode), (wc[1].wr_id, wc[1].opcode)],
            [(5, WcOpcode::Send), (1, WcOpcode::Recv)],
            "completions out of order"
        );
    }

    /// An armed CQ gets the receive completion and raises its event (a
    /// completion handed back would raise none), though `hand` said yes.
    #[test]
    fn an_armed_cq_gets_the_receive_completion_and_its_event() {
        let p = handing_pair(true);
        let (a, b, cqb, pd) = (&p.a, &p.b, &p.cqb, &p.pd);
        let ch = p.ch.as_ref().unwrap();
        cqb.req_notify(false).unwrap();
        let (t, asked) = sleep_handing(b, true);
        send_eight(a, pd, 7, 2, false);
        let (r, handed) = t.join().unwrap();
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert!(handed.is_none(), "handed back past the arm");
        assert_eq!(asked.load(super::Ordering::SeqCst), 1);
        let ev = ch.get_event(Some(Duration::from_secs(10))).expect("event");
        assert!(ev.same_as(cqb));
        cqb.ack_events(1);
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 2];
        assert_eq!(cqb.poll(&mut wc), 1);
        assert_eq!((wc[0].wr_id, wc[0].opcode), (1, WcOpcode::Recv));
    }

    /// The run's first successful receive completion is handed back, the
    /// ones after it (the same run received two messages) are queued, in
    /// order behind it; nothing twice.
    #[test]
    fn receive_completions_after_the_handed_one_are_queued_in_order() {
        let p = handing_pair(false);
        let (a, b, cqb, pd) = (&p.a, &p.b, &p.cqb, &p.pd);
        let dst2 = pd.register(64, Access::LOCAL_WRITE).unwrap();
        let sge = [Sge {
            lkey: dst2.lkey(),
            addr: dst2.addr(),
            length: 64,
        }];
        b.post_recv(&RecvWr::new(3, &sge)).unwrap();
        // Both Sends are on the socket before the sleep's `recv`.
        send_eight(a, pd, 7, 2, false);
        send_eight(a, pd, 8, 4, false);
        let fd = b.qp().core_fd.load(super::Ordering::Acquire);
        wait_while("the Sends never arrived", || {
            !crate::sys::io::readable_now(fd)
        });
        // (Loopback: both are there once the first is; some slack.)
        std::thread::sleep(Duration::from_millis(20));
        let (r, handed) = sleep_once(b);
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(
            handed.map(|w| (w.wr_id, w.opcode)),
            Some((1, WcOpcode::Recv))
        );
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        let n = cqb.poll(&mut wc);
        assert_eq!(
            wc[..n].iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![3],
            "the second receive"
        );
        let mut got = [0u8; 8];
        dst2.read(0, &mut got).unwrap();
        assert_eq!(got, [8u8; 8]);
    }

    /// A receive run that unwound after it kept the first receive
    /// completion (and queued the second) used to leave it in the
    /// connection: it never reached the CQ, and the next hand-back's run
    /// dropped it (its data lost, its receive never given back). The
    /// unwind now queues it, ahead of the second; and the next run hands
    /// back its own.
    #[test]
    fn a_panic_after_the_capture_does_not_lose_the_kept_completion() {
        let p = handing_pair(false);
        let (a, b, cqb, pd) = (&p.a, &p.b, &p.cqb, &p.pd);
        let dst2 = pd.register(64, Access::LOCAL_WRITE).unwrap();
        for id in [3, 5] {
            let sge = [Sge {
                lkey: dst2.lkey(),
                addr: dst2.addr(),
                length: 64,
            }];
            b.post_recv(&RecvWr::new(id, &sge)).unwrap();
        }
        let fd = b.qp().core_fd.load(super::Ordering::Acquire);
        send_eight(a, pd, 7, 2, false);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut one = 0;
        while one == 0 {
            assert!(Instant::now() < deadline, "the first Send never arrived");
            std::thread::sleep(Duration::from_millis(1));
            one = crate::sys::io::readable_octets(fd);
        }
        // Both messages on the socket before the run (one `recv` takes
        // both): the second doubles what the first left there.
        send_eight(a, pd, 8, 4, false);
        while crate::sys::io::readable_octets(fd) < 2 * one {
            assert!(Instant::now() < deadline, "the second Send never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        PANIC_AFTER_CAPTURE.with(|p| p.set(true));
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            sleep_once(b);
        }));
        assert!(unwound.is_err(), "the injected panic did not happen");
        assert!(!PANIC_AFTER_CAPTURE.with(std::cell::Cell::get));
        // Left set, the flag would keep the receive threads and `poll(2)`
        // waiters backing off from a connection nobody receives on.
        assert!(
            !b.qp().core_rx_sleeping.load(super::Ordering::SeqCst),
            "the unwind left the sleeping-in-recv flag set"
        );
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        let n = cqb.poll(&mut wc);
        assert_eq!(
            wc[..n].iter().map(|w| w.wr_id).collect::<Vec<_>>(),
            vec![1, 3],
            "the kept completion lost or out of order"
        );
        // The capture was ended: the next run hands its own back.
        send_eight(a, pd, 9, 6, false);
        wait_while("the third Send never arrived", || {
            !crate::sys::io::readable_now(fd)
        });
        let (r, handed) = sleep_once(b);
        assert_eq!(r, crate::cq::RxSleep::Received);
        assert_eq!(handed.map(|w| w.wr_id), Some(5));
        assert_eq!(cqb.poll(&mut wc), 0, "a completion given twice");
    }

    /// A send completed directly (`post_send_now`) while a receive run
    /// may keep a receive completion (its capture set, the connection's
    /// lock let go around a large payload's read) would be handed to the
    /// poster ahead of that older completion on the one CQ: the send's
    /// completion goes to the CQ instead while the capture is set.
    #[test]
    fn a_send_is_not_completed_directly_while_a_receive_completion_may_be_kept() {
        let p = handing_pair(false);
        let (b, cqb, pd) = (&p.b, &p.cqb, &p.pd);
        let src = pd.register(64, Access::LOCAL_WRITE).unwrap();
        let sge = [Sge {
            lkey: src.lkey(),
            addr: src.addr(),
            length: 8,
        }];
        let post = |id: u64, inline: bool| {
            let mut wr = SendWr::new(id, SendOp::Send).sg_list(&sge).signaled();
            if inline {
                wr = SendWr::new(id, SendOp::Send).inline(&[7; 8]).signaled();
            }
            b.post_send_now(&wr).unwrap()
        };
        // Without a capture, the direct path (checked: the test means
        // something).
        let wc = post(20, false).expect("not completed directly");
        assert_eq!(wc.wr_id, 20);
        let mut wcs = [WorkCompletion::success(0, WcOpcode::Send, 0); 4];
        for (id, inline) in [(21, false), (22, true)] {
            b.qp().lock_core().as_mut().unwrap().direct_rwc = Some(None);
            let direct = post(id, inline);
            let kept = b.qp().lock_core().as_mut().unwrap().direct_rwc.take();
            assert_eq!(kept, Some(None), "a send completion kept as a receive's");
            assert!(direct.is_none(), "completed directly past the capture");
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut n = 0;
            while n == 0 {
                assert!(Instant::now() < deadline, "the Send never completed");
                n = cqb.poll(&mut wcs);
            }
            assert_eq!((n, wcs[0].wr_id, wcs[0].opcode), (1, id, WcOpcode::Send));
        }
    }
}
