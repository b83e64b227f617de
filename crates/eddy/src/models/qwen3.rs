//! Qwen3 dense: the Qwen2 block without q/k/v biases and with an RMSNorm over each query and key head
//! (`attn_q_norm`, `attn_k_norm`, applied before RoPE); head_dim is given explicitly (`key_length`).

use super::{common_config, Arch, ModelConfig};
use crate::error::Result;
use crate::gguf::GgufFile;

/// Hyper-parameters from `qwen3.*` metadata.
pub fn config(g: &GgufFile) -> Result<ModelConfig> {
    common_config(g, Arch::Qwen3, "qwen3")
}
