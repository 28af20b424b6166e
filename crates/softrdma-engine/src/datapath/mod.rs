//! The data path: what moves bytes between registered memory and the
//! connection.
//!
//! * [`tx`]: framing send-queue work and responses into FPDUs and writing
//!   them (direct sending by the posting thread, or by a datamover);
//! * [`rx`]: reading FPDUs, validating them and placing their data (direct
//!   placement), producing receive completions and responses;
//! * [`datamover`]: the per-CPU transmit threads and receive threads.
//!
//! The data path calls into the QP layer ([`crate::qp`]) for completion
//! order, ORD/IRD accounting and state changes; the QP layer calls the data
//! path through the transmit hand-off ([`crate::handoff`]) and the receive
//! threads. The modules stay importable as `crate::tx`, `crate::rx` and
//! `crate::datamover`.

pub(crate) mod datamover;
pub(crate) mod rx;
pub(crate) mod tx;
