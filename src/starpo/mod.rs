//! StarPO and StarPO-S (RAGEN): settings with presets, per-group reward normalisation, the
//! StarPO-S rollout filter, advantage estimators, the losses, the update, the trainer loop; and
//! the jobs beside it: `eval` on chat endpoints, the supervised warm start (`sft`), the benches.
//!
//! Read `trainer.rs` top to bottom for the algorithm: `train` is the step as RAGEN's algorithm
//! box, and each part is a `Trainer` method or a module of its own: `credit` (score, filter,
//! advantages), `player` (playing and validating), `update`, `report` (the lines a step
//! writes), `nets` (the networks and optimisers), `resume` (settings.json and checkpoints).
//! The math lives in small pure modules (`normalize`, `filter`, `advantage`, `loss`).
pub mod advantage;
pub mod bench;
pub mod credit;
pub mod early_stop;
pub mod eval;
pub mod filter;
pub mod loss;
pub mod nets;
pub mod normalize;
pub mod optim;
pub mod player;
pub mod policy_bench;
pub mod preview;
pub mod report;
pub mod resume;
pub mod rundir;
pub mod settings;
pub mod sft;
pub mod trainer;
pub mod update;

pub use settings::Settings;
