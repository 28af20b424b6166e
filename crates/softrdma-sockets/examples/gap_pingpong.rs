//! Ping-pong with pauses: the client sends 64 octets every `GAP_MS`
//! milliseconds and waits for the echo; prints the median and 90th
//! percentile round trip of sockets direct (offloaded) and of plain TCP.
//! Unlike a back-to-back ping-pong, the server's blocking read sleeps for a
//! while before each message arrives: the wake-up path of an idle blocked
//! call is what is measured.
//!
//! ```text
//! gap_pingpong [GAP_MS (default 10)] [ROUNDS (default 200)]
//! ```

use std::io::{Read, Write};
use std::thread;
use std::time::{Duration, Instant};

use softrdma_sockets::{Config, Mode, TcpListener, TcpStream};

fn run(mode: Mode, gap: Duration, rounds: usize) -> (f64, f64) {
    let mut cfg = Config::default();
    cfg.mode = mode;
    let l = TcpListener::bind_with("127.0.0.1:0", &cfg).expect("bind");
    let addr = l.local_addr().expect("addr");
    let server = thread::spawn(move || {
        let (mut s, _) = l.accept().expect("accept");
        s.set_nodelay(true).expect("nodelay");
        let mut b = [0u8; 64];
        while s.read_exact(&mut b).is_ok() {
            if s.write_all(&b).is_err() {
                break;
            }
        }
    });
    let mut c = TcpStream::connect_with(addr, &cfg).expect("connect");
    c.set_nodelay(true).expect("nodelay");
    let mut b = [7u8; 64];
    let mut rtt = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        thread::sleep(gap);
        let t = Instant::now();
        c.write_all(&b).expect("write");
        c.read_exact(&mut b).expect("read");
        rtt.push(t.elapsed().as_secs_f64() * 1e6);
    }
    drop(c);
    server.join().expect("server");
    rtt.sort_by(f64::total_cmp);
    (rtt[rtt.len() / 2], rtt[rtt.len() * 9 / 10])
}

fn main() {
    let mut args = std::env::args().skip(1);
    let gap_ms: u64 = args.next().map_or(10, |v| v.parse().expect("GAP_MS"));
    let rounds: usize = args.next().map_or(200, |v| v.parse().expect("ROUNDS"));
    let gap = Duration::from_millis(gap_ms);
    println!("64 B ping-pong, {gap_ms} ms between rounds, {rounds} rounds");
    println!("{:>10} {:>12} {:>12}", "transport", "median µs", "p90 µs");
    let (sm, s9) = run(Mode::Offload, gap, rounds);
    let (tm, t9) = run(Mode::Tcp, gap, rounds);
    println!("{:>10} {sm:>12.1} {s9:>12.1}", "sdp");
    println!("{:>10} {tm:>12.1} {t9:>12.1}", "tcp");
    println!("sdp / tcp (median): {:.2}×", sm / tm);
}
