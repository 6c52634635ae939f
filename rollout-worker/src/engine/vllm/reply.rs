//! Reading a generation reply: tokens, log-probs, finish reason and the
//! per-token weight versions.

use asyncrl_policy::SamplingParams;

use super::api::{self, Choice, Sampling};

/// The sampling parameters of one request with `max_tokens` left.
pub(super) fn sampling(params: &SamplingParams, max_tokens: usize) -> Sampling {
    Sampling {
        max_tokens,
        temperature: params.temperature,
        top_p: params.top_p,
        logprobs: 0,
        stop_token_ids: params.stop_token_ids.clone(),
        ignore_eos: true,
        seed: params.seed,
    }
}

/// One reply's tokens, log-probs, finish reason and version spans.
pub(super) struct Part {
    pub tokens: Vec<i64>,
    pub logprobs: Vec<f32>,
    pub finish: Option<String>,
    pub spans: Option<Vec<api::VersionSpan>>,
}

pub(super) fn read_choice(choice: Choice, max_tokens: usize) -> Result<Part, String> {
    let tokens = choice
        .token_ids
        .ok_or("the reply has no token_ids (is return_token_ids supported?)")?;
    if tokens.len() > max_tokens {
        return Err(format!(
            "{} tokens returned, at most {max_tokens} asked for",
            tokens.len()
        ));
    }
    let lp = choice.logprobs.ok_or("the reply has no logprobs")?;
    let logprobs: Vec<f32> = match (lp.content, lp.token_logprobs) {
        (Some(content), _) => content.iter().map(|t| t.logprob as f32).collect(),
        (None, Some(list)) => list
            .iter()
            .map(|x| x.map(|v| v as f32).ok_or("a token has no log-prob"))
            .collect::<Result<_, _>>()?,
        (None, None) => return Err("the reply's logprobs hold no per-token values".into()),
    };
    if logprobs.len() != tokens.len() {
        return Err(format!(
            "{} log-probs for {} tokens",
            logprobs.len(),
            tokens.len()
        ));
    }
    if let Some(bad) = logprobs
        .iter()
        .find(|l| !(l.is_finite() || **l == f32::NEG_INFINITY) || **l > 1e-3)
    {
        return Err(format!("log-prob {bad} is not a log-probability"));
    }
    Ok(Part {
        tokens,
        logprobs,
        finish: choice.finish_reason,
        spans: choice.weight_versions,
    })
}

/// Per-token versions from the engine's spans. They must cover the tokens
/// exactly, in order, and never be older than `submitted` (the version the
/// server held when the request was sent).
pub(super) fn span_versions(
    spans: &Option<Vec<api::VersionSpan>>,
    n: usize,
    submitted: i32,
) -> Result<Vec<i32>, String> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let spans = spans.as_ref().ok_or("the reply has no weight_versions")?;
    let mut versions = Vec::with_capacity(n);
    for s in spans {
        if s.start != versions.len() || s.end < s.start || s.end > n {
            return Err(format!(
                "weight_versions span {}..{} does not continue at token {} of {n}",
                s.start,
                s.end,
                versions.len()
            ));
        }
        let v: i32 = s
            .version
            .as_deref()
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("weight version {:?} is not one this worker set", s.version))?;
        if v < submitted {
            return Err(format!(
                "tokens {}..{} carry version {v}, older than the {submitted} in use when the request was sent",
                s.start, s.end
            ));
        }
        if versions.last().is_some_and(|&last| v < last) {
            return Err(format!(
                "weight versions go backwards ({v} after {})",
                versions.last().unwrap_or(&v)
            ));
        }
        versions.extend(std::iter::repeat_n(v, s.end - s.start));
    }
    if versions.len() != n {
        return Err(format!(
            "weight_versions cover {} of {n} tokens",
            versions.len()
        ));
    }
    Ok(versions)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(v: &str, start: usize, end: usize) -> api::VersionSpan {
        api::VersionSpan {
            version: Some(v.into()),
            start,
            end,
        }
    }

    #[test]
    fn version_spans_must_cover_the_tokens_in_order() {
        assert_eq!(
            span_versions(&Some(vec![span("3", 0, 2), span("4", 2, 3)]), 3, 3).unwrap(),
            vec![3, 3, 4]
        );
        for (spans, why) in [
            (None, "no weight_versions"),
            (Some(vec![span("3", 0, 2)]), "cover 2 of 3"),
            (Some(vec![span("3", 1, 3)]), "does not continue"),
            (Some(vec![span("2", 0, 3)]), "older than"),
            (Some(vec![span("4", 0, 1), span("3", 1, 3)]), "backwards"),
            (Some(vec![span("default", 0, 3)]), "not one this worker set"),
            (Some(vec![span("3", 0, 4)]), "does not continue"),
        ] {
            let err = span_versions(&spans, 3, 3).unwrap_err();
            assert!(err.contains(why), "{err} should say {why}");
        }
        assert!(span_versions(&None, 0, 3).unwrap().is_empty());
    }
}
