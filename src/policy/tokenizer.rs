//! Tokenizers: building a byte-level BPE (GPT-2 style, as SmolLM2/Qwen/Llama-3 use) from a
//! vocabulary and merges (GGUF metadata), and training a small one deterministically for the
//! tiny presets. Loading `tokenizer.json` is `tokenizers::Tokenizer::from_file`.
//!
//! We do not use candle's `TokenizerFromGguf`: for SmolLM2 ("smollm" pre-tokenizer) it falls
//! back to `add_prefix_space=true` and produces different ids (shared/notes/candle-cpu.md §4).
use anyhow::{anyhow, bail, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, Vocab, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// llama.cpp's `tokenizer.ggml.pre` names the pre-tokenizer; these are the ones we rebuild.
const QWEN2_PATTERN: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(SplitPattern::Regex(pattern.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| anyhow!("pre-tokenizer regex: {e}"))?;
        Ok(Sequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into())
    };
    Ok(match pre {
        // SmolLM2: digits one by one, then GPT-2's byte-level regex.
        "smollm" => Sequence::new(vec![Digits::new(true).into(), ByteLevel::new(false, true, true).into()]).into(),
        "gpt2" | "default" => ByteLevel::new(false, true, true).into(),
        "qwen2" => split(QWEN2_PATTERN)?,
        "llama-bpe" | "llama3" => split(LLAMA3_PATTERN)?,
        other => bail!("tokenizer.ggml.pre {other:?} is not supported (supported: smollm, gpt2, qwen2, llama-bpe)"),
    })
}

/// Attach the byte-level pipeline (pre-tokenizer `pre`, ByteLevel decoder and post-processor).
fn with_pipeline(tok: &mut Tokenizer, pre: &str) -> Result<()> {
    tok.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
    tok.with_decoder(Some(ByteLevelDecoder::default()));
    tok.with_post_processor(Some(ByteLevel::new(false, true, true)));
    Ok(())
}

/// A byte-level BPE from its vocabulary (index = id), merges (`"a b"`) and special tokens.
/// `special` ids are control tokens (dropped when decoding); `words` ids are added tokens that
/// are matched whole yet decode as text (GGUF token types 3 and 4).
pub fn byte_level_bpe(
    tokens: &[String],
    merges: &[String],
    special: &[u32],
    words: &[u32],
    pre: &str,
) -> Result<Tokenizer> {
    let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').ok_or_else(|| anyhow!("bad merge {m:?}: expected \"a b\""))?;
            Ok((a.to_string(), b.to_string()))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(false)
        .build()
        .map_err(|e| anyhow!("building the BPE: {e}"))?;
    let mut tok = Tokenizer::new(bpe);
    with_pipeline(&mut tok, pre)?;
    let added = |ids: &[u32], special: bool| -> Result<Vec<AddedToken>> {
        ids.iter()
            .map(|&id| {
                let t =
                    tokens.get(id as usize).ok_or_else(|| anyhow!("added token id {id} is out of the vocabulary"))?;
                Ok(AddedToken::from(t.clone(), special))
            })
            .collect()
    };
    tok.add_special_tokens(added(special, true)?).map_err(|e| anyhow!("adding special tokens: {e}"))?;
    tok.add_tokens(added(words, false)?).map_err(|e| anyhow!("adding tokens: {e}"))?;
    Ok(tok)
}

/// Train a byte-level BPE of `vocab_size` on `corpus`, special tokens first (ids 0, 1, …) and
/// `words` (whole-matched tokens that decode as text) last. Deterministic: the same corpus gives
/// the same vocabulary and merges.
pub fn train_bpe(corpus: &[&str], vocab_size: usize, special: &[&str], words: &[&str]) -> Result<Tokenizer> {
    let mut tok = Tokenizer::new(BPE::default());
    with_pipeline(&mut tok, "smollm")?;
    let trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(special.iter().map(|s| AddedToken::from(s.to_string(), true)).collect())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut trainer = TrainerWrapper::from(trainer);
    tok.train(&mut trainer, corpus.iter().copied()).map_err(|e| anyhow!("training the tokenizer: {e}"))?;
    tok.add_tokens(words.iter().map(|w| AddedToken::from(w.to_string(), false)).collect::<Vec<_>>())
        .map_err(|e| anyhow!("adding tokens: {e}"))?;
    Ok(tok)
}

/// Vocabulary by id and merges as `"a b"`, read back from a BPE tokenizer (for writing GGUF).
pub fn vocab_and_merges(tok: &Tokenizer) -> Result<(Vec<String>, Vec<String>)> {
    let json: serde_json::Value =
        serde_json::from_str(&tok.to_string(false).map_err(|e| anyhow!("serialising the tokenizer: {e}"))?)?;
    let model = &json["model"];
    let vocab = model["vocab"].as_object().ok_or_else(|| anyhow!("tokenizer model has no vocab"))?;
    let mut tokens = vec![String::new(); tok.get_vocab_size(true)];
    for (t, id) in vocab {
        let id = id.as_u64().ok_or_else(|| anyhow!("bad vocab id for {t:?}"))? as usize;
        *tokens.get_mut(id).ok_or_else(|| anyhow!("vocab id {id} out of range"))? = t.clone();
    }
    for (id, added) in tok.get_added_tokens_decoder() {
        tokens[id as usize] = added.content;
    }
    let merges = model["merges"]
        .as_array()
        .ok_or_else(|| anyhow!("tokenizer model has no merges"))?
        .iter()
        .map(|m| match m {
            serde_json::Value::String(s) => Ok(s.clone()),
            serde_json::Value::Array(p) if p.len() == 2 => {
                Ok(format!("{} {}", p[0].as_str().unwrap_or_default(), p[1].as_str().unwrap_or_default()))
            }
            _ => bail!("bad merge {m}"),
        })
        .collect::<Result<_>>()?;
    Ok((tokens, merges))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CORPUS: &[&str] = &["Dragon Phoenix Up Down 12 345", "<think>Up is good</think><answer>Up</answer>"];

    #[test]
    fn training_is_deterministic_and_round_trips_through_vocab_and_merges() {
        let a = train_bpe(CORPUS, 300, &["<|endoftext|>"], &[]).unwrap();
        let b = train_bpe(CORPUS, 300, &["<|endoftext|>"], &[]).unwrap();
        assert_eq!(a.to_string(false).unwrap(), b.to_string(false).unwrap());
        let (tokens, merges) = vocab_and_merges(&a).unwrap();
        assert_eq!(tokens[0], "<|endoftext|>");
        let c = byte_level_bpe(&tokens, &merges, &[0], &[], "smollm").unwrap();
        let text = "<think>Dragon 1234</think><|endoftext|>";
        let ids_a = a.encode(text, false).unwrap().get_ids().to_vec();
        let ids_c = c.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(ids_a, ids_c);
        assert!(ids_a.contains(&0), "special token must be one id: {ids_a:?}");
        assert_eq!(c.decode(&ids_c, false).unwrap(), text);
    }

    #[test]
    fn qwen2_and_llama3_pre_tokenizers_build_and_split_digits_their_way() {
        let a = train_bpe(CORPUS, 300, &["<|endoftext|>"], &[]).unwrap();
        let (tokens, merges) = vocab_and_merges(&a).unwrap();
        let pieces = |pre: &str| {
            let t = byte_level_bpe(&tokens, &merges, &[0], &[], pre).unwrap();
            let enc = t.encode("Up 12345", false).unwrap();
            assert_eq!(t.decode(enc.get_ids(), false).unwrap(), "Up 12345", "{pre}");
            enc.get_tokens().to_vec()
        };
        // Qwen2 splits digits one by one; Llama-3 in groups of up to three.
        assert!(pieces("qwen2").ends_with(&["1", "2", "3", "4", "5"].map(String::from)));
        assert!(pieces("llama-bpe").iter().all(|p| p.chars().filter(char::is_ascii_digit).count() <= 3));
        assert!(byte_level_bpe(&tokens, &merges, &[0], &[], "no-such-pre").is_err());
    }
}
