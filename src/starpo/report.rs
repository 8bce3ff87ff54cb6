//! What the long jobs (train, eval, sft) report: the terminal progress bar, the metric lines of
//! a step (docs/contracts.md "Metric keys"), trajectory lines, and the summary at the end of a
//! run, and the template-collapse probe that scores a step's reasoning with the policy. The
//! run directory writes them.
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{json, Map, Value};
use std::path::PathBuf;

use anyhow::Result;

use super::normalize::mean_std;
use super::rundir::now;
use super::settings::Settings;
use super::update::UpdateStats;
use crate::agent::pack::distinct_positions;
use crate::agent::rollout::{Trajectory, TurnRecord};
use crate::metrics::collapse::template_collapse;
use crate::metrics::echo_trap::{answer_top_share, repetition, MutualInfo};
use crate::metrics::keys::Key;
use crate::phase::{Clocks, Phase};
use crate::policy::config::Config;
use crate::policy::Policy;

/// `⠋ {what} 3/20 [00:01:02 < 00:05:10] {message}`, ticking on its own so a long step still moves.
pub fn progress_bar(show: bool, what: &str, total: u64) -> ProgressBar {
    let target = if show { ProgressDrawTarget::stderr() } else { ProgressDrawTarget::hidden() };
    let bar = ProgressBar::with_draw_target(Some(total), target);
    let template = format!("{{spinner}} {what} {{pos}}/{{len}} [{{elapsed_precise}} < {{eta_precise}}] {{msg}}");
    bar.set_style(ProgressStyle::with_template(&template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

/// The progress bar's message: a step's headline numbers.
pub fn headline(m: &Map<String, Value>) -> String {
    let g = |k: Key| k.get(m).unwrap_or(f64::NAN);
    format!(
        "reward {:.3} success {:.2} std {:.3} entropy {:.3} len {:.0}",
        g(Key::RewardMean),
        g(Key::Success),
        g(Key::InGroupStd),
        g(Key::Entropy),
        g(Key::ResponseLen)
    )
}

/// The `rollout/` metrics of one step: `stds` are the groups' reward stds, `kept` the groups the
/// filter kept.
pub fn rollout_metrics(step: u64, trajs: &[Trajectory], stds: &[f64], kept: &[usize]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("step".into(), json!(step));
    m.insert("time".into(), json!(now()));
    let put = |m: &mut Map<String, Value>, k: Key, v: f64| k.put(m, v);
    let scores: Vec<f64> = trajs.iter().map(|t| t.score).collect();
    let (mean, std) = mean_std(&scores);
    let turns: Vec<&TurnRecord> = trajs.iter().flat_map(|t| &t.turns).collect();
    let nt = turns.len().max(1) as f64;
    let mean_of = |xs: &[f64]| if xs.is_empty() { 0.0 } else { xs.iter().sum::<f64>() / xs.len() as f64 };
    put(&mut m, Key::RewardMean, mean);
    put(&mut m, Key::RewardStd, std);
    put(&mut m, Key::RewardMin, scores.iter().copied().fold(f64::INFINITY, f64::min));
    put(&mut m, Key::RewardMax, scores.iter().copied().fold(f64::NEG_INFINITY, f64::max));
    put(&mut m, Key::Success, trajs.iter().filter(|t| t.success).count() as f64 / trajs.len().max(1) as f64);
    put(&mut m, Key::InGroupStd, mean_of(stds));
    put(&mut m, Key::InGroupStdKept, mean_of(&kept.iter().map(|&g| stds[g]).collect::<Vec<_>>()));
    put(&mut m, Key::KeptRatio, kept.len() as f64 / stds.len().max(1) as f64);
    put(&mut m, Key::ResponseLen, turns.iter().map(|t| t.response_tokens as f64).sum::<f64>() / nt);
    put(&mut m, Key::ThinkLen, turns.iter().map(|t| t.think_tokens as f64).sum::<f64>() / nt);
    put(&mut m, Key::TurnsMean, turns.len() as f64 / trajs.len().max(1) as f64);
    let parsed_actions: usize = turns.iter().map(|t| t.actions.len() + t.invalid_actions.len()).sum();
    let valid: usize = trajs.iter().map(|t| t.actions_valid).sum();
    if parsed_actions > 0 {
        put(&mut m, Key::ValidActionRate, valid as f64 / parsed_actions as f64);
    }
    put(&mut m, Key::FormatErrorRate, turns.iter().filter(|t| !t.format_ok).count() as f64 / nt);
    // A response that is only a legal answer repeats by design when the action space is small
    // (two one-word answers): only the rest can duplicate, over all turns. Collapse onto one
    // answer shows as one answer whatever the observation instead.
    let answer_only = |t: &&&TurnRecord| t.think.is_none() && t.legal_answer();
    let free: Vec<&str> = turns.iter().filter(|t| !answer_only(t)).map(|t| t.response.as_str()).collect();
    put(&mut m, Key::Repetition, repetition(&free) * free.len() as f64 / nt);
    // A turn whose state offered one action (a workflow's forced lookup) is no choice.
    let answers: Vec<(&str, String)> = turns
        .iter()
        .filter(|t| t.legal_answer() && t.choices != 1)
        .map(|t| (t.obs.as_str(), t.actions.join(" || ")))
        .collect();
    if let Some(share) = answer_top_share(&answers) {
        put(&mut m, Key::AnswerTopShare, share);
    }
    m
}

/// The `update/` metrics of an update that ran.
pub fn update_metrics(m: &mut Map<String, Value>, u: &UpdateStats, lr: f64) {
    let mut put = |k: Key, v: f64| k.put(m, v);
    put(Key::PgLoss, u.pg_loss);
    put(Key::Entropy, u.entropy);
    put(Key::ClipFrac, u.clip_frac);
    put(Key::GradNorm, u.grad_norm);
    put(Key::ApproxKl, u.approx_kl);
    put(Key::Lr, lr);
    put(Key::OptimizerSteps, u.optimizer_steps as f64);
    put(Key::SamplerLogprobs, u.sampler_logprobs as f64 / u.seq_advantage.len().max(1) as f64);
    if let Some(k) = u.kl {
        put(Key::Kl, k);
    }
    if let Some(v) = u.value_loss {
        put(Key::ValueLoss, v);
    }
    if let Some(t) = &u.tis {
        put(Key::TisWeightMean, t.weight_mean);
        put(Key::TisRatioMax, t.ratio_max);
        put(Key::KlRollout, t.kl_rollout);
        put(Key::TisCoverage, t.coverage);
    }
}

/// What a step cost, for the `time/` and `perf/` metrics.
pub struct Cost {
    /// The phases' clocks and computed positions (`phase::take` at the step's end).
    pub clocks: Clocks,
    pub rollout_s: f64,
    pub update_s: f64,
    pub step_s: f64,
    /// Positions the update ran (0 when skipped).
    pub update_tokens: usize,
}

/// The `time/` and `perf/` metrics of a step: clocks, tokens, and the FLOPs done against the
/// floor of computing each distinct position once. `kept` are the trajectories the update
/// trained on (`None`: skipped).
pub fn cost_metrics(m: &mut Map<String, Value>, cfg: &Config, trajs: &[Trajectory], kept: Option<&[usize]>, c: &Cost) {
    let mut put = |k: Key, v: f64| k.put(m, v);
    let rollout_tokens: usize =
        trajs.iter().map(|t| t.packed.ids.len() + t.turns.iter().map(|u| u.response_tokens).sum::<usize>()).sum();
    put(Key::RolloutS, c.rollout_s);
    put(Key::UpdateS, c.update_s);
    put(Key::StepS, c.step_s);
    for p in Phase::ALL {
        put(Key::time(p), c.clocks.get(p));
    }
    // The rest of the rollout: env and reward scripts, prompt rendering, tokenising.
    put(Key::EnvS, c.rollout_s - c.clocks.get(Phase::Prefill) - c.clocks.get(Phase::Decode));
    put(Key::Tokens, (rollout_tokens + c.update_tokens) as f64);
    put(Key::TokensComputed, c.clocks.tokens as f64);
    let packed: Vec<&[u32]> = trajs.iter().map(|t| t.packed.ids.as_slice()).collect();
    let unique = distinct_positions(&packed);
    put(Key::TokensUnique, unique as f64);
    // Rough: 2·N per token forward (rollout), 6·N per token forward + backward (update).
    let n_params = cfg.num_params() as f64;
    put(Key::Flops, 2.0 * n_params * rollout_tokens as f64 + 6.0 * n_params * c.update_tokens as f64);
    let sampled: usize = trajs.iter().flat_map(|t| &t.turns).map(|u| u.response_tokens).sum();
    put(Key::FloorFlopsRollout, cfg.forward_flops(unique, sampled));
    if let Some(kept) = kept {
        let kept_ids: Vec<&[u32]> = kept.iter().map(|&i| packed[i]).collect();
        let scored: usize = kept.iter().map(|&i| trajs[i].packed.assistant_tokens()).sum();
        put(Key::FloorFlopsUpdate, 4.0 * cfg.forward_flops(distinct_positions(&kept_ids), scored));
    }
    if let Some(mb) = super::rundir::peak_rss_mb() {
        put(Key::PeakRssMb, mb);
    }
}

/// One trajectory line (docs/contracts.md "Trajectory line").
pub fn trajectory_line(
    step: u64,
    policy_version: Option<u64>,
    t: &Trajectory,
    normalized: Option<f64>,
    advantage: Option<f64>,
    kept: bool,
) -> Value {
    let mut v = json!({
        "step": step, "group": t.group, "episode": t.episode, "seed": t.seed, "success": t.success,
        "score": t.score, "kept": kept, "response_tokens": t.turns.iter().map(|u| u.response_tokens).sum::<usize>(),
        "versions": t.versions, "system": t.system, "turns": t.turns, "truncated": t.truncated,
    });
    if let Some(p) = policy_version {
        v["policy_version"] = json!(p);
    }
    if let Some(n) = normalized {
        v["normalized_score"] = json!(n);
    }
    if let Some(a) = advantage {
        v["advantage"] = json!(a);
    }
    v
}

/// The share of turns, over trajectory lines, whose first action is the env solver's first move
/// from the state the model was shown (`solver_action`, recorded where the rollout asked the
/// solver); `None` when no turn has one (the env defines no `solve`). Names compare as the env's
/// turn parser does, ignoring case.
pub fn solver_agreement(lines: &[Value]) -> Option<f64> {
    let asked: Vec<bool> = lines
        .iter()
        .flat_map(|l| l["turns"].as_array().into_iter().flatten())
        .filter_map(|u| {
            let best = u["solver_action"].as_str()?;
            Some(u["actions"][0].as_str().is_some_and(|a| a.eq_ignore_ascii_case(best)))
        })
        .collect();
    (!asked.is_empty()).then(|| asked.iter().filter(|&&a| a).count() as f64 / asked.len() as f64)
}

/// What a run ends with (the one-screen summary).
#[derive(Debug, Clone)]
pub struct Summary {
    pub run_dir: PathBuf,
    pub first_step: u64,
    pub last_step: u64,
    pub interrupted: bool,
    pub seconds: f64,
    /// The metrics lines of the first and last training steps of this session.
    pub first: Option<Map<String, Value>>,
    pub last: Option<Map<String, Value>>,
    /// (step, val line) of every validation of this session.
    pub validations: Vec<(u64, Map<String, Value>)>,
    pub checkpoint: Option<PathBuf>,
    pub alarms: Vec<String>,
    /// Why the run stopped before its last step (`stop.*`), if it did.
    pub early_stop: Option<String>,
}

impl Summary {
    /// A session of `run_dir` that starts after `start_step`.
    pub fn new(run_dir: PathBuf, start_step: u64) -> Self {
        Self {
            run_dir,
            first_step: start_step + 1,
            last_step: start_step,
            interrupted: false,
            seconds: 0.0,
            first: None,
            last: None,
            validations: Vec::new(),
            checkpoint: None,
            alarms: Vec::new(),
            early_stop: None,
        }
    }

    /// Takes in a training step's metrics line.
    pub fn step(&mut self, step: u64, line: Map<String, Value>) {
        self.first.get_or_insert_with(|| line.clone());
        self.last = Some(line);
        self.last_step = step;
    }

    /// The one-screen summary printed at the end of `ragen-lab train`.
    pub fn render(&self) -> String {
        let g = |m: &Option<Map<String, Value>>, k: Key| m.as_ref().and_then(|m| k.get(m));
        let f = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.3}"));
        let mut out = String::new();
        let status = match (&self.early_stop, self.interrupted) {
            (Some(_), _) => "stopped early (checkpoint saved)",
            (None, true) => "interrupted (checkpoint saved)",
            (None, false) => "done",
        };
        out += &format!(
            "ragen-lab train: {status}: steps {}–{} in {:.0} s\n",
            self.first_step, self.last_step, self.seconds
        );
        out += &format!("  run directory   {}\n", self.run_dir.display());
        for (k, name) in [
            (Key::RewardMean, "reward mean"),
            (Key::Success, "success"),
            (Key::InGroupStd, "in-group std"),
            (Key::Entropy, "entropy"),
            (Key::ResponseLen, "response len"),
        ] {
            out += &format!("  {name:<15} {:>8} → {:>8}\n", f(g(&self.first, k)), f(g(&self.last, k)));
        }
        for (step, v) in &self.validations {
            let parts: Vec<String> = v.iter().map(|(k, x)| format!("{k} {:.3}", x.as_f64().unwrap_or(0.0))).collect();
            out += &format!("  validation @{step:<4} {}\n", parts.join("  "));
        }
        if !self.alarms.is_empty() {
            out += &format!("  alarms          {}\n", self.alarms.len());
            for a in self.alarms.iter().take(5) {
                out += &format!("    {a}\n");
            }
        }
        if let Some(why) = &self.early_stop {
            out += &format!("  early stop      {why}\n");
        }
        if let Some(c) = &self.checkpoint {
            out += &format!("  checkpoint      {}\n", c.display());
        }
        out +=
            &format!("  next: ragen-lab view {}   ragen-lab plot {}\n", self.run_dir.display(), self.run_dir.display());
        out
    }
}

/// RAGEN-2's template-collapse probe on this step's rollouts: one trajectory per group (members of
/// a group share their prompt, so only distinct prompts can be told apart), at most
/// `echo.mi_samples` of them. X is the first turn's prompt up to the assistant header plus
/// `<think>`; Z is that turn's reasoning without its tags (the parsed think text, or, where the
/// format broke, the response up to `</think>`, since generation starts inside the think block).
/// `None` in no-think mode or when fewer than two groups have reasoning to score.
pub fn template_collapse_probe(
    policy: &Policy,
    trajs: &[Trajectory],
    members: &[Vec<usize>],
    s: &Settings,
) -> Result<Option<MutualInfo>> {
    if !s.rollout.think {
        return Ok(None);
    }
    let think_open = policy.encode("<think>")?;
    let (mut prompts, mut traces) = (Vec::new(), Vec::new());
    for group in members.iter().take(s.echo.mi_samples) {
        let Some(t) = group.first().map(|&i| &trajs[i]) else { continue };
        let Some(turn) = t.turns.first() else { continue };
        let reasoning = turn
            .think
            .clone()
            .unwrap_or_else(|| turn.response.split("</think>").next().unwrap_or_default().to_string());
        let z = policy.encode(reasoning.trim())?;
        if z.is_empty() {
            continue;
        }
        let first_assistant = t.packed.mask.iter().position(|&m| m).unwrap_or(t.packed.ids.len());
        let mut x = t.packed.ids[..first_assistant].to_vec();
        x.extend_from_slice(&think_open);
        prompts.push(x);
        traces.push(z);
    }
    if prompts.len() < 2 {
        return Ok(None);
    }
    template_collapse(policy, &prompts, &traces, s.optim.micro_batch_size).map(Some)
}
