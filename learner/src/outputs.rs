//! The learner's run outputs in `run.output_dir`, each a typed record with
//! one writer (the learner's) and one reader (for the tests, the benches,
//! the plots and `asyncrl train`'s report):
//!
//! | file                   | record          | writer        | reader           |
//! |------------------------|-----------------|---------------|------------------|
//! | [`TRAINED_JSONL`]      | [`TrainedStep`] | [`TrainedLog`]| [`read_trained`] |
//! | [`METRICS_CSV`]        | [`MetricsRow`]  | [`CsvLog`]    | [`read_metrics`] |
//! | [`EVAL_CSV`]           | [`EvalRow`]     | [`CsvLog`]    | [`read_eval`]    |
//!
//! All three are append-only files of one record per line: a resumed
//! learner appends to them, and they follow the torn-tail rule of
//! [`asyncrl_common::linelog`]. A writer cuts a torn last line off when it
//! opens the file and writes every record with one `write` of a whole line;
//! a reader ignores the text after the last newline (the learner may be
//! writing that line right now). docs/contracts.md describes the fields and
//! the invariants that read `trained.jsonl`.
//!
//! The records are free of libtorch, so the harness and the application
//! read them without the trainer.

use std::fmt::Display;
use std::io::{BufRead as _, BufReader, Seek as _, SeekFrom, Write as _};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use anyhow::Context as _;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};

/// Per trained step: the versions and the trajectories it trained on.
pub const TRAINED_JSONL: &str = "trained.jsonl";
/// Per trained step: its statistics, written once its version is announced.
pub const METRICS_CSV: &str = "learner_metrics.csv";
/// Per evaluated version (`[eval]`): the held-out scores.
pub const EVAL_CSV: &str = "eval.csv";

// ------------------------------------------------------------ trained.jsonl

/// One line of `trained.jsonl`: a step the learner trained, recorded before
/// its weights are published. A learner killed in between retrains the step
/// (on the same trajectories, from its kept batch) and lists it again.
///
/// The fields are declared in the order they are written (alphabetical, as
/// the file has always had them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TrainedStep {
    /// The largest per-token version lag of the step (`v − v_b`, over the
    /// trained tokens).
    pub max_version_lag: f64,
    /// The oldest policy version of any trained token; −1 for a batch
    /// without version information.
    pub min_token_version: i32,
    /// The version the step's weights are published as (= `step`).
    pub published_version: i32,
    /// The learner step (1, 2, …).
    pub step: u64,
    /// The wire ids of the tasks trained on (one per group, sorted); empty
    /// in a file written before they were recorded.
    #[serde(default)]
    pub tasks: Vec<String>,
    /// The version of the weights the step trained from (= `step − 1`).
    pub trained_at_version: i32,
    /// The ids of the trajectories trained on.
    pub trajectories: Vec<String>,
}

/// The writer of `trained.jsonl`: appends one step per line and syncs it.
pub struct TrainedLog {
    path: PathBuf,
    file: std::fs::File,
}

impl TrainedLog {
    /// Opens (or creates) `path`, cutting off a torn last line.
    pub fn open(path: PathBuf) -> anyhow::Result<Self> {
        let file = asyncrl_common::linelog::open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self { path, file })
    }

    /// Appends `step` (one write) and syncs the file's data.
    pub fn append(&mut self, step: &TrainedStep) -> anyhow::Result<()> {
        let mut line = serde_json::to_vec(step).context("cannot encode a trained.jsonl line")?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|()| self.file.sync_data())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }
}

/// Every whole line of a `trained.jsonl`, in order (a retrained step
/// appears again; the last entry of a step is its final one). Text after
/// the last newline is ignored; a whole line that is not a [`TrainedStep`]
/// is an error naming it.
pub fn read_trained(path: &Path) -> anyhow::Result<Vec<TrainedStep>> {
    let bytes = read_whole_lines(path)?;
    let text =
        std::str::from_utf8(&bytes).with_context(|| format!("{} is not UTF-8", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            serde_json::from_str(l).with_context(|| {
                format!(
                    "{} line {}: not a trained step: {l:?}",
                    path.display(),
                    n + 1
                )
            })
        })
        .collect()
}

// -------------------------------------------------------------- the CSV files

/// A record of one of the learner's CSV files: its columns, in order, are
/// the header the writer writes and the reader expects.
pub trait CsvRecord: Serialize + DeserializeOwned {
    const COLUMNS: &'static [&'static str];
}

/// One row of `learner_metrics.csv`: a trained step, written once its
/// version is announced. The columns are the fields, in this order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsRow {
    pub step: u64,
    /// The version the step published (= `step`).
    pub version: i32,
    /// Seconds from the start of this learner run to the announcement of
    /// `version` (a resumed run starts again from 0).
    #[serde(serialize_with = "fixed3")]
    pub wall_seconds: f64,
    /// Mean reward of the step's scored trajectories.
    #[serde(serialize_with = "fixed6")]
    pub reward_mean: f64,
    /// Trajectories whose verifier failed.
    pub reward_failed: u64,
    #[serde(serialize_with = "fixed6")]
    pub loss: f64,
    /// Fractions of the trained tokens whose ratio hit the lower / upper
    /// bound, masked by the importance-weight cap, masked by m2po.
    #[serde(serialize_with = "fixed6")]
    pub clip_low: f64,
    #[serde(serialize_with = "fixed6")]
    pub clip_high: f64,
    #[serde(serialize_with = "fixed6")]
    pub weight_masked: f64,
    #[serde(serialize_with = "fixed6")]
    pub m2po_masked: f64,
    /// `mean 0.5·(c − p)²` over the trained tokens.
    #[serde(serialize_with = "fixed6")]
    pub approx_kl: f64,
    #[serde(serialize_with = "fixed6")]
    pub entropy: f64,
    #[serde(serialize_with = "fixed6")]
    pub grad_norm: f64,
    #[serde(serialize_with = "exp")]
    pub learning_rate: f64,
    /// Trained (completion) tokens.
    pub tokens: i64,
    pub groups: u64,
    /// Mean and largest per-token version lag `v − v_b`.
    #[serde(serialize_with = "fixed4")]
    pub version_lag_mean: f64,
    #[serde(serialize_with = "shortest")]
    pub version_lag_max: f64,
    /// Seconds the step waited for its batch, trained, and took to upload
    /// and announce its weights.
    #[serde(serialize_with = "fixed4")]
    pub wait_seconds: f64,
    #[serde(serialize_with = "fixed4")]
    pub compute_seconds: f64,
    #[serde(serialize_with = "fixed4")]
    pub publish_seconds: f64,
    /// Rows × padded length of the batch.
    pub padded_tokens: i64,
    /// Tokens whose behaviour log-prob was compared with the learner's,
    /// the mean and largest `|b − l|`, and the k3 estimate of
    /// KL(behaviour ‖ learner).
    pub logprob_gap_tokens: i64,
    #[serde(serialize_with = "exp")]
    pub logprob_gap_mean: f64,
    #[serde(serialize_with = "exp")]
    pub logprob_gap_max: f64,
    #[serde(serialize_with = "exp")]
    pub logprob_kl: f64,
}

impl CsvRecord for MetricsRow {
    const COLUMNS: &'static [&'static str] = &[
        "step",
        "version",
        "wall_seconds",
        "reward_mean",
        "reward_failed",
        "loss",
        "clip_low",
        "clip_high",
        "weight_masked",
        "m2po_masked",
        "approx_kl",
        "entropy",
        "grad_norm",
        "learning_rate",
        "tokens",
        "groups",
        "version_lag_mean",
        "version_lag_max",
        "wait_seconds",
        "compute_seconds",
        "publish_seconds",
        "padded_tokens",
        "logprob_gap_tokens",
        "logprob_gap_mean",
        "logprob_gap_max",
        "logprob_kl",
    ];
}

/// The scores of one evaluation. Accuracies are mean rewards (1 = every
/// completion right); a completion is "right" for pass@k at reward 1.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EvalScores {
    pub problems: usize,
    pub greedy: Option<f64>,
    pub sampled: Option<f64>,
    /// Fraction of problems with at least one right completion among `k`.
    pub pass_at_k: Option<f64>,
    pub k: usize,
    pub seconds: f64,
}

impl std::fmt::Display for EvalScores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} problems:", self.problems)?;
        if let Some(g) = self.greedy {
            write!(f, " greedy accuracy {g:.4}")?;
        }
        if let Some(s) = self.sampled {
            write!(f, " sampled accuracy {s:.4}")?;
        }
        if let Some(p) = self.pass_at_k {
            write!(f, " pass@{} {p:.4}", self.k)?;
        }
        write!(f, " ({:.1}s)", self.seconds)
    }
}

/// One row of `eval.csv`: an evaluated version. In the file the scores are
/// columns of their own (see [`EvalRow::COLUMNS`]); a score not measured
/// is an empty field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "EvalRecord", from = "EvalRecord")]
pub struct EvalRow {
    pub version: i32,
    /// The learner step that produced the version.
    pub step: u64,
    /// Seconds since the learner started when the version was published.
    pub wall_seconds: f64,
    pub scores: EvalScores,
}

impl CsvRecord for EvalRow {
    const COLUMNS: &'static [&'static str] = &[
        "version",
        "step",
        "wall_seconds",
        "problems",
        "greedy_accuracy",
        "sampled_accuracy",
        "pass_at_k",
        "k",
        "eval_seconds",
    ];
}

/// [`EvalRow`] as the columns of `eval.csv`.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct EvalRecord {
    version: i32,
    step: u64,
    #[serde(serialize_with = "fixed3")]
    wall_seconds: f64,
    problems: usize,
    #[serde(serialize_with = "opt_fixed6")]
    greedy_accuracy: Option<f64>,
    #[serde(serialize_with = "opt_fixed6")]
    sampled_accuracy: Option<f64>,
    #[serde(serialize_with = "opt_fixed6")]
    pass_at_k: Option<f64>,
    k: usize,
    #[serde(serialize_with = "fixed3")]
    eval_seconds: f64,
}

impl From<EvalRow> for EvalRecord {
    fn from(r: EvalRow) -> Self {
        let s = r.scores;
        Self {
            version: r.version,
            step: r.step,
            wall_seconds: r.wall_seconds,
            problems: s.problems,
            greedy_accuracy: s.greedy,
            sampled_accuracy: s.sampled,
            pass_at_k: s.pass_at_k,
            k: s.k,
            eval_seconds: s.seconds,
        }
    }
}

impl From<EvalRecord> for EvalRow {
    fn from(r: EvalRecord) -> Self {
        Self {
            version: r.version,
            step: r.step,
            wall_seconds: r.wall_seconds,
            scores: EvalScores {
                problems: r.problems,
                greedy: r.greedy_accuracy,
                sampled: r.sampled_accuracy,
                pass_at_k: r.pass_at_k,
                k: r.k,
                seconds: r.eval_seconds,
            },
        }
    }
}

/// The writer of an append-only CSV of `R`: the header when the file is
/// new, then one row per [`CsvLog::append`] (one write each, unbuffered).
pub struct CsvLog<R> {
    path: PathBuf,
    file: std::fs::File,
    row: PhantomData<fn(&R)>,
}

impl<R: CsvRecord> CsvLog<R> {
    /// Opens (or creates, with its folder) `path`, cutting off a torn last
    /// line and writing the header into an empty file. A file with another
    /// header (another version's columns) is an error: rows appended to it
    /// would be read under the wrong names.
    pub fn open(path: PathBuf) -> anyhow::Result<Self> {
        let err = |e: std::io::Error| {
            anyhow::Error::new(e).context(format!("cannot open {}", path.display()))
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(err)?;
        }
        let mut file = asyncrl_common::linelog::open(&path).map_err(err)?;
        let header = R::COLUMNS.join(",");
        if file.metadata().map_err(err)?.len() == 0 {
            file.write_all(format!("{header}\n").as_bytes())
                .with_context(|| format!("cannot write {}", path.display()))?;
        } else {
            file.seek(SeekFrom::Start(0)).map_err(err)?;
            let mut first = String::new();
            BufReader::new(&file).read_line(&mut first).map_err(err)?;
            anyhow::ensure!(
                first.trim_end_matches(['\n', '\r']) == header,
                "{} has the header {:?}, not {header:?}: written by another version of the learner?",
                path.display(),
                first.trim_end()
            );
        }
        Ok(Self {
            path,
            file,
            row: PhantomData,
        })
    }

    /// Appends `row` as one line (one write).
    pub fn append(&mut self, row: &R) -> anyhow::Result<()> {
        let mut w = csv::WriterBuilder::new()
            .has_headers(false)
            .from_writer(Vec::new());
        w.serialize(row)
            .with_context(|| format!("cannot encode a row of {}", self.path.display()))?;
        let line = w
            .into_inner()
            .map_err(|e| anyhow::anyhow!("cannot encode a row of {}: {e}", self.path.display()))?;
        self.file
            .write_all(&line)
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The rows of a `learner_metrics.csv`, in order.
pub fn read_metrics(path: &Path) -> anyhow::Result<Vec<MetricsRow>> {
    read_csv(path)
}

/// The rows of an `eval.csv`, in order.
pub fn read_eval(path: &Path) -> anyhow::Result<Vec<EvalRow>> {
    read_csv(path)
}

/// The rows of a CSV of `R`: its header must be `R::COLUMNS`; text after
/// the last newline is ignored (so a file without a whole header line has
/// no rows); a row that does not parse is an error naming its line.
pub fn read_csv<R: CsvRecord>(path: &Path) -> anyhow::Result<Vec<R>> {
    let bytes = read_whole_lines(path)?;
    if bytes.is_empty() {
        return Ok(Vec::new());
    }
    let mut reader = csv::Reader::from_reader(bytes.as_slice());
    let header = reader
        .headers()
        .with_context(|| format!("{}: cannot read the header", path.display()))?;
    anyhow::ensure!(
        header.iter().eq(R::COLUMNS.iter().copied()),
        "{} has the columns {:?}, not {:?}",
        path.display(),
        header.iter().collect::<Vec<_>>(),
        R::COLUMNS
    );
    reader
        .deserialize()
        .map(|row| row.with_context(|| format!("{}: a bad row", path.display())))
        .collect()
}

/// The bytes of `path` up to its last newline.
fn read_whole_lines(path: &Path) -> anyhow::Result<Vec<u8>> {
    let mut bytes =
        std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    bytes.truncate(asyncrl_common::linelog::whole_lines_len(&bytes));
    Ok(bytes)
}

// The number formats of the CSV files (compact, and what they always were).

fn formatted<S: Serializer>(s: S, v: impl Display) -> Result<S::Ok, S::Error> {
    s.collect_str(&v)
}

fn fixed3<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    formatted(s, format_args!("{v:.3}"))
}

fn fixed4<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    formatted(s, format_args!("{v:.4}"))
}

fn fixed6<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    formatted(s, format_args!("{v:.6}"))
}

fn exp<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    formatted(s, format_args!("{v:e}"))
}

/// Rust's shortest round-trip form (`2` for 2.0).
fn shortest<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
    formatted(s, v)
}

fn opt_fixed6<S: Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => fixed6(v, s),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trained(step: u64, ids: &[&str]) -> TrainedStep {
        TrainedStep {
            max_version_lag: 1.5,
            min_token_version: step as i32 - 2,
            published_version: step as i32,
            step,
            tasks: vec![format!("t{step}")],
            trained_at_version: step as i32 - 1,
            trajectories: ids.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn metrics(step: u64) -> MetricsRow {
        MetricsRow {
            step,
            version: step as i32,
            wall_seconds: 12.5,
            reward_mean: 0.25,
            reward_failed: 1,
            loss: -0.125,
            clip_low: 0.5,
            clip_high: 0.0,
            weight_masked: 0.0625,
            m2po_masked: 0.0,
            approx_kl: 0.001,
            entropy: 2.5,
            grad_norm: 3.0,
            learning_rate: 1e-6,
            tokens: 640,
            groups: 4,
            version_lag_mean: 0.75,
            version_lag_max: 2.0,
            wait_seconds: 0.5,
            compute_seconds: 1.25,
            publish_seconds: 0.125,
            padded_tokens: 1024,
            logprob_gap_tokens: 640,
            logprob_gap_mean: 0.0,
            logprob_gap_max: 3.5e-7,
            logprob_kl: 1e-9,
        }
    }

    fn eval(version: i32, greedy: Option<f64>) -> EvalRow {
        EvalRow {
            version,
            step: version as u64,
            wall_seconds: 3.5,
            scores: EvalScores {
                problems: 32,
                greedy,
                sampled: Some(0.25),
                pass_at_k: Some(0.5),
                k: 2,
                seconds: 1.75,
            },
        }
    }

    /// The bytes of one row as the CSV writer writes it.
    fn csv_line<R: CsvRecord>(row: &R) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.csv");
        CsvLog::<R>::open(path.clone())
            .unwrap()
            .append(row)
            .unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        text.split_once('\n').unwrap().1.to_owned()
    }

    #[test]
    fn a_trained_line_is_what_the_learner_always_wrote() {
        // The writer before the typed record: a `json!` map (sorted keys),
        // with the tasks recorded since.
        let t = trained(3, &["a", "b"]);
        let before = serde_json::json!({
            "step": t.step,
            "tasks": t.tasks,
            "trained_at_version": t.trained_at_version,
            "published_version": t.published_version,
            "min_token_version": t.min_token_version,
            "max_version_lag": t.max_version_lag,
            "trajectories": t.trajectories,
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(TRAINED_JSONL);
        TrainedLog::open(path.clone()).unwrap().append(&t).unwrap();
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            format!("{before}\n")
        );
    }

    #[test]
    fn a_trained_line_without_tasks_still_reads() {
        let old = r#"{"max_version_lag":1.5,"min_token_version":1,"published_version":3,"step":3,"trained_at_version":2,"trajectories":["a","b"]}"#;
        let t: TrainedStep = serde_json::from_str(old).unwrap();
        assert!(t.tasks.is_empty());
        assert_eq!(t.trajectories, ["a", "b"]);
    }

    #[test]
    fn csv_rows_are_what_the_learner_always_wrote() {
        // The format strings of the writers before the typed records.
        let m = metrics(7);
        let before = format!(
            "{},{},{:.3},{:.6},{},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:.6},{:e},{},{},{:.4},{},{:.4},{:.4},{:.4},{},{},{:e},{:e},{:e}\n",
            m.step,
            m.version,
            m.wall_seconds,
            m.reward_mean,
            m.reward_failed,
            m.loss,
            m.clip_low,
            m.clip_high,
            m.weight_masked,
            m.m2po_masked,
            m.approx_kl,
            m.entropy,
            m.grad_norm,
            m.learning_rate,
            m.tokens,
            m.groups,
            m.version_lag_mean,
            m.version_lag_max,
            m.wait_seconds,
            m.compute_seconds,
            m.publish_seconds,
            m.padded_tokens,
            m.logprob_gap_tokens,
            m.logprob_gap_mean,
            m.logprob_gap_max,
            m.logprob_kl
        );
        assert_eq!(csv_line(&m), before);
        assert_eq!(
            before,
            "7,7,12.500,0.250000,1,-0.125000,0.500000,0.000000,0.062500,0.000000,0.001000,2.500000,3.000000,1e-6,640,4,0.7500,2,0.5000,1.2500,0.1250,1024,640,0e0,3.5e-7,1e-9\n"
        );
        assert_eq!(
            csv_line(&eval(5, None)),
            "5,5,3.500,32,,0.250000,0.500000,2,1.750\n"
        );
        assert_eq!(
            csv_line(&eval(5, Some(1.0 / 3.0))),
            "5,5,3.500,32,0.333333,0.250000,0.500000,2,1.750\n"
        );
    }

    #[test]
    fn the_columns_are_the_serialised_fields() {
        fn header<R: CsvRecord>(row: &R) -> String {
            let mut w = csv::Writer::from_writer(Vec::new());
            w.serialize(row).unwrap();
            let text = String::from_utf8(w.into_inner().unwrap()).unwrap();
            text.lines().next().unwrap().to_owned()
        }
        assert_eq!(header(&metrics(1)), MetricsRow::COLUMNS.join(","));
        assert_eq!(header(&eval(1, None)), EvalRow::COLUMNS.join(","));
        assert_eq!(
            EvalRow::COLUMNS.join(","),
            "version,step,wall_seconds,problems,greedy_accuracy,sampled_accuracy,pass_at_k,k,eval_seconds"
        );
    }

    #[test]
    fn readers_read_what_the_writers_wrote_and_ignore_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();

        let path = dir.path().join(TRAINED_JSONL);
        let mut log = TrainedLog::open(path.clone()).unwrap();
        let lines = [
            trained(1, &["a"]),
            trained(2, &["b", "c"]),
            trained(2, &["b", "c"]),
        ];
        for t in &lines {
            log.append(t).unwrap();
        }
        drop(log);
        append(&path, "{\"max_version_lag\":0.0,\"min_tok");
        assert_eq!(read_trained(&path).unwrap(), lines);
        // Reopened, the torn tail is cut off and the next line is whole.
        TrainedLog::open(path.clone())
            .unwrap()
            .append(&trained(3, &["d"]))
            .unwrap();
        let read = read_trained(&path).unwrap();
        assert_eq!(read.len(), 4);
        assert_eq!(read[3], trained(3, &["d"]));

        let path = dir.path().join("sub").join(METRICS_CSV);
        let mut csv = CsvLog::open(path.clone()).unwrap();
        csv.append(&metrics(1)).unwrap();
        csv.append(&metrics(2)).unwrap();
        drop(csv);
        append(&path, "3,3,1.0");
        assert_eq!(read_metrics(&path).unwrap(), vec![metrics(1), metrics(2)]);
        // A resumed learner appends, without a second header.
        CsvLog::open(path.clone())
            .unwrap()
            .append(&metrics(3))
            .unwrap();
        assert_eq!(
            read_metrics(&path).unwrap(),
            vec![metrics(1), metrics(2), metrics(3)]
        );
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 4, "{text}");

        let path = dir.path().join(EVAL_CSV);
        let rows = [eval(0, Some(0.5)), eval(5, None)];
        let mut csv = CsvLog::open(path.clone()).unwrap();
        for r in &rows {
            csv.append(r).unwrap();
        }
        assert_eq!(read_eval(&path).unwrap(), rows);

        // A header alone is no row; a torn header is no header.
        let path = dir.path().join("empty.csv");
        drop(CsvLog::<EvalRow>::open(path.clone()).unwrap());
        assert_eq!(read_eval(&path).unwrap(), vec![]);
        std::fs::write(&path, "version,st").unwrap();
        assert_eq!(read_eval(&path).unwrap(), vec![]);
        CsvLog::open(path.clone())
            .unwrap()
            .append(&rows[0])
            .unwrap();
        assert_eq!(read_eval(&path).unwrap(), vec![rows[0].clone()]);
    }

    #[test]
    fn what_is_not_a_record_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.jsonl");
        let e = format!("{:#}", read_trained(&missing).unwrap_err());
        assert!(e.contains("cannot read") && e.contains("none.jsonl"), "{e}");

        let path = dir.path().join(TRAINED_JSONL);
        let good = serde_json::to_string(&trained(1, &["a"])).unwrap();
        std::fs::write(&path, format!("{good}\n\n{{\"step\":2}}\n")).unwrap();
        let e = format!("{:#}", read_trained(&path).unwrap_err());
        assert!(e.contains("line 3"), "{e}");

        // Rows under another header are refused by the reader and the writer.
        let path = dir.path().join(METRICS_CSV);
        std::fs::write(&path, "step,version\n1,1\n").unwrap();
        let e = format!("{:#}", read_metrics(&path).unwrap_err());
        assert!(e.contains("has the columns"), "{e}");
        let Err(e) = CsvLog::<MetricsRow>::open(path) else {
            panic!("a CSV with another header is opened for appending");
        };
        let e = format!("{e:#}");
        assert!(e.contains("another version"), "{e}");

        let path = dir.path().join(EVAL_CSV);
        let header = EvalRow::COLUMNS.join(",");
        std::fs::write(&path, format!("{header}\n0,0,1.0,32,x,,,2,1.0\n")).unwrap();
        let e = format!("{:#}", read_eval(&path).unwrap_err());
        assert!(e.contains("bad row") && e.contains("line: 2"), "{e}");
    }

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }
}
