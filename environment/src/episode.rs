//! One multi-turn episode, token-in, token-out: a pure state machine that
//! the worker (and the learner's held-out evaluation) drives with its own
//! engine and environment.
//!
//! The episode keeps the exact token ids of everything so far. A reply is
//! appended as sampled, with its log-probs and versions. The environment's
//! messages are appended to the conversation, the conversation is rendered
//! by the chat template, and only the text the rendering adds after the
//! tokens so far (the template's scaffolding after the reply, the messages,
//! the next generation prompt) is tokenized: earlier turns are never
//! re-tokenized. The assistant message keeps the reply's raw text (tool
//! calls included, as the model wrote them), so that the template renders
//! exactly what was sampled; the environment gets the parsed calls.
//!
//! A template that renders an earlier turn differently once a later one is
//! added (one that drops earlier reasoning, say) cannot be extended this
//! way; the episode stops with [`EpisodeError::TemplateRewrites`].

use asyncrl_protos::{FinishReason, Turn};
use asyncrl_text::{Message, ModelText, ToolCallFormat, parse_tool_calls};
use serde_json::Value;

use crate::{Action, ActionToolCall, EnvMessage, StepResult};

/// The limits of one episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpisodeLimits {
    /// Model replies at most.
    pub max_turns: u32,
    /// Tokens per reply at most.
    pub max_turn_tokens: usize,
    /// Prompt + completion tokens at most.
    pub max_episode_tokens: usize,
}

/// How a reply ended, as the engine reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyEnd {
    /// A stop token (the last token) or a stop string ended it.
    Stop,
    /// The reply reached its token limit.
    Length,
}

/// One reply of the policy, exactly as sampled.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub versions: Vec<i32>,
    pub end: ReplyEnd,
}

/// What the driver does next.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Generate a reply from `prompt` (every token so far) of at most
    /// `max_new_tokens` tokens.
    Generate {
        prompt: Vec<i64>,
        max_new_tokens: usize,
    },
    /// Send the reply to the environment (`step` is 1-based).
    Step { step: u32, action: Action },
    /// The episode is over.
    Done,
}

/// The episode's failures that are not the model's: its task goes back to
/// the coordinator.
#[derive(Debug, thiserror::Error)]
pub enum EpisodeError {
    #[error("cannot render the episode's messages: {0}")]
    Render(#[source] asyncrl_text::TextError),
    #[error("the model has no chat template; multi-turn episodes render messages with one")]
    NoChatTemplate,
    #[error(
        "the chat template renders the earlier turns differently once the environment's reply is added (they differ from byte {at}); multi-turn episodes need a template that only appends"
    )]
    TemplateRewrites { at: usize },
    #[error(
        "the environment's message {index} has role {role:?}; it may send `user`, `tool` or `system` messages"
    )]
    Role { index: usize, role: String },
    #[error("the reply has {tokens} tokens, {logprobs} log-probs and {versions} versions")]
    Reply {
        tokens: usize,
        logprobs: usize,
        versions: usize,
    },
    /// The driver called the episode out of order (a bug in the driver).
    #[error("the episode got {0} out of order")]
    OutOfOrder(&'static str),
}

/// A finished episode, as a trajectory holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeOutput {
    pub prompt: Vec<i64>,
    pub completion: Vec<i64>,
    /// One per model token.
    pub logprobs: Vec<f32>,
    pub versions: Vec<i32>,
    pub turns: Vec<Turn>,
    pub finish: FinishReason,
    /// The sum of the environment's rewards.
    pub reward: f32,
    /// The conversation, each assistant message with the reply's raw text:
    /// rendered by the chat template (no generation prompt) it is the text
    /// of `prompt` + `completion` up to the last reply's stop token.
    pub messages: Vec<Message>,
    /// A one-line reason when a limit or an unreadable tool call ended it.
    pub note: Option<String>,
}

enum State {
    Generate,
    Step,
    Done,
}

/// One episode.
pub struct Episode<'a> {
    text: &'a ModelText,
    limits: EpisodeLimits,
    stop_token_ids: Vec<i64>,
    tools: Option<Vec<Value>>,
    format: Option<ToolCallFormat>,
    messages: Vec<Message>,
    prompt: Vec<i64>,
    completion: Vec<i64>,
    logprobs: Vec<f32>,
    versions: Vec<i32>,
    turns: Vec<Turn>,
    /// Context tokens waiting for the next reply.
    pending: usize,
    steps: u32,
    reward: f32,
    state: State,
    finish: FinishReason,
    note: Option<String>,
}

impl<'a> Episode<'a> {
    /// Starts an episode from the task's messages and the environment's
    /// reset observation (its messages follow the task's; its tools, when
    /// it gives any, are the tools the template is shown).
    pub fn start(
        text: &'a ModelText,
        task_messages: Vec<Message>,
        reset: &StepResult,
        limits: EpisodeLimits,
        stop_token_ids: Vec<i64>,
    ) -> Result<Self, EpisodeError> {
        let mut messages = task_messages;
        for (index, m) in reset.observation.messages.iter().enumerate() {
            messages.push(env_message(index, m)?);
        }
        let tools = (!reset.observation.tools.is_empty()).then(|| reset.observation.tools.clone());
        let rendered = render(text, &messages, tools.as_deref(), true)?;
        let prompt = text
            .tokenizer()
            .encode(&rendered, false)
            .map_err(EpisodeError::Render)?;
        let mut episode = Self {
            text,
            limits,
            stop_token_ids,
            format: text.tool_call_format(),
            tools,
            messages,
            prompt,
            completion: Vec::new(),
            logprobs: Vec::new(),
            versions: Vec::new(),
            turns: Vec::new(),
            pending: 0,
            steps: 0,
            reward: reset.reward.unwrap_or(0.0),
            state: State::Generate,
            finish: FinishReason::Stop,
            note: None,
        };
        if reset.done {
            episode.state = State::Done;
        }
        Ok(episode)
    }

    fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }

    fn end(&mut self, finish: FinishReason, note: Option<String>) -> Next {
        // Context tokens after the last reply are not part of the episode.
        self.completion
            .truncate(self.completion.len() - self.pending);
        self.pending = 0;
        self.finish = finish;
        self.note = note;
        self.state = State::Done;
        Next::Done
    }

    /// What to do next. Call it after [`Episode::start`], after each reply
    /// and after each step.
    pub fn next_action(&mut self) -> Result<Next, EpisodeError> {
        match self.state {
            State::Done => Ok(Next::Done),
            State::Step => Err(EpisodeError::OutOfOrder(
                "a request for its next action while a step is pending",
            )),
            State::Generate => {
                if self.turns.len() as u32 >= self.limits.max_turns {
                    let note = format!(
                        "the episode reached environment.max_turns = {} replies",
                        self.limits.max_turns
                    );
                    return Ok(self.end(FinishReason::MaxTurns, Some(note)));
                }
                let room = self.limits.max_episode_tokens.saturating_sub(self.len());
                if room == 0 {
                    let note = format!(
                        "the episode reached {} tokens (environment.max_episode_tokens or the model's context)",
                        self.limits.max_episode_tokens
                    );
                    return Ok(self.end(FinishReason::EpisodeLength, Some(note)));
                }
                let mut prompt = Vec::with_capacity(self.len());
                prompt.extend_from_slice(&self.prompt);
                prompt.extend_from_slice(&self.completion);
                Ok(Next::Generate {
                    prompt,
                    max_new_tokens: room.min(self.limits.max_turn_tokens),
                })
            }
        }
    }

    /// Appends the policy's reply and returns what to do next: send it to
    /// the environment, or stop (a reply cut by its length, a tool call the
    /// parser cannot read).
    pub fn on_reply(&mut self, reply: Reply) -> Result<Next, EpisodeError> {
        if !matches!(self.state, State::Generate) {
            return Err(EpisodeError::OutOfOrder("a reply"));
        }
        let n = reply.tokens.len();
        if n == 0 || reply.logprobs.len() != n || reply.versions.len() != n {
            return Err(EpisodeError::Reply {
                tokens: n,
                logprobs: reply.logprobs.len(),
                versions: reply.versions.len(),
            });
        }
        self.turns.push(Turn {
            context_tokens: u32::try_from(self.pending).unwrap_or(u32::MAX),
            model_tokens: u32::try_from(n).unwrap_or(u32::MAX),
            reward: None,
        });
        self.pending = 0;
        self.completion.extend_from_slice(&reply.tokens);
        self.logprobs.extend_from_slice(&reply.logprobs);
        self.versions.extend_from_slice(&reply.versions);
        // The reply's text exactly as sampled (special tokens kept), less a
        // final stop token, which the template writes after the content.
        let end = match reply.tokens.last() {
            Some(last) if self.stop_token_ids.contains(last) => n - 1,
            _ => n,
        };
        let raw = self
            .text
            .tokenizer()
            .decode(&reply.tokens[..end], false)
            .map_err(EpisodeError::Render)?;
        self.messages.push(Message::new("assistant", raw.clone()));
        if reply.end == ReplyEnd::Length {
            let note = format!(
                "reply {} reached its {} tokens without a stop token",
                self.turns.len(),
                n
            );
            return Ok(self.end(FinishReason::Length, Some(note)));
        }
        let (content, calls) = match self.format {
            None => (raw, Vec::new()),
            Some(format) => match parse_tool_calls(format, &raw) {
                Ok(parsed) => (parsed.content, parsed.tool_calls),
                Err(e) => {
                    let note = format!("reply {}: {e}", self.turns.len());
                    return Ok(self.end(FinishReason::ToolCallUnreadable, Some(note)));
                }
            },
        };
        self.steps += 1;
        self.state = State::Step;
        Ok(Next::Step {
            step: self.steps,
            action: Action {
                content,
                tool_calls: calls
                    .into_iter()
                    .map(|c| ActionToolCall {
                        id: c.id,
                        name: c.function.name,
                        arguments: c.function.arguments,
                    })
                    .collect(),
            },
        })
    }

    /// Takes the environment's answer to the last step.
    pub fn on_step(&mut self, result: &StepResult) -> Result<Next, EpisodeError> {
        if !matches!(self.state, State::Step) {
            return Err(EpisodeError::OutOfOrder("a step result"));
        }
        if let Some(r) = result.reward {
            self.reward += r;
            if let Some(turn) = self.turns.last_mut() {
                turn.reward = Some(r);
            }
        }
        if result.done {
            self.state = State::Done;
            self.finish = FinishReason::Stop;
            return Ok(Next::Done);
        }
        for (index, m) in result.observation.messages.iter().enumerate() {
            self.messages.push(env_message(index, m)?);
        }
        // The text of every token so far, then the conversation rendered
        // with the generation prompt: the context tokens are what it adds.
        let mut all = Vec::with_capacity(self.len());
        all.extend_from_slice(&self.prompt);
        all.extend_from_slice(&self.completion);
        let so_far = self
            .text
            .tokenizer()
            .decode(&all, false)
            .map_err(EpisodeError::Render)?;
        let rendered = render(self.text, &self.messages, self.tools.as_deref(), true)?;
        let Some(added) = rendered.strip_prefix(so_far.as_str()) else {
            let at = so_far
                .bytes()
                .zip(rendered.bytes())
                .take_while(|(a, b)| a == b)
                .count();
            return Err(EpisodeError::TemplateRewrites { at });
        };
        let context = self
            .text
            .tokenizer()
            .encode(added, false)
            .map_err(EpisodeError::Render)?;
        self.pending = context.len();
        self.completion.extend_from_slice(&context);
        self.state = State::Generate;
        self.next_action()
    }

    /// The finished episode (`None` until [`Next::Done`]).
    pub fn output(&self) -> Option<EpisodeOutput> {
        if !matches!(self.state, State::Done) {
            return None;
        }
        Some(EpisodeOutput {
            prompt: self.prompt.clone(),
            completion: self.completion.clone(),
            logprobs: self.logprobs.clone(),
            versions: self.versions.clone(),
            turns: self.turns.clone(),
            finish: self.finish,
            reward: self.reward,
            messages: self.messages.clone(),
            note: self.note.clone(),
        })
    }

    /// The replies so far.
    pub fn turns(&self) -> usize {
        self.turns.len()
    }
}

fn render(
    text: &ModelText,
    messages: &[Message],
    tools: Option<&[Value]>,
    add_generation_prompt: bool,
) -> Result<String, EpisodeError> {
    if text.chat_template().is_none() {
        return Err(EpisodeError::NoChatTemplate);
    }
    text.render_messages(messages, tools, add_generation_prompt)
        .map_err(EpisodeError::Render)
}

/// An environment's message as a chat message (`user`, `tool` or `system`).
fn env_message(index: usize, m: &EnvMessage) -> Result<Message, EpisodeError> {
    if !matches!(m.role.as_str(), "user" | "tool" | "system") {
        return Err(EpisodeError::Role {
            index,
            role: m.role.clone(),
        });
    }
    let mut out = Message::new(m.role.clone(), m.content.clone());
    out.name = m.name.clone();
    out.tool_call_id = m.tool_call_id.clone();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use asyncrl_text::{ModelFacts, PolicyTokenizer};

    use super::*;
    use crate::Observation;

    /// The built-in character tokenizer with a template that writes tool
    /// calls the Hermes way (so replies are parsed for `<tool_call>`).
    fn hermes_text() -> ModelText {
        let tokenizer = PolicyTokenizer::builtin();
        let eos = tokenizer.token_to_id("<eos>").unwrap();
        let template = "{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}<eos>{% elif m.role == 'tool' %}<tool_response>{{ m.content }};{% else %}{{ m.content }}{% endif %}{% endfor %}";
        let config = serde_json::json!({"chat_template": template, "eos_token": "<eos>"});
        let files = BTreeMap::from([(
            "tokenizer_config.json".to_owned(),
            serde_json::to_vec(&config).unwrap(),
        )]);
        let facts = ModelFacts {
            bos_token_id: None,
            eos_token_ids: vec![eos],
            vocab_size: tokenizer.vocab_size() as i64,
            tie_word_embeddings: true,
        };
        ModelText::from_parts("hermes-test".into(), tokenizer, facts, &files).unwrap()
    }

    fn reply(text: &ModelText, s: &str) -> Reply {
        let mut tokens = text.tokenizer().encode(s, false).unwrap();
        tokens.push(text.eos_token_ids()[0]);
        Reply {
            logprobs: vec![-0.5; tokens.len()],
            versions: vec![1; tokens.len()],
            tokens,
            end: ReplyEnd::Stop,
        }
    }

    fn limits() -> EpisodeLimits {
        EpisodeLimits {
            max_turns: 4,
            max_turn_tokens: 32,
            max_episode_tokens: 200,
        }
    }

    #[test]
    fn a_tool_call_goes_to_the_environment_parsed_and_its_reply_is_appended_as_context() {
        let text = hermes_text();
        let eos = text.eos_token_ids().to_vec();
        let mut ep = Episode::start(
            &text,
            vec![Message::new("user", "2+x=")],
            &StepResult::default(),
            limits(),
            eos,
        )
        .unwrap();
        assert!(matches!(ep.next_action().unwrap(), Next::Generate { .. }));
        let call =
            "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"name\": \"x\"}}\n</tool_call>";
        let Next::Step { step, action } = ep.on_reply(reply(&text, call)).unwrap() else {
            panic!("a step")
        };
        assert_eq!(step, 1);
        assert_eq!(action.tool_calls.len(), 1);
        assert_eq!(action.tool_calls[0].name, "lookup");
        let answer = StepResult {
            observation: Observation {
                messages: vec![EnvMessage::new("tool", "x=5")],
                tools: Vec::new(),
            },
            reward: None,
            done: false,
        };
        let Next::Generate { prompt, .. } = ep.on_step(&answer).unwrap() else {
            panic!("the next reply")
        };
        let rendered = text.tokenizer().decode(&prompt, false).unwrap();
        assert!(
            rendered.ends_with("</tool_call><eos><tool_response>x=5;"),
            "{rendered}"
        );
        ep.on_reply(reply(&text, "7")).unwrap();
        let done = StepResult {
            reward: Some(1.0),
            done: true,
            ..StepResult::default()
        };
        assert_eq!(ep.on_step(&done).unwrap(), Next::Done);
        let out = ep.output().unwrap();
        assert_eq!(out.finish, FinishReason::Stop);
        assert_eq!(out.reward, 1.0);
        assert_eq!(out.turns.len(), 2);
        assert_eq!(
            out.turns[1].context_tokens as usize,
            "<tool_response>x=5;".len()
        );
        assert_eq!(
            out.logprobs.len(),
            out.turns
                .iter()
                .map(|t| t.model_tokens as usize)
                .sum::<usize>()
        );
    }

    #[test]
    fn an_unreadable_tool_call_and_the_limits_end_the_episode_with_their_finish_reason() {
        let text = hermes_text();
        let eos = text.eos_token_ids().to_vec();
        let start = |limits| {
            Episode::start(
                &text,
                vec![Message::new("user", "2+x=")],
                &StepResult::default(),
                limits,
                eos.clone(),
            )
            .unwrap()
        };
        let mut ep = start(limits());
        ep.next_action().unwrap();
        let bad = "<tool_call>\n{\"name\": \"lookup\", \"arguments\": [1]}\n</tool_call>";
        assert_eq!(ep.on_reply(reply(&text, bad)).unwrap(), Next::Done);
        let out = ep.output().unwrap();
        assert_eq!(out.finish, FinishReason::ToolCallUnreadable);
        assert!(out.note.unwrap().contains("reply 1"));

        // One turn at most: the environment's reply is never appended.
        let mut ep = start(EpisodeLimits {
            max_turns: 1,
            ..limits()
        });
        ep.next_action().unwrap();
        ep.on_reply(reply(&text, "hi")).unwrap();
        let more = StepResult {
            observation: Observation {
                messages: vec![EnvMessage::new("user", "again")],
                tools: Vec::new(),
            },
            ..StepResult::default()
        };
        assert_eq!(ep.on_step(&more).unwrap(), Next::Done);
        let out = ep.output().unwrap();
        assert_eq!(out.finish, FinishReason::MaxTurns);
        assert_eq!(
            out.completion.len(),
            3,
            "the context tokens after the last reply are dropped"
        );

        // The episode's token budget.
        let mut ep = start(EpisodeLimits {
            max_episode_tokens: 8,
            ..limits()
        });
        let Next::Generate { max_new_tokens, .. } = ep.next_action().unwrap() else {
            panic!()
        };
        assert_eq!(max_new_tokens, 4, "8 tokens less the 4 of the prompt");
        ep.on_reply(reply(&text, "abc")).unwrap();
        assert_eq!(ep.on_step(&more).unwrap(), Next::Done);
        assert_eq!(ep.output().unwrap().finish, FinishReason::EpisodeLength);

        // An environment may not speak for the assistant.
        let mut ep = start(limits());
        ep.next_action().unwrap();
        ep.on_reply(reply(&text, "hi")).unwrap();
        let forged = StepResult {
            observation: Observation {
                messages: vec![EnvMessage::new("assistant", "42")],
                tools: Vec::new(),
            },
            ..StepResult::default()
        };
        let err = ep.on_step(&forged).unwrap_err().to_string();
        assert!(err.contains("role \"assistant\""), "{err}");
    }
}
