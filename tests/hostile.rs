//! The sandbox under hostile scripts (issue 10): for each class of attack, at least three cases,
//! each asserting the exact error kind and its place. Limits are tight here (200k operations,
//! 400 ms, 64 MiB), so every runaway stops within a fraction of a second; memory is counted by
//! the same allocator wrapper the binary installs.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ragen_lab::cli::check::check;
use ragen_lab::script::{
    Counted, EnvScript, ErrorKind, Experiment, Host, Limits, RewardScript, Role, ScriptError, Update, WatchMode,
    Watcher,
};
use ragen_lab::starpo::rundir::RunDir;
use serde_json::Map;

#[global_allocator]
static ALLOC: Counted<std::alloc::System> = Counted(std::alloc::System);

/// A temporary project with the given files (relative path, content).
fn project(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for sub in ["envs", "prompts", "rewards", "scripts"] {
        std::fs::create_dir_all(dir.path().join(sub)).unwrap();
    }
    for (p, text) in files {
        std::fs::write(dir.path().join(p), text).unwrap();
    }
    dir
}

fn tight() -> Limits {
    Limits {
        max_operations: 200_000,
        call_timeout: Duration::from_millis(400),
        max_memory: 64 << 20,
        ..Limits::default()
    }
}

/// A well-behaved env with `fn run()` for the attack: lines 1-4 are the env, line 5 on the attack.
const ENV: &str = r#"fn describe(p) { #{ name: "t", instruction: "i", actions: ["A"] } }
fn reset(seed, p) { #{ n: 0 } }
fn render(s) { `n=${s.n}` }
fn step(s, a) { s.n += 1; #{ reward: 1.0, done: false } }
"#;

/// Compiles `envs/t.rhai` = ENV + `attack` (plus `files`) and calls `run()`; returns the error.
fn attack_with(files: &[(&str, &str)], attack: &str) -> ScriptError {
    let mut all = files.to_vec();
    let src = format!("{ENV}{attack}");
    all.push(("envs/t.rhai", &src));
    let dir = project(&all);
    let host = Host::new(dir.path(), tight());
    let started = Instant::now();
    let out = host.compile(Path::new("envs/t.rhai")).and_then(|s| s.call("run", (), None));
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    out.expect_err("the attack should fail")
}

fn attack(src: &str) -> ScriptError {
    attack_with(&[], src)
}

/// Asserts the kind and the place (`path:line:col`; col 0 = any column).
#[track_caller]
fn assert_at(e: &ScriptError, kind: ErrorKind, path: &str, line: usize, col: usize) {
    assert_eq!(e.kind, kind, "{e}");
    assert_eq!((e.path.as_str(), e.line), (path, line), "{e}");
    if col > 0 {
        assert_eq!(e.col, col, "{e}");
    }
}

/// Plays `envs/t.rhai` = ENV with `replace` replaced; returns the first error of a reset, a
/// render, valid_actions and two steps.
#[track_caller]
fn env_error(replace: &str, with: &str) -> ScriptError {
    let src = ENV.replace(replace, with);
    let dir = project(&[("envs/t.rhai", &src)]);
    let host = Host::new(dir.path(), tight());
    let env = EnvScript::load(&host, Path::new("envs/t.rhai")).unwrap();
    let out = env.reset(1, 0, &Map::new()).and_then(|mut ep| {
        ep.render()?;
        ep.valid_actions()?;
        ep.step("A")?;
        ep.step("A")
    });
    out.expect_err("the env should fail")
}

// ---- 1. host panics from script input --------------------------------------------------------

#[test]
fn rng_int_takes_any_range_without_overflow() {
    let src = ENV.replace(
        "#{ n: 0 }",
        "#{ n: rng::int(-9223372036854775807 - 1, 9223372036854775807), m: rng::int(9223372036854775806, 9223372036854775807), k: rng::int(-9223372036854775807 - 1, -9223372036854775807 - 1) }",
    );
    let dir = project(&[("envs/t.rhai", &src)]);
    let env = EnvScript::load(&Host::new(dir.path(), tight()), Path::new("envs/t.rhai")).unwrap();
    let state = env.reset(7, 0, &Map::new()).unwrap().state_json();
    assert!(state["m"].as_i64().unwrap() >= i64::MAX - 1, "{state}");
    assert_eq!(state["k"].as_i64(), Some(i64::MIN), "{state}");
}

#[test]
fn rng_misuse_is_an_error_at_the_rng_call() {
    let e = env_error("#{ n: 0 }", "#{ n: rng::int(5, 1) }");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 2, 32);
    assert!(e.message.contains("hi must be >= lo"), "{e}");
    let e = env_error("#{ n: 0 }", "#{ n: rng::below(-3) }");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 2, 32);
    let e = env_error("`n=${s.n}`", "`n=${rng::float()}`");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 3, 26);
    assert!(e.message.contains("only inside reset and step"), "{e}");
}

#[test]
fn standard_functions_with_extreme_arguments_fail_cleanly_or_work() {
    // Each line once panicked somewhere or might: extreme indices, counts and steps.
    for (line, src) in [
        "let s = \"abc\"; s.sub_string(-9223372036854775807 - 1, 9223372036854775807)",
        "let a = [1, 2, 3]; a.extract(-9223372036854775807 - 1, 9223372036854775807)",
        "let a = [1, 2, 3]; a.splice(9223372036854775807, 9223372036854775807, [4]); a",
        "let n = 0; for i in range(0, 9223372036854775807, 4611686018427387904) { n += 1 } n",
        "let x = [3, 1, 2, 5, 4, 7, 6, 9, 8, 0, 11, 10, 13, 12, 15, 14, 17, 16, 19, 18, 21, 20]; x.sort(|a, b| if a % 3 == 0 { -1 } else { 1 }); x",
        "(-9223372036854775807 - 1).abs()",
        "let s = \"x\"; s.pad(-5, \"y\"); s.split_at(-9223372036854775807 - 1)",
        "let b = blob(4); b.parse_le_int(-9223372036854775807 - 1, 9223372036854775807)",
        "1 << 64",
        "(-9223372036854775807 - 1) / -1",
    ]
    .iter()
    .enumerate()
    {
        let dir = project(&[("envs/t.rhai", &format!("{ENV}fn run() {{ {src} }}\n"))]);
        let host = Host::new(dir.path(), tight());
        match host.compile(Path::new("envs/t.rhai")).and_then(|s| s.call("run", (), None)) {
            Ok(_) => {}
            Err(e) => {
                assert!(matches!(e.kind, ErrorKind::Runtime | ErrorKind::Size), "case {line}: {e}");
                assert_eq!((e.line, e.path.as_str()), (5, "envs/t.rhai"), "case {line}: {e}");
            }
        }
    }
}

#[test]
fn the_watcher_outlives_a_hostile_edit() {
    let dir = project(&[("envs/t.rhai", ENV)]);
    let host = Host::new(dir.path(), tight());
    let path = dir.path().join("envs/t.rhai");
    let w = Watcher::new(host, vec![(path.clone(), Role::Env, Map::new())], WatchMode::Poll(Duration::from_millis(30)))
        .unwrap();
    // A stack-overflow import cycle, then an allocation bomb; the watcher thread must survive
    // both and still offer the good edit after them.
    std::fs::write(dir.path().join("envs/a.rhai"), "import \"envs/t\" as t;\nfn f() { 1 }\n").unwrap();
    std::fs::write(&path, format!("import \"envs/a\" as a;\n{ENV}")).unwrap();
    let e = rejected(&w);
    assert_at(&e, ErrorKind::Import, "envs/a.rhai", 1, 1);
    std::fs::write(&path, ENV.replace("#{ n: 0 }", "{ let s = \"ab\"; loop { s.replace(\"a\", s + s); } }")).unwrap();
    let e = rejected(&w);
    assert_at(&e, ErrorKind::Size, "envs/t.rhai", 2, 0);
    std::fs::write(&path, ENV.replace("reward: 1.0", "reward: 2.0")).unwrap();
    match w.wait(Duration::from_secs(10)) {
        Some(Update::Swapped { .. }) => {}
        other => panic!("live reload died: {other:?}"),
    }
}

fn rejected(w: &Watcher) -> ScriptError {
    match w.wait(Duration::from_secs(10)) {
        Some(Update::Rejected { error, .. }) => error,
        other => panic!("expected a rejection, got {other:?}"),
    }
}

// ---- 2. stack-overflow aborts ------------------------------------------------------------------

#[test]
fn mutual_imports_are_refused_by_name() {
    let e = attack_with(
        &[
            ("envs/a.rhai", "import \"envs/b\" as b;\nfn f() { 1 }\n"),
            ("envs/b.rhai", "fn g() { 2 }\nimport \"envs/a\" as a;\n"),
        ],
        "fn run() { import \"envs/a\" as a; a::f() }\n",
    );
    assert_at(&e, ErrorKind::Import, "envs/b.rhai", 2, 1);
    assert!(e.message.contains("import cycle envs/t.rhai → envs/a.rhai → envs/b.rhai → envs/a.rhai"), "{e}");
}

#[test]
fn a_script_importing_itself_is_a_cycle() {
    let e = attack("fn run() {\n  import \"envs/t\" as me;\n  1\n}\n");
    assert_at(&e, ErrorKind::Import, "envs/t.rhai", 6, 3);
    assert!(e.message.contains("import cycle envs/t.rhai → envs/t.rhai"), "{e}");
}

#[test]
fn imports_nested_too_deep_are_refused() {
    let files: Vec<(String, String)> = (0..12)
        .map(|i| (format!("envs/m{i}.rhai"), format!("import \"envs/m{}\" as next;\nfn f() {{ {i} }}\n", i + 1)))
        .chain([("envs/m12.rhai".to_string(), "fn f() { 12 }\n".to_string())])
        .collect();
    let refs: Vec<(&str, &str)> = files.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    let e = attack_with(&refs, "fn run() { import \"envs/m0\" as m; m::f() }\n");
    assert_eq!(e.kind, ErrorKind::Import, "{e}");
    assert_eq!(e.line, 1, "{e}");
    assert!(e.message.contains("nest deeper than 8"), "{e}");
}

#[test]
fn deep_curried_fn_chains_are_stopped() {
    // Built deep, each `curry` copies the chain: the budget stops it long before the stack.
    let e = attack("fn run() {\n  let f = Fn(\"run\");\n  loop { f = Fn(\"run\").curry(f); }\n}\n");
    assert!(matches!(e.kind, ErrorKind::Operations | ErrorKind::Timeout), "{e}");
    assert_at(&e, e.kind, "envs/t.rhai", 5, 1);
    // Handed back, a chain deeper than max_depth is refused before the host walks it.
    let e = attack("fn run() {\n  let f = Fn(\"run\");\n  for i in 0..100 { f = Fn(\"run\").curry(f); }\n  f\n}\n");
    assert_at(&e, ErrorKind::Depth, "envs/t.rhai", 5, 1);
    // Nested arrays too.
    let e = attack("fn run() { let a = []; for i in 0..100 { a = [a]; } a }\n");
    assert_at(&e, ErrorKind::Depth, "envs/t.rhai", 5, 1);
}

#[test]
fn deep_recursion_through_fn_pointers_is_stopped() {
    let e = attack("fn run() { deep(Fn(\"deep\")) }\nfn deep(f) { f.call(f) }\n");
    assert_eq!(e.kind, ErrorKind::Depth, "{e}");
    assert!(e.message.contains("stack overflow"), "{e}");
}

// ---- 3. memory limits bypassed ------------------------------------------------------------------

#[test]
fn replace_is_checked_before_it_builds() {
    // Rhai gives a method call's native function no position: the error points at the function.
    let e = attack("fn run() {\n  let s = \"a\"; s.pad(1000000, \"a\");\n  s.replace(\"a\", s);\n}\n");
    assert_at(&e, ErrorKind::Size, "envs/t.rhai", 5, 1);
    assert!(e.message.contains("1000000000000 bytes"), "{e}");
    let e = attack("fn run() {\n  let s = \"ab\"; s.pad(1000000, \"ab\");\n  s.replace('a', s);\n}\n");
    assert_at(&e, ErrorKind::Size, "envs/t.rhai", 5, 1);
    let e = attack("fn run() {\n  let s = \"ab\"; s.pad(1000000, \"ab\");\n  s.replace(\"\", \"xyz\");\n}\n");
    assert_at(&e, ErrorKind::Size, "envs/t.rhai", 5, 1);
}

#[test]
fn strings_captured_in_closures_count_against_memory() {
    let e = attack(
        "fn run() {\n  let s = \"a\"; s.pad(1000000, \"a\");\n  let fs = [];\n  for i in 0..1000 { let t = s + i; fs.push(|| t); }\n}\n",
    );
    assert_at(&e, ErrorKind::Memory, "envs/t.rhai", 5, 1);
}

#[test]
fn strings_curried_into_fn_pointers_count_against_memory() {
    let e = attack(
        "fn run() {\n  let s = \"a\"; s.pad(1000000, \"a\");\n  let fs = [];\n  for i in 0..1000 { fs.push(Fn(\"run\").curry(s + i)); }\n}\n",
    );
    assert_at(&e, ErrorKind::Memory, "envs/t.rhai", 5, 1);
    // Doubling a pointer by currying it into itself: memory, not an allocation abort.
    let e = attack("fn run() {\n  let f = Fn(\"run\");\n  for i in 0..60 { f = f.curry(f); }\n}\n");
    assert_at(&e, ErrorKind::Memory, "envs/t.rhai", 5, 1);
}

#[test]
fn a_state_holding_big_closures_is_refused() {
    // Each step keeps another 600 KB string in a closure in the state map: over max_string_size
    // (1 MiB) on the second step, though no single string is too large.
    let e = env_error("s.n += 1;", "let t = \"a\"; t.pad(600000, \"a\"); t += s.n; s[`f${s.n}`] = || t; s.n += 1;");
    assert_at(&e, ErrorKind::Size, "envs/t.rhai", 4, 1);
    assert!(e.message.contains("closures and curried values count"), "{e}");
}

// ---- 4. hangs outside the time budget ------------------------------------------------------------

#[cfg(unix)]
fn fifo(path: &Path) {
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

#[cfg(unix)]
#[test]
fn an_import_naming_a_fifo_does_not_block() {
    let dir = project(&[("envs/t.rhai", &format!("{ENV}fn run() {{\n  import \"envs/pipe\" as p;\n}}\n"))]);
    fifo(&dir.path().join("envs/pipe.rhai"));
    let e = Host::new(dir.path(), tight()).compile(Path::new("envs/t.rhai")).unwrap_err();
    assert_at(&e, ErrorKind::Import, "envs/t.rhai", 6, 3);
    assert!(e.message.contains("not a regular file"), "{e}");
}

#[cfg(unix)]
#[test]
fn a_script_that_is_a_fifo_does_not_block() {
    let dir = project(&[]);
    fifo(&dir.path().join("envs/t.rhai"));
    let e = Host::new(dir.path(), tight()).compile(Path::new("envs/t.rhai")).unwrap_err();
    assert_at(&e, ErrorKind::File, "envs/t.rhai", 0, 0);
    // Nor does the watcher when a watched script is replaced by one.
    let dir = project(&[("envs/t.rhai", ENV)]);
    let path = dir.path().join("envs/t.rhai");
    let host = Host::new(dir.path(), tight());
    let w = Watcher::new(host, vec![(path.clone(), Role::Env, Map::new())], WatchMode::Poll(Duration::from_millis(30)))
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    fifo(&path);
    let e = rejected(&w);
    assert_eq!(e.kind, ErrorKind::File, "{e}");
}

#[test]
fn the_budget_spans_every_imported_module() {
    // Each module's top level is cheap on its own; Rhai restarts its count per module, the
    // sandbox does not.
    let heavy = "let n = 0; for i in 0..60000 { n += i; }\nfn f() { 1 }\n";
    let files: Vec<(String, String)> = (0..6)
        .map(|i| (format!("envs/h{i}.rhai"), format!("import \"envs/h{}\" as next;\n{heavy}", i + 1)))
        .chain([("envs/h6.rhai".to_string(), heavy.to_string())])
        .collect();
    let refs: Vec<(&str, &str)> = files.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    let e = attack_with(&refs, "fn run() { import \"envs/h0\" as h; h::f() }\n");
    assert!(matches!(e.kind, ErrorKind::Operations | ErrorKind::Timeout), "{e}");
    assert!(e.path.starts_with("envs/h"), "{e}");
}

#[test]
fn an_env_that_is_never_done_cannot_make_check_run_forever() {
    let never = ENV.replace("actions: [\"A\"]", "actions: [\"A\"], max_actions: 1000000000");
    let dir = project(&[("envs/t.rhai", &never)]);
    let host = Host::new(dir.path(), tight());
    let lines = check(&host, &dir.path().join("envs/t.rhai"), 3, &[]);
    let e = lines[0].as_ref().unwrap_err();
    assert_at(e, ErrorKind::Contract, "envs/t.rhai", 1, 1);
    assert!(e.message.contains("`max_actions` as an integer from 1 to 10000"), "{e}");
    let turns = ENV.replace("actions: [\"A\"]", "actions: [\"A\"], max_turns: 5000");
    let dir = project(&[("envs/t.rhai", &turns)]);
    let lines = check(&Host::new(dir.path(), tight()), &dir.path().join("envs/t.rhai"), 3, &[]);
    assert_at(lines[0].as_ref().unwrap_err(), ErrorKind::Contract, "envs/t.rhai", 1, 1);
}

// ---- 5. code that changes without a version change ----------------------------------------------

#[test]
fn an_import_path_built_at_run_time_is_refused() {
    let e = attack_with(
        &[("envs/g.rhai", "fn f() { 1 }\n")],
        "fn run() {\n  let p = \"envs/\" + \"g\";\n  import p as g;\n}\n",
    );
    assert_at(&e, ErrorKind::Import, "envs/t.rhai", 7, 10);
    assert!(e.message.contains("computed at run time"), "{e}");
}

#[test]
fn an_import_path_from_an_argument_is_refused_inside_a_module_too() {
    let module = "fn load(p) {\n  import p as m;\n  m::f()\n}\n";
    let e = attack_with(
        &[("envs/g.rhai", module), ("envs/h.rhai", "fn f() { 1 }\n")],
        "fn run() { import \"envs/g\" as g; g::load(\"envs/h\") }\n",
    );
    assert_at(&e, ErrorKind::Import, "envs/g.rhai", 2, 10);
}

#[test]
fn every_imported_file_is_in_the_version_and_in_the_recorded_copy() {
    let dir = project(&[
        ("envs/g.rhai", "fn f() { 1 }\n"),
        ("envs/t.rhai", &format!("{ENV}fn run() {{ import \"envs/g\" as g; g::f() }}\n")),
    ]);
    let host = Host::new(dir.path(), tight());
    let v1 = host.compile(Path::new("envs/t.rhai")).unwrap();
    std::fs::write(dir.path().join("envs/g.rhai"), "fn f() { 2 }\n").unwrap();
    let v2 = host.compile(Path::new("envs/t.rhai")).unwrap();
    assert_ne!(v1.version(), v2.version(), "an edited import makes a new version");
    assert_eq!(v1.call("run", (), None).unwrap().as_int(), Ok(1), "a version never changes under its user");
    // The run directory keeps what was compiled, not what is on disk now.
    std::fs::write(dir.path().join("envs/t.rhai"), "garbage").unwrap();
    let mut run = RunDir::create(&dir.path().join("run")).unwrap();
    run.record_script(1, "env", &v1).unwrap();
    let copy = std::fs::read_to_string(dir.path().join(format!("run/scripts/{}.rhai", v1.version()))).unwrap();
    assert_eq!(copy, v1.source());
    let imports =
        std::fs::read_to_string(dir.path().join(format!("run/scripts/{}.imports.json", v1.version()))).unwrap();
    assert!(imports.contains("fn f() { 1 }"), "{imports}");
}

// ---- 6. a live edit that passes the smoke test (the trainer's rollback: tests/train.rs) ---------

#[test]
fn a_live_edit_is_offered_only_after_it_passes_under_the_limits() {
    let dir = project(&[("envs/t.rhai", ENV)]);
    let path = dir.path().join("envs/t.rhai");
    let w = Watcher::new(
        Host::new(dir.path(), tight()),
        vec![(path.clone(), Role::Env, Map::new())],
        WatchMode::Poll(Duration::from_millis(30)),
    )
    .unwrap();
    for (edit, kind, line) in [
        (ENV.replace("s.n += 1;", "loop { }"), ErrorKind::Operations, 4),
        (ENV.replace("s.n += 1;", "s.n += ;"), ErrorKind::Syntax, 4),
        (ENV.replace("reward: 1.0", "reward: parse_float(\"inf\")"), ErrorKind::Contract, 4),
        (ENV.replace("#{ n: 0 }", "42"), ErrorKind::Contract, 2),
    ] {
        std::fs::write(&path, edit).unwrap();
        let e = rejected(&w);
        assert_at(&e, kind, "envs/t.rhai", line, 0);
    }
}

// ---- 7. unbounded side channels -----------------------------------------------------------------

fn play_stderr(dir: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_ragen-lab"))
        .args(["play", "--env", "envs/t.rhai", "--actions", "A"])
        .current_dir(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn print_output_is_capped_per_call() {
    let flood = ENV.replace("s.n += 1;", "for i in 0..100000 { print(\"0123456789\"); } s.n += 1;");
    let dir = project(&[("envs/t.rhai", &flood)]);
    let err = play_stderr(dir.path());
    assert!(err.len() < 80_000, "{} bytes of stderr", err.len());
    assert!(err.contains("further output of this call dropped (Limits::max_output)"), "{}", &err[err.len() - 300..]);
}

#[test]
fn control_characters_from_scripts_are_escaped() {
    let noisy = ENV.replace("s.n += 1;", "print(\"\\x1b[2J\\x07ring\"); debug(\"\\x1b]0;title\\x07\"); s.n += 1;");
    let dir = project(&[("envs/t.rhai", &noisy)]);
    let err = play_stderr(dir.path());
    assert!(!err.contains('\u{1b}') && !err.contains('\u{7}'), "{err:?}");
    assert!(err.contains("\\u{1b}[2J\\u{7}ring"), "{err}");
    let e = attack("fn run() { throw \"\\x1b[31mred\"; }\n");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 5, 12);
    assert!(e.message.contains("\\u{1b}[31mred") && !e.message.contains('\u{1b}'), "{e}");
}

#[test]
fn a_huge_script_file_is_refused_before_it_is_read_whole() {
    let big = format!("{ENV}// {}\n", "x".repeat(2 << 20));
    let dir = project(&[("envs/t.rhai", &big)]);
    let e = Host::new(dir.path(), tight()).compile(Path::new("envs/t.rhai")).unwrap_err();
    assert_at(&e, ErrorKind::File, "envs/t.rhai", 0, 0);
    assert!(e.message.contains("larger than 1048576 bytes"), "{e}");
    // An imported one too.
    let dir = project(&[("envs/big.rhai", &big)]);
    std::fs::write(dir.path().join("envs/t.rhai"), format!("{ENV}fn run() {{\n  import \"envs/big\" as b;\n}}\n"))
        .unwrap();
    let e = Host::new(dir.path(), tight()).compile(Path::new("envs/t.rhai")).unwrap_err();
    assert_at(&e, ErrorKind::Import, "envs/t.rhai", 6, 3);
}

// ---- 8. paths not confined ----------------------------------------------------------------------

fn experiment_error(env_path: &str) -> ScriptError {
    let dir = project(&[
        ("envs/t.rhai", ENV),
        ("prompts/p.rhai", "fn system(info) { \"\" }\nfn user(info, turn) { \"\" }\n"),
        (
            "scripts/x.rhai",
            &format!("// an experiment\nfn experiment() {{ #{{ env: {env_path:?}, prompt: \"prompts/p.rhai\" }} }}\n"),
        ),
    ]);
    std::fs::write(dir.path().join("outside.rhai"), "root:x:0:0\n").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(dir.path().join("outside.rhai"), dir.path().join("envs/link.rhai")).unwrap();
    Experiment::load(&Host::new(dir.path(), tight()), Path::new("scripts/x.rhai")).unwrap_err()
}

#[test]
fn an_experiment_cannot_name_a_file_outside_the_script_folders() {
    for (path, why) in [
        ("/etc/passwd", "absolute paths are not allowed"),
        ("../outside.rhai", "`..` and `.` are not allowed"),
        ("outside.rhai", "name a file under envs/"),
        #[cfg(unix)]
        ("envs/link.rhai", "lies outside envs/"),
    ] {
        let e = experiment_error(path);
        assert_at(&e, ErrorKind::File, "scripts/x.rhai", 2, 1);
        assert!(e.message.contains(why) && !e.message.contains("root:"), "{path}: {e}");
    }
}

#[test]
fn imports_cannot_leave_the_script_folders() {
    for (path, kind_of_refusal) in
        [("/etc/passwd", "absolute"), ("envs/../../x", "`..`"), ("tmp/x", "name a file under")]
    {
        let e = attack(&format!("fn run() {{\n  import \"{path}\" as x;\n}}\n"));
        assert_at(&e, ErrorKind::Import, "envs/t.rhai", 6, 3);
        assert!(e.message.contains(kind_of_refusal), "{path}: {e}");
    }
}

// ---- 9. non-finite and extreme numbers ----------------------------------------------------------

#[test]
fn non_finite_and_extreme_env_rewards_are_refused_by_name() {
    for (reward, says) in
        [("parse_float(\"NaN\")", "is NaN"), ("parse_float(\"-inf\")", "is -inf"), ("1e308", "beyond ±1e9")]
    {
        let e = env_error("reward: 1.0", &format!("reward: {reward}"));
        assert_at(&e, ErrorKind::Contract, "envs/t.rhai", 4, 1);
        assert!(e.message.contains(says), "{reward}: {e}");
    }
}

#[test]
fn non_finite_and_extreme_shaped_rewards_are_refused_by_name() {
    let turn = ragen_lab::script::turn::parse_turn("<answer>A</answer>", &["A".to_string()], 1, true);
    for (ret, says) in [
        ("reward / 0.0", "is inf"),
        ("parse_float(\"NaN\")", "is NaN"),
        ("-1e300", "beyond ±1e9"),
        ("\"1\"", "must be a number"),
    ] {
        let dir = project(&[("rewards/r.rhai", &format!("// shaping\nfn shape(turn, reward) {{ {ret} }}\n"))]);
        let r = RewardScript::load(&Host::new(dir.path(), tight()), Path::new("rewards/r.rhai")).unwrap();
        let e = r.shape(&turn, &[], 1.0).unwrap_err();
        assert_at(&e, ErrorKind::Contract, "rewards/r.rhai", 2, 1);
        assert!(e.message.contains(says), "{ret}: {e}");
    }
}

#[test]
fn extreme_scores_normalise_to_finite_advantages() {
    use ragen_lab::starpo::normalize::normalize;
    use ragen_lab::starpo::settings::RewardNorm;
    let scores = [1e308, -1e308, 1e308, 5.0, f64::MAX, -f64::MAX, 0.0, 0.0];
    let members = vec![vec![0, 1, 2, 3], vec![4, 5], vec![6, 7]];
    for norm in [RewardNorm::MeanStd, RewardNorm::AsymClip] {
        let out = normalize(&scores, &members, norm);
        assert!(out.iter().all(|x| x.is_finite()), "{norm:?}: {out:?}");
    }
    let out = normalize(&[1e307, -1e307, 3e307], &[vec![0, 1, 2]], RewardNorm::Mean);
    assert!(out.iter().all(|x| x.is_finite()) && (out[0] - 0.0).abs() < 1e300, "{out:?}");
    let out = normalize(&scores, &members, RewardNorm::MeanStd);
    assert!(out[0] > 0.0 && out[1] < 0.0 && out[4] > 0.0 && out[5] < 0.0, "{out:?}");
    assert_eq!(&out[6..], &[0.0, 0.0], "a group without variance has no signal");
}

// ---- 10. errors without a place -----------------------------------------------------------------

#[test]
fn wrong_return_shapes_point_at_their_function() {
    let e = env_error("#{ n: 0 }", "42");
    assert_at(&e, ErrorKind::Contract, "envs/t.rhai", 2, 1);
    assert!(e.message.contains("reset must return the state as a map") && e.message.contains("got an integer"), "{e}");
    let e = env_error("#{ reward: 1.0, done: false }", "#{ reward: 1.0 }");
    assert_at(&e, ErrorKind::Contract, "envs/t.rhai", 4, 1);
    assert!(e.message.contains("`done` is missing"), "{e}");
    let e = env_error("fn step(s, a) {", "fn valid_actions(s) { [\"A\", 2] }\nfn step(s, a) {");
    assert_at(&e, ErrorKind::Contract, "envs/t.rhai", 4, 1);
    assert!(e.message.contains("array of strings; found 2"), "{e}");
    let e = env_error("`n=${s.n}`", "s.n");
    assert_at(&e, ErrorKind::Contract, "envs/t.rhai", 3, 1);
}

#[test]
fn a_shape_with_the_wrong_parameters_is_reported_as_a_reward_script() {
    let dir = project(&[("rewards/r.rhai", "fn shape(turn) { 0.0 }\n")]);
    let lines = check(&Host::new(dir.path(), tight()), &dir.path().join("rewards/r.rhai"), 1, &[]);
    let e = lines[0].as_ref().unwrap_err();
    assert_eq!(e.kind, ErrorKind::Contract, "{e}");
    assert!(e.message.contains("missing `fn shape(turn, reward)` (found one taking 1 argument(s))"), "{e}");
    assert!(Role::detect(&Host::new(dir.path(), tight()), &dir.path().join("rewards/r.rhai")).unwrap() == Role::Reward);
    let dir = project(&[("prompts/p.rhai", "fn system() { \"\" }\nfn user(info, turn) { \"\" }\n")]);
    let lines = check(&Host::new(dir.path(), tight()), &dir.path().join("prompts/p.rhai"), 1, &[]);
    assert!(lines[0].as_ref().unwrap_err().message.contains("missing `fn system(info)`"), "{lines:?}");
}

#[test]
fn check_refuses_settings_that_train_would_refuse() {
    let dir = project(&[
        ("envs/t.rhai", ENV),
        ("prompts/p.rhai", "fn system(info) { \"\" }\nfn user(info, turn) { \"\" }\n"),
        (
            "scripts/x.rhai",
            "// settings with a typo\nfn experiment() { #{ env: \"envs/t.rhai\", prompt: \"prompts/p.rhai\", settings: #{ starpo: #{ clip_hgh: 0.3 } } } }\n",
        ),
    ]);
    let lines = check(&Host::new(dir.path(), tight()), &dir.path().join("scripts/x.rhai"), 1, &[]);
    let e = lines.iter().find_map(|l| l.as_ref().err()).expect("the typo should be reported");
    assert_at(e, ErrorKind::Contract, "scripts/x.rhai", 2, 1);
    assert!(e.message.contains("clip_hgh"), "{e}");
}

#[test]
fn a_forged_checkpoint_state_cannot_truncate_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let run = RunDir::create(dir.path()).unwrap();
    let ckpt = run.save_checkpoint(3, 2, |d| Ok(std::fs::write(d.join("state.json"), "{}")?)).unwrap();
    assert!(RunDir::checkpoint_step(&ckpt, 3).is_ok());
    for forged in [0, 2, 4] {
        let e = RunDir::checkpoint_step(&ckpt, forged).unwrap_err().to_string();
        assert!(e.contains(&format!("state.json says step {forged}")), "{e}");
    }
    std::fs::write(dir.path().join("checkpoints/latest"), "../../etc\n").unwrap();
    let e = RunDir::latest_checkpoint(dir.path()).unwrap_err().to_string();
    assert!(e.contains("not a checkpoint like step-000012"), "{e}");
}

/// The project's own scripts pass through the hardened host unchanged.
#[test]
fn the_shipped_scripts_still_load() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let host: Arc<Host> = Host::new(&root, Limits::default());
    for x in ["bandit", "sokoban", "frozenlake", "math", "invoice", "expense", "bandit_tiny"] {
        let exp = Experiment::load(&host, Path::new(&format!("scripts/{x}.rhai"))).unwrap();
        exp.scripts(&host).unwrap();
    }
}

#[test]
fn an_error_inside_a_standard_function_points_at_its_call() {
    let e = attack("fn run() {\n  let r = range(0, 10, 0);\n}\n");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 6, 11);
    assert!(e.message.contains("step value cannot be zero"), "{e}");
    let e = attack("fn run() { [1, 2].zip([3], Fn(\"nothing\")) }\n");
    assert_at(&e, ErrorKind::Runtime, "envs/t.rhai", 5, 19);
}

#[test]
fn a_user_raises_a_limit_by_name_and_typos_are_named() {
    let raised = Limits::default().with("max_string_size=4194304, call_timeout_ms=5000").unwrap();
    assert_eq!((raised.max_string_size, raised.call_timeout), (4 << 20, Duration::from_secs(5)));
    let e = Limits::default().with("max_strng_size=1").unwrap_err().to_string();
    assert!(e.contains("unknown limit \"max_strng_size\"") && e.contains("max_string_size"), "{e}");
    assert!(Limits::default().with("max_memory=lots").unwrap_err().to_string().contains("not a whole number"));
    // A raised limit lets through what the default refuses.
    let src =
        format!("{ENV}fn run() {{ let s = \"ab\"; s.pad(1000000, \"ab\"); s.replace(\"a\", \"aaa\"); s.len() }}\n");
    let dir = project(&[("envs/t.rhai", &src)]);
    let call =
        |limits: Limits| Host::new(dir.path(), limits).compile(Path::new("envs/t.rhai")).unwrap().call("run", (), None);
    assert_eq!(call(tight()).unwrap_err().kind, ErrorKind::Size);
    assert_eq!(call(tight().with("max_string_size=3000000").unwrap()).unwrap().as_int(), Ok(2_000_000));
}

// ---- 8. native stack and extreme values (issue 27) ----------------------------------------------

/// A command run to its end, or killed after `secs` (a hang is a failure, not a slow pass).
fn run_for(mut c: Command, secs: u64) -> std::process::Output {
    let mut child = c.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(secs) {
            child.kill().unwrap();
            panic!("{c:?} did not finish in {secs} s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn closure_chains_as_deep_as_memory_allows_are_an_error_in_every_command() {
    // Each closure captures the last: built in linear time, dropped recursively. 16 MiB of them
    // overflowed the 8 MiB main stack (the process aborted in check and play); now the command's
    // thread has the stack its limits need and the call ends in the memory error, with its place.
    let chain = ENV.replace(
        "fn reset(seed, p) { #{ n: 0 } }",
        "fn reset(seed, p) {\n  let f = |x| x;\n  loop { let g = f; f = |x| g.call(x); }\n}",
    );
    let dir = project(&[("envs/t.rhai", &chain)]);
    for args in [&["check", "envs/t.rhai"][..], &["play", "--env", "envs/t.rhai", "--actions", "A"]] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ragen-lab"));
        c.args(args).current_dir(dir.path());
        c.env("RAGEN_LIMITS", "max_memory=16777216,max_operations=0,call_timeout_ms=60000");
        let out = run_for(c, 120);
        let text = format!("{}{}", String::from_utf8_lossy(&out.stderr), String::from_utf8_lossy(&out.stdout));
        assert_eq!(out.status.code(), Some(2), "{args:?}: {text}");
        assert!(text.contains("envs/t.rhai:2:") && text.contains("out of memory"), "{args:?}: {text}");
    }
}

#[test]
fn plot_and_view_handle_any_value_a_reward_may_return() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    std::fs::create_dir_all(&run).unwrap();
    let values = [1e308, -1e308, f64::MAX, 1e-308, 0.0, -f64::MAX, 5e-324, 1.0];
    let lines: String = values
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let line = serde_json::json!({"step": i + 1, "rollout/reward_mean": v, "rollout/reward_std": v.abs(),
                "rollout/success": v, "update/grad_norm": v, "update/entropy": -v});
            line.to_string() + "\n"
        })
        .collect();
    std::fs::write(run.join("metrics.jsonl"), lines).unwrap();
    for args in [&["plot", "run"][..], &["view", "run"]] {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ragen-lab"));
        c.args(args).current_dir(dir.path());
        let out = run_for(c, 60);
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    assert!(run.join("plots/overview.png").exists() && run.join("view/index.html").exists());
}
