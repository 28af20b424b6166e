//! Links the unwinder into the preload library (see `static_unwinder`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../../build-support/static_unwinder.rs");
    println!("cargo:rerun-if-env-changed=RUSTC_LINKER");
    if let Some(a) = static_unwinder() {
        println!(
            "cargo:rustc-cdylib-link-arg=-Wl,--whole-archive,{},--no-whole-archive",
            a.display()
        );
        // For the tests that check it.
        println!("cargo:rustc-env=SOFTRDMA_UNWINDER_LINKED_IN=1");
    }
}

include!("../../build-support/static_unwinder.rs");
