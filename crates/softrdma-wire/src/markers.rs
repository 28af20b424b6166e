//! MPA markers (RFC 5044 section 4.3).
//!
//! ```text
//!   0                   1                   2                   3
//!   0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//!  |           RESERVED            |            FPDUPTR            |
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! The rules this module implements (RFC 5044 section 4.3):
//!
//! * RESERVED is sent as zero and ignored on receive (except by the CRC).
//! * FPDUPTR is "the number of octets in the TCP stream from the beginning of
//!   the ULPDU Length field to the first octet of the entire MPA Marker",
//!   an unsigned 16-bit back-pointer. Its two least significant bits are
//!   sent as zero and treated as zero by the receiver.
//! * Markers are "inserted immediately preceding the first FPDU of full
//!   operation phase, and at every 512th octet of the TCP octet stream
//!   thereafter. As a result, the first MPA Marker has an FPDUPTR value of
//!   0x0000." Stream *positions* in this crate are therefore counted from the
//!   first octet of full operation phase (the first octet after the MPA
//!   Request/Reply frame sent in that direction): markers start at positions
//!   0, 512, 1024, ... ([`is_marker_position`]).
//! * A marker that falls immediately before an FPDU's ULPDU Length field (the
//!   first marker, and any marker that falls exactly where the previous FPDU
//!   ended) belongs to that FPDU and has FPDUPTR 0; a marker inside an FPDU
//!   (in the ULPDU, between ULPDU and pad, between pad and CRC) points back
//!   to the ULPDU Length field of that FPDU. A marker never falls inside the
//!   length field or the CRC field: FPDUs are multiples of 4 octets and start
//!   at positions that are multiples of 4.
//! * Markers are not counted by ULPDU_LENGTH and do not change the pad
//!   (4 octets each), but the CRC covers them: the CRC of an FPDU is computed
//!   over its bytes as they appear in the TCP stream, markers included
//!   (Wireshark's MPA dissector does the same, a leading marker included).
//!
//! Kernel siw rejects markers; they exist here for completeness and for
//! iWARP hardware that insists on them. The deframer
//! ([`crate::deframer`]) removes them itself; [`MarkerRemover`] is the
//! FPDU-agnostic building block for tools.

use crate::crc::{self, CRC_LEN};
use crate::{DecodeError, EncodeError};

/// Length of a marker.
pub const MARKER_LEN: usize = 4;

/// Distance between the starts of two consecutive markers.
pub const MARKER_INTERVAL: usize = 512;

/// [`MARKER_INTERVAL`] as a stream position difference.
const INTERVAL: u64 = MARKER_INTERVAL as u64;

/// Whether a marker starts at stream position `pos`.
#[inline]
#[must_use]
pub const fn is_marker_position(pos: u64) -> bool {
    pos.is_multiple_of(INTERVAL)
}

/// Start of the first marker at or after stream position `pos`.
#[inline]
#[must_use]
pub const fn next_marker_position(pos: u64) -> u64 {
    pos.div_ceil(INTERVAL).saturating_mul(INTERVAL)
}

/// A zero-copy view of a marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    use core::ops::Range;
    /// RESERVED.
    pub(super) const RESERVED: Range<usize> = 0..2;
    /// FPDUPTR.
    pub(super) const FPDUPTR: Range<usize> = 2..4;
}

impl<T: AsRef<[u8]>> Marker<T> {
    /// Wraps `buffer` without checking its length.
    pub const fn new_unchecked(buffer: T) -> Self {
        Marker { buffer }
    }

    /// Wraps `buffer` after checking it holds at least [`MARKER_LEN`] bytes.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if it does not.
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let got = buffer.as_ref().len();
        if got < MARKER_LEN {
            return Err(DecodeError::Truncated {
                what: "MPA marker",
                needed: MARKER_LEN,
                got,
            });
        }
        Ok(Marker { buffer })
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The RESERVED field.
    #[must_use]
    pub fn reserved(&self) -> u16 {
        let b = &self.buffer.as_ref()[field::RESERVED];
        u16::from_be_bytes([b[0], b[1]])
    }

    /// The FPDUPTR field, as sent (low two bits included).
    #[must_use]
    pub fn fpduptr(&self) -> u16 {
        let b = &self.buffer.as_ref()[field::FPDUPTR];
        u16::from_be_bytes([b[0], b[1]])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Marker<T> {
    /// Sets the RESERVED field.
    pub fn set_reserved(&mut self, v: u16) {
        self.buffer.as_mut()[field::RESERVED].copy_from_slice(&v.to_be_bytes());
    }

    /// Sets the FPDUPTR field.
    pub fn set_fpduptr(&mut self, v: u16) {
        self.buffer.as_mut()[field::FPDUPTR].copy_from_slice(&v.to_be_bytes());
    }
}

/// A marker's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MarkerRepr {
    /// FPDUPTR: octets from the ULPDU Length field of the FPDU back to this
    /// marker; 0 for a marker immediately preceding its FPDU.
    pub fpduptr: u16,
}

impl MarkerRepr {
    /// Reads a marker; RESERVED is ignored (RFC 5044: "ignored on receive").
    ///
    /// # Errors
    ///
    /// None today; the `Result` keeps the codec convention.
    pub fn parse<T: AsRef<[u8]>>(m: &Marker<T>) -> Result<Self, DecodeError> {
        Ok(MarkerRepr {
            fpduptr: m.fpduptr(),
        })
    }

    /// Writes the marker (RESERVED zero) into `buf`; returns [`MARKER_LEN`].
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than [`MARKER_LEN`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let b = buf
            .get_mut(..MARKER_LEN)
            .ok_or(EncodeError::BufferTooSmall {
                what: "MPA marker",
                needed: MARKER_LEN,
                got,
            })?;
        b.copy_from_slice(&self.to_bytes());
        Ok(MARKER_LEN)
    }

    /// Bytes written by [`MarkerRepr::emit`].
    #[must_use]
    pub const fn buffer_len(&self) -> usize {
        MARKER_LEN
    }

    /// The 4 marker bytes.
    #[must_use]
    pub const fn to_bytes(&self) -> [u8; MARKER_LEN] {
        let p = self.fpduptr.to_be_bytes();
        [0, 0, p[0], p[1]]
    }

    /// The marker in `bytes`.
    #[must_use]
    pub const fn from_bytes(bytes: [u8; MARKER_LEN]) -> Self {
        MarkerRepr {
            fpduptr: u16::from_be_bytes([bytes[2], bytes[3]]),
        }
    }

    /// Stream position of the ULPDU Length field this marker designates,
    /// given the marker's own position (low two bits of FPDUPTR treated as
    /// zero). `None` if the pointer reaches before the stream start.
    #[must_use]
    pub const fn header_position(&self, marker_pos: u64) -> Option<u64> {
        if self.fpduptr == 0 {
            Some(marker_pos + MARKER_LEN as u64)
        } else {
            marker_pos.checked_sub((self.fpduptr & !3) as u64)
        }
    }
}

/// The FPDUPTR a marker at `marker_pos` must carry when it belongs to the
/// FPDU whose ULPDU Length field is at `header_pos`: 0 for a marker
/// immediately preceding the FPDU (`marker_pos + 4 == header_pos`), else the
/// distance back to the header. `None` if the distance does not fit 16 bits
/// (or the marker is before the FPDU but not immediately).
#[must_use]
pub const fn expected_fpduptr(marker_pos: u64, header_pos: u64) -> Option<u16> {
    if marker_pos < header_pos {
        if marker_pos + MARKER_LEN as u64 == header_pos {
            Some(0)
        } else {
            None
        }
    } else {
        let d = marker_pos - header_pos;
        if d > u16::MAX as u64 {
            None
        } else {
            Some(d as u16)
        }
    }
}

/// Where the markers of one FPDU go, for an FPDU whose region starts at
/// stream position `start` (the position right after the previous FPDU, or
/// 0 for the first FPDU) and that is `fpdu_len` bytes long without markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpduMarkers {
    /// A marker immediately precedes the FPDU.
    has_leading: bool,
    /// The leading marker has not been yielded yet.
    leading: bool,
    /// Stream position of the ULPDU Length field.
    header_pos: u64,
    /// Stream position of the next marker after the header.
    next: u64,
    /// Markers after the header yielded so far.
    yielded: u64,
    /// FPDU length without markers.
    fpdu_len: usize,
}

/// A marker placed inside (or immediately before) an FPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlacedMarker {
    /// Offset in the marker-free FPDU bytes before which the marker goes
    /// (0 for a leading marker; always `< fpdu_len`).
    pub offset: usize,
    /// The marker.
    pub marker: MarkerRepr,
}

impl FpduMarkers {
    /// The markers of an FPDU of `fpdu_len` bytes starting at `start`.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] (field `FPDUPTR`) if a marker would be
    /// more than 65535 octets after the FPDU header (only possible for an
    /// FPDU much larger than any MULPDU with markers).
    pub fn new(start: u64, fpdu_len: usize) -> Result<Self, EncodeError> {
        let m = Self::layout(start, fpdu_len);
        let after = m.count_after_header();
        if after > 0 {
            let last_ptr = m.next + (after - 1) * INTERVAL - m.header_pos;
            if last_ptr > u64::from(u16::MAX) {
                return Err(EncodeError::OutOfRange {
                    what: "MPA marker",
                    field: "FPDUPTR",
                    value: last_ptr,
                    max: u64::from(u16::MAX),
                });
            }
        }
        Ok(m)
    }

    /// The layout, without the FPDUPTR range check.
    const fn layout(start: u64, fpdu_len: usize) -> Self {
        let leading = is_marker_position(start) && fpdu_len > 0;
        let header_pos = if leading {
            start + MARKER_LEN as u64
        } else {
            start
        };
        FpduMarkers {
            has_leading: leading,
            leading,
            header_pos,
            next: next_marker_position(header_pos),
            yielded: 0,
            fpdu_len,
        }
    }

    /// Stream position of the FPDU's ULPDU Length field.
    #[must_use]
    pub const fn header_position(&self) -> u64 {
        self.header_pos
    }

    /// Number of markers after the header (yielded or not).
    const fn count_after_header(&self) -> u64 {
        let first_off = self.next - self.yielded * INTERVAL - self.header_pos;
        let len = self.fpdu_len as u64;
        if first_off >= len {
            0
        } else {
            (len - 1 - first_off) / (INTERVAL - MARKER_LEN as u64) + 1
        }
    }

    /// Total number of markers of the FPDU, leading marker included.
    #[must_use]
    pub const fn marker_count(&self) -> usize {
        (self.count_after_header() + self.has_leading as u64) as usize
    }
}

impl Iterator for FpduMarkers {
    type Item = PlacedMarker;

    fn next(&mut self) -> Option<PlacedMarker> {
        if self.leading {
            self.leading = false;
            return Some(PlacedMarker {
                offset: 0,
                marker: MarkerRepr { fpduptr: 0 },
            });
        }
        let ptr = self.next - self.header_pos;
        let offset = ptr - self.yielded * MARKER_LEN as u64;
        if offset >= self.fpdu_len as u64 {
            return None;
        }
        self.yielded += 1;
        self.next += INTERVAL;
        Some(PlacedMarker {
            offset: usize::try_from(offset).ok()?,
            marker: MarkerRepr {
                fpduptr: u16::try_from(ptr).ok()?,
            },
        })
    }
}

/// Length on the wire of an FPDU of `fpdu_len` bytes (without markers) whose
/// region starts at stream position `start`, markers included.
#[must_use]
pub const fn marked_len(start: u64, fpdu_len: usize) -> usize {
    fpdu_len + FpduMarkers::layout(start, fpdu_len).marker_count() * MARKER_LEN
}

/// Writes `fpdu` (one whole FPDU without markers, as [`crate::fpdu::emit`]
/// produces it) with its markers into `out`, for an FPDU region starting at
/// stream position `start`. Returns the bytes written ([`marked_len`]); the
/// next FPDU starts at `start + written`.
///
/// The CRC covers the markers, so with `crc_negotiated` the CRC field is
/// recomputed over the marked bytes (the CRC field in `fpdu` is ignored);
/// without, the CRC field is copied as it is.
///
/// # Errors
///
/// [`EncodeError::BufferTooSmall`] if `out` is too short;
/// [`EncodeError::OutOfRange`] as for [`FpduMarkers::new`].
pub fn insert_markers(
    fpdu: &[u8],
    start: u64,
    crc_negotiated: bool,
    out: &mut [u8],
) -> Result<usize, EncodeError> {
    let total = marked_len(start, fpdu.len());
    let got = out.len();
    let out = out.get_mut(..total).ok_or(EncodeError::BufferTooSmall {
        what: "MPA FPDU with markers",
        needed: total,
        got,
    })?;
    let mut src = 0;
    let mut dst = 0;
    for pm in FpduMarkers::new(start, fpdu.len())? {
        let n = pm.offset - src;
        copy(out, dst, fpdu, src, n);
        dst += n;
        src = pm.offset;
        copy(out, dst, &pm.marker.to_bytes(), 0, MARKER_LEN);
        dst += MARKER_LEN;
    }
    copy(out, dst, fpdu, src, fpdu.len() - src);
    // The CRC field is the last 4 bytes: no marker follows it inside the
    // FPDU (a marker where the FPDU ends belongs to the next one).
    if crc_negotiated && total >= CRC_LEN {
        let (covered, field) = out.split_at_mut(total - CRC_LEN);
        field.copy_from_slice(&crc::to_wire(crc::crc32c(covered)));
    }
    Ok(total)
}

/// `out[dst..dst + n] = src[at..at + n]`, ignoring out-of-range requests
/// (which the callers' arithmetic rules out).
fn copy(out: &mut [u8], dst: usize, src: &[u8], at: usize, n: usize) {
    if let (Some(o), Some(s)) = (out.get_mut(dst..dst + n), src.get(at..at + n)) {
        o.copy_from_slice(s);
    }
}

/// Removes markers from a byte stream, FPDU-agnostic: feed it the stream in
/// chunks of any size with [`MarkerRemover::split`]; it yields the data
/// between markers (borrowed from the chunk, never copied) and each marker
/// with its stream position, even when a marker straddles two chunks.
/// Pointer checks need FPDU boundaries; [`MarkerRepr::header_position`] and
/// [`expected_fpduptr`] serve a caller that knows them.
///
/// ```
/// use softrdma_wire::markers::{MarkerRemover, Piece, insert_markers, marked_len};
/// let fpdu = [7u8; 600];
/// let mut wire = vec![0u8; marked_len(0, fpdu.len())];
/// insert_markers(&fpdu, 0, false, &mut wire)?;
/// let mut rm = MarkerRemover::new(0);
/// let mut data = Vec::new();
/// for piece in rm.split(&wire) {
///     if let Piece::Data(d) = piece { data.extend_from_slice(d) }
/// }
/// assert_eq!(data, fpdu);
/// # Ok::<(), softrdma_wire::EncodeError>(())
/// ```
#[derive(Debug, Clone)]
pub struct MarkerRemover {
    /// Stream position of the next byte to be fed.
    pos: u64,
    /// The marker being read: bytes `[..pos % 512]` are valid while
    /// `pos % 512 < MARKER_LEN`.
    marker: [u8; MARKER_LEN],
}

/// A piece of a stream split by [`MarkerRemover::split`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece<'a> {
    /// Bytes between markers.
    Data(&'a [u8]),
    /// A complete marker that started at stream position `position`.
    Marker {
        /// Stream position of the marker's first byte.
        position: u64,
        /// The marker.
        marker: MarkerRepr,
    },
}

impl MarkerRemover {
    /// A remover whose next byte is at stream position `pos`.
    ///
    /// If `pos` falls inside a marker (`pos % 512` in `1..=3`), the bytes of
    /// that marker before `pos` are taken to be zero; the marker is still
    /// reported, with its true start position.
    #[must_use]
    pub const fn new(pos: u64) -> Self {
        MarkerRemover {
            pos,
            marker: [0; MARKER_LEN],
        }
    }

    /// Stream position of the next byte to be fed.
    #[must_use]
    pub const fn position(&self) -> u64 {
        self.pos
    }

    /// Splits the next chunk of the stream into data and markers.
    pub fn split<'r, 'a>(&'r mut self, input: &'a [u8]) -> Split<'r, 'a> {
        Split {
            remover: self,
            input,
        }
    }
}

/// Iterator returned by [`MarkerRemover::split`].
#[derive(Debug)]
pub struct Split<'r, 'a> {
    remover: &'r mut MarkerRemover,
    input: &'a [u8],
}

impl<'a> Iterator for Split<'_, 'a> {
    type Item = Piece<'a>;

    fn next(&mut self) -> Option<Piece<'a>> {
        loop {
            if self.input.is_empty() {
                return None;
            }
            let r = self.remover.pos % INTERVAL;
            let in_marker = r < MARKER_LEN as u64;
            // `r < 512`, so these conversions cannot fail.
            let r = usize::try_from(r).ok()?;
            if in_marker {
                let k = (MARKER_LEN - r).min(self.input.len());
                let (m, rest) = self.input.split_at(k);
                self.remover.marker.get_mut(r..r + k)?.copy_from_slice(m);
                self.input = rest;
                self.remover.pos += k as u64;
                if r + k == MARKER_LEN {
                    return Some(Piece::Marker {
                        position: self.remover.pos - MARKER_LEN as u64,
                        marker: MarkerRepr::from_bytes(self.remover.marker),
                    });
                }
            } else {
                let n = (MARKER_INTERVAL - r).min(self.input.len());
                let (d, rest) = self.input.split_at(n);
                self.input = rest;
                self.remover.pos += n as u64;
                return Some(Piece::Data(d));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a remover started inside a marker (found by the `markers`
    /// fuzz target) reports that marker once, at its true start, with the
    /// bytes before the start position taken as zero.
    #[test]
    fn remover_started_inside_a_marker() {
        let mut rm = MarkerRemover::new(513);
        let pieces: Vec<_> = rm.split(&[0x00, 0x01, 0x2c, 7, 8]).collect();
        assert_eq!(
            pieces,
            [
                Piece::Marker {
                    position: 512,
                    marker: MarkerRepr { fpduptr: 0x012c },
                },
                Piece::Data(&[7, 8]),
            ]
        );
        assert_eq!(rm.position(), 518);
    }
    use crate::fpdu::fpdu_len;
    use proptest::prelude::*;

    #[test]
    fn marker_codec() {
        let m = Marker::new_checked([0u8, 0, 0x01, 0xe8]).unwrap();
        assert_eq!(m.reserved(), 0);
        assert_eq!(m.fpduptr(), 488);
        let r = MarkerRepr::parse(&m).unwrap();
        let mut b = [0xffu8; 4];
        assert_eq!(r.emit(&mut b), Ok(4));
        assert_eq!(b, [0, 0, 0x01, 0xe8]);
        assert_eq!(r.buffer_len(), 4);
        // RESERVED ignored on receive.
        let mut m = Marker::new_unchecked([0u8; 4]);
        m.set_reserved(0xbeef);
        m.set_fpduptr(12);
        assert_eq!(MarkerRepr::parse(&m).unwrap(), MarkerRepr { fpduptr: 12 });
        for n in 0..4 {
            assert!(Marker::new_checked(&[0u8; 4][..n]).is_err());
        }
        assert!(r.emit(&mut [0u8; 3]).is_err());
    }

    #[test]
    fn positions() {
        assert!(is_marker_position(0));
        assert!(is_marker_position(1024));
        assert!(!is_marker_position(4));
        assert_eq!(next_marker_position(0), 0);
        assert_eq!(next_marker_position(1), 512);
        assert_eq!(next_marker_position(512), 512);
        assert_eq!(next_marker_position(513), 1024);
    }

    /// Hand-built from the RFC 5044 rules: three FPDUs at the start of full
    /// operation phase.
    ///
    /// ```text
    ///  pos 0     marker FPDUPTR 0 (first marker, precedes FPDU A)
    ///  pos 4     FPDU A, 20 bytes (ULPDU 14)                  4..24
    ///  pos 24    FPDU B, 1008 bytes (ULPDU 1000), header at 24
    ///  pos 512   marker FPDUPTR 488 (512 - 24)   after 488 bytes of B
    ///  pos 1024  marker FPDUPTR 1000             after 996 bytes of B
    ///            B ends at 24 + 1008 + 8 = 1040
    ///  pos 1040  FPDU C, 496 bytes (ULPDU 490): ends exactly at 1536
    ///  pos 1536  marker FPDUPTR 0: precedes FPDU D (not part of C)
    ///  pos 1540  FPDU D, 8 bytes (ULPDU 0)
    /// ```
    #[test]
    fn golden_rfc_layout() {
        let a: Vec<u8> = (0..20).map(|i| 0xa0 + i).collect();
        let b: Vec<u8> = (0..1008u32).map(|i| (i % 251) as u8).collect();
        let c = vec![0xcc; 496];
        let d = vec![0xdd; 8];
        assert_eq!(fpdu_len(1000), 1008);
        assert_eq!(fpdu_len(490), 496);
        let mut wire = vec![0u8; 2048];
        let mut pos = 0usize;
        for f in [&a, &b, &c, &d] {
            pos += insert_markers(f, pos as u64, false, &mut wire[pos..]).unwrap();
        }
        assert_eq!(pos, 4 + 20 + 1016 + 496 + 4 + 8);
        assert_eq!(&wire[0..4], &[0, 0, 0, 0]);
        assert_eq!(&wire[4..24], &a[..]);
        assert_eq!(&wire[24..512], &b[..488]);
        assert_eq!(&wire[512..516], &[0, 0, 0x01, 0xe8]);
        assert_eq!(&wire[516..1024], &b[488..996]);
        assert_eq!(&wire[1024..1028], &[0, 0, 0x03, 0xe8]);
        assert_eq!(&wire[1028..1040], &b[996..]);
        assert_eq!(&wire[1040..1536], &c[..]);
        assert_eq!(&wire[1536..1540], &[0, 0, 0, 0]);
        assert_eq!(&wire[1540..1548], &d[..]);

        let placed: Vec<_> = FpduMarkers::new(24, 1008).unwrap().collect();
        assert_eq!(
            placed,
            [
                PlacedMarker {
                    offset: 488,
                    marker: MarkerRepr { fpduptr: 488 }
                },
                PlacedMarker {
                    offset: 996,
                    marker: MarkerRepr { fpduptr: 1000 }
                },
            ]
        );
        assert_eq!(FpduMarkers::new(24, 1008).unwrap().marker_count(), 2);
        assert_eq!(FpduMarkers::new(0, 20).unwrap().marker_count(), 1);
        assert_eq!(FpduMarkers::new(1040, 496).unwrap().marker_count(), 0);
        assert_eq!(marked_len(1040, 496), 496);
        assert_eq!(MarkerRepr { fpduptr: 1000 }.header_position(1024), Some(24));
        assert_eq!(MarkerRepr { fpduptr: 0 }.header_position(1536), Some(1540));
        assert_eq!(expected_fpduptr(1536, 1540), Some(0));
        assert_eq!(expected_fpduptr(512, 24), Some(488));
        assert_eq!(expected_fpduptr(1024, 1540), None);
    }

    #[test]
    fn fpduptr_overflow_is_an_encode_error() {
        // A maximum-size FPDU with markers: the last markers are more than
        // 65535 octets after the header.
        let len = fpdu_len(crate::fpdu::MAX_ULPDU_LEN);
        assert!(matches!(
            FpduMarkers::new(4, len),
            Err(EncodeError::OutOfRange { .. })
        ));
        let mut out = vec![0u8; len + 1024];
        assert!(insert_markers(&vec![0u8; len], 4, true, &mut out).is_err());
        assert!(insert_markers(&[0u8; 8], 0, true, &mut [0u8; 11]).is_err());
    }

    /// A stream of FPDUs with markers inserted, and the header position of
    /// every FPDU.
    fn marked_stream(start: u64, ulpdu_lens: &[usize]) -> (Vec<u8>, Vec<u8>, Vec<u64>) {
        let mut plain = Vec::new();
        let mut wire = Vec::new();
        let mut headers = Vec::new();
        let mut pos = start;
        for (i, &u) in ulpdu_lens.iter().enumerate() {
            let f: Vec<u8> = (0..fpdu_len(u)).map(|j| (i * 31 + j) as u8).collect();
            let mut out = vec![0u8; marked_len(pos, f.len())];
            let n = insert_markers(&f, pos, false, &mut out).unwrap();
            assert_eq!(n, out.len());
            headers.push(FpduMarkers::new(pos, f.len()).unwrap().header_position());
            pos += n as u64;
            plain.extend_from_slice(&f);
            wire.extend_from_slice(&out);
        }
        (plain, wire, headers)
    }

    proptest! {
        #[test]
        fn insert_then_remove_is_identity(
            start in (0u64..4096).prop_map(|p| p * 4),
            ulpdu_lens in proptest::collection::vec(0usize..1500, 1..8),
            cuts in proptest::collection::vec(any::<usize>(), 0..12),
        ) {
            let (plain, wire, headers) = marked_stream(start, &ulpdu_lens);
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (wire.len() + 1)).collect();
            cuts.sort_unstable();
            let mut rm = MarkerRemover::new(start);
            let mut data = Vec::new();
            let mut s = 0;
            for c in cuts.into_iter().chain([wire.len()]) {
                for piece in rm.split(&wire[s..c]) {
                    match piece {
                        Piece::Data(d) => data.extend_from_slice(d),
                        Piece::Marker { position, marker } => {
                            prop_assert!(is_marker_position(position));
                            // The marker designates the FPDU containing it
                            // (or the one it precedes).
                            let h = marker.header_position(position).unwrap();
                            prop_assert!(headers.contains(&h), "{} -> {}", position, h);
                            prop_assert!(h <= position + 4);
                            let next = headers.iter().find(|&&x| x > position + 4);
                            prop_assert!(next.is_none_or(|&n| n > h));
                        }
                    }
                }
                s = c;
            }
            prop_assert_eq!(rm.position(), start + wire.len() as u64);
            prop_assert_eq!(data, plain);
        }

        #[test]
        fn remover_any_position_any_bytes(
            start in any::<u32>(),
            plain in proptest::collection::vec(any::<u8>(), 0..3000),
            chunk in 1usize..700,
        ) {
            // Build a stream by hand: a zero marker at each marker position.
            let start = u64::from(start);
            let mut wire = Vec::new();
            let mut pos = start;
            let mut it = plain.iter();
            // Skip the tail of a marker we would start in the middle of.
            while pos % 512 != 0 && pos % 512 < 4 { wire.push(0); pos += 1; }
            loop {
                if is_marker_position(pos) {
                    wire.extend_from_slice(&[0, 0, 0, 0]);
                    pos += 4;
                    continue;
                }
                match it.next() { Some(&b) => { wire.push(b); pos += 1; } None => break }
            }
            let mut rm = MarkerRemover::new(start);
            let mut data = Vec::new();
            for c in wire.chunks(chunk) {
                for p in rm.split(c) {
                    if let Piece::Data(d) = p { data.extend_from_slice(d) }
                }
            }
            prop_assert_eq!(data, plain);
        }
    }
}
