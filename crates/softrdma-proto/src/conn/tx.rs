//! Transmit rules: framing send-queue work, responses and the Terminate
//! into FPDU descriptors (header bytes + payload spans + trailer).

use softrdma_wire::crc::{self, CRC_LEN, Crc32c};
use softrdma_wire::ddp::{self, DdpUntaggedRepr, Msn, Stag};
use softrdma_wire::fpdu::{FpduTrailer, pad_len};
use softrdma_wire::rdmap::atomic::AtomicResponseRepr;
use softrdma_wire::rdmap::immediate::ImmediateDataRepr;
use softrdma_wire::rdmap::read_request::ReadRequestRepr;
use softrdma_wire::rdmap::{self, Opcode};
use softrdma_wire::ulpdu::UlpduRepr;

use super::{
    Connection, Done, Kind, OutKind, OutRead, QN_ARESP, QN_RREQ, QN_SEND, Response,
    SEND_IMM_FOLLOWS, Slot,
};
use crate::mem::{Memory, Span};
use crate::qp_state::{ConnEvent, QpState};
use crate::types::{
    AsyncKind, Completion, CqKind, LinkAction, Output, SendOp, SendWr, WcOpcode, WcStatus,
};

/// Longest Terminate ULPDU: untagged header + Terminate header.
pub(super) const TERM_CAP: usize = 18 + softrdma_wire::rdmap::terminate::MAX_LEN;

/// Inline payload bytes carried per FPDU (in the header buffer).
pub(super) const INLINE_FPDU: usize = 256;

/// Header buffer of a [`TxFpdu`]: ULPDU length field and the longest
/// header or consumed ULPDU (a Terminate), or an untagged header with up to
/// 256 bytes of inline payload.
pub const HEAD_CAP: usize = 2 + if TERM_CAP > 18 + INLINE_FPDU {
    TERM_CAP
} else {
    18 + INLINE_FPDU
};

/// The longest FPDU [`Connection::post_send_framed`] frames: the ULPDU
/// length field, the untagged header, 256 octets of inline payload, at
/// most 3 octets of pad and the CRC field.
pub const SEND_NOW_MAX: usize = 2 + ddp::UNTAGGED_HEADER_LEN + INLINE_FPDU + 3 + CRC_LEN;

/// One FPDU to transmit: `head()`, then the bytes of every `payload()` span
/// (gathered from registered memory, in order), then `trailer()`.
#[derive(Debug, Clone)]
pub struct TxFpdu<R> {
    head: [u8; HEAD_CAP],
    head_len: usize,
    payload: Vec<Span<R>>,
    payload_len: usize,
    trailer: FpduTrailer,
}

impl<R: Clone> Default for TxFpdu<R> {
    fn default() -> Self {
        Self::new()
    }
}

impl<R: Clone> TxFpdu<R> {
    /// An empty descriptor (reuse it: its span list keeps its capacity).
    #[must_use]
    pub fn new() -> Self {
        TxFpdu {
            head: [0; HEAD_CAP],
            head_len: 0,
            payload: Vec::new(),
            payload_len: 0,
            trailer: FpduTrailer::new(0, 0),
        }
    }

    /// The ULPDU length field and the DDP/RDMAP header (or the whole ULPDU
    /// of a consumed message).
    #[must_use]
    pub fn head(&self) -> &[u8] {
        self.head.get(..self.head_len).unwrap_or_default()
    }

    /// The payload, by reference into registered memory.
    #[must_use]
    pub fn payload(&self) -> &[Span<R>] {
        &self.payload
    }

    /// Pad and CRC field.
    #[must_use]
    pub fn trailer(&self) -> &[u8] {
        self.trailer.as_bytes()
    }

    /// Total bytes of the FPDU on the wire.
    #[must_use]
    pub fn len(&self) -> usize {
        self.head_len + self.payload_len + self.trailer.as_bytes().len()
    }

    /// Never true for a filled descriptor.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the FPDU's bytes to `out`, gathering the payload with
    /// [`Memory::copy_out`] (the copying mode: tests, simulation).
    /// `false` if a span could not be read.
    pub fn write_to<M: Memory<Region = R>>(&self, mem: &mut M, out: &mut Vec<u8>) -> bool {
        out.extend_from_slice(self.head());
        for s in &self.payload {
            let at = out.len();
            out.resize(at + s.len, 0);
            if !mem.copy_out(s, 0, out.get_mut(at..).unwrap_or_default()) {
                return false;
            }
        }
        out.extend_from_slice(self.trailer());
        true
    }

    /// Empties the descriptor: lets go of its payload's regions (the span
    /// list keeps its capacity), without touching the header buffer.
    pub fn clear(&mut self) {
        self.head_len = 0;
        self.payload.clear();
        self.payload_len = 0;
    }

    /// Frames a whole ULPDU that fits the header buffer.
    fn set_consumed(&mut self, ulpdu: &UlpduRepr<'_>, crc: bool) -> bool {
        self.clear();
        let Some(dst) = self.head.get_mut(2..) else {
            return false;
        };
        let Ok(n) = ulpdu.emit(dst) else { return false };
        self.set_len_and_trailer(n, n, crc, None)
    }

    fn set_len_and_trailer(
        &mut self,
        hdr: usize,
        ulpdu_len: usize,
        crc: bool,
        payload_crc: Option<Crc32c>,
    ) -> bool {
        let Ok(len16) = u16::try_from(ulpdu_len) else {
            return false;
        };
        if let Some(d) = self.head.get_mut(..2) {
            d.copy_from_slice(&len16.to_be_bytes());
        }
        self.head_len = 2 + hdr;
        let c = if crc {
            let mut c = payload_crc.unwrap_or_else(|| {
                let mut c = Crc32c::new();
                c.update(self.head.get(..self.head_len).unwrap_or_default());
                c
            });
            c.update(&[0u8; 3][..pad_len(ulpdu_len)]);
            c.finish()
        } else {
            0
        };
        self.trailer = FpduTrailer::new(ulpdu_len, c);
        true
    }
}

/// Transmit state.
#[derive(Debug)]
pub(super) struct TxState {
    /// Next MSN to send per queue number.
    pub(super) msn: [Msn; 4],
    cur_off: usize,
    cur_started: bool,
    cur_msn: Msn,
    cur_imm_next: bool,
    resp_off: usize,
    resp_turn: bool,
    /// The Terminate ULPDU waiting to go out.
    pub(super) term: Option<([u8; TERM_CAP], usize)>,
}

impl TxState {
    pub(super) fn new() -> Self {
        TxState {
            msn: [Msn::INITIAL; 4],
            cur_off: 0,
            cur_started: false,
            cur_msn: Msn::INITIAL,
            cur_imm_next: false,
            resp_off: 0,
            resp_turn: false,
            term: None,
        }
    }

    pub(super) fn reset_current(&mut self) {
        self.cur_off = 0;
        self.cur_started = false;
        self.cur_imm_next = false;
        self.resp_off = 0;
    }
}

impl<R: Clone + core::fmt::Debug> Connection<R> {
    /// Fills `out` with the next FPDU to transmit; `false` if there is none
    /// now (no work, ORD credits or a fence wait, or the connection is
    /// finished). Hand every FPDU to the socket in order and report the
    /// whole ones written with [`Connection::handle_sent`].
    pub fn poll_transmit<M: Memory<Region = R>>(
        &mut self,
        mem: &mut M,
        out: &mut TxFpdu<R>,
    ) -> bool {
        if let Some((buf, n)) = self.tx.term.take() {
            out.clear();
            let Some(dst) = out.head.get_mut(2..2 + n) else {
                return false;
            };
            dst.copy_from_slice(buf.get(..n).unwrap_or_default());
            out.set_len_and_trailer(n, n, self.cfg.crc, None);
            self.inflight.push_back(Done::Terminate);
            return true;
        }
        if !matches!(self.state, QpState::Rts | QpState::Closing) {
            return false;
        }
        let resp_first = self.tx.resp_turn;
        self.tx.resp_turn = !self.tx.resp_turn;
        // Alternate between responses and the send queue.
        for resp in [resp_first, !resp_first] {
            let framed = if resp {
                self.frame_response(mem, out)
            } else {
                self.frame_sq(mem, out)
            };
            if framed {
                return true;
            }
        }
        if self.fin_pending && !self.fin_sent && self.sq_done() && self.resp.is_empty() {
            // Everything posted before the close is handed out: FIN after it.
            self.fin_pending = false;
            self.outputs.push_back(Output::Link(LinkAction::SendFin));
            if !self.cfg.confirm_fin {
                self.fin_sent = true;
                self.try_finish_close();
            }
        }
        false
    }

    /// `fpdus` more FPDUs handed out by [`Connection::poll_transmit`] were
    /// written completely (in order): their requests complete, IRD slots
    /// free up, and after the Terminate the QP enters ERROR.
    pub fn handle_sent(&mut self, fpdus: usize) {
        for _ in 0..fpdus {
            let Some(d) = self.inflight.pop_front() else {
                return;
            };
            match d {
                Done::Nothing => {}
                Done::SqMessage { seq, byte_len } => {
                    self.complete_sq(seq, WcStatus::Success, byte_len, 0);
                }
                Done::Terminate => {
                    let was_error = self.state == QpState::Error;
                    self.transition(ConnEvent::TerminateDone);
                    self.set_error();
                    if !was_error && self.cfg.srq {
                        // ERROR reached after the Terminate went out: the
                        // SRQ's last WQE event, as on every way into ERROR.
                        self.push_event(AsyncKind::QpLastWqeReached, None);
                    }
                    self.outputs.push_back(Output::Link(LinkAction::Shutdown));
                }
            }
        }
    }

    /// Posts a small inline Send and frames it into `out` in one pass, if
    /// the connection is idle: [`post_send`](Self::post_send) followed by
    /// [`poll_transmit`](Self::poll_transmit), without the queued request
    /// in between. Returns the FPDU's length, the bytes at the start of
    /// `out` (the ULPDU length, the untagged header, the payload, the pad
    /// and the CRC field); the FPDU counts as handed out, exactly as if
    /// `poll_transmit` had framed it: write it to the socket before
    /// anything `poll_transmit` hands out later, and report it written
    /// with [`handle_sent`](Self::handle_sent), which completes the
    /// request.
    ///
    /// Taken only for an inline Send without Immediate Data (Send, with
    /// Solicited Event, with Invalidate) whose payload fits one FPDU, in
    /// RTS, with nothing queued or handed out and not yet written before
    /// it (no request on the send queue, no response or Terminate owed, no
    /// FPDU in flight), no fence to wait for, and room on the send queue;
    /// the request would pass every check of `post_send`. Otherwise
    /// `None`, and nothing changed: post it with `post_send`. The bytes,
    /// the MSN, the completion and its order are those of the general
    /// path (markers are never negotiated, see [`Config::crc`]).
    ///
    /// [`Config::crc`]: super::Config::crc
    pub fn post_send_framed(&mut self, wr: &SendWr<'_>, out: &mut [u8]) -> Option<usize> {
        let SendOp::Send { inv, imm: None } = wr.op else {
            return None;
        };
        let data = wr.inline?;
        let len = data.len();
        let ulpdu_len = ddp::UNTAGGED_HEADER_LEN + len;
        let pad = pad_len(ulpdu_len);
        let total = 2 + ulpdu_len + pad + CRC_LEN;
        if self.state != QpState::Rts
            || !self.sq.is_empty()
            || !self.inflight.is_empty()
            || !self.resp.is_empty()
            || self.tx.term.is_some()
            || self.tx.cur_started
            || len > self.cfg.max_inline
            || len > self.cfg.max_payload.min(INLINE_FPDU)
            || wr.sgl.len() > self.cfg.max_send_sge
            || self.slots.len() >= self.cfg.max_send_wr as usize
            || !self.ord.may_start(wr.fence, false)
            || out.len() < total
        {
            return None;
        }
        let opcode = match (wr.solicited, inv.is_some()) {
            (false, false) => Opcode::Send,
            (true, false) => Opcode::SendWithSolicitedEvent,
            (false, true) => Opcode::SendWithInvalidate,
            (true, true) => Opcode::SendWithSolicitedEventAndInvalidate,
        };
        let msn = self.tx.msn[QN_SEND];
        let hdr = DdpUntaggedRepr {
            last: true,
            rsvd_ulp: rdmap::control_byte(opcode),
            rsvd_ulp_ext: inv.unwrap_or(0),
            qn: ddp::QN_SEND,
            msn,
            mo: 0,
        };
        let covered = 2 + ulpdu_len + pad;
        {
            let (head, rest) = out.split_at_mut(2 + ddp::UNTAGGED_HEADER_LEN);
            let (len_field, hdr_field) = head.split_at_mut(2);
            // `ulpdu_len` is at most 18 + 256 (checked above).
            len_field.copy_from_slice(&u16::try_from(ulpdu_len).ok()?.to_be_bytes());
            hdr.emit(hdr_field).ok()?;
            let (payload, rest) = rest.split_at_mut(len);
            payload.copy_from_slice(data);
            if let Some(p) = rest.get_mut(..pad) {
                p.fill(0);
            }
        }
        let c = if self.cfg.crc {
            crc::crc32c(out.get(..covered).unwrap_or_default())
        } else {
            0
        };
        out.get_mut(covered..total)?
            .copy_from_slice(&crc::to_wire(c));
        // As `post_send` queues it and `frame_data_wqe` frames it.
        let seq = self.slots.push(Slot {
            wr_id: wr.wr_id,
            opcode: WcOpcode::Send,
            signaled: wr.signaled,
            internal: wr.internal,
            status: None,
            byte_len: 0,
            vendor_err: 0,
        });
        self.tx.msn[QN_SEND] = msn.next();
        self.tx.cur_msn = msn;
        self.inflight.push_back(Done::SqMessage {
            seq,
            byte_len: u32::try_from(len).unwrap_or(u32::MAX),
        });
        Some(total)
    }

    /// [`handle_sent`](Self::handle_sent)`(1)` for the FPDU of
    /// [`post_send_framed`](Self::post_send_framed), written whole right
    /// after it was framed: its request completes. When it was the only
    /// request outstanding and nothing waits to be delivered before its
    /// completion (no completion, event or state change queued), that
    /// completion is returned instead of being queued for
    /// [`poll_completion`](Self::poll_completion) (`None` for an
    /// unsignaled request too): the one it would have been polled as
    /// next. Otherwise `None`, and it is delivered as `handle_sent`
    /// delivers it.
    pub fn handle_sent_framed(&mut self) -> Option<Completion> {
        if self.slots.len() == 1
            && self.completions.is_empty()
            && self.outputs.is_empty()
            && let Some(&Done::SqMessage { seq, byte_len }) = self.inflight.front()
            && self.slots.complete(seq, |_| {})
        {
            // The only request outstanding: its completion is the next
            // one delivered, built as `complete_sq` builds it.
            self.inflight.pop_front();
            let s = self.slots.pop_ready()?;
            return (s.signaled || s.internal).then_some(Completion {
                cq: CqKind::Send,
                wr_id: s.wr_id,
                status: WcStatus::Success,
                opcode: s.opcode,
                byte_len,
                imm: None,
                invalidated: None,
                solicited: false,
                vendor_err: 0,
                internal: s.internal,
            });
        }
        self.handle_sent(1);
        None
    }

    /// FPDUs handed out and not yet reported written.
    #[must_use]
    pub fn fpdus_in_flight(&self) -> usize {
        self.inflight.len()
    }

    /// The last FPDU of a response is handed out: its IRD slot is free.
    /// Freed here, not when the bytes are written: the peer may answer the
    /// response (with a new request) before the writer learns its write
    /// finished. (The engine frees it in `TxState::advance`, after
    /// `writev` returns, and a new Read Request processed by the receive
    /// thread in between is refused with a "MSN range" Terminate.)
    fn release_ird(&mut self) {
        self.ird.release();
    }

    fn sq_done(&self) -> bool {
        self.sq.is_empty() || (self.peer_closed && !self.tx.cur_started)
    }

    fn frame_response<M: Memory<Region = R>>(&mut self, mem: &mut M, out: &mut TxFpdu<R>) -> bool {
        let crc = self.cfg.crc;
        let Some(r) = self.resp.front() else {
            return false;
        };
        match r {
            Response::Atomic {
                request_id,
                original,
            } => {
                let msn = self.tx.msn[QN_ARESP];
                self.tx.msn[QN_ARESP] = msn.next();
                let ulpdu = UlpduRepr::atomic_response(
                    msn,
                    AtomicResponseRepr {
                        request_id: *request_id,
                        original_value: *original,
                    },
                );
                let ok = out.set_consumed(&ulpdu, crc);
                self.resp.pop_front();
                self.release_ird();
                self.inflight.push_back(Done::Nothing);
                ok
            }
            Response::Read {
                src,
                sink_stag,
                sink_to,
            } => {
                let off = self.tx.resp_off;
                let chunk = (src.len - off).min(self.cfg.max_payload);
                let last = off + chunk == src.len;
                let ulpdu = UlpduRepr::tagged(
                    Opcode::RdmaReadResponse,
                    Stag(*sink_stag),
                    sink_to.wrapping_add(off as u64),
                    last,
                    &[],
                );
                let piece = src.slice(off, chunk);
                let ok = frame_data(out, &ulpdu, None, Some(piece), chunk, crc, mem);
                if last {
                    self.resp.pop_front();
                    self.tx.resp_off = 0;
                    self.release_ird();
                } else {
                    self.tx.resp_off += chunk;
                }
                self.inflight.push_back(Done::Nothing);
                ok
            }
        }
    }

    fn frame_sq<M: Memory<Region = R>>(&mut self, mem: &mut M, out: &mut TxFpdu<R>) -> bool {
        if self.peer_closed && !self.tx.cur_started {
            return false;
        }
        let crc = self.cfg.crc;
        loop {
            let Some(w) = self.sq.front() else {
                return false;
            };
            if let Some(status) = w.failed {
                // A request that failed its checks at post time reached the
                // head of the queue: it completes with its error and the QP
                // enters ERROR — once what was framed before it is written
                // (`handle_sent`), so the requests before it complete, as
                // in the engine.
                if !self.inflight.is_empty() {
                    return false;
                }
                let seq = w.seq;
                self.sq.pop_front();
                self.complete_sq(seq, status, 0, 0);
                self.push_event(AsyncKind::QpFatal, None);
                self.enter_error(ConnEvent::LocalAbort, Some(LinkAction::Reset));
                return false;
            }
            if !self.tx.cur_started {
                // Fence: wait for all earlier Reads and atomics; a Read or
                // atomic waits for an ORD slot.
                let takes_slot = matches!(w.kind, Kind::Read { .. } | Kind::Atomic { .. });
                if !self.ord.may_start(w.fence, takes_slot) {
                    return false;
                }
            }
            let seq = w.seq;
            match &w.kind {
                Kind::Local => {
                    self.sq.pop_front();
                    self.complete_sq(seq, WcStatus::Success, 0, 0);
                }
                Kind::Read {
                    stag,
                    to,
                    sink,
                    sink_stag,
                    sink_to,
                } => {
                    let msn = self.tx.msn[QN_RREQ];
                    self.tx.msn[QN_RREQ] = msn.next();
                    let req = ReadRequestRepr {
                        sink_stag: Stag(*sink_stag),
                        sink_to: *sink_to,
                        read_size: u32::try_from(sink.len).unwrap_or(u32::MAX),
                        src_stag: Stag(*stag),
                        src_to: *to,
                    };
                    self.ord.push(OutRead {
                        seq,
                        kind: OutKind::Read {
                            sink: sink.clone(),
                            progress: crate::order::ReadSink::new(*sink_stag, *sink_to, sink.len),
                        },
                    });
                    let ok = out.set_consumed(&UlpduRepr::read_request(msn, req), crc);
                    self.sq.pop_front();
                    self.inflight.push_back(Done::Nothing);
                    return ok;
                }
                Kind::Atomic { req, sink } => {
                    let msn = self.tx.msn[QN_RREQ];
                    self.tx.msn[QN_RREQ] = msn.next();
                    self.ord.push(OutRead {
                        seq,
                        kind: OutKind::Atomic {
                            request_id: req.request_id,
                            sink: sink.clone(),
                        },
                    });
                    let ok = out.set_consumed(&UlpduRepr::atomic_request(msn, *req), crc);
                    self.sq.pop_front();
                    self.inflight.push_back(Done::Nothing);
                    return ok;
                }
                Kind::Send { .. } | Kind::Write { .. } => {
                    return self.frame_data_wqe(mem, out);
                }
            }
        }
    }

    /// Frames the next FPDU of the Send or Write at the head of the queue.
    fn frame_data_wqe<M: Memory<Region = R>>(&mut self, mem: &mut M, out: &mut TxFpdu<R>) -> bool {
        let crc = self.cfg.crc;
        let max = self.cfg.max_payload;
        let Some(w) = self.sq.front() else {
            return false;
        };
        let (imm, is_send) = match &w.kind {
            Kind::Send { imm, .. } => (*imm, true),
            Kind::Write { imm, .. } => (*imm, false),
            _ => return false,
        };
        let byte_len = u32::try_from(w.len).unwrap_or(u32::MAX);
        let seq = w.seq;
        if self.tx.cur_imm_next {
            // The Immediate Data message that ends this request.
            let msn = self.tx.msn[QN_SEND];
            self.tx.msn[QN_SEND] = msn.next();
            let data = ImmediateDataRepr::from_be_u64(u64::from(imm.unwrap_or(0)));
            let ulpdu = UlpduRepr::immediate(msn, data, w.solicited);
            let ok = out.set_consumed(&ulpdu, crc);
            self.inflight.push_back(Done::SqMessage { seq, byte_len });
            self.finish_front();
            return ok;
        }
        if !self.tx.cur_started && is_send {
            self.tx.cur_msn = self.tx.msn[QN_SEND];
            self.tx.msn[QN_SEND] = self.tx.cur_msn.next();
        }
        self.tx.cur_started = true;
        let off = self.tx.cur_off;
        let max = if w.inline.is_some() {
            max.min(INLINE_FPDU)
        } else {
            max
        };
        let chunk = (w.len - off).min(max);
        let last = off + chunk == w.len;
        let mut patch_imm = false;
        let ulpdu = match &w.kind {
            Kind::Send { inv, .. } => {
                let opcode = match (w.solicited, inv.is_some()) {
                    (false, false) => Opcode::Send,
                    (true, false) => Opcode::SendWithSolicitedEvent,
                    (false, true) => Opcode::SendWithInvalidate,
                    (true, true) => Opcode::SendWithSolicitedEventAndInvalidate,
                };
                patch_imm = imm.is_some();
                UlpduRepr::send(
                    opcode,
                    inv.map(Stag),
                    self.tx.cur_msn,
                    u32::try_from(off).unwrap_or(u32::MAX),
                    last,
                    &[],
                )
            }
            Kind::Write { stag, to, .. } => UlpduRepr::tagged(
                Opcode::RdmaWrite,
                Stag(*stag),
                to.wrapping_add(off as u64),
                last,
                &[],
            ),
            _ => return false,
        };
        out.clear();
        let patch = patch_imm.then_some(SEND_IMM_FOLLOWS);
        let ok = match &w.inline {
            Some(data) => frame_inline(
                out,
                &ulpdu,
                patch,
                data.get(off..off + chunk).unwrap_or_default(),
                crc,
            ),
            None => {
                collect_pieces(&w.segs, off, chunk, &mut out.payload);
                frame_data(out, &ulpdu, patch, None, chunk, crc, mem)
            }
        };
        self.inflight.push_back(if last && imm.is_none() {
            Done::SqMessage { seq, byte_len }
        } else {
            Done::Nothing
        });
        if last {
            if imm.is_some() {
                self.tx.cur_imm_next = true;
            } else {
                self.finish_front();
            }
        } else {
            self.tx.cur_off += chunk;
        }
        ok
    }

    fn finish_front(&mut self) {
        if let Some(e) = self.sq.pop_front() {
            self.recycle_sq(e);
        }
        self.tx.cur_off = 0;
        self.tx.cur_started = false;
        self.tx.cur_imm_next = false;
    }
}

/// The spans covering `[off, off + len)` of a gather list.
fn collect_pieces<R: Clone>(
    segs: &[Span<R>],
    mut off: usize,
    mut len: usize,
    out: &mut Vec<Span<R>>,
) {
    for s in segs {
        if len == 0 {
            break;
        }
        if off >= s.len {
            off -= s.len;
            continue;
        }
        let k = (s.len - off).min(len);
        out.push(s.slice(off, k));
        len -= k;
        off = 0;
    }
}

/// Frames a data FPDU whose payload (inline data) is copied into the
/// header buffer after the header.
fn frame_inline<R: Clone>(
    out: &mut TxFpdu<R>,
    ulpdu: &UlpduRepr<'_>,
    patch_rsvd: Option<u32>,
    bytes: &[u8],
    crc: bool,
) -> bool {
    let Some(dst) = out.head.get_mut(2..) else {
        return false;
    };
    let Ok(hdr) = ulpdu.emit_header(dst) else {
        return false;
    };
    let Some(d) = out.head.get_mut(2 + hdr..2 + hdr + bytes.len()) else {
        return false;
    };
    d.copy_from_slice(bytes);
    if let Some(v) = patch_rsvd
        && let Some(d) = out.head.get_mut(4..8)
    {
        d.copy_from_slice(&v.to_be_bytes());
    }
    out.set_len_and_trailer(hdr + bytes.len(), hdr + bytes.len(), crc, None)
}

/// Frames a data FPDU: header, then the payload spans already in
/// `out.payload` (plus `extra`), `len` bytes in all.
fn frame_data<R: Clone, M: Memory<Region = R>>(
    out: &mut TxFpdu<R>,
    ulpdu: &UlpduRepr<'_>,
    patch_rsvd: Option<u32>,
    extra: Option<Span<R>>,
    len: usize,
    crc: bool,
    mem: &mut M,
) -> bool {
    if let Some(e) = extra {
        out.clear();
        if e.len > 0 {
            out.payload.push(e);
        }
    }
    out.payload_len = len;
    let Some(dst) = out.head.get_mut(2..) else {
        return false;
    };
    let Ok(hdr) = ulpdu.emit_header(dst) else {
        return false;
    };
    if let Some(v) = patch_rsvd
        && let Some(d) = out.head.get_mut(4..8)
    {
        // RsvdULP[8:39] of the untagged header: bytes 2..6 of the DDP header.
        d.copy_from_slice(&v.to_be_bytes());
    }
    let mut c = None;
    if crc {
        let mut cc = Crc32c::new();
        let ulpdu_len = hdr + len;
        let Ok(len16) = u16::try_from(ulpdu_len) else {
            return false;
        };
        cc.update(&len16.to_be_bytes());
        cc.update(out.head.get(2..2 + hdr).unwrap_or_default());
        for s in &out.payload {
            if !mem.crc_update(s, &mut cc) {
                return false;
            }
        }
        c = Some(cc);
    }
    out.set_len_and_trailer(hdr, hdr + len, crc, c)
}

#[cfg(test)]
mod tests;
