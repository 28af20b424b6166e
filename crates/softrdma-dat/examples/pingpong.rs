//! A DAT ping-pong over softrdma on loopback: two IAs in one process. The
//! client RDMA-writes a message into the server's memory and sends a
//! one-byte "ping"; the server answers "pong" after checking the bytes;
//! every 10th round the client RDMA-reads the server's buffer back.
//!
//! ```text
//! cargo run -p softrdma-dat --example pingpong -- [rounds] [size]
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use softrdma_dat::{
    CompletionFlags, ConnEvent, Ep, Evd, EvdFlags, Event, Ia, IaConfig, Lmr, LmrTriplet, MemPriv,
    Psp, Pz, RmrTriplet,
};

const T: Option<Duration> = Some(Duration::from_secs(10));

struct Side {
    ia: Ia,
    cr: Evd,
    conn: Evd,
    dto: Evd,
    ep: Ep,
    lmr: Lmr,
}

fn side(name: &str) -> Result<Side, Box<dyn std::error::Error>> {
    let ia = Ia::open(IaConfig::loopback(name))?;
    let pz = Pz::new(&ia);
    let cr = Evd::new(&ia, 4, EvdFlags::CR, None)?;
    let conn = Evd::new(&ia, 4, EvdFlags::CONNECTION, None)?;
    let dto = Evd::new(&ia, 64, EvdFlags::DTO, None)?;
    let ep = Ep::new(&ia, &pz, Some(&dto), Some(&dto), Some(&conn), None)?;
    let lmr = Lmr::alloc(&pz, 1 << 20, MemPriv::ALL)?;
    Ok(Side {
        ia,
        cr,
        conn,
        dto,
        ep,
        lmr,
    })
}

fn seg(l: &Lmr, off: u64, len: u32) -> LmrTriplet {
    LmrTriplet {
        lmr_context: l.lmr_context(),
        virtual_address: l.address() + off,
        segment_length: len,
    }
}

/// Waits for the next DTO event and returns (cookie, length).
fn dto(evd: &Evd) -> Result<(u64, u32), Box<dyn std::error::Error>> {
    match evd.wait(T, 1)?.0 {
        Event::Dto {
            cookie,
            status: softrdma_dat::DtoStatus::Success,
            len,
            ..
        } => Ok((cookie, len)),
        other => Err(format!("unexpected event {other:?}").into()),
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let rounds: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(1000);
    let size: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(4096);
    let s = side("server")?;
    let c = side("client")?;
    let psp = Psp::new_any(&s.ia, &s.cr, 0)?;
    // Receives before connecting: the passive side may be sent to at once.
    s.ep.post_recv(&[seg(&s.lmr, 0, 64)], 1, CompletionFlags::DEFAULT)?;
    c.ep.post_recv(&[seg(&c.lmr, 0, 64)], 1, CompletionFlags::DEFAULT)?;
    let lo = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0);
    c.ep.connect(lo, psp.conn_qual(), T, b"softrdma ping-pong")?;
    let Event::ConnRequest { cr, .. } = s.cr.wait(T, 1)?.0 else {
        return Err("no connection request".into());
    };
    cr.accept(Some(&s.ep), b"welcome")?;
    for e in [&s.conn, &c.conn] {
        match e.wait(T, 1)?.0 {
            Event::Connection {
                kind: ConnEvent::Established,
                ..
            } => {}
            other => return Err(format!("not established: {other:?}").into()),
        }
    }
    // The server's buffer at offset 4096, advertised out of band here.
    let remote = RmrTriplet {
        rmr_context: s.lmr.rmr_context(),
        virtual_address: s.lmr.address() + 4096,
        segment_length: size,
    };
    let start = Instant::now();
    for round in 0..rounds {
        let byte = (round % 251) as u8;
        c.lmr.region().fill(byte);
        c.ep.post_rdma_write(
            &[seg(&c.lmr, 4096, size)],
            10,
            &remote,
            CompletionFlags::SUPPRESS,
        )?;
        c.ep.post_send(&[seg(&c.lmr, 64, 1)], 11, CompletionFlags::DEFAULT)?;
        // Server: the ping arrives after the written bytes are in place.
        let (_, len) = dto(&s.dto)?;
        assert_eq!(len, 1);
        let mut probe = [0u8; 1];
        s.lmr.region().read(4096 + size as usize - 1, &mut probe)?;
        assert_eq!(probe[0], byte, "RDMA Write data in place");
        s.ep.post_recv(&[seg(&s.lmr, 0, 64)], 1, CompletionFlags::DEFAULT)?;
        s.ep.post_send(&[seg(&s.lmr, 64, 1)], 12, CompletionFlags::DEFAULT)?;
        // Client: its send and the pong (either order), then re-arm.
        let mut got = [false; 2];
        while !(got[0] && got[1]) {
            let (cookie, _) = dto(&c.dto)?;
            got[usize::from(cookie == 1)] = true;
        }
        dto(&s.dto)?; // the server's send completion
        c.ep.post_recv(&[seg(&c.lmr, 0, 64)], 1, CompletionFlags::DEFAULT)?;
        if round % 10 == 9 {
            c.ep.post_rdma_read(
                &[seg(&c.lmr, 8192, size)],
                13,
                &remote,
                CompletionFlags::DEFAULT,
            )?;
            let (cookie, len) = dto(&c.dto)?;
            assert_eq!((cookie, len), (13, size));
            let mut b = [0u8; 1];
            c.lmr.region().read(8192, &mut b)?;
            assert_eq!(b[0], byte, "RDMA Read brought the bytes back");
        }
    }
    let el = start.elapsed();
    println!(
        "{rounds} rounds of {size}-byte RDMA Write + ping/pong (RDMA Read every 10th): {:.1} us/round, {:.1} MB/s written",
        el.as_secs_f64() * 1e6 / f64::from(rounds),
        f64::from(rounds) * f64::from(size) / el.as_secs_f64() / 1e6
    );
    c.ep.disconnect(true)?;
    for e in [&c.conn, &s.conn] {
        if let Event::Connection { kind, .. } = e.wait(T, 1)?.0 {
            println!("{kind:?}");
        }
    }
    Ok(())
}
