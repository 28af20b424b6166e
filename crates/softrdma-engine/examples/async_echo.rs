//! An async echo server and client over softrdma (tokio, Send/Receive).
//!
//! ```text
//! cargo run -p softrdma-engine --features tokio --example async_echo            # both, on loopback
//! cargo run -p softrdma-engine --features tokio --example async_echo -- server 0.0.0.0:7471
//! cargo run -p softrdma-engine --features tokio --example async_echo -- client 127.0.0.1:7471 1000
//! ```
//!
//! Each side posts a ring of receives before it connects (a Send that finds
//! no posted receive is fatal on iWARP), then connects through the
//! connection manager's async calls (`connect_async`, `next_request`,
//! `accept_async`): the CM reactor thread runs every handshake, no task
//! blocks and no thread is started per connection. The server echoes each message
//! straight from the buffer it was received into and re-posts that buffer;
//! a zero-length message ends the session. Every operation is an `.await`
//! on the async adapter; the buffers move into the operations and come back
//! with their completions.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::collections::VecDeque;
use std::error::Error;
use std::net::{Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_engine::async_cq::{AsyncCq, AsyncQp, Op, OpError};
use softrdma_engine::cm::{ConnRequest, ConnectConfig, ListenConfig, Listener, connect_async};
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::{Access, Device, MemoryRegion, ProtectionDomain, QpInitAttr, WcStatus};

type BoxError = Box<dyn Error + Send + Sync>;

/// Largest message.
const MSG_MAX: usize = 4096;
/// Receives each side keeps posted.
const RECV_DEPTH: usize = 8;
/// MPA negotiation limit.
const MPA_TIMEOUT: Duration = Duration::from_secs(10);
/// Clients run at once in the loopback demo.
const DEMO_CLIENTS: usize = 3;
/// Messages each demo client sends.
const DEMO_MESSAGES: usize = 200;

/// One side's verbs objects.
struct Endpoint {
    pd: ProtectionDomain,
    qp: AsyncQp,
    /// Posted receives, in the order they complete.
    recvs: VecDeque<Op<MemoryRegion>>,
}

impl Endpoint {
    /// A QP with its own async CQ and `RECV_DEPTH` receives posted.
    fn new(dev: &Device) -> Result<Endpoint, BoxError> {
        let pd = dev.alloc_pd();
        let cq = AsyncCq::new(dev, 4 * RECV_DEPTH)?;
        let qp = AsyncQp::new(&pd, &QpInitAttr::new(cq.cq(), cq.cq()), &cq, &cq)?;
        let mut ep = Endpoint {
            pd,
            qp,
            recvs: VecDeque::new(),
        };
        for _ in 0..RECV_DEPTH {
            let buf = ep.buffer()?;
            ep.post_recv(buf);
        }
        Ok(ep)
    }

    fn buffer(&self) -> Result<MemoryRegion, BoxError> {
        Ok(self.pd.register(MSG_MAX, Access::LOCAL_WRITE)?)
    }

    fn post_recv(&mut self, buf: MemoryRegion) {
        self.recvs.push_back(self.qp.recv(buf, 0, MSG_MAX as u32));
    }

    /// The MPA configuration matching the QP's IRD/ORD.
    fn mpa_config(&self) -> MpaConfig {
        let attr = self.qp.qp().query();
        MpaConfig {
            ird: attr.ird,
            ord: attr.ord,
            ..MpaConfig::default()
        }
    }

    /// The next received message: its buffer and length; `None` when the
    /// connection went away (the receive was flushed).
    async fn next_message(&mut self) -> Result<Option<(MemoryRegion, usize)>, BoxError> {
        let Some(op) = self.recvs.pop_front() else {
            return Err("no receive posted".into());
        };
        match op.await {
            Ok(done) => Ok(Some((done.buf, done.wc.byte_len as usize))),
            Err(OpError::Completion { wc, .. }) if wc.status == WcStatus::WrFlush => Ok(None),
            Err(e) => Err(e.to_string().into()),
        }
    }
}

/// Serves one connection: echoes until the client's empty message.
async fn serve(dev: Device, request: ConnRequest) -> Result<(usize, usize), BoxError> {
    let peer = request.peer_addr();
    let mut ep = Endpoint::new(&dev)?;
    let cfg = ep.mpa_config();
    let conn = request
        .accept_async(ep.qp.qp(), b"softrdma async echo", cfg.ird, cfg.ord)
        .await?;
    let negotiated = conn.negotiated().ok_or("no negotiation")?;
    println!(
        "server: {peer} connected (MPA rev {}, CRC {}), QP {}",
        negotiated.revision,
        if negotiated.crc { "on" } else { "off" },
        ep.qp.qp().qp_num()
    );
    let (mut messages, mut bytes) = (0, 0);
    while let Some((buf, len)) = ep.next_message().await? {
        if len == 0 {
            break;
        }
        // Echo from the receive buffer itself, then post it again.
        let buf = ep.qp.send(buf, 0, len as u32).await?.buf;
        ep.post_recv(buf);
        messages += 1;
        bytes += len;
    }
    println!("server: {peer} done, echoed {messages} messages, {bytes} bytes");
    Ok((messages, bytes))
}

/// Connects to `addr`, sends `count` messages and checks every echo.
async fn client(dev: Device, addr: SocketAddr, id: usize, count: usize) -> Result<(), BoxError> {
    let mut ep = Endpoint::new(&dev)?;
    let config = ConnectConfig {
        mpa: ep.mpa_config(),
        private_data: Vec::new(),
        timeout: MPA_TIMEOUT,
    };
    let conn = connect_async(ep.qp.qp(), addr, config).await?;
    let negotiated = conn.negotiated().ok_or("no negotiation")?;
    let greeting = String::from_utf8_lossy(&negotiated.peer_private_data).into_owned();
    println!("client {id}: connected to {addr} (server says {greeting:?})");

    let mut out = ep.buffer()?;
    let start = Instant::now();
    let mut bytes = 0;
    for i in 0..count {
        let msg = format!("client {id} message {i}: {}", "echo ".repeat(i % 64));
        out.write(0, msg.as_bytes())?;
        // The echo lands in the oldest posted receive; send and wait for
        // both at once.
        let recv = ep.recvs.pop_front().ok_or("no receive posted")?;
        let (sent, echoed) = tokio::join!(ep.qp.send(out, 0, msg.len() as u32), recv);
        out = sent?.buf;
        let echoed = echoed?;
        let len = echoed.wc.byte_len as usize;
        let mut got = vec![0; len];
        echoed.buf.read(0, &mut got)?;
        if got != msg.as_bytes() {
            return Err(format!("client {id}: echo {i} differs").into());
        }
        ep.post_recv(echoed.buf);
        bytes += len;
    }
    let elapsed = start.elapsed();
    // An empty message says goodbye.
    ep.qp.send(out, 0, 0).await?;
    println!(
        "client {id}: {count} messages, {bytes} bytes echoed and checked in {:.1} ms ({:.1} us per round trip)",
        elapsed.as_secs_f64() * 1e3,
        elapsed.as_secs_f64() * 1e6 / count.max(1) as f64
    );
    Ok(())
}

/// Accepts connections and serves each in its own task; stops after
/// `limit` connections if given. Finished tasks are reaped at every accept,
/// so a long-running server keeps only its live connections.
async fn server(dev: Device, listener: Listener, limit: Option<usize>) -> Result<(), BoxError> {
    let mut tasks = tokio::task::JoinSet::new();
    let mut accepted = 0;
    while limit.is_none_or(|l| accepted < l) {
        let request = listener.next_request().await?;
        accepted += 1;
        while let Some(done) = tasks.try_join_next() {
            done?;
        }
        let dev = dev.clone();
        tasks.spawn(async move {
            if let Err(e) = serve(dev, request).await {
                eprintln!("server: connection failed: {e}");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dev = Device::open_default()?;
    match args.first().map(String::as_str) {
        Some("server") => {
            let addr = args.get(1).map_or("0.0.0.0:7471", String::as_str);
            let listener = Listener::bind(addr, 128, ListenConfig::default())?;
            println!("server: listening on {}", listener.local_addr());
            server(dev, listener, None).await
        }
        Some("client") => {
            let addr: SocketAddr = args.get(1).ok_or("client needs an address")?.parse()?;
            let count = args.get(2).map_or(Ok(1000), |c| c.parse())?;
            client(dev, addr, 0, count).await
        }
        None => {
            let listener = Listener::bind((Ipv4Addr::LOCALHOST, 0), 128, ListenConfig::default())?;
            let addr = listener.local_addr();
            println!(
                "async echo on loopback: server on {addr}, {DEMO_CLIENTS} clients, {DEMO_MESSAGES} messages each"
            );
            let srv = tokio::spawn(server(dev.clone(), listener, Some(DEMO_CLIENTS)));
            let clients: Vec<_> = (0..DEMO_CLIENTS)
                .map(|id| tokio::spawn(client(dev.clone(), addr, id, DEMO_MESSAGES)))
                .collect();
            for c in clients {
                c.await??;
            }
            srv.await??;
            println!("done: every echo matched");
            Ok(())
        }
        Some(other) => Err(format!(
            "unknown mode {other:?}; usage: async_echo [server [ADDR] | client ADDR [COUNT]]"
        )
        .into()),
    }
}
