//! Two-process mode: `softrdma perf TEST --server` in one process,
//! `softrdma perf TEST --connect HOST` in another (perftest's
//! `ib_write_bw` / `ib_write_bw HOST`).
//!
//! The client decides everything. The exchange, all through the engine's
//! connection manager and QPs:
//!
//! ```text
//! client                                         server (listening)
//! control QP: connect, private data Hello ─────▶ check against its own flags
//!   (test, mode, sizes, iters/duration,           refuse: MPA reject with the
//!    depth, qps, inline, CRC, TCP baseline)       reason | accept: Welcome
//! ◀──────────────── Welcome (session, TCP baseline port)
//! per size:
//!   Send Round (size, client buffers) ─────────▶
//!   data QPs 1..=qps: connect (session, round,  accept each
//!   index) ────────────────────────────────────▶ post receives
//!   ◀──────────────────────────── Send Ready (server buffers: addr, STag, len)
//!   measuring loop (Writes, Reads, Sends, ...)   serving loop
//!   Send End (receives to wait for) ───────────▶
//!   ◀─────────────────────────────────────────── Send Done
//!   [TCP baseline: connect to the baseline port, same pattern]
//!   Send Result (the numbers) ─────────────────▶ prints the row too
//! Send Bye ────────────────────────────────────▶ exits (or serves the next)
//! ```
//!
//! The control QP is a connection of its own, so the data QPs carry
//! exactly what loopback mode's carry. Every wait is bounded by the
//! timeout of [`Params::timeout`]; a peer that leaves is seen as its
//! QPs leaving RTS. A failure is reported to the peer with an Error
//! message when the control connection still works.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use softrdma_engine::cm::{self, CmError, ConnectConfig, ListenConfig, Listener};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::{
    Access, Device, MemoryRegion, QpInitAttr, QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode,
    WcStatus, WorkCompletion,
};

use super::msg::{Control, DataConn, Hello, MAX_CONTROL, MAX_SIZES, Welcome, refusal};
use super::output::{Progress, Style, header, line};
use super::rdma::{Active, End, Passive, Peer, passive_bytes, run_active, serve};
use super::{
    Baseline, Constraints, Mode, Params, PerfError, PerfOptions, Row, ServerOptions, Summary, Test,
    cpu_time, device, eng, io, label, msg, tcp, tcp_params, validate, validate_all,
};

/// Receives kept posted on the control QP: the exchange is request/answer,
/// but during a run the measuring side also sends a heartbeat every
/// [`super::rdma::HEARTBEAT`] without waiting for an answer.
const CONTROL_RECVS: usize = 4;

/// How long the serving loop goes at most without taking the control
/// connection's messages: well under the time the client's heartbeats
/// ([`super::rdma::HEARTBEAT`] apart) take to use up [`CONTROL_RECVS`]
/// receives, so a heartbeat never meets a missing receive (which is a
/// Terminate on iWARP).
const CONTROL_CHECK: Duration = Duration::from_millis(50);

/// `wr_id` of control Sends.
const SEND_ID: u64 = u64::MAX;

/// `wr_id` of heartbeats (not waited for).
const ALIVE_ID: u64 = u64::MAX - 1;

/// The control connection: small messages as Sends, one at a time.
struct Ctl {
    end: End,
    qp: QueuePair,
    rbuf: MemoryRegion,
    sbuf: MemoryRegion,
    /// Messages received while waiting for a Send to complete.
    stash: VecDeque<Vec<u8>>,
    timeout: Duration,
    /// "client" or "server", for messages.
    peer: &'static str,
    /// Why the connection failed, once it did.
    failed: Option<String>,
}

impl Ctl {
    fn new(dev: &Device, timeout: Duration, peer: &'static str) -> Result<Ctl, PerfError> {
        let end = End::new(dev, 64, false)?;
        let mut attr = QpInitAttr::new(&end.cq, &end.cq);
        attr.cap.max_send_wr = 16;
        attr.cap.max_recv_wr = 16;
        attr.cap.max_inline_data = 16;
        let qp = QueuePair::new(&end.pd, &attr).map_err(eng)?;
        let rbuf = end.mr(CONTROL_RECVS * MAX_CONTROL, Access::LOCAL_WRITE)?;
        let sbuf = end.mr(MAX_CONTROL, Access::NONE)?;
        let c = Ctl {
            end,
            qp,
            rbuf,
            sbuf,
            stash: VecDeque::new(),
            timeout,
            peer,
            failed: None,
        };
        for slot in 0..CONTROL_RECVS {
            c.post_recv(slot)?;
        }
        Ok(c)
    }

    fn post_recv(&self, slot: usize) -> Result<(), PerfError> {
        let s = [self
            .rbuf
            .sge(slot * MAX_CONTROL, MAX_CONTROL as u32)
            .map_err(eng)?];
        self.qp
            .post_recv(&RecvWr::new(slot as u64, &s))
            .map_err(eng)
    }

    fn gone(&self) -> PerfError {
        PerfError::Peer(format!("the {} closed the connection", self.peer))
    }

    /// Takes completions: received messages go to the stash. Returns
    /// whether the outstanding Send completed. A failed completion (the
    /// peer left) is reported once the messages before it are taken.
    fn pump(&mut self) -> Result<bool, PerfError> {
        let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 8];
        let k = self.end.cq.poll(&mut buf);
        let mut sent = false;
        for wc in &buf[..k] {
            if wc.status != WcStatus::Success {
                if self.failed.is_none() {
                    self.failed = Some(
                        if self.qp.state() != QpState::Rts || wc.status == WcStatus::WrFlush {
                            self.gone().to_string()
                        } else {
                            format!(
                                "the control connection to the {} failed: {}",
                                self.peer, wc.status
                            )
                        },
                    );
                }
                continue;
            }
            if wc.opcode == WcOpcode::Recv {
                let slot = (wc.wr_id as usize).min(CONTROL_RECVS - 1);
                let len = (wc.byte_len as usize).min(MAX_CONTROL);
                let mut m = vec![0u8; len];
                self.rbuf.read(slot * MAX_CONTROL, &mut m).map_err(eng)?;
                // No more receives once the peer is closing (after its Bye).
                if self.qp.state() == QpState::Rts {
                    self.post_recv(slot)?;
                }
                self.stash.push_back(m);
            } else if wc.wr_id == SEND_ID {
                sent = true;
            }
        }
        match &self.failed {
            Some(e) if self.stash.is_empty() && !sent => Err(PerfError::Peer(e.clone())),
            _ => Ok(sent),
        }
    }

    /// Waits a little: spins for the first 2 ms of a wait, then sleeps.
    fn pause(since: Instant) {
        if since.elapsed() < Duration::from_millis(2) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn send(&mut self, m: &Control) -> Result<(), PerfError> {
        let b = m.encode();
        self.sbuf.write(0, &b).map_err(eng)?;
        let s = [self.sbuf.sge(0, b.len() as u32).map_err(eng)?];
        self.qp
            .post_send(&SendWr::new(SEND_ID, SendOp::Send).sg_list(&s).signaled())
            .map_err(|e| {
                if self.qp.state() == QpState::Rts {
                    eng(e)
                } else {
                    self.gone()
                }
            })?;
        let start = Instant::now();
        while !self.pump()? {
            if self.failed.is_some() {
                // The peer answered, then closed: the Send arrived.
                return Ok(());
            }
            if start.elapsed() > self.timeout {
                return Err(PerfError::Timeout(format!(
                    "sending to the {} ({})",
                    self.peer,
                    m.name()
                )));
            }
            Self::pause(start);
        }
        Ok(())
    }

    /// A heartbeat: takes the completions (so the CQ never fills), fails
    /// if the peer reported an error or left, and posts an `Alive`
    /// without waiting for it.
    fn heartbeat(&mut self) -> Result<(), PerfError> {
        self.pump()?;
        if let Some(b) = self.stash.front()
            && let Ok(Control::Error(_)) = Control::decode(b)
        {
            self.try_recv()?;
        }
        let b = Control::Alive.encode();
        self.qp
            .post_send(&SendWr::new(ALIVE_ID, SendOp::Send).inline(&b).signaled())
            .map_err(|e| {
                if self.qp.state() == QpState::Rts {
                    eng(e)
                } else {
                    self.gone()
                }
            })
    }

    /// Tells the peer why this side gives up (best effort).
    fn send_error(&mut self, e: &PerfError) {
        if self.qp.state() == QpState::Rts {
            self.timeout = self.timeout.min(Duration::from_secs(1));
            let _ = self.send(&Control::Error(e.to_string()));
        }
    }

    /// The next message if one arrived; the peer's Error message is an
    /// error.
    fn try_recv(&mut self) -> Result<Option<Control>, PerfError> {
        if self.stash.is_empty() {
            self.pump()?;
        }
        let Some(b) = self.stash.pop_front() else {
            return Ok(None);
        };
        match Control::decode(&b) {
            Ok(Control::Error(m)) => Err(PerfError::Peer(format!("the {} failed: {m}", self.peer))),
            Ok(m) => Ok(Some(m)),
            Err(e) => Err(PerfError::Peer(e.to_string())),
        }
    }

    /// Waits for the next message (`what`, for the error message).
    fn recv(&mut self, what: &str) -> Result<Control, PerfError> {
        let start = Instant::now();
        let gone = |e: PerfError, failed: bool| match e {
            PerfError::Peer(m) if failed => PerfError::Peer(format!("{m} (waiting for {what})")),
            e => e,
        };
        loop {
            let live = self.qp.state() == QpState::Rts;
            match self.try_recv() {
                Ok(Some(Control::Alive)) => continue,
                Ok(Some(m)) => return Ok(m),
                Ok(None) => {}
                Err(e) => return Err(gone(e, self.failed.is_some())),
            }
            if !live {
                // Everything that arrived before the close was taken.
                return Err(gone(self.gone(), true));
            }
            if start.elapsed() > self.timeout {
                return Err(PerfError::Timeout(format!(
                    "nothing from the {} for {} s (waiting for {what})",
                    self.peer,
                    secs(self.timeout)
                )));
            }
            Self::pause(start);
        }
    }
}

/// Seconds for messages: `2`, `0.5`.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s}")
    }
}

fn unexpected(what: &str, m: &Control) -> PerfError {
    PerfError::Peer(format!(
        "protocol error: expected {what}, got a '{}' message",
        m.name()
    ))
}

impl Control {
    fn name(&self) -> &'static str {
        match self {
            Control::Round { .. } => "round",
            Control::Ready { .. } => "ready",
            Control::End { .. } => "end",
            Control::Done { .. } => "done",
            Control::Result { .. } => "result",
            Control::Bye => "bye",
            Control::Alive => "alive",
            Control::Error(_) => "error",
        }
    }
}

/// `host` with `port` unless it has one: `host`, `host:port`, `1.2.3.4`,
/// `::1`, `[::1]`, `[::1]:port`.
pub fn with_port(host: &str, port: u16) -> String {
    if host.parse::<SocketAddr>().is_ok() {
        return host.to_string();
    }
    if let Ok(ip) = host.parse::<Ipv6Addr>() {
        return format!("[{ip}]:{port}");
    }
    if host.starts_with('[') && host.ends_with(']') {
        return format!("{host}:{port}");
    }
    if let Some((h, p)) = host.rsplit_once(':')
        && !h.contains(':')
        && p.parse::<u16>().is_ok()
    {
        return host.to_string();
    }
    format!("{host}:{port}")
}

/// [`with_port`], refusing a port that is not one (`host:99999`,
/// `host:abc`, `[::1]:x`, port 0).
///
/// # Errors
///
/// A message naming the bad port.
pub fn checked_port(host: &str, port: u16) -> Result<String, String> {
    let given = if let Some(rest) = host.strip_prefix('[') {
        rest.split_once("]:").map(|(_, p)| p)
    } else {
        host.rsplit_once(':')
            .filter(|(h, _)| !h.contains(':'))
            .map(|(_, p)| p)
    };
    if let Some(p) = given
        && !p.parse::<u16>().is_ok_and(|p| p > 0)
    {
        return Err(format!(
            "invalid port '{p}' in '{host}' (a number from 1 to 65535)"
        ));
    }
    Ok(with_port(host, port))
}

fn mpa_config(p: &Params, rd: u16) -> MpaConfig {
    MpaConfig {
        ird: rd,
        ord: rd,
        ..super::mpa(p)
    }
}

fn connect_error(target: &str, e: CmError) -> PerfError {
    match e {
        CmError::Rejected { private_data } => PerfError::Refused(format!(
            "the server refused the test: {}",
            msg::refusal_reason(&private_data).unwrap_or_else(|| "no reason given".into())
        )),
        CmError::Unreachable(e) => PerfError::Peer(format!(
            "cannot connect to {target}: {e} (is `softrdma perf --server` running there?)"
        )),
        CmError::Resolve(e) => PerfError::Peer(format!("cannot resolve {target}: {e}")),
        CmError::TimedOut => PerfError::Timeout(format!("connecting to {target}")),
        e => PerfError::Peer(format!("connecting to {target}: {e}")),
    }
}

/// The serving side's answer to a run's end.
struct RemotePeer<'a> {
    ctl: &'a mut Ctl,
}

impl Peer for RemotePeer<'_> {
    fn alive(&mut self) -> Result<(), PerfError> {
        self.ctl.heartbeat()
    }

    fn finish(&mut self, recvs: u64) -> Result<(), PerfError> {
        self.ctl.send(&Control::End { recvs })?;
        match self.ctl.recv("the end of the run")? {
            Control::Done { .. } => Ok(()),
            m => Err(unexpected("'done'", &m)),
        }
    }
}

/// The client: runs every size of `o` against the server at `server`.
///
/// # Errors
///
/// Bad options, the server unreachable or refusing, and every failure of
/// a run (the server's included).
pub fn run_client(
    o: &PerfOptions,
    server: &str,
    port: u16,
    out: &mut dyn Write,
) -> Result<Vec<Row>, PerfError> {
    validate_all(o)?;
    if o.sizes.len() > MAX_SIZES {
        return Err(PerfError::Usage(format!(
            "at most {MAX_SIZES} sizes in two-process mode"
        )));
    }
    let p0 = &o.params;
    let target = checked_port(server, port).map_err(PerfError::Usage)?;
    let dev = device(p0)?;
    let mut ctl = Ctl::new(&dev, p0.timeout, "server")?;
    let hello = Hello {
        test: p0.test,
        mode: p0.mode,
        crc: p0.crc,
        baseline_tcp: o.baseline.is_some(),
        tcp_spin: o.baseline == Some(Baseline::TcpSpin),
        iters: p0.iters,
        duration: p0.duration,
        depth: p0.depth,
        qps: p0.qps,
        inline: p0.inline,
        sizes: o.sizes.clone(),
    };
    let conn = cm::connect(
        &ctl.qp,
        target.as_str(),
        &ConnectConfig {
            mpa: mpa_config(p0, 16),
            private_data: hello.encode(),
            timeout: p0.timeout,
        },
    )
    .map_err(|e| connect_error(&target, e))?;
    let welcome = Welcome::decode(&conn.peer_private_data().unwrap_or_default()).map_err(|e| {
        PerfError::Peer(format!(
            "the peer at {target} is not a softrdma perf server (a perftest server? \
                 its answer to the connection request: {e})"
        ))
    })?;
    let addr = conn
        .peer_addr()
        .ok_or_else(|| PerfError::Peer("the server's address is unknown".into()))?;
    tracing::info!(
        server = %addr,
        session = welcome.session,
        tcp_baseline_port = welcome.tcp_port,
        "connected: the server accepted the test"
    );
    tracing::debug!(negotiated = ?conn.negotiated(), "control connection");
    drop(conn);
    if o.baseline.is_some() && welcome.tcp_port == 0 {
        return Err(PerfError::Peer(
            "the server offered no port for the TCP baseline".into(),
        ));
    }
    let progress = Progress::start();
    header(out, o.style(), p0, &format!("client of {addr}")).map_err(io("output"))?;
    out.flush().map_err(io("output"))?;
    let mut rows = Vec::new();
    for (round, &size) in o.sizes.iter().enumerate() {
        let p = Params { size, ..p0.clone() };
        progress.set(label(&p));
        let r = client_round(
            o,
            &p,
            round as u32,
            &dev,
            &mut ctl,
            addr,
            welcome,
            &progress,
        );
        rows.push(round_done(&mut ctl, out, o, r)?);
    }
    // The server exits when the Bye arrives: its close may overtake the
    // Send's completion here.
    match ctl.send(&Control::Bye) {
        Ok(()) | Err(PerfError::Peer(_)) => Ok(rows),
        Err(e) => Err(e),
    }
}

/// Ends one size: a failure is reported to the peer; a result is printed.
fn round_done(
    ctl: &mut Ctl,
    out: &mut dyn Write,
    o: &PerfOptions,
    r: Result<Row, PerfError>,
) -> Result<Row, PerfError> {
    let r = r.inspect_err(|e| ctl.send_error(e))?;
    let st = Style {
        baseline: r.baseline.map(|b| {
            if b == Baseline::TcpSpin.name() {
                Baseline::TcpSpin
            } else {
                Baseline::Tcp
            }
        }),
        ..o.style()
    };
    line(out, st, &r).map_err(io("output"))?;
    out.flush().map_err(io("output"))?;
    Ok(r)
}

#[allow(clippy::too_many_arguments)]
fn client_round(
    o: &PerfOptions,
    p: &Params,
    round: u32,
    dev: &Device,
    ctl: &mut Ctl,
    addr: SocketAddr,
    welcome: Welcome,
    progress: &Progress,
) -> Result<Row, PerfError> {
    let mut a = Active::new(p, dev)?;
    a.prepare(p)?;
    ctl.send(&Control::Round {
        size: p.size,
        bufs: a.sinks(),
    })?;
    for (i, qp) in a.qps.iter().enumerate() {
        let config = ConnectConfig {
            mpa: mpa_config(p, p.rd()),
            private_data: DataConn {
                session: welcome.session,
                round,
                index: i as u16,
            }
            .encode(),
            timeout: p.timeout,
        };
        if let Err(e) = cm::connect(qp, addr, &config) {
            // The server may have said why.
            ctl.try_recv()?;
            return Err(connect_error(&addr.to_string(), e));
        }
    }
    let bufs = match ctl.recv("the server's buffers")? {
        Control::Ready { bufs } => bufs,
        m => return Err(unexpected("'ready'", &m)),
    };
    // Send tests use no buffer of the server's.
    let need = if p.test == Test::Send {
        0
    } else {
        p.size as u64
    };
    if bufs.len() != a.qps.len() || bufs.iter().any(|b| b.len < need) {
        return Err(PerfError::Peer(
            "the server's buffers do not match the test".into(),
        ));
    }
    a.remote = bufs;
    tracing::info!(
        round,
        size = p.size,
        qps = a.qps.len(),
        "data connections up; measuring"
    );
    let m = run_active(p, &a, &mut RemotePeer { ctl })?;
    tracing::info!(round, iters = m.iters, secs = m.secs, "measured");
    drop(a);
    let tcp = if o.baseline.is_some() {
        progress.set(format!("tcp baseline {}", super::human_size(p.size)));
        let to = SocketAddr::new(addr.ip(), welcome.tcp_port);
        let s = TcpStream::connect_timeout(&to, p.timeout)
            .map_err(io("connecting to the server's TCP baseline port"))?;
        Some(tcp::active(&tcp_params(p, &m, o.baseline), s)?.summary())
    } else {
        None
    };
    let rdma = m.summary();
    ctl.send(&Control::Result { rdma, tcp })?;
    Ok(Row::new(p, &rdma, tcp.as_ref(), o.baseline))
}

/// Why the server refuses `h`, if its own flags `c` ask for something
/// else.
fn conflicts(c: &Constraints, h: &Hello) -> Option<String> {
    let mut why = Vec::new();
    if let Some(t) = c.test
        && t != h.test
    {
        why.push(format!(
            "the server runs '{}', the client asked for '{}'",
            t.name(),
            h.test.name()
        ));
    }
    if c.lat && h.mode != Mode::Lat {
        why.push("the server runs a latency test (--lat), the client a bandwidth test".into());
    }
    if c.crc && !h.crc {
        why.push("the server requires the MPA CRC (--crc), the client did not ask for it".into());
    }
    if let Some(s) = &c.sizes
        && h.sizes != *s
    {
        let list = |v: &[usize]| {
            v.iter()
                .map(|&s| super::human_size(s))
                .collect::<Vec<_>>()
                .join(",")
        };
        why.push(format!(
            "the server's message sizes are {} (-s/-a), the client's {}",
            list(s),
            list(&h.sizes)
        ));
    }
    if let Some(n) = c.iters
        && (h.iters != n || h.duration.is_some())
    {
        why.push(format!("the server's iteration count is {n} (-n)"));
    }
    if let Some(d) = c.duration
        && h.duration != Some(d)
    {
        why.push(format!(
            "the server's duration is {} s (-D)",
            d.as_secs_f64()
        ));
    }
    if let Some(d) = c.depth
        && h.depth != d
    {
        why.push(format!(
            "the server's depth is {d}, the client's {}",
            h.depth
        ));
    }
    if let Some(q) = c.qps
        && h.qps != q
    {
        why.push(format!(
            "the server's QP count is {q}, the client's {}",
            h.qps
        ));
    }
    if let Some(i) = c.inline
        && h.inline != i
    {
        why.push(format!(
            "the server's inline size is {i}, the client's {}",
            h.inline
        ));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// A random session number.
fn session_id() -> u32 {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new().hash_one((std::process::id(), Instant::now()))
        as u32
}

/// The server: listens, prints `listening on ADDR:PORT`, serves one
/// client's run (every client's, one after another, with `persist`).
///
/// # Errors
///
/// The address cannot be listened on, no client within the timeout, the
/// client refused (its test conflicts with the server's flags) or a
/// failure of the run.
pub fn run_server(
    o: &PerfOptions,
    s: &ServerOptions,
    out: &mut dyn Write,
) -> Result<Vec<Row>, PerfError> {
    let local = &o.params;
    let bind = with_port(
        if s.bind.is_empty() {
            "0.0.0.0"
        } else {
            &s.bind
        },
        s.port,
    );
    let config = ListenConfig {
        mpa: MpaConfig {
            crc: if s.require.crc {
                CrcPolicy::Required
            } else {
                CrcPolicy::AcceptIfAsked
            },
            ..MpaConfig::default()
        },
        handshake_timeout: local.timeout,
        ..ListenConfig::default()
    };
    let listener = Listener::bind(bind.as_str(), 8, config).map_err(|e| match e {
        CmError::Io(source) => PerfError::Io {
            what: format!("cannot listen on {bind}"),
            source,
        },
        e => PerfError::Peer(format!("cannot listen on {bind}: {e}")),
    })?;
    // A JSON stream stays JSON; CSV gets the line on stderr.
    match o.format {
        super::Format::Json => writeln!(
            out,
            "{}",
            serde_json::json!({"listening": listener.local_addr().to_string()})
        ),
        super::Format::Csv => {
            eprintln!("listening on {}", listener.local_addr());
            Ok(())
        }
        super::Format::Human => writeln!(out, "listening on {}", listener.local_addr()),
    }
    .map_err(io("output"))?;
    out.flush().map_err(io("output"))?;
    let mut rows = Vec::new();
    loop {
        let wait = (!s.persist).then_some(local.timeout);
        if !super::wait_for_request(&listener, wait) {
            return Ok(rows);
        }
        match serve_client(o, s, &listener, wait, out) {
            Ok(mut r) => rows.append(&mut r),
            Err(e) if s.persist => {
                eprintln!("softrdma perf: {e}");
                eprintln!("softrdma perf: waiting for the next client");
            }
            Err(e) => return Err(e),
        }
        if !s.persist {
            return Ok(rows);
        }
    }
}

fn serve_client(
    o: &PerfOptions,
    s: &ServerOptions,
    listener: &Listener,
    wait: Option<Duration>,
    out: &mut dyn Write,
) -> Result<Vec<Row>, PerfError> {
    let local = &o.params;
    let Some(req) = listener.get_request(wait) else {
        return Err(PerfError::Timeout(format!(
            "no client connected within {:.0} s",
            wait.map_or(0.0, |d| d.as_secs_f64())
        )));
    };
    let peer = req.peer_addr();
    let hello = match Hello::decode(req.private_data()) {
        Ok(h) => h,
        Err(e) => {
            let reason = if DataConn::decode(req.private_data()).is_ok() {
                "no run in progress for this data connection".to_string()
            } else {
                e.to_string()
            };
            let _ = req.reject(&refusal(&reason));
            return Err(PerfError::Refused(format!(
                "refused the connection from {peer}: {reason}"
            )));
        }
    };
    if let Some(why) = conflicts(&s.require, &hello) {
        let _ = req.reject(&refusal(&why));
        return Err(PerfError::Refused(format!(
            "refused the client at {peer}: {why}"
        )));
    }
    let p = Params {
        test: hello.test,
        mode: hello.mode,
        size: hello.sizes[0],
        iters: hello.iters,
        duration: hello.duration,
        depth: hello.depth,
        qps: hello.qps,
        inline: hello.inline,
        crc: hello.crc,
        tcp_spin: hello.tcp_spin,
        ..local.clone()
    };
    for &size in &hello.sizes {
        if let Err(e) = validate(&Params { size, ..p.clone() }) {
            let _ = req.reject(&refusal(&e.to_string()));
            return Err(PerfError::Refused(format!(
                "refused the client at {peer}: {e}"
            )));
        }
    }
    let need = server_bytes(&p, &hello.sizes, hello.baseline_tcp);
    if need > s.max_mem {
        let why = format!(
            "the test needs {} of memory on the server, more than its limit of {} (--max-mem)",
            super::output::human_bytes(need),
            super::output::human_bytes(s.max_mem)
        );
        let _ = req.reject(&refusal(&why));
        return Err(PerfError::Refused(format!(
            "refused the client at {peer}: {why}"
        )));
    }
    let dev = device(&p)?;
    let mut ctl = Ctl::new(&dev, p.timeout, "client")?;
    let tcp = if hello.baseline_tcp {
        Some(
            TcpListener::bind((listener.local_addr().ip(), 0))
                .map_err(io("TCP baseline listener"))?,
        )
    } else {
        None
    };
    let welcome = Welcome {
        session: session_id(),
        tcp_port: match &tcp {
            Some(l) => l.local_addr().map_err(io("TCP baseline listener"))?.port(),
            None => 0,
        },
    };
    req.accept(&ctl.qp, &welcome.encode(), 16, 16)
        .map_err(|e| PerfError::Peer(format!("accepting the client at {peer}: {e}")))?;
    let baseline = hello.baseline_tcp.then_some(if hello.tcp_spin {
        Baseline::TcpSpin
    } else {
        Baseline::Tcp
    });
    tracing::info!(
        client = %peer,
        test = hello.test.name(),
        mode = ?hello.mode,
        sizes = ?hello.sizes,
        iters = hello.iters,
        duration = ?hello.duration,
        depth = hello.depth,
        qps = hello.qps,
        inline = hello.inline,
        crc = hello.crc,
        tcp_baseline = hello.baseline_tcp,
        "accepted a client's test"
    );
    header(
        out,
        Style {
            baseline,
            ..o.style()
        },
        &p,
        &format!("server, client {peer}"),
    )
    .map_err(io("output"))?;
    out.flush().map_err(io("output"))?;
    let mut rows = Vec::new();
    for (round, &size) in hello.sizes.iter().enumerate() {
        let p = Params { size, ..p.clone() };
        let r = serve_round(
            &p,
            round as u32,
            &dev,
            &mut ctl,
            listener,
            tcp.as_ref(),
            welcome,
        );
        rows.push(round_done(&mut ctl, out, o, r)?);
    }
    match ctl.recv("the end of the client's run")? {
        Control::Bye => Ok(rows),
        m => Err(unexpected("'bye'", &m)),
    }
}

/// Memory the server allocates for a run of `sizes` (the largest round:
/// rounds run one after another, each freeing its buffers), with the TCP
/// baseline's buffers and the control connection.
fn server_bytes(p: &Params, sizes: &[usize], baseline_tcp: bool) -> u64 {
    let control = ((CONTROL_RECVS + 1) * MAX_CONTROL) as u64;
    sizes
        .iter()
        .map(|&size| {
            let q = Params { size, ..p.clone() };
            let tcp = if baseline_tcp {
                tcp::passive_bytes(&q)
            } else {
                0
            };
            passive_bytes(&q) + tcp
        })
        .max()
        .unwrap_or(0)
        + control
}

/// Accepts the data connections of a round, in order; refuses others.
fn accept_data(
    p: &Params,
    listener: &Listener,
    qps: &[QueuePair],
    session: u32,
    round: u32,
) -> Result<(), PerfError> {
    let start = Instant::now();
    let mut i = 0;
    while i < qps.len() {
        let left = p.timeout.saturating_sub(start.elapsed());
        let Some(req) = listener.get_request(Some(left)) else {
            return Err(PerfError::Timeout(format!(
                "the client's data connection {} of {} did not arrive",
                i + 1,
                qps.len()
            )));
        };
        let want = DataConn {
            session,
            round,
            index: i as u16,
        };
        if DataConn::decode(req.private_data()).is_ok_and(|d| d == want) {
            req.accept(&qps[i], &[], p.rd(), p.rd())
                .map_err(|e| PerfError::Peer(format!("data connection {i}: {e}")))?;
            i += 1;
        } else {
            let _ = req.reject(&refusal("the server is busy with another client"));
        }
    }
    Ok(())
}

/// Accepts the TCP baseline connection.
fn accept_tcp(l: &TcpListener, timeout: Duration) -> Result<TcpStream, PerfError> {
    l.set_nonblocking(true)
        .map_err(io("TCP baseline listener"))?;
    let start = Instant::now();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(io("TCP baseline"))?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if start.elapsed() > timeout {
                    return Err(PerfError::Timeout(
                        "the client's TCP baseline connection did not arrive".into(),
                    ));
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(e) => return Err(io("TCP baseline accept")(e)),
        }
    }
}

fn serve_round(
    p: &Params,
    round: u32,
    dev: &Device,
    ctl: &mut Ctl,
    listener: &Listener,
    tcp: Option<&TcpListener>,
    welcome: Welcome,
) -> Result<Row, PerfError> {
    let (size, bufs) = match ctl.recv("the next test")? {
        Control::Round { size, bufs } => (size, bufs),
        m => return Err(unexpected("'round'", &m)),
    };
    if size != p.size {
        return Err(PerfError::Peer(format!(
            "the client announced size {} but runs {size}",
            p.size
        )));
    }
    let need = if p.test == Test::Write && p.mode == Mode::Lat {
        p.size as u64
    } else {
        0
    };
    if bufs.len() != p.nqps() || bufs.iter().any(|b| b.len < need) {
        return Err(PerfError::Peer(
            "the client's buffers do not match the test".into(),
        ));
    }
    let mut s = Passive::new(p, dev)?;
    s.remote = bufs;
    accept_data(p, listener, &s.qps, welcome.session, round)?;
    s.prepare(p)?;
    ctl.send(&Control::Ready { bufs: s.targets() })?;
    tracing::info!(round, size = p.size, "data connections up; serving");
    let cpu0 = cpu_time();
    let data = s.qps.clone();
    let got = {
        let mut calls = 0u32;
        let mut checked = Instant::now();
        let mut ended: Option<Instant> = None;
        let mut heard = Instant::now();
        let timeout = p.timeout;
        let mut control = || -> Result<Option<u64>, PerfError> {
            calls = calls.wrapping_add(1);
            // Every 64th call, and at least every CONTROL_CHECK: a serving
            // loop whose polls wait (a Read or Write test has no
            // completions here) makes 64 calls slowly, and the client's
            // heartbeats must find a receive reposted.
            if !calls.is_multiple_of(64) && checked.elapsed() < CONTROL_CHECK {
                return Ok(None);
            }
            checked = Instant::now();
            if ended.is_none() && heard.elapsed() > timeout {
                return Err(PerfError::Timeout(format!(
                    "the client went silent: nothing from it for {} s during the run \
                     (stopped, or the network is partitioned)",
                    secs(timeout)
                )));
            }
            if data.iter().any(|q| q.state() != QpState::Rts) {
                return Err(PerfError::Peer(
                    "the client closed the connection during the run".into(),
                ));
            }
            if ended.is_some_and(|t| t.elapsed() > timeout) {
                return Err(PerfError::Timeout(
                    "the client's last messages did not arrive".into(),
                ));
            }
            match ctl.try_recv()? {
                Some(Control::Alive) => {
                    heard = Instant::now();
                    Ok(None)
                }
                Some(Control::End { recvs }) => {
                    ended = Some(Instant::now());
                    Ok(Some(recvs))
                }
                Some(m) => Err(unexpected("'end'", &m)),
                None if ctl.qp.state() != QpState::Rts => Err(ctl.gone()),
                None => Ok(None),
            }
        };
        serve(p, &s, &mut control)?
    };
    ctl.send(&Control::Done { recvs: got })?;
    tracing::info!(round, receives = got, "run ended");
    let cpu = cpu_time() - cpu0;
    drop(s);
    if let Some(l) = tcp {
        let stream = accept_tcp(l, p.timeout)?;
        tcp::passive(p, stream)?;
    }
    match ctl.recv("the results")? {
        Control::Result { rdma, tcp } if rdma.size == p.size => {
            let mine = Summary {
                cpu_secs: cpu,
                ..rdma
            };
            let baseline = if p.tcp_spin {
                Baseline::TcpSpin
            } else {
                Baseline::Tcp
            };
            Ok(Row::new(p, &mine, tcp.as_ref(), Some(baseline)))
        }
        m => Err(unexpected("'result'", &m)),
    }
}

#[cfg(test)]
mod tests {
    use super::super::Test;
    use super::*;

    #[test]
    fn connect_reported_cannot_resolve_for_an_invalid_port() {
        for bad in [
            "127.0.0.1:99999",
            "127.0.0.1:abc",
            "host:0",
            "[::1]:x",
            "h:",
        ] {
            let e = checked_port(bad, 7).unwrap_err();
            assert!(e.contains("invalid port"), "{bad}: {e}");
        }
        assert_eq!(checked_port("h:80", 7).unwrap(), "h:80");
        assert_eq!(checked_port("::1", 7).unwrap(), "[::1]:7");
        assert_eq!(checked_port("[::1]:9", 7).unwrap(), "[::1]:9");
    }

    #[test]
    fn ports() {
        assert_eq!(with_port("host", 7), "host:7");
        assert_eq!(with_port("host:9", 7), "host:9");
        assert_eq!(with_port("10.0.0.1", 7), "10.0.0.1:7");
        assert_eq!(with_port("10.0.0.1:80", 7), "10.0.0.1:80");
        assert_eq!(with_port("::1", 7), "[::1]:7");
        assert_eq!(with_port("[::1]", 7), "[::1]:7");
        assert_eq!(with_port("[::1]:80", 7), "[::1]:80");
    }

    #[test]
    fn conflicting_flags_are_named() {
        let h = Hello {
            test: Test::Read,
            mode: Mode::Bw,
            crc: false,
            baseline_tcp: false,
            tcp_spin: false,
            iters: 1000,
            duration: None,
            depth: 16,
            qps: 1,
            inline: 64,
            sizes: vec![65536],
        };
        assert!(conflicts(&Constraints::default(), &h).is_none());
        let c = Constraints {
            test: Some(Test::Write),
            crc: true,
            ..Constraints::default()
        };
        let why = conflicts(&c, &h).unwrap();
        assert!(why.contains("'write'") && why.contains("CRC"), "{why}");
        let c = Constraints {
            sizes: Some(vec![65536]),
            qps: Some(1),
            ..Constraints::default()
        };
        assert!(conflicts(&c, &h).is_none());
        let c = Constraints {
            sizes: Some(super::super::sweep(Test::Read)),
            ..Constraints::default()
        };
        let why = conflicts(&c, &h).unwrap();
        assert!(
            why.contains("2,4,8") && why.contains("client's 64K"),
            "{why}"
        );
    }
}
