//! The narrow set of decoding operations the dissector needs: MPA
//! Request/Reply frames, FPDU framing, CRC32C and the DDP/RDMAP headers of a
//! ULPDU, returned as plain values ready for printing.
//!
//! Field layouts (RFC 5044 §7.1, RFC 6581 §9, RFC 5041 §4, RFC 5040 §4):
//!
//! ```text
//! MPA Request/Reply:  key (16) | M C R H rsvd (1) | Rev (1) | PD_Length (2) | private data
//! MPA v2 (H set):     private data starts |A|B| IRD (14) |C|D| ORD (14) |
//! FPDU:               ULPDU_Length (2) | ULPDU | pad to 4 | CRC32C (4)
//! DDP tagged:         T L rsvd DV (1) | RsvdULP=RDMAP ctrl (1) | STag (4) | TO (8)
//! DDP untagged:       T L rsvd DV (1) | RsvdULP (5)            | QN (4) | MSN (4) | MO (4)
//! RDMAP control:      RV (2) | rsvd (2) | Opcode (4)
//! ```

use serde::Serialize;

/// "MPA ID Req Frame".
pub const MPA_REQ_KEY: &[u8; 16] = b"MPA ID Req Frame";
/// "MPA ID Rep Frame".
pub const MPA_REP_KEY: &[u8; 16] = b"MPA ID Rep Frame";
/// Bytes in an MPA Request/Reply header before the private data.
pub const MPA_HEADER_LEN: usize = 20;

/// Which of the two MPA start-up frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MpaKind {
    /// Sent by the initiator.
    Request,
    /// Sent by the responder.
    Reply,
}

/// The MPA v2 enhanced-mode IRD/ORD word (RFC 6581 §9.1.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct IrdOrdInfo {
    /// Inbound RDMA Read queue depth.
    pub ird: u16,
    /// Outbound RDMA Read queue depth.
    pub ord: u16,
    /// A: peer-to-peer model (an RTR message is expected).
    pub a_peer_to_peer: bool,
    /// B: a zero-length Send is acceptable as RTR.
    pub b_send_rtr: bool,
    /// C: a zero-length RDMA Write is acceptable as RTR.
    pub c_write_rtr: bool,
    /// D: a zero-length RDMA Read is acceptable as RTR.
    pub d_read_rtr: bool,
}

/// A decoded MPA Request or Reply frame.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MpaFrameInfo {
    /// Request or Reply.
    pub kind: MpaKind,
    /// M: the sender of this frame wants markers in the FPDUs it receives.
    pub marker: bool,
    /// C: the sender wants CRC.
    pub crc: bool,
    /// R: rejected.
    pub reject: bool,
    /// H: MPA v2 enhanced mode (IRD/ORD word at the start of private data).
    pub enhanced: bool,
    /// Revision (1 or 2).
    pub revision: u8,
    /// Private data length (including the IRD/ORD word in enhanced mode).
    pub private_data_len: u16,
    /// The IRD/ORD word when H is set and the private data holds it.
    pub ird_ord: Option<IrdOrdInfo>,
    /// The whole frame (header + private data).
    #[serde(skip)]
    pub raw: Vec<u8>,
}

/// Why bytes at the start of a stream are not an MPA Request/Reply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MpaError {
    /// The key is neither "MPA ID Req Frame" nor "MPA ID Rep Frame".
    #[error("no MPA key at stream start")]
    BadKey,
    /// Revision is not 1 or 2.
    #[error("unsupported MPA revision {0}")]
    BadRevision(u8),
    /// Private data longer than the 512 bytes RFC 5044 allows.
    #[error("private data length {0} exceeds 512")]
    PrivateDataTooLong(u16),
}

/// Parses an MPA Request/Reply at the start of `buf`.
///
/// `None`: more bytes needed.
pub fn parse_mpa_frame(buf: &[u8]) -> Option<Result<MpaFrameInfo, MpaError>> {
    let key = buf.get(..16)?;
    let kind = if key == MPA_REQ_KEY {
        MpaKind::Request
    } else if key == MPA_REP_KEY {
        MpaKind::Reply
    } else {
        return Some(Err(MpaError::BadKey));
    };
    let hdr = buf.get(..MPA_HEADER_LEN)?;
    let flags = hdr[16];
    let revision = hdr[17];
    let pd_len = u16::from_be_bytes([hdr[18], hdr[19]]);
    if !(1..=2).contains(&revision) {
        return Some(Err(MpaError::BadRevision(revision)));
    }
    if pd_len > 512 {
        return Some(Err(MpaError::PrivateDataTooLong(pd_len)));
    }
    let raw = buf.get(..MPA_HEADER_LEN + usize::from(pd_len))?;
    let enhanced = flags & 0x10 != 0 && revision == 2;
    let ird_ord = match (enhanced, raw.get(20..24)) {
        (true, Some(w)) => {
            let ird = u16::from_be_bytes([w[0], w[1]]);
            let ord = u16::from_be_bytes([w[2], w[3]]);
            Some(IrdOrdInfo {
                ird: ird & 0x3fff,
                ord: ord & 0x3fff,
                a_peer_to_peer: ird & 0x8000 != 0,
                b_send_rtr: ird & 0x4000 != 0,
                c_write_rtr: ord & 0x8000 != 0,
                d_read_rtr: ord & 0x4000 != 0,
            })
        }
        _ => None,
    };
    Some(Ok(MpaFrameInfo {
        kind,
        marker: flags & 0x80 != 0,
        crc: flags & 0x40 != 0,
        reject: flags & 0x20 != 0,
        enhanced,
        revision,
        private_data_len: pd_len,
        ird_ord,
        raw: raw.to_vec(),
    }))
}

/// Total FPDU length on the wire (without markers) for a ULPDU length:
/// 2 + ULPDU + pad to a multiple of 4 + 4.
pub fn fpdu_len(ulpdu_len: u16) -> usize {
    (2 + usize::from(ulpdu_len)).next_multiple_of(4) + 4
}

/// The CRC field value an FPDU should carry, read as a big-endian `u32`
/// the way Wireshark shows it: CRC32C over everything before the CRC field
/// (length, ULPDU, pad; markers excluded), RFC 5044 §6. The CRC register is
/// transmitted least significant byte first (as in iSCSI, RFC 3720 §12.1),
/// so the big-endian reading is the byte-swapped register.
pub fn fpdu_crc(fpdu_without_crc: &[u8]) -> u32 {
    crc32c::crc32c(fpdu_without_crc).swap_bytes()
}

/// The DDP buffer model and its addressing fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "model", rename_all = "snake_case")]
pub enum DdpInfo {
    /// Tagged buffer: STag and tagged offset.
    Tagged {
        /// Steering tag.
        stag: u32,
        /// Tagged offset.
        to: u64,
    },
    /// Untagged buffer: queue number, message sequence number, offset.
    Untagged {
        /// Queue number.
        qn: u32,
        /// Message sequence number.
        msn: u32,
        /// Message offset.
        mo: u32,
    },
}

/// A decoded ULPDU (DDP header + RDMAP header).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UlpduInfo {
    /// DDP buffer model and addressing.
    pub ddp: DdpInfo,
    /// DDP Last flag.
    pub last: bool,
    /// RDMAP opcode.
    pub opcode: u8,
    /// Bytes after the DDP header (RDMAP payload, including RDMAP
    /// message-specific headers such as a Read Request).
    pub payload_len: usize,
    /// Extra fields of some messages (Read Request, Terminate), for display.
    pub detail: Option<String>,
}

/// Why a ULPDU could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum UlpduError {
    /// Shorter than the DDP header its T bit announces.
    #[error("ULPDU of {len} bytes is shorter than the {need}-byte DDP header")]
    Truncated {
        /// ULPDU length.
        len: usize,
        /// Header length required.
        need: usize,
    },
    /// DDP version is not 1.
    #[error("DDP version {0} (expected 1)")]
    DdpVersion(u8),
    /// RDMAP version is not 1.
    #[error("RDMAP version {0} (expected 1)")]
    RdmapVersion(u8),
    /// Reserved opcode.
    #[error("reserved RDMAP opcode {0:#x}")]
    Opcode(u8),
}

/// RDMAP opcode names (RFC 5040 §4.3 and RFC 7306 §6).
pub fn opcode_name(opcode: u8) -> Option<&'static str> {
    Some(match opcode {
        0x0 => "RDMA Write",
        0x1 => "RDMA Read Request",
        0x2 => "RDMA Read Response",
        0x3 => "Send",
        0x4 => "Send with Invalidate",
        0x5 => "Send with Solicited Event",
        0x6 => "Send with SE and Invalidate",
        0x7 => "Terminate",
        0x8 => "Immediate Data",
        0x9 => "Immediate Data with SE",
        0xa => "Atomic Request",
        0xb => "Atomic Response",
        _ => return None,
    })
}

fn be32(b: &[u8], at: usize) -> u32 {
    b.get(at..at + 4)
        .map_or(0, |s| u32::from_be_bytes([s[0], s[1], s[2], s[3]]))
}

fn be64(b: &[u8], at: usize) -> u64 {
    (u64::from(be32(b, at)) << 32) | u64::from(be32(b, at + 4))
}

/// Decodes the DDP and RDMAP headers of a ULPDU.
///
/// # Errors
///
/// [`UlpduError`] when the header is truncated or carries a bad version or
/// a reserved opcode.
pub fn decode_ulpdu(ulpdu: &[u8]) -> Result<UlpduInfo, UlpduError> {
    let (Some(&ctrl), Some(&rctrl)) = (ulpdu.first(), ulpdu.get(1)) else {
        return Err(UlpduError::Truncated {
            len: ulpdu.len(),
            need: 14,
        });
    };
    let tagged = ctrl & 0x80 != 0;
    let last = ctrl & 0x40 != 0;
    let need = if tagged { 14 } else { 18 };
    if ulpdu.len() < need {
        return Err(UlpduError::Truncated {
            len: ulpdu.len(),
            need,
        });
    }
    if ctrl & 0x03 != 1 {
        return Err(UlpduError::DdpVersion(ctrl & 0x03));
    }
    if rctrl >> 6 != 1 {
        return Err(UlpduError::RdmapVersion(rctrl >> 6));
    }
    let opcode = rctrl & 0x0f;
    if opcode_name(opcode).is_none() {
        return Err(UlpduError::Opcode(opcode));
    }
    let ddp = if tagged {
        DdpInfo::Tagged {
            stag: be32(ulpdu, 2),
            to: be64(ulpdu, 6),
        }
    } else {
        DdpInfo::Untagged {
            qn: be32(ulpdu, 6),
            msn: be32(ulpdu, 10),
            mo: be32(ulpdu, 14),
        }
    };
    let payload = ulpdu.get(need..).unwrap_or_default();
    let detail = match opcode {
        0x1 if payload.len() >= 28 => Some(format!(
            "sink STag {:#010x} TO {:#x}, size {}, source STag {:#010x} TO {:#x}",
            be32(payload, 0),
            be64(payload, 4),
            be32(payload, 12),
            be32(payload, 16),
            be64(payload, 20)
        )),
        0x7 if payload.len() >= 4 => {
            let w = be32(payload, 0);
            Some(format!(
                "layer {} etype {:#x} code {:#04x}",
                w >> 28,
                (w >> 24) & 0xf,
                (w >> 16) & 0xff
            ))
        }
        _ => None,
    };
    Ok(UlpduInfo {
        ddp,
        last,
        opcode,
        payload_len: payload.len(),
        detail,
    })
}

/// Heuristic check that an FPDU starts at `buf[0]`: a ULPDU length that
/// can hold a DDP header, DDP and RDMAP version 1, reserved DDP bits clear,
/// a defined opcode. Used only to resynchronise after a hole or when a
/// capture starts mid-stream.
pub fn plausible_fpdu_start(buf: &[u8]) -> bool {
    let (Some(l), Some(&ctrl), Some(&rctrl)) = (buf.get(..2), buf.get(2), buf.get(3)) else {
        return false;
    };
    let len = u16::from_be_bytes([l[0], l[1]]);
    let need = if ctrl & 0x80 != 0 { 14 } else { 18 };
    usize::from(len) >= need
        && ctrl & 0x3f == 0x01
        && rctrl & 0xf0 == 0x40
        && opcode_name(rctrl & 0x0f).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn mpa_request_from_rping_crc_p2p() {
        let raw = hex("4d504120494420526571204672616d65500200048001c001");
        let f = parse_mpa_frame(&raw).unwrap().unwrap();
        assert_eq!(f.kind, MpaKind::Request);
        assert!(f.crc && !f.marker && !f.reject && f.enhanced);
        assert_eq!(f.revision, 2);
        assert_eq!(f.private_data_len, 4);
        let io = f.ird_ord.unwrap();
        assert_eq!((io.ird, io.ord), (1, 1));
        assert!(io.a_peer_to_peer && !io.b_send_rtr && io.c_write_rtr && io.d_read_rtr);
        assert!(parse_mpa_frame(&raw[..23]).is_none());
        assert_eq!(
            parse_mpa_frame(b"GET / HTTP/1.1\r\n\r\n"),
            Some(Err(MpaError::BadKey))
        );
    }

    #[test]
    fn fpdu_lengths() {
        assert_eq!(fpdu_len(14), 20);
        assert_eq!(fpdu_len(34), 40);
        assert_eq!(fpdu_len(20), 28);
        assert_eq!(fpdu_len(1442), 1448);
    }

    #[test]
    fn truncated_ulpdu_is_an_error_not_a_panic() {
        let u = hex("4143000000000000000000000001000000");
        for n in 0..u.len() {
            assert!(decode_ulpdu(&u[..n]).is_err());
        }
    }
}
