//! The messages of the two-process mode: MPA private data of the
//! connections, and the control messages Sent on the control QP.
//!
//! Every private data starts with the magic `SRPF` and a kind octet;
//! integers are little-endian. Everything from the peer is checked:
//! lengths, counts and values are bounded, and decoding never panics.
//!
//! ```text
//! Hello (client's control connection):
//!   "SRPF" 'H' version test mode flags(crc=1,baseline=2) iters:u64
//!   duration_us:u64 depth:u32 qps:u32 inline:u32 nsizes:u8 size:u32 * nsizes
//! Accept (server's answer):   "SRPF" 'A' version session:u32 tcp_port:u16
//! Refusal (server's reject):  "SRPF" 'E' reason (UTF-8)
//! Data connection:            "SRPF" 'D' version session:u32 round:u32 index:u16
//! ```
//!
//! Control messages: a tag octet, then
//! `R` round: size:u64 n:u16 (addr:u64 rkey:u32 len:u64)*n — `Y` ready:
//! n:u16 bufs — `N` end: receives:u64 — `O` done: receives:u64 — `S`
//! result: summary [tcp summary] — `B` bye — `K` alive (the client's
//! heartbeat during a run) — `E` error: reason (UTF-8).

use std::time::Duration;

use super::rdma::RemoteBuf;
use super::{MAX_DEPTH, MAX_QPS, MAX_SIZE, Mode, Summary, Test};

const MAGIC: &[u8; 4] = b"SRPF";

/// Version of the messages.
pub(super) const VERSION: u8 = 2;

/// Most sizes in one run (`-a` has 23).
pub(super) const MAX_SIZES: usize = 48;

/// Longest control message: a round with `MAX_QPS` buffers.
pub(super) const MAX_CONTROL: usize = 8192;

/// Longest reason text carried.
const MAX_REASON: usize = 200;

/// A message from the peer that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed message from the peer: {0}")]
pub(super) struct MsgError(String);

fn bad<T>(what: impl Into<String>) -> Result<T, MsgError> {
    Err(MsgError(what.into()))
}

#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        self.u64(v.to_bits())
    }
    fn text(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(MAX_REASON);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.0.extend_from_slice(&s.as_bytes()[..end]);
        self
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], MsgError> {
        if self.0.len() < n {
            return bad("truncated");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], MsgError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, MsgError> {
        Ok(self.arr::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, MsgError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, MsgError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, MsgError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    /// A finite, non-negative float.
    fn f64(&mut self) -> Result<f64, MsgError> {
        let v = f64::from_bits(self.u64()?);
        if v.is_finite() && v >= 0.0 {
            Ok(v)
        } else {
            bad("a number is negative or not finite")
        }
    }
    fn text(&mut self) -> String {
        let s = std::mem::take(&mut self.0);
        String::from_utf8_lossy(&s[..s.len().min(MAX_REASON)])
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect()
    }
    fn end(&self) -> Result<(), MsgError> {
        if self.0.is_empty() {
            Ok(())
        } else {
            bad("trailing octets")
        }
    }
    /// Magic, kind and (except refusals) version.
    fn head(&mut self, kind: u8) -> Result<(), MsgError> {
        if self.take(4)? != MAGIC {
            return bad("not a softrdma perf peer (no SRPF magic)");
        }
        let k = self.u8()?;
        if k != kind {
            return bad(format!(
                "expected a '{}' message, got '{}'",
                kind as char,
                k.escape_ascii()
            ));
        }
        if kind != b'E' {
            let v = self.u8()?;
            if v != VERSION {
                return bad(format!(
                    "protocol version {v}, this softrdma speaks {VERSION}"
                ));
            }
        }
        Ok(())
    }
}

/// What the client asks the server to run (its control connection's
/// private data).
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Hello {
    pub(super) test: Test,
    pub(super) mode: Mode,
    pub(super) crc: bool,
    pub(super) baseline_tcp: bool,
    /// The TCP baseline busy-polls.
    pub(super) tcp_spin: bool,
    pub(super) iters: u64,
    pub(super) duration: Option<Duration>,
    pub(super) depth: usize,
    pub(super) qps: usize,
    pub(super) inline: u32,
    pub(super) sizes: Vec<usize>,
}

impl Hello {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        w.0.extend_from_slice(MAGIC);
        w.u8(b'H').u8(VERSION);
        w.u8(match self.test {
            Test::Write => 0,
            Test::Read => 1,
            Test::Send => 2,
            Test::Atomic => 3,
        });
        w.u8(match self.mode {
            Mode::Bw => 0,
            Mode::Lat => 1,
        });
        w.u8(u8::from(self.crc)
            | (u8::from(self.baseline_tcp) << 1)
            | (u8::from(self.tcp_spin) << 2));
        w.u64(self.iters)
            .u64(self.duration.map_or(0, |d| d.as_micros().max(1) as u64))
            .u32(self.depth as u32)
            .u32(self.qps as u32)
            .u32(self.inline);
        w.u8(self.sizes.len().min(MAX_SIZES) as u8);
        for &s in self.sizes.iter().take(MAX_SIZES) {
            w.u32(s as u32);
        }
        w.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<Hello, MsgError> {
        let mut r = R(b);
        r.head(b'H')?;
        let test = match r.u8()? {
            0 => Test::Write,
            1 => Test::Read,
            2 => Test::Send,
            3 => Test::Atomic,
            t => return bad(format!("unknown test {t}")),
        };
        let mode = match r.u8()? {
            0 => Mode::Bw,
            1 => Mode::Lat,
            m => return bad(format!("unknown mode {m}")),
        };
        let flags = r.u8()?;
        if flags & !7 != 0 {
            return bad("unknown flags");
        }
        let iters = r.u64()?;
        let us = r.u64()?;
        let duration = (us > 0).then(|| Duration::from_micros(us));
        let depth = r.u32()? as usize;
        let qps = r.u32()? as usize;
        let inline = r.u32()?;
        let n = r.u8()? as usize;
        let mut sizes = Vec::with_capacity(n);
        for _ in 0..n {
            sizes.push(r.u32()? as usize);
        }
        r.end()?;
        if duration.is_none() && iters == 0 {
            return bad("no iterations and no duration");
        }
        if us > 1_000_000 * 1_000_000 {
            return bad("duration over 10^6 s");
        }
        if !(1..=MAX_DEPTH).contains(&depth) {
            return bad(format!("depth {depth} (1..={MAX_DEPTH})"));
        }
        if !(1..=MAX_QPS).contains(&qps) {
            return bad(format!("qps {qps} (1..={MAX_QPS})"));
        }
        if inline > 65536 {
            return bad(format!("inline {inline}"));
        }
        if sizes.is_empty() || n > MAX_SIZES {
            return bad(format!("{n} message sizes (1..={MAX_SIZES})"));
        }
        if let Some(s) = sizes.iter().find(|&&s| s == 0 || s > MAX_SIZE) {
            return bad(format!("message size {s}"));
        }
        if sizes.iter().any(|&s| s.saturating_mul(qps) > 4 * MAX_SIZE) {
            return bad("message size times QPs over 4 GiB");
        }
        Ok(Hello {
            test,
            mode,
            crc: flags & 1 != 0,
            baseline_tcp: flags & 2 != 0,
            tcp_spin: flags & 4 != 0,
            iters,
            duration,
            depth,
            qps,
            inline,
            sizes,
        })
    }
}

/// The server's answer to a Hello it accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Welcome {
    /// Identifies the run's data connections.
    pub(super) session: u32,
    /// Port of the TCP baseline listener (0: none).
    pub(super) tcp_port: u16,
}

impl Welcome {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        w.0.extend_from_slice(MAGIC);
        w.u8(b'A').u8(VERSION).u32(self.session).u16(self.tcp_port);
        w.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<Welcome, MsgError> {
        let mut r = R(b);
        r.head(b'A')?;
        let w = Welcome {
            session: r.u32()?,
            tcp_port: r.u16()?,
        };
        r.end()?;
        Ok(w)
    }
}

/// The private data of a refusal: the reason.
pub(super) fn refusal(reason: &str) -> Vec<u8> {
    let mut w = W::default();
    w.0.extend_from_slice(MAGIC);
    w.u8(b'E').text(reason);
    w.0
}

/// The reason of a refusal, if `b` is one.
pub(super) fn refusal_reason(b: &[u8]) -> Option<String> {
    let mut r = R(b);
    r.head(b'E').ok()?;
    Some(r.text())
}

/// The private data of a data connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct DataConn {
    pub(super) session: u32,
    /// Which size of the run (0-based).
    pub(super) round: u32,
    /// Which QP of the round (0-based).
    pub(super) index: u16,
}

impl DataConn {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        w.0.extend_from_slice(MAGIC);
        w.u8(b'D')
            .u8(VERSION)
            .u32(self.session)
            .u32(self.round)
            .u16(self.index);
        w.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<DataConn, MsgError> {
        let mut r = R(b);
        r.head(b'D')?;
        let d = DataConn {
            session: r.u32()?,
            round: r.u32()?,
            index: r.u16()?,
        };
        r.end()?;
        Ok(d)
    }
}

/// A control message.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Control {
    /// Client: the next size, with the client's buffers (its write-latency
    /// sinks), one per QP; its data connections follow.
    Round { size: usize, bufs: Vec<RemoteBuf> },
    /// Server: the data connections are up and its receives posted; its
    /// buffers, one per QP.
    Ready { bufs: Vec<RemoteBuf> },
    /// Client: the run is over; the server waits for this many receives.
    End { recvs: u64 },
    /// Server: it has them.
    Done { recvs: u64 },
    /// Client: its numbers (and the TCP baseline's).
    Result { rdma: Summary, tcp: Option<Summary> },
    /// Client: no more sizes.
    Bye,
    /// Client: a heartbeat during a run (the server ends a run that hears
    /// nothing for its timeout).
    Alive,
    /// Either: a failure, with the reason.
    Error(String),
}

fn put_bufs(w: &mut W, bufs: &[RemoteBuf]) {
    w.u16(bufs.len().min(MAX_QPS) as u16);
    for b in bufs.iter().take(MAX_QPS) {
        w.u64(b.addr).u32(b.rkey).u64(b.len);
    }
}

fn get_bufs(r: &mut R<'_>) -> Result<Vec<RemoteBuf>, MsgError> {
    let n = r.u16()? as usize;
    if n == 0 || n > MAX_QPS {
        return bad(format!("{n} buffers (1..={MAX_QPS})"));
    }
    (0..n)
        .map(|_| {
            Ok(RemoteBuf {
                addr: r.u64()?,
                rkey: r.u32()?,
                len: r.u64()?,
            })
        })
        .collect()
}

fn put_summary(w: &mut W, s: &Summary) {
    w.u64(s.size as u64)
        .u64(s.iters)
        .f64(s.secs)
        .u64(s.lat_n)
        .f64(s.lat_min_us)
        .f64(s.lat_mean_us)
        .f64(s.lat_stdev_us)
        .f64(s.lat_p50_us)
        .f64(s.lat_p99_us)
        .f64(s.lat_p999_us)
        .f64(s.lat_max_us)
        .f64(s.cpu_secs);
}

fn get_summary(r: &mut R<'_>) -> Result<Summary, MsgError> {
    let size = r.u64()?;
    if size == 0 || size > MAX_SIZE as u64 {
        return bad(format!("message size {size}"));
    }
    Ok(Summary {
        size: size as usize,
        iters: r.u64()?,
        secs: r.f64()?,
        lat_n: r.u64()?,
        lat_min_us: r.f64()?,
        lat_mean_us: r.f64()?,
        lat_stdev_us: r.f64()?,
        lat_p50_us: r.f64()?,
        lat_p99_us: r.f64()?,
        lat_p999_us: r.f64()?,
        lat_max_us: r.f64()?,
        cpu_secs: r.f64()?,
    })
}

impl Control {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut w = W::default();
        match self {
            Control::Round { size, bufs } => {
                w.u8(b'R').u64(*size as u64);
                put_bufs(&mut w, bufs);
            }
            Control::Ready { bufs } => {
                w.u8(b'Y');
                put_bufs(&mut w, bufs);
            }
            Control::End { recvs } => {
                w.u8(b'N').u64(*recvs);
            }
            Control::Done { recvs } => {
                w.u8(b'O').u64(*recvs);
            }
            Control::Result { rdma, tcp } => {
                w.u8(b'S');
                put_summary(&mut w, rdma);
                if let Some(t) = tcp {
                    put_summary(&mut w, t);
                }
            }
            Control::Bye => {
                w.u8(b'B');
            }
            Control::Alive => {
                w.u8(b'K');
            }
            Control::Error(m) => {
                w.u8(b'E').text(m);
            }
        }
        w.0
    }

    pub(super) fn decode(b: &[u8]) -> Result<Control, MsgError> {
        let mut r = R(b);
        let m = match r.u8()? {
            b'R' => {
                let size = r.u64()?;
                if size == 0 || size > MAX_SIZE as u64 {
                    return bad(format!("message size {size}"));
                }
                Control::Round {
                    size: size as usize,
                    bufs: get_bufs(&mut r)?,
                }
            }
            b'Y' => Control::Ready {
                bufs: get_bufs(&mut r)?,
            },
            b'N' => Control::End { recvs: r.u64()? },
            b'O' => Control::Done { recvs: r.u64()? },
            b'S' => {
                let rdma = get_summary(&mut r)?;
                let tcp = if r.0.is_empty() {
                    None
                } else {
                    Some(get_summary(&mut r)?)
                };
                Control::Result { rdma, tcp }
            }
            b'B' => Control::Bye,
            b'K' => Control::Alive,
            b'E' => return Ok(Control::Error(r.text())),
            t => return bad(format!("unknown control message '{}'", t.escape_ascii())),
        };
        r.end()?;
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> Hello {
        Hello {
            test: Test::Send,
            mode: Mode::Lat,
            crc: true,
            baseline_tcp: true,
            tcp_spin: true,
            iters: 1000,
            duration: None,
            depth: 16,
            qps: 2,
            inline: 64,
            sizes: super::super::sweep(Test::Write),
        }
    }

    #[test]
    fn round_trips() {
        let h = hello();
        let b = h.encode();
        assert!(b.len() <= 256, "fits MPA private data: {}", b.len());
        assert_eq!(Hello::decode(&b).unwrap(), h);
        let h2 = Hello {
            duration: Some(Duration::from_millis(1500)),
            ..h
        };
        assert_eq!(Hello::decode(&h2.encode()).unwrap(), h2);
        let w = Welcome {
            session: 0xdead_beef,
            tcp_port: 4242,
        };
        assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
        let d = DataConn {
            session: 7,
            round: 3,
            index: 254,
        };
        assert_eq!(DataConn::decode(&d.encode()).unwrap(), d);
        assert_eq!(
            refusal_reason(&refusal("needs --crc")).as_deref(),
            Some("needs --crc")
        );
        let buf = RemoteBuf {
            addr: 0x7f00_0000_1000,
            rkey: 0x1234_5601,
            len: 65536,
        };
        let s = Summary {
            size: 65536,
            iters: 10,
            secs: 0.5,
            lat_n: 10,
            lat_min_us: 1.0,
            lat_mean_us: 2.5,
            lat_stdev_us: 0.5,
            lat_p50_us: 2.0,
            lat_p999_us: 3.5,
            lat_p99_us: 3.0,
            lat_max_us: 4.0,
            cpu_secs: 0.25,
        };
        for m in [
            Control::Round {
                size: 65536,
                bufs: vec![buf; MAX_QPS],
            },
            Control::Ready { bufs: vec![buf] },
            Control::End { recvs: 5 },
            Control::Done { recvs: 5 },
            Control::Result {
                rdma: s,
                tcp: Some(s),
            },
            Control::Result { rdma: s, tcp: None },
            Control::Bye,
            Control::Alive,
            Control::Error("out of memory".into()),
        ] {
            let b = m.encode();
            assert!(b.len() <= MAX_CONTROL);
            assert_eq!(Control::decode(&b).unwrap(), m);
        }
    }

    #[test]
    fn truncated_and_bad_input_is_an_error() {
        let b = hello().encode();
        for n in 0..b.len() {
            assert!(Hello::decode(&b[..n]).is_err(), "{n}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(Hello::decode(&long).is_err());
        let mut v = b.clone();
        v[5] = 9;
        assert!(
            Hello::decode(&v)
                .unwrap_err()
                .to_string()
                .contains("version")
        );
        assert!(Hello::decode(b"hello world").is_err());
        assert!(Welcome::decode(&b).is_err());
        // Out-of-range values.
        for h in [
            Hello {
                depth: 0,
                ..hello()
            },
            Hello {
                qps: 256,
                ..hello()
            },
            Hello {
                iters: 0,
                ..hello()
            },
            Hello {
                sizes: vec![],
                ..hello()
            },
            Hello {
                sizes: vec![MAX_SIZE + 1],
                ..hello()
            },
        ] {
            assert!(Hello::decode(&h.encode()).is_err(), "{h:?}");
        }
        let c = Control::Round {
            size: 8,
            bufs: vec![
                RemoteBuf {
                    addr: 1,
                    rkey: 2,
                    len: 3
                };
                2
            ],
        }
        .encode();
        for n in 0..c.len() {
            assert!(Control::decode(&c[..n]).is_err(), "{n}");
        }
        assert!(Control::decode(b"Z").is_err());
        let mut nan = Control::Result {
            rdma: Summary {
                size: 8,
                ..Summary::default()
            },
            tcp: None,
        }
        .encode();
        nan[17..25].copy_from_slice(&f64::NAN.to_bits().to_le_bytes());
        assert!(Control::decode(&nan).is_err());
        // Arbitrary bytes never panic.
        let mut x = 0x1234_5678u32;
        for len in 0..300 {
            let v: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = Hello::decode(&v);
            let _ = Control::decode(&v);
            let _ = DataConn::decode(&v);
            let _ = refusal_reason(&v);
        }
    }
}
