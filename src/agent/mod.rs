//! The agent side of a rollout: turn parsing (`turn`), the per-episode chat history and context
//! window (`history`), packing a finished episode into one training sequence (`pack`), and the
//! batched multi-turn rollout (`rollout`).
pub mod history;
pub mod pack;
pub mod rollout;
pub mod turn;
