//! Gives this crate's tests, examples and benches an rpath to the libtorch
//! that torch-sys linked against (the same approach as policy/build.rs), so
//! that they start without LD_LIBRARY_PATH.

use std::path::{Path, PathBuf};

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    match libtorch_lib_dir() {
        Ok(dir) => {
            let dir = dir.display();
            println!("cargo:rustc-link-search=native={dir}");
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
            println!("cargo:rustc-link-arg=-L{dir}");
            println!("cargo:rustc-link-arg=-ltorch");
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
        Err(e) => println!(
            "cargo:warning=cannot locate libtorch's lib dir ({e}); tests will need LD_LIBRARY_PATH"
        ),
    }
}

/// Where libtorch's shared libraries are: torch-sys's exported metadata,
/// `$LIBTORCH/lib`, or `torch/lib` of the Python in `$PYTHON`, the project's
/// `.venv`, or `python3` on PATH.
fn libtorch_lib_dir() -> Result<PathBuf, String> {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    if let Some(dir) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
        return Ok(PathBuf::from(dir));
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        return Ok(PathBuf::from(dir).join("lib"));
    }
    println!("cargo:rerun-if-env-changed=PYTHON");
    let manifest = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
    let root = Path::new(&manifest).parent().unwrap_or(Path::new("."));
    let venv_python = root.join(".venv/bin/python");
    let python = match std::env::var_os("PYTHON") {
        Some(p) => PathBuf::from(p),
        None if venv_python.is_file() => venv_python,
        None => PathBuf::from("python3"),
    };
    let out = std::process::Command::new(&python)
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} cannot import torch: {}",
            python.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}
