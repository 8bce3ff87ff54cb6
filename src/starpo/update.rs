//! One StarPO(-S) update on the kept trajectories, in RAGEN `agent_trainer.fit` order (the
//! filter has already run in the trainer):
//!   2. old log-probs with the actor; reference log-probs only when the KL loss is on;
//!   3. critic values (GAE estimators only);
//!   4. advantages: GAE over the packed sequence, bi-level GAE, or a critic-free estimator's
//!      per-trajectory advantage (computed by the trainer from the groups) on its tokens;
//!   5. for each epoch and mini-batch: the critic step, then the actor step (clipped surrogate,
//!      entropy bonus, KL loss, aggregated by `starpo.loss_agg_mode`), gradients summed over
//!      micro-batches, grad-norm clip, AdamW.
//! Reported losses are means over all mini-batches (not the last one's, CleanRL's habit).
use std::time::Instant;

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor};

use super::advantage::{bi_level_gae, gae, spread, spread_turns, whiten};
use super::loss::{agg_share, clipped_surrogate, kl, seq_mean_token_mean, value_loss};
use super::optim::AdamW;
use super::settings::{AdvantageKind, Settings, Starpo};
use crate::agent::pack::Packed;
use crate::agent::settings::Backend;
use crate::phase::{self, Phase};
use crate::policy::{Critic, Policy, Temperature, TokenBatch};
use crate::rng::Rng;

/// One trajectory as the update sees it: its packed tokens, its (normalised) score for the
/// critic estimators or its advantage for the critic-free ones, and a factor on its final
/// advantages (`starpo.filter_loss_scaling`; 1 otherwise).
pub struct Item<'a> {
    pub packed: &'a Packed,
    pub score: f32,
    /// Turn-level GRPO: the advantage of each turn the packed sequence shows (else empty).
    pub turn_scores: Vec<f32>,
    pub adv_scale: f32,
}

/// Means over mini-batches.
#[derive(Clone, Debug, Default)]
pub struct UpdateStats {
    pub pg_loss: f64,
    pub entropy: f64,
    pub kl: Option<f64>,
    pub clip_frac: f64,
    pub grad_norm: f64,
    pub value_loss: Option<f64>,
    pub approx_kl: f64,
    pub optimizer_steps: usize,
    /// Token positions run forward (and backward) in the update, for perf/tokens and FLOPs.
    pub tokens: usize,
    /// The per-sequence mean advantage over assistant tokens (for the rollout log).
    pub seq_advantage: Vec<f32>,
    /// Rollouts on engines (truncated importance sampling): the mean weight, the largest
    /// ratio and KL(π_engine ‖ π_old), over the tokens with an engine log-prob.
    pub tis: Option<TisStats>,
    /// Trajectories whose old log-probs were the local sampler's (no pass over them).
    pub sampler_logprobs: usize,
}

/// One mini-batch's update figures, and their sums over mini-batches (`UpdateStats` divides).
#[derive(Clone, Copy, Debug, Default)]
struct Sums {
    pg_loss: f64,
    entropy: f64,
    clip_frac: f64,
    approx_kl: f64,
    kl: f64,
    grad_norm: f64,
    value_loss: f64,
}

impl Sums {
    fn add(&mut self, o: &Sums) {
        self.pg_loss += o.pg_loss;
        self.entropy += o.entropy;
        self.clip_frac += o.clip_frac;
        self.approx_kl += o.approx_kl;
        self.kl += o.kl;
        self.grad_norm += o.grad_norm;
        self.value_loss += o.value_loss;
    }
}

#[derive(Clone, Debug, Default)]
pub struct TisStats {
    pub weight_mean: f64,
    pub ratio_max: f64,
    pub kl_rollout: f64,
    /// Share of the scored tokens whose engine log-prob is known (the rest get weight 1).
    pub coverage: f64,
}

/// Running sums behind [`TisStats`], over the update's micro-batches.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct TisSums {
    weight: f64,
    ratio_max: f64,
    k3: f64,
    /// Scored tokens with an engine log-prob, and all scored tokens.
    known: f64,
    scored: f64,
}

impl TisSums {
    fn add(&mut self, o: TisSums) {
        self.weight += o.weight;
        self.ratio_max = self.ratio_max.max(o.ratio_max);
        self.k3 += o.k3;
        self.known += o.known;
        self.scored += o.scored;
    }

    fn stats(&self) -> TisStats {
        let known = self.known.max(1.0);
        TisStats {
            weight_mean: self.weight / known,
            ratio_max: self.ratio_max,
            kl_rollout: self.k3 / known,
            coverage: self.known / self.scored.max(1.0),
        }
    }
}

/// Truncated importance sampling (veRL's `rollout_is`, token level): the engine sampled with
/// log-probs `rollout`, the update's old policy has `old`; each scored token (`mask`) whose
/// engine log-prob is there (`known`, 1.0) has its advantage weighted by
/// min(exp(old − rollout), cap); every other token by 1. Returns the weights [B, T] and sums.
fn tis_weights(old: &Tensor, rollout: &Tensor, known: &Tensor, mask: &Tensor, cap: f64) -> Result<(Tensor, TisSums)> {
    let known = (known * mask)?;
    let sum = |t: &Tensor| -> Result<f64> { Ok(t.sum_all()?.to_scalar::<f32>()? as f64) };
    let log_ratio = ((old - rollout)? * &known)?;
    let ratio = log_ratio.exp()?;
    let weight = ratio.clamp(0.0, cap)?;
    let sums = TisSums {
        weight: sum(&(&weight * &known)?)?,
        ratio_max: (&ratio * &known)?.max_all()?.to_scalar::<f32>()? as f64,
        // k3 of KL(engine ‖ old) with r = π_old / π_engine: (r − 1) − log r.
        k3: sum(&(((&ratio - 1.0)? - &log_ratio)? * &known)?)?,
        known: sum(&known)?,
        scored: sum(mask)?,
    };
    Ok((weight, sums))
}

/// The models and optimisers the update touches.
pub struct Models<'a> {
    pub policy: &'a Policy,
    pub critic: Option<&'a Critic>,
    pub reference: Option<&'a Policy>,
    pub actor_opt: &'a mut AdamW,
    pub critic_opt: Option<&'a mut AdamW>,
}

/// Rows of `[B, T]` f32 from ragged vectors, zero-padded to `t`.
pub(super) fn rows_tensor(rows: &[Vec<f32>], t: usize, dev: &Device) -> Result<Tensor> {
    let mut data = Vec::with_capacity(rows.len() * t);
    for r in rows {
        data.extend_from_slice(&r[..r.len().min(t)]);
        data.extend(std::iter::repeat_n(0.0, t.saturating_sub(r.len())));
    }
    Ok(Tensor::from_vec(data, (rows.len(), t), dev)?)
}

/// Shift the critic's per-position values (position t = state after ids[..=t]) to the log-prob
/// layout (position t = state before ids[t]): aligned[t] = raw[t − 1], aligned[0] = 0.
fn align_values(raw: &Tensor) -> Result<Tensor> {
    let (b, t) = raw.dims2()?;
    let zero = Tensor::zeros((b, 1), raw.dtype(), raw.device())?;
    if t < 2 {
        return Ok(zero.narrow(1, 0, t)?);
    }
    Ok(Tensor::cat(&[&zero, &raw.narrow(1, 0, t - 1)?], 1)?)
}

/// Per-sequence vectors of a no-grad score over micro-batches.
fn per_seq(x: &Tensor, lengths: &[usize]) -> Result<Vec<Vec<f32>>> {
    let rows: Vec<Vec<f32>> = x.to_vec2()?;
    Ok(rows
        .into_iter()
        .zip(lengths)
        .map(|(mut r, &l)| {
            r.truncate(l);
            r
        })
        .collect())
}

/// Keys a query attends to at which its attention costs as much as its projections (SmolLM2:
/// 7.1 MFLOP of projections per position and layer, 2.3 kFLOP of attention per key).
const KEYS_PER_PROJECTION: f64 = 3000.0;

/// The trajectories `rows` as one pass: packed as a prefix tree where that computes less than
/// the rows do (a group's trajectories share their prompt and often turns of history), scoring
/// only their trained tokens, under the temperature they were sampled at.
fn pass_of(packed: &[&Packed], rows: &[usize], pad: u32, temperature: Temperature) -> Result<TokenBatch> {
    let plain = TokenBatch::new(&rows.iter().map(|&i| packed[i].ids.clone()).collect::<Vec<_>>(), pad)?;
    let masks: Vec<&[bool]> = rows.iter().map(|&i| packed[i].mask.as_slice()).collect();
    let allowed: Vec<_> = rows.iter().map(|&i| packed[i].allowed.as_slice()).collect();
    let value_slots: Vec<_> = rows.iter().map(|&i| packed[i].value_slots.as_slice()).collect();
    let cost = |b: &TokenBatch| b.tokens_computed() as f64 + b.attention_pairs() as f64 / KEYS_PER_PROJECTION;
    let tree = plain.clone().as_tree();
    let pick = if cost(&tree) < cost(&plain) { tree } else { plain };
    Ok(pick.score_only(&masks).restrict(&allowed).restrict_values(&value_slots).tempered(temperature))
}

/// Micro-batches of the trajectories `idx` of `packed`, in order, each computing at most the
/// positions of `micro` rows of the longest trajectory. Rows of one group share their prompt and often
/// turns of history, which a packed tree runs once, so a micro-batch holds as many rows as fit:
/// a whole group when the shared part dominates. Scored at the sampling `temperature`.
pub(super) fn micro_batches(
    packed: &[&Packed],
    idx: &[usize],
    micro: usize,
    pad: u32,
    temperature: Temperature,
) -> Result<Vec<(Vec<usize>, TokenBatch)>> {
    let budget = micro.max(1) * idx.iter().map(|&i| packed[i].ids.len()).max().unwrap_or(0);
    let mut out = Vec::new();
    let mut rows: Vec<usize> = Vec::new();
    let mut current: Option<TokenBatch> = None;
    for &i in idx {
        rows.push(i);
        let candidate = pass_of(packed, &rows, pad, temperature)?;
        if rows.len() > 1 && candidate.tokens_computed() > budget {
            rows.pop();
            out.push((std::mem::take(&mut rows), current.take().expect("a batch of the rows so far")));
            rows.push(i);
            current = Some(pass_of(packed, &rows, pad, temperature)?);
        } else {
            current = Some(candidate);
        }
    }
    if let Some(tb) = current {
        out.push((rows, tb));
    }
    Ok(out)
}

/// How many times a training micro-batch's positions a pass without a graph runs at once: it
/// keeps no activations for a backward, and one larger tree runs a prefix shared across
/// micro-batches once.
const NO_GRAD_MICRO: usize = 8;

/// Each trajectory's mean token entropy over its assistant tokens under the current policy, in
/// one no-grad pass (the filter's entropy metrics; RAGEN-2 computes it the same way).
pub fn mean_entropies(policy: &Policy, packed: &[&Packed], micro: usize, temperature: Temperature) -> Result<Vec<f64>> {
    let all: Vec<usize> = (0..packed.len()).collect();
    let mut out = vec![0.0; packed.len()];
    for (ids, tb) in micro_batches(packed, &all, micro * NO_GRAD_MICRO, policy.pad_id, temperature)? {
        let entropy = per_seq(&policy.token_logprobs_no_grad(&tb)?.entropy, &tb.lengths)?;
        phase::add_tokens(tb.tokens_computed());
        for (row, &i) in entropy.iter().zip(&ids) {
            let on: Vec<f64> = row.iter().zip(&packed[i].mask).filter(|p| *p.1).map(|p| *p.0 as f64).collect();
            out[i] = on.iter().sum::<f64>() / on.len().max(1) as f64;
        }
    }
    Ok(out)
}

/// What the update reads from the weights before it moves them: each sequence's old log-probs
/// (skipped on a single optimiser step, where the step's own forward pass, detached, is
/// bit-identical; taken from the local sampler where it has them, see [`sampled_logprobs`]),
/// the reference's where the KL loss is on, and the critic's values.
struct Old {
    lp: Vec<Vec<f32>>,
    ref_lp: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    /// Positions run.
    tokens: usize,
    /// Sequences whose old log-probs are the sampler's.
    from_sampler: usize,
}

/// The local sampler's log-probs of `p`'s trained tokens, 0 elsewhere, where it has one for
/// each of them (the end-of-turn after `</answer>` included, which it scores after stopping).
/// It drew them from the distribution the update scores (tempered, over the legal tokens) on
/// the weights the update starts from, so they are the old log-probs without a pass, up to the
/// rounding of a cached decode against a full forward. An engine's are of other weights and
/// weigh the update instead (truncated importance sampling).
fn sampled_logprobs(p: &Packed, s: &Settings) -> Option<Vec<f32>> {
    if s.rollout.backend == Backend::Http || p.rollout_logprobs.len() != p.mask.len() {
        return None;
    }
    let known = p.rollout_logprobs.iter().zip(&p.mask).all(|(lp, &on)| !on || !lp.is_nan());
    known.then(|| p.rollout_logprobs.iter().zip(&p.mask).map(|(&lp, &on)| if on { lp } else { 0.0 }).collect())
}

/// The no-graph passes of [`Old`], timed as the old-log-probs phase.
fn old_passes(m: &Models<'_>, packed: &[&Packed], s: &Settings, pad: u32, single_step: bool) -> Result<Old> {
    let (micro, kl, temperature) = (s.optim.micro_batch_size, s.starpo.kl_coef > 0.0, Temperature::from(&s.rollout));
    let n = packed.len();
    let mut old = Old {
        lp: vec![Vec::new(); n],
        ref_lp: vec![Vec::new(); n],
        values: vec![Vec::new(); n],
        tokens: 0,
        from_sampler: 0,
    };
    let mut unknown = Vec::new();
    if !single_step {
        for (i, p) in packed.iter().enumerate() {
            match sampled_logprobs(p, s) {
                Some(lp) => (old.lp[i], old.from_sampler) = (lp, old.from_sampler + 1),
                None => unknown.push(i),
            }
        }
    }
    let (reference, critic) = (m.reference.filter(|_| kl), m.critic);
    // Every sequence where the reference or the critic reads them, else only those the sampler
    // left without old log-probs.
    let rows: Vec<usize> = if reference.is_some() || critic.is_some() { (0..n).collect() } else { unknown.clone() };
    let start = Instant::now();
    for (ids, tb) in micro_batches(packed, &rows, micro * NO_GRAD_MICRO, pad, temperature)? {
        let mut tokens = 0;
        let mut put = |into: &mut Vec<Vec<f32>>, rows: Vec<Vec<f32>>| {
            for (&i, row) in ids.iter().zip(rows) {
                if into[i].is_empty() {
                    into[i] = row;
                }
            }
            tokens += tb.tokens_computed();
        };
        if ids.iter().any(|i| unknown.contains(i)) {
            put(&mut old.lp, per_seq(&m.policy.token_logprobs_no_grad(&tb)?.logprobs, &tb.lengths)?);
        }
        if let Some(r) = reference {
            put(&mut old.ref_lp, per_seq(&r.token_logprobs_no_grad(&tb)?.logprobs, &tb.lengths)?);
        }
        // 3. Critic values.
        if let Some(c) = critic {
            put(&mut old.values, per_seq(&align_values(&c.values_no_grad(&tb)?)?, &tb.lengths)?);
        }
        phase::add_tokens(tokens);
        old.tokens += tokens;
    }
    phase::add_seconds(Phase::OldLogprobs, start.elapsed().as_secs_f64());
    Ok(old)
}

/// Per-token advantages of each item (masked, whitened where the estimator is, scaled by its
/// `adv_scale`) and the critic's returns. `values` without a critic become zeros.
fn advantages(
    items: &[Item<'_>],
    values: &mut [Vec<f32>],
    masks: &[Vec<bool>],
    sp: &Starpo,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut adv = Vec::with_capacity(items.len());
    let mut ret = Vec::with_capacity(items.len());
    for (i, it) in items.iter().enumerate() {
        let p = it.packed;
        if values[i].is_empty() {
            values[i] = vec![0.0; p.ids.len()]; // no critic: V = 0
        }
        let (a, r) = match sp.advantage {
            AdvantageKind::Gae => {
                let (a, r) = gae(&p.score_rewards(it.score), &values[i], sp.gamma as f32, sp.lam as f32);
                (a.into_iter().zip(&p.mask).map(|(x, &on)| if on { x } else { 0.0 }).collect(), r)
            }
            AdvantageKind::BiLevelGae => bi_level_gae(
                &p.turn_ends,
                &p.turn_rewards,
                &values[i],
                &p.mask,
                sp.gamma as f32,
                sp.lam as f32,
                sp.high_level_gamma as f32,
            ),
            AdvantageKind::ReinforcePlusPlus => (spread(it.score, &p.mask, sp.gamma as f32), vec![0.0; p.ids.len()]),
            AdvantageKind::TurnGrpo => (spread_turns(&it.turn_scores, &p.turn_ends, &p.mask), vec![0.0; p.ids.len()]),
            _ => (spread(it.score, &p.mask, 1.0), vec![0.0; p.ids.len()]),
        };
        adv.push(a);
        ret.push(r);
    }
    let whitened = match sp.advantage {
        AdvantageKind::Gae | AdvantageKind::BiLevelGae => sp.whiten,
        AdvantageKind::ReinforcePlusPlus | AdvantageKind::ReinforcePlusPlusBaseline => true,
        _ => false,
    };
    if whitened {
        whiten(&mut adv, masks);
    }
    for (a, it) in adv.iter_mut().zip(items) {
        if it.adv_scale != 1.0 {
            a.iter_mut().for_each(|x| *x *= it.adv_scale);
        }
    }
    (adv, ret)
}

/// One update. `rng` shuffles nothing at RAGEN's defaults (veRL `shuffle: False`); it orders
/// mini-batches only when there are several epochs.
pub fn update(mut m: Models<'_>, items: &[Item<'_>], s: &Settings, rng: &mut Rng) -> Result<UpdateStats> {
    let (sp, so) = (&s.starpo, &s.optim);
    let policy = m.policy;
    let dev = policy.device().clone();
    let n = items.len();
    let mut stats = UpdateStats::default();
    if n == 0 {
        return Ok(stats);
    }
    let packed: Vec<&Packed> = items.iter().map(|it| it.packed).collect();
    let masks: Vec<Vec<bool>> = items.iter().map(|it| it.packed.mask.clone()).collect();
    let all: Vec<usize> = (0..n).collect();
    let pad = policy.pad_id;
    // Engine log-probs where the rollout ran on engines: the value (0 where unknown) and 1 where
    // known.
    let tis = s.rollout.tis_cap > 0.0
        && s.rollout.backend == Backend::Http
        && items.iter().any(|it| !it.packed.rollout_logprobs.is_empty());
    let engine_rows = |f: fn(f32) -> f32| -> Vec<Vec<f32>> {
        items.iter().map(|it| it.packed.rollout_logprobs.iter().map(|&x| f(x)).collect()).collect()
    };
    let roll_lp = engine_rows(|x| if x.is_nan() { 0.0 } else { x });
    let roll_known = engine_rows(|x| f32::from(u8::from(!x.is_nan())));
    let mut tis_sums = TisSums::default();

    // 2. Old log-probs (and reference log-probs where the KL loss is on), no graph: the local
    // sampler's where it has them all. When the update is a single optimiser step, the policy
    // has not moved before it: the old log-probs are the step's own forward pass, detached
    // (bit-identical: Score and Train run the same ops), and the no-grad pass is skipped.
    let mb_size = if so.rollout_reuse > 1 { n.div_ceil(so.rollout_reuse) } else { so.mini_batch_size.min(n) };
    let single_step = so.epochs == 1 && mb_size >= n;
    let old = old_passes(&m, &packed, s, pad, single_step)?;
    stats.tokens += old.tokens;
    stats.sampler_logprobs = old.from_sampler;
    let Old { lp: old_lp, ref_lp, mut values, .. } = old;
    // 4. Advantages (and returns for the critic).
    let (adv, ret) = advantages(items, &mut values, &masks, sp);
    let old_v = values;
    stats.seq_advantage = adv
        .iter()
        .zip(&masks)
        .map(|(a, m)| {
            let k = m.iter().filter(|&&x| x).count().max(1) as f32;
            a.iter().zip(m).filter(|p| *p.1).map(|p| *p.0).sum::<f32>() / k
        })
        .collect();

    // 5. Epochs × mini-batches: critic step, then actor step.
    let mask_f: Vec<Vec<f32>> = masks.iter().map(|m| m.iter().map(|&x| x as u8 as f32).collect()).collect();
    let choice_f: Vec<Vec<f32>> = items.iter().map(|it| choice_mask(it.packed)).collect();
    let (mut sums, mut count) = (Sums::default(), 0usize);
    for epoch in 0..so.epochs {
        let mut order = all.clone();
        if epoch > 0 {
            rng.shuffle(&mut order);
        }
        for mb in order.chunks(mb_size) {
            let weight = |rows: usize| rows as f64 / mb.len() as f64;
            let passes = micro_batches(&packed, mb, so.micro_batch_size, pad, Temperature::from(&s.rollout))?;
            // Critic.
            let mut vloss = 0.0;
            if let (Some(c), Some(opt)) = (m.critic, m.critic_opt.as_deref_mut()) {
                let mut grads = GradStore::default();
                for (ids, tb) in &passes {
                    let t = tb.len;
                    let pick = |v: &Vec<Vec<f32>>| ids.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
                    let (ov, rt, mk) = (pick(&old_v), pick(&ret), pick(&mask_f));
                    let (ov, rt, mk) =
                        (rows_tensor(&ov, t, &dev)?, rows_tensor(&rt, t, &dev)?, rows_tensor(&mk, t, &dev)?);
                    let l = c.loss_and_grads(
                        tb,
                        |values| {
                            let l = value_loss(&align_values(values)?, &ov, &rt, &mk, sp.value_clip)?;
                            Ok((l * weight(tb.rows))?)
                        },
                        &mut grads,
                    )?;
                    vloss += l as f64;
                    phase::add_tokens(tb.tokens_computed());
                    stats.tokens += tb.tokens_computed();
                }
                if !passes.is_empty() {
                    phase::timed(Phase::Optimizer, || opt.step(&grads, so.grad_clip))?;
                }
            }
            // Actor: each micro-batch adds its share of the mini-batch's aggregated loss.
            let mb_tokens: f64 = mb.iter().map(|&i| masks[i].iter().filter(|&&m| m).count() as f64).sum();
            let agg = |x: &Tensor, mask: &Tensor| agg_share(x, mask, sp.loss_agg_mode, mb.len(), mb_tokens);
            let mut grads = GradStore::default();
            let mut mb_stats = Sums::default();
            for (ids, tb) in &passes {
                let t = tb.len;
                let pick = |v: &Vec<Vec<f32>>| ids.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
                let (olp, ad, mk) = (pick(&old_lp), pick(&adv), pick(&mask_f));
                let mask = rows_tensor(&mk, t, &dev)?;
                let choices = match sp.answer_entropy_coef > 0.0 {
                    true => Some(rows_tensor(&pick(&choice_f), t, &dev)?),
                    false => None,
                };
                let old = if single_step { None } else { Some(rows_tensor(&olp, t, &dev)?) };
                let w = weight(tb.rows);
                let ad = rows_tensor(&ad, t, &dev)?;
                let rl = if m.reference.is_some() && sp.kl_coef > 0.0 {
                    Some(rows_tensor(&pick(&ref_lp), t, &dev)?)
                } else {
                    None
                };
                let engine = match tis {
                    true => Some((rows_tensor(&pick(&roll_lp), t, &dev)?, rows_tensor(&pick(&roll_known), t, &dev)?)),
                    false => None,
                };
                // The policy holds one chunk of full-vocabulary logits at a time (big vocabularies).
                policy.loss_and_grads(
                    tb,
                    |scored| {
                        let old = old.unwrap_or_else(|| scored.logprobs.detach());
                        let ad = match &engine {
                            Some((roll, known)) => {
                                let (w, sums) = tis_weights(&old, roll, known, &mask, s.rollout.tis_cap)?;
                                tis_sums.add(sums);
                                (&ad * w)?
                            }
                            None => ad,
                        };
                        let (pg, clipped, _) =
                            clipped_surrogate(&scored.logprobs, &old, &ad, sp.clip_low, sp.clip_high, sp.dual_clip)?;
                        let pg_loss = agg(&pg, &mask)?;
                        let entropy = agg(&scored.entropy, &mask)?;
                        let mut loss = (&pg_loss - (&entropy * sp.entropy_coef)?)?;
                        if let Some(choices) = &choices {
                            // Shared with the other token losses' denominator: per token, a
                            // choice's entropy weighs against its advantage.
                            let h = (agg(&(&scored.entropy * choices)?, &mask)? * sp.answer_entropy_coef)?;
                            loss = (loss - h)?;
                        }
                        if let Some(rl) = &rl {
                            let k = agg(&kl(&scored.logprobs, rl, sp.kl_type)?, &mask)?;
                            mb_stats.kl += k.to_scalar::<f32>()? as f64;
                            loss = (loss + (k * sp.kl_coef)?)?;
                        }
                        mb_stats.pg_loss += pg_loss.to_scalar::<f32>()? as f64;
                        mb_stats.entropy += entropy.to_scalar::<f32>()? as f64;
                        // The diagnostics stay per-sequence token means, whatever the loss's mode.
                        mb_stats.clip_frac += w * seq_mean_token_mean(&clipped, &mask)?.to_scalar::<f32>()? as f64;
                        let approx = seq_mean_token_mean(&(&old - scored.logprobs.detach())?, &mask)?;
                        mb_stats.approx_kl += w * approx.to_scalar::<f32>()? as f64;
                        Ok(loss)
                    },
                    &mut grads,
                )?;
                phase::add_tokens(tb.tokens_computed());
                stats.tokens += tb.tokens_computed();
            }
            let norm = if passes.is_empty() {
                0.0
            } else {
                phase::timed(Phase::Optimizer, || m.actor_opt.step(&grads, so.grad_clip))?
            };
            mb_stats.grad_norm = norm;
            mb_stats.value_loss = vloss;
            sums.add(&mb_stats);
            count += 1;
        }
    }
    let c = count.max(1) as f64;
    stats.pg_loss = sums.pg_loss / c;
    stats.entropy = sums.entropy / c;
    stats.clip_frac = sums.clip_frac / c;
    stats.approx_kl = sums.approx_kl / c;
    stats.grad_norm = sums.grad_norm / c;
    stats.value_loss = m.critic.map(|_| sums.value_loss / c);
    stats.kl = (m.reference.is_some() && sp.kl_coef > 0.0).then_some(sums.kl / c);
    stats.optimizer_steps = count;
    stats.tis = tis.then(|| tis_sums.stats());
    Ok(stats)
}

/// 1 on a trajectory's constrained choices (trained positions where the grammar allowed more
/// than one token), 0 elsewhere, [T]: where starpo.answer_entropy_coef keeps the policy from
/// settling on one answer for good.
fn choice_mask(p: &Packed) -> Vec<f32> {
    (0..p.mask.len()).map(|t| (p.mask[t] && p.allowed.get(t).is_some_and(Option::is_some)) as u8 as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_are_the_trained_positions_with_a_choice() {
        let mut p =
            Packed { ids: vec![1, 2, 3, 4, 5], mask: vec![false, true, true, false, true], ..Packed::default() };
        assert_eq!(choice_mask(&p), [0.0; 5], "a free reply has no constrained choice");
        let two: crate::policy::Allowed = Some(vec![2, 7].into());
        p.allowed = vec![two.clone(), two.clone(), None, two.clone(), None];
        // Position 0 is allowed but not trained (a prompt token), 3 likewise (left the loss).
        assert_eq!(choice_mask(&p), [0.0, 1.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn tis_weights_are_capped_ratios_on_known_scored_tokens_only() {
        let dev = Device::Cpu;
        let row = |v: &[f32]| Tensor::new(v, &dev).unwrap().unsqueeze(0).unwrap();
        // Token 0: prompt (unscored). 1: ratio e^0.5. 2: ratio e^2, capped at 2. 3: unknown.
        let old = row(&[-1.0, -1.0, -1.0, -1.0]);
        let engine = row(&[-3.0, -1.5, -3.0, 0.0]);
        let known = row(&[1.0, 1.0, 1.0, 0.0]);
        let mask = row(&[0.0, 1.0, 1.0, 1.0]);
        let (w, sums) = tis_weights(&old, &engine, &known, &mask, 2.0).unwrap();
        let w = w.squeeze(0).unwrap().to_vec1::<f32>().unwrap();
        let (r1, r2) = (0.5f64.exp(), 2f64.exp());
        for (got, want) in w.iter().zip([1.0, r1, 2.0, 1.0]) {
            assert!((*got as f64 - want).abs() < 1e-5, "{w:?}");
        }
        let t = sums.stats();
        assert!((t.weight_mean - (r1 + 2.0) / 2.0).abs() < 1e-5, "{t:?}");
        assert!((t.ratio_max - r2).abs() < 1e-4, "{t:?}");
        let k3 = |r: f64| r - 1.0 - r.ln();
        assert!((t.kl_rollout - (k3(r1) + k3(r2)) / 2.0).abs() < 1e-4, "{t:?}");
        assert!((t.coverage - 2.0 / 3.0).abs() < 1e-6, "{t:?}");
    }
}
