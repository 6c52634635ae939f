//! Just enough of PromQL to list the series selectors of an expression:
//! metric names and their label matchers. Function and aggregation names,
//! grouping label lists (`by (...)`, `on (...)`, ...), range and subquery
//! brackets, strings, numbers, durations and Grafana variables (`$x`,
//! `${x}`, `$__rate_interval`) are recognised and skipped.

/// A label matcher `name op "value"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Matcher {
    pub label: String,
    pub op: String,
    pub value: String,
}

/// One vector selector: `name{matchers}` (name empty for `{__name__=...}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selector {
    pub metric: String,
    pub matchers: Vec<Matcher>,
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Num,
    Var,
    Punct(char),
    /// `{...}` label matchers.
    Matchers(Vec<Matcher>),
    /// `[...]` range or subquery (contents skipped).
    Range,
}

/// Keywords that are followed by a parenthesised label list.
const GROUPING: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// Aggregation operators (they may take `by (...)` before their argument).
const AGGREGATIONS: &[&str] = &[
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "group",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "limitk",
    "limit_ratio",
];

/// Words that are never metric names when they stand alone.
const KEYWORDS: &[&str] = &[
    "and", "or", "unless", "bool", "offset", "atan2", "inf", "nan", "start", "end",
];

/// The selectors of `expr`, in order. Errors name what could not be read.
pub fn selectors(expr: &str) -> Result<Vec<Selector>, String> {
    let toks = tokenize(expr)?;
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        match &toks[i] {
            Tok::Ident(word) if GROUPING.contains(&word.as_str()) => {
                // Skip the label list that follows, if any (group_left may
                // stand without one).
                i += 1;
                if toks.get(i) == Some(&Tok::Punct('(')) {
                    while i < toks.len() && toks[i] != Tok::Punct(')') {
                        i += 1;
                    }
                }
            }
            Tok::Ident(word) if word == "offset" => {
                i += 1; // the duration
            }
            Tok::Ident(word) if KEYWORDS.contains(&word.as_str()) => {}
            Tok::Ident(word) => {
                let next = toks.get(i + 1);
                let grouped = matches!(next, Some(Tok::Ident(w)) if GROUPING.contains(&w.as_str()));
                if next == Some(&Tok::Punct('('))
                    || (grouped && AGGREGATIONS.contains(&word.as_str()))
                {
                    // A function, or an aggregation (`sum by (x) (...)`).
                } else {
                    let matchers = match next {
                        Some(Tok::Matchers(m)) => {
                            i += 1;
                            m.clone()
                        }
                        _ => Vec::new(),
                    };
                    out.push(Selector {
                        metric: word.clone(),
                        matchers,
                    });
                }
            }
            Tok::Matchers(m) => {
                let name = m
                    .iter()
                    .find(|m| m.label == "__name__" && m.op == "=")
                    .map(|m| m.value.clone())
                    .unwrap_or_default();
                out.push(Selector {
                    metric: name,
                    matchers: m.clone(),
                });
            }
            _ => {}
        }
        i += 1;
    }
    Ok(out)
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

fn tokenize(expr: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c == '#' {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '"' || c == '\'' || c == '`' {
            let (s, next) = string_at(&chars, i)?;
            toks.push(Tok::Str(s));
            i = next;
        } else if c == '$' {
            // $name, ${name}, ${name:fmt}
            i += 1;
            if chars.get(i) == Some(&'{') {
                while i < chars.len() && chars[i] != '}' {
                    i += 1;
                }
                i += 1;
            } else {
                while i < chars.len() && is_ident(chars[i]) {
                    i += 1;
                }
            }
            toks.push(Tok::Var);
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            // Numbers, durations (5m, 1h30m) and exponents (1e-3).
            while i < chars.len() {
                let d = chars[i];
                let exponent_sign = (d == '-' || d == '+') && matches!(chars[i - 1], 'e' | 'E');
                if d.is_ascii_alphanumeric() || d == '.' || exponent_sign {
                    i += 1;
                } else {
                    break;
                }
            }
            toks.push(Tok::Num);
        } else if is_ident_start(c) {
            let start = i;
            while i < chars.len() && is_ident(chars[i]) {
                i += 1;
            }
            toks.push(Tok::Ident(chars[start..i].iter().collect()));
        } else if c == '{' {
            let (m, next) = matchers_at(&chars, i)?;
            toks.push(Tok::Matchers(m));
            i = next;
        } else if c == '[' {
            let mut depth = 0;
            while i < chars.len() {
                match chars[i] {
                    '[' => depth += 1,
                    ']' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            if i >= chars.len() {
                return Err(format!("unclosed [ in {expr:?}"));
            }
            i += 1;
            toks.push(Tok::Range);
        } else {
            toks.push(Tok::Punct(c));
            i += 1;
        }
    }
    Ok(toks)
}

/// The string literal starting at `chars[i]` and the index after it.
fn string_at(chars: &[char], i: usize) -> Result<(String, usize), String> {
    let quote = chars[i];
    let mut j = i + 1;
    let mut s = String::new();
    while j < chars.len() && chars[j] != quote {
        if chars[j] == '\\' && quote != '`' {
            j += 1;
        }
        if let Some(c) = chars.get(j) {
            s.push(*c);
        }
        j += 1;
    }
    if j >= chars.len() {
        return Err(format!(
            "unclosed string in {:?}",
            chars.iter().collect::<String>()
        ));
    }
    Ok((s, j + 1))
}

/// The matchers of the `{...}` starting at `chars[i]` and the index after it.
fn matchers_at(chars: &[char], mut i: usize) -> Result<(Vec<Matcher>, usize), String> {
    let whole: String = chars.iter().collect();
    i += 1;
    let mut out = Vec::new();
    loop {
        while i < chars.len() && (chars[i].is_whitespace() || chars[i] == ',') {
            i += 1;
        }
        match chars.get(i) {
            None => return Err(format!("unclosed {{ in {whole:?}")),
            Some('}') => return Ok((out, i + 1)),
            Some(c) if is_ident_start(*c) => {}
            Some(c) => {
                return Err(format!(
                    "unexpected {c:?} in the label matchers of {whole:?}"
                ));
            }
        }
        let start = i;
        while i < chars.len() && is_ident(chars[i]) {
            i += 1;
        }
        let label: String = chars[start..i].iter().collect();
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        let op_start = i;
        while i < chars.len() && "=!~".contains(chars[i]) {
            i += 1;
        }
        let op: String = chars[op_start..i].iter().collect();
        if !["=", "!=", "=~", "!~"].contains(&op.as_str()) {
            return Err(format!(
                "bad matcher operator {op:?} after {label} in {whole:?}"
            ));
        }
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if !matches!(chars.get(i), Some('"' | '\'' | '`')) {
            return Err(format!(
                "matcher {label}{op} without a string value in {whole:?}"
            ));
        }
        let (value, next) = string_at(chars, i)?;
        i = next;
        out.push(Matcher { label, op, value });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(expr: &str) -> Vec<String> {
        selectors(expr)
            .unwrap()
            .into_iter()
            .map(|s| s.metric)
            .collect()
    }

    #[test]
    fn metric_names_are_found_and_everything_else_skipped() {
        assert_eq!(
            names(
                r#"sum by (phase) (rate(asyncrl_learner_step_phase_seconds_sum{namespace="$namespace"}[$__rate_interval]))"#
            ),
            vec!["asyncrl_learner_step_phase_seconds_sum"]
        );
        assert_eq!(
            names(
                "histogram_quantile(0.9, sum(rate(x_bucket[5m])) by (le)) > 1e-3 and on(namespace) group_left(pod) y offset 1h30m"
            ),
            vec!["x_bucket", "y"]
        );
        assert_eq!(
            names(
                r#"max(a) >= bool on (namespace) 0.75 * max by (namespace) (b{knob="eta"}) unless c[10m:1m]"#
            ),
            vec!["a", "b", "c"]
        );
        assert_eq!(
            names(
                r#"label_replace(up{job=~"a.*"}, "dst", "$1", "src", "(.*)") or vector(0) or {__name__="z"}"#
            ),
            vec!["up", "z"]
        );
        assert_eq!(names("${DS}"), Vec::<String>::new());
    }

    #[test]
    fn matchers_are_read() {
        let s = selectors(r#"m{a="1", b!~'x|y',}"#).unwrap();
        assert_eq!(s[0].matchers.len(), 2);
        assert_eq!(s[0].matchers[1].op, "!~");
        assert_eq!(s[0].matchers[1].value, "x|y");
        assert!(selectors("m{a=1}").is_err());
        assert!(selectors("m{a=\"1\"").is_err());
    }
}
