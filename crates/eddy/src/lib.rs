//! eddy: a fast local LLM inference engine.
//!
//! The path of one request: chat template ([`chat`]) → tokenizer ([`tokenizer`]) → engine ([`engine`]):
//! prefill, decode and tree verification through one forward pass ([`models::forward`]) over eddy's weight
//! formats ([`quant`]), written against the op trait of [`backend`] (implemented by the CPU kernels,
//! [`backend::cpu`]), with all sequence state (KV rows, recurrent states) owned by the engine ([`state`]),
//! speculators proposing token trees ([`spec`]), sampling keyed by (seed, position) ([`sampling`]).
//! Modules depend one way: [`gguf`], [`model_dir`] → [`models`] → [`backend`], [`state`] → [`spec`] →
//! [`engine`]; [`load`] puts a model, its tokenizer and template together.

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
pub mod stop;
pub mod tokenizer;
pub mod tree;

pub use error::{Error, Result};
