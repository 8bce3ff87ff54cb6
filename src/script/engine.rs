//! The sandbox: the one place a Rhai `Engine` is built ([`Host`]), its [`Limits`], the import
//! resolver confined to the project's script folders, and compiled script versions ([`Script`]:
//! one self-contained AST plus the sha256 of its sources).
//!
//! Scripts get Rhai's standard library and the `rng::` helpers, nothing else: no files, network
//! or processes. `eval` is disabled, undefined variables and missing map keys are errors, and
//! every call runs under operation, depth, size and wall-clock limits.
use std::cell::{Cell, RefCell};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rhai::packages::{Package, StandardPackage};
use rhai::{CallFnOptions, Dynamic, Engine, EvalAltResult, FuncArgs, Module, ModuleResolver, Position, Scope, AST};
use sha2::{Digest, Sha256};

use super::error::{display_path, ScriptError};
use super::rng_module;
use crate::rng::Rng;

/// The folders under the project directory that hold scripts; imports may only name files here.
pub const SCRIPT_ROOTS: [&str; 4] = ["envs", "prompts", "rewards", "scripts"];

/// Sandbox limits, applied to every call (and to compiling imported modules).
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Rhai operations per call (roughly AST nodes visited; ~30 M/s).
    pub max_operations: u64,
    /// Nesting of script function calls (recursion depth).
    pub max_call_levels: usize,
    /// Nesting of expressions at global level and inside functions.
    pub max_expr_depth: usize,
    /// Bytes in one string.
    pub max_string_size: usize,
    /// Elements in one array.
    pub max_array_size: usize,
    /// Entries in one object map.
    pub max_map_size: usize,
    /// Wall-clock budget of one call.
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
            call_timeout: Duration::from_secs(2),
        }
    }
}

thread_local! {
    /// Deadline of the call running on this thread (read by the engine's progress callback).
    static DEADLINE: Cell<Option<Instant>> = const { Cell::new(None) };
    /// Files read by the resolver during the compile running on this thread: (path, source).
    static IMPORTS: RefCell<Vec<(PathBuf, String)>> = const { RefCell::new(Vec::new()) };
}

/// Sets this thread's deadline for the duration of a call; restores the outer one after.
struct DeadlineGuard(Option<Instant>);

impl DeadlineGuard {
    fn start(timeout: Duration) -> Self {
        Self(DEADLINE.with(|d| d.replace(Some(Instant::now() + timeout))))
    }
}

impl Drop for DeadlineGuard {
    fn drop(&mut self) {
        DEADLINE.with(|d| d.set(self.0));
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
        engine.on_progress(|ops| {
            // Checking the clock every 1024 operations costs nothing measurable.
            if ops % 1024 == 0 && DEADLINE.with(|d| d.get()).is_some_and(|t| Instant::now() > t) {
                Some(Dynamic::UNIT)
            } else {
                None
            }
        });
        engine.on_print(|s| eprintln!("[script] {s}"));
        engine.on_debug(|s, src, pos| eprintln!("[script] {}:{}: {s}", src.unwrap_or("?"), pos.line().unwrap_or(0)));
        engine.set_module_resolver(ConfinedResolver { project: project.clone() });
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
        let source = std::fs::read_to_string(&full)
            .map_err(|e| ScriptError::new(&name, format!("cannot read the script: {e}")))?;
        self.compile_source(&full, &source)
    }

    /// Compiles `source` as if read from `path` (tests and `new` use this directly).
    pub fn compile_source(self: &Arc<Self>, path: &Path, source: &str) -> Result<Arc<Script>, ScriptError> {
        let name = display_path(path, &self.project);
        IMPORTS.with(|i| i.borrow_mut().clear());
        let _deadline = DeadlineGuard::start(self.limits.call_timeout);
        let compiled = self.engine.compile_into_self_contained(&Scope::new(), source);
        let imports = IMPORTS.with(|i| std::mem::take(&mut *i.borrow_mut()));
        let mut ast = compiled.map_err(|err| match *err {
            EvalAltResult::ErrorParsing(ref kind, pos) => ScriptError::at(&name, pos, format!("syntax error: {kind}")),
            ref other => {
                // Imports are resolved without a position: point at the `import` line ourselves.
                let mut e = ScriptError::from_eval(&name, other);
                if e.line == 0 || e.path != name {
                    if let Some((line, col)) = import_position(source, other) {
                        e.call_chain.insert(0, format!("import at {name}:{line}:{col}"));
                        if e.path == name {
                            (e.line, e.col) = (line, col);
                        }
                    }
                }
                e
            }
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
        Ok(Arc::new(Script {
            host: self.clone(),
            path: path.to_path_buf(),
            name,
            ast,
            hash,
            sources,
            source: source.to_string(),
        }))
    }
}

/// Finds `import "<path>"` in the source for an import failure (Rhai resolves without positions).
fn import_position(source: &str, err: &EvalAltResult) -> Option<(usize, usize)> {
    let needle = match err {
        EvalAltResult::ErrorModuleNotFound(p, ..) => p.clone(),
        EvalAltResult::ErrorInModule(p, ..) => p.clone(),
        // The resolver's own refusals start with `import "<path>"`.
        EvalAltResult::ErrorRuntime(m, ..) => m.to_string().strip_prefix("import \"")?.split('"').next()?.to_string(),
        _ => return None,
    };
    let stem = needle.trim_end_matches(".rhai");
    source.lines().enumerate().find_map(|(i, l)| {
        let at = l.find("import")?;
        l[at..].contains(stem).then_some((i + 1, at + 1))
    })
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

/// Imports name a file under one of [`SCRIPT_ROOTS`], relative to the project: `import "envs/grid" as grid;`.
struct ConfinedResolver {
    project: PathBuf,
}

impl ConfinedResolver {
    fn locate(&self, path: &str) -> Result<PathBuf, String> {
        let rel = Path::new(path);
        let roots = SCRIPT_ROOTS.map(|r| format!("{r}/")).join(", ");
        if rel.is_absolute() || path.starts_with('/') || path.contains('\\') {
            return Err(format!(
                "import \"{path}\": absolute paths are not allowed; name a file under {roots} relative to the project"
            ));
        }
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(format!(
                "import \"{path}\": `..` and `.` are not allowed in import paths; name a file under {roots}"
            ));
        }
        let first = rel.components().next().and_then(|c| c.as_os_str().to_str()).unwrap_or("");
        if !SCRIPT_ROOTS.contains(&first) || rel.components().count() < 2 {
            return Err(format!("import \"{path}\": imports must name a file under {roots} (e.g. \"envs/grid\")"));
        }
        let mut full = self.project.join(rel);
        if full.extension().is_none() {
            full.set_extension("rhai");
        }
        let canon = full.canonicalize().map_err(|_| format!("import \"{path}\": no such file {}", full.display()))?;
        let root = self.project.join(first).canonicalize().unwrap_or_else(|_| self.project.join(first));
        if !canon.starts_with(&root) {
            return Err(format!("import \"{path}\": the file lies outside {first}/ (through a link); imports must stay inside the script folders"));
        }
        Ok(canon)
    }
}

impl ModuleResolver for ConfinedResolver {
    fn resolve(
        &self,
        engine: &Engine,
        _source: Option<&str>,
        path: &str,
        pos: Position,
    ) -> Result<rhai::Shared<Module>, Box<EvalAltResult>> {
        let full = self.locate(path).map_err(|m| EvalAltResult::ErrorRuntime(m.into(), pos))?;
        let name = display_path(&full, &self.project);
        let text = std::fs::read_to_string(&full).map_err(|e| {
            EvalAltResult::ErrorRuntime(format!("import \"{path}\": cannot read {name}: {e}").into(), pos)
        })?;
        IMPORTS.with(|i| i.borrow_mut().push((full.clone(), text.clone())));
        let in_module = |err: Box<EvalAltResult>| Box::new(EvalAltResult::ErrorInModule(name.clone(), err, pos));
        let mut ast = engine.compile(&text).map_err(|e| in_module(Box::new(EvalAltResult::ErrorParsing(*e.0, e.1))))?;
        ast.set_source(name.as_str());
        let module = Module::eval_ast_as_new(Scope::new(), &ast, engine).map_err(in_module)?;
        Ok(module.into())
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

    /// Calls a script function under the limits. `rng` is what `rng::` draws from during the
    /// call (absent: `rng::` functions fail, keeping render and friends deterministic).
    pub fn call(&self, name: &str, args: impl FuncArgs, rng: Option<&mut Rng>) -> Result<Dynamic, ScriptError> {
        let _deadline = DeadlineGuard::start(self.host.limits.call_timeout);
        let _rng = rng_module::RngGuard::lend(rng);
        let mut scope = Scope::new();
        self.host
            .engine
            .call_fn_with_options::<Dynamic>(CallFnOptions::new(), &mut scope, &self.ast, name, args)
            .map_err(|e| {
                let mut err = ScriptError::from_eval(&self.name, &e);
                // Limit errors (operations, depth, sizes, time) carry no position: point at the
                // innermost function's definition instead.
                if err.line == 0 && err.path == self.name {
                    let innermost = err.call_chain.last().and_then(|c| c.split(' ').next()).unwrap_or(name);
                    if let Some((line, col)) = fn_position(&self.source, innermost) {
                        (err.line, err.col) = (line, col);
                    }
                }
                err.context(format!("in {name}"))
            })
    }
}

/// Where `fn name(` is defined in `source` (1-based line and column).
fn fn_position(source: &str, name: &str) -> Option<(usize, usize)> {
    let pattern = format!("fn {name}(");
    source.lines().enumerate().find_map(|(i, l)| l.find(&pattern).map(|c| (i + 1, c + 1)))
}
