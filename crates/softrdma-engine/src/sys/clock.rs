//! The engine's clock: every reading of the time outside tests goes through
//! here, so that the rest of the engine stays free of direct clock calls
//! (like its IO and `unsafe`).

use std::time::Instant;

/// The current time (monotonic).
#[allow(clippy::disallowed_methods)] // the engine's one reading of the clock
pub(crate) fn now() -> Instant {
    Instant::now()
}
