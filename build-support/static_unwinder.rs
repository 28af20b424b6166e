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
/// linker (rustc passes `--as-needed`) leaves it out. The archive has to
/// come *before* std's `-lgcc_s` on the command line: GNU ld decides
/// whether an `--as-needed` library is needed at its place in the command
/// line, so an archive given after it (as a plain link argument is) leaves
/// `libgcc_s.so.1` in the binary's `NEEDED` list; lld decides at the end.
/// A `rustc-link-lib` library (see `link_static_unwinder`) is placed with
/// the crate's own native libraries, before std's.
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
    let out = Command::new(c_compiler())
        .arg("-print-file-name=libgcc_eh.a")
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    (out.status.success() && path.is_absolute() && path.is_file()).then_some(path)
}

/// The C compiler asked: `$RUSTC_LINKER`, else `cc` (the linker rustc
/// runs by default).
fn c_compiler() -> String {
    std::env::var("RUSTC_LINKER").unwrap_or_else(|_| "cc".into())
}

/// Where `cc` is a plain name, the file `PATH` resolves it to (the first
/// executable match), else the path itself.
fn resolved_c_compiler() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let cc = PathBuf::from(c_compiler());
    if cc.components().count() > 1 {
        return cc.is_file().then_some(cc);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(&cc))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// Tell cargo to link the unwinder archive in whole into every binary of
/// the package (executables, test harnesses, the shared library), and to
/// run the build script again when the archive moves or another compiler
/// would be asked.
fn link_static_unwinder() {
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    // The compiler `PATH` finds, not `PATH` itself (which differs between
    // an editor and a shell, and would rebuild the crate at each switch):
    // replaced or upgraded, it is asked again. A different `PATH` that
    // finds another compiler first is not seen (`cargo clean -p` then).
    if let Some(cc) = resolved_c_compiler() {
        println!("cargo:rerun-if-changed={}", cc.display());
    }
    let Some(archive) = static_unwinder() else {
        return;
    };
    // A C compiler upgrade removes the archive: cargo then sees it changed
    // and runs this again instead of linking a path that is gone.
    println!("cargo:rerun-if-changed={}", archive.display());
    let Some(dir) = archive.parent() else {
        return;
    };
    println!("cargo:rustc-link-search=native={}", dir.display());
    // `+whole-archive`: every member (nothing in the crate calls the
    // unwinder directly, std does); `-bundle`: the `rlib` of a library
    // crate names the archive for the final link instead of copying it.
    println!("cargo:rustc-link-lib=static:+whole-archive,-bundle=gcc_eh");
    // For the tests that check it.
    println!("cargo:rustc-env=SOFTRDMA_UNWINDER_LINKED_IN=1");
}
