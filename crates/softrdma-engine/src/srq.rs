//! Shared receive queues (stub, being written).
