//! Closing: graceful close, abortive close, the application's Terminate,
//! entering ERROR, the reset to IDLE and tearing the QP down. The rules
//! (FIN exchange, close timer, flushing everything in completion order,
//! Terminates sent and received) are the protocol core's `Connection`'s;
//! these enter it through `core_path`.

use super::*;

impl QpInner {
    /// RTS → CLOSING: the connection lets the send queue drain, then sends
    /// its FIN and arms the close timer (`Connection::close`). The posted
    /// receives stay until the close ends (IDLE) or fails (ERROR).
    /// `fin_linger`: the FIN waits for the peer's acknowledgement of every
    /// byte in the socket, at most this long (`disconnect_acknowledged`).
    pub(crate) fn begin_close(&self, fin_linger: Option<std::time::Duration>) {
        self.core_close(fin_linger);
    }

    /// Abortive close: reset the connection, then ERROR.
    pub(crate) fn abort(&self) {
        if matches!(self.state(), QpState::Error) {
            return;
        }
        self.core_abort(false, None);
    }

    /// The application moves the QP to TERMINATE: a Terminate with `err`
    /// goes out (if the connection still works), then ERROR.
    pub(crate) fn fail(&self, err: TermError) {
        if matches!(self.state(), QpState::Error | QpState::Terminate) {
            return;
        }
        self.core_terminate(err);
    }

    /// Enters ERROR: flushes every outstanding request in order and closes
    /// the connection (in order if the QP is being destroyed, else with a
    /// reset). `event`: raised if this call moves the QP to ERROR.
    pub(crate) fn enter_error(&self, event: Option<AsyncEventKind>) {
        let orderly = self.orderly_close.load(Ordering::Acquire);
        self.core_abort(orderly, event);
    }

    /// ERROR → IDLE: forget the connection, keep the queues' sizes.
    pub(super) fn reset(&self) {
        self.core_reset();
    }

    /// See [`QueuePair::close_acknowledged`].
    pub(crate) fn close_acknowledged(&self, linger: std::time::Duration) {
        if self.tx_batch.take_deferred() {
            self.core_kick();
        }
        if !matches!(self.state(), QpState::Rts | QpState::Closing) {
            return;
        }
        // The wait for the peer's acknowledgement is the engine's (`linger`).
        self.core_linger(linger);
        if self.state() != QpState::Error {
            self.orderly_close.store(true, Ordering::Release);
            self.enter_error(None);
        }
    }

    /// The last handle is gone: flush and close.
    pub(super) fn destroy(&self) {
        // Small posts a poster left for its next poll are written first: a
        // destroy after posting (without waiting for the completions) sent
        // them before batching, and must still.
        if self.tx_batch.take_deferred() {
            self.core_kick();
        }
        if self.state() != QpState::Error {
            // Destroying a connected QP closes its connection in order (FIN
            // after what is already in the socket), like closing a socket;
            // use `abort` first for a reset.
            self.orderly_close.store(true, Ordering::Release);
            self.enter_error(None);
        }
        self.device.threads().unregister(self);
        let hook: Weak<dyn Progress> = self.self_weak.clone() as Weak<dyn Progress>;
        self.recv_cq.detach_progress(&hook);
        self.send_cq.detach_progress(&hook);
        self.device.threads().release(self.datamover);
    }

    /// Delivers a receive completion (through the proxy's sequencer on a
    /// proxy QP).
    pub(crate) fn complete_recv(&self, wc: WorkCompletion, solicited: bool) {
        let lost = match self.proxy.get() {
            Some(link) => link.deliver(self, wc, false, solicited),
            None => self.recv_cq.push(wc, solicited).is_err(),
        };
        if lost {
            self.cq_overflow();
        }
    }

    /// A completion could not be delivered (its CQ is full): the QP is
    /// unusable and enters ERROR.
    pub(crate) fn cq_overflow(&self) {
        if self.state() != QpState::Error
            && let Some(qp) = self.self_weak.upgrade()
        {
            std::thread::spawn(move || qp.enter_error(Some(AsyncEventKind::QpFatal)));
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use crate::proto::mpa::MpaConfig;
    use crate::qp::unconnected_qp;
    use crate::state::QpState;
    use crate::{CompletionQueue, Device, DeviceConfig, ProtectionDomain, QpInitAttr, QueuePair};

    /// Two QPs connected on loopback, on a device of their own.
    fn pair() -> (QueuePair, QueuePair, CompletionQueue, CompletionQueue) {
        let dev = Device::open_with(DeviceConfig {
            pin_threads: false,
            ..DeviceConfig::default()
        })
        .unwrap();
        let pd = ProtectionDomain::new(&dev);
        let cqa = CompletionQueue::new(&dev, 64, None).unwrap();
        let cqb = CompletionQueue::new(&dev, 64, None).unwrap();
        let a = QueuePair::new(&pd, &QpInitAttr::new(&cqa, &cqa)).unwrap();
        let b = QueuePair::new(&pd, &QpInitAttr::new(&cqb, &cqb)).unwrap();
        crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
        (a, b, cqa, cqb)
    }

    fn resets(q: &QueuePair) -> u32 {
        q.qp().lock_core().as_ref().map_or(0, |cc| cc.resets)
    }

    /// Polls `cq` (driving its QPs) until `q` reaches `state`.
    fn poll_until(q: &QueuePair, cq: &CompletionQueue, state: QpState) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut out = [crate::WorkCompletion::success(0, crate::WcOpcode::Send, 0); 8];
        while q.state() != state {
            assert!(
                Instant::now() < deadline,
                "{:?} never reached {state:?}",
                q.state()
            );
            cq.poll(&mut out);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// An abort after the connection closed in order (both FINs went: the
    /// QP is IDLE) moves the QP to ERROR without touching its socket:
    /// before, it reset it (`SO_LINGER` 0, `connect(AF_UNSPEC)` and
    /// `shutdown`, three system calls for a socket the kernel sends no
    /// RST for any more). An abort of a connected QP still resets.
    #[test]
    fn abort_after_an_orderly_close_makes_no_reset() {
        let (a, b, cqa, cqb) = pair();
        a.disconnect().unwrap();
        poll_until(&b, &cqb, QpState::Idle);
        poll_until(&a, &cqa, QpState::Idle);
        b.abort();
        assert_eq!(b.state(), QpState::Error);
        assert_eq!(resets(&b), 0);

        let (c, _d, _cqc, _cqd) = pair();
        c.abort();
        assert_eq!(c.state(), QpState::Error);
        assert_eq!(resets(&c), 1);
    }

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
                inner.enter_error(None);
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
