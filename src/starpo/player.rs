//! Playing a training run's episodes with the current weights: a step's groups on fresh seeds,
//! and validation's on fixed ones at the validation temperature (on the training params and on
//! the held-out variant, from a random stream of its own, so validating does not change the
//! training one). A live-edited script that fails on real turns is rolled back to the version it
//! replaced and the episodes played again.
use std::time::Instant;

use anyhow::{Context, Result};
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};

use super::report::{solver_agreement, trajectory_line};
use super::rundir::RunDir;
use super::settings::{AdvantageKind, Settings};
use crate::agent::engine::HttpEngine;
use crate::agent::rollout::{groups, rollout, Plan, Trajectory};
use crate::metrics::keys::Key;
use crate::policy::Policy;
use crate::rng::Rng;
use crate::script::{Experiment, ExperimentScripts, LiveScripts, ScriptError};

/// One step's episodes, the weights that played them and how long they took; for ReMax, each
/// group's greedy score.
pub struct Played {
    pub trajs: Vec<Trajectory>,
    pub greedy: Vec<f64>,
    pub seconds: f64,
    /// The step whose weights played it, and the updates made before it was played.
    pub version: u64,
    pub updates: u64,
}

/// What playing a step's episodes borrows from the trainer.
pub struct Player<'a> {
    pub policy: &'a Policy,
    pub engine: Option<&'a HttpEngine>,
    pub exp: &'a Experiment,
    pub s: &'a Settings,
    pub run: &'a RunDir,
    pub bar: &'a ProgressBar,
    pub version: u64,
    pub updates: u64,
}

impl Player<'_> {
    /// Step `step`'s episodes: `env_groups × rollout_reuse` groups of fresh seeds, timed and
    /// stamped with the weights that play them. A script error rolls the script back to its last
    /// good version and the step starts over from the same random state.
    pub fn play(&self, step: u64, scripts: &mut LiveScripts, rng: &mut Rng) -> Result<Played> {
        let t0 = Instant::now();
        let s = self.s;
        let n_groups = s.rollout.env_groups * s.optim.rollout_reuse;
        let first_seed = s.rollout.seed_base + (step - 1) * n_groups as u64;
        loop {
            let start_rng = rng.clone();
            let current = &scripts.current;
            let attempt = current.env.params_from(&self.exp.params).map_err(anyhow::Error::from).and_then(|params| {
                let plan = Plan {
                    seeds: (0..n_groups as u64).map(|g| first_seed + g).collect(),
                    group_size: s.rollout.group_size,
                    temperature: s.rollout.temperature,
                    answer_temperature: s.rollout.answer_temperature(),
                    params,
                    ask_solver: false,
                };
                let trajs = rollout(self.policy, self.engine, current, &plan, &s.rollout, rng)?;
                // ReMax's baseline: one greedy episode per group, from the same start state.
                let greedy = match s.starpo.advantage {
                    AdvantageKind::Remax => {
                        let plan = Plan { group_size: 1, temperature: 0.0, ..plan };
                        rollout(self.policy, self.engine, current, &plan, &s.rollout, rng)?
                            .iter()
                            .map(|t| t.score)
                            .collect()
                    }
                    _ => Vec::new(),
                };
                Ok((trajs, greedy))
            });
            match attempt {
                Ok((trajs, greedy)) => {
                    let seconds = t0.elapsed().as_secs_f64();
                    return Ok(Played { trajs, greedy, seconds, version: self.version, updates: self.updates });
                }
                Err(e) => {
                    roll_back(e, scripts, self.run, step, self.bar).with_context(|| format!("step {step}: rollout"))?;
                    *rng = start_rng;
                }
            }
        }
    }

    pub fn validate(&self, step: u64, scripts: &ExperimentScripts) -> Result<Map<String, Value>> {
        let (s, exp) = (self.s, self.exp);
        let mut variants = vec![(false, "val", exp.params.clone())];
        if let Some(v) = &exp.val_params {
            variants.push((true, "val-heldout", v.clone()));
        }
        let mut out = Map::new();
        for (heldout, file, params) in variants {
            let plan = Plan {
                seeds: (0..s.train.val_groups as u64).map(|g| s.train.val_seed + g).collect(),
                group_size: s.train.val_samples,
                temperature: s.train.val_temperature,
                answer_temperature: None,
                params: scripts.env.params_from(&params)?,
                ask_solver: true,
            };
            let mut rng = Rng::derive(s.train.seed, 1_000_003);
            let trajs = rollout(self.policy, self.engine, scripts, &plan, &s.rollout, &mut rng)
                .with_context(|| format!("step {step}: validation"))?;
            let n = trajs.len().max(1) as f64;
            let success = trajs.iter().filter(|t| t.success).count() as f64 / n;
            let reward = trajs.iter().map(|t| t.score).sum::<f64>() / n;
            let members = groups(&trajs);
            let pass = members.iter().filter(|m| m.iter().any(|&i| trajs[i].success)).count() as f64
                / members.len().max(1) as f64;
            let lines: Vec<Value> =
                trajs.iter().map(|t| trajectory_line(step, Some(self.version), t, None, None, false)).collect();
            let [k_success, k_reward, k_pass, k_agree] = Key::validation(heldout);
            k_success.put(&mut out, success);
            k_reward.put(&mut out, reward);
            k_pass.put(&mut out, pass);
            if let Some(a) = solver_agreement(&lines) {
                k_agree.put(&mut out, a);
            }
            self.run.rollouts(&format!("{file}-step-{step:06}"), &lines)?;
        }
        let mut extra = out.clone();
        extra.insert("k".into(), json!(s.train.val_samples));
        let msg =
            out.iter().map(|(k, v)| format!("{k} {:.3}", v.as_f64().unwrap_or(0.0))).collect::<Vec<_>>().join(", ");
        self.run.event(step, "validation", &msg, extra)?;
        Ok(out)
    }
}

/// A script failed during the step. When it is a version a live edit swapped in, put back the
/// version it replaced, report it once (`script_error`, with the error's place) and return Ok so
/// the caller tries again; any other failure ends the run.
pub fn roll_back(
    err: anyhow::Error,
    scripts: &mut LiveScripts,
    run: &RunDir,
    step: u64,
    bar: &ProgressBar,
) -> Result<()> {
    let Some(e) = err.downcast_ref::<ScriptError>() else { return Err(err) };
    let Some(back) = scripts.roll_back(e) else { return Err(err) };
    let msg = format!("{e}; rolled back to version {}", back.restored);
    bar.println(format!("step {step}: script error: {msg}"));
    let mut extra = e.fields();
    extra.insert("restored".into(), json!(back.restored));
    run.event(step, "script_error", &msg, extra)?;
    Ok(())
}
