//! `ragen-lab train` end to end on the tiny random-weight model: a short run writes a run
//! directory that resumes; a killed run resumes from its checkpoint to the same state as an
//! uninterrupted one; an env script edited during training is swapped in at the next step, and a
//! broken edit is reported while the run goes on.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread::sleep;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

const BIN: &str = env!("CARGO_BIN_EXE_ragen-lab");

/// Small enough for a debug build on 2 cores: 2 groups × 2 episodes, 12-token responses. PPO
/// with a critic (the flag beats the script's GRPO): the path with the most state to resume.
const TINY: &[&str] = &[
    "--algo",
    "ppo",
    "--model",
    "tiny-llama",
    "--quiet",
    "--set",
    "rollout.env_groups=2",
    "--set",
    "rollout.group_size=2",
    "--set",
    "rollout.response_length=12",
    "--set",
    "train.val_every=0",
    "--set",
    "train.save_every=1",
    "--set",
    "optim.lr=1e-3",
];

/// A project folder with the repo's bandit experiment and the scripts it names.
fn project() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for f in ["envs/bandit.rhai", "prompts/ragen.rhai", "rewards/format_penalty.rhai", "scripts/bandit.rhai"] {
        let to = dir.path().join(f);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(root.join(f), to).unwrap();
    }
    dir
}

fn train(project: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.current_dir(project).arg("train").args(TINY).args(extra);
    c
}

fn run_ok(mut c: Command) -> String {
    let out = c.output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ragen-lab train failed:\n{text}");
    text
}

/// The complete lines of a JSONL file that a running trainer may be appending to (a last line
/// without its newline is still being written).
/// `ragen-lab train` on the bandit experiment in the background, writing `runs/NAME` for `steps`
/// steps (a test kills it when it has seen what it waits for).
fn spawn_bandit(project: &Path, name: &str, steps: u32) -> Child {
    let (steps, dir) = (steps.to_string(), format!("runs/{name}"));
    let mut c = train(project, &["--env", "scripts/bandit.rhai", "--steps", &steps, "--run-dir", &dir]);
    c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// The run's events of one kind.
fn events_of(run: &Path, kind: &str) -> Vec<Value> {
    jsonl(&run.join("events.jsonl")).into_iter().filter(|e| e["kind"] == kind).collect()
}

fn jsonl(path: &Path) -> Vec<Value> {
    let text = fs::read_to_string(path).unwrap_or_default();
    let complete = text.rfind('\n').map_or("", |i| &text[..i]);
    complete.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn steps_of(run: &Path) -> Vec<u64> {
    jsonl(&run.join("metrics.jsonl")).iter().map(|m| m["step"].as_u64().unwrap()).collect()
}

fn latest(run: &Path) -> Option<String> {
    fs::read_to_string(run.join("checkpoints/latest")).ok().map(|s| s.trim().to_string())
}

/// Waits (polling) until `cond` holds; gives up after a generous limit so a broken run cannot
/// hang the suite (this bounds the test, it asserts nothing about speed).
fn wait_for(child: &mut Child, what: &str, mut cond: impl FnMut() -> bool) {
    let give_up = Instant::now() + Duration::from_secs(300);
    while !cond() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run exited ({status}) before {what}");
        }
        assert!(Instant::now() < give_up, "gave up waiting for {what}");
        sleep(Duration::from_millis(20));
    }
}

#[test]
fn train_bandit_two_steps_writes_a_resumable_run_dir() {
    let p = project();
    let run = p.path().join("runs/two");
    let summary = run_ok(train(
        p.path(),
        &[
            "--env",
            "scripts/bandit.rhai",
            "--steps",
            "2",
            "--run-dir",
            "runs/two",
            "--set",
            "echo.mi_every=2",
            "--set",
            "rollout.think=true",
        ],
    ));
    assert!(summary.contains("steps 1–2"), "{summary}");

    let settings: Value = serde_json::from_str(&fs::read_to_string(run.join("settings.json")).unwrap()).unwrap();
    assert_eq!(settings["settings"]["rollout"]["env_groups"], 2);
    assert_eq!(settings["settings"]["starpo"]["clip_high"], 0.28, "starpo-s is the default preset");
    assert_eq!(settings["settings"]["starpo"]["advantage"], "gae", "--algo beats the script's settings");
    let metrics = jsonl(&run.join("metrics.jsonl"));
    assert_eq!(steps_of(&run), vec![1, 2]);
    for key in [
        "rollout/reward_mean",
        "rollout/in_group_std",
        "update/entropy",
        "update/grad_norm",
        "time/rollout_s",
        "perf/tokens",
    ] {
        assert!(metrics[1][key].is_number(), "metrics line lacks {key}: {}", metrics[1]);
    }
    // The rollout's floor counts each distinct position once: above 0, below the per-token estimate.
    let floor = metrics[1]["perf/floor_flops_rollout"].as_f64().unwrap();
    assert!(floor > 0.0 && floor < metrics[1]["perf/flops"].as_f64().unwrap(), "{}", metrics[1]);
    assert!(metrics[1]["perf/floor_flops_update"].as_f64().unwrap() > 0.0, "{}", metrics[1]);
    // Every key an Echo-Trap alarm reads is one the trainer writes (a misspelt key would switch
    // the alarm off without a word); the probe's keys come every echo.mi_every steps.
    // (answer_top_share only where a batch shows 4 distinct observations: tested on phases below.)
    for key in ragen_lab::metrics::echo_trap::ALARM_KEYS.iter().filter(|k| k.name() != "rollout/answer_top_share") {
        assert!(metrics[1][key.name()].is_number(), "no alarm can fire on {}: {}", key.name(), metrics[1]);
    }
    let trajs = jsonl(&run.join("rollouts/step-000001.jsonl"));
    assert_eq!(trajs.len(), 4, "2 groups × 2 episodes");
    assert_eq!(trajs[0]["seed"], trajs[1]["seed"], "a group shares its seed");
    assert_ne!(trajs[0]["seed"], trajs[2]["seed"]);
    let step2 = jsonl(&run.join("rollouts/step-000002.jsonl"));
    assert_ne!(step2[0]["seed"], trajs[0]["seed"], "fresh seeds every step");
    let env_hash = trajs[0]["versions"]["env"].as_str().unwrap();
    assert!(run.join(format!("scripts/{env_hash}.rhai")).exists(), "the env source is kept by its hash");
    assert_eq!(latest(&run).as_deref(), Some("step-000002"));
    let ckpt = run.join("checkpoints/step-000002");
    for f in [
        "policy/model.safetensors",
        "policy/config.json",
        "optimizer.safetensors",
        "critic/model.safetensors",
        "state.json",
    ] {
        assert!(ckpt.join(f).exists(), "checkpoint lacks {f}");
    }

    // Resume extends the run: step 3 follows, every step logged once.
    run_ok(train(p.path(), &["--resume", "runs/two", "--steps", "3"]));
    assert_eq!(steps_of(&run), vec![1, 2, 3]);
    assert_eq!(latest(&run).as_deref(), Some("step-000003"));
    assert!(jsonl(&run.join("events.jsonl")).iter().any(|e| e["kind"] == "resume"));

    // Flags a resumed run cannot honour are refused, saying why (they were silently ignored).
    for (flag, value) in [("--preset", "starpo"), ("--algo", "grpo"), ("--model", "tiny-qwen2")] {
        let out = Command::new(BIN)
            .current_dir(p.path())
            .args(["train", "--quiet", "--resume", "runs/two", "--steps", "4", flag, value])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} with --resume was accepted");
        assert!(err.contains(&format!("{flag} {value} cannot apply to --resume")), "{err}");
        assert!(err.contains("settings and model it was started with"), "{err}");
    }
    assert_eq!(steps_of(&run), vec![1, 2, 3], "a refused resume trains nothing");
}

#[test]
fn a_killed_run_resumes_from_its_checkpoint_to_the_same_state() {
    let p = project();
    let killed = p.path().join("runs/killed");
    let mut child = spawn_bandit(p.path(), "killed", 50);
    wait_for(&mut child, "the first checkpoint", || latest(&killed).is_some());
    child.kill().unwrap();
    child.wait().unwrap();
    let saved: u64 = latest(&killed).unwrap().trim_start_matches("step-").parse().unwrap();

    // Resume one step past the checkpoint, and compare with a run that was never interrupted.
    let target = (saved + 1).to_string();
    run_ok(train(p.path(), &["--resume", "runs/killed", "--steps", &target]));
    run_ok(train(p.path(), &["--env", "scripts/bandit.rhai", "--steps", &target, "--run-dir", "runs/straight"]));
    let straight = p.path().join("runs/straight");
    assert_eq!(steps_of(&killed), (1..=saved + 1).collect::<Vec<_>>(), "the step continues from the checkpoint");
    let last = |run: &Path| jsonl(&run.join("metrics.jsonl")).pop().unwrap();
    let (a, b) = (last(&killed), last(&straight));
    for key in ["rollout/reward_mean", "rollout/response_len", "update/pg_loss", "update/entropy", "update/grad_norm"] {
        assert_eq!(a[key], b[key], "{key} after resume differs from the uninterrupted run");
    }
    let weights =
        |run: &Path| fs::read(run.join(format!("checkpoints/step-{:06}/policy/model.safetensors", saved + 1))).unwrap();
    assert!(weights(&killed) == weights(&straight), "resumed weights differ from the uninterrupted run's");
}

#[test]
fn an_env_edit_during_training_is_swapped_in_and_a_broken_edit_is_reported() {
    let p = project();
    let run = p.path().join("runs/live");
    let env = p.path().join("envs/bandit.rhai");
    let original = fs::read_to_string(&env).unwrap();
    let mut child = spawn_bandit(p.path(), "live", 40);
    let events = |kind: &str| events_of(&run, kind);

    wait_for(&mut child, "step 1", || !steps_of(&run).is_empty());
    fs::write(&env, original.replace("lo_payout: 0.1", "lo_payout: 0.05")).unwrap();
    wait_for(&mut child, "the swap", || !events("swap").is_empty());
    let swap_step = events("swap")[0]["step"].as_u64().unwrap();

    fs::write(&env, format!("{original}\nfn broken( {{")).unwrap();
    wait_for(&mut child, "the reload error", || !events("reload_error").is_empty());
    let err_step = events("reload_error")[0]["step"].as_u64().unwrap();
    // The step's rollouts are written (atomically) after its metrics line.
    let rollouts_of = |step: u64| run.join(format!("rollouts/step-{step:06}.jsonl"));
    wait_for(&mut child, "the rollouts of the step after the broken edit", || rollouts_of(err_step).exists());
    child.kill().unwrap();
    child.wait().unwrap();

    let msg = events("reload_error")[0]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("envs/bandit.rhai"), "the error names the file: {msg}");
    let index = jsonl(&run.join("scripts/index.jsonl"));
    let env_versions: Vec<&str> =
        index.iter().filter(|l| l["role"] == "env").map(|l| l["hash"].as_str().unwrap()).collect();
    assert_eq!(env_versions.len(), 2, "the original and the edited env, not the broken one: {index:?}");
    let version_at = |step: u64| -> String {
        jsonl(&run.join(format!("rollouts/step-{step:06}.jsonl")))[0]["versions"]["env"].as_str().unwrap().to_string()
    };
    assert_eq!(version_at(1), env_versions[0]);
    assert_eq!(version_at(swap_step), env_versions[1], "trajectories after the swap carry the new version");
    assert_eq!(version_at(err_step), env_versions[1], "the broken edit left the last good version in use");
    let edited: PathBuf = run.join(format!("scripts/{}.rhai", env_versions[1]));
    assert!(fs::read_to_string(edited).unwrap().contains("lo_payout: 0.05"));
}

/// The learning check: scripts/bandit_tiny.rhai as shipped (a random-weight tiny-llama, GRPO
/// under the StarPO-S filter, constrained answers) reaches ≥ 0.9 validation success on Bandit in
/// 30 steps whatever the two arm names are: here two ordinary words the tiny tokenizer never saw
/// (so each takes several tokens), each in turn the paying arm, so a model that merely prefers
/// one name cannot pass both (it first reaches 1.0 by step 10 on this machine; 30 leaves a margin
/// for other CPUs' rounding). Training is deterministic for a seed, so this is not a flaky test;
/// it fails when a change breaks learning (a sign error in the advantage, a mask off by one, a
/// dropped gradient).
#[test]
fn a_tiny_model_learns_bandit_whatever_the_arm_names() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let names = ["Walrus", "Quokka"];
    let tok = ragen_lab::policy::Policy::preset("tiny-llama", &candle_core::Device::Cpu).unwrap().tokenizer;
    for name in names {
        let corpus = ragen_lab::policy::preset::CORPUS.join(" ").to_lowercase();
        assert!(!corpus.contains(&name.to_lowercase()), "{name} is in the tiny tokenizer's corpus");
        assert!(tok.encode(format!(" {name}"), false).unwrap().len() >= 3, "{name} should take several tokens");
    }
    for (hi, lo) in [(names[0], names[1]), (names[1], names[0])] {
        let tmp = tempfile::tempdir().unwrap();
        let run = tmp.path().join("run");
        let mut c = Command::new(BIN);
        c.current_dir(root).args(["train", "--env", "scripts/bandit_tiny.rhai", "--quiet", "--steps", "30"]);
        c.args(["--param", &format!("hi_arm={hi}"), "--param", &format!("lo_arm={lo}")]);
        c.args(["--set", "train.save_every=0", "--set", "train.val_every=30", "--run-dir"]).arg(&run);
        run_ok(c);
        let vals: Vec<(u64, f64)> = jsonl(&run.join("events.jsonl"))
            .iter()
            .filter(|e| e["kind"] == "validation")
            .map(|e| (e["step"].as_u64().unwrap(), e["val/success"].as_f64().unwrap()))
            .collect();
        assert_eq!(vals.first().map(|v| v.0), Some(0), "{vals:?}");
        let last = vals.last().unwrap();
        assert_eq!(last.0, 30, "{vals:?}");
        assert!(last.1 >= 0.9, "{hi} over {lo}: validation success after 30 steps: {vals:?}");
        // The choice is the first token's, so a random model picks either about half the time.
        assert!(vals[0].1 < 0.8, "{hi} over {lo}: the untrained model should not already choose {hi}: {vals:?}");
        let settings: Value = serde_json::from_str(&fs::read_to_string(run.join("settings.json")).unwrap()).unwrap();
        assert_eq!(settings["params"]["hi_arm"], json!(hi), "--param is recorded with the run");
    }
}

/// GRPO on a reward that never varies: every step is skipped (no entropy-only drift), logged
/// as `update/skipped` and a `no_signal` event, and the weights stay where they started.
#[test]
fn a_step_without_reward_variance_makes_no_update() {
    let p = project();
    fs::write(p.path().join("rewards/flat.rhai"), "fn shape(turn, reward) { 0.0 }\n").unwrap();
    let bandit = fs::read_to_string(p.path().join("scripts/bandit.rhai")).unwrap();
    let flat = bandit.replace("rewards/format_penalty.rhai", "rewards/flat.rhai");
    fs::write(p.path().join("scripts/flat.rhai"), flat).unwrap();
    let mut c = Command::new(BIN);
    c.current_dir(p.path()).args(["train", "--env", "scripts/flat.rhai", "--algo", "grpo"]);
    c.args(&TINY[2..]).args(["--steps", "2", "--run-dir", "runs/flat"]);
    run_ok(c);
    let run = p.path().join("runs/flat");
    for m in jsonl(&run.join("metrics.jsonl")) {
        assert_eq!(m["update/skipped"], 1.0, "{m}");
        assert!(m.get("update/entropy").is_none(), "{m}");
        assert!(m.get("perf/floor_flops_update").is_none(), "a skipped update has no floor: {m}");
    }
    assert_eq!(jsonl(&run.join("events.jsonl")).iter().filter(|e| e["kind"] == "no_signal").count(), 2);
    let weights =
        |step: u32| fs::read(run.join(format!("checkpoints/step-{step:06}/policy/model.safetensors"))).unwrap();
    assert!(weights(1) == weights(2), "a skipped step changed the weights");
}

/// RAGEN-2's options through the trainer (issue 14): every estimator, loss aggregation, filter
/// strategy, metric, type, zero rule, loss scaling and normalisation grouping trains two steps
/// on the tiny model, and the run records the settings it used.
#[test]
fn ragen2_options_train_through_the_trainer() {
    let p = project();
    let runs: [(&str, &[&str]); 5] = [
        (
            "rpp",
            &[
                "starpo.advantage=reinforce_plus_plus",
                "starpo.gamma=0.99",
                "starpo.loss_agg_mode=token-mean",
                "starpo.filter=top_p",
                "starpo.filter_top_p_mode=softmax",
                "starpo.filter_metric=entropy",
                "starpo.filter_type=smallest",
                "starpo.reward_norm_grouping=batch",
                "starpo.filter_loss_scaling=sqrt",
            ],
        ),
        (
            "rppb",
            &[
                "starpo.advantage=reinforce_plus_plus_baseline",
                "starpo.loss_agg_mode=seq-mean-token-sum",
                "starpo.filter=top_k",
                "starpo.filter_ratio=0.5",
                "starpo.filter_metric=entropy_variance",
                "starpo.filter_include_zero=false",
                "starpo.reward_norm_grouping=inductive",
                "starpo.filter_loss_scaling=linear",
            ],
        ),
        (
            "rloo",
            &["starpo.advantage=rloo", "starpo.filter=top_k_abs", "starpo.filter_k=1", "starpo.filter_metric=length"],
        ),
        (
            "remax",
            &[
                "starpo.advantage=remax",
                "starpo.reward_norm=mean",
                "starpo.filter=min_p",
                "starpo.filter_metric=reward",
            ],
        ),
        (
            "drgrpo",
            &[
                "starpo.advantage=grpo",
                "starpo.norm_adv_by_std_in_grpo=false",
                "starpo.soft_advantage_reweight=true",
                "starpo.grpo_length_weight=true",
                "starpo.filter=top_p",
                "starpo.filter_metric=reward_sum",
            ],
        ),
    ];
    for (name, sets) in runs {
        let mut c =
            train(p.path(), &["--env", "scripts/bandit.rhai", "--steps", "2", "--run-dir", &format!("runs/{name}")]);
        c.args(["--set", "rollout.env_groups=4"]);
        for kv in sets {
            c.args(["--set", kv]);
        }
        run_ok(c);
        let run = p.path().join("runs").join(name);
        let lines = jsonl(&run.join("metrics.jsonl"));
        assert_eq!(lines.len(), 2, "{name}");
        // Each made an update (a step whose episodes all scored alike is skipped).
        assert!(
            lines.iter().any(|m| m["update/skipped"] == 0.0 && m["update/grad_norm"].as_f64().unwrap() > 0.0),
            "{name}: {lines:?}"
        );
        let saved: Value = serde_json::from_str(&fs::read_to_string(run.join("settings.json")).unwrap()).unwrap();
        for kv in sets {
            let (key, value) = kv.split_once('=').unwrap();
            let (section, field) = key.split_once('.').unwrap();
            let got = &saved["settings"][section][field];
            let want = serde_json::from_str::<Value>(value).unwrap_or(json!(value));
            assert_eq!(got, &want, "{name}: {key}");
        }
        if name == "rloo" {
            // top_k_abs with k = 1 of 4 groups keeps one (ties included: the lower index).
            for m in &lines {
                assert_eq!(m["rollout/kept_ratio"], 0.25, "{m}");
            }
        }
    }
}

/// RAGEN-2's recommended filter (`--preset starpo-s2`) on a reward that never varies keeps no
/// group; with `stop.empty_steps = 2` the run stops after two such steps, with an
/// `early_stop` event that gives its numbers and a checkpoint to resume from.
#[test]
fn the_empty_filter_early_stop_ends_the_run_with_its_numbers() {
    let p = project();
    fs::write(p.path().join("rewards/flat.rhai"), "fn shape(turn, reward) { 0.0 }\n").unwrap();
    let bandit = fs::read_to_string(p.path().join("scripts/bandit.rhai")).unwrap();
    fs::write(p.path().join("scripts/flat.rhai"), bandit.replace("rewards/format_penalty.rhai", "rewards/flat.rhai"))
        .unwrap();
    let mut c = train(p.path(), &["--env", "scripts/flat.rhai", "--preset", "starpo-s2", "--steps", "6"]);
    // The shipped script trains every group (`starpo.filter = "none"`, which a preset does not
    // override): name the preset's filter.
    c.args(["--set", "starpo.filter=top_p", "--set", "stop.empty_steps=2", "--run-dir", "runs/stop"]);
    let out = run_ok(c);
    assert!(out.contains("stopped early"), "{out}");
    let run = p.path().join("runs/stop");
    let lines = jsonl(&run.join("metrics.jsonl"));
    assert_eq!(steps_of(&run), vec![1, 2], "stopped after the second empty step");
    for m in &lines {
        assert_eq!((m["rollout/empty_after_filter"].clone(), m["update/skipped"].clone()), (json!(1.0), json!(1.0)));
    }
    let events = jsonl(&run.join("events.jsonl"));
    assert_eq!(events.iter().filter(|e| e["kind"] == "empty_filter").count(), 2);
    let stop = events.iter().find(|e| e["kind"] == "early_stop").expect("an early_stop event");
    assert_eq!((stop["step"].clone(), stop["steps"].clone()), (json!(2), json!(2)), "{stop}");
    assert_eq!(stop["stop"], "empty_filtered_steps", "{stop}");
    assert!(run.join("checkpoints/step-000002").exists());
}

/// Live edits that pass the smoke test but fail on real turns (issue 10): a reward that is NaN
/// on real responses, an env whose reset never ends for real seeds, a prompt that builds a
/// string bomb on real observations. Each is rolled back to the version it replaced, reported
/// once as a `script_error` event with its place, and the run goes on; `--resume` then keeps the
/// last good versions instead of reloading the broken files.
#[test]
fn hostile_live_edits_roll_back_and_are_recorded() {
    let p = project();
    let run = p.path().join("runs/hostile");
    let mut child = spawn_bandit(p.path(), "hostile", 60);
    let errors = || events_of(&run, "script_error");
    wait_for(&mut child, "step 1", || !steps_of(&run).is_empty());
    let edit = |file: &str, from: &str, to: &str| {
        let path = p.path().join(file);
        let text = fs::read_to_string(&path).unwrap();
        assert!(text.contains(from), "{file} lacks {from:?}");
        fs::write(&path, text.replacen(from, to, 1)).unwrap();
    };
    // The smoke test's sample turns mention Up, Jump or have no tags; real ones do not.
    edit(
        "rewards/format_penalty.rhai",
        "fn shape(turn, reward) {",
        "fn shape(turn, reward) {\n    if !(turn.response.contains(\"Up\") || turn.response.contains(\"Jump\") || turn.response == \"no tags\") { return parse_float(\"NaN\"); }",
    );
    // A reward edit is tried on the last step's turns before it is swapped in: refused there.
    let refusals =
        || jsonl(&run.join("events.jsonl")).into_iter().filter(|e| e["kind"] == "reload_error").collect::<Vec<_>>();
    wait_for(&mut child, "the reward's refusal", || refusals().len() == 1);
    edit("envs/bandit.rhai", "fn reset(seed, params) {", "fn reset(seed, params) {\n    if seed != 0 { loop { } }");
    wait_for(&mut child, "the env's script error", || errors().len() == 1);
    edit(
        "prompts/ragen.rhai",
        "fn user(info, turn) {",
        "fn user(info, turn) {\n    if turn.obs != \"P_G\" { let s = \"ab\"; loop { s += s; } }",
    );
    wait_for(&mut child, "the prompt's script error", || errors().len() == 2);
    let last_error = errors()[1]["step"].as_u64().unwrap();
    let rollouts_of = |step: u64| run.join(format!("rollouts/step-{step:06}.jsonl"));
    wait_for(&mut child, "the step after the last rollback", || rollouts_of(last_error + 1).exists());
    wait_for(&mut child, "its checkpoint", || latest(&run).is_some_and(|l| l >= format!("step-{:06}", last_error + 1)));
    child.kill().unwrap();
    child.wait().unwrap();

    let errors = errors();
    // Errors Rhai reports without a position (a wrong value, a limit) point at the function.
    let line_of = |path: &str, f: &str| {
        let text = fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap();
        text.lines().position(|l| l.starts_with(&format!("fn {f}("))).unwrap() as u64 + 1
    };
    let refused = &refusals()[0];
    let reward_line = line_of("rewards/format_penalty.rhai", "shape");
    assert_eq!(
        (refused["path"].as_str(), refused["line"].as_u64()),
        (Some("rewards/format_penalty.rhai"), Some(reward_line))
    );
    assert_eq!(refused["error"], "contract", "{refused}");
    assert!(refused["message"].as_str().unwrap().contains("recorded turns"), "{refused}");
    let expect = [
        ("envs/bandit.rhai", line_of("envs/bandit.rhai", "reset"), ["operations", "timeout"]),
        ("prompts/ragen.rhai", line_of("prompts/ragen.rhai", "user"), ["size", "size"]),
    ];
    for (e, (path, line, kinds)) in errors.iter().zip(expect) {
        assert_eq!((e["path"].as_str(), e["line"].as_u64()), (Some(path), Some(line)), "{e}");
        assert!(kinds.contains(&e["error"].as_str().unwrap()), "{e}");
        assert!(e["col"].as_u64().unwrap() > 0, "{e}");
        assert_ne!(e["version"], e["restored"], "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(message.starts_with(&format!("{path}:{line}:")) && message.contains("rolled back to version"), "{e}");
    }
    let versions = |step: u64| jsonl(&rollouts_of(step))[0]["versions"].clone();
    for (e, role) in errors.iter().zip(["env", "prompt"]) {
        let used = versions(last_error + 1)[role].clone();
        assert_eq!(used, e["restored"], "the {role} in use after the rollback is the restored version");
    }
    assert_ne!(versions(last_error + 1)["rewards"][0], refused["version"], "the refused reward was never used");

    // Resume with the broken files still on disk: the last good versions are kept, and said so.
    let saved: u64 = latest(&run).unwrap().trim_start_matches("step-").parse().unwrap();
    run_ok(train(p.path(), &["--resume", "runs/hostile", "--steps", &(saved + 1).to_string()]));
    assert_eq!(*steps_of(&run).last().unwrap(), saved + 1);
    let notes: Vec<Value> =
        jsonl(&run.join("events.jsonl")).into_iter().filter(|e| e["kind"] == "reload_error").collect();
    assert_eq!(notes.len(), 1 + 3, "the refusal, then one note per script not resumed: {notes:?}");
    assert!(
        jsonl(&run.join("events.jsonl")).iter().filter(|e| e["kind"] == "script_error").count() == 2,
        "no new failures after resume"
    );
}

/// Two turns whose legal answers differ (issue 31): describe lists all four names, the state
/// allows two. A random model constrained to describe's list would name an illegal one in most
/// of 2 × 4 episodes × 2 turns; constrained to the state's, never.
const PHASES_ENV: &str = r#"
fn describe(params) {
    #{ name: "phases", instruction: "Answer with one of the available actions.",
       actions: ["Alpha", "Beta", "Gamma", "Delta"], max_turns: 2, max_actions: 2, max_actions_per_turn: 1 }
}
fn reset(seed, params) { #{ turn: 0, seed: seed } }
fn valid_actions(state) { if state.turn == 0 { ["Alpha", "Beta"] } else { ["Gamma", "Delta"] } }
fn render(state) { `Phase ${state.turn + 1} of game ${state.seed}.` }
fn step(state, action) {
    let ok = valid_actions(state).contains(action);
    state.turn += 1;
    #{ reward: if ok { 1.0 } else { 0.0 }, done: state.turn >= 2, valid: ok, success: ok && state.turn >= 2 }
}
"#;

#[test]
fn each_turn_is_constrained_to_the_states_legal_actions() {
    let p = project();
    fs::write(p.path().join("envs/phases.rhai"), PHASES_ENV).unwrap();
    let experiment = r#"fn experiment() { #{ env: "envs/phases.rhai", prompt: "prompts/ragen.rhai",
        settings: #{ rollout: #{ think: false, constrain_actions: true }, starpo: #{ advantage: "grpo" } } } }"#;
    fs::write(p.path().join("scripts/phases.rhai"), experiment).unwrap();
    let mut c = train(p.path(), &["--env", "scripts/phases.rhai", "--steps", "1", "--run-dir", "runs/phases"]);
    c.args(["--set", "rollout.group_size=4", "--set", "rollout.response_length=24"]);
    c.args(["--set", "stop.flat_steps=0"]);
    run_ok(c);
    let trajs = jsonl(&p.path().join("runs/phases/rollouts/step-000001.jsonl"));
    assert_eq!(trajs.len(), 8);
    // 2 games × 2 phases are 4 observations: the one-answer share is measured, and no answer
    // can be most of them (each phase has its own two).
    let metrics = jsonl(&p.path().join("runs/phases/metrics.jsonl"));
    let share = metrics[0]["rollout/answer_top_share"].as_f64().unwrap();
    assert!((0.25..=0.5).contains(&share), "{share}");
    // 16 one-word answers from 2 per turn repeat by design: that is no repetition.
    assert_eq!(metrics[0]["rollout/repetition"], 0.0, "{}", metrics[0]);
    // The update scores the answers over the tokens their grammar allowed: a random model's
    // entropy there is a few nats at most, over its whole vocabulary near ln V (only the
    // template's end-of-turn id is scored free).
    let entropy = metrics[0]["update/entropy"].as_f64().unwrap();
    assert!(entropy < 0.7 * (49152f64).ln(), "entropy {entropy}: the answers were scored over the whole vocabulary");
    for t in &trajs {
        let turns = t["turns"].as_array().unwrap();
        assert_eq!(turns.len(), 2, "{t}");
        for (turn, legal) in turns.iter().zip([["Alpha", "Beta"], ["Gamma", "Delta"]]) {
            let action = turn["actions"][0].as_str().unwrap_or_default();
            assert!(legal.contains(&action), "turn answered {action:?}, legal {legal:?}: {t}");
            // The prompt lists the state's actions: all of turn 1's, and turn 2's where they differ.
            assert!(turn["user"].as_str().unwrap().contains(&legal.join(", ")), "{turn}");
        }
    }
}

/// A run with nothing left to learn from ends (issue 31): every group alike for
/// `stop.flat_steps` steps is `solved` when the episodes succeed (phases: constrained to legal
/// answers, every episode wins), else `no_variance` with what to try; both checkpoint.
#[test]
fn flat_runs_stop_as_solved_or_with_no_variance() {
    let p = project();
    fs::write(p.path().join("envs/phases.rhai"), PHASES_ENV).unwrap();
    let experiment = r#"fn experiment() { #{ env: "envs/phases.rhai", prompt: "prompts/ragen.rhai",
        settings: #{ rollout: #{ think: false, constrain_actions: true, response_length: 24 } } } }"#;
    fs::write(p.path().join("scripts/phases.rhai"), experiment).unwrap();
    fs::write(p.path().join("rewards/flat.rhai"), "fn shape(turn, reward) { 0.0 }\n").unwrap();
    let bandit = fs::read_to_string(p.path().join("scripts/bandit.rhai")).unwrap();
    fs::write(p.path().join("scripts/flat.rhai"), bandit.replace("rewards/format_penalty.rhai", "rewards/flat.rhai"))
        .unwrap();
    // (The flat reward scores every bandit episode 0 whatever the env's success says.)
    // With stop.explore_temperature, an unsolved flat run first samples hotter (1.0 → 1.5 → 2.0,
    // a flat streak each), then stops.
    for (script, kind, steps) in [("scripts/phases.rhai", "solved", 2), ("scripts/flat.rhai", "no_variance", 6)] {
        let mut c = train(p.path(), &["--env", script, "--steps", "8", "--set", "stop.flat_steps=2"]);
        c.args(["--set", "stop.explore_temperature=2.0"]);
        if kind == "no_variance" {
            // The flat reward pays nothing whatever the env's success says: never solved.
            c.args(["--set", "stop.solved_success=2"]);
        }
        c.args(["--set", "rollout.response_length=24", "--run-dir", "runs/flat"]);
        let out = run_ok(c);
        assert!(out.contains("stopped early"), "{out}");
        let run = p.path().join("runs/flat");
        assert_eq!(steps_of(&run), (1..=steps).collect::<Vec<u64>>(), "{script}: {out}");
        let events = jsonl(&run.join("events.jsonl"));
        let explored: Vec<f64> =
            events.iter().filter(|e| e["kind"] == "explore").map(|e| e["temperature"].as_f64().unwrap()).collect();
        assert_eq!(explored, if kind == "solved" { vec![] } else { vec![1.5, 2.0] }, "{script}");
        let stop = events.iter().find(|e| e["kind"] == "early_stop").expect("an early_stop event");
        assert_eq!(stop["stop"].as_str(), Some(kind), "{stop}");
        assert!(kind != "solved" || stop["success"].as_f64().unwrap() >= 0.95, "{stop}");
        assert!(run.join(format!("checkpoints/step-{steps:06}")).exists());
        fs::remove_dir_all(run).unwrap();
    }
}

/// Turn-level GRPO through the trainer on a 3-turn env paying each right answer as it is given
/// (envs/lights.rhai with `each_turn`): the update runs on per-turn advantages.
#[test]
fn turn_level_grpo_trains_a_multi_turn_env() {
    let p = project();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    fs::copy(root.join("envs/lights.rhai"), p.path().join("envs/lights.rhai")).unwrap();
    let experiment = r#"fn experiment() { #{ env: "envs/lights.rhai", prompt: "prompts/ragen.rhai",
        params: #{ each_turn: true },
        settings: #{ rollout: #{ think: false, constrain_actions: true }, starpo: #{ filter: "none" } } } }"#;
    fs::write(p.path().join("scripts/lights.rhai"), experiment).unwrap();
    let mut c = train(p.path(), &["--env", "scripts/lights.rhai", "--steps", "2", "--run-dir", "runs/turns"]);
    c.args([
        "--set",
        "starpo.advantage=turn_grpo",
        "--set",
        "rollout.group_size=6",
        "--set",
        "rollout.response_length=24",
    ]);
    run_ok(c);
    let run = p.path().join("runs/turns");
    let lines = jsonl(&run.join("metrics.jsonl"));
    assert!(
        lines.iter().any(|m| m["update/skipped"] == 0.0 && m["update/grad_norm"].as_f64().unwrap() > 0.0),
        "{lines:?}"
    );
    let trajs = jsonl(&run.join("rollouts/step-000001.jsonl"));
    assert!(trajs.iter().all(|t| t["turns"].as_array().unwrap().len() == 3), "three turns each");
    let settings: Value = serde_json::from_str(&fs::read_to_string(run.join("settings.json")).unwrap()).unwrap();
    assert_eq!(settings["settings"]["starpo"]["advantage"], "turn_grpo");
}

/// The local sampler's log-probs are the update's old log-probs (issue 26: no pass over the
/// batch before the first optimiser step). With the weights held still (a vanishing rate),
/// every mini-batch's ratio to them is 1 only if they are the log-probs the update scores:
/// tempered at the answer or text temperature, over the legal tokens, on the same positions,
/// the end-of-turn after each `</answer>` included.
#[test]
fn the_samplers_logprobs_are_the_updates_old_logprobs() {
    let p = project();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    fs::copy(root.join("envs/lights.rhai"), p.path().join("envs/lights.rhai")).unwrap();
    let experiment = r#"fn experiment() { #{ env: "envs/lights.rhai", prompt: "prompts/ragen.rhai",
        settings: #{ rollout: #{ think: false, constrain_actions: true, answer_temperature: 2.0, temperature: 0.7 },
                     starpo: #{ filter: "none", advantage: "turn_grpo" } } } }"#;
    fs::write(p.path().join("scripts/lights.rhai"), experiment).unwrap();
    let mut c = train(p.path(), &["--env", "scripts/lights.rhai", "--steps", "2", "--run-dir", "runs/lp"]);
    c.args(["--set", "rollout.group_size=4", "--set", "rollout.response_length=24"]);
    c.args(["--set", "optim.mini_batch_size=2", "--set", "optim.lr=1e-12", "--set", "stop.flat_steps=0"]);
    run_ok(c);
    let lines = jsonl(&p.path().join("runs/lp/metrics.jsonl"));
    let trained: Vec<&Value> = lines.iter().filter(|m| m["update/skipped"] == 0.0).collect();
    assert!(!trained.is_empty(), "{lines:?}");
    for m in trained {
        let f = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("{k} missing: {m}"));
        assert!(f("update/optimizer_steps") > 1.0, "{m}");
        assert_eq!(f("update/sampler_logprobs"), 1.0, "every trajectory's old log-probs from the sampler: {m}");
        assert!(f("update/approx_kl").abs() < 1e-4 && f("update/clip_frac") == 0.0, "{m}");
    }
}

/// What a run computes, without its clocks: every metrics line and validation event with the
/// keys that measure time or memory taken out.
fn computed(run: &Path) -> Value {
    let clock = |k: &str| k == "time" || k.starts_with("time/") || k == "perf/peak_rss_mb";
    let strip = |v: &Value| {
        Value::Object(
            v.as_object().unwrap().iter().filter(|(k, _)| !clock(k)).map(|(k, v)| (k.clone(), v.clone())).collect(),
        )
    };
    let metrics: Vec<Value> = jsonl(&run.join("metrics.jsonl")).iter().map(strip).collect();
    let validations: Vec<Value> = jsonl(&run.join("events.jsonl"))
        .iter()
        .filter(|e| e["kind"] == "validation")
        .map(|e| {
            strip(e)
                .as_object()
                .unwrap()
                .iter()
                .filter(|(k, _)| k.as_str() != "message")
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect();
    json!({"metrics": metrics, "validations": validations})
}

/// Numbers equal to 1e-9 of their size, everything else exactly.
fn same(a: &Value, b: &Value, at: &str) -> Result<(), String> {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => {
            let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
            ((x - y).abs() <= 1e-9 * x.abs().max(y.abs()).max(1.0)).then_some(()).ok_or(format!("{at}: {x} ≠ {y}"))
        }
        (Value::Object(x), Value::Object(y)) => {
            let keys =
                |m: &serde_json::Map<String, Value>| m.keys().cloned().collect::<std::collections::BTreeSet<_>>();
            if keys(x) != keys(y) {
                return Err(format!("{at}: keys {:?} ≠ {:?}", keys(x), keys(y)));
            }
            x.iter().try_for_each(|(k, v)| same(v, &y[k], &format!("{at}.{k}")))
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            x.iter().zip(y).enumerate().try_for_each(|(i, (v, w))| same(v, w, &format!("{at}[{i}]")))
        }
        _ => (a == b).then_some(()).ok_or(format!("{at}: {a} ≠ {b}")),
    }
}

/// The trainer's behaviour is pinned: the default Bandit job (and the PPO path with its critic)
/// on the tiny model, same seed, gives the metric values recorded in tests/fixtures/golden/ before
/// the trainer was last restructured. A change that means to alter what training computes
/// re-records them: `RAGEN_BLESS=1 cargo test --test train pinned`.
#[test]
fn pinned_metrics_of_the_default_job_are_unchanged() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/golden");
    for (name, extra) in [
        ("bandit-grpo", &["--set", "train.val_every=2"][..]),
        ("bandit-ppo", &["--algo", "ppo", "--set", "rollout.env_groups=2", "--set", "train.val_every=0"][..]),
    ] {
        let p = project();
        let mut c = Command::new(BIN);
        c.current_dir(p.path()).args(["train", "--quiet", "--model", "tiny-llama", "--env", "scripts/bandit.rhai"]);
        c.args(["--steps", "3", "--run-dir", "runs/pin"]).args(extra);
        run_ok(c);
        let got = computed(&p.path().join("runs/pin"));
        let file = root.join(format!("{name}.json"));
        if std::env::var_os("RAGEN_BLESS").is_some() {
            fs::create_dir_all(&root).unwrap();
            fs::write(&file, serde_json::to_string_pretty(&got).unwrap() + "\n").unwrap();
            continue;
        }
        let want: Value = serde_json::from_str(&fs::read_to_string(&file).unwrap()).unwrap();
        if let Err(e) = same(&got, &want, name) {
            panic!("{e}\n(if the change means to alter what training computes: RAGEN_BLESS=1 cargo test --test train pinned)");
        }
    }
}

/// A reward edited during a run is first scored on the last finished step's trajectories: the
/// `reward_preview` event's numbers equal a re-score by hand of that step's recorded turns, and
/// then the edit is swapped in. An edit that fails on those real turns is refused before it is
/// ever used. `check --against` gives the same numbers offline.
#[test]
fn a_reward_edit_is_previewed_on_the_last_step_then_swapped_in() {
    let p = project();
    let run = p.path().join("runs/preview");
    let reward = p.path().join("rewards/format_penalty.rhai");
    let original = fs::read_to_string(&reward).unwrap();
    let mut child = spawn_bandit(p.path(), "preview", 40);
    let events = |kind: &str| events_of(&run, kind);
    wait_for(&mut child, "step 1", || !steps_of(&run).is_empty());
    // Pays 0.5 more for a turn whose first action is Dragon (the format penalty kept).
    let bonus = "\nfn shape(turn, reward) { let r = penalty(turn, reward); if turn.actions.len() > 0 && turn.actions[0] == \"Dragon\" { r + 0.5 } else { r } }\n";
    fs::write(&reward, original.replace("fn shape(turn, reward)", "fn penalty(turn, reward)") + bonus).unwrap();
    wait_for(&mut child, "the swap", || !events("swap").is_empty());
    // Passes the watcher's smoke test (its sample env has other actions) but fails on every real
    // Bandit turn: refused by the preview, never swapped in.
    let fails = "fn shape(turn, reward) {\n  if \"Dragon\" in turn.env_actions { reward + turn.no_such_key.len() } else { reward }\n}\n";
    fs::write(&reward, fails).unwrap();
    wait_for(&mut child, "the refusal", || !events("reload_error").is_empty());
    child.kill().unwrap();
    child.wait().unwrap();

    let preview = &events("reward_preview")[0];
    let swap = &events("swap")[0];
    assert_eq!(preview["step"], swap["step"], "previewed at the boundary where it is swapped in");
    let on = preview["on_step"].as_u64().unwrap();
    assert_eq!(on, swap["step"].as_u64().unwrap() - 1, "on the last finished step");
    let lines = jsonl(&run.join(format!("rollouts/step-{on:06}.jsonl")));
    let rescored: Vec<f64> = lines
        .iter()
        .map(|t| {
            let turns = t["turns"].as_array().unwrap();
            let dragons = turns.iter().filter(|u| u["actions"][0] == "Dragon").count();
            t["score"].as_f64().unwrap() + 0.5 * dragons as f64
        })
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let old: Vec<f64> = lines.iter().map(|t| t["score"].as_f64().unwrap()).collect();
    let close = |k: &str, want: f64| assert!((preview[k].as_f64().unwrap() - want).abs() < 1e-9, "{k}: {preview}");
    close("score_old", mean(&old));
    close("score_new", mean(&rescored));
    assert_eq!(preview["trajectories"], lines.len());
    assert_eq!(preview["changed"], rescored.iter().zip(&old).filter(|(a, b)| a != b).count());
    assert!(preview["moved"].as_array().unwrap().len() <= 3);
    // The refused edit names the script and the turn it failed on, and no trajectory used it.
    let refused = &events("reload_error")[0];
    let says = refused["message"].as_str().unwrap();
    assert!(says.contains("rewards/format_penalty.rhai:2") && says.contains("recorded turns"), "{refused}");
    let versions: Vec<String> = jsonl(&run.join("scripts/index.jsonl"))
        .iter()
        .filter(|l| l["role"] == "reward")
        .map(|l| l["hash"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(versions.len(), 2, "the original and the previewed edit only");

    // Offline, the same report on the same step with the same edit.
    fs::write(&reward, original.replace("fn shape(turn, reward)", "fn penalty(turn, reward)") + bonus).unwrap();
    let out = Command::new(BIN)
        .current_dir(p.path())
        .args(["check", "rewards/format_penalty.rhai", "--against", &format!("runs/preview:{on}")])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let offline: Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in ["on_step", "trajectories", "score_old", "score_new", "changed", "groups", "groups_flipped", "moved"] {
        assert_eq!(offline[k], preview[k], "{k}");
    }
    // A step the run never recorded, and a folder that is not a run, are clear errors.
    for (spec, says) in [("runs/preview:999", "no trajectories of step 999"), ("envs", "settings.json")] {
        let out = Command::new(BIN)
            .current_dir(p.path())
            .args(["check", "rewards/format_penalty.rhai", "--against", spec])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(says), "{spec}: {err}");
    }
}
