//! Completion order: send-queue requests complete in posting order
//! (slots: the protocol core's [`softrdma_proto::order::InOrder`], the one
//! implementation of the rule, also used by `softrdma_proto::conn`),
//! receive completions, CQ overflow, taking receives for incoming Sends.

use super::*;

impl QpInner {
    /// Records the outcome of send-queue request `seq` and delivers the
    /// completions that are now in order.
    pub(crate) fn complete_sq(&self, seq: u64, status: WcStatus, byte_len: u32, vendor_err: u32) {
        let mut overflow = false;
        {
            let mut c = self.comp.lock();
            c.complete(seq, |s| {
                s.status = Some(status);
                s.byte_len = byte_len;
                s.vendor_err = vendor_err;
            });
            while let Some(s) = c.pop_ready() {
                let Some(st) = s.status else { continue };
                self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
                if s.proxy_owned {
                    if let Some(link) = self.proxy.get() {
                        link.reply_completed(st);
                    }
                    continue;
                }
                if s.signaled || !st.is_success() {
                    let wc = WorkCompletion {
                        wr_id: s.wr_id,
                        status: st,
                        opcode: s.opcode,
                        byte_len: s.byte_len,
                        imm_data: 0,
                        invalidated_rkey: 0,
                        qp_num: self.qp_num,
                        flags: WcFlags::NONE,
                        vendor_err: s.vendor_err,
                        proxy_seq: 0,
                        proxy_note: 0,
                    };
                    let lost = match self.proxy.get() {
                        Some(link) => link.deliver(self, wc, true, false),
                        None => self.send_cq.push(wc, false).is_err(),
                    };
                    if lost {
                        overflow = true;
                    }
                }
            }
        }
        if overflow {
            self.cq_overflow();
        }
    }

    /// Delivers a receive completion.
    pub(crate) fn complete_recv(&self, wc: WorkCompletion, solicited: bool) {
        let lost = match self.proxy.get() {
            Some(link) => link.deliver(self, wc, false, solicited),
            None => self.recv_cq.push(wc, solicited).is_err(),
        };
        if lost {
            self.cq_overflow();
        }
    }

    pub(crate) fn cq_overflow(&self) {
        if self.state() != QpState::Error
            && let Some(qp) = self.self_weak.upgrade()
        {
            // Completions can no longer be delivered: the QP is unusable.
            std::thread::spawn(move || qp.enter_error(None, Some(AsyncEventKind::QpFatal)));
        }
    }

    /// A receive for an incoming Send: from the SRQ or the QP's queue.
    pub(crate) fn pop_recv(&self) -> Option<RecvWqe> {
        match &self.srq {
            Some(srq) => srq.pop(),
            None => self.rq.pop(),
        }
    }
}

/// The send-queue completion order ([`softrdma_proto::order::InOrder`], the
/// protocol core's) used the way the QP uses it: under one lock, completers
/// and a flush record outcomes and deliver what is in order.
#[cfg(all(test, loom))]
mod loom_tests {
    use loom::sync::{Arc, Mutex};
    use loom::thread;
    use softrdma_proto::order::InOrder;

    /// Three requests; two completers finish the last two out of order
    /// while a flush (ERROR) completes whatever is open. Every request is
    /// delivered exactly once, in posting order.
    #[test]
    fn loom_completions_in_order_exactly_once_against_a_flush() {
        loom::model(|| {
            let q = Arc::new(Mutex::new((InOrder::default(), Vec::new())));
            {
                let mut g = q.lock().unwrap();
                for i in 0..3u64 {
                    g.0.push(i);
                }
            }
            let complete = |q: &Mutex<(InOrder<u64>, Vec<u64>)>, seq: u64| {
                let mut g = q.lock().unwrap();
                let (slots, delivered) = &mut *g;
                slots.complete(seq, |_| {});
                while let Some(v) = slots.pop_ready() {
                    delivered.push(v);
                }
            };
            let a = {
                let q = q.clone();
                thread::spawn(move || complete(&q, 2))
            };
            let b = {
                let q = q.clone();
                thread::spawn(move || complete(&q, 1))
            };
            // The flush: everything still open, then deliver.
            let open = q.lock().unwrap().0.open();
            for seq in open {
                complete(&q, seq);
            }
            a.join().unwrap();
            b.join().unwrap();
            complete(&q, 0);
            assert_eq!(q.lock().unwrap().1, vec![0, 1, 2]);
        });
    }
}
