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
    let r = Ring {
        _dev: dev,
        pd,
        a,
        cqa,
        b,
        cqb,
        ring,
        src,
        sge0: None,
    };
    for slot in 0..SLOTS {
        r.post(slot).unwrap();
    }
    r
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

    /// Posts slot `slot`'s buffer as receive `slot`.
    fn post(&self, slot: u64) -> Result<(), crate::qp::PostRecvError> {
        self.b.post_recv(&RecvWr::new(slot, &[self.sge(slot)]))
    }

    /// Sends 16 octets of `byte` and waits for the send's completion.
    fn send(&self, byte: u8) {
        self.src.write(0, &[byte; 16]).unwrap();
        let sge = [self.src.sge(0, 16).unwrap()];
        self.a
            .post_send(&SendWr::new(1000, SendOp::Send).sg_list(&sge).signaled())
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
    assert_eq!(taken, 0);
    assert!(
        seen.contains("(0, LocalProtection, Recv, 0)") && seen.contains("state Error"),
        "{seen}"
    );
    assert_eq!(seen.matches("WrFlush").count(), 3, "{seen}");
}

/// The region's rights changed (re-registered without local write) in
/// between: posted with its new key, the repost fails (no local write);
/// the kept buffer is not used.
#[test]
fn a_repost_after_the_rights_changed_fails_as_the_look_up_does() {
    let (seen, taken) = both(
        |r| {
            r.ring.rereg(Access::NONE).unwrap();
        },
        |r| format!("{:?}", recvs(&wait(&r.cqb, 4))),
    );
    assert_eq!(taken, 0);
    assert!(
        seen.contains("(0, LocalProtection, Recv, 0)") && seen.contains("state Error"),
        "{seen}"
    );
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
