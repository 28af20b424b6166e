//! Remote-buffer descriptors: what a peer needs to address a buffer with
//! RDMA Write, Read or an atomic, and a stable byte encoding to send it.
//!
//! ```
//! use softrdma_engine::{Access, Device, RemoteBuf};
//!
//! let dev = Device::open_default()?;
//! let pd = dev.alloc_pd();
//! let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
//! // Advertise the region (for example in a Send or in MPA private data) ...
//! let wire: [u8; RemoteBuf::ENCODED_LEN] = RemoteBuf::of_region(&mr).to_bytes();
//! // ... and on the other side turn it back into a descriptor.
//! let remote = RemoteBuf::from_bytes(&wire)?;
//! assert_eq!(remote.rkey, mr.rkey());
//! let first_half = remote.slice(0, 2048)?;
//! assert_eq!(first_half.len, 2048);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::mr::{MemoryRegion, MemoryWindow};

/// A buffer of the peer: start address (the Tagged Offset), steering tag and
/// length.
///
/// Encoded as 16 bytes, big-endian `{u64 addr, u32 rkey, u32 len}` — the
/// layout rping advertises its buffers in, so a descriptor can be read from
/// and sent to rdma-core programs that use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    /// Start address (Tagged Offset) of the buffer in the peer's STag space.
    pub addr: u64,
    /// The peer's steering tag (rkey).
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

/// Why a [`RemoteBuf`] could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RemoteBufError {
    /// The encoding is not 16 bytes.
    #[error("a remote-buffer descriptor is {expected} bytes, got {got}")]
    Length {
        /// 16.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// The buffer is longer than a descriptor can say (4 GiB - 1).
    #[error("a remote buffer of {0} bytes does not fit a descriptor (at most 4 GiB - 1)")]
    TooLong(u64),
    /// A slice outside the buffer.
    #[error("bytes {offset}..{offset}+{len} are outside a {buf_len}-byte remote buffer")]
    OutOfRange {
        /// Offset of the slice.
        offset: u64,
        /// Length of the slice.
        len: u64,
        /// Length of the buffer.
        buf_len: u32,
    },
}

impl RemoteBuf {
    /// Size of the encoding.
    pub const ENCODED_LEN: usize = 16;

    /// A descriptor of the whole of `mr` (its rkey, address and length).
    /// A region longer than 4 GiB - 1 is described up to that length; use
    /// [`RemoteBuf::try_of_region`] to refuse it instead.
    pub fn of_region(mr: &MemoryRegion) -> RemoteBuf {
        RemoteBuf {
            addr: mr.addr(),
            rkey: mr.rkey(),
            len: u32::try_from(mr.len()).unwrap_or(u32::MAX),
        }
    }

    /// A descriptor of the whole of `mr`, refusing regions of 4 GiB or more.
    pub fn try_of_region(mr: &MemoryRegion) -> Result<RemoteBuf, RemoteBufError> {
        let len = u64::try_from(mr.len()).unwrap_or(u64::MAX);
        Ok(RemoteBuf {
            addr: mr.addr(),
            rkey: mr.rkey(),
            len: u32::try_from(len).map_err(|_| RemoteBufError::TooLong(len))?,
        })
    }

    /// A descriptor of the range a memory window is bound to.
    pub fn of_window(mw: &MemoryWindow) -> Result<RemoteBuf, RemoteBufError> {
        let len = mw.len();
        Ok(RemoteBuf {
            addr: mw.addr(),
            rkey: mw.rkey(),
            len: u32::try_from(len).map_err(|_| RemoteBufError::TooLong(len))?,
        })
    }

    /// The part `[offset, offset + len)` of this buffer.
    pub fn slice(&self, offset: u64, len: u32) -> Result<RemoteBuf, RemoteBufError> {
        let out = || RemoteBufError::OutOfRange {
            offset,
            len: u64::from(len),
            buf_len: self.len,
        };
        let end = offset.checked_add(u64::from(len)).ok_or_else(out)?;
        if end > u64::from(self.len) {
            return Err(out());
        }
        Ok(RemoteBuf {
            addr: self.addr.checked_add(offset).ok_or_else(out)?,
            rkey: self.rkey,
            len,
        })
    }

    /// The 16-byte encoding: big-endian `{u64 addr, u32 rkey, u32 len}`.
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..8].copy_from_slice(&self.addr.to_be_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_be_bytes());
        b[12..].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decode the 16-byte encoding ([`RemoteBuf::to_bytes`]).
    pub fn from_bytes(b: &[u8]) -> Result<RemoteBuf, RemoteBufError> {
        let b: &[u8; Self::ENCODED_LEN] = b.try_into().map_err(|_| RemoteBufError::Length {
            expected: Self::ENCODED_LEN,
            got: b.len(),
        })?;
        let (addr, rest) = b.split_at(8);
        let (rkey, len) = rest.split_at(4);
        Ok(RemoteBuf {
            addr: u64::from_be_bytes(addr.try_into().unwrap_or_default()),
            rkey: u32::from_be_bytes(rkey.try_into().unwrap_or_default()),
            len: u32::from_be_bytes(len.try_into().unwrap_or_default()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_is_rpings_big_endian_layout() {
        let r = RemoteBuf {
            addr: 0x0000_55ca_f061_5450,
            rkey: 0xff05_cf00,
            len: 64,
        };
        let b = r.to_bytes();
        assert_eq!(
            b,
            [
                0x00, 0x00, 0x55, 0xca, 0xf0, 0x61, 0x54, 0x50, 0xff, 0x05, 0xcf, 0x00, 0, 0, 0, 64
            ]
        );
        assert_eq!(RemoteBuf::from_bytes(&b), Ok(r));
    }

    #[test]
    fn wrong_length_is_refused() {
        assert_eq!(
            RemoteBuf::from_bytes(&[0; 15]),
            Err(RemoteBufError::Length {
                expected: 16,
                got: 15
            })
        );
        assert!(RemoteBuf::from_bytes(&[0; 17]).is_err());
    }

    #[test]
    fn slices_stay_inside() {
        let r = RemoteBuf {
            addr: 1000,
            rkey: 7,
            len: 100,
        };
        assert_eq!(
            r.slice(10, 90),
            Ok(RemoteBuf {
                addr: 1010,
                rkey: 7,
                len: 90
            })
        );
        assert_eq!(r.slice(100, 0).map(|s| s.len), Ok(0));
        assert!(matches!(
            r.slice(10, 91),
            Err(RemoteBufError::OutOfRange { .. })
        ));
        assert!(r.slice(u64::MAX, 1).is_err());
        let top = RemoteBuf {
            addr: u64::MAX - 1,
            rkey: 1,
            len: 10,
        };
        assert!(top.slice(5, 1).is_err(), "address overflow");
    }
}
