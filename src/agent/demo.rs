//! Demonstrations from an environment's own solver, for a supervised warm start before RL
//! (RAGEN App. C: SFT on BFS trajectories). Each episode is played as the rollout plays it: the
//! same [`Turns`] opens every turn (system and user messages, context window, limits, `think`),
//! but instead of sampling, the answer is the first k actions of `solve(state)` on the current
//! state (re-planned every turn, so a slip on the ice is corrected). The answer is taken by
//! [`Play::take_reply`] like a sampled one, and the finished episode
//! is packed like a trajectory (`Packed::from_history`): the loss mask covers the answers.
//!
//! The answer text is what the model would have generated after the opening tag:
//! `A || B</answer>` in no-think mode; in think mode a short plan first,
//! `Shortest path: A, B, C.</think><answer>A || B</answer>` (the whole remaining path, of which
//! the turn takes the first k), because an empty think block teaches the model to skip thinking.
//!
//! What it does not do: train (starpo::sft), or make up for an env without `solve`.
use anyhow::{bail, Result};
use serde::Serialize;
use serde_json::{Map, Value};

use super::pack::Packed;
use super::rollout::{Play, Reply, TurnRecord, Turns};
use super::settings::Rollout;
use crate::policy::Policy;
use crate::script::ExperimentScripts;

/// One solver-played episode.
#[derive(Clone, Debug)]
pub struct Demo {
    pub seed: u64,
    /// The episode reached success (a slippery env can drop the solver in a hole).
    pub success: bool,
    /// R(τ) = Σ turn rewards, as the rollout scores it.
    pub score: f64,
    pub turns: Vec<TurnRecord>,
    /// Ended by `rollout.max_context_tokens`.
    pub truncated: bool,
    pub packed: Packed,
}

/// What a set of demonstrations holds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DemoStats {
    /// Episodes kept (each has at least one turn).
    pub episodes: usize,
    /// Seeds skipped because the solver found no solution from the start state.
    pub unsolvable: usize,
    /// Kept episodes that reached success when played by the solver.
    pub solved: usize,
    pub turns: usize,
    /// Tokens of all packed sequences, and of their assistant parts (what the loss covers).
    pub tokens: usize,
    pub assistant_tokens: usize,
    /// Turns whose answer failed to parse or named an action the env does not have; 0 unless
    /// the solver returns names outside the env's `actions`.
    pub format_errors: usize,
    pub invalid_actions: usize,
    /// Answers longer than `rollout.response_length` tokens (the model could not produce them
    /// in a rollout; shorten the think text or raise the setting).
    pub over_response_length: usize,
}

impl DemoStats {
    /// The fraction of kept episodes the solver itself solved.
    pub fn solved_fraction(&self) -> f64 {
        self.solved as f64 / self.episodes.max(1) as f64
    }
}

/// The text generated after the opening tag for `actions` (this turn's) out of `path` (the whole
/// remaining plan).
pub fn answer_text(actions: &[String], path: &[String], think: bool) -> String {
    let answer = format!("{}</answer>", actions.join(" || "));
    if think {
        format!("Shortest path: {}.</think><answer>{answer}", path.join(", "))
    } else {
        answer
    }
}

/// Plays one episode per seed with the env's solver under the rollout settings `s` and the env
/// parameters `params`, and packs each with `policy`'s chat template. Seeds whose start state
/// the solver cannot solve are skipped (counted in `unsolvable`).
pub fn demonstrations(
    policy: &Policy,
    scripts: &ExperimentScripts,
    params: &Map<String, Value>,
    seeds: &[u64],
    s: &Rollout,
    mut on_episode: impl FnMut(&DemoStats),
) -> Result<(Vec<Demo>, DemoStats)> {
    let turns = Turns::new(scripts, params, s)?;
    let (k, max_actions) = (turns.limits.max_actions_per_turn, turns.limits.max_actions);
    let mut stats = DemoStats::default();
    let mut demos = Vec::new();
    for &seed in seeds {
        let mut play = Play::new(scripts, 0, 0, seed, params, &turns.system)?;
        for turn in 1..=turns.max_turns {
            // 1. Plan from where the episode is now.
            let Some(path) = play.episode.solve()? else {
                bail!(
                    "{} defines no `fn solve(state)`: demonstrations need the env's own solver (docs/training.md, \"Warm start from solvers\")",
                    scripts.env.name()
                );
            };
            if path.is_empty() {
                break;
            }
            // 2. Open the turn exactly as the rollout does.
            let Some(open) =
                turns.open(policy, scripts, &play.episode, &mut play.history, turn, play.prev_reward, s)?
            else {
                play.truncated = true;
                break;
            };
            // 3. Answer with the plan's first k actions (never more than the episode has left),
            // taken like a sampled answer.
            let take = k.min(max_actions.saturating_sub(play.episode.steps)).min(path.len());
            let text = answer_text(&path[..take], &path, s.think);
            let tokens = policy.encode_plain(&text)?.len();
            stats.over_response_length += usize::from(tokens > s.response_length);
            let reply = Reply { text, tokens, forced: false, sampled: None, verbatim: None, grammar: None };
            play.take_reply(&turns, scripts, s, turn, (open.obs, open.user, open.valid_actions.len()), reply, |t| {
                Ok(policy.encode_plain(t)?.len())
            })?;
            let taken = play.turns.last().expect("a turn was just taken");
            stats.format_errors += usize::from(!taken.format_ok);
            stats.invalid_actions += taken.invalid_actions.len();
            if play.done {
                break;
            }
        }
        if play.turns.is_empty() {
            stats.unsolvable += 1;
            on_episode(&stats);
            continue;
        }
        // 4. Pack it as the rollout packs a trajectory.
        let rewards: Vec<f64> = play.turns.iter().map(|t| t.reward).collect();
        let packed = Packed::from_history(policy, &play.history, &rewards, s.context_window)?;
        stats.episodes += 1;
        stats.solved += usize::from(play.success);
        stats.turns += play.turns.len();
        stats.tokens += packed.ids.len();
        stats.assistant_tokens += packed.assistant_tokens();
        let score = rewards.iter().sum();
        demos.push(Demo { seed, success: play.success, score, turns: play.turns, truncated: play.truncated, packed });
        on_episode(&stats);
    }
    Ok((demos, stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_continues_the_opening_tag() {
        let p = |xs: &[&str]| xs.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        assert_eq!(answer_text(&p(&["Up", "Left"]), &p(&["Up", "Left", "Up"]), false), "Up || Left</answer>");
        assert_eq!(
            answer_text(&p(&["Up"]), &p(&["Up", "Left"]), true),
            "Shortest path: Up, Left.</think><answer>Up</answer>"
        );
    }
}
