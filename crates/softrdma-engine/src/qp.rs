//! Queue pairs (reliable connected, iWARP): creation, states, posting, and the
//! glue between the transmit path ([`crate::tx`]), the receive path
//! ([`crate::rx`]), the datamovers and the completion queues.
//!
//! Posting never blocks: a send request is validated, given its place in the
//! completion order and pushed on a lock-free queue; then the posting thread
//! tries the QP's transmit lock and, if it gets it and no datamover owns the
//! QP, frames and writes the FPDUs itself (direct sending). If the socket
//! would block, the QP is handed to its datamover.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use crossbeam_queue::{ArrayQueue, SegQueue};
use parking_lot::Mutex;
use softrdma_proto::mpa::{InitialMsns, Negotiated};
use softrdma_wire::ddp::{Msn, Stag};
use softrdma_wire::errcode::{TermCode, TermError};
use softrdma_wire::rdmap::atomic::AtomicRequestRepr;

use crate::cq::{CompletionQueue, Progress};
use crate::device::Device;
use crate::event::{AsyncEvent, AsyncEventKind};
use crate::pd::ProtectionDomain;
use crate::rx::RxState;
use crate::srq::SharedReceiveQueue;
use crate::state::{PostPolicy, QpState};
use crate::sys::io::tcp_maxseg;
use crate::tx::{Payload, SendWqe, TxLink, TxOutcome, TxState, WqeKind};
use crate::wc::{WcFlags, WcOpcode, WcStatus, WorkCompletion};
use crate::wr::{LocalSeg, RecvWqe, RecvWr, SendFlags, SendOp, SendWr};

/// How long a graceful close waits for the peer's FIN before it resets the
/// connection, unless changed with [`QueuePair::set_close_timeout`].
pub const DEFAULT_CLOSE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Requested sizes of a QP's queues (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive request.
    pub max_recv_sge: u32,
    /// Inline payload bytes per send request.
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 4,
            max_recv_sge: 4,
            max_inline_data: 64,
        }
    }
}

/// What a QP is created with (`ibv_qp_init_attr`).
#[derive(Debug, Clone)]
pub struct QpInitAttr {
    /// CQ of send-queue completions.
    pub send_cq: CompletionQueue,
    /// CQ of receive completions.
    pub recv_cq: CompletionQueue,
    /// Shared receive queue instead of the QP's own.
    pub srq: Option<SharedReceiveQueue>,
    /// Queue sizes.
    pub cap: QpCap,
    /// Every send request is signaled, whatever its flags.
    pub sq_sig_all: bool,
    /// Inbound RDMA Read / atomic requests the QP accepts outstanding (IRD).
    pub ird: u16,
    /// Outbound RDMA Read / atomic requests the QP keeps outstanding (ORD).
    pub ord: u16,
}

impl QpInitAttr {
    /// Default capabilities with these CQs, IRD = ORD = 16.
    pub fn new(send_cq: &CompletionQueue, recv_cq: &CompletionQueue) -> Self {
        QpInitAttr {
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            srq: None,
            cap: QpCap::default(),
            sq_sig_all: false,
            ird: 16,
            ord: 16,
        }
    }
}

/// What the connection settled, given to [`QueuePair::establish`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkParams {
    /// MPA CRC is used in both directions.
    pub crc: bool,
    /// The peer's IRD: this QP keeps at most `min(ord, peer_ird)` Reads and
    /// atomics outstanding.
    pub peer_ird: u16,
    /// The peer's ORD (informational: the QP's own IRD is what it enforces).
    pub peer_ord: u16,
    /// First MSNs of full operation (an RTR may have used MSN 1 of a queue).
    pub msns: InitialMsns,
}

impl Default for LinkParams {
    fn default() -> Self {
        LinkParams {
            crc: false,
            peer_ird: u16::MAX,
            peer_ord: u16::MAX,
            msns: InitialMsns {
                send_tx: Msn::INITIAL,
                read_tx: Msn::INITIAL,
                send_rx: Msn::INITIAL,
                read_rx: Msn::INITIAL,
            },
        }
    }
}

impl From<&Negotiated> for LinkParams {
    fn from(n: &Negotiated) -> Self {
        LinkParams {
            crc: n.crc,
            peer_ird: n.peer_ird.unwrap_or(u16::MAX),
            peer_ord: n.peer_ord.unwrap_or(u16::MAX),
            msns: n.initial_msns(),
        }
    }
}

/// Why a QP could not be created.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateQpError {
    /// A capability exceeds the device limit.
    #[error("{what} = {value} exceeds the device limit {max}")]
    Capability {
        /// Which capability.
        what: &'static str,
        /// Requested.
        value: u32,
        /// Device limit.
        max: u32,
    },
    /// A CQ, the SRQ or the PD belong to another device.
    #[error("the CQs, SRQ and PD of a QP must belong to the same device")]
    WrongDevice,
    /// The QP could not become a proxy QP.
    #[error(transparent)]
    Proxy(#[from] crate::proxy::ProxySetupError),
}

/// Why a send request was refused (nothing was queued).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostSendError {
    /// The QP state does not accept send requests.
    #[error("QP {qp_num} is in state {state}: send requests need RTS")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The send queue is full.
    #[error("send queue full ({depth} requests outstanding)")]
    QueueFull {
        /// The queue depth.
        depth: u32,
    },
    /// More SGEs than the QP was created for.
    #[error("{count} SGEs, the QP allows {max}")]
    TooManySges {
        /// SGEs in the request.
        count: usize,
        /// Limit.
        max: u32,
    },
    /// Inline payload larger than the QP allows.
    #[error("inline payload of {len} bytes, the QP allows {max}")]
    InlineTooLarge {
        /// Payload length.
        len: usize,
        /// Limit.
        max: u32,
    },
    /// The request's shape is invalid for its operation.
    #[error("invalid {op} request: {why}")]
    Invalid {
        /// Operation.
        op: &'static str,
        /// Reason.
        why: &'static str,
    },
}

/// Why a receive request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostRecvError {
    /// The QP state does not accept receives.
    #[error("QP {qp_num} is in state {state}: receives are not accepted")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The receive queue is full.
    #[error("receive queue full ({depth} requests posted)")]
    QueueFull {
        /// Queue depth.
        depth: u32,
    },
    /// More SGEs than the QP was created for.
    #[error("{count} SGEs, the QP allows {max}")]
    TooManySges {
        /// SGEs in the request.
        count: usize,
        /// Limit.
        max: u32,
    },
    /// The QP uses a shared receive queue: post to the SRQ.
    #[error("the QP uses a shared receive queue; post receives to it")]
    HasSrq,
}

/// Why a state change was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifyError {
    /// The transition is not one an application may request.
    #[error("QP {qp_num}: {from} -> {to} is not a valid transition")]
    InvalidTransition {
        /// The QP.
        qp_num: u32,
        /// Current state.
        from: QpState,
        /// Requested state.
        to: QpState,
    },
    /// RTS needs a connection.
    #[error("QP {qp_num} has no connection: RTS is reached by connecting")]
    NotConnected {
        /// The QP.
        qp_num: u32,
    },
    /// IRD/ORD may change only before the connection is established.
    #[error("QP {qp_num}: IRD/ORD can change only in IDLE or RTR")]
    IrdOrdFixed {
        /// The QP.
        qp_num: u32,
    },
}

/// Why [`QueuePair::establish`] failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EstablishError {
    /// The QP is not in IDLE or RTR.
    #[error("QP {qp_num} is in state {state}; a connection needs IDLE or RTR")]
    InvalidState {
        /// The QP.
        qp_num: u32,
        /// Its state.
        state: QpState,
    },
    /// The socket could not be set up.
    #[error("socket setup failed: {0}")]
    Io(#[from] io::Error),
}

/// What [`QueuePair::query`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct QpAttr {
    /// QP number.
    pub qp_num: u32,
    /// Current state.
    pub state: QpState,
    /// Capabilities.
    pub cap: QpCap,
    /// Inbound Read/atomic limit.
    pub ird: u16,
    /// Outbound Read/atomic limit (the effective one once connected).
    pub ord: u16,
    /// Every send request signaled.
    pub sq_sig_all: bool,
    /// CRC in use (once connected).
    pub crc: bool,
    /// Largest ULPDU payload per FPDU (once connected).
    pub max_fpdu_payload: usize,
    /// The datamover the QP is assigned to.
    pub datamover: usize,
    /// Peer address (once connected).
    pub peer: Option<SocketAddr>,
    /// Bytes written to the connection.
    pub bytes_sent: u64,
    /// Bytes read from the connection.
    pub bytes_received: u64,
}

/// An outstanding outbound Read or atomic (ORD entry).
#[derive(Debug)]
pub(crate) struct OutRead {
    pub(crate) seq: u64,
    pub(crate) kind: OutReadKind,
}

/// Kind of an [`OutRead`].
#[derive(Debug)]
pub(crate) enum OutReadKind {
    Read {
        sink: LocalSeg,
        sink_stag: u32,
        sink_to: u64,
        got: usize,
    },
    Atomic {
        request_id: u32,
        sink: LocalSeg,
    },
}

/// One send-queue request in completion order.
#[derive(Debug, Clone, Copy)]
struct Slot {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    status: Option<WcStatus>,
    byte_len: u32,
    vendor_err: u32,
    /// Posted by a proxy handler: its completion is the proxy's, never the
    /// application's.
    proxy_owned: bool,
}

/// Send-queue completion order.
#[derive(Debug, Default)]
struct CompQueue {
    slots: VecDeque<Slot>,
    /// Sequence number of `slots[0]`.
    base: u64,
}

/// A queue pair handle. Cloning gives another handle to the same QP; the QP
/// is destroyed (its connection closed, outstanding work flushed) when the
/// last handle is dropped.
#[derive(Debug, Clone)]
pub struct QueuePair {
    pub(crate) inner: Arc<QpHandle>,
}

/// Owner of a QP: destroying it tears the QP down.
#[derive(Debug)]
pub(crate) struct QpHandle {
    pub(crate) qp: Arc<QpInner>,
}

impl Drop for QpHandle {
    fn drop(&mut self) {
        self.qp.destroy();
    }
}

/// The shared state of a QP.
#[derive(Debug)]
pub(crate) struct QpInner {
    pub(crate) qp_num: u32,
    pub(crate) device: Device,
    pub(crate) pd: ProtectionDomain,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) srq: Option<SharedReceiveQueue>,
    pub(crate) cap: QpCap,
    sq_sig_all: bool,
    state: AtomicU8,
    state_lock: Mutex<()>,
    ird: AtomicU32,
    ord: AtomicU32,
    /// Effective ORD once connected: min(ord, peer IRD).
    ord_limit: AtomicU32,
    /// Inbound Reads/atomics accepted and not yet fully answered.
    ird_used: AtomicU32,
    pub(crate) datamover: usize,
    stream: Mutex<Option<Arc<TcpStream>>>,
    peer: Mutex<Option<SocketAddr>>,
    incoming: SegQueue<SendWqe>,
    sq_outstanding: AtomicU32,
    comp: Mutex<CompQueue>,
    ord_q: Mutex<VecDeque<OutRead>>,
    rq: ArrayQueue<RecvWqe>,
    pub(crate) tx: Mutex<TxState>,
    pub(crate) rx: Mutex<RxState>,
    /// Set while the QP is registered with the receive threads.
    pub(crate) rx_registered: AtomicBool,
    /// Set while a datamover lists the QP (active or paused).
    pub(crate) dm_listed: AtomicBool,
    /// When a CQ poll last drove this QP's receive path (engine clock, ns).
    pub(crate) last_poll: AtomicU64,
    /// The peer's FIN arrived (at an FPDU boundary).
    peer_fin: AtomicBool,
    /// Entering ERROR closes the connection in order instead of resetting
    /// it (QP destroyed by its owner).
    orderly_close: AtomicBool,
    /// How long a graceful close waits for the peer's FIN (ms).
    close_timeout_ms: AtomicU64,
    /// Proxy offload, once attached (IDLE only): filter, handler and the
    /// completion sequencer.
    pub(crate) proxy: std::sync::OnceLock<crate::proxy::ProxyLink>,
    pub(crate) self_weak: Weak<QpInner>,
    /// The connection manager's watch: told of every state change.
    state_watch: Mutex<Option<crate::cm::StateWatch>>,
}

impl QueuePair {
    /// Creates a QP in IDLE.
    pub fn new(pd: &ProtectionDomain, attr: &QpInitAttr) -> Result<QueuePair, CreateQpError> {
        let device = pd.device().clone();
        let a = device.attr();
        let check = |what, value: u32, max: u32| {
            if value > max {
                Err(CreateQpError::Capability { what, value, max })
            } else {
                Ok(())
            }
        };
        check("max_send_wr", attr.cap.max_send_wr, a.max_qp_wr)?;
        check("max_recv_wr", attr.cap.max_recv_wr, a.max_qp_wr)?;
        check("max_send_sge", attr.cap.max_send_sge, a.max_sge)?;
        check("max_recv_sge", attr.cap.max_recv_sge, a.max_sge)?;
        check(
            "max_inline_data",
            attr.cap.max_inline_data,
            a.max_inline_data,
        )?;
        check("ird", u32::from(attr.ird), a.max_qp_rd_atom)?;
        check("ord", u32::from(attr.ord), a.max_qp_init_rd_atom)?;
        let qp_num = device.alloc_qp_num();
        let datamover = device.threads().assign();
        let inner = Arc::new_cyclic(|weak| QpInner {
            qp_num,
            device: device.clone(),
            pd: pd.clone(),
            send_cq: attr.send_cq.clone(),
            recv_cq: attr.recv_cq.clone(),
            srq: attr.srq.clone(),
            cap: attr.cap,
            sq_sig_all: attr.sq_sig_all,
            state: AtomicU8::new(QpState::Idle.as_u8()),
            state_lock: Mutex::new(()),
            ird: AtomicU32::new(u32::from(attr.ird)),
            ord: AtomicU32::new(u32::from(attr.ord)),
            ord_limit: AtomicU32::new(u32::from(attr.ord)),
            ird_used: AtomicU32::new(0),
            datamover,
            stream: Mutex::new(None),
            peer: Mutex::new(None),
            incoming: SegQueue::new(),
            sq_outstanding: AtomicU32::new(0),
            comp: Mutex::new(CompQueue::default()),
            ord_q: Mutex::new(VecDeque::new()),
            rq: ArrayQueue::new(attr.cap.max_recv_wr.max(1) as usize),
            tx: Mutex::new(TxState::new()),
            rx: Mutex::new(RxState::new()),
            rx_registered: AtomicBool::new(false),
            dm_listed: AtomicBool::new(false),
            last_poll: AtomicU64::new(0),
            peer_fin: AtomicBool::new(false),
            orderly_close: AtomicBool::new(false),
            close_timeout_ms: AtomicU64::new(DEFAULT_CLOSE_TIMEOUT.as_millis() as u64),
            proxy: std::sync::OnceLock::new(),
            self_weak: weak.clone(),
            state_watch: Mutex::new(None),
        });
        let hook: Weak<dyn Progress> = Arc::downgrade(&inner) as Weak<dyn Progress>;
        inner.recv_cq.attach_progress(hook.clone());
        if !inner.send_cq.same_as(&inner.recv_cq) {
            inner.send_cq.attach_progress(hook);
        }
        Ok(QueuePair {
            inner: Arc::new(QpHandle { qp: inner }),
        })
    }

    fn qp(&self) -> &Arc<QpInner> {
        &self.inner.qp
    }

    /// The QP number.
    pub fn qp_num(&self) -> u32 {
        self.qp().qp_num
    }

    /// The current state.
    pub fn state(&self) -> QpState {
        self.qp().state()
    }

    /// The QP's attributes (`ibv_query_qp`).
    pub fn query(&self) -> QpAttr {
        let qp = self.qp();
        let tx = qp.tx.lock();
        let link = tx.link;
        let bytes_sent = tx.bytes_sent;
        drop(tx);
        let bytes_received = qp.rx.lock().bytes_received;
        QpAttr {
            qp_num: qp.qp_num,
            state: qp.state(),
            cap: qp.cap,
            ird: u16::try_from(qp.ird.load(Ordering::Relaxed)).unwrap_or(u16::MAX),
            ord: u16::try_from(qp.ord_limit.load(Ordering::Relaxed)).unwrap_or(u16::MAX),
            sq_sig_all: qp.sq_sig_all,
            crc: link.is_some_and(|l| l.crc),
            max_fpdu_payload: link.map_or(0, |l| l.max_payload),
            datamover: qp.datamover,
            peer: *qp.peer.lock(),
            bytes_sent,
            bytes_received,
        }
    }

    /// Changes the IRD and ORD the QP will negotiate (IDLE or RTR only).
    pub fn set_ird_ord(&self, ird: u16, ord: u16) -> Result<(), ModifyError> {
        let qp = self.qp();
        let _g = qp.state_lock.lock();
        if !matches!(qp.state(), QpState::Idle | QpState::Rtr) {
            return Err(ModifyError::IrdOrdFixed { qp_num: qp.qp_num });
        }
        qp.ird.store(u32::from(ird), Ordering::Relaxed);
        qp.ord.store(u32::from(ord), Ordering::Relaxed);
        qp.ord_limit.store(u32::from(ord), Ordering::Relaxed);
        Ok(())
    }

    /// Requests a state change (`ibv_modify_qp` with `IBV_QP_STATE`).
    ///
    /// * IDLE → RTR: receives may be posted before the connection exists.
    /// * → ERROR: outstanding work completes with flush errors, the
    ///   connection is closed abortively.
    /// * RTS → TERMINATE: a Terminate (RDMAP local catastrophic) is sent,
    ///   then the QP enters ERROR.
    /// * RTS → CLOSING: graceful disconnect, as [`QueuePair::disconnect`].
    /// * → ERROR from RTS: abortive disconnect (the connection is reset).
    /// * ERROR → IDLE: the QP is reset and can be connected again.
    pub fn modify(&self, to: QpState) -> Result<(), ModifyError> {
        let qp = self.qp();
        let from = qp.state();
        if !from.user_may_modify(to) {
            return Err(ModifyError::InvalidTransition {
                qp_num: qp.qp_num,
                from,
                to,
            });
        }
        match to {
            QpState::Rts if from != QpState::Rts => {
                Err(ModifyError::NotConnected { qp_num: qp.qp_num })
            }
            QpState::Error => {
                qp.abort(false);
                Ok(())
            }
            QpState::Terminate => {
                qp.fail(
                    TermError::RdmapLocalCatastrophic,
                    None,
                    AsyncEventKind::QpFatal,
                );
                Ok(())
            }
            QpState::Closing => {
                qp.begin_close(false);
                Ok(())
            }
            QpState::Idle if from == QpState::Error => {
                qp.reset();
                Ok(())
            }
            _ => {
                qp.set_state(to);
                Ok(())
            }
        }
    }

    /// Graceful disconnect: RTS → CLOSING. Posted receives are flushed, the
    /// send requests posted before the call still go out, then FIN is sent;
    /// when the peer's FIN has arrived too the QP reaches IDLE and the device
    /// reports [`AsyncEventKind::LlpClosed`]. If the peer's FIN does not come
    /// within the close timeout, the connection is reset: ERROR,
    /// everything flushed, [`AsyncEventKind::BadClose`].
    pub fn disconnect(&self) -> Result<(), ModifyError> {
        let qp = self.qp();
        let from = qp.state();
        if from != QpState::Rts {
            return Err(ModifyError::InvalidTransition {
                qp_num: qp.qp_num,
                from,
                to: QpState::Closing,
            });
        }
        qp.begin_close(false);
        Ok(())
    }

    /// Abortive disconnect: the connection is reset (RST), the QP enters
    /// ERROR and every outstanding request completes with a flush error;
    /// the device reports [`AsyncEventKind::LlpReset`].
    pub fn abort(&self) {
        self.qp().abort(false);
    }

    /// How long a graceful close waits for the peer's FIN
    /// ([`DEFAULT_CLOSE_TIMEOUT`] unless set).
    pub fn set_close_timeout(&self, timeout: std::time::Duration) {
        self.qp().close_timeout_ms.store(
            u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Moves the QP to RTS over a connected TCP stream positioned at the
    /// first FPDU of full operation (the MPA exchange is done), with what
    /// the negotiation settled.
    pub fn establish(&self, stream: TcpStream, params: &LinkParams) -> Result<(), EstablishError> {
        self.establish_with_prefix(stream, params, &[])
    }

    /// Like [`establish`](Self::establish), for a stream from which the
    /// caller has already read the first bytes of full operation (read-ahead
    /// of a stream-to-RDMA transition, or of an MPA exchange that read past
    /// the handshake): `already_read` is processed as FPDUs before anything
    /// read from the socket. At most 16 KiB.
    pub fn establish_with_prefix(
        &self,
        stream: TcpStream,
        params: &LinkParams,
        already_read: &[u8],
    ) -> Result<(), EstablishError> {
        if already_read.len() > 16 * 1024 {
            return Err(EstablishError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "more than 16 KiB of read-ahead",
            )));
        }
        let qp = self.qp();
        let _g = qp.state_lock.lock();
        let state = qp.state();
        if !matches!(state, QpState::Idle | QpState::Rtr) {
            return Err(EstablishError::InvalidState {
                qp_num: qp.qp_num,
                state,
            });
        }
        stream.set_nodelay(true)?;
        stream.set_nonblocking(true)?;
        let fd = stream.as_raw_fd();
        let mss = tcp_maxseg(fd).unwrap_or(1460);
        let max_payload = softrdma_wire::fpdu::mulpdu(mss, false)
            .saturating_sub(18)
            .max(64)
            & !3;
        let ord = qp
            .ord
            .load(Ordering::Relaxed)
            .min(u32::from(params.peer_ird));
        qp.ord_limit.store(ord, Ordering::Relaxed);
        *qp.peer.lock() = stream.peer_addr().ok();
        let stream = Arc::new(stream);
        *qp.stream.lock() = Some(stream.clone());
        {
            let mut tx = qp.tx.lock();
            tx.link = Some(TxLink {
                fd,
                crc: params.crc,
                max_payload,
            });
            tx.closed = false;
            tx.set_initial_msns(params.msns.send_tx, params.msns.read_tx);
        }
        qp.rx.lock().attach(
            stream,
            params.crc,
            params.msns.send_rx,
            params.msns.read_rx,
            already_read,
        );
        qp.peer_fin.store(false, Ordering::Release);
        qp.set_state(QpState::Rts);
        drop(_g);
        qp.device.threads().register_rx(qp, fd);
        if !already_read.is_empty() {
            // Bytes already here: the socket may never become readable for
            // them, so process them now.
            qp.rx_thread_progress();
        }
        qp.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::CommEstablished, qp.qp_num));
        Ok(())
    }

    /// Installs (or removes) the connection manager's state watch.
    pub(crate) fn set_state_watch(&self, w: Option<crate::cm::StateWatch>) {
        *self.qp().state_watch.lock() = w;
    }

    /// Posts one send-queue request (`ibv_post_send`). Never blocks.
    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        self.post_send_list(std::slice::from_ref(wr))
            .map_err(|(_, e)| e)
    }

    /// Posts several send-queue requests in order; they are framed and
    /// written together (one vectored write for many small messages). On
    /// error, returns the index of the first request not posted (the earlier
    /// ones are posted), like ibverbs' `bad_wr`.
    pub fn post_send_list(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostSendError)> {
        let qp = self.qp();
        let mut posted = 0usize;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            match qp.post_one(wr) {
                Ok(()) => posted += 1,
                Err(e) => {
                    result = Err((i, e));
                    break;
                }
            }
        }
        if posted > 0 {
            qp.kick();
        }
        result
    }

    /// Posts a receive (`ibv_post_recv`). Never blocks.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        self.qp().post_recv(wr)
    }

    /// The device of the QP.
    pub fn device(&self) -> &Device {
        &self.qp().device
    }

    /// Number of send requests posted and not yet completed.
    pub fn send_queue_len(&self) -> u32 {
        self.qp().sq_outstanding.load(Ordering::Relaxed)
    }

    /// Number of receives posted and not yet consumed.
    pub fn recv_queue_len(&self) -> usize {
        self.qp().rq.len()
    }
}

impl QpInner {
    pub(crate) fn state(&self) -> QpState {
        QpState::from_u8(self.state.load(Ordering::Acquire)).unwrap_or(QpState::Error)
    }

    fn set_state(&self, s: QpState) {
        self.state.store(s.as_u8(), Ordering::Release);
        if let Some(w) = self.state_watch.lock().as_ref() {
            w.notify(s);
        }
    }

    pub(crate) fn ord_outstanding(&self) -> u32 {
        u32::try_from(self.ord_q.lock().len()).unwrap_or(u32::MAX)
    }

    pub(crate) fn ord_limit(&self) -> u32 {
        self.ord_limit.load(Ordering::Relaxed)
    }

    pub(crate) fn push_ord(&self, r: OutRead) {
        self.ord_q.lock().push_back(r);
    }

    /// Runs `f` on the oldest outstanding Read/atomic.
    pub(crate) fn with_ord_front<R>(&self, f: impl FnOnce(Option<&mut OutRead>) -> R) -> R {
        let mut q = self.ord_q.lock();
        f(q.front_mut())
    }

    /// Removes the oldest outstanding Read/atomic.
    pub(crate) fn pop_ord(&self) -> Option<OutRead> {
        self.ord_q.lock().pop_front()
    }

    pub(crate) fn ird_limit(&self) -> u32 {
        self.ird.load(Ordering::Relaxed)
    }

    /// Takes an IRD slot; `false` if all are in use.
    pub(crate) fn take_ird(&self) -> bool {
        let limit = self.ird_limit();
        self.ird_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                (u < limit).then_some(u + 1)
            })
            .is_ok()
    }

    pub(crate) fn release_ird(&self) {
        let _ = self
            .ird_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| u.checked_sub(1));
    }

    /// Records the outcome of send-queue request `seq` and delivers the
    /// completions that are now in order.
    pub(crate) fn complete_sq(&self, seq: u64, status: WcStatus, byte_len: u32, vendor_err: u32) {
        let mut overflow = false;
        {
            let mut c = self.comp.lock();
            let Some(idx) = seq
                .checked_sub(c.base)
                .and_then(|i| usize::try_from(i).ok())
            else {
                return;
            };
            if let Some(s) = c.slots.get_mut(idx)
                && s.status.is_none()
            {
                s.status = Some(status);
                s.byte_len = byte_len;
                s.vendor_err = vendor_err;
            }
            while let Some(s) = c.slots.front().copied() {
                let Some(st) = s.status else { break };
                c.slots.pop_front();
                c.base += 1;
                self.sq_outstanding.fetch_sub(1, Ordering::AcqRel);
                if s.proxy_owned {
                    if let Some(link) = self.proxy.get() {
                        link.reply_completed(st);
                    }
                    continue;
                }
                if s.signaled || !st.is_success() {
                    let wc = WorkCompletion {
                        wr_id: s.wr_id,
                        status: st,
                        opcode: s.opcode,
                        byte_len: s.byte_len,
                        imm_data: 0,
                        invalidated_rkey: 0,
                        qp_num: self.qp_num,
                        flags: WcFlags::NONE,
                        vendor_err: s.vendor_err,
                        proxy_seq: 0,
                        proxy_note: 0,
                    };
                    let lost = match self.proxy.get() {
                        Some(link) => link.deliver(self, wc, true, false),
                        None => self.send_cq.push(wc, false).is_err(),
                    };
                    if lost {
                        overflow = true;
                    }
                }
            }
        }
        if overflow {
            self.cq_overflow();
        }
    }

    /// Delivers a receive completion.
    pub(crate) fn complete_recv(&self, wc: WorkCompletion, solicited: bool) {
        let lost = match self.proxy.get() {
            Some(link) => link.deliver(self, wc, false, solicited),
            None => self.recv_cq.push(wc, solicited).is_err(),
        };
        if lost {
            self.cq_overflow();
        }
    }

    pub(crate) fn cq_overflow(&self) {
        if self.state() != QpState::Error
            && let Some(qp) = self.self_weak.upgrade()
        {
            // Completions can no longer be delivered: the QP is unusable.
            std::thread::spawn(move || qp.enter_error(None, Some(AsyncEventKind::QpFatal)));
        }
    }

    /// A receive for an incoming Send: from the SRQ or the QP's queue.
    pub(crate) fn pop_recv(&self) -> Option<RecvWqe> {
        match &self.srq {
            Some(srq) => srq.pop(),
            None => self.rq.pop(),
        }
    }

    fn post_one(&self, wr: &SendWr<'_>) -> Result<(), PostSendError> {
        let signaled = self.sq_sig_all || wr.flags.contains(SendFlags::SIGNALED);
        let (opcode, wqe) = self.prepare_send(wr)?;
        self.enqueue(wr.wr_id, opcode, signaled, false, wqe)
    }

    /// Checks a send request as [`post_send`](QueuePair::post_send) would and
    /// returns it ready for [`enqueue`](Self::enqueue) (for proxy handlers,
    /// whose replies are posted only if the handler succeeds).
    pub(crate) fn prepare_send(
        &self,
        wr: &SendWr<'_>,
    ) -> Result<(WcOpcode, SendWqe), PostSendError> {
        let state = self.state();
        if state.send_policy() == PostPolicy::Reject {
            return Err(PostSendError::InvalidState {
                qp_num: self.qp_num,
                state,
            });
        }
        if wr.sg_list.len() > self.cap.max_send_sge as usize {
            return Err(PostSendError::TooManySges {
                count: wr.sg_list.len(),
                max: self.cap.max_send_sge,
            });
        }
        let inline = wr.flags.contains(SendFlags::INLINE);
        if inline && wr.inline.len() > self.cap.max_inline_data as usize {
            return Err(PostSendError::InlineTooLarge {
                len: wr.inline.len(),
                max: self.cap.max_inline_data,
            });
        }
        self.build_wqe(wr, inline)
    }

    /// Queues a checked request: takes a send-queue slot (completion order)
    /// and hands it to the transmit path, or flushes it in ERROR.
    pub(crate) fn enqueue(
        &self,
        wr_id: u64,
        opcode: WcOpcode,
        signaled: bool,
        proxy_owned: bool,
        wqe: SendWqe,
    ) -> Result<(), PostSendError> {
        let policy = self.state().send_policy();
        if policy == PostPolicy::Reject {
            return Err(PostSendError::InvalidState {
                qp_num: self.qp_num,
                state: self.state(),
            });
        }
        // Reserve a send-queue slot.
        let depth = self.cap.max_send_wr;
        if self
            .sq_outstanding
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < depth).then_some(n + 1)
            })
            .is_err()
        {
            return Err(PostSendError::QueueFull { depth });
        }
        let mut c = self.comp.lock();
        let seq = c.base + c.slots.len() as u64;
        c.slots.push_back(Slot {
            wr_id,
            opcode,
            signaled,
            status: None,
            byte_len: 0,
            vendor_err: 0,
            proxy_owned,
        });
        let mut wqe = wqe;
        wqe.seq = seq;
        if policy == PostPolicy::Flush || self.state() == QpState::Error {
            drop(c);
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
            return Ok(());
        }
        self.incoming.push(wqe);
        drop(c);
        Ok(())
    }

    /// Validates a send request and turns it into a queued request.
    fn build_wqe(
        &self,
        wr: &SendWr<'_>,
        inline: bool,
    ) -> Result<(WcOpcode, SendWqe), PostSendError> {
        let stags = self.device.stags();
        let pd = self.pd.id();
        let mut failed = None;
        let mut segs_for = |need_write: bool| -> Vec<LocalSeg> {
            let mut v = Vec::with_capacity(wr.sg_list.len());
            for sge in wr.sg_list {
                match stags.local(sge.lkey, pd, sge.addr, sge.length, need_write) {
                    Ok(seg) => v.push(seg),
                    Err(e) => {
                        failed = Some(e.wc_status());
                        return Vec::new();
                    }
                }
            }
            v
        };
        let sge_len: usize = wr.sg_list.iter().map(|s| s.length as usize).sum();
        let (payload, len) = if inline {
            (
                Payload::Inline(wr.inline.to_vec().into_boxed_slice()),
                wr.inline.len(),
            )
        } else {
            (Payload::None, sge_len)
        };
        let single_sink = |op: &'static str, exact: Option<u32>| -> Result<(), PostSendError> {
            if wr.sg_list.len() != 1 {
                return Err(PostSendError::Invalid {
                    op,
                    why: "needs exactly one SGE as its local sink",
                });
            }
            if let Some(n) = exact
                && wr.sg_list.first().map(|s| s.length) != Some(n)
            {
                return Err(PostSendError::Invalid {
                    op,
                    why: "the local sink must be 8 bytes",
                });
            }
            Ok(())
        };
        let mut wqe = SendWqe {
            seq: 0,
            kind: WqeKind::Local,
            payload,
            len,
            fence: wr.flags.contains(SendFlags::FENCE),
            solicited: wr.flags.contains(SendFlags::SOLICITED),
            failed: None,
        };
        if len > u32::MAX as usize {
            return Err(PostSendError::Invalid {
                op: "send",
                why: "message longer than 4 GiB",
            });
        }
        let data_payload = |segs: Vec<LocalSeg>, wqe: &mut SendWqe| {
            if !inline {
                wqe.payload = Payload::Segs(segs);
            }
        };
        let opcode = match wr.op {
            SendOp::Send | SendOp::SendWithImm { .. } | SendOp::SendWithInv { .. } => {
                let segs = if inline { Vec::new() } else { segs_for(false) };
                data_payload(segs, &mut wqe);
                wqe.kind = WqeKind::Send {
                    inv: match wr.op {
                        SendOp::SendWithInv { invalidate_rkey } => Some(invalidate_rkey),
                        _ => None,
                    },
                    imm: match wr.op {
                        SendOp::SendWithImm { imm } => Some(imm),
                        _ => None,
                    },
                };
                WcOpcode::Send
            }
            SendOp::Write { remote_addr, rkey }
            | SendOp::WriteWithImm {
                remote_addr, rkey, ..
            } => {
                let segs = if inline { Vec::new() } else { segs_for(false) };
                data_payload(segs, &mut wqe);
                wqe.kind = WqeKind::Write {
                    stag: rkey,
                    to: remote_addr,
                    imm: match wr.op {
                        SendOp::WriteWithImm { imm, .. } => Some(imm),
                        _ => None,
                    },
                };
                WcOpcode::RdmaWrite
            }
            SendOp::Read { remote_addr, rkey } => {
                single_sink("RDMA Read", None)?;
                let mut segs = segs_for(true);
                wqe.payload = Payload::None;
                let (sink_stag, sink_to) = wr.sg_list.first().map_or((0, 0), |s| (s.lkey, s.addr));
                match segs.pop() {
                    Some(sink) => {
                        wqe.kind = WqeKind::Read {
                            stag: rkey,
                            to: remote_addr,
                            sink,
                            sink_stag,
                            sink_to,
                        }
                    }
                    None => wqe.kind = WqeKind::Local,
                }
                WcOpcode::RdmaRead
            }
            SendOp::FetchAdd {
                remote_addr,
                rkey,
                add,
            }
            | SendOp::CmpSwap {
                remote_addr,
                rkey,
                compare: _,
                swap: add,
            } => {
                let is_cas = matches!(wr.op, SendOp::CmpSwap { .. });
                single_sink(if is_cas { "CmpSwap" } else { "FetchAdd" }, Some(8))?;
                if remote_addr % 8 != 0 {
                    return Err(PostSendError::Invalid {
                        op: "atomic",
                        why: "the remote address must be 8-byte aligned",
                    });
                }
                let mut segs = segs_for(true);
                wqe.payload = Payload::None;
                wqe.len = 8;
                let request_id = self.next_request_id();
                let req = match wr.op {
                    SendOp::CmpSwap { compare, swap, .. } => AtomicRequestRepr::cmp_swap(
                        request_id,
                        Stag(rkey),
                        remote_addr,
                        compare,
                        swap,
                    ),
                    _ => AtomicRequestRepr::fetch_add(request_id, Stag(rkey), remote_addr, add),
                };
                match segs.pop() {
                    Some(sink) => wqe.kind = WqeKind::Atomic { req, sink },
                    None => wqe.kind = WqeKind::Local,
                }
                if is_cas {
                    WcOpcode::CompSwap
                } else {
                    WcOpcode::FetchAdd
                }
            }
            SendOp::LocalInv { rkey } => {
                wqe.payload = Payload::None;
                if let Err(_e) = stags.invalidate(rkey, pd, false) {
                    failed = Some(WcStatus::LocalProtection);
                }
                WcOpcode::LocalInv
            }
            SendOp::BindMw {
                mw,
                mr,
                addr,
                length,
                access,
            } => {
                wqe.payload = Payload::None;
                if stags.bind_mw(mw, mr, addr, length, access).is_err() {
                    failed = Some(WcStatus::MwBind);
                }
                WcOpcode::BindMw
            }
            SendOp::FastReg {
                mr,
                iova,
                length,
                access,
            } => {
                wqe.payload = Payload::None;
                if stags.fast_reg(mr, iova, length, access).is_err() {
                    failed = Some(WcStatus::LocalProtection);
                }
                WcOpcode::RegMr
            }
        };
        wqe.failed = failed;
        Ok((opcode, wqe))
    }

    fn next_request_id(&self) -> u32 {
        static NEXT: AtomicU32 = AtomicU32::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    /// Puts a consumed receive back at the end of the receive queue (a
    /// proxy recycling the buffer of a message it served). False if the QP
    /// uses an SRQ, no longer accepts receives or its queue is full.
    pub(crate) fn repost_recv(&self, wqe: RecvWqe) -> bool {
        self.srq.is_none()
            && self.state().recv_policy() == PostPolicy::Accept
            && self.rq.push(wqe).is_ok()
    }

    fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        if self.srq.is_some() {
            return Err(PostRecvError::HasSrq);
        }
        let state = self.state();
        let policy = state.recv_policy();
        if policy == PostPolicy::Reject {
            return Err(PostRecvError::InvalidState {
                qp_num: self.qp_num,
                state,
            });
        }
        if wr.sg_list.len() > self.cap.max_recv_sge as usize {
            return Err(PostRecvError::TooManySges {
                count: wr.sg_list.len(),
                max: self.cap.max_recv_sge,
            });
        }
        let stags = self.device.stags();
        let pd = self.pd.id();
        let mut segs = Vec::with_capacity(wr.sg_list.len());
        let mut bad = None;
        for sge in wr.sg_list {
            match stags.local(sge.lkey, pd, sge.addr, sge.length, true) {
                Ok(s) => segs.push(s),
                Err(e) => {
                    bad = Some(e.wc_status());
                    break;
                }
            }
        }
        if let Some(status) = bad {
            // Hardware finds a bad receive when a Send uses it; softrdma
            // finds it at once. Like any error completion it puts the QP in
            // ERROR: the receives posted before it are flushed first
            // (completion order), then it completes with the error.
            self.enter_error(None, Some(AsyncEventKind::QpFatal));
            self.complete_recv(
                WorkCompletion::error(wr.wr_id, WcOpcode::Recv, self.qp_num, status),
                false,
            );
            return Ok(());
        }
        let total_len = segs.iter().map(|s| s.len).sum();
        let wqe = RecvWqe {
            wr_id: wr.wr_id,
            segs,
            total_len,
        };
        if policy == PostPolicy::Flush {
            self.flush_recv_one(wqe.wr_id);
            return Ok(());
        }
        if self.rq.push(wqe).is_err() {
            return Err(PostRecvError::QueueFull {
                depth: self.cap.max_recv_wr,
            });
        }
        if self.state() == QpState::Error {
            self.flush_rq();
        }
        Ok(())
    }

    fn flush_recv_one(&self, wr_id: u64) {
        self.complete_recv(
            WorkCompletion::error(wr_id, WcOpcode::Recv, self.qp_num, WcStatus::WrFlush),
            false,
        );
    }

    fn flush_rq(&self) {
        while let Some(w) = self.rq.pop() {
            self.flush_recv_one(w.wr_id);
        }
    }

    /// Moves queued requests into the transmit state (caller holds it).
    pub(crate) fn drain_incoming(&self, tx: &mut TxState) {
        while let Some(w) = self.incoming.pop() {
            if tx.closed {
                self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
            } else {
                tx.sq.push_back(w);
            }
        }
    }

    /// Direct sending: transmit in the calling thread if no one else is.
    pub(crate) fn kick(&self) {
        loop {
            let Some(mut tx) = self.tx.try_lock() else {
                // The holder re-checks the queue after unlocking.
                return;
            };
            self.drain_incoming(&mut tx);
            if tx.on_dm {
                return;
            }
            if self.device.config().force_datamover {
                if tx.has_work() {
                    tx.on_dm = true;
                    drop(tx);
                    self.schedule_dm();
                    return;
                }
                drop(tx);
                // A request pushed while we held the lock: its poster's
                // try-lock failed, so it is ours to hand over.
                if self.incoming.is_empty() {
                    return;
                }
                continue;
            }
            let outcome = tx.progress(self, usize::MAX);
            // A request that failed at post time reached the head of the
            // queue; act on it once what was framed before it is written
            // (the transmit path reports Idle then), not before.
            let fatal = if matches!(outcome, TxOutcome::Idle) {
                tx.fatal.take()
            } else {
                None
            };
            match outcome {
                TxOutcome::Idle | TxOutcome::Budget => {}
                TxOutcome::FinSent => {
                    drop(tx);
                    self.fin_sent();
                    return;
                }
                TxOutcome::WouldBlock => {
                    tx.on_dm = true;
                    drop(tx);
                    self.schedule_dm();
                    return;
                }
                TxOutcome::Failed(e) => {
                    drop(tx);
                    self.link_failed(&e);
                    return;
                }
            }
            drop(tx);
            if fatal.is_some() {
                // The failed request has its status already; the Reads and
                // atomics still outstanding are flushed.
                self.enter_error(None, Some(AsyncEventKind::QpFatal));
                return;
            }
            if self.incoming.is_empty() {
                return;
            }
        }
    }

    fn schedule_dm(&self) {
        if let Some(me) = self.self_weak.upgrade() {
            self.device.threads().schedule(&me);
        }
    }

    /// The connection failed (reset, lost).
    pub(crate) fn link_failed(&self, e: &io::Error) {
        if matches!(self.state(), QpState::Error | QpState::Idle) {
            return;
        }
        let detail = format!("connection failed: {e}");
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::LlpReset, self.qp_num).with_detail(detail));
        self.enter_error(None, None);
    }

    /// The peer closed the connection.
    pub(crate) fn link_closed(&self, at_boundary: bool) {
        let state = self.state();
        if matches!(state, QpState::Error | QpState::Idle) {
            return;
        }
        if at_boundary && matches!(state, QpState::Rts | QpState::Closing) {
            // The peer's FIN: a graceful close (started by the peer if we
            // are still in RTS).
            self.peer_fin.store(true, Ordering::Release);
            if state == QpState::Rts {
                self.begin_close(true);
            } else {
                self.tx.lock().peer_closed = true;
                self.kick();
            }
            self.try_finish_close();
            return;
        }
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::BadClose, self.qp_num));
        self.enter_error(None, None);
    }

    /// RTS → CLOSING: flush the posted receives, let the send queue drain,
    /// then FIN; arm the close timer.
    pub(crate) fn begin_close(&self, by_peer: bool) {
        {
            let _g = self.state_lock.lock();
            if self.state() != QpState::Rts {
                return;
            }
            self.set_state(QpState::Closing);
        }
        self.flush_rq();
        {
            let mut tx = self.tx.lock();
            tx.fin_pending = true;
            tx.peer_closed = by_peer;
        }
        self.kick();
        let weak = self.self_weak.clone();
        let timeout =
            std::time::Duration::from_millis(self.close_timeout_ms.load(Ordering::Relaxed));
        let spawned = std::thread::Builder::new()
            .name("softrdma-close".into())
            .spawn(move || {
                std::thread::sleep(timeout);
                if let Some(qp) = weak.upgrade()
                    && qp.state() == QpState::Closing
                {
                    qp.device.events().push(
                        AsyncEvent::qp(AsyncEventKind::BadClose, qp.qp_num)
                            .with_detail("the peer did not close in time; connection reset"),
                    );
                    qp.abort(true);
                }
            });
        if spawned.is_err() {
            // No timer: close abortively at once rather than hang forever.
            self.abort(true);
        }
    }

    /// The FIN went out (transmit path).
    pub(crate) fn fin_sent(&self) {
        self.try_finish_close();
    }

    /// CLOSING → IDLE once both FINs are exchanged.
    fn try_finish_close(&self) {
        if !self.peer_fin.load(Ordering::Acquire) {
            return;
        }
        if !self.tx.lock().fin_sent {
            return;
        }
        {
            let _g = self.state_lock.lock();
            if self.state() != QpState::Closing {
                return;
            }
            self.set_state(QpState::Idle);
        }
        // Reads and atomics the peer will never answer now, and anything
        // else still open, complete with flush errors, in order.
        let ord: Vec<OutRead> = self.ord_q.lock().drain(..).collect();
        for r in ord {
            self.complete_sq(r.seq, WcStatus::WrFlush, 0, 0);
        }
        let dropped = {
            let mut tx = self.tx.lock();
            let d = tx.clear();
            self.drain_incoming(&mut tx);
            d
        };
        for w in dropped {
            self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
        }
        self.flush_open_sq();
        self.flush_partial_recv();
        self.flush_rq();
        self.device.threads().unregister(self);
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::LlpClosed, self.qp_num));
    }

    /// Abortive close: reset the connection, then ERROR.
    pub(crate) fn abort(&self, timer: bool) {
        if matches!(self.state(), QpState::Error) {
            return;
        }
        if let Some(s) = self.stream.lock().as_ref() {
            let _ = crate::sys::io::reset_connection(s.as_raw_fd());
        }
        if !timer && !matches!(self.state(), QpState::Idle) {
            self.device.events().push(
                AsyncEvent::qp(AsyncEventKind::LlpReset, self.qp_num).with_detail("local abort"),
            );
        }
        self.enter_error(None, None);
    }

    /// A local error found on the connection: send a Terminate (if the
    /// connection still works), then ERROR.
    pub(crate) fn fail(&self, err: TermError, hdr: Option<&[u8]>, event: AsyncEventKind) {
        if matches!(self.state(), QpState::Error | QpState::Terminate) {
            return;
        }
        self.set_state(QpState::Terminate);
        {
            let mut tx = self.tx.lock();
            let mut repr = softrdma_wire::rdmap::terminate::TerminateRepr::new(err);
            if let Some(h) = hdr {
                repr.ddp = Some(softrdma_wire::rdmap::terminate::TerminatedDdp {
                    segment_length: 0,
                    header: h,
                });
            }
            tx.queue_terminate(&repr);
            // Best effort: a few non-blocking attempts.
            for _ in 0..64 {
                match tx.progress(self, usize::MAX) {
                    TxOutcome::WouldBlock => std::thread::yield_now(),
                    _ => break,
                }
                if !tx.has_work() {
                    break;
                }
            }
        }
        self.device.events().push(
            AsyncEvent::qp(event, self.qp_num)
                .with_term(err.code())
                .with_detail(format!("sent Terminate: {}", err.name())),
        );
        self.enter_error(None, None);
    }

    /// A Terminate arrived from the peer.
    pub(crate) fn terminated_by_peer(&self, code: TermCode) {
        self.device
            .events()
            .push(AsyncEvent::qp(AsyncEventKind::TerminateReceived, self.qp_num).with_term(code));
        // The oldest outstanding Read or atomic is the request the
        // Terminate answered; its completion carries the raw code.
        let status = term_status(code);
        let vendor = u32::from(u16::from_be_bytes(code.to_bytes()));
        // Stop framing before the ORD slot frees up: nothing behind the
        // answered request may reach the wire now.
        {
            let _g = self.state_lock.lock();
            if self.state() == QpState::Error {
                return;
            }
            self.set_state(QpState::Terminate);
        }
        if let Some(r) = self.pop_ord() {
            self.complete_sq(r.seq, status, 0, vendor);
        }
        self.enter_error(None, None);
    }

    /// Enters ERROR: flushes every outstanding request in order and closes
    /// the connection. `first_status`: status of the oldest outstanding
    /// Read/atomic (the request a remote error answered), if any.
    pub(crate) fn enter_error(
        &self,
        first_status: Option<WcStatus>,
        event: Option<AsyncEventKind>,
    ) {
        {
            let _g = self.state_lock.lock();
            if self.state() == QpState::Error {
                return;
            }
            self.set_state(QpState::Error);
        }
        if let Some(kind) = event {
            self.device.events().push(AsyncEvent::qp(kind, self.qp_num));
        }
        // Stop transmission; everything not completed is flushed.
        let dropped = {
            let mut tx = self.tx.lock();
            let d = tx.clear();
            self.drain_incoming(&mut tx);
            d
        };
        let mut ord: Vec<OutRead> = self.ord_q.lock().drain(..).collect();
        if let Some(st) = first_status
            && !ord.is_empty()
        {
            let r = ord.remove(0);
            self.complete_sq(r.seq, st, 0, 0);
        }
        for r in ord {
            self.complete_sq(r.seq, WcStatus::WrFlush, 0, 0);
        }
        for w in dropped {
            self.complete_sq(w.seq, WcStatus::WrFlush, 0, 0);
        }
        self.flush_open_sq();
        self.flush_partial_recv();
        self.flush_rq();
        if let Some(srq) = &self.srq {
            let _ = srq;
            self.device.events().push(AsyncEvent::qp(
                AsyncEventKind::QpLastWqeReached,
                self.qp_num,
            ));
        }
        self.close_link();
    }

    /// Requests already written but whose completion waits for earlier ones
    /// are complete; anything else still open is flushed.
    fn flush_open_sq(&self) {
        let open: Vec<u64> = {
            let c = self.comp.lock();
            c.slots
                .iter()
                .enumerate()
                .filter(|(_, s)| s.status.is_none())
                .map(|(i, _)| c.base + i as u64)
                .collect()
        };
        for seq in open {
            self.complete_sq(seq, WcStatus::WrFlush, 0, 0);
        }
    }

    /// Flushes the receives the receive path holds, if it is not running
    /// (if it is, it flushes them itself when it sees the state).
    fn flush_partial_recv(&self) {
        let partial = match self.rx.try_lock() {
            Some(mut rx) => {
                rx.detach();
                rx.take_partial()
            }
            None => Vec::new(),
        };
        for wr_id in partial {
            self.flush_recv_one(wr_id);
        }
    }

    pub(crate) fn rq_is_empty(&self) -> bool {
        self.rq.is_empty()
    }

    fn close_link(&self) {
        self.device.threads().unregister(self);
        // After a Terminate the connection closes in order (so the Terminate
        // is delivered); any other way into ERROR resets it, so the peer
        // learns at once. The descriptor stays open until the QP is freed
        // or reconnected: a datamover may still watch it, and must see the
        // hang-up rather than a recycled descriptor.
        let orderly = self.tx.lock().terminate_sent || self.orderly_close.load(Ordering::Acquire);
        if let Some(s) = self.stream.lock().as_ref() {
            if orderly {
                let _ = s.shutdown(Shutdown::Both);
            } else {
                let _ = crate::sys::io::reset_connection(s.as_raw_fd());
            }
        }
        if let Some(mut rx) = self.rx.try_lock() {
            rx.detach();
        }
        self.tx.lock().link = None;
    }

    /// ERROR → IDLE: forget the connection, keep the queues' sizes.
    fn reset(&self) {
        let _g = self.state_lock.lock();
        *self.tx.lock() = TxState::new();
        *self.rx.lock() = RxState::new();
        self.ird_used.store(0, Ordering::Relaxed);
        self.ord_limit
            .store(self.ord.load(Ordering::Relaxed), Ordering::Relaxed);
        self.set_state(QpState::Idle);
    }

    /// The last handle is gone: flush and close.
    fn destroy(&self) {
        if self.state() != QpState::Error {
            // Destroying a connected QP closes its connection in order (FIN
            // after what is already in the socket), like closing a socket;
            // use `abort` first for a reset.
            self.orderly_close.store(true, Ordering::Release);
            self.enter_error(None, None);
        }
        self.device.threads().unregister(self);
        let hook: Weak<dyn Progress> = self.self_weak.clone() as Weak<dyn Progress>;
        self.recv_cq.detach_progress(&hook);
        self.send_cq.detach_progress(&hook);
        self.device.threads().release(self.datamover);
    }
}

/// The completion status of the request that a Terminate with `code`
/// answered.
pub(crate) fn term_status(code: TermCode) -> WcStatus {
    use softrdma_wire::errcode::ErrorType;
    match code.error_type() {
        Some(ErrorType::RdmapRemoteProtection | ErrorType::DdpTaggedBuffer) => {
            WcStatus::RemoteAccess
        }
        Some(ErrorType::RdmapRemoteOperation) => WcStatus::RemoteOperation,
        Some(ErrorType::DdpUntaggedBuffer) => WcStatus::RemoteInvalidRequest,
        _ => WcStatus::Fatal,
    }
}

impl Progress for QpInner {
    fn armed(&self) {
        // Not busy-polled any more: let the receive thread watch the socket
        // now, not after the quiet period.
        if self.last_poll.swap(0, Ordering::Relaxed) != 0 {
            self.device.threads().wake_rx(self.datamover);
        }
    }

    fn progress(&self, armed: bool) -> bool {
        if !self.device.config().poll_driven_receive {
            return false;
        }
        self.rx_poll(!armed)
    }
}
