//! Many episodes driven together by a blocking caller, round by round: the
//! learner's held-out evaluation of a multi-turn task and the supervised
//! warm start on demonstrated episodes. Each round asks the caller for the
//! reply of every episode that waits for one in one call (one batched
//! decode), then sends every reply to the environment at once and waits
//! for all of them. The rollout worker does not use this: its episodes run
//! on their own, each at its own pace.

use asyncrl_text::{Message, ModelText};
use futures::future::join_all;

use crate::{
    EnvError, EnvTask, Environment, Episode, EpisodeError, EpisodeLimits, EpisodeOutput, Next,
    Reply,
};

/// One episode to run: its id (unique among those open in the
/// environment), the task the environment is reset with, and the messages
/// it starts from.
#[derive(Debug, Clone)]
pub struct LockstepEpisode {
    pub episode_id: String,
    pub task: EnvTask,
    pub messages: Vec<Message>,
}

/// A reply the caller generates: for episode `episode` (its index in the
/// list run), reply `turn` (0-based), from every token so far.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplyRequest {
    pub episode: usize,
    pub turn: usize,
    pub prompt: Vec<i64>,
    pub max_new_tokens: usize,
}

/// Why one episode has no output. The others go on.
#[derive(Debug, thiserror::Error)]
pub enum EpisodeFailure {
    #[error("cannot write the task as JSON: {0}")]
    Task(#[source] serde_json::Error),
    #[error("environment reset: {0}")]
    Reset(#[source] EnvError),
    #[error("environment step {step}: {source}")]
    Step {
        step: u32,
        #[source]
        source: EnvError,
    },
    #[error(transparent)]
    Episode(#[from] EpisodeError),
    #[error("the caller returned {got} replies for {asked} requests")]
    Replies { asked: usize, got: usize },
}

enum Slot<'a> {
    Running(Box<Episode<'a>>, Next),
    Failed(EpisodeFailure),
}

/// Runs `episodes` to their ends on `rt` (a runtime of the caller's, not
/// one whose thread this blocks), with `generate` making the replies of
/// each round, in the order of the requests it is given. Returns each
/// episode's output or failure, in order; an error of `generate` stops the
/// run. Every episode is closed in the environment at the end.
pub fn run_lockstep<E>(
    rt: &tokio::runtime::Runtime,
    env: &dyn Environment,
    text: &ModelText,
    episodes: Vec<LockstepEpisode>,
    limits: EpisodeLimits,
    stop_token_ids: &[i64],
    mut generate: impl FnMut(&[ReplyRequest]) -> Result<Vec<Reply>, E>,
) -> Result<Vec<Result<EpisodeOutput, EpisodeFailure>>, E> {
    let ids: Vec<String> = episodes.iter().map(|e| e.episode_id.clone()).collect();
    let resets = rt.block_on(join_all(
        episodes.iter().map(|e| env.reset(&e.episode_id, &e.task)),
    ));
    let mut slots: Vec<Slot> = episodes
        .into_iter()
        .zip(resets)
        .map(|(spec, reset)| {
            let started = reset.map_err(EpisodeFailure::Reset).and_then(|reset| {
                let mut episode =
                    Episode::start(text, spec.messages, &reset, limits, stop_token_ids.to_vec())?;
                let next = episode.next_action()?;
                Ok(Slot::Running(Box::new(episode), next))
            });
            started.unwrap_or_else(Slot::Failed)
        })
        .collect();
    let result = rounds(rt, env, &ids, &mut slots, &mut generate);
    rt.block_on(join_all(ids.iter().map(|id| env.close(id))));
    result?;
    Ok(slots
        .into_iter()
        .map(|slot| match slot {
            Slot::Failed(why) => Err(why),
            Slot::Running(episode, _) => {
                episode
                    .output()
                    .ok_or(EpisodeFailure::Episode(EpisodeError::OutOfOrder(
                        "the end of a run before the episode's end",
                    )))
            }
        })
        .collect())
}

fn rounds<E>(
    rt: &tokio::runtime::Runtime,
    env: &dyn Environment,
    ids: &[String],
    slots: &mut [Slot],
    generate: &mut impl FnMut(&[ReplyRequest]) -> Result<Vec<Reply>, E>,
) -> Result<(), E> {
    loop {
        let mut requests = Vec::new();
        for (i, slot) in slots.iter_mut().enumerate() {
            if let Slot::Running(episode, next @ Next::Generate { .. }) = slot {
                let turn = episode.turns();
                if let Next::Generate {
                    prompt,
                    max_new_tokens,
                } = std::mem::replace(next, Next::Done)
                {
                    requests.push(ReplyRequest {
                        episode: i,
                        turn,
                        prompt,
                        max_new_tokens,
                    });
                }
            }
        }
        if !requests.is_empty() {
            let replies = generate(&requests)?;
            if replies.len() != requests.len() {
                for r in &requests {
                    slots[r.episode] = Slot::Failed(EpisodeFailure::Replies {
                        asked: requests.len(),
                        got: replies.len(),
                    });
                }
            } else {
                for (request, reply) in requests.iter().zip(replies) {
                    let slot = &mut slots[request.episode];
                    if let Slot::Running(episode, next) = slot {
                        match episode.on_reply(reply) {
                            Ok(n) => *next = n,
                            Err(e) => *slot = Slot::Failed(e.into()),
                        }
                    }
                }
            }
        }
        let steps: Vec<(usize, u32, crate::Action)> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, slot)| match slot {
                Slot::Running(_, Next::Step { step, action }) => Some((i, *step, action.clone())),
                _ => None,
            })
            .collect();
        if !steps.is_empty() {
            let results = rt.block_on(join_all(
                steps
                    .iter()
                    .map(|(i, step, action)| env.step(&ids[*i], *step, action)),
            ));
            for ((i, step, _), result) in steps.iter().zip(results) {
                let slot = &mut slots[*i];
                let Slot::Running(episode, next) = slot else {
                    continue;
                };
                let advanced = result
                    .map_err(|source| EpisodeFailure::Step {
                        step: *step,
                        source,
                    })
                    .and_then(|r| Ok(episode.on_step(&r)?));
                match advanced {
                    Ok(n) => *next = n,
                    Err(e) => *slot = Slot::Failed(e),
                }
            }
        }
        if requests.is_empty() && steps.is_empty() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::HiddenSum;
    use crate::{ReplyEnd, prompt_messages};
    use asyncrl_text::Prompt;

    fn episode(id: &str, prompt: &str, answer: &str) -> LockstepEpisode {
        let prompt = Prompt::Text(prompt.to_owned());
        LockstepEpisode {
            episode_id: id.to_owned(),
            task: EnvTask::from_prompt(id, "hidden_sum", &prompt, answer).unwrap(),
            messages: prompt_messages(&prompt),
        }
    }

    #[test]
    fn episodes_run_in_rounds_each_to_its_own_end_and_a_failed_one_leaves_the_rest() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let text = ModelText::builtin();
        let eos = text.eos_token_ids().to_vec();
        let env = HiddenSum::new();
        let limits = EpisodeLimits {
            max_turns: 3,
            max_turn_tokens: 4,
            max_episode_tokens: 64,
        };
        // 0: asks, answers right. 1: answers at once, wrong. 2: asks, then
        // answers wrong. 3: a prompt the game cannot play. 4: asks three
        // times (max_turns).
        let episodes = vec![
            episode("e0", "7+x=", "12"),
            episode("e1", "3+x=", "4"),
            episode("e2", "1+x=", "9"),
            episode("e3", "what?", "1"),
            episode("e4", "2+x=", "2"),
        ];
        let script = [
            vec!["x?", "12"],
            vec!["5"],
            vec!["x?", "10"],
            vec![],
            vec!["x?", "x?", "x?"],
        ];
        let mut rounds = Vec::new();
        let outputs = run_lockstep(&rt, &env, &text, episodes, limits, &eos, |requests| {
            rounds.push(
                requests
                    .iter()
                    .map(|r| (r.episode, r.turn))
                    .collect::<Vec<_>>(),
            );
            Ok::<_, std::convert::Infallible>(
                requests
                    .iter()
                    .map(|r| {
                        let mut tokens = text
                            .tokenizer()
                            .encode(script[r.episode][r.turn], false)
                            .unwrap();
                        tokens.push(eos[0]);
                        Reply {
                            logprobs: vec![-0.25; tokens.len()],
                            versions: vec![r.turn as i32; tokens.len()],
                            tokens,
                            end: ReplyEnd::Stop,
                        }
                    })
                    .collect(),
            )
        })
        .unwrap();
        // One call per round, with every episode waiting for a reply.
        assert_eq!(
            rounds,
            [
                vec![(0, 0), (1, 0), (2, 0), (4, 0)],
                vec![(0, 1), (2, 1), (4, 1)],
                vec![(4, 2)]
            ]
        );
        let rewards: Vec<Option<f32>> = outputs
            .iter()
            .map(|o| o.as_ref().ok().map(|o| o.reward))
            .collect();
        assert_eq!(rewards, [Some(1.0), Some(0.0), Some(0.0), None, Some(0.0)]);
        assert!(matches!(outputs[3], Err(EpisodeFailure::Reset(_))));
        let asked = outputs[0].as_ref().unwrap();
        assert_eq!(asked.turns.len(), 2);
        assert_eq!(asked.versions, [0, 0, 0, 1, 1, 1]);
        assert_eq!(
            outputs[4].as_ref().unwrap().finish,
            asyncrl_protos::FinishReason::MaxTurns
        );
        // Every episode was closed.
        assert_eq!(env.open_episodes(), 0);
    }
}
