//! `ragen-lab train`: resolve the flags into `starpo::trainer::Options`, install the Ctrl-C
//! handler, run the loop, print the summary.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::script::parse_assignment;
use crate::starpo::resume::RunRecord;
use crate::starpo::settings::{Algo, Preset};
use crate::starpo::trainer::{train, Options};

/// Train a policy on an experiment script with StarPO-S (default) or StarPO.
///
/// With no other flag, `ragen-lab train --env scripts/bandit.rhai` trains SmolLM2-135M-Instruct
/// (fetched on first use) with StarPO-S and the experiment's settings, and writes
/// runs/<experiment>-<date>/. Every setting (`ragen-lab settings` lists them) can be set in the
/// experiment script's `settings` map or with `--set key=value`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The experiment script (scripts/*.rhai): env, prompt template, reward shaping, settings.
    /// Optional with --resume (the run remembers it).
    #[arg(long, value_name = "SCRIPT")]
    pub env: Option<PathBuf>,
    /// Settings preset: starpo-s (filtering, clip-higher, no KL; the default), starpo-s2 (the
    /// same with RAGEN-2's top-p filter) or starpo (vanilla PPO + KL). Not with --resume (the
    /// run keeps its settings).
    #[arg(long, value_enum)]
    pub preset: Option<Preset>,
    /// Advantage estimator family: ppo (GAE with a critic) or grpo (group-normalised, no critic).
    /// With --resume, only the family the run already uses.
    #[arg(long, value_enum)]
    pub algo: Option<Algo>,
    /// Override a setting, e.g. `--set optim.lr=1e-5 --set rollout.env_groups=8` (repeatable;
    /// applied after the preset and the experiment script).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The model: an HF folder, a .gguf file, a preset (tiny-llama, tiny-qwen2), a known short
    /// name (smollm2-135m) or a hub id. Default: the experiment script's `model`, else smollm2-135m.
    #[arg(long)]
    pub model: Option<String>,
    /// Training steps (shorthand for --set train.steps=N; with --resume, extends the run).
    #[arg(long)]
    pub steps: Option<usize>,
    /// Override a training env parameter, e.g. `--param slippery=false --param size=4`
    /// (repeatable; over the experiment's `params`; `ragen-lab check ENV` lists them). Curricula
    /// are parameters: smaller rooms, fewer boxes, ice that does not slip.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Override a parameter of the held-out validation variant (repeatable; over the
    /// experiment's `val_params`, or the training ones when it has none).
    #[arg(long = "val-param", value_name = "KEY=VALUE")]
    pub val_params: Vec<String>,
    /// Where to write the run (default runs/<name>).
    #[arg(long, value_name = "DIR", conflicts_with = "name")]
    pub run_dir: Option<PathBuf>,
    /// The run's name under runs/ (default <experiment>-<UTC date and time>).
    #[arg(long)]
    pub name: Option<String>,
    /// Continue a run from its latest checkpoint (a run directory, or a name under runs/).
    #[arg(long, value_name = "RUN")]
    pub resume: Option<PathBuf>,
    /// No progress bar (logs still go to the run directory).
    #[arg(long)]
    pub quiet: bool,
    /// Also serve the run's live dashboard on http://127.0.0.1:PORT (0 = any free port), as
    /// `ragen-lab view RUN --serve PORT` does from another process (which outlives the run).
    #[arg(long, value_name = "PORT")]
    pub serve: Option<u16>,
}

/// `YYYYMMDD-HHMMSS` in UTC (civil-from-days, Howard Hinnant's algorithm).
pub(crate) fn utc_stamp() -> String {
    let secs =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0) as i64;
    let (days, rem) = (secs.div_euclid(86400), secs.rem_euclid(86400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem / 60 % 60, rem % 60)
}

fn resolve_resume(run: &Path) -> PathBuf {
    if run.join("settings.json").exists() || run.components().count() > 1 {
        run.to_path_buf()
    } else {
        Path::new("runs").join(run)
    }
}

pub(crate) fn assignments(flags: &[String]) -> Result<Vec<(String, String)>> {
    flags.iter().map(|p| parse_assignment(p).map_err(anyhow::Error::msg)).collect()
}

/// Starts the dashboard server on a thread of its own (it only reads the run directory) and
/// returns its address once it listens.
fn serve_dashboard(dir: &Path, port: u16) -> Result<std::net::SocketAddr> {
    let (tx, rx) = std::sync::mpsc::channel();
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        let ready = tx.clone();
        let served = crate::view::serve::serve(&dir, std::net::Ipv4Addr::LOCALHOST.into(), port, move |addr| {
            let _ = ready.send(Ok(addr));
        });
        if let Err(e) = served {
            let _ = tx.send(Err(e));
        }
    });
    rx.recv().context("the dashboard server stopped before it listened")?
}

pub fn run(args: Args) -> Result<()> {
    let (experiment, model, run_dir, resume) = match &args.resume {
        Some(r) => {
            let dir = resolve_resume(r);
            let saved = RunRecord::read(&dir)?;
            let exp = args.env.clone().unwrap_or_else(|| saved.experiment.clone());
            let params = !args.params.is_empty() || !args.val_params.is_empty();
            saved
                .refuse(args.preset, args.algo, args.model.as_deref(), params)
                .with_context(|| format!("resuming {}", dir.display()))?;
            let model = Some(saved.model.clone());
            (exp, model, dir, true)
        }
        None => {
            let Some(exp) = args.env.clone() else {
                bail!("--env SCRIPT is required (an experiment script such as scripts/bandit.rhai), or --resume RUN");
            };
            let stem = exp.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
            let dir = match (&args.run_dir, &args.name) {
                (Some(d), _) => d.clone(),
                (None, Some(n)) => Path::new("runs").join(n),
                (None, None) => Path::new("runs").join(format!("{stem}-{}", utc_stamp())),
            };
            (exp, args.model.clone(), dir, false)
        }
    };
    if let Some(port) = args.serve {
        let addr = serve_dashboard(&run_dir, port)?;
        println!("serving the dashboard of {} on http://{addr}/", run_dir.display());
    }
    let stop = Arc::new(AtomicBool::new(false));
    let presses = Arc::new(AtomicUsize::new(0));
    {
        let (stop, presses) = (stop.clone(), presses.clone());
        // A second handler cannot be installed in the same process; the first one serves.
        let _ = ctrlc::set_handler(move || {
            if presses.fetch_add(1, Ordering::SeqCst) > 0 {
                eprintln!("\nragen-lab: interrupted again, exiting without saving");
                std::process::exit(130);
            }
            eprintln!("\nragen-lab: stopping after this step and saving a checkpoint (Ctrl-C again to abort)");
            stop.store(true, Ordering::SeqCst);
        });
    }
    let summary = train(Options {
        experiment,
        model,
        preset: args.preset.unwrap_or(Preset::StarpoS),
        algo: args.algo,
        sets: args.sets,
        steps: args.steps,
        params: assignments(&args.params)?,
        val_params: assignments(&args.val_params)?,
        run_dir,
        resume,
        progress: !args.quiet,
        stop,
    })?;
    print!("{}", summary.render());
    Ok(())
}
