//! End to end: `softrdma run` prepares the environment and execs the program.

use std::path::Path;
use std::process::{Command, Output};

fn softrdma(lib_dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("run")
        .arg("--lib-dir")
        .arg(lib_dir)
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LD_PRELOAD")
        .env_remove("SOFTRDMA_IA_ADDR")
        .output()
        .expect("run softrdma")
}

fn fake_libs(names: &[&str]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for n in names {
        std::fs::write(d.path().join(n), b"stand-in").unwrap();
    }
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_program_sees_the_private_dir_first_and_the_dat_conf() {
    let d = fake_libs(&["libsoftrdma_verbs.so", "libsoftrdma_dapl.so"]);
    let o = softrdma(
        d.path(),
        &[
            "--ia-addr",
            "192.0.2.9",
            "--",
            "sh",
            "-c",
            "echo \"$LD_LIBRARY_PATH\"; cat \"$DAT_OVERRIDE\"; readlink \"${LD_LIBRARY_PATH%%:*}/libibverbs.so.1\"",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    let dir = d.path().canonicalize().unwrap();
    let mut lines = out.lines();
    assert_eq!(
        lines.next().unwrap(),
        dir.join("softrdma-run").to_str().unwrap()
    );
    assert!(
        out.contains("softrdma-lo u2.0 nonthreadsafe default"),
        "{out}"
    );
    assert!(out.contains("\"192.0.2.9 0\""), "{out}");
    assert!(
        out.lines()
            .last()
            .unwrap()
            .ends_with("/libsoftrdma_verbs.so"),
        "{out}"
    );
}

#[test]
fn exit_status_and_arguments_pass_through() {
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    let o = softrdma(d.path(), &["--", "sh", "-c", "exit 7"]);
    assert_eq!(o.status.code(), Some(7));
    // Hyphenated arguments belong to the program, not to `softrdma run`.
    let o = softrdma(d.path(), &["--", "echo", "-n", "--verbs"]);
    assert_eq!(text(&o.stdout), "--verbs");
}

#[test]
fn a_missing_program_is_127_with_a_message() {
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    let o = softrdma(d.path(), &["--", "/nonexistent/program"]);
    assert_eq!(o.status.code(), Some(127));
    assert!(text(&o.stderr).contains("cannot run /nonexistent/program"));
}

#[test]
fn no_libraries_is_an_error_that_says_how_to_build_them() {
    let d = fake_libs(&[]);
    let o = softrdma(d.path(), &["--", "true"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o.stderr).contains("cargo build --release"),
        "{}",
        text(&o.stderr)
    );
    let o = softrdma(d.path(), &["--sockets", "--", "true"]);
    assert!(text(&o.stderr).contains("libsoftrdma_preload.so"));
}

#[test]
fn print_env_gives_shell_assignments() {
    let d = fake_libs(&["libsoftrdma_verbs.so", "libsoftrdma_preload.so"]);
    let o = softrdma(d.path(), &["--sockets", "--print-env"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let out = text(&o.stdout);
    assert!(out.contains("export LD_LIBRARY_PATH="), "{out}");
    assert!(out.contains("export LD_PRELOAD="), "{out}");
    assert!(!out.contains("DAT_OVERRIDE"), "{out}");
}

#[test]
fn no_command_is_a_usage_error() {
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    let o = softrdma(d.path(), &[]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn sockets_preload_counts_a_real_programs_connections() {
    // The real preload library, built next to this test binary's softrdma.
    let bin = std::path::PathBuf::from(env!("CARGO_BIN_EXE_softrdma"));
    let dir = bin.parent().unwrap();
    if !dir.join("libsoftrdma_preload.so").exists() {
        // `cargo test` builds no cdylib for another crate's tests.
        let release = dir.file_name().is_some_and(|n| n == "release");
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "softrdma-preload"])
            .env("CARGO_TARGET_DIR", dir.parent().unwrap());
        if release {
            c.arg("--release");
        }
        assert!(
            c.status().unwrap().success(),
            "cargo build -p softrdma-preload"
        );
    }
    if Command::new("python3").arg("-V").output().is_err() {
        println!("SKIPPED: no python3");
        return;
    }
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut v = Vec::new();
        std::io::Read::read_to_end(&mut s, &mut v).unwrap();
        v
    });
    let stats = tempfile::tempdir().unwrap();
    let file = stats.path().join("s.jsonl");
    let o = Command::new(&bin)
        .args(["run", "--no-verbs", "--no-dat", "--sockets", "--sockets-policy", "tcp", "--"])
        .args(["python3", "-c"])
        .arg(format!(
            "import socket; s=socket.create_connection(('127.0.0.1',{port})); s.sendall(b'hi'); s.close()"
        ))
        .env("SOFTRDMA_SOCKETS_STATS", &file)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(t.join().unwrap(), b"hi");
    let line = std::fs::read_to_string(&file).unwrap();
    assert!(line.contains("\"plain\":1"), "{line}");
    assert!(line.contains("\"policy\":1"), "{line}");
}

/// `softrdma` carries its own unwinder: starting it maps no
/// `libgcc_s.so.1` (whose constructor runs `cpuid`s), one library fewer
/// for every program `softrdma run` starts.
#[test]
fn the_softrdma_executable_loads_no_unwinder_library() {
    if option_env!("SOFTRDMA_UNWINDER_LINKED_IN").is_none() {
        println!("SKIPPED: no libgcc_eh.a to link the unwinder from");
        return;
    }
    // glibc's loader lists the libraries it maps and runs nothing.
    let out = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .env("LD_TRACE_LOADED_OBJECTS", "1")
        .output()
        .unwrap();
    let libs = text(&out.stdout);
    assert!(libs.contains("libc.so"), "{libs}");
    assert!(!libs.contains("libgcc_s"), "{libs}");
}

/// `softrdma run ARGS -- /usr/bin/env -0` in an environment of exactly
/// `vars`: the variables the program saw, in order.
fn child_env(lib_dir: &Path, args: &[&str], vars: &[(&str, &std::ffi::OsStr)]) -> Vec<Vec<u8>> {
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("run")
        .arg("--lib-dir")
        .arg(lib_dir)
        .args(args)
        .args(["--", "/usr/bin/env", "-0"])
        .env_clear()
        .envs(vars.iter().copied())
        .output()
        .expect("run softrdma");
    assert!(o.status.success(), "{}", text(&o.stderr));
    o.stdout
        .split(|b| *b == 0)
        .filter(|v| !v.is_empty())
        .map(<[u8]>::to_vec)
        .collect()
}

/// The program gets the environment of `softrdma run` with only the
/// variables of its layers set, every other one (odd bytes included)
/// passed as it was.
#[test]
fn the_program_sees_the_environment_with_only_the_layers_variables_changed() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let d = fake_libs(&[
        "libsoftrdma_verbs.so",
        "libsoftrdma_dapl.so",
        "libsoftrdma_preload.so",
    ]);
    let dir = d.path().canonicalize().unwrap();
    let dir = dir.to_str().unwrap();
    let vars: [(&str, &OsStr); 5] = [
        ("HOME", OsStr::new("/home/x")),
        ("ODD", OsStr::from_bytes(b"a\xffb c=d")),
        ("LD_PRELOAD", OsStr::new("/old.so")),
        ("LD_LIBRARY_PATH", OsStr::new("/old/lib")),
        ("EMPTY", OsStr::new("")),
    ];
    let sorted = |mut v: Vec<Vec<u8>>| {
        v.sort();
        v
    };
    let want = |extra: &[String]| {
        let mut v: Vec<Vec<u8>> = vars
            .iter()
            .filter(|(k, _)| !extra.iter().any(|e| e.starts_with(&format!("{k}="))))
            .map(|(k, v)| [k.as_bytes(), b"=", v.as_bytes()].concat())
            .collect();
        v.extend(extra.iter().map(|e| e.as_bytes().to_vec()));
        sorted(v)
    };
    let got = child_env(
        d.path(),
        &[
            "--no-verbs",
            "--no-dat",
            "--sockets",
            "--sockets-policy",
            "tcp",
        ],
        &vars,
    );
    assert_eq!(
        sorted(got),
        want(&[
            format!("LD_PRELOAD={dir}/libsoftrdma_preload.so:/old.so"),
            "SOFTRDMA_SOCKETS=tcp".into(),
        ])
    );
    let got = child_env(d.path(), &["--ia-addr", "192.0.2.5"], &vars);
    assert_eq!(
        sorted(got),
        want(&[
            format!("LD_LIBRARY_PATH={dir}/softrdma-run:/old/lib"),
            format!("DAT_OVERRIDE={dir}/softrdma-run/dat-192.0.2.5.conf"),
            "SOFTRDMA_IA_ADDR=192.0.2.5".into(),
        ])
    );
}

/// An argument that is not UTF-8 reaches the program unchanged (the
/// argument list was read as UTF-8 strings, which panicked), and the other
/// subcommands take one as their parser does.
#[test]
fn run_passes_a_non_utf8_argument_through() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    let odd = OsStr::from_bytes(b"a\xffb");
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("run")
        .arg("--lib-dir")
        .arg(d.path())
        .args(["--", "printf", "%s"])
        .arg(odd)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert_eq!(o.stdout, b"a\xffb");
    let o = Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .arg("dissect")
        .arg(odd)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(text(&o.stderr).starts_with("softrdma dissect: error:"));
}

/// Whether `tool --version` runs.
fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The `LD_LIBRARY_PATH` that `softrdma run --print-env` printed.
fn printed_library_path(out: &str) -> String {
    let line = out
        .lines()
        .find_map(|l| l.strip_prefix("export LD_LIBRARY_PATH="))
        .unwrap_or_else(|| panic!("no LD_LIBRARY_PATH in {out}"));
    line.trim_matches('\'').to_string()
}

/// Run `sh -c script` in a new user and mount namespace (`unshare -rm`)
/// with `$SOFTRDMA` the executable, `$D` the library directory, `$T` the
/// temporary directory; `None` when namespaces cannot be made here.
fn in_namespace(script: &str, lib_dir: &Path, tmp: &Path) -> Option<Output> {
    if !have("unshare") {
        return None;
    }
    let probe = Command::new("unshare").args(["-rm", "true"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        return None;
    }
    let o = Command::new("unshare")
        .args(["-rm", "sh", "-c", script])
        .env("SOFTRDMA", env!("CARGO_BIN_EXE_softrdma"))
        .env("D", lib_dir)
        .env("T", tmp)
        .env("TMPDIR", tmp)
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("run unshare");
    Some(o)
}

/// Runs `script` in new user and mount namespaces (`in_namespace`) and
/// returns the private directory `softrdma run` printed, checked to be
/// under `tmp` (the fallback); `None` (the test skipped) without
/// `unshare -rm`.
fn fallen_back_under(script: &str, libs: &Path, tmp: &Path) -> Option<String> {
    let Some(o) = in_namespace(script, libs, tmp) else {
        println!("SKIPPED: no unshare -rm (user and mount namespaces)");
        return None;
    };
    assert!(o.status.success(), "{}", text(&o.stderr));
    let path = printed_library_path(&text(&o.stdout));
    assert!(path.starts_with(&*tmp.to_string_lossy()), "{path}");
    Some(path)
}

/// A library directory on a read-only mount (an installed tree; made here
/// with a read-only bind mount, which stops root too): the private
/// directory goes to the temporary directory.
#[test]
fn a_read_only_mount_puts_the_private_directory_under_tmp() {
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    let t = tempfile::tempdir().unwrap();
    let script = r#"mount --bind "$D" "$D" && mount -o remount,bind,ro "$D" &&
        "$SOFTRDMA" run --lib-dir "$D" --print-env"#;
    let Some(path) = fallen_back_under(script, d.path(), t.path()) else {
        return;
    };
    assert!(!d.path().join("softrdma-run").exists());
    let rd = Path::new(&path);
    assert_eq!(
        std::fs::read_link(rd.join("libibverbs.so.1")).unwrap(),
        d.path()
            .canonicalize()
            .unwrap()
            .join("libsoftrdma_verbs.so")
    );
}

/// The library directory passes the permission check but writing in it
/// fails (here a full file system: no inodes left; the same for a quota,
/// or a security module's rules): the private directory is made again in
/// the temporary directory instead of the run failing.
#[test]
fn a_full_library_directory_falls_back_to_tmp() {
    let d = tempfile::tempdir().unwrap();
    let t = tempfile::tempdir().unwrap();
    let script = r#"mount -t tmpfs -o size=64k,nr_inodes=16 softrdma-test "$D" &&
        echo stand-in > "$D/libsoftrdma_verbs.so" && mkdir "$D/softrdma-run" &&
        i=0 && while touch "$D/fill$i" 2>/dev/null; do i=$((i+1)); done &&
        "$SOFTRDMA" run --lib-dir "$D" --print-env"#;
    // Checked there: it ran, and the private directory is under `t`.
    let _ = fallen_back_under(script, d.path(), t.path());
}

/// `softrdma run --lib-dir LIBS --print-env` as root with the effective
/// user 65534 (`setpriv --euid`), `XDG_RUNTIME_DIR` set to `runtime` or
/// unset: checks that it ran and that the private directory is 65534's,
/// outside `libs` (the fallback), and removes it. `false` (the test
/// skipped) without root, `setpriv`, or an executable other users can
/// reach.
fn falls_back_as_another_user(libs: &Path, runtime: Option<&Path>) -> bool {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() || !have("setpriv") {
        println!("SKIPPED: needs root and setpriv");
        return false;
    }
    let exe = Path::new(env!("CARGO_BIN_EXE_softrdma"));
    let reachable = exe
        .ancestors()
        .skip(1)
        .all(|a| std::fs::metadata(a).is_ok_and(|m| m.permissions().mode() & 0o001 != 0));
    if !reachable {
        println!("SKIPPED: the executable's directory is closed to other users");
        return false;
    }
    let mut cmd = Command::new("setpriv");
    cmd.arg("--euid=65534")
        .arg(exe)
        .args(["run", "--lib-dir"])
        .arg(libs)
        .arg("--print-env")
        .env_remove("LD_LIBRARY_PATH");
    match runtime {
        Some(r) => cmd.env("XDG_RUNTIME_DIR", r),
        None => cmd.env_remove("XDG_RUNTIME_DIR"),
    };
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let path = printed_library_path(&text(&o.stdout));
    let rd = Path::new(&path);
    // Under the temporary directory (glibc drops TMPDIR for a program whose
    // users differ), named by the effective user.
    assert!(
        rd.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with("softrdma-run-65534-"),
        "{path}"
    );
    assert!(!rd.starts_with(libs), "{path}");
    std::fs::remove_dir_all(rd).unwrap();
    true
}

/// A library directory (mode 0755, its private directory made already)
/// that root can write and the effective user 65534 cannot.
fn libs_root_can_write() -> tempfile::TempDir {
    use std::os::unix::fs::PermissionsExt;
    let d = fake_libs(&["libsoftrdma_verbs.so"]);
    std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::create_dir(d.path().join("softrdma-run")).unwrap();
    d
}

/// `access(2)` checks the real user: a program whose effective user
/// cannot write the library directory (setuid, `setpriv --euid`) was told
/// it could, and failed with "Permission denied" making the links.
#[test]
fn the_writable_check_uses_the_effective_user_not_the_real_one() {
    let d = libs_root_can_write();
    falls_back_as_another_user(d.path(), None);
}

/// A runtime directory the effective user cannot write was a hard error
/// ("Permission denied") instead of falling back to the temporary
/// directory.
#[test]
fn an_unwritable_xdg_runtime_dir_falls_back_to_tmp() {
    use std::os::unix::fs::PermissionsExt;
    if !nix::unistd::geteuid().is_root() {
        println!("SKIPPED: needs root");
        return;
    }
    let d = libs_root_can_write();
    // The effective user's own runtime directory, but read-only to it.
    let runtime = d.path().join("runtime");
    std::fs::create_dir(&runtime).unwrap();
    std::os::unix::fs::chown(&runtime, Some(65534), Some(65534)).unwrap();
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o500)).unwrap();
    falls_back_as_another_user(d.path(), Some(&runtime));
}
