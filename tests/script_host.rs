//! The script host end to end: the sandbox and every bad input of issue 2, the shipped envs'
//! rules, the prompt template and reward scripts, live reload, and the CLI contracts
//! (`play --json`, `check`, `new`, `play --watch`).
use std::collections::{HashSet, VecDeque};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use ragen_lab::cli::check::check;
use ragen_lab::script::check::check_env;
use ragen_lab::script::pattern;
use ragen_lab::script::turn::parse_turn;
use ragen_lab::script::{
    shape_all, EnvScript, Experiment, Host, Limits, Loaded, PromptScript, RewardScript, Role, ScriptError, TurnContext,
    Update, WatchMode, Watcher,
};
use serde_json::{json, Map, Value};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn repo_host() -> Arc<Host> {
    Host::new(repo(), Limits::default())
}

fn env(name: &str) -> EnvScript {
    EnvScript::load(&repo_host(), Path::new(&format!("envs/{name}.rhai"))).unwrap()
}

fn params(e: &EnvScript, overrides: &[(&str, &str)]) -> Map<String, Value> {
    let o: Vec<(String, String)> = overrides.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    e.params(&o).unwrap()
}

/// A temporary project with the given files (relative path, content).
fn project(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (p, text) in files {
        let full = dir.path().join(p);
        std::fs::create_dir_all(full.parent().unwrap()).unwrap();
        std::fs::write(full, text).unwrap();
    }
    dir
}

const HEAD: &str = r#"fn describe(p) { #{ name: "t", instruction: "i", actions: ["A"] } }
fn reset(seed, p) { #{ n: 0 } }
fn render(s) { `n=${s.n}` }
"#;

/// Small limits, so the runaway scripts below stop in milliseconds.
fn tight() -> Limits {
    Limits { max_operations: 200_000, call_timeout: Duration::from_millis(500), ..Limits::default() }
}

/// Loads `envs/t.rhai` = HEAD + `step_src` and plays one step; returns the error.
fn step_error(step_src: &str) -> ScriptError {
    let dir = project(&[("envs/t.rhai", &format!("{HEAD}{step_src}"))]);
    let host = Host::new(dir.path(), tight());
    let e = EnvScript::load(&host, Path::new("envs/t.rhai")).and_then(|e| {
        let mut ep = e.reset(0, 0, &Map::new())?;
        ep.step("A")
    });
    e.expect_err("the bad script should fail")
}

// ---- the sandbox and issue 2's bad inputs --------------------------------------------------

#[test]
fn a_syntax_error_names_path_line_and_column() {
    let e = step_error("fn step(s, a) {\n  let x = ;\n}\n");
    assert_eq!((e.path.as_str(), e.line, e.col), ("envs/t.rhai", 5, 11), "{e}");
    assert!(e.to_string().starts_with("envs/t.rhai:5:11: syntax error"), "{e}");
}

#[test]
fn a_runtime_error_inside_step_names_its_line_and_the_call_chain() {
    let e = step_error("fn step(s, a) { helper(s) }\nfn helper(s) {\n  throw \"boom\";\n}\n");
    assert_eq!((e.line, e.col), (6, 3), "{e}");
    assert!(e.message.contains("boom"), "{e}");
    assert_eq!(e.call_chain, ["helper (called at envs/t.rhai:4:17)"], "{e}");
}

#[test]
fn an_endless_loop_stops_at_the_operation_budget() {
    let e = step_error("fn step(s, a) {\n  loop { s.n += 1; }\n}\n");
    assert!(e.message.contains("too many operations"), "{e}");
    assert_eq!(e.line, 4, "points at fn step: {e}");
}

#[test]
fn an_endless_loop_stops_at_the_wall_clock_budget_too() {
    let dir = project(&[("envs/t.rhai", &format!("{HEAD}fn step(s, a) {{ loop {{ }} }}\n"))]);
    let limits = Limits { max_operations: 0, call_timeout: Duration::from_millis(100), ..Limits::default() };
    let e = EnvScript::load(&Host::new(dir.path(), limits), Path::new("envs/t.rhai")).unwrap();
    let err = e.reset(0, 0, &Map::new()).unwrap().step("A").unwrap_err();
    assert!(err.message.contains("timed out"), "{err}");
}

#[test]
fn string_and_array_bombs_hit_the_size_limits() {
    let e = step_error("fn step(s, a) { let t = \"xy\"; loop { t += t; } }\n");
    assert!(e.message.contains("too large"), "{e}");
    let e = step_error("fn step(s, a) { let t = [1, 2]; loop { t += t; } }\n");
    assert!(e.message.contains("too large"), "{e}");
}

#[test]
fn deep_recursion_is_stopped() {
    let e = step_error("fn step(s, a) { deep(0) }\nfn deep(n) { deep(n + 1) }\n");
    assert!(e.message.contains("stack overflow"), "{e}");
}

#[test]
fn eval_is_disabled() {
    let e = step_error("fn step(s, a) { eval(\"1\") }\n");
    assert!(e.message.contains("'eval' is disabled") && e.line == 4, "{e}");
}

#[test]
fn imports_outside_the_script_folders_are_refused() {
    for (import, why) in
        [("/etc/hostname", "absolute"), ("envs/../secret", "`..`"), ("lib/helper", "name a file under envs/")]
    {
        let e = step_error(&format!("fn step(s, a) {{ import \"{import}\" as h; h::f() }}\n"));
        assert!(e.message.contains(why), "{import}: {e}");
        assert_eq!(e.line, 4, "points at the import: {e}");
    }
}

#[test]
fn imports_inside_the_script_folders_work_and_change_the_hash() {
    let dir = project(&[
        ("envs/lib.rhai", "fn bonus() { 2.0 }\n"),
        (
            "envs/t.rhai",
            &format!("{HEAD}fn step(s, a) {{ import \"envs/lib\" as lib; #{{ reward: lib::bonus(), done: true }} }}\n"),
        ),
    ]);
    let host = Host::new(dir.path(), Limits::default());
    let e = EnvScript::load(&host, Path::new("envs/t.rhai")).unwrap();
    assert_eq!(e.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 2.0);
    assert_eq!(e.script().sources.len(), 2);
    std::fs::write(dir.path().join("envs/lib.rhai"), "fn bonus() { 3.0 }\n").unwrap();
    let e2 = EnvScript::load(&host, Path::new("envs/t.rhai")).unwrap();
    assert_ne!(e.version(), e2.version());
    // The old version is self-contained: the edit on disk does not leak into it.
    assert_eq!(e.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 2.0);
    assert_eq!(e2.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 3.0);
}

#[test]
fn a_step_returning_the_wrong_shape_is_named() {
    let e = step_error("fn step(s, a) { \"moved\" }\n");
    assert!(e.message.contains("step must return a map") && e.message.contains("got a string"), "{e}");
    let e = step_error("fn step(s, a) { #{ reward: 1.0, done: false, sucess: true } }\n");
    assert!(e.message.contains("unknown key `sucess`"), "{e}");
    let e = step_error("fn step(s, a) { #{ reward: \"1\", done: false } }\n");
    assert!(e.message.contains("`reward` must be a number; got a string"), "{e}");
    assert_eq!((e.line, e.col), (4, 1), "points at fn step: {e}");
}

#[test]
fn a_missing_function_is_named_with_its_parameters() {
    let dir = project(&[("envs/t.rhai", HEAD)]);
    let e = EnvScript::load(&Host::new(dir.path(), Limits::default()), Path::new("envs/t.rhai")).unwrap_err();
    assert_eq!(e.to_string(), "envs/t.rhai: missing `fn step(state, action)`");
}

#[test]
fn undefined_variables_and_missing_map_keys_are_errors() {
    let e = step_error("fn step(s, a) { #{ reward: rewrd, done: true } }\n");
    assert!(e.message.contains("rewrd") && e.line == 4, "{e}");
    let e = step_error("fn step(s, a) { let k = s.count; #{ reward: 0.0, done: true } }\n");
    assert!(e.message.contains("property not found: count"), "{e}");
}

#[test]
fn a_reset_that_is_not_deterministic_fails_the_check() {
    let src = "fn describe(p) { #{ name: \"t\", instruction: \"i\", actions: [\"A\"] } }\n\
               fn reset(seed, p) { let t = timestamp(); let n = 0; while t.elapsed < 0.002 { n += 1; } #{ n: n } }\n\
               fn render(s) { `${s.n}` }\n\
               fn step(s, a) { #{ reward: 0.0, done: true } }\n";
    let dir = project(&[("envs/t.rhai", src)]);
    let e = EnvScript::load(&Host::new(dir.path(), Limits::default()), Path::new("envs/t.rhai")).unwrap();
    let err = check_env(&e, &Map::new(), 3).unwrap_err();
    assert!(err.to_string().starts_with("envs/t.rhai: not deterministic: seed 0"), "{err}");
}

#[test]
fn rng_is_refused_outside_reset_and_step() {
    let dir = project(&[(
        "envs/t.rhai",
        &format!(
            "{}fn step(s, a) {{ #{{ reward: 0.0, done: true }} }}\n",
            HEAD.replace("`n=${s.n}`", "`${rng::float()}`")
        ),
    )]);
    let e = EnvScript::load(&Host::new(dir.path(), Limits::default()), Path::new("envs/t.rhai")).unwrap();
    let err = e.reset(0, 0, &Map::new()).unwrap().render().unwrap_err();
    assert!(err.message.contains("only inside reset and step"), "{err}");
}

#[test]
fn params_are_overridden_and_unknown_ones_named() {
    let e = env("sokoban");
    let p = params(&e, &[("size", "8"), ("boxes", "2")]);
    assert_eq!((p["size"].clone(), p["boxes"].clone()), (json!(8), json!(2)));
    let err = e.params(&[("box".into(), "2".into())]).unwrap_err();
    assert!(err.message.contains("no parameter `box`") && err.message.contains("boxes"), "{err}");
}

// ---- randomness: a group shares its start, episodes slip differently -------------------------

#[test]
fn a_group_shares_its_start_state_but_not_its_transitions() {
    let e = env("frozenlake");
    let p = params(&e, &[]);
    let starts: HashSet<String> = (0..8).map(|stream| e.reset(5, stream, &p).unwrap().render().unwrap()).collect();
    assert_eq!(starts.len(), 1);
    let after: HashSet<String> = (0..16)
        .map(|stream| {
            let mut ep = e.reset(5, stream, &p).unwrap();
            let a = ep.valid_actions().unwrap()[1].clone();
            ep.step(&a).unwrap();
            ep.render().unwrap()
        })
        .collect();
    assert!(after.len() > 1, "16 episodes of one group all moved alike");
    assert_ne!(e.reset(6, 0, &p).unwrap().render().unwrap(), e.reset(5, 0, &p).unwrap().render().unwrap());
}

// ---- Sokoban --------------------------------------------------------------------------------

fn sokoban_level(level: &str) -> ragen_lab::script::Episode {
    let e = env("sokoban");
    let p = params(&e, &[("level", level)]);
    e.reset(0, 0, &p).unwrap()
}

#[test]
fn sokoban_pushes_boxes_and_pays_for_placing_them() {
    let mut ep = sokoban_level("######,#PX_O#,######");
    let o = ep.step("Right").unwrap();
    assert_eq!((o.reward, o.done, o.effective), (-0.1, false, true));
    assert_eq!(ep.render().unwrap(), "######\n#_PXO#\n######");
    let o = ep.step("right").unwrap();
    assert_eq!((o.reward, o.done, o.success), (-0.1 + 1.0 + 10.0, true, true));
    assert_eq!(ep.render().unwrap(), "######\n#__P√#\n######");
}

#[test]
fn sokoban_walls_and_blocked_boxes_stop_the_player() {
    let mut ep = sokoban_level("#####,#P#_#,#X__#,#X_O#,#####");
    let o = ep.step("Up").unwrap();
    assert_eq!((o.reward, o.effective, o.valid), (-0.1, false, true));
    let o = ep.step("Right").unwrap();
    assert!(!o.effective, "wall");
    let o = ep.step("Down").unwrap();
    assert!(!o.effective, "a box cannot be pushed into another box");
    assert_eq!(ep.render().unwrap(), "#####\n#P#_#\n#X__#\n#X_O#\n#####");
    let o = ep.step("Jump").unwrap();
    assert!(!o.valid && o.reward == 0.0);
}

#[test]
fn sokoban_pushing_a_box_off_a_target_costs_one() {
    let mut ep = sokoban_level("######,#P√_O#,######");
    let o = ep.step("Right").unwrap();
    assert!((o.reward - (-0.1 - 1.0)).abs() < 1e-9, "{o:?}");
    assert_eq!(ep.render().unwrap(), "######\n#_SXO#\n######");
    let o = ep.step("Right").unwrap();
    assert!((o.reward - (-0.1 + 1.0 + 10.0)).abs() < 1e-9 && o.success, "{o:?}");
}

#[test]
fn sokoban_ends_after_max_steps() {
    let e = env("sokoban");
    let p = params(&e, &[("level", "#####,#P_X_O#,#####".replace("#P_X_O#", "#PXO#").as_str()), ("max_steps", "3")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    assert!(!ep.step("Left").unwrap().done);
    assert!(!ep.step("Left").unwrap().done);
    assert!(ep.step("Left").unwrap().done);
}

/// Breadth-first search over (player, boxes) with push rules; the fewest steps to solve.
fn solve(grid: &str) -> Option<usize> {
    let rows: Vec<Vec<char>> = grid.lines().map(|l| l.chars().collect()).collect();
    let w = rows[0].len();
    let cells: Vec<char> = rows.concat();
    let wall = |i: usize| cells[i] == '#';
    let targets: Vec<usize> = (0..cells.len()).filter(|&i| matches!(cells[i], 'O' | '√' | 'S')).collect();
    let mut boxes: Vec<usize> = (0..cells.len()).filter(|&i| matches!(cells[i], 'X' | '√')).collect();
    boxes.sort();
    let player = (0..cells.len()).find(|&i| matches!(cells[i], 'P' | 'S'))?;
    let mut seen = HashSet::new();
    let mut queue = VecDeque::from([(player, boxes, 0usize)]);
    while let Some((p, b, d)) = queue.pop_front() {
        if b.iter().all(|x| targets.contains(x)) {
            return Some(d);
        }
        if !seen.insert((p, b.clone())) || d > 60 {
            continue;
        }
        for delta in [-(w as isize), w as isize, -1, 1] {
            let n = (p as isize + delta) as usize;
            if wall(n) {
                continue;
            }
            let mut nb = b.clone();
            if let Some(k) = b.iter().position(|&x| x == n) {
                let to = (n as isize + delta) as usize;
                if wall(to) || b.contains(&to) {
                    continue;
                }
                nb[k] = to;
                nb.sort();
            }
            queue.push_back((n, nb, d + 1));
        }
    }
    None
}

#[test]
fn generated_sokoban_levels_are_solvable_and_not_solved_at_the_start() {
    let e = env("sokoban");
    for (overrides, seeds) in [(vec![], 0..40u64), (vec![("size", "8"), ("boxes", "2")], 0..8u64)] {
        let p = params(&e, &overrides);
        for seed in seeds {
            let grid = e.reset(seed, 0, &p).unwrap().render().unwrap();
            let steps = solve(&grid).unwrap_or_else(|| panic!("seed {seed} {overrides:?} unsolvable:\n{grid}"));
            assert!(steps > 0, "seed {seed} starts solved:\n{grid}");
            let n: usize = p["size"].as_u64().unwrap() as usize;
            assert_eq!(grid.lines().count(), n);
            assert!(grid.lines().all(|l| l.chars().count() == n));
            assert_eq!(grid.matches(['X', '√']).count(), p["boxes"].as_u64().unwrap() as usize, "{grid}");
        }
    }
}

#[test]
fn sokoban_grid_coord_writes_ragen2s_coordinate_lines_above_the_grid() {
    let e = env("sokoban");
    let p = params(&e, &[("level", "######,#PX_O#,#_√__#,######"), ("observation_format", "grid_coord")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    let walls = "Walls: (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 5), (2, 0), (2, 5), \
                 (3, 0), (3, 1), (3, 2), (3, 3), (3, 4), (3, 5)";
    // RAGEN-2's `_render_text('grid_coord')`: "Coordinates: \n" + coordinates + "\nGrid Map: \n" + grid.
    assert_eq!(
        ep.render().unwrap(),
        format!(
            "Coordinates: \nBoard size: 4 rows x 6 cols (zero-indexed).\n{walls}\nTargets: (1, 4), (2, 2)\n\
             Boxes: (1, 2)\nBoxes on target: (2, 2)\nPlayer: (1, 1)\nGrid Map: \n######\n#PX_O#\n#_√__#\n######"
        )
    );
    ep.step("Right").unwrap();
    let o = ep.step("Right").unwrap();
    assert!(o.success);
    // No box is off a target now: RAGEN-2 leaves out an empty kind's line.
    assert_eq!(
        ep.render().unwrap(),
        format!(
            "Coordinates: \nBoard size: 4 rows x 6 cols (zero-indexed).\n{walls}\nTargets: (1, 4), (2, 2)\n\
             Boxes on target: (1, 4), (2, 2)\nPlayer: (1, 3)\nGrid Map: \n######\n#__P√#\n#_√__#\n######"
        )
    );
    // "coord" alone; the player standing on a target.
    let p = params(&e, &[("level", "######,#SXO_#,######"), ("observation_format", "coord")]);
    assert_eq!(
        e.reset(0, 0, &p).unwrap().render().unwrap(),
        "Board size: 3 rows x 6 cols (zero-indexed).\nWalls: (0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), \
         (1, 0), (1, 5), (2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (2, 5)\nTargets: (1, 1), (1, 3)\nBoxes: (1, 2)\n\
         Player on target: (1, 1)"
    );
}

#[test]
fn sokoban_renders_the_grid_alone_by_default_and_coordinates_do_not_change_the_level() {
    let e = env("sokoban");
    let default = params(&e, &[]);
    assert_eq!(default["observation_format"], "grid");
    let coord = params(&e, &[("observation_format", "grid_coord")]);
    for seed in 0..10 {
        let grid = e.reset(seed, 0, &default).unwrap().render().unwrap();
        assert!(grid.lines().all(|l| l.chars().all(|c| "#_OX√PS".contains(c))), "{grid}");
        let both = e.reset(seed, 0, &coord).unwrap().render().unwrap();
        assert!(
            both.starts_with("Coordinates: \nBoard size: 6 rows x 6 cols (zero-indexed).\nWalls: (0, 0)"),
            "{both}"
        );
        assert!(both.ends_with(&format!("\nGrid Map: \n{grid}")), "{both}");
    }
    // The instruction: RAGEN's by default, CoordSokoban's with the coordinates.
    let info = e.info(&default).unwrap();
    assert!(info.instruction.starts_with("You are solving the Sokoban puzzle. You are the player and you need to push all boxes to targets. When you are right next to a box"));
    let info = e.info(&coord).unwrap();
    assert!(info.instruction.contains(
        "You are provided with a symbol grid and the zero-indexed coordinates of the player, each box, and each target. \
         Coordinates range from the top-left corner (0, 0) to the bottom-right corner (5, 5). When you are exactly next to a box"
    ), "{}", info.instruction);
    assert_eq!(info.legend, e.info(&default).unwrap().legend);
    let bad = e.params(&[("observation_format".into(), "pixels".into())]).unwrap();
    assert!(e.reset(0, 0, &bad).unwrap_err().to_string().contains("observation_format must be"));
}

// ---- FrozenLake -------------------------------------------------------------------------------

#[test]
fn frozenlake_slips_perpendicular_two_thirds_of_the_time() {
    let e = env("frozenlake");
    let p = params(&e, &[("map", "FFFF,FSFF,FFFF,FFFG")]);
    let mut counts = std::collections::BTreeMap::new();
    let n = 3000;
    for stream in 0..n {
        let mut ep = e.reset(0, stream, &p).unwrap();
        ep.step("Down").unwrap();
        *counts.entry(ep.render().unwrap()).or_insert(0) += 1;
    }
    let down = counts["____\n____\n_P__\n___G"];
    let left = counts["____\nP___\n____\n___G"];
    let right = counts["____\n__P_\n____\n___G"];
    assert_eq!(down + left + right, n, "only the intended and perpendicular moves: {counts:?}");
    // Each ~1000 with sd ~26: a 5-sd band.
    for c in [down, left, right] {
        assert!((870..=1130).contains(&c), "{counts:?}");
    }
}

#[test]
fn frozenlake_edges_stop_moves_and_holes_and_goal_end_the_episode() {
    let e = env("frozenlake");
    let p = params(&e, &[("map", "SHFF,FFFF,FFFF,FFFG"), ("slippery", "false")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    let o = ep.step("Up").unwrap();
    assert!(!o.effective && !o.done && o.reward == 0.0);
    let o = ep.step("Right").unwrap();
    assert!(o.done && !o.success && o.reward == 0.0);
    assert_eq!(ep.render().unwrap(), "_X__\n____\n____\n___G");
    let p = params(&e, &[("map", "FFFF,FFFF,FFFF,FFSG"), ("slippery", "false")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    let o = ep.step("Right").unwrap();
    assert!(o.done && o.success && o.reward == 1.0);
    assert_eq!(ep.render().unwrap(), "____\n____\n____\n___√");
}

#[test]
fn frozenlake_maps_have_one_start_one_goal_and_a_path() {
    let e = env("frozenlake");
    let p = params(&e, &[]);
    let mut holes = 0;
    for seed in 0..200 {
        let grid = e.reset(seed, 0, &p).unwrap().render().unwrap().replace('\n', "");
        assert_eq!((grid.len(), grid.matches('P').count(), grid.matches('G').count()), (16, 1, 1), "{grid}");
        holes += grid.matches('O').count();
        let cells: Vec<char> = grid.chars().collect();
        let start = cells.iter().position(|&c| c == 'P').unwrap();
        let mut seen = [false; 16];
        let mut stack = vec![start];
        while let Some(i) = stack.pop() {
            if std::mem::replace(&mut seen[i], true) || cells[i] == 'O' {
                continue;
            }
            let (r, c) = (i / 4, i % 4);
            stack.extend(
                [(r > 0).then(|| i - 4), (r < 3).then(|| i + 4), (c > 0).then(|| i - 1), (c < 3).then(|| i + 1)]
                    .into_iter()
                    .flatten(),
            );
        }
        assert!(seen[cells.iter().position(|&c| c == 'G').unwrap()], "no path:\n{grid}");
    }
    // Holes come from cells frozen with p = 0.8, minus maps rejected for having no path.
    let share = holes as f64 / (200.0 * 14.0);
    assert!((0.1..0.25).contains(&share), "hole share {share}");
}

#[test]
fn frozenlake_grid_coord_writes_ragen2s_coordinate_lines_above_the_grid() {
    let e = env("frozenlake");
    let p = params(&e, &[("map", "SFFF,FHFH,FFFH,HFFG"), ("slippery", "false"), ("observation_format", "grid_coord")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    // RAGEN-2's `_render_text('grid_coord')`: start, goal, player, holes, then the grid.
    assert_eq!(
        ep.render().unwrap(),
        "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 0)\nGoal: (3, 3)\nPlayer: (0, 0)\n\
         Holes: (1, 1), (1, 3), (2, 3), (3, 0)\nGrid Map: \nP___\n_O_O\n___O\nO__G"
    );
    ep.step("Down").unwrap();
    assert!(ep.render().unwrap().contains("\nStart: (0, 0)\nGoal: (3, 3)\nPlayer: (1, 0)\nHoles: "));
    assert!(ep.step("Right").unwrap().done);
    assert_eq!(
        ep.render().unwrap(),
        "Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: (0, 0)\nGoal: (3, 3)\nPlayer in hole: (1, 1)\n\
         Holes: (1, 1), (1, 3), (2, 3), (3, 0)\nGrid Map: \n____\n_X_O\n___O\nO__G"
    );
    // "coord" alone, on the goal, with no holes (their line left out, as in RAGEN-2).
    let p = params(&e, &[("map", "FFFF,FFFF,FFFF,FFSG"), ("slippery", "false"), ("observation_format", "coord")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    assert!(ep.step("Right").unwrap().success);
    assert_eq!(
        ep.render().unwrap(),
        "Board size: 4 rows x 4 cols (zero-indexed).\nStart: (3, 2)\nGoal: (3, 3)\nPlayer on goal: (3, 3)"
    );
}

#[test]
fn frozenlake_relative_names_the_goals_offset_and_the_holes_next_to_the_player_in_moves() {
    let e = env("frozenlake");
    let p = params(&e, &[("map", "SFFF,FHFH,FFFH,HFFG"), ("slippery", "false"), ("observation_format", "relative")]);
    assert_eq!(e.info(&p).unwrap().legend, "", "no grid symbols to explain");
    let mut ep = e.reset(0, 0, &p).unwrap();
    assert_eq!(ep.render().unwrap(), "The goal is 3 Down and 3 Right from you.\nNo hole next to you.");
    ep.step("Right").unwrap();
    assert_eq!(ep.render().unwrap(), "The goal is 3 Down and 2 Right from you.\nHoles next to you: Down.");
    ep.step("Right").unwrap();
    ep.step("Right").unwrap();
    assert_eq!(ep.render().unwrap(), "The goal is 3 Down from you.\nHoles next to you: Down.");
    assert!(ep.step("Down").unwrap().done);
    assert_eq!(ep.render().unwrap(), "You fell into a hole.");
    let p = params(&e, &[("map", "FFFF,FFFF,FFFF,FFGS"), ("slippery", "false"), ("observation_format", "relative")]);
    let mut ep = e.reset(0, 0, &p).unwrap();
    assert_eq!(ep.render().unwrap(), "The goal is 1 Left from you.\nNo hole next to you.");
    assert!(ep.step("Left").unwrap().success);
    assert_eq!(ep.render().unwrap(), "You are on the goal.");
}

#[test]
fn frozenlake_renders_the_grid_alone_by_default_and_coordinates_do_not_change_the_map() {
    let e = env("frozenlake");
    let default = params(&e, &[]);
    assert_eq!(default["observation_format"], "grid");
    let coord = params(&e, &[("observation_format", "grid_coord")]);
    for seed in 0..20 {
        let grid = e.reset(seed, 0, &default).unwrap().render().unwrap();
        assert!(grid.lines().count() == 4 && grid.chars().all(|c| "\nP_OG".contains(c)), "{grid}");
        let both = e.reset(seed, 0, &coord).unwrap().render().unwrap();
        assert!(both.starts_with("Coordinates: \nBoard size: 4 rows x 4 cols (zero-indexed).\nStart: "), "{both}");
        assert!(both.ends_with(&format!("\nGrid Map: \n{grid}")), "{both}");
    }
    let p = params(&e, &[("map", "SFFF,FHFH,FFFH,HFFG"), ("slippery", "false")]);
    assert_eq!(e.reset(0, 0, &p).unwrap().render().unwrap(), "P___\n_O_O\n___O\nO__G");
    assert!(e
        .info(&default)
        .unwrap()
        .instruction
        .starts_with("You are solving the FrozenLake puzzle. Forbid the hole"));
    let info = e.info(&coord).unwrap();
    assert_eq!(
        info.instruction,
        "You are solving the FrozenLake puzzle. The observation includes both a symbol grid and zero-indexed coordinates \
         for the start, goal, player, and any holes. Coordinates range from the top-left corner (0, 0) to the bottom-right \
         corner (3, 3). Beware that the ice is slippery, so the agent might slide and end up in an unintended tile. \
         Respond with a sequence of actions such as <answer>Left || Up || Up</answer>."
    );
    let bad = e.params(&[("observation_format".into(), "Grid".into())]).unwrap();
    assert!(e.info(&bad).unwrap_err().to_string().contains("observation_format must be"));
}

// ---- Bandit, math, invoice ----------------------------------------------------------------------

#[test]
fn bandit_pays_like_ragen_and_randomises_the_name_order() {
    let e = env("bandit");
    let p = params(&e, &[]);
    let (mut hi_sum, mut hi_wins, n) = (0.0, 0, 4000);
    for stream in 0..n {
        let mut ep = e.reset(1, stream, &p).unwrap();
        let o = ep.step("dragon").unwrap();
        assert!(o.done && o.success && (o.reward == 0.0 || o.reward == 1.0));
        hi_sum += o.reward;
        hi_wins += (o.reward == 1.0) as usize;
        let lo = e.reset(1, stream, &p).unwrap().step("Phoenix").unwrap();
        assert_eq!((lo.reward, lo.success), (0.1, false));
    }
    // p = 0.25, sd of the mean ~0.007.
    assert!((hi_sum / n as f64 - 0.25).abs() < 0.035, "{hi_wins}/{n}");
    let dragon_first =
        (0..200).filter(|&s| e.reset(s, 0, &p).unwrap().render().unwrap().contains("named Dragon and Phoenix")).count();
    assert!((60..140).contains(&dragon_first), "{dragon_first}/200");
    let held_out = params(&e, &[("hi_arm", "Librarian"), ("lo_arm", "Trader")]);
    let obs = e.reset(0, 0, &held_out).unwrap().render().unwrap();
    assert!(obs.contains("Librarian") && obs.contains("Trader") && !obs.contains("Dragon"));
}

/// RAGEN-2's ARM_NAMES (ragen/env/bandit/config.py) as (low arm, high arm), written out here
/// independently of the env script.
const RAGEN2_TRAIN_PAIRS: [(&str, &str); 12] = [
    ("Teacher", "Trader"),
    ("Nurse", "StartupFounder"),
    ("Librarian", "Investor"),
    ("Accountant", "StockBroker"),
    ("Engineer", "RealEstateAgent"),
    ("Pharmacist", "Musician"),
    ("Clerk", "Freelancer"),
    ("Technician", "Youtuber"),
    ("Planner", "Artist"),
    ("Postman", "Pilot"),
    ("Banker", "VentureCapitalist"),
    ("Gardener", "Cryptominer"),
];
const RAGEN2_TEST_PAIRS: [(&str, &str); 8] = [
    ("Receptionist", "Explorer"),
    ("Archivist", "Filmmaker"),
    ("Bookkeeper", "Consultant"),
    ("SocialWorker", "Photographer"),
    ("Mechanic", "GameDesigner"),
    ("Secretary", "Entrepreneur"),
    ("Cashier", "DataScientist"),
    ("CivilServant", "StartupAccelerator"),
];

/// The two names a bandit prompt offers, in its order.
fn bandit_names(obs: &str) -> (String, String) {
    let line = obs.lines().find(|l| l.starts_with("1. There are 2 arms, named ")).unwrap();
    let (a, b) = line.trim_start_matches("1. There are 2 arms, named ").split_once(" and ").unwrap();
    (a.to_string(), b.to_string())
}

#[test]
fn bandit_pairs_come_from_ragen2s_lists_one_per_seed_shared_by_the_group() {
    let e = env("bandit");
    for (split, list) in [("train", &RAGEN2_TRAIN_PAIRS[..]), ("test", &RAGEN2_TEST_PAIRS[..])] {
        let p = params(&e, &[("pairs", split)]);
        // The action list is every name of the list, sorted.
        let mut all: Vec<String> = list.iter().flat_map(|(lo, hi)| [lo.to_string(), hi.to_string()]).collect();
        all.sort();
        assert_eq!(e.info(&p).unwrap().actions, all);
        let (mut seen, mut hi_first, mut hi_sum, n) = (HashSet::new(), 0, 0.0, 400u64);
        for seed in 0..n {
            let ep = e.reset(seed, 0, &p).unwrap();
            let obs = ep.render().unwrap();
            let (a, b) = bandit_names(&obs);
            let &(lo, hi) = list
                .iter()
                .find(|(lo, hi)| (a == *lo && b == *hi) || (a == *hi && b == *lo))
                .unwrap_or_else(|| panic!("{split} seed {seed}: {a} / {b} is not a RAGEN-2 {split} pair"));
            seen.insert(lo);
            hi_first += (a == hi) as usize;
            let mut sorted = vec![lo.to_string(), hi.to_string()];
            sorted.sort();
            assert_eq!(ep.valid_actions().unwrap(), sorted);
            // Every episode of the group sees the same pair in the same order.
            for stream in 1..4 {
                assert_eq!(e.reset(seed, stream, &p).unwrap().render().unwrap(), obs);
            }
            // The second name of RAGEN-2's pair is the high arm: 1.0 a quarter of the time.
            let o = e.reset(seed, 0, &p).unwrap().step(&hi.to_lowercase()).unwrap();
            assert!(o.done && o.success && (o.reward == 0.0 || o.reward == 1.0), "{o:?}");
            assert_eq!(e.reset(seed, 0, &p).unwrap().render().unwrap(), obs);
            hi_sum += o.reward;
            let mut ep = e.reset(seed, 0, &p).unwrap();
            let o = ep.step(lo).unwrap();
            assert_eq!((o.reward, o.success, o.done), (0.1, false, true));
            assert_eq!(ep.render().unwrap(), format!("{lo}: 0.1 points"));
            // A name from another pair of the list is not an arm of this episode.
            let other = list.iter().find(|(l, _)| *l != lo).unwrap().0;
            assert!(!e.reset(seed, 0, &p).unwrap().step(other).unwrap().valid);
        }
        assert_eq!(seen.len(), list.len(), "{split}: every pair is drawn over {n} seeds");
        assert!((120..280).contains(&hi_first), "{split}: high arm named first {hi_first}/{n}");
        // p = 0.25 over 400 pulls, sd ~0.022.
        assert!((hi_sum / n as f64 - 0.25).abs() < 0.1, "{split}: {hi_sum}/{n}");
    }
    // One seed's group: a shared pair, but each member's own Bernoulli draw.
    let p = params(&e, &[("pairs", "train")]);
    let (a, b) = bandit_names(&e.reset(3, 0, &p).unwrap().render().unwrap());
    let hi =
        RAGEN2_TRAIN_PAIRS.iter().find_map(|&(lo, hi)| ((a == lo && b == hi) || (a == hi && b == lo)).then_some(hi));
    let hi = hi.unwrap();
    let wins: HashSet<u64> = (0..64).map(|s| e.reset(3, s, &p).unwrap().step(hi).unwrap().reward as u64).collect();
    assert_eq!(wins.len(), 2, "64 members of one group all drew alike");
    // No train name is held out, and a typo is refused.
    let train: HashSet<&str> = RAGEN2_TRAIN_PAIRS.iter().flat_map(|&(lo, hi)| [lo, hi]).collect();
    assert!(RAGEN2_TEST_PAIRS.iter().all(|&(lo, hi)| !train.contains(lo) && !train.contains(hi)));
    let bad = e.params(&[("pairs".into(), "val".into())]).unwrap();
    assert!(e.info(&bad).unwrap_err().to_string().contains("pairs must be"));
}

#[test]
fn bandit_without_pairs_keeps_hi_arm_and_lo_arm() {
    let e = env("bandit");
    let p = params(&e, &[]);
    assert_eq!(p["pairs"], "");
    assert_eq!(e.info(&p).unwrap().actions, ["Dragon", "Phoenix"]);
    for seed in 0..20 {
        let ep = e.reset(seed, 0, &p).unwrap();
        assert_eq!(ep.valid_actions().unwrap(), ["Dragon", "Phoenix"]);
        let (a, b) = bandit_names(&ep.render().unwrap());
        assert!((a == "Dragon" && b == "Phoenix") || (a == "Phoenix" && b == "Dragon"), "{a} / {b}");
    }
    // Seed 0's prompt, byte for byte as before the pairs existed.
    let obs = e.reset(0, 0, &p).unwrap().render().unwrap();
    let (a, b) = bandit_names(&obs);
    assert_eq!(
        obs,
        format!(
            "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull.\n\
             Game Rules:\n1. There are 2 arms, named {a} and {b}\n\
             2. Each arm has its own reward distribution, related to their names.\n\
             3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution might behave.\n\
             4. Based on the symbolic meaning of their names, which arm do you think is more likely to give higher rewards \
             on average? Choose between {a} and {b}, and output like <answer> {a} </answer> or <answer> {b} </answer>.\n"
        )
    );
}

#[test]
fn math_rewards_the_right_value_of_x() {
    let e = env("math");
    for d in ["1", "2", "3"] {
        let p = params(&e, &[("difficulty", d)]);
        for seed in 0..20 {
            let ep = e.reset(seed, 0, &p).unwrap();
            let x = ep.state_json()["x"].as_i64().unwrap();
            let mut right = e.reset(seed, 0, &p).unwrap();
            let o = right.step(&format!("x = {x}")).unwrap();
            assert!(o.success && o.reward == 1.0, "{} {x}", ep.render().unwrap());
            let mut wrong = e.reset(seed, 0, &p).unwrap();
            assert_eq!(wrong.step(&format!("{}", x + 1)).unwrap().reward, 0.0);
        }
    }
    let mut ep = e.reset(0, 0, &params(&e, &[])).unwrap();
    assert!(!ep.step("no idea").unwrap().valid);
}

#[test]
fn invoice_rewards_right_decisions_and_extracted_fields() {
    let e = env("invoice");
    let p = params(&e, &[("problem_p", "1.0")]);
    let mut seen = HashSet::new();
    for seed in 0..30 {
        let mut ep = e.reset(seed, 0, &p).unwrap();
        let s = ep.state_json();
        let problem = s["problem"].as_str().unwrap().to_string();
        seen.insert(problem.clone());
        let vendor = s["invoice"]["vendor"].as_str().unwrap().to_string();
        assert_eq!(ep.step(&format!("extract vendor={vendor}")).unwrap().reward, 0.2);
        assert_eq!(ep.step(&format!("extract vendor={vendor}")).unwrap().reward, 0.0, "counted once");
        assert_eq!(ep.step("extract total=0.01").unwrap().reward, -0.1);
        // No decision before the PO lookup (the env's control): refused, the episode goes on.
        let early = ep.step("approve").unwrap();
        assert!(!early.valid && !early.done && !ep.valid_actions().unwrap().contains(&"approve".to_string()));
        ep.step("lookup_po").unwrap();
        let o = ep.step("approve").unwrap();
        assert!(o.done && !o.success && o.reward == -1.0, "approving a {problem} invoice");
        let mut ep = e.reset(seed, 0, &p).unwrap();
        ep.step("lookup_po").unwrap();
        assert!(
            ep.render().unwrap().ends_with(&format!("Match: FAILED, the {problem} differs")),
            "a {problem} problem is flagged"
        );
        if problem == "total" {
            assert_eq!(ep.step("request_correction").unwrap().reward, 0.5, "a right request is paid as made");
            assert!(ep.render().unwrap().contains("corrected invoice"));
            let o = ep.step("approve").unwrap();
            assert!(o.success && o.reward == 1.0);
        } else {
            let o = ep.step("reject").unwrap();
            assert!(o.success && o.reward == 1.0);
        }
    }
    assert_eq!(seen.len(), 2, "both problem kinds appear: {seen:?}");
    let mut ep = e.reset(0, 0, &params(&e, &[("problem_p", "0.0")])).unwrap();
    assert!(ep.render().unwrap().starts_with("INVOICE "));
    assert!(ep.step("lookup_po").unwrap().valid);
    // Later turns show what changed, with the PO lookup's verdict, not the document again.
    let later = ep.render().unwrap();
    assert!(later.contains("PO total: ") && later.ends_with("Match: PASSED") && !later.contains("INVOICE"), "{later}");
    assert!(!ep.step("dance").unwrap().valid);
    assert_eq!(ep.step("request_correction").unwrap().reward, -0.5, "nothing to correct");
    assert!(ep.step("approve").unwrap().success);
    // Without extraction (scripts/invoice.rhai) the lookup is the first turn's one command.
    let mut ep = e.reset(0, 0, &params(&e, &[("extract", "false")])).unwrap();
    assert_eq!(ep.valid_actions().unwrap(), ["lookup_po"]);
    assert!(!ep.step("extract total=1.00").unwrap().valid);
}

/// Each workflow env's procedure solves every case, and each command it gives is one of the
/// state's legal patterns (what the constrained decoder lets the model say).
#[test]
fn the_workflow_solvers_solve_every_case_with_legal_commands() {
    let cases = [("invoice", "problem_p", ["0.0", "0.5", "1.0"]), ("expense", "over_p", ["0.0", "0.5", "1.0"])];
    for (name, key, values) in cases {
        let e = env(name);
        for value in values {
            solve_all(&e, &params(&e, &[(key, value)]));
        }
    }
}

/// Plays 40 seeds by the env's solver; each must end in success within 4 turns.
fn solve_all(e: &EnvScript, p: &Map<String, Value>) {
    for seed in 0..40 {
        let mut ep = e.reset(seed, 0, p).unwrap();
        let mut last = None;
        for _turn in 0..4 {
            let legal = ep.valid_actions().unwrap();
            for action in ep.solve().unwrap().expect("the env defines solve") {
                assert!(legal.iter().any(|a| pattern::matches(a, &action)), "{action} not in {legal:?}");
                last = Some(ep.step(&action).unwrap());
            }
            if ep.done {
                break;
            }
        }
        assert!(last.is_some_and(|o| o.done && o.success), "seed {seed}");
    }
}

/// Expense claims: the policy's rules, and a partial approval right only at the exact limit.
#[test]
fn expense_decisions_follow_the_policy() {
    let e = env("expense");
    let mut seen = HashSet::new();
    for seed in 0..60 {
        let p = params(&e, &[("over_p", "0.5")]);
        let mut ep = e.reset(seed, 0, &p).unwrap();
        let s = ep.state_json();
        let (category, amount) = (s["category"].as_str().unwrap().to_string(), s["amount"].as_i64().unwrap());
        let limit = [("meals", 6000), ("travel", 50000), ("lodging", 25000), ("software", 15000)]
            .iter()
            .find(|(c, _)| *c == category)
            .map(|x| x.1);
        if s["receipt"] == json!(false) && amount > 2500 && limit.is_some() {
            continue; // the receipt decides; the solver test covers it
        }
        let (right, wrong) = match limit {
            None => ("reject".to_string(), "approve".to_string()),
            Some(l) if amount > l => (format!("approve_partial {}.{:02}", l / 100, l % 100), "approve".to_string()),
            Some(_) => ("approve".to_string(), "approve_partial 0.01".to_string()),
        };
        seen.insert(right.split(' ').next().unwrap().to_string());
        // The policy lookup says how the claim compares with the limit.
        ep.step("check_policy").unwrap();
        let note = ep.render().unwrap();
        let verdict = match limit {
            None => "Check: FAILED, the category is not reimbursed".to_string(),
            Some(l) if amount > l => {
                format!("Check: FAILED, the amount is over the limit of {}.{:02}", l / 100, l % 100)
            }
            Some(_) => "Check: PASSED".to_string(),
        };
        assert!(note.ends_with(&verdict) && !note.contains("EXPENSE CLAIM"), "seed {seed}: {note}");
        assert!(ep.step(&right).unwrap().success, "seed {seed}: {right} on {s}");
        let mut ep = e.reset(seed, 0, &p).unwrap();
        assert!(!ep.step(&wrong).unwrap().valid, "no decision before the policy lookup");
        ep.step("check_policy").unwrap();
        assert_eq!(ep.step(&wrong).unwrap().reward, -1.0, "seed {seed}: {wrong} on {s}");
        if right.starts_with("approve_partial") {
            let mut ep = e.reset(seed, 0, &p).unwrap();
            ep.step("check_policy").unwrap();
            let o = ep.step("approve_partial 0.01").unwrap();
            assert!(o.done && !o.success && o.reward == 0.0, "the wrong amount: wrong, scored 0");
        }
    }
    assert_eq!(seen.len(), 3, "approve, reject and partial all appear: {seen:?}");
}

#[test]
fn a_bad_action_pattern_is_an_error_at_the_function_that_returned_it() {
    let src = "fn describe(p) { #{ name: \"t\", instruction: \"i\", actions: [\"pay {money}\"] } }\n\
               fn reset(seed, p) { #{ n: 0 } }\n\
               fn render(s) { `n=${s.n}` }\n\
               fn valid_actions(s) {\n  [\"pay {amount}\"]\n}\n\
               fn step(s, a) { #{ reward: 0.0, done: true } }\n";
    let dir = project(&[("envs/t.rhai", src)]);
    let host = Host::new(dir.path(), tight());
    let env = EnvScript::load(&host, Path::new("envs/t.rhai")).unwrap();
    let ep = env.reset(0, 0, &Map::new()).unwrap();
    let e = ep.valid_actions().unwrap_err();
    assert_eq!((e.line, e.col), (4, 1), "points at fn valid_actions: {e}");
    assert!(e.to_string().contains("unknown value shape `{amount}`"), "{e}");
    let bad = src.replace("[\"pay {money}\"]", "[\"pay {money\"]");
    let dir = project(&[("envs/t.rhai", &bad)]);
    let e = EnvScript::load(&Host::new(dir.path(), tight()), Path::new("envs/t.rhai"))
        .and_then(|env| env.info(&Map::new()))
        .unwrap_err();
    assert!(e.to_string().contains("not closed") && e.line == 1, "{e}");
}

// ---- prompt template and reward shaping ---------------------------------------------------------

#[test]
fn the_prompt_template_writes_ragens_messages() {
    let host = repo_host();
    let prompt = PromptScript::load(&host, Path::new("prompts/ragen.rhai")).unwrap();
    let e = env("sokoban");
    let info = e.info(&params(&e, &[])).unwrap();
    assert_eq!(prompt.system(&info).unwrap(), "You're a helpful assistant. ");
    let first = TurnContext {
        turn: 1,
        obs: "#P#".into(),
        actions_left: 10,
        prev_reward: None,
        think: true,
        max_tokens: 100,
        max_actions_per_turn: 5,
        show_actions: true,
        valid_actions: info.actions.clone(),
    };
    let text = prompt.user(&info, &first).unwrap();
    let expected = format!(
        "{}\nThe meaning of each symbol in the state is:\n#: wall, _: empty, O: target, √: box on target, X: box, P: player, S: player on target\n\
         Your available actions are:\nUp, Down, Left, Right\nYou can make up to 5 actions, separated by the action separator \" || \"\n\
         \nTurn 1:\nState:\n#P#\nYou have 10 actions left. Always output: <think> [Your thoughts] </think> <answer> [your answer] </answer> \
         with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n",
        info.instruction
    );
    assert_eq!(text, expected);
    let second = TurnContext {
        turn: 2,
        obs: "#S#".into(),
        actions_left: 7,
        // A sum of shaping terms: shown rounded, not as -0.15000000000000002.
        prev_reward: Some(-0.1 - 0.05),
        think: false,
        max_tokens: 100,
        max_actions_per_turn: 5,
        show_actions: true,
        valid_actions: info.actions.clone(),
    };
    assert_eq!(
        prompt.user(&info, &second).unwrap(),
        "Reward:\n-0.15\n\nTurn 2:\nState:\n#S#\nYou have 7 actions left. Always output: <answer> [your answer] </answer> \
         with no extra text. Strictly follow this format. Max response length: 100 words (tokens).\n"
    );
    // Without the legal actions listed (rollout.show_actions = false) the limit is still stated.
    let hidden = prompt.user(&info, &TurnContext { show_actions: false, ..first.clone() }).unwrap();
    assert!(!hidden.contains("Your available actions") && hidden.contains("You can make up to 5 actions"));
    // Where the state allows fewer actions than describe lists, every turn lists this state's.
    let narrow = vec!["Up".to_string(), "Left".to_string()];
    let first_narrow = prompt.user(&info, &TurnContext { valid_actions: narrow.clone(), ..first }).unwrap();
    assert!(first_narrow.contains("Your available actions are:\nUp, Left\n"), "{first_narrow}");
    let later = prompt.user(&info, &TurnContext { valid_actions: narrow, ..second }).unwrap();
    assert!(later.starts_with("Reward:\n-0.15\nYour available actions are:\nUp, Left\n\nTurn 2:"), "{later}");
}

/// The workflow prompt states the rules once: later turns carry the reward, the state and the
/// commands legal in it, not the instruction and format again.
#[test]
fn the_workflow_prompt_states_its_rules_on_the_first_turn_only() {
    let host = repo_host();
    let prompt = PromptScript::load(&host, Path::new("prompts/workflow.rhai")).unwrap();
    let e = env("invoice");
    let info = e.info(&params(&e, &[])).unwrap();
    let first = TurnContext {
        turn: 1,
        obs: "INVOICE INV-1".into(),
        actions_left: 8,
        prev_reward: None,
        think: false,
        max_tokens: 32,
        max_actions_per_turn: 2,
        show_actions: true,
        valid_actions: vec!["lookup_po".into(), "approve".into()],
    };
    assert_eq!(
        prompt.user(&info, &first).unwrap(),
        format!(
            "{}\nAnswer with up to 2 commands separated by \" || \", as <answer> [your answer] </answer>.\n\
             \nTurn 1 (8 commands left):\nINVOICE INV-1\nCommands: lookup_po, approve\n",
            info.instruction
        )
    );
    let second = TurnContext { turn: 2, obs: "Invoice INV-1 (above).".into(), prev_reward: Some(0.2), ..first };
    assert_eq!(
        prompt.user(&info, &second).unwrap(),
        "Reward: 0.2\n\nTurn 2 (8 commands left):\nInvoice INV-1 (above).\nCommands: lookup_po, approve\n"
    );
}

#[test]
fn reward_scripts_apply_the_format_penalty_and_the_reasoning_bonus_in_order() {
    let host = repo_host();
    let load = |p: &str| RewardScript::load(&host, Path::new(p)).unwrap();
    let chain = [load("rewards/format_penalty.rhai"), load("rewards/reasoning.rhai")];
    let acts: Vec<String> = ["Up", "Down"].map(String::from).to_vec();
    let long = "the box is left of the target so I push it right twice then check it";
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let good = parse_turn(&format!("{long}</think><answer>Up</answer>"), &acts, 5, true);
    assert!(close(shape_all(&chain, &good, &acts, 1.0).unwrap(), 1.05));
    let short = parse_turn("go</think><answer>Up</answer>", &acts, 5, true);
    assert!(close(shape_all(&chain, &short, &acts, 1.0).unwrap(), 1.0));
    let invalid = parse_turn("go</think><answer>Up || Fly</answer>", &acts, 5, true);
    assert!(close(shape_all(&chain, &invalid, &acts, 0.0).unwrap(), -0.1));
    let unparsed = parse_turn("I would go up", &acts, 5, true);
    assert!(close(shape_all(&chain, &unparsed, &acts, 0.0).unwrap(), -0.1));
}

#[test]
fn answer_credit_cannot_be_gamed_by_echoing_the_prompts_placeholder() {
    let host = repo_host();
    let load = |p: &str| RewardScript::load(&host, Path::new(p)).unwrap();
    let chain = [load("rewards/format_penalty.rhai"), load("rewards/answer_credit.rhai")];
    let acts: Vec<String> = ["Up", "Down", "Left", "Right"].map(String::from).to_vec();
    let score = |response: &str| shape_all(&chain, &parse_turn(response, &acts, 2, false), &acts, 0.0).unwrap();
    let valid = score(" Up || Left </answer>");
    // What SmolLM2 learnt to write on FrozenLake and Sokoban: the prompt's own placeholder.
    for echo in [" [your answer] </answer>", "Your answer</answer>", "[your answer]", "</answer>"] {
        assert!(score(echo) < 0.0, "{echo:?} scored {}", score(echo));
        assert!(score(echo) < valid, "{echo:?}");
    }
    // Partial credit toward the closing tag only when a real action is named.
    let near = score(" Up </ans");
    assert!(near > score(" Up") && near < valid && near > score(" [your answer] </ans"), "{near}");
    // Naming an action the env does not have earns nothing beyond the penalty.
    assert!((score(" Jump </answer>") - -0.1).abs() < 1e-9);
}

#[test]
fn the_bandit_experiment_names_its_scripts_params_and_settings() {
    let host = repo_host();
    let x = Experiment::load(&host, Path::new("scripts/bandit.rhai")).unwrap();
    assert!(x.env.ends_with("envs/bandit.rhai") && x.prompt.ends_with("prompts/ragen.rhai"));
    assert_eq!(x.rewards.len(), 1);
    assert_eq!(Value::Object(x.params.clone()), json!({"hi_arm": "Dragon", "lo_arm": "Phoenix"}));
    assert_eq!(x.val_params.clone().map(Value::Object), Some(json!({"hi_arm": "Librarian", "lo_arm": "Trader"})));
    assert_eq!(x.settings["rollout"]["group_size"], json!(4));
    assert_eq!(x.settings["rollout"]["answer_temperature"], json!(2.0));
    assert_eq!(x.model, None, "the default model serves");
    x.scripts(&host).unwrap();
    let tiny = Experiment::load(&host, Path::new("scripts/bandit_tiny.rhai")).unwrap();
    assert_eq!(tiny.model.as_deref(), Some("tiny-llama"));
}

/// The multi-turn experiments that judge the shipped settings use them as a new user would:
/// scripts/bandit.rhai's, with only the env and the turn count changed (docs/training.md).
#[test]
fn the_learning_experiments_copy_the_bandit_settings_but_the_turn_count() {
    let host = repo_host();
    let bandit = Experiment::load(&host, Path::new("scripts/bandit.rhai")).unwrap().settings;
    for script in [
        "scripts/lights.rhai",
        "scripts/learning/recall.rhai",
        "scripts/learning/elevator.rhai",
        "scripts/learning/triage.rhai",
    ] {
        let mut x = Experiment::load(&host, Path::new(script)).unwrap().settings;
        let turns = x["rollout"].as_object_mut().unwrap().remove("max_turns");
        assert!(turns.is_some_and(|t| t.as_u64().unwrap() > 1), "{script}: a multi-turn experiment");
        assert_eq!(x, bandit, "{script}");
    }
}

#[test]
fn an_experiment_naming_a_missing_script_or_param_is_refused() {
    let dir = project(&[
        ("envs/t.rhai", &format!("{HEAD}fn step(s, a) {{ #{{ reward: 0.0, done: true }} }}\n")),
        ("scripts/x.rhai", "fn experiment() { #{ env: \"envs/t.rhai\", prompt: \"prompts/none.rhai\" } }\n"),
        (
            "scripts/y.rhai",
            "fn experiment() { #{ env: \"envs/t.rhai\", prompt: \"envs/t.rhai\", params: #{ size: 3 } } }\n",
        ),
        ("scripts/z.rhai", "fn experiment() { #{ env: \"envs/t.rhai\", prompt: \"envs/t.rhai\", model: 7 } }\n"),
    ]);
    let host = Host::new(dir.path(), Limits::default());
    let e = Experiment::load(&host, Path::new("scripts/x.rhai")).unwrap_err();
    assert!(e.to_string().contains("`prompt`") && e.message.contains("no such file prompts/none.rhai"), "{e}");
    let y = Experiment::load(&host, Path::new("scripts/y.rhai")).unwrap();
    let e = y.scripts(&host).unwrap_err();
    assert!(e.to_string().contains("parameter `size`"), "{e}");
    let e = Experiment::load(&host, Path::new("scripts/z.rhai")).unwrap_err();
    assert!(e.to_string().contains("`model` must be a model spec string"), "{e}");
}

// ---- live reload --------------------------------------------------------------------------------

const GOOD: &str = r#"fn describe(p) { #{ name: "t", instruction: "i", actions: ["A"] } }
fn reset(seed, p) { #{ n: 0 } }
fn render(s) { `n=${s.n}` }
fn step(s, a) { s.n += 1; #{ reward: 1.0, done: false } }
"#;

fn next_update(w: &Watcher) -> Update {
    w.wait(Duration::from_secs(10)).expect("no update within 10 s of the edit")
}

fn swapped_env(u: Update) -> EnvScript {
    match u {
        Update::Swapped { loaded: Loaded::Env(e), .. } => e,
        other => panic!("expected a swap, got {other:?}"),
    }
}

fn reload_cycle(mode: WatchMode) {
    let dir = project(&[("envs/t.rhai", GOOD)]);
    let host = Host::new(dir.path(), Limits::default());
    let path = dir.path().join("envs/t.rhai");
    let old = EnvScript::load(&host, &path).unwrap();
    let w = Watcher::new(host.clone(), vec![(path.clone(), Role::Env, Map::new())], mode).unwrap();
    assert!(w.poll().is_empty());

    // A good edit is offered.
    std::fs::write(&path, GOOD.replace("reward: 1.0", "reward: 2.0")).unwrap();
    let new = swapped_env(next_update(&w));
    assert_ne!(new.version(), old.version());
    assert_eq!(new.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 2.0);

    // A broken edit is rejected with its location; the versions in hand keep working.
    std::fs::write(&path, GOOD.replace("s.n += 1;", "s.n += ;")).unwrap();
    match next_update(&w) {
        Update::Rejected { error, .. } => assert_eq!((error.path.as_str(), error.line), ("envs/t.rhai", 4), "{error}"),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(new.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 2.0);

    // An editor-style save: write a temporary file, rename it over the script.
    let tmp = dir.path().join("envs/.t.rhai.swp");
    std::fs::write(&tmp, GOOD.replace("reward: 1.0", "reward: 3.0")).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let renamed = swapped_env(next_update(&w));
    assert_eq!(renamed.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 3.0);
}

#[test]
fn live_reload_swaps_good_edits_rejects_broken_ones_and_sees_rename_saves() {
    reload_cycle(WatchMode::Events);
}

#[test]
fn live_reload_by_polling_does_the_same() {
    reload_cycle(WatchMode::Poll(Duration::from_millis(50)));
}

#[test]
fn live_reload_recompiles_a_script_when_its_import_changes() {
    let dir = project(&[
        ("envs/lib.rhai", "fn pay() { 1.0 }\n"),
        (
            "envs/t.rhai",
            &GOOD.replace("s.n += 1; #{ reward: 1.0", "import \"envs/lib\" as lib; s.n += 1; #{ reward: lib::pay()"),
        ),
    ]);
    let host = Host::new(dir.path(), Limits::default());
    let w =
        Watcher::new(host, vec![(dir.path().join("envs/t.rhai"), Role::Env, Map::new())], WatchMode::Events).unwrap();
    std::fs::write(dir.path().join("envs/lib.rhai"), "fn pay() { 5.0 }\n").unwrap();
    let e = swapped_env(next_update(&w));
    assert_eq!(e.reset(0, 0, &Map::new()).unwrap().step("A").unwrap().reward, 5.0);
}

// ---- the CLI ------------------------------------------------------------------------------------

fn cli(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ragen-lab")).args(args).current_dir(repo()).output().unwrap()
}

#[test]
fn play_json_keeps_its_contract() {
    let out = cli(&[
        "play",
        "--env",
        "envs/sokoban.rhai",
        "--param",
        "level=######,#PX_O#,######",
        "--seed",
        "7",
        "--actions",
        "Left,Right,Right,Up",
        "--json",
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<Value> =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 4, "reset + 3 steps, stopping at done: {lines:?}");
    let reset = &lines[0];
    assert_eq!(reset["event"], "reset");
    assert_eq!(reset["seed"], 7);
    assert_eq!(reset["obs"], "######\n#PX_O#\n######");
    assert_eq!(reset["actions"], json!(["Up", "Down", "Left", "Right"]));
    assert_eq!(reset["env"], "envs/sokoban.rhai");
    assert_eq!(reset["version"].as_str().unwrap().len(), 16);
    assert_eq!(
        lines[1],
        json!({"event": "step", "action": "Left", "reward": -0.1, "done": false, "success": false, "valid": true, "effective": false,
               "obs": "######\n#PX_O#\n######"})
    );
    assert_eq!(lines[2]["obs"], "######\n#_PXO#\n######");
    assert_eq!(
        lines[3],
        json!({"event": "step", "action": "Right", "reward": 10.9, "done": true, "success": true, "valid": true, "effective": true,
               "obs": "######\n#__P√#\n######"})
    );
}

#[test]
fn check_passes_on_every_shipped_script() {
    let host = repo_host();
    for dir in ["envs", "prompts", "rewards", "scripts"] {
        for entry in std::fs::read_dir(repo().join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|x| x == "rhai") {
                let lines: Vec<String> = check(&host, &path, 30, &[])
                    .into_iter()
                    .collect::<Result<_, _>>()
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert!(lines.iter().all(|l| l.starts_with("ok: ")), "{lines:?}");
            }
        }
    }
    let out = cli(&["check", "envs/bandit.rhai", "--episodes", "20"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok: envs/bandit.rhai (env, version "));
}

#[test]
fn check_fails_with_the_location_and_a_nonzero_status() {
    let dir = project(&[("envs/t.rhai", &format!("{HEAD}fn step(s, a) {{\n  s.n += undefined;\n}}\n"))]);
    let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .args(["check", "envs/t.rhai"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.starts_with("envs/t.rhai:5:10: "), "{text}");
}

#[test]
fn check_reports_every_broken_script_of_an_experiment() {
    let dir = project(&[
        ("envs/t.rhai", &format!("{HEAD}fn step(s, a) {{ #{{ reward: 0.0, done: true }} }}\n")),
        ("prompts/p.rhai", "fn system(info) { 1 }\nfn user(info, turn) { \"\" }\n"),
        ("rewards/r.rhai", "fn shape(turn, reward) {\n  reward + turn.bonus\n}\n"),
        ("scripts/x.rhai", "fn experiment() { #{ env: \"envs/t.rhai\", prompt: \"prompts/p.rhai\", rewards: [\"rewards/r.rhai\"] } }\n"),
    ]);
    let lines = check(&Host::new(dir.path(), Limits::default()), &dir.path().join("scripts/x.rhai"), 5, &[]);
    let problems: Vec<String> = lines.iter().filter_map(|l| l.as_ref().err().map(|e| e.to_string())).collect();
    assert_eq!(problems.len(), 2, "{lines:?}");
    assert!(problems[0].starts_with("prompts/p.rhai:1:1: system must return a string; got an integer"), "{problems:?}");
    assert!(problems[1].starts_with("rewards/r.rhai:2:17: in shape: property not found: bonus"), "{problems:?}");
    assert!(lines[0].as_ref().is_ok_and(|l| l.starts_with("ok: envs/t.rhai")), "{lines:?}");
}

#[test]
fn new_writes_a_starter_that_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let bin = env!("CARGO_BIN_EXE_ragen-lab");
    let out = Command::new(bin).args(["new", "maze"]).current_dir(dir.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    for script in ["envs/maze.rhai", "scripts/maze.rhai"] {
        let out =
            Command::new(bin).args(["check", script, "--episodes", "20"]).current_dir(dir.path()).output().unwrap();
        assert!(out.status.success(), "{script}: {}", String::from_utf8_lossy(&out.stdout));
    }
    let again = Command::new(bin).args(["new", "maze"]).current_dir(dir.path()).output().unwrap();
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

/// `play --actions A,A --json --watch --poll` on `envs/t.rhai` in `dir` (stderr piped), and a
/// function that returns its next JSON line (panicking after 20 s of silence).
fn play_watching(dir: &Path) -> (std::process::Child, impl Fn() -> Value) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .args(["play", "--env", "envs/t.rhai", "--actions", "A,A", "--json", "--watch", "--poll"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap()).is_err() {
                return;
            }
        }
    });
    let next = move || -> Value {
        serde_json::from_str(&rx.recv_timeout(Duration::from_secs(20)).expect("play stopped printing")).unwrap()
    };
    (child, next)
}

#[test]
fn play_watch_replays_on_the_new_version() {
    let dir = project(&[("envs/t.rhai", GOOD)]);
    let (mut child, next) = play_watching(dir.path());
    let first: Vec<Value> = (0..3).map(|_| next()).collect();
    assert_eq!(first[2]["obs"], "n=2");
    std::fs::write(dir.path().join("envs/t.rhai"), GOOD.replace("`n=${s.n}`", "`count ${s.n}`")).unwrap();
    let replay: Vec<Value> = (0..3).map(|_| next()).collect();
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(replay[0]["event"], "reset");
    assert_ne!(replay[0]["version"], first[0]["version"]);
    assert_eq!(replay[2]["obs"], "count 2");
}

#[test]
fn episodes_run_on_many_threads_exactly_as_on_one() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Host>();
    send_sync::<EnvScript>();
    send_sync::<ragen_lab::script::Episode>();
    let e = env("frozenlake");
    let p = params(&e, &[]);
    let play = |seed: u64| -> Vec<String> {
        let mut ep = e.reset(seed, seed, &p).unwrap();
        let mut trace = vec![ep.render().unwrap()];
        while !ep.done && ep.steps < 10 {
            let o = ep.step("Down").unwrap();
            trace.push(format!("{o:?} {}", ep.render().unwrap()));
        }
        trace
    };
    let one: Vec<Vec<String>> = (0..32).map(play).collect();
    let many: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> =
            (0..4u64).map(|t| s.spawn(move || (0..8).map(|i| play(t * 8 + i)).collect::<Vec<_>>())).collect();
        handles.into_iter().flat_map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(one, many);
}

// ---- issue 11: play and check act through the rollout's turn code ------------------------------

/// Two actions, a budget of 3 per episode, never done by itself; `Up` pays 1.
const BUDGET: &str = r#"fn describe(p) { #{ name: "b", instruction: "i", actions: ["Up", "Down"], max_actions: 3 } }
fn reset(seed, p) { #{ n: 0 } }
fn render(s) { `n=${s.n}` }
fn step(s, a) { s.n += 1; #{ reward: if a == "Up" { 1.0 } else { 0.0 }, done: false, valid: a == "Up" || a == "Down" } }
"#;

fn json_lines(out: &[u8]) -> Vec<Value> {
    String::from_utf8_lossy(out).lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn play_matches_actions_like_training_drops_unknown_pieces_and_ends_at_the_action_budget() {
    let dir = project(&[("envs/b.rhai", BUDGET)]);
    let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .args(["play", "--env", "envs/b.rhai", "--actions", "up || JUMP || down,UP,Up,Down", "--json"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let lines = json_lines(&out.stdout);
    let steps: Vec<(&str, bool)> =
        lines[1..].iter().map(|l| (l["action"].as_str().unwrap(), l["done"].as_bool().unwrap())).collect();
    assert_eq!(
        steps,
        [("Up", false), ("Down", false), ("Up", true)],
        "canonical names, jump dropped, done at 3: {lines:?}"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dropped \"JUMP\": not an action of this env (Up, Down)"), "{err}");
}

#[test]
fn play_watch_survives_a_version_that_fails_during_the_replay() {
    let dir = project(&[("envs/t.rhai", GOOD)]);
    let (mut child, next) = play_watching(dir.path());
    let first: Vec<Value> = (0..3).map(|_| next()).collect();
    assert_eq!(first[2]["obs"], "n=2");
    // Compiles and passes the one-step smoke test, but throws on the replay's second step.
    let failing = GOOD.replace("s.n += 1;", "if s.n == 1 { throw \"second step\"; } s.n += 1;");
    std::fs::write(dir.path().join("envs/t.rhai"), failing).unwrap();
    let (reset, step) = (next(), next());
    assert_eq!((reset["event"].as_str(), step["obs"].as_str()), (Some("reset"), Some("n=1")));
    std::fs::write(dir.path().join("envs/t.rhai"), GOOD.replace("`n=${s.n}`", "`count ${s.n}`")).unwrap();
    let replay: Vec<Value> = (0..3).map(|_| next()).collect();
    assert!(child.try_wait().unwrap().is_none(), "play quit");
    let _ = child.kill();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let _ = child.wait();
    assert_eq!(replay[2]["obs"], "count 2", "the fixed version replays the episode");
    assert!(err.contains("the new version failed replaying the episode, keeping the old one"), "{err}");
    assert!(err.contains("second step"), "{err}");
}

#[test]
fn check_turn_runs_a_reward_script_or_an_experiment_on_a_written_turn() {
    let dir = project(&[
        ("envs/b.rhai", BUDGET),
        ("prompts/p.rhai", "fn system(info) { \"s\" }\nfn user(info, turn) { turn.obs }\n"),
        ("rewards/r.rhai", "fn shape(turn, reward) { reward + turn.actions.len() }\n"),
        ("scripts/x.rhai", "fn experiment() { #{ env: \"envs/b.rhai\", prompt: \"prompts/p.rhai\", rewards: [\"rewards/r.rhai\"] } }\n"),
        ("alone.json", r#"{"response": "plan</think><answer>up || jump</answer>", "actions": ["Up", "Down"], "env_reward": 0.5}"#),
        ("played.json", r#"{"response": "<think>go</think><answer>UP || down</answer>", "before": ["Up"], "seed": 3}"#),
    ]);
    let run = |script: &str, turn: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
            .args(["check", script, "--turn", turn])
            .current_dir(dir.path())
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let alone = run("rewards/r.rhai", "alone.json");
    assert_eq!(alone["turn"]["actions"], json!(["Up"]));
    assert_eq!(alone["turn"]["invalid_actions"], json!(["jump"]));
    assert_eq!(alone["reward"], 1.5);
    assert_eq!(alone["shaped"], json!([{"script": "rewards/r.rhai", "reward": 1.5}]));

    // On the experiment's env: one action left of the budget of 3 after `before`... two are.
    let played = run("scripts/x.rhai", "played.json");
    assert_eq!(played["turn"]["actions"], json!(["Up", "Down"]));
    assert_eq!(played["steps"].as_array().unwrap().len(), 2);
    assert_eq!(played["env_reward"], 1.0);
    assert_eq!(played["done"], true, "3 actions spent");
    assert_eq!(played["reward"], 3.0, "env 1 + 2 parsed actions");

    std::fs::write(
        dir.path().join("over.json"),
        r#"{"response": "<answer>Up || Up</answer>", "before": ["Up || Up"], "think": false}"#,
    )
    .unwrap();
    let over = run("scripts/x.rhai", "over.json");
    assert_eq!((over["steps"].as_array().unwrap().len(), over["dropped"].clone()), (1, json!(["Up"])));
}

#[test]
fn check_counts_one_success_in_the_singular() {
    let src = "fn describe(p) { #{ name: \"t\", instruction: \"i\", actions: [\"A\"] } }\nfn reset(seed, p) { #{ n: 0 } }\nfn render(s) { `n=${s.n}` }\nfn step(s, a) { #{ reward: 1.0, done: true, success: true } }\n";
    let dir = project(&[("envs/t.rhai", src)]);
    let lines = check(&Host::new(dir.path(), Limits::default()), &dir.path().join("envs/t.rhai"), 1, &[]);
    let line = lines[0].as_ref().unwrap();
    assert!(line.contains("1 random episode, 1 step, 1 success, deterministic"), "{line}");
}
