//! Advantage estimators: GAE with a critic (PPO) and RAGEN's bi-level GAE over one packed
//! trajectory; the critic-free ones (GRPO, RLOO, REINFORCE++ with and without baseline, ReMax)
//! as one number per trajectory from its group, spread over its assistant tokens; and whitening
//! over the loss mask. Pure functions; the update turns the results into tensors.
//!
//! Positions follow the policy's log-prob layout: position t scores token t given tokens < t;
//! `values[t]` is the critic's estimate before token t; `mask[t]` marks assistant tokens.
use super::settings::AdvantageKind;

/// GAE (Schulman et al. 2016) over every position of one sequence, as veRL
/// `compute_gae_advantage_return`: δₜ = rₜ + γ·Vₜ₊₁ − Vₜ (V after the end = 0),
/// Aₜ = δₜ + γλ·Aₜ₊₁, returnsₜ = Aₜ + Vₜ. With γ = λ = 1 and the score on the last token,
/// Aₜ = R − Vₜ.
///
/// # Shapes
/// `rewards`, `values`: [T] → (advantages [T], returns [T]).
pub fn gae(rewards: &[f32], values: &[f32], gamma: f32, lam: f32) -> (Vec<f32>, Vec<f32>) {
    let t_len = rewards.len();
    let mut adv = vec![0.0; t_len];
    let mut last = 0.0;
    for t in (0..t_len).rev() {
        let next = if t + 1 < t_len { values[t + 1] } else { 0.0 };
        let delta = rewards[t] + gamma * next - values[t];
        last = delta + gamma * lam * last;
        adv[t] = last;
    }
    let ret = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, ret)
}

/// The critic-free estimators' advantage of each trajectory, from the scores of its group
/// (veRL `core_algos`, with a one-member group's mean 0 and std 1 as there):
/// - GRPO: (R − μ)/(σ + 1e-6), σ the sample std; R − μ without `norm_by_std` (Dr. GRPO);
/// - RLOO: R − (mean of the others) = (n·R − Σ)/(n − 1);
/// - REINFORCE++-baseline: R − μ; REINFORCE++: R (both are whitened later, token level);
/// - ReMax: R − b, b the score of the group's greedy episode (`baselines[g]`);
/// - GAE and bi-level GAE: R (the critic supplies the baseline).
///
/// # Shapes
/// `scores`: [N]; `groups`: [G] lists of indices into `scores`; `baselines`: [G] (ReMax only,
/// else ignored) → [N].
pub fn outcome(
    kind: AdvantageKind,
    scores: &[f64],
    groups: &[Vec<usize>],
    baselines: &[f64],
    norm_by_std: bool,
) -> Vec<f64> {
    let mut out = scores.to_vec();
    for (g, members) in groups.iter().enumerate() {
        let xs: Vec<f64> = members.iter().map(|&i| scores[i]).collect();
        let n = xs.len() as f64;
        let (mean, std) = if xs.len() > 1 { super::normalize::mean_std(&xs) } else { (0.0, 1.0) };
        let sum: f64 = xs.iter().sum();
        for (&i, &x) in members.iter().zip(&xs) {
            out[i] = match kind {
                AdvantageKind::Grpo | AdvantageKind::TurnGrpo if norm_by_std => (x - mean) / (std + 1e-6),
                AdvantageKind::Grpo | AdvantageKind::TurnGrpo | AdvantageKind::ReinforcePlusPlusBaseline => x - mean,
                AdvantageKind::Rloo if xs.len() > 1 => (n * x - sum) / (n - 1.0),
                AdvantageKind::Remax => x - baselines[g],
                _ => x,
            };
        }
    }
    out
}

/// Turn-level GRPO: for each episode, per turn k, its return-to-go Gₖ = Σ_{j≥k} γ^{j−k} rⱼ less the mean
/// of Gₖ over the episodes of its group that reached turn k (over their std with `norm_by_std`;
/// a turn only one episode reached gets Gₖ − 0, as GRPO treats a one-member group). A turn's
/// answer is judged against the others' answers at the same point, and by what followed it,
/// not by what came before it. γ (`starpo.high_level_gamma`) weighs what followed: at 0 a turn
/// is judged by its own reward only, which is exact credit where later turns do not depend on
/// it (and where they do, a turn then gets no credit for setting them up).
///
/// # Shapes
/// `turn_rewards`: [N] lists of each episode's turn rewards; `groups`: [G] lists of indices →
/// [N] lists of per-turn advantages.
pub fn turn_grpo(turn_rewards: &[Vec<f64>], groups: &[Vec<usize>], norm_by_std: bool, gamma: f64) -> Vec<Vec<f64>> {
    let to_go: Vec<Vec<f64>> = turn_rewards
        .iter()
        .map(|r| {
            let mut g = r.clone();
            for k in (0..g.len().saturating_sub(1)).rev() {
                g[k] += gamma * g[k + 1];
            }
            g
        })
        .collect();
    let mut out: Vec<Vec<f64>> = to_go.clone();
    for members in groups {
        let turns = members.iter().map(|&i| to_go[i].len()).max().unwrap_or(0);
        for k in 0..turns {
            let at: Vec<usize> = members.iter().copied().filter(|&i| k < to_go[i].len()).collect();
            let xs: Vec<f64> = at.iter().map(|&i| to_go[i][k]).collect();
            let (mean, std) = if xs.len() > 1 { super::normalize::mean_std(&xs) } else { (0.0, 1.0) };
            for (&i, &x) in at.iter().zip(&xs) {
                out[i][k] = if norm_by_std { (x - mean) / (std + 1e-6) } else { x - mean };
            }
        }
    }
    out
}

/// Per-turn advantages on their turns' assistant tokens: turn k's tokens are the assistant
/// tokens after turn k−1's end up to turn k's (`turn_ends`, ascending), 0 elsewhere.
///
/// # Shapes
/// `advantages`: [K]; `turn_ends`: [K]; `mask`: [T] → [T].
pub fn spread_turns(advantages: &[f32], turn_ends: &[usize], mask: &[bool]) -> Vec<f32> {
    let mut out = vec![0.0; mask.len()];
    let mut k = 0;
    for (t, &on) in mask.iter().enumerate() {
        while k < turn_ends.len() && turn_ends[k] < t {
            k += 1;
        }
        if on && k < advantages.len() {
            out[t] = advantages[k];
        }
    }
    out
}

/// A trajectory's advantage on its assistant tokens, discounted by γ per assistant token from
/// the last one (REINFORCE++'s return; the other outcome estimators use γ = 1), 0 elsewhere.
/// veRL zeroes the running return at the first non-assistant token, which in a packed
/// multi-turn sequence would leave every turn but the last without credit; here the discount
/// counts assistant tokens only, so each turn gets γ^(tokens after it) · A.
///
/// # Shapes
/// `mask`: [T] → [T].
pub fn spread(advantage: f32, mask: &[bool], gamma: f32) -> Vec<f32> {
    let mut out = vec![0.0; mask.len()];
    let mut running = advantage;
    for t in (0..mask.len()).rev() {
        if mask[t] {
            out[t] = running;
            running *= gamma;
        }
    }
    out
}

/// Bi-level GAE (RAGEN `compute_bi_level_gae_advantage_return`).
///
/// 1. Turn level: over the turn-end positions e₁ < … < e_K (the last assistant token of each
///    turn) with that turn's reward rₖ: δₖ = rₖ + γ_turn·V(eₖ₊₁) − V(eₖ), Aₖ = δₖ + γ_turn·λ·Aₖ₊₁;
///    the turn return Gₖ = Aₖ + V(eₖ) replaces the reward at eₖ.
/// 2. Token level: inside each turn, GAE with γ, λ over its assistant positions, restarted at
///    each turn end, whose "reward" is Gₖ and next value 0.
///
/// # Shapes
/// `turn_ends`: [K] positions, `turn_rewards`: [K], `values`, `mask`: [T] → (advantages [T],
/// returns [T]); positions outside the mask get 0.
pub fn bi_level_gae(
    turn_ends: &[usize],
    turn_rewards: &[f32],
    values: &[f32],
    mask: &[bool],
    gamma: f32,
    lam: f32,
    high_level_gamma: f32,
) -> (Vec<f32>, Vec<f32>) {
    let t_len = values.len();
    let mut adv = vec![0.0; t_len];
    let mut ret = vec![0.0; t_len];
    let mut reward = vec![0.0; t_len];
    let mut last = 0.0;
    for k in (0..turn_ends.len()).rev() {
        let e = turn_ends[k];
        let next = if k + 1 < turn_ends.len() { values[turn_ends[k + 1]] } else { 0.0 };
        let delta = turn_rewards[k] + high_level_gamma * next - values[e];
        last = delta + high_level_gamma * lam * last;
        adv[e] = last;
    }
    for &e in turn_ends {
        reward[e] = adv[e] + values[e];
    }
    let valid: Vec<usize> = (0..t_len).filter(|&t| mask[t]).collect();
    let mut last = 0.0;
    for i in (0..valid.len()).rev() {
        let t = valid[i];
        let next = if turn_ends.contains(&t) || i + 1 == valid.len() {
            last = 0.0;
            0.0
        } else {
            values[valid[i + 1]]
        };
        let delta = reward[t] + gamma * next - values[t];
        last = delta + gamma * lam * last;
        adv[t] = last;
        ret[t] = last + values[t];
    }
    (adv, ret)
}

/// Whiten over the masked positions of the whole batch: (x − μ)/√(σ² + 1e-8), σ² the
/// Bessel-corrected variance (veRL `masked_whiten`). Unmasked positions become 0.
///
/// # Shapes
/// `xs`, `masks`: [B][T] (ragged) → in place.
pub fn whiten(xs: &mut [Vec<f32>], masks: &[Vec<bool>]) {
    let vals: Vec<f64> =
        xs.iter().zip(masks).flat_map(|(x, m)| x.iter().zip(m).filter(|p| *p.1).map(|p| *p.0 as f64)).collect();
    let n = vals.len() as f64;
    if n < 2.0 {
        return;
    }
    let mean = vals.iter().sum::<f64>() / n;
    let var = vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1.0);
    let scale = 1.0 / (var + 1e-8).sqrt();
    for (x, m) in xs.iter_mut().zip(masks) {
        for (v, &on) in x.iter_mut().zip(m) {
            *v = if on { ((*v as f64 - mean) * scale) as f32 } else { 0.0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn gae_with_unit_gamma_lambda_is_score_minus_value() {
        let r = [0.0, 0.0, 0.0, 1.0];
        let v = [0.2, 0.5, 0.4, 0.9];
        let (a, ret) = gae(&r, &v, 1.0, 1.0);
        close(&a, &[0.8, 0.5, 0.6, 0.1]);
        close(&ret, &[1.0, 1.0, 1.0, 1.0]);
    }

    #[test]
    fn gae_by_hand_with_discount() {
        // γ = 0.5, λ = 0.5, r = [0, 1], V = [0.2, 0.4]
        // δ1 = 1 − 0.4 = 0.6, A1 = 0.6; δ0 = 0 + 0.5·0.4 − 0.2 = 0, A0 = 0 + 0.25·0.6 = 0.15
        let (a, ret) = gae(&[0.0, 1.0], &[0.2, 0.4], 0.5, 0.5);
        close(&a, &[0.15, 0.6]);
        close(&ret, &[0.35, 1.0]);
    }

    #[test]
    fn turn_grpo_judges_each_turn_by_what_followed_it_against_its_group() {
        // A hand-made group of three 3-turn episodes, a reward after every turn:
        // returns-to-go  a: [3, 2, 1]   b: [1, 1, 1]   c: [2, 1, 0]  → means [2, 4/3, 2/3].
        let rewards = vec![vec![1.0, 1.0, 1.0], vec![0.0, 0.0, 1.0], vec![1.0, 1.0, 0.0]];
        let adv = turn_grpo(&rewards, &[vec![0, 1, 2]], false, 1.0);
        let third = 1.0 / 3.0;
        for (got, want) in adv.iter().zip([[1.0, 2.0 / 3.0, third], [-1.0, -third, third], [0.0, -third, -2.0 / 3.0]]) {
            close(&got.iter().map(|&x| x as f32).collect::<Vec<_>>(), &want);
        }
        // The reward only at the end: every turn gets the episode's Dr. GRPO advantage.
        let end = vec![vec![0.0, 0.0, 1.0], vec![0.0, 0.0, 0.0]];
        assert_eq!(turn_grpo(&end, &[vec![0, 1]], false, 1.0), vec![vec![0.5; 3], vec![-0.5; 3]]);
        // A turn only one episode reached keeps its return-to-go; std division as GRPO's.
        let ragged = vec![vec![1.0, 1.0], vec![0.0]];
        assert_eq!(turn_grpo(&ragged, &[vec![0, 1]], false, 1.0), vec![vec![1.0, 1.0], vec![-1.0]]);
        let normed = turn_grpo(&end, &[vec![0, 1]], true, 1.0);
        // (GRPO's sample std: of [1, 0] it is √½.)
        assert!((normed[0][0] - 0.5 / (0.5f64.sqrt() + 1e-6)).abs() < 1e-9, "{normed:?}");
        // γ = 0: each turn against the group's rewards at that turn alone (each turn's mean 2/3);
        // γ = ½ weighs the next turn by ½ (G₁: a 1.75, b 0.25, c 1.5; their mean 3.5/3).
        let own = turn_grpo(&rewards, &[vec![0, 1, 2]], false, 0.0);
        close(&own[1].iter().map(|&x| x as f32).collect::<Vec<_>>(), &[-2.0 / 3.0, -2.0 / 3.0, third]);
        let half = turn_grpo(&rewards, &[vec![0, 1, 2]], false, 0.5);
        assert!((half[0][0] - (1.75 - 3.5 / 3.0)).abs() < 1e-9, "{half:?}");
    }

    #[test]
    fn spread_turns_puts_each_turns_advantage_on_its_own_tokens() {
        // user 0-1, turn 1 on 2-3 (end 3), user 4, turn 2 on 5-6 (end 6), user 7.
        let mask = [false, false, true, true, false, true, true, false];
        close(&spread_turns(&[0.5, -1.0], &[3, 6], &mask), &[0.0, 0.0, 0.5, 0.5, 0.0, -1.0, -1.0, 0.0]);
    }

    #[test]
    fn spread_puts_the_advantage_on_assistant_tokens_discounted_from_the_end() {
        close(&spread(0.7, &[false, true, true, false, true], 1.0), &[0.0, 0.7, 0.7, 0.0, 0.7]);
        // γ = 0.5 counts assistant tokens only: the user token between turns costs nothing.
        close(&spread(1.0, &[false, true, true, false, true], 0.5), &[0.0, 0.25, 0.5, 0.0, 1.0]);
    }

    fn outcome_of(kind: AdvantageKind, norm_by_std: bool) -> Vec<f64> {
        // Group 0: scores 1, 2, 6 (μ = 3, sample σ = √7); group 1: a lone 5; ReMax baselines 2, 4.
        outcome(kind, &[1.0, 2.0, 6.0, 5.0], &[vec![0, 1, 2], vec![3]], &[2.0, 4.0], norm_by_std)
    }

    fn close64(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn outcome_estimators_by_hand() {
        let s7 = 7f64.sqrt() + 1e-6;
        // GRPO: (x − 3)/√7; the lone member: (5 − 0)/(1 + 1e-6).
        close64(&outcome_of(AdvantageKind::Grpo, true), &[-2.0 / s7, -1.0 / s7, 3.0 / s7, 5.0 / (1.0 + 1e-6)]);
        // Dr. GRPO and REINFORCE++-baseline: x − μ (μ = 0 alone).
        close64(&outcome_of(AdvantageKind::Grpo, false), &[-2.0, -1.0, 3.0, 5.0]);
        close64(&outcome_of(AdvantageKind::ReinforcePlusPlusBaseline, true), &[-2.0, -1.0, 3.0, 5.0]);
        // RLOO: x − mean of the other two: 1 − 4, 2 − 3.5, 6 − 1.5; alone: x.
        close64(&outcome_of(AdvantageKind::Rloo, true), &[-3.0, -1.5, 4.5, 5.0]);
        // ReMax: x − the group's greedy score.
        close64(&outcome_of(AdvantageKind::Remax, true), &[-1.0, 0.0, 4.0, 1.0]);
        close64(&outcome_of(AdvantageKind::ReinforcePlusPlus, true), &[1.0, 2.0, 6.0, 5.0]);
        close64(&outcome_of(AdvantageKind::Gae, true), &[1.0, 2.0, 6.0, 5.0]);
    }

    #[test]
    fn bi_level_gae_by_hand() {
        // Two turns: assistant tokens 1,2 (turn end 2) and 4,5 (turn end 5); token 3 is a user token.
        // Turn rewards r = [0.5, 1.0], V = [0, 0.1, 0.2, 0, 0.3, 0.4], γ = λ = 1, γ_turn = 0.5.
        // Turn level: A(5) = 1 − 0.4 = 0.6, G(5) = 1.0;
        //             A(2) = 0.5 + 0.5·0.4 − 0.2 + 0.5·0.6 = 0.8, G(2) = 1.0.
        // Token level in turn 2: A(5) = G(5) − V(5) = 0.6; A(4) = 0 + V(5) − V(4) + A(5) = 0.7.
        // In turn 1: A(2) = 1.0 − 0.2 = 0.8; A(1) = 0.2 − 0.1 + 0.8 = 0.9.
        let mask = [false, true, true, false, true, true];
        let v = [0.0, 0.1, 0.2, 0.0, 0.3, 0.4];
        let (a, ret) = bi_level_gae(&[2, 5], &[0.5, 1.0], &v, &mask, 1.0, 1.0, 0.5);
        close(&a, &[0.0, 0.9, 0.8, 0.0, 0.7, 0.6]);
        close(&ret, &[0.0, 1.0, 1.0, 0.0, 1.0, 1.0]);
    }

    #[test]
    fn whiten_over_mask_only() {
        // masked values [1, 3] and [5]: μ = 3, unbiased σ² = (4 + 0 + 4)/2 = 4 → [-1, 0] and [1]
        let mut xs = vec![vec![1.0, 3.0, 100.0], vec![5.0]];
        whiten(&mut xs, &[vec![true, true, false], vec![true]]);
        close(&xs[0], &[-1.0, 0.0, 0.0]);
        close(&xs[1], &[1.0]);
    }
}
