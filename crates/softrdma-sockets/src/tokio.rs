//! Async (tokio) versions of [`crate::TcpStream`] and [`crate::TcpListener`]
//! (feature `tokio`), built on the readiness descriptor.
//!
//! A [`TcpStream`] here is the synchronous stream in non-blocking mode.
//! Reads and writes are tried first; only a `WouldBlock` waits. A plain
//! connection waits on a duplicate of its kernel socket registered with
//! tokio's reactor. An offloaded one leaves its waker with the library,
//! which wakes it from the engine's completion callback at the same point
//! where it updates the [`readiness_fd`](crate::TcpStream::readiness_fd)
//! (readable when data, end of stream or an error is there, writable when
//! a write would not block); no thread of this module polls.
//!
//! Connecting and accepting run the capability query and the switch into
//! RDMA mode, which block (bounded by [`Config::probe_timeout`] and
//! [`Config::setup_timeout`]): they run on tokio's blocking pool
//! ([`tokio::task::spawn_blocking`]), never on the reactor's threads. The
//! listener waits for connections with tokio's own listener on a duplicate
//! of the kernel listener, then decides each one as the synchronous
//! listener does (one dual listener for plain and offloaded clients).

use std::io;
use std::net::{Shutdown, SocketAddr};
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, Interest, ReadBuf};

use crate::config::{Config, Transport};
use crate::net::ReadinessClone;

/// How a stream learns that it may read or write again: a plain stream
/// through a duplicate of its kernel socket registered with tokio; an
/// offloaded one through wakers the library wakes from its completion
/// callback (where it also updates the readiness descriptor).
#[derive(Debug)]
enum Ready {
    Tcp(tokio::net::TcpStream),
    Offload,
}

impl Ready {
    fn new(s: &crate::TcpStream) -> io::Result<Ready> {
        Ok(match s.readiness_clone()? {
            ReadinessClone::Tcp(k) => {
                k.set_nonblocking(true)?;
                Ready::Tcp(tokio::net::TcpStream::from_std(k)?)
            }
            ReadinessClone::Offload => Ready::Offload,
        })
    }

    fn poll_ready_for(
        &self,
        cx: &mut Context<'_>,
        read: bool,
        s: &crate::TcpStream,
    ) -> Poll<io::Result<()>> {
        match (self, read) {
            (Ready::Tcp(k), true) => k.poll_read_ready(cx),
            (Ready::Tcp(k), false) => k.poll_write_ready(cx),
            (Ready::Offload, _) => match s.poll_offload_ready(!read, cx.waker()) {
                Some(false) => Poll::Pending,
                _ => Poll::Ready(Ok(())),
            },
        }
    }

    async fn ready(&self, read: bool, s: &crate::TcpStream) -> io::Result<()> {
        std::future::poll_fn(|cx| self.poll_ready_for(cx, read, s)).await
    }

    /// Runs `f`; for a plain stream a `WouldBlock` clears the readiness it
    /// waited for.
    fn try_io<R>(&self, read: bool, f: impl FnOnce() -> io::Result<R>) -> io::Result<R> {
        let i = if read {
            Interest::READABLE
        } else {
            Interest::WRITABLE
        };
        match self {
            Ready::Tcp(k) => k.try_io(i, f),
            Ready::Offload => f(),
        }
    }
}

/// An async TCP stream, offloaded when both ends can (see the crate docs).
#[derive(Debug)]
pub struct TcpStream {
    ready: Ready,
    inner: crate::TcpStream,
}

impl TcpStream {
    /// Connects with the default [`Config`].
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        Self::connect_with(addr, &Config::default()).await
    }

    /// Connects with `cfg` (the blocking steps run on the blocking pool).
    pub async fn connect_with(addr: SocketAddr, cfg: &Config) -> io::Result<TcpStream> {
        let cfg = cfg.clone();
        let s = tokio::task::spawn_blocking(move || crate::TcpStream::connect_with(addr, &cfg))
            .await
            .map_err(io::Error::other)??;
        Self::from_std(s)
    }

    /// Wraps a connected stream (switched to non-blocking mode). Must be
    /// called inside a tokio runtime.
    pub fn from_std(s: crate::TcpStream) -> io::Result<TcpStream> {
        s.set_nonblocking(true)?;
        let ready = Ready::new(&s)?;
        Ok(TcpStream { ready, inner: s })
    }

    /// The synchronous stream (in non-blocking mode).
    pub fn get_ref(&self) -> &crate::TcpStream {
        &self.inner
    }

    /// What carries the connection, and why.
    pub fn transport(&self) -> Transport {
        self.inner.transport()
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// `TCP_NODELAY`.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.inner.set_nodelay(on)
    }

    /// Reads into `buf`, waiting for data or the end of the stream.
    pub async fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.ready.ready(true, &self.inner).await?;
            match self.ready.try_io(true, || (&self.inner).read_nb(buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    /// Writes some of `buf`, waiting for buffer space.
    pub async fn write(&self, buf: &[u8]) -> io::Result<usize> {
        loop {
            self.ready.ready(false, &self.inner).await?;
            match self.ready.try_io(false, || (&self.inner).write_nb(buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }
}

/// Non-blocking calls on the synchronous stream.
trait Nb {
    fn read_nb(self, buf: &mut [u8]) -> io::Result<usize>;
    fn write_nb(self, buf: &[u8]) -> io::Result<usize>;
}

impl Nb for &crate::TcpStream {
    fn read_nb(mut self, buf: &mut [u8]) -> io::Result<usize> {
        io::Read::read(&mut self, buf)
    }
    fn write_nb(mut self, buf: &[u8]) -> io::Result<usize> {
        io::Write::write(&mut self, buf)
    }
}

impl AsyncRead for TcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            ready!(this.ready.poll_ready_for(cx, true, &this.inner))?;
            let unfilled = buf.initialize_unfilled();
            match this.ready.try_io(true, || (&this.inner).read_nb(unfilled)) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for TcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        loop {
            ready!(this.ready.poll_ready_for(cx, false, &this.inner))?;
            match this.ready.try_io(false, || (&this.inner).write_nb(buf)) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => return Poll::Ready(r),
            }
        }
    }

    /// Asks for corked data to go out now; the library sends it as
    /// credits allow without further calls (as a kernel socket does).
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().inner.push())
    }

    /// Shuts down writing (offloaded: DisConn after the queued data).
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(self.get_mut().inner.shutdown(Shutdown::Write))
    }
}

/// An async listener taking plain and offloaded clients on one port.
#[derive(Debug)]
pub struct TcpListener {
    kernel: tokio::net::TcpListener,
    inner: std::sync::Arc<crate::TcpListener>,
}

impl TcpListener {
    /// Binds with the default [`Config`].
    pub async fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
        Self::bind_with(addr, &Config::default()).await
    }

    /// Binds with `cfg`.
    pub async fn bind_with(addr: SocketAddr, cfg: &Config) -> io::Result<TcpListener> {
        Self::from_std(crate::TcpListener::bind_with(addr, cfg)?)
    }

    /// Wraps a listener. Must be called inside a tokio runtime.
    pub fn from_std(l: crate::TcpListener) -> io::Result<TcpListener> {
        let k = l.kernel_clone()?;
        k.set_nonblocking(true)?;
        Ok(TcpListener {
            kernel: tokio::net::TcpListener::from_std(k)?,
            inner: std::sync::Arc::new(l),
        })
    }

    /// The local address.
    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }

    /// Accepts a connection; an offloaded client's switch runs on the
    /// blocking pool.
    pub async fn accept(&self) -> io::Result<(TcpStream, SocketAddr)> {
        loop {
            let (s, peer) = self.kernel.accept().await?;
            let s = s.into_std()?;
            let l = self.inner.clone();
            let decided = tokio::task::spawn_blocking(move || l.decide(s, peer))
                .await
                .map_err(io::Error::other)?;
            if let Some(t) = decided {
                return Ok((TcpStream::from_std(t)?, peer));
            }
        }
    }
}
