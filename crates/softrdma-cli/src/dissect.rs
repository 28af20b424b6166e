//! From reassembled TCP streams to iWARP records: the MPA Request/Reply at
//! the start of each direction, the negotiated CRC and markers, then every
//! FPDU of both directions with its DDP and RDMAP headers and CRC check.
//!
//! Negotiation (RFC 5044 §7.1.2, RFC 6581):
//! * CRC is used in both directions if either the Request or the Reply set C;
//! * markers are inserted by a sender if the *other* side's frame set M
//!   (M declares what the sender of the frame wants to receive). Markers are
//!   4 bytes at every 512th octet of the stream, the first immediately before
//!   the first FPDU; they are removed before framing and CRC checking.
//!
//! When a capture starts mid-stream, or bytes are missing (a hole in the
//! reassembled stream), the dissector says so and looks for the next offset
//! where a chain of plausible FPDU headers starts, then continues from there.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::Serialize;

use crate::capture::{self, Capture, FrameNote};
use crate::decode::{
    self, DdpInfo, MpaError, MpaFrameInfo, MpaKind, UlpduInfo, check_crc, fpdu_len,
    plausible_fpdu_start,
};
use crate::reassembly::{self, Chunk, Connection, Direction};
use softrdma_wire::deframer::{Deframer, DeframerConfig};
use softrdma_wire::markers;

/// Which way bytes travel on a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Dir {
    /// From side a (the active opener) to side b.
    #[serde(rename = "a->b")]
    AToB,
    /// From side b to side a.
    #[serde(rename = "b->a")]
    BToA,
}

impl Dir {
    /// `a→b` / `b→a`.
    pub fn arrow(self) -> &'static str {
        match self {
            Dir::AToB => "a→b",
            Dir::BToA => "b→a",
        }
    }
}

/// The outcome of checking one FPDU's CRC field.
///
/// CRC values are shown the way Wireshark shows the field: the four wire
/// bytes read as a big-endian number (the CRC32C register goes on the wire
/// least significant byte first, so this is the byte-swapped register).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum CrcStatus {
    /// CRC negotiated and the field matches.
    Good {
        /// The CRC field.
        value: u32,
    },
    /// CRC negotiated (or, mid-stream, apparently used) and the field does
    /// not match the bytes.
    Bad {
        /// CRC32C computed over the FPDU.
        expected: u32,
        /// The CRC field found on the wire.
        found: u32,
    },
    /// CRC not negotiated: the field is not checked (siw sends zero).
    NotNegotiated {
        /// The CRC field found on the wire.
        field: u32,
    },
    /// The MPA exchange was not captured, the field is not zero and does not
    /// match: CRC was probably not negotiated.
    Unknown {
        /// The CRC field found on the wire.
        field: u32,
    },
}

/// Where a record sits in the capture.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Place {
    /// Seconds since the first frame of the capture.
    pub time: f64,
    /// Stream (connection) index, 0-based in order of first appearance.
    pub stream: usize,
    /// Direction.
    pub dir: Dir,
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
    /// Frame where the item starts (1-based, as Wireshark numbers frames).
    pub frame: u64,
    /// Stream offset where the item starts (0 = first byte after the SYN).
    pub offset: u64,
}

/// One FPDU, decoded.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FpduRecord {
    /// Where it is.
    #[serde(flatten)]
    pub place: Place,
    /// Frame holding the FPDU's last byte (its CRC field). Differs from
    /// `place.frame` when the FPDU spans segments; Wireshark shows an FPDU in
    /// this frame, where its reassembly completes.
    pub end_frame: u64,
    /// MPA ULPDU length.
    pub ulpdu_len: u16,
    /// DDP buffer model and addressing fields.
    pub ddp: DdpInfo,
    /// DDP Last flag.
    pub last: bool,
    /// DDP payload length (bytes after the DDP header).
    pub payload_len: usize,
    /// RDMAP opcode.
    pub opcode: u8,
    /// RDMAP opcode name.
    pub opcode_name: &'static str,
    /// Extra fields of a Read Request or Terminate.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// CRC check.
    pub crc: CrcStatus,
}

/// An MPA Request or Reply found at the start of a direction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MpaRecord {
    /// Where it is.
    #[serde(flatten)]
    pub place: Place,
    /// The decoded frame.
    #[serde(flatten)]
    pub mpa: MpaFrameInfo,
    /// The raw frame (key, flags, revision, length, private data) in hex.
    pub raw_hex: String,
}

/// Something that could not be decoded, or a remark about the stream.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Remark {
    /// Where it is (the frame is 0 when no frame applies).
    #[serde(flatten)]
    pub place: Place,
    /// What happened.
    pub message: String,
}

/// One line of output.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// MPA Request/Reply.
    Mpa(MpaRecord),
    /// An FPDU.
    Fpdu(FpduRecord),
    /// A decode error (bytes that should have been an FPDU and are not).
    Error(Remark),
    /// A remark (capture started mid-stream, hole, resynchronised).
    Note(Remark),
}

impl Record {
    /// The place of the record.
    pub fn place(&self) -> &Place {
        match self {
            Record::Mpa(r) => &r.place,
            Record::Fpdu(r) => &r.place,
            Record::Error(r) | Record::Note(r) => &r.place,
        }
    }
}

/// Per-direction totals.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct DirSummary {
    /// The MPA frame this side sent, if captured.
    pub mpa: Option<MpaFrameInfo>,
    /// Markers in this direction (`None` when the MPA exchange was not seen).
    pub markers: Option<bool>,
    /// FPDUs decoded.
    pub fpdus: u64,
    /// FPDU count per RDMAP opcode name.
    pub opcodes: BTreeMap<&'static str, u64>,
    /// FPDUs with a good CRC.
    pub crc_good: u64,
    /// FPDUs with a bad CRC.
    pub crc_bad: u64,
    /// Decode errors.
    pub decode_errors: u64,
    /// No SYN captured from this side.
    pub mid_stream: bool,
    /// SYN / FIN / RST seen.
    pub syn: bool,
    /// FIN seen.
    pub fin: bool,
    /// RST seen.
    pub rst: bool,
    /// Payload bytes reassembled.
    pub bytes: u64,
    /// Bytes never captured (holes).
    pub missing_bytes: u64,
    /// Retransmitted / duplicate bytes dropped.
    pub duplicate_bytes: u64,
    /// Segments that arrived out of order.
    pub out_of_order: u64,
    /// Bytes skipped while resynchronising or left undecoded at the end.
    pub undecoded_bytes: u64,
}

/// Per-connection summary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StreamSummary {
    /// Stream index.
    pub stream: usize,
    /// Side a.
    pub a: SocketAddr,
    /// Side b.
    pub b: SocketAddr,
    /// First frame of the connection.
    pub first_frame: u64,
    /// Whether this looks like iWARP (MPA key seen or FPDUs decoded).
    pub iwarp: bool,
    /// CRC in use (`None`: the MPA exchange was not captured).
    pub crc: Option<bool>,
    /// a → b.
    pub a_to_b: DirSummary,
    /// b → a.
    pub b_to_a: DirSummary,
}

/// The dissection of a whole capture.
#[derive(Debug, Clone, PartialEq)]
pub struct Dissection {
    /// MPA frames, FPDUs, errors and notes, ordered by frame then offset.
    pub records: Vec<Record>,
    /// One summary per TCP connection.
    pub summaries: Vec<StreamSummary>,
    /// Frames that could not be decoded down to TCP.
    pub frame_notes: Vec<FrameNote>,
    /// The file ended in the middle of a record.
    pub truncated: Option<String>,
    /// Frames in the capture.
    pub frames: u64,
}

/// Dissects every TCP connection of a capture.
pub fn dissect_capture(capture: &Capture) -> Dissection {
    let t0 = capture
        .frames
        .first()
        .map_or(Duration::ZERO, |f| f.timestamp);
    let mut frame_notes = Vec::new();
    let mut segments = Vec::new();
    for frame in &capture.frames {
        match capture::tcp_segment(frame) {
            Ok(Some(s)) => segments.push(s),
            Ok(None) => {}
            Err(note) => frame_notes.push(note),
        }
    }
    let conns = reassembly::reassemble(segments);
    let mut records = Vec::new();
    let mut summaries = Vec::new();
    for conn in &conns {
        let (recs, summary) = dissect_connection(conn, t0);
        records.extend(recs);
        summaries.push(summary);
    }
    // Stable: within a frame, streams keep their order and offsets ascend.
    records.sort_by_key(|r| (r.place().frame, r.place().stream, r.place().offset));
    Dissection {
        records,
        summaries,
        frame_notes,
        truncated: capture.truncated.clone(),
        frames: capture.frames.len() as u64,
    }
}

/// Per-direction context.
struct Ctx<'a> {
    stream: usize,
    dir: Dir,
    src: SocketAddr,
    dst: SocketAddr,
    t0: Duration,
    data: &'a Direction,
}

impl Ctx<'_> {
    fn place(&self, offset: u64) -> Place {
        let origin = self
            .data
            .chunks
            .iter()
            .find(|c| c.offset <= offset && offset < c.end().max(c.offset + 1))
            .and_then(|c| c.origin_of(offset));
        let (frame, ts) = origin.map_or((0, self.t0), |o| (o.frame, o.timestamp));
        Place {
            time: ts.saturating_sub(self.t0).as_secs_f64(),
            stream: self.stream,
            dir: self.dir,
            src: self.src,
            dst: self.dst,
            frame,
            offset,
        }
    }

    fn remark(&self, offset: u64, message: String) -> Remark {
        Remark {
            place: self.place(offset),
            message,
        }
    }
}

/// Result of looking for the MPA frame at the start of one direction.
enum Start {
    /// MPA frame found; FPDUs start at this stream offset.
    Mpa(MpaFrameInfo, u64),
    /// Stream starts at offset 0 but holds no MPA key.
    NoKey,
    /// Start of the stream not captured (mid-stream, or hole at 0).
    Unknown,
    /// Stream too short or bad MPA header.
    Broken(String),
    /// Nothing sent in this direction.
    Empty,
}

fn find_start(d: &Direction) -> Start {
    let Some(first) = d.chunks.first() else {
        return Start::Empty;
    };
    if d.mid_stream || first.offset != 0 {
        return Start::Unknown;
    }
    match decode::parse_mpa_frame(&first.data) {
        Some(Ok(f)) => {
            let len = f.raw.len() as u64;
            Start::Mpa(f, len)
        }
        Some(Err(MpaError::BadKey { .. })) => Start::NoKey,
        Some(Err(e)) => Start::Broken(e.to_string()),
        None => Start::Broken(format!(
            "stream ends after {} bytes, inside the MPA Request/Reply",
            first.data.len()
        )),
    }
}

/// CRC use as negotiated: `None` if unknown.
fn negotiated_crc(a: &Start, b: &Start) -> Option<bool> {
    match (a, b) {
        (Start::Mpa(fa, _), Start::Mpa(fb, _)) => Some(fa.crc || fb.crc),
        // One side's frame is enough to know CRC is on.
        (Start::Mpa(f, _), _) | (_, Start::Mpa(f, _)) if f.crc => Some(true),
        _ => None,
    }
}

fn dissect_connection(conn: &Connection, t0: Duration) -> (Vec<Record>, StreamSummary) {
    let start_ab = find_start(&conn.a_to_b);
    let start_ba = find_start(&conn.b_to_a);
    let crc = negotiated_crc(&start_ab, &start_ba);
    // Markers in a→b are wanted by b (its frame's M bit), and vice versa.
    let markers_of = |other: &Start| match other {
        Start::Mpa(f, _) => Some(f.marker),
        _ => None,
    };
    let iwarp_key = matches!(start_ab, Start::Mpa(..)) || matches!(start_ba, Start::Mpa(..));
    let rejected = [&start_ab, &start_ba]
        .iter()
        .any(|s| matches!(s, Start::Mpa(f, _) if f.reject));
    let mut records = Vec::new();
    let mut summaries = [DirSummary::default(), DirSummary::default()];
    for (i, (dir, data, start, other, src, dst)) in [
        (
            Dir::AToB,
            &conn.a_to_b,
            &start_ab,
            &start_ba,
            conn.a,
            conn.b,
        ),
        (
            Dir::BToA,
            &conn.b_to_a,
            &start_ba,
            &start_ab,
            conn.b,
            conn.a,
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let ctx = Ctx {
            stream: conn.id,
            dir,
            src,
            dst,
            t0,
            data,
        };
        let summary = &mut summaries[i];
        summary.mid_stream = data.mid_stream;
        summary.syn = data.syn;
        summary.fin = data.fin;
        summary.rst = data.rst;
        summary.bytes = data.chunks.iter().map(|c| c.data.len() as u64).sum();
        summary.missing_bytes = data.missing_bytes;
        summary.duplicate_bytes = data.duplicate_bytes;
        summary.out_of_order = data.out_of_order;
        summary.markers = markers_of(other);
        if data.conflicting_bytes > 0 {
            records.push(Record::Note(ctx.remark(
                0,
                format!(
                    "{} retransmitted bytes differ from the first copy (first copy kept)",
                    data.conflicting_bytes
                ),
            )));
        }
        let fpdu_start = match start {
            Start::Empty => continue,
            Start::Mpa(f, len) => {
                summary.mpa = Some(f.clone());
                records.push(Record::Mpa(MpaRecord {
                    place: ctx.place(0),
                    mpa: f.clone(),
                    raw_hex: f.raw.iter().map(|b| format!("{b:02x}")).collect(),
                }));
                if rejected {
                    continue;
                }
                Some(*len)
            }
            Start::NoKey => {
                if !iwarp_key {
                    // Not iWARP at all (or not in this capture): stay quiet.
                    summary.undecoded_bytes = summary.bytes;
                    continue;
                }
                records.push(Record::Error(
                    ctx.remark(0, "no MPA Request/Reply at the start of the stream".into()),
                ));
                summary.decode_errors += 1;
                None
            }
            Start::Broken(msg) => {
                records.push(Record::Error(
                    ctx.remark(0, format!("bad MPA frame: {msg}")),
                ));
                summary.decode_errors += 1;
                None
            }
            Start::Unknown => {
                let first = data.chunks.first().map_or(0, |c| c.offset);
                records.push(Record::Note(ctx.remark(
                    first,
                    if data.mid_stream {
                        "capture starts mid-stream (no SYN): MPA negotiation not seen, \
                         looking for the first FPDU"
                            .into()
                    } else {
                        "start of the stream not captured: looking for the first FPDU".into()
                    },
                )));
                None
            }
        };
        let markers = summary.markers.unwrap_or(false);
        let mut walker = Walker {
            ctx: &ctx,
            crc,
            markers_from: if markers { fpdu_start } else { None },
            records: &mut records,
            summary,
        };
        walker.walk(fpdu_start);
    }
    let [a_to_b, b_to_a] = summaries;
    let iwarp = iwarp_key || a_to_b.fpdus > 0 || b_to_a.fpdus > 0;
    (
        records,
        StreamSummary {
            stream: conn.id,
            a: conn.a,
            b: conn.b,
            first_frame: conn.first_frame,
            iwarp,
            crc,
            a_to_b,
            b_to_a,
        },
    )
}

/// Walks the FPDUs of one direction with the wire deframer.
///
/// The deframer runs with CRC checking off and the CRC is verified here
/// instead: a dissector must report a bad CRC and go on, while the deframer
/// (rightly, for a receiver) stops at the first mismatch. With markers on,
/// the deframer removes them; the CRC is computed over the FPDU as sent,
/// markers included (RFC 5044 §5.1; `softrdma_wire::markers`).
struct Walker<'a, 'b> {
    ctx: &'a Ctx<'b>,
    crc: Option<bool>,
    /// Stream offset of the first FPDU when markers are on (they are placed
    /// every 512 octets counted from there); `None` when markers are off.
    markers_from: Option<u64>,
    records: &'a mut Vec<Record>,
    summary: &'a mut DirSummary,
}

/// How many chained plausible FPDU headers make a resynchronisation point.
const RESYNC_CHAIN: usize = 3;

/// Where a deframing run over a chunk stopped.
enum Stop {
    /// All bytes of the chunk used (or the rest reported as incomplete).
    End,
    /// Start again (resynchronise) at or after this stream offset.
    ResyncFrom(u64),
}

impl Walker<'_, '_> {
    fn walk(&mut self, fpdu_start: Option<u64>) {
        let chunks = &self.ctx.data.chunks;
        let n = chunks.len();
        let mut prev_end: Option<u64> = None;
        for (ci, chunk) in chunks.iter().enumerate() {
            let last_chunk = ci + 1 == n;
            let mut start = match (ci, fpdu_start) {
                (0, Some(s)) => Some(s),
                _ => {
                    if let Some(pe) = prev_end {
                        self.records.push(Record::Note(self.ctx.remark(
                            chunk.offset,
                            format!(
                                "{} bytes missing from the capture before this point; \
                                 resynchronising",
                                chunk.offset.saturating_sub(pe)
                            ),
                        )));
                    }
                    self.resync(chunk, chunk.offset)
                }
            };
            while let Some(at) = start {
                start = match self.run(chunk, at, last_chunk) {
                    Stop::End => None,
                    Stop::ResyncFrom(from) => self.resync(chunk, from),
                };
            }
            prev_end = Some(chunk.end());
        }
    }

    /// Deframes `chunk` from stream offset `at` (an FPDU boundary).
    fn run(&mut self, chunk: &Chunk, at: u64, last_chunk: bool) -> Stop {
        let base = self.markers_from.unwrap_or(0);
        let config = DeframerConfig::new(false, self.markers_from.is_some())
            .with_stream_position(at.saturating_sub(base));
        let mut deframer = Deframer::new(config);
        let mut rest = chunk
            .data
            .get(usize::try_from(at - chunk.offset).unwrap_or(usize::MAX)..)
            .unwrap_or_default();
        // Stream offset where the next FPDU's region (markers included) starts.
        let mut region = at;
        loop {
            let (used, out) = deframer.deframe(rest);
            match out {
                None => {
                    if region < chunk.end() {
                        self.incomplete(region, chunk.end() - region, last_chunk);
                    }
                    return Stop::End;
                }
                Some(Err(e)) => {
                    self.summary.decode_errors += 1;
                    self.records.push(Record::Error(
                        self.ctx.remark(region, format!("{e}; resynchronising")),
                    ));
                    return Stop::ResyncFrom(region + 1);
                }
                Some(Ok(d)) => {
                    let header = base + d.position;
                    let ulpdu_len = u16::try_from(d.ulpdu.len()).unwrap_or(u16::MAX);
                    let plain_len = fpdu_len(ulpdu_len);
                    let raw_len = if self.markers_from.is_some() {
                        markers::marked_len(region - base, plain_len)
                    } else {
                        plain_len
                    } as u64;
                    let info = decode::decode_ulpdu(d.ulpdu);
                    let from = usize::try_from(region - chunk.offset).unwrap_or(usize::MAX);
                    let raw = chunk
                        .data
                        .get(from..from + raw_len as usize)
                        .unwrap_or_default();
                    match info {
                        Ok(info) => {
                            self.fpdu(header, region + raw_len - 1, ulpdu_len, raw, info);
                        }
                        Err(e) => {
                            self.summary.decode_errors += 1;
                            self.records.push(Record::Error(self.ctx.remark(
                                header,
                                format!(
                                    "bad FPDU (ULPDU length {ulpdu_len}): {e}; resynchronising"
                                ),
                            )));
                            return Stop::ResyncFrom(header + 1);
                        }
                    }
                    region += raw_len;
                }
            }
            rest = rest.get(used..).unwrap_or_default();
        }
    }

    fn incomplete(&mut self, at: u64, have: u64, last_chunk: bool) {
        self.summary.undecoded_bytes += have;
        if last_chunk {
            self.records.push(Record::Note(self.ctx.remark(
                at,
                format!("capture ends inside an FPDU ({have} bytes of it captured)"),
            )));
        } else {
            self.summary.decode_errors += 1;
            self.records.push(Record::Error(self.ctx.remark(
                at,
                format!("hole in the capture inside an FPDU ({have} bytes of it captured)"),
            )));
        }
    }

    /// Finds the first stream offset ≥ `from` in `chunk` where
    /// [`RESYNC_CHAIN`] plausible FPDU headers follow each other (or the
    /// chain reaches the end of the chunk). With CRC negotiated, each
    /// complete FPDU of the chain must also carry a good CRC. Counts the
    /// bytes skipped as undecoded.
    fn resync(&mut self, chunk: &Chunk, from: u64) -> Option<u64> {
        let data = &chunk.data;
        let first = usize::try_from(from.saturating_sub(chunk.offset)).ok()?;
        let found = (first..data.len()).find(|&start| {
            let mut p = start;
            for _ in 0..RESYNC_CHAIN {
                let Some(rest) = data.get(p..) else {
                    return false;
                };
                if !plausible_fpdu_start(rest) {
                    return false;
                }
                let total = fpdu_len(u16::from_be_bytes([rest[0], rest[1]]));
                if self.crc == Some(true) {
                    match rest.get(..total) {
                        Some(f) if !check_crc(f).is_some_and(|(good, _, _)| good) => {
                            return false;
                        }
                        Some(_) => {}
                        None => return true,
                    }
                }
                p += total;
                if p >= data.len() {
                    return true;
                }
            }
            true
        });
        let skipped = found.unwrap_or(data.len()).saturating_sub(first);
        self.summary.undecoded_bytes += skipped as u64;
        let found = chunk.offset + found? as u64;
        if skipped > 0 {
            self.records.push(Record::Note(
                self.ctx
                    .remark(found, format!("resynchronised: {skipped} bytes skipped")),
            ));
        }
        Some(found)
    }

    fn fpdu(&mut self, at: u64, end: u64, ulpdu_len: u16, raw: &[u8], info: UlpduInfo) {
        // `raw` is the whole FPDU as sent (markers included, if any).
        let (good, expected, found) = check_crc(raw).unwrap_or((false, 0, 0));
        let crc = match self.crc {
            Some(false) => CrcStatus::NotNegotiated { field: found },
            Some(true) if good => CrcStatus::Good { value: found },
            Some(true) => CrcStatus::Bad { expected, found },
            None if good => CrcStatus::Good { value: found },
            None if found == 0 => CrcStatus::NotNegotiated { field: found },
            None => CrcStatus::Unknown { field: found },
        };
        match crc {
            CrcStatus::Good { .. } => self.summary.crc_good += 1,
            CrcStatus::Bad { .. } => self.summary.crc_bad += 1,
            _ => {}
        }
        let opcode_name = info.opcode_name;
        self.summary.fpdus += 1;
        *self.summary.opcodes.entry(opcode_name).or_default() += 1;
        self.records.push(Record::Fpdu(FpduRecord {
            place: self.ctx.place(at),
            end_frame: self.ctx.place(end).frame,
            ulpdu_len,
            ddp: info.ddp,
            last: info.last,
            payload_len: info.payload_len,
            opcode: info.opcode,
            opcode_name,
            detail: info.detail,
            crc,
        }));
    }
}

/// Whether an MPA frame is a Request (for display).
pub fn mpa_kind_name(kind: MpaKind) -> &'static str {
    match kind {
        MpaKind::Request => "MPA Request",
        MpaKind::Reply => "MPA Reply",
    }
}
