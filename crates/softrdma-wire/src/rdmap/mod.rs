//! RDMAP (RFC 5040, RFC 7306).

pub mod atomic;
pub mod immediate;
pub mod read_request;
pub mod terminate;
