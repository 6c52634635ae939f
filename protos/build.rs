//! Compiles the wire contract with a vendored `protoc`, so no system protoc
//! is needed.
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("proto");
    let files: Vec<PathBuf> = [
        "trajectory",
        "tasks",
        "weights",
        "buffer",
        "admin",
        "reward",
    ]
    .iter()
    .map(|f| root.join("asyncrl/v1").join(format!("{f}.proto")))
    .collect();
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
    }
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?);
    config.bytes([".asyncrl.v1.BatchReply.arrow_ipc"]);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_with_config(config, &files, &[root])?;
    Ok(())
}
