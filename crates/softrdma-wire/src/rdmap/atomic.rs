//! Atomic Request and Atomic Response headers (RFC 7306).
//!
//! RFC 7306 adds remote 64-bit atomic operations to RDMAP. Both messages are
//! untagged DDP messages whose payload is the header below: the Atomic
//! Request (opcode 10) travels on queue 1, the queue of RDMA Read Requests
//! (it shares their ORD/IRD credits and ordering), and the Atomic Response
//! (opcode 11) on queue 3. Both are consumed by RDMAP, never placed into a
//! ULP buffer.
//!
//! Atomic Request header, 52 bytes:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                     Reserved (Not Used)               |AOpCode|
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                      Request Identifier                       |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                          Remote STag                          |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                Remote Tagged Offset (64 bits)                 |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                  Add or Swap Data (64 bits)                   |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                  Add or Swap Mask (64 bits)                   |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                    Compare Data (64 bits)                     |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                    Compare Mask (64 bits)                     |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! The 64-bit fields are drawn on one line each; they are 8 bytes,
//! big-endian. `AOpCode` selects the operation ([`AtomicOpcode`]):
//!
//! * FetchAdd: adds Add Data to the 64-bit value at STag/TO. The Add Mask
//!   makes it a *masked* FetchAdd: it cuts the 64 bits into independent
//!   fields (a set bit marks a field boundary, so no carry crosses it); an
//!   all-zero Add Mask is a plain 64-bit add.
//! * Swap: replaces the value by Swap Data, in the bits set in Swap Mask
//!   (all ones for a plain Swap).
//! * CmpSwap: if the value equals Compare Data in the bits set in Compare
//!   Mask, replaces it by Swap Data in the bits set in Swap Mask (both masks
//!   all ones for a plain CmpSwap).
//!
//! Fields an operation does not use are sent as zero. The Remote Tagged
//! Offset must be 8-byte aligned; that is the responder's check (it answers a
//! misaligned request with a Terminate), not the decoder's.
//!
//! Atomic Response header, 12 bytes: the Request Identifier of the request it
//! answers and the value found at STag/TO before the operation.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                  Original Request Identifier                  |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |              Original Remote Data Value (64 bits)             |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```

use core::fmt;
use core::ops::Range;

use crate::ddp::Stag;
use crate::{DecodeError, EncodeError};

/// Length of the Atomic Request header.
pub const REQUEST_LEN: usize = 52;

/// Length of the Atomic Response header.
pub const RESPONSE_LEN: usize = 12;

/// The AOpCode bits of the first word of an Atomic Request.
pub const AOPCODE_MASK: u32 = 0x0000_000f;

const WHAT_REQUEST: &str = "Atomic Request";
const WHAT_RESPONSE: &str = "Atomic Response";

mod field {
    use core::ops::Range;

    pub(super) const AOPCODE_WORD: Range<usize> = 0..4;
    pub(super) const REQUEST_ID: Range<usize> = 4..8;
    pub(super) const STAG: Range<usize> = 8..12;
    pub(super) const TO: Range<usize> = 12..20;
    pub(super) const ADD_SWAP_DATA: Range<usize> = 20..28;
    pub(super) const ADD_SWAP_MASK: Range<usize> = 28..36;
    pub(super) const COMPARE_DATA: Range<usize> = 36..44;
    pub(super) const COMPARE_MASK: Range<usize> = 44..52;

    pub(super) const ORIG_REQUEST_ID: Range<usize> = 0..4;
    pub(super) const ORIG_VALUE: Range<usize> = 4..12;
}

fn get<const N: usize>(buf: &[u8], range: Range<usize>) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = buf.get(range)
        && src.len() == N
    {
        out.copy_from_slice(src);
    }
    out
}

fn put(buf: &mut [u8], range: Range<usize>, src: &[u8]) {
    if let Some(dst) = buf.get_mut(range)
        && dst.len() == src.len()
    {
        dst.copy_from_slice(src);
    }
}

fn get_u32(buf: &[u8], range: Range<usize>) -> u32 {
    u32::from_be_bytes(get(buf, range))
}

fn get_u64(buf: &[u8], range: Range<usize>) -> u64 {
    u64::from_be_bytes(get(buf, range))
}

/// The atomic operation of an Atomic Request (the AOpCode field).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum AtomicOpcode {
    /// Fetch and add (masked when Add Mask is non-zero).
    FetchAdd = 0,
    /// Swap (masked when Swap Mask is not all ones).
    Swap = 1,
    /// Compare and swap (masked when a mask is not all ones).
    CmpSwap = 2,
}

impl AtomicOpcode {
    /// The operation with wire value `value`, or `None` for a reserved one.
    pub const fn from_u8(value: u8) -> Option<Self> {
        match value {
            0 => Some(Self::FetchAdd),
            1 => Some(Self::Swap),
            2 => Some(Self::CmpSwap),
            _ => None,
        }
    }

    /// The wire value.
    #[inline]
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The operation's name as RFC 7306 spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::FetchAdd => "FetchAdd",
            Self::Swap => "Swap",
            Self::CmpSwap => "CmpSwap",
        }
    }
}

impl fmt::Display for AtomicOpcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A zero-copy view of an Atomic Request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtomicRequest<T: AsRef<[u8]>> {
    buffer: T,
}

crate::view::fixed_len_view!(AtomicRequest, REQUEST_LEN, WHAT_REQUEST);

impl<T: AsRef<[u8]>> AtomicRequest<T> {
    /// The raw AOpCode (0..=15).
    #[inline]
    pub fn aopcode(&self) -> u8 {
        // The mask keeps four bits, so the cast cannot truncate.
        (get_u32(self.buffer.as_ref(), field::AOPCODE_WORD) & AOPCODE_MASK) as u8
    }

    /// The reserved upper 28 bits of the first word.
    #[inline]
    pub fn reserved(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::AOPCODE_WORD) >> 4
    }

    /// Request Identifier.
    #[inline]
    pub fn request_id(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::REQUEST_ID)
    }

    /// Remote STag.
    #[inline]
    pub fn stag(&self) -> Stag {
        Stag(get_u32(self.buffer.as_ref(), field::STAG))
    }

    /// Remote Tagged Offset.
    #[inline]
    pub fn to(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::TO)
    }

    /// Add or Swap Data.
    #[inline]
    pub fn add_or_swap_data(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::ADD_SWAP_DATA)
    }

    /// Add or Swap Mask.
    #[inline]
    pub fn add_or_swap_mask(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::ADD_SWAP_MASK)
    }

    /// Compare Data.
    #[inline]
    pub fn compare_data(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::COMPARE_DATA)
    }

    /// Compare Mask.
    #[inline]
    pub fn compare_mask(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::COMPARE_MASK)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicRequest<T> {
    /// Sets the first word: zero reserved bits and `opcode`.
    #[inline]
    pub fn set_aopcode(&mut self, opcode: AtomicOpcode) {
        let word = u32::from(opcode.as_u8());
        put(
            self.buffer.as_mut(),
            field::AOPCODE_WORD,
            &word.to_be_bytes(),
        );
    }

    /// Sets the Request Identifier.
    #[inline]
    pub fn set_request_id(&mut self, value: u32) {
        put(
            self.buffer.as_mut(),
            field::REQUEST_ID,
            &value.to_be_bytes(),
        );
    }

    /// Sets the Remote STag.
    #[inline]
    pub fn set_stag(&mut self, value: Stag) {
        put(self.buffer.as_mut(), field::STAG, &value.0.to_be_bytes());
    }

    /// Sets the Remote Tagged Offset.
    #[inline]
    pub fn set_to(&mut self, value: u64) {
        put(self.buffer.as_mut(), field::TO, &value.to_be_bytes());
    }

    /// Sets Add or Swap Data.
    #[inline]
    pub fn set_add_or_swap_data(&mut self, value: u64) {
        put(
            self.buffer.as_mut(),
            field::ADD_SWAP_DATA,
            &value.to_be_bytes(),
        );
    }

    /// Sets Add or Swap Mask.
    #[inline]
    pub fn set_add_or_swap_mask(&mut self, value: u64) {
        put(
            self.buffer.as_mut(),
            field::ADD_SWAP_MASK,
            &value.to_be_bytes(),
        );
    }

    /// Sets Compare Data.
    #[inline]
    pub fn set_compare_data(&mut self, value: u64) {
        put(
            self.buffer.as_mut(),
            field::COMPARE_DATA,
            &value.to_be_bytes(),
        );
    }

    /// Sets Compare Mask.
    #[inline]
    pub fn set_compare_mask(&mut self, value: u64) {
        put(
            self.buffer.as_mut(),
            field::COMPARE_MASK,
            &value.to_be_bytes(),
        );
    }
}

/// A parsed Atomic Request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicRequestRepr {
    /// The operation.
    pub opcode: AtomicOpcode,
    /// Request Identifier, chosen by the requester and echoed in the response.
    pub request_id: u32,
    /// Remote STag of the 64-bit target.
    pub stag: Stag,
    /// Remote Tagged Offset of the 64-bit target (8-byte aligned).
    pub to: u64,
    /// Add Data (FetchAdd) or Swap Data (Swap, CmpSwap).
    pub add_or_swap_data: u64,
    /// Add Mask (FetchAdd: field boundaries) or Swap Mask (Swap, CmpSwap:
    /// bits to replace).
    pub add_or_swap_mask: u64,
    /// Compare Data (CmpSwap; zero otherwise).
    pub compare_data: u64,
    /// Compare Mask (CmpSwap: bits to compare; zero otherwise).
    pub compare_mask: u64,
}

impl AtomicRequestRepr {
    /// A plain FetchAdd: adds `add` to the 64-bit value at `stag`/`to`.
    pub const fn fetch_add(request_id: u32, stag: Stag, to: u64, add: u64) -> Self {
        Self::masked_fetch_add(request_id, stag, to, add, 0)
    }

    /// A masked FetchAdd: `add_mask` marks field boundaries (no carry
    /// crosses a set bit).
    pub const fn masked_fetch_add(
        request_id: u32,
        stag: Stag,
        to: u64,
        add: u64,
        add_mask: u64,
    ) -> Self {
        Self {
            opcode: AtomicOpcode::FetchAdd,
            request_id,
            stag,
            to,
            add_or_swap_data: add,
            add_or_swap_mask: add_mask,
            compare_data: 0,
            compare_mask: 0,
        }
    }

    /// A plain Swap: replaces all 64 bits by `swap`.
    pub const fn swap(request_id: u32, stag: Stag, to: u64, swap: u64) -> Self {
        Self {
            opcode: AtomicOpcode::Swap,
            request_id,
            stag,
            to,
            add_or_swap_data: swap,
            add_or_swap_mask: u64::MAX,
            compare_data: 0,
            compare_mask: 0,
        }
    }

    /// A plain CmpSwap: if the value equals `compare`, replace it by `swap`.
    pub const fn cmp_swap(request_id: u32, stag: Stag, to: u64, compare: u64, swap: u64) -> Self {
        Self::masked_cmp_swap(request_id, stag, to, compare, u64::MAX, swap, u64::MAX)
    }

    /// A masked CmpSwap: compares the bits set in `compare_mask`, and if they
    /// match replaces the bits set in `swap_mask`.
    pub const fn masked_cmp_swap(
        request_id: u32,
        stag: Stag,
        to: u64,
        compare: u64,
        compare_mask: u64,
        swap: u64,
        swap_mask: u64,
    ) -> Self {
        Self {
            opcode: AtomicOpcode::CmpSwap,
            request_id,
            stag,
            to,
            add_or_swap_data: swap,
            add_or_swap_mask: swap_mask,
            compare_data: compare,
            compare_mask,
        }
    }

    /// Parses the header. The reserved bits of the first word are ignored.
    ///
    /// # Errors
    ///
    /// [`DecodeError::InvalidField`] (field `"AOpCode"`) for a reserved
    /// operation code.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &AtomicRequest<&T>) -> Result<Self, DecodeError> {
        let raw = header.aopcode();
        let opcode = AtomicOpcode::from_u8(raw).ok_or(DecodeError::InvalidField {
            what: WHAT_REQUEST,
            field: "AOpCode",
            value: u64::from(raw),
        })?;
        Ok(Self {
            opcode,
            request_id: header.request_id(),
            stag: header.stag(),
            to: header.to(),
            add_or_swap_data: header.add_or_swap_data(),
            add_or_swap_mask: header.add_or_swap_mask(),
            compare_data: header.compare_data(),
            compare_mask: header.compare_mask(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`REQUEST_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        REQUEST_LEN
    }

    /// Writes the header into the start of `buf`, returning [`REQUEST_LEN`].
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(hdr) = buf.get_mut(..REQUEST_LEN) else {
            return Err(EncodeError::BufferTooSmall {
                what: WHAT_REQUEST,
                needed: REQUEST_LEN,
                got,
            });
        };
        let mut view = AtomicRequest::new_unchecked(hdr);
        view.set_aopcode(self.opcode);
        view.set_request_id(self.request_id);
        view.set_stag(self.stag);
        view.set_to(self.to);
        view.set_add_or_swap_data(self.add_or_swap_data);
        view.set_add_or_swap_mask(self.add_or_swap_mask);
        view.set_compare_data(self.compare_data);
        view.set_compare_mask(self.compare_mask);
        Ok(REQUEST_LEN)
    }
}

/// A zero-copy view of an Atomic Response header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AtomicResponse<T: AsRef<[u8]>> {
    buffer: T,
}

crate::view::fixed_len_view!(AtomicResponse, RESPONSE_LEN, WHAT_RESPONSE);

impl<T: AsRef<[u8]>> AtomicResponse<T> {
    /// Original Request Identifier.
    #[inline]
    pub fn request_id(&self) -> u32 {
        get_u32(self.buffer.as_ref(), field::ORIG_REQUEST_ID)
    }

    /// Original Remote Data Value.
    #[inline]
    pub fn original_value(&self) -> u64 {
        get_u64(self.buffer.as_ref(), field::ORIG_VALUE)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> AtomicResponse<T> {
    /// Sets the Original Request Identifier.
    #[inline]
    pub fn set_request_id(&mut self, value: u32) {
        put(
            self.buffer.as_mut(),
            field::ORIG_REQUEST_ID,
            &value.to_be_bytes(),
        );
    }

    /// Sets the Original Remote Data Value.
    #[inline]
    pub fn set_original_value(&mut self, value: u64) {
        put(
            self.buffer.as_mut(),
            field::ORIG_VALUE,
            &value.to_be_bytes(),
        );
    }
}

/// A parsed Atomic Response header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AtomicResponseRepr {
    /// The Request Identifier of the request this answers.
    pub request_id: u32,
    /// The 64-bit value at the target before the operation.
    pub original_value: u64,
}

impl AtomicResponseRepr {
    /// Reads the fields (every bit pattern is well formed).
    ///
    /// # Errors
    ///
    /// None today; the `Result` keeps the signature of the other `parse`s.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(
        header: &AtomicResponse<&T>,
    ) -> Result<Self, DecodeError> {
        Ok(Self {
            request_id: header.request_id(),
            original_value: header.original_value(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`RESPONSE_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        RESPONSE_LEN
    }

    /// Writes the header into the start of `buf`, returning [`RESPONSE_LEN`].
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(hdr) = buf.get_mut(..RESPONSE_LEN) else {
            return Err(EncodeError::BufferTooSmall {
                what: WHAT_RESPONSE,
                needed: RESPONSE_LEN,
                got,
            });
        };
        let mut view = AtomicResponse::new_unchecked(hdr);
        view.set_request_id(self.request_id);
        view.set_original_value(self.original_value);
        Ok(RESPONSE_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A masked CmpSwap, written out field by field.
    const CMP_SWAP: [u8; REQUEST_LEN] = [
        0x00, 0x00, 0x00, 0x02, // reserved | AOpCode 2 (CmpSwap)
        0xde, 0xad, 0xbe, 0xef, // Request Identifier
        0x12, 0x34, 0x56, 0x78, // Remote STag
        0x00, 0x00, 0x7f, 0x00, 0x00, 0x00, 0x10, 0x08, // Remote TO
        0x11, 0x11, 0x11, 0x11, 0x22, 0x22, 0x22, 0x22, // Swap Data
        0xff, 0xff, 0xff, 0xff, 0x00, 0x00, 0x00, 0x00, // Swap Mask
        0x33, 0x33, 0x33, 0x33, 0x44, 0x44, 0x44, 0x44, // Compare Data
        0x00, 0x00, 0x00, 0x00, 0xff, 0xff, 0xff, 0xff, // Compare Mask
    ];

    #[test]
    fn golden_masked_cmp_swap() {
        let repr = AtomicRequestRepr::masked_cmp_swap(
            0xdead_beef,
            Stag(0x1234_5678),
            0x0000_7f00_0000_1008,
            0x3333_3333_4444_4444,
            0x0000_0000_ffff_ffff,
            0x1111_1111_2222_2222,
            0xffff_ffff_0000_0000,
        );
        let mut out = [0u8; REQUEST_LEN];
        assert_eq!(repr.emit(&mut out), Ok(REQUEST_LEN));
        assert_eq!(out, CMP_SWAP);
        let view = AtomicRequest::new_checked(&CMP_SWAP[..]).unwrap();
        assert_eq!(AtomicRequestRepr::parse(&view), Ok(repr));
    }

    #[test]
    fn constructors() {
        let s = Stag(7);
        let fa = AtomicRequestRepr::fetch_add(1, s, 8, 5);
        assert_eq!(
            (fa.opcode, fa.add_or_swap_mask, fa.compare_mask),
            (AtomicOpcode::FetchAdd, 0, 0)
        );
        let sw = AtomicRequestRepr::swap(1, s, 8, 5);
        assert_eq!(
            (sw.opcode, sw.add_or_swap_mask),
            (AtomicOpcode::Swap, u64::MAX)
        );
        let cs = AtomicRequestRepr::cmp_swap(1, s, 8, 4, 5);
        assert_eq!(
            (cs.compare_data, cs.compare_mask, cs.add_or_swap_data),
            (4, u64::MAX, 5)
        );
    }

    #[test]
    fn golden_response() {
        let bytes = [0, 0, 0, 9, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08];
        let view = AtomicResponse::new_checked(&bytes[..]).unwrap();
        let repr = AtomicResponseRepr::parse(&view).unwrap();
        assert_eq!(
            repr,
            AtomicResponseRepr {
                request_id: 9,
                original_value: 0x0102_0304_0506_0708
            }
        );
        let mut out = [0u8; RESPONSE_LEN];
        repr.emit(&mut out).unwrap();
        assert_eq!(out, bytes);
    }

    #[test]
    fn reserved_aopcodes_rejected_reserved_bits_ignored() {
        for raw in 3..16u8 {
            let mut buf = CMP_SWAP;
            buf[3] = raw;
            let view = AtomicRequest::new_checked(&buf[..]).unwrap();
            assert_eq!(
                AtomicRequestRepr::parse(&view),
                Err(DecodeError::InvalidField {
                    what: WHAT_REQUEST,
                    field: "AOpCode",
                    value: u64::from(raw)
                })
            );
        }
        let mut buf = CMP_SWAP;
        buf[0] = 0xff;
        buf[3] |= 0xf0;
        let view = AtomicRequest::new_checked(&buf[..]).unwrap();
        assert_eq!(view.reserved(), 0x0ff0_000f);
        assert_eq!(
            AtomicRequestRepr::parse(&view).map(|r| r.opcode),
            Ok(AtomicOpcode::CmpSwap)
        );
    }

    #[test]
    fn truncated_at_every_length() {
        for n in 0..REQUEST_LEN {
            assert!(matches!(
                AtomicRequest::new_checked(&CMP_SWAP[..n]),
                Err(DecodeError::Truncated { .. })
            ));
            let mut out = vec![0u8; n];
            assert!(
                AtomicRequestRepr::fetch_add(0, Stag(0), 0, 0)
                    .emit(&mut out)
                    .is_err()
            );
        }
        for n in 0..RESPONSE_LEN {
            assert!(matches!(
                AtomicResponse::new_checked(&CMP_SWAP[..n]),
                Err(DecodeError::Truncated { .. })
            ));
        }
        assert_eq!(AtomicRequest::new_unchecked(&[1u8][..]).compare_mask(), 0);
    }

    fn arb_request() -> impl Strategy<Value = AtomicRequestRepr> {
        (
            0u8..3,
            any::<u32>(),
            any::<u32>(),
            any::<u64>(),
            any::<[u64; 4]>(),
        )
            .prop_map(
                |(op, request_id, stag, to, [a, b, c, d])| AtomicRequestRepr {
                    opcode: AtomicOpcode::from_u8(op).unwrap_or(AtomicOpcode::FetchAdd),
                    request_id,
                    stag: Stag(stag),
                    to,
                    add_or_swap_data: a,
                    add_or_swap_mask: b,
                    compare_data: c,
                    compare_mask: d,
                },
            )
    }

    proptest! {
        #[test]
        fn request_roundtrip(repr in arb_request()) {
            let mut buf = [0u8; REQUEST_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(REQUEST_LEN));
            let view = AtomicRequest::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(AtomicRequestRepr::parse(&view), Ok(repr));
        }

        #[test]
        fn response_roundtrip(request_id in any::<u32>(), original_value in any::<u64>()) {
            let repr = AtomicResponseRepr { request_id, original_value };
            let mut buf = [0u8; RESPONSE_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(RESPONSE_LEN));
            let view = AtomicResponse::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(AtomicResponseRepr::parse(&view), Ok(repr));
        }
    }
}
