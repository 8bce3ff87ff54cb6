//! `ragen-lab check`: everything a script must pass before training uses it, reported as
//! `path:line:col: problem` with a nonzero exit status when anything fails. The checks live in
//! `script::check`; this file adds the settings check (as `train` would resolve them).
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::script::check::{check_turn, ScriptCheck};
use crate::script::turn::TurnSettings;
use crate::script::{parse_assignment, Experiment, Host, Limits, RewardScript};
use crate::starpo::preview;
use crate::starpo::resume::resolve_settings;
use crate::starpo::settings::{Preset, Settings};

/// Check a script: it compiles, defines the functions its role needs (env, prompt template,
/// reward shaping or experiment: told apart by its functions), and runs under the sandbox
/// limits. An env also plays many random episodes, and must give the same episode for the same
/// seed twice. An experiment checks the scripts it names.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The script to check.
    pub script: PathBuf,
    /// Random episodes to play (envs).
    #[arg(long, default_value_t = 100)]
    pub episodes: u64,
    /// Override an env parameter (repeatable), e.g. --param size=8.
    #[arg(long = "param", value_name = "KEY=VALUE")]
    pub params: Vec<String>,
    /// Run a reward script (or an experiment's reward scripts, on its env) on a turn you wrote:
    /// a JSON file `{"response": "<think>…</think><answer>Up || Left</answer>", …}` (README,
    /// "Testing a reward script"); prints the parsed turn and the reward after each script.
    #[arg(long, value_name = "FILE.json")]
    pub turn: Option<PathBuf>,
    /// Preview a reward script on a training run's recorded trajectories: re-score step STEP
    /// (default: the last) turn by turn with this script in place of the run's script of the
    /// same path, and print mean score before → after, how many scores changed, the groups
    /// whose advantages change sign and the trajectories that moved most (as JSON). What a
    /// running `train` reports as a `reward_preview` event when a reward script is edited.
    #[arg(long, value_name = "RUN[:STEP]", conflicts_with = "turn")]
    pub against: Option<String>,
}

/// The settings as `train` would resolve them for `x` (default preset, no flags).
fn settings_of(x: &Experiment) -> Result<Settings, String> {
    resolve_settings(Preset::StarpoS, None, &x.settings, &x.path, &[]).map_err(|e| format!("{e:#}"))
}

/// How `train` would parse and play `x`'s turns.
pub fn turn_settings(x: &Experiment) -> Result<TurnSettings, String> {
    Ok(TurnSettings::from(&settings_of(x)?.rollout))
}

/// Every check of `path` (`script::check::check`) plus, for an experiment, its settings as
/// `train` would resolve them: one line per script checked.
pub fn check(
    host: &std::sync::Arc<Host>,
    path: &std::path::Path,
    episodes: u64,
    overrides: &[(String, String)],
) -> Vec<ScriptCheck> {
    crate::script::check::check(host, path, episodes, overrides, &|x| settings_of(x).map(drop))
}

pub fn run(args: Args) -> Result<()> {
    let host = Host::for_script(&args.script, Limits::from_env()?);
    let overrides =
        args.params.iter().map(|p| parse_assignment(p).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
    if let Some(spec) = &args.against {
        let (run, step) = preview::parse_against(spec);
        let edited = RewardScript::load(&host, &args.script)?;
        let p = preview::against(&host, &edited, &run, step)
            .with_context(|| format!("previewing {} on {spec}", args.script.display()))?;
        eprintln!("{}: {}", args.script.display(), p.summary());
        println!("{}", serde_json::to_string_pretty(&p)?);
        return Ok(());
    }
    if let Some(turn) = &args.turn {
        let text =
            std::fs::read_to_string(turn).map_err(|e| anyhow::anyhow!("reading --turn {}: {e}", turn.display()))?;
        let report = check_turn(&host, &args.script, &text, &overrides, &turn_settings)
            .map_err(|e| anyhow::anyhow!("{}: {e}", turn.display()))?;
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let mut problems = 0;
    for line in check(&host, &args.script, args.episodes, &overrides) {
        match line {
            Ok(l) => println!("{l}"),
            Err(e) => {
                problems += 1;
                println!("{e}");
            }
        }
    }
    if problems > 0 {
        bail!("check found {problems} problem(s) in {}", args.script.display());
    }
    Ok(())
}
