//! `softrdma perf stream`: byte-stream bandwidth and latency of sockets
//! direct (SDP over softrdma, `softrdma-sockets`) against plain kernel TCP
//! in the same run.
//!
//! ```text
//! softrdma perf stream [--lat | --setup] [-s SIZE | -a] [-n N | -D SECS] [--nodelay]
//!                      [--baseline tcp|tcp-spin] [--mode offload|auto|tcp]
//!                      [--zcopy-threshold SIZE]
//!                      [--server [--bind ADDR] [--persist] | --connect HOST[:PORT]]
//!                      [-p PORT] [--json | --csv]
//! ```
//!
//! Bandwidth: the client writes `size`-byte writes for `-D` seconds (or
//! `-n` writes), shuts down writing and waits for the server's count of
//! the octets it read: bandwidth = octets / (first write .. count). Latency:
//! `size`-byte ping-pong, one-way latency = round trip / 2 (median, mean
//! and 99th percentile over `-n` round trips after 10% warm-up). Setup:
//! `-n` connections one after the other, each connect, a 1-byte round
//! trip and close; the mean per connection. With `--baseline tcp` the runs
//! (`-r`) of both transports alternate. Every row also gives the CPU time
//! (user + system, `getrusage`) of the whole process per round trip,
//! connection or write (`cpu µs`): with the server in the same process,
//! both ends and the engine's threads.
//!
//! The server is one dual listener: it accepts offloaded and plain clients
//! on the same port, so `--baseline tcp` measures plain TCP against the
//! very same server (in two-process mode too). Each connection starts with
//! a 24-octet request (`"SPS1"`, kind, nodelay, size, count); kind 0 ends
//! the server (unless `--persist`).

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::thread;
use std::time::{Duration, Instant};

use clap::Parser;
use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

/// Default TCP port of `perf stream`'s two-process mode.
pub const DEFAULT_STREAM_PORT: u16 = 18516;

const MAGIC: &[u8; 4] = b"SPS1";
const KIND_END: u8 = 0;
const KIND_BW: u8 = 1;
const KIND_LAT: u8 = 2;

/// Arguments of `softrdma perf stream`.
#[derive(Debug, Parser)]
#[command(
    name = "softrdma perf stream",
    about = "Byte-stream bandwidth / latency of sockets direct (SDP over softrdma) against plain TCP",
    after_help = "Two-process mode:\n  \
    softrdma perf stream --server                      # serves until the client ends it\n  \
    softrdma perf stream --connect HOST --baseline tcp # measures SDP, then TCP, same server"
)]
pub struct StreamArgs {
    /// Latency (ping-pong) instead of bandwidth.
    #[arg(long, conflicts_with = "setup")]
    pub lat: bool,
    /// Connection setup instead of bandwidth: connect (capability query,
    /// switch), a first 1-byte round trip and close, per connection (mean
    /// of -n connections per run, default 200).
    #[arg(long)]
    pub setup: bool,
    /// Write size in bytes (suffixes K, M) [default: 128K bw, 64 lat].
    #[arg(short = 's', long, value_parser = super::parse_size)]
    pub size: Option<usize>,
    /// Sweep sizes 64 B .. the -s size (default 1M) in powers of four.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Writes (bw) or round trips (lat) per size [default: bw by time, lat 10000].
    #[arg(short = 'n', long, conflicts_with = "duration")]
    pub iters: Option<u64>,
    /// Seconds per size (bandwidth) [default: 2].
    #[arg(short = 'D', long, value_name = "SECS")]
    pub duration: Option<f64>,
    /// Set TCP_NODELAY (no corking of small writes).
    #[arg(long)]
    pub nodelay: bool,
    /// Also measure plain TCP (same pattern, same server) and print the
    /// ratio sockets direct / TCP; `tcp-spin`: latency with both ends of
    /// the TCP connection busy-polling non-blocking sockets (compare with
    /// `--spin-us`).
    #[arg(long, value_parser = ["tcp", "tcp-spin"], value_name = "tcp|tcp-spin")]
    pub baseline: Option<String>,
    /// What the measured connection asks for: offload (required), auto,
    /// tcp.
    #[arg(long, default_value = "offload", value_parser = ["offload", "auto", "tcp"])]
    pub mode: String,
    /// Busy-poll this many microseconds before sleeping (Config::spin).
    #[arg(long, value_name = "US")]
    pub spin_us: Option<u64>,
    /// Writes of at least this many bytes go by Read zero copy when both
    /// ends offer it (suffixes K, M; 0: off, not offered) [default: the
    /// library's, 256K].
    #[arg(long, value_name = "SIZE", value_parser = parse_threshold)]
    pub zcopy_threshold: Option<usize>,
    /// Runs per size, alternated with the baseline's; the median is
    /// reported [default: 1].
    #[arg(short = 'r', long, default_value_t = 1)]
    pub runs: usize,
    /// Two-process mode: serve clients (prints `listening on ADDR:PORT`).
    #[arg(long, conflicts_with = "connect")]
    pub server: bool,
    /// Two-process mode: measure against the server at HOST or HOST:PORT.
    #[arg(long, value_name = "HOST[:PORT]")]
    pub connect: Option<String>,
    /// TCP port of the two-process mode (0 on a server: any free port).
    #[arg(short = 'p', long, default_value_t = DEFAULT_STREAM_PORT)]
    pub port: u16,
    /// Server: the address to listen on.
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0")]
    pub bind: String,
    /// Server: keep serving after a client ends its run.
    #[arg(long)]
    pub persist: bool,
    /// One JSON object per line.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Comma-separated values with a header.
    #[arg(long)]
    pub csv: bool,
}

/// One measured size on one transport.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StreamRow {
    /// Always `"stream"`.
    pub test: &'static str,
    /// `"bw"`, `"lat"` or `"setup"`.
    pub mode: &'static str,
    /// What carried the connection (`offloaded (sdp, ...)`, `plain TCP (...)`).
    pub transport: String,
    /// `"sdp"` or `"tcp"` (the baseline).
    pub kind: &'static str,
    /// Write size in bytes.
    pub size: usize,
    /// Octets moved (bw), round trips (lat) or connections (setup).
    pub count: u64,
    /// Seconds measured.
    pub secs: f64,
    /// Bandwidth, 10^6 bytes per second (bw).
    pub mb_s: Option<f64>,
    /// One-way latency (RTT/2), median, µs (lat); mean µs per connection
    /// (setup: the median over the runs).
    pub lat_us: Option<f64>,
    /// One-way latency, mean, µs (lat).
    pub lat_mean_us: Option<f64>,
    /// One-way latency, 99th percentile, µs (lat).
    pub lat_p99_us: Option<f64>,
    /// This row / the TCP row of the same size (bandwidth ratio, or latency
    /// ratio: lower is better), on the sockets-direct row.
    pub ratio_to_tcp: Option<f64>,
    /// CPU time (user + system) of the whole process per operation, µs
    /// (median over the runs): per round trip (lat), connection (setup)
    /// or write (bw). Both ends and the engine's threads when the server
    /// runs in the same process (the default), the client's side only
    /// with `--connect`. Unlike the latency, it does not depend on
    /// whether the two ends' threads share a CPU.
    pub cpu_us: Option<f64>,
}

/// A size, or 0 (off).
fn parse_threshold(s: &str) -> Result<usize, String> {
    if s.trim() == "0" {
        Ok(0)
    } else {
        super::parse_size(s)
    }
}

fn cfg(args: &StreamArgs, mode: Mode) -> Config {
    let mut c = Config::with_mode(mode);
    if let Some(t) = args.zcopy_threshold {
        c.zcopy_threshold = t;
    }
    if let Some(us) = args.spin_us {
        c.spin = Duration::from_micros(us);
    }
    c
}

fn measured_mode(args: &StreamArgs) -> Mode {
    match args.mode.as_str() {
        "auto" => Mode::Auto,
        "tcp" => Mode::Tcp,
        _ => Mode::Offload,
    }
}

fn request(kind: u8, nodelay: bool, size: usize, count: u64) -> [u8; 24] {
    request_spin(kind, nodelay, false, size, count)
}

/// A request; `spin`: the server busy-polls a non-blocking socket (plain
/// TCP latency baseline `tcp-spin`).
fn request_spin(kind: u8, nodelay: bool, spin: bool, size: usize, count: u64) -> [u8; 24] {
    let mut b = [0u8; 24];
    b[..4].copy_from_slice(MAGIC);
    b[4] = kind;
    b[5] = u8::from(nodelay);
    b[6] = u8::from(spin);
    b[8..12].copy_from_slice(&u32::try_from(size).unwrap_or(u32::MAX).to_be_bytes());
    b[12..20].copy_from_slice(&count.to_be_bytes());
    b
}

/// Serves one connection; returns false when the client ended the server.
fn serve_one(mut s: TcpStream) -> io::Result<bool> {
    let mut req = [0u8; 24];
    s.read_exact(&mut req)?;
    if &req[..4] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a perf stream client",
        ));
    }
    let size = u32::from_be_bytes([req[8], req[9], req[10], req[11]]) as usize;
    if size == 0 || size > 64 << 20 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "bad size"));
    }
    s.set_nodelay(req[5] != 0)?;
    match req[4] {
        KIND_END => Ok(false),
        KIND_BW => {
            let mut buf = vec![0u8; size.max(64 << 10)];
            let mut total = 0u64;
            loop {
                match s.read(&mut buf)? {
                    0 => break,
                    n => total += n as u64,
                }
            }
            s.write_all(&total.to_be_bytes())?;
            s.flush()?;
            Ok(true)
        }
        KIND_LAT if req[6] != 0 => {
            s.set_nonblocking(true)?;
            let mut buf = vec![0u8; size];
            while spin_read_exact(&mut s, &mut buf)? {
                spin_write_all(&mut s, &buf)?;
            }
            Ok(true)
        }
        KIND_LAT => {
            let mut buf = vec![0u8; size];
            loop {
                match s.read_exact(&mut buf) {
                    Ok(()) => s.write_all(&buf)?,
                    Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
                    Err(e) => return Err(e),
                }
            }
            Ok(true)
        }
        k => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unknown request kind {k}"),
        )),
    }
}

fn serve(l: &TcpListener, persist: bool) {
    loop {
        let s = match l.accept() {
            Ok((s, _)) => s,
            Err(e) => {
                eprintln!("softrdma perf stream: accept: {e}");
                continue;
            }
        };
        match serve_one(s) {
            Ok(false) if !persist => return,
            Ok(_) => {}
            Err(e) => eprintln!("softrdma perf stream: client: {e}"),
        }
    }
}

fn bw(
    addr: SocketAddr,
    c: &Config,
    a: &StreamArgs,
    size: usize,
) -> io::Result<(String, u64, f64, f64)> {
    let mut s = TcpStream::connect_with(addr, c)?;
    let transport = s.transport().to_string();
    s.set_nodelay(a.nodelay)?;
    s.write_all(&request(KIND_BW, a.nodelay, size, a.iters.unwrap_or(0)))?;
    let buf = vec![0x5Au8; size];
    let limit = Duration::from_secs_f64(a.duration.unwrap_or(2.0));
    let t0 = Instant::now();
    let cpu0 = super::cpu_time();
    let mut writes = 0u64;
    loop {
        s.write_all(&buf)?;
        writes += 1;
        let done = match a.iters {
            Some(n) => writes >= n,
            None => writes.is_multiple_of(16) && t0.elapsed() >= limit,
        };
        if done {
            break;
        }
    }
    s.shutdown(Shutdown::Write)?;
    let mut cnt = [0u8; 8];
    s.read_exact(&mut cnt)?;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (super::cpu_time() - cpu0) * 1e6 / writes.max(1) as f64;
    let got = u64::from_be_bytes(cnt);
    if got != writes * size as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("server read {got} octets of {}", writes * size as u64),
        ));
    }
    Ok((transport, got, secs, cpu))
}

/// `n` timed round trips of `size` octets, each one `rt` (write `out`, read
/// the echo into `back`), after `n / 10` untimed ones; the round trips
/// (µs) and the process's CPU µs per timed round trip.
fn round_trips(
    s: &mut TcpStream,
    n: u64,
    size: usize,
    mut rt: impl FnMut(&mut TcpStream, &[u8], &mut [u8]) -> io::Result<()>,
) -> io::Result<(Vec<f64>, f64)> {
    let out = vec![0xA5u8; size];
    let mut back = vec![0u8; size];
    let warm = n / 10;
    let mut rtts = Vec::with_capacity(n as usize);
    let mut cpu0 = 0.0;
    for i in 0..warm + n {
        if i == warm {
            cpu0 = super::cpu_time();
        }
        let t = Instant::now();
        rt(s, &out, &mut back)?;
        if i >= warm {
            rtts.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let cpu = (super::cpu_time() - cpu0) * 1e6 / n as f64;
    Ok((rtts, cpu))
}

fn lat(
    addr: SocketAddr,
    c: &Config,
    a: &StreamArgs,
    size: usize,
) -> io::Result<(String, Vec<f64>, f64)> {
    let mut s = TcpStream::connect_with(addr, c)?;
    let transport = s.transport().to_string();
    s.set_nodelay(true)?;
    let n = a.iters.unwrap_or(10_000).max(1);
    s.write_all(&request(KIND_LAT, true, size, n))?;
    let (rtts, cpu) = round_trips(&mut s, n, size, |s, out, back| {
        s.write_all(out)?;
        s.read_exact(back)
    })?;
    s.shutdown(Shutdown::Write)?;
    let mut end = [0u8; 1];
    let _ = s.read(&mut end);
    Ok((transport, rtts, cpu))
}

/// `-n` (default 200) connections, each: connect, a 1-byte round trip,
/// close. Returns the transport of the last, the count and the mean µs.
fn setup(addr: SocketAddr, c: &Config, a: &StreamArgs) -> io::Result<(String, u64, f64, f64)> {
    let n = a.iters.unwrap_or(200).max(1);
    // Kept as it is and put in words after the timed loop.
    let mut transport = None;
    let t0 = Instant::now();
    let cpu0 = super::cpu_time();
    for _ in 0..n {
        let mut s = TcpStream::connect_with(addr, c)?;
        s.set_nodelay(true)?;
        s.write_all(&request(KIND_LAT, true, 1, 1))?;
        s.write_all(b"x")?;
        let mut b = [0u8; 1];
        s.read_exact(&mut b)?;
        transport = Some(s.transport());
    }
    let us = t0.elapsed().as_secs_f64() * 1e6 / n as f64;
    let cpu = (super::cpu_time() - cpu0) * 1e6 / n as f64;
    let transport = transport.map(|t| t.to_string()).unwrap_or_default();
    Ok((transport, n, us, cpu))
}

/// `read_exact` on a non-blocking stream, busy-polling; `false` at end of
/// stream before the first octet.
fn spin_read_exact(s: &mut TcpStream, buf: &mut [u8]) -> io::Result<bool> {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `write_all` on a non-blocking stream, busy-polling.
fn spin_write_all(s: &mut TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match s.write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Latency of plain TCP with both ends busy-polling non-blocking sockets.
fn lat_spin(
    addr: SocketAddr,
    c: &Config,
    a: &StreamArgs,
    size: usize,
) -> io::Result<(String, Vec<f64>, f64)> {
    let mut s = TcpStream::connect_with(addr, c)?;
    let transport = format!("{} busy-polled", s.transport());
    s.set_nodelay(true)?;
    let n = a.iters.unwrap_or(10_000).max(1);
    s.write_all(&request_spin(KIND_LAT, true, true, size, n))?;
    s.set_nonblocking(true)?;
    let (rtts, cpu) = round_trips(&mut s, n, size, |s, out, back| {
        spin_write_all(s, out)?;
        if !spin_read_exact(s, back)? {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    })?;
    s.set_nonblocking(false)?;
    s.shutdown(Shutdown::Write)?;
    let mut end = [0u8; 1];
    let _ = s.read(&mut end);
    Ok((transport, rtts, cpu))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// One run's result: the transport and, per run, bandwidth (MB/s) or the
/// round trips (µs).
/// Each with the process's CPU µs per operation.
enum Sample {
    Bw(String, u64, f64, f64),
    Lat(String, Vec<f64>, f64),
    /// Connections made, mean µs per connection.
    Setup(String, u64, f64, f64),
}

/// One run; `baseline`: of the TCP baseline.
fn sample(
    addr: SocketAddr,
    a: &StreamArgs,
    size: usize,
    mode: Mode,
    baseline: bool,
) -> io::Result<Sample> {
    let c = cfg(a, mode);
    if baseline && a.lat && a.baseline.as_deref() == Some("tcp-spin") {
        let (t, rtts, cpu) = lat_spin(addr, &c, a, size)?;
        Ok(Sample::Lat(t, rtts, cpu))
    } else if a.setup {
        let (t, n, us, cpu) = setup(addr, &c, a)?;
        Ok(Sample::Setup(t, n, us, cpu))
    } else if a.lat {
        let (t, rtts, cpu) = lat(addr, &c, a, size)?;
        Ok(Sample::Lat(t, rtts, cpu))
    } else {
        let (t, bytes, secs, cpu) = bw(addr, &c, a, size)?;
        Ok(Sample::Bw(t, bytes, secs, cpu))
    }
}

/// The row of one transport from its runs (medians).
fn row_of(a: &StreamArgs, size: usize, kind: &'static str, runs: Vec<Sample>) -> StreamRow {
    let mut row = StreamRow {
        test: "stream",
        mode: if a.setup {
            "setup"
        } else if a.lat {
            "lat"
        } else {
            "bw"
        },
        transport: String::new(),
        kind,
        size,
        count: 0,
        secs: 0.0,
        mb_s: None,
        lat_us: None,
        lat_mean_us: None,
        lat_p99_us: None,
        ratio_to_tcp: None,
        cpu_us: None,
    };
    let mut cpu = Vec::new();
    let mut med = Vec::new();
    let mut mean = Vec::new();
    let mut p99 = Vec::new();
    let mut rates = Vec::new();
    for s in runs {
        match s {
            Sample::Lat(t, mut rtts, c) => {
                cpu.push(c);
                row.transport = t;
                row.count = rtts.len() as u64;
                row.secs = rtts.iter().sum::<f64>() / 1e6;
                mean.push(rtts.iter().sum::<f64>() / rtts.len().max(1) as f64 / 2.0);
                let m = median(&mut rtts);
                med.push(m / 2.0);
                p99.push(rtts[(rtts.len() * 99 / 100).min(rtts.len() - 1)] / 2.0);
            }
            Sample::Setup(t, n, us, c) => {
                cpu.push(c);
                row.transport = t;
                row.count = n;
                row.secs = us * n as f64 / 1e6;
                med.push(us);
                mean.push(us);
            }
            Sample::Bw(t, bytes, secs, c) => {
                cpu.push(c);
                row.transport = t;
                row.count = bytes;
                row.secs = secs;
                rates.push(bytes as f64 / secs / 1e6);
            }
        }
    }
    if a.setup {
        row.lat_us = Some(median(&mut med));
    } else if a.lat {
        row.lat_us = Some(median(&mut med));
        row.lat_mean_us = Some(median(&mut mean));
        row.lat_p99_us = Some(median(&mut p99));
    } else {
        row.mb_s = Some(median(&mut rates));
    }
    row.cpu_us = Some(median(&mut cpu));
    row
}

/// Measures `size` on the measured transport and, with `tcp`, on plain TCP,
/// the runs alternated (A, B, A, B, ...) so that a machine whose load
/// changes meanwhile weighs on both alike.
fn measure(
    addr: SocketAddr,
    a: &StreamArgs,
    size: usize,
    tcp: bool,
) -> io::Result<(StreamRow, Option<StreamRow>)> {
    let mut sd = Vec::new();
    let mut base = Vec::new();
    for _ in 0..a.runs.max(1) {
        sd.push(sample(addr, a, size, measured_mode(a), false)?);
        if tcp {
            base.push(sample(addr, a, size, Mode::Tcp, true)?);
        }
    }
    let sd = row_of(a, size, "sdp", sd);
    let base = tcp.then(|| row_of(a, size, "tcp", base));
    Ok((sd, base))
}

fn print_row(r: &StreamRow, a: &StreamArgs, first: bool, out: &mut dyn Write) -> io::Result<()> {
    let f = |v: Option<f64>| v.map_or(String::new(), |v| format!("{v:.2}"));
    if a.json {
        writeln!(
            out,
            "{}",
            serde_json::to_string(r).map_err(io::Error::other)?
        )
    } else if a.csv {
        if first {
            writeln!(
                out,
                "test,mode,kind,transport,size,count,secs,mb_s,lat_us,lat_mean_us,lat_p99_us,ratio_to_tcp,cpu_us"
            )?;
        }
        writeln!(
            out,
            "{},{},{},\"{}\",{},{},{:.6},{},{},{},{},{},{}",
            r.test,
            r.mode,
            r.kind,
            r.transport,
            r.size,
            r.count,
            r.secs,
            f(r.mb_s),
            f(r.lat_us),
            f(r.lat_mean_us),
            f(r.lat_p99_us),
            f(r.ratio_to_tcp),
            f(r.cpu_us)
        )
    } else {
        if first {
            if a.setup {
                writeln!(
                    out,
                    "{:>9} {:<4} {:>10} {:>8} {:>9}  transport",
                    "conns", "kind", "µs/conn", "vs TCP", "cpu µs"
                )?;
            } else if a.lat {
                writeln!(
                    out,
                    "{:>9} {:<4} {:>10} {:>10} {:>10} {:>8} {:>9}  transport",
                    "size", "kind", "lat µs", "mean µs", "p99 µs", "vs TCP", "cpu µs"
                )?;
            } else {
                writeln!(
                    out,
                    "{:>9} {:<4} {:>12} {:>8} {:>9}  transport",
                    "size", "kind", "MB/s", "vs TCP", "cpu µs"
                )?;
            }
        }
        let ratio = r.ratio_to_tcp.map_or(String::new(), |x| format!("{x:.2}×"));
        if a.setup {
            writeln!(
                out,
                "{:>9} {:<4} {:>10} {:>8} {:>9}  {}",
                r.count,
                r.kind,
                f(r.lat_us),
                ratio,
                f(r.cpu_us),
                r.transport
            )
        } else if a.lat {
            writeln!(
                out,
                "{:>9} {:<4} {:>10} {:>10} {:>10} {:>8} {:>9}  {}",
                r.size,
                r.kind,
                f(r.lat_us),
                f(r.lat_mean_us),
                f(r.lat_p99_us),
                ratio,
                f(r.cpu_us),
                r.transport
            )
        } else {
            writeln!(
                out,
                "{:>9} {:<4} {:>12} {:>8} {:>9}  {}",
                r.size,
                r.kind,
                f(r.mb_s),
                ratio,
                f(r.cpu_us),
                r.transport
            )
        }
    }
}

fn sizes(a: &StreamArgs) -> Vec<usize> {
    if a.setup {
        return vec![1];
    }
    let top = a.size.unwrap_or(if a.all {
        1 << 20
    } else if a.lat {
        64
    } else {
        128 << 10
    });
    if !a.all {
        return vec![top];
    }
    let mut v = Vec::new();
    let mut s = 64usize;
    while s < top {
        v.push(s);
        s *= 4;
    }
    v.push(top);
    v
}

fn resolve(host: &str, port: u16) -> io::Result<SocketAddr> {
    let with_port = if host.parse::<SocketAddr>().is_ok()
        || host
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.contains(':') && p.parse::<u16>().is_ok())
    {
        host.to_string()
    } else if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    };
    with_port
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {host}")))
}

/// Runs the client side against `addr`: every size, the measured mode and,
/// with a baseline, plain TCP right after it. Returns the rows.
pub fn run_client(
    addr: SocketAddr,
    a: &StreamArgs,
    out: &mut dyn Write,
) -> io::Result<Vec<StreamRow>> {
    let mut rows = Vec::new();
    let mut first = true;
    for size in sizes(a) {
        let (mut sd, tcp) = measure(addr, a, size, a.baseline.is_some())?;
        if let Some(tcp) = tcp {
            sd.ratio_to_tcp = match (a.lat || a.setup, sd.mb_s, tcp.mb_s, sd.lat_us, tcp.lat_us) {
                (false, Some(x), Some(y), _, _) if y > 0.0 => Some(x / y),
                (true, _, _, Some(x), Some(y)) if y > 0.0 => Some(x / y),
                _ => None,
            };
            print_row(&sd, a, first, out)?;
            print_row(&tcp, a, false, out)?;
            rows.push(sd);
            rows.push(tcp);
        } else {
            print_row(&sd, a, first, out)?;
            rows.push(sd);
        }
        first = false;
    }
    Ok(rows)
}

fn end_server(addr: SocketAddr) {
    if let Ok(mut s) = TcpStream::connect_with(addr, &Config::with_mode(Mode::Tcp)) {
        let _ = s.write_all(&request(KIND_END, false, 1, 0));
    }
}

/// Entry point of `softrdma perf stream` (`argv` starts with `stream`).
pub fn main_with_args(argv: &[String]) -> ExitCode {
    let a = match StreamArgs::try_parse_from(argv) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    if let Some(d) = a.duration
        && !(d.is_finite() && d > 0.0)
    {
        eprintln!("softrdma perf stream: error: --duration must be a positive number of seconds");
        return ExitCode::from(2);
    }
    let stdout = io::stdout();
    let mut out = stdout.lock();
    let listen_cfg = cfg(&a, Mode::Auto);
    if a.server {
        let l = match TcpListener::bind_with((a.bind.as_str(), a.port), &listen_cfg) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "softrdma perf stream: error: cannot listen on {}:{}: {e}",
                    a.bind, a.port
                );
                return ExitCode::FAILURE;
            }
        };
        match l.local_addr() {
            Ok(addr) => {
                let _ = writeln!(out, "listening on {addr}");
                let _ = out.flush();
            }
            Err(e) => eprintln!("softrdma perf stream: {e}"),
        }
        drop(out);
        serve(&l, a.persist);
        return ExitCode::SUCCESS;
    }
    let (addr, server) = match &a.connect {
        Some(host) => match resolve(host, a.port) {
            Ok(addr) => (addr, None),
            Err(e) => {
                eprintln!("softrdma perf stream: error: {host}: {e}");
                return ExitCode::FAILURE;
            }
        },
        None => {
            let l = match TcpListener::bind_with("127.0.0.1:0", &listen_cfg) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("softrdma perf stream: error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let addr = match l.local_addr() {
                Ok(a) => a,
                Err(e) => {
                    eprintln!("softrdma perf stream: error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            (addr, Some(thread::spawn(move || serve(&l, false))))
        }
    };
    let res = run_client(addr, &a, &mut out);
    if server.is_some() || a.connect.is_some() {
        end_server(addr);
    }
    if let Some(t) = server {
        let _ = t.join();
    }
    match res {
        Ok(_) => ExitCode::SUCCESS,
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("softrdma perf stream: error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> StreamArgs {
        let mut v = vec!["stream"];
        v.extend_from_slice(extra);
        StreamArgs::try_parse_from(v).unwrap()
    }

    /// A measured row over an offloaded connection and its baseline row
    /// over plain TCP.
    fn offloaded_then_plain(rows: &[StreamRow]) {
        assert_eq!(rows.len(), 2);
        assert!(
            rows[0].transport.starts_with("offloaded"),
            "{}",
            rows[0].transport
        );
        assert!(
            rows[1].transport.starts_with("plain"),
            "{}",
            rows[1].transport
        );
    }

    /// Both patterns against one dual listener: the measured row is
    /// offloaded, the baseline row plain, every octet is counted by the
    /// server, and the CSV has a header and one line per row.
    #[test]
    fn loopback_bw_and_lat_with_tcp_baseline() {
        let l = TcpListener::bind_with("127.0.0.1:0", &Config::default()).unwrap();
        let addr = l.local_addr().unwrap();
        let server = thread::spawn(move || serve(&l, false));
        let bw_args = args(&["-s", "4K", "-n", "300", "--baseline", "tcp", "--csv"]);
        let mut out = Vec::new();
        let rows = run_client(addr, &bw_args, &mut out).unwrap();
        offloaded_then_plain(&rows);
        for r in &rows {
            assert_eq!(r.count, 300 * 4096);
            assert!(r.mb_s.unwrap() > 0.0);
        }
        assert!(rows[0].ratio_to_tcp.is_some());
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 3, "{text}");
        assert!(text.starts_with("test,mode,kind,"));
        let lat_args = args(&["--lat", "-s", "100", "-n", "200", "--json"]);
        let mut out = Vec::new();
        let rows = run_client(addr, &lat_args, &mut out).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].count, 200);
        assert!(rows[0].lat_us.unwrap() > 0.0);
        // 200 round trips cost the process CPU time.
        assert!(rows[0].cpu_us.is_some_and(|c| c.is_finite() && c > 0.0));
        let v: serde_json::Value =
            serde_json::from_str(String::from_utf8(out).unwrap().trim()).unwrap();
        assert_eq!(v["mode"], "lat");
        assert!(v["cpu_us"].is_number(), "{v}");
        end_server(addr);
        server.join().unwrap();
    }

    /// Setup rows and the busy-polled TCP latency baseline against one
    /// dual listener: the measured rows are offloaded, the baselines
    /// plain, every connection and round trip is counted.
    #[test]
    fn setup_and_spinning_tcp_baseline() {
        let l = TcpListener::bind_with("127.0.0.1:0", &Config::default()).unwrap();
        let addr = l.local_addr().unwrap();
        let server = thread::spawn(move || serve(&l, false));
        let a = args(&["--setup", "-n", "5", "-r", "2", "--baseline", "tcp"]);
        let rows = run_client(addr, &a, &mut Vec::new()).unwrap();
        offloaded_then_plain(&rows);
        assert_eq!(rows[0].mode, "setup");
        assert!(rows.iter().all(|r| r.count == 5 && r.lat_us.unwrap() > 0.0));
        let a = args(&["--lat", "-n", "50", "--baseline", "tcp-spin"]);
        let rows = run_client(addr, &a, &mut Vec::new()).unwrap();
        assert_eq!(rows.len(), 2);
        assert!(
            rows[1].transport.ends_with("busy-polled"),
            "{}",
            rows[1].transport
        );
        assert!(rows.iter().all(|r| r.count == 50));
        end_server(addr);
        server.join().unwrap();
    }

    #[test]
    fn sweep_sizes() {
        assert_eq!(sizes(&args(&["-a", "-s", "4K"])), vec![64, 256, 1024, 4096]);
        assert_eq!(sizes(&args(&["--lat"])), vec![64]);
        assert_eq!(sizes(&args(&[])), vec![128 << 10]);
    }
}
