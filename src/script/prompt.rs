//! Prompt templates as scripts ([`PromptScript`]): `fn system(info)` gives the system message and
//! `fn user(info, turn)` each user message, from the env's description ([`EnvInfo`]) and the
//! turn's [`TurnContext`]. The host assembles `[system, user 1, assistant 1, user 2, …]`.

use serde::Serialize;

use super::env::{to_dynamic, type_word, EnvInfo};
use super::error::{ErrorKind, ScriptError};

/// What a template knows about the turn it writes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TurnContext {
    /// 1-based.
    pub turn: usize,
    /// The env's rendered observation.
    pub obs: String,
    /// Env steps left in the episode.
    pub actions_left: usize,
    /// The previous turn's reward (`()` in the script on the first turn).
    pub prev_reward: Option<f64>,
    /// Whether to ask for a `<think>` block before the answer.
    pub think: bool,
    /// The response length stated in the prompt ("Max response length: N words (tokens)").
    pub max_tokens: usize,
    /// Actions parsed from one answer (`rollout.max_actions_per_turn`, or the env's own): what
    /// "You can make up to N actions" must say, since later pieces are cut.
    pub max_actions_per_turn: usize,
    /// Whether to list the env's legal actions (`rollout.show_actions`, an experiment setting).
    pub show_actions: bool,
    /// The legal actions in this state: the env's `valid_actions(state)`, else `describe`'s.
    pub valid_actions: Vec<String>,
}

/// A reward as a prompt shows it: rounded to 6 decimals, so a sum of shaping terms reads
/// `-0.15`, not `-0.15000000000000002`.
fn shown(reward: f64) -> f64 {
    (reward * 1e6).round() / 1e6
}

script_role! {
    /// One compiled prompt template. Cheap to clone.
    PromptScript requires [("system", ["info"]), ("user", ["info", "turn"])]
}

impl PromptScript {
    fn text(&self, f: &str, v: rhai::Dynamic) -> Result<String, ScriptError> {
        let what = type_word(&v);
        v.into_string()
            .map_err(|_| self.0.error_in(f, ErrorKind::Contract, format!("{f} must return a string; got {what}")))
    }

    pub fn system(&self, info: &EnvInfo) -> Result<String, ScriptError> {
        let v = self.0.call("system", (to_dynamic(info, &self.0.name)?,), None)?;
        self.text("system", v)
    }

    pub fn user(&self, info: &EnvInfo, turn: &TurnContext) -> Result<String, ScriptError> {
        let turn = TurnContext { prev_reward: turn.prev_reward.map(shown), ..turn.clone() };
        let args = (to_dynamic(info, &self.0.name)?, to_dynamic(&turn, &self.0.name)?);
        let v = self.0.call("user", args, None)?;
        self.text("user", v)
    }
}
