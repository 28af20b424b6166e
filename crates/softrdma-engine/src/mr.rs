//! Memory regions and windows (stub, being written).

/// Access flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(u32);

impl Access {
    /// Remote peers may write.
    pub const MW_BIND: Access = Access(16);
}

/// A memory region.
#[derive(Debug)]
pub struct MemoryRegion {}

/// A memory window.
#[derive(Debug)]
pub struct MemoryWindow {}

/// The registration table.
#[derive(Debug)]
pub(crate) struct StagTable {}

impl StagTable {
    pub(crate) fn new() -> Self {
        StagTable {}
    }
}
