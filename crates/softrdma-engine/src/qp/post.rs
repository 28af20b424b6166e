//! Posting: send and receive requests go to the connection (the protocol
//! core checks and queues them, `core_path`); receives posted before a
//! connection exists wait in `pre_rq`; the direct-send hand-off (`kick`)
//! transmits in the posting thread.

use super::*;

impl QpInner {
    pub(super) fn post_one(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        self.core_post_send(wr)
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
