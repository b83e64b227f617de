//! Llama (Touvron et al. 2023) as stored in GGUF by llama.cpp: pre-norm decoder, SwiGLU, RoPE on adjacent
//! pairs (the converter permutes q/k rows so that llama.cpp's "normal" RoPE equals HF's `rotate_half`),
//! optionally tied embeddings. Used by SmolLM2.

use super::{common_config, Arch, ModelConfig};
use crate::backend::cpu::rope::RopeMode;
use crate::error::Result;
use crate::gguf::GgufFile;

/// Hyper-parameters from `llama.*` metadata.
pub fn config(g: &GgufFile) -> Result<ModelConfig> {
    let mut c = common_config(g, Arch::Llama, "llama")?;
    c.rope_mode = RopeMode::Normal;
    Ok(c)
}
