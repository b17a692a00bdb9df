//! Seeded, policy-independent randomness of a rollout: which step attempts fail and when, and
//! the LLM time of steps recorded without one.
//!
//! Every draw is a pure function of (seed, trajectory, step, attempt), derived with blake3, so
//! the same failures hit the same step attempts under every policy (the comparison in the
//! paper's Fig. 12 injects failures with a fixed per-step probability).

/// Failure injection like a chaos tool: each step attempt fails with probability `p`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailureSchedule {
    /// Seed.
    pub seed: u64,
    /// Per-step failure probability.
    pub p: f64,
}

/// Two uniform draws in [0, 1) for a key.
fn uniforms(seed: u64, what: &str, trajectory: &str, step: u64, attempt: u32) -> (f64, f64) {
    let mut h = blake3::Hasher::new();
    h.update(&seed.to_le_bytes());
    h.update(what.as_bytes());
    h.update(&[0]);
    h.update(trajectory.as_bytes());
    h.update(&[0]);
    h.update(&step.to_le_bytes());
    h.update(&attempt.to_le_bytes());
    let out = h.finalize();
    let b = out.as_bytes();
    let u = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        (u64::from_le_bytes(w) >> 11) as f64 / (1u64 << 53) as f64
    };
    (u(0), u(8))
}

impl FailureSchedule {
    /// When attempt `attempt` (0-based) of step `step` fails: `Some(f)` with `f` in [0, 1), the
    /// moment as a fraction of the step (LLM wait followed by the action), or `None`.
    pub fn failure(&self, trajectory: &str, step: u64, attempt: u32) -> Option<f64> {
        if self.p <= 0.0 {
            return None;
        }
        let (hit, moment) = uniforms(self.seed, "failure", trajectory, step, attempt);
        (hit < self.p).then_some(moment)
    }
}

/// An LLM time for a step recorded without one: a draw from `samples` (seconds).
pub fn sample_llm_s(seed: u64, trajectory: &str, step: u64, samples: &[f64]) -> f64 {
    if samples.is_empty() {
        return 3.0;
    }
    let (u, _) = uniforms(seed, "llm", trajectory, step, 0);
    samples[((u * samples.len() as f64) as usize).min(samples.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_is_deterministic_and_has_the_right_rate() {
        let s = FailureSchedule { seed: 7, p: 0.05 };
        assert_eq!(s.failure("t", 3, 0), s.failure("t", 3, 0));
        let hits = (0..20_000u64)
            .filter(|k| s.failure("t", *k, 0).is_some())
            .count();
        assert!((800..1200).contains(&hits), "{hits} of 20000 at p=0.05");
        assert!((0..1000u64)
            .filter_map(|k| s.failure("t", k, 0))
            .all(|f| (0.0..1.0).contains(&f)));
        assert_eq!(FailureSchedule { seed: 7, p: 0.0 }.failure("t", 1, 0), None);
        // Different attempts of the same step draw independently.
        let again = (0..2000u64)
            .filter(|k| s.failure("t", *k, 0).is_some() && s.failure("t", *k, 1).is_some())
            .count();
        assert!(again < 20);
    }

    #[test]
    fn llm_samples_come_from_the_distribution() {
        let samples = [1.0, 2.0, 3.0];
        for k in 0..50 {
            assert!(samples.contains(&sample_llm_s(1, "t", k, &samples)));
        }
        assert_eq!(sample_llm_s(1, "t", 1, &[]), 3.0);
    }
}
