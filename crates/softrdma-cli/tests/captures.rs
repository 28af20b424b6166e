//! The dissector against Wireshark: every capture in `shared/captures` is
//! dissected and compared with the tshark decode stored beside it (`X.txt`).
//!
//! What tshark lists, and how we compare:
//!
//! * tshark shows a reassembled FPDU in the frame where its reassembly
//!   COMPLETES (the frame holding its last byte, the CRC field), and its
//!   "## FPDUs" list and opcode histogram count only the FIRST FPDU shown in
//!   each frame. We record both the frame where an FPDU starts (what
//!   `softrdma dissect` prints first) and the frame where it ends
//!   (`end_frame`), and compare tshark's per-frame view with our first FPDU
//!   per `end_frame`.
//! * Kernel siw writes the FPDU header and payload with one `sendmsg` and the
//!   4-byte CRC trailer with another. A large FPDU therefore appears as a
//!   1444-byte segment (2 + 1442-byte ULPDU) followed by a 4-byte segment
//!   holding only the CRC field (297 such pairs in ib_write_bw and in
//!   ib_send_bw); tshark lists those FPDUs under the 4-byte frame. When TCP
//!   coalesces the two writes the segment is 1448 (or 1260/1272) bytes: one
//!   FPDU plus its own trailer, never the start of a second FPDU. Small FPDUs
//!   (rping, control connections) fit in one segment with their trailer.
//! * The 32-byte segments of the ib_write_bw control connection (frames
//!   934-943, 5 per direction) are complete Send FPDUs: ULPDU length 26 =
//!   18-byte untagged DDP/RDMAP header + 8 bytes of perftest's end-of-test
//!   exchange, + 2 length + 4 CRC = 32. They need no special case.
//! * Our FULL per-FPDU counts are asserted separately. They equal tshark's
//!   per-frame counts in these captures because no frame completes (or
//!   starts) more than one FPDU, which the test checks rather than assumes.
//! * The CRC column holds the CRC field as stored; for the CRC-on capture
//!   (rping-crc-p2p) tshark verified it, and our own CRC32C must agree
//!   ("good") and read the same field value.
//! * "## MPA Request / Reply raw TCP payload" must match the MPA frames we
//!   found: frame number, sender port and bytes.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use softrdma_cli::capture::read_capture;
use softrdma_cli::decode::DdpInfo;
use softrdma_cli::dissect::{CrcStatus, Dir, FpduRecord, Record, dissect_capture};

use common::fpdus;

fn captures_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/captures");
    dir.is_dir().then_some(dir)
}

/// One line of tshark's "## FPDUs" section.
#[derive(Debug)]
struct TsharkFpdu {
    frame: u64,
    src_port: u16,
    ulpdu_len: u16,
    crc: u32,
    tagged: bool,
    last: bool,
    opcode: u8,
    /// STag, TO for tagged; QN, MSN, MO for untagged.
    fields: Vec<u64>,
}

#[derive(Debug, Default)]
struct Tshark {
    mpa_raw: Vec<(u64, u16, String)>,
    fpdus: Vec<TsharkFpdu>,
    total_frames: usize,
    histogram: BTreeMap<u8, usize>,
}

fn num(s: &str) -> u64 {
    match s.strip_prefix("0x") {
        Some(h) => u64::from_str_radix(h, 16).unwrap(),
        None => s.parse().unwrap(),
    }
}

fn parse_tshark(text: &str) -> Tshark {
    let mut t = Tshark::default();
    let mut section = "";
    for line in text.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            section = if h.starts_with("MPA Request / Reply raw") {
                "raw"
            } else if h.starts_with("FPDUs") {
                "fpdus"
            } else if h.starts_with("RDMAP opcode histogram") {
                "hist"
            } else {
                ""
            };
            continue;
        }
        if let Some(n) = line.strip_prefix("(FPDU frames in total: ") {
            t.total_frames = n.trim_end_matches(')').parse().unwrap();
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.is_empty() {
            continue;
        }
        match section {
            "raw" => t
                .mpa_raw
                .push((num(f[0]), num(f[2]) as u16, f[3].to_string())),
            "fpdus" => t.fpdus.push(TsharkFpdu {
                frame: num(f[0]),
                src_port: num(f[2]) as u16,
                ulpdu_len: num(f[5]) as u16,
                crc: num(f[6]) as u32,
                tagged: f[7] == "1",
                last: f[8] == "1",
                opcode: num(f[9]) as u8,
                fields: f[10..].iter().map(|s| num(s)).collect(),
            }),
            "hist" => {
                // "opcode 0x03: 12 frames"
                let op = num(f[1].trim_end_matches(':')) as u8;
                t.histogram.insert(op, f[2].parse().unwrap());
            }
            _ => {}
        }
    }
    t
}

fn check_capture(pcap: &Path) {
    let name = pcap.file_stem().unwrap().to_string_lossy().to_string();
    let txt = pcap.with_extension("txt");
    let tshark = parse_tshark(&std::fs::read_to_string(&txt).unwrap());
    let capture = read_capture(pcap).unwrap();
    let d = dissect_capture(&capture);
    let all = fpdus(&d);

    // No decode errors, no skipped frames, every stream understood as iWARP.
    let errors: Vec<_> = d
        .records
        .iter()
        .filter(|r| matches!(r, Record::Error(_)))
        .collect();
    assert!(errors.is_empty(), "{name}: decode errors {errors:?}");
    assert!(d.frame_notes.is_empty(), "{name}: {:?}", d.frame_notes);
    for s in &d.summaries {
        assert!(s.iwarp, "{name}: stream {} not recognised", s.stream);
        assert_eq!(s.a_to_b.undecoded_bytes + s.b_to_a.undecoded_bytes, 0);
    }

    // MPA Request/Reply raw bytes, frame and sender.
    let ours: Vec<(u64, u16, String)> = d
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Mpa(m) => Some((m.place.frame, m.place.src.port(), m.raw_hex.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(ours, tshark.mpa_raw, "{name}: MPA frames");

    // First FPDU per frame, as tshark counts.
    let mut first_per_frame: BTreeMap<u64, &FpduRecord> = BTreeMap::new();
    let mut per_frame_count: BTreeMap<u64, usize> = BTreeMap::new();
    let mut per_start_frame: BTreeMap<u64, usize> = BTreeMap::new();
    for f in &all {
        let e = first_per_frame.entry(f.end_frame).or_insert(f);
        if f.place.offset < e.place.offset {
            *e = f;
        }
        *per_frame_count.entry(f.end_frame).or_default() += 1;
        *per_start_frame.entry(f.place.frame).or_default() += 1;
    }
    assert_eq!(
        first_per_frame.len(),
        tshark.total_frames,
        "{name}: FPDU frames"
    );
    let mut hist: BTreeMap<u8, usize> = BTreeMap::new();
    for f in first_per_frame.values() {
        *hist.entry(f.opcode).or_default() += 1;
    }
    assert_eq!(hist, tshark.histogram, "{name}: per-frame opcode histogram");

    // Every FPDU tshark lists, field by field.
    for t in &tshark.fpdus {
        let f = first_per_frame
            .get(&t.frame)
            .unwrap_or_else(|| panic!("{name}: no FPDU in frame {}", t.frame));
        assert_eq!(f.place.src.port(), t.src_port, "{name} frame {}", t.frame);
        assert_eq!(f.ulpdu_len, t.ulpdu_len, "{name} frame {}", t.frame);
        assert_eq!(f.last, t.last, "{name} frame {}", t.frame);
        assert_eq!(f.opcode, t.opcode, "{name} frame {}", t.frame);
        match f.ddp {
            DdpInfo::Tagged { stag, to } => {
                assert!(t.tagged);
                assert_eq!(
                    t.fields,
                    vec![u64::from(stag), to],
                    "{name} frame {}",
                    t.frame
                );
            }
            DdpInfo::Untagged { qn, msn, mo } => {
                assert!(!t.tagged);
                assert_eq!(
                    t.fields,
                    vec![u64::from(qn), u64::from(msn), u64::from(mo)],
                    "{name} frame {}",
                    t.frame
                );
            }
        }
        let crc_on = d.summaries.iter().any(|s| s.crc == Some(true));
        match f.crc {
            CrcStatus::Good { value } => {
                assert!(crc_on);
                assert_eq!(value, t.crc, "{name} frame {}: stored CRC", t.frame);
            }
            CrcStatus::NotNegotiated { field } => {
                assert!(!crc_on);
                assert_eq!(field, t.crc, "{name} frame {}: CRC field", t.frame);
            }
            other => panic!("{name} frame {}: CRC {other:?}", t.frame),
        }
    }

    // Full per-FPDU counts. Equal to tshark's per-frame counts here because
    // no frame completes two FPDUs and none starts two (see the module
    // comment for why siw's segmentation gives that in these captures) ...
    assert!(
        per_frame_count.values().all(|&n| n == 1),
        "{name}: a frame completes several FPDUs; tshark would under-count"
    );
    assert!(
        per_start_frame.values().all(|&n| n == 1),
        "{name}: a frame starts several FPDUs"
    );
    assert_eq!(all.len(), tshark.total_frames, "{name}: all FPDUs");
    // ... and the FPDUs that span two frames are exactly those whose 4-byte
    // CRC trailer went out as its own segment.
    for f in &all {
        if f.end_frame != f.place.frame {
            let tail = &capture.frames[(f.end_frame - 1) as usize];
            let seg = softrdma_cli::capture::tcp_segment(tail).unwrap().unwrap();
            assert_eq!(seg.payload.len(), 4, "{name} frame {}", f.end_frame);
        }
    }
    let by_stream: usize = d
        .summaries
        .iter()
        .map(|s| (s.a_to_b.fpdus + s.b_to_a.fpdus) as usize)
        .sum();
    assert_eq!(by_stream, all.len());
    // CRC verdicts: all good when negotiated, never bad.
    for s in &d.summaries {
        let fp = s.a_to_b.fpdus + s.b_to_a.fpdus;
        let good = s.a_to_b.crc_good + s.b_to_a.crc_good;
        assert_eq!(s.a_to_b.crc_bad + s.b_to_a.crc_bad, 0, "{name}");
        match s.crc {
            Some(true) => assert_eq!(good, fp, "{name}: all CRCs good"),
            Some(false) => assert_eq!(good, 0),
            None => panic!("{name}: negotiation not found"),
        }
    }
    // FPDU frames are in order of time per direction.
    for dir in [Dir::AToB, Dir::BToA] {
        let frames: Vec<u64> = all
            .iter()
            .filter(|f| f.place.dir == dir)
            .map(|f| f.place.frame)
            .collect();
        assert!(frames.windows(2).all(|w| w[0] < w[1]), "{name}");
    }
}

#[test]
fn every_capture_matches_tshark() {
    let Some(dir) = captures_dir() else {
        println!(
            "SKIPPED: capture folder {} not present",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../../shared/captures")
                .display()
        );
        return;
    };
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "pcap") {
            assert!(
                path.with_extension("txt").exists(),
                "{} has no tshark decode beside it",
                path.display()
            );
            check_capture(&path);
            n += 1;
        }
    }
    assert!(n > 0, "no captures in {}", dir.display());
}

#[test]
fn crc_capture_negotiation_and_rtr() {
    let Some(dir) = captures_dir() else {
        println!("SKIPPED: capture folder not present");
        return;
    };
    let d = dissect_capture(&read_capture(&dir.join("rping-crc-p2p.pcap")).unwrap());
    let s = &d.summaries[0];
    assert_eq!(s.crc, Some(true));
    let req = s.a_to_b.mpa.as_ref().unwrap();
    let rep = s.b_to_a.mpa.as_ref().unwrap();
    assert!(req.crc && rep.crc && req.enhanced && rep.enhanced);
    assert_eq!((req.revision, req.private_data_len), (2, 4));
    let io = req.ird_ord.unwrap();
    assert!(io.a_peer_to_peer && io.c_write_rtr && io.d_read_rtr && !io.b_send_rtr);
    assert_eq!(s.a_to_b.markers, Some(false));
    // The RTR: the initiator's first FPDU is a zero-length RDMA Write.
    let first = fpdus(&d)
        .into_iter()
        .find(|f| f.place.dir == Dir::AToB)
        .unwrap();
    assert_eq!((first.opcode, first.payload_len), (0, 0));
}
