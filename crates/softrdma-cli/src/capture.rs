//! Reading capture files and peeling link and network layers off each frame.
//!
//! Supported containers: classic pcap (both byte orders, microsecond and
//! nanosecond timestamps) and pcapng (Enhanced and Simple Packet Blocks, one
//! link type per interface, `if_tsresol` honoured), both through `pcap-file`.
//!
//! Supported link types:
//!
//! | link type | DLT | header |
//! |---|---|---|
//! | Ethernet | 1 | 14 bytes (+ VLAN tags), EtherType |
//! | Linux cooked (SLL) | 113 | 16 bytes, protocol at offset 14 |
//! | Linux cooked v2 (SLL2) | 276 | 20 bytes, protocol at offset 0 |
//! | BSD loopback (NULL) | 0 | 4-byte address family, host byte order |
//! | OpenBSD loopback (LOOP) | 108 | 4-byte address family, network byte order |
//!
//! Above the link layer, `etherparse` slices IPv4/IPv6 (with options and
//! extension headers) and TCP. Frames that are not TCP over IP are skipped
//! silently; frames that look like TCP but cannot be sliced (truncated by the
//! snap length, IP fragments) become a [`FrameNote`].

use std::fs::File;
use std::io::{BufReader, Read};
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use etherparse::{EtherType, NetSlice, SlicedPacket, TransportSlice};
use pcap_file::DataLink;
use pcap_file::pcap::PcapReader;
use pcap_file::pcapng::blocks::interface_description::InterfaceDescriptionOption;
use pcap_file::pcapng::{Block, PcapNgReader};

/// The link layers this dissector understands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkType {
    /// Ethernet II (DLT_EN10MB, 1).
    Ethernet,
    /// Linux "cooked" capture v1 (DLT_LINUX_SLL, 113).
    LinuxSll,
    /// Linux "cooked" capture v2 (DLT_LINUX_SLL2, 276).
    LinuxSll2,
    /// BSD loopback (DLT_NULL, 0): address family in host byte order.
    Null,
    /// OpenBSD loopback (DLT_LOOP, 108): address family in network byte order.
    Loop,
}

impl LinkType {
    /// Maps a pcap link type to a supported one.
    ///
    /// # Errors
    ///
    /// [`CaptureError::UnsupportedLinkType`] for anything else.
    pub fn from_datalink(dl: DataLink) -> Result<Self, CaptureError> {
        match dl {
            DataLink::ETHERNET => Ok(Self::Ethernet),
            DataLink::LINUX_SLL => Ok(Self::LinuxSll),
            DataLink::LINUX_SLL2 => Ok(Self::LinuxSll2),
            DataLink::NULL => Ok(Self::Null),
            DataLink::LOOP => Ok(Self::Loop),
            other => Err(CaptureError::UnsupportedLinkType(u32::from(other))),
        }
    }
}

/// Why a capture file could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CaptureError {
    /// The file could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The file does not start with a pcap or pcapng magic number.
    #[error("{0}: not a pcap or pcapng file")]
    NotPcap(String),
    /// The file is pcap/pcapng but its header or blocks are malformed.
    #[error("{path}: malformed capture: {reason}")]
    Malformed {
        /// The file.
        path: String,
        /// What pcap-file reported.
        reason: String,
    },
    /// The link type (DLT number) is not one this dissector understands.
    #[error(
        "unsupported link type {0} (supported: Ethernet 1, Linux SLL 113, Linux SLL2 276, \
         BSD loopback 0, OpenBSD loopback 108)"
    )]
    UnsupportedLinkType(u32),
}

/// One captured frame, still with its link header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// 1-based frame number, as Wireshark counts.
    pub number: u64,
    /// Capture timestamp (since the epoch, as stored).
    pub timestamp: Duration,
    /// Link layer of this frame (pcapng may mix interfaces).
    pub link: LinkType,
    /// Captured bytes.
    pub data: Vec<u8>,
}

/// All frames of a capture file, in file order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// Frames in file order.
    pub frames: Vec<Frame>,
    /// Set when the file ended in the middle of a record (the frames before
    /// it are kept).
    pub truncated: Option<String>,
}

const PCAP_MAGICS: [[u8; 4]; 4] = [
    [0xd4, 0xc3, 0xb2, 0xa1],
    [0xa1, 0xb2, 0xc3, 0xd4],
    [0x4d, 0x3c, 0xb2, 0xa1],
    [0xa1, 0xb2, 0x3c, 0x4d],
];
const PCAPNG_MAGIC: [u8; 4] = [0x0a, 0x0d, 0x0d, 0x0a];

/// Reads a whole pcap or pcapng file.
///
/// # Errors
///
/// [`CaptureError`] if the file is missing, not a capture, malformed in its
/// header, or uses an unsupported link type. A file cut short in the middle
/// of a packet record is not an error: the complete frames are returned and
/// [`Capture::truncated`] says what happened.
pub fn read_capture(path: &Path) -> Result<Capture, CaptureError> {
    let shown = path.display().to_string();
    let io = |source| CaptureError::Io {
        path: shown.clone(),
        source,
    };
    let mut bytes = Vec::new();
    File::open(path)
        .map_err(io)?
        .read_to_end(&mut bytes)
        .map_err(io)?;
    read_capture_bytes(&bytes, &shown)
}

/// Like [`read_capture`] but from bytes in memory; `name` is used in errors.
///
/// # Errors
///
/// As [`read_capture`].
pub fn read_capture_bytes(bytes: &[u8], name: &str) -> Result<Capture, CaptureError> {
    let magic: [u8; 4] = match bytes.get(..4).and_then(|m| m.try_into().ok()) {
        Some(m) => m,
        None => return Err(CaptureError::NotPcap(name.to_owned())),
    };
    if PCAP_MAGICS.contains(&magic) {
        read_pcap(bytes, name)
    } else if magic == PCAPNG_MAGIC {
        read_pcapng(bytes, name)
    } else {
        Err(CaptureError::NotPcap(name.to_owned()))
    }
}

fn read_pcap(bytes: &[u8], name: &str) -> Result<Capture, CaptureError> {
    let mut reader =
        PcapReader::new(BufReader::new(bytes)).map_err(|e| CaptureError::Malformed {
            path: name.to_owned(),
            reason: e.to_string(),
        })?;
    let link = LinkType::from_datalink(reader.header().datalink)?;
    let mut frames = Vec::new();
    let mut truncated = None;
    while let Some(packet) = reader.next_packet() {
        match packet {
            Ok(p) => frames.push(Frame {
                number: frames.len() as u64 + 1,
                timestamp: p.timestamp,
                link,
                data: p.data.into_owned(),
            }),
            Err(e) => {
                truncated = Some(format!("after frame {}: {e}", frames.len()));
                break;
            }
        }
    }
    Ok(Capture { frames, truncated })
}

/// Per-interface facts of a pcapng file.
struct Interface {
    link: Result<LinkType, u32>,
    /// Timestamp units per second.
    units_per_sec: u128,
}

fn read_pcapng(bytes: &[u8], name: &str) -> Result<Capture, CaptureError> {
    let mut reader =
        PcapNgReader::new(BufReader::new(bytes)).map_err(|e| CaptureError::Malformed {
            path: name.to_owned(),
            reason: e.to_string(),
        })?;
    let mut interfaces: Vec<Interface> = Vec::new();
    let mut frames = Vec::new();
    let mut truncated = None;
    let mut number = 0u64;
    while let Some(block) = reader.next_block() {
        let block = match block {
            Ok(b) => b,
            Err(e) => {
                truncated = Some(format!("after frame {number}: {e}"));
                break;
            }
        };
        match block {
            Block::SectionHeader(_) => interfaces.clear(),
            Block::InterfaceDescription(idb) => {
                let mut units_per_sec = 1_000_000u128;
                for opt in &idb.options {
                    if let InterfaceDescriptionOption::IfTsResol(r) = opt {
                        units_per_sec = tsresol_units(*r);
                    }
                }
                interfaces.push(Interface {
                    link: LinkType::from_datalink(idb.linktype)
                        .map_err(|_| u32::from(idb.linktype)),
                    units_per_sec,
                });
            }
            Block::EnhancedPacket(epb) => {
                number += 1;
                let Some(iface) = interfaces.get(epb.interface_id as usize) else {
                    return Err(CaptureError::Malformed {
                        path: name.to_owned(),
                        reason: format!(
                            "frame {number} names unknown interface {}",
                            epb.interface_id
                        ),
                    });
                };
                let link = iface.link.map_err(CaptureError::UnsupportedLinkType)?;
                // pcap-file hands back the raw 64-bit timestamp as nanoseconds;
                // rescale by the interface's resolution.
                let raw = epb.timestamp.as_nanos();
                let nanos = raw.saturating_mul(1_000_000_000) / iface.units_per_sec.max(1);
                frames.push(Frame {
                    number,
                    timestamp: Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX)),
                    link,
                    data: epb.data.into_owned(),
                });
            }
            Block::SimplePacket(spb) => {
                number += 1;
                let Some(iface) = interfaces.first() else {
                    return Err(CaptureError::Malformed {
                        path: name.to_owned(),
                        reason: format!("frame {number} before any interface description"),
                    });
                };
                let link = iface.link.map_err(CaptureError::UnsupportedLinkType)?;
                frames.push(Frame {
                    number,
                    timestamp: Duration::ZERO,
                    link,
                    data: spb.data.into_owned(),
                });
            }
            Block::Packet(_) => number += 1,
            _ => {}
        }
    }
    Ok(Capture { frames, truncated })
}

/// `if_tsresol`: high bit clear = 10^-n seconds, set = 2^-n seconds.
fn tsresol_units(r: u8) -> u128 {
    let n = u32::from(r & 0x7f);
    if r & 0x80 == 0 {
        10u128.checked_pow(n).unwrap_or(1_000_000)
    } else {
        1u128.checked_shl(n).unwrap_or(1_000_000)
    }
}

/// A TCP segment taken out of a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpSegment {
    /// Frame number it came from.
    pub frame: u64,
    /// Frame timestamp.
    pub timestamp: Duration,
    /// Sender.
    pub src: SocketAddr,
    /// Receiver.
    pub dst: SocketAddr,
    /// Sequence number of the first payload byte (or of the SYN).
    pub seq: u32,
    /// SYN flag.
    pub syn: bool,
    /// ACK flag.
    pub ack: bool,
    /// FIN flag.
    pub fin: bool,
    /// RST flag.
    pub rst: bool,
    /// TCP payload.
    pub payload: Vec<u8>,
}

/// Something odd about a single frame, reported but not fatal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameNote {
    /// The frame.
    pub frame: u64,
    /// What was wrong.
    pub message: String,
}

/// Address families used by DLT_NULL / DLT_LOOP for IPv4 and the several
/// BSD values for IPv6 (Linux 10, BSDs 24, FreeBSD 28, Darwin 30).
const AF_INET: u32 = 2;
const AF_INET6: [u32; 4] = [10, 24, 28, 30];

/// Extracts the TCP segment of one frame.
///
/// Returns `Ok(None)` for frames that are not TCP over IPv4/IPv6 (ARP, UDP,
/// other EtherTypes), and `Err` with a note for frames that should have been
/// but could not be decoded (truncated, fragmented).
///
/// # Errors
///
/// A [`FrameNote`] describing why the frame was skipped.
pub fn tcp_segment(frame: &Frame) -> Result<Option<TcpSegment>, FrameNote> {
    let note = |message: String| FrameNote {
        frame: frame.number,
        message,
    };
    let data = frame.data.as_slice();
    let sliced = match frame.link {
        LinkType::Ethernet => SlicedPacket::from_ethernet(data),
        LinkType::LinuxSll => SlicedPacket::from_linux_sll(data),
        LinkType::LinuxSll2 => {
            // SLL2: protocol type (2) | reserved (2) | ifindex (4) | ARPHRD (2)
            // | packet type (1) | addr len (1) | addr (8) = 20 bytes.
            let (Some(proto), Some(rest)) = (data.get(0..2), data.get(20..)) else {
                return Err(note("truncated Linux SLL2 header".into()));
            };
            let ether_type = EtherType(u16::from_be_bytes([proto[0], proto[1]]));
            SlicedPacket::from_ether_type(ether_type, rest)
        }
        LinkType::Null | LinkType::Loop => {
            let (Some(af), Some(rest)) = (data.get(0..4), data.get(4..)) else {
                return Err(note("truncated loopback header".into()));
            };
            let af: [u8; 4] = [af[0], af[1], af[2], af[3]];
            let family = if frame.link == LinkType::Loop {
                u32::from_be_bytes(af)
            } else {
                // Host byte order of the capturing machine: accept either.
                let le = u32::from_le_bytes(af);
                if le == AF_INET || AF_INET6.contains(&le) {
                    le
                } else {
                    u32::from_be_bytes(af)
                }
            };
            if family == AF_INET || AF_INET6.contains(&family) {
                SlicedPacket::from_ip(rest)
            } else {
                return Ok(None);
            }
        }
    };
    let sliced = match sliced {
        Ok(s) => s,
        Err(e) => return Err(note(format!("cannot decode headers: {e}"))),
    };
    let (src_ip, dst_ip, fragmented) = match &sliced.net {
        Some(NetSlice::Ipv4(v4)) => (
            IpAddr::V4(v4.header().source_addr()),
            IpAddr::V4(v4.header().destination_addr()),
            v4.is_payload_fragmented(),
        ),
        Some(NetSlice::Ipv6(v6)) => (
            IpAddr::V6(v6.header().source_addr()),
            IpAddr::V6(v6.header().destination_addr()),
            v6.is_payload_fragmented(),
        ),
        _ => return Ok(None),
    };
    if fragmented {
        return Err(note(
            "IP fragment (reassembly of IP fragments is not supported)".into(),
        ));
    }
    let Some(TransportSlice::Tcp(tcp)) = &sliced.transport else {
        return Ok(None);
    };
    Ok(Some(TcpSegment {
        frame: frame.number,
        timestamp: frame.timestamp,
        src: SocketAddr::new(src_ip, tcp.source_port()),
        dst: SocketAddr::new(dst_ip, tcp.destination_port()),
        seq: tcp.sequence_number(),
        syn: tcp.syn(),
        ack: tcp.ack(),
        fin: tcp.fin(),
        rst: tcp.rst(),
        payload: tcp.payload().to_vec(),
    }))
}
