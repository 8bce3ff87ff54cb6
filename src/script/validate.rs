//! Loading a script by role and smoke-testing it under the limits: the check a new version must
//! pass before the watcher offers it, and the first step of `ragen-lab check`.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::engine::Host;
use super::env::{EnvInfo, EnvScript};
use super::error::ScriptError;
use super::experiment::Experiment;
use super::prompt::{PromptScript, TurnContext};
use super::reward::RewardScript;
use super::turn::parse_turn;

/// What a script is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Env,
    Prompt,
    Reward,
    Experiment,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Env => "env",
            Role::Prompt => "prompt",
            Role::Reward => "reward",
            Role::Experiment => "experiment",
        }
    }

    /// Guesses the role from the names of the functions a compiled script defines (any arity,
    /// so a `shape` with the wrong parameters is reported as a reward script's mistake).
    pub fn detect(host: &Arc<Host>, path: &Path) -> Result<Role, ScriptError> {
        let s = host.compile(path)?;
        let has = |name: &str| (0..=4).any(|arity| s.has_fn(name, arity));
        Ok(if has("experiment") {
            Role::Experiment
        } else if has("shape") {
            Role::Reward
        } else if has("user") || has("system") {
            Role::Prompt
        } else {
            Role::Env
        })
    }
}

/// A validated script version.
#[derive(Clone, Debug)]
pub enum Loaded {
    Env(EnvScript),
    Prompt(PromptScript),
    Reward(RewardScript),
    Experiment(Box<Experiment>),
}

impl Loaded {
    /// The content hash (16 hex digits); for an experiment, of its own script (the scripts it
    /// names have their own).
    pub fn version(&self) -> String {
        match self {
            Loaded::Env(s) => s.version().to_string(),
            Loaded::Prompt(s) => s.version().to_string(),
            Loaded::Reward(s) => s.version().to_string(),
            Loaded::Experiment(x) => x.version.clone(),
        }
    }
}

/// A description to exercise templates with when no env is at hand.
pub fn sample_info() -> EnvInfo {
    EnvInfo {
        name: "sample".into(),
        actions: vec!["Up".into(), "Down".into()],
        max_turns: 2,
        max_actions: 4,
        max_actions_per_turn: 2,
        instruction: "Reach the goal.".into(),
        legend: "P: player".into(),
        extra: Map::new(),
    }
}

/// One reset, render, valid_actions and step of seed 0 with `params` over the env's defaults.
pub fn smoke_env(env: &EnvScript, params: &Map<String, Value>) -> Result<(), ScriptError> {
    let p = env.params_from(params)?;
    let info = env.info(&p)?;
    let mut ep = env.reset(0, 0, &p)?;
    ep.render()?;
    let acts = ep.valid_actions()?;
    let first = acts.first().or(info.actions.first()).cloned().unwrap_or_else(|| "0".into());
    ep.step(&first)?;
    ep.render()?;
    Ok(())
}

pub fn smoke_prompt(prompt: &PromptScript) -> Result<(), ScriptError> {
    let info = sample_info();
    prompt.system(&info)?;
    for (turn, think) in [(1, true), (2, false)] {
        let prev_reward = (turn > 1).then_some(-0.1);
        let ctx = TurnContext {
            turn,
            obs: "P_G".into(),
            actions_left: 3,
            prev_reward,
            think,
            max_tokens: 100,
            max_actions_per_turn: 2,
            show_actions: turn == 1,
            valid_actions: info.actions.clone(),
        };
        prompt.user(&info, &ctx)?;
    }
    Ok(())
}

pub fn smoke_reward(reward: &RewardScript) -> Result<(), ScriptError> {
    let acts = sample_info().actions;
    for response in ["plan</think><answer>Up || Down</answer>", "no tags", "x</think><answer>Jump</answer>"] {
        reward.shape(&parse_turn(response, &acts, 2, true), &acts, 1.0)?;
    }
    Ok(())
}

/// Compiles `path` as `role` and smoke-tests it. `params` are env parameters (env role only).
pub fn load(host: &Arc<Host>, path: &Path, role: Role, params: &Map<String, Value>) -> Result<Loaded, ScriptError> {
    Ok(match role {
        Role::Env => {
            let env = EnvScript::load(host, path)?;
            smoke_env(&env, params)?;
            Loaded::Env(env)
        }
        Role::Prompt => {
            let p = PromptScript::load(host, path)?;
            smoke_prompt(&p)?;
            Loaded::Prompt(p)
        }
        Role::Reward => {
            let r = RewardScript::load(host, path)?;
            smoke_reward(&r)?;
            Loaded::Reward(r)
        }
        Role::Experiment => {
            let x = Experiment::load(host, path)?;
            let s = x.scripts(host)?;
            smoke_env(&s.env, &x.params)?;
            smoke_prompt(&s.prompt)?;
            s.rewards.iter().try_for_each(smoke_reward)?;
            Loaded::Experiment(Box::new(x))
        }
    })
}

/// The files a validated version was built from (the script and its imports; for an
/// experiment, also the scripts it names and theirs).
pub fn sources(host: &Arc<Host>, loaded: &Loaded) -> Vec<PathBuf> {
    match loaded {
        Loaded::Env(s) => s.script().sources.clone(),
        Loaded::Prompt(s) => s.script().sources.clone(),
        Loaded::Reward(s) => s.script().sources.clone(),
        Loaded::Experiment(x) => {
            let mut out = vec![x.path.clone()];
            for p in std::iter::once(&x.env).chain([&x.prompt]).chain(&x.rewards) {
                match host.compile(p) {
                    Ok(s) => out.extend(s.sources.iter().cloned()),
                    Err(_) => out.push(p.clone()),
                }
            }
            out
        }
    }
}
