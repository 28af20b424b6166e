//! The connection manager across two processes: a server and a client that
//! exchange buffer descriptors in the MPA private data, then do RDMA Write,
//! RDMA Read and Send/Receive, every byte verified.
//!
//! ```text
//! cargo run -p softrdma-engine --example cm_pingpong                        # both, as two processes
//! cargo run -p softrdma-engine --example cm_pingpong -- server 0.0.0.0:7480
//! cargo run -p softrdma-engine --example cm_pingpong -- client 127.0.0.1:7480 [ROUNDS]
//! ```
//!
//! Each round: the client writes a pattern into the server's buffer with an
//! RDMA Write and sends the round number; the server checks its buffer, reads
//! the client's buffer with an RDMA Read, checks it, and answers with a Send.
//! The client then closes gracefully and both sides see the disconnect.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

use std::error::Error;
use std::time::{Duration, Instant};

use softrdma_engine::cm::{self, CmEvent, ConnectConfig, ListenConfig, Listener};
use softrdma_engine::{
    Access, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpInitAttr, QueuePair, RecvWr,
    RemoteBuf, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

type BoxError = Box<dyn Error + Send + Sync>;

/// Size of each side's RDMA buffer.
const BUF: usize = 64 * 1024;
/// Limit for any single step.
const STEP: Duration = Duration::from_secs(10);

/// One side: its verbs objects and buffers.
struct Side {
    _pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    /// Target of the peer's Writes and source of its Reads.
    rdma: MemoryRegion,
    /// Source of this side's Writes (apart from `rdma`, which the peer
    /// reads while a Write may still be gathering from here).
    src: MemoryRegion,
    /// Receives land here (8 bytes each).
    recv: MemoryRegion,
    /// Sends come from here.
    send: MemoryRegion,
}

impl Side {
    fn new(dev: &Device) -> Result<Side, BoxError> {
        let pd = ProtectionDomain::new(dev);
        let cq = CompletionQueue::new(dev, 64, None)?;
        let qp = QueuePair::new(&pd, &QpInitAttr::new(&cq, &cq))?;
        let rdma = pd.register(
            BUF,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )?;
        let src = pd.register(BUF, Access::LOCAL_WRITE)?;
        let recv = pd.register(8, Access::LOCAL_WRITE)?;
        let send = pd.register(8, Access::LOCAL_WRITE)?;
        // A receive is posted before connecting: on iWARP a Send that finds
        // none is fatal.
        qp.post_recv(&RecvWr::new(0, &[recv.sge(0, 8)?]))?;
        Ok(Side {
            _pd: pd,
            cq,
            qp,
            rdma,
            src,
            recv,
            send,
        })
    }

    /// Waits for the next completion, which must be a success.
    fn next(&self) -> Result<WorkCompletion, BoxError> {
        let start = Instant::now();
        let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 1];
        loop {
            if self.cq.poll(&mut wc) == 1 {
                if wc[0].status != WcStatus::Success {
                    return Err(format!("completion failed: {:?}", wc[0]).into());
                }
                return Ok(wc[0]);
            }
            if start.elapsed() > STEP {
                return Err("no completion within 10 s".into());
            }
            std::thread::yield_now();
        }
    }

    /// Sends `v` and re-posts the receive first, so the peer's answer has
    /// somewhere to land.
    fn send_u64(&self, v: u64) -> Result<(), BoxError> {
        self.send.write(0, &v.to_be_bytes())?;
        self.qp.post_send(
            &SendWr::new(1, SendOp::Send)
                .sg_list(&[self.send.sge(0, 8)?])
                .signaled(),
        )?;
        Ok(())
    }

    fn repost(&self) -> Result<(), BoxError> {
        self.qp
            .post_recv(&RecvWr::new(0, &[self.recv.sge(0, 8)?]))?;
        Ok(())
    }

    fn received_u64(&self) -> Result<u64, BoxError> {
        let mut b = [0u8; 8];
        self.recv.read(0, &mut b)?;
        Ok(u64::from_be_bytes(b))
    }
}

/// The pattern of round `r` (different for each side and round).
fn pattern(round: u64, side: u8) -> Vec<u8> {
    (0..BUF)
        .map(|i| {
            (i as u64)
                .wrapping_mul(31)
                .wrapping_add(round * 7 + u64::from(side)) as u8
        })
        .collect()
}

fn server(dev: &Device, addr: &str) -> Result<(), BoxError> {
    let listener = Listener::bind(addr, 4, ListenConfig::default())?;
    println!("server: listening on {}", listener.local_addr());
    let req = listener
        .get_request(Some(Duration::from_secs(60)))
        .ok_or("no client within 60 s")?;
    let client_buf = RemoteBuf::from_bytes(req.private_data())?;
    println!(
        "server: request from {} advertising {} bytes at {:#x} (rkey {:#x})",
        req.peer_addr(),
        client_buf.len,
        client_buf.addr,
        client_buf.rkey
    );
    let me = Side::new(dev)?;
    let conn = req.accept(&me.qp, &RemoteBuf::of_region(&me.rdma).to_bytes(), 4, 4)?;
    let mut rounds = 0u64;
    loop {
        // A receive completes: the round number, or 0 to end.
        me.next()?;
        let round = me.received_u64()?;
        me.repost()?;
        if round == 0 {
            break;
        }
        if me.rdma.to_vec() != pattern(round, 1) {
            return Err(format!("round {round}: the client's RDMA Write did not land").into());
        }
        // Read the client's buffer over ours and check it.
        me.qp.post_send(
            &SendWr::new(
                2,
                SendOp::Read {
                    remote_addr: client_buf.addr,
                    rkey: client_buf.rkey,
                },
            )
            .sg_list(&[me.rdma.sge(0, BUF as u32)?])
            .signaled(),
        )?;
        let wc = me.next()?;
        assert_eq!(wc.opcode, WcOpcode::RdmaRead);
        if me.rdma.to_vec() != pattern(round, 2) {
            return Err(format!("round {round}: the RDMA Read returned other bytes").into());
        }
        me.send_u64(round)?;
        me.next()?;
        rounds += 1;
    }
    loop {
        match conn.wait_event(Some(STEP)) {
            Some(CmEvent::Established { .. }) => continue,
            Some(CmEvent::Disconnected { graceful, .. }) => {
                println!(
                    "server: {rounds} rounds verified; the client disconnected (graceful: {graceful})"
                );
                return Ok(());
            }
            other => return Err(format!("server: after {rounds} rounds: {other:?}").into()),
        }
    }
}

fn client(dev: &Device, addr: &str, rounds: u64) -> Result<(), BoxError> {
    let me = Side::new(dev)?;
    let conn = cm::connect(
        &me.qp,
        addr,
        &ConnectConfig {
            private_data: RemoteBuf::of_region(&me.rdma).to_bytes().to_vec(),
            timeout: STEP,
            ..ConnectConfig::default()
        },
    )?;
    let server_buf = RemoteBuf::from_bytes(&conn.peer_private_data().unwrap_or_default())?;
    println!(
        "client: connected to {addr}; server buffer {} bytes at {:#x}",
        server_buf.len, server_buf.addr
    );
    let start = Instant::now();
    for round in 1..=rounds {
        me.src.write(0, &pattern(round, 1))?;
        me.qp.post_send(
            &SendWr::new(
                3,
                SendOp::Write {
                    remote_addr: server_buf.addr,
                    rkey: server_buf.rkey,
                },
            )
            .sg_list(&[me.src.sge(0, BUF as u32)?]),
        )?;
        // The server reads this once our Write has landed over there.
        me.rdma.write(0, &pattern(round, 2))?;
        // Sends are ordered after the Write: the server sees the pattern.
        me.send_u64(round)?;
        me.next()?; // our Send
        me.next()?; // the server's answer
        let got = me.received_u64()?;
        me.repost()?;
        if got != round {
            return Err(format!("round {round}: the server answered {got}").into());
        }
    }
    me.send_u64(0)?;
    me.next()?;
    conn.disconnect()?;
    let per = start.elapsed() / u32::try_from(rounds.max(1)).unwrap_or(u32::MAX);
    println!("client: {rounds} rounds verified ({per:?} per round of Write + Send + Read + Send)");
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dev = Device::open_default()?;
    match args.first().map(String::as_str) {
        Some("server") => server(&dev, args.get(1).map_or("0.0.0.0:7480", String::as_str)),
        Some("client") => {
            let addr = args.get(1).ok_or("client needs HOST:PORT")?;
            let rounds = args.get(2).map_or(Ok(100), |r| r.parse())?;
            client(&dev, addr, rounds)
        }
        None => {
            // Both sides, as two processes: this program again as the server.
            let exe = std::env::current_exe()?;
            let mut child = std::process::Command::new(exe)
                .args(["server", "127.0.0.1:0"])
                .stdout(std::process::Stdio::piped())
                .spawn()?;
            let mut out = std::io::BufReader::new(child.stdout.take().ok_or("no stdout")?);
            let mut line = String::new();
            std::io::BufRead::read_line(&mut out, &mut line)?;
            print!("{line}");
            let addr = line
                .trim()
                .strip_prefix("server: listening on ")
                .ok_or("the server did not start")?
                .to_string();
            // Relay the server's remaining lines.
            let relay = std::thread::spawn(move || {
                for l in std::io::BufRead::lines(out).map_while(Result::ok) {
                    println!("{l}");
                }
            });
            let r = client(&dev, &addr, 100);
            let status = child.wait()?;
            let _ = relay.join();
            r?;
            if !status.success() {
                return Err(format!("the server process failed: {status}").into());
            }
            println!("done: two processes, every byte verified");
            Ok(())
        }
        Some(other) => Err(format!(
            "unknown mode {other:?}; usage: cm_pingpong [server [ADDR] | client HOST:PORT [ROUNDS]]"
        )
        .into()),
    }
}
