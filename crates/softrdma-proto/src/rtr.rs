//! The MPA v2 peer-to-peer "Ready to Receive" (RTR) message (RFC 6581
//! section 7).
//!
//! > "The initiator MUST send an RTR message after it receives the MPA Reply
//! > [...] The responder MUST NOT send any FPDU until it has received the RTR."
//!
//! The RTR is an ordinary FPDU of one of three kinds, chosen during MPA
//! negotiation (the initiator offers, the responder picks exactly one):
//!
//! ```text
//!  Write RTR: zero-length RDMA Write, STag 1, TO 0            (DDP tagged)
//!  Read RTR:  zero-length RDMA Read Request on QN 1, MSN 1,
//!             sink STag 1 / TO 0, size 0, source STag 1 / TO 0
//!             → answered by the responder with a zero-length RDMA Read
//!               Response to the sink STag/TO
//!  Send RTR:  zero-length Send on QN 0, MSN 1                 (DDP untagged)
//! ```
//!
//! Linux siw offers Write and Read and, as responder, picks Write; it sends
//! the zero-length messages to STag 1 because some hardware treats STag 0
//! specially (zero-length transfers check no STag). Frame 8 of
//! `rping-crc-p2p.pcap` is a Write RTR.
//!
//! Everything here is on whole FPDUs without markers (MPA markers are never
//! negotiated by softrdma).

use softrdma_wire::ddp::{Msn, QN_READ_REQUEST, QN_SEND, Stag};
use softrdma_wire::fpdu::{self, CrcVerdict, ULPDU_LENGTH_LEN};
use softrdma_wire::rdmap::Opcode;
use softrdma_wire::rdmap::read_request::ReadRequestRepr;
use softrdma_wire::ulpdu::{DdpAddress, UlpduBody, UlpduError, UlpduRepr};

/// The STag the zero-length RTR messages name (never checked by the peer).
pub const RTR_STAG: Stag = Stag(1);

/// The longest ULPDU an RTR exchange message can have (a Read Request is
/// 46 octets); a longer ULPDU_LENGTH is refused before reading it.
pub const MAX_RTR_ULPDU_LEN: usize = 64;

/// Which message serves as RTR (RFC 6581 section 5: the A/B/C/D bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RtrKind {
    /// Zero-length Send (B bit). Consumes MSN 1 of queue 0 (and a receive
    /// buffer of the responder).
    Send,
    /// Zero-length RDMA Write (C bit). Consumes no MSN.
    Write,
    /// Zero-length RDMA Read Request (D bit). Consumes MSN 1 of queue 1 in
    /// both directions' accounting and one ORD/IRD slot until the
    /// zero-length Read Response arrives.
    Read,
}

/// Why received bytes are not the expected RTR exchange message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RtrError {
    /// ULPDU_LENGTH is larger than any RTR message.
    #[error("FPDU of {len} octets where an RTR message was expected")]
    TooLong {
        /// ULPDU_LENGTH received.
        len: usize,
    },
    /// The FPDU's CRC does not match.
    #[error("RTR FPDU with a bad CRC (computed {expected:#010x}, received {found:#010x})")]
    BadCrc {
        /// Computed CRC.
        expected: u32,
        /// CRC field received.
        found: u32,
    },
    /// The bytes do not hold a whole FPDU.
    #[error("RTR FPDU: {0}")]
    Fpdu(softrdma_wire::DecodeError),
    /// The ULPDU does not decode.
    #[error("RTR FPDU: {0}")]
    Malformed(#[from] UlpduError),
    /// A well-formed message, but not the one expected.
    #[error("expected {expected}, received a {opcode:?} that is not one")]
    Unexpected {
        /// What was expected.
        expected: &'static str,
        /// What arrived.
        opcode: Opcode,
    },
}

fn emit_fpdu(ulpdu: &UlpduRepr<'_>, crc: bool) -> Vec<u8> {
    let mut u = vec![0u8; ulpdu.buffer_len()];
    // The messages built here are fixed and valid; emit cannot fail on them.
    let n = ulpdu.emit(&mut u).unwrap_or(0);
    u.truncate(n);
    let mut out = vec![0u8; fpdu::fpdu_len(u.len())];
    let n = fpdu::emit(&u, crc, &mut out).unwrap_or(0);
    out.truncate(n);
    out
}

/// The RTR FPDU of `kind` the initiator sends (CRC filled in if `crc` was
/// negotiated).
pub fn rtr_fpdu(kind: RtrKind, crc: bool) -> Vec<u8> {
    let ulpdu = match kind {
        RtrKind::Write => UlpduRepr::tagged(Opcode::RdmaWrite, RTR_STAG, 0, true, &[]),
        RtrKind::Send => UlpduRepr::send(Opcode::Send, None, Msn::INITIAL, 0, true, &[]),
        RtrKind::Read => UlpduRepr::read_request(
            Msn::INITIAL,
            ReadRequestRepr {
                sink_stag: RTR_STAG,
                sink_to: 0,
                read_size: 0,
                src_stag: RTR_STAG,
                src_to: 0,
            },
        ),
    };
    emit_fpdu(&ulpdu, crc)
}

/// The zero-length RDMA Read Response answering a Read RTR.
pub fn read_rtr_response_fpdu(request: &ReadRequestRepr, crc: bool) -> Vec<u8> {
    let ulpdu = UlpduRepr::tagged(
        Opcode::RdmaReadResponse,
        request.sink_stag,
        request.sink_to,
        true,
        &[],
    );
    emit_fpdu(&ulpdu, crc)
}

/// How many octets the FPDU starting with `prefix` occupies, once the
/// 2-octet ULPDU_LENGTH is there (`None` before).
pub fn fpdu_total_len(prefix: &[u8]) -> Option<usize> {
    let &[a, b] = prefix.first_chunk::<ULPDU_LENGTH_LEN>()?;
    Some(fpdu::fpdu_len(usize::from(u16::from_be_bytes([a, b]))))
}

/// Checks the length prefix of what should be an RTR exchange FPDU, so that
/// a peer cannot make the receiver wait for (or buffer) a long FPDU.
pub fn check_rtr_prefix(prefix: &[u8]) -> Result<(), RtrError> {
    if let Some(&[a, b]) = prefix.first_chunk::<ULPDU_LENGTH_LEN>() {
        let len = usize::from(u16::from_be_bytes([a, b]));
        if len > MAX_RTR_ULPDU_LEN {
            return Err(RtrError::TooLong { len });
        }
    }
    Ok(())
}

fn decode(fpdu_bytes: &[u8], crc: bool) -> Result<UlpduRepr<'_>, RtrError> {
    check_rtr_prefix(fpdu_bytes)?;
    let d = fpdu::decode(fpdu_bytes, crc).map_err(RtrError::Fpdu)?;
    if let CrcVerdict::Bad { expected, found } = d.crc {
        return Err(RtrError::BadCrc { expected, found });
    }
    Ok(UlpduRepr::parse(d.ulpdu)?)
}

/// An RTR message as received by the responder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceivedRtr {
    /// A zero-length Send or RDMA Write: nothing to answer.
    Plain(RtrKind),
    /// A zero-length Read Request: answer with
    /// [`read_rtr_response_fpdu`] of this request.
    Read(ReadRequestRepr),
}

/// Recognises the whole FPDU `fpdu_bytes` (exactly one FPDU) as the RTR of
/// kind `expected`: a zero-length RDMA Write (any STag and TO: zero-length
/// transfers check none), a zero-length Read Request with MSN 1 on queue 1,
/// or a zero-length Send with MSN 1 on queue 0, each with the L flag.
pub fn recognise_rtr(
    fpdu_bytes: &[u8],
    crc: bool,
    expected: RtrKind,
) -> Result<ReceivedRtr, RtrError> {
    let u = decode(fpdu_bytes, crc)?;
    let what = match expected {
        RtrKind::Write => "a zero-length RDMA Write (Write RTR)",
        RtrKind::Read => "a zero-length RDMA Read Request with MSN 1 (Read RTR)",
        RtrKind::Send => "a zero-length Send with MSN 1 (Send RTR)",
    };
    let unexpected = RtrError::Unexpected {
        expected: what,
        opcode: u.opcode,
    };
    if !u.last {
        return Err(unexpected);
    }
    match (expected, u.opcode, u.address, u.body) {
        (RtrKind::Write, Opcode::RdmaWrite, DdpAddress::Tagged { .. }, UlpduBody::Payload([])) => {
            Ok(ReceivedRtr::Plain(RtrKind::Write))
        }
        (
            RtrKind::Send,
            Opcode::Send,
            DdpAddress::Untagged { qn, msn, mo: 0 },
            UlpduBody::Payload([]),
        ) if qn == QN_SEND && msn == Msn::INITIAL => Ok(ReceivedRtr::Plain(RtrKind::Send)),
        (
            RtrKind::Read,
            Opcode::RdmaReadRequest,
            DdpAddress::Untagged { qn, msn, mo: 0 },
            UlpduBody::ReadRequest(r),
        ) if qn == QN_READ_REQUEST && msn == Msn::INITIAL && r.read_size == 0 => {
            Ok(ReceivedRtr::Read(r))
        }
        _ => Err(unexpected),
    }
}

/// Recognises the whole FPDU `fpdu_bytes` as the zero-length RDMA Read
/// Response that answers a Read RTR.
pub fn recognise_read_rtr_response(fpdu_bytes: &[u8], crc: bool) -> Result<(), RtrError> {
    let u = decode(fpdu_bytes, crc)?;
    match (u.opcode, u.last, u.body) {
        (Opcode::RdmaReadResponse, true, UlpduBody::Payload([])) => Ok(()),
        _ => Err(RtrError::Unexpected {
            expected: "a zero-length RDMA Read Response (answer to the Read RTR)",
            opcode: u.opcode,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frame 8 of rping-crc-p2p.pcap: siw's Write RTR, CRC on.
    const SIW_WRITE_RTR: [u8; 20] = [
        0x00, 0x0e, 0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0xeb, 0xd3, 0x4c, 0x5f,
    ];

    #[test]
    fn write_rtr_matches_siw_byte_for_byte() {
        assert_eq!(rtr_fpdu(RtrKind::Write, true), SIW_WRITE_RTR);
        assert_eq!(
            recognise_rtr(&SIW_WRITE_RTR, true, RtrKind::Write),
            Ok(ReceivedRtr::Plain(RtrKind::Write))
        );
        let no_crc = rtr_fpdu(RtrKind::Write, false);
        assert_eq!(no_crc[..16], SIW_WRITE_RTR[..16]);
        assert_eq!(no_crc[16..], [0, 0, 0, 0]);
        assert_eq!(fpdu_total_len(&no_crc), Some(20));
    }

    #[test]
    fn every_kind_round_trips_and_is_not_another_kind() {
        for crc in [false, true] {
            for kind in [RtrKind::Write, RtrKind::Read, RtrKind::Send] {
                let f = rtr_fpdu(kind, crc);
                assert_eq!(fpdu_total_len(&f), Some(f.len()));
                let got = recognise_rtr(&f, crc, kind).unwrap();
                match (kind, got) {
                    (RtrKind::Read, ReceivedRtr::Read(r)) => {
                        assert_eq!(r.read_size, 0);
                        let resp = read_rtr_response_fpdu(&r, crc);
                        recognise_read_rtr_response(&resp, crc).unwrap();
                        assert!(recognise_rtr(&resp, crc, RtrKind::Write).is_err());
                    }
                    (k, ReceivedRtr::Plain(p)) => assert_eq!(k, p),
                    other => panic!("{other:?}"),
                }
                for other in [RtrKind::Write, RtrKind::Read, RtrKind::Send] {
                    if other != kind {
                        assert!(matches!(
                            recognise_rtr(&f, crc, other),
                            Err(RtrError::Unexpected { .. })
                        ));
                    }
                }
                assert!(recognise_read_rtr_response(&f, crc).is_err());
            }
        }
    }

    #[test]
    fn bad_crc_long_and_truncated_are_refused() {
        let mut f = SIW_WRITE_RTR;
        f[19] ^= 1;
        assert!(matches!(
            recognise_rtr(&f, true, RtrKind::Write),
            Err(RtrError::BadCrc { .. })
        ));
        assert!(recognise_rtr(&f, false, RtrKind::Write).is_ok());
        assert_eq!(
            check_rtr_prefix(&[0x01, 0x00]),
            Err(RtrError::TooLong { len: 256 })
        );
        assert!(check_rtr_prefix(&[0x00]).is_ok());
        for n in 0..SIW_WRITE_RTR.len() {
            assert!(recognise_rtr(&SIW_WRITE_RTR[..n], true, RtrKind::Write).is_err());
        }
        // A Write RTR carrying data is not an RTR.
        let u = UlpduRepr::tagged(Opcode::RdmaWrite, RTR_STAG, 0, true, b"x");
        let f = emit_fpdu(&u, false);
        assert!(recognise_rtr(&f, false, RtrKind::Write).is_err());
        // Neither is a Send with MSN 2.
        let u = UlpduRepr::send(Opcode::Send, None, Msn(2), 0, true, &[]);
        let f = emit_fpdu(&u, false);
        assert!(recognise_rtr(&f, false, RtrKind::Send).is_err());
    }
}
