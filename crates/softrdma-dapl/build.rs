//! The provider stays mapped after libdat2 dlcloses it (`-z nodelete`):
//! threads of the engine may still be finishing when the last IA closes.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
