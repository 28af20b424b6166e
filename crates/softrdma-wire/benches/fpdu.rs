//! FPDU framing benchmarks: encode and decode of single FPDUs, deframing a
//! 64 MiB stream of MSS-sized FPDUs, and raw CRC32C over the same bytes (the
//! ceiling the deframer is measured against).
//!
//! Run: `cargo bench -p softrdma-wire --bench fpdu -- --warm-up-time 1 --measurement-time 3`

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use softrdma_wire::deframer::{Deframer, DeframerConfig, Event, Want};
use softrdma_wire::{crc, fpdu};

/// ULPDU length of a 1448-byte FPDU (kernel siw's FPDU at MSS 1448).
const MSS_ULPDU: usize = 1442;
/// ULPDU length of a 64 KiB FPDU.
const BIG_ULPDU: usize = 65530;
/// Size of the deframing stream.
const STREAM_LEN: usize = 64 << 20;
/// Bytes handed to the deframer per call (a large socket read).
const READ_LEN: usize = 64 << 10;

/// A tagged ULPDU (14-byte DDP header) of `len` bytes.
fn ulpdu(len: usize) -> Vec<u8> {
    let mut u = vec![0xc1, 0x40, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0];
    u.extend((0..len - u.len()).map(|i| (i * 7) as u8));
    u
}

fn encode_decode(c: &mut Criterion) {
    for (name, ulen) in [("1448", MSS_ULPDU), ("64KiB", BIG_ULPDU)] {
        let u = ulpdu(ulen);
        let total = fpdu::fpdu_len(ulen);
        let mut g = c.benchmark_group(format!("fpdu_{name}"));
        g.throughput(Throughput::Bytes(total as u64));
        for crc_on in [false, true] {
            let tag = if crc_on { "crc" } else { "nocrc" };
            let mut buf = vec![0u8; total];
            g.bench_function(BenchmarkId::new("emit", tag), |b| {
                b.iter(|| fpdu::emit(black_box(&u), crc_on, &mut buf).unwrap())
            });
            // Vectored: framing only (the payload is not copied).
            let (hdr, payload) = u.split_at(14);
            g.bench_function(BenchmarkId::new("framing_vectored", tag), |b| {
                b.iter(|| {
                    let mut enc = fpdu::FpduEncoder::new(ulen, crc_on).unwrap();
                    enc.update(black_box(hdr));
                    enc.update(black_box(payload));
                    (enc.prefix(), enc.finish().unwrap())
                })
            });
            fpdu::emit(&u, crc_on, &mut buf).unwrap();
            g.bench_function(BenchmarkId::new("decode", tag), |b| {
                b.iter(|| {
                    let d = fpdu::decode(black_box(&buf), crc_on).unwrap();
                    assert!(d.crc.is_acceptable());
                    d.ulpdu.len()
                })
            });
        }
        g.finish();
    }
}

/// About 64 MiB of 1448-byte FPDUs with CRC.
fn mss_stream() -> Vec<u8> {
    let u = ulpdu(MSS_ULPDU);
    let one = fpdu::fpdu_len(MSS_ULPDU);
    let n = STREAM_LEN / one;
    let mut wire = vec![0u8; n * one];
    for f in wire.chunks_exact_mut(one) {
        fpdu::emit(&u, true, f).unwrap();
    }
    wire
}

fn deframe_stream(c: &mut Criterion) {
    let wire = mss_stream();
    let mut g = c.benchmark_group("stream_64MiB");
    g.throughput(Throughput::Bytes(wire.len() as u64));
    g.sample_size(20);

    g.bench_function("crc32c_raw", |b| b.iter(|| crc::crc32c(black_box(&wire))));

    g.bench_function("deframe_slice_crc", |b| {
        b.iter(|| {
            let mut d = Deframer::new(DeframerConfig::new(true, false));
            let mut n = 0usize;
            for chunk in wire.chunks(READ_LEN) {
                d.deframe_all(chunk, |f| n += f.ulpdu.len()).unwrap();
            }
            n
        })
    });

    // Direct placement, deframer cost only: the payload is reported where it
    // lies in the stream, as if the socket read had placed it there.
    g.bench_function("deframe_direct_crc", |b| {
        b.iter(|| {
            let mut d = Deframer::new(DeframerConfig::new(true, false));
            let mut at = 0;
            let mut fpdus = 0usize;
            while at < wire.len() {
                let want = d.next_read();
                let n = want.len().min(wire.len() - at);
                let src = &wire[at..at + n];
                let h = match want {
                    Want::Payload { .. } => d.handle_payload(src).unwrap(),
                    _ => d.handle_bytes(src).unwrap(),
                };
                at += h.consumed;
                if let Some(Event::FpduEnd { .. }) = h.event {
                    fpdus += 1;
                }
            }
            fpdus
        })
    });

    // Direct placement: header bytes into the deframer, payload "read from
    // the socket" (copied) into a destination buffer, then reported.
    let mut dest = vec![0u8; MSS_ULPDU];
    g.bench_function("deframe_direct_crc_with_placement_copy", |b| {
        b.iter(|| {
            let mut d = Deframer::new(DeframerConfig::new(true, false));
            let mut at = 0;
            let mut placed = 0;
            let mut fpdus = 0usize;
            while at < wire.len() {
                let want = d.next_read();
                let n = want.len().min(wire.len() - at);
                let src = &wire[at..at + n];
                let h = match want {
                    Want::Payload { .. } => {
                        let dst = &mut dest[placed..placed + n];
                        dst.copy_from_slice(src);
                        placed += n;
                        d.handle_payload(dst).unwrap()
                    }
                    _ => d.handle_bytes(src).unwrap(),
                };
                at += h.consumed;
                if let Some(Event::FpduEnd { .. }) = h.event {
                    placed = 0;
                    fpdus += 1;
                }
            }
            fpdus
        })
    });
    g.finish();
}

criterion_group!(benches, encode_decode, deframe_stream);
criterion_main!(benches);
