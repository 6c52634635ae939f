//! `asyncrl buffer export --format parquet`: the file is read back by
//! pyarrow from the project's venv.

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use asyncrl_buffer::testing::traj;
use asyncrl_buffer::{ExportArgs, ExportFormat, export};
use asyncrl_config::RetentionPolicy;
use asyncrl_protos::Trajectory;
use asyncrl_transport::{Bus, LocalBus};

use common::*;

/// pyarrow version installed into the venv when it is missing.
const PYARROW: &str = "pyarrow==26.0.1";

fn venv_python() -> Option<PathBuf> {
    let p = asyncrl_testkit::workspace_root().join(".venv/bin/python");
    p.is_file().then_some(p)
}

/// The venv's python with pyarrow importable (installed with pip if needed).
fn python_with_pyarrow() -> Option<PathBuf> {
    let Some(python) = venv_python() else {
        eprintln!(
            "\n\n*** SKIPPING the pyarrow read-back: {} is missing (run scripts/setup) ***\n\n",
            asyncrl_testkit::workspace_root()
                .join(".venv/bin/python")
                .display()
        );
        return None;
    };
    let has = |p: &PathBuf| {
        Command::new(p)
            .args(["-c", "import pyarrow.parquet"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has(&python) {
        eprintln!("pyarrow missing in the venv: pip install {PYARROW}");
        let status = Command::new(&python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--progress-bar",
                "off",
                PYARROW,
            ])
            .status()
            .expect("run pip");
        assert!(status.success(), "pip install {PYARROW} failed");
        assert!(
            has(&python),
            "pyarrow still not importable after pip install"
        );
    }
    Some(python)
}

const READ_BACK: &str = r#"
import json, sys
import pyarrow.parquet as pq
t = pq.read_table(sys.argv[1])
d = t.to_pydict()
print(json.dumps({
    "rows": t.num_rows,
    "columns": t.column_names,
    "uuids": d["uuid"],
    "versions": sorted(set(d["admission_version"])),
    "completion_tokens": sum(len(x) for x in d["completion_token_ids"]),
    "logprob_sum": sum(sum(x) for x in d["behaviour_logprobs"]),
    "null_rewards": sum(1 for r in d["reward"] if r is None),
    "codec": pq.ParquetFile(sys.argv[1]).metadata.row_group(0).column(0).compression,
}))
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_writes_parquet_that_pyarrow_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = config("local", dir.path());
    config.buffer.retention = RetentionPolicy::Keep;
    let bus: Arc<dyn Bus> = Arc::new(LocalBus::new());
    let buffer = Running::start(&config, bus.clone()).await;
    // Versions 0..=3, 3 groups of 2 each, 10 tokens; one failed reward.
    let mut trajs: Vec<Trajectory> = (0..4)
        .flat_map(|v| (0..6).map(move |i| traj(v as u32 * 6 + i, 2, v, 10)))
        .collect();
    trajs[5].reward_status = asyncrl_protos::RewardStatus::Failed as i32;
    trajs[5].reward = f32::NAN;
    publish(bus.as_ref(), &trajs).await;
    publish_as(bus.as_ref(), &trajs[0], "republished").await; // a duplicate
    // Index 0 of group lease-0 again, with its own uuid: dead-lettered, and
    // not exported although it is in the segment.
    let intruder = asyncrl_buffer::testing::traj_of("task-0", "lease-0", 999, 0, 2, 0, 10);
    publish(bus.as_ref(), &[intruder]).await;
    eventually(
        "24 stored, the intruder dead-lettered",
        Duration::from_secs(10),
        || {
            buffer.handle.stats().live_trajectories == 24
                && buffer
                    .metrics
                    .encode_prometheus_text()
                    .unwrap()
                    .contains("asyncrl_buffer_dead_lettered_total{reason=\"group\"} 1")
        },
    )
    .await;
    // Train some of it: with retention = keep the export still has everything.
    ask(bus.as_ref(), 1, 3, 4, 4, 0).await.unwrap();
    ask(bus.as_ref(), 2, 3, 4, 4, 0).await.unwrap();

    let data_dir = config.buffer.data_dir_in(&config.run.output_dir);
    let all = dir.path().join("all.parquet");
    let summary = export(&ExportArgs {
        data_dir: data_dir.clone(),
        format: ExportFormat::Parquet,
        from_version: None,
        to_version: None,
        out: all.clone(),
    })
    .unwrap();
    assert_eq!(summary.trajectories, 24);
    let range = dir.path().join("v1-2.parquet");
    let summary = export(&ExportArgs {
        from_version: Some(1),
        to_version: Some(2),
        out: range.clone(),
        ..ExportArgs::from_config(&config, all.clone())
    })
    .unwrap();
    assert_eq!(summary.trajectories, 12);
    assert!(
        export(&ExportArgs {
            from_version: Some(3),
            to_version: Some(1),
            ..ExportArgs::from_config(&config, range.clone())
        })
        .is_err()
    );
    buffer.shutdown().await;

    let Some(python) = python_with_pyarrow() else {
        return;
    };
    let read = |path: &PathBuf| -> serde_json::Value {
        let out = Command::new(&python)
            .args(["-c", READ_BACK])
            .arg(path)
            .output()
            .expect("run python");
        assert!(
            out.status.success(),
            "python failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let v = read(&all);
    assert_eq!(v["rows"], 24);
    let mut got: Vec<String> = v["uuids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u.as_str().unwrap().to_owned())
        .collect();
    got.sort();
    let mut want: Vec<String> = trajs.iter().map(|t| t.uuid.clone()).collect();
    want.sort();
    assert_eq!(got, want);
    assert_eq!(v["versions"], serde_json::json!([0, 1, 2, 3]));
    assert_eq!(v["completion_tokens"], 240);
    let logprobs: f64 = trajs
        .iter()
        .flat_map(|t| t.behaviour_logprobs.iter().map(|x| f64::from(*x)))
        .sum();
    assert!((v["logprob_sum"].as_f64().unwrap() - logprobs).abs() < 1e-3);
    assert_eq!(v["null_rewards"], 1, "a failed reward is null, not 0");
    assert_eq!(v["codec"], "ZSTD");
    // The trajectory schema: 18 columns and the three of a multi-turn
    // episode's turns.
    assert_eq!(v["columns"].as_array().unwrap().len(), 21);
    let v = read(&range);
    assert_eq!(v["rows"], 12);
    assert_eq!(v["versions"], serde_json::json!([1, 2]));
}
