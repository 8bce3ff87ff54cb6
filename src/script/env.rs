//! Environments as scripts: [`EnvScript`] (one compiled version), [`EnvInfo`] (what `describe`
//! returns, with defaults filled in), [`Episode`] (one running episode: its state map and its own
//! random stream) and [`StepOutcome`].
//!
//! The script contract (README.md, "Writing environments", has a complete example):
//! `fn params()` (optional) → default parameters; `fn describe(params)` → #{name, instruction, …};
//! `fn reset(seed, params)` → the state map; `fn render(state)` → the observation text;
//! `fn step(state, action)` → #{reward, done, success?, valid?, effective?}, mutating `state`;
//! `fn valid_actions(state)` (optional) → the actions worth listing now;
//! `fn solve(state)` (optional) → a shortest action list from this state to success (`[]` or `()`
//! when there is none or it is out of the solver's reach), for `ragen-lab sft`'s demonstrations.

use rhai::Dynamic;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::engine::Script;
use super::error::{ErrorKind, ScriptError};
use super::params;
use super::pattern;
use crate::rng::Rng;

pub(crate) fn to_dynamic(v: &impl Serialize, script: &str) -> Result<Dynamic, ScriptError> {
    rhai::serde::to_dynamic(v).map_err(|e| ScriptError::new(script, format!("cannot pass a value to the script: {e}")))
}

pub(crate) fn to_json(v: &Dynamic) -> Result<Value, String> {
    rhai::serde::from_dynamic::<Value>(v).map_err(|e| e.to_string())
}

/// Rhai's name for a value's type, in words for messages.
pub(crate) fn type_word(v: &Dynamic) -> String {
    match v.type_name() {
        "()" => "nothing (`()`: a missing return?)".into(),
        "map" => "a map".into(),
        "array" => "an array".into(),
        "string" => "a string".into(),
        "i64" => "an integer".into(),
        "f64" => "a float".into(),
        "bool" => "a bool".into(),
        other => other.to_string(),
    }
}

/// What an environment says about itself (`describe(params)`), defaults filled in.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EnvInfo {
    pub name: String,
    /// Action names, matched case-insensitively; empty = free-text actions (e.g. math answers).
    pub actions: Vec<String>,
    /// Turns (model responses) per episode. Default 5.
    pub max_turns: usize,
    /// Env steps per episode over all turns. Default `max_turns * max_actions_per_turn`.
    pub max_actions: usize,
    /// Actions one response may hold. Default 5 (1 for free-text envs).
    pub max_actions_per_turn: usize,
    /// The task, as the first user message states it.
    pub instruction: String,
    /// What the observation's symbols mean ("" when there are none).
    pub legend: String,
    /// Any other keys `describe` returned, for prompt templates.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// The most turns, actions per turn and actions per episode an env may declare (an episode is
/// played to its end inside one training step, and `check` plays several).
pub const MAX_TURNS: u64 = 100;
pub const MAX_ACTIONS_PER_TURN: u64 = 100;
pub const MAX_ACTIONS: u64 = 10_000;

/// Rewards beyond ±this are refused: a group's scores must stay far from f64 overflow when they
/// are summed and normalised.
pub const MAX_REWARD: f64 = 1e9;

/// A reward a script returned, as a finite number within ±[`MAX_REWARD`].
pub(crate) fn reward_value(v: &Dynamic, what: &str) -> Result<f64, String> {
    let r = match v {
        v if v.is_int() => v.as_int().unwrap_or(0) as f64,
        v if v.is_float() => v.as_float().unwrap_or(f64::NAN),
        v => return Err(format!("{what} must be a number; got {}", type_word(v))),
    };
    if !r.is_finite() {
        return Err(format!("{what} is {r}; rewards must be finite numbers (check for a division by zero)"));
    }
    if r.abs() > MAX_REWARD {
        return Err(format!("{what} is {r}, beyond ±{MAX_REWARD:e}; scale it down"));
    }
    Ok(r)
}

/// Every action a well-formed name or pattern ([`pattern::parse`]), else an error at `f`.
fn check_patterns(script: &Script, f: &str, actions: &[String]) -> Result<(), ScriptError> {
    for a in actions {
        pattern::parse(a).map_err(|m| script.error_in(f, ErrorKind::Contract, format!("{f}: {m}")))?;
    }
    Ok(())
}

impl EnvInfo {
    fn from_value(script: &Script, v: Value) -> Result<Self, ScriptError> {
        let err = |m: String| script.error_in("describe", ErrorKind::Contract, format!("describe must return {m}"));
        let Value::Object(mut m) = v else {
            return Err(err(format!(
                "a map like #{{name: \"grid\", instruction: \"…\", actions: [\"Up\", …]}}; got {v}"
            )));
        };
        let mut take_str = |key: &str, required: bool| -> Result<String, ScriptError> {
            match m.remove(key) {
                Some(Value::String(s)) => Ok(s),
                None if !required => Ok(String::new()),
                None => Err(err(format!("a map with `{key}` (string)"))),
                Some(other) => Err(err(format!("`{key}` as a string; got {other}"))),
            }
        };
        let name = take_str("name", true)?;
        let instruction = take_str("instruction", true)?;
        let legend = take_str("legend", false)?;
        let actions = match m.remove("actions") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|x| match x {
                    Value::String(s) => Ok(s),
                    other => Err(err(format!("`actions` as an array of strings; found {other}"))),
                })
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(err(format!("`actions` as an array of strings; got {other}"))),
        };
        check_patterns(script, "describe", &actions)?;
        let mut take_count = |key: &str, max: u64| -> Result<Option<usize>, ScriptError> {
            match m.remove(key) {
                None => Ok(None),
                Some(Value::Number(n)) if n.as_u64().is_some_and(|n| n > 0 && n <= max) => {
                    Ok(Some(n.as_u64().unwrap_or(1) as usize))
                }
                Some(other) => Err(err(format!("`{key}` as an integer from 1 to {max}; got {other}"))),
            }
        };
        let max_turns = take_count("max_turns", MAX_TURNS)?.unwrap_or(5);
        let per_turn =
            take_count("max_actions_per_turn", MAX_ACTIONS_PER_TURN)?.unwrap_or(if actions.is_empty() { 1 } else { 5 });
        let max_actions = take_count("max_actions", MAX_ACTIONS)?.unwrap_or(max_turns * per_turn);
        Ok(Self {
            name,
            actions,
            max_turns,
            max_actions,
            max_actions_per_turn: per_turn,
            instruction,
            legend,
            extra: m,
        })
    }
}

/// The result of one `step`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepOutcome {
    pub reward: f64,
    pub done: bool,
    pub success: bool,
    /// The action was one the env accepts (else it is counted as invalid and usually a no-op).
    pub valid: bool,
    /// The action changed the state (a bump into a wall is valid but not effective).
    pub effective: bool,
}

const STEP_SHAPE: &str = "#{reward: <number>, done: <bool>} with optional `success`, `valid`, `effective` (bools)";

impl StepOutcome {
    fn from_dynamic(script: &Script, v: &Dynamic) -> Result<Self, ScriptError> {
        let err = |m: String| {
            script.error_in("step", ErrorKind::Contract, format!("step must return a map {STEP_SHAPE}; {m}"))
        };
        let Some(map) = v.read_lock::<rhai::Map>() else {
            return Err(err(format!("got {}", type_word(v))));
        };
        let flag = |k: &str| -> Result<Option<bool>, ScriptError> {
            match map.get(k) {
                None => Ok(None),
                Some(x) => x.as_bool().map(Some).map_err(|_| err(format!("`{k}` is {}", type_word(x)))),
            }
        };
        if let Some(k) = map.keys().find(|k| !["reward", "done", "success", "valid", "effective"].contains(&k.as_str()))
        {
            return Err(err(format!("unknown key `{k}`")));
        }
        let reward = map.get("reward").ok_or_else(|| err("`reward` is missing".into()))?;
        let reward = reward_value(reward, "`reward`").map_err(|m| script.error_in("step", ErrorKind::Contract, m))?;
        let done = flag("done")?.ok_or_else(|| err("`done` is missing".into()))?;
        let valid = flag("valid")?.unwrap_or(true);
        Ok(Self {
            reward,
            done,
            success: flag("success")?.unwrap_or(false),
            valid,
            effective: flag("effective")?.unwrap_or(valid),
        })
    }
}

script_role! {
    /// One compiled environment script. Cheap to clone.
    EnvScript requires [("describe", ["params"]), ("reset", ["seed", "params"]), ("render", ["state"]), ("step", ["state", "action"])]
}

impl EnvScript {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// `fn params()`'s defaults (empty when the script has none).
    pub fn default_params(&self) -> Result<Map<String, Value>, ScriptError> {
        if !self.0.has_fn("params", 0) {
            return Ok(Map::new());
        }
        let v = self.0.call("params", (), None)?;
        match to_json(&v) {
            Ok(Value::Object(m)) => Ok(m),
            _ => Err(self.0.error_in(
                "params",
                ErrorKind::Contract,
                format!("params must return a map of defaults like #{{size: 6}}; got {}", type_word(&v)),
            )),
        }
    }

    /// Defaults with `--param key=value` overrides applied.
    pub fn params(&self, overrides: &[(String, String)]) -> Result<Map<String, Value>, ScriptError> {
        params::apply(self.name(), &self.default_params()?, overrides).map_err(|m| ScriptError::new(self.name(), m))
    }

    /// Defaults with a map of typed values merged in (an experiment's `params`).
    pub fn params_from(&self, given: &Map<String, Value>) -> Result<Map<String, Value>, ScriptError> {
        params::merge(self.name(), &self.default_params()?, given).map_err(|m| ScriptError::new(self.name(), m))
    }

    /// An experiment's `params` merged into the defaults, then `--param key=value` overrides.
    pub fn params_with(
        &self,
        given: &Map<String, Value>,
        overrides: &[(String, String)],
    ) -> Result<Map<String, Value>, ScriptError> {
        params::apply(self.name(), &self.params_from(given)?, overrides).map_err(|m| ScriptError::new(self.name(), m))
    }

    pub fn info(&self, params: &Map<String, Value>) -> Result<EnvInfo, ScriptError> {
        let v = self.0.call("describe", (to_dynamic(params, self.name())?,), None)?;
        let json = to_json(&v).map_err(|e| {
            self.0.error_in("describe", ErrorKind::Contract, format!("describe returned something unreadable: {e}"))
        })?;
        EnvInfo::from_value(&self.0, json)
    }

    /// Starts an episode. The start state draws only from `Rng::new(seed)`, so every episode of a
    /// group (same seed) starts alike; `step` draws from `Rng::derive(seed, stream)`.
    pub fn reset(&self, seed: u64, stream: u64, params: &Map<String, Value>) -> Result<Episode, ScriptError> {
        let mut start = Rng::new(seed);
        let p = to_dynamic(params, self.name())?;
        let state = self.0.call("reset", (seed as rhai::INT, p), Some(&mut start))?;
        if !state.is_map() {
            return Err(self.0.error_in(
                "reset",
                ErrorKind::Contract,
                format!("reset must return the state as a map like #{{player: 0}}; got {}", type_word(&state)),
            ));
        }
        Ok(Episode {
            env: self.clone(),
            state: state.into_shared(),
            rng: Rng::derive(seed, stream),
            seed,
            stream,
            params: params.clone(),
            steps: 0,
            done: false,
        })
    }
}

/// One running episode: the env version it started with, its state and its random stream.
#[derive(Debug)]
pub struct Episode {
    env: EnvScript,
    /// Shared, so that `step(state, action)` can mutate it in place.
    state: Dynamic,
    rng: Rng,
    pub seed: u64,
    pub stream: u64,
    params: Map<String, Value>,
    /// Steps taken so far.
    pub steps: usize,
    pub done: bool,
}

impl Episode {
    pub fn env(&self) -> &EnvScript {
        &self.env
    }

    pub fn render(&self) -> Result<String, ScriptError> {
        let v = self.env.0.call("render", (self.state.clone(),), None)?;
        let what = type_word(&v);
        v.into_string().map_err(|_| {
            self.env.0.error_in("render", ErrorKind::Contract, format!("render must return a string; got {what}"))
        })
    }

    pub fn step(&mut self, action: &str) -> Result<StepOutcome, ScriptError> {
        if self.done {
            return Err(ScriptError::new(self.env.name(), "step called after the episode finished"));
        }
        let v = self.env.0.call("step", (self.state.clone(), action.to_string()), Some(&mut self.rng))?;
        let out = StepOutcome::from_dynamic(&self.env.0, &v)?;
        if !self.state.is_map() {
            return Err(self.env.0.error_in(
                "step",
                ErrorKind::Contract,
                format!("step replaced the state with {}; mutate the map's fields instead", type_word(&self.state)),
            ));
        }
        // The state lives on between calls (a training step holds every episode's): check it
        // with what its closures and curried values hold counted.
        self.env.0.check_value("step", &self.state)?;
        self.steps += 1;
        self.done = out.done;
        Ok(out)
    }

    /// `valid_actions(state)` when defined, else every action in `describe`.
    pub fn valid_actions(&self) -> Result<Vec<String>, ScriptError> {
        if !self.env.0.has_fn("valid_actions", 1) {
            return Ok(self.env.info(&self.params)?.actions);
        }
        let v = self.env.0.call("valid_actions", (self.state.clone(),), None)?;
        match to_json(&v) {
            Ok(Value::Array(a)) if a.iter().all(Value::is_string) => {
                let actions: Vec<String> = a.into_iter().filter_map(|x| x.as_str().map(str::to_string)).collect();
                check_patterns(&self.env.0, "valid_actions", &actions)?;
                Ok(actions)
            }
            Ok(Value::Array(a)) => Err(self.env.0.error_in(
                "valid_actions",
                ErrorKind::Contract,
                format!(
                    "valid_actions must return an array of strings; found {}",
                    a.iter().find(|x| !x.is_string()).map_or(String::new(), Value::to_string)
                ),
            )),
            _ => Err(self.env.0.error_in(
                "valid_actions",
                ErrorKind::Contract,
                format!("valid_actions must return an array of strings; got {}", type_word(&v)),
            )),
        }
    }

    /// Whether the env defines `solve(state)` (the optional solver).
    pub fn has_solver(&self) -> bool {
        self.env.0.has_fn("solve", 1)
    }

    /// The env's own solution from the current state: `solve(state)`'s action list, `Some([])`
    /// when it found none (or the episode is already solved), `None` when the script defines no
    /// `solve`. The solver sees a copy of the state, so it cannot change the episode, and no
    /// random stream (`rng::` fails in it): a solution depends on the state alone.
    pub fn solve(&self) -> Result<Option<Vec<String>>, ScriptError> {
        if !self.has_solver() {
            return Ok(None);
        }
        let v = self.env.0.call("solve", (self.state.flatten_clone(),), None)?;
        if v.is_unit() {
            return Ok(Some(Vec::new()));
        }
        match to_json(&v) {
            Ok(Value::Array(a)) if a.iter().all(Value::is_string) => {
                Ok(Some(a.into_iter().filter_map(|x| x.as_str().map(str::to_string)).collect()))
            }
            _ => Err(self.env.0.error_in(
                "solve",
                ErrorKind::Contract,
                format!(
                    "solve must return an array of action names (or `()` when there is no solution); got {}",
                    type_word(&v)
                ),
            )),
        }
    }

    /// The state map as JSON (for determinism checks and debugging).
    pub fn state_json(&self) -> Value {
        // The shared wrapper must come off first: serde sees only plain values.
        to_json(&self.state.flatten_clone()).unwrap_or(Value::Null)
    }
}
