//! Closing: graceful close (FIN exchange, close timer), abortive close,
//! Terminates sent and received, entering ERROR (flushing everything in
//! completion order), and tearing the QP down.

use std::net::Shutdown;
use std::os::fd::AsRawFd;

use softrdma_proto::term;
use softrdma_proto::types::AsyncKind;
use softrdma_wire::rdmap::terminate::{TerminateRepr, TerminatedDdp};

use super::*;

/// The headers of the segment a Terminate answers, as received.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TermHeader<'a> {
    /// Its DDP header (14 or 18 bytes).
    pub(crate) ddp: &'a [u8],
    /// Its DDP Segment Length (payload after the DDP header).
    pub(crate) segment_length: u16,
    /// A Read Request's 28-byte RDMAP header, if the segment was one.
    pub(crate) rdmap: Option<&'a [u8]>,
}

/// The Terminate for `err` about `hdr`, shaped like siw's: D=1 and M=1 with
/// the segment's length and DDP header when `term::copies_ddp_header`
/// says the error is tied to a segment whose layout is known, plus R=1 and
/// a Read Request's header for a protection error on one.
pub(crate) fn terminate_repr<'a>(err: TermError, hdr: Option<TermHeader<'a>>) -> TerminateRepr<'a> {
    let mut repr = TerminateRepr::new(err);
    if let Some(h) = hdr
        && !h.ddp.is_empty()
        && term::copies_ddp_header(err)
    {
        repr.segment_length_valid = true;
        repr.ddp = Some(TerminatedDdp {
            segment_length: h.segment_length,
            header: h.ddp,
        });
        if term::copies_rdmap_header(err) {
            repr.rdmap_header = h.rdmap;
        }
    }
    repr
}

/// The event a Terminate sent for `err` raises (from the one table,
/// `softrdma_proto::term::TABLE`).
pub(crate) fn term_event(err: TermError) -> AsyncEventKind {
    match term::class(err).event {
        AsyncKind::QpRequestError => AsyncEventKind::QpRequestError,
        AsyncKind::QpAccessError => AsyncEventKind::QpAccessError,
        _ => AsyncEventKind::QpFatal,
    }
}

impl QpInner {
    /// The connection failed (reset, lost).
    pub(crate) fn link_failed(&self, e: &io::Error) {
        if matches!(self.state(), QpState::Error | QpState::Idle) {
            return;
        }
        let detail = format!("connection failed: {e}");
        self.enter_error_with(
            None,
            Some(AsyncEvent::qp(AsyncEventKind::LlpReset, self.qp_num).with_detail(detail)),
        );
    }

    /// The peer closed the connection.
    pub(crate) fn link_closed(&self, at_boundary: bool) {
        let state = self.state();
        if matches!(state, QpState::Error | QpState::Idle) {
            return;
        }
        if at_boundary && matches!(state, QpState::Rts | QpState::Closing) {
            // The peer's FIN: a graceful close (started by the peer if we
            // are still in RTS).
            self.peer_fin.store(true, Ordering::Release);
            if state == QpState::Rts {
                self.begin_close(true);
            } else {
                self.lock_tx().peer_closed = true;
                self.kick();
            }
            self.try_finish_close();
            return;
        }
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::BadClose, self.qp_num));
        self.enter_error(None, None);
    }

    /// RTS → CLOSING: let the send queue drain, then FIN; arm the close
    /// timer. The posted receives stay until the close ends (IDLE) or fails
    /// (ERROR): a multi-segment Send being received completes first, and
    /// Sends the peer sent before it saw our FIN find their buffers.
    pub(crate) fn begin_close(&self, by_peer: bool) {
        if self.core_mode() {
            self.core_close();
            return;
        }
        {
            let _g = self.lock_state();
            if self.state() != QpState::Rts {
                return;
            }
            self.set_state(QpState::Closing);
        }
        {
            let mut tx = self.lock_tx();
            tx.fin_pending = true;
            tx.peer_closed = by_peer;
        }
        self.kick();
        // The close timer runs on the engine's timer thread.
        let weak = self.self_weak.clone();
        let timeout =
            std::time::Duration::from_millis(self.close_timeout_ms.load(Ordering::Relaxed));
        let generation = self.close_gen.fetch_add(1, Ordering::AcqRel) + 1;
        let armed = crate::timer::arm(timeout, move || {
            if let Some(qp) = weak.upgrade()
                && qp.state() == QpState::Closing
                && qp.close_gen.load(Ordering::Acquire) == generation
            {
                qp.device.events().push(
                    AsyncEvent::qp(AsyncEventKind::BadClose, qp.qp_num)
                        .with_detail("the peer did not close in time; connection reset"),
                );
                qp.abort(true);
            }
        });
        match armed {
            Ok(id) => {
                if let Some(old) = self.close_timer.lock().replace(id) {
                    crate::timer::cancel(old);
                }
                // The close may have finished before the timer was stored.
                if self.state() != QpState::Closing {
                    self.cancel_close_timer();
                }
            }
            // No timer: close abortively at once rather than hang forever.
            Err(_) => self.abort(true),
        }
    }

    /// The close is over (IDLE or ERROR): its timer is not needed.
    fn cancel_close_timer(&self) {
        if let Some(id) = self.close_timer.lock().take() {
            crate::timer::cancel(id);
        }
    }

    /// The FIN went out (transmit path).
    pub(crate) fn fin_sent(&self) {
        self.try_finish_close();
    }

    /// CLOSING → IDLE once both FINs are exchanged.
    fn try_finish_close(&self) {
        if !self.peer_fin.load(Ordering::Acquire) {
            return;
        }
        if !self.lock_tx().fin_sent {
            return;
        }
        {
            let _g = self.lock_state();
            if self.state() != QpState::Closing {
                return;
            }
            self.closed.store(true, Ordering::SeqCst);
            self.set_state(QpState::Idle);
        }
        self.cancel_close_timer();
        // The event first: whoever has seen the flushes below can see it.
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::LlpClosed, self.qp_num));
        // Reads and atomics the peer will never answer now, and anything
        // else still open, complete with flush errors, in order.
        let ord: Vec<OutRead> = self.ord_q.lock().drain().collect();
        for r in ord {
            self.complete_sq(r.seq, WcStatus::WrFlush, 0, 0);
        }
        let dropped = {
            let mut tx = self.lock_tx();
            let d = tx.clear();
            self.drain_incoming(&mut tx);
            d
        };
        for w in dropped {
            self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
        }
        self.flush_open_sq();
        self.flush_partial_recv();
        self.flush_rq();
        self.device.threads().unregister(self);
    }

    /// Abortive close: reset the connection, then ERROR.
    pub(crate) fn abort(&self, timer: bool) {
        if matches!(self.state(), QpState::Error) {
            return;
        }
        if self.core_mode() {
            self.core_abort(false, None);
            return;
        }
        if let Some(s) = self.stream.lock().as_ref() {
            let _ = crate::sys::io::reset_connection(s.as_raw_fd());
        }
        let event = (!timer && !matches!(self.state(), QpState::Idle)).then(|| {
            AsyncEvent::qp(AsyncEventKind::LlpReset, self.qp_num).with_detail("local abort")
        });
        self.enter_error_with(None, event);
    }

    /// A local error found on the connection: send a Terminate (if the
    /// connection still works), then ERROR.
    pub(crate) fn fail(&self, err: TermError, hdr: Option<TermHeader<'_>>) {
        if matches!(self.state(), QpState::Error | QpState::Terminate) {
            return;
        }
        if self.core_mode() {
            self.core_terminate(err);
            return;
        }
        self.set_state(QpState::Terminate);
        tracing::info!(qp = self.qp_num, code = %err.code(), "Terminate sent");
        *self.last_terminate.lock() = Some(TerminateInfo {
            direction: TerminateDirection::Sent,
            code: err.code(),
        });
        {
            let mut tx = self.lock_tx();
            let repr = terminate_repr(err, hdr);
            tx.queue_terminate(&repr);
            // Best effort: a few non-blocking attempts.
            for _ in 0..64 {
                match tx.progress(self, usize::MAX) {
                    TxOutcome::WouldBlock => std::thread::yield_now(),
                    _ => break,
                }
                if !tx.has_work() {
                    break;
                }
            }
        }
        self.device.events().push(
            AsyncEvent::qp(term_event(err), self.qp_num)
                .with_term(err.code())
                .with_detail(format!("sent Terminate: {}", err.name())),
        );
        self.enter_error(None, None);
    }

    /// A Terminate arrived from the peer.
    pub(crate) fn terminated_by_peer(&self, code: TermCode) {
        tracing::info!(qp = self.qp_num, %code, "Terminate received");
        *self.last_terminate.lock() = Some(TerminateInfo {
            direction: TerminateDirection::Received,
            code,
        });
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::TerminateReceived, self.qp_num).with_term(code));
        // The oldest outstanding Read or atomic is the request the
        // Terminate answered; its completion carries the raw code.
        let status = term_status(code);
        let vendor = u32::from(u16::from_be_bytes(code.to_bytes()));
        // Stop framing before the ORD slot frees up: nothing behind the
        // answered request may reach the wire now.
        {
            let _g = self.lock_state();
            if self.state() == QpState::Error {
                return;
            }
            self.set_state(QpState::Terminate);
        }
        if let Some(r) = self.pop_ord() {
            self.complete_sq(r.seq, status, 0, vendor);
        }
        self.enter_error(None, None);
    }

    /// Enters ERROR: flushes every outstanding request in order and closes
    /// the connection. `first_status`: status of the oldest outstanding
    /// Read/atomic (the request a remote error answered), if any.
    pub(crate) fn enter_error(
        &self,
        first_status: Option<WcStatus>,
        event: Option<AsyncEventKind>,
    ) {
        self.enter_error_inner(first_status, None, event);
    }

    /// [`enter_error`](Self::enter_error) reporting `cause` (the reset or
    /// abort that ends the connection) first, only if this call moves the
    /// QP to ERROR: an abort racing the receive path's view of the same
    /// reset reports one `LlpReset`, not two.
    pub(crate) fn enter_error_with(
        &self,
        first_status: Option<WcStatus>,
        cause: Option<AsyncEvent>,
    ) {
        self.enter_error_inner(first_status, cause, None);
    }

    fn enter_error_inner(
        &self,
        first_status: Option<WcStatus>,
        cause: Option<AsyncEvent>,
        event: Option<AsyncEventKind>,
    ) {
        if self.core_mode() {
            if let Some(ev) = cause {
                self.device.events().push(ev);
            }
            let orderly = self.orderly_close.load(Ordering::Acquire);
            self.core_abort(orderly, event);
            return;
        }
        {
            let _g = self.lock_state();
            if self.state() == QpState::Error {
                return;
            }
            if let Some(ev) = cause {
                self.device.events().push(ev);
            }
            self.set_state(QpState::Error);
        }
        self.cancel_close_timer();
        if let Some(kind) = event {
            self.device.events().push(AsyncEvent::qp(kind, self.qp_num));
        }
        // Stop transmission; everything not completed is flushed.
        let dropped = {
            let mut tx = self.lock_tx();
            let d = tx.clear();
            self.drain_incoming(&mut tx);
            d
        };
        let mut ord: Vec<OutRead> = self.ord_q.lock().drain().collect();
        if let Some(st) = first_status
            && !ord.is_empty()
        {
            let r = ord.remove(0);
            self.complete_sq(r.seq, st, 0, 0);
        }
        for r in ord {
            self.complete_sq(r.seq, WcStatus::WrFlush, 0, 0);
        }
        for w in dropped {
            self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
        }
        self.flush_open_sq();
        self.flush_partial_recv();
        self.flush_rq();
        if let Some(srq) = &self.srq {
            let _ = srq;
            self.device.events().push(AsyncEvent::qp(
                AsyncEventKind::QpLastWqeReached,
                self.qp_num,
            ));
        }
        self.close_link();
    }

    /// Requests already written but whose completion waits for earlier ones
    /// are complete; anything else still open is flushed.
    fn flush_open_sq(&self) {
        let open: Vec<u64> = self.comp.lock().open();
        for seq in open {
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
        }
    }

    /// Flushes the receives the receive path holds, if it is not running
    /// (if it is, it flushes them itself when it sees the state).
    fn flush_partial_recv(&self) {
        let partial = match self.rx.try_lock() {
            Some(mut rx) => {
                rx.detach();
                rx.take_partial()
            }
            None => Vec::new(),
        };
        for wr_id in partial {
            self.flush_recv_one(wr_id);
        }
    }

    pub(crate) fn rq_is_empty(&self) -> bool {
        self.rq.is_empty()
    }

    fn close_link(&self) {
        self.device.threads().unregister(self);
        // After a Terminate the connection closes in order (so the Terminate
        // is delivered); any other way into ERROR resets it, so the peer
        // learns at once. The descriptor stays open until the QP is freed
        // or reconnected: a datamover may still watch it, and must see the
        // hang-up rather than a recycled descriptor.
        let orderly = self.lock_tx().terminate_sent || self.orderly_close.load(Ordering::Acquire);
        if let Some(s) = self.stream.lock().as_ref() {
            if orderly {
                let _ = s.shutdown(Shutdown::Both);
            } else {
                let _ = crate::sys::io::reset_connection(s.as_raw_fd());
            }
        }
        if let Some(mut rx) = self.rx.try_lock() {
            rx.detach();
        }
        self.lock_tx().link = None;
    }

    /// ERROR → IDLE: forget the connection, keep the queues' sizes.
    pub(super) fn reset(&self) {
        if self.core_mode() {
            self.core_reset();
            return;
        }
        // `rx` first, as everywhere else: a receive path that was already
        // running when the QP entered ERROR (an engine thread that took the
        // socket's readiness just before it was unregistered) may still
        // hold `rx` and, on finding the link failed, take `state_lock` to
        // enter ERROR; taking `state_lock` first here deadlocked against it.
        let mut rx = self.rx.lock();
        let _g = self.lock_state();
        // Raw lock: ERROR accepts no request (posts are flushed), nothing to
        // hand off, and the state lock is held.
        let mut tx = self.tx.lock();
        *tx = TxState::new();
        let _ = self.tx.release(tx);
        *rx = RxState::new();
        drop(rx);
        self.ird.lock().reset();
        self.ord_q
            .lock()
            .set_limit(self.ord.load(Ordering::Relaxed));
        self.closed.store(false, Ordering::SeqCst);
        self.set_state(QpState::Idle);
    }

    /// The last handle is gone: flush and close.
    pub(super) fn destroy(&self) {
        if self.state() != QpState::Error {
            // Destroying a connected QP closes its connection in order (FIN
            // after what is already in the socket), like closing a socket;
            // use `abort` first for a reset.
            self.orderly_close.store(true, Ordering::Release);
            self.enter_error(None, None);
        }
        self.device.threads().unregister(self);
        let hook: Weak<dyn Progress> = self.self_weak.clone() as Weak<dyn Progress>;
        self.recv_cq.detach_progress(&hook);
        self.send_cq.detach_progress(&hook);
        self.device.threads().release(self.datamover);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use crate::qp::unconnected_qp;
    use crate::state::QpState;

    /// A receive path that was already running when the QP entered ERROR
    /// holds `rx` and, finding the link failed, takes `state_lock` to enter
    /// ERROR (which it then finds done). A reset ERROR → IDLE at that moment
    /// took `state_lock` first and then waited for `rx`: neither moved.
    #[test]
    fn reset_while_a_receive_path_enters_error_does_not_deadlock() {
        let qp = unconnected_qp();
        qp.modify(QpState::Error).unwrap();
        let inner = qp.inner.qp.clone();

        let (holding_tx, holding) = mpsc::channel();
        let receive_path = {
            let inner = inner.clone();
            std::thread::spawn(move || {
                let rx = inner.rx.lock();
                holding_tx.send(()).unwrap();
                // Give the reset time to reach its first lock.
                std::thread::sleep(Duration::from_millis(100));
                inner.enter_error(None, None);
                drop(rx);
            })
        };
        holding.recv().unwrap();
        let (done_tx, done) = mpsc::channel();
        let qp2 = qp.clone();
        std::thread::spawn(move || {
            let r = qp2.modify(QpState::Idle);
            let _ = done_tx.send(r);
        });
        // A deadlock never answers; a generous bound keeps a loaded machine
        // from failing the test.
        let r = done
            .recv_timeout(Duration::from_secs(60))
            .expect("the reset deadlocked against the receive path");
        r.unwrap();
        receive_path.join().unwrap();
        assert_eq!(qp.state(), QpState::Idle);
    }
}
