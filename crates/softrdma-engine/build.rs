//! Declares the `loom` cfg: `RUSTFLAGS="--cfg loom"` builds the model-checked
//! tests of the engine's hand-off protocol (`src/handoff.rs`).
fn main() {
    println!("cargo::rustc-check-cfg=cfg(loom)");
}
