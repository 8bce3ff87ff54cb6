//! The scripts a run plays with while their files are edited: the version in use of each, and
//! the version each live edit replaced. The watcher compiles and smoke-tests an edit before it
//! is swapped in, but no smoke test plays every state, so a version that then fails on real
//! turns is rolled back to the one it replaced.
use std::path::Path;
use std::sync::Arc;

use super::engine::{Host, Script};
use super::error::ScriptError;
use super::experiment::{Experiment, ExperimentScripts};
use super::validate::{Loaded, Role};
use super::watch::{WatchMode, Watcher};

/// A live edit swapped in: the script's name and its versions before and after.
pub struct Swapped {
    pub name: String,
    pub from: String,
    pub to: String,
}

/// What a rollback put back: the failing script's path and the version restored.
pub struct RolledBack {
    pub path: std::path::PathBuf,
    pub restored: String,
}

/// The versions in use (`current`) and the ones live edits replaced (at most one per file).
pub struct LiveScripts {
    pub current: ExperimentScripts,
    replaced: Vec<Loaded>,
}

impl LiveScripts {
    pub fn new(current: ExperimentScripts) -> Self {
        Self { current, replaced: Vec::new() }
    }

    /// Puts an edited version in place of the one in use at `path`, remembering that one.
    pub fn swap(&mut self, path: &Path, loaded: Loaded) -> Swapped {
        if let Some(old) = self.current.loaded_at(path) {
            self.replaced.retain(|r| !same_file(loaded_path(r), path));
            self.replaced.push(old);
        }
        let from = self.current.version_at(path);
        let name = self.current.put(path, loaded);
        Swapped { name, from, to: self.current.version_at(path) }
    }

    /// When `e` comes from a version a live edit swapped in, puts back the version it replaced.
    /// `None`: the failing version is not one a swap brought in (the run cannot go on with it).
    pub fn roll_back(&mut self, e: &ScriptError) -> Option<RolledBack> {
        let path = self.current.all().find(|x| x.version() == e.version)?.path.clone();
        let at = self.replaced.iter().position(|r| same_file(loaded_path(r), &path))?;
        let old = self.replaced.remove(at);
        let restored = old.version();
        self.current.put(&path, old);
        Some(RolledBack { path, restored })
    }
}

impl ExperimentScripts {
    /// The env's, the prompt's and each reward's compiled script, in that order.
    pub fn all(&self) -> impl Iterator<Item = &Arc<Script>> {
        [self.env.script(), self.prompt.script()].into_iter().chain(self.rewards.iter().map(|r| r.script()))
    }

    /// The version in use for the script at `path` ("" when the experiment names no such file).
    pub fn version_at(&self, path: &Path) -> String {
        self.all().find(|x| same_file(&x.path, path)).map(|x| x.version().to_string()).unwrap_or_default()
    }

    fn loaded_at(&self, path: &Path) -> Option<Loaded> {
        if same_file(&self.env.script().path, path) {
            return Some(Loaded::Env(self.env.clone()));
        }
        if same_file(&self.prompt.script().path, path) {
            return Some(Loaded::Prompt(self.prompt.clone()));
        }
        self.rewards.iter().find(|r| same_file(&r.script().path, path)).map(|r| Loaded::Reward(r.clone()))
    }

    /// Puts `loaded` in its place; returns the script's name.
    fn put(&mut self, path: &Path, loaded: Loaded) -> String {
        match loaded {
            Loaded::Env(e) => {
                self.env = e;
                self.env.script().name.clone()
            }
            Loaded::Prompt(p) => {
                self.prompt = p;
                self.prompt.script().name.clone()
            }
            Loaded::Reward(r) => match self.rewards.iter_mut().find(|x| same_file(&x.script().path, path)) {
                Some(slot) => {
                    *slot = r;
                    slot.script().name.clone()
                }
                None => path.display().to_string(),
            },
            Loaded::Experiment(_) => path.display().to_string(),
        }
    }
}

impl Experiment {
    /// A watcher on the env, prompt and reward scripts this experiment names: OS file events
    /// where they work, re-reading every second where they do not (some containers).
    pub fn watch(&self, host: &Arc<Host>) -> anyhow::Result<Watcher> {
        let mut files = vec![
            (self.env.clone(), Role::Env, self.params.clone()),
            (self.prompt.clone(), Role::Prompt, self.params.clone()),
        ];
        files.extend(self.rewards.iter().map(|r| (r.clone(), Role::Reward, self.params.clone())));
        Watcher::new(host.clone(), files.clone(), WatchMode::Events)
            .or_else(|_| Watcher::new(host.clone(), files, WatchMode::Poll(std::time::Duration::from_secs(1))))
    }
}

fn loaded_path(l: &Loaded) -> &Path {
    match l {
        Loaded::Env(s) => &s.script().path,
        Loaded::Prompt(s) => &s.script().path,
        Loaded::Reward(s) => &s.script().path,
        Loaded::Experiment(x) => &x.path,
    }
}

fn same_file(a: &Path, b: &Path) -> bool {
    a == b || matches!((a.canonicalize(), b.canonicalize()), (Ok(x), Ok(y)) if x == y)
}
