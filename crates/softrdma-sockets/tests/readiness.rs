//! Readiness kept by the caller: `TcpStream::arrivals` (an edge per
//! message taken in) and `TcpStream::ready_now` (readable, writable, with
//! no system call), as an epoll kept in user space uses them.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use softrdma_sockets::poll::{POLLIN, PollEntry, poll};
use softrdma_sockets::{Config, Mode, TcpStream};

fn pair(mode: Mode) -> (TcpStream, TcpStream) {
    let cfg = Config::with_mode(mode);
    common::pair(&cfg, &cfg)
}

/// Waits until `s` is readable.
fn readable(s: &TcpStream) {
    let mut e = [PollEntry::stream(s, POLLIN)];
    assert_eq!(
        poll(&mut e, Some(Duration::from_secs(10)), None).unwrap(),
        1
    );
}

#[test]
fn arrivals_count_each_message_and_ready_now_follows_the_data() {
    let (mut c, mut s) = pair(Mode::Offload);
    assert!(s.transport().is_offloaded());
    assert_eq!(
        s.ready_now().map(|r| r.0),
        Some(false),
        "nothing to read yet"
    );
    let a0 = s.arrivals();
    c.write_all(b"one").unwrap();
    readable(&s);
    let a1 = s.arrivals();
    assert!(a1 > a0, "a message arrived: {a0} -> {a1}");
    assert_eq!(s.ready_now().map(|r| r.0), Some(true));
    let mut b = [0u8; 2];
    assert_eq!(s.read(&mut b).unwrap(), 2);
    assert_eq!(s.ready_now().map(|r| r.0), Some(true), "one octet left");
    c.write_all(b"two").unwrap();
    // The byte left is there all along: only the count tells of the new
    // message.
    let give_up = std::time::Instant::now() + Duration::from_secs(30);
    while s.arrivals() == a1 {
        assert!(
            std::time::Instant::now() < give_up,
            "the second message never counted"
        );
        readable(&s);
        let _ = s.ready_now();
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut rest = [0u8; 8];
    let mut got = Vec::new();
    while got.len() < 4 {
        let n = s.read(&mut rest).unwrap();
        got.extend_from_slice(&rest[..n]);
    }
    assert_eq!(got, b"etwo");
    assert_eq!(s.ready_now().map(|r| r.0), Some(false), "all read");
    drop(c);
    readable(&s);
    assert_eq!(s.ready_now().map(|r| r.0), Some(true), "end of stream");
    assert_eq!(s.read(&mut rest).unwrap(), 0);
}

#[test]
fn a_plain_stream_has_no_readiness_of_its_own() {
    let (_c, s) = pair(Mode::Tcp);
    assert!(!s.transport().is_offloaded());
    assert_eq!(s.ready_now(), None);
    assert_eq!(s.arrivals(), 0);
}
