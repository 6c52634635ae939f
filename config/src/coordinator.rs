//! `[coordinator]`: task data sets, leases, worker liveness, the admin API,
//! the knob journal, and the starting values of the live knobs (owned by the
//! coordinator's crate).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::{ConfigError, check_range};

#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CoordinatorConfig {
    /// The prompt data sets, issued in this order (JSONL files, one
    /// `{"prompt": ..., "answer": ...}` per line; an optional `"id"`).
    /// Relative paths are relative to the working directory.
    pub datasets: Vec<DatasetConfig>,
    /// A lease not extended by a heartbeat for this long expires and its task
    /// goes back to the front of the queue.
    #[serde(with = "humantime_serde")]
    pub lease_timeout: Duration,
    /// How often workers are told to send heartbeats.
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// A worker without a heartbeat for this long is marked dead and its
    /// leases expire at once.
    #[serde(with = "humantime_serde")]
    pub dead_after: Duration,
    /// When no task can be granted, workers are told to ask again after this.
    #[serde(with = "humantime_serde")]
    pub retry_after: Duration,
    /// At most this many tasks per acquire request.
    pub max_tasks_per_acquire: u32,
    /// Address of the admin gRPC API (`host:port`; port 0 picks a free one;
    /// empty disables it).
    pub admin_listen: String,
    /// Bearer token of the mutating admin calls (inline, or read from a file).
    /// Without one, every mutating call is refused.
    pub admin_token: Option<String>,
    pub admin_token_file: Option<PathBuf>,
    /// TLS of the admin API. Without it the API speaks plain HTTP/2.
    pub admin_tls: Option<AdminTlsConfig>,
    /// The JSONL journal of knob and control requests; default
    /// `<run.output_dir>/coordinator-journal.jsonl`.
    pub journal_path: Option<PathBuf>,
    /// How many recent completions the coordinator remembers (persisted):
    /// a completion retried after a coordinator restart is recognised, and a
    /// group the buffer drops as stale returns its capacity and is re-issued.
    /// Keep it above (η + 1) · B. An epoch closes (and the buffer forgets
    /// its trained tasks) once none of its completions is remembered.
    pub completed_memory: usize,
    /// Failed attempts after which a task is quarantined: never issued
    /// again (counted in `asyncrl_tasks_quarantined_total`, logged). A
    /// failed attempt is a task a worker returns as failed (its prompt
    /// cannot be rendered or fit, its episode's environment failed) or a
    /// group of it the learner refused. 0: never quarantine.
    pub max_task_attempts: u32,
    /// Upper bound of `asyncrl_rollout_workers_recommended`.
    pub max_recommended_workers: u32,
    /// The live knobs a new run starts with (η comes from `[staleness]`).
    /// Once a run has stored knobs, the stored ones win.
    pub initial_knobs: InitialKnobs,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        Self {
            datasets: Vec::new(),
            lease_timeout: Duration::from_secs(120),
            heartbeat_interval: Duration::from_secs(2),
            dead_after: Duration::from_secs(10),
            retry_after: Duration::from_millis(250),
            max_tasks_per_acquire: 64,
            admin_listen: "127.0.0.1:7461".into(),
            admin_token: None,
            admin_token_file: None,
            admin_tls: None,
            journal_path: None,
            completed_memory: 1024,
            max_task_attempts: 5,
            max_recommended_workers: 1024,
            initial_knobs: InitialKnobs::default(),
        }
    }
}

/// One prompt data set: a JSONL or Parquet file (a Hugging Face `datasets`
/// export loads as it is), with a mapping from its fields to the prompt, the
/// answer and the id.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DatasetConfig {
    /// Name of the data set; it prefixes the task ids, so only
    /// `[A-Za-z0-9_-]`. Also the verifier when `verifier` is not set.
    pub name: String,
    pub path: PathBuf,
    /// `jsonl`, `parquet`, or `auto` (by the file's extension: `.parquet`,
    /// else JSONL).
    #[serde(default)]
    pub format: DatasetFormat,
    /// The field (JSONL key, Parquet column) holding the prompt: a string,
    /// or a list of `{"role", "content"}` messages.
    #[serde(default = "default_prompt_field")]
    pub prompt_field: String,
    /// The field holding the reference answer (a string or a number).
    #[serde(default = "default_answer_field")]
    pub answer_field: String,
    /// The field holding the task id, used when a row has it; otherwise the
    /// id is `<name>-<row>` (row counted from 0).
    #[serde(default = "default_id_field")]
    pub id_field: String,
    /// Render text prompts with the model's chat template, as one user
    /// message (message prompts always are).
    #[serde(default)]
    pub apply_chat_template: bool,
    /// A system message put before every prompt that has none (needs
    /// `apply_chat_template` or message prompts).
    #[serde(default)]
    pub system_prompt: Option<String>,
    /// The built-in verifier that scores completions (`arith`, `reverse`,
    /// `math`), or `service` for the worker's reward service. Default: the
    /// data set's name when that is a built-in verifier, else `service`.
    #[serde(default)]
    pub verifier: Option<String>,
    /// Prompts longer than this many tokens (after the chat template) are
    /// handled as `long_prompts` says; unset: no limit at load time.
    #[serde(default)]
    pub max_prompt_tokens: Option<usize>,
    /// `error` (refuse to load the data set) or `skip` (count, log and leave
    /// out each long prompt). Never truncated.
    #[serde(default)]
    pub long_prompts: LongPrompts,
}

fn default_prompt_field() -> String {
    "prompt".into()
}
fn default_answer_field() -> String {
    "answer".into()
}
fn default_id_field() -> String {
    "id".into()
}

impl DatasetConfig {
    /// A JSONL data set with the default field names.
    pub fn jsonl(name: impl Into<String>, path: impl Into<PathBuf>) -> Self {
        Self {
            name: name.into(),
            path: path.into(),
            format: DatasetFormat::Auto,
            prompt_field: default_prompt_field(),
            answer_field: default_answer_field(),
            id_field: default_id_field(),
            apply_chat_template: false,
            system_prompt: None,
            verifier: None,
            max_prompt_tokens: None,
            long_prompts: LongPrompts::Error,
        }
    }

    /// Checks the entry; `prefix` is its key (`coordinator.datasets[0]`,
    /// `eval.dataset`) in errors.
    pub fn validate(&self, prefix: &str) -> Result<(), ConfigError> {
        let field = |f: &str| format!("{prefix}.{f}");
        if !valid_name(&self.name) {
            return Err(ConfigError::invalid(
                field("name"),
                format!(
                    "= {:?} must be 1-64 characters of [A-Za-z0-9_-] (it prefixes task ids)",
                    self.name
                ),
            ));
        }
        if self.path.as_os_str().is_empty() {
            return Err(ConfigError::invalid(field("path"), "is empty"));
        }
        for (f, v) in [
            ("prompt_field", &self.prompt_field),
            ("answer_field", &self.answer_field),
            ("id_field", &self.id_field),
        ] {
            if v.is_empty() {
                return Err(ConfigError::invalid(field(f), "is empty"));
            }
        }
        if self.prompt_field == self.answer_field {
            return Err(ConfigError::invalid(
                field("answer_field"),
                format!("= {:?} is also the prompt_field", self.answer_field),
            ));
        }
        if let Some(v) = &self.verifier
            && v != "service"
            && !BUILTIN_VERIFIERS.contains(&v.as_str())
        {
            return Err(ConfigError::invalid(
                field("verifier"),
                format!(
                    "= {v:?} is not a built-in verifier ({}) nor \"service\"",
                    BUILTIN_VERIFIERS.join(", ")
                ),
            ));
        }
        if self.max_prompt_tokens == Some(0) {
            return Err(ConfigError::invalid(
                field("max_prompt_tokens"),
                "must be at least 1 (leave it out for no limit)",
            ));
        }
        if self.system_prompt.as_deref() == Some("") {
            return Err(ConfigError::invalid(
                field("system_prompt"),
                "is empty (leave it out for none)",
            ));
        }
        Ok(())
    }

    /// The verifier that scores this data set's completions.
    pub fn verifier_name(&self) -> &str {
        match &self.verifier {
            Some(v) => v,
            None if BUILTIN_VERIFIERS.contains(&self.name.as_str()) => &self.name,
            None => "service",
        }
    }
}

/// The verifiers the rollout worker has built in.
pub const BUILTIN_VERIFIERS: [&str; 3] = ["arith", "reverse", "math"];

/// The file format of a data set.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DatasetFormat {
    #[default]
    Auto,
    Jsonl,
    Parquet,
}

/// What loading does with a prompt over `max_prompt_tokens`.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LongPrompts {
    #[default]
    Error,
    Skip,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AdminTlsConfig {
    /// Server certificate chain and key (PEM); both or neither.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// For `asyncrl ctl`: the CA that signed the server certificate (PEM).
    pub ca_file: Option<PathBuf>,
    /// For `asyncrl ctl`: the name the server certificate is checked against
    /// (default: the host of the endpoint).
    pub domain: Option<String>,
}

/// The clipping mode of the learner's objective.
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ClipModeName {
    /// PPO clipping of each token's ratio.
    Ppo,
    /// Staleness-adaptive clipping of each token's ratio.
    #[default]
    Adaptive,
    /// Second-moment masking, then PPO clipping (M2PO).
    M2po,
    /// GSPO: one length-normalised ratio per sequence, clipped as in PPO
    /// (Zheng et al. 2025, arXiv:2507.18071).
    Gspo,
}

impl ClipModeName {
    pub const ALL: [ClipModeName; 4] = [
        ClipModeName::Ppo,
        ClipModeName::Adaptive,
        ClipModeName::M2po,
        ClipModeName::Gspo,
    ];

    /// The name in configs, knob assignments, metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ClipModeName::Ppo => "ppo",
            ClipModeName::Adaptive => "adaptive",
            ClipModeName::M2po => "m2po",
            ClipModeName::Gspo => "gspo",
        }
    }
}

impl std::fmt::Display for ClipModeName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A clip mode name that is none of [`ClipModeName::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown clip mode `{0}` (known: ppo, adaptive, m2po, gspo)")]
pub struct UnknownClipMode(pub String);

impl std::str::FromStr for ClipModeName {
    type Err = UnknownClipMode;

    /// Case-insensitive.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ClipModeName::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownClipMode(s.to_owned()))
    }
}

/// How the learner corrects the off-policy importance weight
/// `w = π_prox / π_behav` of a token (of a sequence, under GSPO).
#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ImportanceCorrectionName {
    /// Decoupled PPO: a token whose weight exceeds the cap is masked.
    #[default]
    Mask,
    /// Truncated importance sampling (TIS): the weight is `min(w, cap)`.
    Truncate,
    /// Masked importance sampling (IcePop): a token whose weight is outside
    /// `[floor, cap]` is masked; the rest keep `w`.
    Icepop,
}

impl ImportanceCorrectionName {
    pub const ALL: [ImportanceCorrectionName; 3] = [
        ImportanceCorrectionName::Mask,
        ImportanceCorrectionName::Truncate,
        ImportanceCorrectionName::Icepop,
    ];

    /// The name in configs, knob assignments, metrics and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            ImportanceCorrectionName::Mask => "mask",
            ImportanceCorrectionName::Truncate => "truncate",
            ImportanceCorrectionName::Icepop => "icepop",
        }
    }
}

impl std::fmt::Display for ImportanceCorrectionName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An importance correction name that is none of
/// [`ImportanceCorrectionName::ALL`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown importance correction `{0}` (known: mask, truncate, icepop)")]
pub struct UnknownImportanceCorrection(pub String);

impl std::str::FromStr for ImportanceCorrectionName {
    type Err = UnknownImportanceCorrection;

    /// Case-insensitive; `tis` names `truncate`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("tis") {
            return Ok(ImportanceCorrectionName::Truncate);
        }
        ImportanceCorrectionName::ALL
            .into_iter()
            .find(|m| m.as_str().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownImportanceCorrection(s.to_owned()))
    }
}

/// Starting values of the live knobs.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct InitialKnobs {
    pub eps_low: f64,
    pub eps_high: f64,
    pub clip_mode: ClipModeName,
    pub adaptive_quantile: f64,
    pub adaptive_temperature: f64,
    pub importance_weight_cap: f64,
    pub importance_correction: ImportanceCorrectionName,
    /// IcePop's lower bound on the importance weight.
    pub importance_weight_floor: f64,
    /// Dual-clip PPO's bound on the ratio of a token with a negative
    /// advantage (0: off; otherwise at least 1).
    pub dual_clip: f64,
    pub learning_rate: f64,
    pub paused: bool,
}

impl Default for InitialKnobs {
    fn default() -> Self {
        Self {
            eps_low: 0.2,
            eps_high: 0.28,
            clip_mode: ClipModeName::Adaptive,
            adaptive_quantile: 0.9,
            adaptive_temperature: 0.1,
            importance_weight_cap: 5.0,
            importance_correction: ImportanceCorrectionName::Mask,
            importance_weight_floor: 0.5,
            dual_clip: 0.0,
            learning_rate: 1e-6,
            paused: false,
        }
    }
}

/// The allowed range of a numeric knob; the config and the live API check
/// the same ranges.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnobRange {
    /// The knob's name in the admin API and `asyncrl ctl set`.
    pub name: &'static str,
    pub lo: f64,
    pub hi: f64,
    /// A value outside `[lo, hi]` that turns the knob off (dual clip's 0).
    pub off: Option<f64>,
}

impl KnobRange {
    pub fn contains(&self, value: f64) -> bool {
        (value.is_finite() && value >= self.lo && value <= self.hi) || Some(value) == self.off
    }
}

impl std::fmt::Display for KnobRange {
    /// `[lo, hi]`, and `or <off> (off)` when the knob has an off value.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}, {}]", self.lo, self.hi)?;
        match self.off {
            Some(off) => write!(f, " or {off} (off)"),
            None => Ok(()),
        }
    }
}

/// Ranges of the live knobs.
pub mod knob_ranges {
    use super::KnobRange;

    pub const ETA: KnobRange = KnobRange {
        name: "eta",
        lo: 0.0,
        hi: crate::StalenessConfig::MAX_ETA as f64,
        off: None,
    };
    pub const EPS_LOW: KnobRange = KnobRange {
        name: "eps_low",
        lo: 0.0,
        hi: 0.99,
        off: None,
    };
    pub const EPS_HIGH: KnobRange = KnobRange {
        name: "eps_high",
        lo: 0.0,
        hi: 10.0,
        off: None,
    };
    pub const ADAPTIVE_QUANTILE: KnobRange = KnobRange {
        name: "adaptive_quantile",
        lo: 0.01,
        hi: 0.999,
        off: None,
    };
    pub const ADAPTIVE_TEMPERATURE: KnobRange = KnobRange {
        name: "adaptive_temperature",
        lo: 1e-4,
        hi: 100.0,
        off: None,
    };
    pub const IMPORTANCE_WEIGHT_CAP: KnobRange = KnobRange {
        name: "importance_weight_cap",
        lo: 1.0,
        hi: 1000.0,
        off: None,
    };
    pub const IMPORTANCE_WEIGHT_FLOOR: KnobRange = KnobRange {
        name: "importance_weight_floor",
        lo: 0.0,
        hi: 1.0,
        off: None,
    };
    pub const DUAL_CLIP: KnobRange = KnobRange {
        name: "dual_clip",
        lo: 1.0,
        hi: 1000.0,
        off: Some(0.0),
    };
    pub const LEARNING_RATE: KnobRange = KnobRange {
        name: "learning_rate",
        lo: 1e-9,
        hi: 1.0,
        off: None,
    };
}

fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl CoordinatorConfig {
    /// The admin listen address, or None when the admin API is disabled.
    pub fn admin_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        if self.admin_listen.is_empty() {
            return Ok(None);
        }
        self.admin_listen.parse().map(Some).map_err(|e| {
            ConfigError::invalid(
                "coordinator.admin_listen",
                format!("= {:?} is not host:port ({e})", self.admin_listen),
            )
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let mut names = std::collections::HashSet::new();
        for (i, d) in self.datasets.iter().enumerate() {
            let prefix = format!("coordinator.datasets[{i}]");
            d.validate(&prefix)?;
            if !names.insert(d.name.as_str()) {
                return Err(ConfigError::invalid(
                    format!("{prefix}.name"),
                    format!("= {:?} names two data sets", d.name),
                ));
            }
        }
        for (key, d) in [
            ("coordinator.lease_timeout", self.lease_timeout),
            ("coordinator.heartbeat_interval", self.heartbeat_interval),
            ("coordinator.dead_after", self.dead_after),
            ("coordinator.retry_after", self.retry_after),
        ] {
            if d.is_zero() {
                return Err(ConfigError::invalid(key, "must be longer than 0s"));
            }
        }
        if self.lease_timeout < self.heartbeat_interval * 2 {
            return Err(ConfigError::invalid(
                "coordinator.lease_timeout",
                format!(
                    "= {:?} must be at least twice coordinator.heartbeat_interval ({:?}), or a single late heartbeat expires every lease",
                    self.lease_timeout, self.heartbeat_interval
                ),
            ));
        }
        if self.dead_after < self.heartbeat_interval * 2 {
            return Err(ConfigError::invalid(
                "coordinator.dead_after",
                format!(
                    "= {:?} must be at least twice coordinator.heartbeat_interval ({:?})",
                    self.dead_after, self.heartbeat_interval
                ),
            ));
        }
        check_range(
            "coordinator.max_tasks_per_acquire",
            self.max_tasks_per_acquire,
            1,
            4096,
        )?;
        self.admin_addr()?;
        if self.admin_token.is_some() && self.admin_token_file.is_some() {
            return Err(ConfigError::invalid(
                "coordinator.admin_token_file",
                "cannot be set together with coordinator.admin_token",
            ));
        }
        if self
            .admin_token
            .as_deref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(ConfigError::invalid("coordinator.admin_token", "is empty"));
        }
        if let Some(tls) = &self.admin_tls
            && tls.cert_file.is_some() != tls.key_file.is_some()
        {
            let missing = if tls.cert_file.is_some() {
                "coordinator.admin_tls.key_file"
            } else {
                "coordinator.admin_tls.cert_file"
            };
            return Err(ConfigError::invalid(
                missing,
                "is required when the other of cert_file/key_file is set",
            ));
        }
        check_range(
            "coordinator.completed_memory",
            self.completed_memory,
            0,
            65_536,
        )?;
        check_range(
            "coordinator.max_task_attempts",
            self.max_task_attempts,
            0,
            1_000,
        )?;
        check_range(
            "coordinator.max_recommended_workers",
            self.max_recommended_workers,
            1,
            100_000,
        )?;
        let k = &self.initial_knobs;
        for (range, value) in [
            (knob_ranges::EPS_LOW, k.eps_low),
            (knob_ranges::EPS_HIGH, k.eps_high),
            (knob_ranges::ADAPTIVE_QUANTILE, k.adaptive_quantile),
            (knob_ranges::ADAPTIVE_TEMPERATURE, k.adaptive_temperature),
            (knob_ranges::IMPORTANCE_WEIGHT_CAP, k.importance_weight_cap),
            (
                knob_ranges::IMPORTANCE_WEIGHT_FLOOR,
                k.importance_weight_floor,
            ),
            (knob_ranges::DUAL_CLIP, k.dual_clip),
            (knob_ranges::LEARNING_RATE, k.learning_rate),
        ] {
            if !range.contains(value) {
                return Err(ConfigError::invalid(
                    format!("coordinator.initial_knobs.{}", range.name),
                    format!("= {value} is out of range {range}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::DatasetConfig;
    use crate::test_check::check;

    #[test]
    fn verifier_defaults_to_a_builtin_name_else_the_service() {
        let mut d = DatasetConfig::jsonl("math", "x.jsonl");
        assert_eq!(d.verifier_name(), "math");
        d.name = "gsm8k".into();
        assert_eq!(d.verifier_name(), "service");
        d.verifier = Some("math".into());
        assert_eq!(d.verifier_name(), "math");
    }

    #[test]
    fn coordinator_table() {
        check("[coordinator]", None);
        check(
            "[coordinator]\nlease_timeout = \"30s\"\nheartbeat_interval = \"1s\"\ndead_after = \"5s\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_token = \"t\"\n[[coordinator.datasets]]\nname = \"arith\"\npath = \"data/arith.jsonl\"\n[coordinator.initial_knobs]\nclip_mode = \"m2po\"\nlearning_rate = 3e-6",
            None,
        );
        check(
            "[coordinator]\nlease_timeout = \"0s\"",
            Some("coordinator.lease_timeout"),
        );
        check(
            "[coordinator]\nlease_timeout = \"3s\"\nheartbeat_interval = \"2s\"",
            Some("coordinator.lease_timeout"),
        );
        check(
            "[coordinator]\ndead_after = \"1s\"",
            Some("coordinator.dead_after"),
        );
        check(
            "[coordinator]\nheartbeat_interval = \"0s\"",
            Some("coordinator.heartbeat_interval"),
        );
        check(
            "[coordinator]\nretry_after = \"soon\"",
            Some("coordinator.retry_after"),
        );
        check(
            "[coordinator]\nmax_tasks_per_acquire = 0",
            Some("coordinator.max_tasks_per_acquire"),
        );
        check(
            "[coordinator]\nadmin_listen = \"nowhere\"",
            Some("coordinator.admin_listen"),
        );
        check("[coordinator]\nadmin_listen = \"\"", None);
        let ds = "[[coordinator.datasets]]\nname = \"gsm8k\"\npath = \"d.parquet\"\n";
        check(
            &format!(
                "{ds}format = \"parquet\"\nprompt_field = \"question\"\nid_field = \"uid\"\napply_chat_template = true\nsystem_prompt = \"Think.\"\nverifier = \"math\"\nmax_prompt_tokens = 512\nlong_prompts = \"skip\""
            ),
            None,
        );
        check(
            &format!("{ds}format = \"csv\""),
            Some("coordinator.datasets[0].format"),
        );
        check(
            &format!("{ds}prompt_field = \"\""),
            Some("coordinator.datasets[0].prompt_field"),
        );
        check(
            &format!("{ds}answer_field = \"prompt\""),
            Some("coordinator.datasets[0].answer_field"),
        );
        check(
            &format!("{ds}verifier = \"exact\""),
            Some("coordinator.datasets[0].verifier"),
        );
        check(&format!("{ds}verifier = \"service\""), None);
        check(
            &format!("{ds}max_prompt_tokens = 0"),
            Some("coordinator.datasets[0].max_prompt_tokens"),
        );
        check(
            &format!("{ds}long_prompts = \"truncate\""),
            Some("coordinator.datasets[0].long_prompts"),
        );
        check(
            &format!("{ds}system_prompt = \"\""),
            Some("coordinator.datasets[0].system_prompt"),
        );
        check(
            &format!("{ds}prompt = \"q\""),
            Some("coordinator.datasets[0].prompt"),
        );
        check(
            "[coordinator]\nadmin_token = \"a\"\nadmin_token_file = \"/t\"",
            Some("coordinator.admin_token_file"),
        );
        check(
            "[coordinator]\nadmin_token = \" \"",
            Some("coordinator.admin_token"),
        );
        check(
            "[coordinator.admin_tls]\ncert_file = \"c.pem\"",
            Some("coordinator.admin_tls.key_file"),
        );
        check(
            "[coordinator.admin_tls]\nkey_file = \"k.pem\"",
            Some("coordinator.admin_tls.cert_file"),
        );
        check(
            "[[coordinator.datasets]]\nname = \"a.b\"\npath = \"x\"",
            Some("coordinator.datasets[0].name"),
        );
        check(
            "[[coordinator.datasets]]\nname = \"a\"\npath = \"x\"\n[[coordinator.datasets]]\nname = \"a\"\npath = \"y\"",
            Some("coordinator.datasets[1].name"),
        );
        check(
            "[[coordinator.datasets]]\nname = \"a\"\npath = \"\"",
            Some("coordinator.datasets[0].path"),
        );
        check(
            "[[coordinator.datasets]]\nname = \"a\"",
            Some("missing field `path`"),
        );
        check(
            "[coordinator]\ncompleted_memory = 100000",
            Some("coordinator.completed_memory"),
        );
        check(
            "[coordinator]\nmax_recommended_workers = 0",
            Some("coordinator.max_recommended_workers"),
        );
        check(
            "[coordinator.initial_knobs]\neps_low = 1.5",
            Some("coordinator.initial_knobs.eps_low"),
        );
        check(
            "[coordinator.initial_knobs]\nlearning_rate = 0.0",
            Some("coordinator.initial_knobs.learning_rate"),
        );
        check(
            "[coordinator.initial_knobs]\nadaptive_quantile = 1.0",
            Some("coordinator.initial_knobs.adaptive_quantile"),
        );
        check(
            "[coordinator.initial_knobs]\nclip_mode = \"fancy\"",
            Some("clip_mode"),
        );
        check(
            "[coordinator]\nlease_timout = \"1s\"",
            Some("`coordinator.lease_timout`: unknown field"),
        );
    }
}
