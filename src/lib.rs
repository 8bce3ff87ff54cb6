//! ragen-lab: multi-turn RL for LLM agents (StarPO / StarPO-S, after RAGEN) on candle,
//! with environments, prompt templates and reward shaping written as Rhai scripts.
//!
//! One idea per module (see DESIGN.md):
//! - [`script`]: the sandboxed Rhai host, env/prompt/reward bindings, live reload.
//! - [`agent`]: turn parsing, per-episode chat history, the batched multi-turn rollout.
//! - [`policy`]: the transformer (Llama, Qwen2) with LoRA, loading, tokenizer + chat template,
//!   the constrained-answer grammar, batched sampling, differentiable log-probs, value head.
//! - [`remote`]: the OpenAI-compatible wire format and its HTTP client.
//! - [`starpo`]: settings, normalisation, filtering, advantages, losses, the update, the trainer
//!   loop; eval and the supervised warm start.
//! - [`metrics`]: metric keys, the run reader, Echo-Trap diagnostics, plots, TensorBoard.
//! - [`view`]: the dashboard of a run (an offline page, or served live).
//! - [`serve`]: `ragen-lab serve`, an OpenAI-compatible server on the policy.
//! - [`cli`]: one thin file per subcommand.
//! - [`phase`], [`rng`]: per-thread clocks of a step's phases; the project's seeded generator.
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
