//! # softrdma-proto: the sans-IO protocol core
//!
//! The protocol state machines that sit between the wire codecs
//! ([`softrdma_wire`]) and the engine. Like the wire codecs this crate does
//! no IO, reads no clock (time is passed in), spawns no threads and contains
//! no `unsafe`: bytes go in, bytes and events come out.
//!
//! * [`mpa`]: MPA connection setup (RFC 5044 section 7, RFC 6581): the
//!   [`mpa::Initiator`] and [`mpa::Responder`] negotiation machines;
//! * [`rtr`]: the peer-to-peer "Ready to Receive" messages of RFC 6581;
//! * [`qp_state`]: the iWARP QP states, which transitions an application may
//!   request, what posting does in each state, and the connection-driven
//!   transitions as one table ([`qp_state::QpState::on_conn_event`]);
//! * [`conn`]: the DDP/RDMAP data path of one connection (RFC 5040, 5041,
//!   5044/6581 framing, 7306): [`conn::Connection`];
//! * [`mem`]: the [`mem::Memory`] trait through which the connection asks
//!   the engine about registered memory — it never touches memory itself;
//! * [`term`]: Terminate codes and what each means for the QP, in one table;
//! * [`types`]: work requests, completions, events, link actions;
//! * [`sim`]: a deterministic two-connection simulation harness with a
//!   simulated memory (used by `tests/sim.rs` and the fuzz targets);
//! * [`proxy`]: proxy offload rules — the message filter, the completion
//!   reorder buffer and the no-offload load guard.
//!
//! ## The connection core
//!
//! ```text
//!   engine (IO, threads, clock)                       softrdma-proto (pure)
//!  ┌────────────────────────────┐   inputs           ┌──────────────────────────────┐
//!  │ socket bytes ─────────────────handle_rx_bytes──▶│                              │
//!  │ readv into span ──────────────handle_rx_placed─▶│  Connection<R>               │
//!  │ post_send / post_recv ────────post_*───────────▶│   deframer (wire, direct     │
//!  │ FIN / RST / time ─────────────handle_fin/       │   placement) ─ DDP/RDMAP     │
//!  │                               handle_reset/     │   rules ─ MSNs ─ ORD/IRD ─   │
//!  │                               handle_timeout ──▶│   SQ/RQ ─ completion order ─ │
//!  │ close / abort ────────────────close/abort──────▶│   Terminate ─ QP state       │
//!  │                                                 │                              │
//!  │ what to read next ◀───────────rx_want───────────│  outputs                     │
//!  │ writev(head, spans, trailer) ◀poll_transmit─────│  (TxFpdu: header bytes +     │
//!  │   ...written ─────────────────handle_sent──────▶│   payload Spans + trailer)   │
//!  │ CQs ◀─────────────────────────poll_completion───│                              │
//!  │ events, FIN/shutdown/reset ◀──poll_output───────│                              │
//!  └────────────┬───────────────┘                    └──────────────┬───────────────┘
//!               │ impl Memory (per QP: knows the PD)                │ asks
//!               └──────── remote / local / atomic / invalidate / ◀──┘
//!                         local_op / srq_pop / copy_in / copy_out / crc_update
//! ```
//!
//! Zero copy both ways: on receive [`conn::RxWant::Place`] names the
//! [`mem::Span`] (region handle, offset, length) the next payload bytes of
//! the stream go to, so the engine reads them from the socket straight into
//! the destination and only reports them; on transmit [`conn::TxFpdu`]
//! describes an FPDU as header bytes, payload spans into registered memory
//! and the trailer. See `docs/protocol-core.md` for how the engine drives it.
#![forbid(unsafe_code)]
#![cfg_attr(
    not(test),
    deny(clippy::panic, clippy::unwrap_used, clippy::expect_used)
)]

pub use softrdma_wire as wire;

pub mod conn;
pub mod dat;
pub mod mem;
pub mod mpa;
pub mod order;
pub mod proxy;
pub mod qp_state;
pub mod rtr;
pub mod sim;
pub mod term;
pub mod types;
