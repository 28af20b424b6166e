//! Many sequential connections leave no thread and no descriptor behind.
//! Alone in its test binary so that the counts are the process's own.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::thread;
use std::time::Duration;

use common::*;
use softrdma_engine::cm::{CmEvent, ConnectConfig, ListenConfig, Listener, connect};

const T: Duration = Duration::from_secs(20);

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn one(l: &Listener, dev: &softrdma_engine::Device, n: usize) {
    let a = side(dev, |_| {});
    let b = side(dev, |_| {});
    let addr = l.local_addr();
    let pd = format!("conn {n}").into_bytes();
    let client = if n.is_multiple_of(2) {
        // Blocking connect from another thread, blocking accept.
        let qp = a.qp.clone();
        let cfg = ConnectConfig {
            private_data: pd.clone(),
            timeout: T,
            ..ConnectConfig::default()
        };
        let h = thread::spawn(move || connect(&qp, addr, &cfg));
        let req = l.get_request(Some(T)).expect("request");
        assert_eq!(req.private_data(), pd);
        let server = req.accept(&b.qp, b"", 4, 4).expect("accept");
        let client = h.join().unwrap().expect("connect");
        drop(server);
        client
    } else {
        // Non-blocking on both sides, from this one thread.
        let cfg = ConnectConfig {
            private_data: pd.clone(),
            timeout: T,
            ..ConnectConfig::default()
        };
        let client = softrdma_engine::cm::Connection::start(&a.qp, addr, cfg).unwrap();
        let req = l.get_request(Some(T)).expect("request");
        let server = req.accept_nonblocking(&b.qp, b"", 4, 4).expect("accept");
        assert!(matches!(
            server.wait_event(Some(T)),
            Some(CmEvent::Established { .. })
        ));
        assert!(matches!(
            client.wait_event(Some(T)),
            Some(CmEvent::Established { .. })
        ));
        client
    };
    client.disconnect().unwrap();
    // Both QPs are dropped here (closing the connection).
}

#[test]
fn many_sequential_connections_leave_threads_and_fds_flat() {
    let dev = device(false);
    let l = Listener::bind("127.0.0.1:0", 16, ListenConfig::default()).unwrap();
    for n in 0..10 {
        one(&l, &dev, n);
    }
    thread::sleep(Duration::from_millis(200));
    let (t0, f0) = (threads(), fds());
    for n in 0..500 {
        one(&l, &dev, n);
    }
    // Closing connections finish in the background (FIN exchange).
    let t1 = settled_threads(t0);
    let mut f1 = fds();
    for _ in 0..100 {
        if f1 <= f0 + 4 {
            break;
        }
        thread::sleep(Duration::from_millis(50));
        f1 = fds();
    }
    eprintln!("after 500 connections: threads {t0} -> {t1}, fds {f0} -> {f1}");
    assert!(t1 <= t0, "threads grew: {t0} -> {t1}: {:?}", thread_names());
    assert!(f1 <= f0 + 4, "descriptors leaked: {f0} -> {f1}");
}
