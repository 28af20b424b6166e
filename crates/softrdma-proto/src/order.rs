//! Ordering rules shared by the protocol core and the engine: completion
//! order ([`InOrder`]), outbound Reads and atomics against the ORD
//! ([`Outstanding`]) with the Read Response check ([`ReadSink`]),
//! inbound ones against the IRD ([`Credits`]), and the segments of a Send
//! filling a receive ([`SendFill`], [`scatter`]).
//!
//! Completion order: requests complete in the order they were posted, even
//! when their outcomes are known out of order (a Write is done when its
//! last FPDU is written, a Read when its response arrives, a flush at any
//! time).
//!
//! Each posted request takes the next sequence number and a slot
//! ([`InOrder::push`]); recording an outcome fills the slot once
//! ([`InOrder::complete`]: a later outcome for the same request is
//! ignored); the filled slots at the front are then delivered in order
//! ([`InOrder::pop_ready`]). [`crate::conn::Connection`] keeps its
//! send-queue slots in one, and so does the engine's QP (under one lock,
//! delivering under it: completions reach the CQ in posting order and
//! exactly once; the engine's loom model checks that against concurrent
//! completers and a concurrent flush).

use std::collections::VecDeque;

use softrdma_wire::ddp::Msn;
use softrdma_wire::errcode::TermError;

/// Slots in posting order; `T` is what a slot holds (the request's
/// identity and, once known, its outcome).
#[derive(Debug, Clone)]
pub struct InOrder<T> {
    slots: VecDeque<(T, bool)>,
    /// Sequence number of `slots[0]`.
    base: u64,
}

impl<T> Default for InOrder<T> {
    fn default() -> Self {
        InOrder {
            slots: VecDeque::new(),
            base: 0,
        }
    }
}

impl<T> InOrder<T> {
    /// No slots; the first [`push`](Self::push) gets sequence number 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next slot; returns its sequence number.
    pub fn push(&mut self, item: T) -> u64 {
        let seq = self.base + self.slots.len() as u64;
        self.slots.push_back((item, false));
        seq
    }

    /// Records the outcome of `seq` with `fill` unless it has one already
    /// or was delivered; `true` if recorded.
    pub fn complete(&mut self, seq: u64, fill: impl FnOnce(&mut T)) -> bool {
        let Some(idx) = seq
            .checked_sub(self.base)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return false;
        };
        match self.slots.get_mut(idx) {
            Some((item, done)) if !*done => {
                fill(item);
                *done = true;
                true
            }
            _ => false,
        }
    }

    /// The oldest slot, if its outcome is recorded: it is delivered now
    /// (and leaves the queue).
    pub fn pop_ready(&mut self) -> Option<T> {
        if !self.slots.front().is_some_and(|(_, done)| *done) {
            return None;
        }
        self.base += 1;
        self.slots.pop_front().map(|(item, _)| item)
    }

    /// Sequence numbers of the slots without an outcome, oldest first.
    #[must_use]
    pub fn open(&self) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (_, done))| !*done)
            .map(|(i, _)| self.base + i as u64)
            .collect()
    }

    /// Slots not yet delivered (with or without an outcome).
    #[must_use]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// No slot waits for delivery.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

/// Outbound RDMA Reads and atomics sent and not yet answered (the ORD
/// queue), oldest first, with the limit the connection settled: our ORD
/// min'ed with the peer's IRD (RFC 5040 section 6.4, RFC 6581).
///
/// Responses arrive in request order, so the front is the request the
/// next Read Response, Atomic Response or Terminate answers.
#[derive(Debug, Clone)]
pub struct Outstanding<T> {
    q: VecDeque<T>,
    limit: u32,
}

impl<T> Outstanding<T> {
    /// Empty, at most `limit` outstanding.
    #[must_use]
    pub fn new(limit: u32) -> Self {
        Outstanding {
            q: VecDeque::new(),
            limit,
        }
    }

    /// How many may be outstanding at once.
    #[must_use]
    pub const fn limit(&self) -> u32 {
        self.limit
    }

    /// Changes the limit (a new connection settled another one).
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// Whether the send queue's head may go out now: a fenced request
    /// waits until every earlier Read and atomic is answered; a Read or
    /// atomic (`takes_slot`) waits for a free slot.
    #[must_use]
    pub fn may_start(&self, fenced: bool, takes_slot: bool) -> bool {
        let n = self.q.len();
        let fence_waits = fenced && n > 0;
        let no_slot = takes_slot && n >= self.limit as usize;
        !fence_waits && !no_slot
    }

    /// A Read or atomic request went out: it waits for its answer.
    pub fn push(&mut self, item: T) {
        self.q.push_back(item);
    }

    /// The oldest outstanding request: the one the next answer is for.
    #[must_use]
    pub fn front(&self) -> Option<&T> {
        self.q.front()
    }

    /// The oldest outstanding request, to record a partial answer.
    pub fn front_mut(&mut self) -> Option<&mut T> {
        self.q.front_mut()
    }

    /// Removes the oldest outstanding request (answered, or failed).
    pub fn pop_front(&mut self) -> Option<T> {
        self.q.pop_front()
    }

    /// Removes every outstanding request, oldest first (flush).
    pub fn drain(&mut self) -> std::collections::vec_deque::Drain<'_, T> {
        self.q.drain(..)
    }

    /// Requests outstanding.
    #[must_use]
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// None outstanding.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// An outstanding outbound RDMA Read or atomic (an entry of the ORD
/// queue, [`Outstanding`]): its send-queue sequence number
/// ([`InOrder::push`]) and what its answer fills. `S` is the caller's
/// handle of the local sink (the core's `Span`, the engine's segment).
#[derive(Debug, Clone)]
pub struct OutRead<S> {
    /// Sequence number of the request in the send queue's completion order.
    pub seq: u64,
    /// Read or atomic, and its sink.
    pub kind: OutKind<S>,
}

/// What an [`OutRead`] waits for.
#[derive(Debug, Clone)]
pub enum OutKind<S> {
    /// An RDMA Read: Read Response segments fill `sink`.
    Read {
        /// Where the data goes.
        sink: S,
        /// The response's progress and checks.
        progress: ReadSink,
    },
    /// An atomic: the Atomic Response with `request_id` carries the
    /// original value, written to `sink` (8 bytes).
    Atomic {
        /// The request's identifier (RFC 7306).
        request_id: u32,
        /// Where the original value goes.
        sink: S,
    },
}

impl<S> OutRead<S> {
    /// Whether an Atomic Response for `request_id` answers this request
    /// (the oldest outstanding): a Read, or another atomic, is RDMAP
    /// "Unexpected OpCode" for the peer.
    #[must_use]
    pub fn answered_by_atomic(&self, request_id: u32) -> bool {
        matches!(self.kind, OutKind::Atomic { request_id: r, .. } if r == request_id)
    }

    /// The byte count of the request's completion when the last segment
    /// of a Read Response answers it: the bytes the Read received.
    #[must_use]
    pub fn read_len(&self) -> usize {
        match &self.kind {
            OutKind::Read { progress, .. } => progress.got,
            OutKind::Atomic { .. } => 0,
        }
    }
}

/// The local sink of an outstanding RDMA Read and how much of it the Read
/// Response has filled: the segments of a Read Response must arrive in
/// order, name the sink's STag and fill it exactly (RFC 5040 section
/// 4.4, RFC 5041 section 7.1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadSink {
    /// The sink's STag (the Read Request's Data Sink STag).
    pub stag: u32,
    /// The sink's tagged offset.
    pub to: u64,
    /// The sink's length (the Read Request's RDMA Read Message Size).
    pub len: usize,
    /// Bytes of the response received so far.
    pub got: usize,
}

impl ReadSink {
    /// Nothing received yet.
    #[must_use]
    pub const fn new(stag: u32, to: u64, len: usize) -> Self {
        ReadSink {
            stag,
            to,
            len,
            got: 0,
        }
    }

    /// Accepts a Read Response segment of `len` payload bytes for
    /// `(stag, to)`, the last one if `last`: returns the offset in the sink
    /// where its payload goes and counts it. Refused (nothing counted)
    /// with DDP "Invalid STag" for another STag and "Base or bounds
    /// violation" for a segment out of order, beyond the sink, or a last
    /// segment that leaves the sink short.
    ///
    /// # Errors
    ///
    /// The Terminate error for the peer.
    pub fn accept(
        &mut self,
        stag: u32,
        to: u64,
        len: usize,
        last: bool,
    ) -> Result<usize, TermError> {
        if stag != self.stag {
            return Err(TermError::DdpTaggedInvalidStag);
        }
        let end = self.got.checked_add(len);
        if to != self.to.wrapping_add(self.got as u64)
            || end.is_none_or(|e| e > self.len)
            || (last && end != Some(self.len))
        {
            return Err(TermError::DdpTaggedBaseOrBounds);
        }
        let at = self.got;
        self.got += len;
        Ok(at)
    }
}

/// A posted receive being filled by a Send (of one or more segments):
/// the Send's MSN and the bytes received so far. Every segment of an
/// untagged message carries the message's MSN and its Message Offset
/// (RFC 5041 section 5.1): they must continue the message in order and
/// stay within the receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SendFill {
    /// MSN of the Send (its first segment's).
    pub msn: Msn,
    /// The receive's length (all its buffers).
    pub total: usize,
    /// Bytes of the Send received so far.
    pub received: usize,
}

impl SendFill {
    /// A receive of `total` bytes taken for the Send with this MSN.
    #[must_use]
    pub const fn new(msn: Msn, total: usize) -> Self {
        SendFill {
            msn,
            total,
            received: 0,
        }
    }

    /// Accepts a segment with `(msn, mo)` and `len` payload bytes: returns
    /// the offset in the receive where its payload goes and counts it.
    /// Refused (nothing counted) with DDP "Invalid MO" if it does not
    /// continue the message, "Message too long" if it overflows the
    /// receive (which then completes with a length error).
    ///
    /// # Errors
    ///
    /// The Terminate error for the peer.
    pub fn accept(&mut self, msn: Msn, mo: u32, len: usize) -> Result<usize, TermError> {
        if msn != self.msn || usize::try_from(mo).ok() != Some(self.received) {
            return Err(TermError::DdpUntaggedInvalidMo);
        }
        if self
            .received
            .checked_add(len)
            .is_none_or(|e| e > self.total)
        {
            return Err(TermError::DdpUntaggedMessageTooLong);
        }
        let at = self.received;
        self.received += len;
        Ok(at)
    }
}

/// Where the bytes `[off, off + len)` of a buffer made of segments of
/// `seg_lens` (in order) are: calls `f(segment index, offset in that
/// segment, length)` for each piece, in order. Bytes beyond the segments
/// are not reported (callers check the bounds first, e.g. with
/// [`SendFill::accept`]).
pub fn scatter(
    seg_lens: impl IntoIterator<Item = usize>,
    off: usize,
    len: usize,
    mut f: impl FnMut(usize, usize, usize),
) {
    let mut off = off;
    let mut left = len;
    for (i, seg) in seg_lens.into_iter().enumerate() {
        if left == 0 {
            break;
        }
        if off >= seg {
            off -= seg;
            continue;
        }
        let k = (seg - off).min(left);
        f(i, off, k);
        left -= k;
        off = 0;
    }
}

/// Inbound RDMA Reads and atomics accepted and not yet answered, against
/// our IRD. A request beyond the IRD is the peer's error: RFC 5041's
/// "MSN range is not valid" (the request's MSN is outside the window the
/// IRD opens).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Credits {
    used: u32,
    limit: u32,
}

impl Credits {
    /// None used, `limit` available.
    #[must_use]
    pub const fn new(limit: u32) -> Self {
        Credits { used: 0, limit }
    }

    /// The IRD.
    #[must_use]
    pub const fn limit(&self) -> u32 {
        self.limit
    }

    /// Changes the IRD (before a connection).
    pub fn set_limit(&mut self, limit: u32) {
        self.limit = limit;
    }

    /// Accepted and not yet answered.
    #[must_use]
    pub const fn used(&self) -> u32 {
        self.used
    }

    /// Another request may be accepted now.
    #[must_use]
    pub const fn has_room(&self) -> bool {
        self.used < self.limit
    }

    /// Accepts a request; `false` (nothing taken) if all are in use.
    pub fn take(&mut self) -> bool {
        let ok = self.has_room();
        if ok {
            self.used += 1;
        }
        ok
    }

    /// A response's last FPDU is handed out: its slot is free.
    pub fn release(&mut self) {
        self.used = self.used.saturating_sub(1);
    }

    /// Forgets every accepted request (the connection ended).
    pub fn reset(&mut self) {
        self.used = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fence_waits_for_every_outstanding_request_and_reads_for_a_slot() {
        let mut o = Outstanding::new(2);
        assert!(o.may_start(true, true), "nothing outstanding");
        o.push('a');
        assert!(!o.may_start(true, false), "fenced behind a Read");
        assert!(o.may_start(false, true), "one of two slots used");
        assert!(o.may_start(false, false));
        o.push('b');
        assert!(!o.may_start(false, true), "ORD reached");
        assert!(o.may_start(false, false), "a Write needs no slot");
        assert_eq!(o.front(), Some(&'a'));
        *o.front_mut().unwrap() = 'c';
        assert_eq!(o.pop_front(), Some('c'));
        assert!(o.may_start(false, true));
        o.set_limit(1);
        assert!(!o.may_start(false, true), "the new limit counts");
        assert_eq!(o.drain().collect::<Vec<_>>(), ['b']);
        assert!(o.is_empty());
        assert!(o.may_start(true, true));
    }

    #[test]
    fn read_response_segments_fill_the_sink_in_order_and_exactly() {
        let mut r = ReadSink::new(7, 1000, 10);
        assert_eq!(
            r.accept(8, 1000, 4, false),
            Err(TermError::DdpTaggedInvalidStag)
        );
        assert_eq!(
            r.accept(7, 1001, 4, false),
            Err(TermError::DdpTaggedBaseOrBounds),
            "out of order"
        );
        assert_eq!(r.accept(7, 1000, 4, false), Ok(0));
        assert_eq!(
            r.accept(7, 1004, 7, false),
            Err(TermError::DdpTaggedBaseOrBounds),
            "beyond the sink"
        );
        assert_eq!(
            r.accept(7, 1004, 4, true),
            Err(TermError::DdpTaggedBaseOrBounds),
            "last leaves it short"
        );
        assert_eq!(r.got, 4, "refused segments are not counted");
        assert_eq!(r.accept(7, 1004, 0, false), Ok(4));
        assert_eq!(r.accept(7, 1004, 6, true), Ok(4));
        assert_eq!(r.got, 10);
        let mut z = ReadSink::new(1, u64::MAX, 2);
        assert_eq!(z.accept(1, u64::MAX, 1, false), Ok(0));
        assert_eq!(
            z.accept(1, 0, 1, true),
            Ok(1),
            "the tagged offset wraps like the sender's"
        );
        assert_eq!(
            ReadSink::new(1, 0, 0).accept(1, 0, usize::MAX, true),
            Err(TermError::DdpTaggedBaseOrBounds)
        );
    }

    #[test]
    fn send_segments_continue_the_message_within_the_receive() {
        let mut f = SendFill::new(Msn(5), 10);
        assert_eq!(
            f.accept(Msn(6), 0, 4),
            Err(TermError::DdpUntaggedInvalidMo),
            "another message"
        );
        assert_eq!(
            f.accept(Msn(5), 1, 4),
            Err(TermError::DdpUntaggedInvalidMo),
            "a gap"
        );
        assert_eq!(f.accept(Msn(5), 0, 4), Ok(0));
        assert_eq!(
            f.accept(Msn(5), 4, 7),
            Err(TermError::DdpUntaggedMessageTooLong)
        );
        assert_eq!(f.received, 4, "refused segments are not counted");
        assert_eq!(f.accept(Msn(5), 4, 6), Ok(4));
        assert_eq!(
            f.accept(Msn(5), 10, 0),
            Ok(10),
            "an empty segment at the end fits"
        );
        assert_eq!(
            f.accept(Msn(5), 10, usize::MAX),
            Err(TermError::DdpUntaggedMessageTooLong)
        );
    }

    #[test]
    fn scatter_splits_a_range_over_the_segments() {
        let mut v = Vec::new();
        scatter([4, 0, 3, 5], 2, 7, |i, o, k| v.push((i, o, k)));
        assert_eq!(v, [(0, 2, 2), (2, 0, 3), (3, 0, 2)]);
        v.clear();
        scatter([4, 3], 5, 2, |i, o, k| v.push((i, o, k)));
        assert_eq!(v, [(1, 1, 2)]);
        v.clear();
        scatter([4, 3], 0, 0, |i, o, k| v.push((i, o, k)));
        assert!(v.is_empty(), "nothing to place");
        scatter([2], 1, 5, |i, o, k| v.push((i, o, k)));
        assert_eq!(v, [(0, 1, 1)], "bytes beyond the segments are not reported");
    }

    #[test]
    fn an_atomic_response_answers_only_its_atomic() {
        let a = OutRead {
            seq: 3,
            kind: OutKind::Atomic {
                request_id: 9,
                sink: (),
            },
        };
        assert!(a.answered_by_atomic(9));
        assert!(!a.answered_by_atomic(8));
        assert_eq!(a.read_len(), 0);
        let mut r = OutRead {
            seq: 4,
            kind: OutKind::Read {
                sink: (),
                progress: ReadSink::new(1, 0, 6),
            },
        };
        assert!(
            !r.answered_by_atomic(9),
            "a Read is not answered by an atomic"
        );
        if let OutKind::Read { progress, .. } = &mut r.kind {
            progress.accept(1, 0, 6, true).unwrap();
        }
        assert_eq!(r.read_len(), 6);
    }

    #[test]
    fn credits_are_taken_up_to_the_limit_and_released() {
        let mut c = Credits::new(2);
        assert!(c.take());
        assert!(c.take());
        assert!(!c.has_room());
        assert!(!c.take(), "the IRD is exceeded");
        assert_eq!(c.used(), 2);
        c.release();
        assert!(c.take());
        c.reset();
        assert_eq!(c.used(), 0);
        c.release();
        assert_eq!(c.used(), 0, "release never underflows");
        c.set_limit(0);
        assert!(!c.take());
    }

    #[test]
    fn out_of_order_outcomes_are_delivered_in_order_once() {
        let mut q = InOrder::default();
        let s: Vec<u64> = (0..3).map(|i| q.push(i * 10)).collect();
        assert_eq!(s, [0, 1, 2]);
        assert_eq!(q.len(), 3);
        assert!(q.complete(2, |v| *v += 2));
        assert_eq!(q.pop_ready(), None);
        assert!(q.complete(0, |v| *v += 1));
        assert!(!q.complete(0, |v| *v += 100), "second outcome ignored");
        assert_eq!(q.pop_ready(), Some(1));
        assert_eq!(q.pop_ready(), None);
        assert_eq!(q.open(), [1]);
        assert!(q.complete(1, |_| {}));
        assert_eq!(q.pop_ready(), Some(10));
        assert_eq!(q.pop_ready(), Some(22));
        assert!(q.is_empty());
        assert!(!q.complete(1, |_| {}), "delivered slots are gone");
        assert!(!q.complete(9, |_| {}), "never-pushed slots are ignored");
        assert_eq!(q.push(7), 3);
    }
}
