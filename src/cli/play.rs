//! `ragen-lab play`: play an environment script by hand, or with a list of actions. With
//! `--json`, one JSON object per line (a public contract, tested in tests/script_host.rs):
//! `{"event":"reset","seed":S,"obs":…,"env":…,"version":…,"actions":[…]}` then per action
//! `{"event":"step","action":…,"reward":…,"done":…,"success":…,"valid":…,"effective":…,"obs":…}`,
//! stopping at done. Each typed line (or `--actions` item) is one turn's answer, played through
//! the rollout's own code (`script::turn`): pieces split on `||`, matched case-insensitively to
//! the env's action names, unknown ones dropped, at most `max_actions_per_turn` per turn and
//! `max_actions` per episode (the episode is done when they are spent). With `--watch`, an edit
//! to the script replays the episode on the new version; a broken edit, or one that fails during
//! the replay or a later action, prints its `path:line:col` and play goes on with the old one.
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

use super::check::turn_settings;
use crate::script::turn::{apply_turn, TurnLimits, TurnSettings};
use crate::script::{
    parse_assignment, EnvInfo, EnvScript, Episode, Experiment, Host, Limits, Loaded, Role, Update, WatchMode, Watcher,
};

/// Play an environment script: shows the observation and asks for an action (type `?` for the
/// valid actions, an empty line to quit), or plays `--actions` in order.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The environment script (envs/NAME.rhai), or an experiment script (its env and params).
    #[arg(long, value_name = "SCRIPT")]
    pub env: PathBuf,
    /// Episode seed: the start state comes from it.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Episode stream: the randomness of steps (slips, payouts) for this seed.
    #[arg(long, default_value_t = 0)]
    pub stream: u64,
    /// Override an env parameter (repeatable), e.g. --param size=8 --param names=A,B.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Comma-separated answers to play in order instead of asking, one turn each, e.g.
    /// "Up,Up,Left" or "Up || Up,Left".
    #[arg(long, value_name = "A,B,…")]
    pub actions: Option<String>,
    /// Print one JSON object per line (reset, then one per step).
    #[arg(long)]
    pub json: bool,
    /// Reload the script when it changes and replay the episode on the new version.
    #[arg(long)]
    pub watch: bool,
    /// With --watch: re-read files every 300 ms instead of using OS file events.
    #[arg(long)]
    pub poll: bool,
}

struct Game {
    env: EnvScript,
    params: Map<String, Value>,
    /// An experiment's rollout settings (the training defaults for a bare env).
    settings: TurnSettings,
    json: bool,
}

impl Game {
    fn emit(&self, v: Value, text: String) {
        if self.json {
            println!("{v}");
        } else {
            // A script's text reaches a terminal: escape control characters (JSON escapes its own).
            println!("{}", crate::script::printable(&text));
        }
        let _ = std::io::stdout().flush();
    }

    /// The env's description and the limits turns are played under, for the current version.
    fn rules(&self) -> Result<(EnvInfo, TurnLimits)> {
        let info = self.env.info(&self.params)?;
        let limits = TurnLimits::resolve(&info, self.settings.max_actions, self.settings.max_actions_per_turn);
        Ok((info, limits))
    }

    /// Resets and plays `turns`; returns the episode and whether it finished.
    fn replay(&self, seed: u64, stream: u64, turns: &[String]) -> Result<(Episode, bool)> {
        let mut ep = self.env.reset(seed, stream, &self.params)?;
        let obs = ep.render()?;
        let valid = ep.valid_actions()?;
        self.emit(
            json!({"event": "reset", "seed": seed, "stream": stream, "env": self.env.name(), "version": self.env.version(),
                   "params": self.params, "actions": valid, "obs": obs}),
            format!("{} (version {}), seed {seed}\n{obs}", self.env.name(), self.env.version()),
        );
        for answer in turns {
            if self.turn(&mut ep, answer)? {
                return Ok((ep, true));
            }
        }
        Ok((ep, false))
    }

    /// Plays one turn's answer (`a || b`) as the rollout would; returns whether the episode is
    /// done (the env said so, or its action budget is spent).
    fn turn(&self, ep: &mut Episode, answer: &str) -> Result<bool> {
        let (info, limits) = self.rules()?;
        // The typed line is the answer alone: parse it as a no-think response.
        let parsed = limits.parse(&format!("<answer>{answer}</answer>"), &info, false);
        for piece in &parsed.invalid_actions {
            eprintln!("dropped {piece:?}: not an action of this env ({})", info.actions.join(", "));
        }
        let applied = apply_turn(ep, &parsed, limits.max_actions, |ep, action, out| {
            let obs = ep.render()?;
            let done = out.done || ep.steps >= limits.max_actions;
            self.emit(
                json!({"event": "step", "action": action, "reward": out.reward, "done": done, "success": out.success,
                       "valid": out.valid, "effective": out.effective, "obs": obs}),
                format!(
                    "> {action}: reward {}{}{}{}\n{obs}",
                    out.reward,
                    if out.valid { "" } else { " (invalid)" },
                    if out.effective || !out.valid { "" } else { " (no effect)" },
                    match (done, out.success) {
                        (true, true) => ", done: success".to_string(),
                        (true, false) if !out.done =>
                            format!(", done: the {} actions of the episode are spent", limits.max_actions),
                        (true, false) => ", done".to_string(),
                        _ => String::new(),
                    },
                ),
            );
            Ok(())
        })?;
        if !applied.dropped.is_empty() {
            eprintln!("dropped {}: the episode is over", applied.dropped.join(", "));
        }
        Ok(applied.done)
    }
}

pub fn run(args: Args) -> Result<()> {
    let host = Host::for_script(&args.env, Limits::from_env()?);
    let mut overrides = Vec::new();
    for p in &args.params {
        overrides.push(parse_assignment(p).map_err(anyhow::Error::msg)?);
    }
    let (env_path, base, settings) = match Role::detect(&host, &args.env)? {
        Role::Experiment => {
            let x = Experiment::load(&host, &args.env)?;
            let settings = turn_settings(&x).map_err(anyhow::Error::msg)?;
            (x.env.clone(), x.params.clone(), settings)
        }
        _ => (args.env.clone(), Map::new(), TurnSettings::from(&crate::agent::settings::Rollout::default())),
    };
    let env = EnvScript::load(&host, &env_path)?;
    let defaults = env.params_from(&base)?;
    let params = crate::script::params::apply(env.name(), &defaults, &overrides).map_err(anyhow::Error::msg)?;
    let mut game = Game { env, params, settings, json: args.json };
    let scripted: Vec<String> = args
        .actions
        .as_deref()
        .map(|a| a.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect())
        .unwrap_or_default();

    let watcher = if args.watch {
        let mode = if args.poll { WatchMode::Poll(Duration::from_millis(300)) } else { WatchMode::Events };
        Some(Watcher::new(host.clone(), vec![(env_path.clone(), Role::Env, game.params.clone())], mode)?)
    } else {
        None
    };

    let mut played: Vec<String> = scripted.clone();
    let (mut ep, mut done) = game.replay(args.seed, args.stream, &scripted)?;
    if args.actions.is_some() && watcher.is_none() {
        return Ok(());
    }

    // Lines from stdin arrive on a channel, so a watcher can be polled while we wait.
    let (lines_tx, lines) = channel::<Option<String>>();
    let interactive = args.actions.is_none();
    if interactive {
        std::thread::spawn(move || {
            let stdin = std::io::stdin();
            for line in stdin.lock().lines() {
                if lines_tx.send(line.ok()).is_err() {
                    return;
                }
            }
            let _ = lines_tx.send(None);
        });
    }
    let prompt = |done: bool| {
        if interactive && !args.json {
            let over = if args.watch {
                "(done; edit the script to replay, empty line quits) "
            } else {
                "(done; empty line quits) "
            };
            eprint!("{}", if done { over } else { "action> " });
        }
    };
    prompt(done);
    loop {
        if let Some(w) = &watcher {
            for u in w.poll() {
                match u {
                    Update::Swapped { loaded: Loaded::Env(env), .. } => {
                        eprintln!("reloaded {} (version {})", env.name(), env.version());
                        let old = std::mem::replace(&mut game.env, env);
                        match game.replay(args.seed, args.stream, &played) {
                            Ok(replayed) => (ep, done) = replayed,
                            Err(e) => {
                                // A version that compiles may still fail on this episode: say
                                // where, and go on with the one that worked.
                                eprintln!("the new version failed replaying the episode, keeping the old one:\n{e:#}");
                                game.env = old;
                            }
                        }
                        prompt(done);
                    }
                    Update::Rejected { error, .. } => eprintln!("reload rejected, keeping the old version:\n{error}"),
                    Update::Swapped { .. } => {}
                }
            }
        }
        if !interactive {
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let line = match lines.recv_timeout(Duration::from_millis(100)) {
            Ok(Some(l)) => l,
            Ok(None) | Err(RecvTimeoutError::Disconnected) => return Ok(()),
            Err(RecvTimeoutError::Timeout) => continue,
        };
        let action = line.trim();
        if action.is_empty() {
            return Ok(());
        }
        if action == "?" {
            eprintln!("valid actions: {}", ep.valid_actions()?.join(", "));
        } else if done {
            eprintln!("the episode is over");
        } else {
            // Kept even when it fails, so that a fixed version replays it.
            played.push(action.to_string());
            match game.turn(&mut ep, action).with_context(|| format!("playing {action:?}")) {
                Ok(d) => done = d,
                // Under --watch, a failing action is the script's bug: report it, keep playing,
                // and let the fixed version replay the episode.
                Err(e) if watcher.is_some() => eprintln!("{e:#}"),
                Err(e) => return Err(e),
            }
        }
        prompt(done);
    }
}
