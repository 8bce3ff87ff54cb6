//! The rollout viewer: one self-contained HTML file (inline CSS and JS, the run's data embedded as
//! JSON) that opens from disk without a network. It lists steps and trajectories, reads each
//! trajectory as dialogue turns, filters by step, group, success and validity, and draws the
//! metric charts (inline SVG) with the alarms.
//!
//! The page is a template (`page.html`) plus one JSON blob built here from the run directory; the
//! page's script renders everything from that blob, so the file written to `view/index.html` and
//! the page [`serve`] regenerates on every request are the same thing. The charts' panels come from
//! [`crate::metrics::plot::PANELS`], so `plot` and the viewer show the same series.
pub mod serve;

use crate::metrics::keys::Key;
use crate::metrics::plot::PANELS;
use crate::metrics::run::{read_jsonl, Run};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

const PAGE: &str = include_str!("page.html");
/// Where the page's script expects the data (a JSON literal replaces this whole comment).
const SLOT: &str = "/*RAGEN_DATA*/null";

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

/// The viewer's data for a run: metrics, alarms, events, script versions, every trajectory.
pub fn data(run: &Run) -> Result<Value> {
    let mut steps = vec![];
    for f in &run.rollouts {
        let trajectories = read_jsonl(&f.path)?;
        steps.push(json!({"step": f.step, "validation": f.validation, "trajectories": trajectories}));
    }
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
    let generated = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    Ok(json!({
        "run": run.name,
        "dir": run.dir.display().to_string(),
        "generated": generated,
        "settings": run.settings,
        "panels": panels,
        "step_columns": STEP_COLUMNS.iter().map(|(k, label)| json!([k.name(), label])).collect::<Vec<_>>(),
        "success_key": Key::Success.name(),
        "metrics": run.metrics,
        "alarms": run.alarms,
        "events": run.events,
        "scripts": read_jsonl(&run.dir.join("scripts").join("index.jsonl"))?,
        "steps": steps,
    }))
}

/// The page with `data` embedded. `<` is escaped inside the JSON (it only occurs in strings) so
/// model output such as `</script>` cannot end the script element.
pub fn page(data: &Value) -> String {
    let json = serde_json::to_string(data).expect("a serde_json::Value always serialises").replace('<', "\\u003c");
    PAGE.replacen(SLOT, &json, 1)
}

/// Builds the page for the run at `dir` and writes it to `out` (default `dir/view/index.html`).
pub fn build(dir: &Path, out: Option<&Path>) -> Result<PathBuf> {
    let run = Run::open(dir)?;
    let out = out.map_or_else(|| dir.join("view").join("index.html"), Path::to_path_buf);
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("creating {}", parent.display()))?;
    }
    // Write then rename, so a browser reloading during a rebuild never sees half a page.
    let tmp = out.with_extension("html.tmp");
    std::fs::write(&tmp, page(&data(&run)?)).with_context(|| format!("writing {}", tmp.display()))?;
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
}
