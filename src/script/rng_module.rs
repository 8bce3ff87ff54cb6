//! The `rng::` functions scripts use for randomness, backed by [`crate::rng::Rng`].
//!
//! The host lends a generator for the length of one call: during `reset` the episode's start
//! stream (`Rng::new(seed)`, shared by a group), during `step` the episode's own stream. Outside
//! those calls `rng::` fails, so render, valid_actions and describe stay deterministic.
use std::cell::RefCell;

use rhai::{Array, Dynamic, EvalAltResult, Module, Position, INT};

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

fn fail<T>(msg: impl Into<String>) -> Res<T> {
    Err(Box::new(EvalAltResult::ErrorRuntime(Dynamic::from(msg.into()), Position::NONE)))
}

fn with_rng<T>(f: impl FnOnce(&mut Rng) -> Res<T>) -> Res<T> {
    LENT.with(|l| match l.borrow_mut().as_mut() {
        Some(r) => f(r),
        None => fail("rng:: functions work only inside reset and step (render, valid_actions, describe and params must not be random)"),
    })
}

fn below(r: &mut Rng, n: usize) -> usize {
    r.below(n as u64) as usize
}

/// The `rng` module: `int(lo, hi)` (inclusive), `below(n)`, `float()`, `chance(p)`,
/// `pick(array)`, `shuffle(array)` (returns a shuffled copy).
pub(crate) fn module() -> Module {
    let mut m = Module::new();
    m.set_native_fn("int", |lo: INT, hi: INT| {
        if hi < lo {
            return fail(format!("rng::int({lo}, {hi}): hi must be >= lo"));
        }
        with_rng(|r| Ok(lo + r.below((hi - lo) as u64 + 1) as INT))
    });
    m.set_native_fn("below", |n: INT| {
        if n <= 0 {
            return fail(format!("rng::below({n}): n must be positive"));
        }
        with_rng(|r| Ok(r.below(n as u64) as INT))
    });
    m.set_native_fn("float", || with_rng(|r| Ok(r.next_f64())));
    m.set_native_fn("chance", |p: f64| with_rng(|r| Ok(r.next_f64() < p)));
    m.set_native_fn("chance", |p: INT| with_rng(|r| Ok(r.next_f64() < p as f64)));
    m.set_native_fn("pick", |xs: Array| {
        if xs.is_empty() {
            return fail("rng::pick: the array is empty");
        }
        with_rng(|r| Ok(xs[below(r, xs.len())].clone()))
    });
    m.set_native_fn("shuffle", |mut xs: Array| {
        with_rng(|r| {
            r.shuffle(&mut xs);
            Ok(xs)
        })
    });
    m
}
