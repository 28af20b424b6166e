//! Receive rules: DDP segment validation and placement, RDMAP message
//! effects, Terminate generation (RFC 5040 sections 5-7, RFC 5041 sections
//! 5-7, RFC 7306).

use softrdma_wire::ddp::{self, Msn, QN_SEND, Qn};
use softrdma_wire::deframer::{DeframeError, Deframer, Event, Handled, Want};
use softrdma_wire::errcode::TermError;
use softrdma_wire::rdmap::terminate::{TerminateRepr, TerminatedDdp};
use softrdma_wire::rdmap::{Opcode, PayloadPlacement, parse_control};
use softrdma_wire::ulpdu::{DdpAddress, UlpduBody, UlpduError, UlpduRepr};

use super::{
    Connection, MsgInfo, OutKind, QN_ARESP, QN_RREQ, QN_SEND as QS, QN_TERM, RecvEntry, Response,
    SEND_IMM_FOLLOWS, WriteInfo,
};
use crate::mem::{Memory, RemoteAccess, Span};
use crate::qp_state::{ConnEvent, QpState};
use crate::term::{self, MALFORMED_HEADER, UNSUPPORTED_ATOMIC};
use crate::types::{AsyncKind, Completion, CqKind, LinkAction, WcOpcode, WcStatus};

/// Longest consumed RDMAP body kept (Atomic Request: 52 bytes; Terminate:
/// 52 at most).
const CONSUME_MAX: usize = 64;
/// Longest DDP header.
const HDR_MAX: usize = ddp::UNTAGGED_HEADER_LEN;

/// What the engine reads next from the socket (direct placement).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RxWant<R> {
    /// Read at most `len` bytes and pass them to
    /// [`Connection::handle_rx_bytes`].
    Bytes {
        /// Bytes wanted (at least 1).
        len: usize,
    },
    /// Read at most `dst.len` payload bytes straight into `dst` (registered
    /// memory), then report them with [`Connection::handle_rx_placed`].
    Place {
        /// Where the next payload bytes go.
        dst: Span<R>,
    },
    /// Nothing more is received (ERROR, closed, or after a violation).
    Closed,
}

/// A receive being filled by a (multi-segment) Send.
#[derive(Debug, Clone)]
pub(super) struct RecvProgress<R> {
    pub(super) wr_id: u64,
    segs: Vec<Span<R>>,
    /// The receive's buffer's key ([`super::Config::keep_recvs`]).
    key: Option<super::RecvKey>,
    /// The Send's MSN and the bytes received (the rule is the core's
    /// [`crate::order::SendFill`]).
    fill: crate::order::SendFill,
    /// Opcode and DDP header of the first segment ([`super::MsgInfo`]).
    opcode: Opcode,
    header: [u8; HDR_MAX],
}

/// How the payload of the current FPDU is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Placed into `dest`.
    Place,
    /// Kept in `consumed` (an RDMAP header the protocol consumes).
    Consume,
    /// Read and dropped: the header was refused, and the refusal waits for
    /// the CRC (a header corrupted in transit is a CRC error, not a
    /// protocol violation of the peer).
    Discard,
}

/// What to do once the current FPDU is complete and its CRC checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pending {
    None,
    SendSegment {
        last: bool,
        solicited: bool,
        inv: Option<u32>,
        imm_follows: bool,
    },
    ReadResponse {
        last: bool,
    },
}

/// Receive state.
#[derive(Debug)]
pub(super) struct RxState<R> {
    deframer: Deframer,
    hdr: [u8; HDR_MAX],
    hdr_len: usize,
    payload_len: usize,
    mode: Mode,
    consumed: [u8; CONSUME_MAX],
    consumed_len: usize,
    dest: Vec<Span<R>>,
    dest_idx: usize,
    dest_off: usize,
    pending: Pending,
    pub(super) expect: [Msn; 4],
    pub(super) recv: Option<RecvProgress<R>>,
    pub(super) imm_wait: Option<(RecvProgress<R>, bool)>,
    /// The violation found at header time, raised once the CRC is checked.
    deferred: Option<TermError>,
    /// A receive too small for the Send being received: it completes with
    /// a length error once the CRC is checked (else it is flushed).
    pub(super) too_long: Option<u64>,
    /// No more bytes are processed.
    pub(super) dead: bool,
    /// With `Config::message_info`: the RDMA Write being received, and the
    /// last one received completely.
    write_open: Option<WriteInfo>,
    last_write: Option<WriteInfo>,
    /// Whole single-FPDU Sends are received in one pass
    /// ([`Connection::set_one_pass_rx`]).
    one_pass: bool,
    /// FPDUs received in one pass (counted with debug assertions only).
    #[cfg(any(test, debug_assertions))]
    pub(super) one_pass_taken: u64,
}

impl<R> RxState<R> {
    pub(super) fn new(deframer: Deframer) -> Self {
        RxState {
            deframer,
            hdr: [0; HDR_MAX],
            hdr_len: 0,
            payload_len: 0,
            mode: Mode::Place,
            consumed: [0; CONSUME_MAX],
            consumed_len: 0,
            dest: Vec::new(),
            dest_idx: 0,
            dest_off: 0,
            pending: Pending::None,
            expect: [Msn::INITIAL; 4],
            recv: None,
            imm_wait: None,
            deferred: None,
            too_long: None,
            dead: false,
            write_open: None,
            last_write: None,
            one_pass: true,
            #[cfg(any(test, debug_assertions))]
            one_pass_taken: 0,
        }
    }

    pub(super) fn at_fpdu_boundary(&self) -> bool {
        !self.dead && self.deframer.is_at_fpdu_boundary()
    }
}

/// A checked segment's verdict: a Terminate error, with whether the
/// terminated segment's headers are known.
type Check<T> = Result<T, TermError>;

impl<R: Clone + core::fmt::Debug> Connection<R> {
    fn receiving(&self) -> bool {
        !self.rx.dead && matches!(self.state, QpState::Rts | QpState::Closing)
    }

    /// What to read next. See [`RxWant`].
    #[must_use]
    pub fn rx_want(&self) -> RxWant<R> {
        if !self.receiving() {
            return RxWant::Closed;
        }
        match self.rx.deframer.next_read() {
            Want::Payload { len } if self.rx.mode == Mode::Place => {
                match self.rx.dest.get(self.rx.dest_idx) {
                    Some(d) => {
                        let left = d.len - self.rx.dest_off;
                        RxWant::Place {
                            dst: d.slice(self.rx.dest_off, left.min(len)),
                        }
                    }
                    None => RxWant::Closed,
                }
            }
            w => RxWant::Bytes { len: w.len() },
        }
    }

    /// Takes the bytes of an [`RxWant::Bytes`] (at most its `len`; given
    /// more, an untagged DDP header whole, as
    /// [`Deframer::handle_bytes`] does). Returns how many were consumed (0
    /// if the connection no longer receives; the bytes of a call that made
    /// the stream invalid count as consumed).
    pub fn handle_rx_bytes<M: Memory<Region = R>>(&mut self, bytes: &[u8], mem: &mut M) -> usize {
        if !self.receiving() {
            return 0;
        }
        self.bytes_for(self.rx.deframer.next_read(), bytes, mem)
    }

    /// [`Connection::handle_rx_bytes`] once receiving is checked and the
    /// deframer's `want` read.
    fn bytes_for<M: Memory<Region = R>>(&mut self, want: Want, bytes: &[u8], mem: &mut M) -> usize {
        let r = match want {
            Want::Payload { len } => {
                if self.rx.mode == Mode::Place {
                    return 0;
                }
                let n = len.min(bytes.len());
                let Some(b) = bytes.get(..n) else { return 0 };
                if self.rx.mode == Mode::Consume {
                    let at = self.rx.consumed_len;
                    if let Some(dst) = self.rx.consumed.get_mut(at..at + n) {
                        dst.copy_from_slice(b);
                    }
                    self.rx.consumed_len += n;
                }
                self.rx.deframer.handle_payload(b)
            }
            _ => self.rx.deframer.handle_bytes(bytes),
        };
        // On an error: the bytes the deframer looked at (an untagged
        // header's last 4 are not counted when they made the error).
        let attempted = want.len().min(bytes.len());
        self.after_deframer(r, attempted, mem)
    }

    /// Reports payload bytes placed into the [`RxWant::Place`] span (the
    /// bytes themselves are read for the CRC, never copied). Returns how
    /// many were accepted.
    pub fn handle_rx_placed<M: Memory<Region = R>>(&mut self, placed: &[u8], mem: &mut M) -> usize {
        let RxWant::Place { dst } = self.rx_want() else {
            return 0;
        };
        let n = dst.len.min(placed.len());
        drop(dst);
        self.placed_for(placed.get(..n).unwrap_or_default(), mem)
    }

    /// [`Connection::handle_rx_placed`] of bytes known to fit the current
    /// [`RxWant::Place`] span.
    fn placed_for<M: Memory<Region = R>>(&mut self, placed: &[u8], mem: &mut M) -> usize {
        let n = placed.len();
        let r = self.rx.deframer.handle_payload(placed);
        if let Ok(h) = r {
            self.rx.dest_off += h.consumed;
            if let Some(d) = self.rx.dest.get(self.rx.dest_idx)
                && self.rx.dest_off >= d.len
            {
                self.rx.dest_idx += 1;
                self.rx.dest_off = 0;
            }
        }
        self.after_deframer(r, n, mem)
    }

    /// Reports that the engine placed `n` payload bytes at the start of the
    /// [`RxWant::Place`] span without handing them over: when CRC is
    /// negotiated the core feeds them to the CRC through
    /// [`Memory::crc_update`] (no copy), so the engine never forms a slice
    /// over registered memory. Returns how many were accepted.
    pub fn handle_rx_placed_in<M: Memory<Region = R>>(&mut self, n: usize, mem: &mut M) -> usize {
        let mut done = 0;
        while done < n {
            let RxWant::Place { dst } = self.rx_want() else {
                break;
            };
            let k = (n - done).min(dst.len);
            let mut readable = true;
            let r = self.rx.deframer.handle_payload_by(k, |crc, got| {
                readable = mem.crc_update(&dst.slice(0, got), crc);
            });
            if !readable {
                self.violate(TermError::DdpLocalCatastrophic, false, mem);
                break;
            }
            let got = match &r {
                Ok(h) => h.consumed,
                Err(_) => 0,
            };
            if let Ok(h) = r {
                self.rx.dest_off += h.consumed;
                if let Some(d) = self.rx.dest.get(self.rx.dest_idx)
                    && self.rx.dest_off >= d.len
                {
                    self.rx.dest_idx += 1;
                    self.rx.dest_off = 0;
                }
            }
            self.after_deframer(r, k, mem);
            done += got;
            if got < k {
                break;
            }
        }
        done
    }

    /// Copying convenience: handles a chunk of the stream, placing payload
    /// with [`Memory::copy_in`]. Returns the bytes consumed; fewer than
    /// given only once the connection stopped receiving.
    pub fn handle_rx_stream<M: Memory<Region = R>>(&mut self, bytes: &[u8], mem: &mut M) -> usize {
        let mut done = 0;
        while let Some(rest) = bytes.get(done..) {
            if rest.is_empty() {
                break;
            }
            // As `rx_want`, then `handle_rx_bytes` or `handle_rx_placed`,
            // with the connection's state and the deframer's want looked
            // at once per piece.
            if !self.receiving() {
                break;
            }
            if self.rx.one_pass
                && let Some(n) = self.one_pass_send(rest, mem)
            {
                done += n;
                continue;
            }
            let want = self.rx.deframer.next_read();
            let n = match want {
                Want::Payload { len } if self.rx.mode == Mode::Place => {
                    let Some(d) = self.rx.dest.get(self.rx.dest_idx) else {
                        break;
                    };
                    let k = (d.len - self.rx.dest_off).min(len).min(rest.len());
                    let chunk = rest.get(..k).unwrap_or_default();
                    if !mem.copy_in(d, self.rx.dest_off, chunk) {
                        self.violate(TermError::DdpLocalCatastrophic, false, mem);
                        break;
                    }
                    self.placed_for(chunk, mem)
                }
                // The deframer takes at most what it wants (and an
                // untagged header whole when `rest` holds it).
                w => self.bytes_for(w, rest, mem),
            };
            if n == 0 {
                break;
            }
            done += n;
        }
        done
    }

    /// Whether [`Connection::handle_rx_stream`] receives a whole
    /// single-FPDU Send in one pass (on by default). Off, every FPDU takes
    /// the general path; the results are the same either way.
    pub fn set_one_pass_rx(&mut self, on: bool) {
        self.rx.one_pass = on;
    }

    /// How many FPDUs [`Connection::handle_rx_stream`] received in one
    /// pass so far: `Some` in builds with debug assertions (tests, the
    /// simulation, fuzzing), `None` in others, which do not count (the
    /// count would cost the one pass an instruction).
    #[must_use]
    pub fn one_pass_rx_count(&self) -> Option<u64> {
        #[cfg(any(test, debug_assertions))]
        {
            Some(self.rx.one_pass_taken)
        }
        #[cfg(not(any(test, debug_assertions)))]
        {
            None
        }
    }

    /// One pass for the FPDU a ping-pong is made of: an untagged Send (or
    /// Send with Solicited Event) that is a whole DDP message in one FPDU,
    /// all of it at the front of `bytes`, at an FPDU boundary: its header
    /// checked, its payload placed into the next posted receive and the
    /// receive completed, as the general path (header event, placement,
    /// FPDU end) would, with every check that path makes for it: MPA
    /// length and CRC (the deframer's), DDP version, last flag, queue
    /// number, MSN and MO, RDMAP version and opcode, a receive posted and
    /// long enough, each placement inside the receive's (checked) memory.
    /// Returns the bytes consumed, or `None`, having changed nothing but
    /// receive memory the general path writes the same way, whenever
    /// anything else holds (a partial FPDU, markers, another opcode, a
    /// message of several segments, a Send with Invalidate or one that
    /// immediate data follows, a shared receive queue, message info, a
    /// check that fails): the general path then takes the same bytes and
    /// reports a violation, if any, in its own order.
    #[inline]
    fn one_pass_send<M: Memory<Region = R>>(&mut self, bytes: &[u8], mem: &mut M) -> Option<usize> {
        let hdr: &[u8; HDR_MAX] = bytes.get(2..2 + HDR_MAX)?.try_into().ok()?;
        let word = |at: usize| {
            hdr.get(at..at + 4)
                .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        // DDP: untagged, last segment, version 1 (reserved bits ignored,
        // as `UlpduRepr::parse` ignores them).
        let ddp_ctl = ddp::FLAG_TAGGED | ddp::FLAG_LAST | ddp::VERSION_MASK;
        if hdr[0] & ddp_ctl != ddp::FLAG_LAST | ddp::DDP_VERSION {
            return None;
        }
        // RDMAP: version 1, Send or Send with Solicited Event.
        let solicited = match parse_control(hdr[1]) {
            Ok(Opcode::Send) => false,
            Ok(Opcode::SendWithSolicitedEvent) => true,
            _ => return None,
        };
        if word(2) == SEND_IMM_FOLLOWS
            || Qn(word(6)) != QN_SEND
            || Msn(word(10)) != self.rx.expect[QS]
            || word(14) != 0
            || self.rx.recv.is_some()
            || self.rx.imm_wait.is_some()
            || self.rx.too_long.is_some()
            || self.cfg.srq
            || self.cfg.message_info
        {
            return None;
        }
        // The deframer stays borrowed from its checks to the take.
        let peeked = self.rx.deframer.peek_whole_mut(bytes)?;
        let payload = peeked.fpdu().ulpdu().get(HDR_MAX..)?;
        let len = payload.len();
        let w = self.rq.front()?;
        if len > w.total {
            return None;
        }
        let placed = match w.segs.as_slice() {
            // One buffer (a socket's receive): at its start.
            [s] if len <= s.len => len == 0 || mem.copy_in(s, 0, payload),
            segs => {
                let mut placed = true;
                let mut from = 0;
                crate::order::scatter(segs.iter().map(|s| s.len), 0, len, |i, off, k| {
                    let chunk = payload.get(from..from + k).unwrap_or_default();
                    from += k;
                    placed = placed && segs.get(i).is_some_and(|s| mem.copy_in(s, off, chunk));
                });
                placed
            }
        };
        if !placed {
            return None;
        }
        let fpdu = peeked.take();
        let n = fpdu.len();
        self.rx.hdr = *hdr;
        self.rx.hdr_len = HDR_MAX;
        self.rx.payload_len = len;
        self.rx.consumed_len = 0;
        self.rx.mode = Mode::Place;
        self.rx.expect[QS] = self.rx.expect[QS].next();
        let w = self.rq.pop_front()?;
        self.completions
            .push_back(recv_success(w.wr_id, WcOpcode::Recv, len, solicited));
        self.recv_done(w);
        #[cfg(any(test, debug_assertions))]
        {
            self.rx.one_pass_taken += 1;
        }
        Some(n)
    }

    fn after_deframer<M: Memory<Region = R>>(
        &mut self,
        r: Result<Handled, DeframeError>,
        attempted: usize,
        mem: &mut M,
    ) -> usize {
        match r {
            Ok(h) => {
                match h.event {
                    Some(Event::Header) => self.on_header(mem),
                    Some(Event::FpduEnd { .. }) => self.on_fpdu_end(mem),
                    None => {}
                }
                h.consumed
            }
            Err(e) => {
                let err = match e {
                    DeframeError::CrcMismatch { .. } => TermError::MpaCrcError,
                    DeframeError::BadMarker { .. } => TermError::MpaMarkerMismatch,
                    // The ULPDU cannot hold its DDP header: a Terminate, not
                    // a bare reset.
                    DeframeError::UlpduTooShort { .. } | DeframeError::UlpduTooLong { .. } => {
                        MALFORMED_HEADER
                    }
                    _ => TermError::DdpLocalCatastrophic,
                };
                self.violate(err, false, mem);
                // The bytes were looked at (and count as consumed); nothing
                // after them is.
                attempted
            }
        }
    }

    // ------------------------------------------------------------------
    // Header time: validate, pick the destination
    // ------------------------------------------------------------------

    // Not inlined (nor `on_fpdu_end`): the deframer's result is handled
    // three times per FPDU (header, payload, trailer), with an event at two
    // of them; inlined, both made every call save and restore as much as
    // the largest of them needs.
    #[inline(never)]
    fn on_header<M: Memory<Region = R>>(&mut self, mem: &mut M) {
        let Some(h) = self.rx.deframer.header() else {
            return;
        };
        let n = h.ddp_header.len().min(HDR_MAX);
        if let (Some(dst), Some(src)) = (self.rx.hdr.get_mut(..n), h.ddp_header.get(..n)) {
            dst.copy_from_slice(src);
        }
        self.rx.hdr_len = n;
        self.rx.payload_len = h.payload_len();
        self.rx.consumed_len = 0;
        self.rx.dest.clear();
        self.rx.dest_idx = 0;
        self.rx.dest_off = 0;
        self.rx.pending = Pending::None;
        self.rx.mode = Mode::Place;
        let hdr = self.rx.hdr;
        let consumed = hdr
            .get(1)
            .and_then(|&b| parse_control(b).ok())
            .is_some_and(|o| o.payload_placement() == PayloadPlacement::Consumed);
        let verdict = match UlpduRepr::parse(hdr.get(..n).unwrap_or_default()) {
            Ok(repr) => self.check_placed(&repr, mem),
            Err(UlpduError::BodyLength { .. } | UlpduError::Body(_)) if consumed => {
                if self.rx.payload_len > CONSUME_MAX {
                    Err(MALFORMED_HEADER)
                } else {
                    self.rx.mode = Mode::Consume;
                    Ok(())
                }
            }
            Err(e) => Err(e.term_error().unwrap_or(MALFORMED_HEADER)),
        };
        // A consumed message longer than any valid one is refused at once,
        // as the engine does: waiting for its end would stage bytes never
        // used (and the peer may never send them).
        let oversized = consumed && self.rx.payload_len > CONSUME_MAX;
        if let Err(e) = verdict {
            self.rx.dest.clear();
            if !consumed || oversized {
                // A placed segment's header (Write, Read Response, Send, or
                // an unknown opcode) is refused before its payload and CRC
                // are read, as Linux siw does: a corrupted STag in a Write
                // is reported as "Invalid STag" (see "Rule 6" in
                // docs/protocol-core.md).
                if let Some(wr_id) = self.rx.too_long.take() {
                    // The receive is too small: it completes with a length
                    // error (not a flush), then the Terminate goes out.
                    self.complete_recv(wr_id, WcStatus::LocalLength);
                }
                self.violate(e, true, mem);
                return;
            }
            // A consumed message's verdict is raised at the end of the
            // FPDU, once its CRC is known good.
            self.rx.mode = Mode::Discard;
            self.rx.deferred = Some(e);
        }
    }

    fn check_placed<M: Memory<Region = R>>(
        &mut self,
        repr: &UlpduRepr<'_>,
        mem: &mut M,
    ) -> Check<()> {
        let len = self.rx.payload_len;
        match (repr.opcode, repr.address) {
            (Opcode::RdmaWrite, DdpAddress::Tagged { stag, to }) => {
                if to.checked_add(len as u64).is_none() {
                    return Err(TermError::DdpTaggedToWrap);
                }
                if self.cfg.message_info {
                    let mut header = [0u8; ddp::TAGGED_HEADER_LEN];
                    if let Some(h) = self.rx.hdr.get(..ddp::TAGGED_HEADER_LEN) {
                        header.copy_from_slice(h);
                    }
                    let w = self.rx.write_open.get_or_insert(WriteInfo {
                        stag: stag.0,
                        to,
                        len: 0,
                        header,
                    });
                    w.len += len as u64;
                    if repr.last {
                        self.rx.last_write = self.rx.write_open.take();
                    }
                }
                if len == 0 {
                    // A zero-length Write places nothing (RTR uses one).
                    return Ok(());
                }
                let span = mem
                    .remote(stag.0, RemoteAccess::Write, to, len as u64)
                    .map_err(|e| e.term_error(true))?;
                if span.len < len {
                    return Err(TermError::DdpTaggedBaseOrBounds);
                }
                self.rx.dest.push(span);
                Ok(())
            }
            (Opcode::RdmaReadResponse, DdpAddress::Tagged { stag, to }) => {
                if to.checked_add(len as u64).is_none() {
                    return Err(TermError::DdpTaggedToWrap);
                }
                let Some(front) = self.ord.front_mut() else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                let OutKind::Read { sink, progress } = &mut front.kind else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                let at = progress.accept(stag.0, to, len, repr.last)?;
                if len > 0 {
                    let piece = sink.slice(at, len);
                    self.rx.dest.push(piece);
                }
                self.rx.pending = Pending::ReadResponse { last: repr.last };
                Ok(())
            }
            (op, DdpAddress::Untagged { qn, msn, mo }) if op.is_send() => {
                self.check_send(repr, qn, msn, mo, mem)
            }
            _ => Err(TermError::RdmapUnexpectedOpcode),
        }
    }

    fn pop_recv<M: Memory<Region = R>>(&mut self, mem: &mut M) -> Option<RecvEntry<R>> {
        if self.cfg.srq {
            mem.srq_pop().map(|s| RecvEntry {
                wr_id: s.wr_id,
                total: s.segs.iter().map(|x| x.len).sum(),
                segs: s.segs,
                key: None,
            })
        } else {
            self.rq.pop_front()
        }
    }

    fn check_send<M: Memory<Region = R>>(
        &mut self,
        repr: &UlpduRepr<'_>,
        qn: Qn,
        msn: Msn,
        mo: u32,
        mem: &mut M,
    ) -> Check<()> {
        let len = self.rx.payload_len;
        if qn != QN_SEND {
            return Err(TermError::DdpUntaggedInvalidQn);
        }
        if msn != self.rx.expect[QS] {
            return Err(TermError::DdpUntaggedMsnRange);
        }
        if self.rx.recv.is_none() {
            if mo != 0 {
                return Err(TermError::DdpUntaggedInvalidMo);
            }
            if self.rx.imm_wait.is_some() {
                return Err(TermError::RdmapUnexpectedOpcode);
            }
            let Some(w) = self.pop_recv(mem) else {
                return Err(TermError::DdpUntaggedNoBuffer);
            };
            self.rx.recv = Some(RecvProgress {
                wr_id: w.wr_id,
                segs: w.segs,
                key: w.key,
                fill: crate::order::SendFill::new(msn, w.total),
                opcode: repr.opcode,
                header: self.rx.hdr,
            });
        }
        let Some(r) = self.rx.recv.as_mut() else {
            return Err(TermError::DdpLocalCatastrophic);
        };
        let at = match r.fill.accept(msn, mo, len) {
            Ok(at) => at,
            Err(e) => {
                if e == TermError::DdpUntaggedMessageTooLong {
                    // The receive is too small: it completes with a length
                    // error (not a flush), then the Terminate goes out.
                    self.rx.too_long = Some(r.wr_id);
                    self.rx.recv = None;
                }
                return Err(e);
            }
        };
        let segs = &r.segs;
        let dest = &mut self.rx.dest;
        crate::order::scatter(segs.iter().map(|s| s.len), at, len, |i, off, k| {
            if let Some(s) = segs.get(i) {
                dest.push(s.slice(off, k));
            }
        });
        let rsvd = self
            .rx
            .hdr
            .get(2..6)
            .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        self.rx.pending = Pending::SendSegment {
            last: repr.last,
            solicited: repr.opcode.is_solicited(),
            inv: repr.invalidate_stag.map(|s| s.0),
            imm_follows: rsvd == SEND_IMM_FOLLOWS && !repr.opcode.has_invalidate_stag(),
        };
        Ok(())
    }

    // ------------------------------------------------------------------
    // FPDU end: message effects
    // ------------------------------------------------------------------

    #[inline(never)]
    fn on_fpdu_end<M: Memory<Region = R>>(&mut self, mem: &mut M) {
        // The payload is placed: let go of its memory now, not at the next
        // FPDU (the engine's lent memory waits for every reference).
        self.rx.dest.clear();
        self.rx.dest_idx = 0;
        self.rx.dest_off = 0;
        let r = match self.rx.mode {
            Mode::Consume => self.consume_message(mem),
            Mode::Place => self.apply_pending(mem),
            Mode::Discard => {
                if let Some(wr_id) = self.rx.too_long.take() {
                    // The receive is too small: it completes with a length
                    // error (not a flush), then the Terminate goes out.
                    self.complete_recv(wr_id, WcStatus::LocalLength);
                }
                Err(self
                    .rx
                    .deferred
                    .take()
                    .unwrap_or(TermError::DdpLocalCatastrophic))
            }
        };
        if let Err(e) = r {
            self.violate(e, true, mem);
        }
    }

    fn apply_pending<M: Memory<Region = R>>(&mut self, mem: &mut M) -> Check<()> {
        match core::mem::replace(&mut self.rx.pending, Pending::None) {
            Pending::None => Ok(()),
            Pending::ReadResponse { last } => {
                if last && let Some(o) = self.ord.pop_front() {
                    let got = o.read_len();
                    self.complete_sq(
                        o.seq,
                        WcStatus::Success,
                        u32::try_from(got).unwrap_or(u32::MAX),
                        0,
                    );
                }
                Ok(())
            }
            Pending::SendSegment {
                last,
                solicited,
                inv,
                imm_follows,
            } => {
                if !last {
                    return Ok(());
                }
                self.rx.expect[QS] = self.rx.expect[QS].next();
                let Some(r) = self.rx.recv.take() else {
                    return Ok(());
                };
                if imm_follows {
                    self.rx.imm_wait = Some((r, solicited));
                    return Ok(());
                }
                let mut wc = recv_success(r.wr_id, WcOpcode::Recv, r.fill.received, solicited);
                if let Some(stag) = inv {
                    if let Err(e) = mem.invalidate(stag, true) {
                        // Like siw: the receive reports the failure.
                        wc.status = WcStatus::RemoteInvalidRequest;
                        self.completions.push_back(wc);
                        return Err(e.term_error());
                    }
                    wc.invalidated = Some(stag);
                }
                self.push_recv_info(&r, inv);
                self.completions.push_back(wc);
                self.recv_done(RecvEntry {
                    wr_id: r.wr_id,
                    total: r.fill.total,
                    segs: r.segs,
                    key: r.key,
                });
                Ok(())
            }
        }
    }

    fn consume_message<M: Memory<Region = R>>(&mut self, mem: &mut M) -> Check<()> {
        let mut buf = [0u8; HDR_MAX + CONSUME_MAX];
        let h = self.rx.hdr_len;
        let c = self.rx.consumed_len;
        if let (Some(d), Some(s)) = (buf.get_mut(..h), self.rx.hdr.get(..h)) {
            d.copy_from_slice(s);
        }
        if let (Some(d), Some(s)) = (buf.get_mut(h..h + c), self.rx.consumed.get(..c)) {
            d.copy_from_slice(s);
        }
        let opcode = self.rx.hdr.get(1).and_then(|&b| parse_control(b).ok());
        let repr = match UlpduRepr::parse(buf.get(..h + c).unwrap_or_default()) {
            Ok(r) => r,
            Err(UlpduError::Body(_)) if opcode == Some(Opcode::AtomicRequest) => {
                return Err(UNSUPPORTED_ATOMIC);
            }
            Err(e) => return Err(e.term_error().unwrap_or(MALFORMED_HEADER)),
        };
        let DdpAddress::Untagged { qn, msn, mo } = repr.address else {
            return Err(TermError::RdmapUnexpectedOpcode);
        };
        // Every consumed message is one whole DDP message on its queue:
        // right QN, MO 0, last flag set.
        let want_qn = repr.opcode.queue_number();
        if want_qn != Some(qn) {
            return Err(TermError::DdpUntaggedInvalidQn);
        }
        if mo != 0 {
            return Err(TermError::DdpUntaggedInvalidMo);
        }
        if !repr.last {
            return Err(MALFORMED_HEADER);
        }
        match repr.body {
            UlpduBody::ReadRequest(req) => {
                self.accept_inbound(msn)?;
                let src = mem
                    .remote(
                        req.src_stag.0,
                        RemoteAccess::Read,
                        req.src_to,
                        u64::from(req.read_size),
                    )
                    .map_err(|e| e.term_error(false))?;
                if src.len < req.read_size as usize {
                    return Err(TermError::RdmapBaseOrBounds);
                }
                self.take_inbound();
                self.resp.push_back(Response::Read {
                    src,
                    sink_stag: req.sink_stag.0,
                    sink_to: req.sink_to,
                });
                Ok(())
            }
            UlpduBody::AtomicRequest(req) => {
                self.accept_inbound(msn)?;
                if req.to % 8 != 0 {
                    return Err(TermError::RdmapBaseOrBounds);
                }
                let t = mem
                    .remote(req.stag.0, RemoteAccess::Atomic, req.to, 8)
                    .map_err(|e| e.term_error(false))?;
                let Some(original) = mem.atomic(&t, &req) else {
                    return Err(TermError::RdmapBaseOrBounds);
                };
                self.take_inbound();
                self.resp.push_back(Response::Atomic {
                    request_id: req.request_id,
                    original,
                });
                Ok(())
            }
            UlpduBody::AtomicResponse(resp) => {
                if msn != self.rx.expect[QN_ARESP] {
                    return Err(TermError::DdpUntaggedMsnRange);
                }
                let matches = self
                    .ord
                    .front()
                    .is_some_and(|o| o.answered_by_atomic(resp.request_id));
                if !matches {
                    return Err(TermError::RdmapUnexpectedOpcode);
                }
                self.rx.expect[QN_ARESP] = self.rx.expect[QN_ARESP].next();
                if let Some(o) = self.ord.pop_front() {
                    if let OutKind::Atomic { sink, .. } = &o.kind {
                        mem.copy_in(sink, 0, &resp.original_value.to_ne_bytes());
                    }
                    self.complete_sq(o.seq, WcStatus::Success, 8, 0);
                }
                Ok(())
            }
            UlpduBody::Immediate(d) => {
                if msn != self.rx.expect[QS] || self.rx.recv.is_some() {
                    return Err(TermError::DdpUntaggedMsnRange);
                }
                let imm = u32::try_from(d.as_be_u64() & 0xffff_ffff).unwrap_or(0);
                let solicited = repr.opcode.is_solicited();
                let mut wc = match self.rx.imm_wait.take() {
                    Some((r, s)) => {
                        self.push_recv_info(&r, None);
                        recv_success(r.wr_id, WcOpcode::Recv, r.fill.received, s || solicited)
                    }
                    None => match self.pop_recv(mem) {
                        Some(w) => {
                            if self.cfg.message_info {
                                let write = self.rx.last_write.take();
                                self.msg_infos.push_back(MsgInfo::Write { write });
                            }
                            recv_success(w.wr_id, WcOpcode::RecvRdmaWithImm, 0, solicited)
                        }
                        None => return Err(TermError::DdpUntaggedNoBuffer),
                    },
                };
                self.rx.expect[QS] = self.rx.expect[QS].next();
                wc.imm = Some(imm);
                self.completions.push_back(wc);
                Ok(())
            }
            UlpduBody::Terminate(t) => {
                self.rx.expect[QN_TERM] = self.rx.expect[QN_TERM].next();
                self.terminated_by_peer(t.code);
                Ok(())
            }
            UlpduBody::Payload(_) => Err(TermError::RdmapUnexpectedOpcode),
        }
    }

    /// With `Config::message_info`: what a completed Send tells a proxy.
    fn push_recv_info(&mut self, r: &RecvProgress<R>, inv: Option<u32>) {
        if self.cfg.message_info {
            self.msg_infos.push_back(MsgInfo::Send {
                opcode: r.opcode,
                header: r.header,
                segs: r.segs.clone(),
                inv,
            });
        }
    }

    /// The checks every inbound Read Request or Atomic Request passes
    /// (queue 1): its MSN is the next one and an IRD slot is free (RFC
    /// 5041's "MSN range is not valid" when the peer exceeds our IRD).
    fn accept_inbound(&self, msn: Msn) -> Check<()> {
        if msn != self.rx.expect[QN_RREQ] || !self.ird.has_room() {
            return Err(TermError::DdpUntaggedMsnRange);
        }
        Ok(())
    }

    fn take_inbound(&mut self) {
        self.ird.take();
        self.rx.expect[QN_RREQ] = self.rx.expect[QN_RREQ].next();
    }

    /// A Terminate arrived from the peer.
    fn terminated_by_peer(&mut self, code: softrdma_wire::errcode::TermCode) {
        self.outputs
            .push_back(crate::types::Output::Event(crate::types::AsyncEvent {
                kind: AsyncKind::TerminateReceived,
                term: Some(code),
            }));
        // The oldest outstanding Read or atomic is the request the
        // Terminate answered; its completion carries the raw code.
        let status = term::status_for_received(code);
        let vendor = u32::from(u16::from_be_bytes(code.to_bytes()));
        if let Some(r) = self.ord.pop_front() {
            self.complete_sq(r.seq, status, 0, vendor);
        }
        self.enter_error(ConnEvent::TerminateReceived, Some(LinkAction::Reset));
    }

    // ------------------------------------------------------------------
    // Violations
    // ------------------------------------------------------------------

    /// The peer violated the protocol: queue a Terminate (RFC 5040 section
    /// 4.8) carrying `err`, report the event of its [`term::TABLE`] row,
    /// flush everything and stop receiving. `with_header`: the current
    /// segment's DDP header is complete and is copied (D=1, M=1 with the
    /// segment's payload length, like siw; plus the Read Request header,
    /// R=1, for a protection error on a Read Request).
    pub(super) fn violate<M: Memory<Region = R>>(
        &mut self,
        err: TermError,
        with_header: bool,
        _mem: &mut M,
    ) {
        self.violate_with(err, with_header);
    }

    /// [`Self::violate`] without the memory (none is needed).
    pub(super) fn violate_with(&mut self, err: TermError, with_header: bool) {
        if !matches!(self.state, QpState::Rts | QpState::Closing) {
            self.rx.dead = true;
            return;
        }
        let class = term::class(err);
        let hdr = self.rx.hdr;
        let h = self.rx.hdr_len;
        let copy_ddp = with_header && h > 0 && term::copies_ddp_header(err);
        let is_read_req =
            hdr.get(1).and_then(|&b| parse_control(b).ok()) == Some(Opcode::RdmaReadRequest);
        let rdmap = (copy_ddp
            && is_read_req
            && term::copies_rdmap_header(err)
            && self.rx.consumed_len >= 28)
            .then(|| self.rx.consumed.get(..28))
            .flatten();
        let repr = TerminateRepr {
            code: err.into(),
            segment_length_valid: copy_ddp,
            ddp: copy_ddp.then(|| TerminatedDdp {
                segment_length: u16::try_from(self.rx.payload_len).unwrap_or(u16::MAX),
                header: hdr.get(..h).unwrap_or_default(),
            }),
            rdmap_header: rdmap,
        };
        let msn = self.tx.msn[QN_TERM];
        self.tx.msn[QN_TERM] = msn.next();
        let ulpdu = UlpduRepr::terminate(msn, repr);
        let mut buf = [0u8; super::tx::TERM_CAP];
        let n = ulpdu.emit(&mut buf).unwrap_or(0);
        self.push_event(class.event, Some(err));
        self.transition(ConnEvent::LocalViolation);
        self.rx.dead = true;
        self.close_deadline = None;
        self.flush_all();
        debug_assert!(n > 0, "a Terminate always fits its buffer");
        self.sq.clear();
        self.tx.term = Some((buf, n));
    }
}

#[cfg(test)]
mod one_pass_tests;

fn recv_success(wr_id: u64, opcode: WcOpcode, len: usize, solicited: bool) -> Completion {
    Completion {
        cq: CqKind::Recv,
        wr_id,
        status: WcStatus::Success,
        opcode,
        byte_len: u32::try_from(len).unwrap_or(u32::MAX),
        imm: None,
        invalidated: None,
        solicited,
        vendor_err: 0,
        internal: false,
    }
}
