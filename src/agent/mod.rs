//! The agent side of a rollout: the per-episode chat history and context window (`history`),
//! packing a finished episode into one training sequence (`pack`), the `rollout` settings
//! section (`settings`), the batched multi-turn rollout (`rollout`), generation on external
//! engines over HTTP (`engine`, which also pushes the trainer's weights to them), and solver-played demonstrations for a supervised warm start
//! (`demo`). Turn parsing and applying a turn to an
//! episode are pure script-side work (`script::turn`), shared with `play` and `check`.
pub mod demo;
pub mod engine;
pub mod history;
pub mod pack;
pub mod rollout;
pub mod settings;
