//! `ragen-lab eval`: resolve the flags into `starpo::eval::Options`, run, print the summary.
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};

use super::train::utc_stamp;
use crate::starpo::eval::{eval, Options};

/// Evaluate a model served over HTTP (any OpenAI-compatible chat endpoint: `ragen-lab serve`,
/// vLLM, SGLang, llama-server, a hosted API) on an experiment's validation episodes.
///
/// The episodes are the trainer's validation: seeds train.val_seed onwards, train.val_samples
/// episodes each, at train.val_temperature, multi-turn with the experiment's prompt template,
/// env and reward scripts (and its held-out variant where it has one). The run directory has the
/// trainer's layout, so `ragen-lab view` and `plot` read it; an interrupted eval continues when
/// run again with the same --run-dir.
///
///   ragen-lab eval --env scripts/bandit.rhai --endpoint http://127.0.0.1:8000/v1 --model smollm2-135m
///   OPENAI_API_KEY=… ragen-lab eval --env scripts/bandit.rhai --endpoint https://api.example.com/v1 \
///       --model some-model --plain-api
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The experiment script (scripts/*.rhai).
    #[arg(long, value_name = "SCRIPT")]
    pub env: PathBuf,
    /// The endpoint: http://host:port or its /v1 root.
    #[arg(long, value_name = "URL")]
    pub endpoint: String,
    /// The model name the endpoint serves (GET /v1/models lists them).
    #[arg(long)]
    pub model: String,
    /// The environment variable holding the API key (sent as a bearer token, never printed).
    #[arg(long, value_name = "VAR", default_value = "OPENAI_API_KEY")]
    pub api_key_env: String,
    /// Validation seeds to play (default train.val_groups); each is played train.val_samples times.
    #[arg(long)]
    pub seeds: Option<usize>,
    /// Episodes in flight at once (each sends one request per turn).
    #[arg(long, default_value_t = 8)]
    pub concurrency: usize,
    /// Seconds before a request is given up (then retried).
    #[arg(long, default_value_t = 300)]
    pub timeout: u64,
    /// Attempts after a failed request (429, 5xx, a dropped connection), waiting 0.5 s, 1 s,
    /// 2 s, … (or the server's Retry-After) between them.
    #[arg(long, default_value_t = 5)]
    pub retries: usize,
    /// Only standard OpenAI request fields: no prefilled `<answer>`/`<think>` tag
    /// (continue_final_message) and no top_k/min_p/include_stop_str_in_output, for APIs that
    /// refuse unknown fields.
    #[arg(long)]
    pub plain_api: bool,
    /// Override a setting, e.g. `--set train.val_samples=4` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// The run directory (default runs/<experiment>-eval-<date>); an existing eval there continues.
    #[arg(long, value_name = "DIR")]
    pub run_dir: Option<PathBuf>,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let stem = args.env.file_stem().and_then(|s| s.to_str()).unwrap_or("run").to_string();
    let run_dir = args.run_dir.unwrap_or_else(|| Path::new("runs").join(format!("{stem}-eval-{}", utc_stamp())));
    let api_key = std::env::var(&args.api_key_env).ok().filter(|k| !k.is_empty());
    let summary = eval(Options {
        experiment: args.env,
        endpoint: args.endpoint,
        model: args.model,
        api_key,
        seeds: args.seeds,
        concurrency: args.concurrency,
        sets: args.sets,
        run_dir,
        timeout: Duration::from_secs(args.timeout),
        retries: args.retries,
        plain_api: args.plain_api,
        progress: !args.quiet,
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&summary).context("summary as JSON")?);
    } else {
        print!("{}", summary.render());
    }
    Ok(())
}
