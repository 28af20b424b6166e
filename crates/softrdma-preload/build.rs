//! Links the unwinder into the preload library (see `static_unwinder`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../build-support/static_unwinder.rs");
    link_static_unwinder();
}

include!("../../build-support/static_unwinder.rs");
