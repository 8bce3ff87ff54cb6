//! Fused CPU kernels with their own backward, for what candle only offers as a chain of
//! small ops (each keeping a full-size tensor alive for backward) or as a fused op that
//! silently cuts the graph (shared/notes/candle-cpu.md §1).
//!
//! - [`causal_softmax`]: the attention mask and the softmax in one pass over the scores; the
//!   backward keeps only the probabilities. [`tree_softmax`]: the same over a packed prefix
//!   tree, each position seeing its ancestors, for the whole tree or one block of its queries.
//! - [`token_scores`]: the log-prob of each row's target token and the entropy of its
//!   distribution, straight from the logits; the backward keeps only the logits (the composite
//!   log-softmax, exp and product keep five vocabulary-wide tensors, about a gigabyte per chunk).
//!   A position sampled under a constrained answer is scored over its allowed tokens only.
//! - [`rms_norm`]: RMSNorm in one pass per row; the backward recomputes the row's scale from
//!   the input (the composite keeps the square, the mean, the root and the quotient).
//! - [`rope`]: the rotary embedding with per-row positions as one rotation per pair; its
//!   backward is the inverse rotation (the composite narrows, negates and concatenates, and
//!   keeps each piece for backward).
//! - [`trained_project`]: `x Wᵀ` whose backward writes W's gradient in W's own layout, and
//!   skips it for a frozen W (LoRA's base). Through candle's matmul of `W.t()` the gradient
//!   passed through the transpose's backward (two more weight-sized copies, one strided), and
//!   was computed for a frozen weight all the same.
//! - [`swiglu`]: `silu(gate) ⊙ up` in one pass; the backward reads the two inputs once (the
//!   composite rebuilds the sigmoid out of five full-size tensors).
//!
//! Each is tested against the composite ops for values and gradients (tests/kernels.rs).
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

use super::tree::{QueryBlock, TreeLinks};

/// Softmax over the last axis of attention scores `[B, H, T, L]` (H any number of heads),
/// restricted to the keys each query may see: query j of batch row b sits at cache position
/// `offset + j` and sees key s when s ≤ offset + j and s is not padding (s ≥ `starts[b]`), and
/// always itself. Hidden keys get probability 0. Differentiable when `grad`.
pub fn causal_softmax(scores: &Tensor, offset: usize, starts: &[usize], grad: bool) -> Result<Tensor> {
    masked_softmax(scores, CausalSoftmax { offset, starts: starts.to_vec(), tree: None }, grad)
}

/// Softmax over the last axis of attention scores `[1, H, T, T]` of one packed prefix tree
/// (`tree::PrefixTree`): query i sees key j when j is i or one of its ancestors. Differentiable
/// when `grad`.
pub fn tree_softmax(scores: &Tensor, links: &Arc<TreeLinks>, grad: bool) -> Result<Tensor> {
    tree_block_softmax(scores, links, &QueryBlock::whole(links.len()), grad)
}

/// [`tree_softmax`] for one block of queries: scores `[1, H, block's nodes, block's keys]`.
pub fn tree_block_softmax(scores: &Tensor, links: &Arc<TreeLinks>, block: &QueryBlock, grad: bool) -> Result<Tensor> {
    let tree = Some((links.clone(), block.clone()));
    masked_softmax(scores, CausalSoftmax { offset: 0, starts: vec![0], tree }, grad)
}

fn masked_softmax(scores: &Tensor, op: CausalSoftmax, grad: bool) -> Result<Tensor> {
    let scores = scores.contiguous()?;
    if grad {
        scores.apply_op1(op)
    } else {
        scores.apply_op1_no_bwd(&op)
    }
}

/// `x Wᵀ` (`x` `[N, in]`, `w` `[out, in]`) as one op, differentiable in `x`, and in `w` when it
/// records a graph. The backward computes `dx = dy W` and `dW = dyᵀ x` straight into W's
/// layout. Through candle's matmul of the transposed view, W's gradient came out `[in, out]` and
/// went through the transpose's backward (two more weight-sized zero-and-add copies, one of
/// them strided), and a frozen W's gradient was computed all the same.
pub fn trained_project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if cfg!(feature = "mkl") && w.track_op() {
        return project(x, w); // MKL's GEMM runs under candle's matmul only
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Project)
}

struct Project;

/// `dst = lhs · rhs` for `(m, n, k)`, each operand given with its (row, column) strides.
fn gemm_f32(
    (m, n, k): (usize, usize, usize),
    dst: &mut [f32],
    (dst_rs, dst_cs): (usize, usize),
    (lhs, lhs_rs, lhs_cs): (&[f32], usize, usize),
    (rhs, rhs_rs, rhs_cs): (&[f32], usize, usize),
) {
    let last = |rows: usize, cols: usize, rs: usize, cs: usize| (rows.max(1) - 1) * rs + (cols.max(1) - 1) * cs;
    assert!(
        dst.len() > last(m, n, dst_rs, dst_cs)
            && lhs.len() > last(m, k, lhs_rs, lhs_cs)
            && rhs.len() > last(k, n, rhs_rs, rhs_cs),
        "gemm operands smaller than their shapes"
    );
    let threads = candle_core::utils::get_num_threads(); // as candle's matmul: the same values
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: every index the strides reach is inside its slice (checked above).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            dst_cs as isize,
            dst_rs as isize,
            false,
            lhs.as_ptr(),
            lhs_cs as isize,
            lhs_rs as isize,
            rhs.as_ptr(),
            rhs_cs as isize,
            rhs_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

impl CustomOp2 for Project {
    fn name(&self) -> &'static str {
        "project"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let ((n, k), (m, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
        if k != k2 {
            candle_core::bail!("project: x {:?} against a weight {:?}", l1.shape(), l2.shape());
        }
        let (x, w) = (f32_slice(s1, l1, "project")?, f32_slice(s2, l2, "project")?);
        let mut y = vec![0f32; n * m];
        if y.is_empty() || k == 0 {
            return Ok((CpuStorage::F32(y), Shape::from((n, m))));
        }
        if n > FEW_ROWS {
            // y [n, m] = x [n, k] · wᵀ [k, m], as candle's `x.matmul(&w.t())` runs it.
            gemm_f32((n, m, k), &mut y, (m, 1), (x, k, 1), (w, 1, k));
        } else {
            // yᵀ [m, n] = w [m, k] · xᵀ [k, n], as `project` runs few rows, then laid out.
            let mut yt = vec![0f32; n * m];
            gemm_f32((m, n, k), &mut yt, (n, 1), (w, k, 1), (x, 1, k));
            for (i, row) in yt.chunks(n).enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    y[j * m + i] = v;
                }
            }
        }
        Ok((CpuStorage::F32(y), Shape::from((n, m))))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dx = dy.matmul(&w.detach())?;
        let dw = if w.track_op() { Some(dy.t()?.matmul(&x.detach())?) } else { None };
        Ok((Some(dx), dw))
    }
}

/// `x / sqrt(mean(x²) + eps) ⊙ w` over the last axis (`x` `[N, H]`, `w` `[H]`), differentiable
/// in both when `grad` (the weight only when it records a graph).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f32, grad: bool) -> Result<Tensor> {
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    if grad {
        x.apply_op2(&w, RmsNorm { eps })
    } else {
        x.apply_op2_no_bwd(&w, &RmsNorm { eps })
    }
}

struct RmsNorm {
    eps: f32,
}

impl RmsNorm {
    /// 1 / sqrt(mean(x²) + eps) of one row.
    fn scale(&self, x: &[f32]) -> f32 {
        let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        1.0 / (ms + self.eps).sqrt()
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let h = l1.shape().dims().last().copied().unwrap_or(1).max(1);
        let (x, w) = (f32_slice(s1, l1, "rms-norm")?, f32_slice(s2, l2, "rms-norm")?);
        if w.len() != h {
            candle_core::bail!("rms-norm: a weight of {} for rows of {h}", w.len());
        }
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(h).zip(x.par_chunks(h)).for_each(|(y, x)| {
            let r = self.scale(x);
            for ((o, &v), &g) in y.iter_mut().zip(x).zip(w) {
                *o = v * r * g;
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// With r = 1/sqrt(mean(x²)+eps): dx = r·(dy⊙w) − x·r³·Σ(dy⊙w⊙x)/H, dw = Σ_rows dy⊙x·r.
    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let h = w.elem_count();
        let dy = dy.contiguous()?;
        let want_dw = w.track_op();
        let (dx, dw) = with_cpu_slices([x, w, &dy], "rms-norm", |[x_, w_, g_]| {
            let mut dx = vec![0f32; x_.len()];
            // Rows in blocks, each block summing its own dw (one vector per block, not per row).
            let block = 64 * h;
            let dw = dx
                .par_chunks_mut(block)
                .zip(x_.par_chunks(block).zip(g_.par_chunks(block)))
                .map(|(dx, (x, g))| {
                    let mut dw = vec![0f32; if want_dw { h } else { 0 }];
                    for (dx, (x, g)) in dx.chunks_mut(h).zip(x.chunks(h).zip(g.chunks(h))) {
                        let r = self.scale(x);
                        let dot: f32 = g.iter().zip(w_).zip(x).map(|((g, w), x)| g * w * x).sum();
                        let c = r * r * r * dot / h as f32;
                        for (((d, &g), &w), &x) in dx.iter_mut().zip(g).zip(w_).zip(x) {
                            *d = r * g * w - x * c;
                        }
                        for ((d, &g), &x) in dw.iter_mut().zip(g).zip(x) {
                            *d += g * x * r;
                        }
                    }
                    dw
                })
                .reduce(Vec::new, |a, b| match (a.is_empty(), b.is_empty()) {
                    (true, _) => b,
                    (_, true) => a,
                    _ => a.iter().zip(&b).map(|(a, b)| a + b).collect(),
                });
            Ok((dx, dw))
        })?;
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        let dw = if want_dw { Some(Tensor::from_vec(dw, w.shape(), w.device())?) } else { None };
        Ok((Some(dx), dw))
    }
}

/// SwiGLU's gate: `silu(gate) ⊙ up` (both `[N, I]`) in one pass, differentiable in both when
/// `grad`. The composite keeps silu's output and, in its backward, builds the sigmoid again out
/// of five full-size tensors; this backward reads the two inputs once.
pub fn swiglu(gate: &Tensor, up: &Tensor, grad: bool) -> Result<Tensor> {
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    if grad {
        gate.apply_op2(&up, SwiGlu)
    } else {
        gate.apply_op2_no_bwd(&up, &SwiGlu)
    }
}

struct SwiGlu;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// As candle computes it, so that every mode's values agree bit for bit.
fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `f` over the f32 data of contiguous CPU tensors (a backward written over slices).
fn with_cpu_slices<R, const N: usize>(
    tensors: [&Tensor; N],
    what: &str,
    f: impl FnOnce([&[f32]; N]) -> Result<R>,
) -> Result<R> {
    let guards = tensors.map(|t| t.storage_and_layout());
    let mut slices: [&[f32]; N] = [&[]; N];
    for (slice, (storage, layout)) in slices.iter_mut().zip(&guards) {
        *slice = match &**storage {
            Storage::Cpu(cpu) => f32_slice(cpu, layout, what)?,
            _ => candle_core::bail!("{what}: expected CPU tensors"),
        };
    }
    f(slices)
}

/// Slices of `a` and `b`'s storage, which must be f32 CPU tensors of the same shape.
fn same_shape_slices<'a>(
    (s1, l1): (&'a CpuStorage, &Layout),
    (s2, l2): (&'a CpuStorage, &Layout),
    what: &str,
) -> Result<(&'a [f32], &'a [f32])> {
    if l1.shape() != l2.shape() {
        candle_core::bail!("{what}: shapes {:?} and {:?} differ", l1.shape(), l2.shape());
    }
    Ok((f32_slice(s1, l1, what)?, f32_slice(s2, l2, what)?))
}

/// Elementwise work in chunks large enough to be worth a thread.
const ELEMENTWISE_CHUNK: usize = 1 << 14;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let (g, u) = same_shape_slices((s1, l1), (s2, l2), "swiglu")?;
        let mut y = vec![0f32; g.len()];
        y.par_chunks_mut(ELEMENTWISE_CHUNK)
            .zip(g.par_chunks(ELEMENTWISE_CHUNK).zip(u.par_chunks(ELEMENTWISE_CHUNK)))
            .for_each(|(y, (g, u))| {
                for ((o, &g), &u) in y.iter_mut().zip(g).zip(u) {
                    *o = silu(g) * u;
                }
            });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// With s = sigmoid(g): d gate = dy·u·s·(1 + g·(1 − s)), d up = dy·g·s.
    fn bwd(&self, gate: &Tensor, up: &Tensor, _y: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dy.contiguous()?;
        if gate.shape() != up.shape() || up.shape() != dy.shape() {
            candle_core::bail!("swiglu: shapes {:?}, {:?} and {:?} differ", gate.shape(), up.shape(), dy.shape());
        }
        let (dg, du) = with_cpu_slices([gate, up, &dy], "swiglu", |[g, u, d]| {
            let (mut dg, mut du) = (vec![0f32; g.len()], vec![0f32; g.len()]);
            let c = ELEMENTWISE_CHUNK;
            dg.par_chunks_mut(c)
                .zip(du.par_chunks_mut(c))
                .zip(g.par_chunks(c).zip(u.par_chunks(c)).zip(d.par_chunks(c)))
                .for_each(|((dg, du), ((g, u), d))| {
                    for i in 0..g.len() {
                        let s = sigmoid(g[i]);
                        dg[i] = d[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
                        du[i] = d[i] * g[i] * s;
                    }
                });
            Ok((dg, du))
        })?;
        Ok((
            Some(Tensor::from_vec(dg, gate.shape(), gate.device())?),
            Some(Tensor::from_vec(du, up.shape(), up.device())?),
        ))
    }
}

/// Rotary embedding in the NeoX/HF "rotate_half" layout: `x` `[B, n, T, hd]` rotated by the
/// angles whose cosines and sines are `cos`, `sin` `[B, T, hd/2]` (each batch row its own
/// positions). Differentiable in `x` when `grad`.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, grad: bool) -> Result<Tensor> {
    let (x, cos, sin) = (x.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    if grad {
        x.apply_op3(&cos, &sin, Rope)
    } else {
        x.apply_op3_no_bwd(&cos, &sin, &Rope)
    }
}

struct Rope;

impl CustomOp3 for Rope {
    fn name(&self) -> &'static str {
        "rope"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (b, n, t, hd) = l1.shape().dims4()?;
        let half = hd / 2;
        if l2.shape().dims() != [b, t, half] || l3.shape() != l2.shape() {
            candle_core::bail!("rope: tables {:?} / {:?} for x {:?}", l2.shape(), l3.shape(), l1.shape());
        }
        let (x, cos, sin) = (f32_slice(s1, l1, "rope")?, f32_slice(s2, l2, "rope")?, f32_slice(s3, l3, "rope")?);
        let mut y = vec![0f32; x.len()];
        y.par_chunks_mut(hd).zip(x.par_chunks(hd)).enumerate().for_each(|(r, (y, x))| {
            // Row r is (batch r / (n t), head, position r % t).
            let at = ((r / (n * t)) * t + r % t) * half;
            let (c, s) = (&cos[at..at + half], &sin[at..at + half]);
            let (x1, x2) = x.split_at(half);
            let (y1, y2) = y.split_at_mut(half);
            for i in 0..half {
                y1[i] = x1[i] * c[i] - x2[i] * s[i];
                y2[i] = x2[i] * c[i] + x1[i] * s[i];
            }
        });
        Ok((CpuStorage::F32(y), l1.shape().clone()))
    }

    /// The inverse rotation: the same op with the sines negated.
    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((Some(dy.contiguous()?.apply_op3_no_bwd(cos, &sin.neg()?, &Rope)?), None, None))
    }
}

/// Per row of `logits` `[N, V]`: the log-probability of token `targets[n]` and the entropy
/// −Σ p log p, as `[N, 2]`. A row with an `allowed` list scores the distribution renormalised
/// over those tokens (what a constrained sampler drew from); the others the whole vocabulary.
/// `allowed` is empty or one entry per row. Differentiable in the logits when `grad`.
pub fn token_scores(logits: &Tensor, targets: &[u32], allowed: &[Allowed], grad: bool) -> Result<Tensor> {
    let op = TokenScores { targets: targets.to_vec(), allowed: allowed.to_vec() };
    let logits = logits.contiguous()?;
    if grad {
        logits.apply_op1(op)
    } else {
        logits.apply_op1_no_bwd(&op)
    }
}

/// The token ids a position's distribution is restricted to (`None`: the whole vocabulary).
pub type Allowed = Option<Arc<[u32]>>;

struct TokenScores {
    targets: Vec<u32>,
    allowed: Vec<Allowed>,
}

impl CustomOp1 for TokenScores {
    fn name(&self) -> &'static str {
        "token-scores"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (n, v) = layout.shape().dims2()?;
        self.check(n, v)?;
        let z = f32_slice(storage, layout, "token-scores")?;
        let mut out = vec![0f32; 2 * n];
        out.par_chunks_mut(2).zip(z.par_chunks(v)).enumerate().for_each(|(r, (o, z))| {
            let t = self.targets[r] as usize;
            let (lse, mean_z) = match self.allowed_of(r) {
                Some(ids) => moments(ids.iter().map(|&j| z[j as usize])),
                None => moments(z.iter().copied()),
            };
            o[0] = (z[t] as f64 - lse) as f32;
            o[1] = (lse - mean_z) as f32; // H = lse − E_p[z]
        });
        Ok((CpuStorage::F32(out), Shape::from((n, 2))))
    }

    /// d lp / dz_j = [j = t] − p_j and d H / dz_j = −p_j (log p_j + H), with log p_j = z_j − lse
    /// and lse = z_t − lp read back from the forward's output; p_j = 0 off a row's allowed list.
    fn bwd(&self, logits: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let (n, v) = logits.dims2()?;
        let res = res.flatten_all()?.to_vec1::<f32>()?;
        let g = grad_res.flatten_all()?.to_vec1::<f32>()?;
        let (storage, layout) = logits.storage_and_layout();
        let z = match &*storage {
            Storage::Cpu(s) => f32_slice(s, layout, "token-scores backward")?,
            _ => candle_core::bail!("token-scores: expected CPU logits"),
        };
        let mut dz = vec![0f32; n * v];
        dz.par_chunks_mut(v).zip(z.par_chunks(v)).enumerate().for_each(|(r, (dz, z))| {
            let t = self.targets[r] as usize;
            let (lp, h, g_lp, g_h) = (res[2 * r], res[2 * r + 1], g[2 * r], g[2 * r + 1]);
            let lse = z[t] - lp;
            let grad = |x: f32| {
                let logp = x - lse;
                let p = logp.exp();
                -g_lp * p - g_h * p * (logp + h)
            };
            match self.allowed_of(r) {
                Some(ids) => ids.iter().for_each(|&j| dz[j as usize] = grad(z[j as usize])),
                None => dz.iter_mut().zip(z).for_each(|(d, &x)| *d = grad(x)),
            }
            dz[t] += g_lp;
        });
        Ok(Some(Tensor::from_vec(dz, (n, v), logits.device())?))
    }
}

/// log Σ e^z and the mean of z under softmax(z), in one pass (f64 over a vocabulary-long row).
fn moments(z: impl Iterator<Item = f32> + Clone) -> (f64, f64) {
    let max = z.clone().fold(f32::NEG_INFINITY, f32::max);
    let (mut sum, mut weighted) = (0f64, 0f64);
    for x in z {
        let e = (x - max).exp() as f64;
        sum += e;
        weighted += e * x as f64;
    }
    (max as f64 + sum.ln(), weighted / sum)
}

impl TokenScores {
    fn allowed_of(&self, row: usize) -> Option<&[u32]> {
        self.allowed.get(row).and_then(|a| a.as_deref())
    }

    fn check(&self, n: usize, v: usize) -> Result<()> {
        if self.targets.len() != n {
            candle_core::bail!("token-scores: {} targets for {n} rows", self.targets.len());
        }
        if let Some(&t) = self.targets.iter().find(|&&t| t as usize >= v) {
            candle_core::bail!("token-scores: target {t} outside a vocabulary of {v}");
        }
        if !self.allowed.is_empty() && self.allowed.len() != n {
            candle_core::bail!("token-scores: {} allowed lists for {n} rows", self.allowed.len());
        }
        for (r, ids) in (0..n).filter_map(|r| self.allowed_of(r).map(|a| (r, a))) {
            if let Some(&j) = ids.iter().find(|&&j| j as usize >= v) {
                candle_core::bail!("token-scores: allowed token {j} outside a vocabulary of {v}");
            }
            if !ids.contains(&self.targets[r]) {
                candle_core::bail!(
                    "token-scores: row {r}'s target {} is not among its allowed tokens",
                    self.targets[r]
                );
            }
        }
        Ok(())
    }
}

struct CausalSoftmax {
    offset: usize,
    starts: Vec<usize>,
    /// One packed prefix tree instead of causal rows: the queries and keys of the scores.
    tree: Option<(Arc<TreeLinks>, QueryBlock)>,
}

/// Softmax of `x` over the key ranges `ranges` into `y` (0 elsewhere, as `y` comes).
fn softmax_over(x: &[f32], y: &mut [f32], ranges: impl Iterator<Item = (usize, usize)> + Clone) {
    let max = ranges.clone().flat_map(|(a, b)| x[a..=b].iter().copied()).fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for (a, b) in ranges.clone() {
        for (o, &v) in y[a..=b].iter_mut().zip(&x[a..=b]) {
            *o = (v - max).exp();
            sum += *o;
        }
    }
    let inv = 1.0 / sum;
    for (a, b) in ranges {
        y[a..=b].iter_mut().for_each(|o| *o *= inv);
    }
}

fn f32_slice<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((a, b))) => Ok(&x[a..b]),
        _ => candle_core::bail!("{what}: expected a contiguous f32 tensor"),
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "causal-softmax"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let (b, h, t, l) = layout.shape().dims4()?;
        let x = f32_slice(storage, layout, "causal-softmax")?;
        let mut y = vec![0f32; x.len()];
        if let Some((tree, block)) = &self.tree {
            if b != 1 || t != block.end - block.start || l != block.key_count() || block.end > tree.len() {
                candle_core::bail!(
                    "tree-softmax: scores {:?} for nodes {}..{} seeing {} keys of a tree of {}",
                    layout.shape(),
                    block.start,
                    block.end,
                    block.key_count(),
                    tree.len()
                );
            }
            y.par_chunks_mut(l).zip(x.par_chunks(l)).enumerate().for_each(|(r, (y, x))| {
                let seen = tree.visible(block.start + r % t).map(|(from, to)| {
                    let k = block.key_index(from);
                    (k, k + to - from)
                });
                softmax_over(x, y, seen);
            });
            return Ok((CpuStorage::F32(y), layout.shape().clone()));
        }
        if self.starts.len() != b {
            candle_core::bail!("causal-softmax: {} row starts for a batch of {b}", self.starts.len());
        }
        if self.offset + t > l {
            candle_core::bail!(
                "causal-softmax: {t} queries at offset {} need {} keys, got {l}",
                self.offset,
                self.offset + t
            );
        }
        y.par_chunks_mut(l).zip(x.par_chunks(l)).enumerate().for_each(|(r, (y, x))| {
            let q = self.offset + r % t;
            // Keys start..=q are visible (padding before `start`; a padding query sees itself).
            let start = self.starts[r / (h * t)].min(q);
            softmax_over(x, y, std::iter::once((start, q)));
        });
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad_res.contiguous()?, &SoftmaxGrad)?))
    }
}

/// dx = y ⊙ (dy − Σ dy ⊙ y) over the last axis, from the softmax's output y and its gradient dy.
struct SoftmaxGrad;

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "softmax-grad"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let l = l1.shape().dims().last().copied().unwrap_or(1).max(1);
        if l1.shape() != l2.shape() {
            candle_core::bail!("softmax-grad: shapes {:?} and {:?} differ", l1.shape(), l2.shape());
        }
        let (y, dy) = (f32_slice(s1, l1, "softmax-grad")?, f32_slice(s2, l2, "softmax-grad")?);
        let mut dx = vec![0f32; y.len()];
        dx.par_chunks_mut(l).zip(y.par_chunks(l).zip(dy.par_chunks(l))).for_each(|(dx, (y, dy))| {
            let dot: f32 = y.iter().zip(dy).map(|(a, b)| a * b).sum();
            for ((o, &y), &dy) in dx.iter_mut().zip(y).zip(dy) {
                *o = y * (dy - dot);
            }
        });
        Ok((CpuStorage::F32(dx), l1.shape().clone()))
    }
}

/// Rows up to which [`project`] multiplies as `(W xᵀ)ᵀ`.
const FEW_ROWS: usize = 256;

/// `x Wᵀ` for `W` stored `[out, in]`. gemm re-packs the transposed weight on every call, which
/// for a few rows (decoding, short prefixes) costs more than the product: with W as the
/// left-hand side it streams W as stored, 1.5–5× faster at 16–128 rows here (docs/models.md).
/// # Shapes
/// x: [N, in], w: [out, in] → [N, out]
pub(crate) fn project(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if x.dim(0)? <= FEW_ROWS {
        Ok(w.matmul(&x.t()?)?.t()?)
    } else {
        Ok(x.matmul(&w.t()?)?)
    }
}
