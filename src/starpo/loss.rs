//! The StarPO losses on candle tensors (differentiable): PPO's clipped surrogate with separate
//! clip_low / clip_high and dual-clip, the KL estimators, the clipped value loss, and the
//! aggregation RAGEN effectively uses (token-mean within each sequence, then the mean over
//! sequences; notes/ragen.md §3 "Losses").
//!
//! Every `[B, T]` tensor is f32 and aligned with the policy's log-prob layout; `mask` is 1.0 on
//! assistant tokens and 0.0 elsewhere (padding included).
use candle_core::{Result, Tensor};

use super::settings::{KlKind, LossAgg};

/// Token-mean within each sequence, then the mean over sequences: (1/B) Σ_b Σ_t x·m / Σ_t m.
/// A sequence with no masked token contributes 0.
///
/// # Shapes
/// `x`, `mask`: [B, T] → scalar.
pub fn seq_mean_token_mean(x: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let per_seq = (x * mask)?.sum(1)?; // [B]
    let counts = mask.sum(1)?.clamp(1.0, f64::INFINITY)?; // [B]
    (per_seq / counts)?.mean(0)
}

/// One micro-batch's share of its mini-batch's aggregated loss (veRL `agg_loss`), so that the
/// shares of a mini-batch's micro-batches add up to the loss of the whole mini-batch of `rows`
/// sequences holding `tokens` assistant tokens:
/// - token-mean: Σ_b Σ_t x·m / tokens;
/// - seq-mean-token-mean: Σ_b (Σ_t x·m / Σ_t m) / rows;
/// - seq-mean-token-sum: Σ_b Σ_t x·m / rows (Dr. GRPO).
///
/// # Shapes
/// `x`, `mask`: [B, T] → scalar.
pub fn agg_share(x: &Tensor, mask: &Tensor, mode: LossAgg, rows: usize, tokens: f64) -> Result<Tensor> {
    let per_seq = (x * mask)?.sum(1)?; // [B]
    match mode {
        LossAgg::TokenMean => per_seq.sum(0)? / tokens.max(1.0),
        LossAgg::SeqMeanTokenMean => (per_seq / mask.sum(1)?.clamp(1.0, f64::INFINITY)?)?.sum(0)? / rows.max(1) as f64,
        LossAgg::SeqMeanTokenSum => per_seq.sum(0)? / rows.max(1) as f64,
    }
}

/// The per-token PPO loss and whether the clip bound (veRL `compute_policy_loss`):
///   r = exp(logp − old_logp)
///   l₁ = −A·r, l₂ = −A·clip(r, 1 − ε_low, 1 + ε_high), l = max(l₁, l₂)
///   dual-clip (A < 0, c > 1): l = min(l, −A·c)
///
/// # Shapes
/// `logp`, `old_logp`, `adv`: [B, T] → (loss [B, T], clipped [B, T] as 0.0/1.0, ratio [B, T]).
pub fn clipped_surrogate(
    logp: &Tensor,
    old_logp: &Tensor,
    adv: &Tensor,
    clip_low: f64,
    clip_high: f64,
    dual_clip: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let ratio = (logp - old_logp)?.exp()?; // [B, T]
    let neg_adv = adv.neg()?;
    let l1 = (&neg_adv * &ratio)?;
    let l2 = (&neg_adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)?)?;
    let clipped = l2.gt(&l1)?.to_dtype(l1.dtype())?.detach();
    let mut loss = l1.maximum(&l2)?;
    if dual_clip > 1.0 {
        let l3 = neg_adv.affine(dual_clip, 0.0)?;
        let dual = loss.minimum(&l3)?;
        loss = adv.lt(0.0)?.where_cond(&dual, &loss)?;
    }
    Ok((loss, clipped, ratio))
}

/// KL estimators of KL(π ‖ π_ref) per token (veRL `kl_penalty`):
/// k1 = logp − ref_logp; abs = |k1|; mse (k2) = ½·k1²; k3 ("low_var_kl") = r − log r − 1 with
/// log r = ref_logp − logp, clamped to [−10, 10].
///
/// # Shapes
/// `logp`, `ref_logp`: [B, T] → [B, T].
pub fn kl(logp: &Tensor, ref_logp: &Tensor, kind: KlKind) -> Result<Tensor> {
    match kind {
        KlKind::K1 => logp - ref_logp,
        KlKind::Abs => (logp - ref_logp)?.abs(),
        KlKind::Mse => (logp - ref_logp)?.sqr()? * 0.5,
        KlKind::K3 => {
            let log_r = (ref_logp - logp)?;
            ((log_r.exp()? - &log_r)? - 1.0)?.clamp(-10.0, 10.0)
        }
    }
}

/// The clipped value loss (veRL `compute_value_loss`):
/// 0.5 · agg(max((v − R)², (clip(v, v_old ± ε) − R)²)).
///
/// # Shapes
/// `values`, `old_values`, `returns`, `mask`: [B, T] → scalar.
pub fn value_loss(values: &Tensor, old_values: &Tensor, returns: &Tensor, mask: &Tensor, clip: f64) -> Result<Tensor> {
    let lo = (old_values - clip)?;
    let hi = (old_values + clip)?;
    let clipped = values.maximum(&lo)?.minimum(&hi)?;
    let l1 = (values - returns)?.sqr()?;
    let l2 = (clipped - returns)?.sqr()?;
    seq_mean_token_mean(&l1.maximum(&l2)?, mask)? * 0.5
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn t(rows: &[&[f32]]) -> Tensor {
        let b = rows.len();
        let data: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(data, (b, rows[0].len()), &Device::Cpu).unwrap()
    }

    fn v2(x: &Tensor) -> Vec<Vec<f32>> {
        x.to_vec2().unwrap()
    }

    fn close(a: f32, b: f32) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }

    #[test]
    fn token_mean_per_sequence_then_mean_over_sequences() {
        // seq 0: tokens 1, 3 masked → 2; seq 1: token 10 masked → 10; mean = 6
        // (a flat token-mean would give 14/3 = 4.67)
        let x = t(&[&[1.0, 3.0, 5.0], &[10.0, 7.0, 7.0]]);
        let m = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        close(seq_mean_token_mean(&x, &m).unwrap().to_scalar().unwrap(), 6.0);
    }

    #[test]
    fn aggregation_shares_add_up_to_the_mini_batch_loss() {
        // A mini-batch of 3 sequences in two micro-batches; assistant tokens: [1, 3], [10], [2, 2, 2].
        let a = t(&[&[1.0, 3.0, 5.0], &[10.0, 7.0, 7.0]]);
        let am = t(&[&[1.0, 1.0, 0.0], &[1.0, 0.0, 0.0]]);
        let b = t(&[&[2.0, 2.0, 2.0]]);
        let bm = t(&[&[1.0, 1.0, 1.0]]);
        let total = |mode| {
            let share = |x, m| agg_share(x, m, mode, 3, 6.0).unwrap().to_scalar::<f32>().unwrap();
            share(&a, &am) + share(&b, &bm)
        };
        // token-mean: (1 + 3 + 10 + 6)/6; seq-mean-token-mean: (2 + 10 + 2)/3; seq-sum: (4 + 10 + 6)/3.
        close(total(LossAgg::TokenMean), 20.0 / 6.0);
        close(total(LossAgg::SeqMeanTokenMean), 14.0 / 3.0);
        close(total(LossAgg::SeqMeanTokenSum), 20.0 / 3.0);
    }

    #[test]
    fn surrogate_by_hand_with_asymmetric_and_dual_clip() {
        // ratios: e^0.5 = 1.6487, e^-0.5 = 0.6065, e^0.1 = 1.1052, e^1.5 = 4.4817
        let logp = t(&[&[0.5, -0.5, 0.1, 1.5]]);
        let old = t(&[&[0.0, 0.0, 0.0, 0.0]]);
        let adv = t(&[&[1.0, 1.0, -2.0, -1.0]]);
        let (loss, clipped, _) = clipped_surrogate(&logp, &old, &adv, 0.2, 0.28, 3.0).unwrap();
        let l = &v2(&loss)[0];
        // A>0, r = 1.6487 > 1.28: max(−1.6487, −1.28) = −1.28 (clipped)
        close(l[0], -1.28);
        // A>0, r = 0.6065 < 0.8: max(−0.6065, −0.8) = −0.6065 (unclipped: pessimistic side)
        close(l[1], -0.606_530_7);
        // A<0, r = 1.1052 inside: 2.2103
        close(l[2], 2.210_342);
        // A<0, r = 4.4817: max(4.4817, 1.28) = 4.4817, dual-clip min(4.4817, 3·1) = 3
        close(l[3], 3.0);
        assert_eq!(v2(&clipped)[0], vec![1.0, 0.0, 0.0, 0.0]);
        // without dual-clip the last token keeps 4.4817
        let (loss, _, _) = clipped_surrogate(&logp, &old, &adv, 0.2, 0.28, 0.0).unwrap();
        close(v2(&loss)[0][3], 4.481_689);
    }

    #[test]
    fn the_clip_binds_zero_gradient_past_the_bound() {
        // Positive advantage, ratio past 1 + ε_high: no gradient. Inside the bound: −A·r.
        // Negative advantage, ratio below 1 − ε_low: no gradient. Dual-clipped: no gradient.
        let logp = Var::from_tensor(&t(&[&[0.5, 0.1, -0.5, 1.5]])).unwrap();
        let old = t(&[&[0.0, 0.0, 0.0, 0.0]]);
        let adv = t(&[&[1.0, 1.0, -1.0, -1.0]]);
        let mask = t(&[&[1.0, 1.0, 1.0, 1.0]]);
        let (loss, _, _) = clipped_surrogate(logp.as_tensor(), &old, &adv, 0.2, 0.28, 3.0).unwrap();
        let total = seq_mean_token_mean(&loss, &mask).unwrap();
        let grads = total.backward().unwrap();
        let g = v2(grads.get(&logp).unwrap())[0].clone();
        close(g[0], 0.0);
        // d/dlogp (−A·e^logp)/4 = −1.1052/4
        close(g[1], -(0.1f32.exp()) / 4.0);
        close(g[2], 0.0);
        close(g[3], 0.0);
        // same ratio as g[1] but the asymmetric upper bound: 1.25 is inside 1.28, outside 1.2
        let logp = Var::from_tensor(&t(&[&[1.25f32.ln()]])).unwrap();
        let (l, _, _) = clipped_surrogate(logp.as_tensor(), &t(&[&[0.0]]), &t(&[&[1.0]]), 0.2, 0.28, 3.0).unwrap();
        let g = l.sum_all().unwrap().backward().unwrap();
        close(v2(g.get(&logp).unwrap())[0][0], -1.25);
        let logp = Var::from_tensor(&t(&[&[1.25f32.ln()]])).unwrap();
        let (l, _, _) = clipped_surrogate(logp.as_tensor(), &t(&[&[0.0]]), &t(&[&[1.0]]), 0.2, 0.2, 3.0).unwrap();
        let g = l.sum_all().unwrap().backward().unwrap();
        close(v2(g.get(&logp).unwrap())[0][0], 0.0);
    }

    #[test]
    fn kl_estimators_by_hand() {
        // logp = −1, ref = −1.5: k1 = 0.5; k3: log r = −0.5, r = 0.60653 → 0.60653 + 0.5 − 1 = 0.10653
        let logp = t(&[&[-1.0, -2.0]]);
        let reff = t(&[&[-1.5, -2.0]]);
        let k1 = v2(&kl(&logp, &reff, KlKind::K1).unwrap())[0].clone();
        let k3 = v2(&kl(&logp, &reff, KlKind::K3).unwrap())[0].clone();
        close(k1[0], 0.5);
        close(k1[1], 0.0);
        close(k3[0], 0.106_530_66);
        close(k3[1], 0.0);
        let abs = v2(&kl(&reff, &logp, KlKind::Abs).unwrap())[0].clone();
        let mse = v2(&kl(&reff, &logp, KlKind::Mse).unwrap())[0].clone();
        // |−1.5 − (−1)| = 0.5 and ½ · 0.5² = 0.125.
        close(abs[0], 0.5);
        close(mse[0], 0.125);
        // k3 clamps at 10: log r = 20 → e^20 huge
        close(v2(&kl(&t(&[&[-21.0]]), &t(&[&[-1.0]]), KlKind::K3).unwrap())[0][0], 10.0);
    }

    #[test]
    fn value_loss_takes_the_worse_of_clipped_and_unclipped() {
        // v = 1.0, v_old = 0.0, R = 1.0, ε = 0.5: unclipped 0, clipped (0.5 − 1)² = 0.25 → max 0.25
        // v = 0.2, v_old = 0.0, R = 1.0: both 0.64 → 0.64; mean 0.445, × 0.5 = 0.2225
        let v = t(&[&[1.0, 0.2]]);
        let old = t(&[&[0.0, 0.0]]);
        let ret = t(&[&[1.0, 1.0]]);
        let m = t(&[&[1.0, 1.0]]);
        close(value_loss(&v, &old, &ret, &m, 0.5).unwrap().to_scalar().unwrap(), 0.2225);
    }
}
