//! Standard-library functions replaced in the sandbox. Rhai checks a string's size after a
//! function returns it; `replace` can build a result a million times its input first (a 1 MiB
//! string with every byte replaced by a 1 MiB string), which aborts the process on allocation.
//! These versions compute the result's size first and refuse before allocating. (The other
//! growing functions, `pad`, `+`, `+=`, `blob`, check before building.)
use rhai::{EvalAltResult, ImmutableString, Module, NativeCallContext};

fn replace_checked(
    ctx: &NativeCallContext,
    s: &mut ImmutableString,
    find: &str,
    with: &str,
) -> Result<(), Box<EvalAltResult>> {
    if s.is_empty() || find.is_empty() && with.is_empty() {
        return Ok(());
    }
    let hits = if find.is_empty() { s.chars().count() + 1 } else { s.matches(find).count() };
    let size = (s.len() - hits * find.len()).saturating_add(hits.saturating_mul(with.len()));
    let max = ctx.engine().max_string_size();
    if max > 0 && size > max {
        // Shown as "the string replace would build (N bytes) too large".
        let what = format!("the string replace would build ({size} bytes, Limits::max_string_size is {max})");
        return Err(EvalAltResult::ErrorDataTooLarge(what, ctx.call_position()).into());
    }
    *s = s.replace(find, with).into();
    Ok(())
}

/// The module of replacements; registered after the standard package, so its functions win.
pub(crate) fn module() -> Module {
    let mut m = Module::new();
    m.set_native_fn(
        "replace",
        |ctx: NativeCallContext, s: &mut ImmutableString, find: ImmutableString, with: ImmutableString| {
            replace_checked(&ctx, s, &find, &with)
        },
    );
    m.set_native_fn("replace", |ctx: NativeCallContext, s: &mut ImmutableString, find: ImmutableString, with: char| {
        replace_checked(&ctx, s, &find, &with.to_string())
    });
    m.set_native_fn("replace", |ctx: NativeCallContext, s: &mut ImmutableString, find: char, with: ImmutableString| {
        replace_checked(&ctx, s, &find.to_string(), &with)
    });
    m.set_native_fn("replace", |ctx: NativeCallContext, s: &mut ImmutableString, find: char, with: char| {
        replace_checked(&ctx, s, &find.to_string(), &with.to_string())
    });
    m
}
