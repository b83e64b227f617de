//! Qwen2 / Qwen2.5 (Yang et al. 2024): the llama block with biases on the q, k and v projections and
//! NeoX-style RoPE (`rotate_half`). The biases are loaded when present by the shared loader.

use super::{common_config, Arch, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Hyper-parameters from `qwen2.*` metadata.
pub fn config(g: &GgufFile) -> Result<ModelConfig> {
    common_config(g, Arch::Qwen2, "qwen2")
}
