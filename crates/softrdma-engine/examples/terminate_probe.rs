//! Sends one well-framed but invalid FPDU to an iWARP peer and prints the
//! Terminate it answers with: a way to compare softrdma's Terminates with
//! another implementation's (Linux siw) on the same input, together with a
//! capture (`tshark -d tcp.port==PORT,iwarp_mpa`).
//!
//! ```text
//! terminate_probe ADDR:PORT CASE
//! CASE: read-qn0 | read-qn7 | read-mo | read-nolast | read-badstag |
//!       short-ulpdu | atomic-badop | write-badstag
//! ```
//!
//! It connects, runs the MPA handshake as initiator (revision 2, CRC if the
//! peer wants it, IRD/ORD 1, no private data: what rdma_cm does on iWARP),
//! sends the case's FPDU, and prints every FPDU the peer sends until it
//! closes (10 s at most).

use std::io::Read;
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use softrdma_engine::connect::mpa_connect;
use softrdma_engine::proto::mpa::{CrcPolicy, MpaConfig};
use softrdma_engine::wire::ddp::{Msn, Stag};
use softrdma_engine::wire::fpdu;
use softrdma_engine::wire::rdmap::atomic::AtomicRequestRepr;
use softrdma_engine::wire::rdmap::read_request::ReadRequestRepr;
use softrdma_engine::wire::rdmap::{Opcode, control_byte};
use softrdma_engine::wire::ulpdu::{UlpduBody, UlpduRepr};

fn ulpdu(repr: &UlpduRepr<'_>) -> Vec<u8> {
    let mut u = vec![0u8; repr.buffer_len()];
    let n = repr.emit(&mut u).expect("emit");
    u.truncate(n);
    u
}

fn read_request() -> Vec<u8> {
    ulpdu(&UlpduRepr::read_request(
        Msn(1),
        ReadRequestRepr {
            sink_stag: Stag(0x0000_1200),
            sink_to: 0,
            read_size: 16,
            src_stag: Stag(0x00ab_cd01),
            src_to: 0x1000,
        },
    ))
}

fn case(name: &str) -> Option<Vec<u8>> {
    let mut u = match name {
        "read-qn0" | "read-qn7" | "read-mo" | "read-nolast" | "read-badstag" => read_request(),
        "short-ulpdu" => {
            let mut u = vec![0u8; 10];
            u[0] = 0x41;
            u[1] = control_byte(Opcode::Send);
            return Some(u);
        }
        "atomic-badop" => ulpdu(&UlpduRepr::atomic_request(
            Msn(1),
            AtomicRequestRepr::fetch_add(1, Stag(0x00ab_cd01), 0x1000, 1),
        )),
        "write-badstag" => ulpdu(&UlpduRepr::tagged(
            Opcode::RdmaWrite,
            Stag(0x00ab_cd01),
            0x1000,
            true,
            &[7u8; 64],
        )),
        _ => return None,
    };
    match name {
        "read-qn0" => u[6..10].copy_from_slice(&0u32.to_be_bytes()),
        "read-qn7" => u[6..10].copy_from_slice(&7u32.to_be_bytes()),
        "read-mo" => u[14..18].copy_from_slice(&28u32.to_be_bytes()),
        "read-nolast" => u[0] &= !0x40,
        "atomic-badop" => u[18 + 3] = 0x0f,
        _ => {}
    }
    Some(u)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(addr), Some(name)) = (args.get(1), args.get(2)) else {
        eprintln!("usage: terminate_probe ADDR:PORT CASE");
        std::process::exit(2);
    };
    let Some(u) = case(name) else {
        eprintln!("unknown case {name}");
        std::process::exit(2);
    };
    let mut s = TcpStream::connect(addr).expect("connect");
    let cfg = MpaConfig {
        crc: CrcPolicy::AcceptIfAsked,
        ird: 1,
        ord: 1,
        ..MpaConfig::default()
    };
    let n = mpa_connect(&mut s, &cfg, &[], Duration::from_secs(10)).expect("MPA");
    println!(
        "connected: MPA rev {}, CRC {}, RTR {:?}",
        n.revision,
        if n.crc { "on" } else { "off" },
        n.rtr
    );
    let mut f = vec![0u8; fpdu::fpdu_len(u.len())];
    let k = fpdu::emit(&u, n.crc, &mut f).expect("frame");
    s.write_all(&f[..k]).expect("send");
    println!("sent {name}: ULPDU {}", hex(&u));
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    let end = loop {
        match s.read(&mut b) {
            Ok(0) => break "FIN".to_string(),
            Ok(k) => got.extend_from_slice(&b[..k]),
            Err(e) => break format!("{e}"),
        }
    };
    let mut at = 0;
    while let Ok(fr) = fpdu::decode(&got[at..], n.crc) {
        at += fr.len;
        match UlpduRepr::parse(fr.ulpdu) {
            Ok(r) => match r.body {
                UlpduBody::Terminate(t) => println!(
                    "Terminate: code {} ({}), D={} M={} seg_len={:?} ddp_hdr={} R={} rdmap_hdr={}",
                    t.code,
                    t.code.known().map_or("?", |e| e.name()),
                    u8::from(t.ddp.is_some()),
                    u8::from(t.segment_length_valid),
                    t.ddp.map(|d| d.segment_length),
                    t.ddp.map_or(String::new(), |d| hex(d.header)),
                    u8::from(t.rdmap_header.is_some()),
                    t.rdmap_header.map_or(String::new(), hex),
                ),
                _ => println!("FPDU: {:?}", r.opcode),
            },
            Err(e) => println!("undecodable ULPDU {}: {e}", hex(fr.ulpdu)),
        }
    }
    if at < got.len() {
        println!("{} trailing bytes", got.len() - at);
    }
    println!("stream ended: {end}");
}
