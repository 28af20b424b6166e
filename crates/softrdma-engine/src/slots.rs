//! Completion slots: requests complete in the order they were posted, even
//! when their outcomes are known out of order (a Write is done when written,
//! a Read when its response arrives, a flush at any time).
//!
//! Each posted request takes the next sequence number and a slot; recording
//! an outcome fills the slot (once: a later outcome for the same request is
//! ignored); the filled slots at the front are then delivered in order. The
//! QP keeps its send-queue slots in an [`InOrder`] under one lock and
//! delivers under that lock, so completions reach the CQ in posting order
//! and exactly once; the `cfg(loom)` test checks that against concurrent
//! completers and a concurrent flush.

use std::collections::VecDeque;

/// Slots in posting order; `T` is what a slot holds.
#[derive(Debug)]
pub(crate) struct InOrder<T> {
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
    /// Takes the next slot; returns its sequence number.
    pub(crate) fn push(&mut self, item: T) -> u64 {
        let seq = self.base + self.slots.len() as u64;
        self.slots.push_back((item, false));
        seq
    }

    /// Records the outcome of `seq` with `fill` unless it has one already
    /// (or was delivered); `true` if recorded.
    pub(crate) fn complete(&mut self, seq: u64, fill: impl FnOnce(&mut T)) -> bool {
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

    /// The oldest slot, if its outcome is recorded: it is delivered now.
    pub(crate) fn pop_ready(&mut self) -> Option<T> {
        if !self.slots.front().is_some_and(|(_, done)| *done) {
            return None;
        }
        self.base += 1;
        self.slots.pop_front().map(|(item, _)| item)
    }

    /// Sequence numbers of the slots without an outcome.
    pub(crate) fn open(&self) -> Vec<u64> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, (_, done))| !*done)
            .map(|(i, _)| self.base + i as u64)
            .collect()
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
        assert!(!q.complete(1, |_| {}), "delivered slots are gone");
        assert_eq!(q.push(7), 3);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::{Arc, Mutex};
    use loom::thread;

    /// Three requests; two completers finish the last two out of order
    /// while a flush (ERROR) completes whatever is open. Every request is
    /// delivered exactly once, in posting order.
    #[test]
    fn completions_in_order_exactly_once_against_a_flush() {
        loom::model(|| {
            let q = Arc::new(Mutex::new((InOrder::default(), Vec::new())));
            {
                let mut g = q.lock().unwrap();
                for i in 0..3u64 {
                    g.0.push(i);
                }
            }
            let complete = |q: &Mutex<(InOrder<u64>, Vec<u64>)>, seq: u64| {
                let mut g = q.lock().unwrap();
                let (slots, delivered) = &mut *g;
                slots.complete(seq, |_| {});
                while let Some(v) = slots.pop_ready() {
                    delivered.push(v);
                }
            };
            let a = {
                let q = q.clone();
                thread::spawn(move || complete(&q, 2))
            };
            let b = {
                let q = q.clone();
                thread::spawn(move || complete(&q, 1))
            };
            // The flush: everything still open, then deliver.
            let open = q.lock().unwrap().0.open();
            for seq in open {
                complete(&q, seq);
            }
            a.join().unwrap();
            b.join().unwrap();
            complete(&q, 0);
            assert_eq!(q.lock().unwrap().1, vec![0, 1, 2]);
        });
    }
}
