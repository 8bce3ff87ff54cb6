//! RAGEN-2's games as scripts, against the reference's rules (`ragen/env/countdown`, `sudoku`,
//! `game_2048`, `rubikscube`): hand-worked steps with their rewards, flags and observations,
//! the generators' promises (solvable, unique, in range), the cube's moves against a
//! transcription of RAGEN's sticker cycles, the solvers reaching success, determinism per seed,
//! `check` on the envs and their experiments, and a two-step `ragen-lab train` on the tiny
//! model for each experiment.
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

fn episode(name: &str, seed: u64, overrides: &[(&str, &str)]) -> Episode {
    let e = env(name);
    let p = params(&e, overrides);
    e.reset(seed, 0, &p).unwrap()
}

/// One step as (reward, done, success, valid, effective).
fn step(ep: &mut Episode, action: &str) -> (f64, bool, bool, bool, bool) {
    let o = ep.step(action).unwrap();
    (o.reward, o.done, o.success, o.valid, o.effective)
}

fn state(ep: &Episode) -> Value {
    ep.state_json()
}

fn ints(v: &Value) -> Vec<i64> {
    v.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect()
}

/// `ragen-lab check` on a script of the repo: every line `ok: …`.
fn check_ok(path: &str, episodes: u64) {
    let lines: Vec<String> = check(&host(), &repo().join(path), episodes, &[])
        .into_iter()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    assert!(!lines.is_empty() && lines.iter().all(|l| l.starts_with("ok: ")), "{path}: {lines:?}");
}

/// `ragen-lab train` for two steps on the tiny random-weight model, in a temp project holding
/// the experiment and the scripts it names; returns the run's metric lines.
fn train_two_steps(game: &str) -> Vec<Value> {
    train_two_steps_with(game, &[])
}

/// The same with extra flags (`--param k=v`, `--set k=v`).
fn train_two_steps_with(game: &str, extra: &[&str]) -> Vec<Value> {
    let dir = tempfile::tempdir().unwrap();
    let env_script = format!("envs/{game}.rhai");
    let experiment = format!("scripts/{game}.rhai");
    for f in [env_script.as_str(), "prompts/ragen.rhai", "rewards/format_penalty.rhai", experiment.as_str()] {
        let to = dir.path().join(f);
        fs::create_dir_all(to.parent().unwrap()).unwrap();
        fs::copy(repo().join(f), to).unwrap();
    }
    // tests/train.rs's TINY, with the experiment's own GRPO (no critic: the quicker path).
    let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .current_dir(dir.path())
        .args(["train", "--env", &experiment, "--model", "tiny-llama", "--quiet", "--steps", "2"])
        .args(["--run-dir", "runs/two"])
        .args(["--set", "rollout.env_groups=2", "--set", "rollout.group_size=2"])
        .args(["--set", "rollout.response_length=12", "--set", "train.val_every=0"])
        .args(["--set", "optim.lr=1e-3"])
        .args(extra)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ragen-lab train failed:\n{text}");
    let metrics = fs::read_to_string(dir.path().join("runs/two/metrics.jsonl")).unwrap();
    metrics.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

// ---- Countdown ---------------------------------------------------------------------------------

fn countdown(nums: &str, target: &str) -> Episode {
    episode("countdown", 0, &[("nums", nums), ("target", target)])
}

/// RAGEN's score of one answer to a fixed puzzle, and the observation after it.
fn countdown_score(nums: &str, target: &str, answer: &str) -> (f64, String) {
    let mut ep = countdown(nums, target);
    let (reward, done, success, valid, effective) = step(&mut ep, answer);
    assert!(done && valid, "{answer}: one answer ends the episode, always valid");
    assert_eq!(success, reward == 1.0, "{answer}");
    assert_eq!(effective, reward > 0.0, "{answer}");
    (reward, ep.render().unwrap())
}

#[test]
fn countdown_renders_the_puzzle_and_the_points_like_ragen() {
    let ep = countdown("3,5,2", "4");
    assert_eq!(ep.render().unwrap(), "Target: 4, nums: [3, 5, 2]");
    let info = env("countdown").info(&params(&env("countdown"), &[])).unwrap();
    assert_eq!((info.max_turns, info.max_actions, info.max_actions_per_turn), (1, 1, 1));
    assert!(info.actions.is_empty(), "free-text answers");
    assert!(info.instruction.starts_with("You are solving the Countdown puzzle."));
    // Python prints the ints 0 and 1 and the float 0.1.
    assert_eq!(countdown_score("3,5,2", "4", "2 + 5 - 3"), (1.0, "Your answer get 1 points.".into()));
    assert_eq!(countdown_score("3,5,2", "4", "2 + 5 + 3"), (0.1, "Your answer get 0.1 points.".into()));
    assert_eq!(countdown_score("3,5,2", "4", "2 + 5"), (0.0, "Your answer get 0 points.".into()));
}

#[test]
fn countdown_scores_each_answer_as_ragens_compute_reward() {
    let s = |answer: &str| countdown_score("3,5,2", "4", answer).0;
    // 1: the target, with each number exactly once.
    assert_eq!(s("(5 - 3) * 2"), 1.0);
    assert_eq!(s("-3 + 5 + 2"), 1.0, "unary minus, as in RAGEN's own example");
    assert_eq!(s("((((2 + 5)))) - 3"), 1.0);
    assert_eq!(s("2*5-3*2"), 0.0, "a number used twice is not the puzzle's numbers");
    assert_eq!(s("5 + 3 - 2 * 2 / 2 * 1"), 0.0, "extra numbers");
    // 0: the digits written are not exactly 3, 5, 2 (re.findall(r'\d+')).
    assert_eq!(s("2 + 5 - 3 = 4"), 0.0, "the `= 4` adds a number");
    assert_eq!(s("two plus five"), 0.0);
    assert_eq!(s(""), 0.0);
    assert_eq!(s("2 + 5 - 13"), 0.0);
    // 0.1: the right numbers, but not the target or not an expression.
    assert_eq!(s("5 * 2 / 3"), 0.1, "10/3");
    assert_eq!(s("2.5 + 3"), 0.1, "2.5 is the digits 2 and 5; Python evaluates it to 5.5");
    assert_eq!(s("2 + 5 - 3 apples"), 0.1, "Python's eval fails on the name");
    assert_eq!(s("05 - 3 + 2"), 0.1, "Python refuses a leading zero");
    assert_eq!(s("(2 + 5 - 3"), 0.1, "unbalanced");
    assert_eq!(s("2 + 5 3"), 0.1);
    // Differs from RAGEN (Python's eval gives 4 and scores 1): ** is not parsed.
    assert_eq!(s("(5 - 3) ** 2"), 0.1);
    // Division: exact fractions, and a division by zero does not evaluate.
    assert_eq!(countdown_score("6,4,3", "8", "6 / 3 * 4").0, 1.0);
    assert_eq!(countdown_score("4,4,6", "1", "6 / (4 - 4)").0, 0.1);
    assert_eq!(countdown_score("1,3,4,6", "24", "6 / (1 - 3 / 4)").0, 1.0, "a fraction in between");
}

#[test]
fn countdown_puzzles_are_solvable_by_signs_and_within_ragens_ranges() {
    let e = env("countdown");
    let p = params(&e, &[]);
    let mut sizes = [0; 5];
    for seed in 0..60 {
        let ep = e.reset(seed, 0, &p).unwrap();
        let s = state(&ep);
        let nums = ints(&s["nums"]);
        let target = s["target"].as_i64().unwrap();
        sizes[nums.len()] += 1;
        assert!((3..=4).contains(&nums.len()) && nums.iter().all(|n| (1..=99).contains(n)), "{s}");
        assert!((1..=99).contains(&target), "{s}");
        // RAGEN's has_solution: some signs make the sum the target.
        let signed = (0..1 << nums.len()).any(|m: u32| {
            nums.iter().enumerate().map(|(i, n)| if m >> i & 1 == 1 { -n } else { *n }).sum::<i64>() == target
        });
        assert!(signed, "seed {seed}: {s}");
    }
    assert!(sizes[3] > 10 && sizes[4] > 10, "both sizes drawn: {sizes:?}");
}

#[test]
fn countdown_solver_answers_every_puzzle_with_full_points() {
    let e = env("countdown");
    for ops in ["+-", "+-*/"] {
        let p = params(&e, &[("ops", ops)]);
        for seed in 0..12 {
            let mut ep = e.reset(seed, 0, &p).unwrap();
            let plan = ep.solve().unwrap().unwrap();
            assert_eq!(plan.len(), 1, "ops {ops} seed {seed}: {plan:?}");
            let (reward, done, success, ..) = step(&mut ep, &plan[0]);
            assert!(reward == 1.0 && done && success, "ops {ops} seed {seed}: {plan:?} on {}", state(&ep));
            assert_eq!(ep.solve().unwrap().unwrap(), Vec::<String>::new(), "nothing to solve once answered");
        }
    }
    // A puzzle that needs * and /: the search, parenthesised.
    let mut ep = countdown("1,3,4,6", "24");
    let plan = ep.solve().unwrap().unwrap();
    assert_eq!(step(&mut ep, &plan[0]).0, 1.0, "{plan:?}");
    assert_eq!(countdown("2,2", "7").solve().unwrap().unwrap(), Vec::<String>::new(), "no expression makes 7");
}

#[test]
fn countdown_is_deterministic_per_seed() {
    let e = env("countdown");
    let p = params(&e, &[]);
    let a: Vec<Value> = (0..10).map(|s| state(&e.reset(s, 0, &p).unwrap())).collect();
    let b: Vec<Value> = (0..10).map(|s| state(&e.reset(s, 7, &p).unwrap())).collect();
    assert_eq!(a, b, "the stream does not change the puzzle");
    let distinct: std::collections::HashSet<String> = a.iter().map(Value::to_string).collect();
    assert!(distinct.len() >= 9, "seeds give different puzzles: {a:?}");
}

#[test]
fn countdown_env_and_experiment_pass_check() {
    check_ok("envs/countdown.rhai", 30);
    check_ok("scripts/countdown.rhai", 10);
}

#[test]
fn countdown_trains_two_steps_on_the_tiny_model() {
    assert_eq!(train_two_steps("countdown").len(), 2);
}

// ---- Sudoku ------------------------------------------------------------------------------------

/// The 4x4 board 1234/3412/2143/4321 with four cells empty.
const SMALL: &str = "1.34,34.2,21.3,4.21";

fn sudoku(puzzle: &str, more: &[(&str, &str)]) -> Episode {
    let mut o = vec![("puzzle", puzzle)];
    o.extend_from_slice(more);
    episode("sudoku", 0, &o)
}

#[test]
fn sudoku_places_numbers_and_pays_one_for_the_solved_board() {
    let mut ep = sudoku(SMALL, &[]);
    assert_eq!(ep.render().unwrap(), "| 1 . 3 4 | 3 4 . 2 | 2 1 . 3 | 4 . 2 1 ");
    // A placement that fits: effective, no reward yet.
    assert_eq!(step(&mut ep, "place 2 at row 1 col 2"), (0.0, false, false, true, true));
    assert_eq!(ep.render().unwrap(), "| 1 2 3 4 | 3 4 . 2 | 2 1 . 3 | 4 . 2 1 ");
    // Invalid (RAGEN action_is_valid false): a given cell, off the board, a value out of range,
    // no value, unreadable text.
    for bad in [
        "1,1,1",
        "5,5,1",
        "0,2,1",
        "2,3,5",
        "2,3,0",
        "row 2 col 3",
        "hello",
        "rows 2 col 3 value 1",
        "row 3 col 3: 4",
        "place 1 at row 2 column 3",
        "--2,3,1",
    ] {
        assert_eq!(step(&mut ep, bad), (0.0, false, false, false, false), "{bad}");
    }
    // Valid but against the rules (4 is in row 2): not effective, the board unchanged.
    assert_eq!(step(&mut ep, "2,3,4"), (0.0, false, false, true, false));
    assert_eq!(ep.render().unwrap(), "| 1 2 3 4 | 3 4 . 2 | 2 1 . 3 | 4 . 2 1 ");
    // The other formats: `r c v`, and words with the value after them. (RAGEN wants the words
    // `row` and `col` on their own and a bare number after each, so `column` and `3:` above are
    // invalid.)
    assert_eq!(step(&mut ep, "2 3 1"), (0.0, false, false, true, true));
    assert_eq!(step(&mut ep, "Row 3, Col 3, value 4"), (0.0, false, false, true, true));
    assert_eq!(ep.render().unwrap(), "| 1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 . 2 1 ");
    assert_eq!(step(&mut ep, "4,2,3"), (1.0, true, true, true, true));
    assert_eq!(ep.render().unwrap(), "| 1 2 3 4 | 3 4 1 2 | 2 1 4 3 | 4 3 2 1 ");
    assert_eq!(state(&ep)["steps"], 16, "every action is a step, the invalid ones too");
}

#[test]
fn sudoku_allows_overwriting_a_placement_but_not_with_the_same_value() {
    // Few givens, so a cell has several values that fit.
    let mut ep = sudoku("1...,....,....,....", &[]);
    assert_eq!(step(&mut ep, "1,2,2"), (0.0, false, false, true, true));
    assert_eq!(step(&mut ep, "1,2,3"), (0.0, false, false, true, true), "RAGEN lets a placement be replaced");
    assert_eq!(step(&mut ep, "1,2,3"), (0.0, false, false, true, false), "3 is in the row: the cell itself");
    assert!(ep.render().unwrap().starts_with("| 1 3 . . | "));
}

#[test]
fn sudoku_ends_at_max_steps_counting_every_action() {
    let mut ep = sudoku(SMALL, &[("max_steps", "3")]);
    assert_eq!(step(&mut ep, "nonsense"), (0.0, false, false, false, false));
    assert_eq!(step(&mut ep, "2,3,4"), (0.0, false, false, true, false));
    assert_eq!(step(&mut ep, "1,2,2"), (0.0, true, false, true, true), "the third step is the last");
}

#[test]
fn sudoku_renders_the_empty_cells_coordinates_on_request() {
    let mut ep = sudoku(SMALL, &[("coordinates", "true")]);
    assert_eq!(
        ep.render().unwrap(),
        "| 1 . 3 4 | 3 4 . 2 | 2 1 . 3 | 4 . 2 1 \nEmpty positions to be filled are at (1,2), (2,3), (3,3), (4,2)."
    );
    for a in ["1,2,2", "2,3,1", "3,3,4"] {
        step(&mut ep, a);
    }
    assert!(ep.render().unwrap().ends_with(" \nEmpty position to be filled is at (4,2)."));
    step(&mut ep, "4,2,3");
    assert!(ep.render().unwrap().ends_with(" \nNo empty positions found (board might be complete)."));
}

#[test]
fn sudoku_variants_follow_ragens_configs() {
    let e = env("sudoku");
    let simple = e.info(&params(&e, &[])).unwrap();
    assert_eq!((simple.max_turns, simple.max_actions_per_turn, simple.max_actions), (5, 5, 20));
    assert!(simple.instruction.contains("every row, column, and 3x3 box contains the numbers 1-9"));
    let medium = e.info(&params(&e, &[("difficulty", "medium"), ("max_actions", "30")])).unwrap();
    assert_eq!(medium.max_actions, 30);
    let small = e.info(&params(&e, &[("size", "4")])).unwrap();
    assert!(small.instruction.contains("2x2 box contains the numbers 1-4"), "{}", small.instruction);
    assert!(e.reset(0, 0, &params(&e, &[("size", "5")])).is_err(), "only 4x4 and 9x9");
}

/// Solutions of a board (0 = empty), counted up to `limit` by plain backtracking.
fn count_solutions(board: &mut Vec<i64>, n: usize, limit: usize) -> usize {
    let b = if n == 4 { 2 } else { 3 };
    let Some(i) = board.iter().position(|&v| v == 0) else { return 1 };
    let (r, c) = (i / n, i % n);
    let mut found = 0;
    for v in 1..=n as i64 {
        let clash = (0..n).any(|k| {
            board[r * n + k] == v
                || board[k * n + c] == v
                || board[((r / b) * b + k / b) * n + (c / b) * b + k % b] == v
        });
        if clash {
            continue;
        }
        board[i] = v;
        found += count_solutions(board, n, limit - found);
        board[i] = 0;
        if found >= limit {
            break;
        }
    }
    found
}

fn is_solution(board: &[i64], n: usize) -> bool {
    let b = if n == 4 { 2 } else { 3 };
    let full: Vec<i64> = (1..=n as i64).collect();
    let sorted = |mut v: Vec<i64>| {
        v.sort();
        v
    };
    (0..n).all(|k| {
        sorted((0..n).map(|j| board[k * n + j]).collect()) == full
            && sorted((0..n).map(|j| board[j * n + k]).collect()) == full
            && sorted((0..n).map(|j| board[((k / b) * b + j / b) * n + (k % b) * b + j % b]).collect()) == full
    })
}

#[test]
fn sudoku_puzzles_have_one_solution_and_ragens_number_of_givens() {
    let e = env("sudoku");
    for (size, difficulty, clues, seeds) in
        [(4, "easy", 10, 0..12u64), (4, "medium", 9, 0..12), (9, "easy", 36, 0..3), (9, "medium", 30, 0..3)]
    {
        let p = params(&e, &[("size", &size.to_string()), ("difficulty", difficulty)]);
        for seed in seeds {
            let s = state(&e.reset(seed, 0, &p).unwrap());
            let givens = ints(&s["givens"]);
            let solution = ints(&s["solution"]);
            let n = size as usize;
            let at = format!("{size}x{size} {difficulty} seed {seed}");
            assert!(is_solution(&solution, n), "{at}");
            assert!(givens.iter().zip(&solution).all(|(g, v)| *g == 0 || g == v), "{at}");
            assert_eq!(givens.iter().filter(|&&g| g != 0).count(), clues, "{at}");
            assert_eq!(count_solutions(&mut givens.clone(), n, 2), 1, "{at}: unique");
            assert_eq!(s["board"], s["givens"], "{at}");
        }
    }
}

#[test]
fn sudoku_solver_fills_the_board_from_several_seeds() {
    let e = env("sudoku");
    for (size, seeds) in [("4", 0..8u64), ("9", 0..2)] {
        let p = params(&e, &[("size", size)]);
        for seed in seeds {
            let mut ep = e.reset(seed, 0, &p).unwrap();
            let plan = ep.solve().unwrap().unwrap();
            let empty = ints(&state(&ep)["board"]).iter().filter(|&&v| v == 0).count();
            assert_eq!(plan.len(), empty, "one placement per empty cell");
            let mut last = (0.0, false, false, true, true);
            for a in &plan {
                last = step(&mut ep, a);
                assert!(last.3 && last.4, "{size} seed {seed}: {a} in {plan:?}");
            }
            assert_eq!(last, (1.0, true, true, true, true), "{size} seed {seed}");
            assert_eq!(ep.solve().unwrap().unwrap(), Vec::<String>::new(), "nothing left to place");
        }
    }
    // From a board with a wrong placement: it is overwritten with the right value.
    let mut ep = sudoku("1...,....,....,....", &[]);
    step(&mut ep, "1,2,4");
    let plan = ep.solve().unwrap().unwrap();
    for a in &plan {
        step(&mut ep, a);
    }
    assert!(ep.done && state(&ep)["board"] == state(&ep)["solution"], "{plan:?}");
}

#[test]
fn sudoku_is_deterministic_per_seed() {
    let e = env("sudoku");
    let p = params(&e, &[("size", "4")]);
    let a: Vec<Value> = (0..8).map(|s| state(&e.reset(s, 0, &p).unwrap())).collect();
    let b: Vec<Value> = (0..8).map(|s| state(&e.reset(s, 3, &p).unwrap())).collect();
    assert_eq!(a, b);
    let distinct: std::collections::HashSet<String> = a.iter().map(|s| s["givens"].to_string()).collect();
    assert!(distinct.len() >= 7, "seeds give different puzzles");
}

#[test]
fn sudoku_env_and_experiment_pass_check() {
    check_ok("envs/sudoku.rhai", 30);
    check_ok("scripts/sudoku.rhai", 10);
}

#[test]
fn sudoku_trains_two_steps_on_the_tiny_model() {
    assert_eq!(train_two_steps("sudoku").len(), 2);
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
fn check_passes_on_2048_and_the_cube_and_their_experiments() {
    for script in ["envs/game_2048.rhai", "envs/rubiks_cube.rhai", "scripts/game_2048.rhai", "scripts/rubiks_cube.rhai"]
    {
        check_ok(script, 20);
    }
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

/// RAGEN-2's env variants that are params of the shipped envs (CoordSokoban, CoordFrozenLake,
/// Bandit's name pairs) train too, training and validating on their variant.
#[test]
fn ragen2_env_variants_train_two_steps_on_the_tiny_model() {
    for (game, param) in [
        ("sokoban", "observation_format=grid_coord"),
        ("frozenlake", "observation_format=grid_coord"),
        ("bandit", "pairs=train"),
    ] {
        let m = train_two_steps_with(game, &["--param", param, "--val-param", param]);
        assert_eq!(m.len(), 2, "{game} {param}: {m:?}");
    }
}
