//! Proxy QP offload: filtered messages served by a proxy handler,
//! completions in order, rollback, load protection, filter kinds, mismatch
//! errors.

#![allow(clippy::disallowed_methods)] // tests and benchmarks read the clock directly

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use common::{Side, mr, wait};
use softrdma_engine::loopback::connect_pair;
use softrdma_engine::proto::mpa::MpaConfig;
use softrdma_engine::proxy::{
    Criterion, Field, FilterEntry, HandlerError, MatchPolicy, Proxy, ProxyAttach, ProxyConfig,
    ProxyContext, ProxyFilter, ProxyMessage, ProxyOutcome, ProxySetupError,
};
use softrdma_engine::wire::rdmap::Opcode;
use softrdma_engine::{
    AsyncEventKind, CompletionQueue, Device, MemoryRegion, ProtectionDomain, QpInitAttr, QpState,
    QueuePair, RecvWr, SendOp, SendWr, WcFlags, WcOpcode, WcStatus, WorkCompletion,
};

const SLOT: usize = 256;

type Handler = Box<
    dyn FnMut(&mut ProxyContext<'_>, &ProxyMessage<'_>) -> Result<ProxyOutcome, HandlerError>
        + Send,
>;

/// A client (plain QP) connected to a server whose QP is a proxy QP.
struct Setup {
    dev: Device,
    proxy: Proxy,
    client: Side,
    server: Side,
    /// Server receive buffers (SLOT bytes per receive) and shared memory.
    srv_mr: MemoryRegion,
    /// Client receive buffers.
    cli_mr: MemoryRegion,
}

fn setup_with(
    cfg: ProxyConfig,
    filter: ProxyFilter,
    tweak: impl Fn(&mut QpInitAttr),
    handler: Handler,
) -> Setup {
    setup_full(cfg, filter, tweak, handler, false)
}

fn setup_full(
    cfg: ProxyConfig,
    filter: ProxyFilter,
    tweak: impl Fn(&mut QpInitAttr),
    handler: Handler,
    recycle: bool,
) -> Setup {
    let dev = common::device(false);
    let proxy = Proxy::start(&dev, cfg).expect("proxy");
    let client = common::side(&dev, |_| {});
    let pd = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::builder(&dev, 4096)
        .proxy(&proxy)
        .build()
        .expect("proxy cq");
    let mut attr = QpInitAttr::new(&cq, &cq);
    tweak(&mut attr);
    let mut attach = ProxyAttach::new(&proxy, filter, handler);
    if recycle {
        attach = attach.recycle_receives();
    }
    let qp = QueuePair::new_proxy(&pd, &attr, attach).expect("proxy qp");
    let server = Side { pd, cq, qp };
    connect_pair(&client.qp, &server.qp, &MpaConfig::default()).expect("connect");
    let srv_mr = mr(&server, SLOT * 1024);
    let cli_mr = mr(&client, SLOT * 1024);
    Setup {
        dev,
        proxy,
        client,
        server,
        srv_mr,
        cli_mr,
    }
}

fn setup(filter: ProxyFilter, handler: Handler) -> Setup {
    setup_with(ProxyConfig::default(), filter, |_| {}, handler)
}

impl Setup {
    fn post_server_recvs(&self, ids: std::ops::Range<u64>) {
        for i in ids {
            let sge = self
                .srv_mr
                .sge(i as usize % 512 * SLOT, SLOT as u32)
                .unwrap();
            self.server.qp.post_recv(&RecvWr::new(i, &[sge])).unwrap();
        }
    }

    fn post_client_recvs(&self, ids: std::ops::Range<u64>) {
        for i in ids {
            let sge = self
                .cli_mr
                .sge(i as usize % 512 * SLOT, SLOT as u32)
                .unwrap();
            self.client.qp.post_recv(&RecvWr::new(i, &[sge])).unwrap();
        }
    }

    fn send(&self, wr_id: u64, payload: &[u8]) {
        self.client
            .qp
            .post_send(&SendWr::new(wr_id, SendOp::Send).inline(payload))
            .unwrap();
    }
}

/// Payload starts with `b'L'`.
fn lock_filter() -> ProxyFilter {
    ProxyFilter::new(MatchPolicy::MatchesToProxy).entry(
        FilterEntry::any().and(Criterion::ternary(Field::Payload, 0, b"L", &[0xff]).unwrap()),
    )
}

fn done() -> Handler {
    Box::new(|_, _| Ok(ProxyOutcome::Done))
}

/// Asserts completions carry consecutive sequence numbers from `first`.
fn assert_in_sequence(wcs: &[WorkCompletion], first: u64) {
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(wc.proxy_seq, first + i as u64, "completion {i}: {wc:?}");
    }
}

/// No completion arrives within `d`.
fn assert_quiet(cq: &CompletionQueue, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        assert!(cq.poll_one().is_none(), "unexpected completion");
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn completions_stay_in_order_behind_a_slow_proxy() {
    // The handler sleeps a pseudo-random 0-2 ms per message: the messages
    // behind an offloaded one finish first on the application path and
    // must wait.
    let mut x: u32 = 0x1234_5678;
    let s = setup(
        lock_filter(),
        Box::new(move |_, msg| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            std::thread::sleep(Duration::from_micros(u64::from(x % 2000)));
            assert_eq!(msg.payload()[0], b'L');
            Ok(ProxyOutcome::Done)
        }),
    );
    const N: u64 = 200;
    s.post_server_recvs(0..N);
    let mut kinds = Vec::new();
    let mut y: u32 = 99;
    for i in 0..N {
        y = y.wrapping_mul(1_103_515_245).wrapping_add(12345);
        let lock = !(y >> 16).is_multiple_of(3);
        kinds.push(lock);
        let payload = format!("{}{i:08}", if lock { 'L' } else { 'U' });
        s.send(i, payload.as_bytes());
    }
    let wcs = wait(&s.server.cq, N as usize);
    assert_in_sequence(&wcs, 0);
    for (i, wc) in wcs.iter().enumerate() {
        assert_eq!(wc.wr_id, i as u64, "receives complete in message order");
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(wc.byte_len, 9);
        let want = if kinds[i] {
            WcOpcode::ProxyNoop
        } else {
            WcOpcode::Recv
        };
        assert_eq!(wc.opcode, want, "message {i}");
        if !kinds[i] {
            let mut b = [0u8; 9];
            s.srv_mr.read(i * SLOT, &mut b).unwrap();
            assert_eq!(b, format!("U{i:08}").as_bytes());
        }
    }
    let st = s.proxy.stats();
    let locks = kinds.iter().filter(|k| **k).count() as u64;
    assert_eq!(st.offloaded, locks);
    assert_eq!(st.passed_through, N - locks);
    assert!(st.reordered > 0, "a slow proxy must hold completions back");
    assert_eq!(st.queued, 0);
    assert!(s.server.cq.poll_one().is_none());
}

#[test]
fn lock_service_handler_replies_and_updates_shared_memory() {
    // Lock table: 8 words at offset 0 of a server region; the handler takes
    // lock K with a compare-and-swap and replies "G"(granted) or "B"(busy).
    let table: Arc<Mutex<Option<(u32, u64)>>> = Arc::new(Mutex::new(None));
    let t2 = Arc::clone(&table);
    let s = setup_with(
        ProxyConfig::default(),
        lock_filter(),
        |a| a.sq_sig_all = true,
        Box::new(move |ctx, msg| {
            let (lkey, base) = t2.lock().unwrap().expect("table");
            let p = msg.payload();
            let k = u64::from(p[1] - b'0');
            let owner = u64::from(p[2]);
            let prev = ctx.compare_swap(lkey, base + 8 * k, 0, owner)?;
            let reply = if prev == 0 { b"G" } else { b"B" };
            ctx.post_send(&SendWr::new(7, SendOp::Send).inline(reply))?;
            Ok(ProxyOutcome::Done)
        }),
    );
    *table.lock().unwrap() = Some((s.srv_mr.lkey(), s.srv_mr.addr() + 200 * SLOT as u64));
    s.post_server_recvs(0..4);
    s.post_client_recvs(0..4);
    s.send(0, &[b'L', b'3', 5]);
    s.send(1, &[b'L', b'3', 6]);
    s.send(2, b"U3:new value");
    s.send(3, &[b'L', b'4', 6]);
    let replies = wait(&s.client.cq, 3);
    let mut got = Vec::new();
    for wc in &replies {
        assert_eq!(wc.opcode, WcOpcode::Recv);
        let mut b = [0u8; 1];
        s.cli_mr.read(wc.wr_id as usize * SLOT, &mut b).unwrap();
        got.push(b[0]);
    }
    assert_eq!(got, b"GBG");
    let wcs = wait(&s.server.cq, 4);
    let ops: Vec<_> = wcs.iter().map(|w| w.opcode).collect();
    assert_eq!(
        ops,
        [
            WcOpcode::ProxyNoop,
            WcOpcode::ProxyNoop,
            WcOpcode::Recv,
            WcOpcode::ProxyNoop
        ]
    );
    // The replies' Send completions are the proxy's, even with
    // sq_sig_all: the application's CQ saw only the four receives.
    assert_quiet(&s.server.cq, Duration::from_millis(50));
    let mut w = [0u8; 8];
    s.srv_mr.read(200 * SLOT + 24, &mut w).unwrap();
    assert_eq!(u64::from_ne_bytes(w), 5, "lock 3 owned by client 5");
    s.srv_mr.read(200 * SLOT + 32, &mut w).unwrap();
    assert_eq!(u64::from_ne_bytes(w), 6, "lock 4 owned by client 6");
    let st = s.proxy.stats();
    assert_eq!(st.replies_posted, 3);
    assert_eq!(st.reply_errors, 0);
}

#[test]
fn handler_failure_and_decline_roll_back_every_effect() {
    // Byte 1 of the payload picks the ending: 'e' error, 'p' panic, 'n'
    // not handled, 'd' done. Each handler first writes, adds, swaps and
    // posts a reply.
    let region: Arc<Mutex<Option<(u32, u64)>>> = Arc::new(Mutex::new(None));
    let r2 = Arc::clone(&region);
    let s = setup(
        lock_filter(),
        Box::new(move |ctx, msg| {
            let (lkey, base) = r2.lock().unwrap().expect("region");
            ctx.write(lkey, base, b"scribbled")?;
            ctx.fetch_add(lkey, base + 16, 1000)?;
            ctx.compare_swap(lkey, base + 24, 0, 77)?;
            ctx.post_send(&SendWr::new(1, SendOp::Send).inline(b"reply"))?;
            assert_eq!(ctx.recorded_effects(), 3);
            match msg.payload()[1] {
                b'e' => Err(HandlerError::failed("lookup failed")),
                b'p' => panic!("handler bug"),
                b'n' => Ok(ProxyOutcome::NotHandled),
                _ => Ok(ProxyOutcome::Done),
            }
        }),
    );
    let base = s.srv_mr.addr() + 300 * SLOT as u64;
    *region.lock().unwrap() = Some((s.srv_mr.lkey(), base));
    let before = {
        let mut b = vec![0u8; 32];
        s.srv_mr
            .write(300 * SLOT, b"original-bytes-and-counters....")
            .unwrap();
        s.srv_mr.read(300 * SLOT, &mut b).unwrap();
        b[24..32].copy_from_slice(&0u64.to_ne_bytes());
        s.srv_mr.write(300 * SLOT, &b).unwrap();
        b
    };
    s.post_server_recvs(0..4);
    s.post_client_recvs(0..4);
    for (i, kind) in [b'e', b'p', b'n'].into_iter().enumerate() {
        s.send(i as u64, &[b'L', kind]);
    }
    let wcs = wait(&s.server.cq, 3);
    assert_in_sequence(&wcs, 0);
    for wc in &wcs {
        // Processed as if never matched: a normal receive with the bytes.
        assert_eq!(wc.opcode, WcOpcode::Recv);
        assert_eq!(wc.status, WcStatus::Success);
        assert_eq!(wc.byte_len, 2);
    }
    let mut after = vec![0u8; 32];
    s.srv_mr.read(300 * SLOT, &mut after).unwrap();
    assert_eq!(after, before, "writes and atomics rolled back");
    // No reply of a failed or declined handler ever left.
    assert_quiet(&s.client.cq, Duration::from_millis(50));
    let st = s.proxy.stats();
    assert_eq!((st.failed, st.declined, st.offloaded), (2, 1, 0));
    assert_eq!(st.rolled_back, 9);
    assert_eq!(st.rollback_conflicts, 0);
    let why = s.proxy.last_failure().unwrap();
    assert!(why.contains("handler bug"), "{why}");
    // The proxy still serves after a panic; a done handler keeps effects.
    s.send(3, b"Ld");
    let wc = wait(&s.server.cq, 1)[0];
    assert_eq!(wc.opcode, WcOpcode::ProxyNoop);
    assert_eq!(wc.proxy_seq, 3);
    let r = wait(&s.client.cq, 1)[0];
    assert_eq!((r.opcode, r.byte_len), (WcOpcode::Recv, 5));
    s.srv_mr.read(300 * SLOT, &mut after).unwrap();
    assert_eq!(&after[..9], b"scribbled");
    assert_eq!(u64::from_ne_bytes(after[16..24].try_into().unwrap()), {
        u64::from_ne_bytes(before[16..24].try_into().unwrap()).wrapping_add(1000)
    });
    assert_eq!(u64::from_ne_bytes(after[24..32].try_into().unwrap()), 77);
}

#[test]
fn handler_memory_access_is_checked() {
    let other_pd_key = Arc::new(AtomicU64::new(0));
    let k2 = Arc::clone(&other_pd_key);
    let errors = Arc::new(Mutex::new(Vec::new()));
    let e2 = Arc::clone(&errors);
    let s = setup(
        lock_filter(),
        Box::new(move |ctx, msg| {
            let key = k2.load(Ordering::SeqCst) as u32;
            let mut b = [0u8; 4];
            // A region of another protection domain.
            let r1 = ctx.read(key, 0, &mut b).map(|_| ());
            // An unaligned atomic in the QP's own receive buffer region.
            let r2 = ctx.fetch_add(u32::MAX, 1, 1).map(|_| ());
            e2.lock()
                .unwrap()
                .push((r1.unwrap_err().to_string(), r2.unwrap_err().to_string()));
            let _ = msg;
            Ok(ProxyOutcome::Done)
        }),
    );
    let foreign = common::mr(&s.client, 64);
    other_pd_key.store(u64::from(foreign.lkey()), Ordering::SeqCst);
    s.post_server_recvs(0..1);
    s.send(0, b"L");
    assert_eq!(wait(&s.server.cq, 1)[0].opcode, WcOpcode::ProxyNoop);
    let e = errors.lock().unwrap();
    assert!(e[0].0.contains("another protection domain"), "{e:?}");
    assert!(e[0].1.contains("invalid lkey"), "{e:?}");
}

#[test]
fn partial_outcome_flags_the_normal_completion() {
    let s = setup(
        lock_filter(),
        Box::new(|_, msg| {
            Ok(ProxyOutcome::Partial {
                note: 0xabc0 + msg.len() as u64,
            })
        }),
    );
    s.post_server_recvs(0..2);
    s.send(0, b"Lpart");
    s.send(1, b"Uother");
    let wcs = wait(&s.server.cq, 2);
    assert_in_sequence(&wcs, 0);
    assert_eq!(wcs[0].opcode, WcOpcode::Recv);
    assert!(wcs[0].flags.contains(WcFlags::PROXY_PARTIAL));
    assert_eq!(wcs[0].proxy_note, 0xabc5);
    assert!(!wcs[1].flags.contains(WcFlags::PROXY_PARTIAL));
    assert_eq!(s.proxy.stats().partial, 1);
}

#[test]
fn no_offload_mode_entered_above_depth_and_left_when_caught_up() {
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let s = setup_with(
        ProxyConfig::default().max_queue(2),
        lock_filter(),
        |_| {},
        Box::new(move |_, _| {
            release_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .map_err(HandlerError::failed)?;
            Ok(ProxyOutcome::Done)
        }),
    );
    s.post_server_recvs(0..8);
    for i in 0..6 {
        s.send(i, b"Lock");
    }
    // Two messages are queued at the proxy; the other four matched but
    // went to the application (held behind the first two).
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.proxy.stats().no_offload_passed < 4 {
        assert!(Instant::now() < deadline, "{:?}", s.proxy.stats());
        std::thread::sleep(Duration::from_millis(1));
    }
    let st = s.proxy.stats();
    assert!(st.no_offload && s.proxy.is_no_offload());
    assert_eq!(st.no_offload_entries, 1);
    assert_eq!(st.queued, 2);
    assert_eq!(st.max_queued, 2);
    assert!(s.server.cq.poll_one().is_none(), "held behind the proxy");
    std::thread::sleep(Duration::from_millis(20));
    release_tx.send(()).unwrap();
    release_tx.send(()).unwrap();
    let wcs = wait(&s.server.cq, 6);
    assert_in_sequence(&wcs, 0);
    let ops: Vec<_> = wcs.iter().map(|w| w.opcode).collect();
    assert_eq!(&ops[..2], [WcOpcode::ProxyNoop; 2]);
    assert_eq!(&ops[2..], [WcOpcode::Recv; 4]);
    let st = s.proxy.stats();
    assert!(!st.no_offload, "the proxy caught up");
    assert!(st.no_offload_time >= Duration::from_millis(20), "{st:?}");
    // Offloading resumes.
    s.send(6, b"Lock");
    release_tx.send(()).unwrap();
    assert_eq!(wait(&s.server.cq, 1)[0].opcode, WcOpcode::ProxyNoop);
    let st = s.proxy.stats();
    assert_eq!((st.offloaded, st.no_offload_entries), (3, 1));
}

/// Runs one message through `filter` and says whether the proxy got it.
fn offloaded(filter: ProxyFilter, post: impl FnOnce(&Setup)) -> bool {
    let s = setup(filter, done());
    s.post_server_recvs(0..1);
    post(&s);
    let wc = wait(&s.server.cq, 1)[0];
    assert_eq!(wc.status, WcStatus::Success);
    wc.opcode == WcOpcode::ProxyNoop
}

fn to_proxy(e: FilterEntry) -> ProxyFilter {
    ProxyFilter::new(MatchPolicy::MatchesToProxy).entry(e)
}

#[test]
fn filter_on_opcode() {
    let f =
        || to_proxy(FilterEntry::any().and(Criterion::opcodes(&[Opcode::SendWithSolicitedEvent])));
    assert!(!offloaded(f(), |s| s.send(0, b"x")));
    assert!(offloaded(f(), |s| {
        s.client
            .qp
            .post_send(
                &SendWr::new(0, SendOp::Send)
                    .inline(b"x")
                    .flags(softrdma_engine::SendFlags::SOLICITED),
            )
            .unwrap();
    }));
}

#[test]
fn filter_on_payload_size() {
    let f = || to_proxy(FilterEntry::any().and(Criterion::payload_at_most(8)));
    assert!(offloaded(f(), |s| s.send(0, b"12345678")));
    assert!(!offloaded(f(), |s| s.send(0, b"123456789")));
    assert!(offloaded(f(), |s| s.send(0, b"")));
}

#[test]
fn filter_on_header_value_and_mask() {
    // Byte 1 of the DDP/RDMAP header is the RDMAP control byte: version 1
    // and the opcode in the low four bits (Send = 3).
    let f = || {
        to_proxy(
            FilterEntry::any().and(Criterion::ternary(Field::Header, 1, &[0x43], &[0xcf]).unwrap()),
        )
    };
    assert!(offloaded(f(), |s| s.send(0, b"any")));
    // Send with Solicited Event (opcode 5) differs under the mask.
    assert!(!offloaded(f(), |s| {
        s.client
            .qp
            .post_send(
                &SendWr::new(0, SendOp::Send)
                    .inline(b"any")
                    .flags(softrdma_engine::SendFlags::SOLICITED),
            )
            .unwrap();
    }));
}

#[test]
fn filter_on_payload_value_and_mask_past_the_first_segment_byte() {
    // Bytes 4..6 of the payload equal 0xBEEF, high nibble of byte 6 ignored.
    let f = || {
        to_proxy(
            FilterEntry::any().and(
                Criterion::ternary(Field::Payload, 4, &[0xbe, 0xef, 0x50], &[0xff, 0xff, 0x0f])
                    .unwrap(),
            ),
        )
    };
    assert!(offloaded(f(), |s| s.send(0, &[0, 0, 0, 0, 0xbe, 0xef, 0xa0])));
    assert!(!offloaded(f(), |s| s.send(0, &[0, 0, 0, 0, 0xbe, 0xef, 0xa1])));
    // Too short: byte 6 is under a non-zero mask.
    assert!(!offloaded(f(), |s| s.send(0, &[0, 0, 0, 0, 0xbe, 0xef])));
}

#[test]
fn matches_stay_policy_offloads_the_rest() {
    let f = || {
        ProxyFilter::new(MatchPolicy::MatchesStay)
            .entry(FilterEntry::any().and(Criterion::payload_at_least(100)))
    };
    assert!(offloaded(f(), |s| s.send(0, b"small")));
    assert!(!offloaded(f(), |s| {
        let src = common::mr(&s.client, 200);
        let sge = src.sge(0, 200).unwrap();
        s.client
            .qp
            .post_send(&SendWr::new(0, SendOp::Send).sg_list(&[sge]))
            .unwrap();
        std::mem::forget(src);
    }));
}

/// A Write with Immediate into the server region at `offset`.
fn write_imm(s: &Setup, offset: usize, data: &[u8], imm: u32) {
    let src = common::mr(&s.client, data.len().max(1));
    src.write(0, data).unwrap();
    let sge = src.sge(0, data.len() as u32).unwrap();
    s.client
        .qp
        .post_send(
            &SendWr::new(
                0,
                SendOp::WriteWithImm {
                    remote_addr: s.srv_mr.addr() + offset as u64,
                    rkey: s.srv_mr.rkey(),
                    imm,
                },
            )
            .sg_list(&[sge]),
        )
        .unwrap();
    // The posted request holds the memory; the region handle may go.
}

#[test]
fn write_with_immediate_filtered_by_stag_and_address_and_seen_by_the_handler() {
    let seen = Arc::new(Mutex::new(None));
    let seen2 = Arc::clone(&seen);
    let s = setup(
        ProxyFilter::new(MatchPolicy::MatchesToProxy).entry(
            FilterEntry::any()
                .and(Criterion::opcodes(&[Opcode::RdmaWrite]))
                .and(Criterion::ternary(Field::Payload, 0, b"W", &[0xff]).unwrap()),
        ),
        Box::new(move |_, msg| {
            *seen2.lock().unwrap() = Some((
                msg.payload(),
                msg.immediate(),
                msg.stag(),
                msg.tagged_offset(),
                msg.header().len(),
            ));
            Ok(ProxyOutcome::Done)
        }),
    );
    s.post_server_recvs(0..2);
    let data = common::pattern(3000, 9);
    let mut data = data;
    data[0] = b'W';
    write_imm(&s, 4096, &data, 0x1234);
    let wc = wait(&s.server.cq, 1)[0];
    assert_eq!(wc.opcode, WcOpcode::ProxyNoop);
    assert_eq!(wc.imm_data, 0x1234);
    let (payload, imm, stag, to, hlen) = seen.lock().unwrap().take().unwrap();
    assert_eq!(payload, data, "the handler reads the written bytes");
    assert_eq!(imm, Some(0x1234));
    assert_eq!(stag, Some(s.srv_mr.rkey()));
    assert_eq!(to, Some(s.srv_mr.addr() + 4096));
    assert_eq!(hlen, 14, "tagged DDP/RDMAP header");
    // Not starting with 'W': the application gets it.
    write_imm(&s, 8192, b"Xyz", 7);
    let wc = wait(&s.server.cq, 1)[0];
    assert_eq!(
        (wc.opcode, wc.byte_len, wc.imm_data),
        (WcOpcode::RecvRdmaWithImm, 0, 7)
    );

    // STag and address ranges.
    let rkey_filter = |first: u32, last: u32| {
        to_proxy(FilterEntry::any().and(Criterion::stags(first, last).unwrap()))
    };
    let check = |f: ProxyFilter, off: usize| offloaded(f, |s| write_imm(s, off, b"abc", 1));
    assert!(check(rkey_filter(0, u32::MAX), 0));
    assert!(!check(rkey_filter(0, 0), 0));
    // Address window: the first 4 KiB of a server region.
    let s2 = {
        // The filter needs the region's address: register it first.
        let dev = common::device(false);
        let proxy = Proxy::start(&dev, ProxyConfig::default()).unwrap();
        let pd = ProtectionDomain::new(&dev);
        let srv_mr = pd
            .register(
                64 * 1024,
                softrdma_engine::Access::LOCAL_WRITE | softrdma_engine::Access::REMOTE_WRITE,
            )
            .unwrap();
        let lo = srv_mr.addr();
        let f = to_proxy(FilterEntry::any().and(Criterion::addresses(lo, lo + 4095).unwrap()));
        let cq = CompletionQueue::builder(&dev, 64)
            .proxy(&proxy)
            .build()
            .unwrap();
        let qp = QueuePair::new_proxy(
            &pd,
            &QpInitAttr::new(&cq, &cq),
            ProxyAttach::new(&proxy, f, |_, _| Ok(ProxyOutcome::Done)),
        )
        .unwrap();
        let client = common::side(&dev, |_| {});
        connect_pair(&client.qp, &qp, &MpaConfig::default()).unwrap();
        let rbuf = common::mr(
            &Side {
                pd: pd.clone(),
                cq: cq.clone(),
                qp: qp.clone(),
            },
            4096,
        );
        for i in 0..3 {
            qp.post_recv(&RecvWr::new(i, &[rbuf.sge(0, 64).unwrap()]))
                .unwrap();
        }
        (dev, proxy, client, cq, qp, srv_mr, rbuf)
    };
    let (_dev, _proxy, client, cq, _qp, srv_mr, _rbuf) = &s2;
    let src = common::mr(client, 16);
    let sge = src.sge(0, 16).unwrap();
    for (i, off) in [0u64, 4080, 4081].into_iter().enumerate() {
        client
            .qp
            .post_send(
                &SendWr::new(
                    i as u64,
                    SendOp::WriteWithImm {
                        remote_addr: srv_mr.addr() + off,
                        rkey: srv_mr.rkey(),
                        imm: 0,
                    },
                )
                .sg_list(&[sge]),
            )
            .unwrap();
    }
    let ops: Vec<_> = wait(cq, 3).iter().map(|w| w.opcode).collect();
    // [0, 16) and [4080, 4096) lie inside; [4081, 4097) crosses the end.
    assert_eq!(
        ops,
        [
            WcOpcode::ProxyNoop,
            WcOpcode::ProxyNoop,
            WcOpcode::RecvRdmaWithImm
        ]
    );
}

#[test]
fn send_with_invalidate_matched_by_its_stag() {
    let s = setup(
        to_proxy(FilterEntry::any().and(Criterion::stags(1, u32::MAX).unwrap())),
        done(),
    );
    let mw_region = common::mr(&s.server, 64);
    s.post_server_recvs(0..2);
    s.send(0, b"plain send has no stag");
    s.client
        .qp
        .post_send(
            &SendWr::new(
                1,
                SendOp::SendWithInv {
                    invalidate_rkey: mw_region.rkey(),
                },
            )
            .inline(b"inv"),
        )
        .unwrap();
    let wcs = wait(&s.server.cq, 2);
    assert_eq!(wcs[0].opcode, WcOpcode::Recv);
    // Invalidating a region's STag fails (only windows/fast-reg regions
    // can be invalidated remotely): the message is not offloaded, its
    // error completion passes through the sequencer in order.
    assert_eq!(wcs[1].proxy_seq, 1);
}

#[test]
fn proxy_qp_needs_proxy_cqs_of_its_proxy() {
    let dev = common::device(false);
    let proxy = Proxy::start(&dev, ProxyConfig::default()).unwrap();
    let other = Proxy::start(&dev, ProxyConfig::default()).unwrap();
    let pd = ProtectionDomain::new(&dev);
    let plain = CompletionQueue::new(&dev, 16, None).unwrap();
    let mine = CompletionQueue::builder(&dev, 16)
        .proxy(&proxy)
        .build()
        .unwrap();
    let theirs = CompletionQueue::builder(&dev, 16)
        .proxy(&other)
        .build()
        .unwrap();
    assert_eq!(mine.proxy_id(), Some(proxy.id()));
    assert_eq!(plain.proxy_id(), None);
    let attach = || {
        ProxyAttach::new(&proxy, ProxyFilter::default(), |_, _| {
            Ok(ProxyOutcome::Done)
        })
    };

    let e = QueuePair::new_proxy(&pd, &QpInitAttr::new(&plain, &mine), attach()).unwrap_err();
    assert!(
        matches!(
            e,
            softrdma_engine::qp::CreateQpError::Proxy(ProxySetupError::CqNotProxy {
                queue: "send",
                found: None,
                ..
            })
        ),
        "{e}"
    );
    let qp = QueuePair::new(&pd, &QpInitAttr::new(&mine, &theirs)).unwrap();
    let e = qp.attach_proxy(attach()).unwrap_err();
    assert!(
        matches!(e, ProxySetupError::CqNotProxy { queue: "receive", found: Some(id), .. } if id == other.id()),
        "{e}"
    );
    assert!(!qp.is_proxy());

    let qp = QueuePair::new(&pd, &QpInitAttr::new(&mine, &mine)).unwrap();
    qp.attach_proxy(attach()).unwrap();
    assert!(matches!(
        qp.attach_proxy(attach()),
        Err(ProxySetupError::AlreadyProxy { .. })
    ));

    // Only in IDLE.
    let client = common::side(&dev, |_| {});
    let srv = QueuePair::new(&pd, &QpInitAttr::new(&mine, &mine)).unwrap();
    connect_pair(&client.qp, &srv, &MpaConfig::default()).unwrap();
    assert!(matches!(
        srv.attach_proxy(attach()),
        Err(ProxySetupError::NotIdle {
            state: QpState::Rts,
            ..
        })
    ));

    // A stopped proxy takes no new QPs.
    other.shutdown();
    let q2 = QueuePair::new(&pd, &QpInitAttr::new(&theirs, &theirs)).unwrap();
    let e = q2
        .attach_proxy(ProxyAttach::new(&other, ProxyFilter::default(), |_, _| {
            Ok(ProxyOutcome::Done)
        }))
        .unwrap_err();
    assert_eq!(e, ProxySetupError::ProxyStopped(other.id()));
}

#[test]
fn message_for_a_stopped_proxy_is_discarded_with_an_error_event() {
    let s = setup(lock_filter(), done());
    s.post_server_recvs(0..4);
    s.send(0, b"Lfirst");
    assert_eq!(wait(&s.server.cq, 1)[0].opcode, WcOpcode::ProxyNoop);
    s.proxy.shutdown();
    assert!(!s.proxy.is_running());
    s.send(1, b"Lsecond");
    s.send(2, b"Uthird");
    let wcs = wait(&s.server.cq, 2);
    assert_in_sequence(&wcs, 1);
    assert_eq!(wcs[0].status, WcStatus::ProxyDiscarded);
    assert_eq!(wcs[0].wr_id, 1);
    assert_eq!(wcs[1].status, WcStatus::Success);
    assert_eq!(wcs[1].opcode, WcOpcode::Recv);
    let ev = s
        .dev
        .async_events()
        .get(Some(Duration::from_secs(5)))
        .into_iter()
        .chain(std::iter::from_fn(|| s.dev.async_events().try_get()))
        .find(|e| e.kind == AsyncEventKind::ProxyMismatch)
        .expect("mismatch event");
    assert_eq!(ev.qp_num, Some(s.server.qp.qp_num()));
    assert_eq!(s.proxy.stats().mismatched, 1);
    // The QP keeps working.
    assert_eq!(s.server.qp.state(), QpState::Rts);
}

#[test]
fn send_completions_of_a_proxy_qp_wait_behind_an_offloaded_message() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = Mutex::new(go_rx);
    let s = setup(
        lock_filter(),
        Box::new(move |_, _| {
            go_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .map_err(HandlerError::failed)?;
            Ok(ProxyOutcome::Done)
        }),
    );
    s.post_server_recvs(0..1);
    s.post_client_recvs(0..1);
    s.send(0, b"Lwait");
    // Let the message reach the proxy, then complete a Send of the server.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.proxy.stats().queued == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    s.server
        .qp
        .post_send(&SendWr::new(42, SendOp::Send).inline(b"hi").signaled())
        .unwrap();
    assert_eq!(wait(&s.client.cq, 1)[0].byte_len, 2);
    assert_quiet(&s.server.cq, Duration::from_millis(30));
    go_tx.send(()).unwrap();
    let wcs = wait(&s.server.cq, 2);
    assert_in_sequence(&wcs, 0);
    assert_eq!(wcs[0].opcode, WcOpcode::ProxyNoop);
    assert_eq!((wcs[1].opcode, wcs[1].wr_id), (WcOpcode::Send, 42));
}

#[test]
fn flushed_receives_of_a_proxy_qp_keep_their_order() {
    let s = setup(
        lock_filter(),
        Box::new(|_, _| {
            std::thread::sleep(Duration::from_millis(30));
            Ok(ProxyOutcome::Done)
        }),
    );
    s.post_server_recvs(0..4);
    s.send(0, b"Lslow");
    let deadline = Instant::now() + Duration::from_secs(10);
    // `queued` is non-zero only while the handler runs (30 ms): a test
    // thread descheduled for longer on a busy machine used to miss it and
    // wait here forever. `max_queued` says the message got there; the
    // abort then usually comes while it is still with the proxy.
    while s.proxy.stats().max_queued == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    s.server.qp.abort();
    let wcs = wait(&s.server.cq, 4);
    assert_in_sequence(&wcs, 0);
    assert_eq!(wcs[0].opcode, WcOpcode::ProxyNoop);
    for (i, wc) in wcs[1..].iter().enumerate() {
        assert_eq!((wc.wr_id, wc.status), (i as u64 + 1, WcStatus::WrFlush));
    }
}

#[test]
fn recycled_receives_keep_offloaded_traffic_flowing_without_the_application() {
    let s = setup_full(ProxyConfig::default(), lock_filter(), |_| {}, done(), true);
    // Two receives for 50 offloaded messages: the proxy reposts each
    // buffer it is done with.
    s.post_server_recvs(0..2);
    for i in 0..50 {
        s.send(i, format!("L{i}").as_bytes());
        let wc = wait(&s.server.cq, 1)[0];
        assert_eq!(wc.opcode, WcOpcode::ProxyNoop);
        assert!(wc.flags.contains(WcFlags::PROXY_RECYCLED), "{wc:?}");
        assert_eq!(wc.wr_id, i % 2, "buffers used round robin");
        assert_eq!(wc.proxy_seq, i);
    }
    // A message for the application still finds a buffer, and its
    // completion is not flagged.
    s.send(50, b"Update");
    let wc = wait(&s.server.cq, 1)[0];
    assert_eq!((wc.opcode, wc.status), (WcOpcode::Recv, WcStatus::Success));
    assert!(!wc.flags.contains(WcFlags::PROXY_RECYCLED));
    assert_eq!(s.server.qp.state(), QpState::Rts);
}
