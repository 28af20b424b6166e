//! Immediate Data messages (RFC 7306).
//!
//! An Immediate Data message (opcode 8) or Immediate Data with Solicited
//! Event message (opcode 9) carries exactly 8 bytes of data that the
//! receiving RDMAP hands to the ULP in the completion, not in a receive
//! buffer's memory. It is an untagged DDP message on queue 0 (the Send
//! queue, sharing its MSN sequence), so the ULPDU is 18 + 8 = 26 bytes:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |                 Immediate Data (64 bits)                      |
//! +                                                               +
//! |                                                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! The 8 bytes are opaque: no byte order is implied. (The verbs API's 32-bit
//! `imm_data` fits in them; how it is laid out is the ULP's business.)
//!
//! There is no "Send with Immediate" or "RDMA Write with Immediate" opcode.
//! RFC 7306 expresses them as two messages: a Send (or RDMA Write) followed,
//! on the same stream, by an Immediate Data message. Because RDMAP completes
//! messages in order, the receiver sees the data of the first message before
//! it completes the Immediate Data message; with a solicited event wanted,
//! the second message is Immediate Data with Solicited Event.

use crate::{DecodeError, EncodeError};

/// Length of the Immediate Data header (the whole DDP payload).
pub const HEADER_LEN: usize = 8;

const WHAT: &str = "Immediate Data";

/// A zero-copy view of an Immediate Data header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImmediateData<T: AsRef<[u8]>> {
    buffer: T,
}

crate::view::fixed_len_view!(ImmediateData, HEADER_LEN, WHAT);

impl<T: AsRef<[u8]>> ImmediateData<T> {
    /// The 8 bytes of immediate data.
    #[inline]
    pub fn data(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        if let Some(src) = self.buffer.as_ref().get(..HEADER_LEN) {
            out.copy_from_slice(src);
        }
        out
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> ImmediateData<T> {
    /// Sets the 8 bytes of immediate data.
    #[inline]
    pub fn set_data(&mut self, value: [u8; HEADER_LEN]) {
        if let Some(dst) = self.buffer.as_mut().get_mut(..HEADER_LEN) {
            dst.copy_from_slice(&value);
        }
    }
}

/// A parsed Immediate Data header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ImmediateDataRepr {
    /// The immediate data, as it appears on the wire.
    pub data: [u8; HEADER_LEN],
}

impl ImmediateDataRepr {
    /// Immediate data holding `value` in network (big-endian) byte order.
    pub const fn from_be_u64(value: u64) -> Self {
        Self {
            data: value.to_be_bytes(),
        }
    }

    /// The data read as a big-endian `u64`.
    pub const fn as_be_u64(&self) -> u64 {
        u64::from_be_bytes(self.data)
    }

    /// Reads the data.
    ///
    /// # Errors
    ///
    /// None today; the `Result` keeps the signature of the other `parse`s.
    pub fn parse<T: AsRef<[u8]> + ?Sized>(header: &ImmediateData<&T>) -> Result<Self, DecodeError> {
        Ok(Self {
            data: header.data(),
        })
    }

    /// Bytes [`Self::emit`] writes: [`HEADER_LEN`].
    #[inline]
    pub const fn buffer_len(&self) -> usize {
        HEADER_LEN
    }

    /// Writes the data into the start of `buf`, returning [`HEADER_LEN`].
    ///
    /// # Errors
    ///
    /// [`EncodeError::BufferTooSmall`] if `buf` is too short.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let got = buf.len();
        let Some(dst) = buf.get_mut(..HEADER_LEN) else {
            return Err(EncodeError::BufferTooSmall {
                what: WHAT,
                needed: HEADER_LEN,
                got,
            });
        };
        dst.copy_from_slice(&self.data);
        Ok(HEADER_LEN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden() {
        let bytes = [0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef];
        let view = ImmediateData::new_checked(&bytes[..]).unwrap();
        let repr = ImmediateDataRepr::parse(&view).unwrap();
        assert_eq!(repr, ImmediateDataRepr::from_be_u64(0x0123_4567_89ab_cdef));
        assert_eq!(repr.as_be_u64(), 0x0123_4567_89ab_cdef);
        let mut out = [0u8; 8];
        assert_eq!(repr.emit(&mut out), Ok(8));
        assert_eq!(out, bytes);
    }

    #[test]
    fn truncated_at_every_length() {
        let bytes = [0u8; 8];
        for n in 0..HEADER_LEN {
            assert_eq!(
                ImmediateData::new_checked(&bytes[..n]),
                Err(DecodeError::Truncated {
                    what: WHAT,
                    needed: HEADER_LEN,
                    got: n
                })
            );
            let mut out = vec![0u8; n];
            assert!(ImmediateDataRepr::default().emit(&mut out).is_err());
        }
        assert_eq!(ImmediateData::new_unchecked(&bytes[..3]).data(), [0; 8]);
    }

    proptest! {
        #[test]
        fn roundtrip(data in any::<[u8; 8]>()) {
            let repr = ImmediateDataRepr { data };
            let mut buf = [0u8; HEADER_LEN];
            prop_assert_eq!(repr.emit(&mut buf), Ok(HEADER_LEN));
            let view = ImmediateData::new_checked(&buf[..]).unwrap();
            prop_assert_eq!(ImmediateDataRepr::parse(&view), Ok(repr));
        }
    }
}
