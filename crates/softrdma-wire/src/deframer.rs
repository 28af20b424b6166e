//! The incremental TCP byte stream → FPDU deframer (RFC 5044 sections 4 and 5).
//!
//! In full operation phase an MPA receiver sees a TCP byte stream of FPDUs
//! (RFC 5044 section 4.2), possibly with markers every 512 octets (section
//! 4.3), cut into segments at arbitrary places: an FPDU may span many
//! segments, a segment may carry many FPDUs, and kernel siw really does send
//! the 4-byte CRC field as a segment of its own (`ib_write_bw.pcap`):
//!
//! ```text
//!  stream:  | len | DDP hdr | payload ........ | pad | CRC | len | DDP hdr | ...
//!  segments:|<------------ 1444 ----------------------->|<4>|<------ ...
//!  markers: every 512 octets from the start of full operation phase, 4 octets
//! ```
//!
//! [`Deframer`] cuts such a stream back into FPDUs. It is configured with what
//! the MPA negotiation settled ([`DeframerConfig`]: CRC on or off, markers on
//! or off, the stream position of the first byte it will see) and then used in
//! one of two ways:
//!
//! * **slice mode** (tools, tests): [`Deframer::deframe`] takes any chunk of
//!   the stream and returns the complete FPDUs in it, one per call. A whole
//!   FPDU inside the chunk is returned as a slice of the chunk (no copy);
//!   only an FPDU that straddles chunks, or carries markers, is assembled in
//!   an internal buffer (reused, so there is no allocation per FPDU).
//! * **direct-placement mode** (the engine): [`Deframer::next_read`] says what
//!   to read next and how much; the engine reads the ULPDU length field and
//!   DDP header into the deframer, then reads the payload straight from the
//!   socket into its destination and only *reports* it
//!   ([`Deframer::handle_payload`] with the placed bytes, or
//!   [`Deframer::handle_payload_by`] with their length when the caller
//!   cannot form a slice of the destination and updates the CRC itself),
//!   then the deframer consumes pad and CRC and checks the CRC. See
//!   [`Deframer`] for the order of calls.
//!
//! Both modes share one state machine, and the tests check they give the same
//! results on the same streams, at every split point.
//!
//! "Need more bytes" is never an error. A malformed stream gives a typed
//! [`DeframeError`]; the deframer then stays failed (the stream cannot be
//! resynchronised: MPA leaves that to the ULP's Terminate and close).

use crate::crc::{self, CRC_LEN, Crc32c};
use crate::ddp;
use crate::fpdu::{self, CrcVerdict, ULPDU_LENGTH_LEN};
use crate::markers::{self, MARKER_LEN, MarkerRepr};

/// Largest header the deframer reads: the ULPDU Length field and an
/// untagged DDP header.
pub const MAX_HEADER_LEN: usize = ULPDU_LENGTH_LEN + ddp::UNTAGGED_HEADER_LEN;

/// Header bytes asked for before the DDP header type is known: the ULPDU
/// Length field and the shortest (tagged) DDP header.
const MIN_HEADER_LEN: usize = ULPDU_LENGTH_LEN + ddp::TAGGED_HEADER_LEN;

/// [`markers::MARKER_INTERVAL`] as a stream position difference.
const MARKER_INTERVAL: u64 = markers::MARKER_INTERVAL as u64;

/// What the MPA negotiation settled for the direction being received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeframerConfig {
    /// CRC negotiated: check the CRC field of every FPDU. When off, the field
    /// is consumed and not checked (RFC 5044: "MUST NOT be checked").
    pub crc: bool,
    /// The peer inserts markers (we asked for them with the M flag).
    pub markers: bool,
    /// Stream position of the first byte the deframer will see, counted from
    /// the first byte of full operation phase (where the first marker sits,
    /// see [`crate::markers`]). 0 for a deframer that starts right after the
    /// MPA Request/Reply. Only matters with markers. It must not fall inside
    /// a marker (position mod 512 in 1..=3): there the next marker is taken
    /// to be the following one.
    pub stream_position: u64,
    /// Largest ULPDU length accepted; a longer one is
    /// [`DeframeError::UlpduTooLong`]. Defaults to 65535 (no limit).
    pub max_ulpdu_len: u16,
}

impl DeframerConfig {
    /// CRC and markers as negotiated; stream position 0; no ULPDU limit.
    #[must_use]
    pub const fn new(crc: bool, markers: bool) -> Self {
        DeframerConfig {
            crc,
            markers,
            stream_position: 0,
            max_ulpdu_len: u16::MAX,
        }
    }

    /// The same, with the stream position of the first byte.
    #[must_use]
    pub const fn with_stream_position(mut self, pos: u64) -> Self {
        self.stream_position = pos;
        self
    }

    /// The same, with a largest acceptable ULPDU length.
    #[must_use]
    pub const fn with_max_ulpdu_len(mut self, max: u16) -> Self {
        self.max_ulpdu_len = max;
        self
    }
}

/// The stream is not a valid FPDU stream. Every variant names the stream
/// position (counted as in [`DeframerConfig::stream_position`]) of the
/// ULPDU Length field of the FPDU concerned, or of the marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeframeError {
    /// The ULPDU cannot hold the DDP header its first byte announces (or, when
    /// only the length is in, the shortest DDP header).
    #[error(
        "FPDU at stream position {position}: ULPDU length {len} is shorter than the {min}-byte DDP header"
    )]
    UlpduTooShort {
        /// Stream position of the ULPDU Length field.
        position: u64,
        /// The ULPDU length found.
        len: u16,
        /// The DDP header length required.
        min: u16,
    },
    /// The ULPDU length exceeds [`DeframerConfig::max_ulpdu_len`].
    #[error("FPDU at stream position {position}: ULPDU length {len} exceeds the maximum {max}")]
    UlpduTooLong {
        /// Stream position of the ULPDU Length field.
        position: u64,
        /// The ULPDU length found.
        len: u16,
        /// The configured maximum.
        max: u16,
    },
    /// CRC negotiated and the CRC field does not match the FPDU.
    #[error(
        "FPDU at stream position {position}: CRC mismatch: computed {expected:#010x}, CRC field {found:#010x}"
    )]
    CrcMismatch {
        /// Stream position of the ULPDU Length field.
        position: u64,
        /// The CRC computed over the received bytes.
        expected: u32,
        /// The CRC value in the CRC field.
        found: u32,
    },
    /// A marker's FPDUPTR does not point at the FPDU it belongs to.
    #[error("marker at stream position {position}: FPDUPTR {found}, expected {expected:?}")]
    BadMarker {
        /// Stream position of the marker.
        position: u64,
        /// The FPDUPTR found.
        found: u16,
        /// The FPDUPTR the marker must carry (`None`: the FPDU is too long
        /// for any 16-bit pointer to reach its header).
        expected: Option<u16>,
    },
}

/// What the deframer needs next, in direct-placement mode. Every variant
/// gives the largest number of bytes that may be read for it; fewer is fine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Want {
    /// The ULPDU Length field and DDP header of the next FPDU (or the rest of
    /// them). Read at most `len` bytes and pass them to
    /// [`Deframer::handle_bytes`].
    Header {
        /// Bytes wanted (at least 1).
        len: usize,
    },
    /// Payload of the current FPDU (the ULPDU after the DDP header). Read at
    /// most `len` bytes straight into their destination and report them with
    /// [`Deframer::handle_payload`] (or by length with
    /// [`Deframer::handle_payload_by`]). `len` stops at the FPDU's payload
    /// end and at the next marker.
    Payload {
        /// Bytes that may be read contiguously (at least 1).
        len: usize,
    },
    /// (The rest of) a marker. Read at most `len` bytes and pass them to
    /// [`Deframer::handle_bytes`].
    Marker {
        /// Bytes wanted (1 to 4).
        len: usize,
    },
    /// Pad and CRC field of the current FPDU (or the rest of them). Read at
    /// most `len` bytes and pass them to [`Deframer::handle_bytes`].
    Trailer {
        /// Bytes wanted (at least 1).
        len: usize,
    },
}

impl Want {
    /// The number of bytes wanted, whatever the kind.
    #[must_use]
    pub const fn len(&self) -> usize {
        match *self {
            Want::Header { len }
            | Want::Payload { len }
            | Want::Marker { len }
            | Want::Trailer { len } => len,
        }
    }

    /// Never true: every want asks for at least one byte.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Something that happened while bytes were handled (direct-placement mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The ULPDU Length field and DDP header of a new FPDU are complete:
    /// [`Deframer::header`] returns them until the FPDU ends. The payload
    /// comes next (possibly none).
    Header,
    /// The FPDU ended: pad and CRC field consumed, the CRC checked when
    /// negotiated (a mismatch is [`DeframeError::CrcMismatch`] instead).
    FpduEnd {
        /// [`CrcVerdict::Good`] or [`CrcVerdict::NotNegotiated`].
        crc: CrcVerdict,
    },
}

/// Result of [`Deframer::handle_bytes`], [`Deframer::handle_payload`] and
/// [`Deframer::handle_payload_by`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Handled {
    /// Bytes consumed from the front of the slice passed (never more than
    /// the current [`Want`] allows, except a whole untagged header when the
    /// want is the shortest header's and markers are off: see
    /// [`Deframer::handle_bytes`]; 0 if the call did not match it).
    pub consumed: usize,
    /// What these bytes completed, if anything.
    pub event: Option<Event>,
}

/// The header of the FPDU being received (direct-placement mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpduHeader<'a> {
    /// The ULPDU Length field.
    pub ulpdu_len: u16,
    /// The DDP header (14 bytes tagged, 18 untagged), markers removed.
    pub ddp_header: &'a [u8],
    /// Stream position of the ULPDU Length field.
    pub position: u64,
}

impl FpduHeader<'_> {
    /// Length of the payload after the DDP header.
    #[must_use]
    pub fn payload_len(&self) -> usize {
        usize::from(self.ulpdu_len).saturating_sub(self.ddp_header.len())
    }
}

/// A complete FPDU returned by slice mode ([`Deframer::deframe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deframed<'a> {
    /// The ULPDU (DDP header and payload), markers removed.
    pub ulpdu: &'a [u8],
    /// [`CrcVerdict::Good`] or [`CrcVerdict::NotNegotiated`].
    pub crc: CrcVerdict,
    /// Stream position of the ULPDU Length field.
    pub position: u64,
}

/// A whole FPDU at the front of the bytes given to
/// [`Deframer::peek_whole`] or [`Deframer::peek_whole_mut`], its lengths
/// and CRC checked by that deframer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WholeFpdu<'a> {
    /// The FPDU, ULPDU Length field to CRC field.
    fpdu: &'a [u8],
    /// Its ULPDU length.
    ulpdu_len: u16,
    /// Stream position of its ULPDU Length field.
    position: u64,
}

impl<'a> WholeFpdu<'a> {
    /// The ULPDU: DDP header, then payload.
    #[must_use]
    #[inline]
    pub fn ulpdu(&self) -> &'a [u8] {
        self.fpdu
            .get(ULPDU_LENGTH_LEN..ULPDU_LENGTH_LEN + usize::from(self.ulpdu_len))
            .unwrap_or_default()
    }

    /// Bytes of the stream the FPDU takes (length field, ULPDU, pad, CRC).
    #[must_use]
    #[inline]
    pub const fn len(&self) -> usize {
        self.fpdu.len()
    }

    /// Never true: an FPDU has at least its length and CRC fields.
    #[must_use]
    pub const fn is_empty(&self) -> bool {
        self.fpdu.is_empty()
    }

    /// Stream position of its ULPDU Length field.
    #[must_use]
    pub const fn position(&self) -> u64 {
        self.position
    }
}

/// A whole FPDU [`Deframer::peek_whole_mut`] checked, not taken yet: the
/// deframer stays borrowed until [`PeekedWhole::take`] takes the FPDU or
/// this is dropped (and nothing changes).
#[derive(Debug)]
pub struct PeekedWhole<'d, 'a> {
    deframer: &'d mut Deframer,
    fpdu: WholeFpdu<'a>,
}

impl<'a> PeekedWhole<'_, 'a> {
    /// The FPDU.
    #[must_use]
    #[inline(always)]
    pub const fn fpdu(&self) -> &WholeFpdu<'a> {
        &self.fpdu
    }

    /// Takes the FPDU: the deframer is left as the byte-wise calls would
    /// have left it (at the next FPDU boundary, [`Deframer::header`]
    /// `None`).
    #[inline(always)]
    pub fn take(self) -> WholeFpdu<'a> {
        self.deframer.consume_peeked(&self.fpdu);
        self.fpdu
    }
}

/// Where in the FPDU the next non-marker byte belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// ULPDU Length field and DDP header.
    Header,
    /// ULPDU bytes after the DDP header.
    Payload,
    /// Pad, then CRC field.
    Trailer,
}

/// The incremental FPDU deframer. See the [module documentation](self).
///
/// # Direct-placement mode: order of calls
///
/// ```text
///  loop {
///      match deframer.next_read() {
///          Want::Header { len } | Want::Marker { len } | Want::Trailer { len } => {
///              n = read(socket, &mut small[..len])          // 0 < n <= len
///              handled = deframer.handle_bytes(&small[..n])?
///          }
///          Want::Payload { len } => {
///              n = read(socket, destination[..len])          // placed, not copied
///              handled = deframer.handle_payload(&destination[..n])?
///          }
///      }
///      match handled.event {
///          Some(Event::Header) => validate deframer.header(), pick the destination
///          Some(Event::FpduEnd { .. }) => the FPDU is complete and its CRC good
///          None => {}
///      }
///  }
/// ```
///
/// * `handle_bytes` takes the bytes of [`Want::Header`], [`Want::Marker`]
///   and [`Want::Trailer`]; `handle_payload` takes the bytes of
///   [`Want::Payload`] after they were placed (the deframer reads them for
///   the CRC and never copies them). A call that does not match
///   [`Deframer::next_read`] consumes nothing; bytes beyond the current want
///   are not consumed ([`Handled::consumed`]).
/// * [`Event::Header`] comes once per FPDU; [`Deframer::header`] is `Some`
///   from then until [`Event::FpduEnd`].
/// * Payload placed before a [`DeframeError::CrcMismatch`] must be treated
///   as never received (the engine does not complete the work request).
/// * After an error, every `handle_*` call returns the same error.
///
/// ```
/// use softrdma_wire::deframer::{Deframer, DeframerConfig, Event, Want};
/// use softrdma_wire::fpdu;
/// // A tagged ULPDU: 14-byte DDP header, then 5 bytes of payload.
/// let mut ulpdu = vec![0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
/// ulpdu.extend_from_slice(b"hello");
/// let mut wire = [0u8; 32];
/// let n = fpdu::emit(&ulpdu, true, &mut wire)?;
/// let mut socket = &wire[..n];
///
/// let mut d = Deframer::new(DeframerConfig::new(true, false));
/// let mut placed = Vec::new();
/// loop {
///     let want = d.next_read();
///     let (bytes, rest) = socket.split_at(want.len().min(socket.len()));
///     socket = rest;
///     let handled = match want {
///         Want::Payload { .. } => {
///             placed.extend_from_slice(bytes); // "read into the destination"
///             d.handle_payload(bytes)?
///         }
///         _ => d.handle_bytes(bytes)?,
///     };
///     if let Some(Event::FpduEnd { crc }) = handled.event {
///         assert!(crc.is_acceptable());
///         break;
///     }
/// }
/// assert_eq!(placed, b"hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # Slice mode
///
/// ```
/// use softrdma_wire::deframer::{Deframer, DeframerConfig};
/// use softrdma_wire::fpdu;
/// let ulpdu = [0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
/// let mut wire = vec![0u8; 40];
/// let n = fpdu::emit(&ulpdu, true, &mut wire)?;
/// fpdu::emit(&ulpdu, true, &mut wire[n..])?;
///
/// let mut d = Deframer::new(DeframerConfig::new(true, false));
/// let mut count = 0;
/// for chunk in wire.chunks(7) {
///     let mut rest = chunk;
///     loop {
///         let (used, out) = d.deframe(rest);
///         rest = &rest[used..];
///         match out {
///             None => break, // the whole chunk is consumed
///             Some(fpdu) => {
///                 assert_eq!(fpdu?.ulpdu, &ulpdu[..]);
///                 count += 1;
///             }
///         }
///     }
/// }
/// assert_eq!(count, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Deframer {
    /// What was negotiated; never changes.
    config: DeframerConfig,
    /// Stream position of the next byte to consume (markers counted).
    pos: u64,
    /// Start of the next marker not yet completely consumed; `u64::MAX` when
    /// markers are off. Invariant: `pos < next_marker + 4`; the deframer is
    /// inside a marker exactly when `pos >= next_marker`.
    next_marker: u64,
    /// The marker being consumed: `marker[..pos - next_marker]` is valid
    /// while inside a marker.
    marker: [u8; MARKER_LEN],
    /// Where the next non-marker byte belongs.
    phase: Phase,
    /// CRC over every byte of the current FPDU consumed so far (its leading
    /// marker and inner markers included, CRC field excluded). Reset when an
    /// FPDU ends; never updated when CRC is off.
    crc: Crc32c,
    /// ULPDU Length field then DDP header, markers removed:
    /// `hdr[..hdr_have]` is valid.
    hdr: [u8; MAX_HEADER_LEN],
    /// Valid bytes in `hdr`; 0 at an FPDU boundary.
    hdr_have: usize,
    /// Header length wanted: [`MIN_HEADER_LEN`] until the first ULPDU byte
    /// is in, then 2 plus the DDP header length. `hdr_have <= hdr_need`.
    hdr_need: usize,
    /// Stream position of the current FPDU's ULPDU Length field (valid once
    /// `hdr_have > 0`; kept after the FPDU ends until the next one starts).
    header_pos: u64,
    /// ULPDU length of the current FPDU (valid once `hdr_have >= 2`).
    ulpdu_len: u16,
    /// Payload bytes of the current FPDU still to come (in `Phase::Payload`).
    payload_left: usize,
    /// Pad bytes still to come (in `Phase::Trailer`).
    pad_left: usize,
    /// CRC field: `crc_field[..crc_have]` is valid (in `Phase::Trailer`).
    crc_field: [u8; CRC_LEN],
    /// Valid bytes in `crc_field`.
    crc_have: usize,
    /// The first error; once set, the deframer only returns it.
    error: Option<DeframeError>,
    /// Slice mode: the ULPDU of an FPDU assembled across chunks (or with
    /// markers): DDP header then payload. Cleared per FPDU, capacity kept.
    ulpdu: Vec<u8>,
}

impl Deframer {
    /// A deframer at an FPDU boundary, at `config.stream_position`.
    #[must_use]
    pub fn new(config: DeframerConfig) -> Self {
        let pos = config.stream_position;
        let next_marker = if config.markers {
            markers::next_marker_position(pos)
        } else {
            u64::MAX
        };
        Deframer {
            config,
            pos,
            next_marker,
            marker: [0; MARKER_LEN],
            phase: Phase::Header,
            crc: Crc32c::new(),
            hdr: [0; MAX_HEADER_LEN],
            hdr_have: 0,
            hdr_need: MIN_HEADER_LEN,
            header_pos: pos,
            ulpdu_len: 0,
            payload_left: 0,
            pad_left: 0,
            crc_field: [0; CRC_LEN],
            crc_have: 0,
            error: None,
            ulpdu: Vec::new(),
        }
    }

    /// The configuration.
    #[must_use]
    pub const fn config(&self) -> &DeframerConfig {
        &self.config
    }

    /// Stream position of the next byte to consume.
    #[must_use]
    pub const fn stream_position(&self) -> u64 {
        self.pos
    }

    /// Whether the deframer is between FPDUs (no byte of the next FPDU, not
    /// even its leading marker, consumed yet).
    #[must_use]
    pub const fn is_at_fpdu_boundary(&self) -> bool {
        matches!(self.phase, Phase::Header) && self.hdr_have == 0 && self.pos <= self.next_marker
    }

    /// The error the deframer failed with, if it did.
    #[must_use]
    pub const fn error(&self) -> Option<DeframeError> {
        self.error
    }

    /// What to read next (direct-placement mode).
    #[must_use]
    pub fn next_read(&self) -> Want {
        let limit = if self.config.markers {
            if self.pos >= self.next_marker {
                let have = usize::try_from(self.pos - self.next_marker).unwrap_or(0);
                return Want::Marker {
                    len: MARKER_LEN.saturating_sub(have),
                };
            }
            usize::try_from(self.next_marker - self.pos).unwrap_or(usize::MAX)
        } else {
            usize::MAX
        };
        match self.phase {
            Phase::Header => Want::Header {
                len: (self.hdr_need - self.hdr_have).min(limit),
            },
            Phase::Payload => Want::Payload {
                len: self.payload_left.min(limit),
            },
            Phase::Trailer => Want::Trailer {
                len: (self.pad_left + CRC_LEN - self.crc_have).min(limit),
            },
        }
    }

    /// The header of the current FPDU, from [`Event::Header`] until
    /// [`Event::FpduEnd`].
    #[must_use]
    pub fn header(&self) -> Option<FpduHeader<'_>> {
        if matches!(self.phase, Phase::Header) {
            return None;
        }
        Some(FpduHeader {
            ulpdu_len: self.ulpdu_len,
            ddp_header: self
                .hdr
                .get(ULPDU_LENGTH_LEN..self.hdr_need)
                .unwrap_or_default(),
            position: self.header_pos,
        })
    }

    /// Consumes framing bytes: those of [`Want::Header`], [`Want::Marker`]
    /// or [`Want::Trailer`] (up to the wanted length; without markers, a
    /// header is taken up to its end, which its first DDP byte tells: an
    /// untagged header in one call when `bytes` hold it, though the want
    /// before it is the shortest header's length).
    ///
    /// # Errors
    ///
    /// A [`DeframeError`] if the bytes make the stream invalid (or made it
    /// invalid earlier).
    pub fn handle_bytes(&mut self, bytes: &[u8]) -> Result<Handled, DeframeError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let want = self.next_read();
        let mut n = want.len().min(bytes.len());
        if let Want::Header { .. } = want
            && self.hdr_have == 0
            && !self.config.markers
            && let Some(&first) = bytes.get(ULPDU_LENGTH_LEN)
        {
            // The header's first byte tells its length: an untagged
            // header is taken whole in one call when `bytes` hold it, not
            // as the shortest header's length and then the rest.
            // `consume_header` checks the ULPDU Length against it.
            n = (ULPDU_LENGTH_LEN + ddp::header_len(first)).min(bytes.len());
        }
        let Some(b) = bytes.get(..n) else {
            return Ok(Handled {
                consumed: 0,
                event: None,
            });
        };
        if n == 0 {
            return Ok(Handled {
                consumed: 0,
                event: None,
            });
        }
        let r = match want {
            Want::Marker { .. } => self.consume_marker(b),
            Want::Header { .. } => self.consume_header(b),
            Want::Trailer { .. } => self.consume_trailer(b),
            Want::Payload { .. } => {
                return Ok(Handled {
                    consumed: 0,
                    event: None,
                });
            }
        };
        match r {
            Ok(event) => Ok(Handled { consumed: n, event }),
            Err(e) => Err(self.fail(e)),
        }
    }

    /// Reports payload bytes of [`Want::Payload`] that the caller placed in
    /// their destination (up to the wanted length). They are read for the
    /// CRC (when negotiated), never copied.
    ///
    /// # Errors
    ///
    /// The earlier [`DeframeError`] if the deframer already failed.
    pub fn handle_payload(&mut self, placed: &[u8]) -> Result<Handled, DeframeError> {
        self.handle_payload_by(placed.len(), |crc, n| {
            crc.update(placed.get(..n).unwrap_or_default());
        })
    }

    /// Reports `n` payload bytes of [`Want::Payload`] that the caller placed
    /// in their destination without handing them over (memory it may not
    /// form a slice of, e.g. registered memory other threads may write).
    /// When CRC is negotiated, `update` is called once with the running CRC
    /// and the number of bytes accepted (at most the wanted length), and
    /// must feed it exactly those bytes, in order; it is not called when
    /// CRC is off or nothing is accepted.
    ///
    /// # Errors
    ///
    /// The earlier [`DeframeError`] if the deframer already failed.
    pub fn handle_payload_by(
        &mut self,
        n: usize,
        update: impl FnOnce(&mut Crc32c, usize),
    ) -> Result<Handled, DeframeError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let Want::Payload { len } = self.next_read() else {
            return Ok(Handled {
                consumed: 0,
                event: None,
            });
        };
        let n = len.min(n);
        if self.config.crc && n > 0 {
            update(&mut self.crc, n);
        }
        self.pos += n as u64;
        self.payload_left -= n;
        if self.payload_left == 0 {
            self.enter_trailer();
        }
        Ok(Handled {
            consumed: n,
            event: None,
        })
    }

    /// Direct-placement mode, one pass: when the deframer is at an FPDU
    /// boundary without markers and `input` starts with a whole FPDU whose
    /// lengths pass the checks of [`Deframer::handle_bytes`] and whose CRC
    /// (when negotiated) is good, returns it; changes nothing. `None` in
    /// every other case, an invalid FPDU included: the byte-wise calls
    /// then report its error, in their order. [`Deframer::peek_whole_mut`]
    /// checks it so that it can be taken.
    #[must_use]
    #[inline(always)]
    pub fn peek_whole<'a>(&self, input: &'a [u8]) -> Option<WholeFpdu<'a>> {
        if self.error.is_some()
            || self.config.markers
            || !matches!(self.phase, Phase::Header)
            || self.hdr_have != 0
        {
            return None;
        }
        let &[l0, l1, first, ..] = input else {
            return None;
        };
        let ulpdu_len = u16::from_be_bytes([l0, l1]);
        let fpdu = input.get(..fpdu::fpdu_len(usize::from(ulpdu_len)))?;
        let position = self.pos;
        self.check_len(position, ulpdu_len).ok()?;
        self.check_ddp_len(position, ulpdu_len, first).ok()?;
        if self.config.crc {
            let (covered, field) = fpdu.split_at(fpdu.len() - CRC_LEN);
            let mut running = Crc32c::new();
            running.update(covered);
            let found = crc::from_wire([field[0], field[1], field[2], field[3]]);
            if !crc::matches(running.finish(), found) {
                return None;
            }
        }
        Some(WholeFpdu {
            fpdu,
            ulpdu_len,
            position,
        })
    }

    /// Direct-placement mode, one pass: the FPDU [`Deframer::peek_whole`]
    /// finds at the front of `input`, held with the deframer borrowed
    /// until [`PeekedWhole::take`] takes it (leaving the deframer as the
    /// byte-wise calls would have: at the next FPDU boundary,
    /// [`Deframer::header`] `None`); dropped untaken, nothing changes.
    /// `None` when there is no whole valid FPDU there. The checks and the
    /// take are made by the same deframer with nothing in between: an FPDU
    /// checked under another configuration or elsewhere in the stream
    /// cannot be taken.
    #[must_use]
    #[inline(always)]
    pub fn peek_whole_mut<'d, 'a>(&'d mut self, input: &'a [u8]) -> Option<PeekedWhole<'d, 'a>> {
        let fpdu = self.peek_whole(input)?;
        Some(PeekedWhole {
            deframer: self,
            fpdu,
        })
    }

    /// Takes `f`, which [`Deframer::peek_whole`] just returned for this
    /// deframer unchanged since (so at its position, at an FPDU boundary,
    /// without markers or an error).
    #[inline(always)]
    fn consume_peeked(&mut self, f: &WholeFpdu<'_>) {
        debug_assert_eq!(f.position, self.pos);
        let hdr_len = f
            .fpdu
            .get(ULPDU_LENGTH_LEN)
            .map_or(MIN_HEADER_LEN, |&b| ULPDU_LENGTH_LEN + ddp::header_len(b));
        match f.fpdu.first_chunk::<MAX_HEADER_LEN>() {
            // An untagged header: a copy of fixed length (no `memcpy` call).
            Some(h) if hdr_len == MAX_HEADER_LEN => self.hdr = *h,
            _ => {
                if let (Some(dst), Some(src)) = (self.hdr.get_mut(..hdr_len), f.fpdu.get(..hdr_len))
                {
                    dst.copy_from_slice(src);
                }
            }
        }
        if let Some(field) = f.fpdu.last_chunk::<CRC_LEN>() {
            self.crc_field = *field;
        }
        self.crc_have = CRC_LEN;
        self.header_pos = self.pos;
        self.pos += f.fpdu.len() as u64;
        self.ulpdu_len = f.ulpdu_len;
        self.payload_left = 0;
        self.pad_left = 0;
    }

    /// Slice mode: deframes the next FPDU from `input`, the next bytes of the
    /// stream. Returns the number of bytes of `input` consumed and:
    ///
    /// * `None`: all of `input` was consumed (buffered) and no FPDU completed
    ///   — feed more bytes;
    /// * `Some(Ok(fpdu))`: an FPDU completed; call again with the rest of
    ///   `input` (`&input[consumed..]`);
    /// * `Some(Err(e))`: the stream is invalid.
    ///
    /// The ULPDU borrows `input` when the whole FPDU (without markers) was in
    /// it, and the deframer's buffer otherwise.
    pub fn deframe<'r>(
        &'r mut self,
        input: &'r [u8],
    ) -> (usize, Option<Result<Deframed<'r>, DeframeError>>) {
        if let Some(e) = self.error {
            return (0, Some(Err(e)));
        }
        if matches!(self.phase, Phase::Header)
            && self.hdr_have == 0
            && self.pos < self.next_marker
            && let Some(r) = self.deframe_whole(input)
        {
            return r;
        }
        self.deframe_pieces(input)
    }

    /// Slice mode convenience: deframes all of `chunk`, calling `f` with every
    /// complete FPDU.
    ///
    /// # Errors
    ///
    /// The first [`DeframeError`]; FPDUs before it were passed to `f`.
    pub fn deframe_all(
        &mut self,
        chunk: &[u8],
        mut f: impl FnMut(Deframed<'_>),
    ) -> Result<(), DeframeError> {
        let mut rest = chunk;
        loop {
            let (used, out) = self.deframe(rest);
            match out {
                None => return Ok(()),
                Some(Ok(fpdu)) => f(fpdu),
                Some(Err(e)) => return Err(e),
            }
            rest = rest.get(used..).unwrap_or_default();
        }
    }

    /// Fast path of slice mode: the whole FPDU, with no marker inside it, is
    /// at the front of `input`. Checks exactly what the byte-wise path checks,
    /// in the same order. `None` when the fast path does not apply.
    #[inline]
    fn deframe_whole<'r>(
        &mut self,
        input: &'r [u8],
    ) -> Option<(usize, Option<Result<Deframed<'r>, DeframeError>>)> {
        let &[l0, l1, first, ..] = input else {
            return None;
        };
        let ulpdu_len = u16::from_be_bytes([l0, l1]);
        let total = fpdu::fpdu_len(usize::from(ulpdu_len));
        let fpdu = input.get(..total)?;
        let position = self.pos;
        if self.next_marker - position < total as u64 {
            return None; // a marker inside: byte-wise path
        }
        if let Err(e) = self
            .check_len(position, ulpdu_len)
            .and_then(|()| self.check_ddp_len(position, ulpdu_len, first).map(|_| ()))
        {
            return Some((0, Some(Err(self.fail(e)))));
        }
        let (covered, field) = fpdu.split_at(total - CRC_LEN);
        let crc = if self.config.crc {
            // Continue from the running CRC: it is fresh, or holds the
            // FPDU's leading marker consumed byte-wise by an earlier call.
            let mut running = self.crc;
            running.update(covered);
            let expected = running.finish();
            let found = crc::from_wire([field[0], field[1], field[2], field[3]]);
            if !crc::matches(expected, found) {
                let e = DeframeError::CrcMismatch {
                    position,
                    expected,
                    found,
                };
                return Some((0, Some(Err(self.fail(e)))));
            }
            CrcVerdict::Good
        } else {
            CrcVerdict::NotNegotiated
        };
        self.pos += total as u64;
        self.header_pos = position;
        self.crc = Crc32c::new();
        let ulpdu = covered.get(ULPDU_LENGTH_LEN..ULPDU_LENGTH_LEN + usize::from(ulpdu_len))?;
        Some((
            total,
            Some(Ok(Deframed {
                ulpdu,
                crc,
                position,
            })),
        ))
    }

    /// Byte-wise path of slice mode: drives the direct-placement state
    /// machine, with the internal buffer as the payload destination.
    fn deframe_pieces<'r>(
        &'r mut self,
        input: &'r [u8],
    ) -> (usize, Option<Result<Deframed<'r>, DeframeError>>) {
        let mut consumed = 0;
        loop {
            let rest = input.get(consumed..).unwrap_or_default();
            if rest.is_empty() {
                return (consumed, None);
            }
            let handled = match self.next_read() {
                Want::Payload { len } => {
                    let placed = rest.get(..len.min(rest.len())).unwrap_or_default();
                    self.ulpdu.extend_from_slice(placed);
                    self.handle_payload(placed)
                }
                _ => self.handle_bytes(rest),
            };
            match handled {
                Err(e) => return (consumed, Some(Err(e))),
                Ok(h) => {
                    consumed += h.consumed;
                    match h.event {
                        None => {}
                        Some(Event::Header) => {
                            self.ulpdu.clear();
                            let ddp = self.hdr.get(ULPDU_LENGTH_LEN..self.hdr_need);
                            self.ulpdu.extend_from_slice(ddp.unwrap_or_default());
                        }
                        Some(Event::FpduEnd { crc }) => {
                            let fpdu = Deframed {
                                ulpdu: &self.ulpdu,
                                crc,
                                position: self.header_pos,
                            };
                            return (consumed, Some(Ok(fpdu)));
                        }
                    }
                }
            }
        }
    }

    /// Records the first error and returns it.
    fn fail(&mut self, e: DeframeError) -> DeframeError {
        self.error = Some(e);
        e
    }

    /// Checks a ULPDU length against the shortest DDP header and the limit.
    fn check_len(&self, position: u64, len: u16) -> Result<(), DeframeError> {
        if usize::from(len) < ddp::TAGGED_HEADER_LEN {
            return Err(DeframeError::UlpduTooShort {
                position,
                len,
                min: ddp::TAGGED_HEADER_LEN as u16,
            });
        }
        if len > self.config.max_ulpdu_len {
            return Err(DeframeError::UlpduTooLong {
                position,
                len,
                max: self.config.max_ulpdu_len,
            });
        }
        Ok(())
    }

    /// Checks a ULPDU length against the DDP header its first byte announces;
    /// returns that header's length.
    fn check_ddp_len(&self, position: u64, len: u16, first: u8) -> Result<usize, DeframeError> {
        let ddp_len = ddp::header_len(first);
        if usize::from(len) < ddp_len {
            return Err(DeframeError::UlpduTooShort {
                position,
                len,
                min: ddp_len as u16,
            });
        }
        Ok(ddp_len)
    }

    /// Consumes bytes of a marker (`b` never goes past its end).
    fn consume_marker(&mut self, b: &[u8]) -> Result<Option<Event>, DeframeError> {
        let have = usize::try_from(self.pos - self.next_marker).unwrap_or(MARKER_LEN);
        if let Some(dst) = self.marker.get_mut(have..have + b.len()) {
            dst.copy_from_slice(b);
        }
        if self.config.crc {
            self.crc.update(b);
        }
        self.pos += b.len() as u64;
        if have + b.len() < MARKER_LEN {
            return Ok(None);
        }
        let position = self.next_marker;
        self.next_marker += MARKER_INTERVAL;
        let found = MarkerRepr::from_bytes(self.marker).fpduptr;
        // A marker before any header byte precedes its FPDU: FPDUPTR 0.
        let expected = if matches!(self.phase, Phase::Header) && self.hdr_have == 0 {
            Some(0)
        } else {
            markers::expected_fpduptr(position, self.header_pos)
        };
        match expected {
            Some(x) if x & !3 == found & !3 => Ok(None),
            _ => Err(DeframeError::BadMarker {
                position,
                found,
                expected,
            }),
        }
    }

    /// Consumes header bytes (`b` never goes past the wanted header length).
    fn consume_header(&mut self, b: &[u8]) -> Result<Option<Event>, DeframeError> {
        let old = self.hdr_have;
        if old == 0 {
            self.header_pos = self.pos;
        }
        if let Some(dst) = self.hdr.get_mut(old..old + b.len()) {
            dst.copy_from_slice(b);
        }
        if self.config.crc {
            self.crc.update(b);
        }
        self.pos += b.len() as u64;
        self.hdr_have = old + b.len();
        if old < ULPDU_LENGTH_LEN && self.hdr_have >= ULPDU_LENGTH_LEN {
            self.ulpdu_len = u16::from_be_bytes([self.hdr[0], self.hdr[1]]);
            self.check_len(self.header_pos, self.ulpdu_len)?;
        }
        if old <= ULPDU_LENGTH_LEN && self.hdr_have > ULPDU_LENGTH_LEN {
            let ddp_len = self.check_ddp_len(self.header_pos, self.ulpdu_len, self.hdr[2])?;
            self.hdr_need = ULPDU_LENGTH_LEN + ddp_len;
        }
        if self.hdr_have < self.hdr_need {
            return Ok(None);
        }
        self.payload_left = usize::from(self.ulpdu_len) + ULPDU_LENGTH_LEN - self.hdr_need;
        if self.payload_left == 0 {
            self.enter_trailer();
        } else {
            self.phase = Phase::Payload;
        }
        Ok(Some(Event::Header))
    }

    /// Moves to pad and CRC field.
    fn enter_trailer(&mut self) {
        self.phase = Phase::Trailer;
        self.pad_left = fpdu::pad_len(usize::from(self.ulpdu_len));
        self.crc_have = 0;
    }

    /// Consumes pad and CRC bytes (`b` never goes past the CRC field).
    fn consume_trailer(&mut self, b: &[u8]) -> Result<Option<Event>, DeframeError> {
        let (pad, field) = b.split_at(self.pad_left.min(b.len()));
        if self.config.crc && !pad.is_empty() {
            self.crc.update(pad);
        }
        self.pad_left -= pad.len();
        if let Some(dst) = self
            .crc_field
            .get_mut(self.crc_have..self.crc_have + field.len())
        {
            dst.copy_from_slice(field);
        }
        self.crc_have += field.len();
        self.pos += b.len() as u64;
        if self.crc_have < CRC_LEN {
            return Ok(None);
        }
        let verdict = if self.config.crc {
            let expected = self.crc.finish();
            let found = crc::from_wire(self.crc_field);
            if !crc::matches(expected, found) {
                return Err(DeframeError::CrcMismatch {
                    position: self.header_pos,
                    expected,
                    found,
                });
            }
            CrcVerdict::Good
        } else {
            CrcVerdict::NotNegotiated
        };
        self.phase = Phase::Header;
        self.hdr_have = 0;
        self.hdr_need = MIN_HEADER_LEN;
        self.crc = Crc32c::new();
        Ok(Some(Event::FpduEnd { crc: verdict }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::markers::insert_markers;
    use proptest::prelude::*;

    /// What a deframer produced from a stream: the FPDUs (ULPDU, verdict,
    /// position) and the error it stopped at, if any.
    type Outcome = (Vec<(Vec<u8>, CrcVerdict, u64)>, Option<DeframeError>);

    /// A tagged ULPDU with `payload` bytes of payload.
    fn tagged(payload: usize, seed: u8) -> Vec<u8> {
        let mut u = vec![0xc1, 0x40, 0, 0, 0, seed, 0, 0, 0, 0, 0, 0, 0, 0];
        u.extend((0..payload).map(|i| (i as u8).wrapping_mul(seed).wrapping_add(7)));
        u
    }

    /// An untagged ULPDU with `payload` bytes of payload.
    fn untagged(payload: usize, seed: u8) -> Vec<u8> {
        let mut u = vec![
            0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, seed,
        ];
        u.extend((0..payload).map(|i| (i as u8) ^ seed));
        u
    }

    /// The wire bytes of `ulpdus` sent from stream position `start`.
    fn stream(ulpdus: &[Vec<u8>], crc: bool, markers: bool, start: u64) -> Vec<u8> {
        let mut wire = Vec::new();
        let mut pos = start;
        for u in ulpdus {
            let mut f = vec![0u8; fpdu::fpdu_len(u.len())];
            fpdu::emit(u, crc, &mut f).unwrap();
            if markers {
                let mut m = vec![0u8; markers::marked_len(pos, f.len())];
                insert_markers(&f, pos, crc, &mut m).unwrap();
                f = m;
            }
            pos += f.len() as u64;
            wire.extend_from_slice(&f);
        }
        wire
    }

    /// Slice mode over `wire` cut at `cuts` (sorted offsets).
    fn run_slice(cfg: DeframerConfig, wire: &[u8], cuts: &[usize]) -> Outcome {
        let mut d = Deframer::new(cfg);
        let mut out = Vec::new();
        let mut s = 0;
        for &c in cuts.iter().chain([&wire.len()]) {
            let mut rest = &wire[s..c];
            s = c;
            loop {
                let (used, r) = d.deframe(rest);
                assert!(used <= rest.len());
                match r {
                    None => {
                        assert_eq!(used, rest.len());
                        break;
                    }
                    Some(Ok(f)) => out.push((f.ulpdu.to_vec(), f.crc, f.position)),
                    Some(Err(e)) => return (out, Some(e)),
                }
                rest = &rest[used..];
            }
        }
        (out, None)
    }

    /// Direct-placement mode over `wire`, the socket returning at most up
    /// to the next cut per read.
    fn run_direct(cfg: DeframerConfig, wire: &[u8], cuts: &[usize]) -> Outcome {
        run_direct_mode(cfg, wire, cuts, false)
    }

    /// [`run_direct`], payload reported either as a slice or by length
    /// (`by_len`: [`Deframer::handle_payload_by`], the CRC fed by the
    /// caller).
    fn run_direct_mode(cfg: DeframerConfig, wire: &[u8], cuts: &[usize], by_len: bool) -> Outcome {
        run_direct_pieces(cfg, wire, cuts, |_| by_len)
    }

    /// [`run_direct`], the `i`-th payload piece reported by length when
    /// `by_len(i)`, as a slice otherwise (the engine mixes both within one
    /// FPDU: staged bytes as a slice, a direct `readv` by length).
    fn run_direct_pieces(
        cfg: DeframerConfig,
        wire: &[u8],
        cuts: &[usize],
        by_len: impl Fn(usize) -> bool,
    ) -> Outcome {
        let mut pieces = 0;
        let mut d = Deframer::new(cfg);
        let mut out = Vec::new();
        let mut ulpdu = Vec::new();
        let mut at = 0;
        let mut cuts = cuts.iter().copied().chain([wire.len()]).peekable();
        while at < wire.len() {
            while cuts.peek().is_some_and(|&c| c <= at) {
                cuts.next();
            }
            let seg_end = cuts.peek().copied().unwrap_or(wire.len());
            let want = d.next_read();
            assert!(!want.is_empty());
            let n = want.len().min(seg_end - at);
            let bytes = &wire[at..at + n];
            let r = match want {
                Want::Payload { .. } => {
                    ulpdu.extend_from_slice(bytes);
                    pieces += 1;
                    if by_len(pieces) {
                        d.handle_payload_by(n, |c, k| {
                            assert_eq!(k, n);
                            c.update(&bytes[..k]);
                        })
                    } else {
                        d.handle_payload(bytes)
                    }
                }
                _ => d.handle_bytes(bytes),
            };
            match r {
                Err(e) => return (out, Some(e)),
                Ok(h) => {
                    assert_eq!(h.consumed, n);
                    at += n;
                    match h.event {
                        Some(Event::Header) => {
                            let hdr = d.header().unwrap();
                            ulpdu.clear();
                            ulpdu.extend_from_slice(hdr.ddp_header);
                            assert_eq!(
                                hdr.payload_len() + hdr.ddp_header.len(),
                                usize::from(hdr.ulpdu_len)
                            );
                        }
                        Some(Event::FpduEnd { crc }) => {
                            assert!(d.header().is_none());
                            out.push((std::mem::take(&mut ulpdu), crc, d.header_pos));
                        }
                        None => {}
                    }
                }
            }
        }
        (out, None)
    }

    /// Feeds one FPDU at the front of `wire` through the byte-wise
    /// direct-placement calls, each as large as its want allows: the bytes
    /// taken, and the error if one came.
    fn bytewise_one(d: &mut Deframer, wire: &[u8]) -> (usize, Option<DeframeError>) {
        let mut at = 0;
        loop {
            let want = d.next_read();
            let Some(rest) = wire.get(at..).filter(|r| !r.is_empty()) else {
                return (at, None);
            };
            let bytes = &rest[..want.len().min(rest.len())];
            let r = match want {
                Want::Payload { .. } => d.handle_payload(bytes),
                _ => d.handle_bytes(rest),
            };
            match r {
                Err(e) => return (at, Some(e)),
                Ok(h) => {
                    at += h.consumed;
                    if let Some(Event::FpduEnd { .. }) = h.event {
                        return (at, None);
                    }
                }
            }
        }
    }

    #[test]
    fn a_whole_fpdu_taken_at_once_leaves_the_deframer_as_the_bytewise_calls() {
        for crc in [false, true] {
            let ulpdus = sample_ulpdus();
            let wire = stream(&ulpdus, crc, false, 0);
            let cfg = DeframerConfig::new(crc, false);
            let mut whole = Deframer::new(cfg);
            let mut bytewise = Deframer::new(cfg);
            let mut at = 0;
            for u in &ulpdus {
                let rest = &wire[at..];
                let f = whole.peek_whole(rest).expect("a whole, valid FPDU");
                assert_eq!(f.ulpdu(), &u[..]);
                assert_eq!(f.position(), at as u64);
                // Dropped untaken: nothing changes.
                let before = format!("{whole:?}");
                let peeked = whole.peek_whole_mut(rest).map(|p| *p.fpdu());
                assert_eq!(peeked, Some(f));
                assert_eq!(format!("{whole:?}"), before);
                assert_eq!(whole.peek_whole_mut(rest).map(PeekedWhole::take), Some(f));
                let (n, e) = bytewise_one(&mut bytewise, rest);
                assert_eq!(e, None);
                assert_eq!(n, f.len());
                assert_eq!(format!("{whole:?}"), format!("{bytewise:?}"));
                at += n;
            }
            assert_eq!(at, wire.len());
        }
    }

    #[test]
    fn a_whole_fpdu_is_not_taken_where_the_bytewise_calls_fail_or_wait() {
        let cfg = DeframerConfig::new(true, false);
        let good = stream(&[untagged(5, 9)], true, false, 0);
        let mut cases: Vec<(DeframerConfig, Vec<u8>, bool)> = Vec::new();
        // A CRC field or payload byte flipped: a CRC mismatch byte-wise.
        for at in [4, good.len() - 1, good.len() - 4] {
            let mut w = good.clone();
            w[at] ^= 0x20;
            cases.push((cfg, w, true));
        }
        // ULPDU lengths below either DDP header, or above the limit.
        for len in [0u16, 13, 14, 17] {
            let mut w = good.clone();
            w[..2].copy_from_slice(&len.to_be_bytes());
            cases.push((cfg, w, true));
        }
        cases.push((cfg.with_max_ulpdu_len(20), good.clone(), true));
        // Not all of it there yet.
        for n in [0, 1, 2, 3, 20, good.len() - 1] {
            cases.push((cfg, good[..n].to_vec(), false));
        }
        // Markers negotiated.
        let marked = stream(&[untagged(5, 9)], true, true, 0);
        cases.push((DeframerConfig::new(true, true), marked, false));
        for (cfg, wire, fails) in cases {
            let d = Deframer::new(cfg);
            assert_eq!(d.peek_whole(&wire), None, "{wire:?}");
            let mut b = Deframer::new(cfg);
            let (_, e) = bytewise_one(&mut b, &wire);
            assert_eq!(e.is_some(), fails, "{wire:?}: {e:?}");
        }
        // Inside an FPDU, or after an error: nothing is taken.
        let mut d = Deframer::new(cfg);
        d.handle_bytes(&good[..3]).unwrap();
        assert_eq!(d.peek_whole(&good[3..]), None);
        let mut bad = good.clone();
        bad[0] = 0xff;
        let mut d = Deframer::new(cfg.with_max_ulpdu_len(100));
        assert!(d.handle_bytes(&bad).is_err());
        assert_eq!(d.peek_whole(&good), None);
        // What `peek_whole` refuses, `peek_whole_mut` refuses.
        let mut d = Deframer::new(cfg);
        d.handle_bytes(&good[..3]).unwrap();
        let before = format!("{d:?}");
        assert!(d.peek_whole_mut(&good[3..]).is_none());
        assert_eq!(format!("{d:?}"), before);
    }

    /// The checks are those of the deframer that takes the FPDU: an FPDU
    /// good for a deframer without CRC, or with a larger ULPDU limit, is
    /// not taken by one with CRC or a smaller limit (each call of
    /// `peek_whole_mut` checks, in its own configuration).
    #[test]
    fn a_whole_fpdu_is_checked_by_the_deframer_that_takes_it() {
        let plain = stream(&[untagged(5, 9)], false, false, 0);
        let mut no_crc = Deframer::new(DeframerConfig::new(false, false));
        assert!(no_crc.peek_whole(&plain).is_some());
        let mut crc = Deframer::new(DeframerConfig::new(true, false));
        assert!(crc.peek_whole_mut(&plain).is_none());
        let (_, e) = bytewise_one(&mut crc, &plain);
        assert!(matches!(e, Some(DeframeError::CrcMismatch { .. })), "{e:?}");
        let mut small = Deframer::new(DeframerConfig::new(false, false).with_max_ulpdu_len(20));
        assert!(small.peek_whole_mut(&plain).is_none());
        let taken = no_crc.peek_whole_mut(&plain).map(PeekedWhole::take);
        assert_eq!(taken.map(|f| f.len()), Some(plain.len()));
    }

    fn sample_ulpdus() -> Vec<Vec<u8>> {
        vec![
            tagged(0, 1),
            untagged(16, 2),
            tagged(1, 3),
            untagged(0, 4),
            tagged(600, 5),
            untagged(3, 6),
            tagged(1100, 7),
            untagged(2, 8),
        ]
    }

    fn expected(ulpdus: &[Vec<u8>], crc: bool) -> Vec<(Vec<u8>, CrcVerdict)> {
        let v = if crc {
            CrcVerdict::Good
        } else {
            CrcVerdict::NotNegotiated
        };
        ulpdus.iter().map(|u| (u.clone(), v)).collect()
    }

    fn strip_pos(o: &Outcome) -> Vec<(Vec<u8>, CrcVerdict)> {
        o.0.iter().map(|(u, c, _)| (u.clone(), *c)).collect()
    }

    #[test]
    fn every_split_point_every_config() {
        let ulpdus = sample_ulpdus();
        for crc in [false, true] {
            for markers in [false, true] {
                for start in [0u64, 4, 508, 512, 4096 + 100] {
                    let cfg = DeframerConfig::new(crc, markers).with_stream_position(start);
                    let wire = stream(&ulpdus, crc, markers, start);
                    let whole = run_slice(cfg, &wire, &[]);
                    assert_eq!(whole.1, None, "crc {crc} markers {markers} start {start}");
                    assert_eq!(strip_pos(&whole), expected(&ulpdus, crc));
                    for cut in 0..=wire.len() {
                        let a = run_slice(cfg, &wire, &[cut]);
                        let b = run_direct(cfg, &wire, &[cut]);
                        let c = run_direct_mode(cfg, &wire, &[cut], true);
                        assert_eq!(a, whole, "slice, cut {cut}");
                        assert_eq!(b, whole, "direct, cut {cut}");
                        assert_eq!(c, whole, "direct by length, cut {cut}");
                    }
                }
            }
        }
    }

    /// Payload pieces of one FPDU reported alternately as a slice and by
    /// length (as the engine's receive path does), the stream cut at two
    /// points: the CRC and the FPDUs are those of the whole stream; one
    /// byte changed in a piece reported by length is a CRC mismatch.
    #[test]
    fn payload_in_mixed_slice_and_length_pieces_at_two_cuts() {
        let ulpdus = [tagged(1100, 7), untagged(40, 8), untagged(1500, 9)];
        let cfg = DeframerConfig::new(true, false);
        let wire = stream(&ulpdus, true, false, 0);
        let whole = run_slice(cfg, &wire, &[]);
        assert_eq!(strip_pos(&whole), expected(&ulpdus, true));
        for i in (0..wire.len()).step_by(11) {
            for j in (i..wire.len()).step_by(29) {
                for odd in [false, true] {
                    let got = run_direct_pieces(cfg, &wire, &[i, j], |k| (k % 2 == 1) == odd);
                    assert_eq!(got, whole, "cuts {i} {j}, odd {odd}");
                }
            }
        }
        // A byte of the first FPDU's payload changed: a CRC mismatch at it,
        // whichever way its piece was reported.
        let mut bad = wire.clone();
        bad[2 + 14 + 700] ^= 1;
        for by_len in [false, true] {
            let (fpdus, err) = run_direct_pieces(cfg, &bad, &[2 + 14 + 300, 2 + 14 + 701], |k| {
                (k == 2) == by_len
            });
            assert!(fpdus.is_empty());
            assert!(
                matches!(err, Some(DeframeError::CrcMismatch { position: 0, .. })),
                "{err:?}"
            );
        }
    }

    #[test]
    fn payload_reported_by_length_with_a_wrong_crc_update_is_a_crc_mismatch() {
        let u = tagged(100, 9);
        let wire = stream(std::slice::from_ref(&u), true, false, 0);
        let mut d = Deframer::new(DeframerConfig::new(true, false));
        let h = d.handle_bytes(&wire[..16]).unwrap();
        assert_eq!(h.event, Some(Event::Header));
        assert_eq!(d.next_read(), Want::Payload { len: 100 });
        // The caller fed the CRC with bytes that are not the payload.
        let h = d
            .handle_payload_by(150, |c, k| c.update(&vec![0u8; k]))
            .unwrap();
        assert_eq!(h.consumed, 100);
        let r = d.handle_bytes(&wire[116..]);
        assert!(matches!(r, Err(DeframeError::CrcMismatch { .. })), "{r:?}");
        // CRC off: the update is never called.
        let wire = stream(std::slice::from_ref(&u), false, false, 0);
        let mut d = Deframer::new(DeframerConfig::new(false, false));
        d.handle_bytes(&wire[..16]).unwrap();
        d.handle_payload_by(100, |_, _| panic!("CRC off")).unwrap();
        let h = d.handle_bytes(&wire[116..]).unwrap();
        assert!(matches!(h.event, Some(Event::FpduEnd { .. })));
    }

    #[test]
    fn one_byte_chunks() {
        let ulpdus = sample_ulpdus();
        for (crc, markers) in [(false, false), (true, false), (false, true), (true, true)] {
            let cfg = DeframerConfig::new(crc, markers);
            let wire = stream(&ulpdus, crc, markers, 0);
            let cuts: Vec<usize> = (1..wire.len()).collect();
            let a = run_slice(cfg, &wire, &cuts);
            let b = run_direct(cfg, &wire, &cuts);
            assert_eq!(a.1, None);
            assert_eq!(strip_pos(&a), expected(&ulpdus, crc));
            assert_eq!(a, b);
        }
    }

    #[test]
    fn siw_capture_with_crc_trailer_segments() {
        // rping-crc-p2p.pcap, one direction, reassembled; then the same
        // stream with every CRC field cut into its own segment as siw does
        // on bulk transfers.
        let pcap = std::fs::read(crate::testutil::RPING_CRC_PCAP).unwrap();
        let mut wire = Vec::new();
        let mut segs = Vec::new();
        let payloads = crate::testutil::pcap_tcp_payloads(&pcap);
        // Frames 8.. from port 41206 to 7174 (the first FPDU is frame 8).
        for (frame, p) in payloads {
            if [8, 9, 12, 14, 18, 20, 22, 26, 28, 30].contains(&frame) {
                wire.extend_from_slice(&p);
                segs.push(wire.len());
            }
        }
        let cfg = DeframerConfig::new(true, false);
        let (fpdus, err) = run_slice(cfg, &wire, &segs);
        assert_eq!(err, None);
        assert_eq!(fpdus.len(), 10);
        assert_eq!(fpdus[0].0.len(), 14);
        assert_eq!(fpdus[2].0.len(), 78);
        assert!(fpdus.iter().all(|f| f.1 == CrcVerdict::Good));
        // CRC in a segment of its own, after every FPDU.
        let mut cuts = Vec::new();
        let mut at = 0;
        for f in &fpdus {
            let len = fpdu::fpdu_len(f.0.len());
            cuts.push(at + len - 4);
            cuts.push(at + len);
            at += len;
        }
        cuts.pop();
        assert_eq!(run_slice(cfg, &wire, &cuts), (fpdus.clone(), None));
        assert_eq!(run_direct(cfg, &wire, &cuts), (fpdus, None));
    }

    #[test]
    fn corrupted_payload_is_a_crc_mismatch() {
        let ulpdus = sample_ulpdus();
        let wire = stream(&ulpdus, true, false, 0);
        // Flip one bit in the payload of the 5th FPDU (tagged, 600 bytes).
        let start5: usize = ulpdus[..4].iter().map(|u| fpdu::fpdu_len(u.len())).sum();
        let mut bad = wire.clone();
        bad[start5 + 2 + 14 + 100] ^= 0x10;
        let cfg = DeframerConfig::new(true, false);
        for cuts in [vec![], vec![start5 + 50], (1..bad.len()).collect()] {
            for run in [run_slice, run_direct] {
                let (fpdus, err) = run(cfg, &bad, &cuts);
                assert_eq!(fpdus.len(), 4);
                match err {
                    Some(DeframeError::CrcMismatch {
                        position,
                        expected,
                        found,
                    }) => {
                        assert_eq!(position, start5 as u64);
                        assert_ne!(expected, found);
                        let f = fpdu::Fpdu::new_checked(&bad[start5..]).unwrap();
                        assert_eq!(found, f.crc_field());
                        assert_eq!(expected, crc::crc32c(f.covered()));
                    }
                    e => panic!("{e:?}"),
                }
            }
        }
        // The same corruption goes through when CRC is off.
        let plain = stream(&ulpdus, false, false, 0);
        let mut bad = plain.clone();
        bad[start5 + 2 + 14 + 100] ^= 0x10;
        let (fpdus, err) = run_slice(DeframerConfig::new(false, false), &bad, &[]);
        assert_eq!((fpdus.len(), err), (8, None));
    }

    #[test]
    fn crc_field_is_ignored_when_crc_is_off() {
        let u = tagged(5, 9);
        let mut wire = stream(std::slice::from_ref(&u), false, false, 0);
        let n = wire.len();
        wire[n - 4..].copy_from_slice(&[1, 2, 3, 4]);
        let (f, e) = run_slice(DeframerConfig::new(false, false), &wire, &[]);
        assert_eq!(
            (f[0].0.clone(), f[0].1, e),
            (u, CrcVerdict::NotNegotiated, None)
        );
    }

    #[test]
    fn garbage_lengths_are_typed_errors() {
        let cfg = DeframerConfig::new(true, false).with_max_ulpdu_len(1500);
        let cases: [(&[u8], DeframeError); 4] = [
            (
                &[0x00, 0x00],
                DeframeError::UlpduTooShort {
                    position: 0,
                    len: 0,
                    min: 14,
                },
            ),
            (
                &[0x00, 0x0d, 0xc1],
                DeframeError::UlpduTooShort {
                    position: 0,
                    len: 13,
                    min: 14,
                },
            ),
            // 16 bytes: enough for a tagged header, not for an untagged one.
            (
                &[0x00, 0x10, 0x41, 0x43],
                DeframeError::UlpduTooShort {
                    position: 0,
                    len: 16,
                    min: 18,
                },
            ),
            (
                &[0x05, 0xdd],
                DeframeError::UlpduTooLong {
                    position: 0,
                    len: 1501,
                    max: 1500,
                },
            ),
        ];
        for (bytes, err) in cases {
            for cuts in [vec![], vec![1]] {
                assert_eq!(
                    run_slice(cfg, bytes, &cuts),
                    (vec![], Some(err)),
                    "{bytes:?}"
                );
                assert_eq!(
                    run_direct(cfg, bytes, &cuts),
                    (vec![], Some(err)),
                    "{bytes:?}"
                );
            }
        }
        // After an error the deframer stays failed.
        let mut d = Deframer::new(cfg);
        assert_eq!(d.handle_bytes(&[0, 0]), Err(cases[0].1));
        assert_eq!(d.handle_bytes(&[0, 20]), Err(cases[0].1));
        assert_eq!(d.handle_payload(&[0, 20]), Err(cases[0].1));
        assert_eq!(d.deframe(&[0, 20]).1, Some(Err(cases[0].1)));
        assert_eq!(d.error(), Some(cases[0].1));
        // The second FPDU's position is reported.
        let wire = [
            stream(&[tagged(2, 1)], true, false, 0),
            vec![0xff, 0xff, 0xc1],
        ]
        .concat();
        let (f, e) = run_slice(cfg, &wire, &[]);
        assert_eq!(f.len(), 1);
        assert_eq!(
            e,
            Some(DeframeError::UlpduTooLong {
                position: 24,
                len: 0xffff,
                max: 1500
            })
        );
    }

    #[test]
    fn bad_marker_pointer() {
        let ulpdus = sample_ulpdus();
        let wire = stream(&ulpdus, false, true, 0);
        // The first marker (position 0) must carry 0.
        let mut bad = wire.clone();
        bad[3] = 8;
        let cfg = DeframerConfig::new(false, true);
        let e = Some(DeframeError::BadMarker {
            position: 0,
            found: 8,
            expected: Some(0),
        });
        assert_eq!(run_slice(cfg, &bad, &[]).1, e);
        assert_eq!(run_direct(cfg, &bad, &[2]).1, e);
        // The marker at 512 sits inside the 5th FPDU.
        let mut bad = wire.clone();
        let found = u16::from_be_bytes([bad[514], bad[515]]);
        bad[515] ^= 0x40;
        let (f, err) = run_slice(cfg, &bad, &[]);
        assert_eq!(f.len(), 4);
        assert_eq!(
            err,
            Some(DeframeError::BadMarker {
                position: 512,
                found: found ^ 0x40,
                expected: Some(found)
            })
        );
        // The low two bits are ignored; RESERVED is ignored.
        let mut ok = wire.clone();
        ok[515] ^= 0x03;
        ok[512] = 0xff;
        assert_eq!(run_slice(cfg, &ok, &[]).1, None);
        // ... but with CRC negotiated they are covered by the CRC.
        let wire = stream(&ulpdus, true, true, 0);
        let mut bad = wire.clone();
        bad[512] = 0xff;
        assert!(matches!(
            run_slice(DeframerConfig::new(true, true), &bad, &[]).1,
            Some(DeframeError::CrcMismatch { .. })
        ));
    }

    #[test]
    fn an_untagged_header_is_taken_in_one_call() {
        let u = untagged(40, 5);
        let wire = stream(std::slice::from_ref(&u), false, false, 0);
        let mut d = Deframer::new(DeframerConfig::new(false, false));
        // The want is the shortest header's; the bytes hold the whole one.
        assert_eq!(d.next_read(), Want::Header { len: 16 });
        let h = d.handle_bytes(&wire).unwrap();
        assert_eq!((h.consumed, h.event), (20, Some(Event::Header)));
        assert_eq!(d.header().unwrap().payload_len(), 40);
        assert_eq!(d.next_read(), Want::Payload { len: 40 });
        // Cut inside the header: what is given, then the rest.
        let mut d = Deframer::new(DeframerConfig::new(false, false));
        let h = d.handle_bytes(&wire[..17]).unwrap();
        assert_eq!((h.consumed, h.event), (17, None));
        assert_eq!(d.next_read(), Want::Header { len: 3 });
        let h = d.handle_bytes(&wire[17..]).unwrap();
        assert_eq!((h.consumed, h.event), (3, Some(Event::Header)));
        // A tagged header is the shortest: 16 bytes, as wanted.
        let t = tagged(40, 5);
        let wire = stream(std::slice::from_ref(&t), false, false, 0);
        let mut d = Deframer::new(DeframerConfig::new(false, false));
        let h = d.handle_bytes(&wire).unwrap();
        assert_eq!((h.consumed, h.event), (16, Some(Event::Header)));
        // An untagged header in a ULPDU too short for it is refused.
        let mut bad = wire.clone();
        bad[2] &= !ddp::FLAG_TAGGED;
        bad[0..2].copy_from_slice(&16u16.to_be_bytes());
        let mut d = Deframer::new(DeframerConfig::new(false, false));
        assert!(matches!(
            d.handle_bytes(&bad),
            Err(DeframeError::UlpduTooShort { min: 18, .. })
        ));
    }

    #[test]
    fn wants_are_bounded_by_markers_and_fpdu_end() {
        let cfg = DeframerConfig::new(true, true).with_stream_position(504);
        let u = tagged(1000, 3);
        let wire = stream(&[u], true, true, 504);
        let mut d = Deframer::new(cfg);
        // Header: 16 bytes wanted, but only 8 until the marker at 512.
        assert_eq!(d.next_read(), Want::Header { len: 8 });
        assert_eq!(d.handle_bytes(&wire[..20]).unwrap().consumed, 8);
        assert_eq!(d.next_read(), Want::Marker { len: 4 });
        assert_eq!(d.handle_bytes(&wire[8..10]).unwrap().consumed, 2);
        assert_eq!(d.next_read(), Want::Marker { len: 2 });
        assert_eq!(
            d.handle_payload(&wire[10..12]).unwrap().consumed,
            0,
            "mismatched call"
        );
        assert_eq!(d.handle_bytes(&wire[10..12]).unwrap().consumed, 2);
        assert_eq!(d.next_read(), Want::Header { len: 8 });
        let h = d.handle_bytes(&wire[12..40]).unwrap();
        assert_eq!((h.consumed, h.event), (8, Some(Event::Header)));
        let hdr = d.header().unwrap();
        assert_eq!(
            (hdr.ulpdu_len, hdr.position, hdr.payload_len()),
            (1014, 504, 1000)
        );
        // Payload: up to the marker at 1024.
        assert_eq!(d.next_read(), Want::Payload { len: 1024 - 524 });
        assert_eq!(
            d.handle_bytes(&wire[20..30]).unwrap().consumed,
            0,
            "mismatched call"
        );
        assert_eq!(d.handle_payload(&wire[20..]).unwrap().consumed, 500);
        assert_eq!(d.next_read(), Want::Marker { len: 4 });
        d.handle_bytes(&wire[520..524]).unwrap();
        assert_eq!(d.next_read(), Want::Payload { len: 500 });
        d.handle_payload(&wire[524..1024]).unwrap();
        // 1014 + 2 = 1016: pad 0, then the CRC.
        assert_eq!(d.next_read(), Want::Trailer { len: 4 });
        let h = d.handle_bytes(&wire[1024..]).unwrap();
        assert_eq!(
            h.event,
            Some(Event::FpduEnd {
                crc: CrcVerdict::Good
            })
        );
        assert_eq!(wire.len(), 1028);
        assert_eq!(d.stream_position(), 504 + 1028);
        assert!(d.is_at_fpdu_boundary());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        #[test]
        fn random_chunking_slice_equals_direct(
            specs in proptest::collection::vec((any::<bool>(), 0usize..1600, any::<u8>()), 1..8),
            crc in any::<bool>(),
            markers in any::<bool>(),
            start in (0u64..2048).prop_map(|p| p * 4),
            cuts in proptest::collection::vec(any::<usize>(), 0..24),
        ) {
            let ulpdus: Vec<Vec<u8>> = specs
                .iter()
                .map(|&(t, n, s)| if t { tagged(n, s) } else { untagged(n, s) })
                .collect();
            let wire = stream(&ulpdus, crc, markers, start);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (wire.len() + 1)).collect();
            cuts.sort_unstable();
            let cfg = DeframerConfig::new(crc, markers).with_stream_position(start);
            let a = run_slice(cfg, &wire, &cuts);
            let b = run_direct(cfg, &wire, &cuts);
            prop_assert_eq!(&a.1, &None);
            prop_assert_eq!(strip_pos(&a), expected(&ulpdus, crc));
            prop_assert_eq!(a, b);
        }

        #[test]
        fn garbage_never_panics_and_modes_agree(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
            crc in any::<bool>(),
            markers in any::<bool>(),
            start in any::<u32>(),
            chunk in 1usize..64,
            max in any::<u16>(),
        ) {
            let cfg = DeframerConfig::new(crc, markers)
                .with_stream_position(u64::from(start))
                .with_max_ulpdu_len(max);
            let cuts: Vec<usize> = (chunk..bytes.len()).step_by(chunk).collect();
            let a = run_slice(cfg, &bytes, &cuts);
            let b = run_direct(cfg, &bytes, &cuts);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn bit_flips_never_pass_silently_with_crc(
            specs in proptest::collection::vec((any::<bool>(), 0usize..300, any::<u8>()), 1..5),
            markers in any::<bool>(),
            flip in any::<usize>(),
            bit in 0u8..8,
        ) {
            let ulpdus: Vec<Vec<u8>> = specs
                .iter()
                .map(|&(t, n, s)| if t { tagged(n, s) } else { untagged(n, s) })
                .collect();
            let mut wire = stream(&ulpdus, true, markers, 0);
            let at = flip % wire.len();
            wire[at] ^= 1 << bit;
            let cfg = DeframerConfig::new(true, markers);
            let a = run_slice(cfg, &wire, &[]);
            let b = run_direct(cfg, &wire, &[]);
            prop_assert_eq!(&a, &b);
            // Either an error, or the stream no longer ends on an FPDU
            // boundary (a flipped length), never the original FPDUs.
            prop_assert!(a.1.is_some() || strip_pos(&a) != expected(&ulpdus, true));
        }
    }
}
