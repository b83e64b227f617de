//! eddy: a fast local LLM inference engine.
//!
//! The path of one request: chat template ([`chat`]) → tokenizer ([`tokenizer`]) → engine ([`engine`]):
//! prefill and decode through one forward path ([`models`]) over eddy's weight formats ([`quant`]) and
//! CPU kernels ([`backend::cpu`]), with all sequence state (KV cache) owned by the engine ([`state`]),
//! sampling keyed by (seed, position) ([`sampling`]).

pub mod backend;
pub mod chat;
pub mod engine;
pub mod error;
pub mod export;
pub mod gguf;
pub mod load;
pub mod model_dir;
pub mod models;
pub mod quant;
pub mod sampling;
pub mod spec;
pub mod state;
pub mod stats;
pub mod tokenizer;
pub mod tree;

pub use error::{Error, Result};
