//! The HTTP client against the real example environment,
//! `environments/calc_env` (Python), started as a separate process:
//! `$ASYNCRL_PYTHON` or `<workspace>/.venv/bin/python -m asyncrl_calc_env
//! --port 0`, with the package's folder on `PYTHONPATH` (it needs nothing
//! beyond the standard library, so no install is needed).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use asyncrl_environment::{
    Action, ActionToolCall, EnvMessage, EnvTask, Environment, HttpEnvSettings, HttpEnvironment,
    StepResult,
};
use asyncrl_telemetry::Metrics;
use serde_json::json;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const LISTENING: &str = "asyncrl-calc-env listening on ";

/// A running `python -m asyncrl_calc_env`, killed when dropped.
struct CalcEnv {
    child: Child,
    url: String,
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the crate is in the workspace")
        .to_path_buf()
}

fn python() -> PathBuf {
    match std::env::var_os("ASYNCRL_PYTHON") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => {
            let venv = workspace().join(".venv/bin/python");
            assert!(
                venv.exists(),
                "no Python interpreter for the example environment: {} does not exist; run scripts/setup or set ASYNCRL_PYTHON",
                venv.display()
            );
            venv
        }
    }
}

impl CalcEnv {
    async fn start(args: &[&str]) -> Self {
        let python = python();
        let package = workspace().join("environments/calc_env");
        let mut pythonpath = std::ffi::OsString::from(&package);
        if let Some(existing) = std::env::var_os("PYTHONPATH") {
            pythonpath.push(":");
            pythonpath.push(existing);
        }
        let mut child = Command::new(&python)
            .args(["-m", "asyncrl_calc_env", "--port", "0"])
            .args(args)
            .env("PYTHONPATH", pythonpath)
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start the example environment with {}: {e} (run scripts/setup or set ASYNCRL_PYTHON)",
                    python.display()
                )
            });
        let stdout = child.stdout.take().expect("stdout is piped");
        let first = tokio::time::timeout(
            Duration::from_secs(60),
            BufReader::new(stdout).lines().next_line(),
        )
        .await
        .expect("the example environment printed nothing within 60 s")
        .expect("cannot read the example environment's output");
        let line = first.unwrap_or_else(|| {
            panic!(
                "{} -m asyncrl_calc_env exited before listening (is {} there?)",
                python.display(),
                package.display()
            )
        });
        let url = line
            .strip_prefix(LISTENING)
            .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
            .to_owned();
        let env = CalcEnv { child, url };
        env.wait_healthy().await;
        env
    }

    /// Polls `/health`, a bounded number of times.
    async fn wait_healthy(&self) {
        let probe = client(&self.url, Duration::from_secs(2), 0);
        let mut last = None;
        for _ in 0..50 {
            match probe.health().await {
                Ok(()) => return,
                Err(e) => last = Some(e),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{} never became healthy: {last:?}", self.url);
    }

    async fn stop(mut self) {
        self.child
            .kill()
            .await
            .expect("kill the example environment");
    }
}

fn client(url: &str, call_timeout: Duration, retries: u32) -> HttpEnvironment {
    let settings = HttpEnvSettings {
        url: url.to_owned(),
        call_timeout,
        retries,
        backoff: (Duration::from_millis(1), Duration::from_millis(20)),
    };
    HttpEnvironment::new(settings, &Metrics::new()).unwrap()
}

fn task(x: i64, answer: &str) -> EnvTask {
    EnvTask {
        task_id: "t1".into(),
        dataset: "hidden_sum".into(),
        prompt: json!("7+x="),
        answer: answer.into(),
        metadata: json!({ "x": x }),
    }
}

fn tool(content: &str) -> EnvMessage {
    EnvMessage::new("tool", content)
}

#[tokio::test]
async fn a_whole_episode_with_a_query_a_tool_call_and_the_answer() {
    let server = CalcEnv::start(&[]).await;
    let env = client(&server.url, Duration::from_secs(10), 2);

    let reset = env.reset("ep", &task(12, "19")).await.unwrap();
    assert!(reset.observation.messages.is_empty());
    assert_eq!(
        reset.observation.tools[0]["function"]["name"],
        json!("lookup")
    );
    assert_eq!((reset.reward, reset.done), (None, false));

    let query = env.step("ep", 1, &Action::text("x?")).await.unwrap();
    assert_eq!(
        query,
        StepResult {
            observation: asyncrl_environment::Observation {
                messages: vec![tool("x=12")],
                tools: vec![],
            },
            reward: None,
            done: false,
        }
    );

    let call = Action {
        content: String::new(),
        tool_calls: vec![ActionToolCall {
            id: Some("call-7".into()),
            name: "lookup".into(),
            arguments: json!({ "name": "x" }),
        }],
    };
    let looked_up = env.step("ep", 2, &call).await.unwrap();
    assert_eq!(
        looked_up.observation.messages,
        vec![EnvMessage {
            role: "tool".into(),
            content: "x=12".into(),
            name: Some("lookup".into()),
            tool_call_id: Some("call-7".into()),
        }]
    );

    let answer = env.step("ep", 3, &Action::text(" 19\n")).await.unwrap();
    assert_eq!((answer.reward, answer.done), (Some(1.0), true));
    assert!(answer.observation.messages.is_empty());
    env.close("ep").await;

    let m = env.metrics();
    assert_eq!(m.call_count("reset", "ok"), 1);
    assert_eq!(m.call_count("step", "ok"), 3);
    assert_eq!(m.call_count("close", "ok"), 1);
    assert_eq!(m.retry_count("step"), 0);
    server.stop().await;
}

#[tokio::test]
async fn a_repeated_step_is_answered_from_the_cache() {
    let server = CalcEnv::start(&["--max-queries", "1"]).await;
    let env = client(&server.url, Duration::from_secs(10), 0);
    env.reset("ep", &task(3, "10")).await.unwrap();
    let first = env.step("ep", 1, &Action::text("x?")).await.unwrap();
    // Same index, another action: the first reply again, not a new step.
    let again = env.step("ep", 1, &Action::text("10")).await.unwrap();
    assert_eq!(first, again);
    // The one query allowed was used once: a second one ends the episode.
    let over = env.step("ep", 2, &Action::text("x?")).await.unwrap();
    assert_eq!((over.reward, over.done), (Some(0.0), true));
    server.stop().await;
}

#[tokio::test]
async fn wrong_requests_are_refused_and_not_retried() {
    let server = CalcEnv::start(&[]).await;
    let env = client(&server.url, Duration::from_secs(10), 3);
    let url = &server.url;

    let err = env.step("nope", 1, &Action::text("x?")).await.unwrap_err();
    assert_eq!(err.kind(), "refused");
    assert_eq!(
        err.to_string(),
        format!("environment {url} step refused: HTTP 400: unknown episode 'nope'")
    );

    let mut bad = task(0, "7");
    bad.metadata = json!({ "x": "seven" });
    let err = env.reset("ep", &bad).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "environment {url} reset refused: HTTP 400: task.metadata.x must be int, got \"seven\""
        )
    );

    env.reset("ep", &task(1, "8")).await.unwrap();
    let err = env.step("ep", 2, &Action::text("x?")).await.unwrap_err();
    assert!(
        err.to_string()
            .ends_with("step 2 of episode 'ep' is out of order (expected 1)"),
        "{err}"
    );
    env.step("ep", 1, &Action::text("9")).await.unwrap();
    let err = env.step("ep", 2, &Action::text("8")).await.unwrap_err();
    assert!(err.to_string().contains("is done"), "{err}");
    env.close("ep").await;
    let err = env.step("ep", 1, &Action::text("8")).await.unwrap_err();
    assert!(err.to_string().contains("unknown episode"), "{err}");

    let m = env.metrics();
    assert_eq!(m.call_count("step", "refused"), 4);
    assert_eq!(m.call_count("reset", "refused"), 1);
    assert_eq!(m.retry_count("step") + m.retry_count("reset"), 0);
    server.stop().await;
}

#[tokio::test]
async fn a_slow_query_times_out_and_the_retry_gets_the_same_reply() {
    // Each query waits 5 s on the server; the client gives up after 300 ms.
    // The server applied the step before waiting, so the retry (the same
    // step index) is answered at once from its cache: the query counts once.
    let server = CalcEnv::start(&["--latency-ms", "5000", "--max-queries", "1"]).await;
    let env = client(&server.url, Duration::from_millis(300), 1);
    env.reset("ep", &task(12, "19")).await.unwrap();
    let reply = env.step("ep", 1, &Action::text("x?")).await.unwrap();
    assert_eq!(reply.observation.messages, vec![tool("x=12")]);
    let m = env.metrics();
    assert_eq!(m.call_count("step", "timeout"), 1);
    assert_eq!(m.call_count("step", "ok"), 1);
    assert_eq!(m.retry_count("step"), 1);
    let answer = env.step("ep", 2, &Action::text("19")).await.unwrap();
    assert_eq!((answer.reward, answer.done), (Some(1.0), true));
    server.stop().await;
}
