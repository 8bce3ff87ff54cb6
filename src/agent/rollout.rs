//! The batched multi-turn rollout (RAGEN `agent_proxy.rollout`): P groups × N episodes, one
//! seed per group (a group shares its start state; each episode has its own random stream for
//! stochastic steps). Each turn, every live episode's chat is rendered and all of them generate
//! together; each response is parsed, its actions step the env (at most k per turn and
//! `max_actions` per episode), the turn reward is shaped, and the re-serialised reply goes into
//! the history. Finished episodes leave the batch. A finished episode is packed into one token
//! sequence for the update.
//!
//! What it does not do: scoring beyond the per-episode sum, normalisation, filtering (starpo/).
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};

use super::history::History;
use super::pack::Packed;
use super::turn::{parse_turn, ParsedTurn};
use crate::policy::{GenerationConfig, Policy, Resume};
use crate::rng::Rng;
use crate::script::{shape_all, Episode, ExperimentScripts, TurnContext};
use crate::starpo::settings::Rollout as RolloutSettings;

/// What one rollout is asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    /// One seed per group.
    pub seeds: Vec<u64>,
    /// Episodes per group.
    pub group_size: usize,
    /// Sampling temperature (training 1.0, validation 0.5).
    pub temperature: f64,
    /// Env parameters (training or held-out).
    pub params: Map<String, Value>,
}

/// One turn as the run directory records it (docs/contracts.md "Trajectory line").
#[derive(Clone, Debug, Serialize)]
pub struct TurnRecord {
    pub user: String,
    pub obs: String,
    pub response: String,
    pub think: Option<String>,
    pub answer: Option<String>,
    pub actions: Vec<String>,
    pub invalid_actions: Vec<String>,
    pub format_ok: bool,
    /// Sum of the env's step rewards in this turn.
    pub env_reward: f64,
    /// The turn reward: the env reward after the reward scripts (e.g. the format penalty).
    pub reward: f64,
    pub done: bool,
    /// Generated tokens in this turn.
    pub response_tokens: usize,
    /// Tokens of the think text (0 in no-think mode or on a format error).
    pub think_tokens: usize,
}

/// Script versions that produced a trajectory.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Versions {
    pub env: String,
    pub prompt: String,
    pub rewards: Vec<String>,
}

impl Versions {
    pub fn of(s: &ExperimentScripts) -> Self {
        Self {
            env: s.env.version().to_string(),
            prompt: s.prompt.version().to_string(),
            rewards: s.rewards.iter().map(|r| r.version().to_string()).collect(),
        }
    }
}

/// A finished episode.
#[derive(Clone, Debug)]
pub struct Trajectory {
    pub group: usize,
    pub episode: usize,
    pub seed: u64,
    pub success: bool,
    /// R(τ) = Σ turn rewards (shaping and format penalties included).
    pub score: f64,
    pub system: String,
    pub turns: Vec<TurnRecord>,
    pub versions: Versions,
    /// Env steps taken / valid ones (for the valid-action rate).
    pub actions_taken: usize,
    pub actions_valid: usize,
    /// Ended by the context budget rather than the env or the turn limit.
    pub truncated: bool,
    pub packed: Packed,
}

/// An episode in flight.
struct Live {
    group: usize,
    index: usize,
    episode: Episode,
    history: History,
    turns: Vec<TurnRecord>,
    success: bool,
    actions_taken: usize,
    actions_valid: usize,
    prev_reward: Option<f64>,
    done: bool,
    truncated: bool,
    /// What the model computed for this episode last turn, to continue from.
    resume: Option<Resume>,
}

/// Run a rollout. `rng` drives sampling; env randomness comes from (seed, episode index).
pub fn rollout(
    policy: &Policy,
    scripts: &ExperimentScripts,
    plan: &Plan,
    s: &RolloutSettings,
    rng: &mut Rng,
) -> Result<Vec<Trajectory>> {
    let info = scripts.env.info(&plan.params)?;
    let max_turns = if s.max_turns > 0 { s.max_turns } else { info.max_turns }.max(1);
    let max_actions = if s.max_actions > 0 { s.max_actions } else { info.max_actions }.max(1);
    let per_turn = if s.max_actions_per_turn > 0 { s.max_actions_per_turn } else { info.max_actions_per_turn }.max(1);
    let system = scripts.prompt.system(&info)?;
    let open_tag = if s.think { "<think>" } else { "<answer>" };
    let open_ids =
        policy.tokenizer.encode(open_tag, false).map_err(|e| anyhow::anyhow!("tokenizing {open_tag}: {e}"))?;
    let open_ids = open_ids.get_ids().to_vec();
    let gen_cfg = GenerationConfig {
        max_new_tokens: s.response_length,
        temperature: plan.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        stop_strings: vec!["</answer>".into()],
        ..GenerationConfig::default()
    };

    let mut live = Vec::new();
    for (group, &seed) in plan.seeds.iter().enumerate() {
        for index in 0..plan.group_size {
            live.push(Live {
                group,
                index,
                episode: scripts.env.reset(seed, index as u64, &plan.params)?,
                history: History::new(system.clone()),
                turns: Vec::new(),
                success: false,
                actions_taken: 0,
                actions_valid: 0,
                prev_reward: None,
                done: false,
                truncated: false,
                resume: None,
            });
        }
    }

    for turn in 1..=max_turns {
        // 1. Prompts of every live episode.
        let mut batch = Vec::new(); // (episode index, prompt ids, obs, user text)
        for (i, ep) in live.iter_mut().enumerate().filter(|(_, e)| !e.done) {
            let obs = ep.episode.render()?;
            let ctx = TurnContext {
                turn,
                obs: obs.clone(),
                actions_left: max_actions - ep.actions_taken,
                prev_reward: ep.prev_reward,
                think: s.think,
                max_tokens: s.response_length,
            };
            let user = scripts.prompt.user(&info, &ctx)?;
            ep.history.push_user(user.clone());
            let mut ids = policy.chat_tokens(&ep.history.messages(s.context_window), true)?.ids;
            ids.extend_from_slice(&open_ids);
            if ids.len() + s.response_length > s.max_context_tokens {
                // No room for another full response: the episode ends here (RAGEN max_model_len).
                ep.history.turns.pop();
                ep.done = true;
                ep.truncated = true;
                continue;
            }
            batch.push((i, ids, obs, user));
        }
        if batch.is_empty() {
            break;
        }
        // 2. All live episodes generate together, each continuing from what the model computed
        // for it last turn (the new prompt repeats the old one and the reply).
        let prompts: Vec<Vec<u32>> = batch.iter().map(|b| b.1.clone()).collect();
        let resume: Vec<Option<Resume>> = batch.iter().map(|b| live[b.0].resume.take()).collect();
        let keep = turn < max_turns && s.kv_cache_mb > 0;
        let (gens, resumes) =
            policy.generate_resuming(&prompts, &resume, keep, &gen_cfg, rng).context("generating responses")?;
        drop(resume);
        // Keep them for the next turn while they fit the budget.
        let mut budget = s.kv_cache_mb << 20;
        for ((i, ..), r) in batch.iter().zip(resumes) {
            if let Some(r) = r.filter(|r| r.bytes() <= budget) {
                budget -= r.bytes();
                live[*i].resume = Some(r);
            }
        }
        // 3. Parse, step, shape.
        for ((i, _, obs, user), gen) in batch.into_iter().zip(gens) {
            let ep = &mut live[i];
            let parsed: ParsedTurn = parse_turn(&gen.text, &info.actions, per_turn, s.think);
            let mut env_reward = 0.0;
            let mut invalid = parsed.invalid_actions.clone();
            for action in &parsed.actions {
                if ep.episode.done || ep.actions_taken >= max_actions {
                    break; // extra actions are dropped, as in RAGEN
                }
                let out = ep.episode.step(action)?;
                ep.actions_taken += 1;
                env_reward += out.reward;
                ep.success |= out.success;
                if out.valid {
                    ep.actions_valid += 1;
                } else {
                    invalid.push(action.clone());
                }
            }
            // Shaping (RAGEN's format penalty included) is the experiment's reward scripts' job.
            let reward = shape_all(&scripts.rewards, &parsed, env_reward)?;
            ep.history.push_assistant(parsed.reserialize());
            ep.prev_reward = Some(reward);
            ep.done = ep.episode.done || ep.actions_taken >= max_actions || turn == max_turns;
            let think_tokens = match &parsed.think {
                Some(t) if !t.is_empty() => policy.tokenizer.encode(t.as_str(), false).map(|e| e.len()).unwrap_or(0),
                _ => 0,
            };
            ep.turns.push(TurnRecord {
                user,
                obs,
                response: gen.text,
                think: parsed.think,
                answer: parsed.answer,
                actions: parsed.actions,
                invalid_actions: invalid,
                format_ok: parsed.format_ok,
                env_reward,
                reward,
                done: ep.done,
                response_tokens: gen.ids.len(),
                think_tokens,
            });
        }
    }

    // 4. Pack every episode: the chat it ends with, the rewards of the turns it shows.
    let versions = Versions::of(scripts);
    live.into_iter()
        .map(|ep| {
            let shown = ep.history.visible_turns(s.context_window);
            let rewards: Vec<f64> = ep.turns.iter().map(|t| t.reward).collect();
            let chat = policy.chat_tokens(&ep.history.messages(s.context_window), false)?;
            let packed = Packed::new(chat, &rewards[rewards.len() - shown..])?;
            Ok(Trajectory {
                group: ep.group,
                episode: ep.index,
                seed: plan.seeds[ep.group],
                success: ep.success,
                score: rewards.iter().sum(),
                system: system.clone(),
                turns: ep.turns,
                versions: versions.clone(),
                actions_taken: ep.actions_taken,
                actions_valid: ep.actions_valid,
                truncated: ep.truncated,
                packed,
            })
        })
        .collect()
}

/// Indices of each group's trajectories, group-major.
pub fn groups(trajs: &[Trajectory]) -> Vec<Vec<usize>> {
    let n = trajs.iter().map(|t| t.group + 1).max().unwrap_or(0);
    let mut out = vec![Vec::new(); n];
    for (i, t) in trajs.iter().enumerate() {
        out[t.group].push(i);
    }
    out
}
