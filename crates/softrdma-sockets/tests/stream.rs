//! Offloaded and plain byte streams on loopback.

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::thread;
use std::time::Duration;

use common::pair;
use rand::{Rng, RngCore, SeedableRng};
use softrdma_sockets::{Config, Mode, PlainReason, TcpListener, TcpStream, Transport};

fn offload_pair() -> (TcpStream, TcpStream) {
    let cfg = Config::with_mode(Mode::Offload);
    let (c, s) = pair(&cfg, &cfg);
    assert!(c.transport().is_offloaded(), "{}", c.transport());
    assert!(s.transport().is_offloaded(), "{}", s.transport());
    (c, s)
}

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Writes `data` in random-sized pieces from one thread while the other
/// end reads in random-sized pieces; returns what was read.
fn transfer(mut w: TcpStream, mut r: TcpStream, data: Vec<u8>, seed: u64) -> (TcpStream, Vec<u8>) {
    let d = data.clone();
    let writer = thread::spawn(move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut off = 0;
        while off < d.len() {
            let n = rng.random_range(1..=200_000usize).min(d.len() - off);
            w.write_all(&d[off..off + n]).unwrap();
            off += n;
        }
        w.shutdown(Shutdown::Write).unwrap();
        w
    });
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 1);
    let mut got = Vec::new();
    let mut buf = vec![0u8; 300_000];
    loop {
        let n = rng.random_range(1..=buf.len());
        match r.read(&mut buf[..n]).unwrap() {
            0 => break,
            k => got.extend_from_slice(&buf[..k]),
        }
    }
    let _w = writer.join().unwrap();
    (r, got)
}

#[test]
fn offloaded_byte_exact_both_ways() {
    for (i, size) in [
        0usize,
        1,
        15,
        16,
        17,
        65519,
        65520,
        65521,
        1 << 20,
        3_000_001,
    ]
    .into_iter()
    .enumerate()
    {
        let (c, s) = offload_pair();
        let c2 = c.try_clone().unwrap();
        let s2 = s.try_clone().unwrap();
        let a = random_bytes(i as u64, size);
        let b = random_bytes(100 + i as u64, size / 2 + 3);
        let (a2, b2) = (a.clone(), b.clone());
        let up = thread::spawn(move || transfer(c, s, a2, 7 + i as u64).1);
        let down = thread::spawn(move || transfer(s2, c2, b2, 9 + i as u64).1);
        assert!(up.join().unwrap() == a, "client→server {size}");
        assert!(down.join().unwrap() == b, "server→client {size}");
    }
}

#[test]
fn tiny_writes_and_nodelay() {
    let (mut c, mut s) = offload_pair();
    let data = random_bytes(5, 50_000);
    let d = data.clone();
    let t = thread::spawn(move || {
        for ch in d.chunks(3) {
            c.write_all(ch).unwrap();
        }
        c.set_nodelay(true).unwrap();
        for ch in d.chunks(7) {
            c.write_all(ch).unwrap();
        }
        c
    });
    let mut got = vec![0u8; 100_000];
    s.read_exact(&mut got).unwrap();
    assert!(got[..50_000] == data[..] && got[50_000..] == data[..]);
    drop(t.join().unwrap());
    let mut end = [0u8; 1];
    assert_eq!(s.read(&mut end).unwrap(), 0);
}

#[test]
fn ping_pong_small() {
    let (mut c, mut s) = offload_pair();
    let t = thread::spawn(move || {
        let mut b = [0u8; 64];
        for _ in 0..2000 {
            s.read_exact(&mut b).unwrap();
            s.write_all(&b).unwrap();
        }
    });
    let mut b = [7u8; 64];
    for i in 0..2000u32 {
        b[..4].copy_from_slice(&i.to_be_bytes());
        c.write_all(&b).unwrap();
        let mut r = [0u8; 64];
        c.read_exact(&mut r).unwrap();
        assert_eq!(r, b);
    }
    t.join().unwrap();
    eprintln!("lost wake-ups so far: {}", softrdma_sockets::lost_wakeups());
}

#[test]
fn half_close_then_reply() {
    let (mut c, mut s) = offload_pair();
    c.write_all(b"request").unwrap();
    c.shutdown(Shutdown::Write).unwrap();
    let mut req = Vec::new();
    s.read_to_end(&mut req).unwrap();
    assert_eq!(req, b"request");
    // The half-closed client still reads.
    s.write_all(b"response").unwrap();
    drop(s);
    let mut resp = Vec::new();
    c.read_to_end(&mut resp).unwrap();
    assert_eq!(resp, b"response");
    assert_eq!(
        c.write(b"x").unwrap_err().kind(),
        std::io::ErrorKind::BrokenPipe
    );
}

#[test]
fn abort_resets_peer() {
    let (c, mut s) = offload_pair();
    c.abort();
    let mut b = [0u8; 8];
    let e = loop {
        match s.read(&mut b) {
            Err(e) => break e,
            Ok(0) => panic!("EOF instead of reset"),
            Ok(_) => {}
        }
    };
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
}

#[test]
fn peek_then_read() {
    let (mut c, mut s) = offload_pair();
    c.write_all(b"abcdef").unwrap();
    c.flush().unwrap();
    let mut p = [0u8; 3];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut n = 0;
    while n < 3 {
        n = s.peek(&mut p).unwrap();
    }
    assert_eq!(&p, b"abc");
    let mut all = [0u8; 6];
    s.read_exact(&mut all).unwrap();
    assert_eq!(&all, b"abcdef");
}

#[test]
fn nonblocking_and_timeouts() {
    let (mut c, mut s) = offload_pair();
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    assert_eq!(
        s.read(&mut b).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    s.set_nonblocking(false).unwrap();
    s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
    assert_eq!(
        s.read(&mut b).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock
    );
    // Writes without a reader fill the buffers, then would block.
    c.set_nonblocking(true).unwrap();
    let chunk = vec![1u8; 64 * 1024];
    let mut written = 0usize;
    let e = loop {
        match c.write(&chunk) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
        assert!(written < 64 << 20, "never blocked");
    };
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    c.set_nonblocking(false).unwrap();
    c.set_write_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    // A non-blocking write may find the staging buffers busy before the
    // reader's ring is full (its sends still under way): timed writes go on
    // until the credits are gone, then time out.
    let e = loop {
        match c.write(&chunk) {
            Ok(n) => written += n,
            Err(e) => break e,
        }
        assert!(written < 64 << 20, "never timed out");
    };
    assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock);
    // Reading drains everything that was accepted.
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = vec![0u8; written];
    s.read_exact(&mut got).unwrap();
    assert!(got.iter().all(|&x| x == 1));
}

#[test]
fn addresses_and_fd_are_the_kernel_socket() {
    use std::os::fd::AsRawFd;
    let (c, s) = offload_pair();
    assert_eq!(c.local_addr().unwrap(), s.peer_addr().unwrap());
    assert_eq!(c.peer_addr().unwrap(), s.local_addr().unwrap());
    // The descriptor is a TCP socket with the same names.
    let fd = c.as_raw_fd();
    let sr = socket2::SockRef::from(&c);
    assert_eq!(
        sr.local_addr().unwrap().as_socket().unwrap(),
        c.local_addr().unwrap()
    );
    sr.set_keepalive(true).unwrap();
    assert!(sr.keepalive().unwrap());
    assert!(fd >= 0);
}

#[test]
fn tcp_mode_is_plain() {
    let cfg = Config::with_mode(Mode::Tcp);
    let (c, s) = pair(&cfg, &cfg);
    assert_eq!(c.transport(), Transport::Plain(PlainReason::Policy));
    assert_eq!(s.transport(), Transport::Plain(PlainReason::Policy));
}

fn poll_fd(fd: i32, events: i16, timeout_ms: i32) -> i16 {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd on the stack, count 1.
    let n = unsafe { libc::poll(&mut p, 1, timeout_ms) };
    assert!(n >= 0);
    p.revents
}

#[test]
fn readiness_fd_follows_data_space_and_eof() {
    let (mut c, mut s) = offload_pair();
    let rfd = s.readiness_fd().unwrap();
    assert_eq!(poll_fd(rfd, libc::POLLIN, 0) & libc::POLLIN, 0);
    c.write_all(b"wake up").unwrap();
    c.flush().unwrap();
    assert_ne!(poll_fd(rfd, libc::POLLIN, 5000) & libc::POLLIN, 0);
    let mut b = [0u8; 7];
    s.read_exact(&mut b).unwrap();
    assert_eq!(poll_fd(rfd, libc::POLLIN, 0) & libc::POLLIN, 0);

    // Writable until the buffers are full, then not; space comes back when
    // the peer reads.
    let wfd = c.readiness_fd().unwrap();
    assert_ne!(poll_fd(wfd, libc::POLLOUT, 0) & libc::POLLOUT, 0);
    c.set_nonblocking(true).unwrap();
    let chunk = vec![3u8; 65536];
    let mut written = 0;
    // Until the peer's credits are used up: a WouldBlock while sends are
    // still completing is followed by space again (the descriptor turns
    // writable then, which is right); once the unread peer has no buffer
    // left, nothing frees space.
    loop {
        match c.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if poll_fd(wfd, libc::POLLOUT, 200) & libc::POLLOUT == 0 {
                    break;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(poll_fd(wfd, libc::POLLOUT, 0) & libc::POLLOUT, 0);
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut got = vec![0u8; written];
    s.read_exact(&mut got).unwrap();
    assert_ne!(poll_fd(wfd, libc::POLLOUT, 5000) & libc::POLLOUT, 0);

    // EOF makes it readable.
    c.shutdown(Shutdown::Write).unwrap();
    assert_ne!(poll_fd(rfd, libc::POLLIN, 5000) & libc::POLLIN, 0);
    assert_eq!(s.read(&mut b).unwrap(), 0);
}

/// Small rings, random sizes and random pauses on both sides, both
/// directions at once: every byte arrives, no connection error (a Send
/// without a posted receive would end the connection with a Terminate).
#[test]
fn credits_under_random_pacing_never_terminate() {
    let mut cfg = Config::with_mode(Mode::Offload);
    cfg.rx_bufs = 4;
    cfg.tx_bufs = 2;
    cfg.buf_size = 4096;
    for round in 0..3u64 {
        let (c, s) = pair(&cfg, &cfg);
        assert!(c.transport().is_offloaded());
        let mut handles = Vec::new();
        for (dir, (mut w, mut r)) in [(c.try_clone().unwrap(), s.try_clone().unwrap()), (s, c)]
            .into_iter()
            .enumerate()
        {
            let seed = round * 10 + dir as u64;
            let data = random_bytes(seed, 400_000);
            let d = data.clone();
            handles.push(thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
                let mut off = 0;
                while off < d.len() {
                    let n = rng.random_range(1..9000usize).min(d.len() - off);
                    w.write_all(&d[off..off + n]).unwrap();
                    off += n;
                    if rng.random_range(0..20) == 0 {
                        thread::sleep(Duration::from_micros(rng.random_range(0..2000)));
                    }
                }
                w.flush().unwrap();
                w
            }));
            handles.push(thread::spawn(move || {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 5);
                let mut got = vec![0u8; data.len()];
                let mut off = 0;
                while off < got.len() {
                    let n = rng.random_range(1..7000usize).min(got.len() - off);
                    let k = r.read(&mut got[off..off + n]).unwrap();
                    assert!(k > 0);
                    off += k;
                    if rng.random_range(0..20) == 0 {
                        thread::sleep(Duration::from_micros(rng.random_range(0..2000)));
                    }
                }
                assert!(got == data);
                r
            }));
        }
        let ends: Vec<TcpStream> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        for e in &ends {
            assert!(e.take_error().unwrap().is_none());
        }
    }
}

fn exit_reply() -> Vec<u8> {
    (0..2_000_000u32)
        .map(|i| (i * 13 + (i >> 7)) as u8)
        .collect()
}

/// Server side of `process_exiting_right_after_close_still_sends_disconn`
/// (a child process of this test binary; does nothing when run alone).
#[test]
#[ignore = "child process of process_exiting_right_after_close_still_sends_disconn"]
fn exit_after_close_child() {
    let Ok(addr) = std::env::var("SD_EXIT_ADDR") else {
        return;
    };
    let mut s = TcpStream::connect_with(&addr, &Config::with_mode(Mode::Offload)).unwrap();
    let mut req = [0u8; 4];
    s.read_exact(&mut req).unwrap();
    s.write_all(&exit_reply()).unwrap();
    drop(s);
    // The process exits at once.
}

/// Regression: the last reference to a connection could be the engine's
/// completion callback thread's (it holds one while it runs), so closing
/// the stream ran the graceful close there while the application went on;
/// a process exiting right after closing cut it off: the peer saw the TCP
/// connection end without a DisConn and lost queued data (a flush error
/// instead of EOF after all of it).
#[test]
fn process_exiting_right_after_close_still_sends_disconn() {
    for _ in 0..4 {
        let l = TcpListener::bind_with("127.0.0.1:0", &Config::with_mode(Mode::Offload)).unwrap();
        let addr = l.local_addr().unwrap();
        let mut child = std::process::Command::new("timeout")
            .arg("60")
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "exit_after_close_child", "--include-ignored"])
            .env("SD_EXIT_ADDR", addr.to_string())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (mut s, _) = l.accept().unwrap();
        assert!(s.transport().is_offloaded());
        s.write_all(b"go!!").unwrap();
        s.shutdown(Shutdown::Write).unwrap();
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        assert!(got == exit_reply(), "{} octets", got.len());
        assert!(child.wait().unwrap().success());
    }
}

/// The readiness descriptor under edge-triggered epoll (how an event loop
/// uses it): read until `WouldBlock`, then wait for the next edge; every
/// write of the peer is seen, none is left waiting for an edge.
#[test]
fn readiness_fd_edge_triggered_epoll_sees_every_write() {
    let (mut c, mut s) = offload_pair();
    s.set_nonblocking(true).unwrap();
    let rfd = s.readiness_fd().unwrap();
    // SAFETY: plain epoll calls on descriptors this test owns.
    let ep = unsafe { libc::epoll_create1(0) };
    assert!(ep >= 0);
    let mut ev = libc::epoll_event {
        events: (libc::EPOLLIN | libc::EPOLLET) as u32,
        u64: 1,
    };
    // SAFETY: valid epoll descriptor, event on the stack.
    let added = unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, rfd, &mut ev) };
    assert_eq!(added, 0);
    let total = 3000usize;
    let t = thread::spawn(move || {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for i in 0..total {
            c.write_all(&(i as u32).to_be_bytes()).unwrap();
            c.flush().unwrap();
            if rng.random_range(0..4) == 0 {
                thread::sleep(Duration::from_micros(rng.random_range(0..300)));
            }
        }
        c
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while got.len() < total * 4 {
        loop {
            match s.read(&mut buf) {
                Ok(0) => panic!("EOF"),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        if got.len() == total * 4 {
            break;
        }
        let mut out = [libc::epoll_event { events: 0, u64: 0 }; 4];
        // SAFETY: valid epoll descriptor, buffer of 4 events.
        let n = unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 4, 20_000) };
        assert!(
            n > 0,
            "no edge for 20 s with {} of {} octets read",
            got.len(),
            total * 4
        );
    }
    for (i, ch) in got.chunks(4).enumerate() {
        assert_eq!(u32::from_be_bytes(ch.try_into().unwrap()), i as u32);
    }
    drop(t.join().unwrap());
    // SAFETY: closing the epoll descriptor this test created.
    unsafe { libc::close(ep) };
}

/// The receive time limit of the kernel socket under `s` (`None`: none),
/// read through a duplicate of its descriptor.
fn recv_limit(fd: &std::os::fd::OwnedFd) -> Option<Duration> {
    socket2::SockRef::from(fd).read_timeout().unwrap()
}

/// Waits (up to 10 s) until the receive time limit of the kernel socket
/// under `fd` satisfies `want`, and returns it; fails the test if it
/// never does. The sleep in `recv` sets the limit when it starts, which
/// a loaded machine may delay.
fn wait_for_limit(
    fd: &std::os::fd::OwnedFd,
    want: impl Fn(Option<Duration>) -> bool,
    what: &str,
) -> Option<Duration> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let limit = recv_limit(fd);
        if want(limit) {
            return limit;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{what}: the receive time limit stayed {limit:?} for 10 s"
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// A blocked read through the stream's only handle (`Read` of a
/// `TcpStream` that has no clone) sleeps in the kernel socket's `recv`
/// with no time limit (no kernel timer armed per sleep): nobody else can
/// call on the connection meanwhile. One through `&TcpStream`, or while a
/// clone lives (another thread may change what it waits for: its
/// `shutdown(Read)`, data it leaves corked), keeps the re-poll limit.
///
/// On one connection a read through `&TcpStream` first sets the limit,
/// then one through the only handle takes it away: a socket that never
/// slept in `recv` would show no limit either, so the change is what
/// tells the only handle's sleep in `recv` happened.
#[test]
fn a_blocked_read_by_the_only_handle_sleeps_without_a_time_limit() {
    use std::os::fd::AsFd;
    let bounded = |l: Option<Duration>| l.is_some_and(|d| d <= Duration::from_secs(1));
    // Through a shared reference, then through the only handle.
    let (c, mut s) = offload_pair();
    let fd = c.as_fd().try_clone_to_owned().unwrap();
    let reader = thread::spawn(move || {
        let mut c = c;
        let mut b = [0u8; 4];
        (&c).read_exact(&mut b).unwrap();
        let first = b;
        c.read_exact(&mut b).unwrap();
        (first, b)
    });
    let shared = wait_for_limit(&fd, bounded, "shared reference");
    s.write_all(b"one!").unwrap();
    let only = wait_for_limit(&fd, |l| l.is_none(), "only handle after a shared reference");
    s.write_all(b"two!").unwrap();
    assert_eq!(reader.join().unwrap(), (*b"one!", *b"two!"));
    assert!(bounded(shared), "{shared:?}");
    assert_eq!(only, None);
    // While a clone lives.
    let (c, mut s) = offload_pair();
    let fd = c.as_fd().try_clone_to_owned().unwrap();
    let clone = c.try_clone().unwrap();
    let reader = thread::spawn(move || {
        let mut c = c;
        let mut b = [0u8; 4];
        c.read_exact(&mut b).unwrap();
        b
    });
    let limit = wait_for_limit(&fd, bounded, "with a clone");
    s.write_all(b"wake").unwrap();
    assert_eq!(&reader.join().unwrap(), b"wake");
    assert!(bounded(limit), "{limit:?}");
    drop(clone);
}
