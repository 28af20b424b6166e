//! [`QpInitAttr::keep_recvs`]: a receive posted again with the same
//! `wr_id` and SGE after it completed takes its kept buffer without the
//! key's look-up, and every post has the result it has without the kept
//! buffer. Each case runs on a receiver with and without `keep_recvs` and
//! compares what the two saw (post results, completions, state, bytes).

use std::time::{Duration, Instant};

use softrdma_proto::mpa::MpaConfig;

use crate::state::QpState;
use crate::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpInitAttr,
    QueuePair, RecvWr, SendOp, SendWr, Sge, WcOpcode, WcStatus, WorkCompletion,
};

/// Receive slots of the ring.
const SLOTS: u64 = 4;
/// Octets per slot.
const SLOT: u32 = 64;

/// A sender `a` connected to a receiver `b` (with `keep_recvs` as given)
/// whose ring of [`SLOTS`] receives in `ring` is posted.
struct Ring {
    _dev: Device,
    pd: ProtectionDomain,
    a: QueuePair,
    cqa: CompletionQueue,
    b: QueuePair,
    cqb: CompletionQueue,
    ring: MemoryRegion,
    src: MemoryRegion,
    /// The SGE slot 0 is posted with instead of its own, if set.
    sge0: Option<Sge>,
}

fn ring(keep: bool) -> Ring {
    let r = unposted(keep);
    r.post_all();
    r
}

/// [`ring`] with no receive posted yet.
fn unposted(keep: bool) -> Ring {
    let dev = Device::open_with(DeviceConfig {
        pin_threads: false,
        ..DeviceConfig::default()
    })
    .unwrap();
    let pd = ProtectionDomain::new(&dev);
    let cqa = CompletionQueue::new(&dev, 64, None).unwrap();
    let cqb = CompletionQueue::new(&dev, 64, None).unwrap();
    let a = QueuePair::new(&pd, &QpInitAttr::new(&cqa, &cqa)).unwrap();
    let mut attr = QpInitAttr::new(&cqb, &cqb);
    attr.keep_recvs = keep;
    let b = QueuePair::new(&pd, &attr).unwrap();
    crate::loopback::connect_pair(&a, &b, &MpaConfig::default()).unwrap();
    let ring = pd
        .register((SLOTS as u32 * SLOT) as usize, Access::LOCAL_WRITE)
        .unwrap();
    let src = pd.register(SLOT as usize, Access::LOCAL_WRITE).unwrap();
    Ring {
        _dev: dev,
        pd,
        a,
        cqa,
        b,
        cqb,
        ring,
        src,
        sge0: None,
    }
}

impl Ring {
    /// Slot `slot`'s SGE in the ring (the region's current key).
    fn sge(&self, slot: u64) -> Sge {
        if slot == 0
            && let Some(sge) = self.sge0
        {
            return sge;
        }
        self.ring.sge((slot as u32 * SLOT) as usize, SLOT).unwrap()
    }

    /// Posts every slot's receive.
    fn post_all(&self) {
        for slot in 0..SLOTS {
            self.post(slot).unwrap();
        }
    }

    /// Posts slot `slot`'s buffer as receive `slot`.
    fn post(&self, slot: u64) -> Result<(), crate::qp::PostRecvError> {
        self.b.post_recv(&RecvWr::new(slot, &[self.sge(slot)]))
    }

    /// Sends 16 octets of `byte` and waits for the send's completion.
    fn send(&self, byte: u8) {
        self.send_op(byte, SendOp::Send);
    }

    /// Sends 16 octets of `byte` with `op` (a kind of Send) and waits for
    /// the send's completion.
    fn send_op(&self, byte: u8, op: SendOp<'_>) {
        self.src.write(0, &[byte; 16]).unwrap();
        let sge = [self.src.sge(0, 16).unwrap()];
        self.a
            .post_send(&SendWr::new(1000, op).sg_list(&sge).signaled())
            .unwrap();
        let wc = wait(&self.cqa, 1);
        assert_eq!(wc[0].status, WcStatus::Success, "the send: {wc:?}");
    }

    /// Posts that took a kept buffer.
    fn kept_taken(&self) -> u64 {
        let g = self.b.qp().lock_core();
        g.as_ref().map_or(0, |cc| cc.conn.kept_recvs_taken())
    }

    /// The bytes of slot `slot`.
    fn slot_bytes(&self, slot: u64) -> Vec<u8> {
        let mut v = vec![0u8; 16];
        self.ring
            .read((slot as u32 * SLOT) as usize, &mut v)
            .unwrap();
        v
    }
}

/// Waits for `n` completions (10 s at most), then 20 ms more for any
/// extra one (returned too).
fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
    while out.len() < n {
        let k = cq.poll(&mut buf);
        out.extend_from_slice(&buf[..k]);
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
        if k == 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    std::thread::sleep(Duration::from_millis(20));
    let k = cq.poll(&mut buf);
    out.extend_from_slice(&buf[..k]);
    out
}

/// What a receiver saw: (wr_id, status, opcode, byte_len) of each receive
/// completion.
fn recvs(wcs: &[WorkCompletion]) -> Vec<(u64, WcStatus, WcOpcode, u32)> {
    wcs.iter()
        .map(|w| (w.wr_id, w.status, w.opcode, w.byte_len))
        .collect()
}

/// Slot 0 receives a message, is consumed and posted again, `between`
/// running in between; then `after` runs. Returns what the receiver saw
/// and the posts that took a kept buffer.
fn case(
    keep: bool,
    between: impl FnOnce(&mut Ring),
    after: impl FnOnce(&mut Ring) -> String,
) -> (String, u64) {
    let mut r = ring(keep);
    r.send(1);
    let first = recvs(&wait(&r.cqb, 1));
    assert_eq!(first, [(0, WcStatus::Success, WcOpcode::Recv, 16)]);
    between(&mut r);
    let post = format!("{:?}", r.post(0));
    let seen = after(&mut r);
    let state = r.b.state();
    (
        format!("post {post}; {seen}; state {state:?}"),
        r.kept_taken(),
    )
}

/// Runs `case` with and without `keep_recvs`: both must see the same.
/// Returns what they saw and the kept buffers taken with `keep_recvs`.
fn both(between: impl Fn(&mut Ring), after: impl Fn(&mut Ring) -> String) -> (String, u64) {
    let (with, taken) = case(true, &between, &after);
    let (without, none) = case(false, &between, &after);
    assert_eq!(with, without, "keep_recvs changed the result");
    assert_eq!(none, 0, "a buffer kept without keep_recvs");
    (with, taken)
}

/// What a refused repost of slot 0 leaves, the same with and without
/// `keep_recvs` (checked by `both`): no kept buffer taken, the receive
/// failed with `LocalProtection`, the QP in ERROR and the `flushed`
/// other receives flushed.
fn refused_as_the_look_up_refuses(seen: &str, taken: u64, flushed: usize) {
    assert_eq!(taken, 0);
    assert!(
        seen.contains("(0, LocalProtection, Recv, 0)") && seen.contains("state Error"),
        "{seen}"
    );
    assert_eq!(seen.matches("WrFlush").count(), flushed, "{seen}");
}

/// The ring's usual life: every slot receives, is posted again and
/// receives again; the reposts take the kept buffers, the data lands in
/// the right slots.
#[test]
fn a_reposted_ring_takes_its_kept_buffers() {
    for keep in [true, false] {
        let r = ring(keep);
        for round in 0..3u64 {
            for slot in 0..SLOTS {
                let byte = (round * SLOTS + slot + 1) as u8;
                r.send(byte);
                let wc = recvs(&wait(&r.cqb, 1));
                assert_eq!(wc, [(slot, WcStatus::Success, WcOpcode::Recv, 16)]);
                assert_eq!(r.slot_bytes(slot), [byte; 16]);
                r.post(slot).unwrap();
            }
        }
        let reposts = 3 * SLOTS;
        assert_eq!(r.kept_taken(), if keep { reposts } else { 0 });
        assert_eq!(r.b.state(), QpState::Rts);
    }
}

/// The region deregistered between the completion and the repost: the
/// repost fails as a post with a bad key does (the QP enters ERROR, the
/// other receives are flushed, then the repost completes with a local
/// protection error), and writes nothing anywhere.
#[test]
fn a_repost_after_deregistration_fails_as_the_look_up_does() {
    let (seen, taken) = both(
        |r| {
            let old = std::mem::replace(
                &mut r.ring,
                r.pd.register(SLOT as usize, Access::LOCAL_WRITE).unwrap(),
            );
            // The repost names the old region's key and range.
            let sge = old.sge(0, SLOT).unwrap();
            drop(old);
            r.sge0 = Some(sge);
        },
        |r| format!("{:?}", recvs(&wait(&r.cqb, 4))),
    );
    refused_as_the_look_up_refuses(&seen, taken, 3);
}

/// The region's rights changed (re-registered without local write) in
/// between: posted with its new key (another SGE than the kept receive's,
/// so the kept buffer is let go whatever the change count says), the
/// repost fails (no local write).
#[test]
fn a_repost_after_the_rights_changed_fails_as_the_look_up_does() {
    let (seen, taken) = both(
        |r| {
            r.ring.rereg(Access::NONE).unwrap();
        },
        |r| format!("{:?}", recvs(&wait(&r.cqb, 4))),
    );
    refused_as_the_look_up_refuses(&seen, taken, 3);
}

/// The region re-registered in between with the same rights, the repost
/// naming its old key: the very SGE the kept buffer was checked as, but
/// the key is gone, so the repost fails as the look-up does. The
/// re-registration's change count is what keeps the kept buffer from
/// being taken.
#[test]
fn a_repost_with_the_old_key_after_rereg_fails_as_the_look_up_does() {
    let (seen, taken) = both(
        |r| {
            let old = r.sge(0);
            r.ring.rereg(Access::LOCAL_WRITE).unwrap();
            assert_ne!(r.sge(0).lkey, old.lkey, "the same key after rereg");
            r.sge0 = Some(old);
        },
        |r| format!("{:?}", recvs(&wait(&r.cqb, 4))),
    );
    refused_as_the_look_up_refuses(&seen, taken, 3);
}

/// Octets a fast-register region answers for in the cases below.
const FR_LEN: u32 = SLOT;

/// Slot 0 receives into a fast-register region (fast-registered with
/// local write, its STag in the slot's SGE) and is posted again, the same
/// SGE, after `between` ran (given the region); then `after` runs.
/// Returns what the receiver saw and the posts that took a kept buffer.
fn fast_reg_case(
    keep: bool,
    between: &dyn Fn(&Ring, &MemoryRegion),
    after: &dyn Fn(&Ring, &MemoryRegion) -> String,
) -> (String, u64) {
    let mut r = unposted(keep);
    let fmr = r.pd.alloc_mr(FR_LEN as usize).unwrap();
    let iova = 0x5_0000;
    let op = SendOp::FastReg {
        mr: &fmr,
        iova,
        length: u64::from(FR_LEN),
        access: Access::LOCAL_WRITE,
    };
    r.b.post_send(&SendWr::new(500, op).signaled()).unwrap();
    let wc = wait(&r.cqb, 1);
    assert_eq!(
        (wc[0].status, wc[0].opcode),
        (WcStatus::Success, WcOpcode::RegMr)
    );
    r.sge0 = Some(Sge {
        addr: iova,
        length: FR_LEN,
        lkey: fmr.lkey(),
    });
    r.post_all();
    r.send(1);
    let first = recvs(&wait(&r.cqb, 1));
    assert_eq!(first, [(0, WcStatus::Success, WcOpcode::Recv, 16)]);
    between(&r, &fmr);
    let post = format!("{:?}", r.post(0));
    let seen = after(&r, &fmr);
    let state = r.b.state();
    (
        format!("post {post}; {seen}; state {state:?}"),
        r.kept_taken(),
    )
}

/// [`fast_reg_case`] with and without `keep_recvs`: both must see the
/// same. Returns what they saw and the kept buffers taken with
/// `keep_recvs`.
fn fast_reg_both(
    between: &dyn Fn(&Ring, &MemoryRegion),
    after: &dyn Fn(&Ring, &MemoryRegion) -> String,
) -> (String, u64) {
    let (with, taken) = fast_reg_case(true, between, after);
    let (without, none) = fast_reg_case(false, between, after);
    assert_eq!(with, without, "keep_recvs changed the result");
    assert_eq!(none, 0, "a buffer kept without keep_recvs");
    (with, taken)
}

/// Nothing in between: the repost into the fast-registered region takes
/// its kept buffer, and the slot receives there again.
#[test]
fn a_repost_into_a_fast_registered_region_takes_its_kept_buffer() {
    let (seen, taken) = fast_reg_both(&|_, _| {}, &|r, fmr| {
        let mut wc = Vec::new();
        for slot in 1..=SLOTS {
            r.send(slot as u8 + 1);
            wc.extend(recvs(&wait(&r.cqb, 1)));
        }
        format!("{wc:?} {:?}", &fmr.to_vec()[..16])
    });
    assert_eq!(taken, 1);
    assert!(
        seen.contains("(0, Success, Recv, 16)]") && seen.contains(&format!("{:?}", [5u8; 16])),
        "{seen}"
    );
    assert!(seen.contains("state Rts"), "{seen}");
}

/// The fast-register region invalidated (Local Invalidate: its STag
/// stays the same) between the completion and the repost of the same
/// SGE: the repost fails as the look-up does (ERROR, the other receives
/// flushed, a local protection error), with or without `keep_recvs`.
#[test]
fn a_repost_after_local_invalidate_fails_as_the_look_up_does() {
    let (seen, taken) = fast_reg_both(
        &|r, fmr| {
            let stag = fmr.lkey();
            r.b.post_send(&SendWr::new(501, SendOp::LocalInv { rkey: stag }).signaled())
                .unwrap();
            let wc = wait(&r.cqb, 1);
            assert_eq!(
                (wc[0].status, wc[0].opcode),
                (WcStatus::Success, WcOpcode::LocalInv)
            );
            assert_eq!(fmr.lkey(), stag, "the invalidation changed the STag");
        },
        &|r, _| format!("{:?}", recvs(&wait(&r.cqb, 4))),
    );
    refused_as_the_look_up_refuses(&seen, taken, 3);
}

/// The peer invalidates the fast-register region (Send with Invalidate,
/// received by slot 1) between the completion and the repost of the same
/// SGE: the repost fails as the look-up does.
#[test]
fn a_repost_after_send_with_invalidate_fails_as_the_look_up_does() {
    let (seen, taken) = fast_reg_both(
        &|r, fmr| {
            let op = SendOp::SendWithInv {
                invalidate_rkey: fmr.rkey(),
            };
            r.send_op(2, op);
            let wc = recvs(&wait(&r.cqb, 1));
            assert_eq!(wc, [(1, WcStatus::Success, WcOpcode::Recv, 16)]);
        },
        &|r, _| format!("{:?}", recvs(&wait(&r.cqb, 3))),
    );
    refused_as_the_look_up_refuses(&seen, taken, 2);
}

/// A kept buffer does not outlive the next post of its `wr_id`: slot 0
/// receives into a region of its own, the region is deregistered, and
/// receive 0 is posted again with another SGE (slot 0 of the ring) or
/// with two SGEs: the old region's memory is freed at that post, not
/// kept until receive 0 completes again.
#[test]
fn a_repost_with_another_sge_lets_the_kept_buffer_go() {
    for two_sges in [false, true] {
        for keep in [true, false] {
            let mut r = unposted(keep);
            let own = r.pd.register(SLOT as usize, Access::LOCAL_WRITE).unwrap();
            let weak = std::sync::Arc::downgrade(&own.mem);
            r.sge0 = Some(own.sge(0, SLOT).unwrap());
            r.post_all();
            r.send(1);
            let wc = recvs(&wait(&r.cqb, 1));
            assert_eq!(wc, [(0, WcStatus::Success, WcOpcode::Recv, 16)]);
            own.deregister().unwrap();
            assert_eq!(
                weak.upgrade().is_some(),
                keep,
                "the memory after deregistration (keep_recvs {keep})"
            );
            r.sge0 = None;
            if two_sges {
                let sgl = [
                    r.ring.sge(0, SLOT / 2).unwrap(),
                    r.ring.sge((SLOT / 2) as usize, SLOT / 2).unwrap(),
                ];
                r.b.post_recv(&RecvWr::new(0, &sgl)).unwrap();
            } else {
                r.post(0).unwrap();
            }
            assert!(
                weak.upgrade().is_none(),
                "the old buffer kept past the post (two SGEs {two_sges}, keep_recvs {keep})"
            );
            assert_eq!(r.kept_taken(), 0);
            // Receive 0 lands in the ring's slot 0.
            for slot in 1..SLOTS {
                r.send(slot as u8);
                wait(&r.cqb, 1);
            }
            r.send(7);
            let wc = recvs(&wait(&r.cqb, 1));
            assert_eq!(wc, [(0, WcStatus::Success, WcOpcode::Recv, 16)]);
            assert_eq!(r.slot_bytes(0), [7; 16]);
            assert_eq!(r.b.state(), QpState::Rts);
        }
    }
}

/// Another region of the device deregistered in between: the kept
/// buffer is not taken (the stamp is the device's), the look-up succeeds
/// and the slot receives as before.
#[test]
fn a_change_of_another_region_makes_the_repost_look_up_again() {
    let (seen, taken) = both(
        |r| drop(r.pd.register(64, Access::LOCAL_WRITE).unwrap()),
        |r| {
            for slot in 1..SLOTS {
                r.send(slot as u8);
                wait(&r.cqb, 1);
            }
            r.send(9);
            let wc = recvs(&wait(&r.cqb, 1));
            format!("{wc:?} {:?}", r.slot_bytes(0))
        },
    );
    assert_eq!(taken, 0);
    assert!(seen.contains("[(0, Success, Recv, 16)]"), "{seen}");
    assert!(seen.contains("state Rts"), "{seen}");
}

/// The QP in ERROR between the completion and the repost: the repost is
/// accepted and flushed at once, as any post in ERROR.
#[test]
fn a_repost_in_error_is_flushed() {
    let (seen, _) = both(
        |r| {
            r.b.modify(QpState::Error).unwrap();
            // The three other receives are flushed.
            let wc = recvs(&wait(&r.cqb, 3));
            assert!(wc.iter().all(|w| w.1 == WcStatus::WrFlush), "{wc:?}");
        },
        |r| format!("{:?}", recvs(&wait(&r.cqb, 1))),
    );
    assert!(
        seen.contains("post Ok(())") && seen.contains("[(0, WrFlush, Recv, 0)]"),
        "{seen}"
    );
}

/// A post of slot 0's buffer under another `wr_id`, or of another buffer
/// under `wr_id` 0, is not the kept receive: checked with a look-up (and
/// received into the buffer it names).
#[test]
fn another_wr_id_or_buffer_is_looked_up() {
    for keep in [true, false] {
        let r = ring(keep);
        r.send(1);
        wait(&r.cqb, 1);
        // Slot 0's buffer as receive 7.
        r.b.post_recv(&RecvWr::new(7, &[r.sge(0)])).unwrap();
        assert_eq!(r.kept_taken(), 0);
        for slot in 1..SLOTS {
            r.send(slot as u8);
            wait(&r.cqb, 1);
        }
        r.send(5);
        assert_eq!(
            recvs(&wait(&r.cqb, 1)),
            [(7, WcStatus::Success, WcOpcode::Recv, 16)]
        );
        assert_eq!(r.slot_bytes(0), [5; 16]);
        // Slot 1's buffer (now consumed) as receive 0.
        r.b.post_recv(&RecvWr::new(0, &[r.sge(1)])).unwrap();
        assert_eq!(r.kept_taken(), 0);
        r.send(6);
        assert_eq!(
            recvs(&wait(&r.cqb, 1)),
            [(0, WcStatus::Success, WcOpcode::Recv, 16)]
        );
        assert_eq!(r.slot_bytes(1), [6; 16]);
        assert_eq!(r.b.state(), QpState::Rts);
    }
}

/// A receive into memory lent for one call is never kept: the lending
/// call waits for every reference to the memory, and a kept buffer would
/// keep it waiting for good.
#[test]
fn a_receive_into_lent_memory_is_not_kept() {
    let r = std::sync::Arc::new(ring(true));
    let (tx, rx) = std::sync::mpsc::channel();
    let r2 = std::sync::Arc::clone(&r);
    // Not joined: a lending call that never returns leaves its thread
    // blocked, and the test fails on the timeout below.
    std::thread::spawn(move || {
        let r = r2;
        let mut buf = [0u8; 64];
        r.pd.lend_mut(&mut buf, Access::LOCAL_WRITE, |lent| {
            // The lent receive goes after the ring's four.
            let sge = [Sge {
                addr: lent.addr(),
                length: 64,
                lkey: lent.lkey(),
            }];
            r.b.post_recv(&RecvWr::new(2, &sge)).unwrap();
            for i in 0..=SLOTS {
                r.send(i as u8 + 1);
            }
            let wc = recvs(&wait(&r.cqb, SLOTS as usize + 1));
            assert_eq!(
                wc[SLOTS as usize],
                (2, WcStatus::Success, WcOpcode::Recv, 16)
            );
        })
        .unwrap();
        tx.send(buf[..16].to_vec()).unwrap();
    });
    let got = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the lending call never returned");
    assert_eq!(got, [SLOTS as u8 + 1; 16]);
}
