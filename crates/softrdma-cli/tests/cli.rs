//! End to end: the built `softrdma` binary on a real capture, text and
//! `--json`, and its error handling.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn softrdma(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_softrdma"))
        .args(args)
        .output()
        .expect("run softrdma")
}

fn capture(name: &str) -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/captures")
        .join(name);
    if p.exists() {
        Some(p)
    } else {
        println!("SKIPPED: {} not present", p.display());
        None
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

#[test]
fn text_output_on_rping() {
    let Some(p) = capture("rping.pcap") else {
        return;
    };
    let o = softrdma(&["dissect", p.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].contains("[0] a→b") && lines[0].contains("#4"));
    assert!(lines[0].contains("MPA Request rev 2 M=0 C=0 R=0 H=1, private data 4 bytes"));
    assert!(lines[1].contains("MPA Reply rev 2"));
    // First FPDU: frame 8, a Send on QN 0 MSN 1.
    assert!(lines[2].contains("#8 "), "{}", lines[2]);
    assert!(lines[2].contains("U QN 0 MSN 1 MO 0"));
    assert!(lines[2].contains("Send"));
    assert!(lines[2].contains("CRC not negotiated"));
    let fpdu_lines: Vec<&&str> = lines
        .iter()
        .filter(|l| l.contains("CRC not negotiated"))
        .collect();
    assert_eq!(fpdu_lines.len(), 70);
    let count = |s: &str| fpdu_lines.iter().filter(|l| l.contains(s)).count();
    assert_eq!(count("RDMA Read Request"), 10);
    assert_eq!(count("RDMA Read Response"), 10);
    assert!(out.contains("stream 0: 10.99.0.2:33428 (a) ↔ 10.99.0.2:7174 (b)"));
    assert!(out.contains("iWARP, CRC off"));
    assert!(out.contains("30 FPDUs: RDMA Read Response 10, Send 20"));
    assert!(out.contains("40 FPDUs: RDMA Read Request 10, RDMA Write 10, Send 20"));
    assert!(!out.contains("error:"));
    assert!(out.contains("decode errors 0"));
}

#[test]
fn json_output_on_rping_crc() {
    let Some(p) = capture("rping-crc-p2p.pcap") else {
        return;
    };
    let o = softrdma(&["dissect", "--json", p.to_str().unwrap()]);
    assert!(o.status.success());
    let objs: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let of = |t: &'static str| objs.iter().filter(move |v| v["type"] == t);
    assert_eq!(of("mpa").count(), 2);
    assert_eq!(of("fpdu").count(), 22);
    assert_eq!(of("summary").count(), 1);
    assert!(of("fpdu").all(|v| v["crc"]["status"] == "good"));
    let first = of("fpdu").next().unwrap();
    assert_eq!(first["frame"], 8);
    assert_eq!(first["dir"], "a->b");
    assert_eq!(first["src"], "10.99.0.2:41206");
    assert_eq!(first["opcode"], 0);
    assert_eq!(first["opcode_name"], "RDMA Write");
    assert_eq!(first["ddp"]["model"], "tagged");
    assert_eq!(first["ddp"]["stag"], 1);
    assert_eq!(first["payload_len"], 0);
    assert_eq!(first["crc"]["value"], 0xebd3_4c5f_u32);
    let req = of("mpa").next().unwrap();
    assert_eq!(
        req["raw_hex"],
        "4d504120494420526571204672616d65500200048001c001"
    );
    assert_eq!(req["ird_ord"]["a_peer_to_peer"], true);
    let s = of("summary").next().unwrap();
    assert_eq!(s["crc"], true);
    assert_eq!(s["a_to_b"]["crc_good"], 10);
    assert_eq!(s["b_to_a"]["opcodes"]["RDMA Read Request"], 3);
}

#[test]
fn summary_and_stream_filter() {
    let Some(p) = capture("ib_write_bw.pcap") else {
        return;
    };
    let p = p.to_str().unwrap();
    let o = softrdma(&["dissect", "--summary", p]);
    assert!(o.status.success());
    let out = stdout(&o);
    assert!(out.starts_with("stream 0:"));
    assert!(out.contains("stream 1:"));
    assert!(!out.contains("CRC not negotiated"), "no FPDU lines");
    let o = softrdma(&["dissect", "--stream", "1", "--json", p]);
    let objs: Vec<serde_json::Value> = stdout(&o)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(objs.iter().all(|v| v["stream"] == 1));
    assert_eq!(objs.iter().filter(|v| v["type"] == "fpdu").count(), 300);
    let o = softrdma(&["dissect", "--stream", "7", p]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no stream 7"));
}

#[test]
fn clear_errors() {
    let o = softrdma(&["dissect", "/nonexistent/x.pcap"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(e.contains("cannot read /nonexistent/x.pcap"), "{e}");

    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml");
    let o = softrdma(&["dissect", manifest]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a pcap or pcapng file"));

    // A pcap with an 802.11 link type.
    let dir = std::env::temp_dir().join(format!("softrdma-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let wifi = dir.join("wifi.pcap");
    let mut hdr = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0];
    hdr.extend_from_slice(&[0; 8]);
    hdr.extend_from_slice(&65535u32.to_le_bytes());
    hdr.extend_from_slice(&105u32.to_le_bytes());
    std::fs::write(&wifi, hdr).unwrap();
    let o = softrdma(&["dissect", wifi.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unsupported link type 105"));

    let o = softrdma(&["dissect"]);
    assert_eq!(o.status.code(), Some(2), "usage error from clap");
}
