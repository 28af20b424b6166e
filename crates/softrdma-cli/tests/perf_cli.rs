//! The `softrdma demo` and `softrdma perf` commands, run as a user would
//! (`perf` in loopback and in two-process mode).

mod common;

use std::process::{Command, Output};

use common::{json_rows, run, stdout};

#[test]
fn demo_runs_every_step() {
    let o = run(&["demo"]);
    let text = stdout(&o);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for step in [
        "device",
        "connect",
        "send/recv",
        "rdma write",
        "rdma read",
        "atomic",
        "checksum",
        "bandwidth",
        "latency",
        "demo complete",
    ] {
        assert!(text.contains(step), "missing '{step}' in:\n{text}");
    }
}

#[test]
fn perf_every_test_and_mode_as_json() {
    for test in ["write", "read", "send", "atomic"] {
        for lat in [false, true] {
            let mut args = vec!["perf", test, "-n", "50", "--json"];
            if lat {
                args.push("--lat");
            } else if test != "atomic" {
                args.extend(["-s", "4K"]);
            }
            let rows = json_rows(&run(&args));
            assert_eq!(rows.len(), 1, "{args:?}");
            let r = &rows[0];
            assert_eq!(r["test"], test);
            assert_eq!(r["mode"], if lat { "lat" } else { "bw" });
            assert_eq!(r["iters"], 50);
            for f in [
                "size",
                "mb_s",
                "gbit_s",
                "mmsg_s",
                "lat_min_us",
                "lat_mean_us",
                "lat_p50_us",
                "lat_p999_us",
                "lat_p99_us",
                "lat_max_us",
            ] {
                let v = r[f].as_f64().unwrap_or_else(|| panic!("{f} in {r}"));
                assert!(v > 0.0, "{f} = {v} in {r}");
            }
            assert!(r["cpu_us_per_msg"].as_f64().is_some());
            assert!(r.get("ratio").is_none());
        }
    }
}

#[test]
fn baseline_adds_tcp_and_ratio() {
    for args in [
        &[
            "perf",
            "write",
            "-s",
            "64K",
            "-n",
            "50",
            "--json",
            "--baseline",
            "tcp",
        ][..],
        &[
            "perf",
            "send",
            "--lat",
            "-n",
            "50",
            "--json",
            "--baseline",
            "tcp",
        ][..],
    ] {
        let rows = json_rows(&run(args));
        let r = &rows[0];
        assert!(r["ratio"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert!(r["tcp_mb_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        // A TCP stream has no per-message latency: no number, not 0.
        let lat = r["mode"] == "lat";
        assert_eq!(r["tcp_lat_mean_us"].as_f64().is_some(), lat, "{r}");
        assert_eq!(r["tcp_lat_p99_us"].as_f64().is_some(), lat, "{r}");
        assert_eq!(r["baseline"], "tcp", "{r}");
        assert!(r["ratio_of"].as_str().is_some(), "{r}");
    }
}

#[test]
fn csv_sweep_and_plot() {
    let dir = std::env::temp_dir().join(format!("softrdma-perf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("plot.svg");
    let o = run(&[
        "perf",
        "write",
        "-a",
        "-n",
        "5",
        "--csv",
        "--baseline",
        "tcp",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let text = stdout(&o);
    assert!(
        o.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut lines = text.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("test,mode,size,iters,mb_s")
    );
    // 2 B .. 8 MiB.
    assert_eq!(lines.count(), 23, "{text}");
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.starts_with("<svg") && s.trim_end().ends_with("</svg>"));
    assert!(s.contains("polyline"));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn human_table() {
    let o = run(&["perf", "read", "-s", "1K", "-n", "50", "--depth", "4"]);
    let text = stdout(&o);
    assert!(o.status.success());
    assert!(text.contains("MB/s") && text.contains("p99.9"), "{text}");
    assert!(text.contains("post to completion, 4 outstanding"), "{text}");
    assert!(
        text.lines().any(|l| l.trim_start().starts_with("1K")),
        "{text}"
    );
}

#[test]
fn bad_arguments_exit_2_with_a_message() {
    for args in [
        &["perf", "bogus"][..],
        &["perf", "write", "-s", "12Q"][..],
        &["perf", "atomic", "-s", "64"][..],
        &["perf", "write", "--depth", "0", "-n", "5"][..],
        &["perf", "write", "-n", "5", "-D", "1"][..],
        &["perf", "write", "--baseline", "udp"][..],
    ] {
        let o = run(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("error"), "{args:?}: {err}");
    }
}

#[test]
fn info_json_reports_attributes_threads_and_defaults() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["info", "--json"])
        .output()
        .expect("run softrdma info");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["device"], "softrdma0");
    assert!(v["attributes"]["max_qp"].as_u64().unwrap() > 0);
    assert_eq!(v["attributes"]["max_sge_rd"], 1);
    assert!(!v["threads"]["datamovers"].as_array().unwrap().is_empty());
    assert!(
        !v["threads"]["completion_handlers"]
            .as_array()
            .unwrap()
            .is_empty()
    );
    assert_eq!(v["defaults"]["mpa_revision"], 2);
    assert_eq!(v["defaults"]["private_data_cap"], 256);
    let text = std::process::Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("info")
        .output()
        .expect("run softrdma info");
    let text = String::from_utf8(text.stdout).unwrap();
    assert!(text.starts_with("hca_id:\tsoftrdma0"), "{text}");
}

// ---------------------------------------------------------------------
// Two-process mode: a `--server` and a `--connect` process on 127.0.0.1.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdout, Stdio};
use std::time::{Duration, Instant};

/// A server process and its port (read from its `listening on` line).
struct Server {
    child: Child,
    out: BufReader<ChildStdout>,
    port: u16,
}

/// What a finished server printed.
struct Finished {
    ok: bool,
    stdout: String,
    stderr: String,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_softrdma"))
            .args(["perf", "--server", "--bind", "127.0.0.1", "--port", "0"])
            .args(args)
            // Fail with a message rather than make `finish` give up.
            .args(if args.contains(&"--timeout") {
                &[][..]
            } else {
                &["--timeout", "10"][..]
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the server");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut first = String::new();
        out.read_line(&mut first).expect("the server's first line");
        // `listening on ADDR`, or with --json `{"listening":"ADDR"}`.
        let addr = match serde_json::from_str::<serde_json::Value>(&first) {
            Ok(v) => v["listening"].as_str().unwrap_or_default().to_string(),
            Err(_) => first.trim().trim_start_matches("listening on ").to_string(),
        };
        let port = addr
            .strip_prefix("127.0.0.1:")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("no port in {first:?}"));
        Server { child, out, port }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Waits (at most 30 s) for the server to exit.
    fn finish(mut self) -> Finished {
        let start = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
                panic!("the server did not exit");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let mut stdout = String::new();
        self.out.read_to_string(&mut stdout).unwrap();
        let mut stderr = String::new();
        self.child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        Finished {
            ok: status.success(),
            stdout,
            stderr,
        }
    }
}

/// Runs a client against `s` with `args` (plus `--connect`).
fn client(s: &Server, args: &[&str]) -> Output {
    let addr = s.addr();
    let mut a = vec!["perf"];
    a.extend_from_slice(args);
    a.extend(["--connect", addr.as_str()]);
    run(&a)
}

/// Server and client with the same JSON rows; returns the client's rows.
fn pair(server_args: &[&str], client_args: &[&str]) -> Vec<serde_json::Value> {
    let s = Server::start(&[server_args, &["--json"]].concat());
    let c = client(&s, &[client_args, &["--json"]].concat());
    let f = s.finish();
    assert!(
        c.status.success() && f.ok,
        "client: {}\nserver: {}",
        String::from_utf8_lossy(&c.stderr),
        f.stderr
    );
    let rows = json_rows(&c);
    let srows: Vec<serde_json::Value> = f
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(rows.len(), srows.len(), "{}", f.stdout);
    for (c, s) in rows.iter().zip(&srows) {
        // The server prints the client's numbers with its own CPU time.
        for k in ["test", "mode", "size", "iters", "mb_s", "lat_p50_us"] {
            assert_eq!(c[k], s[k], "{k}: client {c}, server {s}");
        }
    }
    rows
}

fn check_row(r: &serde_json::Value, test: &str, mode: &str, iters: u64) {
    assert_eq!(r["test"], test, "{r}");
    assert_eq!(r["mode"], mode, "{r}");
    assert_eq!(r["iters"], iters, "{r}");
    for f in ["mb_s", "lat_p50_us", "lat_max_us"] {
        assert!(r[f].as_f64().is_some_and(|v| v > 0.0), "{f} in {r}");
    }
}

#[test]
fn two_process_write_bw_and_send_lat() {
    let rows = pair(&[], &["write", "-s", "64K", "-n", "100"]);
    check_row(&rows[0], "write", "bw", 100);
    assert_eq!(rows[0]["size"], 65536);
    let rows = pair(&["send", "--lat"], &["send", "--lat", "-n", "200"]);
    check_row(&rows[0], "send", "lat", 200);
    assert_eq!(rows[0]["size"], 8);
}

#[test]
fn two_process_read_bw_and_atomics() {
    let rows = pair(&[], &["read", "-s", "4K", "-n", "100", "--depth", "4"]);
    check_row(&rows[0], "read", "bw", 100);
    let rows = pair(&[], &["atomic", "-n", "100"]);
    check_row(&rows[0], "atomic", "bw", 100);
    let rows = pair(&[], &["atomic", "--lat", "-n", "100"]);
    check_row(&rows[0], "atomic", "lat", 100);
    let rows = pair(&[], &["write", "--lat", "-n", "100", "-s", "4K"]);
    check_row(&rows[0], "write", "lat", 100);
}

#[test]
fn two_process_two_qps_and_a_small_sweep() {
    let rows = pair(
        &["--qps", "2"],
        &["send", "--qps", "2", "-s", "1K", "-n", "300"],
    );
    check_row(&rows[0], "send", "bw", 300);
    let rows = pair(&[], &["write", "--qps", "2", "-a", "-s", "16K", "-n", "20"]);
    let sizes: Vec<u64> = rows.iter().map(|r| r["size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, (1..=14).map(|e| 1u64 << e).collect::<Vec<_>>());
    for r in &rows {
        check_row(r, "write", "bw", 20);
    }
}

#[test]
fn two_process_tcp_baseline() {
    let rows = pair(
        &[],
        &["write", "-s", "64K", "-n", "50", "--baseline", "tcp"],
    );
    let r = &rows[0];
    assert!(r["ratio"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    assert!(r["tcp_mb_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
    let rows = pair(&[], &["send", "--lat", "-n", "50", "--baseline", "tcp"]);
    assert!(rows[0]["tcp_lat_p50_us"].as_f64().is_some_and(|v| v > 0.0));
}

#[test]
fn two_process_human_table_on_both_sides() {
    let s = Server::start(&[]);
    let c = client(&s, &["read", "--lat", "-n", "50"]);
    let f = s.finish();
    let text = stdout(&c);
    assert!(c.status.success() && f.ok, "{}", f.stderr);
    assert!(text.contains("(client of 127.0.0.1:"), "{text}");
    assert!(
        f.stdout.contains("(server, client 127.0.0.1:"),
        "{}",
        f.stdout
    );
    assert!(f.stdout.contains("p99.9"), "{}", f.stdout);
}

#[test]
fn server_refuses_a_conflicting_test_with_the_reason_on_both_sides() {
    let s = Server::start(&["write", "--crc"]);
    let c = client(&s, &["read", "-n", "10"]);
    let f = s.finish();
    assert!(!c.status.success() && !f.ok);
    let cerr = String::from_utf8_lossy(&c.stderr);
    for err in [cerr.as_ref(), f.stderr.as_str()] {
        assert!(err.contains("refused"), "{err}");
        assert!(err.contains("'write'") && err.contains("'read'"), "{err}");
        assert!(err.contains("CRC"), "{err}");
    }
}

#[test]
fn server_refuses_a_peer_that_is_not_a_perf_client() {
    use softrdma_engine::cm::{CmError, ConnectConfig, connect};
    use softrdma_engine::{CompletionQueue, Device, ProtectionDomain, QpInitAttr, QueuePair};
    let s = Server::start(&[]);
    let dev = Device::open_with(Default::default()).unwrap();
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 16, None).unwrap();
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq)).unwrap();
    let r = connect(
        &qp,
        s.addr().as_str(),
        &ConnectConfig {
            private_data: b"SRPF\x48\x01garbage".to_vec(),
            timeout: Duration::from_secs(10),
            ..ConnectConfig::default()
        },
    );
    match r {
        Err(CmError::Rejected { private_data }) => {
            let why = String::from_utf8_lossy(&private_data);
            assert!(why.contains("malformed"), "{why}");
        }
        other => panic!("expected a reject, got {other:?}"),
    }
    let f = s.finish();
    assert!(!f.ok);
    assert!(f.stderr.contains("malformed message"), "{}", f.stderr);
}

#[test]
fn client_without_server_fails_fast() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let start = Instant::now();
    let o = run(&[
        "perf",
        "write",
        "-n",
        "5",
        "--connect",
        &format!("127.0.0.1:{port}"),
    ]);
    assert!(start.elapsed() < Duration::from_secs(5));
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot connect to 127.0.0.1:"), "{err}");
}

#[test]
fn server_without_client_times_out() {
    let start = Instant::now();
    let s = Server::start(&["--timeout", "0.5"]);
    let f = s.finish();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(!f.ok);
    assert!(f.stderr.contains("no client connected"), "{}", f.stderr);
}
