//! The dashboard of a run: one HTML page (inline CSS and JS, no network beyond the server it came
//! from) with the run's health, its curves with alarms and script swaps marked, each step's reward
//! histogram, groups and trajectories turn by turn, the steps table, the alarms and events, and the
//! script versions with the diff between consecutive versions of a file.
//!
//! Two ways to get it. [`serve`] follows a live run: the page fetches a summary, then each step's
//! rollouts a page at a time as the user asks, and new steps, alarms and events arrive over a
//! server-sent event stream ([`follow`] reads what the trainer appended). [`build`] writes
//! `view/index.html`, which opens from disk without a network: the same page with the same data
//! embedded as JSON, the newest steps' trajectories up to [`OFFLINE_TRAJECTORY_BYTES`].
//!
//! The charts' panels come from [`crate::metrics::plot::PANELS`], so `plot` and the page show the
//! same series.
pub mod diff;
pub mod follow;
pub mod serve;
pub mod step;

use crate::metrics::keys::Key;
use crate::metrics::plot::PANELS;
use crate::metrics::run::{check_dir, read_jsonl, step_of};
use anyhow::{Context, Result};
use follow::Follow;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

const PAGE: &str = include_str!("page.html");
/// Where the page's script expects the data (a JSON literal replaces this whole comment).
const SLOT: &str = "/*RAGEN_DATA*/null";
/// The offline page embeds trajectories up to this many bytes of rollout files, newest steps
/// first; the older steps say to serve the run to read them.
pub const OFFLINE_TRAJECTORY_BYTES: usize = 16 << 20;
/// Points per series in the summary: each chart is a few hundred pixels wide, so a long run is
/// thinned to the lowest and highest value of each of this many buckets (a spike stays visible).
const CHART_BUCKETS: usize = 400;
/// Events in the summary; older ones are fetched when the user scrolls back.
const SUMMARY_EVENTS: usize = 200;
/// Step times in the summary, for the rate and ETA in the health line.
const RECENT_TIMES: usize = 64;

/// The columns of the viewer's table of steps.
pub const STEP_COLUMNS: &[(Key, &str)] = &[
    (Key::RewardMean, "reward"),
    (Key::Success, "success"),
    (Key::InGroupStd, "in-group std"),
    (Key::Entropy, "entropy"),
    (Key::GradNorm, "grad norm"),
    (Key::ThinkLen, "think len"),
    (Key::ValSuccess, "val success"),
];

/// What the page loads first: everything but the trajectories and the older events, with the
/// series thinned for the charts.
pub fn summary(f: &Follow) -> Value {
    let panels: Vec<Value> = PANELS
        .iter()
        .map(|p| {
            let lines: Vec<Value> = p
                .lines
                .iter()
                .map(|l| json!({"key": l.key.name(), "label": l.label, "band": l.band.map(Key::name)}))
                .collect();
            json!({"file": p.file, "title": p.title, "y": p.y, "lines": lines})
        })
        .collect();
    let mut thinned: BTreeMap<&str, Vec<(u64, f64)>> =
        f.series.iter().map(|(k, points)| (*k, thin(points, CHART_BUCKETS))).collect();
    // A band (± std) is drawn around its line's points, so it keeps the steps its line kept.
    for l in PANELS.iter().flat_map(|p| p.lines) {
        if let Some(band) = l.band {
            let kept: HashSet<u64> = thinned[l.key.name()].iter().map(|p| p.0).collect();
            thinned
                .insert(band.name(), f.series[band.name()].iter().filter(|p| kept.contains(&p.0)).copied().collect());
        }
    }
    let series: Map<String, Value> = thinned
        .into_iter()
        .filter(|(_, points)| !points.is_empty())
        .map(|(k, points)| {
            let (steps, values): (Vec<u64>, Vec<f64>) = points.iter().map(|&(s, v)| (s, round(v))).unzip();
            (k.to_string(), json!([steps, values]))
        })
        .collect();
    let marks: Vec<Value> = f
        .events
        .iter()
        .filter(|e| e.get("kind").and_then(Value::as_str).is_some_and(|k| follow::MARKED_EVENTS.contains(&k)))
        .map(|e| json!({"step": e.get("step"), "kind": e.get("kind"), "message": e.get("message")}))
        .collect();
    let ranges =
        |validation: bool| steps_as_ranges(f.rollouts.iter().filter(|r| r.validation == validation).map(|r| r.step));
    let name = f.dir.canonicalize().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    json!({
        "run": name.unwrap_or_else(|| f.dir.display().to_string()),
        "dir": f.dir.display().to_string(),
        "seq": f.position(),
        "settings": f.settings,
        "panels": panels,
        "step_columns": STEP_COLUMNS.iter().map(|(k, label)| json!([k.name(), label])).collect::<Vec<_>>(),
        "success_key": Key::Success.name(),
        "series": series,
        "steps": f.times.len(),
        "recent_times": f.times[f.times.len().saturating_sub(RECENT_TIMES)..].iter().map(|&(s, t)| json!([s, t])).collect::<Vec<_>>(),
        "alarms": f.alarms,
        "marks": marks,
        "events": &f.events[f.events.len().saturating_sub(SUMMARY_EVENTS)..],
        "events_total": f.events.len(),
        "scripts": f.scripts,
        "rollouts": {"train": ranges(false), "val": ranges(true)},
        "warnings": f.warnings,
    })
}

/// The steps table's rows before step `before` (all when None), newest first, at most `limit`:
/// the step, its time and the table's columns, with the events of those steps.
pub fn step_rows(f: &Follow, before: Option<u64>, limit: usize) -> Value {
    let end = before.map_or(f.times.len(), |b| f.times.partition_point(|t| t.0 < b));
    let rows: Vec<Value> = f.times[..end]
        .iter()
        .rev()
        .take(limit)
        .map(|&(step, time)| {
            let mut row = Map::new();
            row.insert("step".into(), step.into());
            row.insert("time".into(), json!(time));
            for (k, _) in STEP_COLUMNS {
                let points = &f.series[k.name()];
                if let Ok(i) = points.binary_search_by_key(&step, |p| p.0) {
                    row.insert(k.name().into(), json!(points[i].1));
                }
            }
            Value::Object(row)
        })
        .collect();
    let lo = rows.last().and_then(|r| r["step"].as_u64()).unwrap_or(0);
    let hi = rows.first().and_then(|r| r["step"].as_u64()).unwrap_or(0);
    let events: Vec<&Map<String, Value>> = f.events.iter().filter(|e| (lo..=hi).contains(&step_of(e))).collect();
    json!({"rows": rows, "events": events, "more": end > limit})
}

/// At most `2 * buckets` points: the lowest and highest of each bucket, in step order.
fn thin(points: &[(u64, f64)], buckets: usize) -> Vec<(u64, f64)> {
    if points.len() <= 2 * buckets {
        return points.to_vec();
    }
    let size = points.len().div_ceil(buckets);
    let mut out = Vec::with_capacity(2 * buckets);
    for chunk in points.chunks(size) {
        let by = |a: &&(u64, f64), b: &&(u64, f64)| a.1.total_cmp(&b.1);
        let (lo, hi) = (chunk.iter().min_by(by).expect("chunk"), chunk.iter().max_by(by).expect("chunk"));
        out.extend(if lo.0 <= hi.0 { [*lo, *hi] } else { [*hi, *lo] });
        if lo.0 == hi.0 {
            out.pop();
        }
    }
    out
}

/// Five significant digits: a chart cannot show more, and the summary is a third the size.
fn round(x: f64) -> f64 {
    format!("{x:.4e}").parse().unwrap_or(x)
}

/// Sorted steps as [first, last] runs of consecutive steps (10,000 steps are one pair).
fn steps_as_ranges(steps: impl Iterator<Item = u64>) -> Vec<[u64; 2]> {
    let mut out: Vec<[u64; 2]> = vec![];
    for s in steps {
        match out.last_mut() {
            Some(r) if r[1] + 1 == s => r[1] = s,
            _ => out.push([s, s]),
        }
    }
    out
}

/// The offline page's data: the summary, every step row and event, the diffs between consecutive
/// versions of each script, and the trajectories of the newest steps up to
/// [`OFFLINE_TRAJECTORY_BYTES`].
pub fn offline(f: &Follow) -> Result<Value> {
    let mut rollouts = Map::new();
    let mut bytes = 0;
    for r in f.rollouts.iter().rev() {
        if bytes > OFFLINE_TRAJECTORY_BYTES {
            break;
        }
        let trajectories = read_jsonl(&r.path)?;
        let episodes = step::episodes(&trajectories);
        bytes += std::fs::metadata(&r.path).map_or(0, |m| m.len() as usize);
        let key = if r.validation { format!("val-{}", r.step) } else { r.step.to_string() };
        rollouts.insert(key, json!({"episodes": episodes, "trajectories": trajectories}));
    }
    let mut diffs = Map::new();
    for (old, new) in script_pairs(&f.scripts) {
        diffs.insert(format!("{}..{}", old.unwrap_or(""), new), diff_json(&f.dir, old, new)?);
    }
    Ok(json!({
        "summary": summary(f),
        "steps": step_rows(f, None, usize::MAX)["rows"],
        "events": f.events,
        "rollouts": rollouts,
        "diffs": diffs,
    }))
}

/// (previous version, version) of each entry of scripts/index.jsonl, by path.
fn script_pairs(index: &[Map<String, Value>]) -> Vec<(Option<&str>, &str)> {
    let mut last: HashMap<&str, &str> = HashMap::new();
    let mut out = vec![];
    for e in index {
        let (Some(path), Some(hash)) = (e.get("path").and_then(Value::as_str), e.get("hash").and_then(Value::as_str))
        else {
            continue;
        };
        out.push((last.insert(path, hash), hash));
    }
    out
}

/// The diff between two stored versions (`old` None: the first version, all added) as
/// `{"lines": [[" "|"-"|"+", text], …]}`; a version whose source was not stored says so.
pub fn diff_json(dir: &Path, old: Option<&str>, new: &str) -> Result<Value> {
    let source = |h: &str| -> Result<Option<String>> {
        anyhow::ensure!(!h.is_empty() && h.bytes().all(|b| b.is_ascii_hexdigit()), "not a script version: {h:?}");
        let p = dir.join("scripts").join(format!("{h}.rhai"));
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e).with_context(|| format!("reading {}", p.display())),
        }
    };
    let old_text = match old {
        Some(h) => source(h)?,
        None => Some(String::new()),
    };
    let (Some(old_text), Some(new_text)) = (old_text, source(new)?) else {
        return Ok(json!({"missing": "the run directory has no source for this version (scripts/<hash>.rhai)"}));
    };
    let lines: Vec<Value> =
        diff::lines(&old_text, &new_text).into_iter().map(|(c, l)| json!([c.to_string(), l])).collect();
    Ok(json!({"lines": lines}))
}

/// The page with `data` embedded (`Value::Null`: the live page, which fetches it). `<` is escaped inside the JSON (it only occurs in strings) so
/// model output such as `</script>` cannot end the script element.
pub fn page(data: &Value) -> String {
    let json = serde_json::to_string(data).expect("a serde_json::Value always serialises").replace('<', "\\u003c");
    PAGE.replacen(SLOT, &json, 1)
}

/// Builds the offline page for the run at `dir` and writes it to `out` (default
/// `dir/view/index.html`).
pub fn build(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    check_dir(dir)?;
    let mut f = Follow::new(dir);
    f.poll()?;
    let out = out.map_or_else(|| dir.join("view").join("index.html"), Path::to_path_buf);
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    // Write then rename, so a browser reloading during a rebuild never sees half a page.
    let tmp = out.with_extension("html.tmp");
    std::fs::write(&tmp, page(&offline(&f)?)).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &out).with_context(|| format!("writing {}", out.display()))?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_has_exactly_one_data_slot() {
        assert_eq!(PAGE.matches(SLOT).count(), 1);
    }

    #[test]
    fn model_text_cannot_close_the_script_element() {
        let p = page(&json!({"x": "</script><b>"}));
        assert!(!p.contains("</script><b>"));
        assert!(p.contains(r#""x":"\u003c/script>\u003cb>""#));
    }

    #[test]
    fn thinning_keeps_a_spike_and_the_step_order() {
        let mut points: Vec<(u64, f64)> = (0..10_000).map(|s| (s, 1.0)).collect();
        points[7777].1 = 50.0;
        let t = thin(&points, 100);
        assert!(t.len() <= 200, "{}", t.len());
        assert!(t.contains(&(7777, 50.0)));
        assert!(t.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(thin(&points[..10], 100), points[..10].to_vec());
    }

    #[test]
    fn steps_become_ranges() {
        assert_eq!(steps_as_ranges([1, 2, 3, 5, 10, 11].into_iter()), vec![[1, 3], [5, 5], [10, 11]]);
    }
}
