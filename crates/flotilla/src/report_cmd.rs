//! `flotilla report RUN`: PNG and SVG plots of a run's metrics file ([`report`]).
use anyhow::Result;
use std::path::PathBuf;

/// Options of `flotilla report`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The run: its metrics file (`flotilla train --metrics FILE`) or a directory holding one.
    run: PathBuf,
    /// Where the plots go (default: `report/` beside the metrics file).
    #[arg(short, long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// TrueType font of the plots' text (default: DejaVu Sans or another common one).
    #[arg(long, value_name = "FILE")]
    font: Option<PathBuf>,
    /// Print the files written as JSON.
    #[arg(long)]
    json: bool,
}

/// Run `flotilla report`.
pub fn run(a: Args) -> Result<()> {
    let file = report::metrics_file(&a.run)?;
    let data = report::read(&file)?;
    report::load_font(a.font.as_deref())?;
    let out = a.out.unwrap_or_else(|| {
        let dir = file.parent().filter(|d| !d.as_os_str().is_empty());
        dir.map_or_else(|| PathBuf::from("report"), |d| d.join("report"))
    });
    let files = report::plot_all(&data, &out)?;
    if a.json {
        let v = serde_json::json!({"metrics": file, "steps": data.steps.len(), "files": files});
        println!("{v}");
    } else {
        println!("# {} steps of {}", data.steps.len(), file.display());
        files.iter().for_each(|f| println!("{}", f.display()));
    }
    Ok(())
}
