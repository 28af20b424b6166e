//! Helpers shared by the integration tests: the built library, a directory
//! of the drop-in names, the C compiler.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

/// The cdylib's file name.
const ARTIFACT: &str = "libsoftrdma_verbs.so";

/// `target/<profile>/` of this test run.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// The newest modification time among the files the library is built
/// from (sources, build script, export lists, manifest).
fn sources_mtime() -> SystemTime {
    fn walk(p: &Path, newest: &mut SystemTime) {
        let Ok(md) = std::fs::metadata(p) else { return };
        if md.is_dir() {
            for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
                walk(&e.path(), newest);
            }
        } else if let Ok(m) = md.modified() {
            *newest = (*newest).max(m);
        }
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut newest = SystemTime::UNIX_EPOCH;
    for p in ["src", "abi", "build.rs", "Cargo.toml"] {
        walk(&root.join(p), &mut newest);
    }
    newest
}

/// `lib` if it exists and is at least as new as the sources.
fn fresh(lib: PathBuf, sources: SystemTime) -> Option<PathBuf> {
    let m = std::fs::metadata(&lib).ok()?.modified().ok()?;
    (m >= sources).then_some(lib)
}

/// The built cdylib, up to date with the sources.
///
/// `cargo test` compiles the library with both of its crate types in one
/// `rustc` run (the rlib the tests link and the cdylib), but leaves the
/// cdylib in `target/<profile>/deps/` (only `cargo build` copies it up to
/// `target/<profile>/`). That file is used when it is current; else the
/// one `cargo build` left; else the library is built here with a nested
/// `cargo build -p softrdma-verbs` in a target directory of its own
/// (`target/verbs-tests/`), so it neither waits on nor replaces the
/// artifacts of the cargo that runs the tests.
pub fn library() -> PathBuf {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let dir = target_dir();
        let sources = sources_mtime();
        if let Some(lib) = fresh(dir.join("deps").join(ARTIFACT), sources)
            .or_else(|| fresh(dir.join(ARTIFACT), sources))
        {
            return lib;
        }
        let release = dir.file_name().is_some_and(|n| n == "release");
        let nested = dir.parent().expect("target root").join("verbs-tests");
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "softrdma-verbs"])
            .arg("--manifest-path")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml"))
            .env("CARGO_TARGET_DIR", &nested);
        if release {
            c.arg("--release");
        }
        let st = c.status().expect("run cargo build");
        assert!(st.success(), "cargo build -p softrdma-verbs failed");
        let lib = nested
            .join(if release { "release" } else { "debug" })
            .join(ARTIFACT);
        fresh(lib.clone(), sources)
            .unwrap_or_else(|| panic!("{} not built or older than the sources", lib.display()))
    })
    .clone()
}

/// A directory with the drop-in names linked to the library.
pub fn drop_in_dir(tag: &str) -> PathBuf {
    let dir = target_dir().join(format!("verbs-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    for name in [
        "libibverbs.so.1",
        "librdmacm.so.1",
        "libmlx5.so.1",
        "libefa.so.1",
    ] {
        std::os::unix::fs::symlink(library(), dir.join(name)).expect("symlink");
    }
    dir
}

/// Whether the rdma-core development headers are installed.
pub fn have_headers() -> bool {
    Path::new("/usr/include/infiniband/verbs.h").exists()
        && Path::new("/usr/include/rdma/rdma_cma.h").exists()
        && Command::new("cc").arg("--version").output().is_ok()
}

/// Compiles `tests/c/<name>.c` with `cc` (extra arguments after the
/// source) into the target directory; the executable's path.
pub fn compile(name: &str, extra: &[&str]) -> PathBuf {
    compile_as(name, name, extra)
}

/// [`compile`] into an executable named after `tag`, so that two tests
/// can run the same program at once.
#[allow(dead_code)]
pub fn compile_as(name: &str, tag: &str, extra: &[&str]) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = target_dir().join(format!("verbs-c-{tag}-{}", std::process::id()));
    let st = Command::new("cc")
        .args(["-O1", "-g", "-Wall", "-o"])
        .arg(&out)
        .arg(&src)
        .args(extra)
        .status()
        .expect("run cc");
    assert!(st.success(), "cc {} failed", src.display());
    out
}
