//! Readiness of several streams and descriptors at once: `poll(2)` for
//! sockets direct.
//!
//! [`poll`] waits until one of its entries is ready, like `poll(2)`, for
//! any mix of [`TcpStream`]s (offloaded or plain) and other file
//! descriptors. Plain streams and descriptors are waited on by the
//! kernel; for an offloaded stream the thread sleeps on the queue pair's
//! socket itself ([`softrdma_engine::wait_set`]) and, when bytes come,
//! runs the receive path and the SDP processing in its own thread: an
//! event loop is woken directly by the bytes on the wire, with no engine
//! thread in between.
//!
//! [`wait_progress`] is the same wait for callers that keep their own
//! readiness state (an epoll instance holding the streams' readiness
//! descriptors): it also returns as soon as an offloaded stream's
//! completions were handled, whether or not that made an entry ready.
//!
//! ```no_run
//! use std::time::Duration;
//! use softrdma_sockets::poll::{poll, PollEntry, POLLIN};
//! # fn demo(a: &softrdma_sockets::TcpStream, b: &softrdma_sockets::TcpStream) -> std::io::Result<()> {
//! let mut entries = [PollEntry::stream(a, POLLIN), PollEntry::stream(b, POLLIN)];
//! if poll(&mut entries, Some(Duration::from_secs(1)), None)? > 0 {
//!     for e in &entries {
//!         if e.revents() & POLLIN != 0 { /* read it */ }
//!     }
//! }
//! # Ok(()) }
//! ```

use std::cell::RefCell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use softrdma_engine::wait_set::{SigSet, WaitError, WaitSet};

use crate::TcpStream;

/// `poll(2)`'s event bits (Linux values), for [`PollEntry`].
pub const POLLIN: i16 = 0x001;
/// Urgent data (never on an offloaded stream).
pub const POLLPRI: i16 = 0x002;
/// Writable.
pub const POLLOUT: i16 = 0x004;
/// Error (always reported).
pub const POLLERR: i16 = 0x008;
/// Hang-up (always reported).
pub const POLLHUP: i16 = 0x010;
/// Not an open descriptor (always reported).
pub const POLLNVAL: i16 = 0x020;
/// Normal data readable.
pub const POLLRDNORM: i16 = 0x040;
/// Normal data writable.
pub const POLLWRNORM: i16 = 0x100;
/// Priority data writable.
pub const POLLWRBAND: i16 = 0x200;

/// What a [`PollEntry`] watches.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// A sockets-direct stream.
    Stream(&'a TcpStream),
    /// Any other file descriptor (negative: ignored, as by `poll(2)`).
    Fd(RawFd),
}

/// One entry of [`poll`]: what to watch, for which events, and what was
/// found (`revents`).
#[derive(Debug, Clone, Copy)]
pub struct PollEntry<'a> {
    source: Source<'a>,
    events: i16,
    revents: i16,
}

impl<'a> PollEntry<'a> {
    /// A stream with interest `events` (`POLLIN`, `POLLOUT`, ...).
    pub fn stream(stream: &'a TcpStream, events: i16) -> PollEntry<'a> {
        PollEntry {
            source: Source::Stream(stream),
            events,
            revents: 0,
        }
    }

    /// A file descriptor with interest `events`.
    pub fn fd(fd: RawFd, events: i16) -> PollEntry<'a> {
        PollEntry {
            source: Source::Fd(fd),
            events,
            revents: 0,
        }
    }

    /// What the entry watches.
    pub fn source(&self) -> Source<'a> {
        self.source
    }

    /// The events found by the last [`poll`] (0: not ready).
    pub fn revents(&self) -> i16 {
        self.revents
    }
}

/// The `revents` of an offloaded stream: readable (data, end of stream or
/// an error) as a datagram socket reports it, writable likewise; only the
/// bits asked for.
fn offload_revents(readable: bool, writable: bool, events: i16) -> i16 {
    let mut r = 0;
    if readable {
        r |= POLLIN | POLLRDNORM;
    }
    if writable {
        r |= POLLOUT | POLLWRNORM | POLLWRBAND;
    }
    r & events
}

#[cfg(test)]
thread_local! {
    /// Offloaded streams looked at again after a wait, by this thread.
    static SECOND_LOOKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Longest single engine wait before the streams are looked at again.
const NAP_MAX: Duration = Duration::from_millis(100);

thread_local! {
    /// The calling thread's wait set, reused (its buffers).
    static SET: RefCell<WaitSet> = RefCell::new(WaitSet::new());
}

/// Waits until an entry is ready, at most `timeout` (`None`: no limit;
/// zero: look once), with the signal mask `mask` during the sleep if
/// given (`ppoll(2)`); fills every entry's [`revents`](PollEntry::revents)
/// and returns how many are ready (0: timed out). Level-triggered, as
/// `poll(2)`.
///
/// # Errors
///
/// `ErrorKind::Interrupted` (`EINTR`) if a signal was handled meanwhile;
/// the errno of `ppoll(2)` if it failed.
pub fn poll(
    entries: &mut [PollEntry<'_>],
    timeout: Option<Duration>,
    mask: Option<&SigSet>,
) -> io::Result<usize> {
    wait(entries, timeout, mask, false)
}

/// [`poll`] that also returns (possibly 0) as soon as the completions of
/// an offloaded stream of `entries` were handled (its readiness descriptor
/// is then up to date), even if no entry became ready, and at the latest
/// after 100 ms (so the caller can look at what changed): for callers whose
/// own readiness state (an epoll instance holding the streams' readiness
/// descriptors, with edge-triggered or one-shot registrations) decides
/// what is reported. Entries with no interest (`events` 0) are watched for
/// that only.
///
/// # Errors
///
/// As [`poll`].
pub fn wait_progress(
    entries: &mut [PollEntry<'_>],
    timeout: Option<Duration>,
    mask: Option<&SigSet>,
) -> io::Result<usize> {
    wait(entries, timeout, mask, true)
}

fn wait(
    entries: &mut [PollEntry<'_>],
    timeout: Option<Duration>,
    mask: Option<&SigSet>,
    on_progress: bool,
) -> io::Result<usize> {
    let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
    // A call from a signal handler that interrupted a call gets a set of
    // its own, as does a call after the thread's locals were destroyed:
    // glibc's `exit` destroys the exiting thread's before it runs the exit
    // handlers, which may poll (`with` would panic there).
    let r = SET.try_with(|set| {
        let mut set = set.try_borrow_mut().ok()?;
        let r = wait_in(&mut set, entries, deadline, mask, on_progress);
        // Holds no connection's CQ between calls.
        set.clear();
        Some(r)
    });
    match r {
        Ok(Some(r)) => r,
        _ => wait_in(&mut WaitSet::new(), entries, deadline, mask, on_progress),
    }
}

fn wait_in(
    set: &mut WaitSet,
    entries: &mut [PollEntry<'_>],
    deadline: Option<Instant>,
    mask: Option<&SigSet>,
    on_progress: bool,
) -> io::Result<usize> {
    {
        loop {
            set.clear();
            // Index in the set of each entry: CQ for offloaded streams,
            // descriptor otherwise.
            let mut idx = Vec::with_capacity(entries.len());
            let mut ready = 0;
            for e in entries.iter_mut() {
                e.revents = 0;
                match e.source {
                    Source::Stream(s) => match s.offload() {
                        Some(o) => {
                            let (r, w) = o.ready_now();
                            e.revents = offload_revents(r, w, e.events);
                            ready += usize::from(e.revents != 0);
                            idx.push(set.add_cq(o.cq()));
                        }
                        None => idx.push(set.add_fd(s.as_raw_fd(), e.events)),
                    },
                    Source::Fd(fd) => idx.push(set.add_fd(fd, e.events)),
                }
            }
            let now = Instant::now();
            // At most NAP_MAX per wait: a state change made by another
            // thread without a completion (a shutdown, say) is seen then.
            let left = deadline.map_or(NAP_MAX, |d| d.saturating_duration_since(now).min(NAP_MAX));
            let t = if ready > 0 { Duration::ZERO } else { left };
            set.wait_masked(Some(t), mask).map_err(|e| match e {
                WaitError::Interrupted => io::Error::from(rustix::io::Errno::INTR),
                other => io::Error::from_raw_os_error(other.raw_os_error()),
            })?;
            // The offloaded streams whose CQ got completions in the wait,
            // or that were ready before it, are looked at again (O(those),
            // not O(entries): an event loop waits on many connections). A
            // stream whose completions another thread took out and handled
            // meanwhile is not seen here: the wait then reports nothing
            // new, and the next round's first look, which looks at every
            // stream, finds it.
            ready = 0;
            for (e, &i) in entries.iter_mut().zip(&idx) {
                let offload = match e.source {
                    Source::Stream(s) => s.offload(),
                    Source::Fd(_) => None,
                };
                match offload {
                    Some(o) if e.revents != 0 || set.cq_ready(i) => {
                        #[cfg(test)]
                        SECOND_LOOKS.with(|n| n.set(n.get() + 1));
                        let (r, w) = o.ready_now();
                        e.revents = offload_revents(r, w, e.events);
                    }
                    Some(_) => {}
                    None => e.revents = set.fd_revents(i),
                }
                ready += usize::from(e.revents != 0);
            }
            if ready > 0 || on_progress || deadline.is_some_and(|d| Instant::now() >= d) {
                return Ok(ready);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    use super::*;
    use crate::{Config, Mode, TcpListener};

    fn pair(mode: Mode) -> (TcpStream, TcpStream) {
        let cfg = Config::with_mode(mode);
        let l = TcpListener::bind_with("127.0.0.1:0", &cfg).unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || TcpStream::connect_with(addr, &cfg).unwrap());
        let (s, _) = l.accept().unwrap();
        (t.join().unwrap(), s)
    }

    const T: Option<Duration> = Some(Duration::from_secs(10));

    #[test]
    fn offloaded_plain_and_a_pipe_in_one_poll() {
        let (mut c1, s1) = pair(Mode::Offload);
        let (mut c2, s2) = pair(Mode::Offload);
        let (mut c3, s3) = pair(Mode::Tcp);
        assert!(s1.transport().is_offloaded() && !s3.transport().is_offloaded());
        let (pr, mut pw) = std::io::pipe().unwrap();
        let ins = |e: &[PollEntry<'_>]| -> Vec<bool> {
            e.iter().map(|e| e.revents() & POLLIN != 0).collect()
        };
        let mut e = [
            PollEntry::stream(&s1, POLLIN),
            PollEntry::stream(&s2, POLLIN),
            PollEntry::stream(&s3, POLLIN),
            PollEntry::fd(pr.as_raw_fd(), POLLIN),
        ];
        assert_eq!(
            poll(&mut e, Some(Duration::from_millis(20)), None).unwrap(),
            0
        );
        c2.write_all(b"two").unwrap();
        assert_eq!(poll(&mut e, T, None).unwrap(), 1);
        assert_eq!(ins(&e), [false, true, false, false]);
        // Level-triggered: still ready until read.
        assert_eq!(poll(&mut e, T, None).unwrap(), 1);
        let mut b = [0u8; 8];
        assert_eq!((&s2).read(&mut b).unwrap(), 3);
        c3.write_all(b"3").unwrap();
        pw.write_all(b"p").unwrap();
        c1.write_all(b"1").unwrap();
        let mut seen = [false; 4];
        loop {
            assert!(poll(&mut e, T, None).unwrap() > 0);
            for (s, r) in seen.iter_mut().zip(ins(&e)) {
                *s |= r;
            }
            if seen[0] && seen[2] && seen[3] {
                break;
            }
        }
        assert_eq!(seen, [true, false, true, true]);
        // Writable at once.
        let mut w = [PollEntry::stream(&s1, POLLOUT | POLLIN)];
        assert_eq!(poll(&mut w, T, None).unwrap(), 1);
        assert_eq!(w[0].revents() & POLLOUT, POLLOUT);
    }

    #[test]
    fn end_of_stream_is_readable() {
        let (c, s) = pair(Mode::Offload);
        let mut e = [PollEntry::stream(&s, POLLIN)];
        assert_eq!(poll(&mut e, Some(Duration::ZERO), None).unwrap(), 0);
        drop(c);
        assert_eq!(poll(&mut e, T, None).unwrap(), 1);
        assert_eq!((&s).read(&mut [0u8; 4]).unwrap(), 0);
    }

    /// `wait_progress` returns once an offloaded stream's completions were
    /// handled, and its readiness descriptor is readable by then.
    #[test]
    fn wait_progress_updates_the_readiness_descriptor() {
        let (mut c, s) = pair(Mode::Offload);
        let rfd = s.readiness_fd().unwrap();
        // Kept in sync by the waits alone (no CQ arm, no engine thread).
        s.set_readiness_polled(true);
        let mut e = [PollEntry::stream(&s, 0)];
        assert_eq!(
            wait_progress(&mut e, Some(Duration::from_millis(20)), None).unwrap(),
            0
        );
        c.write_all(b"x").unwrap();
        let mut r = [PollEntry::fd(rfd, POLLIN)];
        loop {
            wait_progress(&mut e, T, None).unwrap();
            if poll(&mut r, Some(Duration::ZERO), None).unwrap() == 1 {
                break;
            }
        }
        assert_eq!(e[0].revents(), 0);
    }

    /// A bulk transfer driven by poll alone (as `nc` does): the writer
    /// waits for POLLOUT, the reader for POLLIN; every byte arrives.
    #[test]
    fn bulk_transfer_driven_by_poll() {
        let (c, s) = pair(Mode::Offload);
        c.set_nonblocking(true).unwrap();
        s.set_nonblocking(true).unwrap();
        let total = 8 << 20;
        let w = std::thread::spawn(move || {
            let chunk = vec![7u8; 16384];
            let mut sent = 0;
            while sent < total {
                let mut e = [PollEntry::stream(&c, POLLOUT)];
                assert_eq!(
                    poll(&mut e, T, None).unwrap(),
                    1,
                    "writer stalled at {sent}"
                );
                match (&c).write(&chunk[..chunk.len().min(total - sent)]) {
                    Ok(n) => sent += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => panic!("{e}"),
                }
            }
            c.shutdown(std::net::Shutdown::Write).unwrap();
            c
        });
        let mut got = 0;
        let mut b = vec![0u8; 65536];
        loop {
            let mut e = [PollEntry::stream(&s, POLLIN)];
            assert_eq!(poll(&mut e, T, None).unwrap(), 1, "reader stalled at {got}");
            match (&s).read(&mut b) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => panic!("{e}"),
            }
        }
        assert_eq!(got, total);
        drop(w.join().unwrap());
    }

    /// After a wait, only the streams whose CQ got completions (or that
    /// were ready before it) are looked at again, not every entry: one
    /// stream of sixteen receiving data costs one second look.
    #[test]
    fn a_wait_looks_again_only_at_streams_with_completions() {
        let pairs: Vec<(TcpStream, TcpStream)> = (0..16).map(|_| pair(Mode::Offload)).collect();
        let mut e: Vec<PollEntry<'_>> = pairs
            .iter()
            .map(|(_, s)| PollEntry::stream(s, POLLIN))
            .collect();
        assert_eq!(poll(&mut e, Some(Duration::ZERO), None).unwrap(), 0);
        let mut w = &pairs[5].0;
        w.write_all(b"x").unwrap();
        let before = SECOND_LOOKS.with(|n| n.get());
        let mut rounds = 0;
        while poll(&mut e, T, None).unwrap() == 0 {
            rounds += 1;
        }
        let looks = SECOND_LOOKS.with(|n| n.get()) - before;
        assert_eq!(e[5].revents() & POLLIN, POLLIN);
        assert!(
            e.iter()
                .enumerate()
                .all(|(k, x)| k == 5 || x.revents() == 0)
        );
        // One look per round at most (the round the bytes came in).
        assert!(
            looks <= rounds + 1,
            "{looks} second looks in {} rounds",
            rounds + 1
        );
        assert_eq!((&pairs[5].1).read(&mut [0u8; 4]).unwrap(), 1);
    }

    /// Regression: a poller woken by a completion that another thread (the
    /// completion callback of a connection with a readiness descriptor)
    /// handled first found the CQ empty and slept on, though the stream
    /// had become readable: every round must look at the streams again.
    #[test]
    fn poll_sees_data_whose_completion_another_thread_handled() {
        let (mut c, s) = pair(Mode::Offload);
        // A readiness descriptor arms the CQ: the engine's handler thread
        // handles completions too.
        s.readiness_fd().unwrap();
        let mut b = [0u8; 1];
        for i in 0..200u8 {
            let w = std::thread::spawn(move || {
                if i % 2 == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                c.write_all(&[i]).unwrap();
                c
            });
            let mut e = [PollEntry::stream(&s, POLLIN)];
            assert_eq!(poll(&mut e, T, None).unwrap(), 1, "round {i}");
            assert_eq!((&s).read(&mut b).unwrap(), 1);
            assert_eq!(b[0], i);
            c = w.join().unwrap();
        }
    }
}
