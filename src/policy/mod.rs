//! The policy: a pretrained causal LM (Llama or Qwen2 family) on candle that ragen-lab samples
//! from (rollouts) and trains (per-token log-probs with gradients).
//!
//! - [`model`]: the decoder, two modes over the same `Var`s (differentiable / fast + KV cache).
//! - [`config`]: the shape, from `config.json` or GGUF metadata.
//! - [`load`]: HF folders and GGUF files in, HF folders (and GGUF for the presets) out.
//! - [`tokenizer`], [`chat`]: byte-level BPE, chat templates with the assistant loss mask.
//! - [`sample`]: batched generation; [`logprob`]: differentiable scoring; [`critic`]: PPO's value model.
//! - [`constrain`]: answers limited to the env's action names (`rollout.constrain_actions`).
//! - [`kernels`]: fused CPU ops with their own backward (masked causal softmax).
//! - [`preset`]: tiny random models of both families for tests; [`resolve`]: model specs → files.
//!
//! [`Policy`] ties them together; its methods are the interface the agent and the trainer use
//! (docs/contracts.md, "policy → agent/starpo").
use std::path::Path;
use std::sync::{Arc, OnceLock};

use anyhow::{anyhow, Context, Result};
use candle_core::{Device, Var};
use serde_json::Value;
use tokenizers::Tokenizer;

pub mod chat;
pub mod config;
pub mod constrain;
pub mod critic;
pub mod kernels;
pub mod linear;
pub mod load;
pub mod logprob;
pub mod lora;
pub mod model;
pub mod preset;
pub mod resolve;
pub mod sample;
pub mod tokenizer;
pub mod tree;

pub use chat::{ChatTemplate, ChatTokens, Message};
use constrain::AnswerGrammar;

/// The device every command loads its policy on: CUDA device 0 when built with `cuda` and one is
/// present, else the CPU. The one place this is chosen.
pub fn device() -> Result<Device> {
    Device::cuda_if_available(0).context("opening CUDA device 0")
}
pub use critic::Critic;
pub use kernels::Allowed;
pub use logprob::{Scored, Temperature, TokenBatch};
pub use model::Decoder;
pub use resolve::ModelLocation;
pub use sample::{Draws, Finish, Generation, GenerationConfig, Resume};

/// A loaded model with its tokenizer and chat template.
pub struct Policy {
    pub model: Decoder,
    pub tokenizer: Tokenizer,
    /// `None` when the model ships none (a base model): `chat_tokens` then fails clearly.
    pub chat_template: Option<ChatTemplate>,
    /// tokenizer_config.json as loaded (written back by `save`).
    pub tokenizer_config: Value,
    /// Ids that end a generation: the config's EOS ids and the end-of-turn tokens in the vocabulary.
    pub stop_ids: Vec<u32>,
    /// Filler for padded positions (pad token, else the first stop id); never scored.
    pub pad_id: u32,
    /// Where the weights came from, for `model info` and logs.
    pub source: String,
    /// The model spec it was loaded from (what an adapter names as its base).
    pub spec: String,
    /// Most full-vocabulary logits alive at once when scoring (floats); see `logprob`.
    pub logit_chunk: usize,
    /// Each token id's text alone, built on first use (constrained answers match text).
    token_texts: OnceLock<Arc<Vec<String>>>,
}

/// A special token in tokenizer_config.json: a string or `{"content": …}`.
fn special_token(tc: &Value, field: &str) -> Option<String> {
    match tc.get(field)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// `chat_template` is a string, or a list of named templates of which "default" is the one.
fn template_source(tc: &Value) -> Option<String> {
    match tc.get("chat_template")? {
        Value::String(s) => Some(s.clone()),
        Value::Array(ts) => ts
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string),
        _ => None,
    }
}

impl Policy {
    /// Load from a spec: an HF folder, a `.gguf` file, a preset (`tiny-llama`, `tiny-qwen2`), a
    /// known short name (`smollm2-135m`) or a hub id; fetched into the cache when missing.
    pub fn load(spec: &str, device: &Device) -> Result<Self> {
        let location = resolve::Resolver::from_env()?.resolve_or_fetch(spec)?;
        let mut policy = Self::from_location(&location, device)?;
        policy.spec = spec.to_string();
        Ok(policy)
    }

    /// Load what a spec resolved to.
    pub fn from_location(location: &ModelLocation, device: &Device) -> Result<Self> {
        match location {
            ModelLocation::HfDir(dir) => Self::from_loaded(load::load_hf_dir(dir, device)?, dir.display().to_string()),
            ModelLocation::Gguf(path) => Self::from_loaded(load::load_gguf(path, device)?, path.display().to_string()),
            ModelLocation::Preset(name) => Self::preset(name, device),
        }
    }

    /// A tiny preset, written as an HF folder to a scratch directory and read back by the HF loader.
    pub fn preset(name: &str, device: &Device) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "ragen-lab-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let loaded = preset::write_hf(name, &dir).and_then(|_| load::load_hf_dir(&dir, device));
        let _ = std::fs::remove_dir_all(&dir);
        Self::from_loaded(loaded?, format!("preset {name}"))
    }

    fn from_loaded(l: load::Loaded, source: String) -> Result<Self> {
        let tc = l.tokenizer_config;
        let bos = special_token(&tc, "bos_token").unwrap_or_default();
        let eos = special_token(&tc, "eos_token").unwrap_or_default();
        let chat_template = match template_source(&tc) {
            Some(src) => {
                Some(ChatTemplate::new(src, bos, eos.clone()).with_context(|| format!("{source}: chat_template"))?)
            }
            None => None,
        };
        let mut stop_ids = l.eos_ids;
        // End-of-turn tokens stop generation too, when the tokenizer has them as special tokens.
        let mut specials: Vec<(u32, String)> = l
            .tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(i, t)| (i, t.content))
            .collect();
        specials.sort();
        for (id, content) in specials {
            if (chat::END_OF_TURN.contains(&content.as_str()) || content == eos) && !stop_ids.contains(&id) {
                stop_ids.push(id);
            }
        }
        let pad_id = special_token(&tc, "pad_token")
            .and_then(|p| l.tokenizer.token_to_id(&p))
            .or(stop_ids.first().copied())
            .unwrap_or(0);
        Ok(Self {
            model: l.model,
            tokenizer: l.tokenizer,
            chat_template,
            tokenizer_config: tc,
            stop_ids,
            pad_id,
            spec: source.clone(),
            source,
            logit_chunk: logprob::LOGIT_CHUNK,
            token_texts: OnceLock::new(),
        })
    }

    pub fn device(&self) -> &Device {
        self.model.device()
    }

    /// The id the chat template closes an assistant turn with (`<|im_end|>`, `<|eot_id|>`):
    /// the last token of a reply's mask, where it is one of the stop ids.
    pub fn end_of_turn_id(&self) -> Option<u32> {
        let chat = self.chat_tokens(&[Message::user("x"), Message::assistant("y")], false).ok()?;
        let last = chat.assistant_mask.iter().rposition(|&m| m)?;
        Some(chat.ids[last]).filter(|id| self.stop_ids.contains(id))
    }

    /// Render `messages` with the chat template and tokenize, with the assistant loss mask.
    pub fn chat_tokens(&self, messages: &[Message], add_generation_prompt: bool) -> Result<ChatTokens> {
        let t = self.chat_template.as_ref().ok_or_else(|| {
            anyhow!("{}: the model has no chat template (tokenizer_config.json chat_template)", self.source)
        })?;
        t.tokens(&self.tokenizer, messages, add_generation_prompt)
    }

    /// Token ids of plain text, special tokens added as the tokenizer's post-processor says
    /// (like HF `tokenizer(text)`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| anyhow!("tokenizing: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` alone, no special tokens added (a piece inside a reply).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, false).map_err(|e| anyhow!("tokenizing {text:?}: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer.decode(ids, true).map_err(|e| anyhow!("decoding: {e}"))
    }

    /// The opening tag's ids `tag` then `sampled` (a trailing end-of-turn id dropped: the chat
    /// template writes its own), when they decode, special tokens and all, to exactly `opened`
    /// (the tag and the reply's text): the ids a reply kept as written stands in the chat as
    /// (`Message::ids`). None when they do not (a stop string cut inside a token, a tokenizer
    /// that does not decode losslessly).
    pub fn verbatim_ids(&self, tag: &[u32], opened: &str, sampled: &[u32]) -> Option<Vec<u32>> {
        let mut ids = [tag, sampled].concat();
        for _ in 0..2 {
            if self.tokenizer.decode(&ids, false).ok()? == opened {
                return Some(ids);
            }
            let last = *ids.last()?;
            if self.tokenizer.decode(&[last], true).ok()?.is_empty() && ids.len() > 1 {
                ids.pop(); // a special token the text does not show: the end of the turn
            } else {
                return None;
            }
        }
        None
    }

    /// `grammar` over this tokenizer's ids: each piece of an answer as its own tokens
    /// (`AnswerGrammar::with_tokens`), so a constrained answer is sampled in one spelling.
    pub fn canonical(&self, grammar: AnswerGrammar) -> AnswerGrammar {
        grammar.with_tokens(|text| self.encode_plain(text).ok(), |ids| self.decode(ids).ok())
    }

    /// Each token id's text decoded alone (empty for special tokens), for the model's whole
    /// vocabulary (ids past the tokenizer's are empty).
    pub fn token_texts(&self) -> Arc<Vec<String>> {
        self.token_texts
            .get_or_init(|| {
                let n = self.model.cfg.vocab_size.max(self.tokenizer.get_vocab_size(true));
                Arc::new((0..n as u32).map(|id| self.tokenizer.decode(&[id], true).unwrap_or_default()).collect())
            })
            .clone()
    }

    /// Every trainable weight (the adapters' under LoRA).
    pub fn vars(&self) -> Vec<Var> {
        self.model.trainable_vars().into_iter().map(|(_, v)| v).collect()
    }

    /// Save as a Hugging Face folder (config.json, model.safetensors, tokenizer files), or
    /// under LoRA as a PEFT adapter folder naming `spec` as its base.
    pub fn save(&self, dir: &Path) -> Result<()> {
        match self.model.lora {
            Some(_) => lora::save(&self.model, &self.spec, dir),
            None => load::save_hf_dir(dir, &self.model, &self.tokenizer, &self.tokenizer_config),
        }
    }

    /// Load what `save` wrote onto this base: adapters attach to it, full weights replace it.
    pub fn load_saved(self, dir: &Path) -> Result<Self> {
        if lora::is_adapter_dir(dir) {
            let mut policy = self;
            let device = policy.device().clone();
            lora::load(&mut policy.model, dir, &device)?;
            return Ok(policy);
        }
        let mut saved = Self::from_location(&ModelLocation::HfDir(dir.to_path_buf()), self.device())?;
        saved.spec = self.spec;
        Ok(saved)
    }

    /// A frozen reference (for a KL term) of these weights without adapters: sharing them when
    /// they never change (`share_weights`: training adapters on them), else a deep copy.
    pub fn reference(&self, share_weights: bool) -> Result<Self> {
        Ok(self.with_model(match share_weights {
            true => self.model.without_adapters(),
            false => self.model.deep_copy()?,
        }))
    }

    /// This policy's tokenizer and settings around another decoder.
    fn with_model(&self, model: Decoder) -> Self {
        Self {
            model,
            tokenizer: self.tokenizer.clone(),
            chat_template: self.chat_template.clone(),
            tokenizer_config: self.tokenizer_config.clone(),
            stop_ids: self.stop_ids.clone(),
            pad_id: self.pad_id,
            source: self.source.clone(),
            spec: self.spec.clone(),
            logit_chunk: self.logit_chunk,
            token_texts: self.token_texts.clone(),
        }
    }
}
