//! Helpers shared by the unit tests of this crate.

/// Decodes a hex string (tests only: panics on bad input).
pub(crate) fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Walks a classic (microsecond, little-endian) pcap file with Ethernet
/// link type and yields the TCP payload of every IPv4 frame, with the
/// 1-based frame number (as tshark numbers frames).
pub(crate) fn pcap_tcp_payloads(pcap: &[u8]) -> Vec<(usize, Vec<u8>)> {
    assert_eq!(&pcap[..4], &[0xd4, 0xc3, 0xb2, 0xa1], "pcap magic");
    assert_eq!(
        u32::from_le_bytes(pcap[20..24].try_into().unwrap()),
        1,
        "Ethernet"
    );
    let mut out = Vec::new();
    let mut off = 24;
    let mut frame = 0;
    while off + 16 <= pcap.len() {
        let incl = u32::from_le_bytes(pcap[off + 8..off + 12].try_into().unwrap()) as usize;
        let pkt = &pcap[off + 16..off + 16 + incl];
        off += 16 + incl;
        frame += 1;
        if pkt.len() < 14 || pkt[12..14] != [0x08, 0x00] {
            continue;
        }
        let ip = &pkt[14..];
        let ihl = usize::from(ip[0] & 0x0f) * 4;
        let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
        if ip[9] != 6 {
            continue;
        }
        let tcp = &ip[ihl..total];
        let doff = usize::from(tcp[12] >> 4) * 4;
        out.push((frame, tcp[doff..].to_vec()));
    }
    out
}

/// The siw CRC capture bundled with the repository (a copy of the shared
/// `captures/rping-crc-p2p.pcap`).
pub(crate) const RPING_CRC_PCAP: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../captures/rping-crc-p2p.pcap"
);
