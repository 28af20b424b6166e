//! `softrdma ping`: an rping-compatible client and server.
//!
//! rping (rdma-core's `librdmacm/examples/rping.c`) exchanges 16-byte
//! advertisements `{be64 addr, be32 rkey, be32 size}` by Send and moves a
//! buffer by RDMA Read and RDMA Write. One iteration:
//!
//! ```text
//!  client                                   server
//!  Send {start_buf addr, rkey, size}  ───►  RDMA Read start_buf → rdma_buf
//!                                     ◄───  Send (go ahead)
//!  Send {rdma_buf addr, rkey, size}   ───►  RDMA Write rdma_buf → client rdma_buf
//!                                     ◄───  Send (write done)
//!  compare rdma_buf with start_buf
//! ```
//!
//! The client fills `start_buf` with rping's text, `rdma-ping-N: ` followed
//! by a rotating run of the letters `A`..`z`, NUL-terminated, so a kernel
//! siw `rping` on the other side sees exactly what another `rping` would
//! send. The connection is MPA over TCP (default port 7174, as rping), set up
//! like rdma_cm does on iWARP: MPA revision 2 with IRD/ORD 1/1 and no private
//! data beyond the IRD/ORD word.

use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use crate::why;

use softrdma_engine::connect::{ConnectError, mpa_accept, mpa_connect};
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig, RtrOffer};
use softrdma_engine::qp::EstablishError;
use softrdma_engine::{
    Access, CompletionQueue, Device, LinkParams, MemoryRegion, ProtectionDomain, QpInitAttr,
    QpState, QueuePair, RecvWr, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

/// rping's default port.
pub const DEFAULT_PORT: u16 = 7174;
/// rping's default buffer size (`cb->size = 64` in rdma-core's rping.c):
/// a larger client buffer than the peer rping's fails its RDMA Read.
pub const DEFAULT_SIZE: usize = 64;
/// Smallest buffer accepted: room for `rdma-ping-%d: ` and a few letters
/// (rping's own minimum, 26 bytes, is above it).
pub const MIN_SIZE: usize = 24;
/// Largest buffer (rping's `RPING_BUFSIZE`, 64 KiB).
pub const MAX_SIZE: usize = 64 * 1024;
/// Size of an advertisement.
const INFO_LEN: usize = 16;

/// What `softrdma ping` was asked to do.
#[derive(Debug, Clone)]
pub struct PingOptions {
    /// Run the server side (else the client).
    pub server: bool,
    /// Address to connect to (client) or bind to (server).
    pub addr: Option<String>,
    /// TCP port.
    pub port: u16,
    /// Iterations (0: until the peer disconnects, server only).
    pub count: u64,
    /// Buffer size in bytes.
    pub size: usize,
    /// Print each iteration's data.
    pub verbose: bool,
    /// MPA revision to request (1 or 2).
    pub mpa_revision: u8,
    /// CRC policy.
    pub crc: CrcPolicy,
    /// Offer peer-to-peer mode with an RTR (client).
    pub p2p: bool,
    /// How long to wait for any one step.
    pub timeout: Duration,
    /// Server: serve clients one after another (rping's `-P`).
    pub persistent: bool,
    /// Client: the source address to bind to (rping's `-I`).
    pub source: Option<String>,
    /// Set (by a Ctrl-C handler) to stop: the run ends with
    /// [`PingError::Interrupted`] and the verified iterations.
    pub stop: Option<Arc<AtomicBool>>,
    /// Client: pause between connecting and the first Send. Kernel siw as
    /// the responder installs its receive callback only after sending the
    /// MPA Reply (`siw_accept`), so a first FPDU that arrives in between
    /// stays unread until more bytes come; on a slow siw host (an emulated
    /// VM) that window lasts milliseconds. A short pause avoids it.
    pub start_delay: Duration,
}

impl Default for PingOptions {
    fn default() -> Self {
        PingOptions {
            server: false,
            addr: None,
            port: DEFAULT_PORT,
            count: 0,
            size: DEFAULT_SIZE,
            verbose: false,
            mpa_revision: 2,
            crc: CrcPolicy::AcceptIfAsked,
            p2p: false,
            timeout: Duration::from_secs(30),
            start_delay: Duration::from_millis(200),
            persistent: false,
            source: None,
            stop: None,
        }
    }
}

/// What a ping run did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PingSummary {
    /// Iterations completed with verified data.
    pub iterations: u64,
    /// The peer's address.
    pub peer: SocketAddr,
    /// Whether the connection used MPA CRC.
    pub crc: bool,
    /// MPA revision of the connection.
    pub mpa_revision: u8,
}

/// Why a ping run failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PingError {
    /// Bad options.
    #[error("{0}")]
    Usage(String),
    /// Socket setup failed.
    #[error("{what}: {err}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        err: std::io::Error,
    },
    /// The MPA exchange failed.
    #[error("MPA negotiation: {0}")]
    Mpa(#[from] ConnectError),
    /// The engine refused a step.
    #[error("{0}")]
    Engine(String),
    /// A work request failed.
    #[error("{what} failed: {status} (vendor error {vendor:#x})")]
    Completion {
        /// Which step.
        what: &'static str,
        /// Its status.
        status: WcStatus,
        /// The Terminate code, if any.
        vendor: u32,
    },
    /// A step took longer than the timeout.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// The data read back differs from what was sent.
    #[error("data mismatch in iteration {iteration}: sent {sent:?}, got {got:?}")]
    Mismatch {
        /// Iteration.
        iteration: u64,
        /// What was sent (text).
        sent: String,
        /// What came back (text).
        got: String,
    },
    /// The peer left or ended the connection (with the reason).
    #[error("{0}")]
    Peer(String),
    /// Interrupted (Ctrl-C) after this many verified iterations.
    #[error("interrupted after {iterations} verified iterations")]
    Interrupted {
        /// Iterations completed with verified data.
        iterations: u64,
    },
    /// The peer's advertisement is unusable.
    #[error("peer advertised {len} bytes, more than the local {size}-byte buffer")]
    TooLong {
        /// Advertised length.
        len: u32,
        /// Local buffer size.
        size: usize,
    },
}

impl From<EstablishError> for PingError {
    fn from(e: EstablishError) -> Self {
        PingError::Engine(e.to_string())
    }
}

fn io_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> PingError {
    let what = what.into();
    move |err| PingError::Io { what, err }
}

fn engine_err(e: impl std::fmt::Display) -> PingError {
    PingError::Engine(e.to_string())
}

/// The resources of one side.
struct Side {
    qp: QueuePair,
    scq: CompletionQueue,
    rcq: CompletionQueue,
    recv_buf: MemoryRegion,
    send_buf: MemoryRegion,
    start_buf: MemoryRegion,
    rdma_buf: MemoryRegion,
    size: usize,
    timeout: Duration,
    stop: Option<Arc<AtomicBool>>,
}

impl Side {
    fn new(opts: &PingOptions) -> Result<(Side, ProtectionDomain), PingError> {
        let dev = Device::open_default().map_err(engine_err)?;
        let pd = dev.alloc_pd();
        let scq = dev.create_cq(16).map_err(engine_err)?;
        let rcq = dev.create_cq(16).map_err(engine_err)?;
        let mut attr = QpInitAttr::new(&scq, &rcq);
        attr.cap.max_send_wr = 8;
        attr.cap.max_recv_wr = 8;
        attr.ird = 1;
        attr.ord = 1;
        let qp = QueuePair::new(&pd, &attr).map_err(engine_err)?;
        let reg = |len, access| pd.register(len, access).map_err(engine_err);
        let side = Side {
            recv_buf: reg(INFO_LEN, Access::LOCAL_WRITE)?,
            send_buf: reg(INFO_LEN, Access::NONE)?,
            start_buf: reg(opts.size, Access::LOCAL_WRITE | Access::REMOTE_READ)?,
            rdma_buf: reg(opts.size, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?,
            qp,
            scq,
            rcq,
            size: opts.size,
            timeout: opts.timeout,
            stop: opts.stop.clone(),
        };
        Ok((side, pd))
    }

    /// Whether `e` is the peer having left (a flushed work request, or the
    /// connection out of RTS) rather than a failure of a step.
    fn peer_left(&self, e: &PingError) -> bool {
        match e {
            PingError::Completion { status, .. } => {
                *status == WcStatus::WrFlush || self.qp.state() != QpState::Rts
            }
            PingError::Timeout(_) => self.qp.state() != QpState::Rts,
            _ => false,
        }
    }

    /// `e` with the reason the connection ended, when the engine reported
    /// one (a Terminate received or sent, a close, a reset).
    fn explain(&self, e: PingError, done: u64) -> PingError {
        if let PingError::Interrupted { .. } = e {
            return PingError::Interrupted { iterations: done };
        }
        if !self.peer_left(&e) {
            return e;
        }
        match why::connection_end(self.qp.device(), self.qp.qp_num()) {
            Some(why) => PingError::Peer(format!("{e}: {why} (after {done} iterations)")),
            None => e,
        }
    }

    /// A refused post: the peer left when the QP is no longer in RTS.
    fn post_err(&self, e: impl std::fmt::Display) -> PingError {
        if self.qp.state() == QpState::Rts {
            return engine_err(e);
        }
        PingError::Peer(
            why::connection_end(self.qp.device(), self.qp.qp_num())
                .unwrap_or_else(|| "the peer closed the connection".into()),
        )
    }

    fn post_recv(&self) -> Result<(), PingError> {
        let sge = [self.recv_buf.sge(0, INFO_LEN as u32).map_err(engine_err)?];
        self.qp.post_recv(&RecvWr::new(0, &sge)).map_err(engine_err)
    }

    /// Waits for one completion on `cq`.
    fn wait(&self, cq: &CompletionQueue, what: &'static str) -> Result<WorkCompletion, PingError> {
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        loop {
            if let Some(wc) = cq.poll_one() {
                if wc.status != WcStatus::Success {
                    return Err(PingError::Completion {
                        what,
                        status: wc.status,
                        vendor: wc.vendor_err,
                    });
                }
                return Ok(wc);
            }
            if Instant::now() > deadline {
                return Err(PingError::Timeout(what));
            }
            if self
                .stop
                .as_ref()
                .is_some_and(|s| s.load(Ordering::Relaxed))
            {
                // The caller knows the count.
                return Err(PingError::Interrupted { iterations: 0 });
            }
            spins += 1;
            if spins > 1000 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// Receives the peer's next Send and re-posts the receive buffer.
    fn recv(&self, what: &'static str) -> Result<[u8; INFO_LEN], PingError> {
        let wc = self.wait(&self.rcq, what)?;
        debug_assert_eq!(wc.opcode, WcOpcode::Recv);
        let mut info = [0u8; INFO_LEN];
        self.recv_buf.read(0, &mut info).map_err(engine_err)?;
        self.post_recv()?;
        Ok(info)
    }

    /// Sends an advertisement of `mr` (or zeros).
    fn send_info(&self, mr: Option<&MemoryRegion>, what: &'static str) -> Result<(), PingError> {
        let mut info = [0u8; INFO_LEN];
        if let Some(mr) = mr {
            info[..8].copy_from_slice(&mr.addr().to_be_bytes());
            info[8..12].copy_from_slice(&mr.rkey().to_be_bytes());
            info[12..].copy_from_slice(&(self.size as u32).to_be_bytes());
        }
        self.send_buf.write(0, &info).map_err(engine_err)?;
        let sge = [self.send_buf.sge(0, INFO_LEN as u32).map_err(engine_err)?];
        self.qp
            .post_send(&SendWr::new(1, SendOp::Send).sg_list(&sge).signaled())
            .map_err(|e| self.post_err(e))?;
        self.wait(&self.scq, what).map(|_| ())
    }

    fn rdma(&self, op: SendOp<'_>, len: u32, what: &'static str) -> Result<(), PingError> {
        let sge = [self.rdma_buf.sge(0, len).map_err(engine_err)?];
        self.qp
            .post_send(&SendWr::new(2, op).sg_list(&sge).signaled())
            .map_err(|e| self.post_err(e))?;
        self.wait(&self.scq, what).map(|_| ())
    }
}

/// Parses an advertisement.
fn parse_info(info: &[u8; INFO_LEN]) -> (u64, u32, u32) {
    let mut a = [0u8; 8];
    a.copy_from_slice(&info[..8]);
    let mut k = [0u8; 4];
    k.copy_from_slice(&info[8..12]);
    let mut l = [0u8; 4];
    l.copy_from_slice(&info[12..]);
    (
        u64::from_be_bytes(a),
        u32::from_be_bytes(k),
        u32::from_be_bytes(l),
    )
}

/// rping's buffer contents for iteration `ping`: `rdma-ping-N: ` then
/// letters from `start` (65..=122, wrapping), last byte NUL.
pub fn rping_pattern(ping: u64, start: u8, size: usize) -> Vec<u8> {
    let mut buf = format!("rdma-ping-{ping}: ").into_bytes();
    buf.truncate(size);
    let mut c = start;
    while buf.len() < size {
        buf.push(c);
        c += 1;
        if c > 122 {
            c = 65;
        }
    }
    if let Some(last) = buf.last_mut() {
        *last = 0;
    }
    buf
}

/// The text of a NUL-terminated buffer.
fn text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// With `-v`, one line on what the MPA exchange settled.
fn report_connection(
    out: &mut dyn Write,
    opts: &PingOptions,
    peer: SocketAddr,
    n: &softrdma_engine::proto::mpa::Negotiated,
) {
    if opts.verbose {
        let _ = writeln!(
            out,
            "connected to {peer}: MPA rev {}, CRC {}, IRD/ORD {}/{} (peer {}/{}), RTR {}",
            n.revision,
            if n.crc { "on" } else { "off" },
            n.ird,
            n.ord,
            n.peer_ird.map_or("-".to_string(), |v| v.to_string()),
            n.peer_ord.map_or("-".to_string(), |v| v.to_string()),
            n.rtr.map_or("none".to_string(), |r| format!("{r:?}")),
        );
    }
}

fn mpa_config(opts: &PingOptions) -> MpaConfig {
    MpaConfig {
        revision: opts.mpa_revision,
        crc: opts.crc,
        ird: 1,
        ord: 1,
        peer_to_peer: opts.p2p.then_some(RtrOffer::WRITE_READ),
        ..MpaConfig::default()
    }
}

fn resolve(addr: &str, port: u16) -> Result<SocketAddr, PingError> {
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return Ok(SocketAddr::new(ip, port));
    }
    (addr, port)
        .to_socket_addrs()
        .map_err(io_err(format!("resolving {addr}")))?
        .next()
        .ok_or_else(|| PingError::Usage(format!("{addr}: no address")))
}

/// Runs `softrdma ping` with `opts`, reporting progress to `out`.
///
/// # Errors
///
/// [`PingError`]: bad options, a connection that cannot be set up (the
/// client; the server skips bad connections and waits for the next), a
/// failed step, data that does not match, or an interruption
/// ([`PingError::Interrupted`], with the verified iterations).
pub fn run_ping(opts: &PingOptions, out: &mut dyn Write) -> Result<PingSummary, PingError> {
    if opts.size < MIN_SIZE {
        return Err(PingError::Usage(format!(
            "size {} is below the minimum of {MIN_SIZE} bytes",
            opts.size
        )));
    }
    if opts.size > MAX_SIZE {
        return Err(PingError::Usage(format!(
            "size {} is above the maximum of {MAX_SIZE} bytes",
            opts.size
        )));
    }
    if !matches!(opts.mpa_revision, 1 | 2) {
        return Err(PingError::Usage("MPA revision must be 1 or 2".into()));
    }
    if opts.server {
        run_server(opts, out)
    } else {
        run_client(opts, out)
    }
}

fn stopped(opts: &PingOptions) -> bool {
    opts.stop
        .as_ref()
        .is_some_and(|s| s.load(Ordering::Relaxed))
}

/// Connects to `peer`, from `source` if given (rping's `-I`).
fn tcp_connect(
    peer: SocketAddr,
    source: Option<&str>,
    timeout: Duration,
) -> Result<TcpStream, PingError> {
    let Some(src) = source else {
        return TcpStream::connect_timeout(&peer, timeout)
            .map_err(io_err(format!("connecting to {peer}")));
    };
    let from = resolve(src, 0)?;
    let sock = socket2::Socket::new(
        socket2::Domain::for_address(peer),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .map_err(io_err("creating the socket"))?;
    sock.bind(&from.into())
        .map_err(io_err(format!("binding to the source address {from}")))?;
    sock.connect_timeout(&peer.into(), timeout)
        .map_err(io_err(format!("connecting to {peer} from {from}")))?;
    Ok(sock.into())
}

fn run_client(opts: &PingOptions, out: &mut dyn Write) -> Result<PingSummary, PingError> {
    let Some(addr) = opts.addr.as_deref() else {
        return Err(PingError::Usage("the client needs -a ADDRESS".into()));
    };
    let peer = resolve(addr, opts.port)?;
    let (side, _pd) = Side::new(opts)?;
    side.post_recv()?;
    let mut stream = tcp_connect(peer, opts.source.as_deref(), opts.timeout)?;
    tracing::debug!(%peer, "TCP connected; MPA negotiation");
    let n = mpa_connect(&mut stream, &mpa_config(opts), &[], opts.timeout)?;
    let (crc, rev) = (n.crc, n.revision);
    side.qp.establish(stream, &LinkParams::from(&n))?;
    tracing::debug!(?n, "connection established");
    report_connection(out, opts, peer, &n);
    std::thread::sleep(opts.start_delay);
    let count = if opts.count == 0 {
        u64::MAX
    } else {
        opts.count
    };
    let mut start = 65u8;
    let mut done = 0;
    for ping in 0..count {
        if stopped(opts) {
            let _ = side.qp.disconnect();
            return Err(PingError::Interrupted { iterations: done });
        }
        let data = rping_pattern(ping, start, opts.size);
        start += 1;
        if start > 122 {
            start = 65;
        }
        let step = || -> Result<Vec<u8>, PingError> {
            side.start_buf.write(0, &data).map_err(engine_err)?;
            side.rdma_buf.fill(0);
            side.send_info(Some(&side.start_buf), "the start-buffer advertisement")?;
            side.recv("the server's go-ahead after its RDMA Read")?;
            side.send_info(Some(&side.rdma_buf), "the sink-buffer advertisement")?;
            side.recv("the server's go-ahead after its RDMA Write")?;
            Ok(side.rdma_buf.to_vec())
        };
        let got = step().map_err(|e| side.explain(e, done))?;
        if got != data {
            return Err(PingError::Mismatch {
                iteration: ping,
                sent: text(&data),
                got: text(&got),
            });
        }
        if opts.verbose {
            let _ = writeln!(out, "ping data: {}", text(&got));
        }
        done += 1;
    }
    // Disconnect gracefully (FIN exchange); the server sees the disconnect
    // as the end of the run, as rping's does.
    side.qp.disconnect().map_err(engine_err)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !matches!(side.qp.state(), QpState::Idle | QpState::Error) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(PingSummary {
        iterations: done,
        peer,
        crc,
        mpa_revision: rev,
    })
}

/// A connection whose MPA negotiation finished (or failed).
type Negotiation = (
    TcpStream,
    SocketAddr,
    Result<softrdma_engine::proto::mpa::Negotiated, ConnectError>,
);

/// Accepts connections on a thread and negotiates MPA on one thread per
/// connection, so that a silent or bad connection (a port scan) does not
/// hold up the real client. Stops when `stop` is set.
fn acceptor(
    listener: TcpListener,
    opts: &PingOptions,
    stop: Arc<AtomicBool>,
) -> Result<mpsc::Receiver<Negotiation>, PingError> {
    listener
        .set_nonblocking(true)
        .map_err(io_err("listening socket"))?;
    let (tx, rx) = mpsc::channel();
    let (config, timeout) = (mpa_config(opts), opts.timeout);
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match listener.accept() {
                Ok((mut stream, peer)) => {
                    tracing::debug!(%peer, "TCP connection accepted; MPA negotiation");
                    let tx = tx.clone();
                    let config = config.clone();
                    std::thread::spawn(move || {
                        let r = stream
                            .set_nonblocking(false)
                            .map_err(ConnectError::from)
                            .and_then(|()| mpa_accept(&mut stream, &config, &[], timeout));
                        let _ = tx.send((stream, peer, r));
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(e) => {
                    eprintln!("softrdma ping: accepting a connection: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    });
    Ok(rx)
}

fn run_server(opts: &PingOptions, out: &mut dyn Write) -> Result<PingSummary, PingError> {
    let bind = match opts.addr.as_deref() {
        Some(a) => resolve(a, opts.port)?,
        None => SocketAddr::from(([0, 0, 0, 0], opts.port)),
    };
    let listener = TcpListener::bind(bind).map_err(io_err(format!("binding {bind}")))?;
    tracing::debug!(%bind, "listening");
    let stop_acceptor = Arc::new(AtomicBool::new(false));
    let conns = acceptor(listener, opts, stop_acceptor.clone())?;
    let _stop = StopOnDrop(stop_acceptor);
    let mut total = 0u64;
    let mut last = None;
    loop {
        let (stream, peer, n) = loop {
            if stopped(opts) {
                return Err(PingError::Interrupted { iterations: total });
            }
            match conns.recv_timeout(Duration::from_millis(100)) {
                Ok(c) => break c,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(PingError::Engine("the listening thread ended".into()));
                }
            }
        };
        let n = match n {
            Ok(n) => n,
            Err(e) => {
                eprintln!(
                    "softrdma ping: skipped the connection from {peer}: MPA negotiation failed: {e}"
                );
                continue;
            }
        };
        let (side, _pd) = Side::new(opts)?;
        side.post_recv()?;
        if let Err(e) = side.qp.establish(stream, &LinkParams::from(&n)) {
            eprintln!("softrdma ping: skipped the connection from {peer}: {e}");
            continue;
        }
        tracing::debug!(%peer, ?n, "connection established");
        report_connection(out, opts, peer, &n);
        let summary = |iterations| PingSummary {
            iterations,
            peer,
            crc: n.crc,
            mpa_revision: n.revision,
        };
        match serve_pings(&side, opts, out) {
            Ok(done) if opts.persistent => {
                total += done;
                let _ = writeln!(out, "client {peer}: {done} iterations verified");
                last = Some(summary(done));
            }
            Ok(done) => return Ok(summary(total + done)),
            Err((0, e)) => {
                eprintln!("softrdma ping: skipped the connection from {peer}: {e}");
            }
            Err((done, e)) if opts.persistent => {
                total += done;
                eprintln!("softrdma ping: client {peer} after {done} iterations: {e}");
            }
            Err((_, e)) => return Err(e),
        }
        if stopped(opts) {
            return match last {
                Some(_) => Err(PingError::Interrupted { iterations: total }),
                None => Err(PingError::Interrupted { iterations: 0 }),
            };
        }
    }
}

/// Stops the acceptor thread when the server returns.
struct StopOnDrop(Arc<AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

/// Serves one client's iterations until it leaves; returns how many were
/// verified, or the failure with the count before it.
fn serve_pings(
    side: &Side,
    opts: &PingOptions,
    out: &mut dyn Write,
) -> Result<u64, (u64, PingError)> {
    let mut done = 0u64;
    let fail = |done: u64, e: PingError| (done, side.explain(e, done));
    loop {
        if stopped(opts) {
            return Err((done, PingError::Interrupted { iterations: done }));
        }
        // The client's start-buffer advertisement; its leaving here is the
        // end of the run (like rping's server, the server leaves the
        // disconnect to the client; -C only says how many iterations to
        // expect).
        let info = match side.recv("the client's start-buffer advertisement") {
            Ok(i) => i,
            Err(e) if side.peer_left(&e) => {
                if done > 0 && done >= opts.count {
                    return Ok(done);
                }
                let why = why::connection_end(side.qp.device(), side.qp.qp_num())
                    .unwrap_or_else(|| "the client disconnected".into());
                return Err((
                    done,
                    PingError::Peer(format!(
                        "{why} after {done} of {} iterations",
                        opts.count.max(1)
                    )),
                ));
            }
            Err(e) => return Err(fail(done, e)),
        };
        let (addr, rkey, len) = parse_info(&info);
        if len as usize > side.size {
            return Err((
                done,
                PingError::TooLong {
                    len,
                    size: side.size,
                },
            ));
        }
        side.rdma(
            SendOp::Read {
                remote_addr: addr,
                rkey,
            },
            len,
            "the RDMA Read of the client's start buffer",
        )
        .map_err(|e| fail(done, e))?;
        let got = side.rdma_buf.to_vec();
        if opts.verbose {
            let _ = writeln!(out, "server ping data: {}", text(&got));
        }
        side.send_info(None, "the go-ahead Send")
            .map_err(|e| fail(done, e))?;
        let info = side
            .recv("the client's sink-buffer advertisement")
            .map_err(|e| fail(done, e))?;
        let (addr, rkey, _len) = parse_info(&info);
        let wlen = got
            .iter()
            .position(|&b| b == 0)
            .map_or(got.len(), |p| p + 1);
        side.rdma(
            SendOp::Write {
                remote_addr: addr,
                rkey,
            },
            wlen as u32,
            "the RDMA Write to the client's sink buffer",
        )
        .map_err(|e| fail(done, e))?;
        match side.send_info(None, "the write-done Send") {
            Ok(()) => {}
            // The client got it and left at once (its close may overtake
            // this Send's completion): the iteration is complete.
            Err(e) if side.peer_left(&e) && done + 1 >= opts.count.max(1) => {
                return Ok(done + 1);
            }
            Err(e) => return Err(fail(done, e)),
        }
        done += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_matches_rping() {
        let p = rping_pattern(0, 65, 64);
        assert_eq!(p.len(), 64);
        assert!(p.starts_with(b"rdma-ping-0: ABCDEFG"));
        assert_eq!(p[63], 0);
        // Wraps from 'z' to 'A'.
        let p = rping_pattern(12, 121, 30);
        assert_eq!(&p[..16], b"rdma-ping-12: yz");
        assert_eq!(p[16], b'A');
    }

    #[test]
    fn loopback_client_and_server() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let server = PingOptions {
            server: true,
            addr: Some("127.0.0.1".into()),
            port,
            count: 5,
            size: 100,
            ..PingOptions::default()
        };
        let t = std::thread::spawn(move || run_ping(&server, &mut Vec::new()));
        let client = PingOptions {
            addr: Some("127.0.0.1".into()),
            port,
            count: 5,
            size: 100,
            verbose: true,
            ..PingOptions::default()
        };
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(10);
        let summary = loop {
            match run_ping(&client, &mut out) {
                Err(PingError::Io { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                r => break r.unwrap(),
            }
        };
        assert_eq!(summary.iterations, 5);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 6);
        assert!(text.starts_with("connected to 127.0.0.1:"), "{text}");
        assert!(text.contains("ping data: rdma-ping-0: ABC"), "{text}");
        let s = t.join().unwrap().unwrap();
        assert_eq!(s.iterations, 5);
    }
}
