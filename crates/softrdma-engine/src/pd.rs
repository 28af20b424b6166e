//! Protection domains (`ibv_pd`): the unit of memory protection. A queue
//! pair reaches only regions and windows of its own protection domain
//! (RFC 5040 section 2.1: an STag not associated with the stream is a
//! protection error).

use std::sync::Arc;

use crate::device::Device;
use crate::mr::{Access, MemoryRegion, MemoryWindow, RegError};
use crate::sys::mem::{MemError, Memory};

// `ProtectionDomain::register_raw`: its `unsafe` stays in a file of `sys/`.
#[allow(unsafe_code)]
#[path = "sys/register_raw.rs"]
mod register_raw;

/// A protection domain. A cheap, cloneable handle; regions, windows and
/// queue pairs created from it keep it (and its device) alive.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    inner: Arc<PdInner>,
}

#[derive(Debug)]
struct PdInner {
    device: Device,
    id: u32,
}

impl From<MemError> for RegError {
    fn from(e: MemError) -> Self {
        match e {
            MemError::TooLarge(len) => RegError::TooLarge {
                len: len as u64,
                max: isize::MAX as u64,
            },
            MemError::OutOfMemory(len) => RegError::OutOfMemory(len),
        }
    }
}

// The device's constructor of protection domains lives here, so that the
// device (a lower layer) does not name this module.
impl Device {
    /// Allocates a protection domain (`ibv_alloc_pd`).
    pub fn alloc_pd(&self) -> ProtectionDomain {
        ProtectionDomain::new(self)
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `device` (`ibv_alloc_pd`).
    pub fn new(device: &Device) -> ProtectionDomain {
        ProtectionDomain {
            inner: Arc::new(PdInner {
                device: device.clone(),
                id: device.alloc_pd_id(),
            }),
        }
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The identifier, unique on the device.
    pub fn id(&self) -> u32 {
        self.inner.id
    }

    /// Registers `len` fresh zeroed bytes, page aligned, owned by the region
    /// (`ibv_reg_mr` on a new buffer). `len` 0 is allowed.
    ///
    /// # Errors
    ///
    /// [`RegError::InvalidAccess`] (remote write or atomic without local
    /// write), [`RegError::TooLarge`], [`RegError::OutOfMemory`],
    /// [`RegError::TableFull`].
    ///
    /// # Example
    ///
    /// ```
    /// use softrdma_engine::{Access, Device, ProtectionDomain};
    /// let dev = Device::open_default()?;
    /// let pd = ProtectionDomain::new(&dev);
    /// let mr = pd.register(4096, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// mr.write(0, b"hello")?;
    /// let mut out = [0u8; 5];
    /// mr.read(0, &mut out)?;
    /// assert_eq!(&out, b"hello");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn register(&self, len: usize, access: Access) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(len)?;
        let mem = Memory::alloc_zeroed(len)?;
        MemoryRegion::new(self, mem, access, false)
    }

    /// Registers the bytes of `buf`, taking ownership (no copy). The
    /// region's length is `buf.len()`.
    ///
    /// # Errors
    ///
    /// As [`ProtectionDomain::register`].
    pub fn register_vec(&self, buf: Vec<u8>, access: Access) -> Result<MemoryRegion, RegError> {
        if !access.is_valid() {
            return Err(RegError::InvalidAccess(access));
        }
        self.check_len(buf.len())?;
        MemoryRegion::new(self, Memory::from_vec(buf), access, false)
    }

    /// Allocates a fast-register region of up to `max_len` bytes
    /// (`ib_alloc_mr` with `IB_MR_TYPE_MEM_REG`): zeroed memory owned by
    /// the region, STag invalid until a fast-register work request gives it
    /// an address, a length, rights and a key.
    ///
    /// # Errors
    ///
    /// [`RegError::TooLarge`], [`RegError::OutOfMemory`],
    /// [`RegError::TableFull`].
    pub fn alloc_mr(&self, max_len: usize) -> Result<MemoryRegion, RegError> {
        self.check_len(max_len)?;
        let mem = Memory::alloc_zeroed(max_len)?;
        MemoryRegion::new(self, mem, Access::NONE, true)
    }

    /// Allocates an unbound type 2 memory window (`ibv_alloc_mw`).
    ///
    /// # Errors
    ///
    /// [`RegError::TableFull`].
    pub fn alloc_mw(&self) -> Result<MemoryWindow, RegError> {
        MemoryWindow::new(self)
    }

    pub(crate) fn check_len(&self, len: usize) -> Result<(), RegError> {
        let max = self.device().attr().max_mr_size;
        let len = len as u64;
        if len > max {
            return Err(RegError::TooLarge { len, max });
        }
        Ok(())
    }
}
