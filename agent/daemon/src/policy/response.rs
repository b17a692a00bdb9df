//! The empirical distribution of LLM response times T and q(x; c).

use std::collections::VecDeque;

/// Default number of most recent response times kept.
pub const DEFAULT_RESPONSE_WINDOW: usize = 1024;

/// Empirical distribution of LLM response times T, seconds, over a bounded window of the most
/// recent samples: warm-started from given samples (the first steps' times or a recorded
/// distribution) and updated online with [`observe`](Self::observe).
#[derive(Debug, Clone)]
pub struct ResponseTimes {
    /// Samples in arrival order (oldest first), at most `capacity`.
    window: VecDeque<f64>,
    /// The same samples, sorted ascending.
    sorted: Vec<f64>,
    capacity: usize,
}

impl ResponseTimes {
    /// An empty distribution keeping the last `capacity` samples (at least 1).
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        ResponseTimes {
            window: VecDeque::with_capacity(capacity.min(DEFAULT_RESPONSE_WINDOW)),
            sorted: Vec::new(),
            capacity,
        }
    }

    /// A distribution of capacity `capacity` warm-started with `samples` (seconds; in order, so
    /// only the last `capacity` are kept).
    pub fn with_samples(capacity: usize, samples: impl IntoIterator<Item = f64>) -> Self {
        let mut r = Self::new(capacity);
        for t in samples {
            r.observe(t);
        }
        r
    }

    /// Adds one response time, seconds, evicting the oldest sample when the window is full.
    /// Negative or non-finite values are ignored.
    pub fn observe(&mut self, t_s: f64) {
        if !(t_s.is_finite() && t_s >= 0.0) {
            tracing::debug!(t_s, "ignoring invalid llm response time");
            return;
        }
        if self.window.len() == self.capacity {
            if let Some(old) = self.window.pop_front() {
                let i = self.sorted.partition_point(|&s| s < old);
                self.sorted.remove(i);
            }
        }
        self.window.push_back(t_s);
        let i = self.sorted.partition_point(|&s| s <= t_s);
        self.sorted.insert(i, t_s);
    }

    /// Number of samples held.
    pub fn len(&self) -> usize {
        self.window.len()
    }

    /// Whether no sample is held.
    pub fn is_empty(&self) -> bool {
        self.window.is_empty()
    }

    /// Maximum number of samples kept.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Number of samples with T >= `x_s`.
    fn count_at_least(&self, x_s: f64) -> usize {
        self.sorted.len() - self.sorted.partition_point(|&s| s < x_s)
    }

    /// Empirical survival function S(x) = P(T >= x), in [0, 1]; 0.0 without samples.
    pub fn survival(&self, x_s: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        self.count_at_least(x_s) as f64 / self.sorted.len() as f64
    }

    /// q(x; c) = P(T >= x + c | T >= x) = #{T >= x + c} / #{T >= x}: the probability that a
    /// response already running for `x_s` seconds lasts at least `c_s` more, so a checkpoint of
    /// cost `c_s` started now stays hidden in the bubble.
    ///
    /// When no sample is >= x (the response already outlasted every one seen), or there are no
    /// samples at all, returns 0.0: the checkpoint is assumed fully visible. A negative `c_s`
    /// counts as 0.
    pub fn q(&self, x_s: f64, c_s: f64) -> f64 {
        let x = if x_s.is_finite() { x_s.max(0.0) } else { 0.0 };
        let c = if c_s.is_finite() { c_s.max(0.0) } else { 0.0 };
        let alive = self.count_at_least(x);
        if alive == 0 {
            return 0.0;
        }
        self.count_at_least(x + c) as f64 / alive as f64
    }
}

impl Default for ResponseTimes {
    fn default() -> Self {
        Self::new(DEFAULT_RESPONSE_WINDOW)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one_to_ten() -> ResponseTimes {
        ResponseTimes::with_samples(DEFAULT_RESPONSE_WINDOW, (1..=10).map(f64::from))
    }

    #[test]
    fn q_on_known_distribution() {
        let r = one_to_ten();
        assert_eq!(r.len(), 10);
        // q(0; 3) = #{T >= 3} / #{T >= 0} = |{3..=10}| / 10 = 8/10.
        assert_eq!(r.q(0.0, 3.0), 0.8);
        // q(2; 3) = #{T >= 5} / #{T >= 2} = 6/9.
        assert_eq!(r.q(2.0, 3.0), 6.0 / 9.0);
        // q(2.5; 3) = #{T >= 5.5} / #{T >= 2.5} = 5/8.
        assert_eq!(r.q(2.5, 3.0), 5.0 / 8.0);
        // q(8; 2) = #{T >= 10} / #{T >= 8} = 1/3.
        assert_eq!(r.q(8.0, 2.0), 1.0 / 3.0);
        // q(9.5; 1) = #{T >= 10.5} / #{T >= 9.5} = 0/1.
        assert_eq!(r.q(9.5, 1.0), 0.0);
        // No sample >= 11: the checkpoint is assumed fully visible.
        assert_eq!(r.q(11.0, 1.0), 0.0);
        // A free checkpoint is always hidden while any sample is alive.
        assert_eq!(r.q(4.0, 0.0), 1.0);
        assert_eq!(r.q(0.0, -1.0), 1.0);
        // S(x): P(T >= 4) = 7/10.
        assert_eq!(r.survival(4.0), 0.7);
    }

    #[test]
    fn empty_distribution_gives_zero() {
        let r = ResponseTimes::default();
        assert!(r.is_empty());
        assert_eq!(r.q(0.0, 1.0), 0.0);
        assert_eq!(r.survival(0.0), 0.0);
    }

    #[test]
    fn window_evicts_oldest_and_ignores_invalid() {
        let mut r = ResponseTimes::new(3);
        for t in [1.0, 2.0, 3.0, 4.0] {
            r.observe(t);
        }
        r.observe(f64::NAN);
        r.observe(-1.0);
        assert_eq!(r.len(), 3);
        assert_eq!(r.capacity(), 3);
        // Samples {2, 3, 4}: q(0; 3) = #{T >= 3} / 3 = 2/3.
        assert_eq!(r.q(0.0, 3.0), 2.0 / 3.0);
        // Duplicates are evicted one at a time.
        let mut r = ResponseTimes::with_samples(2, [5.0, 5.0, 1.0]);
        assert_eq!(r.len(), 2);
        assert_eq!(r.survival(5.0), 0.5);
        r.observe(1.0);
        assert_eq!(r.survival(5.0), 0.0);
    }
}
