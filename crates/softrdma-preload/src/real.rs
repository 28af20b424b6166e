//! The real libc functions behind the interposed ones, found with
//! `dlsym(RTLD_NEXT)` on first use, and errno helpers.
//!
//! Code of this library (and of the crates linked into it) that calls a
//! libc function this library also defines reaches the interposed one:
//! every interposed function passes descriptors it does not know straight
//! to the real one, and this library calls `REAL_*` where it means the
//! kernel's behaviour.

use std::ffi::CStr;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{
    c_int, c_uint, c_ulong, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t,
};

/// A real libc function, found with `dlsym(RTLD_NEXT)` on first use.
#[derive(Debug)]
pub(crate) struct Real<F> {
    addr: AtomicUsize,
    name: &'static CStr,
    _f: PhantomData<F>,
}

impl<F: Copy> Real<F> {
    pub(crate) const fn new(name: &'static CStr) -> Real<F> {
        Real {
            addr: AtomicUsize::new(0),
            name,
            _f: PhantomData,
        }
    }

    pub(crate) fn get(&self) -> Option<F> {
        const { assert!(size_of::<F>() == size_of::<usize>()) };
        let mut a = self.addr.load(Ordering::Relaxed);
        if a == 0 {
            // SAFETY: dlsym with a NUL-terminated name; RTLD_NEXT finds the
            // definition after this library's (libc's).
            a = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
            if a == 0 {
                return None;
            }
            self.addr.store(a, Ordering::Relaxed);
        }
        // SAFETY: `F` is the `extern "C" fn` type of the symbol named
        // `self.name` (each `Real` is declared with its C prototype below),
        // and the assertion above checks it is pointer-sized.
        Some(unsafe { std::mem::transmute_copy::<usize, F>(&a) })
    }
}

macro_rules! reals {
    ($($name:ident = $sym:literal : fn($($a:ty),*) -> $r:ty;)*) => {
        $(pub(crate) static $name: Real<unsafe extern "C" fn($($a),*) -> $r> = Real::new($sym);)*
    };
}

// Variadic C functions (fcntl, ioctl) are declared with their one optional
// argument as a pointer-sized integer: on the Linux ABIs (x86-64, AArch64)
// a variadic int or pointer argument is passed where a fixed one would be.
reals! {
    REAL_CONNECT = c"connect": fn(c_int, *const sockaddr, socklen_t) -> c_int;
    REAL_BIND = c"bind": fn(c_int, *const sockaddr, socklen_t) -> c_int;
    REAL_ACCEPT = c"accept": fn(c_int, *mut sockaddr, *mut socklen_t) -> c_int;
    REAL_ACCEPT4 = c"accept4": fn(c_int, *mut sockaddr, *mut socklen_t, c_int) -> c_int;
    REAL_LISTEN = c"listen": fn(c_int, c_int) -> c_int;
    REAL_CLOSE = c"close": fn(c_int) -> c_int;
    REAL_SHUTDOWN = c"shutdown": fn(c_int, c_int) -> c_int;
    REAL_DUP = c"dup": fn(c_int) -> c_int;
    REAL_DUP2 = c"dup2": fn(c_int, c_int) -> c_int;
    REAL_DUP3 = c"dup3": fn(c_int, c_int, c_int) -> c_int;
    REAL_FCNTL = c"fcntl": fn(c_int, c_int, usize) -> c_int;
    REAL_FCNTL64 = c"fcntl64": fn(c_int, c_int, usize) -> c_int;
    REAL_IOCTL = c"ioctl": fn(c_int, c_ulong, usize) -> c_int;
    REAL_GETSOCKOPT = c"getsockopt": fn(c_int, c_int, c_int, *mut c_void, *mut socklen_t) -> c_int;
    REAL_SETSOCKOPT = c"setsockopt": fn(c_int, c_int, c_int, *const c_void, socklen_t) -> c_int;
    REAL_READ = c"read": fn(c_int, *mut c_void, size_t) -> ssize_t;
    REAL_WRITE = c"write": fn(c_int, *const c_void, size_t) -> ssize_t;
    REAL_READV = c"readv": fn(c_int, *const iovec, c_int) -> ssize_t;
    REAL_WRITEV = c"writev": fn(c_int, *const iovec, c_int) -> ssize_t;
    REAL_RECV = c"recv": fn(c_int, *mut c_void, size_t, c_int) -> ssize_t;
    REAL_RECVFROM = c"recvfrom": fn(c_int, *mut c_void, size_t, c_int, *mut sockaddr, *mut socklen_t) -> ssize_t;
    REAL_RECVMSG = c"recvmsg": fn(c_int, *mut msghdr, c_int) -> ssize_t;
    REAL_SEND = c"send": fn(c_int, *const c_void, size_t, c_int) -> ssize_t;
    REAL_SENDTO = c"sendto": fn(c_int, *const c_void, size_t, c_int, *const sockaddr, socklen_t) -> ssize_t;
    REAL_SENDMSG = c"sendmsg": fn(c_int, *const msghdr, c_int) -> ssize_t;
    REAL_SENDFILE = c"sendfile": fn(c_int, c_int, *mut off_t, size_t) -> ssize_t;
    REAL_SENDFILE64 = c"sendfile64": fn(c_int, c_int, *mut off_t, size_t) -> ssize_t;
    REAL_SPLICE = c"splice": fn(c_int, *mut off_t, c_int, *mut off_t, size_t, c_uint) -> ssize_t;
    REAL_POLL = c"poll": fn(*mut libc::pollfd, libc::nfds_t, c_int) -> c_int;
    REAL_PPOLL = c"ppoll": fn(*mut libc::pollfd, libc::nfds_t, *const libc::timespec, *const libc::sigset_t) -> c_int;
    REAL_SELECT = c"select": fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *mut libc::timeval) -> c_int;
    REAL_PSELECT = c"pselect": fn(c_int, *mut libc::fd_set, *mut libc::fd_set, *mut libc::fd_set, *const libc::timespec, *const libc::sigset_t) -> c_int;
    REAL_SOCKETPAIR = c"socketpair": fn(c_int, c_int, c_int, *mut c_int) -> c_int;
    REAL_EVENTFD = c"eventfd": fn(c_uint, c_int) -> c_int;
    REAL_CLOSE_RANGE = c"close_range": fn(c_uint, c_uint, c_int) -> c_int;
    REAL_CLOSEFROM = c"closefrom": fn(c_int) -> ();
    REAL_RECVMMSG = c"recvmmsg": fn(c_int, *mut libc::mmsghdr, c_uint, c_int, *mut libc::timespec) -> c_int;
    REAL_SENDMMSG = c"sendmmsg": fn(c_int, *mut libc::mmsghdr, c_uint, c_int) -> c_int;
    REAL_EPOLL_CTL = c"epoll_ctl": fn(c_int, c_int, c_int, *mut libc::epoll_event) -> c_int;
    REAL_EPOLL_WAIT = c"epoll_wait": fn(c_int, *mut libc::epoll_event, c_int, c_int) -> c_int;
    REAL_EPOLL_PWAIT = c"epoll_pwait": fn(c_int, *mut libc::epoll_event, c_int, c_int, *const libc::sigset_t) -> c_int;
    REAL_EPOLL_PWAIT2 = c"epoll_pwait2": fn(c_int, *mut libc::epoll_event, c_int, *const libc::timespec, *const libc::sigset_t) -> c_int;
}

/// This thread's errno.
pub(crate) fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Sets this thread's errno.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// `-1` with errno `e` (the C convention), for any integer result type.
pub(crate) fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}
