//! The sandbox: the one place a Rhai `Engine` is built ([`Host`]) under its [`Limits`], the import
//! resolver confined to the project's script folders, and compiled script versions ([`Script`]:
//! one self-contained AST plus the sha256 of its sources).
//!
//! Scripts get Rhai's standard library and the `rng::` helpers, nothing else: no files, network
//! or processes. `eval` is disabled, undefined variables and missing map keys are errors, and
//! every call runs under operation, depth, size and wall-clock limits.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rhai::packages::{Package, StandardPackage};
use rhai::{CallFnOptions, Dynamic, Engine, EvalAltResult, FuncArgs, Scope, AST};
use sha2::{Digest, Sha256};

use super::error::{display_path, ErrorKind, ScriptError};
use super::limits::Limits;
use super::resolver::{self, read_script, ConfinedResolver, SCRIPT_ROOTS};
use super::{rng_module, sandbox, stdlib};
use crate::rng::Rng;

/// A sandboxed engine bound to one project directory. Build it once and share it (`Arc`).
pub struct Host {
    engine: Engine,
    project: PathBuf,
    limits: Limits,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").field("project", &self.project).field("limits", &self.limits).finish()
    }
}

impl Host {
    /// A host for scripts under `project` (the folder holding envs/, prompts/, rewards/, scripts/).
    pub fn new(project: impl Into<PathBuf>, limits: Limits) -> Arc<Self> {
        let project = project.into();
        let project = project.canonicalize().unwrap_or(project);
        let mut engine = Engine::new_raw();
        engine.register_global_module(StandardPackage::new().as_shared_module());
        // Registered after the standard package, so its replacements win.
        engine.register_global_module(stdlib::module().into());
        engine.register_static_module("rng", rng_module::module().into());
        engine
            .set_max_operations(limits.max_operations)
            .set_max_call_levels(limits.max_call_levels)
            .set_max_expr_depths(limits.max_expr_depth, limits.max_expr_depth)
            .set_max_string_size(limits.max_string_size)
            .set_max_array_size(limits.max_array_size)
            .set_max_map_size(limits.max_map_size)
            .set_max_modules(64)
            .set_strict_variables(true)
            .set_fail_on_invalid_map_property(true)
            .disable_symbol("eval");
        engine.on_progress(sandbox::on_progress);
        engine.on_print(sandbox::emit);
        engine
            .on_debug(|s, src, pos| sandbox::emit(&format!("{}:{}: {s}", src.unwrap_or("?"), pos.line().unwrap_or(0))));
        engine.set_module_resolver(ConfinedResolver {
            project: project.clone(),
            max_script_bytes: limits.max_script_bytes,
        });
        Arc::new(Self { engine, project, limits })
    }

    /// A host for `script`, with the project directory found from its location: the parent of
    /// its envs/, prompts/, rewards/ or scripts/ folder, else the script's own folder.
    pub fn for_script(script: &Path, limits: Limits) -> Arc<Self> {
        Self::new(project_of(script), limits)
    }

    pub fn project(&self) -> &Path {
        &self.project
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Resolves a path as the user wrote it: absolute, relative to the working directory, or
    /// relative to the project.
    pub fn resolve_path(&self, path: &Path) -> PathBuf {
        if path.is_absolute() || path.exists() {
            path.to_path_buf()
        } else {
            self.project.join(path)
        }
    }

    /// Reads and compiles `path` with its imports embedded.
    pub fn compile(self: &Arc<Self>, path: &Path) -> Result<Arc<Script>, ScriptError> {
        let full = self.resolve_path(path);
        let full = full.canonicalize().unwrap_or(full);
        let name = display_path(&full, &self.project);
        let source = read_script(&full, self.limits.max_script_bytes)
            .map_err(|e| ScriptError::new(&name, format!("cannot load the script: {e}")).kind(ErrorKind::File))?;
        self.compile_source(&full, &source)
    }

    /// Compiles `source` as if read from `path` (tests and `new` use this directly). Imports are
    /// resolved now, under the call limits, and become part of the version.
    pub fn compile_source(self: &Arc<Self>, path: &Path, source: &str) -> Result<Arc<Script>, ScriptError> {
        let name = display_path(path, &self.project);
        let (compiled, imports) = resolver::compiling(&name, source, || {
            sandbox::run(&self.limits, || self.engine.compile_into_self_contained(&Scope::new(), source))
        });
        let mut ast = compiled.map_err(|err| {
            if let EvalAltResult::ErrorParsing(ref kind, pos) = *err {
                return ScriptError::at(&name, pos, format!("syntax error: {kind}")).kind(ErrorKind::Syntax);
            }
            ScriptError::from_eval(&name, &err)
        })?;
        ast.set_source(name.as_str());
        let mut hasher = Sha256::new();
        hasher.update(source.as_bytes());
        let mut sources = vec![path.to_path_buf()];
        for (p, text) in &imports {
            hasher.update(display_path(p, &self.project).as_bytes());
            hasher.update(text.as_bytes());
            sources.push(p.clone());
        }
        let hash = hex::encode(hasher.finalize());
        let imports = imports.into_iter().map(|(p, text)| (display_path(&p, &self.project), text)).collect();
        Ok(Arc::new(Script {
            host: self.clone(),
            path: path.to_path_buf(),
            name,
            ast,
            hash,
            sources,
            source: source.to_string(),
            imports,
        }))
    }
}

/// The project directory of a script path (see [`Host::for_script`]).
/// A script in a subfolder of a root (`scripts/learning/x.rhai`) belongs to the same project.
pub fn project_of(script: &Path) -> PathBuf {
    let full = script.canonicalize().unwrap_or_else(|_| script.to_path_buf());
    let dir = full.parent().map(Path::to_path_buf).unwrap_or_default();
    let root =
        dir.ancestors().find(|d| d.file_name().and_then(|n| n.to_str()).is_some_and(|n| SCRIPT_ROOTS.contains(&n)));
    match root.and_then(Path::parent) {
        Some(project) => project.to_path_buf(),
        None if dir.as_os_str().is_empty() => PathBuf::from("."),
        None => dir,
    }
}

/// One compiled version of a script: cheap to share (`Arc<Script>`), immutable.
pub struct Script {
    host: Arc<Host>,
    /// Where it was read from.
    pub path: PathBuf,
    /// The name used in messages (relative to the project).
    pub name: String,
    ast: AST,
    hash: String,
    /// The script and every file it imports (the watcher recompiles when any changes).
    pub sources: Vec<PathBuf>,
    source: String,
    /// The imported files as compiled in: (name relative to the project, source).
    imports: Vec<(String, String)>,
}

impl std::fmt::Debug for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Script").field("name", &self.name).field("hash", &self.hash).finish()
    }
}

impl Script {
    /// sha256 (hex) of the script and its imports.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// The short content hash used in logs and run directories (first 16 hex digits).
    pub fn version(&self) -> &str {
        &self.hash[..16]
    }

    pub fn host(&self) -> &Arc<Host> {
        &self.host
    }

    /// Whether the script defines `name` taking `arity` arguments.
    pub fn has_fn(&self, name: &str, arity: usize) -> bool {
        self.ast.iter_functions().any(|f| f.name == name && f.params.len() == arity)
    }

    /// An error naming each missing function with its expected parameters.
    pub fn require_fns(&self, fns: &[(&str, &[&str])]) -> Result<(), ScriptError> {
        let missing: Vec<String> = fns
            .iter()
            .filter(|(n, params)| !self.has_fn(n, params.len()))
            .map(|(n, params)| {
                let other = self.ast.iter_functions().find(|f| f.name == *n).map(|f| f.params.len());
                match other {
                    Some(k) => format!("`fn {n}({})` (found one taking {k} argument(s))", params.join(", ")),
                    None => format!("`fn {n}({})`", params.join(", ")),
                }
            })
            .collect();
        if missing.is_empty() {
            Ok(())
        } else {
            Err(ScriptError::new(&self.name, format!("missing {}", missing.join(" and "))))
        }
    }

    /// The source this version was compiled from (not re-read from disk).
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The imported files compiled into this version: (name relative to the project, source).
    pub fn imports(&self) -> &[(String, String)] {
        &self.imports
    }

    /// Calls a script function under the limits ([`sandbox::run`]); the value it returns is
    /// checked with everything it holds counted. `rng` is what `rng::` draws from during the
    /// call (absent: `rng::` functions fail, keeping render and friends deterministic).
    pub fn call(&self, name: &str, args: impl FuncArgs, rng: Option<&mut Rng>) -> Result<Dynamic, ScriptError> {
        let _rng = rng_module::RngGuard::lend(rng);
        let engine = &self.host.engine;
        let v = sandbox::run(&self.host.limits, || {
            engine.call_fn_with_options::<Dynamic>(CallFnOptions::new(), &mut Scope::new(), &self.ast, name, args)
        })
        .map_err(|e| {
            let mut err = ScriptError::from_eval(&self.name, &e);
            // Limit errors (operations, time, memory) carry no position: point at the
            // innermost function's definition instead.
            if err.line == 0 && err.path == self.name {
                let innermost = err.call_chain.last().and_then(|c| c.split(' ').next()).unwrap_or(name);
                if let Some((line, col)) = fn_position(&self.source, innermost) {
                    (err.line, err.col) = (line, col);
                }
            }
            err.version = self.version().to_string();
            err.context(format!("in {name}"))
        })?;
        self.check_value(name, &v)?;
        Ok(v)
    }

    /// Checks a value `fname` handed back (or left in its arguments, like an episode's state)
    /// against the size and depth limits, closures and curried values counted.
    pub fn check_value(&self, fname: &str, v: &Dynamic) -> Result<(), ScriptError> {
        sandbox::check_value(v, &self.host.limits)
            .map_err(|(kind, m)| self.error_in(fname, kind, format!("{fname}: {m}")))
    }

    /// An error about what `fname` did (a wrong return shape, a value too large), placed at the
    /// function's definition.
    pub fn error_in(&self, fname: &str, kind: ErrorKind, message: impl std::fmt::Display) -> ScriptError {
        let mut e = ScriptError::new(&self.name, message.to_string()).kind(kind);
        if let Some((line, col)) = fn_position(&self.source, fname) {
            (e.line, e.col) = (line, col);
        }
        e.version = self.version().to_string();
        e
    }
}

/// Where `fn name(` is defined in `source` (1-based line and column).
fn fn_position(source: &str, name: &str) -> Option<(usize, usize)> {
    let pattern = format!("fn {name}(");
    source.lines().enumerate().find_map(|(i, l)| l.find(&pattern).map(|c| (i + 1, c + 1)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_script_belongs_to_the_project_above_its_nearest_root_folder() {
        let p = std::env::temp_dir().join(format!("ragen-project-of-{}", std::process::id()));
        std::fs::create_dir_all(p.join("scripts/learning")).unwrap();
        std::fs::create_dir_all(p.join("elsewhere")).unwrap();
        let project = p.canonicalize().unwrap();
        assert_eq!(project_of(&p.join("scripts/x.rhai")), project);
        assert_eq!(project_of(&p.join("scripts/learning/x.rhai")), project);
        assert_eq!(project_of(&p.join("elsewhere/x.rhai")), project.join("elsewhere"));
        std::fs::remove_dir_all(&p).unwrap();
    }
}
