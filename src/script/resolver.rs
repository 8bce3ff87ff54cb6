//! Where script source comes from: [`read_script`] (regular files only, size-capped, never
//! blocking on a FIFO or device) and the import resolver, confined to the project's script
//! folders and active only while a script is being compiled. Imports are resolved once, at
//! compile time, into the script's self-contained AST and its content hash; an `import` whose
//! path is computed at run time reaches the resolver during a call and is refused, so code can
//! never change under a version. Cycles are refused by name, nesting by depth.
use std::cell::RefCell;
use std::io::Read;
use std::path::{Component, Path, PathBuf};

use rhai::{Engine, EvalAltResult, Module, ModuleResolver, Position, Scope};

use super::error::display_path;

/// The folders under the project directory that hold scripts; imports may only name files here.
pub const SCRIPT_ROOTS: [&str; 4] = ["envs", "prompts", "rewards", "scripts"];

/// Imports nested deeper than this are refused (each level is a Rhai evaluation on the stack).
pub const MAX_IMPORT_DEPTH: usize = 8;

/// One compile in progress on this thread: the files it read (path, source), in order, and the
/// chain of imports being resolved now (to name a cycle).
#[derive(Default)]
pub(crate) struct Compiling {
    pub files: Vec<(PathBuf, String)>,
    /// (name, source) of the files being compiled now, outermost first.
    chain: Vec<(String, String)>,
}

thread_local! {
    static COMPILING: RefCell<Option<Compiling>> = const { RefCell::new(None) };
}

/// Runs the compile of `root` (its name) with the resolver active; returns its result and the
/// files it imported.
pub(crate) fn compiling<T>(root: &str, source: &str, f: impl FnOnce() -> T) -> (T, Vec<(PathBuf, String)>) {
    let start = Compiling { files: Vec::new(), chain: vec![(root.to_string(), source.to_string())] };
    let outer = COMPILING.with(|c| c.borrow_mut().replace(start));
    let out = f();
    let done = COMPILING.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer));
    (out, done.map(|c| c.files).unwrap_or_default())
}

/// Reads a script file: a regular file (not a FIFO, device or directory) of at most `max_bytes`,
/// in UTF-8. Opening does not block (`O_NONBLOCK`), and the type is checked on the open file.
pub fn read_script(path: &Path, max_bytes: usize) -> Result<String, String> {
    let mut opts = std::fs::OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let meta = file.metadata().map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let mut bytes = Vec::new();
    file.take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() > max_bytes {
        return Err(format!("{} is larger than {max_bytes} bytes (Limits::max_script_bytes)", path.display()));
    }
    String::from_utf8(bytes).map_err(|_| format!("{} is not UTF-8 text", path.display()))
}

/// `path` as a file under one of [`SCRIPT_ROOTS`] of `project`, relative to it: no absolute
/// paths, no `..`, no links out of the folder. `what` names the path in messages.
pub fn confine(project: &Path, path: &str, what: &str) -> Result<PathBuf, String> {
    let rel = Path::new(path);
    let roots = SCRIPT_ROOTS.map(|r| format!("{r}/")).join(", ");
    if rel.is_absolute() || path.starts_with('/') || path.contains('\\') {
        return Err(format!(
            "{what}: absolute paths are not allowed; name a file under {roots} relative to the project"
        ));
    }
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return Err(format!("{what}: `..` and `.` are not allowed; name a file under {roots}"));
    }
    let first = rel.components().next().and_then(|c| c.as_os_str().to_str()).unwrap_or("");
    if !SCRIPT_ROOTS.contains(&first) || rel.components().count() < 2 {
        return Err(format!("{what}: name a file under {roots} (e.g. \"envs/grid\")"));
    }
    let mut full = project.join(rel);
    if full.extension().is_none() {
        full.set_extension("rhai");
    }
    let canon = full.canonicalize().map_err(|_| format!("{what}: no such file {}", display_path(&full, project)))?;
    let root = project.join(first).canonicalize().unwrap_or_else(|_| project.join(first));
    if !canon.starts_with(&root) {
        return Err(format!(
            "{what}: the file lies outside {first}/ (through a link); scripts must stay inside the script folders"
        ));
    }
    Ok(canon)
}

/// Imports name a file under one of [`SCRIPT_ROOTS`], relative to the project: `import "envs/grid" as grid;`.
pub(crate) struct ConfinedResolver {
    pub project: PathBuf,
    pub max_script_bytes: usize,
}

impl ModuleResolver for ConfinedResolver {
    fn resolve(
        &self,
        engine: &Engine,
        _source: Option<&str>,
        path: &str,
        pos: Position,
    ) -> Result<rhai::Shared<Module>, Box<EvalAltResult>> {
        let what = format!("import \"{path}\"");
        // Rhai resolves imports at compile time without a position: find the line ourselves.
        let (importer, pos) = COMPILING.with(|c| {
            let c = c.borrow();
            let importer = c.as_ref().and_then(|c| c.chain.last());
            let at = importer.and_then(|(_, text)| import_position(text, path));
            (importer.map(|(n, _)| n.clone()), if pos.is_none() { at.unwrap_or(pos) } else { pos })
        });
        let refuse = |m: String| Box::new(EvalAltResult::ErrorRuntime(m.into(), pos));
        if importer.is_none() {
            return Err(refuse(format!(
                "{what}: the path is computed at run time; write it as a constant string so it is part of the script's version"
            )));
        }
        let full = confine(&self.project, path, &what).map_err(refuse)?;
        let name = display_path(&full, &self.project);
        let entered = COMPILING.with(|c| match c.borrow_mut().as_mut() {
            None => Ok(()),
            Some(c) if c.chain.iter().any(|(n, _)| *n == name) => {
                let chain: Vec<&str> = c.chain.iter().map(|(n, _)| n.as_str()).collect();
                Err(format!("{what}: import cycle {} → {name}", chain.join(" → ")))
            }
            Some(c) if c.chain.len() > MAX_IMPORT_DEPTH => {
                Err(format!("{what}: imports nest deeper than {MAX_IMPORT_DEPTH} levels"))
            }
            Some(c) => {
                c.chain.push((name.clone(), String::new()));
                Ok(())
            }
        });
        entered.map_err(refuse)?;
        let out = self.load(engine, path, &full, &name, pos);
        COMPILING.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.chain.pop();
            }
        });
        out
    }
}

impl ConfinedResolver {
    /// Reads, compiles (its own imports embedded) and evaluates one imported module.
    fn load(
        &self,
        engine: &Engine,
        path: &str,
        full: &Path,
        name: &str,
        pos: Position,
    ) -> Result<rhai::Shared<Module>, Box<EvalAltResult>> {
        let text = read_script(full, self.max_script_bytes)
            .map_err(|e| EvalAltResult::ErrorRuntime(format!("import \"{path}\": {e}").into(), pos))?;
        COMPILING.with(|c| {
            if let Some(c) = c.borrow_mut().as_mut() {
                c.files.push((full.to_path_buf(), text.clone()));
                if let Some(last) = c.chain.last_mut() {
                    last.1 = text.clone();
                }
            }
        });
        let in_module = |err: Box<EvalAltResult>| Box::new(EvalAltResult::ErrorInModule(name.to_string(), err, pos));
        let mut ast = engine.compile_into_self_contained(&Scope::new(), &text).map_err(in_module)?;
        ast.set_source(name);
        let module = Module::eval_ast_as_new(Scope::new(), &ast, engine).map_err(in_module)?;
        Ok(module.into())
    }
}

/// Where `import "<path>"` is written in `source` (1-based line and column of `import`).
pub(crate) fn import_position(source: &str, path: &str) -> Option<Position> {
    let stem = path.trim_end_matches(".rhai");
    source.lines().enumerate().find_map(|(i, l)| {
        let at = l.find("import")?;
        l[at..].contains(stem).then(|| Position::new(saturate(i + 1), saturate(at + 1)))
    })
}

fn saturate(n: usize) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}
