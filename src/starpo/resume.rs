//! How a training run is started and continued: the settings resolved once from the preset, the
//! experiment script and the flags; the record of them in settings.json; and the checkpoint a
//! killed run resumes from, which continues with the recorded settings and model.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::rundir::{write_atomic, RunDir};
use super::settings::{Algo, Preset, Settings};

/// Preset → the experiment script's settings → `--algo` → `--set` flags → validate. Command-line
/// flags beat the script, so `--algo ppo` works on a script that chose GRPO.
pub fn resolve_settings(
    preset: Preset,
    algo: Option<Algo>,
    script: &Map<String, Value>,
    script_path: &Path,
    sets: &[String],
) -> Result<Settings> {
    let mut s = Settings::preset(preset);
    s.apply_map(script, &script_path.display().to_string())?;
    if let Some(a) = algo {
        s.apply_algo(a);
    }
    for flag in sets {
        s.apply_flag(flag)?;
    }
    s.validate()?;
    Ok(s)
}

/// A training run's settings.json (docs/contracts.md "The run directory"): what it trains, with
/// which settings, and how they were asked for.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRecord {
    pub settings: Settings,
    pub experiment: PathBuf,
    pub env: PathBuf,
    pub prompt: PathBuf,
    pub rewards: Vec<PathBuf>,
    /// The env parameters it trains on (`--param` flags included), and the held-out variant's.
    pub params: Map<String, Value>,
    pub val_params: Option<Map<String, Value>>,
    /// The model spec as given, and where it was loaded from.
    pub model: String,
    pub model_source: String,
    pub preset: Preset,
    pub algo: Option<Algo>,
    pub sets: Vec<String>,
}

impl RunRecord {
    pub fn read(run: &Path) -> Result<Self> {
        let saved = RunDir::read_settings(run)?;
        serde_json::from_value(saved)
            .with_context(|| format!("{}: settings.json is not a training run's, or not this version's", run.display()))
    }

    pub fn write(&self, run: &RunDir) -> Result<()> {
        write_atomic(&run.path.join("settings.json"), serde_json::to_string_pretty(self)?.as_bytes())
    }

    /// Refuses the flags that would change what a resumed run trains, saying why (`--set` and
    /// `--steps` still apply). A flag that changes nothing (the model it already uses, the
    /// `--algo` its settings already follow) is accepted, so a resume command may repeat the
    /// start command's flags.
    pub fn refuse(&self, preset: Option<Preset>, algo: Option<Algo>, model: Option<&str>, params: bool) -> Result<()> {
        let why = "a resumed run continues with the settings and model it was started with (settings.json)";
        let name = |v: Value| v.as_str().map(String::from).unwrap_or_default();
        if params {
            bail!("--param and --val-param cannot apply to --resume: {why}, env parameters included");
        }
        if let Some(p) = preset {
            bail!(
                "--preset {} cannot apply to --resume: {why}; change single settings with --set",
                name(serde_json::json!(p))
            );
        }
        if let Some(a) = algo {
            let mut changed = self.settings.clone();
            changed.apply_algo(a);
            if changed != self.settings {
                bail!("--algo {} cannot apply to --resume: {why}, and its advantage estimator differs (a critic cannot appear or vanish mid-run)", name(serde_json::json!(a)));
            }
        }
        match model {
            Some(m) if m != self.model => bail!(
                "--model {m} cannot apply to --resume: {why}, and this run trains {}; start a new run to train another model",
                self.model
            ),
            _ => Ok(()),
        }
    }
}

/// The checkpointed loop state besides weights and optimiser moments.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoopState {
    pub step: u64,
    pub rng: [u64; 4],
    pub time: f64,
}

/// A run to continue: its record and its newest complete checkpoint.
pub struct Resume {
    pub record: RunRecord,
    pub checkpoint: PathBuf,
    pub state: LoopState,
}

impl Resume {
    pub fn open(run: &Path) -> Result<Self> {
        let record = RunRecord::read(run)?;
        let checkpoint = RunDir::latest_checkpoint(run)?;
        let file = checkpoint.join("state.json");
        let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
        let state: LoopState = serde_json::from_str(&text).with_context(|| format!("reading {}", file.display()))?;
        RunDir::checkpoint_step(&checkpoint, state.step)?;
        Ok(Self { record, checkpoint, state })
    }
}
