//! CRC32C (Castagnoli), the MPA FPDU checksum.
//!
//! RFC 5044 section 4.2: "CRC: 32 bits, When CRCs are enabled, this field
//! contains a CRC32c check value, which is used to verify the entire contents
//! of the FPDU, using CRC32c." The polynomial and the bit/byte ordering are
//! those of iSCSI (RFC 3385 / RFC 3720 appendix B.4): reflected polynomial
//! `0x82F63B78`, initial value `0xFFFF_FFFF`, final complement.
//!
//! ```text
//!   covered by the CRC                                      not covered
//!  +---------------+-----------------------+--------------+------------+
//!  | ULPDU_LENGTH  | ULPDU (and markers)   | PAD (0..3)   | CRC (4)    |
//!  +---------------+-----------------------+--------------+------------+
//! ```
//!
//! # Byte order on the wire
//!
//! The 32-bit CRC value (as returned by [`crc32c()`]) is stored
//! **least significant byte first** ([`to_wire`] / [`from_wire`]). This is
//! what Linux kernel siw does (the kernel's `crc32c` shash writes its result
//! with `put_unaligned_le32`), and it is what Wireshark accepts: Wireshark
//! *displays* the field as a big-endian number, so its "CRC check:
//! 0xebd34c5f (Good CRC32)" for frame 8 of `rping-crc-p2p.pcap` is the wire
//! bytes `eb d3 4c 5f`, i.e. the CRC value `0x5f4cd3eb`. The test
//! `siw_capture_crc_is_little_endian` below proves this on FPDUs taken from
//! that capture.
//!
//! All the arithmetic is done by [`crc-fast`](https://docs.rs/crc-fast) for
//! long inputs and by the [`crc32c`](https://docs.rs/crc32c)
//! crate, which uses the SSE4.2 `crc32` instruction on x86-64 and the ARMv8
//! CRC instructions on AArch64 (detected at run time), three streams in
//! parallel on long buffers.

/// Number of bytes of the CRC field of an FPDU.
pub const CRC_LEN: usize = 4;

/// Incremental CRC32C: feed the covered bytes in any number of pieces.
///
/// ```
/// use softrdma_wire::crc::{crc32c, Crc32c};
/// let mut crc = Crc32c::new();
/// crc.update(b"Hello ");
/// crc.update(b"world!");
/// assert_eq!(crc.finish(), crc32c(b"Hello world!"));
/// assert_eq!(crc.finish(), 0x7B98_E751);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Crc32c {
    /// The CRC32C of all bytes fed so far (the finished value, complement
    /// applied); `crc32c::crc32c_append` continues from it.
    value: u32,
}

impl Crc32c {
    /// A CRC over no bytes yet.
    #[must_use]
    pub const fn new() -> Self {
        Crc32c { value: 0 }
    }

    /// Feeds `bytes` (the next covered bytes, in stream order).
    #[inline]
    pub fn update(&mut self, bytes: &[u8]) {
        self.value = append(self.value, bytes);
    }

    /// The CRC32C of everything fed so far. Does not reset the state: more
    /// bytes may still be fed afterwards.
    #[inline]
    #[must_use]
    pub const fn finish(&self) -> u32 {
        self.value
    }
}

/// From this many bytes on, `crc-fast`'s folding kernel (several SSE4.2 /
/// ARMv8 CRC streams combined with carry-less multiplication) beats the
/// `crc32c` crate's; below it, `crc32c`'s lower per-call cost wins. Both
/// compute the same CRC32C and continue from the same finished value.
const FAST_FROM: usize = 1024;

/// The CRC32C of the bytes behind `value` followed by `bytes`.
#[inline]
fn append(value: u32, bytes: &[u8]) -> u32 {
    if bytes.len() < FAST_FROM {
        return crc32c::crc32c_append(value, bytes);
    }
    // crc-fast continues from the register, which is the complement of the
    // finished value for CRC32C (init and xorout all ones).
    let mut d = crc_fast::Digest::new_with_init_state(
        crc_fast::CrcAlgorithm::Crc32Iscsi,
        u64::from(!value),
    );
    d.update(bytes);
    // The finished CRC32C is 32 bits wide; the upper half is always zero.
    (d.finalize() & 0xffff_ffff) as u32
}

/// One-shot CRC32C of `bytes`.
#[inline]
#[must_use]
pub fn crc32c(bytes: &[u8]) -> u32 {
    append(0, bytes)
}

/// Whether a received CRC field value `found` matches the CRC `expected`
/// from the received bytes. Under `cfg(fuzzing)` every CRC matches, so that a
/// fuzzer explores what lies behind the checksum.
#[inline]
#[must_use]
pub(crate) const fn matches(expected: u32, found: u32) -> bool {
    cfg!(fuzzing) || expected == found
}

/// The 4 bytes that carry the CRC value `crc` in the FPDU CRC field
/// (least significant byte first, see the module documentation).
#[inline]
#[must_use]
pub const fn to_wire(crc: u32) -> [u8; CRC_LEN] {
    crc.to_le_bytes()
}

/// The CRC value carried by the 4 bytes of an FPDU CRC field.
#[inline]
#[must_use]
pub const fn from_wire(field: [u8; CRC_LEN]) -> u32 {
    u32::from_le_bytes(field)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{RPING_CRC_PCAP, hex, pcap_tcp_payloads};
    use proptest::prelude::*;

    // Golden FPDUs from frame 8 and frame 9 of rping-crc-p2p.pcap (kernel siw
    // with CRC negotiated). The tshark decode (rping-crc-p2p.txt) shows
    // "ULPDU length: 14 bytes, CRC check: 0xebd34c5f (Good CRC32)" for frame 8
    // and "ULPDU length: 34 bytes, CRC check: 0x45690c4d (Good CRC32)" for 9.
    const FRAME8_FPDU: &str = "000ec140000000010000000000000000ebd34c5f";
    const FRAME9_FPDU: &str =
        "0022414300000000000000000000000100000000000055e9c6f8de10b5ff1b000000004045690c4d";

    #[test]
    fn check_value() {
        // The standard CRC-32C check value (RFC 3720 appendix B.4 / the
        // "123456789" catalogue entry).
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
        assert_eq!(to_wire(0x8A91_36AA), [0xaa, 0x36, 0x91, 0x8a]);
    }

    #[test]
    fn siw_capture_crc_is_little_endian() {
        for (fpdu, shown) in [(FRAME8_FPDU, 0xebd3_4c5f_u32), (FRAME9_FPDU, 0x4569_0c4d)] {
            let fpdu = hex(fpdu);
            let (covered, field) = fpdu.split_at(fpdu.len() - CRC_LEN);
            let field: [u8; 4] = field.try_into().unwrap();
            // Wireshark shows the field read big-endian ...
            assert_eq!(u32::from_be_bytes(field), shown);
            // ... and the field carries our CRC least significant byte first.
            assert_eq!(to_wire(crc32c(covered)), field);
            assert_eq!(from_wire(field), crc32c(covered));
            assert_ne!(crc32c(covered), shown, "the value is not stored big-endian");
        }
    }

    #[test]
    fn siw_capture_every_fpdu_crc() {
        // Every FPDU of the capture (each segment carries whole FPDUs there):
        // our CRC over length field + ULPDU + pad equals the wire CRC field.
        let pcap = std::fs::read(RPING_CRC_PCAP).unwrap();
        let mut checked = Vec::new();
        for (frame, payload) in pcap_tcp_payloads(&pcap) {
            if frame <= 6 || payload.is_empty() {
                continue; // MPA Request / Reply, pure ACKs
            }
            let mut rest = &payload[..];
            while !rest.is_empty() {
                let ulpdu_len = usize::from(u16::from_be_bytes([rest[0], rest[1]]));
                let covered = (2 + ulpdu_len).next_multiple_of(4);
                let field: [u8; 4] = rest[covered..covered + 4].try_into().unwrap();
                assert_eq!(to_wire(crc32c(&rest[..covered])), field, "frame {frame}");
                checked.push((frame, u32::from_be_bytes(field)));
                rest = &rest[covered + 4..];
            }
        }
        // The values the tshark decode lists, as Wireshark prints them.
        assert!(checked.contains(&(8, 0xebd3_4c5f)));
        assert!(checked.contains(&(12, 0xbcda_4f07)));
        assert!(checked.contains(&(32, 0x0711_ad31)));
        assert_eq!(checked.len(), 22, "the decode lists 22 FPDU frames");
    }

    proptest! {
        #[test]
        fn incremental_equals_one_shot(data in proptest::collection::vec(any::<u8>(), 0..2048),
                                       cuts in proptest::collection::vec(any::<usize>(), 0..8)) {
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (data.len() + 1)).collect();
            cuts.sort_unstable();
            let mut crc = Crc32c::new();
            let mut start = 0;
            for c in cuts.into_iter().chain([data.len()]) {
                crc.update(&data[start..c]);
                start = c;
            }
            prop_assert_eq!(crc.finish(), crc32c(&data));
        }

        #[test]
        fn wire_round_trip(v in any::<u32>()) {
            prop_assert_eq!(from_wire(to_wire(v)), v);
        }
    }

    proptest::proptest! {
        /// The two CRC engines (`crc32c` below FAST_FROM bytes, `crc-fast`
        /// from it on) agree with each other on every length and split.
        #[test]
        fn both_engines_agree(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..5000), cut in 0usize..5000) {
            let cut = cut.min(data.len());
            let mut c = Crc32c::new();
            c.update(&data[..cut]);
            c.update(&data[cut..]);
            proptest::prop_assert_eq!(c.finish(), crc32c::crc32c(&data));
            proptest::prop_assert_eq!(crc32c(&data), crc32c::crc32c(&data));
        }
    }
}
