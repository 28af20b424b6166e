//! The `softrdma demo` and `softrdma perf` commands, run as a user would.

use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(args)
        .output()
        .expect("run softrdma")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

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
            let rows = json_lines(&run(&args));
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
                "lat_median_us",
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
        let rows = json_lines(&run(args));
        let r = &rows[0];
        assert!(r["ratio"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert!(r["tcp_mb_s"].as_f64().is_some_and(|v| v > 0.0), "{r}");
        assert!(r["tcp_lat_median_us"].as_f64().is_some(), "{r}");
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
    assert!(text.contains("MB/s") && text.contains("p99_us"), "{text}");
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
