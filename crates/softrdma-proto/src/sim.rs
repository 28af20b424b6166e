//! Deterministic simulation harness: two [`Connection`]s joined by a
//! simulated byte stream, each with a simulated memory ([`SimMemory`]) that
//! keeps canaries around every granted range.
//!
//! The harness takes its decisions as [`Action`]s from the caller — a seeded
//! PRNG in `tests/sim.rs`, fuzzer bytes in `fuzz/fuzz_targets/core_pair.rs`
//! ([`Action::decode`]) — and checks after every action that
//!
//! * every work request completes at most once, in posting order per queue,
//!   and (at the end, [`Pair::finish`]) exactly once;
//! * data placed is the data sent (receives, RDMA Reads, Writes with
//!   Immediate, atomics), unless bits were flipped without CRC;
//! * nothing is written outside a granted range (every write goes through
//!   [`SimMemory`], which checks bounds and writability; canaries around
//!   every range stay intact);
//! * every Terminate sent carries a code the faults can explain.
//!
//! It reads no clock and no OS randomness: the same actions give the same
//! run, byte for byte.

use std::collections::VecDeque;
use std::fmt::Write as _;

use softrdma_wire::crc::Crc32c;
use softrdma_wire::errcode::{TermCode, TermError};
use softrdma_wire::rdmap::atomic::{AtomicOpcode, AtomicRequestRepr};

use crate::conn::{Config, Connection, TxFpdu};
use crate::mem::{
    InvalidateError, LocalAccessError, LocalOp, Memory, RemoteAccess, RemoteAccessError,
    SharedRecv, Span,
};
use crate::qp_state::QpState;
use crate::types::{
    AsyncKind, Completion, CqKind, LinkAction, Output, RecvWr, SendOp, SendWr, Sge, WcOpcode,
    WcStatus,
};

/// Access bit: the local side may write (receives, sinks).
pub const LOCAL_WRITE: u32 = 1;
/// Access bit: remote RDMA Write.
pub const REMOTE_WRITE: u32 = 2;
/// Access bit: remote RDMA Read.
pub const REMOTE_READ: u32 = 4;
/// Access bit: remote atomics.
pub const REMOTE_ATOMIC: u32 = 8;

/// Canary bytes kept before and after every region.
const GUARD: usize = 16;
/// Canary value.
const CANARY: u8 = 0xa5;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum KeyKind {
    Mr,
    Mw,
}

#[derive(Debug, Clone)]
struct KeyEntry {
    key: u32,
    kind: KeyKind,
    region: usize,
    /// Offset of the granted range inside the region.
    off: usize,
    /// Address of the first granted byte.
    base: u64,
    len: u64,
    access: u32,
    valid: bool,
}

/// A simulated memory: regions with canaries, an STag table with regions
/// and windows, a shared receive queue. Region handles are indices.
#[derive(Debug, Default)]
pub struct SimMemory {
    bufs: Vec<Vec<u8>>,
    writable: Vec<bool>,
    keys: Vec<KeyEntry>,
    next_key: u32,
    /// The shared receive queue (when the connection uses one).
    pub srq: VecDeque<SharedRecv<usize>>,
    /// Every problem the memory saw (writes out of range, to read-only
    /// regions).
    pub violations: Vec<String>,
}

impl SimMemory {
    /// An empty memory; keys start at `key_base` (so both sides' keys
    /// differ).
    #[must_use]
    pub fn new(key_base: u32) -> Self {
        SimMemory {
            next_key: key_base,
            ..SimMemory::default()
        }
    }

    /// Registers a region of `len` bytes filled by `fill`, with `access`;
    /// returns (region, key, address).
    pub fn add_region(
        &mut self,
        len: usize,
        access: u32,
        fill: impl Fn(usize) -> u8,
    ) -> (usize, u32, u64) {
        let r = self.bufs.len();
        let mut b = vec![CANARY; len + 2 * GUARD];
        for i in 0..len {
            if let Some(x) = b.get_mut(GUARD + i) {
                *x = fill(i);
            }
        }
        self.bufs.push(b);
        self.writable
            .push(access & (LOCAL_WRITE | REMOTE_WRITE | REMOTE_ATOMIC) != 0);
        let key = self.next_key;
        self.next_key += 1;
        let base = (r as u64 + 1) << 32;
        self.keys.push(KeyEntry {
            key,
            kind: KeyKind::Mr,
            region: r,
            off: 0,
            base,
            len: len as u64,
            access,
            valid: true,
        });
        (r, key, base)
    }

    /// Creates an unbound memory window; returns its key.
    pub fn add_mw(&mut self) -> u32 {
        let key = self.next_key;
        self.next_key += 1;
        self.keys.push(KeyEntry {
            key,
            kind: KeyKind::Mw,
            region: 0,
            off: 0,
            base: 0,
            len: 0,
            access: 0,
            valid: false,
        });
        key
    }

    /// Whether key `key` is currently valid.
    #[must_use]
    pub fn key_valid(&self, key: u32) -> bool {
        self.keys.iter().any(|k| k.key == key && k.valid)
    }

    /// The bytes of a region (canaries excluded).
    #[must_use]
    pub fn region(&self, r: usize) -> &[u8] {
        self.bufs
            .get(r)
            .and_then(|b| b.get(GUARD..b.len() - GUARD))
            .unwrap_or_default()
    }

    /// Checks every canary.
    ///
    /// # Errors
    ///
    /// The first damaged canary.
    pub fn check_canaries(&self) -> Result<(), String> {
        for (r, b) in self.bufs.iter().enumerate() {
            let n = b.len();
            let head = b.get(..GUARD).unwrap_or_default();
            let tail = b.get(n - GUARD..).unwrap_or_default();
            if head.iter().chain(tail).any(|&c| c != CANARY) {
                return Err(format!("canary of region {r} damaged"));
            }
        }
        Ok(())
    }

    fn entry(&self, key: u32) -> Option<&KeyEntry> {
        self.keys.iter().find(|k| k.key == key)
    }

    fn in_range(&self, s: &Span<usize>, at: usize, n: usize) -> bool {
        self.bufs
            .get(s.region)
            .is_some_and(|b| at + n <= s.len && s.offset + s.len + 2 * GUARD <= b.len())
    }
}

impl Memory for SimMemory {
    type Region = usize;

    fn remote(
        &mut self,
        stag: u32,
        access: RemoteAccess,
        to: u64,
        len: u64,
    ) -> Result<Span<usize>, RemoteAccessError> {
        let Some(k) = self.entry(stag).filter(|k| k.valid) else {
            return Err(RemoteAccessError::InvalidStag);
        };
        let need = match access {
            RemoteAccess::Write => REMOTE_WRITE,
            RemoteAccess::Read => REMOTE_READ,
            RemoteAccess::Atomic => REMOTE_ATOMIC,
        };
        if k.access & need == 0 {
            return Err(RemoteAccessError::AccessRights);
        }
        let Some(end) = to.checked_add(len) else {
            return Err(RemoteAccessError::ToWrap);
        };
        if to < k.base || end > k.base + k.len {
            return Err(RemoteAccessError::BaseOrBounds);
        }
        Ok(Span {
            region: k.region,
            offset: k.off + usize::try_from(to - k.base).unwrap_or(usize::MAX),
            len: usize::try_from(len).unwrap_or(usize::MAX),
        })
    }

    fn local(
        &mut self,
        lkey: u32,
        addr: u64,
        len: u32,
        write: bool,
    ) -> Result<Span<usize>, LocalAccessError> {
        let Some(k) = self
            .entry(lkey)
            .filter(|k| k.valid && k.kind == KeyKind::Mr)
        else {
            return Err(LocalAccessError::InvalidLkey);
        };
        if write && k.access & LOCAL_WRITE == 0 {
            return Err(LocalAccessError::NoLocalWrite);
        }
        let end = addr.checked_add(u64::from(len));
        if addr < k.base || end.is_none_or(|e| e > k.base + k.len) {
            return Err(LocalAccessError::OutOfBounds);
        }
        Ok(Span {
            region: k.region,
            offset: k.off + usize::try_from(addr - k.base).unwrap_or(usize::MAX),
            len: len as usize,
        })
    }

    fn atomic(&mut self, t: &Span<usize>, req: &AtomicRequestRepr) -> Option<u64> {
        let mut b = [0u8; 8];
        if t.len != 8 || !self.copy_out(t, 0, &mut b) {
            return None;
        }
        let v = u64::from_ne_bytes(b);
        let new = match req.opcode {
            AtomicOpcode::FetchAdd => v.wrapping_add(req.add_or_swap_data),
            AtomicOpcode::Swap => {
                (v & !req.add_or_swap_mask) | (req.add_or_swap_data & req.add_or_swap_mask)
            }
            AtomicOpcode::CmpSwap => {
                if (v ^ req.compare_data) & req.compare_mask == 0 {
                    (v & !req.add_or_swap_mask) | (req.add_or_swap_data & req.add_or_swap_mask)
                } else {
                    v
                }
            }
        };
        self.copy_in(t, 0, &new.to_ne_bytes()).then_some(v)
    }

    fn invalidate(&mut self, stag: u32, _remote: bool) -> Result<(), InvalidateError> {
        let Some(k) = self.keys.iter_mut().find(|k| k.key == stag) else {
            return Err(InvalidateError::InvalidStag);
        };
        if k.kind == KeyKind::Mr {
            return Err(InvalidateError::CannotInvalidate);
        }
        k.valid = false;
        Ok(())
    }

    fn local_op(&mut self, op: &LocalOp) -> Result<(), ()> {
        match *op {
            LocalOp::BindMw {
                mw,
                mr,
                addr,
                len,
                access,
                key: _,
            } => {
                let Some(m) = self.entry(mr).filter(|k| k.kind == KeyKind::Mr).cloned() else {
                    return Err(());
                };
                if addr < m.base || addr.saturating_add(len) > m.base + m.len {
                    return Err(());
                }
                let Some(w) = self
                    .keys
                    .iter_mut()
                    .find(|k| k.key == mw && k.kind == KeyKind::Mw)
                else {
                    return Err(());
                };
                w.region = m.region;
                w.off = m.off + usize::try_from(addr - m.base).map_err(|_| ())?;
                w.base = addr;
                w.len = len;
                w.access = access;
                w.valid = true;
                Ok(())
            }
            LocalOp::FastReg { .. } | LocalOp::Invalidate { .. } => Err(()),
        }
    }

    fn srq_pop(&mut self) -> Option<SharedRecv<usize>> {
        self.srq.pop_front()
    }

    fn copy_in(&mut self, dst: &Span<usize>, at: usize, bytes: &[u8]) -> bool {
        if !self.in_range(dst, at, bytes.len()) {
            self.violations.push(format!(
                "write of {} bytes at {at} outside {dst:?}",
                bytes.len()
            ));
            return false;
        }
        if !self.writable.get(dst.region).copied().unwrap_or(false) {
            self.violations
                .push(format!("write into read-only region {}", dst.region));
            return false;
        }
        let start = GUARD + dst.offset + at;
        match self
            .bufs
            .get_mut(dst.region)
            .and_then(|b| b.get_mut(start..start + bytes.len()))
        {
            Some(d) => {
                d.copy_from_slice(bytes);
                true
            }
            None => false,
        }
    }

    fn copy_out(&mut self, src: &Span<usize>, at: usize, out: &mut [u8]) -> bool {
        if !self.in_range(src, at, out.len()) {
            return false;
        }
        let start = GUARD + src.offset + at;
        match self
            .bufs
            .get(src.region)
            .and_then(|b| b.get(start..start + out.len()))
        {
            Some(s) => {
                out.copy_from_slice(s);
                true
            }
            None => false,
        }
    }

    fn crc_update(&mut self, src: &Span<usize>, crc: &mut Crc32c) -> bool {
        if !self.in_range(src, 0, src.len) {
            return false;
        }
        let start = GUARD + src.offset;
        match self
            .bufs
            .get(src.region)
            .and_then(|b| b.get(start..start + src.len))
        {
            Some(s) => {
                crc.update(s);
                true
            }
            None => false,
        }
    }
}

/// The payload pattern of message `id` from side `side`.
#[must_use]
pub fn pattern(side: usize, id: u64, i: usize) -> u8 {
    let x =
        (id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (side as u64) << 7).wrapping_add(i as u64 * 31);
    (x ^ (x >> 13)) as u8
}

/// A decision of the simulation driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Post a receive of `len` bytes on `side` (`len` 0..=4096).
    PostRecv {
        /// 0 or 1.
        side: usize,
        /// Buffer length.
        len: u16,
    },
    /// Post a send-queue request on `side`.
    Post {
        /// 0 or 1.
        side: usize,
        /// Which operation (see [`Pair`]).
        kind: u8,
        /// Payload length.
        len: u16,
        /// Flags: bit 0 unsignaled, bit 1 solicited, bit 2 fence, bit 3 bad
        /// remote key, bit 4 inline, bit 6 with bit 0: internal.
        flags: u8,
    },
    /// `side` frames up to `n` FPDUs into its outgoing stream.
    Transmit {
        /// 0 or 1.
        side: usize,
        /// FPDUs.
        n: u8,
    },
    /// `side` learns that `n` FPDUs it handed out were written.
    Ack {
        /// 0 or 1.
        side: usize,
        /// FPDUs.
        n: u8,
    },
    /// Deliver up to `n` bytes of the stream towards `side` (any
    /// re-segmentation).
    Deliver {
        /// Receiving side.
        side: usize,
        /// Bytes.
        n: u16,
    },
    /// Flip bit `bit` of the byte at `pos` (modulo) of the undelivered
    /// stream towards `side`.
    Flip {
        /// Receiving side.
        side: usize,
        /// Position.
        pos: u16,
        /// Bit.
        bit: u8,
    },
    /// Drop the undelivered bytes beyond `keep` of the stream towards
    /// `side`, then end it (FIN).
    Truncate {
        /// Receiving side.
        side: usize,
        /// Bytes kept.
        keep: u16,
    },
    /// The network resets the connection.
    Reset,
    /// `side` closes gracefully.
    Close {
        /// 0 or 1.
        side: usize,
    },
    /// `side` aborts.
    Abort {
        /// 0 or 1.
        side: usize,
    },
    /// A hostile peer: append a crafted, well-framed FPDU (see
    /// [`hostile`]) to the stream towards `side`; the Terminate `side` sends
    /// about it must carry exactly the expected code.
    Inject {
        /// Receiving side.
        side: usize,
        /// Which violation.
        kind: u8,
    },
    /// Time passes.
    Tick {
        /// Time units.
        dt: u16,
    },
    /// `side` changes its largest FPDU payload
    /// ([`Connection::set_max_payload`]), possibly in the middle of a
    /// message. Not produced by [`Action::decode`] (fuzz inputs keep
    /// their meaning).
    MaxPayload {
        /// 0 or 1.
        side: usize,
        /// The new largest payload (0 is raised to 1).
        max_payload: u16,
    },
}

impl Action {
    /// Decodes one action from fuzzer bytes (5 bytes an action).
    #[must_use]
    pub fn decode(b: [u8; 5]) -> Action {
        let side = usize::from(b[1] & 1);
        let w = u16::from_le_bytes([b[2], b[3]]);
        match b[0] % 16 {
            0 | 1 => Action::PostRecv {
                side,
                len: w % 2048,
            },
            2..=4 => Action::Post {
                side,
                kind: b[1] >> 1,
                len: w % 3000,
                flags: b[4],
            },
            5 | 6 => Action::Transmit { side, n: b[4] % 8 },
            7 => Action::Ack { side, n: b[4] % 8 },
            8..=10 => Action::Deliver { side, n: w },
            11 => Action::Flip {
                side,
                pos: w,
                bit: b[4] % 8,
            },
            12 => Action::Truncate { side, keep: w },
            13 => match b[4] % 4 {
                0 => Action::Reset,
                1 => Action::Abort { side },
                _ => Action::Close { side },
            },
            14 => Action::Tick { dt: w },
            _ => Action::Inject { side, kind: b[4] },
        }
    }
}

/// What the run injects (decides which checks apply).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Faults {
    /// Bits may be flipped.
    pub flips: bool,
    /// Streams may be truncated, reset, aborted.
    pub breaks: bool,
}

/// One direction of the simulated TCP connection.
#[derive(Debug, Default)]
struct Pipe {
    bytes: VecDeque<u8>,
    fin: bool,
    fin_delivered: bool,
    reset: bool,
    reset_delivered: bool,
    /// A flip happened on this direction.
    flipped: bool,
    /// The receiver's connection finished FPDUs up to here.
    delivered: u64,
    /// Bytes written into this direction so far.
    written: u64,
    /// Bytes the receiver consumed so far.
    consumed: u64,
    /// A hostile FPDU starts at this stream offset; its expected Terminate.
    injected: Option<(u64, TermError)>,
}

/// A send-queue request the driver posted.
#[derive(Debug, Clone)]
struct SqRec {
    wr_id: u64,
    op: SendOp,
    signaled: bool,
    /// Posted as the engine's own request (`SendWr::internal`).
    internal: bool,
    len: usize,
    /// Local region of the payload / sink.
    local: usize,
    /// Remote region written (Write) for data checks.
    remote: Option<usize>,
    /// Expected original value (atomics).
    atomic_expect: u64,
    completed: bool,
}

/// A receive the driver posted.
#[derive(Debug, Clone)]
struct RecvRec {
    wr_id: u64,
    region: usize,
    completed: bool,
}

/// One side of the pair.
#[derive(Debug)]
pub struct Node {
    /// The connection.
    pub conn: Connection<usize>,
    /// Its memory.
    pub mem: SimMemory,
    srq: bool,
    sq: Vec<SqRec>,
    rq: Vec<RecvRec>,
    last_sq: Option<usize>,
    last_rq: Option<usize>,
    /// Successful receives consumed by Sends, in order.
    recv_sends: usize,
    /// Successful receives consumed by Writes with Immediate.
    recv_imms: usize,
    unacked: usize,
    read_src: (usize, u32, u64),
    atomic_cell: (usize, u32, u64),
    mw: u32,
    mw_region: (usize, u32, u64),
    atomics_sum: u64,
    next_wr: u64,
    now: u64,
    terminates: Vec<TermCode>,
    rejected: usize,
}

const READ_SRC_LEN: usize = 8192;

impl Node {
    fn new(side: usize, cfg: Config) -> Self {
        let mut mem = SimMemory::new(0x100 * (side as u32 + 1));
        let read_src = mem.add_region(READ_SRC_LEN, REMOTE_READ, |i| pattern(side, 0xfeed, i));
        let atomic_cell = mem.add_region(8, REMOTE_ATOMIC, |_| 0);
        let mw_region = mem.add_region(4096, LOCAL_WRITE, |_| 0);
        let mw = mem.add_mw();
        Node {
            conn: Connection::new(cfg),
            mem,
            srq: cfg.srq,
            sq: Vec::new(),
            rq: Vec::new(),
            last_sq: None,
            last_rq: None,
            recv_sends: 0,
            recv_imms: 0,
            unacked: 0,
            read_src,
            atomic_cell,
            mw,
            mw_region,
            atomics_sum: 0,
            next_wr: 1,
            now: 0,
            terminates: Vec::new(),
            rejected: 0,
        }
    }

    /// Terminate codes this side sent.
    #[must_use]
    pub fn terminates_sent(&self) -> &[TermCode] {
        &self.terminates
    }
}

/// What a run did (to see that the workload reaches every feature).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Successful send-queue completions by opcode: Send, Write, Read,
    /// atomics, local operations.
    pub sends: u64,
    /// Successful RDMA Writes.
    pub writes: u64,
    /// Successful RDMA Reads.
    pub reads: u64,
    /// Successful atomics.
    pub atomics: u64,
    /// Successful memory window binds.
    pub binds: u64,
    /// Successful receives (Send).
    pub recvs: u64,
    /// Successful receives with immediate data.
    pub imms: u64,
    /// Receives taken from an SRQ that completed successfully.
    pub srq_recvs: u64,
    /// Receives that reported an invalidated STag.
    pub invalidations: u64,
    /// Flushed requests.
    pub flushed: u64,
    /// Terminates sent.
    pub terminates: u64,
    /// Graceful closes completed (LLP closed).
    pub graceful_closes: u64,
    /// Posts refused (e.g. a Send in CLOSING).
    pub rejected: u64,
    /// Hostile FPDUs answered with exactly their Terminate code.
    pub hostile_answered: u64,
    /// Sends and Writes posted (accepted) with an inline payload.
    pub inline: u64,
    /// Requests posted (accepted) as the engine's own
    /// (`SendWr::internal`).
    pub internal: u64,
    /// Bits flipped in an undelivered stream ([`Action::Flip`] applied).
    pub flips: u64,
    /// Of [`flips`](Self::flips), those on a connection without CRC.
    pub flips_without_crc: u64,
    /// Streams cut short and ended ([`Action::Truncate`] applied).
    pub truncations: u64,
    /// Connections reset by the network ([`Action::Reset`] applied).
    pub resets: u64,
    /// Sides that aborted ([`Action::Abort`] applied).
    pub aborts: u64,
    /// Graceful closes started ([`Action::Close`]).
    pub closes: u64,
    /// Hostile FPDUs appended to a stream ([`Action::Inject`] applied).
    pub injections: u64,
    /// Changes of the largest FPDU payload ([`Action::MaxPayload`]).
    pub max_payload_changes: u64,
    /// FPDUs received in one pass ([`Connection::one_pass_rx_count`];
    /// counted in builds with debug assertions only, else 0).
    pub one_pass_recvs: u64,
}

impl core::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Stats) {
        self.sends += o.sends;
        self.writes += o.writes;
        self.reads += o.reads;
        self.atomics += o.atomics;
        self.binds += o.binds;
        self.recvs += o.recvs;
        self.imms += o.imms;
        self.srq_recvs += o.srq_recvs;
        self.invalidations += o.invalidations;
        self.flushed += o.flushed;
        self.terminates += o.terminates;
        self.graceful_closes += o.graceful_closes;
        self.rejected += o.rejected;
        self.hostile_answered += o.hostile_answered;
        self.inline += o.inline;
        self.internal += o.internal;
        self.flips += o.flips;
        self.flips_without_crc += o.flips_without_crc;
        self.truncations += o.truncations;
        self.resets += o.resets;
        self.aborts += o.aborts;
        self.closes += o.closes;
        self.injections += o.injections;
        self.max_payload_changes += o.max_payload_changes;
        self.one_pass_recvs += o.one_pass_recvs;
    }
}

/// Two connections joined by a simulated stream, with the checks of the
/// [module docs](self).
#[derive(Debug)]
pub struct Pair {
    /// What the run did so far.
    pub stats: Stats,
    /// The two sides.
    pub nodes: [Node; 2],
    /// `pipes[i]`: the stream towards side `i`.
    pipes: [Pipe; 2],
    faults: Faults,
    crc: bool,
    /// What happened, for a failure report.
    pub log: String,
    tx: TxFpdu<usize>,
    steps: u64,
}

impl Pair {
    /// A connected pair. `srq`: side 1 takes its receives from an SRQ.
    /// `message_info[i]`: side `i` reports what each receive carried
    /// ([`Config::message_info`], checked against its completions); a
    /// side without it and without an SRQ receives whole single-FPDU Sends
    /// in one pass ([`Connection::set_one_pass_rx`]).
    #[must_use]
    pub fn new(
        crc: bool,
        max_payload: usize,
        ird_ord: u32,
        srq: bool,
        message_info: [bool; 2],
        faults: Faults,
    ) -> Self {
        let mut c = Config::new(crc);
        c.max_payload = max_payload.max(1);
        c.ird = ird_ord;
        c.ord = ird_ord;
        c.close_timeout = 1000;
        let mut c1 = c;
        c.message_info = message_info[0];
        c1.message_info = message_info[1];
        c1.srq = srq;
        // Fuzzing builds (`--cfg fuzzing`) skip the CRC check in the wire
        // codecs: for the checks, CRC is then off.
        let crc = crc && !cfg!(fuzzing);
        Pair {
            nodes: [Node::new(0, c), Node::new(1, c1)],
            pipes: [Pipe::default(), Pipe::default()],
            faults,
            crc,
            stats: Stats::default(),
            log: String::new(),
            tx: TxFpdu::new(),
            steps: 0,
        }
    }

    /// Applies one action, then checks the invariants.
    ///
    /// # Errors
    ///
    /// The first invariant broken.
    pub fn step(&mut self, a: Action) -> Result<(), String> {
        self.steps += 1;
        let _ = writeln!(self.log, "{:>5} {a:?}", self.steps);
        match a {
            Action::PostRecv { side, len } => self.post_recv(side, usize::from(len)),
            Action::Post {
                side,
                kind,
                len,
                flags,
            } => self.post(side, kind, usize::from(len), flags),
            Action::Transmit { side, n } => self.transmit(side, usize::from(n)),
            Action::Ack { side, n } => {
                let node = &mut self.nodes[side];
                let k = usize::from(n).min(node.unacked);
                node.unacked -= k;
                node.conn.handle_sent(k);
            }
            Action::Deliver { side, n } => self.deliver(side, usize::from(n)),
            Action::Flip { side, pos, bit } => {
                if self.faults.flips {
                    let p = &mut self.pipes[side];
                    let len = p.bytes.len();
                    if len > 0 {
                        if let Some(b) = p.bytes.get_mut(usize::from(pos) % len) {
                            *b ^= 1 << (bit % 8);
                        }
                        p.flipped = true;
                        self.stats.flips += 1;
                        if !self.crc {
                            self.stats.flips_without_crc += 1;
                        }
                    }
                }
            }
            Action::Truncate { side, keep } => {
                if self.faults.breaks {
                    let p = &mut self.pipes[side];
                    p.bytes.truncate(usize::from(keep));
                    p.fin = true;
                    self.stats.truncations += 1;
                }
            }
            Action::Reset => {
                if self.faults.breaks {
                    for p in &mut self.pipes {
                        p.reset = true;
                    }
                    self.stats.resets += 1;
                }
            }
            Action::Close { side } => {
                let now = self.nodes[side].now;
                self.nodes[side].conn.close(now);
                self.stats.closes += 1;
            }
            Action::Abort { side } => {
                if self.faults.breaks {
                    self.nodes[side].conn.abort();
                    self.stats.aborts += 1;
                }
            }
            Action::Inject { side, kind } => {
                let p = &mut self.pipes[side];
                if !p.fin && !p.reset && p.injected.is_none() {
                    let (ulpdu, code) = hostile(kind);
                    let mut buf = vec![0u8; ulpdu.len() + 8];
                    if let Ok(n) = softrdma_wire::fpdu::emit(
                        &ulpdu,
                        self.nodes[side].conn.config().crc,
                        &mut buf,
                    ) {
                        p.injected = Some((p.written, code));
                        p.written += n as u64;
                        p.bytes.extend(buf.get(..n).unwrap_or_default());
                        self.stats.injections += 1;
                    }
                }
            }
            Action::MaxPayload { side, max_payload } => {
                let c = &mut self.nodes[side].conn;
                let kept = c.set_max_payload(usize::from(max_payload));
                if kept != usize::from(max_payload).max(1) {
                    return Err(format!("max payload {max_payload} kept as {kept}"));
                }
                self.stats.max_payload_changes += 1;
            }
            Action::Tick { dt } => {
                for n in &mut self.nodes {
                    n.now += u64::from(dt);
                    let now = n.now;
                    n.conn.handle_timeout(now);
                }
            }
        }
        self.drain_outputs()?;
        self.stats.one_pass_recvs = self
            .nodes
            .iter()
            .map(|n| n.conn.one_pass_rx_count().unwrap_or(0))
            .sum();
        self.check()
    }

    fn post_recv(&mut self, side: usize, len: usize) {
        let node = &mut self.nodes[side];
        let (r, key, addr) = node.mem.add_region(len, LOCAL_WRITE, |_| 0);
        let wr_id = node.next_wr;
        node.next_wr += 1;
        let sge = [Sge {
            lkey: key,
            addr,
            len: u32::try_from(len).unwrap_or(0),
        }];
        if node.srq {
            let Ok(span) = node.mem.local(key, addr, sge[0].len, true) else {
                return;
            };
            node.mem.srq.push_back(SharedRecv {
                wr_id,
                segs: vec![span],
            });
        } else if node
            .conn
            .post_recv(&RecvWr { wr_id, sgl: &sge }, &mut node.mem)
            .is_err()
        {
            node.rejected += 1;
            self.stats.rejected += 1;
            return;
        }
        node.rq.push(RecvRec {
            wr_id,
            region: r,
            completed: false,
        });
    }

    fn post(&mut self, side: usize, kind: u8, len: usize, flags: u8) {
        let peer = 1 - side;
        let bad = flags & 8 != 0 && kind % 16 == 15;
        let (peer_read, peer_cell, peer_mw, peer_mw_valid) = {
            let p = &self.nodes[peer];
            (p.read_src, p.atomic_cell, p.mw, p.mem.key_valid(p.mw))
        };
        // A Write target on the peer, fresh per Write (data checks).
        let new_target =
            |n: &mut Node, len: usize| n.mem.add_region(len.max(1), REMOTE_WRITE, |_| 0);
        let node_id = side;
        let wr_id = self.nodes[side].next_wr;
        let choice = kind % 16;
        let mut remote = None;
        let mut atomic_expect = 0;
        let (op, sgl_len, local_access) = match choice {
            0..=4 => (
                SendOp::Send {
                    inv: None,
                    imm: None,
                },
                len,
                0,
            ),
            5 => (
                SendOp::Send {
                    inv: None,
                    imm: Some(wr_id as u32),
                },
                len,
                0,
            ),
            6 if peer_mw_valid => (
                SendOp::Send {
                    inv: Some(peer_mw),
                    imm: None,
                },
                len,
                0,
            ),
            6..=8 => {
                let t = new_target(&mut self.nodes[peer], len);
                remote = Some(t.0);
                (
                    SendOp::Write {
                        rkey: t.1,
                        remote_addr: t.2,
                        imm: (choice == 8).then_some(wr_id as u32),
                    },
                    len,
                    0,
                )
            }
            9 | 10 => {
                let l = len.min(READ_SRC_LEN);
                let off = (usize::from(flags) * 17) % (READ_SRC_LEN - l + 1);
                (
                    SendOp::Read {
                        rkey: peer_read.1,
                        remote_addr: peer_read.2 + off as u64,
                    },
                    l,
                    LOCAL_WRITE,
                )
            }
            11 => {
                let add = u64::from(flags) + 1;
                atomic_expect = self.nodes[side].atomics_sum;
                self.nodes[side].atomics_sum += add;
                (
                    SendOp::FetchAdd {
                        rkey: peer_cell.1,
                        remote_addr: peer_cell.2,
                        add,
                    },
                    8,
                    LOCAL_WRITE,
                )
            }
            12 => {
                let e = self.nodes[side].atomics_sum;
                atomic_expect = e;
                let add = u64::from(flags) + 1;
                self.nodes[side].atomics_sum += add;
                (
                    SendOp::CmpSwap {
                        rkey: peer_cell.1,
                        remote_addr: peer_cell.2,
                        compare: e,
                        swap: e + add,
                    },
                    8,
                    LOCAL_WRITE,
                )
            }
            13 => {
                let n = &self.nodes[side];
                let l = (len % 4096) as u64;
                (
                    SendOp::Local(LocalOp::BindMw {
                        mw: n.mw,
                        mr: n.mw_region.1,
                        addr: n.mw_region.2,
                        len: l,
                        access: REMOTE_WRITE,
                        key: None,
                    }),
                    0,
                    0,
                )
            }
            14 => {
                let addr = self.nodes[peer].mw_region.2;
                (
                    SendOp::Write {
                        rkey: peer_mw,
                        remote_addr: addr,
                        imm: None,
                    },
                    len % 64 + 1,
                    0,
                )
            }
            _ => {
                // A request with a bad remote key (hostile on purpose) or a
                // Write of zero length.
                let rkey = if bad { 0xdead_beef } else { peer_read.1 };
                (
                    SendOp::Read {
                        rkey,
                        remote_addr: peer_read.2,
                    },
                    len.min(64),
                    LOCAL_WRITE,
                )
            }
        };
        let _ = node_id;
        let node = &mut self.nodes[side];
        let (local, key, addr) = node
            .mem
            .add_region(sgl_len, local_access, |i| pattern(side, wr_id, i));
        let sge = [Sge {
            lkey: key,
            addr,
            len: u32::try_from(sgl_len).unwrap_or(0),
        }];
        let sgl: &[Sge] = if matches!(op, SendOp::Local(_)) {
            &[]
        } else {
            &sge
        };
        // Sometimes the same bytes go inline (copied at post, no SGE).
        let inline_data: Option<Vec<u8>> = (flags & 16 != 0
            && matches!(op, SendOp::Send { .. } | SendOp::Write { .. })
            && sgl_len <= node.conn.config().max_inline)
            .then(|| (0..sgl_len).map(|i| pattern(side, wr_id, i)).collect());
        let wr = SendWr {
            wr_id,
            op,
            sgl: if inline_data.is_some() { &[] } else { sgl },
            signaled: flags & 1 == 0,
            fence: flags & 4 != 0,
            solicited: flags & 2 != 0,
            inline: inline_data.as_deref(),
            // Sometimes an unsignaled request is the engine's own (a proxy
            // reply): its completion is reported all the same.
            internal: flags & 1 != 0 && flags & 64 != 0,
        };

        node.next_wr += 1;
        match node.conn.post_send(&wr, &mut node.mem) {
            Ok(()) => {
                if inline_data.is_some() {
                    self.stats.inline += 1;
                }
                if wr.internal {
                    self.stats.internal += 1;
                }
                node.sq.push(SqRec {
                    wr_id,
                    op,
                    signaled: wr.signaled,
                    internal: wr.internal,
                    len: sgl.iter().map(|s| s.len as usize).sum(),
                    local,
                    remote,
                    atomic_expect,
                    completed: false,
                });
            }
            Err(_) => {
                node.rejected += 1;
                self.stats.rejected += 1;
                if matches!(op, SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. }) {
                    // Not posted: undo the expectation.
                    let add = match op {
                        SendOp::FetchAdd { add, .. } => add,
                        SendOp::CmpSwap { swap, compare, .. } => swap - compare,
                        _ => 0,
                    };
                    node.atomics_sum -= add;
                }
            }
        }
    }

    fn transmit(&mut self, side: usize, n: usize) {
        let peer = 1 - side;
        for _ in 0..n {
            let node = &mut self.nodes[side];
            if !node.conn.poll_transmit(&mut node.mem, &mut self.tx) {
                break;
            }
            let mut bytes = Vec::with_capacity(self.tx.len());
            if !self.tx.write_to(&mut node.mem, &mut bytes) {
                self.log.push_str("transmit: payload unreadable\n");
            }
            node.unacked += 1;
            if let Err(e) = check_terminate_shape(&bytes, self.crc, &node.terminates) {
                self.log.push_str(&e);
                node.mem.violations.push(e);
            }
            let h = self.tx.head();
            let _ = writeln!(
                self.log,
                "      side {side} sends FPDU of {} bytes, header {:02x?}",
                bytes.len(),
                h.get(..h.len().min(20)).unwrap_or_default()
            );
            let p = &mut self.pipes[peer];
            if !p.fin && !p.reset {
                p.written += bytes.len() as u64;
                p.bytes.extend(bytes);
            }
        }
    }

    fn deliver(&mut self, side: usize, n: usize) {
        let p = &mut self.pipes[side];
        let node = &mut self.nodes[side];
        if p.reset {
            if !p.reset_delivered {
                p.reset_delivered = true;
                p.bytes.clear();
                node.conn.handle_reset();
            }
            return;
        }
        let k = n.min(p.bytes.len());
        if k > 0 {
            let chunk: Vec<u8> = p.bytes.drain(..k).collect();
            let was = node.conn.rx_want() != crate::conn::RxWant::Closed;
            let used = node.conn.handle_rx_stream(&chunk, &mut node.mem);
            p.consumed += used as u64;
            if was && node.conn.rx_want() != crate::conn::RxWant::Closed {
                p.delivered += used as u64;
            }
            return;
        }
        if p.fin && !p.fin_delivered {
            p.fin_delivered = true;
            let now = node.now;
            node.conn.handle_fin(now);
        }
    }

    fn drain_outputs(&mut self) -> Result<(), String> {
        for side in 0..2 {
            while let Some(o) = self.nodes[side].conn.poll_output() {
                let _ = writeln!(self.log, "      side {side}: {o:?}");
                match o {
                    Output::Link(LinkAction::SendFin | LinkAction::Shutdown) => {
                        self.pipes[1 - side].fin = true;
                    }
                    Output::Link(LinkAction::Reset) => {
                        self.pipes[1 - side].reset = true;
                        self.pipes[side].bytes.clear();
                        self.pipes[side].reset = true;
                        self.pipes[side].reset_delivered = true;
                    }
                    Output::Event(ev) => {
                        if let Some(code) = ev.term
                            && matches!(
                                ev.kind,
                                AsyncKind::QpFatal
                                    | AsyncKind::QpRequestError
                                    | AsyncKind::QpAccessError
                            )
                        {
                            self.nodes[side].terminates.push(code);
                            self.stats.terminates += 1;
                            self.check_terminate(side, code)?;
                            let p = &self.pipes[side];
                            if p.injected.is_some_and(|(at, want)| {
                                p.consumed > at && code.known() == Some(want)
                            }) {
                                self.stats.hostile_answered += 1;
                            }
                        }
                    }
                    Output::State { to, .. } => {
                        if to == QpState::Idle {
                            self.stats.graceful_closes += 1;
                        }
                    }
                }
            }
            self.check_completions(side)?;
        }
        Ok(())
    }

    /// A Terminate `side` sent must be explained by the run: the peer's
    /// behaviour (no receive posted, receive too small, a bad key on
    /// purpose, a window invalidated) or an injected fault.
    fn check_terminate(&self, side: usize, code: TermCode) -> Result<(), String> {
        let incoming = &self.pipes[side];
        if !self.crc && self.pipes.iter().any(|p| p.flipped) {
            // Undetected corruption in either direction (a request changed
            // on its way changes its response) explains anything.
            return Ok(());
        }
        let e = code.known();
        if let Some((at, want)) = incoming.injected
            && incoming.consumed > at
        {
            // The Terminate is about the hostile FPDU: exactly its code
            // (or, if bits were flipped too, what the flip explains).
            if e == Some(want) {
                return Ok(());
            }
            if !incoming.flipped {
                return Err(format!(
                    "side {side} answered a hostile FPDU ({want:?}) with {code}"
                ));
            }
        }
        let ok = match e {
            Some(TermError::DdpUntaggedNoBuffer | TermError::DdpUntaggedMessageTooLong) => true,
            Some(TermError::DdpTaggedInvalidStag | TermError::RdmapInvalidStag) => true,
            Some(TermError::DdpTaggedBaseOrBounds) => true, // window bound shorter
            Some(TermError::RdmapOperationCannotInvalidate) => true, // window already gone
            Some(TermError::MpaCrcError) | Some(crate::term::MALFORMED_HEADER) => incoming.flipped,
            // A placed segment's header is judged before its CRC (as siw
            // does): a bit flipped in it gives that header's verdict, any
            // DDP or RDMAP one. Never a local catastrophe.
            Some(TermError::DdpLocalCatastrophic) => false,
            Some(_) => incoming.flipped,
            _ => false,
        };
        if ok {
            Ok(())
        } else {
            Err(format!("side {side} sent an unexplained Terminate {code}"))
        }
    }

    fn check_completions(&mut self, side: usize) -> Result<(), String> {
        let data_ok = self.crc || !(self.pipes[0].flipped || self.pipes[1].flipped);
        let with_info = self.nodes[side].conn.config().message_info;
        while let Some((c, info)) = self.nodes[side].conn.poll_completion_with_info() {
            // With message info, every successful receive reports what it
            // carried (proxy offload), nothing else does; without, nothing.
            let info_ok = match (&info, c.cq, c.status, c.opcode) {
                (Some(_), _, _, _) if !with_info => false,
                (None, CqKind::Recv, WcStatus::Success, _) => !with_info,
                (Some(_), CqKind::Send, _, _) => false,
                (Some(_), CqKind::Recv, s, _) if s != WcStatus::Success => false,
                (Some(crate::conn::MsgInfo::Send { segs, inv, .. }), _, _, op) => {
                    op == WcOpcode::Recv
                        && *inv == c.invalidated
                        && segs.iter().map(|x| x.len).sum::<usize>() >= c.byte_len as usize
                }
                (Some(crate::conn::MsgInfo::Write { .. }), _, _, op) => {
                    op == WcOpcode::RecvRdmaWithImm
                }
                _ => true,
            };
            if !info_ok {
                return Err(format!("side {side}: {c:?} reported message info {info:?}"));
            }
            let _ = writeln!(self.log, "      side {side}: {c:?}");
            let st = &mut self.stats;
            if c.status == WcStatus::WrFlush {
                st.flushed += 1;
            } else if c.status.is_success() {
                match c.opcode {
                    WcOpcode::Send => st.sends += 1,
                    WcOpcode::RdmaWrite => st.writes += 1,
                    WcOpcode::RdmaRead => st.reads += 1,
                    WcOpcode::CompSwap | WcOpcode::FetchAdd => st.atomics += 1,
                    WcOpcode::BindMw => st.binds += 1,
                    WcOpcode::Recv => st.recvs += 1,
                    WcOpcode::RecvRdmaWithImm => st.imms += 1,
                    WcOpcode::LocalInv | WcOpcode::RegMr => {}
                }
                if c.invalidated.is_some() {
                    st.invalidations += 1;
                }
                if c.cq == CqKind::Recv && self.nodes[side].srq {
                    st.srq_recvs += 1;
                }
            }
            match c.cq {
                CqKind::Send => self.check_sq_completion(side, &c, data_ok)?,
                CqKind::Recv => self.check_rq_completion(side, &c, data_ok)?,
            }
        }
        Ok(())
    }

    fn check_sq_completion(
        &mut self,
        side: usize,
        c: &Completion,
        data_ok: bool,
    ) -> Result<(), String> {
        let peer = 1 - side;
        let node = &mut self.nodes[side];
        let Some(i) = node.sq.iter().position(|r| r.wr_id == c.wr_id) else {
            return Err(format!(
                "side {side}: completion for unknown send wr {}",
                c.wr_id
            ));
        };
        if node.last_sq.is_some_and(|l| i <= l) {
            return Err(format!(
                "side {side}: send wr {} completed out of order",
                c.wr_id
            ));
        }
        node.last_sq = Some(i);
        let rec = &mut node.sq[i];
        if rec.completed {
            return Err(format!("side {side}: send wr {} completed twice", c.wr_id));
        }
        rec.completed = true;
        if c.internal != rec.internal {
            return Err(format!(
                "side {side}: send wr {} reported internal = {}",
                c.wr_id, c.internal
            ));
        }
        if c.status != WcStatus::Success {
            return Ok(());
        }
        if !rec.signaled && !rec.internal {
            return Err(format!(
                "side {side}: unsignaled wr {} reported success",
                c.wr_id
            ));
        }
        let rec = rec.clone();
        let peer_flip_free = data_ok;
        match rec.op {
            SendOp::Read { remote_addr, .. } if peer_flip_free => {
                let src = &self.nodes[peer];
                let off = usize::try_from(remote_addr - src.read_src.2).unwrap_or(0);
                let want = src.mem.region(src.read_src.0).get(off..off + rec.len);
                let got = node_region(&self.nodes[side], rec.local);
                if want != Some(got) || c.byte_len as usize != rec.len {
                    return Err(format!(
                        "side {side}: Read wr {} placed wrong data",
                        c.wr_id
                    ));
                }
            }
            SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. } if peer_flip_free => {
                let got = node_region(&self.nodes[side], rec.local);
                let v = got.try_into().map(u64::from_ne_bytes).unwrap_or(u64::MAX);
                if v != rec.atomic_expect {
                    return Err(format!(
                        "side {side}: atomic wr {} returned {v}, expected {}",
                        c.wr_id, rec.atomic_expect
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn check_rq_completion(
        &mut self,
        side: usize,
        c: &Completion,
        data_ok: bool,
    ) -> Result<(), String> {
        let peer = 1 - side;
        let node = &mut self.nodes[side];
        let Some(i) = node.rq.iter().position(|r| r.wr_id == c.wr_id) else {
            return Err(format!(
                "side {side}: completion for unknown receive {}",
                c.wr_id
            ));
        };
        if node.last_rq.is_some_and(|l| i <= l) {
            return Err(format!(
                "side {side}: receive {} completed out of order",
                c.wr_id
            ));
        }
        node.last_rq = Some(i);
        if node.rq[i].completed {
            return Err(format!("side {side}: receive {} completed twice", c.wr_id));
        }
        node.rq[i].completed = true;
        if c.status != WcStatus::Success || !data_ok {
            // Undetected corruption (flips without CRC) may change any field.
            return Ok(());
        }
        let region = node.rq[i].region;
        match c.opcode {
            WcOpcode::Recv => {
                let k = node.recv_sends;
                node.recv_sends += 1;
                let Some(s) = self.nodes[peer]
                    .sq
                    .iter()
                    .filter(|r| matches!(r.op, SendOp::Send { .. }))
                    .nth(k)
                    .cloned()
                else {
                    return Err(format!("side {side}: receive {} matches no Send", c.wr_id));
                };
                let SendOp::Send { inv, imm } = s.op else {
                    return Ok(());
                };
                if c.byte_len as usize != s.len || c.imm != imm || c.invalidated != inv {
                    return Err(format!(
                        "side {side}: receive {} got {c:?} for Send wr {} of {} bytes",
                        c.wr_id, s.wr_id, s.len
                    ));
                }
                if data_ok {
                    let got = node_region(&self.nodes[side], region).get(..s.len);
                    let want = node_region(&self.nodes[peer], s.local);
                    if got != Some(want) {
                        return Err(format!("side {side}: receive {} data differs", c.wr_id));
                    }
                }
            }
            WcOpcode::RecvRdmaWithImm => {
                let k = node.recv_imms;
                node.recv_imms += 1;
                let Some(w) = self.nodes[peer]
                    .sq
                    .iter()
                    .filter(|r| matches!(r.op, SendOp::Write { imm: Some(_), .. }))
                    .nth(k)
                    .cloned()
                else {
                    return Err(format!(
                        "side {side}: imm receive {} matches no Write",
                        c.wr_id
                    ));
                };
                let SendOp::Write { imm, .. } = w.op else {
                    return Ok(());
                };
                if c.imm != imm {
                    return Err(format!("side {side}: imm {:?} != {imm:?}", c.imm));
                }
                if data_ok && let Some(t) = w.remote {
                    let got = node_region(&self.nodes[side], t).get(..w.len);
                    let want = node_region(&self.nodes[peer], w.local);
                    if got != Some(want) {
                        return Err(format!("side {side}: Write wr {} data differs", w.wr_id));
                    }
                }
            }
            op => return Err(format!("side {side}: receive completed as {op:?}")),
        }
        Ok(())
    }

    fn check(&self) -> Result<(), String> {
        for (i, n) in self.nodes.iter().enumerate() {
            if let Some(v) = n.mem.violations.first() {
                return Err(format!("side {i}: memory violation: {v}"));
            }
            n.mem
                .check_canaries()
                .map_err(|e| format!("side {i}: {e}"))?;
        }
        Ok(())
    }

    /// Ends the run: lets everything settle (all bytes transmitted,
    /// acknowledged and delivered, time past every timeout), then aborts
    /// both sides, and checks that every work request completed exactly
    /// once.
    ///
    /// # Errors
    ///
    /// The first invariant broken.
    pub fn finish(&mut self) -> Result<(), String> {
        for _ in 0..10_000 {
            let before = self.progress_mark();
            for side in 0..2 {
                self.step(Action::Transmit { side, n: 64 })?;
                let n = core::mem::take(&mut self.nodes[side].unacked);
                self.nodes[side].conn.handle_sent(n);
                self.drain_outputs()?;
                self.step(Action::Deliver { side, n: u16::MAX })?;
            }
            if self.progress_mark() == before {
                break;
            }
        }
        self.step(Action::Tick { dt: 5000 })?;
        for side in 0..2 {
            self.nodes[side].conn.abort();
        }
        self.drain_outputs()?;
        for (side, n) in self.nodes.iter().enumerate() {
            if n.unacked > 0 && !n.conn.is_done() {
                return Err(format!("side {side}: FPDUs never acknowledged"));
            }
            for r in &n.sq {
                if (r.signaled || r.internal) && !r.completed {
                    return Err(format!("side {side}: send wr {} never completed", r.wr_id));
                }
            }
            let in_srq: Vec<u64> = n.mem.srq.iter().map(|s| s.wr_id).collect();
            for r in &n.rq {
                if !r.completed && !in_srq.contains(&r.wr_id) {
                    return Err(format!("side {side}: receive {} never completed", r.wr_id));
                }
            }
            if n.conn.state() != QpState::Error {
                return Err(format!("side {side}: not in ERROR after abort"));
            }
        }
        self.check()
    }

    fn progress_mark(&self) -> (u64, u64, usize, usize, bool, bool) {
        (
            self.pipes[0].written,
            self.pipes[1].written,
            self.pipes[0].bytes.len(),
            self.pipes[1].bytes.len(),
            self.pipes[0].fin_delivered,
            self.pipes[1].fin_delivered,
        )
    }

    /// How many operations each side posted successfully (for statistics).
    #[must_use]
    pub fn posted(&self) -> usize {
        self.nodes.iter().map(|n| n.sq.len() + n.rq.len()).sum()
    }
}

fn node_region(n: &Node, r: usize) -> &[u8] {
    n.mem.region(r)
}

/// Fuzzing entry: one connection after a valid negotiation receives
/// arbitrary bytes. Byte 0: bit 0 CRC. The victim has a Write target
/// (key 0x10), a Read source (0x11), an atomic cell (0x12), two posted
/// receives and an outstanding Read and atomic (so Read and Atomic
/// Responses have something to match). The rest of the input is the
/// stream, fed once whole and once byte by byte, and once whole with the
/// one-pass receive of single-FPDU Sends off
/// ([`Connection::set_one_pass_rx`]): all three runs must give the same
/// completions, outputs, FPDUs sent (a Terminate) and memory, and the
/// runs with and without the one pass the same connection state (its
/// `Debug` form once the stream is fed; a split stream may leave the
/// deframer elsewhere after an error). Then every posted request must
/// complete exactly once and nothing may be written outside a granted
/// range.
///
/// # Errors
///
/// The invariant broken.
pub fn fuzz_rx(data: &[u8]) -> Result<(), String> {
    let (flags, stream) = data.split_first().unwrap_or((&0, &[]));
    let whole = rx_victim(flags & 1 != 0, true, &[stream])?;
    let bytes: Vec<&[u8]> = stream.chunks(1).collect();
    let split = rx_victim(flags & 1 != 0, true, &bytes)?;
    if (
        &whole.completions,
        &whole.outputs,
        &whole.sent,
        &whole.memory,
    ) != (
        &split.completions,
        &split.outputs,
        &split.sent,
        &split.memory,
    ) {
        return Err(format!(
            "segmentation changed the outcome:\n whole: {whole:?}\n split: {split:?}"
        ));
    }
    let general = rx_victim(flags & 1 != 0, false, &[stream])?;
    if whole != general {
        return Err(format!(
            "the one-pass receive changed the outcome:\n one pass: {whole:?}\n general: {general:?}"
        ));
    }
    Ok(())
}

/// What the receive victim did.
#[derive(Debug, PartialEq)]
struct RxOutcome {
    /// Its connection once the stream was fed (`Debug` form, without the
    /// one-pass switch and count).
    state: String,
    completions: Vec<Completion>,
    outputs: Vec<Output>,
    /// The FPDUs it sent once the stream was fed (a Terminate).
    sent: Vec<Vec<u8>>,
    memory: String,
}

/// The `Debug` form of `c` without its one-pass switch and count
/// ([`Connection::set_one_pass_rx`]), which are not part of what the
/// connection did.
pub(crate) fn state_without_one_pass<R: core::fmt::Debug>(c: &Connection<R>) -> String {
    let mut state = format!("{c:?}");
    if let Some(at) = state.find(", one_pass: ")
        && let Some(end) = state[at..].find(" }")
    {
        state.replace_range(at..at + end, "");
    }
    state
}

/// Runs the receive victim over `chunks`; returns its completions,
/// outputs and memory.
fn rx_victim(crc: bool, one_pass: bool, chunks: &[&[u8]]) -> Result<RxOutcome, String> {
    let mut m = SimMemory::new(0x10);
    let write = m.add_region(64, REMOTE_WRITE, |_| 0);
    let _read = m.add_region(64, REMOTE_READ, |i| i as u8);
    let _cell = m.add_region(8, REMOTE_ATOMIC, |_| 7);
    let mut c: Connection<usize> = Connection::new(Config::new(crc));
    c.set_one_pass_rx(one_pass);
    let mut ids = Vec::new();
    for wr_id in 1..=2u64 {
        let (_, k, a) = m.add_region(48, LOCAL_WRITE, |_| 0);
        let sgl = [
            Sge {
                lkey: k,
                addr: a,
                len: 16,
            },
            Sge {
                lkey: k,
                addr: a + 24,
                len: 24,
            },
        ];
        c.post_recv(&RecvWr { wr_id, sgl: &sgl }, &mut m)
            .map_err(|e| e.to_string())?;
        ids.push((CqKind::Recv, wr_id));
    }
    let (_, k, a) = m.add_region(32, LOCAL_WRITE, |_| 0);
    let sink = [Sge {
        lkey: k,
        addr: a,
        len: 32,
    }];
    let read = SendWr::new(
        3,
        SendOp::Read {
            rkey: 0x99,
            remote_addr: 0,
        },
        &sink,
    );
    c.post_send(&read, &mut m).map_err(|e| e.to_string())?;
    let (_, k, a) = m.add_region(8, LOCAL_WRITE, |_| 0);
    let res = [Sge {
        lkey: k,
        addr: a,
        len: 8,
    }];
    let fa = SendWr::new(
        4,
        SendOp::FetchAdd {
            rkey: 0x98,
            remote_addr: 0,
            add: 1,
        },
        &res,
    );
    c.post_send(&fa, &mut m).map_err(|e| e.to_string())?;
    ids.push((CqKind::Send, 3));
    ids.push((CqKind::Send, 4));
    let mut tx = TxFpdu::new();
    let mut sent = 0;
    while c.poll_transmit(&mut m, &mut tx) {
        sent += 1;
    }
    c.handle_sent(sent);
    for ch in chunks {
        c.handle_rx_stream(ch, &mut m);
    }
    let state = state_without_one_pass(&c);
    c.handle_fin(0);
    let mut sent = Vec::new();
    while c.poll_transmit(&mut m, &mut tx) {
        let mut v = Vec::new();
        if !tx.write_to(&mut m, &mut v) {
            return Err(format!("an FPDU sent is unreadable: {:?}", tx.head()));
        }
        sent.push(v);
    }
    c.handle_sent(sent.len());
    c.abort();
    let comps: Vec<Completion> = std::iter::from_fn(|| c.poll_completion()).collect();
    let outs: Vec<Output> = std::iter::from_fn(|| c.poll_output()).collect();
    for id in &ids {
        let n = comps.iter().filter(|x| (x.cq, x.wr_id) == *id).count();
        if n != 1 {
            return Err(format!("{id:?} completed {n} times: {comps:?}"));
        }
    }
    if let Some(v) = m.violations.first() {
        return Err(v.clone());
    }
    m.check_canaries()?;
    let _ = write;
    Ok(RxOutcome {
        state,
        completions: comps,
        outputs: outs,
        sent,
        memory: format!("{:?}", m.bufs),
    })
}

/// Fuzzing entry: a [`Pair`] driven by fuzzer-chosen actions. Byte 0: bit
/// 0 CRC, bit 1 SRQ, bits 2-3 FPDU size, bit 4 flips, bit 5 breaks, bits
/// 6-7 which sides report message info (0: side 1 only, 1: both, 2:
/// neither, 3: side 0 only; a side without it nor an SRQ receives whole
/// single-FPDU Sends in one pass); then 5 bytes an [`Action`]
/// ([`Action::decode`]).
///
/// # Errors
///
/// The invariant broken, with the log.
pub fn fuzz_pair(data: &[u8]) -> Result<(), String> {
    fuzz_pair_stats(data).map(|_| ())
}

/// [`fuzz_pair`], returning what the run did.
///
/// # Errors
///
/// The invariant broken, with the log.
pub fn fuzz_pair_stats(data: &[u8]) -> Result<Stats, String> {
    let (flags, rest) = data.split_first().unwrap_or((&0, &[]));
    let max_payload = [16, 128, 1024, 4096][usize::from(flags >> 2 & 3)];
    let faults = Faults {
        flips: flags & 16 != 0,
        breaks: flags & 32 != 0,
    };
    let message_info =
        [[false, true], [true, true], [false, false], [true, false]][usize::from(flags >> 6)];
    let mut p = Pair::new(
        flags & 1 != 0,
        max_payload,
        2,
        flags & 2 != 0,
        message_info,
        faults,
    );
    for ch in rest.chunks_exact(5).take(2000) {
        let mut b = [0u8; 5];
        b.copy_from_slice(ch);
        p.step(Action::decode(b))
            .map_err(|e| format!("{}\n{e}", p.log))?;
    }
    p.finish().map_err(|e| format!("{}\n{e}", p.log))?;
    Ok(p.stats)
}

/// A Terminate FPDU on the wire carries the code its sender reported, and
/// its shape follows siw: the DDP header copied (D) always with a valid
/// segment length (M), never for LLP errors.
fn check_terminate_shape(
    fpdu_bytes: &[u8],
    crc: bool,
    reported: &[TermCode],
) -> Result<(), String> {
    use softrdma_wire::rdmap::Opcode;
    use softrdma_wire::ulpdu::{UlpduBody, UlpduRepr};
    let Ok(d) = softrdma_wire::fpdu::decode(fpdu_bytes, crc) else {
        return Err("transmitted an undecodable FPDU".into());
    };
    let Ok(u) = UlpduRepr::parse(d.ulpdu) else {
        return Err("transmitted an unparsable ULPDU".into());
    };
    if u.opcode != Opcode::Terminate {
        return Ok(());
    }
    let UlpduBody::Terminate(t) = u.body else {
        return Err("Terminate without its header".into());
    };
    if reported.last() != Some(&t.code) {
        return Err(format!(
            "Terminate {} on the wire, {:?} reported",
            t.code,
            reported.last()
        ));
    }
    if t.ddp.is_some() != t.segment_length_valid {
        return Err(format!("Terminate {}: D without M or M without D", t.code));
    }
    if let Some(e) = t.error()
        && !crate::term::copies_ddp_header(e)
        && t.ddp.is_some()
    {
        return Err(format!(
            "Terminate {}: copied a header for an error without one",
            t.code
        ));
    }
    Ok(())
}

/// A crafted ULPDU violating one rule, and the Terminate error it must get
/// (whatever state the receiver is in, as long as it receives).
#[must_use]
pub fn hostile(kind: u8) -> (Vec<u8>, TermError) {
    fn untagged(ctrl: u8, rdmap: u8, qn: u32, msn: u32, mo: u32) -> Vec<u8> {
        let mut v = vec![ctrl, rdmap, 0, 0, 0, 0];
        v.extend_from_slice(&qn.to_be_bytes());
        v.extend_from_slice(&msn.to_be_bytes());
        v.extend_from_slice(&mo.to_be_bytes());
        v
    }
    fn tagged(stag: u32, to: u64) -> Vec<u8> {
        let mut v = vec![0xc1, 0x40];
        v.extend_from_slice(&stag.to_be_bytes());
        v.extend_from_slice(&to.to_be_bytes());
        v
    }
    let read_body = [0u8; 28];
    match kind % 12 {
        0 => {
            let mut v = untagged(0x41, 0x41, 0, 1, 0);
            v.extend_from_slice(&read_body);
            (v, TermError::DdpUntaggedInvalidQn)
        }
        1 => {
            let mut v = untagged(0x41, 0x41, 1, 1, 4);
            v.extend_from_slice(&read_body);
            (v, TermError::DdpUntaggedInvalidMo)
        }
        2 => {
            let mut v = untagged(0x41, 0x4a, 1, 1, 0);
            let mut body = [0u8; 52];
            body[3] = 0x0f; // undefined atomic opcode
            v.extend_from_slice(&body);
            (v, crate::term::UNSUPPORTED_ATOMIC)
        }
        3 => {
            let mut v = untagged(0x41, 0x48, 1, 1, 0);
            v.extend_from_slice(&[0u8; 8]);
            (v, TermError::DdpUntaggedInvalidQn)
        }
        4 => {
            let mut v = untagged(0x41, 0x43, 1, 1, 0);
            v.extend_from_slice(b"hostile");
            (v, TermError::DdpUntaggedInvalidQn)
        }
        5 => {
            let mut v = tagged(1, u64::MAX - 2);
            v.extend_from_slice(&[0u8; 10]);
            (v, TermError::DdpTaggedToWrap)
        }
        6 => {
            let mut v = tagged(0xdead_0000, 0);
            v.extend_from_slice(&[0u8; 8]);
            (v, TermError::DdpTaggedInvalidStag)
        }
        7 => {
            let mut v = untagged(0x42, 0x43, 0, 1, 0);
            v.extend_from_slice(b"v2");
            (v, TermError::DdpUntaggedInvalidVersion)
        }
        8 => {
            let mut v = untagged(0x41, 0x03, 0, 1, 0);
            v.extend_from_slice(b"v0");
            (v, TermError::RdmapInvalidVersion)
        }
        9 => {
            let mut v = untagged(0x41, 0x4c, 0, 1, 0);
            v.extend_from_slice(b"op12");
            (v, TermError::RdmapUnexpectedOpcode)
        }
        10 => (vec![0x41, 0x43, 0, 0], crate::term::MALFORMED_HEADER),
        _ => {
            let mut v = untagged(0x01, 0x41, 1, 1, 0);
            v.extend_from_slice(&read_body);
            (v, crate::term::MALFORMED_HEADER)
        }
    }
}
