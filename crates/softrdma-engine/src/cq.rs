//! Completion queues (stub, being written).
