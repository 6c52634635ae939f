//! Finds the libtorch that torch-sys linked against, records its version for
//! `device_report`, gives this crate's tests an rpath to it, and passes the
//! directory on to the `asyncrl` binary (see `links` in Cargo.toml).

#[path = "libtorch_link.rs"]
mod libtorch_link;

use std::path::Path;

fn main() {
    println!("cargo:rerun-if-changed=libtorch_link.rs");
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let root = Path::new(&manifest).parent().unwrap_or(Path::new("."));
    let lib_dir = match libtorch_link::libtorch_lib_dir(&["DEP_TCH_LIBTORCH_LIB"], root) {
        Ok(dir) => dir,
        Err(e) => {
            // torch-sys itself fails the build earlier if libtorch is missing;
            // this is only reached with unusual setups, so warn and go on.
            println!(
                "cargo:warning=cannot locate libtorch's lib dir ({e}); binaries will need LD_LIBRARY_PATH"
            );
            return;
        }
    };
    libtorch_link::emit_link_args(&lib_dir);
    println!("cargo:libtorch_lib={}", lib_dir.display());
    println!("cargo:rustc-env=ASYNCRL_LIBTORCH_LIB={}", lib_dir.display());
    let (version, cuda) = libtorch_version(&lib_dir);
    println!("cargo:rustc-env=ASYNCRL_LIBTORCH_VERSION={version}");
    // The CUDA version this libtorch was built for, empty for a CPU build.
    println!("cargo:rustc-env=ASYNCRL_LIBTORCH_CUDA={cuda}");
}

/// The version of the libtorch in `lib_dir` and the CUDA version it was built
/// for (empty for a CPU build): `torch/version.py` of a PyTorch install, or the
/// `build-version` file of a standalone libtorch (`2.11.0+cu130`).
fn libtorch_version(lib_dir: &Path) -> (String, String) {
    let Some(base) = lib_dir.parent() else {
        return ("unknown".into(), String::new());
    };
    let py = base.join("version.py");
    println!("cargo:rerun-if-changed={}", py.display());
    if let Ok(text) = std::fs::read_to_string(&py) {
        let version = py_assignment(&text, "__version__");
        let cuda = py_assignment(&text, "cuda");
        if let Some(version) = version {
            return (version, cuda.unwrap_or_default());
        }
    }
    let bv = base.join("build-version");
    if let Ok(text) = std::fs::read_to_string(&bv) {
        let version = text.trim().to_owned();
        let cuda = version
            .split_once("+cu")
            .map(|(_, cu)| match cu.len() {
                // cu130 -> 13.0, cu126 -> 12.6
                3 => format!("{}.{}", &cu[..2], &cu[2..]),
                _ => cu.to_owned(),
            })
            .unwrap_or_default();
        return (version, cuda);
    }
    ("unknown".into(), String::new())
}

/// The string value of `name = '...'` (or `name: str = '...'`) in a Python
/// file; None when absent or not a string literal (e.g. `cuda = None`).
fn py_assignment(text: &str, name: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(name)?;
        if !rest.starts_with([' ', ':', '=']) {
            return None;
        }
        let value = rest.rsplit('=').next()?.trim();
        let quoted = (value.starts_with('\'') && value.ends_with('\''))
            || (value.starts_with('"') && value.ends_with('"'));
        (quoted && value.len() >= 2).then(|| value[1..value.len() - 1].to_owned())
    })
}
