//! Compiles the wire contract with a vendored `protoc`, so no system protoc
//! is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let dir = root.join("asyncrl/v1");
    // Every .proto file of the package, in a stable order: a role that adds a
    // file (e.g. coordinator.proto) does not have to touch this script.
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<Vec<_>, _>>()?
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "proto"))
        .collect();
    files.sort();
    println!("cargo:rerun-if-changed={}", dir.display());
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    config.bytes([
        ".asyncrl.v1.BatchReply.arrow_ipc",
        ".asyncrl.v1.TrainStepRequest.batch_arrow_ipc",
    ]);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &files, &[root])?;
    Ok(())
}
