//! AdamW (Loshchilov & Hutter 2019, as torch.optim.AdamW) over named candle `Var`s, with global
//! grad-norm clipping and its state saved to / loaded from safetensors so a resumed run continues
//! exactly. (candle-nn's AdamW keeps its moments private, so it cannot be checkpointed.)
use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use super::settings::Optim;

pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimiser steps taken (bias correction uses it).
    pub t: u64,
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
        Ok(Self { lr, beta1: s.beta1, beta2: s.beta2, eps: s.eps, weight_decay: s.weight_decay, t: 0, params })
    }

    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.1.clone()).collect()
    }

    /// The global L2 norm of the gradients of our vars.
    pub fn grad_norm(&self, grads: &GradStore) -> Result<f64> {
        let mut sq = 0.0f64;
        for (_, v, _, _) in &self.params {
            if let Some(g) = grads.get(v.as_tensor()) {
                sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
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
        let (b1, b2) = (self.beta1, self.beta2);
        let bc1 = 1.0 - b1.powi(self.t as i32);
        let bc2 = 1.0 - b2.powi(self.t as i32);
        for (_, p, m, v) in &self.params {
            let Some(g) = grads.get(p.as_tensor()) else { continue };
            let g = (g * scale)?;
            let m_new = ((m.as_tensor() * b1)? + (&g * (1.0 - b1))?)?;
            let v_new = ((v.as_tensor() * b2)? + (g.sqr()? * (1.0 - b2))?)?;
            let m_hat = (&m_new / bc1)?;
            let v_hat = (&v_new / bc2)?;
            let decayed = (p.as_tensor() * (1.0 - self.lr * self.weight_decay))?;
            let update = (m_hat / (v_hat.sqrt()? + self.eps)?)?;
            p.set(&(decayed - (update * self.lr)?)?)?;
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
