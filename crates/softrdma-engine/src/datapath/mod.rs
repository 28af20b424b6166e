//! The data path: what moves bytes between registered memory and the
//! connection.
//!
//! * [`tx`]: framing send-queue work and responses into FPDUs and writing
//!   them (direct sending by the posting thread, or by a datamover);
//! * [`rx`]: reading FPDUs, validating them and placing their data (direct
//!   placement), producing receive completions and responses; the FPDU
//!   framing is the wire crate's deframer
//!   (`softrdma_wire::deframer::Deframer`, direct-placement mode), the one
//!   framer of the project;
//! * [`datamover`]: the per-CPU engine threads (transmit and receive).
//!
//! The transmit path reaches its QP only through the narrow [`TxHost`]
//! trait (completion order, ORD/IRD accounting, the state), so `tx` does
//! not depend on the QP layer. The receive path still calls into
//! [`crate::qp`] directly (placement, receive queues, state changes); the
//! QP layer calls the data path through the transmit hand-off
//! ([`crate::handoff`]) and the engine threads. The modules stay importable as `crate::tx`, `crate::rx` and
//! `crate::datamover`.

pub(crate) mod conn_io;
pub(crate) mod datamover;
pub(crate) mod rx;
pub(crate) mod tx;

use crate::state::QpState;
use crate::wc::WcStatus;
use crate::wr::LocalSeg;

/// What the transmit path needs from the QP it transmits for.
pub(crate) trait TxHost {
    /// The QP's state.
    fn state(&self) -> QpState;
    /// Records the outcome of send-queue request `seq` (completion order).
    fn complete_sq(&self, seq: u64, status: WcStatus, byte_len: u32, vendor_err: u32);
    /// An inbound Read or atomic was fully answered: its IRD slot is free.
    fn release_ird(&self);
    /// Whether the send queue's head may go out now: a fenced request waits
    /// for every outstanding Read and atomic, a Read or atomic
    /// (`takes_slot`) for a free ORD slot (`softrdma_proto::order`).
    fn ord_may_start(&self, fenced: bool, takes_slot: bool) -> bool;
    /// A Read or atomic request went out: it waits for its response.
    fn push_ord(&self, r: OutRead);
}

/// An outstanding outbound Read or atomic (ORD entry): the protocol core's
/// type, with the engine's segments as sinks.
pub(crate) type OutRead = softrdma_proto::order::OutRead<LocalSeg>;

/// Kind of an [`OutRead`].
pub(crate) type OutReadKind = softrdma_proto::order::OutKind<LocalSeg>;
