//! The consumer notification object (CNO): a fan-in of EVDs. An event on
//! an enabled EVD of the CNO triggers it; `dat_cno_wait` returns the EVD
//! that triggered it (one waiter at a time).

use super::ret::{DatError, ErrorType, Subtype};

/// The state of a CNO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CnoState {
    /// A thread is in `dat_cno_wait`.
    pub waiting: bool,
    /// Triggered and not yet collected by a wait.
    pub triggered: bool,
}

/// Operations on a CNO.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CnoOp {
    /// `dat_cno_wait` begins.
    WaitBegin,
    /// An enabled EVD of the CNO got an event (or `dat_cno_trigger`).
    Trigger,
    /// The waiter collects the trigger and returns.
    Collect,
    /// The waiter returns without a trigger (timeout).
    WaitTimeout,
    /// `dat_cno_free`.
    Free,
}

impl CnoOp {
    /// Every operation.
    pub const ALL: [CnoOp; 5] = [
        CnoOp::WaitBegin,
        CnoOp::Trigger,
        CnoOp::Collect,
        CnoOp::WaitTimeout,
        CnoOp::Free,
    ];
}

/// Applies `op`.
///
/// # Errors
///
/// `DAT_INVALID_STATE CNO_IN_USE` for a second waiter or a free while a
/// thread waits; `CNO_DEAD` for a collect or timeout without a waiter or a
/// collect without a trigger.
pub fn apply(s: CnoState, op: CnoOp) -> Result<CnoState, DatError> {
    let in_use = DatError::new(ErrorType::InvalidState, Subtype::CnoInUse);
    let dead = DatError::new(ErrorType::InvalidState, Subtype::CnoDead);
    match op {
        CnoOp::WaitBegin if s.waiting => Err(in_use),
        CnoOp::WaitBegin => Ok(CnoState { waiting: true, ..s }),
        CnoOp::Trigger => Ok(CnoState {
            triggered: true,
            ..s
        }),
        CnoOp::Collect if s.waiting && s.triggered => Ok(CnoState {
            waiting: false,
            triggered: false,
        }),
        CnoOp::WaitTimeout if s.waiting => Ok(CnoState {
            waiting: false,
            ..s
        }),
        CnoOp::Collect | CnoOp::WaitTimeout => Err(dead),
        CnoOp::Free if s.waiting => Err(in_use),
        CnoOp::Free => Ok(s),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_op_pair() {
        for waiting in [false, true] {
            for triggered in [false, true] {
                let s = CnoState { waiting, triggered };
                for op in CnoOp::ALL {
                    let ok = match op {
                        CnoOp::WaitBegin | CnoOp::Free => !waiting,
                        CnoOp::Trigger => true,
                        CnoOp::Collect => waiting && triggered,
                        CnoOp::WaitTimeout => waiting,
                    };
                    assert_eq!(apply(s, op).is_ok(), ok, "{s:?} {op:?}");
                }
            }
        }
        let s = apply(
            CnoState {
                waiting: false,
                triggered: false,
            },
            CnoOp::WaitBegin,
        )
        .unwrap();
        let s = apply(s, CnoOp::Trigger).unwrap();
        assert_eq!(
            apply(s, CnoOp::Collect).unwrap(),
            CnoState {
                waiting: false,
                triggered: false
            }
        );
    }
}
