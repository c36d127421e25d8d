//! The charts of a report, drawn on any plotters backend.
use plotters::coord::Shift;
use plotters::coord::cartesian::Cartesian2d;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

use super::{Draw, RunData, text};
use train::metrics_log::StepRecord;

const TITLE: u32 = 30;
const AXIS: u32 = 20;
const LABEL: u32 = 16;
const BLUE_: RGBColor = RGBColor(31, 119, 180);
const ORANGE: RGBColor = RGBColor(255, 127, 14);
const GREEN_: RGBColor = RGBColor(44, 160, 44);
const RED_: RGBColor = RGBColor(214, 39, 40);
const GREY: RGBColor = RGBColor(90, 90, 90);
const PURPLE: RGBColor = RGBColor(148, 103, 189);

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;
/// A stacked layer of the breakdown: its name, colour and seconds of a step.
type Layer = (&'static str, RGBColor, fn(&StepRecord) -> f64);

/// Training loss per step, validation loss where measured.
pub(super) fn loss<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, d: &RunData) -> Draw
where
    DB::ErrorType: 'static,
{
    let train: Vec<(f64, f64)> = points(d, |r| r.loss);
    let val: Vec<(f64, f64)> = d
        .steps
        .values()
        .filter_map(|r| {
            r.val_loss
                .filter(|v| v.is_finite())
                .map(|v| (r.step as f64, v))
        })
        .collect();
    let y = span(train.iter().chain(&val).map(|p| p.1), false);
    let title = match d
        .summary
        .as_ref()
        .map(|s| s.final_loss)
        .filter(|l| l.is_finite())
    {
        Some(l) => format!("Loss (final training loss {l:.4})"),
        None => "Loss".to_string(),
    };
    let mut c = frame(area, &title, x_span(d), y, "loss (nats/token)")?;
    line(&mut c, train, BLUE_, "training loss")?;
    if !val.is_empty() {
        c.draw_series(val.iter().map(|&p| Circle::new(p, 5, RED_.filled())))
            .map_err(text)?;
        line(&mut c, val, RED_, "validation loss (held-out split)")?;
    }
    legend(&mut c, SeriesLabelPosition::UpperRight)
}

/// Tokens per second per step, with the run's mean.
pub(super) fn throughput<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, d: &RunData) -> Draw
where
    DB::ErrorType: 'static,
{
    let tps = points(d, |r| r.tokens_per_s);
    let (y, off) = span_after_first(&tps);
    let mut title = "Throughput (tokens/s, all ranks)".to_string();
    if let Some(s) = &d.summary {
        title = format!(
            "Throughput: mean {:.0} tokens/s, MFU {:.1}% (all ranks)",
            s.tokens_per_s,
            100.0 * s.mfu
        );
    }
    if off {
        title.push_str("; step 1 (warm-up) off scale");
    }
    let mut c = frame(area, &title, x_span(d), y, "tokens per second")?;
    line(&mut c, tps, BLUE_, "tokens/s per step")?;
    if let Some(s) = d.summary.as_ref().filter(|s| s.tokens_per_s > 0.0) {
        let (x0, x1) = x_span(d);
        let mean = vec![(x0, s.tokens_per_s), (x1, s.tokens_per_s)];
        line(&mut c, mean, GREY, "run mean (steps after the first)")?;
    }
    // Each straggler named: a dashed line at its step, labelled with the rank and slowdown.
    for (i, s) in d.stragglers.iter().enumerate() {
        let x = s.step as f64;
        let dashes = (0..20).map(|k| {
            let at = |f: f64| y.0 + (y.1 - y.0) * f;
            PathElement::new(
                vec![(x, at(k as f64 / 20.0)), (x, at((k as f64 + 0.5) / 20.0))],
                RED_.stroke_width(2),
            )
        });
        let series = c.draw_series(dashes).map_err(text)?;
        if i == 0 {
            series
                .label("straggler named")
                .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], RED_.stroke_width(2)));
        }
        let label = format!(" rank {} {:.1}x slower", s.rank, s.slowdown);
        let at = (x, y.1 - (y.1 - y.0) * (0.06 + 0.05 * i as f64));
        c.draw_series(std::iter::once(Text::new(
            label,
            at,
            ("sans-serif", LABEL).into_font().color(&RED_),
        )))
        .map_err(text)?;
    }
    legend(&mut c, SeriesLabelPosition::LowerRight)
}

/// The goodput ledger: one bar per generation and one for the run, its wall time split into
/// productive steps, steps trained again, restart, checkpoint pauses, data stalls and straggler
/// waits (seconds).
pub(super) fn goodput<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, d: &RunData) -> Draw
where
    DB::ErrorType: 'static,
{
    let Some(l) = &d.goodput else {
        return Ok(());
    };
    type Part = (&'static str, RGBColor, fn(&train::goodput::Share) -> f64);
    // Step time includes the straggler waits (part of the exposed communication); data
    // stalls and checkpoint pauses are outside it. What the ledger does not account for
    // (start-up, time between the steps) is the rest of the wall time.
    let parts: [Part; 7] = [
        ("productive steps", BLUE_, |s| {
            s.productive_s - s.straggler_wait_s
        }),
        ("straggler waits", PURPLE, |s| s.straggler_wait_s),
        ("steps trained again", RED_, |s| s.lost_s),
        ("checkpoint pauses", ORANGE, |s| s.ckpt_pause_s),
        ("data stalls", GREEN_, |s| s.data_stall_s),
        ("restart", GREY, |s| s.restart_s),
        (
            "unaccounted (between steps, start-up)",
            RGBColor(200, 200, 200),
            |s| {
                s.wall_s - s.productive_s - s.lost_s - s.ckpt_pause_s - s.data_stall_s - s.restart_s
            },
        ),
    ];
    let rows: Vec<(String, &train::goodput::Share)> = (l.generations.iter())
        .map(|g| (format!("generation {}", g.generation), g))
        .chain(std::iter::once(("run".to_string(), &l.run)))
        .collect();
    let widest = rows
        .iter()
        .map(|(_, s)| s.wall_s)
        .fold(0.0, f64::max)
        .max(1e-3);
    let mut title = format!(
        "Goodput {:.1}% of wall time, {} failure(s)",
        100.0 * l.goodput,
        l.failures
    );
    if let Some(p) = l.planner_goodput {
        title.push_str(&format!("; planner {:.1}%", 100.0 * p));
    }
    let n = rows.len() as f64;
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", TITLE))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(160)
        .build_cartesian_2d(0.0..widest * 1.35, -0.5..n - 0.5)
        .map_err(text)?;
    let names: Vec<String> = rows.iter().map(|(name, _)| name.clone()).collect();
    c.configure_mesh()
        .x_desc("seconds of wall time")
        .axis_desc_style(("sans-serif", AXIS))
        .label_style(("sans-serif", LABEL))
        .y_labels(rows.len())
        .y_label_formatter(&|v| {
            let i = v.round();
            match ((v - i).abs() < 1e-6, names.get(i as usize)) {
                (true, Some(name)) => name.clone(),
                _ => String::new(),
            }
        })
        .x_label_formatter(&|v| format!("{v:.1}"))
        .disable_y_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(text)?;
    for (k, (name, color, f)) in parts.iter().enumerate() {
        let color = *color;
        let bars = rows.iter().enumerate().map(|(i, (_, s))| {
            let x0: f64 = parts[..k].iter().map(|p| p.2(s).max(0.0)).sum();
            let x1 = x0 + f(s).max(0.0);
            let y = i as f64;
            Rectangle::new([(x0, y - 0.3), (x1, y + 0.3)], color.filled())
        });
        c.draw_series(bars)
            .map_err(text)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], color.filled()));
    }
    legend(&mut c, SeriesLabelPosition::UpperRight)
}

/// Each step's time, stacked: compute, exposed communication, data wait, checkpoint pause.
pub(super) fn breakdown<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, d: &RunData) -> Draw
where
    DB::ErrorType: 'static,
{
    let ms = 1e3;
    let layers: [Layer; 4] = [
        ("compute", BLUE_, |r| r.compute_s),
        ("exposed communication", ORANGE, |r| r.comm_s),
        ("data wait", GREEN_, |r| r.data_s),
        ("checkpoint pause", RED_, |r| r.ckpt_pause_s.unwrap_or(0.0)),
    ];
    // Cumulative tops of each layer, per step.
    let tops: Vec<Vec<(f64, f64)>> = (1..=layers.len())
        .map(|n| points(d, |r| ms * layers[..n].iter().map(|l| l.2(r)).sum::<f64>()))
        .collect();
    let (y, off) = span_after_first(&tops[layers.len() - 1]);
    // Headroom for the legend above the tallest step.
    let y = (0.0, y.1 * 1.2);
    let mut title = "Step time breakdown (ms per step, lead rank)".to_string();
    if off {
        title.push_str("; step 1 (warm-up) off scale");
    }
    let mut c = frame(area, &title, x_span(d), y, "time per step (ms)")?;
    // The tallest first, each lower layer drawn over it.
    for (n, (name, color, _)) in layers.iter().enumerate().rev() {
        let color = *color;
        c.draw_series(
            AreaSeries::new(tops[n].clone(), 0.0, color.filled())
                .border_style(WHITE.stroke_width(1)),
        )
        .map_err(text)?
        .label(*name)
        .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 20, y + 6)], color.filled()));
    }
    legend(&mut c, SeriesLabelPosition::UpperRight)
}

/// `(step, f(record))` for every step whose value is finite.
fn points(d: &RunData, f: impl Fn(&StepRecord) -> f64) -> Vec<(f64, f64)> {
    d.steps
        .values()
        .map(|r| (r.step as f64, f(r)))
        .filter(|p| p.1.is_finite())
        .collect()
}

/// The steps' extent (widened when there is one step).
fn x_span(d: &RunData) -> (f64, f64) {
    let first = d.steps.keys().next().copied().unwrap_or(0) as f64;
    let last = d.steps.keys().next_back().copied().unwrap_or(1) as f64;
    if last > first {
        (first, last)
    } else {
        (first - 1.0, last + 1.0)
    }
}

/// The extent of `vals` with a margin (from 0 when `from_zero`).
fn span(vals: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| v.is_finite()) {
        (lo, hi) = (lo.min(v), hi.max(v));
    }
    if lo > hi {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    let pad = if hi > lo {
        0.08 * (hi - lo)
    } else {
        0.1 * hi.abs().max(1.0)
    };
    (if from_zero { lo } else { lo - pad }, hi + pad)
}

/// The extent of `pts` from 0, over the steps after the first when there are three or more
/// (the first warms caches and can dwarf the rest); whether the first is then off the scale.
fn span_after_first(pts: &[(f64, f64)]) -> ((f64, f64), bool) {
    let rest = if pts.len() >= 3 { &pts[1..] } else { pts };
    let y = span(rest.iter().map(|p| p.1), true);
    (y, pts.first().is_some_and(|p| p.1 > y.1))
}

/// The chart's frame: title, axes, grid, labelled axes.
fn frame<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    title: &str,
    x: (f64, f64),
    y: (f64, f64),
    y_desc: &str,
) -> std::result::Result<Chart<'a, DB>, String>
where
    DB::ErrorType: 'static,
{
    // Enough decimals to tell the labels apart, no more.
    let decimals = match y.1 - y.0 {
        r if r >= 20.0 => 0,
        r if r >= 2.0 => 1,
        r if r >= 0.2 => 2,
        _ => 3,
    };
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", TITLE))
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(100)
        .build_cartesian_2d(x.0..x.1, y.0..y.1)
        .map_err(text)?;
    c.configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .axis_desc_style(("sans-serif", AXIS))
        .label_style(("sans-serif", LABEL))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:.decimals$}"))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(text)?;
    Ok(c)
}

/// A labelled line.
fn line<'a, DB: DrawingBackend + 'a>(
    c: &mut Chart<'a, DB>,
    pts: Vec<(f64, f64)>,
    color: RGBColor,
    label: &str,
) -> Draw
where
    DB::ErrorType: 'static,
{
    c.draw_series(LineSeries::new(pts, color.stroke_width(2)))
        .map_err(text)?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(3)));
    Ok(())
}

/// The legend box at `pos`.
fn legend<'a, DB: DrawingBackend + 'a>(c: &mut Chart<'a, DB>, pos: SeriesLabelPosition) -> Draw
where
    DB::ErrorType: 'static,
{
    c.configure_series_labels()
        .position(pos)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", LABEL))
        .draw()
        .map_err(text)
}
