//! `ragen-lab play`: play an environment script by hand, or with a list of actions. With
//! `--json`, one JSON object per line (a public contract, tested in tests/script_host.rs):
//! `{"event":"reset","seed":S,"obs":…,"env":…,"version":…,"actions":[…]}` then per action
//! `{"event":"step","action":…,"reward":…,"done":…,"success":…,"valid":…,"effective":…,"obs":…}`,
//! stopping at done. With `--watch`, an edit to the script replays the episode on the new
//! version; a broken edit prints its `path:line:col` and play goes on with the old one.
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

use anyhow::{Context, Result};
use serde_json::{json, Map, Value};

use crate::script::{parse_assignment, EnvScript, Experiment, Host, Limits, Loaded, Role, Update, WatchMode, Watcher};

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
    /// Comma-separated actions to play in order instead of asking, e.g. "Up,Up,Left".
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

    /// Resets and plays `actions`; returns the episode and whether it finished.
    fn replay(&self, seed: u64, stream: u64, actions: &[String]) -> Result<(crate::script::Episode, bool)> {
        let mut ep = self.env.reset(seed, stream, &self.params)?;
        let obs = ep.render()?;
        let valid = ep.valid_actions()?;
        self.emit(
            json!({"event": "reset", "seed": seed, "stream": stream, "env": self.env.name(), "version": self.env.version(),
                   "params": self.params, "actions": valid, "obs": obs}),
            format!("{} (version {}), seed {seed}\n{obs}", self.env.name(), self.env.version()),
        );
        for a in actions {
            if self.step(&mut ep, a)? {
                return Ok((ep, true));
            }
        }
        Ok((ep, false))
    }

    /// Plays one action; returns whether the episode is done.
    fn step(&self, ep: &mut crate::script::Episode, action: &str) -> Result<bool> {
        let out = ep.step(action)?;
        let obs = ep.render()?;
        self.emit(
            json!({"event": "step", "action": action, "reward": out.reward, "done": out.done, "success": out.success,
                   "valid": out.valid, "effective": out.effective, "obs": obs}),
            format!(
                "> {action}: reward {}{}{}{}\n{obs}",
                out.reward,
                if out.valid { "" } else { " (invalid)" },
                if out.effective || !out.valid { "" } else { " (no effect)" },
                if out.done {
                    if out.success {
                        ", done: success"
                    } else {
                        ", done"
                    }
                } else {
                    ""
                },
            ),
        );
        Ok(out.done)
    }
}

pub fn run(args: Args) -> Result<()> {
    let host = Host::for_script(&args.env, Limits::from_env().map_err(anyhow::Error::msg)?);
    let mut overrides = Vec::new();
    for p in &args.params {
        overrides.push(parse_assignment(p).map_err(anyhow::Error::msg)?);
    }
    let (env_path, base) = match Role::detect(&host, &args.env)? {
        Role::Experiment => {
            let x = Experiment::load(&host, &args.env)?;
            (x.env.clone(), x.params.clone())
        }
        _ => (args.env.clone(), Map::new()),
    };
    let env = EnvScript::load(&host, &env_path)?;
    let defaults = env.params_from(&base)?;
    let params = crate::script::params::apply(env.name(), &defaults, &overrides).map_err(anyhow::Error::msg)?;
    let mut game = Game { env, params, json: args.json };
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
            eprint!("{}", if done { "(done; edit the script to replay, empty line quits) " } else { "action> " });
        }
    };
    prompt(done);
    loop {
        if let Some(w) = &watcher {
            for u in w.poll() {
                match u {
                    Update::Swapped { loaded: Loaded::Env(env), .. } => {
                        eprintln!("reloaded {} (version {})", env.name(), env.version());
                        game.env = env;
                        (ep, done) = game.replay(args.seed, args.stream, &played)?;
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
            played.push(action.to_string());
            done = game.step(&mut ep, action).with_context(|| format!("playing {action:?}"))?;
        }
        prompt(done);
    }
}
