//! Service points: a public service point (PSP) delivers every request
//! as a CR; a reserved service point (RSP) delivers the first request for
//! its EP and rejects the rest.

/// The kind of a service point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpKind {
    /// Public: accepts every request until freed.
    Psp,
    /// Reserved: one EP, one request.
    Rsp,
}

/// The state of a service point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpState {
    /// Listening.
    Listening,
    /// An RSP whose request was delivered.
    Used,
}

/// What to do with an arriving connection request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OnRequest {
    /// Queue a CR event on the SP's EVD.
    Deliver,
    /// Reject it (not the consumer's reject: the initiator sees
    /// `NON_PEER_REJECTED`).
    Reject,
}

/// A request arrives at a service point of `kind` in `state`.
pub const fn on_request(kind: SpKind, state: SpState) -> (SpState, OnRequest) {
    match (kind, state) {
        (SpKind::Psp, s) => (s, OnRequest::Deliver),
        (SpKind::Rsp, SpState::Listening) => (SpState::Used, OnRequest::Deliver),
        (SpKind::Rsp, SpState::Used) => (SpState::Used, OnRequest::Reject),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_state_pair() {
        use OnRequest::*;
        use SpKind::*;
        use SpState::*;
        assert_eq!(on_request(Psp, Listening), (Listening, Deliver));
        assert_eq!(on_request(Psp, Used), (Used, Deliver));
        assert_eq!(on_request(Rsp, Listening), (Used, Deliver));
        assert_eq!(on_request(Rsp, Used), (Used, Reject));
    }
}
