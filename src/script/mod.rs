//! The Rhai host: a sandboxed engine ([`Host`]) with limits, a confined import resolver and
//! self-contained compiled versions ([`Script`], content-hashed); the typed bindings for
//! environments ([`EnvScript`]), prompt templates ([`PromptScript`]), reward shaping
//! ([`RewardScript`]) and experiments ([`Experiment`]); `--param` parsing; and the live-reload
//! [`Watcher`]. Errors are [`ScriptError`]s located as `path:line:col`.
mod engine;
mod error;
mod rng_module;

pub use engine::{project_of, Host, Limits, Script, SCRIPT_ROOTS};
pub use error::ScriptError;
mod env;
pub mod params;

pub use env::{EnvInfo, EnvScript, Episode, StepOutcome};
pub use params::parse_assignment;
mod experiment;
mod prompt;
mod reward;

pub use experiment::{Experiment, ExperimentScripts};
pub use prompt::{PromptScript, TurnContext};
pub use reward::{shape_all, RewardScript};
pub mod validate;
mod watch;

pub use validate::{Loaded, Role};
pub use watch::{Update, WatchMode, Watcher};
