//! `report.md`: the run's configuration, a summary table and links to the plots.

use std::fmt::Write;

use super::model::{PolicyResult, RolloutReport};

/// Renders `report.md`; `increase_plot` and `timeline_plots` ((run name, file name)) are the plot
/// files next to it.
pub(super) fn render(
    report: &RolloutReport,
    increase_plot: &str,
    timeline_plots: &[(String, String)],
) -> String {
    let c = &report.config;
    let mut md = String::new();
    // Writing to a String cannot fail.
    let _ = writeln!(md, "# Rollout report\n");
    let _ = writeln!(md, "## Configuration\n");
    let _ = writeln!(md, "| setting | value |\n|---|---|");
    let _ = writeln!(md, "| trajectories | {} |", c.trajectories.len());
    let _ = writeln!(md, "| failure rate (per step) | {} |", c.failure_rate);
    let _ = writeln!(md, "| seed | {} |", c.seed);
    let _ = writeln!(md, "| time scale | {} |", c.time_scale);
    let _ = writeln!(md, "| concurrency | {} |", c.concurrency);
    let _ = writeln!(md, "| image | {} |", cell(&c.image));
    let _ = writeln!(
        md,
        "\nTrajectories: {}\n",
        c.trajectories
            .iter()
            .map(|t| format!("`{t}`"))
            .collect::<Vec<_>>()
            .join(", ")
    );

    let _ = writeln!(md, "## Results\n");
    let _ = writeln!(
        md,
        "Failure-free makespan: **{:.2} s**. Increase is the makespan over the failure-free run.\n",
        report.failure_free.makespan_s
    );
    let _ = writeln!(
        md,
        "| policy | makespan (s) | increase (s) | increase (%) | failures | restores | regenerated steps | regenerated (s) | checkpoints taken | skipped | hidden (s) | visible (s) | bytes written | validity errors |"
    );
    let _ = writeln!(
        md,
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    );
    for r in std::iter::once(&report.failure_free).chain(&report.policies) {
        row(&mut md, r);
    }

    let bad: Vec<&PolicyResult> = report
        .policies
        .iter()
        .chain(std::iter::once(&report.failure_free))
        .filter(|p| !p.validity_errors.is_empty())
        .collect();
    if !bad.is_empty() {
        let _ = writeln!(md, "\n## Validity errors\n");
        for p in bad {
            for e in &p.validity_errors {
                let _ = writeln!(md, "- `{}`: {}", p.name, e.replace('\n', " "));
            }
        }
    }

    let _ = writeln!(md, "\n## Plots\n");
    let _ = writeln!(
        md,
        "- [Rollout-time increase per policy]({increase_plot})\n\n![increase]({increase_plot})\n"
    );
    for (name, file) in timeline_plots {
        let _ = writeln!(md, "- [Timeline: {}]({file})", cell(name));
    }
    md
}

fn row(md: &mut String, r: &PolicyResult) {
    let _ = writeln!(
        md,
        "| {} | {:.2} | {:+.2} | {:+.1} | {} | {} | {} | {:.2} | {} | {} | {:.2} | {:.2} | {} | {} |",
        cell(&r.name),
        r.makespan_s,
        r.increase_s,
        r.increase_pct,
        r.failures,
        r.restores,
        r.regenerated_steps,
        r.regenerated_s,
        r.checkpoints_taken,
        r.checkpoints_skipped,
        r.checkpoint_hidden_s,
        r.checkpoint_visible_s,
        r.bytes_written,
        r.validity_errors.len()
    );
}

/// Escapes a table cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}
