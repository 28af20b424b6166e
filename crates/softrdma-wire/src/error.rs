//! Errors shared by the codecs.

/// Bytes that do not form a valid message.
///
/// `what` names the message or header being decoded (for example
/// `"DDP tagged header"`), so an error printed by a dissector says where the
/// stream went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The buffer is shorter than the message requires.
    #[error("{what}: truncated: need {needed} bytes, have {got}")]
    Truncated {
        /// The message being decoded.
        what: &'static str,
        /// Bytes the message requires.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A version field holds a version this implementation does not speak.
    #[error("{what}: unsupported version {version}")]
    BadVersion {
        /// The message being decoded.
        what: &'static str,
        /// The version found.
        version: u8,
    },
    /// A field holds a value the specification does not allow.
    #[error("{what}: invalid {field} {value:#x}")]
    InvalidField {
        /// The message being decoded.
        what: &'static str,
        /// The offending field.
        field: &'static str,
        /// The value found.
        value: u64,
    },
}

/// A value that cannot be written to the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The caller's buffer is too small.
    #[error("{what}: buffer too small: need {needed} bytes, have {got}")]
    BufferTooSmall {
        /// The message being encoded.
        what: &'static str,
        /// Bytes the message requires.
        needed: usize,
        /// Bytes available.
        got: usize,
    },
    /// A field value does not fit its wire field.
    #[error("{what}: {field} {value} out of range (max {max})")]
    OutOfRange {
        /// The message being encoded.
        what: &'static str,
        /// The offending field.
        field: &'static str,
        /// The value given.
        value: u64,
        /// The largest value the field can carry.
        max: u64,
    },
}
