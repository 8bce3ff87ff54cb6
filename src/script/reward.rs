//! Reward shaping as scripts ([`RewardScript`]): `fn shape(turn, reward)` gets the parsed turn
//! (think, answer, actions, invalid_actions, format_ok, response) and the reward so far, and
//! returns the shaped reward. An experiment chains several, in order ([`shape_all`]).

use super::env::{reward_value, to_dynamic};
use super::error::{ErrorKind, ScriptError};
use super::turn::ParsedTurn;

script_role! {
    /// One compiled reward-shaping script. Cheap to clone.
    RewardScript requires [("shape", ["turn", "reward"])]
}

impl RewardScript {
    pub fn shape(&self, turn: &ParsedTurn, reward: f64) -> Result<f64, ScriptError> {
        let v = self.0.call("shape", (to_dynamic(turn, &self.0.name)?, reward), None)?;
        reward_value(&v, "the reward shape returns").map_err(|m| self.0.error_in("shape", ErrorKind::Contract, m))
    }
}

/// Applies each script in order to the turn's env reward.
pub fn shape_all(scripts: &[RewardScript], turn: &ParsedTurn, env_reward: f64) -> Result<f64, ScriptError> {
    scripts.iter().try_fold(env_reward, |r, s| s.shape(turn, r))
}
