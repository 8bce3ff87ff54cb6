//! Following a run directory while the trainer writes it. Each [`Follow::poll`] reads only what
//! was appended since the last one (metrics, events, the script index, new rollout files) and
//! turns it into numbered [`Update`]s that the dashboard's event stream sends on.
//!
//! It keeps what the charts, the steps table and the header draw: the charted and tabled metric
//! series, the alarms (recorded, and replayed from the metrics with the run's own thresholds, as
//! `plot` does), the events and the script versions. It never keeps trajectories (the server reads
//! one step's file when the page asks), so its memory grows with steps, not with rollouts.
//!
//! A file replaced or shortened under it (a resumed run rewrites metrics.jsonl) starts it over; a
//! step logged again replaces the later ones. Either way the page is told to fetch everything again
//! (`reset`).
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
    /// When this follower was made (unix ns): update numbers mean something only within one
    /// follower, so a page that reconnects to a restarted server is told to start over.
    pub epoch: u128,
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
            epoch: SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_nanos()),
            log: VecDeque::new(),
        }
    }

    /// Reads what the run appended since the last poll. Returns whether anything changed.
    pub fn poll(&mut self) -> Result<bool> {
        let before = self.seq;
        match self.poll_once() {
            Err(e) if e.is::<Rewritten>() => {
                // Start over on the same numbering, so open streams see `reset`, not old numbers.
                let (seq, epoch, log) = (self.seq, self.epoch, std::mem::take(&mut self.log));
                *self = Follow { seq, epoch, log, ..Follow::new(&self.dir) };
                self.push("reset", json!({}));
                self.poll_once()?;
            }
            r => r?,
        }
        Ok(self.seq != before)
    }

    /// One pass over the files; [`Rewritten`] when what was read before no longer holds.
    fn poll_once(&mut self) -> Result<()> {
        if self.settings.is_none() {
            let path = self.dir.join("settings.json");
            if let Ok(text) = std::fs::read_to_string(&path) {
                let settings: Value =
                    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
                if !self.times.is_empty() {
                    // Alarms were replayed with default thresholds; the run's own apply from step 1.
                    return Err(Rewritten.into());
                }
                self.monitor = EchoTrapMonitor::new(echo_settings(Some(&settings)));
                self.push("settings", settings.clone());
                self.settings = Some(settings);
            }
        }
        // Each tail is read to its end a chunk at a time (a long run's catch-up holds one chunk).
        while let Some(scripts) = lines(&mut self.tails.scripts, &mut self.warnings)? {
            for s in scripts {
                self.push("script", Value::Object(s.clone()));
                self.scripts.push(s);
            }
        }
        // Events before metrics: a validation's numbers give way to the metrics line's, and an
        // alarm the trainer recorded is not taken for a replayed one.
        while let Some(events) = lines(&mut self.tails.events, &mut self.warnings)? {
            for e in events {
                self.event(e);
            }
        }
        while let Some(metrics) = lines(&mut self.tails.metrics, &mut self.warnings)? {
            for m in metrics {
                let step = step_of(&m);
                if self.times.last().is_some_and(|&(last, _)| step <= last) {
                    // A step again (a run resumed without trimming the file): the later line
                    // wins, as in `read_metrics`, and the page fetches the summary again.
                    self.times.retain(|t| t.0 < step);
                    self.series.values_mut().for_each(|points| points.retain(|p| p.0 < step));
                    self.push("reset", json!({}));
                }
                self.metrics(&m);
            }
        }
        self.poll_rollouts()
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

    /// Where the updates stand, as `EPOCH-SEQ` (the event stream's ids).
    pub fn position(&self) -> String {
        self.id(self.seq)
    }

    pub fn id(&self, seq: u64) -> String {
        format!("{}-{seq}", self.epoch)
    }

    /// The updates after `position`, or None when the page must fetch everything again: some of
    /// them are no longer kept, or the position is another follower's.
    pub fn since(&self, position: &str) -> Option<Vec<Update>> {
        let (epoch, seq) = position.split_once('-')?;
        let seq: u64 = seq.parse().ok()?;
        let first = self.log.front().map_or(self.seq + 1, |u| u.seq);
        if epoch.parse() != Ok(self.epoch) || seq > self.seq || (seq + 1 < first && seq < self.seq) {
            return None;
        }
        Some(self.log.iter().filter(|u| u.seq > seq).cloned().collect())
    }
}

/// The next lines of a tail, None once it has no more; [`Rewritten`] when its file was. A bad
/// line becomes a warning and is skipped (a dashboard that stopped at one bad line would hide the
/// rest of the run).
fn lines(tail: &mut Tail, warnings: &mut Vec<String>) -> Result<Option<Vec<Map<String, Value>>>> {
    loop {
        match tail.read() {
            Ok(Grown::Lines(l)) => return Ok(Some(l).filter(|l| !l.is_empty())),
            Ok(Grown::Rewritten) => return Err(Rewritten.into()),
            Err(e) => warnings.push(format!("{e:#}")),
        }
    }
}

/// What the follower read no longer describes the run (a file replaced or shortened, settings that
/// came after the metrics): it starts over.
#[derive(Debug)]
struct Rewritten;

impl std::fmt::Display for Rewritten {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the run directory was rewritten under the reader")
    }
}

impl std::error::Error for Rewritten {}

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

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn append(path: &Path, line: &str) {
        std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap().write_all(line.as_bytes()).unwrap();
    }

    fn kinds(updates: &[Update]) -> Vec<&'static str> {
        updates.iter().map(|u| u.kind).collect()
    }

    #[test]
    fn appended_lines_become_updates_and_a_rewritten_run_a_reset() {
        let dir = tempfile::tempdir().unwrap();
        let (run, metrics) = (dir.path(), dir.path().join("metrics.jsonl"));
        let mut f = Follow::new(run);
        assert!(!f.poll().unwrap(), "an empty directory has nothing to say");
        let start = f.position();
        append(&metrics, "{\"step\":1,\"time\":10.0,\"rollout/reward_mean\":0.5}\n{\"step\":2,\"time\":12.0,\"rollout/reward_mean\":0.7}\n");
        append(&run.join("events.jsonl"), "{\"step\":2,\"kind\":\"validation\",\"val/success\":0.25}\n");
        assert!(f.poll().unwrap());
        let got = f.since(&start).unwrap();
        assert_eq!(kinds(&got), vec!["metrics", "event", "metrics", "metrics"]);
        assert_eq!(f.series["rollout/reward_mean"], vec![(1, 0.5), (2, 0.7)]);
        assert_eq!(f.series["val/success"], vec![(2, 0.25)]);
        let here = f.position();
        assert!(f.since(&here).unwrap().is_empty());
        // A half-written line waits for its end.
        append(&metrics, "{\"step\":3,\"time\":14.0,");
        assert!(!f.poll().unwrap());
        append(&metrics, "\"rollout/reward_mean\":0.9}\n");
        assert!(f.poll().unwrap());
        assert_eq!(kinds(&f.since(&here).unwrap()), vec!["metrics"]);
        // Another server's position, or one from the future: start over.
        assert!(f.since("1-0").is_none() && f.since(&f.id(f.seq + 5)).is_none() && f.since("junk").is_none());

        // A resumed run replaces metrics.jsonl by rename, without step 3.
        let here = f.position();
        std::fs::write(run.join("m.tmp"), "{\"step\":1,\"time\":10.0,\"rollout/reward_mean\":0.5}\n").unwrap();
        std::fs::rename(run.join("m.tmp"), &metrics).unwrap();
        assert!(f.poll().unwrap());
        assert_eq!(kinds(&f.since(&here).unwrap())[0], "reset");
        assert_eq!(f.series["rollout/reward_mean"], vec![(1, 0.5)]);
        assert_eq!(f.events.len(), 1, "events read again once");

        // A step logged again in the same file: the later line wins.
        let here = f.position();
        append(&metrics, "{\"step\":2,\"time\":12.0,\"rollout/reward_mean\":0.7}\n{\"step\":1,\"time\":13.0,\"rollout/reward_mean\":0.1}\n");
        assert!(f.poll().unwrap());
        assert_eq!(kinds(&f.since(&here).unwrap()), vec!["metrics", "reset", "metrics"]);
        assert_eq!(f.series["rollout/reward_mean"], vec![(1, 0.1)]);
        assert_eq!(f.times, vec![(1, 13.0)]);
    }
}
