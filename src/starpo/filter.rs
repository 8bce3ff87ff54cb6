//! StarPO-S rollout filtering: which env groups the update learns from. Whole groups are kept or
//! dropped (RAGEN `agent_trainer._filter_rollout`; RAGEN-2 `rollout_filter.py`).
use super::normalize::mean_std;

/// RAGEN v1: the top `int(ratio · G)` groups by in-group reward std (at least one group).
///
/// # Shapes
/// `stds`: [G] → sorted indices of the kept groups, ≤ G of them.
///
/// Ties keep the lower group index (a stable sort), so the choice is deterministic.
pub fn top_by_std(stds: &[f64], ratio: f64) -> Vec<usize> {
    let keep = ((ratio * stds.len() as f64 + 1e-9).floor() as usize).clamp(1, stds.len().max(1));
    let mut order: Vec<usize> = (0..stds.len()).collect();
    order.sort_by(|&a, &b| stds[b].total_cmp(&stds[a]));
    let mut kept: Vec<usize> = order.into_iter().take(keep).collect();
    kept.sort_unstable();
    kept
}

/// RAGEN-2 top-p ("linear" mode): drop zero-variance groups, sort the rest by variance, and keep
/// adding groups until they hold at least `p` of the total variance, less a 1% tolerance
/// (RAGEN-2 subtracts an absolute eps = 0.01, which swamps small rewards; ours is relative). Empty when every group has zero variance: that step has nothing to learn from.
///
/// RAGEN-2 sums the std under the name `reward_variance`; we sum the variance (σ²), the quantity
/// the name and the paper's signal-to-noise argument refer to.
pub fn top_p_by_variance(stds: &[f64], p: f64) -> Vec<usize> {
    let var: Vec<f64> = stds.iter().map(|s| s * s).collect();
    let mut order: Vec<usize> = (0..var.len()).filter(|&g| var[g] > 1e-12).collect();
    order.sort_by(|&a, &b| var[b].total_cmp(&var[a]));
    let total: f64 = order.iter().map(|&g| var[g]).sum();
    let mut kept = Vec::new();
    let mut acc = 0.0;
    for g in order {
        if acc >= p * total - 0.01 * total && !kept.is_empty() {
            break;
        }
        acc += var[g];
        kept.push(g);
    }
    kept.sort_unstable();
    kept
}

/// In-group std of each group's scores (sample std, as torch).
pub fn group_stds(scores: &[f64], groups: &[Vec<usize>]) -> Vec<f64> {
    groups.iter().map(|m| mean_std(&m.iter().map(|&i| scores[i]).collect::<Vec<_>>()).1).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_top_quarter_by_std() {
        // 8 groups, ratio 0.25 → int(2.0) = 2 groups: the two largest stds (groups 5 and 2).
        let stds = [0.1, 0.0, 0.4, 0.2, 0.0, 0.5, 0.3, 0.05];
        assert_eq!(top_by_std(&stds, 0.25), vec![2, 5]);
        assert_eq!(top_by_std(&stds, 1.0), (0..8).collect::<Vec<_>>());
        // 4 groups at 0.25 → one group; 3 groups at 0.25 → int(0.75) = 0, clamped to one.
        assert_eq!(top_by_std(&[0.0, 0.2, 0.1, 0.0], 0.25), vec![1]);
        assert_eq!(top_by_std(&[0.0, 0.2, 0.3], 0.25), vec![2]);
    }

    #[test]
    fn top_p_drops_zero_variance_and_stops_at_the_share() {
        // variances 0.25, 0.09, 0.01, 0 → total 0.35. p = 0.9 needs ≥ 0.3115 (0.315 − 0.0035):
        // 0.25 alone is short, 0.25 + 0.09 = 0.34 passes → groups 0 and 1.
        let stds = [0.5, 0.3, 0.1, 0.0];
        assert_eq!(top_p_by_variance(&stds, 0.9), vec![0, 1]);
        // p = 0.7 needs ≥ 0.2415: the first group alone suffices.
        assert_eq!(top_p_by_variance(&stds, 0.7), vec![0]);
        // p = 1 keeps every group with variance, never the zero one.
        assert_eq!(top_p_by_variance(&stds, 1.0), vec![0, 1, 2]);
        assert!(top_p_by_variance(&[0.0, 0.0], 0.9).is_empty());
    }

    #[test]
    fn stds_per_group() {
        let s = group_stds(&[0.0, 1.0, 2.0, 2.0], &[vec![0, 1], vec![2, 3]]);
        assert!((s[0] - 0.5f64.sqrt()).abs() < 1e-12 && s[1] == 0.0);
    }
}
