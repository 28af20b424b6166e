//! [`Config::keep_recvs`]: a receive posted again after it completed takes
//! its kept buffer without [`Memory::local`] while the registrations'
//! stamp is unchanged, and every post has the result it has without it.

use softrdma_wire::ddp::Msn;
use softrdma_wire::fpdu;
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::ulpdu::UlpduRepr;

use super::*;
use crate::mem::{InvalidateError, LocalAccessError, RemoteAccess, RemoteAccessError};
use crate::sim::{LOCAL_WRITE, SimMemory};
use softrdma_wire::rdmap::atomic::AtomicRequestRepr;

/// [`SimMemory`] with a registrations' stamp, keys that can be revoked
/// (the stamp moves on), and a count of the SGE checks.
struct Stamped {
    m: SimMemory,
    stamp: u64,
    revoked: Vec<u32>,
    checks: usize,
    keepable: bool,
}

impl Memory for Stamped {
    type Region = usize;

    fn remote(
        &mut self,
        stag: u32,
        access: RemoteAccess,
        to: u64,
        len: u64,
    ) -> Result<Span<usize>, RemoteAccessError> {
        self.m.remote(stag, access, to, len)
    }

    fn local(
        &mut self,
        lkey: u32,
        addr: u64,
        len: u32,
        write: bool,
    ) -> Result<Span<usize>, LocalAccessError> {
        self.checks += 1;
        if self.revoked.contains(&lkey) {
            return Err(LocalAccessError::InvalidLkey);
        }
        self.m.local(lkey, addr, len, write)
    }

    fn atomic(&mut self, t: &Span<usize>, req: &AtomicRequestRepr) -> Option<u64> {
        self.m.atomic(t, req)
    }

    fn invalidate(&mut self, stag: u32, remote: bool) -> Result<(), InvalidateError> {
        self.m.invalidate(stag, remote)
    }

    fn local_op(&mut self, op: &LocalOp) -> Result<(), ()> {
        self.m.local_op(op)
    }

    fn copy_in(&mut self, dst: &Span<usize>, at: usize, bytes: &[u8]) -> bool {
        self.m.copy_in(dst, at, bytes)
    }

    fn copy_out(&mut self, src: &Span<usize>, at: usize, out: &mut [u8]) -> bool {
        self.m.copy_out(src, at, out)
    }

    fn recv_stamp(&mut self) -> Option<u64> {
        Some(self.stamp)
    }

    fn may_keep(&mut self, _span: &Span<usize>) -> bool {
        self.keepable
    }
}

struct K {
    c: Connection<usize>,
    mem: Stamped,
    /// The ring's region, key and address; slots of 64 octets.
    ring: (usize, u32, u64),
    msn: u32,
}

fn setup(keep: bool) -> K {
    let mut m = SimMemory::new(0x10);
    let ring = m.add_region(4 * 64, LOCAL_WRITE, |_| 0);
    let mut cfg = Config::new(false);
    cfg.keep_recvs = keep;
    cfg.max_recv_wr = 4;
    K {
        c: Connection::new(cfg),
        mem: Stamped {
            m,
            stamp: 0,
            revoked: Vec::new(),
            checks: 0,
            keepable: true,
        },
        ring,
        msn: 1,
    }
}

impl K {
    fn sge(&self, slot: u64) -> Sge {
        Sge {
            lkey: self.ring.1,
            addr: self.ring.2 + slot * 64,
            len: 64,
        }
    }

    fn post(&mut self, wr_id: u64, sge: Sge) -> Result<(), PostError> {
        self.c
            .post_recv(&RecvWr { wr_id, sgl: &[sge] }, &mut self.mem)
    }

    /// The peer's Send of `payload`.
    fn send(&mut self, payload: &[u8]) {
        let u = UlpduRepr::send(Opcode::Send, None, Msn(self.msn), 0, true, payload);
        self.msn += 1;
        let mut b = vec![0u8; u.buffer_len()];
        u.emit(&mut b).unwrap();
        let mut f = vec![0u8; b.len() + 16];
        let n = fpdu::emit(&b, false, &mut f).unwrap();
        assert_eq!(self.c.handle_rx_stream(&f[..n], &mut self.mem), n);
    }

    fn completions(&mut self) -> Vec<(u64, WcStatus, u32)> {
        std::iter::from_fn(|| self.c.poll_completion())
            .map(|c| (c.wr_id, c.status, c.byte_len))
            .collect()
    }

    fn slot(&self, slot: usize) -> &[u8] {
        &self.mem.m.region(self.ring.0)[slot * 64..slot * 64 + 8]
    }
}

/// Slot 0 receives, is posted again and receives again: the repost is
/// not checked (its kept buffer is taken), the data lands in slot 0.
#[test]
fn a_repost_takes_the_kept_buffer() {
    let mut k = setup(true);
    let s0 = k.sge(0);
    k.post(0, s0).unwrap();
    k.send(b"first!!!");
    assert_eq!(k.completions(), [(0, WcStatus::Success, 8)]);
    assert_eq!(k.c.kept_recvs(), 1);
    let checks = k.mem.checks;
    k.post(0, s0).unwrap();
    assert_eq!(k.mem.checks, checks, "the repost was checked again");
    assert_eq!((k.c.kept_recvs(), k.c.kept_recvs_taken()), (0, 1));
    k.send(b"second!!");
    assert_eq!(k.completions(), [(0, WcStatus::Success, 8)]);
    assert_eq!(k.slot(0), b"second!!");
}

/// Without `keep_recvs`, or with memory that may not be kept, nothing is
/// kept and every post is checked.
#[test]
fn nothing_is_kept_unless_asked_and_allowed() {
    for (keep, keepable) in [(false, true), (true, false)] {
        let mut k = setup(keep);
        k.mem.keepable = keepable;
        let s0 = k.sge(0);
        k.post(0, s0).unwrap();
        k.send(b"12345678");
        assert_eq!(k.completions(), [(0, WcStatus::Success, 8)]);
        assert_eq!(k.c.kept_recvs(), 0);
        let checks = k.mem.checks;
        k.post(0, s0).unwrap();
        assert_eq!(k.mem.checks, checks + 1);
    }
}

/// The stamp moved on (a registration changed) and the key was revoked
/// between the completion and the repost: the repost is checked and
/// fails as any post with a bad key (ERROR, the others flushed first,
/// local protection error); the kept buffer is let go.
#[test]
fn a_changed_stamp_checks_the_repost_again() {
    let mut k = setup(true);
    let (s0, s1) = (k.sge(0), k.sge(1));
    k.post(0, s0).unwrap();
    k.post(1, s1).unwrap();
    k.send(b"12345678");
    assert_eq!(k.completions(), [(0, WcStatus::Success, 8)]);
    k.mem.revoked.push(k.ring.1);
    k.mem.stamp += 1;
    k.post(0, s0).unwrap();
    assert_eq!(k.c.kept_recvs_taken(), 0);
    assert_eq!(k.c.state(), QpState::Error);
    assert_eq!(
        k.completions(),
        [(1, WcStatus::WrFlush, 0), (0, WcStatus::LocalProtection, 0)]
    );
    assert_eq!(k.c.kept_recvs(), 0);
}

/// A changed stamp alone (another registration changed): the repost is
/// checked again, succeeds, and is kept again with the new stamp.
#[test]
fn a_changed_stamp_alone_only_costs_a_check() {
    let mut k = setup(true);
    let s0 = k.sge(0);
    k.post(0, s0).unwrap();
    k.send(b"12345678");
    k.completions();
    k.mem.stamp += 1;
    let checks = k.mem.checks;
    k.post(0, s0).unwrap();
    assert_eq!(k.mem.checks, checks + 1);
    k.send(b"abcdefgh");
    assert_eq!(k.completions(), [(0, WcStatus::Success, 8)]);
    k.post(0, s0).unwrap();
    assert_eq!((k.mem.checks, k.c.kept_recvs_taken()), (checks + 1, 1));
}

/// Another `wr_id`, another SGE, or a `wr_id` past the receive queue's
/// depth: not the kept receive (checked as usual). A post of the kept
/// receive's `wr_id` with another SGE lets its kept buffer go.
#[test]
fn only_the_same_wr_id_and_sge_take_the_kept_buffer() {
    let mut k = setup(true);
    let (s0, s1) = (k.sge(0), k.sge(1));
    k.post(0, s0).unwrap();
    k.send(b"12345678");
    k.completions();
    let checks = k.mem.checks;
    k.post(1, s0).unwrap();
    assert_eq!(k.c.kept_recvs(), 1, "another wr_id's post took it");
    k.post(0, s1).unwrap();
    assert_eq!(k.mem.checks, checks + 2);
    assert_eq!(
        (k.c.kept_recvs(), k.c.kept_recvs_taken()),
        (0, 0),
        "the buffer of receive 0 kept past its post with another SGE"
    );
    // Past the depth (4): never kept.
    k.send(b"x");
    k.send(b"y");
    k.completions();
    k.post(9, s0).unwrap();
    k.send(b"z");
    assert_eq!(k.completions(), [(9, WcStatus::Success, 1)]);
    assert_eq!(k.c.kept_recvs(), 2, "receives 1 and 0 kept, 9 not");
}

/// In ERROR the kept buffers are let go and a repost is flushed at once,
/// as any post in ERROR; a full queue refuses a repost and keeps the
/// buffer for the next try.
#[test]
fn reposts_in_error_and_into_a_full_queue() {
    let mut k = setup(true);
    let s = [k.sge(0), k.sge(1), k.sge(2), k.sge(3)];
    k.post(0, s[0]).unwrap();
    k.send(b"12345678");
    k.completions();
    for (i, sge) in s.iter().enumerate().skip(1) {
        k.post(i as u64, *sge).unwrap();
    }
    k.post(4, s[0]).unwrap();
    // Four posted: the queue is full.
    assert_eq!(k.post(0, s[0]), Err(PostError::QueueFull(4)));
    assert_eq!(k.c.kept_recvs(), 1);
    k.c.abort();
    assert_eq!(k.c.kept_recvs(), 0);
    k.completions();
    assert_eq!(k.post(0, s[0]), Ok(()));
    assert_eq!(k.completions(), [(0, WcStatus::WrFlush, 0)]);
}
