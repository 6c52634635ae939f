//! Environments that run in-process, for the built-in tasks.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;

use crate::{Action, EnvError, EnvMessage, EnvTask, Environment, Observation, StepResult};

/// A heavy-tailed latency: Pareto with shape `pareto_alpha`, scaled so that
/// half the draws are below `median`. It stands in for slow tools (a
/// search, a sandbox, a remote API): most calls are quick, a few take many
/// times the median. With `pareto_alpha` ≤ 1 the mean is infinite, so a
/// draw is capped at [`LatencyModel::MAX_MEDIANS`] × `median`. Draws are
/// reproducible from `seed`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LatencyModel {
    pub median: Duration,
    /// The tail's shape, above 0: smaller is heavier (1.5 is a long tail,
    /// 3 a mild one).
    pub pareto_alpha: f64,
    pub seed: u64,
}

impl LatencyModel {
    /// The cap on one draw, in medians.
    pub const MAX_MEDIANS: u32 = 1000;

    /// The latency at the `u` quantile (`u` in (0, 1]; 1 gives the
    /// smallest value, `median / 2^(1/alpha)`; 0.5 the median).
    pub fn quantile(&self, u: f64) -> Duration {
        let cap = self.median.saturating_mul(Self::MAX_MEDIANS);
        if self.pareto_alpha.is_nan() || self.pareto_alpha <= 0.0 || self.median.is_zero() {
            return self.median.min(cap);
        }
        let u = u.clamp(f64::MIN_POSITIVE, 1.0);
        let scale = self.median.as_secs_f64() / 2f64.powf(1.0 / self.pareto_alpha);
        let seconds = scale * u.powf(-1.0 / self.pareto_alpha);
        Duration::try_from_secs_f64(seconds).map_or(cap, |d| d.min(cap))
    }
}

/// The state of a [`LatencyModel`]'s draws: SplitMix64.
#[derive(Debug)]
struct Draws {
    model: LatencyModel,
    state: u64,
}

impl Draws {
    fn next(&mut self) -> Duration {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        // 53 random bits as a uniform in (0, 1].
        let u = ((z >> 11) + 1) as f64 / (1u64 << 53) as f64;
        self.model.quantile(u)
    }
}

/// One episode of [`HiddenSum`].
#[derive(Debug)]
struct Episode {
    task_id: String,
    x: i64,
    answer: String,
    queries: u32,
    /// The index of the last step answered (0: reset).
    last_step: u32,
    last_reply: StepResult,
}

/// The built-in multi-turn task: the prompt is like `7+x=` with `x`
/// hidden; the model may ask for it before it answers.
///
/// - The task carries `x` as an integer in `metadata["x"]` and the sum in
///   `answer`. Reset returns an empty observation (the prompt comes from
///   the task), no reward, not done.
/// - A step whose content, trimmed, is exactly `x?` is a query: the
///   observation is one `tool` message `x=<value>`, no reward, not done.
///   So is each tool call of a step that has any: `lookup` with arguments
///   `{"name": "x"}` answers `x=<value>` (the message carries the call's
///   name and id), any other call an `error: ...` tool message.
/// - Any other step is the final answer: done, reward 1.0 when its trimmed
///   content equals the trimmed answer, else 0.0, and an empty observation.
/// - A query beyond `max_queries` ends the episode with reward 0.
/// - Steps are numbered from 1 and must come in order; repeating the last
///   step's index returns the same reply again (an idempotent retry).
///
/// With [`HiddenSum::with_latency`] each answered query first waits a
/// draw of the latency model (`tokio::time::sleep`), the stand-in for a
/// slow tool. Episodes are kept until `close`.
#[derive(Debug)]
pub struct HiddenSum {
    max_queries: u32,
    draws: Option<Mutex<Draws>>,
    episodes: Mutex<HashMap<String, Episode>>,
}

impl Default for HiddenSum {
    fn default() -> Self {
        Self::new()
    }
}

/// What one step does to an episode.
struct Outcome {
    reply: StepResult,
    /// Whether a query was answered (it waits the tool latency).
    answered_query: bool,
}

impl HiddenSum {
    /// The environment's name (what [`Environment::name`] returns).
    pub const NAME: &'static str = "builtin:hidden_sum";
    /// Queries answered per episode unless [`HiddenSum::with_max_queries`]
    /// says otherwise.
    pub const DEFAULT_MAX_QUERIES: u32 = 4;

    /// Up to [`HiddenSum::DEFAULT_MAX_QUERIES`] queries, answered at once.
    pub fn new() -> Self {
        Self {
            max_queries: Self::DEFAULT_MAX_QUERIES,
            draws: None,
            episodes: Mutex::new(HashMap::new()),
        }
    }

    /// Answers up to `max_queries` queries per episode; the next one ends it
    /// with reward 0.
    pub fn with_max_queries(mut self, max_queries: u32) -> Self {
        self.max_queries = max_queries;
        self
    }

    /// Waits a draw of `model` before answering each query.
    pub fn with_latency(mut self, model: LatencyModel) -> Self {
        self.draws = Some(Mutex::new(Draws {
            model,
            state: model.seed,
        }));
        self
    }

    /// The replies of an episode of `task` played right: ask for `x`, then
    /// give the answer. The supervised warm start of the multi-turn task
    /// learns from these.
    pub fn demonstration(task: &EnvTask) -> Vec<String> {
        vec!["x?".to_owned(), task.answer.trim().to_owned()]
    }

    /// Episodes reset and not closed.
    pub fn open_episodes(&self) -> usize {
        self.episodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    fn refused(call: &'static str, reason: String) -> EnvError {
        EnvError::Refused {
            env: Self::NAME.to_owned(),
            call,
            reason,
        }
    }

    /// The reply to `action` in `episode`, which it updates.
    fn play(&self, episode: &mut Episode, action: &Action) -> Outcome {
        let tool = |content: String, call: Option<&crate::ActionToolCall>| EnvMessage {
            role: "tool".to_owned(),
            content,
            name: call.map(|c| c.name.clone()),
            tool_call_id: call.and_then(|c| c.id.clone()),
        };
        let mut replies = Vec::new();
        if !action.tool_calls.is_empty() {
            for call in &action.tool_calls {
                let content = match (call.name.as_str(), call.arguments.get("name")) {
                    ("lookup", Some(serde_json::Value::String(name))) if name == "x" => {
                        format!("x={}", episode.x)
                    }
                    ("lookup", Some(serde_json::Value::String(name))) => {
                        format!("error: no variable named {name:?}")
                    }
                    ("lookup", _) => "error: lookup takes {\"name\": \"x\"}".to_owned(),
                    (other, _) => format!("error: unknown tool {other:?}"),
                };
                replies.push(tool(content, Some(call)));
            }
        } else if action.content.trim() == "x?" {
            replies.push(tool(format!("x={}", episode.x), None));
        } else {
            let right = action.content.trim() == episode.answer.trim();
            return Outcome {
                reply: StepResult {
                    observation: Observation::default(),
                    reward: Some(if right { 1.0 } else { 0.0 }),
                    done: true,
                },
                answered_query: false,
            };
        }
        episode.queries += replies.len() as u32;
        if episode.queries > self.max_queries {
            return Outcome {
                reply: StepResult {
                    observation: Observation::default(),
                    reward: Some(0.0),
                    done: true,
                },
                answered_query: false,
            };
        }
        Outcome {
            reply: StepResult {
                observation: Observation {
                    messages: replies,
                    tools: Vec::new(),
                },
                reward: None,
                done: false,
            },
            answered_query: true,
        }
    }
}

#[async_trait]
impl Environment for HiddenSum {
    async fn reset(&self, episode_id: &str, task: &EnvTask) -> Result<StepResult, EnvError> {
        let x = hidden_value(task).ok_or_else(|| {
            Self::refused(
                "reset",
                format!(
                    "task {:?} has neither an integer metadata[\"x\"] nor a prompt \"A+x=\" with an integer answer (metadata: {}, prompt: {})",
                    task.task_id, task.metadata, task.prompt
                ),
            )
        })?;
        let mut episodes = self.episodes.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(existing) = episodes.get(episode_id) {
            // A repeated reset (a retry) of an episode that has not stepped.
            if existing.last_step == 0 && existing.task_id == task.task_id {
                return Ok(existing.last_reply.clone());
            }
            return Err(Self::refused(
                "reset",
                format!("episode {episode_id:?} already exists"),
            ));
        }
        let reply = StepResult::default();
        episodes.insert(
            episode_id.to_owned(),
            Episode {
                task_id: task.task_id.clone(),
                x,
                answer: task.answer.clone(),
                queries: 0,
                last_step: 0,
                last_reply: reply.clone(),
            },
        );
        Ok(reply)
    }

    async fn step(
        &self,
        episode_id: &str,
        step: u32,
        action: &Action,
    ) -> Result<StepResult, EnvError> {
        let outcome = {
            let mut episodes = self.episodes.lock().unwrap_or_else(PoisonError::into_inner);
            let episode = episodes
                .get_mut(episode_id)
                .ok_or_else(|| Self::refused("step", format!("unknown episode {episode_id:?}")))?;
            if step > 0 && step == episode.last_step {
                return Ok(episode.last_reply.clone());
            }
            if episode.last_reply.done {
                return Err(Self::refused(
                    "step",
                    format!("episode {episode_id:?} is done (step {step})"),
                ));
            }
            if step != episode.last_step + 1 {
                return Err(Self::refused(
                    "step",
                    format!(
                        "step {step} of episode {episode_id:?} is out of order (expected {})",
                        episode.last_step + 1
                    ),
                ));
            }
            let outcome = self.play(episode, action);
            episode.last_step = step;
            episode.last_reply = outcome.reply.clone();
            outcome
        };
        if outcome.answered_query
            && let Some(draws) = &self.draws
        {
            let delay = draws.lock().unwrap_or_else(PoisonError::into_inner).next();
            tokio::time::sleep(delay).await;
        }
        Ok(outcome.reply)
    }

    async fn close(&self, episode_id: &str) {
        self.episodes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(episode_id);
    }

    fn name(&self) -> &str {
        Self::NAME
    }
}

/// The hidden `x` of a task: `metadata["x"]` when the task carries it,
/// else derived from a prompt `A+x=` and the answer (`x = answer − A`), as
/// the built-in `hidden_sum` data set has it.
pub fn hidden_value(task: &EnvTask) -> Option<i64> {
    if let Some(x) = task.metadata.get("x") {
        return x.as_i64();
    }
    let a = task
        .prompt
        .as_str()?
        .strip_suffix("+x=")?
        .parse::<i64>()
        .ok()?;
    let sum = task.answer.trim().parse::<i64>().ok()?;
    Some(sum - a)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ActionToolCall;

    fn task(x: i64, answer: &str) -> EnvTask {
        EnvTask {
            task_id: "t1".into(),
            dataset: "hidden_sum".into(),
            prompt: serde_json::json!("7+x="),
            answer: answer.into(),
            metadata: serde_json::json!({ "x": x }),
        }
    }

    fn tool(content: &str) -> EnvMessage {
        EnvMessage::new("tool", content)
    }

    #[tokio::test]
    async fn query_then_right_answer() {
        let env = HiddenSum::new();
        let reset = env.reset("e", &task(12, "19")).await.unwrap();
        assert_eq!(reset, StepResult::default());
        let q = env.step("e", 1, &Action::text(" x? ")).await.unwrap();
        assert_eq!(q.observation.messages, vec![tool("x=12")]);
        assert_eq!((q.reward, q.done), (None, false));
        let a = env.step("e", 2, &Action::text("19\n")).await.unwrap();
        assert_eq!(a.observation, Observation::default());
        assert_eq!((a.reward, a.done), (Some(1.0), true));
    }

    #[tokio::test]
    async fn wrong_answer_scores_zero_and_ends() {
        let env = HiddenSum::new();
        env.reset("e", &task(-3, "4")).await.unwrap();
        let a = env.step("e", 1, &Action::text("5")).await.unwrap();
        assert_eq!((a.reward, a.done), (Some(0.0), true));
        let err = env.step("e", 2, &Action::text("4")).await.unwrap_err();
        assert_eq!(err.kind(), "refused");
        assert!(err.to_string().contains("is done"), "{err}");
    }

    #[tokio::test]
    async fn a_query_beyond_max_queries_ends_with_zero() {
        let env = HiddenSum::new().with_max_queries(2);
        env.reset("e", &task(1, "8")).await.unwrap();
        for step in 1..=2 {
            let q = env.step("e", step, &Action::text("x?")).await.unwrap();
            assert!(!q.done, "query {step} should be answered");
        }
        let over = env.step("e", 3, &Action::text("x?")).await.unwrap();
        assert_eq!(over.observation, Observation::default());
        assert_eq!((over.reward, over.done), (Some(0.0), true));
    }

    #[tokio::test]
    async fn tool_calls_are_queries() {
        let env = HiddenSum::new();
        env.reset("e", &task(5, "12")).await.unwrap();
        let action = Action {
            content: "let me look".into(),
            tool_calls: vec![
                ActionToolCall {
                    id: Some("c1".into()),
                    name: "lookup".into(),
                    arguments: serde_json::json!({"name": "x"}),
                },
                ActionToolCall {
                    id: None,
                    name: "search".into(),
                    arguments: serde_json::json!({}),
                },
            ],
        };
        let r = env.step("e", 1, &action).await.unwrap();
        let m = &r.observation.messages;
        assert_eq!(m.len(), 2);
        assert_eq!(
            (
                m[0].content.as_str(),
                m[0].name.as_deref(),
                m[0].tool_call_id.as_deref()
            ),
            ("x=5", Some("lookup"), Some("c1"))
        );
        assert_eq!(m[1].content, "error: unknown tool \"search\"");
        assert!(!r.done);
    }

    #[tokio::test]
    async fn steps_in_order_and_repeats_are_idempotent() {
        let env = HiddenSum::new();
        env.reset("e", &task(2, "9")).await.unwrap();
        // A retried reset of the same task is answered again.
        env.reset("e", &task(2, "9")).await.unwrap();
        let err = env.step("e", 2, &Action::text("x?")).await.unwrap_err();
        assert!(
            err.to_string().contains("out of order (expected 1)"),
            "{err}"
        );
        let first = env.step("e", 1, &Action::text("x?")).await.unwrap();
        // The same index again: the same reply, and not a second query.
        let again = env.step("e", 1, &Action::text("9")).await.unwrap();
        assert_eq!(first, again);
        let err = env.reset("e", &task(2, "9")).await.unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
        let err = env.step("other", 1, &Action::text("x?")).await.unwrap_err();
        assert_eq!(
            err.to_string(),
            "environment builtin:hidden_sum step refused: unknown episode \"other\""
        );
        env.close("e").await;
        assert_eq!(env.open_episodes(), 0);
    }

    #[tokio::test]
    async fn a_task_without_x_is_refused() {
        let env = HiddenSum::new();
        let mut t = task(0, "7");
        t.metadata = serde_json::json!({ "x": "twelve" });
        let err = env.reset("e", &t).await.unwrap_err();
        assert_eq!(err.kind(), "refused");
        assert!(
            err.to_string().contains("neither an integer metadata"),
            "{err}"
        );
        // Without metadata, `x` is the answer less the prompt's operand.
        t.metadata = serde_json::Value::Null;
        t.answer = "19".into();
        assert_eq!(hidden_value(&t), Some(12));
        t.prompt = serde_json::json!("7*x=");
        assert_eq!(hidden_value(&t), None);
    }

    #[test]
    fn latency_quantiles() {
        let m = LatencyModel {
            median: Duration::from_millis(100),
            pareto_alpha: 1.5,
            seed: 1,
        };
        let median = m.quantile(0.5).as_secs_f64();
        assert!((median - 0.1).abs() < 1e-9, "{median}");
        // The 1% tail: 0.1 * 50^(2/3) = 1.357 s.
        let p99 = m.quantile(0.01).as_secs_f64();
        assert!((p99 - 1.357).abs() < 0.001, "{p99}");
        // The far tail is capped.
        assert_eq!(m.quantile(0.0), Duration::from_secs(100));
        // A shape that is not above 0 gives the median, always.
        for alpha in [0.0, -1.0, f64::NAN] {
            let m = LatencyModel {
                pareto_alpha: alpha,
                ..m
            };
            assert_eq!(m.quantile(0.01), Duration::from_millis(100), "{alpha}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn queries_wait_the_latency_draws() {
        let model = LatencyModel {
            median: Duration::from_millis(200),
            pareto_alpha: 1.2,
            seed: 42,
        };
        let mut draws = Draws {
            model,
            state: model.seed,
        };
        let expected: Vec<Duration> = (0..3).map(|_| draws.next()).collect();
        assert!(
            expected.iter().all(|d| *d >= model.quantile(1.0)),
            "{expected:?}"
        );
        let env = HiddenSum::new().with_latency(model);
        env.reset("e", &task(4, "11")).await.unwrap();
        for (i, want) in expected.iter().enumerate() {
            let started = tokio::time::Instant::now();
            env.step("e", i as u32 + 1, &Action::text("x?"))
                .await
                .unwrap();
            // The timer wheel rounds a deadline up to the millisecond.
            let waited = started.elapsed();
            assert!(
                waited >= *want && waited <= *want + Duration::from_millis(1),
                "query {}: waited {waited:?}, drew {want:?}",
                i + 1
            );
        }
        // A final answer does not wait.
        let started = tokio::time::Instant::now();
        env.step("e", 4, &Action::text("11")).await.unwrap();
        assert_eq!(started.elapsed(), Duration::ZERO);
    }
}
