//! The subcommands that are not a whole training run: one role in its own
//! process, the warm start, data sets, the buffer's export, the version.

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use asyncrl_config::Config;

use crate::roles::{block_on, load, run_role};

/// `asyncrl version`: the version, the linked libtorch and CUDA.
pub fn version_report() -> String {
    #[cfg(feature = "torch")]
    let torch = asyncrl_learner::device_report();
    #[cfg(not(feature = "torch"))]
    let torch = "built without the `torch` feature: no libtorch (coordinator, buffer, ctl, data)"
        .to_owned();
    format!("asyncrl {}\n{torch}", env!("CARGO_PKG_VERSION"))
}

/// `asyncrl coordinator`.
pub fn coordinator(config: &Path, bus: Option<&str>) -> anyhow::Result<()> {
    run_role(
        config,
        bus,
        "coordinator",
        |_| {},
        |c, b, m, s| async move {
            asyncrl_coordinator::run(c, b, m, s)
                .await
                .map_err(Into::into)
        },
    )
}

/// `asyncrl buffer`.
pub fn buffer(config: &Path, bus: Option<&str>) -> anyhow::Result<()> {
    run_role(
        config,
        bus,
        "buffer",
        |_| {},
        |c, b, m, s| async move { asyncrl_buffer::run(c, b, m, s).await.map_err(Into::into) },
    )
}

/// `asyncrl learner`.
#[cfg(feature = "torch")]
pub fn learner(config: &Path, bus: Option<&str>) -> anyhow::Result<()> {
    run_role(
        config,
        bus,
        "learner",
        |_| {},
        |c, b, m, s| async move { asyncrl_learner::service::run(c, b, m, s).await.map(|_| ()) },
    )
}

/// `asyncrl worker`.
#[cfg(feature = "torch")]
pub fn worker(config: &Path, bus: Option<&str>) -> anyhow::Result<()> {
    run_role(
        config,
        bus,
        "worker",
        asyncrl_rollout_worker::pin_worker_id,
        |c, b, m, s| async move {
            asyncrl_rollout_worker::run(c, b, m, s)
                .await
                .map(|_| ())
                .map_err(Into::into)
        },
    )
}

/// `asyncrl trainer-node`: node `node_rank` of the learner's torch engine
/// group (`learner.torch.nodes` > 1), by default the Indexed Job's
/// `JOB_COMPLETION_INDEX` + 1 (node 0 is the learner). Exits as the group
/// does.
#[cfg(feature = "torch")]
pub fn trainer_node(config: &Path, node_rank: Option<usize>) -> anyhow::Result<()> {
    let config = crate::roles::load(config, None)?;
    let node_rank = match node_rank {
        Some(r) => r,
        None => {
            let index = std::env::var("JOB_COMPLETION_INDEX").context(
                "asyncrl trainer-node needs --node-rank N (or JOB_COMPLETION_INDEX, as an Indexed Job sets it)",
            )?;
            let index: usize = index
                .parse()
                .with_context(|| format!("JOB_COMPLETION_INDEX {index:?} is not a number"))?;
            index + 1
        }
    };
    let status = asyncrl_learner::torch_engine::run_node(&config, node_rank)?;
    if !status.success() {
        anyhow::bail!("trainer node {node_rank}: the group exited with {status}");
    }
    Ok(())
}

#[cfg(not(feature = "torch"))]
pub fn trainer_node(_: &Path, _: Option<usize>) -> anyhow::Result<()> {
    crate::no_torch("trainer-node")
}

#[cfg(not(feature = "torch"))]
pub fn learner(_: &Path, _: Option<&str>) -> anyhow::Result<()> {
    crate::no_torch("learner")
}

#[cfg(not(feature = "torch"))]
pub fn worker(_: &Path, _: Option<&str>) -> anyhow::Result<()> {
    crate::no_torch("worker")
}

/// `asyncrl train CONFIG`: every role in one process; prints the summary.
#[cfg(feature = "torch")]
pub fn train(
    config: &Path,
    bus: Option<&str>,
    workers: usize,
    fresh: bool,
    check_config: bool,
) -> anyhow::Result<()> {
    let config = load(config, bus)?;
    if check_config {
        return self::check_config(&config);
    }
    let opts = crate::train::TrainOptions {
        workers,
        fresh,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        ..Default::default()
    };
    let summary = block_on(crate::train::train(config, opts))??;
    print!("{summary}");
    Ok(())
}

#[cfg(not(feature = "torch"))]
pub fn train(
    config: &Path,
    bus: Option<&str>,
    _workers: usize,
    _fresh: bool,
    check_config: bool,
) -> anyhow::Result<()> {
    if check_config {
        return self::check_config(&load(config, bus)?);
    }
    crate::no_torch("train")
}

/// `asyncrl train --check-config`: prints the report of [`crate::check`].
pub fn check_config(config: &Config) -> anyhow::Result<()> {
    let report = crate::check::check_tasks(config)?;
    print!("{report}");
    Ok(())
}

/// `asyncrl ctl`: one admin call; prints the reply.
pub fn ctl(
    config: Option<&Path>,
    request: &asyncrl_coordinator::ctl::CtlArgs,
) -> anyhow::Result<()> {
    let config = match config {
        Some(p) => Config::load(p)?,
        None => Config::default(),
    };
    let out = block_on(asyncrl_coordinator::ctl::ctl(&config, request))??;
    print!("{out}");
    Ok(())
}

/// `asyncrl buffer export`.
pub fn buffer_export(
    config: &Path,
    format: &str,
    out: PathBuf,
    from_version: Option<i32>,
    to_version: Option<i32>,
) -> anyhow::Result<()> {
    if format != "parquet" {
        anyhow::bail!("--format {format:?} is not supported (only parquet)");
    }
    let config = Config::load(config)?;
    let mut args = asyncrl_buffer::ExportArgs::from_config(&config, out);
    args.from_version = from_version;
    args.to_version = to_version;
    let summary = asyncrl_buffer::export(&args)?;
    println!("{summary}");
    Ok(())
}

/// What `asyncrl data generate` writes.
#[derive(Debug, Clone)]
pub struct DataGenerate {
    /// arith or reverse.
    pub task: String,
    pub n: usize,
    pub seed: u64,
    pub max_operand: u64,
    /// arith: every problem once instead of `n` random ones.
    pub all: bool,
    pub out: PathBuf,
}

/// `asyncrl data generate`.
pub fn data_generate(args: &DataGenerate) -> anyhow::Result<()> {
    let task = asyncrl_tasks::BuiltinTask::from_name(&args.task).with_context(|| {
        format!(
            "--task {:?} is not a built-in task (arith, reverse, hidden_sum)",
            args.task
        )
    })?;
    let items = match (args.all, task) {
        (true, asyncrl_tasks::BuiltinTask::Arith) => asyncrl_tasks::arith_all(args.max_operand),
        (true, asyncrl_tasks::BuiltinTask::HiddenSum) => {
            asyncrl_tasks::hidden_sum_all(args.max_operand)
        }
        (true, _) => anyhow::bail!("--all lists every problem of arith and hidden_sum only"),
        (false, _) => asyncrl_tasks::generate_with(
            task,
            args.n,
            args.seed,
            asyncrl_tasks::GenerateOptions {
                max_operand: args.max_operand,
            },
        ),
    };
    asyncrl_tasks::write_jsonl(&args.out, &items)?;
    println!(
        "wrote {} {} tasks to {}",
        items.len(),
        task.name(),
        args.out.display()
    );
    Ok(())
}

/// What `asyncrl warmstart` trains.
#[derive(Debug, Clone)]
pub struct Warmstart {
    pub config: PathBuf,
    pub out: PathBuf,
    pub steps: usize,
    pub batch_size: usize,
    pub lr: f64,
    /// Items held out of training to measure accuracy before and after.
    pub eval: usize,
}

/// Pins libtorch's CPU kernels to their portable code paths
/// ([`asyncrl_policy::kernels`]): `asyncrl warmstart` does so unless told
/// `--native-kernels`, so that one command makes the same weights on every
/// x86-64 CPU.
///
/// # Safety
/// Call it first thing in `main`, while the process has one thread and
/// before any tensor operation.
#[cfg(feature = "torch")]
pub unsafe fn pin_portable_kernels() {
    // SAFETY: passed on to the caller.
    unsafe { asyncrl_policy::kernels::pin_portable() }
}

/// `asyncrl warmstart`: supervised warm start of the built-in model.
#[cfg(feature = "torch")]
pub fn warmstart(args: &Warmstart) -> anyhow::Result<()> {
    let config = load(&args.config, None)?;
    let opts = asyncrl_learner::sft::SftOptions {
        steps: args.steps,
        batch_size: args.batch_size,
        learning_rate: args.lr,
        seed: config.run.seed,
        temperature: asyncrl_policy::logprob_temperature(config.model.temperature),
        grad_clip: 1.0,
    };
    let report = asyncrl_learner::sft::run_warm_start(&config, &opts, args.eval, &args.out)?;
    println!(
        "warm start: {} steps in {:.0}s; accuracy on {} held-out tasks: greedy {:.3} -> {:.3}, sampled (T={}) {:.3} -> {:.3}",
        args.steps,
        report.seconds,
        args.eval,
        report.before.greedy,
        report.after.greedy,
        config.model.temperature,
        report.before.sampled,
        report.after.sampled
    );
    println!(
        "model: {} ({} CPU kernels)",
        args.out.display(),
        asyncrl_policy::kernels::current().as_str()
    );
    Ok(())
}

#[cfg(not(feature = "torch"))]
pub fn warmstart(_: &Warmstart) -> anyhow::Result<()> {
    crate::no_torch("warmstart")
}
