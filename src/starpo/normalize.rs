//! Reward normalisation of trajectory scores (RAGEN `agent_proxy.reward_normalization`): the
//! groups sharing statistics (a start state, the batch, an env) and the method. Pure functions
//! over `f64` slices; no tensors.
use super::settings::{NormGrouping, RewardNorm};

/// Mean and sample (Bessel-corrected, as torch's `std`) standard deviation; std 0 for one element.
/// Computed on the scores divided by their largest magnitude, so scores near ±1e308 do not
/// overflow the sums (the result saturates to ±inf only where it is itself beyond f64).
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let (scale, mean, std) = scaled_mean_std(xs);
    (mean * scale, std * scale)
}

/// (s, μ/s, σ/s) with s the largest |x| when it is beyond 1e100, else 1.
fn scaled_mean_std(xs: &[f64]) -> (f64, f64, f64) {
    if xs.is_empty() {
        return (1.0, 0.0, 0.0);
    }
    // Scaled only where the sums could overflow: ordinary scores keep the exact unscaled
    // arithmetic (a rounding change is enough to send a short run down another path).
    let max = xs.iter().fold(0.0_f64, |m, x| m.max(x.abs()));
    let scale = if max > 1e100 && max.is_finite() { max } else { 1.0 };
    let n = xs.len() as f64;
    let mean = xs.iter().map(|x| x / scale).sum::<f64>() / n;
    if xs.len() < 2 {
        return (scale, mean, 0.0);
    }
    let var = xs.iter().map(|x| (x / scale - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (scale, mean, var.sqrt())
}

/// Normalise one group's scores.
///
/// # Shapes
/// `scores`: [N] (one group) → [N].
///
/// `mean_std` is (x − μ)/(σ + 1e-6), or all zeros when σ < 1e-6 (RAGEN checks σ over the whole
/// batch; we check it per group, so one constant group cannot blow up while others vary). It is
/// computed on scaled scores (see [`mean_std`]), so extreme but finite scores stay finite.
pub fn normalize_group(scores: &[f64], method: RewardNorm) -> Vec<f64> {
    let f = normalizer(scores, method);
    scores.iter().map(|&x| f(x)).collect()
}

/// The map x ↦ normalised x under one group's statistics; it applies to a score outside the
/// group too (ReMax's greedy baseline is normalised as its group is).
pub fn normalizer(scores: &[f64], method: RewardNorm) -> impl Fn(f64) -> f64 {
    let (scale, mu, sigma) = scaled_mean_std(scores);
    // (x − μ)/(σ + ε) with every term divided by `scale`.
    let standard = move |x: f64| if sigma * scale < 1e-6 { 0.0 } else { (x / scale - mu) / (sigma + 1e-6 / scale) };
    move |x| match method {
        RewardNorm::Identity => x,
        RewardNorm::Mean => (x / scale - mu) * scale,
        RewardNorm::MeanStd => standard(x),
        RewardNorm::AsymClip => standard(x).clamp(-1.0, 3.0),
    }
}

/// The sets of trajectories that share normalisation statistics: each env group (`state`), or
/// the whole batch (`batch`, and `inductive`: one env per experiment, so one tag).
pub fn norm_groups(grouping: NormGrouping, groups: &[Vec<usize>]) -> Vec<Vec<usize>> {
    match grouping {
        NormGrouping::State => groups.to_vec(),
        NormGrouping::Batch | NormGrouping::Inductive => vec![groups.concat()],
    }
}

/// Normalise every set of a batch (`sets[k]` are indices into `scores`).
pub fn normalize(scores: &[f64], sets: &[Vec<usize>], method: RewardNorm) -> Vec<f64> {
    let mut out = scores.to_vec();
    for members in sets {
        let group: Vec<f64> = members.iter().map(|&i| scores[i]).collect();
        for (&i, v) in members.iter().zip(normalize_group(&group, method)) {
            out[i] = v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f64], b: &[f64]) {
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(b) {
            assert!((x - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn identity_and_mean() {
        close(&normalize_group(&[1.0, 2.0, 6.0], RewardNorm::Identity), &[1.0, 2.0, 6.0]);
        // μ = 3
        close(&normalize_group(&[1.0, 2.0, 6.0], RewardNorm::Mean), &[-2.0, -1.0, 3.0]);
    }

    #[test]
    fn mean_std_by_hand() {
        // [0, 0, 1, 1]: μ = 0.5, sample σ = sqrt(4·0.25 / 3) = 0.57735
        let z = 0.5 / (0.577_350_3 + 1e-6);
        close(&normalize_group(&[0.0, 0.0, 1.0, 1.0], RewardNorm::MeanStd), &[-z, -z, z, z]);
        // a constant group gives zeros, not NaN
        close(&normalize_group(&[0.1, 0.1], RewardNorm::MeanStd), &[0.0, 0.0]);
    }

    #[test]
    fn asym_clip_clamps_to_minus_one_three() {
        // [0, 0, 0, 10]: μ = 2.5, σ = sqrt((3·6.25 + 56.25)/3) = 5 → z = [-0.5, -0.5, -0.5, 1.5]
        close(&normalize_group(&[0.0, 0.0, 0.0, 10.0], RewardNorm::AsymClip), &[-0.5, -0.5, -0.5, 1.5]);
        // nine zeros and a one: z(1) = 0.9 / sqrt(0.1) = 2.846, z(0) = -0.316; then [0]*9+[100]
        let mut xs = vec![0.0; 15];
        xs.push(1.0);
        let z = normalize_group(&xs, RewardNorm::AsymClip);
        assert!((z[15] - 3.0).abs() < 1e-9, "15/16 zeros put the one at z = 3.87, clipped to 3: {z:?}");
        let mut ys = vec![1.0; 15];
        ys.push(0.0);
        let z = normalize_group(&ys, RewardNorm::AsymClip);
        assert!((z[15] + 1.0).abs() < 1e-9, "the lone zero sits at z = -3.87, clipped to -1");
    }

    #[test]
    fn batch_normalises_within_each_group() {
        let scores = [1.0, 3.0, 10.0, 30.0];
        let groups = vec![vec![0, 1], vec![2, 3]];
        close(&normalize(&scores, &groups, RewardNorm::Mean), &[-1.0, 1.0, -10.0, 10.0]);
        // batch grouping: one set, μ = 11 → [-10, -8, -1, 19]
        let batch = norm_groups(NormGrouping::Batch, &groups);
        assert_eq!(batch, vec![vec![0, 1, 2, 3]]);
        close(&normalize(&scores, &batch, RewardNorm::Mean), &[-10.0, -8.0, -1.0, 19.0]);
        assert_eq!(norm_groups(NormGrouping::Inductive, &groups), batch);
        assert_eq!(norm_groups(NormGrouping::State, &groups), groups);
    }

    #[test]
    fn a_score_outside_the_group_is_normalised_by_its_statistics() {
        // Group [0, 0, 1, 1]: μ = 0.5, σ = 0.57735; a greedy baseline of 1 maps to z(1).
        let z = normalizer(&[0.0, 0.0, 1.0, 1.0], RewardNorm::MeanStd);
        assert!((z(1.0) - 0.5 / (0.577_350_3 + 1e-6)).abs() < 1e-5);
        assert_eq!(normalizer(&[3.0], RewardNorm::Identity)(7.0), 7.0);
    }
}
