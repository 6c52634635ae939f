//! Exposition formats.
//!
//! prometheus-client writes OpenMetrics 1.0. Prometheus itself asks for that
//! format, but `promtool check metrics`, many scrapers and people with curl
//! read the older Prometheus text format 0.0.4, which differs for a few
//! metric types. [`openmetrics_to_prometheus_text`] converts.

use std::collections::HashMap;

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const PROMETHEUS_TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Converts OpenMetrics text to the Prometheus text format 0.0.4:
///
/// - a counter family `x` (samples `x_total`) becomes family `x_total`, and
///   its `x_created` samples are dropped;
/// - an info family `x` (samples `x_info`) becomes the gauge `x_info`;
/// - a stateset becomes a gauge, `unknown` becomes `untyped`, and the
///   OpenMetrics-only gauge histogram and its samples are dropped;
/// - `# UNIT` lines, `# EOF` and exemplars are dropped.
pub fn openmetrics_to_prometheus_text(openmetrics: &str) -> String {
    // Pass 1: the type of every family.
    let mut types: HashMap<&str, &str> = HashMap::new();
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some((name, ty)) = rest.split_once(' ')
        {
            types.insert(name, ty.trim());
        }
    }
    let renamed = |family: &str| -> (String, Option<&'static str>) {
        match types.get(family).copied() {
            Some("counter") => (format!("{family}_total"), Some("counter")),
            Some("info") => (format!("{family}_info"), Some("gauge")),
            Some("stateset") => (family.to_owned(), Some("gauge")),
            Some("unknown") => (family.to_owned(), Some("untyped")),
            Some("gaugehistogram") => (family.to_owned(), None),
            Some("gauge") => (family.to_owned(), Some("gauge")),
            Some("histogram") => (family.to_owned(), Some("histogram")),
            Some("summary") => (family.to_owned(), Some("summary")),
            _ => (family.to_owned(), Some("untyped")),
        }
    };

    // Pass 2: rewrite, tracking the family the sample lines belong to.
    let mut out = String::with_capacity(openmetrics.len());
    let mut current: Option<&str> = None;
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (family, help) = rest.split_once(' ').unwrap_or((rest, ""));
            current = Some(family);
            let (name, ty) = renamed(family);
            if ty.is_some() {
                out.push_str(&format!("# HELP {name} {}\n", escape_help_004(help)));
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let family = rest.split_once(' ').map_or(rest, |(f, _)| f);
            current = Some(family);
            let (name, ty) = renamed(family);
            if let Some(ty) = ty {
                out.push_str(&format!("# TYPE {name} {ty}\n"));
            }
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let family_type = current.and_then(|f| types.get(f).copied());
        match family_type {
            Some("gaugehistogram") => continue,
            Some("counter") => {
                let sample = sample_name(line);
                if current.is_some_and(|f| sample == format!("{f}_created")) {
                    continue;
                }
            }
            _ => {}
        }
        out.push_str(strip_exemplar(line));
        out.push('\n');
    }
    out
}

/// The metric name at the start of a sample line.
fn sample_name(line: &str) -> &str {
    let end = line.find(['{', ' ']).unwrap_or(line.len());
    &line[..end]
}

/// A sample line without its exemplar (` # {labels} value [ts]`), which only
/// OpenMetrics allows. Quoted label values may hold `#`, `}` or spaces.
fn strip_exemplar(line: &str) -> &str {
    let bytes = line.as_bytes();
    let mut i = sample_name(line).len();
    if bytes.get(i) == Some(&b'{') {
        let mut in_quotes = false;
        let mut escaped = false;
        i += 1;
        while i < bytes.len() {
            let b = bytes[i];
            if escaped {
                escaped = false;
            } else if in_quotes && b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_quotes = !in_quotes;
            } else if b == b'}' && !in_quotes {
                break;
            }
            i += 1;
        }
    }
    match line[i..].find(" # ") {
        Some(pos) => &line[..i + pos],
        None => line,
    }
}

/// HELP text in 0.0.4 escapes only `\` and newline; prometheus-client writes
/// help verbatim, so make sure nothing breaks the line.
fn escape_help_004(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn converts_each_metric_type() {
        let om = "\
# HELP asyncrl_jobs Jobs done.
# TYPE asyncrl_jobs counter
asyncrl_jobs_total{kind=\"a # } b\"} 3 # {trace_id=\"x\"} 1.0
asyncrl_jobs_created{kind=\"a # } b\"} 1700000000.0
# HELP asyncrl_build Build facts.
# TYPE asyncrl_build info
asyncrl_build_info{version=\"0.1.0\"} 1
# HELP asyncrl_depth Queue depth.
# TYPE asyncrl_depth gauge
asyncrl_depth 7
# HELP asyncrl_step_seconds Step time.
# TYPE asyncrl_step_seconds histogram
# UNIT asyncrl_step_seconds seconds
asyncrl_step_seconds_sum 1.5
asyncrl_step_seconds_count 2
asyncrl_step_seconds_bucket{le=\"1.0\"} 1
asyncrl_step_seconds_bucket{le=\"+Inf\"} 2
# HELP asyncrl_gh A gauge histogram.
# TYPE asyncrl_gh gaugehistogram
asyncrl_gh_gsum 1
# EOF
";
        let want = "\
# HELP asyncrl_jobs_total Jobs done.
# TYPE asyncrl_jobs_total counter
asyncrl_jobs_total{kind=\"a # } b\"} 3
# HELP asyncrl_build_info Build facts.
# TYPE asyncrl_build_info gauge
asyncrl_build_info{version=\"0.1.0\"} 1
# HELP asyncrl_depth Queue depth.
# TYPE asyncrl_depth gauge
asyncrl_depth 7
# HELP asyncrl_step_seconds Step time.
# TYPE asyncrl_step_seconds histogram
asyncrl_step_seconds_sum 1.5
asyncrl_step_seconds_count 2
asyncrl_step_seconds_bucket{le=\"1.0\"} 1
asyncrl_step_seconds_bucket{le=\"+Inf\"} 2
";
        assert_eq!(openmetrics_to_prometheus_text(om), want);
    }

    #[test]
    fn help_newlines_are_escaped() {
        assert_eq!(escape_help_004("a\\b\nc"), "a\\\\b\\nc");
    }
}
