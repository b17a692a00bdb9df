//! The lifecycle state of a sandbox ([`SandboxState`]), as `belayerd` keeps it and as
//! [`SandboxInfo::state`](crate::SandboxInfo) reports it.
//!
//! It travels as its lowercase name (`running`), so the encoding is a string's, JSON and
//! `state.json` read the same, and an unknown name is refused when a message is decoded.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Lifecycle state of a sandbox.
///
/// ```text
/// create → Running ⇄ Checkpointing
///            │  ↑
///   (init dies)│  │restore
///            ↓  │
///           Failed → Restoring → Running
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum SandboxState {
    /// The init is alive; actions and checkpoints are allowed.
    #[default]
    Running,
    /// A checkpoint holds the sandbox (frozen or being published).
    Checkpointing,
    /// A restore is building a fresh instance.
    Restoring,
    /// The instance died (fail-stop); only restore or removal are allowed.
    Failed,
}

impl SandboxState {
    /// Every state, in declaration order.
    pub const ALL: [SandboxState; 4] = [
        SandboxState::Running,
        SandboxState::Checkpointing,
        SandboxState::Restoring,
        SandboxState::Failed,
    ];

    /// Lowercase name used on the wire and in JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Running => "running",
            SandboxState::Checkpointing => "checkpointing",
            SandboxState::Restoring => "restoring",
            SandboxState::Failed => "failed",
        }
    }

    /// Actions may run.
    pub fn can_exec(self) -> bool {
        self == SandboxState::Running
    }

    /// A checkpoint may start.
    pub fn can_checkpoint(self) -> bool {
        self == SandboxState::Running
    }
}

impl fmt::Display for SandboxState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A state name that is none of [`SandboxState::as_str`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown sandbox state {0:?}")]
pub struct BadSandboxState(pub String);

impl FromStr for SandboxState {
    type Err = BadSandboxState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SandboxState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| BadSandboxState(s.to_owned()))
    }
}

impl TryFrom<String> for SandboxState {
    type Error = BadSandboxState;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<SandboxState> for String {
    fn from(s: SandboxState) -> String {
        s.as_str().to_owned()
    }
}

impl PartialEq<str> for SandboxState {
    fn eq(&self, other: &str) -> bool {
        self.as_str() == other
    }
}

impl PartialEq<&str> for SandboxState {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_and_names() {
        assert!(SandboxState::Running.can_exec());
        assert!(!SandboxState::Failed.can_exec());
        assert!(!SandboxState::Checkpointing.can_checkpoint());
        for st in SandboxState::ALL {
            assert_eq!(st.as_str().parse::<SandboxState>(), Ok(st));
            assert_eq!(st, st.as_str());
        }
        assert!("stopped".parse::<SandboxState>().is_err());
    }
}
