//! `softrdma run -- CMD ARGS...`: run an unmodified program over softrdma.
//!
//! Three C libraries let programs that were never written for softrdma use
//! it; this subcommand puts them in front of the program and then `exec`s
//! it (same PID, signals and exit status pass straight through):
//!
//! | layer | artifact (next to `softrdma`) | how the program finds it |
//! | --- | --- | --- |
//! | drop-in verbs | `libsoftrdma_verbs.so` | symlinked as `libibverbs.so.1`, `librdmacm.so.1` (and the vendor stubs perftest links) into a private directory put first in `LD_LIBRARY_PATH` |
//! | DAT provider | `libsoftrdma_dapl.so` | a generated `dat.conf` naming the IAs `softrdma-lo` (127.0.0.1) and `softrdma0`, selected with `DAT_OVERRIDE` |
//! | sockets preload | `libsoftrdma_preload.so` | `LD_PRELOAD` (only with `--sockets`) |
//!
//! The libraries are looked for in `--lib-dir`, else `$SOFTRDMA_LIB_DIR`,
//! else the directory of the `softrdma` executable itself, so the command
//! works right after `cargo build --release` (`target/release/softrdma run
//! -- ...`). Verbs and DAT are on by default when their library is there
//! (`--verbs` / `--dat` insist on it, `--no-verbs` / `--no-dat` leave it
//! out); the preload is only used with `--sockets`.
//!
//! The private directory, made only when the verbs libraries or the DAT
//! provider are in, is `<lib dir>/softrdma-run/` when this user can write
//! there, else `softrdma-run-<uid>-<hash of the lib dir>` in
//! `$XDG_RUNTIME_DIR` (when set) or the system temporary directory. That
//! one is made with mode 0700 and used only if it is a directory owned by
//! the effective user that no one else can write (another user could
//! otherwise make it first and choose the libraries the program loads).
//! Links and files in it are replaced atomically (rename), so concurrent
//! runs are safe.

use std::ffi::{OsStr, OsString};
use std::fmt::Write as _;
use std::io;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// The drop-in verbs libraries: (name the program loads, artifact it is).
pub const VERBS_LINKS: &[(&str, &str)] = &[
    ("libibverbs.so.1", VERBS_ARTIFACT),
    ("librdmacm.so.1", VERBS_ARTIFACT),
    ("libmlx5.so.1", VERBS_ARTIFACT),
    ("libefa.so.1", VERBS_ARTIFACT),
];
/// The cargo artifact of the drop-in verbs libraries.
pub const VERBS_ARTIFACT: &str = "libsoftrdma_verbs.so";
/// The cargo artifact of the DAT provider that `libdat2` loads.
pub const DAT_ARTIFACT: &str = "libsoftrdma_dapl.so";
/// The cargo artifact of the sockets preload library.
pub const PRELOAD_ARTIFACT: &str = "libsoftrdma_preload.so";
/// The DAT IA name bound to 127.0.0.1.
pub const DAT_IA_LOOPBACK: &str = "softrdma-lo";
/// The DAT IA name bound to `SOFTRDMA_IA_ADDR` (or the host's address).
pub const DAT_IA_HOST: &str = "softrdma0";
/// Environment variable naming the host IA's IPv4 address.
pub const IA_ADDR_VAR: &str = "SOFTRDMA_IA_ADDR";
/// Environment variable naming the directory holding the libraries.
pub const LIB_DIR_VAR: &str = "SOFTRDMA_LIB_DIR";

/// Whether a layer is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Use {
    /// When its library is present.
    #[default]
    IfPresent,
    /// Required: an error if its library is missing.
    Required,
    /// Not used.
    Off,
}

/// What `softrdma run` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// The drop-in verbs libraries.
    pub verbs: Use,
    /// The DAT provider.
    pub dat: Use,
    /// The sockets preload library (off unless asked for).
    pub sockets: bool,
    /// The preload's policy (`auto`, `offload`, `tcp`), passed as
    /// `SOFTRDMA_SOCKETS`; unset: the library's default (auto).
    pub sockets_policy: Option<String>,
    /// Where the libraries are (default: `$SOFTRDMA_LIB_DIR`, then the
    /// executable's directory).
    pub lib_dir: Option<PathBuf>,
    /// The address of the `softrdma0` IA (default: `$SOFTRDMA_IA_ADDR`, then
    /// the first non-loopback IPv4 address, then 127.0.0.1).
    pub ia_addr: Option<Ipv4Addr>,
}

/// Why `softrdma run` could not prepare the environment.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RunError {
    /// A layer asked for explicitly has no library.
    #[error(
        "{what} requested but {artifact} is not in {dir} (build it with `cargo build --release`, or point --lib-dir / {LIB_DIR_VAR} at it)"
    )]
    Missing {
        /// The layer.
        what: &'static str,
        /// The file looked for.
        artifact: &'static str,
        /// Where.
        dir: PathBuf,
    },
    /// Nothing to put in front of the program.
    #[error(
        "no softrdma libraries in {0} ({VERBS_ARTIFACT}, {DAT_ARTIFACT}, {PRELOAD_ARTIFACT}): build them with `cargo build --release`, or point --lib-dir / {LIB_DIR_VAR} at them"
    )]
    NothingFound(PathBuf),
    /// `SOFTRDMA_IA_ADDR` is not an IPv4 address.
    #[error("{IA_ADDR_VAR}={0:?} is not an IPv4 address")]
    BadIaAddr(String),
    /// The library directory could not be determined.
    #[error("cannot find the directory of the softrdma executable: {0}")]
    NoExeDir(#[source] io::Error),
    /// The private directory under the temporary directory exists but is
    /// not this user's alone.
    #[error(
        "refusing to use {path}: {why}; another user may control what it holds (remove it, or point --lib-dir / {LIB_DIR_VAR} at a directory you can write)"
    )]
    NotPrivate {
        /// The directory.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The private directory or a file in it could not be written.
    #[error("preparing {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// The prepared environment: variables to set for the program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Prepared {
    /// Variables to set, in order.
    pub vars: Vec<(&'static str, OsString)>,
    /// The private directory (links and `dat.conf`); none when neither
    /// the verbs libraries nor the DAT provider are in.
    pub run_dir: Option<PathBuf>,
    /// Which layers are in: verbs, DAT, sockets.
    pub layers: Vec<&'static str>,
}

/// Resolve the library directory: the option, `$SOFTRDMA_LIB_DIR`, the
/// executable's directory.
/// A given directory is made absolute and free of symbolic links when it
/// exists (the links made to its libraries must not depend on the working
/// directory).
pub fn lib_dir(opt: Option<&Path>) -> Result<PathBuf, RunError> {
    lib_dir_in(opt, |k| std::env::var_os(k))
}

/// [`lib_dir`] with `env` reading the variables.
fn lib_dir_in(
    opt: Option<&Path>,
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<PathBuf, RunError> {
    let given = opt.map(Path::to_path_buf).or_else(|| {
        env(LIB_DIR_VAR)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from)
    });
    match given {
        Some(d) => Ok(d.canonicalize().unwrap_or(d)),
        None => exe_dir(),
    }
}

/// The directory of the running executable. The kernel's
/// `/proc/self/exe` is already an absolute path without symbolic links or
/// `..` (what `canonicalize` would make of it).
fn exe_dir() -> Result<PathBuf, RunError> {
    let exe = std::env::current_exe().map_err(RunError::NoExeDir)?;
    exe.parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| RunError::NoExeDir(io::Error::other("the executable has no parent")))
}

/// The `softrdma0` IA's address: the option, `$SOFTRDMA_IA_ADDR`, the first
/// non-loopback IPv4 address of the host, 127.0.0.1.
pub fn ia_addr(opt: Option<Ipv4Addr>) -> Result<Ipv4Addr, RunError> {
    if let Some(a) = opt {
        return Ok(a);
    }
    if let Some(v) = std::env::var_os(IA_ADDR_VAR).filter(|v| !v.is_empty()) {
        let s = v.to_string_lossy().into_owned();
        return s.trim().parse().map_err(|_| RunError::BadIaAddr(s));
    }
    Ok(first_host_ipv4().unwrap_or(Ipv4Addr::LOCALHOST))
}

/// The first non-loopback, specified IPv4 address of the host's
/// interfaces (`getifaddrs(3)`), by interface name, then address.
pub fn first_host_ipv4() -> Option<Ipv4Addr> {
    let mut addrs: Vec<(String, Ipv4Addr)> = nix::ifaddrs::getifaddrs()
        .ok()?
        .filter_map(|i| {
            let a = i.address?.as_sockaddr_in()?.ip();
            (!a.is_loopback() && !a.is_unspecified()).then_some((i.interface_name, a))
        })
        .collect();
    // Stable choice: by interface name, then address.
    addrs.sort();
    addrs.first().map(|(_, a)| *a)
}

/// The `dat.conf` naming the softrdma IAs for `provider` (an absolute path).
/// Format of each line (libdat2's static registry): IA name, API version,
/// thread safety, default, library, provider version, IA parameters
/// (`"<IPv4 address> 0"`), platform parameters.
pub fn dat_conf(provider: &Path, host: Ipv4Addr) -> String {
    let lib = quote_dat(&provider.to_string_lossy());
    let mut s = String::from("# Generated by `softrdma run`: the softrdma DAT IAs.\n");
    for (name, addr) in [(DAT_IA_LOOPBACK, Ipv4Addr::LOCALHOST), (DAT_IA_HOST, host)] {
        let _ = writeln!(
            s,
            "{name} u2.0 nonthreadsafe default {lib} dapl.2.0 \"{addr} 0\" \"\""
        );
    }
    s
}

/// Quote a `dat.conf` field if it has whitespace or quotes (the parser's
/// escapes are `\\` and `\"` inside double quotes).
fn quote_dat(field: &str) -> String {
    if field
        .chars()
        .any(|c| c.is_whitespace() || c == '"' || c == '\\')
    {
        let esc = field.replace('\\', "\\\\").replace('"', "\\\"");
        format!("\"{esc}\"")
    } else {
        field.to_string()
    }
}

/// Prepend `dir` to a colon-separated search path variable's old value.
fn prepend_path(dir: &Path, old: Option<OsString>) -> OsString {
    let mut v = dir.as_os_str().to_os_string();
    if let Some(old) = old.filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

/// The private directories to try, in order, when the library directory
/// cannot be written: one per effective user and library directory, in
/// `$XDG_RUNTIME_DIR` (when it is an absolute directory owned by the
/// effective user and writable by no one else, as the XDG base directory
/// specification requires), then in the temporary directory.
fn fallback_run_dirs(lib_dir: &Path, env: &impl Fn(&str) -> Option<OsString>) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in lib_dir.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let uid = nix::unistd::geteuid();
    let runtime = env("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .filter(|d| d.is_absolute())
        .filter(|d| {
            std::fs::metadata(d)
                .is_ok_and(|m| m.is_dir() && m.uid() == uid.as_raw() && m.mode() & 0o022 == 0)
        });
    runtime
        .into_iter()
        .chain([std::env::temp_dir()])
        .map(|base| base.join(format!("softrdma-run-{uid}-{h:016x}")))
        .collect()
}

/// Make (mode 0700) or open the directory `dir` in a directory that others
/// can write, and check it is this user's alone: a directory (not a link),
/// owned by the effective user, writable by no one else, in a directory
/// owned by the effective user or root and, if others can write that, with
/// the sticky bit set (else another user could rename `dir` away and put
/// their own in its place).
fn private_dir(dir: &Path) -> Result<(), RunError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let io = |source| RunError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let euid = nix::unistd::geteuid().as_raw();
    let parent = dir.parent().unwrap_or(Path::new("/"));
    let p = std::fs::metadata(parent).map_err(|source| RunError::Io {
        path: parent.to_path_buf(),
        source,
    })?;
    let parent_why = if p.uid() != euid && p.uid() != 0 {
        Some(format!(
            "its directory {} is owned by uid {}, not {euid} or root",
            parent.display(),
            p.uid()
        ))
    } else if p.mode() & 0o022 != 0 && p.mode() & 0o1000 == 0 {
        Some(format!(
            "its directory {} (mode {:o}) lets others write in it without the sticky bit",
            parent.display(),
            p.mode() & 0o7777
        ))
    } else {
        None
    };
    if let Some(why) = parent_why {
        return Err(RunError::NotPrivate {
            path: dir.to_path_buf(),
            why,
        });
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => return Err(io(e)),
        _ => {}
    }
    let m = std::fs::symlink_metadata(dir).map_err(io)?;
    let why = if !m.file_type().is_dir() {
        Some("it is not a directory".to_string())
    } else if m.uid() != euid {
        Some(format!("it is owned by uid {}, not {euid}", m.uid()))
    } else if m.mode() & 0o022 != 0 {
        Some(format!(
            "its mode {:o} lets others write in it",
            m.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(RunError::NotPrivate {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Whether the effective user can make files in `dir`: one
/// `faccessat(AT_EACCESS)` (write and search permission, a read-only or
/// immutable file system). Not seen: a full disk or quota, or a security
/// module's rules; [`falls_back`] covers those.
fn writable(dir: &Path) -> bool {
    use nix::fcntl::{AT_FDCWD, AtFlags};
    use nix::unistd::{AccessFlags, faccessat};
    faccessat(
        AT_FDCWD,
        dir,
        AccessFlags::W_OK | AccessFlags::X_OK,
        AtFlags::AT_EACCESS,
    )
    .is_ok()
}

/// Whether preparing the library directory's private directory failed in
/// a way the temporary directory may not (permission, a read-only file
/// system, no space or quota left).
fn falls_back(e: &RunError) -> bool {
    use nix::errno::Errno;
    let RunError::Io { source, .. } = e else {
        return false;
    };
    source.raw_os_error().is_some_and(|n| {
        [
            Errno::EACCES,
            Errno::EPERM,
            Errno::EROFS,
            Errno::ENOSPC,
            Errno::EDQUOT,
        ]
        .contains(&Errno::from_raw(n))
    })
}

/// Make `dir/name` a symlink to `target`, atomically replacing what is there
/// unless it already points at `target`.
fn link(dir: &Path, name: &str, target: &Path) -> Result<(), RunError> {
    let path = dir.join(name);
    if std::fs::read_link(&path).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let io = |source| RunError::Io {
        path: path.clone(),
        source,
    };
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)
}

/// Write `dir/name` atomically unless it already has `contents`.
fn write_file(dir: &Path, name: &str, contents: &str) -> Result<PathBuf, RunError> {
    let path = dir.join(name);
    if std::fs::read_to_string(&path).is_ok_and(|c| c == contents) {
        return Ok(path);
    }
    let tmp = dir.join(format!(".{name}.{}", std::process::id()));
    let io = |source| RunError::Io {
        path: path.clone(),
        source,
    };
    std::fs::write(&tmp, contents).map_err(io)?;
    std::fs::rename(&tmp, &path).map_err(io)?;
    Ok(path)
}

/// Whether a layer is in, given its library's presence.
fn wanted(
    u: Use,
    what: &'static str,
    artifact: &'static str,
    dir: &Path,
) -> Result<bool, RunError> {
    if u == Use::Off {
        return Ok(false);
    }
    let present = dir.join(artifact).is_file();
    match u {
        Use::Off => Ok(false),
        Use::IfPresent => Ok(present),
        Use::Required if present => Ok(true),
        Use::Required => Err(RunError::Missing {
            what,
            artifact,
            dir: dir.to_path_buf(),
        }),
    }
}

/// Prepare the private directory and the variables for the program.
/// `env` reads the current value of a variable (so tests can pass their own).
pub fn prepare(
    opts: &RunOptions,
    env: impl Fn(&str) -> Option<OsString>,
) -> Result<Prepared, RunError> {
    let dir = lib_dir_in(opts.lib_dir.as_deref(), &env)?;
    let verbs = wanted(opts.verbs, "--verbs", VERBS_ARTIFACT, &dir)?;
    let dat = wanted(opts.dat, "--dat", DAT_ARTIFACT, &dir)?;
    let sockets = wanted(
        if opts.sockets {
            Use::Required
        } else {
            Use::Off
        },
        "--sockets",
        PRELOAD_ARTIFACT,
        &dir,
    )?;
    if !(verbs || dat || sockets) {
        return Err(RunError::NothingFound(dir));
    }
    let addr = if dat {
        Some(ia_addr(opts.ia_addr)?)
    } else {
        None
    };
    // Only the verbs links and the DAT configuration go there.
    let fill = |rd: &Path| -> Result<Vec<(&'static str, OsString)>, RunError> {
        let mut vars = Vec::new();
        if verbs {
            for (name, artifact) in VERBS_LINKS {
                link(rd, name, &dir.join(artifact))?;
            }
            vars.push(("LD_LIBRARY_PATH", prepend_path(rd, env("LD_LIBRARY_PATH"))));
        }
        if let Some(addr) = addr {
            let conf = write_file(
                rd,
                &format!("dat-{addr}.conf"),
                &dat_conf(&dir.join(DAT_ARTIFACT), addr),
            )?;
            vars.push(("DAT_OVERRIDE", conf.into_os_string()));
            vars.push((IA_ADDR_VAR, OsString::from(addr.to_string())));
        }
        Ok(vars)
    };
    let (mut vars, rd) = if verbs || dat {
        let preferred = dir.join("softrdma-run");
        let done = if std::fs::create_dir_all(&preferred).is_ok() && writable(&preferred) {
            match fill(&preferred) {
                Ok(vars) => Some(vars),
                Err(e) if falls_back(&e) => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        match done {
            Some(vars) => (vars, Some(preferred)),
            None => {
                // The runtime directory, then the temporary directory if
                // the runtime directory cannot be written.
                let mut dirs = fallback_run_dirs(&dir, &env).into_iter().peekable();
                loop {
                    let rd = dirs.next().expect("the temporary directory is last");
                    match private_dir(&rd).and_then(|()| fill(&rd)) {
                        Ok(vars) => break (vars, Some(rd)),
                        Err(e) if falls_back(&e) && dirs.peek().is_some() => {}
                        Err(e) => return Err(e),
                    }
                }
            }
        }
    } else {
        (Vec::new(), None)
    };
    let mut layers = Vec::new();
    if verbs {
        layers.push("verbs");
    }
    if dat {
        layers.push("dat");
    }
    if sockets {
        let lib = dir.join(PRELOAD_ARTIFACT);
        let mut v = lib.into_os_string();
        if let Some(old) = env("LD_PRELOAD").filter(|o| !o.is_empty()) {
            v.push(":");
            v.push(old);
        }
        vars.push(("LD_PRELOAD", v));
        if let Some(p) = &opts.sockets_policy {
            vars.push(("SOFTRDMA_SOCKETS", OsString::from(p)));
        }
        layers.push("sockets");
    }
    Ok(Prepared {
        vars,
        run_dir: rd,
        layers,
    })
}

/// Shell-quote a value for `--print-env` (single quotes).
pub fn shell_quote(v: &OsStr) -> String {
    let s = v.to_string_lossy();
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "/._-:=,+@%".contains(c))
    {
        s.into_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_libs(names: &[&str]) -> tempfile::TempDir {
        let d = tempfile::tempdir().unwrap();
        for n in names {
            std::fs::write(d.path().join(n), b"not really a library").unwrap();
        }
        d
    }

    #[test]
    fn dat_conf_has_both_ias_in_libdat2_format() {
        let c = dat_conf(
            Path::new("/x/libsoftrdma_dapl.so"),
            Ipv4Addr::new(10, 1, 2, 3),
        );
        let lines: Vec<&str> = c.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            lines,
            [
                "softrdma-lo u2.0 nonthreadsafe default /x/libsoftrdma_dapl.so dapl.2.0 \"127.0.0.1 0\" \"\"",
                "softrdma0 u2.0 nonthreadsafe default /x/libsoftrdma_dapl.so dapl.2.0 \"10.1.2.3 0\" \"\"",
            ]
        );
    }

    #[test]
    fn dat_conf_quotes_a_path_with_spaces() {
        let c = dat_conf(Path::new("/my libs/a\"b.so"), Ipv4Addr::LOCALHOST);
        assert!(c.contains(" \"/my libs/a\\\"b.so\" dapl.2.0"), "{c}");
    }

    #[test]
    fn verbs_links_point_at_the_artifact_and_path_comes_first() {
        let d = fake_libs(&[VERBS_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            ..Default::default()
        };
        let p = prepare(&opts, |k| {
            (k == "LD_LIBRARY_PATH").then(|| OsString::from("/old"))
        })
        .unwrap();
        assert_eq!(p.layers, ["verbs"]);
        let dir = d.path().canonicalize().unwrap();
        let rd = p.run_dir.clone().unwrap();
        assert_eq!(rd, dir.join("softrdma-run"));
        for (name, artifact) in VERBS_LINKS {
            assert_eq!(
                std::fs::read_link(rd.join(name)).unwrap(),
                dir.join(artifact)
            );
        }
        let want = format!("{}:/old", rd.display());
        assert_eq!(p.vars, [("LD_LIBRARY_PATH", OsString::from(want))]);
        // A second run reuses the links.
        let again = prepare(&opts, |_| None).unwrap();
        assert_eq!(again.run_dir, p.run_dir);
    }

    #[test]
    fn dat_layer_writes_the_conf_and_sets_dat_override() {
        let d = fake_libs(&[DAT_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            ia_addr: Some(Ipv4Addr::new(192, 0, 2, 7)),
            ..Default::default()
        };
        let p = prepare(&opts, |_| None).unwrap();
        assert_eq!(p.layers, ["dat"]);
        let conf = &p.vars[0];
        assert_eq!(conf.0, "DAT_OVERRIDE");
        let text = std::fs::read_to_string(&conf.1).unwrap();
        assert!(text.contains("softrdma0 u2.0 nonthreadsafe default"));
        assert!(text.contains("\"192.0.2.7 0\""));
        assert_eq!(p.vars[1], (IA_ADDR_VAR, OsString::from("192.0.2.7")));
    }

    #[test]
    fn a_required_layer_without_its_library_is_an_error() {
        let d = fake_libs(&[DAT_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            verbs: Use::Required,
            ..Default::default()
        };
        let e = prepare(&opts, |_| None).unwrap_err();
        assert!(matches!(
            e,
            RunError::Missing {
                artifact: VERBS_ARTIFACT,
                ..
            }
        ));
        assert!(e.to_string().contains("cargo build --release"));
    }

    #[test]
    fn nothing_present_is_an_error_and_sockets_is_opt_in() {
        let d = fake_libs(&[PRELOAD_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            ..Default::default()
        };
        assert!(matches!(
            prepare(&opts, |_| None),
            Err(RunError::NothingFound(_))
        ));
        let opts = RunOptions {
            sockets: true,
            sockets_policy: Some("tcp".into()),
            ..opts
        };
        let p = prepare(&opts, |k| (k == "LD_PRELOAD").then(|| "/a.so".into())).unwrap();
        assert_eq!(p.layers, ["sockets"]);
        let v = p.vars[0].1.to_string_lossy().into_owned();
        assert!(v.ends_with("libsoftrdma_preload.so:/a.so"), "{v}");
        assert_eq!(p.vars[1], ("SOFTRDMA_SOCKETS", OsString::from("tcp")));
    }

    #[test]
    fn the_sockets_layer_alone_makes_no_private_directory() {
        let d = fake_libs(&[VERBS_ARTIFACT, DAT_ARTIFACT, PRELOAD_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            verbs: Use::Off,
            dat: Use::Off,
            sockets: true,
            ..Default::default()
        };
        let p = prepare(&opts, |_| None).unwrap();
        assert_eq!(p.layers, ["sockets"]);
        assert_eq!(p.run_dir, None);
        let lib = d.path().canonicalize().unwrap().join(PRELOAD_ARTIFACT);
        assert_eq!(p.vars, [("LD_PRELOAD", lib.into_os_string())]);
        assert!(!d.path().join("softrdma-run").exists());
    }

    #[test]
    fn a_read_only_library_directory_puts_the_private_directory_under_tmp() {
        use std::os::unix::fs::PermissionsExt;
        let d = fake_libs(&[VERBS_ARTIFACT]);
        let set = |mode| {
            std::fs::set_permissions(d.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        };
        set(0o555);
        if std::fs::write(d.path().join("x"), b"").is_ok() {
            // Permissions do not stop this user (root).
            set(0o755);
            // (`tests/run.rs` makes a read-only mount for that case.)
            println!("SKIPPED: the directory is writable anyway");
            return;
        }
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            ..Default::default()
        };
        let p = prepare(&opts, |_| None);
        set(0o755);
        let rd = p.unwrap().run_dir.unwrap();
        assert!(rd.starts_with(std::env::temp_dir()), "{}", rd.display());
        assert_eq!(
            std::fs::read_link(rd.join("libibverbs.so.1")).unwrap(),
            d.path().canonicalize().unwrap().join(VERBS_ARTIFACT)
        );
        std::fs::remove_dir_all(rd).unwrap();
    }

    /// A library directory where the private directory cannot be made
    /// (here `softrdma-run` is a file: works for root too), with
    /// `XDG_RUNTIME_DIR` at `runtime`.
    fn unwritable_lib_dir(runtime: &Path) -> (tempfile::TempDir, RunOptions, PathBuf) {
        let d = fake_libs(&[VERBS_ARTIFACT, "softrdma-run"]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            ..Default::default()
        };
        let dir = d.path().canonicalize().unwrap();
        let env = |k: &str| (k == "XDG_RUNTIME_DIR").then(|| runtime.into());
        let rd = fallback_run_dirs(&dir, &env).remove(0);
        (d, opts, rd)
    }

    #[test]
    fn the_fallback_directory_is_private_named_by_uid_and_in_the_runtime_directory() {
        use std::os::unix::fs::MetadataExt;
        let runtime = tempfile::tempdir().unwrap();
        let (_d, opts, rd) = unwritable_lib_dir(runtime.path());
        let p = prepare(&opts, |k| {
            (k == "XDG_RUNTIME_DIR").then(|| runtime.path().into())
        })
        .unwrap();
        assert_eq!(p.run_dir.as_deref(), Some(&*rd));
        assert_eq!(rd.parent(), Some(runtime.path()));
        let uid = nix::unistd::geteuid().as_raw();
        let name = rd.file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with(&format!("softrdma-run-{uid}-")), "{name}");
        let m = std::fs::symlink_metadata(&rd).unwrap();
        assert_eq!((m.uid(), m.mode() & 0o777), (uid, 0o700));
        // The next run opens it again.
        prepare(&opts, |k| {
            (k == "XDG_RUNTIME_DIR").then(|| runtime.path().into())
        })
        .unwrap();
    }

    /// Another local user could make the (predictable) directory under
    /// `/tmp` first and so choose the libraries the program loads: one
    /// that others can write, that is a link, or (as root) that another
    /// user owns is refused.
    #[test]
    fn a_fallback_directory_another_user_could_control_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let runtime = tempfile::tempdir().unwrap();
        let env = |k: &str| (k == "XDG_RUNTIME_DIR").then(|| runtime.path().into());
        let (_d, opts, rd) = unwritable_lib_dir(runtime.path());
        let refused = |why: &str| {
            let e = prepare(&opts, env).unwrap_err();
            assert!(matches!(e, RunError::NotPrivate { .. }), "{e}");
            assert!(e.to_string().contains(why), "{e}");
            assert!(std::fs::read_link(rd.join("libibverbs.so.1")).is_err());
        };
        // Writable by others.
        std::fs::create_dir(&rd).unwrap();
        std::fs::set_permissions(&rd, std::fs::Permissions::from_mode(0o777)).unwrap();
        refused("mode 777");
        std::fs::set_permissions(&rd, std::fs::Permissions::from_mode(0o730)).unwrap();
        refused("mode 730");
        std::fs::remove_dir(&rd).unwrap();
        // A link (to a directory of this user's, even).
        let elsewhere = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), &rd).unwrap();
        refused("not a directory");
        std::fs::remove_file(&rd).unwrap();
        // Owned by another user (only root can give it away).
        std::fs::create_dir(&rd).unwrap();
        std::fs::set_permissions(&rd, std::fs::Permissions::from_mode(0o700)).unwrap();
        if std::os::unix::fs::chown(&rd, Some(65534), Some(65534)).is_ok() {
            refused("owned by uid 65534");
        } else {
            println!("SKIPPED (the other owner): not allowed to chown");
        }
    }

    #[test]
    fn the_library_directory_comes_from_the_environment_before_the_executable() {
        let d = fake_libs(&[PRELOAD_ARTIFACT]);
        let opts = RunOptions {
            sockets: true,
            ..Default::default()
        };
        let p = prepare(&opts, |k| (k == LIB_DIR_VAR).then(|| d.path().into())).unwrap();
        let lib = d.path().canonicalize().unwrap().join(PRELOAD_ARTIFACT);
        assert_eq!(p.vars, [("LD_PRELOAD", lib.into_os_string())]);
    }

    #[test]
    fn off_leaves_a_present_layer_out() {
        let d = fake_libs(&[VERBS_ARTIFACT, DAT_ARTIFACT]);
        let opts = RunOptions {
            lib_dir: Some(d.path().into()),
            verbs: Use::Off,
            ia_addr: Some(Ipv4Addr::LOCALHOST),
            ..Default::default()
        };
        let p = prepare(&opts, |_| None).unwrap();
        assert_eq!(p.layers, ["dat"]);
    }

    #[test]
    fn the_host_address_is_a_local_non_loopback_ipv4_address() {
        let Some(a) = first_host_ipv4() else {
            println!("SKIPPED: the host has no IPv4 address but loopback");
            return;
        };
        assert!(!a.is_loopback() && !a.is_unspecified(), "{a}");
        // Only an address of this host can be bound.
        std::net::UdpSocket::bind((a, 0)).unwrap();
    }

    #[test]
    fn shell_quote_quotes_only_when_needed() {
        assert_eq!(shell_quote(OsStr::new("/a/b:c")), "/a/b:c");
        assert_eq!(shell_quote(OsStr::new("a b")), "'a b'");
        assert_eq!(shell_quote(OsStr::new("it's")), "'it'\\''s'");
    }

    /// `$XDG_RUNTIME_DIR` was used if it was any absolute directory: one
    /// kept by `sudo -E` or `su` that another user owns (or can write) let
    /// them swap the private directory for their own.
    #[test]
    fn an_xdg_runtime_dir_another_user_owns_or_can_write_is_not_used() {
        use std::os::unix::fs::PermissionsExt;
        let runtime = tempfile::tempdir().unwrap();
        let env = |k: &str| (k == "XDG_RUNTIME_DIR").then(|| runtime.path().into());
        let lib = Path::new("/lib/dir");
        // Owned by this user, 0700: used first.
        let dirs = fallback_run_dirs(lib, &env);
        assert_eq!(dirs.len(), 2);
        assert_eq!(dirs[0].parent(), Some(runtime.path()));
        assert_eq!(dirs[1].parent(), Some(&*std::env::temp_dir()));
        // Writable by others: not used.
        std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        assert_eq!(fallback_run_dirs(lib, &env), [dirs[1].clone()]);
        if nix::unistd::geteuid().is_root() {
            // Another user's, 0700: not used.
            std::fs::set_permissions(runtime.path(), std::fs::Permissions::from_mode(0o700))
                .unwrap();
            std::os::unix::fs::chown(runtime.path(), Some(65534), Some(65534)).unwrap();
            assert_eq!(fallback_run_dirs(lib, &env), [dirs[1].clone()]);
        } else {
            println!("SKIPPED (the other user's directory): needs root");
        }
    }

    /// Only the private directory itself was checked: in a directory
    /// another user owns, or one others can write without the sticky bit,
    /// they could rename it away and put their own in its place.
    #[test]
    fn a_private_dir_whose_parent_another_user_can_swap_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let parent = tempfile::tempdir().unwrap();
        let dir = parent.path().join("softrdma-run-x");
        let mode = |m| {
            std::fs::set_permissions(parent.path(), std::fs::Permissions::from_mode(m)).unwrap();
        };
        mode(0o777);
        let e = private_dir(&dir).unwrap_err();
        assert!(matches!(e, RunError::NotPrivate { .. }), "{e}");
        assert!(e.to_string().contains("sticky"), "{e}");
        assert!(!dir.exists());
        mode(0o1777);
        private_dir(&dir).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        if nix::unistd::geteuid().is_root() {
            mode(0o700);
            std::os::unix::fs::chown(parent.path(), Some(65534), Some(65534)).unwrap();
            let e = private_dir(&dir).unwrap_err();
            assert!(matches!(e, RunError::NotPrivate { .. }), "{e}");
            assert!(e.to_string().contains("owned by uid 65534"), "{e}");
            assert!(!dir.exists());
        } else {
            println!("SKIPPED (another user's directory): needs root");
        }
    }
}
