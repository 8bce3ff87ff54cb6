//! Generation on inference engines over HTTP (`rollout.backend = "http"`): the rollout's
//! prompts, as token ids, go to `/v1/completions` on `rollout.endpoints` (spread over them,
//! all in flight at once), and the engines answer with token ids (`return_token_ids`) and the
//! sampled tokens' log-probs, so nothing is decoded and re-encoded on the way. The trainer pushes
//! its weights after each update ([`WeightSync`]): a LoRA adapter in PEFT layout through
//! `/v1/load_lora_adapter` (vLLM; `ragen-lab serve` answers it too), then requested by name; or a
//! full model folder through `/update_weights_from_disk` (SGLang; `ragen-lab serve`). The engine
//! reads the folder itself, so it must see the run directory's disk.
//!
//! An engine that restarts loses what was pushed: after a dropped connection or a 404 for the
//! synced adapter the last sync is pushed again and the request repeated, so no sample comes
//! from stale weights. Retries are counted for the trainer to report.
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use super::settings::Rollout;
use crate::policy::{Finish, Generation, GenerationConfig, Policy};
use crate::remote::client::Refused;
use crate::remote::wire::{
    restore_stop, AnswerSpec, CompletionRequest, CompletionResponse, LoadLora, Prompt, Sampling, Stop, UpdateFromDisk,
};
use crate::remote::Endpoint;
use crate::rng::Rng;

/// The name the synced adapter is requested by.
pub const ADAPTER_NAME: &str = "ragen-lab-policy";

/// Weights pushed to the engines.
#[derive(Clone, Debug, PartialEq)]
pub enum WeightSync {
    /// A PEFT adapter folder, served as [`ADAPTER_NAME`].
    Lora { path: String },
    /// A Hugging Face model folder that replaces the served weights.
    Disk { path: String },
}

pub struct HttpEngine {
    endpoints: Vec<Endpoint>,
    /// The served base model's name.
    base: String,
    /// The last sync, pushed again to an engine that lost it.
    synced: Option<WeightSync>,
}

impl HttpEngine {
    /// Connects to `rollout.endpoints` (comma-separated URLs) and learns the base model's name
    /// (`rollout.engine_model`, else the first model the first endpoint lists).
    pub fn connect(s: &Rollout) -> Result<Self> {
        let urls: Vec<&str> = s.endpoints.split(',').map(str::trim).filter(|u| !u.is_empty()).collect();
        if urls.is_empty() {
            bail!("rollout.backend = \"http\" needs rollout.endpoints, e.g. --set rollout.endpoints=http://127.0.0.1:8000/v1");
        }
        let endpoints = urls
            .iter()
            .map(|u| Endpoint::new(u, std::env::var("RAGEN_ENGINE_API_KEY").ok(), Duration::from_secs(600)))
            .collect::<Result<Vec<_>>>()?;
        let base = if s.engine_model.is_empty() {
            let names =
                endpoints[0].models().with_context(|| format!("asking {} for its models", endpoints[0].base))?;
            names.into_iter().next().ok_or_else(|| anyhow!("{} serves no model", endpoints[0].base))?
        } else {
            s.engine_model.clone()
        };
        Ok(Self { endpoints, base, synced: None })
    }

    /// Retries made so far, over all endpoints.
    pub fn retries(&self) -> usize {
        self.endpoints.iter().map(|e| e.retried.load(Ordering::Relaxed)).sum()
    }

    /// The model name requests ask for.
    fn model(&self) -> &str {
        match &self.synced {
            Some(WeightSync::Lora { .. }) => ADAPTER_NAME,
            _ => &self.base,
        }
    }

    /// Pushes new weights to every engine.
    pub fn sync(&mut self, sync: WeightSync) -> Result<()> {
        for ep in &self.endpoints {
            push(ep, &sync)?;
        }
        self.synced = Some(sync);
        Ok(())
    }

    /// Pushes `policy`'s weights: its LoRA adapter, or the whole model, written to
    /// `root/step-N` (the engines read it from there; the folder of the previous push goes).
    pub fn sync_policy(&mut self, policy: &Policy, root: &Path, step: u64) -> Result<()> {
        let dir = root.join(format!("step-{step:06}"));
        let _ = std::fs::remove_dir_all(&dir);
        policy.save(&dir)?;
        let path = dir.canonicalize()?.to_string_lossy().into_owned();
        self.sync(match policy.model.lora {
            Some(_) => WeightSync::Lora { path },
            None => WeightSync::Disk { path },
        })?;
        for old in std::fs::read_dir(root)?.flatten().filter(|e| e.path() != dir) {
            let _ = std::fs::remove_dir_all(old.path());
        }
        Ok(())
    }

    /// Generates a continuation of every prompt; `rng` draws each request's seed.
    pub fn generate(&self, prompts: &[Vec<u32>], cfg: &GenerationConfig, rng: &mut Rng) -> Result<Vec<Generation>> {
        if cfg.forcing.is_some() {
            bail!("rollout.think_budget acts inside the local sampler; it is not available with rollout.backend = \"http\"");
        }
        let answer_grammar = |row: usize| {
            cfg.constraint_of(row).map(|g| {
                let (actions, max_actions, starts_inside) = g.parts();
                AnswerSpec { actions, max_actions, starts_inside }
            })
        };
        let requests: Vec<CompletionRequest> = prompts
            .iter()
            .enumerate()
            .map(|(row, p)| CompletionRequest {
                model: self.model().to_string(),
                prompt: Prompt::Ids(p.clone()),
                sampling: Sampling {
                    max_tokens: Some(cfg.max_new_tokens),
                    temperature: Some(cfg.temperature),
                    top_p: Some(cfg.top_p),
                    top_k: Some(cfg.top_k as i64),
                    min_p: Some(0.0),
                    stop: Some(Stop::Many(cfg.stop_strings.clone())),
                    seed: Some(rng.next_u64()),
                    include_stop_str_in_output: Some(true),
                    return_token_ids: Some(true),
                    answer_grammar: answer_grammar(row),
                    ..Sampling::default()
                },
                // 1, not 0: llama-server returns no log-probs for 0 (vLLM gives the sampled
                // token's either way).
                logprobs: Some(1),
            })
            .collect();
        std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .enumerate()
                .map(|(i, req)| {
                    scope
                        .spawn(move || self.complete(&self.endpoints[i % self.endpoints.len()], req, &cfg.stop_strings))
                })
                .collect();
            handles.into_iter().map(|h| h.join().map_err(|_| anyhow!("a request thread panicked"))?).collect()
        })
    }

    /// One request; when the engine restarted under it (a dropped connection) or lost the
    /// adapter (404), the last sync is pushed again and the request repeated.
    fn complete(&self, ep: &Endpoint, req: &CompletionRequest, stop: &[String]) -> Result<Generation> {
        for _ in 0..3 {
            let dropped = ep.dropped.load(Ordering::Relaxed);
            let answer = ep.completions(req);
            let lost = match &answer {
                Err(e) => e.chain().any(|c| c.downcast_ref::<Refused>().is_some_and(|r| r.code == 404)),
                Ok(_) => ep.dropped.load(Ordering::Relaxed) != dropped,
            };
            match (&self.synced, lost) {
                (Some(sync), true) => push(ep, sync).context("pushing the weights again to a restarted engine")?,
                _ => return generation(answer?, &ep.base, stop),
            }
        }
        bail!("{}: the engine keeps losing the pushed weights", ep.base)
    }
}

fn push(ep: &Endpoint, sync: &WeightSync) -> Result<()> {
    match sync {
        WeightSync::Lora { path } => {
            let body = LoadLora { lora_name: ADAPTER_NAME.into(), lora_path: path.clone(), load_inplace: true };
            ep.post_value("/load_lora_adapter", &body)
        }
        WeightSync::Disk { path } => {
            // SGLang's route sits at the server root, not under /v1.
            let body = UpdateFromDisk { model_path: path.clone(), weight_version: None };
            ep.post_value_at_root("/update_weights_from_disk", &body)
        }
    }
    .with_context(|| format!("{}: pushing the weights ({sync:?})", ep.base))
}

/// A completions answer as the rollout's [`Generation`].
fn generation(resp: CompletionResponse, base: &str, stop_strings: &[String]) -> Result<Generation> {
    let c = resp.choices.into_iter().next().ok_or_else(|| anyhow!("{base}: an answer without choices"))?;
    let l = c.logprobs.unwrap_or_default();
    // llama-server gives the ids only inside its chat-shaped log-probs.
    let content_ids = || l.content.iter().map(|t| t.id).collect::<Option<Vec<u32>>>().filter(|ids| !ids.is_empty());
    let ids = c.token_ids.or_else(content_ids).ok_or_else(|| {
        anyhow!("{base}: the answer has no token ids; the engine must return them (vLLM and ragen-lab serve: return_token_ids; llama-server: logprobs with ids)")
    })?;
    let logprobs = match l.token_logprobs.is_empty() {
        true => l.content.iter().map(|t| t.logprob).collect(),
        false => l.token_logprobs,
    };
    let finish = match (c.finish_reason.as_deref(), &c.stop_reason) {
        (Some("length"), _) => Finish::Length,
        (_, Some(serde_json::Value::String(_))) => Finish::Stop,
        _ => Finish::Eos,
    };
    // llama-server drops the stop string (and its ids) from the reply: the text gets it back.
    let text = match stop_strings.first() {
        Some(stop) => restore_stop(c.text, c.finish_reason.as_deref(), c.stop_reason.as_ref(), stop),
        None => c.text,
    };
    Ok(Generation { ids, text, logprobs, finish, forced: false, end_logprob: None })
}
