//! Scoring packed sequences for training: per-token log-probs of the taken tokens and per-token
//! entropy, differentiable through the model's training path.
//!
//! Memory: the full-vocabulary logits exist only one sequence chunk at a time (at most
//! `Policy::logit_chunk` floats) and are reduced to `[B, chunk]` at once. With gradients, autograd
//! would keep each chunk's graph until `backward()`, so the trainer calls `loss_and_grads`,
//! which keeps only one chunk's logits graph alive at a time and adds each micro-batch's
//! gradients into one store (micro-batches: `TokenBatch::split`). Without
//! gradients (`token_logprobs_no_grad`: old and reference log-probs) no graph is recorded at all
//! (`Mode::Score`): every activation is freed as soon as the next op has read it.
//!
//! Shared prefixes: a group's trajectories start with the same prompt. A batch whose rows agree
//! on their first `prefix` tokens (`TokenBatch::share_prefix`) runs those tokens once and the
//! rows' remainders against their keys and values; forward and backward cost the prefix once
//! instead of once per row, and the gradients are the same sums. Positions up to `prefix` are
//! then not scored (0), so a caller shares only tokens it does not train on.
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, D};

use super::kernels;
use super::model::Mode;
use super::Policy;
use crate::phase::{self, Phase};
use crate::policy::model::{move_grads, take_grad, Decoder};

/// Shared prefixes shorter than this run with every row (nothing worth saving).
const MIN_SHARED_PREFIX: usize = 4;

/// Default of `Policy::logit_chunk`: most full-vocabulary logits alive at once, 16 M floats = 64 MiB.
pub const LOGIT_CHUNK: usize = 1 << 24;

/// Right-padded token ids `[B, T]` with each row's real length.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// Row-major `[rows, len]`.
    pub ids: Vec<u32>,
    pub rows: usize,
    pub len: usize,
    pub lengths: Vec<usize>,
    /// Leading tokens that every row has in common and that run once for all of them
    /// (0: none). Positions up to and including `prefix` are not scored.
    pub prefix: usize,
}

impl TokenBatch {
    /// Pack sequences, padding on the right with `pad_id` to the longest.
    pub fn new(seqs: &[Vec<u32>], pad_id: u32) -> Result<Self> {
        let len = seqs.iter().map(Vec::len).max().unwrap_or(0);
        if let Some(i) = seqs.iter().position(Vec::is_empty) {
            bail!("sequence {i} is empty");
        }
        let mut ids = Vec::with_capacity(seqs.len() * len);
        for s in seqs {
            ids.extend_from_slice(s);
            ids.extend(std::iter::repeat_n(pad_id, len - s.len()));
        }
        Ok(Self { ids, rows: seqs.len(), len, lengths: seqs.iter().map(Vec::len).collect(), prefix: 0 })
    }

    /// Run the rows' common leading tokens once, as far as the scores are not needed: no
    /// position before `first_scored` is scored afterwards (the caller's first trained
    /// position, e.g. the first assistant token). Shares nothing for a single row or when the
    /// rows have too little in common.
    pub fn share_prefix(mut self, first_scored: usize) -> Self {
        let row = |r: usize| &self.ids[r * self.len..r * self.len + self.lengths[r]];
        let mut common = self.lengths.iter().copied().min().unwrap_or(0);
        for r in 1..self.rows {
            common = common.min(row(0).iter().zip(row(r)).take_while(|(a, b)| a == b).count());
        }
        // The last shared token runs with every row: its hidden state predicts the row's own next token.
        let prefix = common.min(first_scored).saturating_sub(1);
        // Every row keeps at least one token to score; below a few tokens sharing saves nothing.
        if self.rows > 1 && prefix >= MIN_SHARED_PREFIX && self.lengths.iter().all(|&l| l > prefix + 1) {
            self.prefix = prefix;
        }
        self
    }

    /// Token positions a forward pass computes: the shared prefix once, the rest per row.
    pub fn tokens_computed(&self) -> usize {
        self.prefix + self.rows * (self.len - self.prefix)
    }

    /// The rows' tokens after the shared prefix, `[B, len - prefix]`.
    pub(crate) fn own_ids_tensor(&self, dev: &Device) -> Result<Tensor> {
        let n = self.len - self.prefix;
        let ids: Vec<u32> = (0..self.rows)
            .flat_map(|r| self.ids[r * self.len + self.prefix..(r + 1) * self.len].iter().copied())
            .collect();
        Ok(Tensor::from_vec(ids, (self.rows, n), dev)?)
    }

    pub fn ids_tensor(&self, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.ids.clone(), (self.rows, self.len), dev)?)
    }

    /// `[B, T]` f32: 1 where a position is scored (prefix < t < length; prefix 0: 0 < t), else 0.
    pub fn score_mask(&self, dev: &Device) -> Result<Tensor> {
        let m: Vec<f32> = (0..self.rows)
            .flat_map(|r| (0..self.len).map(move |t| (t > self.prefix && t < self.lengths[r]) as u8 as f32))
            .collect();
        Ok(Tensor::from_vec(m, (self.rows, self.len), dev)?)
    }

    /// Micro-batches of at most `rows` rows, each trimmed to its own longest row.
    pub fn split(&self, rows: usize) -> Vec<TokenBatch> {
        let rows = rows.max(1);
        (0..self.rows)
            .step_by(rows)
            .map(|r0| {
                let r1 = (r0 + rows).min(self.rows);
                let len = self.lengths[r0..r1].iter().copied().max().unwrap_or(0);
                let ids = (r0..r1).flat_map(|r| self.ids[r * self.len..r * self.len + len].iter().copied()).collect();
                TokenBatch { ids, rows: r1 - r0, len, lengths: self.lengths[r0..r1].to_vec(), prefix: self.prefix }
            })
            .collect()
    }
}

/// Per-position scores, `[B, T]`: position t scores `ids[t]` given `ids[..t]`. Position 0 and
/// positions at or past a row's length hold 0.
pub struct Scored {
    pub logprobs: Tensor,
    pub entropy: Tensor,
}

/// The final hidden states of each row's own tokens (those after the shared prefix, which runs
/// once) and those tokens: `[B, S, H]` and `[B, S]`, S = len - prefix.
pub(crate) fn own_hidden(model: &Decoder, batch: &TokenBatch, mode: Mode) -> Result<(Tensor, Tensor)> {
    let ids = batch.own_ids_tensor(model.device())?;
    let hidden = if batch.prefix == 0 {
        model.hidden(&ids, &vec![0; batch.rows], None, mode)?
    } else {
        let prefix = model.prefix(&batch.ids[..batch.prefix], mode)?;
        model.hidden_after(&prefix, &ids, mode)?
    };
    Ok((hidden, ids))
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
        let mask = batch.score_mask(self.device())?;
        if batch.len < batch.prefix + 2 {
            return Ok(Scored { logprobs: mask.zeros_like()?, entropy: mask.zeros_like()? });
        }
        let mode = if detach { Mode::Score } else { Mode::Train };
        let (hidden, ids) = own_hidden(&self.model, batch, mode)?;
        let (mut lps, mut ents) = (vec![], vec![]);
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(&hidden, &ids, s, c, !detach)?;
            lps.push(lp);
            ents.push(ent);
        }
        self.assemble(batch, &mask, lps, ents)
    }

    /// Chunk scores (over the own tokens' predicting positions) laid out as `[B, len]`.
    fn assemble(
        &self,
        batch: &TokenBatch,
        mask: &Tensor,
        mut lps: Vec<Tensor>,
        mut ents: Vec<Tensor>,
    ) -> Result<Scored> {
        // Positions up to the prefix's last token predict nothing here.
        let first = mask.narrow(1, 0, batch.prefix + 1)?.zeros_like()?;
        lps.insert(0, first.clone());
        ents.insert(0, first);
        Ok(Scored { logprobs: (Tensor::cat(&lps, 1)? * mask)?, entropy: (Tensor::cat(&ents, 1)? * mask)? })
    }

    /// `(start, len)` of the sequence chunks over the predicting positions of the rows' own
    /// tokens, sized so one chunk's logits hold at most `Policy::logit_chunk` floats.
    fn chunks(&self, batch: &TokenBatch) -> Vec<(usize, usize)> {
        let n = (batch.len - batch.prefix).saturating_sub(1);
        let chunk = (self.logit_chunk / (batch.rows * self.model.cfg.vocab_size).max(1)).max(1);
        (0..n).step_by(chunk).map(|s| (s, chunk.min(n - s))).collect()
    }

    /// Log-prob of the next token and entropy at positions `s..s+c`, each `[B, c]`; with a
    /// graph through the output weights when `grad`.
    fn chunk_scores(&self, hidden: &Tensor, ids: &Tensor, s: usize, c: usize, grad: bool) -> Result<(Tensor, Tensor)> {
        let (b, _, h) = hidden.dims3()?;
        let hc = hidden.narrow(1, s, c)?.reshape((b * c, h))?;
        let logits = if grad { self.model.logits(&hc)? } else { self.model.logits_no_grad(&hc)? };
        let tgt = ids.narrow(1, s + 1, c)?.contiguous()?.reshape((b * c, 1))?; // what position t predicts: ids[t+1]
        if logits.device().is_cpu() {
            let both = kernels::token_scores(&logits, &tgt.flatten_all()?.to_vec1::<u32>()?, grad)?; // [B*c, 2]
            return Ok((both.narrow(1, 0, 1)?.reshape((b, c))?, both.narrow(1, 1, 1)?.reshape((b, c))?));
        }
        let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?; // [B*c, V]
        let lp = logp.gather(&tgt, 1)?.reshape((b, c))?;
        let ent = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?.reshape((b, c))?;
        Ok((lp, ent))
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
        let mask = batch.score_mask(self.device())?;
        let ids = batch.own_ids_tensor(self.device())?;
        let (hidden, backprop) = self.model.train_hidden(&batch.ids[..batch.prefix], &ids)?; // [B, S, H]
        let h_leaf = Var::from_tensor(&hidden)?;
        // 1. Scores without a graph, as leaves the loss can be differentiated against.
        let (mut lps, mut ents) = (vec![], vec![]);
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(&h_leaf.as_tensor().detach(), &ids, s, c, false)?;
            lps.push(lp);
            ents.push(ent);
        }
        let scored = self.assemble(batch, &mask, lps, ents)?;
        let lp_leaf = Var::from_tensor(&scored.logprobs)?;
        let ent_leaf = Var::from_tensor(&scored.entropy)?;
        let l = loss(&Scored { logprobs: lp_leaf.as_tensor().clone(), entropy: ent_leaf.as_tensor().clone() })?;
        let value = l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        phase::add_seconds(Phase::Forward, forward_start.elapsed().as_secs_f64());
        let backward_start = std::time::Instant::now();
        let g = l.backward()?;
        let zeros = mask.zeros_like()?;
        let g_lp = (g.get(lp_leaf.as_tensor()).unwrap_or(&zeros) * &mask)?;
        let g_ent = (g.get(ent_leaf.as_tensor()).unwrap_or(&zeros) * &mask)?;
        drop(g);
        // 2. Chunk by chunk: d loss / d hidden and d loss / d lm_head.
        let head = self.model.lm_head.as_ref().unwrap_or(&self.model.embed_tokens);
        let mut grad_h = h_leaf.as_tensor().zeros_like()?;
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(h_leaf.as_tensor(), &ids, s, c, true)?;
            // Own-token chunk position s + i scores batch position prefix + 1 + s + i.
            let at = batch.prefix + 1 + s;
            let surrogate =
                ((lp * g_lp.narrow(1, at, c)?)?.sum_all()? + (ent * g_ent.narrow(1, at, c)?)?.sum_all()?)?;
            let mut gs = surrogate.backward()?;
            if let Some(gh) = take_grad(&mut gs, h_leaf.as_tensor()) {
                grad_h = (grad_h + gh)?;
            }
            move_grads(grads, gs, [head])?;
        }
        // 3. Once through the model from the hidden states.
        backprop.backward(&self.model, &grad_h, grads)?;
        phase::add_seconds(Phase::Backward, backward_start.elapsed().as_secs_f64());
        Ok(value)
    }
}
