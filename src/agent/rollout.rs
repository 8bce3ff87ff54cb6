//! The batched multi-turn rollout (RAGEN `agent_proxy.rollout`): P groups × N episodes, one
//! seed per group (a group shares its start state; each episode has its own random stream for
//! stochastic steps). Each turn, every live episode's chat is rendered and all of them generate
//! together; each response is parsed, its actions step the env (at most k per turn and
//! `max_actions` per episode), the turn reward is shaped, and the re-serialised reply goes into
//! the history. Finished episodes leave the batch. A finished episode is packed into one token
//! sequence for the update.
//!
//! What it does not do: scoring beyond the per-episode sum, normalisation, filtering (starpo/).
use std::collections::HashMap;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};

use super::engine::HttpEngine;
use super::history::History;
use super::pack::Packed;
use super::settings::Rollout;
use crate::policy::constrain::AnswerGrammar;
use crate::policy::sample::Forcing;
use crate::policy::{GenerationConfig, Message, Policy, Resume};
use crate::rng::Rng;
use crate::script::turn::{ParsedTurn, TurnLimits};
use crate::script::{apply_and_shape, EnvInfo, Episode, ExperimentScripts, TurnContext};

/// What the sampler writes when the think budget is spent (`rollout.think_budget`).
const FORCED: &str = "</think><answer>";

/// What one rollout is asked to do.
#[derive(Clone, Debug)]
pub struct Plan {
    /// One seed per group.
    pub seeds: Vec<u64>,
    /// Episodes per group.
    pub group_size: usize,
    /// Sampling temperature (training 1.0, validation 0.5).
    pub temperature: f64,
    /// The temperature of a constrained answer's choices (`rollout.answer_temperature`;
    /// `None`: `temperature`).
    pub answer_temperature: Option<f64>,
    /// Env parameters (training or held-out).
    pub params: Map<String, Value>,
    /// Ask the env's solver for its move every turn (`TurnRecord::solver_action`): validation
    /// does, training does not (a search per turn it would not use).
    pub ask_solver: bool,
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
    /// The env solver's first move from the state shown this turn, where the rollout asked
    /// (validation) and the env defines `fn solve`: whether the model read the state.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub solver_action: Option<String>,
    /// How many legal actions the state offered (its `valid_actions`): a turn with one had no
    /// choice to make, so the answer-share alarms leave it out.
    pub choices: usize,
}

impl TurnRecord {
    /// Whether the answer is a legal action list: in format, every action valid, at least one.
    pub fn legal_answer(&self) -> bool {
        self.format_ok && self.invalid_actions.is_empty() && !self.actions.is_empty()
    }
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

/// One episode being played turn by turn: its env state, its chat and the record of its turns.
/// The rollout plays many at once with the in-process policy; `starpo::eval` plays them against
/// an HTTP endpoint. Both hand each reply to [`Play::take_reply`].
pub struct Play {
    pub group: usize,
    pub index: usize,
    pub seed: u64,
    pub episode: Episode,
    pub history: History,
    pub turns: Vec<TurnRecord>,
    pub success: bool,
    pub actions_valid: usize,
    pub prev_reward: Option<f64>,
    pub done: bool,
    pub truncated: bool,
    /// Each turn's sampled ids and the sampler's log-probs (local or engine), where they compare
    /// with the policy's.
    pub sampled: Vec<(Vec<u32>, Vec<f32>)>,
    /// Each turn's answer grammar (`None`: sampled freely).
    pub grammars: Vec<Option<AnswerGrammar>>,
    /// Record the solver's move every turn ([`Plan::ask_solver`]).
    pub ask_solver: bool,
}

/// A reply to one turn, as the model wrote it.
pub struct Reply {
    pub text: String,
    /// Generated tokens.
    pub tokens: usize,
    /// The sampler wrote `</think><answer>` itself (`rollout.think_budget`).
    pub forced: bool,
    /// The sampled ids and their log-probs, where they compare with the policy's.
    pub sampled: Option<(Vec<u32>, Vec<f32>)>,
    /// The opening tag's and the reply's ids as sampled (`Policy::verbatim_ids`): a reply kept
    /// as written (its format failed) stands in the chat as these, not re-tokenized.
    pub verbatim: Option<Vec<u32>>,
    /// The grammar the answer was sampled under (`rollout.constrain_actions`).
    pub grammar: Option<AnswerGrammar>,
}

impl Play {
    pub fn new(
        scripts: &ExperimentScripts,
        group: usize,
        index: usize,
        seed: u64,
        params: &Map<String, Value>,
        system: &str,
    ) -> Result<Self> {
        Ok(Self {
            group,
            index,
            seed,
            episode: scripts.env.reset(seed, index as u64, params)?,
            history: History::new(system),
            turns: Vec::new(),
            success: false,
            actions_valid: 0,
            prev_reward: None,
            done: false,
            truncated: false,
            sampled: Vec::new(),
            grammars: Vec::new(),
            ask_solver: false,
        })
    }

    /// The reply to turn `turn` (opened by [`Turns::open`] or [`Turns::user_turn`]): parse it,
    /// step the env, shape the reward, put the re-serialised reply into the history and record
    /// the turn. `choices` is how many legal actions the opened state offered (the caller has
    /// them already); `count_tokens` measures the think text.
    pub fn take_reply(
        &mut self,
        turns: &Turns,
        scripts: &ExperimentScripts,
        s: &Rollout,
        turn: usize,
        (obs, user, choices): (String, String, usize),
        reply: Reply,
        count_tokens: impl Fn(&str) -> Result<usize>,
    ) -> Result<()> {
        let parsed: ParsedTurn = turns.limits.parse(&reply.text, &turns.info, s.think);
        // Before the env steps: the solver plans from the state the model was shown.
        let solver_action = match self.ask_solver {
            true => self.episode.solve()?.and_then(|path| path.into_iter().next()),
            false => None,
        };
        // Actions past the episode's budget or its end are dropped, as in RAGEN; shaping
        // (RAGEN's format penalty included) is the experiment's reward scripts' job.
        let (applied, reward) = apply_and_shape(
            &mut self.episode,
            &parsed,
            turns.limits.max_actions,
            &scripts.rewards,
            &turns.info.actions,
            |_, _, _| Ok(()),
        )?;
        self.actions_valid += applied.valid_steps();
        self.success |= applied.success;
        // The history keeps the reply re-serialised (RAGEN), but as sampled where its format
        // failed, and where it was a constrained answer (the grammar's canonical text is the
        // re-serialised one): the update then scores the very tokens the sampler drew.
        let mut message = Message::assistant(parsed.reserialize());
        if reply.forced {
            message.unscored = message.content.find(FORCED).map(|i| (i, i + FORCED.len()));
        } else if parsed.answer.is_none() || (reply.grammar.is_some() && reply.verbatim.is_some()) {
            message.content = parsed.opened.clone();
            message.ids = reply.verbatim;
        }
        self.history.push_reply(message);
        // One entry a turn (empty where none was kept), so the turns line up when packed.
        self.sampled.push(reply.sampled.unwrap_or_default());
        self.grammars.push(reply.grammar);
        self.prev_reward = Some(reward);
        self.done = applied.done || turn == turns.max_turns;
        let think_tokens = match &parsed.think {
            Some(t) if !t.is_empty() => count_tokens(t)?,
            _ => 0,
        };
        self.turns.push(TurnRecord {
            user,
            obs,
            response: reply.text,
            think: parsed.think,
            answer: parsed.answer,
            actions: parsed.actions,
            invalid_actions: applied.invalid_actions,
            format_ok: parsed.format_ok,
            env_reward: applied.env_reward,
            reward,
            done: self.done,
            response_tokens: reply.tokens,
            think_tokens,
            solver_action,
            choices,
        });
        Ok(())
    }

    /// The finished episode, with its packed sequence (empty where there are no tokens: an
    /// episode played over HTTP).
    pub fn finish(self, system: &str, versions: &Versions, packed: Packed) -> Trajectory {
        Trajectory {
            group: self.group,
            episode: self.index,
            seed: self.seed,
            success: self.success,
            score: self.turns.iter().map(|t| t.reward).sum(),
            system: system.to_string(),
            turns: self.turns,
            versions: versions.clone(),
            actions_taken: self.episode.steps,
            actions_valid: self.actions_valid,
            truncated: self.truncated,
            packed,
        }
    }
}

/// Run a rollout. `rng` drives sampling; env randomness comes from (seed, episode index). With
/// an `engine` the replies are generated there (`policy` still tokenizes and packs).
pub fn rollout(
    policy: &Policy,
    engine: Option<&HttpEngine>,
    scripts: &ExperimentScripts,
    plan: &Plan,
    s: &Rollout,
    rng: &mut Rng,
) -> Result<Vec<Trajectory>> {
    let turns = Turns::new(scripts, &plan.params, s)?;
    let open_tag = policy.encode_plain(turns.open_tag)?;
    let (info, max_turns, limits, system) = (&turns.info, turns.max_turns, turns.limits, &turns.system);
    // An answer names the state's legal actions (the env's own list when it gives none); each
    // list's grammar is tokenised once a rollout.
    let mut grammars_of: HashMap<Vec<String>, Option<AnswerGrammar>> = HashMap::new();
    let mut turn_grammar = |valid: &[String]| {
        let names = if valid.is_empty() { &info.actions[..] } else { valid };
        let made =
            |n: &Vec<String>| AnswerGrammar::new(n, limits.max_actions_per_turn, !s.think).map(|g| policy.canonical(g));
        grammars_of.entry(names.to_vec()).or_insert_with_key(made).clone()
    };
    let mut gen_cfg = GenerationConfig {
        max_new_tokens: s.response_length,
        temperature: plan.temperature,
        answer_temperature: plan.answer_temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        stop_strings: vec!["</answer>".into()],
        forcing: match (s.think, s.think_budget) {
            (true, n) if n > 0 => {
                Some(Forcing { after: n, unless: "</think>".into(), ids: policy.encode_plain(FORCED)? })
            }
            _ => None,
        },
        // The update's old log-prob of the end-of-turn after `</answer>` (local sampler only).
        end_after_stop: engine.is_none().then(|| policy.end_of_turn_id()).flatten(),
        ..GenerationConfig::default()
    };

    let mut live = Vec::new();
    for (group, &seed) in plan.seeds.iter().enumerate() {
        for index in 0..plan.group_size {
            let mut play = Play::new(scripts, group, index, seed, &plan.params, system)?;
            play.ask_solver = plan.ask_solver;
            live.push(play);
        }
    }
    // What the model computed for each episode last turn, to continue from.
    let mut resumes: Vec<Option<Resume>> = (0..live.len()).map(|_| None).collect();

    for turn in 1..=max_turns {
        // 1. Prompts of every live episode.
        let mut batch = Vec::new(); // (episode index, prompt ids, (obs, user text, legal actions))
        let mut row_constraints = Vec::new(); // under constrain_actions: each row's legal actions
        for (i, ep) in live.iter_mut().enumerate().filter(|(_, e)| !e.done) {
            let Some(open) = turns.open(policy, scripts, &ep.episode, &mut ep.history, turn, ep.prev_reward, s)? else {
                ep.done = true;
                ep.truncated = true;
                continue;
            };
            if s.constrain_actions {
                row_constraints.push(turn_grammar(&open.valid_actions));
            }
            batch.push((i, open.ids, (open.obs, open.user, open.valid_actions.len())));
        }
        if batch.is_empty() {
            break;
        }
        gen_cfg.row_constraints = row_constraints;
        // 2. All live episodes generate together, each continuing from what the model computed
        // for it last turn (the new prompt repeats the old one and the reply).
        let prompts: Vec<Vec<u32>> = batch.iter().map(|b| b.1.clone()).collect();
        let resume: Vec<Option<Resume>> = batch.iter().map(|b| resumes[b.0].take()).collect();
        let keep = turn < max_turns && s.kv_cache_mb > 0;
        let (gens, kept) = match engine {
            Some(e) => (e.generate(&prompts, &gen_cfg, rng).context("generating on the engines")?, Vec::new()),
            None => policy.generate_resuming(&prompts, &resume, keep, &gen_cfg, rng).context("generating responses")?,
        };
        drop(resume);
        // Keep them for the next turn while they fit the budget.
        let mut budget = s.kv_cache_mb << 20;
        for ((i, ..), r) in batch.iter().zip(kept) {
            if let Some(r) = r.filter(|r| r.bytes() <= budget) {
                budget -= r.bytes();
                resumes[*i] = Some(r);
            }
        }
        // 3. Parse, step, shape.
        let grammars = std::mem::take(&mut gen_cfg.row_constraints);
        for (((i, _, opened), gen), grammar) in
            batch.into_iter().zip(gens).zip(grammars.into_iter().chain(std::iter::repeat(None)))
        {
            // The local sampler's log-probs are of the distribution the update scores (tempered,
            // over the legal tokens), the end-of-turn's after a stop string included: the
            // update's old log-probs. Forced ids were not drawn. Under constrain_actions an
            // engine's are of the masked distribution, and at a temperature other than 1 of a
            // tempered one (vLLM's raw ones are not): neither compares with the policy's, so no
            // importance correction uses them.
            let keep = match engine {
                None => s.temperature > 0.0 && !gen.forced,
                Some(_) => !s.constrain_actions && s.temperature == 1.0,
            };
            let sampled = keep.then(|| {
                let (mut ids, mut lps) = (gen.ids.clone(), gen.logprobs.clone());
                if let (Some(lp), Some(end)) = (gen.end_logprob, gen_cfg.end_after_stop) {
                    ids.push(end);
                    lps.push(lp);
                }
                (ids, lps)
            });
            let verbatim = policy.verbatim_ids(&open_tag, &format!("{}{}", turns.open_tag, gen.text), &gen.ids);
            let reply = Reply { tokens: gen.ids.len(), text: gen.text, forced: gen.forced, sampled, verbatim, grammar };
            live[i].take_reply(&turns, scripts, s, turn, opened, reply, |t| Ok(policy.encode_plain(t)?.len()))?;
        }
    }

    // 4. Pack every episode: the chat it ends with, the rewards of the turns it shows.
    let versions = Versions::of(scripts);
    live.into_iter()
        .map(|ep| {
            let rewards: Vec<f64> = ep.turns.iter().map(|t| t.reward).collect();
            let mut packed = Packed::from_history(policy, &ep.history, &rewards, s.context_window)?;
            if ep.sampled.iter().any(|(ids, _)| !ids.is_empty()) {
                // A window that dropped turns shows the earlier replies in a context they were
                // not sampled in: only the last one compares.
                let k = ep.sampled.len();
                let from = if s.context_window > 0 && k > s.context_window { k - 1 } else { 0 };
                packed.set_rollout_logprobs(&ep.sampled[from..], &open_tag);
            }
            packed.unscore_tags(&open_tag);
            if s.constrain_actions {
                packed.set_allowed(&ep.grammars, &open_tag, &policy.token_texts());
            }
            Ok(ep.finish(system, &versions, packed))
        })
        .collect()
}

/// How a rollout's episodes are played and asked: the env's description, the turn and action
/// limits (the settings over the env's own), the system message and the tag generation starts
/// with. The rollout and the solver demonstrations (`agent::demo`) both open every turn with
/// [`Turns::open`], so a demonstration answers exactly the prompt the model is given.
pub struct Turns {
    pub info: EnvInfo,
    /// `rollout.max_turns`, 0 = the env's own.
    pub max_turns: usize,
    pub limits: TurnLimits,
    pub system: String,
    /// `<think>` (think mode) or `<answer>`: generation starts after it.
    pub open_tag: &'static str,
}

/// One opened turn: the observation, the user message, and the prompt the model continues.
pub struct OpenTurn {
    pub obs: String,
    pub user: String,
    /// The chat so far with the generation prompt and the opening tag.
    pub ids: Vec<u32>,
    /// The legal actions in this state (what a constrained answer may name).
    pub valid_actions: Vec<String>,
}

impl Turns {
    pub fn new(scripts: &ExperimentScripts, params: &Map<String, Value>, s: &Rollout) -> Result<Self> {
        let info = scripts.env.info(params)?;
        let max_turns = if s.max_turns > 0 { s.max_turns } else { info.max_turns }.max(1);
        let limits = TurnLimits::resolve(&info, s.max_actions, s.max_actions_per_turn);
        let system = scripts.prompt.system(&info)?;
        let open_tag = if s.think { "<think>" } else { "<answer>" };
        Ok(Self { info, max_turns, limits, system, open_tag })
    }

    /// Turn `turn` of `episode`: renders the observation, writes the user message with the
    /// prompt template and pushes it onto `history`. `None` when the prompt leaves no room for a
    /// full response within `rollout.max_context_tokens` (RAGEN max_model_len): the message is
    /// taken back and the episode ends there, truncated.
    pub fn open(
        &self,
        policy: &Policy,
        scripts: &ExperimentScripts,
        episode: &Episode,
        history: &mut History,
        turn: usize,
        prev_reward: Option<f64>,
        s: &Rollout,
    ) -> Result<Option<OpenTurn>> {
        let ((obs, user), valid_actions) = self.user_turn(scripts, episode, history, turn, prev_reward, s)?;
        let mut ids = policy.chat_tokens(&history.messages(s.context_window), true)?.ids;
        ids.extend(policy.encode_plain(self.open_tag)?);
        if ids.len() + s.response_length > s.max_context_tokens {
            history.turns.pop();
            return Ok(None);
        }
        Ok(Some(OpenTurn { obs, user, ids, valid_actions }))
    }

    /// The text half of [`Turns::open`]: renders the observation, writes the user message with
    /// the prompt template and pushes it onto `history`; returns (observation, user message) and
    /// the state's legal actions.
    pub fn user_turn(
        &self,
        scripts: &ExperimentScripts,
        episode: &Episode,
        history: &mut History,
        turn: usize,
        prev_reward: Option<f64>,
        s: &Rollout,
    ) -> Result<((String, String), Vec<String>)> {
        let obs = episode.render()?;
        let valid_actions = episode.valid_actions()?;
        let ctx = TurnContext {
            turn,
            obs: obs.clone(),
            actions_left: self.limits.max_actions.saturating_sub(episode.steps),
            prev_reward,
            think: s.think,
            max_tokens: s.response_length,
            max_actions_per_turn: self.limits.max_actions_per_turn,
            show_actions: s.show_actions,
            valid_actions,
        };
        let user = scripts.prompt.user(&self.info, &ctx)?;
        history.push_user(user.clone());
        Ok(((obs, user), ctx.valid_actions))
    }
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
