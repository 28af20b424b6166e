//! The per-connection DDP/RDMAP state machine (RFC 5040, 5041, 5044/6581
//! framing, 7306), sans IO.
//!
//! A [`Connection`] is created once MPA negotiation (and RTR) is done; it
//! owns the QP's send queue, receive queue, ORD/IRD accounting, MSNs and
//! completion order. The engine feeds it (`handle_*`, `post_*`) and drains
//! it (`poll_*`):
//!
//! * **receive**, zero copy: [`Connection::rx_want`] says what to read next:
//!   [`RxWant::Bytes`] (framing bytes and consumed RDMAP headers: pass them to
//!   [`Connection::handle_rx_bytes`]) or [`RxWant::Place`] (read up to `len`
//!   payload bytes from the socket straight into the given [`Span`], then
//!   report them with [`Connection::handle_rx_placed`]). The one deframer is
//!   `softrdma_wire::deframer::Deframer` in direct-placement mode. A copying
//!   convenience, [`Connection::handle_rx_stream`], does the same from a
//!   byte slice (tests, simulation, fuzzing).
//! * **transmit**, zero copy: [`Connection::poll_transmit`] fills a reusable
//!   [`TxFpdu`]: header bytes, payload [`Span`]s into registered memory and
//!   the trailer (pad, CRC). The engine writes them (`writev`) and reports
//!   whole FPDUs written with [`Connection::handle_sent`]. A small inline
//!   Send on an idle connection may be posted and framed in one pass
//!   instead ([`Connection::post_send_framed`], then
//!   [`Connection::handle_sent_framed`]).
//! * **completions and events**: [`Connection::poll_completion`] (in posting
//!   order per queue) and [`Connection::poll_output`] (state changes, async
//!   events, link actions: FIN, orderly shutdown, reset).

mod rx;
mod tx;

use std::collections::VecDeque;

use softrdma_wire::ddp::{self, Msn, Qn};
use softrdma_wire::deframer::{Deframer, DeframerConfig};
use softrdma_wire::errcode::TermError;
use softrdma_wire::rdmap::atomic::AtomicRequestRepr;

use crate::mem::{LocalOp, Memory, Span};
use crate::order::{Credits, InOrder, OutKind, Outstanding};
use crate::qp_state::{ConnEvent, PostPolicy, QpState};
use crate::types::{
    AsyncEvent, AsyncKind, Completion, CqKind, LinkAction, Output, PostError, RecvWr, SendOp,
    SendWr, Sge, WcOpcode, WcStatus,
};

pub use rx::RxWant;
pub use tx::{HEAD_CAP, SEND_NOW_MAX, TxFpdu};

/// The value a softrdma sender puts in the (reserved, ignored by other
/// implementations) Invalidate STag field of a Send to say that an
/// Immediate Data message follows and completes the same receive (Send with
/// Immediate) — the engine's encoding.
pub const SEND_IMM_FOLLOWS: u32 = 0x534e_4949;

/// The index of untagged queue `qn` in the per-queue MSN arrays
/// (`[Msn; 4]`, one per queue RFC 5040 and RFC 7306 define).
const fn queue_index(qn: Qn) -> usize {
    qn.0 as usize
}

/// The wire crate's queue numbers as indices (see [`queue_index`]).
const QN_SEND: usize = queue_index(ddp::QN_SEND);
const QN_RREQ: usize = queue_index(ddp::QN_READ_REQUEST);
const QN_TERM: usize = queue_index(ddp::QN_TERMINATE);
const QN_ARESP: usize = queue_index(ddp::QN_ATOMIC_RESPONSE);

/// The largest payload one FPDU can carry: the ULPDU length is 16 bits
/// and holds the payload with its DDP/RDMAP header (at most the untagged
/// header's 18 octets).
pub const MAX_PAYLOAD: usize = u16::MAX as usize - softrdma_wire::ddp::UNTAGGED_HEADER_LEN;

/// What the connection was set up with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    /// CRC negotiated (markers are always declined).
    pub crc: bool,
    /// Inbound Reads/atomics we accept at once (our IRD).
    pub ird: u32,
    /// Outbound Reads/atomics outstanding at once (min of our ORD and the
    /// peer's IRD).
    pub ord: u32,
    /// Largest payload per FPDU (MULPDU minus the DDP/RDMAP header).
    /// [`Connection::new`] keeps it within `1..=`[`MAX_PAYLOAD`] (the
    /// 16-bit ULPDU length must hold the payload and its header).
    pub max_payload: usize,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Receives come from a shared receive queue ([`Memory::srq_pop`]).
    pub srq: bool,
    /// How long a graceful close waits for the peer's FIN (same unit as
    /// the `now` values passed in).
    pub close_timeout: u64,
    /// First MSN sent and expected on queues 0 (Send) and 1 (Read Request);
    /// RTR messages may have used the first ones.
    pub tx_msn: [u32; 2],
    /// First MSN expected on queues 0 and 1.
    pub rx_msn: [u32; 2],
    /// Longest inline payload accepted at post ([`SendWr::inline`]).
    pub max_inline: usize,
    /// Most SGEs per send request (the engine's `QpCap::max_send_sge`).
    pub max_send_sge: usize,
    /// Most SGEs per receive request (`QpCap::max_recv_sge`).
    pub max_recv_sge: usize,
    /// Report what each successful receive carried
    /// ([`Connection::poll_completion_with_info`]): the engine's proxy
    /// offload needs it.
    pub message_info: bool,
    /// The engine confirms each [`LinkAction::SendFin`] with
    /// [`Connection::handle_fin_sent`] (a FIN that cannot be sent — the
    /// peer's reset already in — is a reset, not a graceful close);
    /// without it the FIN counts as sent when it is asked for.
    pub confirm_fin: bool,
    /// Keep the checked buffer of each receive that completed successfully
    /// (one SGE, memory that [`Memory::may_keep`] allows, a `wr_id` below
    /// [`Config::max_recv_wr`]: a ring of receive slots numbered from 0)
    /// and take it again, without [`Memory::local`], when the same receive
    /// is posted again: same `wr_id` and SGE, and [`Memory::recv_stamp`]
    /// unchanged since the buffer was checked. See
    /// [`Connection::post_recv`].
    pub keep_recvs: bool,
}

impl Config {
    /// A configuration with CRC as given and common defaults.
    #[must_use]
    pub const fn new(crc: bool) -> Self {
        Config {
            crc,
            ird: 8,
            ord: 8,
            max_payload: 1024,
            max_send_wr: 128,
            max_recv_wr: 128,
            srq: false,
            close_timeout: 5_000,
            tx_msn: [1, 1],
            rx_msn: [1, 1],
            max_inline: 64,
            max_send_sge: 4,
            max_recv_sge: 4,
            message_info: false,
            confirm_fin: false,
            keep_recvs: false,
        }
    }
}

/// What a successful receive carried, for a proxy filter
/// ([`Config::message_info`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MsgInfo<R> {
    /// A Send (any variant; with Immediate too): the first segment's
    /// opcode and DDP header, the receive's buffers, the STag a Send with
    /// Invalidate named.
    Send {
        /// RDMAP opcode of the first segment.
        opcode: softrdma_wire::rdmap::Opcode,
        /// DDP header of the first segment (untagged: 18 bytes).
        header: [u8; softrdma_wire::ddp::UNTAGGED_HEADER_LEN],
        /// The receive's buffers.
        segs: Vec<Span<R>>,
        /// Send with Invalidate: the STag.
        inv: Option<u32>,
    },
    /// Immediate Data of a Write with Immediate: the last RDMA Write
    /// received completely before it (`None` if there was none).
    Write {
        /// The Write.
        write: Option<WriteInfo>,
    },
}

/// An RDMA Write received completely ([`MsgInfo::Write`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteInfo {
    /// Its STag.
    pub stag: u32,
    /// Tagged offset of its first byte.
    pub to: u64,
    /// Bytes it placed (all segments).
    pub len: u64,
    /// DDP header of its first segment (tagged: 14 bytes).
    pub header: [u8; softrdma_wire::ddp::TAGGED_HEADER_LEN],
}

/// One send-queue request in completion order.
#[derive(Debug, Clone, Copy)]
struct Slot {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    /// [`SendWr::internal`].
    internal: bool,
    status: Option<WcStatus>,
    byte_len: u32,
    vendor_err: u32,
}

/// What a queued send-queue request does on the wire.
#[derive(Debug, Clone)]
enum Kind<R> {
    Send {
        inv: Option<u32>,
        imm: Option<u32>,
    },
    Write {
        stag: u32,
        to: u64,
        imm: Option<u32>,
    },
    Read {
        stag: u32,
        to: u64,
        sink: Span<R>,
        sink_stag: u32,
        sink_to: u64,
    },
    Atomic {
        req: AtomicRequestRepr,
        sink: Span<R>,
    },
    /// Executed at post; completes in order without touching the wire.
    Local,
}

/// A validated send-queue request.
#[derive(Debug, Clone)]
struct SqEntry<R> {
    seq: u64,
    kind: Kind<R>,
    segs: Vec<Span<R>>,
    /// Inline payload, copied at post (then `segs` is empty); its buffer
    /// comes from and goes back to [`Connection`]'s `inline_pool`.
    inline: Option<Vec<u8>>,
    len: usize,
    fence: bool,
    solicited: bool,
    failed: Option<WcStatus>,
}

/// A send request checked by [`Connection::prepare_send`], waiting for
/// [`Connection::post_prepared`].
#[derive(Debug, Clone)]
pub struct Prepared<R> {
    entry: SqEntry<R>,
    slot: Slot,
}

impl<R> Prepared<R> {
    /// The request's `wr_id`.
    #[must_use]
    pub const fn wr_id(&self) -> u64 {
        self.slot.wr_id
    }
}

/// A posted receive.
#[derive(Debug, Clone)]
struct RecvEntry<R> {
    wr_id: u64,
    segs: Vec<Span<R>>,
    total: usize,
    /// With [`Config::keep_recvs`]: what its buffer was checked as, if it
    /// may be kept past its completion.
    key: Option<RecvKey>,
}

/// The one SGE a receive was posted with and the registrations' stamp
/// ([`Memory::recv_stamp`]) read before the SGE was checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RecvKey {
    sge: Sge,
    stamp: u64,
}

/// An outstanding outbound Read or atomic (ORD entry): the shared type.
type OutRead<R> = crate::order::OutRead<Span<R>>;

/// A response owed to the peer.
#[derive(Debug, Clone)]
enum Response<R> {
    Read {
        src: Span<R>,
        sink_stag: u32,
        sink_to: u64,
    },
    Atomic {
        request_id: u32,
        original: u64,
    },
}

/// What to do when an FPDU handed out is completely written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    Nothing,
    SqMessage { seq: u64, byte_len: u32 },
    Terminate,
}

/// The DDP/RDMAP connection state machine. See the [module docs](self).
#[derive(Debug)]
pub struct Connection<R> {
    cfg: Config,
    state: QpState,
    now: u64,
    // ---- receive ----
    rx: rx::RxState<R>,
    rq: VecDeque<RecvEntry<R>>,
    // ---- transmit ----
    tx: tx::TxState,
    sq: VecDeque<SqEntry<R>>,
    resp: VecDeque<Response<R>>,
    inflight: VecDeque<Done>,
    // ---- ORD / IRD ----
    ord: Outstanding<OutRead<R>>,
    ird: Credits,
    next_request_id: u32,
    // ---- completion order ----
    slots: InOrder<Slot>,
    completions: VecDeque<Completion>,
    /// With `Config::message_info`: one per successful receive completion,
    /// in the same order.
    msg_infos: VecDeque<MsgInfo<R>>,
    outputs: VecDeque<Output>,
    /// With [`Config::keep_recvs`]: receives that completed successfully,
    /// their checked buffers kept for the same receive's next post, by
    /// `wr_id` (those below `max_recv_wr`; empty until one is kept).
    kept: Vec<Option<RecvEntry<R>>>,
    /// Number of `Some` in `kept`.
    kept_len: usize,
    /// Posts that took a kept buffer.
    kept_taken: u64,
    // ---- buffers reused from one request to the next ----
    /// Emptied gather/scatter lists of finished requests (a post takes
    /// one instead of allocating).
    seg_pool: Vec<Vec<Span<R>>>,
    /// Emptied inline payload buffers of sent requests.
    inline_pool: Vec<Vec<u8>>,
    // ---- close ----
    fin_pending: bool,
    fin_sent: bool,
    peer_fin: bool,
    peer_closed: bool,
    close_deadline: Option<u64>,
}

/// Most emptied inline buffers kept for reuse (and the least number of
/// gather/scatter lists, see `Connection::seg_pool_max`).
const POOL_MAX: usize = 32;

impl<R> Connection<R> {
    /// Keeps a finished request's list for the next post (its spans, and
    /// with them the references to registered memory, are let go now).
    fn recycle_segs(&mut self, mut segs: Vec<Span<R>>) {
        segs.clear();
        if segs.capacity() > 0 && self.seg_pool.len() < self.seg_pool_max() {
            self.seg_pool.push(segs);
        }
    }

    /// Most emptied gather/scatter lists kept: as many as both queues can
    /// hold (at least [`POOL_MAX`]). A receive run that completes a whole
    /// posted window of small Sends at once (hundreds from one read of
    /// the socket) gives back a list per receive, and the reposts that
    /// follow take them again; kept to 32, all but 32 were freed and
    /// allocated again, a `malloc` and a `free` per message. The pool
    /// never holds more lists than the queues held when full.
    fn seg_pool_max(&self) -> usize {
        (self.cfg.max_recv_wr as usize)
            .saturating_add(self.cfg.max_send_wr as usize)
            .max(POOL_MAX)
    }

    /// Keeps the buffers of a send request that left the send queue.
    fn recycle_sq(&mut self, e: SqEntry<R>) {
        if let Some(mut v) = e.inline {
            v.clear();
            if self.inline_pool.len() < POOL_MAX {
                self.inline_pool.push(v);
            }
        }
        self.recycle_segs(e.segs);
    }
}

impl<R: Clone + core::fmt::Debug> Connection<R> {
    /// A connection in full operation (RTS), right after MPA negotiation.
    #[must_use]
    pub fn new(mut cfg: Config) -> Self {
        // A larger payload overflows the ULPDU length (nothing could be
        // framed); an empty one frames empty FPDUs forever.
        cfg.max_payload = cfg.max_payload.clamp(1, MAX_PAYLOAD);
        let mut rx = rx::RxState::new(Deframer::new(DeframerConfig::new(cfg.crc, false)));
        rx.expect[QN_SEND] = Msn(cfg.rx_msn[0]);
        rx.expect[QN_RREQ] = Msn(cfg.rx_msn[1]);
        let mut tx = tx::TxState::new();
        tx.msn[QN_SEND] = Msn(cfg.tx_msn[0]);
        tx.msn[QN_RREQ] = Msn(cfg.tx_msn[1]);
        Connection {
            cfg,
            state: QpState::Rts,
            now: 0,
            rx,
            rq: VecDeque::new(),
            tx,
            sq: VecDeque::new(),
            resp: VecDeque::new(),
            inflight: VecDeque::new(),
            ord: Outstanding::new(cfg.ord),
            ird: Credits::new(cfg.ird),
            next_request_id: 1,
            slots: InOrder::new(),
            completions: VecDeque::new(),
            msg_infos: VecDeque::new(),
            kept: Vec::new(),
            kept_len: 0,
            kept_taken: 0,
            seg_pool: Vec::new(),
            inline_pool: Vec::new(),
            outputs: VecDeque::new(),
            fin_pending: false,
            fin_sent: false,
            peer_fin: false,
            peer_closed: false,
            close_deadline: None,
        }
    }

    /// The QP state.
    #[must_use]
    pub const fn state(&self) -> QpState {
        self.state
    }

    /// The configuration.
    #[must_use]
    pub const fn config(&self) -> &Config {
        &self.cfg
    }

    /// Changes the largest payload per FPDU of a live connection (the
    /// engine follows the socket's current MSS), kept within
    /// `1..=`[`MAX_PAYLOAD`] as in [`Connection::new`]; returns the value
    /// kept.
    ///
    /// It applies from the next FPDU framed by
    /// [`poll_transmit`](Self::poll_transmit): FPDUs framed already keep
    /// their size, and a message being framed goes on from where it is
    /// with segments of the new size (RFC 5041 lets the segments of one
    /// message differ in size; every segment still carries its own
    /// offset, and only the last one has L set). The receiving side does
    /// not depend on it.
    pub fn set_max_payload(&mut self, max_payload: usize) -> usize {
        self.cfg.max_payload = max_payload.clamp(1, MAX_PAYLOAD);
        self.cfg.max_payload
    }

    /// Outbound Reads/atomics outstanding.
    #[must_use]
    pub fn ord_outstanding(&self) -> usize {
        self.ord.len()
    }

    /// Inbound Reads/atomics accepted and not yet answered.
    #[must_use]
    pub const fn ird_used(&self) -> u32 {
        self.ird.used()
    }

    /// Whether [`Connection::poll_transmit`] may have something to hand
    /// out (a Terminate, a response, a send-queue request, the FIN): when
    /// `false`, it would return `false` at once, so a caller may skip it.
    #[must_use]
    pub fn may_transmit(&self) -> bool {
        self.tx.term.is_some()
            || (matches!(self.state, QpState::Rts | QpState::Closing)
                && (!self.resp.is_empty() || !self.sq.is_empty() || self.fin_pending))
    }

    /// Send-queue requests posted and not yet completed.
    #[must_use]
    pub fn send_queue_len(&self) -> usize {
        self.slots.len()
    }

    /// Receives posted and not yet consumed (the QP's own queue).
    #[must_use]
    pub fn recv_queue_len(&self) -> usize {
        self.rq.len()
    }

    /// The next completion, in posting order per queue.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.poll_completion_with_info().map(|(c, _)| c)
    }

    /// The next completion and, with [`Config::message_info`], what a
    /// successful receive carried ([`MsgInfo`]; `None` for every other
    /// completion).
    pub fn poll_completion_with_info(&mut self) -> Option<(Completion, Option<MsgInfo<R>>)> {
        let c = self.completions.pop_front()?;
        let info = (self.cfg.message_info && c.cq == CqKind::Recv && c.status == WcStatus::Success)
            .then(|| self.msg_infos.pop_front())
            .flatten();
        Some((c, info))
    }

    /// Whether [`Connection::poll_output`] or
    /// [`Connection::poll_completion`] has something to hand out (a post
    /// that produced neither needs no look at them).
    #[must_use]
    pub fn has_output(&self) -> bool {
        !self.outputs.is_empty() || !self.completions.is_empty()
    }

    /// The next state change, event or link action.
    pub fn poll_output(&mut self) -> Option<Output> {
        self.outputs.pop_front()
    }

    // ------------------------------------------------------------------
    // Posting
    // ------------------------------------------------------------------

    /// Posts a send-queue work request. SGEs are checked with
    /// [`Memory::local`] now; local operations (invalidate, bind,
    /// fast-register) execute now and complete in order. A request that
    /// fails its checks is accepted and completes with an error when its
    /// turn comes, after the requests before it were written (then the QP
    /// enters ERROR), like the engine. In ERROR, and in IDLE (after a
    /// graceful close), the request is accepted and flushed at once.
    ///
    /// # Errors
    ///
    /// [`PostError`] if the state refuses posts, the queue is full or the
    /// request is malformed; nothing is queued then.
    pub fn post_send<M: Memory<Region = R>>(
        &mut self,
        wr: &SendWr<'_>,
        mem: &mut M,
    ) -> Result<(), PostError> {
        let p = self.prepare_inner(wr, mem)?;
        self.queue_prepared(p)
    }

    /// The first half of [`Connection::post_send`]: checks `wr` and executes
    /// a local operation, without queuing it; [`Connection::post_prepared`]
    /// queues it. For requests checked now and posted only later, or never
    /// (a proxy handler's replies, sent only if the handler succeeds).
    ///
    /// # Errors
    ///
    /// As [`Connection::post_send`].
    pub fn prepare_send<M: Memory<Region = R>>(
        &mut self,
        wr: &SendWr<'_>,
        mem: &mut M,
    ) -> Result<Prepared<R>, PostError> {
        self.prepare_inner(wr, mem)
    }

    /// [`Connection::prepare_send`], inlined into
    /// [`Connection::post_send`] (see [`Connection::queue_prepared`]).
    #[inline(always)]
    fn prepare_inner<M: Memory<Region = R>>(
        &mut self,
        wr: &SendWr<'_>,
        mem: &mut M,
    ) -> Result<Prepared<R>, PostError> {
        let policy = self.send_policy();
        if policy == PostPolicy::Reject {
            return Err(PostError::InvalidState(self.state));
        }
        if wr.sgl.len() > self.cfg.max_send_sge {
            return Err(PostError::TooManySges {
                count: wr.sgl.len(),
                max: self.cfg.max_send_sge,
            });
        }
        if self.slots.len() >= self.cfg.max_send_wr as usize {
            return Err(PostError::QueueFull(self.cfg.max_send_wr));
        }
        if let Some(data) = wr.inline {
            if !matches!(wr.op, SendOp::Send { .. } | SendOp::Write { .. }) {
                return Err(PostError::Invalid(
                    "inline payload on an operation other than Send or Write",
                ));
            }
            if data.len() > self.cfg.max_inline {
                return Err(PostError::InlineTooLarge {
                    len: data.len(),
                    max: self.cfg.max_inline,
                });
            }
        }
        let sge_len: u64 = match wr.inline {
            Some(data) => data.len() as u64,
            None => wr.sgl.iter().map(|s| u64::from(s.len)).sum(),
        };
        let Ok(len) = usize::try_from(sge_len) else {
            return Err(PostError::Invalid("message too long"));
        };
        if sge_len > u64::from(u32::MAX) {
            return Err(PostError::Invalid("message longer than 4 GiB"));
        }
        let mut failed = None;
        let inline = wr.inline.map(|data| {
            let mut v = self.inline_pool.pop().unwrap_or_default();
            v.extend_from_slice(data);
            v
        });
        let seg_pool = &mut self.seg_pool;
        let mut segs_for = |mem: &mut M, write: bool| -> Vec<Span<R>> {
            if wr.inline.is_some() {
                return Vec::new();
            }
            let mut v = seg_pool
                .pop()
                .unwrap_or_else(|| Vec::with_capacity(wr.sgl.len()));
            for s in wr.sgl {
                match mem.local(s.lkey, s.addr, s.len, write) {
                    Ok(sp) => v.push(sp),
                    Err(_) => {
                        failed = Some(WcStatus::LocalProtection);
                        return Vec::new();
                    }
                }
            }
            v
        };
        let mut entry = SqEntry {
            seq: 0,
            kind: Kind::Local,
            segs: Vec::new(),
            inline,
            len,
            fence: wr.fence,
            solicited: wr.solicited,
            failed: None,
        };
        let opcode = match wr.op {
            SendOp::Send { inv, imm } => {
                if inv.is_some() && imm.is_some() {
                    return Err(PostError::Invalid(
                        "Send with both Invalidate and Immediate",
                    ));
                }
                entry.segs = segs_for(mem, false);
                entry.kind = Kind::Send { inv, imm };
                WcOpcode::Send
            }
            SendOp::Write {
                rkey,
                remote_addr,
                imm,
            } => {
                entry.segs = segs_for(mem, false);
                entry.kind = Kind::Write {
                    stag: rkey,
                    to: remote_addr,
                    imm,
                };
                WcOpcode::RdmaWrite
            }
            SendOp::Read { rkey, remote_addr } => {
                let [sge] = wr.sgl else {
                    return Err(PostError::Invalid("RDMA Read needs exactly one SGE"));
                };
                let mut segs = segs_for(mem, true);
                if let Some(sink) = segs.pop() {
                    entry.kind = Kind::Read {
                        stag: rkey,
                        to: remote_addr,
                        sink,
                        sink_stag: sge.lkey,
                        sink_to: sge.addr,
                    };
                }
                WcOpcode::RdmaRead
            }
            SendOp::FetchAdd {
                rkey, remote_addr, ..
            }
            | SendOp::CmpSwap {
                rkey, remote_addr, ..
            } => {
                if !matches!(wr.sgl, [s] if s.len == 8) {
                    return Err(PostError::Invalid("an atomic needs one 8-byte SGE"));
                }
                if remote_addr % 8 != 0 {
                    return Err(PostError::Invalid(
                        "atomic remote address not 8-byte aligned",
                    ));
                }
                let mut segs = segs_for(mem, true);
                entry.len = 8;
                let id = self.next_request_id;
                self.next_request_id = self.next_request_id.wrapping_add(1);
                let (req, op) = match wr.op {
                    SendOp::CmpSwap { compare, swap, .. } => (
                        AtomicRequestRepr::cmp_swap(
                            id,
                            softrdma_wire::ddp::Stag(rkey),
                            remote_addr,
                            compare,
                            swap,
                        ),
                        WcOpcode::CompSwap,
                    ),
                    SendOp::FetchAdd { add, .. } => (
                        AtomicRequestRepr::fetch_add(
                            id,
                            softrdma_wire::ddp::Stag(rkey),
                            remote_addr,
                            add,
                        ),
                        WcOpcode::FetchAdd,
                    ),
                    _ => return Err(PostError::Invalid("atomic")),
                };
                if let Some(sink) = segs.pop() {
                    entry.kind = Kind::Atomic { req, sink };
                }
                op
            }
            SendOp::Local(op) => {
                entry.len = 0;
                match op {
                    LocalOp::Invalidate { rkey } => {
                        if mem.invalidate(rkey, false).is_err() {
                            failed = Some(WcStatus::LocalProtection);
                        }
                        WcOpcode::LocalInv
                    }
                    LocalOp::BindMw { .. } => {
                        if mem.local_op(&op).is_err() {
                            failed = Some(WcStatus::MwBind);
                        }
                        WcOpcode::BindMw
                    }
                    LocalOp::FastReg { .. } => {
                        if mem.local_op(&op).is_err() {
                            failed = Some(WcStatus::LocalProtection);
                        }
                        WcOpcode::RegMr
                    }
                }
            }
        };
        entry.failed = failed;
        Ok(Prepared {
            entry,
            slot: Slot {
                wr_id: wr.wr_id,
                opcode,
                signaled: wr.signaled,
                internal: wr.internal,
                status: None,
                byte_len: 0,
                vendor_err: 0,
            },
        })
    }

    /// Queues a request checked by [`Connection::prepare_send`] (or
    /// flushes it in ERROR and after a graceful close).
    ///
    /// # Errors
    ///
    /// [`PostError::InvalidState`] if the state refuses posts now,
    /// [`PostError::QueueFull`] if the send queue is full; nothing is
    /// queued then.
    pub fn post_prepared(&mut self, p: Prepared<R>) -> Result<(), PostError> {
        self.queue_prepared(p)
    }

    /// [`Connection::post_prepared`], inlined into
    /// [`Connection::post_send`]: the request (some 200 octets) is moved
    /// into the queue from where it was prepared, not copied into an
    /// argument first.
    #[inline(always)]
    fn queue_prepared(&mut self, p: Prepared<R>) -> Result<(), PostError> {
        let policy = self.send_policy();
        if policy == PostPolicy::Reject {
            return Err(PostError::InvalidState(self.state));
        }
        if self.slots.len() >= self.cfg.max_send_wr as usize {
            return Err(PostError::QueueFull(self.cfg.max_send_wr));
        }
        let Prepared { mut entry, slot } = p;
        let seq = self.slots.push(slot);
        entry.seq = seq;
        if policy == PostPolicy::Flush {
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
            return Ok(());
        }
        self.sq.push_back(entry);
        Ok(())
    }

    /// Posts a receive. A receive whose SGE fails its checks puts the QP in
    /// ERROR and completes with the error after the earlier receives are
    /// flushed (the engine's behaviour). In ERROR, and in IDLE (after a
    /// graceful close), the receive is accepted and flushed at once.
    ///
    /// With [`Config::keep_recvs`], a receive of one SGE posted again after
    /// it completed (same `wr_id`, same SGE) takes its kept, already
    /// checked buffer instead of checking the SGE with [`Memory::local`],
    /// if [`Memory::recv_stamp`] is the same as when the buffer was
    /// checked: the registrations have not changed since, so the check
    /// would give the same buffer again, and the post has exactly the
    /// effect it has without the kept buffer. Otherwise the SGE is checked
    /// as usual, and a buffer kept for `wr_id` is let go at this post
    /// (whatever the post's SGEs), so a kept buffer never outlives the
    /// next accepted post of its `wr_id` (a post refused before these
    /// checks, by a full queue, the state or too many SGEs, leaves it
    /// kept).
    ///
    /// # Errors
    ///
    /// [`PostError`] if the QP uses an SRQ, the state refuses receives or
    /// the queue is full.
    pub fn post_recv<M: Memory<Region = R>>(
        &mut self,
        wr: &RecvWr<'_>,
        mem: &mut M,
    ) -> Result<(), PostError> {
        if self.cfg.srq {
            return Err(PostError::HasSrq);
        }
        let policy = self.recv_policy();
        if policy == PostPolicy::Reject {
            return Err(PostError::InvalidState(self.state));
        }
        if wr.sgl.len() > self.cfg.max_recv_sge {
            return Err(PostError::TooManySges {
                count: wr.sgl.len(),
                max: self.cfg.max_recv_sge,
            });
        }
        if self.rq.len() >= self.cfg.max_recv_wr as usize {
            return Err(PostError::QueueFull(self.cfg.max_recv_wr));
        }
        // The stamp is read before the check: a change of the
        // registrations after this read makes the key stale, never a
        // buffer checked against a newer table look current.
        let key = match wr.sgl {
            [sge] if self.cfg.keep_recvs => {
                mem.recv_stamp().map(|stamp| RecvKey { sge: *sge, stamp })
            }
            _ => None,
        };
        if self.kept_len != 0
            && let Some(e) = self.take_kept(wr.wr_id, key)
        {
            self.kept_taken += 1;
            if policy == PostPolicy::Flush {
                self.recycle_segs(e.segs);
                self.complete_recv(wr.wr_id, WcStatus::WrFlush);
            } else {
                self.rq.push_back(e);
            }
            return Ok(());
        }
        let mut segs = self
            .seg_pool
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(wr.sgl.len()));
        for s in wr.sgl {
            match mem.local(s.lkey, s.addr, s.len, true) {
                Ok(sp) => segs.push(sp),
                Err(_) => {
                    self.push_event(AsyncKind::QpFatal, None);
                    self.enter_error(ConnEvent::LocalAbort, Some(LinkAction::Reset));
                    self.complete_recv(wr.wr_id, WcStatus::LocalProtection);
                    return Ok(());
                }
            }
        }
        if policy == PostPolicy::Flush {
            self.complete_recv(wr.wr_id, WcStatus::WrFlush);
            return Ok(());
        }
        let total = segs.iter().map(|s| s.len).sum();
        let key = key.filter(|_| segs.iter().all(|s| mem.may_keep(s)));
        self.rq.push_back(RecvEntry {
            wr_id: wr.wr_id,
            segs,
            total,
            key,
        });
        Ok(())
    }

    /// The kept buffer of receive `wr_id`, if it was checked as `key`
    /// (the same SGE, the registrations unchanged since). Any buffer kept
    /// for `wr_id` is taken out of the kept list: one that does not match
    /// (another SGE, a changed stamp, a post of other than one SGE) is let
    /// go here, not held until `wr_id` completes again.
    #[inline]
    fn take_kept(&mut self, wr_id: u64, key: Option<RecvKey>) -> Option<RecvEntry<R>> {
        let e = self.kept.get_mut(usize::try_from(wr_id).ok()?)?.take()?;
        self.kept_len -= 1;
        if key.is_some() && e.key == key {
            return Some(e);
        }
        self.recycle_segs(e.segs);
        None
    }

    /// A receive that completed successfully: its buffer is kept for its
    /// next post ([`Config::keep_recvs`]) or let go.
    #[inline(always)]
    fn recv_done(&mut self, e: RecvEntry<R>) {
        let max = self.cfg.max_recv_wr as usize;
        let slot = match usize::try_from(e.wr_id) {
            Ok(i) if e.key.is_some() && i < max => {
                if self.kept.len() < max {
                    self.kept.resize_with(max, || None);
                }
                self.kept.get_mut(i)
            }
            _ => None,
        };
        match slot {
            Some(s) => match s.replace(e) {
                Some(old) => self.recycle_segs(old.segs),
                None => self.kept_len += 1,
            },
            None => self.recycle_segs(e.segs),
        }
    }

    /// Lets go of every kept receive buffer (the connection failed or
    /// closed: nothing is received any more).
    fn drop_kept(&mut self) {
        if self.kept_len == 0 {
            return;
        }
        let kept = core::mem::take(&mut self.kept);
        for e in kept.into_iter().flatten() {
            self.recycle_segs(e.segs);
        }
        self.kept_len = 0;
    }

    /// Number of receive buffers kept for their next post
    /// ([`Config::keep_recvs`]).
    #[must_use]
    pub fn kept_recvs(&self) -> usize {
        self.kept_len
    }

    /// Posts that took a kept receive buffer instead of checking the SGE
    /// ([`Config::keep_recvs`]).
    #[must_use]
    pub fn kept_recvs_taken(&self) -> u64 {
        self.kept_taken
    }

    /// What posting a send request does now. A connection reaches IDLE
    /// only through a graceful close; then posts are flushed as in ERROR,
    /// like the engine (and siw, whose QP ends its LLP close in ERROR), so
    /// the drain idiom works and no receive waits for a connection that is
    /// gone.
    fn send_policy(&self) -> PostPolicy {
        match self.state {
            QpState::Idle => PostPolicy::Flush,
            s => s.send_policy(),
        }
    }

    /// What posting a receive does now (see [`Self::send_policy`]).
    fn recv_policy(&self) -> PostPolicy {
        match self.state {
            QpState::Idle => PostPolicy::Flush,
            s => s.recv_policy(),
        }
    }

    /// Puts a consumed receive back at the end of the receive queue, its
    /// buffers already checked (a proxy recycling the buffer of a message it
    /// served). `false` if the connection uses an SRQ, no longer accepts
    /// receives, or its queue is full: the caller completes the receive
    /// itself then.
    pub fn repost_recv(&mut self, wr_id: u64, segs: Vec<Span<R>>) -> bool {
        if self.cfg.srq
            || self.recv_policy() != PostPolicy::Accept
            || self.rq.len() >= self.cfg.max_recv_wr as usize
        {
            return false;
        }
        let total = segs.iter().map(|s| s.len).sum();
        self.rq.push_back(RecvEntry {
            wr_id,
            segs,
            total,
            key: None,
        });
        true
    }

    /// The application moves the QP to TERMINATE: a Terminate with `err`
    /// (RDMAP "Local Catastrophic" for the verbs' modify to TERMINATE) goes
    /// out, nothing of the peer's is copied into it, everything outstanding
    /// is flushed, and the QP enters ERROR once it is written. Only in RTS
    /// and CLOSING.
    pub fn terminate(&mut self, err: TermError) {
        self.violate_with(err, false);
    }

    // ------------------------------------------------------------------
    // Close, abort, time
    // ------------------------------------------------------------------

    /// Graceful close (RTS → CLOSING): the send queue drains, then FIN ([`LinkAction::SendFin`]); the close is done
    /// (→ IDLE) once the peer's FIN arrived too, or fails at the close
    /// timeout. Posted receives keep taking the peer's Sends until then and
    /// are flushed when the close ends.
    pub fn close(&mut self, now: u64) {
        self.now = now;
        self.begin_close(false);
    }

    /// Abortive close: reset, ERROR, everything flushed.
    pub fn abort(&mut self) {
        if self.state == QpState::Error {
            return;
        }
        if self.state != QpState::Idle {
            self.push_event(AsyncKind::LlpReset, None);
        }
        self.enter_error(ConnEvent::LocalAbort, Some(LinkAction::Reset));
    }

    /// Time passed: fails a graceful close that waited too long.
    pub fn handle_timeout(&mut self, now: u64) {
        self.now = now;
        if self.state == QpState::Closing
            && let Some(d) = self.close_deadline
            && now >= d
        {
            self.push_event(AsyncKind::BadClose, None);
            self.enter_error(ConnEvent::CloseTimeout, Some(LinkAction::Reset));
        }
    }

    /// When the pending close times out, if one is under way.
    #[must_use]
    pub const fn next_timeout(&self) -> Option<u64> {
        self.close_deadline
    }

    /// The peer's FIN arrived (the stream ended).
    pub fn handle_fin(&mut self, now: u64) {
        self.now = now;
        if matches!(self.state, QpState::Error | QpState::Idle) {
            return;
        }
        let at_boundary = self.rx.at_fpdu_boundary();
        self.rx.dead = true;
        self.flush_partial_recv();
        if at_boundary && matches!(self.state, QpState::Rts | QpState::Closing) {
            self.peer_fin = true;
            if self.state == QpState::Rts {
                self.begin_close(true);
            } else {
                self.peer_closed = true;
            }
            self.try_finish_close();
            return;
        }
        self.push_event(AsyncKind::BadClose, None);
        self.enter_error(ConnEvent::BadClose, Some(LinkAction::Reset));
    }

    /// The FIN asked for with [`LinkAction::SendFin`] went out (`ok`) or
    /// could not be sent (the connection is gone: a reset). Only with
    /// [`Config::confirm_fin`].
    pub fn handle_fin_sent(&mut self, ok: bool) {
        if !self.cfg.confirm_fin || self.fin_sent {
            return;
        }
        if ok {
            self.fin_sent = true;
            self.try_finish_close();
        } else {
            self.handle_reset();
        }
    }

    /// The connection was reset or failed.
    pub fn handle_reset(&mut self) {
        if matches!(self.state, QpState::Error | QpState::Idle) {
            return;
        }
        self.push_event(AsyncKind::LlpReset, None);
        self.enter_error(ConnEvent::PeerReset, None);
    }

    fn begin_close(&mut self, by_peer: bool) {
        if self.state != QpState::Rts {
            return;
        }
        self.transition(if by_peer {
            ConnEvent::PeerFin
        } else {
            ConnEvent::LocalClose
        });
        // The posted receives stay: Sends the peer transmitted before it saw
        // our FIN still need them, and a receive the receive path is filling
        // must complete before the later ones are flushed. They are flushed
        // when the close completes (or fails). (The engine's `begin_close`
        // flushes them here: out-of-order receive completions and a
        // "no buffer" Terminate for the peer's in-flight Sends.)
        self.fin_pending = true;
        self.peer_closed = by_peer;
        self.close_deadline = Some(self.now.saturating_add(self.cfg.close_timeout));
    }

    fn try_finish_close(&mut self) {
        if !(self.peer_fin && self.fin_sent && self.state == QpState::Closing) {
            return;
        }
        self.transition(ConnEvent::FinsExchanged);
        self.close_deadline = None;
        self.flush_all();
        self.push_event(AsyncKind::LlpClosed, None);
    }

    // ------------------------------------------------------------------
    // Completions, errors
    // ------------------------------------------------------------------

    fn transition(&mut self, ev: ConnEvent) {
        if let Some(to) = self.state.on_conn_event(ev)
            && to != self.state
        {
            self.outputs.push_back(Output::State {
                from: self.state,
                to,
            });
            self.state = to;
        }
    }

    fn set_error(&mut self) {
        if self.state != QpState::Error {
            self.outputs.push_back(Output::State {
                from: self.state,
                to: QpState::Error,
            });
            self.state = QpState::Error;
        }
    }

    fn push_event(&mut self, kind: AsyncKind, term: Option<TermError>) {
        self.outputs.push_back(Output::Event(AsyncEvent {
            kind,
            term: term.map(Into::into),
        }));
    }

    /// Records the outcome of send-queue request `seq` and delivers the
    /// completions that are now in order.
    fn complete_sq(&mut self, seq: u64, status: WcStatus, byte_len: u32, vendor_err: u32) {
        self.slots.complete(seq, |s| {
            s.status = Some(status);
            s.byte_len = byte_len;
            s.vendor_err = vendor_err;
        });
        while let Some(s) = self.slots.pop_ready() {
            let Some(st) = s.status else { continue };
            if s.signaled || s.internal || !st.is_success() {
                self.completions.push_back(Completion {
                    cq: CqKind::Send,
                    wr_id: s.wr_id,
                    status: st,
                    opcode: s.opcode,
                    byte_len: s.byte_len,
                    imm: None,
                    invalidated: None,
                    solicited: false,
                    vendor_err: s.vendor_err,
                    internal: s.internal,
                });
            }
        }
    }

    fn complete_recv(&mut self, wr_id: u64, status: WcStatus) {
        self.completions.push_back(Completion {
            cq: CqKind::Recv,
            wr_id,
            status,
            opcode: WcOpcode::Recv,
            byte_len: 0,
            imm: None,
            invalidated: None,
            solicited: false,
            vendor_err: 0,
            internal: false,
        });
    }

    fn flush_rq(&mut self) {
        while let Some(r) = self.rq.pop_front() {
            self.complete_recv(r.wr_id, WcStatus::WrFlush);
        }
    }

    fn flush_partial_recv(&mut self) {
        if let Some(wr_id) = self.rx.too_long.take() {
            self.complete_recv(wr_id, WcStatus::WrFlush);
        }
        if let Some(r) = self.rx.recv.take() {
            self.complete_recv(r.wr_id, WcStatus::WrFlush);
        }
        if let Some((r, _)) = self.rx.imm_wait.take() {
            self.complete_recv(r.wr_id, WcStatus::WrFlush);
        }
    }

    /// Flushes every outstanding request, in order: outstanding Reads and
    /// atomics, queued requests, requests written whose completion waited,
    /// receives the receive path holds, then the receive queue.
    fn flush_all(&mut self) {
        while let Some(r) = self.ord.pop_front() {
            self.complete_sq(r.seq, WcStatus::WrFlush, 0, 0);
        }
        while let Some(w) = self.sq.pop_front() {
            self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
        }
        for seq in self.slots.open() {
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
        }
        self.flush_partial_recv();
        self.flush_rq();
        self.drop_kept();
        self.resp.clear();
        self.ird.reset();
        self.tx.reset_current();
        self.fin_pending = false;
    }

    /// Enters ERROR on `ev` (a row of [`QpState::on_conn_event`] leading
    /// to ERROR): flushes everything, stops receiving and transmitting.
    fn enter_error(&mut self, ev: ConnEvent, link: Option<LinkAction>) {
        if self.state == QpState::Error {
            return;
        }
        match self.state.on_conn_event(ev) {
            Some(QpState::Error) => self.transition(ev),
            _ => self.set_error(),
        }
        self.rx.dead = true;
        self.close_deadline = None;
        self.flush_all();
        self.tx.term = None;
        if self.cfg.srq {
            self.push_event(AsyncKind::QpLastWqeReached, None);
        }
        if let Some(l) = link {
            self.outputs.push_back(Output::Link(l));
        }
    }

    /// Whether the connection is finished (ERROR or closed to IDLE): no
    /// more input is processed, no more output produced.
    #[must_use]
    pub fn is_done(&self) -> bool {
        matches!(self.state, QpState::Error | QpState::Idle)
    }
}

#[cfg(test)]
mod keep_tests;
#[cfg(test)]
mod tests;
