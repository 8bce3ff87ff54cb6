//! `ragen-lab new NAME`: writes a commented starter environment (`envs/NAME.rhai`) and an
//! experiment (`scripts/NAME.rhai`) that pass `ragen-lab check`.
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

/// Write a commented starter environment (envs/NAME.rhai) and experiment (scripts/NAME.rhai)
/// to edit into your own task. Both pass `ragen-lab check` as written.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The env's name: lowercase letters, digits and underscores.
    pub name: String,
    /// The project directory to write into (holds envs/ and scripts/).
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
}

/// The starter env; `NAME` is replaced by the env's name.
pub const ENV_TEMPLATE: &str = r#"// NAME: a starter environment. A corridor of cells; walk to the goal `G`.
// Try it:  ragen-lab play --env envs/NAME.rhai      Check it:  ragen-lab check envs/NAME.rhai
//
// An env is five plain functions over one state map. The host calls them; nothing else runs.
// Randomness comes only from rng:: (rng::int(lo, hi), rng::below(n), rng::float(),
// rng::chance(p), rng::pick(array), rng::shuffle(array)): in reset it is seeded by the episode's
// seed, so a seed always gives the same start; in step each episode has its own stream.

// Parameters and their defaults; override with --param length=9.
fn params() {
    #{ length: 7, slip: 0.1 }
}

// What the env is: its name, the task, the symbols, the action names and its limits.
fn describe(params) {
    #{
        name: "NAME",
        instruction: "You walk along a corridor. Reach the goal.",
        legend: "P: you, _: floor, G: goal",
        actions: ["Left", "Right"],
        max_turns: 3,              // model responses per episode
        max_actions_per_turn: 3,   // actions in one response ("Left || Left")
        max_actions: 9,            // env steps per episode
    }
}

// The start state, from the seed. Return a map; step will change it.
fn reset(seed, params) {
    let goal = rng::below(params.length);
    let player = goal;
    while player == goal { player = rng::below(params.length); }
    #{ length: params.length, slip: params.slip, player: player, goal: goal }
}

// The observation the model reads.
fn render(state) {
    let text = "";
    for i in 0..state.length {
        text += if i == state.player { "P" } else if i == state.goal { "G" } else { "_" };
    }
    text
}

// One action: change `state` in place and say what happened.
//   reward (number) and done (bool) are required;
//   success, valid and effective (bools) are optional (false, true, and valid).
fn step(state, action) {
    let dir = switch action.to_lower() { "left" => -1, "right" => 1, _ => 0 };
    if dir == 0 {
        return #{ reward: 0.0, done: false, valid: false };
    }
    if rng::chance(state.slip) { dir = -dir; }   // the floor is a little slippery
    let before = state.player;
    state.player = (state.player + dir).max(0).min(state.length - 1);
    let arrived = state.player == state.goal;
    #{ reward: if arrived { 1.0 } else { -0.1 }, done: arrived, success: arrived, effective: state.player != before }
}

// Optional: the actions legal now (defaults to describe's `actions`); constrained answers name
// only these. An action may take a value: "pay {money}", "goto {digits}" (README, "Actions
// with arguments"); list such patterns in describe's `actions` too.
fn valid_actions(state) {
    ["Left", "Right"]
}
"#;

/// The starter experiment; `NAME` is replaced by the env's name.
pub const EXPERIMENT_TEMPLATE: &str = r#"// Train on envs/NAME.rhai:  ragen-lab train --env scripts/NAME.rhai
// `settings` keys are listed by `ragen-lab settings`; anything left out keeps its default.

fn experiment() {
    #{
        env: "envs/NAME.rhai",
        prompt: "prompts/ragen.rhai",
        rewards: ["rewards/format_penalty.rhai"],
        params: #{ length: 7 },
        // A held-out variant to validate on (or () for none).
        val_params: #{ length: 9 },
        // The shipped Bandit experiment's settings (docs/training.md says why): no-think answers
        // constrained to the state's legal actions, GRPO without the std division, no critic.
        settings: #{
            rollout: #{ env_groups: 4, group_size: 8, response_length: 32, think: false, constrain_actions: true },
            starpo: #{ advantage: "grpo", reward_norm: "identity", norm_adv_by_std_in_grpo: false },
            optim: #{ lr: 1e-5 },
            train: #{ steps: 20, val_every: 5, val_groups: 16 },
        },
    }
}
"#;

const PROMPT: &str = include_str!("../../prompts/ragen.rhai");
const FORMAT_PENALTY: &str = include_str!("../../rewards/format_penalty.rhai");

/// Writes the two files (and the shipped prompt and format penalty where the project lacks them); fails rather than overwrite.
pub fn write_starter(dir: &std::path::Path, name: &str) -> Result<Vec<PathBuf>> {
    if name.is_empty() || !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_') {
        bail!("new {name:?}: use lowercase letters, digits and underscores, e.g. `ragen-lab new maze`");
    }
    let files = [
        (dir.join("envs").join(format!("{name}.rhai")), ENV_TEMPLATE),
        (dir.join("scripts").join(format!("{name}.rhai")), EXPERIMENT_TEMPLATE),
    ];
    for (path, _) in &files {
        if path.exists() {
            bail!("{} already exists; pick another name or delete it first", path.display());
        }
    }
    let mut written = Vec::new();
    // The experiment names the shipped prompt and format penalty: provide them where missing.
    let shared = [("prompts/ragen.rhai", PROMPT), ("rewards/format_penalty.rhai", FORMAT_PENALTY)];
    let missing = shared.into_iter().filter(|(p, _)| !dir.join(p).exists()).map(|(p, t)| (dir.join(p), t));
    for (path, text) in
        files.into_iter().map(|(p, t)| (p, t.replace("NAME", name))).chain(missing.map(|(p, t)| (p, t.to_string())))
    {
        let parent = path.parent().unwrap_or(dir);
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        written.push(path);
    }
    Ok(written)
}

pub fn run(args: Args) -> Result<()> {
    for p in write_starter(&args.dir, &args.name)? {
        println!("wrote {}", p.display());
    }
    println!(
        "next: ragen-lab play --env {0}  and  ragen-lab check {0}",
        args.dir.join("envs").join(format!("{}.rhai", args.name)).display()
    );
    Ok(())
}
