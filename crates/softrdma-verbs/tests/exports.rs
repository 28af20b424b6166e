//! The export list (`abi/symbols.txt`, `abi/nodes.txt`) is what the library
//! exports, and covers every `ibv_*`/`rdma_*`/vendor symbol the target
//! programs import, with the same version node; the installed programs
//! load with every symbol and version resolved.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Command;

fn manifest(p: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(p)).expect("read")
}

/// name -> (node, kind)
fn symbols() -> HashMap<String, (String, String)> {
    manifest("abi/symbols.txt")
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[0].to_string(), (f[1].to_string(), f[2].to_string()))
        })
        .collect()
}

#[test]
fn every_listed_symbol_is_exported() {
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(common::library())
        .output()
        .expect("nm");
    let text = String::from_utf8_lossy(&out.stdout);
    let exported: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .map(|s| s.split('@').next().unwrap_or(s))
        .collect();
    let missing: Vec<_> = symbols()
        .into_keys()
        .filter(|s| !exported.contains(s.as_str()))
        .collect();
    assert!(missing.is_empty(), "listed but not exported: {missing:?}");
}

#[test]
fn every_version_node_is_defined() {
    let out = Command::new("readelf")
        .args(["-V", "-W"])
        .arg(common::library())
        .output()
        .expect("readelf");
    let text = String::from_utf8_lossy(&out.stdout);
    let defs = text
        .split("Version definition section")
        .nth(1)
        .expect("a version definition section")
        .split("Version needs section")
        .next()
        .unwrap_or("");
    for node in manifest("abi/nodes.txt").lines().filter(|l| !l.is_empty()) {
        assert!(
            defs.contains(&format!("Name: {node}\n")) || defs.contains(&format!("Name: {node} ")),
            "version node {node} not defined"
        );
    }
    for n in [
        "IBVERBS_1.1",
        "IBVERBS_1.14",
        "IBVERBS_1.18",
        "IBVERBS_PRIVATE_34",
        "RDMACM_1.3",
        "MLX5_1.21",
        "EFA_1.2",
    ] {
        assert!(
            manifest("abi/nodes.txt").lines().any(|l| l == n),
            "{n} in nodes.txt"
        );
    }
}

#[test]
fn imports_of_the_target_programs_are_listed_with_their_node() {
    let syms = symbols();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("abi/imports");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("abi/imports") {
        let path = entry.expect("entry").path();
        for line in std::fs::read_to_string(&path).expect("read").lines() {
            // "(NODE) name"
            let Some((node, name)) = line.trim().split_once(' ') else {
                continue;
            };
            let node = node.trim_matches(|c| c == '(' || c == ')');
            if name.starts_with("umad_") {
                continue; // libibumad, not ours
            }
            let got = syms.get(name).map(|(n, _)| n.as_str());
            assert_eq!(
                got,
                Some(node),
                "{name} imported by {} as {node}",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 100, "only {checked} imports checked");
}

#[test]
fn the_data_path_and_connection_calls_are_implemented_not_stubbed() {
    let syms = symbols();
    for s in [
        "ibv_get_device_list",
        "ibv_open_device",
        "ibv_reg_mr",
        "ibv_reg_mr_iova2",
        "ibv_create_cq",
        "ibv_create_qp",
        "ibv_get_cq_event",
        "ibv_qp_to_qp_ex",
        "_ibv_query_gid_ex",
        "rdma_connect",
        "rdma_accept",
        "rdma_listen",
        "rdma_get_cm_event",
        "rdma_create_qp_ex",
        "rdma_getaddrinfo",
    ] {
        assert_eq!(syms[s].1, "impl", "{s}");
    }
}

#[test]
fn installed_programs_load_with_every_symbol_and_version() {
    let programs: Vec<_> = [
        "ibv_devinfo",
        "rping",
        "ib_write_bw",
        "ib_send_lat",
        "qperf",
    ]
    .into_iter()
    .map(|p| Path::new("/usr/bin").join(p))
    .filter(|p| p.exists())
    .collect();
    if programs.is_empty() {
        eprintln!(
            "SKIP: no rdma-core programs installed (apt-get install ibverbs-utils rdmacm-utils perftest qperf)"
        );
        return;
    }
    let dir = common::drop_in_dir("ldd");
    for p in programs {
        let out = Command::new("ldd")
            .arg("-r")
            .arg(&p)
            .env("LD_LIBRARY_PATH", &dir)
            .output()
            .expect("ldd");
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(
            !text.contains("not found")
                && !text.contains("undefined symbol")
                && !text.contains("no version information"),
            "{}:\n{text}",
            p.display()
        );
        // One file serves both names: the first one loaded appears.
        assert!(
            text.contains(&format!(".so.1 => {}", dir.display())),
            "{}:\n{text}",
            p.display()
        );
        for real in ["libibverbs.so.1 => /", "librdmacm.so.1 => /"] {
            for line in text.lines().filter(|l| l.contains(real)) {
                assert!(
                    line.contains(&dir.display().to_string()),
                    "{}: the real library loads: {line}",
                    p.display()
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
