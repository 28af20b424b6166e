//! What a QP knows of proxy offload ([`crate::proxy`], built on the QP):
//! the route its completions take once it is a proxy QP
//! ([`CompletionRoute`]), and why it could not become one
//! ([`ProxySetupError`], re-exported from `proxy`).

use std::sync::Arc;

use softrdma_proto::conn::MsgInfo;
use softrdma_proto::types::Completion;

use super::QpInner;
use crate::state::QpState;
use crate::sys::mem::Memory;
use crate::wc::WorkCompletion;

/// Where a proxy QP's completions go instead of straight to its CQs: the
/// proxy's filter and completion sequencer. Installed once, at attach
/// (`QpInner::proxy`); `proxy::ProxyLink` is the one implementation, and
/// the proxy thread gets it back by downcasting (hence `Any`).
pub(crate) trait CompletionRoute: std::any::Any + Send + Sync + std::fmt::Debug {
    /// Delivers a completion of `qp` in order (`send`: of the send queue);
    /// true if a CQ overflowed.
    fn deliver(&self, qp: &QpInner, wc: WorkCompletion, send: bool, solicited: bool) -> bool;

    /// A completion the protocol core produced for `qp` (`wc` is its verbs
    /// form, `info` what a successful receive carried); true if a CQ
    /// overflowed.
    fn core_completion(
        &self,
        qp: &QpInner,
        c: &Completion,
        wc: WorkCompletion,
        info: Option<MsgInfo<Arc<Memory>>>,
    ) -> bool;
}

/// Why a QP could not become a proxy QP.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProxySetupError {
    /// The QP is not IDLE.
    #[error("QP {qp_num} is in state {state}; it can become a proxy QP only in IDLE")]
    NotIdle {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The QP is already a proxy QP.
    #[error("QP {qp_num} is already a proxy QP")]
    AlreadyProxy {
        /// The QP.
        qp_num: u32,
    },
    /// A CQ of the QP is not a proxy CQ of this proxy.
    #[error(
        "QP {qp_num}: its {queue} CQ {cq_id} is not a proxy CQ of proxy {proxy} (it belongs to {found:?})"
    )]
    CqNotProxy {
        /// The QP.
        qp_num: u32,
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// The CQ.
        cq_id: u32,
        /// The proxy the QP is attached to.
        proxy: u32,
        /// The proxy the CQ belongs to, if any.
        found: Option<u32>,
    },
    /// The proxy has been shut down.
    #[error("proxy {0} is shut down")]
    ProxyStopped(u32),
}
