//! `ragen-lab check`: everything a script must pass before training uses it, reported as
//! `path:line:col: problem` with a nonzero exit status when anything fails.
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Result};
use serde_json::{Map, Value};

use crate::rng::Rng;
use crate::script::validate::{self, Loaded, Role};
use crate::script::{parse_assignment, EnvScript, ErrorKind, Experiment, Host, Limits, ScriptError};

/// Check a script: it compiles, defines the functions its role needs (env, prompt template,
/// reward shaping or experiment: told apart by its functions), and runs under the sandbox
/// limits. An env also plays many random episodes, and must give the same episode for the same
/// seed twice. An experiment checks the scripts it names.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The script to check.
    pub script: PathBuf,
    /// Random episodes to play (envs).
    #[arg(long, default_value_t = 100)]
    pub episodes: u64,
    /// Override an env parameter (repeatable), e.g. --param size=8.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
}

/// What an env check saw, for the summary line.
#[derive(Debug, Default, PartialEq)]
pub struct EnvReport {
    pub episodes: u64,
    pub steps: u64,
    pub successes: u64,
}

/// Plays `episodes` random episodes (random valid actions, at most the env's `max_actions`
/// steps each) and replays the first few to check determinism.
pub fn check_env(env: &EnvScript, params: &Map<String, Value>, episodes: u64) -> Result<EnvReport, ScriptError> {
    let info = env.info(params)?;
    let mut report = EnvReport::default();
    let mut chooser = Rng::new(0xC4EC);
    let started = std::time::Instant::now();
    let cap = info.max_actions.max(1);
    for seed in 0..episodes {
        let mut ep = env.reset(seed, seed % 3, params)?;
        // Digests, not the texts: an episode of 10,000 steps of megabyte renders fits in memory.
        let mut trace = vec![digest(&ep.render()?)];
        let mut actions = Vec::new();
        while !ep.done && ep.steps < cap {
            let valid = ep.valid_actions()?;
            let action = if valid.is_empty() {
                "0".to_string()
            } else {
                valid[chooser.below(valid.len() as u64) as usize].clone()
            };
            let out = ep.step(&action)?;
            trace.push(digest(&format!("{action} {out:?} {}", ep.render()?)));
            actions.push(action);
            if started.elapsed() > CHECK_BUDGET {
                return Err(ScriptError::new(env.name(), format!(
                    "check: {} random episodes did not finish within {} s ({} steps so far); pass fewer --episodes or make episodes end sooner",
                    episodes, CHECK_BUDGET.as_secs(), report.steps
                )).kind(ErrorKind::Timeout));
            }
            report.steps += 1;
            report.successes += out.success as u64;
        }
        report.episodes += 1;
        if seed < 5 {
            determinism(env, params, seed, &ep.state_json(), &trace, &actions)?;
        }
    }
    Ok(report)
}

/// The same seed, stream and actions must give the same states, observations and rewards.
/// Wall-clock budget of `check`'s random episodes (each call also has its own limits).
const CHECK_BUDGET: std::time::Duration = std::time::Duration::from_secs(120);

fn digest(text: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(text.as_bytes()).into()
}

fn determinism(
    env: &EnvScript,
    params: &Map<String, Value>,
    seed: u64,
    state: &Value,
    trace: &[[u8; 32]],
    actions: &[String],
) -> Result<(), ScriptError> {
    let fail = |what: &str| {
        ScriptError::new(env.name(), format!(
            "not deterministic: seed {seed} gave a different {what} the second time; draw randomness only from rng:: (never from the clock)"
        ))
    };
    let a = env.reset(seed, 1000, params)?;
    let b = env.reset(seed, 1000, params)?;
    if a.state_json() != b.state_json() || a.render()? != b.render()? {
        return Err(fail("start state from reset"));
    }
    let mut ep = env.reset(seed, seed % 3, params)?;
    let mut again = vec![digest(&ep.render()?)];
    for action in actions {
        let out = ep.step(action)?;
        again.push(digest(&format!("{action} {out:?} {}", ep.render()?)));
    }
    if again != trace || ep.state_json() != *state {
        return Err(fail("episode for the same actions"));
    }
    Ok(())
}

/// Runs every check on `path`: one line per script checked, `Ok` (what passed) or the problem.
/// An experiment's env, template and reward scripts are checked independently, so one run
/// reports every broken script.
pub fn check(
    host: &Arc<Host>,
    path: &std::path::Path,
    episodes: u64,
    overrides: &[(String, String)],
) -> Vec<Result<String, ScriptError>> {
    let env_line = |env: &EnvScript, base: &Map<String, Value>, label: &str| -> Result<String, ScriptError> {
        let p = env.params_from(base)?;
        let p = crate::script::params::apply(env.name(), &p, overrides).map_err(|m| ScriptError::new(env.name(), m))?;
        let r = check_env(env, &p, episodes)?;
        Ok(format!(
            "ok: {} (env, version {}){label}: {} random episodes, {} steps, {} successes, deterministic",
            env.name(),
            env.version(),
            r.episodes,
            r.steps,
            r.successes
        ))
    };
    let prompt_line = |p: &std::path::Path| -> Result<String, ScriptError> {
        let Loaded::Prompt(s) = validate::load(host, p, Role::Prompt, &Map::new())? else { unreachable!() };
        Ok(format!("ok: {} (prompt, version {})", s.script().name, s.version()))
    };
    let reward_line = |p: &std::path::Path| -> Result<String, ScriptError> {
        let Loaded::Reward(s) = validate::load(host, p, Role::Reward, &Map::new())? else { unreachable!() };
        Ok(format!("ok: {} (reward, version {})", s.script().name, s.version()))
    };
    let role = match Role::detect(host, path) {
        Ok(r) => r,
        Err(e) => return vec![Err(e)],
    };
    match role {
        Role::Env => vec![EnvScript::load(host, path).and_then(|env| env_line(&env, &Map::new(), ""))],
        Role::Prompt => vec![prompt_line(path)],
        Role::Reward => vec![reward_line(path)],
        Role::Experiment => {
            let x = match Experiment::load(host, path) {
                Ok(x) => x,
                Err(e) => return vec![Err(e)],
            };
            let mut out = Vec::new();
            match EnvScript::load(host, &x.env) {
                Ok(env) => {
                    out.push(env_line(&env, &x.params, " with the experiment's params"));
                    if let Some(v) = &x.val_params {
                        out.push(env_line(&env, v, " with val_params"));
                    }
                }
                Err(e) => out.push(Err(e)),
            }
            out.push(prompt_line(&x.prompt));
            out.extend(x.rewards.iter().map(|r| reward_line(r)));
            // The settings as `train` would resolve them (default preset, no flags).
            let settings = crate::starpo::trainer::resolve_settings(
                crate::starpo::settings::Preset::StarpoS,
                None,
                &x.settings,
                &x.path,
                &[],
            );
            if let Err(e) = settings {
                let script = host.compile(path);
                let msg = format!("settings: {e:#}");
                out.push(Err(match script {
                    Ok(s) => s.error_in("experiment", ErrorKind::Contract, msg),
                    Err(e) => e,
                }));
            }
            let name = crate::script::project_of(path);
            let name =
                path.canonicalize().ok().and_then(|p| p.strip_prefix(&name).ok().map(|p| p.display().to_string()));
            out.push(Ok(format!(
                "ok: {} (experiment, version {})",
                name.unwrap_or_else(|| path.display().to_string()),
                x.version
            )));
            out
        }
    }
}

pub fn run(args: Args) -> Result<()> {
    let host = Host::for_script(&args.script, Limits::from_env().map_err(anyhow::Error::msg)?);
    let overrides =
        args.params.iter().map(|p| parse_assignment(p).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    let mut problems = 0;
    for line in check(&host, &args.script, args.episodes, &overrides) {
        match line {
            Ok(l) => println!("{l}"),
            Err(e) => {
                problems += 1;
                println!("{e}");
            }
        }
    }
    if problems > 0 {
        bail!("check found {problems} problem(s) in {}", args.script.display());
    }
    Ok(())
}
