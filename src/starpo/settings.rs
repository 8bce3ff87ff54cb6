//! Every training setting, declared once: a `Settings` tree of six sections, each declared by
//! the module that uses it (`rollout` in `agent::rollout`, `echo` (the Echo-Trap thresholds) in
//! `metrics::echo_trap`; `starpo`, `optim`, `train` and `lora` here), each field with its `///`
//! doc, its default (in `Default`, nowhere else) and its serde name. The dotted key of a field is
//! `section.field` (`starpo.clip_high`).
//!
//! Resolution order ([`crate::starpo::resume::resolve_settings`]): preset (`starpo` or
//! `starpo-s`, diffs from the defaults) → the experiment script's `settings` map → `--algo` →
//! `--set key=value` flags → [`Settings::validate`]: the command line beats the script. Errors
//! name their source and the nearest known key. `ragen-lab settings` prints
//! [`Settings::describe`], read from the same declarations. A resumed run starts from its saved
//! settings; only `--set` applies on top.
//!
//! The defaults are RAGEN's algorithm (notes/ragen.md §3–4) with a rollout sized for a 2-core CPU;
//! the GPU sizes (8 × 16 rollouts, 200 steps) are one `--set` line (docs/training.md).
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::early_stop::Stop;
pub use crate::agent::settings::{Backend, Rollout};
use crate::metrics::echo_trap::EchoSettings;

/// How trajectory scores are normalised within their group before advantages (RAGEN
/// `agent_proxy.reward_normalization.method`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RewardNorm {
    /// Scores as they are (RAGEN's default with PPO).
    Identity,
    /// (x − μ) / (σ + 1e-6), or 0 when σ < 1e-6 (GRPO).
    MeanStd,
    /// x − μ.
    Mean,
    /// mean_std clamped to [−1, 3].
    AsymClip,
}

/// Which groups the StarPO-S filter keeps (RAGEN-2 `rollout_filter_strategy`, plus v1's `std`).
/// Every strategy ranks the groups by `starpo.filter_metric` (`filter::select`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterKind {
    /// Keep every group (vanilla StarPO).
    None,
    /// RAGEN v1: the top `filter_ratio` fraction of groups by reward std, whatever the
    /// metric and type settings say (= `top_k` on `reward_variance`, `largest`).
    Std,
    /// Nucleus over groups: keep the best groups until they hold `filter_top_p` of the metric's
    /// total (`filter_top_p_mode` linear) or of its softmax (softmax).
    TopP,
    /// The best `int(filter_ratio × groups)` groups (at least one).
    TopK,
    /// The best `filter_k` groups.
    TopKAbs,
    /// Groups whose metric is within `filter_min_p` of the best (≥ p·max for largest,
    /// ≤ min/p for smallest).
    MinP,
}

/// What the filter ranks groups by (RAGEN-2 `rollout_filter_metric`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterMetric {
    /// In-group std of the trajectory scores (RAGEN-2's name; it is the std, not σ²).
    RewardVariance,
    /// In-group mean score.
    Reward,
    /// In-group sum of scores.
    RewardSum,
    /// In-group mean of the trajectories' mean token entropy (one no-grad pass over the batch).
    Entropy,
    /// In-group std of that entropy.
    EntropyVariance,
    /// In-group mean of the trajectories' trained (assistant) tokens.
    Length,
}

/// Whether the filter keeps the groups with the largest or the smallest metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterType {
    Largest,
    Smallest,
}

/// How `top_p` turns metrics into shares (RAGEN-2 `rollout_filter_top_p_prob_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopPMode {
    /// Shares proportional to the metric; positive metrics only; empty when p is out of reach.
    Linear,
    /// Shares = softmax of the metric (of its negative for `smallest`).
    Softmax,
}

/// Scale the advantages by the share of groups the filter kept (RAGEN-2 `filter_loss_scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterLossScaling {
    None,
    /// × kept share.
    Linear,
    /// × √(kept share).
    Sqrt,
}

/// Which trajectories share the statistics of score normalisation (RAGEN
/// `reward_normalization.grouping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormGrouping {
    /// The trajectories of one start state (one env group).
    State,
    /// The whole batch.
    Batch,
    /// The trajectories of one env (RAGEN's env tag); an experiment trains on one env, so
    /// this is the whole batch here.
    Inductive,
}

/// How the token losses of a mini-batch become one number (veRL `loss_agg_mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// Mean over every assistant token of the mini-batch: long sequences weigh more.
    TokenMean,
    /// Mean within each sequence, then over sequences (RAGEN v1's effective aggregation).
    SeqMeanTokenMean,
    /// Sum within each sequence, mean over sequences (Dr. GRPO: no length normalisation).
    SeqMeanTokenSum,
}

/// The advantage estimator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageKind {
    /// GAE with a learned critic over the packed sequence (PPO).
    Gae,
    /// The group-relative score (R − μ)/(σ + ε) on every assistant token (no critic).
    Grpo,
    /// Turn-level GAE between turn ends, then token-level GAE inside each turn (needs a critic).
    BiLevelGae,
    /// Turn-level GRPO (no critic): each turn's tokens get its return-to-go (its reward and the
    /// later turns') less the mean of its group's episodes at the same turn, over their std with
    /// `norm_adv_by_std_in_grpo`. With the reward only at the end it is GRPO.
    TurnGrpo,
    /// REINFORCE++: the score's discounted return on each assistant token, whitened over the batch.
    ReinforcePlusPlus,
    /// REINFORCE++ with the group mean as baseline: R − μ, whitened over the batch.
    ReinforcePlusPlusBaseline,
    /// RLOO: R minus the mean of the other episodes of its group.
    Rloo,
    /// ReMax: R minus the score of one greedy episode from the same start state (played per group).
    Remax,
}

/// The KL estimator for the loss against the frozen reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlKind {
    /// k1: log π − log π_ref.
    K1,
    /// |k1| (veRL `abs`).
    Abs,
    /// ½·k1² (veRL `mse`, k2).
    Mse,
    /// k3 "low-var-kl": r − log r − 1 with r = π_ref / π, clamped to [−10, 10].
    K3,
}

settings_section! {
    /// StarPO / StarPO-S: normalisation, filtering, advantages and losses.
    Starpo {
        /// Advantage estimator: gae (PPO), grpo, bi_level_gae, reinforce_plus_plus,
        /// reinforce_plus_plus_baseline, rloo, remax.
        advantage: AdvantageKind = AdvantageKind::Gae,
        /// Per-group score normalisation: identity, mean_std, mean, asym_clip.
        reward_norm: RewardNorm = RewardNorm::Identity,
        /// Who shares normalisation statistics: state (a group), batch, inductive (an env).
        reward_norm_grouping: NormGrouping = NormGrouping::State,
        /// StarPO-S rollout filter: none, std (RAGEN v1), top_p, top_k, top_k_abs, min_p (RAGEN-2).
        filter: FilterKind = FilterKind::Std,
        /// Fraction of groups kept by the `std` and `top_k` filters (RAGEN rollout_filter_ratio).
        filter_ratio: f64 = 0.25,
        /// Share kept by the `top_p` filter (RAGEN-2 rollout_filter_value).
        filter_top_p: f64 = 0.9,
        /// top_p shares: linear (proportional to the metric) or softmax.
        filter_top_p_mode: TopPMode = TopPMode::Linear,
        /// Groups kept by the `top_k_abs` filter.
        filter_k: usize = 2,
        /// Ratio to the best group's metric for the `min_p` filter.
        filter_min_p: f64 = 0.5,
        /// What groups are ranked by: reward_variance (the std), reward, reward_sum, entropy,
        /// entropy_variance, length.
        filter_metric: FilterMetric = FilterMetric::RewardVariance,
        /// Keep the largest or the smallest metrics.
        filter_type: FilterType = FilterType::Largest,
        /// Whether groups whose metric is 0 may be kept (RAGEN-2 rollout_filter_include_zero).
        filter_include_zero: bool = true,
        /// Scale advantages by the kept share of groups: none, linear, sqrt.
        filter_loss_scaling: FilterLossScaling = FilterLossScaling::None,
        /// Token-level discount γ for GAE.
        gamma: f64 = 1.0,
        /// GAE λ.
        lam: f64 = 1.0,
        /// Turn-level discount: of bi-level GAE, and of turn-level GRPO's return-to-go (0: each
        /// turn judged by its own reward).
        high_level_gamma: f64 = 0.95,
        /// Lower PPO clip ε_low: the ratio is clipped at 1 − ε_low.
        clip_low: f64 = 0.2,
        /// Upper PPO clip ε_high: the ratio is clipped at 1 + ε_high (clip-higher; 0.28 in StarPO-S).
        clip_high: f64 = 0.28,
        /// Dual-clip constant c for negative advantages (0 = off).
        dual_clip: f64 = 3.0,
        /// Entropy bonus coefficient.
        entropy_coef: f64 = 0.001,
        /// An entropy bonus on constrained answers' choices only (rollout.constrain_actions), of
        /// the distribution over the answers the grammar allowed: it keeps a rarely picked answer
        /// sampled, so an answer that becomes better (a reward edit) is found again. Per token it
        /// weighs against the advantage: at β the policy settles where p(a) ∝ exp(A(a)/β).
        answer_entropy_coef: f64 = 0.0,
        /// KL-loss coefficient against the frozen reference (0 = no reference model).
        kl_coef: f64 = 0.0,
        /// KL estimator: k1, abs, mse or k3 (low-var-kl).
        kl_type: KlKind = KlKind::K1,
        /// Value-loss clip range around the rollout-time values.
        value_clip: f64 = 0.5,
        /// Whiten GAE and bi-level GAE advantages over the assistant tokens of the batch
        /// (REINFORCE++ always whitens; GRPO, RLOO and ReMax never do).
        whiten: bool = true,
        /// GRPO divides by the in-group std (false: R − μ only, Dr. GRPO; pair it with
        /// reward_norm identity or mean, since mean_std has already divided the scores).
        norm_adv_by_std_in_grpo: bool = true,
        /// GRPO: weight each group's advantages by its std over the largest kept group's
        /// (RAGEN-2 soft_advantage_reweight), so low-variance groups count less.
        soft_advantage_reweight: bool = false,
        /// GRPO: divide each trajectory's advantage by its trained-token count relative to the
        /// batch mean (RAGEN grpo_advantage_length_weight).
        grpo_length_weight: bool = false,
        /// Token losses to one number: token-mean, seq-mean-token-mean, seq-mean-token-sum.
        loss_agg_mode: LossAgg = LossAgg::SeqMeanTokenMean,
    }
}

settings_section! {
    /// Optimisation: AdamW for the actor and the critic, batching.
    Optim {
        /// Actor learning rate (RAGEN: 1e-6 for 0.5B models; tiny models want far more).
        lr: f64 = 1e-6,
        /// Critic learning rate.
        critic_lr: f64 = 1e-5,
        /// AdamW β1.
        beta1: f64 = 0.9,
        /// AdamW β2.
        beta2: f64 = 0.999,
        /// AdamW ε.
        eps: f64 = 1e-8,
        /// AdamW decoupled weight decay.
        weight_decay: f64 = 0.01,
        /// Optimiser steps over which the learning rate rises linearly from lr/n to lr (0 = off).
        /// Adam's first steps are full-size whatever the gradient's noise: on a policy whose
        /// choice does not yet depend on the state, one such step can tip every answer to one
        /// side (docs/training.md).
        warmup_steps: usize = 0,
        /// Clip the global gradient norm to this (0 = off).
        grad_clip: f64 = 1.0,
        /// Trajectories per optimiser step (RAGEN ppo_mini_batch_size); a smaller kept batch is
        /// one mini-batch.
        mini_batch_size: usize = 32,
        /// Memory of a forward/backward pass, in sequences of the longest trajectory
        /// (gradients accumulate over a mini-batch); rows sharing a prompt compute it once, so
        /// a pass holds as many of them as fit.
        micro_batch_size: usize = 4,
        /// Activation checkpointing per layer: training passes keep only each layer's input
        /// and recompute the layer during backward (8 × 256 tokens of the 135M model: 1.25×
        /// the time, half the memory; RAGEN's default, veRL enable_gradient_checkpointing).
        checkpoint_layers: bool = true,
        /// With `checkpoint_layers`, a training pass whose graph is estimated under this many
        /// MB keeps it instead (no recomputation: a 3-turn lights step 0.8× the time, 2.7 GB
        /// more at its peak). 0 = checkpoint every pass.
        graph_budget_mb: usize = 4096,
        /// Passes over the kept rollout per update (RAGEN ppo_epochs).
        epochs: usize = 1,
        /// Rollout freshness (RAGEN "Online-k"): each rollout gathers k × env_groups groups and
        /// the kept batch is split into k optimiser steps. 1 = fully on-policy.
        rollout_reuse: usize = 1,
    }
}

settings_section! {
    /// The loop around the algorithm: length, validation, checkpoints, seeds.
    Train {
        /// Training steps (each: one rollout, one update).
        steps: usize = 40,
        /// Seed for sampling, shuffles and episode randomness.
        seed: u64 = 42,
        /// Validate every n steps (and before the first); 0 = never.
        val_every: usize = 10,
        /// Validation seeds (RAGEN: 256 fixed prompts).
        val_groups: usize = 32,
        /// Episodes per validation seed; pass@k uses k = this.
        val_samples: usize = 1,
        /// Validation sampling temperature.
        val_temperature: f64 = 0.5,
        /// First validation seed (RAGEN seed.val = 123).
        val_seed: u64 = 123,
        /// Save a checkpoint every n steps (and at the end); 0 = only at the end.
        save_every: usize = 10,
        /// Checkpoints kept on disk (older ones are deleted).
        keep_checkpoints: usize = 2,
    }
}

settings_section! {
    /// LoRA: train low-rank adapters on a frozen model instead of every weight.
    Lora {
        /// Adapter rank r; 0 = full fine-tuning (no adapters).
        rank: usize = 0,
        /// Scale numerator: adapters add (alpha / r) · B A.
        alpha: f64 = 32.0,
        /// Projections that get adapters: `all-linear` or a comma-separated list of q_proj,
        /// k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj.
        targets: String = "all-linear".to_string(),
        /// Dropout on the adapters' inputs while training.
        dropout: f64 = 0.0,
    }
}

/// All training settings. Dotted keys: `rollout.*`, `starpo.*`, `optim.*`, `train.*`, `lora.*`,
/// `echo.*`, `stop.*`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(default, deny_unknown_fields)]
pub struct Settings {
    pub rollout: Rollout,
    pub starpo: Starpo,
    pub optim: Optim,
    pub train: Train,
    pub lora: Lora,
    /// Echo-Trap alarm thresholds (declared by the metrics module).
    pub echo: EchoSettings,
    /// RAGEN-2's early stops (declared by `starpo::early_stop`; off by default).
    pub stop: Stop,
}

/// The named starting points.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    /// Vanilla StarPO: PPO, KL loss 0.001 (k1), symmetric clip 0.2, no filter.
    Starpo,
    /// StarPO-S (default): top 25% of groups by reward std, clip-higher 0.28, no KL.
    StarpoS,
    /// StarPO-S with RAGEN-2's recommended filter: top-p 0.9 (linear) of the in-group reward
    /// std, zero-std groups dropped; a step with nothing kept is skipped.
    #[value(name = "starpo-s2")]
    #[serde(rename = "starpo-s2")]
    StarpoS2,
}

/// `--algo`: the advantage estimator family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algo {
    /// GAE with a critic, identity score normalisation.
    Ppo,
    /// Group-normalised scores (mean_std) on every assistant token, no critic; adds a k1 KL loss
    /// 0.001 as RAGEN's GRPO baseline does.
    Grpo,
}

impl Optim {
    /// How `model`'s training passes spend memory: layer checkpoints above the graph budget.
    pub fn plan_memory(&self, model: &mut crate::policy::model::Decoder) {
        model.checkpoint_layers = self.checkpoint_layers;
        model.graph_budget = self.graph_budget_mb << 20;
    }
}

impl Settings {
    /// StarPO-S: the defaults (RAGEN v1 `base.yaml`).
    pub fn starpo_s() -> Self {
        Self::default()
    }

    /// Vanilla StarPO (RAGEN's `USE_BASE`): a diff from the defaults.
    pub fn starpo() -> Self {
        let mut s = Self::default();
        s.starpo.filter = FilterKind::None;
        s.starpo.clip_high = 0.2;
        s.starpo.kl_coef = 0.001;
        s.starpo.kl_type = KlKind::K1;
        s
    }

    /// StarPO-S with RAGEN-2's recommended filter (`scripts/runs` of the v2 repo and its docs:
    /// top_p 0.9, linear, reward_variance, largest, include_zero false): a diff from the defaults.
    pub fn starpo_s2() -> Self {
        let mut s = Self::default();
        let f = &mut s.starpo;
        (f.filter, f.filter_top_p, f.filter_top_p_mode) = (FilterKind::TopP, 0.9, TopPMode::Linear);
        (f.filter_metric, f.filter_type, f.filter_include_zero) =
            (FilterMetric::RewardVariance, FilterType::Largest, false);
        s
    }

    pub fn preset(p: Preset) -> Self {
        match p {
            Preset::Starpo => Self::starpo(),
            Preset::StarpoS => Self::starpo_s(),
            Preset::StarpoS2 => Self::starpo_s2(),
        }
    }

    /// Switch the estimator family (RAGEN's GRPO baseline: mean_std scores, k1 KL 0.001).
    pub fn apply_algo(&mut self, algo: Algo) {
        match algo {
            Algo::Ppo => {
                self.starpo.advantage = AdvantageKind::Gae;
                self.starpo.reward_norm = RewardNorm::Identity;
            }
            Algo::Grpo => {
                self.starpo.advantage = AdvantageKind::Grpo;
                self.starpo.reward_norm = RewardNorm::MeanStd;
                self.starpo.kl_coef = 0.001;
                self.starpo.kl_type = KlKind::K1;
            }
        }
    }

    /// The adapters to train, or `None` for full fine-tuning (`lora.rank` 0).
    pub fn lora_config(&self) -> Result<Option<crate::policy::lora::LoraConfig>> {
        let l = &self.lora;
        if l.rank == 0 {
            return Ok(None);
        }
        crate::policy::lora::LoraConfig::new(l.rank, l.alpha, &l.targets, l.dropout).map(Some)
    }

    /// Whether a critic is trained (GAE and bi-level GAE need one).
    pub fn needs_critic(&self) -> bool {
        matches!(self.starpo.advantage, AdvantageKind::Gae | AdvantageKind::BiLevelGae)
    }

    /// Every dotted key with its default (as JSON text) and doc, in declaration order.
    pub fn describe() -> Vec<(String, String, String)> {
        let defaults = serde_json::to_value(Settings::default()).expect("settings serialise");
        let sections: [(&str, &[(&str, &str)]); 7] = [
            ("rollout", Rollout::DOCS),
            ("starpo", Starpo::DOCS),
            ("optim", Optim::DOCS),
            ("train", Train::DOCS),
            ("lora", Lora::DOCS),
            ("echo", EchoSettings::DOCS),
            ("stop", Stop::DOCS),
        ];
        let mut out = Vec::new();
        for (section, docs) in sections {
            for (field, doc) in docs {
                let default = defaults[section][field].to_string();
                let doc = doc.lines().map(str::trim).collect::<Vec<_>>().join(" ");
                out.push((format!("{section}.{field}"), default, doc));
            }
        }
        out
    }

    /// All dotted keys.
    pub fn keys() -> Vec<String> {
        Self::describe().into_iter().map(|(k, _, _)| k).collect()
    }

    /// Apply a map of settings (nested `{starpo: {clip_high: 0.3}}` or dotted
    /// `{"starpo.clip_high": 0.3}` keys) from `source` (named in errors).
    pub fn apply_map(&mut self, map: &Map<String, Value>, source: &str) -> Result<()> {
        let mut flat = Vec::new();
        flatten("", map, &mut flat);
        for (key, value) in flat {
            self.set(&key, value, source)?;
        }
        Ok(())
    }

    /// Apply one `key=value` flag; the value is read as JSON where it parses (numbers, booleans),
    /// else as a string (`starpo.advantage=grpo`).
    pub fn apply_flag(&mut self, flag: &str) -> Result<()> {
        let (key, raw) = flag
            .split_once('=')
            .ok_or_else(|| anyhow!("--set {flag}: expected key=value, e.g. --set optim.lr=1e-5"))?;
        let value = serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.trim().to_string()));
        self.set(key.trim(), value, &format!("--set {flag}"))
    }

    /// Set one dotted key, checked against the declaration.
    pub fn set(&mut self, key: &str, value: Value, source: &str) -> Result<()> {
        let known = Self::keys();
        if !known.iter().any(|k| k == key) {
            let hint = nearest(key, &known).map(|k| format!(" (did you mean {k}?)")).unwrap_or_default();
            bail!("{source}: unknown setting {key}{hint}; `ragen-lab settings` lists them all");
        }
        let (section, field) = key.split_once('.').expect("known keys are dotted");
        let mut tree = serde_json::to_value(&*self).expect("settings serialise");
        tree[section][field] = value.clone();
        *self = serde_json::from_value(tree).with_context(|| {
            let default = Self::describe().into_iter().find(|(k, _, _)| k == key).map(|d| d.1).unwrap_or_default();
            format!("{source}: bad value {value} for {key} (the default is {default})")
        })?;
        Ok(())
    }

    /// Check ranges and combinations; errors name the setting.
    pub fn validate(&self) -> Result<()> {
        let (r, s, o, t) = (&self.rollout, &self.starpo, &self.optim, &self.train);
        let st = &self.stop;
        let checks: [(bool, &str); 23] = [
            (
                r.backend == Backend::Local || r.think_budget == 0,
                "rollout.think_budget acts inside the local sampler: set it to 0 with rollout.backend = \"http\"",
            ),
            (
                r.max_policy_lag == 0 || r.backend == Backend::Http,
                "rollout.max_policy_lag > 0 overlaps the rollout with the update, which needs rollout.backend = \"http\" (the local sampler shares the trainer's weights and cores)",
            ),
            (
                r.max_policy_lag <= 1,
                "rollout.max_policy_lag: one rollout runs ahead of the update, so the lag is 0 or 1",
            ),
            (r.env_groups >= 1, "rollout.env_groups must be at least 1"),
            (r.group_size >= 1, "rollout.group_size must be at least 1"),
            (r.response_length >= 1, "rollout.response_length must be at least 1"),
            (r.temperature > 0.0, "rollout.temperature must be > 0"),
            (
                r.answer_temperature >= 0.0 && (r.answer_temperature == 0.0 || r.backend == Backend::Local),
                "rollout.answer_temperature must be ≥ 0, and 0 with rollout.backend = \"http\" (engines sample at one temperature)",
            ),
            (r.top_p > 0.0 && r.top_p <= 1.0, "rollout.top_p must be in (0, 1]"),
            (s.filter_ratio > 0.0 && s.filter_ratio <= 1.0, "starpo.filter_ratio must be in (0, 1]"),
            (s.filter_top_p > 0.0 && s.filter_top_p <= 1.0, "starpo.filter_top_p must be in (0, 1]"),
            (s.filter_k >= 1, "starpo.filter_k must be at least 1"),
            (s.filter_min_p > 0.0 && s.filter_min_p <= 1.0, "starpo.filter_min_p must be in (0, 1]"),
            (
                st.std_fraction > 0.0 && st.std_fraction < 1.0,
                "stop.std_fraction must be in (0, 1): the share of the early in-group std that counts as collapsed",
            ),
            (
                (0.0..=1.0).contains(&s.gamma) && (0.0..=1.0).contains(&s.lam),
                "starpo.gamma and starpo.lam must be in [0, 1]",
            ),
            (
                s.clip_low >= 0.0 && s.clip_low < 1.0 && s.clip_high >= 0.0,
                "starpo.clip_low must be in [0, 1) and starpo.clip_high ≥ 0",
            ),
            (s.dual_clip == 0.0 || s.dual_clip > 1.0, "starpo.dual_clip must be 0 (off) or > 1"),
            (
                s.kl_coef >= 0.0 && s.entropy_coef >= 0.0 && s.answer_entropy_coef >= 0.0,
                "starpo.kl_coef, starpo.entropy_coef and starpo.answer_entropy_coef must be ≥ 0",
            ),
            (o.lr > 0.0 && o.critic_lr > 0.0, "optim.lr and optim.critic_lr must be > 0"),
            (
                o.mini_batch_size >= 1 && o.micro_batch_size >= 1,
                "optim.mini_batch_size and optim.micro_batch_size must be at least 1",
            ),
            (o.epochs >= 1 && o.rollout_reuse >= 1, "optim.epochs and optim.rollout_reuse must be at least 1"),
            (t.val_groups >= 1 && t.val_samples >= 1, "train.val_groups and train.val_samples must be at least 1"),
            (
                t.val_temperature > 0.0 && t.keep_checkpoints >= 1,
                "train.val_temperature must be > 0 and train.keep_checkpoints ≥ 1",
            ),
        ];
        for (ok, msg) in checks {
            if !ok {
                bail!("invalid settings: {msg}");
            }
        }
        self.lora_config().context("invalid settings")?;
        Ok(())
    }
}

/// Flatten nested maps into dotted keys; a key that already has a dot stays as it is.
fn flatten(prefix: &str, map: &Map<String, Value>, out: &mut Vec<(String, Value)>) {
    for (k, v) in map {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match v {
            Value::Object(inner) if !key.contains('.') => flatten(&key, inner, out),
            _ => out.push((key, v.clone())),
        }
    }
}

/// The known key closest to `key` by edit distance (also matching a bare field name), if close.
fn nearest<'a>(key: &str, known: &'a [String]) -> Option<&'a String> {
    known
        .iter()
        .map(|k| {
            let field = k.split_once('.').map(|p| p.1).unwrap_or(k);
            (levenshtein(key, k).min(levenshtein(key, field)), k)
        })
        .filter(|(d, _)| *d <= 3.max(key.len() / 3))
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn levenshtein(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn presets_differ_only_where_ragen_says() {
        let (s, v) = (Settings::starpo_s(), Settings::starpo());
        assert_eq!(s.starpo.filter, FilterKind::Std);
        assert_eq!((s.starpo.clip_low, s.starpo.clip_high, s.starpo.kl_coef), (0.2, 0.28, 0.0));
        assert_eq!(v.starpo.filter, FilterKind::None);
        assert_eq!((v.starpo.clip_high, v.starpo.kl_coef), (0.2, 0.001));
        assert_eq!((s.rollout, s.optim, s.train, s.echo), (v.rollout, v.optim, v.train, v.echo));
        let s2 = Settings::starpo_s2();
        assert_eq!(
            (s2.starpo.filter, s2.starpo.filter_top_p, s2.starpo.filter_include_zero),
            (FilterKind::TopP, 0.9, false)
        );
        assert_eq!((s2.starpo.clip_high, s2.starpo.kl_coef, s2.stop), (0.28, 0.0, s.stop));
    }

    #[test]
    fn script_map_then_flags_override_in_order() {
        let mut s = Settings::starpo_s();
        let map = json!({"starpo": {"clip_high": 0.3}, "optim.lr": 1e-4}).as_object().unwrap().clone();
        s.apply_map(&map, "scripts/x.rhai").unwrap();
        assert_eq!((s.starpo.clip_high, s.optim.lr), (0.3, 1e-4));
        s.apply_flag("starpo.clip_high=0.25").unwrap();
        s.apply_flag("starpo.advantage=grpo").unwrap();
        assert_eq!(s.starpo.clip_high, 0.25);
        assert_eq!(s.starpo.advantage, AdvantageKind::Grpo);
    }

    #[test]
    fn unknown_key_names_source_and_nearest_key() {
        let mut s = Settings::default();
        let err = s.apply_flag("starpo.clip_hgh=0.3").unwrap_err().to_string();
        assert!(err.contains("--set starpo.clip_hgh=0.3"), "{err}");
        assert!(err.contains("did you mean starpo.clip_high?"), "{err}");
        let map = json!({"lr": 0.1}).as_object().unwrap().clone();
        let err = s.apply_map(&map, "scripts/b.rhai").unwrap_err().to_string();
        assert!(err.contains("scripts/b.rhai") && err.contains("optim.lr"), "{err}");
    }

    #[test]
    fn bad_value_and_bad_range_are_named() {
        let mut s = Settings::default();
        let err = format!("{:#}", s.apply_flag("rollout.env_groups=many").unwrap_err());
        assert!(err.contains("rollout.env_groups") && err.contains("default is 4"), "{err}");
        s.apply_flag("starpo.filter_ratio=0").unwrap();
        assert!(s.validate().unwrap_err().to_string().contains("starpo.filter_ratio"));
    }

    #[test]
    fn lora_settings_are_checked() {
        let mut s = Settings::default();
        assert_eq!(s.lora_config().unwrap(), None, "rank 0: full fine-tuning");
        s.apply_flag("lora.rank=8").unwrap();
        assert_eq!(s.lora_config().unwrap().unwrap().targets.len(), 7);
        s.apply_flag("lora.targets=q_proj, v_proj").unwrap();
        assert_eq!(s.lora_config().unwrap().unwrap().targets, ["q_proj", "v_proj"]);
        s.apply_flag("lora.targets=qproj").unwrap();
        let e = format!("{:#}", s.validate().unwrap_err());
        assert!(e.contains("unknown module \"qproj\""), "{e}");
    }

    #[test]
    fn describe_lists_every_field_with_doc() {
        let d = Settings::describe();
        let n = Rollout::DOCS.len()
            + Starpo::DOCS.len()
            + Optim::DOCS.len()
            + Train::DOCS.len()
            + Lora::DOCS.len()
            + EchoSettings::DOCS.len()
            + Stop::DOCS.len();
        assert_eq!(d.len(), n);
        let clip = d.iter().find(|(k, _, _)| k == "starpo.clip_high").unwrap();
        assert_eq!(clip.1, "0.28");
        assert!(clip.2.contains("clip-higher"));
    }
}
