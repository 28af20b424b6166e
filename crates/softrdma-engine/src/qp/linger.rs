//! Lingering closes: the socket of a QP closed with
//! [`QueuePair::close_acknowledged`] is closed in order (FIN) once its peer
//! has acknowledged every byte handed to it, or once the linger has passed,
//! by the engine: the caller returns at once.
//!
//! The sockets waiting are kept in one list (of this fork generation), which
//! one timer looks at every [`ACK_POLL`] while it is not empty
//! (`ioctl(SIOCOUTQ)` per socket). A socket whose wait is over has what it
//! received and nobody read dropped (a socket closed with unread bytes
//! resets its connection), is shut down both ways (the FIN after the bytes
//! in the socket) and is let go: its descriptor is closed once the QP has
//! let go of it too (at its destroy, or its reset to IDLE).
//!
//! **At exit.** A process that exits right after closing (a return from
//! `main`, `exit(3)`) waits in its exit handler, registered with the first
//! lingering close, until every socket in the list has been closed: at
//! most the longest linger, not at all once the peers have acknowledged.
//! A close made after that handler returned (from an exit handler
//! registered before it, which runs after it, or a destructor) registers
//! it once more, and the exit waits for that socket too.
//! A process that ends without exit handlers (`_exit(2)`, a fatal signal,
//! an abort) leaves the sockets to the kernel, which closes them at once:
//! in order (FIN after the bytes sent) unless bytes received were unread
//! (then with a reset), without waiting for the acknowledgement. A forked
//! child closes none of its parent's sockets and does not wait for them.
//!
//! **A FIN that waits** ([`QueuePair::disconnect_acknowledged`]) is the
//! QP's own (its timer sends it); its socket is also listed here, as one
//! to wait for at exit only ([`hold_exit_until_ack`]): a process that
//! disconnects and exits without destroying the QP then ends once the
//! peer has acknowledged what is in the socket (the FIN goes, from the
//! QP's timer or from the kernel as the process ends, after that), not
//! with the FIN right behind the bytes the peer has not acknowledged yet.
//! The hold is listed only once the FIN is ready, every request posted
//! before it handed to the socket: requests still in the engine's own
//! queue at `exit` (the socket full, a slow peer) are not waited for (the
//! process may end before they reach the socket), as a device flushes
//! posted requests that never completed. The hold ends with the
//! connection: a QP destroyed or reset (its FIN, or a reset, goes at
//! once) no longer holds the exit.
//!
//! **Descriptor numbers.** A socket waits here by its descriptor number,
//! which the application does not know about: a `close_range(2)` /
//! `closefrom(3)` sweep, or a plain `close` of a stale number, may close it
//! while it waits, and a file the application opens next may get the
//! number. Each socket's identity (device and inode, `fstat(2)`) is noted
//! when it is listed and checked before every look and every act: a
//! number that no longer names that socket ends its wait and is never
//! read from, shut down or closed by this list, nor by whoever holds the
//! socket last (the QP's state, dropped after the list let go of it:
//! [`LinkStream`] notes it); the sweep closed the socket itself, at once,
//! as the kernel closes any socket. A
//! sweep that closes the number and reopens it between the check and the
//! act (some microseconds, in the engine's timer thread) is not covered,
//! nor a QP not destroyed yet (its descriptor is its own, closed at its
//! destroy; `ibv_destroy_qp` destroys it as it closes).
//!
//! [`QueuePair::close_acknowledged`]: super::QueuePair::close_acknowledged
//! [`QueuePair::disconnect_acknowledged`]: super::QueuePair::disconnect_acknowledged

use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, IntoRawFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::sys::process::PerFork;

/// How often the sockets waiting are asked whether their peers have
/// acknowledged everything.
pub(crate) const ACK_POLL: Duration = Duration::from_millis(1);

/// Longest wait for the list's lock at exit (the exiting thread may hold it
/// itself: `exit` called from a signal handler).
const EXIT_LOCK_WAIT: Duration = Duration::from_millis(100);

/// A connection's socket, shared by its QP, the receive path and this
/// list: its descriptor is closed when the last holder lets go, unless
/// [`forget`](LinkStream::forget) found its number naming another file by
/// then (the application closed it and reused the number), which is then
/// left open, never closed.
#[derive(Debug)]
pub(crate) struct LinkStream {
    /// `Some` until dropped.
    stream: Option<TcpStream>,
    /// The number is not ours any more: never close it.
    forgotten: AtomicBool,
}

impl LinkStream {
    /// Shares `stream`.
    pub(crate) fn new(stream: TcpStream) -> LinkStream {
        LinkStream {
            stream: Some(stream),
            forgotten: AtomicBool::new(false),
        }
    }

    /// The number no longer names this socket: whoever lets go of it last
    /// leaves the number alone instead of closing it.
    fn forget(&self) {
        self.forgotten.store(true, Ordering::Release);
    }
}

impl std::ops::Deref for LinkStream {
    type Target = TcpStream;
    fn deref(&self) -> &TcpStream {
        self.stream.as_ref().expect("open until dropped")
    }
}

impl AsRawFd for LinkStream {
    fn as_raw_fd(&self) -> RawFd {
        (**self).as_raw_fd()
    }
}

impl AsFd for LinkStream {
    fn as_fd(&self) -> BorrowedFd<'_> {
        (**self).as_fd()
    }
}

impl Drop for LinkStream {
    fn drop(&mut self) {
        if let Some(stream) = self.stream.take()
            && self.forgotten.load(Ordering::Acquire)
        {
            // Not ours to close any more.
            let _ = stream.into_raw_fd();
        }
    }
}

/// A socket waiting for its peer's acknowledgement.
struct Lingering {
    stream: Arc<LinkStream>,
    /// The socket's identity when it was listed (`None`: unknown, and then
    /// nothing is done on its number any more).
    id: Option<crate::sys::tcp::FileId>,
    deadline: Instant,
    /// Closed in order when the wait is over ([`close_after_ack`]); else
    /// only waited for at exit ([`hold_exit_until_ack`]).
    close: bool,
}

impl Lingering {
    fn new(stream: Arc<LinkStream>, linger: Duration, close: bool) -> Lingering {
        let now = crate::sys::clock::now();
        Lingering {
            id: crate::sys::tcp::file_id(stream.as_raw_fd()),
            stream,
            deadline: now.checked_add(linger).unwrap_or(now),
            close,
        }
    }

    /// Whether its descriptor number still names the socket listed.
    fn ours(&self) -> bool {
        self.id.is_some() && crate::sys::tcp::file_id(self.stream.as_raw_fd()) == self.id
    }

    /// Whether the wait is over at `now`: the peer acknowledged every byte
    /// (or the socket cannot tell: it is gone), the linger has passed, or
    /// the number names another file now (see the module's docs).
    fn over(&self, now: Instant) -> bool {
        now >= self.deadline
            || !self.ours()
            || !matches!(crate::sys::tcp::unacked_bytes(self.stream.as_raw_fd()), Ok(n) if n > 0)
    }

    /// Ends the wait. A socket to close is closed in order: what was
    /// received and not read is dropped, then the FIN goes after the bytes
    /// in the socket. Its descriptor is closed here if the QP has let go
    /// of it already; a number that no longer names the socket (the
    /// application closed it) is left alone, never closed, here or by
    /// whoever holds the socket last ([`LinkStream::forget`]).
    fn close(self) {
        let ours = self.ours();
        if ours && self.close {
            crate::sys::tcp::discard_received(self.stream.as_raw_fd());
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        #[cfg(test)]
        CLOSED.fetch_add(1, Ordering::Relaxed);
        if !ours {
            self.stream.forget();
        }
    }
}

#[derive(Default)]
struct Pending {
    list: Vec<Lingering>,
    /// The timer that looks at the list is armed.
    armed: bool,
    /// [`close_at_exit`] found the list empty and returned: a socket put
    /// in the list after that registers it once more.
    exit_done: bool,
}

impl Pending {
    /// Takes the sockets whose wait is over at `now` out of the list.
    fn take_over(&mut self, now: Instant) -> Vec<Lingering> {
        let mut over = Vec::new();
        let mut i = 0;
        while i < self.list.len() {
            if self.list[i].over(now) {
                over.push(self.list.swap_remove(i));
            } else {
                i += 1;
            }
        }
        over
    }
}

/// The sockets waiting, of this fork generation.
static PENDING: PerFork<Mutex<Pending>> = PerFork::new();

#[cfg(test)]
/// Tests: sockets closed by this module so far.
pub(crate) static CLOSED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Closes `stream` in order once its peer has acknowledged every byte
/// handed to it, at most `linger` from now, without waiting for that: the
/// engine's timer does. Ends any receive sleeping in the socket at once
/// (`shutdown(SHUT_RD)`, which sends nothing).
pub(crate) fn close_after_ack(stream: Arc<LinkStream>, linger: Duration) {
    let _ = stream.shutdown(Shutdown::Read);
    list(Lingering::new(stream, linger, true));
}

/// Keeps a process that exits (`exit(3)`) from ending before the peer of
/// `stream` has acknowledged every byte handed to it, at most `linger`
/// from now: for a FIN that waits for that acknowledgement in its QP
/// (`disconnect_acknowledged`), which sends it itself. Nothing is done on
/// the socket here.
pub(crate) fn hold_exit_until_ack(stream: Arc<LinkStream>, linger: Duration) {
    list(Lingering::new(stream, linger, false));
}

/// Ends the exit hold of `stream` ([`hold_exit_until_ack`]), if it is
/// listed: its connection was reset or closed without the wait (destroyed),
/// or dropped.
pub(crate) fn release_exit_hold(stream: &Arc<LinkStream>) {
    let Some(pending) = PENDING.peek() else {
        return;
    };
    let mut p = pending.lock();
    let mut released = Vec::new();
    let mut i = 0;
    while i < p.list.len() {
        if !p.list[i].close && Arc::ptr_eq(&p.list[i].stream, stream) {
            released.push(p.list.swap_remove(i));
        } else {
            i += 1;
        }
    }
    drop(p);
    for l in released {
        if !l.ours() {
            l.stream.forget();
        }
    }
}

/// Lists `l` (arming the timer, registering the exit handler), or ends it
/// at once if its wait is over.
fn list(l: Lingering) {
    if l.over(crate::sys::clock::now()) {
        l.close();
        return;
    }
    register_exit_handler();
    let mut p = PENDING.get(Default::default).lock();
    p.list.push(l);
    if p.exit_done {
        // The exit handler has found the list empty and returned (this
        // close comes from an exit handler registered before it, or a
        // destructor): another run waits for this socket (glibc runs a
        // handler registered while the handlers run, next).
        p.exit_done = false;
        crate::sys::process::at_exit(close_at_exit);
    }
    if !p.armed {
        p.armed = crate::timer::arm(ACK_POLL, tick).is_ok();
        if !p.armed {
            // No timer thread: closed at once (in order), as without the
            // wait.
            let all = std::mem::take(&mut p.list);
            drop(p);
            all.into_iter().for_each(Lingering::close);
        }
    }
}

/// The timer: closes the sockets whose wait is over, and looks again
/// [`ACK_POLL`] later while any is left.
fn tick() {
    let Some(pending) = PENDING.peek() else {
        return;
    };
    let mut p = pending.lock();
    let mut over = p.take_over(crate::sys::clock::now());
    p.armed = !p.list.is_empty() && crate::timer::arm(ACK_POLL, tick).is_ok();
    if !p.armed {
        over.append(&mut p.list);
    }
    // Closed under the lock (`Lingering::close` does not block): the exit
    // handler that finds the list empty must not return while a socket
    // taken out of it is still open (the process would end and the kernel
    // close it, a reset if received bytes were left unread).
    over.into_iter().for_each(Lingering::close);
    drop(p);
}

/// Registers [`close_at_exit`] (once per process).
fn register_exit_handler() {
    // (Not a `Once`: a forked child could wait for a parent thread that
    // was in it at the fork.)
    static REGISTERED: AtomicBool = AtomicBool::new(false);
    if !REGISTERED.load(Ordering::Relaxed) && !REGISTERED.swap(true, Ordering::Relaxed) {
        crate::sys::process::at_exit(close_at_exit);
    }
}

/// At `exit(3)`: waits until every socket of the list is closed (their
/// lingers bound it), closing those whose wait is over as the timer does.
extern "C" fn close_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        // This generation's list (a forked child's own, made here if it
        // lingered on no socket yet: a later close then finds
        // `exit_done`).
        let pending = PENDING.get(Default::default);
        loop {
            let Some(mut p) = pending.try_lock_for(EXIT_LOCK_WAIT) else {
                return;
            };
            let over = p.take_over(crate::sys::clock::now());
            let left = p.list.len();
            // (Under the lock: a socket put in the list after this look
            // finds it set.)
            p.exit_done = left == 0;
            drop(p);
            over.into_iter().for_each(Lingering::close);
            if left == 0 {
                return;
            }
            std::thread::sleep(ACK_POLL);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};

    /// The list finds the number naming another file while someone else
    /// (a QP's state not dropped yet, another entry) still holds the
    /// socket: the last holder leaves the number alone too.
    #[test]
    fn a_reused_number_is_not_closed_by_the_streams_last_holder() {
        let l = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_peer, _) = l.accept().unwrap();
        let number = c.as_raw_fd();
        let id = crate::sys::tcp::file_id(number);
        assert!(id.is_some());
        let stream = Arc::new(LinkStream::new(c));
        let other_holder = stream.clone();
        // Listed with another identity: as if the application had closed
        // the number and opened a file of its own on it (that file is
        // this socket here, so that a close shows).
        let l = Lingering {
            stream,
            id: Some((u64::MAX, u64::MAX)),
            deadline: crate::sys::clock::now(),
            close: true,
        };
        assert!(!l.ours());
        l.close();
        drop(other_holder);
        assert_eq!(
            crate::sys::tcp::file_id(number),
            id,
            "the number was closed by the stream's last holder"
        );
        // (The socket is left open: this test cannot close a bare number.)
    }
}
