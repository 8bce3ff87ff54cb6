//! The observability surface end to end through the binary: `ragen-lab view` opened in a real
//! headless chromium, `view --serve` following a run that grows, and `ragen-lab plot` on two runs.
//!
//! The run directories are written here the way the trainer writes them (docs/contracts.md,
//! "The run directory"): a Sokoban-like run with a variance cliff, a recorded gradient-norm spike
//! alarm, a script swap, validation rollouts, and a turn with an invalid action.
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const BIN: &str = env!("CARGO_BIN_EXE_ragen-lab");

fn write_jsonl(path: &Path, lines: &[Value]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(path, text).unwrap();
}

fn append_jsonl(path: &Path, line: &Value) {
    let mut f = std::fs::OpenOptions::new().append(true).open(path).unwrap();
    writeln!(f, "{line}").unwrap();
}

/// A deterministic wobble in [-1, 1] (no RNG needed for a fixture).
fn wobble(step: u64, k: u64) -> f64 {
    ((step * 2654435761 + k * 40503) % 1000) as f64 / 500.0 - 1.0
}

/// One metrics line. `cliff_at`: in-group std collapses there while the mean keeps rising.
fn metrics_line(step: u64, cliff_at: u64, lift: f64) -> Value {
    let t = step as f64;
    let std = if step >= cliff_at { 0.03 + 0.005 * wobble(step, 1) } else { 0.35 + 0.04 * wobble(step, 1) };
    let grad = if step == 25 { 14.0 } else { 1.1 + 0.3 * wobble(step, 2) };
    let mut m = json!({
        "step": step, "time": 1_767_000_000.0 + 7.5 * t,
        "rollout/reward_mean": 0.1 + lift * t + 0.03 * wobble(step, 3),
        "rollout/reward_std": 0.4 + 0.03 * wobble(step, 4),
        "rollout/success": (0.15 + lift * t).min(1.0),
        "rollout/in_group_std": std, "rollout/in_group_std_kept": std * 1.3,
        "rollout/response_len": 48.0 - 0.4 * t, "rollout/think_len": 30.0 - 0.3 * t,
        "rollout/repetition": 0.05, "rollout/valid_action_rate": 0.9,
        "update/entropy": 1.4 - 0.01 * t + 0.02 * wobble(step, 5), "update/grad_norm": grad,
        "update/kl": 0.001 * t, "update/clip_frac": 0.05 + 0.02 * wobble(step, 6), "update/pg_loss": -0.01,
        "time/step_s": 7.5,
    });
    if step.is_multiple_of(10) {
        m["val/success"] = json!(0.1 + 1.5 * lift * t);
    }
    if step == 25 {
        m["alarms"] = json!([{"kind": "grad_norm_spike", "since": 25,
            "message": "grad_norm_spike: gradient norm 14.0000 is 12.7× its running median 1.1000 (threshold 5.0×) (since step 25)"}]);
    }
    m
}

fn trajectory(step: u64, group: u64, episode: u64, invalid: bool) -> Value {
    let success = (step + group + episode).is_multiple_of(3);
    let grid = "#####\n#P_O#\n#__X#\n#####";
    let answer = if invalid { "Right || Jump" } else { "Right" };
    let think = format!("step {step}: the box is right of me and the target below it, so I push right first.");
    let turn = |k: u64, obs: &str, done: bool| {
        json!({"user": format!("Turn {k}:\nState:\n{obs}\nYou have 2 actions left."), "obs": obs,
               "response": format!("<think>{think}</think><answer>{answer}</answer>"),
               "think": think, "answer": answer, "actions": ["Right"],
               "invalid_actions": if invalid && k == 1 { json!(["Jump"]) } else { json!([]) },
               "format_ok": true, "env_reward": -0.1, "reward": if invalid && k == 1 { -0.2 } else { -0.1 }, "done": done})
    };
    json!({"step": step, "group": group, "episode": episode, "seed": 10_000 + step * 10 + group,
           "success": success, "score": if success { 0.9 } else { -0.3 }, "normalized_score": if success { 0.8 } else { -0.6 },
           "advantage": if success { 0.8 } else { -0.6 }, "kept": group == 0, "response_tokens": 57,
           "versions": {"env": if step < 10 { "a1b2c3d4e5f60718" } else { "9f8e7d6c5b4a3921" }, "prompt": "0c1d2e3f40516273", "rewards": ["77aa88bb99cc00dd"]},
           "system": "You're a helpful assistant. ",
           "turns": [turn(1, grid, false), turn(2, "#####\n#_PX#\n#__X#\n#####", true)]})
}

fn rollout_file(run: &Path, step: u64, validation: bool) {
    let name = if validation { format!("val-step-{step:06}.jsonl") } else { format!("step-{step:06}.jsonl") };
    let lines: Vec<Value> = (0..2)
        .flat_map(|g| (0..2).map(move |e| (g, e)))
        .map(|(g, e)| trajectory(step, g, e, !validation && g == 0 && e == 0))
        .collect();
    write_jsonl(&run.join("rollouts").join(name), &lines);
}

/// Writes a run directory of `steps` steps (the trainer's layout).
fn fixture_run(run: &Path, steps: u64, cliff_at: u64, lift: f64) {
    std::fs::create_dir_all(run.join("scripts")).unwrap();
    std::fs::write(
        run.join("settings.json"),
        serde_json::to_string_pretty(&json!({
            "preset": "starpo-s", "model": "tiny-qwen2", "experiment": "scripts/sokoban.rhai",
            "starpo": {"clip_low": 0.2, "clip_high": 0.28, "keep_ratio": 0.25}, "echo": {"spike_factor": 5.0}
        }))
        .unwrap(),
    )
    .unwrap();
    std::fs::write(run.join("scripts").join("a1b2c3d4e5f60718.rhai"), "fn reset(seed) { #{} }\n").unwrap();
    write_jsonl(
        &run.join("scripts").join("index.jsonl"),
        &[
            json!({"step": 1, "role": "env", "path": "envs/sokoban.rhai", "hash": "a1b2c3d4e5f60718"}),
            json!({"step": 1, "role": "prompt", "path": "prompts/default.rhai", "hash": "0c1d2e3f40516273"}),
            json!({"step": 10, "role": "env", "path": "envs/sokoban.rhai", "hash": "9f8e7d6c5b4a3921"}),
        ],
    );
    write_jsonl(&run.join("metrics.jsonl"), &(1..=steps).map(|s| metrics_line(s, cliff_at, lift)).collect::<Vec<_>>());
    let mut events = vec![
        json!({"step": 10, "time": 1_767_000_075.0, "kind": "swap", "message": "envs/sokoban.rhai a1b2c3d4 -> 9f8e7d6c"}),
    ];
    if steps >= 25 {
        events.push(json!({"step": 25, "time": 1_767_000_187.5, "kind": "alarm", "alarm": "grad_norm_spike", "since": 25,
            "message": "grad_norm_spike: gradient norm 14.0000 is 12.7× its running median 1.1000 (threshold 5.0×) (since step 25)"}));
    }
    events.push(json!({"step": 10, "time": 1_767_000_076.0, "kind": "validation", "message": "val success 0.25"}));
    write_jsonl(&run.join("events.jsonl"), &events);
    for s in 1..=steps {
        rollout_file(run, s, false);
    }
    if steps >= 10 {
        rollout_file(run, 10, true);
    }
}

fn ragen(args: &[&str]) -> String {
    let out = Command::new(BIN).args(args).output().unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "ragen-lab {args:?} failed:\n{text}");
    text
}

fn find_chromium() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    ["chromium", "chromium-browser", "google-chrome"]
        .iter()
        .flat_map(|name| std::env::split_paths(&path).map(move |d| d.join(name)))
        .find(|p| p.is_file())
}

/// Runs headless chromium with the flags that keep it off the network, to completion.
fn chromium(exe: &Path, profile: &Path, extra: &[&str], url: &str) -> String {
    let mut child = Command::new(exe)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(extra)
        .arg(url)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = String::new();
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(status.success(), "chromium {extra:?} failed ({status}):\n{err}");
    out
}

#[test]
fn viewer_page_shows_steps_turns_invalid_actions_and_alarms_in_headless_chromium() {
    let Some(exe) = find_chromium() else {
        let msg = "chromium not found on PATH: install it with \
                   `apt-get install -y --no-install-recommends chromium` to run the viewer browser test";
        if std::env::var_os("CI").is_some() {
            panic!("{msg} (CI is set, so this is a failure)");
        }
        eprintln!("SKIPPED viewer browser test: {msg}");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("runs").join("sokoban-starpo-s");
    fixture_run(&run, 30, 18, 0.01);
    let out = ragen(&["view", run.to_str().unwrap()]);
    let page = run.join("view").join("index.html");
    assert!(out.contains("wrote") && page.is_file(), "{out}");
    assert!(run.join("tb").read_dir().unwrap().next().is_some(), "view writes tb/ when missing");

    let url = format!("file://{}", page.display());
    let dom = chromium(&exe, &tmp.path().join("profile"), &["--dump-dom"], &url);
    // Kept for reading when an assertion below fails.
    let artifacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::write(artifacts.join("viewer-dom.html"), &dom).unwrap();
    // The header and the step list: 30 training steps plus one validation step, newest first.
    assert!(dom.contains("sokoban-starpo-s"), "run name missing");
    assert!(dom.contains("30 logged steps"), "step count missing");
    assert!(dom.contains(">step 30 (4)</option>") && dom.contains(">step 1 (4)</option>"), "steps missing");
    assert!(dom.contains(">validation @ step 10 (4)</option>"), "validation step missing");
    // The newest step's trajectories, the first one open, read as turns.
    assert!(dom.contains("4 trajectories"), "trajectory count missing");
    assert!(dom.contains("step 30 · group 0 · episode 0"), "trajectory header missing");
    assert!(dom.contains("Turn 1") && dom.contains("Turn 2"), "turns missing");
    assert!(dom.contains("#P_O#"), "observation grid missing");
    assert!(dom.contains("step 30: the box is right of me"), "think text missing");
    assert!(
        dom.contains(r#"<span class="act invalid" title="invalid action">Jump (invalid)</span>"#),
        "invalid action not marked"
    );
    assert!(dom.contains("9f8e7d6c5b"), "script version missing");
    // Alarms: the recorded spike and the variance cliff the replay finds at step 18.
    assert!(dom.contains("2 alarms: variance_cliff, grad_norm_spike"), "alarm summary missing");
    assert!(dom.contains("since step 18"), "variance cliff alarm missing");
    assert!(dom.contains("gradient norm 14.0000"), "recorded alarm message missing");
    // The steps table links every step, with its alarms.
    assert!(dom.contains("click a step to read its trajectories"), "steps table missing");
    // Charts are inline SVG (one per panel with data) with the alarm lines.
    assert!(dom.matches(r#"<div class="chart">"#).count() >= 8, "charts missing");
    assert!(dom.contains(r##"stroke="#d62728""##), "alarm marker missing");

    let shot = artifacts.join("viewer-screenshot.png");
    let _ = std::fs::remove_file(&shot);
    chromium(
        &exe,
        &tmp.path().join("profile"),
        &[&format!("--screenshot={}", shot.display()), "--window-size=1280,1400"],
        &url,
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000, "screenshot too small: {} bytes", png.len());
    // The charts tab, opened from the URL.
    let charts = artifacts.join("viewer-charts.png");
    chromium(
        &exe,
        &tmp.path().join("profile"),
        &[&format!("--screenshot={}", charts.display()), "--window-size=1280,1100"],
        &format!("{url}#tab=charts"),
    );
    eprintln!("viewer screenshots: {} {}", shot.display(), charts.display());
}

fn http_get(addr: &str, path: &str) -> (String, String) {
    http_get_as(addr, path, addr)
}

/// A GET naming the server as `host`; the connection closes after the answer.
fn http_get_as(addr: &str, path: &str, host: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let (head, body) = resp.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}

#[test]
fn view_serve_follows_a_growing_run_on_reload() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("live");
    fixture_run(&run, 3, 100, 0.01);
    let mut child = Command::new(BIN)
        .args(["view", run.to_str().unwrap(), "--serve", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("view --serve exited before printing its address").unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    };
    let steps = |addr: &str| -> Vec<u64> {
        let (_, data) = http_get(addr, "/data.json");
        let data: Value = serde_json::from_str(&data).unwrap();
        data["steps"].as_array().unwrap().iter().map(|s| s["step"].as_u64().unwrap()).collect()
    };
    let (head, body) = http_get(&addr, "/");
    assert!(head.starts_with("HTTP/1.1 200") && head.contains("text/html"), "{head}");
    assert!(body.contains("step 3: the box is right") && !body.contains("step 4: the box is right"));
    assert_eq!(steps(&addr), vec![1, 2, 3]);

    // The trainer logs step 4; a reload shows it without rebuilding by hand.
    append_jsonl(&run.join("metrics.jsonl"), &metrics_line(4, 100, 0.01));
    rollout_file(&run, 4, false);
    let (_, body) = http_get(&addr, "/");
    assert!(body.contains("step 4: the box is right"), "new step not served");
    assert_eq!(steps(&addr), vec![1, 2, 3, 4]);
    let (head, body) = http_get(&addr, "/rollouts/step-000004.jsonl");
    assert!(head.contains("text/plain") && body.contains("\"group\":1"));
    let (head, _) = http_get(&addr, "/../../etc/passwd");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");

    // Loopback by default; a connection that sends nothing (a browser's pre-connect) does not
    // hold up the others (it held them for the 5 s read timeout, one connection at a time).
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let idle = std::net::TcpStream::connect(&addr).unwrap();
    let t = std::time::Instant::now();
    let (head, _) = http_get(&addr, "/data.json");
    assert!(head.starts_with("HTTP/1.1 200") && t.elapsed() < std::time::Duration::from_secs(2), "{head}");
    drop(idle);
    // A page on another site that rebinds its domain to 127.0.0.1 names that domain as the Host.
    let (head, body) = http_get_as(&addr, "/data.json", "rebound.example");
    assert!(head.starts_with("HTTP/1.1 403") && !body.contains("trajectories"), "{head}");
    let port = addr.rsplit(':').next().unwrap();
    let (head, _) = http_get_as(&addr, "/data.json", &format!("localhost:{port}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn plot_draws_two_runs_on_one_chart_with_alarms_and_writes_tensorboard() {
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("starpo"), tmp.path().join("starpo-s"));
    fixture_run(&a, 30, 12, 0.004);
    fixture_run(&b, 30, 100, 0.012);
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("plot-two-runs");
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = ragen(&["plot", a.to_str().unwrap(), b.to_str().unwrap(), "--out", out_dir.to_str().unwrap()]);
    assert!(out.contains("starpo: alarm at step 13: variance_cliff"), "{out}");
    assert!(out.contains("no data for: mutual_info"), "{out}");
    for stem in ["overview", "reward", "success", "in_group_std", "entropy", "grad_norm", "length", "kl", "clip_frac"] {
        let png = std::fs::read(out_dir.join(format!("{stem}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{stem}.png");
        let svg = std::fs::read_to_string(out_dir.join(format!("{stem}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("step"), "{stem}.svg");
    }
    let svg = std::fs::read_to_string(out_dir.join("in_group_std.svg")).unwrap();
    assert!(svg.contains("starpo: variance_cliff") && svg.contains("starpo-s: grad_norm_spike"), "alarms not marked");
    assert!(svg.contains("starpo-s all groups") && svg.contains("starpo kept groups"), "runs not in the legend");
    eprintln!("plots: {}", out_dir.display());

    // tb/ was written from metrics.jsonl and reads back with valid CRCs.
    let tb = a.join("tb").read_dir().unwrap().next().unwrap().unwrap().path();
    let scalars = ragen_lab::metrics::tensorboard::read_scalars(&tb).unwrap();
    let grad: Vec<_> = scalars.iter().filter(|s| s.tag == "update/grad_norm").collect();
    assert_eq!(grad.len(), 30);
    assert_eq!((grad[24].step, grad[24].value), (25, 14.0));
}
