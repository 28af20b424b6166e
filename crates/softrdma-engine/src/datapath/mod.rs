//! The data path: what moves bytes between registered memory and the
//! connection.
//!
//! * [`conn_io`]: the socket IO of one connection driven by the protocol
//!   core (`softrdma_proto::conn::Connection`, which holds the receive and
//!   transmit rules, the one FPDU framer — the wire crate's deframer — and
//!   the ORD/IRD, send, receive and completion queues): `RxIo` reads FPDUs
//!   and places payloads straight into registered memory, `TxIo` writes
//!   the FPDUs the core frames with vectored, non-blocking writes;
//! * [`datamover`]: the per-CPU engine threads (transmit and receive).
//!
//! The QP layer (`qp/core_path.rs`) holds each connection under one lock
//! and drives these; the engine threads see a QP only through the narrow
//! trait `datamover::DmQp` (implemented in `qp/dm.rs`), so this module
//! does not import `qp`. The modules stay importable as `crate::datamover`.

pub(crate) mod conn_io;
pub(crate) mod datamover;
pub(crate) mod staging;
