//! Completion order: requests complete in the order they were posted, even
//! when their outcomes are known out of order (a Write is done when its
//! last FPDU is written, a Read when its response arrives, a flush at any
//! time).
//!
//! Each posted request takes the next sequence number and a slot
//! ([`InOrder::push`]); recording an outcome fills the slot once
//! ([`InOrder::complete`]: a later outcome for the same request is
//! ignored); the filled slots at the front are then delivered in order
//! ([`InOrder::pop_ready`]). [`crate::conn::Connection`] keeps its
//! send-queue slots in one, and so does the engine's QP (under one lock,
//! delivering under it: completions reach the CQ in posting order and
//! exactly once; the engine's loom model checks that against concurrent
//! completers and a concurrent flush).

use std::collections::VecDeque;

/// Slots in posting order; `T` is what a slot holds (the request's
/// identity and, once known, its outcome).
#[derive(Debug, Clone)]
pub struct InOrder<T> {
    slots: VecDeque<(T, bool)>,
    /// Sequence number of `slots[0]`.
    base: u64,
}

impl<T> Default for InOrder<T> {
    fn default() -> Self {
        InOrder {
            slots: VecDeque::new(),
            base: 0,
        }
    }
}

impl<T> InOrder<T> {
    /// No slots; the first [`push`](Self::push) gets sequence number 0.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes the next slot; returns its sequence number.
    pub fn push(&mut self, item: T) -> u64 {
        let seq = self.base + self.slots.len() as u64;
        self.slots.push_back((item, false));
        seq
    }

    /// Records the outcome of `seq` with `fill` unless it has one already
    /// or was delivered; `true` if recorded.
    pub fn complete(&mut self, seq: u64, fill: impl FnOnce(&mut T)) -> bool {
        let Some(idx) = seq
            .checked_sub(self.base)
            .and_then(|i| usize::try_from(i).ok())
        else {
            return false;
        };
        match self.slots.get_mut(idx) {
            Some((item, done)) if !*done => {
                fill(item);
                *done = true;
                true
            }
            _ => false,
        }
    }

    /// The oldest slot, if its outcome is recorded: it is delivered now
    /// (and leaves the queue).
    pub fn pop_ready(&mut self) -> Option<T> {
        if !self.slots.front().is_some_and(|(_, done)| *done) {
            return None;
        }
        self.base += 1;
        self.slots.pop_front().map(|(item, _)| item)
    }

    /// Sequence numbers of the slots without an outcome, oldest first.
    #[must_use]
    pub fn open(&self) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (_, done))| !*done)
            .map(|(i, _)| self.base + i as u64)
            .collect()
    }

    /// Slots not yet delivered (with or without an outcome).
    #[must_use]
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// No slot waits for delivery.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_order_outcomes_are_delivered_in_order_once() {
        let mut q = InOrder::default();
        let s: Vec<u64> = (0..3).map(|i| q.push(i * 10)).collect();
        assert_eq!(s, [0, 1, 2]);
        assert_eq!(q.len(), 3);
        assert!(q.complete(2, |v| *v += 2));
        assert_eq!(q.pop_ready(), None);
        assert!(q.complete(0, |v| *v += 1));
        assert!(!q.complete(0, |v| *v += 100), "second outcome ignored");
        assert_eq!(q.pop_ready(), Some(1));
        assert_eq!(q.pop_ready(), None);
        assert_eq!(q.open(), [1]);
        assert!(q.complete(1, |_| {}));
        assert_eq!(q.pop_ready(), Some(10));
        assert_eq!(q.pop_ready(), Some(22));
        assert!(q.is_empty());
        assert!(!q.complete(1, |_| {}), "delivered slots are gone");
        assert!(!q.complete(9, |_| {}), "never-pushed slots are ignored");
        assert_eq!(q.push(7), 3);
    }
}
