//! Marker removal from an arbitrary stream, cut into arbitrary chunks at an
//! arbitrary start position: every byte is either data or marker, none lost.
#![no_main]

use libfuzzer_sys::fuzz_target;
use softrdma_wire::markers::{MARKER_LEN, MarkerRemover, Piece};

fuzz_target!(|input: (u16, u8, &[u8])| {
    let (start, chunk, data) = input;
    let chunk = usize::from(chunk).max(1);
    let mut remover = MarkerRemover::new(u64::from(start));
    let mut seen = 0usize;
    let mut pending_marker_bytes = 0usize;
    for piece in data.chunks(chunk) {
        for p in remover.split(piece) {
            match p {
                Piece::Data(d) => seen += d.len(),
                // A marker that began before `start` was only partly fed.
                Piece::Marker { position, .. } => {
                    let before = u64::from(start).saturating_sub(position) as usize;
                    pending_marker_bytes += MARKER_LEN - before;
                }
            }
        }
    }
    // Bytes of a marker still being read are not reported yet.
    assert!(seen + pending_marker_bytes <= data.len());
    assert!(data.len() - (seen + pending_marker_bytes) < MARKER_LEN);
    assert_eq!(remover.position(), u64::from(start) + data.len() as u64);
});
