//! MPA connection setup (RFC 5044 section 7, RFC 6581).
//!
//! Two pieces live here:
//!
//! * [`Frame`] / [`FrameRepr`]: the MPA Request and Reply frames exchanged on
//!   a new TCP connection before it carries FPDUs (a Reply with R set is a
//!   reject), and [`frame_len`], which finds a whole frame at the start of a
//!   byte stream incrementally;
//! * [`IrdOrd`]: the MPA v2 ("enhanced") IRD/ORD word that starts the private
//!   data when the H flag is set (RFC 6581 section 5).
//!
//! ```text
//!  key (16) | M C R H Res | Rev | PD_Length (16) | private data
//!                                                  └─ if H: |A|B| IRD | C|D| ORD | ULP private data
//! ```
//!
//! Bytes from a peer that cannot be a frame are reported as [`MpaError`];
//! values a caller cannot encode are [`crate::EncodeError`].

mod frame;
mod ird_ord;

pub use frame::{
    FLAG_CRC, FLAG_ENHANCED, FLAG_MARKERS, FLAG_REJECT, FLAGS_RESERVED, Frame, FrameKind,
    FrameRepr, HEADER_LEN, KEY_LEN, MPA_MAX_PRIVATE_DATA, REPLY_KEY, REQUEST_KEY, REVISION_1,
    REVISION_2, SIW_MAX_PRIVATE_DATA, frame_len,
};
pub use ird_ord::{
    FLAG_PEER_TO_PEER, FLAG_READ_RTR, FLAG_SEND_RTR, FLAG_WRITE_RTR, IRD_ORD_LEN, IRD_ORD_MAX,
    IrdOrd,
};

use crate::DecodeError;

/// An MPA Request or Reply frame from the peer that cannot be accepted.
///
/// A connection manager answers these with a reject (or by closing the
/// connection); they are never caused by local arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MpaError {
    /// The key is neither "MPA ID Req Frame" nor "MPA ID Rep Frame". When
    /// found from a stream prefix, only the bytes received so far are
    /// filled in; the rest are zero.
    #[error("MPA frame: bad key {key:02x?}")]
    BadKey {
        /// The key bytes received.
        key: [u8; KEY_LEN],
    },
    /// A Request key where a Reply was expected, or the other way round.
    #[error("MPA frame: expected {expected}, got {found}")]
    UnexpectedKind {
        /// The kind the receiver expected.
        expected: FrameKind,
        /// The kind the key names.
        found: FrameKind,
    },
    /// A revision other than 1 or 2.
    #[error("MPA frame: unsupported revision {revision}")]
    BadRevision {
        /// The revision received.
        revision: u8,
    },
    /// PD_Length is above the receiver's cap (at most 512).
    #[error("MPA frame: {len} bytes of private data, more than the {max} accepted")]
    PrivateDataTooLong {
        /// PD_Length as received.
        len: usize,
        /// The receiver's cap.
        max: usize,
    },
    /// The frame is shorter than its header says.
    #[error(transparent)]
    Malformed(#[from] DecodeError),
}
