//! The async (tokio) stream and listener: offloaded and plain clients of
//! one async listener, byte-exact echo both ways, half-close.
#![cfg(feature = "tokio")]

use std::time::Duration;

use softrdma_sockets::tokio::{TcpListener, TcpStream};
use softrdma_sockets::{Config, Mode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn data(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(seed) ^ (i >> 5)) as u8)
        .collect()
}

async fn echo(mut s: TcpStream) {
    let mut buf = vec![0u8; 50_000];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        s.write_all(&buf[..n]).await.unwrap();
    }
    s.shutdown().await.unwrap();
}

async fn client(addr: std::net::SocketAddr, mode: Mode, seed: u32) -> bool {
    let s = TcpStream::connect_with(addr, &Config::with_mode(mode))
        .await
        .unwrap();
    let offloaded = s.transport().is_offloaded();
    let (mut r, mut w) = tokio::io::split(s);
    let sent = data(1_500_000, seed);
    let to_send = sent.clone();
    let writer = tokio::spawn(async move {
        for ch in to_send.chunks(7_777) {
            w.write_all(ch).await.unwrap();
        }
        w.flush().await.unwrap();
        w.shutdown().await.unwrap();
    });
    let mut got = Vec::new();
    r.read_to_end(&mut got).await.unwrap();
    writer.await.unwrap();
    assert!(
        got == sent,
        "echo differs ({} of {} octets)",
        got.len(),
        sent.len()
    );
    offloaded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_echo_offloaded_and_plain_on_one_listener() {
    let l = TcpListener::bind_with("127.0.0.1:0".parse().unwrap(), &Config::default())
        .await
        .unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(async move {
        let mut kinds = Vec::new();
        for _ in 0..3 {
            let (s, _) = l.accept().await.unwrap();
            kinds.push(s.transport().is_offloaded());
            tokio::spawn(echo(s));
        }
        kinds
    });
    let run = async {
        let a = client(addr, Mode::Offload, 3).await;
        let b = client(addr, Mode::Tcp, 5).await;
        let c = client(addr, Mode::Auto, 7).await;
        (a, b, c)
    };
    let (a, b, c) = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("async echo stalled");
    assert!(a && !b && c);
    assert_eq!(server.await.unwrap(), vec![true, false, true]);
}
