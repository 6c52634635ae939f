//! Permission violations the NATS server reports on a connection.
//!
//! A server with per-user permissions (deploy/k8s/base/nats-auth.conf)
//! answers a forbidden publish or subscription with an asynchronous
//! `-ERR 'Permissions Violation for Publish to "<subject>"'` and otherwise
//! drops it: the operation that sent it (a JetStream publish, a KV put, a
//! request) would wait for a reply until its timeout. The connection's event
//! callback records each violation here; the operation whose subjects it
//! names ends with [`crate::TransportError::PermissionDenied`] as soon as it
//! is recorded.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::subject_matches;

/// What the server refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Denied {
    Publish,
    Subscribe,
}

impl Denied {
    /// The NATS operation, as [`crate::TransportError::PermissionDenied`] names it.
    pub(crate) fn op(self) -> &'static str {
        match self {
            Denied::Publish => "publish",
            Denied::Subscribe => "subscribe",
        }
    }
}

/// One refusal by the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Violation {
    seq: u64,
    at: Instant,
    pub(crate) kind: Denied,
    pub(crate) subject: String,
}

/// The refusal a server error text describes, if it is one:
/// `Permissions Violation for Publish to "a.b"`,
/// `Permissions Violation for Subscription to "a.b" using queue "q"`.
pub(crate) fn parse(message: &str) -> Option<(Denied, String)> {
    let lower = message.trim().to_ascii_lowercase();
    let kind = if lower.starts_with("permissions violation for publish") {
        Denied::Publish
    } else if lower.starts_with("permissions violation for subscription") {
        Denied::Subscribe
    } else {
        return None;
    };
    let start = message.find('"')? + 1;
    let end = start + message[start..].find('"')?;
    Some((kind, message[start..end].to_owned()))
}

/// How many recent violations a connection remembers.
const KEEP: usize = 256;

/// The recent violations of one connection, in order.
#[derive(Debug, Default)]
pub(crate) struct Violations {
    log: Mutex<VecDeque<Violation>>,
    seq: AtomicU64,
    recorded: Notify,
}

impl Violations {
    /// A mark before an operation starts: only violations recorded after it
    /// are the operation's.
    pub(crate) fn mark(&self) -> u64 {
        self.seq.load(Ordering::SeqCst)
    }

    pub(crate) fn record(&self, kind: Denied, subject: String) {
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let seq = self.seq.fetch_add(1, Ordering::SeqCst) + 1;
            log.push_back(Violation {
                seq,
                at: Instant::now(),
                kind,
                subject,
            });
            while log.len() > KEEP {
                log.pop_front();
            }
        }
        self.recorded.notify_waiters();
    }

    /// Every remembered violation, oldest first: its operation and subject.
    pub(crate) fn list(&self) -> Vec<(&'static str, String)> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter()
            .map(|v| (v.kind.op(), v.subject.clone()))
            .collect()
    }

    /// The first violation of `kind` after `since` on a subject that one of
    /// `patterns` (NATS wildcards allowed) matches.
    pub(crate) fn find(&self, since: u64, kind: Denied, patterns: &[String]) -> Option<Violation> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter()
            .find(|v| {
                v.seq > since
                    && v.kind == kind
                    && patterns.iter().any(|p| subject_matches(p, &v.subject))
            })
            .cloned()
    }

    /// The latest violation of `kind` within the last `within` on a subject
    /// `pattern` matches: the likely cause of an operation that failed
    /// without saying why and took up to `within`.
    pub(crate) fn recent(
        &self,
        kind: Denied,
        pattern: &str,
        within: Duration,
    ) -> Option<Violation> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter()
            .rev()
            .take_while(|v| v.at.elapsed() <= within)
            .find(|v| v.kind == kind && subject_matches(pattern, &v.subject))
            .cloned()
    }

    /// Waits for such a violation (forever if none comes).
    pub(crate) async fn wait(&self, since: u64, kind: Denied, patterns: &[String]) -> Violation {
        loop {
            let recorded = self.recorded.notified();
            tokio::pin!(recorded);
            recorded.as_mut().enable();
            if let Some(v) = self.find(since, kind, patterns) {
                return v;
            }
            recorded.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_servers_permission_errors() {
        assert_eq!(
            parse(r#"Permissions Violation for Publish to "$KV.asyncrl_control.policy.version""#),
            Some((Denied::Publish, "$KV.asyncrl_control.policy.version".into()))
        );
        assert_eq!(
            parse(
                r#"Permissions Violation for Subscription to "svc.tasks.take" using queue "svc-workers""#
            ),
            Some((Denied::Subscribe, "svc.tasks.take".into()))
        );
        assert_eq!(parse("Authorization Violation"), None);
        assert_eq!(parse("Permissions Violation for Publish to"), None);
    }

    #[tokio::test]
    async fn an_operation_sees_only_the_violations_after_its_mark_on_its_subjects() {
        let v = Violations::default();
        v.record(Denied::Publish, "$O.WEIGHTS.C.old".into());
        let since = v.mark();
        let patterns = vec!["$O.WEIGHTS.>".to_owned()];
        assert_eq!(v.find(since, Denied::Publish, &patterns), None);
        v.record(Denied::Publish, "$KV.b.k".into());
        v.record(Denied::Subscribe, "$O.WEIGHTS.C.x".into());
        assert_eq!(v.find(since, Denied::Publish, &patterns), None);
        v.record(Denied::Publish, "$O.WEIGHTS.M.bmFtZQ==".into());
        let found = v.wait(since, Denied::Publish, &patterns).await;
        assert_eq!(found.subject, "$O.WEIGHTS.M.bmFtZQ==");
        let recent = v.recent(Denied::Publish, "$KV.>", Duration::from_secs(60));
        assert_eq!(recent.map(|r| r.subject).as_deref(), Some("$KV.b.k"));
        assert_eq!(
            v.recent(Denied::Publish, "$JS.API.>", Duration::from_secs(60)),
            None
        );
        assert_eq!(v.recent(Denied::Publish, "$KV.>", Duration::ZERO), None);
    }

    #[tokio::test]
    async fn a_waiting_operation_wakes_when_its_violation_arrives() {
        let v = std::sync::Arc::new(Violations::default());
        let since = v.mark();
        let waiter = {
            let v = v.clone();
            tokio::spawn(async move {
                v.wait(since, Denied::Publish, &["a.b".to_owned()])
                    .await
                    .subject
            })
        };
        tokio::task::yield_now().await;
        v.record(Denied::Publish, "a.b".into());
        assert_eq!(waiter.await.unwrap(), "a.b");
    }
}
