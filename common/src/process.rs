//! What every asyncrl process does the same way: SIGTERM/SIGINT become a
//! cancelled shutdown token, and a failure is printed as one line.

use std::future::Future;
use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

/// A token cancelled on the first SIGTERM or SIGINT (logged with `role`).
/// The handlers are installed before it returns, so a signal that arrives
/// afterwards is never the default "terminate now". Call it inside a tokio
/// runtime.
pub fn shutdown_on_signals(role: &str) -> std::io::Result<CancellationToken> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    let role = role.to_owned();
    tokio::spawn(async move {
        let signal = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(role = %role, signal, "shutdown requested; draining");
        cancel.cancel();
    });
    Ok(token)
}

/// The error and its causes on one line, joined by `: `. A cause whose text
/// the message before it already includes (errors that print their source
/// themselves) is not repeated.
pub fn one_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let text = cause
            .to_string()
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect::<Vec<_>>()
            .join(" ");
        if parts.last().is_some_and(|prev| prev.contains(&text)) {
            continue;
        }
        parts.push(text);
    }
    parts.join(": ")
}

/// The `main` of a process: runs `body` on a multi-threaded runtime and
/// turns its error into `error: <one line>` on stderr and a failing exit
/// code (no panic, no backtrace).
pub fn main<F>(body: impl FnOnce() -> F) -> ExitCode
where
    F: Future<Output = anyhow::Result<()>>,
{
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::Error::new(e).context("cannot start the tokio runtime"))
        .and_then(|rt| rt.block_on(body()));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_are_one_line() {
        let e = anyhow::anyhow!("inner\nsecond line").context("outer");
        assert_eq!(one_line(&e), "outer: inner second line");
        let io = std::io::Error::new(std::io::ErrorKind::NotFound, "gone");
        let e = anyhow::Error::new(io).context("cannot read x: gone");
        assert_eq!(one_line(&e), "cannot read x: gone");
    }

    #[tokio::test]
    async fn sigterm_cancels_the_token() {
        let token = shutdown_on_signals("test").expect("listen for signals");
        // SAFETY: sends SIGTERM to this process, whose handler is installed.
        unsafe {
            libc::raise(libc::SIGTERM);
        }
        tokio::time::timeout(std::time::Duration::from_secs(30), token.cancelled())
            .await
            .expect("SIGTERM cancels the token");
    }
}
