//! Interface adapters.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use softrdma_engine::{Device, DeviceConfig};

use crate::cm::Reactor;
use crate::evd::{Evd, EvdFlags};
use crate::{ErrorType, Result, Subtype, err};

/// How an IA is opened.
#[derive(Debug, Clone)]
pub struct IaConfig {
    /// The IA name (the `dat.conf` name for the C provider).
    pub name: String,
    /// The IA's address: listeners bind to it, it is reported as the
    /// IA address. Must not be unspecified.
    pub addr: IpAddr,
    /// Queue length of the IA's asynchronous EVD.
    pub async_qlen: usize,
    /// Added to connection qualifiers to make TCP ports
    /// ([`softrdma_proto::dat::addr`]).
    pub port_base: u16,
    /// Retry a refused connect for up to this long (within the connect
    /// timeout): the seed's "retry until the server comes online" state.
    /// `None` fails at once with `NON_PEER_REJECTED`.
    pub connect_retry: Option<Duration>,
    /// The softrdma device's settings.
    pub device: DeviceConfig,
}

impl IaConfig {
    /// Defaults for an IA at `addr`: async queue 8, port base 0, connect
    /// retry from `SOFTRDMA_DAT_CONNREFUSED_RETRY_MS` (default 5000, 0
    /// turns it off), threads not pinned.
    pub fn new(name: impl Into<String>, addr: IpAddr) -> IaConfig {
        let retry_ms = std::env::var("SOFTRDMA_DAT_CONNREFUSED_RETRY_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(5000);
        let mut device = DeviceConfig::default();
        device.pin_threads = false;
        device.poll_driven_receive = false;
        IaConfig {
            name: name.into(),
            addr,
            async_qlen: 8,
            port_base: std::env::var("SOFTRDMA_DAT_PORT_BASE")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            connect_retry: (retry_ms > 0).then(|| Duration::from_millis(retry_ms)),
            device,
        }
    }

    /// Loopback (127.0.0.1).
    pub fn loopback(name: impl Into<String>) -> IaConfig {
        IaConfig::new(name, IpAddr::V4(Ipv4Addr::LOCALHOST))
    }
}

#[derive(Debug)]
pub(crate) struct IaInner {
    pub(crate) config: IaConfig,
    pub(crate) device: Device,
    async_evd: Mutex<Option<Evd>>,
    pub(crate) reactor: Reactor,
    /// Live objects (PZ, EVD, CNO, EP, SP, SRQ; not the async EVD).
    objects: AtomicUsize,
    /// Every EVD made on this IA: drained when the IA closes. A queued
    /// event holds its EP, and the EP holds its EVDs, so an event that
    /// arrives after the consumer's last look would keep both (and the
    /// device under them) alive for good.
    pub(crate) evds: Mutex<Vec<std::sync::Weak<crate::evd::EvdInner>>>,
    user: AtomicUsize,
}

impl IaInner {
    pub(crate) fn async_evd(&self) -> Option<Evd> {
        self.async_evd.lock().clone()
    }
}

impl Drop for IaInner {
    fn drop(&mut self) {
        self.reactor.stop();
    }
}

/// Counts an object as belonging to its IA while it lives (graceful
/// close is refused while any does) and keeps the IA alive.
#[derive(Debug)]
pub(crate) struct ObjRef(pub(crate) Arc<IaInner>);

impl ObjRef {
    pub(crate) fn new(ia: &Arc<IaInner>) -> ObjRef {
        ia.objects.fetch_add(1, Ordering::AcqRel);
        ObjRef(ia.clone())
    }
}

impl Drop for ObjRef {
    fn drop(&mut self) {
        self.0.objects.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An interface adapter (`DAT_IA_HANDLE`): a softrdma device at an IP
/// address, with its asynchronous EVD and one connection reactor thread.
#[derive(Debug, Clone)]
pub struct Ia {
    pub(crate) inner: Arc<IaInner>,
}

/// What [`Ia::attr`] reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IaAttr {
    /// Device limits.
    pub device: softrdma_engine::DeviceAttr,
    /// The IA address.
    pub addr: IpAddr,
}

impl Ia {
    /// Opens an IA (`dat_ia_open`), with its asynchronous EVD.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_ADDRESS` for an unspecified address;
    /// `DAT_INSUFFICIENT_RESOURCES` if the device or the reactor cannot
    /// start.
    pub fn open(config: IaConfig) -> Result<Ia> {
        if config.addr.is_unspecified() {
            return Err(err(ErrorType::InvalidParameter, Subtype::AddressMalformed));
        }
        let mut dc = config.device.clone();
        dc.name = config.name.clone();
        let device = Device::open_with(dc)
            .map_err(|_| err(ErrorType::InsufficientResources, Subtype::ResourceDevice))?;
        let reactor = Reactor::start(&device)
            .map_err(|_| err(ErrorType::InsufficientResources, Subtype::None))?;
        let inner = Arc::new(IaInner {
            async_evd: Mutex::new(None),
            reactor,
            objects: AtomicUsize::new(0),
            evds: Mutex::new(Vec::new()),
            user: AtomicUsize::new(0),
            config,
            device,
        });
        let qlen = inner.config.async_qlen.max(1);
        let evd = Evd::create(&inner, qlen, EvdFlags::ASYNC, None, false)?;
        *inner.async_evd.lock() = Some(evd);
        inner.reactor.attach(Arc::downgrade(&inner));
        Ok(Ia { inner })
    }

    /// The IA's name.
    pub fn name(&self) -> &str {
        &self.inner.config.name
    }

    /// The IA's address.
    pub fn addr(&self) -> IpAddr {
        self.inner.config.addr
    }

    /// The settings it was opened with.
    pub fn config(&self) -> &IaConfig {
        &self.inner.config
    }

    /// The asynchronous EVD.
    pub fn async_evd(&self) -> Evd {
        self.inner
            .async_evd()
            .unwrap_or_else(|| unreachable_evd(&self.inner))
    }

    /// Attributes.
    pub fn attr(&self) -> IaAttr {
        IaAttr {
            device: self.inner.device.attr().clone(),
            addr: self.addr(),
        }
    }

    /// Objects of the IA alive now (the async EVD not counted).
    pub fn objects(&self) -> usize {
        self.inner.objects.load(Ordering::Acquire)
    }

    /// See [`Evd::user_data`].
    pub fn user_data(&self) -> usize {
        self.inner.user.load(Ordering::Acquire)
    }

    /// Sets [`user_data`](Self::user_data).
    pub fn set_user_data(&self, v: usize) {
        self.inner.user.store(v, Ordering::Release);
    }

    /// Closes the IA (`dat_ia_close`). Graceful: refused while objects of
    /// the IA exist. Abrupt: connections of the IA's EPs are reset. Either
    /// way the reactor thread ends; the IA's memory is released when the
    /// caller's other handles go.
    ///
    /// # Errors
    ///
    /// `DAT_INVALID_STATE` (`IA_IN_USE`) for a graceful close with objects
    /// left.
    pub fn close(self, graceful: bool) -> Result<()> {
        if graceful && self.objects() > 0 {
            return Err(err(ErrorType::InvalidState, Subtype::IaInUse));
        }
        if !graceful {
            self.inner.reactor.abort_all();
        }
        // The IA is closed: its reactor thread ends now, even if clones
        // of the handle are still around.
        self.inner.reactor.stop();
        if let Some(a) = self.inner.async_evd() {
            a.drain();
        }
        // Events still queued (or arriving from a connection torn down just
        // now) hold EPs that hold their EVDs: drop them so nothing of the IA
        // outlives it.
        let evds: Vec<_> = std::mem::take(&mut *self.inner.evds.lock())
            .into_iter()
            .filter_map(|w| w.upgrade())
            .collect();
        for e in &evds {
            crate::evd::EvdInner::discard_events(e);
        }
        Ok(())
    }
}

fn unreachable_evd(_: &Arc<IaInner>) -> Evd {
    // `open` sets the async EVD before returning the IA.
    panic!("IA without its async EVD")
}
