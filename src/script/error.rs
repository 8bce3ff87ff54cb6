//! `ScriptError`: every script failure as `path:line:col: message`, with the chain of script
//! functions the error passed through (innermost last), so an author can find the line at once.
use std::fmt;
use std::path::Path;

use rhai::{EvalAltResult, ParseError, Position};

/// A script failure located in its source file.
#[derive(Debug, Clone, PartialEq)]
pub struct ScriptError {
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
    /// An error about the script as a whole (missing function, wrong shape, bad parameter).
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        Self { path: path.into(), line: 0, col: 0, message: message.into(), call_chain: Vec::new() }
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

    pub fn from_parse(path: &str, err: &ParseError) -> Self {
        Self::at(path, err.position(), format!("syntax error: {}", err.0))
    }

    /// Unwraps Rhai's nested `ErrorInFunctionCall`/`ErrorInModule` layers: the innermost error
    /// gives the location and message, the layers give the call chain. `path` is the file of the
    /// script that was called; errors inside imported modules carry their own source.
    pub fn from_eval(path: &str, err: &EvalAltResult) -> Self {
        let mut chain = Vec::new();
        let mut cur = err;
        let mut file = path.to_string();
        loop {
            match cur {
                EvalAltResult::ErrorInFunctionCall(name, src, inner, pos) => {
                    chain.push(format!("{name} (called at {})", loc(&file, *pos)));
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
        let mut e = Self::at(file, cur.position(), describe(cur));
        e.call_chain = chain;
        e
    }

    /// Prefixes the message, e.g. with the function being called: "step: …".
    pub fn context(mut self, what: impl fmt::Display) -> Self {
        self.message = format!("{what}: {}", self.message);
        self
    }
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
    let hint = match err {
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
        EvalAltResult::ErrorTerminated(..) => "call timed out".to_string(),
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
