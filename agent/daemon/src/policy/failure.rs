//! p_t: the probability of a fail-stop failure during a step.

use serde::{Deserialize, Serialize};

use super::PolicyError;

/// How the policy estimates p_t, the probability that the environment fails during step t.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum FailureModel {
    /// Constant-hazard exponential lifetime: p_t = 1 - e^(-λ·d_t), with λ per second.
    Rate {
        /// Fail-stop rate λ, per second.
        lambda_per_s: f64,
    },
    /// A fixed per-step probability (the injected one in step-level failure experiments).
    Fixed {
        /// Probability in [0, 1].
        p: f64,
    },
}

impl FailureModel {
    /// p_t for a step of `d_t_s` seconds, in [0, 1]. A negative or non-finite duration counts
    /// as 0 s (p = 0 under [`FailureModel::Rate`]).
    pub fn p_t(&self, d_t_s: f64) -> f64 {
        match *self {
            FailureModel::Rate { lambda_per_s } => {
                let d = if d_t_s.is_finite() && d_t_s > 0.0 {
                    d_t_s
                } else {
                    0.0
                };
                // 1 - e^(-x) computed as -expm1(-x), exact for small λ·d.
                (-(-lambda_per_s * d).exp_m1()).clamp(0.0, 1.0)
            }
            FailureModel::Fixed { p } => p.clamp(0.0, 1.0),
        }
    }

    /// Checks that the rate is finite and non-negative or the probability within [0, 1].
    ///
    /// Errors: [`PolicyError::ValidateRate`], [`PolicyError::ValidateProbability`].
    pub fn validate(&self) -> Result<(), PolicyError> {
        match *self {
            FailureModel::Rate { lambda_per_s }
                if !(lambda_per_s.is_finite() && lambda_per_s >= 0.0) =>
            {
                Err(PolicyError::ValidateRate { lambda_per_s })
            }
            FailureModel::Fixed { p } if !(0.0..=1.0).contains(&p) => {
                Err(PolicyError::ValidateProbability { p })
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p_t_from_rate_matches_hand_values() {
        let m = FailureModel::Rate { lambda_per_s: 0.01 };
        // 1 - e^-0.1 = 0.0951625819640404...
        assert!((m.p_t(10.0) - 0.095_162_581_964_040_4).abs() < 1e-15);
        // 1 - e^-0.3 = 0.2591817793182821...
        assert!((m.p_t(30.0) - 0.259_181_779_318_282_1).abs() < 1e-15);
        assert_eq!(m.p_t(0.0), 0.0);
        assert_eq!(m.p_t(-3.0), 0.0);
        assert_eq!(m.p_t(f64::NAN), 0.0);
        // λ = 1/s, d = 1 s: 1 - 1/e = 0.6321205588285577
        let m = FailureModel::Rate { lambda_per_s: 1.0 };
        assert!((m.p_t(1.0) - 0.632_120_558_828_557_7).abs() < 1e-15);
        assert_eq!(m.p_t(f64::INFINITY), 0.0);
    }

    #[test]
    fn fixed_p_ignores_duration() {
        let m = FailureModel::Fixed { p: 0.05 };
        assert_eq!(m.p_t(0.0), 0.05);
        assert_eq!(m.p_t(1000.0), 0.05);
    }

    #[test]
    fn validation() {
        assert!(FailureModel::Fixed { p: 0.01 }.validate().is_ok());
        assert_eq!(
            FailureModel::Fixed { p: 1.5 }.validate(),
            Err(PolicyError::ValidateProbability { p: 1.5 })
        );
        assert!(FailureModel::Rate { lambda_per_s: -1.0 }
            .validate()
            .is_err());
        assert!(FailureModel::Rate {
            lambda_per_s: f64::NAN
        }
        .validate()
        .is_err());
        assert!(FailureModel::Rate { lambda_per_s: 0.0 }.validate().is_ok());
    }
}
