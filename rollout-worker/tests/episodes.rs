//! Multi-turn episodes through a worker, a real nats-server and an HTTP
//! environment speaking the reset/step protocol: every trajectory read back
//! from the stream is token-exact across turns and across a weight swap
//! during the run (model tokens' log-probs recomputed under each token's
//! version), the environment's tokens carry no log-prob and are exactly the
//! template's rendering of its messages, and limits end episodes with their
//! finish reason.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use asyncrl_config::EnvironmentConfig;
use asyncrl_protos::{FinishReason, RewardStatus};
use asyncrl_rollout_worker::scripted::{ScriptOptions, ScriptedTask, read_trajectories};
use asyncrl_rollout_worker::{CancellationToken, WorkerMetrics, run};
use asyncrl_telemetry::Metrics;
use asyncrl_text::{Message, ModelText};
use common::*;
use serde_json::{Value, json};

const G: u32 = 2;
const TASKS: usize = 6;
/// Replies the environment wants before it ends an episode: task `i` needs
/// `i % 3 + 1`; with `max_turns = 2` the third kind ends by the limit.
const MAX_TURNS: u32 = 2;
const MAX_NEW: usize = 12;

/// Task `i`: `A+x=`, where the environment answers each reply with
/// `r<step>` until the task's number of steps is reached.
fn tasks() -> Vec<ScriptedTask> {
    (0..TASKS)
        .map(|i| ScriptedTask {
            task_id: format!("hs-{i:03}"),
            dataset: "hidden_sum".into(),
            prompt: format!("{}+x=", i + 2),
            answer: format!("{}", i + 9),
        })
        .collect()
}

fn steps_wanted(task_id: &str) -> u32 {
    let i: u32 = task_id.trim_start_matches("hs-").parse().unwrap();
    i % 3 + 1
}

/// An environment server: reset answers nothing; step `n` of a task that
/// wants `k` steps answers the tool message `r<n>` while `n < k`, and ends
/// the episode with reward 1 at `n = k`. It records every call.
async fn environment() -> (String, Arc<Mutex<Vec<Value>>>) {
    use axum::Json;
    use axum::Router;
    use axum::routing::post;
    let calls: Arc<Mutex<Vec<Value>>> = Arc::default();
    let tasks: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let (c1, c2, t1, t2) = (calls.clone(), calls.clone(), tasks.clone(), tasks.clone());
    let app = Router::new()
        .route(
            "/reset",
            post(move |Json(body): Json<Value>| {
                let (calls, tasks) = (c1.clone(), t1.clone());
                async move {
                    let episode = body["episode_id"].as_str().unwrap_or_default().to_owned();
                    let task = body["task"]["task_id"].as_str().unwrap_or_default().to_owned();
                    tasks.lock().unwrap().insert(episode, task);
                    calls.lock().unwrap().push(body);
                    Json(json!({"observation": {"messages": []}, "reward": null, "done": false}))
                }
            }),
        )
        .route(
            "/step",
            post(move |Json(body): Json<Value>| {
                let (calls, tasks) = (c2.clone(), t2.clone());
                async move {
                    let episode = body["episode_id"].as_str().unwrap_or_default();
                    let step = body["step"].as_u64().unwrap_or_default() as u32;
                    let task = tasks.lock().unwrap().get(episode).cloned().unwrap_or_default();
                    calls.lock().unwrap().push(body);
                    if step >= steps_wanted(&task) {
                        Json(json!({"observation": {"messages": []}, "reward": 1.0, "done": true}))
                    } else {
                        Json(json!({
                            "observation": {"messages": [{"role": "tool", "content": format!("r{step}")}]},
                            "reward": null,
                            "done": false
                        }))
                    }
                }
            }),
        )
        .route("/close", post(|| async { Json(json!({})) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, calls)
}

fn options(max_per_acquire: u32) -> ScriptOptions {
    ScriptOptions {
        group_size: G,
        admission_version: 5,
        max_per_acquire,
        heartbeat_interval_ms: 10,
        ..ScriptOptions::default()
    }
}

/// The rig's worker config with `[environment]` at `url`. Replies end at a
/// stop string (most characters), so that an untrained model's replies are
/// short and end as a stop does.
fn episode_config(rig: &Rig, url: String, max_turns: u32) -> asyncrl_config::Config {
    let mut config = rig.config.clone();
    config.model.stop_strings = "0123456789abcdefghijklmnopqrstuvwxyz "
        .chars()
        .map(String::from)
        .collect();
    config.environment = Some(EnvironmentConfig {
        url,
        max_turns,
        ..EnvironmentConfig::default()
    });
    config.validate().unwrap();
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_are_token_exact_across_turns_and_a_weight_swap_and_limits_end_them() {
    let (url, calls) = environment().await;
    let rig = Rig::nats(model_section(MAX_NEW, 64), 8, tasks(), options(2)).await;
    let config = episode_config(&rig, url, MAX_TURNS);
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(
        config.clone(),
        rig.bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    let p5 = rig.policy(1234);
    let p6 = rig.policy(99);
    rig.publish(5, &p5).await;
    let (_, _) = rig
        .coordinator
        .wait_for(Duration::from_secs(120), |l| {
            !l.completed_leases().is_empty()
        })
        .await;
    rig.publish(6, &p6).await;
    let (done, log) = rig
        .coordinator
        .wait_for(Duration::from_secs(120), |l| {
            l.completed_leases().len() == TASKS
        })
        .await;
    assert!(done, "not every task completed: {log:#?}");
    shutdown.cancel();
    worker.await.unwrap().unwrap();

    let received = read_trajectories(
        rig.bus.as_ref(),
        "episodes",
        TASKS * G as usize,
        Duration::from_secs(10),
    )
    .await
    .unwrap();
    assert_eq!(received.len(), TASKS * G as usize);
    let text = ModelText::builtin();
    let eos = text.eos_token_ids()[0];
    let (mut multi, mut by_limit, mut by_env, mut by_length) = (0, 0, 0, 0);
    let mut versions_seen = std::collections::BTreeSet::new();
    for r in &received {
        let t = &r.trajectory;
        t.validate().unwrap();
        let task = tasks()
            .into_iter()
            .find(|x| x.task_id == t.task_id)
            .unwrap();
        assert!(!t.turns.is_empty(), "an episode has turns");
        if t.turns.len() > 1 {
            multi += 1;
        }
        // The environment's tokens carry no log-prob or version.
        let mask = t.model_token_mask();
        let model_tokens = mask.iter().filter(|m| **m).count();
        assert_eq!(t.behaviour_logprobs.len(), model_tokens);
        assert_eq!(t.policy_versions.len(), model_tokens);
        assert!(t.turns.iter().skip(1).all(|turn| turn.context_tokens > 0));

        // The token ids are the template's rendering of the episode's
        // messages: the task, each reply as sampled, each tool message.
        let mut messages = vec![Message::new("user", task.prompt.clone())];
        let mut at = 0usize;
        for (k, turn) in t.turns.iter().enumerate() {
            at += turn.context_tokens as usize;
            let reply: Vec<i64> = t.completion_token_ids[at..at + turn.model_tokens as usize]
                .iter()
                .map(|&x| i64::from(x))
                .collect();
            at += turn.model_tokens as usize;
            let end = reply.len() - usize::from(reply.last() == Some(&eos));
            let content = text.tokenizer().decode(&reply[..end], false).unwrap();
            messages.push(Message::new("assistant", content));
            if k + 1 < t.turns.len() {
                messages.push(Message::new("tool", format!("r{}", k + 1)));
            }
        }
        let rendered = text
            .encode(&asyncrl_text::Prompt::Messages(messages))
            .unwrap();
        let ids: Vec<i64> = t
            .prompt_token_ids
            .iter()
            .chain(&t.completion_token_ids)
            .map(|&x| i64::from(x))
            .collect();
        // The last reply ended at a stop string: the template's `<eos>`
        // after it was never sampled.
        assert!(
            rendered == ids
                || rendered[..rendered.len() - 1] == ids[..] && rendered.last() == Some(&eos),
            "{}: tokens {ids:?} are not the rendering {rendered:?}",
            t.task_id
        );

        // Model tokens: the log-prob each token's version gives it.
        let lp5 = recompute(&p5, &t.prompt_token_ids, &t.completion_token_ids);
        let lp6 = recompute(&p6, &t.prompt_token_ids, &t.completion_token_ids);
        let mut k = 0;
        for (i, is_model) in mask.iter().enumerate() {
            if !is_model {
                continue;
            }
            let v = t.policy_versions[k];
            versions_seen.insert(v);
            let want = if v == 5 { lp5[i] } else { lp6[i] };
            assert_eq!(v.clamp(5, 6), v, "version {v}");
            assert!(
                (t.behaviour_logprobs[k] - want).abs() <= 1e-4,
                "{} token {i} (version {v}): {} vs {want}",
                t.task_id,
                t.behaviour_logprobs[k]
            );
            k += 1;
        }

        // How it ended, and the reward.
        let wanted = steps_wanted(&t.task_id);
        assert_eq!(t.reward_status, RewardStatus::Ok as i32);
        if t.finish_reason == FinishReason::Length as i32 {
            // A reply reached its token limit without a stop: the episode
            // ends there.
            by_length += 1;
            assert_eq!(t.turns.last().unwrap().model_tokens, MAX_NEW as u32);
            assert!(t.turns.len() as u32 <= wanted.min(MAX_TURNS));
            assert_eq!(t.reward, 0.0);
        } else if wanted <= MAX_TURNS {
            by_env += 1;
            assert_eq!(t.finish_reason, FinishReason::Stop as i32, "{}", t.task_id);
            assert_eq!(t.turns.len() as u32, wanted);
            assert_eq!(t.reward, 1.0);
            assert_eq!(t.turns.last().unwrap().reward, Some(1.0));
        } else {
            by_limit += 1;
            assert_eq!(
                t.finish_reason,
                FinishReason::MaxTurns as i32,
                "{}",
                t.task_id
            );
            assert_eq!(t.turns.len() as u32, MAX_TURNS);
            assert_eq!(t.reward, 0.0);
        }
    }
    assert!(
        multi > 0 && by_limit > 0 && by_env > 0,
        "{multi} {by_limit} {by_env}"
    );
    assert!(
        versions_seen.contains(&5) && versions_seen.contains(&6),
        "the swap happened during the run: {versions_seen:?}"
    );
    // One reset per episode, steps in order, and the metrics.
    let calls = calls.lock().unwrap();
    let resets = calls.iter().filter(|c| c.get("task").is_some()).count();
    assert_eq!(resets, TASKS * G as usize);
    let m = WorkerMetrics::new(&metrics).unwrap();
    assert_eq!(
        failures(&m.episodes_finished, "max_turns") as usize,
        by_limit
    );
    assert_eq!(failures(&m.episodes_finished, "stop") as usize, by_env);
    assert_eq!(failures(&m.episodes_finished, "length") as usize, by_length);
}

/// How the broken environment's steps fail.
#[derive(Clone, Copy)]
enum Broken {
    /// HTTP 200 with a body that is not JSON.
    Garbage,
    /// No reply, ever.
    Hangs,
    /// The connection closes before a reply (the handler's task dies).
    Closes,
}

/// An environment that resets well and whose every step fails as `how`.
async fn broken_environment(how: Broken) -> String {
    use axum::Router;
    use axum::routing::post;
    let step = post(move || async move {
        match how {
            Broken::Garbage => "this is not json",
            Broken::Hangs => std::future::pending().await,
            Broken::Closes => panic!("the environment's step handler dies (a test fake)"),
        }
    });
    let app = Router::new()
        .route(
            "/reset",
            post(|| async {
                axum::Json(json!({"observation": {"messages": []}, "reward": null, "done": false}))
            }),
        )
        .route("/step", step)
        .route("/close", post(|| async { "{}" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// A broken environment's episode: the task goes back to the coordinator
/// with one line naming the environment, the call and `what` went wrong;
/// nothing is published; the worker counts it (`environment_failed`, the
/// client's `outcome`) and goes on.
async fn a_broken_environment_gets_the_task_returned(how: Broken, what: &str, outcome: &str) {
    let url = broken_environment(how).await;
    let rig = Rig::local(
        model_section(MAX_NEW, 64),
        4,
        tasks()[..1].to_vec(),
        options(1),
    )
    .await;
    let mut config = episode_config(&rig, url.clone(), EnvironmentConfig::default().max_turns);
    if let Some(env) = config.environment.as_mut() {
        env.call_timeout = Duration::from_millis(300);
        env.retries = 1;
    }
    // Every reply reaches the environment: each character stops it (with
    // most characters, a reply of the untrained model sometimes reached its
    // token limit first, ended its episode without a step and was
    // published, about one run in 40).
    config.model.stop_strings = asyncrl_text::BUILTIN_CHARS
        .chars()
        .map(String::from)
        .collect();
    let metrics = Metrics::new();
    let shutdown = CancellationToken::new();
    let worker = tokio::spawn(run(
        config,
        rig.bus.clone(),
        metrics.clone(),
        shutdown.clone(),
    ));
    rig.publish(5, &rig.policy(1234)).await;
    let (returned, log) = rig
        .coordinator
        .wait_for(Duration::from_secs(60), |l| !l.returns.is_empty())
        .await;
    shutdown.cancel();
    worker.await.unwrap().unwrap();
    assert!(returned, "the task was not returned: {log:#?}");
    let reason = &log.returns[0].reason;
    assert!(
        reason.contains("environment step 1") && reason.contains(&url) && reason.contains(what),
        "one line naming the environment, the call and what was wrong ({what}): {reason}"
    );
    assert!(!reason.contains('\n'), "{reason}");
    assert!(log.completed_leases().is_empty());
    let m = WorkerMetrics::new(&metrics).unwrap();
    assert!(failures(&m.episodes_finished, "environment_failed") >= 1);
    assert_eq!(m.trajectories_published.get(), 0);
    let env = asyncrl_environment::EnvMetrics::new(&metrics).unwrap();
    assert!(env.call_count("step", outcome) >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_that_answers_garbage_gets_the_task_returned_naming_it_and_nothing_published()
 {
    a_broken_environment_gets_the_task_returned(Broken::Garbage, "JSON", "malformed").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_that_never_answers_gets_the_task_returned_after_its_timeout() {
    a_broken_environment_gets_the_task_returned(Broken::Hangs, "no reply within", "timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_that_closes_the_connection_gets_the_task_returned() {
    a_broken_environment_gets_the_task_returned(Broken::Closes, "connection failed", "connection")
        .await;
}
