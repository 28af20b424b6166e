//! The endpoint (EP) state machine of DAT 2.0, mapped onto an iWARP
//! connection over TCP, with the seed's optional "retry until the server
//! comes online" state.
//!
//! ```text
//!             connect                Established
//! UNCONNECTED ───────▶ ACTIVE_PENDING ──────────▶ CONNECTED ──disconnect(graceful)──▶ DISCONNECT_PENDING
//!   │  ▲ ▲               │ ▲ refused (retry on)      │                                     │ closed
//!   │  │ │               ▼ │ retry due               │ closed / broken / abrupt            ▼
//!   │  │ │            CONNECT_RETRY                  └──────────────────────────────▶ DISCONNECTED
//!   │  │ └──────────── reset ──────────────────────────────────────────────────────────────┘
//!   │  └ unreserve ── RESERVED ── request ──▶ TENTATIVE_PENDING ── accept ──▶ PASSIVE_PENDING ─▶ CONNECTED
//!   └── accept (PSP request) ───────────────────────────────────────────────▶ PASSIVE_PENDING
//! ```
//!
//! Every failed connection attempt ends in DISCONNECTED and is reported
//! with its [`ConnEvent`]; [`EpEvent::Reset`] makes the EP usable again.

use super::ret::{DatError, ErrorType, Subtype};

/// An endpoint's state. [`ConnectRetry`](EpState::ConnectRetry) is
/// softrdma's: DAT reports it as `ACTIVE_CONNECTION_PENDING`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EpState {
    /// Quiescent: receives may be posted, a connection may start.
    Unconnected,
    /// Reserved for a reserved service point (RSP).
    Reserved,
    /// A request arrived at the EP's RSP; the consumer decides.
    TentativeConnectionPending,
    /// Accepted; the connection is being completed.
    PassiveConnectionPending,
    /// Connecting.
    ActiveConnectionPending,
    /// The peer refused the TCP connection; waiting to try again (the
    /// seed's "Connect Pending 4").
    ConnectRetry,
    /// Connected: every data transfer operation is allowed.
    Connected,
    /// A graceful disconnect is under way.
    DisconnectPending,
    /// The connection ended (or never came up); reset to reuse.
    Disconnected,
}

impl EpState {
    /// Every state.
    pub const ALL: [EpState; 9] = [
        EpState::Unconnected,
        EpState::Reserved,
        EpState::TentativeConnectionPending,
        EpState::PassiveConnectionPending,
        EpState::ActiveConnectionPending,
        EpState::ConnectRetry,
        EpState::Connected,
        EpState::DisconnectPending,
        EpState::Disconnected,
    ];

    /// The `DAT_EP_STATE` value reported to consumers.
    pub const fn dat_state(self) -> u32 {
        match self {
            EpState::Unconnected => 0,
            EpState::Reserved => 2,
            EpState::PassiveConnectionPending => 4,
            EpState::ActiveConnectionPending | EpState::ConnectRetry => 6,
            EpState::TentativeConnectionPending => 7,
            EpState::Connected => 9,
            EpState::DisconnectPending => 10,
            EpState::Disconnected => 11,
        }
    }

    /// The `DAT_INVALID_STATE` subtype naming this state.
    pub const fn subtype(self) -> Subtype {
        match self {
            EpState::Unconnected => Subtype::EpUnconnected,
            EpState::Reserved => Subtype::EpReserved,
            EpState::TentativeConnectionPending => Subtype::EpTentConnPending,
            EpState::PassiveConnectionPending => Subtype::EpPassConnPending,
            EpState::ActiveConnectionPending | EpState::ConnectRetry => Subtype::EpActConnPending,
            EpState::Connected => Subtype::EpConnected,
            EpState::DisconnectPending => Subtype::EpDiscPending,
            EpState::Disconnected => Subtype::EpDisconnected,
        }
    }

    /// The error of an operation not allowed in this state.
    pub const fn invalid(self) -> DatError {
        DatError::new(ErrorType::InvalidState, self.subtype())
    }

    /// Whether send-queue work (send, RDMA, bind) may be posted.
    pub fn may_post_send(self) -> Result<(), DatError> {
        match self {
            EpState::Connected => Ok(()),
            s => Err(s.invalid()),
        }
    }

    /// Whether receives may be posted: in every state (DAT requires them
    /// before a connection exists; after one ends they are flushed).
    pub fn may_post_recv(self) -> Result<(), DatError> {
        Ok(())
    }
}

/// What happens to an endpoint: consumer calls and transport outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EpEvent {
    /// `dat_ep_connect`.
    Connect,
    /// `dat_rsp_create` on this EP.
    Reserve,
    /// The EP's RSP was freed before a request arrived.
    Unreserve,
    /// A request arrived at the EP's RSP.
    RequestArrived,
    /// `dat_cr_accept` with this EP.
    Accept,
    /// `dat_cr_reject` of the request at the EP's RSP.
    Reject,
    /// The connection is up (QP in RTS).
    Established,
    /// The peer's consumer rejected the connection.
    PeerRejected,
    /// The connection was refused by the peer's provider (not by its
    /// consumer), or the retry budget ran out.
    NonPeerRejected,
    /// No route to the peer.
    Unreachable,
    /// The connect timeout expired.
    TimedOut,
    /// The TCP connection was refused (nobody listens yet).
    /// `budget_left`: the retry budget is not spent.
    Refused {
        /// Whether there is time left to try again.
        budget_left: bool,
    },
    /// The retry backoff elapsed.
    RetryDue,
    /// Completing an accepted connection failed.
    AcceptFailed,
    /// `dat_ep_disconnect`.
    Disconnect {
        /// `DAT_CLOSE_GRACEFUL_FLAG` (else abrupt).
        graceful: bool,
    },
    /// The transport connection closed (orderly or reset by the peer).
    Closed,
    /// The transport connection failed (Terminate, protocol error).
    Broken,
    /// `dat_ep_reset`.
    Reset,
}

impl EpEvent {
    /// Every event.
    pub const ALL: [EpEvent; 20] = [
        EpEvent::Connect,
        EpEvent::Reserve,
        EpEvent::Unreserve,
        EpEvent::RequestArrived,
        EpEvent::Accept,
        EpEvent::Reject,
        EpEvent::Established,
        EpEvent::PeerRejected,
        EpEvent::NonPeerRejected,
        EpEvent::Unreachable,
        EpEvent::TimedOut,
        EpEvent::Refused { budget_left: true },
        EpEvent::Refused { budget_left: false },
        EpEvent::RetryDue,
        EpEvent::AcceptFailed,
        EpEvent::Disconnect { graceful: true },
        EpEvent::Disconnect { graceful: false },
        EpEvent::Closed,
        EpEvent::Broken,
        EpEvent::Reset,
    ];
}

/// A connection event for the EP's connection EVD
/// (`DAT_CONNECTION_EVENT_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConnEvent {
    /// `ESTABLISHED`.
    Established,
    /// `PEER_REJECTED`.
    PeerRejected,
    /// `NON_PEER_REJECTED`.
    NonPeerRejected,
    /// `ACCEPT_COMPLETION_ERROR`.
    AcceptCompletionError,
    /// `DISCONNECTED`.
    Disconnected,
    /// `BROKEN`.
    Broken,
    /// `TIMED_OUT`.
    TimedOut,
    /// `UNREACHABLE`.
    Unreachable,
}

impl ConnEvent {
    /// The `DAT_EVENT_NUMBER`.
    pub const fn event_number(self) -> u32 {
        match self {
            ConnEvent::Established => 0x4001,
            ConnEvent::PeerRejected => 0x4002,
            ConnEvent::NonPeerRejected => 0x4003,
            ConnEvent::AcceptCompletionError => 0x4004,
            ConnEvent::Disconnected => 0x4005,
            ConnEvent::Broken => 0x4006,
            ConnEvent::TimedOut => 0x4007,
            ConnEvent::Unreachable => 0x4008,
        }
    }
}

/// Settings of the machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EpPolicy {
    /// Retry a refused TCP connection within the connect timeout instead
    /// of failing at once.
    pub retry_refused: bool,
}

/// The result of an event: the next state and the connection event to
/// report, if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// The state after the event.
    pub next: EpState,
    /// What to queue on the connection EVD.
    pub report: Option<ConnEvent>,
}

const fn to(next: EpState) -> Step {
    Step { next, report: None }
}

const fn report(next: EpState, ev: ConnEvent) -> Step {
    Step {
        next,
        report: Some(ev),
    }
}

/// Applies `ev` to an EP in `state`.
///
/// # Errors
///
/// `DAT_INVALID_STATE` with the subtype of `state` for a pair that is not
/// allowed (the state is unchanged).
pub fn step(state: EpState, ev: EpEvent, policy: EpPolicy) -> Result<Step, DatError> {
    use EpEvent as E;
    use EpState as S;
    let d = S::Disconnected;
    Ok(match (state, ev) {
        (S::Unconnected, E::Connect) => to(S::ActiveConnectionPending),
        (S::Unconnected, E::Reserve) => to(S::Reserved),
        (S::Unconnected, E::Accept) => to(S::PassiveConnectionPending),
        (S::Unconnected, E::Reset) => to(S::Unconnected),
        (S::Reserved, E::Unreserve) => to(S::Unconnected),
        (S::Reserved, E::RequestArrived) => to(S::TentativeConnectionPending),
        (S::TentativeConnectionPending, E::Accept) => to(S::PassiveConnectionPending),
        (S::TentativeConnectionPending, E::Reject) => to(S::Unconnected),
        (S::PassiveConnectionPending | S::ActiveConnectionPending, E::Established) => {
            report(S::Connected, ConnEvent::Established)
        }
        (S::PassiveConnectionPending, E::AcceptFailed) => {
            report(d, ConnEvent::AcceptCompletionError)
        }
        (S::ActiveConnectionPending, E::PeerRejected) => report(d, ConnEvent::PeerRejected),
        (S::ActiveConnectionPending, E::NonPeerRejected) => report(d, ConnEvent::NonPeerRejected),
        (S::ActiveConnectionPending, E::Unreachable) => report(d, ConnEvent::Unreachable),
        (S::ActiveConnectionPending | S::ConnectRetry, E::TimedOut) => {
            report(d, ConnEvent::TimedOut)
        }
        (S::ActiveConnectionPending, E::Refused { budget_left }) => {
            if budget_left && policy.retry_refused {
                to(S::ConnectRetry)
            } else {
                report(d, ConnEvent::NonPeerRejected)
            }
        }
        (S::ConnectRetry, E::RetryDue) => to(S::ActiveConnectionPending),
        (
            S::PassiveConnectionPending | S::ActiveConnectionPending | S::ConnectRetry,
            E::Disconnect { .. },
        ) => report(d, ConnEvent::Disconnected),
        (S::PassiveConnectionPending | S::Connected, E::Closed) => {
            report(d, ConnEvent::Disconnected)
        }
        (S::PassiveConnectionPending | S::Connected, E::Broken) => report(d, ConnEvent::Broken),
        (S::Connected, E::Disconnect { graceful: true }) => to(S::DisconnectPending),
        (S::Connected, E::Disconnect { graceful: false }) => report(d, ConnEvent::Disconnected),
        (S::DisconnectPending, E::Disconnect { graceful: true }) => to(S::DisconnectPending),
        // The disconnect was asked for: however the transport ends, it is
        // the disconnect completing.
        (S::DisconnectPending, E::Disconnect { graceful: false } | E::Closed | E::Broken) => {
            report(d, ConnEvent::Disconnected)
        }
        (S::Disconnected, E::Reset) => to(S::Unconnected),
        (S::Disconnected, E::Disconnect { .. } | E::Closed | E::Broken) => to(d),
        (s, _) => return Err(s.invalid()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ConnEvent as C;
    use EpEvent as E;
    use EpState as S;

    /// The allowed pairs, written out independently of `step`.
    fn expected(s: S, e: E, retry: bool) -> Option<(S, Option<C>)> {
        let d = S::Disconnected;
        let table: &[(S, E, S, Option<C>)] = &[
            (S::Unconnected, E::Connect, S::ActiveConnectionPending, None),
            (S::Unconnected, E::Reserve, S::Reserved, None),
            (S::Unconnected, E::Accept, S::PassiveConnectionPending, None),
            (S::Unconnected, E::Reset, S::Unconnected, None),
            (S::Reserved, E::Unreserve, S::Unconnected, None),
            (
                S::Reserved,
                E::RequestArrived,
                S::TentativeConnectionPending,
                None,
            ),
            (
                S::TentativeConnectionPending,
                E::Accept,
                S::PassiveConnectionPending,
                None,
            ),
            (
                S::TentativeConnectionPending,
                E::Reject,
                S::Unconnected,
                None,
            ),
            (
                S::PassiveConnectionPending,
                E::Established,
                S::Connected,
                Some(C::Established),
            ),
            (
                S::PassiveConnectionPending,
                E::AcceptFailed,
                d,
                Some(C::AcceptCompletionError),
            ),
            (
                S::PassiveConnectionPending,
                E::Disconnect { graceful: true },
                d,
                Some(C::Disconnected),
            ),
            (
                S::PassiveConnectionPending,
                E::Disconnect { graceful: false },
                d,
                Some(C::Disconnected),
            ),
            (
                S::PassiveConnectionPending,
                E::Closed,
                d,
                Some(C::Disconnected),
            ),
            (S::PassiveConnectionPending, E::Broken, d, Some(C::Broken)),
            (
                S::ActiveConnectionPending,
                E::Established,
                S::Connected,
                Some(C::Established),
            ),
            (
                S::ActiveConnectionPending,
                E::PeerRejected,
                d,
                Some(C::PeerRejected),
            ),
            (
                S::ActiveConnectionPending,
                E::NonPeerRejected,
                d,
                Some(C::NonPeerRejected),
            ),
            (
                S::ActiveConnectionPending,
                E::Unreachable,
                d,
                Some(C::Unreachable),
            ),
            (
                S::ActiveConnectionPending,
                E::TimedOut,
                d,
                Some(C::TimedOut),
            ),
            (
                S::ActiveConnectionPending,
                E::Refused { budget_left: false },
                d,
                Some(C::NonPeerRejected),
            ),
            (
                S::ActiveConnectionPending,
                E::Disconnect { graceful: true },
                d,
                Some(C::Disconnected),
            ),
            (
                S::ActiveConnectionPending,
                E::Disconnect { graceful: false },
                d,
                Some(C::Disconnected),
            ),
            (
                S::ConnectRetry,
                E::RetryDue,
                S::ActiveConnectionPending,
                None,
            ),
            (S::ConnectRetry, E::TimedOut, d, Some(C::TimedOut)),
            (
                S::ConnectRetry,
                E::Disconnect { graceful: true },
                d,
                Some(C::Disconnected),
            ),
            (
                S::ConnectRetry,
                E::Disconnect { graceful: false },
                d,
                Some(C::Disconnected),
            ),
            (
                S::Connected,
                E::Disconnect { graceful: true },
                S::DisconnectPending,
                None,
            ),
            (
                S::Connected,
                E::Disconnect { graceful: false },
                d,
                Some(C::Disconnected),
            ),
            (S::Connected, E::Closed, d, Some(C::Disconnected)),
            (S::Connected, E::Broken, d, Some(C::Broken)),
            (
                S::DisconnectPending,
                E::Disconnect { graceful: true },
                S::DisconnectPending,
                None,
            ),
            (
                S::DisconnectPending,
                E::Disconnect { graceful: false },
                d,
                Some(C::Disconnected),
            ),
            (S::DisconnectPending, E::Closed, d, Some(C::Disconnected)),
            (S::DisconnectPending, E::Broken, d, Some(C::Disconnected)),
            (S::Disconnected, E::Reset, S::Unconnected, None),
            (S::Disconnected, E::Disconnect { graceful: true }, d, None),
            (S::Disconnected, E::Disconnect { graceful: false }, d, None),
            (S::Disconnected, E::Closed, d, None),
            (S::Disconnected, E::Broken, d, None),
        ];
        if s == S::ActiveConnectionPending && e == (E::Refused { budget_left: true }) {
            return Some(if retry {
                (S::ConnectRetry, None)
            } else {
                (d, Some(C::NonPeerRejected))
            });
        }
        table
            .iter()
            .find(|(ts, te, _, _)| *ts == s && *te == e)
            .map(|&(_, _, n, r)| (n, r))
    }

    #[test]
    fn every_state_event_pair() {
        for retry in [false, true] {
            let policy = EpPolicy {
                retry_refused: retry,
            };
            let mut allowed = 0;
            for s in S::ALL {
                for e in E::ALL {
                    let got = step(s, e, policy);
                    match expected(s, e, retry) {
                        Some((next, rep)) => {
                            allowed += 1;
                            assert_eq!(got, Ok(Step { next, report: rep }), "{s:?} {e:?}");
                        }
                        None => assert_eq!(got, Err(s.invalid()), "{s:?} {e:?}"),
                    }
                }
            }
            assert_eq!(allowed, 40);
        }
    }

    #[test]
    fn retry_state_looks_like_active_pending_to_consumers() {
        assert_eq!(
            S::ConnectRetry.dat_state(),
            S::ActiveConnectionPending.dat_state()
        );
        assert_eq!(S::ConnectRetry.subtype(), Subtype::EpActConnPending);
    }

    #[test]
    fn only_connected_eps_post_send_work() {
        for s in S::ALL {
            assert_eq!(s.may_post_send().is_ok(), s == S::Connected, "{s:?}");
            assert!(s.may_post_recv().is_ok());
        }
    }

    #[test]
    fn a_full_life_and_reuse() {
        let p = EpPolicy {
            retry_refused: true,
        };
        let mut s = S::Unconnected;
        for (e, want) in [
            (E::Connect, None),
            (E::Refused { budget_left: true }, None),
            (E::RetryDue, None),
            (E::Established, Some(C::Established)),
            (E::Disconnect { graceful: true }, None),
            (E::Closed, Some(C::Disconnected)),
            (E::Reset, None),
            (E::Connect, None),
            (E::Refused { budget_left: false }, Some(C::NonPeerRejected)),
        ] {
            let st = step(s, e, p).unwrap();
            assert_eq!(st.report, want, "{e:?}");
            s = st.next;
        }
        assert_eq!(s, S::Disconnected);
    }
}
