//! Presets: `tiny-llama` and `tiny-qwen2` for tests, `random-qwen2.5-0.5b` for measuring what
//! a 0.5B model costs. Random weights of the real architectures with a
//! small real tokenizer (byte-level BPE trained deterministically on a built-in corpus of
//! general English, ChatML special tokens, RAGEN's tags as whole tokens, a ChatML template).
//! They are written to disk in the real formats (HF folder, GGUF) and loaded back
//! through the real loaders, so tests and quick runs exercise the same code as a pretrained model.
use std::path::Path;

use anyhow::{bail, Result};
use candle_core::Device;
use serde_json::{json, Value};
use tokenizers::Tokenizer;

use super::chat::CHATML;
use super::config::{Config, Family};
use super::load::{save_gguf, save_hf_dir};
use super::model::Decoder;
use super::tokenizer::train_bpe;

pub const NAMES: &[&str] = &["tiny-llama", "tiny-qwen2", QWEN2_5_0_5B];

/// Qwen2.5-0.5B's architecture (its config.json) with random weights and the tiny tokenizer
/// (whose ids are a subset of the 151,936 embedding rows): what a 0.5B step costs, without the
/// hub. About 2 GB of f32 weights written and read back.
pub const QWEN2_5_0_5B: &str = "random-qwen2.5-0.5b";

/// ChatML's special tokens; ids 0, 1, 2 in the tiny tokenizer.
pub const SPECIAL_TOKENS: &[&str] = &["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// RAGEN's tags, one token each in the tiny tokenizer (decoded as text, unlike the specials). A
/// real model spells `</answer>` with 3–4 tokens it already knows; a random-weight model would
/// have to discover that sequence by chance, which is what keeps it from ever being rewarded.
pub const TAG_TOKENS: &[&str] = &["<think>", "</think>", "<answer>", "</answer>"];

/// Vocabulary size of the tiny tokenizer (small so tiny models are fast).
pub const VOCAB_SIZE: usize = 512;

/// What the tiny tokenizer learns from: ordinary English prose, numbers and chat phrases, and
/// none of the envs' own words (arm names, symbols, instructions), so a tiny model's results do
/// not hinge on a name happening to be one token. Tests pick names that appear nowhere here.
pub const CORPUS: &[&str] = &[
    "Hello! How can I help you today? I am happy to answer your question.",
    "The weather was cold in the morning, but by noon the sun had warmed the streets.",
    "She walked to the market, bought bread and cheese, and came home before it rained.",
    "If you add three and four you get seven; seven is more than five and less than ten.",
    "Please read the instructions carefully, then write your reply in the requested format.",
    "The river runs down from the hills, turns left at the old mill and right at the bridge.",
    "He opened the window, looked up at the sky and said that the clouds were moving fast.",
    "Our team meets every week to plan the work, share the results and choose what to try next.",
    "A good answer is short and clear. Think about the question first, then give your answer.",
    "The children played in the garden until dinner; their parents talked about the news.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 12 25 42 100 3.14 -0.1 0.5 1.0 and 2,048.",
    "user assistant system user assistant system. You are a helpful assistant.",
    "The meeting is on Tuesday at ten. Bring the report, the budget and your questions.",
    "Which of these is better? It depends on what you need, how much time you have and the cost.",
    "The cat sat near the door, the dog slept by the fire, and the house was quiet at last.",
];

fn config(name: &str, vocab_size: usize) -> Result<Config> {
    if name == QWEN2_5_0_5B {
        return Ok(Config {
            family: Family::Qwen2,
            vocab_size: 151_936,
            hidden_size: 896,
            intermediate_size: 4864,
            num_hidden_layers: 24,
            num_attention_heads: 14,
            num_key_value_heads: 2,
            head_dim: 64,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            max_position_embeddings: 32_768,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_ids: vec![2], // <|im_end|>
        });
    }
    let family = match name {
        "tiny-llama" => Family::Llama,
        "tiny-qwen2" => Family::Qwen2,
        _ => bail!("unknown preset {name:?} (presets: {})", NAMES.join(", ")),
    };
    Ok(Config {
        family,
        vocab_size,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rms_norm_eps: if family == Family::Llama { 1e-5 } else { 1e-6 },
        rope_theta: if family == Family::Llama { 10_000.0 } else { 1_000_000.0 },
        max_position_embeddings: 2048,
        // SmolLM2 ties its head; the tiny Qwen2 keeps its own to exercise that path.
        tie_word_embeddings: family == Family::Llama,
        bos_token_id: None,
        eos_token_ids: vec![2], // <|im_end|>
    })
}

fn tokenizer() -> Result<Tokenizer> {
    train_bpe(CORPUS, VOCAB_SIZE, SPECIAL_TOKENS, TAG_TOKENS)
}

fn tokenizer_config() -> Value {
    json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": false,
        "bos_token": null,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHATML,
    })
}

/// The preset's model and tokenizer, in memory (seeded: always the same weights).
fn build(name: &str, device: &Device) -> Result<(Decoder, Tokenizer)> {
    let tok = tokenizer()?;
    let cfg = config(name, tok.get_vocab_size(true))?;
    let seed = NAMES.iter().position(|n| *n == name).unwrap_or(0) as u64 + 1;
    Ok((Decoder::random(cfg, seed, device)?, tok))
}

/// Write preset `name` as a Hugging Face folder.
pub fn write_hf(name: &str, dir: &Path) -> Result<()> {
    let (model, tok) = build(name, &Device::Cpu)?;
    save_hf_dir(dir, &model, &tok, &tokenizer_config())
}

/// Write preset `name` as a GGUF file (f32, Llama Q/K permuted as llama.cpp does).
pub fn write_gguf(name: &str, path: &Path) -> Result<()> {
    let (model, tok) = build(name, &Device::Cpu)?;
    save_gguf(path, &model, &tok, &tokenizer_config())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_vocab_is_small_and_holds_the_tags_whole_but_not_the_envs_words() {
        let tok = tokenizer().unwrap();
        assert!(tok.get_vocab_size(true) <= 1024);
        for (i, s) in SPECIAL_TOKENS.iter().enumerate() {
            assert_eq!(tok.token_to_id(s), Some(i as u32));
        }
        for tag in TAG_TOKENS {
            assert_eq!(tok.encode(*tag, false).unwrap().get_ids().len(), 1, "{tag}");
        }
        // Trained on general text: an env's names are spelt from pieces.
        for word in [" Dragon", " Phoenix", " Librarian", " Sokoban"] {
            assert!(tok.encode(word, false).unwrap().get_ids().len() >= 2, "{word:?}");
        }
        // The tags decode as text, so the turn parser sees them.
        let ids = tok.encode("<answer>Up</answer>", false).unwrap();
        assert_eq!(tok.decode(ids.get_ids(), true).unwrap(), "<answer>Up</answer>");
    }
}
