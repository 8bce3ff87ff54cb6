//! One projection of the decoder, `y = x Wᵀ (+ b)` (+ a LoRA adapter's term), and how a forward
//! pass reads its weights ([`Mode`]). The adapter sits here, beside the weight it adapts; the
//! functions over a whole decoder's adapters (attach, save, merge) are in `lora`.
//!
//! LoRA's term is `(α/r) · drop(x) Aᵀ Bᵀ`, with `A` `[r, in]` drawn like PEFT's (uniform ±1/√in)
//! and `B` `[out, r]` zero, so a fresh adapter leaves the model unchanged.
use anyhow::{bail, Result};
use candle_core::{Tensor, Var};

use super::kernels::{project, trained_project};
use crate::rng::Rng;

/// Which ops the forward pass uses and whether it records a graph (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    Score,
    Sample,
}

impl Mode {
    /// A weight as this mode reads it: detached (no graph recorded through it) unless training.
    /// Without this, every op of a no-grad pass would be recorded and keep its inputs alive
    /// until the output is dropped: gigabytes of activations for a batched prefill.
    pub(crate) fn weight(self, v: &Var) -> Tensor {
        match self {
            Mode::Train => v.as_tensor().clone(),
            Mode::Score | Mode::Sample => v.as_tensor().detach(),
        }
    }
}

/// A projection `y = x Wᵀ (+ b)`, `W` as HF stores it: `[out, in]`, plus a LoRA adapter's term
/// when it has one.
#[derive(Clone)]
pub struct Linear {
    pub weight: Var,
    pub bias: Option<Var>,
    pub lora: Option<Adapter>,
}

impl Linear {
    /// `base` is how the weight itself is read (frozen under LoRA), `mode` how the adapter is.
    /// # Shapes
    /// x: [N, in] → [N, out]
    pub(super) fn forward(&self, x: &Tensor, mode: Mode, base: Mode, dropout_seed: Option<u64>) -> Result<Tensor> {
        let w = base.weight(&self.weight);
        // Training on the CPU: one op whose backward skips a frozen (detached) weight.
        let mut y = if mode == Mode::Train && x.device().is_cpu() { trained_project(x, &w)? } else { project(x, &w)? };
        if let Some(b) = &self.bias {
            y = y.broadcast_add(&base.weight(b))?;
        }
        if let Some(ad) = &self.lora {
            y = (y + ad.forward(x, mode, dropout_seed)?)?;
        }
        Ok(y)
    }
}

/// A layer's projections, module paths after `model.layers.{l}.` in HF order: the one list of
/// their names (loading, saving, LoRA targets and the optimiser's names derive from it). The
/// `Layer` fields in `Layer::projections` follow this order.
pub const PROJECTIONS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// The projections an adapter can sit on, by their HF module names (`q_proj`, …, `down_proj`).
pub fn targets() -> Vec<&'static str> {
    PROJECTIONS.iter().map(|p| p.rsplit('.').next().unwrap_or(p)).collect()
}

/// What adapters a decoder carries (the `lora.*` settings).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraConfig {
    pub rank: usize,
    pub alpha: f64,
    /// HF module names from `targets()`.
    pub targets: Vec<String>,
    pub dropout: f64,
}

impl LoraConfig {
    /// `targets` as the setting writes it: `all-linear` or a comma-separated list of module names.
    pub fn new(rank: usize, alpha: f64, targets: &str, dropout: f64) -> Result<Self> {
        if rank == 0 {
            bail!("lora.rank must be at least 1 (0 means full fine-tuning, no adapters)");
        }
        if !(0.0..1.0).contains(&dropout) {
            bail!("lora.dropout must be in [0, 1), got {dropout}");
        }
        let known = self::targets();
        let targets: Vec<String> = if targets.trim() == "all-linear" {
            known.iter().map(|t| t.to_string()).collect()
        } else {
            targets.split(',').map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect()
        };
        if let Some(bad) = targets.iter().find(|t| !known.contains(&t.as_str())) {
            bail!("lora.targets: unknown module {bad:?}; known: all-linear or {}", known.join(","));
        }
        if targets.is_empty() {
            bail!("lora.targets names no module");
        }
        Ok(Self { rank, alpha, targets, dropout })
    }

    pub(super) fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }
}

/// One adapter: `scale · drop(x) Aᵀ Bᵀ`.
#[derive(Clone)]
pub struct Adapter {
    /// `[r, in]`.
    pub a: Var,
    /// `[out, r]`.
    pub b: Var,
    pub scale: f64,
    pub dropout: f32,
    /// Mixed into a training pass's seed so every adapter drops its own inputs.
    pub(super) id: u64,
}

impl Adapter {
    /// `dropout_seed` is `Some` in training passes (the same seed when a checkpointed layer is
    /// recomputed, so the recomputation drops the same inputs).
    /// # Shapes
    /// x: [N, in] → [N, out]
    pub fn forward(&self, x: &Tensor, mode: Mode, dropout_seed: Option<u64>) -> Result<Tensor> {
        let x = match dropout_seed {
            Some(seed) if self.dropout > 0.0 => {
                dropout(x, self.dropout, seed ^ self.id.wrapping_mul(0x9E37_79B9_7F4A_7C15))?
            }
            _ => x.clone(),
        };
        let low = project(&x, &mode.weight(&self.a))?;
        Ok((project(&low, &mode.weight(&self.b))? * self.scale)?)
    }

    /// `scale · B A`, `[out, in]`: what merging adds to the weight.
    pub(super) fn delta(&self) -> Result<Tensor> {
        Ok((self.b.as_tensor().matmul(self.a.as_tensor())? * self.scale)?)
    }
}

/// Inverted dropout with the project's seeded generator (candle's draws from an unseeded one,
/// which would break byte-identical resumes).
fn dropout(x: &Tensor, p: f32, seed: u64) -> Result<Tensor> {
    let mut rng = Rng::new(seed);
    let keep = 1.0 / (1.0 - p);
    let mask: Vec<f32> = (0..x.elem_count()).map(|_| if (rng.next_f64() as f32) < p { 0.0 } else { keep }).collect();
    Ok((x * Tensor::from_vec(mask, x.shape(), x.device())?)?)
}
