//! The `rng::` functions scripts use for randomness, backed by [`crate::rng::Rng`].
//!
//! The host lends a generator for the length of one call: during `reset` the episode's start
//! stream (`Rng::new(seed)`, shared by a group), during `step` the episode's own stream. Outside
//! those calls `rng::` fails, so render, valid_actions and describe stay deterministic.
use std::cell::RefCell;

use rhai::{Array, Dynamic, EvalAltResult, Module, NativeCallContext, INT};

use crate::rng::Rng;

thread_local! {
    static LENT: RefCell<Option<Rng>> = const { RefCell::new(None) };
}

/// Lends a generator to this thread's `rng::` functions; writes the advanced state back on drop.
pub(crate) struct RngGuard<'a> {
    owner: Option<&'a mut Rng>,
    outer: Option<Rng>,
}

impl<'a> RngGuard<'a> {
    pub(crate) fn lend(owner: Option<&'a mut Rng>) -> Self {
        let outer = LENT.with(|l| l.replace(owner.as_ref().map(|r| (**r).clone())));
        Self { owner, outer }
    }
}

impl Drop for RngGuard<'_> {
    fn drop(&mut self) {
        let used = LENT.with(|l| l.replace(self.outer.take()));
        if let (Some(owner), Some(used)) = (self.owner.as_mut(), used) {
            **owner = used;
        }
    }
}

type Res<T> = Result<T, Box<EvalAltResult>>;

/// An error at the `rng::` call in the script (not at the enclosing function).
fn fail<T>(ctx: &NativeCallContext, msg: impl Into<String>) -> Res<T> {
    Err(Box::new(EvalAltResult::ErrorRuntime(Dynamic::from(msg.into()), ctx.call_position())))
}

fn with_rng<T>(ctx: &NativeCallContext, f: impl FnOnce(&mut Rng) -> T) -> Res<T> {
    LENT.with(|l| match l.borrow_mut().as_mut() {
        Some(r) => Ok(f(r)),
        None => fail(ctx, "rng:: functions work only inside reset and step (render, valid_actions, solve, describe and params must not be random)"),
    })
}

/// A uniform integer in `lo..=hi`, for any `lo <= hi` (the full i64 range included).
fn int_in(r: &mut Rng, lo: INT, hi: INT) -> INT {
    let span = hi.wrapping_sub(lo) as u64; // hi - lo fits in u64 even when it overflows i64
    let offset = if span == u64::MAX { r.next_u64() } else { r.below(span + 1) };
    lo.wrapping_add(offset as INT)
}

/// The `rng` module: `int(lo, hi)` (inclusive), `below(n)`, `float()`, `chance(p)`,
/// `pick(array)`, `shuffle(array)` (returns a shuffled copy).
pub(crate) fn module() -> Module {
    let mut m = Module::new();
    m.set_native_fn("int", |ctx: NativeCallContext, lo: INT, hi: INT| {
        if hi < lo {
            return fail(&ctx, format!("rng::int({lo}, {hi}): hi must be >= lo"));
        }
        with_rng(&ctx, |r| int_in(r, lo, hi))
    });
    m.set_native_fn("below", |ctx: NativeCallContext, n: INT| {
        if n <= 0 {
            return fail(&ctx, format!("rng::below({n}): n must be positive"));
        }
        with_rng(&ctx, |r| r.below(n as u64) as INT)
    });
    m.set_native_fn("float", |ctx: NativeCallContext| with_rng(&ctx, |r| r.next_f64()));
    m.set_native_fn("chance", |ctx: NativeCallContext, p: f64| {
        if p.is_nan() {
            return fail(&ctx, "rng::chance(NaN): p must be a probability");
        }
        with_rng(&ctx, |r| r.next_f64() < p)
    });
    m.set_native_fn("chance", |ctx: NativeCallContext, p: INT| with_rng(&ctx, |r| r.next_f64() < p as f64));
    m.set_native_fn("pick", |ctx: NativeCallContext, xs: Array| {
        if xs.is_empty() {
            return fail(&ctx, "rng::pick: the array is empty");
        }
        with_rng(&ctx, |r| xs[r.below(xs.len() as u64) as usize].clone())
    });
    m.set_native_fn("shuffle", |ctx: NativeCallContext, mut xs: Array| {
        with_rng(&ctx, |r| {
            r.shuffle(&mut xs);
            xs
        })
    });
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn int_covers_extreme_ranges_without_overflow() {
        let mut r = Rng::new(3);
        for (lo, hi) in [(INT::MIN, INT::MAX), (INT::MIN, INT::MIN), (INT::MAX - 1, INT::MAX), (-5, 5)] {
            for _ in 0..100 {
                let x = int_in(&mut r, lo, hi);
                assert!(lo <= x && x <= hi, "{x} outside {lo}..={hi}");
            }
        }
    }
}
