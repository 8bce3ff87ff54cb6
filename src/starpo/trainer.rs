//! The StarPO(-S) training loop, CleanRL-style: read [`train`] top to bottom.
//!
//!   setup (scripts, settings, models, optimisers, run directory, or a checkpoint to resume)
//!   for each step:
//!     1. swap in edited scripts at the step boundary (the script watcher compiles and
//!        smoke-tests them off the hot path; a broken edit is reported, the old version stays)
//!     2. rollout: P groups × N episodes on fresh seeds
//!     3. score: R(τ) per trajectory, normalised per group (or batch)
//!     4. filter: StarPO-S keeps the groups with the most reward variance (or RAGEN-2's rules)
//!     5. advantages of the critic-free estimators from the groups; update (update.rs, RAGEN
//!        `fit` order)
//!     6. log: metrics.jsonl, rollouts, Echo-Trap alarms, TensorBoard, the progress bar
//!     7. validate every n steps (fixed seeds, temperature 0.5, and the held-out variant)
//!     8. checkpoint every n steps (and on Ctrl-C, an early stop, and at the end)
//!
//! Helpers below `train` turn rollouts into metric lines and trajectory lines.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};

use super::advantage::{outcome, turn_grpo};
use super::early_stop::{explore_temperature, EarlyStop, Stopped};
use super::filter::{alike_groups, choice_stds, group_metric, group_stds, select};
use super::normalize::{norm_groups, normalize, normalizer};
use super::optim::AdamW;
use super::progress::progress_bar;
use super::rundir::{now, peak_rss_mb, RunDir};
use super::settings::{
    AdvantageKind, Algo, Backend, FilterKind, FilterLossScaling, FilterMetric, Preset, Settings, Starpo,
};
use super::update::{mean_entropies, update, Item, Models, UpdateStats};
use crate::agent::engine::{HttpEngine, WeightSync};
use crate::agent::pack::distinct_positions;
use crate::agent::rollout::{groups, rollout, Plan, Trajectory, TurnRecord};
use crate::metrics::collapse::template_collapse;
use crate::metrics::echo_trap::{answer_top_share, record, repetition, EchoTrapMonitor, MutualInfo};
use crate::metrics::keys::Key;
use crate::metrics::tensorboard::TbWriter;
use crate::phase::{self, Phase};
use crate::policy::{lora, Critic, Policy};
use crate::rng::Rng;
use crate::script::{
    Experiment, ExperimentScripts, Host, Limits, Loaded, Role, ScriptError, Update, WatchMode, Watcher,
};

/// The model when neither `--model` nor the experiment names one.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// What `ragen-lab train` asks for.
pub struct Options {
    /// The experiment script (scripts/*.rhai).
    pub experiment: PathBuf,
    /// Model spec (HF dir, .gguf, preset, known name, hub id); `None`: the experiment's
    /// `model`, else [`DEFAULT_MODEL`].
    pub model: Option<String>,
    pub preset: Preset,
    pub algo: Option<Algo>,
    /// `--set key=value` flags, in order.
    pub sets: Vec<String>,
    /// `--steps` (also extends a resumed run).
    pub steps: Option<usize>,
    /// `--param key=value`: the training env's parameters over the experiment's `params`.
    pub params: Vec<(String, String)>,
    /// `--val-param key=value`: the held-out variant's, over its `val_params` (or, when the
    /// experiment has none, over the training ones).
    pub val_params: Vec<(String, String)>,
    pub run_dir: PathBuf,
    /// Continue the run in `run_dir` from its latest checkpoint.
    pub resume: bool,
    /// Draw the progress bar and the summary.
    pub progress: bool,
    /// Set by the Ctrl-C handler: save a checkpoint and stop at the next boundary.
    pub stop: Arc<AtomicBool>,
}

/// What a run ends with (the one-screen summary).
#[derive(Debug, Clone)]
pub struct Summary {
    pub run_dir: PathBuf,
    pub first_step: u64,
    pub last_step: u64,
    pub interrupted: bool,
    pub seconds: f64,
    /// (step, metrics line) of the first and last training steps of this session.
    pub first: Option<Map<String, Value>>,
    pub last: Option<Map<String, Value>>,
    /// (step, val line) of every validation of this session.
    pub validations: Vec<(u64, Map<String, Value>)>,
    pub checkpoint: Option<PathBuf>,
    pub alarms: Vec<String>,
    /// Why the run stopped before its last step (`stop.*`), if it did.
    pub early_stop: Option<String>,
}

/// Preset → the experiment script's settings → `--algo` → `--set` flags → validate. Command-line
/// flags beat the script, so `--algo ppo` works on a script that chose GRPO.
pub fn resolve_settings(
    preset: Preset,
    algo: Option<Algo>,
    script: &Map<String, Value>,
    script_path: &Path,
    sets: &[String],
) -> Result<Settings> {
    let mut s = Settings::preset(preset);
    s.apply_map(script, &script_path.display().to_string())?;
    if let Some(a) = algo {
        s.apply_algo(a);
    }
    for flag in sets {
        s.apply_flag(flag)?;
    }
    s.validate()?;
    Ok(s)
}

/// A resumed run keeps the settings and model it was started with; refuses the flags that would
/// change them, saying why (`--set` and `--steps` still apply). `saved` is the run's
/// settings.json. A flag that changes nothing (the model it already uses, the `--algo` its
/// settings already follow) is accepted, so a resume command may repeat the start command's flags.
pub fn refuse_on_resume(
    saved: &Value,
    preset: Option<Preset>,
    algo: Option<Algo>,
    model: Option<&str>,
    params: bool,
) -> Result<()> {
    let why = "a resumed run continues with the settings and model it was started with (settings.json)";
    if params {
        bail!("--param and --val-param cannot apply to --resume: {why}, env parameters included");
    }
    let name = |v: Value| v.as_str().map(String::from).unwrap_or_default();
    if let Some(p) = preset {
        let name = name(json!(p));
        bail!("--preset {name} cannot apply to --resume: {why}; change single settings with --set");
    }
    if let Some(a) = algo {
        let s: Settings = serde_json::from_value(saved["settings"].clone())
            .context("settings.json does not match this version's settings")?;
        let mut changed = s.clone();
        changed.apply_algo(a);
        if changed != s {
            bail!("--algo {} cannot apply to --resume: {why}, and its advantage estimator differs (a critic cannot appear or vanish mid-run)", name(json!(a)));
        }
    }
    if let (Some(m), Some(was)) = (model, saved["model"].as_str()) {
        if m != was {
            bail!("--model {m} cannot apply to --resume: {why}, and this run trains {was}; start a new run to train another model");
        }
    }
    Ok(())
}

/// The checkpointed loop state besides weights and optimiser moments.
#[derive(serde::Serialize, serde::Deserialize)]
struct State {
    step: u64,
    rng: [u64; 4],
    time: f64,
}

pub fn train(opts: Options) -> Result<Summary> {
    let t_start = Instant::now();
    // ---- setup -------------------------------------------------------------------------------
    let host = Host::for_script(&opts.experiment, Limits::from_env().map_err(anyhow::Error::msg)?);
    let mut exp = Experiment::load(&host, &opts.experiment)?;
    let (mut s, start_step, resume_from) = if opts.resume {
        let saved = RunDir::read_settings(&opts.run_dir)?;
        // The env parameters it was started with (`--param` flags included).
        if let Some(p) = saved["params"].as_object() {
            exp.params = p.clone();
        }
        exp.val_params = saved["val_params"].as_object().cloned();
        let mut s: Settings = serde_json::from_value(saved["settings"].clone()).with_context(|| {
            format!("{}: settings.json does not match this version's settings", opts.run_dir.display())
        })?;
        for flag in &opts.sets {
            s.apply_flag(flag)?;
        }
        let ckpt = RunDir::latest_checkpoint(&opts.run_dir)?;
        let st: State = serde_json::from_str(&std::fs::read_to_string(ckpt.join("state.json"))?)
            .with_context(|| format!("reading {}", ckpt.join("state.json").display()))?;
        RunDir::checkpoint_step(&ckpt, st.step)?;
        (s, st.step, Some((ckpt, st)))
    } else {
        let s = resolve_settings(opts.preset, opts.algo, &exp.settings, &exp.path, &opts.sets)?;
        (s, 0, None)
    };
    if let Some(n) = opts.steps {
        s.train.steps = n;
    }
    s.validate()?;
    // A resumed run does not take back a version that failed during it.
    let (mut scripts, resume_notes) = if opts.resume {
        RunDir::resume_scripts(&opts.run_dir, &host, &exp)?
    } else {
        (exp.scripts(&host)?, Vec::new())
    };
    if !opts.val_params.is_empty() {
        let base = exp.val_params.clone().unwrap_or_else(|| exp.params.clone());
        exp.val_params = Some(scripts.env.params_with(&base, &opts.val_params)?);
    }
    if !opts.params.is_empty() {
        exp.params = scripts.env.params_with(&exp.params, &opts.params)?;
    }
    let device = crate::policy::device()?;
    let model = opts.model.clone().or(exp.model.clone()).unwrap_or_else(|| DEFAULT_MODEL.to_string());
    if opts.progress {
        eprintln!("ragen-lab train: {} with {} → {}", opts.experiment.display(), model, opts.run_dir.display());
    }
    let mut base = Policy::load(&model, &device)?;
    // Under LoRA the policy is the base with adapters, and the reference and the critic share
    // its frozen weights; fully fine-tuned, each is its own copy.
    let lora = s.lora_config()?;
    let reference = if s.starpo.kl_coef > 0.0 { Some(base.reference(lora.is_some())?) } else { None };
    let (mut policy, mut critic) = match &resume_from {
        Some((ckpt, _)) => {
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
    policy.model.checkpoint_layers = s.optim.checkpoint_layers;
    if let Some(c) = critic.as_mut() {
        c.backbone.checkpoint_layers = s.optim.checkpoint_layers;
    }
    let mut actor_opt = AdamW::new(policy.model.trainable_vars(), s.optim.lr, &s.optim)?;
    let mut critic_opt = match &critic {
        Some(c) => Some(AdamW::new(c.named_vars(), s.optim.critic_lr, &s.optim)?),
        None => None,
    };
    let mut rng = Rng::new(s.train.seed);
    let mut run = match &resume_from {
        Some((ckpt, st)) => {
            actor_opt.load(&ckpt.join("optimizer.safetensors"))?;
            if let (Some(o), true) = (critic_opt.as_mut(), critic.is_some()) {
                o.load(&ckpt.join("critic_optimizer.safetensors"))?;
            }
            rng = Rng::from_state(st.rng);
            let run = RunDir::reopen(&opts.run_dir, st.step)?;
            run.event(st.step, "resume", &format!("resumed from {}", ckpt.display()), Map::new())?;
            run
        }
        None => RunDir::create(&opts.run_dir)?,
    };
    run.write_settings(&json!({
        "settings": s, "experiment": exp.path, "env": exp.env, "prompt": exp.prompt, "rewards": exp.rewards,
        "params": exp.params, "val_params": exp.val_params, "model": model, "preset": opts.preset,
        "algo": opts.algo, "sets": opts.sets, "model_source": policy.source,
    }))?;
    record_versions(&mut run, start_step, &scripts)?;
    for note in &resume_notes {
        run.event(start_step, "reload_error", note, Map::new())?;
    }
    let mut tb = TbWriter::new(run.path.join("tb"))?;
    let mut echo = EchoTrapMonitor::new(s.echo.clone());
    let n_params = policy.model.cfg.num_params() as f64;
    let total = s.train.steps as u64;
    let bar = progress_bar(opts.progress, "step", total);
    bar.set_position(start_step);
    let mut summary = Summary {
        run_dir: run.path.clone(),
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
    };
    let mut stops = EarlyStop::default();
    let save =
        |run: &RunDir, step: u64, policy: &Policy, critic: &Option<Critic>, a: &AdamW, c: &Option<AdamW>, rng: &Rng| {
            run.save_checkpoint(step, s.train.keep_checkpoints, |dir| {
                policy.save(&dir.join("policy"))?;
                a.save(&dir.join("optimizer.safetensors"))?;
                if let (Some(cr), Some(co)) = (critic, c) {
                    cr.save(&dir.join("critic"), &policy.spec)?;
                    co.save(&dir.join("critic_optimizer.safetensors"))?;
                }
                let st = State { step, rng: rng.state(), time: now() };
                std::fs::write(dir.join("state.json"), serde_json::to_string_pretty(&st)?)?;
                Ok(())
            })
        };
    // Generation on inference engines: they get the policy's weights before the first rollout
    // (whatever an earlier run left there), and again after every update.
    let mut engine = match s.rollout.backend {
        Backend::Http => Some(HttpEngine::connect(&s.rollout)?),
        Backend::Local => None,
    };
    if let Some(e) = engine.as_mut() {
        sync_engine(e, &policy, &run, start_step).context("pushing the policy's weights to the engines")?;
    }
    let mut retries_seen = 0;
    if start_step == 0 && s.train.val_every > 0 {
        validate(&policy, engine.as_ref(), &scripts, &exp, &s, &run, (0, start_step), &mut summary)?;
    }

    // ---- the loop ----------------------------------------------------------------------------
    let watcher = watch(&host, &exp)?;
    // The versions live edits replaced: where a swapped-in version fails on real turns, the
    // one it replaced comes back (see `roll_back`).
    let mut replaced: Vec<Loaded> = Vec::new();
    // The step whose update last changed the weights (0 = the initial ones): each sample records
    // the version that generated it. Synchronous rollouts (RAGEN's) are never older than the
    // update they feed; with rollout.max_policy_lag = 1, `ahead` holds the next step's episodes,
    // played during this step's update.
    let mut version = start_step;
    // Updates made so far: the policy lag counts these, not steps (a skipped step changes nothing).
    let mut updates = 0u64;
    let mut ahead: Option<Played> = None;
    for step in start_step + 1..=total {
        if opts.stop.load(Ordering::SeqCst) {
            summary.interrupted = true;
            break;
        }
        let t_step = Instant::now();
        phase::take(); // what ran between steps (validation, checkpoints) is not this step's
                       // Adapter dropout seeds follow the step, so a resumed run drops what an unbroken one did.
        policy.model.dropout_seed.store(step << 32, Ordering::Relaxed);
        if let Some(c) = &critic {
            c.backbone.dropout_seed.store((step << 32) | 1 << 31, Ordering::Relaxed);
        }

        // 1. Swap in edited scripts at the boundary (the watcher compiled and smoke-tested them).
        for update in watcher.poll() {
            match update {
                Update::Swapped { path, loaded, .. } => {
                    if let Some(old) = loaded_at(&scripts, &path) {
                        replaced.retain(|r| !same_file(&loaded_path(r), &path));
                        replaced.push(old);
                    }
                    let (name, old) = swap_in(&mut scripts, &path, loaded);
                    let msg = format!("swapped in {name} {old} → {}", current_version(&scripts, &path));
                    run.event(step, "swap", &msg, Map::new())?;
                    bar.println(format!("step {step}: {msg}"));
                    record_versions(&mut run, step, &scripts)?;
                }
                Update::Rejected { error, .. } => {
                    let msg = format!("{error}; keeping the previous version");
                    bar.println(format!("step {step}: reload error: {msg}"));
                    run.event(step, "reload_error", &msg, error_fields(&error))?;
                }
            }
        }

        // 2. Rollout: P × reuse groups (rollout freshness), N episodes each, fresh seeds; or the
        // one the engines played during the last update (rollout.max_policy_lag = 1). `play`
        // plays step k's episodes, timed, stamped with the weights that play them.
        let play = |k: u64, scripts: &mut ExperimentScripts, replaced: &mut Vec<Loaded>, rng: &mut Rng| {
            let t0 = Instant::now();
            let (trajs, greedy) = play_step(k, &policy, engine.as_ref(), scripts, replaced, &exp, &s, &run, &bar, rng)?;
            anyhow::Ok(Played { trajs, greedy, seconds: t0.elapsed().as_secs_f64(), version, updates })
        };
        let Played { trajs, greedy, seconds: rollout_s, version: sampled_by, updates: played_after } =
            match ahead.take() {
                Some(r) => r,
                None => play(step, &mut scripts, &mut replaced, &mut rng)?,
            };

        // 3. Score and normalise within each group (or the batch: starpo.reward_norm_grouping).
        let scores: Vec<f64> = trajs.iter().map(|t| t.score).collect();
        let members = groups(&trajs);
        let sets = norm_groups(s.starpo.reward_norm_grouping, &members);
        let normed = normalize(&scores, &sets, s.starpo.reward_norm);

        // 4. Filter whole groups, ranked by in-group reward std (or the chosen metric); the std of
        // a group that played one trajectory is luck, not the agent's, and ranks as none.
        let stds = group_stds(&scores, &members);
        let ids: Vec<&[u32]> = trajs.iter().map(|t| t.packed.ids.as_slice()).collect();
        let alike = alike_groups(&ids, &members);
        let metric = match s.starpo.filter {
            FilterKind::None | FilterKind::Std => choice_stds(&stds, &alike),
            _ if s.starpo.filter_metric == FilterMetric::RewardVariance => choice_stds(&stds, &alike),
            _ => {
                let entropies = match s.starpo.filter_metric {
                    FilterMetric::Entropy | FilterMetric::EntropyVariance => {
                        let packed: Vec<_> = trajs.iter().map(|t| &t.packed).collect();
                        phase::timed(Phase::OldLogprobs, || mean_entropies(&policy, &packed, s.optim.micro_batch_size))?
                    }
                    _ => Vec::new(),
                };
                let lengths: Vec<f64> =
                    trajs.iter().map(|t| t.packed.mask.iter().filter(|&&m| m).count() as f64).collect();
                group_metric(s.starpo.filter_metric, &scores, &entropies, &lengths, &members)
            }
        };
        let kept_groups = select(&metric, &s.starpo);
        let kept: Vec<usize> = kept_groups.iter().flat_map(|&g| members[g].clone()).collect();
        let kept_share = kept_groups.len() as f64 / members.len().max(1) as f64;

        // 5. Advantages of the critic-free estimators, from each group's normalised scores (ReMax:
        // less the group's greedy episode, normalised as its set is); the critic ones take the
        // normalised score. Skipped when nothing is kept, or when every kept advantage is 0 (or,
        // for the whitened REINFORCE++, all equal): the update would apply only the entropy
        // bonus, which AdamW scales to a full-size step, and the policy drifts (SmolLM2 on
        // FrozenLake: entropy 2.5 → 4.0 in 3 such steps).
        let baselines: Vec<f64> = greedy
            .iter()
            .enumerate()
            .map(|(g, &b)| {
                let set = sets.iter().find(|m| m.contains(&members[g][0])).expect("every group is in a set");
                normalizer(&set.iter().map(|&i| scores[i]).collect::<Vec<_>>(), s.starpo.reward_norm)(b)
            })
            .collect();
        let adv = outcome(s.starpo.advantage, &normed, &members, &baselines, s.starpo.norm_adv_by_std_in_grpo);
        let turn_adv = match s.starpo.advantage {
            AdvantageKind::TurnGrpo => {
                let rewards: Vec<Vec<f64>> = trajs.iter().map(|t| t.turns.iter().map(|u| u.reward).collect()).collect();
                turn_grpo(&rewards, &members, s.starpo.norm_adv_by_std_in_grpo)
            }
            _ => vec![Vec::new(); trajs.len()],
        };
        let whitened =
            matches!(s.starpo.advantage, AdvantageKind::ReinforcePlusPlus | AdvantageKind::ReinforcePlusPlusBaseline);
        let flat = |x: f64| if whitened { x == adv[kept[0]] } else { x == 0.0 };
        // A kept group of alike episodes has advantages, but they cancel on its one trajectory
        // (its answer entropy bonus, where one is set, is what spreads a settled choice again).
        let cancels = |g: usize| alike[g] && s.starpo.answer_entropy_coef == 0.0;
        let no_signal = !kept.is_empty()
            && !s.needs_critic()
            && kept_groups.iter().all(|&g| {
                cancels(g) || members[g].iter().all(|&i| flat(adv[i]) && turn_adv[i].iter().all(|&x| x == 0.0))
            });
        if kept.is_empty() {
            let msg = format!(
                "the filter kept no group ({:?} of {:?}): update skipped",
                s.starpo.filter, s.starpo.filter_metric
            );
            run.event(step, "empty_filter", &msg, Map::new())?;
        } else if no_signal {
            let msg = "every kept advantage is 0 or cancels (no reward variance in the kept groups, or each \
                       played one trajectory): update skipped";
            run.event(step, "no_signal", msg, Map::new())?;
        }
        let skipped = kept.is_empty() || no_signal;
        let scales = adv_scales(&s.starpo, kept_share, &kept_groups, &members, &normed, &trajs);
        let t1 = Instant::now();
        let items: Vec<Item> = if skipped {
            Vec::new()
        } else {
            kept.iter()
                .map(|&i| {
                    // The packed sequence shows the last turns (a context window drops early ones).
                    let shown = &turn_adv[i][turn_adv[i].len().saturating_sub(trajs[i].packed.turn_ends.len())..];
                    Item {
                        packed: &trajs[i].packed,
                        score: adv[i] as f32,
                        turn_scores: shown.iter().map(|&x| x as f32).collect(),
                        adv_scale: scales[i] as f32,
                    }
                })
                .collect()
        };
        let models = Models {
            policy: &policy,
            critic: critic.as_ref(),
            reference: reference.as_ref(),
            actor_opt: &mut actor_opt,
            critic_opt: critic_opt.as_mut(),
        };
        let lag = updates - played_after;
        let stats = if s.rollout.max_policy_lag > 0 && step < total && !opts.stop.load(Ordering::SeqCst) {
            // The engines play the next step's episodes (on the weights they hold, one update
            // behind) while this update runs here; its clocks come back from its thread.
            let mut update_rng = Rng::new(rng.next_u64());
            let (stats, next) = std::thread::scope(|scope| {
                let worker = scope.spawn(|| (update(models, &items, &s, &mut update_rng), phase::take()));
                let next = play(step + 1, &mut scripts, &mut replaced, &mut rng);
                let (stats, clocks) = worker.join().map_err(|_| anyhow!("step {step}: the update thread panicked"))?;
                phase::add(&clocks);
                anyhow::Ok((stats, next))
            })?;
            ahead = Some(next?);
            stats?
        } else {
            update(models, &items, &s, &mut rng)?
        };
        if !skipped {
            version = step;
            updates += 1;
        }
        if let (Some(e), false) = (engine.as_mut(), skipped) {
            sync_engine(e, &policy, &run, step).with_context(|| format!("step {step}: pushing the weights"))?;
        }
        let update_s = t1.elapsed().as_secs_f64();
        if let Some(e) = &engine {
            let n = e.retries();
            if n > retries_seen {
                let msg = format!(
                    "{} requests to the engines were retried (busy, or the connection dropped)",
                    n - retries_seen
                );
                bar.println(format!("step {step}: {msg}"));
                run.event(
                    step,
                    "engine_retry",
                    &msg,
                    Map::from_iter([("retries".to_string(), json!(n - retries_seen))]),
                )?;
                retries_seen = n;
            }
        }

        // 6. Log.
        let mut line = rollout_metrics(step, &trajs, &members, &stds, &kept_groups);
        // What the stops read (step 7), before the line is handed on.
        let logged = |k: Key| k.get(&line).unwrap_or(0.0);
        let (mean_std, success, reward) = (logged(Key::InGroupStd), logged(Key::Success), logged(Key::RewardMean));
        put(&mut line, Key::Skipped, f64::from(u8::from(skipped)));
        put(&mut line, Key::EmptyAfterFilter, f64::from(u8::from(kept.is_empty())));
        put(&mut line, Key::PolicyLag, lag as f64);
        if !skipped {
            update_metrics(&mut line, &stats, s.optim.lr);
        }
        let rollout_tokens: usize =
            trajs.iter().map(|t| t.packed.ids.len() + t.turns.iter().map(|u| u.response_tokens).sum::<usize>()).sum();
        put(&mut line, Key::RolloutS, rollout_s);
        put(&mut line, Key::UpdateS, update_s);
        put(&mut line, Key::StepS, t_step.elapsed().as_secs_f64());
        let clocks = phase::take();
        for p in Phase::ALL {
            put(&mut line, Key::time(p), clocks.get(p));
        }
        // The rest of the rollout: env and reward scripts, prompt rendering, tokenising.
        put(&mut line, Key::EnvS, rollout_s - clocks.get(Phase::Prefill) - clocks.get(Phase::Decode));
        put(&mut line, Key::Tokens, (rollout_tokens + stats.tokens) as f64);
        put(&mut line, Key::TokensComputed, clocks.tokens as f64);
        let packed: Vec<&[u32]> = trajs.iter().map(|t| t.packed.ids.as_slice()).collect();
        let unique = distinct_positions(&packed);
        put(&mut line, Key::TokensUnique, unique as f64);
        // Rough: 2·N per token forward (rollout), 6·N per token forward + backward (update).
        put(&mut line, Key::Flops, 2.0 * n_params * rollout_tokens as f64 + 6.0 * n_params * stats.tokens as f64);
        let cfg = &policy.model.cfg;
        let sampled: usize = trajs.iter().flat_map(|t| &t.turns).map(|u| u.response_tokens).sum();
        put(&mut line, Key::FloorFlopsRollout, cfg.forward_flops(unique, sampled));
        if !skipped {
            let kept_ids: Vec<&[u32]> = kept.iter().map(|&i| packed[i]).collect();
            let scored: usize = kept.iter().map(|&i| trajs[i].packed.assistant_tokens()).sum();
            put(&mut line, Key::FloorFlopsUpdate, 4.0 * cfg.forward_flops(distinct_positions(&kept_ids), scored));
        }
        if let Some(mb) = peak_rss_mb() {
            put(&mut line, Key::PeakRssMb, mb);
        }
        if s.echo.mi_every > 0 && step % s.echo.mi_every as u64 == 0 {
            if let Some(mi) = template_collapse_probe(&policy, &trajs, &members, &s)? {
                line.extend(mi.to_metrics());
            }
        }
        let alarms = echo.observe(step, &line);
        record(&alarms, &mut line);
        for a in &alarms {
            run.event_value(&a.event(now()))?;
            bar.println(a.to_string());
            summary.alarms.push(a.to_string());
        }
        run.metrics(&line)?;
        tb.metrics(step, now(), &line)?;
        let adv: Vec<f64> = {
            let mut a = vec![0.0; trajs.len()];
            for (k, &i) in kept.iter().enumerate() {
                a[i] = stats.seq_advantage.get(k).copied().unwrap_or(0.0) as f64;
            }
            a
        };
        let lines: Vec<Value> = trajs
            .iter()
            .enumerate()
            .map(|(i, t)| trajectory_line(step, Some(sampled_by), t, Some(normed[i]), Some(adv[i]), kept.contains(&i)))
            .collect();
        run.rollouts(&format!("step-{step:06}"), &lines)?;
        bar.set_message(headline(&line));
        bar.inc(1);
        summary.first.get_or_insert_with(|| line.clone());
        summary.last = Some(line);
        summary.last_step = step;

        // 7. Validate. Then the early stops (stop.*; RAGEN-2's off by default, ours on flat runs).
        let ragen2 = stops.step(&s.stop, kept.is_empty(), mean_std);
        let mut stopped = ragen2.or(stops.flat(&s.stop, mean_std, success, reward));
        // Collapsed onto one outcome: sample hotter before giving up (stop.explore_temperature).
        if let Some(t) = stopped
            .as_ref()
            .filter(|x| x.kind == "no_variance")
            .and_then(|_| explore_temperature(&s.stop, s.rollout.temperature))
        {
            let message = format!(
                "no group's episodes scored differently for {} steps in a row: rollout.temperature {} → {t} to explore (stop.explore_temperature = {})",
                s.stop.flat_steps, s.rollout.temperature, s.stop.explore_temperature
            );
            let fields = Map::from_iter([
                ("from".to_string(), json!(s.rollout.temperature)),
                ("temperature".to_string(), json!(t)),
            ]);
            run.event(step, "explore", &message, fields)?;
            bar.println(format!("step {step}: {message}"));
            s.rollout.temperature = t;
            stops.reset_flat();
            stopped = None;
        }
        if s.train.val_every > 0 && step % s.train.val_every as u64 == 0 {
            while let Err(e) =
                validate(&policy, engine.as_ref(), &scripts, &exp, &s, &run, (step, version), &mut summary)
            {
                roll_back(e, &mut scripts, &mut replaced, &run, step, &bar)?;
            }
            let success = summary.validations.last().and_then(|v| v.1[Key::ValSuccess.name()].as_f64()).unwrap_or(0.0);
            stopped = stopped.or(stops.validation(&s.stop, success));
        }
        if let Some(Stopped { kind, message, mut fields }) = stopped {
            fields.insert("stop".into(), json!(kind)); // the event's own `kind` is early_stop
            run.event(step, "early_stop", &message, fields)?;
            bar.println(format!("step {step}: early stop: {message}"));
            summary.early_stop = Some(format!("{kind}: {message}"));
        }
        // 8. Checkpoint.
        let last = step == total || summary.early_stop.is_some();
        if last || (s.train.save_every > 0 && step % s.train.save_every as u64 == 0) {
            let dir = save(&run, step, &policy, &critic, &actor_opt, &critic_opt, &rng)?;
            run.event(step, "checkpoint", &format!("saved {}", dir.display()), Map::new())?;
            summary.checkpoint = Some(dir);
        }
        if summary.early_stop.is_some() {
            break;
        }
    }
    if summary.interrupted
        && summary.last_step > start_step
        && summary.checkpoint.as_ref().is_none_or(|c| !c.ends_with(format!("step-{:06}", summary.last_step)))
    {
        let dir = save(&run, summary.last_step, &policy, &critic, &actor_opt, &critic_opt, &rng)?;
        run.event(summary.last_step, "checkpoint", &format!("saved {} on interrupt", dir.display()), Map::new())?;
        summary.checkpoint = Some(dir);
    }
    bar.finish_and_clear();
    tb.flush()?;
    summary.seconds = t_start.elapsed().as_secs_f64();
    Ok(summary)
}

/// One step's episodes, played by the policy or the engines: `env_groups × rollout_reuse`
/// groups of fresh seeds. A script error rolls the script back to its last good version and the
/// step starts over from the same random state.
#[allow(clippy::too_many_arguments)]
fn play_step(
    step: u64,
    policy: &Policy,
    engine: Option<&HttpEngine>,
    scripts: &mut ExperimentScripts,
    replaced: &mut Vec<Loaded>,
    exp: &Experiment,
    s: &Settings,
    run: &RunDir,
    bar: &ProgressBar,
    rng: &mut Rng,
) -> Result<(Vec<Trajectory>, Vec<f64>)> {
    let n_groups = s.rollout.env_groups * s.optim.rollout_reuse;
    let first_seed = s.rollout.seed_base + (step - 1) * n_groups as u64;
    loop {
        let start_rng = rng.clone();
        let attempt = scripts.env.params_from(&exp.params).map_err(anyhow::Error::from).and_then(|params| {
            let plan = Plan {
                seeds: (0..n_groups as u64).map(|g| first_seed + g).collect(),
                group_size: s.rollout.group_size,
                temperature: s.rollout.temperature,
                params,
                ask_solver: false,
            };
            let trajs = rollout(policy, engine, scripts, &plan, &s.rollout, rng)?;
            // ReMax's baseline: one greedy episode per group, from the same start state.
            let greedy = match s.starpo.advantage {
                AdvantageKind::Remax => {
                    let plan = Plan { group_size: 1, temperature: 0.0, ..plan };
                    rollout(policy, engine, scripts, &plan, &s.rollout, rng)?.iter().map(|t| t.score).collect()
                }
                _ => Vec::new(),
            };
            Ok((trajs, greedy))
        });
        match attempt {
            Ok(trajs) => return Ok(trajs),
            Err(e) => {
                // The step starts over on the restored version, from the same random state.
                roll_back(e, scripts, replaced, run, step, bar).with_context(|| format!("step {step}: rollout"))?;
                *rng = start_rng;
            }
        }
    }
}

/// Each trajectory's factor on its advantages: the kept share of groups
/// (`filter_loss_scaling`), and for GRPO its group's std over the largest kept group's
/// (`soft_advantage_reweight`, a lone member's std taken as 1 as GRPO does) and its trained-token
/// count over the kept mean (`grpo_length_weight`, dividing).
fn adv_scales(
    sp: &Starpo,
    kept_share: f64,
    kept_groups: &[usize],
    members: &[Vec<usize>],
    normed: &[f64],
    trajs: &[Trajectory],
) -> Vec<f64> {
    let base = match sp.filter_loss_scaling {
        FilterLossScaling::None => 1.0,
        FilterLossScaling::Linear => kept_share,
        FilterLossScaling::Sqrt => kept_share.sqrt(),
    };
    let mut out = vec![base; trajs.len()];
    if !matches!(sp.advantage, AdvantageKind::Grpo | AdvantageKind::TurnGrpo) {
        return out;
    }
    if sp.soft_advantage_reweight {
        let std = |g: usize| if members[g].len() > 1 { group_stds(normed, &members[g..=g])[0] } else { 1.0 };
        let max = kept_groups.iter().map(|&g| std(g)).fold(0.0, f64::max);
        for &g in kept_groups {
            members[g].iter().for_each(|&i| out[i] *= std(g) / (max + 1e-6));
        }
    }
    if sp.grpo_length_weight {
        let len = |i: usize| trajs[i].packed.mask.iter().filter(|&&m| m).count() as f64;
        let kept: Vec<usize> = kept_groups.iter().flat_map(|&g| members[g].iter().copied()).collect();
        let mean = kept.iter().map(|&i| len(i)).sum::<f64>() / kept.len().max(1) as f64;
        kept.iter().for_each(|&i| out[i] /= (len(i) + 1e-6) / mean.max(1e-6));
    }
    out
}

/// One step's episodes, the weights that played them and how long they took; for ReMax, each
/// group's greedy score.
struct Played {
    trajs: Vec<Trajectory>,
    greedy: Vec<f64>,
    seconds: f64,
    /// The step whose weights played it, and the updates made before it was played.
    version: u64,
    updates: u64,
}

/// Validation: fixed seeds at the validation temperature, on the training params and on the
/// held-out variant where the experiment has one. Its own Rng, so validating does not change
/// the training stream.
#[allow(clippy::too_many_arguments)]
fn validate(
    policy: &Policy,
    engine: Option<&HttpEngine>,
    scripts: &ExperimentScripts,
    exp: &Experiment,
    s: &Settings,
    run: &RunDir,
    (step, version): (u64, u64),
    summary: &mut Summary,
) -> Result<()> {
    let mut variants = vec![("val", "val", exp.params.clone())];
    if let Some(v) = &exp.val_params {
        variants.push(("val_heldout", "val-heldout", v.clone()));
    }
    let mut out = Map::new();
    for (key, file, params) in variants {
        let plan = Plan {
            seeds: (0..s.train.val_groups as u64).map(|g| s.train.val_seed + g).collect(),
            group_size: s.train.val_samples,
            temperature: s.train.val_temperature,
            params: scripts.env.params_from(&params)?,
            ask_solver: true,
        };
        let mut rng = Rng::derive(s.train.seed, 1_000_003);
        let trajs = rollout(policy, engine, scripts, &plan, &s.rollout, &mut rng)
            .with_context(|| format!("step {step}: validation"))?;
        let n = trajs.len().max(1) as f64;
        let success = trajs.iter().filter(|t| t.success).count() as f64 / n;
        let reward = trajs.iter().map(|t| t.score).sum::<f64>() / n;
        let members = groups(&trajs);
        let pass =
            members.iter().filter(|m| m.iter().any(|&i| trajs[i].success)).count() as f64 / members.len().max(1) as f64;
        let lines: Vec<Value> =
            trajs.iter().map(|t| trajectory_line(step, Some(version), t, None, None, false)).collect();
        let [k_success, k_reward, k_pass, k_agree] = Key::validation(key == "val_heldout");
        put(&mut out, k_success, success);
        put(&mut out, k_reward, reward);
        put(&mut out, k_pass, pass);
        if let Some(a) = solver_agreement(&lines) {
            put(&mut out, k_agree, a);
        }
        run.rollouts(&format!("{file}-step-{step:06}"), &lines)?;
    }
    let mut extra = out.clone();
    extra.insert("k".into(), json!(s.train.val_samples));
    let msg = out.iter().map(|(k, v)| format!("{k} {:.3}", v.as_f64().unwrap_or(0.0))).collect::<Vec<_>>().join(", ");
    run.event(step, "validation", &msg, extra)?;
    summary.validations.push((step, out));
    Ok(())
}

/// Pushes the policy's weights to the engines: its LoRA adapter, or the whole model, written
/// under `sync/` in the run directory (the engines read it from there; the previous one goes).
fn sync_engine(engine: &mut HttpEngine, policy: &Policy, run: &RunDir, step: u64) -> Result<()> {
    let root = run.path.join("sync");
    let dir = root.join(format!("step-{step:06}"));
    let _ = std::fs::remove_dir_all(&dir);
    policy.save(&dir)?;
    let path = dir.canonicalize()?.to_string_lossy().into_owned();
    engine.sync(match policy.model.lora {
        Some(_) => WeightSync::Lora { path },
        None => WeightSync::Disk { path },
    })?;
    for old in std::fs::read_dir(&root)?.flatten().filter(|e| e.path() != dir) {
        let _ = std::fs::remove_dir_all(old.path());
    }
    Ok(())
}

fn record_versions(run: &mut RunDir, step: u64, s: &ExperimentScripts) -> Result<()> {
    run.record_script(step, "env", s.env.script())?;
    run.record_script(step, "prompt", s.prompt.script())?;
    for r in &s.rewards {
        run.record_script(step, "reward", r.script())?;
    }
    Ok(())
}

/// Watch the env, prompt and reward scripts the experiment names.
fn watch(host: &Arc<Host>, exp: &Experiment) -> Result<Watcher> {
    let mut files =
        vec![(exp.env.clone(), Role::Env, exp.params.clone()), (exp.prompt.clone(), Role::Prompt, exp.params.clone())];
    files.extend(exp.rewards.iter().map(|r| (r.clone(), Role::Reward, exp.params.clone())));
    // OS file events where they work; re-reading every second where they do not (some containers).
    Watcher::new(host.clone(), files.clone(), WatchMode::Events)
        .or_else(|_| Watcher::new(host.clone(), files, WatchMode::Poll(std::time::Duration::from_secs(1))))
}

/// A script failed during the step. When it is a version a live edit swapped in, put back the
/// version it replaced, report it once (`script_error`, with the error's place) and return Ok so
/// the caller tries again; any other failure ends the run, as before.
fn roll_back(
    err: anyhow::Error,
    scripts: &mut ExperimentScripts,
    replaced: &mut Vec<Loaded>,
    run: &RunDir,
    step: u64,
    bar: &ProgressBar,
) -> Result<()> {
    let Some(e) = err.downcast_ref::<ScriptError>() else { return Err(err) };
    let failed = [scripts.env.script(), scripts.prompt.script()]
        .into_iter()
        .chain(scripts.rewards.iter().map(|r| r.script()))
        .find(|x| x.version() == e.version)
        .map(|x| x.path.clone());
    let Some(path) = failed else { return Err(err) };
    let Some(at) = replaced.iter().position(|r| same_file(&loaded_path(r), &path)) else { return Err(err) };
    let old = replaced.remove(at);
    let restored = old.version();
    swap_in(scripts, &path, old);
    let msg = format!("{e}; rolled back to version {restored}");
    bar.println(format!("step {step}: script error: {msg}"));
    let mut extra = error_fields(e);
    extra.insert("restored".into(), json!(restored));
    run.event(step, "script_error", &msg, extra)?;
    Ok(())
}

/// Where a script error is, as event fields.
fn error_fields(e: &ScriptError) -> Map<String, Value> {
    let v = json!({"path": e.path, "line": e.line, "col": e.col, "error": format!("{:?}", e.kind).to_lowercase(), "version": e.version});
    v.as_object().cloned().unwrap_or_default()
}

/// The version in use for the script at `path`.
fn loaded_at(s: &ExperimentScripts, path: &Path) -> Option<Loaded> {
    if same_file(&s.env.script().path, path) {
        return Some(Loaded::Env(s.env.clone()));
    }
    if same_file(&s.prompt.script().path, path) {
        return Some(Loaded::Prompt(s.prompt.clone()));
    }
    s.rewards.iter().find(|r| same_file(&r.script().path, path)).map(|r| Loaded::Reward(r.clone()))
}

fn loaded_path(l: &Loaded) -> PathBuf {
    match l {
        Loaded::Env(s) => s.script().path.clone(),
        Loaded::Prompt(s) => s.script().path.clone(),
        Loaded::Reward(s) => s.script().path.clone(),
        Loaded::Experiment(x) => x.path.clone(),
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}

/// Put a new version in place; returns the script's name and the version it replaced.
fn swap_in(scripts: &mut ExperimentScripts, path: &Path, loaded: Loaded) -> (String, String) {
    let old = current_version(scripts, path);
    let name = match loaded {
        Loaded::Env(e) => {
            scripts.env = e;
            scripts.env.script().name.clone()
        }
        Loaded::Prompt(p) => {
            scripts.prompt = p;
            scripts.prompt.script().name.clone()
        }
        Loaded::Reward(r) => match scripts.rewards.iter_mut().find(|x| same_file(&x.script().path, path)) {
            Some(slot) => {
                *slot = r;
                slot.script().name.clone()
            }
            None => path.display().to_string(),
        },
        Loaded::Experiment(_) => path.display().to_string(),
    };
    (name, old)
}

fn current_version(s: &ExperimentScripts, path: &Path) -> String {
    let mut all = vec![s.env.script(), s.prompt.script()];
    all.extend(s.rewards.iter().map(|r| r.script()));
    all.into_iter().find(|x| same_file(&x.path, path)).map(|x| x.version().to_string()).unwrap_or_default()
}

fn put(m: &mut Map<String, Value>, k: Key, v: f64) {
    k.put(m, v);
}

/// The `rollout/` metrics of one step (docs/contracts.md "Metric keys").
fn rollout_metrics(
    step: u64,
    trajs: &[Trajectory],
    members: &[Vec<usize>],
    stds: &[f64],
    kept: &[usize],
) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("step".into(), json!(step));
    m.insert("time".into(), json!(now()));
    let scores: Vec<f64> = trajs.iter().map(|t| t.score).collect();
    let (mean, std) = super::normalize::mean_std(&scores);
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
    put(&mut m, Key::KeptRatio, kept.len() as f64 / members.len().max(1) as f64);
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
    let answers: Vec<(&str, String)> =
        turns.iter().filter(|t| t.legal_answer()).map(|t| (t.obs.as_str(), t.actions.join(" || "))).collect();
    if let Some(share) = answer_top_share(&answers) {
        put(&mut m, Key::AnswerTopShare, share);
    }
    m
}

fn update_metrics(m: &mut Map<String, Value>, u: &UpdateStats, lr: f64) {
    put(m, Key::PgLoss, u.pg_loss);
    put(m, Key::Entropy, u.entropy);
    put(m, Key::ClipFrac, u.clip_frac);
    put(m, Key::GradNorm, u.grad_norm);
    put(m, Key::ApproxKl, u.approx_kl);
    put(m, Key::Lr, lr);
    put(m, Key::OptimizerSteps, u.optimizer_steps as f64);
    if let Some(k) = u.kl {
        put(m, Key::Kl, k);
    }
    if let Some(v) = u.value_loss {
        put(m, Key::ValueLoss, v);
    }
    if let Some(t) = &u.tis {
        put(m, Key::TisWeightMean, t.weight_mean);
        put(m, Key::TisRatioMax, t.ratio_max);
        put(m, Key::KlRollout, t.kl_rollout);
        put(m, Key::TisCoverage, t.coverage);
    }
}

/// One trajectory line (docs/contracts.md "Trajectory line").
pub(crate) fn trajectory_line(
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
pub(crate) fn solver_agreement(lines: &[Value]) -> Option<f64> {
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

fn headline(m: &Map<String, Value>) -> String {
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

impl Summary {
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
fn template_collapse_probe(
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
