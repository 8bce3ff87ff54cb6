//! `ragen-lab bench`: speed measurements. `bench envs` plays random episodes of each env
//! script through the real host and prints resets/s and steps/s; `bench policy` and
//! `bench step` live with what they measure (policy/bench.rs, starpo/bench.rs).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::Map;

use crate::rng::Rng;
use crate::script::{EnvScript, Host, Limits, Role};

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
    Policy(crate::policy::bench::PolicyArgs),
    /// Real StarPO steps of an experiment, timed by phase (prefill, decode, env, old log-probs,
    /// forward, backward, optimiser), with tokens computed vs unique and the peak RSS.
    Step(crate::starpo::bench::StepArgs),
}

#[derive(clap::Args, Debug)]
pub struct EnvsArgs {
    /// Env scripts to measure (default: envs/*.rhai).
    pub scripts: Vec<PathBuf>,
    /// Seconds to spend on each env.
    #[arg(long, default_value_t = 2.0)]
    pub seconds: f64,
}

/// One env's figures.
#[derive(Debug)]
pub struct EnvBench {
    pub name: String,
    pub episodes: u64,
    pub steps: u64,
    /// Time in reset (+ the first render) vs in step (+ render + valid_actions), seconds.
    pub reset_s: f64,
    pub step_s: f64,
}

/// Plays random episodes of `env` for about `budget`: each step renders and lists the valid
/// actions too, as a rollout does.
pub fn bench_env(env: &EnvScript, budget: Duration) -> Result<EnvBench> {
    let params = env.params_from(&Map::new())?;
    let info = env.info(&params)?;
    let mut chooser = Rng::new(7);
    let (mut episodes, mut steps, mut reset_s, mut step_s) = (0u64, 0u64, 0.0, 0.0);
    let start = Instant::now();
    while start.elapsed() < budget {
        let t = Instant::now();
        let mut ep = env.reset(episodes, episodes, &params)?;
        ep.render()?;
        reset_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let mut valid = ep.valid_actions()?;
        while !ep.done && ep.steps < info.max_actions.max(1) {
            let a = if valid.is_empty() {
                "0".to_string()
            } else {
                valid[chooser.below(valid.len() as u64) as usize].clone()
            };
            ep.step(&a)?;
            ep.render()?;
            valid = ep.valid_actions()?;
            steps += 1;
        }
        step_s += t.elapsed().as_secs_f64();
        episodes += 1;
    }
    Ok(EnvBench { name: env.name().to_string(), episodes, steps, reset_s, step_s })
}

fn env_scripts(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("cannot list {}: {e}; name the env scripts to measure", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "rhai"))
        .collect();
    out.sort();
    Ok(out)
}

pub fn run(args: Args) -> Result<()> {
    match args.what {
        What::Policy(a) => crate::policy::bench::run_cli(a),
        What::Step(a) => crate::starpo::bench::run_cli(a),
        What::Envs(a) => {
            let scripts = if a.scripts.is_empty() { env_scripts(Path::new("envs"))? } else { a.scripts };
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
