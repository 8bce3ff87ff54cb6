//! The sandbox: the one place a Rhai `Engine` is built ([`Host`]), its [`Limits`], the import
//! resolver confined to the project's script folders, and compiled script versions ([`Script`]:
//! one self-contained AST plus the sha256 of its sources).
//!
//! Scripts get Rhai's standard library and the `rng::` helpers, nothing else: no files, network
//! or processes. `eval` is disabled, undefined variables and missing map keys are errors, and
//! every call runs under operation, depth, size and wall-clock limits.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rhai::packages::{Package, StandardPackage};
use rhai::{CallFnOptions, Dynamic, Engine, EvalAltResult, FuncArgs, Scope, AST};
use sha2::{Digest, Sha256};

use super::error::{display_path, ErrorKind, ScriptError};
use super::resolver::{self, read_script, ConfinedResolver};
use super::{rng_module, sandbox, stdlib};
use crate::rng::Rng;

/// The folders under the project directory that hold scripts; imports may only name files here.
pub const SCRIPT_ROOTS: [&str; 4] = ["envs", "prompts", "rewards", "scripts"];

/// Sandbox limits, applied to every call and every compile (imports included). README.md, "The
/// sandbox and its limits", lists them with their defaults.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Rhai operations per call, counted over the whole call including imported modules
    /// (roughly AST nodes visited; ~30 M/s).
    pub max_operations: u64,
    /// Nesting of script function calls (recursion depth).
    pub max_call_levels: usize,
    /// Nesting of expressions at global level and inside functions.
    pub max_expr_depth: usize,
    /// Bytes in one string; also all the strings one returned value or state holds together.
    pub max_string_size: usize,
    /// Elements in one array (nested ones counted).
    pub max_array_size: usize,
    /// Entries in one object map (nested ones counted).
    pub max_map_size: usize,
    /// Nesting depth of a value handed back to the host (a return value, an episode's state).
    pub max_depth: usize,
    /// Bytes a call may allocate and hold (counted by the allocator, see `script::Counted`).
    pub max_memory: usize,
    /// Bytes of `print`/`debug` output per call; the rest is dropped with a note.
    pub max_output: usize,
    /// Size of one script file.
    pub max_script_bytes: usize,
    /// Wall-clock budget of one call (and of one compile, imports included).
    pub call_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_operations: 20_000_000,
            max_call_levels: 32,
            max_expr_depth: 64,
            max_string_size: 1 << 20,
            max_array_size: 100_000,
            max_map_size: 10_000,
            max_depth: 32,
            max_memory: 256 << 20,
            max_output: 64 << 10,
            max_script_bytes: 1 << 20,
            call_timeout: Duration::from_secs(2),
        }
    }
}

impl Limits {
    /// The environment variable that raises (or lowers) limits for every command:
    /// `RAGEN_LIMITS="max_operations=50000000,call_timeout_ms=5000"`.
    pub const ENV: &'static str = "RAGEN_LIMITS";

    /// Native stack for a thread that runs scripts under these limits. Rhai clones, measures
    /// and drops nested values recursively, and a chain of closures, each capturing the last,
    /// grows in linear time as deep as `max_memory` lets it (100k nested arrays are bounded by
    /// `max_array_size` too). Measured on SmolLM2's build (2026-12-06): a chain holding 2 MiB
    /// dropped fine on an 8 MiB stack and one holding 4 MiB overflowed it, so a level needs 2–4
    /// times its heap bytes in stack; 8 times `max_memory` plus a base leaves a margin. Reserved,
    /// not committed: only the pages a deep value touches are ever backed. Unlimited memory
    /// (`max_memory=0`) gets the 4 GiB cap, which bounds nothing.
    pub fn stack_bytes(&self) -> usize {
        const BASE: usize = 64 << 20;
        const CAP: usize = 4 << 30;
        match self.max_memory {
            0 => CAP,
            m => m.saturating_mul(8).saturating_add(BASE).min(CAP),
        }
    }

    /// Runs `f` on a new thread named `name` with the stack scripts under these limits need.
    pub fn spawn<T: Send + 'static>(
        &self,
        name: &str,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> std::io::Result<std::thread::JoinHandle<T>> {
        std::thread::Builder::new().name(name.into()).stack_size(self.stack_bytes()).spawn(f)
    }

    /// The defaults with `RAGEN_LIMITS` applied (see [`Limits::with`]).
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(Self::ENV) {
            Ok(text) => Self::default().with(&text).map_err(|e| format!("{}: {e}", Self::ENV)),
            Err(_) => Ok(Self::default()),
        }
    }

    /// These limits with `key=value` pairs (comma-separated) applied; keys are the field names,
    /// and `call_timeout_ms` for the timeout. 0 means unlimited for the counts.
    pub fn with(mut self, assignments: &str) -> Result<Self, String> {
        for pair in assignments.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| format!("{pair:?}: expected key=value"))?;
            let n: u64 =
                value.trim().replace('_', "").parse().map_err(|_| format!("{key}: {value:?} is not a whole number"))?;
            let size = usize::try_from(n).map_err(|_| format!("{key}: {n} is too large"))?;
            match key.trim() {
                "max_operations" => self.max_operations = n,
                "max_call_levels" => self.max_call_levels = size,
                "max_expr_depth" => self.max_expr_depth = size,
                "max_string_size" => self.max_string_size = size,
                "max_array_size" => self.max_array_size = size,
                "max_map_size" => self.max_map_size = size,
                "max_depth" => self.max_depth = size,
                "max_memory" => self.max_memory = size,
                "max_output" => self.max_output = size,
                "max_script_bytes" => self.max_script_bytes = size,
                "call_timeout_ms" => self.call_timeout = Duration::from_millis(n),
                other => {
                    return Err(format!(
                        "unknown limit {other:?}; known: max_operations, max_call_levels, max_expr_depth, max_string_size, max_array_size, max_map_size, max_depth, max_memory, max_output, max_script_bytes, call_timeout_ms"
                    ))
                }
            }
        }
        Ok(self)
    }
}

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
pub fn project_of(script: &Path) -> PathBuf {
    let full = script.canonicalize().unwrap_or_else(|_| script.to_path_buf());
    let dir = full.parent().map(Path::to_path_buf).unwrap_or_default();
    match dir.file_name().and_then(|n| n.to_str()) {
        Some(n) if SCRIPT_ROOTS.contains(&n) => dir.parent().map(Path::to_path_buf).unwrap_or(dir),
        _ if dir.as_os_str().is_empty() => PathBuf::from("."),
        _ => dir,
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
