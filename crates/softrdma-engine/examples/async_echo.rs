//! Async echo over softrdma (being written).

fn main() {}
