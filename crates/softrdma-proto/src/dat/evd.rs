//! The event dispatcher (EVD) rules: who may wait, enable/disable,
//! waitable/unwaitable, the threshold of `dat_evd_wait`, and overflow.
//!
//! An EVD queues at most `qlen` events; one that arrives when `qlen` are
//! queued is dropped and reported as `DAT_ASYNC_ERROR_EVD_OVERFLOW` on the
//! IA's asynchronous EVD ([`push`]). One thread at a time may wait; a
//! dequeue or a free while a thread waits is refused.

use super::ret::{DatError, ErrorType, Subtype};

/// The state of an EVD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EvdState {
    /// Enabled: arrivals notify the EVD's CNO (`dat_evd_enable`).
    pub enabled: bool,
    /// Waitable (`dat_evd_clear_unwaitable`; `set_unwaitable` clears it).
    pub waitable: bool,
    /// A thread is in `dat_evd_wait`.
    pub waiting: bool,
}

impl EvdState {
    /// A new EVD: enabled, waitable, nobody waiting.
    pub const NEW: EvdState = EvdState {
        enabled: true,
        waitable: true,
        waiting: false,
    };

    /// All eight combinations.
    pub fn all() -> impl Iterator<Item = EvdState> {
        (0u8..8).map(|b| EvdState {
            enabled: b & 1 != 0,
            waitable: b & 2 != 0,
            waiting: b & 4 != 0,
        })
    }
}

/// Operations on an EVD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EvdOp {
    /// `dat_evd_wait` begins.
    WaitBegin,
    /// `dat_evd_wait` returns.
    WaitEnd,
    /// `dat_evd_dequeue`.
    Dequeue,
    /// `dat_evd_enable`.
    Enable,
    /// `dat_evd_disable`.
    Disable,
    /// `dat_evd_set_unwaitable` (a waiter is woken and fails).
    SetUnwaitable,
    /// `dat_evd_clear_unwaitable`.
    ClearUnwaitable,
    /// `dat_evd_resize`.
    Resize,
    /// `dat_evd_modify_cno`.
    ModifyCno,
    /// `dat_evd_free`.
    Free,
}

impl EvdOp {
    /// Every operation.
    pub const ALL: [EvdOp; 10] = [
        EvdOp::WaitBegin,
        EvdOp::WaitEnd,
        EvdOp::Dequeue,
        EvdOp::Enable,
        EvdOp::Disable,
        EvdOp::SetUnwaitable,
        EvdOp::ClearUnwaitable,
        EvdOp::Resize,
        EvdOp::ModifyCno,
        EvdOp::Free,
    ];
}

const fn invalid(sub: Subtype) -> DatError {
    DatError::new(ErrorType::InvalidState, sub)
}

/// Applies `op` to an EVD in state `s`.
///
/// # Errors
///
/// `DAT_INVALID_STATE`: `EVD_IN_USE` for a second waiter, or a dequeue,
/// resize, CNO change or free while a thread waits; `EVD_UNWAITABLE` for a
/// wait on an unwaitable EVD; `EVD_WAITER` for the end of a wait nobody
/// began.
pub fn apply(s: EvdState, op: EvdOp) -> Result<EvdState, DatError> {
    let mut n = s;
    match op {
        EvdOp::WaitBegin => {
            if !s.waitable {
                return Err(invalid(Subtype::EvdUnwaitable));
            }
            if s.waiting {
                return Err(invalid(Subtype::EvdInUse));
            }
            n.waiting = true;
        }
        EvdOp::WaitEnd => {
            if !s.waiting {
                return Err(invalid(Subtype::EvdWaiter));
            }
            n.waiting = false;
        }
        EvdOp::Dequeue | EvdOp::Resize | EvdOp::ModifyCno | EvdOp::Free => {
            if s.waiting {
                return Err(invalid(Subtype::EvdInUse));
            }
        }
        EvdOp::Enable => n.enabled = true,
        EvdOp::Disable => n.enabled = false,
        EvdOp::SetUnwaitable => n.waitable = false,
        EvdOp::ClearUnwaitable => n.waitable = true,
    }
    Ok(n)
}

/// What happens to an event arriving at an EVD holding `len` of `qlen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Push {
    /// Queued.
    Queued,
    /// Dropped: report `DAT_ASYNC_ERROR_EVD_OVERFLOW`.
    Overflow,
}

/// The overflow rule.
pub const fn push(len: usize, qlen: usize) -> Push {
    if len >= qlen {
        Push::Overflow
    } else {
        Push::Queued
    }
}

/// Checks the threshold of `dat_evd_wait` (1 ≤ threshold ≤ qlen).
///
/// # Errors
///
/// `DAT_INVALID_PARAMETER` / `DAT_INVALID_ARG3`.
pub fn check_threshold(threshold: usize, qlen: usize) -> Result<(), DatError> {
    if threshold == 0 || threshold > qlen {
        return Err(DatError::new(ErrorType::InvalidParameter, Subtype::Arg3));
    }
    Ok(())
}

/// Whether a waiter with `threshold` may return with `len` queued.
pub const fn satisfied(len: usize, threshold: usize) -> bool {
    len > 0 && len >= threshold
}

/// Checks a new queue length for `dat_evd_resize` (`qlen` ≥ the events
/// queued, > 0).
///
/// # Errors
///
/// `DAT_INVALID_PARAMETER` (0), `DAT_INVALID_STATE` (below the queued
/// count).
pub fn check_resize(new_qlen: usize, len: usize) -> Result<(), DatError> {
    if new_qlen == 0 {
        return Err(DatError::new(ErrorType::InvalidParameter, Subtype::Arg2));
    }
    if new_qlen < len {
        return Err(invalid(Subtype::None));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_state_op_pair() {
        let mut n = 0;
        for s in EvdState::all() {
            for op in EvdOp::ALL {
                n += 1;
                let r = apply(s, op);
                let want = match op {
                    EvdOp::WaitBegin if !s.waitable => Err(invalid(Subtype::EvdUnwaitable)),
                    EvdOp::WaitBegin if s.waiting => Err(invalid(Subtype::EvdInUse)),
                    EvdOp::WaitBegin => Ok(EvdState { waiting: true, ..s }),
                    EvdOp::WaitEnd if !s.waiting => Err(invalid(Subtype::EvdWaiter)),
                    EvdOp::WaitEnd => Ok(EvdState {
                        waiting: false,
                        ..s
                    }),
                    EvdOp::Dequeue | EvdOp::Resize | EvdOp::ModifyCno | EvdOp::Free
                        if s.waiting =>
                    {
                        Err(invalid(Subtype::EvdInUse))
                    }
                    EvdOp::Dequeue | EvdOp::Resize | EvdOp::ModifyCno | EvdOp::Free => Ok(s),
                    EvdOp::Enable => Ok(EvdState { enabled: true, ..s }),
                    EvdOp::Disable => Ok(EvdState {
                        enabled: false,
                        ..s
                    }),
                    EvdOp::SetUnwaitable => Ok(EvdState {
                        waitable: false,
                        ..s
                    }),
                    EvdOp::ClearUnwaitable => Ok(EvdState {
                        waitable: true,
                        ..s
                    }),
                };
                assert_eq!(r, want, "{s:?} {op:?}");
            }
        }
        assert_eq!(n, 80);
    }

    #[test]
    fn overflow_threshold_resize() {
        assert_eq!(push(0, 1), Push::Queued);
        assert_eq!(push(1, 1), Push::Overflow);
        assert_eq!(push(9, 10), Push::Queued);
        assert!(check_threshold(0, 4).is_err());
        assert!(check_threshold(5, 4).is_err());
        assert!(check_threshold(4, 4).is_ok());
        assert!(!satisfied(0, 1));
        assert!(satisfied(1, 1));
        assert!(!satisfied(2, 3));
        assert!(check_resize(0, 0).is_err());
        assert!(check_resize(2, 3).is_err());
        assert!(check_resize(3, 3).is_ok());
    }
}
