//! Receive: direct placement over the wire crate's deframer.
//!
//! The one FPDU framer is `softrdma_wire::deframer::Deframer` in its
//! direct-placement mode: it says what to read next (header, payload,
//! trailer), checks lengths and the CRC, and reports the FPDU's header and
//! end. This file feeds it bytes from the socket and applies the rules
//! (RFC 5040 / RFC 5041: STag, protection domain, bounds, access rights,
//! MSN, MO, Read Response matching, a posted receive for a Send) at the two
//! events it reports:
//!
//! * **header** (`on_header`): a placed segment (Write, Read Response, Send)
//!   is validated and its destination picked — the tagged buffer of a Write
//!   or Read Response, the posted receive of a Send; a refused header gets
//!   its Terminate at once, before the payload is read, as Linux siw does.
//!   A consumed message (Read Request, atomics, Immediate Data, Terminate)
//!   only has its RDMAP header collected.
//! * **FPDU end** (`on_fpdu_end`, the CRC checked good): a consumed message
//!   is validated (so a header damaged in transit is a CRC error, not the
//!   peer's protocol violation), then the message's effects are applied.
//!
//! The payload is read from the socket straight into its destination with
//! one `readv` that also takes the bytes after it (trailer, next header)
//! into a small staging buffer, and reported to the deframer by length
//! (`Deframer::handle_payload_by`; the CRC is updated from the placed
//! memory through `sys`). Payload bytes that arrived in the staging buffer
//! together with a header (small messages) are copied from there: fewer
//! system calls beat avoiding a copy of a few hundred bytes.
//!
//! Any violation sends a Terminate with the RFC's error code and puts the QP
//! in ERROR; no byte is ever placed outside a region the peer was granted.
//! The codes and the event each one raises come from the protocol core's
//! one table (`softrdma_proto::term`).

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use softrdma_wire::ddp::{FLAG_LAST, Msn};
use softrdma_wire::deframer::{DeframeError, Deframer, DeframerConfig, Event, Want};
use softrdma_wire::errcode::TermError;
use softrdma_wire::rdmap::atomic::{AtomicRequestRepr, AtomicResponseRepr};
use softrdma_wire::rdmap::{Opcode, PayloadPlacement, parse_control};
use softrdma_wire::ulpdu::{DdpAddress, UlpduBody, UlpduError, UlpduRepr};

use crate::mr::Access;
use crate::proxy::MsgMeta;
use crate::qp::{OutReadKind, QpInner, TermHeader};
use crate::state::QpState;
use crate::sys::io::{IoVecs, MAX_IOVECS, crc_update_mem, readv};
use crate::sys::mem::Memory;
use crate::tx::{Response, SEND_IMM_FOLLOWS, qi};
use crate::wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use crate::wr::RecvWqe;
use softrdma_proto::order::{SendFill, scatter};
use softrdma_proto::term::{MALFORMED_HEADER, UNSUPPORTED_ATOMIC};
use softrdma_wire::ddp::{QN_ATOMIC_RESPONSE, QN_READ_REQUEST, QN_SEND, QN_TERMINATE};

/// Staging buffer: headers, trailers, small payloads and read-ahead. Large
/// payloads never pass through it, so it need not hold a whole FPDU.
const STAGING: usize = 32 * 1024;
/// Payload remainders at least this long are read straight into their
/// destination; shorter ones go through the staging buffer.
const DIRECT_MIN: usize = 1024;
/// Bytes read ahead of a large payload (its trailer and the next header).
const READAHEAD_LARGE: usize = 256;
/// Longest consumed ULPDU (Atomic Request: 18 + 52 bytes; Terminate: 18 +
/// 52 at most); a longer one is refused at its header.
const MAX_HEAD: usize = 128;
/// Largest DDP header copied into a Terminate.
const MAX_COPIED_HDR: usize = 18;
/// The RDMAP header of a Read Request, copied into a Terminate for a
/// protection error on it.
const READ_REQUEST_HDR: usize = 28;

/// How the payload of the current FPDU is handled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Placed into `dest`.
    Place,
    /// Collected in `consumed` (an RDMAP header the protocol consumes),
    /// judged at the FPDU's end.
    Consume,
}

/// What to do once the current FPDU is complete and its CRC checked.
#[derive(Debug)]
enum Action {
    None,
    /// A Send segment was placed into the current receive.
    SendSegment {
        last: bool,
        solicited: bool,
        inv: Option<u32>,
        imm_follows: bool,
    },
    /// Immediate Data arrived.
    Immediate {
        imm: u32,
        solicited: bool,
    },
    /// A Read Response segment was placed.
    ReadResponse {
        last: bool,
    },
    /// A Read Request was accepted.
    ReadRequest(Response),
    /// An Atomic Request.
    AtomicRequest(AtomicRequestRepr, crate::mr::Target),
    /// An Atomic Response.
    AtomicResponse(AtomicResponseRepr),
    /// A Terminate arrived.
    Terminate(softrdma_wire::errcode::TermCode),
}

/// A receive being filled by a (multi-segment) Send.
#[derive(Debug)]
struct RecvProgress {
    wqe: RecvWqe,
    /// The Send's MSN and the bytes received (the protocol core's rule,
    /// `softrdma_proto::order::SendFill`).
    fill: SendFill,
    /// RDMAP opcode and DDP/RDMAP header of the first segment (for proxy
    /// filters).
    opcode: Opcode,
    header: [u8; MAX_COPIED_HDR],
}

/// An RDMA Write being received on a proxy QP: what a following Immediate
/// Data message (Write with Immediate) reports to the proxy filter.
#[derive(Debug, Clone, Copy)]
struct WriteTrack {
    stag: u32,
    to: u64,
    len: u64,
    header: [u8; MAX_COPIED_HDR],
    header_len: usize,
}

/// Why processing stopped.
#[derive(Debug)]
enum Stop {
    /// No more bytes for now.
    Drained,
    /// The peer closed the stream (at an FPDU boundary or not).
    Closed { at_boundary: bool },
    /// The socket failed.
    Failed(io::Error),
    /// The peer violated the protocol (the event it raises comes from
    /// `softrdma_proto::term::TABLE`).
    Violation(TermError),
    /// The QP is no longer receiving.
    Dead,
}

/// The receive state of a QP (behind its receive lock).
#[derive(Debug)]
pub(crate) struct RxState {
    stream: Option<Arc<TcpStream>>,
    /// The FPDU framer (lengths, pad, CRC).
    deframer: Deframer,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    mode: Mode,
    /// A consumed message's RDMAP header (after the DDP header).
    consumed: [u8; MAX_HEAD],
    consumed_len: usize,
    dest: Vec<(Arc<Memory>, usize, usize)>,
    dest_idx: usize,
    dest_off: usize,
    action: Action,
    /// The current FPDU's DDP header (also copied into a Terminate).
    hdr_copy: [u8; MAX_COPIED_HDR],
    hdr_copy_len: usize,
    /// The current segment's payload length (after its DDP header), for a
    /// Terminate's DDP Segment Length.
    seg_len: usize,
    /// A Read Request's RDMAP header (copied into a Terminate for a
    /// protection error).
    rdmap_copy: [u8; READ_REQUEST_HDR],
    rdmap_copy_len: usize,
    /// A receive too small for the Send being received: completes with a
    /// length error before the Terminate (else it is flushed).
    too_long: Option<u64>,
    /// Next MSN expected per queue.
    expect: [Msn; 4],
    recv: Option<RecvProgress>,
    /// A completed Send with Immediate waiting for its Immediate Data.
    imm_wait: Option<(RecvProgress, bool)>,
    /// Proxy QPs only: the RDMA Write being received, and the last one
    /// received completely.
    write_open: Option<WriteTrack>,
    last_write: Option<WriteTrack>,
    iov: IoVecs,
    /// The last FPDU had a small payload and was not the tail of a
    /// message with a large FPDU: read as much as is available.
    small: bool,
    /// The placed message being received (its last FPDU not yet seen) had
    /// an FPDU with a large payload.
    msg_large: bool,
    /// The last read (`fill` or `read_direct`'s `readv`) in this run
    /// returned less than asked for: the socket was empty at that moment,
    /// so the next read is skipped (`Stop::Drained`) rather than made to
    /// say EAGAIN. Cleared at the start of every `rx_run`; a watcher
    /// re-arms level-triggered, so bytes that arrived since are not missed.
    drained_hint: bool,
    pub(crate) bytes_received: u64,
}

impl RxState {
    pub(crate) fn new() -> Self {
        RxState {
            stream: None,
            deframer: Deframer::new(DeframerConfig::new(false, false)),
            buf: Vec::new(),
            start: 0,
            end: 0,
            mode: Mode::Place,
            consumed: [0; MAX_HEAD],
            consumed_len: 0,
            dest: Vec::new(),
            dest_idx: 0,
            dest_off: 0,
            action: Action::None,
            hdr_copy: [0; MAX_COPIED_HDR],
            hdr_copy_len: 0,
            seg_len: 0,
            rdmap_copy: [0; READ_REQUEST_HDR],
            rdmap_copy_len: 0,
            too_long: None,
            expect: [Msn::INITIAL; 4],
            recv: None,
            imm_wait: None,
            write_open: None,
            last_write: None,
            iov: IoVecs::new(),
            small: true,
            msg_large: false,
            drained_hint: false,
            bytes_received: 0,
        }
    }

    pub(crate) fn attach(
        &mut self,
        stream: Arc<TcpStream>,
        crc: bool,
        send_msn: Msn,
        read_msn: Msn,
        already_read: &[u8],
    ) {
        self.stream = Some(stream);
        // A QP closed gracefully is connected again with this state: every
        // queue starts afresh, nothing of the last connection's Writes is
        // reported.
        self.expect = [Msn::INITIAL; 4];
        self.write_open = None;
        self.last_write = None;
        self.expect[qi(QN_SEND)] = send_msn;
        self.expect[qi(QN_READ_REQUEST)] = read_msn;
        // Markers are always declined in the MPA negotiation.
        self.deframer = Deframer::new(DeframerConfig::new(crc, false));
        self.buf = vec![0u8; STAGING];
        let n = already_read.len().min(STAGING);
        self.buf[..n].copy_from_slice(&already_read[..n]);
        self.start = 0;
        self.end = n;
        self.small = true;
        self.msg_large = false;
    }

    pub(crate) fn detach(&mut self) {
        self.stream = None;
        // No placement after this: let go of the memory (lent memory waits
        // for it, see `mr::LentRegion`).
        self.dest.clear();
    }

    /// The receives taken from the queue and not completed (flushed on
    /// error).
    pub(crate) fn take_partial(&mut self) -> Vec<u64> {
        self.dest.clear();
        let mut v = Vec::new();
        if let Some(wr_id) = self.too_long.take() {
            v.push(wr_id);
        }
        if let Some(r) = self.recv.take() {
            v.push(r.wqe.wr_id);
        }
        if let Some((r, _)) = self.imm_wait.take() {
            v.push(r.wqe.wr_id);
        }
        v
    }

    fn avail(&self) -> usize {
        self.end - self.start
    }

    /// Reads more bytes into the staging buffer.
    fn fill(&mut self) -> Result<(), Stop> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > STAGING / 2 || self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.drained_hint {
            // The last read came back short: the socket is (very likely)
            // empty. Skip the read that would say EAGAIN; a watcher re-arms
            // level-triggered, so bytes still there are not missed.
            return Err(Stop::Drained);
        }
        let Some(stream) = self.stream.as_ref() else {
            return Err(Stop::Dead);
        };
        let mut s: &TcpStream = stream;
        // After a large FPDU, read little ahead: the next FPDU is probably
        // large too, and its payload should go straight to its destination,
        // not through this buffer.
        let limit = if self.small {
            self.buf.len()
        } else {
            (self.end + READAHEAD_LARGE).min(self.buf.len())
        };
        match s.read(&mut self.buf[self.end..limit]) {
            Ok(0) => Err(Stop::Closed {
                at_boundary: self.deframer.is_at_fpdu_boundary() && self.avail() == 0,
            }),
            Ok(n) => {
                self.drained_hint = self.end + n < limit;
                self.end += n;
                self.bytes_received += n as u64;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(Stop::Drained),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(Stop::Failed(e)),
        }
    }
}

impl QpInner {
    /// Receive progress from a CQ poll: only if nobody else is receiving.
    /// `busy`: the caller busy-polls (the receive thread may leave the
    /// socket to it for a while).
    pub(crate) fn rx_poll(&self, busy: bool) -> bool {
        if busy {
            self.last_poll
                .store(crate::datamover::now_ns(), Ordering::Relaxed);
        }
        if self.core_mode() {
            return self.core_rx(false).0;
        }
        let Some(mut rx) = self.rx.try_lock() else {
            return false;
        };
        if rx.stream.is_none() {
            return false;
        }
        let before = rx.bytes_received;
        self.rx_run(&mut rx);
        rx.bytes_received != before
    }

    /// Receive progress from a receive thread. Returns `false` once the QP
    /// no longer receives (no need to wait for the socket again).
    pub(crate) fn rx_thread_progress(&self) -> bool {
        if self.core_mode() {
            return self.core_rx(true).1;
        }
        let mut rx = self.rx.lock();
        if rx.stream.is_none() {
            return false;
        }
        self.rx_run(&mut rx)
    }

    /// Processes FPDUs until the socket has no more bytes. Returns whether
    /// the QP still receives.
    fn rx_run(&self, rx: &mut RxState) -> bool {
        rx.drained_hint = false;
        let stop = loop {
            if !matches!(self.state(), QpState::Rts | QpState::Closing) {
                break Stop::Dead;
            }
            match self.rx_step(rx) {
                Ok(()) => {}
                Err(s) => break s,
            }
        };
        match stop {
            Stop::Drained => return true,
            Stop::Dead => {}
            Stop::Closed { at_boundary } => {
                rx.stream = None;
                self.flush_partial(rx);
                self.link_closed(at_boundary);
            }
            Stop::Failed(e) => {
                rx.stream = None;
                self.flush_partial(rx);
                self.link_failed(&e);
            }
            Stop::Violation(err) => {
                rx.stream = None;
                self.flush_partial(rx);
                let hdr = rx.hdr_copy;
                let rdmap = rx.rdmap_copy;
                let copied = TermHeader {
                    ddp: &hdr[..rx.hdr_copy_len],
                    segment_length: u16::try_from(rx.seg_len).unwrap_or(u16::MAX),
                    rdmap: (rx.rdmap_copy_len == READ_REQUEST_HDR).then_some(&rdmap[..]),
                };
                self.fail(err, (rx.hdr_copy_len > 0).then_some(copied));
            }
        }
        // Whoever moved the QP out of RTS could not take the receive lock
        // (held here): flush what the receive path holds and let go of the
        // socket.
        rx.stream = None;
        self.flush_partial(rx);
        false
    }

    /// Flushes the receives the receive path has taken and not completed.
    fn flush_partial(&self, rx: &mut RxState) {
        for wr_id in rx.take_partial() {
            self.complete_recv(
                WorkCompletion::error(wr_id, WcOpcode::Recv, self.qp_num, WcStatus::WrFlush),
                false,
            );
        }
    }

    /// One step: what the deframer wants next, from the staging buffer or
    /// the socket.
    fn rx_step(&self, rx: &mut RxState) -> Result<(), Stop> {
        let len = match rx.deframer.next_read() {
            Want::Payload { len } => return self.rx_payload(rx, len),
            w => w.len(),
        };
        if rx.avail() == 0 {
            return rx.fill();
        }
        let (s, n) = (rx.start, len.min(rx.avail()));
        let h = rx
            .deframer
            .handle_bytes(&rx.buf[s..s + n])
            .map_err(|e| deframe_stop(rx, e))?;
        rx.start += h.consumed;
        match h.event {
            Some(Event::Header) => self.on_header(rx),
            Some(Event::FpduEnd { .. }) => self.on_fpdu_end(rx),
            None => Ok(()),
        }
    }

    /// The DDP header of a new FPDU is in: a placed segment is judged now
    /// and its destination picked; a consumed message waits for its end.
    fn on_header(&self, rx: &mut RxState) -> Result<(), Stop> {
        let Some(h) = rx.deframer.header() else {
            return Err(local_catastrophe());
        };
        let hdr_len = h.ddp_header.len().min(MAX_COPIED_HDR);
        let ulpdu_len = usize::from(h.ulpdu_len);
        let payload_len = h.payload_len();
        rx.hdr_copy[..hdr_len].copy_from_slice(&h.ddp_header[..hdr_len]);
        rx.hdr_copy_len = hdr_len;
        rx.seg_len = payload_len;
        rx.rdmap_copy_len = 0;
        rx.consumed_len = 0;
        rx.action = Action::None;
        rx.dest.clear();
        rx.dest_idx = 0;
        rx.dest_off = 0;
        let opcode = parse_control(rx.hdr_copy[1]).ok();
        if opcode.is_some_and(|o| o.payload_placement() == PayloadPlacement::Consumed) {
            rx.mode = Mode::Consume;
            rx.small = true;
            if ulpdu_len > MAX_HEAD {
                // No consumed message is this long: answer at once, without
                // waiting for (or staging) bytes never used.
                return Err(Stop::Violation(MALFORMED_HEADER));
            }
            return Ok(());
        }
        rx.mode = Mode::Place;
        // Small is decided per message, not per FPDU: the short tail FPDU
        // of a long message (64 KiB + 16 sent as 65 456 + 96 octets) is
        // followed most likely by another long message, whose payload
        // should go straight to its destination rather than be read ahead
        // into the staging buffer and copied. Messages of small FPDUs only
        // (an 8-octet Send) still read ahead all there is.
        let cont_large = rx.msg_large;
        rx.small = payload_len < DIRECT_MIN && !cont_large;
        rx.msg_large = rx.hdr_copy[0] & FLAG_LAST == 0 && (cont_large || payload_len >= DIRECT_MIN);
        let hdr = rx.hdr_copy;
        let verdict = match UlpduRepr::parse(&hdr[..hdr_len]) {
            Ok(repr) => self.validate(rx, &repr, payload_len),
            Err(e) => Err(e.term_error().unwrap_or(MALFORMED_HEADER)),
        };
        match verdict {
            Ok(action) => {
                rx.action = action;
                Ok(())
            }
            Err(err) => {
                // A placed segment's header is refused before its payload
                // is read, as Linux siw does (a corrupted STag is reported
                // as such: tests/faults.rs).
                self.finish_too_long(rx);
                Err(Stop::Violation(err))
            }
        }
    }

    /// The FPDU is complete and its CRC checked good: a consumed message is
    /// judged, then the message's effects are applied.
    fn on_fpdu_end(&self, rx: &mut RxState) -> Result<(), Stop> {
        // The payload is placed and its CRC checked: let go of its memory
        // now, not at the next FPDU (lent memory waits for it, see
        // `mr::LentRegion`).
        rx.dest.clear();
        let action = match rx.mode {
            Mode::Consume => self.check_consumed(rx).map_err(Stop::Violation)?,
            Mode::Place => std::mem::replace(&mut rx.action, Action::None),
        };
        self.apply(rx, action)?;
        rx.hdr_copy_len = 0;
        rx.rdmap_copy_len = 0;
        rx.seg_len = 0;
        Ok(())
    }

    /// Parses and checks a consumed message (Read Request, atomics,
    /// Immediate Data, Terminate).
    fn check_consumed(&self, rx: &mut RxState) -> Result<Action, TermError> {
        let (h, n) = (rx.hdr_copy_len, rx.consumed_len);
        let mut local = [0u8; MAX_COPIED_HDR + MAX_HEAD];
        local[..h].copy_from_slice(&rx.hdr_copy[..h]);
        local[h..h + n].copy_from_slice(&rx.consumed[..n]);
        let opcode = parse_control(rx.hdr_copy[1]).ok();
        if opcode == Some(Opcode::RdmaReadRequest) && n >= READ_REQUEST_HDR {
            rx.rdmap_copy
                .copy_from_slice(&rx.consumed[..READ_REQUEST_HDR]);
            rx.rdmap_copy_len = READ_REQUEST_HDR;
        }
        match UlpduRepr::parse(&local[..h + n]) {
            Ok(repr) => self.validate(rx, &repr, 0),
            Err(UlpduError::Body(_)) if opcode == Some(Opcode::AtomicRequest) => {
                Err(UNSUPPORTED_ATOMIC)
            }
            Err(e) => Err(e.term_error().unwrap_or(MALFORMED_HEADER)),
        }
    }

    /// Checks a segment and says where its payload goes.
    fn validate(
        &self,
        rx: &mut RxState,
        repr: &UlpduRepr<'_>,
        payload_len: usize,
    ) -> Result<Action, TermError> {
        let stags = self.device.stags();
        let pd = self.pd.id();
        if repr.opcode.payload_placement() == PayloadPlacement::Consumed {
            whole_message(repr)?;
        }
        match (repr.opcode, repr.address) {
            (Opcode::RdmaWrite, DdpAddress::Tagged { stag, to }) => {
                if self.proxy.get().is_some() {
                    let w = rx.write_open.get_or_insert(WriteTrack {
                        stag: stag.0,
                        to,
                        len: 0,
                        header: rx.hdr_copy,
                        header_len: rx.hdr_copy_len,
                    });
                    w.len += payload_len as u64;
                    if repr.last {
                        rx.last_write = rx.write_open.take();
                    }
                }
                if payload_len == 0 {
                    // A zero-length Write places nothing (RTR uses one).
                    return Ok(Action::None);
                }
                match stags.remote(stag.0, pd, Access::REMOTE_WRITE, to, payload_len as u64) {
                    Ok(t) => {
                        rx.dest.push((t.mem, t.offset, t.len));
                        Ok(Action::None)
                    }
                    Err(e) => Err(e.term_error(true)),
                }
            }
            (Opcode::RdmaReadResponse, DdpAddress::Tagged { stag, to }) => {
                let r = self.with_ord_front(|front| match front {
                    Some(o) => match &mut o.kind {
                        OutReadKind::Read { sink, progress } => {
                            let at = progress.accept(stag.0, to, payload_len, repr.last)?;
                            Ok((sink.mem.clone(), sink.offset + at, payload_len))
                        }
                        OutReadKind::Atomic { .. } => Err(TermError::RdmapUnexpectedOpcode),
                    },
                    None => Err(TermError::RdmapUnexpectedOpcode),
                });
                match r {
                    Ok(piece) => {
                        rx.dest.push(piece);
                        Ok(Action::ReadResponse { last: repr.last })
                    }
                    Err(e) => Err(e),
                }
            }
            (
                Opcode::Send
                | Opcode::SendWithInvalidate
                | Opcode::SendWithSolicitedEvent
                | Opcode::SendWithSolicitedEventAndInvalidate,
                DdpAddress::Untagged { qn, msn, mo },
            ) => {
                if qn.0 != 0 {
                    return Err(TermError::DdpUntaggedInvalidQn);
                }
                if msn != rx.expect[qi(QN_SEND)] {
                    return Err(TermError::DdpUntaggedMsnRange);
                }
                if rx.recv.is_none() {
                    if mo != 0 {
                        return Err(TermError::DdpUntaggedInvalidMo);
                    }
                    if rx.imm_wait.is_some() {
                        return Err(TermError::RdmapUnexpectedOpcode);
                    }
                    let Some(wqe) = self.pop_recv() else {
                        return Err(TermError::DdpUntaggedNoBuffer);
                    };
                    rx.recv = Some(RecvProgress {
                        fill: SendFill::new(msn, wqe.total_len),
                        wqe,
                        opcode: repr.opcode,
                        header: rx.hdr_copy,
                    });
                }
                let Some(r) = rx.recv.as_mut() else {
                    return Err(TermError::DdpLocalCatastrophic);
                };
                let at = match r.fill.accept(msn, mo, payload_len) {
                    Ok(at) => at,
                    Err(e) => {
                        if e == TermError::DdpUntaggedMessageTooLong {
                            // The receive is too small: once the CRC is
                            // checked it completes with a length error (not
                            // a flush), then the Terminate goes out.
                            rx.too_long = Some(r.wqe.wr_id);
                            rx.recv = None;
                        }
                        return Err(e);
                    }
                };
                let pieces = &mut rx.dest;
                let segs = &r.wqe.segs;
                scatter(segs.iter().map(|s| s.len), at, payload_len, |i, off, k| {
                    if let Some(s) = segs.get(i) {
                        pieces.push((s.mem.clone(), s.offset + off, k));
                    }
                });
                let imm_follows = rx.hdr_copy_len >= 6
                    && u32::from_be_bytes([
                        rx.hdr_copy[2],
                        rx.hdr_copy[3],
                        rx.hdr_copy[4],
                        rx.hdr_copy[5],
                    ]) == SEND_IMM_FOLLOWS
                    && !repr.opcode.has_invalidate_stag();
                Ok(Action::SendSegment {
                    last: repr.last,
                    solicited: repr.opcode.is_solicited(),
                    inv: repr.invalidate_stag.map(|s| s.0),
                    imm_follows,
                })
            }
            (
                Opcode::ImmediateData | Opcode::ImmediateDataWithSolicitedEvent,
                DdpAddress::Untagged { msn, .. },
            ) => {
                if msn != rx.expect[qi(QN_SEND)] || rx.recv.is_some() {
                    return Err(TermError::DdpUntaggedMsnRange);
                }
                let UlpduBody::Immediate(d) = repr.body else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                let imm = u32::try_from(d.as_be_u64() & 0xffff_ffff).unwrap_or(0);
                if rx.imm_wait.is_none() && self.srq.is_none() && self.rq_is_empty() {
                    return Err(TermError::DdpUntaggedNoBuffer);
                }
                Ok(Action::Immediate {
                    imm,
                    solicited: repr.opcode.is_solicited(),
                })
            }
            (Opcode::RdmaReadRequest, DdpAddress::Untagged { msn, .. }) => {
                let UlpduBody::ReadRequest(req) = repr.body else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                self.accept_inbound_request(rx, msn)?;
                let src = stags.remote(
                    req.src_stag.0,
                    pd,
                    Access::REMOTE_READ,
                    req.src_to,
                    u64::from(req.read_size),
                );
                match src {
                    Ok(t) => Ok(Action::ReadRequest(Response::Read {
                        src: t,
                        sink_stag: req.sink_stag.0,
                        sink_to: req.sink_to,
                    })),
                    Err(e) => {
                        self.release_ird();
                        Err(e.term_error(false))
                    }
                }
            }
            (Opcode::AtomicRequest, DdpAddress::Untagged { msn, .. }) => {
                let UlpduBody::AtomicRequest(req) = repr.body else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                self.accept_inbound_request(rx, msn)?;
                if req.to % 8 != 0 {
                    self.release_ird();
                    return Err(TermError::RdmapBaseOrBounds);
                }
                match stags.remote(req.stag.0, pd, Access::REMOTE_ATOMIC, req.to, 8) {
                    Ok(t) => Ok(Action::AtomicRequest(req, t)),
                    Err(e) => {
                        self.release_ird();
                        Err(e.term_error(false))
                    }
                }
            }
            (Opcode::AtomicResponse, DdpAddress::Untagged { msn, .. }) => {
                if msn != rx.expect[qi(QN_ATOMIC_RESPONSE)] {
                    return Err(TermError::DdpUntaggedMsnRange);
                }
                let UlpduBody::AtomicResponse(resp) = repr.body else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                let matches = self
                    .with_ord_front(|f| f.is_some_and(|o| o.answered_by_atomic(resp.request_id)));
                if !matches {
                    return Err(TermError::RdmapUnexpectedOpcode);
                }
                Ok(Action::AtomicResponse(resp))
            }
            (Opcode::Terminate, DdpAddress::Untagged { .. }) => {
                let UlpduBody::Terminate(t) = repr.body else {
                    return Err(TermError::RdmapUnexpectedOpcode);
                };
                Ok(Action::Terminate(t.code))
            }
            _ => Err(TermError::RdmapUnexpectedOpcode),
        }
    }

    /// The checks every inbound Read Request or Atomic Request passes
    /// (queue 1): its MSN is the next one, and an IRD slot is free (taken
    /// here; RFC 5041's "MSN out of range" when the peer exceeds our IRD).
    fn accept_inbound_request(&self, rx: &RxState, msn: Msn) -> Result<(), TermError> {
        if msn != rx.expect[qi(QN_READ_REQUEST)] || !self.take_ird() {
            return Err(TermError::DdpUntaggedMsnRange);
        }
        Ok(())
    }

    /// Payload of the current FPDU (`len` bytes, or fewer, wanted now).
    fn rx_payload(&self, rx: &mut RxState, len: usize) -> Result<(), Stop> {
        let avail = rx.avail();
        if avail == 0 {
            if len >= DIRECT_MIN && rx.mode == Mode::Place {
                return self.read_direct(rx, len);
            }
            return rx.fill();
        }
        let n = avail.min(len);
        let (s, e) = (rx.start, rx.start + n);
        match rx.mode {
            Mode::Consume => {
                let at = rx.consumed_len;
                let Some(dst) = rx.consumed.get_mut(at..at + n) else {
                    return Err(local_catastrophe());
                };
                dst.copy_from_slice(&rx.buf[s..e]);
                rx.consumed_len += n;
            }
            Mode::Place => {
                let mut at = s;
                while at < e {
                    let Some((mem, off, len)) = rx.dest.get(rx.dest_idx).cloned() else {
                        return Err(local_catastrophe());
                    };
                    let k = (len - rx.dest_off).min(e - at);
                    if !mem.copy_in(off + rx.dest_off, &rx.buf[at..at + k]) {
                        return Err(local_catastrophe());
                    }
                    at += k;
                    rx.dest_off += k;
                    if rx.dest_off == len {
                        rx.dest_idx += 1;
                        rx.dest_off = 0;
                    }
                }
            }
        }
        let h = rx
            .deframer
            .handle_payload(&rx.buf[s..e])
            .map_err(|e| deframe_stop(rx, e))?;
        rx.start += h.consumed;
        Ok(())
    }

    /// One `readv` of the rest of the payload (`left` bytes) straight into
    /// its destination plus read-ahead into the staging buffer.
    ///
    /// The payload's last byte is left to the read-ahead and placed by the
    /// staging copy once the `readv` has returned, so it lands after every
    /// other byte of the FPDU (the kernel's copy does not promise an order;
    /// see `Memory::copy_in`).
    fn read_direct(&self, rx: &mut RxState, left: usize) -> Result<(), Stop> {
        if rx.drained_hint {
            // See `RxState::fill`: the last read came back short.
            return Err(Stop::Drained);
        }
        rx.start = 0;
        rx.end = 0;
        rx.iov.clear();
        let direct = left - 1;
        let mut covered = 0usize;
        let mut idx = rx.dest_idx;
        let mut off = rx.dest_off;
        let mut pieces: [(usize, usize, usize); MAX_IOVECS] = [(0, 0, 0); MAX_IOVECS];
        let mut np = 0usize;
        while covered < direct && np < MAX_IOVECS - 1 {
            let Some((mem, moff, len)) = rx.dest.get(idx) else {
                return Err(local_catastrophe());
            };
            let k = (len - off).min(direct - covered);
            if !rx.iov.push_mem(mem, moff + off, k) {
                return Err(local_catastrophe());
            }
            pieces[np] = (idx, moff + off, k);
            np += 1;
            covered += k;
            off += k;
            if off == *len {
                idx += 1;
                off = 0;
            }
        }
        rx.iov.push_slice_mut(&mut rx.buf[..READAHEAD_LARGE]);
        let Some(stream) = rx.stream.as_ref() else {
            return Err(Stop::Dead);
        };
        let r = readv(stream.as_raw_fd(), &rx.iov);
        rx.iov.clear();
        let n = match r {
            Ok(0) => return Err(Stop::Closed { at_boundary: false }),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(Stop::Drained),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(()),
            Err(e) => return Err(Stop::Failed(e)),
        };
        rx.bytes_received += n as u64;
        // A short read on a stream socket emptied its buffer at that
        // moment: the next read would most likely say EAGAIN (as in
        // `RxState::fill`).
        rx.drained_hint = n < covered + READAHEAD_LARGE;
        let placed = n.min(covered);
        // Report the placed bytes by length; the CRC reads them from the
        // registered memory (through `sys`), never as a slice.
        let pieces = &pieces[..np];
        let dest = &rx.dest;
        let h = rx
            .deframer
            .handle_payload_by(placed, |crc, k| {
                let mut left = k;
                for &(idx, moff, len) in pieces {
                    if left == 0 {
                        break;
                    }
                    let t = len.min(left);
                    if let Some((mem, _, _)) = dest.get(idx) {
                        crc_update_mem(crc, mem, moff, t);
                    }
                    left -= t;
                }
            })
            .map_err(|e| deframe_stop(rx, e))?;
        // Advance the destination cursor.
        let mut left = h.consumed;
        while left > 0 {
            let Some((_, _, len)) = rx.dest.get(rx.dest_idx) else {
                return Err(local_catastrophe());
            };
            let t = (len - rx.dest_off).min(left);
            rx.dest_off += t;
            left -= t;
            if rx.dest_off == *len {
                rx.dest_idx += 1;
                rx.dest_off = 0;
            }
        }
        rx.end = n - placed;
        Ok(())
    }

    /// A receive too small for its Send completes with a length error (not
    /// a flush) before the Terminate goes out.
    fn finish_too_long(&self, rx: &mut RxState) {
        if let Some(wr_id) = rx.too_long.take() {
            self.complete_recv(
                WorkCompletion::error(wr_id, WcOpcode::Recv, self.qp_num, WcStatus::LocalLength),
                false,
            );
        }
    }

    /// Message-level effects of a complete, checked FPDU.
    fn apply(&self, rx: &mut RxState, action: Action) -> Result<(), Stop> {
        match action {
            Action::None => {}
            Action::SendSegment {
                last,
                solicited,
                inv,
                imm_follows,
            } => {
                if !last {
                    return Ok(());
                }
                rx.expect[qi(QN_SEND)] = rx.expect[qi(QN_SEND)].next();
                let Some(r) = rx.recv.take() else {
                    return Ok(());
                };
                if imm_follows {
                    rx.imm_wait = Some((r, solicited));
                    return Ok(());
                }
                let mut wc = WorkCompletion::success(r.wqe.wr_id, WcOpcode::Recv, self.qp_num);
                wc.byte_len = u32::try_from(r.fill.received).unwrap_or(u32::MAX);
                if solicited {
                    wc.flags = wc.flags | WcFlags::SOLICITED;
                }
                if let Some(stag) = inv {
                    if let Err(e) = self.device.stags().invalidate(stag, self.pd.id(), true) {
                        // Like siw: the receive reports the failure, and an
                        // STag of another PD is a protection error.
                        wc.status = WcStatus::RemoteInvalidRequest;
                        self.complete_recv(wc, solicited);
                        let err = match e {
                            crate::mr::InvalidateError::PdMismatch => {
                                TermError::RdmapProtectionCannotInvalidate
                            }
                            _ => TermError::RdmapOperationCannotInvalidate,
                        };
                        return Err(Stop::Violation(err));
                    }
                    wc.flags = wc.flags | WcFlags::WITH_INV;
                    wc.invalidated_rkey = stag;
                }
                match self.proxy.get() {
                    Some(link) => link.on_message(
                        self,
                        wc,
                        solicited,
                        MsgMeta::send(r.opcode, r.header, r.wqe.segs.into_vec(), inv),
                    ),
                    None => self.complete_recv(wc, solicited),
                }
            }
            Action::Immediate { imm, solicited } => {
                rx.expect[qi(QN_SEND)] = rx.expect[qi(QN_SEND)].next();
                let (wc, sol, meta) = match rx.imm_wait.take() {
                    Some((r, s)) => {
                        let mut wc =
                            WorkCompletion::success(r.wqe.wr_id, WcOpcode::Recv, self.qp_num);
                        wc.byte_len = u32::try_from(r.fill.received).unwrap_or(u32::MAX);
                        (
                            wc,
                            s || solicited,
                            MsgMeta::send(r.opcode, r.header, r.wqe.segs.into_vec(), None),
                        )
                    }
                    None => match self.pop_recv() {
                        Some(w) => {
                            let wc = WorkCompletion::success(
                                w.wr_id,
                                WcOpcode::RecvRdmaWithImm,
                                self.qp_num,
                            );
                            let meta = rx.last_write.take().map(|t| {
                                MsgMeta::write(t.stag, t.to, t.len, &t.header[..t.header_len])
                            });
                            (wc, solicited, meta.unwrap_or_else(MsgMeta::empty_write))
                        }
                        None => {
                            return Err(Stop::Violation(TermError::DdpUntaggedNoBuffer));
                        }
                    },
                };
                let mut wc = wc;
                wc.imm_data = imm;
                wc.flags = WcFlags::WITH_IMM;
                if sol {
                    wc.flags = wc.flags | WcFlags::SOLICITED;
                }
                match self.proxy.get() {
                    Some(link) => link.on_message(self, wc, sol, meta.with_imm(imm)),
                    None => self.complete_recv(wc, sol),
                }
            }
            Action::ReadResponse { last } => {
                if last {
                    if let Some(o) = self.pop_ord() {
                        let len = o.read_len();
                        self.complete_sq(
                            o.seq,
                            WcStatus::Success,
                            u32::try_from(len).unwrap_or(u32::MAX),
                            0,
                        );
                    }
                    self.kick();
                }
            }
            Action::ReadRequest(resp) => {
                rx.expect[qi(QN_READ_REQUEST)] = rx.expect[qi(QN_READ_REQUEST)].next();
                self.queue_response(resp);
            }
            Action::AtomicRequest(req, target) => {
                rx.expect[qi(QN_READ_REQUEST)] = rx.expect[qi(QN_READ_REQUEST)].next();
                let Some(cell) = target.mem.atomic_u64(target.offset) else {
                    self.release_ird();
                    return Err(Stop::Violation(TermError::RdmapBaseOrBounds));
                };
                let original = crate::mr::execute_atomic(cell, &req);
                self.queue_response(Response::Atomic(AtomicResponseRepr {
                    request_id: req.request_id,
                    original_value: original,
                }));
            }
            Action::AtomicResponse(resp) => {
                rx.expect[qi(QN_ATOMIC_RESPONSE)] = rx.expect[qi(QN_ATOMIC_RESPONSE)].next();
                if let Some(o) = self.pop_ord() {
                    if let OutReadKind::Atomic { sink, .. } = &o.kind {
                        sink.mem
                            .copy_in(sink.offset, &resp.original_value.to_ne_bytes());
                    }
                    self.complete_sq(o.seq, WcStatus::Success, 8, 0);
                }
                self.kick();
            }
            Action::Terminate(code) => {
                rx.expect[qi(QN_TERMINATE)] = rx.expect[qi(QN_TERMINATE)].next();
                rx.stream = None;
                self.flush_partial(rx);
                self.terminated_by_peer(code);
                return Err(Stop::Dead);
            }
        }
        Ok(())
    }

    /// Queues a response and sends it from here if the transmit path is
    /// free (direct sending from the receive context).
    fn queue_response(&self, resp: Response) {
        {
            let mut tx = self.lock_tx();
            tx.resp.push_back(resp);
        }
        self.kick();
    }

    /// Bytes counted so far by the receive path.
    #[allow(dead_code)]
    pub(crate) fn rx_bytes(&self) -> u64 {
        self.rx.lock().bytes_received
    }

    /// Whether the QP is receiving.
    #[allow(dead_code)]
    pub(crate) fn rx_active(&self) -> bool {
        self.rx_registered.load(Ordering::Relaxed)
    }
}

/// RFC 5040 section 5 / RFC 7306: a Read Request, an Atomic Request or
/// Response, Immediate Data and a Terminate are each one whole DDP message
/// on their own queue: the right QN, MO 0 and the Last flag set.
fn whole_message(repr: &UlpduRepr<'_>) -> Result<(), TermError> {
    let DdpAddress::Untagged { qn, mo, .. } = repr.address else {
        return Err(TermError::RdmapUnexpectedOpcode);
    };
    if repr.opcode.queue_number() != Some(qn) {
        return Err(TermError::DdpUntaggedInvalidQn);
    }
    if mo != 0 {
        return Err(TermError::DdpUntaggedInvalidMo);
    }
    if !repr.last {
        return Err(MALFORMED_HEADER);
    }
    Ok(())
}

/// A destination checked at header time turned out unusable: cannot happen
/// unless the engine's own bookkeeping is wrong; the QP is failed rather
/// than touching memory.
fn local_catastrophe() -> Stop {
    Stop::Violation(TermError::DdpLocalCatastrophic)
}

/// The deframer refused the stream: a CRC error, or a ULPDU length that
/// cannot be framed (nothing of its header is copied into the Terminate).
fn deframe_stop(rx: &mut RxState, e: DeframeError) -> Stop {
    match e {
        DeframeError::CrcMismatch { .. } => Stop::Violation(TermError::MpaCrcError),
        DeframeError::BadMarker { .. } => Stop::Violation(TermError::MpaMarkerMismatch),
        // The ULPDU cannot hold its DDP header: a Terminate, not a bare
        // reset.
        DeframeError::UlpduTooShort { .. } | DeframeError::UlpduTooLong { .. } => {
            rx.hdr_copy_len = 0;
            rx.rdmap_copy_len = 0;
            Stop::Violation(MALFORMED_HEADER)
        }
        _ => local_catastrophe(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};

    /// A QP closed gracefully (IDLE) keeps its receive state; connected
    /// again, every queue's expected MSN must start afresh (the Atomic
    /// Response and Terminate queues too, not only the two the
    /// negotiation names), and nothing of the last connection's Writes is
    /// reported to a proxy filter.
    #[test]
    fn attach_after_a_closed_connection_starts_every_msn_afresh() {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let s = Arc::new(TcpStream::connect(l.local_addr().unwrap()).unwrap());
        let mut rx = RxState::new();
        rx.attach(s.clone(), false, Msn::INITIAL, Msn::INITIAL, &[]);
        // The first connection received messages on every queue.
        for e in &mut rx.expect {
            *e = e.next().next();
        }
        let w = WriteTrack {
            stag: 1,
            to: 0,
            len: 8,
            header: [0; MAX_COPIED_HDR],
            header_len: 14,
        };
        rx.write_open = Some(w);
        rx.last_write = Some(w);
        rx.detach();
        rx.attach(s, true, Msn(7), Msn(9), &[]);
        assert_eq!(
            rx.expect,
            [Msn(7), Msn(9), Msn::INITIAL, Msn::INITIAL],
            "expected MSNs per queue"
        );
        assert!(rx.write_open.is_none() && rx.last_write.is_none());
    }
}
