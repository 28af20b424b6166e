//! The plain-TCP baseline: the same transfer pattern over a TCP socket.
//!
//! write/send: a byte stream of the messages (bw) or a ping-pong of the
//! same size (lat, RTT/2); read/atomic: 8-byte requests answered by
//! `size`-byte responses, `depth` in flight (bw) or one at a time (lat,
//! full RTT). The measuring side ([`active`]) and the serving side
//! ([`passive`]) are the same in loopback (a thread) and in two-process
//! mode (the server).
//!
//! End of a run: the measuring side shuts down its writing half; the
//! serving side reads to the end and closes. In a stream (bw write/send)
//! the measuring side stops its clock when it sees that close, i.e. once
//! every byte was read by the peer.

use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use std::sync::atomic::Ordering;

use super::{Limit, Measurement, Mode, PROGRESS, Params, PerfError, Test, cpu_time, io, validate};

/// Whether the pattern is request/response (read, atomic).
fn reqrep(p: &Params) -> bool {
    matches!(p.test, Test::Read | Test::Atomic)
}

/// Request size of the request/response and ping-pong patterns.
fn request_len(p: &Params) -> usize {
    if reqrep(p) { 8 } else { p.size }
}

/// One end's socket: blocking (`--baseline tcp`: the thread sleeps in the
/// kernel until data comes) or busy-polled (`--baseline tcp-spin`: a
/// non-blocking socket read in a loop, as softrdma polls its CQ). Every
/// read and write is bounded by the stall limit either way.
struct Conn {
    s: TcpStream,
    spin: bool,
    timeout: Duration,
}

impl Conn {
    /// No Nagle; blocking with timeouts, or non-blocking to spin.
    fn new(s: TcpStream, p: &Params) -> Result<Conn, PerfError> {
        s.set_nodelay(true).map_err(io("tcp nodelay"))?;
        if p.tcp_spin {
            s.set_nonblocking(true).map_err(io("tcp non-blocking"))?;
        } else {
            s.set_read_timeout(Some(p.timeout))
                .map_err(io("tcp timeout"))?;
            s.set_write_timeout(Some(p.timeout))
                .map_err(io("tcp timeout"))?;
        }
        Ok(Conn {
            s,
            spin: p.tcp_spin,
            timeout: p.timeout,
        })
    }

    /// Runs `f` until it does not say `WouldBlock` (spinning mode) or the
    /// stall limit passes.
    fn retry<T>(
        &mut self,
        mut f: impl FnMut(&mut TcpStream) -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        if !self.spin {
            return f(&mut self.s);
        }
        let start = Instant::now();
        loop {
            match f(&mut self.s) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if start.elapsed() > self.timeout {
                        return Err(ErrorKind::TimedOut.into());
                    }
                    std::hint::spin_loop();
                }
                r => return r,
            }
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.retry(|s| s.read(buf))
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        let mut got = 0;
        while got < buf.len() {
            match self.read(&mut buf[got..]) {
                Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        let mut sent = 0;
        while sent < buf.len() {
            match self.retry(|s| s.write(&buf[sent..])) {
                Ok(0) => return Err(ErrorKind::WriteZero.into()),
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Bytes the serving side allocates for `p`.
pub(super) fn passive_bytes(p: &Params) -> u64 {
    if p.mode == Mode::Bw && !reqrep(p) {
        p.size.clamp(65536, 1 << 22) as u64
    } else {
        (request_len(p) + p.size) as u64
    }
}

/// The serving side: reads the stream to its end (bw write/send), or
/// answers each request with `size` bytes until the end.
pub(super) fn passive(p: &Params, b: TcpStream) -> Result<(), PerfError> {
    let mut b = Conn::new(b, p)?;
    if p.mode == Mode::Bw && !reqrep(p) {
        let mut buf = vec![0u8; p.size.clamp(65536, 1 << 22)];
        loop {
            if b.read(&mut buf).map_err(io("tcp read"))? == 0 {
                return Ok(());
            }
        }
    }
    let mut r = vec![0u8; request_len(p)];
    let resp = vec![0xa5u8; p.size];
    loop {
        match b.read_exact(&mut r) {
            Ok(()) => b.write_all(&resp).map_err(io("tcp write"))?,
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(io("tcp read")(e)),
        }
    }
}

/// The measuring side.
pub(super) fn active(p: &Params, a: TcpStream) -> Result<Measurement, PerfError> {
    let mut a = Conn::new(a, p)?;
    let size = p.size;
    let limit = Limit::new(p);
    if p.mode == Mode::Bw && !reqrep(p) {
        let data = vec![0x5au8; size];
        let cpu0 = cpu_time();
        let start = Instant::now();
        let mut i = 0u64;
        while limit.more(i) {
            a.write_all(&data).map_err(io("tcp write"))?;
            i += 1;
            PROGRESS.fetch_add(1, Ordering::Relaxed);
        }
        a.s.shutdown(Shutdown::Write).map_err(io("tcp shutdown"))?;
        // The peer closes once it has read everything.
        let mut end = [0u8; 64];
        while a.read(&mut end).map_err(io("tcp read"))? > 0 {}
        return Ok(Measurement {
            size,
            iters: i,
            secs: start.elapsed().as_secs_f64(),
            lat_us: Vec::new(),
            cpu_secs: cpu_time() - cpu0,
        });
    }
    let depth = if p.mode == Mode::Bw { p.depth } else { 1 };
    let div = if reqrep(p) { 1.0 } else { 2.0 };
    let q = vec![0x11u8; request_len(p)];
    let mut r = vec![0u8; size];
    let mut times = std::collections::VecDeque::new();
    let mut lat = Vec::new();
    let cpu0 = cpu_time();
    let start = Instant::now();
    let (mut sent, mut done) = (0u64, 0u64);
    loop {
        while times.len() < depth && limit.more(sent) {
            times.push_back(Instant::now());
            a.write_all(&q).map_err(io("tcp write"))?;
            sent += 1;
        }
        let Some(t) = times.pop_front() else { break };
        a.read_exact(&mut r).map_err(io("tcp read"))?;
        lat.push(t.elapsed().as_secs_f64() * 1e6 / div);
        done += 1;
        PROGRESS.fetch_add(1, Ordering::Relaxed);
    }
    let secs = start.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu0;
    a.s.shutdown(Shutdown::Write).map_err(io("tcp shutdown"))?;
    lat.sort_by(f64::total_cmp);
    Ok(Measurement {
        size,
        iters: done,
        secs,
        lat_us: lat,
        cpu_secs: cpu,
    })
}

fn tcp_pair() -> Result<(TcpStream, TcpStream), PerfError> {
    let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).map_err(io("tcp bind"))?;
    let addr = l.local_addr().map_err(io("tcp bind"))?;
    let a = TcpStream::connect(addr).map_err(io("tcp connect"))?;
    let (b, _) = l.accept().map_err(io("tcp accept"))?;
    Ok((a, b))
}

/// Runs the TCP baseline of `p` over loopback (same sizes, iterations and
/// depth; with a duration, the same duration).
///
/// # Errors
///
/// [`PerfError::Io`] when a socket fails.
pub fn measure_tcp(p: &Params) -> Result<Measurement, PerfError> {
    validate(p)?;
    let (a, b) = tcp_pair()?;
    let server = {
        let p = p.clone();
        std::thread::spawn(move || passive(&p, b))
    };
    let m = active(p, a);
    let s = server
        .join()
        .map_err(|_| PerfError::Engine("TCP responder panicked".into()))?;
    let m = m?;
    s?;
    Ok(m)
}
