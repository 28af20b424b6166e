//! Vectored socket IO on raw pointers into registered memory, CRC over
//! registered memory, and thread pinning.
//!
//! Registered memory may be written by a remote peer (through another QP) at
//! any moment, exactly like memory a NIC places into by DMA, so the data path
//! never forms `&[u8]`/`&mut [u8]` over it for longer than one CRC pass: the
//! kernel reads and writes it through `iovec`s built from raw pointers.

use std::io;
use std::os::fd::RawFd;

use softrdma_wire::crc::Crc32c;

use super::mem::Memory;

/// Most `iovec`s passed to one `readv`/`writev` (below Linux's `IOV_MAX`).
pub(crate) const MAX_IOVECS: usize = 64;

/// A reusable list of `iovec`s.
#[derive(Debug)]
pub(crate) struct IoVecs {
    v: Vec<libc::iovec>,
    bytes: usize,
}

// SAFETY: an `IoVecs` only carries addresses; it is filled and consumed by
// one thread at a time (it lives inside a QP's transmit or receive state,
// behind that state's mutex), and the memory the addresses point to is kept
// alive by the caller (an `Arc<Memory>` or a buffer owned by the same state)
// for as long as the list is used.
unsafe impl Send for IoVecs {}

impl Default for IoVecs {
    fn default() -> Self {
        IoVecs::new()
    }
}

impl IoVecs {
    /// An empty list.
    pub(crate) fn new() -> Self {
        IoVecs {
            v: Vec::with_capacity(MAX_IOVECS),
            bytes: 0,
        }
    }

    /// Empties the list.
    pub(crate) fn clear(&mut self) {
        self.v.clear();
        self.bytes = 0;
    }

    /// How many more entries fit.
    pub(crate) fn room(&self) -> usize {
        MAX_IOVECS.saturating_sub(self.v.len())
    }

    /// Adds a byte slice the caller keeps alive and unchanged until the list
    /// is cleared. Empty slices are skipped.
    pub(crate) fn push_slice(&mut self, s: &[u8]) {
        if s.is_empty() {
            return;
        }
        self.v.push(libc::iovec {
            iov_base: s.as_ptr().cast_mut().cast(),
            iov_len: s.len(),
        });
        self.bytes += s.len();
    }

    /// Adds a writable byte slice (for `readv`).
    pub(crate) fn push_slice_mut(&mut self, s: &mut [u8]) {
        if s.is_empty() {
            return;
        }
        self.v.push(libc::iovec {
            iov_base: s.as_mut_ptr().cast(),
            iov_len: s.len(),
        });
        self.bytes += s.len();
    }

    /// Adds `len` bytes at `offset` of registered memory; `false` (and
    /// nothing added) if the range is outside the memory.
    pub(crate) fn push_mem(&mut self, mem: &Memory, offset: usize, len: usize) -> bool {
        if len == 0 {
            return true;
        }
        match mem.ptr_at(offset, len) {
            Some(p) => {
                self.v.push(libc::iovec {
                    iov_base: p.cast(),
                    iov_len: len,
                });
                self.bytes += len;
                true
            }
            None => false,
        }
    }
}

/// Converts a libc return value to a byte count.
fn check(ret: isize) -> io::Result<usize> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret.unsigned_abs())
    }
}

/// Whether `fd` has bytes (or an end of stream, an error) to read now:
/// one `poll(2)` with no timeout. `true` if that cannot be told.
pub(crate) fn readable_now(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid `pollfd` on the stack, count 1, no timeout; `fd`
    // is only inspected (a closed or reused number makes the answer wrong,
    // never unsafe: the caller then reads under its lock as before).
    let ret = unsafe { libc::poll(&mut p, 1, 0) };
    ret != 0
}

/// Octets queued for reading on socket `fd` now (`ioctl(FIONREAD)`); 0 if
/// that cannot be told. For tests that need a given number of messages
/// to have arrived before a receive runs.
#[cfg(test)]
pub(crate) fn readable_octets(fd: RawFd) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one `int` through the pointer, which points
    // to one on the stack; `fd` is only inspected.
    let ret = unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) };
    if ret < 0 {
        0
    } else {
        n.unsigned_abs() as usize
    }
}

/// One write of the list. Retries on `EINTR`. On a socket it is `send(2)`
/// (one buffer) or `sendmsg(2)` with `MSG_DONTWAIT` (non-blocking whatever
/// the descriptor's `O_NONBLOCK`, which a waiter may clear to sleep in a
/// `recv`: see [`recv_wait`]) and
/// `MSG_NOSIGNAL`: a peer that reset the connection gives `EPIPE`, never a
/// `SIGPIPE` to the process (whose default action ends it — the engine
/// writes from application threads, in programs that do not ignore it);
/// on anything else `writev(2)` (non-blocking if the descriptor is).
pub(crate) fn writev(fd: RawFd, iov: &IoVecs) -> io::Result<usize> {
    if iov.v.is_empty() {
        return Ok(0);
    }
    if let [one] = iov.v[..] {
        // One buffer (a small FPDU copied whole): `send(2)`, the socket
        // call without the vector's copy-in and the file layer's checks
        // (`writev(2)` on anything but a socket).
        match send_one(fd, one) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
            r => return r,
        }
    } else if let Some(r) = send_gathered(fd, iov) {
        // A few small pieces (an FPDU whose payload fits its header
        // buffer: the header and the trailer): gathered on the stack and
        // sent as one buffer, without `sendmsg(2)`'s header and vector
        // copy-in (about 3 % of a 64-byte ping-pong's CPU).
        match r {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
            r => return r,
        }
    } else {
        match sendmsg_nosignal(fd, iov) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
            r => return r,
        }
    }
    let count = libc::c_int::try_from(iov.v.len()).unwrap_or(libc::c_int::MAX);
    loop {
        // SAFETY: every entry points to live memory of at least `iov_len`
        // bytes (see `IoVecs`); the kernel only reads from it.
        let ret = unsafe { libc::writev(fd, iov.v.as_ptr(), count) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// [`writev`] of one buffer: one `send(2)` ([`SEND_FLAGS`]), or a
/// `write(2)` if `fd` is not a socket. Retries on `EINTR`.
pub(crate) fn write_bytes(fd: RawFd, buf: &[u8]) -> io::Result<usize> {
    if buf.is_empty() {
        return Ok(0);
    }
    let one = libc::iovec {
        iov_base: buf.as_ptr().cast_mut().cast(),
        iov_len: buf.len(),
    };
    match send_one(fd, one) {
        Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
        r => return r,
    }
    loop {
        // SAFETY: `buf` is a live slice of `buf.len()` bytes; the kernel
        // only reads from it.
        let ret = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// One read into the list. Retries on `EINTR`. On a socket it is
/// `recv(2)` (one buffer) or `recvmsg(2)` with `MSG_DONTWAIT`:
/// non-blocking whatever the descriptor's `O_NONBLOCK` (see [`writev`]);
/// on anything else `readv(2)` (non-blocking if the descriptor is).
pub(crate) fn readv(fd: RawFd, iov: &IoVecs) -> io::Result<usize> {
    if iov.v.is_empty() {
        return Ok(0);
    }
    if let [one] = iov.v[..] {
        // One buffer (the staging buffer, most reads): `recv(2)`, as a
        // plain TCP reader makes it, without the vector's copy-in and the
        // file layer's checks (`readv(2)` on anything but a socket).
        match recv_one(fd, one) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
            r => return r,
        }
    } else {
        match recvmsg_dontwait(fd, iov) {
            Err(e) if e.raw_os_error() == Some(libc::ENOTSOCK) => {}
            r => return r,
        }
    }
    let count = libc::c_int::try_from(iov.v.len()).unwrap_or(libc::c_int::MAX);
    loop {
        // SAFETY: every entry points to live, writable memory of at least
        // `iov_len` bytes: registered memory kept alive by the caller's
        // `Arc<Memory>`, or a buffer the caller borrows mutably for the call.
        // Concurrent remote writes into the same registered bytes race like
        // DMA does; the kernel copies bytes, it never forms references.
        let ret = unsafe { libc::readv(fd, iov.v.as_ptr(), count) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// The flags of the engine's socket writes: never a `SIGPIPE`, never a
/// sleep (whatever the descriptor's `O_NONBLOCK`).
const SEND_FLAGS: libc::c_int = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;

/// One `send(2)` of one entry of an [`IoVecs`] ([`SEND_FLAGS`]: a
/// non-blocking `write(2)` on a socket that never raises `SIGPIPE`).
/// Retries on `EINTR`.
fn send_one(fd: RawFd, one: libc::iovec) -> io::Result<usize> {
    loop {
        // SAFETY: the entry points to live memory of at least `iov_len`
        // bytes (see `IoVecs`); the kernel only reads from it.
        let ret = unsafe { libc::send(fd, one.iov_base, one.iov_len, SEND_FLAGS) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// The most octets [`writev`] gathers into one buffer on the stack.
const GATHER_MAX: usize = 512;

/// [`send_one`] of the list gathered into a buffer on the stack, if it is
/// at most [`GATHER_MAX`] octets (`None` otherwise).
fn send_gathered(fd: RawFd, iov: &IoVecs) -> Option<io::Result<usize>> {
    let total: usize = iov.v.iter().map(|e| e.iov_len).sum();
    if total > GATHER_MAX {
        return None;
    }
    // Not zeroed (a `memset` per small FPDU): only the `at` octets
    // copied below are handed to the kernel.
    let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); GATHER_MAX];
    let mut at = 0;
    for e in &iov.v {
        // SAFETY: every entry points to live memory of at least `iov_len`
        // bytes (see `IoVecs`), and `at + iov_len <= total <= GATHER_MAX`;
        // the bytes are copied through raw pointers (registered memory a
        // peer may write meanwhile is never borrowed as a slice), into a
        // buffer that does not overlap it.
        unsafe {
            std::ptr::copy_nonoverlapping(
                e.iov_base.cast_const().cast::<u8>(),
                buf.as_mut_ptr().cast::<u8>().add(at),
                e.iov_len,
            );
        }
        at += e.iov_len;
    }
    // The kernel reads the first `at` octets, each written above.
    let one = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: at,
    };
    Some(send_one(fd, one))
}

/// One `sendmsg(2)` of the whole list with [`SEND_FLAGS`] (the vectored
/// non-blocking write of a socket that never raises `SIGPIPE`). Retries on
/// `EINTR`.
fn sendmsg_nosignal(fd: RawFd, iov: &IoVecs) -> io::Result<usize> {
    // SAFETY: `msghdr` is plain data; all-zero is a valid empty header
    // (no name, no control data, no flags).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.v.as_ptr().cast_mut();
    msg.msg_iovlen = iov.v.len().min(libc::UIO_MAXIOV as usize) as _;
    loop {
        // SAFETY: `msg` points at the list, whose entries point to live
        // memory of at least `iov_len` bytes (see `IoVecs`); the kernel
        // only reads from them and does not keep the pointers.
        let ret = unsafe { libc::sendmsg(fd, &msg, SEND_FLAGS) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// One `recv(2)` into one entry of an [`IoVecs`] (`MSG_DONTWAIT`: a
/// non-blocking `read(2)` on a socket). Retries on `EINTR`.
fn recv_one(fd: RawFd, one: libc::iovec) -> io::Result<usize> {
    loop {
        // SAFETY: the entry points to live, writable memory of at least
        // `iov_len` bytes (see `readv`); the kernel copies bytes into it,
        // it never forms references.
        let ret = unsafe { libc::recv(fd, one.iov_base, one.iov_len, libc::MSG_DONTWAIT) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// One `recvmsg(2)` into the whole list with `MSG_DONTWAIT` (the vectored
/// non-blocking read of a socket). Retries on `EINTR`.
fn recvmsg_dontwait(fd: RawFd, iov: &IoVecs) -> io::Result<usize> {
    // SAFETY: `msghdr` is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.v.as_ptr().cast_mut();
    msg.msg_iovlen = iov.v.len().min(libc::UIO_MAXIOV as usize) as _;
    loop {
        // SAFETY: `msg` points at the list, whose entries point to live,
        // writable memory of at least `iov_len` bytes (see `readv`); the
        // kernel copies bytes into them and does not keep the pointers.
        let ret = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
        match check(ret) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// One `recv(2)` into `buf` that sleeps until bytes come if the socket is
/// blocking (see [`make_blocking`]): at most its `SO_RCVTIMEO`, then
/// `WouldBlock`. A signal handled meanwhile ends it with `Interrupted`
/// (not retried: the caller's wait ends, as `poll(2)`'s does). On a
/// non-blocking socket it is a non-blocking read.
pub(crate) fn recv_wait(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is a live, writable buffer of the length passed; the
    // kernel copies bytes into it.
    let ret = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
    check(ret)
}

/// Whether `fd` is non-blocking (`O_NONBLOCK`; `true` if that cannot be
/// told).
pub(crate) fn is_nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL has no argument; `fd` is only inspected.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl < 0 || fl & libc::O_NONBLOCK != 0
}

/// Makes the stream socket `fd` blocking (clears `O_NONBLOCK` of its open
/// file) with a receive time limit of `timeout` (`SO_RCVTIMEO`), for
/// [`recv_wait`]. Every other read and write of the engine passes
/// `MSG_DONTWAIT` ([`readv`], [`writev`]), so they stay non-blocking.
/// Fails with `ENOTSOCK` (and changes nothing) on anything but a stream
/// socket, whose reads could not pass `MSG_DONTWAIT`.
pub(crate) fn make_blocking(fd: RawFd, timeout: std::time::Duration) -> io::Result<()> {
    let mut ty: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4);
    // SAFETY: `ty` is a valid int of the size passed.
    let ret = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&raw mut ty).cast(),
            &mut len,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    if ty != libc::SOCK_STREAM {
        return Err(io::Error::from_raw_os_error(libc::ENOTSOCK));
    }
    set_recv_timeout(fd, timeout)?;
    // SAFETY: F_GETFL has no argument.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(io::Error::last_os_error());
    }
    if fl & libc::O_NONBLOCK != 0 {
        // SAFETY: F_SETFL with an int argument.
        if unsafe { libc::fcntl(fd, libc::F_SETFL, fl & !libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Sets or clears `O_NONBLOCK` of `fd` (tests: another holder of the
/// descriptor changes it).
#[cfg(test)]
pub(crate) fn set_nonblocking(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor the caller keeps open.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(io::Error::last_os_error());
    }
    let fl = if on {
        fl | libc::O_NONBLOCK
    } else {
        fl & !libc::O_NONBLOCK
    };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, fl) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets `SO_RCVTIMEO` of `fd` (rounded up to whole microseconds; at least
/// one, as zero would mean no limit). A time beyond the kernel's range
/// (`Duration::MAX`) is no limit: a sleep then arms no kernel timer.
pub(crate) fn set_recv_timeout(fd: RawFd, timeout: std::time::Duration) -> io::Result<()> {
    let us = timeout.as_micros().max(1);
    let tv = libc::timeval {
        tv_sec: libc::time_t::try_from(us / 1_000_000).unwrap_or(libc::time_t::MAX),
        tv_usec: (us % 1_000_000) as libc::suseconds_t,
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::timeval>()).unwrap_or(16);
    // SAFETY: `tv` is a valid `struct timeval` of the size passed.
    let ret = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            len,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Feeds `len` bytes at `offset` of `mem` to a CRC; `false` if the range is
/// outside the memory.
pub(crate) fn crc_update_mem(crc: &mut Crc32c, mem: &Memory, offset: usize, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let Some(p) = mem.ptr_at(offset, len) else {
        return false;
    };
    // SAFETY: `ptr_at` checked that `[p, p+len)` lies inside the live
    // allocation of `mem`, which the caller keeps alive. The slice lives only
    // for this CRC pass. Bytes a remote peer writes meanwhile give a CRC that
    // does not match them, which is the outcome DMA hardware has too.
    let bytes = unsafe { std::slice::from_raw_parts(p.cast_const(), len) };
    crc.update(bytes);
    true
}

/// Sends FIN: no more bytes from this side (`shutdown(SHUT_WR)`).
pub(crate) fn shutdown_write(fd: RawFd) -> io::Result<()> {
    // SAFETY: plain syscall on a descriptor the caller keeps open.
    let ret = unsafe { libc::shutdown(fd, libc::SHUT_WR) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Abortive close: the connection is reset (RST) at once, queued bytes are
/// dropped. Done with `connect(AF_UNSPEC)` after `SO_LINGER {1, 0}`, which
/// disconnects the socket without closing the descriptor (so pollers that
/// still watch it see the hang-up instead of a recycled descriptor).
pub(crate) fn reset_connection(fd: RawFd) -> io::Result<()> {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let len = libc::socklen_t::try_from(std::mem::size_of::<libc::linger>()).unwrap_or(8);
    // SAFETY: `linger` is a valid `struct linger` of the size passed.
    let ret = unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            len,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: an all-zero sockaddr with family AF_UNSPEC is valid input.
    let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
    addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    let alen = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr>()).unwrap_or(16);
    // SAFETY: `addr` is a valid sockaddr of the size passed.
    let ret = unsafe { libc::connect(fd, &raw const addr, alen) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // Wake readers and writers (shutdown of a disconnected socket).
    // SAFETY: plain syscall on a descriptor the caller keeps open.
    unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    Ok(())
}

/// The TCP maximum segment size of a connected socket.
pub(crate) fn tcp_maxseg(fd: RawFd) -> io::Result<usize> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4);
    // SAFETY: `value` and `len` are valid for writes and sized for an int
    // option.
    let ret = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_MAXSEG,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(value).unwrap_or(0))
}

/// Pins the calling thread to one CPU.
pub(crate) fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: `cpu_set_t` is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= libc::CPU_SETSIZE as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "CPU number too large",
        ));
    }
    // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the
    // calling thread.
    let ret = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs the process may run on.
pub(crate) fn allowed_cpus() -> Vec<usize> {
    // SAFETY: as above, all-zero is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is valid for writes of its size.
    let ret =
        unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if ret < 0 {
        return vec![0];
    }
    // SAFETY: `set` was filled by the kernel; CPU_ISSET reads it.
    let cpus: Vec<usize> = (0..libc::CPU_SETSIZE as usize)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect();
    if cpus.is_empty() { vec![0] } else { cpus }
}

/// Voluntary and involuntary context switches of the calling thread
/// (`getrusage(RUSAGE_THREAD)`).
pub fn thread_context_switches() -> (u64, u64) {
    context_switches(libc::RUSAGE_THREAD)
}

/// Voluntary and involuntary context switches of the whole process, all
/// threads (`getrusage(RUSAGE_SELF)`).
pub fn process_context_switches() -> (u64, u64) {
    context_switches(libc::RUSAGE_SELF)
}

fn context_switches(who: libc::c_int) -> (u64, u64) {
    // SAFETY: `rusage` is plain data; all-zero is valid.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is valid for writes.
    let ret = unsafe { libc::getrusage(who, &mut ru) };
    if ret < 0 {
        return (0, 0);
    }
    (
        u64::try_from(ru.ru_nvcsw).unwrap_or(0),
        u64::try_from(ru.ru_nivcsw).unwrap_or(0),
    )
}

/// The CPUs the engine's threads may use: the CPUs of the affinity mask, at
/// most as many as the process can keep busy at once under its cgroup CPU
/// quota (`std::thread::available_parallelism` reads both the mask and
/// `cpu.max` / `cpu.cfs_quota_us`). A process limited to 1.5 CPUs of a
/// 2-CPU mask gets one CPU here.
pub(crate) fn usable_cpus() -> Vec<usize> {
    let mut cpus = allowed_cpus();
    let limit = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
    cpus.truncate(limit.max(1));
    cpus
}

/// Starts an engine thread with every signal blocked, so that signals sent
/// to the process (`SIGINT`, `SIGALRM`, `SIGCHLD`, a profiler's `SIGPROF`)
/// are delivered to the application's own threads and never interrupt or
/// run handlers on an engine thread inside another program. The mask is
/// set in the spawning thread around `spawn` (a new thread inherits it), so
/// there is no window in which the new thread accepts signals.
pub fn spawn_engine_thread<F>(name: String, f: F) -> io::Result<std::thread::JoinHandle<()>>
where
    F: FnOnce() + Send + 'static,
{
    // SAFETY: `sigset_t` is plain data; `sigfillset` initialises it.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above, filled by `pthread_sigmask` below.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `all` is valid for writes.
    unsafe { libc::sigfillset(&mut all) };
    // SAFETY: both sets are valid; this changes the calling thread's mask
    // only, and it is restored below before returning.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old) } == 0;
    let r = std::thread::Builder::new().name(name).spawn(f);
    if blocked {
        // SAFETY: `old` holds the mask saved above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    r
}

/// Whether `signal` is blocked in the calling thread.
pub fn signal_blocked(signal: i32) -> bool {
    // SAFETY: plain data, filled by `pthread_sigmask`.
    let mut cur: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null new set only reads the mask into `cur`.
    if unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut cur) } != 0 {
        return false;
    }
    // SAFETY: `cur` was filled by the kernel.
    unsafe { libc::sigismember(&cur, signal) == 1 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;

    /// Regression: the engine wrote with `writev(2)`, which raises
    /// `SIGPIPE` on a connection the peer closed; in a program that does not
    /// ignore it (a C program using the drop-in libraries, whose thread
    /// sends directly) that ended the process. Writes now fail with `EPIPE`
    /// and raise nothing, with one buffer and with several.
    #[test]
    fn writes_to_a_closed_peer_fail_with_epipe_and_raise_no_sigpipe() {
        // SAFETY: plain signal-set calls on a local set and this thread's
        // mask. Blocked, a SIGPIPE the writes raised stays pending even
        // though the test process ignores it (the kernel never discards a
        // blocked signal as ignored).
        let set = unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            set
        };
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        drop(b);
        let (x, y) = (*b"one", *b"two");
        let mut one = IoVecs::new();
        one.push_slice(&x);
        let mut two = IoVecs::new();
        two.push_slice(&x);
        two.push_slice(&y);
        let errors: Vec<_> = [&one, &two]
            .into_iter()
            .map(|iov| writev(a.as_raw_fd(), iov).unwrap_err().raw_os_error())
            .collect();
        // SAFETY: as above; `sigtimedwait` with a zero timeout takes a
        // pending SIGPIPE (if any) so that unblocking does not deliver it.
        let raised = unsafe {
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut pending);
            let raised = libc::sigismember(&pending, libc::SIGPIPE) == 1;
            if raised {
                let zero = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
            }
            libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
            raised
        };
        assert_eq!(errors, [Some(libc::EPIPE), Some(libc::EPIPE)]);
        assert!(!raised, "a write raised SIGPIPE");
    }

    /// One buffer goes through `send`/`recv` on a socket, and through the
    /// vectored calls on a descriptor that is no socket (a pipe): the same
    /// bytes, the same end-of-stream and would-block answers either way.
    #[test]
    fn one_buffer_reads_and_writes_on_sockets_and_on_pipes() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 16];
        let mut iov = IoVecs::new();
        iov.push_slice_mut(&mut buf);
        assert_eq!(
            readv(b.as_raw_fd(), &iov).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        a.write_all(b"ping").unwrap();
        assert_eq!(readv(b.as_raw_fd(), &iov).unwrap(), 4);
        iov.clear();
        assert_eq!(&buf[..4], b"ping");
        let mut out = IoVecs::new();
        out.push_slice(b"pong");
        assert_eq!(writev(b.as_raw_fd(), &out).unwrap(), 4);
        let mut got = [0u8; 4];
        a.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong");
        drop(a);
        let mut iov = IoVecs::new();
        iov.push_slice_mut(&mut buf);
        assert_eq!(readv(b.as_raw_fd(), &iov).unwrap(), 0);

        let mut fds = [0; 2];
        // SAFETY: `pipe` fills the two descriptors, owned below.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just made and are owned once.
        let (r, w) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        let mut out = IoVecs::new();
        out.push_slice(b"pipe");
        assert_eq!(writev(w.as_raw_fd(), &out).unwrap(), 4);
        let mut buf = [0u8; 8];
        let mut iov = IoVecs::new();
        iov.push_slice_mut(&mut buf);
        assert_eq!(readv(r.as_raw_fd(), &iov).unwrap(), 4);
        iov.clear();
        assert_eq!(&buf[..4], b"pipe");
    }

    /// Runs `f` on a thread of its own; fails if it has not returned
    /// within a minute (a call that blocked would hang the test).
    fn bounded<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(std::time::Duration::from_secs(60))
            .expect("a call blocked")
    }

    /// Once a waiter made the socket blocking (to sleep in `recv_wait`),
    /// every other read and write of the engine still returns at once:
    /// they pass `MSG_DONTWAIT` (one buffer and several).
    #[test]
    fn engine_reads_and_writes_never_block_on_a_blocking_socket() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        make_blocking(b.as_raw_fd(), std::time::Duration::from_secs(600)).unwrap();
        assert!(!is_nonblocking(b.as_raw_fd()));
        let kinds = bounded(move || {
            let mut x = [0u8; 16];
            let mut y = [0u8; 16];
            let mut one = IoVecs::new();
            one.push_slice_mut(&mut x);
            let r1 = readv(b.as_raw_fd(), &one).unwrap_err().kind();
            let mut two = IoVecs::new();
            two.push_slice_mut(&mut x);
            two.push_slice_mut(&mut y);
            let r2 = readv(b.as_raw_fd(), &two).unwrap_err().kind();
            // Writes until the socket is full: one buffer, then two.
            let big = vec![1u8; 64 * 1024];
            let mut out = IoVecs::new();
            out.push_slice(&big);
            let w1 = loop {
                match writev(b.as_raw_fd(), &out) {
                    Ok(_) => continue,
                    Err(e) => break e.kind(),
                }
            };
            let mut out2 = IoVecs::new();
            out2.push_slice(&big[..10]);
            out2.push_slice(&big[..10]);
            let w2 = writev(b.as_raw_fd(), &out2).unwrap_err().kind();
            drop(a);
            [r1, r2, w1, w2]
        });
        assert_eq!(kinds, [io::ErrorKind::WouldBlock; 4]);
    }

    /// `recv_wait` sleeps until bytes come, at most the socket's time
    /// limit (then `WouldBlock`), and returns 0 at the end of the stream.
    #[test]
    fn recv_wait_sleeps_until_bytes_or_its_time_limit() {
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        make_blocking(b.as_raw_fd(), std::time::Duration::from_millis(20)).unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(
            recv_wait(b.as_raw_fd(), &mut buf).unwrap_err().kind(),
            io::ErrorKind::WouldBlock
        );
        make_blocking(b.as_raw_fd(), std::time::Duration::from_secs(600)).unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = [0u8; 8];
            let n = recv_wait(b.as_raw_fd(), &mut buf).unwrap();
            let end = recv_wait(b.as_raw_fd(), &mut buf[n..]).unwrap();
            (buf, n, end)
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        a.write_all(b"wake").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(a);
        let (buf, n, end) = t.join().unwrap();
        assert_eq!((&buf[..n], end), (&b"wake"[..], 0));
    }

    /// `Duration::MAX` sets no limit (read back as none), a finite time
    /// one.
    #[test]
    fn a_recv_time_limit_of_duration_max_is_none() {
        let (_a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        set_recv_timeout(b.as_raw_fd(), std::time::Duration::MAX).unwrap();
        assert_eq!(b.read_timeout().unwrap(), None);
        set_recv_timeout(b.as_raw_fd(), std::time::Duration::from_millis(50)).unwrap();
        assert!(b.read_timeout().unwrap().is_some());
    }

    /// Only a stream socket is made blocking: a pipe (whose reads could
    /// not pass `MSG_DONTWAIT`) and a datagram socket stay as they are.
    #[test]
    fn make_blocking_refuses_what_is_no_stream_socket() {
        let mut fds = [0; 2];
        // SAFETY: `pipe2` fills the two descriptors, owned below.
        let made = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) };
        assert_eq!(made, 0);
        // SAFETY: both descriptors were just made and are owned once.
        let (r, _w) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::fs::File::from_raw_fd(fds[0]),
                std::fs::File::from_raw_fd(fds[1]),
            )
        };
        let e = make_blocking(r.as_raw_fd(), std::time::Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTSOCK));
        assert!(is_nonblocking(r.as_raw_fd()));
        let u = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        u.set_nonblocking(true).unwrap();
        let e = make_blocking(u.as_raw_fd(), std::time::Duration::from_secs(1)).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTSOCK));
        assert!(is_nonblocking(u.as_raw_fd()));
    }

    /// Several pieces go out byte-exact and in order whether they are
    /// gathered on the stack and sent as one buffer (at most
    /// `GATHER_MAX` octets), sent with `sendmsg` (more), or written with
    /// `writev` (a pipe, no socket).
    #[test]
    fn small_and_large_lists_of_pieces_arrive_byte_exact() {
        let data: Vec<u8> = (0..2048u32).map(|i| (i * 7 + i / 256) as u8).collect();
        for sizes in [
            &[14usize, 4][..],
            &[100, 1, 50, 300],
            &[GATHER_MAX - 1, 1],
            &[GATHER_MAX, 1],
            &[700, 900],
        ] {
            let total: usize = sizes.iter().sum();
            let mut out = IoVecs::new();
            let mut at = 0;
            for &n in sizes {
                out.push_slice(&data[at..at + n]);
                at += n;
            }
            let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
            assert_eq!(writev(b.as_raw_fd(), &out).unwrap(), total, "{sizes:?}");
            let mut got = vec![0u8; total];
            a.read_exact(&mut got).unwrap();
            assert_eq!(got, data[..total], "{sizes:?}");

            let mut fds = [0; 2];
            // SAFETY: `pipe` fills the two descriptors, owned below.
            let made = unsafe { libc::pipe(fds.as_mut_ptr()) };
            assert_eq!(made, 0);
            // SAFETY: both descriptors were just made and are owned once.
            let (mut r, w) = unsafe {
                use std::os::fd::FromRawFd;
                (
                    std::fs::File::from_raw_fd(fds[0]),
                    std::fs::File::from_raw_fd(fds[1]),
                )
            };
            assert_eq!(writev(w.as_raw_fd(), &out).unwrap(), total, "{sizes:?}");
            drop(w);
            let mut got = Vec::new();
            r.read_to_end(&mut got).unwrap();
            assert_eq!(got, data[..total], "pipe {sizes:?}");
        }
    }
}
