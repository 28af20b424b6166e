//! `softrdma demo`: a loopback tour of the stack for a newcomer.
//!
//! Opens the device, connects two queue pairs over loopback TCP with the
//! connection manager (MPA negotiation), then runs Send/Recv, RDMA Write,
//! RDMA Read, an atomic Fetch-and-Add, a verified CRC32C of 1 MiB moved by
//! RDMA Write and read back by RDMA Read, and a short bandwidth and latency
//! measurement against plain TCP sockets doing the same thing. Each step
//! prints one line of what it did and why it matters.

use std::io::Write;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

use softrdma_engine::cm::{self, ConnectConfig, ListenConfig};
use softrdma_engine::wire::crc::crc32c;
use softrdma_engine::{
    Access, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpInitAttr, QueuePair, RecvWr,
    SendOp, SendWr, WcStatus, WorkCompletion,
};

use crate::perf::{self, Mode, Test};

/// Why the demo stopped.
#[derive(Debug, thiserror::Error)]
#[error("{step}: {reason}")]
pub struct DemoError {
    /// The step that failed.
    pub step: &'static str,
    /// What went wrong.
    pub reason: String,
}

fn fail(step: &'static str) -> impl Fn(&dyn std::fmt::Display) -> DemoError {
    move |e| DemoError {
        step,
        reason: e.to_string(),
    }
}

macro_rules! tryd {
    ($step:expr, $e:expr) => {
        $e.map_err(|e| fail($step)(&e))?
    };
}

/// One end of the demo connection.
struct End {
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
}

/// Local write plus every remote access.
fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE
}

fn end(dev: &Device, step: &'static str) -> Result<End, DemoError> {
    let pd = ProtectionDomain::new(dev);
    let cq = tryd!(step, CompletionQueue::new(dev, 256, None));
    let mut attr = QpInitAttr::new(&cq, &cq);
    attr.cap.max_send_wr = 64;
    attr.cap.max_recv_wr = 64;
    let qp = tryd!(step, QueuePair::new(&pd, &attr));
    Ok(End { pd, cq, qp })
}

fn mr(e: &End, len: usize, step: &'static str) -> Result<MemoryRegion, DemoError> {
    Ok(tryd!(step, e.pd.register(len, all_access())))
}

/// Puts `data` at the start of `src` and RDMA-Writes it from there to the
/// start of `target` (signaled, `wr_id`); returns once it completed.
fn write_remote(
    e: &End,
    src: &MemoryRegion,
    data: &[u8],
    target: &MemoryRegion,
    wr_id: u64,
    step: &'static str,
) -> Result<WorkCompletion, DemoError> {
    tryd!(step, src.write(0, data));
    let sge = [tryd!(step, src.sge(0, data.len() as u32))];
    tryd!(
        step,
        e.qp.post_send(
            &SendWr::new(
                wr_id,
                SendOp::Write {
                    remote_addr: target.addr(),
                    rkey: target.rkey()
                }
            )
            .sg_list(&sge)
            .signaled()
        )
    );
    wait(&e.cq, step)
}

/// RDMA-Reads the first `len` bytes of `target` into the start of `sink`
/// (signaled, `wr_id`); returns once it completed.
fn read_remote(
    e: &End,
    target: &MemoryRegion,
    sink: &MemoryRegion,
    len: u32,
    wr_id: u64,
    step: &'static str,
) -> Result<WorkCompletion, DemoError> {
    let sge = [tryd!(step, sink.sge(0, len))];
    tryd!(
        step,
        e.qp.post_send(
            &SendWr::new(
                wr_id,
                SendOp::Read {
                    remote_addr: target.addr(),
                    rkey: target.rkey()
                }
            )
            .sg_list(&sge)
            .signaled()
        )
    );
    wait(&e.cq, step)
}

/// Busy-polls `cq` for one completion (5 s at most); a non-success status is
/// an error.
fn wait(cq: &CompletionQueue, step: &'static str) -> Result<WorkCompletion, DemoError> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        if let Some(wc) = cq.poll_one() {
            if wc.status != WcStatus::Success {
                return Err(DemoError {
                    step,
                    reason: format!("completion status {} ({:?})", wc.status, wc.opcode),
                });
            }
            return Ok(wc);
        }
        if Instant::now() > deadline {
            return Err(DemoError {
                step,
                reason: "no completion within 5 s".into(),
            });
        }
        std::hint::spin_loop();
    }
}

fn check(ok: bool, step: &'static str, what: impl Into<String>) -> Result<(), DemoError> {
    if ok {
        Ok(())
    } else {
        Err(DemoError {
            step,
            reason: what.into(),
        })
    }
}

/// A reproducible pseudo-random pattern (xorshift64).
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Runs the demo, printing to `out`.
///
/// # Errors
///
/// [`DemoError`] naming the step that failed.
pub fn run_demo(out: &mut dyn Write) -> Result<(), DemoError> {
    let t0 = Instant::now();
    let mut say = |s: String| {
        let _ = writeln!(out, "{s}");
        let _ = out.flush();
    };
    say("softrdma demo: RDMA (iWARP: MPA/DDP/RDMAP) in software over loopback TCP".into());

    // 1. Device.
    const S1: &str = "open the device";
    let dev = tryd!(S1, Device::open_default());
    say(format!(
        "[1/9] device      opened '{}': {} datamover thread(s), {} completion handler(s) — the software 'NIC'",
        dev.name(),
        dev.attr().datamovers,
        dev.attr().completion_handlers
    ));

    // 2. Connection.
    const S2: &str = "connection setup";
    let client = end(&dev, S2)?;
    let server = end(&dev, S2)?;
    let listener = tryd!(
        S2,
        cm::Listener::bind((Ipv4Addr::LOCALHOST, 0), 4, ListenConfig::default())
    );
    let addr = listener.local_addr();
    let cqp = client.qp.clone();
    let connecting = std::thread::spawn(move || {
        let cfg = ConnectConfig {
            private_data: b"softrdma demo".to_vec(),
            ..ConnectConfig::default()
        };
        cm::connect(&cqp, addr, &cfg)
    });
    let req = listener
        .get_request(Some(Duration::from_secs(5)))
        .ok_or_else(|| fail(S2)(&"no connection request within 5 s"))?;
    let hello = String::from_utf8_lossy(req.private_data()).into_owned();
    let sconn = tryd!(S2, req.accept(&server.qp, b"welcome", 16, 16));
    let cconn = tryd!(
        S2,
        connecting
            .join()
            .map_err(|_| "the connecting thread panicked".to_string())
    );
    let cconn = tryd!(S2, cconn);
    let n = cconn
        .negotiated()
        .ok_or_else(|| fail(S2)(&"no negotiated parameters"))?;
    say(format!(
        "[2/9] connect     TCP {addr} + MPA rev {} handshake (CRC {}, IRD/ORD {}/{}), private data '{hello}' — both QPs now in RTS",
        n.revision,
        if n.crc { "on" } else { "off" },
        n.ird,
        n.ord
    ));

    // 3. Send / Recv.
    const S3: &str = "Send/Recv";
    let msg = b"hello over softrdma";
    let rbuf = mr(&server, 64, S3)?;
    let rsge = [tryd!(S3, rbuf.sge(0, 64))];
    tryd!(S3, server.qp.post_recv(&RecvWr::new(7, &rsge)));
    tryd!(
        S3,
        client
            .qp
            .post_send(&SendWr::new(1, SendOp::Send).inline(msg).signaled())
    );
    wait(&client.cq, S3)?;
    let wc = wait(&server.cq, S3)?;
    let mut got = vec![0u8; wc.byte_len as usize];
    tryd!(S3, rbuf.read(0, &mut got));
    check(got == msg, S3, "the received bytes differ")?;
    say(format!(
        "[3/9] send/recv   client sent {} bytes into a receive the server posted: \"{}\" — two-sided messaging",
        wc.byte_len,
        String::from_utf8_lossy(&got)
    ));

    // 4. RDMA Write.
    const S4: &str = "RDMA Write";
    let target = mr(&server, 1 << 20, S4)?;
    let src = mr(&client, 1 << 20, S4)?;
    let data = pattern(4096, 4);
    write_remote(&client, &src, &data, &target, 2, S4)?;
    // A Send after the Write: when it arrives, the Write has been placed.
    tryd!(S4, server.qp.post_recv(&RecvWr::new(8, &rsge)));
    tryd!(
        S4,
        client
            .qp
            .post_send(&SendWr::new(3, SendOp::Send).inline(b"done").signaled())
    );
    wait(&client.cq, S4)?;
    wait(&server.cq, S4)?;
    let mut placed = vec![0u8; 4096];
    tryd!(S4, target.read(0, &mut placed));
    check(
        placed == data,
        S4,
        "server memory differs from what was written",
    )?;
    say(format!(
        "[4/9] rdma write  4096 bytes placed straight into server memory (rkey {:#010x}), no receive consumed — one-sided",
        target.rkey()
    ));

    // 5. RDMA Read.
    const S5: &str = "RDMA Read";
    let sink = mr(&client, 1 << 20, S5)?;
    read_remote(&client, &target, &sink, 4096, 4, S5)?;
    let mut back = vec![0u8; 4096];
    tryd!(S5, sink.read(0, &mut back));
    check(back == data, S5, "read-back data differs")?;
    say("[5/9] rdma read   4096 bytes fetched from server memory without the server's CPU taking part — identical".into());

    // 6. Atomic.
    const S6: &str = "atomic Fetch-and-Add";
    let counter = mr(&server, 8, S6)?;
    tryd!(S6, counter.write(0, &40u64.to_ne_bytes()));
    let old = mr(&client, 8, S6)?;
    let sge = [tryd!(S6, old.sge(0, 8))];
    tryd!(
        S6,
        client.qp.post_send(
            &SendWr::new(
                5,
                SendOp::FetchAdd {
                    remote_addr: counter.addr(),
                    rkey: counter.rkey(),
                    add: 2
                }
            )
            .sg_list(&sge)
            .signaled()
        )
    );
    wait(&client.cq, S6)?;
    let mut b = [0u8; 8];
    tryd!(S6, old.read(0, &mut b));
    let before = u64::from_ne_bytes(b);
    tryd!(S6, counter.read(0, &mut b));
    let after = u64::from_ne_bytes(b);
    check(
        before == 40 && after == 42,
        S6,
        format!("expected 40 -> 42, got {before} -> {after}"),
    )?;
    say(format!(
        "[6/9] atomic      Fetch-and-Add(+2) on a remote 64-bit counter: returned {before}, counter now {after} (RFC 7306)"
    ));

    // 7. Checksum of 1 MiB.
    const S7: &str = "1 MiB checksum";
    let big = pattern(1 << 20, 7);
    let sum = crc32c(&big);
    write_remote(&client, &src, &big, &target, 6, S7)?;
    sink.fill(0);
    // Reads are ordered after the earlier Write on the same QP.
    read_remote(&client, &target, &sink, 1 << 20, 7, S7)?;
    let remote_sum = crc32c(&target.to_vec());
    let back_sum = crc32c(&sink.to_vec());
    check(
        remote_sum == sum && back_sum == sum,
        S7,
        format!("CRC32C sent {sum:#010x}, server {remote_sum:#010x}, read back {back_sum:#010x}"),
    )?;
    say(format!(
        "[7/9] checksum    1 MiB written by RDMA Write and read back by RDMA Read: CRC32C {sum:#010x} on both ends — verified"
    ));
    drop(sconn);
    drop(cconn);

    // 8/9. Measurements, with the perf machinery.
    let bw = perf::Params {
        test: Test::Write,
        mode: Mode::Bw,
        size: 1 << 20,
        iters: 200,
        ..perf::Params::default()
    };
    let r = tryd!("bandwidth", perf::measure_rdma(&bw));
    let t = tryd!("bandwidth", perf::measure_tcp(&bw));
    say(format!(
        "[8/9] bandwidth   RDMA Write 1 MiB x 200: {:.0} MB/s ({:.1} Gbit/s); plain TCP same data: {:.0} MB/s — softrdma/TCP {:.2} (above 1: softrdma faster)",
        r.mb_s(),
        r.gbit_s(),
        t.mb_s(),
        r.mb_s() / t.mb_s()
    ));
    let lat = perf::Params {
        test: Test::Send,
        mode: Mode::Lat,
        size: 8,
        iters: 2000,
        depth: 1,
        ..perf::Params::default()
    };
    let r = tryd!("latency", perf::measure_rdma(&lat));
    let t = tryd!("latency", perf::measure_tcp(&lat));
    let spin = perf::Params {
        tcp_spin: true,
        ..lat
    };
    let ts = tryd!("latency", perf::measure_tcp(&spin));
    say(format!(
        "[9/9] latency     8-byte Send/Recv ping-pong x 2000, one way, mean (p50, p99) in µs:\n\
         \x20                 softrdma, CQ spin 50 µs, sleep{:>8.2} ({:.2}, {:.2})\n\
         \x20                 TCP, busy-polled sockets      {:>8.2} ({:.2}, {:.2})  softrdma/TCP {:.2} (below 1: softrdma faster)\n\
         \x20                 TCP, blocking sockets         {:>8.2} ({:.2}, {:.2})  softrdma/TCP {:.2}",
        r.lat_mean(),
        r.lat_median(),
        r.lat_p99(),
        ts.lat_mean(),
        ts.lat_median(),
        ts.lat_p99(),
        r.lat_mean() / ts.lat_mean().max(1e-9),
        t.lat_mean(),
        t.lat_median(),
        t.lat_p99(),
        r.lat_mean() / t.lat_mean().max(1e-9),
    ));
    if let Some(w) = crate::load::Load::now().warning(2) {
        say(format!("warning: {w}"));
    }
    say(format!(
        "demo complete in {:.1} s: every step succeeded. Next: `softrdma info`, `softrdma perf write -a --baseline tcp`.",
        t0.elapsed().as_secs_f64()
    ));
    Ok(())
}
