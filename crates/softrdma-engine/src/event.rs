//! Async events (stub, being written).

/// The async event queue of a device.
#[derive(Debug)]
pub(crate) struct AsyncEventQueue {}

impl AsyncEventQueue {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(AsyncEventQueue {})
    }
}
