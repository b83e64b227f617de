//! Writing models in other engines' formats, for tests and benchmarks against them (no inference path uses
//! this): a Qwen3.5 Hugging Face folder as a GGUF file of llama.cpp's `qwen35` architecture.

use crate::error::{Error, Result};
use crate::gguf::GgufValue;
use crate::model_dir::{Quant, Tensors, CONFIG_FILE};
use crate::models::qwen35::{gguf_name, read_hf_config, HfLoader, Role, Source, GGUF_ARCH, MTP_LAYER};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Write the Qwen3.5 text model of Hugging Face folder `dir` as an f32 GGUF of architecture `qwen35`, with
/// llama.cpp's conventions (the ones transformers' GGUF loader undoes): `blk.N.*` names, zero-centred norms
/// stored as `1 + w` (not `ssm_norm`), `ssm_a = −exp(A_log)`, the conv squeezed to `[conv_dim, K]`, and value
/// heads reordered from grouped to tiled on every value-indexed tensor (rows of the v part of `attn_qkv` and
/// `ssm_conv1d`, of `attn_gate`, `ssm_alpha`, `ssm_beta`, `ssm_a`, `ssm_dt`; columns of `ssm_out`); the MTP head
/// as `blk.{n_layers}.*` when present; the folder's `tokenizer.json` (byte-level BPE) as `tokenizer.ggml.*`
/// when present. Errors: what [`crate::models::qwen35::load_dir`] reports, layer types that no `full_attention_interval`
/// describes, or an I/O failure.
pub fn qwen35_gguf(dir: &Path, out: &Path) -> Result<()> {
    let cfg_path = dir.join(CONFIG_FILE);
    let (mrope_sections, c) = read_hf_config(dir)?;
    let every = (1..=c.n_layers).find(|&p| c.attention_layers.iter().enumerate().all(|(l, &a)| a == ((l + 1) % p == 0)));
    let every = every.ok_or_else(|| Error::model(&cfg_path, "layer_types are not periodic: no full_attention_interval describes them"))?;
    let t = Tensors::open(dir)?;
    let pre = ["model.language_model.", "model."]
        .into_iter()
        .find(|p| t.contains(&format!("{p}embed_tokens.weight")))
        .ok_or_else(|| Error::model(&t.listing, "missing tensor model.embed_tokens.weight"))?;
    let hf = HfLoader { t: &t, quant: Quant::None, pre };
    let s = c.gdn;
    let r = s.n_v_heads / s.n_k_heads;
    // tiled position of grouped value head h = kh·r + j is j·n_k + kh.
    let tiled_of = |h: usize| (h % r) * s.n_k_heads + h / r;
    let permute_rows = |data: &[f32], row_len: usize, head_rows: usize, offset_rows: usize| -> Vec<f32> {
        let mut o = data.to_vec();
        for h in 0..s.n_v_heads {
            let src = (offset_rows + h * head_rows) * row_len;
            let dst = (offset_rows + tiled_of(h) * head_rows) * row_len;
            o[dst..dst + head_rows * row_len].copy_from_slice(&data[src..src + head_rows * row_len]);
        }
        o
    };
    let mut tensors: Vec<(String, Vec<u64>, Vec<f32>)> = Vec::new();
    let mut add = |name: String, dims: Vec<u64>, data: Vec<f32>| tensors.push((name, dims, data));
    let read = |role: Role, l: usize| -> Result<(Vec<usize>, Vec<f32>)> {
        let n = hf.name(role, l);
        let shape = t.shape(&n).ok_or_else(|| Error::model(&t.listing, format!("missing tensor {n}")))?;
        Ok((shape.clone(), t.f32_tensor(&n, &shape)?))
    };
    let mut roles: Vec<(Role, usize)> = vec![(Role::Embed, 0), (Role::OutputNorm, 0)];
    if t.contains(&hf.name(Role::Head, 0)) && !c.tie_embeddings {
        roles.push((Role::Head, 0));
    }
    for l in 0..c.n_layers {
        roles.extend([Role::AttnNorm, Role::FfnNorm, Role::Gate, Role::Up, Role::Down].map(|x| (x, l)));
        if c.attention_layers[l] {
            roles.extend([Role::Q, Role::K, Role::V, Role::O, Role::QNorm, Role::KNorm].map(|x| (x, l)));
        } else {
            roles.extend(
                [Role::Qkv, Role::Z, Role::A, Role::B, Role::Conv, Role::ALog, Role::DtBias, Role::GdnNorm, Role::Out].map(|x| (x, l)),
            );
        }
    }
    let has_mtp = t.contains(&hf.name(Role::MtpFc, 0));
    if has_mtp {
        roles.extend([Role::MtpEmbNorm, Role::MtpHidNorm, Role::MtpFc, Role::MtpNorm].map(|x| (x, 0)));
        roles.extend(
            [Role::AttnNorm, Role::FfnNorm, Role::Gate, Role::Up, Role::Down, Role::Q, Role::K, Role::V, Role::O, Role::QNorm, Role::KNorm]
                .map(|x| (x, MTP_LAYER)),
        );
    }
    for (role, l) in roles {
        let (shape, mut data) = read(role, l)?;
        let norm_1p = matches!(
            role,
            Role::OutputNorm
                | Role::AttnNorm
                | Role::FfnNorm
                | Role::QNorm
                | Role::KNorm
                | Role::MtpEmbNorm
                | Role::MtpHidNorm
                | Role::MtpNorm
        );
        if norm_1p {
            data.iter_mut().for_each(|v| *v += 1.0);
        }
        let kd2 = 2 * s.key_dim();
        data = match role {
            Role::ALog => permute_rows(&data.iter().map(|v| -v.exp()).collect::<Vec<_>>(), 1, 1, 0),
            Role::DtBias | Role::A | Role::B => permute_rows(&data, data.len() / s.n_v_heads, 1, 0),
            Role::Z => permute_rows(&data, c.d_model, s.d_v, 0),
            Role::Qkv => permute_rows(&data, c.d_model, s.d_v, kd2),
            Role::Conv => permute_rows(&data, s.kernel, s.d_v, kd2),
            Role::Out => {
                // Columns: transpose, permute rows, transpose back.
                let (rows, cols) = (c.d_model, s.value_dim());
                let tr: Vec<f32> = (0..cols * rows).map(|i| data[(i % rows) * cols + i / rows]).collect();
                let p = permute_rows(&tr, rows, s.d_v, 0);
                (0..rows * cols).map(|i| p[(i % cols) * rows + i / cols]).collect()
            }
            _ => data,
        };
        let dims: Vec<u64> = match role {
            Role::Conv => vec![s.kernel as u64, s.conv_dim() as u64],
            _ => shape.iter().rev().map(|&x| x as u64).collect(),
        };
        add(gguf_name(role, if l == MTP_LAYER { c.n_layers } else { l }, c.n_layers), dims, data);
    }
    let p = |k: &str| format!("{GGUF_ARCH}.{k}");
    let mut md: BTreeMap<String, GgufValue> = BTreeMap::new();
    md.insert("general.architecture".into(), GgufValue::String(GGUF_ARCH.into()));
    md.insert(p("nextn_predict_layers"), GgufValue::U32(has_mtp as u32));
    for (k, v) in [
        ("block_count", c.n_layers + has_mtp as usize),
        ("context_length", c.train_ctx),
        ("embedding_length", c.d_model),
        ("feed_forward_length", c.ffn_dim),
        ("attention.head_count", c.n_heads),
        ("attention.head_count_kv", c.n_kv_heads),
        ("attention.key_length", c.head_dim),
        ("attention.value_length", c.head_dim),
        ("rope.dimension_count", c.rope_dims),
        ("full_attention_interval", every),
        ("ssm.conv_kernel", s.kernel),
        ("ssm.state_size", s.d_k),
        ("ssm.group_count", s.n_k_heads),
        ("ssm.time_step_rank", s.n_v_heads),
        ("ssm.inner_size", s.value_dim()),
    ] {
        md.insert(p(k), GgufValue::U32(v as u32));
    }
    md.insert(p("attention.layer_norm_rms_epsilon"), GgufValue::F32(c.norm_eps));
    md.insert(p("rope.freq_base"), GgufValue::F32(c.rope_theta));
    let mut sections = mrope_sections.unwrap_or_else(|| vec![11, 11, 10]);
    sections.resize(4, 0);
    md.insert(p("rope.dimension_sections"), GgufValue::Array(sections.into_iter().map(GgufValue::I32).collect()));
    if dir.join(crate::model_dir::TOKENIZER_FILE).is_file() {
        tokenizer_metadata(dir, c.vocab_size, &mut md)?;
    }
    let bytes: Vec<Vec<u8>> = tensors.iter().map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
    let table: Vec<(String, Vec<u64>, u32, &[u8])> =
        tensors.iter().zip(&bytes).map(|((n, dims, _), b)| (n.clone(), dims.clone(), 0u32, b.as_slice())).collect();
    crate::gguf::write_gguf(out, &md, &table).map_err(|e| Error::Io { path: out.to_path_buf(), source: e })
}

/// llama.cpp's `tokenizer.ggml.*` metadata (byte-level BPE, pre-tokenizer `qwen35`) from the folder's
/// `tokenizer.json` (and `tokenizer_config.json` for the EOS token): tokens by id, padded to `vocab` with
/// unused `<|pad_N|>` entries; token types (1 normal, 3 control for special added tokens, 5 padding); merges.
fn tokenizer_metadata(dir: &Path, vocab: usize, md: &mut BTreeMap<String, GgufValue>) -> Result<()> {
    let path = dir.join(crate::model_dir::TOKENIZER_FILE);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::model(&path, format!("cannot read: {e}")))?;
    let j: Value = serde_json::from_str(&text).map_err(|e| Error::model(&path, format!("malformed JSON: {e}")))?;
    let bad = |m: &str| Error::model(&path, m.to_string());
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab];
    let mut put = |id: u64, tok: &str, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| bad(&format!("token id {id} beyond the {vocab} embedding rows")))?;
        *slot = Some((tok.to_string(), ty));
        Ok(())
    };
    for (tok, id) in j.pointer("/model/vocab").and_then(Value::as_object).ok_or_else(|| bad("no model.vocab (not a BPE tokenizer)"))? {
        put(id.as_u64().ok_or_else(|| bad("vocab id is not an integer"))?, tok, 1)?;
    }
    let mut eos = None;
    let eos_name = std::fs::read_to_string(dir.join(crate::model_dir::TOKENIZER_CONFIG_FILE))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|v| v.get("eos_token").and_then(Value::as_str).map(str::to_string));
    for a in j.get("added_tokens").and_then(Value::as_array).into_iter().flatten() {
        let (id, content) = (a["id"].as_u64().unwrap_or(u64::MAX), a["content"].as_str().unwrap_or(""));
        put(id, content, if a["special"].as_bool() == Some(true) { 3 } else { 4 })?;
        if eos_name.as_deref() == Some(content) {
            eos = Some(id);
        }
    }
    let merges: Vec<GgufValue> = j
        .pointer("/model/merges")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("no model.merges"))?
        .iter()
        .map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(p) => Some(format!("{} {}", p.first()?.as_str()?, p.get(1)?.as_str()?)),
            _ => None,
        })
        .map(|m| m.map(GgufValue::String).ok_or_else(|| bad("a merge is neither \"a b\" nor [a, b]")))
        .collect::<Result<_>>()?;
    let (mut list, mut types) = (Vec::with_capacity(vocab), Vec::with_capacity(vocab));
    for (i, t) in tokens.into_iter().enumerate() {
        let (tok, ty) = t.unwrap_or_else(|| (format!("<|pad_{i}|>"), 5));
        list.push(GgufValue::String(tok));
        types.push(GgufValue::I32(ty));
    }
    md.insert("tokenizer.ggml.model".into(), GgufValue::String("gpt2".into()));
    md.insert("tokenizer.ggml.pre".into(), GgufValue::String("qwen35".into()));
    md.insert("tokenizer.ggml.tokens".into(), GgufValue::Array(list));
    md.insert("tokenizer.ggml.token_type".into(), GgufValue::Array(types));
    md.insert("tokenizer.ggml.merges".into(), GgufValue::Array(merges));
    md.insert("tokenizer.ggml.add_bos_token".into(), GgufValue::Bool(false));
    if let Some(e) = eos {
        md.insert("tokenizer.ggml.eos_token_id".into(), GgufValue::U32(e as u32));
    }
    Ok(())
}
