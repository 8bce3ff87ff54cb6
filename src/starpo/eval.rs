//! `ragen-lab eval`: the experiment's validation episodes played by a model served over HTTP
//! (any OpenAI-compatible chat endpoint: `ragen-lab serve`, vLLM, SGLang, llama-server, a
//! hosted API). Each episode is played as the trainer's validation plays it, turn by turn: the
//! same seeds (`train.val_seed` onwards), `train.val_samples` episodes per seed, the prompt
//! template, the context window, the turn parser, the env and the reward scripts
//! ([`Turns::user_turn`], [`Play::take_reply`]); only the reply comes from the endpoint, at
//! `train.val_temperature`. `C` episodes are in flight at once.
//!
//! The run directory has the trainer's layout (settings.json, events.jsonl with a `validation`
//! event at step 0, `rollouts/val-step-000000.jsonl` and `val-heldout-…`), so `view` and `plot`
//! read it. Each finished episode is appended at once: an interrupted eval, run again with the
//! same `--run-dir`, plays only the episodes that are missing.
//!
//! Over HTTP there is no tokenizer: `think_tokens` counts words, `response_tokens` is the
//! server's `usage.completion_tokens`, and `rollout.max_context_tokens` is the server's to
//! enforce. `rollout.constrain_actions` is sent as `answer_grammar`, which `ragen-lab serve`
//! applies and other engines ignore; `rollout.think_budget` acts inside our sampler and is not
//! applied.
use std::collections::{HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::mpsc::channel;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::report::progress_bar;
use super::report::{solver_agreement, trajectory_line};
use super::resume::resolve_settings;
use super::rundir::{append_line, RunDir};
use super::{settings::Preset, Settings};
use crate::agent::rollout::{Play, Reply, Turns, Versions};
use crate::metrics::keys::Key;
use crate::remote::wire::{restore_stop, AnswerSpec, ChatMessage, ChatRequest, Sampling, Stop};
use crate::remote::Endpoint;
use crate::script::{Experiment, Host, Limits};

pub struct Options {
    pub experiment: PathBuf,
    /// The endpoint's URL (`http://host:port` or `…/v1`).
    pub endpoint: String,
    /// The model name the endpoint serves.
    pub model: String,
    pub api_key: Option<String>,
    /// Validation seeds to play (`None`: `train.val_groups`); each `train.val_samples` times.
    pub seeds: Option<usize>,
    /// Episodes in flight at once.
    pub concurrency: usize,
    /// `--set key=value` flags.
    pub sets: Vec<String>,
    pub run_dir: PathBuf,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Attempts after a failed request (429, 5xx, a dropped connection), with backoff.
    pub retries: usize,
    /// Send only standard OpenAI fields (no prefill of the opening tag, no `top_k`/`min_p`).
    pub plain_api: bool,
    pub progress: bool,
}

/// One variant's results (the training params as `val`, the held-out ones as `val_heldout`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct VariantSummary {
    pub key: String,
    pub episodes: usize,
    pub success: f64,
    /// Share of seeds with at least one success among their `k` episodes.
    pub pass_at_k: f64,
    pub reward_mean: f64,
    pub format_error_rate: f64,
    /// Mean generated tokens per turn (the server's count).
    pub response_tokens_mean: f64,
    /// Share of turns whose first action is the env solver's first move (envs with `fn solve`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub solver_agreement: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    pub run_dir: PathBuf,
    pub model: String,
    pub k: usize,
    pub variants: Vec<VariantSummary>,
    /// Episodes played by this invocation (the others were already in the run directory).
    pub played: usize,
    /// Requests of this invocation, their tokens, latency quantiles (seconds) and retries.
    pub requests: usize,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub latency_p50_s: f64,
    pub latency_p99_s: f64,
    pub retries: usize,
    pub seconds: f64,
}

impl Summary {
    pub fn render(&self) -> String {
        let mut out = String::new();
        for v in &self.variants {
            out += &format!(
                "{:<12} success {:.3}  pass@{} {:.3}  reward {:.3}  format errors {:.3}  tokens/turn {:.1}  ({} episodes)\n",
                v.key, v.success, self.k, v.pass_at_k, v.reward_mean, v.format_error_rate, v.response_tokens_mean, v.episodes
            );
        }
        out += &format!(
            "{} episodes played, {} requests ({} prompt + {} completion tokens), latency p50 {:.2}s p99 {:.2}s, {} retries, {:.1}s → {}\n",
            self.played,
            self.requests,
            self.prompt_tokens,
            self.completion_tokens,
            self.latency_p50_s,
            self.latency_p99_s,
            self.retries,
            self.seconds,
            self.run_dir.display()
        );
        out
    }
}

/// One episode to play.
#[derive(Clone)]
struct EpisodeJob {
    variant: usize,
    group: usize,
    index: usize,
    seed: u64,
}

/// What a worker hands back per episode: the trajectory line and its requests' numbers.
struct EpisodeResult {
    variant: usize,
    line: Value,
    latencies: Vec<f64>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

pub fn eval(opts: Options) -> Result<Summary> {
    let t_start = Instant::now();
    let limits = Limits::from_env()?;
    let host = Host::for_script(&opts.experiment, limits);
    let exp = Experiment::load(&host, &opts.experiment)?;
    let s = resolve_settings(Preset::StarpoS, None, &exp.settings, &exp.path, &opts.sets)?;
    let scripts = exp.scripts(&host)?;
    let mut variants = vec![("val", "val", scripts.env.params_from(&exp.params)?)];
    if let Some(v) = &exp.val_params {
        variants.push(("val_heldout", "val-heldout", scripts.env.params_from(v)?));
    }
    let n_seeds = opts.seeds.unwrap_or(s.train.val_groups);
    if n_seeds == 0 || opts.concurrency == 0 {
        bail!("--seeds and --concurrency must be at least 1");
    }
    let mut endpoint = Endpoint::new(&opts.endpoint, opts.api_key.clone(), opts.timeout)?;
    endpoint.retries = opts.retries;
    let endpoint = Arc::new(endpoint);

    // The run directory: a fresh one, or the same eval continued.
    let record = json!({
        "kind": "eval", "experiment": exp.path, "endpoint": endpoint.base, "model": opts.model,
        "seeds": n_seeds, "plain_api": opts.plain_api, "settings": s,
        "params": exp.params, "val_params": exp.val_params,
    });
    let run = open_run_dir(&opts.run_dir, &record)?;
    run.write_settings(&record)?;
    let file = |v: usize| run.path.join("rollouts").join(format!("{}-step-000000.jsonl", variants[v].1));
    let mut lines: Vec<Vec<Value>> = Vec::new();
    for v in 0..variants.len() {
        lines.push(
            crate::metrics::run::read_jsonl(&file(v)).unwrap_or_default().into_iter().map(Value::Object).collect(),
        );
    }
    let done: HashSet<(usize, u64, u64)> = lines
        .iter()
        .enumerate()
        .flat_map(|(v, ls)| {
            ls.iter().map(move |l| (v, l["group"].as_u64().unwrap_or(0), l["episode"].as_u64().unwrap_or(0)))
        })
        .collect();
    let mut queue = VecDeque::new();
    for v in 0..variants.len() {
        for group in 0..n_seeds {
            for index in 0..s.train.val_samples {
                if !done.contains(&(v, group as u64, index as u64)) {
                    queue.push_back(EpisodeJob { variant: v, group, index, seed: s.train.val_seed + group as u64 });
                }
            }
        }
    }
    if opts.progress {
        eprintln!(
            "ragen-lab eval: {} on {} at {} → {} ({} episodes to play, {} already done)",
            opts.experiment.display(),
            opts.model,
            endpoint.base,
            run.path.display(),
            queue.len(),
            done.len()
        );
    }
    // Fail fast on a wrong URL or model name, before the workers start.
    if !queue.is_empty() {
        let names = endpoint.models().with_context(|| format!("asking {} for its models", endpoint.base))?;
        if !names.is_empty() && !names.iter().any(|n| n == &opts.model) {
            bail!("{}: no model {:?}; it serves: {}", endpoint.base, opts.model, names.join(", "));
        }
    }

    // Workers play whole episodes; this thread writes each one down as it finishes.
    let total = queue.len();
    let queue = Arc::new(Mutex::new(queue));
    let (tx, rx) = channel::<Result<EpisodeResult>>();
    let workers: Vec<std::thread::JoinHandle<()>> = (0..opts.concurrency.min(total))
        .map(|_| {
            let (queue, tx, endpoint, host, exp, s) =
                (queue.clone(), tx.clone(), endpoint.clone(), host.clone(), exp.clone(), s.clone());
            let params: Vec<_> = variants.iter().map(|v| v.2.clone()).collect();
            let (model, plain) = (opts.model.clone(), opts.plain_api);
            let script_limits = host.limits().clone();
            script_limits.spawn("eval-worker", move || {
                let scripts = match exp.scripts(&host) {
                    Ok(x) => x,
                    Err(e) => return drop(tx.send(Err(e.into()))),
                };
                loop {
                    let Some(item) = queue.lock().expect("queue lock").pop_front() else { return };
                    let played = play(&endpoint, &model, plain, &scripts, &s, &params[item.variant], &item);
                    let failed = played.is_err();
                    if tx.send(played).is_err() || failed {
                        queue.lock().expect("queue lock").clear();
                        return;
                    }
                }
            })
        })
        .collect::<std::io::Result<_>>()
        .context("starting the eval workers")?;
    drop(tx);
    let bar = progress_bar(opts.progress, "episodes", total as u64);
    let (mut latencies, mut prompt_tokens, mut completion_tokens, mut first_error) = (Vec::new(), 0, 0, None);
    for played in rx {
        match played {
            Ok(p) => {
                append_line(&file(p.variant), &p.line)?;
                lines[p.variant].push(p.line);
                latencies.extend(p.latencies);
                prompt_tokens += p.prompt_tokens;
                completion_tokens += p.completion_tokens;
                bar.inc(1);
            }
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    for w in workers {
        let _ = w.join();
    }
    bar.finish_and_clear();
    if let Some(e) = first_error {
        return Err(e.context(format!(
            "eval stopped; the {} finished episodes are kept in {}: run the same command again to continue",
            lines.iter().map(Vec::len).sum::<usize>(),
            run.path.display()
        )));
    }

    // Summary, the validation event and the rollout files in (group, episode) order.
    let mut event = Map::new();
    let mut summaries = Vec::new();
    for (v, (key, _, _)) in variants.iter().enumerate() {
        lines[v].sort_by_key(|l| (l["group"].as_u64(), l["episode"].as_u64()));
        let text: String = lines[v].iter().map(|l| format!("{l}\n")).collect();
        super::rundir::write_atomic(&file(v), text.as_bytes())?;
        let sum = summarize(key, &lines[v]);
        let [k_success, k_reward, k_pass, k_agree] = Key::validation(*key == "val_heldout");
        k_success.put(&mut event, sum.success);
        k_reward.put(&mut event, sum.reward_mean);
        k_pass.put(&mut event, sum.pass_at_k);
        if let Some(a) = sum.solver_agreement {
            k_agree.put(&mut event, a);
        }
        event.insert(format!("eval/{key}/format_error_rate"), json!(sum.format_error_rate));
        summaries.push(sum);
    }
    latencies.sort_by(f64::total_cmp);
    let q = |p: f64| latencies.get(((latencies.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
    let summary = Summary {
        run_dir: run.path.clone(),
        model: opts.model.clone(),
        k: s.train.val_samples,
        variants: summaries,
        played: total,
        requests: latencies.len(),
        prompt_tokens,
        completion_tokens,
        latency_p50_s: q(0.5),
        latency_p99_s: q(0.99),
        retries: endpoint.retried.load(std::sync::atomic::Ordering::Relaxed),
        seconds: t_start.elapsed().as_secs_f64(),
    };
    if total > 0 {
        let msg = summary.variants.iter().map(|v| format!("{}/success {:.3}", v.key, v.success)).collect::<Vec<_>>();
        event.insert("k".into(), json!(s.train.val_samples));
        event.insert("eval".into(), serde_json::to_value(&summary)?);
        run.event(0, "validation", &format!("eval of {}: {}", opts.model, msg.join(", ")), event)?;
    }
    super::rundir::write_atomic(&run.path.join("eval.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    Ok(summary)
}

/// A new run directory, or one that holds this same eval (to continue it).
fn open_run_dir(path: &Path, record: &Value) -> Result<RunDir> {
    if !path.join("settings.json").exists() {
        return RunDir::create(path);
    }
    let old = RunDir::read_settings(path)?;
    if old["kind"] != "eval" {
        bail!("{} holds a training run, not an eval; pick another --run-dir", path.display());
    }
    for key in ["experiment", "endpoint", "model", "seeds", "plain_api", "settings", "params", "val_params"] {
        if old[key] != record[key] {
            bail!(
                "{} holds an eval with another {key} ({} there, {} now): pick another --run-dir to start afresh",
                path.display(),
                old[key],
                record[key]
            );
        }
    }
    RunDir::reopen(path, 0)
}

/// Plays one episode against the endpoint.
fn play(
    endpoint: &Endpoint,
    model: &str,
    plain: bool,
    scripts: &crate::script::ExperimentScripts,
    s: &Settings,
    params: &Map<String, Value>,
    item: &EpisodeJob,
) -> Result<EpisodeResult> {
    let r = &s.rollout;
    let turns = Turns::new(scripts, params, r)?;
    let mut play = Play::new(scripts, item.group, item.index, item.seed, params, &turns.system)?;
    play.ask_solver = true;
    let (mut latencies, mut prompt_tokens, mut completion_tokens) = (Vec::new(), 0, 0);
    for turn in 1..=turns.max_turns {
        let ((obs, user), valid) =
            turns.user_turn(scripts, &play.episode, &mut play.history, turn, play.prev_reward, r)?;
        let opened = (obs, user, valid.len());
        let names = if valid.is_empty() { turns.info.actions.clone() } else { valid };
        let mut messages: Vec<ChatMessage> = play
            .history
            .messages(r.context_window)
            .into_iter()
            .map(|m| ChatMessage { role: m.role, content: m.content })
            .collect();
        if !plain {
            messages.push(ChatMessage { role: "assistant".into(), content: turns.open_tag.into() });
        }
        let req = ChatRequest {
            model: model.to_string(),
            messages,
            sampling: Sampling {
                max_tokens: Some(r.response_length),
                temperature: Some(s.train.val_temperature),
                top_p: Some(r.top_p),
                // llama-server samples with top-k 40 and min-p 0.05 unless told otherwise.
                top_k: (!plain).then_some(r.top_k as i64),
                min_p: (!plain).then_some(0.0),
                stop: Some(Stop::Many(vec![CLOSE.into()])),
                seed: Some(item.seed ^ ((item.index as u64) << 32) ^ ((turn as u64) << 48)),
                include_stop_str_in_output: (!plain).then_some(true),
                // `ragen-lab serve` constrains the answer as the local sampler does; other
                // engines ignore the field.
                answer_grammar: (!plain && r.constrain_actions && !names.is_empty()).then_some(AnswerSpec {
                    actions: names,
                    max_actions: turns.limits.max_actions_per_turn,
                    starts_inside: !r.think,
                }),
                ..Sampling::default()
            },
            continue_final_message: (!plain).then_some(true),
            add_generation_prompt: (!plain).then_some(false),
            ..ChatRequest::default()
        };
        let t = Instant::now();
        let resp =
            endpoint.chat(&req).with_context(|| format!("seed {} episode {} turn {turn}", item.seed, item.index))?;
        latencies.push(t.elapsed().as_secs_f64());
        let choice =
            resp.choices.into_iter().next().ok_or_else(|| anyhow!("{}: an answer without choices", endpoint.base))?;
        prompt_tokens += resp.usage.prompt_tokens;
        completion_tokens += resp.usage.completion_tokens;
        let text =
            restore_stop(choice.message.content, choice.finish_reason.as_deref(), choice.stop_reason.as_ref(), CLOSE);
        let reply = Reply {
            text,
            tokens: resp.usage.completion_tokens,
            forced: false,
            sampled: None,
            verbatim: None,
            grammar: None,
        };
        play.take_reply(&turns, scripts, r, turn, opened, reply, |t| Ok(t.split_whitespace().count()))?;
        if play.done {
            break;
        }
    }
    let versions = Versions::of(scripts);
    let t = play.finish(&turns.system, &versions, Default::default());
    Ok(EpisodeResult {
        variant: item.variant,
        line: trajectory_line(0, None, &t, None, None, false),
        latencies,
        prompt_tokens,
        completion_tokens,
    })
}

/// The stop string every turn ends with.
const CLOSE: &str = "</answer>";

fn summarize(key: &str, lines: &[Value]) -> VariantSummary {
    let n = lines.len().max(1) as f64;
    let success = lines.iter().filter(|l| l["success"] == true).count() as f64 / n;
    let reward_mean = lines.iter().filter_map(|l| l["score"].as_f64()).sum::<f64>() / n;
    let mut groups: std::collections::BTreeMap<u64, bool> = Default::default();
    for l in lines {
        *groups.entry(l["group"].as_u64().unwrap_or(0)).or_default() |= l["success"] == true;
    }
    let pass_at_k = groups.values().filter(|&&s| s).count() as f64 / groups.len().max(1) as f64;
    let turns: Vec<&Value> = lines.iter().flat_map(|l| l["turns"].as_array().into_iter().flatten()).collect();
    let t = turns.len().max(1) as f64;
    VariantSummary {
        key: key.to_string(),
        episodes: lines.len(),
        success,
        pass_at_k,
        reward_mean,
        format_error_rate: turns.iter().filter(|u| u["format_ok"] == false).count() as f64 / t,
        response_tokens_mean: turns.iter().filter_map(|u| u["response_tokens"].as_f64()).sum::<f64>() / t,
        solver_agreement: solver_agreement(lines),
    }
}
