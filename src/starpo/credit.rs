//! Steps 3 to 5 of a StarPO step, from played episodes to what the update trains on: each
//! episode's score normalised within its group (or the batch), the filter's choice of whole
//! groups, and each kept episode's advantage (per turn for turn-level GRPO) with its scale.
//! Trajectories in, credit out: the trainer logs it and hands it to the update.
use anyhow::Result;

use super::advantage::{outcome, turn_grpo};
use super::filter::{alike_groups, choice_stds, group_metric, group_stds, select};
use super::normalize::{norm_groups, normalize, normalizer};
use super::settings::{AdvantageKind, FilterKind, FilterLossScaling, FilterMetric, Settings, Starpo};
use super::update::Item;
use crate::agent::rollout::{groups, Trajectory};

/// A step's credit assignment. Indices are the trajectories' (`members[g]` lists group `g`'s).
pub struct Credit {
    pub members: Vec<Vec<usize>>,
    /// Scores normalised as `starpo.reward_norm` says.
    pub normed: Vec<f64>,
    /// Each group's reward std.
    pub stds: Vec<f64>,
    /// The groups the filter kept, and their members.
    pub kept_groups: Vec<usize>,
    pub kept: Vec<usize>,
    /// Each trajectory's advantage; per turn under turn-level GRPO (else empty).
    pub adv: Vec<f64>,
    pub turn_adv: Vec<Vec<f64>>,
    /// Each trajectory's factor on its advantages ([`adv_scales`]).
    pub scales: Vec<f64>,
    /// Every kept advantage is 0 or cancels: an update would apply only the regularisers.
    pub no_signal: bool,
}

impl Credit {
    /// `greedy` holds each group's greedy score (ReMax's baseline; else empty); `entropies`
    /// gives each trajectory's mean token entropy, asked for only by the entropy filters.
    pub fn assign(
        trajs: &[Trajectory],
        greedy: &[f64],
        s: &Settings,
        entropies: impl FnOnce() -> Result<Vec<f64>>,
    ) -> Result<Self> {
        let sp = &s.starpo;
        // 3. Score and normalise within each group (or the batch: starpo.reward_norm_grouping).
        let scores: Vec<f64> = trajs.iter().map(|t| t.score).collect();
        let members = groups(trajs);
        let sets = norm_groups(sp.reward_norm_grouping, &members);
        let normed = normalize(&scores, &sets, sp.reward_norm);

        // 4. Filter whole groups, ranked by in-group reward std (or the chosen metric); the std of
        // a group that played one trajectory is luck, not the agent's, and ranks as none.
        let stds = group_stds(&scores, &members);
        let ids: Vec<&[u32]> = trajs.iter().map(|t| t.packed.ids.as_slice()).collect();
        let alike = alike_groups(&ids, &members);
        let metric = match (sp.filter, sp.filter_metric) {
            (FilterKind::None | FilterKind::Std, _) | (_, FilterMetric::RewardVariance) => choice_stds(&stds, &alike),
            (_, m) => {
                let entropies = match m {
                    FilterMetric::Entropy | FilterMetric::EntropyVariance => entropies()?,
                    _ => Vec::new(),
                };
                let lengths: Vec<f64> = trajs.iter().map(|t| t.packed.assistant_tokens() as f64).collect();
                group_metric(m, &scores, &entropies, &lengths, &members)
            }
        };
        let kept_groups = select(&metric, sp);
        let kept: Vec<usize> = kept_groups.iter().flat_map(|&g| members[g].clone()).collect();

        // 5. Advantages of the critic-free estimators, from each group's normalised scores (ReMax:
        // less the group's greedy episode, normalised as its set is); the critic ones take the
        // normalised score.
        let baselines: Vec<f64> = greedy
            .iter()
            .enumerate()
            .map(|(g, &b)| {
                let set = sets.iter().find(|m| m.contains(&members[g][0])).expect("every group is in a set");
                normalizer(&set.iter().map(|&i| scores[i]).collect::<Vec<_>>(), sp.reward_norm)(b)
            })
            .collect();
        let adv = outcome(sp.advantage, &normed, &members, &baselines, sp.norm_adv_by_std_in_grpo);
        let turn_adv = match sp.advantage {
            AdvantageKind::TurnGrpo => {
                let rewards: Vec<Vec<f64>> = trajs.iter().map(|t| t.turns.iter().map(|u| u.reward).collect()).collect();
                turn_grpo(&rewards, &members, sp.norm_adv_by_std_in_grpo, sp.high_level_gamma)
            }
            _ => vec![Vec::new(); trajs.len()],
        };
        // No signal when every kept advantage is 0 (or, for the whitened REINFORCE++, all
        // equal): the update would apply only the entropy bonus, which AdamW scales to a
        // full-size step, and the policy drifts (SmolLM2 on FrozenLake: entropy 2.5 → 4.0 in 3
        // such steps). A kept group of alike episodes has advantages, but they cancel on its one
        // trajectory (its answer entropy bonus, where one is set, is what spreads a settled
        // choice again).
        let whitened =
            matches!(sp.advantage, AdvantageKind::ReinforcePlusPlus | AdvantageKind::ReinforcePlusPlusBaseline);
        let flat = |x: f64| if whitened { x == adv[kept[0]] } else { x == 0.0 };
        let cancels = |g: usize| alike[g] && sp.answer_entropy_coef == 0.0;
        let no_signal = !kept.is_empty()
            && !s.needs_critic()
            && kept_groups.iter().all(|&g| {
                cancels(g) || members[g].iter().all(|&i| flat(adv[i]) && turn_adv[i].iter().all(|&x| x == 0.0))
            });
        let kept_share = kept_groups.len() as f64 / members.len().max(1) as f64;
        let scales = adv_scales(sp, kept_share, &kept_groups, &members, &normed, trajs);
        Ok(Self { members, normed, stds, kept_groups, kept, adv, turn_adv, scales, no_signal })
    }

    /// No update this step: nothing kept, or nothing to learn from what was.
    pub fn skipped(&self) -> bool {
        self.kept.is_empty() || self.no_signal
    }

    /// What the update trains on (nothing when the step is skipped).
    pub fn items<'a>(&self, trajs: &'a [Trajectory]) -> Vec<Item<'a>> {
        if self.skipped() {
            return Vec::new();
        }
        self.kept
            .iter()
            .map(|&i| {
                // The packed sequence shows the last turns (a context window drops early ones).
                let turns = &self.turn_adv[i];
                let shown = &turns[turns.len().saturating_sub(trajs[i].packed.turn_ends.len())..];
                Item {
                    packed: &trajs[i].packed,
                    score: self.adv[i] as f32,
                    turn_scores: shown.iter().map(|&x| x as f32).collect(),
                    adv_scale: self.scales[i] as f32,
                }
            })
            .collect()
    }
}

/// Each trajectory's factor on its advantages: the kept share of groups
/// (`filter_loss_scaling`), and for GRPO its group's std over the largest kept group's
/// (`soft_advantage_reweight`, a lone member's std taken as 1 as GRPO does) and its trained-token
/// count over the kept mean (`grpo_length_weight`, dividing).
fn adv_scales(
    sp: &Starpo,
    kept_share: f64,
    kept_groups: &[usize],
    members: &[Vec<usize>],
    normed: &[f64],
    trajs: &[Trajectory],
) -> Vec<f64> {
    let base = match sp.filter_loss_scaling {
        FilterLossScaling::None => 1.0,
        FilterLossScaling::Linear => kept_share,
        FilterLossScaling::Sqrt => kept_share.sqrt(),
    };
    let mut out = vec![base; trajs.len()];
    if !matches!(sp.advantage, AdvantageKind::Grpo | AdvantageKind::TurnGrpo) {
        return out;
    }
    if sp.soft_advantage_reweight {
        let std = |g: usize| if members[g].len() > 1 { group_stds(normed, &members[g..=g])[0] } else { 1.0 };
        let max = kept_groups.iter().map(|&g| std(g)).fold(0.0, f64::max);
        for &g in kept_groups {
            members[g].iter().for_each(|&i| out[i] *= std(g) / (max + 1e-6));
        }
    }
    if sp.grpo_length_weight {
        let kept: Vec<usize> = kept_groups.iter().flat_map(|&g| members[g].iter().copied()).collect();
        let mean =
            kept.iter().map(|&i| trajs[i].packed.assistant_tokens() as f64).sum::<f64>() / kept.len().max(1) as f64;
        kept.iter().for_each(|&i| out[i] /= (trajs[i].packed.assistant_tokens() as f64 + 1e-6) / mean.max(1e-6));
    }
    out
}
