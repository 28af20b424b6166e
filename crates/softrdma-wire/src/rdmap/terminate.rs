//! The Terminate message header (RFC 5040 section 4.8).
//!
//! A Terminate is an untagged DDP message on queue 2 (its DDP/RDMAP header
//! is decoded by [`crate::ddp`] and [`crate::rdmap`]); its payload, decoded
//! here, names the error and may carry copies of the headers of the message
//! that caused it:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! | Layer | EType |  Error Code   |M|D|R|        Reserved         |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |  DDP Segment Length (if D)    |                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+                               +
//! ~        Terminated DDP Header (if D: 14 or 18 bytes)           ~
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ~        Terminated RDMA Header (if R: 28 bytes)                ~
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! * Layer / EType / Error Code: the error, see [`crate::errcode`];
//! * M ("Hdrct" bit 0): the DDP Segment Length field is valid;
//! * D: the DDP Segment Length field and the DDP header of the terminated
//!   segment follow (tagged, 14 bytes, or untagged, 18 bytes, told apart by
//!   the T bit of its first byte);
//! * R: the RDMAP header of the terminated message follows (the 28-byte
//!   RDMA Read Request header);
//! * Reserved (13 bits): sent as zero, not checked.
//!
//! # What Linux siw sends
//!
//! `siw_send_terminate` (siw_qp.c) builds the copied part from the header of
//! the failed inbound FPDU, MPA length field included: the MPA length,
//! rewritten to the length of the segment's payload, becomes the DDP Segment
//! Length, and the DDP header follows. It sets:
//!
//! * RDMAP Local Catastrophic (siw sends Error Code 0xff), LLP errors,
//!   RDMAP/DDP version and RDMAP opcode errors: no flags, nothing copied;
//! * other DDP errors and RDMAP Remote Operation errors: M and D, the DDP
//!   header copied;
//! * RDMAP Remote Protection errors: M, D and R; for a Read Request the
//!   28-byte Read Request header follows the DDP header, but for a Send
//!   (with Invalidate) siw sets R and copies **no** RDMAP header.
//!
//! To decode that last shape, a set R bit with no bytes after the DDP header
//! gives an empty copied RDMAP header rather than an error.

use crate::ddp;
use crate::errcode::{TermCode, TermError};
use crate::{DecodeError, EncodeError};

/// Length of the Terminate Control word (Layer, EType, Error Code, Hdrct,
/// Reserved).
pub const CONTROL_LEN: usize = 4;
/// Length of the DDP Segment Length field.
pub const SEGMENT_LENGTH_LEN: usize = 2;
/// Length of a copied RDMAP header (the RDMA Read Request header).
pub const RDMAP_HEADER_LEN: usize = 28;
/// Longest Terminate header: control, segment length, untagged DDP header,
/// RDMAP header.
pub const MAX_LEN: usize =
    CONTROL_LEN + SEGMENT_LENGTH_LEN + ddp::UNTAGGED_HEADER_LEN + RDMAP_HEADER_LEN;

/// M: the DDP Segment Length field is valid (bit of the third byte).
pub const FLAG_M: u8 = 0x80;
/// D: the DDP Segment Length and the terminated DDP header are included.
pub const FLAG_D: u8 = 0x40;
/// R: the terminated RDMAP header is included.
pub const FLAG_R: u8 = 0x20;
/// The reserved bits of the second half of the control word.
pub const RESERVED_MASK: u16 = 0x1fff;

mod field {
    use core::ops::Range;
    pub(super) const CODE: Range<usize> = 0..2;
    pub(super) const HDRCT: usize = 2;
    pub(super) const RESERVED: Range<usize> = 2..4;
    pub(super) const SEGMENT_LENGTH: Range<usize> = 4..6;
    pub(super) const DDP_HEADER: usize = 6;
}

const WHAT: &str = "RDMAP Terminate header";

/// A zero-copy view of a Terminate header (the DDP payload of a Terminate
/// message).
///
/// After [`Terminate::new_checked`] every part the flags announce is present,
/// so no accessor can panic. Bytes after the parts the flags announce are
/// ignored ([`Terminate::header_len`] says where they start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminate<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Terminate<T> {
    /// Wraps a buffer without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        Self { buffer }
    }

    /// Wraps a buffer after checking that it holds every part the flags
    /// announce.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is shorter than the control
    /// word, than the DDP part (if D), or holds between 1 and 27 bytes of
    /// the RDMAP header (if R).
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let t = Self::new_unchecked(buffer);
        t.check_len()?;
        Ok(t)
    }

    /// Checks the length (see [`Terminate::new_checked`]).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] as for [`Terminate::new_checked`].
    pub fn check_len(&self) -> Result<(), DecodeError> {
        let got = self.buffer.as_ref().len();
        let truncated = |needed| DecodeError::Truncated {
            what: WHAT,
            needed,
            got,
        };
        if got < CONTROL_LEN {
            return Err(truncated(CONTROL_LEN));
        }
        if self.ddp_header_included() {
            if got <= field::DDP_HEADER {
                return Err(truncated(field::DDP_HEADER + 1));
            }
            let end = self.rdmap_header_start();
            if got < end {
                return Err(truncated(end));
            }
        }
        if self.rdmap_header_included() {
            let start = self.rdmap_header_start();
            let rest = got.saturating_sub(start);
            if rest != 0 && rest < RDMAP_HEADER_LEN {
                return Err(truncated(start + RDMAP_HEADER_LEN));
            }
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

    /// The raw Layer / EType / Error Code.
    pub fn code(&self) -> TermCode {
        TermCode::from_bytes([
            self.byte(field::CODE.start),
            self.byte(field::CODE.start + 1),
        ])
    }

    /// The error, if the code is one of the table's.
    pub fn error(&self) -> Option<TermError> {
        self.code().known()
    }

    /// The three Hdrct bits (M, D, R) in the top of the returned byte.
    pub fn hdrct(&self) -> u8 {
        self.byte(field::HDRCT) & (FLAG_M | FLAG_D | FLAG_R)
    }

    /// M: the DDP Segment Length field is valid.
    pub fn segment_length_valid(&self) -> bool {
        self.hdrct() & FLAG_M != 0
    }

    /// D: the DDP Segment Length and terminated DDP header are included.
    pub fn ddp_header_included(&self) -> bool {
        self.hdrct() & FLAG_D != 0
    }

    /// R: the terminated RDMAP header is included.
    pub fn rdmap_header_included(&self) -> bool {
        self.hdrct() & FLAG_R != 0
    }

    /// The 13 reserved bits.
    pub fn reserved(&self) -> u16 {
        u16::from_be_bytes([
            self.byte(field::RESERVED.start),
            self.byte(field::RESERVED.start + 1),
        ]) & RESERVED_MASK
    }

    /// The DDP Segment Length field, if D is set.
    pub fn ddp_segment_length(&self) -> Option<u16> {
        self.ddp_header_included().then(|| {
            u16::from_be_bytes([
                self.byte(field::SEGMENT_LENGTH.start),
                self.byte(field::SEGMENT_LENGTH.start + 1),
            ])
        })
    }

    /// Length of the copied DDP header (by its T bit), or 0 if D is clear.
    fn ddp_header_len(&self) -> usize {
        if self.ddp_header_included() {
            ddp::header_len(self.byte(field::DDP_HEADER))
        } else {
            0
        }
    }

    /// Offset of the copied RDMAP header (where it is or would be).
    fn rdmap_header_start(&self) -> usize {
        if self.ddp_header_included() {
            field::DDP_HEADER + self.ddp_header_len()
        } else {
            CONTROL_LEN
        }
    }

    /// Length of the copied RDMAP header: 0 if R is clear or (Linux siw) if
    /// nothing follows the DDP header, else 28.
    fn rdmap_header_len(&self) -> usize {
        let start = self.rdmap_header_start();
        if self.rdmap_header_included() && self.buffer.as_ref().len() > start {
            RDMAP_HEADER_LEN
        } else {
            0
        }
    }

    /// Length of the Terminate header: the control word and every part the
    /// flags announce.
    pub fn header_len(&self) -> usize {
        self.rdmap_header_start() + self.rdmap_header_len()
    }
}

impl<'a, T: AsRef<[u8]> + ?Sized> Terminate<&'a T> {
    /// The copied DDP header of the terminated segment, if D is set.
    pub fn ddp_header(&self) -> Option<&'a [u8]> {
        if !self.ddp_header_included() {
            return None;
        }
        let start = field::DDP_HEADER;
        self.buffer
            .as_ref()
            .get(start..start + self.ddp_header_len())
    }

    /// The copied RDMAP header of the terminated message, if R is set
    /// (empty in the Linux siw shape described in the module docs).
    pub fn rdmap_header(&self) -> Option<&'a [u8]> {
        if !self.rdmap_header_included() {
            return None;
        }
        let start = self.rdmap_header_start();
        self.buffer
            .as_ref()
            .get(start..start + self.rdmap_header_len())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Terminate<T> {
    fn set_byte(&mut self, at: usize, value: u8) {
        if let Some(b) = self.buffer.as_mut().get_mut(at) {
            *b = value;
        }
    }

    /// Writes Layer, EType and Error Code.
    pub fn set_code(&mut self, code: TermCode) {
        let [a, b] = code.to_bytes();
        self.set_byte(field::CODE.start, a);
        self.set_byte(field::CODE.start + 1, b);
    }

    /// Writes the M, D and R bits and the reserved bits (masked to 13 bits).
    pub fn set_hdrct(&mut self, m: bool, d: bool, r: bool, reserved: u16) {
        let mut hdrct = 0u8;
        for (set, bit) in [(m, FLAG_M), (d, FLAG_D), (r, FLAG_R)] {
            if set {
                hdrct |= bit;
            }
        }
        let [hi, lo] = (reserved & RESERVED_MASK).to_be_bytes();
        self.set_byte(field::RESERVED.start, hdrct | hi);
        self.set_byte(field::RESERVED.start + 1, lo);
    }

    /// Writes the DDP Segment Length field (only meaningful with D set).
    pub fn set_ddp_segment_length(&mut self, len: u16) {
        let [a, b] = len.to_be_bytes();
        self.set_byte(field::SEGMENT_LENGTH.start, a);
        self.set_byte(field::SEGMENT_LENGTH.start + 1, b);
    }
}

/// The DDP part of a Terminate: the DDP Segment Length field and the copied
/// DDP header of the terminated segment (present when D is set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminatedDdp<'a> {
    /// The DDP Segment Length field (meaningful if M is set; Linux siw puts
    /// the length of the segment's payload here).
    pub segment_length: u16,
    /// The copied DDP header: 14 bytes if its T bit is set, else 18.
    pub header: &'a [u8],
}

/// A decoded Terminate header, borrowing the copied headers.
///
/// The 13 reserved bits are not kept: [`TerminateRepr::emit`] writes them as
/// zero.
///
/// # Example
///
/// ```
/// use softrdma_wire::errcode::TermError;
/// use softrdma_wire::rdmap::terminate::{Terminate, TerminateRepr};
///
/// // A Send arrived with no receive posted (Linux siw's shape: M and D set,
/// // the failed segment's 16-byte payload length and DDP header copied).
/// let bytes = [
///     0x12, 0x02, 0xc0, 0x00, // DDP, Untagged Buffer Error, no buffer; M D
///     0x00, 0x10, // DDP Segment Length 16
///     0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, // the Send's DDP header
/// ];
/// let t = Terminate::new_checked(&bytes[..]).unwrap();
/// let repr = TerminateRepr::parse(&t).unwrap();
/// assert_eq!(repr.error(), Some(TermError::DdpUntaggedNoBuffer));
/// assert_eq!(repr.ddp.unwrap().segment_length, 16);
///
/// let mut out = [0u8; 24];
/// assert_eq!(repr.emit(&mut out), Ok(24));
/// assert_eq!(out, bytes);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TerminateRepr<'a> {
    /// Layer, EType and Error Code, possibly outside the table.
    pub code: TermCode,
    /// M: the DDP Segment Length field is valid.
    pub segment_length_valid: bool,
    /// D: the DDP Segment Length and copied DDP header.
    pub ddp: Option<TerminatedDdp<'a>>,
    /// R: the copied RDMAP header, 28 bytes (or empty: see the module docs).
    pub rdmap_header: Option<&'a [u8]>,
}

impl<'a> TerminateRepr<'a> {
    /// A Terminate for `code` with no copied headers and no flags (what Linux
    /// siw sends for catastrophic and LLP errors).
    pub fn new(code: impl Into<TermCode>) -> Self {
        Self {
            code: code.into(),
            segment_length_valid: false,
            ddp: None,
            rdmap_header: None,
        }
    }

    /// Decodes a Terminate header.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the view was not length-checked and a
    /// part the flags announce is missing. Unknown error codes are not
    /// errors: they are kept in [`TerminateRepr::code`].
    pub fn parse<T: AsRef<[u8]> + ?Sized>(t: &Terminate<&'a T>) -> Result<Self, DecodeError> {
        t.check_len()?;
        let ddp = match (t.ddp_segment_length(), t.ddp_header()) {
            (Some(segment_length), Some(header)) => Some(TerminatedDdp {
                segment_length,
                header,
            }),
            _ => None,
        };
        Ok(Self {
            code: t.code(),
            segment_length_valid: t.segment_length_valid(),
            ddp,
            rdmap_header: t.rdmap_header(),
        })
    }

    /// The error, if the code is one of the table's.
    pub fn error(&self) -> Option<TermError> {
        self.code.known()
    }

    /// Number of bytes [`TerminateRepr::emit`] writes.
    pub fn buffer_len(&self) -> usize {
        let ddp = self.ddp.map_or(0, |d| SEGMENT_LENGTH_LEN + d.header.len());
        CONTROL_LEN + ddp + self.rdmap_header.map_or(0, <[u8]>::len)
    }

    /// Writes the Terminate header to the start of `buf`, returning its
    /// length.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] if the copied DDP header is not 14 bytes
    /// (T bit set) or 18 bytes (T bit clear), or the copied RDMAP header is
    /// neither 28 bytes nor empty; [`EncodeError::BufferTooSmall`] if `buf`
    /// is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        if let Some(d) = self.ddp {
            let expected = d
                .header
                .first()
                .map_or(ddp::TAGGED_HEADER_LEN, |&b| ddp::header_len(b));
            if d.header.len() != expected {
                return Err(EncodeError::OutOfRange {
                    what: WHAT,
                    field: "terminated DDP header length",
                    value: d.header.len() as u64,
                    max: expected as u64,
                });
            }
        }
        if let Some(r) = self.rdmap_header
            && !r.is_empty()
            && r.len() != RDMAP_HEADER_LEN
        {
            return Err(EncodeError::OutOfRange {
                what: WHAT,
                field: "terminated RDMAP header length",
                value: r.len() as u64,
                max: RDMAP_HEADER_LEN as u64,
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
        let mut at = CONTROL_LEN;
        {
            let mut t = Terminate::new_unchecked(&mut *dst);
            t.set_code(self.code);
            t.set_hdrct(
                self.segment_length_valid,
                self.ddp.is_some(),
                self.rdmap_header.is_some(),
                0,
            );
            if let Some(d) = self.ddp {
                t.set_ddp_segment_length(d.segment_length);
            }
        }
        let mut copy = |src: &[u8], at: &mut usize| {
            if let Some(out) = dst.get_mut(*at..*at + src.len()) {
                out.copy_from_slice(src);
            }
            *at += src.len();
        };
        if let Some(d) = self.ddp {
            at += SEGMENT_LENGTH_LEN;
            copy(d.header, &mut at);
        }
        if let Some(r) = self.rdmap_header {
            copy(r, &mut at);
        }
        Ok(needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errcode::ErrorType;
    use proptest::prelude::*;

    /// A whole siw Terminate FPDU (CRC off): MPA length, the untagged
    /// DDP/RDMAP header of the Terminate (DDP 0x41 untagged last v1, RDMAP
    /// 0x47 v1 Terminate, QN 2, MSN 1, MO 0), the Terminate header, CRC 0.
    /// Returns the Terminate header part, checking the framing on the way.
    fn siw_fpdu(terminate: &[u8]) -> Vec<u8> {
        let ulpdu_len = ddp::UNTAGGED_HEADER_LEN + terminate.len();
        let mut fpdu = (ulpdu_len as u16).to_be_bytes().to_vec();
        fpdu.extend([0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0]);
        fpdu.extend(terminate);
        fpdu.extend([0, 0, 0, 0]);
        // siw: mpa_len = len_terminate - (MPA_HDR_SIZE + MPA_CRC_SIZE).
        assert_eq!(ulpdu_len, fpdu.len() - 6);
        fpdu[2 + ddp::UNTAGGED_HEADER_LEN..fpdu.len() - 4].to_vec()
    }

    fn decode(bytes: &[u8]) -> TerminateRepr<'_> {
        let t = Terminate::new_checked(bytes).unwrap();
        assert_eq!(t.header_len(), bytes.len());
        TerminateRepr::parse(&t).unwrap()
    }

    fn assert_reencodes(repr: &TerminateRepr<'_>, bytes: &[u8]) {
        let mut out = vec![0u8; repr.buffer_len()];
        assert_eq!(repr.emit(&mut out), Ok(bytes.len()));
        assert_eq!(out, bytes);
    }

    #[test]
    fn siw_qp_to_terminate_local_catastrophic() {
        // siw_qp_modify(.. TERMINATE): RDMAP, Local Catastrophic, code 0xff,
        // nothing copied.
        let bytes = siw_fpdu(&[0x00, 0xff, 0x00, 0x00]);
        let r = decode(&bytes);
        assert_eq!(r.error(), Some(TermError::RdmapLocalCatastrophic));
        assert_eq!(r.code.ecode(), 0xff);
        assert_eq!(
            (r.segment_length_valid, r.ddp, r.rdmap_header),
            (false, None, None)
        );
        assert_reencodes(&r, &bytes);
        assert_eq!(r, TerminateRepr::new(TermCode::new(0, 0, 0xff).unwrap()));
    }

    #[test]
    fn siw_llp_crc_error() {
        let bytes = siw_fpdu(&[0x20, 0x02, 0x00, 0x00]);
        let r = decode(&bytes);
        assert_eq!(r.error(), Some(TermError::MpaCrcError));
        assert_eq!(r, TerminateRepr::new(TermError::MpaCrcError));
        assert_reencodes(&r, &bytes);
    }

    #[test]
    fn siw_send_without_receive() {
        // The rping Send (ULPDU 34 bytes: 18 header + 16 payload) finds no
        // receive: DDP, Untagged Buffer Error, Invalid MSN - no buffer; M D;
        // siw rewrites the copied MPA length to 34 - 18 = 16.
        let failed_send = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        let mut term = vec![0x12, 0x02, 0xc0, 0x00, 0x00, 0x10];
        term.extend(failed_send);
        let bytes = siw_fpdu(&term);
        let t = Terminate::new_checked(&bytes[..]).unwrap();
        assert_eq!(t.hdrct(), FLAG_M | FLAG_D);
        assert_eq!(t.reserved(), 0);
        let r = TerminateRepr::parse(&t).unwrap();
        assert_eq!(r.error(), Some(TermError::DdpUntaggedNoBuffer));
        assert_eq!(r.code.error_type(), Some(ErrorType::DdpUntaggedBuffer));
        assert!(r.segment_length_valid);
        assert_eq!(
            r.ddp,
            Some(TerminatedDdp {
                segment_length: 16,
                header: &failed_send
            })
        );
        assert_eq!(r.rdmap_header, None);
        assert_reencodes(&r, &bytes);
        // The copied header is a DDP untagged header the ddp module reads.
        let copied = ddp::Untagged::new_checked(r.ddp.unwrap().header).unwrap();
        assert_eq!((copied.qn().0, copied.msn().0, copied.mo()), (0, 1, 0));
    }

    #[test]
    fn siw_write_out_of_bounds() {
        // An RDMA Write of the rping capture (frame 13: ULPDU 78, STag
        // 0x88724100, TO 0x0000555c000ba450) hits a base/bounds error:
        // DDP, Tagged Buffer Error, code 1; M D; 78 - 14 = 64.
        let failed_write = [
            0xc1, 0x40, 0x88, 0x72, 0x41, 0x00, 0x00, 0x00, 0x55, 0x5c, 0x00, 0x0b, 0xa4, 0x50,
        ];
        let mut term = vec![0x11, 0x01, 0xc0, 0x00, 0x00, 0x40];
        term.extend(failed_write);
        let bytes = siw_fpdu(&term);
        let r = decode(&bytes);
        assert_eq!(r.error(), Some(TermError::DdpTaggedBaseOrBounds));
        assert_eq!(r.ddp.unwrap().segment_length, 64);
        assert_eq!(r.ddp.unwrap().header, &failed_write);
        assert_reencodes(&r, &bytes);
        let copied = ddp::Tagged::new_checked(r.ddp.unwrap().header).unwrap();
        assert_eq!(copied.stag().0, 0x8872_4100);
        assert_eq!(copied.to(), 0x0000_555c_000b_a450);
    }

    fn read_request_header() -> [u8; 28] {
        // Sink STag/TO, size 64, source STag/TO (hand-built).
        let mut h = [0u8; 28];
        h[0..4].copy_from_slice(&0xff05_cf00u32.to_be_bytes());
        h[4..12].copy_from_slice(&0x0000_55ca_f061_5450u64.to_be_bytes());
        h[12..16].copy_from_slice(&64u32.to_be_bytes());
        h[16..20].copy_from_slice(&0x8872_4100u32.to_be_bytes());
        h[20..28].copy_from_slice(&0x0000_555c_000b_a450u64.to_be_bytes());
        h
    }

    #[test]
    fn siw_read_request_invalid_stag() {
        // A Read Request (ULPDU 46 = 18 + 28) names an invalid source STag:
        // RDMAP, Remote Protection Error, Invalid STag; M D R; siw copies
        // the whole iwarp_rdma_rreq: length 46 - (48 - 2) = 0, DDP header,
        // Read Request header.
        let ddp_hdr = [0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        let rr = read_request_header();
        let mut term = vec![0x01, 0x00, 0xe0, 0x00, 0x00, 0x00];
        term.extend(ddp_hdr);
        term.extend(rr);
        let bytes = siw_fpdu(&term);
        assert_eq!(bytes.len(), MAX_LEN);
        let r = decode(&bytes);
        assert_eq!(r.error(), Some(TermError::RdmapInvalidStag));
        assert!(r.segment_length_valid);
        assert_eq!(
            r.ddp,
            Some(TerminatedDdp {
                segment_length: 0,
                header: &ddp_hdr
            })
        );
        assert_eq!(r.rdmap_header, Some(&rr[..]));
        assert_reencodes(&r, &bytes);
    }

    #[test]
    fn siw_send_protection_error_sets_r_without_rdmap_header() {
        // A Send with Invalidate names an STag it may not invalidate: siw sets
        // M D R but copies only the 20-byte iwarp_send.
        let ddp_hdr = [
            0x41, 0x44, 0x12, 0x34, 0x56, 0x78, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0,
        ];
        let mut term = vec![0x01, 0x00, 0xe0, 0x00, 0x00, 0x08];
        term.extend(ddp_hdr);
        let bytes = siw_fpdu(&term);
        let t = Terminate::new_checked(&bytes[..]).unwrap();
        assert!(t.rdmap_header_included());
        assert_eq!(t.header_len(), 24);
        let r = TerminateRepr::parse(&t).unwrap();
        assert_eq!(r.rdmap_header, Some(&[][..]));
        assert_eq!(r.ddp.unwrap().header, &ddp_hdr);
        assert_reencodes(&r, &bytes);
    }

    #[test]
    fn siw_remote_operation_error_copies_ddp_header() {
        // RDMAP Remote Operation errors other than version/opcode: M D and the
        // DDP header (tagged: as iwarp_rdma_write).
        let hdr = [0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut term = vec![0x02, 0x07, 0xc0, 0x00, 0x00, 0x04];
        term.extend(hdr);
        let r = decode(&term);
        assert_eq!(r.error(), Some(TermError::RdmapCatastrophicStream));
        assert_reencodes(&r, &term);
        // Opcode errors: nothing copied.
        let r = decode(&[0x02, 0x06, 0x00, 0x00]);
        assert_eq!(r.error(), Some(TermError::RdmapUnexpectedOpcode));
    }

    #[test]
    fn unknown_codes_and_reserved_bits() {
        let bytes = [0x7a, 0x99, 0x1f, 0xff];
        let t = Terminate::new_checked(&bytes[..]).unwrap();
        assert_eq!(t.reserved(), 0x1fff);
        assert_eq!(t.hdrct(), 0);
        assert_eq!(t.error(), None);
        let r = TerminateRepr::parse(&t).unwrap();
        assert_eq!(
            (r.code.layer_raw(), r.code.etype(), r.code.ecode()),
            (7, 0xa, 0x99)
        );
        assert_eq!(r.error(), None);
        // Reserved bits are written as zero.
        let mut out = [0xffu8; 4];
        assert_eq!(r.emit(&mut out), Ok(4));
        assert_eq!(out, [0x7a, 0x99, 0x00, 0x00]);
    }

    #[test]
    fn m_without_d_and_r_without_d() {
        let r = decode(&[0x12, 0x01, 0x80, 0x00]);
        assert!(r.segment_length_valid);
        assert_eq!(r.ddp, None);
        // R alone: the RDMAP header follows the control word.
        let rr = read_request_header();
        let mut bytes = vec![0x01, 0x02, 0x20, 0x00];
        bytes.extend(rr);
        let r = decode(&bytes);
        assert_eq!(r.ddp, None);
        assert_eq!(r.rdmap_header, Some(&rr[..]));
        assert_reencodes(&r, &bytes);
    }

    #[test]
    fn trailing_bytes_are_ignored() {
        let mut bytes = vec![0x20, 0x01, 0x00, 0x00];
        bytes.extend([1, 2, 3]);
        let t = Terminate::new_checked(&bytes[..]).unwrap();
        assert_eq!(t.header_len(), 4);
        let rr = read_request_header();
        let mut bytes = vec![0x01, 0x02, 0x20, 0x00];
        bytes.extend(rr);
        bytes.extend([9, 9]);
        let t = Terminate::new_checked(&bytes[..]).unwrap();
        assert_eq!(t.header_len(), 32);
        assert_eq!(t.rdmap_header(), Some(&rr[..]));
    }

    #[test]
    fn truncated_at_every_length() {
        let ddp_hdr = [0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        let mut full = vec![0x01, 0x00, 0xe0, 0x00, 0x00, 0x00];
        full.extend(ddp_hdr);
        full.extend(read_request_header());
        for n in 0..full.len() {
            let prefix = &full[..n];
            // Only the siw shape (R set, nothing after the DDP header) is a
            // valid shorter header.
            let siw_shape = n == CONTROL_LEN + SEGMENT_LENGTH_LEN + ddp::UNTAGGED_HEADER_LEN;
            let res = Terminate::new_checked(prefix);
            assert_eq!(res.is_ok(), siw_shape, "len {n}");
            if let Err(e) = res {
                assert!(matches!(e, DecodeError::Truncated { got, .. } if got == n));
                let t = Terminate::new_unchecked(prefix);
                assert!(TerminateRepr::parse(&t).is_err());
            }
        }
        // Tagged copied header: truncated inside it.
        let bytes = [0x11, 0x01, 0xc0, 0x00, 0x00, 0x40, 0xc1, 0x40, 0, 0];
        assert_eq!(
            Terminate::new_checked(&bytes[..]),
            Err(DecodeError::Truncated {
                what: WHAT,
                needed: 20,
                got: 10
            })
        );
    }

    #[test]
    fn unchecked_short_views_do_not_panic() {
        let mut full = vec![0x01, 0x00, 0xe0, 0x1f, 0x00, 0x00];
        full.extend([0x41; 18]);
        full.extend(read_request_header());
        for n in 0..=full.len() {
            let t = Terminate::new_unchecked(&full[..n]);
            let _ = (
                t.code(),
                t.error(),
                t.hdrct(),
                t.reserved(),
                t.ddp_segment_length(),
            );
            let _ = (t.ddp_header(), t.rdmap_header(), t.header_len());
            let mut buf = full[..n].to_vec();
            let mut m = Terminate::new_unchecked(&mut buf[..]);
            m.set_code(TermError::MpaNoMatchingRtr.into());
            m.set_hdrct(true, true, true, 0xffff);
            m.set_ddp_segment_length(7);
        }
    }

    #[test]
    fn emit_errors() {
        let short = [0x41u8; 14]; // untagged first byte, tagged length
        let r = TerminateRepr {
            code: TermError::DdpUntaggedInvalidQn.into(),
            segment_length_valid: true,
            ddp: Some(TerminatedDdp {
                segment_length: 0,
                header: &short,
            }),
            rdmap_header: None,
        };
        assert!(matches!(
            r.emit(&mut [0u8; 64]),
            Err(EncodeError::OutOfRange {
                value: 14,
                max: 18,
                ..
            })
        ));
        let r = TerminateRepr {
            ddp: Some(TerminatedDdp {
                segment_length: 0,
                header: &[],
            }),
            ..r
        };
        assert!(matches!(
            r.emit(&mut [0u8; 64]),
            Err(EncodeError::OutOfRange { .. })
        ));
        let rr = [0u8; 27];
        let r = TerminateRepr {
            ddp: None,
            rdmap_header: Some(&rr),
            ..r
        };
        assert!(matches!(
            r.emit(&mut [0u8; 64]),
            Err(EncodeError::OutOfRange {
                value: 27,
                max: 28,
                ..
            })
        ));
        let r = TerminateRepr::new(TermError::MpaCrcError);
        assert_eq!(
            r.emit(&mut [0u8; 3]),
            Err(EncodeError::BufferTooSmall {
                what: WHAT,
                needed: 4,
                got: 3
            })
        );
    }

    static UNTAGGED: [u8; 18] = [
        0x41, 0x43, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
    ];
    static TAGGED: [u8; 14] = [0xc1, 0x40, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
    static RR: [u8; 28] = [7; 28];

    fn arb_repr() -> impl Strategy<Value = TerminateRepr<'static>> {
        (
            0u8..=0xf,
            0u8..=0xf,
            any::<u8>(),
            any::<bool>(),
            prop_oneof![
                Just(None),
                any::<u16>().prop_map(|l| Some(TerminatedDdp {
                    segment_length: l,
                    header: &UNTAGGED[..]
                })),
                any::<u16>().prop_map(|l| Some(TerminatedDdp {
                    segment_length: l,
                    header: &TAGGED[..]
                })),
            ],
            prop_oneof![Just(None), Just(Some(&RR[..])), Just(Some(&[][..]))],
        )
            .prop_map(|(l, e, c, m, ddp, rdmap_header)| TerminateRepr {
                code: TermCode::new(l, e, c).unwrap(),
                segment_length_valid: m,
                ddp,
                rdmap_header,
            })
    }

    proptest! {
        #[test]
        fn round_trip(repr in arb_repr()) {
            let mut buf = vec![0u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(buf.len()));
            let t = Terminate::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(t.header_len(), buf.len());
            prop_assert_eq!(TerminateRepr::parse(&t).unwrap(), repr);
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let t = Terminate::new_unchecked(&bytes[..]);
            let _ = (t.header_len(), t.ddp_header(), t.rdmap_header());
            if let Ok(t) = Terminate::new_checked(&bytes[..]) {
                let r = TerminateRepr::parse(&t).unwrap();
                prop_assert!(t.header_len() <= bytes.len());
                let mut out = vec![0u8; r.buffer_len()];
                prop_assert_eq!(r.emit(&mut out), Ok(t.header_len()));
            }
        }
    }
}
