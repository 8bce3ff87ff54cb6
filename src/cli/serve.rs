//! `ragen-lab serve`: resolve the flags into `serve::Options` and serve until interrupted.
use std::net::IpAddr;

use anyhow::Result;

use crate::serve::{serve, Options};

/// Serve a model over an OpenAI-compatible HTTP API, for `ragen-lab eval`, your own clients or
/// an RL rollout.
///
/// Routes: GET /health, GET /v1/models, POST /v1/chat/completions, POST /v1/completions;
/// streaming (`"stream": true`), the sampled tokens' log-probs (`logprobs`), token ids in
/// (`prompt` as a list of ids) and out (`return_token_ids`), and vLLM's `top_k`, `min_p`,
/// `continue_final_message`, `include_stop_str_in_output`. Concurrent requests that sample the
/// same way are batched into one generation.
///
///   ragen-lab serve smollm2-135m --port 8000
///   ragen-lab eval --env scripts/bandit.rhai --endpoint http://127.0.0.1:8000/v1 --model smollm2-135m
#[derive(clap::Args, Debug)]
pub struct Args {
    /// What to serve: a model (HF folder, .gguf file, preset, short name, hub id), a run
    /// directory (its latest checkpoint), a checkpoint directory, or a LoRA adapter folder.
    pub model: String,
    /// The name clients ask for in `model` (default: MODEL as given).
    #[arg(long)]
    pub name: Option<String>,
    /// Address to listen on (0.0.0.0 to accept other machines).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port (0 = any free one; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Most requests generated together in one batch.
    #[arg(long, default_value_t = 64)]
    pub max_batch: usize,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(args: Args) -> Result<()> {
    let name = args.name.clone().unwrap_or_else(|| args.model.clone());
    let opts = Options {
        model: args.model,
        name: Some(name.clone()),
        ip: args.host,
        port: args.port,
        max_batch: args.max_batch,
        seed: args.seed,
    };
    serve(opts, |addr| eprintln!("ragen-lab serve: {name} on http://{addr}/v1 (Ctrl-C stops)"))
}
