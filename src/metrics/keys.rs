//! Every numeric key of a step's line in `metrics.jsonl` (docs/contracts.md "Metric keys"),
//! declared once: the trainer writes them, the Echo-Trap monitor reads them, `plot` and the
//! viewer draw them, all through [`Key`]. A typo is a compile error instead of an alarm that
//! silently never fires. The names are a public contract: a variant may be added, never renamed.
use serde_json::{json, Map, Value};

use crate::phase::Phase;

/// Declares the keys: one variant per key, with its name and its meaning.
macro_rules! metric_keys {
    ($( $(#[doc = $doc:literal])+ $var:ident = $name:literal, )*) => {
        /// A metric key of `metrics.jsonl` (`namespace/name`).
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Key { $( $(#[doc = $doc])+ $var, )* }

        impl Key {
            /// Every key, in declaration order.
            pub const ALL: &'static [Key] = &[$(Key::$var),*];

            /// The key as written in `metrics.jsonl`, e.g. `rollout/reward_mean`.
            pub const fn name(self) -> &'static str {
                match self { $(Key::$var => $name,)* }
            }

            /// What the number means (the `///` text of the declaration).
            pub const fn doc(self) -> &'static str {
                match self { $(Key::$var => concat!($($doc),+),)* }
            }
        }
    };
}

metric_keys! {
    /// Mean trajectory score R(τ) over the step's rollouts.
    RewardMean = "rollout/reward_mean",
    /// Standard deviation of the trajectory scores.
    RewardStd = "rollout/reward_std",
    /// Lowest trajectory score.
    RewardMin = "rollout/reward_min",
    /// Highest trajectory score.
    RewardMax = "rollout/reward_max",
    /// Share of episodes the env called a success.
    Success = "rollout/success",
    /// Mean over groups of the score std within a group (RAGEN's reward-variance signal).
    InGroupStd = "rollout/in_group_std",
    /// The same over the groups the StarPO-S filter kept.
    InGroupStdKept = "rollout/in_group_std_kept",
    /// Share of groups the filter kept.
    KeptRatio = "rollout/kept_ratio",
    /// 1 when the filter kept no group (the step made no update), else 0.
    EmptyAfterFilter = "rollout/empty_after_filter",
    /// Mean generated tokens per turn.
    ResponseLen = "rollout/response_len",
    /// Mean think tokens per turn.
    ThinkLen = "rollout/think_len",
    /// Mean turns per episode.
    TurnsMean = "rollout/turns_mean",
    /// Share of parsed actions the env accepted.
    ValidActionRate = "rollout/valid_action_rate",
    /// Share of turns whose response missed the required tags.
    FormatErrorRate = "rollout/format_error_rate",
    /// Share of responses duplicating another in the batch, a response that is only a legal
    /// answer left out of the duplicates (a small action space repeats by design).
    Repetition = "rollout/repetition",
    /// Share of the turns with a legal answer that give the batch's most common one, where
    /// the batch shows at least 4 distinct observations (absent otherwise): 1 is one answer
    /// whatever the observation.
    AnswerTopShare = "rollout/answer_top_share",
    /// 1 when the step had no reward variance and made no update, else 0.
    Skipped = "update/skipped",
    /// Policy-gradient (clipped surrogate) loss, mean over minibatches.
    PgLoss = "update/pg_loss",
    /// Mean token entropy of the policy, nats.
    Entropy = "update/entropy",
    /// KL to the frozen reference (only with a KL loss).
    Kl = "update/kl",
    /// Share of tokens whose ratio was clipped.
    ClipFrac = "update/clip_frac",
    /// Global gradient norm before clipping.
    GradNorm = "update/grad_norm",
    /// Critic loss (only with a critic).
    ValueLoss = "update/value_loss",
    /// Learning rate of the step.
    Lr = "update/lr",
    /// k3 estimate of the KL to the old (rollout) policy.
    ApproxKl = "update/approx_kl",
    /// Optimiser steps taken in the update.
    OptimizerSteps = "update/optimizer_steps",
    /// Share of the trained trajectories whose old log-probs were the local sampler's, so no
    /// pass ran over them (0 on a single optimiser step, which needs none).
    SamplerLogprobs = "update/sampler_logprobs",
    /// Rollouts on engines: mean of the truncated importance weight min(π_old/π_engine, cap)
    /// over the tokens whose engine log-prob is known.
    TisWeightMean = "update/tis_weight_mean",
    /// Its largest untruncated ratio π_old/π_engine.
    TisRatioMax = "update/tis_ratio_max",
    /// k3 estimate of KL(π_engine ‖ π_old) over those tokens.
    KlRollout = "update/kl_rollout",
    /// Updates between the weights that played the batch and those the update starts from (0
    /// when synchronous; 1 under rollout.max_policy_lag = 1 after a step that updated).
    PolicyLag = "rollout/policy_lag",
    /// Share of the scored tokens whose engine log-prob is known (re-tokenized replies are not).
    TisCoverage = "update/tis_coverage",
    /// Validation: share of successful episodes.
    ValSuccess = "val/success",
    /// Validation: mean score.
    ValRewardMean = "val/reward_mean",
    /// Validation: share of seeds with a success among their k samples.
    ValPassAtK = "val/pass_at_k",
    /// Validation: share of turns whose first action is the env solver's first move from the
    /// state the model was shown (envs with `fn solve`; turns where it has one): whether the
    /// policy reads the state, apart from the luck of the env's steps.
    ValSolverAgreement = "val/solver_agreement",
    /// Held-out validation: share of successful episodes.
    HeldoutSuccess = "val_heldout/success",
    /// Held-out validation: mean score.
    HeldoutRewardMean = "val_heldout/reward_mean",
    /// Held-out validation: share of seeds with a success among their k samples.
    HeldoutPassAtK = "val_heldout/pass_at_k",
    /// Held-out validation: share of turns whose first action is the env solver's first move.
    HeldoutSolverAgreement = "val_heldout/solver_agreement",
    /// Seconds of the rollout.
    RolloutS = "time/rollout_s",
    /// Seconds of the update.
    UpdateS = "time/update_s",
    /// Seconds of the whole step.
    StepS = "time/step_s",
    /// Rollout less the model: scripts, rendering, tokenising.
    EnvS = "time/env_s",
    /// Seconds prefilling prompts.
    PrefillS = "time/prefill_s",
    /// Seconds decoding tokens.
    DecodeS = "time/decode_s",
    /// Seconds of old and reference log-probs and critic values.
    OldLogprobsS = "time/old_logprobs_s",
    /// Seconds of the update's forward passes.
    ForwardS = "time/forward_s",
    /// Seconds of back-propagation.
    BackwardS = "time/backward_s",
    /// Seconds of gradient clipping and AdamW.
    OptimizerS = "time/optimizer_s",
    /// Tokens of the step: rollout and update.
    Tokens = "perf/tokens",
    /// Token positions the model ran (a shared prompt counts once).
    TokensComputed = "perf/tokens_computed",
    /// Distinct positions of the step's packed trajectories (their prefix tree).
    TokensUnique = "perf/tokens_unique",
    /// Estimated FLOPs (2N per rollout token, 6N per trained token).
    Flops = "perf/flops",
    /// The rollout's floor: one forward over the step's distinct positions, logits where sampled.
    FloorFlopsRollout = "perf/floor_flops_rollout",
    /// The update's floor: forward, checkpoint recompute and backward (4 forwards) over the kept
    /// trajectories' distinct positions, logits where scored. 0 when the update was skipped.
    FloorFlopsUpdate = "perf/floor_flops_update",
    /// Peak resident memory of the process, MB.
    PeakRssMb = "perf/peak_rss_mb",
    /// Template-collapse probe: mutual information between prompts and reasoning, nats.
    MiEstimate = "echo/mi_estimate",
    /// Its bound ln N.
    MiUpperBound = "echo/mi_upper_bound",
    /// Conditional entropy H(Z|X) of the probe.
    ConditionalEntropy = "echo/conditional_entropy",
    /// Marginal entropy H(Z) of the probe.
    MarginalEntropy = "echo/marginal_entropy",
    /// Share of reasoning traces whose own prompt scores highest.
    RetrievalAccuracy = "echo/retrieval_accuracy",
    /// Chance retrieval accuracy 1/N.
    RetrievalChance = "echo/retrieval_chance",
    /// Prompts N in the probe.
    MiSamples = "echo/mi_samples",
}

impl Key {
    /// The key of a name as written in `metrics.jsonl`.
    pub fn from_name(name: &str) -> Option<Key> {
        Key::ALL.iter().copied().find(|k| k.name() == name)
    }

    /// The seconds of one phase of the step.
    pub const fn time(phase: Phase) -> Key {
        match phase {
            Phase::Prefill => Key::PrefillS,
            Phase::Decode => Key::DecodeS,
            Phase::OldLogprobs => Key::OldLogprobsS,
            Phase::Forward => Key::ForwardS,
            Phase::Backward => Key::BackwardS,
            Phase::Optimizer => Key::OptimizerS,
        }
    }

    /// A validation's (success, reward mean, pass@k, solver agreement) keys: `val/` or, held
    /// out, `val_heldout/`.
    pub const fn validation(held_out: bool) -> [Key; 4] {
        if held_out {
            [Key::HeldoutSuccess, Key::HeldoutRewardMean, Key::HeldoutPassAtK, Key::HeldoutSolverAgreement]
        } else {
            [Key::ValSuccess, Key::ValRewardMean, Key::ValPassAtK, Key::ValSolverAgreement]
        }
    }

    /// The key's finite value in a metrics line.
    pub fn get(self, line: &Map<String, Value>) -> Option<f64> {
        line.get(self.name()).and_then(Value::as_f64).filter(|x| x.is_finite())
    }

    /// Writes `v` into a metrics line; a non-finite value is left out (JSON has no NaN).
    pub fn put(self, line: &mut Map<String, Value>, v: f64) {
        if v.is_finite() {
            line.insert(self.name().into(), json!(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_namespaced_and_found_back() {
        let mut seen = std::collections::HashSet::new();
        for &k in Key::ALL {
            assert!(seen.insert(k.name()), "{} declared twice", k.name());
            let (ns, rest) = k.name().split_once('/').unwrap();
            assert!(["rollout", "update", "val", "val_heldout", "time", "perf", "echo"].contains(&ns), "{}", k.name());
            assert!(!rest.is_empty() && !k.doc().is_empty());
            assert_eq!(Key::from_name(k.name()), Some(k));
        }
        for p in Phase::ALL {
            assert_eq!(Key::time(p).name(), format!("time/{}_s", p.name()));
        }
    }

    #[test]
    fn the_contract_lists_every_key() {
        // docs/contracts.md lists the keys as "- `ns/`: name name …" lines (val_heldout shares val's).
        let doc = include_str!("../../docs/contracts.md");
        let listed = &doc[doc.find("Metric keys").expect("a Metric keys section")..];
        for &k in Key::ALL {
            let (ns, name) = k.name().split_once('/').unwrap();
            let ns = if ns == "val_heldout" { "val" } else { ns };
            let line = listed.find(&format!("- `{ns}/`")).map(|i| &listed[i..]).unwrap_or_default();
            let section = &line[..line[1..].find("\n- ").map_or(line.len(), |j| j + 1)];
            assert!(
                section.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).any(|w| w == name),
                "docs/contracts.md does not list {}",
                k.name()
            );
        }
    }
}
