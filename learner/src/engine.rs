//! The trainer-engine boundary: what the learner role asks of whatever
//! computes its step.
//!
//! The role ([`crate::service`]) keeps the NATS contract, knob sealing,
//! batches (exactly once), publication, checkpoint bookkeeping, metrics and
//! evaluation; an engine owns the model, its optimizer and the step. Two
//! engines (`learner.trainer`):
//! - `builtin`: [`Trainer`], libtorch through tch in this process;
//! - `torch`: [`crate::torch_engine::TorchEngine`], a PyTorch process group
//!   (FSDP2) behind `asyncrl.v1.TrainerEngine` (protos/…/trainer.proto).
//!
//! An engine lives on the learner's trainer thread ([`crate::actor`]); every
//! method may block.

use std::path::{Path, PathBuf};

use arrow::array::RecordBatch;
use asyncrl_config::{Config, TrainerEngineName};

use crate::batch::BatchLimits;
use crate::checkpoint;
use crate::trainer::{StepSettings, StepStats, TrainError, Trainer};

pub trait TrainerEngine: Send {
    /// `builtin` or `torch` (logs, metrics).
    fn name(&self) -> &'static str;
    /// Learner steps completed.
    fn step(&self) -> u64;
    /// Version of the current weights.
    fn version(&self) -> i32;
    /// What a batch may hold for this model at this version.
    fn batch_limits(&self) -> BatchLimits;
    /// Trains one step on `batches` (complete groups, checked against
    /// [`Self::batch_limits`] first) and bumps the version. A batch it
    /// refuses ([`TrainError::Batch`]) trained nothing.
    fn train_step(
        &mut self,
        batches: &[RecordBatch],
        knobs: &StepSettings,
    ) -> Result<StepStats, TrainError>;
    /// The current weights as one safetensors file (the object store's
    /// publication format).
    fn weights_bytes(&mut self) -> Result<Vec<u8>, TrainError>;
    /// Adopts published weights of `version`, newer than the restored
    /// checkpoint (the step counter continues from it).
    fn adopt_published(&mut self, bytes: &[u8], version: i32) -> Result<(), TrainError>;
    /// Writes the current weights as a complete Hugging Face folder at
    /// `dest` (written under a temporary name and renamed, with a
    /// `sha256.json` of its safetensors files): the `shared_path` transport.
    fn export_folder(&mut self, dest: &Path) -> Result<(), TrainError>;
    /// Adopts the published folder `dir` of `version` whose files the
    /// caller has read and checked (`files`).
    fn adopt_folder(
        &mut self,
        dir: &Path,
        files: &[(String, bytes::Bytes)],
        version: i32,
    ) -> Result<(), TrainError>;
    /// Writes a checkpoint of the current state under `root` (a folder
    /// `step-NNNNNNNN`, complete or absent) and returns its path.
    fn write_checkpoint(&mut self, root: &Path) -> Result<PathBuf, TrainError>;
}

impl TrainerEngine for Trainer {
    fn name(&self) -> &'static str {
        TrainerEngineName::Builtin.as_str()
    }

    fn step(&self) -> u64 {
        Trainer::step(self)
    }

    fn version(&self) -> i32 {
        Trainer::version(self)
    }

    fn batch_limits(&self) -> BatchLimits {
        Trainer::batch_limits(self)
    }

    fn train_step(
        &mut self,
        batches: &[RecordBatch],
        knobs: &StepSettings,
    ) -> Result<StepStats, TrainError> {
        Trainer::train_step(self, batches, knobs)
    }

    fn weights_bytes(&mut self) -> Result<Vec<u8>, TrainError> {
        Trainer::weights_bytes(self)
    }

    fn adopt_published(&mut self, bytes: &[u8], version: i32) -> Result<(), TrainError> {
        Trainer::adopt_published(self, bytes, version)
    }

    fn write_checkpoint(&mut self, root: &Path) -> Result<PathBuf, TrainError> {
        Trainer::write_checkpoint(self, root)
    }

    fn export_folder(&mut self, dest: &Path) -> Result<(), TrainError> {
        Trainer::export_folder(self, dest)
    }

    fn adopt_folder(
        &mut self,
        dir: &Path,
        files: &[(String, bytes::Bytes)],
        version: i32,
    ) -> Result<(), TrainError> {
        let [(_, bytes)] = files else {
            return Err(checkpoint::CheckpointError::Invalid {
                path: dir.to_owned(),
                reason: format!(
                    "the built-in trainer adopts one weights file, the folder has {}",
                    files.len()
                ),
            }
            .into());
        };
        Trainer::adopt_published(self, bytes, version)
    }
}

/// Starts the engine `learner.trainer` names, resumed from the newest
/// complete checkpoint of its kind under `ckpt_dir`. Runs on the thread that
/// will own it.
pub fn start(config: &Config, ckpt_dir: &Path) -> anyhow::Result<Box<dyn TrainerEngine>> {
    use anyhow::Context as _;
    let opts = crate::service::trainer_options(config);
    match config.learner.trainer {
        TrainerEngineName::Builtin => {
            let latest = checkpoint::load_latest(ckpt_dir)?;
            let policy = asyncrl_policy::from_config::load_policy(&config.model, config.run.seed)?;
            let mut trainer = Trainer::new(policy, opts);
            // The KL loss's reference: the weights the run started from,
            // taken before a checkpoint replaces them.
            if config.learner.kl_coef > 0.0 {
                trainer
                    .hold_reference()
                    .context("cannot copy the starting weights as the KL reference")?;
            }
            if let Some(ckpt) = &latest {
                trainer.restore(ckpt)?;
                tracing::info!(checkpoint = %ckpt.dir.display(), step = ckpt.meta.step, version = ckpt.meta.version, "resumed from checkpoint");
            }
            Ok(Box::new(trainer))
        }
        TrainerEngineName::Torch => {
            let engine = crate::torch_engine::TorchEngine::start(config, opts, ckpt_dir)
                .context("cannot start the torch trainer engine (learner.trainer = \"torch\")")?;
            Ok(Box::new(engine))
        }
    }
}
