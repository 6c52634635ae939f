//! Gives this crate's tests, examples and benches an rpath to the libtorch
//! that torch-sys linked against, so that they start without
//! LD_LIBRARY_PATH (shared with learner/build.rs and the root build.rs).

#[path = "../learner/libtorch_link.rs"]
mod libtorch_link;

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../learner/libtorch_link.rs");
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let root = Path::new(&manifest).parent().unwrap_or(Path::new("."));
    match libtorch_link::libtorch_lib_dir(&["DEP_TCH_LIBTORCH_LIB"], root) {
        Ok(dir) => libtorch_link::emit_link_args(&dir),
        Err(e) => println!(
            "cargo:warning=cannot locate libtorch's lib dir ({e}); tests will need LD_LIBRARY_PATH"
        ),
    }
}
