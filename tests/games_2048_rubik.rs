//! 2048 (`envs/game_2048.rhai`) and the 2x2 Rubik's cube (`envs/rubiks_cube.rhai`) against the
//! rules of RAGEN-2's reference envs (`ragen/env/game_2048`, `ragen/env/rubikscube`): boards and
//! rewards worked by hand from those rules, the cube's moves against a transcription of RAGEN's
//! sticker cycles, the cube's solver, determinism per seed, `check` on the envs and their
//! experiments, and a two-step `ragen-lab train` on each.
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use ragen_lab::cli::check::check;
use ragen_lab::script::{EnvScript, Episode, Host, Limits};
use serde_json::{Map, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn host() -> Arc<Host> {
    Host::new(repo(), Limits::default())
}

fn env(name: &str) -> EnvScript {
    EnvScript::load(&host(), Path::new(&format!("envs/{name}.rhai"))).unwrap()
}

fn params(e: &EnvScript, overrides: &[(&str, &str)]) -> Map<String, Value> {
    let o: Vec<(String, String)> = overrides.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    e.params(&o).unwrap()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

// ---------------------------------------------------------------------------------------------
// 2048

/// A 2048 episode started from a fixed board (rows of 4 cells).
fn board_2048(rows: [[i64; 4]; 4], extra: &[(&str, &str)]) -> Episode {
    let text = rows.iter().map(|r| r.iter().map(i64::to_string).collect::<Vec<_>>().join(" ")).collect::<Vec<_>>();
    let e = env("game_2048");
    let mut o = vec![("board", text.join(","))];
    o.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    let o: Vec<(&str, &str)> = o.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let p = params(&e, &o);
    e.reset(7, 0, &p).unwrap()
}

fn cells(ep: &Episode) -> Vec<i64> {
    ints(&ep.state_json()["cells"])
}

/// RAGEN's log reward for a move whose merges sum to `m`.
fn log_reward(m: f64) -> f64 {
    0.1 * (m + 1.0).log2()
}

/// The board after a move equals `expected` but for one new tile, a 2 or a 4, on a cell that
/// `expected` leaves empty (RAGEN's spawn after a move that changed the board).
fn assert_moved_to(got: &[i64], expected: [[i64; 4]; 4]) {
    let expected: Vec<i64> = expected.concat();
    let diff: Vec<usize> = (0..16).filter(|&i| got[i] != expected[i]).collect();
    assert_eq!(diff.len(), 1, "expected {expected:?} plus one spawned tile, got {got:?}");
    let i = diff[0];
    assert!(expected[i] == 0 && (got[i] == 2 || got[i] == 4), "spawn at {i}: {got:?} vs {expected:?}");
}

const Z: [i64; 4] = [0; 4];

#[test]
fn game_2048_row_of_four_twos_left_gives_two_fours_and_the_log_reward() {
    let mut ep = board_2048([[2, 2, 2, 2], Z, Z, Z], &[]);
    let o = ep.step("Left").unwrap();
    assert_moved_to(&cells(&ep), [[4, 4, 0, 0], Z, Z, Z]);
    assert!((o.reward - log_reward(8.0)).abs() < 1e-12, "{}", o.reward);
    assert!(o.valid && o.effective && !o.done && !o.success);
    assert_eq!(ep.state_json()["score"], 8);
}

#[test]
fn game_2048_merges_each_tile_once_nearest_the_move_edge_first() {
    // (start row 1, move, row 1 after, merged sum): rows slide along their own line.
    let cases: [([i64; 4], &str, [i64; 4], i64); 8] = [
        ([2, 2, 2, 0], "Left", [4, 2, 0, 0], 4),
        ([2, 2, 2, 0], "Right", [0, 0, 2, 4], 4),
        ([4, 4, 8, 0], "Left", [8, 8, 0, 0], 8),
        ([2, 2, 4, 4], "Left", [4, 8, 0, 0], 12),
        ([2, 2, 4, 4], "Right", [0, 0, 4, 8], 12),
        ([2, 0, 2, 2], "Left", [4, 2, 0, 0], 4),
        ([0, 4, 0, 2], "Left", [4, 2, 0, 0], 0),
        ([8, 0, 8, 16], "Right", [0, 0, 16, 16], 16),
    ];
    for (row, action, after, gain) in cases {
        let mut ep = board_2048([row, Z, Z, Z], &[]);
        let o = ep.step(action).unwrap();
        assert_moved_to(&cells(&ep), [after, Z, Z, Z]);
        let want = if gain > 0 { log_reward(gain as f64) } else { 0.0 };
        assert!((o.reward - want).abs() < 1e-12, "{row:?} {action}: reward {} want {want}", o.reward);
        assert!(o.valid && o.effective, "{row:?} {action}");
    }
    // Columns: the same rules along the first column, Up towards row 1 and Down towards row 4.
    let column = [[2, 0, 0, 0], [2, 0, 0, 0], [2, 0, 0, 0], Z];
    let mut ep = board_2048(column, &[]);
    ep.step("Up").unwrap();
    assert_moved_to(&cells(&ep), [[4, 0, 0, 0], [2, 0, 0, 0], Z, Z]);
    let mut ep = board_2048(column, &[]);
    ep.step("down").unwrap();
    assert_moved_to(&cells(&ep), [Z, Z, [2, 0, 0, 0], [4, 0, 0, 0]]);
}

#[test]
fn game_2048_raw_reward_is_the_merged_sum_and_a_no_op_costs_a_tenth() {
    let mut ep = board_2048([[2, 2, 4, 4], Z, Z, Z], &[("use_log_reward", "false")]);
    assert_eq!(ep.step("Left").unwrap().reward, 12.0);
    let mut ep = board_2048([[2, 0, 0, 0], Z, Z, Z], &[("use_log_reward", "false")]);
    assert_eq!(ep.step("Left").unwrap().reward, -0.1);
}

#[test]
fn game_2048_a_move_that_changes_nothing_is_invalid_and_spawns_no_tile() {
    let start = [[2, 0, 0, 0], Z, Z, Z];
    let mut ep = board_2048(start, &[]);
    for action in ["Left", "Up"] {
        let o = ep.step(action).unwrap();
        assert_eq!(o.reward, 0.0, "the log reward zeroes RAGEN's -0.1");
        assert!(!o.valid && !o.effective && !o.done, "{o:?}");
        assert_eq!(cells(&ep), start.concat());
    }
    assert_eq!(ep.valid_actions().unwrap(), ["Right", "Down"]);
    assert!(ep.render().unwrap().contains("\nValid Actions: 1(Right), 2(Down).\n"));
    // A name the env does not know is invalid too, and changes nothing.
    let o = ep.step("Jump").unwrap();
    assert!(!o.valid && o.reward == 0.0 && cells(&ep) == start.concat());
}

/// After Left the board is full: the one empty cell (row 4, column 4) gets a 2 or a 4, and
/// neither matches its neighbours (128 to its left, 8 above), so no move is left.
const ALMOST_OVER: [[i64; 4]; 4] = [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 8], [0, 32, 64, 128]];

#[test]
fn game_2048_ends_when_the_board_is_full_with_no_merge_and_succeeds_only_at_the_target() {
    let mut ep = board_2048(ALMOST_OVER, &[]);
    let o = ep.step("Left").unwrap();
    assert_moved_to(&cells(&ep), [[2, 4, 2, 4], [4, 2, 4, 2], [2, 4, 2, 8], [32, 64, 128, 0]]);
    assert!(o.done && !o.success && o.reward == 0.0, "{o:?}");
    assert!(ep.render().unwrap().contains("\nValid Actions: None.\n"));
    // RAGEN's success: the largest tile at game over is at least the target.
    let mut ep = board_2048(ALMOST_OVER, &[("target", "128")]);
    let o = ep.step("Left").unwrap();
    assert!(o.done && o.success, "{o:?}");
    // A target tile reached before game over does not end the game.
    let mut ep = board_2048([[64, 64, 0, 0], Z, Z, Z], &[("target", "128")]);
    let o = ep.step("Left").unwrap();
    assert!(!o.done && !o.success, "{o:?}");
}

#[test]
fn game_2048_renders_like_ragen() {
    let ep = board_2048([[2, 0, 0, 0], Z, Z, [0, 0, 0, 2]], &[]);
    assert_eq!(
        ep.render().unwrap(),
        "Current 2048 Grid:\nRow 1: [2, 0, 0, 0]\nRow 2: [0, 0, 0, 0]\nRow 3: [0, 0, 0, 0]\nRow 4: [0, 0, 0, 2]\n\n\
         Valid Actions: 0(Up), 1(Right), 2(Down), 3(Left).\nGoal: Merge same numbers to reach 2048.\n\
         Current Score: 0\nWhat is your next move?"
    );
    let mut ep = board_2048([[2, 2, 0, 0], Z, Z, Z], &[]);
    ep.step("Left").unwrap();
    let text = ep.render().unwrap();
    assert!(text.starts_with("Current 2048 Grid:\nRow 1: [4, "), "{text}");
    assert!(text.contains("\nCurrent Score: 4\n"), "{text}");
}

#[test]
fn game_2048_starts_with_two_tiles_two_nine_times_in_ten() {
    let e = env("game_2048");
    let p = params(&e, &[]);
    let (mut twos, mut fours) = (0, 0);
    for seed in 0..300 {
        let c = cells(&e.reset(seed, 0, &p).unwrap());
        assert_eq!(c.iter().filter(|&&v| v != 0).count(), 2, "seed {seed}: {c:?}");
        twos += c.iter().filter(|&&v| v == 2).count();
        fours += c.iter().filter(|&&v| v == 4).count();
    }
    assert_eq!(twos + fours, 600);
    // 600 draws at p = 0.1: mean 60, sd 7.3.
    assert!((35..=85).contains(&fours), "{fours} fours in 600 tiles");
}

#[test]
fn game_2048_is_deterministic_per_seed_and_stream() {
    let e = env("game_2048");
    let p = params(&e, &[]);
    let play = |seed: u64, stream: u64| -> Vec<String> {
        let mut ep = e.reset(seed, stream, &p).unwrap();
        let mut seen = vec![ep.render().unwrap()];
        for a in ["Left", "Up", "Right", "Down", "Left", "Up", "Left", "Down"] {
            if ep.done {
                break;
            }
            ep.step(a).unwrap();
            seen.push(ep.render().unwrap());
        }
        seen
    };
    assert_eq!(play(3, 1), play(3, 1));
    // One seed, one start board; the spawns come from each episode's own stream.
    assert_eq!(play(3, 1)[0], play(3, 2)[0]);
    assert_ne!(play(3, 1)[0], play(4, 1)[0]);
}

// ---------------------------------------------------------------------------------------------
// The 2x2 cube

const MOVES: [&str; 12] = ["U", "U'", "D", "D'", "L", "L'", "R", "R'", "F", "F'", "B", "B'"];

fn cube(overrides: &[(&str, &str)], seed: u64) -> Episode {
    let e = env("rubiks_cube");
    let p = params(&e, overrides);
    e.reset(seed, 0, &p).unwrap()
}

fn stickers(ep: &Episode) -> Vec<i64> {
    ints(&ep.state_json()["stickers"])
}

const SOLVED: [i64; 24] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5];

/// Every face one colour (RAGEN's solved test, any orientation).
fn uniform(s: &[i64]) -> bool {
    s.chunks(4).all(|f| f.iter().all(|&c| c == f[0]))
}

#[test]
fn rubiks_cube_each_move_four_times_and_each_move_then_its_inverse_is_the_identity() {
    for physical_b in ["false", "true"] {
        let o = [("physical_b", physical_b), ("max_steps", "100")];
        for (i, m) in MOVES.iter().enumerate() {
            let inverse = MOVES[i ^ 1];
            let mut ep = cube(&o, 11);
            let start = stickers(&ep);
            for _ in 0..4 {
                ep.step(m).unwrap();
            }
            assert_eq!(stickers(&ep), start, "{m} x4 (physical_b {physical_b})");
            ep.step(m).unwrap();
            assert_ne!(stickers(&ep), start, "{m} changes a scrambled cube");
            ep.step(inverse).unwrap();
            assert_eq!(stickers(&ep), start, "{m} then {inverse} (physical_b {physical_b})");
        }
    }
}

#[test]
fn rubiks_cube_moves_the_stickers_as_ragen_does() {
    // From solved, U (RAGEN _move_U: the top rows go F -> L -> B -> R -> F, U turns in place):
    // L's top row takes F's colour (2), F's R's (3), R's B's (4), B's L's (1).
    let mut ep = cube(&[("scramble_depth", "0")], 0);
    assert_eq!(stickers(&ep), SOLVED);
    ep.step("U").unwrap();
    assert_eq!(stickers(&ep), [0, 0, 0, 0, 2, 2, 1, 1, 3, 3, 2, 2, 4, 4, 3, 3, 1, 1, 4, 4, 5, 5, 5, 5]);
    // From solved, R: U's right column takes F's colour, F's takes D's, D's takes B's (B's left
    // column as seen from behind), B's takes U's.
    let mut ep = cube(&[("scramble_depth", "0")], 0);
    ep.step("R").unwrap();
    assert_eq!(stickers(&ep), [0, 2, 0, 2, 1, 1, 1, 1, 2, 5, 2, 5, 3, 3, 3, 3, 0, 4, 0, 4, 5, 4, 5, 4]);
    // Every move once from solved, checked against a line-by-line transcription of RAGEN's
    // _move_* cycles (RAGEN's B included).
    let seq = ["R", "U'", "F", "B", "D'", "L", "B'", "U", "R'", "F'", "D", "L'"];
    let mut ep = cube(&[("scramble_depth", "0"), ("max_steps", "100")], 0);
    for m in seq {
        ep.step(m).unwrap();
    }
    assert_eq!(stickers(&ep), [1, 0, 0, 3, 1, 2, 5, 0, 5, 5, 4, 4, 4, 3, 0, 1, 3, 2, 2, 3, 4, 1, 2, 5]);
    // physical_b: a real quarter turn of the back face, which differs from RAGEN's B.
    let mut ep = cube(&[("scramble_depth", "0"), ("max_steps", "100"), ("physical_b", "true")], 0);
    for m in seq {
        ep.step(m).unwrap();
    }
    assert_eq!(stickers(&ep), [1, 0, 0, 3, 0, 2, 5, 1, 3, 5, 5, 4, 4, 3, 0, 1, 4, 2, 2, 3, 4, 1, 2, 5]);
}

#[test]
fn rubiks_cube_renders_like_ragen() {
    let ep = cube(&[("scramble_depth", "0")], 0);
    assert_eq!(
        ep.render().unwrap(),
        "=== Rubik's Cube 2x2 State ===\nStep: 0/20\n\n\
         Up (U):    [W, W]\n [W, W]\nLeft (L):  [O, O]\n [O, O]\nFront (F): [G, G]\n [G, G]\n\
         Right (R): [R, R]\n [R, R]\nBack (B):  [B, B]\n [B, B]\nDown (D):  [Y, Y]\n [Y, Y]\n\n\
         Available Actions:\nU, U', D, D', L, L', R, R', F, F', B, B'\n\nWhat is your next move?"
    );
}

#[test]
fn rubiks_cube_solved_in_any_orientation_pays_one_and_ends() {
    // U then D' turns the whole cube: every face one colour again, which RAGEN counts as solved.
    let mut ep = cube(&[("scramble_depth", "0")], 0);
    let o = ep.step("U").unwrap();
    assert!(o.reward == 0.0 && !o.done && !o.success && o.valid && o.effective, "{o:?}");
    let o = ep.step("D'").unwrap();
    assert!(o.reward == 1.0 && o.done && o.success, "{o:?}");
    let text = ep.render().unwrap();
    assert!(text.starts_with("=== Rubik's Cube 2x2 State ===\nStep: 2/20\n"), "{text}");
    assert!(text.ends_with("\nDown (D):  [Y, Y]\n [Y, Y]\n\n=== Game Over: Cube Solved! ==="), "{text}");
    // Out of steps: done, no reward, RAGEN's message.
    let mut ep = cube(&[("scramble_depth", "0"), ("max_steps", "2")], 0);
    ep.step("R").unwrap();
    let o = ep.step("R").unwrap();
    assert!(o.done && !o.success && o.reward == 0.0, "{o:?}");
    assert!(ep.render().unwrap().ends_with("\n\n=== Game Over: Max steps reached. ==="));
    // An action the env does not know: invalid, not a step.
    let mut ep = cube(&[], 0);
    let o = ep.step("M").unwrap();
    assert!(!o.valid && o.reward == 0.0 && !o.done);
    assert_eq!(ep.state_json()["steps"], 0);
}

#[test]
fn rubiks_cube_solve_plays_to_success_within_the_scramble_depth() {
    // A one-move scramble has a one-move solution, whichever of the 12 it was.
    for seed in 0..12 {
        let mut ep = cube(&[("scramble_depth", "1")], seed);
        let path = ep.solve().unwrap().unwrap();
        assert_eq!(path.len(), 1, "seed {seed}: {path:?}");
        assert!(ep.step(&path[0]).unwrap().success);
    }
    // RAGEN's default depth (5), both B moves: the solution is at most the scramble's length
    // and plays to success.
    for (seed, physical_b) in (0..6).map(|s| (s, "false")).chain((0..3).map(|s| (s, "true"))) {
        let mut ep = cube(&[("physical_b", physical_b)], seed);
        let path = ep.solve().unwrap().unwrap();
        if uniform(&stickers(&ep)) {
            assert!(path.is_empty(), "seed {seed} starts solved");
            continue;
        }
        assert!(!path.is_empty() && path.len() <= 5, "seed {seed}: {path:?}");
        let mut last = None;
        for a in &path {
            last = Some(ep.step(a).unwrap());
        }
        assert!(last.is_some_and(|o| o.success && o.done), "seed {seed}: {path:?} did not solve it");
    }
}

/// The solver searches at most 5 moves deep (a whole depth-6 search would pass the sandbox's
/// operation budget): deeper scrambles get [] or a solution of at most 5 moves, never an error.
#[test]
fn rubiks_cube_solve_gives_up_past_five_moves_within_the_sandbox() {
    for seed in 0..3 {
        let mut ep = cube(&[("scramble_depth", "14"), ("max_steps", "100")], seed);
        let path = ep.solve().unwrap().unwrap();
        assert!(path.len() <= 5, "seed {seed}: {path:?}");
        for (i, a) in path.iter().enumerate() {
            assert_eq!(ep.step(a).unwrap().success, i + 1 == path.len(), "seed {seed}: {path:?}");
        }
    }
}

#[test]
fn rubiks_cube_scrambles_are_deterministic_per_seed() {
    let e = env("rubiks_cube");
    let p = params(&e, &[]);
    let start = |seed: u64, stream: u64| e.reset(seed, stream, &p).unwrap().render().unwrap();
    assert_eq!(start(5, 0), start(5, 0));
    assert_eq!(start(5, 0), start(5, 3), "a group shares its scramble");
    let distinct: std::collections::HashSet<String> = (0..20).map(|s| start(s, 0)).collect();
    assert!(distinct.len() >= 15, "{} distinct scrambles in 20 seeds", distinct.len());
}

// ---------------------------------------------------------------------------------------------
// check and train

#[test]
fn check_passes_on_both_envs_and_their_experiments() {
    let host = host();
    for script in ["envs/game_2048.rhai", "envs/rubiks_cube.rhai", "scripts/game_2048.rhai", "scripts/rubiks_cube.rhai"]
    {
        let lines: Vec<String> = check(&host, &repo().join(script), 20, &[])
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap_or_else(|e| panic!("{script}: {e}"));
        assert!(!lines.is_empty() && lines.iter().all(|l| l.starts_with("ok: ")), "{script}: {lines:?}");
    }
}

/// tests/train.rs's TINY run: the tiny random-weight model, 2 groups x 2 episodes.
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
    "optim.lr=1e-3",
];

/// `ragen-lab train` for 2 steps on an experiment, in a temp project holding it and the scripts
/// it names; the run's metric lines.
fn train_two_steps(game: &str) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let env_file = format!("envs/{game}.rhai");
    let script = format!("scripts/{game}.rhai");
    for f in [env_file.as_str(), "prompts/ragen.rhai", "rewards/format_penalty.rhai", script.as_str()] {
        let to = dir.path().join(f);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(repo().join(f), to).unwrap();
    }
    let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .current_dir(dir.path())
        .arg("train")
        .args(TINY)
        .args(["--env", &script, "--steps", "2", "--run-dir", "runs/two"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ragen-lab train on {script} failed:\n{text}");
    let metrics = fs::read_to_string(dir.path().join("runs/two/metrics.jsonl")).unwrap();
    metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn train_game_2048_two_steps_on_the_tiny_model() {
    let m = train_two_steps("game_2048");
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m[1]["rollout/reward_mean"].is_number(), "{}", m[1]);
}

#[test]
fn train_rubiks_cube_two_steps_on_the_tiny_model() {
    let m = train_two_steps("rubiks_cube");
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m[1]["rollout/reward_mean"].is_number(), "{}", m[1]);
}
