//! The close of the side that closes first, and the peer's FIN.
//!
//! A close sends the connection's last data, its DisConn and its FIN, and
//! returns without waiting for the peer's FIN: the connection is kept
//! (its socket open, so that nothing the peer sends meanwhile resets it)
//! until that FIN comes, and the process's exit waits for it (bounded).
//!
//! Each test runs two child processes (this test binary again, running one
//! of the `*_child` tests, which do nothing when run alone): a peer, which
//! the test stops (`SIGSTOP`) so that it cannot answer, and the process
//! that closes.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

/// Where the closing child connects (set by the parent).
const ADDR_ENV: &str = "SD_CLOSE_FIN_ADDR";
/// Set for the peer child (set by the parent).
const PEER_ENV: &str = "SD_CLOSE_FIN_PEER";
/// The exit flush's bound (read by the library at the first connection).
const LIMIT_ENV: &str = "SOFTRDMA_SOCKETS_EXIT_FLUSH_MS";
/// What the closing child writes before it closes.
const LEN: usize = 1000;

fn offload() -> Config {
    Config::with_mode(Mode::Offload)
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 9)) as u8
}

/// A child process, killed if the test ends before it does.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(name: &str, envs: &[(&str, String)]) -> Kid {
    spawn_limited(name, envs, 20_000)
}

/// As [`spawn`], with the exit flush bounded by `limit_ms` (`0`: off).
fn spawn_limited(name: &str, envs: &[(&str, String)], limit_ms: u64) -> Kid {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", name, "--include-ignored", "--nocapture", "-q"])
        .env(LIMIT_ENV, limit_ms.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    Kid(cmd.spawn().unwrap())
}

/// The next line of a child's standard output that starts with `prefix`,
/// without it.
fn line_after(out: &mut BufReader<ChildStdout>, prefix: &str) -> String {
    let mut line = String::new();
    loop {
        line.clear();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "the child ended before saying {prefix:?}");
        if let Some(v) = line.trim().strip_prefix(prefix) {
            return v.to_string();
        }
    }
}

fn signal(kid: &Kid, sig: &str) {
    let ok = Command::new("kill")
        .args([sig, &kid.0.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill {sig}");
}

/// A closer's start: an offloaded connection to `addr` and [`LEN`]
/// octets written and flushed.
fn connect_and_write(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect_with(addr, &offload()).unwrap();
    assert!(s.transport().is_offloaded(), "{}", s.transport());
    let data: Vec<u8> = (0..LEN).map(pattern).collect();
    s.write_all(&data).unwrap();
    s.flush().unwrap();
    s
}

/// Says the data is written, then waits for the test's word to go on.
fn wrote_then_wait_for_go() {
    println!("wrote {LEN}");
    std::io::stdout().flush().unwrap();
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
}

/// A peer and a closer connected, the closer's data written and read.
struct Pair {
    peer: Kid,
    peer_out: BufReader<ChildStdout>,
    closer: Kid,
    closer_out: BufReader<ChildStdout>,
}

impl Pair {
    /// Starts the peer and the closer `name` (its exit flush bounded by
    /// `limit_ms`, `0`: off), up to the closer's data read by the peer.
    fn start(name: &str, limit_ms: u64) -> Pair {
        let mut peer = spawn("peer_child", &[(PEER_ENV, "1".to_string())]);
        let mut peer_out = BufReader::new(peer.0.stdout.take().unwrap());
        let addr = line_after(&mut peer_out, "addr ");
        let mut closer = spawn_limited(name, &[(ADDR_ENV, addr)], limit_ms);
        let mut closer_out = BufReader::new(closer.0.stdout.take().unwrap());
        assert_eq!(line_after(&mut closer_out, "wrote "), LEN.to_string());
        assert_eq!(line_after(&mut peer_out, "read "), LEN.to_string());
        Pair {
            peer,
            peer_out,
            closer,
            closer_out,
        }
    }

    /// Stops the peer (its engine's threads too; the kernel still
    /// acknowledges what comes) if `stop_peer`, then tells the closer to
    /// go on.
    fn go(&mut self, stop_peer: bool) {
        if stop_peer {
            signal(&self.peer, "-STOP");
        }
        let mut stdin = self.closer.0.stdin.take().unwrap();
        stdin.write_all(b"go\n").unwrap();
        stdin.flush().unwrap();
    }

    /// How long the closer's close took, in ms.
    fn closed_ms(&mut self) -> u64 {
        line_after(&mut self.closer_out, "closed in ")
            .trim_end_matches(" ms")
            .parse()
            .unwrap()
    }

    /// The peer read every octet, in order, then EOF.
    fn peer_got_all(&mut self) {
        assert_eq!(
            line_after(&mut self.peer_out, "got "),
            format!("{LEN} ok true eof true")
        );
    }

    /// Both processes end with success (the closer first).
    fn both_succeed(mut self) {
        let status = self.closer.0.wait().unwrap();
        assert!(status.success(), "closer: {status}");
        let status = self.peer.0.wait().unwrap();
        assert!(status.success(), "peer: {status}");
    }
}

/// The peer: accepts one offloaded connection, reads what comes until
/// EOF, says so.
#[test]
#[ignore = "child process of the tests below"]
fn peer_child() {
    if std::env::var(PEER_ENV).is_err() {
        return;
    }
    let l = TcpListener::bind_with("127.0.0.1:0", &offload()).unwrap();
    println!("addr {}", l.local_addr().unwrap());
    std::io::stdout().flush().unwrap();
    let (mut s, _) = l.accept().unwrap();
    assert!(s.transport().is_offloaded(), "{}", s.transport());
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut got = vec![0u8; LEN];
    s.read_exact(&mut got).unwrap();
    println!("read {}", got.len());
    std::io::stdout().flush().unwrap();
    // Here the parent stops this process, lets the other close, and
    // continues this one.
    let mut b = [0u8; 64];
    let eof = s.read(&mut b).unwrap() == 0;
    let ok = got.iter().enumerate().all(|(i, &b)| b == pattern(i));
    println!("got {} ok {ok} eof {eof}", got.len());
    std::io::stdout().flush().unwrap();
}

/// The closing side: connects, writes, waits for the parent's word,
/// closes, says how long the close took, and exits without anything
/// else (`exit(3)`: the exit handlers run).
#[test]
#[ignore = "child process of the tests below"]
fn closer_child() {
    let Ok(addr) = std::env::var(ADDR_ENV) else {
        return;
    };
    let s = connect_and_write(&addr);
    wrote_then_wait_for_go();
    let t = Instant::now();
    drop(s);
    println!("closed in {} ms", t.elapsed().as_millis());
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

/// The close of the side that closes first returned only once the peer's
/// FIN had come (up to the linger time, 5 s, with a peer that did not
/// answer): a program closing many connections waited for a round trip
/// through the peer's process on each. It now returns once its DisConn
/// and FIN are sent; the process's exit still waits for the peer's FIN
/// (so that the peer reads every octet and EOF, with no reset).
#[test]
fn a_close_does_not_wait_for_the_peers_fin_and_the_exit_does() {
    let mut p = Pair::start("closer_child", 20_000);
    // The peer cannot answer the FIN now (its engine's threads are
    // stopped too); the kernel still acknowledges what comes.
    p.go(true);
    let ms = p.closed_ms();
    // (A close that waits for the FIN takes the linger time: 5000 ms.)
    assert!(ms < 2000, "the close waited {ms} ms for the peer's FIN");
    // The exit waits for the peer's FIN.
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        p.closer.0.try_wait().unwrap().is_none(),
        "the closing process exited before the peer's FIN came"
    );
    signal(&p.peer, "-CONT");
    p.peer_got_all();
    p.both_succeed();
}

/// With the exit flush off (`SOFTRDMA_SOCKETS_EXIT_FLUSH_MS=0`) nothing
/// would wait for the peer's FIN at the exit: a close waits for it in the
/// call, as before.
#[test]
fn with_the_exit_flush_off_a_close_waits_for_the_peers_fin() {
    let mut p = Pair::start("closer_child", 0);
    p.go(true);
    // The peer answers 1.5 s later (the close must take 400 ms at least,
    // whatever the scheduling delays of the signals).
    std::thread::sleep(Duration::from_millis(1500));
    signal(&p.peer, "-CONT");
    let ms = p.closed_ms();
    assert!(
        ms >= 400,
        "the close returned after {ms} ms, before the peer's FIN"
    );
    p.peer_got_all();
    p.both_succeed();
}

/// The stream the late closer's exit handler closes.
static LATE: std::sync::Mutex<Option<TcpStream>> = std::sync::Mutex::new(None);

/// The late closer's exit handler: registered before its first
/// connection, so it runs after the library's exit flush (`atexit` runs
/// the last registered first), as an application's handler or a C++
/// destructor registered early does.
extern "C" fn close_late() {
    let s = LATE.lock().unwrap().take();
    let t = Instant::now();
    drop(s);
    println!("closed in {} ms", t.elapsed().as_millis());
    std::io::stdout().flush().unwrap();
}

/// As [`closer_child`], but the stream is closed by an exit handler that
/// runs after the exit flush.
#[test]
#[ignore = "child process of the tests below"]
fn late_closer_child() {
    let Ok(addr) = std::env::var(ADDR_ENV) else {
        return;
    };
    assert!(softrdma_engine::at_exit(close_late));
    let s = connect_and_write(&addr);
    *LATE.lock().unwrap() = Some(s);
    wrote_then_wait_for_go();
    std::process::exit(0);
}

/// Regression: a close made after the exit flush had started (an exit
/// handler registered before the first connection, a destructor, another
/// thread) was listed to wait for the peer's FIN later, but the exit
/// flush had already taken its list: nothing waited, and the process
/// ended before the peer's FIN. Such a close now waits in the call.
#[test]
fn a_close_after_the_exit_flush_started_was_listed_but_never_waited_for() {
    let mut p = Pair::start("late_closer_child", 20_000);
    p.go(true);
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        p.closer.0.try_wait().unwrap().is_none(),
        "the closing process exited before the peer's FIN came"
    );
    // The peer answers 1.5 s after the word to exit.
    std::thread::sleep(Duration::from_millis(1200));
    signal(&p.peer, "-CONT");
    let ms = p.closed_ms();
    assert!(
        ms >= 400,
        "the close returned after {ms} ms, before the peer's FIN"
    );
    p.peer_got_all();
    p.both_succeed();
}

/// This process's open sockets other than its netlink, unix and UDP ones
/// (the engine keeps some of its own): its TCP sockets, listed in the
/// kernel's TCP tables or not (one closed by both FINs is in neither:
/// TIME-WAIT is kept apart from it).
fn sockets_open() -> usize {
    let mut other = std::collections::HashSet::new();
    for (f, col) in [
        ("/proc/self/net/netlink", 9),
        ("/proc/self/net/unix", 6),
        ("/proc/self/net/udp", 9),
        ("/proc/self/net/udp6", 9),
    ] {
        let table = std::fs::read_to_string(f).unwrap_or_default();
        for l in table.lines().skip(1) {
            if let Some(i) = l.split_whitespace().nth(col) {
                other.insert(i.to_string());
            }
        }
    }
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| {
            l.to_str()
                .and_then(|l| l.strip_prefix("socket:["))
                .and_then(|l| l.strip_suffix(']'))
                .is_some_and(|i| !other.contains(i))
        })
        .count()
}

/// As [`closer_child`], but after the close it neither closes nor sets
/// up anything: it says how long its sockets stayed open (up to 3 s).
#[test]
#[ignore = "child process of the tests below"]
fn quiet_closer_child() {
    let Ok(addr) = std::env::var(ADDR_ENV) else {
        return;
    };
    let before = sockets_open();
    let s = connect_and_write(&addr);
    wrote_then_wait_for_go();
    drop(s);
    let t = Instant::now();
    while sockets_open() > before && t.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    if sockets_open() > before {
        println!("kept {} sockets", sockets_open() - before);
    } else {
        println!("let go in {} ms", t.elapsed().as_millis());
    }
    std::io::stdout().flush().unwrap();
    std::process::exit(0);
}

/// Regression: a closed connection waiting for the peer's FIN was let go
/// only at the process's next close, setup or exit: a process that closed
/// connections and went quiet kept their sockets (and regions) long after
/// the peer's FIN, past the linger time too. They now go once the FIN
/// has come (or the linger time is up) whatever the process does.
#[test]
fn a_closed_connection_was_let_go_only_at_the_next_close_setup_or_exit() {
    let mut p = Pair::start("quiet_closer_child", 20_000);
    p.go(false);
    // The peer reads EOF, closes and exits: its FIN comes at once.
    p.peer_got_all();
    let status = p.peer.0.wait().unwrap();
    assert!(status.success(), "peer: {status}");
    let mut line = String::new();
    p.closer_out.read_line(&mut line).unwrap();
    assert!(
        line.starts_with("let go in "),
        "the closed connection was kept: {line:?}"
    );
    let status = p.closer.0.wait().unwrap();
    assert!(status.success(), "closer: {status}");
}
