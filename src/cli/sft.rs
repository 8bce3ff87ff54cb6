//! `ragen-lab sft`: resolve the flags into `starpo::sft::Options`, run the warm start, print the
//! summary.
use std::path::{Path, PathBuf};

use anyhow::Result;

use super::train::{assignments, utc_stamp};
use crate::starpo::sft::{sft, LrSchedule, Options};

/// Warm-start a model from the env's own solver before RL: supervised fine-tuning on
/// demonstrations.
///
/// For each of --episodes seeds the env's `fn solve(state)` plays one episode turn by turn, as a
/// training rollout would: the experiment's prompt template, its settings (rollout.max_turns,
/// max_actions_per_turn, think, context_window), the same turn parser and env steps. Every turn
/// it re-plans from the current state and answers with the plan's first k actions,
/// `<answer>A || B</answer>` (think mode: `<think>Shortest path: A, B, C.</think>` first). The
/// model is then fine-tuned on the answers (mean negative log-likelihood of the assistant tokens,
/// AdamW, `optim.mini_batch_size` episodes per step, `optim.micro_batch_size` per pass; LoRA
/// when lora.rank > 0, merged on save) and written as a Hugging Face folder:
///
///   ragen-lab sft --env scripts/frozenlake.rhai --episodes 256
///   ragen-lab train --env scripts/frozenlake.rhai --model runs/frozenlake-sft-<date>/model
///
/// sft.json (loss curve, settings, counts) and demos.jsonl (every demonstration) go beside the
/// model folder. envs/frozenlake.rhai and envs/sokoban.rhai have solvers.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The experiment script (scripts/*.rhai); its env must define `fn solve(state)`.
    #[arg(long, value_name = "SCRIPT")]
    pub env: PathBuf,
    /// Demonstration episodes, one seed each (seeds that the solver cannot solve are skipped).
    #[arg(long, default_value_t = 256)]
    pub episodes: usize,
    /// Passes over the demonstrations.
    #[arg(long, default_value_t = 2)]
    pub epochs: usize,
    /// Learning rate (default: 1e-4 with LoRA, as RAGEN's SFT; 1e-5 for a full fine-tune).
    /// optim.lr is RL's and is not used here.
    #[arg(long)]
    pub lr: Option<f64>,
    /// How the learning rate moves over the steps: cosine (from --lr down to 0; at a constant
    /// rate the last few mini-batches decide the model's favourite answer) or constant.
    #[arg(long, value_enum, default_value_t = LrSchedule::Cosine)]
    pub lr_schedule: LrSchedule,
    /// First demonstration seed (default: rollout.seed_base, the first training seed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Held-out demonstration episodes (the seeds after the training ones) whose NLL per answer
    /// token is measured before and after training: falling there means the model learnt to read
    /// states it never saw. 0 skips it.
    #[arg(long, default_value_t = 32)]
    pub heldout: usize,
    /// The model to start from: an HF folder, a .gguf file, a preset (tiny-llama), a known short
    /// name (smollm2-135m) or a hub id. Default: the experiment script's `model`, else smollm2-135m.
    #[arg(long)]
    pub model: Option<String>,
    /// Override a setting as train does, e.g. `--set lora.rank=64 --set optim.mini_batch_size=16`
    /// (repeatable). The rollout.* settings shape the demonstrations.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Override an env parameter of the demonstrations as `train --param` does, e.g.
    /// `--param observation_format=coord` (repeatable; over the experiment's `params`). Pass the
    /// same to the `train` that follows: the model learns the states it is shown.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// The model folder to write; it must not exist (default runs/<experiment>-sft-<date>/model).
    /// sft.json and demos.jsonl go to its parent.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let stem = args.env.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let out = args.out.unwrap_or_else(|| Path::new("runs").join(format!("{stem}-sft-{}", utc_stamp())).join("model"));
    let summary = sft(Options {
        experiment: args.env,
        model: args.model,
        sets: args.sets,
        params: assignments(&args.params)?,
        episodes: args.episodes,
        epochs: args.epochs,
        lr: args.lr,
        lr_schedule: args.lr_schedule,
        seed: args.seed,
        heldout: args.heldout,
        out,
        progress: !args.quiet,
    })?;
    print!("{}", summary.render());
    Ok(())
}
