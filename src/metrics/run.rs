//! Reading a run directory back (docs/contracts.md, "The run directory"): the metrics lines, the
//! events, the rollout files, and the alarms, for `plot` and `view`.
//!
//! A run may still be going: a last line without its newline is a write in progress and is
//! skipped; any other bad line is an error naming the file and line.
use super::echo_trap::{self, EchoSettings};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::{Map, Value};
use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// One JSON object per line. Missing file → empty (a run that has not logged yet).
pub fn read_jsonl(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let (mut tail, mut all) = (Tail::new(path), vec![]);
    loop {
        match tail.read()? {
            Grown::Lines(lines) if lines.is_empty() => return Ok(all),
            Grown::Lines(lines) => all.extend(lines),
            // Replaced while we read it (a resumed run): read the new file.
            Grown::Rewritten => (tail, all) = (Tail::new(path), vec![]),
        }
    }
}

/// A JSONL file read as it grows, for a reader that follows a live run: each [`Tail::read`]
/// returns complete lines appended since the last one, about [`Tail::CHUNK`] bytes at most (read
/// again until it returns none to catch up). A last line without its newline is a
/// write in progress and waits for the next read; any other bad line is an error naming the file
/// and line (after the good lines before it were returned), and the next read goes on after it.
#[derive(Debug)]
pub struct Tail {
    path: PathBuf,
    /// Bytes consumed so far (whole lines).
    offset: u64,
    /// Lines consumed so far, for error messages.
    line: usize,
    /// The inode read from: a file replaced by rename (a resumed run rewrites metrics.jsonl)
    /// gets another.
    inode: Option<u64>,
}

/// What a [`Tail::read`] found.
#[derive(Debug)]
pub enum Grown {
    Lines(Vec<Map<String, Value>>),
    /// The file was replaced, shortened or removed since the last read: what was read before no
    /// longer describes it, so the reader starts over (with a new tail).
    Rewritten,
}

impl Tail {
    /// Bytes of lines one read returns at most (a longer line comes whole).
    pub const CHUNK: usize = 1 << 20;

    pub fn new(path: &Path) -> Tail {
        Tail { path: path.to_path_buf(), offset: 0, line: 0, inode: None }
    }

    pub fn read(&mut self) -> Result<Grown> {
        use std::io::{BufRead, Seek, SeekFrom};
        use std::os::unix::fs::MetadataExt;
        let mut file = match std::fs::File::open(&self.path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(if self.offset > 0 { Grown::Rewritten } else { Grown::Lines(vec![]) });
            }
            Err(e) => return Err(e).with_context(|| format!("reading {}", self.path.display())),
        };
        let meta = file.metadata().with_context(|| format!("reading {}", self.path.display()))?;
        if self.inode.is_some_and(|i| i != meta.ino()) || meta.len() < self.offset {
            return Ok(Grown::Rewritten);
        }
        self.inode = Some(meta.ino());
        file.seek(SeekFrom::Start(self.offset)).with_context(|| format!("reading {}", self.path.display()))?;
        let mut reader = std::io::BufReader::new(file);
        let (mut out, mut consumed, mut raw) = (vec![], 0, vec![]);
        // Line by line up to a budget, so catching up on a long run holds a chunk, not the file.
        while consumed < Tail::CHUNK {
            raw.clear();
            if reader.read_until(b'\n', &mut raw).with_context(|| format!("reading {}", self.path.display()))? == 0 {
                break;
            }
            let ended = raw.ends_with(b"\n");
            let text = raw.strip_suffix(b"\n").unwrap_or(&raw);
            if text.iter().all(u8::is_ascii_whitespace) {
                consumed += if ended { raw.len() } else { 0 };
                self.line += usize::from(ended);
                continue;
            }
            match serde_json::from_slice::<Value>(text) {
                Ok(Value::Object(m)) => out.push(m),
                // The trainer is mid-write: the next read will have it.
                Err(_) if !ended => break,
                // Return the good lines first; the next read reports this one.
                _ if !out.is_empty() => break,
                bad => {
                    self.offset += (consumed + raw.len()) as u64;
                    self.line += 1;
                    let why = bad.map_or_else(|e| e.to_string(), |_| "expected a JSON object per line".into());
                    bail!("{}:{}: {why}", self.path.display(), self.line);
                }
            }
            consumed += raw.len();
            self.line += 1;
        }
        self.offset += consumed as u64;
        Ok(Grown::Lines(out))
    }
}

/// `metrics.jsonl`, sorted by step (a resumed run may repeat steps: the later line wins).
pub fn read_metrics(path: &Path) -> Result<Vec<Map<String, Value>>> {
    let mut lines = read_jsonl(path)?;
    let mut seen = HashSet::new();
    lines.reverse();
    lines.retain(|l| seen.insert(step_of(l)));
    lines.sort_by_key(step_of);
    Ok(lines)
}

/// The `step` of a metrics, event or trajectory line (0 if absent).
pub fn step_of(line: &Map<String, Value>) -> u64 {
    line.get("step").and_then(Value::as_u64).unwrap_or(0)
}

/// (step, value) for every line that has a finite `key`.
pub fn series(lines: &[Map<String, Value>], key: &str) -> Vec<(u64, f64)> {
    lines.iter().filter_map(|l| Some((step_of(l), l.get(key)?.as_f64().filter(|x| x.is_finite())?))).collect()
}

/// An alarm as shown by plots and the viewer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AlarmMark {
    pub kind: String,
    pub step: u64,
    pub since: u64,
    pub message: String,
    /// "run" when the trainer recorded it, "replay" when recomputed here from metrics.jsonl.
    pub source: &'static str,
}

/// A non-alarm event worth marking on the step axis (script swap, reload error, validation…).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EventMark {
    pub step: u64,
    pub kind: String,
    pub message: String,
}

/// A rollout file: `rollouts/step-000001.jsonl` or `rollouts/val-step-000010.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RolloutFile {
    pub step: u64,
    pub validation: bool,
    pub path: PathBuf,
}

/// Everything but the trajectories, read once.
#[derive(Clone, Debug)]
pub struct Run {
    pub dir: PathBuf,
    pub name: String,
    pub settings: Option<Value>,
    pub metrics: Vec<Map<String, Value>>,
    pub events: Vec<EventMark>,
    pub alarms: Vec<AlarmMark>,
    pub rollouts: Vec<RolloutFile>,
}

impl Run {
    /// Reads `dir`; fails if it does not look like a run directory at all.
    pub fn open(dir: &Path) -> Result<Run> {
        check_dir(dir)?;
        let settings = match std::fs::read_to_string(dir.join("settings.json")) {
            Ok(t) => Some(
                serde_json::from_str(&t).with_context(|| format!("parsing {}", dir.join("settings.json").display()))?,
            ),
            Err(_) => None,
        };
        let mut metrics = read_metrics(&dir.join("metrics.jsonl"))?;
        let raw_events = read_jsonl(&dir.join("events.jsonl"))?;
        merge_validation(&mut metrics, &raw_events);
        let echo = echo_settings(settings.as_ref());
        let alarms = alarms(&metrics, &raw_events, &echo);
        let events = raw_events
            .iter()
            .filter(|e| e.get("kind").and_then(Value::as_str) != Some("alarm"))
            .map(|e| EventMark {
                step: step_of(e),
                kind: e.get("kind").and_then(Value::as_str).unwrap_or("event").to_string(),
                message: e.get("message").and_then(Value::as_str).unwrap_or("").to_string(),
            })
            .collect();
        let name = dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| dir.display().to_string());
        Ok(Run { dir: dir.to_path_buf(), name, settings, metrics, events, alarms, rollouts: rollout_files(dir)? })
    }
}

/// Fails if `dir` does not look like a run directory at all.
pub fn check_dir(dir: &Path) -> Result<()> {
    if !dir.is_dir() {
        bail!("{}: no such run directory (expected runs/<name>/ from `ragen-lab train`)", dir.display());
    }
    let has_any = ["metrics.jsonl", "settings.json", "rollouts"].iter().any(|f| dir.join(f).exists());
    if !has_any {
        bail!("{}: not a run directory (no metrics.jsonl, settings.json or rollouts/)", dir.display());
    }
    Ok(())
}

/// Validation results may come only as `validation` events (with their `val/…` numbers, at step 0
/// before training too): fold those numbers into the metrics line of their step, adding a line
/// where the step has none, so plots and the viewer find `val/success` either way.
fn merge_validation(metrics: &mut Vec<Map<String, Value>>, events: &[Map<String, Value>]) {
    for e in events.iter().filter(|e| e.get("kind").and_then(Value::as_str) == Some("validation")) {
        let step = step_of(e);
        let vals: Vec<(&String, &Value)> =
            e.iter().filter(|(k, v)| k.starts_with("val") && k.contains('/') && v.is_number()).collect();
        if vals.is_empty() {
            continue;
        }
        let at = match metrics.binary_search_by_key(&step, step_of) {
            Ok(i) => i,
            Err(i) => {
                let mut line = Map::new();
                line.insert("step".into(), step.into());
                metrics.insert(i, line);
                i
            }
        };
        for (k, v) in vals {
            metrics[at].entry(k.clone()).or_insert_with(|| v.clone());
        }
    }
}

/// The run's own `echo` thresholds when settings.json has them, else the defaults.
pub fn echo_settings(settings: Option<&Value>) -> EchoSettings {
    settings
        .and_then(|s| s.get("echo").or_else(|| s.get("settings").and_then(|s| s.get("echo"))))
        .and_then(|e| serde_json::from_value(e.clone()).ok())
        .unwrap_or_default()
}

/// Recorded alarms (events.jsonl, the metrics lines' `alarms`) plus those a replay of the metrics
/// finds that were not recorded, one per (kind, since), in step order.
pub fn alarms(metrics: &[Map<String, Value>], events: &[Map<String, Value>], echo: &EchoSettings) -> Vec<AlarmMark> {
    let text = |m: &Map<String, Value>, k: &str| m.get(k).and_then(Value::as_str).unwrap_or("").to_string();
    let mut out: Vec<AlarmMark> = vec![];
    for e in events.iter().filter(|e| e.get("kind").and_then(Value::as_str) == Some("alarm")) {
        let step = step_of(e);
        let kind = e.get("alarm").and_then(Value::as_str).unwrap_or("alarm").to_string();
        let since = e.get("since").and_then(Value::as_u64).unwrap_or(step);
        out.push(AlarmMark { kind, step, since, message: text(e, "message"), source: "run" });
    }
    for line in metrics {
        for a in line.get("alarms").and_then(Value::as_array).into_iter().flatten() {
            let Some(a) = a.as_object() else { continue };
            let step = step_of(line);
            let since = a.get("since").and_then(Value::as_u64).unwrap_or(step);
            out.push(AlarmMark { kind: text(a, "kind"), step, since, message: text(a, "message"), source: "run" });
        }
    }
    for a in echo_trap::replay(echo, metrics.iter().map(|l| (step_of(l), l))) {
        out.push(AlarmMark {
            kind: a.kind.as_str().into(),
            step: a.step,
            since: a.since,
            message: a.message,
            source: "replay",
        });
    }
    let mut seen = HashSet::new();
    out.retain(|a| seen.insert((a.kind.clone(), a.since)));
    out.sort_by_key(|a| (a.step, a.since));
    out
}

/// The rollout files under `dir/rollouts/`, by step (training before validation at a step).
pub fn rollout_files(dir: &Path) -> Result<Vec<RolloutFile>> {
    let root = dir.join("rollouts");
    let Ok(entries) = std::fs::read_dir(&root) else { return Ok(vec![]) };
    let mut out = vec![];
    for e in entries {
        let e = e.with_context(|| format!("listing {}", root.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".jsonl") else { continue };
        let (validation, num) = match stem.strip_prefix("val-step-") {
            Some(n) => (true, n),
            None => match stem.strip_prefix("step-") {
                Some(n) => (false, n),
                None => continue,
            },
        };
        if let Ok(step) = num.parse() {
            out.push(RolloutFile { step, validation, path: e.path() });
        }
    }
    out.sort_by_key(|r| (r.step, r.validation));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_half_written_last_line_is_skipped_but_a_bad_middle_line_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(&p, "{\"step\":2,\"a\":1}\n{\"step\":1,\"a\":0}\n{\"step\":3,\"a\"").unwrap();
        let m = read_metrics(&p).unwrap();
        assert_eq!(m.iter().map(step_of).collect::<Vec<_>>(), vec![1, 2]);
        std::fs::write(&p, "{\"step\":1}\nnot json\n{\"step\":3}\n").unwrap();
        let err = read_metrics(&p).unwrap_err().to_string();
        assert!(err.contains("metrics.jsonl:2:"), "{err}");
    }

    #[test]
    fn a_resumed_run_keeps_the_later_line_of_a_repeated_step() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("metrics.jsonl");
        std::fs::write(&p, "{\"step\":1,\"a\":0}\n{\"step\":2,\"a\":1}\n{\"step\":2,\"a\":5}\n").unwrap();
        assert_eq!(series(&read_metrics(&p).unwrap(), "a"), vec![(1, 0.0), (2, 5.0)]);
    }

    #[test]
    fn a_tail_returns_each_complete_line_once_and_sees_a_rewrite() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("events.jsonl");
        let mut tail = Tail::new(&p);
        assert!(matches!(tail.read().unwrap(), Grown::Lines(l) if l.is_empty()), "missing file: nothing yet");
        std::fs::write(&p, "{\"step\":1}\n{\"step\":2,\"a\"").unwrap();
        let steps = |g: Grown| match g {
            Grown::Lines(l) => l.iter().map(step_of).collect::<Vec<_>>(),
            Grown::Rewritten => panic!("not rewritten"),
        };
        assert_eq!(steps(tail.read().unwrap()), vec![1]);
        std::fs::OpenOptions::new().append(true).open(&p).unwrap().write_all(b":0}\n{\"step\":3}\n").unwrap();
        assert_eq!(steps(tail.read().unwrap()), vec![2, 3]);
        assert_eq!(steps(tail.read().unwrap()), Vec::<u64>::new());
        // A resumed run replaces metrics.jsonl by rename.
        std::fs::write(dir.path().join("new"), "{\"step\":1}\n{\"step\":2}\n{\"step\":3}\n{\"step\":4}\n").unwrap();
        std::fs::rename(dir.path().join("new"), &p).unwrap();
        assert!(matches!(tail.read().unwrap(), Grown::Rewritten));
    }

    #[test]
    fn recorded_and_replayed_alarms_merge_without_duplicates() {
        let metrics: Vec<Map<String, Value>> = (1..=10u64)
            .map(|s| {
                let g = if s == 8 { 40.0 } else { 1.0 };
                serde_json::json!({"step": s, "update/grad_norm": g}).as_object().unwrap().clone()
            })
            .collect();
        let recorded =
            serde_json::json!({"step": 8, "kind": "alarm", "alarm": "grad_norm_spike", "since": 8, "message": "m"});
        let a = alarms(&metrics, &[recorded.as_object().unwrap().clone()], &EchoSettings::default());
        assert_eq!(a.len(), 1, "{a:#?}");
        assert_eq!((a[0].kind.as_str(), a[0].since, a[0].source), ("grad_norm_spike", 8, "run"));
        let replayed = alarms(&metrics, &[], &EchoSettings::default());
        assert_eq!(replayed[0].source, "replay");
    }

    #[test]
    fn validation_events_fill_in_val_metrics() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("metrics.jsonl"),
            "{\"step\":1,\"a\":1}\n{\"step\":2,\"a\":2,\"val/success\":0.5}\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("events.jsonl"),
            "{\"step\":0,\"kind\":\"validation\",\"val/success\":0.1,\"message\":\"m\"}\n\
             {\"step\":2,\"kind\":\"validation\",\"val/success\":0.9,\"val_heldout/success\":0.2}\n",
        )
        .unwrap();
        let run = Run::open(dir.path()).unwrap();
        // Step 0 gets a line of its own; a value already in metrics.jsonl wins.
        assert_eq!(series(&run.metrics, "val/success"), vec![(0, 0.1), (2, 0.5)]);
        assert_eq!(series(&run.metrics, "val_heldout/success"), vec![(2, 0.2)]);
        assert_eq!(series(&run.metrics, "a"), vec![(1, 1.0), (2, 2.0)]);
    }

    #[test]
    fn rollout_files_are_listed_by_step() {
        let dir = tempfile::tempdir().unwrap();
        let r = dir.path().join("rollouts");
        std::fs::create_dir_all(&r).unwrap();
        for f in ["step-000010.jsonl", "val-step-000002.jsonl", "step-000002.jsonl", "notes.txt"] {
            std::fs::write(r.join(f), "").unwrap();
        }
        let got: Vec<(u64, bool)> = rollout_files(dir.path()).unwrap().iter().map(|f| (f.step, f.validation)).collect();
        assert_eq!(got, vec![(2, false), (2, true), (10, false)]);
    }
}
