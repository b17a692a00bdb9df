//! The rollout report (issue: "Report"): `report.json`, `report.md` and SVG plots of a policy
//! comparison run (paper: environment-recovery evaluation, Figure 12).
//!
//! The rollout driver fills a [`RolloutReport`] and calls [`write_report`]. `report.json` has the
//! shape of [`ReportJson`]: `config`, `failure_free`, `policies` as an object keyed by policy
//! name (with `policy_order` giving the run order), each with `makespan_s`, `increase_s`,
//! `increase_pct`, `failures`, `restores`, `regenerated_steps`, `regenerated_s`,
//! `checkpoints_taken`, `checkpoints_skipped`, `checkpoint_hidden_s`, `checkpoint_visible_s`,
//! `bytes_written`, `validity_errors` (a count) and `validity_error_messages`; the timelines sit
//! apart under `timelines`. Plots are drawn with `plotters`' SVG backend, which needs no system
//! fonts. Times are seconds.

mod json;
mod markdown;
mod model;
mod plot;

use std::collections::HashSet;
use std::path::{Path, PathBuf};

pub use json::{PolicySummary, ReportJson, TimelinesJson, REPORT_FORMAT};
pub use model::{
    EventKind, PolicyResult, RolloutReport, RunConfig, TimelineEvent, TrajectoryTimeline,
};
pub use plot::DrawError;

/// File name of the JSON report.
pub const REPORT_JSON: &str = "report.json";
/// File name of the Markdown report.
pub const REPORT_MD: &str = "report.md";
/// File name of the increase bar chart.
pub const INCREASE_SVG: &str = "increase.svg";

/// Errors of writing or reading a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Two policies share a name (they are keyed by name in `report.json`).
    #[error("policy {name:?} appears twice in the report")]
    DuplicatePolicy {
        /// The name.
        name: String,
    },
    /// Creating the output directory failed.
    #[error("create report directory {path}")]
    CreateDir {
        /// Directory.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Serializing `report.json` failed.
    #[error("serialize report json")]
    SerializeJson {
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// Drawing a plot failed.
    #[error("draw plot {file}")]
    Draw {
        /// Plot file name.
        file: String,
        /// Cause.
        #[source]
        source: DrawError,
    },
    /// Writing a report file failed.
    #[error("write report file {path}")]
    Write {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Reading `report.json` failed.
    #[error("read report {path}")]
    Read {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// `report.json` does not parse as a [`ReportJson`].
    #[error("parse report {path}")]
    ParseJson {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Writes `report.json`, `report.md`, `increase.svg` and one `timeline-<run>.svg` per run
/// (`timeline-failure-free.svg` and one per policy; characters of the policy name other than
/// ASCII letters, digits, `-` and `_` become `-`, so `every:5` gives `timeline-every-5.svg`) into
/// `dir`, creating it. Each file is written to a temporary name and renamed into place.
///
/// Returns the paths written, `report.json` first.
///
/// Errors: [`ReportError::DuplicatePolicy`], [`ReportError::CreateDir`],
/// [`ReportError::SerializeJson`], [`ReportError::Draw`], [`ReportError::Write`].
pub fn write_report(dir: &Path, report: &RolloutReport) -> Result<Vec<PathBuf>, ReportError> {
    let mut seen = HashSet::new();
    for p in &report.policies {
        if !seen.insert(p.name.as_str()) {
            return Err(ReportError::DuplicatePolicy {
                name: p.name.clone(),
            });
        }
    }
    std::fs::create_dir_all(dir).map_err(|source| ReportError::CreateDir {
        path: dir.to_path_buf(),
        source,
    })?;

    let mut written = Vec::new();
    let json = serde_json::to_vec_pretty(&ReportJson::from(report))
        .map_err(|source| ReportError::SerializeJson { source })?;
    written.push(write_file(dir, REPORT_JSON, &json)?);

    let mut used = HashSet::new();
    let mut timelines = Vec::new();
    for run in std::iter::once(&report.failure_free).chain(&report.policies) {
        let display = if std::ptr::eq(run, &report.failure_free) {
            "failure-free".to_owned()
        } else {
            run.name.clone()
        };
        let mut file = format!("timeline-{}.svg", slug(&display));
        let mut n = 2;
        while !used.insert(file.clone()) {
            file = format!("timeline-{}-{n}.svg", slug(&display));
            n += 1;
        }
        timelines.push((display, file, run));
    }
    let links: Vec<(String, String)> = timelines
        .iter()
        .map(|(name, file, _)| (name.clone(), file.clone()))
        .collect();
    let md = markdown::render(report, INCREASE_SVG, &links);
    written.push(write_file(dir, REPORT_MD, md.as_bytes())?);

    let svg = plot::increase_svg(report).map_err(|source| ReportError::Draw {
        file: INCREASE_SVG.to_owned(),
        source,
    })?;
    written.push(write_file(dir, INCREASE_SVG, svg.as_bytes())?);
    for (_, file, run) in timelines {
        let svg = plot::timeline_svg(run).map_err(|source| ReportError::Draw {
            file: file.clone(),
            source,
        })?;
        written.push(write_file(dir, &file, svg.as_bytes())?);
    }
    tracing::info!(dir = %dir.display(), files = written.len(), "rollout report written");
    Ok(written)
}

/// Reads `report.json` from `path` (the file, or the directory holding it) back into a
/// [`RolloutReport`] (policies in run order).
///
/// Errors: [`ReportError::Read`], [`ReportError::ParseJson`].
pub fn read_report(path: &Path) -> Result<RolloutReport, ReportError> {
    let file = if path.is_dir() {
        path.join(REPORT_JSON)
    } else {
        path.to_path_buf()
    };
    let bytes = std::fs::read(&file).map_err(|source| ReportError::Read {
        path: file.clone(),
        source,
    })?;
    let json: ReportJson = serde_json::from_slice(&bytes)
        .map_err(|source| ReportError::ParseJson { path: file, source })?;
    Ok(json.into())
}

/// `name` with every character other than ASCII letters, digits, `-`, `_` replaced by `-`.
fn slug(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '-'
            }
        })
        .collect();
    if s.is_empty() {
        "run".to_owned()
    } else {
        s
    }
}

fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<PathBuf, ReportError> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, bytes)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|source| {
            let _ = std::fs::remove_file(&tmp);
            ReportError::Write {
                path: path.clone(),
                source,
            }
        })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timeline(name: &str, failures: bool) -> TrajectoryTimeline {
        let mut events = Vec::new();
        let mut t = 0.0;
        for step in 1..=4 {
            events.push(TimelineEvent {
                kind: EventKind::Llm,
                step,
                start_s: t,
                end_s: t + 2.0,
            });
            events.push(TimelineEvent {
                kind: EventKind::Action,
                step,
                start_s: t + 2.0,
                end_s: t + 2.5,
            });
            events.push(TimelineEvent {
                kind: EventKind::Checkpoint,
                step,
                start_s: t + 2.5,
                end_s: t + 3.0,
            });
            t += 2.5;
            if failures && step == 2 {
                events.push(TimelineEvent {
                    kind: EventKind::Failure,
                    step,
                    start_s: t,
                    end_s: t,
                });
                events.push(TimelineEvent {
                    kind: EventKind::Restore,
                    step,
                    start_s: t,
                    end_s: t + 0.4,
                });
                t += 0.4;
            }
        }
        TrajectoryTimeline {
            trajectory: name.into(),
            events,
        }
    }

    fn result(name: &str, makespan_s: f64, failures: bool) -> PolicyResult {
        PolicyResult {
            name: name.into(),
            makespan_s,
            failures: u64::from(failures),
            restores: u64::from(failures),
            regenerated_steps: 1,
            regenerated_s: 2.5,
            checkpoints_taken: 4,
            checkpoints_skipped: 1,
            checkpoint_hidden_s: 1.5,
            checkpoint_visible_s: 0.5,
            bytes_written: 4096,
            timeline: vec![
                timeline("django__django-11099", failures),
                timeline("astropy|1", false),
            ],
            ..PolicyResult::default()
        }
    }

    fn report() -> RolloutReport {
        let mut r = RolloutReport {
            config: RunConfig {
                trajectories: vec!["django__django-11099".into(), "astropy|1".into()],
                seed: 7,
                failure_rate: 0.05,
                time_scale: 0.01,
                concurrency: 2,
                image: "debian-python3".into(),
            },
            failure_free: result("failure-free", 10.0, false),
            policies: vec![
                result("adaptive", 10.5, true),
                result("every:2", 11.0, true),
                PolicyResult {
                    validity_errors: vec!["file tree digest mismatch at k=2".into()],
                    ..result("restart", 14.0, true)
                },
                result("never", 9.5, false),
            ],
        };
        r.fill_increases();
        r
    }

    #[test]
    fn increases_are_filled() {
        let r = report();
        assert_eq!(r.failure_free.increase_s, 0.0);
        assert_eq!(r.policies[0].increase_s, 0.5);
        assert_eq!(r.policies[0].increase_pct, 5.0);
        assert_eq!(r.policies[3].increase_s, -0.5);
        let mut zero = PolicyResult::default();
        zero.set_increase(0.0);
        assert_eq!(zero.increase_pct, 0.0);
    }

    #[test]
    fn writes_parseable_json_markdown_and_svgs() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let r = report();
        let files = write_report(&out, &r).unwrap();
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            names,
            [
                "report.json",
                "report.md",
                "increase.svg",
                "timeline-failure-free.svg",
                "timeline-adaptive.svg",
                "timeline-every-2.svg",
                "timeline-restart.svg",
                "timeline-never.svg"
            ]
        );
        for f in &files {
            assert!(f.starts_with(&out) && f.is_file(), "{}", f.display());
        }
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(&out).unwrap().count(), files.len());

        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("report.json")).unwrap()).unwrap();
        assert_eq!(v["failure_free"]["makespan_s"], 10.0);
        let policies = v["policies"].as_object().unwrap();
        assert_eq!(policies.len(), 4);
        for name in ["adaptive", "every:2", "restart", "never"] {
            let p = &policies[name];
            for key in [
                "makespan_s",
                "increase_s",
                "increase_pct",
                "failures",
                "restores",
                "regenerated_steps",
                "regenerated_s",
                "checkpoints_taken",
                "checkpoints_skipped",
                "checkpoint_hidden_s",
                "checkpoint_visible_s",
                "validity_errors",
                "bytes_written",
            ] {
                assert!(p.get(key).is_some_and(|x| x.is_number()), "{name}.{key}");
            }
        }
        assert_eq!(policies["adaptive"]["increase_s"], 0.5);
        assert_eq!(policies["restart"]["validity_errors"], 1);
        assert_eq!(
            policies["restart"]["validity_error_messages"][0],
            "file tree digest mismatch at k=2"
        );
        assert_eq!(v["policy_order"][1], "every:2");
        assert_eq!(v["config"]["seed"], 7);
        assert_eq!(
            v["timelines"]["policies"]["adaptive"][0]["events"][0]["kind"],
            "llm"
        );

        // Reading back gives the same report.
        assert_eq!(read_report(&out).unwrap(), r);
        assert_eq!(read_report(&out.join("report.json")).unwrap(), r);

        let md = std::fs::read_to_string(out.join("report.md")).unwrap();
        assert!(md.contains("| adaptive | 10.50 | +0.50 | +5.0 |"), "{md}");
        assert!(md.contains("astropy\\|1") || md.contains("`astropy|1`"));
        assert!(md.contains("(increase.svg)"));
        assert!(md.contains("(timeline-every-2.svg)"));
        assert!(md.contains("file tree digest mismatch at k=2"));

        for f in files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "svg"))
        {
            let s = std::fs::read_to_string(f).unwrap();
            assert!(
                s.starts_with("<svg") || s.starts_with("<?xml"),
                "{}",
                f.display()
            );
            assert!(s.trim_end().ends_with("</svg>"), "{}", f.display());
        }
        let bars = std::fs::read_to_string(out.join("increase.svg")).unwrap();
        assert!(bars.contains("+4.0 s (+40.0%)"), "restart's label");
        assert!(bars.contains("every:2"));
        let tl = std::fs::read_to_string(out.join("timeline-adaptive.svg")).unwrap();
        assert!(tl.contains("django__django-11099"));
        assert!(tl.contains("checkpoint"));
    }

    #[test]
    fn empty_runs_still_plot_and_duplicates_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = report();
        r.policies.clear();
        r.failure_free.timeline.clear();
        r.failure_free.makespan_s = 0.0;
        let files = write_report(dir.path(), &r).unwrap();
        assert_eq!(files.len(), 4);

        let mut r = report();
        r.policies.push(result("adaptive", 1.0, false));
        assert!(matches!(
            write_report(dir.path(), &r),
            Err(ReportError::DuplicatePolicy { name }) if name == "adaptive"
        ));
        assert!(matches!(
            read_report(&dir.path().join("missing")),
            Err(ReportError::Read { .. })
        ));
        std::fs::write(dir.path().join("bad.json"), b"{}").unwrap();
        assert!(matches!(
            read_report(&dir.path().join("bad.json")),
            Err(ReportError::ParseJson { .. })
        ));
    }

    #[test]
    fn slugs() {
        assert_eq!(slug("every:5"), "every-5");
        assert_eq!(slug("a_b-c"), "a_b-c");
        assert_eq!(slug(""), "run");
    }
}
