//! The model on its own OS thread, driven through channels.
//!
//! `tch::Tensor` is `Send` but not `Sync`, and a forward pass blocks for
//! milliseconds to seconds; so the [`Policy`] lives on one dedicated thread
//! and async code talks to it through a [`ModelHandle`] (commands over a
//! channel, replies over tokio oneshot channels). The thread runs a
//! [`DecodeBatch`] continuously: [`ModelHandle::generate`] submits one
//! sequence, which joins the batch as soon as a slot is free and is answered
//! when it finishes (continuous batching). Other commands (weight swaps,
//! log-prob computations, saving, arbitrary closures) are served between two
//! decoding steps; after a weight swap, the sequences in flight continue
//! with their KV cache recomputed under the new weights, and their later
//! tokens carry the new version.
//!
//! Dropping the future of a `generate` call cancels that sequence (its slot
//! is freed before the next step).

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::config::ModelConfig;
use crate::decode::{DecodeBatch, DecodeBatchOptions, SeqId, SequenceOutput, SequenceRequest};
use crate::error::{PolicyError, Result};
use crate::model::Policy;
use crate::sampling::sequence_logprobs;
use crate::tokenizer::PolicyTokenizer;
use crate::weights::WeightDtype;

/// Settings of the model thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineOptions {
    /// Size of the continuous batch.
    pub batch: DecodeBatchOptions,
    /// [`DecodeBatch::share_prompts`] (on by default).
    pub share_prompts: bool,
    /// Name of the OS thread.
    pub thread_name: String,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            batch: DecodeBatchOptions::default(),
            share_prompts: true,
            thread_name: "asyncrl-policy".into(),
        }
    }
}

/// Counters of the model thread (shared, lock-free).
#[derive(Debug, Default)]
struct Stats {
    in_flight: AtomicUsize,
    queued: AtomicUsize,
    tokens_generated: AtomicU64,
    steps: AtomicU64,
    sequences_finished: AtomicU64,
    weight_swaps: AtomicU64,
    recomputed_sequences: AtomicU64,
    positions_shared: AtomicU64,
    version: AtomicI32,
}

/// A snapshot of the model thread's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct EngineStats {
    /// Sequences in the decode batch.
    pub in_flight: usize,
    /// Sequences waiting for a free slot.
    pub queued: usize,
    /// Tokens sampled since start.
    pub tokens_generated: u64,
    /// Decoding steps since start.
    pub steps: u64,
    pub sequences_finished: u64,
    /// Weight swaps ([`ModelHandle::load_weights`]) since start.
    pub weight_swaps: u64,
    /// In-flight sequences whose KV cache was recomputed after a swap.
    pub recomputed_sequences: u64,
    /// Prompt positions taken from another sequence's KV cache instead of
    /// computed (prompt sharing).
    pub positions_shared: u64,
    /// The policy version of the weights in use.
    pub version: i32,
}

type Job = Box<dyn FnOnce(&mut Policy) + Send>;

enum Command {
    Generate {
        request: SequenceRequest,
        reply: oneshot::Sender<Result<SequenceOutput>>,
    },
    Logprobs {
        sequences: Vec<Vec<i64>>,
        temperature: f64,
        reply: oneshot::Sender<Result<Vec<Vec<f32>>>>,
    },
    LoadWeights {
        bytes: Bytes,
        version: i32,
        reply: oneshot::Sender<Result<()>>,
    },
    WeightsBytes {
        dtype: WeightDtype,
        reply: oneshot::Sender<Result<Vec<u8>>>,
    },
    Save {
        dir: PathBuf,
        max_shard_bytes: Option<usize>,
        reply: oneshot::Sender<Result<()>>,
    },
    Run(Job),
}

/// A cheap, clonable handle to the model thread. The thread ends when every
/// handle is dropped and the sequences in flight have finished.
#[derive(Clone)]
pub struct ModelHandle {
    tx: mpsc::UnboundedSender<Command>,
    stats: Arc<Stats>,
    config: Arc<ModelConfig>,
    tokenizer: Option<Arc<PolicyTokenizer>>,
    eos_token_ids: Arc<Vec<i64>>,
    batch: DecodeBatchOptions,
}

impl std::fmt::Debug for ModelHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelHandle")
            .field("stats", &self.stats())
            .finish()
    }
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// Runs `f`, turning a panic (tch panics on some libtorch errors) into an
/// error so that the model thread keeps serving.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => Err(PolicyError::Panic(panic_message(p))),
    }
}

impl ModelHandle {
    /// Starts the model thread, builds the policy on it with `load` (so that
    /// the CUDA context belongs to that thread), and returns once it is
    /// ready (or with the error `load` returned).
    pub async fn spawn<F>(opts: EngineOptions, load: F) -> Result<Self>
    where
        F: FnOnce() -> Result<Policy> + Send + 'static,
    {
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let stats = Arc::new(Stats::default());
        let thread_stats = stats.clone();
        let batch_opts = opts.batch;
        let share_prompts = opts.share_prompts;
        std::thread::Builder::new()
            .name(opts.thread_name.clone())
            .spawn(move || {
                let policy = guarded(load).and_then(|p| {
                    let mut batch = DecodeBatch::new(&p, batch_opts)?;
                    batch.share_prompts(share_prompts);
                    Ok((p, batch))
                });
                let (policy, batch) = match policy {
                    Ok(x) => x,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let info = (
                    policy.config().clone(),
                    policy.tokenizer().cloned(),
                    policy.eos_token_ids(),
                );
                thread_stats
                    .version
                    .store(policy.version(), Ordering::Relaxed);
                if ready_tx.send(Ok(info)).is_err() {
                    return;
                }
                Engine {
                    policy,
                    batch,
                    rx,
                    stats: thread_stats,
                    queue: VecDeque::new(),
                    waiting: HashMap::new(),
                }
                .run();
            })
            .map_err(|e| PolicyError::io("(model thread)", e))?;
        let (config, tokenizer, eos) =
            ready_rx.await.map_err(|_| PolicyError::ModelThreadGone)??;
        Ok(Self {
            tx,
            stats,
            config: Arc::new(config),
            tokenizer: tokenizer.map(Arc::new),
            eos_token_ids: Arc::new(eos),
            batch: batch_opts,
        })
    }

    fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).map_err(|_| PolicyError::ModelThreadGone)
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<Result<T>>) -> Command) -> Result<T> {
        let (tx, rx) = oneshot::channel();
        self.send(make(tx))?;
        rx.await.map_err(|_| PolicyError::ModelThreadGone)?
    }

    /// The model's architecture.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer (usable on any thread).
    pub fn tokenizer(&self) -> Option<&PolicyTokenizer> {
        self.tokenizer.as_deref()
    }

    /// The model's default stop tokens ([`Policy::eos_token_ids`]).
    pub fn eos_token_ids(&self) -> &[i64] {
        &self.eos_token_ids
    }

    /// The size of the continuous batch.
    pub fn batch_options(&self) -> DecodeBatchOptions {
        self.batch
    }

    /// The counters of the model thread.
    pub fn stats(&self) -> EngineStats {
        let s = &self.stats;
        EngineStats {
            in_flight: s.in_flight.load(Ordering::Relaxed),
            queued: s.queued.load(Ordering::Relaxed),
            tokens_generated: s.tokens_generated.load(Ordering::Relaxed),
            steps: s.steps.load(Ordering::Relaxed),
            sequences_finished: s.sequences_finished.load(Ordering::Relaxed),
            weight_swaps: s.weight_swaps.load(Ordering::Relaxed),
            recomputed_sequences: s.recomputed_sequences.load(Ordering::Relaxed),
            positions_shared: s.positions_shared.load(Ordering::Relaxed),
            version: s.version.load(Ordering::Relaxed),
        }
    }

    /// The policy version of the weights in use.
    pub fn version(&self) -> i32 {
        self.stats.version.load(Ordering::Relaxed)
    }

    /// Generates one sequence with continuous batching; resolves when it
    /// finishes. Dropping the future cancels the sequence.
    pub async fn generate(&self, request: SequenceRequest) -> Result<SequenceOutput> {
        request.params.validate()?;
        if request.prompt.is_empty() || request.prompt.len() >= self.batch.max_seq_len {
            return Err(PolicyError::InvalidRequest(format!(
                "the prompt must have 1..{} tokens, got {}",
                self.batch.max_seq_len,
                request.prompt.len()
            )));
        }
        self.ask(|reply| Command::Generate { request, reply }).await
    }

    /// Generates several sequences (all submitted at once, continuous
    /// batching); outputs in request order.
    pub async fn generate_many(
        &self,
        requests: Vec<SequenceRequest>,
    ) -> Result<Vec<SequenceOutput>> {
        let mut receivers = Vec::with_capacity(requests.len());
        for request in requests {
            request.params.validate()?;
            let (tx, rx) = oneshot::channel();
            self.send(Command::Generate { request, reply: tx })?;
            receivers.push(rx);
        }
        let mut out = Vec::with_capacity(receivers.len());
        for rx in receivers {
            out.push(rx.await.map_err(|_| PolicyError::ModelThreadGone)??);
        }
        Ok(out)
    }

    /// [`sequence_logprobs`] on the model thread: for each sequence, the
    /// log-probs of its tokens 1.. under the current weights.
    pub async fn token_logprobs(
        &self,
        sequences: Vec<Vec<i64>>,
        temperature: f64,
    ) -> Result<Vec<Vec<f32>>> {
        self.ask(|reply| Command::Logprobs {
            sequences,
            temperature,
            reply,
        })
        .await
    }

    /// Swaps in new weights (safetensors bytes, see
    /// [`Policy::load_weights_from_bytes`]) at the next decoding-step
    /// boundary; resolves once they are in use. On error the old weights
    /// stay.
    pub async fn load_weights(&self, bytes: Bytes, version: i32) -> Result<()> {
        self.ask(|reply| Command::LoadWeights {
            bytes,
            version,
            reply,
        })
        .await
    }

    /// The current weights as safetensors bytes.
    pub async fn weights_bytes(&self, dtype: WeightDtype) -> Result<Vec<u8>> {
        self.ask(|reply| Command::WeightsBytes { dtype, reply })
            .await
    }

    /// Saves the model as a Hugging Face folder ([`Policy::save_pretrained`]).
    pub async fn save_pretrained(
        &self,
        dir: PathBuf,
        max_shard_bytes: Option<usize>,
    ) -> Result<()> {
        self.ask(|reply| Command::Save {
            dir,
            max_shard_bytes,
            reply,
        })
        .await
    }

    /// Runs `f` on the model thread between two decoding steps (a training
    /// step, an evaluation...). If `f` changes the weights in place it must
    /// call [`Policy::mark_weights_changed`] (and [`Policy::set_version`]),
    /// so that sequences in flight get their KV cache recomputed.
    pub async fn with_policy<R, F>(&self, f: F) -> Result<R>
    where
        R: Send + 'static,
        F: FnOnce(&mut Policy) -> R + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Run(Box::new(move |p: &mut Policy| {
            let _ = tx.send(f(p));
        })))?;
        rx.await.map_err(|_| PolicyError::ModelThreadGone)
    }
}

struct Engine {
    policy: Policy,
    batch: DecodeBatch,
    rx: mpsc::UnboundedReceiver<Command>,
    stats: Arc<Stats>,
    queue: VecDeque<(SequenceRequest, oneshot::Sender<Result<SequenceOutput>>)>,
    waiting: HashMap<SeqId, oneshot::Sender<Result<SequenceOutput>>>,
}

impl Engine {
    fn run(mut self) {
        let mut open = true;
        loop {
            let idle = self.batch.is_empty() && self.queue.is_empty();
            if idle {
                if !open {
                    break;
                }
                match self.rx.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => break,
                }
            }
            while open {
                match self.rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => open = false,
                }
            }
            self.drop_cancelled();
            self.admit();
            if !self.batch.is_empty() {
                self.step();
            }
            self.publish_counts();
        }
    }

    fn publish_counts(&self) {
        self.stats
            .in_flight
            .store(self.batch.len(), Ordering::Relaxed);
        self.stats.queued.store(self.queue.len(), Ordering::Relaxed);
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Generate { request, reply } => self.queue.push_back((request, reply)),
            Command::Logprobs {
                sequences,
                temperature,
                reply,
            } => {
                let r = guarded(|| sequence_logprobs(&self.policy, &sequences, temperature));
                let _ = reply.send(r);
            }
            Command::LoadWeights {
                bytes,
                version,
                reply,
            } => {
                let r = guarded(|| self.policy.load_weights_from_bytes(&bytes, version));
                if r.is_ok() {
                    self.stats.weight_swaps.fetch_add(1, Ordering::Relaxed);
                    self.stats.version.store(version, Ordering::Relaxed);
                }
                let _ = reply.send(r);
            }
            Command::WeightsBytes { dtype, reply } => {
                let _ = reply.send(guarded(|| self.policy.weights_to_safetensors(dtype)));
            }
            Command::Save {
                dir,
                max_shard_bytes,
                reply,
            } => {
                let _ = reply.send(guarded(|| {
                    self.policy.save_pretrained(&dir, max_shard_bytes)
                }));
            }
            Command::Run(job) => {
                let policy = &mut self.policy;
                if let Err(p) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(policy)))
                {
                    tracing::error!(panic = %panic_message(p), "a job on the model thread panicked");
                }
                self.stats
                    .version
                    .store(self.policy.version(), Ordering::Relaxed);
            }
        }
    }

    /// Frees the slots of sequences whose caller went away.
    fn drop_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .waiting
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.waiting.remove(&id);
            self.batch.remove(id);
        }
        self.queue.retain(|(_, tx)| !tx.is_closed());
    }

    fn admit(&mut self) {
        while self.batch.free_slots() > 0 {
            let Some((request, reply)) = self.queue.pop_front() else {
                break;
            };
            match self.batch.add(request) {
                Ok(id) => {
                    self.waiting.insert(id, reply);
                }
                Err(e) => {
                    let _ = reply.send(Err(e));
                }
            }
        }
    }

    fn step(&mut self) {
        let (batch, policy) = (&mut self.batch, &self.policy);
        match guarded(|| batch.step(policy)) {
            Ok(out) => {
                self.stats.steps.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .tokens_generated
                    .fetch_add(out.sampled.len() as u64, Ordering::Relaxed);
                self.stats
                    .recomputed_sequences
                    .fetch_add(out.recomputed as u64, Ordering::Relaxed);
                self.stats
                    .positions_shared
                    .fetch_add(out.positions_shared as u64, Ordering::Relaxed);
                for o in out.finished {
                    self.stats
                        .sequences_finished
                        .fetch_add(1, Ordering::Relaxed);
                    if let Some(tx) = self.waiting.remove(&o.id) {
                        let _ = tx.send(Ok(o));
                    }
                }
            }
            Err(e) => {
                // Fail every sequence in flight rather than retrying forever.
                let message = e.to_string();
                tracing::error!(error = %message, "decoding step failed");
                for id in self.batch.ids() {
                    self.batch.remove(id);
                    if let Some(tx) = self.waiting.remove(&id) {
                        let _ = tx.send(Err(PolicyError::StepFailed(message.clone())));
                    }
                }
            }
        }
    }
}
