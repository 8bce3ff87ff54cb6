//! Scoring packed sequences for training: per-token log-probs of the taken tokens and per-token
//! entropy, differentiable through the model's training path.
//!
//! Memory: the full-vocabulary logits exist only for one chunk of scored positions at a time (at
//! most `Policy::logit_chunk` floats) and are reduced to a log-prob and an entropy at once. With gradients, autograd
//! would keep each chunk's graph until `backward()`, so the trainer calls `loss_and_grads`,
//! which keeps only one chunk's logits graph alive at a time and adds each micro-batch's
//! gradients into one store (micro-batches: `TokenBatch::split`). Without
//! gradients (`token_logprobs_no_grad`: old and reference log-probs) no graph is recorded at all
//! (`Mode::Score`): every activation is freed as soon as the next op has read it.
//!
//! Constrained answers: a position the sampler drew from a grammar's allowed tokens is scored
//! over those tokens only (`TokenBatch::restrict`), so the update's ratio, entropy and KL are
//! of the distribution that produced the sample, not of the whole vocabulary.
//!
//! Shared prefixes: a group's trajectories share their prompt, and with a small action space
//! often several turns of history. A batch packed as a prefix tree (`TokenBatch::as_tree`,
//! `tree::PrefixTree`) runs every distinct position once, forward and backward, and each row's
//! scores are read off the nodes on its path; a shared node's gradient is the sum of its rows',
//! the same sums the rows would give run separately. Only the positions a caller scores
//! (`TokenBatch::score_only`) go through the output layer, each distinct one once.
use std::sync::Arc;

use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, D};

use super::kernels::{self, Allowed};
use super::model::{Mode, QUERY_BLOCK};
use super::tree::{PrefixTree, TreeLinks};
use super::Policy;
use crate::phase::{self, Phase};
use crate::policy::model::{move_grads, take_grad};

/// Default of `Policy::logit_chunk`: most full-vocabulary logits alive at once, 16 M floats = 64 MiB.
pub const LOGIT_CHUNK: usize = 1 << 24;

/// Trajectories to score, right-padded `[rows, len]`, and how a pass runs them: as those rows,
/// or packed as one prefix tree.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenBatch {
    /// Row-major `[rows, len]`.
    pub ids: Vec<u32>,
    pub rows: usize,
    pub len: usize,
    pub lengths: Vec<usize>,
    /// The rows packed as a prefix tree (`as_tree`); `None`: a pass runs the rows as they are.
    pub tree: Option<PrefixTree>,
    /// Row-major `[rows, len]`: the positions whose log-prob and entropy are computed (never
    /// position 0 or past a row's length).
    scored: Vec<bool>,
    /// Row-major `[rows, len]`, or empty: the tokens a position's distribution is restricted to
    /// (`restrict`), `None` for the whole vocabulary.
    allowed: Vec<Allowed>,
    /// Row-major `[rows, len]`, or empty: the restricted positions inside a value slot, sampled
    /// at the text temperature (`restrict_values`).
    value_slots: Vec<bool>,
    /// The temperatures the rows were sampled at (`tempered`).
    temperature: Temperature,
}

/// The sampling temperatures of a batch's rows: of text (value slots included), and of
/// constrained choices (the positions `restrict` lists, less those `restrict_values` lists). A
/// position is scored under softmax(logits / t), the distribution the sampler drew from, so the
/// policy trained is the one sampled (veRL divides the logits the same way).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Temperature {
    pub text: f32,
    pub answer: f32,
}

impl Temperature {
    /// The logits as they are.
    pub const ONE: Temperature = Temperature { text: 1.0, answer: 1.0 };
}

/// The distinct scored positions of a batch: for each, the position (of the pass) whose hidden
/// state predicts it, its token and the tokens it is scored over; and for every row position,
/// its index among them (the count of them where it is not scored).
struct Wanted {
    from: Vec<u32>,
    target: Vec<u32>,
    allowed: Vec<Allowed>,
    at: Vec<u32>,
    /// Per wanted position, the temperature it is scored at.
    temperature: Vec<f32>,
}

impl TokenBatch {
    /// Pack sequences as rows, padding on the right with `pad_id` to the longest; every
    /// position after the first is scored.
    pub fn new(seqs: &[Vec<u32>], pad_id: u32) -> Result<Self> {
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        if let Some(i) = seqs.iter().position(Vec::is_empty) {
            bail!("sequence {i} is empty");
        }
        let mut ids = Vec::with_capacity(seqs.len() * len);
        let mut scored = Vec::with_capacity(seqs.len() * len);
        for s in seqs {
            ids.extend_from_slice(s);
            ids.extend(std::iter::repeat_n(pad_id, len - s.len()));
            scored.extend((0..len).map(|t| t > 0 && t < s.len()));
        }
        let lengths = seqs.iter().map(Vec::len).collect();
        Ok(Self {
            ids,
            rows: seqs.len(),
            len,
            lengths,
            tree: None,
            scored,
            allowed: Vec::new(),
            value_slots: Vec::new(),
            temperature: Temperature::ONE,
        })
    }

    /// The rows packed as one prefix tree: positions the rows share run once.
    pub fn as_tree(mut self) -> Self {
        let seqs: Vec<&[u32]> = (0..self.rows).map(|r| self.row(r)).collect();
        self.tree = Some(PrefixTree::new(&seqs));
        self
    }

    /// Score only the positions `masks[r][t]` holds true (the trained tokens): the rest are
    /// left at 0 and cost no output-layer work.
    pub fn score_only(mut self, masks: &[&[bool]]) -> Self {
        for (r, m) in masks.iter().enumerate().take(self.rows) {
            for t in 0..self.len {
                self.scored[r * self.len + t] &= m.get(t).copied().unwrap_or(false);
            }
        }
        self
    }

    /// Score row `r`'s position `t` over `allowed[r][t]` only (a constrained answer's tokens:
    /// the distribution the sampler drew from) where it is `Some`.
    pub fn restrict(mut self, allowed: &[&[Allowed]]) -> Self {
        self.allowed = self.row_major(allowed, Option::is_some);
        self
    }

    /// Of the restricted positions, those where `value_slots[r][t]` holds are a value's characters,
    /// scored at the text temperature as they were sampled.
    pub fn restrict_values(mut self, value_slots: &[&[bool]]) -> Self {
        self.value_slots = self.row_major(value_slots, |&v| v);
        self
    }

    /// Per-row lists laid out row-major `[rows, len]` (each cut at its row's length, the rest
    /// default), or empty where no entry is `set`.
    fn row_major<T: Clone + Default>(&self, per_row: &[&[T]], set: impl Fn(&T) -> bool) -> Vec<T> {
        if !per_row.iter().any(|row| row.iter().any(&set)) {
            return Vec::new();
        }
        let mut out = vec![T::default(); self.rows * self.len];
        for (r, row) in per_row.iter().enumerate().take(self.rows) {
            let n = row.len().min(self.lengths[r]);
            out[r * self.len..r * self.len + n].clone_from_slice(&row[..n]);
        }
        out
    }

    /// Score at the temperatures the rows were sampled at.
    pub fn tempered(mut self, t: Temperature) -> Self {
        self.temperature = t;
        self
    }

    fn allowed_at(&self, i: usize) -> &Allowed {
        self.allowed.get(i).unwrap_or(&None)
    }

    fn row(&self, r: usize) -> &[u32] {
        &self.ids[r * self.len..r * self.len + self.lengths[r]]
    }

    /// Token positions a forward pass computes: the tree's nodes, or every row padded.
    pub fn tokens_computed(&self) -> usize {
        self.tree.as_ref().map_or(self.rows * self.len, PrefixTree::len)
    }

    /// Query-key products a pass's attention computes: each block of tree queries against the
    /// keys it sees, or every padded row against itself.
    pub fn attention_pairs(&self) -> usize {
        match &self.tree {
            Some(tree) => tree.links.query_blocks(QUERY_BLOCK).iter().map(|b| (b.end - b.start) * b.key_count()).sum(),
            None => self.rows * self.len * self.len,
        }
    }

    /// What a pass runs: the rows `[B, T]` or the tree's tokens `[1, nodes]`.
    pub(crate) fn pass_ids(&self, dev: &Device) -> Result<Tensor> {
        Ok(match &self.tree {
            Some(tree) => Tensor::from_vec(tree.tokens.clone(), (1, tree.len()), dev)?,
            None => Tensor::from_vec(self.ids.clone(), (self.rows, self.len), dev)?,
        })
    }

    /// The tree's links for the attention mask (rows: none).
    pub(crate) fn links(&self) -> Option<&Arc<TreeLinks>> {
        self.tree.as_ref().map(|t| &t.links)
    }

    /// Where row `r`'s position `t` sits in the pass's flattened positions.
    fn slot(&self, r: usize, t: usize) -> usize {
        match &self.tree {
            Some(tree) => tree.nodes[r][t] as usize,
            None => r * self.len + t,
        }
    }

    /// Per-pass-position values `[N]` laid out `[B, T]`, 0 past a row's length.
    pub(crate) fn per_row(&self, values: &Tensor) -> Result<Tensor> {
        let n = values.dim(0)?;
        let index: Vec<u32> = (0..self.rows)
            .flat_map(|r| (0..self.len).map(move |t| (r, t)))
            .map(|(r, t)| if t < self.lengths[r] { self.slot(r, t) as u32 } else { n as u32 })
            .collect();
        lay_out(values, index, (self.rows, self.len))
    }

    fn wanted(&self) -> Wanted {
        let mut index = vec![u32::MAX; self.tokens_computed()];
        let (mut from, mut target, mut allowed, mut temperature) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut at = vec![u32::MAX; self.rows * self.len];
        for r in 0..self.rows {
            for t in 1..self.lengths[r] {
                let i = r * self.len + t;
                if !self.scored[i] {
                    continue;
                }
                let node = self.slot(r, t);
                // A shared node is scored once, unless rows restrict it differently.
                let known = index[node] != u32::MAX && allowed[index[node] as usize] == *self.allowed_at(i);
                if !known {
                    index[node] = from.len() as u32;
                    from.push(self.slot(r, t - 1) as u32);
                    target.push(self.ids[i]);
                    allowed.push(self.allowed_at(i).clone());
                    let value = self.value_slots.get(i).copied().unwrap_or(false);
                    temperature.push(match self.allowed_at(i) {
                        Some(_) if !value => self.temperature.answer,
                        _ => self.temperature.text,
                    });
                }
                at[i] = index[node];
            }
        }
        at.iter_mut().filter(|a| **a == u32::MAX).for_each(|a| *a = from.len() as u32);
        Wanted { from, target, allowed, at, temperature }
    }

    /// `[B, T]` f32: 1 where a position is scored, else 0.
    pub fn score_mask(&self, dev: &Device) -> Result<Tensor> {
        let m: Vec<f32> = self.scored.iter().map(|&s| s as u8 as f32).collect();
        Ok(Tensor::from_vec(m, (self.rows, self.len), dev)?)
    }

    /// Micro-batches of at most `rows` rows, each trimmed to its own longest row, packed as
    /// this batch is.
    pub fn split(&self, rows: usize) -> Vec<TokenBatch> {
        let rows = rows.max(1);
        (0..self.rows)
            .step_by(rows)
            .map(|r0| {
                let r1 = (r0 + rows).min(self.rows);
                let len = self.lengths[r0..r1].iter().copied().max().unwrap_or(0);
                let pick = |v: &[bool]| -> Vec<bool> {
                    (r0..r1).flat_map(|r| v[r * self.len..r * self.len + len].iter().copied()).collect()
                };
                let ids = (r0..r1).flat_map(|r| self.ids[r * self.len..r * self.len + len].iter().copied()).collect();
                let allowed = match self.allowed.is_empty() {
                    true => Vec::new(),
                    false => {
                        (r0..r1).flat_map(|r| self.allowed[r * self.len..r * self.len + len].iter().cloned()).collect()
                    }
                };
                let value_slots = if self.value_slots.is_empty() { Vec::new() } else { pick(&self.value_slots) };
                let part = TokenBatch {
                    ids,
                    rows: r1 - r0,
                    len,
                    lengths: self.lengths[r0..r1].to_vec(),
                    tree: None,
                    scored: pick(&self.scored),
                    allowed,
                    value_slots,
                    temperature: self.temperature,
                };
                if self.tree.is_some() {
                    part.as_tree()
                } else {
                    part
                }
            })
            .collect()
    }
}

/// `[rows, vocab]`: 0 on a row's allowed tokens (every token where it has no list), −1e30
/// elsewhere, to add to logits (the GPU path; the CPU kernel skips those tokens instead).
fn outside_allowed(allowed: &[Allowed], vocab: usize, dev: &Device) -> Result<Tensor> {
    let mut bias = vec![0f32; allowed.len() * vocab];
    for (row, ids) in bias.chunks_mut(vocab).zip(allowed) {
        if let Some(ids) = ids {
            row.fill(-1e30);
            ids.iter().for_each(|&j| row[j as usize] = 0.0);
        }
    }
    Ok(Tensor::from_vec(bias, (allowed.len(), vocab), dev)?)
}

/// `values` `[K]` picked by `index` (K picks a 0) into `shape`.
fn lay_out(values: &Tensor, index: Vec<u32>, shape: (usize, usize)) -> Result<Tensor> {
    let zero = Tensor::zeros(1, values.dtype(), values.device())?;
    let padded = Tensor::cat(&[values, &zero], 0)?;
    let index = Tensor::from_vec(index, shape.0 * shape.1, values.device())?;
    Ok(padded.index_select(&index, 0)?.reshape(shape)?)
}

/// Per-position scores, `[B, T]`: position t scores `ids[t]` given `ids[..t]`. Unscored
/// positions (position 0, past a row's length, outside `score_only`) hold 0.
pub struct Scored {
    pub logprobs: Tensor,
    pub entropy: Tensor,
}

impl Policy {
    /// Differentiable per-token log-probs and entropies (training path).
    pub fn token_logprobs(&self, batch: &TokenBatch) -> Result<Scored> {
        self.score(batch, false)
    }

    /// The same numbers without a graph (old-policy and reference log-probs).
    pub fn token_logprobs_no_grad(&self, batch: &TokenBatch) -> Result<Scored> {
        self.score(batch, true)
    }

    fn score(&self, batch: &TokenBatch, detach: bool) -> Result<Scored> {
        let mode = if detach { Mode::Score } else { Mode::Train };
        let hidden = self.model.packed_hidden(&batch.pass_ids(self.device())?, batch.links(), mode)?;
        let hidden = hidden.flatten_to(1)?; // [N, H]
        let want = batch.wanted();
        let (lp, ent) = self.wanted_scores(&hidden, &want, 0..want.from.len(), !detach)?;
        let shape = (batch.rows, batch.len);
        Ok(Scored { logprobs: lay_out(&lp, want.at.clone(), shape)?, entropy: lay_out(&ent, want.at, shape)? })
    }

    /// Ranges of the wanted positions, sized so one range's logits hold at most
    /// `Policy::logit_chunk` floats.
    fn chunks(&self, wanted: usize) -> Vec<std::ops::Range<usize>> {
        let chunk = (self.logit_chunk / self.model.cfg.vocab_size.max(1)).max(1);
        (0..wanted).step_by(chunk).map(|s| s..(s + chunk).min(wanted)).collect()
    }

    /// Log-prob and entropy `[k]` of the wanted positions `range`, chunk by chunk, from the
    /// pass's hidden states `[N, H]`; with a graph through the output weights when `grad`.
    fn wanted_scores(
        &self,
        hidden: &Tensor,
        want: &Wanted,
        range: std::ops::Range<usize>,
        grad: bool,
    ) -> Result<(Tensor, Tensor)> {
        let dev = hidden.device();
        if range.is_empty() {
            let none = Tensor::zeros(0, candle_core::DType::F32, dev)?;
            return Ok((none.clone(), none));
        }
        let (mut lps, mut ents) = (vec![], vec![]);
        for c in self.chunks(range.len()).into_iter().map(|c| c.start + range.start..c.end + range.start) {
            let from = Tensor::from_vec(want.from[c.clone()].to_vec(), c.len(), dev)?;
            let hc = hidden.index_select(&from, 0)?; // [c, H]
            let logits = if grad { self.model.logits(&hc)? } else { self.model.logits_no_grad(&hc)? };
            let temperature = &want.temperature[c.clone()];
            let logits = match temperature.iter().all(|&t| t == 1.0) {
                true => logits,
                false => logits.broadcast_div(&Tensor::from_vec(temperature.to_vec(), (c.len(), 1), dev)?)?,
            };
            let (targets, allowed) = (&want.target[c.clone()], &want.allowed[c.clone()]);
            if logits.device().is_cpu() {
                let both = kernels::token_scores(&logits, targets, allowed, grad)?; // [c, 2]
                lps.push(both.narrow(1, 0, 1)?.squeeze(1)?);
                ents.push(both.narrow(1, 1, 1)?.squeeze(1)?);
                continue;
            }
            let tgt = Tensor::from_vec(targets.to_vec(), (c.len(), 1), dev)?;
            let logits = match allowed.iter().any(Option::is_some) {
                true => (&logits + outside_allowed(allowed, logits.dim(1)?, dev)?)?,
                false => logits,
            };
            let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?; // [c, V]
            lps.push(logp.gather(&tgt, 1)?.squeeze(1)?);
            ents.push((logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?);
        }
        Ok((Tensor::cat(&lps, 0)?, Tensor::cat(&ents, 0)?))
    }

    /// `loss(scores)`, its gradients of every weight added into `grads` (gradient accumulation
    /// without a second full set of gradients), holding at most one chunk's full-vocabulary
    /// logits (and their graph) at a time: the scores are computed without a graph, the loss
    /// is differentiated w.r.t. them, then each chunk is recomputed and back-propagated to the
    /// final hidden states, which are back-propagated once through the model. Costs one extra
    /// lm_head forward; the gradients equal `loss(token_logprobs(b)).backward()`.
    pub fn loss_and_grads(
        &self,
        batch: &TokenBatch,
        loss: impl FnOnce(&Scored) -> Result<Tensor>,
        grads: &mut GradStore,
    ) -> Result<f32> {
        let forward_start = std::time::Instant::now();
        let dev = self.device();
        let (hidden, backprop) = self.model.train_hidden(&batch.pass_ids(dev)?, batch.links())?; // [R, W, H]
        let pass_shape = hidden.shape().clone();
        let h_leaf = Var::from_tensor(&hidden.flatten_to(1)?)?;
        // 1. Scores without a graph, as leaves the loss can be differentiated against.
        let want = batch.wanted();
        let n = want.from.len();
        let (lp, ent) = self.wanted_scores(&h_leaf.as_tensor().detach(), &want, 0..n, false)?;
        let shape = (batch.rows, batch.len);
        let lp_leaf = Var::from_tensor(&lay_out(&lp, want.at.clone(), shape)?)?;
        let ent_leaf = Var::from_tensor(&lay_out(&ent, want.at.clone(), shape)?)?;
        let l = loss(&Scored { logprobs: lp_leaf.as_tensor().clone(), entropy: ent_leaf.as_tensor().clone() })?;
        let value = l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        phase::add_seconds(Phase::Forward, forward_start.elapsed().as_secs_f64());
        let backward_start = std::time::Instant::now();
        let g = l.backward()?;
        // Each wanted position's gradient: the sum over the row positions that read it (the
        // extra slot n collects the unscored ones and is dropped).
        let at = Tensor::from_vec(want.at.clone(), want.at.len(), dev)?;
        let per_wanted = |leaf: &Var| -> Result<Tensor> {
            let zeros = Tensor::zeros(n + 1, candle_core::DType::F32, dev)?;
            Ok(match g.get(leaf.as_tensor()) {
                Some(gr) => zeros.index_add(&at, &gr.flatten_all()?, 0)?.narrow(0, 0, n)?,
                None => zeros.narrow(0, 0, n)?,
            })
        };
        let (g_lp, g_ent) = (per_wanted(&lp_leaf)?, per_wanted(&ent_leaf)?);
        drop(g);
        // 2. Chunk by chunk: d loss / d hidden and d loss / d lm_head.
        let head = self.model.lm_head.as_ref().unwrap_or(&self.model.embed_tokens);
        let mut grad_h = h_leaf.as_tensor().zeros_like()?;
        for c in self.chunks(n) {
            let (lp, ent) = self.wanted_scores(h_leaf.as_tensor(), &want, c.clone(), true)?;
            let (glp, gent) = (g_lp.narrow(0, c.start, c.len())?, g_ent.narrow(0, c.start, c.len())?);
            let surrogate = ((lp * glp)?.sum_all()? + (ent * gent)?.sum_all()?)?;
            let mut gs = surrogate.backward()?;
            if let Some(gh) = take_grad(&mut gs, h_leaf.as_tensor()) {
                grad_h = (grad_h + gh)?;
            }
            move_grads(grads, gs, [head])?;
        }
        // 3. Once through the model from the hidden states.
        backprop.backward(&self.model, &grad_h.reshape(pass_shape)?, grads)?;
        phase::add_seconds(Phase::Backward, backward_start.elapsed().as_secs_f64());
        Ok(value)
    }
}
