//! Programs that poll the last byte of a buffer to learn that an RDMA Write
//! has landed (DAPL's `dtest -D`, many MPI libraries on hardware RNICs) must
//! see every earlier byte of that Write once they see the last one.
//!
//! Regression: placement used `memcpy` and a `readv` that covered the whole
//! payload, neither of which writes in address order, so a poller now and
//! then saw the new last byte next to a stretch of the previous Write's
//! bytes (`dtest -D`: "Tx data from server wrong", about 1 run in 20).
//!
//! `SOFTRDMA_LASTBYTE_ROUNDS=N` runs more rounds (the default keeps the test
//! short; the bug showed about once per 40 000 rounds under load).

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use softrdma_engine::{
    MemoryRegion, SendFlags, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

const LEN: usize = 4096;

/// Different at every position and round, so stale or shifted bytes show.
fn pattern(cnt: u32) -> Vec<u8> {
    let mut v: Vec<u8> = (0..LEN as u32)
        .map(|i| {
            let x = (i ^ cnt.wrapping_mul(0x9e37_79b9)).wrapping_mul(0x85eb_ca6b);
            (x >> 13) as u8 | 1
        })
        .collect();
    v[LEN - 1] = cnt as u8;
    v
}

fn last_byte(mr: &MemoryRegion) -> u8 {
    let mut b = [0u8; 1];
    mr.read(LEN - 1, &mut b).unwrap();
    b[0]
}

struct End {
    side: Side,
    sbuf: MemoryRegion,
    rbuf: MemoryRegion,
}

/// dtest's loop: wait for the peer's Write by its last byte (without polling
/// the CQ), check the whole buffer, write back in two SGEs; every 32nd Write
/// is signaled and its completion polled for (which drives the receive path
/// from this thread while it polls).
fn ping_pong(
    me: &End,
    peer_rbuf: (u64, u32),
    first: bool,
    rounds: u32,
    stop: &AtomicBool,
) -> Result<(), String> {
    let mut wc = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
    let (mut tx, mut rx) = (0u32, 0u32);
    for i in 0..=rounds {
        if !(first && tx == 0) && rx < rounds {
            rx += 1;
            let deadline = Instant::now() + Duration::from_secs(10);
            while last_byte(&me.rbuf) != rx as u8 {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    return Err(format!("round {rx}: the Write never arrived"));
                }
                std::hint::spin_loop();
            }
            let got = me.rbuf.to_vec();
            let want = pattern(rx);
            if got != want {
                let bad: Vec<usize> = (0..LEN).filter(|&k| got[k] != want[k]).collect();
                stop.store(true, Ordering::Relaxed);
                return Err(format!(
                    "round {rx}: the last byte was visible but {} other bytes were not yet ({}..={})",
                    bad.len(),
                    bad[0],
                    bad[bad.len() - 1]
                ));
            }
        }
        if tx == rounds {
            break;
        }
        tx += 1;
        me.sbuf.write(0, &pattern(tx)).unwrap();
        let half = (LEN / 2) as u32;
        let sg = [
            me.sbuf.sge(0, half).unwrap(),
            me.sbuf.sge(LEN / 2, half).unwrap(),
        ];
        let signaled = (i + 1) % 32 == 0;
        let wr = SendWr::new(
            u64::from(tx),
            SendOp::Write {
                remote_addr: peer_rbuf.0,
                rkey: peer_rbuf.1,
            },
        )
        .sg_list(&sg)
        .flags(if signaled {
            SendFlags::SIGNALED
        } else {
            SendFlags::NONE
        });
        me.side.qp.post_send(&wr).map_err(|e| e.to_string())?;
        if signaled {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let k = me.side.cq.poll(&mut wc);
                if let Some(w) = wc[..k].iter().find(|w| w.status != WcStatus::Success) {
                    return Err(format!("completion failed: {w:?}"));
                }
                if k > 0 {
                    break;
                }
                if Instant::now() > deadline {
                    return Err("no completion for a signaled Write".into());
                }
            }
        }
    }
    Ok(())
}

#[test]
fn write_last_byte_is_placed_after_the_rest_of_the_write() {
    let rounds: u32 = std::env::var("SOFTRDMA_LASTBYTE_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8000);
    let p = pair(false);
    let a = End {
        sbuf: mr(&p.a, LEN),
        rbuf: mr(&p.a, LEN),
        side: p.a,
    };
    let b = End {
        sbuf: mr(&p.b, LEN),
        rbuf: mr(&p.b, LEN),
        side: p.b,
    };
    let a_target = (a.rbuf.addr(), a.rbuf.rkey());
    let b_target = (b.rbuf.addr(), b.rbuf.rkey());
    let stop = Arc::new(AtomicBool::new(false));
    let stop2 = Arc::clone(&stop);
    let t = std::thread::spawn(move || ping_pong(&b, a_target, false, rounds, &stop2));
    let ra = ping_pong(&a, b_target, true, rounds, &stop);
    let rb = t.join().expect("peer thread");
    ra.unwrap();
    rb.unwrap();
    drop(p.dev);
}
