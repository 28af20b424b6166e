//! Calls made by an exit handler after glibc's `exit` destroyed the
//! calling thread's thread-locals (it does so before it runs the exit
//! handlers): a poll and a connect by a thread that had polled and
//! connected before. `LocalKey::with` panics there ("cannot access a
//! Thread Local Storage value during or after destruction"), which aborts
//! the process (a panic cannot unwind out of an exit handler).
//!
//! Each test runs a child process (this test binary again, running one of
//! the ignored `*_child` tests) that connects an offloaded stream, polls
//! it, registers an exit handler and calls `exit`.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::Mutex;
use std::time::Duration;

use softrdma_sockets::poll::{POLLIN, PollEntry, poll};
use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

/// Set in the child process a test runs: the name of the child test to
/// run (the child tests do nothing otherwise).
const CHILD_ENV: &str = "SOFTRDMA_SOCKETS_EXIT_TLS_CHILD";

/// What the child's exit handler writes to standard error when it ran to
/// its end.
const DONE: &str = "exit handler done";

/// Runs the child test `name` (this test binary again) and expects it to
/// exit with success, its exit handler done and no panic.
fn run_child(name: &str) {
    let out = std::process::Command::new("timeout")
        .arg("120")
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", name, "--include-ignored", "--nocapture", "-q"])
        .env(CHILD_ENV, name)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && err.contains(DONE) && !err.contains("panicked"),
        "child {name}: {:?}\n{err}",
        out.status
    );
}

/// Whether this process is the child running `name`.
fn is_child(name: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|n| n == name)
}

/// Registers `f` as an exit handler and calls `exit` (glibc destroys the
/// calling thread's thread-locals, then runs `f`).
fn exit_with(f: extern "C" fn()) -> ! {
    // (A panic in `f`, an `extern "C"` function, aborts the child.)
    assert!(softrdma_engine::at_exit(f));
    // `exit(3)`, as the C library's: thread-locals, then exit handlers.
    std::process::exit(0)
}

fn offload() -> Config {
    Config::with_mode(Mode::Offload)
}

/// A listener (in the child) whose thread greets each client with `hi`
/// and keeps its stream open.
fn listener() -> SocketAddr {
    let l = TcpListener::bind_with("127.0.0.1:0", &offload()).unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        loop {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"hi").unwrap();
            kept.push(s);
        }
    });
    addr
}

/// Connects (offloaded), polls until the greeting came and reads it.
fn connect_and_poll(addr: SocketAddr) -> TcpStream {
    let mut c = TcpStream::connect_with(addr, &offload()).unwrap();
    assert!(c.transport().is_offloaded());
    let mut e = [PollEntry::stream(&c, POLLIN)];
    assert_eq!(
        poll(&mut e, Some(Duration::from_secs(10)), None).unwrap(),
        1
    );
    let mut hi = [0u8; 2];
    c.read_exact(&mut hi).unwrap();
    assert_eq!(&hi, b"hi");
    c
}

/// The stream the child's exit handler polls.
static STREAM: Mutex<Option<TcpStream>> = Mutex::new(None);

extern "C" fn poll_late() {
    let c = STREAM.lock().unwrap().take().unwrap();
    // Nothing more comes: a wait that times out.
    let mut e = [PollEntry::stream(&c, POLLIN)];
    assert_eq!(
        poll(&mut e, Some(Duration::from_millis(20)), None).unwrap(),
        0
    );
    eprintln!("{DONE}");
}

/// Regression: `poll` took the thread's wait set with `with`; an exit
/// handler that polled on a thread that had polled before panicked (the
/// process aborted).
#[test]
fn polling_in_an_exit_handler_after_the_thread_polled_does_not_panic() {
    run_child("polling_in_an_exit_handler_child");
}

#[test]
#[ignore = "the child process of the test above"]
fn polling_in_an_exit_handler_child() {
    if !is_child("polling_in_an_exit_handler_child") {
        return;
    }
    let c = connect_and_poll(listener());
    *STREAM.lock().unwrap() = Some(c);
    exit_with(poll_late)
}

/// Where the child's exit handler connects.
static ADDR: Mutex<Option<SocketAddr>> = Mutex::new(None);

extern "C" fn connect_late() {
    let addr = ADDR.lock().unwrap().take().unwrap();
    let c = connect_and_poll(addr);
    drop(c);
    eprintln!("{DONE}");
}

/// Regression: a connect took the thread's kept detection query socket
/// (and kept its own) with `with`; an exit handler that connected on a
/// thread that had connected before panicked (the process aborted).
/// (Memory registration in an exit handler, whose STags came from
/// `rand::rng()`, is the engine's `exit_thread_locals` test.)
#[test]
fn connecting_in_an_exit_handler_after_the_thread_connected_does_not_panic() {
    run_child("connecting_in_an_exit_handler_child");
}

#[test]
#[ignore = "the child process of the test above"]
fn connecting_in_an_exit_handler_child() {
    if !is_child("connecting_in_an_exit_handler_child") {
        return;
    }
    let addr = listener();
    let c = connect_and_poll(addr);
    // Closed: its query socket is kept for the thread's next connect.
    drop(c);
    *ADDR.lock().unwrap() = Some(addr);
    exit_with(connect_late)
}
