//! Alerts and dashboard against the code: every metric they query is one the
//! roles register (read from the source), every label value they filter on
//! is one the code writes, `promtool check rules` accepts the rules and
//! every dashboard query, and `promtool test rules` shows the alerts fire
//! (and stay quiet) as meant.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;

use asyncrl_deploy_checks::promql::{Selector, selectors};
use asyncrl_deploy_checks::{
    MetricKind, k8s_dir, registered_metrics, repo_root, require_tool, run_ok, sample_names,
    source_files,
};
use serde_json::Value;

/// Series that are not asyncrl's but that the alerts and the dashboard may
/// use: Prometheus' own `up` and kube-state-metrics' Deployment replicas.
const EXTERNAL_METRICS: &[&str] = &[
    "up",
    "kube_deployment_spec_replicas",
    "kube_deployment_status_replicas_available",
];

/// Labels added by the scrape (Prometheus operator, our relabelling) or by
/// histograms, not by the code.
const TARGET_LABELS: &[&str] = &[
    "namespace",
    "pod",
    "job",
    "instance",
    "role",
    "container",
    "endpoint",
    "service",
    "le",
    "deployment",
];

fn monitoring_dir() -> PathBuf {
    k8s_dir().join("components/monitoring")
}

/// The `spec` of the PrometheusRule: a plain Prometheus rules file.
fn rules_file() -> String {
    let text = std::fs::read_to_string(monitoring_dir().join("prometheusrule.yaml")).unwrap();
    let rule: Value = serde_yaml::from_str(&text).unwrap();
    assert_eq!(rule["kind"], "PrometheusRule");
    assert_eq!(rule["apiVersion"], "monitoring.coreos.com/v1");
    serde_yaml::to_string(&rule["spec"]).unwrap()
}

fn alert_rules() -> Vec<Value> {
    let spec: Value = serde_yaml::from_str(&rules_file()).unwrap();
    spec["groups"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn dashboard() -> Value {
    let text = std::fs::read_to_string(monitoring_dir().join("dashboards/asyncrl.json")).unwrap();
    serde_json::from_str(&text).expect("the dashboard is JSON")
}

/// Every panel, rows' nested panels included.
fn panels(d: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for p in d["panels"].as_array().unwrap() {
        out.push(p.clone());
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner.iter().cloned());
        }
    }
    out
}

/// (panel title, expr) of every dashboard query.
fn dashboard_queries(d: &Value) -> Vec<(String, String)> {
    panels(d)
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .into_iter()
                .filter_map(move |t| t["expr"].as_str().map(|e| (title.clone(), e.to_owned())))
        })
        .collect()
}

/// A dashboard query with Grafana's variables replaced, as Prometheus gets it.
fn substitute_grafana_variables(expr: &str) -> String {
    expr.replace("$__rate_interval", "1m")
        .replace("$__interval", "1m")
        .replace("$__range", "1h")
        .replace("$namespace", "asyncrl")
}

/// The string literals of the workspace's source, and the field names of
/// its structs: what label names and values the code can produce.
fn source_words() -> BTreeSet<String> {
    let lit = regex::Regex::new(r#""([A-Za-z_][A-Za-z0-9_]*)""#).unwrap();
    let field = regex::Regex::new(r"pub\s+([a-z_][a-z0-9_]*)\s*:").unwrap();
    let mut words = BTreeSet::new();
    for f in source_files(&repo_root()) {
        let text = std::fs::read_to_string(f).unwrap_or_default();
        words.extend(lit.captures_iter(&text).map(|c| c[1].to_owned()));
        words.extend(field.captures_iter(&text).map(|c| c[1].to_owned()));
    }
    words
}

/// Checks the selectors of one expression against what the code exports.
fn check_selectors(
    what: &str,
    expr: &str,
    samples: &BTreeMap<String, String>,
    words: &BTreeSet<String>,
    problems: &mut Vec<String>,
) -> Vec<Selector> {
    let sel = match selectors(expr) {
        Ok(s) => s,
        Err(e) => {
            problems.push(format!("{what}: {e}"));
            return Vec::new();
        }
    };
    if sel.is_empty() {
        problems.push(format!("{what}: queries no metric: {expr}"));
    }
    for s in &sel {
        let known =
            samples.contains_key(&s.metric) || EXTERNAL_METRICS.contains(&s.metric.as_str());
        if !known {
            problems.push(format!(
                "{what}: `{}` is not a metric the roles export (nor an allowed external one)",
                s.metric
            ));
            continue;
        }
        if !s.metric.starts_with("asyncrl_") {
            continue;
        }
        for m in &s.matchers {
            if TARGET_LABELS.contains(&m.label.as_str()) {
                continue;
            }
            if !words.contains(&m.label) {
                problems.push(format!(
                    "{what}: label `{}` of {} appears nowhere in the code",
                    m.label, s.metric
                ));
            }
            if m.op == "=" && !words.contains(&m.value) {
                problems.push(format!(
                    "{what}: {}{{{}=\"{}\"}}: the code never writes that value",
                    s.metric, m.label, m.value
                ));
            }
        }
    }
    sel
}

fn registered_samples() -> BTreeMap<String, String> {
    let (found, unknown) = registered_metrics(&repo_root());
    assert!(
        unknown.is_empty(),
        "registrations whose metric kind the parser cannot read: {unknown:?}"
    );
    sample_names(&found)
}

#[test]
fn the_source_parser_finds_the_roles_metrics_with_their_kinds() {
    let (found, unknown) = registered_metrics(&repo_root());
    assert!(unknown.is_empty(), "{unknown:?}");
    for (family, kind) in [
        ("asyncrl_policy_version", MetricKind::Gauge),
        ("asyncrl_capacity_left", MetricKind::Gauge),
        ("asyncrl_rollout_workers_recommended", MetricKind::Gauge),
        ("asyncrl_stale_dropped", MetricKind::Counter),
        ("asyncrl_worker_heartbeat_age_seconds", MetricKind::Gauge),
        ("asyncrl_workers", MetricKind::Gauge),
        ("asyncrl_buffer_dead_lettered", MetricKind::Counter),
        (
            "asyncrl_buffer_served_token_staleness",
            MetricKind::Histogram,
        ),
        ("asyncrl_learner_step_phase_seconds", MetricKind::Histogram),
        ("asyncrl_learner_token_version_lag", MetricKind::Histogram),
        ("asyncrl_worker_weight_fetch_failures", MetricKind::Counter),
        ("asyncrl_worker_tokens_generated", MetricKind::Counter),
        ("asyncrl_transport_events", MetricKind::Counter),
    ] {
        let r = found
            .get(family)
            .unwrap_or_else(|| panic!("{family} not found in the source"));
        assert_eq!(r.kind, kind, "{family} ({})", r.file.display());
    }
    // One file per role at least.
    for dir in [
        "coordinator",
        "buffer",
        "learner",
        "rollout-worker",
        "transport",
    ] {
        assert!(
            found
                .values()
                .any(|r| r.file.starts_with(repo_root().join(dir))),
            "no metric found in {dir}/"
        );
    }
}

#[test]
fn alerts_query_only_exported_metrics_and_say_what_to_do() {
    let samples = registered_samples();
    let words = source_words();
    let mut problems = Vec::new();
    let rules = alert_rules();
    let mut names = BTreeSet::new();
    for r in &rules {
        let name = r["alert"].as_str().expect("alerting rules only").to_owned();
        assert!(names.insert(name.clone()), "alert {name} twice");
        let expr = r["expr"].as_str().unwrap();
        check_selectors(
            &format!("alert {name}"),
            expr,
            &samples,
            &words,
            &mut problems,
        );
        let sev = r["labels"]["severity"].as_str().unwrap_or_default();
        if !["critical", "warning", "info"].contains(&sev) {
            problems.push(format!("alert {name}: severity {sev:?}"));
        }
        for a in ["summary", "description", "runbook"] {
            if !r["annotations"][a].is_string() {
                problems.push(format!("alert {name}: no {a} annotation"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // What issue #8 asks the alerts to cover, by the metric each needs.
    let all_exprs: String = rules
        .iter()
        .map(|r| r["expr"].as_str().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n");
    for (what, metric) in [
        ("learner idle too long", "asyncrl_learner_step"),
        (
            "learner waiting for batches",
            "asyncrl_learner_step_phase_seconds_sum",
        ),
        ("staleness near η", "asyncrl_learner_version_lag_mean"),
        ("stale_dropped_total rising", "asyncrl_stale_dropped_total"),
        (
            "weight fetch failures",
            "asyncrl_worker_weight_fetch_failures_total",
        ),
        ("no heartbeats", "asyncrl_worker_heartbeat_age_seconds"),
        ("dead-letter rate", "asyncrl_buffer_dead_lettered_total"),
    ] {
        assert!(all_exprs.contains(metric), "no alert on {what} ({metric})");
    }
}

#[test]
fn promtool_checks_and_unit_tests_the_rules() {
    let promtool = require_tool(
        "promtool",
        "install Debian's prometheus package (scripts/setup does)",
    );
    let dir = tempfile::tempdir().unwrap();
    // The unit tests name the rules file asyncrl-rules.yaml.
    let rules = dir.path().join("asyncrl-rules.yaml");
    std::fs::write(&rules, rules_file()).unwrap();
    let out = run_ok(Command::new(&promtool).args(["check", "rules"]).arg(&rules));
    assert!(out.contains("SUCCESS"), "{out}");
    let tests = dir.path().join("alerts-test.yaml");
    std::fs::copy(monitoring_dir().join("alerts-test.yaml"), &tests).unwrap();
    run_ok(Command::new(&promtool).args(["test", "rules"]).arg(&tests));
    // Every alert has at least one unit test.
    let text = std::fs::read_to_string(&tests).unwrap();
    for r in alert_rules() {
        let name = r["alert"].as_str().unwrap();
        assert!(
            text.contains(&format!("alertname: {name}")),
            "alerts-test.yaml does not test {name}"
        );
    }
}

#[test]
fn dashboard_queries_only_exported_metrics() {
    let samples = registered_samples();
    let words = source_words();
    let d = dashboard();
    let mut problems = Vec::new();
    let queries = dashboard_queries(&d);
    assert!(queries.len() >= 20, "only {} queries", queries.len());
    let mut used = BTreeSet::new();
    for (title, expr) in &queries {
        for s in check_selectors(
            &format!("panel {title:?}"),
            expr,
            &samples,
            &words,
            &mut problems,
        ) {
            used.insert(s.metric);
        }
    }
    // Template variables: label_values(metric, label).
    let lv = regex::Regex::new(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)").unwrap();
    for v in d["templating"]["list"].as_array().unwrap() {
        let q = v["query"]["query"]
            .as_str()
            .or_else(|| v["query"].as_str())
            .unwrap_or_default();
        if v["type"] == "query" {
            let m = lv
                .captures(q)
                .unwrap_or_else(|| panic!("variable {}: {q}", v["name"]))[1]
                .to_owned();
            if !samples.contains_key(&m) {
                problems.push(format!("variable {}: {m} is not exported", v["name"]));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    // What issue #8 asks the dashboard to show.
    for (what, metric) in [
        ("throughput", "asyncrl_worker_tokens_generated_total"),
        ("throughput", "asyncrl_learner_tokens_total"),
        (
            "staleness histogram",
            "asyncrl_buffer_served_token_staleness_bucket",
        ),
        ("version lag", "asyncrl_learner_version_lag_mean"),
        ("buffer depth", "asyncrl_buffer_ready_groups"),
        (
            "learner step split",
            "asyncrl_learner_step_phase_seconds_sum",
        ),
        ("recommended workers", "asyncrl_rollout_workers_recommended"),
        ("actual workers", "asyncrl_workers"),
    ] {
        assert!(
            used.contains(metric),
            "the dashboard does not show {what} ({metric})"
        );
    }
}

#[test]
fn dashboard_is_well_formed_and_every_query_parses() {
    let d = dashboard();
    assert_eq!(d["uid"], "asyncrl-run");
    assert!(d["schemaVersion"].as_u64().unwrap() >= 36);
    let vars: Vec<&str> = d["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(vars, ["datasource", "namespace"]);
    let mut ids = BTreeSet::new();
    let mut cells: BTreeSet<(u64, u64)> = BTreeSet::new();
    for p in panels(&d) {
        let title = p["title"].as_str().unwrap_or_default().to_owned();
        assert!(
            ids.insert(p["id"].as_u64().unwrap()),
            "panel id twice: {title}"
        );
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24, "panel {title} is wider than the grid");
        for cx in x..x + w {
            for cy in y..y + h {
                assert!(
                    cells.insert((cx, cy)),
                    "panel {title} overlaps another at {cx},{cy}"
                );
            }
        }
        if p["type"] == "row" {
            continue;
        }
        assert!(
            p["description"].is_string(),
            "panel {title} has no description"
        );
        assert_eq!(p["datasource"]["uid"], "${datasource}", "panel {title}");
        for t in p["targets"].as_array().unwrap() {
            let expr = t["expr"].as_str().unwrap();
            assert!(
                !expr.contains('$') || expr.contains("namespace=\"$namespace\""),
                "panel {title}: variables other than $namespace and Grafana's: {expr}"
            );
            if expr.contains("asyncrl_") {
                assert!(
                    expr.contains("namespace=\"$namespace\""),
                    "panel {title}: not limited to the selected namespace: {expr}"
                );
            }
        }
    }
    // promtool parses every query (Grafana variables substituted) as a
    // recording rule.
    let promtool = require_tool("promtool", "install Debian's prometheus package");
    let rules: Vec<Value> = dashboard_queries(&d)
        .iter()
        .enumerate()
        .map(|(i, (_, e))| {
            serde_json::json!({"record": format!("dashboard:query_{i}"), "expr": substitute_grafana_variables(e)})
        })
        .collect();
    let file = serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]});
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("dashboard-queries.yaml");
    std::fs::write(&path, serde_yaml::to_string(&file).unwrap()).unwrap();
    run_ok(Command::new(promtool).args(["check", "rules"]).arg(&path));
}
