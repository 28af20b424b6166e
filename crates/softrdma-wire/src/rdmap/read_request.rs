//! The RDMA Read Request header (RFC 5040 section 4.4).
//!
//! An RDMA Read Request is an untagged DDP message on queue 1 whose payload
//! is this 28-byte header; the ULPDU is 18 + 28 = 46 bytes.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                         Data Sink STag                        |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                  Data Sink Tagged Offset (64 bits)            |
//! +                                                               +
//! |                                                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                    RDMA Read Message Size                     |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                         Data Source STag                      |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                 Data Source Tagged Offset (64 bits)           |
//! +                                                               +
//! |                                                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! The Data Sink fields name the requester's buffer the RDMA Read Response
//! will be written to (its STag and TO appear in the Read Response's tagged
//! DDP header); the Data Source fields name the responder's buffer to read.

use crate::ddp::Stag;
use crate::{DecodeError, EncodeError};

/// Length of the RDMA Read Request header.
pub const HEADER_LEN: usize = 28;

const WHAT: &str = "RDMA Read Request";

mod field {
    use core::ops::Range;

    pub(super) const SINK_STAG: Range<usize> = 0..4;
    pub(super) const SINK_TO: Range<usize> = 4..12;
    pub(super) const READ_SIZE: Range<usize> = 12..16;
    pub(super) const SRC_STAG: Range<usize> = 16..20;
    pub(super) const SRC_TO: Range<usize> = 20..28;
}

fn get<const N: usize>(buf: &[u8], range: core::ops::Range<usize>) -> [u8; N] {
    let mut out = [0u8; N];
    if let Some(src) = buf.get(range)
        && src.len() == N
    {
        out.copy_from_slice(src);
    }
    out
}

fn put(buf: &mut [u8], range: core::ops::Range<usize>, src: &[u8]) {
    if let Some(dst) = buf.get_mut(range)
        && dst.len() == src.len()
    {
        dst.copy_from_slice(src);
    }
}

/// A zero-copy view of an RDMA Read Request header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest<T: AsRef<[u8]>> {
    buffer: T,
}

crate::view::fixed_len_view!(ReadRequest, HEADER_LEN, WHAT);

impl<T: AsRef<[u8]>> ReadRequest<T> {
    /// Data Sink STag.
    #[inline]
    pub fn sink_stag(&self) -> Stag {
        Stag(u32::from_be_bytes(get(
            self.buffer.as_ref(),
            field::SINK_STAG,
        )))
    }

    /// Data Sink Tagged Offset.
    #[inline]
    pub fn sink_to(&self) -> u64 {
        u64::from_be_bytes(get(self.buffer.as_ref(), field::SINK_TO))
    }

    /// RDMA Read Message Size, in bytes.
    #[inline]
    pub fn read_size(&self) -> u32 {
        u32::from_be_bytes(get(self.buffer.as_ref(), field::READ_SIZE))
    }

    /// Data Source STag.
    #[inline]
    pub fn src_stag(&self) -> Stag {
        Stag(u32::from_be_bytes(get(
            self.buffer.as_ref(),
            field::SRC_STAG,
        )))
    }

    /// Data Source Tagged Offset.
    #[inline]
    pub fn src_to(&self) -> u64 {
        u64::from_be_bytes(get(self.buffer.as_ref(), field::SRC_TO))
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ReadRequest<T> {
    /// Sets the Data Sink STag.
    #[inline]
    pub fn set_sink_stag(&mut self, value: Stag) {
        put(
            self.buffer.as_mut(),
            field::SINK_STAG,
            &value.0.to_be_bytes(),
        );
    }

    /// Sets the Data Sink Tagged Offset.
    #[inline]
    pub fn set_sink_to(&mut self, value: u64) {
        put(self.buffer.as_mut(), field::SINK_TO, &value.to_be_bytes());
    }

    /// Sets the RDMA Read Message Size.
    #[inline]
    pub fn set_read_size(&mut self, value: u32) {
        put(self.buffer.as_mut(), field::READ_SIZE, &value.to_be_bytes());
    }

    /// Sets the Data Source STag.
    #[inline]
    pub fn set_src_stag(&mut self, value: Stag) {
        put(
            self.buffer.as_mut(),
            field::SRC_STAG,
            &value.0.to_be_bytes(),
        );
    }

    /// Sets the Data Source Tagged Offset.
    #[inline]
    pub fn set_src_to(&mut self, value: u64) {
        put(self.buffer.as_mut(), field::SRC_TO, &value.to_be_bytes());
    }
}

/// A parsed RDMA Read Request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadRequestRepr {
    /// Data Sink STag: the requester's buffer for the response.
    pub sink_stag: Stag,
    /// Data Sink Tagged Offset.
    pub sink_to: u64,
    /// RDMA Read Message Size: bytes to read (zero is allowed and is how an
    /// MPA v2 "RTR" zero-length read looks).
    pub read_size: u32,
    /// Data Source STag: the responder's buffer to read from.
    pub src_stag: Stag,
    /// Data Source Tagged Offset.
    pub src_to: u64,
}

impl ReadRequestRepr {
    /// Reads the fields. Every bit pattern is a well-formed header; whether
    /// the STags and offsets are valid is for the responder to check.
    ///
    /// # Errors
    ///
    /// None today; the `Result` keeps the signature of the other `parse`s.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &ReadRequest<&T>) -> Result<Self, DecodeError> {
        Ok(Self {
            sink_stag: header.sink_stag(),
            sink_to: header.sink_to(),
            read_size: header.read_size(),
            src_stag: header.src_stag(),
            src_to: header.src_to(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`HEADER_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the header into the start of `buf`, returning [`HEADER_LEN`].
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than [`HEADER_LEN`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(hdr) = buf.get_mut(..HEADER_LEN) else {
            return Err(EncodeError::BufferTooSmall {
                what: WHAT,
                needed: HEADER_LEN,
                got,
            });
        };
        let mut view = ReadRequest::new_unchecked(hdr);
        view.set_sink_stag(self.sink_stag);
        view.set_sink_to(self.sink_to);
        view.set_read_size(self.read_size);
        view.set_src_stag(self.src_stag);
        view.set_src_to(self.src_to);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// rping-crc-p2p.txt frame 11 (Read Request, QN 1, MSN 1, MO 0):
    /// Data Sink STag 0x0bde1b00, TO 0x000056315a3ec450, size 64,
    /// Data Source STag 0xb5ff1b00, TO 0x000055e9c6f8de10.
    pub(crate) const CRC_P2P_FRAME_11: [u8; 28] = [
        0x0b, 0xde, 0x1b, 0x00, 0x00, 0x00, 0x56, 0x31, 0x5a, 0x3e, 0xc4, 0x50, 0x00, 0x00, 0x00,
        0x40, 0xb5, 0xff, 0x1b, 0x00, 0x00, 0x00, 0x55, 0xe9, 0xc6, 0xf8, 0xde, 0x10,
    ];

    /// rping.txt frame 9: sink 0xff05cf00 / 0x000055caf0615450, size 64,
    /// source 0x97847600 / 0x0000555c000bde10.
    const RPING_FRAME_9: ReadRequestRepr = ReadRequestRepr {
        sink_stag: Stag(0xff05_cf00),
        sink_to: 0x0000_55ca_f061_5450,
        read_size: 64,
        src_stag: Stag(0x9784_7600),
        src_to: 0x0000_555c_000b_de10,
    };

    #[test]
    fn golden_rping_crc_p2p() {
        let view = ReadRequest::new_checked(&CRC_P2P_FRAME_11[..]).unwrap();
        let repr = ReadRequestRepr::parse(&view).unwrap();
        assert_eq!(
            repr,
            ReadRequestRepr {
                sink_stag: Stag(0x0bde_1b00),
                sink_to: 0x0000_5631_5a3e_c450,
                read_size: 64,
                src_stag: Stag(0xb5ff_1b00),
                src_to: 0x0000_55e9_c6f8_de10,
            }
        );
        let mut out = [0u8; HEADER_LEN];
        assert_eq!(repr.emit(&mut out), Ok(HEADER_LEN));
        assert_eq!(out, CRC_P2P_FRAME_11);
    }

    #[test]
    fn golden_rping() {
        let mut out = [0u8; HEADER_LEN];
        RPING_FRAME_9.emit(&mut out).unwrap();
        assert_eq!(
            out[..],
            [
                0xff, 0x05, 0xcf, 0x00, 0x00, 0x00, 0x55, 0xca, 0xf0, 0x61, 0x54, 0x50, 0, 0, 0,
                64, 0x97, 0x84, 0x76, 0x00, 0x00, 0x00, 0x55, 0x5c, 0x00, 0x0b, 0xde, 0x10,
            ]
        );
        let view = ReadRequest::new_checked(&out[..]).unwrap();
        assert_eq!(ReadRequestRepr::parse(&view), Ok(RPING_FRAME_9));
    }

    #[test]
    fn truncated_at_every_length() {
        for n in 0..HEADER_LEN {
            assert_eq!(
                ReadRequest::new_checked(&CRC_P2P_FRAME_11[..n]),
                Err(DecodeError::Truncated {
                    what: WHAT,
                    needed: HEADER_LEN,
                    got: n
                })
            );
            let mut out = vec![0u8; n];
            assert!(RPING_FRAME_9.emit(&mut out).is_err());
        }
        // An unchecked view of a short buffer reads zeroes, never panics.
        let view = ReadRequest::new_unchecked(&CRC_P2P_FRAME_11[..5]);
        assert_eq!(view.src_to(), 0);
    }

    proptest! {
        #[test]
        fn roundtrip(a in any::<u32>(), b in any::<u64>(), c in any::<u32>(), d in any::<u32>(), e in any::<u64>()) {
            let repr = ReadRequestRepr { sink_stag: Stag(a), sink_to: b, read_size: c, src_stag: Stag(d), src_to: e };
            let mut buf = [0u8; HEADER_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(repr.buffer_len()));
            let view = ReadRequest::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(ReadRequestRepr::parse(&view), Ok(repr));
        }
    }
}
