//! Regression tests of the `softrdma` command's hardening, each named
//! after the bug, run against the real binary: silent clients, memory a
//! request makes the server allocate, port scans of the ping server, error
//! messages that hide the cause.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

use common::{bin, run, stderr};

/// A process whose stdout and stderr lines arrive on a channel.
struct Proc {
    child: Child,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn start(args: &[&str]) -> Proc {
        let mut child = bin()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start softrdma");
        let (tx, lines) = channel();
        let out = child.stdout.take().unwrap();
        let err = child.stderr.take().unwrap();
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        std::thread::spawn(move || {
            for l in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx2.send(l);
            }
        });
        Proc {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits (at most `secs`) for a line containing `what`; returns it.
    fn wait_for(&mut self, what: &str, secs: u64) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(secs)) {
                Ok(l) => {
                    self.seen.push(l.clone());
                    if l.contains(what) {
                        return l;
                    }
                }
                Err(_) => panic!("no line with {what:?}; output so far:\n{}", self.text()),
            }
        }
    }

    fn text(&self) -> String {
        self.seen.join("\n")
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // Only this test's own child, by its PID.
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = Command::new("kill")
                .args(["-CONT", &self.pid()])
                .stderr(Stdio::null())
                .status();
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// A persistent perf server on a free port; returns it and its address.
fn perf_server(extra: &[&str]) -> (Proc, String) {
    let mut args = vec![
        "perf",
        "--server",
        "--persist",
        "--bind",
        "127.0.0.1",
        "--port",
        "0",
    ];
    args.extend_from_slice(extra);
    let mut s = Proc::start(&args);
    let l = s.wait_for("listening on", 30);
    let addr = l.trim().strip_prefix("listening on ").unwrap().to_string();
    (s, addr)
}

/// A 60-second 4 KiB RDMA Read client of the server at `addr`, once its
/// run is under way (it printed "measuring").
fn measuring_read_client(addr: &str, timeout: &str) -> Proc {
    let mut client = Proc::start(&[
        "perf",
        "read",
        "-s",
        "4K",
        "-D",
        "60",
        "--timeout",
        timeout,
        "-v",
        "--connect",
        addr,
    ]);
    client.wait_for("measuring", 30);
    client
}

/// Sends `sig` (`-STOP`, `-INT`, ...) to this test's own child, by its PID.
fn signal(p: &Proc, sig: &str) {
    let st = Command::new("kill").args([sig, &p.pid()]).status().unwrap();
    assert!(st.success());
}

#[test]
fn persist_server_froze_forever_when_a_client_went_silent_mid_run() {
    let (mut server, addr) = perf_server(&["--timeout", "2"]);
    // A client with a long run, stopped (SIGSTOP) once the run is under
    // way: its connections stay up but nothing comes from it any more, as
    // in a network partition without a reset.
    let mut silent = measuring_read_client(&addr, "60");
    std::thread::sleep(Duration::from_millis(300));
    signal(&silent, "-STOP");
    let why = server.wait_for("went silent", 60);
    assert!(why.contains("2 s"), "{why}");
    server.wait_for("waiting for the next client", 30);
    // The server serves the next client.
    let o = run(&[
        "perf",
        "write",
        "-s",
        "4K",
        "-n",
        "50",
        "--json",
        "--timeout",
        "20",
        "--connect",
        &addr,
    ]);
    assert!(o.status.success(), "{}\n{}", stderr(&o), server.text());
    let _ = silent.child.kill();
}

#[test]
fn persist_server_froze_when_a_client_sent_a_request_and_went_silent() {
    use softrdma_engine::cm::{ConnectConfig, connect};
    use softrdma_engine::{CompletionQueue, Device, ProtectionDomain, QpInitAttr, QueuePair};
    let (mut server, addr) = perf_server(&["--timeout", "1"]);
    // A valid request (write bw, 1 size of 4 KiB, 10 messages) that is
    // never followed by anything.
    let mut hello = b"SRPF".to_vec();
    hello.extend_from_slice(&[b'H', 2, 0, 0, 0]);
    hello.extend_from_slice(&10u64.to_le_bytes());
    hello.extend_from_slice(&0u64.to_le_bytes());
    hello.extend_from_slice(&16u32.to_le_bytes());
    hello.extend_from_slice(&1u32.to_le_bytes());
    hello.extend_from_slice(&64u32.to_le_bytes());
    hello.push(1);
    hello.extend_from_slice(&4096u32.to_le_bytes());
    let dev = Device::open_with(Default::default()).unwrap();
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 16, None).unwrap();
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
    let conn = connect(
        &qp,
        addr.as_str(),
        &ConnectConfig {
            private_data: hello,
            timeout: Duration::from_secs(10),
            ..ConnectConfig::default()
        },
    )
    .expect("the server accepts a valid request");
    let why = server.wait_for("softrdma perf:", 30);
    assert!(
        why.contains("nothing from the client for 1 s (waiting for the next test)"),
        "{why}"
    );
    server.wait_for("waiting for the next client", 30);
    let o = run(&[
        "perf",
        "send",
        "--lat",
        "-n",
        "50",
        "--timeout",
        "20",
        "--connect",
        &addr,
    ]);
    assert!(o.status.success(), "{}\n{}", stderr(&o), server.text());
    drop(conn);
}

#[test]
fn one_request_made_the_server_allocate_8_gib() {
    let (mut server, addr) = perf_server(&["--timeout", "10"]);
    // 4 QPs of 1 GiB: refused by the default limit before anything is
    // allocated on either side.
    let o = run(&[
        "perf",
        "write",
        "-s",
        "1G",
        "--qps",
        "4",
        "-n",
        "1",
        "--connect",
        &addr,
    ]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("refused") && e.contains("--max-mem"), "{e}");
    assert!(e.contains("4.0 GiB") && e.contains("1 GiB"), "{e}");
    server.wait_for("--max-mem", 30);
    // A server's own limit.
    drop(server);
    let (_server, addr) = perf_server(&["--max-mem", "1M"]);
    let o = run(&["perf", "send", "-s", "2M", "-n", "1", "--connect", &addr]);
    assert!(
        stderr(&o).contains("limit of 1 MiB (--max-mem)"),
        "{}",
        stderr(&o)
    );
    let o = run(&[
        "perf",
        "send",
        "-s",
        "64K",
        "-n",
        "20",
        "--json",
        "--connect",
        &addr,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// Resident memory of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

#[test]
fn server_zero_filled_buffers_it_only_serves_reads_from() {
    // A 64 MiB Read test: the server's buffer is only read, never written,
    // so the kernel need not back it.
    let (server, addr) = perf_server(&["--timeout", "20"]);
    let mut client = Proc::start(&[
        "perf",
        "read",
        "-s",
        "64M",
        "-D",
        "2",
        "-t",
        "1",
        "--json",
        "-v",
        "--connect",
        &addr,
    ]);
    client.wait_for("measuring", 30);
    std::thread::sleep(Duration::from_millis(300));
    // During the run, while the server holds the buffer.
    let rss = rss_kib(server.child.id());
    let (status, text) = finish_taken(&mut client);
    assert!(status.success(), "{text}");
    // The old server held 128 MiB of zeroed buffers here (a target and a
    // receive buffer, both filled); now the target is untouched and there
    // is no receive buffer. What remains is the process itself and the
    // engine's transmit path, which copies a Read Response's data (one
    // 64 MiB Read in flight with -t 1).
    assert!(
        rss < 112 * 1024,
        "server resident memory {rss} KiB during a 64 MiB read test"
    );
}

fn free_port() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port().to_string()
}

/// Waits (at most 60 s) for `p` to exit; its status and all its output.
fn finish(mut p: Proc) -> (std::process::ExitStatus, String) {
    finish_taken(&mut p)
}

#[test]
fn ping_server_exited_on_the_first_bad_or_silent_connection() {
    let port = free_port();
    let server = Proc::start(&[
        "ping",
        "-s",
        "-a",
        "127.0.0.1",
        "-p",
        &port,
        "-C",
        "3",
        "--timeout",
        "20",
    ]);
    // A port scan: connect, close at once (retried until the server
    // listens).
    let addr = format!("127.0.0.1:{port}");
    let start = std::time::Instant::now();
    loop {
        match std::net::TcpStream::connect(&addr) {
            Ok(s) => break drop(s),
            Err(e) => {
                assert!(start.elapsed() < Duration::from_secs(30), "{e}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
    // A connection that says nothing, held open while the client runs.
    let silent = std::net::TcpStream::connect(&addr).unwrap();
    // Not MPA at all.
    let mut junk = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut junk, b"GET / HTTP/1.0\r\n\r\n").unwrap();
    let o = run(&["ping", "-c", "-a", "127.0.0.1", "-p", &port, "-C", "3"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let (status, text) = finish(server);
    assert!(status.success(), "{text}");
    assert!(
        text.contains("skipped the connection from 127.0.0.1"),
        "{text}"
    );
    assert!(text.contains("3 iterations"), "{text}");
    drop((silent, junk));
}

#[test]
fn ping_server_exit_status_depended_on_timing_when_the_client_left() {
    // The client leaves right after its last iteration, every time: the
    // server's last Send may complete before or after the close arrives.
    for _ in 0..3 {
        let port = free_port();
        let server = Proc::start(&["ping", "-s", "-a", "127.0.0.1", "-p", &port, "-C", "2"]);
        let start = std::time::Instant::now();
        let o = loop {
            let o = run(&[
                "ping",
                "-c",
                "-a",
                "127.0.0.1",
                // rping's -I: from a given source address.
                "-I",
                "127.0.0.1",
                "-p",
                &port,
                "-C",
                "2",
                "--start-delay-ms",
                "0",
            ]);
            if o.status.success() || start.elapsed() > Duration::from_secs(30) {
                break o;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert!(o.status.success(), "{}", stderr(&o));
        let (status, text) = finish(server);
        assert!(status.success(), "{text}");
    }
}

#[test]
fn ping_q_meant_quiet_and_size_took_no_suffix() {
    // rping's -q (a self-created QP) is accepted; -S takes perf's suffixes;
    // the default size is rping's 64 (`cb->size = 64` in rping.c).
    let o = run(&[
        "ping",
        "-q",
        "-S",
        "1K",
        "-a",
        "127.0.0.1",
        "-p",
        "1",
        "--timeout",
        "1",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("connecting to 127.0.0.1:1"),
        "{}",
        stderr(&o)
    );
    let o = run(&["ping", "-S", "100K"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("maximum of 65536"), "{}", stderr(&o));
    let o = run(&["ping", "--help"]);
    let help = String::from_utf8_lossy(&o.stdout);
    assert!(help.contains("[default: 64]"), "{help}");
}

#[test]
fn ping_ctrl_c_printed_nothing_and_persistent_server_served_one_client() {
    let port = free_port();
    let mut server = Proc::start(&["ping", "-s", "-P", "-a", "127.0.0.1", "-p", &port]);
    let start = std::time::Instant::now();
    let o = loop {
        let o = run(&["ping", "-c", "-a", "127.0.0.1", "-p", &port, "-C", "2"]);
        if o.status.success() || start.elapsed() > Duration::from_secs(30) {
            break o;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(o.status.success(), "{}", stderr(&o));
    server.wait_for("2 iterations verified", 30);
    // An endless client, interrupted: it says how many it verified.
    let mut client = Proc::start(&["ping", "-c", "-a", "127.0.0.1", "-p", &port, "-v"]);
    client.wait_for("ping data: rdma-ping-3", 30);
    signal(&client, "-INT");
    let (status, text) = finish(client);
    assert_eq!(status.code(), Some(130), "{text}");
    assert!(text.contains("interrupted; "), "{text}");
    assert!(text.contains("iterations verified"), "{text}");
    // The persistent server is still there for the next client.
    server.wait_for("iterations", 30);
    let o = run(&["ping", "-c", "-a", "127.0.0.1", "-p", &port, "-C", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn connect_with_an_invalid_port_said_cannot_resolve() {
    for bad in ["127.0.0.1:99999", "127.0.0.1:abc"] {
        let o = run(&["perf", "write", "--connect", bad]);
        assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
        let e = stderr(&o);
        assert!(e.contains("invalid port"), "{e}");
        assert!(!e.contains("resolve"), "{e}");
    }
}

#[test]
fn a_perftest_peer_gave_malformed_message_truncated() {
    use softrdma_engine::cm::{ListenConfig, Listener};
    use softrdma_engine::{CompletionQueue, Device, ProtectionDomain, QpInitAttr, QueuePair};
    // A server that accepts with no private data, as perftest's -R does.
    let l = Listener::bind("127.0.0.1:0", 8, ListenConfig::default()).unwrap();
    let addr = l.local_addr().to_string();
    let t = std::thread::spawn(move || {
        let dev = Device::open_with(Default::default()).unwrap();
        let pd = ProtectionDomain::new(&dev);
        let cq = CompletionQueue::new(&dev, 16, None).unwrap();
        let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
        let req = l.get_request(Some(Duration::from_secs(30))).unwrap();
        req.accept(&qp, &[], 16, 16).unwrap();
        std::thread::sleep(Duration::from_secs(2));
    });
    let o = run(&["perf", "write", "-n", "5", "--connect", &addr]);
    assert_eq!(o.status.code(), Some(1));
    let e = stderr(&o);
    assert!(e.contains("is not a softrdma perf server"), "{e}");
    t.join().unwrap();
}

#[test]
fn a_peer_leaving_mid_run_showed_wr_flush_err() {
    let (mut server, addr) = perf_server(&["--timeout", "10"]);
    let mut client = measuring_read_client(&addr, "10");
    std::thread::sleep(Duration::from_millis(200));
    let _ = server.child.kill();
    let (status, text) = finish_taken(&mut client);
    assert!(!status.success(), "{text}");
    assert!(!text.contains("FLUSH_ERR"), "{text}");
    assert!(
        text.contains("closed the connection") || text.contains("reset"),
        "{text}"
    );
}

/// [`finish`] for a process still owned by the caller.
fn finish_taken(p: &mut Proc) -> (std::process::ExitStatus, String) {
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = p.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "did not exit:\n{}",
            p.text()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    while let Ok(l) = p.lines.recv_timeout(Duration::from_secs(5)) {
        p.seen.push(l);
    }
    (status, p.text())
}
