//! Tests of the async completion adapter (being written).
