//! The connection request (CR) life: it is answered exactly once, by an
//! accept, a reject or a handoff; after that its handle is gone.

use super::ret::{DatError, ErrorType, Subtype};

/// The state of a CR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrState {
    /// Delivered to the consumer, not answered.
    Pending,
    /// Answered (accepted, rejected or handed off): the handle is freed.
    Answered,
}

/// Operations on a CR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CrOp {
    /// `dat_cr_query`.
    Query,
    /// `dat_cr_accept`.
    Accept,
    /// `dat_cr_reject`.
    Reject,
    /// `dat_cr_handoff`.
    Handoff,
}

impl CrOp {
    /// Every operation.
    pub const ALL: [CrOp; 4] = [CrOp::Query, CrOp::Accept, CrOp::Reject, CrOp::Handoff];
}

/// Applies `op`.
///
/// # Errors
///
/// `DAT_INVALID_HANDLE CR` once the CR is answered.
pub fn apply(s: CrState, op: CrOp) -> Result<CrState, DatError> {
    match (s, op) {
        (CrState::Pending, CrOp::Query) => Ok(CrState::Pending),
        (CrState::Pending, _) => Ok(CrState::Answered),
        (CrState::Answered, _) => Err(DatError::new(ErrorType::InvalidHandle, Subtype::HandleCr)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_op_pair() {
        for s in [CrState::Pending, CrState::Answered] {
            for op in CrOp::ALL {
                let r = apply(s, op);
                match (s, op) {
                    (CrState::Pending, CrOp::Query) => assert_eq!(r, Ok(CrState::Pending)),
                    (CrState::Pending, _) => assert_eq!(r, Ok(CrState::Answered)),
                    _ => assert_eq!(r.unwrap_err().sub, Subtype::HandleCr),
                }
            }
        }
    }
}
