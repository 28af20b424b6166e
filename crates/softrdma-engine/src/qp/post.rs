//! Posting: checking and queuing send and receive requests, and the
//! direct-send hand-off (`kick`) that transmits in the posting thread.

use super::*;

impl QpInner {
    pub(super) fn post_one(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        if self.core_mode() {
            return self.core_post_send(wr);
        }
        let signaled = self.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED);
        let (opcode, wqe) = self.prepare_send(wr)?;
        self.enqueue(wr.wr_id, opcode, signaled, false, wqe)
    }

    /// Checks a send request as [`post_send`](QueuePair::post_send) would and
    /// returns it ready for [`enqueue`](Self::enqueue) (for proxy handlers,
    /// whose replies are posted only if the handler succeeds).
    pub(crate) fn prepare_send(
        &self,
        wr: &SendWr<'_>,
    ) -> Result<(WcOpcode, SendWqe), PostSendError> {
        if self.send_policy() == PostPolicy::Reject {
            return Err(PostSendError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            });
        }
        if wr.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(PostSendError::TooManySges {
                count: wr.sg_list.len(),
                max: self.cap.max_send_sge,
            });
        }
        let inline = wr.flags.contains(SendFlags::INLINE);
        if inline && wr.inline.len() > self.cap.max_inline_data as usize {
            return Err(PostSendError::InlineTooLarge {
                len: wr.inline.len(),
                max: self.cap.max_inline_data,
            });
        }
        self.build_wqe(wr, inline)
    }

    /// Queues a checked request: takes a send-queue slot (completion order)
    /// and hands it to the transmit path, or flushes it in ERROR.
    pub(crate) fn enqueue(
        &self,
        wr_id: u64,
        opcode: WcOpcode,
        signaled: bool,
        proxy_owned: bool,
        wqe: SendWqe,
    ) -> Result<(), PostSendError> {
        let policy = self.send_policy();
        if policy == PostPolicy::Reject {
            return Err(PostSendError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            });
        }
        // Reserve a send-queue slot.
        let depth = self.cap.max_send_wr;
        if self
            .sq_outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < depth).then_some(n + 1)
            })
            .is_err()
        {
            return Err(PostSendError::QueueFull { depth });
        }
        let mut c = self.comp.lock();
        let seq = c.push(Slot {
            wr_id,
            opcode,
            signaled,
            status: None,
            byte_len: 0,
            vendor_err: 0,
            proxy_owned,
        });
        let mut wqe = wqe;
        wqe.seq = seq;
        if policy == PostPolicy::Flush || self.send_policy() == PostPolicy::Flush {
            drop(c);
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
            return Ok(());
        }
        self.incoming.push(wqe);
        drop(c);
        Ok(())
    }

    /// Validates a send request and turns it into a queued request.
    fn build_wqe(
        &self,
        wr: &SendWr<'_>,
        inline: bool,
    ) -> Result<(WcOpcode, SendWqe), PostSendError> {
        let stags = self.device.stags();
        let pd = self.pd.id();
        let mut failed = None;
        // The checked gather list: one SGE (the usual case) without an
        // allocation; an empty list if an SGE is refused (`failed` says
        // why).
        let mut segs_for = |need_write: bool| -> Payload {
            if let [sge] = wr.sg_list {
                return match stags.local(sge.lkey, pd, sge.addr, sge.length, need_write) {
                    Ok(seg) => Payload::Seg(seg),
                    Err(e) => {
                        failed = Some(e.wc_status());
                        Payload::Segs(Vec::new())
                    }
                };
            }
            let mut v = Vec::with_capacity(wr.sg_list.len());
            for sge in wr.sg_list {
                match stags.local(sge.lkey, pd, sge.addr, sge.length, need_write) {
                    Ok(seg) => v.push(seg),
                    Err(e) => {
                        failed = Some(e.wc_status());
                        return Payload::Segs(Vec::new());
                    }
                }
            }
            Payload::Segs(v)
        };
        let sge_len: usize = wr.sg_list.iter().map(|s| s.length as usize).sum();
        let (payload, len) = if inline {
            (Payload::inline(wr.inline), wr.inline.len())
        } else {
            (Payload::None, sge_len)
        };
        let single_sink = |op: &'static str, exact: Option<u32>| -> Result<(), PostSendError> {
            if wr.sg_list.len() != 1 {
                return Err(PostSendError::Invalid {
                    op,
                    why: "needs exactly one SGE as its local sink",
                });
            }
            if let Some(n) = exact
                && wr.sg_list.first().map(|s| s.length) != Some(n)
            {
                return Err(PostSendError::Invalid {
                    op,
                    why: "the local sink must be 8 bytes",
                });
            }
            Ok(())
        };
        let mut wqe = SendWqe {
            seq: 0,
            kind: WqeKind::Local,
            payload,
            len,
            fence: wr.flags.contains(SendFlags::FENCE),
            solicited: wr.flags.contains(SendFlags::SOLICITED),
            failed: None,
        };
        if len > u32::MAX as usize {
            return Err(PostSendError::Invalid {
                op: "send",
                why: "message longer than 4 GiB",
            });
        }
        let data_payload = |segs: Payload, wqe: &mut SendWqe| {
            if !inline {
                wqe.payload = segs;
            }
        };
        let opcode = match wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
                let segs = if inline {
                    Payload::None
                } else {
                    segs_for(false)
                };
                data_payload(segs, &mut wqe);
                wqe.kind = WqeKind::Send {
                    inv: match wr.op {
                        SendOp::SendWithInv { invalidate_rkey } => Some(invalidate_rkey),
                        _ => None,
                    },
                    imm: match wr.op {
                        SendOp::SendWithImm { imm } => Some(imm),
                        _ => None,
                    },
                };
                WcOpcode::Send
            }
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } => {
                let segs = if inline {
                    Payload::None
                } else {
                    segs_for(false)
                };
                data_payload(segs, &mut wqe);
                wqe.kind = WqeKind::Write {
                    stag: rkey,
                    to: remote_addr,
                    imm: match wr.op {
                        SendOp::WriteWithImm { imm, .. } => Some(imm),
                        _ => None,
                    },
                };
                WcOpcode::RdmaWrite
            }
            SendOp::Read { remote_addr, rkey } => {
                single_sink("RDMA Read", None)?;
                let segs = segs_for(true);
                wqe.payload = Payload::None;
                let (sink_stag, sink_to) = wr.sg_list.first().map_or((0, 0), |s| (s.lkey, s.addr));
                match segs.into_last_seg() {
                    Some(sink) => {
                        wqe.kind = WqeKind::Read {
                            stag: rkey,
                            to: remote_addr,
                            sink,
                            sink_stag,
                            sink_to,
                        }
                    }
                    None => wqe.kind = WqeKind::Local,
                }
                WcOpcode::RdmaRead
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            }
            | SendOp::CmpSwap {
                remote_addr,
                rkey,
                compare: _,
                swap: add,
            } => {
                let is_cas = matches!(wr.op, SendOp::CmpSwap { .. });
                single_sink(if is_cas { "CmpSwap" } else { "FetchAdd" }, Some(8))?;
                if remote_addr % 8 != 0 {
                    return Err(PostSendError::Invalid {
                        op: "atomic",
                        why: "the remote address must be 8-byte aligned",
                    });
                }
                let segs = segs_for(true);
                wqe.payload = Payload::None;
                wqe.len = 8;
                let request_id = self.next_request_id();
                let req = match wr.op {
                    SendOp::CmpSwap { compare, swap, .. } => AtomicRequestRepr::cmp_swap(
                        request_id,
                        Stag(rkey),
                        remote_addr,
                        compare,
                        swap,
                    ),
                    _ => AtomicRequestRepr::fetch_add(request_id, Stag(rkey), remote_addr, add),
                };
                match segs.into_last_seg() {
                    Some(sink) => wqe.kind = WqeKind::Atomic { req, sink },
                    None => wqe.kind = WqeKind::Local,
                }
                if is_cas {
                    WcOpcode::CompSwap
                } else {
                    WcOpcode::FetchAdd
                }
            }
            SendOp::LocalInv { rkey } => {
                wqe.payload = Payload::None;
                if let Err(_e) = stags.invalidate(rkey, pd, false) {
                    failed = Some(WcStatus::LocalProtection);
                }
                WcOpcode::LocalInv
            }
            SendOp::BindMw {
                mw,
                mr,
                addr,
                length,
                access,
                key,
            } => {
                wqe.payload = Payload::None;
                if stags
                    .bind_mw_with_key(mw, mr, addr, length, access, key)
                    .is_err()
                {
                    failed = Some(WcStatus::MwBind);
                }
                WcOpcode::BindMw
            }
            SendOp::FastReg {
                mr,
                iova,
                length,
                access,
            } => {
                wqe.payload = Payload::None;
                if stags.fast_reg(mr, iova, length, access).is_err() {
                    failed = Some(WcStatus::LocalProtection);
                }
                WcOpcode::RegMr
            }
        };
        wqe.failed = failed;
        Ok((opcode, wqe))
    }

    fn next_request_id(&self) -> u32 {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Puts a consumed receive back at the end of the receive queue (a
    /// proxy recycling the buffer of a message it served). False if the QP
    /// uses an SRQ, no longer accepts receives or its queue is full.
    pub(crate) fn repost_recv(&self, wqe: RecvWqe) -> bool {
        if self.srq.is_some()
            || self.recv_policy() != PostPolicy::Accept
            || self.rq.push(wqe).is_err()
        {
            return false;
        }
        self.recheck_rq();
        true
    }

    pub(super) fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        if self.srq.is_some() {
            return Err(PostRecvError::HasSrq);
        }
        if self.core_mode()
            && let Some(r) = self.core_post_recv(wr)
        {
            return r;
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
            self.enter_error(None, Some(AsyncEventKind::QpFatal));
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
            self.flush_recv_one(wqe.wr_id);
            return Ok(());
        }
        if self.rq.push(wqe).is_err() {
            return Err(PostRecvError::QueueFull {
                depth: self.cap.max_recv_wr,
            });
        }
        self.recheck_rq();
        Ok(())
    }

    /// After queuing a receive: if the state stopped accepting receives
    /// meanwhile (an error or the end of a close flushed the queue between
    /// our state check and our push), flush what is queued, ours included,
    /// so that every accepted receive completes. In CLOSING the queue is
    /// kept: Sends still arriving use it, and the close flushes it when it
    /// ends (IDLE or ERROR, both after their state change).
    fn recheck_rq(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        let policy = self.recv_policy();
        if policy != PostPolicy::Accept && self.state() != QpState::Closing {
            self.flush_rq();
        }
    }

    pub(super) fn flush_recv_one(&self, wr_id: u64) {
        self.complete_recv(
            WorkCompletion::error(wr_id, WcOpcode::Recv, self.qp_num, WcStatus::WrFlush),
            false,
        );
    }

    pub(super) fn flush_rq(&self) {
        while let Some(w) = self.rq.pop() {
            self.flush_recv_one(w.wr_id);
        }
    }

    /// Moves queued requests into the transmit state (caller holds it).
    pub(crate) fn drain_incoming(&self, tx: &mut TxState) {
        while let Some(w) = self.incoming.pop() {
            if tx.closed {
                self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
            } else {
                tx.sq.push_back(w);
            }
        }
    }

    /// Direct sending: transmit in the calling thread if no one else is.
    pub(crate) fn kick(&self) {
        if self.core_mode() {
            self.core_kick();
            return;
        }
        self.tx.announce();
        loop {
            let Some(mut tx) = self.tx.try_claim() else {
                // The holder re-checks the announcement after unlocking.
                return;
            };
            self.drain_incoming(&mut tx);
            if tx.on_dm {
                return;
            }
            if self.device.config().force_datamover {
                if tx.has_work() {
                    tx.on_dm = true;
                    drop(tx);
                    self.schedule_dm();
                    return;
                }
                // A request pushed while we held the lock: its poster's
                // try-lock failed, so it is ours to hand over.
                if !self.tx.release(tx) {
                    return;
                }
                continue;
            }
            let outcome = tx.progress(self, usize::MAX);
            // A request that failed at post time reached the head of the
            // queue; act on it once what was framed before it is written
            // (the transmit path reports Idle then), not before.
            let fatal = if matches!(outcome, TxOutcome::Idle) {
                tx.fatal.take()
            } else {
                None
            };
            match outcome {
                TxOutcome::Idle | TxOutcome::Budget => {}
                TxOutcome::FinSent => {
                    drop(tx);
                    self.fin_sent();
                    return;
                }
                TxOutcome::WouldBlock => {
                    tx.on_dm = true;
                    drop(tx);
                    self.schedule_dm();
                    return;
                }
                TxOutcome::Failed(e) => {
                    drop(tx);
                    self.link_failed(&e);
                    return;
                }
            }
            let again = self.tx.release(tx);
            if fatal.is_some() {
                // The failed request has its status already; the Reads and
                // atomics still outstanding are flushed.
                self.enter_error(None, Some(AsyncEventKind::QpFatal));
                return;
            }
            if !again {
                return;
            }
        }
    }

    pub(super) fn schedule_dm(&self) {
        if let Some(me) = self.self_weak.upgrade() {
            self.device.threads().schedule(&me);
        }
    }
}
