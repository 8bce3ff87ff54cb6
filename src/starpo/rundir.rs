//! The run directory (docs/contracts.md "The run directory"): resolved settings, script sources
//! by content hash, `metrics.jsonl`, `events.jsonl`, rollouts per step, and checkpoints written
//! atomically (a temp dir renamed into place, then `latest` replaced by rename), so a crash at
//! any instant leaves a run that `--resume` can continue.
//!
//! What it does not hold: what a checkpoint contains (the trainer hands it a closure that writes
//! the files) or how metrics are computed.
use std::collections::{HashMap, HashSet};
use std::fs::{self, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value};

use crate::metrics::run::read_jsonl;
use crate::script::{EnvScript, Experiment, ExperimentScripts, Host, PromptScript, RewardScript, Script};

#[derive(Debug)]
pub struct RunDir {
    pub path: PathBuf,
    /// (role, path) → the hash of the version last recorded in scripts/index.jsonl (the one in use).
    current: HashMap<(String, String), String>,
}

pub fn now() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// Write `text` to `path` atomically (temp file in the same folder, then rename).
pub fn write_atomic(path: &Path, text: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Appends `v` as one line of a JSONL file.
pub fn append_line(path: &Path, v: &Value) -> Result<()> {
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening {}", path.display()))?;
    writeln!(f, "{v}").with_context(|| format!("writing {}", path.display()))
}

impl RunDir {
    /// A fresh run directory; refuses one that already holds a run.
    pub fn create(path: &Path) -> Result<Self> {
        if path.join("settings.json").exists() {
            bail!(
                "{} already holds a run: continue it with --resume {}, or pick another --name",
                path.display(),
                path.display()
            );
        }
        for sub in ["scripts", "rollouts", "checkpoints"] {
            fs::create_dir_all(path.join(sub)).with_context(|| format!("creating {}", path.join(sub).display()))?;
        }
        Ok(Self { path: path.to_path_buf(), current: HashMap::new() })
    }

    /// An existing run, to resume: lines of metrics.jsonl past `step` (written after the last
    /// checkpoint, before the run died) are dropped so every step appears once.
    pub fn reopen(path: &Path, step: u64) -> Result<Self> {
        let metrics = path.join("metrics.jsonl");
        if metrics.exists() {
            let text = fs::read_to_string(&metrics).with_context(|| format!("reading {}", metrics.display()))?;
            let kept: String = text
                .lines()
                .filter(|l| {
                    serde_json::from_str::<Value>(l).ok().and_then(|v| v["step"].as_u64()).is_some_and(|s| s <= step)
                })
                .map(|l| format!("{l}\n"))
                .collect();
            write_atomic(&metrics, kept.as_bytes())?;
        }
        let mut current = HashMap::new();
        for v in read_jsonl(&path.join("scripts/index.jsonl"))? {
            let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
            current.insert((s("role"), s("path")), s("hash"));
        }
        Ok(Self { path: path.to_path_buf(), current })
    }

    pub fn write_settings(&self, v: &Value) -> Result<()> {
        write_atomic(&self.path.join("settings.json"), serde_json::to_string_pretty(v)?.as_bytes())
    }

    pub fn read_settings(path: &Path) -> Result<Value> {
        let p = path.join("settings.json");
        let text = fs::read_to_string(&p)
            .with_context(|| format!("reading {} (is {} a run directory?)", p.display(), path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
    }

    /// Record the script version in use from `step`: the source it was compiled from under
    /// scripts/<hash>.rhai (its imports, if any, in scripts/<hash>.imports.json) and a line in
    /// index.jsonl whenever the version in use changes, a return to an earlier version included
    /// (the viewer's "version used from step N" reads these lines).
    pub fn record_script(&mut self, step: u64, role: &str, script: &Script) -> Result<()> {
        let hash = script.version().to_string();
        let key = (role.to_string(), script.name.clone());
        if self.current.get(&key) == Some(&hash) {
            return Ok(());
        }
        let file = self.path.join("scripts").join(format!("{hash}.rhai"));
        if !file.exists() {
            // From the compiled version, not the disk: the file may have changed since.
            write_atomic(&file, script.source().as_bytes())?;
            if !script.imports().is_empty() {
                let imports: Map<String, Value> =
                    script.imports().iter().map(|(name, text)| (name.clone(), json!(text))).collect();
                write_atomic(&file.with_extension("imports.json"), Value::Object(imports).to_string().as_bytes())?;
            }
        }
        append_line(
            &self.path.join("scripts/index.jsonl"),
            &json!({"step": step, "role": role, "path": script.name, "hash": hash}),
        )?;
        self.current.insert(key, hash);
        Ok(())
    }

    /// Records the versions in use of every script the experiment plays with.
    pub fn record_scripts(&mut self, step: u64, s: &ExperimentScripts) -> Result<()> {
        self.record_script(step, "env", s.env.script())?;
        self.record_script(step, "prompt", s.prompt.script())?;
        for r in &s.rewards {
            self.record_script(step, "reward", r.script())?;
        }
        Ok(())
    }

    pub fn metrics(&self, line: &Map<String, Value>) -> Result<()> {
        append_line(&self.path.join("metrics.jsonl"), &Value::Object(line.clone()))
    }

    /// An event line: `{"step", "time", "kind", "message", …extra}`.
    pub fn event(&self, step: u64, kind: &str, message: &str, extra: Map<String, Value>) -> Result<()> {
        let mut v = Map::new();
        v.insert("step".into(), json!(step));
        v.insert("time".into(), json!(now()));
        v.insert("kind".into(), json!(kind));
        v.insert("message".into(), json!(message));
        v.extend(extra);
        append_line(&self.path.join("events.jsonl"), &Value::Object(v))
    }

    pub fn event_value(&self, v: &Value) -> Result<()> {
        append_line(&self.path.join("events.jsonl"), v)
    }

    /// rollouts/<name>.jsonl, one trajectory per line, written atomically.
    pub fn rollouts(&self, name: &str, lines: &[Value]) -> Result<()> {
        let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
        write_atomic(&self.path.join("rollouts").join(format!("{name}.jsonl")), text.as_bytes())
    }

    pub fn checkpoint_dir(&self, step: u64) -> PathBuf {
        self.path.join("checkpoints").join(format!("step-{step:06}"))
    }

    /// Write a checkpoint: `fill` writes into a temp folder, which is renamed to step-N; then
    /// `latest` is replaced atomically; then checkpoints beyond the newest `keep` are deleted.
    pub fn save_checkpoint(&self, step: u64, keep: usize, fill: impl FnOnce(&Path) -> Result<()>) -> Result<PathBuf> {
        let ckpts = self.path.join("checkpoints");
        let tmp = ckpts.join(format!(".tmp-step-{step:06}"));
        let _ = fs::remove_dir_all(&tmp);
        fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        fill(&tmp)?;
        let dir = self.checkpoint_dir(step);
        let _ = fs::remove_dir_all(&dir);
        fs::rename(&tmp, &dir).with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        write_atomic(&ckpts.join("latest"), format!("step-{step:06}\n").as_bytes())?;
        let mut all: Vec<String> = fs::read_dir(&ckpts)?
            .filter_map(|e| e.ok().and_then(|e| e.file_name().into_string().ok()))
            .filter(|n| n.starts_with("step-"))
            .collect();
        all.sort();
        let excess = all.len().saturating_sub(keep.max(1));
        for old in &all[..excess] {
            let _ = fs::remove_dir_all(ckpts.join(old));
        }
        Ok(dir)
    }

    /// The scripts to resume `exp` with: each as on disk now, unless that version failed during
    /// this run or was refused (a `script_error` or `reload_error` event names it) or no longer
    /// loads, in which case the version last recorded for it in scripts/ (what the run was using).
    /// Returns notes on what was kept.
    pub fn resume_scripts(
        path: &Path,
        host: &std::sync::Arc<Host>,
        exp: &Experiment,
    ) -> Result<(ExperimentScripts, Vec<String>)> {
        let failed: HashSet<String> = read_jsonl(&path.join("events.jsonl"))?
            .into_iter()
            // Failed on real turns (`script_error`), or refused before it was used (`reload_error`).
            .filter(|e| e["kind"] == "script_error" || e["kind"] == "reload_error")
            .filter_map(|e| e["version"].as_str().map(str::to_string))
            .collect();
        let index = read_jsonl(&path.join("scripts/index.jsonl"))?;
        let mut notes = Vec::new();
        let mut pick = |role: &str, file: &Path| -> Result<std::sync::Arc<Script>> {
            let on_disk = host.compile(file);
            let full = file.canonicalize().unwrap_or_else(|_| file.to_path_buf());
            let name = crate::script::display_path(&full, host.project());
            let recorded = index.iter().rev().find(|l| {
                l["role"] == role
                    && l["path"] == name.as_str()
                    && l["hash"].as_str().is_some_and(|h| !failed.contains(h))
            });
            match (on_disk, recorded) {
                (Ok(s), _) if !failed.contains(s.version()) => Ok(s),
                (now, Some(line)) => {
                    let hash = line["hash"].as_str().unwrap_or_default();
                    let source = fs::read_to_string(path.join("scripts").join(format!("{hash}.rhai")))
                        .with_context(|| format!("reading the recorded version {hash} of {name}"))?;
                    let why = match now {
                        Ok(s) => format!("version {} failed during this run", s.version()),
                        Err(e) => format!("it does not load ({e})"),
                    };
                    notes.push(format!("{name} on disk is not resumed ({why}): keeping version {hash}"));
                    Ok(host.compile_source(file, &source)?)
                }
                (Ok(s), None) => Ok(s),
                (Err(e), None) => Err(e.into()),
            }
        };
        let env = EnvScript::from_script(pick("env", &exp.env)?)?;
        let prompt = PromptScript::from_script(pick("prompt", &exp.prompt)?)?;
        let rewards =
            exp.rewards.iter().map(|r| Ok(RewardScript::from_script(pick("reward", r)?)?)).collect::<Result<_>>()?;
        Ok((ExperimentScripts { env, prompt, rewards }, notes))
    }

    /// The newest complete checkpoint (what `latest` names).
    pub fn latest_checkpoint(path: &Path) -> Result<PathBuf> {
        let latest = path.join("checkpoints/latest");
        let name = fs::read_to_string(&latest).with_context(|| {
            format!(
                "{} has no checkpoint yet ({} is missing): start a new run instead",
                path.display(),
                latest.display()
            )
        })?;
        let name = name.trim();
        if !name.strip_prefix("step-").is_some_and(|n| n.len() == 6 && n.bytes().all(|b| b.is_ascii_digit())) {
            bail!("{}: {} names {name:?}, not a checkpoint like step-000012", path.display(), latest.display());
        }
        let dir = path.join("checkpoints").join(name);
        if !dir.join("state.json").exists() {
            bail!("{}: checkpoint {} is incomplete (no state.json)", path.display(), dir.display());
        }
        Ok(dir)
    }

    /// The step a checkpoint folder (step-000012) holds; its state.json must agree, so a forged
    /// or damaged state cannot make `--resume` drop the run's metrics.
    pub fn checkpoint_step(dir: &Path, state_step: u64) -> Result<u64> {
        let named =
            dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix("step-")).and_then(|n| n.parse().ok());
        match named {
            Some(n) if n == state_step && n > 0 => Ok(n),
            _ => bail!(
                "{}: state.json says step {state_step}, which does not match the checkpoint's folder; the checkpoint is damaged",
                dir.display()
            ),
        }
    }
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`), if known.
pub fn peak_rss_mb() -> Option<f64> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoints_publish_latest_and_keep_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(&dir.path().join("r")).unwrap();
        for step in 1..=3 {
            run.save_checkpoint(step, 2, |d| Ok(fs::write(d.join("state.json"), "{}")?)).unwrap();
        }
        let latest = RunDir::latest_checkpoint(&run.path).unwrap();
        assert!(latest.ends_with("step-000003"));
        assert!(!run.checkpoint_dir(1).exists() && run.checkpoint_dir(2).exists());
        assert!(RunDir::create(&run.path).is_ok(), "no settings.json yet, so not a run");
        run.write_settings(&json!({})).unwrap();
        assert!(RunDir::create(&run.path).unwrap_err().to_string().contains("--resume"));
    }

    #[test]
    fn reopen_drops_metrics_past_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let run = RunDir::create(dir.path()).unwrap();
        for s in 1..=4 {
            run.metrics(json!({"step": s}).as_object().unwrap()).unwrap();
        }
        RunDir::reopen(dir.path(), 2).unwrap();
        let text = fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        assert_eq!(text.lines().count(), 2);
    }

    #[test]
    fn the_index_records_a_revert_to_an_earlier_version() {
        let dir = tempfile::tempdir().unwrap();
        let host = Host::new(dir.path(), crate::script::Limits::default());
        let file = dir.path().join("rewards/r.rhai");
        let v1 = host.compile_source(&file, "fn shape(turn, reward) { reward }\n").unwrap();
        let v2 = host.compile_source(&file, "fn shape(turn, reward) { reward + 1.0 }\n").unwrap();
        let mut run = RunDir::create(&dir.path().join("run")).unwrap();
        for (step, s) in [(1, &v1), (2, &v1), (3, &v2), (5, &v1)] {
            run.record_script(step, "reward", s).unwrap();
        }
        let index = || read_jsonl(&dir.path().join("run/scripts/index.jsonl")).unwrap();
        let used: Vec<(u64, String)> =
            index().iter().map(|l| (l["step"].as_u64().unwrap(), l["hash"].as_str().unwrap().to_string())).collect();
        let (h1, h2) = (v1.version().to_string(), v2.version().to_string());
        assert_eq!(used, [(1, h1.clone()), (3, h2), (5, h1)], "step 5 went back to the first version");
        // A resumed run knows which version is in use: the same one is not recorded again.
        let mut again = RunDir::reopen(&dir.path().join("run"), 5).unwrap();
        again.record_script(6, "reward", &v1).unwrap();
        assert_eq!(index().len(), 3);
    }
}
