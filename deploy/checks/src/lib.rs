//! Helpers of the deployment tests (`deploy/checks/tests/`): rendering the
//! kustomize overlays, reading the metric names the code registers, pulling
//! metric selectors out of PromQL, reading a Dockerfile's `COPY` sources, and
//! finding the tools (`kubectl`, `kubernetes-validate`, `promtool`,
//! `prometheus`).
//!
//! Everything here is plain parsing; the tests decide what must hold.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

pub mod promql;

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("deploy/checks lies two levels below the repository root")
        .to_path_buf()
}

/// `deploy/k8s` in the repository.
pub fn k8s_dir() -> PathBuf {
    repo_root().join("deploy/k8s")
}

/// Every overlay under `deploy/k8s/overlays` (a folder with a
/// kustomization.yaml), sorted by name.
pub fn overlays() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(k8s_dir().join("overlays"))
        .expect("deploy/k8s/overlays exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("kustomization.yaml").is_file())
        .collect();
    out.sort();
    out
}

/// A tool from the project's `.venv/bin` if it is there, else from `PATH`.
pub fn tool(name: &str) -> Option<PathBuf> {
    let venv = repo_root().join(".venv/bin").join(name);
    if venv.is_file() {
        return Some(venv);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Like [`tool`], but panics with what to install when the tool is missing.
pub fn require_tool(name: &str, install: &str) -> PathBuf {
    tool(name).unwrap_or_else(|| panic!("`{name}` not found in .venv/bin or PATH: {install}"))
}

/// Runs a command and returns its stdout; panics with its stderr when it fails.
pub fn run_ok(cmd: &mut Command) -> String {
    let shown = format!("{cmd:?}");
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{shown} failed ({}):\n{}\n{}",
        out.status,
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// `kubectl kustomize DIR`: the rendered YAML of an overlay.
pub fn kustomize(dir: &Path) -> String {
    let kubectl = require_tool(
        "kubectl",
        "install kubectl (its built-in kustomize v5 renders the overlays)",
    );
    run_ok(Command::new(kubectl).arg("kustomize").arg(dir))
}

/// The documents of a multi-document YAML stream, as JSON values (empty
/// documents left out).
pub fn yaml_docs(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| {
            let v: serde_yaml::Value =
                serde::Deserialize::deserialize(doc).expect("valid YAML document");
            serde_json::to_value(v).expect("YAML that maps to JSON")
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// One rendered overlay: its name, its objects, and the Jobs its JobSets
/// would create ([`jobset_jobs`]).
pub struct Rendered {
    pub name: String,
    pub yaml: String,
    pub objects: Vec<Value>,
    pub jobs: Vec<Value>,
}

impl Rendered {
    pub fn of(overlay: &Path) -> Self {
        let yaml = kustomize(overlay);
        let objects = yaml_docs(&yaml);
        let jobs = objects
            .iter()
            .filter(|o| o["kind"] == "JobSet")
            .flat_map(jobset_jobs)
            .collect();
        Self {
            name: overlay
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            yaml,
            objects,
            jobs,
        }
    }

    /// The Job of a JobSet's replicatedJob `name` (see [`jobset_jobs`]).
    pub fn job(&self, name: &str) -> Option<&Value> {
        self.jobs.iter().find(|j| j["metadata"]["name"] == name)
    }

    /// Every object of `kind`.
    pub fn of_kind<'a>(&'a self, kind: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
        self.objects.iter().filter(move |o| o["kind"] == kind)
    }

    /// The one object of `kind` named `name`; panics when there is none.
    pub fn get(&self, kind: &str, name: &str) -> &Value {
        self.find(kind, name)
            .unwrap_or_else(|| panic!("overlay {}: no {kind} named {name}", self.name))
    }

    pub fn find(&self, kind: &str, name: &str) -> Option<&Value> {
        self.objects
            .iter()
            .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
    }

    /// The workloads: Deployments, StatefulSets, and the Jobs of JobSets
    /// (each with its pod template at `spec.template`).
    pub fn workloads(&self) -> impl Iterator<Item = &Value> {
        self.objects
            .iter()
            .filter(|o| o["kind"] == "Deployment" || o["kind"] == "StatefulSet")
            .chain(self.jobs.iter())
    }

    /// The data of the ConfigMap whose name starts with `prefix` (kustomize
    /// appends a content hash to generated names).
    pub fn config_map_data(&self, prefix: &str, key: &str) -> String {
        self.of_kind("ConfigMap")
            .find(|o| {
                o["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n == prefix || n.starts_with(&format!("{prefix}-")))
            })
            .and_then(|o| o["data"][key].as_str())
            .unwrap_or_else(|| {
                panic!(
                    "overlay {}: no ConfigMap {prefix} with key {key}",
                    self.name
                )
            })
            .to_owned()
    }
}

/// The Jobs a JobSet (`jobset.x-k8s.io/v1alpha2`) creates from its
/// replicatedJobs, one `batch/v1` Job per replicatedJob: its Job template,
/// in the JobSet's namespace, named after the replicatedJob (the controller
/// names them `<jobset>-<replicatedJob>-<index>`, `replicas` of each).
/// kubernetes-validate has a schema for these, not for the JobSet.
pub fn jobset_jobs(jobset: &Value) -> Vec<Value> {
    let namespace = &jobset["metadata"]["namespace"];
    jobset["spec"]["replicatedJobs"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|rj| {
            let template = &rj["template"];
            let mut metadata = template["metadata"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            metadata.insert("name".into(), rj["name"].clone());
            if !namespace.is_null() {
                metadata.insert("namespace".into(), namespace.clone());
            }
            serde_json::json!({
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": metadata,
                "spec": template["spec"],
            })
        })
        .collect()
}

/// The containers of a workload's pod template (init containers first).
pub fn containers(workload: &Value) -> Vec<&Value> {
    let spec = &workload["spec"]["template"]["spec"];
    ["initContainers", "containers"]
        .iter()
        .filter_map(|k| spec[*k].as_array())
        .flatten()
        .collect()
}

/// Whether a label selector (`matchLabels` and `matchExpressions`) selects
/// the labels `labels`.
pub fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |k: &str| labels.get(k).and_then(Value::as_str);
    if let Some(m) = selector["matchLabels"].as_object()
        && !m.iter().all(|(k, v)| label(k) == v.as_str())
    {
        return false;
    }
    if let Some(exprs) = selector["matchExpressions"].as_array() {
        for e in exprs {
            let key = e["key"].as_str().unwrap_or_default();
            let values: Vec<&str> = e["values"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let ok = match e["operator"].as_str().unwrap_or_default() {
                "In" => label(key).is_some_and(|v| values.contains(&v)),
                "NotIn" => label(key).is_none_or(|v| !values.contains(&v)),
                "Exists" => label(key).is_some(),
                "DoesNotExist" => label(key).is_none(),
                _ => false,
            };
            if !ok {
                return false;
            }
        }
    }
    true
}

/// The type of a registered metric, which decides the sample names it
/// exposes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
    Info,
}

/// A metric the code registers: its family name as exposed (prefix and unit
/// applied, `asyncrl_learner_step_phase_seconds`), its kind and where.
#[derive(Debug, Clone)]
pub struct Registered {
    pub family: String,
    pub kind: MetricKind,
    pub file: PathBuf,
}

impl Registered {
    /// The sample names a scrape shows for this metric.
    pub fn sample_names(&self) -> Vec<String> {
        let f = &self.family;
        match self.kind {
            MetricKind::Counter => vec![format!("{f}_total")],
            MetricKind::Gauge => vec![f.clone()],
            MetricKind::Histogram => ["_bucket", "_sum", "_count"]
                .iter()
                .map(|s| format!("{f}{s}"))
                .collect(),
            MetricKind::Info => vec![format!("{f}_info")],
        }
    }
}

/// The metrics the workspace's code registers, read from its source.
///
/// Every registration goes through `asyncrl_telemetry::Metrics`
/// (`register`, `get_or_register`, `register_with_unit`, `register_info`)
/// or a `Registry::register` handed out by it, always with the name as a
/// string literal first argument; the registry adds the `asyncrl_` prefix.
/// The kind comes from the metric expression, or from the type of the
/// struct field it is assigned to. Test modules are left out.
///
/// Returns the metrics by family name, and the registrations whose kind
/// could not be read (which a test reports: the parser must not guess).
pub fn registered_metrics(root: &Path) -> (BTreeMap<String, Registered>, Vec<String>) {
    let call = regex::Regex::new(
        r#"(?:(\w+)\s*:\s*)?[\w.]*\.(register|get_or_register|register_with_unit|register_info)\(\s*"([A-Za-z_:][A-Za-z0-9_:]*)""#,
    )
    .expect("valid regex");
    let unit_re = regex::Regex::new(r"Unit::(\w+)").expect("valid regex");
    let self_field = regex::Regex::new(r"self\.(\w+)").expect("valid regex");
    let mut found = BTreeMap::new();
    let mut unknown = Vec::new();
    for file in source_files(root) {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let text = without_comment_lines(without_test_module(&text));
        let text = text.as_str();
        for cap in call.captures_iter(text) {
            let whole = cap.get(0).expect("match");
            let field = cap.get(1).map(|m| m.as_str());
            let method = &cap[2];
            let name = &cap[3];
            // The argument list: from the `(` of the call to its `)`.
            let open = whole.start() + whole.as_str().find('(').expect("call has (");
            let args = balanced_args(&text[open..]);
            let args_code = strip_string_literals(args);
            let mut family = format!("asyncrl_{name}");
            if method == "register_with_unit" {
                let unit = unit_re.captures(&args_code).map(|c| c[1].to_lowercase());
                match unit {
                    Some(u) => family = format!("{family}_{u}"),
                    None => {
                        unknown.push(format!("{}: {name} (unit)", file.display()));
                        continue;
                    }
                }
            }
            let kind = if method == "register_info" {
                Some(MetricKind::Info)
            } else {
                kind_in(&args_code).or_else(|| {
                    // `field: m.register("x", "help", Family::default())`, or
                    // `registry.register("x", "help", self.field.clone())`.
                    let field = field
                        .map(str::to_owned)
                        .or_else(|| self_field.captures(&args_code).map(|c| c[1].to_owned()))?;
                    field_types(text, &field)
                        .into_iter()
                        .find_map(|t| kind_in(&t))
                })
            };
            match kind {
                Some(kind) => {
                    found.insert(
                        family.clone(),
                        Registered {
                            family,
                            kind,
                            file: file.clone(),
                        },
                    );
                }
                None => unknown.push(format!("{}: {name}", file.display())),
            }
        }
    }
    (found, unknown)
}

/// Every sample name the registered metrics expose, with the family each
/// belongs to.
pub fn sample_names(registered: &BTreeMap<String, Registered>) -> BTreeMap<String, String> {
    registered
        .values()
        .flat_map(|r| {
            r.sample_names()
                .into_iter()
                .map(move |s| (s, r.family.clone()))
        })
        .collect()
}

/// The kind named by a piece of code (a metric constructor or a type).
fn kind_in(code: &str) -> Option<MetricKind> {
    let word = |w: &str| {
        regex::Regex::new(&format!(r"[A-Za-z0-9]*{w}\b"))
            .expect("valid regex")
            .is_match(code)
    };
    if word("Histogram") {
        Some(MetricKind::Histogram)
    } else if word("Counter") {
        Some(MetricKind::Counter)
    } else if code.contains("Gauge") {
        Some(MetricKind::Gauge)
    } else if word("Info") {
        Some(MetricKind::Info)
    } else {
        None
    }
}

/// The right-hand sides of every `pub field: Type,` (or `field: expr,`)
/// line in `text`: the struct declaration is among them.
fn field_types(text: &str, field: &str) -> Vec<String> {
    let re = regex::Regex::new(&format!(
        r"(?m)^\s*(?:pub(?:\([^)]*\))?\s+)?{field}\s*:\s*([^\n]+?),?\s*$"
    ))
    .expect("valid regex");
    re.captures_iter(text)
        .map(|c| strip_string_literals(c[1].trim()))
        .collect()
}

/// The text from an opening `(` to its matching `)`, skipping string
/// literals.
fn balanced_args(from_paren: &str) -> &str {
    let bytes = from_paren.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                i += 1;
                while i < bytes.len() && bytes[i] != b'"' {
                    if bytes[i] == b'\\' {
                        i += 1;
                    }
                    i += 1;
                }
            }
            b'(' => depth += 1,
            b')' => {
                depth -= 1;
                if depth == 0 {
                    return &from_paren[..=i];
                }
            }
            _ => {}
        }
        i += 1;
    }
    from_paren
}

/// `code` with the contents of its string literals removed (help texts may
/// name other metric kinds).
fn strip_string_literals(code: &str) -> String {
    let mut out = String::with_capacity(code.len());
    let mut chars = code.chars();
    while let Some(c) = chars.next() {
        if c == '"' {
            out.push('"');
            while let Some(c) = chars.next() {
                if c == '\\' {
                    chars.next();
                } else if c == '"' {
                    break;
                }
            }
            out.push('"');
        } else {
            out.push(c);
        }
    }
    out
}

/// The file without its `#[cfg(test)] mod ...` part (by convention the last
/// item of a file).
fn without_test_module(text: &str) -> &str {
    let re = regex::Regex::new(r"(?m)^#\[cfg\(test\)\]\s*\n\s*mod\s").expect("valid regex");
    match re.find(text) {
        Some(m) => &text[..m.start()],
        None => text,
    }
}

/// `text` without its comment lines (doc comments show registrations as
/// examples).
fn without_comment_lines(text: &str) -> String {
    text.lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The `.rs` files under `src/` of the root package and of every workspace
/// member.
pub fn source_files(root: &Path) -> Vec<PathBuf> {
    let mut dirs = vec![root.join("src")];
    dirs.extend(
        workspace_members(root)
            .into_iter()
            .map(|m| root.join(m).join("src")),
    );
    let mut files = Vec::new();
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The `[workspace] members` of the root Cargo.toml.
pub fn workspace_members(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root.join("Cargo.toml")).expect("root Cargo.toml");
    let doc: toml::Value = toml::from_str(&text).expect("root Cargo.toml parses");
    doc["workspace"]["members"]
        .as_array()
        .expect("[workspace] members")
        .iter()
        .filter_map(|m| m.as_str().map(str::to_owned))
        .collect()
}

/// One `COPY`/`ADD` instruction of a Dockerfile.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Copy {
    pub line: usize,
    /// `--from=STAGE` (then the sources are in that stage, not the context).
    pub from: Option<String>,
    pub sources: Vec<String>,
    pub dest: String,
}

/// The `COPY`/`ADD` instructions of a Dockerfile (continuation lines joined,
/// comments skipped, shell and JSON forms).
pub fn dockerfile_copies(text: &str) -> Vec<Copy> {
    let mut out = Vec::new();
    for (line, instr) in dockerfile_instructions(text) {
        let mut words = instr.split_whitespace();
        let Some(op) = words.next() else { continue };
        if !op.eq_ignore_ascii_case("COPY") && !op.eq_ignore_ascii_case("ADD") {
            continue;
        }
        let rest: Vec<&str> = words.collect();
        let mut from = None;
        let mut args: Vec<String> = Vec::new();
        let mut i = 0;
        while i < rest.len() && rest[i].starts_with("--") {
            if let Some(stage) = rest[i].strip_prefix("--from=") {
                from = Some(stage.to_owned());
            }
            i += 1;
        }
        let tail = rest[i..].join(" ");
        if tail.trim_start().starts_with('[') {
            if let Ok(Value::Array(a)) = serde_json::from_str::<Value>(&tail) {
                args = a
                    .into_iter()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect();
            }
        } else {
            args = rest[i..].iter().map(|s| (*s).to_owned()).collect();
        }
        if let Some((dest, sources)) = args.split_last() {
            out.push(Copy {
                line,
                from,
                sources: sources.to_vec(),
                dest: dest.clone(),
            });
        }
    }
    out
}

/// A Dockerfile's instructions with their first line number (1-based).
pub fn dockerfile_instructions(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') && current.is_none() {
            continue;
        }
        if trimmed.starts_with('#') {
            // A comment inside a continued instruction is dropped.
            continue;
        }
        if trimmed.is_empty() && current.is_none() {
            continue;
        }
        let (start, mut acc) = current.take().unwrap_or((i + 1, String::new()));
        if let Some(body) = trimmed.strip_suffix('\\') {
            acc.push_str(body);
            acc.push(' ');
            current = Some((start, acc));
        } else {
            acc.push_str(trimmed);
            out.push((start, acc));
        }
    }
    if let Some(last) = current {
        out.push(last);
    }
    out
}

/// The stage names of a Dockerfile (`FROM image AS name`).
pub fn dockerfile_stages(text: &str) -> Vec<String> {
    dockerfile_instructions(text)
        .into_iter()
        .filter_map(|(_, i)| {
            let w: Vec<&str> = i.split_whitespace().collect();
            (w.first()?.eq_ignore_ascii_case("FROM")
                && w.len() >= 4
                && w[w.len() - 2].eq_ignore_ascii_case("AS"))
            .then(|| w[w.len() - 1].to_owned())
        })
        .collect()
}

/// Reads a plain (non-streaming) HTTP/1.0 response of `GET path` from
/// `addr` and returns (status code, body).
pub fn http_get(addr: &str, path: &str) -> std::io::Result<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other("response without a header end"))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line: {head}")))?;
    Ok((status, body.to_owned()))
}

/// Percent-encodes a query parameter value.
pub fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Kubernetes quantity (`4Gi`) or a nats.conf size (`3GB`) in bytes.
pub fn quantity_bytes(q: &str) -> u64 {
    let q = q.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().unwrap_or_else(|_| panic!("size {q:?}"));
    let m: u64 = match unit.trim() {
        "" => 1,
        "Ki" | "KiB" => 1 << 10,
        "Mi" | "MiB" => 1 << 20,
        "Gi" | "GiB" => 1 << 30,
        "Ti" => 1 << 40,
        "K" | "KB" | "k" => 1_000,
        "M" | "MB" => 1_000_000,
        "G" | "GB" => 1_000_000_000,
        "T" | "TB" => 1_000_000_000_000,
        other => panic!("unit {other:?} in {q:?}"),
    };
    n * m
}

/// `key: value` of a nats.conf (top level or inside a block; comments cut).
pub fn nats_conf_value(conf: &str, key: &str) -> Option<String> {
    conf.lines()
        .map(|l| l.split('#').next().unwrap_or_default().trim())
        .find_map(|l| {
            l.strip_prefix(key)
                .and_then(|rest| rest.trim_start().strip_prefix(':'))
                .map(|v| v.trim().to_owned())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dockerfile_copies_are_read() {
        let text = "FROM a AS build\n# COPY nothing\nCOPY --chown=1:1 a b \\\n  c/ /dst/\nCOPY --from=build /x /y\nADD [\"j k\", \"/z\"]\nFROM b AS run\n";
        let c = dockerfile_copies(text);
        assert_eq!(c.len(), 3);
        assert_eq!(c[0].sources, vec!["a", "b", "c/"]);
        assert_eq!(c[0].dest, "/dst/");
        assert_eq!(c[0].line, 3);
        assert_eq!(c[1].from.as_deref(), Some("build"));
        assert_eq!(c[2].sources, vec!["j k"]);
        assert_eq!(dockerfile_stages(text), vec!["build", "run"]);
    }

    #[test]
    fn a_jobset_yields_one_job_per_replicated_job() {
        let js = serde_json::json!({
            "kind": "JobSet",
            "metadata": {"name": "g", "namespace": "ns"},
            "spec": {"replicatedJobs": [
                {"name": "a", "replicas": 1, "template": {"spec": {"completions": 1, "template": {"spec": {"containers": [{"name": "c"}]}}}}},
                {"name": "b", "replicas": 1, "template": {"metadata": {"labels": {"x": "y"}}, "spec": {"completions": 3}}}
            ]}
        });
        let jobs = jobset_jobs(&js);
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[0]["apiVersion"], "batch/v1");
        assert_eq!(jobs[0]["kind"], "Job");
        assert_eq!(jobs[0]["metadata"]["name"], "a");
        assert_eq!(jobs[0]["metadata"]["namespace"], "ns");
        assert_eq!(containers(&jobs[0])[0]["name"], "c");
        assert_eq!(jobs[1]["metadata"]["labels"]["x"], "y");
        assert_eq!(jobs[1]["spec"]["completions"], 3);
    }

    #[test]
    fn selectors_match_labels() {
        let labels = serde_json::json!({"app": "x", "tier": "a"});
        assert!(selects(
            &serde_json::json!({"matchLabels": {"app": "x"}}),
            &labels
        ));
        assert!(!selects(
            &serde_json::json!({"matchLabels": {"app": "y"}}),
            &labels
        ));
        assert!(selects(
            &serde_json::json!({"matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}]}),
            &labels
        ));
        assert!(!selects(
            &serde_json::json!({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}),
            &labels
        ));
    }

    #[test]
    fn kinds_come_from_constructors_and_field_types() {
        let src = r#"
pub struct M {
    pub a: Family<L, Counter>,
    pub b: GaugeF,
    pub c: Histogram,
}
fn r(m: &Metrics) { M {
    a: m.register("aa", "Counts (a Histogram in words)", Family::default())?,
    b: m.get_or_register("bb", "x", GaugeF::default)?,
    c: m.register_with_unit("cc", "y", Unit::Seconds, seconds)?,
}; m.register_info("build", "z", vec![]); }
"#;
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("src")).unwrap();
        std::fs::write(dir.path().join("Cargo.toml"), "[workspace]\nmembers = []\n").unwrap();
        std::fs::write(dir.path().join("src/m.rs"), src).unwrap();
        let (found, unknown) = registered_metrics(dir.path());
        assert!(unknown.is_empty(), "{unknown:?}");
        assert_eq!(found["asyncrl_aa"].kind, MetricKind::Counter);
        assert_eq!(found["asyncrl_bb"].kind, MetricKind::Gauge);
        assert_eq!(found["asyncrl_cc_seconds"].kind, MetricKind::Histogram);
        assert_eq!(found["asyncrl_build"].kind, MetricKind::Info);
        assert_eq!(
            found["asyncrl_aa"].sample_names(),
            vec!["asyncrl_aa_total".to_owned()]
        );
    }
}
