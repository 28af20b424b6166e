//! Data an offloaded stream holds when its process calls `exit` without
//! closing or flushing it: held by `TCP_CORK`, by Nagle (a send in
//! flight), or waiting for the peer's credits. The kernel's TCP sends such
//! data at the implicit close; so does sockets direct's exit flush.
//!
//! Each test runs a child process (this test binary again, running one of
//! the `*_child` tests, which do nothing when run alone) that connects to
//! the test's listener, writes, and calls `std::process::exit` with the
//! stream still open.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsFd;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

/// Where the child connects (set by the parent).
const ADDR_ENV: &str = "SD_EXIT_FLUSH_ADDR";
/// The exit flush's bound (read by the library at the exit).
const LIMIT_ENV: &str = "SOFTRDMA_SOCKETS_EXIT_FLUSH_MS";

fn offload() -> Config {
    Config::with_mode(Mode::Offload)
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9)) as u8
}

fn patterned(from: usize, len: usize) -> Vec<u8> {
    (from..from + len).map(pattern).collect()
}

/// Runs the child test `name` against `addr`, with the exit flush bounded
/// by `limit_ms` (generous unless the test is about the bound). Its
/// standard output is piped (the child says when it is about to exit).
/// `timeout` only guards against a hang.
fn spawn_child(name: &str, addr: std::net::SocketAddr, limit_ms: u64) -> Child {
    Command::new("timeout")
        .arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--include-ignored", "--nocapture", "-q"])
        .env(ADDR_ENV, addr.to_string())
        .env(LIMIT_ENV, limit_ms.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Where the child makes its second connection, if the test wants one.
const ADDR2_ENV: &str = "SD_EXIT_FLUSH_ADDR2";
/// Where the child makes its third connection, if the test wants one.
const ADDR3_ENV: &str = "SD_EXIT_FLUSH_ADDR3";

/// As [`spawn_child`], with the child's connections made to `addrs` (in
/// the order of `ADDR_ENV`, `ADDR2_ENV`, `ADDR3_ENV`) and its standard
/// error piped too (read with [`ended`]).
fn spawn_child_at(name: &str, addrs: &[std::net::SocketAddr], limit_ms: u64) -> Child {
    let mut cmd = Command::new("timeout");
    cmd.arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--include-ignored", "--nocapture", "-q"])
        .env(LIMIT_ENV, limit_ms.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (env, addr) in [ADDR_ENV, ADDR2_ENV, ADDR3_ENV].iter().zip(addrs) {
        cmd.env(env, addr.to_string());
    }
    cmd.spawn().unwrap()
}

/// In the parent: waits for the child; its exit status must be success
/// and its standard error (piped) free of panics. Returns that output.
fn ended(mut child: Child) -> String {
    let status = child.wait().unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(status.success(), "child: {status}\nstderr: {err}");
    assert!(!err.contains("panicked"), "child stderr: {err}");
    err
}

/// In the child: the connected stream, or `None` when run alone.
fn child_stream() -> Option<TcpStream> {
    let addr = std::env::var(ADDR_ENV).ok()?;
    let s = TcpStream::connect_with(&addr, &offload()).unwrap();
    assert!(s.transport().is_offloaded(), "{}", s.transport());
    Some(s)
}

/// In the child: writes until the peer's credits and the staging buffers
/// are used up (the peer does not read yet); returns how much.
fn write_until_out_of_credits(s: &mut TcpStream) -> usize {
    s.set_nonblocking(true).unwrap();
    let chunk = 16 * 1024;
    let mut at = 0;
    loop {
        match s.write(&patterned(at, chunk)) {
            Ok(n) => at += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    s.set_nonblocking(false).unwrap();
    at
}

/// In the child: small writes of `lens` octets on a corked stream;
/// returns how much.
fn write_corked(s: &mut TcpStream, lens: &[usize]) -> usize {
    s.set_nodelay(true).unwrap();
    s.set_cork(true).unwrap();
    let mut at = 0;
    for &len in lens {
        s.write_all(&patterned(at, len)).unwrap();
        at += len;
    }
    at
}

/// In the child: tells the parent how many octets it wrote, then exits
/// without closing the stream (`exit(3)`: the exit handlers run).
fn exit_now(s: TcpStream, wrote: usize) -> ! {
    println!("wrote {wrote}");
    std::io::stdout().flush().unwrap();
    // Not dropped: `exit` runs no destructor of this thread's values.
    let _kept = s;
    std::process::exit(0);
}

/// In the parent: the child's "wrote N" line.
fn wrote(child: &mut Child) -> usize {
    wrote_each(child)[0]
}

/// In the parent: the child's "wrote N M ..." line (one count a stream).
fn wrote_each(child: &mut Child) -> Vec<usize> {
    let mut out = BufReader::new(child.stdout.as_mut().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the child ended without saying what it wrote");
        if let Some(v) = line.trim().strip_prefix("wrote ") {
            return v.split(' ').map(|n| n.parse().unwrap()).collect();
        }
    }
}

/// In the parent: reads to EOF in `piece`-octet reads, sleeping `pause`
/// between them (a slow reader); every octet must come, then EOF.
fn read_all(s: &mut TcpStream, piece: usize, pause: Duration) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut got = Vec::new();
    let mut buf = vec![0u8; piece];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return got,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => panic!("after {} octets: {e}", got.len()),
        }
        if !pause.is_zero() {
            std::thread::sleep(pause);
        }
    }
}

/// In the parent: runs the child test `name` against `l` (exit flush
/// bounded generously) and checks that every octet it wrote arrives, in
/// order, then EOF, read in `piece`-octet reads `pause` apart, starting
/// `start` after the child said it is exiting.
fn child_writes_arrive(
    l: &TcpListener,
    name: &str,
    start: Duration,
    piece: usize,
    pause: Duration,
) {
    let mut child = spawn_child(name, l.local_addr().unwrap(), 60_000);
    let (mut s, _) = l.accept().unwrap();
    assert!(s.transport().is_offloaded());
    let n = wrote(&mut child);
    assert!(n > 0);
    std::thread::sleep(start);
    let got = read_all(&mut s, piece, pause);
    assert!(
        got == patterned(0, n),
        "{name}: {} of {n} octets",
        got.len()
    );
    drop(s);
    exited_ok(child);
}

/// In the parent: runs the child test `name` against a listener here
/// (exit flush bounded by `limit_ms`), lets `first` use the accepted
/// stream, and returns the error its first read gets once the child
/// exits: none of the child's octets arrive.
fn child_writes_lost(
    name: &str,
    limit_ms: u64,
    first: impl FnOnce(&mut TcpStream),
) -> std::io::Error {
    let (l, addr) = listener();
    let mut child = spawn_child(name, addr, limit_ms);
    let (mut s, _) = l.accept().unwrap();
    first(&mut s);
    assert!(wrote(&mut child) > 0);
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut buf = [0u8; 8192];
    let r = s.read(&mut buf);
    exited_ok(child);
    match r {
        Ok(n) => panic!("read {n} octets"),
        Err(e) => e,
    }
}

/// In the parent: reads the corked stream to its end, then the stuck one
/// (whose peer reads only after that), and checks that each carries
/// exactly what the child said it wrote to it ([`wrote_each`]: the stuck
/// stream's count first).
fn corked_then_stuck_complete(child: &mut Child, mut stuck: TcpStream, mut corked: TcpStream) {
    let n = wrote_each(child);
    let (n_stuck, n_corked) = (n[0], n[1]);
    let got = read_all(&mut corked, 64 * 1024, Duration::ZERO);
    assert!(got == patterned(0, n_corked), "{} of {n_corked}", got.len());
    drop(corked);
    let got = read_all(&mut stuck, 64 * 1024, Duration::ZERO);
    assert!(got == patterned(0, n_stuck), "{} of {n_stuck}", got.len());
    drop(stuck);
}

fn exited_ok(mut child: Child) {
    let status = child.wait().unwrap();
    assert!(status.success(), "child: {status}");
}

fn listener() -> (TcpListener, std::net::SocketAddr) {
    let l = TcpListener::bind_with("127.0.0.1:0", &offload()).unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr)
}

/// Child of `corked_data_is_sent_when_the_process_exits_without_closing`.
#[test]
#[ignore = "child process of corked_data_is_sent_when_the_process_exits_without_closing"]
fn corked_child() {
    let Some(mut s) = child_stream() else { return };
    let n = write_corked(&mut s, &[17, 300, 1, 4000, 90]);
    exit_now(s, n);
}

/// Regression: small writes held by `TCP_CORK` (for up to 200 ms) were
/// lost when the process exited without closing the stream, and the peer
/// got a reset instead of EOF; the kernel's TCP sends a corked socket's
/// data at the implicit close.
#[test]
fn corked_data_is_sent_when_the_process_exits_without_closing() {
    let (l, _) = listener();
    child_writes_arrive(
        &l,
        "corked_child",
        Duration::ZERO,
        64 * 1024,
        Duration::ZERO,
    );
}

/// Child of `data_waiting_for_credits_is_sent_when_the_process_exits`:
/// writes until the peer's credits and the staging buffers are used up.
#[test]
#[ignore = "child process of data_waiting_for_credits_is_sent_when_the_process_exits"]
fn credits_child() {
    let Some(mut s) = child_stream() else { return };
    let n = write_until_out_of_credits(&mut s);
    exit_now(s, n);
}

/// Regression: data queued beyond the peer's credits (the peer had not
/// read yet) was lost when the writer's process exited without closing:
/// the exit now waits (bounded) for the credits of a peer that reads,
/// here slowly, starting once the writer is exiting.
#[test]
fn data_waiting_for_credits_is_sent_when_the_process_exits() {
    let (l, _) = listener();
    // Nothing is read before the child has written all it could (its
    // writes ran out of credits) and is exiting.
    child_writes_arrive(
        &l,
        "credits_child",
        Duration::from_millis(50),
        24 * 1024,
        Duration::from_millis(1),
    );
}

/// Child of `a_write_held_by_nagle_is_sent_when_the_process_exits`.
#[test]
#[ignore = "child process of a_write_held_by_nagle_is_sent_when_the_process_exits"]
fn nagle_child() {
    let Some(mut s) = child_stream() else { return };
    // A small send buffer, and a peer that does not read yet: the first
    // message stays in flight, and the next small write is held (Nagle,
    // no TCP_NODELAY) until it completes.
    socket2::SockRef::from(&s.as_fd())
        .set_send_buffer_size(4096)
        .unwrap();
    let big = 60 * 1024;
    s.write_all(&patterned(0, big)).unwrap();
    let mut at = big;
    for len in [10, 200, 33] {
        s.write_all(&patterned(at, len)).unwrap();
        at += len;
    }
    exit_now(s, at);
}

/// Regression: a small write held by Nagle (no `TCP_NODELAY`, a send in
/// flight) was lost when the process exited without closing; the kernel
/// sends what Nagle held back at the implicit close.
#[test]
fn a_write_held_by_nagle_is_sent_when_the_process_exits() {
    // A small receive buffer at the peer (set on the listener, inherited
    // by the accepted connection), so that the child's sends stay in
    // flight until it reads.
    let (l, _) = listener();
    socket2::SockRef::from(&l.as_fd())
        .set_recv_buffer_size(4096)
        .unwrap();
    child_writes_arrive(
        &l,
        "nagle_child",
        Duration::from_millis(20),
        8 * 1024,
        Duration::ZERO,
    );
}

/// Child of `exit_is_not_held_up_by_a_peer_that_does_not_read`.
#[test]
#[ignore = "child process of exit_is_not_held_up_by_a_peer_that_does_not_read"]
fn stuck_child() {
    credits_child();
}

/// The exit flush is bounded: a peer that never reads (its credits never
/// come back) does not keep the writer's process from exiting. The
/// flush does wait for it, up to its bound (it had data to send): the
/// child ends no sooner than the bound after saying it exits, and well
/// before the hang guard (`timeout`, 120 s).
#[test]
fn exit_is_not_held_up_by_a_peer_that_does_not_read() {
    const LIMIT_MS: u64 = 1500;
    let (l, addr) = listener();
    let mut child = spawn_child("stuck_child", addr, LIMIT_MS);
    let (s, _) = l.accept().unwrap();
    assert!(s.transport().is_offloaded());
    assert!(wrote(&mut child) > 0);
    let exiting = std::time::Instant::now();
    exited_ok(child);
    let took = exiting.elapsed();
    // Measured from after the child said it exits: the flush started
    // later, and ends at its bound at the earliest (nothing is read).
    assert!(
        took >= Duration::from_millis(LIMIT_MS),
        "the exit did not wait for the flush: {took:?}"
    );
    assert!(took < Duration::from_secs(60), "{took:?}");
    drop(s);
}

/// Child of `exit_flush_off_leaves_held_data_unsent`.
#[test]
#[ignore = "child process of exit_flush_off_leaves_held_data_unsent"]
fn off_child() {
    corked_child();
}

/// `SOFTRDMA_SOCKETS_EXIT_FLUSH_MS=0` turns the exit flush off: the
/// corked octets are not sent and the peer sees the connection end
/// without EOF; the same child with the flush on sends them.
#[test]
fn exit_flush_off_leaves_held_data_unsent() {
    child_writes_lost("off_child", 0, |_| {});
    let (l, _) = listener();
    child_writes_arrive(&l, "off_child", Duration::ZERO, 64 * 1024, Duration::ZERO);
}

/// The stream an application's own exit handler uncorks, reached through
/// a static (the exiting thread's thread-locals are destroyed before the
/// exit handlers run): as the preload's autocork handler reaches its
/// holds, through its flusher's process-wide list.
static UNCORK_AT_EXIT: std::sync::OnceLock<TcpStream> = std::sync::OnceLock::new();

extern "C" fn uncork_at_exit() {
    if let Some(s) = UNCORK_AT_EXIT.get() {
        let _ = s.set_cork(false);
    }
}

/// A corked stream whose cork another exit handler takes out, registered
/// before the library's (`first`: runs after it) or after it (runs
/// before it).
fn uncork_child(first: bool) {
    if std::env::var(ADDR_ENV).is_err() {
        return;
    }
    if first {
        assert!(softrdma_engine::at_exit(uncork_at_exit));
    }
    let s = child_stream().unwrap();
    if !first {
        // After the first offloaded connection: after the library's.
        assert!(softrdma_engine::at_exit(uncork_at_exit));
    }
    s.set_cork(true).unwrap();
    let mut at = 0;
    for len in [5, 700, 64] {
        (&s).write_all(&patterned(at, len)).unwrap();
        at += len;
    }
    UNCORK_AT_EXIT.set(s.try_clone().unwrap()).unwrap();
    exit_now(s, at);
}

#[test]
#[ignore = "child process of corked_data_is_sent_whatever_the_order_of_exit_handlers"]
fn uncork_after_child() {
    uncork_child(true);
}

#[test]
#[ignore = "child process of corked_data_is_sent_whatever_the_order_of_exit_handlers"]
fn uncork_before_child() {
    uncork_child(false);
}

/// Another exit handler that takes the cork out (the preload's autocork
/// handler does) runs before or after the library's exit flush: either
/// way every octet goes, in order, then EOF.
#[test]
fn corked_data_is_sent_whatever_the_order_of_exit_handlers() {
    for name in ["uncork_after_child", "uncork_before_child"] {
        let (l, _) = listener();
        child_writes_arrive(&l, name, Duration::ZERO, 64 * 1024, Duration::ZERO);
    }
}

/// Child of `a_stream_whose_peer_does_not_read_does_not_hold_up_the_others`.
#[test]
#[ignore = "child process of a_stream_whose_peer_does_not_read_does_not_hold_up_the_others"]
fn two_streams_child() {
    let Some(mut stuck) = child_stream() else {
        return;
    };
    let n_stuck = write_until_out_of_credits(&mut stuck);
    let (corked, n_corked) = corked_at(ADDR2_ENV);
    assert!(corked.transport().is_offloaded());
    exit_keeping(n_stuck, n_corked, (stuck, corked));
}

/// A stream to the address in the environment variable `env`, with
/// corked writes of 100, 2000 and 7 octets held, and how many it wrote.
fn corked_at(env: &str) -> (TcpStream, usize) {
    let addr = std::env::var(env).unwrap();
    let mut corked = TcpStream::connect_with(&addr, &offload()).unwrap();
    let n = write_corked(&mut corked, &[100, 2000, 7]);
    (corked, n)
}

/// Prints what a child wrote and exits with `kept` alive: `exit` runs no
/// destructor of this thread's values, so no stream is dropped.
fn exit_keeping(n_stuck: usize, n_corked: usize, kept: impl Sized) -> ! {
    println!("wrote {n_stuck} {n_corked}");
    std::io::stdout().flush().unwrap();
    let _kept = kept;
    std::process::exit(0);
}

/// The exit flush serves the process's streams in turn: one whose peer
/// does not read (yet) does not keep the others' held data from going.
/// Here the first stream's peer reads only after it has read the second
/// to EOF: flushed one after the other, in either order, the two would
/// wait for each other until the bound (60 s here).
#[test]
fn a_stream_whose_peer_does_not_read_does_not_hold_up_the_others() {
    let (l1, addr1) = listener();
    let (l2, addr2) = listener();
    let mut child = Command::new("timeout")
        .arg("120")
        .arg(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "two_streams_child",
            "--include-ignored",
            "--nocapture",
            "-q",
        ])
        .env(ADDR_ENV, addr1.to_string())
        .env(ADDR2_ENV, addr2.to_string())
        .env(LIMIT_ENV, "60000")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (stuck, _) = l1.accept().unwrap();
    let (corked, _) = l2.accept().unwrap();
    corked_then_stuck_complete(&mut child, stuck, corked);
    exited_ok(child);
}

/// Child of `held_data_is_discarded_at_exit_with_so_linger_zero`: a
/// corked stream with `SO_LINGER` zero, and a corked one without.
#[test]
#[ignore = "child process of held_data_is_discarded_at_exit_with_so_linger_zero"]
fn linger_zero_child() {
    let Some(mut s) = child_stream() else { return };
    socket2::SockRef::from(&s.as_fd())
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    let n = write_corked(&mut s, &[50, 60]);
    let addr2 = std::env::var(ADDR2_ENV).unwrap();
    let mut plain = TcpStream::connect_with(&addr2, &offload()).unwrap();
    let m = write_corked(&mut plain, &[70, 80]);
    println!("wrote {n} {m}");
    std::io::stdout().flush().unwrap();
    let _kept = (s, plain);
    std::process::exit(0);
}

/// As the kernel's implicit close of a socket with `SO_LINGER` on and a
/// zero time (an abortive close): the held data is not sent, the
/// connection is reset; the same process's other stream, without it, is
/// flushed.
#[test]
fn held_data_is_discarded_at_exit_with_so_linger_zero() {
    let (l1, addr1) = listener();
    let (l2, addr2) = listener();
    let mut child = spawn_child_at("linger_zero_child", &[addr1, addr2], 60_000);
    let (mut lingering, _) = l1.accept().unwrap();
    let (mut plain, _) = l2.accept().unwrap();
    let n = wrote_each(&mut child);
    let got = read_all(&mut plain, 64 * 1024, Duration::ZERO);
    assert!(got == patterned(0, n[1]), "{} of {}", got.len(), n[1]);
    drop(plain);
    lingering
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut buf = [0u8; 256];
    let r = lingering.read(&mut buf);
    ended(child);
    assert!(r.is_err(), "read {r:?}");
}

/// Child of `a_stream_with_unread_data_is_reset_at_exit`.
#[test]
#[ignore = "child process of a_stream_with_unread_data_is_reset_at_exit"]
fn unread_child() {
    let Some(mut s) = child_stream() else { return };
    // The peer's octets are here (peeked: still unread).
    let mut b = [0u8; 4];
    let mut seen = 0;
    while seen < 4 {
        seen = s.peek(&mut b).unwrap();
    }
    let n = write_corked(&mut s, &[40]);
    exit_now(s, n);
}

/// As a close with unread data, and as the kernel's close of a socket
/// with unread data: the process that exits without reading what its
/// peer sent resets the connection (its held data is not sent).
#[test]
fn a_stream_with_unread_data_is_reset_at_exit() {
    let e = child_writes_lost("unread_child", 60_000, |s| s.write_all(b"ping").unwrap());
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
    // The exit flush's reset, not the link lost at the exit.
    assert!(e.to_string().contains("AbortConn"), "{e}");
}

/// Child of `exit_after_a_close_in_the_same_thread_flushes_every_stream`:
/// closes a stream first (its close waits for the peer's FIN in the CQ:
/// the thread's CQ sleep set is made), then exits with a stream out of
/// credits and a corked one.
#[test]
#[ignore = "child process of exit_after_a_close_in_the_same_thread_flushes_every_stream"]
fn closed_first_child() {
    let Some(first) = child_stream() else { return };
    (&first).write_all(b"first").unwrap();
    drop(first);
    let addr2 = std::env::var(ADDR2_ENV).unwrap();
    let mut stuck = TcpStream::connect_with(&addr2, &offload()).unwrap();
    let n_stuck = write_until_out_of_credits(&mut stuck);
    let (corked, n_corked) = corked_at(ADDR3_ENV);
    exit_keeping(n_stuck, n_corked, (stuck, corked));
}

/// Regression: glibc's `exit` destroys the exiting thread's locals
/// before the exit handlers run; a thread that had slept in a CQ wait
/// before (a close) panicked in the exit flush's wait ("cannot access a
/// Thread Local Storage value during or after destruction"): the flush
/// was abandoned (data lost) and the panic printed on stderr.
#[test]
fn exit_after_a_close_in_the_same_thread_flushes_every_stream() {
    let (l1, addr1) = listener();
    let (l2, addr2) = listener();
    let (l3, addr3) = listener();
    let mut child = spawn_child_at("closed_first_child", &[addr1, addr2, addr3], 60_000);
    let (mut first, _) = l1.accept().unwrap();
    assert_eq!(read_all(&mut first, 64, Duration::ZERO), b"first");
    drop(first);
    let (stuck, _) = l2.accept().unwrap();
    let (corked, _) = l3.accept().unwrap();
    corked_then_stuck_complete(&mut child, stuck, corked);
    let err = ended(child);
    assert!(!err.contains("Thread Local"), "child stderr: {err}");
}

/// Child of `another_threads_write_during_the_exit_flush_does_not_fail`:
/// a thread writes to its stream all along (one octet at a time) while
/// the main thread exits with a corked stream.
#[test]
#[ignore = "child process of another_threads_write_during_the_exit_flush_does_not_fail"]
fn writer_thread_child() {
    let Some(mut corked) = child_stream() else {
        return;
    };
    let addr2 = std::env::var(ADDR2_ENV).unwrap();
    let busy = TcpStream::connect_with(&addr2, &offload()).unwrap();
    busy.set_nodelay(true).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut first = Some(tx);
        loop {
            if let Err(e) = (&busy).write(b"x") {
                eprintln!("WRITER ERROR: {e}");
                return;
            }
            if let Some(tx) = first.take() {
                tx.send(()).unwrap();
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    });
    rx.recv().unwrap();
    let n = write_corked(&mut corked, &[30, 40]);
    exit_now(corked, n);
}

/// Regression: a write of another thread while the exit flush ran
/// failed with `EPIPE` (the flush wants the DisConn), which raises
/// `SIGPIPE` under the preload and kills the exiting process. The
/// kernel's TCP takes such writes until the process ends: they are now
/// sent before the DisConn, or wait for the process to end.
#[test]
fn another_threads_write_during_the_exit_flush_does_not_fail() {
    let (l1, addr1) = listener();
    let (l2, addr2) = listener();
    let mut child = spawn_child_at("writer_thread_child", &[addr1, addr2], 60_000);
    let (mut corked, _) = l1.accept().unwrap();
    let (mut busy, _) = l2.accept().unwrap();
    let n = wrote(&mut child);
    let got = read_all(&mut corked, 64 * 1024, Duration::ZERO);
    assert!(got == patterned(0, n), "{} of {n}", got.len());
    // The flush waits for this end's FIN (the corked stream had data):
    // the writer writes meanwhile.
    std::thread::sleep(Duration::from_millis(200));
    drop(corked);
    let got = read_all(&mut busy, 64 * 1024, Duration::ZERO);
    assert!(!got.is_empty() && got.iter().all(|&b| b == b'x'));
    drop(busy);
    let err = ended(child);
    assert!(!err.contains("WRITER ERROR"), "child stderr: {err}");
}
