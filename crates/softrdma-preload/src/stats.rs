//! Per-process connection counts and the JSON line written at exit
//! (`SOFTRDMA_SOCKETS_STATS=FILE`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a connection stayed plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum PlainReason {
    /// The policy said `tcp`.
    Policy,
    /// The peer does not run sockets direct (no UDP twin answered).
    PeerNotCapable,
    /// The peer's listener runs sockets direct but declined.
    PeerDeclined,
    /// Accepted: the client did not ask for offload.
    ClientPlain,
    /// The listener has no capability twin (its UDP port was taken).
    NoTwin,
    /// The switch into sockets direct failed.
    SetupFailed,
    /// A forked child of a process whose engine runs: it cannot switch.
    EngineInherited,
}

impl PlainReason {
    pub(crate) fn key(self) -> &'static str {
        match self {
            PlainReason::Policy => "policy",
            PlainReason::PeerNotCapable => "peer not capable",
            PlainReason::PeerDeclined => "peer declined",
            PlainReason::ClientPlain => "client did not ask for offload",
            PlainReason::NoTwin => "no capability twin",
            PlainReason::SetupFailed => "offload setup failed",
            PlainReason::EngineInherited => "engine inherited across fork",
        }
    }
}

/// Every reason, in the order of their slots.
const REASONS: [PlainReason; 7] = [
    PlainReason::Policy,
    PlainReason::PeerNotCapable,
    PlainReason::PeerDeclined,
    PlainReason::ClientPlain,
    PlainReason::NoTwin,
    PlainReason::SetupFailed,
    PlainReason::EngineInherited,
];

/// Panics in the library's code in this process (see [`quiet_panics`]):
/// global, as the hook that counts them may run before the state exists.
static PANICS: AtomicU64 = AtomicU64::new(0);

/// Keeps the library's panics out of the application's stderr: the hook
/// (of the library's own copy of std: the application's panics, if it has
/// any, are not seen by it) counts them for the stats line, keeps the
/// first one's place, thread and message, and prints nothing for the
/// application's threads unless `print` (`SOFTRDMA_SOCKETS_PANICS=print`:
/// std's default hook runs too); on the library's own threads (named
/// `softrdma-…`) one line.
/// Every entry point catches its panics, and the library's threads are not
/// to panic, but a caught panic is printed by std's default hook all the
/// same, and a thread's would be printed as it ends.
pub(crate) fn quiet_panics(print: bool) {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::Relaxed);
        // The first one's place, thread and message, for the stats line:
        // the only trace a quiet panic leaves. Built before the lock, and
        // `try_lock`: never wait in a hook.
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        let at = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let thread = std::thread::current();
        let message = format!(
            "{at} in thread {}: {what}",
            thread.name().unwrap_or("(unnamed)")
        );
        if let Ok(mut first) = FIRST_PANIC.try_lock()
            && first.is_none()
        {
            *first = Some(message.clone());
        }
        if print {
            default(info);
        } else if thread.name().is_some_and(|n| n.starts_with("softrdma-")) {
            // On one of the library's own threads (the engine's, the
            // twin's, the flusher's, the reaper's): a thread that ends here
            // may leave the application waiting, and an abort leaves no
            // stats line; one line says where. Panics caught at the entry
            // points, on the application's threads, stay quiet.
            eprintln!("softrdma: panic: {message}");
        }
    }));
}

/// The first panic's place and message since the start (or the fork).
static FIRST_PANIC: std::sync::Mutex<Option<String>> = std::sync::Mutex::new(None);

/// The first panic's place and message, if one was counted.
pub(crate) fn first_panic() -> Option<String> {
    FIRST_PANIC.try_lock().ok().and_then(|g| g.clone())
}

/// The panics counted since the start (or the fork) of this process.
pub(crate) fn panics() -> u64 {
    PANICS.load(Ordering::Relaxed)
}

/// Forgets the panics counted (a forked child reports only its own).
#[cfg_attr(test, allow(dead_code))]
pub(crate) fn reset_panics() {
    PANICS.store(0, Ordering::Relaxed);
    // A forked child: a lock held by a thread that is not there stays
    // held, and the parent's message with it (the count says none).
    if let Ok(mut first) = FIRST_PANIC.try_lock() {
        *first = None;
    }
}

/// The counts of one process. Atomics only: a forked child resets them
/// while a lock could be held by a thread that does not exist there.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    offloaded: AtomicU64,
    plain: AtomicU64,
    refused: AtomicU64,
    reasons: [AtomicU64; REASONS.len()],
}

/// A copy of the counts.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Counts {
    pub(crate) offloaded: u64,
    pub(crate) plain: u64,
    pub(crate) refused: u64,
    /// Panics in the library's code (see [`quiet_panics`]; not a count
    /// of [`Stats`]: set from [`panics`]).
    pub(crate) panics: u64,
    /// The first panic's place and message (`file:line: message`).
    pub(crate) first_panic: Option<String>,
    pub(crate) reasons: BTreeMap<&'static str, u64>,
}

impl Stats {
    pub(crate) fn plain(&self, why: PlainReason) {
        self.plain.fetch_add(1, Ordering::Relaxed);
        let slot = REASONS.iter().position(|r| *r == why).unwrap_or(0);
        self.reasons[slot].fetch_add(1, Ordering::Relaxed);
    }

    /// A connection switched into sockets direct.
    pub(crate) fn offloaded(&self) {
        self.offloaded.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection refused because the policy required offload.
    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Ordering::Relaxed);
    }

    /// Forget everything (a forked child reports only its own connections).
    pub(crate) fn reset(&self) {
        for a in [&self.offloaded, &self.plain, &self.refused]
            .into_iter()
            .chain(&self.reasons)
        {
            a.store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn snapshot(&self) -> Counts {
        Counts {
            offloaded: self.offloaded.load(Ordering::Relaxed),
            plain: self.plain.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
            panics: 0,
            first_panic: None,
            reasons: REASONS
                .iter()
                .zip(&self.reasons)
                .map(|(r, n)| (r.key(), n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect(),
        }
    }
}

/// The JSON line for `pid`/`exe` (no trailing newline); `panics` and the
/// first one's place and message (`panic`) only when there were any.
pub(crate) fn json_line(pid: u32, exe: &str, c: &Counts) -> String {
    let reasons: Vec<String> = c
        .reasons
        .iter()
        .map(|(k, v)| format!("{}:{v}", json_str(k)))
        .collect();
    let panics = if c.panics > 0 {
        let first = c
            .first_panic
            .as_deref()
            .map(|m| format!(",\"panic\":{}", json_str(m)))
            .unwrap_or_default();
        format!(",\"panics\":{}{first}", c.panics)
    } else {
        String::new()
    };
    format!(
        "{{\"pid\":{pid},\"exe\":{},\"offloaded\":{},\"plain\":{},\"refused\":{}{panics},\"reasons\":{{{}}}}}",
        json_str(exe),
        c.offloaded,
        c.plain,
        c.refused,
        reasons.join(",")
    )
}

fn json_str(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for ch in s.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_line_counts_and_escapes() {
        let s = Stats::default();
        s.plain(PlainReason::Policy);
        s.plain(PlainReason::PeerNotCapable);
        s.offloaded();
        s.plain(PlainReason::Policy);
        s.refused();
        let line = json_line(42, "/usr/bin/a \"b\"", &s.snapshot());
        assert_eq!(
            line,
            "{\"pid\":42,\"exe\":\"/usr/bin/a \\\"b\\\"\",\"offloaded\":1,\"plain\":3,\"refused\":1,\"reasons\":{\"peer not capable\":1,\"policy\":2}}"
        );
        s.reset();
        assert_eq!(s.snapshot(), Counts::default());
    }

    /// What the child run of [`the_librarys_panics_print_nothing_unless_asked`]
    /// does (nothing in a normal run): installs the hook as the library's
    /// load does, panics in a named thread and prints the first panic.
    #[test]
    fn panic_child() {
        let Some(mode) = std::env::var_os(CHILD) else {
            return;
        };
        quiet_panics(mode == "print");
        let ended = std::thread::Builder::new()
            .name("app-thread".into())
            .spawn(|| panic!("the child's panic"))
            .unwrap()
            .join();
        let caught = std::panic::catch_unwind(|| panic!("a caught one"));
        let library = std::thread::Builder::new()
            .name("softrdma-test".into())
            .spawn(|| panic!("the library thread's panic"))
            .unwrap()
            .join();
        assert!(ended.is_err() && caught.is_err() && library.is_err());
        println!(
            "COUNT {} FIRST {}",
            panics(),
            first_panic().unwrap_or_default()
        );
    }

    const CHILD: &str = "SOFTRDMA_PRELOAD_TEST_PANIC_CHILD";

    /// A panic of the library's code on an application's thread, caught or
    /// ending the thread, prints nothing into the application's stderr
    /// (std's default hook did), unless asked; one on the library's own
    /// threads prints one line; all are counted, with the first one's
    /// place, thread and message. Run in a child process of this test binary: the
    /// hook is the whole process's.
    #[test]
    fn the_librarys_panics_print_nothing_unless_asked() {
        let exe = std::env::current_exe().unwrap();
        for (mode, printed) in [("quiet", false), ("print", true)] {
            let out = std::process::Command::new(&exe)
                .args(["--exact", "stats::tests::panic_child", "--nocapture"])
                .env(CHILD, mode)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{mode}: {stdout}\n{stderr}");
            assert_eq!(
                stderr.contains("the child's panic"),
                printed,
                "{mode}: stderr {stderr}"
            );
            // The library's own thread: one line either way.
            assert!(
                stderr.contains("the library thread's panic"),
                "{mode}: stderr {stderr}"
            );
            assert!(
                stdout.contains("COUNT 3 FIRST ")
                    && stdout.contains("stats.rs:")
                    && stdout.contains(" in thread app-thread: the child's panic"),
                "{mode}: stdout {stdout}"
            );
        }
        let c = Counts {
            panics: 2,
            first_panic: Some("src/twin.rs:9 in thread t: \"x\"".into()),
            ..Counts::default()
        };
        assert_eq!(
            json_line(1, "x", &c),
            "{\"pid\":1,\"exe\":\"x\",\"offloaded\":0,\"plain\":0,\"refused\":0,\"panics\":2,\"panic\":\"src/twin.rs:9 in thread t: \\\"x\\\"\",\"reasons\":{}}"
        );
    }
}
