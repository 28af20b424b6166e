//! MPA connection setup (RFC 5044 section 7.1, RFC 6581): sans-IO
//! negotiation state machines.
//!
//! ```text
//!  Initiator                                   Responder
//!  MPA Request  (C, H, Rev, [IRD/ORD, offers]) ──▶
//!                 ◀── MPA Reply (C, H, Rev, [IRD/ORD, one RTR kind])  (R set: rejected)
//!  peer-to-peer only (RFC 6581 section 7):
//!  RTR FPDU (zero-length Write / Read Request / Send) ──▶
//!                 ◀── zero-length Read Response          (Read RTR only)
//!  ─────────────────────── full operation: FPDUs both ways ──────────────
//! ```
//!
//! RFC 5044: "If the C flag is set in either the Request or the Reply, CRC
//! is used in both directions"; markers are per receiving direction. RFC
//! 6581 section 5: when H is set the private data starts with the IRD/ORD
//! word; the initiator's A bit asks for peer-to-peer mode and B/C/D offer
//! the RTR kinds, of which the responder selects exactly one in its Reply.
//!
//! Rules applied here:
//!
//! * Revision: the initiator sends its configured revision, the responder
//!   replies with the smaller of the two; a Reply with a higher revision
//!   than requested is an error. The IRD/ORD word is exchanged when both
//!   frames are revision 2 with H set (softrdma always sets H in
//!   revision 2).
//! * IRD/ORD: each side's effective ORD is the smaller of its own ORD and
//!   the peer's IRD; an initiator refuses a Reply whose ORD exceeds the IRD
//!   it announced.
//! * CRC ([`CrcPolicy`]): on if either side sets C; a side whose policy is
//!   [`CrcPolicy::Off`] refuses a peer that asks for it.
//! * Markers are never requested and never granted: a Request or Reply
//!   with M set is refused.
//! * Peer-to-peer: the initiator offers the kinds of its
//!   [`MpaConfig::peer_to_peer`]; a responder always honours an offer,
//!   picking Write, else Read, else Send among the kinds it accepts (its own
//!   `peer_to_peer`, or Write and Read when `None`), and refuses the
//!   Request if none is common. The initiator then sends the RTR (see
//!   [`crate::rtr`]); the responder does not report the connection
//!   established before the RTR has arrived.
//! * Private data: at most [`MpaConfig::max_private_data`] octets of ULP
//!   private data (not counting the IRD/ORD word) in each direction.
//!
//! The machines never read past the handshake: [`Initiator::want`] and
//! [`Responder::want`] tell how many octets the current frame or FPDU still
//! needs, and `receive` consumes at most what the handshake needs, so the
//! bytes after it (the first FPDU of full operation) stay with the caller.
//! There is no clock: timeouts are the caller's.

use softrdma_wire::ddp::Msn;
use softrdma_wire::mpa::{
    Frame, FrameKind, FrameRepr, HEADER_LEN, IRD_ORD_LEN, IRD_ORD_MAX, IrdOrd,
    MPA_MAX_PRIVATE_DATA, MpaError, REVISION_1, REVISION_2, SIW_MAX_PRIVATE_DATA, frame_len,
};
use softrdma_wire::{DecodeError, EncodeError};

use crate::rtr::{self, ReceivedRtr, RtrError, RtrKind};

/// When to use the MPA CRC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CrcPolicy {
    /// Never: do not ask, and refuse a peer that asks (for tests and
    /// measurements; RFC 5044 expects CRC to be supported).
    Off,
    /// Do not ask, but use it if the peer asks (Linux siw's default).
    #[default]
    AcceptIfAsked,
    /// Ask for it (so it is always used).
    Required,
}

/// A set of RTR kinds: offered by an initiator, accepted by a responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RtrOffer {
    /// Zero-length Send.
    pub send: bool,
    /// Zero-length RDMA Write.
    pub write: bool,
    /// Zero-length RDMA Read.
    pub read: bool,
}

impl RtrOffer {
    /// Write and Read, what Linux siw offers.
    pub const WRITE_READ: RtrOffer = RtrOffer {
        send: false,
        write: true,
        read: true,
    };

    /// Only `kind`.
    pub const fn only(kind: RtrKind) -> RtrOffer {
        RtrOffer {
            send: matches!(kind, RtrKind::Send),
            write: matches!(kind, RtrKind::Write),
            read: matches!(kind, RtrKind::Read),
        }
    }

    /// Whether no kind is in the set.
    pub const fn is_empty(&self) -> bool {
        !(self.send || self.write || self.read)
    }

    /// Whether `kind` is in the set.
    pub const fn contains(&self, kind: RtrKind) -> bool {
        match kind {
            RtrKind::Send => self.send,
            RtrKind::Write => self.write,
            RtrKind::Read => self.read,
        }
    }

    /// How many kinds are in the set.
    pub fn len(&self) -> usize {
        usize::from(self.send) + usize::from(self.write) + usize::from(self.read)
    }

    /// The kind a responder accepting `self` picks from `offer`: Write,
    /// else Read, else Send.
    pub fn pick(&self, offer: &RtrOffer) -> Option<RtrKind> {
        [RtrKind::Write, RtrKind::Read, RtrKind::Send]
            .into_iter()
            .find(|&k| self.contains(k) && offer.contains(k))
    }

    fn from_ird_ord(w: &IrdOrd) -> RtrOffer {
        RtrOffer {
            send: w.send_rtr,
            write: w.write_rtr,
            read: w.read_rtr,
        }
    }

    /// The only kind in the set, if it has exactly one.
    fn single(&self) -> Option<RtrKind> {
        if self.len() != 1 {
            return None;
        }
        [RtrKind::Write, RtrKind::Read, RtrKind::Send]
            .into_iter()
            .find(|&k| self.contains(k))
    }
}

/// Local MPA settings of one side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaConfig {
    /// MPA revision to speak: 1 (RFC 5044) or 2 (RFC 6581, with H set).
    pub revision: u8,
    /// CRC policy.
    pub crc: CrcPolicy,
    /// Inbound RDMA Read Requests this side can have outstanding (at most
    /// [`IRD_ORD_MAX`]).
    pub ird: u16,
    /// Outbound RDMA Read Requests this side wants to have outstanding (at
    /// most [`IRD_ORD_MAX`]).
    pub ord: u16,
    /// Initiator: ask for peer-to-peer mode offering these RTR kinds
    /// (revision 2 only). Responder: the RTR kinds accepted if the initiator
    /// asks (`None`: Write and Read).
    pub peer_to_peer: Option<RtrOffer>,
    /// Most ULP private data accepted from the peer and allowed to send,
    /// not counting the IRD/ORD word (default 256, as Linux siw; at most
    /// 508).
    pub max_private_data: usize,
}

impl Default for MpaConfig {
    fn default() -> Self {
        Self {
            revision: REVISION_2,
            crc: CrcPolicy::AcceptIfAsked,
            ird: 16,
            ord: 16,
            peer_to_peer: None,
            max_private_data: SIW_MAX_PRIVATE_DATA,
        }
    }
}

/// A local setting or argument that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Revision other than 1 or 2.
    #[error("MPA revision {revision} is not supported (1 or 2)")]
    BadRevision {
        /// The revision configured.
        revision: u8,
    },
    /// IRD or ORD above [`IRD_ORD_MAX`].
    #[error("IRD {ird} / ORD {ord}: at most {IRD_ORD_MAX} each")]
    IrdOrdTooLarge {
        /// IRD.
        ird: u16,
        /// ORD.
        ord: u16,
    },
    /// Peer-to-peer mode needs MPA revision 2.
    #[error("peer-to-peer mode needs MPA revision 2")]
    PeerToPeerNeedsRevision2,
    /// Peer-to-peer mode with no RTR kind.
    #[error("peer-to-peer mode needs at least one RTR kind")]
    EmptyRtrOffer,
    /// Private data longer than allowed.
    #[error("{len} octets of private data, at most {max} allowed")]
    PrivateDataTooLong {
        /// Length given.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// `max_private_data` above what a frame can carry.
    #[error("max_private_data {max} is above the {limit} octets an MPA frame can carry")]
    PrivateDataCapTooLarge {
        /// Configured.
        max: usize,
        /// The limit.
        limit: usize,
    },
    /// `accept`/`reject` called when no Request awaits an answer.
    #[error("no MPA Request is waiting for an answer")]
    NotAwaitingAnswer,
}

/// Why a negotiation failed because of what the peer sent (or did not).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MpaNegotiationError {
    /// The bytes are not an acceptable MPA frame (bad key, revision,
    /// length, or a Request where a Reply was expected).
    #[error(transparent)]
    Frame(#[from] MpaError),
    /// H set, but the private data does not start with an IRD/ORD word.
    #[error("MPA v2 frame without a valid IRD/ORD word: {0}")]
    IrdOrd(DecodeError),
    /// The peer's ULP private data is longer than accepted.
    #[error("peer sent {len} octets of private data, at most {max} accepted")]
    PrivateDataTooLong {
        /// Received length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The peer asks for CRC and the local policy is [`CrcPolicy::Off`].
    #[error("peer requires MPA CRC, which is switched off locally")]
    CrcRefused,
    /// The peer asks for markers, which softrdma does not insert.
    #[error("peer requires MPA markers, which are not supported")]
    MarkersRequested,
    /// The Reply's revision is higher than the Request's.
    #[error("MPA Reply revision {received}, Request was revision {sent}")]
    RevisionMismatch {
        /// Revision sent.
        sent: u8,
        /// Revision received.
        received: u8,
    },
    /// The Reply sets H although the Request did not.
    #[error("MPA Reply sets H, the Request did not")]
    UnexpectedEnhanced,
    /// The Reply's ORD is above the IRD the initiator announced.
    #[error("peer ORD {peer_ord} exceeds local IRD {local_ird}")]
    IrdOrdMismatch {
        /// The responder's ORD.
        peer_ord: u16,
        /// The initiator's IRD.
        local_ird: u16,
    },
    /// Peer-to-peer mode was asked for, and the Reply selects no RTR kind
    /// (or is not revision 2 with H).
    #[error("peer did not accept peer-to-peer mode")]
    PeerToPeerRefused,
    /// The Reply selects more than one RTR kind, or one not offered.
    #[error("peer selected RTR kinds {selected:?}, offered {offered:?}")]
    BadRtrSelection {
        /// Selected by the Reply.
        selected: RtrOffer,
        /// Offered by the Request (empty if none).
        offered: RtrOffer,
    },
    /// The initiator offers no RTR kind the responder accepts.
    #[error("no common RTR kind: offered {offered:?}, accepted {accepted:?}")]
    NoCommonRtr {
        /// Offered by the initiator.
        offered: RtrOffer,
        /// Accepted locally.
        accepted: RtrOffer,
    },
    /// The RTR exchange message is wrong.
    #[error(transparent)]
    Rtr(#[from] RtrError),
    /// The negotiation already ended (succeeded, was rejected or failed);
    /// further bytes belong to someone else.
    #[error("MPA negotiation already over")]
    Over,
}

impl MpaNegotiationError {
    /// Whether a responder that got this error from a Request can still
    /// answer it with a reject (the Request was a well-formed frame whose
    /// terms are refused).
    pub const fn is_refusal(&self) -> bool {
        matches!(
            self,
            Self::PrivateDataTooLong { .. }
                | Self::Frame(MpaError::PrivateDataTooLong { .. })
                | Self::CrcRefused
                | Self::MarkersRequested
                | Self::NoCommonRtr { .. }
                | Self::IrdOrd(_)
        )
    }
}

/// The outcome of a successful negotiation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// The MPA revision in use (the Reply's).
    pub revision: u8,
    /// Whether the IRD/ORD word was exchanged (both frames revision 2 with H).
    pub enhanced: bool,
    /// CRC in use in both directions.
    pub crc: bool,
    /// Local IRD as announced.
    pub ird: u16,
    /// Local effective ORD: the smaller of the configured ORD and the
    /// peer's IRD (the configured one if not enhanced).
    pub ord: u16,
    /// The peer's IRD (if enhanced).
    pub peer_ird: Option<u16>,
    /// The peer's ORD as it announced it (if enhanced).
    pub peer_ord: Option<u16>,
    /// The RTR kind of peer-to-peer mode, if negotiated; the RTR exchange
    /// is complete when [`Negotiated`] is reported.
    pub rtr: Option<RtrKind>,
    /// The peer's ULP private data (without the IRD/ORD word).
    pub peer_private_data: Vec<u8>,
    /// Whether this side was the initiator.
    pub initiator: bool,
}

/// The first MSNs of full operation on the untagged queues 0 (Send) and 1
/// (Read Request), after the RTR exchange consumed some.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InitialMsns {
    /// MSN of the first Send this side transmits.
    pub send_tx: Msn,
    /// MSN of the first Read Request this side transmits.
    pub read_tx: Msn,
    /// MSN of the first Send this side expects.
    pub send_rx: Msn,
    /// MSN of the first Read Request this side expects.
    pub read_rx: Msn,
}

impl Negotiated {
    /// The first MSNs of full operation: 1 everywhere, except for the queue
    /// whose MSN 1 a Send or Read RTR used (in the initiator's transmit and
    /// the responder's receive direction).
    pub fn initial_msns(&self) -> InitialMsns {
        let one = Msn::INITIAL;
        let two = Msn::INITIAL.next();
        let used = |k: RtrKind| if self.rtr == Some(k) { two } else { one };
        let (send, read) = (used(RtrKind::Send), used(RtrKind::Read));
        if self.initiator {
            InitialMsns {
                send_tx: send,
                read_tx: read,
                send_rx: one,
                read_rx: one,
            }
        } else {
            InitialMsns {
                send_tx: one,
                read_tx: one,
                send_rx: send,
                read_rx: read,
            }
        }
    }
}

fn check_config(config: &MpaConfig) -> Result<(), ConfigError> {
    if !matches!(config.revision, REVISION_1 | REVISION_2) {
        return Err(ConfigError::BadRevision {
            revision: config.revision,
        });
    }
    check_ird_ord(config.ird, config.ord)?;
    let limit = MPA_MAX_PRIVATE_DATA - IRD_ORD_LEN;
    if config.max_private_data > limit {
        return Err(ConfigError::PrivateDataCapTooLarge {
            max: config.max_private_data,
            limit,
        });
    }
    Ok(())
}

fn check_ird_ord(ird: u16, ord: u16) -> Result<(), ConfigError> {
    if ird > IRD_ORD_MAX || ord > IRD_ORD_MAX {
        return Err(ConfigError::IrdOrdTooLarge { ird, ord });
    }
    Ok(())
}

fn check_private_data(config: &MpaConfig, pd: &[u8]) -> Result<(), ConfigError> {
    if pd.len() > config.max_private_data {
        return Err(ConfigError::PrivateDataTooLong {
            len: pd.len(),
            max: config.max_private_data,
        });
    }
    Ok(())
}

/// Builds a frame; the arguments are checked by the callers.
fn build_frame(
    kind: FrameKind,
    crc: bool,
    reject: bool,
    revision: u8,
    ird_ord: Option<IrdOrd>,
    ulp: &[u8],
) -> Result<Vec<u8>, EncodeError> {
    let mut pd = Vec::with_capacity(IRD_ORD_LEN + ulp.len());
    if let Some(w) = ird_ord {
        pd.extend_from_slice(&w.to_bytes()?);
    }
    pd.extend_from_slice(ulp);
    let repr = FrameRepr {
        kind,
        markers: false,
        crc,
        reject,
        enhanced: ird_ord.is_some(),
        reserved: 0,
        revision,
        private_data: &pd,
    };
    let mut out = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut out)?;
    out.truncate(n);
    Ok(out)
}

/// What the receive buffer is collecting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Expect {
    Frame,
    Fpdu,
    Nothing,
}

/// Receive and transmit buffers shared by both machines.
#[derive(Debug, Default)]
struct Io {
    rx: Vec<u8>,
    tx: Vec<u8>,
    tx_sent: usize,
}

impl Io {
    fn want(&self, expect: Expect) -> usize {
        let have = self.rx.len();
        match expect {
            Expect::Nothing => 0,
            Expect::Frame => match self.rx.get(18..20) {
                Some(&[a, b]) => {
                    (HEADER_LEN + usize::from(u16::from_be_bytes([a, b]))).saturating_sub(have)
                }
                _ => HEADER_LEN.saturating_sub(have),
            },
            Expect::Fpdu => match rtr::fpdu_total_len(&self.rx) {
                Some(total) => total.saturating_sub(have),
                None => 2usize.saturating_sub(have),
            },
        }
    }

    /// Whether the frame being collected is complete (errors as soon as the
    /// prefix cannot start an acceptable frame).
    fn frame_complete(&self, max_ulp: usize) -> Result<bool, MpaNegotiationError> {
        match frame_len(&self.rx, max_ulp + IRD_ORD_LEN) {
            None => Ok(false),
            Some(Err(e)) => Err(e.into()),
            Some(Ok(total)) => Ok(self.rx.len() >= total),
        }
    }

    fn fpdu_complete(&self) -> Result<bool, MpaNegotiationError> {
        rtr::check_rtr_prefix(&self.rx)?;
        Ok(rtr::fpdu_total_len(&self.rx).is_some_and(|t| self.rx.len() >= t))
    }

    fn transmit(&self) -> &[u8] {
        self.tx.get(self.tx_sent..).unwrap_or(&[])
    }

    fn consumed(&mut self, n: usize) {
        self.tx_sent = self.tx_sent.saturating_add(n).min(self.tx.len());
        if self.tx_sent == self.tx.len() {
            self.tx.clear();
            self.tx_sent = 0;
        }
    }
}

/// A parsed frame, with its private data copied out.
struct ParsedFrame {
    crc: bool,
    markers: bool,
    reject: bool,
    enhanced: bool,
    revision: u8,
    ird_ord: Option<IrdOrd>,
    ulp: Vec<u8>,
}

fn parse_frame(
    bytes: &[u8],
    expected: FrameKind,
    max_ulp: usize,
) -> Result<ParsedFrame, MpaNegotiationError> {
    let frame = Frame::new_checked(bytes).map_err(MpaError::from)?;
    let repr = FrameRepr::parse_expecting(&frame, expected, max_ulp + IRD_ORD_LEN)?;
    let ird_ord = match repr.ird_ord() {
        None => None,
        Some(Ok(w)) => Some(w),
        Some(Err(e)) => return Err(MpaNegotiationError::IrdOrd(e)),
    };
    let ulp = repr.ulp_private_data();
    if ulp.len() > max_ulp {
        return Err(MpaNegotiationError::PrivateDataTooLong {
            len: ulp.len(),
            max: max_ulp,
        });
    }
    Ok(ParsedFrame {
        crc: repr.crc,
        markers: repr.markers,
        reject: repr.reject,
        enhanced: repr.enhanced,
        revision: repr.revision,
        ird_ord,
        ulp: ulp.to_vec(),
    })
}

/// Feeds `bytes` to a machine, at most what it wants at each step.
fn feed<M>(
    m: &mut M,
    bytes: &[u8],
    want: impl Fn(&M) -> usize,
    rx: impl Fn(&mut M) -> &mut Vec<u8>,
    mut step: impl FnMut(&mut M) -> Result<(), MpaNegotiationError>,
) -> Result<usize, MpaNegotiationError> {
    let mut used = 0;
    while used < bytes.len() {
        let w = want(m);
        if w == 0 {
            break;
        }
        let take = w.min(bytes.len() - used);
        if let Some(chunk) = bytes.get(used..used + take) {
            rx(m).extend_from_slice(chunk);
        }
        used += take;
        step(m)?;
    }
    Ok(used)
}

/// What an [`Initiator`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum InitiatorEvent {
    /// The connection is in full operation once [`Initiator::transmit`] is
    /// empty (it may still hold the RTR).
    Established(Negotiated),
    /// The responder rejected the connection.
    Rejected {
        /// The Reply's revision.
        revision: u8,
        /// The responder's ULP private data.
        private_data: Vec<u8>,
    },
}

#[derive(Debug)]
enum InitiatorState {
    AwaitReply,
    AwaitReadResponse(Negotiated),
    Over,
}

/// The active side of MPA negotiation: sends the Request, takes the Reply,
/// sends the RTR in peer-to-peer mode (and takes the Read RTR's response).
#[derive(Debug)]
pub struct Initiator {
    config: MpaConfig,
    sent_enhanced: bool,
    sent_crc: bool,
    io: Io,
    state: InitiatorState,
    event: Option<InitiatorEvent>,
}

impl Initiator {
    /// Starts a negotiation: the Request carrying `private_data` is queued
    /// for [`Self::transmit`].
    pub fn new(config: MpaConfig, private_data: &[u8]) -> Result<Self, ConfigError> {
        check_config(&config)?;
        check_private_data(&config, private_data)?;
        let offer = config.peer_to_peer;
        if let Some(o) = offer {
            if config.revision != REVISION_2 {
                return Err(ConfigError::PeerToPeerNeedsRevision2);
            }
            if o.is_empty() {
                return Err(ConfigError::EmptyRtrOffer);
            }
        }
        let enhanced = config.revision == REVISION_2;
        let ird_ord = enhanced.then(|| {
            let o = offer.unwrap_or_default();
            IrdOrd {
                ird: config.ird,
                ord: config.ord,
                peer_to_peer: offer.is_some(),
                send_rtr: o.send,
                write_rtr: o.write,
                read_rtr: o.read,
            }
        });
        let crc = config.crc == CrcPolicy::Required;
        let request = build_frame(
            FrameKind::Request,
            crc,
            false,
            config.revision,
            ird_ord,
            private_data,
        )
        .map_err(|_| ConfigError::PrivateDataTooLong {
            len: private_data.len(),
            max: config.max_private_data,
        })?;
        Ok(Self {
            config,
            sent_enhanced: enhanced,
            sent_crc: crc,
            io: Io {
                tx: request,
                ..Io::default()
            },
            state: InitiatorState::AwaitReply,
            event: None,
        })
    }

    /// Bytes to write to the peer (empty when there are none).
    pub fn transmit(&self) -> &[u8] {
        self.io.transmit()
    }

    /// Marks the first `n` bytes of [`Self::transmit`] as written.
    pub fn consumed(&mut self, n: usize) {
        self.io.consumed(n);
    }

    fn expect(&self) -> Expect {
        match self.state {
            InitiatorState::AwaitReply => Expect::Frame,
            InitiatorState::AwaitReadResponse(_) => Expect::Fpdu,
            InitiatorState::Over => Expect::Nothing,
        }
    }

    /// How many more octets the handshake needs at least (and at most, for
    /// the frame or FPDU being received); 0 when it needs none.
    pub fn want(&self) -> usize {
        self.io.want(self.expect())
    }

    /// Whether the negotiation is over (established, rejected or failed).
    pub fn is_over(&self) -> bool {
        matches!(self.state, InitiatorState::Over)
    }

    /// Takes bytes received from the peer; returns how many were consumed
    /// (never more than the handshake needs: the rest belong to full
    /// operation). After an error the machine is over.
    pub fn receive(&mut self, bytes: &[u8]) -> Result<usize, MpaNegotiationError> {
        if self.is_over() {
            return Err(MpaNegotiationError::Over);
        }
        let r = feed(self, bytes, Self::want, |m| &mut m.io.rx, Self::step);
        if r.is_err() {
            self.state = InitiatorState::Over;
        }
        r
    }

    /// The next event, if any.
    pub fn poll(&mut self) -> Option<InitiatorEvent> {
        self.event.take()
    }

    fn step(&mut self) -> Result<(), MpaNegotiationError> {
        match &self.state {
            InitiatorState::AwaitReply => {
                if self.io.frame_complete(self.config.max_private_data)? {
                    let bytes = core::mem::take(&mut self.io.rx);
                    self.on_reply(&bytes)?;
                }
            }
            InitiatorState::AwaitReadResponse(_) => {
                if self.io.fpdu_complete()? {
                    let bytes = core::mem::take(&mut self.io.rx);
                    let state = core::mem::replace(&mut self.state, InitiatorState::Over);
                    if let InitiatorState::AwaitReadResponse(n) = state {
                        rtr::recognise_read_rtr_response(&bytes, n.crc)?;
                        self.event = Some(InitiatorEvent::Established(n));
                    }
                }
            }
            InitiatorState::Over => return Err(MpaNegotiationError::Over),
        }
        Ok(())
    }

    fn on_reply(&mut self, bytes: &[u8]) -> Result<(), MpaNegotiationError> {
        let f = parse_frame(bytes, FrameKind::Reply, self.config.max_private_data)?;
        if f.revision > self.config.revision {
            return Err(MpaNegotiationError::RevisionMismatch {
                sent: self.config.revision,
                received: f.revision,
            });
        }
        if f.enhanced && !self.sent_enhanced {
            return Err(MpaNegotiationError::UnexpectedEnhanced);
        }
        if f.reject {
            self.state = InitiatorState::Over;
            self.event = Some(InitiatorEvent::Rejected {
                revision: f.revision,
                private_data: f.ulp,
            });
            return Ok(());
        }
        if f.markers {
            return Err(MpaNegotiationError::MarkersRequested);
        }
        if f.crc && self.config.crc == CrcPolicy::Off {
            return Err(MpaNegotiationError::CrcRefused);
        }
        let crc = f.crc || self.sent_crc;
        let enhanced = f.revision == REVISION_2 && f.ird_ord.is_some();
        let peer = if enhanced { f.ird_ord } else { None };
        let mut ord = self.config.ord;
        if let Some(p) = peer {
            if p.ord > self.config.ird {
                return Err(MpaNegotiationError::IrdOrdMismatch {
                    peer_ord: p.ord,
                    local_ird: self.config.ird,
                });
            }
            ord = ord.min(p.ird);
        }
        let selected = peer.map(|p| RtrOffer::from_ird_ord(&p)).unwrap_or_default();
        let rtr = match self.config.peer_to_peer {
            Some(offered) => {
                if !peer.is_some_and(|p| p.peer_to_peer) || selected.is_empty() {
                    return Err(MpaNegotiationError::PeerToPeerRefused);
                }
                match selected.single() {
                    Some(k) if offered.contains(k) => Some(k),
                    _ => {
                        return Err(MpaNegotiationError::BadRtrSelection { selected, offered });
                    }
                }
            }
            None if !selected.is_empty() => {
                return Err(MpaNegotiationError::BadRtrSelection {
                    selected,
                    offered: RtrOffer::default(),
                });
            }
            None => None,
        };
        let n = Negotiated {
            revision: f.revision,
            enhanced,
            crc,
            ird: self.config.ird,
            ord,
            peer_ird: peer.map(|p| p.ird),
            peer_ord: peer.map(|p| p.ord),
            rtr,
            peer_private_data: f.ulp,
            initiator: true,
        };
        if let Some(kind) = rtr {
            self.io.tx.extend_from_slice(&rtr::rtr_fpdu(kind, crc));
            if kind == RtrKind::Read {
                self.state = InitiatorState::AwaitReadResponse(n);
                return Ok(());
            }
        }
        self.state = InitiatorState::Over;
        self.event = Some(InitiatorEvent::Established(n));
        Ok(())
    }
}

/// An MPA Request as the responder received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The Request's revision.
    pub revision: u8,
    /// Whether the initiator asked for CRC.
    pub crc: bool,
    /// The initiator's IRD/ORD word (H set).
    pub ird_ord: Option<IrdOrd>,
    /// The RTR kinds offered, if the initiator asks for peer-to-peer mode.
    pub rtr_offer: Option<RtrOffer>,
    /// The initiator's ULP private data.
    pub private_data: Vec<u8>,
}

/// What a [`Responder`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ResponderEvent {
    /// A Request arrived: answer it with [`Responder::accept`] or
    /// [`Responder::reject`].
    Request(Request),
    /// The connection is in full operation once [`Responder::transmit`] is
    /// empty (it may still hold the Reply, or the Read RTR's response).
    Established(Negotiated),
}

#[derive(Debug)]
enum ResponderState {
    AwaitRequest,
    /// Request received and acceptable (`rtr` is the kind picked).
    Answer {
        request: Request,
        rtr: Option<RtrKind>,
    },
    /// Request received but refused; only a reject can answer it.
    Refused {
        request: Request,
    },
    AwaitRtr(Negotiated),
    Over,
}

/// The passive side of MPA negotiation: takes the Request, sends the Reply
/// (or a reject), takes the RTR in peer-to-peer mode (and answers a Read
/// RTR).
#[derive(Debug)]
pub struct Responder {
    config: MpaConfig,
    io: Io,
    state: ResponderState,
    event: Option<ResponderEvent>,
}

impl Responder {
    /// Waits for a Request.
    pub fn new(config: MpaConfig) -> Result<Self, ConfigError> {
        check_config(&config)?;
        if config.peer_to_peer.is_some_and(|o| o.is_empty()) {
            return Err(ConfigError::EmptyRtrOffer);
        }
        Ok(Self {
            config,
            io: Io::default(),
            state: ResponderState::AwaitRequest,
            event: None,
        })
    }

    /// Bytes to write to the peer (empty when there are none).
    pub fn transmit(&self) -> &[u8] {
        self.io.transmit()
    }

    /// Marks the first `n` bytes of [`Self::transmit`] as written.
    pub fn consumed(&mut self, n: usize) {
        self.io.consumed(n);
    }

    fn expect(&self) -> Expect {
        match self.state {
            ResponderState::AwaitRequest => Expect::Frame,
            ResponderState::AwaitRtr(_) => Expect::Fpdu,
            _ => Expect::Nothing,
        }
    }

    /// How many more octets the handshake needs now (0: none, e.g. while
    /// the Request awaits an answer).
    pub fn want(&self) -> usize {
        self.io.want(self.expect())
    }

    /// Whether the negotiation is over (established, rejected or failed).
    pub fn is_over(&self) -> bool {
        matches!(self.state, ResponderState::Over)
    }

    /// The Request, once received (until answered).
    pub fn request(&self) -> Option<&Request> {
        match &self.state {
            ResponderState::Answer { request, .. } | ResponderState::Refused { request } => {
                Some(request)
            }
            _ => None,
        }
    }

    /// Takes bytes received from the peer; returns how many were consumed
    /// (never more than the handshake needs). An error for which
    /// [`MpaNegotiationError::is_refusal`] holds leaves the Request waiting
    /// for [`Self::reject`]; after any other error the machine is over.
    pub fn receive(&mut self, bytes: &[u8]) -> Result<usize, MpaNegotiationError> {
        if self.is_over() {
            return Err(MpaNegotiationError::Over);
        }
        let r = feed(self, bytes, Self::want, |m| &mut m.io.rx, Self::step);
        if r.is_err() && !matches!(self.state, ResponderState::Refused { .. }) {
            self.state = ResponderState::Over;
        }
        r
    }

    /// The next event, if any.
    pub fn poll(&mut self) -> Option<ResponderEvent> {
        self.event.take()
    }

    fn step(&mut self) -> Result<(), MpaNegotiationError> {
        match &self.state {
            ResponderState::AwaitRequest => {
                let complete = match self.io.frame_complete(self.config.max_private_data) {
                    Ok(c) => c,
                    Err(e) => {
                        // Too much private data is known from a well-formed
                        // header: the Request can still be rejected.
                        if e.is_refusal() && self.io.rx.len() >= HEADER_LEN {
                            let header = core::mem::take(&mut self.io.rx);
                            self.refuse(&header);
                        }
                        return Err(e);
                    }
                };
                if complete {
                    let bytes = core::mem::take(&mut self.io.rx);
                    self.on_request(&bytes)?;
                }
            }
            ResponderState::AwaitRtr(_) => {
                if self.io.fpdu_complete()? {
                    let bytes = core::mem::take(&mut self.io.rx);
                    let state = core::mem::replace(&mut self.state, ResponderState::Over);
                    if let ResponderState::AwaitRtr(n) = state {
                        let kind = n.rtr.unwrap_or(RtrKind::Write);
                        if let ReceivedRtr::Read(r) = rtr::recognise_rtr(&bytes, n.crc, kind)? {
                            self.io
                                .tx
                                .extend_from_slice(&rtr::read_rtr_response_fpdu(&r, n.crc));
                        }
                        self.event = Some(ResponderEvent::Established(n));
                    }
                }
            }
            _ => return Err(MpaNegotiationError::Over),
        }
        Ok(())
    }

    fn on_request(&mut self, bytes: &[u8]) -> Result<(), MpaNegotiationError> {
        let f = parse_frame(bytes, FrameKind::Request, self.config.max_private_data);
        let f = match f {
            Ok(f) => f,
            Err(e) => {
                // A well-formed frame whose private data is refused can still
                // be answered with a reject.
                if e.is_refusal() {
                    self.refuse(bytes);
                }
                return Err(e);
            }
        };
        let ird_ord = if f.enhanced { f.ird_ord } else { None };
        let rtr_offer = ird_ord
            .filter(|w| w.peer_to_peer)
            .map(|w| RtrOffer::from_ird_ord(&w));
        let request = Request {
            revision: f.revision,
            crc: f.crc,
            ird_ord,
            rtr_offer,
            private_data: f.ulp,
        };
        let refusal = if f.markers {
            Some(MpaNegotiationError::MarkersRequested)
        } else if f.crc && self.config.crc == CrcPolicy::Off {
            Some(MpaNegotiationError::CrcRefused)
        } else {
            None
        };
        let accepted = self.config.peer_to_peer.unwrap_or(RtrOffer::WRITE_READ);
        let mut rtr = None;
        let mut refusal = refusal;
        // Peer-to-peer needs the IRD/ORD word in both frames: only when
        // this side speaks revision 2.
        if let (Some(offered), None) = (rtr_offer, &refusal)
            && self.config.revision == REVISION_2
        {
            rtr = accepted.pick(&offered);
            if rtr.is_none() {
                refusal = Some(MpaNegotiationError::NoCommonRtr { offered, accepted });
            }
        }
        if let Some(e) = refusal {
            self.state = ResponderState::Refused { request };
            return Err(e);
        }
        self.event = Some(ResponderEvent::Request(request.clone()));
        self.state = ResponderState::Answer { request, rtr };
        Ok(())
    }

    /// Keeps what is needed to reject a Request whose private data was
    /// refused.
    fn refuse(&mut self, bytes: &[u8]) {
        let frame = Frame::new_unchecked(bytes);
        self.state = ResponderState::Refused {
            request: Request {
                revision: frame.revision(),
                crc: frame.crc(),
                ird_ord: None,
                rtr_offer: None,
                private_data: Vec::new(),
            },
        };
    }

    /// The revision of the Reply to `request`, and whether it carries the
    /// IRD/ORD word.
    fn reply_revision(&self, request: &Request) -> (u8, bool) {
        let revision = request.revision.min(self.config.revision);
        (
            revision,
            revision == REVISION_2 && request.ird_ord.is_some(),
        )
    }

    /// Accepts the Request: queues the Reply carrying `private_data`, this
    /// side's `ird` and `ord` (lowered to the initiator's IRD) and the RTR
    /// kind picked. Without peer-to-peer mode the connection is established
    /// at once; with it, once the RTR has been received.
    pub fn accept(&mut self, private_data: &[u8], ird: u16, ord: u16) -> Result<(), ConfigError> {
        check_ird_ord(ird, ord)?;
        check_private_data(&self.config, private_data)?;
        let ResponderState::Answer { request, rtr } = &self.state else {
            return Err(ConfigError::NotAwaitingAnswer);
        };
        let rtr = *rtr;
        let (revision, enhanced) = self.reply_revision(request);
        let crc = request.crc || self.config.crc == CrcPolicy::Required;
        let peer = if enhanced { request.ird_ord } else { None };
        let ord = peer.map_or(ord, |p| ord.min(p.ird));
        let word = peer.map(|_| {
            let o = rtr.map(RtrOffer::only).unwrap_or_default();
            IrdOrd {
                ird,
                ord,
                peer_to_peer: rtr.is_some(),
                send_rtr: o.send,
                write_rtr: o.write,
                read_rtr: o.read,
            }
        });
        let reply = build_frame(FrameKind::Reply, crc, false, revision, word, private_data)
            .map_err(|_| ConfigError::PrivateDataTooLong {
                len: private_data.len(),
                max: self.config.max_private_data,
            })?;
        let n = Negotiated {
            revision,
            enhanced,
            crc,
            ird,
            ord,
            peer_ird: peer.map(|p| p.ird),
            peer_ord: peer.map(|p| p.ord),
            rtr,
            peer_private_data: request.private_data.clone(),
            initiator: false,
        };
        self.io.tx.extend_from_slice(&reply);
        if rtr.is_some() {
            self.state = ResponderState::AwaitRtr(n);
        } else {
            self.state = ResponderState::Over;
            self.event = Some(ResponderEvent::Established(n));
        }
        Ok(())
    }

    /// Rejects the Request (also one refused by [`Self::receive`]): queues
    /// a Reply with R set carrying `private_data`; the negotiation is over
    /// once it is written.
    pub fn reject(&mut self, private_data: &[u8]) -> Result<(), ConfigError> {
        check_private_data(&self.config, private_data)?;
        let (ResponderState::Answer { request, .. } | ResponderState::Refused { request }) =
            &self.state
        else {
            return Err(ConfigError::NotAwaitingAnswer);
        };
        let (revision, enhanced) = self.reply_revision(request);
        let revision = if matches!(revision, REVISION_1 | REVISION_2) {
            revision
        } else {
            self.config.revision
        };
        let word = enhanced.then_some(IrdOrd {
            ird: self.config.ird,
            ord: self.config.ord,
            ..IrdOrd::default()
        });
        let crc = request.crc || self.config.crc == CrcPolicy::Required;
        let reply = build_frame(FrameKind::Reply, crc, true, revision, word, private_data)
            .map_err(|_| ConfigError::PrivateDataTooLong {
                len: private_data.len(),
                max: self.config.max_private_data,
            })?;
        self.io.tx.extend_from_slice(&reply);
        self.state = ResponderState::Over;
        Ok(())
    }
}
