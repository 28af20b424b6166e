//! softrdma sockets direct (in progress).
#![forbid(unsafe_code)]
pub mod sdp;
