//! The charts of `ragen-lab plot`: one SVG and one PNG per metric panel plus an overview of all
//! panels, several runs on one chart (colour = run, line style = series), alarms (red) and
//! script swaps (grey) marked on the step axis.
//!
//! Drawing is plotters on its SVG backend and an RGB bitmap that [`super::png`] encodes. Text
//! uses DejaVu Sans (subset to Latin-1 and a few symbols, licence in `fonts/LICENSE-DejaVu`),
//! embedded so a plot looks the same on every machine and needs no system fonts.
use super::keys::Key;
use super::run::{series, Run};
use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::{Path, PathBuf};

static FONT: &[u8] = include_bytes!("fonts/DejaVuSans-subset.ttf");

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The bytes are ours and tested; a failure here is a build defect, not a user error.
        if plotters::style::register_font("sans-serif", FontStyle::Normal, FONT).is_err() {
            panic!("embedded font src/metrics/fonts/DejaVuSans-subset.ttf is not a valid font");
        }
    });
}

/// One series on a panel: a metric key, its legend label, and optionally a ± band key.
#[derive(Clone, Copy, Debug)]
pub struct Line {
    pub key: Key,
    pub label: &'static str,
    pub band: Option<Key>,
}

const fn line(key: Key, label: &'static str) -> Line {
    Line { key, label, band: None }
}

/// One chart: a file stem, a title, a y-axis label, and its series.
#[derive(Clone, Copy, Debug)]
pub struct Panel {
    pub file: &'static str,
    pub title: &'static str,
    pub y: &'static str,
    pub lines: &'static [Line],
}

/// The panels, in overview order (RAGEN Fig. 6's signals first after reward and success).
pub const PANELS: &[Panel] = &[
    Panel {
        file: "reward",
        title: "Reward (mean ± std over the batch)",
        y: "reward",
        lines: &[Line { key: Key::RewardMean, label: "reward", band: Some(Key::RewardStd) }],
    },
    Panel {
        file: "success",
        title: "Success rate (and how often validation moves are the solver's)",
        y: "share",
        lines: &[
            line(Key::Success, "train"),
            line(Key::ValSuccess, "validation"),
            line(Key::HeldoutSuccess, "held-out"),
            line(Key::ValSolverAgreement, "validation: solver agreement"),
            line(Key::HeldoutSolverAgreement, "held-out: solver agreement"),
        ],
    },
    Panel {
        file: "in_group_std",
        title: "In-group reward std (Echo-Trap early warning)",
        y: "std",
        lines: &[line(Key::InGroupStd, "all groups"), line(Key::InGroupStdKept, "kept groups")],
    },
    Panel { file: "entropy", title: "Token entropy", y: "nats", lines: &[line(Key::Entropy, "entropy")] },
    Panel { file: "grad_norm", title: "Gradient norm", y: "norm", lines: &[line(Key::GradNorm, "grad norm")] },
    Panel {
        file: "length",
        title: "Response and think length",
        y: "tokens per turn",
        lines: &[line(Key::ResponseLen, "response"), line(Key::ThinkLen, "think")],
    },
    Panel {
        file: "kl",
        title: "KL to the reference",
        y: "KL",
        lines: &[line(Key::Kl, "kl"), line(Key::ApproxKl, "approx kl (old policy)")],
    },
    Panel { file: "clip_frac", title: "Clip fraction", y: "fraction", lines: &[line(Key::ClipFrac, "clip fraction")] },
    Panel {
        file: "mutual_info",
        title: "Template collapse: MI(prompt; reasoning)",
        y: "nats / accuracy",
        lines: &[
            line(Key::MiEstimate, "MI estimate"),
            line(Key::MiUpperBound, "bound ln N"),
            line(Key::RetrievalAccuracy, "retrieval accuracy"),
            line(Key::RetrievalChance, "chance 1/N"),
        ],
    },
];

/// tab10 without its red, which marks alarms: one colour per run (or per series for one run).
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];
const ALARM: RGBColor = RGBColor(214, 39, 40);
const SWAP: RGBColor = RGBColor(110, 110, 110);

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("drawing: {e}")
}

/// Whether any run has any of the panel's keys.
fn has_data(panel: &Panel, runs: &[Run]) -> bool {
    runs.iter().any(|r| panel.lines.iter().any(|l| !series(&r.metrics, l.key.name()).is_empty()))
}

/// Tick labels on the step axis: at most 8, and no more than there are whole steps in the
/// window, so a two-step run does not get eight ticks all labelled "1".
fn x_label_count(x0: f64, x1: f64) -> usize {
    ((x1 - x0).round() as usize + 1).clamp(2, 8)
}

/// A step-axis tick's label: whole steps only (a tick between two steps stays unlabelled).
fn step_label(x: f64) -> String {
    if (x - x.round()).abs() < 1e-6 {
        format!("{x:.0}")
    } else {
        String::new()
    }
}

/// The largest magnitude drawn: beyond it a value sits at the edge, so that the window's width
/// and padding stay finite (a reward may return ±1e308, and an infinite axis never ends its ticks).
const AXIS_LIMIT: f64 = 1e300;

fn on_axis(y: f64) -> f64 {
    y.clamp(-AXIS_LIMIT, AXIS_LIMIT)
}

/// The y window around the data's range `(lo, hi)`: 6% padding, and a unit-sized window around a
/// flat series (say a constant reward, with float dust).
fn y_window((lo, hi): (f64, f64)) -> (f64, f64) {
    let flat = hi - lo <= 1e-9 * lo.abs().max(hi.abs()).max(1.0);
    let pad = if flat { 0.5 * lo.abs().max(1.0) } else { 0.06 * (hi - lo) };
    (lo - pad, hi + pad)
}

/// Draws one panel on an area (any backend).
fn draw_panel<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, panel: &Panel, runs: &[Run], font: u32) -> Result<()> {
    let mut data = vec![]; // (run index, line index, points, band)
    for (ri, run) in runs.iter().enumerate() {
        for (li, l) in panel.lines.iter().enumerate() {
            let pts = series(&run.metrics, l.key.name());
            if pts.is_empty() {
                continue;
            }
            let band: Vec<(u64, f64, f64)> = match l.band {
                Some(b) => {
                    let sd = series(&run.metrics, b.name());
                    pts.iter()
                        .filter_map(|&(s, m)| sd.iter().find(|p| p.0 == s).map(|&(_, d)| (s, m - d, m + d)))
                        .collect()
                }
                None => vec![],
            };
            data.push((ri, li, pts, band));
        }
    }
    let steps = data.iter().flat_map(|d| d.2.iter().map(|p| p.0));
    let (x0, x1) = steps.fold((u64::MAX, 0), |(a, b), s| (a.min(s), b.max(s)));
    let (x0, x1) = (x0 as f64, if x1 > x0 { x1 as f64 } else { x0 as f64 + 1.0 });
    for d in &mut data {
        d.2.iter_mut().for_each(|p| p.1 = on_axis(p.1));
        d.3.iter_mut().for_each(|b| (b.1, b.2) = (on_axis(b.1), on_axis(b.2)));
    }
    let ys = data.iter().flat_map(|d| d.2.iter().map(|p| p.1).chain(d.3.iter().flat_map(|b| [b.1, b.2])));
    let (y0, y1) = y_window(ys.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), y| (a.min(y), b.max(y))));
    let decimals = (-((y1 - y0) / 6.0).log10().floor()).clamp(0.0, 6.0) as usize;
    let y_label = move |v: &f64| {
        // No "-0.0": values that are zero at the axis' precision print as 0.
        let v = if v.abs() < 0.5 * 10f64.powi(-(decimals as i32)) { 0.0 } else { *v };
        if v.abs() >= 1e7 {
            format!("{v:.2e}")
        } else {
            format!("{v:.decimals$}")
        }
    };

    let mut chart = ChartBuilder::on(area)
        .caption(panel.title, ("sans-serif", font + 4))
        .margin(8)
        .x_label_area_size(font * 3)
        .y_label_area_size(font * 4 + 8)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(panel.y)
        .x_labels(x_label_count(x0, x1))
        .y_labels(6)
        .x_label_formatter(&|x| step_label(*x))
        .y_label_formatter(&y_label)
        .label_style(("sans-serif", font))
        .axis_desc_style(("sans-serif", font))
        .light_line_style(RGBColor(246, 246, 246))
        .draw()
        .map_err(err)?;

    // Markers under the data: script swaps grey, alarms red at the step their condition began.
    let many = runs.len() > 1;
    let mut nth_label = 0; // staggers labels of alarms that fall close together, across runs
    for run in runs {
        for e in run.events.iter().filter(|e| e.kind == "swap" || e.kind == "reload_error") {
            let x = e.step as f64;
            chart.draw_series(DashedLineSeries::new([(x, y0), (x, y1)], 4, 4, SWAP.stroke_width(1))).map_err(err)?;
        }
        for a in &run.alarms {
            let x = a.since as f64;
            chart
                .draw_series(std::iter::once(PathElement::new([(x, y0), (x, y1)], ALARM.stroke_width(1))))
                .map_err(err)?;
            let y = y1 - (y1 - y0) * (0.04 + 0.07 * (nth_label % 4) as f64);
            nth_label += 1;
            let style = ("sans-serif", font.saturating_sub(2).max(8)).into_font().color(&ALARM);
            let name = if many { format!("{}: {}", run.name, a.kind) } else { a.kind.clone() };
            // Labels near the right edge run leftwards so they stay inside the plot.
            let (label, style) = if x > x0 + 0.7 * (x1 - x0) {
                (format!("{name} "), style.pos(Pos::new(HPos::Right, VPos::Top)))
            } else {
                (format!(" {name}"), style)
            };
            chart.draw_series(std::iter::once(Text::new(label, (x, y), style))).map_err(err)?;
        }
    }

    for (ri, li, pts, band) in &data {
        // One run: colour tells the series apart; several: colour is the run, style the series.
        let colour = PALETTE[if many { *ri } else { *li } % PALETTE.len()];
        if !band.is_empty() {
            let poly: Vec<(f64, f64)> =
                band.iter().map(|b| (b.0 as f64, b.2)).chain(band.iter().rev().map(|b| (b.0 as f64, b.1))).collect();
            chart.draw_series(std::iter::once(Polygon::new(poly, colour.mix(0.18).filled()))).map_err(err)?;
        }
        let xy: Vec<(f64, f64)> = pts.iter().map(|&(s, y)| (s as f64, y)).collect();
        let style = colour.stroke_width(2);
        let label = match (many, panel.lines.len() > 1) {
            (true, true) => format!("{} {}", runs[*ri].name, panel.lines[*li].label),
            (true, false) => runs[*ri].name.clone(),
            _ => panel.lines[*li].label.to_string(),
        };
        // Line style tells the series of one run apart: solid, dashed, dotted, dash-dot-ish.
        let drawn = match li {
            0 => chart.draw_series(LineSeries::new(xy.clone(), style)),
            1 => chart.draw_series(DashedLineSeries::new(xy.clone(), 8, 5, style)),
            2 => chart.draw_series(DashedLineSeries::new(xy.clone(), 2, 4, style)),
            _ => chart.draw_series(DashedLineSeries::new(xy.clone(), 12, 3, colour.stroke_width(1))),
        }
        .map_err(err)?;
        let li = *li;
        drawn.label(label).legend(move |(x, y)| {
            let end = if li == 0 { x + 20 } else { x + 10 };
            PathElement::new(vec![(x, y), (end, y)], colour.stroke_width(2))
        });
        // Sparse series (validation every n steps) also get dots, so single points show.
        if xy.len() <= 1 || (x1 - x0) / xy.len() as f64 > 3.0 {
            chart.draw_series(xy.iter().map(|&p| Circle::new(p, 3, colour.filled()))).map_err(err)?;
        }
    }
    chart
        .configure_series_labels()
        .label_font(("sans-serif", font))
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(200, 200, 200))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// What one output file shows: a single panel, or all shown panels in a grid (rows, cols).
enum Figure<'a> {
    Panel(&'a Panel),
    Overview(&'a [&'a Panel], (usize, usize)),
}

impl Figure<'_> {
    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>, runs: &[Run]) -> Result<()> {
        match self {
            Figure::Panel(p) => draw_panel(area, p, runs, 15),
            Figure::Overview(panels, grid) => {
                for (cell, p) in area.split_evenly(*grid).iter().zip(panels.iter()) {
                    draw_panel(cell, p, runs, 13)?;
                }
                Ok(())
            }
        }
    }
}

/// Renders a figure both as SVG and as PNG (same size and font, so the same layout).
fn render(out: &Path, stem: &str, size: (u32, u32), fig: &Figure, runs: &[Run]) -> Result<Vec<PathBuf>> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        fig.draw(&root, runs)?;
        root.present().map_err(err)?;
    }
    let mut rgb = vec![255u8; (size.0 * size.1 * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, size).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        fig.draw(&root, runs)?;
        root.present().map_err(err)?;
    }
    let (svg_path, png_path) = (out.join(format!("{stem}.svg")), out.join(format!("{stem}.png")));
    write(&svg_path, svg.as_bytes())?;
    write(&png_path, &super::png::encode_rgb(size.0, size.1, &rgb)?)?;
    Ok(vec![png_path, svg_path])
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| anyhow!("writing {}: {e}", path.display()))
}

/// Writes `<panel>.png/.svg` for every panel some run has data for, and `overview.png/.svg` with
/// all of them. Returns the files written and the panels skipped for lack of data.
pub fn plot_runs(runs: &[Run], out: &Path) -> Result<(Vec<PathBuf>, Vec<&'static str>)> {
    register_font();
    std::fs::create_dir_all(out).map_err(|e| anyhow!("creating {}: {e}", out.display()))?;
    let (shown, skipped): (Vec<&Panel>, Vec<&Panel>) = PANELS.iter().partition(|p| has_data(p, runs));
    anyhow::ensure!(
        !shown.is_empty(),
        "no metrics to plot in {} (metrics.jsonl is empty or missing)",
        runs.iter().map(|r| r.dir.display().to_string()).collect::<Vec<_>>().join(", ")
    );
    let mut files = vec![];
    for p in &shown {
        files.extend(render(out, p.file, (900, 520), &Figure::Panel(p), runs)?);
    }
    let cols = 3.min(shown.len());
    let rows = shown.len().div_ceil(cols);
    let size = (cols as u32 * 620, rows as u32 * 380);
    files.extend(render(out, "overview", size, &Figure::Overview(&shown, (rows, cols)), runs)?);
    Ok((files, skipped.iter().map(|p| p.file).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use plotters::coord::ranged1d::Ranged;
    use plotters::coord::types::RangedCoordf64;

    /// The labels plotters would print on the step axis of a run of `steps` steps.
    fn step_axis(steps: u64) -> Vec<String> {
        let (x0, x1) = (1.0, if steps > 1 { steps as f64 } else { 2.0 });
        let axis: RangedCoordf64 = (x0..x1).into();
        axis.key_points(x_label_count(x0, x1)).into_iter().map(step_label).filter(|l| !l.is_empty()).collect()
    }

    #[test]
    fn the_y_window_stays_finite_for_extreme_values() {
        let (lo, hi) = y_window((on_axis(-1e308), on_axis(f64::MAX)));
        assert!(lo.is_finite() && hi.is_finite() && lo < -1e300 && hi > 1e300, "{lo} {hi}");
        assert_eq!(y_window((2.0, 2.0)), (1.0, 3.0), "a flat series gets a unit-sized window");
        let (lo, hi) = y_window((1e-308, 2e-308));
        assert!(lo < 1e-308 && hi > 2e-308 && hi - lo > 0.0);
    }

    #[test]
    fn short_runs_get_each_step_label_once() {
        for steps in [1, 2, 3, 5, 12, 200] {
            let labels = step_axis(steps);
            let unique: std::collections::HashSet<_> = labels.iter().collect();
            assert_eq!(unique.len(), labels.len(), "{steps} steps: {labels:?}");
            assert!(!labels.is_empty() && labels.len() <= 8, "{steps} steps: {labels:?}");
        }
    }
}
