// Shared by the build scripts of learner/, policy/ (and through it
// rollout-worker/), harness/ and the workspace root (via #[path]).
//
// Makes binaries and tests that link libtorch start without LD_LIBRARY_PATH:
// `-Wl,--no-as-needed -ltorch` keeps libtorch (and through it libtorch_cuda)
// as a DT_NEEDED entry even though no Rust symbol references it directly,
// and `-Wl,-rpath,<dir>` lets the loader find it at run time.

use std::path::{Path, PathBuf};

/// Where libtorch's shared libraries are, in the order torch-sys looks:
/// the metadata torch-sys exported (`cargo:libtorch_lib`), `$LIBTORCH/lib`,
/// then `torch/lib` of the Python in `$PYTHON`, the project's `.venv`, or
/// `python3` on PATH.
pub fn libtorch_lib_dir(dep_vars: &[&str], workspace_root: &Path) -> Result<PathBuf, String> {
    for var in dep_vars {
        println!("cargo:rerun-if-env-changed={var}");
        if let Some(dir) = std::env::var_os(var) {
            return Ok(PathBuf::from(dir));
        }
    }
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    if let Some(dir) = std::env::var_os("LIBTORCH") {
        return Ok(PathBuf::from(dir).join("lib"));
    }
    println!("cargo:rerun-if-env-changed=PYTHON");
    let venv_python = workspace_root.join(".venv/bin/python");
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

/// Emits the linker arguments for every binary, test, example and bench of
/// the calling package.
pub fn emit_link_args(lib_dir: &Path) {
    let dir = lib_dir.display();
    println!("cargo:rustc-link-search=native={dir}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-L{dir}");
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
}
