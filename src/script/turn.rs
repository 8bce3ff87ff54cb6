//! Parsing one model response into think text, answer text and actions, as RAGEN's
//! `ctx_manager` does: `<think>…</think><answer>…</answer>` (DOTALL, first match), the answer
//! split on `||`, each piece trimmed, the list cut to `max_actions_per_turn`, then each piece
//! matched case-insensitively to the env's action names (unknown ones reported as invalid).
//!
//! [`apply_turn`] then plays a parsed turn on an episode: the one place where actions meet the
//! env, shared by the rollout, `ragen-lab play` and `ragen-lab check --turn`, so the three
//! cannot disagree about which actions run and when an episode ends.
//!
//! The trainer appends `<think>` (or `<answer>` in no-think mode) after the generation prompt, so
//! a response usually begins inside the block; like RAGEN we prepend the opening tag unless the
//! model wrote it again itself.
use serde::{Deserialize, Serialize};

use super::env::{EnvInfo, Episode, StepOutcome};
use super::error::ScriptError;
use super::pattern;

/// The separator between actions in one answer.
pub const ACTION_SEP: &str = "||";

/// One parsed response.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParsedTurn {
    /// The think text (trimmed); `None` in no-think mode or when the format failed.
    pub think: Option<String>,
    /// The answer text (trimmed); `None` when the format failed.
    pub answer: Option<String>,
    /// Valid actions, canonical names (for free-text envs: the trimmed pieces), in order.
    pub actions: Vec<String>,
    /// Pieces that named no action of the env.
    pub invalid_actions: Vec<String>,
    /// The response matched the required tags.
    pub format_ok: bool,
    /// The raw response as generated.
    pub response: String,
    /// The response after the opening tag the prompt ended with (`<think>` or `<answer>`):
    /// what a failed turn keeps in the history, so the update scores its tokens in the context
    /// they were sampled in.
    #[serde(skip)]
    pub opened: String,
}

/// Finds the text between `open` and the next `close` at or after `from`; returns (inner, end).
fn between<'a>(s: &'a str, open: &str, close: &str, from: usize) -> Option<(&'a str, usize, usize)> {
    let start = s[from..].find(open)? + from;
    let inner_start = start + open.len();
    let end = s[inner_start..].find(close)? + inner_start;
    Some((&s[inner_start..end], start, end + close.len()))
}

/// Parses `response`. `actions` are the env's action names (empty: free text, every piece is
/// valid); `think` says whether a think block is required before the answer.
pub fn parse_turn(response: &str, actions: &[String], max_actions_per_turn: usize, think: bool) -> ParsedTurn {
    let open = if think { "<think>" } else { "<answer>" };
    let opened = format!("{open}{response}");
    let text = if response.trim_start().starts_with(open) { response.to_string() } else { opened.clone() };
    let parsed = if think {
        // `<think>(.*?)</think>\s*<answer>(.*?)</answer>`: the answer must follow the think
        // block with only whitespace between.
        between(&text, "<think>", "</think>", 0).and_then(|(t, _, after)| {
            let rest = &text[after..];
            let gap = rest.len() - rest.trim_start().len();
            let (a, start, _) = between(&text, "<answer>", "</answer>", after + gap)?;
            (start == after + gap).then(|| (Some(t.trim().to_string()), a.trim().to_string()))
        })
    } else {
        between(&text, "<answer>", "</answer>", 0).map(|(a, _, _)| (None, a.trim().to_string()))
    };
    let Some((think_text, answer)) = parsed else {
        return ParsedTurn {
            think: None,
            answer: None,
            actions: Vec::new(),
            invalid_actions: Vec::new(),
            format_ok: false,
            response: response.to_string(),
            opened,
        };
    };
    let mut valid = Vec::new();
    let mut invalid = Vec::new();
    for piece in answer.split(ACTION_SEP).map(str::trim).filter(|p| !p.is_empty()).take(max_actions_per_turn) {
        if actions.is_empty() {
            valid.push(piece.to_string());
        } else if let Some(name) = actions.iter().find(|a| a.eq_ignore_ascii_case(piece)) {
            valid.push(name.clone());
        } else if actions.iter().any(|a| pattern::has_slot(a) && pattern::matches(a, piece)) {
            // An action with arguments: the env reads its values from the text as written.
            valid.push(piece.to_string());
        } else {
            invalid.push(piece.to_string());
        }
    }
    ParsedTurn {
        think: think_text,
        answer: Some(answer),
        actions: valid,
        invalid_actions: invalid,
        format_ok: true,
        response: response.to_string(),
        opened,
    }
}

impl ParsedTurn {
    /// The form RAGEN keeps in the chat history: `<think>t</think><answer>a || b</answer>` from
    /// the parsed pieces, or when the format failed the raw response after its opening tag
    /// (RAGEN keeps the raw text; the tag it was sampled after belongs with it).
    pub fn reserialize(&self) -> String {
        let Some(answer) = &self.answer else {
            return self.opened.clone();
        };
        let pieces: Vec<&str> = answer.split(ACTION_SEP).map(str::trim).filter(|p| !p.is_empty()).collect();
        let joined = pieces.join(&format!(" {ACTION_SEP} "));
        match &self.think {
            Some(t) => format!("<think>{t}</think><answer>{joined}</answer>"),
            None => format!("<answer>{joined}</answer>"),
        }
    }

    /// Whether RAGEN's format penalty applies: the format failed, an action was invalid, or no
    /// valid action remained.
    pub fn penalized(&self) -> bool {
        !self.format_ok || !self.invalid_actions.is_empty() || self.actions.is_empty()
    }
}

/// The limits turns are played under, the same in `train`, `play` and `check --turn`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TurnLimits {
    /// Env steps per episode over all turns; the episode is done when they are spent.
    pub max_actions: usize,
    /// Actions taken from one answer (`a || b || …`); later pieces are cut.
    pub max_actions_per_turn: usize,
}

impl TurnLimits {
    /// The settings' values (`rollout.max_actions`, `rollout.max_actions_per_turn`), where 0 means
    /// the env's own (`describe()`), and never below 1.
    pub fn resolve(info: &EnvInfo, max_actions: usize, max_actions_per_turn: usize) -> Self {
        let pick = |set: usize, env: usize| if set > 0 { set } else { env }.max(1);
        Self {
            max_actions: pick(max_actions, info.max_actions),
            max_actions_per_turn: pick(max_actions_per_turn, info.max_actions_per_turn),
        }
    }

    /// Parses `response` against `info`'s action names under these limits.
    pub fn parse(&self, response: &str, info: &EnvInfo, think: bool) -> ParsedTurn {
        parse_turn(response, &info.actions, self.max_actions_per_turn, think)
    }
}

/// The rollout settings that decide how a turn is parsed and played (`rollout.max_actions`,
/// `rollout.max_actions_per_turn`, 0 = the env's own; `rollout.think`), for the tools that play
/// turns outside training; made from the rollout section (`agent::settings`), so its defaults
/// are training's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnSettings {
    pub max_actions: usize,
    pub max_actions_per_turn: usize,
    pub think: bool,
}

/// What one turn's actions did to an episode.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Applied {
    /// Each action stepped, with what the env said, in order.
    pub steps: Vec<(String, StepOutcome)>,
    /// Sum of the env's step rewards.
    pub env_reward: f64,
    /// The parsed turn's invalid pieces, then the stepped actions the env called invalid.
    pub invalid_actions: Vec<String>,
    /// A step reported success.
    pub success: bool,
    /// Actions the turn named but that were not played: the episode ended first, or the
    /// episode's action budget ran out (as in RAGEN, they are dropped).
    pub dropped: Vec<String>,
    /// The episode is over: the env said done, or the budget of `max_actions` is spent.
    pub done: bool,
}

impl Applied {
    /// Stepped actions the env accepted.
    pub fn valid_steps(&self) -> usize {
        self.steps.iter().filter(|(_, o)| o.valid).count()
    }
}

/// Plays `turn`'s actions on `ep` in order, stopping when the env says done or when the episode
/// has taken `max_actions` steps (counted over the whole episode, `ep.steps`). `on_step` sees each
/// step right after it happens (play prints it).
pub fn apply_turn(
    ep: &mut Episode,
    turn: &ParsedTurn,
    max_actions: usize,
    mut on_step: impl FnMut(&Episode, &str, &StepOutcome) -> Result<(), ScriptError>,
) -> Result<Applied, ScriptError> {
    let mut out = Applied { invalid_actions: turn.invalid_actions.clone(), ..Applied::default() };
    for (i, action) in turn.actions.iter().enumerate() {
        if ep.done || ep.steps >= max_actions {
            out.dropped = turn.actions[i..].to_vec();
            break;
        }
        let step = ep.step(action)?;
        out.env_reward += step.reward;
        out.success |= step.success;
        if !step.valid {
            out.invalid_actions.push(action.clone());
        }
        on_step(ep, action, &step)?;
        out.steps.push((action.clone(), step));
    }
    out.done = ep.done || ep.steps >= max_actions;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        ["Up", "Down", "Left", "Right"].map(String::from).to_vec()
    }

    #[test]
    fn a_response_starting_inside_the_think_block_parses() {
        let t = parse_turn(" box is left </think> <answer> left || UP </answer>", &names(), 5, true);
        assert!(t.format_ok);
        assert_eq!(t.think.as_deref(), Some("box is left"));
        assert_eq!(t.actions, ["Left", "Up"]);
        assert!(t.invalid_actions.is_empty() && !t.penalized());
        assert_eq!(t.reserialize(), "<think>box is left</think><answer>left || UP</answer>");
    }

    #[test]
    fn a_repeated_opening_tag_is_not_doubled() {
        let t = parse_turn("<think>x</think><answer>Down</answer> trailing", &names(), 5, true);
        assert_eq!((t.think.as_deref(), t.actions.as_slice()), (Some("x"), ["Down".to_string()].as_slice()));
    }

    #[test]
    fn invalid_actions_are_reported_and_the_list_is_cut_to_k_first() {
        let t = parse_turn("t</think><answer>Up || jump || Down || Left</answer>", &names(), 2, true);
        assert_eq!(t.actions, ["Up"]);
        assert_eq!(t.invalid_actions, ["jump"]);
        assert!(t.penalized());
    }

    #[test]
    fn an_action_with_arguments_is_taken_as_written_where_its_pattern_matches() {
        let acts: Vec<String> = ["approve", "extract total={money}"].map(String::from).to_vec();
        let t = parse_turn("extract total=12.50 || extract total=12 || Approve</answer>", &acts, 3, false);
        assert_eq!(t.actions, ["extract total=12.50", "approve"]);
        assert_eq!(t.invalid_actions, ["extract total=12"]);
    }

    #[test]
    fn missing_or_misordered_tags_fail_the_format() {
        for bad in ["just Up", "t</think> Up", "t</think> words <answer>Up</answer>", "<answer>Up</answer>"] {
            let t = parse_turn(bad, &names(), 5, true);
            assert!(!t.format_ok && t.actions.is_empty() && t.penalized(), "{bad}");
            assert_eq!(t.reserialize(), format!("<think>{bad}"), "kept after the tag it was sampled after");
        }
    }

    #[test]
    fn no_think_mode_needs_only_the_answer_and_free_text_keeps_pieces() {
        let t = parse_turn(" x = 5 </answer>", &[], 1, false);
        assert!(t.format_ok && t.think.is_none());
        assert_eq!(t.actions, ["x = 5"]);
        assert_eq!(t.reserialize(), "<answer>x = 5</answer>");
        let empty = parse_turn("</answer>", &names(), 5, false);
        assert!(empty.format_ok && empty.penalized());
    }
}
