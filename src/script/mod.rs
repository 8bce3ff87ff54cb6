//! The Rhai host: a sandboxed engine ([`Host`]) with limits, a confined import resolver and
//! self-contained compiled versions ([`Script`], content-hashed); the typed bindings for
//! environments ([`EnvScript`]), prompt templates ([`PromptScript`]), reward shaping
//! ([`RewardScript`]) and experiments ([`Experiment`]); `--param` parsing; and the live-reload
//! [`Watcher`]. Errors are [`ScriptError`]s located as `path:line:col`.
/// Declares a kind of script (env, prompt template, reward shaping): a cheap-to-clone handle on
/// one compiled version, the functions it must define, and `load`/`from_script`/`script`/`version`.
/// One declaration serves the three kinds so their loading cannot drift apart.
macro_rules! script_role {
    ($(#[doc = $doc:literal])* $name:ident requires [$(($f:literal, [$($arg:literal),*])),* $(,)?]) => {
        $(#[doc = $doc])*
        #[derive(Clone, Debug)]
        pub struct $name(std::sync::Arc<$crate::script::Script>);

        impl $name {
            /// The functions this kind of script must define, with their parameters.
            pub const REQUIRED: &'static [(&'static str, &'static [&'static str])] = &[$(($f, &[$($arg),*])),*];

            /// Compiles `path` (imports embedded) and checks the required functions.
            pub fn load(
                host: &std::sync::Arc<$crate::script::Host>,
                path: &std::path::Path,
            ) -> Result<Self, $crate::script::ScriptError> {
                Self::from_script(host.compile(path)?)
            }

            /// Checks the required functions are present.
            pub fn from_script(script: std::sync::Arc<$crate::script::Script>) -> Result<Self, $crate::script::ScriptError> {
                script.require_fns(Self::REQUIRED)?;
                Ok(Self(script))
            }

            pub fn script(&self) -> &std::sync::Arc<$crate::script::Script> {
                &self.0
            }

            /// The content hash (16 hex digits).
            pub fn version(&self) -> &str {
                self.0.version()
            }
        }
    };
}

mod engine;
mod error;
mod limits;
pub mod memory;
mod resolver;
mod rng_module;
mod sandbox;
mod stdlib;

pub use engine::{project_of, Host, Script};
pub use error::{display_path, printable, ErrorKind, ScriptError};
pub use limits::Limits;
pub use memory::Counted;
pub use resolver::{confine, read_script, MAX_IMPORT_DEPTH, SCRIPT_ROOTS};
mod env;
pub mod params;
pub mod pattern;

pub use env::{EnvInfo, EnvScript, Episode, StepOutcome};
pub use params::parse_assignment;
mod experiment;
mod live;
mod prompt;
mod reward;

pub use experiment::{Experiment, ExperimentScripts};
pub use live::{LiveScripts, RolledBack, Swapped};
pub use prompt::{PromptScript, TurnContext};
pub use reward::{apply_and_shape, shape_all, with_edit, RewardScript};
pub mod validate;
mod watch;

pub use validate::{Loaded, Role};
pub use watch::{Update, WatchMode, Watcher};
pub mod bench;
pub mod check;
pub mod turn;
