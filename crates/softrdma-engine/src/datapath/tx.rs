//! Transmit: framing work into FPDUs and writing them with vectored,
//! non-blocking writes straight from registered memory.
//!
//! A QP's [`TxState`] holds the send-queue work not yet on the wire, the
//! responses owed to the peer (RDMA Read Responses, Atomic Responses) and a
//! short queue of framed FPDUs. [`TxState::progress`] frames and writes until
//! the socket would block, the work runs out or a byte budget (a datamover's
//! slice) is spent. Whoever holds the QP's transmit lock runs it: the posting
//! thread (direct sending), the receive path (Read Responses), or the QP's
//! datamover.
//!
//! An FPDU is `[length | DDP/RDMAP header | small payload]` from a small
//! buffer, then the payload pieces by reference into registered memory, then
//! `[pad | CRC]`: one `iovec` list, no payload copy (payloads up to
//! [`COPY_MAX`] bytes are copied into the header buffer, which is cheaper
//! than an extra `iovec`).

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use softrdma_wire::crc::Crc32c;
use softrdma_wire::ddp::{
    Msn, QN_ATOMIC_RESPONSE, QN_READ_REQUEST, QN_SEND, QN_TERMINATE, Qn, Stag,
};
use softrdma_wire::fpdu::{FpduTrailer, pad_len};
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::rdmap::atomic::{AtomicRequestRepr, AtomicResponseRepr};
use softrdma_wire::rdmap::immediate::ImmediateDataRepr;
use softrdma_wire::rdmap::read_request::ReadRequestRepr;
use softrdma_wire::rdmap::terminate::TerminateRepr;
use softrdma_wire::ulpdu::UlpduRepr;

use crate::datapath::{OutRead, OutReadKind, TxHost};
use crate::mr::Target;
use crate::sys::io::{IoVecs, crc_update_mem, writev};
use crate::sys::mem::Memory;
use crate::wc::WcStatus;
use crate::wr::LocalSeg;

/// Payloads up to this many bytes are copied into the FPDU's header buffer.
pub(crate) const COPY_MAX: usize = 256;

/// Header buffer: length field + largest header (an Atomic Request ULPDU or
/// a Terminate) + a copied payload.
const HEAD_CAP: usize = 2 + 18 + 52 + COPY_MAX;

/// Framed FPDUs kept ahead of the socket.
const MAX_OUT: usize = 32;
/// Framed bytes kept ahead of the socket.
const MAX_OUT_BYTES: usize = 512 * 1024;

/// The Send-with-Immediate marker, defined once in the protocol core.
pub(crate) use softrdma_proto::conn::SEND_IMM_FOLLOWS;

/// A DDP queue number (the wire crate's `QN_*`) as an index of the
/// per-queue MSN arrays.
pub(crate) const fn qi(qn: Qn) -> usize {
    qn.0 as usize
}

/// Inline payloads up to this size are kept in the request itself (no
/// allocation per post); larger ones in a box.
pub(crate) const SMALL_INLINE: usize = 32;

/// The payload of a send-queue request.
#[derive(Debug)]
pub(crate) enum Payload {
    /// No payload.
    None,
    /// Copied at post time, at most [`SMALL_INLINE`] octets.
    Small {
        /// The octets, `bytes[..len]`.
        bytes: [u8; SMALL_INLINE],
        /// How many.
        len: u8,
    },
    /// Copied at post time.
    Inline(Box<[u8]>),
    /// Gathered from one region at transmit time (the usual single SGE,
    /// no allocation per post).
    Seg(LocalSeg),
    /// Gathered from registered memory at transmit time.
    Segs(Vec<LocalSeg>),
}

impl Payload {
    /// A copy of inline data.
    pub(crate) fn inline(data: &[u8]) -> Payload {
        match u8::try_from(data.len()) {
            Ok(len) if data.len() <= SMALL_INLINE => {
                let mut bytes = [0u8; SMALL_INLINE];
                bytes[..data.len()].copy_from_slice(data);
                Payload::Small { bytes, len }
            }
            _ => Payload::Inline(data.into()),
        }
    }

    /// The inline octets, if the payload was copied at post time.
    fn inline_bytes(&self) -> Option<&[u8]> {
        match self {
            Payload::Small { bytes, len } => bytes.get(..usize::from(*len)),
            Payload::Inline(b) => Some(b),
            _ => None,
        }
    }

    /// The last segment of the gather list, if any.
    pub(crate) fn into_last_seg(self) -> Option<LocalSeg> {
        match self {
            Payload::Seg(s) => Some(s),
            Payload::Segs(mut v) => v.pop(),
            _ => None,
        }
    }

    /// The gather list (empty without one).
    fn segs(&self) -> &[LocalSeg] {
        match self {
            Payload::Seg(s) => std::slice::from_ref(s),
            Payload::Segs(v) => v,
            _ => &[],
        }
    }
}

/// What a send-queue request does on the wire.
#[derive(Debug)]
pub(crate) enum WqeKind {
    /// A Send variant.
    Send {
        /// Invalidate STag (Send with Invalidate).
        inv: Option<u32>,
        /// Immediate data (Send with Immediate).
        imm: Option<u32>,
    },
    /// RDMA Write (with immediate data if `imm`).
    Write {
        stag: u32,
        to: u64,
        imm: Option<u32>,
    },
    /// RDMA Read into `sink`.
    Read {
        stag: u32,
        to: u64,
        sink: LocalSeg,
        sink_stag: u32,
        sink_to: u64,
    },
    /// Atomic request; the original value goes to `sink` (8 bytes).
    Atomic {
        req: AtomicRequestRepr,
        sink: LocalSeg,
    },
    /// Local operation already executed at post time (bind, fast-register,
    /// local invalidate); completes in order without touching the wire.
    Local,
}

/// A validated send-queue request.
#[derive(Debug)]
pub(crate) struct SendWqe {
    /// Position in the send queue's completion order.
    pub(crate) seq: u64,
    pub(crate) kind: WqeKind,
    pub(crate) payload: Payload,
    /// Payload length.
    pub(crate) len: usize,
    pub(crate) fence: bool,
    pub(crate) solicited: bool,
    /// Set when the request failed its checks at post time: it completes
    /// with this status when its turn comes, and the QP enters ERROR.
    pub(crate) failed: Option<WcStatus>,
}

/// A response owed to the peer.
#[derive(Debug)]
pub(crate) enum Response {
    /// RDMA Read Response data from `src` to the peer's sink.
    Read {
        src: Target,
        sink_stag: u32,
        sink_to: u64,
    },
    /// Atomic Response.
    Atomic(AtomicResponseRepr),
}

/// What to do when an FPDU has been written completely.
#[derive(Debug, Clone, Copy)]
enum Done {
    Nothing,
    /// The last FPDU of send-queue request `seq`.
    SqMessage {
        seq: u64,
        byte_len: u32,
    },
    /// The Terminate message.
    Terminate,
}

/// One framed FPDU.
#[derive(Debug)]
struct OutFpdu {
    head: [u8; HEAD_CAP],
    head_len: usize,
    pieces: Vec<(Arc<Memory>, usize, usize)>,
    trailer: FpduTrailer,
    total: usize,
    written: usize,
    done: Done,
}

/// Result of a transmit pass.
#[derive(Debug)]
pub(crate) enum TxOutcome {
    /// Nothing more can be sent now (no work, or work waits for ORD credits
    /// or a fence).
    Idle,
    /// The socket would block.
    WouldBlock,
    /// The byte budget is spent; more work is ready.
    Budget,
    /// The socket failed.
    Failed(io::Error),
    /// All work was written and FIN sent (graceful close).
    FinSent,
}

/// Connection parameters of the transmit side.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TxLink {
    pub(crate) fd: RawFd,
    pub(crate) crc: bool,
    /// Largest ULPDU payload per FPDU.
    pub(crate) max_payload: usize,
}

/// The transmit state of a QP (behind its transmit lock).
#[derive(Debug)]
pub(crate) struct TxState {
    pub(crate) sq: VecDeque<SendWqe>,
    /// Payload bytes of `sq.front()` already framed.
    cur_off: usize,
    /// The first FPDU of `sq.front()` was framed (its MSN is `cur_msn`).
    cur_started: bool,
    cur_msn: Msn,
    /// The data of `sq.front()` is framed; its Immediate Data FPDU is next.
    cur_imm_next: bool,
    pub(crate) resp: VecDeque<Response>,
    resp_off: usize,
    term: Option<OutFpdu>,
    out: VecDeque<OutFpdu>,
    out_bytes: usize,
    iov: IoVecs,
    /// Next MSN to send per queue number.
    msn: [Msn; 4],
    /// Alternation between responses and the send queue.
    resp_turn: bool,
    /// The QP is in a datamover's lists: the posting thread leaves
    /// transmission to it.
    pub(crate) on_dm: bool,
    pub(crate) link: Option<TxLink>,
    /// Set by the transmit path when the QP must enter ERROR (a request that
    /// failed at post time reached the head of the queue).
    pub(crate) fatal: Option<WcStatus>,
    /// A Terminate was written (or given up on): send nothing more.
    pub(crate) closed: bool,
    /// Bytes written since creation.
    pub(crate) bytes_sent: u64,
    /// A graceful close is under way: send FIN once everything queued is
    /// on the wire.
    pub(crate) fin_pending: bool,
    /// FIN was sent.
    pub(crate) fin_sent: bool,
    /// The peer closed its side first: requests not yet started are not
    /// started any more (the remaining ones are flushed at IDLE).
    pub(crate) peer_closed: bool,
    /// A Terminate message was written completely.
    pub(crate) terminate_sent: bool,
}

impl TxState {
    pub(crate) fn new() -> Self {
        TxState {
            sq: VecDeque::new(),
            cur_off: 0,
            cur_started: false,
            cur_msn: Msn::INITIAL,
            cur_imm_next: false,
            resp: VecDeque::new(),
            resp_off: 0,
            term: None,
            out: VecDeque::new(),
            out_bytes: 0,
            iov: IoVecs::new(),
            msn: [Msn::INITIAL; 4],
            resp_turn: false,
            on_dm: false,
            link: None,
            fatal: None,
            closed: false,
            bytes_sent: 0,
            fin_pending: false,
            fin_sent: false,
            peer_closed: false,
            terminate_sent: false,
        }
    }

    /// First MSNs of the Send and Read Request queues.
    /// Forgets what belonged to the previous connection (framing position,
    /// queued FPDUs and responses, MSNs, the close and Terminate marks) so
    /// that a QP connected again after a graceful close transmits afresh.
    /// The send queue (empty in IDLE), the datamover listing and the byte
    /// count are kept.
    pub(crate) fn start_connection(&mut self) {
        let fresh = TxState::new();
        self.cur_off = 0;
        self.cur_started = false;
        self.cur_msn = fresh.cur_msn;
        self.cur_imm_next = false;
        self.resp.clear();
        self.resp_off = 0;
        self.term = None;
        self.out.clear();
        self.out_bytes = 0;
        self.msn = fresh.msn;
        self.resp_turn = false;
        self.fatal = None;
        self.closed = false;
        self.fin_pending = false;
        self.fin_sent = false;
        self.peer_closed = false;
        self.terminate_sent = false;
    }

    pub(crate) fn set_initial_msns(&mut self, send: Msn, read: Msn) {
        self.msn[qi(QN_SEND)] = send;
        self.msn[qi(QN_READ_REQUEST)] = read;
    }

    /// Whether there is anything to transmit (possibly blocked on credits).
    pub(crate) fn has_work(&self) -> bool {
        !self.sq.is_empty()
            || !self.resp.is_empty()
            || !self.out.is_empty()
            || self.term.is_some()
            || (self.fin_pending && !self.fin_sent)
    }

    /// Drops all queued work (the QP entered ERROR); returns the dropped
    /// send-queue requests so that they can be flushed.
    pub(crate) fn clear(&mut self) -> Vec<SendWqe> {
        self.out.clear();
        self.out_bytes = 0;
        self.resp.clear();
        self.term = None;
        self.cur_off = 0;
        self.cur_started = false;
        self.cur_imm_next = false;
        self.closed = true;
        self.sq.drain(..).collect()
    }

    /// Queues a Terminate message to go out before anything else that is not
    /// already partly written; everything else queued is dropped.
    pub(crate) fn queue_terminate(&mut self, term: &TerminateRepr<'_>) {
        // Keep only an FPDU already partly on the wire.
        while self.out.len() > 1 || self.out.front().is_some_and(|f| f.written == 0) {
            self.out.pop_back();
        }
        self.out_bytes = self.out.iter().map(|f| f.total - f.written).sum();
        let msn = self.msn[qi(QN_TERMINATE)];
        self.msn[qi(QN_TERMINATE)] = msn.next();
        let ulpdu = UlpduRepr::terminate(msn, *term);
        let crc = self.link.is_some_and(|l| l.crc);
        if let Some(f) = frame_consumed(&ulpdu, crc, Done::Terminate) {
            self.term = Some(f);
        }
    }

    /// Frames and writes until idle, blocked, or `budget` bytes are written.
    pub(crate) fn progress(&mut self, qp: &impl TxHost, budget: usize) -> TxOutcome {
        let Some(link) = self.link else {
            return TxOutcome::Idle;
        };
        let mut sent = 0usize;
        loop {
            if self.closed && self.term.is_none() && self.out.is_empty() {
                return TxOutcome::Idle;
            }
            if !self.closed {
                while self.out.len() < MAX_OUT && self.out_bytes < MAX_OUT_BYTES {
                    if !self.frame_one(qp, link) {
                        break;
                    }
                }
            }
            if (self.out.is_empty() || self.out.front().is_some_and(|f| f.written == 0))
                && let Some(t) = self.term.take()
            {
                self.out_bytes += t.total;
                self.out.push_front(t);
            }
            if self.out.is_empty() {
                let sq_done = self.sq.is_empty() || (self.peer_closed && !self.cur_started);
                if self.fin_pending && !self.fin_sent && sq_done && self.resp.is_empty() {
                    // Everything posted before the close is on the wire.
                    self.fin_pending = false;
                    return match crate::sys::io::shutdown_write(link.fd) {
                        Ok(()) => {
                            self.fin_sent = true;
                            TxOutcome::FinSent
                        }
                        // The connection is gone (the peer's RST after its
                        // FIN: ENOTCONN): a reset, reported now rather than
                        // by the close timer.
                        Err(e) => TxOutcome::Failed(e),
                    };
                }
                return TxOutcome::Idle;
            }
            self.build_iov(budget.saturating_sub(sent));
            match writev(link.fd, &self.iov) {
                Ok(n) => {
                    self.iov.clear();
                    self.bytes_sent += n as u64;
                    self.advance(qp, n);
                    sent = sent.saturating_add(n);
                    if sent >= budget {
                        return TxOutcome::Budget;
                    }
                }
                Err(e) => {
                    self.iov.clear();
                    if e.kind() == io::ErrorKind::WouldBlock {
                        return TxOutcome::WouldBlock;
                    }
                    return TxOutcome::Failed(e);
                }
            }
        }
    }

    /// Builds the iovec list of the framed FPDUs, skipping written bytes,
    /// with at most `cap` bytes (the rest of a datamover slice).
    fn build_iov(&mut self, cap: usize) {
        self.iov.clear();
        let mut left = cap;
        for f in &self.out {
            if !self.iov.has_room() || left == 0 {
                break;
            }
            let mut skip = f.written;
            let head = &f.head[..f.head_len];
            if skip >= head.len() {
                skip -= head.len();
            } else {
                let n = (head.len() - skip).min(left);
                self.iov.push_slice(&head[skip..skip + n]);
                left -= n;
                skip = 0;
            }
            for (mem, off, len) in &f.pieces {
                if skip >= *len {
                    skip -= len;
                    continue;
                }
                if !self.iov.has_room() || left == 0 {
                    return;
                }
                let n = (len - skip).min(left);
                self.iov.push_mem(mem, off + skip, n);
                left -= n;
                skip = 0;
            }
            if !self.iov.has_room() || left == 0 {
                return;
            }
            let tr = f.trailer.as_bytes();
            let tr = &tr[skip.min(tr.len())..];
            let n = tr.len().min(left);
            self.iov.push_slice(&tr[..n]);
            left -= n;
        }
    }

    /// Accounts `n` written bytes to the framed FPDUs, in order.
    fn advance(&mut self, qp: &impl TxHost, mut n: usize) {
        while n > 0 {
            let Some(f) = self.out.front_mut() else {
                return;
            };
            let left = f.total - f.written;
            let k = left.min(n);
            f.written += k;
            n -= k;
            self.out_bytes -= k;
            if f.written == f.total {
                let done = f.done;
                self.out.pop_front();
                match done {
                    Done::Nothing => {}
                    Done::SqMessage { seq, byte_len } => {
                        qp.complete_sq(seq, WcStatus::Success, byte_len, 0);
                    }
                    Done::Terminate => {
                        self.closed = true;
                        self.terminate_sent = true;
                    }
                }
            }
        }
    }

    /// Frames the next FPDU; `false` if nothing can be framed now.
    fn frame_one(&mut self, qp: &impl TxHost, link: TxLink) -> bool {
        let resp_first = self.resp_turn;
        self.resp_turn = !self.resp_turn;
        let first = if resp_first {
            self.frame_response(qp, link)
        } else {
            self.frame_sq(qp, link)
        };
        first
            || if resp_first {
                self.frame_sq(qp, link)
            } else {
                self.frame_response(qp, link)
            }
    }

    /// Frames the next response FPDU. The IRD slot of a response is freed
    /// when its last FPDU is framed, not when it has been written: the
    /// requester may receive that FPDU and send its next Read Request before
    /// `writev` returns here, and that request must find the slot free.
    fn frame_response(&mut self, qp: &impl TxHost, link: TxLink) -> bool {
        let Some(r) = self.resp.front() else {
            return false;
        };
        match r {
            Response::Atomic(resp) => {
                let msn = self.msn[qi(QN_ATOMIC_RESPONSE)];
                self.msn[qi(QN_ATOMIC_RESPONSE)] = msn.next();
                let ulpdu = UlpduRepr::atomic_response(msn, *resp);
                if let Some(f) = frame_consumed(&ulpdu, link.crc, Done::Nothing) {
                    self.push_out(f);
                }
                self.resp.pop_front();
                qp.release_ird();
                true
            }
            Response::Read {
                src,
                sink_stag,
                sink_to,
            } => {
                let off = self.resp_off;
                let chunk = (src.len - off).min(link.max_payload);
                let last = off + chunk == src.len;
                let ulpdu = UlpduRepr::tagged(
                    Opcode::RdmaReadResponse,
                    Stag(*sink_stag),
                    sink_to.wrapping_add(off as u64),
                    last,
                    &[],
                );
                let pieces = vec![(src.mem.clone(), src.offset + off, chunk)];
                if let Some(f) = frame_data(
                    &ulpdu,
                    None,
                    Gather::Pieces(pieces),
                    chunk,
                    link.crc,
                    Done::Nothing,
                ) {
                    self.push_out(f);
                }
                if last {
                    self.resp.pop_front();
                    self.resp_off = 0;
                    qp.release_ird();
                } else {
                    self.resp_off += chunk;
                }
                true
            }
        }
    }

    fn push_out(&mut self, f: OutFpdu) {
        self.out_bytes += f.total;
        self.out.push_back(f);
    }

    /// Frames the next FPDU of the send queue.
    fn frame_sq(&mut self, qp: &impl TxHost, link: TxLink) -> bool {
        if !matches!(
            qp.state(),
            crate::state::QpState::Rts | crate::state::QpState::Closing
        ) {
            // Terminate or error: nothing new goes out. (In CLOSING the
            // requests posted before the close still drain.)
            return false;
        }
        if self.peer_closed && !self.cur_started {
            return false;
        }
        loop {
            let Some(w) = self.sq.front() else {
                return false;
            };
            if let Some(status) = w.failed {
                let seq = w.seq;
                self.sq.pop_front();
                qp.complete_sq(seq, status, 0, 0);
                self.fatal = Some(status);
                self.closed = true;
                return false;
            }
            if !self.cur_started {
                // Fence: wait for all earlier Reads and atomics; a Read or
                // atomic waits for an ORD slot.
                let takes_slot = matches!(w.kind, WqeKind::Read { .. } | WqeKind::Atomic { .. });
                if !qp.ord_may_start(w.fence, takes_slot) {
                    return false;
                }
            }
            let seq = w.seq;
            match &w.kind {
                WqeKind::Local => {
                    self.sq.pop_front();
                    qp.complete_sq(seq, WcStatus::Success, 0, 0);
                    continue;
                }
                WqeKind::Read {
                    stag,
                    to,
                    sink,
                    sink_stag,
                    sink_to,
                } => {
                    let msn = self.msn[qi(QN_READ_REQUEST)];
                    self.msn[qi(QN_READ_REQUEST)] = msn.next();
                    let req = ReadRequestRepr {
                        sink_stag: Stag(*sink_stag),
                        sink_to: *sink_to,
                        read_size: u32::try_from(sink.len).unwrap_or(u32::MAX),
                        src_stag: Stag(*stag),
                        src_to: *to,
                    };
                    qp.push_ord(OutRead {
                        seq,
                        kind: OutReadKind::Read {
                            sink: sink.clone(),
                            progress: softrdma_proto::order::ReadSink::new(
                                *sink_stag, *sink_to, sink.len,
                            ),
                        },
                    });
                    let ulpdu = UlpduRepr::read_request(msn, req);
                    if let Some(f) = frame_consumed(&ulpdu, link.crc, Done::Nothing) {
                        self.push_out(f);
                    }
                    self.sq.pop_front();
                    return true;
                }
                WqeKind::Atomic { req, sink } => {
                    let msn = self.msn[qi(QN_READ_REQUEST)];
                    self.msn[qi(QN_READ_REQUEST)] = msn.next();
                    qp.push_ord(OutRead {
                        seq,
                        kind: OutReadKind::Atomic {
                            request_id: req.request_id,
                            sink: sink.clone(),
                        },
                    });
                    let ulpdu = UlpduRepr::atomic_request(msn, *req);
                    if let Some(f) = frame_consumed(&ulpdu, link.crc, Done::Nothing) {
                        self.push_out(f);
                    }
                    self.sq.pop_front();
                    return true;
                }
                WqeKind::Send { .. } | WqeKind::Write { .. } => {
                    self.frame_data_wqe(link);
                    return true;
                }
            }
        }
    }

    /// Frames the next FPDU of the Send or Write at the head of the queue.
    fn frame_data_wqe(&mut self, link: TxLink) {
        let Some(w) = self.sq.front() else {
            return;
        };
        let (imm, is_send) = match &w.kind {
            WqeKind::Send { imm, .. } => (*imm, true),
            WqeKind::Write { imm, .. } => (*imm, false),
            _ => return,
        };
        let byte_len = u32::try_from(w.len).unwrap_or(u32::MAX);
        if self.cur_imm_next {
            // The Immediate Data message that ends this request.
            let msn = self.msn[qi(QN_SEND)];
            self.msn[qi(QN_SEND)] = msn.next();
            let data = ImmediateDataRepr::from_be_u64(u64::from(imm.unwrap_or(0)));
            let ulpdu = UlpduRepr::immediate(msn, data, w.solicited);
            let done = Done::SqMessage {
                seq: w.seq,
                byte_len,
            };
            if let Some(f) = frame_consumed(&ulpdu, link.crc, done) {
                self.push_out(f);
            }
            self.finish_front();
            return;
        }
        if !self.cur_started && is_send {
            self.cur_msn = self.msn[qi(QN_SEND)];
            self.msn[qi(QN_SEND)] = self.cur_msn.next();
        }
        self.cur_started = true;
        let off = self.cur_off;
        let chunk = (w.len - off).min(link.max_payload);
        let last = off + chunk == w.len;
        let inline = w
            .payload
            .inline_bytes()
            .and_then(|b| b.get(off..off + chunk));
        let segs = w.payload.segs();
        let mut patch_imm = false;
        let ulpdu = match &w.kind {
            WqeKind::Send { inv, .. } => {
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
                    self.cur_msn,
                    u32::try_from(off).unwrap_or(u32::MAX),
                    last,
                    &[],
                )
            }
            WqeKind::Write { stag, to, .. } => UlpduRepr::tagged(
                Opcode::RdmaWrite,
                Stag(*stag),
                to.wrapping_add(off as u64),
                last,
                &[],
            ),
            _ => return,
        };
        let done = if last && imm.is_none() {
            Done::SqMessage {
                seq: w.seq,
                byte_len,
            }
        } else {
            Done::Nothing
        };
        let f = match inline {
            Some(bytes) => frame_inline(&ulpdu, patch_imm, bytes, link.crc, done),
            None => frame_data(
                &ulpdu,
                patch_imm.then_some(()),
                Gather::Segs { segs, off },
                chunk,
                link.crc,
                done,
            ),
        };
        if let Some(f) = f {
            self.push_out(f);
        }
        if last {
            if imm.is_some() {
                self.cur_imm_next = true;
            } else {
                self.finish_front();
            }
        } else {
            self.cur_off += chunk;
        }
    }

    fn finish_front(&mut self) {
        self.sq.pop_front();
        self.cur_off = 0;
        self.cur_started = false;
        self.cur_imm_next = false;
    }
}

/// Calls `f(seg, offset in its memory, length)` for each piece covering
/// `[off, off+len)` of a gather list; stops at the first `None`.
fn for_pieces(
    segs: &[LocalSeg],
    mut off: usize,
    mut len: usize,
    mut f: impl FnMut(&LocalSeg, usize, usize) -> Option<()>,
) -> Option<()> {
    for s in segs {
        if len == 0 {
            break;
        }
        if off >= s.len {
            off -= s.len;
            continue;
        }
        let k = (s.len - off).min(len);
        f(s, s.offset + off, k)?;
        len -= k;
        off = 0;
    }
    Some(())
}

/// The registered-memory pieces covering `[off, off+len)` of a gather list.
fn collect_pieces(
    segs: &[LocalSeg],
    off: usize,
    len: usize,
    out: &mut Vec<(Arc<Memory>, usize, usize)>,
) {
    let _ = for_pieces(segs, off, len, |s, o, k| {
        out.push((s.mem.clone(), o, k));
        Some(())
    });
}

/// Writes the length field and the ULPDU header into a fresh FPDU buffer.
/// Returns the buffer and the header length (length field included).
fn start_fpdu(
    ulpdu: &UlpduRepr<'_>,
    payload_len: usize,
    patch_imm: bool,
) -> Option<([u8; HEAD_CAP], usize, usize)> {
    let mut head = [0u8; HEAD_CAP];
    let hdr = ulpdu.emit_header(head.get_mut(2..)?).ok()?;
    if patch_imm {
        // RsvdULP[8:39] of the untagged header: bytes 2..6 of the DDP header.
        head.get_mut(4..8)?
            .copy_from_slice(&SEND_IMM_FOLLOWS.to_be_bytes());
    }
    let ulpdu_len = hdr + payload_len;
    let len16 = u16::try_from(ulpdu_len).ok()?;
    head.get_mut(..2)?.copy_from_slice(&len16.to_be_bytes());
    Some((head, 2 + hdr, ulpdu_len))
}

fn trailer(crc: Option<Crc32c>, ulpdu_len: usize) -> FpduTrailer {
    match crc {
        Some(mut c) => {
            c.update(&[0u8; 3][..pad_len(ulpdu_len)]);
            FpduTrailer::new(ulpdu_len, c.finish())
        }
        None => FpduTrailer::new(ulpdu_len, 0),
    }
}

/// An FPDU whose ULPDU is entirely in `ulpdu` (Read Request, Terminate,
/// atomics, Immediate Data).
fn frame_consumed(ulpdu: &UlpduRepr<'_>, crc: bool, done: Done) -> Option<OutFpdu> {
    let mut head = [0u8; HEAD_CAP];
    let n = ulpdu.emit(head.get_mut(2..)?).ok()?;
    let len16 = u16::try_from(n).ok()?;
    head.get_mut(..2)?.copy_from_slice(&len16.to_be_bytes());
    Some(small_fpdu(head, 2 + n, n, crc, done))
}

/// An FPDU entirely in its header buffer: `head[..head_len]` holds the
/// length field and the whole ULPDU of `ulpdu_len` bytes.
fn small_fpdu(
    head: [u8; HEAD_CAP],
    head_len: usize,
    ulpdu_len: usize,
    crc: bool,
    done: Done,
) -> OutFpdu {
    let c = crc.then(|| {
        let mut c = Crc32c::new();
        c.update(&head[..head_len]);
        c
    });
    let trailer = trailer(c, ulpdu_len);
    OutFpdu {
        head,
        head_len,
        pieces: Vec::new(),
        total: head_len + trailer.as_bytes().len(),
        trailer,
        written: 0,
        done,
    }
}

/// An FPDU with a payload copied from `bytes`.
fn frame_inline(
    ulpdu: &UlpduRepr<'_>,
    patch_imm: bool,
    bytes: &[u8],
    crc: bool,
    done: Done,
) -> Option<OutFpdu> {
    let (mut head, hdr_len, ulpdu_len) = start_fpdu(ulpdu, bytes.len(), patch_imm)?;
    let head_len = hdr_len + bytes.len();
    head.get_mut(hdr_len..head_len)?.copy_from_slice(bytes);
    Some(small_fpdu(head, head_len, ulpdu_len, crc, done))
}

/// Where a data FPDU's payload comes from: its pieces, or `[off, off+len)`
/// of a gather list (pieces collected only for payloads not copied into
/// the header buffer: no allocation or reference count for small ones).
enum Gather<'a> {
    /// Registered-memory pieces.
    Pieces(Vec<(Arc<Memory>, usize, usize)>),
    /// From this offset of a gather list.
    Segs { segs: &'a [LocalSeg], off: usize },
}

/// An FPDU with a payload of `len` bytes gathered from `src` (copied into
/// the header buffer when small).
fn frame_data(
    ulpdu: &UlpduRepr<'_>,
    patch_imm: Option<()>,
    src: Gather<'_>,
    len: usize,
    crc: bool,
    done: Done,
) -> Option<OutFpdu> {
    let (mut head, hdr_len, ulpdu_len) = start_fpdu(ulpdu, len, patch_imm.is_some())?;
    if len <= COPY_MAX {
        let mut at = hdr_len;
        let mut copy = |mem: &Memory, off: usize, n: usize| -> Option<()> {
            mem.copy_out(off, head.get_mut(at..at + n)?).then_some(())?;
            at += n;
            Some(())
        };
        match &src {
            Gather::Pieces(pieces) => {
                for (mem, off, n) in pieces {
                    copy(mem, *off, *n)?;
                }
            }
            Gather::Segs { segs, off } => {
                for_pieces(segs, *off, len, |s, o, n| copy(&s.mem, o, n))?;
            }
        }
        return Some(small_fpdu(head, hdr_len + len, ulpdu_len, crc, done));
    }
    let pieces = match src {
        Gather::Pieces(p) => p,
        Gather::Segs { segs, off } => {
            let mut p = Vec::new();
            collect_pieces(segs, off, len, &mut p);
            p
        }
    };
    let c = crc.then(|| {
        let mut c = Crc32c::new();
        c.update(&head[..hdr_len]);
        for (mem, off, n) in &pieces {
            crc_update_mem(&mut c, mem, *off, *n);
        }
        c
    });
    let trailer = trailer(c, ulpdu_len);
    Some(OutFpdu {
        head,
        head_len: hdr_len,
        pieces,
        total: hdr_len + len + trailer.as_bytes().len(),
        trailer,
        written: 0,
        done,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_inline_payloads_are_kept_in_the_request() {
        let small: Vec<u8> = (0..SMALL_INLINE as u8).collect();
        let p = Payload::inline(&small);
        assert!(matches!(p, Payload::Small { .. }));
        assert_eq!(p.inline_bytes(), Some(&small[..]));
        assert!(p.segs().is_empty());
        let empty = Payload::inline(&[]);
        assert_eq!(empty.inline_bytes(), Some(&[][..]));
        let big: Vec<u8> = (0..=SMALL_INLINE as u8).collect();
        let p = Payload::inline(&big);
        assert!(matches!(p, Payload::Inline(_)));
        assert_eq!(p.inline_bytes(), Some(&big[..]));
        assert!(Payload::None.inline_bytes().is_none());
        assert!(Payload::None.into_last_seg().is_none());
    }
}
