//! Shared receive queues, like `ibv_srq`.
//!
//! ```text
//!   application ──post_recv──▶ [ RecvWqe, RecvWqe, … ] ──pop──▶ receive path of
//!                  (SGEs checked             │                  any QP attached
//!                   at post time)            └─ fewer than `limit` left after a
//!                                               pop: one SrqLimitReached event
//! ```
//!
//! Receives posted to an SRQ are consumed, in order, by incoming Sends of
//! any QP created with it. The SGEs are checked against the registration
//! table when posted (valid lkey of the SRQ's protection domain, range inside
//! the region, local write access); a posted receive keeps its memory alive
//! until it is consumed.
//!
//! The *limit* works as in ibverbs: once armed with
//! [`modify_limit`](SharedReceiveQueue::modify_limit), the first consumption
//! that leaves fewer than `limit` receives posted raises one
//! [`AsyncEventKind::SrqLimitReached`] event on the device and disarms the
//! limit. An SRQ is not flushed when a QP using it goes to ERROR.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use crossbeam_queue::ArrayQueue;

use crate::event::{AsyncEvent, AsyncEventKind};
use crate::mr::LocalAccessError;
use crate::pd::ProtectionDomain;
use crate::sys::mem::Memory;
use crate::wr::{LocalSeg, RecvWqe, RecvWr};

/// Identifiers of shared receive queues, unique in the process.
static NEXT_SRQ_ID: AtomicU32 = AtomicU32::new(1);

/// Why a shared receive queue could not be created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CreateSrqError {
    /// `max_wr` is 0 or above the device's `max_srq_wr`.
    #[error("invalid SRQ size {requested} (must be 1..={max})")]
    InvalidMaxWr {
        /// Requested.
        requested: u32,
        /// The device's `max_srq_wr`.
        max: u32,
    },
    /// `max_sge` is above the device's `max_srq_sge`.
    #[error("invalid SGE count {requested} per SRQ request (at most {max})")]
    InvalidMaxSge {
        /// Requested.
        requested: u32,
        /// The device's `max_srq_sge`.
        max: u32,
    },
    /// `limit` is above `max_wr`.
    #[error("SRQ limit {limit} above the SRQ size {max_wr}")]
    InvalidLimit {
        /// Requested limit.
        limit: u32,
        /// The SRQ size.
        max_wr: u32,
    },
}

/// Why [`SharedReceiveQueue::post_recv`] refused a work request. Nothing was
/// posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostRecvError {
    /// `max_wr` receives are already posted.
    #[error("the shared receive queue is full")]
    Full,
    /// The request has more SGEs than the SRQ allows.
    #[error("{given} SGEs, more than the SRQ's {max}")]
    TooManySges {
        /// SGEs in the request.
        given: usize,
        /// The SRQ's `max_sge`.
        max: u32,
    },
    /// An SGE failed the registration check.
    #[error("SGE {index}: {error}")]
    LocalAccess {
        /// Index of the SGE in the request.
        index: usize,
        /// Why it was refused.
        error: LocalAccessError,
    },
}

/// Why [`SharedReceiveQueue::modify_limit`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModifySrqError {
    /// `limit` is above the SRQ's `max_wr`.
    #[error("SRQ limit {limit} above the SRQ size {max_wr}")]
    InvalidLimit {
        /// Requested limit.
        limit: u32,
        /// The SRQ size.
        max_wr: u32,
    },
}

/// A shared receive queue (`ibv_srq`). A cheap, clonable handle; the queue
/// (and the receives posted to it) lives as long as a handle (the
/// application's or a QP's) does.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    shared: Arc<SrqShared>,
}

struct SrqShared {
    id: u32,
    pd: ProtectionDomain,
    max_sge: u32,
    /// The posted receives, oldest first. Capacity `max_wr`.
    queue: ArrayQueue<RecvWqe>,
    /// The armed limit; 0 when disarmed.
    limit: AtomicU32,
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("id", &self.shared.id)
            .field("pd", &self.shared.pd.id())
            .field("max_wr", &self.max_wr())
            .field("max_sge", &self.shared.max_sge)
            .field("len", &self.len())
            .field("limit", &self.limit())
            .finish_non_exhaustive()
    }
}

impl SharedReceiveQueue {
    /// A shared receive queue of `max_wr` receives of up to `max_sge` SGEs
    /// each, in protection domain `pd` (`ibv_create_srq`). `limit` arms the
    /// limit event at once (0: not armed).
    ///
    /// # Errors
    ///
    /// [`CreateSrqError`] if a size is 0 or above the device's limits, or
    /// `limit` is above `max_wr`.
    pub fn new(
        pd: &ProtectionDomain,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<SharedReceiveQueue, CreateSrqError> {
        let attr = pd.device().attr();
        if max_wr == 0 || max_wr > attr.max_srq_wr {
            return Err(CreateSrqError::InvalidMaxWr {
                requested: max_wr,
                max: attr.max_srq_wr,
            });
        }
        if max_sge > attr.max_srq_sge {
            return Err(CreateSrqError::InvalidMaxSge {
                requested: max_sge,
                max: attr.max_srq_sge,
            });
        }
        if limit > max_wr {
            return Err(CreateSrqError::InvalidLimit { limit, max_wr });
        }
        let capacity = usize::try_from(max_wr).map_err(|_| CreateSrqError::InvalidMaxWr {
            requested: max_wr,
            max: attr.max_srq_wr,
        })?;
        Ok(SharedReceiveQueue {
            shared: Arc::new(SrqShared {
                id: NEXT_SRQ_ID.fetch_add(1, Ordering::Relaxed),
                pd: pd.clone(),
                max_sge,
                queue: ArrayQueue::new(capacity),
                limit: AtomicU32::new(limit),
            }),
        })
    }

    /// The SRQ's identifier (unique in the process; used in async events).
    pub fn id(&self) -> u32 {
        self.shared.id
    }

    /// The protection domain of the SRQ.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.shared.pd
    }

    /// Maximum number of posted receives.
    pub fn max_wr(&self) -> u32 {
        // The capacity came from a u32.
        u32::try_from(self.shared.queue.capacity()).unwrap_or(u32::MAX)
    }

    /// Maximum SGEs per receive.
    pub fn max_sge(&self) -> u32 {
        self.shared.max_sge
    }

    /// The armed limit (0: not armed).
    pub fn limit(&self) -> u32 {
        self.shared.limit.load(Ordering::Relaxed)
    }

    /// Number of receives posted and not yet consumed.
    pub fn len(&self) -> usize {
        self.shared.queue.len()
    }

    /// Whether no receive is posted.
    pub fn is_empty(&self) -> bool {
        self.shared.queue.is_empty()
    }

    /// Whether the SRQ is the same queue as `other` (both are handles of it).
    pub fn same_as(&self, other: &SharedReceiveQueue) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Posts a receive (`ibv_post_srq_recv`). Its SGEs are checked now: each
    /// must name a region of the SRQ's protection domain with local write
    /// access, and lie inside it.
    ///
    /// # Errors
    ///
    /// [`PostRecvError`]; nothing is posted then.
    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<(), PostRecvError> {
        let shared = &*self.shared;
        let max = usize::try_from(shared.max_sge).unwrap_or(usize::MAX);
        if wr.sg_list.len() > max {
            return Err(PostRecvError::TooManySges {
                given: wr.sg_list.len(),
                max: shared.max_sge,
            });
        }
        if shared.queue.is_full() {
            return Err(PostRecvError::Full);
        }
        let mut segs = Vec::with_capacity(wr.sg_list.len());
        let mut total_len = 0usize;
        for (index, sge) in wr.sg_list.iter().enumerate() {
            let seg = self
                .check_sge(sge.lkey, sge.addr, sge.length)
                .map_err(|error| PostRecvError::LocalAccess { index, error })?;
            total_len = total_len.saturating_add(seg.len);
            segs.push(seg);
        }
        shared
            .queue
            .push(RecvWqe {
                wr_id: wr.wr_id,
                segs: segs.into(),
                total_len,
            })
            .map_err(|_| PostRecvError::Full)
    }

    fn check_sge(&self, lkey: u32, addr: u64, len: u32) -> Result<LocalSeg, LocalAccessError> {
        let pd = &self.shared.pd;
        pd.device().stags().local(lkey, pd.id(), addr, len, true)
    }

    /// Arms the limit event (`ibv_modify_srq` with `IBV_SRQ_LIMIT`): the
    /// first consumption that leaves fewer than `limit` receives posted
    /// raises one [`AsyncEventKind::SrqLimitReached`] event and disarms it.
    /// `0` disarms. If fewer than `limit` are posted already, the event
    /// comes with the next consumption.
    ///
    /// # Errors
    ///
    /// [`ModifySrqError::InvalidLimit`] if `limit` is above `max_wr`.
    pub fn modify_limit(&self, limit: u32) -> Result<(), ModifySrqError> {
        let max_wr = self.max_wr();
        if limit > max_wr {
            return Err(ModifySrqError::InvalidLimit { limit, max_wr });
        }
        self.shared.limit.store(limit, Ordering::SeqCst);
        Ok(())
    }

    /// Takes the oldest posted receive (the receive path, for an incoming
    /// Send of a QP using this SRQ). Fires the limit event if this leaves
    /// fewer than the armed limit.
    #[allow(dead_code)] // used by the data path
    pub(crate) fn pop(&self) -> Option<RecvWqe> {
        let shared = &*self.shared;
        let wqe = shared.queue.pop()?;
        let limit = shared.limit.load(Ordering::SeqCst);
        if limit != 0
            && shared.queue.len() < limit as usize
            && shared
                .limit
                .compare_exchange(limit, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            shared.pd.device().events().push(
                AsyncEvent::srq(AsyncEventKind::SrqLimitReached, shared.id)
                    .with_detail(format!("fewer than {limit} receives posted")),
            );
        }
        Some(wqe)
    }
}

impl crate::mr::RecvSource for SharedReceiveQueue {
    fn pop_recv(&self) -> Option<softrdma_proto::mem::SharedRecv<Arc<Memory>>> {
        let w = self.pop()?;
        Some(softrdma_proto::mem::SharedRecv {
            wr_id: w.wr_id,
            segs: w.segs.into_iter().map(LocalSeg::into_span).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mr::Access;
    use crate::wr::Sge;
    use crate::{Device, MemoryRegion};

    fn setup() -> (Device, ProtectionDomain, MemoryRegion) {
        let dev = Device::open_default().unwrap();
        let pd = ProtectionDomain::new(&dev);
        let mr = pd.register(4096, Access::LOCAL_WRITE).unwrap();
        (dev, pd, mr)
    }

    fn sge(mr: &MemoryRegion, off: u64, len: u32) -> Sge {
        Sge {
            addr: mr.addr() + off,
            length: len,
            lkey: mr.lkey(),
        }
    }

    #[test]
    fn post_and_pop_in_order() {
        let (_dev, pd, mr) = setup();
        let srq = SharedReceiveQueue::new(&pd, 4, 2, 0).unwrap();
        for i in 0..4 {
            let sg = [sge(&mr, 0, 100), sge(&mr, 1000, 24)];
            srq.post_recv(&RecvWr::new(i, &sg)).unwrap();
        }
        assert_eq!(srq.len(), 4);
        let sg = [sge(&mr, 0, 1)];
        assert_eq!(
            srq.post_recv(&RecvWr::new(9, &sg)),
            Err(PostRecvError::Full)
        );
        for i in 0..4 {
            let wqe = srq.pop().unwrap();
            assert_eq!(wqe.wr_id, i);
            assert_eq!(wqe.total_len, 124);
            assert_eq!(wqe.segs.len(), 2);
            assert_eq!(wqe.segs[1].offset, 1000);
            assert_eq!(wqe.segs[1].len, 24);
        }
        assert!(srq.pop().is_none());
        assert!(srq.is_empty());
    }

    #[test]
    fn bad_sges_are_refused() {
        let (dev, pd, mr) = setup();
        let srq = SharedReceiveQueue::new(&pd, 4, 2, 0).unwrap();
        let three = [sge(&mr, 0, 1), sge(&mr, 0, 1), sge(&mr, 0, 1)];
        assert_eq!(
            srq.post_recv(&RecvWr::new(1, &three)),
            Err(PostRecvError::TooManySges { given: 3, max: 2 })
        );
        let out = [sge(&mr, 0, 1), sge(&mr, 4000, 100)];
        assert!(matches!(
            srq.post_recv(&RecvWr::new(1, &out)),
            Err(PostRecvError::LocalAccess {
                index: 1,
                error: LocalAccessError::OutOfBounds { .. }
            })
        ));
        let ro = pd.register(64, Access::default()).unwrap();
        let sg = [sge(&ro, 0, 8)];
        assert!(matches!(
            srq.post_recv(&RecvWr::new(1, &sg)),
            Err(PostRecvError::LocalAccess {
                index: 0,
                error: LocalAccessError::NoLocalWrite(_)
            })
        ));
        let other = ProtectionDomain::new(&dev)
            .register(64, Access::LOCAL_WRITE)
            .unwrap();
        let sg = [sge(&other, 0, 8)];
        assert!(matches!(
            srq.post_recv(&RecvWr::new(1, &sg)),
            Err(PostRecvError::LocalAccess {
                index: 0,
                error: LocalAccessError::PdMismatch(_)
            })
        ));
        let bad = [Sge {
            addr: mr.addr(),
            length: 8,
            lkey: mr.lkey() ^ 0x1,
        }];
        assert!(matches!(
            srq.post_recv(&RecvWr::new(1, &bad)),
            Err(PostRecvError::LocalAccess {
                index: 0,
                error: LocalAccessError::InvalidLkey(_)
            })
        ));
        assert!(srq.is_empty(), "nothing posted by a refused request");
        // No SGE at all is a valid zero-length receive.
        srq.post_recv(&RecvWr::new(7, &[])).unwrap();
        assert_eq!(srq.pop().unwrap().total_len, 0);
    }

    #[test]
    fn limit_event_fires_once() {
        let (dev, pd, mr) = setup();
        let srq = SharedReceiveQueue::new(&pd, 8, 1, 0).unwrap();
        let sg = [sge(&mr, 0, 8)];
        for i in 0..6 {
            srq.post_recv(&RecvWr::new(i, &sg)).unwrap();
        }
        srq.modify_limit(4).unwrap();
        assert_eq!(srq.limit(), 4);
        srq.pop().unwrap(); // 5 left
        srq.pop().unwrap(); // 4 left: not below
        assert!(dev.events().try_get().is_none());
        srq.pop().unwrap(); // 3 left: below
        let e = dev.events().try_get().unwrap();
        assert_eq!(e.kind, AsyncEventKind::SrqLimitReached);
        assert_eq!(e.srq_id, Some(srq.id()));
        assert_eq!(srq.limit(), 0, "disarmed");
        srq.pop().unwrap();
        assert!(dev.events().try_get().is_none(), "fires once");
        // Re-arm while already below: fires with the next consumption.
        srq.modify_limit(5).unwrap();
        srq.pop().unwrap();
        assert_eq!(
            dev.events().try_get().unwrap().kind,
            AsyncEventKind::SrqLimitReached
        );
        assert_eq!(
            srq.modify_limit(9),
            Err(ModifySrqError::InvalidLimit {
                limit: 9,
                max_wr: 8
            })
        );
        // Limit armed at creation.
        let srq = SharedReceiveQueue::new(&pd, 8, 1, 1).unwrap();
        srq.post_recv(&RecvWr::new(0, &sg)).unwrap();
        srq.pop().unwrap();
        assert_eq!(dev.events().try_get().unwrap().srq_id, Some(srq.id()));
    }

    #[test]
    fn creation_limits() {
        let (dev, pd, _mr) = setup();
        let attr = dev.attr();
        assert!(matches!(
            SharedReceiveQueue::new(&pd, 0, 1, 0),
            Err(CreateSrqError::InvalidMaxWr { .. })
        ));
        assert!(matches!(
            SharedReceiveQueue::new(&pd, attr.max_srq_wr + 1, 1, 0),
            Err(CreateSrqError::InvalidMaxWr { .. })
        ));
        assert!(matches!(
            SharedReceiveQueue::new(&pd, 4, attr.max_srq_sge + 1, 0),
            Err(CreateSrqError::InvalidMaxSge { .. })
        ));
        assert!(matches!(
            SharedReceiveQueue::new(&pd, 4, 1, 5),
            Err(CreateSrqError::InvalidLimit { .. })
        ));
        let a = SharedReceiveQueue::new(&pd, 4, 1, 4).unwrap();
        let b = SharedReceiveQueue::new(&pd, 4, 0, 0).unwrap();
        assert_ne!(a.id(), b.id());
        assert_eq!(a.max_wr(), 4);
        assert!(a.same_as(&a.clone()));
    }

    #[test]
    fn posted_receive_keeps_memory_after_dereg() {
        let (_dev, pd, mr) = setup();
        let srq = SharedReceiveQueue::new(&pd, 4, 1, 0).unwrap();
        let sg = [sge(&mr, 16, 8)];
        srq.post_recv(&RecvWr::new(1, &sg)).unwrap();
        mr.write(16, b"abcdefgh").unwrap();
        drop(mr);
        let wqe = srq.pop().unwrap();
        assert_eq!(wqe.segs[0].mem.to_vec(16, 8).unwrap(), b"abcdefgh");
    }
}
