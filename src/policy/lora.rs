//! LoRA: low-rank adapters on the decoder's projections, `y = x Wᵀ + (α/r) · drop(x) Aᵀ Bᵀ`, with
//! `A` `[r, in]` drawn like PEFT's (uniform ±1/√in) and `B` `[out, r]` zero, so a fresh adapter
//! leaves the model unchanged. While a decoder has adapters its own weights are frozen: they are
//! read detached, so no gradient (and no weight-gradient matmul) is computed for them.
//!
//! On disk an adapter is a PEFT folder: `adapter_config.json` and `adapter_model.safetensors`
//! with PEFT's tensor names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
//! which Python `peft` loads onto the HF base model. `merge` folds the adapters into the weights.
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use serde_json::{json, Value};

use super::model::{project, Decoder, Linear, Mode, PROJECTIONS};
use crate::rng::Rng;

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

    fn scale(&self) -> f64 {
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
    id: u64,
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
    fn delta(&self) -> Result<Tensor> {
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

/// The target projections with their module path (`model.layers.3.self_attn.q_proj`).
fn targets_mut<'a>(model: &'a mut Decoder, cfg: &LoraConfig) -> Vec<(String, &'a mut Linear)> {
    let mut out = Vec::new();
    for (l, layer) in model.layers.iter_mut().enumerate() {
        for (name, lin) in layer.linears_mut() {
            let module = name.rsplit('.').next().unwrap_or(name);
            if cfg.targets.iter().any(|t| t == module) {
                out.push((format!("model.layers.{l}.{name}"), lin));
            }
        }
    }
    out
}

/// PEFT's name of an adapter matrix (`which`: `lora_A` or `lora_B`) on the module at `path`.
fn peft_name(path: &str, which: &str) -> String {
    format!("base_model.model.{path}.{which}.weight")
}

/// Put fresh adapters on `model` (B = 0: the model's outputs are unchanged) and freeze its weights.
pub fn attach(model: &mut Decoder, cfg: &LoraConfig, seed: u64) -> Result<()> {
    if model.lora.is_some() {
        bail!("the model already has adapters");
    }
    let mut rng = Rng::new(seed);
    let dev = model.device().clone();
    for (id, (_, lin)) in targets_mut(model, cfg).into_iter().enumerate() {
        let (out, inp) = lin.weight.as_tensor().dims2()?;
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..cfg.rank * inp).map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32).collect();
        lin.lora = Some(Adapter {
            a: Var::from_tensor(&Tensor::from_vec(a, (cfg.rank, inp), &dev)?)?,
            b: Var::zeros((out, cfg.rank), candle_core::DType::F32, &dev)?,
            scale: cfg.scale(),
            dropout: cfg.dropout as f32,
            id: id as u64,
        });
    }
    model.lora = Some(cfg.clone());
    Ok(())
}

/// The adapters' matrices under their PEFT names, in layer order (A before B).
pub fn named_vars(model: &Decoder) -> Vec<(String, Var)> {
    let mut out = Vec::new();
    for (l, layer) in model.layers.iter().enumerate() {
        for (name, lin) in layer.linears() {
            if let Some(ad) = &lin.lora {
                let path = format!("model.layers.{l}.{name}");
                out.push((peft_name(&path, "lora_A"), ad.a.clone()));
                out.push((peft_name(&path, "lora_B"), ad.b.clone()));
            }
        }
    }
    out
}

/// Write `adapter_config.json` and `adapter_model.safetensors` (PEFT's layout) to `dir`.
/// `base` is what the adapter was trained on (a model spec `ragen-lab` resolves, or a hub id).
pub fn save(model: &Decoder, base: &str, dir: &Path) -> Result<()> {
    let cfg = model.lora.as_ref().context("the model has no adapters to save")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let config = json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": cfg.targets,
        "bias": "none",
        "fan_in_fan_out": false,
        "use_rslora": false,
        "inference_mode": true,
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(&path, serde_json::to_string_pretty(&config)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let tensors: std::collections::HashMap<String, Tensor> =
        named_vars(model).into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
    let path = dir.join("adapter_model.safetensors");
    candle_core::safetensors::save(&tensors, &path).with_context(|| format!("writing {}", path.display()))
}

/// Whether `dir` holds a PEFT adapter.
pub fn is_adapter_dir(dir: &Path) -> bool {
    dir.join("adapter_config.json").is_file()
}

/// The base model an adapter folder names (`base_model_name_or_path`).
pub fn base_of(dir: &Path) -> Result<String> {
    let (_, base) = read_config(dir)?;
    base.with_context(|| format!("{}: adapter_config.json names no base_model_name_or_path", dir.display()))
}

fn read_config(dir: &Path) -> Result<(LoraConfig, Option<String>)> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if v["peft_type"].as_str() != Some("LORA") {
        bail!("{}: peft_type is {}, only LORA adapters load", path.display(), v["peft_type"]);
    }
    let targets = match &v["target_modules"] {
        Value::String(s) => s.clone(),
        Value::Array(a) => a.iter().filter_map(Value::as_str).collect::<Vec<_>>().join(","),
        other => bail!("{}: target_modules is {other}", path.display()),
    };
    let rank = v["r"].as_u64().with_context(|| format!("{}: no r", path.display()))? as usize;
    let alpha = v["lora_alpha"].as_f64().with_context(|| format!("{}: no lora_alpha", path.display()))?;
    let cfg = LoraConfig::new(rank, alpha, &targets, v["lora_dropout"].as_f64().unwrap_or(0.0))
        .with_context(|| path.display().to_string())?;
    Ok((cfg, v["base_model_name_or_path"].as_str().map(str::to_string)))
}

/// Attach the adapters saved in `dir` to `model` (which must be their base's architecture).
pub fn load(model: &mut Decoder, dir: &Path, device: &Device) -> Result<()> {
    let (cfg, _) = read_config(dir)?;
    attach(model, &cfg, 0)?;
    let path = dir.join("adapter_model.safetensors");
    let mut tensors =
        candle_core::safetensors::load(&path, device).with_context(|| format!("reading {}", path.display()))?;
    for (name, var) in named_vars(model) {
        let t = tensors.remove(&name).with_context(|| format!("{}: missing tensor {name}", path.display()))?;
        if t.dims() != var.as_tensor().dims() {
            bail!(
                "{}: {name} has shape {:?}, the model expects {:?}",
                path.display(),
                t.dims(),
                var.as_tensor().dims()
            );
        }
        var.set(&t.to_dtype(candle_core::DType::F32)?)?;
    }
    if let Some(extra) = tensors.keys().next() {
        bail!("{}: tensor {extra} matches no adapter of this model", path.display());
    }
    Ok(())
}

/// Fold every adapter into its weight (`W += scale · B A`) and remove the adapters.
pub fn merge(model: &mut Decoder) -> Result<()> {
    for layer in &mut model.layers {
        for (_, lin) in layer.linears_mut() {
            if let Some(ad) = lin.lora.take() {
                // A new Var: decoders that share this one's weights keep theirs.
                lin.weight = Var::from_tensor(&(lin.weight.as_tensor() + ad.delta()?)?)?;
            }
        }
    }
    model.lora = None;
    Ok(())
}
