//! Shared helpers: the built library and Python programs run with it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// `target/<profile>/libsoftrdma_preload.so`, next to this test's `deps/`;
/// built here if `cargo test` did not build it (it builds no cdylib for
/// integration tests).
pub(crate) fn library() -> PathBuf {
    static BUILT: std::sync::Once = std::sync::Once::new();
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap().parent().unwrap();
    let lib = dir.join("libsoftrdma_preload.so");
    BUILT.call_once(|| {
        // Always (a no-op when it is up to date): a stale library would
        // test old code.
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "softrdma-preload"])
            .env("CARGO_TARGET_DIR", dir.parent().unwrap());
        if release {
            c.arg("--release");
        }
        let st = c.status().expect("run cargo build");
        assert!(st.success(), "cargo build -p softrdma-preload failed");
    });
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

pub(crate) fn have_python() -> bool {
    Command::new("python3").arg("-V").output().is_ok()
}

/// Runs `script` under python3 with the library preloaded.
pub(crate) fn python(script: &str, env: &[(&str, &str)]) -> (Output, Vec<String>) {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("stats.jsonl");
    let mut c = Command::new("python3");
    c.arg("-c")
        .arg(script)
        .env("LD_PRELOAD", library())
        .env("SOFTRDMA_SOCKETS_STATS", &stats)
        .env_remove("SOFTRDMA_SOCKETS")
        .env_remove("SOFTRDMA_SOCKETS_CONF");
    for (k, v) in env {
        c.env(k, v);
    }
    let out = c.output().unwrap();
    let lines = std::fs::read_to_string(&stats)
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect::<Vec<_>>();
    // The library's panics print nothing; the stats line counts them.
    assert!(
        !lines.iter().any(|l| l.contains("\"panics\":")),
        "the library panicked: {lines:?}\nstderr {}",
        String::from_utf8_lossy(&out.stderr)
    );
    (out, lines)
}

/// [`python`], asserting that the script ran to the end (exit status 0
/// and its `DONE` line); returns the stats lines.
pub(crate) fn python_done(script: &str, env: &[(&str, &str)]) -> Vec<String> {
    let (out, lines) = python(script, env);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("DONE"),
        "env {env:?}: status {:?}\nstdout {stdout}\nstderr {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    lines
}

pub(crate) fn field(line: &str, key: &str) -> String {
    let at = line.find(&format!("\"{key}\":")).unwrap() + key.len() + 3;
    line[at..]
        .split([',', '}'])
        .next()
        .unwrap()
        .trim_matches('"')
        .to_string()
}

/// Compiles the C program `src` (written to `dir/NAME.c`) with `cc` and
/// `flags` into `dir/NAME`; `None` (and a note on stderr) when there is no
/// `cc`. Any other failure, a compile error included, panics: a test must
/// not pass silently because its program did not build.
pub(crate) fn compile_c(
    dir: &std::path::Path,
    name: &str,
    src: &str,
    flags: &[&str],
) -> Option<std::path::PathBuf> {
    let c = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&c, src).unwrap();
    match std::process::Command::new("cc")
        .args(flags)
        .arg("-o")
        .arg(&exe)
        .arg(&c)
        .status()
    {
        Ok(st) => assert!(st.success(), "the C test program did not compile: {st}"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            eprintln!("no C compiler: skipped");
            return None;
        }
        Err(e) => panic!("cc: {e}"),
    }
    Some(exe)
}
