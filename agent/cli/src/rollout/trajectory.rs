//! Recorded agent trajectories: one JSON object per line, one file per trajectory, steps in
//! order (format: `shared/trajectories/README.md`; keys `source`, `task`, `step`, `kind`, `cmd`,
//! `llm_s`, `exec_s`, `rc`, `obs_head`).
//!
//! A default selection is compiled into the binary (`agent/cli/trajectories/`), so `belayer
//! rollout` needs no arguments.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// One recorded step (an action boundary k = `step`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Step {
    /// 1-based step index.
    pub step: u64,
    /// `bash`, `sweagent-tool`, or OpenHands `run` / `edit` / `read`.
    pub kind: String,
    /// The action text as the agent issued it.
    pub cmd: String,
    /// Seconds the agent waited for the LLM response that produced this action.
    pub llm_s: Option<f64>,
    /// Seconds the action ran in the recorded environment.
    pub exec_s: Option<f64>,
    /// Recorded exit code.
    pub rc: Option<i64>,
    /// First bytes of the recorded observation.
    #[serde(default)]
    pub obs_head: String,
}

/// A trajectory: its name and steps.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    /// File stem, e.g. `tbmini__grid-pattern-transform__2025-08-07__20-46-16`.
    pub name: String,
    /// Steps in order.
    pub steps: Vec<Step>,
}

/// Errors reading trajectories.
#[derive(Debug, thiserror::Error)]
pub enum TrajectoryError {
    /// A file or directory could not be read.
    #[error("cannot read trajectory {path}")]
    Read {
        /// Path.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// A line is not a valid step.
    #[error("{path}:{line}: invalid step")]
    Parse {
        /// Path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// A trajectory has no steps.
    #[error("trajectory {0} has no steps")]
    Empty(String),
}

/// The default selection: 8 Terminal-Bench runs of mini-swe-agent, one SWE-agent run and two
/// OpenHands runs (114 steps in all).
const DEFAULT: &[(&str, &str)] = &[
    ("tbmini__blind-maze-explorer-5x5__2025-08-15__19-28-24", include_str!("../../trajectories/tbmini__blind-maze-explorer-5x5__2025-08-15__19-28-24.jsonl")),
    ("tbmini__decommissioning-service-with-sensitive-data__2025-08-07__20-46-16", include_str!("../../trajectories/tbmini__decommissioning-service-with-sensitive-data__2025-08-07__20-46-16.jsonl")),
    ("tbmini__grid-pattern-transform__2025-08-07__20-46-16", include_str!("../../trajectories/tbmini__grid-pattern-transform__2025-08-07__20-46-16.jsonl")),
    ("tbmini__incompatible-python-fasttext.base_with_hint__2025-08-13__19-44-27", include_str!("../../trajectories/tbmini__incompatible-python-fasttext.base_with_hint__2025-08-13__19-44-27.jsonl")),
    ("tbmini__new-encrypt-command__2025-08-15__16-23-45", include_str!("../../trajectories/tbmini__new-encrypt-command__2025-08-15__16-23-45.jsonl")),
    ("tbmini__organization-json-generator__2025-08-15__16-23-45", include_str!("../../trajectories/tbmini__organization-json-generator__2025-08-15__16-23-45.jsonl")),
    ("tbmini__sanitize-git-repo.hard__2025-08-07__20-46-16", include_str!("../../trajectories/tbmini__sanitize-git-repo.hard__2025-08-07__20-46-16.jsonl")),
    ("tbmini__simple-sheets-put__2025-08-07__20-46-16", include_str!("../../trajectories/tbmini__simple-sheets-put__2025-08-07__20-46-16.jsonl")),
    ("sweagent__0.00__p-0.95__c-3.00__install-1_swe-agent__test-repo-i1", include_str!("../../trajectories/sweagent__0.00__p-0.95__c-3.00__install-1_swe-agent__test-repo-i1.jsonl")),
    ("openhands__ponylang__ponyc-4595", include_str!("../../trajectories/openhands__ponylang__ponyc-4595.jsonl")),
    ("openhands__basic_gui_mode", include_str!("../../trajectories/openhands__basic_gui_mode.jsonl")),
];

/// Parses the JSONL text of one trajectory.
pub fn parse(name: &str, text: &str, path: &Path) -> Result<Trajectory, TrajectoryError> {
    let mut steps = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let step: Step = serde_json::from_str(line).map_err(|source| TrajectoryError::Parse {
            path: path.to_path_buf(),
            line: i + 1,
            source,
        })?;
        steps.push(step);
    }
    if steps.is_empty() {
        return Err(TrajectoryError::Empty(name.to_string()));
    }
    Ok(Trajectory {
        name: name.to_string(),
        steps,
    })
}

/// The built-in default selection.
pub fn default_selection() -> Vec<Trajectory> {
    DEFAULT
        .iter()
        .filter_map(|(name, text)| parse(name, text, Path::new(name)).ok())
        .collect()
}

/// Loads trajectories from files and directories (every `*.jsonl` inside, sorted); empty
/// trajectories in directories are skipped, an empty file named explicitly is an error.
pub fn load(paths: &[PathBuf]) -> Result<Vec<Trajectory>, TrajectoryError> {
    let mut out = Vec::new();
    for p in paths {
        let meta = fs::metadata(p).map_err(|source| TrajectoryError::Read {
            path: p.clone(),
            source,
        })?;
        if meta.is_dir() {
            let mut files: Vec<PathBuf> = fs::read_dir(p)
                .map_err(|source| TrajectoryError::Read {
                    path: p.clone(),
                    source,
                })?
                .flatten()
                .map(|e| e.path())
                .filter(|f| f.extension().is_some_and(|e| e == "jsonl"))
                .collect();
            files.sort();
            for f in files {
                match load_file(&f) {
                    Ok(t) => out.push(t),
                    Err(TrajectoryError::Empty(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        } else {
            out.push(load_file(p)?);
        }
    }
    Ok(out)
}

fn load_file(path: &Path) -> Result<Trajectory, TrajectoryError> {
    let text = fs::read_to_string(path).map_err(|source| TrajectoryError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    parse(&name, &text, path)
}

/// Every recorded LLM wait (seconds) of `trajectories`: the empirical distribution used for
/// steps without one and to warm-start the policy's response-time model.
pub fn llm_samples(trajectories: &[Trajectory]) -> Vec<f64> {
    trajectories
        .iter()
        .flat_map(|t| t.steps.iter().filter_map(|s| s.llm_s))
        .filter(|v| v.is_finite() && *v > 0.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_selection_loads() {
        let all = default_selection();
        assert_eq!(all.len(), DEFAULT.len());
        assert!(all.iter().all(|t| !t.steps.is_empty()));
        assert!(llm_samples(&all).len() > 50);
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let text = "{\"step\":1,\"kind\":\"bash\",\"cmd\":\"ls\",\"llm_s\":1.0,\"exec_s\":0.1,\"rc\":0}\nnot json\n";
        match parse("t", text, Path::new("t.jsonl")) {
            Err(TrajectoryError::Parse { line, .. }) => assert_eq!(line, 2),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse("t", "\n", Path::new("t")),
            Err(TrajectoryError::Empty(_))
        ));
    }
}
