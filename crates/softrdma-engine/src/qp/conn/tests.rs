//! The engine around the core against the core alone: the same work
//! requests through a connected engine QP pair (sockets, threads,
//! placement, the conversions of `qp::conn`) and through a pair of bare
//! protocol-core `Connection`s over the same device's STag table must give
//! the same completions and the same memory. (Until the engine's own data
//! path was deleted the QP pair ran that path.)

use std::time::{Duration, Instant};

use softrdma_proto::conn::{Connection, TxFpdu};
use softrdma_proto::mpa::{CrcPolicy, MpaConfig};

use super::*;
use crate::mr::PdMemory;
use crate::state::QpState;
use crate::{
    Access, CompletionQueue, Device, DeviceConfig, MemoryRegion, ProtectionDomain, QpInitAttr,
    QueuePair,
};

fn device() -> Device {
    Device::open_with(DeviceConfig {
        pin_threads: false,
        ..DeviceConfig::default()
    })
    .unwrap()
}

fn all_access() -> Access {
    Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC
}

/// The regions of one run: `src` at the requester, `dst` (target of
/// Writes, Reads and atomics) and `rbuf` (receives) at the responder.
struct Regions {
    src: MemoryRegion,
    dst: MemoryRegion,
    rbuf: MemoryRegion,
}

fn regions(req: &ProtectionDomain, resp: &ProtectionDomain, data: &[u8]) -> Regions {
    let r = Regions {
        src: req.register(4096, all_access()).unwrap(),
        dst: resp.register(4096, all_access()).unwrap(),
        rbuf: resp.register(5 * 64, Access::LOCAL_WRITE).unwrap(),
    };
    r.src.write(0, data).unwrap();
    r.dst.write(0, &42u64.to_ne_bytes()).unwrap();
    r
}

fn sge(mr: &MemoryRegion, at: u64, len: u32) -> Sge {
    Sge {
        addr: mr.addr() + at,
        length: len,
        lkey: mr.lkey(),
    }
}

/// The SGEs of the scenario (they must outlive the work requests).
struct Sges {
    write: [Sge; 1],
    small: [Sge; 1],
    send: [Sge; 1],
    sink: [Sge; 1],
    fa: [Sge; 1],
    cas: [Sge; 1],
    two: [Sge; 2],
    recv: Vec<[Sge; 1]>,
}

fn sges(r: &Regions) -> Sges {
    Sges {
        write: [sge(&r.src, 0, 3000)],
        small: [sge(&r.src, 0, 100)],
        send: [sge(&r.src, 0, 16)],
        sink: [sge(&r.src, 3008, 100)],
        fa: [sge(&r.src, 4088, 8)],
        cas: [sge(&r.src, 4080, 8)],
        two: [sge(&r.src, 0, 8), sge(&r.src, 8, 8)],
        recv: (0..5).map(|i| [sge(&r.rbuf, i * 64, 64)]).collect(),
    }
}

/// Every data operation, signaled and not, with Immediate Data, inline,
/// solicited and fenced: 9 requests, 8 signaled; 5 receives, 4 used.
fn scenario<'a>(s: &'a Sges, dst: &MemoryRegion) -> (Vec<SendWr<'a>>, Vec<RecvWr<'a>>) {
    let (rkey, at) = (dst.rkey(), dst.addr());
    let sends = vec![
        SendWr::new(
            1,
            SendOp::Write {
                remote_addr: at + 8,
                rkey,
            },
        )
        .sg_list(&s.write)
        .signaled(),
        SendWr::new(
            2,
            SendOp::Write {
                remote_addr: at + 3100,
                rkey,
            },
        )
        .sg_list(&s.small),
        SendWr::new(
            3,
            SendOp::WriteWithImm {
                remote_addr: at + 3200,
                rkey,
                imm: 0x1234,
            },
        )
        .sg_list(&s.small)
        .flags(SendFlags::SIGNALED | SendFlags::SOLICITED),
        SendWr::new(4, SendOp::Send).sg_list(&s.send).signaled(),
        SendWr::new(5, SendOp::SendWithImm { imm: 77 })
            .sg_list(&s.send)
            .signaled(),
        SendWr::new(6, SendOp::Send)
            .inline(b"inline-10!")
            .signaled(),
        SendWr::new(
            7,
            SendOp::Read {
                remote_addr: at + 8,
                rkey,
            },
        )
        .sg_list(&s.sink)
        .signaled(),
        SendWr::new(
            8,
            SendOp::FetchAdd {
                remote_addr: at,
                rkey,
                add: 5,
            },
        )
        .sg_list(&s.fa)
        .signaled(),
        SendWr::new(
            9,
            SendOp::CmpSwap {
                remote_addr: at,
                rkey,
                compare: 47,
                swap: 99,
            },
        )
        .sg_list(&s.cas)
        .flags(SendFlags::SIGNALED | SendFlags::FENCE),
    ];
    let recvs = s
        .recv
        .iter()
        .enumerate()
        .map(|(i, g)| RecvWr::new(100 + i as u64, g))
        .collect();
    (sends, recvs)
}

/// Completions without what differs between the two runs (QP numbers;
/// the invalidated STag, random in each run: the flag stays).
fn normal(mut v: Vec<WorkCompletion>) -> Vec<WorkCompletion> {
    for wc in &mut v {
        wc.qp_num = 0;
        wc.invalidated_rkey = 0;
    }
    v
}

fn wait(cq: &CompletionQueue, n: usize) -> Vec<WorkCompletion> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
    while out.len() < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions",
            out.len()
        );
        let k = cq.poll(&mut buf);
        out.extend_from_slice(&buf[..k]);
        if k == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    out
}

/// Moves every FPDU `from` has to `to` (copying mode); FPDUs moved.
fn pump(
    from: &mut Connection<Arc<Memory>>,
    fm: &mut PdMemory<'_>,
    to: &mut Connection<Arc<Memory>>,
    tm: &mut PdMemory<'_>,
) -> usize {
    let mut fpdu = TxFpdu::new();
    let mut bytes = Vec::new();
    let mut n = 0;
    while from.poll_transmit(fm, &mut fpdu) {
        assert!(fpdu.write_to(fm, &mut bytes));
        n += 1;
    }
    from.handle_sent(n);
    // A receiver that stopped reading (after a Terminate) leaves the rest.
    let read = to.handle_rx_stream(&bytes, tm);
    assert!(
        read == bytes.len() || matches!(to.rx_want(), softrdma_proto::conn::RxWant::Closed),
        "{read} of {} bytes read",
        bytes.len()
    );
    n
}

fn setup(cap: QpCap) -> ConnSetup {
    ConnSetup {
        cap,
        ird: 16,
        ord: 16,
        max_payload: 1024,
        srq: false,
        message_info: false,
        keep_recvs: false,
        close_timeout: 5_000_000_000,
    }
}

fn crc_link() -> LinkParams {
    LinkParams {
        crc: true,
        ..LinkParams::default()
    }
}

#[test]
fn core_matches_engine_on_every_data_operation() {
    let dev = device();
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7 + 3) as u8).collect();

    // The engine's data path over a loopback connection.
    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    let cqa = CompletionQueue::new(&dev, 64, None).unwrap();
    let cqb = CompletionQueue::new(&dev, 64, None).unwrap();
    let qa = QueuePair::new(&pa, &QpInitAttr::new(&cqa, &cqa)).unwrap();
    let qb = QueuePair::new(&pb, &QpInitAttr::new(&cqb, &cqb)).unwrap();
    crate::loopback::connect_pair(
        &qa,
        &qb,
        &MpaConfig {
            crc: CrcPolicy::Required,
            ..MpaConfig::default()
        },
    )
    .unwrap();
    let er = regions(&pa, &pb, &data);
    let es = sges(&er);
    let (sends, recvs) = scenario(&es, &er.dst);
    for r in &recvs {
        qb.post_recv(r).unwrap();
    }
    qa.post_send_list(&sends).unwrap();
    let engine_a = normal(wait(&cqa, 8));
    let engine_b = normal(wait(&cqb, 4));

    // The protocol core through the conversions, over the same STag table.
    let (pc, pd) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    let cr = regions(&pc, &pd, &data);
    let cs = sges(&cr);
    let (sends, recvs) = scenario(&cs, &cr.dst);
    let cfg = config(&setup(QpCap::default()), &crc_link());
    let (mut a, mut b) = (ConnState::new(cfg).conn, ConnState::new(cfg).conn);
    let mut ma = PdMemory::new(dev.stags(), pc.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pd.id(), None);
    for r in &recvs {
        with_core_recv(r, |w| b.post_recv(w, &mut mb)).unwrap();
    }
    for w in &sends {
        with_core_send(w, false, dev.stags(), |w| a.post_send(w, &mut ma)).unwrap();
    }
    while pump(&mut a, &mut ma, &mut b, &mut mb) + pump(&mut b, &mut mb, &mut a, &mut ma) > 0 {}
    let core_a = normal(
        std::iter::from_fn(|| a.poll_completion())
            .map(|c| work_completion(&c, 0))
            .collect(),
    );
    let core_b = normal(
        std::iter::from_fn(|| b.poll_completion())
            .map(|c| work_completion(&c, 0))
            .collect(),
    );

    assert_eq!(core_a, engine_a, "requester completions");
    assert_eq!(core_b, engine_b, "responder completions");
    assert_eq!(engine_a.len(), 8);
    assert!(engine_a.iter().all(|wc| wc.status == WcStatus::Success));
    assert_eq!(cr.dst.to_vec(), er.dst.to_vec(), "responder memory");
    assert_eq!(cr.rbuf.to_vec(), er.rbuf.to_vec(), "received Sends");
    assert_eq!(cr.src.to_vec(), er.src.to_vec(), "Read and atomic results");
    assert_eq!(
        er.dst.to_vec()[..8],
        99u64.to_ne_bytes(),
        "42 + 5, then swapped"
    );
}

#[test]
fn core_matches_engine_on_refused_posts() {
    let dev = device();
    let pa = ProtectionDomain::new(&dev);
    let cq = CompletionQueue::new(&dev, 64, None).unwrap();
    let qa = QueuePair::new(&pa, &QpInitAttr::new(&cq, &cq)).unwrap();
    let qb = QueuePair::new(&pa, &QpInitAttr::new(&cq, &cq)).unwrap();
    crate::loopback::connect_pair(&qa, &qb, &MpaConfig::default()).unwrap();
    let r = regions(&pa, &pa, &[1; 64]);
    let s = sges(&r);
    let five = [sge(&r.src, 0, 8); 5];
    let rkey = r.dst.rkey();
    let cases = [
        // More SGEs than the QP allows.
        SendWr::new(1, SendOp::Send).sg_list(&five),
        // Inline payload beyond `max_inline_data`.
        SendWr::new(2, SendOp::Send).inline(&[0; 65]),
        // A Read needs exactly one sink.
        SendWr::new(
            3,
            SendOp::Read {
                remote_addr: r.dst.addr(),
                rkey,
            },
        )
        .sg_list(&s.two),
        // An atomic needs one 8-byte sink, at an aligned remote address.
        SendWr::new(
            4,
            SendOp::FetchAdd {
                remote_addr: r.dst.addr(),
                rkey,
                add: 1,
            },
        )
        .sg_list(&s.small),
        SendWr::new(
            5,
            SendOp::CmpSwap {
                remote_addr: r.dst.addr() + 4,
                rkey,
                compare: 0,
                swap: 1,
            },
        )
        .sg_list(&s.fa),
    ];
    let cfg = config(&setup(QpCap::default()), &LinkParams::default());
    let mut c = ConnState::new(cfg).conn;
    let mut m = PdMemory::new(dev.stags(), pa.id(), None);
    for wr in &cases {
        let engine = qa.post_send(wr).unwrap_err();
        let core = with_core_send(wr, false, dev.stags(), |w| c.post_send(w, &mut m))
            .map_err(|e| send_error(e, qa.qp_num(), wr))
            .unwrap_err();
        match (engine, core) {
            (PostSendError::Invalid { .. }, PostSendError::Invalid { .. }) => {}
            (e, c) => assert_eq!(c, e, "request {}", wr.wr_id),
        }
    }
    let recv = RecvWr::new(9, &five);
    let engine = qb.post_recv(&recv).unwrap_err();
    let core = with_core_recv(&recv, |w| c.post_recv(w, &mut m))
        .map_err(|e| recv_error(e, qb.qp_num()))
        .unwrap_err();
    assert_eq!(core, Some(engine));
    assert_eq!(c.send_queue_len(), 0, "nothing queued");
    assert_eq!(qa.send_queue_len(), 0, "nothing queued");
}

#[test]
fn config_takes_the_link_and_the_caps() {
    let mut link = crc_link();
    link.peer_ird = 3;
    link.msns.send_tx = softrdma_wire::ddp::Msn(2);
    link.msns.read_rx = softrdma_wire::ddp::Msn(5);
    let cap = QpCap {
        max_send_wr: 7,
        max_recv_wr: 9,
        max_send_sge: 2,
        max_recv_sge: 3,
        max_inline_data: 32,
    };
    let c = config(&setup(cap), &link);
    assert!(c.crc);
    assert_eq!((c.ird, c.ord), (16, 3), "ORD limited by the peer's IRD");
    assert_eq!((c.max_send_wr, c.max_recv_wr), (7, 9));
    assert_eq!((c.max_send_sge, c.max_recv_sge, c.max_inline), (2, 3, 32));
    assert_eq!((c.tx_msn, c.rx_msn), ([2, 1], [1, 5]));
    assert_eq!(c.max_payload, 1024);
}

/// Runs two core connections to quiescence as the engine would: FPDUs
/// both ways, each side's link actions (FIN, shutdown, reset) delivered to
/// the other; returns each side's async events, converted.
fn run_core(
    a: &mut Connection<Arc<Memory>>,
    ma: &mut PdMemory<'_>,
    b: &mut Connection<Arc<Memory>>,
    mb: &mut PdMemory<'_>,
) -> [Vec<(AsyncEventKind, Option<softrdma_wire::errcode::TermCode>)>; 2] {
    let mut events = [Vec::new(), Vec::new()];
    let mut link_done = [false, false];
    let now = 1;
    loop {
        let mut moved = pump(a, ma, b, mb) + pump(b, mb, a, ma);
        for side in 0..2 {
            let (me, peer) = if side == 0 {
                (&mut *a, &mut *b)
            } else {
                (&mut *b, &mut *a)
            };
            while let Some(o) = me.poll_output() {
                moved += 1;
                match o {
                    ct::Output::Event(e) => {
                        let ev = async_event(&e, 0);
                        events[side].push((ev.kind, ev.term));
                    }
                    ct::Output::Link(ct::LinkAction::Reset) if !link_done[side] => {
                        link_done[side] = true;
                        peer.handle_reset();
                    }
                    ct::Output::Link(a) if !link_done[side] => {
                        link_done[side] = true;
                        if a == ct::LinkAction::SendFin {
                            me.handle_fin_sent(true);
                        }
                        peer.handle_fin(now);
                    }
                    _ => {}
                }
            }
        }
        if moved == 0 {
            return events;
        }
    }
}

/// The engine's events of QP `qp_num`, kind and Terminate code.
fn engine_events(
    dev: &Device,
    qp_num: u32,
    all: &mut Vec<crate::event::AsyncEvent>,
) -> Vec<(AsyncEventKind, Option<softrdma_wire::errcode::TermCode>)> {
    while let Some(e) = dev.events().try_get() {
        all.push(e);
    }
    all.iter()
        .filter(|e| e.qp_num == Some(qp_num) && e.kind != AsyncEventKind::CommEstablished)
        .map(|e| (e.kind, e.term))
        .collect()
}

/// A Write to an STag the responder does not have, then a Send: the
/// responder answers with a Terminate, both sides end in ERROR.
fn bad_write<'a>(s: &'a Sges, dst: &MemoryRegion) -> ([SendWr<'a>; 2], [RecvWr<'a>; 2]) {
    let sends = [
        SendWr::new(
            1,
            SendOp::Write {
                remote_addr: dst.addr(),
                rkey: dst.rkey() ^ 0x5a,
            },
        )
        .sg_list(&s.small)
        .signaled(),
        SendWr::new(2, SendOp::Send).sg_list(&s.send).signaled(),
    ];
    let recvs = [RecvWr::new(100, &s.recv[0]), RecvWr::new(101, &s.recv[1])];
    (sends, recvs)
}

#[test]
fn core_matches_engine_on_a_terminate() {
    let dev = device();
    let data = [5u8; 64];

    let (pa, pb) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    let cqa = CompletionQueue::new(&dev, 64, None).unwrap();
    let cqb = CompletionQueue::new(&dev, 64, None).unwrap();
    let qa = QueuePair::new(&pa, &QpInitAttr::new(&cqa, &cqa)).unwrap();
    let qb = QueuePair::new(&pb, &QpInitAttr::new(&cqb, &cqb)).unwrap();
    crate::loopback::connect_pair(&qa, &qb, &MpaConfig::default()).unwrap();
    let er = regions(&pa, &pb, &data);
    let es = sges(&er);
    let (sends, recvs) = bad_write(&es, &er.dst);
    for r in &recvs {
        qb.post_recv(r).unwrap();
    }
    qa.post_send_list(&sends).unwrap();
    let engine_a = normal(wait(&cqa, 2));
    let engine_b = normal(wait(&cqb, 2));
    let deadline = Instant::now() + Duration::from_secs(10);
    while qa.state() != QpState::Error || qb.state() != QpState::Error {
        assert!(Instant::now() < deadline, "{} {}", qa.state(), qb.state());
        std::thread::sleep(Duration::from_millis(1));
    }
    // Events raised after the state change have time to arrive.
    std::thread::sleep(Duration::from_millis(50));
    let mut all = Vec::new();
    let ev_a = engine_events(&dev, qa.qp_num(), &mut all);
    let ev_b = engine_events(&dev, qb.qp_num(), &mut all);

    let (pc, pd) = (ProtectionDomain::new(&dev), ProtectionDomain::new(&dev));
    let cr = regions(&pc, &pd, &data);
    let cs = sges(&cr);
    let (sends, recvs) = bad_write(&cs, &cr.dst);
    let cfg = config(&setup(QpCap::default()), &LinkParams::default());
    let (mut a, mut b) = (ConnState::new(cfg).conn, ConnState::new(cfg).conn);
    let mut ma = PdMemory::new(dev.stags(), pc.id(), None);
    let mut mb = PdMemory::new(dev.stags(), pd.id(), None);
    for r in &recvs {
        with_core_recv(r, |w| b.post_recv(w, &mut mb)).unwrap();
    }
    for w in &sends {
        with_core_send(w, false, dev.stags(), |w| a.post_send(w, &mut ma)).unwrap();
    }
    let [core_ev_a, core_ev_b] = run_core(&mut a, &mut ma, &mut b, &mut mb);
    let done = |c: &mut Connection<Arc<Memory>>| {
        normal(
            std::iter::from_fn(|| c.poll_completion())
                .map(|c| work_completion(&c, 0))
                .collect(),
        )
    };
    assert_eq!(done(&mut a), engine_a, "requester completions");
    assert_eq!(done(&mut b), engine_b, "responder completions");
    // Both requests complete when written (iWARP has no acknowledgement);
    // the responder's receives are flushed; the Terminate's code in both
    // events: DDP Tagged Buffer Error / Invalid STag.
    assert!(engine_a.iter().all(|wc| wc.status == WcStatus::Success));
    assert!(engine_b.iter().all(|wc| wc.status == WcStatus::WrFlush));
    let code = softrdma_wire::errcode::TermError::DdpTaggedInvalidStag.code();
    assert_eq!(ev_a, [(AsyncEventKind::TerminateReceived, Some(code))]);
    assert_eq!(ev_b, [(AsyncEventKind::QpAccessError, Some(code))]);
    assert_eq!((a.state(), b.state()), (QpState::Error, QpState::Error));
    assert_eq!(core_ev_a, ev_a, "requester events");
    assert_eq!(core_ev_b, ev_b, "responder events");
}

// -- Scripted differential runs -------------------------------------------

/// What a script does to a pair of QPs (side 0 and side 1); implemented
/// by the engine's QPs and by a pair of core connections.
trait Pair {
    fn send(&mut self, side: usize, wr: &SendWr<'_>) -> Result<(), PostSendError>;
    fn recv(&mut self, side: usize, wr: &RecvWr<'_>) -> Result<(), PostRecvError>;
    /// Posts to side 1's shared receive queue ([`Opts::srq`]).
    fn srq_recv(&mut self, wr: &RecvWr<'_>) -> Result<(), crate::srq::PostRecvError>;
    fn disconnect(&mut self, side: usize);
    fn abort(&mut self, side: usize);
    /// The application moves the QP to TERMINATE.
    fn terminate(&mut self, side: usize);
    /// Lets what was posted so far run to its end.
    fn settle(&mut self);
    /// Keeps `side` from receiving (and so from answering) until
    /// [`release`](Pair::release): the core pair runs only in `settle`,
    /// the engine pair's threads would otherwise answer between posts.
    fn hold(&mut self, _side: usize) {}
    /// Ends a [`hold`](Pair::hold).
    fn release(&mut self) {}
}

/// How the QPs of a differential run are created.
#[derive(Debug, Clone, Copy, Default)]
struct Opts {
    cap: Option<QpCap>,
    /// Side 1 takes its receives from an SRQ.
    srq: bool,
    /// Every send request signaled.
    sq_sig_all: bool,
}

/// The memory of a run: a buffer per side (`MW_BIND` too), a window and
/// a fast-register region at side 1.
struct Mem {
    buf: [MemoryRegion; 2],
    mw: crate::MemoryWindow,
    fr: MemoryRegion,
}

type Events = Vec<(AsyncEventKind, Option<softrdma_wire::errcode::TermCode>)>;

#[derive(Debug, PartialEq)]
struct Outcome {
    /// What each post returned, in order (errors without QP numbers).
    posts: Vec<String>,
    completions: [Vec<WorkCompletion>; 2],
    events: [Events; 2],
    states: [QpState; 2],
    memory: [Vec<u8>; 2],
}

fn mem(pds: &[ProtectionDomain; 2]) -> Mem {
    let buf = |i: usize| {
        let m = pds[i]
            .register(8192, all_access() | Access::MW_BIND)
            .unwrap();
        let fill: Vec<u8> = (0..8192u32).map(|k| (k * 13 + i as u32) as u8).collect();
        m.write(0, &fill).unwrap();
        m
    };
    Mem {
        buf: [buf(0), buf(1)],
        mw: pds[1].alloc_mw().unwrap(),
        fr: pds[1].alloc_mr(4096).unwrap(),
    }
}

struct EnginePair<'a> {
    dev: &'a Device,
    srq: Option<crate::SharedReceiveQueue>,
    qps: [QueuePair; 2],
    cqs: [CompletionQueue; 2],
    out: [Vec<WorkCompletion>; 2],
    posts: Vec<String>,
    /// A thread holding one side's connection lock (`hold`) and the way
    /// to tell it to let go.
    held: Option<(std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>)>,
}

impl Pair for EnginePair<'_> {
    fn send(&mut self, side: usize, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        let r = self.qps[side].post_send(wr);
        self.posts.push(post_result(side, wr.wr_id, &r));
        r
    }
    fn recv(&mut self, side: usize, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        let r = self.qps[side].post_recv(wr);
        self.posts.push(post_result(side, wr.wr_id, &r));
        r
    }
    fn srq_recv(&mut self, wr: &RecvWr<'_>) -> Result<(), crate::srq::PostRecvError> {
        let r = self.srq.as_ref().expect("an SRQ").post_recv(wr);
        self.posts.push(post_result(1, wr.wr_id, &r));
        r
    }
    fn disconnect(&mut self, side: usize) {
        self.qps[side].disconnect().unwrap();
    }
    fn abort(&mut self, side: usize) {
        self.qps[side].abort();
    }
    fn terminate(&mut self, side: usize) {
        self.qps[side].modify(QpState::Terminate).unwrap();
    }
    fn hold(&mut self, side: usize) {
        assert!(self.held.is_none(), "one hold at a time");
        let inner = Arc::clone(self.qps[side].qp());
        let (go, wait) = std::sync::mpsc::channel::<()>();
        let (ready, held) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // A receiver finding the connection held leaves the bytes to
            // this holder, which receives them when it lets go.
            let g = inner.lock_core();
            ready.send(()).unwrap();
            let _ = wait.recv();
            drop(g);
        });
        held.recv().unwrap();
        self.held = Some((go, t));
    }
    fn release(&mut self) {
        if let Some((go, t)) = self.held.take() {
            go.send(()).unwrap();
            t.join().unwrap();
        }
    }
    fn settle(&mut self) {
        self.release();
        // Until nothing changed for 200 ms.
        let mut buf = [WorkCompletion::success(0, WcOpcode::Send, 0); 16];
        let mut quiet = Instant::now();
        let mut states = [self.qps[0].state(), self.qps[1].state()];
        while quiet.elapsed() < Duration::from_millis(200) {
            for (i, seen) in states.iter_mut().enumerate() {
                let k = self.cqs[i].poll(&mut buf);
                if k > 0 {
                    self.out[i].extend_from_slice(&buf[..k]);
                    quiet = Instant::now();
                }
                let s = self.qps[i].state();
                if s != *seen {
                    *seen = s;
                    quiet = Instant::now();
                }
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

struct CorePair<'a> {
    srq: Option<&'a crate::SharedReceiveQueue>,
    sq_sig_all: bool,
    conns: [Connection<Arc<Memory>>; 2],
    mems: [PdMemory<'a>; 2],
    stags: &'a crate::mr::StagTable,
    qp_nums: [u32; 2],
    out: [Vec<WorkCompletion>; 2],
    events: [Events; 2],
    link_done: [bool; 2],
    posts: Vec<String>,
}

impl Pair for CorePair<'_> {
    fn send(&mut self, side: usize, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        let (c, m) = (&mut self.conns[side], &mut self.mems[side]);
        let r = with_core_send(wr, self.sq_sig_all, self.stags, |w| c.post_send(w, m))
            .map_err(|e| send_error(e, self.qp_nums[side], wr));
        self.posts.push(post_result(side, wr.wr_id, &r));
        r
    }
    fn recv(&mut self, side: usize, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        let (c, m) = (&mut self.conns[side], &mut self.mems[side]);
        let r = with_core_recv(wr, |w| c.post_recv(w, m))
            .map_err(|e| recv_error(e, self.qp_nums[side]).expect("a receive's refusal"));
        self.posts.push(post_result(side, wr.wr_id, &r));
        r
    }
    fn srq_recv(&mut self, wr: &RecvWr<'_>) -> Result<(), crate::srq::PostRecvError> {
        // The SRQ is the engine's own: the core only pops from it.
        let r = self.srq.expect("an SRQ").post_recv(wr);
        self.posts.push(post_result(1, wr.wr_id, &r));
        r
    }
    fn disconnect(&mut self, side: usize) {
        self.conns[side].close(1);
    }
    fn abort(&mut self, side: usize) {
        self.conns[side].abort();
    }
    fn terminate(&mut self, side: usize) {
        self.conns[side].terminate(softrdma_wire::errcode::TermError::RdmapLocalCatastrophic);
    }
    fn settle(&mut self) {
        let [a, b] = &mut self.conns;
        let [ma, mb] = &mut self.mems;
        loop {
            let mut moved = pump(a, ma, b, mb) + pump(b, mb, a, ma);
            for side in 0..2 {
                let (me, peer) = if side == 0 {
                    (&mut *a, &mut *b)
                } else {
                    (&mut *b, &mut *a)
                };
                while let Some(o) = me.poll_output() {
                    moved += 1;
                    match o {
                        ct::Output::Event(e) => {
                            let ev = async_event(&e, 0);
                            self.events[side].push((ev.kind, ev.term));
                        }
                        ct::Output::Link(ct::LinkAction::Reset) if !self.link_done[side] => {
                            self.link_done[side] = true;
                            peer.handle_reset();
                        }
                        ct::Output::Link(a) if !self.link_done[side] => {
                            self.link_done[side] = true;
                            if a == ct::LinkAction::SendFin {
                                me.handle_fin_sent(true);
                            }
                            peer.handle_fin(1);
                        }
                        _ => {}
                    }
                }
                while let Some(c) = me.poll_completion() {
                    self.out[side].push(work_completion(&c, self.qp_nums[side]));
                }
            }
            if moved == 0 {
                return;
            }
        }
    }
}

/// Runs `script` on a connected engine QP pair and on a pair of core
/// connections (CRC on, default capabilities); returns both outcomes
/// (engine, core).
fn differential(cap: QpCap, script: impl Fn(&mut dyn Pair, &Mem)) -> (Outcome, Outcome) {
    differential_with(
        Opts {
            cap: Some(cap),
            ..Opts::default()
        },
        script,
    )
}

/// [`differential`] with QPs created as `opts` says.
fn differential_with(opts: Opts, script: impl Fn(&mut dyn Pair, &Mem)) -> (Outcome, Outcome) {
    let dev = device();
    let cap = opts.cap.unwrap_or_default();
    let attr = |cq: &CompletionQueue, srq: Option<&crate::SharedReceiveQueue>| QpInitAttr {
        cap,
        srq: srq.cloned(),
        sq_sig_all: opts.sq_sig_all,
        ..QpInitAttr::new(cq, cq)
    };
    let new_srq = |pd: &ProtectionDomain| {
        opts.srq
            .then(|| crate::SharedReceiveQueue::new(pd, 64, 4, 0).unwrap())
    };

    let pds = [ProtectionDomain::new(&dev), ProtectionDomain::new(&dev)];
    let srq = new_srq(&pds[1]);
    let cqs = [
        CompletionQueue::new(&dev, 256, None).unwrap(),
        CompletionQueue::new(&dev, 256, None).unwrap(),
    ];
    let qps = [
        QueuePair::new(&pds[0], &attr(&cqs[0], None)).unwrap(),
        QueuePair::new(&pds[1], &attr(&cqs[1], srq.as_ref())).unwrap(),
    ];
    let crc = MpaConfig {
        crc: CrcPolicy::Required,
        ..MpaConfig::default()
    };
    crate::loopback::connect_pair(&qps[0], &qps[1], &crc).unwrap();
    let em = mem(&pds);
    let mut e = EnginePair {
        dev: &dev,
        srq,
        qps,
        cqs,
        out: [Vec::new(), Vec::new()],
        posts: Vec::new(),
        held: None,
    };
    script(&mut e, &em);
    e.settle();
    let mut all = Vec::new();
    let nums = [e.qps[0].qp_num(), e.qps[1].qp_num()];
    let engine = Outcome {
        posts: e.posts,
        events: [
            engine_events(e.dev, nums[0], &mut all),
            engine_events(e.dev, nums[1], &mut all),
        ],
        completions: e.out.map(normal),
        states: [e.qps[0].state(), e.qps[1].state()],
        memory: [em.buf[0].to_vec(), em.buf[1].to_vec()],
    };

    let cpds = [ProtectionDomain::new(&dev), ProtectionDomain::new(&dev)];
    let csrq = new_srq(&cpds[1]);
    let cm = mem(&cpds);
    let mut setup1 = setup(cap);
    setup1.srq = opts.srq;
    let cfg0 = config(&setup(cap), &crc_link());
    let cfg1 = config(&setup1, &crc_link());
    let mut c = CorePair {
        srq: csrq.as_ref(),
        sq_sig_all: opts.sq_sig_all,
        conns: [ConnState::new(cfg0).conn, ConnState::new(cfg1).conn],
        mems: [
            PdMemory::new(dev.stags(), cpds[0].id(), None),
            PdMemory::new(
                dev.stags(),
                cpds[1].id(),
                csrq.as_ref().map(|s| s as &dyn crate::mr::RecvSource),
            ),
        ],
        stags: dev.stags(),
        qp_nums: nums,
        out: [Vec::new(), Vec::new()],
        events: [Vec::new(), Vec::new()],
        link_done: [false, false],
        posts: Vec::new(),
    };
    script(&mut c, &cm);
    c.settle();
    let core = Outcome {
        posts: c.posts,
        completions: c.out.map(normal),
        events: c.events,
        states: [c.conns[0].state(), c.conns[1].state()],
        memory: [cm.buf[0].to_vec(), cm.buf[1].to_vec()],
    };
    (engine, core)
}

/// A post's result as text: the side, the request and the error kind.
fn post_result<E: std::fmt::Debug>(side: usize, wr_id: u64, r: &Result<(), E>) -> String {
    match r {
        Ok(()) => format!("{side}:{wr_id} ok"),
        Err(e) => {
            let e = format!("{e:?}");
            let kind = e.split([' ', '{']).next().unwrap_or_default().to_owned();
            format!("{side}:{wr_id} {kind}")
        }
    }
}

/// Compares two outcomes field by field (memory by its first difference).
fn same(engine: &Outcome, core: &Outcome) {
    eprintln!(
        "engine: {:?} {:?} {:?} {:?}",
        engine.posts, engine.completions, engine.events, engine.states
    );
    eprintln!(
        "core:   {:?} {:?} {:?} {:?}",
        core.posts, core.completions, core.events, core.states
    );
    assert_eq!(core.posts, engine.posts, "posts (core, engine)");
    for i in 0..2 {
        assert_eq!(
            core.completions[i], engine.completions[i],
            "completions of side {i} (core, engine)"
        );
        assert_eq!(core.events[i], engine.events[i], "events of side {i}");
        let diff = (core.memory[i].iter().zip(&engine.memory[i])).position(|(a, b)| a != b);
        assert_eq!(diff, None, "memory of side {i}: first difference");
    }
    assert_eq!(core.states, engine.states, "states (core, engine)");
}

fn at(m: &MemoryRegion, off: u64, len: u32) -> [Sge; 1] {
    [sge(m, off, len)]
}

#[test]
fn differential_send_into_a_short_receive() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = at(&m.buf[1], 0, 8);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        let r2 = at(&m.buf[1], 64, 64);
        p.recv(1, &RecvWr::new(11, &r2)).unwrap();
        let s = at(&m.buf[0], 0, 32);
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
        p.settle();
        let s2 = at(&m.buf[0], 32, 4);
        let _ = p.send(0, &SendWr::new(2, SendOp::Send).sg_list(&s2).signaled());
    });
    same(&engine, &core);
    assert_eq!(engine.completions[1][0].status, WcStatus::LocalLength);
}

#[test]
fn differential_scatter_over_several_sges() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = [
            sge(&m.buf[1], 0, 10),
            sge(&m.buf[1], 100, 3000),
            sge(&m.buf[1], 4000, 7),
        ];
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        let s = [
            sge(&m.buf[0], 5, 1),
            sge(&m.buf[0], 50, 2500),
            sge(&m.buf[0], 6000, 300),
        ];
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
        let w = [sge(&m.buf[0], 7, 1500), sge(&m.buf[0], 3000, 1500)];
        p.send(
            0,
            &SendWr::new(
                2,
                SendOp::Write {
                    remote_addr: m.buf[1].addr() + 5000,
                    rkey: m.buf[1].rkey(),
                },
            )
            .sg_list(&w),
        )
        .unwrap();
        let sink = at(&m.buf[0], 7000, 1000);
        p.send(
            0,
            &SendWr::new(
                3,
                SendOp::Read {
                    remote_addr: m.buf[1].addr() + 5500,
                    rkey: m.buf[1].rkey(),
                },
            )
            .sg_list(&sink)
            .signaled(),
        )
        .unwrap();
    });
    same(&engine, &core);
    assert_eq!(engine.completions[0].len(), 2);
    assert_eq!(engine.completions[1][0].byte_len, 2801);
}

#[test]
fn differential_graceful_close_flushes_receives() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        for i in 0..3 {
            let r = at(&m.buf[1], i * 64, 64);
            p.recv(1, &RecvWr::new(10 + i, &r)).unwrap();
        }
        let s = at(&m.buf[0], 0, 64);
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
        p.settle();
        p.disconnect(0);
        p.settle();
        let _ = p.send(0, &SendWr::new(2, SendOp::Send).sg_list(&s).signaled());
        let r = at(&m.buf[1], 512, 64);
        let _ = p.recv(1, &RecvWr::new(20, &r));
    });
    same(&engine, &core);
    assert_eq!(engine.states, [QpState::Idle, QpState::Idle]);
}

#[test]
fn differential_local_operations_and_invalidate() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        // The responder binds its window and fast-registers its region.
        p.send(
            1,
            &SendWr::new(
                1,
                SendOp::BindMw {
                    mw: &m.mw,
                    mr: &m.buf[1],
                    addr: m.buf[1].addr() + 1024,
                    length: 512,
                    access: Access::REMOTE_WRITE | Access::REMOTE_READ,
                    key: Some(0x42),
                },
            )
            .signaled(),
        )
        .unwrap();
        p.send(
            1,
            &SendWr::new(
                2,
                SendOp::FastReg {
                    mr: &m.fr,
                    iova: 0x1000_0000,
                    length: 4096,
                    access: Access::LOCAL_WRITE | Access::REMOTE_WRITE,
                },
            )
            .signaled(),
        )
        .unwrap();
        p.settle();
        // The requester writes through both, then invalidates the window
        // with a Send with Invalidate.
        let s = at(&m.buf[0], 0, 100);
        p.send(
            0,
            &SendWr::new(
                3,
                SendOp::Write {
                    remote_addr: m.buf[1].addr() + 1100,
                    rkey: m.mw.rkey(),
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
        p.send(
            0,
            &SendWr::new(
                4,
                SendOp::Write {
                    remote_addr: 0x1000_0010,
                    rkey: m.fr.rkey(),
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
        let r = at(&m.buf[1], 0, 64);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        p.send(
            0,
            &SendWr::new(
                5,
                SendOp::SendWithInv {
                    invalidate_rkey: m.mw.rkey(),
                },
            )
            .sg_list(&at(&m.buf[0], 0, 8))
            .signaled(),
        )
        .unwrap();
        p.settle();
        // Invalidated: a Write through the window now ends the connection.
        p.send(
            1,
            &SendWr::new(6, SendOp::LocalInv { rkey: m.fr.rkey() }).signaled(),
        )
        .unwrap();
        p.settle();
        p.send(
            0,
            &SendWr::new(
                7,
                SendOp::Write {
                    remote_addr: m.buf[1].addr() + 1100,
                    rkey: m.mw.rkey(),
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
    });
    same(&engine, &core);
    assert_eq!(
        engine.completions[1].len(),
        4,
        "{:?}",
        engine.completions[1]
    );
}

#[test]
fn differential_bad_sge_and_posts_in_error() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = at(&m.buf[1], 0, 64);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        let good = at(&m.buf[0], 0, 16);
        let bad = [Sge {
            addr: m.buf[0].addr(),
            length: 16,
            lkey: m.buf[0].lkey() ^ 0x11,
        }];
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&good))
            .unwrap();
        p.send(0, &SendWr::new(2, SendOp::Send).sg_list(&bad))
            .unwrap();
        p.send(0, &SendWr::new(3, SendOp::Send).sg_list(&good).signaled())
            .unwrap();
        p.settle();
        let _ = p.send(0, &SendWr::new(4, SendOp::Send).sg_list(&good));
        let r = at(&m.buf[0], 0, 64);
        let _ = p.recv(0, &RecvWr::new(11, &r));
    });
    same(&engine, &core);
}

#[test]
fn differential_reads_against_the_ord_and_a_fence() {
    let cap = QpCap::default();
    let (engine, core) = differential(cap, |p, m| {
        let rkey = m.buf[1].rkey();
        let sinks: Vec<[Sge; 1]> = (0..6).map(|i| at(&m.buf[0], 4096 + i * 512, 512)).collect();
        for (i, s) in sinks.iter().enumerate() {
            p.send(
                0,
                &SendWr::new(
                    i as u64,
                    SendOp::Read {
                        remote_addr: m.buf[1].addr() + i as u64 * 512,
                        rkey,
                    },
                )
                .sg_list(s)
                .signaled(),
            )
            .unwrap();
        }
        let r = at(&m.buf[1], 7000, 1000);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        // The Send goes out only after the Reads answered: it carries what
        // the first one read.
        p.send(
            0,
            &SendWr::new(9, SendOp::Send)
                .sg_list(&at(&m.buf[0], 4096, 512))
                .flags(SendFlags::SIGNALED | SendFlags::FENCE),
        )
        .unwrap();
    });
    same(&engine, &core);
    assert_eq!(engine.completions[0].len(), 7);
}

#[test]
fn differential_shared_receive_queue() {
    let opts = Opts {
        srq: true,
        ..Opts::default()
    };
    let (engine, core) = differential_with(opts, |p, m| {
        for i in 0..3 {
            let r = at(&m.buf[1], i * 128, 128);
            p.srq_recv(&RecvWr::new(10 + i, &r)).unwrap();
        }
        let r = at(&m.buf[1], 1024, 64);
        assert!(p.recv(1, &RecvWr::new(20, &r)).is_err(), "post to the SRQ");
        for i in 0..2 {
            let s = at(&m.buf[0], i * 100, 100);
            p.send(0, &SendWr::new(i, SendOp::Send).sg_list(&s).signaled())
                .unwrap();
        }
        p.settle();
        // Too long for the next receive: the responder's Terminate.
        let s = at(&m.buf[0], 0, 200);
        p.send(0, &SendWr::new(5, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
    });
    same(&engine, &core);
    assert_eq!(
        engine.completions[1].len(),
        3,
        "{:?}",
        engine.completions[1]
    );
}

#[test]
fn differential_abort_reports_one_llp_reset_and_flushes_everything() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = at(&m.buf[1], 0, 64);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        let s = at(&m.buf[0], 0, 64);
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
        p.settle();
        p.abort(0);
        let _ = p.send(0, &SendWr::new(2, SendOp::Send).sg_list(&s).signaled());
        let _ = p.recv(0, &RecvWr::new(3, &s));
    });
    same(&engine, &core);
    assert_eq!(engine.states, [QpState::Error, QpState::Error]);
}

#[test]
fn differential_remote_errors_answer_reads_and_atomics() {
    for case in 0..3 {
        let (engine, core) = differential(QpCap::default(), |p, m| {
            let sink = at(&m.buf[0], 4096, 8);
            let op = match case {
                // A Read of an STag the responder does not have.
                0 => SendOp::Read {
                    remote_addr: m.buf[1].addr(),
                    rkey: m.buf[1].rkey() ^ 0x33,
                },
                // A Read beyond the region.
                1 => SendOp::Read {
                    remote_addr: m.buf[1].addr() + 8190,
                    rkey: m.buf[1].rkey(),
                },
                // An atomic on a window without atomic rights... here a
                // fast-register region that is not registered yet.
                _ => SendOp::FetchAdd {
                    remote_addr: 0x1000,
                    rkey: m.fr.rkey(),
                    add: 1,
                },
            };
            // The Send goes out before the responder answers: held (an
            // engine thread could otherwise answer with a Terminate before
            // the Send is posted now and then, flushing it).
            p.hold(1);
            p.send(0, &SendWr::new(1, op).sg_list(&sink).signaled())
                .unwrap();
            let s = at(&m.buf[0], 0, 8);
            p.send(0, &SendWr::new(2, SendOp::Send).sg_list(&s).signaled())
                .unwrap();
            p.release();
        });
        same(&engine, &core);
        assert_ne!(engine.completions[0][0].vendor_err, 0, "case {case}");
    }
}

#[test]
fn differential_write_with_immediate_without_a_receive() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let s = at(&m.buf[0], 0, 64);
        p.send(
            0,
            &SendWr::new(
                1,
                SendOp::WriteWithImm {
                    remote_addr: m.buf[1].addr(),
                    rkey: m.buf[1].rkey(),
                    imm: 5,
                },
            )
            .sg_list(&s)
            .signaled(),
        )
        .unwrap();
    });
    same(&engine, &core);
    assert_eq!(engine.states, [QpState::Error, QpState::Error]);
}

#[test]
fn differential_every_request_signaled() {
    let opts = Opts {
        sq_sig_all: true,
        ..Opts::default()
    };
    let (engine, core) = differential_with(opts, |p, m| {
        let s = at(&m.buf[0], 0, 64);
        for i in 0..3 {
            p.send(
                0,
                &SendWr::new(
                    i,
                    SendOp::Write {
                        remote_addr: m.buf[1].addr() + i * 64,
                        rkey: m.buf[1].rkey(),
                    },
                )
                .sg_list(&s),
            )
            .unwrap();
        }
    });
    same(&engine, &core);
    assert_eq!(engine.completions[0].len(), 3);
}

#[test]
fn differential_full_send_queue() {
    let cap = QpCap {
        max_send_wr: 4,
        ..QpCap::default()
    };
    let (engine, core) = differential(cap, |p, m| {
        // Reads wait for their responses: the queue stays full until the
        // responder runs (held: an engine thread would otherwise answer
        // Read 0 before post 4 now and then, freeing a slot).
        p.hold(1);
        for i in 0..6 {
            let sink = at(&m.buf[0], 4096 + i * 64, 64);
            let _ = p.send(
                0,
                &SendWr::new(
                    i,
                    SendOp::Read {
                        remote_addr: m.buf[1].addr(),
                        rkey: m.buf[1].rkey(),
                    },
                )
                .sg_list(&sink)
                .signaled(),
            );
        }
        p.release();
    });
    same(&engine, &core);
}

#[test]
fn differential_modify_to_terminate() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = at(&m.buf[1], 0, 64);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        let r0 = at(&m.buf[0], 0, 64);
        p.recv(0, &RecvWr::new(11, &r0)).unwrap();
        let sink = at(&m.buf[0], 4096, 64);
        p.send(
            0,
            &SendWr::new(
                1,
                SendOp::Read {
                    remote_addr: m.buf[1].addr(),
                    rkey: m.buf[1].rkey(),
                },
            )
            .sg_list(&sink)
            .signaled(),
        )
        .unwrap();
        p.settle();
        p.terminate(0);
    });
    same(&engine, &core);
    assert_eq!(engine.states, [QpState::Error, QpState::Error]);
}

#[test]
fn differential_send_with_invalidate_of_a_region() {
    // A region's STag cannot be invalidated remotely: the receive reports
    // it and the responder sends a Terminate.
    let (engine, core) = differential(QpCap::default(), |p, m| {
        let r = at(&m.buf[1], 0, 64);
        p.recv(1, &RecvWr::new(10, &r)).unwrap();
        p.recv(1, &RecvWr::new(11, &r)).unwrap();
        p.send(
            0,
            &SendWr::new(
                1,
                SendOp::SendWithInv {
                    invalidate_rkey: m.buf[1].rkey(),
                },
            )
            .sg_list(&at(&m.buf[0], 0, 8))
            .signaled(),
        )
        .unwrap();
    });
    same(&engine, &core);
    assert_eq!(
        engine.completions[1][0].status,
        WcStatus::RemoteInvalidRequest
    );
}

#[test]
fn differential_peer_closes_during_a_long_send() {
    let (engine, core) = differential(QpCap::default(), |p, m| {
        for i in 0..2 {
            let r = at(&m.buf[1], i * 4096, 4096);
            p.recv(1, &RecvWr::new(10 + i, &r)).unwrap();
        }
        let s = at(&m.buf[0], 0, 4000);
        p.send(0, &SendWr::new(1, SendOp::Send).sg_list(&s).signaled())
            .unwrap();
        // The responder closes; the Send already posted still arrives.
        p.disconnect(1);
        p.settle();
    });
    same(&engine, &core);
    assert_eq!(engine.states, [QpState::Idle, QpState::Idle]);
}
