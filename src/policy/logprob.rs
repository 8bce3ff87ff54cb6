//! Scoring packed sequences for training: per-token log-probs of the taken tokens and per-token
//! entropy, differentiable through the model's training path.
//!
//! Memory: the full-vocabulary logits exist only one sequence chunk at a time (at most
//! `Policy::logit_chunk` floats) and are reduced to `[B, chunk]` at once. With gradients, autograd
//! still keeps each chunk's graph until `backward()`, so the trainer bounds memory with
//! micro-batches (`TokenBatch::split`) and sums their gradients (`accumulate_grads`), or calls
//! `loss_and_grads`, which keeps only one chunk's logits graph alive at a time. Without
//! gradients (`token_logprobs_no_grad`: old and reference log-probs) each chunk is freed at once.
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, D};

use super::model::Mode;
use super::Policy;

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
        Ok(Self { ids, rows: seqs.len(), len, lengths: seqs.iter().map(Vec::len).collect() })
    }

    pub fn ids_tensor(&self, dev: &Device) -> Result<Tensor> {
        Ok(Tensor::from_vec(self.ids.clone(), (self.rows, self.len), dev)?)
    }

    /// `[B, T]` f32: 1 where a position is scored (0 < t < length), else 0.
    pub fn score_mask(&self, dev: &Device) -> Result<Tensor> {
        let m: Vec<f32> = (0..self.rows)
            .flat_map(|r| (0..self.len).map(move |t| (t > 0 && t < self.lengths[r]) as u8 as f32))
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
                TokenBatch { ids, rows: r1 - r0, len, lengths: self.lengths[r0..r1].to_vec() }
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

/// Add `grads` into `acc` for every var: gradient accumulation over micro-batches.
pub fn accumulate_grads(acc: &mut Option<GradStore>, mut grads: GradStore, vars: &[Var]) -> Result<()> {
    let Some(acc) = acc else {
        *acc = Some(grads);
        return Ok(());
    };
    for v in vars {
        if let Some(g) = grads.remove(v.as_tensor()) {
            let sum = match acc.remove(v.as_tensor()) {
                Some(a) => (a + g)?,
                None => g,
            };
            acc.insert(v.as_tensor(), sum);
        }
    }
    Ok(())
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
        let dev = self.device();
        let mask = batch.score_mask(dev)?;
        if batch.len < 2 {
            return Ok(Scored { logprobs: mask.zeros_like()?, entropy: mask.zeros_like()? });
        }
        let ids = batch.ids_tensor(dev)?;
        let hidden = self.model.hidden(&ids, &vec![0; batch.rows], None, Mode::Train)?; // [B, T, H]
        let (mut lps, mut ents) = (vec![], vec![]);
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(&hidden, &ids, s, c)?;
            let (lp, ent) = if detach { (lp.detach(), ent.detach()) } else { (lp, ent) };
            lps.push(lp);
            ents.push(ent);
        }
        let first = mask.narrow(1, 0, 1)?.zeros_like()?; // position 0 predicts nothing
        lps.insert(0, first.clone());
        ents.insert(0, first);
        Ok(Scored { logprobs: (Tensor::cat(&lps, 1)? * &mask)?, entropy: (Tensor::cat(&ents, 1)? * &mask)? })
    }

    /// `(start, len)` of the sequence chunks over the T-1 predicting positions, sized so one
    /// chunk's logits hold at most `Policy::logit_chunk` floats.
    fn chunks(&self, batch: &TokenBatch) -> Vec<(usize, usize)> {
        let n = batch.len.saturating_sub(1);
        let chunk = (self.logit_chunk / (batch.rows * self.model.cfg.vocab_size).max(1)).max(1);
        (0..n).step_by(chunk).map(|s| (s, chunk.min(n - s))).collect()
    }

    /// Log-prob of the next token and entropy at positions `s..s+c`, each `[B, c]`.
    fn chunk_scores(&self, hidden: &Tensor, ids: &Tensor, s: usize, c: usize) -> Result<(Tensor, Tensor)> {
        let (b, _, h) = hidden.dims3()?;
        let hc = hidden.narrow(1, s, c)?.reshape((b * c, h))?;
        let logp = candle_nn::ops::log_softmax(&self.model.logits(&hc)?, D::Minus1)?; // [B*c, V]
        let tgt = ids.narrow(1, s + 1, c)?.contiguous()?.reshape((b * c, 1))?; // what position t predicts: ids[t+1]
        let lp = logp.gather(&tgt, 1)?.reshape((b, c))?;
        let ent = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?.reshape((b, c))?;
        Ok((lp, ent))
    }

    /// `loss(scores)` and the gradients of every weight, holding at most one chunk's
    /// full-vocabulary logits (and their graph) at a time: the scores are computed without a
    /// graph, the loss is differentiated w.r.t. them, then each chunk is recomputed and
    /// back-propagated to the final hidden states, which are back-propagated once through the
    /// model. Costs one extra lm_head forward; the gradients equal `loss(token_logprobs(b)).backward()`.
    pub fn loss_and_grads(
        &self,
        batch: &TokenBatch,
        loss: impl FnOnce(&Scored) -> Result<Tensor>,
    ) -> Result<(f32, GradStore)> {
        let dev = self.device();
        let mask = batch.score_mask(dev)?;
        let ids = batch.ids_tensor(dev)?;
        let hidden = self.model.hidden(&ids, &vec![0; batch.rows], None, Mode::Train)?; // [B, T, H]
        let h_leaf = Var::from_tensor(&hidden.detach())?;
        // 1. Scores without a graph, as leaves the loss can be differentiated against.
        let (mut lps, mut ents) =
            (vec![mask.narrow(1, 0, 1)?.zeros_like()?], vec![mask.narrow(1, 0, 1)?.zeros_like()?]);
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(&h_leaf.as_tensor().detach(), &ids, s, c)?;
            lps.push(lp.detach());
            ents.push(ent.detach());
        }
        let lp_leaf = Var::from_tensor(&(Tensor::cat(&lps, 1)? * &mask)?)?;
        let ent_leaf = Var::from_tensor(&(Tensor::cat(&ents, 1)? * &mask)?)?;
        let l = loss(&Scored { logprobs: lp_leaf.as_tensor().clone(), entropy: ent_leaf.as_tensor().clone() })?;
        let value = l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        let g = l.backward()?;
        let zeros = mask.zeros_like()?;
        let g_lp = (g.get(lp_leaf.as_tensor()).unwrap_or(&zeros) * &mask)?;
        let g_ent = (g.get(ent_leaf.as_tensor()).unwrap_or(&zeros) * &mask)?;
        drop(g);
        // 2. Chunk by chunk: d loss / d hidden and d loss / d lm_head.
        let head = self.model.lm_head.as_ref().unwrap_or(&self.model.embed_tokens);
        let mut grad_h = h_leaf.as_tensor().zeros_like()?;
        let mut grad_head: Option<Tensor> = None;
        for (s, c) in self.chunks(batch) {
            let (lp, ent) = self.chunk_scores(h_leaf.as_tensor(), &ids, s, c)?;
            let surrogate =
                ((lp * g_lp.narrow(1, s + 1, c)?)?.sum_all()? + (ent * g_ent.narrow(1, s + 1, c)?)?.sum_all()?)?;
            let gs = surrogate.backward()?;
            if let Some(gh) = gs.get(h_leaf.as_tensor()) {
                grad_h = (grad_h + gh)?;
            }
            if let Some(gw) = gs.get(head.as_tensor()) {
                grad_head = Some(match grad_head {
                    Some(acc) => (acc + gw)?,
                    None => gw.clone(),
                });
            }
        }
        // 3. Once through the model from the hidden states.
        let mut grads = (hidden * grad_h.detach())?.sum_all()?.backward()?;
        if let Some(gw) = grad_head {
            let total = match grads.remove(head.as_tensor()) {
                Some(g) => (g + gw)?,
                None => gw,
            };
            grads.insert(head.as_tensor(), total);
        }
        Ok((value, grads))
    }
}
