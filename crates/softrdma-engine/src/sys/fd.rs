//! Event file descriptors (stub, being written).
