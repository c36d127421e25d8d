//! `flotilla report RUN`: plots of a run's metrics file (`flotilla train --metrics FILE`, JSON
//! lines: [`train::metrics_log`]), each as PNG and SVG:
//! - `loss`: the training loss per step, and the validation loss of `--eval-every`;
//! - `throughput`: tokens per second per step (all ranks), with the run's mean and MFU;
//! - `breakdown`: each step's time stacked as compute, exposed communication, data wait and
//!   checkpoint pause, in milliseconds;
//! - `goodput` (when the launcher wrote the job's ledger): each generation's wall time as
//!   productive steps, steps trained again, restart, checkpoint pauses, data stalls and
//!   straggler waits, the run's goodput beside the planner's.
//!
//! Stragglers the run named are marked on the throughput chart at the step they were named.
//!
//! RUN is the metrics file or a directory holding one (`*.jsonl`). A file that several runs
//! appended to (a resumed run) is plotted by step, the latest record of a step winning.
//!
//! Text is drawn with a TrueType font found at run time ([`FONT_PATHS`], or the caller's), so
//! the binary needs no font library; a system without one is told what to install.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use train::goodput::Ledger;
use train::metrics_log::{
    MetricsLogError, Record, StepRecord, StragglerRecord, Summary, read_records,
};

/// Where a sans-serif TrueType font is looked for when none is given (Debian's
/// `fonts-dejavu-core` first).
pub const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Plot size in pixels.
const SIZE: (u32, u32) = (1200, 700);

/// What went wrong making a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The metrics file could not be read.
    #[error(transparent)]
    Metrics(#[from] MetricsLogError),
    /// RUN is neither a metrics file nor a directory with exactly one.
    #[error("{}: {why}", path.display())]
    Run {
        /// RUN.
        path: PathBuf,
        /// What was found instead.
        why: String,
    },
    /// No usable font.
    #[error("{0}")]
    Font(String),
    /// The output could not be drawn or written.
    #[error("{}: {why}", path.display())]
    Draw {
        /// The plot file.
        path: PathBuf,
        /// The drawing error.
        why: String,
    },
}

type Result<T, E = ReportError> = std::result::Result<T, E>;

/// The metrics file of `run`: itself, or the one `*.jsonl` file of the directory `run`.
pub fn metrics_file(run: &Path) -> Result<PathBuf> {
    if !run.is_dir() {
        return Ok(run.to_path_buf());
    }
    let err = |why: String| ReportError::Run {
        path: run.to_path_buf(),
        why,
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(run)
        .map_err(|e| err(e.to_string()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jsonl"))
        .collect();
    found.sort();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(err(
            "no metrics file (*.jsonl) in this directory; give the file".into(),
        )),
        _ => Err(err(format!(
            "{} metrics files (*.jsonl) here: give one of {found:?}",
            found.len()
        ))),
    }
}

/// A run's records: the steps by number (the latest record of a step) and the last summary.
pub struct RunData {
    /// Step records by step.
    pub steps: BTreeMap<u64, StepRecord>,
    /// The last summary line, if the run finished.
    pub summary: Option<Summary>,
    /// The stragglers named, in order.
    pub stragglers: Vec<StragglerRecord>,
    /// The job's goodput ledger (the last one written), if the launcher wrote one.
    pub goodput: Option<Ledger>,
}

/// Reads the metrics file `path`; a file with no step record is an error.
pub fn read(path: &Path) -> Result<RunData> {
    let mut steps = BTreeMap::new();
    let (mut summary, mut stragglers, mut goodput) = (None, vec![], None);
    for r in read_records(path)? {
        match r {
            Record::Step(s) => {
                steps.insert(s.step, s);
            }
            Record::Summary(s) => summary = Some(s),
            Record::Straggler(s) => stragglers.push(s),
            Record::Goodput(l) => goodput = Some(l),
        }
    }
    if steps.is_empty() {
        return Err(ReportError::Run {
            path: path.to_path_buf(),
            why: "no step records to plot".into(),
        });
    }
    Ok(RunData {
        steps,
        summary,
        stragglers,
        goodput,
    })
}

/// Registers the font at `font` (or the first of [`FONT_PATHS`] that exists) for the plots'
/// text, once per process.
pub fn load_font(font: Option<&Path>) -> Result<()> {
    static LOADED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    LOADED
        .get_or_init(|| {
            let path = match font {
                Some(p) => p.to_path_buf(),
                None => FONT_PATHS.iter().map(PathBuf::from).find(|p| p.is_file()).ok_or_else(|| {
                    format!(
                        "no TrueType font found for the plots' text (looked at {FONT_PATHS:?}): \
                         install one (Debian: apt-get install fonts-dejavu-core) or give --font FILE.ttf"
                    )
                })?,
            };
            let bytes = std::fs::read(&path).map_err(|e| format!("font {}: {e}", path.display()))?;
            // Registered fonts live for the process (plotters keeps `&'static` bytes).
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            plotters::style::register_font("sans-serif", FontStyle::Normal, bytes)
                .map_err(|_| format!("font {}: not a TrueType/OpenType font", path.display()))
        })
        .clone()
        .map_err(ReportError::Font)
}

/// Draws the plots of `data` into `out` (created) as PNG and SVG; the files written.
pub fn plot_all(data: &RunData, out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).map_err(|e| ReportError::Draw {
        path: out.to_path_buf(),
        why: e.to_string(),
    })?;
    let mut files = vec![];
    let mut charts = vec![
        ("loss", Which::Loss),
        ("throughput", Which::Throughput),
        ("breakdown", Which::Breakdown),
    ];
    if data.goodput.is_some() {
        charts.push(("goodput", Which::Goodput));
    }
    for (name, which) in charts {
        let png = out.join(format!("{name}.png"));
        let svg = out.join(format!("{name}.svg"));
        let drawn = |path: &Path, r: Draw| {
            r.map_err(|why| ReportError::Draw {
                path: path.to_path_buf(),
                why,
            })
        };
        drawn(
            &png,
            draw_on(
                BitMapBackend::new(&png, SIZE).into_drawing_area(),
                data,
                which,
            ),
        )?;
        drawn(
            &svg,
            draw_on(SVGBackend::new(&svg, SIZE).into_drawing_area(), data, which),
        )?;
        files.extend([png, svg]);
    }
    Ok(files)
}

/// A drawing's outcome (the backend's error as text).
type Draw = std::result::Result<(), String>;

/// The charts.
#[derive(Clone, Copy)]
enum Which {
    Loss,
    Throughput,
    Breakdown,
    Goodput,
}

fn text<E: std::fmt::Display>(e: E) -> String {
    e.to_string()
}

/// Draws `which` on `root`, white behind, and writes it out.
fn draw_on<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, d: &RunData, which: Which) -> Draw
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE).map_err(text)?;
    match which {
        Which::Loss => charts::loss(&root, d),
        Which::Throughput => charts::throughput(&root, d),
        Which::Breakdown => charts::breakdown(&root, d),
        Which::Goodput => charts::goodput(&root, d),
    }?;
    root.present().map_err(text)
}

mod charts;
