//! `ragen-lab plot`: draw one or more runs' metrics as PNG and SVG charts (and write the runs'
//! TensorBoard files if they have none).
use crate::metrics::{plot, run::Run, tensorboard};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(
    after_help = "Charts: reward mean ± std, success (train and validation, with the validation moves' agreement with the env's solver where it has one), in-group reward std, entropy, gradient norm, response and think length, KL, clip fraction, and the template-collapse estimate. Alarms (red, at the step their condition began) and script swaps (grey, dashed) are marked on the step axis. Several runs share each chart (colour = run), e.g. StarPO against StarPO-S. Runs without tb/ also get TensorBoard files written from metrics.jsonl."
)]
pub struct Args {
    /// Run directories (runs/<name>/), each with a metrics.jsonl.
    #[arg(required = true, value_name = "RUN")]
    pub runs: Vec<PathBuf>,
    /// Where to write <panel>.png/.svg and overview.png/.svg [default: RUN/plots for the first RUN].
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> anyhow::Result<()> {
    let runs = args.runs.iter().map(|d| Run::open(d)).collect::<anyhow::Result<Vec<_>>>()?;
    for r in &runs {
        if let Some(p) = tensorboard::ensure_tb(&r.dir)? {
            println!("wrote {} (TensorBoard, from metrics.jsonl)", p.display());
        }
        for a in &r.alarms {
            println!("{}: alarm at step {}: {}", r.name, a.step, a.message);
        }
    }
    let out = args.out.unwrap_or_else(|| args.runs[0].join("plots"));
    let (files, skipped) = plot::plot_runs(&runs, &out)?;
    for f in &files {
        println!("wrote {}", f.display());
    }
    if !skipped.is_empty() {
        println!("no data for: {} (skipped)", skipped.join(", "));
    }
    Ok(())
}
