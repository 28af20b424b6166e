//! Replays the committed seed corpus of the protocol core's fuzz targets
//! (`fuzz/fuzz_targets/core_rx.rs`, `core_pair.rs`) through the same
//! functions, on the stable toolchain, so CI runs them without cargo-fuzz.
//! A crash the fuzzer finds becomes a regression test by adding its input
//! to `fuzz/seeds/<target>/` (where every fuzz target keeps its seeds).

use std::path::Path;

fn replay(target: &str, f: fn(&[u8]) -> Result<(), String>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/seeds")
        .join(target);
    let mut n = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        let data = std::fs::read(&path).expect("seed file");
        if let Err(e) = f(&data) {
            panic!("{} failed:\n{e}", path.display());
        }
        n += 1;
    }
    assert!(n >= 5, "{target}: only {n} seeds");
}

#[test]
fn core_rx_seeds() {
    replay("core_rx", softrdma_proto::sim::fuzz_rx);
}

#[test]
fn core_pair_seeds() {
    replay("core_pair", softrdma_proto::sim::fuzz_pair);
}

/// The pair seeds reach the one-pass receive (counted in builds with
/// debug assertions).
#[test]
fn core_pair_seeds_reach_the_one_pass() {
    if !cfg!(debug_assertions) {
        return;
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/core_pair");
    let mut taken = 0;
    for e in std::fs::read_dir(&dir).expect("seed directory") {
        let path = e.expect("directory entry").path();
        let data = std::fs::read(&path).expect("seed file");
        let n = softrdma_proto::sim::fuzz_pair_stats(&data)
            .expect("a seed passes")
            .one_pass_recvs;
        eprintln!("{}: {n} in one pass", path.display());
        taken += n;
    }
    assert!(taken > 0, "no seed receives in one pass");
}
