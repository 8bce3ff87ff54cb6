//! StarPO and StarPO-S (RAGEN): settings with presets, per-group reward normalisation, the
//! StarPO-S rollout filter, advantage estimators, the losses, the update, the trainer loop, and
//! the supervised warm start from solver demonstrations (`sft`).
//!
//! Read `trainer.rs` top to bottom for the algorithm; the math lives in small pure modules.
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
pub mod report;
pub mod resume;
pub mod rundir;
pub mod settings;
pub mod sft;
pub mod trainer;
pub mod update;

pub use settings::Settings;
