//! Switching an application's own connected TCP stream
//! (`TcpStream::upgrade`), and with what the caller knows of the socket
//! (`TcpStream::upgrade_known`: the peer's address, `TCP_NODELAY` and
//! `O_NONBLOCK` already set), which the switch then does not ask the
//! kernel for.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::thread;

use softrdma_sockets::{Config, Known, TcpStream, Transport};

fn pair() -> (
    std::net::TcpStream,
    std::net::TcpStream,
    SocketAddr,
    SocketAddr,
) {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let server_addr = l.local_addr().unwrap();
    let c = std::net::TcpStream::connect(server_addr).unwrap();
    let (s, client_addr) = l.accept().unwrap();
    (c, s, server_addr, client_addr)
}

/// Switches both ends (the server in a thread of its own), then sends a
/// message each way.
fn switch_and_talk() {
    let (c, s, _, _) = pair();
    let server = thread::spawn(move || {
        let cfg = Config::default();
        let mut s = TcpStream::upgrade(s, false, &cfg).unwrap();
        assert!(matches!(s.transport(), Transport::Offloaded { .. }));
        let mut b = [0u8; 5];
        s.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"hello");
        s.write_all(b"world!").unwrap();
        s.flush().unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).unwrap();
        assert!(rest.is_empty());
    });
    let cfg = Config::default();
    let mut c = TcpStream::upgrade(c, true, &cfg).unwrap();
    assert!(matches!(c.transport(), Transport::Offloaded { .. }));
    c.write_all(b"hello").unwrap();
    let mut b = [0u8; 6];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"world!");
    drop(c);
    server.join().unwrap();
}

#[test]
fn upgraded_streams_carry_data_both_ways() {
    switch_and_talk();
}

/// The caller's knowledge replaces the kernel's answers: the peer's
/// address on both ends, and on the client a socket it made non-blocking
/// with `TCP_NODELAY` itself.
#[test]
fn streams_upgraded_with_what_the_caller_knows_carry_data_both_ways() {
    let (c, s, server_addr, client_addr) = pair();
    c.set_nodelay(true).unwrap();
    c.set_nonblocking(true).unwrap();
    let client_known = Known {
        peer: Some(server_addr),
        nodelay: true,
        nonblocking: true,
    };
    let server_known = Known {
        peer: Some(client_addr),
        ..Known::default()
    };
    let server = thread::spawn(move || {
        let mut s = TcpStream::upgrade_known(s, false, &Config::default(), &server_known).unwrap();
        assert!(matches!(s.transport(), Transport::Offloaded { .. }));
        let mut b = [0u8; 3];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    });
    let mut c = TcpStream::upgrade_known(c, true, &Config::default(), &client_known).unwrap();
    // The application's stream was non-blocking: the offloaded one is
    // blocking until told otherwise, as `upgrade` leaves it.
    c.write_all(b"abc").unwrap();
    let mut b = [0u8; 3];
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"abc");
    assert_eq!(c.peer_addr().unwrap(), server_addr);
    server.join().unwrap();
}

/// `begin_upgrade_known` returns once this side's MPA Request is written,
/// without the peer: a single thread begins the client's switch, then
/// switches the server (which finds the Request there), then finishes the
/// client's, and the streams carry data both ways.
#[test]
fn a_begun_upgrade_returns_before_the_peer_switches_and_finishes_after_it() {
    let (c, s, server_addr, _) = pair();
    let known = Known {
        peer: Some(server_addr),
        ..Known::default()
    };
    let mut up = TcpStream::begin_upgrade_known(c, true, &Config::default(), &known).unwrap();
    assert!(!up.poll().unwrap(), "done before the peer answered");
    assert!(up.wait_on().is_some());
    let mut s = TcpStream::upgrade(s, false, &Config::default()).unwrap();
    let mut c = up.finish().unwrap();
    assert!(matches!(c.transport(), Transport::Offloaded { .. }));
    c.write_all(b"early").unwrap();
    let mut b = [0u8; 5];
    s.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"early");
    s.write_all(b"reply").unwrap();
    c.read_exact(&mut b).unwrap();
    assert_eq!(&b, b"reply");
}

/// A begun switch dropped unfinished ends the connection: the peer's
/// switch, or its read, fails instead of waiting.
#[test]
fn a_begun_upgrade_dropped_unfinished_ends_the_connection() {
    let (c, s, _, _) = pair();
    let up =
        TcpStream::begin_upgrade_known(c, true, &Config::default(), &Known::default()).unwrap();
    drop(up);
    let t = std::time::Instant::now();
    match TcpStream::upgrade(s, false, &Config::default()) {
        Err(_) => {}
        Ok(mut s) => {
            s.set_read_timeout(Some(std::time::Duration::from_secs(4)))
                .unwrap();
            let mut b = [0u8; 1];
            match s.read(&mut b) {
                Ok(0) => {}
                Err(e) => assert_ne!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock,
                    "the switched end waited for a dropped switch"
                ),
                Ok(n) => panic!("{n} octets from a dropped switch"),
            }
        }
    }
    assert!(
        t.elapsed() < std::time::Duration::from_secs(4),
        "{:?}",
        t.elapsed()
    );
}
