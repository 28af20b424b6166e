//! Shared by the test binaries: running the built `softrdma` command and
//! reading its output, and the FPDU records of a dissection.

// Each test binary uses its own part of it.
#![allow(dead_code)]

use std::process::{Command, Output};

use softrdma_cli::dissect::{Dissection, FpduRecord, Record};

/// The built `softrdma` command.
pub(crate) fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
}

/// Runs `softrdma args` to the end; its status and output.
pub(crate) fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run softrdma")
}

/// Its stdout as text.
pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Its stderr as text.
pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A successful run's stdout, one JSON value a line.
pub(crate) fn json_rows(o: &Output) -> Vec<serde_json::Value> {
    assert!(o.status.success(), "{}", stderr(o));
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

/// The FPDU records of `d`, in order.
pub(crate) fn fpdus(d: &Dissection) -> Vec<&FpduRecord> {
    d.records
        .iter()
        .filter_map(|r| match r {
            Record::Fpdu(f) => Some(f),
            _ => None,
        })
        .collect()
}
