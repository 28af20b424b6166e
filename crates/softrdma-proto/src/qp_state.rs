//! The iWARP QP state machine (RDMAC verbs / RFC 5040 section 5): the states,
//! which transitions an application may request, and what posting does in
//! each state. Pure rules, no IO.
//!
//! ```text
//!            modify            connection established
//!   IDLE ──────────► RTR ───────────────────────────► RTS
//!    ▲  ╲________________________________________↗   │ │ │
//!    │                                               │ │ └─ local or remote error ─► TERMINATE ─► ERROR
//!    │                    graceful close (FIN) ──────┘ │                                           │
//!    │                         CLOSING ────────────────┼─ abortive close / lost ─────────────────► │
//!    │                            │ FIN exchanged       │                                           │
//!    └────────────────────────────┴─────────────────────┴──────── modify to IDLE (reset) ◄──────────┘
//! ```

use core::fmt;

/// The state of a queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum QpState {
    /// Created, not connected. Receives may be posted; sends are rejected.
    Idle = 0,
    /// Ready to receive: receives may be posted, the connection is being set
    /// up; sends are rejected.
    Rtr = 1,
    /// Ready to send: connected, full operation.
    Rts = 2,
    /// Graceful close in progress: no new work is accepted.
    Closing = 3,
    /// A Terminate is being sent or was received; the QP is about to enter
    /// ERROR.
    Terminate = 4,
    /// Error: outstanding and newly posted work completes with flush errors.
    Error = 5,
}

impl QpState {
    /// The state for a raw value stored by [`QpState::as_u8`].
    pub const fn from_u8(v: u8) -> Option<QpState> {
        Some(match v {
            0 => QpState::Idle,
            1 => QpState::Rtr,
            2 => QpState::Rts,
            3 => QpState::Closing,
            4 => QpState::Terminate,
            5 => QpState::Error,
            _ => return None,
        })
    }

    /// The raw value.
    pub const fn as_u8(self) -> u8 {
        self as u8
    }

    /// The name used by the verbs specifications.
    pub const fn name(self) -> &'static str {
        match self {
            QpState::Idle => "IDLE",
            QpState::Rtr => "RTR",
            QpState::Rts => "RTS",
            QpState::Closing => "CLOSING",
            QpState::Terminate => "TERMINATE",
            QpState::Error => "ERROR",
        }
    }

    /// Whether an application may move a QP from `self` to `to` with
    /// `modify`. Transitions driven by the connection (RTR → RTS on
    /// establishment, RTS → TERMINATE on a protocol error, CLOSING → IDLE
    /// when the close completes) are made by the engine, not by `modify`,
    /// except RTR/IDLE → RTS which `modify` allows once the QP is connected.
    pub const fn user_may_modify(self, to: QpState) -> bool {
        use QpState::*;
        matches!(
            (self, to),
            (Idle, Idle)
                | (Idle, Rtr)
                | (Idle, Error)
                | (Rtr, Rtr)
                | (Rtr, Rts)
                | (Rtr, Error)
                | (Rts, Rts)
                | (Rts, Closing)
                | (Rts, Terminate)
                | (Rts, Error)
                | (Closing, Error)
                | (Terminate, Error)
                | (Error, Idle)
                | (Error, Error)
        )
    }

    /// What posting a send-queue request does in this state.
    pub const fn send_policy(self) -> PostPolicy {
        match self {
            QpState::Rts => PostPolicy::Accept,
            QpState::Error => PostPolicy::Flush,
            QpState::Idle | QpState::Rtr | QpState::Closing | QpState::Terminate => {
                PostPolicy::Reject
            }
        }
    }

    /// What posting a receive does in this state.
    pub const fn recv_policy(self) -> PostPolicy {
        match self {
            QpState::Idle | QpState::Rtr | QpState::Rts => PostPolicy::Accept,
            QpState::Error => PostPolicy::Flush,
            QpState::Closing | QpState::Terminate => PostPolicy::Reject,
        }
    }
}

impl fmt::Display for QpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A connection-driven event: what happens to the QP's connection, as
/// opposed to an application's `modify`. [`QpState::on_conn_event`] gives
/// the transition each causes in each state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnEvent {
    /// The connection reached full operation (MPA and RTR done).
    Established,
    /// The application asked for a graceful close.
    LocalClose,
    /// The peer's FIN arrived at an FPDU boundary.
    PeerFin,
    /// Our FIN is out and the peer's arrived: the graceful close is done.
    FinsExchanged,
    /// We found a protocol violation: a Terminate goes out.
    LocalViolation,
    /// Our Terminate is out (or cannot be sent).
    TerminateDone,
    /// A Terminate arrived from the peer.
    TerminateReceived,
    /// The connection was reset or lost.
    PeerReset,
    /// The peer closed in the middle of an FPDU (or with work pending).
    BadClose,
    /// The application aborted the connection.
    LocalAbort,
    /// A graceful close did not finish in time.
    CloseTimeout,
}

impl ConnEvent {
    /// Every event.
    pub const ALL: [ConnEvent; 11] = [
        ConnEvent::Established,
        ConnEvent::LocalClose,
        ConnEvent::PeerFin,
        ConnEvent::FinsExchanged,
        ConnEvent::LocalViolation,
        ConnEvent::TerminateDone,
        ConnEvent::TerminateReceived,
        ConnEvent::PeerReset,
        ConnEvent::BadClose,
        ConnEvent::LocalAbort,
        ConnEvent::CloseTimeout,
    ];
}

impl QpState {
    /// Every state.
    pub const ALL: [QpState; 6] = [
        QpState::Idle,
        QpState::Rtr,
        QpState::Rts,
        QpState::Closing,
        QpState::Terminate,
        QpState::Error,
    ];

    /// The state a connection-driven event moves the QP to, or `None` if the
    /// event changes nothing in this state. This is the whole table of
    /// connection-driven transitions (the engine and
    /// [`crate::conn::Connection`] use nothing else).
    pub const fn on_conn_event(self, ev: ConnEvent) -> Option<QpState> {
        use ConnEvent as E;
        use QpState::*;
        match (self, ev) {
            (Idle | Rtr, E::Established) => Some(Rts),
            (Rts, E::LocalClose | E::PeerFin) => Some(Closing),
            (Closing, E::FinsExchanged) => Some(Idle),
            (Rts | Closing, E::LocalViolation) => Some(Terminate),
            (Terminate, E::TerminateDone) => Some(Error),
            (Rts | Closing | Terminate, E::TerminateReceived) => Some(Error),
            (Rtr | Rts | Closing | Terminate, E::PeerReset | E::BadClose) => Some(Error),
            (Idle | Rtr | Rts | Closing | Terminate, E::LocalAbort) => Some(Error),
            (Closing, E::CloseTimeout) => Some(Error),
            _ => None,
        }
    }
}

/// What posting a work request does in a given state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostPolicy {
    /// The request is queued for processing.
    Accept,
    /// The request is accepted and completes at once with a flush error.
    Flush,
    /// The request is refused with an error return (nothing is queued).
    Reject,
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [QpState; 6] = [
        QpState::Idle,
        QpState::Rtr,
        QpState::Rts,
        QpState::Closing,
        QpState::Terminate,
        QpState::Error,
    ];

    #[test]
    fn raw_values_round_trip() {
        for s in ALL {
            assert_eq!(QpState::from_u8(s.as_u8()), Some(s));
        }
        assert_eq!(QpState::from_u8(6), None);
    }

    #[test]
    fn every_state_can_reach_error_except_through_idle_reset() {
        for s in ALL {
            assert!(s.user_may_modify(QpState::Error), "{s} -> ERROR");
        }
        assert!(QpState::Error.user_may_modify(QpState::Idle));
        assert!(!QpState::Rts.user_may_modify(QpState::Idle));
        assert!(!QpState::Idle.user_may_modify(QpState::Rts));
        assert!(!QpState::Closing.user_may_modify(QpState::Rts));
    }

    #[test]
    fn posting_rules() {
        assert_eq!(QpState::Rts.send_policy(), PostPolicy::Accept);
        assert_eq!(QpState::Idle.send_policy(), PostPolicy::Reject);
        assert_eq!(QpState::Error.send_policy(), PostPolicy::Flush);
        assert_eq!(QpState::Idle.recv_policy(), PostPolicy::Accept);
        assert_eq!(QpState::Rtr.recv_policy(), PostPolicy::Accept);
        assert_eq!(QpState::Error.recv_policy(), PostPolicy::Flush);
        assert_eq!(QpState::Closing.recv_policy(), PostPolicy::Reject);
    }
    #[test]
    fn every_state_event_pair() {
        use ConnEvent as E;
        use QpState::*;
        // The expected table, written out pair by pair.
        let expect = |s: QpState, e: ConnEvent| -> Option<QpState> {
            match e {
                E::Established => matches!(s, Idle | Rtr).then_some(Rts),
                E::LocalClose | E::PeerFin => (s == Rts).then_some(Closing),
                E::FinsExchanged => (s == Closing).then_some(Idle),
                E::LocalViolation => matches!(s, Rts | Closing).then_some(Terminate),
                E::TerminateDone => (s == Terminate).then_some(Error),
                E::TerminateReceived => matches!(s, Rts | Closing | Terminate).then_some(Error),
                E::PeerReset | E::BadClose => {
                    matches!(s, Rtr | Rts | Closing | Terminate).then_some(Error)
                }
                E::LocalAbort => (s != Error).then_some(Error),
                E::CloseTimeout => (s == Closing).then_some(Error),
            }
        };
        let mut n = 0;
        for s in QpState::ALL {
            for e in ConnEvent::ALL {
                assert_eq!(s.on_conn_event(e), expect(s, e), "{s} on {e:?}");
                n += 1;
            }
        }
        assert_eq!(n, 66);
        // ERROR is left only by the application's reset to IDLE.
        for e in ConnEvent::ALL {
            assert_eq!(Error.on_conn_event(e), None);
        }
    }
}
