//! Talking to inference engines over HTTP (OpenAI-compatible: `ragen-lab serve`, vLLM, SGLang,
//! llama-server, hosted APIs): the wire format and a client. `eval` uses it to play an
//! experiment's episodes on a served model; `serve` answers the same format.
pub mod client;
pub mod wire;

pub use client::{api_base, Endpoint};
