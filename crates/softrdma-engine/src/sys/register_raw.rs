//! Registration of application memory, the public API's one `unsafe`
//! entry point. The file lives in `sys/` with the rest of the engine's
//! `unsafe`, but is compiled as a child of `mr` (`mr.rs` includes it with
//! `#[path]`, beside the other constructors of regions), so that `sys`
//! stays the bottom layer and never names the PD or region types
//! (`scripts/module-graph.py`).

impl crate::pd::ProtectionDomain {
    /// Registers `len` bytes at `ptr` owned by the caller (`ibv_reg_mr` on
    /// application memory).
    ///
    /// # Safety
    ///
    /// `ptr` must be valid for reads and writes of `len` bytes and stay
    /// valid (not freed, not reused) until the region is dropped **and**
    /// every work request that names it and every window bound to it are
    /// gone (they keep the memory registered). Remote peers and the engine
    /// write these bytes at any time, so the caller must not hold Rust
    /// references over them while remote access is possible.
    ///
    /// # Errors
    ///
    /// As [`ProtectionDomain::register`](crate::pd::ProtectionDomain::register).
    pub unsafe fn register_raw(
        &self,
        ptr: *mut u8,
        len: usize,
        access: crate::mr::Access,
    ) -> Result<crate::mr::MemoryRegion, crate::mr::RegError> {
        if !access.is_valid() {
            return Err(crate::mr::RegError::InvalidAccess(access));
        }
        self.check_len(len)?;
        // SAFETY: the caller's contract above is the one of
        // `Memory::external` (valid for `len` bytes while it lives).
        let mem = unsafe { crate::sys::mem::Memory::external(ptr, len) };
        crate::mr::MemoryRegion::new(self, mem, access, false)
    }
}
