//! The StarPO(-S) training loop, CleanRL-style: read [`train`] top to bottom.
//!
//!   setup (scripts, settings, models, optimisers, run directory, or a checkpoint to resume)
//!   for each step:
//!     1. swap in edited scripts at the step boundary (the script watcher compiles and
//!        smoke-tests them off the hot path; a broken edit is reported, the old version stays)
//!     2. rollout: P groups × N episodes on fresh seeds
//!     3. score: R(τ) per trajectory, normalised per group (or batch)
//!     4. filter: StarPO-S keeps the groups with the most reward variance (or RAGEN-2's rules)
//!     5. advantages of the critic-free estimators from the groups (3–5: credit.rs); update
//!        (update.rs, RAGEN `fit` order)
//!     6. log: metrics.jsonl, rollouts, Echo-Trap alarms, TensorBoard, the progress bar
//!     7. validate every n steps (fixed seeds, temperature 0.5, and the held-out variant), then
//!        the early stops
//!     8. checkpoint every n steps (and on Ctrl-C, an early stop, and at the end)
//!
//! [`Trainer`] holds what lives across steps; its methods are the steps' parts.
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context, Result};
use indicatif::ProgressBar;
use serde_json::{json, Map, Value};

use super::credit::Credit;
use super::early_stop::{explore_temperature, EarlyStop, Stopped};
use super::nets::Nets;
use super::player::{roll_back, Played, Player};
use super::preview::Preview;
use super::report::{
    cost_metrics, headline, progress_bar, rollout_metrics, template_collapse_probe, trajectory_line, update_metrics,
};
use super::report::{Cost, Summary};
use super::resume::{resolve_settings, Resume, RunRecord};
use super::rundir::{now, RunDir};
use super::settings::{Algo, Backend, Preset, Settings};
use super::update::{mean_entropies, update, Models, UpdateStats};
use crate::agent::engine::HttpEngine;
use crate::metrics::echo_trap::{record, EchoTrapMonitor};
use crate::metrics::keys::Key;
use crate::metrics::tensorboard::TbWriter;
use crate::phase::{self, Phase};
use crate::policy::Temperature;
use crate::rng::Rng;
use crate::script::{
    with_edit, Experiment, Host, Limits, LiveScripts, Loaded, RewardScript, ScriptError, Update, Watcher,
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

pub fn train(opts: Options) -> Result<Summary> {
    let t_start = Instant::now();
    let mut t = Trainer::open(&opts)?;
    if t.start_step == 0 && t.s.train.val_every > 0 {
        t.validate(0)?;
    }
    let watcher = t.exp.watch(&t.host)?;
    // With rollout.max_policy_lag = 1, the next step's episodes, played during this update.
    let mut ahead: Option<Played> = None;
    for step in t.start_step + 1..=t.total() {
        if opts.stop.load(Ordering::SeqCst) {
            t.summary.interrupted = true;
            break;
        }
        let t_step = Instant::now();
        t.begin(step);

        // 1. Swap in edited scripts at the boundary (the watcher compiled and smoke-tested them).
        t.swap_edits(step, &watcher)?;

        // 2. Rollout: P × reuse groups (rollout freshness), N episodes each, fresh seeds; or the
        // one the engines played during the last update.
        let played = match ahead.take() {
            Some(p) => p,
            None => t.play(step)?,
        };

        // 3–5. Score, filter whole groups, advantages. Skipped when nothing is kept, or when no
        // kept advantage carries a signal (credit.rs says which).
        let credit = Credit::assign(&played.trajs, &played.greedy, &t.s, || {
            let packed: Vec<_> = played.trajs.iter().map(|t| &t.packed).collect();
            phase::timed(Phase::OldLogprobs, || {
                mean_entropies(&t.nets.policy, &packed, t.s.optim.micro_batch_size, Temperature::from(&t.s.rollout))
            })
        })?;
        t.report_skip(step, &credit)?;
        let t_update = Instant::now();
        let (stats, next) = t.update(step, &played, &credit)?;
        ahead = next;
        let update_s = t_update.elapsed().as_secs_f64();
        t.report_retries(step)?;

        // 6. Log.
        let cost = Cost {
            clocks: phase::take(),
            rollout_s: played.seconds,
            update_s,
            step_s: t_step.elapsed().as_secs_f64(),
            update_tokens: stats.tokens,
        };
        let line = t.log(step, &played, &credit, &stats, &cost)?;

        // 7. Validate. Then the early stops (stop.*; RAGEN-2's off by default, ours on flat runs).
        let logged = |k: Key| k.get(&line).unwrap_or(0.0);
        let (mean_std, success, reward) = (logged(Key::InGroupStd), logged(Key::Success), logged(Key::RewardMean));
        let top_share = Key::AnswerTopShare.get(&line);
        t.summary.step(step, line);
        let ragen2 = t.stops.step(&t.s.stop, credit.kept.is_empty(), mean_std);
        let flat = t.stops.flat(&t.s.stop, mean_std, success, reward, top_share);
        let mut stopped = t.explore(step, ragen2.or(flat))?;
        if t.s.train.val_every > 0 && step % t.s.train.val_every as u64 == 0 {
            let success = t.validate(step)?;
            stopped = stopped.or(t.stops.validation(&t.s.stop, success));
        }
        if let Some(Stopped { kind, message, mut fields }) = stopped {
            fields.insert("stop".into(), json!(kind)); // the event's own `kind` is early_stop
            t.run.event(step, "early_stop", &message, fields)?;
            t.bar.println(format!("step {step}: early stop: {message}"));
            t.summary.early_stop = Some(format!("{kind}: {message}"));
        }

        // 8. Checkpoint.
        let last = step == t.total() || t.summary.early_stop.is_some();
        if last || (t.s.train.save_every > 0 && step % t.s.train.save_every as u64 == 0) {
            t.save(step, "")?;
        }
        if t.summary.early_stop.is_some() {
            break;
        }
    }
    t.finish(t_start)
}

/// What a run holds across its steps, opened once.
struct Trainer<'o> {
    opts: &'o Options,
    host: Arc<Host>,
    exp: Experiment,
    s: Settings,
    scripts: LiveScripts,
    nets: Nets,
    /// Generation on inference engines (`rollout.backend = http`); they get the policy's weights
    /// before the first rollout and after every update.
    engine: Option<HttpEngine>,
    rng: Rng,
    run: RunDir,
    tb: TbWriter,
    echo: EchoTrapMonitor,
    stops: EarlyStop,
    bar: ProgressBar,
    summary: Summary,
    start_step: u64,
    /// The step whose update last changed the weights (0 = the initial ones): each sample records
    /// the version that generated it. Synchronous rollouts (RAGEN's) are never older than the
    /// update they feed.
    version: u64,
    /// Updates made so far: the policy lag counts these, not steps (a skipped step changes nothing).
    updates: u64,
    retries_seen: usize,
    /// The last finished step's trajectory lines: a reward edit is previewed on them.
    last_lines: Option<(u64, Vec<Map<String, Value>>)>,
}

impl<'o> Trainer<'o> {
    fn open(opts: &'o Options) -> Result<Self> {
        let host = Host::for_script(&opts.experiment, Limits::from_env()?);
        let mut exp = Experiment::load(&host, &opts.experiment)?;
        let resume = if opts.resume { Some(Resume::open(&opts.run_dir)?) } else { None };
        let mut s = match &resume {
            Some(r) => {
                // The settings and env parameters it was started with (`--param` flags included).
                exp.params = r.record.params.clone();
                exp.val_params = r.record.val_params.clone();
                let mut s = r.record.settings.clone();
                for flag in &opts.sets {
                    s.apply_flag(flag)?;
                }
                s
            }
            None => resolve_settings(opts.preset, opts.algo, &exp.settings, &exp.path, &opts.sets)?,
        };
        if let Some(n) = opts.steps {
            s.train.steps = n;
        }
        s.validate()?;
        // A resumed run does not take back a version that failed during it.
        let (scripts, resume_notes) = match &resume {
            Some(_) => RunDir::resume_scripts(&opts.run_dir, &host, &exp)?,
            None => (exp.scripts(&host)?, Vec::new()),
        };
        if !opts.val_params.is_empty() {
            let base = exp.val_params.clone().unwrap_or_else(|| exp.params.clone());
            exp.val_params = Some(scripts.env.params_with(&base, &opts.val_params)?);
        }
        if !opts.params.is_empty() {
            exp.params = scripts.env.params_with(&exp.params, &opts.params)?;
        }
        let model = opts.model.clone().or(exp.model.clone()).unwrap_or_else(|| DEFAULT_MODEL.to_string());
        if opts.progress {
            eprintln!("ragen-lab train: {} with {} → {}", opts.experiment.display(), model, opts.run_dir.display());
        }
        let nets = Nets::open(&model, &s, resume.as_ref().map(|r| r.checkpoint.as_path()))?;
        let (mut run, rng, start_step) = match &resume {
            Some(r) => {
                let run = RunDir::reopen(&opts.run_dir, r.state.step)?;
                run.event(r.state.step, "resume", &format!("resumed from {}", r.checkpoint.display()), Map::new())?;
                (run, Rng::from_state(r.state.rng), r.state.step)
            }
            None => (RunDir::create(&opts.run_dir)?, Rng::new(s.train.seed), 0),
        };
        let record = RunRecord {
            settings: s.clone(),
            experiment: exp.path.clone(),
            env: exp.env.clone(),
            prompt: exp.prompt.clone(),
            rewards: exp.rewards.clone(),
            params: exp.params.clone(),
            val_params: exp.val_params.clone(),
            model,
            model_source: nets.policy.source.clone(),
            preset: opts.preset,
            algo: opts.algo,
            sets: opts.sets.clone(),
        };
        record.write(&run)?;
        run.record_scripts(start_step, &scripts)?;
        for note in &resume_notes {
            run.event(start_step, "reload_error", note, Map::new())?;
        }
        let mut engine = match s.rollout.backend {
            Backend::Http => Some(HttpEngine::connect(&s.rollout)?),
            Backend::Local => None,
        };
        if let Some(e) = engine.as_mut() {
            // Whatever an earlier run left on the engines is replaced.
            e.sync_policy(&nets.policy, &run.path.join("sync"), start_step)
                .context("pushing the policy's weights to the engines")?;
        }
        let bar = progress_bar(opts.progress, "step", s.train.steps as u64);
        bar.set_position(start_step);
        Ok(Self {
            opts,
            exp,
            scripts: LiveScripts::new(scripts),
            nets,
            engine,
            rng,
            tb: TbWriter::new(run.path.join("tb"))?,
            echo: EchoTrapMonitor::new(s.echo.clone()),
            stops: EarlyStop::default(),
            bar,
            summary: Summary::new(run.path.clone(), start_step),
            run,
            s,
            host,
            start_step,
            version: start_step,
            updates: 0,
            retries_seen: 0,
            last_lines: None,
        })
    }

    fn total(&self) -> u64 {
        self.s.train.steps as u64
    }

    /// What ran between steps (validation, checkpoints) is not this step's; adapter dropout
    /// seeds follow the step, so a resumed run drops what an unbroken one did.
    fn begin(&self, step: u64) {
        phase::take();
        self.nets.policy.model.dropout_seed.store(step << 32, Ordering::Relaxed);
        if let Some(c) = &self.nets.critic {
            c.backbone.dropout_seed.store((step << 32) | 1 << 31, Ordering::Relaxed);
        }
    }

    /// Swaps in the edits the watcher accepted, and reports the ones it rejected.
    fn swap_edits(&mut self, step: u64, watcher: &Watcher) -> Result<()> {
        for update in watcher.poll() {
            match update {
                Update::Swapped { path, loaded, .. } => {
                    if let Loaded::Reward(r) = &loaded {
                        if let Err(error) = self.preview(step, r) {
                            let msg =
                                format!("{error} (on the last step's recorded turns); keeping the previous version");
                            self.bar.println(format!("step {step}: reload error: {msg}"));
                            self.run.event(step, "reload_error", &msg, error.fields())?;
                            continue;
                        }
                    }
                    let done = self.scripts.swap(&path, loaded);
                    let msg = format!("swapped in {} {} → {}", done.name, done.from, done.to);
                    self.run.event(step, "swap", &msg, Map::new())?;
                    self.bar.println(format!("step {step}: {msg}"));
                    self.run.record_scripts(step, &self.scripts.current)?;
                }
                Update::Rejected { error, .. } => {
                    let msg = format!("{error}; keeping the previous version");
                    self.bar.println(format!("step {step}: reload error: {msg}"));
                    self.run.event(step, "reload_error", &msg, error.fields())?;
                }
            }
        }
        Ok(())
    }

    /// An edited reward, before it is swapped in: the last finished step's trajectories
    /// re-scored through the edited chain, reported as a `reward_preview` event and a line. A
    /// version that fails on those turns is refused (its error, with the place, comes back).
    fn preview(&self, step: u64, edited: &RewardScript) -> Result<(), ScriptError> {
        let Some((on_step, lines)) = &self.last_lines else { return Ok(()) };
        let env = &self.scripts.current.env;
        let actions = env.info(&env.params_from(&self.exp.params)?)?.actions;
        let chain = with_edit(&self.scripts.current.rewards, edited);
        let preview = match Preview::of(*on_step, lines, &chain, &actions) {
            Ok(p) => p,
            Err(e) => {
                return Err(e
                    .downcast::<ScriptError>()
                    .unwrap_or_else(|e| ScriptError::new(&edited.script().name, format!("{e:#}"))))
            }
        };
        let msg = format!("reward preview of {} {}", edited.script().name, preview.summary());
        self.bar.println(format!("step {step}: {msg}"));
        let mut fields = preview.fields();
        fields.insert("script".into(), json!(edited.script().name));
        fields.insert("version".into(), json!(edited.version()));
        // Logging can fail only on the disk, which the next event write reports.
        let _ = self.run.event(step, "reward_preview", &msg, fields);
        Ok(())
    }

    /// The trainer split for a step's parts that may run at once: the player of episodes, the
    /// models the update trains (the same weights, read-only to the player), the scripts and the
    /// random stream.
    fn split(&mut self) -> (Player<'_>, Models<'_>, &mut LiveScripts, &mut Rng) {
        let Trainer { nets, engine, exp, s, run, bar, scripts, rng, version, updates, .. } = self;
        let player = Player {
            policy: &nets.policy,
            engine: engine.as_ref(),
            exp,
            s,
            run,
            bar,
            version: *version,
            updates: *updates,
        };
        let models = Models {
            policy: &nets.policy,
            critic: nets.critic.as_ref(),
            reference: nets.reference.as_ref(),
            actor_opt: &mut nets.actor_opt,
            critic_opt: nets.critic_opt.as_mut(),
        };
        (player, models, scripts, rng)
    }

    fn play(&mut self, step: u64) -> Result<Played> {
        let (player, _, scripts, rng) = self.split();
        player.play(step, scripts, rng)
    }

    fn report_skip(&self, step: u64, credit: &Credit) -> Result<()> {
        if credit.kept.is_empty() {
            let sp = &self.s.starpo;
            let msg = format!("the filter kept no group ({:?} of {:?}): update skipped", sp.filter, sp.filter_metric);
            self.run.event(step, "empty_filter", &msg, Map::new())?;
        } else if credit.no_signal {
            let msg = "every kept advantage is 0 or cancels (no reward variance in the kept groups, or each \
                       played one trajectory): update skipped";
            self.run.event(step, "no_signal", msg, Map::new())?;
        }
        Ok(())
    }

    /// The update on the kept trajectories. Under rollout.max_policy_lag = 1 the engines play the
    /// next step's episodes meanwhile, on the weights they hold (one update behind); those come
    /// back with the update's statistics.
    fn update(&mut self, step: u64, played: &Played, credit: &Credit) -> Result<(UpdateStats, Option<Played>)> {
        let items = credit.items(&played.trajs);
        let play_ahead =
            self.s.rollout.max_policy_lag > 0 && step < self.total() && !self.opts.stop.load(Ordering::SeqCst);
        let (player, models, scripts, rng) = self.split();
        let s = player.s;
        let (stats, next) = if play_ahead {
            let mut update_rng = Rng::new(rng.next_u64());
            let (stats, next) = std::thread::scope(|scope| {
                let worker = scope.spawn(|| (update(models, &items, s, &mut update_rng), phase::take()));
                let next = player.play(step + 1, scripts, rng);
                let (stats, clocks) = worker.join().map_err(|_| anyhow!("step {step}: the update thread panicked"))?;
                phase::add(&clocks);
                anyhow::Ok((stats, next))
            })?;
            (stats?, Some(next?))
        } else {
            (update(models, &items, s, rng)?, None)
        };
        if !credit.skipped() {
            self.version = step;
            self.updates += 1;
            if let Some(e) = self.engine.as_mut() {
                e.sync_policy(&self.nets.policy, &self.run.path.join("sync"), step)
                    .with_context(|| format!("step {step}: pushing the weights"))?;
            }
        }
        Ok((stats, next))
    }

    /// Requests to the engines that were retried since the last report.
    fn report_retries(&mut self, step: u64) -> Result<()> {
        let Some(n) = self.engine.as_ref().map(HttpEngine::retries).filter(|&n| n > self.retries_seen) else {
            return Ok(());
        };
        let new = n - self.retries_seen;
        let msg = format!("{new} requests to the engines were retried (busy, or the connection dropped)");
        self.bar.println(format!("step {step}: {msg}"));
        self.run.event(step, "engine_retry", &msg, Map::from_iter([("retries".to_string(), json!(new))]))?;
        self.retries_seen = n;
        Ok(())
    }

    /// The step's metrics line (with its alarms), its trajectories, TensorBoard and the bar.
    fn log(
        &mut self,
        step: u64,
        played: &Played,
        credit: &Credit,
        stats: &UpdateStats,
        cost: &Cost,
    ) -> Result<Map<String, Value>> {
        let trajs = &played.trajs;
        let skipped = credit.skipped();
        let mut line = rollout_metrics(step, trajs, &credit.stds, &credit.kept_groups);
        Key::Skipped.put(&mut line, f64::from(u8::from(skipped)));
        Key::EmptyAfterFilter.put(&mut line, f64::from(u8::from(credit.kept.is_empty())));
        Key::PolicyLag.put(&mut line, (self.updates_before(played, skipped)) as f64);
        if !skipped {
            update_metrics(&mut line, stats, self.nets.actor_opt.current_lr());
        }
        cost_metrics(&mut line, &self.nets.policy.model.cfg, trajs, (!skipped).then_some(&credit.kept[..]), cost);
        if self.s.echo.mi_every > 0 && step.is_multiple_of(self.s.echo.mi_every as u64) {
            if let Some(mi) = template_collapse_probe(&self.nets.policy, trajs, &credit.members, &self.s)? {
                line.extend(mi.to_metrics());
            }
        }
        let alarms = self.echo.observe(step, &line);
        record(&alarms, &mut line);
        for a in &alarms {
            self.run.event_value(&a.event(now()))?;
            self.bar.println(a.to_string());
            self.summary.alarms.push(a.to_string());
        }
        self.run.metrics(&line)?;
        self.tb.metrics(step, now(), &line)?;
        let mut adv = vec![0.0; trajs.len()];
        for (k, &i) in credit.kept.iter().enumerate() {
            adv[i] = stats.seq_advantage.get(k).copied().unwrap_or(0.0) as f64;
        }
        let lines: Vec<Value> = trajs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let kept = credit.kept.contains(&i);
                trajectory_line(step, Some(played.version), t, Some(credit.normed[i]), Some(adv[i]), kept)
            })
            .collect();
        self.run.rollouts(&format!("step-{step:06}"), &lines)?;
        let maps = lines.into_iter().filter_map(|l| if let Value::Object(m) = l { Some(m) } else { None });
        self.last_lines = Some((step, maps.collect()));
        self.bar.set_message(headline(&line));
        self.bar.inc(1);
        Ok(line)
    }

    /// The updates between the weights that played `played` and the ones it trains (counted
    /// before this step's own update).
    fn updates_before(&self, played: &Played, skipped: bool) -> u64 {
        self.updates - u64::from(!skipped) - played.updates
    }

    /// Collapsed onto one outcome or one answer (`no_variance`, `one_answer`): sample hotter
    /// before giving up, where stop.explore_temperature says so.
    fn explore(&mut self, step: u64, stopped: Option<Stopped>) -> Result<Option<Stopped>> {
        let hotter = stopped
            .as_ref()
            .filter(|x| x.kind == "no_variance" || x.kind == "one_answer")
            .and_then(|_| explore_temperature(&self.s.stop, self.s.rollout.temperature));
        let Some(t) = hotter else { return Ok(stopped) };
        let was = self.s.rollout.temperature;
        let message = format!(
            "no group's episodes scored differently for {} steps in a row: rollout.temperature {was} → {t} to explore (stop.explore_temperature = {})",
            self.s.stop.flat_steps, self.s.stop.explore_temperature
        );
        let fields = Map::from_iter([("from".to_string(), json!(was)), ("temperature".to_string(), json!(t))]);
        self.run.event(step, "explore", &message, fields)?;
        self.bar.println(format!("step {step}: {message}"));
        self.s.rollout.temperature = t;
        self.s.rollout.answer_temperature *= t / was;
        self.stops.reset_flat();
        Ok(None)
    }

    /// Validates at `step` (a live-edited script that fails on the validation's turns is rolled
    /// back and the validation replayed) and returns its success.
    fn validate(&mut self, step: u64) -> Result<f64> {
        let out = loop {
            let (player, _, scripts, _) = self.split();
            match player.validate(step, &scripts.current) {
                Ok(out) => break out,
                Err(e) => roll_back(e, scripts, player.run, step, player.bar)?,
            }
        };
        let success = Key::ValSuccess.get(&out).unwrap_or(0.0);
        self.summary.validations.push((step, out));
        Ok(success)
    }

    fn save(&mut self, step: u64, why: &str) -> Result<()> {
        let dir = self.nets.save(&self.run, step, &self.rng, self.s.train.keep_checkpoints)?;
        self.run.event(step, "checkpoint", &format!("saved {}{why}", dir.display()), Map::new())?;
        self.summary.checkpoint = Some(dir);
        Ok(())
    }

    /// An interrupted run saves the last step it finished, if no checkpoint holds it yet.
    fn finish(mut self, t_start: Instant) -> Result<Summary> {
        let last = self.summary.last_step;
        let saved = self.summary.checkpoint.as_ref().is_some_and(|c| c.ends_with(format!("step-{last:06}")));
        if self.summary.interrupted && last > self.start_step && !saved {
            self.save(last, " on interrupt")?;
        }
        self.bar.finish_and_clear();
        self.tb.flush()?;
        self.summary.seconds = t_start.elapsed().as_secs_f64();
        Ok(self.summary)
    }
}
