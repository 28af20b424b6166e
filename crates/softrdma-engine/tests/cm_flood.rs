//! Regression test for the listener denial of service: handshakes in
//! progress used to count against the backlog and cost a thread each, so
//! a few silent TCP connections kept every real client out (for the
//! handshake timeout, renewable forever) and 500 half-open connections
//! meant 500 threads. Alone in its test binary so that the thread count of
//! the process is not disturbed by other tests.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::io::Write;
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::cm::{ConnectConfig, ListenConfig, Listener, connect};
use softrdma_engine::proto::mpa::{Initiator, MpaConfig};

const T: Duration = Duration::from_secs(20);

fn serve_one(l: &Listener, dev: &softrdma_engine::Device) -> Duration {
    let a = side(dev, |_| {});
    let b = side(dev, |_| {});
    let addr = l.local_addr();
    let qp = a.qp.clone();
    let start = Instant::now();
    let h = thread::spawn(move || {
        let cfg = ConnectConfig {
            private_data: b"real".to_vec(),
            timeout: T,
            ..ConnectConfig::default()
        };
        connect(&qp, addr, &cfg).map(|_| ())
    });
    let req = l
        .get_request(Some(T))
        .expect("the real client was not served");
    assert_eq!(req.private_data(), b"real");
    let _c = req.accept(&b.qp, b"", 4, 4).expect("accept");
    h.join().unwrap().expect("connect");
    start.elapsed()
}

#[test]
fn listener_dos_half_open_flood_serves_real_client_without_threads() {
    let dev = device(false);
    // The backlog of the probe (8) and a handshake timeout far longer than
    // the test: only the separate handshake bound can let clients in.
    let l = Listener::bind(
        "127.0.0.1:0",
        8,
        ListenConfig {
            handshake_timeout: Duration::from_secs(600),
            ..ListenConfig::default()
        },
    )
    .unwrap();
    serve_one(&l, &dev); // warms up the reactor and the device threads
    let before = threads();

    // 200 half-open connections: 180 silent, 20 that sent the start of a
    // Request and stopped (slow drip).
    let mut request = Initiator::new(MpaConfig::default(), b"never finished").unwrap();
    let bytes = request.transmit().to_vec();
    request.consumed(bytes.len());
    let mut flood = Vec::new();
    for i in 0..200u32 {
        let mut s = TcpStream::connect(l.local_addr()).unwrap();
        if i.is_multiple_of(10) {
            s.write_all(&bytes[..10]).unwrap();
        }
        flood.push(s);
    }
    let deadline = Instant::now() + T;
    while l.handshakes_in_progress() < 200 {
        assert!(Instant::now() < deadline, "{}", l.handshakes_in_progress());
        thread::sleep(Duration::from_millis(5));
    }
    let during = settled_threads(before);
    assert!(
        during <= before,
        "threads grew with half-open connections: {before} -> {during}: {:?}",
        thread_names()
    );

    // Real clients are served while the flood holds on (more than the
    // backlog of them).
    for _ in 0..10 {
        let took = serve_one(&l, &dev);
        eprintln!("real client served in {took:?} under 200 half-open connections");
    }
    assert_eq!(l.handshakes_in_progress(), 200);
    let after = settled_threads(before);
    assert!(
        after <= before,
        "threads grew: {before} -> {after}: {:?}",
        thread_names()
    );
    drop(flood);
}
