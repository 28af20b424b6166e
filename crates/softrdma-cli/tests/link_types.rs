//! Hand-built captures: one small iWARP conversation (handshake, MPA
//! Request/Reply with CRC, one Send each way) written with every supported
//! link type, IPv4 and IPv6, pcap and pcapng; plus captures that start
//! mid-stream, lose a segment, corrupt a CRC, or are not captures at all.

mod common;

use std::borrow::Cow;
use std::net::IpAddr;
use std::time::Duration;

use etherparse::PacketBuilder;
use pcap_file::DataLink;
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pcap_file::pcapng::PcapNgWriter;
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::{
    InterfaceDescriptionBlock, InterfaceDescriptionOption,
};
use softrdma_cli::capture::{CaptureError, read_capture_bytes};
use softrdma_cli::decode::DdpInfo;
use softrdma_cli::dissect::{CrcStatus, Dir, Dissection, Record, dissect_capture};
use softrdma_wire::crc;

use common::fpdus;

const A_PORT: u16 = 40000;
const B_PORT: u16 = 7174;

/// A TCP segment to put in a frame.
#[derive(Clone)]
struct Seg {
    from_a: bool,
    seq: u32,
    syn: bool,
    payload: Vec<u8>,
}

/// MPA v2 frame with CRC and enhanced mode, IRD/ORD word `pd`.
fn mpa(key: &[u8; 16], pd: [u8; 4]) -> Vec<u8> {
    let mut v = key.to_vec();
    v.extend_from_slice(&[0x50, 2, 0, 4]);
    v.extend_from_slice(&pd);
    v
}

/// An untagged Send FPDU (QN 0, MSN `msn`) with a correct CRC.
fn send_fpdu(msn: u32, payload: &[u8]) -> Vec<u8> {
    let mut ulpdu = vec![0x41, 0x43, 0, 0, 0, 0];
    ulpdu.extend_from_slice(&0u32.to_be_bytes());
    ulpdu.extend_from_slice(&msn.to_be_bytes());
    ulpdu.extend_from_slice(&0u32.to_be_bytes());
    ulpdu.extend_from_slice(payload);
    let mut f = (ulpdu.len() as u16).to_be_bytes().to_vec();
    f.extend_from_slice(&ulpdu);
    while !f.len().is_multiple_of(4) {
        f.push(0);
    }
    f.extend_from_slice(&crc::to_wire(crc::crc32c(&f)));
    f
}

/// A tagged RDMA Write FPDU with a correct CRC.
fn write_fpdu(stag: u32, to: u64, payload: &[u8]) -> Vec<u8> {
    let mut ulpdu = vec![0xc1, 0x40];
    ulpdu.extend_from_slice(&stag.to_be_bytes());
    ulpdu.extend_from_slice(&to.to_be_bytes());
    ulpdu.extend_from_slice(payload);
    let mut f = (ulpdu.len() as u16).to_be_bytes().to_vec();
    f.extend_from_slice(&ulpdu);
    while !f.len().is_multiple_of(4) {
        f.push(0);
    }
    f.extend_from_slice(&crc::to_wire(crc::crc32c(&f)));
    f
}

const A_ISN: u32 = 1000;
const B_ISN: u32 = 5000;

/// SYN, SYN-ACK, MPA Request, MPA Reply, Send a→b, Send b→a.
fn conversation() -> Vec<Seg> {
    let req = mpa(b"MPA ID Req Frame", [0x80, 0x01, 0xc0, 0x01]);
    let rep = mpa(b"MPA ID Rep Frame", [0x80, 0x01, 0x80, 0x01]);
    let s1 = send_fpdu(1, b"ping....");
    let s2 = send_fpdu(1, b"pong....");
    let a1 = A_ISN + 1;
    let b1 = B_ISN + 1;
    vec![
        Seg {
            from_a: true,
            seq: A_ISN,
            syn: true,
            payload: vec![],
        },
        Seg {
            from_a: false,
            seq: B_ISN,
            syn: true,
            payload: vec![],
        },
        Seg {
            from_a: true,
            seq: a1,
            syn: false,
            payload: req.clone(),
        },
        Seg {
            from_a: false,
            seq: b1,
            syn: false,
            payload: rep.clone(),
        },
        Seg {
            from_a: true,
            seq: a1 + req.len() as u32,
            syn: false,
            payload: s1,
        },
        Seg {
            from_a: false,
            seq: b1 + rep.len() as u32,
            syn: false,
            payload: s2,
        },
    ]
}

fn addrs(v6: bool) -> (IpAddr, IpAddr) {
    if v6 {
        ("fd00::1".parse().unwrap(), "fd00::2".parse().unwrap())
    } else {
        ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap())
    }
}

/// IP + TCP bytes of a segment (no link header).
fn ip_packet(s: &Seg, v6: bool) -> Vec<u8> {
    let (a, b) = addrs(v6);
    let (src, dst, sp, dp) = if s.from_a {
        (a, b, A_PORT, B_PORT)
    } else {
        (b, a, B_PORT, A_PORT)
    };
    let builder = match (src, dst) {
        (IpAddr::V4(s4), IpAddr::V4(d4)) => PacketBuilder::ipv4(s4.octets(), d4.octets(), 64),
        (IpAddr::V6(s6), IpAddr::V6(d6)) => PacketBuilder::ipv6(s6.octets(), d6.octets(), 64),
        _ => unreachable!(),
    };
    let tcp = builder.tcp(sp, dp, s.seq, 65535);
    let tcp = if s.syn {
        if s.from_a {
            tcp.syn()
        } else {
            tcp.syn().ack(A_ISN + 1)
        }
    } else {
        tcp.ack(1)
    };
    let mut out = Vec::new();
    tcp.write(&mut out, &s.payload).unwrap();
    out
}

fn ethertype(v6: bool) -> [u8; 2] {
    if v6 { [0x86, 0xdd] } else { [0x08, 0x00] }
}

/// The whole frame for a link type.
fn frame(link: DataLink, s: &Seg, v6: bool) -> Vec<u8> {
    let ip = ip_packet(s, v6);
    let mut f = Vec::new();
    match link {
        DataLink::ETHERNET => {
            f.extend_from_slice(&[2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1]);
            f.extend_from_slice(&ethertype(v6));
        }
        DataLink::LINUX_SLL => {
            // packet type (outgoing 4) | ARPHRD_ETHER | addr len | addr[8] | protocol
            f.extend_from_slice(&[0, 4, 0, 1, 0, 6, 2, 0, 0, 0, 0, 1, 0, 0]);
            f.extend_from_slice(&ethertype(v6));
        }
        DataLink::LINUX_SLL2 => {
            // protocol | reserved | ifindex | ARPHRD | packet type | addr len | addr[8]
            f.extend_from_slice(&ethertype(v6));
            f.extend_from_slice(&[0, 0, 0, 0, 0, 1, 0, 1, 4, 6, 2, 0, 0, 0, 0, 1, 0, 0]);
        }
        DataLink::NULL => {
            let af: u32 = if v6 { 30 } else { 2 };
            f.extend_from_slice(&af.to_le_bytes());
        }
        DataLink::LOOP => {
            let af: u32 = if v6 { 24 } else { 2 };
            f.extend_from_slice(&af.to_be_bytes());
        }
        other => panic!("no builder for {other:?}"),
    }
    f.extend_from_slice(&ip);
    f
}

fn ts(i: usize) -> Duration {
    Duration::from_secs(1_700_000_000) + Duration::from_micros(250 * i as u64)
}

fn pcap(link: DataLink, segs: &[Seg], v6: bool) -> Vec<u8> {
    let header = PcapHeader {
        datalink: link,
        ..Default::default()
    };
    let mut w = PcapWriter::with_header(Vec::new(), header).unwrap();
    for (i, s) in segs.iter().enumerate() {
        let data = frame(link, s, v6);
        w.write_packet(&PcapPacket::new(ts(i), data.len() as u32, &data))
            .unwrap();
    }
    w.into_writer()
}

fn pcapng(link: DataLink, segs: &[Seg], v6: bool) -> Vec<u8> {
    let mut w = PcapNgWriter::new(Vec::new()).unwrap();
    let mut idb = InterfaceDescriptionBlock::new(link, 0xffff);
    // pcap-file writes timestamps in nanoseconds: say so.
    idb.options.push(InterfaceDescriptionOption::IfTsResol(9));
    w.write_pcapng_block(idb).unwrap();
    for (i, s) in segs.iter().enumerate() {
        let data = frame(link, s, v6);
        w.write_pcapng_block(EnhancedPacketBlock {
            interface_id: 0,
            timestamp: ts(i),
            original_len: data.len() as u32,
            data: Cow::Owned(data),
            options: vec![],
        })
        .unwrap();
    }
    w.into_inner()
}

fn dissect(bytes: &[u8]) -> Dissection {
    dissect_capture(&read_capture_bytes(bytes, "test").unwrap())
}

fn errors(d: &Dissection) -> Vec<&Record> {
    d.records
        .iter()
        .filter(|r| matches!(r, Record::Error(_)))
        .collect()
}

/// The conversation decodes identically whatever the container and link.
fn check_conversation(d: &Dissection, v6: bool) {
    assert!(d.frame_notes.is_empty(), "{:?}", d.frame_notes);
    assert!(errors(d).is_empty(), "{:?}", errors(d));
    assert_eq!(d.summaries.len(), 1);
    let s = &d.summaries[0];
    let (a, _) = addrs(v6);
    assert_eq!(s.a.ip(), a);
    assert_eq!(s.a.port(), A_PORT);
    assert_eq!(s.crc, Some(true));
    assert!(s.a_to_b.mpa.as_ref().unwrap().crc);
    let io = s.b_to_a.mpa.as_ref().unwrap().ird_ord.unwrap();
    assert!(io.a_peer_to_peer && io.c_write_rtr && !io.d_read_rtr);
    let f = fpdus(d);
    assert_eq!(f.len(), 2);
    assert_eq!((f[0].place.dir, f[0].place.frame), (Dir::AToB, 5));
    assert_eq!((f[1].place.dir, f[1].place.frame), (Dir::BToA, 6));
    for x in &f {
        assert_eq!(x.opcode_name, "Send");
        assert!(matches!(x.crc, CrcStatus::Good { .. }), "{:?}", x.crc);
        assert_eq!(
            x.ddp,
            DdpInfo::Untagged {
                qn: 0,
                msn: 1,
                mo: 0
            }
        );
        assert_eq!(x.payload_len, 8);
    }
    // Relative time: frame 5 is 4 × 250 µs after frame 1.
    assert!(
        (f[0].place.time - 0.001).abs() < 1e-9,
        "{}",
        f[0].place.time
    );
}

const LINKS: [DataLink; 5] = [
    DataLink::ETHERNET,
    DataLink::LINUX_SLL,
    DataLink::LINUX_SLL2,
    DataLink::NULL,
    DataLink::LOOP,
];

/// The conversation in a classic pcap of `link`, over IPv4 and over IPv6.
fn check_pcap_both_families(link: DataLink) {
    for v6 in [false, true] {
        check_conversation(&dissect(&pcap(link, &conversation(), v6)), v6);
    }
}

#[test]
fn ethernet_ipv4_and_ipv6() {
    check_pcap_both_families(DataLink::ETHERNET);
}

#[test]
fn linux_sll_ipv4_and_ipv6() {
    check_pcap_both_families(DataLink::LINUX_SLL);
}

#[test]
fn linux_sll2_ipv4_and_ipv6() {
    check_pcap_both_families(DataLink::LINUX_SLL2);
}

#[test]
fn bsd_null_ipv4_and_ipv6() {
    check_pcap_both_families(DataLink::NULL);
}

#[test]
fn openbsd_loop_ipv4_and_ipv6() {
    check_pcap_both_families(DataLink::LOOP);
}

#[test]
fn pcapng_every_link_type() {
    for link in LINKS {
        for v6 in [false, true] {
            check_conversation(&dissect(&pcapng(link, &conversation(), v6)), v6);
        }
    }
}

#[test]
fn unsupported_link_type_is_a_clear_error() {
    let header = PcapHeader {
        datalink: DataLink::IEEE802_11,
        ..Default::default()
    };
    let bytes = PcapWriter::with_header(Vec::new(), header)
        .unwrap()
        .into_writer();
    let err = read_capture_bytes(&bytes, "wifi.pcap").unwrap_err();
    assert!(
        matches!(err, CaptureError::UnsupportedLinkType(105)),
        "{err}"
    );
    assert!(err.to_string().contains("unsupported link type 105"));
}

#[test]
fn not_a_pcap_is_a_clear_error() {
    for bytes in [&b""[..], b"MPA", b"hello, world\n"] {
        let err = read_capture_bytes(bytes, "x.txt").unwrap_err();
        assert!(matches!(err, CaptureError::NotPcap(_)), "{err}");
    }
}

#[test]
fn truncated_file_keeps_complete_frames() {
    let bytes = pcap(DataLink::ETHERNET, &conversation(), false);
    let cap = read_capture_bytes(&bytes[..bytes.len() - 10], "cut").unwrap();
    assert_eq!(cap.frames.len(), 5);
    assert!(cap.truncated.is_some());
}

#[test]
fn reordered_and_duplicated_segments_reassemble() {
    // Split the a→b Send into three segments, deliver them out of order with
    // a duplicate and an overlapping retransmission.
    let conv = conversation();
    let send = conv[4].clone();
    let (x, y, z) = (
        &send.payload[..5],
        &send.payload[5..20],
        &send.payload[20..],
    );
    let part = |off: usize, bytes: &[u8]| Seg {
        seq: send.seq + off as u32,
        payload: bytes.to_vec(),
        ..send.clone()
    };
    let mut segs = conv[..4].to_vec();
    segs.push(part(20, z));
    segs.push(part(0, x));
    segs.push(part(0, x));
    segs.push(part(3, &send.payload[3..20]));
    segs.push(part(5, y));
    segs.push(conv[5].clone());
    let d = dissect(&pcap(DataLink::ETHERNET, &segs, false));
    assert!(errors(&d).is_empty(), "{:?}", errors(&d));
    let f = fpdus(&d);
    assert_eq!(f.len(), 2);
    // The FPDU starts in frame 6 (bytes 0..5), its last byte is in frame 5.
    assert_eq!(f[0].place.frame, 6);
    assert_eq!(f[0].end_frame, 5);
    assert!(matches!(f[0].crc, CrcStatus::Good { .. }));
    let s = &d.summaries[0].a_to_b;
    // x again (5), bytes 3..5 of the overlapping one (2), y again (15).
    assert_eq!(s.duplicate_bytes, 5 + 2 + 15);
    assert!(s.out_of_order >= 1);
}

#[test]
fn mid_stream_capture_resynchronises() {
    // No handshake, no MPA: the capture starts with an FPDU tail, then whole
    // FPDUs. The dissector says so, skips the tail and decodes the rest.
    let w1 = write_fpdu(0x1234, 0x1000, &[7; 40]);
    let w2 = write_fpdu(0x1234, 0x1028, &[8; 40]);
    let s3 = send_fpdu(9, b"12345678");
    let tail = w1[w1.len() - 10..].to_vec();
    let mut seq = 77_000;
    let mut segs = Vec::new();
    for p in [tail, w1.clone(), w2, s3] {
        segs.push(Seg {
            from_a: true,
            seq,
            syn: false,
            payload: p.clone(),
        });
        seq += p.len() as u32;
    }
    let d = dissect(&pcap(DataLink::ETHERNET, &segs, false));
    assert!(d.records.iter().any(|r| matches!(r,
        Record::Note(n) if n.message.contains("mid-stream"))));
    let f = fpdus(&d);
    assert_eq!(f.len(), 3, "{:?}", d.records);
    assert_eq!(f[0].place.frame, 2);
    assert_eq!(f[0].opcode_name, "RDMA Write");
    assert_eq!(f[2].opcode_name, "Send");
    let s = &d.summaries[0];
    assert!(s.iwarp && s.crc.is_none() && s.a_to_b.mid_stream);
    assert_eq!(s.a_to_b.undecoded_bytes, 10);
    // CRC negotiation unseen, but the CRCs verify: reported good.
    assert!(f.iter().all(|x| matches!(x.crc, CrcStatus::Good { .. })));
}

#[test]
fn lost_segment_is_reported_and_decoding_resumes() {
    let mut conv = conversation();
    let last_seq = conv[4].seq + conv[4].payload.len() as u32;
    let more: Vec<Seg> = (2..6)
        .scan(last_seq, |seq, msn| {
            let p = send_fpdu(msn, b"abcdefgh");
            let s = Seg {
                from_a: true,
                seq: *seq,
                syn: false,
                payload: p.clone(),
            };
            *seq += p.len() as u32;
            Some(s)
        })
        .collect();
    // Drop the second of the four extra FPDUs (MSN 3).
    conv.extend([more[0].clone(), more[2].clone(), more[3].clone()]);
    let d = dissect(&pcap(DataLink::ETHERNET, &conv, false));
    assert!(d.records.iter().any(|r| matches!(r,
        Record::Note(n) if n.message.contains("bytes missing"))));
    let msns: Vec<u32> = fpdus(&d)
        .iter()
        .filter(|f| f.place.dir == Dir::AToB)
        .map(|f| match f.ddp {
            DdpInfo::Untagged { msn, .. } => msn,
            DdpInfo::Tagged { .. } => 0,
        })
        .collect();
    assert_eq!(msns, vec![1, 2, 4, 5]);
    assert_eq!(d.summaries[0].a_to_b.missing_bytes, 32);
}

#[test]
fn corrupted_crc_is_reported_bad() {
    let mut conv = conversation();
    let n = conv[4].payload.len();
    conv[4].payload[n - 6] ^= 0xff; // a payload byte, not the CRC field
    let d = dissect(&pcap(DataLink::ETHERNET, &conv, false));
    let f = fpdus(&d);
    assert!(matches!(f[0].crc, CrcStatus::Bad { .. }), "{:?}", f[0].crc);
    assert!(matches!(f[1].crc, CrcStatus::Good { .. }));
    assert_eq!(d.summaries[0].a_to_b.crc_bad, 1);
}

#[test]
fn non_iwarp_tcp_is_quiet() {
    let segs = vec![
        Seg {
            from_a: true,
            seq: 1,
            syn: true,
            payload: vec![],
        },
        Seg {
            from_a: true,
            seq: 2,
            syn: false,
            payload: b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        },
    ];
    let d = dissect(&pcap(DataLink::ETHERNET, &segs, false));
    assert!(d.records.is_empty(), "{:?}", d.records);
    assert!(!d.summaries[0].iwarp);
}

#[test]
fn markers_negotiated_are_removed_and_crc_covers_them() {
    // Both sides set M (and C): markers in both directions, every 512 octets
    // from the first byte after the MPA frames, inserted by the wire codec.
    let mut conv = conversation();
    conv[2].payload[16] |= 0x80;
    conv[3].payload[16] |= 0x80;
    let a_start = conv[4].seq;
    let mut pos = 0u64;
    let mut wire = Vec::new();
    let sizes = [100usize, 700, 3, 511, 1200, 8, 40];
    for (i, n) in sizes.iter().enumerate() {
        let f = write_fpdu(0x77, (i * 4096) as u64, &vec![i as u8; *n]);
        let mut out = vec![0; f.len() + 64];
        let w = softrdma_wire::markers::insert_markers(&f, pos, true, &mut out).unwrap();
        wire.extend_from_slice(&out[..w]);
        pos += w as u64;
    }
    // Cut the marked stream into 300-byte segments.
    let mut segs = conv[..4].to_vec();
    for (k, piece) in wire.chunks(300).enumerate() {
        segs.push(Seg {
            from_a: true,
            seq: a_start + (k * 300) as u32,
            syn: false,
            payload: piece.to_vec(),
        });
    }
    let d = dissect(&pcap(DataLink::ETHERNET, &segs, false));
    assert!(errors(&d).is_empty(), "{:?}", errors(&d));
    let s = &d.summaries[0];
    assert_eq!(s.a_to_b.markers, Some(true));
    let f = fpdus(&d);
    assert_eq!(f.len(), sizes.len());
    for (x, n) in f.iter().zip(sizes) {
        assert_eq!(x.payload_len, n);
        assert!(matches!(x.crc, CrcStatus::Good { .. }), "{:?}", x.crc);
    }
    assert_eq!(s.a_to_b.crc_good, sizes.len() as u64);
}
