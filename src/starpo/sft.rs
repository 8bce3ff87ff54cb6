//! Supervised warm start from solver demonstrations, before RL (RAGEN App. C compares SFT on BFS
//! trajectories, LoRA r64/α32, lr 1e-4, with StarPO). CleanRL-style: read [`sft`] top to bottom.
//!
//!   setup: the experiment and its settings (resolved as `train` resolves them), the model,
//!          LoRA adapters when `lora.rank > 0`, AdamW
//!   1. demonstrations: one solver-played episode per seed (agent::demo), in the experiment's
//!      own prompt and answer format, packed like rollout trajectories
//!   2. the mean NLL of held-out demonstrations (seeds after the training ones) before
//!      training: whether the model learns to read states it has not seen, not to recite
//!   3. epochs × shuffled mini-batches of `optim.mini_batch_size` episodes: the mean negative
//!      log-likelihood of the answer (assistant) tokens, gradients summed over micro-batches
//!      (`optim.micro_batch_size`, `optim.checkpoint_layers`), grad-norm clip, AdamW step at
//!      the schedule's learning rate (cosine to 0 by default: at a constant rate the last few
//!      mini-batches decide the model's favourite answer)
//!   4. the held-out NLL after; adapters merged into the weights; an HF folder that
//!      `train --model` loads, with sft.json (loss curve, settings, counts) and demos.jsonl
//!
//! The loss is a token mean over the whole mini-batch (every answer token weighs the same, the
//! usual SFT loss), not StarPO's per-sequence token mean. The learning rate is `--lr`, not
//! `optim.lr` (RL wants a far smaller one).
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::backprop::GradStore;
use serde::Serialize;
use serde_json::json;

use super::optim::AdamW;
use super::report::progress_bar;
use super::resume::resolve_settings;
use super::rundir::write_atomic;
use super::settings::{Optim, Preset, Settings};
use super::trainer::DEFAULT_MODEL;
use super::update::{micro_batches, rows_tensor};
use crate::agent::demo::{demonstrations, DemoStats};
use crate::agent::pack::Packed;
use crate::policy::{lora, Policy, Temperature};
use crate::rng::Rng;
use crate::script::{Experiment, Host, Limits};

/// `--lr` when LoRA is on (RAGEN App. C).
pub const LORA_LR: f64 = 1e-4;
/// `--lr` for a full fine-tune: every weight moves, so ten times smaller.
pub const FULL_LR: f64 = 1e-5;

/// What `ragen-lab sft` asks for.
pub struct Options {
    /// The experiment script (scripts/*.rhai); its env must define `solve(state)`.
    pub experiment: PathBuf,
    /// Model spec; `None`: the experiment's `model`, else [`DEFAULT_MODEL`].
    pub model: Option<String>,
    /// `--set key=value` flags, in order.
    pub sets: Vec<String>,
    /// `--param key=value`: env parameters over the experiment's `params`.
    pub params: Vec<(String, String)>,
    /// Demonstration episodes, one seed each.
    pub episodes: usize,
    pub epochs: usize,
    /// `None`: [`LORA_LR`] or [`FULL_LR`].
    pub lr: Option<f64>,
    pub lr_schedule: LrSchedule,
    /// First seed; `None`: `rollout.seed_base`.
    pub seed: Option<u64>,
    /// Held-out demonstration episodes (the seeds after the training ones) whose NLL is
    /// measured before and after; 0 skips the measurement.
    pub heldout: usize,
    /// The model folder to write (must not exist yet).
    pub out: PathBuf,
    pub progress: bool,
}

/// What a warm start did (written as sft.json).
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub experiment: PathBuf,
    pub model: String,
    pub out: PathBuf,
    pub lr: f64,
    pub lr_schedule: LrSchedule,
    pub epochs: usize,
    pub first_seed: u64,
    pub lora_rank: usize,
    /// The env parameters the demonstrations were played with (the experiment's, with `--param`).
    pub params: serde_json::Map<String, serde_json::Value>,
    pub demos: DemoStats,
    /// Held-out demonstration episodes (seeds after the training ones; unsolvable ones skipped).
    pub heldout_episodes: usize,
    /// Mean NLL per answer token of the held-out demonstrations, before and after training
    /// (`None` with `--heldout 0`). The training set's own loss is `epoch_loss`.
    pub heldout_nll_before: Option<f64>,
    pub heldout_nll_after: Option<f64>,
    /// Each epoch's training loss (token mean over its mini-batches, taken as they trained).
    pub epoch_loss: Vec<f64>,
    /// Each optimiser step's mini-batch loss and grad norm (before clipping).
    pub step_loss: Vec<f64>,
    pub step_grad_norm: Vec<f64>,
    pub seconds: f64,
    /// Wall-clock seconds of each part: demonstrations, the two NLL passes, training, saving.
    pub phase_seconds: PhaseSeconds,
    pub settings: Settings,
}

/// The learning rate over the fine-tune's steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// `--lr` at every step.
    Constant,
    /// Half a cosine from `--lr` at the first step down to 0 after the last.
    Cosine,
}

impl LrSchedule {
    /// The learning rate of step `step` (0-based) of `total`, from the peak `lr`.
    pub fn at(self, lr: f64, step: usize, total: usize) -> f64 {
        match self {
            LrSchedule::Constant => lr,
            LrSchedule::Cosine => lr * 0.5 * (1.0 + (std::f64::consts::PI * step as f64 / total.max(1) as f64).cos()),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseSeconds {
    pub demonstrations: f64,
    pub nll: f64,
    pub training: f64,
    pub save: f64,
}

pub fn sft(opts: Options) -> Result<Summary> {
    let t_start = Instant::now();
    // ---- setup -------------------------------------------------------------------------------
    if opts.out.exists() {
        bail!("{} already exists; pass another --out or remove it", opts.out.display());
    }
    if opts.episodes == 0 || opts.epochs == 0 {
        bail!("--episodes and --epochs must be at least 1");
    }
    let host = Host::for_script(&opts.experiment, Limits::from_env()?);
    let exp = Experiment::load(&host, &opts.experiment)?;
    let s = resolve_settings(Preset::StarpoS, None, &exp.settings, &exp.path, &opts.sets)?;
    let scripts = exp.scripts(&host)?;
    let params = scripts.env.params_with(&exp.params, &opts.params)?;
    let model = opts.model.clone().or(exp.model.clone()).unwrap_or_else(|| DEFAULT_MODEL.to_string());
    if opts.progress {
        eprintln!("ragen-lab sft: {} with {} → {}", opts.experiment.display(), model, opts.out.display());
    }
    let mut policy = Policy::load(&model, &crate::policy::device()?)?;
    let lora = s.lora_config()?;
    if let Some(cfg) = &lora {
        lora::attach(&mut policy.model, cfg, s.train.seed)?;
    }
    s.optim.plan_memory(&mut policy.model);
    let lr = opts.lr.unwrap_or(if lora.is_some() { LORA_LR } else { FULL_LR });
    let mut opt = AdamW::new(policy.model.trainable_vars(), lr, &s.optim)?;
    let mut rng = Rng::new(s.train.seed);
    let mut phases = PhaseSeconds::default();
    let mut clock = Instant::now();
    let mut lap = || std::mem::replace(&mut clock, Instant::now()).elapsed().as_secs_f64();

    // 1. Demonstrations: the solver plays one episode per seed, turn by turn as the rollout does.
    let first_seed = opts.seed.unwrap_or(s.rollout.seed_base);
    let seeds: Vec<u64> = (first_seed..first_seed + opts.episodes as u64).collect();
    let bar = progress_bar(opts.progress, "demonstrations", seeds.len() as u64);
    let (demos, stats) = demonstrations(&policy, &scripts, &params, &seeds, &s.rollout, |st| {
        bar.set_position((st.episodes + st.unsolvable) as u64);
    })?;
    bar.finish_and_clear();
    if demos.is_empty() {
        bail!("the solver found no solution for any of the {} seeds from {first_seed}", seeds.len());
    }
    let seqs: Vec<&Packed> = demos.iter().map(|d| &d.packed).collect();
    let next_seed = first_seed + opts.episodes as u64;
    let heldout_seeds: Vec<u64> = (next_seed..next_seed + opts.heldout as u64).collect();
    let (heldout, _) = demonstrations(&policy, &scripts, &params, &heldout_seeds, &s.rollout, |_| {})?;
    let heldout: Vec<&Packed> = heldout.iter().map(|d| &d.packed).collect();
    phases.demonstrations = lap();

    // 2. The held-out NLL before training.
    let heldout_nll =
        |policy: &Policy| (!heldout.is_empty()).then(|| nll(policy, &heldout, s.optim.micro_batch_size)).transpose();
    let heldout_nll_before = heldout_nll(&policy)?;
    phases.nll = lap();

    // 3. Epochs × shuffled mini-batches.
    let per_epoch = seqs.len().div_ceil(s.optim.mini_batch_size.max(1));
    let bar = progress_bar(opts.progress, "sft step", (opts.epochs * per_epoch) as u64);
    let (mut step_loss, mut step_grad_norm) = (Vec::new(), Vec::new());
    let mut optimizer_step = 0u64;
    let epoch_loss =
        fine_tune(&policy, &mut opt, &seqs, &s.optim, opts.epochs, opts.lr_schedule, &mut rng, |epoch, loss, norm| {
            optimizer_step += 1;
            // Adapter dropout draws follow the step.
            policy.model.dropout_seed.store(optimizer_step << 32, std::sync::atomic::Ordering::Relaxed);
            step_loss.push(loss);
            step_grad_norm.push(norm);
            bar.inc(1);
            bar.set_message(format!("epoch {}/{} loss {loss:.4}", epoch + 1, opts.epochs));
        })?;
    for (e, l) in epoch_loss.iter().enumerate() {
        bar.println(format!("epoch {}/{}: loss {l:.4}", e + 1, opts.epochs));
    }
    bar.finish_and_clear();
    phases.training = lap();

    // 4. The held-out NLL after; merge, save, summarise.
    let heldout_nll_after = heldout_nll(&policy)?;
    phases.nll += lap();
    if lora.is_some() {
        lora::merge(&mut policy.model)?;
    }
    policy.save(&opts.out).with_context(|| format!("saving the model to {}", opts.out.display()))?;
    phases.save = lap();
    let summary = Summary {
        experiment: opts.experiment.clone(),
        model,
        out: opts.out.clone(),
        lr,
        lr_schedule: opts.lr_schedule,
        epochs: opts.epochs,
        first_seed,
        lora_rank: s.lora.rank,
        params,
        demos: stats,
        heldout_episodes: heldout.len(),
        heldout_nll_before,
        heldout_nll_after,
        epoch_loss,
        step_loss,
        step_grad_norm,
        seconds: t_start.elapsed().as_secs_f64(),
        phase_seconds: phases,
        settings: s,
    };
    let dir = summary_dir(&opts.out);
    write_atomic(&dir.join("sft.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    let lines: Vec<String> = demos
        .iter()
        .map(|d| {
            json!({"seed": d.seed, "success": d.success, "score": d.score, "truncated": d.truncated, "turns": d.turns})
                .to_string()
        })
        .collect();
    write_atomic(&dir.join("demos.jsonl"), (lines.join("\n") + "\n").as_bytes())?;
    Ok(summary)
}

/// Where sft.json goes: the model folder's parent (the current folder for a bare name).
pub fn summary_dir(out: &Path) -> PathBuf {
    out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
}

/// `epochs` passes over `seqs` in shuffled mini-batches of `s.mini_batch_size`, one AdamW step
/// each at `schedule`'s rate (from `opt.lr`, the peak); `on_step(epoch, loss, grad_norm)` after
/// every step. Returns each epoch's loss: the token mean over its mini-batches, as they were
/// trained.
pub fn fine_tune(
    policy: &Policy,
    opt: &mut AdamW,
    seqs: &[&Packed],
    s: &Optim,
    epochs: usize,
    schedule: LrSchedule,
    rng: &mut Rng,
    mut on_step: impl FnMut(usize, f64, f64),
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(epochs);
    let (peak, total) = (opt.lr, epochs * seqs.len().div_ceil(s.mini_batch_size.max(1)));
    let mut taken = 0;
    for epoch in 0..epochs {
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        rng.shuffle(&mut order);
        let (mut sum, mut tokens) = (0.0, 0usize);
        for mb in order.chunks(s.mini_batch_size.max(1)) {
            let batch: Vec<&Packed> = mb.iter().map(|&i| seqs[i]).collect();
            opt.lr = schedule.at(peak, taken, total);
            taken += 1;
            let (loss, n, norm) = step(policy, opt, &batch, s)?;
            sum += loss * n as f64;
            tokens += n;
            on_step(epoch, loss, norm);
        }
        out.push(sum / tokens.max(1) as f64);
    }
    Ok(out)
}

/// One optimiser step on a mini-batch: returns its loss (the mean NLL of its answer tokens), the
/// number of those tokens, and the grad norm before clipping.
fn step(policy: &Policy, opt: &mut AdamW, batch: &[&Packed], s: &Optim) -> Result<(f64, usize, f64)> {
    let n_tokens: usize = batch.iter().map(|p| p.assistant_tokens()).sum();
    if n_tokens == 0 {
        return Ok((0.0, 0, 0.0));
    }
    let mut grads = GradStore::default();
    let mut loss = 0.0;
    for (tb, mask) in passes(policy, batch, s.micro_batch_size)? {
        // This micro-batch's −Σ log p over the mini-batch's token count: the micro-batches'
        // gradients add up to the gradient of the mini-batch's mean.
        let scale = -1.0 / n_tokens as f64;
        let l =
            policy.loss_and_grads(&tb, |scored| Ok(((&scored.logprobs * &mask)?.sum_all()? * scale)?), &mut grads)?;
        loss += l as f64;
    }
    let norm = opt.step(&grads, s.grad_clip)?;
    Ok((loss, n_tokens, norm))
}

/// The mean negative log-likelihood per answer token of `seqs`, without a graph.
pub fn nll(policy: &Policy, seqs: &[&Packed], micro_batch_size: usize) -> Result<f64> {
    let (mut sum, mut n) = (0.0f64, 0usize);
    for (tb, mask) in passes(policy, seqs, micro_batch_size)? {
        let lp = policy.token_logprobs_no_grad(&tb)?.logprobs;
        sum -= (lp * &mask)?.sum_all()?.to_scalar::<f32>()? as f64;
    }
    for p in seqs {
        n += p.assistant_tokens();
    }
    if n == 0 {
        return Err(anyhow!("no answer tokens to score"));
    }
    Ok(sum / n as f64)
}

/// The trainer's micro-batches of `seqs` (rows sharing a prompt compute it once), each with its
/// answer-token mask `[B, T]`.
fn passes(
    policy: &Policy,
    seqs: &[&Packed],
    micro_batch_size: usize,
) -> Result<Vec<(crate::policy::TokenBatch, candle_core::Tensor)>> {
    let all: Vec<usize> = (0..seqs.len()).collect();
    micro_batches(seqs, &all, micro_batch_size, policy.pad_id, Temperature::ONE)?
        .into_iter()
        .map(|(rows, tb)| {
            let m: Vec<Vec<f32>> =
                rows.iter().map(|&i| seqs[i].mask.iter().map(|&x| x as u8 as f32).collect()).collect();
            let mask = rows_tensor(&m, tb.len, policy.device())?;
            Ok((tb, mask))
        })
        .collect()
}

impl Summary {
    /// The one-screen summary printed at the end of `ragen-lab sft`.
    pub fn render(&self) -> String {
        let d = &self.demos;
        let p = &self.phase_seconds;
        let mut out = format!(
            "ragen-lab sft: done in {:.0} s (demonstrations {:.0}, NLL {:.0}, training {:.0}, saving {:.0})\n",
            self.seconds, p.demonstrations, p.nll, p.training, p.save
        );
        out += &format!(
            "  demonstrations  {} episodes (seeds {}..{}, {} unsolvable skipped), {} turns\n",
            d.episodes,
            self.first_seed,
            self.first_seed + (d.episodes + d.unsolvable) as u64,
            d.unsolvable,
            d.turns
        );
        out += &format!("  solver success  {:.3} (played by the solver itself)\n", d.solved_fraction());
        out += &format!("  tokens          {} ({} in answers, the loss's)\n", d.tokens, d.assistant_tokens);
        if d.format_errors + d.invalid_actions + d.over_response_length > 0 {
            out += &format!(
                "  warnings        {} format errors, {} invalid actions, {} answers over rollout.response_length\n",
                d.format_errors, d.invalid_actions, d.over_response_length
            );
        }
        out += &format!(
            "  training        {} epochs, {} steps, lr {:e} ({:?}), {}\n",
            self.epochs,
            self.step_loss.len(),
            self.lr,
            self.lr_schedule,
            if self.lora_rank > 0 { format!("LoRA r{} (merged)", self.lora_rank) } else { "full fine-tune".into() }
        );
        for (e, l) in self.epoch_loss.iter().enumerate() {
            out += &format!("  epoch {:<9} loss {l:.4}\n", e + 1);
        }
        if let (Some(before), Some(after)) = (self.heldout_nll_before, self.heldout_nll_after) {
            out += &format!(
                "  held-out nll    {before:.4} → {after:.4} (per answer token, {} unseen episodes)\n",
                self.heldout_episodes
            );
        }
        out += &format!("  model           {}\n", self.out.display());
        out += &format!("  summary         {}\n", summary_dir(&self.out).join("sft.json").display());
        out += &format!("  next: ragen-lab train --env {} --model {}\n", self.experiment.display(), self.out.display());
        out
    }
}
