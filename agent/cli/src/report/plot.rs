//! SVG plots drawn with plotters (SVG backend, no system fonts: text stays SVG `<text>`).

use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::drawing::DrawingAreaErrorKind;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::model::{EventKind, PolicyResult, RolloutReport};

/// Drawing error of the SVG backend.
pub type DrawError = DrawingAreaErrorKind<std::io::Error>;

const FONT: &str = "sans-serif";

/// Bar colors per policy, cycled.
const BAR_COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn event_color(kind: EventKind) -> RGBColor {
    match kind {
        EventKind::Llm => RGBColor(174, 199, 232),
        EventKind::Action => RGBColor(31, 119, 180),
        EventKind::Checkpoint => RGBColor(44, 160, 44),
        EventKind::Failure => RGBColor(214, 39, 40),
        EventKind::Restore => RGBColor(255, 127, 14),
        EventKind::Restart => RGBColor(148, 103, 189),
    }
}

/// The end of segment `i` of `n` on a segmented axis over `0..=n-1`.
fn segment_end(i: usize, n: usize) -> SegmentValue<usize> {
    if i + 1 < n {
        SegmentValue::Exact(i + 1)
    } else {
        SegmentValue::Last
    }
}

/// Bar chart of each policy's rollout-time increase over failure-free, seconds, labeled with the
/// seconds and percent (paper, Figure 12).
pub(super) fn increase_svg(report: &RolloutReport) -> Result<String, DrawError> {
    let policies = &report.policies;
    let n = policies.len().max(1);
    let names: Vec<&str> = policies.iter().map(|p| p.name.as_str()).collect();
    let values: Vec<f64> = policies.iter().map(|p| finite(p.increase_s)).collect();
    let lo = values.iter().copied().fold(0.0f64, f64::min);
    let hi = values.iter().copied().fold(0.0f64, f64::max);
    let span = if hi - lo > 0.0 { hi - lo } else { 1.0 };
    let (y0, y1) = (
        if lo < 0.0 { lo - 0.15 * span } else { 0.0 },
        hi + 0.15 * span,
    );

    let width = (160 * n as u32 + 160).max(640);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (width, 480)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!(
                    "Rollout-time increase over failure-free ({:.1} s), p = {}",
                    report.failure_free.makespan_s, report.config.failure_rate
                ),
                (FONT, 18),
            )
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d((0..n - 1).into_segmented(), y0..y1)?;
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                names.get(*i).map(|s| (*s).to_owned()).unwrap_or_default()
            }
            SegmentValue::Last => String::new(),
        };
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(n)
            .x_label_formatter(&label)
            .y_desc("increase over failure-free (s)")
            .label_style((FONT, 14))
            .draw()?;
        chart.draw_series(values.iter().enumerate().map(|(i, &v)| {
            let mut bar = Rectangle::new(
                [(SegmentValue::Exact(i), 0.0), (segment_end(i, n), v)],
                BAR_COLORS[i % BAR_COLORS.len()].filled(),
            );
            bar.set_margin(0, 0, 24, 24);
            bar
        }))?;
        let text_style =
            TextStyle::from((FONT, 14).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
        chart.draw_series(policies.iter().enumerate().map(|(i, p)| {
            Text::new(
                format!(
                    "{:+.1} s ({:+.1}%)",
                    finite(p.increase_s),
                    finite(p.increase_pct)
                ),
                (
                    SegmentValue::CenterOf(i),
                    finite(p.increase_s).max(0.0) + 0.02 * span,
                ),
                text_style.clone(),
            )
        }))?;
        root.present()?;
    }
    Ok(svg)
}

/// Timeline of one run: a row per trajectory with LLM waits, actions, checkpoints (lower half of
/// the row, since they overlap the LLM wait), restores, restarts, and failures as red marks.
pub(super) fn timeline_svg(run: &PolicyResult) -> Result<String, DrawError> {
    let rows = run.timeline.len().max(1);
    let end = run
        .timeline
        .iter()
        .flat_map(|t| t.events.iter())
        .map(|e| finite(e.end_s).max(finite(e.start_s)))
        .fold(finite(run.makespan_s), f64::max);
    let x_max = if end > 0.0 { end * 1.02 } else { 1.0 };
    let label_px = run
        .timeline
        .iter()
        .map(|t| t.trajectory.chars().count())
        .max()
        .unwrap_or(0)
        .clamp(6, 48) as u32
        * 7
        + 20;
    // 26 px per trajectory row plus legend, caption and axis.
    let height = 26 * rows as u32 + 130;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (1200, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (legend, body) = root.split_vertically(34);
        draw_legend(&legend)?;
        let mut chart = ChartBuilder::on(&body)
            .caption(format!("Timeline: {}", run.name), (FONT, 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(label_px)
            .build_cartesian_2d(0.0..x_max, (0..rows - 1).into_segmented())?;
        let names: Vec<&str> = run.timeline.iter().map(|t| t.trajectory.as_str()).collect();
        // Row r (from the bottom) shows trajectory rows - 1 - r, so the first one is on top.
        let row_of = |i: usize| rows - 1 - i;
        let label = |v: &SegmentValue<usize>| match v {
            SegmentValue::CenterOf(r) | SegmentValue::Exact(r) if *r < rows => names
                .get(rows - 1 - *r)
                .map(|s| (*s).to_owned())
                .unwrap_or_default(),
            _ => String::new(),
        };
        chart
            .configure_mesh()
            .disable_y_mesh()
            .y_labels(rows)
            .y_label_formatter(&label)
            .x_desc("time since start of the run (s)")
            .label_style((FONT, 12))
            .draw()?;

        let plot_row_px = chart.plotting_area().dim_in_pixel().1 / rows as u32;
        let full = (plot_row_px / 6, plot_row_px / 6);
        let lower = (plot_row_px / 2, plot_row_px / 6);
        for kind in [
            EventKind::Llm,
            EventKind::Action,
            EventKind::Restore,
            EventKind::Restart,
            EventKind::Checkpoint,
        ] {
            let (top, bottom) = if kind == EventKind::Checkpoint {
                lower
            } else {
                full
            };
            let color = event_color(kind);
            chart.draw_series(run.timeline.iter().enumerate().flat_map(|(i, t)| {
                let r = row_of(i);
                t.events
                    .iter()
                    .filter(move |e| e.kind == kind && e.end_s > e.start_s)
                    .map(move |e| {
                        let mut rect = Rectangle::new(
                            [
                                (finite(e.start_s), SegmentValue::Exact(r)),
                                (finite(e.end_s), segment_end(r, rows)),
                            ],
                            color.filled(),
                        );
                        rect.set_margin(top, bottom, 0, 0);
                        rect
                    })
            }))?;
        }
        let red = event_color(EventKind::Failure);
        chart.draw_series(run.timeline.iter().enumerate().flat_map(|(i, t)| {
            let r = row_of(i);
            t.events
                .iter()
                .filter(|e| e.kind == EventKind::Failure)
                .flat_map(move |e| {
                    let x = finite(e.start_s);
                    [
                        PathElement::new(
                            vec![(x, SegmentValue::Exact(r)), (x, segment_end(r, rows))],
                            red.stroke_width(2),
                        )
                        .into_dyn(),
                        Cross::new((x, SegmentValue::CenterOf(r)), 5, red.stroke_width(2))
                            .into_dyn(),
                    ]
                })
        }))?;
        root.present()?;
    }
    Ok(svg)
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let style = TextStyle::from((FONT, 13).into_font()).pos(Pos::new(HPos::Left, VPos::Center));
    let mut x = 16;
    let y = 18;
    for kind in EventKind::ALL {
        let color = event_color(kind);
        area.draw(&Rectangle::new(
            [(x, y - 6), (x + 14, y + 6)],
            color.filled(),
        ))?;
        area.draw(&Text::new(kind.as_str(), (x + 20, y), style.clone()))?;
        x += 20 + 9 * kind.as_str().len() as i32 + 24;
    }
    Ok(())
}

/// Non-finite values (which plotters cannot place) as 0.
fn finite(v: f64) -> f64 {
    if v.is_finite() {
        v
    } else {
        0.0
    }
}
