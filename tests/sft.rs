//! Warm start from solvers (issue 12): the FrozenLake and Sokoban solvers' paths reach success
//! when played through `apply_turn`, within the sandbox's default limits; solver demonstrations
//! are in the experiment's own format and parse back as valid actions; a short SFT on the tiny
//! model lowers the demonstrations' NLL, and the saved folder loads with the same log-probs; the
//! `sft` command writes a model that `train --model` starts from.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use candle_core::Device;
use ragen_lab::agent::demo::{answer_text, demonstrations, Demo};
use ragen_lab::agent::pack::Packed;
use ragen_lab::policy::{Policy, TokenBatch};
use ragen_lab::rng::Rng;
use ragen_lab::script::turn::{apply_turn, parse_turn};
use ragen_lab::script::{EnvScript, Episode, Experiment, Host, Limits};
use ragen_lab::starpo::optim::AdamW;
use ragen_lab::starpo::resume::resolve_settings;
use ragen_lab::starpo::settings::{Preset, Settings};
use ragen_lab::starpo::sft::{fine_tune, nll, LrSchedule};
use serde_json::{Map, Value};

const BIN: &str = env!("CARGO_BIN_EXE_ragen-lab");

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn host() -> Arc<Host> {
    Host::new(repo(), Limits::default())
}

fn env_with(name: &str, overrides: &[(&str, &str)]) -> (EnvScript, Map<String, Value>) {
    let env = EnvScript::load(&host(), Path::new(&format!("envs/{name}.rhai"))).unwrap();
    let o: Vec<(String, String)> = overrides.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let params = env.params(&o).unwrap();
    (env, params)
}

/// Plays `path` as one turn through the rollout's `apply_turn`; returns whether it succeeded.
fn play(ep: &mut Episode, path: &[String], names: &[String]) -> bool {
    let turn = parse_turn(&answer_text(path, path, false), names, path.len(), false);
    assert!(turn.format_ok && turn.invalid_actions.is_empty(), "{turn:?}");
    assert_eq!(turn.actions, path);
    let applied = apply_turn(ep, &turn, usize::MAX, |_, _, _| Ok(())).unwrap();
    assert!(applied.dropped.is_empty(), "the episode ended before the path did: {path:?}");
    applied.success
}

#[test]
fn the_frozenlake_solver_walks_to_the_goal_on_ice_that_does_not_slip() {
    let (env, params) = env_with("frozenlake", &[("slippery", "false")]);
    let names = env.info(&params).unwrap().actions;
    for seed in 0..20 {
        let mut ep = env.reset(seed, 0, &params).unwrap();
        let path = ep.solve().unwrap().expect("frozenlake defines solve");
        assert!(!path.is_empty(), "seed {seed}: the map generator guarantees a path");
        assert!(play(&mut ep, &path, &names), "seed {seed}: {path:?} did not reach the goal");
        assert_eq!(ep.solve().unwrap(), Some(vec![]), "at the goal there is nothing left to do");
    }
    // gymnasium's 4x4 map: the shortest path is 6 moves.
    let (env, params) = env_with("frozenlake", &[("slippery", "false"), ("map", "SFFF,FHFH,FFFH,HFFG")]);
    let mut ep = env.reset(0, 0, &params).unwrap();
    let path = ep.solve().unwrap().unwrap();
    assert_eq!(path.len(), 6, "{path:?}");
    assert!(play(&mut ep, &path, &names));
}

#[test]
fn the_sokoban_solver_solves_generated_levels_within_the_sandbox_limits() {
    let (env, params) = env_with("sokoban", &[]);
    let names = env.info(&params).unwrap().actions;
    for seed in 0..20 {
        let mut ep = env.reset(seed, 0, &params).unwrap();
        let path = ep.solve().unwrap().expect("sokoban defines solve");
        assert!(!path.is_empty(), "seed {seed}: reverse play makes every level solvable");
        assert!(play(&mut ep, &path, &names), "seed {seed}: {path:?} did not solve\n{}", ep.render().unwrap());
    }
    // A fixed level: one push right; and a box stuck in a corner has no solution.
    let (env, params) = env_with("sokoban", &[("level", "#####,#PXO#,#####")]);
    let ep = env.reset(0, 0, &params).unwrap();
    assert_eq!(ep.solve().unwrap(), Some(vec!["Right".to_string()]));
    let (env, params) = env_with("sokoban", &[("level", "######,#X_PO#,######")]);
    assert_eq!(env.reset(0, 0, &params).unwrap().solve().unwrap(), Some(vec![]));
    // LargerSokoban (8x8, two boxes) stays within the limits: a solution or [] when it runs out.
    let (env, params) = env_with("sokoban", &[("size", "8"), ("boxes", "2")]);
    for seed in 0..3 {
        let mut ep = env.reset(seed, 0, &params).unwrap();
        let path = ep.solve().unwrap().unwrap();
        if !path.is_empty() {
            assert!(play(&mut ep, &path, &names), "8x8 seed {seed}: {path:?}");
        }
    }
}

/// The experiment's scripts and settings (with `sets`), as `sft` resolves them.
fn experiment(script: &str, sets: &[&str]) -> (ragen_lab::script::ExperimentScripts, Map<String, Value>, Settings) {
    let host = host();
    let exp = Experiment::load(&host, Path::new(script)).unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let s = resolve_settings(Preset::StarpoS, None, &exp.settings, &exp.path, &sets).unwrap();
    let scripts = exp.scripts(&host).unwrap();
    let params = scripts.env.params_from(&exp.params).unwrap();
    (scripts, params, s)
}

fn demos(policy: &Policy, script: &str, sets: &[&str], n: u64) -> (Vec<Demo>, Settings) {
    let (scripts, params, s) = experiment(script, sets);
    let seeds: Vec<u64> = (100..100 + n).collect();
    let (demos, stats) = demonstrations(policy, &scripts, &params, &seeds, &s.rollout, |_| {}).unwrap();
    assert_eq!(stats.episodes + stats.unsolvable, n as usize);
    assert_eq!((stats.format_errors, stats.invalid_actions), (0, 0), "{stats:?}");
    (demos, s)
}

#[test]
fn demonstrations_are_in_the_experiments_format_and_parse_back_as_valid_actions() {
    let policy = Policy::load("tiny-llama", &Device::Cpu).unwrap();
    for (script, sets) in [
        ("scripts/frozenlake.rhai", vec![]),
        ("scripts/sokoban.rhai", vec![]),
        ("scripts/sokoban.rhai", vec!["rollout.think=true", "rollout.max_turns=5", "rollout.max_actions_per_turn=5"]),
    ] {
        let (demos, s) = demos(&policy, script, &sets, 6);
        assert!(!demos.is_empty());
        let (scripts, params, _) = experiment(script, &sets);
        let info = scripts.env.info(&params).unwrap();
        let k =
            if s.rollout.max_actions_per_turn > 0 { s.rollout.max_actions_per_turn } else { info.max_actions_per_turn };
        let max_turns = if s.rollout.max_turns > 0 { s.rollout.max_turns } else { info.max_turns };
        for d in &demos {
            assert!(d.turns.len() <= max_turns);
            for t in &d.turns {
                let parsed = parse_turn(&t.response, &info.actions, k, s.rollout.think);
                assert!(parsed.format_ok && !parsed.penalized(), "{script}: {:?}", t.response);
                assert!(!parsed.actions.is_empty() && parsed.actions.len() <= k);
                assert_eq!(parsed.actions, t.actions);
                assert_eq!(parsed.think.is_some(), s.rollout.think);
                if s.rollout.think {
                    assert!(t.response.starts_with("Shortest path: "), "{}", t.response);
                }
            }
            // The loss covers exactly the answers: one assistant run per turn shown.
            assert_eq!(d.packed.turn_ends.len(), d.turns.len());
            let answers = policy.decode(&masked(&d.packed)).unwrap();
            assert!(answers.contains("</answer>"), "{answers}");
            assert!(!answers.contains("State:"), "user text in the loss: {answers}");
        }
    }
    // With room for the whole solution, the deterministic env is always solved.
    let (demos, _) = demos(
        &policy,
        "scripts/sokoban.rhai",
        &["rollout.max_turns=5", "rollout.max_actions_per_turn=5", "rollout.max_actions=25"],
        6,
    );
    assert!(demos.iter().all(|d| d.success), "{:?}", demos.iter().map(|d| d.success).collect::<Vec<_>>());
}

fn masked(p: &Packed) -> Vec<u32> {
    p.ids.iter().zip(&p.mask).filter(|(_, &m)| m).map(|(&id, _)| id).collect()
}

#[test]
fn the_cosine_schedule_falls_from_the_peak_towards_zero_and_constant_stays() {
    let rates: Vec<f64> = (0..10).map(|i| LrSchedule::Cosine.at(1e-4, i, 10)).collect();
    assert_eq!(rates[0], 1e-4);
    assert!((rates[5] - 0.5e-4).abs() < 1e-12, "half way: {}", rates[5]);
    assert!(rates.windows(2).all(|w| w[1] < w[0]) && rates[9] > 0.0 && rates[9] < 0.03e-4, "{rates:?}");
    assert!((0..10).all(|i| LrSchedule::Constant.at(1e-4, i, 10) == 1e-4));
}

#[test]
fn a_short_sft_lowers_the_demonstrations_nll_and_the_saved_folder_gives_the_same_logprobs() {
    let policy = Policy::load("tiny-llama", &Device::Cpu).unwrap();
    let (demos, mut s) = demos(&policy, "scripts/frozenlake.rhai", &[], 8);
    let seqs: Vec<&Packed> = demos.iter().map(|d| &d.packed).collect();
    s.optim.mini_batch_size = 4;
    let before = nll(&policy, &seqs, s.optim.micro_batch_size).unwrap();
    let mut opt = AdamW::new(policy.model.trainable_vars(), 1e-3, &s.optim).unwrap();
    let mut steps = 0;
    let epochs =
        fine_tune(&policy, &mut opt, &seqs, &s.optim, 3, LrSchedule::Cosine, &mut Rng::new(0), |_, _, _| steps += 1)
            .unwrap();
    let after = nll(&policy, &seqs, s.optim.micro_batch_size).unwrap();
    assert_eq!((epochs.len(), steps), (3, 6));
    assert!(after < before - 0.5, "nll {before} -> {after} (epochs {epochs:?})");

    let dir = tempfile::tempdir().unwrap();
    policy.save(&dir.path().join("model")).unwrap();
    let loaded = Policy::load(dir.path().join("model").to_str().unwrap(), &Device::Cpu).unwrap();
    let batch = TokenBatch::new(&seqs.iter().map(|p| p.ids.clone()).collect::<Vec<_>>(), policy.pad_id).unwrap();
    let a = policy.token_logprobs_no_grad(&batch).unwrap().logprobs;
    let b = loaded.token_logprobs_no_grad(&batch).unwrap().logprobs;
    let diff = (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(diff < 1e-5, "saved and in-memory log-probs differ by {diff}");
}

#[test]
fn the_sft_command_writes_a_model_that_train_starts_from() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("warm/model");
    let out = Command::new(BIN)
        .current_dir(repo())
        .args(["sft", "--env", "scripts/sokoban.rhai", "--model", "tiny-llama", "--episodes", "6", "--epochs", "2"])
        .args(["--set", "lora.rank=4", "--set", "optim.mini_batch_size=3", "--lr", "1e-3", "--quiet", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("held-out nll") && stdout.contains("LoRA r4 (merged)"), "{stdout}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("warm/sft.json")).unwrap()).unwrap();
    assert_eq!(summary["demos"]["episodes"], 6);
    assert_eq!(summary["epoch_loss"].as_array().unwrap().len(), 2);
    assert_eq!(summary["step_loss"].as_array().unwrap().len(), 4);
    // The held-out demonstrations (the 32 seeds after the 6) are scored before and after.
    assert_eq!(summary["heldout_episodes"], 32);
    let (before, after) =
        (summary["heldout_nll_before"].as_f64().unwrap(), summary["heldout_nll_after"].as_f64().unwrap());
    assert!(after < before, "{summary}");
    assert_eq!(std::fs::read_to_string(dir.path().join("warm/demos.jsonl")).unwrap().lines().count(), 6);
    // The adapters were merged: a plain HF folder.
    assert!(model.join("config.json").exists() && !model.join("adapter_config.json").exists());
    // A second run refuses to overwrite it.
    let again = Command::new(BIN)
        .current_dir(repo())
        .args(["sft", "--env", "scripts/sokoban.rhai", "--model", "tiny-llama", "--episodes", "1", "--quiet", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
    // train starts from it and validates at step 0.
    let run = dir.path().join("run");
    let out = Command::new(BIN)
        .current_dir(repo())
        .args(["train", "--env", "scripts/sokoban.rhai", "--steps", "0", "--quiet", "--model"])
        .arg(&model)
        .args(["--set", "train.val_every=1", "--set", "train.val_groups=2", "--run-dir"])
        .arg(&run)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let events = std::fs::read_to_string(run.join("events.jsonl")).unwrap();
    assert!(events.contains("\"validation\""), "{events}");
    // Validation asks the solver every turn; the agreement is the share of first actions that
    // match its move, recomputed here from the rollout lines.
    let lines = std::fs::read_to_string(run.join("rollouts/val-step-000000.jsonl")).unwrap();
    let (mut asked, mut agreed) = (0, 0);
    for line in lines.lines() {
        let l: Value = serde_json::from_str(line).unwrap();
        for u in l["turns"].as_array().unwrap() {
            // A turn from a dead end (a box in a corner) has no solver move and is not counted.
            let Some(best) = u["solver_action"].as_str() else { continue };
            asked += 1;
            agreed += usize::from(u["actions"][0].as_str().is_some_and(|a| a.eq_ignore_ascii_case(best)));
        }
    }
    let validation: Value =
        serde_json::from_str(events.lines().find(|l| l.contains("\"validation\"")).unwrap()).unwrap();
    assert!(asked > 0);
    assert_eq!(validation["val/solver_agreement"].as_f64().unwrap(), agreed as f64 / asked as f64, "{validation}");
}

#[test]
fn sft_param_shapes_the_demonstrations_and_a_wrong_one_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let sft = |param: &str, out: &str| {
        Command::new(BIN)
            .current_dir(repo())
            .args(["sft", "--env", "scripts/frozenlake.rhai", "--model", "tiny-llama", "--episodes", "2"])
            .args(["--epochs", "1", "--heldout", "0", "--quiet", "--param", param, "--out"])
            .arg(dir.path().join(out).join("model"))
            .output()
            .unwrap()
    };
    let out = sft("observation_format=coord", "coord");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("coord/sft.json")).unwrap()).unwrap();
    assert_eq!(summary["params"]["observation_format"], "coord", "{summary}");
    let demos = std::fs::read_to_string(dir.path().join("coord/demos.jsonl")).unwrap();
    assert!(demos.contains("Board size: 4 rows x 4 cols") && !demos.contains("\"obs\":\"_"), "{demos}");
    let out = sft("observation_fromat=coord", "typo");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("observation_fromat"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
