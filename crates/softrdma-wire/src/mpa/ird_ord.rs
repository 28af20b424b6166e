//! The MPA v2 enhanced-mode IRD/ORD word (RFC 6581 section 5).
//!
//! When the H (enhanced) flag is set in an MPA Request or Reply, the first
//! four bytes of the private data carry the RDMA connection parameters; the
//! application's private data follows them.
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |A|B|           IRD             |C|D|           ORD             |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! * A (0x8000 of the IRD half): peer-to-peer connection model requested;
//! * B (0x4000 of the IRD half): a zero-length Send is acceptable as the
//!   Ready To Receive (RTR) message;
//! * C (0x8000 of the ORD half): a zero-length RDMA Write is acceptable as
//!   RTR;
//! * D (0x4000 of the ORD half): a zero-length RDMA Read is acceptable as RTR;
//! * IRD / ORD: 14-bit Inbound RDMA Read Queue Depth and Outbound RDMA Read
//!   Queue Depth, 0 to 0x3fff, big endian.
//!
//! Linux siw names these `MPA_V2_PEER_TO_PEER`, `MPA_V2_ZERO_LENGTH_RTR`,
//! `MPA_V2_RDMA_WRITE_RTR`, `MPA_V2_RDMA_READ_RTR` and `MPA_IRD_ORD_MASK`.
//!
//! On 0x3fff: this codec gives the all-ones value no special meaning; it is
//! the largest depth the field can carry ([`IRD_ORD_MAX`]). (We could not
//! check the RFC 6581 text for a "no limit" reading of 0x3fff; whoever
//! negotiates IRD/ORD should confirm it there before relying on one.)

use crate::{DecodeError, EncodeError};

/// Length of the IRD/ORD word at the start of enhanced-mode private data.
pub const IRD_ORD_LEN: usize = 4;

/// Largest IRD or ORD value (14 bits).
pub const IRD_ORD_MAX: u16 = 0x3fff;

/// A: peer-to-peer flag in the IRD half.
pub const FLAG_PEER_TO_PEER: u16 = 0x8000;
/// B: zero-length Send RTR flag in the IRD half.
pub const FLAG_SEND_RTR: u16 = 0x4000;
/// C: zero-length RDMA Write RTR flag in the ORD half.
pub const FLAG_WRITE_RTR: u16 = 0x8000;
/// D: zero-length RDMA Read RTR flag in the ORD half.
pub const FLAG_READ_RTR: u16 = 0x4000;

const WHAT: &str = "MPA v2 IRD/ORD";

/// The enhanced-mode connection parameters (RFC 6581 section 5).
///
/// # Example
///
/// ```
/// use softrdma_wire::mpa::IrdOrd;
///
/// // The private data of siw's MPA Request in rping-crc-p2p.
/// let p = IrdOrd::parse(&[0x80, 0x01, 0xc0, 0x01]).unwrap();
/// assert_eq!((p.ird, p.ord), (1, 1));
/// assert!(p.peer_to_peer && p.write_rtr && p.read_rtr && !p.send_rtr);
/// assert_eq!(p.to_bytes().unwrap(), [0x80, 0x01, 0xc0, 0x01]);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct IrdOrd {
    /// Inbound RDMA Read Queue Depth (0..=0x3fff).
    pub ird: u16,
    /// Outbound RDMA Read Queue Depth (0..=0x3fff).
    pub ord: u16,
    /// A: the sender asks for the peer-to-peer model (an RTR message before
    /// the first ULP message).
    pub peer_to_peer: bool,
    /// B: a zero-length Send may be the RTR message.
    pub send_rtr: bool,
    /// C: a zero-length RDMA Write may be the RTR message.
    pub write_rtr: bool,
    /// D: a zero-length RDMA Read may be the RTR message.
    pub read_rtr: bool,
}

impl IrdOrd {
    /// Decodes the word from the first four bytes of `private_data`
    /// (bytes after them are the application's and are ignored).
    ///
    /// # Errors
    ///
    /// [`DecodeError::Truncated`] if fewer than four bytes are given.
    pub fn parse(private_data: &[u8]) -> Result<Self, DecodeError> {
        let Some(&[i0, i1, o0, o1]) = private_data.first_chunk::<IRD_ORD_LEN>() else {
            return Err(DecodeError::Truncated {
                what: WHAT,
                needed: IRD_ORD_LEN,
                got: private_data.len(),
            });
        };
        let ird = u16::from_be_bytes([i0, i1]);
        let ord = u16::from_be_bytes([o0, o1]);
        Ok(Self {
            ird: ird & IRD_ORD_MAX,
            ord: ord & IRD_ORD_MAX,
            peer_to_peer: ird & FLAG_PEER_TO_PEER != 0,
            send_rtr: ird & FLAG_SEND_RTR != 0,
            write_rtr: ord & FLAG_WRITE_RTR != 0,
            read_rtr: ord & FLAG_READ_RTR != 0,
        })
    }

    /// Number of bytes [`IrdOrd::emit`] writes (always 4).
    pub const fn buffer_len(&self) -> usize {
        IRD_ORD_LEN
    }

    /// The four wire bytes.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] if `ird` or `ord` exceeds 0x3fff.
    pub fn to_bytes(&self) -> Result<[u8; IRD_ORD_LEN], EncodeError> {
        for (field, value) in [("IRD", self.ird), ("ORD", self.ord)] {
            if value > IRD_ORD_MAX {
                return Err(EncodeError::OutOfRange {
                    what: WHAT,
                    field,
                    value: u64::from(value),
                    max: u64::from(IRD_ORD_MAX),
                });
            }
        }
        let mut ird = self.ird;
        if self.peer_to_peer {
            ird |= FLAG_PEER_TO_PEER;
        }
        if self.send_rtr {
            ird |= FLAG_SEND_RTR;
        }
        let mut ord = self.ord;
        if self.write_rtr {
            ord |= FLAG_WRITE_RTR;
        }
        if self.read_rtr {
            ord |= FLAG_READ_RTR;
        }
        let [i0, i1] = ird.to_be_bytes();
        let [o0, o1] = ord.to_be_bytes();
        Ok([i0, i1, o0, o1])
    }

    /// Writes the word to the start of `buf`, returning 4.
    ///
    /// # Errors
    ///
    /// [`EncodeError::OutOfRange`] if `ird` or `ord` exceeds 0x3fff;
    /// [`EncodeError::BufferTooSmall`] if `buf` is shorter than 4 bytes.
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, EncodeError> {
        let bytes = self.to_bytes()?;
        let got = buf.len();
        let dst = buf
            .get_mut(..IRD_ORD_LEN)
            .ok_or(EncodeError::BufferTooSmall {
                what: WHAT,
                needed: IRD_ORD_LEN,
                got,
            })?;
        dst.copy_from_slice(&bytes);
        Ok(IRD_ORD_LEN)
    }

    /// Whether any RTR flag (B, C or D) is set.
    pub const fn any_rtr(&self) -> bool {
        self.send_rtr || self.write_rtr || self.read_rtr
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn golden_rping() {
        // rping.txt: Request and Reply private data 00010001.
        let p = IrdOrd::parse(&[0x00, 0x01, 0x00, 0x01]).unwrap();
        assert_eq!(
            p,
            IrdOrd {
                ird: 1,
                ord: 1,
                ..IrdOrd::default()
            }
        );
        assert!(!p.any_rtr());
    }

    #[test]
    fn golden_ib_write_bw() {
        // ib_write_bw.txt: private data 00000000.
        assert_eq!(IrdOrd::parse(&[0; 4]).unwrap(), IrdOrd::default());
    }

    #[test]
    fn golden_rping_crc_p2p() {
        // rping-crc-p2p.txt Request: 8001c001 (P2P, Write RTR + Read RTR).
        let req = IrdOrd::parse(&[0x80, 0x01, 0xc0, 0x01]).unwrap();
        assert_eq!(
            req,
            IrdOrd {
                ird: 1,
                ord: 1,
                peer_to_peer: true,
                send_rtr: false,
                write_rtr: true,
                read_rtr: true,
            }
        );
        // Reply: 80018001 (P2P, the responder picked Write RTR).
        let rep = IrdOrd::parse(&[0x80, 0x01, 0x80, 0x01]).unwrap();
        assert_eq!(
            rep,
            IrdOrd {
                ird: 1,
                ord: 1,
                peer_to_peer: true,
                send_rtr: false,
                write_rtr: true,
                read_rtr: false,
            }
        );
        assert_eq!(req.to_bytes().unwrap(), [0x80, 0x01, 0xc0, 0x01]);
        assert_eq!(rep.to_bytes().unwrap(), [0x80, 0x01, 0x80, 0x01]);
    }

    #[test]
    fn trailing_private_data_is_ignored() {
        let p = IrdOrd::parse(&[0x40, 0x10, 0x00, 0x20, 0xde, 0xad]).unwrap();
        assert_eq!((p.ird, p.ord, p.send_rtr), (0x10, 0x20, true));
    }

    #[test]
    fn truncated_at_every_length() {
        let bytes = [0x80, 0x01, 0xc0, 0x01];
        for n in 0..IRD_ORD_LEN {
            assert_eq!(
                IrdOrd::parse(&bytes[..n]),
                Err(DecodeError::Truncated {
                    what: WHAT,
                    needed: 4,
                    got: n
                })
            );
        }
    }

    #[test]
    fn out_of_range_values_are_refused() {
        let p = IrdOrd {
            ird: 0x4000,
            ..IrdOrd::default()
        };
        assert!(matches!(
            p.to_bytes(),
            Err(EncodeError::OutOfRange {
                field: "IRD",
                value: 0x4000,
                max: 0x3fff,
                ..
            })
        ));
        let p = IrdOrd {
            ord: 0xffff,
            ..IrdOrd::default()
        };
        assert!(matches!(
            p.emit(&mut [0; 4]),
            Err(EncodeError::OutOfRange { field: "ORD", .. })
        ));
        let p = IrdOrd {
            ird: IRD_ORD_MAX,
            ord: IRD_ORD_MAX,
            ..IrdOrd::default()
        };
        assert_eq!(p.to_bytes().unwrap(), [0x3f, 0xff, 0x3f, 0xff]);
    }

    #[test]
    fn emit_needs_four_bytes() {
        assert!(matches!(
            IrdOrd::default().emit(&mut [0; 3]),
            Err(EncodeError::BufferTooSmall {
                needed: 4,
                got: 3,
                ..
            })
        ));
        let mut buf = [0xaa; 6];
        assert_eq!(IrdOrd::default().emit(&mut buf), Ok(4));
        assert_eq!(buf, [0, 0, 0, 0, 0xaa, 0xaa]);
    }

    fn arb_ird_ord() -> impl Strategy<Value = IrdOrd> {
        (
            0..=IRD_ORD_MAX,
            0..=IRD_ORD_MAX,
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(ird, ord, a, b, c, d)| IrdOrd {
                ird,
                ord,
                peer_to_peer: a,
                send_rtr: b,
                write_rtr: c,
                read_rtr: d,
            })
    }

    proptest! {
        #[test]
        fn round_trip(p in arb_ird_ord()) {
            let bytes = p.to_bytes().unwrap();
            prop_assert_eq!(IrdOrd::parse(&bytes).unwrap(), p);
        }

        #[test]
        fn every_word_decodes_and_re_encodes(bytes in any::<[u8; 4]>()) {
            let p = IrdOrd::parse(&bytes).unwrap();
            prop_assert_eq!(p.to_bytes().unwrap(), bytes);
        }
    }
}
