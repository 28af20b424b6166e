//! Per-connection policy and what a connection ended up as.

use std::fmt;
use std::time::Duration;

/// Offload policy of a connection or listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// Offload when the peer can, plain TCP otherwise.
    #[default]
    Auto,
    /// Offload required: a peer that cannot is an error (the connection is
    /// not made; a listener drops such clients).
    Offload,
    /// Plain kernel TCP, no detection traffic at all.
    Tcp,
}

/// Default [`Config::zcopy_threshold`]: where zero copy pays on loopback
/// (`softrdma perf stream -D 1 -r 5 --baseline tcp`, A/B in the same runs,
/// see the crate's README): 128 KiB writes were faster by buffered copy
/// (1.00–1.36 × TCP against 0.61–0.96 × by zero copy, whose synchronous
/// exchange costs about two round trips per write), 256 KiB about even,
/// 1 MiB twice as fast by zero copy.
pub const DEFAULT_ZCOPY_THRESHOLD: usize = 256 * 1024;

/// Default [`Config::buf_size`]: a 64 KiB payload and its SDP header, so
/// that writes of multiples of 64 KiB (common application buffer sizes)
/// fill whole messages (with 64 KiB buffers a 128 KiB write took three
/// messages, the third one 32 octets: a message and a credit more per
/// write).
pub const DEFAULT_BUF_SIZE: usize = 64 * 1024 + crate::sdp::BSDH_LEN;

/// Default [`Config::rx_bufs`]: the receive ring, and so the credits a
/// writer has. The reader sends a credit update per half ring of messages:
/// with 8 buffers a bulk writer ran out of credits every few messages and
/// waited for the update (the engine thread then looped on the readable
/// socket), 0.64-0.80 x TCP at 128 KiB writes against 1.04-1.05 x with 64
/// (`softrdma perf stream -s 128K -D 1 -r 3 --baseline tcp`; the crate's
/// README). The
/// buffers are mapped lazily: small messages touch a page per buffer. A
/// connection posts 8 of them at first and the rest once it has received
/// 512 KiB of data.
pub const DEFAULT_RX_BUFS: u16 = 64;

/// Settings of a connection or listener.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Offload policy.
    pub mode: Mode,
    /// Receive buffers posted per offloaded connection (at least
    /// [`crate::sdp::MIN_RING`]; default [`DEFAULT_RX_BUFS`]).
    pub rx_bufs: u16,
    /// Send staging buffers per offloaded connection (at least 2).
    pub tx_bufs: u16,
    /// Size of one receive / send buffer, SDP header included (the largest
    /// message), 4 KiB..=1 MiB.
    pub buf_size: usize,
    /// Ask for the MPA CRC on offloaded connections (it is used if either
    /// side asks).
    pub crc: bool,
    /// How long a client waits for the capability answer of a host it has
    /// not asked before (a plain host usually answers at once with ICMP
    /// port unreachable; silence costs this long once, then it is cached).
    /// When offload is required the client waits up to
    /// [`setup_timeout`](Self::setup_timeout) instead, on loopback at
    /// least [`LOOPBACK_PROBE_WAIT`](crate::detect::LOOPBACK_PROBE_WAIT)
    /// (a plain peer answers at once there, and a busy listener must not
    /// turn into a wrong answer).
    pub probe_timeout: Duration,
    /// How long the switch of an accepted or connected stream into RDMA
    /// mode may take before it counts as failed.
    pub setup_timeout: Duration,
    /// How long a blocking call busy-polls before it sleeps (lower latency
    /// for request/response traffic at the cost of CPU time).
    pub spin: Duration,
    /// How long a close waits for queued data to leave before it resets.
    pub linger: Duration,
    /// Blocking writes of at least this many octets go by Read zero copy
    /// (SrcAvail: the peer RDMA-Reads the application's buffer straight
    /// into its reader's buffer) when both ends offer it; 0 turns zero
    /// copy off (and it is not offered to the peer).
    pub zcopy_threshold: usize,
    /// How long a zero-copy write waits for the peer to read its buffer
    /// before it withdraws the offer (SrcAvailCancel; the rest goes by
    /// buffered copy), and then how long it waits for the peer to
    /// acknowledge that before it resets the connection. A write timeout
    /// shorter than this withdraws the offer when it expires.
    pub zcopy_timeout: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            mode: Mode::Auto,
            rx_bufs: DEFAULT_RX_BUFS,
            tx_bufs: 4,
            buf_size: DEFAULT_BUF_SIZE,
            crc: false,
            probe_timeout: Duration::from_millis(50),
            setup_timeout: Duration::from_secs(5),
            spin: Duration::ZERO,
            linger: Duration::from_secs(5),
            zcopy_threshold: DEFAULT_ZCOPY_THRESHOLD,
            zcopy_timeout: Duration::from_secs(5),
        }
    }
}

impl Config {
    /// The default configuration with this mode.
    pub fn with_mode(mode: Mode) -> Config {
        Config {
            mode,
            ..Config::default()
        }
    }

    /// Memory of the buffers of one offloaded connection, in octets.
    pub fn buffer_memory(&self) -> usize {
        (usize::from(self.rx_bufs) + usize::from(self.tx_bufs)) * self.buf_size
    }

    pub(crate) fn checked(&self) -> std::io::Result<()> {
        let bad = |what: &str| {
            Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("invalid sockets-direct config: {what}"),
            ))
        };
        if self.rx_bufs < crate::sdp::MIN_RING {
            return bad("rx_bufs below MIN_RING");
        }
        if self.tx_bufs < 2 {
            return bad("tx_bufs below 2");
        }
        if !(4096..=1 << 20).contains(&self.buf_size) {
            return bad("buf_size outside 4 KiB..=1 MiB");
        }
        Ok(())
    }
}

/// Why a connection is plain TCP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlainReason {
    /// The local policy said TCP ([`Mode::Tcp`]).
    Policy,
    /// The peer does not run sockets direct (no answer to the capability
    /// query, or its host refused it; possibly cached).
    PeerNotCapable,
    /// The peer runs sockets direct but declined this connection (its
    /// policy is TCP, or it could not set up resources).
    PeerDeclined,
    /// The peer agreed but setting up the offloaded connection failed; a
    /// new plain connection was made before any application data.
    SetupFailed,
    /// Accepted connection from a client that did not ask for offload.
    ClientPlain,
    /// Local resources for offload were not available (engine, memory).
    LocalResources,
}

impl fmt::Display for PlainReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PlainReason::Policy => "policy",
            PlainReason::PeerNotCapable => "peer not capable",
            PlainReason::PeerDeclined => "peer declined",
            PlainReason::SetupFailed => "offload setup failed",
            PlainReason::ClientPlain => "client did not ask for offload",
            PlainReason::LocalResources => "no local offload resources",
        })
    }
}

/// What carries a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Transport {
    /// An offload protocol over a softrdma queue pair on the same TCP
    /// connection.
    Offloaded {
        /// The offload protocol's name (`"sdp"`).
        protocol: &'static str,
        /// MPA CRC in use.
        crc: bool,
        /// Zero copy transfers in use.
        zero_copy: bool,
    },
    /// Plain kernel TCP, and why.
    Plain(PlainReason),
}

impl Transport {
    /// Whether the connection is offloaded.
    pub fn is_offloaded(&self) -> bool {
        matches!(self, Transport::Offloaded { .. })
    }
}

impl fmt::Display for Transport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Transport::Offloaded {
                protocol,
                crc,
                zero_copy,
            } => write!(
                f,
                "offloaded ({protocol}, crc {}, zero copy {})",
                if *crc { "on" } else { "off" },
                if *zero_copy { "on" } else { "off" }
            ),
            Transport::Plain(r) => write!(f, "plain TCP ({r})"),
        }
    }
}
