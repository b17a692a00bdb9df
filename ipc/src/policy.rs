//! Wire values of the checkpoint policy (paper: Algorithm 1): which policy a sandbox runs
//! ([`PolicyKind`]) and why a decision went the way it did ([`DecisionReason`]).
//!
//! Both travel as their text form (`every:4`, `clean`), so the encoding is the one a string
//! has, the JSON output reads the same, and an unknown value is refused when a message is
//! decoded.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A policy name that is not one of `adaptive`, `always`, `never`, `every:N`, `restart`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadPolicyKind {
    /// Not a known policy name.
    #[error("unknown checkpoint policy {input:?} (expected adaptive, always, never, every:N or restart)")]
    Unknown {
        /// The string given.
        input: String,
    },
    /// `every:N` with an N that is not a positive integer.
    #[error("checkpoint policy {input:?}: N of every:N must be a positive integer")]
    Interval {
        /// The string given.
        input: String,
    },
}

/// Which checkpoint policy runs; parsed from `adaptive`, `always`, `never`, `every:N`, `restart`
/// (ASCII case-insensitive) and displayed the same way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum PolicyKind {
    /// Algorithm 1: checkpoint when p_t·C_t > c_t·(1 − q(x; c_t)).
    Adaptive,
    /// Checkpoint after every step.
    Always,
    /// Never checkpoint; a failure is recovered by whatever the driver does without checkpoints.
    Never,
    /// Checkpoint after steps N, 2N, 3N, ... (steps count from 1).
    EveryN(u64),
    /// Baseline: never checkpoint; a failure restarts the trajectory from the base image.
    Restart,
}

impl PolicyKind {
    /// Whether this policy ever takes a checkpoint.
    pub fn takes_checkpoints(self) -> bool {
        !matches!(self, PolicyKind::Never | PolicyKind::Restart)
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyKind::Adaptive => f.write_str("adaptive"),
            PolicyKind::Always => f.write_str("always"),
            PolicyKind::Never => f.write_str("never"),
            PolicyKind::EveryN(n) => write!(f, "every:{n}"),
            PolicyKind::Restart => f.write_str("restart"),
        }
    }
}

impl FromStr for PolicyKind {
    type Err = BadPolicyKind;

    /// Parses `adaptive|always|never|every:N|restart`.
    ///
    /// Errors: [`BadPolicyKind::Unknown`], [`BadPolicyKind::Interval`] (N missing, not an
    /// integer, or 0).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.to_ascii_lowercase();
        match lower.as_str() {
            "adaptive" => return Ok(PolicyKind::Adaptive),
            "always" => return Ok(PolicyKind::Always),
            "never" => return Ok(PolicyKind::Never),
            "restart" => return Ok(PolicyKind::Restart),
            _ => {}
        }
        let Some(n) = lower.strip_prefix("every:") else {
            return Err(BadPolicyKind::Unknown {
                input: s.to_owned(),
            });
        };
        match n.parse::<u64>() {
            Ok(n) if n > 0 => Ok(PolicyKind::EveryN(n)),
            _ => Err(BadPolicyKind::Interval {
                input: s.to_owned(),
            }),
        }
    }
}

impl TryFrom<String> for PolicyKind {
    type Error = BadPolicyKind;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<PolicyKind> for String {
    fn from(k: PolicyKind) -> String {
        k.to_string()
    }
}

/// Why a checkpoint decision went the way it did.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub enum DecisionReason {
    /// Adaptive: the expected benefit p·C exceeds the visible cost c·(1 − q); checkpoint.
    Benefit,
    /// Adaptive: the visible cost is at least the benefit; skip.
    Cost,
    /// Adaptive: within the cooldown after a timed-out checkpoint; skip.
    Cooldown,
    /// `always`: checkpoint.
    Always,
    /// `never`: skip (the default of an empty decision).
    #[default]
    Never,
    /// `every:N`: checkpoint when N divides the step, skip otherwise.
    EveryN,
    /// `restart`: skip (the baseline recovers by restarting).
    Restart,
    /// Nothing changed since the last ready checkpoint; skip.
    Clean,
}

impl DecisionReason {
    /// Every reason, in declaration order.
    pub const ALL: [DecisionReason; 8] = [
        DecisionReason::Benefit,
        DecisionReason::Cost,
        DecisionReason::Cooldown,
        DecisionReason::Always,
        DecisionReason::Never,
        DecisionReason::EveryN,
        DecisionReason::Restart,
        DecisionReason::Clean,
    ];

    /// The text form: `benefit`, `cost`, `cooldown`, `always`, `never`, `every_n`, `restart`,
    /// `clean`.
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionReason::Benefit => "benefit",
            DecisionReason::Cost => "cost",
            DecisionReason::Cooldown => "cooldown",
            DecisionReason::Always => "always",
            DecisionReason::Never => "never",
            DecisionReason::EveryN => "every_n",
            DecisionReason::Restart => "restart",
            DecisionReason::Clean => "clean",
        }
    }
}

impl fmt::Display for DecisionReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason name that is not one of [`DecisionReason::as_str`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown decision reason {0:?}")]
pub struct BadDecisionReason(pub String);

impl FromStr for DecisionReason {
    type Err = BadDecisionReason;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DecisionReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| BadDecisionReason(s.to_owned()))
    }
}

impl TryFrom<String> for DecisionReason {
    type Error = BadDecisionReason;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<DecisionReason> for String {
    fn from(r: DecisionReason) -> String {
        r.as_str().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_bad_ones_are_named() {
        for k in ["adaptive", "always", "never", "restart", "every:3"] {
            assert_eq!(k.parse::<PolicyKind>().unwrap().to_string(), k);
        }
        assert_eq!("EVERY:2".parse::<PolicyKind>(), Ok(PolicyKind::EveryN(2)));
        assert!(matches!(
            "every:0".parse::<PolicyKind>(),
            Err(BadPolicyKind::Interval { .. })
        ));
        assert!(matches!(
            "sometimes".parse::<PolicyKind>(),
            Err(BadPolicyKind::Unknown { .. })
        ));
        assert!(!PolicyKind::Restart.takes_checkpoints());
    }

    #[test]
    fn reasons_round_trip() {
        for r in DecisionReason::ALL {
            assert_eq!(r.as_str().parse::<DecisionReason>(), Ok(r));
        }
        assert!("maybe".parse::<DecisionReason>().is_err());
        assert_eq!(String::from(DecisionReason::EveryN), "every_n");
    }
}
