//! Shared by the stream test binaries: a connected pair on loopback, and
//! an echo session in which the server speaks first.

// Each test binary uses its own part of it.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::thread;

use softrdma_sockets::{Config, TcpListener, TcpStream};

/// A client (first) and a server stream connected on loopback, each with
/// its own configuration.
pub(crate) fn pair(server: &Config, client: &Config) -> (TcpStream, TcpStream) {
    let l = TcpListener::bind_with("127.0.0.1:0", server).unwrap();
    let addr = l.local_addr().unwrap();
    let c = client.clone();
    let t = thread::spawn(move || TcpStream::connect_with(addr, &c).unwrap());
    let (s, _) = l.accept().unwrap();
    (t.join().unwrap(), s)
}

/// Server side of a session: `banner` first, then echo until EOF.
pub(crate) fn serve<S: Read + Write>(mut s: S, banner: &[u8]) {
    s.write_all(banner).unwrap();
    let mut buf = vec![0u8; 70_000];
    loop {
        let n = s.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).unwrap();
    }
}

/// Client side of a session with [`serve`]: reads `banner`, sends `data`
/// in `chunk`-octet writes, each followed by reading its echo (so the echo
/// never backs up), then `shut` (a half-close), and expects EOF with
/// nothing more.
pub(crate) fn session<S: Read + Write>(
    mut s: S,
    banner: &[u8],
    data: &[u8],
    chunk: usize,
    shut: impl FnOnce(&S),
) {
    let mut got_banner = vec![0u8; banner.len()];
    s.read_exact(&mut got_banner).unwrap();
    assert_eq!(got_banner, banner);
    let mut echo = Vec::new();
    for ch in data.chunks(chunk) {
        s.write_all(ch).unwrap();
        let mut got = vec![0u8; ch.len()];
        s.read_exact(&mut got).unwrap();
        echo.extend_from_slice(&got);
    }
    shut(&s);
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
    assert!(echo == data, "echo differs");
}
