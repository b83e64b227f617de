//! Hugging Face model folders on disk: the file names, the weight shards (`model.safetensors` or the shards
//! listed by `model.safetensors.index.json`, memory-mapped) and the conversion of their tensors into eddy's
//! formats ([`Tensors`]): f32 and f16 become `WeightMatrix::F32`, bf16 stays `WeightMatrix::Bf16` (bits
//! kept) — or, with [`Quant::Q8`]/[`Quant::Q4`], every matrix is quantized with [`quantize_f32`]. Vectors
//! (norms, biases) are f32. Every tensor is converted while being read (byte by byte, so the data need not
//! be aligned).
//!
//! What the tensors mean is the architectures' business: [`crate::models::hf`] reads `config.json` and
//! assembles the dense models, [`crate::models::qwen35`] the hybrid one; [`crate::load`] puts a model, its
//! tokenizer and chat template together.

use crate::error::{Error, Result};
use crate::quant::import::{quantize_f32, QuantKind};
use crate::quant::WeightMatrix;
use memmap2::Mmap;
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// File names inside a model folder.
pub const CONFIG_FILE: &str = "config.json";
/// Single-file weights.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// Index of sharded weights (`{"weight_map": {tensor: shard file}}`).
pub const WEIGHTS_INDEX_FILE: &str = "model.safetensors.index.json";
/// The fast-tokenizer file.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// Tokenizer settings (BOS/EOS names, chat template).
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// How the matrices of a safetensors model are stored in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Quant {
    /// As in the file: f32/f16 → `WeightMatrix::F32`, bf16 → `WeightMatrix::Bf16`.
    #[default]
    None,
    /// Every matrix → int8, group 32 ([`QuantKind::Q8`]).
    Q8,
    /// Projections → int4, group 32 ([`QuantKind::Q4`]); the embedding and LM head → int8 (the LM head is
    /// the most sensitive matrix; llama.cpp's Q4_K_M likewise keeps it at 6 bits).
    Q4,
}

impl std::str::FromStr for Quant {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "none" | "f32" | "bf16" => Ok(Quant::None),
            "q8" => Ok(Quant::Q8),
            "q4" => Ok(Quant::Q4),
            _ => Err(format!("unknown quantization '{s}' (expected q8, q4 or none)")),
        }
    }
}

impl std::fmt::Display for Quant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Quant::None => "none",
            Quant::Q8 => "q8",
            Quant::Q4 => "q4",
        })
    }
}

/// Whether `dir` looks like a complete Hugging Face model folder: `config.json`, `tokenizer.json` and the
/// weights (`model.safetensors`, or the index with every shard it lists).
pub fn is_complete_dir(dir: &Path) -> bool {
    if !dir.join(CONFIG_FILE).is_file() || !dir.join(TOKENIZER_FILE).is_file() {
        return false;
    }
    if dir.join(WEIGHTS_FILE).is_file() {
        return true;
    }
    match shard_files(&dir.join(WEIGHTS_INDEX_FILE)) {
        Ok(files) => !files.is_empty() && files.iter().all(|f| dir.join(f).is_file()),
        Err(_) => false,
    }
}

/// The shard file names listed in a `model.safetensors.index.json`, sorted and deduplicated.
pub fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).map_err(|e| Error::model(index, format!("cannot read: {e}")))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| Error::model(index, format!("malformed JSON: {e}")))?;
    let map = json.get("weight_map").and_then(Value::as_object).ok_or_else(|| Error::model(index, "no \"weight_map\" object"))?;
    let mut files = Vec::new();
    for (name, file) in map {
        let f = file.as_str().ok_or_else(|| Error::model(index, format!("weight_map entry {name} is not a file name")))?;
        if f.contains('/') || f.contains('\\') || f.starts_with('.') {
            return Err(Error::model(index, format!("weight_map entry {name} names an unsupported path '{f}'")));
        }
        files.push(f.to_string());
    }
    files.sort();
    files.dedup();
    Ok(files)
}

// ---------------------------------------------------------------------------------------------------------
// safetensors

/// One memory-mapped safetensors file.
struct Shard {
    path: PathBuf,
    mmap: Mmap,
    /// Offset of the data section (after the 8-byte length and the JSON header).
    data_start: usize,
    meta: Metadata,
}

impl Shard {
    fn open(path: &Path) -> Result<Shard> {
        let file = std::fs::File::open(path).map_err(|e| Error::model(path, format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only; like every mmap-based loader we rely on the file not being truncated
        // or rewritten while the model loads (the data is copied out before load returns).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::model(path, format!("cannot map: {e}")))?;
        let (header_len, meta) =
            SafeTensors::read_metadata(&mmap).map_err(|e| Error::model(path, format!("malformed safetensors file: {e}")))?;
        Ok(Shard { path: path.to_path_buf(), mmap, data_start: 8 + header_len, meta })
    }

    fn bytes(&self, info: &TensorInfo) -> &[u8] {
        // read_metadata() checked that the offsets lie inside the buffer and match dtype × shape.
        &self.mmap[self.data_start + info.data_offsets.0..self.data_start + info.data_offsets.1]
    }
}

/// The tensors of a folder, over all its shards.
pub(crate) struct Tensors {
    shards: Vec<Shard>,
    /// Tensor name → shard.
    index: HashMap<String, usize>,
    /// The file named by "missing tensor" errors: model.safetensors or the index.
    pub(crate) listing: PathBuf,
}

impl Tensors {
    pub(crate) fn open(dir: &Path) -> Result<Tensors> {
        let single = dir.join(WEIGHTS_FILE);
        let index_path = dir.join(WEIGHTS_INDEX_FILE);
        let (files, listing) = if single.is_file() {
            (vec![single.clone()], single)
        } else if index_path.is_file() {
            let files = shard_files(&index_path)?;
            if files.is_empty() {
                return Err(Error::model(&index_path, "weight_map lists no files"));
            }
            (files.iter().map(|f| dir.join(f)).collect(), index_path)
        } else {
            let hint = if dir.join("pytorch_model.bin").is_file() { " (PyTorch .bin checkpoints are not supported)" } else { "" };
            return Err(Error::model(&single, format!("missing: no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE} in the folder{hint}")));
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for f in &files {
            if !f.is_file() {
                return Err(Error::model(f, format!("missing: listed in {}", listing.display())));
            }
            let shard = Shard::open(f)?;
            for name in shard.meta.tensors().keys() {
                index.insert(name.clone(), shards.len());
            }
            shards.push(shard);
        }
        Ok(Tensors { shards, index, listing })
    }

    fn get(&self, name: &str) -> Option<(&Shard, &TensorInfo)> {
        let shard = &self.shards[*self.index.get(name)?];
        Some((shard, shard.meta.info(name)?))
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Names of every tensor of the folder.
    pub(crate) fn names(&self) -> impl Iterator<Item = &String> {
        self.index.keys()
    }

    /// The shard file holding tensor `name`, if present.
    pub(crate) fn file_of(&self, name: &str) -> Option<&Path> {
        self.get(name).map(|(s, _)| s.path.as_path())
    }

    /// Shape of tensor `name`, if present.
    pub(crate) fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.get(name).map(|(_, i)| i.shape.clone())
    }

    /// Tensor `name` as f32 (f32/f16/bf16 data), after checking its shape is `want`.
    pub(crate) fn f32_tensor(&self, name: &str, want: &[usize]) -> Result<Vec<f32>> {
        let (shard, info) = self.get(name).ok_or_else(|| Error::model(&self.listing, format!("missing tensor {name}")))?;
        check_shape(shard, name, info, want)?;
        to_f32(shard, name, info)
    }

    /// Matrix `name` (`rows × cols`, out × in as stored by PyTorch), stored under `quant` (`vocab`: embedding/LM
    /// head, int8 even under [`Quant::Q4`]).
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize, quant: Quant, vocab: bool) -> Result<WeightMatrix> {
        let (shard, info) = self.get(name).ok_or_else(|| Error::model(&self.listing, format!("missing tensor {name}")))?;
        if info.dtype == Dtype::U8 {
            return self.eddy_matrix(name, rows, cols, shard, info);
        }
        check_shape(shard, name, info, &[rows, cols])?;
        let kind = match (quant, vocab) {
            (Quant::None, _) => None,
            (Quant::Q8, _) | (Quant::Q4, true) => Some(QuantKind::Q8),
            (Quant::Q4, false) => Some(QuantKind::Q4),
        };
        Ok(match (kind, info.dtype) {
            (None, Dtype::BF16) => WeightMatrix::Bf16 {
                rows,
                cols,
                data: shard.bytes(info).chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect(),
            },
            (None, _) => WeightMatrix::f32(rows, cols, to_f32(shard, name, info)?),
            (Some(k), _) => quantize_f32(rows, cols, &to_f32(shard, name, info)?, k),
        })
    }
}

impl Tensors {
    /// Tensor `name` as stored: dtype, shape and bytes.
    pub(crate) fn raw(&self, name: &str) -> Option<(Dtype, &[usize], &[u8])> {
        self.get(name).map(|(s, i)| (i.dtype, &i.shape[..], s.bytes(i)))
    }

    /// An eddy M/L matrix (`docs/quant-formats.md`, "Model folder"): U8 codes `name` (`[rows, cols/2]` for
    /// 4 bits, `[rows, cols]` for 8), F16 `name.scales` `[rows, cols/group]`, F16 `name.zero_points` (4
    /// bits only, same shape), optional I8 `name.input_signs` `[cols]` / `name.output_signs` `[rows]`
    /// (±1). Format K (U8 `name.scales`): 4-bit codes, `name.scales` and `name.zero_points` U8
    /// `[rows, 3·⌈cols/128⌉]` (6-bit multipliers packed 4 to 3 bytes per row, [`crate::quant::rtn::unpack6_rows`]),
    /// F16 `name.super_scales` and `name.super_zero_points` `[rows, ⌈cols/256⌉]` (a row's last super-block
    /// partial when `cols % 256 != 0`). Errors name the file and the tensor at fault.
    fn eddy_matrix(&self, name: &str, rows: usize, cols: usize, shard: &Shard, info: &TensorInfo) -> Result<WeightMatrix> {
        use crate::quant::rotation::{Rotation, Signs};
        use crate::quant::{rtn, super_blocks, GroupScales, QMatrix};
        let bad = |m: String| Error::model(&shard.path, format!("tensor {name}: {m}"));
        const SIDE: [&str; 7] = ["scales", "zero_points", "super_scales", "super_zero_points", "high_bits", "input_signs", "output_signs"];
        let prefix = format!("{name}.");
        if let Some(other) = self.names().find(|n| n.strip_prefix(&prefix).is_some_and(|s| !SIDE.contains(&s))) {
            return Err(bad(format!("unknown side tensor {other} (expected .{})", SIDE.join(", ."))));
        }
        let bits = match info.shape[..] {
            [r, c] if r == rows && c == cols => 8,
            [r, c] if r == rows && 2 * c == cols => 4,
            _ => return Err(bad(format!("U8 codes of shape {:?} for a {rows} × {cols} matrix", info.shape))),
        };
        let half = |suffix: &str| -> Result<Option<(Vec<half::f16>, Vec<usize>)>> {
            let n = format!("{name}.{suffix}");
            match self.get(&n) {
                None => Ok(None),
                Some((s, i)) if i.dtype == Dtype::F16 => {
                    let v: Vec<half::f16> =
                        s.bytes(i).chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
                    // A NaN or infinite scale or offset would run the matrix as NaN or silent zeros.
                    if let Some(at) = v.iter().position(|x| !x.is_finite()) {
                        return Err(bad(format!("{suffix} holds a non-finite value ({} at index {at})", v[at])));
                    }
                    Ok(Some((v, i.shape.clone())))
                }
                Some((_, i)) => Err(bad(format!("{suffix} has dtype {}, expected F16", dtype_name(i.dtype)))),
            }
        };
        let signs = |suffix: &str, n: usize| -> Result<Option<std::sync::Arc<Signs>>> {
            let t = format!("{name}.{suffix}");
            match self.get(&t) {
                None => Ok(None),
                Some((s, i)) if i.dtype == Dtype::I8 && i.shape == [n] && s.bytes(i).iter().all(|&b| b == 1 || b == 0xFF) => {
                    Ok(Some(std::sync::Arc::new(Signs::new(s.bytes(i).iter().map(|&b| if b == 1 { 1.0 } else { -1.0 }).collect()))))
                }
                Some(_) => Err(bad(format!("{suffix} must be I8 [{n}] of ±1"))),
            }
        };
        let rotation = Rotation { input: signs("input_signs", cols)?, output: signs("output_signs", rows)? };
        let mut m = QMatrix {
            rows,
            cols,
            bits,
            group: rtn::K_GROUP,
            lo: shard.bytes(info).to_vec(),
            hi: Vec::new(),
            scales: GroupScales::F16 { scale: Vec::new(), min: None },
            packed: None,
            rotation,
        };
        // F16 super-block scales `[rows, ⌈cols/256⌉]` of format k or k6 (a row's last super-block partial when
        // `cols % 256 != 0`).
        let sup = |suffix: &str, format: &str| -> Result<Vec<f32>> {
            let want = vec![rows, super_blocks(cols)];
            match half(suffix)? {
                Some((v, s)) if s == want => Ok(v.iter().map(|h| h.to_f32()).collect()),
                Some((_, s)) => Err(bad(format!("{suffix} of shape {s:?}, expected {want:?}"))),
                None => Err(bad(format!("format {format} codes without their .{suffix}"))),
            }
        };
        if let Some((hs, hi)) = self.get(&format!("{name}.high_bits")) {
            // K6: 6-bit codes (low nibbles in NAME, bit planes 4 and 5 in .high_bits), i8 multipliers per 16
            // or 32 values, f16 super-scales per 256.
            if bits != 4 {
                return Err(bad(format!(
                    "codes of shape {:?} are 8-bit; format k6 (it has .high_bits) needs 4-bit low codes U8 [{rows}, {}]",
                    info.shape,
                    cols / 2
                )));
            }
            if hi.dtype != Dtype::U8 || hi.shape != [rows, cols / 4] {
                return Err(bad(format!(
                    "high_bits is {} {:?}, expected U8 [{rows}, {}] (format k6)",
                    dtype_name(hi.dtype),
                    hi.shape,
                    cols / 4
                )));
            }
            // The group is the one of K6_GROUPS whose multiplier count the `.scales` shape holds.
            let (sc, group) = match self.get(&format!("{name}.scales")) {
                Some((s, i)) if i.dtype == Dtype::I8 && i.shape.len() == 2 && i.shape[0] == rows => {
                    match rtn::K6_GROUPS.into_iter().find(|&g| i.shape[1] * g == cols) {
                        Some(g) => (s.bytes(i).iter().map(|&b| b as i8).collect(), g),
                        None => {
                            return Err(bad(format!(
                                "scales of shape {:?}, expected [{rows}, {}] or [{rows}, {}] (format k6: groups of 16 or 32)",
                                i.shape,
                                cols / 16,
                                cols / 32
                            )))
                        }
                    }
                }
                Some((_, i)) => {
                    return Err(bad(format!(
                        "scales is {} {:?}, expected I8 [{rows}, {}] or [{rows}, {}] (format k6)",
                        dtype_name(i.dtype),
                        i.shape,
                        cols / 16,
                        cols / 32
                    )))
                }
                None => return Err(bad("format k6 codes without their .scales".into())),
            };
            let d = sup("super_scales", "k6")?;
            if self.get(&format!("{name}.zero_points")).is_some() {
                return Err(bad("format k6 takes no zero_points".into()));
            }
            (m.bits, m.group, m.hi) = (6, group, hs.bytes(hi).to_vec());
            m.scales = GroupScales::SuperI8 { sc, mn: None, d, dmin: Vec::new() };
            return Ok(WeightMatrix::Q(m));
        }
        if self.get(&format!("{name}.scales")).is_some_and(|(_, i)| i.dtype == Dtype::U8) {
            // K: 6-bit multipliers packed 4 to 3 bytes per row (the last triple of a row padded when its
            // group count is not a multiple of 4), f16 super-scales per 256 values.
            if bits != 4 {
                return Err(bad(format!("U8 .scales (format k) need 4-bit codes ({rows} × {cols})")));
            }
            let gpr = cols / rtn::K_GROUP;
            let packed = |suffix: &str| -> Result<Vec<i8>> {
                let want = [rows, 3 * gpr.div_ceil(4)];
                match self.get(&format!("{name}.{suffix}")) {
                    Some((s, i)) if i.dtype == Dtype::U8 && i.shape == want && gpr > 0 => Ok(rtn::unpack6_rows(s.bytes(i), gpr)),
                    Some((_, i)) => Err(bad(format!("{suffix} is {} {:?}, expected U8 {want:?} (format k)", dtype_name(i.dtype), i.shape))),
                    None => Err(bad(format!("format k codes without their .{suffix}"))),
                }
            };
            m.scales = GroupScales::SuperI8 {
                sc: packed("scales")?,
                mn: Some(packed("zero_points")?),
                d: sup("super_scales", "k")?,
                dmin: sup("super_zero_points", "k")?,
            };
            return Ok(WeightMatrix::Q(m));
        }
        if self.get(&format!("{name}.scales")).is_some_and(|(_, i)| i.dtype == Dtype::I8) {
            return Err(bad("I8 .scales (format k6) without the codes' .high_bits".into()));
        }
        let (scale, shape) = half("scales")?.ok_or_else(|| bad("codes without their .scales".into()))?;
        let group = match shape[..] {
            [r, g] if r == rows && g > 0 && cols.is_multiple_of(g) && rtn::GROUPS.contains(&(cols / g)) => cols / g,
            _ => return Err(bad(format!("scales of shape {:?} for a {rows} × {cols} matrix (groups of 32, 64 or 128)", shape))),
        };
        let min = match half("zero_points")? {
            Some((m, s)) if s == shape && bits == 4 => Some(m),
            None if bits == 8 => None,
            Some((_, s)) if bits == 4 => return Err(bad(format!("zero_points of shape {s:?}, expected {shape:?}"))),
            _ => return Err(bad(format!("{bits}-bit codes {} zero_points", if bits == 4 { "need" } else { "take no" }))),
        };
        m.group = group;
        m.scales = GroupScales::F16 { scale, min };
        Ok(WeightMatrix::Q(m))
    }
}

fn dtype_name(d: Dtype) -> String {
    format!("{d:?}")
}

/// The values of a tensor as f32 (f32, f16, bf16 data).
fn to_f32(shard: &Shard, name: &str, info: &TensorInfo) -> Result<Vec<f32>> {
    let b = shard.bytes(info);
    Ok(match info.dtype {
        Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => b.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32()).collect(),
        Dtype::BF16 => b.chunks_exact(2).map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16)).collect(),
        other => return Err(unsupported_dtype(shard, name, other)),
    })
}

fn unsupported_dtype(shard: &Shard, name: &str, d: Dtype) -> Error {
    Error::model(&shard.path, format!("tensor {name} has unsupported dtype {} (eddy reads F32, F16, BF16)", dtype_name(d)))
}

fn check_shape(shard: &Shard, name: &str, info: &TensorInfo, want: &[usize]) -> Result<()> {
    if info.shape != want {
        return Err(Error::model(&shard.path, format!("tensor {name} has shape {:?}, expected {want:?}", info.shape)));
    }
    Ok(())
}
