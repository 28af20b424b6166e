//! DDP segment headers (RFC 5041 section 4).
//!
//! Every DDP segment starts with the DDP control field and 8 bits reserved
//! for the ULP (RDMAP puts its control field there), followed by the fields
//! of one of two buffer models. RFC 5041 section 4.2 (control field):
//!
//! ```text
//!  0                   1
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Resrv | DV| RsvdULP[0:7]  |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! `T` is set for the tagged buffer model, `L` on the last segment of a DDP
//! message, `Resrv` is sent as zero and not checked on receipt, `DV` is the
//! DDP version (1, the only version defined, and the one Linux siw speaks).
//!
//! Tagged buffer model header (section 4.3), 14 bytes:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Resrv | DV| RsvdULP[0:7]  |            STag               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |              STag (cont)      |             TO                |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                              TO (cont)                        |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |         TO (cont)             |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! Untagged buffer model header (section 4.4), 18 bytes:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Resrv | DV| RsvdULP[0:7]  |        RsvdULP[8:39]          |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |     RsvdULP[8:39] (cont)      |              QN               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |          QN (cont)            |              MSN              |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |          MSN (cont)           |              MO               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |          MO (cont)            |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! All multi-byte fields are big-endian. On the wire these headers follow the
//! 2-byte MPA ULPDU length (RFC 5044 section 4), so the ULPDU length of a DDP
//! segment is header length plus payload length.
//!
//! [`header_len`] tells from the first byte alone how long the header is, so
//! a deframer can split header from payload and place the payload directly.
//! [`Tagged`] and [`Untagged`] are zero-copy views, [`DdpHeaderRepr`] the
//! parsed value.

use core::fmt;
use core::ops::Range;

use crate::{DecodeError, EncodeError};

/// The DDP version this implementation speaks (RFC 5041 section 4.2).
pub const DDP_VERSION: u8 = 1;

/// Length of the tagged buffer model header (control through TO).
pub const TAGGED_HEADER_LEN: usize = 14;

/// Length of the untagged buffer model header (control through MO).
pub const UNTAGGED_HEADER_LEN: usize = 18;

/// The `T` (tagged) flag in the DDP control field.
pub const FLAG_TAGGED: u8 = 0x80;

/// The `L` (last segment) flag in the DDP control field.
pub const FLAG_LAST: u8 = 0x40;

/// The reserved bits of the DDP control field (sent as zero, ignored on receipt).
pub const RESERVED_MASK: u8 = 0x3c;

/// The DDP version bits of the DDP control field.
pub const VERSION_MASK: u8 = 0x03;

/// Untagged queue for Send, Send with Invalidate, Send with Solicited Event,
/// Send with Solicited Event and Invalidate (RFC 5040 section 4.3), and the
/// Immediate Data messages of RFC 7306.
pub const QN_SEND: Qn = Qn(0);

/// Untagged queue for RDMA Read Request messages (RFC 5040 section 4.3); RFC
/// 7306 Atomic Request messages travel on the same queue.
pub const QN_READ_REQUEST: Qn = Qn(1);

/// Untagged queue for Terminate messages (RFC 5040 section 4.3).
pub const QN_TERMINATE: Qn = Qn(2);

/// Untagged queue for Atomic Response messages (RFC 7306).
pub const QN_ATOMIC_RESPONSE: Qn = Qn(3);

/// Length of the DDP header that starts with `first_byte` (the DDP control
/// field): [`TAGGED_HEADER_LEN`] if the `T` flag is set, else
/// [`UNTAGGED_HEADER_LEN`].
///
/// This looks at the `T` bit only; the header itself is validated when it is
/// parsed. A deframer calls it to split header from payload as soon as the
/// first byte of a ULPDU is in.
///
/// ```
/// use softrdma_wire::ddp;
/// assert_eq!(ddp::header_len(0xc1), 14);
/// assert_eq!(ddp::header_len(0x41), 18);
/// ```
#[inline]
pub const fn header_len(first_byte: u8) -> usize {
    if first_byte & FLAG_TAGGED != 0 {
        TAGGED_HEADER_LEN
    } else {
        UNTAGGED_HEADER_LEN
    }
}

/// A Steering Tag: names a registered buffer (memory region or window) of
/// the peer that receives a tagged segment (RFC 5041 section 3).
///
/// Following the verbs convention the 32 bits are a 24-bit index (upper bits)
/// and an 8-bit key (lower bits) that the owner changes on re-registration and
/// invalidation, so a stale STag does not match.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Stag(pub u32);

impl Stag {
    /// Builds an STag from a 24-bit index and an 8-bit key. Bits of `index`
    /// above 24 are dropped.
    #[inline]
    pub const fn from_parts(index: u32, key: u8) -> Self {
        Stag((index << 8) | key as u32)
    }

    /// The 24-bit index (upper 24 bits).
    #[inline]
    pub const fn index(self) -> u32 {
        self.0 >> 8
    }

    /// The 8-bit key (lower 8 bits).
    #[inline]
    pub const fn key(self) -> u8 {
        (self.0 & 0xff) as u8
    }
}

impl fmt::Debug for Stag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Stag({:#010x})", self.0)
    }
}

impl fmt::Display for Stag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#010x}", self.0)
    }
}

/// A DDP untagged Queue Number (RFC 5041 section 4.4). RDMAP uses queues 0,
/// 1 and 2 ([`QN_SEND`], [`QN_READ_REQUEST`], [`QN_TERMINATE`]) and RFC 7306
/// adds 3 ([`QN_ATOMIC_RESPONSE`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Qn(pub u32);

impl fmt::Debug for Qn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Qn({})", self.0)
    }
}

impl fmt::Display for Qn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A DDP Message Sequence Number (RFC 5041 section 4.4).
///
/// Each untagged queue numbers its messages separately. The first message on
/// every queue of a DDP stream carries MSN 1 ([`Msn::INITIAL`], RFC 5041
/// section 4.4; Linux siw does the same), and the counter wraps modulo 2^32.
/// All segments of one message carry the same MSN.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Msn(pub u32);

impl Msn {
    /// The MSN of the first message on every untagged queue.
    pub const INITIAL: Msn = Msn(1);

    /// The MSN of the next message on the same queue (wraps modulo 2^32).
    #[inline]
    #[must_use]
    pub const fn next(self) -> Msn {
        Msn(self.0.wrapping_add(1))
    }
}

impl Default for Msn {
    fn default() -> Self {
        Msn::INITIAL
    }
}

impl fmt::Debug for Msn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Msn({})", self.0)
    }
}

impl fmt::Display for Msn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Byte ranges of the header fields.
mod field {
    use core::ops::Range;

    /// DDP control field: T, L, reserved, DV.
    pub(super) const CONTROL: usize = 0;
    /// `RsvdULP[0:7]` (the RDMAP control field).
    pub(super) const RSVD_ULP: usize = 1;

    /// Tagged: Steering Tag.
    pub(super) const STAG: Range<usize> = 2..6;
    /// Tagged: Tagged Offset.
    pub(super) const TO: Range<usize> = 6..14;

    /// Untagged: `RsvdULP[8:39]`.
    pub(super) const RSVD_ULP_EXT: Range<usize> = 2..6;
    /// Untagged: Queue Number.
    pub(super) const QN: Range<usize> = 6..10;
    /// Untagged: Message Sequence Number.
    pub(super) const MSN: Range<usize> = 10..14;
    /// Untagged: Message Offset.
    pub(super) const MO: Range<usize> = 14..18;
}

const WHAT_TAGGED: &str = "DDP tagged header";
const WHAT_UNTAGGED: &str = "DDP untagged header";

#[inline]
fn read_u32(buf: &[u8], range: Range<usize>) -> u32 {
    let mut b = [0u8; 4];
    if let Some(src) = buf.get(range)
        && src.len() == 4
    {
        b.copy_from_slice(src);
    }
    u32::from_be_bytes(b)
}

#[inline]
fn read_u64(buf: &[u8], range: Range<usize>) -> u64 {
    let mut b = [0u8; 8];
    if let Some(src) = buf.get(range)
        && src.len() == 8
    {
        b.copy_from_slice(src);
    }
    u64::from_be_bytes(b)
}

#[inline]
fn write_bytes(buf: &mut [u8], range: Range<usize>, src: &[u8]) {
    if let Some(dst) = buf.get_mut(range)
        && dst.len() == src.len()
    {
        dst.copy_from_slice(src);
    }
}

#[inline]
fn read_u8(buf: &[u8], at: usize) -> u8 {
    buf.get(at).copied().unwrap_or(0)
}

#[inline]
fn write_u8(buf: &mut [u8], at: usize, value: u8) {
    if let Some(b) = buf.get_mut(at) {
        *b = value;
    }
}

macro_rules! common_accessors {
    () => {
        /// Wraps a buffer without checking its length. Accessors of a too
        /// short buffer return zeroes rather than panic; use
        /// [`Self::new_checked`] to be told.
        #[inline]
        pub const fn new_unchecked(buffer: T) -> Self {
            Self { buffer }
        }

        /// Returns the underlying buffer.
        #[inline]
        pub fn into_inner(self) -> T {
            self.buffer
        }

        /// The raw DDP control byte.
        #[inline]
        pub fn control(&self) -> u8 {
            read_u8(self.buffer.as_ref(), field::CONTROL)
        }

        /// The `T` (tagged) flag.
        #[inline]
        pub fn tagged(&self) -> bool {
            self.control() & FLAG_TAGGED != 0
        }

        /// The `L` (last segment) flag.
        #[inline]
        pub fn last(&self) -> bool {
            self.control() & FLAG_LAST != 0
        }

        /// The reserved bits of the control field, shifted down (0..=15).
        #[inline]
        pub fn reserved(&self) -> u8 {
            (self.control() & RESERVED_MASK) >> 2
        }

        /// The DDP version (DV).
        #[inline]
        pub fn version(&self) -> u8 {
            self.control() & VERSION_MASK
        }

        /// `RsvdULP[0:7]`: the 8 bits reserved for the ULP (the RDMAP control
        /// field).
        #[inline]
        pub fn rsvd_ulp(&self) -> u8 {
            read_u8(self.buffer.as_ref(), field::RSVD_ULP)
        }
    };
}

macro_rules! common_setters {
    () => {
        /// Sets the DDP control byte: the flags, zero reserved bits and
        /// version [`DDP_VERSION`].
        #[inline]
        pub fn set_control(&mut self, tagged: bool, last: bool) {
            let mut c = DDP_VERSION;
            if tagged {
                c |= FLAG_TAGGED;
            }
            if last {
                c |= FLAG_LAST;
            }
            write_u8(self.buffer.as_mut(), field::CONTROL, c);
        }

        /// Sets the raw DDP control byte.
        #[inline]
        pub fn set_control_raw(&mut self, value: u8) {
            write_u8(self.buffer.as_mut(), field::CONTROL, value);
        }

        /// Sets `RsvdULP[0:7]`.
        #[inline]
        pub fn set_rsvd_ulp(&mut self, value: u8) {
            write_u8(self.buffer.as_mut(), field::RSVD_ULP, value);
        }
    };
}

/// A zero-copy view of a tagged buffer model DDP header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tagged<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Tagged<T> {
    common_accessors!();

    /// Wraps a buffer, checking that it holds at least
    /// [`TAGGED_HEADER_LEN`] bytes. Field contents (flags, version) are
    /// checked by [`DdpTaggedRepr::parse`].
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is too short.
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let got = buffer.as_ref().len();
        if got < TAGGED_HEADER_LEN {
            return Err(DecodeError::Truncated {
                what: WHAT_TAGGED,
                needed: TAGGED_HEADER_LEN,
                got,
            });
        }
        Ok(Self { buffer })
    }

    /// The Steering Tag of the data sink buffer.
    #[inline]
    pub fn stag(&self) -> Stag {
        Stag(read_u32(self.buffer.as_ref(), field::STAG))
    }

    /// The Tagged Offset: where in the STag's buffer this segment's payload
    /// goes.
    #[inline]
    pub fn to(&self) -> u64 {
        read_u64(self.buffer.as_ref(), field::TO)
    }

    /// The bytes after the header.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        self.buffer.as_ref().get(TAGGED_HEADER_LEN..).unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Tagged<T> {
    common_setters!();

    /// Sets the Steering Tag.
    #[inline]
    pub fn set_stag(&mut self, value: Stag) {
        write_bytes(self.buffer.as_mut(), field::STAG, &value.0.to_be_bytes());
    }

    /// Sets the Tagged Offset.
    #[inline]
    pub fn set_to(&mut self, value: u64) {
        write_bytes(self.buffer.as_mut(), field::TO, &value.to_be_bytes());
    }
}

/// A zero-copy view of an untagged buffer model DDP header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Untagged<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Untagged<T> {
    common_accessors!();

    /// Wraps a buffer, checking that it holds at least
    /// [`UNTAGGED_HEADER_LEN`] bytes. Field contents (flags, version) are
    /// checked by [`DdpUntaggedRepr::parse`].
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if the buffer is too short.
    pub fn new_checked(buffer: T) -> Result<Self, DecodeError> {
        let got = buffer.as_ref().len();
        if got < UNTAGGED_HEADER_LEN {
            return Err(DecodeError::Truncated {
                what: WHAT_UNTAGGED,
                needed: UNTAGGED_HEADER_LEN,
                got,
            });
        }
        Ok(Self { buffer })
    }

    /// `RsvdULP[8:39]`: 32 more bits for the ULP (RDMAP carries the
    /// Invalidate STag here).
    #[inline]
    pub fn rsvd_ulp_ext(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::RSVD_ULP_EXT)
    }

    /// The Queue Number.
    #[inline]
    pub fn qn(&self) -> Qn {
        Qn(read_u32(self.buffer.as_ref(), field::QN))
    }

    /// The Message Sequence Number.
    #[inline]
    pub fn msn(&self) -> Msn {
        Msn(read_u32(self.buffer.as_ref(), field::MSN))
    }

    /// The Message Offset: byte offset of this segment's payload within the
    /// DDP message.
    #[inline]
    pub fn mo(&self) -> u32 {
        read_u32(self.buffer.as_ref(), field::MO)
    }

    /// The bytes after the header.
    #[inline]
    pub fn payload(&self) -> &[u8] {
        self.buffer
            .as_ref()
            .get(UNTAGGED_HEADER_LEN..)
            .unwrap_or(&[])
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Untagged<T> {
    common_setters!();

    /// Sets `RsvdULP[8:39]`.
    #[inline]
    pub fn set_rsvd_ulp_ext(&mut self, value: u32) {
        write_bytes(
            self.buffer.as_mut(),
            field::RSVD_ULP_EXT,
            &value.to_be_bytes(),
        );
    }

    /// Sets the Queue Number.
    #[inline]
    pub fn set_qn(&mut self, value: Qn) {
        write_bytes(self.buffer.as_mut(), field::QN, &value.0.to_be_bytes());
    }

    /// Sets the Message Sequence Number.
    #[inline]
    pub fn set_msn(&mut self, value: Msn) {
        write_bytes(self.buffer.as_mut(), field::MSN, &value.0.to_be_bytes());
    }

    /// Sets the Message Offset.
    #[inline]
    pub fn set_mo(&mut self, value: u32) {
        write_bytes(self.buffer.as_mut(), field::MO, &value.to_be_bytes());
    }
}

fn check_version(what: &'static str, control: u8) -> Result<(), DecodeError> {
    let version = control & VERSION_MASK;
    if version != DDP_VERSION {
        return Err(DecodeError::BadVersion { what, version });
    }
    Ok(())
}

fn buffer_too_small(what: &'static str, needed: usize, got: usize) -> EncodeError {
    EncodeError::BufferTooSmall { what, needed, got }
}

/// A parsed tagged buffer model DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DdpTaggedRepr {
    /// The `L` flag: last segment of the DDP message.
    pub last: bool,
    /// `RsvdULP[0:7]`, opaque to DDP (RDMAP's control field).
    pub rsvd_ulp: u8,
    /// The data sink's Steering Tag.
    pub stag: Stag,
    /// The Tagged Offset of this segment's first payload byte.
    pub to: u64,
}

impl DdpTaggedRepr {
    /// Parses a tagged header.
    ///
    /// # Errors
    ///
    /// [`DecodeError::InvalidField`] if the `T` flag is clear,
    /// [`DecodeError::BadVersion`] if DV is not [`DDP_VERSION`]. The reserved
    /// bits are ignored, as RFC 5041 requires.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Tagged<&T>) -> Result<Self, DecodeError> {
        let control = header.control();
        if control & FLAG_TAGGED == 0 {
            return Err(DecodeError::InvalidField {
                what: WHAT_TAGGED,
                field: "T flag",
                value: 0,
            });
        }
        check_version(WHAT_TAGGED, control)?;
        Ok(Self {
            last: header.last(),
            rsvd_ulp: header.rsvd_ulp(),
            stag: header.stag(),
            to: header.to(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`TAGGED_HEADER_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        TAGGED_HEADER_LEN
    }

    /// Writes the header into the start of `buf` and returns its length.
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than
    /// [`TAGGED_HEADER_LEN`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(hdr) = buf.get_mut(..TAGGED_HEADER_LEN) else {
            return Err(buffer_too_small(WHAT_TAGGED, TAGGED_HEADER_LEN, got));
        };
        let mut view = Tagged::new_unchecked(hdr);
        view.set_control(true, self.last);
        view.set_rsvd_ulp(self.rsvd_ulp);
        view.set_stag(self.stag);
        view.set_to(self.to);
        Ok(TAGGED_HEADER_LEN)
    }
}

/// A parsed untagged buffer model DDP header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DdpUntaggedRepr {
    /// The `L` flag: last segment of the DDP message.
    pub last: bool,
    /// `RsvdULP[0:7]`, opaque to DDP (RDMAP's control field).
    pub rsvd_ulp: u8,
    /// `RsvdULP[8:39]`, opaque to DDP (RDMAP's Invalidate STag or zero).
    pub rsvd_ulp_ext: u32,
    /// The Queue Number.
    pub qn: Qn,
    /// The Message Sequence Number.
    pub msn: Msn,
    /// The Message Offset of this segment's first payload byte.
    pub mo: u32,
}

impl DdpUntaggedRepr {
    /// Parses an untagged header.
    ///
    /// # Errors
    ///
    /// [`DecodeError::InvalidField`] if the `T` flag is set,
    /// [`DecodeError::BadVersion`] if DV is not [`DDP_VERSION`]. The reserved
    /// bits are ignored, as RFC 5041 requires.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &Untagged<&T>) -> Result<Self, DecodeError> {
        let control = header.control();
        if control & FLAG_TAGGED != 0 {
            return Err(DecodeError::InvalidField {
                what: WHAT_UNTAGGED,
                field: "T flag",
                value: 1,
            });
        }
        check_version(WHAT_UNTAGGED, control)?;
        Ok(Self {
            last: header.last(),
            rsvd_ulp: header.rsvd_ulp(),
            rsvd_ulp_ext: header.rsvd_ulp_ext(),
            qn: header.qn(),
            msn: header.msn(),
            mo: header.mo(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`UNTAGGED_HEADER_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        UNTAGGED_HEADER_LEN
    }

    /// Writes the header into the start of `buf` and returns its length.
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than
    /// [`UNTAGGED_HEADER_LEN`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(hdr) = buf.get_mut(..UNTAGGED_HEADER_LEN) else {
            return Err(buffer_too_small(WHAT_UNTAGGED, UNTAGGED_HEADER_LEN, got));
        };
        let mut view = Untagged::new_unchecked(hdr);
        view.set_control(false, self.last);
        view.set_rsvd_ulp(self.rsvd_ulp);
        view.set_rsvd_ulp_ext(self.rsvd_ulp_ext);
        view.set_qn(self.qn);
        view.set_msn(self.msn);
        view.set_mo(self.mo);
        Ok(UNTAGGED_HEADER_LEN)
    }
}

/// A parsed DDP header of either buffer model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DdpHeaderRepr {
    /// Tagged buffer model (`T` = 1).
    Tagged(DdpTaggedRepr),
    /// Untagged buffer model (`T` = 0).
    Untagged(DdpUntaggedRepr),
}

impl DdpHeaderRepr {
    /// Parses the DDP header at the start of `buf` (a ULPDU), choosing the
    /// buffer model by the `T` flag. Returns the header and its length; the
    /// payload is `&buf[len..]`.
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if `buf` is shorter than the header,
    /// [`DecodeError::BadVersion`] if DV is not [`DDP_VERSION`].
    ///
    /// ```
    /// use softrdma_wire::ddp::{DdpHeaderRepr, Msn, QN_SEND};
    /// // An untagged Send segment from a Linux siw capture (rping).
    /// let ulpdu = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
    /// let (hdr, len) = DdpHeaderRepr::parse(&ulpdu)?;
    /// let DdpHeaderRepr::Untagged(u) = hdr else { unreachable!() };
    /// assert_eq!((len, u.qn, u.msn, u.mo, u.last), (18, QN_SEND, Msn(1), 0, true));
    /// # Ok::<(), softrdma_wire::DecodeError>(())
    /// ```
    pub fn parse(buf: &[u8]) -> Result<(Self, usize), DecodeError> {
        let Some(&first) = buf.first() else {
            return Err(DecodeError::Truncated {
                what: "DDP header",
                needed: 1,
                got: 0,
            });
        };
        if first & FLAG_TAGGED != 0 {
            let view = Tagged::new_checked(buf)?;
            Ok((
                Self::Tagged(DdpTaggedRepr::parse(&view)?),
                TAGGED_HEADER_LEN,
            ))
        } else {
            let view = Untagged::new_checked(buf)?;
            Ok((
                Self::Untagged(DdpUntaggedRepr::parse(&view)?),
                UNTAGGED_HEADER_LEN,
            ))
        }
    }

    /// Whether this is a tagged header.
    #[inline]
    pub const fn is_tagged(&self) -> bool {
        matches!(self, Self::Tagged(_))
    }

    /// The `L` flag.
    #[inline]
    pub const fn last(&self) -> bool {
        match self {
            Self::Tagged(t) => t.last,
            Self::Untagged(u) => u.last,
        }
    }

    /// `RsvdULP[0:7]`.
    #[inline]
    pub const fn rsvd_ulp(&self) -> u8 {
        match self {
            Self::Tagged(t) => t.rsvd_ulp,
            Self::Untagged(u) => u.rsvd_ulp,
        }
    }

    /// Bytes [`Self::emit`] writes.
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        match self {
            Self::Tagged(_) => TAGGED_HEADER_LEN,
            Self::Untagged(_) => UNTAGGED_HEADER_LEN,
        }
    }

    /// Writes the header into the start of `buf` and returns its length.
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than
    /// [`Self::buffer_len`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        match self {
            Self::Tagged(t) => t.emit(buf),
            Self::Untagged(u) => u.emit(buf),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// rping.txt frame 13: RDMA Write, T=1 L=1, STag 0x88724100,
    /// TO 0x0000555c000ba450, RDMAP control 0x40.
    const WRITE_HDR: [u8; 14] = [
        0xc1, 0x40, 0x88, 0x72, 0x41, 0x00, 0x00, 0x00, 0x55, 0x5c, 0x00, 0x0b, 0xa4, 0x50,
    ];

    /// ib_send_bw.txt frame 39: Send, T=0 L=0, QN 0, MSN 1, MO 1424;
    /// "Reserved for use by the ULP: 4300000000".
    const SEND_MIDDLE_HDR: [u8; 18] = [
        0x01, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0x05, 0x90,
    ];

    #[test]
    fn golden_tagged_write() {
        let (hdr, len) = DdpHeaderRepr::parse(&WRITE_HDR).unwrap();
        assert_eq!(len, 14);
        let expected = DdpTaggedRepr {
            last: true,
            rsvd_ulp: 0x40,
            stag: Stag(0x8872_4100),
            to: 0x0000_555c_000b_a450,
        };
        assert_eq!(hdr, DdpHeaderRepr::Tagged(expected));
        let mut out = [0u8; 14];
        assert_eq!(hdr.emit(&mut out), Ok(14));
        assert_eq!(out, WRITE_HDR);
        assert_eq!(expected.stag.index(), 0x88_7241);
        assert_eq!(expected.stag.key(), 0x00);
    }

    #[test]
    fn golden_untagged_send_middle_segment() {
        let (hdr, len) = DdpHeaderRepr::parse(&SEND_MIDDLE_HDR).unwrap();
        assert_eq!(len, 18);
        let expected = DdpUntaggedRepr {
            last: false,
            rsvd_ulp: 0x43,
            rsvd_ulp_ext: 0,
            qn: QN_SEND,
            msn: Msn::INITIAL,
            mo: 1424,
        };
        assert_eq!(hdr, DdpHeaderRepr::Untagged(expected));
        let mut out = [0u8; 18];
        assert_eq!(hdr.emit(&mut out), Ok(18));
        assert_eq!(out, SEND_MIDDLE_HDR);
    }

    #[test]
    fn view_accessors_and_payload() {
        let mut buf = WRITE_HDR.to_vec();
        buf.extend_from_slice(b"data");
        let view = Tagged::new_checked(&buf[..]).unwrap();
        assert!(view.tagged() && view.last());
        assert_eq!((view.version(), view.reserved()), (1, 0));
        assert_eq!(view.payload(), b"data");
        let view = Untagged::new_checked(&SEND_MIDDLE_HDR[..]).unwrap();
        assert!(!view.tagged() && !view.last());
        assert_eq!(view.payload(), b"");
    }

    #[test]
    fn header_len_by_first_byte() {
        for b in 0..=255u8 {
            let expected = if b & 0x80 != 0 { 14 } else { 18 };
            assert_eq!(header_len(b), expected);
        }
    }

    #[test]
    fn truncated_at_every_length() {
        for n in 0..WRITE_HDR.len() {
            assert!(matches!(
                DdpHeaderRepr::parse(&WRITE_HDR[..n]),
                Err(DecodeError::Truncated { .. })
            ));
        }
        for n in 0..SEND_MIDDLE_HDR.len() {
            assert!(matches!(
                DdpHeaderRepr::parse(&SEND_MIDDLE_HDR[..n]),
                Err(DecodeError::Truncated { .. })
            ));
        }
    }

    #[test]
    fn bad_version_rejected() {
        for dv in [0u8, 2, 3] {
            let mut buf = WRITE_HDR;
            buf[0] = (buf[0] & !VERSION_MASK) | dv;
            assert_eq!(
                DdpHeaderRepr::parse(&buf),
                Err(DecodeError::BadVersion {
                    what: WHAT_TAGGED,
                    version: dv
                })
            );
            let mut buf = SEND_MIDDLE_HDR;
            buf[0] = (buf[0] & !VERSION_MASK) | dv;
            assert_eq!(
                DdpHeaderRepr::parse(&buf),
                Err(DecodeError::BadVersion {
                    what: WHAT_UNTAGGED,
                    version: dv
                })
            );
        }
    }

    #[test]
    fn reserved_bits_ignored() {
        let mut buf = WRITE_HDR;
        buf[0] |= RESERVED_MASK;
        let (hdr, _) = DdpHeaderRepr::parse(&buf).unwrap();
        assert_eq!(hdr, DdpHeaderRepr::parse(&WRITE_HDR).unwrap().0);
    }

    #[test]
    fn model_parse_rejects_wrong_t_flag() {
        let view = Untagged::new_checked(&SEND_MIDDLE_HDR[..]).unwrap();
        assert!(DdpUntaggedRepr::parse(&view).is_ok());
        let mut buf = SEND_MIDDLE_HDR;
        buf[0] |= FLAG_TAGGED;
        let view = Untagged::new_checked(&buf[..]).unwrap();
        assert!(matches!(
            DdpUntaggedRepr::parse(&view),
            Err(DecodeError::InvalidField { .. })
        ));
        let view = Tagged::new_checked(&SEND_MIDDLE_HDR[..]).unwrap();
        assert!(matches!(
            DdpTaggedRepr::parse(&view),
            Err(DecodeError::InvalidField { .. })
        ));
    }

    #[test]
    fn emit_into_short_buffer_fails() {
        let (hdr, _) = DdpHeaderRepr::parse(&SEND_MIDDLE_HDR).unwrap();
        for n in 0..18 {
            let mut out = vec![0u8; n];
            assert!(matches!(
                hdr.emit(&mut out),
                Err(EncodeError::BufferTooSmall { .. })
            ));
        }
    }

    #[test]
    fn unchecked_view_of_short_buffer_does_not_panic() {
        let view = Untagged::new_unchecked(&[0x41u8, 0x43, 1][..]);
        assert_eq!((view.qn(), view.msn(), view.mo()), (Qn(0), Msn(0), 0));
        assert_eq!(view.payload(), b"");
        let view = Tagged::new_unchecked(&[][..]);
        assert_eq!((view.control(), view.stag(), view.to()), (0, Stag(0), 0));
    }

    #[test]
    fn msn_wraps() {
        assert_eq!(Msn::default(), Msn(1));
        assert_eq!(Msn(u32::MAX).next(), Msn(0));
        assert_eq!(Stag::from_parts(0x12_3456, 0x78), Stag(0x1234_5678));
    }

    fn arb_header() -> impl Strategy<Value = DdpHeaderRepr> {
        prop_oneof![
            (any::<bool>(), any::<u8>(), any::<u32>(), any::<u64>()).prop_map(
                |(last, rsvd_ulp, stag, to)| DdpHeaderRepr::Tagged(DdpTaggedRepr {
                    last,
                    rsvd_ulp,
                    stag: Stag(stag),
                    to,
                })
            ),
            (
                any::<bool>(),
                any::<u8>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u32>()
            )
                .prop_map(|(last, rsvd_ulp, rsvd_ulp_ext, qn, msn, mo)| {
                    DdpHeaderRepr::Untagged(DdpUntaggedRepr {
                        last,
                        rsvd_ulp,
                        rsvd_ulp_ext,
                        qn: Qn(qn),
                        msn: Msn(msn),
                        mo,
                    })
                }),
        ]
    }

    proptest! {
        #[test]
        fn roundtrip(hdr in arb_header(), payload in proptest::collection::vec(any::<u8>(), 0..8)) {
            let mut buf = vec![0u8; hdr.buffer_len()];
            prop_assert_eq!(hdr.emit(&mut buf), Ok(hdr.buffer_len()));
            prop_assert_eq!(header_len(buf[0]), hdr.buffer_len());
            buf.extend_from_slice(&payload);
            let (parsed, len) = DdpHeaderRepr::parse(&buf).unwrap();
            prop_assert_eq!(parsed, hdr);
            prop_assert_eq!(&buf[len..], &payload[..]);
        }

        #[test]
        fn parse_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..40)) {
            let _ = DdpHeaderRepr::parse(&buf);
        }
    }
}
