//! One pass for a small inline Send on an idle connection
//! (`QueuePair::post_send_now`, the answer of a request/response
//! exchange): the core frames the FPDU straight into a buffer on the stack
//! (`Connection::post_send_framed`: the header, the payload, the CRC), it
//! is written with one `send(2)`, and the request completes in the same
//! call. No request is queued, no [`TxFpdu`] filled and gathered, no
//! second look for more to frame.
//!
//! The core takes the request only when nothing is queued or handed out
//! before it; the transmitter adds its own conditions: nothing framed and
//! not yet written, and no look at the socket's MSS due. A write that
//! takes less than the whole FPDU (the socket's buffer full) queues the
//! rest as a copied FPDU, written on by the general path
//! ([`TxIo::progress`]) from where the write stopped; it completes, as
//! every FPDU, once written whole (`handle_sent`).

use std::io;
use std::os::fd::RawFd;
use std::sync::Arc;

use softrdma_proto::conn::{Connection, SEND_NOW_MAX, TxFpdu};
use softrdma_proto::types::{Completion, SendWr};

use super::{Out, TxIo};
use crate::sys::io::write_bytes;
use crate::sys::mem::Memory;

/// What [`TxIo::send_now`] did.
#[derive(Debug)]
pub(crate) enum SendNow {
    /// Not taken (the core's or the transmitter's conditions): nothing
    /// changed; post the request the general way.
    Declined,
    /// Posted and written whole: the request completed, with the
    /// completion `Connection::handle_sent_framed` returned (`None`: if
    /// signaled, it is in the core's outputs).
    Written(Option<Completion>),
    /// Posted; the socket took part of the FPDU or none of it: the rest
    /// is queued for [`TxIo::progress`].
    Rest,
    /// Posted; the socket failed (the FPDU is queued as if not written;
    /// report the failure as [`TxStop::Failed`](super::TxStop::Failed)).
    Failed(io::Error),
}

impl TxIo {
    /// Posts `wr` and writes it in one pass if the core and this
    /// transmitter allow it (see the module docs).
    pub(crate) fn send_now(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        fd: RawFd,
        wr: &SendWr<'_>,
    ) -> SendNow {
        self.send_now_with(conn, wr, |frame| write_bytes(fd, frame))
    }

    /// [`send_now`](Self::send_now) with `write` as the socket's write.
    fn send_now_with(
        &mut self,
        conn: &mut Connection<Arc<Memory>>,
        wr: &SendWr<'_>,
        mut write: impl FnMut(&[u8]) -> io::Result<usize>,
    ) -> SendNow {
        if !self.out.is_empty() || self.bytes_sent >= self.mss_next {
            return SendNow::Declined;
        }
        let mut buf = [0u8; SEND_NOW_MAX];
        let Some(len) = conn.post_send_framed(wr, &mut buf) else {
            return SendNow::Declined;
        };
        let frame = &buf[..len];
        loop {
            let r = write(frame);
            self.writes += 1;
            match r {
                Ok(n) if n >= len => {
                    self.bytes_sent += n as u64;
                    return SendNow::Written(conn.handle_sent_framed());
                }
                Ok(n) => {
                    self.bytes_sent += n as u64;
                    self.queue_rest(frame, n);
                    return SendNow::Rest;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.queue_rest(frame, 0);
                    return SendNow::Rest;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    self.queue_rest(frame, 0);
                    return SendNow::Failed(e);
                }
            }
        }
    }

    /// Queues `frame`, of which `written` bytes are written, as the front
    /// FPDU (the queue is empty): a copied one, as [`TxIo::progress`]
    /// queues a small FPDU.
    fn queue_rest(&mut self, frame: &[u8], written: usize) {
        let mut o = self.pool.pop().unwrap_or_else(|| {
            Box::new(Out {
                fpdu: TxFpdu::new(),
                copy: Vec::new(),
                copied: false,
            })
        });
        o.fpdu.clear();
        o.copy.clear();
        o.copy.extend_from_slice(frame);
        o.copied = true;
        self.written = written;
        self.out.push_back(o);
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::{Ipv4Addr, TcpListener, TcpStream};
    use std::os::fd::AsRawFd;
    use std::time::{Duration, Instant};

    use softrdma_proto::conn::Config;
    use softrdma_proto::qp_state::QpState;
    use softrdma_proto::types::{SendOp, SendWr, WcOpcode, WcStatus};

    use super::super::TxStop;
    use super::*;
    use crate::mr::PdMemory;
    use crate::sys::io::{readable_now, reset_connection};
    use crate::{Device, DeviceConfig, ProtectionDomain};

    const SEND: SendOp = SendOp::Send {
        inv: None,
        imm: None,
    };

    fn config() -> Config {
        Config {
            max_inline: 256,
            ..Config::new(true)
        }
    }

    /// A device whose threads are not pinned.
    fn device() -> Device {
        Device::open_with(DeviceConfig {
            pin_threads: false,
            ..DeviceConfig::default()
        })
        .unwrap()
    }

    /// The bytes the general path puts on the wire for `wrs`, in order.
    fn general_bytes(wrs: &[SendWr<'_>], mem: &mut PdMemory<'_>) -> Vec<u8> {
        let mut c = Connection::new(config());
        let mut out = Vec::new();
        let mut f = TxFpdu::new();
        for wr in wrs {
            c.post_send(wr, mem).unwrap();
            while c.poll_transmit(mem, &mut f) {
                assert!(f.write_to(mem, &mut out));
                c.handle_sent(1);
            }
        }
        out
    }

    /// A write that takes `k` octets of the one pass's FPDU (none: the
    /// socket is full), then a second Send posted behind it: the general
    /// path writes the rest of the first FPDU, then the second, and the
    /// peer reads exactly what the general path would have written; both
    /// complete, in order. The same when the write fails.
    #[test]
    fn a_short_write_mid_fpdu_is_finished_by_the_general_path() {
        let dev = device();
        let pd = ProtectionDomain::new(&dev);
        let mut mem = PdMemory::new(dev.stags(), pd.id(), None);
        let first: Vec<u8> = (0..64u8).collect();
        let wr1 = SendWr::new(1, SEND, &[]).with_inline(&first);
        let wr2 = SendWr::new(2, SEND, &[]).with_inline(b"second");
        let want = general_bytes(&[wr1, wr2], &mut mem);
        let len1 = want.len() - (2 + 18 + 6 + 2 + 4);
        for k in [0, 1, 2, 3, 19, 20, 21, 50, len1 - 5, len1 - 4, len1 - 1] {
            let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
            let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
            let (mut b, _) = l.accept().unwrap();
            a.set_nonblocking(true).unwrap();
            let fd = a.as_raw_fd();
            let mut conn = Connection::new(config());
            let mut tx = TxIo::new();
            let r = tx.send_now_with(&mut conn, &wr1, |frame| {
                if k == 0 {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                write_bytes(fd, &frame[..k])
            });
            assert!(matches!(r, SendNow::Rest), "{k}: {r:?}");
            assert_eq!(tx.pending(), 1);
            assert_eq!(conn.send_queue_len(), 1);
            // Behind it: not by the one pass.
            assert!(matches!(
                tx.send_now(&mut conn, fd, &wr2),
                SendNow::Declined
            ));
            conn.post_send(&wr2, &mut mem).unwrap();
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match tx.progress(&mut conn, &mut mem, fd, usize::MAX) {
                    TxStop::Idle => break,
                    TxStop::Completed | TxStop::Budget | TxStop::WouldBlock => {}
                    TxStop::Failed(e) => panic!("{k}: {e}"),
                }
                assert!(Instant::now() < deadline, "{k}: stuck");
            }
            let ids: Vec<u64> = std::iter::from_fn(|| conn.poll_completion())
                .map(|c| c.wr_id)
                .collect();
            assert_eq!(ids, [1, 2], "{k}");
            drop(a);
            let mut got = Vec::new();
            b.read_to_end(&mut got).unwrap();
            assert_eq!(got, want, "{k}");
        }
        // A failed write: the FPDU stays queued, as the general path
        // leaves one it could not write; the caller's reset flushes the
        // request and the QP enters ERROR.
        let mut conn = Connection::new(config());
        let mut tx = TxIo::new();
        let r = tx.send_now_with(&mut conn, &wr1, |_| {
            Err(io::ErrorKind::ConnectionReset.into())
        });
        let SendNow::Failed(e) = r else {
            panic!("{r:?}")
        };
        assert_eq!(e.kind(), io::ErrorKind::ConnectionReset);
        assert_eq!(tx.pending(), 1);
        assert_eq!(conn.fpdus_in_flight(), 1);
        conn.handle_reset();
        assert_eq!(conn.state(), QpState::Error);
        let done: Vec<_> = std::iter::from_fn(|| conn.poll_completion())
            .map(|c| (c.wr_id, c.status))
            .collect();
        assert_eq!(done, [(1, WcStatus::WrFlush)]);
    }

    /// What a write into a socket the peer reset leaves, after the
    /// caller's `handle_reset` (as `core_post_send_now` and
    /// `core_transmit` do on a failure): the one pass (`send_now`) or the
    /// general path (`post_send`, then `progress`).
    fn after_a_reset(one_pass: bool, mem: &mut PdMemory<'_>) -> ResetOutcome {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        let fd = a.as_raw_fd();
        // The peer resets (RST); wait until it is in.
        reset_connection(b.as_raw_fd()).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !readable_now(fd) {
            assert!(Instant::now() < deadline, "the reset never arrived");
            std::thread::sleep(Duration::from_millis(1));
        }
        let mut conn = Connection::new(config());
        let mut tx = TxIo::new().following_mss(false);
        let wr = SendWr::new(1, SEND, &[]).with_inline(b"into a reset");
        let e = if one_pass {
            match tx.send_now(&mut conn, fd, &wr) {
                SendNow::Failed(e) => e,
                r => panic!("{r:?}"),
            }
        } else {
            conn.post_send(&wr, mem).unwrap();
            match tx.progress(&mut conn, mem, fd, usize::MAX) {
                TxStop::Failed(e) => e,
                r => panic!("{r:?}"),
            }
        };
        let queued = (tx.pending(), conn.fpdus_in_flight());
        conn.handle_reset();
        ResetOutcome {
            error: e.kind(),
            detail: format!("connection failed: {e}"),
            queued,
            state: conn.state(),
            completions: std::iter::from_fn(|| conn.poll_completion()).collect(),
            outputs: std::iter::from_fn(|| conn.poll_output()).collect(),
        }
    }

    #[derive(Debug, PartialEq)]
    struct ResetOutcome {
        error: io::ErrorKind,
        detail: String,
        queued: (usize, usize),
        state: QpState,
        completions: Vec<softrdma_proto::types::Completion>,
        outputs: Vec<softrdma_proto::types::Output>,
    }

    /// A peer that reset the connection: the one pass's write fails with
    /// the reset, the FPDU stays queued, and the caller's reset leaves
    /// exactly what the general path's leaves (the same error and detail,
    /// ERROR, the request flushed, the reset event).
    #[test]
    fn a_write_into_a_reset_fails_as_the_general_paths() {
        let dev = device();
        let pd = ProtectionDomain::new(&dev);
        let mut mem = PdMemory::new(dev.stags(), pd.id(), None);
        let one = after_a_reset(true, &mut mem);
        assert_eq!(one.error, io::ErrorKind::ConnectionReset, "{one:?}");
        assert!(one.detail.contains("reset by peer"), "{}", one.detail);
        assert_eq!(one.queued, (1, 1), "the FPDU stays queued");
        assert_eq!(one.state, QpState::Error);
        assert_eq!(
            one.completions
                .iter()
                .map(|c| (c.wr_id, c.status, c.opcode))
                .collect::<Vec<_>>(),
            [(1, WcStatus::WrFlush, WcOpcode::Send)]
        );
        assert_eq!(one, after_a_reset(false, &mut mem));
    }

    /// A whole write completes the request in the call; with an FPDU
    /// queued before it, or a look at the MSS due, the one pass declines.
    #[test]
    fn a_whole_write_completes_in_the_call() {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_b, _) = l.accept().unwrap();
        a.set_nonblocking(true).unwrap();
        let fd = a.as_raw_fd();
        let mut conn = Connection::new(config());
        let mut tx = TxIo::new();
        let wr = SendWr::new(7, SEND, &[]).with_inline(b"pong");
        match tx.send_now(&mut conn, fd, &wr) {
            SendNow::Written(Some(c)) => assert_eq!((c.wr_id, c.byte_len), (7, 4)),
            r => panic!("{r:?}"),
        }
        assert_eq!(tx.pending(), 0);
        assert_eq!(conn.send_queue_len(), 0);
        assert_eq!(tx.bytes_sent, 2 + 18 + 4 + 4, "no pad after 22 octets");
        let mut tx = TxIo::new().following_mss(true);
        tx.bytes_sent = tx.mss_next;
        assert!(matches!(tx.send_now(&mut conn, fd, &wr), SendNow::Declined));
    }
}
