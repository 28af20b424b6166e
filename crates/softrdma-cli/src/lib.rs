//! # softrdma-cli: the `softrdma` command as a library
//!
//! `softrdma dissect FILE` decodes the iWARP traffic of a capture:
//!
//! ```text
//!  pcap / pcapng file            capture     (pcap-file; Ethernet, SLL, SLL2, NULL, LOOP)
//!   └─ TCP segments              capture     (etherparse; IPv4, IPv6)
//!       └─ byte streams          reassembly  (by sequence number, both directions)
//!           └─ MPA + FPDUs       dissect     (negotiation, framing, CRC, DDP, RDMAP)
//!               └─ lines         output      (text or JSON lines)
//! ```
//!
//! The binary (`src/main.rs`) only parses arguments and calls [`run_dissect`].

#![forbid(unsafe_code)]

pub mod capture;
pub mod decode;
pub mod demo;
pub mod dissect;
pub mod info;
pub mod load;
pub mod output;
pub mod perf;
pub mod ping;
pub mod reassembly;
pub mod run;
mod why;

use std::io::Write;
use std::path::Path;

pub use capture::CaptureError;
pub use dissect::{Dissection, dissect_capture};
pub use output::OutputOptions;

/// Why `softrdma dissect` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DissectError {
    /// The capture could not be read.
    #[error(transparent)]
    Capture(#[from] CaptureError),
    /// Writing the output failed.
    #[error("writing output: {0}")]
    Output(#[from] std::io::Error),
    /// `--stream N` names a stream that does not exist.
    #[error("no stream {wanted} (the capture has {count} TCP streams)")]
    NoSuchStream {
        /// The stream asked for.
        wanted: usize,
        /// Streams in the capture.
        count: usize,
    },
}

/// Reads, dissects and prints a capture.
///
/// # Errors
///
/// [`DissectError`] when the file cannot be read or is not a supported
/// capture, when `--stream` names a missing stream, or when `out` fails.
pub fn run_dissect(
    path: &Path,
    opts: &OutputOptions,
    out: &mut dyn Write,
) -> Result<Dissection, DissectError> {
    let capture = capture::read_capture(path)?;
    let d = dissect_capture(&capture);
    if let Some(wanted) = opts.stream
        && wanted >= d.summaries.len()
    {
        return Err(DissectError::NoSuchStream {
            wanted,
            count: d.summaries.len(),
        });
    }
    output::write(&d, opts, out)?;
    out.flush()?;
    Ok(d)
}
