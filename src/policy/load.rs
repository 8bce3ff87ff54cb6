//! Reading and writing model files: a Hugging Face folder (config.json, safetensors single or
//! sharded, tokenizer.json, tokenizer_config.json, generation_config.json) and GGUF (weights
//! dequantised to f32 with llama.cpp's Q/K row permutation undone; tokenizer and chat template
//! from the metadata). Errors name the file and the missing piece.
use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::config::{token_ids, Config, Family};
use super::model::Decoder;
use super::tokenizer::{byte_level_bpe, vocab_and_merges};

/// What a loader hands the `Policy`: the model, its tokenizer and the tokenizer settings
/// (`tokenizer_config.json` content: chat template, special tokens).
pub struct Loaded {
    pub model: Decoder,
    pub tokenizer: Tokenizer,
    pub tokenizer_config: Value,
    /// EOS ids from generation_config.json / GGUF metadata.
    pub eos_ids: Vec<u32>,
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))
}

/// The safetensors files of an HF folder and, per tensor name, the file that holds it.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.exists() {
        bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display());
    }
    let map = read_json(&index)?;
    let map = map["weight_map"].as_object().with_context(|| format!("{}: no weight_map", index.display()))?;
    let mut files: Vec<PathBuf> = map.values().filter_map(Value::as_str).map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// Load a Hugging Face model folder.
pub fn load_hf_dir(dir: &Path, device: &Device) -> Result<Loaded> {
    let config_path = dir.join("config.json");
    let cfg_json = read_json(&config_path)?;
    let mut cfg = Config::from_hf_json(&cfg_json, &config_path)?;
    let gen_path = dir.join("generation_config.json");
    let mut eos_ids = cfg.eos_token_ids.clone();
    if gen_path.exists() {
        for id in token_ids(read_json(&gen_path)?.get("eos_token_id")) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
    }
    cfg.eos_token_ids = eos_ids.clone();
    let files = safetensors_files(dir)?;
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    for f in &files {
        let part = candle_core::safetensors::load(f, device).with_context(|| format!("reading {}", f.display()))?;
        tensors.extend(part);
    }
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap_or_default().to_string_lossy().into()).collect();
    let model = Decoder::from_tensors(cfg, |name, _| {
        tensors
            .remove(name)
            .with_context(|| format!("{}: missing tensor {name} (in {})", dir.display(), names.join(", ")))
    })?;
    // RoPE's inverse frequencies (saved by old transformers) are recomputed from the config, and
    // a tied model may still carry its lm_head copy; anything else would be silently dropped.
    let tied = model.lm_head.is_none();
    tensors.retain(|n, _| !(n.ends_with("rotary_emb.inv_freq") || (tied && n == "lm_head.weight")));
    refuse_unused(dir, tensors.into_keys())?;
    let tok_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tok_path).map_err(|e| anyhow!("reading {}: {e}", tok_path.display()))?;
    let tc_path = dir.join("tokenizer_config.json");
    let tokenizer_config = if tc_path.exists() { read_json(&tc_path)? } else { json!({}) };
    Ok(Loaded { model, tokenizer, tokenizer_config, eos_ids })
}

/// A weight file's tensors the model did not read mean an architecture it does not implement
/// (biases, extra norms, scaled RoPE): an error that names them, not wrong logits.
fn refuse_unused(source: &Path, names: impl Iterator<Item = String>) -> Result<()> {
    let mut names: Vec<String> = names.collect();
    if names.is_empty() {
        return Ok(());
    }
    names.sort();
    let more = if names.len() > 5 { format!(" and {} more", names.len() - 5) } else { String::new() };
    names.truncate(5);
    bail!(
        "{}: tensors this architecture does not use: {}{more} (refusing to load a model it would compute wrongly)",
        source.display(),
        names.join(", ")
    )
}

/// Write `model` and its tokenizer as a Hugging Face folder that `load_hf_dir` and
/// `transformers` both read.
pub fn save_hf_dir(dir: &Path, model: &Decoder, tokenizer: &Tokenizer, tokenizer_config: &Value) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let write_json = |name: &str, v: &Value| -> Result<()> {
        let path = dir.join(name);
        std::fs::write(&path, serde_json::to_string_pretty(v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))
    };
    write_json("config.json", &model.cfg.to_hf_json())?;
    let mut gen = json!({ "do_sample": true });
    if let Some(b) = model.cfg.bos_token_id {
        gen["bos_token_id"] = json!(b);
    }
    gen["eos_token_id"] = json!(model.cfg.eos_token_ids);
    write_json("generation_config.json", &gen)?;
    write_json("tokenizer_config.json", tokenizer_config)?;
    let tensors: HashMap<String, Tensor> =
        model.named_vars().into_iter().map(|(n, v)| (n, v.as_tensor().clone())).collect();
    let path = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &path).with_context(|| format!("writing {}", path.display()))?;
    let path = dir.join("tokenizer.json");
    tokenizer.save(&path, false).map_err(|e| anyhow!("writing {}: {e}", path.display()))
}

/// HF weight name → GGUF tensor name (llama.cpp's naming).
fn gguf_name(hf: &str) -> Result<String> {
    let fixed = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        ("lm_head.weight", "output.weight"),
    ];
    if let Some((_, g)) = fixed.iter().find(|(h, _)| *h == hf) {
        return Ok(g.to_string());
    }
    let rest = hf.strip_prefix("model.layers.").with_context(|| format!("no GGUF name for {hf}"))?;
    let (layer, rest) = rest.split_once('.').with_context(|| format!("no GGUF name for {hf}"))?;
    let parts = [
        ("input_layernorm", "attn_norm"),
        ("self_attn.q_proj", "attn_q"),
        ("self_attn.k_proj", "attn_k"),
        ("self_attn.v_proj", "attn_v"),
        ("self_attn.o_proj", "attn_output"),
        ("post_attention_layernorm", "ffn_norm"),
        ("mlp.gate_proj", "ffn_gate"),
        ("mlp.up_proj", "ffn_up"),
        ("mlp.down_proj", "ffn_down"),
    ];
    let (module, kind) = rest.rsplit_once('.').with_context(|| format!("no GGUF name for {hf}"))?;
    let (_, g) = parts.iter().find(|(h, _)| *h == module).with_context(|| format!("no GGUF name for {hf}"))?;
    Ok(format!("blk.{layer}.{g}.{kind}"))
}

/// llama.cpp stores Llama's Q/K rows permuted for interleaved RoPE; `inverse` restores HF's
/// rotate-half layout (shared/notes/candle-cpu.md §3). Both directions on `[n_head·hd, in]`.
fn permute_qk(w: &Tensor, n_head: usize, inverse: bool) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    let hd = out / n_head;
    let t = if inverse {
        w.reshape((n_head, hd / 2, 2, inp))?.transpose(1, 2)?
    } else {
        w.reshape((n_head, 2, hd / 2, inp))?.transpose(1, 2)?
    };
    Ok(t.contiguous()?.reshape((out, inp))?)
}

/// Which heads count applies to a Q or K weight, if this tensor needs the permutation.
fn qk_heads(cfg: &Config, hf: &str) -> Option<usize> {
    if cfg.family != Family::Llama || !hf.ends_with(".weight") {
        return None; // llama.cpp permutes Llama's Q/K only, not Qwen2's
    }
    if hf.contains("self_attn.q_proj") {
        Some(cfg.num_attention_heads)
    } else if hf.contains("self_attn.k_proj") {
        Some(cfg.num_key_value_heads)
    } else {
        None
    }
}

fn md_usize(md: &HashMap<String, gguf_file::Value>, key: &str) -> Option<usize> {
    use gguf_file::Value as V;
    Some(match md.get(key)? {
        V::U8(x) => *x as usize,
        V::U16(x) => *x as usize,
        V::U32(x) => *x as usize,
        V::U64(x) => *x as usize,
        V::I32(x) => *x as usize,
        V::I64(x) => *x as usize,
        _ => return None,
    })
}

fn md_f64(md: &HashMap<String, gguf_file::Value>, key: &str) -> Option<f64> {
    match md.get(key)? {
        gguf_file::Value::F32(x) => Some(*x as f64),
        gguf_file::Value::F64(x) => Some(*x),
        _ => md_usize(md, key).map(|x| x as f64),
    }
}

fn md_strings(md: &HashMap<String, gguf_file::Value>, key: &str) -> Option<Vec<String>> {
    let v = md.get(key)?.to_vec().ok()?;
    v.iter().map(|x| x.to_string().ok().cloned()).collect()
}

/// Load a GGUF file (f32 after dequantisation).
pub fn load_gguf(path: &Path, device: &Device) -> Result<Loaded> {
    let mut file = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let ct = gguf_file::Content::read(&mut file).map_err(|e| anyhow!("{}: not a GGUF file: {e}", path.display()))?;
    let md = &ct.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .with_context(|| format!("{}: no general.architecture", path.display()))?
        .clone();
    let family = match arch.as_str() {
        "llama" => Family::Llama,
        "qwen2" => Family::Qwen2,
        a => bail!("{}: architecture {a:?} is not supported (supported: llama, qwen2)", path.display()),
    };
    let need = |key: &str| {
        md_usize(md, &format!("{arch}.{key}"))
            .with_context(|| format!("{}: missing metadata {arch}.{key}", path.display()))
    };
    let tokens = md_strings(md, "tokenizer.ggml.tokens")
        .with_context(|| format!("{}: missing metadata tokenizer.ggml.tokens", path.display()))?;
    let hidden_size = need("embedding_length")?;
    let num_attention_heads = need("attention.head_count")?;
    let eos = md_usize(md, "tokenizer.ggml.eos_token_id").map(|x| x as u32);
    let cfg = Config {
        family,
        vocab_size: tokens.len(),
        hidden_size,
        intermediate_size: need("feed_forward_length")?,
        num_hidden_layers: need("block_count")?,
        num_attention_heads,
        num_key_value_heads: need("attention.head_count_kv").unwrap_or(num_attention_heads),
        head_dim: need("attention.key_length").unwrap_or(hidden_size / num_attention_heads),
        rms_norm_eps: md_f64(md, &format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        rope_theta: md_f64(md, &format!("{arch}.rope.freq_base")).unwrap_or(10_000.0),
        max_position_embeddings: need("context_length").unwrap_or(2048),
        tie_word_embeddings: !ct.tensor_infos.contains_key("output.weight"),
        bos_token_id: md_usize(md, "tokenizer.ggml.bos_token_id").map(|x| x as u32),
        eos_token_ids: eos.into_iter().collect(),
    };
    let mut unused: std::collections::HashSet<String> = ct.tensor_infos.keys().cloned().collect();
    let model = Decoder::from_tensors(cfg.clone(), |name, _| {
        let g = gguf_name(name)?;
        unused.remove(&g);
        if !ct.tensor_infos.contains_key(&g) {
            bail!("{}: missing tensor {g} (for {name})", path.display());
        }
        let w = ct.tensor(&mut file, &g, device)?.dequantize(device)?;
        match qk_heads(&cfg, name) {
            Some(n) => permute_qk(&w, n, true),
            None => Ok(w),
        }
    })?;
    refuse_unused(path, unused.into_iter())?;
    let tokenizer =
        gguf_tokenizer(md, &tokens).with_context(|| format!("{}: building the tokenizer", path.display()))?;
    let token = |key: &str| md_usize(md, key).and_then(|id| tokens.get(id)).cloned();
    let mut tokenizer_config = json!({ "tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": false });
    for (field, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(t) = token(key) {
            tokenizer_config[field] = json!(t);
        }
    }
    if let Some(t) = md.get("tokenizer.chat_template").and_then(|v| v.to_string().ok()) {
        tokenizer_config["chat_template"] = json!(t);
    }
    let eos_ids = cfg.eos_token_ids.clone();
    Ok(Loaded { model, tokenizer, tokenizer_config, eos_ids })
}

/// The byte-level BPE of a GGUF file (`tokenizer.ggml.model = "gpt2"`), specials from token types.
fn gguf_tokenizer(md: &HashMap<String, gguf_file::Value>, tokens: &[String]) -> Result<Tokenizer> {
    let model = md.get("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).map(String::as_str);
    if model != Some("gpt2") {
        bail!("tokenizer.ggml.model {model:?} is not supported (only byte-level BPE, \"gpt2\")");
    }
    let merges = md_strings(md, "tokenizer.ggml.merges").context("missing metadata tokenizer.ggml.merges")?;
    // token_type 3 = control, 4 = user-defined: both are matched whole, never split; only
    // control tokens are dropped when decoding.
    let types = md.get("tokenizer.ggml.token_type").and_then(|v| v.to_vec().ok()).map_or(&[][..], Vec::as_slice);
    let of_type = |ty: i32| -> Vec<u32> {
        types.iter().enumerate().filter(|(_, t)| t.to_i32().ok() == Some(ty)).map(|(i, _)| i as u32).collect()
    };
    let pre = md.get("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).map_or("gpt2", String::as_str);
    byte_level_bpe(tokens, &merges, &of_type(3), &of_type(4), pre)
}

/// Write a GGUF file as llama.cpp's converter would (f32 tensors, Llama Q/K permuted, the
/// tokenizer and chat template in the metadata). Used for the tiny presets' GGUF form.
pub fn save_gguf(path: &Path, model: &Decoder, tokenizer: &Tokenizer, tokenizer_config: &Value) -> Result<()> {
    use gguf_file::Value as V;
    let cfg = &model.cfg;
    let arch = cfg.family.model_type();
    let (tokens, merges) = vocab_and_merges(tokenizer)?;
    let added = tokenizer.get_added_tokens_decoder();
    let types: Vec<V> =
        (0..tokens.len() as u32).map(|i| V::I32(added.get(&i).map_or(1, |t| if t.special { 3 } else { 4 }))).collect();
    let id_of = |field: &str| -> Option<u32> {
        tokenizer_config.get(field).and_then(Value::as_str).and_then(|t| tokenizer.token_to_id(t))
    };
    let mut md: Vec<(String, V)> = vec![
        ("general.architecture".into(), V::String(arch.into())),
        (format!("{arch}.embedding_length"), V::U32(cfg.hidden_size as u32)),
        (format!("{arch}.feed_forward_length"), V::U32(cfg.intermediate_size as u32)),
        (format!("{arch}.block_count"), V::U32(cfg.num_hidden_layers as u32)),
        (format!("{arch}.attention.head_count"), V::U32(cfg.num_attention_heads as u32)),
        (format!("{arch}.attention.head_count_kv"), V::U32(cfg.num_key_value_heads as u32)),
        (format!("{arch}.attention.key_length"), V::U32(cfg.head_dim as u32)),
        (format!("{arch}.attention.layer_norm_rms_epsilon"), V::F32(cfg.rms_norm_eps as f32)),
        (format!("{arch}.rope.freq_base"), V::F32(cfg.rope_theta as f32)),
        (format!("{arch}.context_length"), V::U32(cfg.max_position_embeddings as u32)),
        ("tokenizer.ggml.model".into(), V::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), V::String("smollm".into())),
        ("tokenizer.ggml.tokens".into(), V::Array(tokens.iter().cloned().map(V::String).collect())),
        ("tokenizer.ggml.merges".into(), V::Array(merges.into_iter().map(V::String).collect())),
        ("tokenizer.ggml.token_type".into(), V::Array(types)),
    ];
    for (field, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = id_of(field) {
            md.push((key.into(), V::U32(id)));
        }
    }
    if let Some(t) = tokenizer_config.get("chat_template").and_then(Value::as_str) {
        md.push(("tokenizer.chat_template".into(), V::String(t.into())));
    }
    let mut qtensors = vec![];
    for (name, var) in model.named_vars() {
        let w = match qk_heads(cfg, &name) {
            Some(n) => permute_qk(var.as_tensor(), n, false)?,
            None => var.as_tensor().clone(),
        };
        qtensors.push((gguf_name(&name)?, QTensor::quantize(&w, GgmlDType::F32)?));
    }
    let md_refs: Vec<(&str, &V)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut f = File::create(path).with_context(|| format!("creating {}", path.display()))?;
    gguf_file::write(&mut f, &md_refs, &t_refs).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qk_permutation_round_trips() {
        let w = Tensor::arange(0f32, 64.0, &Device::Cpu).unwrap().reshape((8, 8)).unwrap();
        let p = permute_qk(&w, 2, false).unwrap();
        assert_ne!(p.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
        let back = permute_qk(&p, 2, true).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), w.to_vec2::<f32>().unwrap());
    }

    #[test]
    fn gguf_names_follow_llama_cpp() {
        assert_eq!(gguf_name("model.layers.3.self_attn.k_proj.bias").unwrap(), "blk.3.attn_k.bias");
        assert_eq!(gguf_name("model.layers.0.mlp.down_proj.weight").unwrap(), "blk.0.ffn_down.weight");
        assert_eq!(gguf_name("model.embed_tokens.weight").unwrap(), "token_embd.weight");
    }
}
