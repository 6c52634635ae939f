//! `[learner]`: the optimiser, the objective's static settings and
//! checkpoints. The live knobs (ε, clip mode, learning rate, ...) start from
//! `[coordinator.initial_knobs]` and change through the admin API.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ProximalName {
    /// One extra forward pass with the weights before the step.
    Recompute,
    /// A-3PO interpolation from each token's version lag (no extra pass).
    #[default]
    Approx,
    /// No decoupling (naive PPO): the behaviour log-probs are the proximal
    /// ones. For comparisons: stale tokens are clipped against the policy
    /// that sampled them, not the current one.
    Behaviour,
}

impl ProximalName {
    pub fn as_str(self) -> &'static str {
        match self {
            ProximalName::Recompute => "recompute",
            ProximalName::Approx => "approx",
            ProximalName::Behaviour => "behaviour",
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageNormName {
    /// reward − group mean.
    Mean,
    /// (reward − group mean) / group std.
    #[default]
    MeanStd,
    /// RLOO: reward − the mean of the group's other rewards (Ahmadian et
    /// al. 2024, arXiv:2402.14740).
    #[serde(alias = "rloo")]
    LeaveOneOut,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LossAggregationName {
    /// Mean over the batch's tokens.
    #[default]
    Token,
    /// Mean over sequences of each sequence's token mean.
    Sequence,
}

/// How the learner estimates the KL divergence to the reference policy,
/// per token, from the current log-prob `c` and the reference's `r`
/// (Schulman, "Approximating KL divergence", 2020).
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimatorName {
    /// `c − r`: unbiased, high variance, can be negative.
    K1,
    /// `exp(r − c) − (r − c) − 1`: unbiased, low variance, never negative
    /// (the estimator of GRPO's KL loss).
    #[default]
    K3,
}

impl KlEstimatorName {
    pub fn as_str(self) -> &'static str {
        match self {
            KlEstimatorName::K1 => "k1",
            KlEstimatorName::K3 => "k3",
        }
    }
}

/// Which engine computes the learner's step (docs/ARCHITECTURE.md, "Trainer
/// engines").
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum TrainerEngineName {
    /// The libtorch trainer in this process (tch): the built-in Llama and
    /// Qwen2 architectures on one device.
    #[default]
    Builtin,
    /// A PyTorch process group started with torchrun (`trainer/`): any
    /// Hugging Face causal LM, sharded with FSDP2 over
    /// `learner.torch.world_size` processes.
    Torch,
}

impl TrainerEngineName {
    pub fn as_str(self) -> &'static str {
        match self {
            TrainerEngineName::Builtin => "builtin",
            TrainerEngineName::Torch => "torch",
        }
    }
}

/// How the learner hands each version's weights to the workers.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum WeightTransportName {
    /// The NATS object store `WEIGHTS` (one safetensors object a version).
    #[default]
    ObjectStore,
    /// A Hugging Face folder per version under `learner.shared_weights_dir`,
    /// storage every worker mounts at the same path; only the announcement
    /// goes over the bus.
    SharedPath,
}

/// Mixed precision of the `torch` engine's FSDP2 shards.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum MixedPrecisionName {
    /// bf16 on CUDA, none (fp32) on the CPU.
    #[default]
    Auto,
    /// fp32 compute and weights.
    None,
    /// bf16 parameters in forward and backward, fp32 gradient reduction and
    /// master weights.
    Bf16,
}

/// `[learner.torch]`: the `torch` trainer engine's process group.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TorchEngineConfig {
    /// Processes (one per GPU) that shard the model, on all nodes together;
    /// it must divide the rows of every mini-batch.
    pub world_size: usize,
    /// Nodes (machines, pods) the group spans; `world_size / nodes` ranks
    /// each. The learner runs node 0; every other node runs
    /// `asyncrl trainer-node --node-rank N` with the same config.
    pub nodes: usize,
    /// `host:port` where node 0's torchrun serves the static rendezvous
    /// (the learner's address as the other nodes reach it); needed when
    /// `nodes` > 1.
    pub rendezvous: Option<String>,
    /// The Python interpreter with torch, transformers and `asyncrl-trainer`
    /// (scripts/setup installs them into .venv and puts it first on PATH).
    pub python: PathBuf,
    pub mixed_precision: MixedPrecisionName,
    /// Recompute each decoder layer's activations in the backward pass.
    pub activation_checkpointing: bool,
    /// Keep parameters, gradients and optimizer state in host memory.
    pub cpu_offload: bool,
    /// How long the group may take to load the model and serve.
    #[serde(with = "humantime_serde")]
    pub start_timeout: Duration,
}

impl Default for TorchEngineConfig {
    fn default() -> Self {
        Self {
            world_size: 1,
            nodes: 1,
            rendezvous: None,
            python: PathBuf::from("python3"),
            mixed_precision: MixedPrecisionName::Auto,
            activation_checkpointing: false,
            cpu_offload: false,
            start_timeout: Duration::from_secs(600),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LearnerConfig {
    /// The engine that computes the step: `builtin` or `torch`.
    pub trainer: TrainerEngineName,
    /// The `torch` engine's settings (read when `trainer = "torch"`).
    pub torch: TorchEngineConfig,
    /// `object_store` or `shared_path`.
    pub weight_transport: WeightTransportName,
    /// The shared folder of `weight_transport = "shared_path"` (the same
    /// path on the learner and every worker).
    pub shared_weights_dir: Option<PathBuf>,
    pub proximal: ProximalName,
    pub advantage_norm: AdvantageNormName,
    pub loss_aggregation: LossAggregationName,
    /// m2po: mean (b − p)² the unmasked tokens must stay under.
    pub m2po_threshold: f64,
    /// Weight β of the KL loss against the reference policy (the weights
    /// the run started from, frozen): the loss gains β times the
    /// aggregated per-token estimate. 0: no KL loss and no reference model
    /// (which costs a copy of the weights, sharded like the model in the
    /// torch engine, and one no-grad forward pass per step).
    pub kl_coef: f64,
    pub kl_estimator: KlEstimatorName,
    /// Optimizer steps per batch (the batch is split into this many mini-batches).
    pub minibatches: usize,
    /// Padded positions (rows × the longest prompt + completion among them)
    /// of one forward pass at most: each mini-batch, and the recompute pass,
    /// run micro-batch by micro-batch under this budget with gradient
    /// accumulation, one optimizer step per mini-batch as without it. A row
    /// longer than the budget is a micro-batch of its own. 0: no split.
    pub max_tokens_per_microbatch: usize,
    /// Sequence packing: each forward pass packs several rows into each
    /// lane (as wide as its longest row), positions restarting and
    /// attention kept inside each row, instead of padding every row to the
    /// longest. The log-probs, losses and gradients are the padded ones up
    /// to float rounding; only the positions computed shrink. With it,
    /// `max_tokens_per_microbatch` counts lanes × lane width.
    pub packing: bool,
    /// Prefix sharing (with `packing`, in the built-in trainer): the rows
    /// of a group (completions of one prompt) lay the tokens they all
    /// start with out once, each row's own tokens after them attending to
    /// them, instead of every row recomputing its prompt. The log-probs,
    /// losses and gradients are the unshared ones up to float rounding.
    /// A trainer engine packs without it.
    pub share_prefixes: bool,
    /// Rows whose every token has advantage 0 (a group whose completions
    /// all scored alike) take a forward pass without gradient instead of
    /// forward + backward, in the built-in trainer, when `kl_coef` is 0:
    /// their gradient is exactly zero, so the step's loss, statistics and
    /// gradient are the same up to float rounding. A trainer engine
    /// trains them as any row.
    pub forward_only_zero_advantage: bool,
    /// The narrowest lane of a packed forward pass: lanes are as wide as
    /// the longest row or this many positions if that is more, so that
    /// short rows share a lane (attention within a lane costs its width
    /// squared, so wider is not free). 0: the longest row.
    pub packing_lane_tokens: usize,
    /// Linear learning-rate warmup over this many steps.
    pub warmup_steps: u64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub adam_eps: f64,
    /// Clip the global gradient norm to this (0: no clipping).
    pub grad_clip: f64,
    /// Checkpoint directory (default: `<run.output_dir>/checkpoints`).
    pub checkpoint_dir: Option<PathBuf>,
    /// Write a checkpoint every N steps (and on SIGTERM).
    pub checkpoint_every: u64,
    /// Complete checkpoints kept on disk.
    pub keep_checkpoints: usize,
    /// Weight versions kept in the object store (older ones are deleted).
    pub keep_weight_versions: usize,
    /// How long to wait between batch requests when the buffer has too few groups.
    #[serde(with = "humantime_serde")]
    pub batch_poll_interval: Duration,
    /// How long the run's learner lease lasts without a renewal (renewed
    /// every quarter of it). A second learner waits twice this long for a
    /// live lease and then refuses to start; a restarted one waits at most
    /// this long for its crashed predecessor's lease to lapse.
    #[serde(with = "humantime_serde")]
    pub lease_ttl: Duration,
    /// Pin the trainer thread (and the libtorch threads it starts) to these
    /// CPU cores (empty: no pinning). `asyncrl-bench speedup` uses it to give
    /// the learner and the worker a core each.
    pub cpu_affinity: Vec<usize>,
}

impl Default for LearnerConfig {
    fn default() -> Self {
        Self {
            trainer: TrainerEngineName::Builtin,
            torch: TorchEngineConfig::default(),
            weight_transport: WeightTransportName::ObjectStore,
            shared_weights_dir: None,
            proximal: ProximalName::Approx,
            advantage_norm: AdvantageNormName::MeanStd,
            loss_aggregation: LossAggregationName::Token,
            m2po_threshold: 0.04,
            kl_coef: 0.0,
            kl_estimator: KlEstimatorName::K3,
            minibatches: 1,
            max_tokens_per_microbatch: 0,
            packing: true,
            share_prefixes: true,
            forward_only_zero_advantage: true,
            packing_lane_tokens: 0,
            warmup_steps: 0,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            adam_eps: 1e-8,
            grad_clip: 1.0,
            checkpoint_dir: None,
            checkpoint_every: 10,
            keep_checkpoints: 2,
            keep_weight_versions: 8,
            batch_poll_interval: Duration::from_millis(50),
            lease_ttl: Duration::from_secs(10),
            cpu_affinity: Vec::new(),
        }
    }
}

/// The largest `learner.max_tokens_per_microbatch` (2³² − 1): far above
/// what any accelerator holds.
const MAX_TOKENS_PER_MICROBATCH: usize = u32::MAX as usize;

impl LearnerConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        check_range("learner.m2po_threshold", self.m2po_threshold, 0.0, 100.0)?;
        check_range("learner.kl_coef", self.kl_coef, 0.0, 100.0)?;
        check_range("learner.minibatches", self.minibatches, 1, 1024)?;
        check_range(
            "learner.max_tokens_per_microbatch",
            self.max_tokens_per_microbatch,
            0,
            MAX_TOKENS_PER_MICROBATCH,
        )?;
        check_range(
            "learner.packing_lane_tokens",
            self.packing_lane_tokens,
            0,
            MAX_TOKENS_PER_MICROBATCH,
        )?;
        check_range("learner.weight_decay", self.weight_decay, 0.0, 1.0)?;
        check_range("learner.beta1", self.beta1, 0.0, 0.999_999)?;
        check_range("learner.beta2", self.beta2, 0.0, 0.999_999_9)?;
        check_range("learner.adam_eps", self.adam_eps, 1e-20, 1.0)?;
        check_range("learner.grad_clip", self.grad_clip, 0.0, 1e6)?;
        check_range(
            "learner.checkpoint_every",
            self.checkpoint_every,
            1,
            u64::MAX,
        )?;
        check_range("learner.keep_checkpoints", self.keep_checkpoints, 1, 1000)?;
        check_range(
            "learner.keep_weight_versions",
            self.keep_weight_versions,
            1,
            1000,
        )?;
        crate::check_cores("learner.cpu_affinity", &self.cpu_affinity)?;
        check_range("learner.torch.world_size", self.torch.world_size, 1, 4096)?;
        check_range("learner.torch.nodes", self.torch.nodes, 1, 512)?;
        if !self.torch.world_size.is_multiple_of(self.torch.nodes) {
            return Err(ConfigError::invalid(
                "learner.torch.nodes",
                format!(
                    "{} nodes cannot hold world_size {} ranks evenly",
                    self.torch.nodes, self.torch.world_size
                ),
            ));
        }
        match (&self.torch.rendezvous, self.torch.nodes) {
            (None, n) if n > 1 => {
                return Err(ConfigError::invalid(
                    "learner.torch.rendezvous",
                    format!("{n} nodes need the host:port of node 0's rendezvous"),
                ));
            }
            (Some(r), _) => {
                let port = r.rsplit_once(':').and_then(|(h, p)| {
                    (!h.is_empty()).then_some(())?;
                    p.parse::<u16>().ok().filter(|p| *p > 0)
                });
                if port.is_none() {
                    return Err(ConfigError::invalid(
                        "learner.torch.rendezvous",
                        format!("{r:?} is not host:port"),
                    ));
                }
            }
            _ => {}
        }
        if self.torch.python.as_os_str().is_empty() {
            return Err(ConfigError::invalid(
                "learner.torch.python",
                "must name a Python interpreter",
            ));
        }
        if self.weight_transport == WeightTransportName::SharedPath
            && self.shared_weights_dir.is_none()
        {
            return Err(ConfigError::invalid(
                "learner.shared_weights_dir",
                "weight_transport = \"shared_path\" needs the shared folder",
            ));
        }
        if self.torch.start_timeout.is_zero() {
            return Err(ConfigError::invalid(
                "learner.torch.start_timeout",
                "must be longer than 0s",
            ));
        }
        if self.batch_poll_interval.is_zero() {
            return Err(ConfigError::invalid(
                "learner.batch_poll_interval",
                "must be longer than 0s",
            ));
        }
        if self.lease_ttl < Duration::from_millis(100) || self.lease_ttl > Duration::from_secs(3600)
        {
            return Err(ConfigError::invalid(
                "learner.lease_ttl",
                format!("= {:?} must be in [100ms, 1h]", self.lease_ttl),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::test_check::check;

    #[test]
    fn trainer_engine_table() {
        let cases: &[(&str, Option<&str>)] = &[
            ("", None),
            ("[learner]\ntrainer = \"builtin\"", None),
            (
                "[learner]\ntrainer = \"torch\"",
                Some("`model.path` the torch trainer engine"),
            ),
            (
                "[model]\npath = \"m\"\n[learner]\ntrainer = \"torch\"",
                None,
            ),
            (
                "[learner]\ntrainer = \"megatron\"",
                Some("`learner.trainer`"),
            ),
            // A KL loss, in either engine.
            ("[learner]\nkl_coef = 0.05\nkl_estimator = \"k1\"", None),
            (
                "[model]\npath = \"m\"\n[learner]\ntrainer = \"torch\"\nkl_coef = 0.05",
                None,
            ),
            (
                "[learner]\nkl_coef = -1",
                Some("`learner.kl_coef` = -1 is out of range"),
            ),
            (
                "[learner]\nkl_estimator = \"k2\"",
                Some("`learner.kl_estimator`"),
            ),
            // 8 groups × 8 rows = 64 rows share evenly over 1, 2, 4, 8 ranks.
            (
                "[model]\npath = \"m\"\n[learner]\ntrainer = \"torch\"\n[learner.torch]\nworld_size = 8",
                None,
            ),
            (
                "[model]\npath = \"m\"\n[learner]\ntrainer = \"torch\"\n[learner.torch]\nworld_size = 3",
                Some("`learner.torch.world_size` 3 ranks cannot share the batch evenly: 64 rows"),
            ),
            (
                "[model]\npath = \"m\"\n[learner]\ntrainer = \"torch\"\nminibatches = 16\n[learner.torch]\nworld_size = 8",
                Some("`learner.torch.world_size` 8 ranks cannot share the batch evenly"),
            ),
            // The builtin engine has no ranks to share with.
            ("[learner.torch]\nworld_size = 3", None),
            // Two nodes of four ranks, node 0's rendezvous named.
            (
                "[learner.torch]\nworld_size = 8\nnodes = 2\nrendezvous = \"learner-0.trainer:29500\"",
                None,
            ),
            (
                "[learner.torch]\nworld_size = 8\nnodes = 2",
                Some("`learner.torch.rendezvous` 2 nodes need the host:port"),
            ),
            (
                "[learner.torch]\nworld_size = 8\nnodes = 3\nrendezvous = \"h:1\"",
                Some("`learner.torch.nodes` 3 nodes cannot hold world_size 8 ranks evenly"),
            ),
            (
                "[learner.torch]\nworld_size = 2\nnodes = 2\nrendezvous = \"learner\"",
                Some("`learner.torch.rendezvous` \"learner\" is not host:port"),
            ),
            (
                "[learner.torch]\nworld_size = 2\nnodes = 2\nrendezvous = \"learner:0\"",
                Some("`learner.torch.rendezvous` \"learner:0\" is not host:port"),
            ),
            (
                "[learner.torch]\nworld_size = 0",
                Some("`learner.torch.world_size` = 0 is out of range"),
            ),
            ("[learner.torch]\nranks = 2", Some("`learner.torch.ranks`")),
            ("[learner]\nweight_transport = \"object_store\"", None),
            (
                "[learner]\nweight_transport = \"shared_path\"\nshared_weights_dir = \"/mnt/w\"",
                None,
            ),
            (
                "[learner]\nweight_transport = \"shared_path\"",
                Some("`learner.shared_weights_dir`"),
            ),
            (
                "[learner]\nweight_transport = \"nfs\"",
                Some("`learner.weight_transport`"),
            ),
            (
                "[learner.torch]\nmixed_precision = \"fp8\"",
                Some("`learner.torch.mixed_precision`"),
            ),
        ];
        for (text, want) in cases {
            check(text, *want);
        }
    }

    #[test]
    fn max_tokens_per_microbatch_table() {
        let cases: &[(&str, Option<&str>)] = &[
            // Unset and 0: no split.
            ("", None),
            ("[learner]\nmax_tokens_per_microbatch = 0", None),
            // Any budget, even below one row's length (rows then go alone).
            ("[learner]\nmax_tokens_per_microbatch = 1", None),
            ("[learner]\nmax_tokens_per_microbatch = 16384", None),
            ("[learner]\nmax_tokens_per_microbatch = 4294967295", None),
            (
                "[learner]\nmax_tokens_per_microbatch = 4294967296",
                Some(
                    "`learner.max_tokens_per_microbatch` = 4294967296 is out of range [0, 4294967295]",
                ),
            ),
            (
                "[learner]\nmax_tokens_per_microbatch = -1",
                Some("`learner.max_tokens_per_microbatch`"),
            ),
            (
                "[learner]\nmax_tokens_per_microbatch = 1.5",
                Some("`learner.max_tokens_per_microbatch`"),
            ),
            (
                "[learner]\nmax_tokens_per_microbatch = \"8k\"",
                Some("`learner.max_tokens_per_microbatch`"),
            ),
        ];
        for (text, want) in cases {
            check(text, *want);
        }
    }

    #[test]
    fn max_tokens_per_microbatch_defaults_to_no_split() {
        let config = crate::Config::parse("", None).unwrap();
        assert_eq!(config.learner.max_tokens_per_microbatch, 0);
        let config =
            crate::Config::parse("[learner]\nmax_tokens_per_microbatch = 8192", None).unwrap();
        assert_eq!(config.learner.max_tokens_per_microbatch, 8192);
    }
}
