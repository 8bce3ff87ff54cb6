//! One step's rollouts, read from its file when the page asks for them: a row per episode (what the
//! groups, the reward histogram and the filters need) and full trajectories by line number. No
//! cache: the trainer writes a step's file once, and one file reads in milliseconds.
use crate::metrics::run::read_jsonl;
use anyhow::{bail, Result};
use serde_json::{json, Map, Value};
use std::path::Path;

/// At most this many trajectories per request (a page of the list, not the step).
pub const MAX_PER_REQUEST: usize = 100;

/// A row per trajectory line, in file order (`i` is the line number, from 0).
pub fn episodes(lines: &[Map<String, Value>]) -> Vec<Value> {
    lines.iter().enumerate().map(|(i, t)| episode(i, t)).collect()
}

fn episode(i: usize, t: &Map<String, Value>) -> Value {
    let turns = t.get("turns").and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let invalid =
        turns.iter().any(|u| u.get("invalid_actions").and_then(Value::as_array).is_some_and(|a| !a.is_empty()));
    let format_error = turns.iter().any(|u| u.get("format_ok") == Some(&Value::Bool(false)));
    let field = |k: &str| t.get(k).cloned().unwrap_or(Value::Null);
    json!({
        "i": i, "group": field("group"), "episode": field("episode"), "seed": field("seed"),
        "success": field("success"), "score": field("score"), "normalized_score": field("normalized_score"),
        "advantage": field("advantage"), "kept": field("kept"), "turns": turns.len(),
        "invalid": invalid, "format_error": format_error,
    })
}

/// The trajectories at line numbers `at` (those past the end are left out).
pub fn trajectories(path: &Path, at: &[usize]) -> Result<Vec<Value>> {
    if at.len() > MAX_PER_REQUEST {
        bail!("at most {MAX_PER_REQUEST} trajectories per request, asked for {}", at.len());
    }
    let all = read_jsonl(path)?;
    Ok(at.iter().filter_map(|&i| all.get(i).cloned().map(Value::Object)).collect())
}
