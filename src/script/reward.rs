//! Reward shaping as scripts ([`RewardScript`]): `fn shape(turn, reward)` gets the parsed turn
//! (think, answer, actions, invalid_actions, format_ok, response) and the reward so far, and
//! returns the shaped reward. An experiment chains several, in order ([`shape_all`]).

use super::env::{to_dynamic, type_word};
use super::error::ScriptError;
use crate::agent::turn::ParsedTurn;

script_role! {
    /// One compiled reward-shaping script. Cheap to clone.
    RewardScript requires [("shape", ["turn", "reward"])]
}

impl RewardScript {
    pub fn shape(&self, turn: &ParsedTurn, reward: f64) -> Result<f64, ScriptError> {
        let v = self.0.call("shape", (to_dynamic(turn, &self.0.name)?, reward), None)?;
        let r = if v.is_int() { v.as_int().unwrap_or(0) as f64 } else { v.as_float().unwrap_or(f64::NAN) };
        if !(v.is_int() || v.is_float()) || !r.is_finite() {
            return Err(ScriptError::new(
                &self.0.name,
                format!("shape must return the reward as a number; got {}", type_word(&v)),
            ));
        }
        Ok(r)
    }
}

/// Applies each script in order to the turn's env reward.
pub fn shape_all(scripts: &[RewardScript], turn: &ParsedTurn, env_reward: f64) -> Result<f64, ScriptError> {
    scripts.iter().try_fold(env_reward, |r, s| s.shape(turn, r))
}
