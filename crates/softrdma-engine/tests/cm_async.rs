//! Async connect and accept (feature `tokio`): on a current-thread runtime
//! both sides of many connections progress together, which only works if
//! nothing blocks the runtime's one thread.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::time::Duration;

use common::*;
use softrdma_engine::cm::{CmError, CmEvent, ConnectConfig, ListenConfig, Listener, connect_async};

fn cfg(pd: &[u8]) -> ConnectConfig {
    ConnectConfig {
        private_data: pd.to_vec(),
        timeout: Duration::from_secs(10),
        ..ConnectConfig::default()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn async_connect_and_accept_on_one_thread() {
    let dev = device(false);
    let l = Listener::bind("127.0.0.1:0", 16, ListenConfig::default()).unwrap();
    let addr = l.local_addr();
    let clients: Vec<Side> = (0..8).map(|_| side(&dev, |_| {})).collect();
    let servers: Vec<Side> = (0..8).map(|_| side(&dev, |_| {})).collect();
    let connects = clients.iter().enumerate().map(|(i, s)| {
        let qp = s.qp.clone();
        async move { connect_async(&qp, addr, cfg(format!("c{i}").as_bytes())).await }
    });
    let accepts = async {
        let mut conns = Vec::new();
        for s in &servers {
            let req = l.next_request().await.unwrap();
            let pd = req.private_data().to_vec();
            let c = req.accept_async(&s.qp, &pd, 4, 4).await.unwrap();
            conns.push(c);
        }
        conns
    };
    let (client_conns, server_conns) = tokio::join!(futures_join_all(connects.collect()), accepts);
    for (i, c) in client_conns.into_iter().enumerate() {
        let c = c.expect("connect_async");
        assert!(c.peer_private_data().unwrap().starts_with(b"c"), "{i}");
    }
    assert_eq!(server_conns.len(), 8);
    // Disconnect events arrive on the async side too (the Established
    // event was the outcome of accept_async).
    server_conns[0].disconnect().unwrap();
    let ev = tokio::time::timeout(Duration::from_secs(10), server_conns[0].next_event())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(ev, CmEvent::Disconnected { .. }), "{ev:?}");
}

#[tokio::test(flavor = "current_thread")]
async fn async_connect_reports_reject_and_timeout() {
    let dev = device(false);
    let a = side(&dev, |_| {});
    let l = Listener::bind("127.0.0.1:0", 16, ListenConfig::default()).unwrap();
    let addr = l.local_addr();
    let qp = a.qp.clone();
    let rejecter = async {
        let req = l.next_request().await.unwrap();
        req.reject_nonblocking(b"no room").unwrap();
    };
    let (r, ()) = tokio::join!(connect_async(&qp, addr, cfg(b"")), rejecter);
    match r {
        Err(CmError::Rejected { private_data }) => assert_eq!(private_data, b"no room"),
        other => panic!("{other:?}"),
    }
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut c = cfg(b"");
    c.timeout = Duration::from_millis(100);
    let r = connect_async(&qp, silent.local_addr().unwrap(), c).await;
    assert!(matches!(r, Err(CmError::TimedOut)), "{r:?}");
}

/// Runs futures concurrently on the current task (a tiny `join_all`).
async fn futures_join_all<F: std::future::Future>(fs: Vec<F>) -> Vec<F::Output> {
    let mut set = Vec::new();
    for f in fs {
        set.push(Box::pin(f));
    }
    let mut out: Vec<Option<F::Output>> = set.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in set.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|o| o.unwrap()).collect()
}
