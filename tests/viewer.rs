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
    let think =
        format!("step {step}: the box is right of me and the target below it, so I push right first. <b>bold?</b>");
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
    rollout_file_of(run, step, validation, 2, 2);
}

/// A rollout file of `groups` × `episodes` trajectories.
fn rollout_file_of(run: &Path, step: u64, validation: bool, groups: u64, episodes: u64) {
    let name = if validation { format!("val-step-{step:06}.jsonl") } else { format!("step-{step:06}.jsonl") };
    let lines: Vec<Value> = (0..groups)
        .flat_map(|g| (0..episodes).map(move |e| (g, e)))
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
    let env_v1 = "// sokoban\nfn reset(seed) {\n    #{ pos: 0 }\n}\nfn step(state, action) {\n    state.pos += 1;\n    state\n}\n";
    std::fs::write(run.join("scripts").join("a1b2c3d4e5f60718.rhai"), env_v1).unwrap();
    let env_v2 = env_v1.replace("state.pos += 1;", "state.pos += 2; // <b>faster</b>");
    std::fs::write(run.join("scripts").join("9f8e7d6c5b4a3921.rhai"), env_v2).unwrap();
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
    // The shape of part 3's preview is not settled: the page shows whatever fields it has.
    events.push(json!({"step": 12, "time": 1_767_000_090.0, "kind": "reward_preview", "script": "rewards/format_penalty.rhai",
        "message": "reward preview of rewards/format_penalty.rhai on step 11's 8 trajectories: mean score 0.410 → 0.370, 3 changed, advantages change sign in 1 of 2 groups",
        "version": "9f2c1e0a7b3d5566", "on_step": 11, "trajectories": 8, "score_old": 0.41, "score_new": 0.37, "success": 0.25,
        "changed": 3, "groups": 2, "groups_flipped": 1, "moved": [{"group": 0, "episode": 1, "old": 0.9, "new": 0.5}]}));
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
fn offline_dashboard_shows_every_view_in_headless_chromium() {
    let Some(exe) = find_chromium_or_skip("the viewer browser test") else { return };
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("runs").join("sokoban-starpo-s");
    fixture_run(&run, 30, 18, 0.01);
    let out = ragen(&["view", run.to_str().unwrap()]);
    let page = run.join("view").join("index.html");
    assert!(out.contains("wrote") && page.is_file(), "{out}");
    assert!(run.join("tb").read_dir().unwrap().next().is_some(), "view writes tb/ when missing");

    let url = format!("file://{}", page.display());
    let budget = ["--dump-dom", "--virtual-time-budget=3000"];
    let dom = chromium(&exe, &tmp.path().join("profile"), &budget, &url);
    // Kept for reading when an assertion below fails.
    let artifacts = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    std::fs::write(artifacts.join("viewer-dom.html"), &dom).unwrap();
    // The health line, and the step list: 30 training steps plus one validation step, newest first.
    assert!(dom.contains("sokoban-starpo-s"), "run name missing");
    assert!(dom.contains("step 30 · 8.00 steps/min"), "health line missing");
    assert!(dom.contains(">step 30 (4)</option>") && dom.contains(">step 1 (4)</option>"), "steps missing");
    assert!(dom.contains(">validation @ step 10 (4)</option>"), "validation step missing");
    // The newest step: its reward histogram, its groups side by side (group 1 filtered out), and
    // its trajectories, the first one open, read as turns.
    assert!(dom.contains("Scores at step 30") && dom.contains("4 episodes"), "histogram missing");
    assert!(dom.contains("group 0</b> · std 0.600 · kept") && dom.contains("· filtered out</div>"), "groups missing");
    assert!(dom.contains("4 trajectories"), "trajectory count missing");
    assert!(dom.contains("step 30 · group 0 · episode 0"), "trajectory header missing");
    assert!(dom.contains("Turn 1") && dom.contains("Turn 2"), "turns missing");
    assert!(dom.contains("#P_O#"), "observation grid missing");
    assert!(dom.contains("step 30: the box is right of me"), "think text missing");
    // Model text is data: its markup shows as text and makes no element.
    assert!(dom.contains("&lt;b&gt;bold?&lt;/b&gt;") && !dom.contains("<b>bold?</b>"), "think text not escaped");
    assert!(
        dom.contains(r#"<span class="act invalid" title="invalid action">Jump (invalid)</span>"#),
        "invalid action not marked"
    );
    assert!(dom.contains("9f8e7d6c5b"), "script version missing");
    // Alarms: the recorded spike and the variance cliff the replay finds at step 18.
    assert!(dom.contains("2 alarms, last: grad_norm_spike at step 25"), "alarm summary missing");
    assert!(dom.contains("since step 18"), "variance cliff alarm missing");
    assert!(dom.contains("gradient norm 14.0000"), "recorded alarm message missing");
    // Events, and a reward preview's fields in their panel.
    assert!(dom.contains("Reward preview at step 12") && dom.contains("groups_flipped"), "reward preview missing");
    assert!(dom.contains("envs/sokoban.rhai a1b2c3d4 -&gt; 9f8e7d6c"), "swap event missing");
    assert!(dom.contains("offline copy (31 of 31 steps"), "offline note missing");

    // The steps table and the charts are drawn when their tab opens (here from the URL).
    let dom = chromium(&exe, &tmp.path().join("profile"), &budget, &format!("{url}#tab=steps"));
    assert!(dom.contains("click a step to read its trajectories"), "steps table missing");
    assert!(dom.contains(r#"title="grad_norm_spike: gradient norm 14.0000"#), "alarm not in the steps table");
    let dom = chromium(&exe, &tmp.path().join("profile"), &budget, &format!("{url}#tab=charts"));
    assert!(dom.matches(r#"<div class="chart">"#).count() >= 8, "charts missing");
    assert!(dom.contains(r##"stroke="#d62728""##), "alarm marker missing");
    assert!(dom.contains("swap at step 10"), "script swap marker missing");
    // The script timeline and the diff between the env's two versions (the diff is fetched on a
    // click; the offline copy carries it).
    let dom = chromium(&exe, &tmp.path().join("profile"), &budget, &format!("{url}#tab=scripts"));
    assert!(dom.contains("diff a1b2c3d4e5 → 9f8e7d6c5b"), "script versions missing");
    // The newest edit's diff is open: the changed line out and in, the rest kept, markup as text.
    assert!(dom.contains(r#"<div class="del">-     state.pos += 1;</div>"#), "diff missing");
    assert!(
        dom.contains(r#"<div class="add">+     state.pos += 2; // &lt;b&gt;faster&lt;/b&gt;</div>"#),
        "diff missing"
    );

    for (tab, size) in [
        ("", "1280,1100"),
        ("charts", "1280,1100"),
        ("steps", "1280,900"),
        ("alarms", "1280,900"),
        ("scripts", "1280,900"),
    ] {
        let name = if tab.is_empty() { "step".to_string() } else { tab.to_string() };
        let shot = artifacts.join(format!("viewer-{name}.png"));
        let _ = std::fs::remove_file(&shot);
        let view = if tab.is_empty() { url.clone() } else { format!("{url}#tab={tab}") };
        chromium(
            &exe,
            &tmp.path().join("profile"),
            &[
                &format!("--screenshot={}", shot.display()),
                &format!("--window-size={size}"),
                "--virtual-time-budget=3000",
            ],
            &view,
        );
        let png = std::fs::read(&shot).unwrap();
        assert!(png.starts_with(b"\x89PNG") && png.len() > 20_000, "{name} screenshot too small: {} bytes", png.len());
    }
    eprintln!("viewer screenshots: {}/viewer-*.png", artifacts.display());
}

fn http_get(addr: &str, path: &str) -> (String, String) {
    http_get_as(addr, path, addr)
}

/// A GET naming the server as `host`; the connection closes after the answer.
fn http_get_as(addr: &str, path: &str, host: &str) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = vec![];
    s.read_to_end(&mut resp).unwrap();
    let split = resp.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let head = String::from_utf8(resp[..split].to_vec()).unwrap();
    let mut body = resp[split + 4..].to_vec();
    if head.contains("Transfer-Encoding: chunked") {
        // Bodies past tiny_http's threshold come in chunks: `size in hex\r\n`, the bytes, `\r\n`.
        let (mut rest, mut out) = (&body[..], vec![]);
        loop {
            let eol = rest.windows(2).position(|w| w == b"\r\n").unwrap();
            let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap().trim(), 16).unwrap();
            if size == 0 {
                break;
            }
            out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
            rest = &rest[eol + 4 + size..];
        }
        body = out;
    }
    (head, String::from_utf8(body).unwrap())
}

/// A child process killed when the test lets go of it, passing or failing.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `ragen-lab view RUN --serve 0`; returns the server and the address it listens on.
fn view_serve(run: &Path) -> (Killed, String) {
    let mut child = Command::new(BIN)
        .args(["view", run.to_str().unwrap(), "--serve", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let addr = address_from(child.stdout.take().unwrap());
    (Killed(child), addr)
}

/// The `host:port` of the first `http://host:port/` line a server prints.
fn address_from(out: std::process::ChildStdout) -> String {
    let mut lines = BufReader::new(out).lines();
    loop {
        let line = lines.next().expect("the server exited before printing its address").unwrap();
        if let Some(rest) = line.split("http://").nth(1) {
            break rest.split('/').next().unwrap().to_string();
        }
    }
}

fn json_get(addr: &str, path: &str) -> Value {
    let (head, body) = http_get(addr, path);
    assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}\n{body}");
    serde_json::from_str(&body).unwrap()
}

#[test]
fn view_serve_answers_the_dashboard_api_and_streams_new_steps() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("live");
    fixture_run(&run, 3, 100, 0.01);
    let (server, addr) = view_serve(&run);
    let (head, body) = http_get(&addr, "/");
    assert!(head.starts_with("HTTP/1.1 200") && head.contains("text/html"), "{head}");
    assert!(
        body.contains("/*RAGEN_DATA*/null") || body.contains("const OFFLINE = null"),
        "the live page embeds no data"
    );
    let summary = json_get(&addr, "/api/summary");
    assert_eq!(summary["rollouts"]["train"], json!([[1, 3]]));
    assert_eq!(summary["steps"], 3);
    let step = json_get(&addr, "/api/step?step=3&val=0");
    assert_eq!(step["episodes"].as_array().unwrap().len(), 4);
    assert_eq!(step["episodes"][0]["invalid"], true);
    let t = json_get(&addr, "/api/trajectories?step=3&val=0&at=1,3");
    assert_eq!((t[0]["group"].as_u64(), t[0]["episode"].as_u64()), (Some(0), Some(1)));
    assert_eq!((t[1]["group"].as_u64(), t[1]["episode"].as_u64()), (Some(1), Some(1)));
    let rows = json_get(&addr, "/api/steps?limit=2");
    assert_eq!(
        rows["rows"].as_array().unwrap().iter().map(|r| r["step"].as_u64().unwrap()).collect::<Vec<_>>(),
        vec![3, 2]
    );
    let diff = json_get(&addr, "/api/diff?old=a1b2c3d4e5f60718&new=9f8e7d6c5b4a3921");
    assert!(
        diff["lines"].as_array().unwrap().contains(&json!(["+", "    state.pos += 2; // <b>faster</b>"])),
        "{diff}"
    );
    let (head, _) = http_get(&addr, "/api/diff?new=../../etc/passwd");
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");

    // The event stream: open it where the summary left off, then the trainer logs step 4.
    let mut live = std::net::TcpStream::connect(&addr).unwrap();
    write!(live, "GET /api/live?since={} HTTP/1.1\r\nHost: {addr}\r\n\r\n", summary["seq"].as_str().unwrap()).unwrap();
    append_jsonl(&run.join("metrics.jsonl"), &metrics_line(4, 100, 0.01));
    append_jsonl(&run.join("events.jsonl"), &json!({"step": 4, "kind": "checkpoint", "message": "saved step 4"}));
    rollout_file(&run, 4, false);
    live.set_read_timeout(Some(std::time::Duration::from_secs(20))).unwrap();
    let mut got = String::new();
    let mut buf = [0u8; 4096];
    while !(got.contains("event: rollout") && got.contains("event: metrics") && got.contains("event: event")) {
        let n = live.read(&mut buf).expect("the stream went quiet before step 4 arrived");
        assert!(n > 0, "the stream closed: {got}");
        got += &String::from_utf8_lossy(&buf[..n]);
    }
    assert!(got.starts_with("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream"), "{got}");
    assert!(got.contains(r#"data: {"step":4,"validation":false}"#), "{got}");
    assert!(got.contains(r#""kind":"checkpoint""#), "{got}");
    assert!(!got.contains(r#""step":3,"#), "only what came after the summary: {got}");
    assert_eq!(json_get(&addr, "/api/summary")["rollouts"]["train"], json!([[1, 4]]));
    let (head, body) = http_get(&addr, "/rollouts/step-000004.jsonl");
    assert!(head.contains("text/plain") && body.contains("\"group\":1"));
    let (head, _) = http_get(&addr, "/../../etc/passwd");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");

    // Loopback by default; a connection that sends nothing (a browser's pre-connect) and an open
    // event stream do not hold up the others.
    assert!(addr.starts_with("127.0.0.1:"), "{addr}");
    let idle = std::net::TcpStream::connect(&addr).unwrap();
    let t = std::time::Instant::now();
    let (head, _) = http_get(&addr, "/api/summary");
    assert!(head.starts_with("HTTP/1.1 200") && t.elapsed() < std::time::Duration::from_secs(2), "{head}");
    drop(idle);
    // A page on another site that rebinds its domain to 127.0.0.1 names that domain as the Host.
    let (head, body) = http_get_as(&addr, "/api/summary", "rebound.example");
    assert!(head.starts_with("HTTP/1.1 403") && !body.contains("rollouts"), "{head}");
    let (head, _) = http_get_as(&addr, "/api/live", "rebound.example");
    assert!(head.starts_with("HTTP/1.1 403"), "{head}");
    let port = addr.rsplit(':').next().unwrap();
    let (head, _) = http_get_as(&addr, "/api/summary", &format!("localhost:{port}"));
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    drop(server);
}

/// The bytes the live page fetches before it first paints: the page, the summary, the newest
/// step's episode rows and its first page of trajectories (page.html's `start`, `PAGE_SIZE` 20).
fn first_load(addr: &str) -> usize {
    let (_, page) = http_get(addr, "/");
    let (_, summary) = http_get(addr, "/api/summary");
    let newest =
        serde_json::from_str::<Value>(&summary).unwrap()["rollouts"]["train"].as_array().unwrap().last().unwrap()[1]
            .clone();
    let (_, step) = http_get(addr, &format!("/api/step?step={newest}&val=0"));
    let at: Vec<String> = (0..20).map(|i| i.to_string()).collect();
    let (_, trajectories) = http_get(addr, &format!("/api/trajectories?step={newest}&val=0&at={}", at.join(",")));
    page.len() + summary.len() + step.len() + trajectories.len()
}

#[test]
fn first_page_load_is_under_a_tenth_of_the_rollouts_and_under_a_megabyte() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("big");
    fixture_run(&run, 300, 200, 0.002);
    for s in 1..=300 {
        rollout_file_of(&run, s, false, 4, 8);
    }
    let rollouts: u64 =
        std::fs::read_dir(run.join("rollouts")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
    let (server, addr) = view_serve(&run);
    let first = first_load(&addr) as u64;
    drop(server);
    eprintln!(
        "first load {first} bytes of {rollouts} bytes of rollouts/ ({:.2}%)",
        100.0 * first as f64 / rollouts as f64
    );
    assert!(first * 10 < rollouts, "first load {first} bytes, rollouts/ {rollouts} bytes");
    assert!(first < 1 << 20, "first load {first} bytes");
}

/// Headless chromium driven over the DevTools protocol on a pipe (`--remote-debugging-pipe`: it
/// reads commands on fd 3 and answers on fd 4, each message ending in a NUL byte). Unlike
/// `--dump-dom`, which waits for the page's network to go quiet (an event stream never does), it
/// reads a page while the page stays open.
struct Browser {
    child: std::process::Child,
    to: std::io::PipeWriter,
    from: BufReader<std::io::PipeReader>,
    next: u64,
    session: String,
}

impl Browser {
    fn open(exe: &Path, profile: &Path, url: &str, size: (u32, u32)) -> Browser {
        use std::os::fd::AsRawFd;
        use std::os::unix::process::CommandExt;
        let (chrome_reads, to) = std::io::pipe().unwrap();
        let (from, chrome_writes) = std::io::pipe().unwrap();
        let (r, w) = (chrome_reads.as_raw_fd(), chrome_writes.as_raw_fd());
        let mut cmd = Command::new(exe);
        cmd.args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking"])
            .args(["--disable-component-update", "--disable-sync", "--disable-dev-shm-usage", "--hide-scrollbars"])
            .arg("--remote-debugging-pipe")
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!("--window-size={},{}", size.0, size.1))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: only async-signal-safe calls between fork and exec. The pipe ends move above
        // fd 10 first, so that placing them at 3 and 4 cannot overwrite one with the other.
        unsafe {
            cmd.pre_exec(move || {
                let (r, w) = (libc::fcntl(r, libc::F_DUPFD, 10), libc::fcntl(w, libc::F_DUPFD, 10));
                if r < 0 || w < 0 || libc::dup2(r, 3) < 0 || libc::dup2(w, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        drop((chrome_reads, chrome_writes));
        let mut b = Browser { child, to, from: BufReader::new(from), next: 0, session: String::new() };
        let target = b.call("Target.createTarget", json!({"url": url}))["targetId"].clone();
        let attached = b.call("Target.attachToTarget", json!({"targetId": target, "flatten": true}));
        b.session = attached["sessionId"].as_str().unwrap().to_string();
        b
    }

    /// Sends one command (to the page once attached) and returns its result.
    fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let mut msg = json!({"id": self.next, "method": method, "params": params});
        if !self.session.is_empty() {
            msg["sessionId"] = json!(self.session);
        }
        self.to.write_all(format!("{msg}\0").as_bytes()).unwrap();
        loop {
            let mut buf = vec![];
            let n = self.from.read_until(0, &mut buf).unwrap();
            assert!(n > 0, "chromium closed the DevTools pipe");
            let reply: Value = serde_json::from_slice(&buf[..buf.len() - 1]).unwrap();
            if reply["id"] == json!(self.next) {
                assert!(reply.get("error").is_none(), "{method}: {reply}");
                return reply["result"].clone();
            }
        }
    }

    /// Evaluates a JavaScript expression in the page; its JSON value.
    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call("Runtime.evaluate", json!({"expression": expr, "returnByValue": true}));
        r["result"]["value"].clone()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Standard base64, for the screenshots the DevTools protocol returns.
fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let digits: Vec<u8> = s.bytes().filter(|&c| c != b'=' && !c.is_ascii_whitespace()).map(val).collect();
    digits
        .chunks(4)
        .flat_map(|q| {
            let n = q.iter().enumerate().fold(0u32, |n, (i, &d)| n | u32::from(d) << (18 - 6 * i));
            n.to_be_bytes()[1..q.len()].to_vec()
        })
        .collect()
}

fn find_chromium_or_skip(what: &str) -> Option<PathBuf> {
    let exe = find_chromium();
    if exe.is_none() {
        let msg = format!(
            "chromium not found on PATH: install it with `apt-get install -y --no-install-recommends chromium` to run {what}"
        );
        assert!(std::env::var_os("CI").is_none(), "{msg} (CI is set, so this is a failure)");
        eprintln!("SKIPPED: {msg}");
    }
    exe
}

/// Issue 29: `train --serve` on the tiny model; the open page sees new steps and events arrive
/// over the event stream, without a reload.
#[test]
fn dashboard_follows_a_training_run_live_in_headless_chromium() {
    let Some(exe) = find_chromium_or_skip("the live dashboard browser test") else { return };
    let project = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for f in ["envs/bandit.rhai", "prompts/ragen.rhai", "rewards/format_penalty.rhai", "scripts/bandit.rhai"] {
        let to = project.path().join(f);
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(root.join(f), to).unwrap();
    }
    // tests/train.rs's tiny run; 60 steps of ~0.3 s, so the page opens long before the end.
    let mut train = Command::new(BIN)
        .current_dir(project.path())
        .args(["train", "--env", "scripts/bandit.rhai", "--model", "tiny-llama", "--quiet", "--steps", "60"])
        .args(["--set", "rollout.env_groups=2", "--set", "rollout.group_size=2", "--set", "rollout.response_length=12"])
        .args(["--set", "train.val_every=0", "--set", "train.save_every=2", "--run-dir", "runs/live", "--serve", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = address_from(train.stdout.take().unwrap());
    let mut train = Killed(train);
    let metrics = project.path().join("runs/live/metrics.jsonl");
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(300);
    while std::fs::read_to_string(&metrics).map_or(true, |t| t.is_empty()) {
        assert!(std::time::Instant::now() < give_up && train.0.try_wait().unwrap().is_none(), "no first step");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }

    let mut b = Browser::open(&exe, &project.path().join("profile"), &format!("http://{addr}/"), (1280, 1000));
    let probe = "JSON.stringify(typeof S === 'undefined' || !S ? null : {opened: openedAt, last: lastStep(), \
                 got: received, marker: window.testMarker || 0, health: document.getElementById('health').textContent, \
                 live: document.getElementById('live').textContent, list: document.getElementById('trajectories').textContent})";
    let state =
        |b: &mut Browser| -> Value { b.eval(probe).as_str().map_or(Value::Null, |s| serde_json::from_str(s).unwrap()) };
    while state(&mut b).get("opened").is_none_or(Value::is_null) {
        assert!(std::time::Instant::now() < give_up, "the page never loaded its summary");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // A reload would forget this.
    b.eval("window.testMarker = 1");
    let s = loop {
        let s = state(&mut b);
        let (opened, last) = (s["opened"].as_u64().unwrap(), s["last"].as_u64().unwrap_or(0));
        let events = s["got"]["event"].as_u64().unwrap_or(0) + s["got"]["alarm"].as_u64().unwrap_or(0);
        if last >= opened + 2 && events >= 1 && s["list"].as_str().unwrap().contains(&format!("step {last} · group 0"))
        {
            break s;
        }
        assert!(train.0.try_wait().unwrap().is_none(), "the run ended before the page saw two new steps: {s}");
        assert!(std::time::Instant::now() < give_up, "gave up: {s}");
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    eprintln!("live page: opened at step {}, then {} (received {})", s["opened"], s["last"], s["got"]);
    assert_eq!(s["marker"], 1, "the page reloaded");
    assert!(s["opened"].as_u64().unwrap() < 58, "the page opened at the end of the run: {s}");
    assert!(s["got"]["metrics"].as_u64().unwrap() >= 2, "{s}");
    assert!(
        s["health"].as_str().unwrap().contains(" of 60 · ") && s["health"].as_str().unwrap().contains("steps/min"),
        "{s}"
    );
    assert!(s["live"].as_str().unwrap().starts_with("● live"), "{s}");
    let events = b.eval("document.getElementById('events').textContent");
    assert!(events.as_str().unwrap().contains("checkpoint"), "{events}");
    let shot = b.call("Page.captureScreenshot", json!({"format": "png"}));
    let png = base64_decode(shot["data"].as_str().unwrap());
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard-live.png");
    std::fs::write(&path, png).unwrap();
    eprintln!("live screenshot: {}", path.display());
    drop((b, train));
}

/// The figure in docs/observability.md: the live page's first paint (its first trajectory shown)
/// on a large run, in chromium. Not part of the suite: point it at a run, e.g. one from
/// `tools/synthetic_run.py`, with `RAGEN_LARGE_RUN=/tmp/synth-big cargo test --test viewer -- --ignored`.
#[test]
#[ignore]
fn first_paint_on_a_large_run() {
    let (Some(run), Some(exe)) = (std::env::var_os("RAGEN_LARGE_RUN"), find_chromium()) else {
        panic!("set RAGEN_LARGE_RUN to a run directory, and install chromium");
    };
    let (server, addr) = view_serve(Path::new(&run));
    let profile = tempfile::tempdir().unwrap();
    let mut b = Browser::open(&exe, profile.path(), &format!("http://{addr}/"), (1280, 900));
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let painted = loop {
        let t = b.eval("document.querySelector('.traj') ? performance.now() : null");
        if let Some(ms) = t.as_f64() {
            break ms;
        }
        assert!(std::time::Instant::now() < give_up, "no trajectory shown");
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    let bytes = b.eval(
        "performance.getEntriesByType('navigation').concat(performance.getEntriesByType('resource'))\
         .filter(e => !e.name.includes('/api/live')).reduce((n, e) => n + e.encodedBodySize, 0)",
    );
    eprintln!("first trajectory shown {painted:.0} ms after navigation; {bytes} bytes of bodies loaded");
    drop(b);
    drop(server);
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
