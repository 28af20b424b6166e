//! Connection setup helpers (stub, being written).
