//! Speed of env scripts through the real host (`ragen-lab bench envs`): random episodes, each
//! step rendering and listing the valid actions too, as a rollout does.
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Map;

use super::env::EnvScript;
use super::error::ScriptError;
use crate::rng::Rng;

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
pub fn bench_env(env: &EnvScript, budget: Duration) -> Result<EnvBench, ScriptError> {
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

/// The `*.rhai` files of `dir`, sorted.
pub fn env_scripts(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {}: {e}; name the env scripts to measure", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "rhai"))
        .collect();
    out.sort();
    Ok(out)
}
