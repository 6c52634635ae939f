//! The actor's timing and sizing, taken from the config once at start.

use std::time::Duration;

use asyncrl_config::Config;

use crate::scheduler::SchedulerParams;

/// Timing and sizing, from the config.
#[derive(Debug, Clone)]
pub(super) struct Settings {
    pub(super) groups_per_step: u32,
    pub(super) group_size: u32,
    pub(super) lease_timeout_ms: i64,
    pub(super) heartbeat_interval_ms: u32,
    pub(super) dead_after_ms: i64,
    pub(super) retry_after_ms: u32,
    pub(super) max_per_acquire: u32,
    pub(super) max_recommended_workers: u32,
    /// `coordinator.completed_memory`, for the scheduler.
    completed_memory: usize,
    /// `coordinator.max_task_attempts`, for the scheduler.
    max_task_attempts: u32,
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Settings {
    pub(super) fn from_config(config: &Config) -> Self {
        let c = &config.coordinator;
        Self {
            groups_per_step: config.staleness.groups_per_step,
            group_size: config.staleness.group_size,
            lease_timeout_ms: millis(c.lease_timeout),
            heartbeat_interval_ms: u32::try_from(c.heartbeat_interval.as_millis())
                .unwrap_or(u32::MAX),
            dead_after_ms: millis(c.dead_after),
            retry_after_ms: u32::try_from(c.retry_after.as_millis()).unwrap_or(u32::MAX),
            max_per_acquire: c.max_tasks_per_acquire,
            max_recommended_workers: c.max_recommended_workers,
            completed_memory: c.completed_memory,
            max_task_attempts: c.max_task_attempts,
        }
    }

    /// The scheduler's parameters.
    pub(super) fn scheduler_params(&self) -> SchedulerParams {
        SchedulerParams {
            groups_per_step: self.groups_per_step,
            group_size: self.group_size,
            lease_timeout_ms: self.lease_timeout_ms,
            completed_memory: self.completed_memory,
            max_task_attempts: self.max_task_attempts,
        }
    }

    /// How often the actor checks lease deadlines and heartbeats: a quarter
    /// of the shortest of them, within 20-500 ms.
    pub(super) fn tick_interval(&self) -> Duration {
        let shortest = self
            .lease_timeout_ms
            .min(self.dead_after_ms)
            .min(i64::from(self.heartbeat_interval_ms));
        Duration::from_millis((shortest / 4).clamp(20, 500) as u64)
    }
}
