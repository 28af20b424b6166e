//! TCP stream reassembly by sequence number, both directions of each
//! connection.
//!
//! The whole capture is available up front, so reassembly is done offline:
//! segments are grouped by connection and direction, their sequence numbers
//! are unwrapped into 64-bit stream offsets, sorted, and laid end to end.
//! Retransmitted and duplicate bytes are dropped (the first copy captured
//! wins; a retransmission with different bytes is counted as a conflict),
//! out-of-order segments fall into place, and holes (bytes never captured)
//! split the stream into [`Chunk`]s so that a decoder knows where it must
//! resynchronise.
//!
//! The stream starts after the SYN when one was captured. Without a SYN the
//! capture started mid-stream: the stream then starts at the lowest sequence
//! number seen and [`Direction::mid_stream`] is set.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::time::Duration;

use crate::capture::TcpSegment;

/// Where some bytes of a reassembled stream came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Origin {
    /// Stream offset of the first byte this frame contributed.
    pub offset: u64,
    /// Frame number.
    pub frame: u64,
    /// Frame timestamp.
    pub timestamp: Duration,
}

/// A contiguous run of stream bytes (no holes inside).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Chunk {
    /// Stream offset of `data[0]` (0 = first byte after the SYN, or the
    /// first byte captured when the SYN was not).
    pub offset: u64,
    /// The bytes.
    pub data: Vec<u8>,
    /// Frames that contributed new bytes, sorted by `offset`.
    pub origins: Vec<Origin>,
}

impl Chunk {
    /// The frame that carried stream byte `offset` (which must lie in this
    /// chunk), with its timestamp.
    pub fn origin_of(&self, offset: u64) -> Option<Origin> {
        let idx = self.origins.partition_point(|o| o.offset <= offset);
        idx.checked_sub(1)
            .and_then(|i| self.origins.get(i))
            .copied()
    }

    /// Stream offset one past the last byte.
    pub fn end(&self) -> u64 {
        self.offset + self.data.len() as u64
    }
}

/// One direction of a connection, reassembled.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Direction {
    /// Contiguous runs of bytes, in stream order, separated by holes.
    pub chunks: Vec<Chunk>,
    /// A SYN from this side was captured.
    pub syn: bool,
    /// A FIN from this side was captured.
    pub fin: bool,
    /// A RST from this side was captured.
    pub rst: bool,
    /// No SYN was captured: the capture started after the connection did,
    /// so stream offset 0 is not the start of the byte stream.
    pub mid_stream: bool,
    /// Segments with payload.
    pub segments: u64,
    /// Segments that started below the highest byte already captured and
    /// still brought new bytes (out of order, or a retransmission that
    /// extends past what was captured).
    pub out_of_order: u64,
    /// Payload bytes that had already been captured (retransmissions,
    /// duplicates).
    pub duplicate_bytes: u64,
    /// Of those, bytes whose retransmitted value differed from the first copy.
    pub conflicting_bytes: u64,
    /// Bytes missing between chunks (never captured).
    pub missing_bytes: u64,
}

/// A TCP connection, both directions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connection {
    /// 0-based index in order of first appearance in the capture.
    pub id: usize,
    /// Side "a": the active opener if its SYN was captured, else the sender
    /// of the first captured segment.
    pub a: SocketAddr,
    /// Side "b".
    pub b: SocketAddr,
    /// Bytes sent a → b.
    pub a_to_b: Direction,
    /// Bytes sent b → a.
    pub b_to_a: Direction,
    /// Frame number of the first segment of this connection.
    pub first_frame: u64,
}

/// Bytes first captured in one frame.
struct Piece {
    data: Vec<u8>,
    frame: u64,
    timestamp: Duration,
}

#[derive(Default)]
struct Collect {
    first: Option<SocketAddr>,
    first_frame: u64,
    syn_sender: Option<SocketAddr>,
    segs: HashMap<SocketAddr, Vec<TcpSegment>>,
}

/// Groups segments into connections (ordered by first appearance) and
/// reassembles both directions of each.
///
/// A connection is identified by its two endpoints; a new SYN on endpoints
/// whose previous connection has finished is not split off (port reuse within
/// one capture is rare enough for this tool).
pub fn reassemble(segments: impl IntoIterator<Item = TcpSegment>) -> Vec<Connection> {
    let mut order: Vec<(SocketAddr, SocketAddr)> = Vec::new();
    let mut conns: HashMap<(SocketAddr, SocketAddr), Collect> = HashMap::new();
    for seg in segments {
        let key = if seg.src <= seg.dst {
            (seg.src, seg.dst)
        } else {
            (seg.dst, seg.src)
        };
        let c = conns.entry(key).or_insert_with(|| {
            order.push(key);
            Collect::default()
        });
        if c.first.is_none() {
            c.first = Some(seg.src);
            c.first_frame = seg.frame;
        }
        if seg.syn && !seg.ack && c.syn_sender.is_none() {
            c.syn_sender = Some(seg.src);
        }
        c.segs.entry(seg.src).or_default().push(seg);
    }
    let mut out = Vec::with_capacity(order.len());
    for (id, key) in order.into_iter().enumerate() {
        let Some(mut c) = conns.remove(&key) else {
            continue;
        };
        let a = c.syn_sender.or(c.first).unwrap_or(key.0);
        let b = if a == key.0 { key.1 } else { key.0 };
        let a_to_b = reassemble_direction(c.segs.remove(&a).unwrap_or_default());
        let b_to_a = reassemble_direction(c.segs.remove(&b).unwrap_or_default());
        out.push(Connection {
            id,
            a,
            b,
            a_to_b,
            b_to_a,
            first_frame: c.first_frame,
        });
    }
    out
}

/// Reassembles the segments of one direction (in capture order).
pub fn reassemble_direction(segs: Vec<TcpSegment>) -> Direction {
    let mut dir = Direction::default();
    // Unwrap 32-bit sequence numbers into signed 64-bit positions relative
    // to the first segment, each relative to the previous one (segments of a
    // capture are never 2 GiB apart).
    let mut placed: Vec<(i64, TcpSegment)> = Vec::with_capacity(segs.len());
    let mut prev: Option<(u32, i64)> = None;
    let mut syn_pos: Option<i64> = None;
    for seg in segs {
        let pos = match prev {
            None => 0,
            Some((pseq, ppos)) => ppos + i64::from(seg.seq.wrapping_sub(pseq) as i32),
        };
        prev = Some((seg.seq, pos));
        dir.syn |= seg.syn;
        dir.fin |= seg.fin;
        dir.rst |= seg.rst;
        if seg.syn && syn_pos.is_none() {
            syn_pos = Some(pos);
        }
        // SYN occupies one sequence number; data on a SYN starts after it.
        let data_pos = if seg.syn { pos + 1 } else { pos };
        if !seg.payload.is_empty() {
            dir.segments += 1;
            placed.push((data_pos, seg));
        }
    }
    let base = match syn_pos {
        Some(p) => p + 1,
        None => {
            dir.mid_stream = true;
            placed.iter().map(|(p, _)| *p).min().unwrap_or(0)
        }
    };
    // Lay the bytes down in capture order: a byte already captured is never
    // replaced, so the first copy wins whatever the retransmission holds.
    // `pieces` holds non-overlapping runs keyed by stream offset.
    let mut pieces: BTreeMap<u64, Piece> = BTreeMap::new();
    let mut high: u64 = 0;
    for (p, seg) in placed {
        let rel = p - base;
        let len = seg.payload.len() as i64;
        if rel + len <= 0 {
            // Entirely before the stream start (data before the SYN?): drop.
            dir.duplicate_bytes += seg.payload.len() as u64;
            continue;
        }
        let skip_front = (-rel).max(0);
        let s = (rel + skip_front) as u64;
        let payload = seg.payload.get(skip_front as usize..).unwrap_or_default();
        let e = s + payload.len() as u64;
        let mut cursor = s;
        let mut fresh: Vec<(u64, u64)> = Vec::new();
        let first_key = pieces.range(..=s).next_back().map_or(s, |(k, _)| *k);
        for (&ps, piece) in pieces.range(first_key..e) {
            let pe = ps + piece.data.len() as u64;
            if pe <= cursor {
                continue;
            }
            if ps > cursor {
                fresh.push((cursor, ps.min(e)));
            }
            let (os, oe) = (ps.max(cursor), pe.min(e));
            if os < oe {
                dir.duplicate_bytes += oe - os;
                let have = piece
                    .data
                    .get((os - ps) as usize..(oe - ps) as usize)
                    .unwrap_or_default();
                let again = payload
                    .get((os - s) as usize..(oe - s) as usize)
                    .unwrap_or_default();
                dir.conflicting_bytes +=
                    have.iter().zip(again).filter(|(x, y)| x != y).count() as u64;
            }
            cursor = cursor.max(pe);
        }
        if cursor < e {
            fresh.push((cursor, e));
        }
        if !fresh.is_empty() && s < high {
            dir.out_of_order += 1;
        }
        high = high.max(e);
        for (fs, fe) in fresh {
            let data = payload
                .get((fs - s) as usize..(fe - s) as usize)
                .unwrap_or_default()
                .to_vec();
            pieces.insert(
                fs,
                Piece {
                    data,
                    frame: seg.frame,
                    timestamp: seg.timestamp,
                },
            );
        }
    }
    // Join adjacent pieces into chunks; a gap starts a new chunk.
    let mut cur: Option<Chunk> = None;
    for (off, piece) in pieces {
        let origin = Origin {
            offset: off,
            frame: piece.frame,
            timestamp: piece.timestamp,
        };
        match &mut cur {
            Some(ch) if ch.end() == off => {
                ch.origins.push(origin);
                ch.data.extend_from_slice(&piece.data);
            }
            _ => {
                let prev_end = cur.as_ref().map_or(0, Chunk::end);
                dir.missing_bytes += off - prev_end;
                if let Some(done) = cur.take() {
                    dir.chunks.push(done);
                }
                cur = Some(Chunk {
                    offset: off,
                    data: piece.data,
                    origins: vec![origin],
                });
            }
        }
    }
    if let Some(done) = cur {
        dir.chunks.push(done);
    }
    dir
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(frame: u64, seq: u32, payload: &[u8]) -> TcpSegment {
        TcpSegment {
            frame,
            timestamp: Duration::from_millis(frame),
            src: "10.0.0.1:1000".parse().unwrap(),
            dst: "10.0.0.2:2000".parse().unwrap(),
            seq,
            syn: false,
            ack: true,
            fin: false,
            rst: false,
            payload: payload.to_vec(),
        }
    }

    fn syn(frame: u64, seq: u32) -> TcpSegment {
        TcpSegment {
            syn: true,
            ack: false,
            ..seg(frame, seq, &[])
        }
    }

    #[test]
    fn in_order_after_syn() {
        let d = reassemble_direction(vec![syn(1, 100), seg(2, 101, b"abc"), seg(3, 104, b"def")]);
        assert!(!d.mid_stream);
        assert_eq!(d.chunks.len(), 1);
        assert_eq!(d.chunks[0].data, b"abcdef");
        assert_eq!(d.chunks[0].origin_of(3).unwrap().frame, 3);
        assert_eq!(d.chunks[0].origin_of(2).unwrap().frame, 2);
    }

    #[test]
    fn out_of_order_duplicates_and_overlap() {
        let d = reassemble_direction(vec![
            syn(1, 1000),
            seg(2, 1004, b"defg"),   // offsets 3..7, ahead of the data
            seg(3, 1001, b"abc"),    // 0..3, out of order
            seg(4, 1001, b"abc"),    // exact duplicate
            seg(5, 1003, b"cDefgh"), // 2..8: 5 bytes again ('D' differs), 'h' new
            seg(6, 1011, b"kl"),     // 10..12, after a 2-byte hole
        ]);
        assert_eq!(d.chunks.len(), 2, "{d:?}");
        assert_eq!(d.chunks[0].data, b"abcdefgh");
        assert_eq!(d.chunks[1].offset, 10);
        assert_eq!(d.chunks[1].data, b"kl");
        assert_eq!(d.missing_bytes, 2);
        assert_eq!(d.duplicate_bytes, 3 + 5);
        assert_eq!(d.conflicting_bytes, 1, "first copy kept");
        assert_eq!(d.out_of_order, 2);
        assert_eq!(d.chunks[0].origin_of(0).unwrap().frame, 3);
        assert_eq!(d.chunks[0].origin_of(3).unwrap().frame, 2);
        assert_eq!(d.chunks[0].origin_of(7).unwrap().frame, 5);
        assert_eq!(d.chunks[1].origin_of(11).unwrap().frame, 6);
    }

    #[test]
    fn mid_stream_starts_at_lowest_seq_and_wraps() {
        let d = reassemble_direction(vec![
            seg(1, 0xffff_fffe, b"cd"),
            seg(2, 0xffff_fffc, b"ab"),
            seg(3, 0, b"ef"),
        ]);
        assert!(d.mid_stream);
        assert_eq!(d.chunks.len(), 1);
        assert_eq!(d.chunks[0].data, b"abcdef");
        assert_eq!(d.out_of_order, 1);
    }

    #[test]
    fn connections_split_by_direction_and_ordered() {
        let mut back = seg(3, 5000, b"pong");
        back.src = "10.0.0.2:2000".parse().unwrap();
        back.dst = "10.0.0.1:1000".parse().unwrap();
        let conns = reassemble(vec![syn(1, 10), seg(2, 11, b"ping"), back]);
        assert_eq!(conns.len(), 1);
        let c = &conns[0];
        assert_eq!(c.a, "10.0.0.1:1000".parse().unwrap());
        assert_eq!(c.a_to_b.chunks[0].data, b"ping");
        assert!(c.b_to_a.mid_stream);
        assert_eq!(c.b_to_a.chunks[0].data, b"pong");
    }
}
