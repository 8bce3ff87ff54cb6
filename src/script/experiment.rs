//! Experiment scripts (`scripts/*.rhai`): `fn experiment()` names the env, the prompt template,
//! the reward shaping chain, the env parameters (and a held-out variant for validation) and the
//! training settings. Settings are passed through untouched; the trainer validates them.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::{Map, Value};

use super::engine::Host;
use super::env::{to_json, type_word, EnvScript};
use super::error::{ErrorKind, ScriptError};
use super::prompt::PromptScript;
use super::reward::RewardScript;

/// A loaded experiment: paths are resolved against the project directory.
#[derive(Clone, Debug, PartialEq)]
pub struct Experiment {
    pub path: PathBuf,
    /// Content hash of the experiment script itself (16 hex digits).
    pub version: String,
    pub env: PathBuf,
    pub prompt: PathBuf,
    pub rewards: Vec<PathBuf>,
    /// Env parameters for training (over the env's defaults).
    pub params: Map<String, Value>,
    /// Parameters of the held-out variant used for validation, if any.
    pub val_params: Option<Map<String, Value>>,
    /// Training settings as the script wrote them (keys are the trainer's setting names).
    pub settings: Map<String, Value>,
    /// The model this experiment is sized for (`--model` overrides it).
    pub model: Option<String>,
}

/// The env, prompt and reward scripts an experiment names, compiled.
#[derive(Clone, Debug)]
pub struct ExperimentScripts {
    pub env: EnvScript,
    pub prompt: PromptScript,
    pub rewards: Vec<RewardScript>,
}

const SHAPE: &str = "#{env: \"envs/x.rhai\", prompt: \"prompts/ragen.rhai\", rewards: [\"rewards/format_penalty.rhai\"], params: #{}, val_params: #{}, settings: #{}, model: \"smollm2-135m\"}";

impl Experiment {
    pub fn load(host: &Arc<Host>, path: &Path) -> Result<Self, ScriptError> {
        let script = host.compile(path)?;
        script.require_fns(&[("experiment", &[])])?;
        let v = script.call("experiment", (), None)?;
        let err = |m: String| {
            script.error_in(
                "experiment",
                ErrorKind::Contract,
                format!("experiment must return a map like {SHAPE}; {m}"),
            )
        };
        let Ok(Value::Object(mut m)) = to_json(&v) else {
            return Err(err(format!("got {}", type_word(&v))));
        };
        let file = |m: &mut Map<String, Value>, key: &str| -> Result<PathBuf, ScriptError> {
            let p = match m.remove(key) {
                Some(Value::String(s)) => s,
                None => return Err(err(format!("`{key}` is missing"))),
                Some(other) => return Err(err(format!("`{key}` must be a path string; got {other}"))),
            };
            // Confined like imports: a file under the project's script folders, nothing else.
            crate::script::confine(host.project(), &p, &format!("`{key}`: {p:?}"))
                .map_err(|m| script.error_in("experiment", ErrorKind::File, m))
        };
        let env = file(&mut m, "env")?;
        let prompt = file(&mut m, "prompt")?;
        let rewards = match m.remove("rewards") {
            None => Vec::new(),
            Some(Value::Array(a)) => {
                let mut out = Vec::new();
                for r in a {
                    let mut one = Map::new();
                    one.insert("rewards".into(), r);
                    out.push(file(&mut one, "rewards")?);
                }
                out
            }
            Some(other) => return Err(err(format!("`rewards` must be an array of paths; got {other}"))),
        };
        let mut map = |key: &str| -> Result<Option<Map<String, Value>>, ScriptError> {
            match m.remove(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Object(o)) => Ok(Some(o)),
                Some(other) => Err(err(format!("`{key}` must be a map; got {other}"))),
            }
        };
        let params = map("params")?.unwrap_or_default();
        let val_params = map("val_params")?;
        let settings = map("settings")?.unwrap_or_default();
        let model = match m.remove("model") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s),
            Some(other) => return Err(err(format!("`model` must be a model spec string; got {other}"))),
        };
        if let Some(k) = m.keys().next() {
            return Err(err(format!("unknown key `{k}`")));
        }
        Ok(Self {
            path: script.path.clone(),
            version: script.version().to_string(),
            env,
            prompt,
            rewards,
            params,
            val_params,
            settings,
            model,
        })
    }

    /// Compiles the scripts it names and checks `params`/`val_params` against the env's parameters.
    pub fn scripts(&self, host: &Arc<Host>) -> Result<ExperimentScripts, ScriptError> {
        let env = EnvScript::load(host, &self.env)?;
        env.params_from(&self.params)?;
        if let Some(v) = &self.val_params {
            env.params_from(v)?;
        }
        let prompt = PromptScript::load(host, &self.prompt)?;
        let rewards = self.rewards.iter().map(|r| RewardScript::load(host, r)).collect::<Result<_, _>>()?;
        Ok(ExperimentScripts { env, prompt, rewards })
    }
}
