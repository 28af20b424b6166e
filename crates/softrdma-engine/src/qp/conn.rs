//! The engine's side of the protocol core's per-connection state machine
//! (`softrdma_proto::conn::Connection`): its configuration from what the
//! QP was created with and what the connection settled, and the
//! conversions of work requests, completions, post errors and events
//! between the verbs types (`wr.rs`, `wc.rs`, `event.rs`) and the core's
//! `types` (used by `core_path`).
//!
//! The conversions are checked by running the same work requests through
//! a connected engine QP pair and through a pair of bare `Connection`s
//! (`ConnState`, test-only) over the same device's STag table
//! (`tests::core_matches_engine_*`): until the engine's own data path was
//! deleted these compared the two paths; they now compare the engine's
//! sockets, threads, placement and conversions around the core with the
//! core alone.

#[cfg(test)]
use std::sync::Arc;

use softrdma_proto::conn::Config;
#[cfg(test)]
use softrdma_proto::conn::Connection;
use softrdma_proto::mem::LocalOp;
use softrdma_proto::types as ct;

use super::{LinkParams, PostRecvError, PostSendError, QpCap};
use crate::event::AsyncEventKind;
#[cfg(test)]
use crate::sys::mem::Memory;
use crate::wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{RecvWr, SendFlags, SendOp, SendWr, Sge};

/// What a connection's [`Config`] is made of besides the link parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnSetup {
    /// The QP's queue sizes and SGE / inline caps.
    pub(crate) cap: QpCap,
    /// The QP's IRD.
    pub(crate) ird: u32,
    /// The QP's ORD (before the peer's IRD limits it).
    pub(crate) ord: u32,
    /// Largest payload per FPDU (the engine's `TxLink::max_payload`).
    pub(crate) max_payload: usize,
    /// Receives come from a shared receive queue.
    pub(crate) srq: bool,
    /// Proxy QP: the core reports what each receive carried.
    pub(crate) message_info: bool,
    /// Receive buffers kept for their next post
    /// ([`QpInitAttr::keep_recvs`](super::QpInitAttr::keep_recvs)).
    pub(crate) keep_recvs: bool,
    /// Graceful close timeout, in the unit of the `now` values the engine
    /// passes (nanoseconds of the engine clock).
    pub(crate) close_timeout: u64,
}

/// The core's configuration of a connection: what the QP was created with
/// (`setup`) and what MPA negotiation and RTR settled (`link`).
pub(crate) fn config(setup: &ConnSetup, link: &LinkParams) -> Config {
    let cap = &setup.cap;
    Config {
        crc: link.crc,
        ird: setup.ird,
        ord: setup.ord.min(u32::from(link.peer_ird)),
        max_payload: setup.max_payload,
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        srq: setup.srq,
        close_timeout: setup.close_timeout,
        tx_msn: [link.msns.send_tx.0, link.msns.read_tx.0],
        rx_msn: [link.msns.send_rx.0, link.msns.read_rx.0],
        max_inline: cap.max_inline_data as usize,
        max_send_sge: cap.max_send_sge as usize,
        max_recv_sge: cap.max_recv_sge as usize,
        message_info: setup.message_info,
        keep_recvs: setup.keep_recvs,
        // The engine reports whether its FIN went out (a reset after the
        // peer's FIN makes it fail: reported at once, not as a close).
        confirm_fin: true,
    }
}

/// A bare connection for the tests: the protocol core's state machine
/// over the engine's registered memory (`Arc<Memory>` regions), without
/// the engine's sockets and threads.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct ConnState {
    /// The protocol core.
    pub(crate) conn: Connection<Arc<Memory>>,
}

#[cfg(test)]
impl ConnState {
    /// A connection in RTS with `cfg`.
    pub(crate) fn new(cfg: Config) -> Self {
        ConnState {
            conn: Connection::new(cfg),
        }
    }
}

/// The key an STag lookup never finds (index 0 is never allocated): a
/// window or region of another device becomes a request that fails, as the
/// engine's by-object bind and fast-register fail with `OtherDevice`.
const NO_KEY: u32 = 0;

/// The verbs name of an operation (the `op` of [`PostSendError::Invalid`]).
fn op_name(op: &SendOp<'_>) -> &'static str {
    match op {
        SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => "Send",
        SendOp::Write { .. } | SendOp::WriteWithImm { .. } => "RDMA Write",
        SendOp::Read { .. } => "RDMA Read",
        SendOp::FetchAdd { .. } => "FetchAdd",
        SendOp::CmpSwap { .. } => "CmpSwap",
        SendOp::LocalInv { .. } => "LocalInv",
        SendOp::BindMw { .. } => "BindMw",
        SendOp::FastReg { .. } => "FastReg",
    }
}

/// The core's operation for a verbs one. `stags` is the QP's device's
/// table: windows and regions of another device get [`NO_KEY`].
fn core_op(op: &SendOp<'_>, stags: &crate::mr::StagTable) -> ct::SendOp {
    let ours = |t: &crate::mr::StagTable| std::ptr::eq(t, stags);
    match *op {
        SendOp::Send => ct::SendOp::Send {
            inv: None,
            imm: None,
        },
        SendOp::SendWithImm { imm } => ct::SendOp::Send {
            inv: None,
            imm: Some(imm),
        },
        SendOp::SendWithInv { invalidate_rkey } => ct::SendOp::Send {
            inv: Some(invalidate_rkey),
            imm: None,
        },
        SendOp::Write { remote_addr, rkey } => ct::SendOp::Write {
            rkey,
            remote_addr,
            imm: None,
        },
        SendOp::WriteWithImm {
            remote_addr,
            rkey,
            imm,
        } => ct::SendOp::Write {
            rkey,
            remote_addr,
            imm: Some(imm),
        },
        SendOp::Read { remote_addr, rkey } => ct::SendOp::Read { rkey, remote_addr },
        SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        } => ct::SendOp::FetchAdd {
            rkey,
            remote_addr,
            add,
        },
        SendOp::CmpSwap {
            remote_addr,
            rkey,
            compare,
            swap,
        } => ct::SendOp::CmpSwap {
            rkey,
            remote_addr,
            compare,
            swap,
        },
        SendOp::LocalInv { rkey } => ct::SendOp::Local(LocalOp::Invalidate { rkey }),
        SendOp::BindMw {
            mw,
            mr,
            addr,
            length,
            access,
            key,
        } => {
            let same = ours(mw.pd.device().stags())
                && ours(mr.pd.device().stags())
                && mw.pd_id() == mr.pd_id();
            ct::SendOp::Local(LocalOp::BindMw {
                mw: if same { mw.rkey() } else { NO_KEY },
                mr: if same { mr.lkey() } else { NO_KEY },
                addr,
                len: length,
                access: access.bits(),
                key,
            })
        }
        SendOp::FastReg {
            mr,
            iova,
            length,
            access,
        } => ct::SendOp::Local(LocalOp::FastReg {
            mr: if ours(mr.pd.device().stags()) {
                mr.lkey()
            } else {
                NO_KEY
            },
            iova,
            len: length,
            access: access.bits(),
        }),
    }
}

fn core_sge(s: &Sge) -> ct::Sge {
    ct::Sge {
        lkey: s.lkey,
        addr: s.addr,
        len: s.length,
    }
}

/// Most SGEs converted without an allocation.
const SGES_ON_STACK: usize = 4;

/// Runs `f` on the core's form of the verbs send request `wr`
/// (`sq_sig_all`: every request is signaled). The inline payload is passed
/// only for Send and Write, the operations that carry one (the engine
/// ignores the inline flag on the others).
pub(crate) fn with_core_send<T>(
    wr: &SendWr<'_>,
    sq_sig_all: bool,
    stags: &crate::mr::StagTable,
    f: impl FnOnce(&ct::SendWr<'_>) -> T,
) -> T {
    let op = core_op(&wr.op, stags);
    let inline = (wr.flags.contains(SendFlags::INLINE)
        && matches!(op, ct::SendOp::Send { .. } | ct::SendOp::Write { .. }))
    .then_some(wr.inline);
    with_core_sgl(wr.sg_list, |sgl| {
        f(&ct::SendWr {
            wr_id: wr.wr_id,
            op,
            sgl,
            signaled: sq_sig_all || wr.flags.contains(SendFlags::SIGNALED),
            fence: wr.flags.contains(SendFlags::FENCE),
            solicited: wr.flags.contains(SendFlags::SOLICITED),
            inline,
            // The application's request; a proxy reply sets it (and posts
            // it unsignaled) before `Connection::prepare_send`.
            internal: false,
        })
    })
}

/// The core's form of `wr` if it is an inline Send without Immediate
/// Data and without a gather list (the one-pass send's candidates,
/// `Connection::post_send_framed`); `None` for anything else. As
/// [`with_core_send`] would convert it, without the gather list's copy.
pub(crate) fn core_inline_send<'a>(wr: &SendWr<'a>, sq_sig_all: bool) -> Option<ct::SendWr<'a>> {
    let inv = match wr.op {
        SendOp::Send => None,
        SendOp::SendWithInv { invalidate_rkey } => Some(invalidate_rkey),
        _ => return None,
    };
    if !wr.flags.contains(SendFlags::INLINE) || !wr.sg_list.is_empty() {
        return None;
    }
    Some(ct::SendWr {
        wr_id: wr.wr_id,
        op: ct::SendOp::Send { inv, imm: None },
        sgl: &[],
        signaled: sq_sig_all || wr.flags.contains(SendFlags::SIGNALED),
        fence: wr.flags.contains(SendFlags::FENCE),
        solicited: wr.flags.contains(SendFlags::SOLICITED),
        inline: Some(wr.inline),
        internal: false,
    })
}

/// Runs `f` on the core's form of the verbs receive `wr`.
pub(crate) fn with_core_recv<T>(wr: &RecvWr<'_>, f: impl FnOnce(&ct::RecvWr<'_>) -> T) -> T {
    with_core_sgl(wr.sg_list, |sgl| {
        f(&ct::RecvWr {
            wr_id: wr.wr_id,
            sgl,
        })
    })
}

/// Runs `f` on the core's form of a gather/scatter list, on the stack up
/// to `SGES_ON_STACK` entries.
fn with_core_sgl<T>(sg_list: &[Sge], f: impl FnOnce(&[ct::Sge]) -> T) -> T {
    let mut arr = [ct::Sge {
        lkey: 0,
        addr: 0,
        len: 0,
    }; SGES_ON_STACK];
    let vec: Vec<ct::Sge>;
    let sgl: &[ct::Sge] = if sg_list.len() <= SGES_ON_STACK {
        for (d, s) in arr.iter_mut().zip(sg_list) {
            *d = core_sge(s);
        }
        &arr[..sg_list.len()]
    } else {
        vec = sg_list.iter().map(core_sge).collect();
        &vec
    };
    f(sgl)
}

/// The engine's error for a send request the core refused.
pub(crate) fn send_error(e: ct::PostError, qp_num: u32, wr: &SendWr<'_>) -> PostSendError {
    let cap32 = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
    match e {
        ct::PostError::InvalidState(state) => PostSendError::InvalidState { qp_num, state },
        ct::PostError::QueueFull(depth) => PostSendError::QueueFull { depth },
        ct::PostError::TooManySges { count, max } => PostSendError::TooManySges {
            count,
            max: cap32(max),
        },
        ct::PostError::InlineTooLarge { len, max } => PostSendError::InlineTooLarge {
            len,
            max: cap32(max),
        },
        ct::PostError::Invalid(why) => PostSendError::Invalid {
            op: op_name(&wr.op),
            why,
        },
        // Only receives are refused for an SRQ.
        ct::PostError::HasSrq => PostSendError::Invalid {
            op: op_name(&wr.op),
            why: "refused by the shared receive queue",
        },
    }
}

/// The engine's error for a receive the core refused; `None` for a refusal
/// the core makes only for send requests (malformed or inline requests).
pub(crate) fn recv_error(e: ct::PostError, qp_num: u32) -> Option<PostRecvError> {
    match e {
        ct::PostError::InvalidState(state) => Some(PostRecvError::InvalidState { qp_num, state }),
        ct::PostError::QueueFull(depth) => Some(PostRecvError::QueueFull { depth }),
        ct::PostError::TooManySges { count, max } => Some(PostRecvError::TooManySges {
            count,
            max: u32::try_from(max).unwrap_or(u32::MAX),
        }),
        ct::PostError::HasSrq => Some(PostRecvError::HasSrq),
        ct::PostError::Invalid(_) | ct::PostError::InlineTooLarge { .. } => None,
    }
}

/// The engine's completion status.
pub(crate) fn wc_status(s: ct::WcStatus) -> WcStatus {
    use ct::WcStatus as S;
    match s {
        S::Success => WcStatus::Success,
        S::LocalLength => WcStatus::LocalLength,
        S::LocalQpOperation => WcStatus::LocalQpOperation,
        S::LocalProtection => WcStatus::LocalProtection,
        S::WrFlush => WcStatus::WrFlush,
        S::MwBind => WcStatus::MwBind,
        S::RemoteInvalidRequest => WcStatus::RemoteInvalidRequest,
        S::RemoteAccess => WcStatus::RemoteAccess,
        S::RemoteOperation => WcStatus::RemoteOperation,
        S::Fatal => WcStatus::Fatal,
        S::InvalidateError => WcStatus::InvalidateError,
        S::General => WcStatus::General,
    }
}

/// The engine's completion opcode.
pub(crate) fn wc_opcode(o: ct::WcOpcode) -> WcOpcode {
    use ct::WcOpcode as O;
    match o {
        O::Send => WcOpcode::Send,
        O::RdmaWrite => WcOpcode::RdmaWrite,
        O::RdmaRead => WcOpcode::RdmaRead,
        O::CompSwap => WcOpcode::CompSwap,
        O::FetchAdd => WcOpcode::FetchAdd,
        O::LocalInv => WcOpcode::LocalInv,
        O::BindMw => WcOpcode::BindMw,
        O::RegMr => WcOpcode::RegMr,
        O::Recv => WcOpcode::Recv,
        O::RecvRdmaWithImm => WcOpcode::RecvRdmaWithImm,
    }
}

/// The engine's work completion for a core completion of QP `qp_num`.
pub(crate) fn work_completion(c: &ct::Completion, qp_num: u32) -> WorkCompletion {
    let mut wc = WorkCompletion::error(c.wr_id, wc_opcode(c.opcode), qp_num, wc_status(c.status));
    wc.byte_len = c.byte_len;
    wc.vendor_err = c.vendor_err;
    let mut flags = WcFlags::NONE;
    if let Some(imm) = c.imm {
        wc.imm_data = imm;
        flags = flags | WcFlags::WITH_IMM;
    }
    if let Some(stag) = c.invalidated {
        wc.invalidated_rkey = stag;
        flags = flags | WcFlags::WITH_INV;
    }
    if c.solicited {
        flags = flags | WcFlags::SOLICITED;
    }
    wc.flags = flags;
    wc
}

/// The engine's async event kind.
pub(crate) fn event_kind(k: ct::AsyncKind) -> AsyncEventKind {
    use ct::AsyncKind as K;
    match k {
        K::QpFatal => AsyncEventKind::QpFatal,
        K::QpRequestError => AsyncEventKind::QpRequestError,
        K::QpAccessError => AsyncEventKind::QpAccessError,
        K::LlpClosed => AsyncEventKind::LlpClosed,
        K::LlpReset => AsyncEventKind::LlpReset,
        K::BadClose => AsyncEventKind::BadClose,
        K::TerminateReceived => AsyncEventKind::TerminateReceived,
        K::QpLastWqeReached => AsyncEventKind::QpLastWqeReached,
    }
}

/// The engine's async event of QP `qp_num` for a core event (the engine
/// adds its detail strings where it raises the event).
pub(crate) fn async_event(e: &ct::AsyncEvent, qp_num: u32) -> crate::event::AsyncEvent {
    let ev = crate::event::AsyncEvent::qp(event_kind(e.kind), qp_num);
    match e.term {
        Some(code) => ev.with_term(code),
        None => ev,
    }
}

#[cfg(test)]
mod tests;
