//! The networks a training run holds: the policy (fully fine-tuned or with LoRA adapters), the
//! critic where the advantage estimator needs one, the frozen reference where a KL term does,
//! and their optimisers; opened fresh or from a checkpoint, and saved into one.
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};

use super::optim::AdamW;
use super::resume::LoopState;
use super::rundir::{now, RunDir};
use super::settings::Settings;
use crate::policy::{lora, Critic, Policy};
use crate::rng::Rng;

/// The networks a run trains, the frozen reference, and the optimisers.
pub struct Nets {
    pub policy: Policy,
    pub critic: Option<Critic>,
    pub reference: Option<Policy>,
    pub actor_opt: AdamW,
    pub critic_opt: Option<AdamW>,
}

impl Nets {
    /// Loads `model`, attaches the adapters or critic the settings ask for, or takes the weights
    /// and optimiser moments of `checkpoint`.
    pub fn open(model: &str, s: &Settings, checkpoint: Option<&Path>) -> Result<Self> {
        let mut base = Policy::load(model, &crate::policy::device()?)?;
        // Under LoRA the policy is the base with adapters, and the reference and the critic share
        // its frozen weights; fully fine-tuned, each is its own copy.
        let lora = s.lora_config()?;
        let reference = if s.starpo.kl_coef > 0.0 { Some(base.reference(lora.is_some())?) } else { None };
        let (mut policy, mut critic) = match checkpoint {
            Some(ckpt) => {
                let p = base.load_saved(&ckpt.join("policy"))?;
                let c = if s.needs_critic() { Some(Critic::load(&ckpt.join("critic"), &p)?) } else { None };
                (p, c)
            }
            None => {
                if let Some(cfg) = &lora {
                    lora::attach(&mut base.model, cfg, s.train.seed)?;
                }
                let c = if s.needs_critic() { Some(Critic::from_policy(&base, s.train.seed)?) } else { None };
                (base, c)
            }
        };
        if policy.model.lora != lora {
            bail!("the checkpoint's adapters do not match the run's lora.* settings");
        }
        s.optim.plan_memory(&mut policy.model);
        if let Some(c) = critic.as_mut() {
            s.optim.plan_memory(&mut c.backbone);
        }
        let mut actor_opt = AdamW::new(policy.model.trainable_vars(), s.optim.lr, &s.optim)?;
        let mut critic_opt =
            critic.as_ref().map(|c| AdamW::new(c.named_vars(), s.optim.critic_lr, &s.optim)).transpose()?;
        if let Some(ckpt) = checkpoint {
            actor_opt.load(&ckpt.join("optimizer.safetensors"))?;
            if let Some(o) = critic_opt.as_mut() {
                o.load(&ckpt.join("critic_optimizer.safetensors"))?;
            }
        }
        Ok(Self { policy, critic, reference, actor_opt, critic_opt })
    }

    /// Weights, optimiser moments and the loop state, into the run's checkpoint for `step`.
    pub fn save(&self, run: &RunDir, step: u64, rng: &Rng, keep: usize) -> Result<PathBuf> {
        run.save_checkpoint(step, keep, |dir| {
            self.policy.save(&dir.join("policy"))?;
            self.actor_opt.save(&dir.join("optimizer.safetensors"))?;
            if let (Some(c), Some(o)) = (&self.critic, &self.critic_opt) {
                c.save(&dir.join("critic"), &self.policy.spec)?;
                o.save(&dir.join("critic_optimizer.safetensors"))?;
            }
            let st = LoopState { step, rng: rng.state(), time: now() };
            std::fs::write(dir.join("state.json"), serde_json::to_string_pretty(&st)?)?;
            Ok(())
        })
    }
}
