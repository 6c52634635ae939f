//! Gives the tests, examples and benches of a crate that links libtorch
//! through tch an rpath to the libtorch that torch-sys linked against, so
//! that they start without LD_LIBRARY_PATH. `-Wl,-rpath` is a link argument
//! of the package's own targets and does not reach its dependents, so every
//! such crate runs it: this crate, asyncrl-rollout-worker and
//! asyncrl-harness (whose Cargo.toml name this file as their `build`). The learner and the root
//! package have build scripts of their own that also pass the directory on;
//! all of them share `learner/libtorch_link.rs`.
//!
//! No `rerun-if-changed=build.rs`: the path would be relative to each
//! package, and a change to this file rebuilds the script, which reruns it.

#[path = "../learner/libtorch_link.rs"]
mod libtorch_link;

use std::path::Path;

fn main() {
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
