//! Where a training step's time goes: per-thread clocks for the phases of a StarPO step and a
//! counter of the token positions the model computed. The policy and the update add to them
//! (`timed`, `add_tokens`); the trainer reads and resets them once per step (`take`). Per
//! thread, so trainers running side by side in one process (the tests) keep their own.
use std::cell::RefCell;
use std::time::Instant;

/// A phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Rollout: prompts run through the model before the first sampled token.
    Prefill,
    /// Rollout: one token per row per model call, and sampling.
    Decode,
    /// Update: old (and reference) log-probs and critic values, without a graph.
    OldLogprobs,
    /// Update: the forward passes that build the graph.
    Forward,
    /// Update: back-propagation.
    Backward,
    /// Update: gradient clipping and AdamW.
    Optimizer,
}

impl Phase {
    pub const ALL: [Phase; 6] =
        [Phase::Prefill, Phase::Decode, Phase::OldLogprobs, Phase::Forward, Phase::Backward, Phase::Optimizer];

    /// The metric key's name (`time/<name>_s`).
    pub fn name(self) -> &'static str {
        match self {
            Phase::Prefill => "prefill",
            Phase::Decode => "decode",
            Phase::OldLogprobs => "old_logprobs",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Seconds per phase (in `Phase::ALL` order) and model token positions computed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Clocks {
    pub seconds: [f64; 6],
    pub tokens: u64,
}

impl Clocks {
    pub fn get(&self, phase: Phase) -> f64 {
        self.seconds[phase as usize]
    }
}

thread_local! {
    static CLOCKS: RefCell<Clocks> = RefCell::new(Clocks::default());
}

/// Run `f`, adding its wall time to `phase`.
pub fn timed<T>(phase: Phase, f: impl FnOnce() -> T) -> T {
    let start = Instant::now();
    let out = f();
    add_seconds(phase, start.elapsed().as_secs_f64());
    out
}

/// Add `seconds` to `phase` (for spans that `timed` cannot wrap).
pub fn add_seconds(phase: Phase, seconds: f64) {
    CLOCKS.with(|c| c.borrow_mut().seconds[phase as usize] += seconds);
}

/// Count `n` token positions run through the model.
pub fn add_tokens(n: usize) {
    CLOCKS.with(|c| c.borrow_mut().tokens += n as u64);
}

/// Add clocks another thread took (an update run beside the rollout) to this thread's.
pub fn add(other: &Clocks) {
    CLOCKS.with(|c| {
        let mut c = c.borrow_mut();
        for (a, b) in c.seconds.iter_mut().zip(other.seconds) {
            *a += b;
        }
        c.tokens += other.tokens;
    });
}

/// This thread's clocks since the last `take`, reset to zero.
pub fn take() -> Clocks {
    CLOCKS.with(|c| std::mem::take(&mut *c.borrow_mut()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_add_up_per_phase_and_reset_on_take() {
        take();
        timed(Phase::Decode, || std::thread::sleep(std::time::Duration::from_millis(5)));
        add_tokens(7);
        add_tokens(3);
        let c = take();
        assert!(c.get(Phase::Decode) >= 0.005);
        assert_eq!(c.get(Phase::Prefill), 0.0);
        assert_eq!(c.tokens, 10);
        assert_eq!(take(), Clocks::default());
    }
}
