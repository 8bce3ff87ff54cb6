//! `ragen-lab bench`: speed measurements, each a call into the module it measures: `bench envs`
//! (script/bench.rs), `bench policy` (starpo/policy_bench.rs), `bench step` (starpo/bench.rs).
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::policy::lora::{attach, LoraConfig};
use crate::policy::Policy;
use crate::script::bench::{bench_env, env_scripts};
use crate::script::{EnvScript, Host, Limits, Role};
use crate::serve::load::{Load, LoadResult};
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
    /// Concurrent chat requests against an OpenAI-compatible server (`ragen-lab serve` started
    /// here, or any --endpoint such as llama-server): requests/s, tokens/s, p50/p99 latency per
    /// concurrency, and the throughput ratio to one request at a time.
    Serve(ServeArgs),
}

/// `ragen-lab bench serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// The model to serve here (any `--model` form), or with --endpoint the name it serves.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Measure this server instead of starting `ragen-lab serve` (http://host:port or its /v1 root).
    #[arg(long, value_name = "URL")]
    pub endpoint: Option<String>,
    /// Requests in flight at once, comma-separated levels.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub concurrency: Vec<usize>,
    /// Requests per level.
    #[arg(long, default_value_t = 64)]
    pub requests: usize,
    /// Tokens each request generates at most (temperature 1).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Seconds before a request counts as an error.
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Also write the results as JSON here.
    #[arg(long, value_name = "PATH")]
    pub json: Option<std::path::PathBuf>,
}

/// About 230 tokens, the size of a Bandit prompt: the prefill is most of a short episode's cost.
const LOAD_PROMPT: &str = "You are playing a game with two slot machines. Each machine has a name, and \
the name says something about how it pays. One machine pays a small amount every time you pull it; the \
other pays a large amount some of the time and nothing the rest of the time. Over many pulls, one of them \
pays more on average. You will see the names of both machines, and you must pick one. Think about what \
each name suggests: a name for something steady and careful, or a name for something bold and risky. \
Then answer with the name of the machine you pick, and nothing else. The machines are called Dragon and \
Phoenix. Dragon is a creature of legend that guards great treasure and takes great risks; Phoenix is a \
bird that rises again from its ashes, steady through every fire. Which machine do you pick? Give your \
answer inside <answer></answer> tags, with no extra text, in at most sixteen words.";

fn run_serve(a: ServeArgs) -> Result<()> {
    let base = match &a.endpoint {
        Some(url) => crate::remote::api_base(url)?,
        None => {
            let (tx, rx) = std::sync::mpsc::channel();
            let opts = crate::serve::Options {
                model: a.model.clone(),
                name: Some(a.model.clone()),
                ip: std::net::IpAddr::from([127, 0, 0, 1]),
                port: 0,
                max_batch: 64,
                seed: 0,
            };
            std::thread::spawn(move || {
                let ready = tx.clone();
                if let Err(e) = crate::serve::serve(opts, move |addr| {
                    let _ = ready.send(Ok(addr));
                }) {
                    let _ = tx.send(Err(e));
                }
            });
            let addr = rx.recv().context("the server thread ended")??;
            format!("http://{addr}/v1")
        }
    };
    let load = Load {
        chat_url: &format!("{base}/chat/completions"),
        model: &a.model,
        prompt: LOAD_PROMPT,
        max_tokens: a.max_tokens,
        requests: a.requests,
        timeout: Duration::from_secs(a.timeout),
    };
    // One request first: the server's first batch pays one-off costs (allocation, page faults).
    Load { requests: 1, ..load }.run(1)?;
    println!("{base}, {} requests per level, up to {} tokens each", a.requests, a.max_tokens);
    println!(
        "{:>11} {:>8} {:>10} {:>10} {:>10} {:>9} {:>9} {:>11}",
        "concurrency", "errors", "wall s", "req/s", "tok/s", "p50 s", "p99 s", "vs 1 at a time"
    );
    let mut results = Vec::new();
    for &c in &a.concurrency {
        let r = load.run(c)?;
        let single = results.iter().find(|x: &&LoadResult| x.concurrency == 1);
        let ratio = single.map_or(String::from("-"), |s| format!("{:.2}x", r.requests_per_s / s.requests_per_s));
        println!(
            "{:>11} {:>8} {:>10.1} {:>10.2} {:>10.1} {:>9.2} {:>9.2} {:>11}",
            c, r.errors, r.wall_s, r.requests_per_s, r.completion_tokens_per_s, r.latency_p50_s, r.latency_p99_s, ratio
        );
        results.push(r);
    }
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_string_pretty(&results)?)
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
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
    println!("{}", report.floor.line(&report.median, report.gemm_gflops));
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
        What::Serve(a) => run_serve(a),
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
