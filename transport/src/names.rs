//! The names both buses take, checked the same way by each: subjects
//! (tokens separated by `.`; `*` matches one token, `>` (last) one or more)
//! and KV keys.

/// Whether `subject` matches `pattern`.
pub fn subject_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Checks a subject to publish on: non-empty tokens, no wildcards, no spaces.
pub(crate) fn validate_publish_subject(subject: &str) -> Result<(), crate::TransportError> {
    let bad = subject.is_empty()
        || subject
            .split('.')
            .any(|t| t.is_empty() || t == "*" || t == ">")
        || subject.chars().any(char::is_whitespace);
    if bad {
        return Err(crate::TransportError::InvalidName {
            name: subject.into(),
            reason: "not a valid subject to publish on".into(),
        });
    }
    Ok(())
}

/// Checks a KV key by the NATS rules (the in-process bus too, so that local
/// runs catch bad keys): non-empty, not starting or ending with `.`, of
/// `[A-Za-z0-9-/_=.]` only.
pub(crate) fn validate_key(key: &str) -> Result<(), crate::TransportError> {
    let ok = !key.is_empty()
        && !key.starts_with('.')
        && !key.ends_with('.')
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-/_=.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(crate::TransportError::InvalidName {
            name: key.into(),
            reason: "not a valid KV key".into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matching_table() {
        let cases = [
            ("a.b", "a.b", true),
            ("a.b", "a.c", false),
            ("a.*", "a.b", true),
            ("a.*", "a.b.c", false),
            ("a.>", "a.b.c", true),
            ("a.>", "a", false),
            ("*.b", "a.b", true),
            (">", "x", true),
            ("a.b.c", "a.b", false),
            ("a", "a.b", false),
        ];
        for (p, s, want) in cases {
            assert_eq!(subject_matches(p, s), want, "{p} vs {s}");
        }
    }

    #[test]
    fn publish_subjects() {
        assert!(validate_publish_subject("stream.t1").is_ok());
        for bad in ["", "a..b", "a.*", "a.>", "a b"] {
            assert!(validate_publish_subject(bad).is_err(), "{bad:?}");
        }
    }
}
