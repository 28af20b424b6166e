//! The QP as the engine threads see it ([`DmQp`]).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use super::QpInner;
use crate::datamover::{DmQp, Served};
use crate::state::QpState;

impl DmQp for QpInner {
    fn qp_num(&self) -> u32 {
        self.qp_num
    }

    fn datamover(&self) -> usize {
        self.datamover
    }

    fn dm_listed(&self) -> &AtomicBool {
        &self.dm_listed
    }

    fn rx_registered(&self) -> &AtomicBool {
        &self.rx_registered
    }

    fn rx_fd(&self) -> &AtomicI32 {
        &self.rx_fd
    }

    fn last_poll(&self) -> &AtomicU64 {
        &self.last_poll
    }

    fn poll_driven_receive(&self) -> bool {
        self.device.config().poll_driven_receive
    }

    fn receiving(&self) -> bool {
        matches!(self.state(), QpState::Rts | QpState::Closing)
    }

    fn rx_busy(&self) -> bool {
        self.rx.is_locked() || self.core_rx_wanted.load(Ordering::SeqCst)
    }

    fn serve(&self, slice: usize) -> Served {
        self.core_serve(slice)
    }

    fn rx_poll(&self, busy: bool) -> bool {
        QpInner::rx_poll(self, busy)
    }
}
