//! `softrdma perf` as perftest users use it, and its statistics, run
//! against the real binary.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{ChildStdout, Command, Stdio};

use common::{json_rows, run, stderr};

#[test]
fn latency_statistics_are_ordered_and_complete() {
    let r = &json_rows(&run(&["perf", "send", "--lat", "-n", "300", "--json"]))[0];
    let f = |k: &str| r[k].as_f64().unwrap_or_else(|| panic!("{k} in {r}"));
    assert!(f("lat_min_us") <= f("lat_p50_us"), "{r}");
    assert!(f("lat_p50_us") <= f("lat_p99_us"), "{r}");
    assert!(f("lat_p99_us") <= f("lat_p999_us"), "{r}");
    assert!(f("lat_p999_us") <= f("lat_max_us"), "{r}");
    assert!(f("lat_min_us") <= f("lat_mean_us") && f("lat_mean_us") <= f("lat_max_us"));
    assert!(f("lat_stdev_us") >= 0.0);
    assert_eq!(r["lat_kind"], "one-way (RTT/2)");
    let r = &json_rows(&run(&["perf", "read", "-n", "50", "-s", "1K", "--json"]))[0];
    assert_eq!(r["lat_kind"], "post to completion, 16 outstanding");
}

#[test]
fn busy_polled_tcp_baseline_and_the_ratio_on_means() {
    let r = &json_rows(&run(&[
        "perf",
        "write",
        "--lat",
        "-n",
        "200",
        "--json",
        "--baseline",
        "tcp-spin",
    ]))[0];
    assert_eq!(r["baseline"], "tcp-spin", "{r}");
    let mean = r["lat_mean_us"].as_f64().unwrap();
    let tmean = r["tcp_lat_mean_us"].as_f64().unwrap();
    let ratio = r["ratio"].as_f64().unwrap();
    // Rounded to 4 digits each.
    assert!((ratio - mean / tmean).abs() <= 0.01 * ratio, "{r}");
    assert!(
        r["ratio_of"]
            .as_str()
            .unwrap()
            .contains("below 1: softrdma faster"),
        "{r}"
    );
    // The CSV says the same.
    let o = run(&[
        "perf",
        "send",
        "-n",
        "50",
        "-s",
        "4K",
        "--csv",
        "--baseline",
        "tcp-spin",
    ]);
    let text = String::from_utf8_lossy(&o.stdout).into_owned();
    let mut l = text.lines();
    let head: Vec<&str> = l.next().unwrap().split(',').collect();
    assert!(
        head.contains(&"lat_p999_us") && head.contains(&"ratio_of"),
        "{text}"
    );
    assert!(l.next().unwrap().contains(",tcp-spin,"), "{text}");
}

#[test]
fn perftest_flags_and_a_positional_host() {
    let (mut s, mut out, addr) = json_perf_server();
    let (host, port) = addr.rsplit_once(':').unwrap();
    // ib_write_bw -d softrdma0 -q 2 -t 8 -I 32 -s 4096 -n 40 -R -p PORT HOST
    let r = &json_rows(&run(&[
        "perf",
        "write",
        "-d",
        "softrdma0",
        "-q",
        "2",
        "-t",
        "8",
        "-I",
        "32",
        "-s",
        "4096",
        "-n",
        "40",
        "-R",
        "-p",
        port,
        "--json",
        host,
    ]))[0];
    assert_eq!(r["iters"], 40);
    assert_eq!(r["size"], 4096);
    assert_eq!(r["lat_kind"], "post to completion, 8 outstanding");
    let srow = json_line(&mut out);
    assert_eq!(srow["iters"], 40);
    drop(out);
    let _ = s.0.wait();
}

/// Kills the child (by its handle) when the test ends early.
struct Guard(std::process::Child);

/// Starts `softrdma perf --server --json` on an ephemeral loopback port;
/// returns the server, its stdout, and the address of its first line.
fn json_perf_server() -> (Guard, BufReader<ChildStdout>, String) {
    let s = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args([
            "perf",
            "--server",
            "--bind",
            "127.0.0.1",
            "-p",
            "0",
            "--json",
            "--timeout",
            "20",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut s = Guard(s);
    let mut out = BufReader::new(s.0.stdout.take().unwrap());
    // A JSON server's stdout is JSON from the first line.
    let v = json_line(&mut out);
    let addr = v["listening"].as_str().unwrap().to_string();
    (s, out, addr)
}

/// The next line of a JSON server's stdout.
fn json_line(out: &mut BufReader<ChildStdout>) -> serde_json::Value {
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    serde_json::from_str(&line).unwrap()
}
impl Drop for Guard {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

#[test]
fn inline_above_the_maximum_was_silently_capped() {
    let o = run(&["perf", "write", "-n", "5", "--inline", "1000"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("--inline 1000"), "{}", stderr(&o));
    let o = run(&["perf", "write", "-n", "5", "-b"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("bidirectional"), "{}", stderr(&o));
    let o = run(&["perf", "write", "-n", "5", "-d", "mlx5_0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("softrdma0"), "{}", stderr(&o));
}

#[test]
fn plot_path_was_checked_only_after_the_run() {
    let o = run(&[
        "perf",
        "write",
        "-n",
        "5",
        "--plot",
        "/nonexistent-dir/x/plot.svg",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("cannot write the plot"),
        "{}",
        stderr(&o)
    );
    // Nothing was measured.
    assert!(String::from_utf8_lossy(&o.stdout).trim().is_empty());
}

#[test]
fn plot_drew_a_tcp_latency_line_at_zero_in_bandwidth_mode() {
    let dir = std::env::temp_dir().join(format!("softrdma-plot-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("bw.svg");
    let o = run(&[
        "perf",
        "write",
        "-a",
        "-s",
        "4K",
        "-n",
        "20",
        "--baseline",
        "tcp",
        "--plot",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = std::fs::read_to_string(&svg).unwrap();
    // Bandwidth: softrdma and TCP; latency: softrdma only, with its band.
    assert_eq!(s.matches("<polyline").count(), 3, "{s}");
    assert!(s.contains("<polygon"), "p50..p99 band");
    assert!(s.contains("log scale"));
    assert!(s.contains("depth 16, qps 1"), "parameters in the title");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ctrl_c_lost_the_results_so_far() {
    let mut c = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(["perf", "write", "-s", "4K", "-D", "60", "--json", "-v"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let err = BufReader::new(c.stderr.take().unwrap());
    // Keeps reading stderr to its end (the run writes more).
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    while let Ok(l) = rx.recv_timeout(std::time::Duration::from_secs(60)) {
        if l.contains("loopback measurement") {
            break;
        }
    }
    std::thread::sleep(std::time::Duration::from_millis(300));
    let st = Command::new("kill")
        .args(["-INT", &c.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let o = c.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130));
    let mut rest = Vec::new();
    while let Ok(l) = rx.recv_timeout(std::time::Duration::from_secs(10)) {
        rest.push(l);
    }
    assert!(rest.iter().any(|l| l.contains("interrupted")), "{rest:?}");
    let r: serde_json::Value =
        serde_json::from_str(String::from_utf8_lossy(&o.stdout).lines().next().unwrap()).unwrap();
    assert!(r["iters"].as_u64().unwrap() > 0, "{r}");
}

#[test]
fn demo_compared_a_spinning_softrdma_with_blocking_tcp_only() {
    let o = run(&["demo"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("TCP, busy-polled sockets"), "{text}");
    assert!(text.contains("TCP, blocking sockets"), "{text}");
    assert!(text.contains("below 1: softrdma faster"), "{text}");
}

#[test]
fn two_process_busy_polled_baseline_on_both_sides() {
    let (mut s, mut out, addr) = json_perf_server();
    let r = &json_rows(&run(&[
        "perf",
        "send",
        "--lat",
        "-n",
        "100",
        "--baseline",
        "tcp-spin",
        "--json",
        "--connect",
        &addr,
    ]))[0];
    assert_eq!(r["baseline"], "tcp-spin", "{r}");
    assert!(
        r["tcp_lat_p999_us"].as_f64().is_some_and(|v| v > 0.0),
        "{r}"
    );
    let srow = json_line(&mut out);
    assert_eq!(srow["baseline"], "tcp-spin", "{srow}");
    assert_eq!(srow["tcp_lat_mean_us"], r["tcp_lat_mean_us"]);
    let _ = s.0.wait();
}
