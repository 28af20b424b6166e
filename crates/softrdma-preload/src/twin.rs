//! A preloaded listener's UDP twin: answers the capability queries of
//! sockets-direct clients (the wire format of `softrdma_sockets::detect`)
//! and records which connections are to be switched.
//!
//! The records live in shared anonymous memory made at `listen`: servers
//! that fork their workers after listening (nginx) accept in processes
//! other than the one whose thread answers, and every one of them must
//! find the record of the connection it accepts. Slots are claimed and
//! consumed with atomics only (no lock a fork could leave held).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use softrdma_sockets::detect::{Kind, Probe};

/// Number of connections that may be queried and not yet accepted.
const SLOTS: usize = 1024;
/// Seconds a record waits for its connection.
const RECORD_SECS: u64 = 10;
/// Slot state: free.
const FREE: u64 = 0;
/// Slot state: being written.
const BUSY: u64 = 1;

/// One record: state is FREE, BUSY, or the expiry (monotonic seconds + 2).
#[derive(Debug)]
#[repr(C)]
struct Record {
    state: AtomicU64,
    addr_hi: AtomicU64,
    addr_lo: AtomicU64,
    port: AtomicU64,
}

/// Records shared by the processes of one listener.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Records {
    slots: &'static [Record],
}

fn now_secs() -> u64 {
    // SAFETY: timespec is plain data; clock_gettime writes it.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: valid clock id and pointer. CLOCK_MONOTONIC is one clock for
    // every process of the host.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    ts.tv_sec as u64 + 2
}

fn key(peer: SocketAddr) -> (u64, u64, u64) {
    let o = match peer.ip().to_canonical() {
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
        IpAddr::V6(a) => a.octets(),
    };
    let hi = u64::from_be_bytes(o[..8].try_into().unwrap_or([0; 8]));
    let lo = u64::from_be_bytes(o[8..].try_into().unwrap_or([0; 8]));
    (hi, lo, u64::from(peer.port()))
}

impl Records {
    /// Shared memory for the records (inherited by forked children); `None`
    /// if it cannot be mapped.
    pub(crate) fn new_shared() -> Option<Records> {
        let len = SLOTS * size_of::<Record>();
        // SAFETY: a fresh anonymous shared mapping; zero-filled, which is
        // FREE for every slot. It is never unmapped (an accept in any
        // process may read it at any time), so 'static holds.
        unsafe {
            let p = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if p == libc::MAP_FAILED {
                return None;
            }
            Some(Records {
                slots: std::slice::from_raw_parts(p.cast::<Record>(), SLOTS),
            })
        }
    }

    /// Records a coming connection from `peer`; false if the table is full.
    pub(crate) fn put(&self, peer: SocketAddr) -> bool {
        let (hi, lo, port) = key(peer);
        let now = now_secs();
        for r in self.slots {
            let s = r.state.load(Ordering::Acquire);
            let usable = s == FREE || (s > BUSY && s < now);
            if usable
                && r.state
                    .compare_exchange(s, BUSY, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                r.addr_hi.store(hi, Ordering::Relaxed);
                r.addr_lo.store(lo, Ordering::Relaxed);
                r.port.store(port, Ordering::Relaxed);
                r.state.store(now + RECORD_SECS, Ordering::Release);
                return true;
            }
        }
        false
    }

    /// Whether a connection from `peer` was recorded (the record is consumed).
    pub(crate) fn take(&self, peer: SocketAddr) -> bool {
        let (hi, lo, port) = key(peer);
        let now = now_secs();
        for r in self.slots {
            let s = r.state.load(Ordering::Acquire);
            if s <= BUSY || s < now {
                continue;
            }
            if r.port.load(Ordering::Relaxed) == port
                && r.addr_lo.load(Ordering::Relaxed) == lo
                && r.addr_hi.load(Ordering::Relaxed) == hi
                && r.state
                    .compare_exchange(s, FREE, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
            {
                return true;
            }
        }
        false
    }
}

/// A running twin; dropping it stops the answering thread.
#[derive(Debug)]
#[cfg_attr(test, allow(dead_code))]
pub(crate) struct Twin {
    pub(crate) records: Records,
    stop: Arc<AtomicBool>,
}

#[cfg_attr(test, allow(dead_code))]
impl Twin {
    /// Binds a UDP socket to the listener's address `addr` and answers
    /// queries on a thread (started with every signal blocked by the
    /// caller).
    pub(crate) fn start(addr: SocketAddr) -> std::io::Result<Twin> {
        let records = Records::new_shared().ok_or_else(std::io::Error::last_os_error)?;
        let sock = UdpSocket::bind(addr)?;
        sock.set_read_timeout(Some(Duration::from_millis(200)))?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = stop.clone();
        std::thread::Builder::new()
            .name("softrdma-sd-twin".into())
            .spawn(move || serve(&sock, records, &s2))?;
        Ok(Twin { records, stop })
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

#[cfg_attr(test, allow(dead_code))]
fn serve(sock: &UdpSocket, records: Records, stop: &AtomicBool) {
    let mut b = [0u8; 64];
    while !stop.load(Ordering::Relaxed) {
        let Ok((n, from)) = sock.recv_from(&mut b) else {
            continue;
        };
        let Some(q) = Probe::decode(&b[..n]) else {
            continue;
        };
        if q.kind != Kind::Query {
            continue;
        }
        let peer = SocketAddr::new(from.ip(), q.client_port);
        let kind = if records.put(peer) {
            Kind::Accept
        } else {
            Kind::Decline
        };
        let _ = sock.send_to(&Probe { kind, ..q }.encode(), from);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_are_taken_once_and_match_address_and_port() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "127.0.0.1:4000".parse().unwrap();
        let b: SocketAddr = "127.0.0.1:4001".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:4000".parse().unwrap();
        assert!(r.put(a));
        assert!(!r.take(b));
        assert!(r.take(mapped), "v4-mapped is the same peer");
        assert!(!r.take(a), "consumed");
    }

    #[test]
    fn records_are_shared_with_a_forked_child() {
        let r = Records::new_shared().unwrap();
        let a: SocketAddr = "10.0.0.1:5000".parse().unwrap();
        // SAFETY: the child only touches atomics in the shared mapping and
        // exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let ok = r.put(a);
            // SAFETY: ends the child without running the parent's handlers.
            unsafe { libc::_exit(i32::from(!ok)) };
        }
        let mut st = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &raw mut st, 0) };
        assert_eq!(st, 0);
        assert!(r.take(a), "the child's record is seen by the parent");
    }
}
