//! Read zero copy (SrcAvail → the reader's RDMA Read → RdmaRdCompl) on
//! loopback: byte-exact transfers around the threshold both ways, the
//! fallbacks to buffered copy (a peer that does not offer it, small and
//! non-blocking reads, a write timeout that withdraws the offer).

mod common;

use std::io::{Read, Write};
use std::net::Shutdown;
use std::thread;
use std::time::Duration;

use common::pair;
use rand::{Rng, RngCore, SeedableRng};
use softrdma_sockets::{Config, Mode, TcpStream, Transport};

const THRESHOLD: usize = 64 * 1024;

fn cfg(threshold: usize) -> Config {
    let mut c = Config::with_mode(Mode::Offload);
    c.zcopy_threshold = threshold;
    c
}

fn zero_copy(s: &TcpStream) -> bool {
    matches!(
        s.transport(),
        Transport::Offloaded {
            zero_copy: true,
            ..
        }
    )
}

fn random_bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Writes of random sizes around the threshold (and a few large ones)
/// from `w`, read by `r` into buffers of random sizes, most of them large
/// enough for an RDMA Read; returns what was read.
fn transfer(mut w: TcpStream, mut r: TcpStream, seed: u64) -> (TcpStream, TcpStream) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut sizes = Vec::new();
    for _ in 0..60 {
        sizes.push(match rng.random_range(0..10) {
            0 => rng.random_range(1..3000),
            1 => rng.random_range(300_000..1_500_000),
            _ => rng.random_range(THRESHOLD - 3000..THRESHOLD + 3000),
        });
    }
    let total: usize = sizes.iter().sum();
    let data = random_bytes(seed, total);
    let d = data.clone();
    let writer = thread::spawn(move || {
        let mut off = 0;
        for n in sizes {
            w.write_all(&d[off..off + n]).unwrap();
            off += n;
        }
        w.shutdown(Shutdown::Write).unwrap();
        w
    });
    let mut got = Vec::with_capacity(total);
    let mut buf = vec![0u8; 2_000_000];
    loop {
        let n = match rng.random_range(0..8) {
            0 => rng.random_range(1..20_000),
            _ => rng.random_range(20_000..buf.len()),
        };
        match r.read(&mut buf[..n]).unwrap() {
            0 => break,
            k => got.extend_from_slice(&buf[..k]),
        }
    }
    let w = writer.join().unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data, "bytes differ");
    (w, r)
}

#[test]
fn zero_copy_random_sizes_around_threshold_both_ways() {
    let c = cfg(THRESHOLD);
    let (a, b) = pair(&c, &c);
    assert!(zero_copy(&a) && zero_copy(&b), "{}", a.transport());
    let before = softrdma_sockets::zero_copy_octets();
    let (a, b) = transfer(a, b, 1);
    let mid = softrdma_sockets::zero_copy_octets();
    assert!(mid > before, "no octet went by zero copy");
    let (_b, _a) = transfer(b, a, 2);
    assert!(softrdma_sockets::zero_copy_octets() > mid);
}

/// A peer that does not offer zero copy (threshold 0) gets buffered copy,
/// whichever side it is.
#[test]
fn without_the_capability_buffered_copy() {
    for (server, client) in [(cfg(0), cfg(THRESHOLD)), (cfg(THRESHOLD), cfg(0))] {
        let (a, b) = pair(&server, &client);
        assert!(a.transport().is_offloaded());
        assert!(!zero_copy(&a) && !zero_copy(&b), "{}", a.transport());
        let (a, b) = transfer(a, b, 3);
        transfer(b, a, 4);
    }
}

/// Peeks, non-blocking reads and small buffers ask for buffered copy
/// (SendSm); the octets are the same.
#[test]
fn peek_nonblocking_and_small_reads_fall_back() {
    let c = cfg(THRESHOLD);
    let (mut a, mut b) = pair(&c, &c);
    let data = random_bytes(5, 300_000);
    let d = data.clone();
    let before = softrdma_sockets::zero_copy_fallbacks();
    let w = thread::spawn(move || {
        a.write_all(&d).unwrap();
        a.write_all(&d).unwrap();
        a.write_all(&d).unwrap();
        a
    });
    let mut got = Vec::new();
    // A peek first.
    let mut p = [0u8; 100];
    let n = b.peek(&mut p).unwrap();
    assert!(n > 0);
    assert_eq!(&p[..n], &data[..n]);
    // Small reads for the first write.
    let mut small = [0u8; 1000];
    while got.len() < data.len() {
        let n = b.read(&mut small).unwrap();
        got.extend_from_slice(&small[..n]);
    }
    // Non-blocking reads for the second.
    b.set_nonblocking(true).unwrap();
    let mut big = vec![0u8; 400_000];
    while got.len() < 2 * data.len() {
        let want = 2 * data.len() - got.len();
        match b.read(&mut big[..want]) {
            Ok(n) => got.extend_from_slice(&big[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_micros(200))
            }
            Err(e) => panic!("{e}"),
        }
    }
    b.set_nonblocking(false).unwrap();
    // Large blocking reads for the third.
    while got.len() < 3 * data.len() {
        let n = b.read(&mut big).unwrap();
        got.extend_from_slice(&big[..n]);
    }
    w.join().unwrap();
    for k in 0..3 {
        assert!(
            got[k * data.len()..(k + 1) * data.len()] == data[..],
            "copy {k}"
        );
    }
    assert!(softrdma_sockets::zero_copy_fallbacks() > before);
}

/// A write timeout withdraws an offer the reader did not take
/// (SrcAvailCancel); the reader's side acknowledges it without a call of
/// its application (its readiness descriptor keeps events coming) and the
/// write copies instead: it returns fewer octets than offered, all of
/// which arrive.
#[test]
fn write_timeout_withdraws_offer_then_buffered() {
    let mut c = cfg(THRESHOLD);
    c.zcopy_timeout = Duration::from_secs(30);
    let (mut a, b) = pair(&c, &c);
    b.readiness_fd().unwrap();
    a.set_write_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let data = random_bytes(6, 2 << 20);
    let n = a.write(&data).unwrap();
    assert!(n > 0 && n < data.len(), "wrote {n}");
    let reader = thread::spawn(move || {
        let mut b = b;
        let mut got = Vec::new();
        b.read_to_end(&mut got).unwrap();
        got
    });
    a.set_write_timeout(None).unwrap();
    a.write_all(&data[n..]).unwrap();
    a.shutdown(Shutdown::Write).unwrap();
    let got = reader.join().unwrap();
    assert!(got == data, "bytes differ");
}

extern "C" fn on_sigusr1(_: libc::c_int) {}

/// A signal handled while a zero-copy write waits for the reader (which
/// does not read) withdraws the offer: the reader's side acknowledges
/// (SendSm) and the write returns `Interrupted` (`EINTR`: nothing was
/// read). The application writes the same octets again and every octet
/// arrives exactly once. Without the cancel on a signal the write would
/// go on waiting for the reader (the zero-copy timeout is 60 s here), then
/// copy and return a count.
#[test]
fn signal_withdraws_a_pending_offer_with_eintr() {
    // A handler without SA_RESTART: the kernel would interrupt a blocked
    // write with EINTR.
    // SAFETY: installs a handler that does nothing (async-signal-safe) for
    // SIGUSR1, which nothing else in this test binary uses.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigusr1 as *const () as libc::sighandler_t;
        libc::sigemptyset(&raw mut sa.sa_mask);
        sa.sa_flags = 0;
        assert_eq!(
            libc::sigaction(libc::SIGUSR1, &raw const sa, std::ptr::null_mut()),
            0
        );
    }
    let mut c = cfg(THRESHOLD);
    c.zcopy_timeout = Duration::from_secs(60);
    let (mut a, b) = pair(&c, &c);
    assert!(zero_copy(&a));
    // Events for the reader's side without a read call (it answers the
    // cancel from the completion callback).
    b.readiness_fd().unwrap();
    let data = random_bytes(7, 1 << 20);
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let (res_tx, res_rx) = std::sync::mpsc::channel();
    let d = data.clone();
    let writer = thread::spawn(move || {
        // SAFETY: the calling thread's own id.
        tid_tx.send(unsafe { libc::pthread_self() }).unwrap();
        let first = a.write(&d).map_err(|e| e.kind());
        res_tx.send(first).unwrap();
        a.write_all(&d).unwrap();
        a.shutdown(Shutdown::Write).unwrap();
        a
    });
    let tid = tid_rx.recv().unwrap();
    // Signal the writer until its write returns (a signal that comes while
    // it is not asleep in the wait is handled without interrupting it).
    let first = loop {
        match res_rx.recv_timeout(Duration::from_millis(20)) {
            Ok(r) => break r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // SAFETY: the writer thread is alive until it sent its
                // result (it is joined below).
                unsafe { libc::pthread_kill(tid, libc::SIGUSR1) };
            }
            Err(e) => panic!("writer gone: {e}"),
        }
    };
    assert_eq!(first, Err(std::io::ErrorKind::Interrupted));
    let mut b = b;
    let mut got = Vec::new();
    b.read_to_end(&mut got).unwrap();
    let a = writer.join().unwrap();
    assert_eq!(got.len(), data.len(), "octets received");
    assert!(got == data, "bytes differ");
    drop(a);
}
