//! c_t: the checkpoint cost under current load.

use std::collections::VecDeque;

/// Default number of recent checkpoint durations the estimate uses.
pub const DEFAULT_COST_WINDOW: usize = 8;

/// Estimate of the checkpoint cost c_t, seconds: the median of the last `window` checkpoint
/// durations (so it follows the current load), or a configured initial value before the first
/// checkpoint.
#[derive(Debug, Clone)]
pub struct CheckpointCost {
    recent: VecDeque<f64>,
    window: usize,
    initial_s: f64,
}

impl CheckpointCost {
    /// An estimator that answers `initial_s` until a checkpoint is observed and then the median
    /// of the last `window` (at least 1) durations.
    pub fn new(initial_s: f64, window: usize) -> Self {
        let window = window.max(1);
        CheckpointCost {
            recent: VecDeque::with_capacity(window),
            window,
            initial_s,
        }
    }

    /// Records the duration of a finished (or timed-out) checkpoint, seconds. Negative or
    /// non-finite values are ignored.
    pub fn observe(&mut self, duration_s: f64) {
        if !(duration_s.is_finite() && duration_s >= 0.0) {
            tracing::debug!(duration_s, "ignoring invalid checkpoint duration");
            return;
        }
        if self.recent.len() == self.window {
            self.recent.pop_front();
        }
        self.recent.push_back(duration_s);
    }

    /// c_t, seconds: the median of the recent durations (the mean of the two middle ones for an
    /// even count), or the initial value when none was observed.
    pub fn estimate_s(&self) -> f64 {
        if self.recent.is_empty() {
            return self.initial_s;
        }
        let mut v: Vec<f64> = self.recent.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        }
    }

    /// Number of durations held.
    pub fn samples(&self) -> usize {
        self.recent.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_recent_durations() {
        let mut c = CheckpointCost::new(1.5, 4);
        assert_eq!(c.estimate_s(), 1.5);
        c.observe(0.2);
        c.observe(0.4);
        c.observe(10.0);
        // {0.2, 0.4, 10} → 0.4: one slow checkpoint does not move the median.
        assert_eq!(c.estimate_s(), 0.4);
        c.observe(0.6);
        // {0.2, 0.4, 0.6, 10} → (0.4 + 0.6) / 2.
        assert_eq!(c.estimate_s(), 0.5);
        c.observe(0.1);
        c.observe(f64::NAN);
        // 0.2 evicted: {0.1, 0.4, 0.6, 10} → 0.5.
        assert_eq!(c.samples(), 4);
        assert_eq!(c.estimate_s(), 0.5);
        c.observe(3.0);
        c.observe(4.0);
        // {0.6, 0.1, 3, 4} → (0.6 + 3) / 2.
        assert_eq!(c.estimate_s(), 1.8);
        c.observe(5.0);
        // {0.1, 3, 4, 5} → (3 + 4) / 2: the estimate follows a heavier load.
        assert_eq!(c.estimate_s(), 3.5);
    }
}
