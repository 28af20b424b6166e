//! Registered memory (stub, being written).

/// Memory that can be registered.
#[derive(Debug)]
pub(crate) struct Memory {}
