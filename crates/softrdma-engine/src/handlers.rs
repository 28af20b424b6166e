//! Per-CPU completion event handlers (being written).
