//! A whole ULPDU: DDP header, RDMAP control field and RDMAP message body
//! (RFC 5041 section 4, RFC 5040 section 4, RFC 7306).
//!
//! A ULPDU is what MPA frames (RFC 5044 section 4): the bytes after the 2-byte
//! ULPDU length and before pad and CRC. With DDP over MPA every ULPDU is one
//! DDP segment:
//!
//! ```text
//!  tagged (RDMA Write, RDMA Read Response):
//!  +---------+---------+------+---------+-------------------------+
//!  | DDP ctl | RDMAP   | STag |   TO    | payload (placed at      |
//!  | T=1 L DV| ctl     | (32) |  (64)   | STag/TO)                |
//!  +---------+---------+------+---------+-------------------------+
//!     1 byte   1 byte   4       8        = 14-byte header
//!
//!  untagged (everything else):
//!  +---------+---------+----------+------+------+------+----------+
//!  | DDP ctl | RDMAP   | Inval.   |  QN  | MSN  |  MO  | body     |
//!  | T=0 L DV| ctl     | STag/0   | (32) | (32) | (32) |          |
//!  +---------+---------+----------+------+------+------+----------+
//!     1 byte   1 byte   4          4      4      4     = 18-byte header
//! ```
//!
//! The body is the payload of a Send variant (placed into the posted receive
//! buffer at MO), or an RDMAP header that the protocol consumes: the RDMA
//! Read Request (28 bytes), the Terminate header ([`crate::rdmap::terminate`]),
//! the Atomic Request (52) and
//! Response (12), Immediate Data (8).
//!
//! # Decoding
//!
//! [`UlpduRepr::parse`] checks, in this order, and never panics:
//!
//! 1. the DDP header is complete ([`UlpduError::Truncated`]);
//! 2. the DDP version is 1 ([`UlpduError::DdpVersion`]);
//! 3. the RDMAP version is 1 ([`UlpduError::RdmapVersion`]) and the opcode is
//!    defined ([`UlpduError::ReservedOpcode`]);
//! 4. the `T` flag matches the opcode ([`UlpduError::BufferModelMismatch`]);
//! 5. a fixed-size RDMAP header has exactly its size
//!    ([`UlpduError::BodyLength`]) and valid fields ([`UlpduError::Body`]).
//!
//! Reserved bits are ignored, as the RFCs require. It does not check that the
//! queue number suits the opcode, nor MSN/MO/STag validity: those are protocol
//! checks that answer with a specific Terminate, made by the caller with the
//! decoded fields ([`Opcode::queue_number`] says which queue is right).
//! [`UlpduError::term_error`] names the Terminate error for the failures the
//! RFCs give one ("Invalid DDP version", "Invalid RDMAP version",
//! "Unexpected OpCode").
//!
//! # Direct placement
//!
//! For the opcodes whose payload is placed ([`PayloadPlacement::Tagged`] and
//! [`PayloadPlacement::Untagged`]) `parse` accepts a buffer holding only the
//! header: [`crate::ddp::header_len`] of the first byte says how many bytes
//! to read before calling it, and the body comes back as an empty
//! [`UlpduBody::Payload`]; the payload can then be read straight to its
//! destination. For the other opcodes the whole ULPDU must be passed.
//!
//! # Encoding
//!
//! [`UlpduRepr::emit_header`] writes the DDP header, the RDMAP control field
//! and, for the consumed message types, the RDMAP header; it never reads the
//! payload of a [`UlpduBody::Payload`], so an engine gathering the payload
//! from registered memory passes an empty slice and writes
//! [`UlpduRepr::header_len`] bytes of header followed by its payload.
//! [`UlpduRepr::emit`] writes everything, payload included.
//!
//! ```
//! use softrdma_wire::ddp::{Msn, Stag};
//! use softrdma_wire::rdmap::Opcode;
//! use softrdma_wire::ulpdu::{UlpduBody, UlpduRepr};
//!
//! // A single-segment Send of 4 bytes, first message on the Send queue.
//! let send = UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, b"ping");
//! let mut buf = [0u8; 64];
//! let n = send.emit(&mut buf)?;
//! assert_eq!(n, 18 + 4);
//! assert_eq!(&buf[..2], &[0x41, 0x43]);
//!
//! let parsed = UlpduRepr::parse(&buf[..n])?;
//! assert_eq!(parsed, send);
//! assert_eq!(parsed.body, UlpduBody::Payload(b"ping"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::ddp::{
    self, DDP_VERSION, DdpHeaderRepr, DdpTaggedRepr, DdpUntaggedRepr, Msn, QN_ATOMIC_RESPONSE,
    QN_READ_REQUEST, QN_SEND, QN_TERMINATE, Qn, Stag, TAGGED_HEADER_LEN, Tagged, Untagged,
};
use crate::errcode::TermError;
use crate::rdmap::atomic::{
    self, AtomicRequest, AtomicRequestRepr, AtomicResponse, AtomicResponseRepr,
};
use crate::rdmap::immediate::{self, ImmediateData, ImmediateDataRepr};
use crate::rdmap::read_request::{self, ReadRequest, ReadRequestRepr};
use crate::rdmap::terminate::{Terminate, TerminateRepr};
use crate::rdmap::{self, Opcode, PayloadPlacement};
use crate::{DecodeError, EncodeError};

/// The DDP addressing fields of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DdpAddress {
    /// Tagged buffer model: the payload goes to `stag` at offset `to`.
    Tagged {
        /// Data sink Steering Tag.
        stag: Stag,
        /// Tagged Offset of the segment's first payload byte.
        to: u64,
    },
    /// Untagged buffer model: the segment belongs to message `msn` on queue
    /// `qn`, at byte offset `mo` within it.
    Untagged {
        /// Queue Number.
        qn: Qn,
        /// Message Sequence Number.
        msn: Msn,
        /// Message Offset.
        mo: u32,
    },
}

impl DdpAddress {
    /// Whether this is the tagged buffer model.
    #[inline]
    pub const fn is_tagged(&self) -> bool {
        matches!(self, Self::Tagged { .. })
    }
}

/// The body of a ULPDU, by message type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum UlpduBody<'a> {
    /// Data to place: RDMA Write, RDMA Read Response and the Send variants.
    Payload(&'a [u8]),
    /// RDMA Read Request header.
    ReadRequest(ReadRequestRepr),
    /// Terminate header, with the copied headers it carries.
    Terminate(TerminateRepr<'a>),
    /// Atomic Request header (RFC 7306).
    AtomicRequest(AtomicRequestRepr),
    /// Atomic Response header (RFC 7306).
    AtomicResponse(AtomicResponseRepr),
    /// Immediate Data (RFC 7306), for both Immediate Data opcodes.
    Immediate(ImmediateDataRepr),
}

impl UlpduBody<'_> {
    /// A short name of the body kind (for errors and dissectors).
    pub const fn kind(&self) -> &'static str {
        match self {
            Self::Payload(_) => "payload",
            Self::ReadRequest(_) => "RDMA Read Request",
            Self::Terminate(_) => "Terminate",
            Self::AtomicRequest(_) => "Atomic Request",
            Self::AtomicResponse(_) => "Atomic Response",
            Self::Immediate(_) => "Immediate Data",
        }
    }

    /// Whether this body kind is the one `opcode` carries.
    pub const fn suits(&self, opcode: Opcode) -> bool {
        match self {
            Self::Payload(_) => !matches!(opcode.payload_placement(), PayloadPlacement::Consumed),
            Self::ReadRequest(_) => matches!(opcode, Opcode::RdmaReadRequest),
            Self::Terminate(_) => matches!(opcode, Opcode::Terminate),
            Self::AtomicRequest(_) => matches!(opcode, Opcode::AtomicRequest),
            Self::AtomicResponse(_) => matches!(opcode, Opcode::AtomicResponse),
            Self::Immediate(_) => matches!(
                opcode,
                Opcode::ImmediateData | Opcode::ImmediateDataWithSolicitedEvent
            ),
        }
    }

    /// Length of the body on the wire.
    pub fn len(&self) -> usize {
        match self {
            Self::Payload(p) => p.len(),
            Self::Terminate(t) => t.buffer_len(),
            Self::ReadRequest(_) => read_request::HEADER_LEN,
            Self::AtomicRequest(_) => atomic::REQUEST_LEN,
            Self::AtomicResponse(_) => atomic::RESPONSE_LEN,
            Self::Immediate(_) => immediate::HEADER_LEN,
        }
    }

    /// Whether the body is empty on the wire (a zero-length payload).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A decoded ULPDU: one DDP segment carrying (part of) an RDMAP message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UlpduRepr<'a> {
    /// The RDMAP opcode.
    pub opcode: Opcode,
    /// The DDP `L` flag: this is the last segment of the message.
    pub last: bool,
    /// The DDP addressing fields; tagged exactly when
    /// [`Opcode::is_tagged`].
    pub address: DdpAddress,
    /// The Invalidate STag (`RsvdULP[8:39]`); `Some` exactly for the opcodes
    /// with [`Opcode::has_invalidate_stag`]. For other untagged messages the
    /// field is reserved: sent as zero, ignored on receipt.
    pub invalidate_stag: Option<Stag>,
    /// The body.
    pub body: UlpduBody<'a>,
}

/// Why bytes are not a valid ULPDU. [`UlpduError::term_error`] gives the
/// Terminate error to answer with, where the RFCs name one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UlpduError {
    /// The ULPDU is shorter than its DDP header.
    #[error("ULPDU truncated: DDP header needs {needed} bytes, have {got}")]
    Truncated {
        /// Bytes the header needs.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// The DDP version is not 1 (Terminate: DDP layer, tagged or untagged
    /// buffer error, "Invalid DDP version").
    #[error("unsupported DDP version {version} ({} header)", if *tagged { "tagged" } else { "untagged" })]
    DdpVersion {
        /// The `T` flag of the segment.
        tagged: bool,
        /// The version found.
        version: u8,
    },
    /// The RDMAP version is not 1 (Terminate: RDMAP layer, "Invalid RDMAP
    /// version").
    #[error("unsupported RDMAP version {version}")]
    RdmapVersion {
        /// The version found.
        version: u8,
    },
    /// The RDMAP opcode is reserved (Terminate: RDMAP layer, "Unexpected
    /// OpCode").
    #[error("reserved RDMAP opcode {opcode:#x}")]
    ReservedOpcode {
        /// The opcode found.
        opcode: u8,
    },
    /// The `T` flag does not match the opcode (Terminate: RDMAP layer,
    /// "Unexpected OpCode").
    #[error("{opcode} sent in the {} buffer model", if *tagged { "tagged" } else { "untagged" })]
    BufferModelMismatch {
        /// The opcode.
        opcode: Opcode,
        /// The `T` flag found.
        tagged: bool,
    },
    /// A fixed-size RDMAP header has the wrong length.
    #[error("{opcode}: body is {got} bytes, must be {expected}")]
    BodyLength {
        /// The opcode.
        opcode: Opcode,
        /// The length its header has.
        expected: usize,
        /// The length found.
        got: usize,
    },
    /// A field of the RDMAP header is invalid (for example a reserved
    /// atomic operation).
    #[error(transparent)]
    Body(DecodeError),
}

impl UlpduError {
    /// The Terminate error RFC 5040/5041 name for this cause, if there is
    /// one: the DDP and RDMAP version errors and "Unexpected OpCode". A
    /// truncated header or a malformed RDMAP header has no specific code;
    /// the caller picks one (for example
    /// [`TermError::RdmapOperationUnspecified`]).
    pub const fn term_error(&self) -> Option<TermError> {
        match self {
            Self::DdpVersion { tagged: true, .. } => Some(TermError::DdpTaggedInvalidVersion),
            Self::DdpVersion { tagged: false, .. } => Some(TermError::DdpUntaggedInvalidVersion),
            Self::RdmapVersion { .. } => Some(TermError::RdmapInvalidVersion),
            Self::ReservedOpcode { .. } | Self::BufferModelMismatch { .. } => {
                Some(TermError::RdmapUnexpectedOpcode)
            }
            Self::Truncated { .. } | Self::BodyLength { .. } | Self::Body(_) => None,
        }
    }
}

impl From<UlpduError> for DecodeError {
    fn from(e: UlpduError) -> Self {
        match e {
            UlpduError::Truncated { needed, got } => DecodeError::Truncated {
                what: "ULPDU",
                needed,
                got,
            },
            UlpduError::DdpVersion { version, .. } => DecodeError::BadVersion {
                what: "DDP header",
                version,
            },
            UlpduError::RdmapVersion { version } => DecodeError::BadVersion {
                what: "RDMAP control",
                version,
            },
            UlpduError::ReservedOpcode { opcode } => DecodeError::InvalidField {
                what: "RDMAP control",
                field: "opcode",
                value: u64::from(opcode),
            },
            UlpduError::BufferModelMismatch { opcode, .. } => DecodeError::InvalidField {
                what: "ULPDU",
                field: "T flag for opcode",
                value: u64::from(opcode.as_u8()),
            },
            UlpduError::BodyLength {
                opcode,
                expected,
                got,
            } => {
                if got < expected {
                    DecodeError::Truncated {
                        what: opcode.name(),
                        needed: expected,
                        got,
                    }
                } else {
                    DecodeError::InvalidField {
                        what: opcode.name(),
                        field: "length",
                        value: got as u64,
                    }
                }
            }
            UlpduError::Body(e) => e,
        }
    }
}

/// Why a [`UlpduRepr`] cannot be written: the caller's buffer is too small
/// or the value is inconsistent (local misuse, never peer input).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UlpduEncodeError {
    /// The buffer is too small.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The address's buffer model does not suit the opcode.
    #[error("{opcode} needs the {} buffer model", if opcode.is_tagged() { "tagged" } else { "untagged" })]
    BufferModelMismatch {
        /// The opcode.
        opcode: Opcode,
    },
    /// The body kind does not suit the opcode.
    #[error("{opcode} cannot carry a {body} body")]
    BodyMismatch {
        /// The opcode.
        opcode: Opcode,
        /// The body kind given.
        body: &'static str,
    },
    /// `invalidate_stag` is `Some` for an opcode without one, or `None` for
    /// one that needs it.
    #[error("{opcode}: Invalidate STag given where not allowed, or missing")]
    InvalidateStagMismatch {
        /// The opcode.
        opcode: Opcode,
    },
}

fn body_exact(opcode: Opcode, body: &[u8], expected: usize) -> Result<&[u8], UlpduError> {
    if body.len() != expected {
        return Err(UlpduError::BodyLength {
            opcode,
            expected,
            got: body.len(),
        });
    }
    Ok(body)
}

impl<'a> UlpduRepr<'a> {
    /// Decodes a ULPDU (see the [module documentation](self) for what is
    /// checked).
    ///
    /// # Errors
    ///
    /// A [`UlpduError`] saying what is wrong; `From<UlpduError>` turns it
    /// into a plain [`DecodeError`] where the cause does not matter.
    pub fn parse(ulpdu: &'a [u8]) -> Result<Self, UlpduError> {
        let got = ulpdu.len();
        let Some(&control) = ulpdu.first() else {
            return Err(UlpduError::Truncated {
                needed: TAGGED_HEADER_LEN,
                got,
            });
        };
        let header_len = ddp::header_len(control);
        let Some(body) = ulpdu.get(header_len..) else {
            return Err(UlpduError::Truncated {
                needed: header_len,
                got,
            });
        };
        let tagged = control & ddp::FLAG_TAGGED != 0;
        let version = control & ddp::VERSION_MASK;
        if version != DDP_VERSION {
            return Err(UlpduError::DdpVersion { tagged, version });
        }
        let last = control & ddp::FLAG_LAST != 0;
        let rdmap_control = ulpdu.get(1).copied().unwrap_or(0);
        let opcode = rdmap::parse_control(rdmap_control).map_err(|e| match e {
            DecodeError::BadVersion { version, .. } => UlpduError::RdmapVersion { version },
            _ => UlpduError::ReservedOpcode {
                opcode: rdmap_control & rdmap::OPCODE_MASK,
            },
        })?;
        if opcode.is_tagged() != tagged {
            return Err(UlpduError::BufferModelMismatch { opcode, tagged });
        }

        let (address, invalidate_stag) = if tagged {
            let view = Tagged::new_unchecked(ulpdu);
            (
                DdpAddress::Tagged {
                    stag: view.stag(),
                    to: view.to(),
                },
                None,
            )
        } else {
            let view = Untagged::new_unchecked(ulpdu);
            let inval = opcode
                .has_invalidate_stag()
                .then(|| Stag(view.rsvd_ulp_ext()));
            (
                DdpAddress::Untagged {
                    qn: view.qn(),
                    msn: view.msn(),
                    mo: view.mo(),
                },
                inval,
            )
        };

        let body = match opcode {
            Opcode::RdmaWrite
            | Opcode::RdmaReadResponse
            | Opcode::Send
            | Opcode::SendWithInvalidate
            | Opcode::SendWithSolicitedEvent
            | Opcode::SendWithSolicitedEventAndInvalidate => UlpduBody::Payload(body),
            Opcode::Terminate => {
                let view = Terminate::new_checked(body).map_err(UlpduError::Body)?;
                UlpduBody::Terminate(TerminateRepr::parse(&view).map_err(UlpduError::Body)?)
            }
            Opcode::RdmaReadRequest => {
                let b = body_exact(opcode, body, read_request::HEADER_LEN)?;
                let view = ReadRequest::new_checked(b).map_err(UlpduError::Body)?;
                UlpduBody::ReadRequest(ReadRequestRepr::parse(&view).map_err(UlpduError::Body)?)
            }
            Opcode::AtomicRequest => {
                let b = body_exact(opcode, body, atomic::REQUEST_LEN)?;
                let view = AtomicRequest::new_checked(b).map_err(UlpduError::Body)?;
                UlpduBody::AtomicRequest(AtomicRequestRepr::parse(&view).map_err(UlpduError::Body)?)
            }
            Opcode::AtomicResponse => {
                let b = body_exact(opcode, body, atomic::RESPONSE_LEN)?;
                let view = AtomicResponse::new_checked(b).map_err(UlpduError::Body)?;
                UlpduBody::AtomicResponse(
                    AtomicResponseRepr::parse(&view).map_err(UlpduError::Body)?,
                )
            }
            Opcode::ImmediateData | Opcode::ImmediateDataWithSolicitedEvent => {
                let b = body_exact(opcode, body, immediate::HEADER_LEN)?;
                let view = ImmediateData::new_checked(b).map_err(UlpduError::Body)?;
                UlpduBody::Immediate(ImmediateDataRepr::parse(&view).map_err(UlpduError::Body)?)
            }
        };

        Ok(Self {
            opcode,
            last,
            address,
            invalidate_stag,
            body,
        })
    }

    /// An RDMA Write or RDMA Read Response segment (`opcode` must be one of
    /// them; [`Self::emit`] checks).
    pub const fn tagged(
        opcode: Opcode,
        stag: Stag,
        to: u64,
        last: bool,
        payload: &'a [u8],
    ) -> Self {
        Self {
            opcode,
            last,
            address: DdpAddress::Tagged { stag, to },
            invalidate_stag: None,
            body: UlpduBody::Payload(payload),
        }
    }

    /// A segment of one of the four Send variants on queue 0 (`opcode` must
    /// be one of them; `invalidate_stag` must be `Some` exactly for the
    /// Invalidate variants).
    pub const fn send(
        opcode: Opcode,
        invalidate_stag: Option<Stag>,
        msn: Msn,
        mo: u32,
        last: bool,
        payload: &'a [u8],
    ) -> Self {
        Self {
            opcode,
            last,
            address: DdpAddress::Untagged {
                qn: QN_SEND,
                msn,
                mo,
            },
            invalidate_stag,
            body: UlpduBody::Payload(payload),
        }
    }

    /// An RDMA Read Request on queue 1.
    pub const fn read_request(msn: Msn, request: ReadRequestRepr) -> Self {
        Self::untagged_single(
            Opcode::RdmaReadRequest,
            QN_READ_REQUEST,
            msn,
            UlpduBody::ReadRequest(request),
        )
    }

    /// A Terminate message on queue 2.
    pub const fn terminate(msn: Msn, body: TerminateRepr<'a>) -> Self {
        Self::untagged_single(
            Opcode::Terminate,
            QN_TERMINATE,
            msn,
            UlpduBody::Terminate(body),
        )
    }

    /// An Atomic Request on queue 1.
    pub const fn atomic_request(msn: Msn, request: AtomicRequestRepr) -> Self {
        Self::untagged_single(
            Opcode::AtomicRequest,
            QN_READ_REQUEST,
            msn,
            UlpduBody::AtomicRequest(request),
        )
    }

    /// An Atomic Response on queue 3.
    pub const fn atomic_response(msn: Msn, response: AtomicResponseRepr) -> Self {
        Self::untagged_single(
            Opcode::AtomicResponse,
            QN_ATOMIC_RESPONSE,
            msn,
            UlpduBody::AtomicResponse(response),
        )
    }

    /// An Immediate Data message on queue 0 (with Solicited Event if
    /// `solicited`).
    pub const fn immediate(msn: Msn, data: ImmediateDataRepr, solicited: bool) -> Self {
        let opcode = if solicited {
            Opcode::ImmediateDataWithSolicitedEvent
        } else {
            Opcode::ImmediateData
        };
        Self::untagged_single(opcode, QN_SEND, msn, UlpduBody::Immediate(data))
    }

    const fn untagged_single(opcode: Opcode, qn: Qn, msn: Msn, body: UlpduBody<'a>) -> Self {
        Self {
            opcode,
            last: true,
            address: DdpAddress::Untagged { qn, msn, mo: 0 },
            invalidate_stag: None,
            body,
        }
    }

    /// The DDP header this ULPDU starts with (RsvdULP carrying the RDMAP
    /// control field and the Invalidate STag or zero).
    pub const fn ddp_header(&self) -> DdpHeaderRepr {
        let rsvd_ulp = rdmap::control_byte(self.opcode);
        match self.address {
            DdpAddress::Tagged { stag, to } => DdpHeaderRepr::Tagged(DdpTaggedRepr {
                last: self.last,
                rsvd_ulp,
                stag,
                to,
            }),
            DdpAddress::Untagged { qn, msn, mo } => DdpHeaderRepr::Untagged(DdpUntaggedRepr {
                last: self.last,
                rsvd_ulp,
                rsvd_ulp_ext: match self.invalidate_stag {
                    Some(s) => s.0,
                    None => 0,
                },
                qn,
                msn,
                mo,
            }),
        }
    }

    /// Bytes [`Self::emit_header`] writes: the DDP header, plus the RDMAP
    /// header for the message types whose body is consumed by RDMAP. For
    /// [`UlpduBody::Payload`] this is 14 or 18, whatever the payload.
    pub fn header_len(&self) -> usize {
        let ddp_len = self.ddp_header().buffer_len();
        match self.body {
            UlpduBody::Payload(_) => ddp_len,
            _ => ddp_len + self.body.len(),
        }
    }

    /// Bytes [`Self::emit`] writes: the whole ULPDU (the value of the MPA
    /// ULPDU length field).
    pub fn buffer_len(&self) -> usize {
        self.ddp_header().buffer_len() + self.body.len()
    }

    fn check(&self) -> Result<(), UlpduEncodeError> {
        let opcode = self.opcode;
        if self.address.is_tagged() != opcode.is_tagged() {
            return Err(UlpduEncodeError::BufferModelMismatch { opcode });
        }
        if !self.body.suits(opcode) {
            return Err(UlpduEncodeError::BodyMismatch {
                opcode,
                body: self.body.kind(),
            });
        }
        if self.invalidate_stag.is_some() != opcode.has_invalidate_stag() {
            return Err(UlpduEncodeError::InvalidateStagMismatch { opcode });
        }
        Ok(())
    }

    /// Writes the header ([`Self::header_len`] bytes) into the start of
    /// `buf`: DDP header with the RDMAP control field and, unless the body is
    /// a [`UlpduBody::Payload`], the RDMAP header. A payload is not read.
    ///
    /// # Errors
    ///
    /// [`UlpduEncodeError::Encode`] if `buf` is too short; the other
    /// variants if the value is inconsistent (address, body or Invalidate
    /// STag not suiting the opcode).
    pub fn emit_header(&self, buf: &mut [u8]) -> Result<usize, UlpduEncodeError> {
        self.check()?;
        let needed = self.header_len();
        let got = buf.len();
        let Some(out) = buf.get_mut(..needed) else {
            return Err(EncodeError::BufferTooSmall {
                what: "ULPDU header",
                needed,
                got,
            }
            .into());
        };
        let ddp_len = self.ddp_header().emit(out)?;
        let rest = out.get_mut(ddp_len..).unwrap_or_default();
        match &self.body {
            UlpduBody::Payload(_) => {}
            UlpduBody::ReadRequest(r) => {
                r.emit(rest)?;
            }
            UlpduBody::Terminate(t) => {
                t.emit(rest)?;
            }
            UlpduBody::AtomicRequest(r) => {
                r.emit(rest)?;
            }
            UlpduBody::AtomicResponse(r) => {
                r.emit(rest)?;
            }
            UlpduBody::Immediate(r) => {
                r.emit(rest)?;
            }
        }
        Ok(needed)
    }

    /// Writes the whole ULPDU ([`Self::buffer_len`] bytes), payload
    /// included, into the start of `buf`.
    ///
    /// # Errors
    ///
    /// As [`Self::emit_header`].
    pub fn emit(&self, buf: &mut [u8]) -> Result<usize, UlpduEncodeError> {
        self.check()?;
        let needed = self.buffer_len();
        let got = buf.len();
        if got < needed {
            return Err(EncodeError::BufferTooSmall {
                what: "ULPDU",
                needed,
                got,
            }
            .into());
        }
        let n = self.emit_header(buf)?;
        if let UlpduBody::Payload(p) = self.body
            && let Some(dst) = buf.get_mut(n..n + p.len())
        {
            dst.copy_from_slice(p);
        }
        Ok(needed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rdmap::terminate::TerminatedDdp;
    use proptest::prelude::*;

    /// The MPA FPDU around a ULPDU with CRC off: length, ULPDU, pad to 4.
    fn fpdu(ulpdu: &[u8]) -> Vec<u8> {
        let mut f = (ulpdu.len() as u16).to_be_bytes().to_vec();
        f.extend_from_slice(ulpdu);
        while !f.len().is_multiple_of(4) {
            f.push(0);
        }
        f
    }

    /// Checks a reconstructed ULPDU against the CRC tshark reports for it
    /// ("CRC check: 0x..." reads the four CRC bytes as a big-endian number).
    fn assert_capture_crc(ulpdu: &[u8], tshark_crc: u32) {
        let crc = crc32c::crc32c(&fpdu(ulpdu));
        assert_eq!(crc.to_le_bytes(), tshark_crc.to_be_bytes());
    }

    /// rping-crc-p2p.txt frame 8: the MPA v2 RTR, a zero-length RDMA Write,
    /// T=1 L=1, STag 0x00000001, TO 0, CRC 0xebd34c5f.
    const RTR_WRITE: [u8; 14] = [0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];

    /// rping-crc-p2p.txt frame 11: RDMA Read Request, QN 1, MSN 1, MO 0,
    /// "Reserved for use by the ULP: 4100000000", CRC 0xee63a0f7.
    fn crc_p2p_read_request() -> Vec<u8> {
        let mut u = vec![0x41, 0x41, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0];
        u.extend_from_slice(&[
            0x0b, 0xde, 0x1b, 0x00, 0x00, 0x00, 0x56, 0x31, 0x5a, 0x3e, 0xc4, 0x50, 0x00, 0x00,
            0x00, 0x40, 0xb5, 0xff, 0x1b, 0x00, 0x00, 0x00, 0x55, 0xe9, 0xc6, 0xf8, 0xde, 0x10,
        ]);
        u
    }

    #[test]
    fn golden_rtr_write_with_capture_crc() {
        assert_capture_crc(&RTR_WRITE, 0xebd3_4c5f);
        let u = UlpduRepr::parse(&RTR_WRITE).unwrap();
        assert_eq!(
            u,
            UlpduRepr::tagged(Opcode::RdmaWrite, Stag(1), 0, true, &[])
        );
        let mut out = [0u8; 14];
        assert_eq!(u.emit(&mut out), Ok(14));
        assert_eq!(out, RTR_WRITE);
    }

    #[test]
    fn golden_read_request_with_capture_crc() {
        let bytes = crc_p2p_read_request();
        assert_eq!(bytes.len(), 46);
        assert_capture_crc(&bytes, 0xee63_a0f7);
        let u = UlpduRepr::parse(&bytes).unwrap();
        let expected = UlpduRepr::read_request(
            Msn(1),
            ReadRequestRepr {
                sink_stag: Stag(0x0bde_1b00),
                sink_to: 0x0000_5631_5a3e_c450,
                read_size: 64,
                src_stag: Stag(0xb5ff_1b00),
                src_to: 0x0000_55e9_c6f8_de10,
            },
        );
        assert_eq!(u, expected);
        assert_eq!(u.header_len(), 46);
        let mut out = [0u8; 46];
        assert_eq!(expected.emit_header(&mut out), Ok(46));
        assert_eq!(out[..], bytes[..]);
    }

    #[test]
    fn every_read_request_of_the_crc_capture() {
        // rping-crc-p2p.txt frames 11, 19, 27: the same Read Request with
        // MSN 1, 2, 3 on QN 1; their CRCs pin down every byte.
        let base = crc_p2p_read_request();
        let request = match UlpduRepr::parse(&base).map(|u| u.body) {
            Ok(UlpduBody::ReadRequest(r)) => r,
            other => panic!("{other:?}"),
        };
        for (msn, crc) in [(1u32, 0xee63_a0f7u32), (2, 0x9f1e_eb19), (3, 0xb035_d243)] {
            let u = UlpduRepr::read_request(Msn(msn), request);
            let mut buf = [0u8; 46];
            assert_eq!(u.emit(&mut buf), Ok(46));
            assert_capture_crc(&buf, crc);
        }
    }

    #[test]
    fn golden_rping_send_write_read_response() {
        // rping.txt frame 8: Send, QN 0, MSN 1, MO 0, 16 bytes of data
        // (the rping {addr, rkey, size} exchange; the bytes are made up).
        let mut send = vec![0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
        send.extend_from_slice(&[0xa5; 16]);
        assert_eq!(send.len(), 34);
        let u = UlpduRepr::parse(&send).unwrap();
        assert_eq!(
            u,
            UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, &[0xa5; 16])
        );
        // rping.txt frame 10: Read Response, STag 0xff05cf00,
        // TO 0x000055caf0615450, 64 bytes.
        let mut rresp = vec![
            0xc1, 0x42, 0xff, 0x05, 0xcf, 0x00, 0x00, 0x00, 0x55, 0xca, 0xf0, 0x61, 0x54, 0x50,
        ];
        rresp.extend_from_slice(&[0x5a; 64]);
        assert_eq!(rresp.len(), 78);
        let u = UlpduRepr::parse(&rresp).unwrap();
        assert_eq!(u.opcode, Opcode::RdmaReadResponse);
        assert_eq!(
            u.address,
            DdpAddress::Tagged {
                stag: Stag(0xff05_cf00),
                to: 0x0000_55ca_f061_5450
            }
        );
        assert_eq!(u.header_len(), 14);
        assert_eq!(u.buffer_len(), 78);
        let mut out = vec![0u8; 78];
        assert_eq!(u.emit(&mut out), Ok(78));
        assert_eq!(out, rresp);
        // Header only: the payload is not read, and parse of just the
        // header gives an empty payload.
        let hdr_only = UlpduRepr::tagged(
            Opcode::RdmaReadResponse,
            Stag(0xff05_cf00),
            0x0000_55ca_f061_5450,
            true,
            &[],
        );
        let mut hdr = [0u8; 14];
        assert_eq!(hdr_only.emit_header(&mut hdr), Ok(14));
        assert_eq!(hdr[..], rresp[..14]);
        assert_eq!(UlpduRepr::parse(&hdr), Ok(hdr_only));
    }

    #[test]
    fn golden_segmented_send_from_ib_send_bw() {
        // ib_send_bw.txt frames 36, 39, 42: one 4096-byte Send in three
        // segments: (ULPDU len, L, MO) = (1442, 0, 0), (1442, 0, 1424),
        // (1266, 1, 2848), all MSN 1.
        for (len, last, mo) in [
            (1442usize, false, 0u32),
            (1442, false, 1424),
            (1266, true, 2848),
        ] {
            let payload = vec![0u8; len - 18];
            let u = UlpduRepr::send(Opcode::Send, None, Msn(1), mo, last, &payload);
            let mut buf = vec![0u8; len];
            assert_eq!(u.emit(&mut buf), Ok(len));
            assert_eq!(buf[0], if last { 0x41 } else { 0x01 });
            assert_eq!(buf[1], 0x43);
            assert_eq!(buf[14..18], mo.to_be_bytes());
            assert_eq!(UlpduRepr::parse(&buf), Ok(u));
        }
    }

    #[test]
    fn golden_terminate() {
        // What Linux siw sends for a Send with no receive posted: Terminate
        // on QN 2, MSN 1; DDP layer, Untagged Buffer Error, "no buffer";
        // M and D set, the 16-byte Send's payload length and DDP header.
        let bytes = [
            0x41, 0x47, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 0, // DDP/RDMAP
            0x12, 0x02, 0xc0, 0x00, // Terminate control
            0x00, 0x10, // DDP Segment Length
            0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0, // copied header
        ];
        let u = UlpduRepr::parse(&bytes).unwrap();
        assert_eq!(u.opcode, Opcode::Terminate);
        assert_eq!(
            u.address,
            DdpAddress::Untagged {
                qn: QN_TERMINATE,
                msn: Msn(1),
                mo: 0
            }
        );
        let UlpduBody::Terminate(t) = u.body else {
            panic!("not a Terminate body: {:?}", u.body);
        };
        assert_eq!(t.error(), Some(TermError::DdpUntaggedNoBuffer));
        assert_eq!(u, UlpduRepr::terminate(Msn(1), t));
        let mut out = [0u8; 42];
        assert_eq!(u.emit_header(&mut out), Ok(42));
        assert_eq!(out, bytes);
        // A Terminate whose flags announce more than is there.
        assert!(matches!(
            UlpduRepr::parse(&bytes[..30]),
            Err(UlpduError::Body(DecodeError::Truncated { .. }))
        ));
    }

    #[test]
    fn term_errors_for_decode_failures() {
        let cases = [
            (
                UlpduError::DdpVersion {
                    tagged: true,
                    version: 0,
                },
                Some(TermError::DdpTaggedInvalidVersion),
            ),
            (
                UlpduError::DdpVersion {
                    tagged: false,
                    version: 2,
                },
                Some(TermError::DdpUntaggedInvalidVersion),
            ),
            (
                UlpduError::RdmapVersion { version: 0 },
                Some(TermError::RdmapInvalidVersion),
            ),
            (
                UlpduError::ReservedOpcode { opcode: 0xc },
                Some(TermError::RdmapUnexpectedOpcode),
            ),
            (
                UlpduError::BufferModelMismatch {
                    opcode: Opcode::Send,
                    tagged: true,
                },
                Some(TermError::RdmapUnexpectedOpcode),
            ),
            (UlpduError::Truncated { needed: 18, got: 3 }, None),
        ];
        for (e, t) in cases {
            assert_eq!(e.term_error(), t);
            assert!(!e.to_string().is_empty());
        }
    }

    #[test]
    fn send_with_invalidate_carries_stag() {
        let u = UlpduRepr::send(
            Opcode::SendWithSolicitedEventAndInvalidate,
            Some(Stag(0x1234_5600)),
            Msn(7),
            0,
            true,
            b"x",
        );
        let mut buf = [0u8; 19];
        u.emit(&mut buf).unwrap();
        assert_eq!(buf[1], 0x46);
        assert_eq!(buf[2..6], [0x12, 0x34, 0x56, 0x00]);
        assert_eq!(UlpduRepr::parse(&buf), Ok(u));
        // A plain Send ignores whatever is in RsvdULP[8:39].
        buf[1] = 0x43;
        assert_eq!(UlpduRepr::parse(&buf).unwrap().invalidate_stag, None);
    }

    #[test]
    fn rejects_bad_versions() {
        let bytes = crc_p2p_read_request();
        for dv in [0u8, 2, 3] {
            let mut b = bytes.clone();
            b[0] = (b[0] & !0x03) | dv;
            assert_eq!(
                UlpduRepr::parse(&b),
                Err(UlpduError::DdpVersion {
                    tagged: false,
                    version: dv
                })
            );
            let mut b = RTR_WRITE;
            b[0] = (b[0] & !0x03) | dv;
            assert_eq!(
                UlpduRepr::parse(&b),
                Err(UlpduError::DdpVersion {
                    tagged: true,
                    version: dv
                })
            );
        }
        for rv in [0u8, 2, 3] {
            let mut b = bytes.clone();
            b[1] = (rv << 6) | 0x01;
            assert_eq!(
                UlpduRepr::parse(&b),
                Err(UlpduError::RdmapVersion { version: rv })
            );
            assert!(matches!(
                DecodeError::from(UlpduError::RdmapVersion { version: rv }),
                DecodeError::BadVersion { .. }
            ));
        }
    }

    #[test]
    fn rejects_reserved_opcodes_and_model_mismatch() {
        for raw in 12..16u8 {
            let mut b = crc_p2p_read_request();
            b[1] = 0x40 | raw;
            assert_eq!(
                UlpduRepr::parse(&b),
                Err(UlpduError::ReservedOpcode { opcode: raw })
            );
        }
        for op in Opcode::ALL {
            // A header of the wrong model, padded so length is not the issue.
            let mut b = vec![0u8; 80];
            b[0] = if op.is_tagged() { 0x41 } else { 0xc1 };
            b[1] = rdmap::control_byte(op);
            assert_eq!(
                UlpduRepr::parse(&b),
                Err(UlpduError::BufferModelMismatch {
                    opcode: op,
                    tagged: !op.is_tagged()
                })
            );
        }
    }

    #[test]
    fn truncated_at_every_length() {
        let rr = crc_p2p_read_request();
        for n in 0..rr.len() {
            let e = UlpduRepr::parse(&rr[..n]).unwrap_err();
            if n < 18 {
                assert!(matches!(e, UlpduError::Truncated { .. }), "{n}: {e:?}");
            } else {
                assert_eq!(
                    e,
                    UlpduError::BodyLength {
                        opcode: Opcode::RdmaReadRequest,
                        expected: 28,
                        got: n - 18
                    }
                );
            }
        }
        for n in 0..RTR_WRITE.len() {
            assert!(matches!(
                UlpduRepr::parse(&RTR_WRITE[..n]),
                Err(UlpduError::Truncated { .. })
            ));
        }
        let mut long = rr.clone();
        long.push(0);
        assert!(matches!(
            UlpduRepr::parse(&long),
            Err(UlpduError::BodyLength { got: 29, .. })
        ));
    }

    #[test]
    fn bad_atomic_opcode_is_a_body_error() {
        let u = UlpduRepr::atomic_request(Msn(1), AtomicRequestRepr::fetch_add(1, Stag(2), 8, 1));
        let mut buf = vec![0u8; u.buffer_len()];
        u.emit(&mut buf).unwrap();
        buf[18 + 3] = 0x0f;
        assert!(matches!(
            UlpduRepr::parse(&buf),
            Err(UlpduError::Body(DecodeError::InvalidField { .. }))
        ));
    }

    #[test]
    fn encoder_rejects_inconsistent_values() {
        let mut buf = [0u8; 128];
        let bad_model = UlpduRepr {
            address: DdpAddress::Untagged {
                qn: QN_SEND,
                msn: Msn(1),
                mo: 0,
            },
            ..UlpduRepr::tagged(Opcode::RdmaWrite, Stag(1), 0, true, &[])
        };
        assert_eq!(
            bad_model.emit(&mut buf),
            Err(UlpduEncodeError::BufferModelMismatch {
                opcode: Opcode::RdmaWrite
            })
        );
        let bad_body = UlpduRepr {
            body: UlpduBody::Immediate(ImmediateDataRepr::default()),
            ..UlpduRepr::send(Opcode::Send, None, Msn(1), 0, true, &[])
        };
        assert!(matches!(
            bad_body.emit_header(&mut buf),
            Err(UlpduEncodeError::BodyMismatch { .. })
        ));
        let missing_inval = UlpduRepr::send(Opcode::SendWithInvalidate, None, Msn(1), 0, true, &[]);
        assert!(matches!(
            missing_inval.emit(&mut buf),
            Err(UlpduEncodeError::InvalidateStagMismatch { .. })
        ));
        let ok = UlpduRepr::immediate(Msn(3), ImmediateDataRepr::from_be_u64(9), true);
        for n in 0..ok.buffer_len() {
            assert!(matches!(
                ok.emit(&mut buf[..n]),
                Err(UlpduEncodeError::Encode(EncodeError::BufferTooSmall { .. }))
            ));
        }
        assert_eq!(ok.emit(&mut buf), Ok(26));
    }

    fn arb_stag() -> impl Strategy<Value = Stag> {
        any::<u32>().prop_map(Stag)
    }

    /// A body that owns its bytes, so a strategy can produce it.
    #[derive(Debug, Clone)]
    enum OwnedBody {
        Payload(Vec<u8>),
        Fixed(UlpduBody<'static>),
    }

    impl OwnedBody {
        fn as_body(&self) -> UlpduBody<'_> {
            match self {
                Self::Payload(p) => UlpduBody::Payload(p),
                Self::Fixed(b) => *b,
            }
        }
    }

    static COPIED_TAGGED: [u8; 14] = RTR_WRITE;
    static COPIED_UNTAGGED: [u8; 18] = [0x41, 0x43, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 0];
    static COPIED_RDMAP: [u8; 28] = [7; 28];

    fn arb_terminate() -> impl Strategy<Value = TerminateRepr<'static>> {
        (
            proptest::sample::select(TermError::ALL.to_vec()),
            any::<bool>(),
            proptest::option::of((any::<u16>(), any::<bool>())),
            proptest::option::of(any::<bool>()),
        )
            .prop_map(|(e, m, ddp, rdmap)| {
                let mut t = TerminateRepr::new(e);
                t.segment_length_valid = m;
                t.ddp = ddp.map(|(segment_length, tagged)| TerminatedDdp {
                    segment_length,
                    header: if tagged {
                        &COPIED_TAGGED[..]
                    } else {
                        &COPIED_UNTAGGED[..]
                    },
                });
                t.rdmap_header = rdmap.map(|full| if full { &COPIED_RDMAP[..] } else { &[][..] });
                t
            })
    }

    fn arb_body() -> impl Strategy<Value = OwnedBody> {
        let bytes = proptest::collection::vec(any::<u8>(), 0..64);
        let read_request = (
            arb_stag(),
            any::<u64>(),
            any::<u32>(),
            arb_stag(),
            any::<u64>(),
        )
            .prop_map(|(sink_stag, sink_to, read_size, src_stag, src_to)| {
                ReadRequestRepr {
                    sink_stag,
                    sink_to,
                    read_size,
                    src_stag,
                    src_to,
                }
            });
        let atomic_req = (
            0u8..3,
            any::<u32>(),
            arb_stag(),
            any::<u64>(),
            any::<[u64; 4]>(),
        )
            .prop_map(|(op, id, stag, to, [a, b, c, d])| AtomicRequestRepr {
                opcode: atomic::AtomicOpcode::from_u8(op).unwrap_or(atomic::AtomicOpcode::FetchAdd),
                request_id: id,
                stag,
                to,
                add_or_swap_data: a,
                add_or_swap_mask: b,
                compare_data: c,
                compare_mask: d,
            });
        prop_oneof![
            bytes.prop_map(OwnedBody::Payload),
            arb_terminate().prop_map(|t| OwnedBody::Fixed(UlpduBody::Terminate(t))),
            read_request.prop_map(|r| OwnedBody::Fixed(UlpduBody::ReadRequest(r))),
            atomic_req.prop_map(|r| OwnedBody::Fixed(UlpduBody::AtomicRequest(r))),
            (any::<u32>(), any::<u64>()).prop_map(|(request_id, original_value)| {
                OwnedBody::Fixed(UlpduBody::AtomicResponse(AtomicResponseRepr {
                    request_id,
                    original_value,
                }))
            }),
            any::<[u8; 8]>().prop_map(|data| OwnedBody::Fixed(UlpduBody::Immediate(
                ImmediateDataRepr { data }
            ))),
        ]
    }

    /// Everything of a ULPDU but the body, with an opcode that suits it.
    fn arb_ulpdu() -> impl Strategy<Value = (OwnedBody, Opcode, bool, DdpAddress, Option<Stag>)> {
        arb_body()
            .prop_flat_map(|body| {
                let suiting: Vec<Opcode> = Opcode::ALL
                    .iter()
                    .copied()
                    .filter(|op| body.as_body().suits(*op))
                    .collect();
                (Just(body), proptest::sample::select(suiting))
            })
            .prop_flat_map(|(body, opcode)| {
                (
                    Just(body),
                    Just(opcode),
                    any::<bool>(),
                    arb_stag(),
                    any::<u64>(),
                    any::<(u32, u32, u32)>(),
                    arb_stag(),
                )
            })
            .prop_map(|(body, opcode, last, stag, to, (qn, msn, mo), inval)| {
                let address = if opcode.is_tagged() {
                    DdpAddress::Tagged { stag, to }
                } else {
                    DdpAddress::Untagged {
                        qn: Qn(qn),
                        msn: Msn(msn),
                        mo,
                    }
                };
                let inval = opcode.has_invalidate_stag().then_some(inval);
                (body, opcode, last, address, inval)
            })
    }

    proptest! {
        #[test]
        fn roundtrip((body, opcode, last, address, invalidate_stag) in arb_ulpdu()) {
            let repr = UlpduRepr { opcode, last, address, invalidate_stag, body: body.as_body() };
            let mut buf = vec![0u8; repr.buffer_len()];
            prop_assert_eq!(repr.emit(&mut buf), Ok(repr.buffer_len()));
            prop_assert!(ddp::header_len(buf[0]) <= repr.header_len());
            prop_assert_eq!(UlpduRepr::parse(&buf), Ok(repr));
            // emit_header writes the same leading bytes.
            let mut hdr = vec![0u8; repr.header_len()];
            prop_assert_eq!(repr.emit_header(&mut hdr), Ok(repr.header_len()));
            prop_assert_eq!(&hdr[..], &buf[..repr.header_len()]);
        }

        #[test]
        fn parse_never_panics(buf in proptest::collection::vec(any::<u8>(), 0..96)) {
            let _ = UlpduRepr::parse(&buf);
        }

        #[test]
        fn parse_never_panics_on_valid_prefixes(buf in proptest::collection::vec(any::<u8>(), 0..96), b0 in prop_oneof![Just(0x41u8), Just(0xc1u8), Just(0x01u8)], op in 0u8..16) {
            let mut b = buf;
            if b.len() >= 2 {
                b[0] = b0;
                b[1] = 0x40 | op;
            }
            // Whatever parses re-encodes to bytes that parse to the same value.
            if let Ok(repr) = UlpduRepr::parse(&b) {
                let mut out = vec![0u8; repr.buffer_len()];
                prop_assert_eq!(repr.emit(&mut out), Ok(out.len()));
                prop_assert_eq!(UlpduRepr::parse(&out), Ok(repr));
            }
        }
    }
}
