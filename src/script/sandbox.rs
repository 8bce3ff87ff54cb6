//! The boundary every script compile and call passes through ([`run`]): one budget per
//! top-level call, kept on the calling thread and read by the engine's progress callback between
//! operations; panics caught and turned into errors; `print`/`debug` capped and made printable;
//! and the values a call hands back checked with everything they hold counted ([`check_value`]).
//!
//! Why here and not in Rhai's settings alone: Rhai restarts its operation count for every
//! imported module, does not count what closures and curried `Fn` pointers hold, and checks a
//! string's size only after building it. The budget here spans the whole call, imports included.
use std::cell::{Cell, RefCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;
use std::time::Instant;

use rhai::{Array, Blob, Dynamic, EvalAltResult, FnPtr, ImmutableString, Map, Position};

use super::error::{printable_cut, ErrorKind, STOP_MEMORY, STOP_OPERATIONS, STOP_PANIC, STOP_TIME};
use super::limits::Limits;
use super::memory;

/// The budget of the call running on this thread.
struct Budget {
    deadline: Instant,
    ops_left: u64,
    ticks: u32,
    memory_start: i64,
    max_memory: i64,
    output_left: usize,
}

thread_local! {
    static BUDGET: RefCell<Option<Budget>> = const { RefCell::new(None) };
    /// The message of a panic caught on this thread (set by the quiet hook).
    static PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
    static IN_CALL: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` (one compile or one call) under `limits`. Re-entrant: a nested run (an import being
/// compiled inside a compile) shares the outer budget.
pub(crate) fn run<T>(
    limits: &Limits,
    f: impl FnOnce() -> Result<T, Box<EvalAltResult>>,
) -> Result<T, Box<EvalAltResult>> {
    if IN_CALL.with(Cell::get) {
        return f();
    }
    install_quiet_panic_hook();
    let budget = Budget {
        deadline: Instant::now() + limits.call_timeout,
        // 0 means unlimited, as in Rhai.
        ops_left: if limits.max_operations == 0 { u64::MAX } else { limits.max_operations },
        ticks: 0,
        memory_start: memory::net(),
        max_memory: i64::try_from(limits.max_memory).unwrap_or(i64::MAX),
        output_left: limits.max_output,
    };
    BUDGET.with(|b| *b.borrow_mut() = Some(budget));
    IN_CALL.with(|c| c.set(true));
    let out = catch_unwind(AssertUnwindSafe(f));
    IN_CALL.with(|c| c.set(false));
    BUDGET.with(|b| *b.borrow_mut() = None);
    out.unwrap_or_else(|_| {
        let msg = PANIC.with(|p| p.borrow_mut().take()).unwrap_or_else(|| "unknown panic".into());
        Err(EvalAltResult::ErrorTerminated(format!("{STOP_PANIC}{msg}").into(), Position::NONE).into())
    })
}

/// The engine's progress callback: stops the call at its operation, time or memory budget.
pub(crate) fn on_progress(_ops: u64) -> Option<Dynamic> {
    BUDGET.with(|b| {
        let mut b = b.borrow_mut();
        let b = b.as_mut()?;
        if b.ops_left == 0 {
            return Some(STOP_OPERATIONS.into());
        }
        b.ops_left -= 1;
        if memory::installed() && memory::net() - b.memory_start > b.max_memory {
            return Some(STOP_MEMORY.into());
        }
        // Reading the clock every 256 operations costs nothing measurable.
        b.ticks = b.ticks.wrapping_add(1);
        if b.ticks % 256 == 0 && Instant::now() > b.deadline {
            return Some(STOP_TIME.into());
        }
        None
    })
}

const PREFIX: &str = "[script] ";

/// `print` and `debug`: to stderr, control characters escaped, at most `Limits::max_output`
/// bytes per call (one note says where it was cut).
pub(crate) fn emit(text: &str) {
    let allowed = BUDGET.with(|b| match b.borrow_mut().as_mut() {
        Some(b) => {
            let before = b.output_left;
            b.output_left = before.saturating_sub(PREFIX.len() + text.len() + 1);
            Some(before)
        }
        None => None,
    });
    match allowed {
        Some(0) => {}
        Some(left) if PREFIX.len() + text.len() + 1 > left => {
            eprintln!("{PREFIX}{}", printable_cut(text, left.saturating_sub(PREFIX.len() + 1)));
            eprintln!("{PREFIX}… further output of this call dropped (Limits::max_output)");
        }
        _ => eprintln!("{PREFIX}{}", printable_cut(text, usize::MAX)),
    }
}

/// Panics inside a sandboxed call become errors; the default hook would print them as crashes.
fn install_quiet_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let outer = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if IN_CALL.with(Cell::get) {
                let msg = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                let at = info.location().map(|l| format!(" at {}:{}", l.file(), l.line())).unwrap_or_default();
                PANIC.with(|p| *p.borrow_mut() = Some(format!("{msg}{at}")));
            } else {
                outer(info);
            }
        }));
    });
}

/// What a value holds, counted through arrays, maps, blobs and the values curried into `Fn`
/// pointers and closures (which Rhai's own limits do not see).
#[derive(Default)]
struct Tally {
    string_bytes: usize,
    items: usize,
    entries: usize,
}

/// Checks a value handed back by a script (a return value, an episode's state) against the
/// size limits, with captured and curried values counted, and against `Limits::max_depth`.
/// Returns what is wrong, in words.
pub(crate) fn check_value(v: &Dynamic, limits: &Limits) -> Result<(), (ErrorKind, String)> {
    let mut t = Tally::default();
    walk(v, 0, &mut t, limits)
}

fn walk(v: &Dynamic, depth: usize, t: &mut Tally, l: &Limits) -> Result<(), (ErrorKind, String)> {
    if depth > l.max_depth {
        let msg = format!("the value is nested deeper than {} levels (Limits::max_depth)", l.max_depth);
        return Err((ErrorKind::Depth, msg));
    }
    if let Some(s) = v.read_lock::<ImmutableString>() {
        t.string_bytes += s.len();
    } else if let Some(a) = v.read_lock::<Array>() {
        t.items += a.len();
        a.iter().try_for_each(|x| walk(x, depth + 1, t, l))?;
    } else if let Some(m) = v.read_lock::<Map>() {
        t.entries += m.len();
        m.values().try_for_each(|x| walk(x, depth + 1, t, l))?;
    } else if let Some(b) = v.read_lock::<Blob>() {
        t.items += b.len();
    } else if let Some(f) = v.read_lock::<FnPtr>() {
        f.iter_curry().try_for_each(|x| walk(x, depth + 1, t, l))?;
    }
    let over = |what: &str, n: usize, max: usize, name: &str| {
        let msg = format!(
            "the value holds {n} {what}, over the limit of {max} (Limits::{name}; closures and curried values count)"
        );
        Err((ErrorKind::Size, msg))
    };
    if t.string_bytes > l.max_string_size {
        return over("bytes of strings", t.string_bytes, l.max_string_size, "max_string_size");
    }
    if t.items > l.max_array_size {
        return over("array elements", t.items, l.max_array_size, "max_array_size");
    }
    if t.entries > l.max_map_size {
        return over("map entries", t.entries, l.max_map_size, "max_map_size");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::script::{ErrorKind, ScriptError};

    #[test]
    fn a_panic_inside_a_call_becomes_an_error_of_kind_panic() {
        let out: Result<(), _> = run(&Limits::default(), || panic!("index out of bounds"));
        let e = ScriptError::from_eval("envs/t.rhai", &out.unwrap_err());
        assert_eq!(e.kind, ErrorKind::Panic, "{e}");
        assert!(e.message.contains("index out of bounds at src/script/sandbox.rs:"), "{e}");
        // The thread is usable afterwards: the next call has a fresh budget.
        assert_eq!(run(&Limits::default(), || Ok(7)).unwrap(), 7);
    }

    #[test]
    fn the_operation_budget_spans_nested_runs() {
        let limits = Limits { max_operations: 10, ..Limits::default() };
        let out = run(&limits, || {
            for _ in 0..5 {
                assert!(on_progress(0).is_none());
            }
            // A nested run (an import compiled inside a compile) shares the outer budget.
            run(&limits, || {
                let stop = (0..10).find_map(on_progress);
                Ok(stop.and_then(|t| t.into_string().ok()))
            })
        });
        assert_eq!(out.unwrap().as_deref(), Some(STOP_OPERATIONS));
    }
}
