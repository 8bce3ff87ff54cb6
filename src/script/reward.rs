//! Reward shaping as scripts ([`RewardScript`]): `fn shape(turn, reward)` gets the parsed turn
//! (think, answer, actions, invalid_actions, format_ok, response, and `env_actions`: the env's
//! action names, empty for free-text envs) and the reward so far, and returns the shaped reward.
//! An experiment chains several, in order ([`shape_all`]); [`apply_and_shape`] plays a turn and
//! shapes its reward.
use rhai::Dynamic;

use super::env::{reward_value, to_dynamic};
use super::env::{Episode, StepOutcome};
use super::error::{ErrorKind, ScriptError};
use super::turn::{apply_turn, Applied, ParsedTurn};

script_role! {
    /// One compiled reward-shaping script. Cheap to clone.
    RewardScript requires [("shape", ["turn", "reward"])]
}

impl RewardScript {
    /// Shapes `reward` for `turn`, a turn of an env whose action names are `env_actions`.
    pub fn shape(&self, turn: &ParsedTurn, env_actions: &[String], reward: f64) -> Result<f64, ScriptError> {
        let mut map = to_dynamic(turn, &self.0.name)?.cast::<rhai::Map>();
        map.insert("env_actions".into(), to_dynamic(&env_actions, &self.0.name)?);
        let v = self.0.call("shape", (Dynamic::from_map(map), reward), None)?;
        reward_value(&v, "the reward shape returns").map_err(|m| self.0.error_in("shape", ErrorKind::Contract, m))
    }
}

/// The chain with `edited` in place of the script of the same name (its path in the project),
/// or at the end when the chain holds none.
pub fn with_edit(chain: &[RewardScript], edited: &RewardScript) -> Vec<RewardScript> {
    let mut out = chain.to_vec();
    match out.iter_mut().find(|r| r.script().name == edited.script().name) {
        Some(slot) => *slot = edited.clone(),
        None => out.push(edited.clone()),
    }
    out
}

/// Applies each script in order to the turn's env reward.
pub fn shape_all(
    scripts: &[RewardScript],
    turn: &ParsedTurn,
    env_actions: &[String],
    env_reward: f64,
) -> Result<f64, ScriptError> {
    scripts.iter().try_fold(env_reward, |r, s| s.shape(turn, env_actions, r))
}

/// [`apply_turn`], then the turn reward: the env reward through the reward scripts in order
/// (`env_actions`: the env's action names, which the scripts see as `turn.env_actions`).
pub fn apply_and_shape(
    ep: &mut Episode,
    turn: &ParsedTurn,
    max_actions: usize,
    rewards: &[RewardScript],
    env_actions: &[String],
    on_step: impl FnMut(&Episode, &str, &StepOutcome) -> Result<(), ScriptError>,
) -> Result<(Applied, f64), ScriptError> {
    let applied = apply_turn(ep, turn, max_actions, on_step)?;
    let reward = shape_all(rewards, turn, env_actions, applied.env_reward)?;
    Ok((applied, reward))
}
