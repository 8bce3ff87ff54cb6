//! AdamW (Loshchilov & Hutter 2019, as torch.optim.AdamW) over named candle `Var`s, with global
//! grad-norm clipping and its state saved to / loaded from safetensors so a resumed run continues
//! exactly. (candle-nn's AdamW keeps its moments private, so it cannot be checkpointed.)
//!
//! On the CPU each weight is updated in place in one pass over (weight, m, v, gradient), split
//! across threads: no temporaries, where the same math as tensor ops (the other devices' path)
//! allocates ten weight-sized tensors per weight per step.
use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, DType, Device, Layout, Storage, Tensor, Var};
use rayon::prelude::*;

use super::settings::Optim;

pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimiser steps taken (bias correction uses it).
    pub t: u64,
    /// Steps over which the learning rate rises linearly to `lr` (`optim.warmup_steps`).
    warmup: u64,
    params: Vec<(String, Var, Var, Var)>, // (name, param, m, v)
}

impl AdamW {
    pub fn new(named: Vec<(String, Var)>, lr: f64, s: &Optim) -> Result<Self> {
        let params = named
            .into_iter()
            .map(|(n, v)| {
                let m = Var::zeros(v.shape(), v.dtype(), v.device())?;
                let s2 = Var::zeros(v.shape(), v.dtype(), v.device())?;
                Ok((n, v, m, s2))
            })
            .collect::<Result<_>>()?;
        let (beta1, beta2, eps, weight_decay) = (s.beta1, s.beta2, s.eps, s.weight_decay);
        Ok(Self { lr, beta1, beta2, eps, weight_decay, t: 0, warmup: s.warmup_steps as u64, params })
    }

    /// The rate of step `t` (the last one taken, or the first before any): `lr`, scaled by
    /// the warm-up's share while it lasts.
    pub fn current_lr(&self) -> f64 {
        self.lr * (self.t.max(1) as f64 / self.warmup.max(1) as f64).min(1.0)
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.1.clone()).collect()
    }

    /// The global L2 norm of the gradients of our vars.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        let mut sq = 0.0f64;
        for (_, v, _, _) in &self.params {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += match cpu_f32(g, |x| {
                    x.par_chunks(1 << 16).map(|c| c.iter().map(|&e| (e as f64) * (e as f64)).sum::<f64>()).sum::<f64>()
                }) {
                    Some(s) => s,
                    None => g.sqr()?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?,
                };
            }
        }
        Ok(sq.sqrt())
    }

    /// One step: clip the global grad norm to `max_norm` (0 = off), then AdamW. Returns the
    /// norm before clipping.
    pub fn step(&mut self, grads: &GradStore, max_norm: f64) -> Result<f64> {
        let norm = self.grad_norm(grads)?;
        let scale = if max_norm > 0.0 && norm > max_norm { max_norm / (norm + 1e-6) } else { 1.0 };
        self.t += 1;
        // Adam's first steps are its largest (m̂/√v̂ = ±1 on step 1, whatever the gradient's
        // noise), so a noisy early gradient moves every weight by the full rate: warm-up
        // shrinks them until the moments average over a few steps.
        let lr = self.current_lr();
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2 = 1.0 - b2.powi(self.t as i32);
        let fused = FusedStep {
            beta1: b1 as f32,
            beta2: b2 as f32,
            scale: scale as f32,
            lr: lr as f32,
            decay: (1.0 - lr * self.weight_decay) as f32,
            bc1: bc1 as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
        };
        for (_, p, m, v) in &self.params {
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            if fused.applies(p.as_tensor(), m.as_tensor(), v.as_tensor(), g) {
                fused.apply(p.as_tensor(), m.as_tensor(), v.as_tensor(), g)?;
                continue;
            }
            let g = (g * scale)?;
            let m_new = ((m.as_tensor() * b1)? + (&g * (1.0 - b1))?)?;
            let v_new = ((v.as_tensor() * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&m_new / bc1)?;
            let v_hat = (&v_new / bc2)?;
            let decayed = (p.as_tensor() * (1.0 - lr * self.weight_decay))?;
            let update = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            p.set(&(decayed - (update * lr)?)?)?;
            m.set(&m_new)?;
            v.set(&v_new)?;
        }
        Ok(norm)
    }

    /// Save the moments (`m.<name>`, `v.<name>`) and the step count.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut t: HashMap<String, Tensor> = HashMap::new();
        for (n, _, m, v) in &self.params {
            t.insert(format!("m.{n}"), m.as_tensor().clone());
            t.insert(format!("v.{n}"), v.as_tensor().clone());
        }
        t.insert("step".into(), Tensor::new(&[self.t as f32], &Device::Cpu)?);
        candle_core::safetensors::save(&t, path).with_context(|| format!("writing {}", path.display()))
    }

    /// Load what `save` wrote; every var must be present.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let dev = self.params.first().map(|p| p.1.device().clone()).unwrap_or(Device::Cpu);
        let t = candle_core::safetensors::load(path, &dev).with_context(|| format!("reading {}", path.display()))?;
        let get = |k: &str| t.get(k).ok_or_else(|| anyhow!("{}: missing optimizer tensor {k}", path.display()));
        for (n, _, m, v) in &self.params {
            m.set(get(&format!("m.{n}"))?)?;
            v.set(get(&format!("v.{n}"))?)?;
        }
        self.t = get("step")?.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0] as u64;
        Ok(())
    }
}

/// `f` over a contiguous f32 CPU tensor's elements; `None` for any other tensor.
fn cpu_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Option<T> {
    let (storage, layout) = t.storage_and_layout();
    let (start, end) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(x)) => Some(f(&x[start..end])),
        _ => None,
    }
}

/// One AdamW step's constants, for the in-place CPU update.
#[derive(Clone, Copy)]
struct FusedStep {
    beta1: f32,
    beta2: f32,
    /// Gradient scale from norm clipping.
    scale: f32,
    lr: f32,
    /// 1 − lr·weight_decay.
    decay: f32,
    bc1: f32,
    bc2_sqrt: f32,
    eps: f32,
}

/// Elements per thread task.
const CHUNK: usize = 1 << 15;

impl FusedStep {
    fn applies(&self, p: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor) -> bool {
        [p, m, v, g].iter().all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
            && g.dims() == p.dims()
    }

    /// m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²; p ← p·(1−lr·wd) − lr·m̂/(√v̂ + ε), in place.
    fn apply(self, p: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor) -> Result<()> {
        m.inplace_op2(g, &Moment { step: self, second: false })?;
        v.inplace_op2(g, &Moment { step: self, second: true })?;
        p.inplace_op3(m, v, &Apply { step: self })?;
        Ok(())
    }
}

/// A contiguous f32 slice of a CPU storage.
fn slice<'a>(s: &'a CpuStorage, l: &Layout) -> candle_core::Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((a, b))) => Ok(&x[a..b]),
        _ => candle_core::bail!("adamw: expected a contiguous f32 tensor"),
    }
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> candle_core::Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(x), Some((a, b))) => Ok(&mut x[a..b]),
        _ => candle_core::bail!("adamw: expected a contiguous f32 tensor"),
    }
}

/// One moment's running average, in place: m ← β1·m + (1−β1)·g, or with `second`
/// v ← β2·v + (1−β2)·g² (g already scaled by the clipping factor).
struct Moment {
    step: FusedStep,
    second: bool,
}

impl candle_core::InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dst_l: &Layout, g: &CpuStorage, gl: &Layout) -> candle_core::Result<()> {
        let (beta, sc, second) =
            (if self.second { self.step.beta2 } else { self.step.beta1 }, self.step.scale, self.second);
        let (m, g) = (slice_mut(dst, dst_l)?, slice(g, gl)?);
        m.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).for_each(|(m, g)| {
            for (m, &g) in m.iter_mut().zip(g) {
                let g = g * sc;
                *m = beta * *m + (1.0 - beta) * if second { g * g } else { g };
            }
        });
        Ok(())
    }
}

struct Apply {
    step: FusedStep,
}

impl candle_core::InplaceOp3 for Apply {
    fn name(&self) -> &'static str {
        "adamw-apply"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        m: &CpuStorage,
        ml: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> candle_core::Result<()> {
        let s = self.step;
        let (p, m, v) = (slice_mut(dst, dst_l)?, slice(m, ml)?, slice(v, vl)?);
        p.par_chunks_mut(CHUNK).zip(m.par_chunks(CHUNK)).zip(v.par_chunks(CHUNK)).for_each(|((p, m), v)| {
            for ((p, &m), &v) in p.iter_mut().zip(m).zip(v) {
                let update = (m / s.bc1) / (v.sqrt() / s.bc2_sqrt + s.eps);
                *p = *p * s.decay - s.lr * update;
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_step_moves_each_weight_by_lr_against_the_gradient_sign() {
        // torch.optim.AdamW, step 1: m̂ = g, v̂ = g², update = g/(|g| + eps) ≈ sign(g);
        // p ← p·(1 − lr·wd) − lr·sign(g). p = [1, −2], g = [0.5, −3], lr = 0.1, wd = 0.01:
        // [1·0.999 − 0.1, −2·0.999 + 0.1] = [0.899, −1.898]
        let p = Var::new(&[1.0f32, -2.0], &Device::Cpu).unwrap();
        let s = Optim { weight_decay: 0.01, ..Optim::default() };
        let mut opt = AdamW::new(vec![("w".into(), p.clone())], 0.1, &s).unwrap();
        let loss = (p.as_tensor() * &Tensor::new(&[0.5f32, -3.0], &Device::Cpu).unwrap()).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let norm = opt.step(&grads, 0.0).unwrap();
        assert!((norm - (0.25f64 + 9.0).sqrt()).abs() < 1e-5);
        let got = p.as_tensor().to_vec1::<f32>().unwrap();
        assert!((got[0] - 0.899).abs() < 1e-5 && (got[1] + 1.898).abs() < 1e-5, "{got:?}");
    }

    #[test]
    fn warm_up_scales_the_first_steps_by_their_share_of_it() {
        // No decay, a constant gradient: Adam's update is −lr·sign(g) every step, so the steps
        // are lr/4, 2·lr/4, 3·lr/4, then lr.
        let p = Var::new(&[0.0f32], &Device::Cpu).unwrap();
        let s = Optim { weight_decay: 0.0, warmup_steps: 4, ..Optim::default() };
        let mut opt = AdamW::new(vec![("w".into(), p.clone())], 0.1, &s).unwrap();
        let mut was = 0.0f32;
        for (k, want) in [0.025f32, 0.05, 0.075, 0.1, 0.1].into_iter().enumerate() {
            let grads = (p.as_tensor() * 2.0).unwrap().sum_all().unwrap().backward().unwrap();
            opt.step(&grads, 0.0).unwrap();
            let now = p.as_tensor().to_vec1::<f32>().unwrap()[0];
            assert!((was - now - want).abs() < 1e-6, "step {}: moved {}", k + 1, was - now);
            assert!((opt.current_lr() - want as f64).abs() < 1e-6, "step {}: reports {}", k + 1, opt.current_lr());
            was = now;
        }
    }

    #[test]
    fn the_in_place_update_follows_torch_adamw_over_several_steps_with_clipping() {
        // A scalar f64 AdamW (torch.optim.AdamW's update, global-norm clipping first).
        let n = 70_000; // more than one thread chunk
        let p0: Vec<f32> = (0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let grad =
            |step: usize| -> Vec<f32> { (0..n).map(|i| (((i + 3 * step) * 53 % 97) as f32 - 48.0) / 10.0).collect() };
        let s = Optim { weight_decay: 0.01, ..Optim::default() };
        let (lr, max_norm) = (1e-3, 5.0);
        let p = Var::from_vec(p0.clone(), n, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), p.clone())], lr, &s).unwrap();
        let (mut want, mut m, mut v) = (p0.iter().map(|&x| x as f64).collect::<Vec<_>>(), vec![0f64; n], vec![0f64; n]);
        for step in 1..=3 {
            let g = grad(step);
            let target = Tensor::from_vec(g.clone(), n, &Device::Cpu).unwrap();
            let grads = (p.as_tensor() * &target).unwrap().sum_all().unwrap().backward().unwrap();
            let norm = opt.step(&grads, max_norm).unwrap();
            let true_norm = g.iter().map(|&x| (x as f64).powi(2)).sum::<f64>().sqrt();
            assert!((norm - true_norm).abs() < 1e-6 * true_norm);
            let scale = if true_norm > max_norm { max_norm / (true_norm + 1e-6) } else { 1.0 };
            let (b1, b2) = (s.beta1, s.beta2);
            for i in 0..n {
                let gi = g[i] as f64 * scale;
                m[i] = b1 * m[i] + (1.0 - b1) * gi;
                v[i] = b2 * v[i] + (1.0 - b2) * gi * gi;
                let (mh, vh) = (m[i] / (1.0 - b1.powi(step as i32)), v[i] / (1.0 - b2.powi(step as i32)));
                want[i] = want[i] * (1.0 - lr * s.weight_decay) - lr * mh / (vh.sqrt() + s.eps);
            }
        }
        let got = p.as_tensor().to_vec1::<f32>().unwrap();
        let worst = got.iter().zip(&want).map(|(&a, &b)| (a as f64 - b).abs()).fold(0.0, f64::max);
        assert!(worst < 1e-6, "in-place AdamW is off by {worst}");
    }

    #[test]
    fn state_round_trips_through_safetensors() {
        let dir = tempfile::tempdir().unwrap();
        let p = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(vec![("w".into(), p.clone())], 0.01, &Optim::default()).unwrap();
        let grads = p.as_tensor().sqr().unwrap().sum_all().unwrap().backward().unwrap();
        opt.step(&grads, 1.0).unwrap();
        opt.save(&dir.path().join("o.safetensors")).unwrap();
        let q = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
        let mut opt2 = AdamW::new(vec![("w".into(), q)], 0.01, &Optim::default()).unwrap();
        opt2.load(&dir.path().join("o.safetensors")).unwrap();
        assert_eq!(opt2.t, 1);
        assert_eq!(
            opt2.params[0].2.as_tensor().to_vec1::<f32>().unwrap(),
            opt.params[0].2.as_tensor().to_vec1::<f32>().unwrap()
        );
    }
}
