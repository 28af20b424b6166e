// Shared by the build scripts of `softrdma-cli` and `softrdma-preload`
// (`include!`d: a build script cannot depend on a workspace crate).

use std::path::PathBuf;
use std::process::Command;

/// The C compiler's `libgcc_eh.a` (the unwinder that `libgcc_s.so.1` also
/// holds), when building for this Linux/glibc host with a C compiler that
/// has it.
///
/// Rust's standard library on `*-linux-gnu` links its unwinder
/// dynamically: every process that runs the executable, or that the
/// preload library is loaded into, then loads `libgcc_s.so.1` (most C
/// programs do not), whose constructor asks the CPU for its features
/// (`cpuid`, slow in a virtual machine).
/// Linked in whole from the archive, the unwinder is defined in the
/// binary itself: nothing is left for `libgcc_s.so.1` to supply, and the
/// linker (rustc passes `--as-needed`) leaves it out. A linker that keeps
/// it listed anyway (GNU ld decides at the library's place on the command
/// line) still makes a working binary that uses its own copy.
/// In the preload library the unwinder's symbols stay local (rustc's
/// version script exports only the interposed functions), so a program's
/// own unwinder (C++ exceptions) is untouched.
fn static_unwinder() -> Option<PathBuf> {
    let var = |k: &str| std::env::var(k).unwrap_or_default();
    if var("CARGO_CFG_TARGET_OS") != "linux"
        || var("CARGO_CFG_TARGET_ENV") != "gnu"
        || var("TARGET") != var("HOST")
        || var("CARGO_CFG_TARGET_FEATURE")
            .split(',')
            .any(|f| f == "crt-static")
    {
        return None;
    }
    let cc = std::env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".into());
    let out = Command::new(cc)
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}
