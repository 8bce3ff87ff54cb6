//! The model's shape: one `Config` for both decoder families (Llama, Qwen2), read from and
//! written to Hugging Face's `config.json` (field names as HF spells them), or read from GGUF
//! metadata. The family differences are explicit here (`Family`), not hidden in the model code.
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;

/// Which decoder family: they share one block; Qwen2 adds a bias to the Q, K and V projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3, SmolLM2, Mistral-style dense models without attention bias.
    Llama,
    /// Qwen2 / Qwen2.5: bias on q_proj, k_proj, v_proj.
    Qwen2,
}

impl Family {
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
        }
    }

    pub fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
        }
    }

    /// Whether q/k/v projections carry a bias.
    pub fn qkv_bias(self) -> bool {
        self == Family::Qwen2
    }

    fn from_model_type(t: &str) -> Option<Self> {
        match t {
            "llama" | "mistral" => Some(Family::Llama),
            "qwen2" => Some(Family::Qwen2),
            _ => None,
        }
    }
}

/// The hyper-parameters of a decoder-only transformer (RMSNorm, RoPE, GQA, SwiGLU).
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    /// lm_head shares the embedding matrix (SmolLM2, Qwen2.5-0.5B) instead of owning one.
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}

/// `eos_token_id` is a number or a list of numbers in HF configs.
pub(crate) fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(xs)) => xs.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

impl Config {
    /// Parse HF's `config.json`; `path` only names the file in errors.
    pub fn from_hf_json(v: &Value, path: &Path) -> Result<Self> {
        let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        let Some(family) = Family::from_model_type(model_type) else {
            bail!("{}: model_type {model_type:?} is not supported (supported: llama, mistral, qwen2)", path.display());
        };
        let need =
            |key: &str| get_usize(v, key).with_context(|| format!("{}: missing number field {key:?}", path.display()));
        let hidden_size = need("hidden_size")?;
        let num_attention_heads = need("num_attention_heads")?;
        // The block is SiLU-gated with bias only on Qwen2's q/k/v: refuse what would load and
        // then compute something else.
        let act = v.get("hidden_act").and_then(Value::as_str).unwrap_or("silu");
        if act != "silu" {
            bail!("{}: hidden_act {act:?} is not supported (the MLP is SiLU-gated)", path.display());
        }
        for key in ["mlp_bias", "attention_bias"] {
            if v.get(key).and_then(Value::as_bool) == Some(true) {
                bail!(
                    "{}: {key} = true is not supported (biases exist only on Qwen2's q/k/v projections)",
                    path.display()
                );
            }
        }
        let rope_scaling = v.get("rope_scaling").filter(|x| !x.is_null());
        if let Some(rs) = rope_scaling {
            // Llama-3.1+ "llama3" scaling changes the frequencies: refuse rather than run it wrong.
            bail!("{}: rope_scaling {rs} is not supported yet", path.display());
        }
        Ok(Config {
            family,
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            num_hidden_layers: need("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: get_usize(v, "num_key_value_heads").unwrap_or(num_attention_heads),
            head_dim: get_usize(v, "head_dim").unwrap_or(hidden_size / num_attention_heads),
            rms_norm_eps: v.get("rms_norm_eps").and_then(Value::as_f64).unwrap_or(1e-6),
            rope_theta: v.get("rope_theta").and_then(Value::as_f64).unwrap_or(10_000.0),
            max_position_embeddings: get_usize(v, "max_position_embeddings").unwrap_or(2048),
            tie_word_embeddings: v.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            bos_token_id: v.get("bos_token_id").and_then(Value::as_u64).map(|x| x as u32),
            eos_token_ids: token_ids(v.get("eos_token_id")),
        })
    }

    /// HF's `config.json`, complete enough for `transformers.AutoModelForCausalLM`.
    pub fn to_hf_json(&self) -> Value {
        let mut v = json!({
            "architectures": [self.family.architecture()],
            "model_type": self.family.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "attention_dropout": 0.0,
            "initializer_range": 0.02,
            "use_cache": true,
        });
        let o = v.as_object_mut().expect("object literal");
        if let Some(b) = self.bos_token_id {
            o.insert("bos_token_id".into(), json!(b));
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [e] => drop(o.insert("eos_token_id".into(), json!(e))),
            es => drop(o.insert("eos_token_id".into(), json!(es))),
        }
        match self.family {
            Family::Llama => {
                o.insert("attention_bias".into(), json!(false));
                o.insert("mlp_bias".into(), json!(false));
            }
            Family::Qwen2 => {
                o.insert("use_sliding_window".into(), json!(false));
                o.insert("sliding_window".into(), Value::Null);
                o.insert("max_window_layers".into(), json!(self.num_hidden_layers));
            }
        }
        v
    }

    /// Number of parameters (the tied lm_head counted once).
    pub fn num_params(&self) -> usize {
        let (h, v) = (self.hidden_size, self.vocab_size);
        let head = if self.tie_word_embeddings { 0 } else { v * h };
        v * h + self.num_hidden_layers * self.layer_params() + h + head
    }

    /// Parameters of one decoder layer: two norms, attention (with Qwen2's biases), the MLP.
    fn layer_params(&self) -> usize {
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        let bias = if self.family.qkv_bias() { q + 2 * kv } else { 0 };
        2 * h + h * q + 2 * h * kv + q * h + bias + 3 * h * i
    }

    /// FLOPs of one forward pass over `positions` token positions of which `scored` need logits:
    /// 2 per weight per position through the layers, 2·hidden·vocab per logit row. The
    /// embedding lookup is free and attention's score products are left out (under a tenth at
    /// a few hundred positions), so this is a floor.
    pub fn forward_flops(&self, positions: usize, scored: usize) -> f64 {
        let layers = (self.num_hidden_layers * self.layer_params()) as f64;
        let head = (self.vocab_size * self.hidden_size) as f64;
        2.0 * (layers * positions as f64 + head * scored as f64)
    }

    pub fn validate(&self) -> Result<()> {
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("head_dim {} must be even for RoPE", self.head_dim);
        }
        Ok(())
    }
}

#[cfg(test)]
impl Config {
    /// A one-layer config of a few numbers a side, for unit tests.
    pub(crate) fn tiny(family: Family) -> Config {
        Config {
            family,
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 16,
            num_hidden_layers: 1,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 4,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 64,
            tie_word_embeddings: family == Family::Llama,
            bos_token_id: Some(1),
            eos_token_ids: vec![2, 3],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_json_round_trips_for_both_families() {
        for f in [Family::Llama, Family::Qwen2] {
            let c = Config::tiny(f);
            assert_eq!(Config::from_hf_json(&c.to_hf_json(), Path::new("config.json")).unwrap(), c);
        }
    }

    #[test]
    fn param_count_counts_biases_and_the_untied_head() {
        // Llama, tied: embed 80 + layer (norms 16, q 64, k 32, v 32, o 64, mlp 384) + final norm 8
        assert_eq!(Config::tiny(Family::Llama).num_params(), 80 + 592 + 8);
        // Qwen2: + q/k/v biases (8 + 4 + 4) + its own lm_head 80
        assert_eq!(Config::tiny(Family::Qwen2).num_params(), 80 + 592 + 16 + 8 + 80);
    }

    #[test]
    fn forward_flops_count_the_layers_per_position_and_the_head_per_scored_row() {
        // 2 · (592 layer weights · 10 positions + 80 head weights · 3 logit rows), tied or not.
        assert_eq!(Config::tiny(Family::Llama).forward_flops(10, 3), 2.0 * (592.0 * 10.0 + 80.0 * 3.0));
        assert_eq!(Config::tiny(Family::Qwen2).forward_flops(10, 0), 2.0 * 608.0 * 10.0);
    }

    #[test]
    fn unsupported_configs_name_the_file_and_the_field() {
        let mut v = Config::tiny(Family::Llama).to_hf_json();
        v["model_type"] = "gpt_neox".into();
        let err = Config::from_hf_json(&v, Path::new("m/config.json")).unwrap_err().to_string();
        assert!(err.contains("m/config.json") && err.contains("gpt_neox"), "{err}");
        let mut v = Config::tiny(Family::Llama).to_hf_json();
        v.as_object_mut().unwrap().remove("hidden_size");
        let err = Config::from_hf_json(&v, Path::new("m/config.json")).unwrap_err().to_string();
        assert!(err.contains("hidden_size"), "{err}");
        v = Config::tiny(Family::Llama).to_hf_json();
        v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
        assert!(Config::from_hf_json(&v, Path::new("c.json")).unwrap_err().to_string().contains("rope_scaling"));
    }
}
