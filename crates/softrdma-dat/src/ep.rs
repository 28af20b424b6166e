//! Endpoints, their data transfer operations, and shared receive queues.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use softrdma_engine::cm::Connection;
use softrdma_engine::{
    CompletionQueue, QpCap, QpInitAttr, QpState, QueuePair, RecvWr, SendFlags, SendOp, SendWr, Sge,
    SharedReceiveQueue, WcOpcode, WcStatus, WorkCompletion,
};
use softrdma_proto::dat::ep::{self as rules, EpEvent, EpPolicy, EpState};

use crate::evd::{Evd, EvdFlags, Event};
use crate::ia::{Ia, IaInner, ObjRef};
use crate::mem::{Lmr, MemPriv, Pz, PzRef, Rmr};
use crate::{DatError, ErrorType, Result, Subtype, err};

/// One local segment (`DAT_LMR_TRIPLET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LmrTriplet {
    /// The LMR's `lmr_context`.
    pub lmr_context: u32,
    /// Address of the segment (within the LMR).
    pub virtual_address: u64,
    /// Length.
    pub segment_length: u32,
}

/// One remote segment (`DAT_RMR_TRIPLET`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct RmrTriplet {
    /// The peer's `rmr_context`.
    pub rmr_context: u32,
    /// The peer's address.
    pub virtual_address: u64,
    /// Length.
    pub segment_length: u32,
}

/// Completion flags (`DAT_COMPLETION_FLAGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct CompletionFlags(pub u32);

impl CompletionFlags {
    /// `DAT_COMPLETION_DEFAULT_FLAG`.
    pub const DEFAULT: CompletionFlags = CompletionFlags(0);
    /// `DAT_COMPLETION_SUPPRESS_FLAG`: no event on success.
    pub const SUPPRESS: CompletionFlags = CompletionFlags(0x01);
    /// `DAT_COMPLETION_SOLICITED_WAIT_FLAG`.
    pub const SOLICITED_WAIT: CompletionFlags = CompletionFlags(0x02);
    /// `DAT_COMPLETION_UNSIGNALLED_FLAG`: no event on success.
    pub const UNSIGNALLED: CompletionFlags = CompletionFlags(0x04);
    /// `DAT_COMPLETION_BARRIER_FENCE_FLAG`.
    pub const BARRIER_FENCE: CompletionFlags = CompletionFlags(0x08);

    fn has(self, f: CompletionFlags) -> bool {
        self.0 & f.0 != 0
    }

    fn signaled(self) -> bool {
        !self.has(CompletionFlags::SUPPRESS) && !self.has(CompletionFlags::UNSIGNALLED)
    }

    fn send_flags(self) -> SendFlags {
        let mut f = SendFlags::NONE;
        if self.signaled() {
            f = f | SendFlags::SIGNALED;
        }
        if self.has(CompletionFlags::SOLICITED_WAIT) {
            f = f | SendFlags::SOLICITED;
        }
        if self.has(CompletionFlags::BARRIER_FENCE) {
            f = f | SendFlags::FENCE;
        }
        f
    }
}

/// The operation of a DTO event (`DAT_DTOS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DtoOp {
    /// `DAT_DTO_SEND`.
    Send = 0,
    /// `DAT_DTO_RDMA_WRITE`.
    RdmaWrite = 1,
    /// `DAT_DTO_RDMA_READ`.
    RdmaRead = 2,
    /// `DAT_DTO_RECEIVE`.
    Receive = 3,
    /// `DAT_DTO_RECEIVE_WITH_INVALIDATE`.
    ReceiveWithInvalidate = 4,
    /// `DAT_DTO_BIND_MW`.
    BindMw = 5,
}

/// The status of a DTO event (`DAT_DTO_COMPLETION_STATUS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DtoStatus {
    /// `DAT_DTO_SUCCESS`.
    Success = 0,
    /// `DAT_DTO_ERR_FLUSHED`.
    Flushed = 1,
    /// `DAT_DTO_ERR_LOCAL_LENGTH`.
    LocalLength = 2,
    /// `DAT_DTO_ERR_LOCAL_EP`.
    LocalEp = 3,
    /// `DAT_DTO_ERR_LOCAL_PROTECTION`.
    LocalProtection = 4,
    /// `DAT_DTO_ERR_BAD_RESPONSE`.
    BadResponse = 5,
    /// `DAT_DTO_ERR_REMOTE_ACCESS`.
    RemoteAccess = 6,
    /// `DAT_DTO_ERR_REMOTE_RESPONDER`.
    RemoteResponder = 7,
    /// `DAT_DTO_ERR_TRANSPORT`.
    Transport = 8,
    /// `DAT_DTO_ERR_RECEIVER_NOT_READY`.
    ReceiverNotReady = 9,
    /// `DAT_DTO_ERR_PARTIAL_PACKET`.
    PartialPacket = 10,
    /// `DAT_RMR_OPERATION_FAILED`.
    RmrOperationFailed = 11,
}

impl DtoStatus {
    fn of(s: WcStatus) -> DtoStatus {
        match s {
            WcStatus::Success => DtoStatus::Success,
            WcStatus::WrFlush => DtoStatus::Flushed,
            WcStatus::LocalLength => DtoStatus::LocalLength,
            WcStatus::LocalQpOperation => DtoStatus::LocalEp,
            WcStatus::LocalProtection => DtoStatus::LocalProtection,
            WcStatus::RemoteInvalidRequest => DtoStatus::BadResponse,
            WcStatus::RemoteAccess => DtoStatus::RemoteAccess,
            WcStatus::RemoteOperation => DtoStatus::RemoteResponder,
            WcStatus::MwBind => DtoStatus::RmrOperationFailed,
            _ => DtoStatus::Transport,
        }
    }
}

/// Endpoint attributes (`DAT_EP_ATTR`, the parts softrdma uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpAttr {
    /// Largest message.
    pub max_message_size: u64,
    /// Largest RDMA.
    pub max_rdma_size: u64,
    /// Receives outstanding.
    pub max_recv_dtos: u32,
    /// Send-queue requests outstanding.
    pub max_request_dtos: u32,
    /// Segments per receive.
    pub max_recv_iov: u32,
    /// Segments per send-queue request.
    pub max_request_iov: u32,
    /// Inbound RDMA Reads outstanding (IRD).
    pub max_rdma_read_in: u32,
    /// Outbound RDMA Reads outstanding (ORD).
    pub max_rdma_read_out: u32,
    /// Segments of an RDMA Read (split into one Read per segment).
    pub max_rdma_read_iov: u32,
    /// Segments of an RDMA Write.
    pub max_rdma_write_iov: u32,
}

impl Default for EpAttr {
    fn default() -> Self {
        EpAttr {
            max_message_size: 1 << 31,
            max_rdma_size: 1 << 31,
            max_recv_dtos: 256,
            max_request_dtos: 256,
            max_recv_iov: 4,
            max_request_iov: 4,
            max_rdma_read_in: 8,
            max_rdma_read_out: 8,
            max_rdma_read_iov: 4,
            max_rdma_write_iov: 4,
        }
    }
}

/// What [`Ep::modify`] changes; `None` keeps a field.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EpAttrChange {
    /// IRD.
    pub max_rdma_read_in: Option<u32>,
    /// ORD.
    pub max_rdma_read_out: Option<u32>,
    /// Receives outstanding.
    pub max_recv_dtos: Option<u32>,
    /// Send-queue requests outstanding.
    pub max_request_dtos: Option<u32>,
    /// Segments per receive.
    pub max_recv_iov: Option<u32>,
    /// Segments per send-queue request.
    pub max_request_iov: Option<u32>,
    /// Segments of an RDMA Read.
    pub max_rdma_read_iov: Option<u32>,
    /// Segments of an RDMA Write.
    pub max_rdma_write_iov: Option<u32>,
}

/// What [`Ep::query`] reports (`DAT_EP_PARAM`).
#[derive(Debug, Clone)]
pub struct EpParam {
    /// The state.
    pub state: EpState,
    /// The IA address.
    pub local_addr: SocketAddr,
    /// The peer's address (port: the peer's TCP port), once known.
    pub remote_addr: Option<SocketAddr>,
    /// The connection qualifier of the connect or the accepting SP.
    pub conn_qual: u64,
    /// Attributes (as adjusted to the device).
    pub attr: EpAttr,
    /// The PZ.
    pub pz: Pz,
    /// Receive EVD.
    pub recv_evd: Option<Evd>,
    /// Request EVD.
    pub request_evd: Option<Evd>,
    /// Connection EVD.
    pub connect_evd: Option<Evd>,
    /// SRQ.
    pub srq: Option<Srq>,
}

#[derive(Debug)]
struct SqEntry {
    wr_id: u64,
    cookie: u64,
    len: u32,
    op: DtoOp,
    rmr: Option<Rmr>,
}

#[derive(Debug)]
pub(crate) struct Conn {
    pub(crate) state: EpState,
    pub(crate) conn: Option<Connection>,
    pub(crate) remote: Option<SocketAddr>,
    pub(crate) conn_qual: u64,
    /// Connect attempt: target, private data, deadline (for retries).
    pub(crate) target: Option<(SocketAddr, Vec<u8>, Instant)>,
    /// A local abrupt disconnect was reported already.
    pub(crate) broken: bool,
    /// Refused connects are retried until then.
    pub(crate) retry_until: Option<Instant>,
    /// The next retry backoff.
    pub(crate) backoff: Duration,
}

#[derive(Debug)]
pub(crate) struct EpInner {
    id: u64,
    pub(crate) ia: ObjRef,
    pub(crate) qp: QueuePair,
    pz: Mutex<Option<PzRef>>,
    pz_handle: Pz,
    /// The attributes now (`dat_ep_modify` may lower them, or change
    /// IRD/ORD before a connection).
    attr: Mutex<EpAttr>,
    /// The attributes the QP was made with: the limits of `attr`.
    cap: EpAttr,
    pub(crate) recv_evd: Option<Evd>,
    pub(crate) request_evd: Option<Evd>,
    pub(crate) connect_evd: Option<Evd>,
    srq: Option<Srq>,
    pub(crate) conn: Mutex<Conn>,
    sq: Mutex<VecDeque<SqEntry>>,
    /// Serializes posters (see `Ep::post`).
    post_order: Mutex<()>,
    rq: Mutex<HashMap<u64, u64>>,
    next_wr: AtomicU64,
    /// A fatal async event was seen for the QP: its end is BROKEN.
    pub(crate) fatal: AtomicBool,
    /// LAST_WQE_REACHED of the current connection was handled (SRQ EPs).
    pub(crate) last_wqe: AtomicBool,
    user: AtomicUsize,
    detached: AtomicBool,
    self_weak: Weak<EpInner>,
}

impl EpInner {
    /// Whether the EP takes its receives from an SRQ.
    pub(crate) fn has_srq(&self) -> bool {
        self.srq.is_some()
    }

    /// Lets go of the EVDs and the PZ (once): `dat_ep_free` or drop.
    fn detach(&self) {
        if self.detached.swap(true, Ordering::AcqRel) {
            return;
        }
        for e in [&self.recv_evd, &self.request_evd, &self.connect_evd]
            .into_iter()
            .flatten()
        {
            e.inner.users.fetch_sub(1, Ordering::AcqRel);
            e.inner.eps.lock().remove(&self.qp.qp_num());
        }
        self.pz.lock().take();
        if matches!(self.qp.state(), QpState::Rts | QpState::Closing) {
            self.qp.abort();
        }
    }
}

impl Drop for EpInner {
    fn drop(&mut self) {
        self.detach();
    }
}

/// An endpoint (`DAT_EP_HANDLE`): a QP with its EVDs and its DAT state
/// machine. Receives may be posted in any state; sends, RDMA and binds
/// once connected.
#[derive(Debug, Clone)]
pub struct Ep {
    pub(crate) inner: Arc<EpInner>,
}

impl PartialEq for Ep {
    fn eq(&self, other: &Ep) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

fn clamp(v: u32, max: u32) -> u32 {
    v.clamp(1, max.max(1))
}

impl Ep {
    /// Creates an EP (`dat_ep_create`): a QP in RTR (so receives can be
    /// posted before connecting) whose send-queue completions go to
    /// `request_evd` and receive completions to `recv_evd` (both DTO
    /// EVDs), and whose connection events go to `connect_evd`.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_HANDLE` (`EVD_*`) for an EVD of the wrong kind or IA;
    /// `DAT_INSUFFICIENT_RESOURCES` if the QP cannot be made.
    pub fn new(
        ia: &Ia,
        pz: &Pz,
        recv_evd: Option<&Evd>,
        request_evd: Option<&Evd>,
        connect_evd: Option<&Evd>,
        attr: Option<EpAttr>,
    ) -> Result<Ep> {
        Ep::create(ia, pz, recv_evd, request_evd, connect_evd, attr, None)
    }

    /// Creates an EP whose receives come from `srq`
    /// (`dat_ep_create_with_srq`).
    ///
    /// # Errors
    ///
    /// As [`new`](Self::new).
    pub fn with_srq(
        ia: &Ia,
        pz: &Pz,
        recv_evd: Option<&Evd>,
        request_evd: Option<&Evd>,
        connect_evd: Option<&Evd>,
        srq: &Srq,
        attr: Option<EpAttr>,
    ) -> Result<Ep> {
        Ep::create(ia, pz, recv_evd, request_evd, connect_evd, attr, Some(srq))
    }

    fn create(
        ia: &Ia,
        pz: &Pz,
        recv_evd: Option<&Evd>,
        request_evd: Option<&Evd>,
        connect_evd: Option<&Evd>,
        attr: Option<EpAttr>,
        srq: Option<&Srq>,
    ) -> Result<Ep> {
        let same_ia = |e: &Evd| Arc::ptr_eq(&pz.inner.ia.0, &ia.inner) && e.cq_device_ok(ia);
        let check = |e: Option<&Evd>, flags: EvdFlags, sub: Subtype| -> Result<()> {
            match e {
                Some(e) if !e.flags().intersects(flags) || !same_ia(e) => {
                    Err(err(ErrorType::InvalidHandle, sub))
                }
                _ => Ok(()),
            }
        };
        check(recv_evd, EvdFlags::DTO, Subtype::HandleEvdRecv)?;
        check(
            request_evd,
            EvdFlags::DTO.union(EvdFlags::RMR_BIND),
            Subtype::HandleEvdRequest,
        )?;
        check(connect_evd, EvdFlags::CONNECTION, Subtype::HandleEvdConn)?;
        if !Arc::ptr_eq(&pz.inner.ia.0, &ia.inner) {
            return Err(err(ErrorType::InvalidHandle, Subtype::HandlePz));
        }
        let dev = ia.inner.device.attr();
        let mut a = attr.unwrap_or_default();
        a.max_recv_dtos = clamp(a.max_recv_dtos, dev.max_qp_wr);
        a.max_request_dtos = clamp(a.max_request_dtos, dev.max_qp_wr);
        a.max_recv_iov = clamp(a.max_recv_iov, dev.max_sge);
        a.max_request_iov = clamp(a.max_request_iov, dev.max_sge);
        a.max_rdma_write_iov = clamp(a.max_rdma_write_iov, dev.max_sge);
        a.max_rdma_read_iov = clamp(a.max_rdma_read_iov, dev.max_sge);
        a.max_rdma_read_in = clamp(a.max_rdma_read_in, dev.max_qp_rd_atom);
        a.max_rdma_read_out = clamp(a.max_rdma_read_out, dev.max_qp_init_rd_atom);
        // Private CQs stand in for absent EVDs (their completions are
        // dropped: DAT has nowhere to report them).
        let private = || CompletionQueue::new(&ia.inner.device, 64, None);
        let cq_of = |e: Option<&Evd>| -> Result<CompletionQueue> {
            match e.and_then(|e| e.inner.cq.clone()) {
                Some(cq) => Ok(cq),
                None => private()
                    .map_err(|_| err(ErrorType::InsufficientResources, Subtype::ResourceTevd)),
            }
        };
        let mut qa = QpInitAttr::new(&cq_of(request_evd)?, &cq_of(recv_evd)?);
        let read_split = a.max_rdma_read_iov;
        qa.cap = QpCap {
            max_send_wr: clamp(a.max_request_dtos.saturating_mul(read_split), dev.max_qp_wr),
            max_recv_wr: a.max_recv_dtos,
            max_send_sge: a.max_request_iov.max(a.max_rdma_write_iov),
            max_recv_sge: a.max_recv_iov,
            max_inline_data: 0,
        };
        qa.srq = srq.map(|s| s.inner.srq.clone());
        qa.ird = a.max_rdma_read_in as u16;
        qa.ord = a.max_rdma_read_out as u16;
        let qp = QueuePair::new(&pz.inner.pd, &qa)
            .map_err(|_| err(ErrorType::InsufficientResources, Subtype::ResourceTep))?;
        qp.modify(QpState::Rtr)
            .map_err(|_| err(ErrorType::InternalError, Subtype::None))?;
        let inner = Arc::new_cyclic(|w| EpInner {
            id: crate::next_id(),
            ia: ObjRef::new(&ia.inner),
            qp,
            pz: Mutex::new(Some(PzRef::new(pz))),
            pz_handle: pz.clone(),
            attr: Mutex::new(a),
            cap: a,
            recv_evd: recv_evd.cloned(),
            request_evd: request_evd.cloned(),
            connect_evd: connect_evd.cloned(),
            srq: srq.cloned(),
            conn: Mutex::new(Conn {
                state: EpState::Unconnected,
                conn: None,
                remote: None,
                conn_qual: 0,
                target: None,
                broken: false,
                retry_until: None,
                backoff: Duration::ZERO,
            }),
            sq: Mutex::new(VecDeque::new()),
            post_order: Mutex::new(()),
            rq: Mutex::new(HashMap::new()),
            next_wr: AtomicU64::new(1),
            fatal: AtomicBool::new(false),
            last_wqe: AtomicBool::new(false),
            user: AtomicUsize::new(0),
            detached: AtomicBool::new(false),
            self_weak: w.clone(),
        });
        let qpn = inner.qp.qp_num();
        for e in [recv_evd, request_evd, connect_evd].into_iter().flatten() {
            e.inner.users.fetch_add(1, Ordering::AcqRel);
            e.inner.eps.lock().insert(qpn, Arc::downgrade(&inner));
        }
        ia.inner.reactor.add_ep(qpn, Arc::downgrade(&inner));
        Ok(Ep { inner })
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// The state.
    pub fn state(&self) -> EpState {
        self.inner.conn.lock().state
    }

    /// The IA.
    pub fn ia(&self) -> Ia {
        Ia {
            inner: self.inner.ia.0.clone(),
        }
    }

    /// The QP underneath.
    pub fn qp(&self) -> &QueuePair {
        &self.inner.qp
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// Parameters (`dat_ep_query`).
    pub fn query(&self) -> EpParam {
        let c = self.inner.conn.lock();
        let ia = &self.inner.ia.0;
        EpParam {
            state: c.state,
            local_addr: SocketAddr::new(ia.config.addr, 0),
            remote_addr: c.remote,
            conn_qual: c.conn_qual,
            attr: *self.inner.attr.lock(),
            pz: self.inner.pz_handle.clone(),
            recv_evd: self.inner.recv_evd.clone(),
            request_evd: self.inner.request_evd.clone(),
            connect_evd: self.inner.connect_evd.clone(),
            srq: self.inner.srq.clone(),
        }
    }

    /// `dat_ep_get_status`: the state and whether receives / requests are
    /// outstanding.
    pub fn status(&self) -> (EpState, bool, bool) {
        (
            self.state(),
            !self.inner.rq.lock().is_empty(),
            self.inner.qp.send_queue_len() > 0,
        )
    }

    /// Connects to the EP listening at `remote` (its IP; the port is
    /// ignored) on `conn_qual` (`dat_ep_connect`). Returns at once; the
    /// outcome is a connection event on the connect EVD.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` unless UNCONNECTED; `DAT_INVALID_PARAMETER`
    /// for private data over [`MAX_PRIVATE_DATA`](crate::MAX_PRIVATE_DATA)
    /// or a qualifier without a port.
    pub fn connect(
        &self,
        remote: SocketAddr,
        conn_qual: u64,
        timeout: Option<Duration>,
        private_data: &[u8],
    ) -> Result<()> {
        crate::check_private_data(private_data)?;
        let ia = &self.inner.ia.0;
        let port = softrdma_proto::dat::addr::port_of(conn_qual, ia.config.port_base)
            .ok_or_else(|| err(ErrorType::InvalidParameter, Subtype::Arg3))?;
        let mut c = self.inner.conn.lock();
        let st = rules::step(c.state, EpEvent::Connect, self.policy())?;
        c.state = st.next;
        let target = SocketAddr::new(remote.ip(), port);
        let timeout = timeout.unwrap_or(Duration::from_secs(3600));
        let deadline = Instant::now() + timeout;
        c.conn_qual = conn_qual;
        c.remote = Some(target);
        c.target = Some((target, private_data.to_vec(), deadline));
        c.broken = false;
        c.retry_until = ia
            .config
            .connect_retry
            .map(|r| (Instant::now() + r).min(deadline));
        c.backoff = Duration::from_millis(20);
        drop(c);
        self.inner.start_attempt();
        Ok(())
    }

    fn policy(&self) -> EpPolicy {
        EpPolicy {
            retry_refused: self.inner.ia.0.config.connect_retry.is_some(),
        }
    }

    /// `dat_ep_disconnect`: graceful (the send queue drains, then the
    /// connection closes; DISCONNECTED follows) or abrupt (reset at once,
    /// outstanding work flushed, DISCONNECTED reported now).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` in UNCONNECTED, RESERVED or TENTATIVE.
    pub fn disconnect(&self, graceful: bool) -> Result<()> {
        self.inner.local_event(EpEvent::Disconnect { graceful })
    }

    /// `dat_ep_recv_query`: the receives posted to the EP whose
    /// completions have not been generated yet. `None` for an EP on an
    /// SRQ (its receives belong to the SRQ; see [`Srq::outstanding`]).
    pub fn recv_query(&self) -> Option<usize> {
        if self.inner.srq.is_some() {
            return None;
        }
        Some(self.inner.rq.lock().len())
    }

    /// `dat_ep_modify` of the attributes, while the EP has no connection
    /// (UNCONNECTED or RESERVED): IRD and ORD (what the next connect or
    /// accept negotiates) up to the device's limits; the queue depths and
    /// segment counts up to what the EP was created with. Fields left
    /// `None` keep their value.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` in another state; `DAT_INVALID_PARAMETER`
    /// (`ARG2`) for a value of 0 or above its limit.
    pub fn modify(&self, change: &EpAttrChange) -> Result<()> {
        let c = self.inner.conn.lock();
        if !matches!(c.state, EpState::Unconnected | EpState::Reserved) {
            return Err(err(ErrorType::InvalidState, c.state.subtype()));
        }
        let dev = self.inner.ia.0.device.attr();
        let cap = &self.inner.cap;
        let mut a = *self.inner.attr.lock();
        let fields = [
            (
                change.max_rdma_read_in,
                dev.max_qp_rd_atom,
                &mut a.max_rdma_read_in,
            ),
            (
                change.max_rdma_read_out,
                dev.max_qp_init_rd_atom,
                &mut a.max_rdma_read_out,
            ),
            (
                change.max_recv_dtos,
                cap.max_recv_dtos,
                &mut a.max_recv_dtos,
            ),
            (
                change.max_request_dtos,
                cap.max_request_dtos,
                &mut a.max_request_dtos,
            ),
            (change.max_recv_iov, cap.max_recv_iov, &mut a.max_recv_iov),
            (
                change.max_request_iov,
                cap.max_request_iov,
                &mut a.max_request_iov,
            ),
            (
                change.max_rdma_read_iov,
                cap.max_rdma_read_iov,
                &mut a.max_rdma_read_iov,
            ),
            (
                change.max_rdma_write_iov,
                cap.max_rdma_write_iov,
                &mut a.max_rdma_write_iov,
            ),
        ];
        for (new, limit, field) in fields {
            if let Some(v) = new {
                if v == 0 || v > limit {
                    return Err(err(ErrorType::InvalidParameter, Subtype::Arg2));
                }
                *field = v;
            }
        }
        *self.inner.attr.lock() = a;
        Ok(())
    }

    /// `dat_ep_reset`: DISCONNECTED → UNCONNECTED; the QP is reset so the
    /// EP can connect or accept again (receives must be posted again).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` unless DISCONNECTED or UNCONNECTED.
    pub fn reset(&self) -> Result<()> {
        let mut c = self.inner.conn.lock();
        let st = rules::step(c.state, EpEvent::Reset, self.policy())?;
        let qp = &self.inner.qp;
        // A QP that carried a connection is fully reset (through ERROR),
        // whether it ended gracefully (IDLE) or not, so nothing of the old
        // connection survives into the next.
        if c.conn.is_some() || c.state == EpState::Disconnected {
            if qp.state() != QpState::Error {
                qp.abort();
            }
            let _ = qp.modify(QpState::Idle);
        }
        if qp.state() == QpState::Error {
            qp.modify(QpState::Idle)
                .map_err(|_| err(ErrorType::InternalError, Subtype::None))?;
        }
        if qp.state() == QpState::Idle {
            qp.modify(QpState::Rtr)
                .map_err(|_| err(ErrorType::InternalError, Subtype::None))?;
        }
        c.state = st.next;
        c.conn = None;
        c.remote = None;
        c.target = None;
        c.broken = false;
        self.inner.fatal.store(false, Ordering::Release);
        self.inner.last_wqe.store(false, Ordering::Release);
        self.inner.sq.lock().clear();
        self.inner.rq.lock().clear();
        Ok(())
    }

    /// `dat_ep_free`: an open connection is reset; the EVDs and the PZ are
    /// free to go at once (events already queued still name the EP).
    pub fn free(self) {
        let c = self.inner.conn.lock().conn.take();
        if let Some(c) = c {
            c.abort();
        }
        self.inner.ia.0.reactor.remove_ep(&self.inner);
        self.inner.detach();
    }

    fn wr_id(&self) -> u64 {
        self.inner.next_wr.fetch_add(1, Ordering::Relaxed)
    }

    fn sges(local: &[LmrTriplet]) -> (Vec<Sge>, u32) {
        let mut total = 0u32;
        let s = local
            .iter()
            .map(|t| {
                total = total.wrapping_add(t.segment_length);
                Sge {
                    addr: t.virtual_address,
                    length: t.segment_length,
                    lkey: t.lmr_context,
                }
            })
            .collect();
        (s, total)
    }

    fn check_iov(local: &[LmrTriplet], max: u32) -> Result<()> {
        if local.len() > max as usize {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg2));
        }
        Ok(())
    }

    /// Posts `wrs`, whose events `entries` describe (one each, in order).
    ///
    /// Posters are serialized by `post_order`, so the send queue's order is
    /// the QP's; the `sq` lock is held only to queue the entries, not while
    /// the engine sends (it may write the data in this thread): completions
    /// of earlier requests become events meanwhile.
    fn post(&self, wrs: &[SendWr<'_>], entries: Vec<SqEntry>) -> Result<()> {
        self.state().may_post_send()?;
        let _order = self.inner.post_order.lock();
        let count = entries.len();
        self.inner.sq.lock().extend(entries);
        if let Err(e) = self.inner.qp.post_send_list(wrs) {
            // The entries of the requests not posted are the last ones
            // queued (posters are serialized; completions only take from
            // the front, and these never complete). Cookies may repeat, so
            // they are dropped by position, not by cookie.
            let unposted = count - e.index.min(count);
            let mut sq = self.inner.sq.lock();
            let keep = sq.len() - unposted.min(sq.len());
            sq.truncate(keep);
            return Err(post_err(&e.error.to_string()));
        }
        Ok(())
    }

    /// Posts a Send of the segments (`dat_ep_post_send`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` unless connected; `DAT_INVALID_PARAMETER` for
    /// too many segments; `DAT_INSUFFICIENT_RESOURCES` for a full queue.
    pub fn post_send(
        &self,
        local: &[LmrTriplet],
        cookie: u64,
        flags: CompletionFlags,
    ) -> Result<()> {
        Ep::check_iov(local, self.inner.attr.lock().max_request_iov)?;
        let (sg, len) = Ep::sges(local);
        let wr_id = self.wr_id();
        let wr = SendWr::new(wr_id, SendOp::Send)
            .sg_list(&sg)
            .flags(flags.send_flags());
        self.post(
            &[wr],
            vec![SqEntry {
                wr_id,
                cookie,
                len,
                op: DtoOp::Send,
                rmr: None,
            }],
        )
    }

    /// Posts an RDMA Write of the segments to `remote`
    /// (`dat_ep_post_rdma_write`).
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send).
    pub fn post_rdma_write(
        &self,
        local: &[LmrTriplet],
        cookie: u64,
        remote: &RmrTriplet,
        flags: CompletionFlags,
    ) -> Result<()> {
        Ep::check_iov(local, self.inner.attr.lock().max_rdma_write_iov)?;
        let (sg, len) = Ep::sges(local);
        let wr_id = self.wr_id();
        let wr = SendWr::new(
            wr_id,
            SendOp::Write {
                remote_addr: remote.virtual_address,
                rkey: remote.rmr_context,
            },
        )
        .sg_list(&sg)
        .flags(flags.send_flags());
        self.post(
            &[wr],
            vec![SqEntry {
                wr_id,
                cookie,
                len,
                op: DtoOp::RdmaWrite,
                rmr: None,
            }],
        )
    }

    /// Posts an RDMA Read from `remote` into the segments
    /// (`dat_ep_post_rdma_read`): one iWARP Read per local segment, over
    /// consecutive remote ranges; one event for all.
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send).
    pub fn post_rdma_read(
        &self,
        local: &[LmrTriplet],
        cookie: u64,
        remote: &RmrTriplet,
        flags: CompletionFlags,
    ) -> Result<()> {
        Ep::check_iov(local, self.inner.attr.lock().max_rdma_read_iov)?;
        if local.is_empty() {
            return Err(err(ErrorType::InvalidParameter, Subtype::Arg2));
        }
        let (sg, total) = Ep::sges(local);
        let mut wrs = Vec::with_capacity(sg.len());
        let mut entries = Vec::with_capacity(sg.len());
        let mut off = 0u64;
        let last = sg.len() - 1;
        for (i, s) in sg.iter().enumerate() {
            let wr_id = self.wr_id();
            let fl = if i == last {
                flags.send_flags()
            } else {
                SendFlags::NONE
            };
            wrs.push(
                SendWr::new(
                    wr_id,
                    SendOp::Read {
                        remote_addr: remote.virtual_address + off,
                        rkey: remote.rmr_context,
                    },
                )
                .sg_list(std::slice::from_ref(s))
                .flags(fl),
            );
            entries.push(SqEntry {
                wr_id,
                cookie,
                len: total,
                op: DtoOp::RdmaRead,
                rmr: None,
            });
            off += u64::from(s.length);
        }
        self.post(&wrs, entries)
    }

    /// Posts a receive into the segments (`dat_ep_post_recv`), in any
    /// state.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` for too many segments,
    /// `DAT_INSUFFICIENT_RESOURCES` for a full queue; `DAT_INVALID_STATE`
    /// for an EP with an SRQ.
    pub fn post_recv(
        &self,
        local: &[LmrTriplet],
        cookie: u64,
        _flags: CompletionFlags,
    ) -> Result<()> {
        if self.inner.srq.is_some() {
            return Err(err(ErrorType::InvalidState, Subtype::None));
        }
        Ep::check_iov(local, self.inner.attr.lock().max_recv_iov)?;
        let (sg, _) = Ep::sges(local);
        let wr_id = self.wr_id();
        let mut rq = self.inner.rq.lock();
        rq.insert(wr_id, cookie);
        if let Err(e) = self.inner.qp.post_recv(&RecvWr::new(wr_id, &sg)) {
            rq.remove(&wr_id);
            return Err(post_err(&e.to_string()));
        }
        Ok(())
    }

    /// Binds `rmr` to `target` = (LMR, address, length) with remote
    /// rights `priv_` (`dat_rmr_bind`): a bind work request on this EP's
    /// send queue, completed by an RMR-bind event (cookie) unless
    /// suppressed. `None` unbinds. Returns the RMR's new `rmr_context`.
    ///
    /// # Errors
    ///
    /// As [`post_send`](Self::post_send); `DAT_INVALID_PARAMETER` if the
    /// range is outside the LMR.
    pub fn bind_rmr(
        &self,
        rmr: &Rmr,
        target: Option<(&Lmr, u64, u64)>,
        priv_: MemPriv,
        cookie: u64,
        flags: CompletionFlags,
    ) -> Result<u32> {
        let wr_id = self.wr_id();
        let entry = SqEntry {
            wr_id,
            cookie,
            len: 0,
            op: DtoOp::BindMw,
            rmr: Some(rmr.clone()),
        };
        match target {
            Some((l, addr, len)) => {
                let start = l.address();
                if addr < start || addr + len > start + l.len() as u64 {
                    return Err(err(ErrorType::InvalidParameter, Subtype::Arg3));
                }
                let wr = SendWr::new(
                    wr_id,
                    SendOp::BindMw {
                        mw: &rmr.inner.mw,
                        mr: &l.inner.mr,
                        addr,
                        length: len,
                        access: priv_.access(false),
                        key: None,
                    },
                )
                .flags(flags.send_flags());
                self.post(&[wr], vec![entry])?;
                *rmr.inner.bound.lock() = Some((l.clone(), addr, len, priv_));
            }
            None => {
                let wr = SendWr::new(
                    wr_id,
                    SendOp::LocalInv {
                        rkey: rmr.rmr_context(),
                    },
                )
                .flags(flags.send_flags());
                self.post(&[wr], vec![entry])?;
                *rmr.inner.bound.lock() = None;
            }
        }
        Ok(rmr.rmr_context())
    }
}

fn post_err(msg: &str) -> DatError {
    // The engine's post errors: a full queue, too many SGEs, a bad state.
    if msg.contains("full") {
        err(ErrorType::InsufficientResources, Subtype::ResourceTep)
    } else if msg.contains("state") {
        err(ErrorType::InvalidState, Subtype::None)
    } else {
        err(ErrorType::InvalidParameter, Subtype::None)
    }
}

impl Evd {
    fn cq_device_ok(&self, _ia: &Ia) -> bool {
        true
    }
}

impl EpInner {
    /// The DAT event of a completion of this EP, if it has one.
    pub(crate) fn completion_event(self: &Arc<Self>, wc: &WorkCompletion) -> Option<Event> {
        let ep = Ep {
            inner: self.clone(),
        };
        let status = DtoStatus::of(wc.status);
        if matches!(wc.opcode, WcOpcode::Recv | WcOpcode::RecvRdmaWithImm) {
            let cookie = match &self.srq {
                Some(s) => s.inner.rq.lock().remove(&wc.wr_id),
                None => self.rq.lock().remove(&wc.wr_id),
            }?;
            let op = if wc.flags.contains(softrdma_engine::WcFlags::WITH_INV) {
                DtoOp::ReceiveWithInvalidate
            } else {
                DtoOp::Receive
            };
            return Some(Event::Dto {
                ep,
                cookie,
                status,
                len: wc.byte_len,
                op,
            });
        }
        let entry = {
            let mut sq = self.sq.lock();
            // Suppressed requests before this one completed silently.
            loop {
                let e = sq.pop_front()?;
                if e.wr_id == wc.wr_id {
                    break e;
                }
            }
        };
        if entry.op == DtoOp::BindMw {
            return Some(Event::RmrBind {
                rmr: entry.rmr?,
                cookie: entry.cookie,
                status,
            });
        }
        Some(Event::Dto {
            ep,
            cookie: entry.cookie,
            status,
            len: if status == DtoStatus::Success {
                entry.len
            } else {
                0
            },
            op: entry.op,
        })
    }

    /// Applies a consumer-side event, reports its connection event.
    pub(crate) fn local_event(self: &Arc<Self>, ev: EpEvent) -> Result<()> {
        let policy = Ep {
            inner: self.clone(),
        }
        .policy();
        let mut c = self.conn.lock();
        let st = rules::step(c.state, ev, policy)?;
        let prev = c.state;
        c.state = st.next;
        if let EpEvent::Disconnect { graceful } = ev {
            match &c.conn {
                Some(conn)
                    if graceful && prev == EpState::Connected && conn.disconnect().is_err() =>
                {
                    conn.abort();
                }
                Some(_) if graceful && prev == EpState::Connected => {}
                Some(conn) => conn.abort(),
                None if prev != EpState::Disconnected => self.qp.abort(),
                None => {}
            }
        }
        drop(c);
        if let Some(r) = st.report {
            self.report(r, Vec::new());
        }
        Ok(())
    }

    pub(crate) fn report(self: &Arc<Self>, kind: rules::ConnEvent, private_data: Vec<u8>) {
        if let Some(e) = &self.connect_evd {
            e.push(Event::Connection {
                ep: Ep {
                    inner: self.clone(),
                },
                kind,
                private_data,
            });
        }
    }

    /// Starts (or restarts) the connect attempt of the EP's target.
    pub(crate) fn start_attempt(self: &Arc<Self>) {
        let mut c = self.conn.lock();
        let Some((target, pdata, deadline)) = c.target.clone() else {
            return;
        };
        let left = deadline.saturating_duration_since(Instant::now());
        let ia = &self.ia.0;
        let (ird, ord) = {
            let a = self.attr.lock();
            (a.max_rdma_read_in, a.max_rdma_read_out)
        };
        let mut mpa = softrdma_proto::mpa::MpaConfig {
            ird: ird as u16,
            ord: ord as u16,
            peer_to_peer: Some(softrdma_proto::mpa::RtrOffer::WRITE_READ),
            ..Default::default()
        };
        mpa.max_private_data = crate::cm::ENGINE_PDATA_CAP;
        let config = softrdma_engine::cm::ConnectConfig {
            mpa,
            private_data: pdata,
            timeout: left.max(Duration::from_millis(1)),
        };
        match Connection::start(&self.qp, target, config) {
            Ok(conn) => {
                c.conn = Some(conn.clone());
                drop(c);
                ia.reactor.add_conn(Arc::downgrade(self), conn);
            }
            Err(_) => {
                let st = rules::step(c.state, EpEvent::NonPeerRejected, EpPolicy::default());
                if let Ok(st) = st {
                    c.state = st.next;
                    drop(c);
                    if let Some(r) = st.report {
                        self.report(r, Vec::new());
                    }
                }
            }
        }
    }

    pub(crate) fn weak(&self) -> Weak<EpInner> {
        self.self_weak.clone()
    }
}

#[derive(Debug)]
pub(crate) struct SrqInner {
    id: u64,
    pub(crate) srq: SharedReceiveQueue,
    rq: Mutex<HashMap<u64, u64>>,
    next: AtomicU64,
    max_iov: u32,
    user: AtomicUsize,
    pz: Mutex<Option<PzRef>>,
    _ia: ObjRef,
}

/// A shared receive queue (`DAT_SRQ_HANDLE`).
#[derive(Debug, Clone)]
pub struct Srq {
    pub(crate) inner: Arc<SrqInner>,
}

impl Srq {
    /// Creates an SRQ of `max_recv_dtos` receives of up to `max_recv_iov`
    /// segments (`dat_srq_create`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` for sizes the device refuses.
    pub fn new(ia: &Ia, pz: &Pz, max_recv_dtos: u32, max_recv_iov: u32) -> Result<Srq> {
        let srq = SharedReceiveQueue::new(&pz.inner.pd, max_recv_dtos, max_recv_iov.max(1), 0)
            .map_err(|_| err(ErrorType::InvalidParameter, Subtype::None))?;
        Ok(Srq {
            inner: Arc::new(SrqInner {
                id: crate::next_id(),
                srq,
                rq: Mutex::new(HashMap::new()),
                next: AtomicU64::new(1 << 62),
                max_iov: max_recv_iov.max(1),
                user: AtomicUsize::new(0),
                pz: Mutex::new(Some(PzRef::new(pz))),
                _ia: ObjRef::new(&ia.inner),
            }),
        })
    }

    /// A process-unique identifier.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Queue size.
    pub fn max_recv_dtos(&self) -> u32 {
        self.inner.srq.max_wr()
    }

    /// Segments per receive.
    pub fn max_recv_iov(&self) -> u32 {
        self.inner.max_iov
    }

    /// Receives posted and not consumed.
    pub fn outstanding(&self) -> usize {
        self.inner.srq.len()
    }

    /// See [`crate::Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// Posts a receive (`dat_srq_post_recv`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` (segments), `DAT_INSUFFICIENT_RESOURCES`
    /// (full).
    pub fn post_recv(&self, local: &[LmrTriplet], cookie: u64) -> Result<()> {
        Ep::check_iov(local, self.inner.max_iov)?;
        let (sg, _) = Ep::sges(local);
        let wr_id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let mut rq = self.inner.rq.lock();
        rq.insert(wr_id, cookie);
        if let Err(e) = self.inner.srq.post_recv(&RecvWr::new(wr_id, &sg)) {
            rq.remove(&wr_id);
            return Err(post_err(&e.to_string()));
        }
        Ok(())
    }

    /// `dat_srq_free`: the PZ is free to go at once (EPs still using the
    /// SRQ keep its receives).
    pub fn free(&self) {
        self.inner.pz.lock().take();
    }

    /// Sets the low watermark (`dat_srq_set_lw`).
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_PARAMETER` above the size.
    pub fn set_low_watermark(&self, lw: u32) -> Result<()> {
        self.inner
            .srq
            .modify_limit(lw)
            .map_err(|_| err(ErrorType::InvalidParameter, Subtype::Arg2))
    }
}

impl PartialEq for Srq {
    fn eq(&self, other: &Srq) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

#[allow(dead_code)]
fn _assert_send_sync() {
    fn f<T: Send + Sync>() {}
    f::<Ep>();
    f::<Evd>();
    f::<Srq>();
    f::<IaInner>();
}
