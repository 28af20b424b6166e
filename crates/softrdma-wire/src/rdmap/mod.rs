//! RDMAP (RFC 5040, RFC 7306).
//!
//! RDMAP rides in DDP segments: its 8-bit control field is carried in the
//! DDP header's `RsvdULP[0:7]` (the second byte of every DDP segment), and the
//! untagged header's `RsvdULP[8:39]` carries the Invalidate STag of the Send
//! with Invalidate variants (reserved, zero, otherwise). RFC 5040 section 4.2:
//!
//! ```text
//!  0                   1                   2                   3
//!  0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 0 1
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |T|L| Resrv | DV| RV|R| Opcode  |                               |
//! |               |   |s|         |     Invalidate STag           |
//! |               |   |v|         |                               |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! |  Invalidate STag (cont)       |
//! +-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+-+
//! ```
//!
//! `RV` is the RDMAP version (2 bits, 1), `Rsv` two reserved bits (sent as
//! zero, not checked on receipt), `Opcode` four bits (RFC 5040 section 4.3
//! and RFC 7306, see [`Opcode`]).
//!
//! The messages with an RDMAP header of their own live in the submodules:
//! [`read_request`], [`terminate`], [`atomic`] and [`immediate`].
//! [`crate::ulpdu`] puts DDP and RDMAP together.

use core::fmt;

use crate::DecodeError;
use crate::ddp::{QN_ATOMIC_RESPONSE, QN_READ_REQUEST, QN_SEND, QN_TERMINATE, Qn};

pub mod atomic;
pub mod immediate;
pub mod read_request;
pub mod terminate;

/// The RDMAP version this implementation speaks (RFC 5040 section 4.2).
pub const RDMAP_VERSION: u8 = 1;

/// The version bits of the RDMAP control field.
pub const VERSION_MASK: u8 = 0xc0;

/// The reserved bits of the RDMAP control field.
pub const RESERVED_MASK: u8 = 0x30;

/// The opcode bits of the RDMAP control field.
pub const OPCODE_MASK: u8 = 0x0f;

/// An RDMAP message opcode (RFC 5040 section 4.3, RFC 7306).
///
/// | value | message | model | queue |
/// |---|---|---|---|
/// | 0 | RDMA Write | tagged | |
/// | 1 | RDMA Read Request | untagged | 1 |
/// | 2 | RDMA Read Response | tagged | |
/// | 3 | Send | untagged | 0 |
/// | 4 | Send with Invalidate | untagged | 0 |
/// | 5 | Send with Solicited Event | untagged | 0 |
/// | 6 | Send with Solicited Event and Invalidate | untagged | 0 |
/// | 7 | Terminate | untagged | 2 |
/// | 8 | Immediate Data (RFC 7306) | untagged | 0 |
/// | 9 | Immediate Data with Solicited Event (RFC 7306) | untagged | 0 |
/// | 10 | Atomic Request (RFC 7306) | untagged | 1 |
/// | 11 | Atomic Response (RFC 7306) | untagged | 3 |
///
/// Values 12 to 15 are reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Opcode {
    /// RDMA Write: tagged data into the peer's advertised buffer.
    RdmaWrite = 0,
    /// RDMA Read Request: asks the peer to send an RDMA Read Response.
    RdmaReadRequest = 1,
    /// RDMA Read Response: tagged data into the requester's sink buffer.
    RdmaReadResponse = 2,
    /// Send: untagged data into the peer's next posted receive buffer.
    Send = 3,
    /// Send with Invalidate: a Send that also invalidates an STag at the peer.
    SendWithInvalidate = 4,
    /// Send with Solicited Event.
    SendWithSolicitedEvent = 5,
    /// Send with Solicited Event and Invalidate.
    SendWithSolicitedEventAndInvalidate = 6,
    /// Terminate: reports a fatal error and ends the stream.
    Terminate = 7,
    /// Immediate Data (RFC 7306): 8 bytes delivered with a completion.
    ImmediateData = 8,
    /// Immediate Data with Solicited Event (RFC 7306).
    ImmediateDataWithSolicitedEvent = 9,
    /// Atomic Request (RFC 7306).
    AtomicRequest = 10,
    /// Atomic Response (RFC 7306).
    AtomicResponse = 11,
}

/// Where the payload of a message goes at the receiver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadPlacement {
    /// Placed directly at STag/TO (RDMA Write, RDMA Read Response).
    Tagged,
    /// Placed directly into the next posted receive buffer at MO (the Send
    /// variants).
    Untagged,
    /// Not placed: the payload is an RDMAP header that the protocol consumes
    /// (Read Request, Terminate, Atomic Request/Response, Immediate Data).
    Consumed,
}

impl Opcode {
    /// Every opcode, in numeric order.
    pub const ALL: [Opcode; 12] = [
        Opcode::RdmaWrite,
        Opcode::RdmaReadRequest,
        Opcode::RdmaReadResponse,
        Opcode::Send,
        Opcode::SendWithInvalidate,
        Opcode::SendWithSolicitedEvent,
        Opcode::SendWithSolicitedEventAndInvalidate,
        Opcode::Terminate,
        Opcode::ImmediateData,
        Opcode::ImmediateDataWithSolicitedEvent,
        Opcode::AtomicRequest,
        Opcode::AtomicResponse,
    ];

    /// The opcode with wire value `value` (the low four bits of the control
    /// field), or `None` for a reserved value (12 to 15) or one above 15.
    pub const fn from_u8(value: u8) -> Option<Opcode> {
        Some(match value {
            0 => Opcode::RdmaWrite,
            1 => Opcode::RdmaReadRequest,
            2 => Opcode::RdmaReadResponse,
            3 => Opcode::Send,
            4 => Opcode::SendWithInvalidate,
            5 => Opcode::SendWithSolicitedEvent,
            6 => Opcode::SendWithSolicitedEventAndInvalidate,
            7 => Opcode::Terminate,
            8 => Opcode::ImmediateData,
            9 => Opcode::ImmediateDataWithSolicitedEvent,
            10 => Opcode::AtomicRequest,
            11 => Opcode::AtomicResponse,
            _ => return None,
        })
    }

    /// The wire value.
    #[inline]
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The message name as the RFCs spell it (for dissectors and logs).
    pub const fn name(self) -> &'static str {
        match self {
            Opcode::RdmaWrite => "RDMA Write",
            Opcode::RdmaReadRequest => "RDMA Read Request",
            Opcode::RdmaReadResponse => "RDMA Read Response",
            Opcode::Send => "Send",
            Opcode::SendWithInvalidate => "Send with Invalidate",
            Opcode::SendWithSolicitedEvent => "Send with Solicited Event",
            Opcode::SendWithSolicitedEventAndInvalidate => {
                "Send with Solicited Event and Invalidate"
            }
            Opcode::Terminate => "Terminate",
            Opcode::ImmediateData => "Immediate Data",
            Opcode::ImmediateDataWithSolicitedEvent => "Immediate Data with Solicited Event",
            Opcode::AtomicRequest => "Atomic Request",
            Opcode::AtomicResponse => "Atomic Response",
        }
    }

    /// Whether the message uses the DDP tagged buffer model (`T` = 1).
    #[inline]
    pub const fn is_tagged(self) -> bool {
        matches!(self, Opcode::RdmaWrite | Opcode::RdmaReadResponse)
    }

    /// The untagged queue the message travels on, or `None` for the tagged
    /// messages.
    pub const fn queue_number(self) -> Option<Qn> {
        match self {
            Opcode::RdmaWrite | Opcode::RdmaReadResponse => None,
            Opcode::Send
            | Opcode::SendWithInvalidate
            | Opcode::SendWithSolicitedEvent
            | Opcode::SendWithSolicitedEventAndInvalidate
            | Opcode::ImmediateData
            | Opcode::ImmediateDataWithSolicitedEvent => Some(QN_SEND),
            Opcode::RdmaReadRequest | Opcode::AtomicRequest => Some(QN_READ_REQUEST),
            Opcode::Terminate => Some(QN_TERMINATE),
            Opcode::AtomicResponse => Some(QN_ATOMIC_RESPONSE),
        }
    }

    /// Whether the untagged header's `RsvdULP[8:39]` carries an Invalidate
    /// STag (Send with Invalidate, Send with Solicited Event and Invalidate).
    #[inline]
    pub const fn has_invalidate_stag(self) -> bool {
        matches!(
            self,
            Opcode::SendWithInvalidate | Opcode::SendWithSolicitedEventAndInvalidate
        )
    }

    /// Whether the message asks for a solicited event at the receiver.
    #[inline]
    pub const fn is_solicited(self) -> bool {
        matches!(
            self,
            Opcode::SendWithSolicitedEvent
                | Opcode::SendWithSolicitedEventAndInvalidate
                | Opcode::ImmediateDataWithSolicitedEvent
        )
    }

    /// Whether this is one of the four Send variants.
    #[inline]
    pub const fn is_send(self) -> bool {
        matches!(
            self,
            Opcode::Send
                | Opcode::SendWithInvalidate
                | Opcode::SendWithSolicitedEvent
                | Opcode::SendWithSolicitedEventAndInvalidate
        )
    }

    /// Where the message's payload goes at the receiver.
    pub const fn payload_placement(self) -> PayloadPlacement {
        match self {
            Opcode::RdmaWrite | Opcode::RdmaReadResponse => PayloadPlacement::Tagged,
            Opcode::Send
            | Opcode::SendWithInvalidate
            | Opcode::SendWithSolicitedEvent
            | Opcode::SendWithSolicitedEventAndInvalidate => PayloadPlacement::Untagged,
            Opcode::RdmaReadRequest
            | Opcode::Terminate
            | Opcode::ImmediateData
            | Opcode::ImmediateDataWithSolicitedEvent
            | Opcode::AtomicRequest
            | Opcode::AtomicResponse => PayloadPlacement::Consumed,
        }
    }
}

impl fmt::Display for Opcode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Builds the RDMAP control field for `opcode`: version [`RDMAP_VERSION`],
/// zero reserved bits.
///
/// ```
/// use softrdma_wire::rdmap::{control_byte, Opcode};
/// assert_eq!(control_byte(Opcode::Send), 0x43);
/// ```
#[inline]
pub const fn control_byte(opcode: Opcode) -> u8 {
    (RDMAP_VERSION << 6) | opcode.as_u8()
}

/// Parses an RDMAP control field (the DDP header's `RsvdULP[0:7]`). The
/// reserved bits are ignored.
///
/// # Errors
///
/// [`DecodeError::BadVersion`] if the version is not [`RDMAP_VERSION`],
/// [`DecodeError::InvalidField`] (field `"opcode"`) for a reserved opcode.
pub fn parse_control(byte: u8) -> Result<Opcode, DecodeError> {
    let version = (byte & VERSION_MASK) >> 6;
    if version != RDMAP_VERSION {
        return Err(DecodeError::BadVersion {
            what: "RDMAP control",
            version,
        });
    }
    let raw = byte & OPCODE_MASK;
    Opcode::from_u8(raw).ok_or(DecodeError::InvalidField {
        what: "RDMAP control",
        field: "opcode",
        value: u64::from(raw),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcode_values_roundtrip() {
        for (i, op) in Opcode::ALL.iter().enumerate() {
            assert_eq!(op.as_u8() as usize, i);
            assert_eq!(Opcode::from_u8(op.as_u8()), Some(*op));
            assert_eq!(parse_control(control_byte(*op)), Ok(*op));
        }
        for raw in 12..=255u8 {
            assert_eq!(Opcode::from_u8(raw), None);
        }
    }

    #[test]
    fn golden_control_bytes_from_captures() {
        // rping.txt: 0x43 Send, 0x41 Read Request, 0x42 Read Response, 0x40 Write.
        assert_eq!(parse_control(0x43), Ok(Opcode::Send));
        assert_eq!(parse_control(0x41), Ok(Opcode::RdmaReadRequest));
        assert_eq!(parse_control(0x42), Ok(Opcode::RdmaReadResponse));
        assert_eq!(parse_control(0x40), Ok(Opcode::RdmaWrite));
        // Reserved bits are not checked.
        assert_eq!(parse_control(0x73), Ok(Opcode::Send));
    }

    #[test]
    fn bad_version_and_reserved_opcodes() {
        for version in [0u8, 2, 3] {
            assert_eq!(
                parse_control((version << 6) | 3),
                Err(DecodeError::BadVersion {
                    what: "RDMAP control",
                    version
                })
            );
        }
        for raw in 12..16u8 {
            assert!(matches!(
                parse_control(0x40 | raw),
                Err(DecodeError::InvalidField {
                    field: "opcode",
                    ..
                })
            ));
        }
    }

    #[test]
    fn per_opcode_properties_are_consistent() {
        for op in Opcode::ALL {
            assert_eq!(op.is_tagged(), op.queue_number().is_none());
            assert_eq!(
                op.is_tagged(),
                op.payload_placement() == PayloadPlacement::Tagged
            );
            if op.has_invalidate_stag() || op.is_send() {
                assert_eq!(op.payload_placement(), PayloadPlacement::Untagged);
                assert_eq!(op.queue_number(), Some(QN_SEND));
            }
            assert!(!op.name().is_empty());
        }
        assert_eq!(Opcode::Terminate.queue_number(), Some(QN_TERMINATE));
        assert_eq!(Opcode::RdmaReadRequest.queue_number(), Some(Qn(1)));
        assert_eq!(Opcode::AtomicResponse.queue_number(), Some(Qn(3)));
        assert_eq!(
            Opcode::SendWithSolicitedEventAndInvalidate.to_string(),
            "Send with Solicited Event and Invalidate"
        );
    }
}
