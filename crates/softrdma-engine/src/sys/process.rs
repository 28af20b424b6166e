//! The process's life: work at its exit (`atexit(3)`), and (tests) a
//! `fork(2)`ed child. Forks are counted by [`super::epoll::fork_generation`].

/// Registers `f` to run when the process exits through `exit(3)` (a
/// return from `main`, `std::process::exit`), in the exiting thread,
/// while the other threads still run. `false` if it could not be
/// registered. Not at `_exit(2)`, a fatal signal or an abort.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: registers a plain `extern "C" fn()` without arguments; the
    // handlers catch panics themselves (none unwinds into libc).
    unsafe { libc::atexit(f) == 0 }
}

/// Runs `f` in a `fork(2)`ed child of this (multi-threaded) process and
/// returns whether it returned `true` there; a child that does not end
/// within `limit` is killed (`false`). The child ends with `_exit(2)`
/// (no exit handlers, no destructors of the parent's copies).
///
/// Only the forking thread lives on in the child: `f` must not wait for
/// anything another thread of the parent would have done.
#[cfg(test)]
pub(crate) fn in_child(limit: std::time::Duration, f: impl FnOnce() -> bool) -> bool {
    // SAFETY: `fork` has no preconditions; the child runs `f` and leaves
    // with `_exit`, never returning into the caller's frames.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or(false);
        // SAFETY: ends the child at once, as documented above.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let deadline = std::time::Instant::now() + limit;
    loop {
        let mut status = 0;
        // SAFETY: `pid` is our child; `status` is valid for writes.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            return libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
        }
        if r < 0 || std::time::Instant::now() >= deadline {
            // SAFETY: signals and reaps our own child only.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}
