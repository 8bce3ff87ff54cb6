//! PPO's critic: a backbone with a linear value head on the final hidden states (RAGEN/veRL
//! initialise the critic from the same pretrained model). Fully fine-tuned, the backbone is a
//! separate copy of the policy's, saved as an HF folder with the backbone under its usual names
//! plus `score.weight`/`score.bias` (the layout of `*ForTokenClassification` with one label).
//! Under LoRA the backbone is the policy's frozen base itself (shared, not copied) with the
//! critic's own adapters, saved as a PEFT folder plus `value_head.safetensors`.
use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};
use serde_json::json;

use super::config::Config;
use super::logprob::TokenBatch;
use super::lora;
use super::model::{move_grads, normal, take_grad, Decoder, Mode};
use super::Policy;
use crate::phase::{self, Phase};
use crate::rng::Rng;

/// The value head's file beside an adapter critic's PEFT files.
const VALUE_HEAD: &str = "value_head.safetensors";

pub struct Critic {
    /// The backbone; it has no lm_head (its config says tied so none is built or saved).
    pub backbone: Decoder,
    /// `[1, H]`.
    pub score_weight: Var,
    /// `[1]`.
    pub score_bias: Var,
}

impl Critic {
    /// A critic initialised from the policy's weights, value head N(0, 0.02²), bias 0; under
    /// LoRA on the policy's shared frozen base with fresh adapters of the same settings.
    pub fn from_policy(policy: &Policy, seed: u64) -> Result<Self> {
        let src = &policy.model;
        let backbone = match &src.lora {
            Some(cfg) => {
                let mut backbone = src.without_adapters();
                backbone.lm_head = None; // values come from the hidden states
                backbone.cfg.tie_word_embeddings = true;
                lora::attach(&mut backbone, cfg, seed ^ 0xC817)?;
                backbone
            }
            None => {
                let mut cfg = src.cfg.clone();
                cfg.tie_word_embeddings = true; // no lm_head: values come from the hidden states
                let named: HashMap<String, Tensor> =
                    src.named_vars().into_iter().map(|(n, v)| Ok((n, v.as_tensor().copy()?))).collect::<Result<_>>()?;
                Decoder::from_tensors(cfg, |name, _| named.get(name).cloned().context(name.to_string()))?
            }
        };
        let h = backbone.cfg.hidden_size;
        let mut rng = Rng::new(seed);
        let w: Vec<f32> = (0..h).map(|_| 0.02 * normal(&mut rng)).collect();
        let dev = backbone.device().clone();
        Ok(Self {
            score_weight: Var::from_tensor(&Tensor::from_vec(w, (1, h), &dev)?)?,
            score_bias: Var::zeros(1, candle_core::DType::F32, &dev)?,
            backbone,
        })
    }

    /// Values at every position, `[B, T]` (position t: the state after `ids[..=t]`); 0 past a
    /// row's length.
    pub fn values_no_grad(&self, batch: &TokenBatch) -> Result<Tensor> {
        let ids = batch.pass_ids(self.backbone.device())?;
        let hidden = self.backbone.packed_hidden(&ids, batch.links(), Mode::Score)?;
        self.head(batch, &hidden, Mode::Score)
    }

    /// `loss(values)`, its gradients of every critic weight added into `grads`: the value head
    /// is differentiated on detached hidden states, which then back-propagate through the
    /// backbone once (recomputing layer by layer when it checkpoints).
    pub fn loss_and_grads(
        &self,
        batch: &TokenBatch,
        loss: impl FnOnce(&Tensor) -> Result<Tensor>,
        grads: &mut GradStore,
    ) -> Result<f32> {
        let (hidden, h_leaf, l, backprop) = phase::timed(Phase::Forward, || -> Result<_> {
            let ids = batch.pass_ids(self.backbone.device())?;
            let (hidden, backprop) = self.backbone.train_hidden(&ids, batch.links())?;
            let h_leaf = Var::from_tensor(&hidden)?;
            let l = loss(&self.head(batch, h_leaf.as_tensor(), Mode::Train)?)?;
            Ok((hidden, h_leaf, l, backprop))
        })?;
        let value = l.to_dtype(candle_core::DType::F32)?.to_scalar::<f32>()?;
        phase::timed(Phase::Backward, || -> Result<()> {
            let mut head = l.backward()?;
            let grad_h = take_grad(&mut head, h_leaf.as_tensor()).map_or_else(|| hidden.zeros_like(), Ok)?;
            backprop.backward(&self.backbone, &grad_h, grads)?;
            move_grads(grads, head, [&self.score_weight, &self.score_bias])
        })?;
        Ok(value)
    }

    /// The value head on the pass's hidden states `[R, W, H]`, laid out `[B, T]`.
    fn head(&self, batch: &TokenBatch, hidden: &Tensor, mode: Mode) -> Result<Tensor> {
        let (w, bias) = (mode.weight(&self.score_weight), mode.weight(&self.score_bias));
        let v = hidden.flatten_to(1)?.matmul(&w.t()?)?.broadcast_add(&bias)?; // [R*W, 1]
        batch.per_row(&v.squeeze(1)?)
    }

    /// The trainable weights: the backbone's (its adapters' under LoRA) and the value head.
    pub fn named_vars(&self) -> Vec<(String, Var)> {
        let mut out = self.backbone.trainable_vars();
        out.extend(self.head_vars());
        out
    }

    fn head_vars(&self) -> [(String, Var); 2] {
        [("score.weight".into(), self.score_weight.clone()), ("score.bias".into(), self.score_bias.clone())]
    }

    pub fn vars(&self) -> Vec<Var> {
        self.named_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// Write `config.json` and `model.safetensors` to `dir`; under LoRA the adapter folder and
    /// `value_head.safetensors`.
    pub fn save(&self, dir: &Path, base: &str) -> Result<()> {
        if self.backbone.lora.is_some() {
            lora::save(&self.backbone, base, dir)?;
            let tensors: HashMap<String, Tensor> =
                self.head_vars().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
            let path = dir.join(VALUE_HEAD);
            return candle_core::safetensors::save(&tensors, &path)
                .with_context(|| format!("writing {}", path.display()));
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut cfg = self.backbone.cfg.to_hf_json();
        let arch = cfg["architectures"][0].as_str().unwrap_or_default().replace("CausalLM", "TokenClassification");
        cfg["architectures"] = json!([arch]);
        cfg["num_labels"] = json!(1);
        let path = dir.join("config.json");
        std::fs::write(&path, serde_json::to_string_pretty(&cfg)?)
            .with_context(|| format!("writing {}", path.display()))?;
        let tensors: HashMap<String, Tensor> = self
            .backbone
            .named_vars()
            .into_iter()
            .chain(self.head_vars())
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let path = dir.join("model.safetensors");
        candle_core::safetensors::save(&tensors, &path).with_context(|| format!("writing {}", path.display()))
    }

    /// Read a critic written by `save`; an adapter critic goes onto `policy`'s frozen base.
    pub fn load(dir: &Path, policy: &Policy) -> Result<Self> {
        let device = policy.device();
        if lora::is_adapter_dir(dir) {
            let mut backbone = policy.model.without_adapters();
            backbone.lm_head = None;
            backbone.cfg.tie_word_embeddings = true;
            lora::load(&mut backbone, dir, device)?;
            let path = dir.join(VALUE_HEAD);
            let mut t =
                candle_core::safetensors::load(&path, device).with_context(|| format!("reading {}", path.display()))?;
            let mut take =
                |name: &str| t.remove(name).ok_or_else(|| anyhow!("{}: missing tensor {name}", path.display()));
            return Ok(Self {
                score_weight: Var::from_tensor(&take("score.weight")?)?,
                score_bias: Var::from_tensor(&take("score.bias")?)?,
                backbone,
            });
        }
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let mut cfg = Config::from_hf_json(&serde_json::from_str(&text)?, &path)?;
        cfg.tie_word_embeddings = true;
        let path = dir.join("model.safetensors");
        let mut t =
            candle_core::safetensors::load(&path, device).with_context(|| format!("reading {}", path.display()))?;
        let mut take = |name: &str| t.remove(name).ok_or_else(|| anyhow!("{}: missing tensor {name}", path.display()));
        let backbone = Decoder::from_tensors(cfg, |name, _| take(name))?;
        Ok(Self {
            score_weight: Var::from_tensor(&take("score.weight")?)?,
            score_bias: Var::from_tensor(&take("score.bias")?)?,
            backbone,
        })
    }
}
