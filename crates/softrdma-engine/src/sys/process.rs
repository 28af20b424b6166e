//! The process's life: work at its exit (`atexit(3)`), and (tests) a
//! `fork(2)`ed child. Forks are counted by [`super::epoll::fork_generation`].
//!
//! Public (re-exported at the crate's root) for the layers above that hold
//! data of their own before posting it (sockets direct's staged writes):
//! [`at_exit`] and [`PerFork`] (and, beside the queue pairs' posting,
//! [`flush_posts_at_exit`](crate::flush_posts_at_exit)).

/// Registers `f` to run when the process exits through `exit(3)` (a
/// return from `main`, `std::process::exit`), in the exiting thread,
/// while the other threads still run. `false` if it could not be
/// registered. Not at `_exit(2)`, a fatal signal or an abort.
///
/// Handlers run last registered first, the engine's own among them (it
/// registers [`flush_posts_at_exit`](crate::flush_posts_at_exit) at the
/// first post it defers): a handler that posts calls it itself first, so
/// that its posts are written whatever the order. `f` must not unwind (catch
/// panics in it: none may unwind into libc). A handler registered while
/// the handlers run (from one of them) runs too with glibc, next.
pub fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: registers a plain `extern "C" fn()` without arguments; the
    // handlers catch panics themselves (none unwinds into libc).
    unsafe { libc::atexit(f) == 0 }
}

/// Runs `f` in a `fork(2)`ed child of this (multi-threaded) process and
/// returns whether it returned `true` there; a child that does not end
/// within `limit` is killed (`false`). The child ends with `_exit(2)`
/// (no exit handlers, no destructors of the parent's copies); it is
/// killed if the forking thread ends first.
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
        // SAFETY: asks for SIGKILL when the forking thread ends (a child
        // killed at its limit takes a hung grandchild of its own with it,
        // instead of leaving it behind for ever); no pointers.
        unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
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

/// Makes every later thread creation of this process fail (`EAGAIN`):
/// `RLIMIT_NPROC` of 0, after giving up root (whose limit is not
/// enforced) for `nobody`. For a `fork(2)`ed test child only
/// ([`in_child`]): the process cannot get its privileges back. Whether a
/// thread creation now fails.
#[cfg(test)]
pub(crate) fn forbid_new_threads() -> bool {
    // SAFETY: plain system calls on this process's credentials and
    // limits; no pointers but `lim`, valid for reads.
    unsafe {
        if libc::geteuid() == 0 && (libc::setgid(65534) != 0 || libc::setuid(65534) != 0) {
            return false;
        }
        let lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::setrlimit(libc::RLIMIT_NPROC, &lim) != 0 {
            return false;
        }
    }
    std::thread::Builder::new().spawn(|| {}).is_err()
}

/// A process-wide value of which each fork generation
/// ([`fork_generation`](crate::fork_generation)) has its own,
/// reached through one atomic pointer (no lock): a `fork(2)`ed child never
/// uses its parent's value, whose locks may have been held at the fork by
/// threads that do not exist in the child (it would wait for them for
/// ever). The child's first use makes a value of its own and puts it in
/// the slot; the parent's copy is left as it is (leaked: small, once per
/// fork that uses it). Values live as long as the process.
///
/// ```
/// use softrdma_engine::PerFork;
/// static COUNT: PerFork<std::sync::atomic::AtomicU32> = PerFork::new();
/// assert!(COUNT.peek().is_none());
/// COUNT.get(Default::default).fetch_add(1, std::sync::atomic::Ordering::Relaxed);
/// assert!(COUNT.peek().is_some());
/// ```
///
/// The value is reached from any thread that reaches the slot, so a slot
/// is `Send` and `Sync` only if `T` is both: a value that is not `Sync`
/// cannot be shared through it.
///
/// ```compile_fail,E0277
/// use softrdma_engine::PerFork;
/// let p: PerFork<std::cell::Cell<u64>> = PerFork::new();
/// let mine = p.get(|| std::cell::Cell::new(0));
/// // `PerFork<Cell<_>>` is not `Send`: the same `&'static Cell` would be
/// // used from two threads.
/// std::thread::spawn(move || p.peek().unwrap().set(1));
/// mine.set(2);
/// ```
///
/// ```compile_fail,E0277
/// use softrdma_engine::PerFork;
/// static P: PerFork<std::cell::Cell<u64>> = PerFork::new();
/// ```
pub struct PerFork<T: 'static> {
    slot: std::sync::atomic::AtomicPtr<(u64, T)>,
    /// Neither `Send` nor `Sync` of its own (an `AtomicPtr` is both, for
    /// any `T`): the impls below say when.
    _not_auto: std::marker::PhantomData<*const T>,
}

// SAFETY: the slot hands out `&'static T` to any thread that reaches it
// (so `T: Sync`, for a shared slot as for one sent to another thread) and
// a value made by one thread may be dropped by another (a lost race, so
// `T: Send`).
unsafe impl<T: Send + Sync> Sync for PerFork<T> {}
// SAFETY: as for `Sync` above: a slot sent to another thread hands the
// same `&'static T` out there.
unsafe impl<T: Send + Sync> Send for PerFork<T> {}

impl<T: 'static> std::fmt::Debug for PerFork<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerFork")
            .field("made", &self.peek().is_some())
            .finish()
    }
}

impl<T: 'static> Default for PerFork<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: 'static> PerFork<T> {
    /// An empty slot.
    pub const fn new() -> Self {
        PerFork {
            slot: std::sync::atomic::AtomicPtr::new(std::ptr::null_mut()),
            _not_auto: std::marker::PhantomData,
        }
    }

    /// The value in the slot, whichever generation made it.
    fn current(&self) -> (*mut (u64, T), Option<&'static (u64, T)>) {
        use std::sync::atomic::Ordering;
        let p = self.slot.load(Ordering::Acquire);
        // SAFETY: a non-null pointer in the slot comes from `Box::into_raw`
        // (made and published with Release by `get`) and is never freed.
        (p, unsafe { p.as_ref() })
    }

    /// This generation's value, if it made one.
    pub fn peek(&self) -> Option<&'static T> {
        let generation = super::epoll::fork_generation();
        match self.current().1 {
            Some((g, v)) if *g == generation => Some(v),
            _ => None,
        }
    }

    /// This generation's value, made by `make` on its first use.
    pub fn get(&self, make: impl Fn() -> T) -> &'static T {
        use std::sync::atomic::Ordering;
        let generation = super::epoll::fork_generation();
        let (mut p, mut cur) = self.current();
        loop {
            if let Some((g, v)) = cur
                && *g == generation
            {
                return v;
            }
            let new = Box::into_raw(Box::new((generation, make())));
            match self
                .slot
                .compare_exchange(p, new, Ordering::AcqRel, Ordering::Acquire)
            {
                // SAFETY: just made from a box, and now never freed.
                Ok(_) => return unsafe { &(*new).1 },
                Err(actual) => {
                    // Another thread of this generation put its own first.
                    // SAFETY: `new` was not published: still ours alone.
                    drop(unsafe { Box::from_raw(new) });
                    p = actual;
                    // SAFETY: as in `current`.
                    cur = unsafe { actual.as_ref() };
                }
            }
        }
    }
}
