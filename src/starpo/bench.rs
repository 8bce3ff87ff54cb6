//! `ragen-lab bench step`: real StarPO steps of an experiment, timed by phase. It runs the
//! trainer itself (no validation, a scratch run directory) and reads back the per-step metric
//! lines, so what it measures is what `train` does.
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;
use serde_json::{Map, Value};

use super::settings::{Algo, Preset};
use super::trainer::{train, Options};
use crate::metrics::keys::Key;
use crate::phase::Phase;

/// Time an experiment's training steps by phase.
#[derive(clap::Args, Debug)]
pub struct StepArgs {
    /// The experiment script (scripts/*.rhai).
    #[arg(long, value_name = "SCRIPT")]
    pub env: PathBuf,
    /// Steps to run; the first is a warm-up and the medians leave it out when there are more.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// The model (default: the experiment's, else smollm2-135m).
    #[arg(long)]
    pub model: Option<String>,
    /// Advantage estimator family (as `train --algo`).
    #[arg(long, value_enum)]
    pub algo: Option<Algo>,
    /// Override a setting (as `train --set`).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Write the per-step figures and the medians as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// One step's figures, each read from its metrics key: declared once for the struct, the
/// reading and the medians.
macro_rules! step_figures {
    ($($(#[$doc:meta])* $field:ident: $key:expr,)*) => {
        #[derive(Clone, Debug, Default, Serialize, PartialEq)]
        pub struct StepFigures {
            $($(#[$doc])* pub $field: f64,)*
        }

        impl StepFigures {
            fn from_line(line: &Map<String, Value>) -> Self {
                Self { $($field: $key.get(line).unwrap_or(0.0),)* }
            }

            /// Field-wise median of `steps` (the upper middle for an even count); the peak RSS
            /// is the largest.
            fn median(steps: &[StepFigures]) -> Self {
                let m = |f: fn(&StepFigures) -> f64| {
                    let mut v: Vec<f64> = steps.iter().map(f).collect();
                    v.sort_by(f64::total_cmp);
                    v.get(v.len() / 2).copied().unwrap_or(0.0)
                };
                Self {
                    $($field: m(|s| s.$field),)*
                }
                .with_peak(steps.iter().map(|s| s.peak_rss_mb).fold(0.0, f64::max))
            }
        }
    };
}

step_figures! {
    step_s: Key::StepS,
    rollout_s: Key::RolloutS,
    prefill_s: Key::time(Phase::Prefill),
    decode_s: Key::time(Phase::Decode),
    /// Env and reward scripts, prompt rendering and tokenising: the rollout less the model.
    env_s: Key::EnvS,
    update_s: Key::UpdateS,
    old_logprobs_s: Key::time(Phase::OldLogprobs),
    forward_s: Key::time(Phase::Forward),
    backward_s: Key::time(Phase::Backward),
    optimizer_s: Key::time(Phase::Optimizer),
    /// Token positions the model computed (rollout and update).
    tokens_computed: Key::TokensComputed,
    /// Distinct token positions of the step's trajectories (their prefix tree).
    tokens_unique: Key::TokensUnique,
    floor_rollout_flops: Key::FloorFlopsRollout,
    floor_update_flops: Key::FloorFlopsUpdate,
    peak_rss_mb: Key::PeakRssMb,
}

impl StepFigures {
    fn with_peak(self, peak_rss_mb: f64) -> Self {
        Self { peak_rss_mb, ..self }
    }

    pub fn row(&self, label: &str) -> String {
        format!(
            "{label:>6} {:>7.2} | {:>7.2} {:>7.2} {:>7.2} {:>6.2} | {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>6.2} | {:>8.0} {:>8.0} | {:>7.0}",
            self.step_s,
            self.rollout_s,
            self.prefill_s,
            self.decode_s,
            self.env_s,
            self.update_s,
            self.old_logprobs_s,
            self.forward_s,
            self.backward_s,
            self.optimizer_s,
            self.tokens_computed,
            self.tokens_unique,
            self.peak_rss_mb
        )
    }
}

pub const HEADER: &str = "  step  step_s | rollout prefill  decode    env |  update  old_lp forward backwrd  optim | computed   unique | rss_MB";

/// What `bench step` reports.
#[derive(Debug, Serialize)]
pub struct StepReport {
    pub experiment: PathBuf,
    pub threads: usize,
    pub steps: Vec<StepFigures>,
    /// Medians over the steps after the first (over all steps when there is one).
    pub median: StepFigures,
    /// This machine's f32 GEMM rate, measured before the steps.
    pub gemm_gflops: f64,
    /// The median step against its floor at that rate.
    pub floor: Floor,
}

/// A step's floor: its distinct work (the FLOPs of [`StepFigures`]) at the measured GEMM rate,
/// and the measured time as a multiple of it, per phase.
#[derive(Debug, Serialize, PartialEq)]
pub struct Floor {
    pub rollout_s: f64,
    pub update_s: f64,
    pub step_s: f64,
    pub rollout_x: f64,
    pub update_x: f64,
    pub step_x: f64,
}

impl Floor {
    pub fn of(f: &StepFigures, gemm_gflops: f64) -> Self {
        let secs = |flops: f64| flops / (gemm_gflops * 1e9);
        let (rollout_s, update_s) = (secs(f.floor_rollout_flops), secs(f.floor_update_flops));
        let step_s = rollout_s + update_s;
        let times = |measured: f64, floor: f64| if floor > 0.0 { measured / floor } else { f64::NAN };
        Self {
            rollout_s,
            update_s,
            step_s,
            rollout_x: times(f.rollout_s, rollout_s),
            update_x: times(f.update_s, update_s),
            step_x: times(f.step_s, step_s),
        }
    }

    pub fn line(&self, f: &StepFigures, gemm_gflops: f64) -> String {
        format!(
            "floor at {gemm_gflops:.0} GFLOP/s (f32 GEMM, measured): rollout {:.2} TFLOP = {:.2} s ({:.1}×), \
             update {:.2} TFLOP = {:.2} s ({:.1}×), step {:.2} s ({:.1}×)",
            f.floor_rollout_flops / 1e12,
            self.rollout_s,
            self.rollout_x,
            f.floor_update_flops / 1e12,
            self.update_s,
            self.update_x,
            self.step_s,
            self.step_x
        )
    }
}

/// The best f32 GEMM rate of this machine, GFLOP/s, on a layer's shape (512 positions through
/// a 576 → 1536 projection, SmolLM2-135M's MLP), over the threads the steps use.
pub fn gemm_gflops() -> Result<f64> {
    let dev = Device::Cpu;
    let (m, k, n) = (512, 576, 1536);
    let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
    let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
    let wt = w.t()?;
    let _ = x.matmul(&wt)?; // warm-up: pages and packing buffers
    let mut best = f64::INFINITY;
    let t_all = Instant::now();
    while t_all.elapsed().as_secs_f64() < 1.0 {
        let t = Instant::now();
        for _ in 0..8 {
            std::hint::black_box(x.matmul(&wt)?);
        }
        best = best.min(t.elapsed().as_secs_f64() / 8.0);
    }
    Ok(2.0 * (m * k * n) as f64 / best / 1e9)
}

/// Run the steps and collect their figures.
pub fn measure(args: &StepArgs) -> Result<StepReport> {
    if args.steps == 0 {
        bail!("bench step: --steps must be at least 1");
    }
    let gemm = gemm_gflops()?;
    let scratch = tempfile_dir()?;
    let mut sets = args.sets.clone();
    sets.push("train.val_every=0".into());
    sets.push("echo.mi_every=0".into());
    let opts = Options {
        experiment: args.env.clone(),
        model: args.model.clone(),
        preset: Preset::StarpoS,
        algo: args.algo,
        sets,
        steps: Some(args.steps),
        params: Vec::new(),
        val_params: Vec::new(),
        run_dir: scratch.join("run"),
        resume: false,
        progress: false,
        stop: Arc::new(AtomicBool::new(false)),
    };
    let result = train(opts);
    let lines = std::fs::read_to_string(scratch.join("run/metrics.jsonl"));
    let _ = std::fs::remove_dir_all(&scratch);
    result?;
    let steps: Vec<StepFigures> = lines
        .context("bench step: the run wrote no metrics")?
        .lines()
        .filter_map(|l| serde_json::from_str::<Map<String, Value>>(l).ok())
        .filter(|l| l.contains_key(Key::StepS.name()))
        .map(|l| StepFigures::from_line(&l))
        .collect();
    let measured = if steps.len() > 1 { &steps[1..] } else { &steps[..] };
    let median = StepFigures::median(measured);
    Ok(StepReport {
        experiment: args.env.clone(),
        threads: rayon::current_num_threads(),
        floor: Floor::of(&median, gemm),
        gemm_gflops: gemm,
        median,
        steps,
    })
}

/// A fresh scratch directory under the system's temp dir.
fn tempfile_dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("ragen-lab-bench-step-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_come_from_the_metric_keys_and_medians_skip_nothing_given() {
        let line: Map<String, Value> = serde_json::from_str(
            r#"{"time/step_s": 3.0, "time/rollout_s": 1.0, "time/prefill_s": 0.25, "time/decode_s": 0.5,
                "time/env_s": 0.25, "time/update_s": 2.0, "time/old_logprobs_s": 0.2, "time/forward_s": 0.5,
                "time/backward_s": 1.0, "time/optimizer_s": 0.3, "perf/tokens_computed": 900,
                "perf/tokens_unique": 800, "perf/peak_rss_mb": 1234}"#,
        )
        .unwrap();
        let f = StepFigures::from_line(&line);
        assert_eq!((f.prefill_s, f.backward_s, f.tokens_unique), (0.25, 1.0, 800.0));
        let slow = StepFigures { step_s: 9.0, peak_rss_mb: 2000.0, ..f.clone() };
        let m = StepFigures::median(&[f.clone(), slow.clone(), f.clone()]);
        assert_eq!(m.step_s, 3.0);
        assert_eq!(m.peak_rss_mb, 2000.0, "the peak is the largest, not the median");
        assert!(m.row("median").contains("3.00"));
    }

    #[test]
    fn the_floor_is_the_distinct_flops_at_the_gemm_rate() {
        let f = StepFigures {
            step_s: 6.0,
            rollout_s: 2.0,
            update_s: 4.0,
            floor_rollout_flops: 100e9,
            floor_update_flops: 400e9,
            ..StepFigures::default()
        };
        let floor = Floor::of(&f, 200.0);
        assert_eq!((floor.rollout_s, floor.update_s, floor.step_s), (0.5, 2.0, 2.5));
        assert_eq!((floor.rollout_x, floor.update_x, floor.step_x), (4.0, 2.0, 2.4));
        let skipped = Floor::of(&StepFigures { floor_update_flops: 0.0, ..f }, 200.0);
        assert!(skipped.update_x.is_nan(), "a skipped update has no floor to be a multiple of");
        assert!(floor.line(&f, 200.0).contains("step 2.50 s (2.4×)"));
    }

    #[test]
    fn the_gemm_rate_is_measured_and_plausible() {
        let g = gemm_gflops().unwrap();
        assert!(g.is_finite() && g > 0.1, "{g}");
    }
}
