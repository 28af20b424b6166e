//! Helpers shared by the integration tests: the built library, a directory
//! of the drop-in names, the C compiler.

#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// `target/<profile>/` of this test run.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // target/<profile>/deps/<test>-<hash>
    exe.parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf()
}

/// The built cdylib.
pub fn library() -> PathBuf {
    let lib = target_dir().join("libsoftrdma_verbs.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
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
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let out = target_dir().join(format!("verbs-c-{name}-{}", std::process::id()));
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
