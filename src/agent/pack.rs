//! Packing a finished episode into one training sequence (RAGEN: the whole multi-turn chat is
//! one sequence, the loss on assistant tokens only), with the per-position layout the update
//! needs: loss mask, the score on the last assistant token, and each turn's end for bi-level GAE.
//!
//! Positions follow the policy's log-prob layout: position t scores `ids[t]` given `ids[..t]`.
use anyhow::{bail, Result};

use super::history::History;
use crate::policy::{ChatTokens, Policy};

/// One trajectory as the update sees it (empty for an episode played over HTTP: no tokens).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Packed {
    pub ids: Vec<u32>,
    /// True on the assistant tokens the model wrote (the loss mask; text the sampler forced
    /// is out), [T].
    pub mask: Vec<bool>,
    /// The last assistant token of each visible turn, in order, [K].
    pub turn_ends: Vec<usize>,
    /// The reward of each visible turn (shaped, format penalty included), [K].
    pub turn_rewards: Vec<f32>,
    /// The generating engine's log-prob of each token it sampled (NaN where unknown), [T]; empty
    /// when the policy itself generated (the update then has nothing to correct).
    pub rollout_logprobs: Vec<f32>,
}

impl Packed {
    /// From the tokenised chat and the rewards of the turns it shows (the last
    /// `turn_rewards.len()` assistant runs are those turns).
    pub fn new(chat: ChatTokens, turn_rewards: &[f64]) -> Result<Self> {
        let ends = run_ends(&chat.assistant_mask);
        if ends.len() != turn_rewards.len() {
            bail!(
                "packing: the chat has {} assistant turns but {} turn rewards (does the chat template mark assistant tokens?)",
                ends.len(),
                turn_rewards.len()
            );
        }
        Ok(Self {
            ids: chat.ids,
            mask: chat.scored,
            turn_ends: ends,
            turn_rewards: turn_rewards.iter().map(|&r| r as f32).collect(),
            rollout_logprobs: Vec::new(),
        })
    }

    /// Places the engine's log-probs of each turn's sampled ids (`sampled`: the last turns, in
    /// order; the last one is the last visible turn's) on the tokens they scored: after the
    /// opening tag `tag` the reply was sampled after, for as long as the packed ids agree with
    /// the sampled ones. Past the first disagreement (the history keeps a re-serialised answer,
    /// or the template tokenizes the text differently) the context is no longer the one the
    /// engine saw, so those tokens keep NaN and get no correction.
    pub fn set_rollout_logprobs(&mut self, sampled: &[(Vec<u32>, Vec<f32>)], tag: &[u32]) {
        let mut out = vec![f32::NAN; self.ids.len()];
        for (&end, (ids, lps)) in self.turn_ends.iter().rev().zip(sampled.iter().rev()) {
            let mut start = end;
            while start > 0 && self.mask[start - 1] {
                start -= 1;
            }
            let run = &self.ids[start..=end];
            let at = if tag.is_empty() { Some(0) } else { run.windows(tag.len()).position(|w| w == tag) };
            let Some(at) = at else { continue };
            let from = start + at + tag.len();
            let agree = self.ids[from..=end].iter().zip(ids).zip(lps).take_while(|((a, b), _)| a == b).count();
            out[from..from + agree].copy_from_slice(&lps[..agree]);
        }
        self.rollout_logprobs = out;
    }

    /// A finished episode's chat as the model last saw it (the context window: the last `window`
    /// turns, 0 = all), through `policy`'s chat template, with the rewards of all its turns (the
    /// shown turns' are kept). The rollout and the solver demonstrations pack with this.
    pub fn from_history(policy: &Policy, history: &History, turn_rewards: &[f64], window: usize) -> Result<Self> {
        let shown = history.visible_turns(window).min(turn_rewards.len());
        let chat = policy.chat_tokens(&history.messages(window), false)?;
        Self::new(chat, &turn_rewards[turn_rewards.len() - shown..])
    }

    /// Token-level rewards with the whole score R = Σ turn rewards on the last assistant token
    /// (RAGEN `use_turn_scores: False`), [T].
    pub fn score_rewards(&self, score: f32) -> Vec<f32> {
        let mut r = vec![0.0; self.ids.len()];
        if let Some(&last) = self.turn_ends.last() {
            r[last] = score;
        }
        r
    }

    pub fn assistant_tokens(&self) -> usize {
        self.mask.iter().filter(|&&m| m).count()
    }
}

/// Token positions that differ across `seqs`: the size of the prefix tree they make (what a
/// model must compute at least once to score them all).
pub fn distinct_positions(seqs: &[&[u32]]) -> usize {
    let mut sorted = seqs.to_vec();
    sorted.sort();
    let mut total = 0;
    for (i, s) in sorted.iter().enumerate() {
        let shared = if i == 0 { 0 } else { sorted[i - 1].iter().zip(*s).take_while(|(a, b)| a == b).count() };
        total += s.len() - shared;
    }
    total
}

/// The last index of every run of `true`.
fn run_ends(mask: &[bool]) -> Vec<usize> {
    (0..mask.len()).filter(|&t| mask[t] && (t + 1 == mask.len() || !mask[t + 1])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_ends_and_score_on_last_assistant_token() {
        let chat = ChatTokens {
            ids: vec![1, 2, 3, 4, 5, 6, 7, 8],
            assistant_mask: vec![false, false, true, true, true, false, true, false],
            // Position 3 was forced by the sampler: in the turn, out of the loss.
            scored: vec![false, false, true, false, true, false, true, false],
        };
        let p = Packed::new(chat, &[0.5, -0.1]).unwrap();
        assert_eq!(p.turn_ends, vec![4, 6]);
        assert_eq!(p.score_rewards(0.4), vec![0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0]);
        assert_eq!(p.assistant_tokens(), 3);
        assert!(!p.mask[3]);
    }

    #[test]
    fn distinct_positions_count_a_shared_prefix_once() {
        let (a, b, c) = ([1, 2, 3, 4], [1, 2, 5], [9]);
        assert_eq!(distinct_positions(&[&a, &b, &c]), 2 + 2 + 1 + 1);
        assert_eq!(distinct_positions(&[&a, &a]), 4);
        assert_eq!(distinct_positions(&[]), 0);
    }

    #[test]
    fn engine_logprobs_land_on_the_tokens_they_scored() {
        // Two visible turns, each `10` (the opening tag) then the reply, then an end-of-turn id.
        let chat = ChatTokens {
            ids: vec![1, 10, 11, 12, 2, 3, 10, 20, 21, 9, 4],
            assistant_mask: vec![false, true, true, true, false, false, true, true, true, true, false],
            scored: vec![false, true, true, true, false, false, true, true, true, true, false],
        };
        let mut p = Packed::new(chat, &[0.0, 1.0]).unwrap();
        // Turn 1 sampled 11, 12; turn 2 sampled 20, 21 and a stop id 99 the template writes as
        // 9; an earlier turn is outside the window.
        let sampled =
            [(vec![5], vec![-9.0]), (vec![11, 12], vec![-0.5, -0.25]), (vec![20, 21, 99], vec![-1.0, -2.0, -3.0])];
        p.set_rollout_logprobs(&sampled, &[10]);
        let got: Vec<String> = p.rollout_logprobs.iter().map(|x| format!("{x}")).collect();
        assert_eq!(got, ["NaN", "NaN", "-0.5", "-0.25", "NaN", "NaN", "NaN", "-1", "-2", "NaN", "NaN"]);
        // Only the last turn given: it lands on the last visible turn. A reply re-serialised
        // differently keeps what agrees before the first difference.
        p.set_rollout_logprobs(&[(vec![20, 7], vec![-1.0, -0.1])], &[10]);
        let known: Vec<usize> = (0..11).filter(|&i| !p.rollout_logprobs[i].is_nan()).collect();
        assert_eq!(known, [7]);
        // No opening tag in the turn: nothing is placed.
        p.set_rollout_logprobs(&sampled, &[42]);
        assert!(p.rollout_logprobs.iter().all(|x| x.is_nan()));
    }

    #[test]
    fn reward_count_must_match_turns() {
        let chat = ChatTokens { ids: vec![1, 2], assistant_mask: vec![false, true], scored: vec![false, true] };
        assert!(Packed::new(chat, &[1.0, 2.0]).unwrap_err().to_string().contains("1 assistant turns but 2"));
    }
}
