//! Protection domains (stub, being written).

/// A protection domain.
#[derive(Debug)]
pub struct ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a fast-register region (stub).
    pub fn alloc_mr(&self) {}
}
