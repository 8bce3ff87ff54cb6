//! [`Limits`]: the sandbox's budgets for every script call and compile, from their defaults and
//! `RAGEN_LIMITS`, and the native stack a thread running scripts under them needs.
use std::time::Duration;

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
    /// `max_array_size` too). Measured on this project's release build (2026-12-06): a chain holding 2 MiB
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
    pub fn from_env() -> anyhow::Result<Self> {
        match std::env::var(Self::ENV) {
            Ok(text) => Self::default().with(&text).map_err(|e| anyhow::anyhow!("{}: {e}", Self::ENV)),
            Err(_) => Ok(Self::default()),
        }
    }

    /// These limits with `key=value` pairs (comma-separated) applied; keys are the field names,
    /// and `call_timeout_ms` for the timeout. 0 means unlimited for the counts.
    pub fn with(mut self, assignments: &str) -> anyhow::Result<Self> {
        for pair in assignments.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| anyhow::anyhow!("{pair:?}: expected key=value"))?;
            let n: u64 = value
                .trim()
                .replace('_', "")
                .parse()
                .map_err(|_| anyhow::anyhow!("{key}: {value:?} is not a whole number"))?;
            let size = usize::try_from(n).map_err(|_| anyhow::anyhow!("{key}: {n} is too large"))?;
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
                    anyhow::bail!(
                        "unknown limit {other:?}; known: max_operations, max_call_levels, max_expr_depth, max_string_size, max_array_size, max_map_size, max_depth, max_memory, max_output, max_script_bytes, call_timeout_ms"
                    )
                }
            }
        }
        Ok(self)
    }
}
