//! Per-thread state the library sets around its own work, restored on the
//! way out, a panic too (every entry point catches panics, so the thread
//! goes on serving the application).

thread_local! {
    /// Set while this library sets up a connection: descriptors made then
    /// (by the sockets-direct library and the engine) are moved to high
    /// numbers.
    static INTERNAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread is setting up a connection.
pub(crate) fn internal() -> bool {
    INTERNAL.with(|i| i.get())
}

/// Puts back this thread's previous `INTERNAL` when dropped.
struct RestoreInternal(bool);

impl Drop for RestoreInternal {
    fn drop(&mut self) {
        INTERNAL.with(|i| i.set(self.0));
    }
}

/// Runs `f` as connection set-up (descriptors made meanwhile are moved to
/// high numbers); the previous state comes back afterwards, a panic too.
pub(crate) fn as_internal<T>(f: impl FnOnce() -> T) -> T {
    let _restore = RestoreInternal(INTERNAL.with(|i| i.replace(true)));
    f()
}

/// Puts back this thread's previous signal mask when dropped.
struct RestoreMask(libc::sigset_t);

impl Drop for RestoreMask {
    fn drop(&mut self) {
        // SAFETY: a mask pthread_sigmask filled in.
        unsafe {
            libc::pthread_sigmask(libc::SIG_SETMASK, &raw const self.0, std::ptr::null_mut())
        };
    }
}

/// Runs `f` with every signal blocked in this thread, so threads it starts
/// (the engine's, a twin) never run the application's signal handlers; the
/// previous mask comes back afterwards, a panic too.
pub(crate) fn signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sigset_t is plain data, filled by sigfillset and by
    // pthread_sigmask; the old mask is restored when `_restore` drops.
    let _restore = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&raw mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &raw const all, &raw mut old);
        RestoreMask(old)
    };
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// This thread's blocked signals, from `/proc/thread-self/status`.
    fn blocked() -> u64 {
        let s = std::fs::read_to_string("/proc/thread-self/status").unwrap();
        let line = s.lines().find(|l| l.starts_with("SigBlk:")).unwrap();
        u64::from_str_radix(line["SigBlk:".len()..].trim(), 16).unwrap()
    }

    #[test]
    fn panic_in_as_internal_restores_internal() {
        assert!(!internal());
        let r = std::panic::catch_unwind(|| as_internal::<()>(|| panic!("in set-up")));
        assert!(r.is_err());
        assert!(!internal(), "INTERNAL left set after a panic");
        // Nested: the outer state comes back, not false.
        as_internal(|| {
            let r = std::panic::catch_unwind(|| as_internal::<()>(|| panic!("inner")));
            assert!(r.is_err());
            assert!(internal());
        });
        assert!(!internal());
    }

    #[test]
    fn panic_in_signals_blocked_restores_mask() {
        let before = blocked();
        let r = std::panic::catch_unwind(|| {
            signals_blocked(|| {
                assert_ne!(blocked(), before, "signals not blocked inside");
                panic!("in set-up")
            })
        });
        assert!(r.is_err());
        assert_eq!(blocked(), before, "signal mask left blocked after a panic");
        let v = signals_blocked(|| 7);
        assert_eq!(v, 7);
        assert_eq!(blocked(), before);
    }
}
