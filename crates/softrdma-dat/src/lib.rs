//! The DAT 2.0 (uDAPL) object model over softrdma.
//!
//! DAT ("Direct Access Transport") is the RDMA API of the DAT
//! Collaborative; uDAPL is its user-space form. This crate gives its
//! objects, with their DAT 2.0 behaviour, over the softrdma engine's public
//! API, for Rust callers and for the `softrdma-dapl` provider that stock
//! `libdat2` loads:
//!
//! | DAT object | here | over |
//! |---|---|---|
//! | Interface Adapter (IA) | [`Ia`] (an IPv4/IPv6 address) | a [`Device`](softrdma_engine::Device) |
//! | Protection Zone | [`Pz`] | `ProtectionDomain` |
//! | Local Memory Region | [`Lmr`] | `MemoryRegion` |
//! | Remote Memory Region | [`Rmr`] | `MemoryWindow`, bound on the send queue |
//! | Event Dispatcher | [`Evd`] | a software queue, fed by a CQ callback for DTO/bind EVDs |
//! | Consumer Notification Object | [`Cno`] | a fan-in of EVDs |
//! | Endpoint | [`Ep`] | `QueuePair` + `cm::Connection` |
//! | Public / Reserved Service Point | [`Psp`], [`Rsp`] | `cm::Listener` |
//! | Connection Request | [`Cr`] | `cm::ConnRequest` |
//! | Shared Receive Queue | [`Srq`] | `SharedReceiveQueue` |
//!
//! The state machines are the data of [`softrdma_proto::dat`]; this crate
//! drives them. Connection work of an IA runs on one reactor thread per IA
//! (see [`Ia`]): listeners, connections, retry timers and the device's
//! asynchronous events are served from one `poll(2)` loop.
//!
//! Addressing: the IA address is an IP address; a connection qualifier is
//! a TCP port ([`softrdma_proto::dat::addr`]: `port = (qual + base) mod
//! 65536`, base 0 unless [`IaConfig::port_base`] says otherwise).
//! Connections always negotiate peer-to-peer mode (an RTR message), so the
//! passive side may send first.
//!
//! Errors are [`DatError`]s: the type and subtype of the `DAT_RETURN` the C
//! API returns, without loss.

mod cm;
mod ep;
mod evd;
mod fd;
mod ia;
mod mem;

pub use cm::{Cr, CrParam, Psp, Rsp, ServicePoint};
pub use ep::{
    CompletionFlags, DtoOp, DtoStatus, Ep, EpAttr, EpAttrChange, EpParam, LmrTriplet, RmrTriplet,
    Srq,
};
pub use evd::{AsyncKind, Cno, Evd, EvdFlags, Event};
pub use ia::{Ia, IaAttr, IaConfig};
pub use mem::{Lmr, MemPriv, Pz, Rmr};
pub use softrdma_proto::dat::ep::{ConnEvent, EpState};
pub use softrdma_proto::dat::{DatError, ErrorType, Subtype};

/// The result of a DAT operation.
pub type Result<T> = core::result::Result<T, DatError>;

/// Most private data of a connect, accept or reject (the engine's cap of
/// 256 octets minus the 4-octet header of a consumer reject).
pub const MAX_PRIVATE_DATA: usize = 252;

pub(crate) const fn err(ty: ErrorType, sub: Subtype) -> DatError {
    DatError::new(ty, sub)
}

pub(crate) fn check_private_data(pdata: &[u8]) -> Result<()> {
    if pdata.len() > MAX_PRIVATE_DATA {
        return Err(err(ErrorType::InvalidParameter, Subtype::None));
    }
    Ok(())
}

/// A process-unique identifier of an object.
pub(crate) fn next_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}
