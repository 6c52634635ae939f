//! The buffer's cost curve: the buffer's core in process (as
//! `buffer/benches/buffer.rs` drives it) taking in record batches of 256
//! short trajectories (groups of 8) up to N resident, then serving 64-group
//! batches: plan, commit, gather and Arrow IPC encode, what the service does
//! per request apart from the state-log append and the reply's transport.

use std::time::Instant;

use anyhow::Context as _;
use asyncrl_buffer::core::{Ask, Core, Outcome, RowMeta};
use asyncrl_buffer::encode_batch;
use asyncrl_buffer::testing::traj_of;
use asyncrl_config::SamplingPolicy;
use asyncrl_protos::Trajectory;
use asyncrl_protos::arrow_schema::to_record_batch;

use super::curves::{Chart, Curve};
use super::stats::percentile;

pub(crate) struct Options {
    pub trajectories: Vec<usize>,
    pub completion_tokens: usize,
    pub serves: usize,
}

const GROUP: u32 = 8;
const CHUNK: u64 = 256;
const SERVE_GROUPS: usize = 64;
const PROMPT_TOKENS: usize = 16;

/// Resident bytes of this process, from `/proc/self/statm`.
fn resident_bytes() -> anyhow::Result<f64> {
    let text =
        std::fs::read_to_string("/proc/self/statm").context("cannot read /proc/self/statm")?;
    let pages: f64 = text
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .context("/proc/self/statm has no resident field")?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    anyhow::ensure!(page > 0, "sysconf(_SC_PAGESIZE) failed");
    Ok(pages * page as f64)
}

/// Trajectories `from..to` (whole groups, every one its own task).
fn chunk(from: u64, to: u64, tokens: usize) -> Vec<Trajectory> {
    (from..to)
        .map(|k| {
            let group = k / u64::from(GROUP);
            traj_of(
                &format!("t{group}"),
                &format!("g{group}"),
                k as u32,
                (k % u64::from(GROUP)) as u32,
                GROUP,
                0,
                tokens,
            )
        })
        .collect()
}

pub(crate) fn measure(o: &Options) -> anyhow::Result<Curve> {
    let mut targets = o.trajectories.clone();
    targets.sort_unstable();
    let base_rss = resident_bytes()?;
    let mut core = Core::new(SamplingPolicy::Fifo, 1, 0);
    core.add_segment(1, true);
    let mut made = 0u64;
    let mut step = 0u64;
    let mut rows = Vec::new();
    for &target in &targets {
        // Top up to `target` live trajectories (serving released some).
        let mut ingest_s = 0.0;
        let mut ingested = 0u64;
        while (core.stats().live_trajectories as u64) < target as u64 {
            let want = target as u64 - core.stats().live_trajectories as u64;
            let n = want.div_ceil(u64::from(GROUP)) * u64::from(GROUP);
            let n = n.min(CHUNK);
            let trajs = chunk(made, made + n, o.completion_tokens);
            made += n;
            let t0 = Instant::now();
            let batch = to_record_batch(&trajs).context("build a record batch")?;
            let metas: Vec<RowMeta> = trajs
                .iter()
                .map(|t| RowMeta::of(t).context("a trajectory uuid does not parse"))
                .collect::<anyhow::Result<_>>()?;
            drop(trajs);
            let applied = core.apply(batch, &metas, 1, false);
            ingest_s += t0.elapsed().as_secs_f64();
            ingested += n;
            anyhow::ensure!(
                applied.stored == metas.len(),
                "the core stored {} of {} trajectories",
                applied.stored,
                metas.len()
            );
        }
        let stats = core.stats();
        let rss = resident_bytes()? - base_rss;
        let tokens = stats.live_tokens as f64;
        let (mut total, mut planning) = (Vec::new(), Vec::new());
        for _ in 0..o.serves {
            step += 1;
            let t0 = Instant::now();
            let plan = core.plan(Ask::next(step, 0, 1_000, SERVE_GROUPS));
            let Outcome::Serve(groups) = plan.outcome.clone() else {
                anyhow::bail!("step {step} was not served: {:?}", plan.outcome);
            };
            core.commit(plan);
            let t1 = Instant::now();
            let (batches, idx) = core.gather(&groups).map_err(|e| anyhow::anyhow!(e))?;
            let enc = encode_batch(&batches, &idx, false, 0).context("encode a batch")?;
            anyhow::ensure!(
                enc.rows == SERVE_GROUPS * GROUP as usize,
                "{} rows",
                enc.rows
            );
            total.push(t0.elapsed().as_secs_f64() * 1e3);
            planning.push((t1 - t0).as_secs_f64() * 1e3);
        }
        let row = vec![
            stats.live_trajectories as f64,
            tokens,
            rss / tokens,
            stats.resident_bytes as f64 / tokens,
            rss / stats.live_trajectories as f64,
            percentile(&mut total, 50.0),
            percentile(&mut planning, 50.0),
            if ingest_s > 0.0 {
                ingested as f64 / ingest_s
            } else {
                f64::NAN
            },
        ];
        eprintln!(
            "scale: {} resident trajectories: {:.1} bytes/token (RSS), serve {:.3} ms",
            row[0], row[2], row[5]
        );
        rows.push(row);
    }
    let notes = format!(
        "The buffer's core in process (`asyncrl_buffer::core::Core`, FIFO, each group served \
         once), trajectories of {PROMPT_TOKENS} prompt + {} completion tokens (short, so that \
         1 M fit in memory: 1 M of 1 k tokens would be about 12 GB), groups of {GROUP}, taken in \
         as record batches of {CHUNK}. Memory: this process's resident set (`/proc/self/statm`) \
         above its level before the first trajectory, and the core's own account of its Arrow \
         bytes, per resident token. Serve: the median of {} 64-group serves (plan + commit + \
         gather + Arrow IPC encode; `plan_commit_ms` is the first two), each releasing the \
         previous step's groups; no state-log append, no transport. `ingest_per_s`: record \
         batch building + `Core::apply` for the trajectories added since the previous row.\n",
        o.completion_tokens, o.serves
    );
    Ok(Curve {
        name: "buffer",
        title: "Buffer: memory per token and serve time vs resident trajectories".into(),
        x_label: "resident trajectories",
        header: vec![
            "resident_trajectories",
            "resident_tokens",
            "rss_bytes_per_token",
            "arrow_bytes_per_token",
            "rss_bytes_per_trajectory",
            "serve_ms",
            "plan_commit_ms",
            "ingest_per_s",
        ],
        rows,
        x_col: 0,
        charts: vec![
            Chart {
                suffix: "memory",
                y_label: "bytes per token",
                columns: vec![2, 3],
            },
            Chart {
                suffix: "serve",
                y_label: "ms per 64-group batch",
                columns: vec![5, 6],
            },
        ],
        notes,
        headline: String::new(),
    })
}
