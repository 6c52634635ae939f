//! Links the `asyncrl` binary (and this package's tests; asyncrl-app's
//! Cargo.toml names this file as its `build` too, for its own tests) so that it starts
//! without LD_LIBRARY_PATH: `-Wl,--no-as-needed -ltorch` keeps libtorch (and
//! through it libtorch_cuda, so CUDA is found at run time) as a needed
//! library although no Rust symbol refers to it, and an rpath points at the
//! libtorch that torch-sys built against. asyncrl-learner passes that
//! directory on as `DEP_ASYNCRL_LIBTORCH_LIBTORCH_LIB` (its `links` key).

#[path = "learner/libtorch_link.rs"]
mod libtorch_link;

use std::path::Path;

fn main() {
    if std::env::var_os("CARGO_FEATURE_TORCH").is_none() {
        // Built without the tensor roles: nothing links libtorch.
        return;
    }
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let manifest = Path::new(&manifest);
    // The workspace root: this package's folder, or the one above a member's.
    let root = if manifest.join("Cargo.lock").exists() {
        manifest
    } else {
        manifest.parent().unwrap_or(manifest)
    };
    // No `rerun-if-changed=build.rs`: the path would be relative to each
    // package, and a change to this file rebuilds the script, which reruns it.
    println!(
        "cargo:rerun-if-changed={}",
        root.join("learner/libtorch_link.rs").display()
    );
    match libtorch_link::libtorch_lib_dir(&["DEP_ASYNCRL_LIBTORCH_LIBTORCH_LIB"], root) {
        Ok(dir) => libtorch_link::emit_link_args(&dir),
        Err(e) => println!(
            "cargo:warning=cannot locate libtorch's lib dir ({e}); `asyncrl` will need LD_LIBRARY_PATH"
        ),
    }
}
