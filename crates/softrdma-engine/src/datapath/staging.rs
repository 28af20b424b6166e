//! The staging buffers of the connections' receive paths
//! ([`RxIo`](super::conn_io::RxIo)): a connection takes one at its first
//! read that needs it (not when it is made), and gives it back when its
//! receive state goes. Buffers given back are kept in a small process-wide
//! free list, so a new connection reuses one: no allocation and no zeroing
//! of 32 KiB per connection (a buffer is zeroed once, when first made;
//! the receive path only ever looks at the bytes a read put into it).
//! A `fork(2)`ed child keeps a free list of its own.

use parking_lot::Mutex;

/// Size of a staging buffer.
pub(crate) const STAGING: usize = 32 * 1024;

/// Buffers the process keeps for reuse (1 MiB): more connections than this
/// closing at once give the rest back to the allocator.
const KEEP: usize = 32;

/// A free list of staging buffers.
#[derive(Debug)]
pub(crate) struct Pool {
    free: Mutex<Vec<Vec<u8>>>,
    keep: usize,
}

impl Pool {
    /// An empty free list keeping at most `keep` buffers.
    pub(crate) const fn new(keep: usize) -> Pool {
        Pool {
            free: parking_lot::const_mutex(Vec::new()),
            keep,
        }
    }

    /// A buffer of [`STAGING`] bytes: a kept one (holding what an earlier
    /// connection read), or a new zeroed one.
    pub(crate) fn take(&self) -> Vec<u8> {
        // The lock's guard ends with this statement: a new buffer is
        // allocated and zeroed outside it.
        let kept = self.free.lock().pop();
        kept.unwrap_or_else(|| vec![0u8; STAGING])
    }

    /// Keeps `buf` for reuse if it is a staging buffer of the usual size
    /// (one that grew for batched reads goes back to the allocator) and
    /// fewer than `keep` are kept.
    pub(crate) fn give(&self, buf: Vec<u8>) {
        if buf.len() != STAGING || buf.capacity() != STAGING {
            return;
        }
        let mut free = self.free.lock();
        if free.len() < self.keep {
            free.push(buf);
        }
    }

    /// Buffers kept.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> usize {
        self.free.lock().len()
    }
}

/// The process's free list: one per fork generation (a `fork(2)`ed child
/// never takes the lock of its parent's, which a thread that does not
/// exist in the child may have held at the fork).
pub(crate) fn pool() -> &'static Pool {
    static POOL: crate::sys::process::PerFork<Pool> = crate::sys::process::PerFork::new();
    POOL.get(|| Pool::new(KEEP))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::conn_io::RxIo;

    /// A connection's receive state takes no staging buffer until a read
    /// needs one (before, every connection allocated and zeroed 32 KiB
    /// when it was made, whether it received or not); with bytes read
    /// ahead of the connection it takes one at once, holding them.
    #[test]
    fn no_staging_buffer_until_the_first_read() {
        let mut rx = RxIo::new(&[]);
        assert_eq!(rx.staging_capacity(), 0);
        let buf = rx.take_staging().expect("a buffer for a sleeping read");
        assert_eq!(buf.len(), STAGING);
        rx.put_staging(buf, 0);
        assert_eq!(rx.staging_capacity(), STAGING);

        let ahead = RxIo::new(b"read ahead");
        assert_eq!(ahead.staging_capacity(), STAGING);
    }

    /// Buffers given back are reused (no allocation, no zeroing), up to
    /// the bound; a grown one is not kept.
    #[test]
    fn given_buffers_are_reused_up_to_the_bound() {
        let pool = Pool::new(2);
        let mut a = pool.take();
        a[0] = 7;
        let a_ptr = a.as_ptr();
        pool.give(a);
        assert_eq!(pool.kept(), 1);
        let again = pool.take();
        assert_eq!(again.as_ptr(), a_ptr);
        assert_eq!(again[0], 7, "reused as it was, not zeroed again");
        assert_eq!(pool.kept(), 0);
        let mut grown = pool.take();
        grown.resize(4 * STAGING, 0);
        pool.give(grown);
        assert_eq!(pool.kept(), 0);
        for _ in 0..3 {
            pool.give(vec![0u8; STAGING]);
        }
        assert_eq!(pool.kept(), 2);
        pool.give(again);
        assert_eq!(pool.kept(), 2);
    }
}
