//! The stream deframer on an arbitrary byte stream, with arbitrary negotiated
//! options and chunking. Slice mode and direct-placement mode must agree on
//! every FPDU and on the error, and neither may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::deframer::{DeframeError, Deframer, DeframerConfig, Event, Want};

#[derive(Debug, PartialEq)]
enum Outcome {
    Fpdu(Vec<u8>),
    Error(DeframeError),
}

fn slice_mode(config: DeframerConfig, chunk: usize, stream: &[u8]) -> Vec<Outcome> {
    let mut d = Deframer::new(config);
    let mut out = Vec::new();
    for piece in stream.chunks(chunk) {
        if let Err(e) = d.deframe_all(piece, |f| out.push(Outcome::Fpdu(f.ulpdu.to_vec()))) {
            out.push(Outcome::Error(e));
            return out;
        }
    }
    out
}

fn direct_mode(config: DeframerConfig, chunk: usize, mut stream: &[u8]) -> Vec<Outcome> {
    let mut d = Deframer::new(config);
    let mut out = Vec::new();
    let mut ulpdu = Vec::new();
    while !stream.is_empty() {
        let want = d.next_read();
        assert!(!want.is_empty());
        let n = want.len().min(chunk).min(stream.len());
        let (bytes, rest) = stream.split_at(n);
        let handled = match want {
            Want::Payload { .. } => d.handle_payload(bytes),
            _ => d.handle_bytes(bytes),
        };
        let handled = match handled {
            Ok(h) => h,
            Err(e) => {
                out.push(Outcome::Error(e));
                return out;
            }
        };
        assert_eq!(handled.consumed, n, "a matching read is consumed whole");
        stream = rest;
        if let Want::Payload { .. } = want {
            // Payload bytes never complete an FPDU: the CRC field follows.
            assert_eq!(handled.event, None);
            ulpdu.extend_from_slice(bytes);
        }
        match handled.event {
            Some(Event::Header) => {
                let h = d.header().expect("header after Event::Header");
                ulpdu.clear();
                ulpdu.extend_from_slice(h.ddp_header);
            }
            Some(Event::FpduEnd { .. }) => out.push(Outcome::Fpdu(std::mem::take(&mut ulpdu))),
            None => {}
        }
    }
    out
}

fuzz_target!(|input: (u8, u16, u8, &[u8])| {
    let (flags, start, chunk, stream) = input;
    let mut config = DeframerConfig::new(flags & 1 != 0, flags & 2 != 0);
    if flags & 4 != 0 {
        config = config.with_max_ulpdu_len(u16::from(flags) * 8);
    }
    // A start position inside a marker is documented as unsupported.
    let start = u64::from(start);
    let start = if start % 512 != 0 && start % 512 < 4 {
        start + 4 - start % 512
    } else {
        start
    };
    let config = config.with_stream_position(start);
    let chunk = usize::from(chunk).max(1);
    let a = slice_mode(config, chunk, stream);
    let b = direct_mode(config, chunk, stream);
    assert_eq!(a, b);
});
