//! Gemma 3 text decoder (Gemma Team 2025):
//! - embeddings multiplied by √d_model;
//! - RMSNorm with `(1 + w)` — llama.cpp's converter stores `1 + w` in the GGUF, so the shared kernel applies
//!   the stored weight as it is;
//! - four norms per block: before and after attention, before and after the FFN (`post_attention_norm`,
//!   `post_ffw_norm` normalize the sub-layer output before the residual add);
//! - q/k RMSNorm per head; GeGLU with tanh-approximated GELU;
//! - five sliding-window layers (window from metadata, RoPE base 10 000) for every global layer (RoPE base
//!   from metadata, optional linear scaling); attention scale `1/√query_pre_attn_scalar`, which equals
//!   `1/√head_dim` for the released text models (llama.cpp assumes the same).

use super::{common_config, hp, Arch, ModelConfig};
use crate::backend::cpu::activation::Activation;
use crate::error::Result;
use crate::gguf::GgufFile;

/// Global layers: every 6th (layers 5, 11, 17, …).
pub const SLIDING_PATTERN: usize = 6;
/// RoPE base of the sliding-window layers.
pub const LOCAL_ROPE_THETA: f32 = 10_000.0;

/// Hyper-parameters from `gemma3.*` metadata.
pub fn config(g: &GgufFile) -> Result<ModelConfig> {
    let mut c = common_config(g, Arch::Gemma3, "gemma3")?;
    c.embed_scale = Some((c.d_model as f32).sqrt());
    c.activation = Activation::GeluTanh;
    c.post_norms = true;
    if g.get("gemma3.attention.sliding_window").is_some() {
        c.sliding_window = Some(hp(g, "gemma3", "attention.sliding_window")?);
        c.sliding_pattern = SLIDING_PATTERN;
    }
    c.rope_theta_local = LOCAL_ROPE_THETA;
    Ok(c)
}
