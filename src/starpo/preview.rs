//! A reward edit previewed on recorded turns before it takes effect: each trajectory of a
//! finished step re-scored turn by turn through the edited reward chain (the env's reward and
//! the parsed reply as they were recorded, so the re-score is what training would have given),
//! against the score it was trained with. A version that fails on one of those real turns is
//! refused here, before it is ever swapped in. Used live by the trainer and offline by
//! `ragen-lab check REWARD --against RUN[:STEP]`.
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::resume::RunRecord;
use crate::metrics::run::read_jsonl;
use crate::script::turn::ParsedTurn;
use crate::script::{shape_all, with_edit, EnvScript, Host, RewardScript, Script};

/// Trajectories listed in [`Preview::moved`].
const MOST_MOVED: usize = 3;

/// What an edited reward chain does to one step's trajectories.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Preview {
    /// The step whose trajectories were re-scored.
    pub on_step: u64,
    pub trajectories: usize,
    /// Mean score as trained, and through the edited chain.
    pub score_old: f64,
    pub score_new: f64,
    /// Share of successful episodes (the env decides success; a reward cannot change it).
    pub success: f64,
    /// Trajectories whose score changed.
    pub changed: usize,
    pub groups: usize,
    /// Groups in which some episode's advantage (its score less its group's mean) changes sign.
    pub groups_flipped: usize,
    /// The trajectories whose score moved most, largest first.
    pub moved: Vec<Moved>,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Moved {
    pub group: u64,
    pub episode: u64,
    pub old: f64,
    pub new: f64,
}

impl Preview {
    /// `lines` are the step's trajectory lines (docs/contracts.md "Trajectory line"); `chain`
    /// the edited reward chain, in order; `env_actions` the env's action names (what the chain
    /// sees as `turn.env_actions`). A reward script's failure on a turn is returned as its
    /// `ScriptError` (downcast it for the place).
    pub fn of(
        on_step: u64,
        lines: &[Map<String, Value>],
        chain: &[RewardScript],
        env_actions: &[String],
    ) -> Result<Self> {
        let mut scored = Vec::with_capacity(lines.len());
        for (k, line) in lines.iter().enumerate() {
            let at = || format!("trajectory {} of step {on_step}", k + 1);
            let field = |key: &str| line.get(key).ok_or_else(|| anyhow!("{}: no `{key}`", at()));
            let group = field("group")?.as_u64().ok_or_else(|| anyhow!("{}: `group` is not a number", at()))?;
            let old = field("score")?.as_f64().ok_or_else(|| anyhow!("{}: `score` is not a number", at()))?;
            let mut new = 0.0;
            for turn in field("turns")?.as_array().ok_or_else(|| anyhow!("{}: `turns` is not a list", at()))? {
                let parsed = parsed_turn(turn).with_context(at)?;
                let env_reward =
                    turn["env_reward"].as_f64().ok_or_else(|| anyhow!("{}: a turn has no env_reward", at()))?;
                new += shape_all(chain, &parsed, env_actions, env_reward)?;
            }
            let success = line.get("success").and_then(Value::as_bool).unwrap_or(false);
            let episode = line.get("episode").and_then(Value::as_u64).unwrap_or(k as u64);
            scored.push((group, episode, old, new, success));
        }
        let n = scored.len().max(1) as f64;
        let mut groups: Vec<u64> = scored.iter().map(|s| s.0).collect();
        groups.sort_unstable();
        groups.dedup();
        let sign = |x: f64| {
            if x.abs() < 1e-9 {
                0
            } else if x > 0.0 {
                1
            } else {
                -1
            }
        };
        let groups_flipped = groups
            .iter()
            .filter(|&&g| {
                let members: Vec<_> = scored.iter().filter(|s| s.0 == g).collect();
                let mean = |f: fn(&&(u64, u64, f64, f64, bool)) -> f64| {
                    members.iter().map(f).sum::<f64>() / members.len() as f64
                };
                let (old_mean, new_mean) = (mean(|s| s.2), mean(|s| s.3));
                members.iter().any(|s| sign(s.2 - old_mean) != sign(s.3 - new_mean))
            })
            .count();
        let mut moved: Vec<Moved> =
            scored.iter().map(|&(group, episode, old, new, _)| Moved { group, episode, old, new }).collect();
        moved.sort_by(|a, b| (b.new - b.old).abs().total_cmp(&(a.new - a.old).abs()));
        moved.retain(|m| m.new != m.old);
        moved.truncate(MOST_MOVED);
        Ok(Self {
            on_step,
            trajectories: scored.len(),
            score_old: scored.iter().map(|s| s.2).sum::<f64>() / n,
            score_new: scored.iter().map(|s| s.3).sum::<f64>() / n,
            success: scored.iter().filter(|s| s.4).count() as f64 / n,
            changed: scored.iter().filter(|s| s.2 != s.3).count(),
            groups: groups.len(),
            groups_flipped,
            moved,
        })
    }

    /// One line for the terminal.
    pub fn summary(&self) -> String {
        format!(
            "on step {}'s {} trajectories: mean score {:.3} → {:.3}, {} changed, advantages change sign in {} of {} groups",
            self.on_step, self.trajectories, self.score_old, self.score_new, self.changed, self.groups_flipped, self.groups
        )
    }

    /// The fields of a `reward_preview` event.
    pub fn fields(&self) -> Map<String, Value> {
        match json!(self) {
            Value::Object(m) => m,
            _ => Map::new(),
        }
    }
}

/// The parsed reply a reward script sees, from a recorded turn.
fn parsed_turn(turn: &Value) -> Result<ParsedTurn> {
    let text = |k: &str| turn[k].as_str().map(String::from);
    let list = |k: &str| -> Result<Vec<String>> {
        let items = turn[k].as_array().ok_or_else(|| anyhow!("a turn has no `{k}` list"))?;
        Ok(items.iter().filter_map(|a| a.as_str().map(String::from)).collect())
    };
    Ok(ParsedTurn {
        think: text("think"),
        answer: text("answer"),
        actions: list("actions")?,
        invalid_actions: list("invalid_actions")?,
        format_ok: turn["format_ok"].as_bool().ok_or_else(|| anyhow!("a turn has no `format_ok`"))?,
        response: text("response").unwrap_or_default(),
        opened: String::new(),
    })
}

/// `RUN` or `RUN:STEP` (the run's last recorded step when no step is given).
pub fn parse_against(spec: &str) -> (std::path::PathBuf, Option<u64>) {
    match spec.rsplit_once(':') {
        Some((run, step)) if !run.is_empty() && step.parse::<u64>().is_ok() => (run.into(), step.parse().ok()),
        _ => (spec.into(), None),
    }
}

/// The preview of `edited` on step `step` (default: the last) of the training run at `run`,
/// with the reward chain and env those trajectories were recorded with (from the run's
/// `scripts/`), the edited script in place of the one of the same name.
pub fn against(host: &std::sync::Arc<Host>, edited: &RewardScript, run: &Path, step: Option<u64>) -> Result<Preview> {
    let record = RunRecord::read(run)?;
    let rollouts = run.join("rollouts");
    let recorded: Vec<u64> = std::fs::read_dir(&rollouts)
        .with_context(|| format!("{}: no rollouts/ folder", run.display()))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("step-")?.strip_suffix(".jsonl")?.parse().ok())
        .collect();
    let step = match step.or_else(|| recorded.iter().max().copied()) {
        Some(s) if recorded.contains(&s) => s,
        Some(s) => bail!(
            "{} has no trajectories of step {s} (recorded: {})",
            run.display(),
            span(&recorded).unwrap_or_else(|| "none".into())
        ),
        None => bail!("{} has no training step recorded yet", run.display()),
    };
    let file = rollouts.join(format!("step-{step:06}.jsonl"));
    let lines = read_jsonl(&file)?;
    let first = lines.first().ok_or_else(|| anyhow!("{}: no trajectories", file.display()))?;
    let versions =
        first.get("versions").ok_or_else(|| anyhow!("{}: trajectories without script versions", file.display()))?;
    let index = read_jsonl(&run.join("scripts/index.jsonl"))?;
    let recorded_script = |hash: &str| -> Result<Arc<Script>> {
        let line = index
            .iter()
            .find(|l| l.get("hash").and_then(Value::as_str) == Some(hash))
            .ok_or_else(|| anyhow!("{}: scripts/index.jsonl does not list version {hash}", run.display()))?;
        let name = line.get("path").and_then(Value::as_str).unwrap_or_default();
        let source = std::fs::read_to_string(run.join("scripts").join(format!("{hash}.rhai")))
            .with_context(|| format!("{}: the recorded version {hash} of {name}", run.display()))?;
        Ok(host.compile_source(&host.project().join(name), &source)?)
    };
    let hash = |v: &Value| {
        v.as_str().map(String::from).ok_or_else(|| anyhow!("{}: a script version is not a string", file.display()))
    };
    let env = EnvScript::from_script(recorded_script(&hash(&versions["env"])?)?)?;
    let chain = versions["rewards"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|h| Ok(RewardScript::from_script(recorded_script(&hash(h)?)?)?))
        .collect::<Result<Vec<_>>>()?;
    let actions = env.info(&env.params_from(&record.params)?)?.actions;
    Preview::of(step, &lines, &with_edit(&chain, edited), &actions)
}

/// `1–12`, or the steps listed where they have gaps.
fn span(steps: &[u64]) -> Option<String> {
    let (lo, hi) = (*steps.iter().min()?, *steps.iter().max()?);
    Some(if hi - lo + 1 == steps.len() as u64 { format!("{lo}–{hi}") } else { format!("{steps:?}") })
}
