//! The `rollout` settings section: how many episodes, how long, how they are sampled and shown
//! to the model. Its own file so that the engines and the rollout both read it from below.
use serde::{Deserialize, Serialize};

/// Who generates a rollout's replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    /// This process's sampler, on the trainer's own weights.
    Local,
    /// Inference engines at `rollout.endpoints`, weights pushed after every update.
    Http,
}

settings_section! {
    /// Rollout: how many episodes, how long, how they are sampled and shown to the model.
    Rollout {
        /// Number of env groups P per step; each group shares one start state (seed).
        env_groups: usize = 4,
        /// Episodes N per group.
        group_size: usize = 8,
        /// Most turns per episode; 0 = the env's own max_turns.
        max_turns: usize = 0,
        /// Most env actions per episode; 0 = the env's own max_actions.
        max_actions: usize = 0,
        /// Most actions parsed from one turn (`a || b || …`); 0 = the env's own value.
        max_actions_per_turn: usize = 0,
        /// Most generated tokens per turn (RAGEN: 400; its Bandit: 500).
        response_length: usize = 128,
        /// Most tokens in a whole packed trajectory (RAGEN max_model_len: 3600); an episode
        /// whose next prompt would pass it ends (truncated).
        max_context_tokens: usize = 3600,
        /// Sampling temperature for training rollouts.
        temperature: f64 = 1.0,
        /// Sampling temperature of a constrained answer's choices (the draws among several
        /// legal tokens under rollout.constrain_actions); 0 = rollout.temperature. A pretrained
        /// model is often near-certain between a few legal answers before any training
        /// (SmolLM2: one of two words 93% of the time at temperature 1), so RL rarely samples
        /// the other and cannot learn that it pays. The update scores the choices at this
        /// temperature too (the policy trained is the one sampled); validation samples at
        /// train.val_temperature.
        answer_temperature: f64 = 0.0,
        /// Nucleus sampling mass (1 = off).
        top_p: f64 = 1.0,
        /// Top-k sampling (0 = off).
        top_k: usize = 0,
        /// Think mode: generation starts inside `<think>`; false = no-think, it starts inside
        /// `<answer>` and the model gives the answer alone.
        think: bool = true,
        /// Turns of history the model sees: 0 = the full conversation, k = the last k turns.
        context_window: usize = 0,
        /// List the env's legal actions in the prompt (the prompt script reads it as
        /// `turn.show_actions`).
        show_actions: bool = true,
        /// Inside `<answer>`, sample only the names of the actions legal in the episode's state
        /// (`valid_actions(state)`, else `describe`'s; `A || B`, then `</answer>`), so an answer
        /// cannot be misspelt; the choice stays the model's. RAGEN samples freely. No effect on
        /// free-text envs.
        constrain_actions: bool = false,
        /// Think mode: after this many tokens without `</think>`, the sampler writes
        /// `</think><answer>` itself (left out of the loss) and the model answers; 0 = off. For
        /// models that never close their think block within `response_length`.
        think_budget: usize = 0,
        /// Keys and values kept between turns so the next turn prefills only its new tokens,
        /// in MB for the whole batch (0 = re-prefill every turn); episodes past it re-prefill.
        kv_cache_mb: usize = 2048,
        /// First training seed (RAGEN seed.train); each step's P groups take the next P seeds.
        seed_base: u64 = 10000,
        /// Who generates: "local" (this process's sampler) or "http" (inference engines at
        /// `rollout.endpoints`: `ragen-lab serve`, vLLM, SGLang; token ids end to end, weights
        /// pushed after every update; see docs/scale.md).
        backend: Backend = Backend::Local,
        /// With backend "http": the engines' URLs, comma-separated (`http://host:8000/v1,…`).
        endpoints: String = String::new(),
        /// With backend "http": the base model's name at the engines ("" = the first listed).
        engine_model: String = String::new(),
        /// With backend "http": truncated importance sampling, each token's policy-gradient
        /// weighted by min(π_old / π_engine, cap) to correct for the engine's numerics (veRL
        /// `rollout_is_threshold`); 0 = off. Applied only at temperature 1 without
        /// constrain_actions (otherwise the engine's log-probs are of another distribution).
        tis_cap: f64 = 2.0,
        /// With backend "http": how many updates a sample's weights may be behind the update
        /// that trains on it. 0 = synchronous (RAGEN's); 1 = the next step's rollout runs on the
        /// engines while this step's update runs on the trainer (one-step off-policy, corrected
        /// by `tis_cap`'s importance weights).
        max_policy_lag: usize = 0,
    }
}

impl Rollout {
    /// The choices' temperature where it differs from `temperature`.
    pub fn answer_temperature(&self) -> Option<f64> {
        (self.answer_temperature > 0.0).then_some(self.answer_temperature)
    }
}

/// A training rollout's temperatures: `temperature`, and `answer_temperature` where set.
impl From<&Rollout> for crate::policy::Temperature {
    fn from(r: &Rollout) -> Self {
        let text = r.temperature as f32;
        Self { text, answer: r.answer_temperature().map_or(text, |t| t as f32) }
    }
}

impl From<&Rollout> for crate::script::turn::TurnSettings {
    fn from(r: &Rollout) -> Self {
        Self { max_actions: r.max_actions, max_actions_per_turn: r.max_actions_per_turn, think: r.think }
    }
}
