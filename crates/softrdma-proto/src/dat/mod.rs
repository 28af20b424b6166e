//! The DAT 2.0 (uDAPL) object rules as data: the state machines of
//! endpoints, event dispatchers, notification objects, connection
//! requests and service points, the `DAT_RETURN` status codes, and the
//! connection-qualifier ↔ TCP port rule.
//!
//! Nothing here does IO; `softrdma-dat` drives these machines with the
//! engine's events and `softrdma-dapl` exposes them through the C ABI.
//! Every transition function is total: a pair that is not allowed returns
//! the DAT status the operation must fail with.

pub mod addr;
pub mod cno;
pub mod cr;
pub mod ep;
pub mod evd;
pub mod ret;
pub mod sp;

pub use ret::{DatError, ErrorType, Subtype};
