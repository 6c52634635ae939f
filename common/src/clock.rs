//! Wall-clock time, and a [`Clock`] that roles take by injection so that
//! tests drive leases, heartbeats and timeouts with paused tokio time instead
//! of sleeping.

use std::fmt::Debug;
use std::sync::Arc;

/// Milliseconds since the Unix epoch by the system clock (0 if the clock is
/// before 1970).
pub fn unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The time a role reads for deadlines it persists or compares with other
/// processes (lease expiry, heartbeat silence): Unix milliseconds.
pub trait Clock: Send + Sync + Debug {
    fn now_unix_ms(&self) -> i64;
}

/// A clock shared by the parts of one role.
pub type SharedClock = Arc<dyn Clock>;

/// The system clock (what every role uses outside tests).
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl SystemClock {
    pub fn shared() -> SharedClock {
        Arc::new(SystemClock)
    }
}

impl Clock for SystemClock {
    fn now_unix_ms(&self) -> i64 {
        unix_ms()
    }
}

/// Unix time that moves with tokio's clock: `base + (tokio now − start)`.
/// Under `#[tokio::test(start_paused = true)]` it stands still until the
/// test (or tokio's auto-advance) moves time, so lease and heartbeat tests
/// do not depend on how busy the machine is.
#[derive(Debug, Clone)]
pub struct TokioClock {
    base_unix_ms: i64,
    start: tokio::time::Instant,
}

impl TokioClock {
    /// Starts at `base_unix_ms` now.
    pub fn starting_at(base_unix_ms: i64) -> Self {
        Self {
            base_unix_ms,
            start: tokio::time::Instant::now(),
        }
    }

    pub fn shared(self) -> SharedClock {
        Arc::new(self)
    }
}

impl Clock for TokioClock {
    fn now_unix_ms(&self) -> i64 {
        let elapsed = tokio::time::Instant::now().saturating_duration_since(self.start);
        self.base_unix_ms + elapsed.as_millis() as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test(start_paused = true)]
    async fn tokio_clock_follows_paused_time() {
        let clock = TokioClock::starting_at(1_000);
        assert_eq!(clock.now_unix_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(250)).await;
        assert_eq!(clock.now_unix_ms(), 1_250);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert_eq!(clock.now_unix_ms(), 3_250);
    }

    #[test]
    fn system_clock_is_unix_time() {
        let before = unix_ms();
        let now = SystemClock.now_unix_ms();
        assert!(now >= before && now > 1_600_000_000_000, "{now}");
    }
}
