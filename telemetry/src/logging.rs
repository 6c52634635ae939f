//! Tracing setup: text or JSON on stderr, filtered by `telemetry.log_filter`
//! unless `RUST_LOG` is set.

use asyncrl_config::{LogFormat, TelemetryConfig};
use tracing_subscriber::EnvFilter;

use crate::TelemetryError;

/// Installs the global tracing subscriber. Call once, early in `main`.
///
/// A non-empty `RUST_LOG` takes precedence over `config.log_filter`; an
/// invalid filter in either is an error that names where it came from.
pub fn init_tracing(config: &TelemetryConfig) -> Result<(), TelemetryError> {
    let filter = build_filter(std::env::var("RUST_LOG").ok(), &config.log_filter)?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let result = match config.log_format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    result.map_err(|e| TelemetryError::TracingInit(e.to_string()))
}

fn build_filter(rust_log: Option<String>, configured: &str) -> Result<EnvFilter, TelemetryError> {
    let (source_name, filter) = match rust_log {
        Some(v) if !v.trim().is_empty() => ("RUST_LOG", v),
        _ => ("telemetry.log_filter", configured.to_owned()),
    };
    EnvFilter::builder()
        .parse(&filter)
        .map_err(|e| TelemetryError::LogFilter {
            source_name,
            filter,
            message: e.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rust_log_overrides_and_errors_name_their_source() {
        let f = build_filter(Some("debug".into()), "info").unwrap();
        assert_eq!(f.to_string(), "debug");
        let f = build_filter(Some("  ".into()), "warn").unwrap();
        assert_eq!(f.to_string(), "warn");
        let f = build_filter(None, "asyncrl_transport=debug,info").unwrap();
        assert!(f.to_string().contains("asyncrl_transport=debug"), "{f}");
        let err = build_filter(None, "info,[[[").unwrap_err().to_string();
        assert!(err.contains("telemetry.log_filter"), "{err}");
        let err = build_filter(Some("=x=y".into()), "info")
            .unwrap_err()
            .to_string();
        assert!(err.contains("RUST_LOG"), "{err}");
    }
}
