//! Protection domains (`ibv_pd`): the unit of memory protection. A queue
//! pair reaches only regions and windows of its own protection domain
//! (RFC 5040 section 2.1: an STag not associated with the stream is a
//! protection error).

use std::sync::Arc;

use crate::device::Device;
use crate::stags::RegError;

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

    pub(crate) fn check_len(&self, len: usize) -> Result<(), RegError> {
        let max = self.device().attr().max_mr_size;
        let len = len as u64;
        if len > max {
            return Err(RegError::TooLarge { len, max });
        }
        Ok(())
    }
}
