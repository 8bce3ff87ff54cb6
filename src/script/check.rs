//! Everything a script must pass before training uses it (`ragen-lab check`): it compiles,
//! defines its role's functions, runs under the limits; an env also plays random episodes and
//! must replay the same episode for the same seed. [`check_turn`] runs an experiment's or a
//! reward script's shaping on a turn the author wrote, through the rollout's own code.
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::engine::{project_of, Host};
use super::env::EnvScript;
use super::error::{ErrorKind, ScriptError};
use super::experiment::Experiment;
use super::reward::RewardScript;
use super::turn::{apply_turn, parse_turn, ParsedTurn, TurnLimits, TurnSettings};
use super::validate::{self, Loaded, Role};
use crate::rng::Rng;

/// `n word` with the word's plural when n is not 1 ("1 success", "3 successes").
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// One line of a check: what passed, or the problem.
pub type ScriptCheck = Result<String, ScriptError>;

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
    settings: &dyn Fn(&Experiment) -> Result<(), String>,
) -> Vec<ScriptCheck> {
    let env_line = |env: &EnvScript, base: &Map<String, Value>, label: &str| -> Result<String, ScriptError> {
        let p = env.params_from(base)?;
        let p = super::params::apply(env.name(), &p, overrides).map_err(|m| ScriptError::new(env.name(), m))?;
        let r = check_env(env, &p, episodes)?;
        Ok(format!(
            "ok: {} (env, version {}){label}: {}, {}, {}, deterministic",
            env.name(),
            env.version(),
            count(r.episodes, "random episode", "random episodes"),
            count(r.steps, "step", "steps"),
            count(r.successes, "success", "successes")
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
            if let Err(msg) = settings(&x) {
                let script = host.compile(path);
                let msg = format!("settings: {msg}");
                out.push(Err(match script {
                    Ok(s) => s.error_in("experiment", ErrorKind::Contract, msg),
                    Err(e) => e,
                }));
            }
            let name = project_of(path);
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

/// A turn written by hand for `check --turn FILE.json` (README, "Testing a reward script").
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TurnFile {
    /// The model's response as it would be generated, e.g.
    /// `"<think>…</think><answer>Up || Left</answer>"`.
    pub response: String,
    /// Think mode (a think block required before the answer); default: the experiment's
    /// `rollout.think`, else true.
    pub think: Option<bool>,
    /// Reward script alone: the env's reward before shaping (default 0).
    pub env_reward: Option<f64>,
    /// Reward script alone: the env's action names (default none: free text).
    #[serde(default)]
    pub actions: Vec<String>,
    /// Reward script alone: actions taken from one answer (default 5, as an env's default).
    pub max_actions_per_turn: Option<usize>,
    /// Experiment: the episode to play the turn on (seed and stream), and the answers played
    /// before it (each one turn, e.g. `["Up", "Left || Left"]`).
    #[serde(default)]
    pub seed: u64,
    #[serde(default)]
    pub stream: u64,
    #[serde(default)]
    pub before: Vec<String>,
}

/// One step of a checked turn.
#[derive(Debug, Serialize, PartialEq)]
pub struct TurnStep {
    pub action: String,
    pub reward: f64,
    pub done: bool,
    pub success: bool,
    pub valid: bool,
}

/// One reward script's output.
#[derive(Debug, Serialize, PartialEq)]
pub struct Shaped {
    pub script: String,
    pub reward: f64,
}

/// What `check --turn` prints: the turn as the rollout parses it, the env steps it took (an
/// experiment's turn is played on its env), and the reward after each reward script in order.
#[derive(Debug, Serialize)]
pub struct TurnReport {
    /// The parsed turn, as the reward scripts get it (training shapes this one too).
    pub turn: ParsedTurn,
    pub steps: Vec<TurnStep>,
    /// Valid actions not played: the episode ended or its action budget ran out first.
    pub dropped: Vec<String>,
    pub env_reward: f64,
    pub shaped: Vec<Shaped>,
    /// The turn reward, as training would record it.
    pub reward: f64,
    pub done: bool,
}

/// Runs `path` (a reward script, or an experiment: its env and reward scripts) on the turn in
/// `text` (a [`TurnFile`] as JSON), through the rollout's own parsing and turn-applying code.
/// `settings` gives an experiment's rollout settings as `train` would resolve them.
pub fn check_turn(
    host: &Arc<Host>,
    path: &Path,
    text: &str,
    overrides: &[(String, String)],
    settings: &dyn Fn(&Experiment) -> Result<TurnSettings, String>,
) -> Result<TurnReport, String> {
    let file: TurnFile = serde_json::from_str(text).map_err(|e| format!("not a turn file: {e}"))?;
    let role = Role::detect(host, path).map_err(|e| e.to_string())?;
    let (turn, env_actions, rewards, steps, dropped, env_reward, done) = match role {
        Role::Reward => {
            if file.seed != 0 || file.stream != 0 || !file.before.is_empty() {
                return Err("seed, stream and before need an experiment script (an env to play on)".into());
            }
            let reward = RewardScript::load(host, path).map_err(|e| e.to_string())?;
            let per_turn = file.max_actions_per_turn.unwrap_or(5).max(1);
            let turn = parse_turn(&file.response, &file.actions, per_turn, file.think.unwrap_or(true));
            (turn, file.actions.clone(), vec![reward], Vec::new(), Vec::new(), file.env_reward.unwrap_or(0.0), false)
        }
        Role::Experiment => {
            if file.env_reward.is_some() || !file.actions.is_empty() || file.max_actions_per_turn.is_some() {
                return Err("env_reward, actions and max_actions_per_turn come from the experiment's env and settings; leave them out".into());
            }
            let x = Experiment::load(host, path).map_err(|e| e.to_string())?;
            let s = settings(&x)?;
            let scripts = x.scripts(host).map_err(|e| e.to_string())?;
            let env = &scripts.env;
            let base = env.params_from(&x.params).map_err(|e| e.to_string())?;
            let params = super::params::apply(env.name(), &base, overrides)?;
            let info = env.info(&params).map_err(|e| e.to_string())?;
            let limits = TurnLimits::resolve(&info, s.max_actions, s.max_actions_per_turn);
            let think = file.think.unwrap_or(s.think);
            let mut ep = env.reset(file.seed, file.stream, &params).map_err(|e| e.to_string())?;
            for answer in &file.before {
                let earlier = limits.parse(&format!("<answer>{answer}</answer>"), &info, false);
                apply_turn(&mut ep, &earlier, limits.max_actions, |_, _, _| Ok(())).map_err(|e| e.to_string())?;
                if ep.done || ep.steps >= limits.max_actions {
                    return Err(format!(
                        "the episode ended during `before` ({answer:?}); the turn has nothing to play"
                    ));
                }
            }
            let turn = limits.parse(&file.response, &info, think);
            let applied =
                apply_turn(&mut ep, &turn, limits.max_actions, |_, _, _| Ok(())).map_err(|e| e.to_string())?;
            let steps = applied
                .steps
                .iter()
                .map(|(a, o)| TurnStep {
                    action: a.clone(),
                    reward: o.reward,
                    done: o.done,
                    success: o.success,
                    valid: o.valid,
                })
                .collect();
            (turn, info.actions, scripts.rewards, steps, applied.dropped, applied.env_reward, applied.done)
        }
        other => {
            return Err(format!(
                "--turn needs a reward or experiment script; this is a{} {} script",
                if other == Role::Env { "n" } else { "" },
                other.name()
            ))
        }
    };
    let mut shaped = Vec::new();
    let mut reward = env_reward;
    for r in &rewards {
        reward = r.shape(&turn, &env_actions, reward).map_err(|e| e.to_string())?;
        shaped.push(Shaped { script: r.script().name.clone(), reward });
    }
    Ok(TurnReport { turn, steps, dropped, env_reward, shaped, reward, done })
}
