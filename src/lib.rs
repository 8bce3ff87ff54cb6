//! ragen-lab: multi-turn RL for LLM agents (StarPO / StarPO-S, after RAGEN) on candle,
//! with environments, prompt templates and reward shaping written as Rhai scripts.
//!
//! One idea per module (see DESIGN.md):
//! - [`script`]: the sandboxed Rhai host, env/prompt/reward bindings, live reload.
//! - [`agent`]: turn parsing, per-episode chat history, the batched multi-turn rollout.
//! - [`policy`]: the transformer (Llama, Qwen2), loading, tokenizer + chat template,
//!   batched sampling, differentiable log-probs, value head.
//! - [`starpo`]: settings, normalisation, filtering, advantages, losses, the trainer loop.
//! - [`metrics`]: the run log, Echo-Trap diagnostics, plots.
//! - [`view`]: the dashboard of a run (offline page, or served live).
//! - [`phase`]: per-thread clocks of a training step's phases.
#[macro_use]
mod macros;

pub mod agent;
pub mod cli;
pub mod metrics;
pub mod phase;
pub mod policy;
pub mod remote;
pub mod rng;
pub mod script;
pub mod serve;
pub mod starpo;
pub mod view;
