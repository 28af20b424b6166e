//! Proxy offload rules: which incoming messages a proxy thread serves, and
//! the order in which completions reach the application.
//!
//! A *proxy QP* hands some incoming messages (Sends and RDMA Writes with
//! Immediate Data — the messages that consume a posted receive and would wake
//! the application) to a handler running on a dedicated proxy thread. This
//! module holds the deterministic parts of that mechanism; the engine's
//! `proxy` module supplies the thread, the memory access and the clock.
//!
//! * [`ProxyFilter`]: a small table of [`FilterEntry`]s, each a conjunction
//!   of [`Criterion`]s (RDMAP opcode, payload size, STag range, Tagged Offset
//!   range, value-and-mask over header or payload bytes, like a TCAM entry),
//!   plus a [`MatchPolicy`] saying whether matching messages go to the proxy
//!   or stay with the application.
//! * [`Sequencer`]: the reorder buffer that lets completions out strictly in
//!   the order they were produced even when the proxy finishes an offloaded
//!   message later than the application path finishes the ones after it.
//! * [`LoadGuard`]: the switch to *no-offload mode* when the proxy's queue
//!   exceeds its configured depth, and back once the proxy has caught up.

use std::collections::VecDeque;

use softrdma_wire::rdmap::Opcode;

/// Most bytes a value-and-mask criterion may cover.
pub const MAX_MATCH_BYTES: usize = 64;

/// What a filter sees of one incoming message, once it has fully arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MessageView<'a> {
    /// RDMAP opcode of the message that carried the data: one of the Send
    /// variants, or [`Opcode::RdmaWrite`] for an RDMA Write with Immediate
    /// Data.
    pub opcode: Opcode,
    /// Payload length in bytes (the bytes received for a Send, the bytes
    /// written for a Write with Immediate Data).
    pub len: u64,
    /// The message's STag: the Write's STag, or the STag a Send with
    /// Invalidate names; `None` for other Sends.
    pub stag: Option<u32>,
    /// The Tagged Offset a Write with Immediate Data started at.
    pub to: Option<u64>,
    /// The DDP/RDMAP header of the message's first segment as received (14
    /// bytes tagged, 18 untagged; without the MPA length field).
    pub header: &'a [u8],
    /// The first bytes of the payload: at least
    /// [`ProxyFilter::payload_prefix_len`] bytes, or the whole payload if it
    /// is shorter.
    pub payload: &'a [u8],
}

/// Which bytes a value-and-mask criterion looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Field {
    /// The DDP/RDMAP header ([`MessageView::header`]).
    Header,
    /// The payload ([`MessageView::payload`]).
    Payload,
}

/// A set of RDMAP opcodes (bit `n` = opcode value `n`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OpcodeSet(u16);

impl OpcodeSet {
    /// No opcode.
    pub const EMPTY: OpcodeSet = OpcodeSet(0);

    /// The set holding these opcodes.
    pub fn of(opcodes: &[Opcode]) -> OpcodeSet {
        opcodes.iter().fold(OpcodeSet::EMPTY, |s, &o| s.with(o))
    }

    /// This set plus `opcode`.
    #[must_use]
    pub const fn with(self, opcode: Opcode) -> OpcodeSet {
        OpcodeSet(self.0 | 1 << (opcode as u8))
    }

    /// Whether `opcode` is in the set.
    pub const fn contains(self, opcode: Opcode) -> bool {
        self.0 & (1 << (opcode as u8)) != 0
    }
}

/// One condition on a message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Criterion {
    /// The message's RDMAP opcode is in the set.
    Opcode(OpcodeSet),
    /// The payload is at least `min` and at most `max` bytes long.
    PayloadLen {
        /// Shortest matching payload.
        min: u64,
        /// Longest matching payload.
        max: u64,
    },
    /// The message carries an STag in `first..=last` (the Write's STag or a
    /// Send with Invalidate's STag). Messages without one never match.
    Stag {
        /// Lowest matching STag.
        first: u32,
        /// Highest matching STag.
        last: u32,
    },
    /// The Write with Immediate Data covers only Tagged Offsets in
    /// `first..=last` (start and end of the written range). Messages without
    /// a Tagged Offset never match.
    Address {
        /// Lowest matching address.
        first: u64,
        /// Highest matching address.
        last: u64,
    },
    /// Value and mask over `value.len()` bytes of the header or payload
    /// starting at `offset`: the message matches when
    /// `byte & mask == value & mask` for every byte. Bits under a zero mask
    /// are ignored, so are bytes beyond the end of the message whose mask is
    /// zero; a byte beyond the end with a non-zero mask never matches.
    Ternary(Ternary),
}

/// A value-and-mask match (see [`Criterion::Ternary`]); build it with
/// [`Ternary::new`], which checks its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ternary {
    field: Field,
    offset: usize,
    value: Vec<u8>,
    mask: Vec<u8>,
}

/// A filter that cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FilterError {
    /// Value and mask differ in length.
    #[error("value is {value} bytes but mask is {mask} bytes")]
    MaskLength {
        /// Length of the value.
        value: usize,
        /// Length of the mask.
        mask: usize,
    },
    /// The match would reach past [`MAX_MATCH_BYTES`].
    #[error("a value-and-mask match may cover at most the first {max} bytes (asked for {end})")]
    TooLong {
        /// End of the covered bytes.
        end: usize,
        /// The limit.
        max: usize,
    },
    /// A range whose start lies after its end.
    #[error("empty range: {first} > {last}")]
    EmptyRange {
        /// Start.
        first: u64,
        /// End.
        last: u64,
    },
}

impl Ternary {
    /// `value`/`mask` over the bytes of `field` from `offset`.
    pub fn new(
        field: Field,
        offset: usize,
        value: &[u8],
        mask: &[u8],
    ) -> Result<Ternary, FilterError> {
        if value.len() != mask.len() {
            return Err(FilterError::MaskLength {
                value: value.len(),
                mask: mask.len(),
            });
        }
        let end = offset.saturating_add(value.len());
        if end > MAX_MATCH_BYTES {
            return Err(FilterError::TooLong {
                end,
                max: MAX_MATCH_BYTES,
            });
        }
        Ok(Ternary {
            field,
            offset,
            value: value.to_vec(),
            mask: mask.to_vec(),
        })
    }

    /// Which bytes are compared.
    pub fn field(&self) -> Field {
        self.field
    }

    /// One past the last byte compared.
    pub fn end(&self) -> usize {
        self.offset + self.value.len()
    }

    fn matches(&self, bytes: &[u8]) -> bool {
        self.value
            .iter()
            .zip(&self.mask)
            .enumerate()
            .all(|(i, (&v, &m))| match bytes.get(self.offset + i) {
                Some(&b) => b & m == v & m,
                None => m == 0,
            })
    }
}

impl Criterion {
    /// Messages of one of these opcodes.
    pub fn opcodes(opcodes: &[Opcode]) -> Criterion {
        Criterion::Opcode(OpcodeSet::of(opcodes))
    }

    /// Payloads of at most `max` bytes.
    pub fn payload_at_most(max: u64) -> Criterion {
        Criterion::PayloadLen { min: 0, max }
    }

    /// Payloads of at least `min` bytes.
    pub fn payload_at_least(min: u64) -> Criterion {
        Criterion::PayloadLen { min, max: u64::MAX }
    }

    /// STags in `first..=last`.
    pub fn stags(first: u32, last: u32) -> Result<Criterion, FilterError> {
        if first > last {
            return Err(FilterError::EmptyRange {
                first: first.into(),
                last: last.into(),
            });
        }
        Ok(Criterion::Stag { first, last })
    }

    /// Tagged Offsets in `first..=last`.
    pub fn addresses(first: u64, last: u64) -> Result<Criterion, FilterError> {
        if first > last {
            return Err(FilterError::EmptyRange { first, last });
        }
        Ok(Criterion::Address { first, last })
    }

    /// Value and mask over header or payload bytes (see [`Ternary::new`]).
    pub fn ternary(
        field: Field,
        offset: usize,
        value: &[u8],
        mask: &[u8],
    ) -> Result<Criterion, FilterError> {
        Ternary::new(field, offset, value, mask).map(Criterion::Ternary)
    }

    /// Whether `msg` satisfies this criterion.
    pub fn matches(&self, msg: &MessageView<'_>) -> bool {
        match self {
            Criterion::Opcode(set) => set.contains(msg.opcode),
            Criterion::PayloadLen { min, max } => (*min..=*max).contains(&msg.len),
            Criterion::Stag { first, last } => {
                msg.stag.is_some_and(|s| (*first..=*last).contains(&s))
            }
            Criterion::Address { first, last } => msg.to.is_some_and(|to| {
                let end = to.saturating_add(msg.len.saturating_sub(1));
                to >= *first && end <= *last
            }),
            Criterion::Ternary(t) => t.matches(match t.field {
                Field::Header => msg.header,
                Field::Payload => msg.payload,
            }),
        }
    }
}

/// One filter entry: it matches when all its criteria hold (an entry with no
/// criterion matches every message).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FilterEntry {
    criteria: Vec<Criterion>,
}

impl FilterEntry {
    /// An entry matching every message.
    pub fn any() -> FilterEntry {
        FilterEntry::default()
    }

    /// This entry with one more criterion.
    #[must_use]
    pub fn and(mut self, c: Criterion) -> FilterEntry {
        self.criteria.push(c);
        self
    }

    /// The criteria.
    pub fn criteria(&self) -> &[Criterion] {
        &self.criteria
    }

    /// Whether every criterion holds for `msg`.
    pub fn matches(&self, msg: &MessageView<'_>) -> bool {
        self.criteria.iter().all(|c| c.matches(msg))
    }
}

/// What happens to messages that match the filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum MatchPolicy {
    /// Matching messages go to the proxy; the rest stay with the
    /// application.
    #[default]
    MatchesToProxy,
    /// Matching messages stay with the application; the rest go to the
    /// proxy.
    MatchesStay,
}

/// Where a message goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// To the proxy's handler.
    Proxy,
    /// To the application, as on any QP.
    Application,
}

/// The filter of a proxy QP: a message matches when any entry matches.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ProxyFilter {
    entries: Vec<FilterEntry>,
    policy: MatchPolicy,
}

impl ProxyFilter {
    /// An empty filter with this policy (nothing matches).
    pub fn new(policy: MatchPolicy) -> ProxyFilter {
        ProxyFilter {
            entries: Vec::new(),
            policy,
        }
    }

    /// This filter with one more entry.
    #[must_use]
    pub fn entry(mut self, e: FilterEntry) -> ProxyFilter {
        self.entries.push(e);
        self
    }

    /// The policy.
    pub fn policy(&self) -> MatchPolicy {
        self.policy
    }

    /// The entries.
    pub fn entries(&self) -> &[FilterEntry] {
        &self.entries
    }

    /// How many payload bytes [`MessageView::payload`] must hold for every
    /// value-and-mask criterion to be decided.
    pub fn payload_prefix_len(&self) -> usize {
        self.entries
            .iter()
            .flat_map(|e| &e.criteria)
            .filter_map(|c| match c {
                Criterion::Ternary(t) if t.field == Field::Payload => Some(t.end()),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Whether some entry matches `msg`.
    pub fn matches(&self, msg: &MessageView<'_>) -> bool {
        self.entries.iter().any(|e| e.matches(msg))
    }

    /// Where `msg` goes under this filter's policy.
    pub fn route(&self, msg: &MessageView<'_>) -> Route {
        match (self.matches(msg), self.policy) {
            (true, MatchPolicy::MatchesToProxy) | (false, MatchPolicy::MatchesStay) => Route::Proxy,
            _ => Route::Application,
        }
    }
}

/// A misuse of a [`Sequencer`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SequenceError {
    /// The number was never reserved, or was already written.
    #[error("sequence number {0} is not reserved")]
    NotReserved(u64),
    /// The number was already filled.
    #[error("sequence number {0} is already filled")]
    AlreadyFilled(u64),
}

/// A reorder buffer: items get consecutive sequence numbers when produced
/// and come out strictly in that order; an item can be reserved first and
/// filled later (an offloaded message whose completion the proxy has not
/// decided yet), holding back every later one.
#[derive(Debug, Clone)]
pub struct Sequencer<T> {
    /// Sequence number of `slots[0]`: the next to come out.
    next_out: u64,
    slots: VecDeque<Option<T>>,
    held_back: u64,
}

impl<T> Default for Sequencer<T> {
    fn default() -> Self {
        Sequencer {
            next_out: 0,
            slots: VecDeque::new(),
            held_back: 0,
        }
    }
}

impl<T> Sequencer<T> {
    /// An empty sequencer; the first number is 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The number the next reserved or pushed item gets.
    pub fn next_seq(&self) -> u64 {
        self.next_out + self.slots.len() as u64
    }

    /// Reserves the next number for an item decided later.
    pub fn reserve(&mut self) -> u64 {
        let seq = self.next_seq();
        self.slots.push_back(None);
        seq
    }

    /// Adds a ready item with the next number; returns the number.
    pub fn push(&mut self, item: T) -> u64 {
        let seq = self.next_seq();
        if !self.slots.is_empty() {
            self.held_back += 1;
        }
        self.slots.push_back(Some(item));
        seq
    }

    /// Fills reserved number `seq`.
    pub fn fill(&mut self, seq: u64, item: T) -> Result<(), SequenceError> {
        let slot = seq
            .checked_sub(self.next_out)
            .and_then(|i| usize::try_from(i).ok())
            .and_then(|i| self.slots.get_mut(i))
            .ok_or(SequenceError::NotReserved(seq))?;
        if slot.is_some() {
            return Err(SequenceError::AlreadyFilled(seq));
        }
        *slot = Some(item);
        Ok(())
    }

    /// The next item in order, if it is ready.
    pub fn pop_ready(&mut self) -> Option<(u64, T)> {
        match self.slots.front() {
            Some(Some(_)) => {
                let item = self.slots.pop_front().flatten()?;
                let seq = self.next_out;
                self.next_out += 1;
                Some((seq, item))
            }
            _ => None,
        }
    }

    /// Items reserved or waiting to come out.
    pub fn pending(&self) -> usize {
        self.slots.len()
    }

    /// Items that were pushed ready while an earlier one was still waiting
    /// (they came out later than they were produced).
    pub fn held_back(&self) -> u64 {
        self.held_back
    }
}

/// Load protection for a proxy queue: above `max_depth` queued messages the
/// filter stops offloading (matching messages go to the application) until
/// the queue has drained completely.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadGuard {
    max_depth: usize,
    no_offload: bool,
    entries: u64,
}

/// What [`LoadGuard::admit`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Admission {
    /// Offload the message.
    Offload,
    /// Do not offload: the guard is in no-offload mode; `entered` is true if
    /// it switched to it with this message.
    NoOffload {
        /// The switch happened now.
        entered: bool,
    },
}

impl LoadGuard {
    /// A guard allowing at most `max_depth` queued messages (at least 1).
    pub fn new(max_depth: usize) -> LoadGuard {
        LoadGuard {
            max_depth: max_depth.max(1),
            no_offload: false,
            entries: 0,
        }
    }

    /// Decides for a message that would be offloaded while `queued` messages
    /// wait for (or are being served by) the proxy.
    pub fn admit(&mut self, queued: usize) -> Admission {
        if self.no_offload {
            if queued == 0 {
                self.no_offload = false;
                return Admission::Offload;
            }
            return Admission::NoOffload { entered: false };
        }
        if queued >= self.max_depth {
            self.no_offload = true;
            self.entries += 1;
            return Admission::NoOffload { entered: true };
        }
        Admission::Offload
    }

    /// The proxy's queue length changed to `queued`; returns true if this
    /// ended no-offload mode (the proxy caught up).
    pub fn drained(&mut self, queued: usize) -> bool {
        if self.no_offload && queued == 0 {
            self.no_offload = false;
            return true;
        }
        false
    }

    /// Whether the guard is in no-offload mode.
    pub fn is_no_offload(&self) -> bool {
        self.no_offload
    }

    /// How many times no-offload mode was entered.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// The configured depth.
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SEND_HDR: [u8; 18] = [0x01, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];

    fn send(payload: &[u8]) -> MessageView<'_> {
        MessageView {
            opcode: Opcode::Send,
            len: payload.len() as u64,
            stag: None,
            to: None,
            header: &SEND_HDR,
            payload,
        }
    }

    fn write_imm(stag: u32, to: u64, len: u64) -> MessageView<'static> {
        MessageView {
            opcode: Opcode::RdmaWrite,
            len,
            stag: Some(stag),
            to: Some(to),
            header: &[0x80, 0x40, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0x10, 0],
            payload: &[],
        }
    }

    #[test]
    fn empty_filter_matches_nothing_and_routes_by_policy() {
        let m = send(b"x");
        assert_eq!(
            ProxyFilter::new(MatchPolicy::MatchesToProxy).route(&m),
            Route::Application
        );
        assert_eq!(
            ProxyFilter::new(MatchPolicy::MatchesStay).route(&m),
            Route::Proxy
        );
    }

    #[test]
    fn opcode_criterion() {
        let f = ProxyFilter::new(MatchPolicy::MatchesToProxy)
            .entry(FilterEntry::any().and(Criterion::opcodes(&[Opcode::SendWithSolicitedEvent])));
        assert_eq!(f.route(&send(b"a")), Route::Application);
        let mut m = send(b"a");
        m.opcode = Opcode::SendWithSolicitedEvent;
        assert_eq!(f.route(&m), Route::Proxy);
        let set = OpcodeSet::of(&[Opcode::Send, Opcode::RdmaWrite]);
        assert!(set.contains(Opcode::Send) && set.contains(Opcode::RdmaWrite));
        assert!(!set.contains(Opcode::SendWithInvalidate));
        assert!(!OpcodeSet::EMPTY.contains(Opcode::RdmaWrite));
    }

    #[test]
    fn payload_len_threshold_is_inclusive() {
        let f = FilterEntry::any().and(Criterion::payload_at_most(4));
        assert!(f.matches(&send(b"")));
        assert!(f.matches(&send(b"1234")));
        assert!(!f.matches(&send(b"12345")));
        let g = FilterEntry::any().and(Criterion::payload_at_least(4));
        assert!(!g.matches(&send(b"123")));
        assert!(g.matches(&send(b"1234")));
    }

    #[test]
    fn stag_and_address_ranges() {
        let s = Criterion::stags(0x100, 0x1ff).unwrap();
        assert!(s.matches(&write_imm(0x100, 0, 8)));
        assert!(s.matches(&write_imm(0x1ff, 0, 8)));
        assert!(!s.matches(&write_imm(0x200, 0, 8)));
        assert!(!s.matches(&send(b"no stag")));
        let a = Criterion::addresses(0x1000, 0x1fff).unwrap();
        assert!(a.matches(&write_imm(1, 0x1000, 0x1000)));
        // One byte past the end.
        assert!(!a.matches(&write_imm(1, 0x1001, 0x1000)));
        assert!(!a.matches(&write_imm(1, 0xfff, 8)));
        // A zero-length write at the last address still lies inside.
        assert!(a.matches(&write_imm(1, 0x1fff, 0)));
        assert!(!a.matches(&send(b"")));
        assert_eq!(
            Criterion::stags(2, 1),
            Err(FilterError::EmptyRange { first: 2, last: 1 })
        );
        assert!(Criterion::addresses(5, 4).is_err());
    }

    #[test]
    fn ternary_ignores_bits_under_zero_mask() {
        let c = Criterion::ternary(Field::Payload, 0, &[0xA0, 0x00], &[0xF0, 0x00]).unwrap();
        assert!(c.matches(&send(&[0xA5, 0x77])));
        assert!(c.matches(&send(&[0xAF, 0x00])));
        assert!(!c.matches(&send(&[0xB0, 0x00])));
        // Value bits outside the mask do not matter.
        let d = Criterion::ternary(Field::Payload, 0, &[0xAF], &[0xF0]).unwrap();
        assert!(d.matches(&send(&[0xA0])));
    }

    #[test]
    fn ternary_beyond_the_message() {
        // Second byte masked out: a one-byte message still matches.
        let c = Criterion::ternary(Field::Payload, 0, &[1, 2], &[0xff, 0]).unwrap();
        assert!(c.matches(&send(&[1])));
        // Second byte under a mask: a one-byte message never matches, even
        // if the value would be zero.
        let d = Criterion::ternary(Field::Payload, 0, &[1, 0], &[0xff, 0x01]).unwrap();
        assert!(!d.matches(&send(&[1])));
        assert!(d.matches(&send(&[1, 0])));
        // Empty payload and an all-zero mask.
        let e = Criterion::ternary(Field::Payload, 4, &[9, 9], &[0, 0]).unwrap();
        assert!(e.matches(&send(b"")));
        // Empty value matches everything.
        let f = Criterion::ternary(Field::Payload, 0, &[], &[]).unwrap();
        assert!(f.matches(&send(b"")));
    }

    #[test]
    fn ternary_on_header_with_offset() {
        // Byte 1 of the untagged header: RDMAP control, opcode in the low
        // four bits (0x43 = version 1, Send).
        let c = Criterion::ternary(Field::Header, 1, &[0x03], &[0x0f]).unwrap();
        assert!(c.matches(&send(b"")));
        let mut hdr = SEND_HDR;
        hdr[1] = 0x45;
        let m = MessageView {
            header: &hdr,
            ..send(b"")
        };
        assert!(!c.matches(&m));
        // Matching on the header never looks at the payload.
        let p = Criterion::ternary(Field::Header, 20, &[1], &[1]).unwrap();
        assert!(!p.matches(&send(&[1; 32])));
    }

    #[test]
    fn ternary_shape_errors() {
        assert_eq!(
            Ternary::new(Field::Payload, 0, &[1, 2], &[1]),
            Err(FilterError::MaskLength { value: 2, mask: 1 })
        );
        assert_eq!(
            Ternary::new(Field::Payload, 60, &[0; 5], &[0; 5]),
            Err(FilterError::TooLong { end: 65, max: 64 })
        );
        assert!(Ternary::new(Field::Payload, 60, &[0; 4], &[0; 4]).is_ok());
        assert!(Ternary::new(Field::Header, usize::MAX, &[0], &[0]).is_err());
    }

    #[test]
    fn entries_are_and_filters_are_or() {
        let f = ProxyFilter::new(MatchPolicy::MatchesToProxy)
            .entry(
                FilterEntry::any()
                    .and(Criterion::opcodes(&[Opcode::Send]))
                    .and(Criterion::ternary(Field::Payload, 0, b"L", &[0xff]).unwrap()),
            )
            .entry(FilterEntry::any().and(Criterion::stags(7, 7).unwrap()));
        assert!(f.matches(&send(b"Lock")));
        assert!(!f.matches(&send(b"Update")));
        assert!(f.matches(&write_imm(7, 0, 1)));
        assert!(!f.matches(&write_imm(8, 0, 1)));
        assert_eq!(f.payload_prefix_len(), 1);
        let stay = ProxyFilter::new(MatchPolicy::MatchesStay)
            .entry(FilterEntry::any().and(Criterion::payload_at_least(100)));
        assert_eq!(stay.route(&send(b"small")), Route::Proxy);
        assert_eq!(stay.route(&send(&[0; 100])), Route::Application);
        assert!(FilterEntry::any().matches(&send(b"")));
    }

    #[test]
    fn prefix_len_covers_the_furthest_payload_match() {
        let f = ProxyFilter::default()
            .entry(
                FilterEntry::any()
                    .and(Criterion::ternary(Field::Payload, 8, &[0; 8], &[0; 8]).unwrap()),
            )
            .entry(
                FilterEntry::any()
                    .and(Criterion::ternary(Field::Header, 0, &[0; 18], &[0; 18]).unwrap()),
            );
        assert_eq!(f.payload_prefix_len(), 16);
        assert_eq!(ProxyFilter::default().payload_prefix_len(), 0);
    }

    #[test]
    fn sequencer_holds_back_after_a_reserved_slot() {
        let mut s = Sequencer::new();
        assert_eq!(s.push("a"), 0);
        let r = s.reserve();
        assert_eq!(r, 1);
        assert_eq!(s.push("c"), 2);
        assert_eq!(s.pop_ready(), Some((0, "a")));
        assert_eq!(s.pop_ready(), None);
        assert_eq!(s.held_back(), 1);
        s.fill(r, "b").unwrap();
        assert_eq!(s.fill(r, "b"), Err(SequenceError::AlreadyFilled(1)));
        assert_eq!(s.pop_ready(), Some((1, "b")));
        assert_eq!(s.pop_ready(), Some((2, "c")));
        assert_eq!(s.pop_ready(), None);
        assert_eq!(s.fill(1, "late"), Err(SequenceError::NotReserved(1)));
        assert_eq!(s.fill(9, "future"), Err(SequenceError::NotReserved(9)));
        assert_eq!(s.pending(), 0);
        assert_eq!(s.next_seq(), 3);
    }

    #[test]
    fn load_guard_enters_at_depth_and_leaves_when_drained() {
        let mut g = LoadGuard::new(2);
        assert_eq!(g.admit(0), Admission::Offload);
        assert_eq!(g.admit(1), Admission::Offload);
        assert_eq!(g.admit(2), Admission::NoOffload { entered: true });
        assert!(g.is_no_offload());
        // Catching up part way is not enough.
        assert_eq!(g.admit(1), Admission::NoOffload { entered: false });
        assert!(!g.drained(1));
        assert!(g.drained(0));
        assert!(!g.drained(0));
        assert_eq!(g.admit(0), Admission::Offload);
        assert_eq!(g.admit(5), Admission::NoOffload { entered: true });
        // A message arriving after the queue emptied leaves the mode too.
        assert_eq!(g.admit(0), Admission::Offload);
        assert_eq!(g.entries(), 2);
        assert_eq!(LoadGuard::new(0).max_depth(), 1);
    }

    proptest! {
        /// Whatever the order in which reserved items are filled, items come
        /// out in sequence order, each exactly once.
        #[test]
        fn sequencer_outputs_in_order(ops in proptest::collection::vec((any::<bool>(), any::<u8>()), 1..64)) {
            let mut s = Sequencer::new();
            let mut reserved = Vec::new();
            let mut out = Vec::new();
            for (i, (reserve, pick)) in ops.iter().enumerate() {
                if *reserve {
                    reserved.push(s.reserve());
                } else {
                    s.push(s.next_seq());
                }
                if !reserved.is_empty() && pick % 3 == 0 {
                    let k = usize::from(*pick) % reserved.len();
                    let seq = reserved.swap_remove(k);
                    s.fill(seq, seq).unwrap();
                }
                while let Some((seq, v)) = s.pop_ready() {
                    prop_assert_eq!(seq, v);
                    out.push(seq);
                }
                let _ = i;
            }
            for seq in reserved.drain(..) {
                s.fill(seq, seq).unwrap();
            }
            while let Some((seq, _)) = s.pop_ready() {
                out.push(seq);
            }
            let want: Vec<u64> = (0..ops.len() as u64).collect();
            prop_assert_eq!(out, want);
        }

        /// A ternary match equals the bitwise definition on in-range bytes.
        #[test]
        fn ternary_matches_definition(
            payload in proptest::collection::vec(any::<u8>(), 0..16),
            value in proptest::collection::vec(any::<u8>(), 0..8),
            mask_seed in any::<u64>(),
            offset in 0usize..8,
        ) {
            let mask: Vec<u8> = (0..value.len()).map(|i| (mask_seed >> (i * 8)) as u8).collect();
            let c = Criterion::ternary(Field::Payload, offset, &value, &mask).unwrap();
            let want = (0..value.len()).all(|i| match payload.get(offset + i) {
                Some(b) => b & mask[i] == value[i] & mask[i],
                None => mask[i] == 0,
            });
            prop_assert_eq!(c.matches(&send(&payload)), want);
        }
    }
}
