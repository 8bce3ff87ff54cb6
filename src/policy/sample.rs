//! Batched generation: prompts are left-padded into one batch, prefilled into a pre-allocated
//! KV cache, then decoded one token per row per step with the fused (no-grad) ops. Identical
//! prompts (a group's first turn; episodes whose histories are still alike) prefill once and
//! their cache rows are copied out; prompts that share a long prefix (later turns still share
//! the first prompt) prefill it once: its keys and values are copied into each row's cache and
//! only the rows' own tokens are prefilled (`GenerationConfig::share_prefixes`). A row that
//! continues its earlier turn (`Resume`) prefills only the new tokens. Each row stops on its own (a stop id such as EOS or `<|im_end|>`, a stop string, or the
//! token budget); finished rows leave the batch (and the cache) in groups. Sampling (temperature,
//! top-k, top-p) draws from the project's seeded `Rng`, so a seed reproduces a rollout. With an
//! [`AnswerGrammar`], tokens that would leave a well-formed answer are masked before sampling.
use anyhow::{bail, Result};
use candle_core::Tensor;

use super::constrain::AnswerGrammar;
use super::model::{KvCache, Mode, SharedPrefix};
use super::Policy;
use crate::phase::{self, Phase};
use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    pub max_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    /// The temperature of a draw among several tokens a constraint allows (an answer's
    /// choice); `None`: `temperature`. Greedy stays greedy.
    pub answer_temperature: Option<f64>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches `top_p` (1 = off).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Text that ends a row's generation (e.g. `</answer>`); the text is cut after it.
    pub stop_strings: Vec<String>,
    /// Prefill a prefix shared by consecutive prompts once (false: every row in full in one
    /// batch, the reference path the tests compare against).
    pub share_prefixes: bool,
    /// Inside the answer, sample only tokens that keep it a well-formed action list
    /// (`rollout.constrain_actions`); `None`: free sampling.
    pub constraint: Option<AnswerGrammar>,
    /// Per prompt when not empty: each row's own grammar (the legal actions of its episode's
    /// state), in place of `constraint`.
    pub row_constraints: Vec<Option<AnswerGrammar>>,
    /// Text the sampler writes itself once a reply runs long (`rollout.think_budget`).
    pub forcing: Option<Forcing>,
    /// After a stop string, score this id at the next position, at `temperature` over the whole
    /// vocabulary (`Generation::end_logprob`): the chat template's end-of-turn, which the
    /// history puts there and training scores though the sampler never draws it. Costs the
    /// stopped rows one more decode step.
    pub end_after_stop: Option<u32>,
}

impl GenerationConfig {
    /// The grammar row `row` samples under, if any.
    pub fn constraint_of(&self, row: usize) -> Option<&AnswerGrammar> {
        match self.row_constraints.is_empty() {
            true => self.constraint.as_ref(),
            false => self.row_constraints.get(row).and_then(Option::as_ref),
        }
    }

    fn constrained(&self) -> bool {
        self.constraint.is_some() || self.row_constraints.iter().any(Option::is_some)
    }
}

/// After `after` tokens whose text lacks `unless`, the row is fed `ids` as if it had sampled
/// them (`</think><answer>` once the think budget is spent), then samples on.
#[derive(Clone, Debug, PartialEq)]
pub struct Forcing {
    pub after: usize,
    pub unless: String,
    pub ids: Vec<u32>,
}

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            temperature: 1.0,
            answer_temperature: None,
            top_p: 1.0,
            top_k: 0,
            stop_strings: vec![],
            share_prefixes: true,
            constraint: None,
            row_constraints: vec![],
            forcing: None,
            end_after_stop: None,
        }
    }
}

/// Shared prefixes shorter than this are prefilled with every row.
const MIN_SHARED_PREFIX: usize = 16;

/// What a separate prefill call costs beyond its tokens (kernel launches, cache set-up), in
/// token positions: it keeps rows that share nothing in one batch.
const CALL_COST: usize = 8;

/// Consecutive prompts that prefill a common prefix once.
#[derive(Debug, PartialEq)]
struct Cluster {
    rows: std::ops::Range<usize>,
    /// Tokens prefilled once (0: none); always less than every row's length.
    prefix: usize,
}

impl Cluster {
    /// Rows `rows` as one cluster: the prefix all of them share (at least one own token each).
    /// `adjacent[r]`: the common prefix of prompts r and r + 1 (the common prefix of a run is
    /// the least of its neighbours').
    fn of(prompts: &[Vec<u32>], adjacent: &[usize], rows: std::ops::Range<usize>) -> Self {
        let shortest = prompts[rows.clone()].iter().map(Vec::len).min().unwrap_or(1);
        let common = adjacent[rows.start..rows.end - 1].iter().copied().min().unwrap_or(usize::MAX);
        let prefix = common.min(shortest - 1);
        let prefix = if rows.len() < 2 || prefix < MIN_SHARED_PREFIX { 0 } else { prefix };
        Self { rows, prefix }
    }

    /// Token positions its prefill computes: the prefix once (unless every row resumes past
    /// it), then every row from the earliest position not known to the common end.
    fn cost(&self, prompts: &[Vec<u32>], resumed: &[usize]) -> usize {
        let known = |r: usize| resumed[r].max(self.prefix);
        let own = self.rows.clone().map(|r| prompts[r].len() - known(r)).max().unwrap_or(0);
        let shared = if self.rows.clone().any(|r| resumed[r] < self.prefix) { self.prefix } else { 0 };
        CALL_COST + shared + self.rows.len() * own
    }
}

/// Split the prompts into runs of consecutive rows, each prefilling its shared prefix once,
/// choosing the split that computes the fewest positions (dynamic programming over the cut
/// points). `resumed[r]`: positions row r continues from an earlier call. A group's rows share
/// their first prompt; a run across groups would share only the system prompt, so the split
/// falls at the group boundaries. Without sharing: one run.
fn clusters(prompts: &[Vec<u32>], resumed: &[usize], share: bool) -> Vec<Cluster> {
    let n = prompts.len();
    if !share {
        return vec![Cluster { rows: 0..n, prefix: 0 }];
    }
    let adjacent: Vec<usize> =
        prompts.windows(2).map(|w| w[0].iter().zip(&w[1]).take_while(|(a, b)| a == b).count()).collect();
    let of = |rows: std::ops::Range<usize>| Cluster::of(prompts, &adjacent, rows);
    // best[j]: (cost, start of the last run) of the best split of rows 0..j.
    let mut best: Vec<(usize, usize)> = vec![(0, 0); n + 1];
    for j in 1..=n {
        best[j] = (0..j).map(|i| (best[i].0 + of(i..j).cost(prompts, resumed), i)).min().expect("j >= 1");
    }
    let mut out = Vec::new();
    let mut j = n;
    while j > 0 {
        let i = best[j].1;
        out.push(of(i..j));
        j = i;
    }
    out.reverse();
    out
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Finish {
    /// A stop id (EOS, `<|im_end|>`) was sampled; it is the last id.
    Eos,
    /// A stop string appeared in the text.
    Stop,
    /// The token budget ran out.
    Length,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The sampled ids, including a final stop id.
    pub ids: Vec<u32>,
    /// The decoded text without special tokens, cut right after a stop string.
    pub text: String,
    /// Per id: its log-probability under softmax(logits / temperature) before top-k/top-p
    /// filtering (temperature 1 when greedy), the distribution training scores; under a
    /// constraint, of the masked logits (training scores the same renormalised distribution:
    /// `agent::pack::Packed::set_allowed`).
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// The sampler wrote `GenerationConfig::forcing`'s ids into this reply (their log-probs
    /// are 0).
    pub forced: bool,
    /// After a stop string, the log-prob of `GenerationConfig::end_after_stop` at the next
    /// position, as `logprobs` are (`None`: not asked for, or the row did not stop on one).
    pub end_logprob: Option<f32>,
}

/// The positions a row has already run through the model (its prompt and the generated tokens
/// fed back), with their keys and values: a later turn whose prompt starts with the same tokens
/// continues from them instead of prefilling the whole conversation again.
pub struct Resume {
    ids: Vec<u32>,
    kv: SharedPrefix,
}

impl Resume {
    /// Token positions held.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.kv.bytes()
    }

    /// Positions of `prompt` this resume can supply: the common prefix, leaving the prompt's
    /// last token to run (its hidden state gives the first new token).
    fn reusable(&self, prompt: &[u32]) -> usize {
        self.ids.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(prompt.len().saturating_sub(1))
    }
}

/// The distinct prompts: for each, the row that prefills it (of the rows with that prompt, the
/// one whose earlier turn supplies the most positions), and for every row, its prompt's index
/// among them.
fn distinct_prompts(prompts: &[Vec<u32>], resume: &[Option<Resume>]) -> (Vec<usize>, Vec<usize>) {
    let reusable = |r: usize| resume.get(r).and_then(Option::as_ref).map_or(0, |x| x.reusable(&prompts[r]));
    let mut index: std::collections::HashMap<&[u32], usize> = Default::default();
    let (mut firsts, mut of_row) = (Vec::new(), Vec::with_capacity(prompts.len()));
    for (r, prompt) in prompts.iter().enumerate() {
        let u = *index.entry(prompt.as_slice()).or_insert_with(|| {
            firsts.push(r);
            firsts.len() - 1
        });
        if reusable(r) > reusable(firsts[u]) {
            firsts[u] = r;
        }
        of_row.push(u);
    }
    (firsts, of_row)
}

/// Where a batch's random draws come from.
pub enum Draws<'a> {
    /// One stream for the whole batch, row after row (in process: the run's seed fixes every draw).
    Shared(&'a mut Rng),
    /// One stream per row (a server: a request's `seed` fixes its own draws whatever requests it
    /// happens to be batched with).
    PerRow(&'a mut [Rng]),
}

impl Draws<'_> {
    fn row(&mut self, row: usize) -> &mut Rng {
        match self {
            Draws::Shared(rng) => rng,
            Draws::PerRow(rngs) => &mut rngs[row],
        }
    }
}

/// log p_i = (z_i - max)/t - log Σ_j exp((z_j - max)/t) of one row of logits at `temperature`
/// (1 when greedy), for any i.
fn log_softmax_at(logits: &[f32], temperature: f64) -> impl Fn(usize) -> f32 + '_ {
    let t = if temperature > 0.0 { temperature as f32 } else { 1.0 };
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let logsum = logits.iter().map(|&z| ((z - max) / t).exp()).sum::<f32>().ln();
    move |i: usize| (logits[i] - max) / t - logsum
}

/// Pick a token from one row of logits at `temperature` (0 = greedy) with `cfg`'s top-k/top-p;
/// returns (id, log-prob as documented on `Generation`).
fn pick(logits: &[f32], temperature: f64, cfg: &GenerationConfig, rng: &mut Rng) -> (u32, f32) {
    let logprob = log_softmax_at(logits, temperature);
    if temperature <= 0.0 {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        return (best as u32, logprob(best));
    }
    let mut cand: Vec<(usize, f32)> = (0..logits.len()).map(|i| (i, logprob(i).exp())).collect();
    if cfg.top_k > 0 || cfg.top_p < 1.0 {
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if cfg.top_k > 0 {
            cand.truncate(cfg.top_k);
        }
        if cfg.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = cand.iter().position(|&(_, p)| {
                acc += p as f64;
                acc >= cfg.top_p
            });
            cand.truncate(keep.map_or(cand.len(), |k| k + 1));
        }
    }
    let total: f64 = cand.iter().map(|&(_, p)| p as f64).sum();
    let mut u = rng.next_f64() * total;
    for &(i, p) in &cand {
        u -= p as f64;
        if u < 0.0 {
            return (i as u32, logprob(i));
        }
    }
    // Rounding left a sliver: the last candidate that can be drawn (masked ones cannot).
    let (i, _) = *cand.iter().rev().find(|c| c.1 > 0.0).or(cand.last()).expect("at least one candidate");
    (i as u32, logprob(i))
}

impl Policy {
    /// Generate a continuation of every prompt (token ids, e.g. from `chat_tokens`).
    pub fn generate(&self, prompts: &[Vec<u32>], cfg: &GenerationConfig, rng: &mut Rng) -> Result<Vec<Generation>> {
        self.generate_with(prompts, cfg, Draws::Shared(rng), |_, _| {})
    }

    /// `generate` with the draws given, calling `on_token(row, id)` as each id is sampled (for
    /// streaming).
    pub fn generate_with(
        &self,
        prompts: &[Vec<u32>],
        cfg: &GenerationConfig,
        draws: Draws,
        on_token: impl FnMut(usize, u32),
    ) -> Result<Vec<Generation>> {
        if let Draws::PerRow(rngs) = &draws {
            if rngs.len() != prompts.len() {
                bail!("{} random streams for {} prompts", rngs.len(), prompts.len());
            }
        }
        Ok(self.run(prompts, &[], false, cfg, draws, on_token)?.0)
    }

    /// `generate` for rows that may continue an earlier call: `resume[i]` (if any) supplies the
    /// positions row i's prompt shares with it. With `keep`, also returns each row's new
    /// `Resume` (the prompt and the generated tokens fed back) for the next turn.
    pub fn generate_resuming(
        &self,
        prompts: &[Vec<u32>],
        resume: &[Option<Resume>],
        keep: bool,
        cfg: &GenerationConfig,
        rng: &mut Rng,
    ) -> Result<(Vec<Generation>, Vec<Option<Resume>>)> {
        if resume.len() != prompts.len() {
            bail!("{} resumes for {} prompts", resume.len(), prompts.len());
        }
        self.run(prompts, resume, keep, cfg, Draws::Shared(rng), |_, _| {})
    }

    fn run(
        &self,
        prompts: &[Vec<u32>],
        resume: &[Option<Resume>],
        keep: bool,
        cfg: &GenerationConfig,
        mut draws: Draws,
        mut on_token: impl FnMut(usize, u32),
    ) -> Result<(Vec<Generation>, Vec<Option<Resume>>)> {
        let b = prompts.len();
        if b == 0 {
            return Ok((vec![], vec![]));
        }
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            bail!("prompt {i} is empty: generation needs at least one token to condition on");
        }
        let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let starts: Vec<usize> = prompts.iter().map(|x| p - x.len()).collect();
        let dev = self.device();
        // Rows with the same prompt (a group's first turn; episodes whose histories are still
        // alike) prefill it once, from the longest earlier turn any of them kept; the cache
        // rows are then copied out to them.
        let (firsts, of_row) = match cfg.share_prefixes {
            true => distinct_prompts(prompts, resume),
            false => ((0..b).collect(), (0..b).collect()),
        };
        let (mut cache, mut last) = phase::timed(Phase::Prefill, || -> Result<_> {
            let pick = |r: &usize| prompts[*r].clone();
            let once: Vec<Vec<u32>> = firsts.iter().map(pick).collect();
            let once_starts: Vec<usize> = firsts.iter().map(|&r| starts[r]).collect();
            let once_resume: Vec<Option<&Resume>> =
                firsts.iter().map(|&r| resume.get(r).and_then(Option::as_ref)).collect();
            let (mut cache, last) = self.prefill(&once, &once_starts, &once_resume, cfg)?;
            if firsts.len() == b {
                return Ok((cache, last));
            }
            cache.retain(&of_row)?;
            let idx = Tensor::from_vec(of_row.iter().map(|&i| i as u32).collect::<Vec<_>>(), b, dev)?;
            Ok((cache, last.contiguous()?.index_select(&idx, 0)?))
        })?;
        let mut out: Vec<Generation> = (0..b)
            .map(|_| Generation {
                ids: vec![],
                text: String::new(),
                logprobs: vec![],
                finish: Finish::Length,
                forced: false,
                end_logprob: None,
            })
            .collect();
        let mut kept: Vec<Option<Resume>> = (0..b).map(|_| None).collect();
        // Row k of the cache holds the positions of `prompts[row]` and of the tokens fed after
        // it: all generated ids but the last (never fed back).
        let snapshot = |cache: &KvCache, k: usize, row: usize, g: &Generation| -> Result<Resume> {
            let ids = [prompts[row].as_slice(), &g.ids[..g.ids.len().saturating_sub(1)]].concat();
            Ok(Resume { kv: cache.row(k, starts[row], ids.len())?, ids })
        };
        let mut done = vec![false; b];
        // Rows that stopped on a stop string and wait for the end-of-turn's score: their last id
        // is fed once more, and the next step reads its log-prob instead of drawing.
        let mut ending = vec![false; b];
        // Under a constraint or a forcing: each row's text so far, token texts appended as they
        // are sampled; and the forced ids a row has still to be fed.
        let token_texts = (cfg.constrained() || cfg.forcing.is_some()).then(|| self.token_texts());
        let mut replies = vec![String::new(); b];
        let mut to_force: Vec<std::collections::VecDeque<u32>> = vec![Default::default(); b];
        // Cache row k holds sequence active[k]; finished sequences are dropped from the batch
        // once they are a quarter of it, so long stragglers do not drag the whole batch along.
        let mut active: Vec<usize> = (0..b).collect();
        let mut active_starts = starts.clone();
        let decode_start = std::time::Instant::now();
        for step in 0.. {
            let logits = self.model.logits_no_grad(&last)?.to_vec2::<f32>()?;
            let mut next = vec![self.pad_id; active.len()];
            for (k, &row) in active.iter().enumerate() {
                if let (true, Some(end)) = (ending[row], cfg.end_after_stop) {
                    out[row].end_logprob = Some(log_softmax_at(&logits[k], cfg.temperature)(end as usize));
                    ending[row] = false;
                }
                if done[row] || step >= cfg.max_new_tokens {
                    continue;
                }
                if let Some(f) = cfg.forcing.as_ref().filter(|f| {
                    !out[row].forced && out[row].ids.len() >= f.after && !replies[row].contains(f.unless.as_str())
                }) {
                    out[row].forced = true;
                    to_force[row].extend(&f.ids);
                }
                // A forced id, else a draw: under a constraint, from the tokens that keep the
                // answer well-formed (unmasked inside the think block or off the grammar).
                let (id, lp) = if let Some(id) = to_force[row].pop_front() {
                    (id, 0.0)
                } else {
                    let grammar = cfg.constraint_of(row).zip(token_texts.as_ref());
                    let allowed = grammar.and_then(|(g, texts)| g.next_tokens(&replies[row], &out[row].ids, texts));
                    match allowed {
                        Some(allowed) => {
                            let v = logits[k].len();
                            let mut masked = vec![f32::NEG_INFINITY; v];
                            for &id in allowed.iter().filter(|&&id| (id as usize) < v) {
                                masked[id as usize] = logits[k][id as usize];
                            }
                            // A choice among several legal tokens is drawn at the answer
                            // temperature; a value's characters are copied, at the text one.
                            let choice = || {
                                allowed.len() > 1
                                    && !grammar
                                        .is_some_and(|(g, texts)| g.in_value(&replies[row], &out[row].ids, texts))
                            };
                            let t = match cfg.answer_temperature {
                                Some(t) if cfg.temperature > 0.0 && choice() => t,
                                _ => cfg.temperature,
                            };
                            pick(&masked, t, cfg, draws.row(row))
                        }
                        None => pick(&logits[k], cfg.temperature, cfg, draws.row(row)),
                    }
                };
                if let Some(texts) = &token_texts {
                    replies[row].push_str(texts.get(id as usize).map_or("", String::as_str));
                }
                let g = &mut out[row];
                g.ids.push(id);
                g.logprobs.push(lp);
                next[k] = id;
                on_token(row, id);
                if self.stop_ids.contains(&id) {
                    g.finish = Finish::Eos;
                    done[row] = true;
                } else if !cfg.stop_strings.is_empty() && self.stop_string_ends_here(&g.ids, &cfg.stop_strings)? {
                    g.finish = Finish::Stop;
                    done[row] = true;
                    ending[row] = cfg.end_after_stop.is_some();
                }
            }
            let waiting = ending.iter().any(|&e| e);
            if !waiting && (done.iter().all(|&d| d) || step + 1 >= cfg.max_new_tokens) {
                break;
            }
            let gone = |r: usize| done[r] && !ending[r];
            let finished = active.iter().filter(|&&r| gone(r)).count();
            if finished > 0 && finished * 4 >= active.len() {
                if keep {
                    for (k, &row) in active.iter().enumerate().filter(|(_, &r)| gone(r)) {
                        kept[row] = Some(snapshot(&cache, k, row, &out[row])?);
                    }
                }
                let stay: Vec<usize> = (0..active.len()).filter(|&k| !gone(active[k])).collect();
                cache.retain(&stay)?;
                next = stay.iter().map(|&k| next[k]).collect();
                active_starts = stay.iter().map(|&k| active_starts[k]).collect();
                active = stay.iter().map(|&k| active[k]).collect();
            }
            let ids = Tensor::from_vec(next, (active.len(), 1), dev)?;
            last = self.model.hidden(&ids, &active_starts, Some(&mut cache), Mode::Sample)?.squeeze(1)?;
            phase::add_tokens(active.len());
        }
        if keep {
            for (k, &row) in active.iter().enumerate() {
                kept[row] = Some(snapshot(&cache, k, row, &out[row])?);
            }
        }
        phase::add_seconds(Phase::Decode, decode_start.elapsed().as_secs_f64());
        for g in &mut out {
            g.text = self.decode(&g.ids)?;
            if g.finish == Finish::Stop {
                let end = cfg
                    .stop_strings
                    .iter()
                    .filter_map(|s| g.text.find(s.as_str()).map(|i| i + s.len()))
                    .min()
                    .unwrap_or(g.text.len());
                g.text.truncate(end);
            }
        }
        Ok((out, kept))
    }

    /// Whether the text of `ids` now holds a stop string. Rows are checked after every token, so
    /// a new match ends in the newest token: only a tail long enough for the longest stop string
    /// and that token is decoded (with slack for a character cut at the tail's start), not the
    /// whole reply every token.
    fn stop_string_ends_here(&self, ids: &[u32], stops: &[String]) -> Result<bool> {
        let newest = self.decode(&ids[ids.len() - 1..])?.len();
        let need = stops.iter().map(String::len).max().unwrap_or(0) + newest + 8;
        let mut n = need.min(ids.len());
        loop {
            let text = self.decode(&ids[ids.len() - n..])?;
            if text.len() >= need || n == ids.len() {
                return Ok(stops.iter().any(|s| text.contains(s.as_str())));
            }
            n = (2 * n).min(ids.len());
        }
    }

    /// The KV cache after every prompt, left-padded to a common end `p`, with room for the new
    /// tokens; and the last position's hidden state of each row, `[B, H]`. A row's first
    /// positions come from its `resume` or from its cluster's shared prefix (run once), copied
    /// into its place; then each cluster runs only the positions from its earliest own token
    /// to `p`.
    fn prefill(
        &self,
        prompts: &[Vec<u32>],
        starts: &[usize],
        resume: &[Option<&Resume>],
        cfg: &GenerationConfig,
    ) -> Result<(KvCache, Tensor)> {
        let dev = self.device();
        let p = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let capacity = p + cfg.max_new_tokens;
        let resumed: Vec<usize> =
            (0..prompts.len()).map(|r| resume[r].map_or(0, |x| x.reusable(&prompts[r]))).collect();
        let (mut caches, mut lasts) = (Vec::new(), Vec::new());
        for c in clusters(prompts, &resumed, cfg.share_prefixes) {
            let rows = c.rows.len();
            let mut cache = KvCache::new(&self.model.cfg, rows, capacity, dev)?;
            let shared = match c.prefix > 0 && c.rows.clone().any(|r| resumed[r] < c.prefix) {
                true => Some(self.model.prefix(&prompts[c.rows.start][..c.prefix], Mode::Sample)?),
                false => None,
            };
            let mut own = 1;
            for (i, r) in c.rows.clone().enumerate() {
                let known = match (&resume[r], &shared) {
                    (Some(x), _) if resumed[r] >= c.prefix && resumed[r] > 0 => {
                        cache.write_prefix(i, starts[r], &x.kv, resumed[r])?;
                        resumed[r]
                    }
                    (_, Some(sh)) => {
                        cache.write_prefix(i, starts[r], sh, c.prefix)?;
                        c.prefix
                    }
                    _ => 0,
                };
                own = own.max(prompts[r].len() - known);
            }
            // Positions p - own .. p hold every row's own tokens (and, for rows with fewer, some
            // already known or padding positions, recomputed or masked).
            let mut flat = Vec::with_capacity(rows * own);
            for r in c.rows.clone() {
                let row = &prompts[r];
                for pos in p - own..p {
                    flat.push(if pos < starts[r] { self.pad_id } else { row[pos - starts[r]] });
                }
            }
            cache.set_len(p - own);
            let ids = Tensor::from_vec(flat, (rows, own), dev)?;
            let hidden = self.model.hidden(&ids, &starts[c.rows.clone()], Some(&mut cache), Mode::Sample)?;
            phase::add_tokens(shared.as_ref().map_or(0, |_| c.prefix) + rows * own);
            lasts.push(hidden.narrow(1, own - 1, 1)?.squeeze(1)?); // [rows, H]
            caches.push(cache);
        }
        Ok((KvCache::cat(caches)?, Tensor::cat(&lasts, 0)?))
    }

    /// Last-position logits after `ids` (one row, sampling path), for checks and the CLI.
    pub fn next_token_logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let dev = self.device();
        let x = Tensor::from_vec(ids.to_vec(), (1, ids.len()), dev)?;
        let h = self.model.hidden(&x, &[0], None, Mode::Sample)?;
        let last = h.narrow(1, ids.len() - 1, 1)?.squeeze(1)?;
        Ok(self.model.logits_no_grad(&last)?.squeeze(0)?.to_vec1::<f32>()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clusters_split_at_group_boundaries_and_keep_loners_together() {
        let system: Vec<u32> = (100..140).collect();
        let prompt = |group: u32, extra: &[u32]| -> Vec<u32> {
            [system.clone(), (0..30).map(|i| 1000 * group + i).collect(), extra.to_vec()].concat()
        };
        // Two groups of three (their first prompt shared, then own replies), then two loners.
        let prompts = vec![
            prompt(1, &[1, 2]),
            prompt(1, &[3]),
            prompt(1, &[4, 5, 6]),
            prompt(2, &[7]),
            prompt(2, &[8]),
            prompt(2, &[9, 9]),
            vec![1, 2, 3],
            vec![4, 5],
        ];
        let none = vec![0; prompts.len()];
        let c = clusters(&prompts, &none, true);
        assert_eq!(c[0], Cluster { rows: 0..3, prefix: 70 });
        assert_eq!(c[1], Cluster { rows: 3..6, prefix: 70 });
        assert_eq!(c[2], Cluster { rows: 6..8, prefix: 0 }, "short unrelated rows batch together");
        assert_eq!(c.len(), 3);
        assert_eq!(clusters(&prompts, &none, false), vec![Cluster { rows: 0..8, prefix: 0 }]);
        // Rows that resume their own earlier turn need no shared prefix: one batch.
        let resumed: Vec<usize> = prompts.iter().map(|p| p.len() - 1).collect();
        let c = clusters(&prompts[..6], &resumed[..6], true);
        assert_eq!(c.iter().map(|c| c.cost(&prompts, &resumed)).sum::<usize>(), CALL_COST + 6);
        // Identical prompts: all but the last token once.
        let same = vec![prompt(1, &[]); 4];
        assert_eq!(clusters(&same, &[0; 4], true), vec![Cluster { rows: 0..4, prefix: 69 }]);
    }

    #[test]
    fn pick_is_greedy_at_zero_temperature_and_respects_top_k() {
        let logits = [0.0f32, 3.0, 1.0, 2.9];
        let mut rng = Rng::new(1);
        let greedy = GenerationConfig { temperature: 0.0, ..Default::default() };
        let (id, lp) = pick(&logits, greedy.temperature, &greedy, &mut rng);
        assert_eq!(id, 1);
        let z: f32 = logits.iter().map(|x| x.exp()).sum();
        assert!((lp - (3.0f32.exp() / z).ln()).abs() < 1e-6);
        let top2 = GenerationConfig { top_k: 2, ..Default::default() };
        for _ in 0..200 {
            let (id, _) = pick(&logits, top2.temperature, &top2, &mut rng);
            assert!(id == 1 || id == 3);
        }
        let nucleus = GenerationConfig { top_p: 0.01, ..Default::default() };
        assert_eq!(pick(&logits, nucleus.temperature, &nucleus, &mut rng).0, 1);
    }
}
