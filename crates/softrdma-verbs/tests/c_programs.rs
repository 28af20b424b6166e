//! C programs built with the system `cc` against the rdma-core headers and
//! run on the drop-in library: error paths (NULL arguments, UD/UC refused,
//! posting on an unconnected QP, O_NONBLOCK, destroy with unacknowledged
//! events) and the `ibv_wr_*` API over an rdma_cm loopback connection.

mod common;

use std::process::Command;
use std::time::Duration;

fn run(name: &str, libs: &[&str]) {
    run_env(name, libs, &[]);
}

fn run_env(name: &str, libs: &[&str], env: &[(&str, &str)]) {
    if !common::have_headers() {
        eprintln!(
            "SKIP: rdma-core headers or cc missing (apt-get install libibverbs-dev librdmacm-dev)"
        );
        return;
    }
    // Its own executable and library directory per environment, so that
    // tests running one program with different settings run in parallel.
    let tag = if env.is_empty() {
        name.to_string()
    } else {
        format!("{name}-env{}", env.len())
    };
    let exe = common::compile_as(name, &tag, libs);
    let dir = common::drop_in_dir(&tag);
    let mut child = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &dir)
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run");
    // Bounded: a hang is a failure, not a stuck test run.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_file(&exe);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && text.contains("all ok"),
        "{name}:\n{text}"
    );
}

#[test]
fn error_paths_behave_like_libibverbs() {
    run("errors", &["-libverbs", "-lpthread"]);
}

#[test]
fn wr_api_and_rdma_cm_over_loopback() {
    run("wr_api", &["-libverbs", "-lrdmacm"]);
}

#[test]
fn srq_limit_event_reaches_the_async_fd() {
    run("srq_events", &["-libverbs", "-lrdmacm"]);
}

#[test]
fn synchronous_ids_wait_for_their_outcome() {
    run("sync_cm", &["-libverbs", "-lrdmacm", "-lpthread"]);
}

/// Connecting to kernel siw on a slow host needs the active side to hold
/// its first message after the MPA Reply (see docs/verbs.md).
#[test]
fn connect_settle_holds_the_established_event() {
    run_env(
        "sync_cm",
        &["-libverbs", "-lrdmacm", "-lpthread"],
        &[("SOFTRDMA_CONNECT_SETTLE_MS", "300")],
    );
}

#[test]
fn type_2_memory_window_grants_remote_write() {
    run("mw", &["-libverbs", "-lrdmacm"]);
}
