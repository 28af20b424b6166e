//! MPA Request and Reply frames (RFC 5044 section 7.1, RFC 6581 section 4).
//!
//! Before a TCP connection carries FPDUs, the initiator sends an MPA Request
//! frame and the responder answers with an MPA Reply frame (a Reply with the
//! R flag set rejects the connection):
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                                                               |
//! +         Key (16 bytes containing "MPA ID Req Frame"           +
//! |            or "MPA ID Rep Frame")                             |
//! +                                                               +
//! |                                                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |M|C|R|H|  Res  |     Rev       |          PD_Length            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ~                 Private Data (PD_Length bytes)                ~
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! * M (0x80): markers requested; C (0x40): CRC requested; R (0x20): the
//!   connection is rejected (Reply only); H (0x10, RFC 6581): enhanced
//!   connection establishment, the private data starts with the
//!   [`IrdOrd`] word. The remaining four bits are reserved: sent as zero,
//!   not checked on receipt (this codec reports them, Linux siw uses 0x08
//!   privately).
//! * Rev: MPA revision, 1 (RFC 5044) or 2 (RFC 6581).
//! * PD_Length: big-endian private data length, at most 512
//!   ([`MPA_MAX_PRIVATE_DATA`]).

use core::fmt;

use super::MpaError;
use super::ird_ord::IrdOrd;
use crate::{DecodeError, EncodeError};

/// Length of the key.
pub const KEY_LEN: usize = 16;
/// The key of an MPA Request frame.
pub const REQUEST_KEY: [u8; KEY_LEN] = *b"MPA ID Req Frame";
/// The key of an MPA Reply frame.
pub const REPLY_KEY: [u8; KEY_LEN] = *b"MPA ID Rep Frame";
/// Length of the fixed part of a frame (key, flags, revision, PD_Length).
pub const HEADER_LEN: usize = 20;
/// Most private data RFC 5044 allows in a frame.
pub const MPA_MAX_PRIVATE_DATA: usize = 512;
/// Most private data Linux siw accepts in a frame.
pub const SIW_MAX_PRIVATE_DATA: usize = 256;

/// M: markers requested.
pub const FLAG_MARKERS: u8 = 0x80;
/// C: CRC requested.
pub const FLAG_CRC: u8 = 0x40;
/// R: connection rejected.
pub const FLAG_REJECT: u8 = 0x20;
/// H: enhanced connection establishment (RFC 6581).
pub const FLAG_ENHANCED: u8 = 0x10;
/// The reserved bits of the flags byte.
pub const FLAGS_RESERVED: u8 = 0x0f;

/// MPA revision 1 (RFC 5044).
pub const REVISION_1: u8 = 1;
/// MPA revision 2 (RFC 6581).
pub const REVISION_2: u8 = 2;

mod field {
    use core::ops::Range;
    pub(super) const KEY: Range<usize> = 0..16;
    pub(super) const FLAGS: usize = 16;
    pub(super) const REV: usize = 17;
    pub(super) const PD_LEN: Range<usize> = 18..20;
    pub(super) const PRIVATE_DATA: usize = 20;
}

const WHAT: &str = "MPA Request/Reply frame";

/// Which of the two frames a key names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// "MPA ID Req Frame", sent by the initiator.
    Request,
    /// "MPA ID Rep Frame", sent by the responder (a reject if R is set).
    Reply,
}

impl FrameKind {
    /// The 16-byte key of this kind.
    pub const fn key(self) -> &'static [u8; KEY_LEN] {
        match self {
            Self::Request => &REQUEST_KEY,
            Self::Reply => &REPLY_KEY,
        }
    }

    /// The kind whose key is `key`, if either.
    pub fn from_key(key: &[u8]) -> Option<Self> {
        if key == REQUEST_KEY {
            Some(Self::Request)
        } else if key == REPLY_KEY {
            Some(Self::Reply)
        } else {
            None
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Request => "MPA Request",
            Self::Reply => "MPA Reply",
        })
    }
}

/// Tells whether `prefix`, the start of a byte stream, holds a whole MPA
/// Request or Reply frame, and how long it is.
///
/// * `None`: need more bytes (the bytes so far are a valid beginning);
/// * `Some(Ok(len))`: the first `len` bytes are a whole frame;
/// * `Some(Err(_))`: the bytes cannot begin a frame: wrong key (detected as
///   soon as a key byte differs from both keys), bad revision, or a
///   PD_Length above `max_private_data` (detected from the header alone, so
///   no one waits for the oversized private data to arrive).
///
/// `max_private_data` is capped at [`MPA_MAX_PRIVATE_DATA`].
///
/// # Example
///
/// ```
/// use softrdma_wire::mpa::{frame_len, SIW_MAX_PRIVATE_DATA};
///
/// let mut stream = b"MPA ID Req Frame".to_vec();
/// stream.extend([0x10, 0x02, 0x00, 0x04, 0x00, 0x01, 0x00, 0x01]);
/// assert_eq!(frame_len(&stream[..10], SIW_MAX_PRIVATE_DATA), None);
/// assert_eq!(frame_len(&stream, SIW_MAX_PRIVATE_DATA), Some(Ok(24)));
/// ```
pub fn frame_len(prefix: &[u8], max_private_data: usize) -> Option<Result<usize, MpaError>> {
    let key_part = prefix.get(..KEY_LEN).unwrap_or(prefix);
    let n = key_part.len();
    if REQUEST_KEY.get(..n) != Some(key_part) && REPLY_KEY.get(..n) != Some(key_part) {
        let mut key = [0u8; KEY_LEN];
        if let Some(dst) = key.get_mut(..n) {
            dst.copy_from_slice(key_part);
        }
        return Some(Err(MpaError::BadKey { key }));
    }
    if let Some(&revision) = prefix.get(field::REV)
        && !is_valid_revision(revision)
    {
        return Some(Err(MpaError::BadRevision { revision }));
    }
    let &[l0, l1] = prefix.get(field::PD_LEN)?.first_chunk::<2>()?;
    let len = usize::from(u16::from_be_bytes([l0, l1]));
    let max = max_private_data.min(MPA_MAX_PRIVATE_DATA);
    if len > max {
        return Some(Err(MpaError::PrivateDataTooLong { len, max }));
    }
    let total = HEADER_LEN + len;
    (prefix.len() >= total).then_some(Ok(total))
}

const fn is_valid_revision(revision: u8) -> bool {
    matches!(revision, REVISION_1 | REVISION_2)
}

/// A zero-copy view of an MPA Request or Reply frame.
///
/// After [`Frame::new_checked`] the buffer holds the 20-byte header and
/// PD_Length bytes of private data, so no accessor can panic. Bytes after
/// the frame (the start of the FPDU stream, say) are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Frame<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a buffer after checking that it holds a whole frame.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is shorter than the header
    /// or than the header plus PD_Length.
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let frame = Self::new_unchecked(buffer);
        frame.check_len()?;
        Ok(frame)
    }

    /// Checks that the buffer holds a whole frame (see
    /// [`Frame::new_checked`]).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] as for [`Frame::new_checked`].
    pub fn check_len(&self) -> Result<(), DecodeError> {
        let got = self.buffer.as_ref().len();
        if got < HEADER_LEN {
            return Err(DecodeError::Truncated {
                what: WHAT,
                needed: HEADER_LEN,
                got,
            });
        }
        let needed = self.frame_len();
        if got < needed {
            return Err(DecodeError::Truncated {
                what: WHAT,
                needed,
                got,
            });
        }
        Ok(())
    }

    /// Returns the underlying buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    fn byte(&self, at: usize) -> u8 {
        self.buffer.as_ref().get(at).copied().unwrap_or(0)
    }

    /// The 16-byte key field.
    pub fn key(&self) -> &[u8] {
        self.buffer.as_ref().get(field::KEY).unwrap_or(&[])
    }

    /// The kind the key names, or `None` for any other key.
    pub fn kind(&self) -> Option<FrameKind> {
        FrameKind::from_key(self.key())
    }

    /// The whole flags byte (M, C, R, H and the reserved bits).
    pub fn flags(&self) -> u8 {
        self.byte(field::FLAGS)
    }

    /// M: markers requested.
    pub fn markers(&self) -> bool {
        self.flags() & FLAG_MARKERS != 0
    }

    /// C: CRC requested.
    pub fn crc(&self) -> bool {
        self.flags() & FLAG_CRC != 0
    }

    /// R: connection rejected.
    pub fn reject(&self) -> bool {
        self.flags() & FLAG_REJECT != 0
    }

    /// H: enhanced connection establishment (RFC 6581).
    pub fn enhanced(&self) -> bool {
        self.flags() & FLAG_ENHANCED != 0
    }

    /// The four reserved flag bits.
    pub fn reserved_flags(&self) -> u8 {
        self.flags() & FLAGS_RESERVED
    }

    /// The revision byte.
    pub fn revision(&self) -> u8 {
        self.byte(field::REV)
    }

    /// PD_Length: the private data length field.
    pub fn private_data_len(&self) -> u16 {
        u16::from_be_bytes([
            self.byte(field::PD_LEN.start),
            self.byte(field::PD_LEN.start + 1),
        ])
    }

    /// Length of the whole frame: header plus PD_Length.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + usize::from(self.private_data_len())
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Frame<&'a T> {
    /// The private data (PD_Length bytes after the header).
    pub fn private_data(&self) -> &'a [u8] {
        let end = self.frame_len();
        self.buffer
            .as_ref()
            .get(field::PRIVATE_DATA..end)
            .unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    fn set_byte(&mut self, at: usize, value: u8) {
        if let Some(b) = self.buffer.as_mut().get_mut(at) {
            *b = value;
        }
    }

    /// Writes the key of `kind`.
    pub fn set_kind(&mut self, kind: FrameKind) {
        if let Some(dst) = self.buffer.as_mut().get_mut(field::KEY) {
            dst.copy_from_slice(kind.key());
        }
    }

    /// Writes the whole flags byte.
    pub fn set_flags(&mut self, flags: u8) {
        self.set_byte(field::FLAGS, flags);
    }

    /// Writes the revision byte.
    pub fn set_revision(&mut self, revision: u8) {
        self.set_byte(field::REV, revision);
    }

    /// Writes PD_Length.
    pub fn set_private_data_len(&mut self, len: u16) {
        let [a, b] = len.to_be_bytes();
        self.set_byte(field::PD_LEN.start, a);
        self.set_byte(field::PD_LEN.start + 1, b);
    }

    /// The private data, mutable (PD_Length bytes after the header).
    pub fn private_data_mut(&mut self) -> &mut [u8] {
        let end = self.frame_len();
        self.buffer
            .as_mut()
            .get_mut(field::PRIVATE_DATA..end)
            .unwrap_or(&mut [])
    }
}

/// A decoded MPA Request or Reply frame, borrowing its private data.
///
/// # Example
///
/// ```
/// use softrdma_wire::mpa::{Frame, FrameKind, FrameRepr, SIW_MAX_PRIVATE_DATA};
///
/// // siw's MPA Reply from the rping capture.
/// let mut bytes = b"MPA ID Rep Frame".to_vec();
/// bytes.extend([0x10, 0x02, 0x00, 0x04, 0x00, 0x01, 0x00, 0x01]);
/// let frame = Frame::new_checked(&bytes[..]).unwrap();
/// let repr = FrameRepr::parse_expecting(&frame, FrameKind::Reply, SIW_MAX_PRIVATE_DATA).unwrap();
/// assert!(repr.enhanced && !repr.crc && !repr.is_reject());
/// assert_eq!(repr.ird_ord().unwrap().unwrap().ird, 1);
///
/// let mut out = [0u8; 24];
/// assert_eq!(repr.emit(&mut out), Ok(24));
/// assert_eq!(&out[..], &bytes[..]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FrameRepr<'a> {
    /// Request or Reply.
    pub kind: FrameKind,
    /// M: markers requested.
    pub markers: bool,
    /// C: CRC requested.
    pub crc: bool,
    /// R: connection rejected.
    pub reject: bool,
    /// H: enhanced connection establishment (private data starts with the
    /// IRD/ORD word).
    pub enhanced: bool,
    /// The four reserved flag bits as received (sent as zero by RFC 5044
    /// peers; not checked).
    pub reserved: u8,
    /// The revision (1 or 2 after a successful parse).
    pub revision: u8,
    /// The whole private data, including the IRD/ORD word if `enhanced`.
    pub private_data: &'a [u8],
}

impl<'a> FrameRepr<'a> {
    /// Decodes a frame of either kind.
    ///
    /// `max_private_data` is the receiver's cap on PD_Length (Linux siw uses
    /// [`SIW_MAX_PRIVATE_DATA`]); it is capped at [`MPA_MAX_PRIVATE_DATA`].
    ///
    /// # Errors
    ///
    /// [`MpaError::BadKey`], [`MpaError::BadRevision`],
    /// [`MpaError::PrivateDataTooLong`], or [`MpaError::Malformed`] if the
    /// view was not length-checked and is short.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        frame: &Frame<&'a T>,
        max_private_data: usize,
    ) -> Result<Self, MpaError> {
        let Some(kind) = frame.kind() else {
            let mut key = [0u8; KEY_LEN];
            let src = frame.key();
            if let Some(dst) = key.get_mut(..src.len()) {
                dst.copy_from_slice(src);
            }
            return Err(MpaError::BadKey { key });
        };
        let revision = frame.revision();
        if !is_valid_revision(revision) {
            return Err(MpaError::BadRevision { revision });
        }
        let len = usize::from(frame.private_data_len());
        let max = max_private_data.min(MPA_MAX_PRIVATE_DATA);
        if len > max {
            return Err(MpaError::PrivateDataTooLong { len, max });
        }
        frame.check_len()?;
        Ok(Self {
            kind,
            markers: frame.markers(),
            crc: frame.crc(),
            reject: frame.reject(),
            enhanced: frame.enhanced(),
            reserved: frame.reserved_flags(),
            revision,
            private_data: frame.private_data(),
        })
    }

    /// Decodes a frame that must be of kind `expected` (a responder expects
    /// a Request, an initiator a Reply).
    ///
    /// # Errors
    ///
    /// As [`FrameRepr::parse`], plus [`MpaError::UnexpectedKind`] if the
    /// frame carries the other key.
    pub fn parse_expecting<T: AsRef<[u8]> + ?Sized>(
        frame: &Frame<&'a T>,
        expected: FrameKind,
        max_private_data: usize,
    ) -> Result<Self, MpaError> {
        let repr = Self::parse(frame, max_private_data)?;
        if repr.kind != expected {
            return Err(MpaError::UnexpectedKind {
                expected,
                found: repr.kind,
            });
        }
        Ok(repr)
    }

    /// Whether this frame rejects the connection (a Reply with R set).
    pub fn is_reject(&self) -> bool {
        self.kind == FrameKind::Reply && self.reject
    }

    /// The enhanced-mode IRD/ORD word: `None` if H is clear.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if H is set but the private data is
    /// shorter than four bytes.
    pub fn ird_ord(&self) -> Option<Result<IrdOrd, DecodeError>> {
        self.enhanced.then(|| IrdOrd::parse(self.private_data))
    }

    /// The application's private data: everything after the IRD/ORD word if
    /// H is set (empty if the word itself is short), all of it otherwise.
    pub fn ulp_private_data(&self) -> &'a [u8] {
        if self.enhanced {
            self.private_data
                .get(super::ird_ord::IRD_ORD_LEN..)
                .unwrap_or(&[])
        } else {
            self.private_data
        }
    }

    /// Number of bytes [`FrameRepr::emit`] writes.
    pub fn buffer_len(&self) -> usize {
        HEADER_LEN + self.private_data.len()
    }

    /// Writes the frame to the start of `buf`, returning its length.
    ///
    /// The revision is written as given, so tests can produce frames with a
    /// bad one.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] if the private data exceeds 512 bytes or
    /// `reserved` does not fit in four bits; [`EncodeError::BufferTooSmall`]
    /// if `buf` is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let len = self.private_data.len();
        if len > MPA_MAX_PRIVATE_DATA {
            return Err(EncodeError::OutOfRange {
                what: WHAT,
                field: "private data length",
                value: len as u64,
                max: MPA_MAX_PRIVATE_DATA as u64,
            });
        }
        if self.reserved > FLAGS_RESERVED {
            return Err(EncodeError::OutOfRange {
                what: WHAT,
                field: "reserved flags",
                value: u64::from(self.reserved),
                max: u64::from(FLAGS_RESERVED),
            });
        }
        let needed = self.buffer_len();
        let got = buf.len();
        let Some(dst) = buf.get_mut(..needed) else {
            return Err(EncodeError::BufferTooSmall {
                what: WHAT,
                needed,
                got,
            });
        };
        let mut frame = Frame::new_unchecked(dst);
        frame.set_kind(self.kind);
        let mut flags = self.reserved;
        for (set, bit) in [
            (self.markers, FLAG_MARKERS),
            (self.crc, FLAG_CRC),
            (self.reject, FLAG_REJECT),
            (self.enhanced, FLAG_ENHANCED),
        ] {
            if set {
                flags |= bit;
            }
        }
        frame.set_flags(flags);
        frame.set_revision(self.revision);
        // len <= 512 was checked above.
        frame.set_private_data_len(u16::try_from(len).unwrap_or(u16::MAX));
        frame.private_data_mut().copy_from_slice(self.private_data);
        Ok(needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::hex;
    use proptest::prelude::*;

    // Raw TCP payloads of the MPA exchange, from the captures' .txt files.
    const RPING_REQ: &str = "4d504120494420526571204672616d651002000400010001";
    const RPING_REP: &str = "4d504120494420526570204672616d651002000400010001";
    const IB_WRITE_BW_REQ: &str = "4d504120494420526571204672616d651002000400000000";
    const IB_WRITE_BW_REP: &str = "4d504120494420526570204672616d651002000400000000";
    const P2P_REQ: &str = "4d504120494420526571204672616d65500200048001c001";
    const P2P_REP: &str = "4d504120494420526570204672616d655002000480018001";

    fn decode(bytes: &[u8]) -> FrameRepr<'_> {
        let frame = Frame::new_checked(bytes).unwrap();
        assert_eq!(
            frame_len(bytes, SIW_MAX_PRIVATE_DATA),
            Some(Ok(bytes.len()))
        );
        FrameRepr::parse(&frame, SIW_MAX_PRIVATE_DATA).unwrap()
    }

    fn assert_reencodes(repr: &FrameRepr<'_>, bytes: &[u8]) {
        let mut out = vec![0u8; repr.buffer_len()];
        assert_eq!(repr.emit(&mut out), Ok(bytes.len()));
        assert_eq!(out, bytes);
    }

    #[test]
    fn golden_rping() {
        let req = hex(RPING_REQ);
        let r = decode(&req);
        assert_eq!(
            r,
            FrameRepr {
                kind: FrameKind::Request,
                markers: false,
                crc: false,
                reject: false,
                enhanced: true,
                reserved: 0,
                revision: 2,
                private_data: &[0x00, 0x01, 0x00, 0x01],
            }
        );
        let io = r.ird_ord().unwrap().unwrap();
        assert_eq!(
            (io.ird, io.ord, io.peer_to_peer, io.any_rtr()),
            (1, 1, false, false)
        );
        assert_eq!(r.ulp_private_data(), &[] as &[u8]);
        assert_reencodes(&r, &req);

        let rep = hex(RPING_REP);
        let r = decode(&rep);
        assert_eq!(r.kind, FrameKind::Reply);
        assert!(r.enhanced && !r.crc && !r.markers && !r.is_reject());
        assert_eq!((r.revision, r.private_data), (2, &[0, 1, 0, 1][..]));
        assert_reencodes(&r, &rep);
    }

    #[test]
    fn golden_ib_write_bw() {
        for (s, kind) in [
            (IB_WRITE_BW_REQ, FrameKind::Request),
            (IB_WRITE_BW_REP, FrameKind::Reply),
        ] {
            let bytes = hex(s);
            let r = decode(&bytes);
            assert_eq!(r.kind, kind);
            assert!(r.enhanced && !r.crc && !r.markers && !r.reject);
            assert_eq!((r.revision, r.reserved), (2, 0));
            assert_eq!(r.private_data, &[0, 0, 0, 0]);
            assert_eq!(r.ird_ord(), Some(Ok(IrdOrd::default())));
            assert_reencodes(&r, &bytes);
        }
    }

    #[test]
    fn golden_rping_crc_p2p() {
        let req = hex(P2P_REQ);
        let r = decode(&req);
        assert_eq!(r.kind, FrameKind::Request);
        // Flags byte 0x50: C and H.
        assert!(r.crc && r.enhanced && !r.markers && !r.reject);
        assert_eq!(r.revision, 2);
        assert_eq!(
            r.ird_ord(),
            Some(Ok(IrdOrd {
                ird: 1,
                ord: 1,
                peer_to_peer: true,
                send_rtr: false,
                write_rtr: true,
                read_rtr: true,
            }))
        );
        assert_reencodes(&r, &req);

        let rep = hex(P2P_REP);
        let r = decode(&rep);
        assert_eq!(r.kind, FrameKind::Reply);
        assert!(r.crc && r.enhanced && !r.is_reject());
        assert_eq!(
            r.ird_ord(),
            Some(Ok(IrdOrd {
                ird: 1,
                ord: 1,
                peer_to_peer: true,
                send_rtr: false,
                write_rtr: true,
                read_rtr: false,
            }))
        );
        assert_reencodes(&r, &rep);
    }

    #[test]
    fn view_accessors() {
        let bytes = hex(P2P_REQ);
        let f = Frame::new_checked(&bytes[..]).unwrap();
        assert_eq!(f.key(), b"MPA ID Req Frame");
        assert_eq!(f.kind(), Some(FrameKind::Request));
        assert_eq!(f.flags(), 0x50);
        assert_eq!(f.reserved_flags(), 0);
        assert_eq!(f.revision(), 2);
        assert_eq!(f.private_data_len(), 4);
        assert_eq!(f.frame_len(), 24);
        assert_eq!(f.private_data(), &[0x80, 0x01, 0xc0, 0x01]);
        assert_eq!(f.into_inner().len(), 24);
    }

    #[test]
    fn trailing_bytes_are_not_part_of_the_frame() {
        let mut bytes = hex(RPING_REP);
        bytes.extend([0x00, 0x22, 0x41, 0x03]); // start of the first FPDU
        assert_eq!(frame_len(&bytes, SIW_MAX_PRIVATE_DATA), Some(Ok(24)));
        let f = Frame::new_checked(&bytes[..]).unwrap();
        let r = FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA).unwrap();
        assert_eq!(r.private_data, &[0, 1, 0, 1]);
    }

    #[test]
    fn truncated_at_every_length() {
        let bytes = hex(P2P_REQ);
        for n in 0..bytes.len() {
            let prefix = &bytes[..n];
            assert_eq!(frame_len(prefix, SIW_MAX_PRIVATE_DATA), None, "len {n}");
            let needed = if n < HEADER_LEN { HEADER_LEN } else { 24 };
            assert_eq!(
                Frame::new_checked(prefix),
                Err(DecodeError::Truncated {
                    what: WHAT,
                    needed,
                    got: n
                })
            );
            if n >= HEADER_LEN {
                let f = Frame::new_unchecked(prefix);
                assert!(matches!(
                    FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA),
                    Err(MpaError::Malformed(DecodeError::Truncated { .. }))
                ));
            }
        }
    }

    #[test]
    fn unchecked_short_views_do_not_panic() {
        let bytes = hex(P2P_REQ);
        for n in 0..bytes.len() {
            let f = Frame::new_unchecked(&bytes[..n]);
            let _ = (
                f.key(),
                f.kind(),
                f.flags(),
                f.revision(),
                f.private_data_len(),
            );
            let _ = (f.frame_len(), f.private_data());
            let _ = FrameRepr::parse(&f, MPA_MAX_PRIVATE_DATA);
            let mut buf = bytes[..n].to_vec();
            let mut m = Frame::new_unchecked(&mut buf[..]);
            m.set_kind(FrameKind::Reply);
            m.set_flags(0xff);
            m.set_revision(1);
            m.set_private_data_len(9);
            let _ = m.private_data_mut();
        }
    }

    #[test]
    fn wrong_key() {
        let mut bytes = hex(RPING_REQ);
        bytes[4] = b'X'; // "MPA XD Req Frame"
        let f = Frame::new_checked(&bytes[..]).unwrap();
        let mut key = [0u8; 16];
        key.copy_from_slice(&bytes[..16]);
        assert_eq!(
            FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA),
            Err(MpaError::BadKey { key })
        );
        // The stream helper fails as soon as the bad byte arrives.
        assert_eq!(frame_len(&bytes[..4], SIW_MAX_PRIVATE_DATA), None);
        assert!(matches!(
            frame_len(&bytes[..5], SIW_MAX_PRIVATE_DATA),
            Some(Err(MpaError::BadKey { .. }))
        ));
        // A plain FPDU or an HTTP request is not a frame.
        assert!(matches!(
            frame_len(b"GET / HTTP/1.1\r\n", SIW_MAX_PRIVATE_DATA),
            Some(Err(MpaError::BadKey { .. }))
        ));
    }

    #[test]
    fn request_where_reply_expected_and_vice_versa() {
        let req = hex(RPING_REQ);
        let f = Frame::new_checked(&req[..]).unwrap();
        assert_eq!(
            FrameRepr::parse_expecting(&f, FrameKind::Reply, SIW_MAX_PRIVATE_DATA),
            Err(MpaError::UnexpectedKind {
                expected: FrameKind::Reply,
                found: FrameKind::Request
            })
        );
        assert!(FrameRepr::parse_expecting(&f, FrameKind::Request, SIW_MAX_PRIVATE_DATA).is_ok());
        let rep = hex(RPING_REP);
        let f = Frame::new_checked(&rep[..]).unwrap();
        assert_eq!(
            FrameRepr::parse_expecting(&f, FrameKind::Request, SIW_MAX_PRIVATE_DATA),
            Err(MpaError::UnexpectedKind {
                expected: FrameKind::Request,
                found: FrameKind::Reply
            })
        );
    }

    #[test]
    fn bad_revisions() {
        for rev in [0u8, 3, 0x7f, 0xff] {
            let mut bytes = hex(RPING_REQ);
            bytes[17] = rev;
            let f = Frame::new_checked(&bytes[..]).unwrap();
            assert_eq!(
                FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA),
                Err(MpaError::BadRevision { revision: rev })
            );
            assert_eq!(
                frame_len(&bytes[..18], SIW_MAX_PRIVATE_DATA),
                Some(Err(MpaError::BadRevision { revision: rev }))
            );
        }
        let mut bytes = hex(IB_WRITE_BW_REQ);
        bytes[16] = 0; // revision 1 frame: no H, plain private data
        bytes[17] = 1;
        let r = decode(&bytes);
        assert_eq!(r.revision, 1);
        assert_eq!(r.ird_ord(), None);
        assert_eq!(r.ulp_private_data(), &[0, 0, 0, 0]);
    }

    #[test]
    fn private_data_cap() {
        let pd = [0x5a; 300];
        let repr = FrameRepr {
            kind: FrameKind::Request,
            markers: false,
            crc: false,
            reject: false,
            enhanced: false,
            reserved: 0,
            revision: 1,
            private_data: &pd,
        };
        let mut buf = vec![0u8; repr.buffer_len()];
        assert_eq!(repr.emit(&mut buf), Ok(320));
        let f = Frame::new_checked(&buf[..]).unwrap();
        let err = MpaError::PrivateDataTooLong { len: 300, max: 256 };
        assert_eq!(FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA), Err(err));
        // Detected from the header, before the private data arrives.
        assert_eq!(
            frame_len(&buf[..HEADER_LEN], SIW_MAX_PRIVATE_DATA),
            Some(Err(err))
        );
        assert_eq!(FrameRepr::parse(&f, 512).unwrap().private_data, &pd[..]);
        assert_eq!(FrameRepr::parse(&f, 300).unwrap().private_data.len(), 300);
        assert_eq!(
            FrameRepr::parse(&f, 299),
            Err(MpaError::PrivateDataTooLong { len: 300, max: 299 })
        );
        // A cap above the RFC limit is the RFC limit.
        let mut big = hex(RPING_REQ);
        big[18..20].copy_from_slice(&513u16.to_be_bytes());
        assert_eq!(
            frame_len(&big, usize::MAX),
            Some(Err(MpaError::PrivateDataTooLong { len: 513, max: 512 }))
        );
    }

    #[test]
    fn reject_and_reserved_bits_are_reported() {
        let mut bytes = hex(RPING_REP);
        bytes[16] = 0x10 | 0x20 | 0x08; // H, R and siw's private 0x08 bit
        let r = decode(&bytes);
        assert!(r.is_reject() && r.reject && r.enhanced);
        assert_eq!(r.reserved, 0x08);
        assert_reencodes(&r, &bytes);
        // R on a Request is reported but is not a reject.
        let mut bytes = hex(RPING_REQ);
        bytes[16] |= 0x20;
        let r = decode(&bytes);
        assert!(r.reject && !r.is_reject());
    }

    #[test]
    fn enhanced_with_short_private_data() {
        let mut bytes = hex(RPING_REQ);
        bytes[18..20].copy_from_slice(&2u16.to_be_bytes());
        bytes.truncate(22);
        let r = decode(&bytes);
        assert!(matches!(
            r.ird_ord(),
            Some(Err(DecodeError::Truncated { .. }))
        ));
        assert_eq!(r.ulp_private_data(), &[] as &[u8]);
    }

    #[test]
    fn emit_errors() {
        let pd = [0u8; 513];
        let mut repr = FrameRepr {
            kind: FrameKind::Reply,
            markers: false,
            crc: false,
            reject: true,
            enhanced: false,
            reserved: 0,
            revision: 2,
            private_data: &pd,
        };
        let mut buf = [0u8; 600];
        assert!(matches!(
            repr.emit(&mut buf),
            Err(EncodeError::OutOfRange { max: 512, .. })
        ));
        repr.private_data = &pd[..4];
        repr.reserved = 0x10;
        assert!(matches!(
            repr.emit(&mut buf),
            Err(EncodeError::OutOfRange {
                field: "reserved flags",
                ..
            })
        ));
        repr.reserved = 0;
        assert_eq!(
            repr.emit(&mut buf[..23]),
            Err(EncodeError::BufferTooSmall {
                what: WHAT,
                needed: 24,
                got: 23
            })
        );
    }

    fn arb_repr(pd: &[u8]) -> impl Strategy<Value = FrameRepr<'_>> {
        (
            prop_oneof![Just(FrameKind::Request), Just(FrameKind::Reply)],
            any::<[bool; 4]>(),
            0u8..=0x0f,
            1u8..=2,
            0..=pd.len(),
        )
            .prop_map(
                move |(kind, [m, c, r, h], reserved, revision, n)| FrameRepr {
                    kind,
                    markers: m,
                    crc: c,
                    reject: r,
                    enhanced: h,
                    reserved,
                    revision,
                    private_data: &pd[..n],
                },
            )
    }

    static PD: [u8; MPA_MAX_PRIVATE_DATA] = {
        let mut pd = [0u8; MPA_MAX_PRIVATE_DATA];
        let mut i = 0;
        while i < pd.len() {
            pd[i] = (i * 7 + 3) as u8;
            i += 1;
        }
        pd
    };

    proptest! {
        #[test]
        fn round_trip(repr in arb_repr(&PD)) {
            let mut buf = vec![0u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(buf.len()));
            prop_assert_eq!(frame_len(&buf, MPA_MAX_PRIVATE_DATA), Some(Ok(buf.len())));
            let f = Frame::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(FrameRepr::parse(&f, MPA_MAX_PRIVATE_DATA).unwrap(), repr);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = frame_len(&bytes, SIW_MAX_PRIVATE_DATA);
            if let Ok(f) = Frame::new_checked(&bytes[..]) {
                let _ = FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA);
            }
        }

        #[test]
        fn frame_len_agrees_with_parse(mut bytes in proptest::collection::vec(any::<u8>(), 0..40), kind in any::<bool>()) {
            // Mostly valid headers, arbitrary rest.
            if bytes.len() >= 16 {
                bytes[..16].copy_from_slice(if kind { &REQUEST_KEY } else { &REPLY_KEY });
            }
            match frame_len(&bytes, SIW_MAX_PRIVATE_DATA) {
                Some(Ok(n)) => {
                    let f = Frame::new_checked(&bytes[..n]).unwrap();
                    prop_assert!(FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA).is_ok());
                }
                Some(Err(_)) => {
                    if let Ok(f) = Frame::new_checked(&bytes[..]) {
                        prop_assert!(FrameRepr::parse(&f, SIW_MAX_PRIVATE_DATA).is_err());
                    }
                }
                None => prop_assert!(Frame::new_checked(&bytes[..]).is_err()),
            }
        }
    }
}
