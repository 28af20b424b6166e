//! MPA FPDU framing (RFC 5044 section 4).
//!
//! RFC 5044 section 4.2, "Framing Protocol Data Unit Format":
//!
//! ```text
//!   0                   1                   2                   3
//!   0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//!  |          ULPDU_LENGTH         |                               |
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+                               +
//!  ~                            ULPDU                              ~
//!  |                               +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//!  |                               |          PAD (0-3 octets)     |
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//!  |                             CRC                               |
//!  +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! * ULPDU_LENGTH (16 bits, big-endian): the number of octets of the ULPDU.
//!   It does not count itself, the pad, the CRC, or any MPA marker.
//! * PAD: 0 to 3 octets, "set so as to make the size of the FPDU an integral
//!   multiple of four"; sent as zeros, ignored by the receiver except for the
//!   CRC. Markers are 4 octets, so they never change the pad: the pad depends
//!   only on `2 + ULPDU_LENGTH` ([`pad_len`]).
//! * CRC: CRC32C over the whole FPDU before it (length field, ULPDU, pad and
//!   any markers inside the FPDU), stored least significant byte first (see
//!   [`crate::crc`]). The field is *always present*: "When CRCs are not
//!   enabled, this field is still present, may contain any value, and MUST
//!   NOT be checked." Kernel siw sends zeros there (the CRC-off captures show
//!   "CRC field 0x00000000"), and so do we.
//!
//! This module handles FPDUs without markers (markers are inserted and removed
//! around these bytes by [`crate::markers`]). It offers:
//!
//! * sizes: [`pad_len`], [`fpdu_len`], [`mulpdu`], [`MAX_ULPDU_LEN`];
//! * vectored encoding without copying the payload: [`FpduEncoder`] gives the
//!   2-byte length prefix, takes the ULPDU pieces (header bytes, then payload
//!   slices straight from registered memory) into the CRC, and returns the
//!   [`FpduTrailer`] (pad + CRC); [`framing`] does the same for a list of
//!   slices; [`emit`] writes a whole FPDU into one caller-provided buffer;
//! * decoding a whole FPDU: the zero-copy view [`Fpdu`] and [`decode`], which
//!   return the ULPDU and a [`CrcVerdict`].
//!
//! Cutting a byte stream into FPDUs is the job of [`crate::deframer`].

use crate::crc::{self, CRC_LEN, Crc32c};
use crate::{DecodeError, EncodeError};

/// Length of the ULPDU_LENGTH field.
pub const ULPDU_LENGTH_LEN: usize = 2;

/// Largest ULPDU the 16-bit ULPDU_LENGTH field can describe.
pub const MAX_ULPDU_LEN: usize = u16::MAX as usize;

/// Largest pad (the FPDU is padded to a multiple of 4 octets).
pub const MAX_PAD_LEN: usize = 3;

/// Bytes of an FPDU that are not ULPDU when the pad is empty: the length
/// field and the CRC field (the "6" of the RFC 5044 MULPDU formula).
pub const FRAMING_OVERHEAD: usize = ULPDU_LENGTH_LEN + CRC_LEN;

/// Largest trailer: pad plus CRC.
pub const MAX_TRAILER_LEN: usize = MAX_PAD_LEN + CRC_LEN;

/// Number of pad octets after a ULPDU of `ulpdu_len` octets: the length field
/// plus the ULPDU plus the pad is a multiple of 4.
///
/// ```
/// use softrdma_wire::fpdu::pad_len;
/// assert_eq!(pad_len(14), 0); // 2 + 14 = 16
/// assert_eq!(pad_len(34), 0);
/// assert_eq!(pad_len(15), 3);
/// assert_eq!(pad_len(1442), 0); // kernel siw, MSS 1448
/// ```
#[inline]
#[must_use]
pub const fn pad_len(ulpdu_len: usize) -> usize {
    (ulpdu_len.wrapping_neg().wrapping_add(2)) & 3
}

/// Length of the FPDU (without markers) that carries a ULPDU of `ulpdu_len`
/// octets: length field + ULPDU + pad + CRC.
///
/// ```
/// use softrdma_wire::fpdu::fpdu_len;
/// assert_eq!(fpdu_len(14), 20);
/// assert_eq!(fpdu_len(1442), 1448);
/// ```
#[inline]
#[must_use]
pub const fn fpdu_len(ulpdu_len: usize) -> usize {
    ULPDU_LENGTH_LEN + ulpdu_len + pad_len(ulpdu_len) + CRC_LEN
}

/// MULPDU, the largest ULPDU such that one FPDU fits in a TCP segment of
/// `emss` octets (the effective MSS), as RFC 5044 defines it for the MPA
/// sender (the MULPDU that MPA reports to DDP):
///
/// ```text
///   markers off:  MULPDU = EMSS - (6 + EMSS mod 4)
///   markers on:   MULPDU = EMSS - (6 + 4 * Ceiling(EMSS / 512) + EMSS mod 4)
/// ```
///
/// 6 is the length field plus the CRC field; `EMSS mod 4` keeps the FPDU a
/// multiple of 4 octets; with markers, one segment of EMSS octets can hold up
/// to `Ceiling(EMSS / 512)` markers wherever the FPDU starts. The result is
/// capped at [`MAX_ULPDU_LEN`] and is 0 when `emss` is too small for any ULPDU.
///
/// Kernel siw with a 1448-octet MSS sends 1442-octet ULPDUs
/// (`ib_write_bw.txt`), which is this formula without markers.
///
/// ```
/// use softrdma_wire::fpdu::mulpdu;
/// assert_eq!(mulpdu(1448, false), 1442);
/// assert_eq!(mulpdu(1448, true), 1430); // 3 markers
/// assert_eq!(mulpdu(1460, false), 1454);
/// ```
#[must_use]
pub const fn mulpdu(emss: usize, markers: bool) -> usize {
    let mut overhead = FRAMING_OVERHEAD + emss % 4;
    if markers {
        overhead += crate::markers::MARKER_LEN * emss.div_ceil(crate::markers::MARKER_INTERVAL);
    }
    let m = emss.saturating_sub(overhead);
    if m > MAX_ULPDU_LEN { MAX_ULPDU_LEN } else { m }
}

/// Whether the CRC of a decoded FPDU was checked, and what it said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrcVerdict {
    /// CRC negotiated, and the CRC field matches the computed CRC.
    Good,
    /// CRC negotiated, and the CRC field does not match.
    Bad {
        /// The CRC computed over the received bytes.
        expected: u32,
        /// The CRC value carried by the CRC field.
        found: u32,
    },
    /// CRC not negotiated: the field was not checked (RFC 5044: "MUST NOT be
    /// checked").
    NotNegotiated,
}

impl CrcVerdict {
    /// `false` only for [`CrcVerdict::Bad`].
    #[must_use]
    pub const fn is_acceptable(&self) -> bool {
        !matches!(self, CrcVerdict::Bad { .. })
    }
}

/// The 2-byte ULPDU_LENGTH field for a ULPDU of `ulpdu_len` octets.
///
/// # Errors
///
/// [`EncodeError::OutOfRange`] if `ulpdu_len` exceeds [`MAX_ULPDU_LEN`].
pub fn length_prefix(ulpdu_len: usize) -> Result<[u8; ULPDU_LENGTH_LEN], EncodeError> {
    u16::try_from(ulpdu_len)
        .map(u16::to_be_bytes)
        .map_err(|_| EncodeError::OutOfRange {
            what: "MPA FPDU",
            field: "ULPDU length",
            value: ulpdu_len as u64,
            max: MAX_ULPDU_LEN as u64,
        })
}

/// Pad and CRC field of an FPDU, as the bytes to write after the ULPDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FpduTrailer {
    /// `bytes[..len]` is the trailer; the rest is zero.
    bytes: [u8; MAX_TRAILER_LEN],
    /// Pad length plus [`CRC_LEN`].
    len: u8,
}

impl FpduTrailer {
    /// The trailer for a ULPDU of `ulpdu_len` octets whose FPDU CRC is `crc`
    /// (pass 0 when CRC is not negotiated).
    #[must_use]
    pub const fn new(ulpdu_len: usize, crc: u32) -> Self {
        let pad = pad_len(ulpdu_len);
        let mut bytes = [0u8; MAX_TRAILER_LEN];
        let c = crc::to_wire(crc);
        bytes[pad] = c[0];
        bytes[pad + 1] = c[1];
        bytes[pad + 2] = c[2];
        bytes[pad + 3] = c[3];
        FpduTrailer {
            bytes,
            len: (pad + CRC_LEN) as u8,
        }
    }

    /// The bytes to transmit: the pad (zeros) then the CRC field.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        self.bytes
            .get(..usize::from(self.len))
            .unwrap_or(&self.bytes)
    }

    /// Number of pad octets.
    #[must_use]
    pub const fn pad_len(&self) -> usize {
        self.len as usize - CRC_LEN
    }

    /// The CRC value in the CRC field (0 when CRC is not negotiated).
    #[must_use]
    pub fn crc(&self) -> u32 {
        let p = self.pad_len();
        let mut f = [0u8; CRC_LEN];
        if let Some(s) = self.bytes.get(p..p + CRC_LEN) {
            f.copy_from_slice(s);
        }
        crc::from_wire(f)
    }
}

/// Builds the framing of one FPDU around a ULPDU given in pieces, without
/// copying them: the engine writes `prefix()`, the ULPDU pieces and
/// `finish()?.as_bytes()` with one vectored write.
///
/// Order of calls: [`FpduEncoder::new`] (with the total ULPDU length), then
/// [`update`](FpduEncoder::update) with every ULPDU piece in order, then
/// [`finish`](FpduEncoder::finish). [`prefix`](FpduEncoder::prefix) may be
/// called at any time.
///
/// ```
/// use softrdma_wire::fpdu::{FpduEncoder, decode, CrcVerdict};
/// let header = [0xc1u8, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
/// let payload = b"hello";
/// let mut enc = FpduEncoder::new(header.len() + payload.len(), true)?;
/// enc.update(&header);
/// enc.update(payload);
/// let trailer = enc.finish()?;
/// let wire = [&enc.prefix()[..], &header, payload, trailer.as_bytes()].concat();
/// let fpdu = decode(&wire, true)?;
/// assert_eq!(fpdu.crc, CrcVerdict::Good);
/// assert_eq!(&fpdu.ulpdu[14..], b"hello");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct FpduEncoder {
    /// ULPDU length announced in [`FpduEncoder::new`].
    ulpdu_len: u16,
    /// ULPDU bytes fed so far.
    fed: usize,
    /// Running CRC over length field, ULPDU bytes fed so far; `None` when CRC
    /// is not negotiated (no CRC work at all then).
    crc: Option<Crc32c>,
}

impl FpduEncoder {
    /// Starts an FPDU carrying `ulpdu_len` ULPDU octets; `crc` says whether
    /// CRC was negotiated.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] if `ulpdu_len` exceeds [`MAX_ULPDU_LEN`].
    pub fn new(ulpdu_len: usize, crc: bool) -> Result<Self, EncodeError> {
        let prefix = length_prefix(ulpdu_len)?;
        let crc = crc.then(|| {
            let mut c = Crc32c::new();
            c.update(&prefix);
            c
        });
        Ok(FpduEncoder {
            ulpdu_len: u16::from_be_bytes(prefix),
            fed: 0,
            crc,
        })
    }

    /// The ULPDU_LENGTH field to write before the ULPDU.
    #[must_use]
    pub const fn prefix(&self) -> [u8; ULPDU_LENGTH_LEN] {
        self.ulpdu_len.to_be_bytes()
    }

    /// Feeds the next piece of the ULPDU (not copied; only read for the CRC).
    #[inline]
    pub fn update(&mut self, piece: &[u8]) {
        self.fed = self.fed.saturating_add(piece.len());
        if let Some(c) = &mut self.crc {
            c.update(piece);
        }
    }

    /// The pad and CRC field to write after the ULPDU.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] (field `"ULPDU bytes"`) if the pieces fed
    /// do not add up to the length given to [`FpduEncoder::new`].
    pub fn finish(&self) -> Result<FpduTrailer, EncodeError> {
        let len = usize::from(self.ulpdu_len);
        if self.fed != len {
            return Err(EncodeError::OutOfRange {
                what: "MPA FPDU",
                field: "ULPDU bytes",
                value: self.fed as u64,
                max: len as u64,
            });
        }
        let value = match self.crc {
            Some(mut c) => {
                c.update(&[0u8; MAX_PAD_LEN][..pad_len(len)]);
                c.finish()
            }
            None => 0,
        };
        Ok(FpduTrailer::new(len, value))
    }
}

/// The framing of an FPDU whose ULPDU is the concatenation of `pieces`:
/// the length prefix and the trailer (pad + CRC).
///
/// # Errors
///
/// [`EncodeError::OutOfRange`] if the pieces add up to more than
/// [`MAX_ULPDU_LEN`].
pub fn framing(
    pieces: &[&[u8]],
    crc: bool,
) -> Result<([u8; ULPDU_LENGTH_LEN], FpduTrailer), EncodeError> {
    let len = pieces.iter().fold(0usize, |a, p| a.saturating_add(p.len()));
    let mut enc = FpduEncoder::new(len, crc)?;
    for p in pieces {
        enc.update(p);
    }
    Ok((enc.prefix(), enc.finish()?))
}

/// Writes a whole FPDU carrying `ulpdu` into `buf`; returns its length
/// ([`fpdu_len`]`(ulpdu.len())`).
///
/// # Errors
///
/// [`EncodeError::OutOfRange`] if `ulpdu` is longer than [`MAX_ULPDU_LEN`],
/// [`EncodeError::BufferTooSmall`] if `buf` cannot hold the FPDU.
pub fn emit(ulpdu: &[u8], crc: bool, buf: &mut [u8]) -> Result<usize, EncodeError> {
    let prefix = length_prefix(ulpdu.len())?;
    let total = fpdu_len(ulpdu.len());
    let got = buf.len();
    let out = buf.get_mut(..total).ok_or(EncodeError::BufferTooSmall {
        what: "MPA FPDU",
        needed: total,
        got,
    })?;
    let mut f = Fpdu::new_unchecked(out);
    f.set_ulpdu_len(u16::from_be_bytes(prefix));
    f.ulpdu_mut().copy_from_slice(ulpdu);
    f.fill_pad();
    f.fill_crc(crc);
    Ok(total)
}

/// A zero-copy view of one whole FPDU (without markers) at the start of a
/// buffer.
///
/// ```
/// use softrdma_wire::fpdu::{Fpdu, CrcVerdict};
/// // Frame 8 of rping-crc-p2p.pcap: a zero-length RDMA Write (an RTR).
/// let wire = [0x00, 0x0e, 0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0,
///             0xeb, 0xd3, 0x4c, 0x5f];
/// let f = Fpdu::new_checked(&wire[..])?;
/// assert_eq!(f.ulpdu_len(), 14);
/// assert_eq!(f.check_crc(true), CrcVerdict::Good);
/// # Ok::<(), softrdma_wire::DecodeError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fpdu<T: AsRef<[u8]>> {
    buffer: T,
}

mod field {
    use core::ops::Range;
    /// The ULPDU_LENGTH field.
    pub(super) const ULPDU_LENGTH: Range<usize> = 0..2;
    /// First octet of the ULPDU.
    pub(super) const ULPDU: usize = 2;
}

impl<T: AsRef<[u8]>> Fpdu<T> {
    /// Wraps `buffer` without checking its length; accessors may then panic
    /// on a short buffer. Use [`Fpdu::new_checked`] on received bytes.
    pub const fn new_unchecked(buffer: T) -> Self {
        Fpdu { buffer }
    }

    /// Wraps `buffer` after checking that it holds the length field and the
    /// whole FPDU it announces; bytes after the FPDU are allowed (and ignored).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is shorter.
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let f = Fpdu { buffer };
        f.check_len()?;
        Ok(f)
    }

    /// Checks the buffer length (see [`Fpdu::new_checked`]).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is shorter than the FPDU.
    pub fn check_len(&self) -> Result<(), DecodeError> {
        let b = self.buffer.as_ref();
        let needed = match b.get(field::ULPDU_LENGTH) {
            Some(l) => fpdu_len(usize::from(u16::from_be_bytes([l[0], l[1]]))),
            None => ULPDU_LENGTH_LEN,
        };
        if b.len() < needed {
            return Err(DecodeError::Truncated {
                what: "MPA FPDU",
                needed,
                got: b.len(),
            });
        }
        Ok(())
    }

    /// The wrapped buffer.
    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// The ULPDU_LENGTH field.
    #[must_use]
    pub fn ulpdu_len(&self) -> u16 {
        let b = self.buffer.as_ref();
        u16::from_be_bytes([b[0], b[1]])
    }

    /// Length of the FPDU: [`fpdu_len`] of the ULPDU length.
    #[must_use]
    pub fn total_len(&self) -> usize {
        fpdu_len(usize::from(self.ulpdu_len()))
    }

    /// Offset of the CRC field (= number of bytes the CRC covers).
    #[must_use]
    pub fn crc_offset(&self) -> usize {
        self.total_len() - CRC_LEN
    }

    /// The ULPDU.
    #[must_use]
    pub fn ulpdu(&self) -> &[u8] {
        let end = field::ULPDU + usize::from(self.ulpdu_len());
        &self.buffer.as_ref()[field::ULPDU..end]
    }

    /// The pad octets (should be zero; not checked, RFC 5044 section 4.2).
    #[must_use]
    pub fn pad(&self) -> &[u8] {
        let start = field::ULPDU + usize::from(self.ulpdu_len());
        &self.buffer.as_ref()[start..self.crc_offset()]
    }

    /// The bytes covered by the CRC: length field, ULPDU and pad.
    #[must_use]
    pub fn covered(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.crc_offset()]
    }

    /// The CRC value carried by the CRC field (decoded least significant
    /// byte first).
    #[must_use]
    pub fn crc_field(&self) -> u32 {
        let o = self.crc_offset();
        let b = self.buffer.as_ref();
        crc::from_wire([b[o], b[o + 1], b[o + 2], b[o + 3]])
    }

    /// Checks the CRC if `crc_negotiated`.
    #[must_use]
    pub fn check_crc(&self, crc_negotiated: bool) -> CrcVerdict {
        if !crc_negotiated {
            return CrcVerdict::NotNegotiated;
        }
        let expected = crc::crc32c(self.covered());
        let found = self.crc_field();
        if crc::matches(expected, found) {
            CrcVerdict::Good
        } else {
            CrcVerdict::Bad { expected, found }
        }
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Fpdu<T> {
    /// Sets the ULPDU_LENGTH field.
    pub fn set_ulpdu_len(&mut self, len: u16) {
        self.buffer.as_mut()[field::ULPDU_LENGTH].copy_from_slice(&len.to_be_bytes());
    }

    /// The ULPDU, writable.
    pub fn ulpdu_mut(&mut self) -> &mut [u8] {
        let end = field::ULPDU + usize::from(self.ulpdu_len());
        &mut self.buffer.as_mut()[field::ULPDU..end]
    }

    /// Zeroes the pad.
    pub fn fill_pad(&mut self) {
        let start = field::ULPDU + usize::from(self.ulpdu_len());
        let end = self.crc_offset();
        self.buffer.as_mut()[start..end].fill(0);
    }

    /// Sets the CRC field to the CRC value `crc`.
    pub fn set_crc_field(&mut self, crc: u32) {
        let o = self.crc_offset();
        self.buffer.as_mut()[o..o + CRC_LEN].copy_from_slice(&crc::to_wire(crc));
    }

    /// Computes and writes the CRC over length field, ULPDU and pad if
    /// `crc_negotiated`, or writes zeros (as kernel siw does) otherwise.
    pub fn fill_crc(&mut self, crc_negotiated: bool) {
        let value = if crc_negotiated {
            crc::crc32c(self.covered())
        } else {
            0
        };
        self.set_crc_field(value);
    }
}

/// A decoded FPDU: its ULPDU and what the CRC said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodedFpdu<'a> {
    /// The ULPDU (DDP segment).
    pub ulpdu: &'a [u8],
    /// The CRC verdict.
    pub crc: CrcVerdict,
    /// Bytes of the buffer the FPDU occupied ([`fpdu_len`] of the ULPDU).
    pub len: usize,
}

/// Decodes the whole FPDU (without markers) at the start of `buf`, checking
/// the CRC if `crc_negotiated`. A bad CRC is reported in the verdict, not as
/// an error.
///
/// # Errors
///
/// [`DecodeError::Truncated`] if `buf` does not hold the whole FPDU.
pub fn decode(buf: &[u8], crc_negotiated: bool) -> Result<DecodedFpdu<'_>, DecodeError> {
    let f = Fpdu::new_checked(buf)?;
    let crc = f.check_crc(crc_negotiated);
    let len = f.total_len();
    let ulpdu_len = usize::from(f.ulpdu_len());
    let ulpdu = buf
        .get(field::ULPDU..field::ULPDU + ulpdu_len)
        .unwrap_or_default();
    Ok(DecodedFpdu { ulpdu, crc, len })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::hex;
    use proptest::prelude::*;

    // Frame 12 of rping-crc-p2p.pcap: RDMA Read Response carrying "rdma-ping-0: ABC..."
    // (ULPDU length 78, pad 0, CRC check 0xbcda4f07 as Wireshark prints it).
    const FRAME12: &str = "004ec1420bde1b00000056315a3ec45072646d612d70696e672d303a204142434445464748494a4b4c4d4e4f505152535455565758595a5b5c5d5e5f606162636465666768696a6b6c6d6e6f70717200bcda4f07";
    // Frame 11: RDMA Read Request, ULPDU length 46, CRC 0xee63a0f7.
    const FRAME11: &str = "002e4141000000000000000100000001000000000bde1b00000056315a3ec45000000040b5ff1b00000055e9c6f8de10ee63a0f7";

    #[test]
    fn pad_and_len() {
        for (u, pad) in [
            (0, 2),
            (1, 1),
            (2, 0),
            (3, 3),
            (4, 2),
            (14, 0),
            (15, 3),
            (16, 2),
            (17, 1),
        ] {
            assert_eq!(pad_len(u), pad, "ulpdu {u}");
            assert_eq!(fpdu_len(u) % 4, 0);
        }
        assert_eq!(fpdu_len(MAX_ULPDU_LEN), 2 + 65535 + 3 + 4);
    }

    #[test]
    fn mulpdu_formula() {
        assert_eq!(mulpdu(1448, false), 1442);
        assert_eq!(fpdu_len(mulpdu(1448, false)), 1448);
        assert_eq!(mulpdu(1460, false), 1454);
        assert_eq!(mulpdu(1461, false), 1454);
        assert_eq!(mulpdu(1448, true), 1448 - 6 - 12);
        assert_eq!(mulpdu(512, true), 512 - 6 - 4);
        assert_eq!(mulpdu(513, true), 513 - 6 - 8 - 1);
        assert_eq!(mulpdu(5, false), 0);
        assert_eq!(mulpdu(1 << 20, false), MAX_ULPDU_LEN);
        // With markers, an FPDU of MULPDU plus its markers fits in EMSS
        // wherever it starts (positions are multiples of 4).
        for emss in [536usize, 1000, 1448, 1460, 8948, 9000] {
            let m = mulpdu(emss, true);
            for start in (0..512u64).step_by(4) {
                let wire = crate::markers::marked_len(start, fpdu_len(m));
                assert!(wire <= emss, "emss {emss} start {start}: {wire}");
            }
        }
    }

    #[test]
    fn golden_capture_frames() {
        for (h, ulen, shown) in [
            (FRAME12, 78usize, 0xbcda_4f07u32),
            (FRAME11, 46, 0xee63_a0f7),
        ] {
            let wire = hex(h);
            let d = decode(&wire, true).unwrap();
            assert_eq!(d.ulpdu.len(), ulen);
            assert_eq!(d.len, wire.len());
            assert_eq!(d.crc, CrcVerdict::Good);
            let f = Fpdu::new_checked(&wire[..]).unwrap();
            assert_eq!(
                f.crc_field().swap_bytes(),
                shown,
                "Wireshark shows the field big-endian"
            );
            // Re-encoding gives the same bytes, both ways.
            let mut buf = vec![0u8; wire.len()];
            assert_eq!(emit(d.ulpdu, true, &mut buf), Ok(wire.len()));
            assert_eq!(buf, wire);
            let (split_a, split_b) = d.ulpdu.split_at(14);
            let (prefix, trailer) = framing(&[split_a, split_b], true).unwrap();
            assert_eq!([&prefix[..], d.ulpdu, trailer.as_bytes()].concat(), wire);
            assert_eq!(trailer.crc().swap_bytes(), shown);
        }
    }

    #[test]
    fn crc_off_sends_zeros_and_is_not_checked() {
        let mut buf = [0xffu8; 32];
        let n = emit(b"abc", false, &mut buf).unwrap();
        assert_eq!(n, 12);
        assert_eq!(&buf[..n], &[0, 3, b'a', b'b', b'c', 0, 0, 0, 0, 0, 0, 0]);
        buf[5] = 0x55; // pad and CRC are not checked
        buf[8] = 0x99;
        assert_eq!(
            decode(&buf[..n], false).unwrap().crc,
            CrcVerdict::NotNegotiated
        );
        assert_eq!(decode(&buf[..n], false).unwrap().ulpdu, b"abc");
    }

    #[test]
    fn bad_crc_reports_both_values() {
        let mut wire = hex(FRAME12);
        let good = decode(&wire, true).unwrap();
        assert_eq!(good.crc, CrcVerdict::Good);
        wire[20] ^= 0x01;
        match decode(&wire, true).unwrap().crc {
            CrcVerdict::Bad { expected, found } => {
                assert_eq!(found, 0x074f_dabc);
                assert_ne!(expected, found);
                assert_eq!(expected, crate::crc::crc32c(&wire[..wire.len() - 4]));
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn truncated_at_every_length() {
        let wire = hex(FRAME11);
        for cut in 0..wire.len() {
            let needed = if cut < 2 { 2 } else { wire.len() };
            assert_eq!(
                decode(&wire[..cut], true),
                Err(DecodeError::Truncated {
                    what: "MPA FPDU",
                    needed,
                    got: cut
                })
            );
        }
        // Trailing bytes are not part of the FPDU.
        let mut longer = wire.clone();
        longer.extend_from_slice(&[1, 2, 3]);
        assert_eq!(decode(&longer, true).unwrap().len, wire.len());
    }

    #[test]
    fn encode_errors() {
        let big = vec![0u8; MAX_ULPDU_LEN + 1];
        let mut buf = vec![0u8; fpdu_len(MAX_ULPDU_LEN) + 8];
        assert!(matches!(
            emit(&big, true, &mut buf),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert!(matches!(
            framing(&[&big], true),
            Err(EncodeError::OutOfRange { .. })
        ));
        assert_eq!(
            emit(b"abcd", true, &mut buf[..11]),
            Err(EncodeError::BufferTooSmall {
                what: "MPA FPDU",
                needed: 12,
                got: 11
            })
        );
        let mut enc = FpduEncoder::new(4, true).unwrap();
        enc.update(b"abc");
        assert!(matches!(
            enc.finish(),
            Err(EncodeError::OutOfRange {
                field: "ULPDU bytes",
                ..
            })
        ));
        assert!(emit(&big[..MAX_ULPDU_LEN], true, &mut buf).is_ok());
    }

    proptest! {
        #[test]
        fn round_trip(ulpdu in proptest::collection::vec(any::<u8>(), 0..600),
                      crc in any::<bool>(),
                      cuts in proptest::collection::vec(any::<usize>(), 0..5)) {
            let mut buf = vec![0u8; fpdu_len(ulpdu.len())];
            let n = emit(&ulpdu, crc, &mut buf).unwrap();
            prop_assert_eq!(n, buf.len());
            let d = decode(&buf, crc).unwrap();
            prop_assert_eq!(d.ulpdu, &ulpdu[..]);
            prop_assert!(d.crc.is_acceptable());
            // Vectored framing over any split of the ULPDU gives the same bytes.
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (ulpdu.len() + 1)).collect();
            cuts.sort_unstable();
            let mut pieces = Vec::new();
            let mut s = 0;
            for c in cuts.into_iter().chain([ulpdu.len()]) {
                pieces.push(&ulpdu[s..c]);
                s = c;
            }
            let (prefix, trailer) = framing(&pieces, crc).unwrap();
            prop_assert_eq!([&prefix[..], &ulpdu, trailer.as_bytes()].concat(), buf);
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..300), crc in any::<bool>()) {
            let _ = decode(&bytes, crc);
        }
    }
}
