//! # softrdma-sockets: sockets direct
//!
//! A user-space *offload protocol switch* (the OPS of the Offload Sockets
//! Framework design) with the Sockets Direct Protocol (SDP) as its first
//! offload protocol, carried over softrdma queue pairs; every connection
//! is decided on its own: offloaded when both ends run sockets direct,
//! plain kernel TCP otherwise.
//!
//! ```no_run
//! use std::io::{Read, Write};
//! use softrdma_sockets::{TcpListener, TcpStream};
//!
//! let listener = TcpListener::bind("127.0.0.1:0")?; // plain and offloaded clients
//! let addr = listener.local_addr()?;
//! let client = std::thread::spawn(move || -> std::io::Result<()> {
//!     let mut s = TcpStream::connect(addr)?; // offloaded: the server can
//!     println!("{}", s.transport());
//!     s.write_all(b"hello")?;
//!     Ok(())
//! });
//! let (mut s, _) = listener.accept()?;
//! let mut buf = Vec::new();
//! s.read_to_end(&mut buf)?;
//! assert_eq!(buf, b"hello");
//! client.join().unwrap()?;
//! # Ok::<(), std::io::Error>(())
//! ```
//!
//! ## The switch
//!
//! iWARP *is* TCP: an offloaded connection is the very kernel TCP
//! connection the application opened, switched into RDMA mode by the
//! engine's stream-to-RDMA transition
//! ([`softrdma_engine::transition::StreamConnection`]): an MPA exchange on
//! the stream whose private data carries the SDP Hello and HelloAck. So:
//!
//! - the port space is the kernel's (one bind, one listen: *dual listen*
//!   is one kernel listener whose accepted connections are decided one by
//!   one);
//! - names, `SO_KEEPALIVE`/`TCP_KEEP*`, `SO_LINGER`, `ss` and
//!   `/proc/net/tcp` stay true: the descriptor behind [`TcpStream`]'s
//!   `AsRawFd` is (a duplicate of) the real socket, which the queue pair
//!   keeps using; only who parses its bytes changed. Keepalive is the
//!   kernel's, no helper thread is needed;
//! - fallback costs nothing: if the peer cannot, the stream is simply
//!   never switched.
//!
//! The decision is made before any byte is sent: an MPA Request on the
//! stream of a plain server would be application data to it. The client
//! asks the server's *UDP twin* first (see [`detect`]); a plain client never
//! asks, a plain server never answers, so a plain peer on either side gets
//! a plain connection carrying exactly the application's bytes, whoever
//! speaks first. Modes ([`Mode`]): `Auto` (offload when the peer can),
//! `Offload` (required; a clear error otherwise), `Tcp`.
//!
//! An offload setup that fails (the switch times out, the peer's Hello is
//! wrong) fails before application data: the client makes a fresh plain
//! connection ([`PlainReason::SetupFailed`]), the listener drops the
//! half-set-up one. Once offloaded, a connection never falls back; later
//! errors are socket errors. [`TcpStream::transport`] tells which
//! ([`Transport`]) and why.
//!
//! An application that negotiates on its own stream first (iSER-style)
//! can switch it at an agreed point with [`TcpStream::upgrade`].
//!
//! ## SDP over iWARP
//!
//! See [`sdp`] for the messages and credits. Buffered copy: every Data
//! message goes into a posted receive buffer, never beyond the credits
//! (iWARP has no receiver-not-ready retry: a Send without a receive is a
//! Terminate). Shutdown for writing sends DisConn after the queued data
//! (EOF at the peer after it); [`TcpStream::abort`], or closing with unread
//! data, sends AbortConn and resets. Small writes are corked while an
//! earlier message is still queued in the engine, unless `TCP_NODELAY`.
//!
//! Read zero copy, when both Hellos offer it ([`sdp::CAP_READ_ZCOPY`];
//! off with [`Config::zcopy_threshold`] 0): a blocking write of at least
//! the threshold lends the application's buffer to the engine for the
//! call ([`softrdma_engine::ProtectionDomain::lend`]) and sends SrcAvail;
//! the reader RDMA-Reads it straight into its own buffer (lent the same
//! way) and answers RdmaRdCompl; the write returns once the peer has read
//! it all. A peek, a non-blocking read or a read buffer under 128 KiB
//! answers SendSm instead and the writer copies (buffered). After
//! [`Config::zcopy_timeout`] or the write timeout the writer withdraws its
//! offer (SrcAvailCancel) and copies once the reader acknowledges; with a
//! write timeout set, a reader that never acknowledges gets the connection
//! reset. A signal handled while the offer is pending withdraws it the
//! same way (`EINTR` semantics): the write returns the octets the reader
//! had read, or `ErrorKind::Interrupted` if none (a reader that does not
//! acknowledge within [`Config::zcopy_timeout`] gets the connection
//! reset). Either way the call returns only when nothing can touch the
//! buffer any more: the engine removed its STag and no Read Response is
//! still being sent from it. Other blocked calls go on after a signal, as
//! the kernel restarts calls interrupted by an `SA_RESTART` handler.
//!
//! A process that exits (`exit(3)`) without closing an offloaded stream
//! still sends what the library held for it (corked, Nagle-held, waiting
//! for credits), then a DisConn, within a bounded time
//! (`SOFTRDMA_SOCKETS_EXIT_FLUSH_MS`, default 1000, `0`: off), as the
//! kernel's TCP sends a socket's data at the implicit close; see the
//! crate's README, *Data at exit*.
//!
//! ## Readiness
//!
//! [`TcpStream::readiness_fd`] gives a descriptor for poll/epoll that is
//! readable when data, EOF or an error is there and writable when a write
//! would not block: the kernel socket for plain connections, a datagram
//! socket pair kept in sync by the library for offloaded ones.
//! [`poll::poll`] waits on several streams and other descriptors at once
//! in the calling thread, which receives the offloaded streams' bytes
//! itself (no engine thread in between).
//!
//! ## Threads
//!
//! The engine is opened on the first offloaded connection, with unpinned
//! threads. Each listener that may offload has one thread answering
//! capability queries. A blocking call busy-polls for [`Config::spin`]
//! (so request/response traffic needs no thread hand-off), then sleeps
//! until the completion callback wakes it. The callback runs on one of the
//! engine's handler threads, which serve many connections in turn, so it
//! never waits for a connection's lock: if an application thread holds
//! it, that thread handles the event when it lets go.
#![forbid(unsafe_code)]

mod config;
pub mod detect;
pub mod external;
mod net;
mod offload;
pub mod poll;
pub mod sdp;
#[cfg(feature = "tokio")]
pub mod tokio;

pub use config::{
    Config, DEFAULT_BUF_SIZE, DEFAULT_RX_BUFS, DEFAULT_ZCOPY_THRESHOLD, Mode, PlainReason,
    Transport,
};
pub use net::{Known, TcpListener, TcpStream, Upgrade, choose_port};
pub use offload::{lost_wakeups, recv_sleeps, zero_copy_fallbacks, zero_copy_octets};

/// Counts the process's `fork(2)`s from here on. A forked child's close
/// waits for the peer's FIN in the call (a child often ends with
/// `_exit(2)`, which runs no exit handler); the count otherwise starts at
/// the first connection, and a child forked before it would not know it is
/// one. For a program's (or a preloaded library's) start; cheap, once.
pub fn count_forks() {
    softrdma_engine::fork_generation();
}
