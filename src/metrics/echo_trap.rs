//! Echo-Trap diagnostics: detectors that watch the per-step metric series for the signs of
//! collapse RAGEN describes (notes/ragen.md §4-5), and RAGEN-2's mutual-information estimate of
//! template collapse.
//!
//! Each detector is a small state machine over one or two series; [`EchoTrapMonitor`] feeds them
//! from the trainer's flat metrics line (`observe(step, &metrics)`) and announces an [`Alarm`] once
//! when its condition starts, not on every step it persists. The thresholds are [`EchoSettings`]
//! (nested in the trainer's settings as `echo`). The pure math ([`mutual_information`],
//! [`repetition`]) has no state; the trainer computes its inputs (the cross log-prob matrix with
//! the policy, the batch's response strings) and puts the results in the metrics line under
//! `echo/` and `rollout/repetition`, where the monitor picks them up.
//!
//! This file does no I/O: writing alarms to `events.jsonl` and the metrics line is the caller's.
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::keys::Key;
use std::collections::{HashSet, VecDeque};

settings_section! {
    /// Echo-Trap alarm thresholds (`echo.*`). Defaults follow the shapes of RAGEN's Fig. 6 curves;
    /// every alarm names the numbers it compared, so a threshold that is wrong for a task shows.
    EchoSettings {
        /// Run the Echo-Trap monitor at all (alarms in the terminal, events.jsonl, metrics, viewer).
        enabled: bool = true,
        /// Observations of a series before any alarm on it may fire (its baseline needs data).
        warmup_steps: usize = 5,
        /// Steps averaged for the "early level" of entropy and think length (the first values seen).
        baseline_steps: usize = 5,
        /// Consecutive steps a slow condition (variance cliff, entropy collapse, vanishing
        /// reasoning, repetition) must hold before it is announced; `since` is the first of them.
        confirm_steps: usize = 2,
        /// Steps in the moving average used for the running peaks of in-group std and mean reward.
        smooth_window: usize = 3,
        /// Variance cliff: rollout/in_group_std below this fraction of its running peak...
        cliff_fraction: f64 = 0.3,
        /// ...while rollout/reward_mean is still within this many peak-stds of its own running
        /// peak (the mean "has not fallen yet": RAGEN's early warning).
        cliff_mean_drop: f64 = 1.0,
        /// Variance cliff: ignore runs whose peak in-group std never exceeded this.
        cliff_min_peak: f64 = 0.01,
        /// Gradient-norm spike: update/grad_norm above this factor x its running median.
        spike_factor: f64 = 5.0,
        /// Steps in the running median for gradient-norm spikes and entropy rises.
        median_window: usize = 20,
        /// Variance cliff and entropy collapse stay quiet on steps whose rollout/success is at
        /// least this: when (nearly) every episode succeeds, groups agree and the policy settles,
        /// which is a solved task, not the Echo Trap (`stop.solved_*` ends such a run).
        solved_success: f64 = 0.9,
        /// Entropy collapse: update/entropy below this fraction of its early level.
        entropy_collapse_fraction: f64 = 0.1,
        /// Erratic entropy: update/entropy above this factor x its running median.
        entropy_rise_factor: f64 = 2.0,
        /// Vanishing reasoning: rollout/think_len below this fraction of its early level.
        think_fraction: f64 = 0.2,
        /// Vanishing reasoning: ignore runs whose early think length is under this many tokens.
        think_min_baseline: f64 = 2.0,
        /// Repetition: rollout/repetition (share of responses duplicating another) above this.
        repetition_max: f64 = 0.5,
        /// One answer: rollout/answer_top_share (the most common answer's share over distinct
        /// observations) above this.
        one_answer_max: f64 = 0.99,
        /// Template collapse: compute RAGEN-2's mutual-information estimate every this many steps
        /// (0 = never). The trainer reads this; the monitor checks whatever echo/ values arrive.
        mi_every: usize = 5,
        /// Template collapse: (prompt, reasoning) pairs N in the cross log-prob matrix.
        mi_samples: usize = 16,
        /// Template collapse: MI below this fraction of its upper bound ln N...
        mi_min_fraction: f64 = 0.15,
        /// ...and retrieval accuracy at most this factor x chance (1/N).
        retrieval_chance_factor: f64 = 1.5,
    }
}

/// What an alarm is about; serialised in snake_case (`"variance_cliff"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AlarmKind {
    VarianceCliff,
    GradNormSpike,
    EntropyCollapse,
    EntropyRise,
    VanishingReasoning,
    Repetition,
    OneAnswer,
    TemplateCollapse,
}

impl AlarmKind {
    pub fn as_str(self) -> &'static str {
        match self {
            AlarmKind::VarianceCliff => "variance_cliff",
            AlarmKind::GradNormSpike => "grad_norm_spike",
            AlarmKind::EntropyCollapse => "entropy_collapse",
            AlarmKind::EntropyRise => "entropy_rise",
            AlarmKind::VanishingReasoning => "vanishing_reasoning",
            AlarmKind::Repetition => "repetition",
            AlarmKind::OneAnswer => "one_answer",
            AlarmKind::TemplateCollapse => "template_collapse",
        }
    }
}

/// One announcement: what was seen, since which step, with the numbers compared.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Alarm {
    pub kind: AlarmKind,
    /// The step at which it was announced (≥ `since` when confirmation takes several steps).
    pub step: u64,
    /// The first step at which the condition held.
    pub since: u64,
    /// The observed value (at `step`).
    pub value: f64,
    /// The value it was compared against (threshold already applied: peak × fraction, etc.).
    pub threshold: f64,
    /// One line for a human, with the numbers.
    pub message: String,
}

impl Alarm {
    /// The line for `events.jsonl` (contract: `kind` = "alarm"; `alarm` names the detector).
    pub fn event(&self, time: f64) -> Value {
        serde_json::json!({
            "step": self.step, "time": time, "kind": "alarm", "alarm": self.kind.as_str(),
            "since": self.since, "value": self.value, "threshold": self.threshold,
            "message": self.message,
        })
    }

    /// The entry for the step's metrics line (`"alarms": [...]`).
    pub fn metrics_entry(&self) -> Value {
        serde_json::json!({"kind": self.kind.as_str(), "since": self.since, "message": self.message})
    }
}

impl std::fmt::Display for Alarm {
    /// The terminal line: `alarm at step 41: variance_cliff: … (since step 40)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "alarm at step {}: {}", self.step, self.message)
    }
}

/// Puts a step's new alarms into its metrics line as `"alarms": [{kind, since, message}]`
/// (nothing when there are none, so quiet steps stay small).
pub fn record(alarms: &[Alarm], line: &mut Map<String, Value>) {
    if !alarms.is_empty() {
        line.insert("alarms".into(), Value::Array(alarms.iter().map(Alarm::metrics_entry).collect()));
    }
}

/// Announces a condition once when it has held for `need` consecutive observations, then stays
/// quiet until the condition clears (after which it may fire again).
#[derive(Clone, Debug, Default)]
struct Latch {
    need: usize,
    start: Option<u64>,
    run: usize,
    announced: bool,
}

impl Latch {
    fn new(need: usize) -> Self {
        Latch { need: need.max(1), ..Default::default() }
    }

    /// Returns `Some(since)` exactly on the step the condition is to be announced.
    fn feed(&mut self, step: u64, holds: bool) -> Option<u64> {
        if !holds {
            *self = Latch::new(self.need);
            return None;
        }
        let since = *self.start.get_or_insert(step);
        self.run += 1;
        if self.run >= self.need && !self.announced {
            self.announced = true;
            return Some(since);
        }
        None
    }
}

/// The last `cap` values of a series.
#[derive(Clone, Debug)]
struct Window {
    cap: usize,
    xs: VecDeque<f64>,
}

impl Window {
    fn new(cap: usize) -> Self {
        Window { cap: cap.max(1), xs: VecDeque::new() }
    }
    fn push(&mut self, x: f64) {
        if self.xs.len() == self.cap {
            self.xs.pop_front();
        }
        self.xs.push_back(x);
    }
    fn mean(&self) -> f64 {
        self.xs.iter().sum::<f64>() / self.xs.len().max(1) as f64
    }
    fn median(&self) -> f64 {
        let mut v: Vec<f64> = self.xs.iter().copied().collect();
        v.sort_by(|a, b| a.total_cmp(b));
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
        }
    }
}

/// The mean of the first `n` values of a series: its "early level".
#[derive(Clone, Debug)]
struct Baseline {
    n: usize,
    sum: f64,
    seen: usize,
}

impl Baseline {
    fn new(n: usize) -> Self {
        Baseline { n: n.max(1), sum: 0.0, seen: 0 }
    }
    fn push(&mut self, x: f64) {
        if self.seen < self.n {
            self.sum += x;
            self.seen += 1;
        }
    }
    /// Some(level) once the first `n` values are in.
    fn level(&self) -> Option<f64> {
        (self.seen >= self.n).then(|| self.sum / self.seen as f64)
    }
}

/// A condition seen at one step, before latching.
struct Finding {
    holds: bool,
    value: f64,
    threshold: f64,
    message: String,
}

impl Finding {
    fn quiet() -> Self {
        Finding { holds: false, value: f64::NAN, threshold: f64::NAN, message: String::new() }
    }
}

/// Variance cliff: in-group reward std falls below a fraction of its running (smoothed) peak
/// while the mean reward has not fallen by more than `cliff_mean_drop` × that peak std.
#[derive(Clone, Debug)]
pub struct VarianceCliff {
    fraction: f64,
    mean_drop: f64,
    min_peak: f64,
    std_recent: Window,
    mean_recent: Window,
    peak_std: f64,
    peak_std_step: u64,
    peak_mean: f64,
}

impl VarianceCliff {
    pub fn new(s: &EchoSettings) -> Self {
        VarianceCliff {
            fraction: s.cliff_fraction,
            mean_drop: s.cliff_mean_drop,
            min_peak: s.cliff_min_peak,
            std_recent: Window::new(s.smooth_window),
            mean_recent: Window::new(s.smooth_window),
            peak_std: f64::NEG_INFINITY,
            peak_std_step: 0,
            peak_mean: f64::NEG_INFINITY,
        }
    }

    fn check(&mut self, step: u64, std: f64, mean: f64) -> Finding {
        // Compare against the peaks *before* this step, so a cliff cannot lower its own bar.
        let limit = self.fraction * self.peak_std;
        let mean_now = {
            let mut w = self.mean_recent.clone();
            w.push(mean);
            w.mean()
        };
        let mean_fell = self.peak_mean - mean_now > self.mean_drop * self.peak_std;
        let f = if self.peak_std >= self.min_peak && std < limit && !mean_fell {
            Finding {
                holds: true,
                value: std,
                threshold: limit,
                message: format!(
                    "in-group reward std {std:.4} is {:.0}% of its peak {:.4} (step {}) while mean \
                     reward holds at {mean_now:.4} (peak {:.4}): the group no longer disagrees, \
                     the learning signal is vanishing",
                    100.0 * std / self.peak_std,
                    self.peak_std,
                    self.peak_std_step,
                    self.peak_mean
                ),
            }
        } else {
            Finding::quiet()
        };
        self.std_recent.push(std);
        self.mean_recent.push(mean);
        if self.std_recent.mean() > self.peak_std {
            self.peak_std = self.std_recent.mean();
            self.peak_std_step = step;
        }
        self.peak_mean = self.peak_mean.max(self.mean_recent.mean());
        f
    }
}

/// A value far above its own running median (gradient-norm spikes, erratic entropy rises).
#[derive(Clone, Debug)]
pub struct SpikeOverMedian {
    factor: f64,
    recent: Window,
}

impl SpikeOverMedian {
    pub fn new(factor: f64, window: usize) -> Self {
        SpikeOverMedian { factor, recent: Window::new(window) }
    }

    fn check(&mut self, x: f64, what: &str) -> Finding {
        let median = self.recent.median();
        let limit = self.factor * median;
        let f = if median.is_finite() && median > 0.0 && x > limit {
            Finding {
                holds: true,
                value: x,
                threshold: limit,
                message: format!(
                    "{what} {x:.4} is {:.1}× its running median {median:.4} (threshold {:.1}×)",
                    x / median,
                    self.factor
                ),
            }
        } else {
            Finding::quiet()
        };
        self.recent.push(x);
        f
    }
}

/// A value fallen below a fraction of its early level (entropy collapse, vanishing reasoning).
#[derive(Clone, Debug)]
pub struct FallBelowEarly {
    fraction: f64,
    min_baseline: f64,
    early: Baseline,
}

impl FallBelowEarly {
    pub fn new(fraction: f64, baseline_steps: usize, min_baseline: f64) -> Self {
        FallBelowEarly { fraction, min_baseline, early: Baseline::new(baseline_steps) }
    }

    fn check(&mut self, x: f64, what: &str) -> Finding {
        self.early.push(x);
        match self.early.level() {
            Some(level) if level >= self.min_baseline && x < self.fraction * level => Finding {
                holds: true,
                value: x,
                threshold: self.fraction * level,
                message: format!(
                    "{what} {x:.4} is {:.0}% of its early level {level:.4} (threshold {:.0}%)",
                    100.0 * x / level,
                    100.0 * self.fraction
                ),
            },
            _ => Finding::quiet(),
        }
    }
}

/// A value above a fixed limit (repetition share, one answer's share).
fn above(x: f64, limit: f64, message: impl FnOnce() -> String) -> Finding {
    if x > limit {
        Finding { holds: true, value: x, threshold: limit, message: message() }
    } else {
        Finding::quiet()
    }
}

/// Template collapse from the `echo/` keys of [`MutualInfo::to_metrics`]: MI near zero and
/// retrieval accuracy near chance (reasoning no longer depends on the input).
fn template_collapse(s: &EchoSettings, m: &Map<String, Value>) -> Option<Finding> {
    let mi = num(m, Key::MiEstimate)?;
    let acc = num(m, Key::RetrievalAccuracy)?;
    let n = num(m, Key::MiSamples)?;
    if n < 2.0 {
        return None;
    }
    let (bound, chance) = (n.ln(), 1.0 / n);
    let holds = mi < s.mi_min_fraction * bound && acc <= s.retrieval_chance_factor * chance;
    Some(if holds {
        Finding {
            holds,
            value: mi,
            threshold: s.mi_min_fraction * bound,
            message: format!(
                "reasoning no longer depends on the prompt: mutual information {mi:.3} nats is \
                 {:.0}% of its bound ln {n} = {bound:.3}, retrieval accuracy {acc:.3} vs chance \
                 {chance:.3}",
                100.0 * mi / bound
            ),
        }
    } else {
        Finding::quiet()
    })
}

fn num(m: &Map<String, Value>, key: Key) -> Option<f64> {
    key.get(m)
}

/// The metric keys the detectors read: variance cliff, gradient spike, entropy low and high,
/// think collapse, repetition, and the template-collapse probe's.
pub const ALARM_KEYS: &[Key] = &[
    Key::InGroupStd,
    Key::RewardMean,
    Key::GradNorm,
    Key::Entropy,
    Key::ThinkLen,
    Key::Repetition,
    Key::AnswerTopShare,
    Key::MiEstimate,
    Key::RetrievalAccuracy,
    Key::MiSamples,
];

/// Runs every detector over the trainer's per-step metrics and announces each alarm once.
#[derive(Clone, Debug)]
pub struct EchoTrapMonitor {
    settings: EchoSettings,
    seen: [usize; 6],
    cliff: (VarianceCliff, Latch),
    spike: (SpikeOverMedian, Latch),
    entropy_low: (FallBelowEarly, Latch),
    entropy_high: (SpikeOverMedian, Latch),
    think: (FallBelowEarly, Latch),
    repeat: Latch,
    one_answer: Latch,
    template: Latch,
}

impl EchoTrapMonitor {
    pub fn new(settings: EchoSettings) -> Self {
        let s = &settings;
        EchoTrapMonitor {
            seen: [0; 6],
            cliff: (VarianceCliff::new(s), Latch::new(s.confirm_steps)),
            spike: (SpikeOverMedian::new(s.spike_factor, s.median_window), Latch::new(1)),
            entropy_low: (
                FallBelowEarly::new(s.entropy_collapse_fraction, s.baseline_steps, 0.0),
                Latch::new(s.confirm_steps),
            ),
            entropy_high: (SpikeOverMedian::new(s.entropy_rise_factor, s.median_window), Latch::new(1)),
            think: (
                FallBelowEarly::new(s.think_fraction, s.baseline_steps, s.think_min_baseline),
                Latch::new(s.confirm_steps),
            ),
            repeat: Latch::new(s.confirm_steps),
            one_answer: Latch::new(s.confirm_steps),
            template: Latch::new(1),
            settings,
        }
    }

    pub fn settings(&self) -> &EchoSettings {
        &self.settings
    }

    /// Feed one step's metrics line; returns the alarms that start at this step. Absent keys are
    /// skipped (a detector neither advances nor clears), so sparse metrics such as `echo/` work.
    pub fn observe(&mut self, step: u64, m: &Map<String, Value>) -> Vec<Alarm> {
        if !self.settings.enabled {
            return vec![];
        }
        let warm = self.settings.warmup_steps;
        let mut out = vec![];
        let mut emit = |latch: &mut Latch, kind: AlarmKind, f: Finding, armed: bool| {
            // Before warm-up the detector learns its baselines but may not announce.
            if let Some(since) = latch.feed(step, f.holds && armed) {
                out.push(Alarm {
                    kind,
                    step,
                    since,
                    value: f.value,
                    threshold: f.threshold,
                    message: format!("{}: {} (since step {since})", kind.as_str(), f.message),
                });
            }
        };
        let mut tick = |i: usize| {
            self.seen[i] += 1;
            self.seen[i] > warm
        };
        // A solved step's agreement and certainty are what learning was for.
        let solved = num(m, Key::Success).is_some_and(|x| x >= self.settings.solved_success);
        if let (Some(std), Some(mean)) = (num(m, Key::InGroupStd), num(m, Key::RewardMean)) {
            let armed = tick(0);
            let f = self.cliff.0.check(step, std, mean);
            emit(&mut self.cliff.1, AlarmKind::VarianceCliff, f, armed && !solved);
        }
        if let Some(g) = num(m, Key::GradNorm) {
            let armed = tick(1);
            let f = self.spike.0.check(g, "gradient norm");
            emit(&mut self.spike.1, AlarmKind::GradNormSpike, f, armed);
        }
        if let Some(h) = num(m, Key::Entropy) {
            let armed = tick(2);
            let f = self.entropy_low.0.check(h, "token entropy");
            emit(&mut self.entropy_low.1, AlarmKind::EntropyCollapse, f, armed && !solved);
            let f = self.entropy_high.0.check(h, "token entropy");
            emit(&mut self.entropy_high.1, AlarmKind::EntropyRise, f, armed);
        }
        if let Some(t) = num(m, Key::ThinkLen) {
            let armed = tick(3);
            let f = self.think.0.check(t, "think length (tokens per turn)");
            emit(&mut self.think.1, AlarmKind::VanishingReasoning, f, armed);
        }
        if let Some(r) = num(m, Key::Repetition) {
            let armed = tick(4);
            let limit = self.settings.repetition_max;
            let f = above(r, limit, || {
                format!(
                    "{:.0}% of responses duplicate another in the batch (threshold {:.0}%)",
                    100.0 * r,
                    100.0 * limit
                )
            });
            emit(&mut self.repeat, AlarmKind::Repetition, f, armed);
        }
        if let Some(share) = num(m, Key::AnswerTopShare) {
            let armed = tick(5);
            let limit = self.settings.one_answer_max;
            let f = above(share, limit, || {
                format!(
                    "{:.0}% of the answers are the same one whatever the observation (threshold {:.0}%)",
                    100.0 * share,
                    100.0 * limit
                )
            });
            emit(&mut self.one_answer, AlarmKind::OneAnswer, f, armed);
        }
        if let Some(f) = template_collapse(&self.settings, m) {
            // Sparse (every `mi_every` steps): no warm-up beyond having a matrix at all.
            emit(&mut self.template, AlarmKind::TemplateCollapse, f, true);
        }
        out
    }
}

/// Replays a recorded run's metrics through a fresh monitor (for plots and the viewer of a run
/// written without alarms, or with other thresholds).
pub fn replay<'a>(
    settings: &EchoSettings,
    lines: impl IntoIterator<Item = (u64, &'a Map<String, Value>)>,
) -> Vec<Alarm> {
    let mut mon = EchoTrapMonitor::new(settings.clone());
    lines.into_iter().flat_map(|(step, m)| mon.observe(step, m)).collect()
}

/// The share of responses in a batch that duplicate another response in it (`rollout/repetition`).
/// Responses are compared after trimming and collapsing whitespace runs; an exact template
/// repeated by every episode gives 1.0, all-distinct responses 0.0.
pub fn repetition<S: AsRef<str>>(responses: &[S]) -> f64 {
    if responses.is_empty() {
        return 0.0;
    }
    let norm: Vec<String> =
        responses.iter().map(|r| r.as_ref().split_whitespace().collect::<Vec<_>>().join(" ")).collect();
    let mut once = HashSet::new();
    let mut twice = HashSet::new();
    for r in &norm {
        if !once.insert(r.as_str()) {
            twice.insert(r.as_str());
        }
    }
    let dup = norm.iter().filter(|r| twice.contains(r.as_str())).count();
    dup as f64 / norm.len() as f64
}

/// The share of `answers` (each `(observation, answer)`) that are the most common answer, when
/// the observations take at least 4 distinct values (`rollout/answer_top_share`); `None` when they
/// do not, since one answer to one observation is no collapse.
pub fn answer_top_share<O: AsRef<str>, A: AsRef<str>>(answers: &[(O, A)]) -> Option<f64> {
    let observations: HashSet<&str> = answers.iter().map(|(o, _)| o.as_ref()).collect();
    if observations.len() < 4 {
        return None;
    }
    let mut counts: std::collections::HashMap<&str, usize> = Default::default();
    for (_, a) in answers {
        *counts.entry(a.as_ref()).or_default() += 1;
    }
    let top = counts.values().copied().max().unwrap_or(0);
    Some(top as f64 / answers.len() as f64)
}

/// RAGEN-2's template-collapse estimate from a cross log-prob matrix.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MutualInfo {
    /// Number of prompts N (columns).
    pub n: usize,
    /// H(Z|X) = −mean_i log p(z_i | x_{t(i)}), nats per trace.
    pub conditional_entropy: f64,
    /// H(Z) with p(z) the mixture (1/N) Σ_j p(z | x_j), nats per trace.
    pub marginal_entropy: f64,
    /// I(X;Z) = H(Z) − H(Z|X); at most ln N.
    pub mi: f64,
    /// ln N, the largest MI a set of N prompts can show.
    pub upper_bound: f64,
    /// Share of traces whose own prompt scores them highest (ties share the credit).
    pub retrieval_accuracy: f64,
    /// 1/N, the retrieval accuracy of reasoning that ignores the prompt.
    pub chance: f64,
}

impl MutualInfo {
    /// The `echo/` keys for the step's metrics line (what the monitor and the viewer read).
    pub fn to_metrics(&self) -> Map<String, Value> {
        let mut m = Map::new();
        Key::MiEstimate.put(&mut m, self.mi);
        Key::MiUpperBound.put(&mut m, self.upper_bound);
        Key::ConditionalEntropy.put(&mut m, self.conditional_entropy);
        Key::MarginalEntropy.put(&mut m, self.marginal_entropy);
        Key::RetrievalAccuracy.put(&mut m, self.retrieval_accuracy);
        Key::RetrievalChance.put(&mut m, self.chance);
        Key::MiSamples.put(&mut m, self.n as f64);
        m
    }
}

/// Log-prob differences at or below this (nats) count as ties in retrieval accuracy.
pub const TIE_NATS: f64 = 1e-4;

/// Mutual information between prompts X and reasoning traces Z (RAGEN-2 `collapse_metrics.py`).
///
/// `logp[i][j]` = log p(z_i | x_j): the summed log-prob of trace i's reasoning tokens (tags
/// excluded) teacher-forced after prompt j (up to and including `<think>`). `truth[i]` is the
/// prompt trace i was sampled from; for the square N×N case pass `0..N`. Rows may outnumber
/// columns (K traces per prompt).
///
/// H(Z|X) = −(1/M) Σ_i logp[i][t_i];  H(Z) = −(1/M) Σ_i log((1/N) Σ_j exp logp[i][j]);
/// I = H(Z) − H(Z|X) ≤ ln N. Retrieval: argmax_j logp[i][j] == t_i, chance 1/N.
pub fn mutual_information(logp: &[Vec<f64>], truth: &[usize]) -> anyhow::Result<MutualInfo> {
    let n = logp.first().map_or(0, Vec::len);
    anyhow::ensure!(n >= 2, "mutual information needs at least 2 prompts (columns), got {n}");
    anyhow::ensure!(
        truth.len() == logp.len(),
        "mutual information: {} traces (rows) but {} true-prompt indices",
        logp.len(),
        truth.len()
    );
    let (mut h_cond, mut h_marg, mut hits) = (0.0, 0.0, 0.0);
    for (i, (row, &t)) in logp.iter().zip(truth).enumerate() {
        anyhow::ensure!(row.len() == n, "mutual information: row {i} has {} columns, not {n}", row.len());
        anyhow::ensure!(t < n, "mutual information: trace {i} names prompt {t}, but there are {n}");
        anyhow::ensure!(row.iter().all(|x| x.is_finite()), "mutual information: row {i} has a non-finite log-prob");
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        // log-mean-exp, shifted by the max for stability.
        let log_mix = max + (row.iter().map(|x| (x - max).exp()).sum::<f64>() / n as f64).ln();
        h_cond -= row[t];
        h_marg -= log_mix;
        // Scores within TIE_NATS of the best are ties: f32 log-probs of one sequence in
        // different batch rows can differ in the last bits, which is no evidence either way.
        let ties = row.iter().filter(|&&x| max - x <= TIE_NATS).count();
        if max - row[t] <= TIE_NATS {
            hits += 1.0 / ties as f64;
        }
    }
    let m = logp.len() as f64;
    let (h_cond, h_marg) = (h_cond / m, h_marg / m);
    Ok(MutualInfo {
        n,
        conditional_entropy: h_cond,
        marginal_entropy: h_marg,
        mi: h_marg - h_cond,
        upper_bound: (n as f64).ln(),
        retrieval_accuracy: hits / m,
        chance: 1.0 / n as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// One recorded run: a metrics line per step from per-key generators.
    fn series(steps: u64, f: impl Fn(u64, &mut Rng) -> Vec<(Key, f64)>) -> Vec<Map<String, Value>> {
        let mut rng = Rng::new(7);
        (1..=steps)
            .map(|s| f(s, &mut rng).into_iter().map(|(k, v)| (k.name().to_string(), serde_json::json!(v))).collect())
            .collect()
    }

    fn jitter(rng: &mut Rng, scale: f64) -> f64 {
        (rng.next_f64() - 0.5) * 2.0 * scale
    }

    fn run(lines: &[Map<String, Value>]) -> Vec<Alarm> {
        replay(&EchoSettings::default(), lines.iter().enumerate().map(|(i, m)| (i as u64 + 1, m)))
    }

    /// A run that learns: mean reward climbs, in-group std stays, entropy decays gently, think
    /// length and grad norm wobble, responses mostly distinct, reasoning depends on the prompt.
    fn healthy(s: u64, r: &mut Rng) -> Vec<(Key, f64)> {
        let t = s as f64;
        let mut v = vec![
            (Key::RewardMean, 0.2 + 0.004 * t + jitter(r, 0.03)),
            (Key::InGroupStd, 0.30 + jitter(r, 0.05)),
            (Key::GradNorm, 1.0 + jitter(r, 0.4)),
            (Key::Entropy, 1.5 - 0.004 * t + jitter(r, 0.05)),
            (Key::ThinkLen, 40.0 - 0.05 * t + jitter(r, 6.0)),
            (Key::Repetition, 0.1 + jitter(r, 0.08)),
        ];
        if s.is_multiple_of(5) {
            v.extend([(Key::MiEstimate, 1.6 + jitter(r, 0.2)), (Key::RetrievalAccuracy, 0.7), (Key::MiSamples, 8.0)]);
        }
        v
    }

    #[test]
    fn healthy_run_raises_no_alarm() {
        let alarms = run(&series(150, healthy));
        assert!(alarms.is_empty(), "false alarms: {alarms:#?}");
    }

    /// RAGEN Fig. 6, FrozenLake-PPO shape: std falls off a cliff at step 40 while the mean holds
    /// until 90; the grad norm spikes at 90; entropy collapses from 100; thinking shrinks from 60.
    fn collapsing(s: u64, r: &mut Rng) -> Vec<(Key, f64)> {
        let mut v = healthy(s, r);
        let set = |v: &mut Vec<(Key, f64)>, k: Key, x: f64| v.iter_mut().find(|(n, _)| *n == k).unwrap().1 = x;
        if s >= 40 {
            set(&mut v, Key::InGroupStd, 0.04 + jitter(r, 0.01));
        }
        if s >= 90 {
            set(&mut v, Key::RewardMean, 0.1 + jitter(r, 0.02));
        }
        if s == 90 {
            set(&mut v, Key::GradNorm, 9.0);
        }
        if s >= 100 {
            set(&mut v, Key::Entropy, 0.05 + jitter(r, 0.01));
        }
        if s >= 60 {
            set(&mut v, Key::ThinkLen, 2.0 + jitter(r, 1.0));
        }
        v
    }

    #[test]
    fn collapse_fires_each_alarm_once_at_its_step() {
        let alarms = run(&series(150, collapsing));
        let got: Vec<(AlarmKind, u64, u64)> = alarms.iter().map(|a| (a.kind, a.since, a.step)).collect();
        // Slow signals need confirm_steps = 2 consecutive steps: announced one step after `since`.
        assert_eq!(
            got,
            vec![
                (AlarmKind::VarianceCliff, 40, 41),
                (AlarmKind::VanishingReasoning, 60, 61),
                (AlarmKind::GradNormSpike, 90, 90),
                (AlarmKind::EntropyCollapse, 100, 101),
            ],
            "{alarms:#?}"
        );
        let cliff = &alarms[0];
        assert!(cliff.message.contains("since step 40"), "{}", cliff.message);
        assert!(cliff.value < cliff.threshold);
    }

    #[test]
    fn variance_cliff_stays_quiet_once_the_mean_has_fallen_too() {
        // Both fall together (Sokoban-PPO in Fig. 6): that is collapse, not an early warning.
        let alarms = run(&series(60, |s, r| {
            let mut v = healthy(s, r);
            if s >= 30 {
                v[0].1 = -0.5;
                v[1].1 = 0.02;
            }
            v
        }));
        assert!(alarms.iter().all(|a| a.kind != AlarmKind::VarianceCliff), "{alarms:#?}");
    }

    #[test]
    fn a_solved_task_losing_its_variance_and_entropy_raises_no_alarm() {
        // The collapse's std and entropy shapes, but every episode succeeds from step 35 on.
        let solved = |s: u64, r: &mut Rng| {
            let mut v = collapsing(s, r);
            v.retain(|(k, _)| *k != Key::RewardMean);
            v.extend([(Key::RewardMean, 1.0), (Key::Success, if s >= 35 { 1.0 } else { 0.5 })]);
            v
        };
        let alarms = run(&series(150, solved));
        let quiet = [AlarmKind::VarianceCliff, AlarmKind::EntropyCollapse];
        assert!(alarms.iter().all(|a| !quiet.contains(&a.kind)), "{alarms:#?}");
        // The same run failing at 0.5 success is the Echo Trap's early warning.
        let stuck = |s: u64, r: &mut Rng| {
            let mut v = solved(s, r);
            v.last_mut().unwrap().1 = 0.5;
            v
        };
        let kinds: Vec<AlarmKind> = run(&series(150, stuck)).iter().map(|a| a.kind).collect();
        assert!(quiet.iter().all(|k| kinds.contains(k)), "{kinds:?}");
    }

    #[test]
    fn a_second_spike_after_recovery_is_announced_again() {
        let alarms = run(&series(60, |s, r| {
            let mut v = healthy(s, r);
            if s == 20 || s == 21 || s == 45 {
                v[2].1 = 12.0;
            }
            v
        }));
        let spikes: Vec<(u64, u64)> =
            alarms.iter().filter(|a| a.kind == AlarmKind::GradNormSpike).map(|a| (a.since, a.step)).collect();
        assert_eq!(spikes, vec![(20, 20), (45, 45)]);
    }

    #[test]
    fn erratic_entropy_rise_and_repetition_fire() {
        let alarms = run(&series(40, |s, r| {
            let mut v = healthy(s, r);
            if s == 25 {
                v[3].1 = 4.0;
            }
            if s >= 30 {
                v[5].1 = 0.9;
            }
            v
        }));
        let got: Vec<(AlarmKind, u64)> = alarms.iter().map(|a| (a.kind, a.since)).collect();
        assert_eq!(got, vec![(AlarmKind::EntropyRise, 25), (AlarmKind::Repetition, 30)]);
    }

    #[test]
    fn one_answer_whatever_the_observation_fires_and_a_varied_one_does_not() {
        let pairs = |answers: &[&str]| -> Vec<(String, String)> {
            answers.iter().enumerate().map(|(i, a)| (format!("light {i}"), a.to_string())).collect()
        };
        assert_eq!(answer_top_share(&pairs(&["Go", "Stop", "Go", "Go"])), Some(0.75));
        assert_eq!(answer_top_share(&pairs(&["Go", "Go", "Go"])), None, "3 observations say nothing");
        let same = [("a", "Go"), ("a", "Go"), ("a", "Go"), ("a", "Go"), ("a", "Go")];
        assert_eq!(answer_top_share(&same), None, "one observation, one answer: no collapse");
        // A healthy run answering by the observation, then one answer from step 20.
        let alarms = run(&series(30, |s, _| vec![(Key::AnswerTopShare, if s >= 20 { 1.0 } else { 0.55 })]));
        let got: Vec<(AlarmKind, u64, u64)> = alarms.iter().map(|a| (a.kind, a.since, a.step)).collect();
        assert_eq!(got, vec![(AlarmKind::OneAnswer, 20, 21)], "confirmed over confirm_steps = 2");
        assert!(alarms[0].message.contains("whatever the observation"), "{}", alarms[0].message);
    }

    #[test]
    fn nothing_fires_during_warmup() {
        // warmup_steps = 5: the 5th observation may not fire, the 6th may.
        let spike_at = |k: u64| series(6, move |s, _| vec![(Key::GradNorm, if s == k { 50.0 } else { 1.0 })]);
        assert!(run(&spike_at(5)).is_empty());
        assert_eq!(run(&spike_at(6)).len(), 1);
    }

    #[test]
    fn template_collapse_from_the_cross_logprob_matrix() {
        // Diverse reasoning: each trace is far likelier under its own prompt.
        let n = 8;
        let diverse: Vec<Vec<f64>> =
            (0..n).map(|i| (0..n).map(|j| if i == j { -10.0 } else { -30.0 }).collect()).collect();
        let truth: Vec<usize> = (0..n).collect();
        let d = mutual_information(&diverse, &truth).unwrap();
        assert_eq!(d.retrieval_accuracy, 1.0);
        assert!((d.mi - (n as f64).ln()).abs() < 1e-6, "near the ln N bound: {d:?}");
        // A template: every prompt gives every trace the same score.
        let flat = vec![vec![-12.0; n]; n];
        let t = mutual_information(&flat, &truth).unwrap();
        assert!(t.mi.abs() < 1e-12);
        assert!((t.retrieval_accuracy - 1.0 / n as f64).abs() < 1e-12, "ties give chance: {t:?}");
        assert!((t.conditional_entropy - 12.0).abs() < 1e-12 && (t.marginal_entropy - 12.0).abs() < 1e-12);

        let mut mon = EchoTrapMonitor::new(EchoSettings::default());
        assert!(mon.observe(5, &d.to_metrics()).is_empty());
        let a = mon.observe(10, &t.to_metrics());
        assert_eq!(a.len(), 1);
        assert_eq!((a[0].kind, a[0].since), (AlarmKind::TemplateCollapse, 10));
        assert!(a[0].message.contains("retrieval accuracy 0.125 vs chance 0.125"), "{}", a[0].message);
        assert!(mon.observe(15, &t.to_metrics()).is_empty(), "announced once, not every time");
    }

    #[test]
    fn mutual_information_matches_a_hand_computed_two_by_two() {
        // p(z0|x0)=0.5 p(z0|x1)=0.25; p(z1|x0)=0.125 p(z1|x1)=0.5
        let l = |p: f64| p.ln();
        let m = vec![vec![l(0.5), l(0.25)], vec![l(0.125), l(0.5)]];
        let r = mutual_information(&m, &[0, 1]).unwrap();
        let h_cond = -(l(0.5) + l(0.5)) / 2.0;
        let h_marg = -(l(0.375) + l(0.3125)) / 2.0;
        assert!((r.conditional_entropy - h_cond).abs() < 1e-12);
        assert!((r.marginal_entropy - h_marg).abs() < 1e-12);
        assert!((r.mi - (h_marg - h_cond)).abs() < 1e-12);
        assert_eq!(r.retrieval_accuracy, 1.0);
        let err = mutual_information(&m, &[0]).unwrap_err().to_string();
        assert!(err.contains("2 traces (rows) but 1"), "{err}");
    }

    #[test]
    fn repetition_counts_every_member_of_a_duplicate_set() {
        assert_eq!(repetition(&["a", "b", "c", "d"]), 0.0);
        assert_eq!(repetition(&["pick  Dragon", "pick Dragon ", "b", "c"]), 0.5);
        assert_eq!(repetition(&["x", "x", "x"]), 1.0);
        assert_eq!(repetition::<&str>(&[]), 0.0);
    }

    #[test]
    fn docs_cover_every_setting() {
        let json = serde_json::to_value(EchoSettings::default()).unwrap();
        let mut keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        keys.sort();
        let mut documented: Vec<&str> = EchoSettings::DOCS.iter().map(|d| d.0).collect();
        documented.sort();
        assert_eq!(keys, documented);
        assert!(EchoSettings::DOCS.iter().all(|d| d.1.len() > 20));
    }

    #[test]
    fn alarms_go_into_the_metrics_line_and_events() {
        let a =
            Alarm { kind: AlarmKind::Repetition, step: 9, since: 8, value: 0.9, threshold: 0.5, message: "m".into() };
        let mut line = Map::new();
        record(&[], &mut line);
        assert!(line.is_empty());
        record(std::slice::from_ref(&a), &mut line);
        assert_eq!(line["alarms"], serde_json::json!([{"kind": "repetition", "since": 8, "message": "m"}]));
        let ev = a.event(1.5);
        assert_eq!(
            (ev["kind"].as_str(), ev["alarm"].as_str(), ev["since"].as_u64()),
            (Some("alarm"), Some("repetition"), Some(8))
        );
        assert_eq!(a.to_string(), "alarm at step 9: m");
    }

    #[test]
    fn settings_parse_partially_and_reject_unknown_keys() {
        let s: EchoSettings = serde_json::from_str(r#"{"spike_factor": 3.0}"#).unwrap();
        assert_eq!(s.spike_factor, 3.0);
        assert_eq!(s.cliff_fraction, EchoSettings::default().cliff_fraction);
        let err = serde_json::from_str::<EchoSettings>(r#"{"spike_factr": 3.0}"#).unwrap_err();
        assert!(err.to_string().contains("spike_factr"));
    }
}
