//! Lifecycle of a sandbox: a state enum with `can_*` guards, persisted after every verb.

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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// The init is alive; actions and checkpoints are allowed.
    Running,
    /// A checkpoint holds the sandbox (frozen or being published).
    Checkpointing,
    /// A restore is building a fresh instance.
    Restoring,
    /// The instance died (fail-stop); only restore or removal are allowed.
    Failed,
}

impl SandboxState {
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

    /// A restore may start (from any state: an interrupted verb leaves the instance suspect).
    pub fn can_restore(self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards() {
        assert!(SandboxState::Running.can_exec());
        assert!(!SandboxState::Failed.can_exec());
        assert!(!SandboxState::Checkpointing.can_checkpoint());
        assert!(SandboxState::Failed.can_restore());
        assert_eq!(
            serde_json::to_string(&SandboxState::Failed).unwrap(),
            "\"failed\""
        );
    }
}
