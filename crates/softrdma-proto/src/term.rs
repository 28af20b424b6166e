//! Terminate errors and what they mean for the QP: ONE table.
//!
//! Every violation the core detects names a [`TermError`]; [`class`] says,
//! from the table [`TABLE`], which asynchronous event the local application
//! gets, what a requester's completion status is when a peer's Terminate
//! carries the code, and the QP transition (always RTS → TERMINATE → ERROR:
//! RFC 5040 section 6.8 — a Terminate ends the stream). Terminates received
//! with a code outside the table map by error type
//! ([`status_for_received`]).
//!
//! Codes the RFCs leave to the implementation, chosen once here:
//!
//! * [`MALFORMED_HEADER`]: a ULPDU shorter than its DDP header or its fixed-size
//!   RDMAP header (RFC 5040/5041 name no code): RDMAP Remote Operation
//!   "Unspecified Error".
//! * [`UNSUPPORTED_ATOMIC`]: an Atomic Request with an atomic opcode that is
//!   not defined. RFC 7306 section 8 answers an unsupported atomic with an
//!   RDMAP Remote Operation error; the IANA registry holds no RFC 7306 code
//!   (see `softrdma_wire::errcode`), so the RFC 5040 "Unexpected OpCode"
//!   (0x0/0x2/0x06) is sent — never "DDP Local Catastrophic", which would
//!   blame the receiver.

use softrdma_wire::errcode::{ErrorType, TermCode, TermError};

use crate::qp_state::QpState;
use crate::types::{AsyncKind, WcStatus};

/// A ULPDU shorter than its DDP header, or a consumed RDMAP header of the
/// wrong length or shape (no specific RFC code).
pub const MALFORMED_HEADER: TermError = TermError::RdmapOperationUnspecified;
/// An Atomic Request with an undefined atomic opcode.
pub const UNSUPPORTED_ATOMIC: TermError = TermError::RdmapUnexpectedOpcode;

/// One row of [`TABLE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermClass {
    /// The error.
    pub error: TermError,
    /// The event the detecting side's application gets.
    pub event: AsyncKind,
    /// The status of the requester's work request that a Terminate with
    /// this code answers (the oldest outstanding Read or atomic).
    pub requester_status: WcStatus,
    /// The state the detecting side enters at once (then ERROR once the
    /// Terminate is out).
    pub transition: QpState,
}

const fn row(error: TermError, event: AsyncKind, requester_status: WcStatus) -> TermClass {
    TermClass {
        error,
        event,
        requester_status,
        transition: QpState::Terminate,
    }
}

use AsyncKind::{QpAccessError as Acc, QpFatal as Fat, QpRequestError as Req};
use WcStatus::{Fatal, RemoteAccess, RemoteInvalidRequest, RemoteOperation};

/// Every Terminate error with its event class and completion status.
pub const TABLE: &[TermClass] = &[
    row(TermError::RdmapLocalCatastrophic, Fat, Fatal),
    row(TermError::RdmapInvalidStag, Acc, RemoteAccess),
    row(TermError::RdmapBaseOrBounds, Acc, RemoteAccess),
    row(TermError::RdmapAccessRights, Acc, RemoteAccess),
    row(TermError::RdmapStagNotAssociated, Acc, RemoteAccess),
    row(TermError::RdmapToWrap, Acc, RemoteAccess),
    row(
        TermError::RdmapProtectionCannotInvalidate,
        Acc,
        RemoteAccess,
    ),
    row(TermError::RdmapProtectionUnspecified, Acc, RemoteAccess),
    row(TermError::RdmapInvalidVersion, Req, RemoteOperation),
    row(TermError::RdmapUnexpectedOpcode, Req, RemoteOperation),
    row(TermError::RdmapCatastrophicStream, Req, RemoteOperation),
    row(TermError::RdmapCatastrophicGlobal, Req, RemoteOperation),
    row(
        TermError::RdmapOperationCannotInvalidate,
        Acc,
        RemoteOperation,
    ),
    row(TermError::RdmapOperationUnspecified, Req, RemoteOperation),
    row(TermError::DdpLocalCatastrophic, Fat, Fatal),
    row(TermError::DdpTaggedInvalidStag, Acc, RemoteAccess),
    row(TermError::DdpTaggedBaseOrBounds, Acc, RemoteAccess),
    row(TermError::DdpTaggedStagNotAssociated, Acc, RemoteAccess),
    row(TermError::DdpTaggedToWrap, Acc, RemoteAccess),
    row(TermError::DdpTaggedInvalidVersion, Req, RemoteAccess),
    row(TermError::DdpUntaggedInvalidQn, Req, RemoteInvalidRequest),
    row(TermError::DdpUntaggedNoBuffer, Req, RemoteInvalidRequest),
    row(TermError::DdpUntaggedMsnRange, Req, RemoteInvalidRequest),
    row(TermError::DdpUntaggedInvalidMo, Req, RemoteInvalidRequest),
    row(
        TermError::DdpUntaggedMessageTooLong,
        Req,
        RemoteInvalidRequest,
    ),
    row(
        TermError::DdpUntaggedInvalidVersion,
        Req,
        RemoteInvalidRequest,
    ),
    row(TermError::MpaConnectionLost, Fat, Fatal),
    row(TermError::MpaCrcError, Fat, Fatal),
    row(TermError::MpaMarkerMismatch, Fat, Fatal),
    row(TermError::MpaInvalidRequestReply, Fat, Fatal),
    row(TermError::MpaLocalCatastrophic, Fat, Fatal),
    row(TermError::MpaInsufficientIrd, Fat, Fatal),
    row(TermError::MpaNoMatchingRtr, Fat, Fatal),
];

/// The table row of `error`.
#[must_use]
pub fn class(error: TermError) -> TermClass {
    TABLE
        .iter()
        .copied()
        .find(|r| r.error == error)
        .unwrap_or(row(error, Fat, Fatal))
}

/// The status of the request a received Terminate answered: the table's
/// when the code is known, else by error type (like the engine's
/// `term_status`).
#[must_use]
pub fn status_for_received(code: TermCode) -> WcStatus {
    if let Some(e) = code.known() {
        return class(e).requester_status;
    }
    match code.error_type() {
        Some(ErrorType::RdmapRemoteProtection | ErrorType::DdpTaggedBuffer) => RemoteAccess,
        Some(ErrorType::RdmapRemoteOperation) => RemoteOperation,
        Some(ErrorType::DdpUntaggedBuffer) => RemoteInvalidRequest,
        _ => Fatal,
    }
}

/// Whether a Terminate for `error` copies the terminated segment's DDP
/// header (D and M set, with the segment length). Like siw
/// (`siw_send_terminate`), every error tied to a received segment does,
/// except the LLP errors (no segment), the local catastrophic ones, and the
/// errors that mean the header layout is unknown: DDP and RDMAP version
/// errors and RDMAP "Unexpected OpCode".
#[must_use]
pub const fn copies_ddp_header(error: TermError) -> bool {
    !matches!(
        error.error_type(),
        ErrorType::LlpMpa | ErrorType::RdmapLocalCatastrophic | ErrorType::DdpLocalCatastrophic
    ) && !matches!(
        error,
        TermError::DdpTaggedInvalidVersion
            | TermError::DdpUntaggedInvalidVersion
            | TermError::RdmapInvalidVersion
            | TermError::RdmapUnexpectedOpcode
    )
}

/// Whether a Terminate for `error` about a Read Request also copies its
/// RDMAP header (R set, the 28-byte Read Request header after the DDP
/// header): RDMAP Remote Protection errors, like siw.
#[must_use]
pub const fn copies_rdmap_header(error: TermError) -> bool {
    matches!(error.error_type(), ErrorType::RdmapRemoteProtection)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_has_every_terminate_error_once() {
        for e in TermError::ALL {
            let n = TABLE.iter().filter(|r| r.error == *e).count();
            assert_eq!(n, 1, "{e:?}");
        }
        assert_eq!(TABLE.len(), TermError::ALL.len());
    }

    #[test]
    fn table_rows_follow_the_error_type() {
        for r in TABLE {
            assert_eq!(r.transition, QpState::Terminate);
            assert_eq!(status_for_received(r.error.into()), r.requester_status);
            match r.error.error_type() {
                ErrorType::RdmapRemoteProtection | ErrorType::DdpTaggedBuffer => {
                    assert_eq!(r.requester_status, RemoteAccess, "{:?}", r.error);
                }
                ErrorType::DdpUntaggedBuffer => {
                    assert_eq!(r.requester_status, RemoteInvalidRequest);
                    assert_eq!(r.event, Req);
                }
                ErrorType::LlpMpa
                | ErrorType::DdpLocalCatastrophic
                | ErrorType::RdmapLocalCatastrophic => {
                    assert_eq!((r.event, r.requester_status), (Fat, Fatal));
                }
                ErrorType::RdmapRemoteOperation => {
                    assert_eq!(r.requester_status, RemoteOperation);
                }
            }
        }
    }

    #[test]
    fn unknown_codes_map_by_type() {
        let code = TermCode::from_bytes([0x01, 0x77]);
        assert_eq!(status_for_received(code), RemoteAccess);
        assert_eq!(
            status_for_received(TermCode::from_bytes([0x2f, 0x99])),
            Fatal
        );
    }

    #[test]
    fn chosen_codes_are_not_local_catastrophes() {
        for e in [MALFORMED_HEADER, UNSUPPORTED_ATOMIC] {
            assert_eq!(e.error_type(), ErrorType::RdmapRemoteOperation);
        }
        assert!(copies_ddp_header(MALFORMED_HEADER));
    }

    #[test]
    fn header_copies_follow_siw() {
        // Layout unknown: nothing copied.
        for e in [
            TermError::DdpTaggedInvalidVersion,
            TermError::DdpUntaggedInvalidVersion,
            TermError::RdmapInvalidVersion,
            TermError::RdmapUnexpectedOpcode,
            TermError::MpaCrcError,
            TermError::DdpLocalCatastrophic,
        ] {
            assert!(!copies_ddp_header(e), "{e:?}");
        }
        for e in [
            TermError::DdpUntaggedNoBuffer,
            TermError::DdpTaggedInvalidStag,
            TermError::RdmapInvalidStag,
            TermError::DdpUntaggedInvalidQn,
        ] {
            assert!(copies_ddp_header(e), "{e:?}");
        }
        assert!(copies_rdmap_header(TermError::RdmapAccessRights));
        assert!(!copies_rdmap_header(TermError::DdpUntaggedInvalidMo));
    }
}
