//! `[eval] nice`: the evaluator's thread, and the libtorch threads it
//! starts, run at the configured nice value, so that evaluating on the
//! learner's cores takes the CPU training leaves; the thread that starts it
//! keeps its priority.

use asyncrl_config::{Config, DatasetConfig};
use asyncrl_learner::eval::Evaluator;

/// The nice value of each of this process's threads named `name`, read
/// from `/proc/self/task/*/stat` (field 19).
fn nice_of_threads(name: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").expect("/proc/self/task") {
        let dir = task.expect("task").path();
        let Ok(comm) = std::fs::read_to_string(dir.join("comm")) else {
            continue; // the thread ended meanwhile
        };
        if comm.trim_end() != name {
            continue;
        }
        let stat = std::fs::read_to_string(dir.join("stat")).expect("stat");
        // After the command's closing parenthesis come fields 3, 4, ...
        let fields: Vec<&str> = stat[stat.rfind(')').expect(")") + 2..].split(' ').collect();
        out.push(fields[19 - 3].parse().expect("nice"));
    }
    out
}

fn config(dir: &std::path::Path, nice: u8) -> Config {
    let data = dir.join("arith-all.jsonl");
    asyncrl_tasks::write_jsonl(&data, &asyncrl_tasks::arith_all(4)).unwrap();
    let mut c = Config::default();
    c.run.output_dir = dir.join(format!("out-{nice}"));
    c.model.tiny.hidden_size = 32;
    c.model.tiny.num_hidden_layers = 1;
    c.model.tiny.num_attention_heads = 2;
    c.model.tiny.num_key_value_heads = 1;
    c.model.tiny.intermediate_size = 64;
    c.eval.every_steps = 1;
    c.eval.dataset = Some(DatasetConfig::jsonl("arith", &data));
    c.eval.nice = nice;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn the_evaluator_thread_runs_at_its_nice_value_and_the_learner_at_its_own() {
    if !cfg!(target_os = "linux") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let own = asyncrl_policy::affinity::current_thread_nice().expect("nice");
    for nice in [7u8, 0] {
        let metrics = asyncrl_telemetry::Metrics::new();
        let evaluator = Evaluator::start(&config(dir.path(), nice), &metrics, |_| {})
            .await
            .expect("start")
            .expect("[eval] is on");
        // A niced thread cannot go back below the process's own value.
        let want = own.max(i32::from(nice));
        assert_eq!(
            nice_of_threads("asyncrl-eval"),
            [want],
            "eval.nice = {nice}"
        );
        assert_eq!(
            asyncrl_policy::affinity::current_thread_nice(),
            Some(own),
            "the caller keeps its priority"
        );
        evaluator.finish().await.expect("finish");
    }
}
