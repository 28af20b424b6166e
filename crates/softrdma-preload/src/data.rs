//! The data calls on offloaded descriptors: read/write and their vector,
//! message and fortified variants, `sendfile` and `splice`.
//!
//! A descriptor that is not offloaded goes straight to the real call (one
//! atomic load when no connection is offloaded). Offloaded: blocking
//! sockets wait on the connection's readiness descriptor (so a signal
//! handler interrupts them with `EINTR` as the kernel's would, see
//! `conn::Conn::blocking`), a blocking send sends everything, and a write
//! to a closed connection fails with `EPIPE` and raises `SIGPIPE` unless
//! `MSG_NOSIGNAL`. `sendfile` and `splice` copy through user space (the
//! offloaded stream has no kernel path from a file or a pipe).

use std::io::{IoSlice, Read, Write};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use libc::{c_int, c_uint, c_void, iovec, msghdr, off_t, size_t, sockaddr, socklen_t, ssize_t};

use crate::conn::{self, Conn};
use crate::interpose::guard;
use crate::real::*;

/// Largest vector or file chunk copied in one step.
const CHUNK: usize = 1 << 20;

thread_local! {
    /// The calling thread's buffer for copies through user space (gathered
    /// and scattered vectors, `sendfile`, `splice`), kept from one call to
    /// the next (at most [`CHUNK`] octets per thread): a fresh zeroed
    /// buffer per call cost a `calloc`, and above 128 KiB an `mmap`, a
    /// page fault per page and a `munmap`, on every call.
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` on a buffer of `len` octets (at most [`CHUNK`]; its contents
/// are left from earlier calls: `f` reads only what it wrote): the
/// thread's scratch buffer, taken out meanwhile (a signal handler's call
/// inside another call, or one while the thread ends, makes its own).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let len = len.min(CHUNK);
    let mut v = SCRATCH.try_with(std::cell::Cell::take).unwrap_or_default();
    if v.len() < len {
        v.resize(len, 0);
    }
    let r = f(&mut v[..len]);
    let _ = SCRATCH.try_with(|s| {
        // Keep the larger one (a nested call put its own back meanwhile).
        let cur = s.take();
        s.set(if cur.len() > v.len() { cur } else { v });
    });
    r
}

fn recv_conn(c: &Conn, buf: &mut [u8], flags: c_int) -> Result<usize, c_int> {
    if flags & libc::MSG_OOB != 0 {
        return Err(libc::EINVAL);
    }
    if buf.is_empty() {
        return Ok(0);
    }
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    if flags & libc::MSG_PEEK != 0 {
        return c.blocking(dontwait, false, |s| s.peek(buf));
    }
    let mut got = c.blocking(dontwait, false, |mut s| s.read(buf))?;
    if flags & libc::MSG_WAITALL != 0 && !dontwait {
        while got > 0 && got < buf.len() {
            match c.blocking(false, false, |mut s| s.read(&mut buf[got..])) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(_) => break,
            }
        }
    }
    Ok(got)
}

fn send_conn(c: &Arc<Conn>, buf: &[u8], flags: c_int) -> Result<usize, c_int> {
    send_parts(c, &mut [IoSlice::new(buf)], flags)
}

/// A send of the concatenation of `parts` (each copied straight into the
/// stream's send buffers).
fn send_parts(c: &Arc<Conn>, parts: &mut [IoSlice<'_>], flags: c_int) -> Result<usize, c_int> {
    let total: usize = parts.iter().map(|p| p.len()).sum();
    if flags & libc::MSG_OOB != 0 {
        crate::autocork::end_burst();
        return Err(libc::EOPNOTSUPP);
    }
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let nb = dontwait || c.nonblock.load(Ordering::Relaxed);
    let more = flags & libc::MSG_MORE != 0;
    // A small send that the burst's next one should follow: held as for
    // MSG_MORE (see `autocork`).
    let hold =
        crate::autocork::before_send(c, total, more) && c.stream().is_ok_and(|s| c.start_hold(s));
    // MSG_MORE: held as with TCP_CORK until a send without it (or the
    // cork's 200 ms); an application's own TCP_CORK is left alone.
    if more
        && !c.more.load(Ordering::Relaxed)
        && let Ok(s) = c.stream()
        && (c.auto.load(Ordering::Relaxed) || s.cork().is_ok_and(|on| !on))
        && s.set_cork(true).is_ok()
    {
        // A library hold becomes the MSG_MORE one.
        c.auto.store(false, Ordering::Relaxed);
        c.more.store(true, Ordering::Relaxed);
    }
    let r = send_stream(c, parts, total, nb, dontwait);
    if !more && !hold {
        let by_more = c.more.swap(false, Ordering::Relaxed);
        let by_lib = c.auto.swap(false, Ordering::Relaxed);
        if (by_more || by_lib)
            && let Ok(s) = c.stream()
        {
            let _ = s.set_cork(false);
        }
    }
    crate::autocork::after_send(c);
    let r = match r {
        Err(libc::ECONNRESET | libc::ECONNABORTED)
            if c.reset_seen.swap(true, Ordering::Relaxed) =>
        {
            Err(libc::EPIPE)
        }
        r => r,
    };
    if r == Err(libc::EPIPE) && flags & libc::MSG_NOSIGNAL == 0 {
        conn::raise_sigpipe();
    }
    r
}

/// Writes the concatenation of `parts` (`total` octets) to the stream:
/// all of it if blocking (`nb` false), as the kernel's send does.
fn send_stream(
    c: &Conn,
    mut parts: &mut [IoSlice<'_>],
    total: usize,
    nb: bool,
    dontwait: bool,
) -> Result<usize, c_int> {
    let mut sent = 0;
    loop {
        let r = c.blocking(dontwait, true, |mut s| match &*parts {
            [one] => s.write(one),
            many => s.write_vectored(many),
        });
        match r {
            Ok(n) => {
                sent += n;
                // A blocking send sends everything, as the kernel's does.
                if nb || sent >= total || n == 0 {
                    break Ok(sent);
                }
                IoSlice::advance_slices(&mut parts, n);
            }
            Err(e) if sent > 0 && e != libc::EPIPE => break Ok(sent),
            Err(e) => break Err(e),
        }
    }
}

/// A mutable byte slice from C arguments (empty for a null pointer).
///
/// # Safety
/// `p` is null or points to `n` writable bytes.
unsafe fn buf_mut<'a>(p: *mut c_void, n: size_t) -> &'a mut [u8] {
    if p.is_null() || n == 0 {
        return &mut [];
    }
    // SAFETY: the caller's guarantee.
    unsafe { std::slice::from_raw_parts_mut(p.cast(), n) }
}

/// # Safety
/// `p` is null or points to `n` readable bytes.
unsafe fn buf_ref<'a>(p: *const c_void, n: size_t) -> &'a [u8] {
    if p.is_null() || n == 0 {
        return &[];
    }
    // SAFETY: the caller's guarantee.
    unsafe { std::slice::from_raw_parts(p.cast(), n) }
}

/// The iovecs as slices.
///
/// # Safety
/// `iov` points to `cnt` iovecs each naming valid memory.
unsafe fn iovecs<'a>(iov: *const iovec, cnt: c_int) -> Result<&'a [iovec], c_int> {
    if !(0..=libc::UIO_MAXIOV).contains(&cnt) {
        return Err(libc::EINVAL);
    }
    if cnt == 0 || iov.is_null() {
        return Ok(&[]);
    }
    // SAFETY: the caller's guarantee.
    Ok(unsafe { std::slice::from_raw_parts(iov, cnt as usize) })
}

fn readv_conn(c: &Conn, iov: &[iovec], flags: c_int) -> Result<usize, c_int> {
    let total: usize = iov.iter().map(|v| v.iov_len).sum::<usize>().min(CHUNK);
    if let [one] = iov {
        // SAFETY: the application's iovec names writable memory.
        let b = unsafe { buf_mut(one.iov_base, one.iov_len) };
        return recv_conn(c, b, flags);
    }
    with_scratch(total, |tmp| {
        let n = recv_conn(c, tmp, flags)?;
        let mut off = 0;
        for v in iov {
            if off >= n {
                break;
            }
            let k = v.iov_len.min(n - off);
            // SAFETY: the application's iovec names `iov_len` writable
            // bytes.
            unsafe { buf_mut(v.iov_base, k) }.copy_from_slice(&tmp[off..off + k]);
            off += k;
        }
        Ok(n)
    })
}

fn writev_conn(c: &Arc<Conn>, iov: &[iovec], flags: c_int) -> Result<usize, c_int> {
    if let [one] = iov {
        // SAFETY: the application's iovec names readable memory.
        return send_conn(c, unsafe { buf_ref(one.iov_base, one.iov_len) }, flags);
    }
    // Each piece is copied straight into the stream's send buffers.
    let mut parts: Vec<IoSlice<'_>> = iov
        .iter()
        .filter(|v| v.iov_len > 0)
        // SAFETY: the application's iovec names readable memory.
        .map(|v| IoSlice::new(unsafe { buf_ref(v.iov_base, v.iov_len) }))
        .collect();
    send_parts(c, &mut parts, flags)
}

fn ok(r: Result<usize, c_int>) -> Result<ssize_t, c_int> {
    r.map(|n| n as ssize_t)
}

fn on(fd: c_int) -> Option<Arc<Conn>> {
    conn::lookup(fd)
}

/// [`on`] for a send (the thread's burst of sends on it goes on).
fn on_send(fd: c_int) -> Option<Arc<Conn>> {
    conn::lookup_for_send(fd)
}

macro_rules! real_or_enosys {
    ($r:expr) => {
        match $r.get() {
            Some(f) => f,
            None => return crate::real::fail(libc::ENOSYS),
        }
    };
}

/// `read(2)`.
///
/// # Safety
/// As `read(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn read(fd: c_int, buf: *mut c_void, n: size_t) -> ssize_t {
    if let Some(c) = on(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return guard(|| ok(recv_conn(&c, unsafe { buf_mut(buf, n) }, 0)));
    }
    let real = real_or_enosys!(REAL_READ);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n) }
}

/// `__read_chk` (fortified `read`).
///
/// # Safety
/// As `read(2)`; `buflen` is the size of `buf`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __read_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure handler (does not return).
        unsafe { __chk_fail() }
    }
    // SAFETY: as read.
    unsafe { read(fd, buf, n) }
}

unsafe extern "C" {
    fn __chk_fail() -> !;
}

/// `write(2)`.
///
/// # Safety
/// As `write(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, n: size_t) -> ssize_t {
    if let Some(c) = on_send(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return guard(|| ok(send_conn(&c, unsafe { buf_ref(buf, n) }, 0)));
    }
    let real = real_or_enosys!(REAL_WRITE);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n) }
}

/// `readv(2)`.
///
/// # Safety
/// As `readv(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn readv(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some(c) = on(fd) {
        // SAFETY: the caller's iovecs.
        return guard(|| ok(readv_conn(&c, unsafe { iovecs(iov, cnt) }?, 0)));
    }
    let real = real_or_enosys!(REAL_READV);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, iov, cnt) }
}

/// `writev(2)`.
///
/// # Safety
/// As `writev(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn writev(fd: c_int, iov: *const iovec, cnt: c_int) -> ssize_t {
    if let Some(c) = on_send(fd) {
        // SAFETY: the caller's iovecs.
        return guard(|| ok(writev_conn(&c, unsafe { iovecs(iov, cnt) }?, 0)));
    }
    let real = real_or_enosys!(REAL_WRITEV);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, iov, cnt) }
}

/// `recv(2)`.
///
/// # Safety
/// As `recv(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recv(fd: c_int, buf: *mut c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(c) = on(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return guard(|| ok(recv_conn(&c, unsafe { buf_mut(buf, n) }, flags)));
    }
    let real = real_or_enosys!(REAL_RECV);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n, flags) }
}

/// `__recv_chk` (fortified `recv`).
///
/// # Safety
/// As `recv(2)`; `buflen` is the size of `buf`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recv_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure handler.
        unsafe { __chk_fail() }
    }
    // SAFETY: as recv.
    unsafe { recv(fd, buf, n, flags) }
}

/// `recvfrom(2)`: offloaded, the address is not filled in (`*alen` = 0),
/// as for any connected TCP socket.
///
/// # Safety
/// As `recvfrom(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvfrom(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if let Some(c) = on(fd) {
        return guard(|| {
            // SAFETY: the caller's buffer of `n` bytes.
            let r = ok(recv_conn(&c, unsafe { buf_mut(buf, n) }, flags));
            if r.is_ok() && !addr.is_null() && !alen.is_null() {
                // SAFETY: the caller's length slot.
                unsafe { *alen = 0 };
            }
            r
        });
    }
    let real = real_or_enosys!(REAL_RECVFROM);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n, flags, addr, alen) }
}

/// `__recvfrom_chk` (fortified `recvfrom`).
///
/// # Safety
/// As `recvfrom(2)`; `buflen` is the size of `buf`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn __recvfrom_chk(
    fd: c_int,
    buf: *mut c_void,
    n: size_t,
    buflen: size_t,
    flags: c_int,
    addr: *mut sockaddr,
    alen: *mut socklen_t,
) -> ssize_t {
    if n > buflen {
        // SAFETY: glibc's fortify failure handler.
        unsafe { __chk_fail() }
    }
    // SAFETY: as recvfrom.
    unsafe { recvfrom(fd, buf, n, flags, addr, alen) }
}

/// `recvmsg(2)`: offloaded, no name and no control messages come back.
///
/// # Safety
/// As `recvmsg(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmsg(fd: c_int, msg: *mut msghdr, flags: c_int) -> ssize_t {
    if let Some(c) = on(fd) {
        if msg.is_null() {
            return crate::real::fail(libc::EFAULT);
        }
        return guard(|| {
            // SAFETY: the caller's msghdr.
            let m = unsafe { &mut *msg };
            // SAFETY: its iovecs.
            let iov = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }?;
            let n = readv_conn(&c, iov, flags)?;
            m.msg_namelen = 0;
            m.msg_controllen = 0;
            m.msg_flags = 0;
            Ok(n as ssize_t)
        });
    }
    let real = real_or_enosys!(REAL_RECVMSG);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, msg, flags) }
}

/// `send(2)`.
///
/// # Safety
/// As `send(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn send(fd: c_int, buf: *const c_void, n: size_t, flags: c_int) -> ssize_t {
    if let Some(c) = on_send(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return guard(|| ok(send_conn(&c, unsafe { buf_ref(buf, n) }, flags)));
    }
    let real = real_or_enosys!(REAL_SEND);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n, flags) }
}

/// `sendto(2)`: offloaded, the address is ignored, as for any connected
/// TCP socket.
///
/// # Safety
/// As `sendto(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendto(
    fd: c_int,
    buf: *const c_void,
    n: size_t,
    flags: c_int,
    addr: *const sockaddr,
    alen: socklen_t,
) -> ssize_t {
    if let Some(c) = on_send(fd) {
        // SAFETY: the caller's buffer of `n` bytes.
        return guard(|| ok(send_conn(&c, unsafe { buf_ref(buf, n) }, flags)));
    }
    let real = real_or_enosys!(REAL_SENDTO);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, buf, n, flags, addr, alen) }
}

/// `sendmsg(2)`: offloaded, name and control messages are ignored.
///
/// # Safety
/// As `sendmsg(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmsg(fd: c_int, msg: *const msghdr, flags: c_int) -> ssize_t {
    if let Some(c) = on_send(fd) {
        if msg.is_null() {
            return crate::real::fail(libc::EFAULT);
        }
        return guard(|| {
            // SAFETY: the caller's msghdr and its iovecs.
            let m = unsafe { &*msg };
            // SAFETY: as above.
            let iov = unsafe { iovecs(m.msg_iov, m.msg_iovlen as c_int) }?;
            ok(writev_conn(&c, iov, flags))
        });
    }
    let real = real_or_enosys!(REAL_SENDMSG);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, msg, flags) }
}

/// `sendfile` to an offloaded socket: the file is read into a buffer and
/// written to the stream; `*offset` (or the file position) advances by
/// what was sent.
fn sendfile_conn(
    c: &Arc<Conn>,
    in_fd: c_int,
    offset: *mut off_t,
    count: size_t,
) -> Result<ssize_t, c_int> {
    let want = count.min(CHUNK);
    if want == 0 {
        return Ok(0);
    }
    with_scratch(want, |tmp| sendfile_via(c, in_fd, offset, tmp))
}

/// [`sendfile_conn`] through `tmp`.
fn sendfile_via(
    c: &Arc<Conn>,
    in_fd: c_int,
    offset: *mut off_t,
    tmp: &mut [u8],
) -> Result<ssize_t, c_int> {
    let want = tmp.len();
    let got = if offset.is_null() {
        let f = REAL_READ.get().ok_or(libc::ENOSYS)?;
        // SAFETY: reading into our buffer.
        unsafe { f(in_fd, tmp.as_mut_ptr().cast(), want) }
    } else {
        // SAFETY: the caller's offset slot.
        let off = unsafe { *offset };
        // SAFETY: reading into our buffer at the caller's offset.
        unsafe { libc::pread(in_fd, tmp.as_mut_ptr().cast(), want, off) }
    };
    if got < 0 {
        return Err(errno());
    }
    let got = got as usize;
    if got == 0 {
        return Ok(0);
    }
    let sent = match send_conn(c, &tmp[..got], 0) {
        Ok(n) => n,
        Err(e) => {
            if offset.is_null() {
                // Give the file position back.
                // SAFETY: lseek on the caller's file.
                unsafe { libc::lseek(in_fd, -(got as off_t), libc::SEEK_CUR) };
            }
            return Err(e);
        }
    };
    if offset.is_null() {
        if sent < got {
            // SAFETY: lseek on the caller's file.
            unsafe { libc::lseek(in_fd, -((got - sent) as off_t), libc::SEEK_CUR) };
        }
    } else {
        // SAFETY: the caller's offset slot.
        unsafe { *offset += sent as off_t };
    }
    Ok(sent as ssize_t)
}

/// `sendfile(2)`: to an offloaded socket it copies through user space.
///
/// # Safety
/// As `sendfile(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile(
    out: c_int,
    in_fd: c_int,
    offset: *mut off_t,
    count: size_t,
) -> ssize_t {
    if let Some(c) = on_send(out) {
        return guard(|| sendfile_conn(&c, in_fd, offset, count));
    }
    let real = real_or_enosys!(REAL_SENDFILE);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(out, in_fd, offset, count) }
}

/// `sendfile64`: as [`sendfile`].
///
/// # Safety
/// As `sendfile(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendfile64(
    out: c_int,
    in_fd: c_int,
    offset: *mut off_t,
    count: size_t,
) -> ssize_t {
    if let Some(c) = on_send(out) {
        return guard(|| sendfile_conn(&c, in_fd, offset, count));
    }
    let real = match REAL_SENDFILE64.get().or(REAL_SENDFILE.get()) {
        Some(f) => f,
        None => return crate::real::fail(libc::ENOSYS),
    };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(out, in_fd, offset, count) }
}

/// Writes all of `b` to `fd` (a pipe), waiting as needed.
fn write_all_fd(fd: c_int, mut b: &[u8]) -> Result<(), c_int> {
    let f = REAL_WRITE.get().ok_or(libc::ENOSYS)?;
    while !b.is_empty() {
        // SAFETY: writing our buffer.
        let r = unsafe { f(fd, b.as_ptr().cast(), b.len()) };
        if r < 0 {
            let e = errno();
            if e == libc::EINTR {
                continue;
            }
            if e == libc::EAGAIN {
                let mut p = libc::pollfd {
                    fd,
                    events: libc::POLLOUT,
                    revents: 0,
                };
                let poll = REAL_POLL.get().ok_or(libc::ENOSYS)?;
                // SAFETY: one valid pollfd.
                unsafe { poll(&raw mut p, 1, -1) };
                continue;
            }
            return Err(e);
        }
        b = &b[r as usize..];
    }
    Ok(())
}

/// `splice(2)` with an offloaded socket on one side: copied through user
/// space. Socket to pipe: at most what the pipe has room for; pipe to
/// socket: what the pipe holds, all of it sent.
///
/// # Safety
/// As `splice(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn splice(
    fd_in: c_int,
    off_in: *mut off_t,
    fd_out: c_int,
    off_out: *mut off_t,
    len: size_t,
    flags: c_uint,
) -> ssize_t {
    let nonblock = flags & libc::SPLICE_F_NONBLOCK != 0;
    if let Some(c) = on(fd_in) {
        return guard(|| {
            let ioctl = REAL_IOCTL.get().ok_or(libc::ENOSYS)?;
            let fcntl = REAL_FCNTL.get().ok_or(libc::ENOSYS)?;
            // SAFETY: F_GETPIPE_SZ has no argument.
            let size = unsafe { fcntl(fd_out, libc::F_GETPIPE_SZ, 0) };
            let mut used: c_int = 0;
            // SAFETY: FIONREAD writes an int.
            unsafe { ioctl(fd_out, libc::FIONREAD, (&raw mut used) as usize) };
            let room = if size > 0 {
                (size - used).max(0) as usize
            } else {
                65536
            };
            let want = len.min(room).min(CHUNK);
            if want == 0 {
                return Err(libc::EAGAIN);
            }
            let flags = if nonblock { libc::MSG_DONTWAIT } else { 0 };
            with_scratch(want, |tmp| {
                let n = recv_conn(&c, tmp, flags)?;
                write_all_fd(fd_out, &tmp[..n])?;
                Ok(n as ssize_t)
            })
        });
    }
    if let Some(c) = on(fd_out) {
        return guard(|| {
            let want = len.min(CHUNK);
            let f = REAL_READ.get().ok_or(libc::ENOSYS)?;
            with_scratch(want, |tmp| {
                // SAFETY: reading the caller's pipe into our buffer.
                let n = unsafe { f(fd_in, tmp.as_mut_ptr().cast(), want) };
                if n < 0 {
                    return Err(errno());
                }
                let n = n as usize;
                // What was taken out of the pipe is sent whatever the
                // socket's mode (it cannot be put back).
                let mut sent = 0;
                while sent < n {
                    sent += c.blocking(false, true, |mut s| s.write(&tmp[sent..n]))?;
                }
                Ok(n as ssize_t)
            })
        });
    }
    let real = real_or_enosys!(REAL_SPLICE);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd_in, off_in, fd_out, off_out, len, flags) }
}

/// `recvmmsg(2)`: offloaded, one message per stream read: the first waits
/// as the socket's mode says, the rest only take what is there (the
/// timeout is not used).
///
/// # Safety
/// As `recvmmsg(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn recvmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
    timeout: *mut libc::timespec,
) -> c_int {
    if let Some(c) = on(fd) {
        if msgs.is_null() {
            return crate::real::fail(libc::EFAULT);
        }
        return guard(|| {
            let mut done = 0u32;
            while done < n {
                // SAFETY: the caller's array of `n` messages.
                let m = unsafe { &mut *msgs.add(done as usize) };
                // SAFETY: its iovecs.
                let iov = unsafe { iovecs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int) }?;
                let f = if done == 0 {
                    flags
                } else {
                    flags | libc::MSG_DONTWAIT
                };
                match readv_conn(&c, iov, f & !libc::MSG_WAITFORONE) {
                    Ok(k) => {
                        m.msg_len = k as c_uint;
                        m.msg_hdr.msg_namelen = 0;
                        m.msg_hdr.msg_controllen = 0;
                        m.msg_hdr.msg_flags = 0;
                        done += 1;
                        if k == 0 {
                            break;
                        }
                    }
                    Err(e) if done == 0 => return Err(e),
                    Err(_) => break,
                }
            }
            Ok(done as c_int)
        });
    }
    let real = real_or_enosys!(REAL_RECVMMSG);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, msgs, n, flags, timeout) }
}

/// `sendmmsg(2)`: offloaded, each message is written as `sendmsg` would.
///
/// # Safety
/// As `sendmmsg(2)`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn sendmmsg(
    fd: c_int,
    msgs: *mut libc::mmsghdr,
    n: c_uint,
    flags: c_int,
) -> c_int {
    if let Some(c) = on_send(fd) {
        if msgs.is_null() {
            return crate::real::fail(libc::EFAULT);
        }
        return guard(|| {
            let mut done = 0u32;
            while done < n {
                // SAFETY: the caller's array of `n` messages.
                let m = unsafe { &mut *msgs.add(done as usize) };
                // SAFETY: its iovecs.
                let iov = unsafe { iovecs(m.msg_hdr.msg_iov, m.msg_hdr.msg_iovlen as c_int) }?;
                match writev_conn(&c, iov, flags) {
                    Ok(k) => {
                        m.msg_len = k as c_uint;
                        done += 1;
                    }
                    Err(e) if done == 0 => return Err(e),
                    Err(_) => break,
                }
            }
            Ok(done as c_int)
        });
    }
    let real = real_or_enosys!(REAL_SENDMMSG);
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { real(fd, msgs, n, flags) }
}
