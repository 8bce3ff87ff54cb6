//! LoRA over a whole decoder: attaching low-rank adapters to its projections (the adapter itself,
//! `y = x Wᵀ + (α/r) · drop(x) Aᵀ Bᵀ`, is in `linear`), their weights by name, saving and loading
//! them, merging them into the weights. While a decoder has adapters its own weights are frozen:
//! they are read detached, so no gradient (and no weight-gradient matmul) is computed for them.
//!
//! On disk an adapter is a PEFT folder: `adapter_config.json` and `adapter_model.safetensors`
//! with PEFT's tensor names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`),
//! which Python `peft` loads onto the HF base model. `merge` folds the adapters into the weights.
use std::path::Path;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor, Var};
use serde_json::{json, Value};

use super::linear::Adapter;
pub use super::linear::{targets, LoraConfig};
use super::model::{Decoder, Linear};
use crate::rng::Rng;

impl Decoder {
    /// The weights training updates with their names: the adapters' (PEFT names) under LoRA,
    /// else every weight (HF names).
    pub fn trainable_vars(&self) -> Vec<(String, Var)> {
        match self.lora {
            Some(_) => named_vars(self),
            None => self.named_vars(),
        }
    }
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
