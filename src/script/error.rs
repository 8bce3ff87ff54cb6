//! `ScriptError`: every script failure as `path:line:col: message`, with the chain of script
//! functions the error passed through (innermost last), so an author can find the line at once.
use std::fmt;
use std::path::Path;

use rhai::{EvalAltResult, Position};

/// Why the progress callback stopped a call: the `ErrorTerminated` token, read back by
/// `ScriptError::from_eval` to tell the kinds apart.
pub(crate) const STOP_TIME: &str = "time";
pub(crate) const STOP_MEMORY: &str = "memory";
pub(crate) const STOP_OPERATIONS: &str = "operations";
/// Prefix of the token of a caught panic (the panic message follows).
pub(crate) const STOP_PANIC: &str = "panic: ";

/// What went wrong, for callers that branch on it (and tests that assert it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The source does not parse.
    Syntax,
    /// The script failed while running: `throw`, a type error, a missing variable or function.
    Runtime,
    /// The call ran past `Limits::max_operations`.
    Operations,
    /// The call ran past `Limits::call_timeout`.
    Timeout,
    /// The call allocated past `Limits::max_memory`.
    Memory,
    /// A string, array or map (or a value handed back, captured values counted) grew past its
    /// size limit.
    Size,
    /// Recursion past `Limits::max_call_levels`, or a value nested past `Limits::max_depth`.
    Depth,
    /// An import was refused: outside the script folders, computed at run time, a cycle, too
    /// deep, or not found.
    Import,
    /// The script file cannot be used: unreadable, not a regular file, too large, outside the
    /// project's script folders.
    File,
    /// The script broke its contract with the host: a missing function, a wrong return shape,
    /// a non-finite reward, an unknown parameter.
    Contract,
    /// The host itself failed on this input (a bug, caught at the sandbox boundary).
    Panic,
}

/// A script failure located in its source file.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptError {
    pub kind: ErrorKind,
    /// The version (16 hex digits) of the script whose call failed; empty when the failure is
    /// not a call's (a compile, a missing file).
    pub version: String,
    /// The script's path as the user named it (relative to the project when possible).
    pub path: String,
    /// 1-based; 0 when the failure has no position (e.g. a wrong return shape).
    pub line: usize,
    pub col: usize,
    pub message: String,
    /// Script functions the error passed through, outermost first: `"step (envs/x.rhai:12:5)"`.
    pub call_chain: Vec<String>,
}

impl std::error::Error for ScriptError {}

impl fmt::Display for ScriptError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.line > 0 {
            write!(f, "{}:{}:{}: {}", self.path, self.line, self.col, self.message)?;
        } else {
            write!(f, "{}: {}", self.path, self.message)?;
        }
        for call in &self.call_chain {
            write!(f, "\n  in {call}")?;
        }
        Ok(())
    }
}

impl ScriptError {
    /// Where the error is and what kind, as the fields of a run's event.
    pub fn fields(&self) -> serde_json::Map<String, serde_json::Value> {
        let kind = format!("{:?}", self.kind).to_lowercase();
        let v = serde_json::json!({"path": self.path, "line": self.line, "col": self.col, "error": kind, "version": self.version});
        v.as_object().cloned().unwrap_or_default()
    }

    /// An error about the script as a whole (missing function, wrong shape, bad parameter).
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind: ErrorKind::Contract,
            version: String::new(),
            path: path.into(),
            line: 0,
            col: 0,
            message: printable_cut(&message.into(), MAX_MESSAGE),
            call_chain: Vec::new(),
        }
    }

    /// The same error with another kind.
    pub fn kind(mut self, kind: ErrorKind) -> Self {
        self.kind = kind;
        self
    }

    pub fn at(path: impl Into<String>, pos: Position, message: impl Into<String>) -> Self {
        let mut e = Self::new(path, message);
        e.set_pos(pos);
        e
    }

    fn set_pos(&mut self, pos: Position) {
        self.line = pos.line().unwrap_or(0);
        self.col = pos.position().unwrap_or(if self.line > 0 { 1 } else { 0 });
    }

    /// Unwraps Rhai's nested `ErrorInFunctionCall`/`ErrorInModule` layers: the innermost error
    /// gives the location and message, the layers give the call chain. `path` is the file of the
    /// script that was called; errors inside imported modules carry their own source.
    pub fn from_eval(path: &str, err: &EvalAltResult) -> Self {
        let mut chain = Vec::new();
        let mut cur = err;
        let mut file = path.to_string();
        // The innermost call site: the place of an error that has none of its own (one raised
        // inside a standard function, such as `range(0, 10, 0)`).
        let mut call_site = None;
        loop {
            match cur {
                EvalAltResult::ErrorInFunctionCall(name, src, inner, pos) => {
                    chain.push(format!("{name} (called at {})", loc(&file, *pos)));
                    if !pos.is_none() {
                        call_site = Some((file.clone(), *pos));
                    }
                    if !src.is_empty() {
                        file = src.clone();
                    }
                    cur = inner;
                }
                EvalAltResult::ErrorInModule(name, inner, pos) => {
                    chain.push(format!("module '{name}' (imported at {})", loc(&file, *pos)));
                    file = name.clone();
                    cur = inner;
                }
                _ => break,
            }
        }
        let (file, pos) = match call_site {
            Some(site) if cur.position().is_none() => site,
            _ => (file, cur.position()),
        };
        let mut e = Self::at(file, pos, describe(cur)).kind(kind_of(cur));
        e.call_chain = chain;
        e
    }

    /// Prefixes the message, e.g. with the function being called: "step: …".
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
}

fn kind_of(err: &EvalAltResult) -> ErrorKind {
    match err {
        EvalAltResult::ErrorParsing(..) => ErrorKind::Syntax,
        EvalAltResult::ErrorTooManyOperations(..) => ErrorKind::Operations,
        EvalAltResult::ErrorStackOverflow(..) => ErrorKind::Depth,
        EvalAltResult::ErrorDataTooLarge(..) => ErrorKind::Size,
        EvalAltResult::ErrorTooManyModules(..) | EvalAltResult::ErrorModuleNotFound(..) => ErrorKind::Import,
        EvalAltResult::ErrorTerminated(token, ..) => match token.clone().into_string().unwrap_or_default().as_str() {
            STOP_TIME => ErrorKind::Timeout,
            STOP_MEMORY => ErrorKind::Memory,
            STOP_OPERATIONS => ErrorKind::Operations,
            t if t.starts_with(STOP_PANIC) => ErrorKind::Panic,
            _ => ErrorKind::Runtime,
        },
        // The import resolver's refusals start with `import "<path>"`.
        EvalAltResult::ErrorRuntime(v, ..) if v.clone().into_string().is_ok_and(|m| m.starts_with("import \"")) => {
            ErrorKind::Import
        }
        _ => ErrorKind::Runtime,
    }
}

/// Messages are cut to this many bytes (a script can throw a megabyte).
const MAX_MESSAGE: usize = 2000;

/// `text` safe for a terminal: control characters other than newline and tab escaped (`\u{1b}`).
pub fn printable(text: &str) -> String {
    printable_cut(text, usize::MAX)
}

/// [`printable`], cut at `max` bytes with an ellipsis.
pub(crate) fn printable_cut(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max));
    for c in text.chars() {
        if out.len() >= max {
            out.push('…');
            break;
        }
        if c.is_control() && c != '\n' && c != '\t' {
            out.extend(c.escape_unicode());
        } else {
            out.push(c);
        }
    }
    out
}

fn loc(file: &str, pos: Position) -> String {
    match (pos.line(), pos.position()) {
        (Some(l), Some(c)) => format!("{file}:{l}:{c}"),
        (Some(l), None) => format!("{file}:{l}"),
        _ => file.to_string(),
    }
}

/// Rhai's message, lowercased at the start, with a hint for the limits a sandbox user hits.
fn describe(err: &EvalAltResult) -> String {
    let stop = match err {
        EvalAltResult::ErrorTerminated(token, ..) => token.clone().into_string().unwrap_or_default(),
        _ => String::new(),
    };
    let hint = match err {
        EvalAltResult::ErrorTerminated(..) if stop == STOP_OPERATIONS => {
            " (the script ran past its operation budget, imports included: an endless loop? raise Limits::max_operations if it is real work)"
        }
        EvalAltResult::ErrorTerminated(..) if stop == STOP_MEMORY => {
            " (the call holds more memory than Limits::max_memory allows; closures and curried values count)"
        }
        EvalAltResult::ErrorTerminated(..) if stop.starts_with(STOP_PANIC) => {
            " (the host failed on this input and stopped the call; please report it)"
        }
        EvalAltResult::ErrorTooManyOperations(..) => {
            " (the script ran past its operation budget: an endless loop? raise Limits::max_operations if it is real work)"
        }
        EvalAltResult::ErrorTerminated(..) => " (the call ran past its wall-clock budget, Limits::call_timeout)",
        EvalAltResult::ErrorStackOverflow(..) => " (too deep a recursion; Limits::max_call_levels)",
        EvalAltResult::ErrorDataTooLarge(..) => " (a string, array or map outgrew the sandbox limits)",
        EvalAltResult::ErrorVariableNotFound(..) => " (variables must be declared with `let` first)",
        EvalAltResult::ErrorPropertyNotFound(..) => " (a map has no such key; check the spelling or use `in`)",
        EvalAltResult::ErrorFunctionNotFound(sig, ..) if sig.contains("()") => {
            " (a `()` operand is usually a missing map key or a function that returned nothing)"
        }
        _ => "",
    };
    let text = match err {
        EvalAltResult::ErrorTerminated(..) if stop == STOP_TIME => "call timed out".to_string(),
        EvalAltResult::ErrorTerminated(..) if stop == STOP_MEMORY => "out of memory".to_string(),
        EvalAltResult::ErrorTerminated(..) if stop == STOP_OPERATIONS => "too many operations".to_string(),
        EvalAltResult::ErrorTerminated(..) => format!("host error: {stop}"),
        EvalAltResult::ErrorRuntime(v, ..) if v.is_string() => v.clone().into_string().unwrap_or_default(),
        _ => {
            let full = err.to_string();
            let suffix = format!(" ({})", err.position());
            full.strip_suffix(&suffix).unwrap_or(&full).to_string()
        }
    };
    format!("{}{hint}", lowercase_first(&text))
}

fn lowercase_first(s: &str) -> String {
    let mut c = s.chars();
    match c.next() {
        Some(f) if c.clone().next().is_some_and(|n| n.is_lowercase()) => f.to_lowercase().chain(c).collect(),
        _ => s.to_string(),
    }
}

/// The name a script goes by in messages: relative to `project` when inside it.
pub fn display_path(path: &Path, project: &Path) -> String {
    path.strip_prefix(project).unwrap_or(path).to_string_lossy().into_owned()
}
