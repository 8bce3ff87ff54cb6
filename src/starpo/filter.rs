//! StarPO-S rollout filtering: which env groups the update learns from. Whole groups are kept or
//! dropped, ranked by one number per group (RAGEN `agent_trainer._filter_rollout`; RAGEN-2
//! `rollout_filter.py`, whose strategies, metrics, types and zero rule [`select`] follows).
use super::normalize::mean_std;
use super::settings::{FilterKind, FilterMetric, FilterType, Starpo, TopPMode};

/// RAGEN-2's selection tolerance for top-p linear: the kept groups must hold p·Σ − 0.01.
const TOP_P_EPS: f64 = 0.01;

/// The groups the filter keeps, sorted, from each group's metric `values` (see
/// [`group_metric`]). May be empty (top-p linear out of reach, or nothing non-zero with
/// `filter_include_zero` false): that step has nothing to learn from.
///
/// Ties keep the lower group index (a stable sort), so the choice is deterministic.
pub fn select(values: &[f64], s: &Starpo) -> Vec<usize> {
    let n_groups = values.len();
    let (largest, include_zero) = match s.filter {
        FilterKind::None => return (0..n_groups).collect(),
        // RAGEN v1: the top fraction by std, whatever the type and zero settings say.
        FilterKind::Std => (true, true),
        _ => (s.filter_type == FilterType::Largest, s.filter_include_zero),
    };
    let mut idx: Vec<usize> = (0..n_groups).collect();
    if !include_zero {
        idx.retain(|&g| values[g].abs() > 1e-10);
    }
    if idx.is_empty() {
        return idx;
    }
    // Best first: by value for `largest`, by −value for `smallest`.
    let key = |g: usize| if largest { values[g] } else { -values[g] };
    let mut best = idx.clone();
    best.sort_by(|&a, &b| key(b).total_cmp(&key(a)));
    let top = |k: usize| -> Vec<usize> { best[..k.clamp(1, best.len())].to_vec() };
    let mut kept = match s.filter {
        FilterKind::None => unreachable!("returned above"),
        FilterKind::Std | FilterKind::TopK => top((s.filter_ratio * n_groups as f64 + 1e-9).floor() as usize),
        FilterKind::TopKAbs => top(s.filter_k),
        FilterKind::TopP if s.filter_top_p >= 1.0 => idx,
        FilterKind::TopP => match s.filter_top_p_mode {
            TopPMode::Softmax => {
                // Nucleus over softmax(key): the fewest best groups whose probability reaches p.
                let m = best.iter().map(|&g| key(g)).fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = best.iter().map(|&g| (key(g) - m).exp()).collect();
                let total: f64 = w.iter().sum();
                let mut acc = 0.0;
                let k = w.iter().position(|x| {
                    acc += x / total;
                    acc >= s.filter_top_p
                });
                top(k.map_or(best.len(), |k| k + 1))
            }
            TopPMode::Linear => {
                // Sorted by value (descending for largest, ascending for smallest, as RAGEN-2),
                // positive values only, until they hold p of the total less the tolerance.
                let threshold = s.filter_top_p * idx.iter().map(|&g| values[g]).sum::<f64>() - TOP_P_EPS;
                let mut order = idx.clone();
                order.sort_by(
                    |&a, &b| if largest { values[b].total_cmp(&values[a]) } else { values[a].total_cmp(&values[b]) },
                );
                let (mut acc, mut taken) = (0.0, 0);
                for &g in &order {
                    if acc >= threshold || values[g] <= 0.0 {
                        break;
                    }
                    acc += values[g];
                    taken += 1;
                }
                if acc >= threshold {
                    order[..taken].to_vec()
                } else {
                    Vec::new()
                }
            }
        },
        FilterKind::MinP => {
            let vals = idx.iter().map(|&g| values[g]);
            if largest {
                let cut = vals.fold(f64::NEG_INFINITY, f64::max) * s.filter_min_p - 1e-10;
                idx.into_iter().filter(|&g| values[g] >= cut).collect()
            } else {
                let cut = vals.fold(f64::INFINITY, f64::min) / (s.filter_min_p + 1e-10) + 1e-10;
                idx.into_iter().filter(|&g| values[g] <= cut).collect()
            }
        }
    };
    kept.sort_unstable();
    kept
}

/// One number per group for the filter to rank (RAGEN-2 `rollout_filter_metric`), from each
/// trajectory's score, mean token entropy (`entropies`, needed only by the entropy metrics) and
/// trained-token count. `reward_variance` is the in-group std, as in RAGEN-2 (std, sample).
///
/// # Shapes
/// `scores`, `entropies`, `lengths`: [N]; `groups`: [G] index lists → [G].
pub fn group_metric(
    metric: FilterMetric,
    scores: &[f64],
    entropies: &[f64],
    lengths: &[f64],
    groups: &[Vec<usize>],
) -> Vec<f64> {
    let of = |xs: &[f64], m: &Vec<usize>| m.iter().map(|&i| xs[i]).collect::<Vec<_>>();
    groups
        .iter()
        .map(|m| match metric {
            FilterMetric::RewardVariance => mean_std(&of(scores, m)).1,
            FilterMetric::Reward => mean_std(&of(scores, m)).0,
            FilterMetric::RewardSum => of(scores, m).iter().sum(),
            FilterMetric::Entropy => mean_std(&of(entropies, m)).0,
            FilterMetric::EntropyVariance => mean_std(&of(entropies, m)).1,
            FilterMetric::Length => mean_std(&of(lengths, m)).0,
        })
        .collect()
}

/// In-group std of each group's scores (sample std, as torch).
pub fn group_stds(scores: &[f64], groups: &[Vec<usize>]) -> Vec<f64> {
    group_metric(FilterMetric::RewardVariance, scores, &[], &[], groups)
}

/// Whether each group's episodes are one trajectory token for token (`ids`: each episode's
/// packed ids; an episode without tokens, played over HTTP, never counts). Their scores can
/// still differ (the env's dice: a Bandit arm that pays a quarter of the time), but their
/// advantages sum to 0 on the same tokens, so their policy gradient cancels exactly: a filter
/// that ranks by reward spread would spend a kept slot on a group that teaches nothing, while a
/// group whose members chose differently waits (a converged Bandit after a reward edit kept
/// lucky groups of the old arm and never the rare pick of the new one).
pub fn alike_groups(ids: &[&[u32]], groups: &[Vec<usize>]) -> Vec<bool> {
    groups.iter().map(|m| m.len() > 1 && !ids[m[0]].is_empty() && m.iter().all(|&i| ids[i] == ids[m[0]])).collect()
}

/// The reward spread the agent's choices made: each group's std, 0 for a group of alike
/// episodes ([`alike_groups`]).
pub fn choice_stds(stds: &[f64], alike: &[bool]) -> Vec<f64> {
    stds.iter().zip(alike).map(|(&s, &a)| if a { 0.0 } else { s }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::starpo::settings::Settings;

    fn with(f: impl FnOnce(&mut Starpo)) -> Starpo {
        let mut s = Settings::default().starpo;
        f(&mut s);
        s
    }

    #[test]
    fn std_keeps_the_top_quarter_by_std() {
        // 8 groups, ratio 0.25 → int(2.0) = 2 groups: the two largest stds (groups 5 and 2).
        let stds = [0.1, 0.0, 0.4, 0.2, 0.0, 0.5, 0.3, 0.05];
        let s = with(|s| s.filter = FilterKind::Std);
        assert_eq!(select(&stds, &s), vec![2, 5]);
        assert_eq!(select(&stds, &with(|s| s.filter_ratio = 1.0)), (0..8).collect::<Vec<_>>());
        // 4 groups at 0.25 → one group; 3 groups at 0.25 → int(0.75) = 0, clamped to one.
        assert_eq!(select(&[0.0, 0.2, 0.1, 0.0], &s), vec![1]);
        assert_eq!(select(&[0.0, 0.2, 0.3], &s), vec![2]);
        // The type and zero settings do not apply to v1's filter.
        let odd = with(|s| (s.filter_type, s.filter_include_zero) = (FilterType::Smallest, false));
        assert_eq!(select(&stds, &odd), vec![2, 5]);
        assert_eq!(select(&stds, &with(|s| s.filter = FilterKind::None)).len(), 8);
    }

    #[test]
    fn top_k_variants_and_types() {
        let v = [0.3, 0.0, 0.5, 0.1];
        let k = with(|s| (s.filter, s.filter_ratio) = (FilterKind::TopK, 0.5));
        assert_eq!(select(&v, &k), vec![0, 2]);
        let small = with(|s| (s.filter, s.filter_ratio, s.filter_type) = (FilterKind::TopK, 0.5, FilterType::Smallest));
        assert_eq!(select(&v, &small), vec![1, 3]);
        // Without zeros, the smallest two are 0.1 and 0.3; k counts all 4 groups (int(0.5·4) = 2).
        let nz = with(|s| {
            (s.filter, s.filter_ratio, s.filter_type, s.filter_include_zero) =
                (FilterKind::TopK, 0.5, FilterType::Smallest, false)
        });
        assert_eq!(select(&v, &nz), vec![0, 3]);
        let abs = with(|s| (s.filter, s.filter_k) = (FilterKind::TopKAbs, 3));
        assert_eq!(select(&v, &abs), vec![0, 2, 3]);
        // k beyond the groups left keeps them all; nothing left keeps nothing.
        let abs_nz = with(|s| (s.filter, s.filter_k, s.filter_include_zero) = (FilterKind::TopKAbs, 9, false));
        assert_eq!(select(&v, &abs_nz), vec![0, 2, 3]);
        assert!(select(&[0.0, 0.0], &abs_nz).is_empty());
    }

    #[test]
    fn top_p_linear_by_hand() {
        // stds 0.5, 0.35, 0.1, 0 → total 0.95. p = 0.9 needs ≥ 0.855 − 0.01 = 0.845: 0.5 + 0.35.
        let stds = [0.5, 0.35, 0.1, 0.0];
        let p = |p: f64| with(|s| (s.filter, s.filter_top_p) = (FilterKind::TopP, p));
        assert_eq!(select(&stds, &p(0.9)), vec![0, 1]);
        // p = 0.5 needs ≥ 0.465: the first group alone.
        assert_eq!(select(&stds, &p(0.5)), vec![0]);
        // p = 0.99 needs ≥ 0.9305: 0.95 after three groups; the zero group is never added.
        assert_eq!(select(&stds, &p(0.99)), vec![0, 1, 2]);
        // p ≥ 1 keeps every group, zeros too (unless include_zero is off).
        assert_eq!(select(&stds, &p(1.0)), vec![0, 1, 2, 3]);
        // All zero: the threshold −0.01 is met by nothing kept: an empty step.
        assert!(select(&[0.0, 0.0], &p(0.9)).is_empty());
        // Smallest: ascending 0.1, 0.35, 0.5 (zero dropped), until ≥ 0.845 → all three.
        let small = with(|s| {
            (s.filter, s.filter_top_p, s.filter_type, s.filter_include_zero) =
                (FilterKind::TopP, 0.9, FilterType::Smallest, false)
        });
        assert_eq!(select(&stds, &small), vec![0, 1, 2]);
    }

    #[test]
    fn top_p_softmax_by_hand() {
        // values ln 6, ln 3, ln 1 → softmax 0.6, 0.3, 0.1. p = 0.85: 0.6, then 0.9 ≥ 0.85 → two.
        let v = [6f64.ln(), 3f64.ln(), 0.0];
        let sm = |p: f64, t| {
            with(|s| {
                (s.filter, s.filter_top_p, s.filter_top_p_mode, s.filter_type) =
                    (FilterKind::TopP, p, TopPMode::Softmax, t)
            })
        };
        assert_eq!(select(&v, &sm(0.85, FilterType::Largest)), vec![0, 1]);
        assert_eq!(select(&v, &sm(0.5, FilterType::Largest)), vec![0]);
        // Smallest: softmax(−v) = 1, 1/3, 1/6 over 1.5 → 2/3, 2/9, 1/9: p = 0.5 keeps group 2 only.
        assert_eq!(select(&v, &sm(0.5, FilterType::Smallest)), vec![2]);
    }

    #[test]
    fn min_p_by_hand() {
        let v = [0.8, 0.2, 0.4, 0.41];
        let mp = |t| with(|s| (s.filter, s.filter_min_p, s.filter_type) = (FilterKind::MinP, 0.5, t));
        // largest: ≥ 0.5 · 0.8 = 0.4 → 0.8, 0.4, 0.41.
        assert_eq!(select(&v, &mp(FilterType::Largest)), vec![0, 2, 3]);
        // smallest: ≤ 0.2 / 0.5 = 0.4 → 0.2, 0.4.
        assert_eq!(select(&v, &mp(FilterType::Smallest)), vec![1, 2]);
    }

    #[test]
    fn alike_groups_rank_as_no_spread() {
        let (a, b): (&[u32], &[u32]) = (&[1, 2, 3], &[1, 2, 4]);
        // Group 0: one trajectory scored 0 and 1 (luck); group 1: two choices; group 2: no tokens.
        let ids = [a, a, a, b, &[], &[]];
        let groups = vec![vec![0, 1], vec![2, 3], vec![4, 5]];
        let alike = alike_groups(&ids, &groups);
        assert_eq!(alike, [true, false, false]);
        let stds = group_stds(&[0.0, 1.0, 0.6, 0.0, 0.5, 0.5], &groups);
        assert!(stds[0] > stds[1], "luck spreads group 0 more than the choice spreads group 1");
        let spread = choice_stds(&stds, &alike);
        assert_eq!(spread[0], 0.0);
        assert_eq!(spread[1], stds[1]);
        // The std filter keeping one group of three now keeps a group whose members chose.
        let s = with(|s| s.filter_ratio = 0.34);
        assert_eq!(select(&stds, &s), [0]);
        assert_eq!(select(&spread, &s), [1]);
    }

    #[test]
    fn metrics_per_group() {
        let groups = vec![vec![0, 1], vec![2, 3]];
        let scores = [0.0, 1.0, 2.0, 2.0];
        let ent = [1.0, 3.0, 0.5, 0.5];
        let len = [4.0, 6.0, 10.0, 20.0];
        let m = |metric| group_metric(metric, &scores, &ent, &len, &groups);
        let s = m(FilterMetric::RewardVariance);
        assert!((s[0] - 0.5f64.sqrt()).abs() < 1e-12 && s[1] == 0.0);
        assert_eq!(m(FilterMetric::Reward), vec![0.5, 2.0]);
        assert_eq!(m(FilterMetric::RewardSum), vec![1.0, 4.0]);
        assert_eq!(m(FilterMetric::Entropy), vec![2.0, 0.5]);
        let ev = m(FilterMetric::EntropyVariance);
        assert!((ev[0] - 2f64.sqrt()).abs() < 1e-12 && ev[1] == 0.0);
        assert_eq!(m(FilterMetric::Length), vec![5.0, 15.0]);
        assert_eq!(group_stds(&scores, &groups), s);
    }
}
