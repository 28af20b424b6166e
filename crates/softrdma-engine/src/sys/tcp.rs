//! TCP socket queries that the standard library does not offer.

use std::io;
use std::os::fd::RawFd;

/// Bytes handed to a TCP socket that its peer has not acknowledged yet
/// (sent and unacknowledged, plus not sent yet): `ioctl(SIOCOUTQ)`. 0 once
/// the connection is gone (reset: the kernel keeps counting the bytes it
/// will never send, which nobody will acknowledge).
pub(crate) fn unacked_bytes(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ (= TIOCOUTQ) writes one int through the pointer,
    // which points to a live, writable `c_int`; the descriptor is the
    // caller's and stays open for the call.
    let ret = unsafe { libc::ioctl(fd, libc::TIOCOUTQ, &raw mut n) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    if n > 0 && is_closed(fd) {
        return Ok(0);
    }
    Ok(usize::try_from(n).unwrap_or(0))
}

/// What names an open file (a socket) whatever descriptor number it has:
/// its device and inode (`fstat(2)`).
pub(crate) type FileId = (u64, u64);

/// The identity of the file `fd` names now; `None` if `fd` is not open.
pub(crate) fn file_id(fd: RawFd) -> Option<FileId> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one `struct stat` through the pointer, which
    // points to room for one; it reads nothing else. Any descriptor
    // number may be passed (a closed one fails with EBADF).
    let ret = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    if ret < 0 {
        return None;
    }
    // SAFETY: fstat succeeded and filled the struct.
    let st = unsafe { st.assume_init() };
    Some((st.st_dev, st.st_ino))
}

/// `TCP_CLOSE` in `tcp_info`'s `tcpi_state`.
const TCP_CLOSE: u8 = 7;

/// Whether a TCP socket's connection is gone (`TCP_CLOSE`: reset, or
/// timed out), as `getsockopt(TCP_INFO)`'s first byte (`tcpi_state`) says.
fn is_closed(fd: RawFd) -> bool {
    let mut state = [0u8; 8];
    let mut len = state.len() as libc::socklen_t;
    // SAFETY: TCP_INFO writes at most `len` bytes (the buffer's size)
    // through the pointer and the length written through `len`, both
    // live and writable; the descriptor is the caller's.
    let ret = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            state.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    ret == 0 && len >= 1 && state[0] == TCP_CLOSE
}

/// Drops the bytes a TCP socket has received and nobody read, without
/// waiting and without copying them (`recv(MSG_TRUNC | MSG_DONTWAIT)`):
/// a socket closed with unread bytes resets its connection instead of
/// closing it in order. Stops at the first call that finds nothing (or
/// fails), after at most 64 calls.
pub(crate) fn discard_received(fd: RawFd) {
    for _ in 0..64 {
        // SAFETY: with `MSG_TRUNC` a TCP socket discards up to `len` bytes
        // and writes nothing through the (null) buffer pointer.
        let ret = unsafe {
            libc::recv(
                fd,
                std::ptr::null_mut(),
                1 << 20,
                libc::MSG_TRUNC | libc::MSG_DONTWAIT,
            )
        };
        if ret <= 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{ErrorKind, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    /// Bytes a peer with a small window does not read stay counted; once it
    /// reads them all, the count drops to nothing.
    #[test]
    fn counts_what_the_peer_has_not_acknowledged() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        socket2::SockRef::from(&l)
            .set_recv_buffer_size(4096)
            .unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut b, _) = l.accept().unwrap();
        assert_eq!(super::unacked_bytes(a.as_raw_fd()).unwrap(), 0);
        a.set_nonblocking(true).unwrap();
        let chunk = [7u8; 4096];
        let mut written = 0;
        loop {
            match a.write(&chunk) {
                Ok(n) => written += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        std::thread::sleep(Duration::from_millis(50));
        let pending = super::unacked_bytes(a.as_raw_fd()).unwrap();
        assert!(pending > 0 && pending <= written, "{pending} of {written}");
        let mut got = 0;
        let mut buf = vec![0u8; 65536];
        while got < written {
            got += b.read(&mut buf).unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while super::unacked_bytes(a.as_raw_fd()).unwrap() != 0 {
            assert!(Instant::now() < deadline, "never acknowledged");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Bytes received and not read are dropped: the socket then has none
    /// to read (and its close sends a FIN, not a reset).
    #[test]
    fn discards_what_was_received() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.write_all(&[1u8; 200_000]).unwrap();
        drop(a);
        let deadline = Instant::now() + Duration::from_secs(10);
        b.set_nonblocking(true).unwrap();
        let mut one = [0u8; 1];
        loop {
            super::discard_received(b.as_raw_fd());
            match (&b).read(&mut one) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
            assert!(Instant::now() < deadline, "bytes left to read");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
