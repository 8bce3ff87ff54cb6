//! `ragen-lab bench policy`: how fast a policy generates and trains on this machine, and how that
//! compares with PyTorch + transformers doing the same work (`tools/bench_pytorch.py`).
//!
//! Both sides measure the same things and write the same JSON ([`Report`]):
//! - generation tokens/s per batch size (default 1, 8, 32): greedy, the same ChatML prompt in every
//!   row, up to `new_tokens` new tokens per row, each row stopping at its stop id; the tokens
//!   counted are those generated (a final stop id included), the time is the whole call (prefill
//!   and KV-cache decode), the best of `repeats` runs;
//! - training tokens/s at `train_batch × train_seq` (default 8 × 256): random token ids from a fixed
//!   seed, the mean next-token negative log-likelihood over every position, backward, one AdamW
//!   step (lr 1e-5); the first step is a warm-up and not counted.
//!
//! Timings are wall-clock and depend on what else the machine runs; the report records the thread
//! count. Nothing here asserts a speed: tests check the mechanics on a tiny preset only.
use std::time::Instant;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use super::optim::AdamW;
use super::rundir::peak_rss_mb;
use crate::phase::{self, Phase};
use crate::policy::{GenerationConfig, Message, Policy, TokenBatch};
use crate::rng::Rng;

/// The prompt every generation row gets (as in `tools/bench_pytorch.py`).
pub const PROMPT: &str = "Which is bigger, 3 or 7? Answer in <answer></answer>.";

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Generation batch sizes.
    pub batches: Vec<usize>,
    /// New tokens per generated row (at most).
    pub new_tokens: usize,
    /// Generation runs per batch size; the fastest counts.
    pub repeats: usize,
    /// Training batch: sequences × tokens per sequence; 0 sequences skips training.
    pub train_batch: usize,
    pub train_seq: usize,
    /// Measured training steps after one warm-up step.
    pub train_steps: usize,
    /// Sequences per forward/backward pass; gradients accumulate over the batch.
    pub micro_batch: usize,
    /// Seed of the random training tokens.
    pub seed: u64,
}

impl Default for BenchConfig {
    fn default() -> Self {
        Self {
            batches: vec![1, 8, 32],
            new_tokens: 64,
            repeats: 2,
            train_batch: 8,
            train_seq: 256,
            train_steps: 2,
            micro_batch: 4,
            seed: 0,
        }
    }
}

/// One generation measurement.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationRun {
    pub batch: usize,
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// The training measurement: mean seconds per step over the measured steps.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingRun {
    pub batch: usize,
    pub seq_len: usize,
    pub steps: usize,
    pub forward_s: f64,
    pub backward_s: f64,
    pub optimizer_s: f64,
    pub step_s: f64,
    pub tokens_per_s: f64,
}

/// What one engine measured; the JSON both benches write.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub engine: String,
    pub model: String,
    pub threads: usize,
    pub new_tokens: usize,
    pub generation: Vec<GenerationRun>,
    pub training: Option<TrainingRun>,
    /// The process's peak resident memory.
    pub peak_rss_mb: Option<f64>,
    /// Row 0's reply at the first batch size, to eyeball that both engines say the same.
    pub greedy_reply: Option<String>,
}

/// Measures `policy` as described in the module doc, printing a line per measurement.
pub fn measure(policy: &Policy, model: &str, cfg: &BenchConfig) -> Result<Report> {
    if cfg.repeats == 0 || cfg.micro_batch == 0 {
        bail!("bench: --repeats and --micro-batch must be at least 1");
    }
    let (generation, greedy_reply) = bench_generation(policy, cfg)?;
    let training = if cfg.train_batch > 0 { Some(bench_training(policy, cfg)?) } else { None };
    Ok(Report {
        engine: format!("ragen-lab {} (candle {})", env!("CARGO_PKG_VERSION"), features()),
        model: model.to_string(),
        threads: rayon::current_num_threads(),
        new_tokens: cfg.new_tokens,
        generation,
        training,
        peak_rss_mb: peak_rss_mb(),
        greedy_reply,
    })
}

fn bench_generation(policy: &Policy, cfg: &BenchConfig) -> Result<(Vec<GenerationRun>, Option<String>)> {
    let prompt = policy.chat_tokens(&[Message::user(PROMPT)], true)?.ids;
    let gen_cfg = GenerationConfig { max_new_tokens: cfg.new_tokens, temperature: 0.0, ..Default::default() };
    let mut runs = Vec::new();
    let mut reply = None;
    for &batch in &cfg.batches {
        let prompts = vec![prompt.clone(); batch];
        let mut best: Option<(f64, usize)> = None;
        for _ in 0..cfg.repeats {
            let start = Instant::now();
            let gens = policy.generate(&prompts, &gen_cfg, &mut Rng::new(cfg.seed))?;
            let secs = start.elapsed().as_secs_f64();
            let generated: usize = gens.iter().map(|g| g.ids.len()).sum();
            if best.is_none_or(|(s, _)| secs < s) {
                best = Some((secs, generated));
            }
            if reply.is_none() {
                reply = gens.first().map(|g| g.text.clone());
            }
        }
        let (seconds, generated_tokens) = best.expect("repeats >= 1");
        let run = GenerationRun {
            batch,
            prompt_tokens: prompt.len(),
            generated_tokens,
            seconds,
            tokens_per_s: generated_tokens as f64 / seconds,
        };
        println!(
            "generation  batch {batch:>2}: {generated_tokens:>5} tokens in {seconds:7.2} s = {:8.1} tok/s",
            run.tokens_per_s
        );
        runs.push(run);
    }
    Ok((runs, reply))
}

fn bench_training(policy: &Policy, cfg: &BenchConfig) -> Result<TrainingRun> {
    let vocab = policy.model.cfg.vocab_size as u64;
    let mut rng = Rng::new(cfg.seed);
    let seqs: Vec<Vec<u32>> =
        (0..cfg.train_batch).map(|_| (0..cfg.train_seq).map(|_| rng.below(vocab) as u32).collect()).collect();
    let batch = TokenBatch::new(&seqs, policy.pad_id)?;
    let scored_tokens = (cfg.train_batch * cfg.train_seq.saturating_sub(1)).max(1) as f64;
    let named = policy.model.trainable_vars();
    // The trainer's AdamW with its default betas, eps and weight decay (0.01, as torch's).
    let mut opt = AdamW::new(named, 1e-5, &Default::default())?;
    let mut timings = Vec::new();
    for step in 0..=cfg.train_steps {
        let mut acc = candle_core::backprop::GradStore::default();
        let mut loss_sum = 0.0;
        phase::take();
        for micro in batch.split(cfg.micro_batch) {
            // Mean NLL over the whole batch: each micro-batch adds its share. The trainer's
            // path: chunked logits, and layer checkpoints when the model keeps them.
            let loss =
                policy.loss_and_grads(&micro, |s| Ok((s.logprobs.sum_all()? * (-1.0 / scored_tokens))?), &mut acc)?;
            loss_sum += loss as f64;
        }
        let clocks = phase::take();
        let (fwd, bwd) = (clocks.get(Phase::Forward), clocks.get(Phase::Backward));
        let t2 = Instant::now();
        opt.step(&acc, 0.0)?;
        let opt_s = t2.elapsed().as_secs_f64();
        let warm = if step == 0 { " (warm-up)" } else { "" };
        println!(
            "training step {step}: forward {fwd:.2} s, backward {bwd:.2} s, optimizer {opt_s:.2} s, loss {loss_sum:.4}{warm}"
        );
        if step > 0 {
            timings.push((fwd, bwd, opt_s));
        }
    }
    let n = timings.len().max(1) as f64;
    let mean = |f: fn(&(f64, f64, f64)) -> f64| timings.iter().map(f).sum::<f64>() / n;
    let (forward_s, backward_s, optimizer_s) = (mean(|t| t.0), mean(|t| t.1), mean(|t| t.2));
    let step_s = forward_s + backward_s + optimizer_s;
    let run = TrainingRun {
        batch: cfg.train_batch,
        seq_len: cfg.train_seq,
        steps: timings.len(),
        forward_s,
        backward_s,
        optimizer_s,
        step_s,
        tokens_per_s: (cfg.train_batch * cfg.train_seq) as f64 / step_s,
    };
    println!("training {}x{}: {step_s:.2} s/step = {:.1} tok/s", cfg.train_batch, cfg.train_seq, run.tokens_per_s);
    Ok(run)
}

/// A side-by-side table of two reports; the ratio is ours / theirs (above 1: we are faster).
pub fn comparison(ours: &Report, theirs: &Report) -> String {
    let mut out =
        format!("{:<28} {:>12} {:>12} {:>7}\n", "tokens/s", "ragen-lab", short_engine(&theirs.engine), "ratio");
    let mut row = |what: String, a: f64, b: f64| {
        out.push_str(&format!("{what:<28} {a:>12.1} {b:>12.1} {:>6.2}x\n", a / b));
    };
    for g in &ours.generation {
        if let Some(t) = theirs.generation.iter().find(|t| t.batch == g.batch) {
            row(format!("generation, batch {}", g.batch), g.tokens_per_s, t.tokens_per_s);
        }
    }
    if let (Some(a), Some(b)) = (&ours.training, &theirs.training) {
        row(format!("training, {}x{}", a.batch, a.seq_len), a.tokens_per_s, b.tokens_per_s);
        if (a.batch, a.seq_len) != (b.batch, b.seq_len) {
            out.push_str(&format!("note: PyTorch trained {}x{}, a different shape\n", b.batch, b.seq_len));
        }
    }
    let prompts: Vec<_> = ours.generation.iter().chain(&theirs.generation).map(|g| g.prompt_tokens).collect();
    if prompts.windows(2).any(|w| w[0] != w[1]) {
        out.push_str(
            "note: the prompts tokenized to different lengths; the generation figures are not like for like\n",
        );
    }
    if ours.threads != theirs.threads {
        out.push_str(&format!("note: threads differ ({} here, {} there)\n", ours.threads, theirs.threads));
    }
    out
}

fn short_engine(engine: &str) -> String {
    engine.split_whitespace().next().unwrap_or("other").to_string()
}

/// The speed-relevant cargo features this binary was built with.
pub fn features() -> String {
    let on: Vec<&str> = [
        ("avx512", cfg!(feature = "avx512")),
        ("mimalloc", cfg!(feature = "mimalloc")),
        ("mkl", cfg!(feature = "mkl")),
        ("cuda", cfg!(feature = "cuda")),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect();
    if on.is_empty() {
        "default build".into()
    } else {
        on.join("+")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(engine: &str, gen: &[(usize, f64)], train: Option<f64>) -> Report {
        Report {
            engine: engine.into(),
            model: "m".into(),
            threads: 2,
            new_tokens: 64,
            generation: gen
                .iter()
                .map(|&(batch, tps)| GenerationRun {
                    batch,
                    prompt_tokens: 47,
                    generated_tokens: 64 * batch,
                    seconds: 64.0 * batch as f64 / tps,
                    tokens_per_s: tps,
                })
                .collect(),
            training: train.map(|tps| TrainingRun {
                batch: 8,
                seq_len: 256,
                steps: 2,
                forward_s: 1.0,
                backward_s: 1.0,
                optimizer_s: 1.0,
                step_s: 3.0,
                tokens_per_s: tps,
            }),
            peak_rss_mb: None,
            greedy_reply: None,
        }
    }

    #[test]
    fn comparison_gives_ours_over_theirs_for_the_batches_both_measured() {
        let ours = report("ragen-lab", &[(1, 30.0), (8, 120.0), (32, 300.0)], Some(150.0));
        let theirs = report("pytorch 2.15", &[(1, 20.0), (8, 160.0)], Some(200.0));
        let table = comparison(&ours, &theirs);
        assert!(table.contains("generation, batch 1") && table.contains("1.50x"), "{table}");
        assert!(table.contains("generation, batch 8") && table.contains("0.75x"), "{table}");
        assert!(!table.contains("batch 32"), "{table}");
        assert!(table.contains("training, 8x256") && table.contains("0.75x"), "{table}");
        assert!(table.contains("pytorch"), "{table}");
    }

    #[test]
    fn report_round_trips_through_the_json_the_python_bench_writes() {
        let json = r#"{"engine": "pytorch 2.15.0 + transformers 5.24.0", "model": "x.gguf", "threads": 2,
            "machine": "x86_64", "new_tokens": 64,
            "generation": [{"batch": 1, "prompt_tokens": 47, "generated_tokens": 64, "seconds": 2.0, "tokens_per_s": 32.0}],
            "training": null, "peak_rss_mb": 1234.5, "greedy_reply": "The larger"}"#;
        let r: Report = serde_json::from_str(json).unwrap();
        assert_eq!(r.generation[0].tokens_per_s, 32.0);
        assert!(r.training.is_none());
        let back: Report = serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(back.generation[0].batch, 1);
    }

    #[test]
    fn measure_runs_generation_and_a_training_step_on_a_tiny_preset() {
        let policy = Policy::preset("tiny-llama", &candle_core::Device::Cpu).unwrap();
        let cfg = BenchConfig {
            batches: vec![1, 3],
            new_tokens: 5,
            repeats: 1,
            train_batch: 3,
            train_seq: 16,
            train_steps: 1,
            micro_batch: 2,
            seed: 7,
        };
        let r = measure(&policy, "tiny-llama", &cfg).unwrap();
        assert_eq!(r.generation.len(), 2);
        for g in &r.generation {
            // Every row yields 1..=5 tokens (it may stop at a stop id).
            assert!(g.generated_tokens >= g.batch && g.generated_tokens <= 5 * g.batch, "{g:?}");
            assert!(g.tokens_per_s > 0.0);
        }
        let t = r.training.unwrap();
        assert_eq!((t.batch, t.seq_len, t.steps), (3, 16, 1));
        assert!(t.step_s > 0.0 && t.tokens_per_s.is_finite());
    }
}
