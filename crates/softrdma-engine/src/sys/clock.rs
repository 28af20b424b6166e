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
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// `clock_gettime(id)` in nanoseconds.
fn clock_ns(id: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the engine asks only for
    // CLOCK_MONOTONIC and CLOCK_MONOTONIC_COARSE, which exist on every
    // Linux since 2.6.32, so the call cannot fail (the zeroed value stands
    // if it did).
    unsafe {
        libc::clock_gettime(id, &mut ts);
    }
    u64::try_from(ts.tv_sec)
        .unwrap_or(0)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(u64::try_from(ts.tv_nsec).unwrap_or(0))
}

/// The coarse monotonic clock in nanoseconds (`CLOCK_MONOTONIC_COARSE`:
/// the same clock as [`monotonic_ns`] as of the kernel's last tick, read
/// from memory without the time-stamp counter, several times cheaper on
/// a virtual machine). Never ahead of [`monotonic_ns`]; behind it by
/// about [`coarse_resolution_ns`] at most while the CPU that keeps the
/// time runs (further when a virtual CPU was not run: 4.6 ms and more
/// with a 4 ms step seen under load).
pub(crate) fn monotonic_coarse_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

/// The step of [`monotonic_coarse_ns`] (`clock_getres`: the kernel's tick,
/// 1–10 ms), asked once.
pub(crate) fn coarse_resolution_ns() -> u64 {
    static RES: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *RES.get_or_init(|| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid, writable timespec.
        let ret = unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
        let ns = u64::try_from(ts.tv_sec)
            .unwrap_or(0)
            .saturating_mul(1_000_000_000)
            .saturating_add(u64::try_from(ts.tv_nsec).unwrap_or(0));
        // A tick of 10 ms (HZ=100) if the kernel would not say.
        if ret < 0 || ns == 0 { 10_000_000 } else { ns }
    })
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

    /// The coarse clock is the fine one as of the kernel's last tick:
    /// never ahead of it, and it moves (by at least a step over a sleep
    /// of a few steps). How far it trails is not asserted: about a step,
    /// more when the virtual CPU that keeps the time was not running.
    #[test]
    fn the_coarse_clock_is_never_ahead_of_the_fine_one_and_moves() {
        let res = super::coarse_resolution_ns();
        assert!((1..=10_000_000).contains(&res), "{res}");
        let first = super::monotonic_coarse_ns();
        for _ in 0..1000 {
            let coarse = super::monotonic_coarse_ns();
            let after = super::monotonic_ns();
            assert!(coarse <= after, "coarse {coarse} ahead of {after}");
        }
        std::thread::sleep(std::time::Duration::from_nanos(4 * res));
        let later = super::monotonic_coarse_ns();
        assert!(later >= first + res, "{first} then {later}, step {res}");
    }
}
