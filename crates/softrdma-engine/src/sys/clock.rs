//! The engine's clock: every reading of the time outside tests goes through
//! here, so that the rest of the engine stays free of direct clock calls
//! (like its IO and `unsafe`).

use std::time::Instant;

/// The current time (monotonic).
#[allow(clippy::disallowed_methods)] // the engine's one reading of the clock
pub(crate) fn now() -> Instant {
    Instant::now()
}

/// The time since `since` (`Instant::elapsed`, which reads the clock).
pub(crate) fn elapsed(since: Instant) -> std::time::Duration {
    now().saturating_duration_since(since)
}

/// The monotonic clock in nanoseconds (the clock [`Instant`] reads, from
/// an arbitrary start): one `clock_gettime` and no conversion through
/// `Instant`/`Duration`, for the data path's time stamps (several per
/// message).
pub(crate) fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on
    // every Linux, so the call cannot fail (the zeroed value stands if it
    // did).
    unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
    }
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

#[cfg(test)]
mod tests {
    /// The raw clock runs with `Instant` (the same clock) and never back.
    #[test]
    fn monotonic_ns_follows_instant() {
        let a = super::monotonic_ns();
        let i = super::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let waited = u64::try_from(i.elapsed().as_nanos()).unwrap();
        let b = super::monotonic_ns();
        assert!(b >= a + 20_000_000, "{a} {b}");
        assert!(
            b - a >= waited,
            "the raw reading brackets Instant's: {} < {waited}",
            b - a
        );
    }
}
