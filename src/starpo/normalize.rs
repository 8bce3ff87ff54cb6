//! Per-group reward normalisation of trajectory scores (RAGEN `agent_proxy.reward_normalization`,
//! grouping by start state). Pure functions over `f64` slices; no tensors.
use super::settings::RewardNorm;

/// Mean and sample (Bessel-corrected, as torch's `std`) standard deviation; std 0 for one element.
pub fn mean_std(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

/// Normalise one group's scores.
///
/// # Shapes
/// `scores`: [N] (one group) → [N].
///
/// `mean_std` is (x − μ)/(σ + 1e-6), or all zeros when σ < 1e-6 (RAGEN checks σ over the whole
/// batch; we check it per group, so one constant group cannot blow up while others vary).
pub fn normalize_group(scores: &[f64], method: RewardNorm) -> Vec<f64> {
    let (mu, sigma) = mean_std(scores);
    let standard = |x: f64| if sigma < 1e-6 { 0.0 } else { (x - mu) / (sigma + 1e-6) };
    scores
        .iter()
        .map(|&x| match method {
            RewardNorm::Identity => x,
            RewardNorm::Mean => x - mu,
            RewardNorm::MeanStd => standard(x),
            RewardNorm::AsymClip => standard(x).clamp(-1.0, 3.0),
        })
        .collect()
}

/// Normalise every group of a batch laid out group-major (`groups[g]` are indices into `scores`).
pub fn normalize(scores: &[f64], groups: &[Vec<usize>], method: RewardNorm) -> Vec<f64> {
    let mut out = scores.to_vec();
    for members in groups {
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
    }
}
