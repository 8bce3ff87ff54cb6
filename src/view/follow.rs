//! Following a run directory while the trainer writes it. Each [`Follow::poll`] reads only what
//! was appended since the last one (metrics, events, the script index, new rollout files) and
//! turns it into numbered [`Update`]s that the dashboard's event stream sends on.
//!
//! It keeps what the charts, the steps table and the header draw: the charted and tabled metric
//! series, the alarms (recorded, and replayed from the metrics with the run's own thresholds, as
//! `plot` does), the events and the script versions. It never keeps trajectories (the server reads
//! one step's file when the page asks), so its memory grows with steps, not with rollouts.
//!
//! A file replaced or shortened under it (a resumed run rewrites metrics.jsonl) or a step that goes
//! backwards starts it over, and the page is told to fetch everything again (`reset`).
use crate::metrics::echo_trap::{EchoSettings, EchoTrapMonitor};
use crate::metrics::keys::Key;
use crate::metrics::plot::PANELS;
use crate::metrics::run::{echo_settings, rollout_files, step_of, AlarmMark, Grown, RolloutFile, Tail};
use anyhow::{Context, Result};
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Updates kept for streams that fall behind; one further behind is sent `reset` instead.
const KEPT_UPDATES: usize = 1024;
/// Event kinds marked on the charts' step axis.
pub const MARKED_EVENTS: &[&str] = &["swap", "reload_error", "script_error"];

/// One change, as the event stream sends it: `kind` is the SSE event name, `data` its JSON.
#[derive(Clone, Debug)]
pub struct Update {
    pub seq: u64,
    pub kind: &'static str,
    pub data: Value,
}

/// What is known of the run so far.
pub struct Follow {
    pub dir: PathBuf,
    pub settings: Option<Value>,
    /// Metric key → (step, value), by step: the keys of the charts and the steps table only.
    pub series: BTreeMap<&'static str, Vec<(u64, f64)>>,
    /// (step, unix time) of each metrics line, by step.
    pub times: Vec<(u64, f64)>,
    pub alarms: Vec<AlarmMark>,
    /// events.jsonl without the alarms (those are in `alarms`).
    pub events: Vec<Map<String, Value>>,
    /// scripts/index.jsonl.
    pub scripts: Vec<Map<String, Value>>,
    pub rollouts: Vec<RolloutFile>,
    /// Problems reading the run (a bad line), shown on the page; reading goes on.
    pub warnings: Vec<String>,
    tails: Tails,
    monitor: EchoTrapMonitor,
    alarm_seen: HashSet<(String, u64)>,
    rollouts_seen: HashSet<(u64, bool)>,
    rollouts_mtime: Option<SystemTime>,
    /// The last update's number (0: none yet).
    pub seq: u64,
    log: VecDeque<Update>,
}

struct Tails {
    metrics: Tail,
    events: Tail,
    scripts: Tail,
}

/// The metric keys the follower keeps: every charted line and band, and the steps table's columns.
pub fn kept_keys() -> Vec<&'static str> {
    let mut keys: Vec<&'static str> = PANELS
        .iter()
        .flat_map(|p| p.lines.iter().flat_map(|l| [Some(l.key), l.band]))
        .flatten()
        .chain(super::STEP_COLUMNS.iter().map(|(k, _)| *k))
        .map(Key::name)
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys
}

impl Follow {
    /// A follower of `dir` that has read nothing yet (the directory may not exist yet).
    pub fn new(dir: &Path) -> Follow {
        Follow {
            dir: dir.to_path_buf(),
            settings: None,
            series: kept_keys().into_iter().map(|k| (k, vec![])).collect(),
            times: vec![],
            alarms: vec![],
            events: vec![],
            scripts: vec![],
            rollouts: vec![],
            warnings: vec![],
            tails: Tails {
                metrics: Tail::new(&dir.join("metrics.jsonl")),
                events: Tail::new(&dir.join("events.jsonl")),
                scripts: Tail::new(&dir.join("scripts").join("index.jsonl")),
            },
            monitor: EchoTrapMonitor::new(EchoSettings::default()),
            alarm_seen: HashSet::new(),
            rollouts_seen: HashSet::new(),
            rollouts_mtime: None,
            seq: 0,
            log: VecDeque::new(),
        }
    }

    /// Reads what the run appended since the last poll. Returns whether anything changed.
    pub fn poll(&mut self) -> Result<bool> {
        let before = self.seq;
        if !self.poll_once()? {
            // Start over on the same numbering, so open streams see `reset` and not old numbers.
            let (seq, log) = (self.seq, std::mem::take(&mut self.log));
            *self = Follow { seq, log, ..Follow::new(&self.dir) };
            self.push("reset", json!({}));
            self.poll_once()?;
        }
        Ok(self.seq != before)
    }

    /// One pass over the files; false when what was read before no longer holds.
    fn poll_once(&mut self) -> Result<bool> {
        if self.settings.is_none() {
            let path = self.dir.join("settings.json");
            if let Ok(text) = std::fs::read_to_string(&path) {
                let settings: Value =
                    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
                if !self.times.is_empty() {
                    // Alarms were replayed with default thresholds; the run's own apply from step 1.
                    return Ok(false);
                }
                self.monitor = EchoTrapMonitor::new(echo_settings(Some(&settings)));
                self.push("settings", settings.clone());
                self.settings = Some(settings);
            }
        }
        let Some(scripts) = lines(&mut self.tails.scripts, &mut self.warnings) else { return Ok(false) };
        for s in scripts {
            self.push("script", Value::Object(s.clone()));
            self.scripts.push(s);
        }
        // Events before metrics: a validation's numbers give way to the metrics line's, and an
        // alarm the trainer recorded is not taken for a replayed one.
        let Some(events) = lines(&mut self.tails.events, &mut self.warnings) else { return Ok(false) };
        for e in events {
            self.event(e);
        }
        let Some(metrics) = lines(&mut self.tails.metrics, &mut self.warnings) else { return Ok(false) };
        for m in metrics {
            if self.times.last().is_some_and(|&(last, _)| step_of(&m) <= last) {
                return Ok(false);
            }
            self.metrics(&m);
        }
        self.poll_rollouts()?;
        Ok(true)
    }

    fn metrics(&mut self, m: &Map<String, Value>) {
        let step = step_of(m);
        let time = m.get("time").and_then(Value::as_f64).unwrap_or(f64::NAN);
        self.times.push((step, time));
        let mut values = Map::new();
        for (key, points) in &mut self.series {
            if let Some(v) = m.get(*key).and_then(Value::as_f64).filter(|v| v.is_finite()) {
                put(points, step, v, true);
                values.insert((*key).into(), v.into());
            }
        }
        self.push("metrics", json!({"step": step, "time": time, "values": values}));
        let text = |a: &Map<String, Value>, k: &str| a.get(k).and_then(Value::as_str).unwrap_or("").to_string();
        for a in m.get("alarms").and_then(Value::as_array).into_iter().flatten().filter_map(Value::as_object) {
            let since = a.get("since").and_then(Value::as_u64).unwrap_or(step);
            self.alarm(AlarmMark { kind: text(a, "kind"), step, since, message: text(a, "message"), source: "run" });
        }
        for a in self.monitor.observe(step, m) {
            let a =
                AlarmMark { kind: a.kind.as_str().into(), step, since: a.since, message: a.message, source: "replay" };
            self.alarm(a);
        }
    }

    fn event(&mut self, e: Map<String, Value>) {
        let step = step_of(&e);
        let kind = e.get("kind").and_then(Value::as_str).unwrap_or("event");
        if kind == "alarm" {
            let text = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let since = e.get("since").and_then(Value::as_u64).unwrap_or(step);
            let kind = e.get("alarm").and_then(Value::as_str).unwrap_or("alarm").to_string();
            self.alarm(AlarmMark { kind, step, since, message: text("message"), source: "run" });
            return;
        }
        if kind == "validation" {
            // Validation numbers may come only here (step 0, before training, has no metrics line).
            let mut values = Map::new();
            for (key, points) in &mut self.series {
                if let Some(v) = e.get(*key).and_then(Value::as_f64).filter(|v| v.is_finite()) {
                    if put(points, step, v, false) {
                        values.insert((*key).into(), v.into());
                    }
                }
            }
            if !values.is_empty() {
                self.push("metrics", json!({"step": step, "values": values}));
            }
        }
        self.push("event", Value::Object(e.clone()));
        self.events.push(e);
    }

    fn alarm(&mut self, a: AlarmMark) {
        if !self.alarm_seen.insert((a.kind.clone(), a.since)) {
            return;
        }
        let at = self.alarms.partition_point(|b| (b.step, b.since) <= (a.step, a.since));
        self.push("alarm", serde_json::to_value(&a).expect("an alarm serialises"));
        self.alarms.insert(at, a);
    }

    /// Lists rollouts/ again only when its modification time moved (a file was added).
    fn poll_rollouts(&mut self) -> Result<()> {
        let mtime = std::fs::metadata(self.dir.join("rollouts")).and_then(|m| m.modified()).ok();
        if mtime.is_none() || mtime == self.rollouts_mtime {
            return Ok(());
        }
        self.rollouts_mtime = mtime;
        for f in rollout_files(&self.dir)? {
            if self.rollouts_seen.insert((f.step, f.validation)) {
                self.push("rollout", json!({"step": f.step, "validation": f.validation}));
                let at = self.rollouts.partition_point(|r| (r.step, r.validation) < (f.step, f.validation));
                self.rollouts.insert(at, f);
            }
        }
        Ok(())
    }

    fn push(&mut self, kind: &'static str, data: Value) {
        self.seq += 1;
        if self.log.len() == KEPT_UPDATES {
            self.log.pop_front();
        }
        self.log.push_back(Update { seq: self.seq, kind, data });
    }

    /// The updates after `seq`, or None when some of them are no longer kept (start over).
    pub fn since(&self, seq: u64) -> Option<Vec<Update>> {
        let first = self.log.front().map_or(self.seq + 1, |u| u.seq);
        if seq + 1 < first && seq < self.seq {
            return None;
        }
        Some(self.log.iter().filter(|u| u.seq > seq).cloned().collect())
    }
}

/// The new lines of a tail; None when its file was rewritten. A bad line becomes a warning and
/// is skipped (a dashboard that stops at one bad line would hide the rest of the run).
fn lines(tail: &mut Tail, warnings: &mut Vec<String>) -> Option<Vec<Map<String, Value>>> {
    loop {
        match tail.read() {
            Ok(Grown::Lines(l)) => return Some(l),
            Ok(Grown::Rewritten) => return None,
            Err(e) => warnings.push(format!("{e:#}")),
        }
    }
}

/// Sets the value at `step` (points stay in step order); an existing value is replaced only with
/// `replace`. Returns whether the value was stored.
fn put(points: &mut Vec<(u64, f64)>, step: u64, v: f64, replace: bool) -> bool {
    match points.binary_search_by_key(&step, |p| p.0) {
        Ok(i) if replace => points[i].1 = v,
        Ok(_) => return false,
        Err(i) => points.insert(i, (step, v)),
    }
    true
}
