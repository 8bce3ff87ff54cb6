//! `ragen-lab bench`: speed measurements, each a call into the module it measures: `bench envs`
//! (script/bench.rs), `bench policy` (starpo/policy_bench.rs), `bench step` (starpo/bench.rs).
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::policy::lora::{attach, LoraConfig};
use crate::policy::Policy;
use crate::script::bench::{bench_env, env_scripts};
use crate::script::{EnvScript, Host, Limits, Role};
use crate::starpo::bench::{measure as measure_steps, StepArgs, HEADER};
use crate::starpo::policy_bench::{comparison, features, measure, BenchConfig, Report};

/// Measure speed.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    pub what: What,
}

#[derive(clap::Subcommand, Debug)]
pub enum What {
    /// Env steps per second through the Rhai host: random valid actions, many episodes, for
    /// each env script (default: every env in envs/).
    Envs(EnvsArgs),
    /// A policy's generation tokens/s (batch 1, 8, 32) and training tokens/s (8 x 256), with
    /// ratios against PyTorch from `--compare` (tools/bench_pytorch.py).
    Policy(PolicyArgs),
    /// Real StarPO steps of an experiment, timed by phase (prefill, decode, env, old log-probs,
    /// forward, backward, optimiser), with tokens computed vs unique and the peak RSS.
    Step(StepArgs),
}

#[derive(clap::Args, Debug)]
pub struct EnvsArgs {
    /// Env scripts to measure (default: envs/*.rhai).
    pub scripts: Vec<std::path::PathBuf>,
    /// Seconds to spend on each env.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
}

/// `ragen-lab bench policy`: the flags (kept beside the measurement they steer).
#[derive(clap::Args, Debug)]
pub struct PolicyArgs {
    /// The model: a folder, a .gguf file, a preset, a known name or a hub id.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Generation batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batches: Vec<usize>,
    /// New tokens per generated row (greedy; a row may stop earlier at its stop id).
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Generation runs per batch size; the fastest counts.
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// Training batch: sequences per optimiser step (0 skips training).
    #[arg(long, default_value_t = 8)]
    pub train_batch: usize,
    /// Training batch: tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub train_seq: usize,
    /// Measured training steps, after one warm-up step.
    #[arg(long, default_value_t = 2)]
    pub train_steps: usize,
    /// Sequences per forward/backward pass (gradients accumulate over the batch).
    #[arg(long, default_value_t = 4)]
    pub micro_batch: usize,
    /// Train LoRA adapters of this rank (alpha 32, every projection) instead of every weight.
    #[arg(long, value_name = "R")]
    pub lora_rank: Option<usize>,
    /// Keep only each layer's input in training and recompute layers in backward
    /// (`optim.checkpoint_layers`).
    #[arg(long)]
    pub checkpoint_layers: bool,
    /// Write this run's figures as JSON (the format tools/bench_pytorch.py writes).
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
    /// Print ratios against a results JSON from tools/bench_pytorch.py (above 1: we are faster).
    #[arg(long, value_name = "FILE")]
    pub compare: Option<std::path::PathBuf>,
}

/// Runs `ragen-lab bench policy`.
fn run_policy(args: PolicyArgs) -> Result<()> {
    // Read the comparison first: a wrong path should not cost a whole benchmark.
    let theirs: Option<Report> = match &args.compare {
        Some(path) => {
            let text =
                std::fs::read_to_string(path).with_context(|| format!("reading --compare {}", path.display()))?;
            Some(serde_json::from_str(&text).with_context(|| {
                format!("--compare {}: not a results JSON from tools/bench_pytorch.py", path.display())
            })?)
        }
        None => None,
    };
    let mut policy = Policy::load(&args.model, &crate::policy::device()?)?;
    policy.model.checkpoint_layers = args.checkpoint_layers;
    let mut how = String::new();
    if args.checkpoint_layers {
        how += ", layer checkpoints";
    }
    if let Some(rank) = args.lora_rank {
        attach(&mut policy.model, &LoraConfig::new(rank, 32.0, "all-linear", 0.0)?, 0)?;
        how += &format!(", LoRA rank {rank}");
    }
    println!("{}: {} threads, {}{how}", policy.source, rayon::current_num_threads(), features());
    let cfg = BenchConfig {
        batches: args.batches,
        new_tokens: args.new_tokens,
        repeats: args.repeats,
        train_batch: args.train_batch,
        train_seq: args.train_seq,
        train_steps: args.train_steps,
        micro_batch: args.micro_batch,
        seed: 0,
    };
    let ours = measure(&policy, &args.model, &cfg)?;
    if let Some(reply) = &ours.greedy_reply {
        println!("greedy reply (batch row 0): {reply:?}");
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&ours)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    if let Some(theirs) = theirs {
        println!("\n{}", comparison(&ours, &theirs));
    }
    Ok(())
}

/// `ragen-lab bench step`: measure, print the table, write the JSON.
fn run_step(args: StepArgs) -> Result<()> {
    let report = measure_steps(&args)?;
    println!(
        "{}: {} steps, {} threads (seconds; tokens = model positions)",
        args.env.display(),
        args.steps,
        report.threads
    );
    println!("{HEADER}");
    for (i, s) in report.steps.iter().enumerate() {
        println!("{}", s.row(&(i + 1).to_string()));
    }
    println!("{}", report.median.row("median"));
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Policy(a) => run_policy(a),
        What::Step(a) => run_step(a),
        What::Envs(a) => {
            let scripts = if a.scripts.is_empty() {
                env_scripts(Path::new("envs")).map_err(anyhow::Error::msg)?
            } else {
                a.scripts
            };
            if scripts.is_empty() {
                bail!("no env scripts found in envs/; name them: ragen-lab bench envs envs/x.rhai");
            }
            println!(
                "{:<28} {:>9} {:>10} {:>12} {:>12} {:>10}",
                "env", "episodes", "steps", "resets/s", "steps/s", "µs/step"
            );
            for path in scripts {
                let host = Host::for_script(&path, Limits::default());
                if Role::detect(&host, &path)? != Role::Env {
                    continue;
                }
                // Helper modules under envs/ (imported by envs) define no env functions: skip them.
                let env = match EnvScript::load(&host, &path) {
                    Ok(e) => e,
                    Err(e) if e.line == 0 && e.message.starts_with("missing `fn") => {
                        eprintln!("skipping {} (not an env: {})", path.display(), e.message);
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                };
                let b = bench_env(&env, Duration::from_secs_f64(a.seconds))?;
                let per_step = if b.steps > 0 { b.step_s / b.steps as f64 } else { 0.0 };
                println!(
                    "{:<28} {:>9} {:>10} {:>12.0} {:>12.0} {:>10.1}",
                    env.script().name,
                    b.episodes,
                    b.steps,
                    b.episodes as f64 / b.reset_s.max(1e-9),
                    b.steps as f64 / b.step_s.max(1e-9),
                    per_step * 1e6
                );
            }
            Ok(())
        }
    }
}
