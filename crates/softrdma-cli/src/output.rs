//! Text and JSON-lines rendering of a [`Dissection`].
//!
//! Text: one line per record (time, stream, direction, frame, then the
//! decode), then one block per stream summary. JSON: one object per line,
//! each with a `"type"` field: `mpa`, `fpdu`, `error`, `note`, `frame_note`,
//! `summary`.

use std::io::{self, Write};

use serde::Serialize;

use crate::capture::FrameNote;
use crate::decode::{DdpInfo, IrdOrdInfo, MpaFrameInfo};
use crate::dissect::{
    CrcStatus, DirSummary, Dissection, FpduRecord, Place, Record, StreamSummary, mpa_kind_name,
};

/// What to print.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutputOptions {
    /// JSON lines instead of text.
    pub json: bool,
    /// Only the per-stream summaries.
    pub summary_only: bool,
    /// Only this stream.
    pub stream: Option<usize>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum JsonLine<'a> {
    FrameNote { frame: u64, message: &'a str },
    Summary(&'a StreamSummary),
}

/// Writes the dissection.
///
/// # Errors
///
/// Any error of `out`.
pub fn write(d: &Dissection, opts: &OutputOptions, out: &mut dyn Write) -> io::Result<()> {
    let keep = |stream: usize| opts.stream.is_none_or(|s| s == stream);
    if !opts.summary_only {
        if opts.stream.is_none() {
            for n in &d.frame_notes {
                write_frame_note(n, opts.json, out)?;
            }
        }
        for r in d.records.iter().filter(|r| keep(r.place().stream)) {
            if opts.json {
                serde_json::to_writer(&mut *out, r)?;
                writeln!(out)?;
            } else {
                writeln!(out, "{}", record_line(r))?;
            }
        }
    }
    let mut first = true;
    for s in d.summaries.iter().filter(|s| keep(s.stream)) {
        if opts.json {
            serde_json::to_writer(&mut *out, &JsonLine::Summary(s))?;
            writeln!(out)?;
        } else {
            if !(first && opts.summary_only) {
                writeln!(out)?;
            }
            first = false;
            write!(out, "{}", summary_text(s))?;
        }
    }
    if let Some(t) = &d.truncated {
        if opts.json {
            serde_json::to_writer(
                &mut *out,
                &JsonLine::FrameNote {
                    frame: 0,
                    message: &format!("capture file truncated {t}"),
                },
            )?;
            writeln!(out)?;
        } else {
            writeln!(out, "\nnote: capture file truncated {t}")?;
        }
    }
    Ok(())
}

fn write_frame_note(n: &FrameNote, json: bool, out: &mut dyn Write) -> io::Result<()> {
    if json {
        serde_json::to_writer(
            &mut *out,
            &JsonLine::FrameNote {
                frame: n.frame,
                message: &n.message,
            },
        )?;
        writeln!(out)
    } else {
        writeln!(out, "frame {}: skipped: {}", n.frame, n.message)
    }
}

fn prefix(p: &Place, end_frame: Option<u64>) -> String {
    let frames = match end_frame {
        Some(e) if e != p.frame => format!("{}-{e}", p.frame),
        _ => p.frame.to_string(),
    };
    format!(
        "{:>11.6}  [{}] {}  #{:<10}",
        p.time,
        p.stream,
        p.dir.arrow(),
        frames
    )
}

/// Renders `bool` as `1`/`0` for flag lists.
fn b(v: bool) -> u8 {
    u8::from(v)
}

fn ird_ord_text(io: &IrdOrdInfo) -> String {
    format!(
        "IRD {} ORD {}, RTR A(p2p)={} B(send)={} C(write)={} D(read)={}",
        io.ird,
        io.ord,
        b(io.a_peer_to_peer),
        b(io.b_send_rtr),
        b(io.c_write_rtr),
        b(io.d_read_rtr)
    )
}

/// One-line description of an MPA frame.
pub fn mpa_text(m: &MpaFrameInfo) -> String {
    let mut s = format!(
        "{} rev {} M={} C={} R={} H={}, private data {} bytes",
        mpa_kind_name(m.kind),
        m.revision,
        b(m.marker),
        b(m.crc),
        b(m.reject),
        b(m.enhanced),
        m.private_data_len
    );
    if let Some(io) = &m.ird_ord {
        s.push_str(", ");
        s.push_str(&ird_ord_text(io));
    }
    if m.reject {
        s.push_str(" (REJECTED)");
    }
    s
}

/// The CRC column.
pub fn crc_text(c: &CrcStatus) -> String {
    match c {
        CrcStatus::Good { .. } => "good".into(),
        CrcStatus::Bad { expected, found } => {
            format!("bad (expected {expected:#010x}, found {found:#010x})")
        }
        CrcStatus::NotNegotiated { .. } => "not negotiated".into(),
        CrcStatus::Unknown { field } => format!("unknown (field {field:#010x}, MPA not seen)"),
    }
}

fn fpdu_text(f: &FpduRecord) -> String {
    let ddp = match f.ddp {
        DdpInfo::Tagged { stag, to } => format!("T STag {stag:#010x} TO {to:#018x}"),
        DdpInfo::Untagged { qn, msn, mo } => format!("U QN {qn} MSN {msn} MO {mo}"),
    };
    let mut s = format!(
        "{ddp:<40} L={} len {:<5} {:<22} CRC {}",
        b(f.last),
        f.payload_len,
        f.opcode_name,
        crc_text(&f.crc)
    );
    if let Some(d) = &f.detail {
        s.push_str(&format!("  [{d}]"));
    }
    s
}

/// The text line of one record.
pub fn record_line(r: &Record) -> String {
    let end = match r {
        Record::Fpdu(f) => Some(f.end_frame),
        _ => None,
    };
    let p = prefix(r.place(), end);
    match r {
        Record::Mpa(m) => format!("{p}{}", mpa_text(&m.mpa)),
        Record::Fpdu(f) => format!("{p}{}", fpdu_text(f)),
        Record::Error(e) => format!("{p}error: {}", e.message),
        Record::Note(n) => format!("{p}note: {}", n.message),
    }
}

fn dir_text(arrow: &str, d: &DirSummary) -> String {
    let mut s = format!("  {arrow}: ");
    match &d.mpa {
        Some(m) => s.push_str(&mpa_text(m)),
        None if d.mid_stream => s.push_str("MPA not captured (capture started mid-stream)"),
        None => s.push_str("no MPA frame"),
    }
    match d.markers {
        Some(true) => s.push_str("; markers on"),
        Some(false) => s.push_str("; markers off"),
        None => {}
    }
    s.push('\n');
    let ops: Vec<String> = d.opcodes.iter().map(|(k, v)| format!("{k} {v}")).collect();
    s.push_str(&format!(
        "      {} FPDUs{}{}; CRC good {} bad {}; decode errors {}\n",
        d.fpdus,
        if ops.is_empty() { "" } else { ": " },
        ops.join(", "),
        d.crc_good,
        d.crc_bad,
        d.decode_errors
    ));
    let mut tcp = vec![format!("{} bytes", d.bytes)];
    if d.mid_stream {
        tcp.push("no SYN (capture started mid-stream)".into());
    }
    if d.fin {
        tcp.push("FIN".into());
    }
    if d.rst {
        tcp.push("RST".into());
    }
    if d.missing_bytes > 0 {
        tcp.push(format!("{} bytes missing", d.missing_bytes));
    }
    if d.duplicate_bytes > 0 {
        tcp.push(format!("{} bytes retransmitted", d.duplicate_bytes));
    }
    if d.out_of_order > 0 {
        tcp.push(format!("{} segments out of order", d.out_of_order));
    }
    if d.undecoded_bytes > 0 {
        tcp.push(format!("{} bytes not decoded", d.undecoded_bytes));
    }
    s.push_str(&format!("      TCP: {}\n", tcp.join(", ")));
    s
}

/// The text block of one stream summary.
pub fn summary_text(s: &StreamSummary) -> String {
    let kind = if !s.iwarp {
        "not iWARP".to_string()
    } else {
        match s.crc {
            Some(true) => "iWARP, CRC on".into(),
            Some(false) => "iWARP, CRC off".into(),
            None => "iWARP, CRC unknown".into(),
        }
    };
    format!(
        "stream {}: {} (a) ↔ {} (b), from frame {}, {kind}\n{}{}",
        s.stream,
        s.a,
        s.b,
        s.first_frame,
        dir_text("a→b", &s.a_to_b),
        dir_text("b→a", &s.b_to_a)
    )
}
