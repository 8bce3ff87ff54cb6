//! Packing a finished episode into one training sequence (RAGEN: the whole multi-turn chat is
//! one sequence, the loss on assistant tokens only), with the per-position layout the update
//! needs: loss mask, the score on the last assistant token, and each turn's end for bi-level GAE.
//!
//! Positions follow the policy's log-prob layout: position t scores `ids[t]` given `ids[..t]`.
use anyhow::{bail, Result};

use super::history::History;
use crate::policy::constrain::AnswerGrammar;
use crate::policy::{Allowed, ChatTokens, Policy};

/// One trajectory as the update sees it (empty for an episode played over HTTP: no tokens).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Packed {
    pub ids: Vec<u32>,
    /// True on the assistant tokens the model wrote (the loss mask; text the sampler forced
    /// is out), [T].
    pub mask: Vec<bool>,
    /// The first and the last assistant token of each visible turn, in order, [K].
    pub turn_starts: Vec<usize>,
    pub turn_ends: Vec<usize>,
    /// The reward of each visible turn (shaped, format penalty included), [K].
    pub turn_rewards: Vec<f32>,
    /// The sampler's log-prob of each token it sampled (NaN where unknown), [T]; empty when it
    /// kept none. The local sampler's (the end-of-turn after a stop string included) are the
    /// update's old log-probs, an engine's weigh the update (truncated importance sampling).
    pub rollout_logprobs: Vec<f32>,
    /// Where the reply was a constrained answer: the tokens the sampler could draw at each
    /// position (the update scores those positions over them), [T]; empty when none was.
    pub allowed: Vec<Allowed>,
    /// The positions of `allowed` inside a value slot (drawn at the text temperature, not the
    /// answer's), [T]; empty when none is.
    pub value_slots: Vec<bool>,
}

impl Packed {
    /// From the tokenised chat and the rewards of the turns it shows (the last
    /// `turn_rewards.len()` assistant runs are those turns).
    pub fn new(chat: ChatTokens, turn_rewards: &[f64]) -> Result<Self> {
        let ends = run_ends(&chat.assistant_mask);
        let starts =
            ends.iter().map(|&e| (0..=e).rev().take_while(|&t| chat.assistant_mask[t]).last().unwrap_or(e)).collect();
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
            turn_starts: starts,
            turn_ends: ends,
            turn_rewards: turn_rewards.iter().map(|&r| r as f32).collect(),
            rollout_logprobs: Vec::new(),
            allowed: Vec::new(),
            value_slots: Vec::new(),
        })
    }

    /// Each visible turn's reply, after the opening tag `tag` it was sampled after (the whole
    /// assistant run where `tag` is empty): positions `from..=end`, or `None` where the turn
    /// does not hold the tag. In turn order.
    fn replies(&self, tag: &[u32]) -> Vec<Option<std::ops::RangeInclusive<usize>>> {
        self.turn_starts
            .iter()
            .zip(&self.turn_ends)
            .map(|(&start, &end)| {
                let run = &self.ids[start..=end];
                let at = if tag.is_empty() { Some(0) } else { run.windows(tag.len()).position(|w| w == tag) };
                at.map(|at| start + at + tag.len()..=end)
            })
            .collect()
    }

    /// Places the sampler's log-probs of each turn's sampled ids (`sampled`: the last turns, in
    /// order; the last one is the last visible turn's) on the tokens they scored: after the
    /// opening tag `tag` the reply was sampled after, for as long as the packed ids agree with
    /// the sampled ones. Past the first disagreement (the history keeps a re-serialised answer,
    /// or the template tokenizes the text differently) the context is no longer the one the
    /// sampler saw, so those tokens keep NaN (the update then runs its own old-log-prob pass for
    /// that trajectory, and an engine's get no correction there).
    pub fn set_rollout_logprobs(&mut self, sampled: &[(Vec<u32>, Vec<f32>)], tag: &[u32]) {
        let mut out = vec![f32::NAN; self.ids.len()];
        for (reply, (ids, lps)) in self.replies(tag).into_iter().rev().zip(sampled.iter().rev()) {
            let Some(reply) = reply else { continue };
            let from = *reply.start();
            let agree = self.ids[reply].iter().zip(ids).zip(lps).take_while(|((a, b), _)| a == b).count();
            out[from..from + agree].copy_from_slice(&lps[..agree]);
        }
        self.rollout_logprobs = out;
    }

    /// Takes each visible turn's opening tag `tag` out of the loss: the generation prompt
    /// wrote it, the model did not sample it (only what it sampled is trained).
    pub fn unscore_tags(&mut self, tag: &[u32]) {
        for reply in self.replies(tag).into_iter().flatten() {
            let from = *reply.start();
            self.mask[from - tag.len()..from].fill(false);
        }
    }

    /// Marks the tokens of each constrained answer with the tokens its grammar allowed there,
    /// and takes those it allowed alone out of the loss mask
    /// (`grammars`: the last turns', in order, the last one the last visible turn's; `None`
    /// where a turn was free; `token_texts`: each id's text). The grammar reads the reply as
    /// packed, from the opening tag `tag` on, as the sampler read it; a token off the grammar
    /// (a reply kept as written) and everything after it stay unrestricted, as the sampler left
    /// such a row free.
    pub fn set_allowed(&mut self, grammars: &[Option<AnswerGrammar>], tag: &[u32], token_texts: &[String]) {
        let mut out: Vec<Allowed> = vec![None; self.ids.len()];
        let mut value_slots = vec![false; self.ids.len()];
        for (reply, grammar) in self.replies(tag).into_iter().rev().zip(grammars.iter().rev()) {
            let (Some(reply), Some(grammar)) = (reply, grammar) else { continue };
            let from = *reply.start();
            let mut text = String::new();
            for t in reply {
                let id = self.ids[t];
                match grammar.next_tokens(&text, &self.ids[from..t], token_texts) {
                    // The only token allowed: no choice was made, it leaves the loss (and the
                    // token means) like the opening tag.
                    Some(next) if next == [id] => self.mask[t] = false,
                    Some(next) if next.binary_search(&id).is_ok() => {
                        value_slots[t] = grammar.in_value(&text, &self.ids[from..t], token_texts);
                        out[t] = Some(next.into());
                    }
                    // Outside the answer yet (think mode): free, and the grammar reads on.
                    None if grammar.answer_part(&text).is_none() => {}
                    _ => break,
                }
                text.push_str(token_texts.get(id as usize).map_or("", String::as_str));
            }
        }
        self.allowed = if out.iter().any(Option::is_some) { out } else { Vec::new() };
        self.value_slots = if value_slots.contains(&true) { value_slots } else { Vec::new() };
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
        // The tags leave the loss, and the replies are still found after them.
        p.unscore_tags(&[10]);
        assert_eq!(p.mask.iter().filter(|&&m| m).count(), 2 + 3);
        assert!(!p.mask[1] && !p.mask[6] && p.mask[2] && p.mask[7]);
        p.set_rollout_logprobs(&sampled, &[10]);
        assert_eq!(p.rollout_logprobs[2], -0.5);
    }

    #[test]
    fn constrained_answers_are_marked_with_the_tokens_their_grammar_allowed() {
        let texts: Vec<String> =
            ["", "<answer>", "red", "blue", "</answer>", "r", "ed", "x", "<|im_end|>"].map(String::from).to_vec();
        // Three turns after the tag `<answer>` (1): "red" | "r" "ed" | "x" (off the grammar),
        // each closed by the template's end-of-turn id 8.
        let ids = vec![0, 1, 2, 4, 8, 0, 1, 5, 6, 4, 8, 0, 1, 7, 4, 8];
        let assistant: Vec<bool> = ids.iter().map(|&i| i != 0).collect();
        let chat = ChatTokens { ids: ids.clone(), assistant_mask: assistant.clone(), scored: assistant };
        let mut p = Packed::new(chat, &[0.0, 0.0, 1.0]).unwrap();
        let g = AnswerGrammar::new(&["red".into(), "blue".into()], 1, true);
        p.set_allowed(&[g.clone(), g.clone(), g.clone()], &[1], &texts);
        let got: Vec<Option<Vec<u32>>> = p.allowed.iter().map(|a| a.as_deref().map(<[u32]>::to_vec)).collect();
        let first = Some(vec![2, 3, 5]);
        #[rustfmt::skip]
        let want = [None, None, first.clone(), None, None,
                    None, None, first, None, None, None,
                    None, None, None, None, None];
        assert_eq!(got, want);
        // What followed `r` and the closing tags were the only tokens allowed: out of the loss.
        let scored: Vec<usize> = (0..ids.len()).filter(|&t| p.mask[t]).collect();
        assert_eq!(scored, [1, 2, 4, 6, 7, 10, 12, 13, 14, 15]);
        // A free turn is left alone; no constrained turn at all leaves nothing.
        p.set_allowed(&[g.clone(), None, None], &[1], &texts);
        assert_eq!(p.allowed.iter().filter(|a| a.is_some()).count(), 1);
        p.set_allowed(&[None], &[1], &texts);
        assert!(p.allowed.is_empty());
    }

    #[test]
    fn reward_count_must_match_turns() {
        let chat = ChatTokens { ids: vec![1, 2], assistant_mask: vec![false, true], scored: vec![false, true] };
        assert!(Packed::new(chat, &[1.0, 2.0]).unwrap_err().to_string().contains("1 assistant turns but 2"));
    }
}
