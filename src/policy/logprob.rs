//! Scoring packed sequences for training: per-token log-probs of the taken tokens and per-token
//! entropy, differentiable through the model's training path.
//!
//! Memory: the full-vocabulary logits exist only one sequence chunk at a time (at most
//! `LOGIT_CHUNK` floats) and are reduced to `[B, chunk]` at once. With gradients, autograd
//! still keeps each chunk's graph until `backward()`, so the trainer bounds memory with
//! micro-batches (`TokenBatch::split`) and sums their gradients (`accumulate_grads`). Without
//! gradients (`token_logprobs_no_grad`: old and reference log-probs) each chunk is freed at once.
use anyhow::{bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var, D};

use super::model::Mode;
use super::Policy;

/// Most full-vocabulary logits materialised at once (floats): 16 M = 64 MiB in f32.
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
        let m: Vec<f32> =
            (0..self.rows).flat_map(|r| (0..self.len).map(move |t| (t > 0 && t < self.lengths[r]) as u8 as f32)).collect();
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
        let (b, t) = (batch.rows, batch.len);
        let mask = batch.score_mask(dev)?;
        if t < 2 {
            return Ok(Scored { logprobs: mask.zeros_like()?, entropy: mask.zeros_like()? });
        }
        let ids = batch.ids_tensor(dev)?;
        let hidden = self.model.hidden(&ids, &vec![0; b], None, Mode::Train)?; // [B, T, H]
        let h = hidden.dim(2)?;
        let targets = ids.narrow(1, 1, t - 1)?.contiguous()?; // [B, T-1]: what position t-1 predicts
        let chunk = (LOGIT_CHUNK / (b * self.model.cfg.vocab_size)).max(1);
        let (mut lps, mut ents) = (vec![mask.narrow(1, 0, 1)?.zeros_like()?], vec![mask.narrow(1, 0, 1)?.zeros_like()?]);
        for s in (0..t - 1).step_by(chunk) {
            let c = chunk.min(t - 1 - s);
            let hc = hidden.narrow(1, s, c)?.reshape((b * c, h))?;
            let logp = candle_nn::ops::log_softmax(&self.model.logits(&hc)?, D::Minus1)?; // [B*c, V]
            let tgt = targets.narrow(1, s, c)?.reshape((b * c, 1))?;
            let lp = logp.gather(&tgt, 1)?.reshape((b, c))?;
            let ent = (logp.exp()? * &logp)?.sum(D::Minus1)?.neg()?.reshape((b, c))?;
            let (lp, ent) = if detach { (lp.detach(), ent.detach()) } else { (lp, ent) };
            lps.push(lp);
            ents.push(ent);
        }
        Ok(Scored { logprobs: (Tensor::cat(&lps, 1)? * &mask)?, entropy: (Tensor::cat(&ents, 1)? * &mask)? })
    }
}
