//! The dissector's view of the wire codecs: MPA Request/Reply frames, FPDU
//! framing and CRC, and the DDP/RDMAP headers of a ULPDU, decoded by
//! `softrdma-wire` and turned into plain, serialisable values for printing.
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
use softrdma_wire::crc;
use softrdma_wire::fpdu;
use softrdma_wire::mpa::{self, Frame, FrameKind, FrameRepr, MPA_MAX_PRIVATE_DATA};
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::ulpdu::{DdpAddress, UlpduBody, UlpduRepr};

pub use softrdma_wire::mpa::MpaError;
pub use softrdma_wire::ulpdu::UlpduError;

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

/// Parses an MPA Request/Reply at the start of `buf` with
/// [`softrdma_wire::mpa`]. Private data up to the RFC 5044 maximum (512
/// bytes) is accepted, not only siw's 256: a dissector shows what was sent.
///
/// `None`: the stream ends before the frame does.
pub fn parse_mpa_frame(buf: &[u8]) -> Option<Result<MpaFrameInfo, MpaError>> {
    let len = match mpa::frame_len(buf, MPA_MAX_PRIVATE_DATA)? {
        Ok(len) => len,
        Err(e) => return Some(Err(e)),
    };
    let raw = buf.get(..len)?;
    let frame = match Frame::new_checked(raw) {
        Ok(f) => f,
        Err(e) => return Some(Err(MpaError::Malformed(e))),
    };
    let repr = match FrameRepr::parse(&frame, MPA_MAX_PRIVATE_DATA) {
        Ok(r) => r,
        Err(e) => return Some(Err(e)),
    };
    let ird_ord = repr.ird_ord().and_then(Result::ok).map(|io| IrdOrdInfo {
        ird: io.ird,
        ord: io.ord,
        a_peer_to_peer: io.peer_to_peer,
        b_send_rtr: io.send_rtr,
        c_write_rtr: io.write_rtr,
        d_read_rtr: io.read_rtr,
    });
    Some(Ok(MpaFrameInfo {
        kind: match repr.kind {
            FrameKind::Request => MpaKind::Request,
            FrameKind::Reply => MpaKind::Reply,
        },
        marker: repr.markers,
        crc: repr.crc,
        reject: repr.reject,
        enhanced: repr.enhanced,
        revision: repr.revision,
        private_data_len: frame.private_data_len(),
        ird_ord,
        raw: raw.to_vec(),
    }))
}

/// Total FPDU length on the wire (without markers) for a ULPDU length:
/// 2 + ULPDU + pad to a multiple of 4 + 4.
pub fn fpdu_len(ulpdu_len: u16) -> usize {
    fpdu::fpdu_len(usize::from(ulpdu_len))
}

/// The CRC field of an FPDU read as a big-endian number, the way Wireshark
/// displays it (the field itself carries the CRC32C value least significant
/// byte first; see `softrdma_wire::crc`).
pub fn crc_field_as_shown(field: [u8; 4]) -> u32 {
    u32::from_be_bytes(field)
}

/// What CRC32C says about one whole FPDU as sent (`raw`: length field
/// through CRC field, markers included if any; the CRC covers everything
/// before the CRC field), as `(good, expected, found)` with the two values
/// shown as Wireshark shows the field. `None` if `raw` is shorter than the
/// CRC field.
pub fn check_crc(raw: &[u8]) -> Option<(bool, u32, u32)> {
    let n = raw.len().checked_sub(crc::CRC_LEN)?;
    let (covered, field) = raw.split_at(n);
    let field: [u8; 4] = field.try_into().ok()?;
    let expected = crc::to_wire(crc::crc32c(covered));
    Some((
        expected == field,
        crc_field_as_shown(expected),
        crc_field_as_shown(field),
    ))
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
    /// RDMAP message name.
    pub opcode_name: &'static str,
    /// Bytes after the DDP header (RDMAP payload, including RDMAP
    /// message-specific headers such as a Read Request).
    pub payload_len: usize,
    /// Extra fields of some messages (Read Request, Terminate, atomics,
    /// Immediate Data), for display.
    pub detail: Option<String>,
}

/// RDMAP opcode names (RFC 5040 §4.3 and RFC 7306), from the wire codecs.
pub fn opcode_name(opcode: u8) -> Option<&'static str> {
    Opcode::from_u8(opcode).map(Opcode::name)
}

/// Decodes the DDP and RDMAP headers of a ULPDU with
/// [`softrdma_wire::ulpdu::UlpduRepr`].
///
/// # Errors
///
/// [`UlpduError`] when the header is truncated, carries a bad version or a
/// reserved opcode, the buffer model does not suit the opcode, or an RDMAP
/// header is malformed.
pub fn decode_ulpdu(ulpdu: &[u8]) -> Result<UlpduInfo, UlpduError> {
    let repr = UlpduRepr::parse(ulpdu)?;
    let (ddp, ddp_len) = match repr.address {
        DdpAddress::Tagged { stag, to } => (DdpInfo::Tagged { stag: stag.0, to }, 14),
        DdpAddress::Untagged { qn, msn, mo } => (
            DdpInfo::Untagged {
                qn: qn.0,
                msn: msn.0,
                mo,
            },
            18,
        ),
    };
    let detail = match repr.body {
        UlpduBody::Payload(_) => repr
            .invalidate_stag
            .map(|s| format!("invalidate STag {:#010x}", s.0)),
        UlpduBody::ReadRequest(r) => Some(format!(
            "sink STag {:#010x} TO {:#x}, size {}, source STag {:#010x} TO {:#x}",
            r.sink_stag.0, r.sink_to, r.read_size, r.src_stag.0, r.src_to
        )),
        UlpduBody::Terminate(t) => Some(format!("{}", t.code)),
        UlpduBody::AtomicRequest(a) => Some(format!(
            "{:?} request {} STag {:#010x} TO {:#x}",
            a.opcode, a.request_id, a.stag.0, a.to
        )),
        UlpduBody::AtomicResponse(a) => Some(format!(
            "response to {}, original value {:#x}",
            a.request_id, a.original_value
        )),
        UlpduBody::Immediate(i) => Some(format!("immediate data {:02x?}", i.data)),
    };
    Ok(UlpduInfo {
        ddp,
        last: repr.last,
        opcode: repr.opcode.as_u8(),
        opcode_name: repr.opcode.name(),
        payload_len: ulpdu.len().saturating_sub(ddp_len),
        detail,
    })
}

/// Heuristic check that an FPDU starts at `buf[0]`: a ULPDU length that
/// can hold a DDP header, DDP and RDMAP version 1, reserved DDP bits clear,
/// a defined opcode in the buffer model it belongs to; and, when the whole
/// ULPDU is in `buf`, a ULPDU that decodes. Used only to resynchronise after
/// a hole or when a capture starts mid-stream.
pub fn plausible_fpdu_start(buf: &[u8]) -> bool {
    let (Some(l), Some(&ctrl), Some(&rctrl)) = (buf.get(..2), buf.get(2), buf.get(3)) else {
        return false;
    };
    let len = usize::from(u16::from_be_bytes([l[0], l[1]]));
    let tagged = ctrl & 0x80 != 0;
    let need = if tagged { 14 } else { 18 };
    let Some(op) = Opcode::from_u8(rctrl & 0x0f) else {
        return false;
    };
    if len < need || ctrl & 0x3f != 0x01 || rctrl & 0xf0 != 0x40 || op.is_tagged() != tagged {
        return false;
    }
    match buf.get(2..2 + len) {
        Some(ulpdu) => UlpduRepr::parse(ulpdu).is_ok(),
        None => true,
    }
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
        assert!(matches!(
            parse_mpa_frame(b"GET / HTTP/1.1\r\n\r\n"),
            Some(Err(MpaError::BadKey { .. }))
        ));
    }

    #[test]
    fn fpdu_lengths() {
        assert_eq!(fpdu_len(14), 20);
        assert_eq!(fpdu_len(34), 40);
        assert_eq!(fpdu_len(20), 28);
        assert_eq!(fpdu_len(1442), 1448);
    }

    #[test]
    fn crc_field_shown_as_wireshark_shows_it() {
        // rping-crc-p2p frame 8: the zero-length RDMA Write (RTR), CRC field
        // shown by tshark as 0xebd34c5f (Good).
        let f = hex("000ec140000000010000000000000000ebd34c5f");
        assert_eq!(check_crc(&f), Some((true, 0xebd3_4c5f, 0xebd3_4c5f)));
        let mut bad = f.clone();
        bad[5] ^= 1;
        let (good, expected, found) = check_crc(&bad).unwrap();
        assert!(!good);
        assert_eq!(found, 0xebd3_4c5f);
        assert_ne!(expected, found);
        assert!(!check_crc(&f[..f.len() - 1]).unwrap().0);
        assert_eq!(check_crc(&f[..3]), None);
    }

    #[test]
    fn plausibility() {
        let f = hex("000ec140000000010000000000000000ebd34c5f");
        assert!(plausible_fpdu_start(&f));
        assert!(plausible_fpdu_start(&f[..4]));
        assert!(!plausible_fpdu_start(&f[1..]));
        // Untagged opcode (Send) with T set: not plausible.
        let mut t = f.clone();
        t[3] = 0x43;
        assert!(!plausible_fpdu_start(&t));
    }

    #[test]
    fn truncated_ulpdu_is_an_error_not_a_panic() {
        let u = hex("4143000000000000000000000001000000");
        for n in 0..u.len() {
            assert!(decode_ulpdu(&u[..n]).is_err());
        }
    }
}
