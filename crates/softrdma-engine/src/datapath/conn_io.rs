//! The socket IO around the protocol core's `Connection`: what the data
//! path does once the core holds the rules (`docs/protocol-core.md`,
//! "Remaining steps", step 2), used by the opt-in core data path
//! (`qp/core_path.rs`).
//!
//! * [`RxIo`] feeds the connection from its socket with the engine's speed
//!   tricks kept: a 32 KiB staging buffer for headers, trailers and small
//!   payloads (handed over with `handle_rx_stream`), one `readv` straight
//!   into the destination of a payload of at least 1 KiB plus a read-ahead
//!   of the bytes after it (`handle_rx_placed_in`: the placed bytes are
//!   reported by length, the CRC fed from registered memory), and no
//!   `read` after a short one (the socket is very likely empty). A short
//!   payload after a direct read of a large one (a large message's last
//!   FPDU) is read into place too. A reader that is behind (four direct
//!   reads in a row came back full) reads 256 KiB batches into the
//!   staging buffer until one comes back short: one window update per
//!   batch instead of one per FPDU (`SOFTRDMA_RX_BATCH=0` turns it off;
//!   `docs/core-path-performance.md`); the buffer shrinks back to 32 KiB
//!   after 1024 reads without a batch.
//! * [`TxIo`] frames with `poll_transmit` into a queue of FPDUs and writes
//!   them with one `writev` (several messages per call), payloads by
//!   reference into registered memory; FPDUs of at most [`COPY_MAX`]
//!   payload bytes are copied into one buffer (one `iovec`, not three);
//!   whole FPDUs written are reported with `handle_sent`, the partial
//!   offset stays here. With `SOFTRDMA_FPDU_FOLLOW_MSS=1` the FPDU size
//!   follows the socket's current MSS (read again every [`MSS_EVERY`]
//!   bytes written, as kernel siw re-reads `mss_cache` as it transmits):
//!   on loopback the MSS read right after the handshake is half the one
//!   read once data flows.

#![allow(dead_code)] // parts used only by the core path's tests

use std::collections::VecDeque;
use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use softrdma_proto::conn::{Connection, RxWant, TxFpdu};
// The QP's memory (`mr::PdMemory`) is passed through as the protocol core
// sees it, so the data path does not name `mr`.
use softrdma_proto::mem::{Memory as CoreMemory, Span};

use crate::sys::io::{IoVecs, readv, tcp_maxseg, writev};
use crate::sys::mem::Memory;

/// Staging buffer: headers, trailers, small payloads and read-ahead
/// (taken at the first read that needs it, from a free list: `staging`).
use super::staging::{STAGING, pool as staging_pool};
/// Payloads at least this long are read straight into their destination.
const DIRECT_MIN: usize = 1024;
/// A read while the reader is behind: the staging buffer grows to this.
const BATCH: usize = 256 * 1024;
/// Direct reads in a row that came back full (the socket held at least
/// the payload and its read-ahead) that say the reader is behind.
const BEHIND_READS: u32 = 4;
/// Reads without a batch after which the batch buffer is given back (the
/// staging buffer shrinks to [`STAGING`] bytes again): 32 MiB of large
/// payloads read into place, so that a reader that falls behind now and
/// then does not allocate the buffer again every few MiB.
const BATCH_RELEASE_READS: u64 = 1024;
/// Bytes read ahead of a large payload (its trailer and the next header).
const READAHEAD_LARGE: usize = 256;
/// FPDUs with at most this many payload bytes are copied into one buffer.
pub(crate) const COPY_MAX: usize = 256;
/// FPDUs framed ahead of the socket.
const MAX_OUT: usize = 32;
/// Bytes written between two looks at the socket's MSS (one
/// `getsockopt` per 256 KiB: nothing beside the writes).
pub(crate) const MSS_EVERY: u64 = 256 * 1024;

/// Whether a reader that is behind reads in batches of [`BATCH`] bytes
/// (`SOFTRDMA_RX_BATCH=0` turns it off; read once).
fn rx_batch_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SOFTRDMA_RX_BATCH").map_or(true, |v| v.trim() != "0"))
}

/// Whether the transmitter follows the socket's MSS: only with
/// `SOFTRDMA_FPDU_FOLLOW_MSS=1` (read once). Off by default: FPDUs keep
/// the size `QueuePair::establish` read. On loopback following the MSS
/// doubles the FPDU size and saves CPU per MiB on a busy machine, but
/// lowered a quiet machine's 1 MiB Write bandwidth
/// (`docs/core-path-performance.md`, "FPDUs sized from the socket's
/// current MSS").
fn follow_mss_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("SOFTRDMA_FPDU_FOLLOW_MSS").is_ok_and(|v| v.trim() == "1"))
}

/// The largest FPDU payload for a TCP MSS: one FPDU per segment (MULPDU,
/// RFC 5044 section 8.1.1, without markers) less the DDP/RDMAP header,
/// at least 64 octets, a multiple of 4.
pub(crate) fn max_payload_for_mss(mss: usize) -> usize {
    softrdma_wire::fpdu::mulpdu(mss, false)
        .saturating_sub(softrdma_wire::ddp::UNTAGGED_HEADER_LEN)
        .max(64)
        & !3
}

/// Why receiving stopped.
#[derive(Debug)]
pub(crate) enum RxStop {
    /// The socket has no more bytes for now.
    Drained,
    /// The connection no longer receives (ERROR, closed, a violation).
    Done,
    /// The peer closed the stream (reported with `handle_fin`).
    Closed,
    /// The socket failed (reported with `handle_reset`).
    Failed(io::Error),
}

/// What [`RxIo::step`] stopped at.
#[derive(Debug)]
pub(crate) enum RxStep {
    /// Receiving stopped.
    Stop(RxStop),
    /// A payload to read straight into registered memory, or a batch to
    /// read into the staging buffer.
    Direct(DirectRead),
}

/// One `readv` of a payload straight into its destination plus the
/// read-ahead after it, or of a batch into the staging buffer, taken out
/// of [`RxIo`] so that it can run without the connection's lock (the
/// `Arc<Memory>` of `dst` keeps the memory mapped; the staging buffer
/// moves with it).
#[derive(Debug)]
pub(crate) struct DirectRead {
    /// Where the payload goes; `None` for a batch ([`BATCH`] bytes into
    /// the staging buffer).
    dst: Option<Span<Arc<Memory>>>,
    buf: Vec<u8>,
    iov: IoVecs,
}

impl DirectRead {
    /// The `readv`: payload bytes first, then up to 256 bytes of
    /// read-ahead; or a batch.
    pub(crate) fn read(&mut self, fd: RawFd) -> io::Result<usize> {
        self.iov.clear();
        let r = match &self.dst {
            Some(dst) if self.iov.push_mem(&dst.region, dst.offset, dst.len) => {
                self.iov.push_slice_mut(&mut self.buf[..READAHEAD_LARGE]);
                readv(fd, &self.iov)
            }
            Some(_) => Err(io::ErrorKind::InvalidInput.into()),
            None => {
                let n = BATCH.min(self.buf.len());
                self.iov.push_slice_mut(&mut self.buf[..n]);
                readv(fd, &self.iov)
            }
        };
        self.iov.clear();
        r
    }
}

/// The receive side of a connection's socket.
#[derive(Debug)]
pub(crate) struct RxIo {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// The last payload was small: read as much as there is.
    small: bool,
    /// The last read through the staging buffer (a batch, a read of the
    /// staging buffer, one outside the run: [`Self::staged_short`]) came
    /// back short, and no direct read came back full since: the socket is
    /// very likely empty.
    drained_hint: bool,
    /// Bytes were staged by a read outside the run ([`put_staging`]),
    /// which came back short: the run starts drained (`begin`).
    ///
    /// [`put_staging`]: Self::put_staging
    staged_short: bool,
    /// A read outside the run ([`put_staging_error`]) failed: the run
    /// acts on that error before it reads again (after a reset the socket
    /// reads as at its end).
    ///
    /// [`put_staging_error`]: Self::put_staging_error
    staged_error: Option<io::Error>,
    /// A short payload next is read straight into place too: the last
    /// read was a direct read of a large payload that came back full (the
    /// socket likely holds more), or a full read of the read-ahead after
    /// one, or a direct read that ended inside its payload (see
    /// [`Self::step`]).
    direct_next: bool,
    /// Direct reads in a row that came back full.
    full_reads: u32,
    /// Batched reads are allowed ([`rx_batch_on`]).
    batch: bool,
    /// The last read was a batch that came back full: read the next one
    /// as a batch too.
    batching: bool,
    /// Batched reads made.
    pub(crate) batches: u64,
    /// [`Self::reads`] after the last batch (its own read counted): the
    /// staging buffer grown for batches shrinks back after
    /// [`BATCH_RELEASE_READS`] reads without one.
    batch_reads: u64,
    /// Reads made (each `readv`/`recv` on the socket).
    pub(crate) reads: u64,
    iov: IoVecs,
    /// Bytes read from the socket.
    pub(crate) bytes_received: u64,
    /// Of those, bytes read straight into their destination.
    pub(crate) bytes_placed: u64,
    /// Of those, bytes read by batches.
    pub(crate) bytes_batched: u64,
}

impl RxIo {
    /// Receive state for a socket from which `already_read` (at most 32 KiB)
    /// was read already.
    pub(crate) fn new(already_read: &[u8]) -> Self {
        let n = already_read.len().min(STAGING);
        let buf = if n == 0 {
            Vec::new()
        } else {
            let mut buf = staging_pool().take();
            buf[..n].copy_from_slice(&already_read[..n]);
            buf
        };
        RxIo {
            buf,
            start: 0,
            end: n,
            small: true,
            drained_hint: false,
            staged_short: false,
            staged_error: None,
            direct_next: false,
            full_reads: 0,
            batch: rx_batch_on(),
            batching: false,
            batches: 0,
            batch_reads: 0,
            reads: 0,
            iov: IoVecs::new(),
            bytes_received: 0,
            bytes_placed: 0,
            bytes_batched: 0,
        }
    }

    /// Feeds `conn` from socket `fd` until the socket is drained or the
    /// connection stops receiving. `now`: the engine clock, read only for
    /// a FIN (a clock read per receive cost more than the rest of the
    /// step's bookkeeping).
    pub(crate) fn run(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        mem: &mut impl CoreMemory<Region = Arc<Memory>>,
        fd: RawFd,
        now: &dyn Fn() -> u64,
    ) -> RxStop {
        self.drained_hint = false;
        loop {
            match self.step(conn, mem, fd, now) {
                RxStep::Stop(stop) => return stop,
                RxStep::Direct(mut d) => {
                    let r = d.read(fd);
                    if let Some(stop) = self.placed(conn, mem, d, r, now) {
                        return stop;
                    }
                }
            }
        }
    }

    /// Takes the staging buffer at the first read that needs it.
    fn staging(&mut self) {
        if self.buf.is_empty() {
            self.buf = staging_pool().take();
        }
    }

    /// Bytes of staging buffer held (0 until the first read needing one).
    #[cfg(test)]
    pub(crate) fn staging_capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Starts a receive run ([`step`](Self::step) until it stops).
    pub(crate) fn begin(&mut self) {
        self.drained_hint = std::mem::take(&mut self.staged_short);
    }

    /// Takes the staging buffer out for a read made without the
    /// connection's lock (a receive that sleeps in the kernel), if it
    /// holds no bytes; give it back with [`put_staging`](Self::put_staging).
    pub(crate) fn take_staging(&mut self) -> Option<Vec<u8>> {
        if self.end > self.start {
            return None;
        }
        self.staging();
        self.start = 0;
        self.end = 0;
        Some(std::mem::take(&mut self.buf))
    }

    /// Gives back the buffer of [`take_staging`](Self::take_staging) with
    /// `n` bytes read into its front: the next run feeds them to the
    /// connection first (and reads no more if they came short).
    pub(crate) fn put_staging(&mut self, buf: Vec<u8>, n: usize) {
        // A read of the socket like the run's own: counted the same way.
        if n > 0 {
            self.bytes_received += n as u64;
            self.reads += 1;
        }
        self.staged_short = n > 0 && n < buf.len();
        self.buf = buf;
        self.start = 0;
        self.end = n.min(self.buf.len());
    }

    /// Gives back the buffer of [`take_staging`](Self::take_staging)
    /// after its read failed with `e`: the next run acts on `e` first.
    pub(crate) fn put_staging_error(&mut self, buf: Vec<u8>, e: io::Error) {
        self.put_staging(buf, 0);
        self.staged_error = Some(e);
    }

    /// Feeds `conn` from the staging buffer and the socket until it stops,
    /// or until the next payload is large enough to be read straight into
    /// its destination: that read ([`DirectRead::read`]) touches neither
    /// the connection nor this state, so the caller may do it without the
    /// connection's lock, then hands the result to
    /// [`placed`](Self::placed) (nothing but the receive path changes what
    /// the connection wants to read; a reset or close meanwhile makes
    /// `handle_rx_placed_in` take nothing).
    pub(crate) fn step(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        mem: &mut impl CoreMemory<Region = Arc<Memory>>,
        fd: RawFd,
        now: &dyn Fn() -> u64,
    ) -> RxStep {
        loop {
            if self.end > self.start {
                let n = conn.handle_rx_stream(&self.buf[self.start..self.end], mem);
                self.start += n;
                if self.start < self.end {
                    // Fewer taken than given: no longer receiving.
                    return RxStep::Stop(RxStop::Done);
                }
                continue;
            }
            self.start = 0;
            self.end = 0;
            if self.buf.len() > STAGING
                && self.reads.saturating_sub(self.batch_reads) >= BATCH_RELEASE_READS
            {
                // Back to reads into place for a while: the 256 KiB batch
                // buffer is given back (it is empty here).
                self.buf.truncate(STAGING);
                self.buf.shrink_to_fit();
            }
            if let Some(e) = self.staged_error.take()
                && let Some(stop) = self.after_read(conn, Err(e), now)
            {
                return RxStep::Stop(stop);
            }
            let want = conn.rx_want();
            // A reader that is behind (its direct reads of large payloads
            // keep coming back full) reads the socket in batches through
            // the staging buffer, copying the payloads, until a batch
            // comes back short: each read of one FPDU frees the window
            // from about zero, which makes TCP send a window update at once
            // and the sender's queued bytes go out in segments of one FPDU;
            // a batch frees a quarter of a MiB at once
            // (`docs/core-path-performance.md`).
            if self.batch
                && (self.batching && !matches!(want, RxWant::Closed)
                    || self.full_reads >= BEHIND_READS
                        && matches!(&want, RxWant::Place { dst } if dst.len >= DIRECT_MIN))
            {
                if self.buf.len() < BATCH {
                    self.buf.resize(BATCH, 0);
                }
                self.full_reads = 0;
                self.batches += 1;
                // The batch's own read is counted when it is placed.
                self.batch_reads = self.reads + 1;
                return RxStep::Direct(DirectRead {
                    dst: None,
                    buf: std::mem::take(&mut self.buf),
                    iov: std::mem::take(&mut self.iov),
                });
            }
            let got = match want {
                RxWant::Closed => return RxStep::Stop(RxStop::Done),
                // A short payload after a direct read of a large one (the
                // last FPDU of a large message; what is left after a short
                // read) is read into place as well, with the read-ahead
                // after it and `small` unchanged: read through the whole
                // staging buffer, the large FPDUs after it would be copied
                // through the buffer, each 32 KiB read ending a few bytes
                // further into the next FPDU's payload, for a whole
                // message or more (a 1 MiB Write of 32 744-byte payloads
                // ends with an 808-byte FPDU; see `direct_next`).
                RxWant::Place { dst } if dst.len >= DIRECT_MIN || self.direct_next => {
                    if dst.len >= DIRECT_MIN {
                        self.small = false;
                    } else if self.drained_hint {
                        // A read through the staging buffer came back
                        // short (a batch ending inside this payload, or a
                        // staging read, in this run or before it) and no
                        // direct read came back full since: the socket is
                        // very likely empty (no `read` to find `EAGAIN`, as
                        // for the staging buffer). Wrong at worst when data
                        // came meanwhile: one wake-up more, not a stall
                        // (the socket is readable).
                        return RxStep::Stop(RxStop::Drained);
                    }
                    let mut iov = std::mem::take(&mut self.iov);
                    iov.clear();
                    if iov.push_mem(&dst.region, dst.offset, dst.len) {
                        iov.clear();
                        self.staging();
                        return RxStep::Direct(DirectRead {
                            dst: Some(dst),
                            buf: std::mem::take(&mut self.buf),
                            iov,
                        });
                    }
                    self.iov = iov;
                    // Not a range of its memory (never for a span the core
                    // checked): through the staging buffer, where the copy
                    // fails and the core reports it.
                    self.read_staging(fd)
                }
                RxWant::Place { dst } => {
                    self.small = dst.len < DIRECT_MIN;
                    if self.drained_hint {
                        return RxStep::Stop(RxStop::Drained);
                    }
                    self.read_staging(fd)
                }
                // As `read_staging` would answer, without making and
                // dropping an `io::Error` per receive run (a ping-pong's
                // every message ends here).
                RxWant::Bytes { .. } if self.drained_hint => {
                    return RxStep::Stop(RxStop::Drained);
                }
                RxWant::Bytes { .. } => self.read_staging(fd),
            };
            if let Some(stop) = self.after_read(conn, got, now) {
                return RxStep::Stop(stop);
            }
        }
    }

    /// The result of a [`DirectRead`]: the placed bytes reported to `conn`,
    /// the read-ahead staged. `Some` if receiving stops.
    pub(crate) fn placed(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        mem: &mut impl CoreMemory<Region = Arc<Memory>>,
        d: DirectRead,
        r: io::Result<usize>,
        now: &dyn Fn() -> u64,
    ) -> Option<RxStop> {
        let DirectRead { dst, buf, iov } = d;
        self.reads += 1;
        self.buf = buf;
        self.iov = iov;
        self.start = 0;
        self.end = 0;
        let Some(dst) = dst else {
            // A batch: a full one keeps the reader batching, a short one
            // (the socket is drained) sends it back to direct reads. One
            // that found nothing (`EAGAIN`: the writer is behind for a
            // moment) leaves it batching, as measured: ending it there
            // took 211 reads instead of 51 for 4 MiB of Writes with the
            // CRC on (`a_reader_that_is_behind_reads_in_batches`).
            // After a short one the tail of the FPDU it ended in is read
            // into place, as after a direct read that ended inside its
            // payload: the socket drains at a TCP segment's end, a few
            // hundred bytes before an FPDU's end more often than not, and
            // that short `Place` read through the staging buffer started
            // the chain of 32 KiB staging reads each ending 4 bytes
            // further into the next FPDU (`direct_next`), which copied up
            // to 8 MiB of a Write through the buffer
            // (`a_short_batch_does_not_start_a_chain_of_staging_reads`).
            let r = r.inspect(|&n| {
                self.batching = n == BATCH;
                self.drained_hint = n > 0 && n < BATCH;
                self.direct_next = n > 0 && n < BATCH;
                self.bytes_batched += n as u64;
                self.end = n;
            });
            return self.after_read(conn, r, now);
        };
        let r = r.inspect(|&n| {
            let placed = n.min(dst.len);
            let full = n >= dst.len + READAHEAD_LARGE;
            // Not after a full read of a short payload: messages of a few
            // hundred bytes would each be read that way, one `readv` per
            // message instead of a 32 KiB read for dozens.
            self.direct_next = (full && dst.len >= DIRECT_MIN) || (n > 0 && placed < dst.len);
            self.full_reads = if full { self.full_reads + 1 } else { 0 };
            if full {
                // The socket held more than was asked for: an earlier
                // short read no longer says it is empty.
                self.drained_hint = false;
            }
            let took = conn.handle_rx_placed_in(placed, mem);
            self.bytes_placed += took as u64;
            self.end = n - placed;
        });
        self.after_read(conn, r, now)
    }

    /// Acts on a read's result: `Some` if receiving stops.
    fn after_read(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        got: io::Result<usize>,
        now: &dyn Fn() -> u64,
    ) -> Option<RxStop> {
        match got {
            Ok(0) => {
                conn.handle_fin(now());
                Some(RxStop::Closed)
            }
            Ok(n) => {
                self.bytes_received += n as u64;
                None
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Some(RxStop::Drained),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(e) => {
                conn.handle_reset();
                Some(RxStop::Failed(e))
            }
        }
    }

    /// One `read` into the (empty) staging buffer: all of it after small
    /// payloads, a little after a large one (the next payload is probably
    /// large too and should go straight to its destination).
    fn read_staging(&mut self, fd: RawFd) -> io::Result<usize> {
        if self.drained_hint {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.batching = false;
        self.staging();
        let limit = if self.small { STAGING } else { READAHEAD_LARGE };
        self.iov.clear();
        self.iov.push_slice_mut(&mut self.buf[..limit]);
        let r = readv(fd, &self.iov);
        self.reads += 1;
        self.iov.clear();
        if let Ok(n) = r {
            self.drained_hint = n > 0 && n < limit;
            self.direct_next = n == limit && !self.small;
            self.end = n;
        }
        r
    }
}

impl Drop for RxIo {
    fn drop(&mut self) {
        staging_pool().give(std::mem::take(&mut self.buf));
    }
}

/// Why transmitting stopped.
#[derive(Debug)]
pub(crate) enum TxStop {
    /// Nothing more to send.
    Idle,
    /// The byte budget is spent (more may be ready).
    Budget,
    /// A send-queue request was written completely: its completion is
    /// ready (more may be ready to write). The caller delivers it before
    /// writing on, so that the poster learns at once that its buffer is
    /// free, not after the rest of a long queue is written.
    Completed,
    /// The socket is full.
    WouldBlock,
    /// The socket failed.
    Failed(io::Error),
}

/// An FPDU handed out by the core: by reference, or copied whole.
#[derive(Debug)]
struct Out {
    fpdu: TxFpdu<Arc<Memory>>,
    /// The FPDU's bytes when its payload was small enough to copy.
    copy: Vec<u8>,
    copied: bool,
}

/// The transmit side of a connection's socket.
#[derive(Debug)]
pub(crate) struct TxIo {
    /// Boxed: an `Out` is about 400 bytes (the header buffer), moved
    /// between the pool and the queue once per FPDU.
    out: VecDeque<Box<Out>>,
    #[allow(clippy::vec_box)] // moved per FPDU: a pointer, not 400 bytes
    pool: Vec<Box<Out>>,
    /// Bytes of the front FPDU already written.
    written: usize,
    iov: IoVecs,
    /// Bytes written to the socket.
    pub(crate) bytes_sent: u64,
    /// `writev` calls made (successful or not).
    pub(crate) writes: u64,
    /// `bytes_sent` at which the socket's MSS is read again.
    mss_next: u64,
    /// Looks at the MSS that changed the FPDU size.
    pub(crate) mss_changes: u64,
}

impl TxIo {
    pub(crate) fn new() -> Self {
        TxIo {
            out: VecDeque::new(),
            pool: Vec::new(),
            written: 0,
            iov: IoVecs::new(),
            bytes_sent: 0,
            writes: 0,
            mss_next: if follow_mss_on() { MSS_EVERY } else { u64::MAX },
            mss_changes: 0,
        }
    }

    /// Follows the socket's MSS (or not), whatever the environment says.
    pub(crate) fn following_mss(mut self, on: bool) -> Self {
        self.mss_next = if on {
            self.bytes_sent + MSS_EVERY
        } else {
            u64::MAX
        };
        self
    }

    /// Sizes the next FPDUs from the socket's current MSS (the TCP stack
    /// changes it as the peer's window grows, or as the path MTU changes).
    /// FPDUs framed already keep their size; the core applies the new one
    /// from its next FPDU, also inside a message.
    fn follow_mss(&mut self, conn: &mut Connection<Arc<Memory>>, fd: RawFd) {
        self.mss_next = self.bytes_sent + MSS_EVERY;
        if let Ok(mss) = tcp_maxseg(fd)
            && mss > 0
        {
            let want = max_payload_for_mss(mss);
            if want != conn.config().max_payload {
                conn.set_max_payload(want);
                self.mss_changes += 1;
            }
        }
    }

    /// FPDUs framed and not completely written.
    pub(crate) fn pending(&self) -> usize {
        self.out.len()
    }

    /// Drops the FPDUs not written (the connection was reset): their
    /// memory is released at once.
    pub(crate) fn discard(&mut self) {
        self.out.clear();
        self.pool.clear();
        self.written = 0;
    }

    /// Frames and writes until the socket would block, nothing is left,
    /// `budget` bytes are written or a send-queue request completed.
    pub(crate) fn progress(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        mem: &mut impl CoreMemory<Region = Arc<Memory>>,
        fd: RawFd,
        budget: usize,
    ) -> TxStop {
        let mut sent = 0usize;
        loop {
            if self.bytes_sent >= self.mss_next {
                self.follow_mss(conn, fd);
            }
            while self.out.len() < MAX_OUT {
                let mut o = self.pool.pop().unwrap_or_else(|| {
                    Box::new(Out {
                        fpdu: TxFpdu::new(),
                        copy: Vec::new(),
                        copied: false,
                    })
                });
                if !conn.poll_transmit(mem, &mut o.fpdu) {
                    self.pool.push(o);
                    break;
                }
                let payload: usize = o.fpdu.payload().iter().map(|s| s.len).sum();
                o.copied = false;
                if payload > 0 && payload <= COPY_MAX {
                    o.copy.clear();
                    o.copied = o.fpdu.write_to(mem, &mut o.copy);
                }
                self.out.push_back(o);
            }
            if self.out.is_empty() {
                return TxStop::Idle;
            }
            self.build_iov();
            let r = writev(fd, &self.iov);
            self.writes += 1;
            self.iov.clear();
            match r {
                Ok(n) => {
                    self.bytes_sent += n as u64;
                    let done = self.advance(n);
                    let queued = conn.send_queue_len();
                    conn.handle_sent(done);
                    sent = sent.saturating_add(n);
                    if sent >= budget {
                        return TxStop::Budget;
                    }
                    if conn.send_queue_len() < queued {
                        return TxStop::Completed;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return TxStop::WouldBlock,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return TxStop::Failed(e),
            }
        }
    }

    /// The iovecs of the queued FPDUs, skipping what was written.
    fn build_iov(&mut self) {
        self.iov.clear();
        let mut skip = self.written;
        for o in &self.out {
            let pieces = if o.copied {
                1
            } else {
                2 + o.fpdu.payload().len()
            };
            if self.iov.room() < pieces {
                break;
            }
            if o.copied {
                if let Some(rest) = o.copy.get(skip..) {
                    self.iov.push_slice(rest);
                }
                skip = 0;
                continue;
            }
            let head = o.fpdu.head();
            if skip < head.len() {
                self.iov.push_slice(&head[skip..]);
                skip = 0;
            } else {
                skip -= head.len();
            }
            for s in o.fpdu.payload() {
                if skip < s.len {
                    if !self.iov.push_mem(&s.region, s.offset + skip, s.len - skip) {
                        return;
                    }
                    skip = 0;
                } else {
                    skip -= s.len;
                }
            }
            let trailer = o.fpdu.trailer();
            if skip < trailer.len() {
                self.iov.push_slice(&trailer[skip..]);
            }
            skip = 0;
        }
    }

    /// `n` more bytes written: returns the FPDUs now written completely.
    fn advance(&mut self, mut n: usize) -> usize {
        let mut done = 0;
        while let Some(front) = self.out.front() {
            // A copied FPDU's bytes are its copy (`send_now` queues one
            // without a descriptor).
            let whole = if front.copied {
                front.copy.len()
            } else {
                front.fpdu.len()
            };
            let left = whole - self.written;
            if n < left {
                self.written += n;
                break;
            }
            n -= left;
            self.written = 0;
            done += 1;
            if let Some(mut o) = self.out.pop_front() {
                // Let go of the payload's memory now (lent memory waits
                // for every reference, see `mr::LentRegion`).
                o.fpdu.clear();
                self.pool.push(o);
            }
        }
        done
    }
}

mod send_now;
pub(crate) use send_now::SendNow;

#[cfg(test)]
mod tests;
