//! Import of GGUF tensors (ggml block types) into eddy's weight formats, reference dequantization, and
//! quantization of f32 weights (for `--quant q8|q4` on safetensors models).
//!
//! Block layouts (little endian; `f16` is IEEE half; values per block / bytes per block), learned from the
//! ggml block definitions and gguf-py's `quants.py`:
//!
//! | type | layout | value |
//! |------|--------|-------|
//! | Q4_0 (32/18)  | `d:f16, qs[16]` (byte j: element j low nibble, j+16 high) | `d·(q−8)` |
//! | Q4_1 (32/20)  | `d:f16, m:f16, qs[16]` | `d·q + m` |
//! | Q5_0 (32/22)  | `d:f16, qh:u32, qs[16]` (bit i of qh is bit 4 of element i) | `d·(q−16)` |
//! | Q5_1 (32/24)  | `d:f16, m:f16, qh:u32, qs[16]` | `d·q + m` |
//! | Q8_0 (32/34)  | `d:f16, qs:i8[32]` | `d·q` |
//! | Q4_K (256/144)| `d:f16, dmin:f16, scales[12], qs[128]` | `(d·sc)·q − dmin·m` per sub-block of 32 |
//! | Q5_K (256/176)| `d:f16, dmin:f16, scales[12], qh[32], qs[128]` | as Q4_K with 5-bit q |
//! | Q6_K (256/210)| `ql[128], qh[64], scales:i8[16], d:f16` | `(d·sc)·(q−32)` per sub-block of 16 |
//!
//! K-quant 4-bit codes: 32-byte chunk `j` of `qs` holds sub-block `2j` in its low nibbles and `2j+1` in its
//! high nibbles; Q5_K's bit 4 of element `i` of sub-block `s` is bit `s` of `qh[i]`. The 6-bit scales and
//! mins of Q4_K/Q5_K: for `j < 4`, `sc = s[j] & 63`, `m = s[j+4] & 63`; for `j ≥ 4`,
//! `sc = (s[j+4] & 15) | (s[j−4] >> 6) << 4`, `m = (s[j+4] >> 4) | (s[j] >> 6) << 4`. Q6_K: element `r` of
//! 128-half `h` has low nibble `(ql[64h + r%64] >> 4·(r/64)) & 15` and high bits `(qh[32h + r%32] >> 2·(r/32)) & 3`.
//!
//! # Import mapping and exactness
//!
//! "Exact" means that `WeightMatrix::dequant_row` of the import equals [`dequantize_blocks`] of the original
//! bytes bit-for-bit in f32 (including the sign of zero); checked on the fixtures of
//! `tests/quant_import.rs` and on every tensor of the real model files. Every import is exact and keeps
//! the original size up to the scale encoding (bits per weight in parentheses):
//!
//! * Q4_0 → [`QMatrix`] bits 4, `F16{d, implicit}` (4.5): nibbles copied; `d·(q−8)`.
//! * Q4_1 → bits 4, `F16{d, m}` (5.0): `d·q + m`.
//! * Q5_0 → bits 5, `F16{d, implicit}` (5.5): nibbles and `qh` copied as they are.
//! * Q5_1 → bits 5, `F16{d, m}` (6.0).
//! * Q8_0 → bits 8, codes `q + 128`, `F16{d, implicit}` (8.5): `d·(q'−128)` is `d·q`.
//! * Q4_K → bits 4, `SuperI8{sc, mn, d, −dmin}` (4.75): `(d·sc)·q + (−dmin)·m` is ggml's `(d·sc)·q − dmin·m`.
//! * Q5_K → bits 5, `SuperI8` as Q4_K (5.75).
//! * Q6_K → bits 6, group 16, `SuperI8{sc, None, d}` (6.625): `(d·sc)·(q−32)`.
//! * F32 → `WeightMatrix::F32`; F16 → `F32` (exact conversion); BF16 → `Bf16` (bits kept).
//!
//! A matrix whose row length (`dims[0]`) is not a multiple of 32 (or of the block size of its type) cannot
//! be stored in the grouped formats: it is imported as `WeightMatrix::F32` holding the exact dequantized
//! values instead.

// `x % k != 0` rather than `is_multiple_of`, which is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

use super::{GroupScales, QMatrix, WeightMatrix, QK};
use crate::error::{Error, Result};
use crate::gguf::{ggml_type as gt, TensorInfo};
use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use std::path::Path;

/// The ggml types eddy imports.
pub const SUPPORTED_TYPES: [u32; 11] =
    [gt::F32, gt::F16, gt::BF16, gt::Q4_0, gt::Q4_1, gt::Q5_0, gt::Q5_1, gt::Q8_0, gt::Q4_K, gt::Q5_K, gt::Q6_K];

/// Whether [`import_matrix`] / [`dequantize`] accept tensors of this ggml type.
pub fn is_supported(ggml_type: u32) -> bool {
    SUPPORTED_TYPES.contains(&ggml_type)
}

/// How [`quantize_f32`] stores a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// [`QMatrix`] bits 8, symmetric (implicit offset), group 32, f16 scale `≈ max|w| / 127`.
    Q8,
    /// [`QMatrix`] bits 4, asymmetric, group 32, f16 scale `≈ (max − min) / 15` and f16 offset `≈ min`.
    Q4,
}

/// Bytes that `n` values of `ggml_type` occupy, if `n` is a whole number of blocks of a supported type.
fn byte_len(ggml_type: u32, n: usize) -> Option<usize> {
    if !is_supported(ggml_type) {
        return None;
    }
    let (bv, bb) = gt::block_size(ggml_type)?;
    if n % bv != 0 {
        return None;
    }
    (n / bv).checked_mul(bb)
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// The eight 6-bit (scale, min) pairs of a Q4_K / Q5_K super-block.
#[inline(always)]
fn k_scale_min(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        m[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        m[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// 5-bit codes `[0, 31]` of a Q5_0 / Q5_1 block given its `qh` word and 16 `qs` bytes.
#[inline(always)]
fn q5_codes(qh: u32, qs: &[u8]) -> [u8; 32] {
    let mut q = [0u8; 32];
    for j in 0..16 {
        q[j] = (qs[j] & 15) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (qs[j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// 5-bit codes `[0, 31]` of the 256 values of a Q5_K super-block (`qh`: 32 bytes, `qs`: 128 bytes).
#[inline(always)]
fn q5k_codes(qh: &[u8], qs: &[u8]) -> [u8; 256] {
    let mut q = [0u8; 256];
    for s in 0..8 {
        let chunk = &qs[32 * (s / 2)..][..32];
        let shift = 4 * (s % 2);
        for i in 0..32 {
            q[32 * s + i] = ((chunk[i] >> shift) & 15) | (((qh[i] >> s) & 1) << 4);
        }
    }
    q
}

/// Signed codes `q − 32 ∈ [−32, 31]` of the 256 values of a Q6_K super-block.
#[inline(always)]
fn q6k_codes(blk: &[u8]) -> [i8; 256] {
    let (ql, qh) = (&blk[..128], &blk[128..192]);
    let mut q = [0i8; 256];
    for h in 0..2 {
        let (ql, qh) = (&ql[64 * h..][..64], &qh[32 * h..][..32]);
        let out = &mut q[128 * h..][..128];
        for l in 0..32 {
            let hb = qh[l];
            out[l] = ((ql[l] & 15) | ((hb & 3) << 4)) as i8 - 32;
            out[l + 32] = ((ql[l + 32] & 15) | (((hb >> 2) & 3) << 4)) as i8 - 32;
            out[l + 64] = ((ql[l] >> 4) | (((hb >> 4) & 3) << 4)) as i8 - 32;
            out[l + 96] = ((ql[l + 32] >> 4) | ((hb >> 6) << 4)) as i8 - 32;
        }
    }
    q
}

/// Dequantize one block (`blk` is exactly one block of `ggml_type`) into `out` (its values), with the
/// reference's order of f32 operations.
#[inline(always)]
fn dequant_block(ggml_type: u32, blk: &[u8], out: &mut [f32]) {
    match ggml_type {
        gt::Q4_0 => {
            let d = f16_at(blk, 0);
            for j in 0..16 {
                let b = blk[2 + j];
                out[j] = d * ((b & 15) as i32 - 8) as f32;
                out[j + 16] = d * ((b >> 4) as i32 - 8) as f32;
            }
        }
        gt::Q4_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            for j in 0..16 {
                let b = blk[4 + j];
                out[j] = d * (b & 15) as f32 + m;
                out[j + 16] = d * (b >> 4) as f32 + m;
            }
        }
        gt::Q5_0 => {
            let d = f16_at(blk, 0);
            let q = q5_codes(u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]), &blk[6..22]);
            for (o, &q) in out.iter_mut().zip(&q) {
                *o = d * (q as i32 - 16) as f32;
            }
        }
        gt::Q5_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            let q = q5_codes(u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]), &blk[8..24]);
            for (o, &q) in out.iter_mut().zip(&q) {
                *o = d * q as f32 + m;
            }
        }
        gt::Q8_0 => {
            let d = f16_at(blk, 0);
            for (o, &q) in out.iter_mut().zip(&blk[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        gt::Q4_K | gt::Q5_K => {
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            let (sc, m) = k_scale_min(&blk[4..16]);
            let q5 = if ggml_type == gt::Q5_K { q5k_codes(&blk[16..48], &blk[48..176]) } else { [0; 256] };
            for s in 0..8 {
                let d1 = d * sc[s] as f32;
                let m1 = dmin * m[s] as f32;
                let out = &mut out[32 * s..][..32];
                if ggml_type == gt::Q5_K {
                    for (o, &q) in out.iter_mut().zip(&q5[32 * s..][..32]) {
                        *o = d1 * q as f32 - m1;
                    }
                } else {
                    let chunk = &blk[16 + 32 * (s / 2)..][..32];
                    let shift = 4 * (s % 2);
                    for (o, &b) in out.iter_mut().zip(chunk) {
                        *o = d1 * ((b >> shift) & 15) as f32 - m1;
                    }
                }
            }
        }
        gt::Q6_K => {
            let d = f16_at(blk, 208);
            let q = q6k_codes(blk);
            for (g, (out, q)) in out.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
                let s = d * blk[192 + g] as i8 as f32;
                for (o, &q) in out.iter_mut().zip(q) {
                    *o = s * q as f32;
                }
            }
        }
        _ => unreachable!("dequant_block called for a non-block type"),
    }
}

/// Reference dequantization of raw blocks of one ggml type into f32 (`n` values).
///
/// `None` when the type is not supported, `n` is not a whole number of its blocks, or `bytes` is not
/// exactly the size of `n` values. Results follow gguf-py's `quants.dequantize` bit-for-bit (same f32
/// operations in the same order; F16/BF16 conversions are exact).
pub fn dequantize_blocks(ggml_type: u32, bytes: &[u8], n: usize) -> Option<Vec<f32>> {
    if byte_len(ggml_type, n)? != bytes.len() {
        return None;
    }
    let mut out = vec![0f32; n];
    match ggml_type {
        gt::F32 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        gt::F16 => f16_bytes_to_f32(bytes, &mut out),
        gt::BF16 => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        t => {
            let (bv, bb) = gt::block_size(t)?;
            for (blk, o) in bytes.chunks_exact(bb).zip(out.chunks_exact_mut(bv)) {
                dequant_block(t, blk, o);
            }
        }
    }
    Some(out)
}

/// Little-endian f16 bytes to f32, through `half`'s slice conversion (uses F16C where available).
fn f16_bytes_to_f32(bytes: &[u8], out: &mut [f32]) {
    const CHUNK: usize = 1024;
    let mut tmp = [0u16; CHUNK];
    for (src, dst) in bytes.chunks(2 * CHUNK).zip(out.chunks_mut(CHUNK)) {
        let k = dst.len();
        for (t, b) in tmp[..k].iter_mut().zip(src.chunks_exact(2)) {
            *t = u16::from_le_bytes([b[0], b[1]]);
        }
        tmp[..k].reinterpret_cast::<half::f16>().convert_to_f32_slice(dst);
    }
}

/// (rows, cols, n) of a tensor: `cols = dims[0]`, `rows` the product of the other dims (1 for a vector).
fn shape(path: &Path, info: &TensorInfo) -> Result<(usize, usize, usize)> {
    let bad = || Error::model(path, format!("tensor {} has impossible dimensions {:?}", info.name, info.dims));
    let cols = usize::try_from(*info.dims.first().ok_or_else(bad)?).map_err(|_| bad())?;
    let mut rows = 1usize;
    for &d in info.dims.iter().skip(1) {
        rows = usize::try_from(d).ok().and_then(|d| rows.checked_mul(d)).ok_or_else(bad)?;
    }
    let n = rows.checked_mul(cols).ok_or_else(bad)?;
    Ok((rows, cols, n))
}

/// Checks the type and the byte length; returns (rows, cols, n).
fn validate(path: &Path, info: &TensorInfo, bytes: &[u8]) -> Result<(usize, usize, usize)> {
    let t = info.ggml_type;
    if !is_supported(t) {
        let names: Vec<String> = SUPPORTED_TYPES.iter().map(|&t| gt::name(t)).collect();
        return Err(Error::model(
            path,
            format!("tensor {} has type {}, which eddy does not import (supported: {})", info.name, gt::name(t), names.join(", ")),
        ));
    }
    let (rows, cols, n) = shape(path, info)?;
    let Some(want) = byte_len(t, n) else {
        let bv = gt::block_size(t).map_or(1, |b| b.0);
        return Err(Error::model(
            path,
            format!("tensor {} ({}, dims {:?}): {n} values is not a whole number of {bv}-value blocks", info.name, gt::name(t), info.dims),
        ));
    };
    if bytes.len() != want {
        return Err(Error::model(
            path,
            format!("tensor {} ({}, dims {:?}) should have {want} bytes of data, got {}", info.name, gt::name(t), info.dims, bytes.len()),
        ));
    }
    Ok((rows, cols, n))
}

/// Dequantize any supported tensor to f32 (for norms, biases, embeddings kept in f32, and as reference).
///
/// Errors ([`Error::Model`] naming `path` and the tensor): unsupported type, impossible dimensions, or a
/// byte length that does not match the dimensions.
pub fn dequantize(path: &Path, info: &TensorInfo, bytes: &[u8]) -> Result<Vec<f32>> {
    let (_, _, n) = validate(path, info, bytes)?;
    // validate() checked everything dequantize_blocks checks.
    dequantize_blocks(info.ggml_type, bytes, n).ok_or_else(|| Error::model(path, format!("tensor {}: cannot dequantize", info.name)))
}

/// Convert a GGUF tensor (raw block bytes) into eddy's format; see the module docs for the mapping.
///
/// `info.dims` is in ggml order: `dims[0]` is the row length (`cols`), the product of the other dims is
/// `rows` (a 1-D tensor is one row). Errors as for [`dequantize`].
pub fn import_matrix(path: &Path, info: &TensorInfo, bytes: &[u8]) -> Result<WeightMatrix> {
    let (rows, cols, n) = validate(path, info, bytes)?;
    let t = info.ggml_type;
    let bv = gt::block_size(t).map_or(1, |b| b.0);
    let grouped = cols % QK == 0 && cols % bv == 0;
    let w = match t {
        gt::F32 | gt::F16 => WeightMatrix::f32(rows, cols, dequantize(path, info, bytes)?),
        gt::BF16 => WeightMatrix::Bf16 { rows, cols, data: bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect() },
        _ if !grouped => WeightMatrix::f32(rows, cols, dequantize(path, info, bytes)?),
        gt::Q4_0 | gt::Q4_1 | gt::Q5_0 | gt::Q5_1 | gt::Q8_0 => WeightMatrix::Q(import_legacy(t, rows, cols, n, bytes)),
        gt::Q4_K | gt::Q5_K | gt::Q6_K => WeightMatrix::Q(import_k(t, rows, cols, n, bytes)),
        _ => unreachable!("validate() accepts only supported types"),
    };
    match non_finite_row(&w) {
        Some(r) => Err(Error::model(
            path,
            format!("tensor {} holds a NaN or infinite value or scale (row {r}): the model file is corrupt", info.name),
        )),
        None => Ok(w),
    }
}

/// `v` (a vector tensor `name` of the file at `path`: a norm weight, a bias) when every value is finite;
/// else the same corrupt-file error as a matrix's (a NaN norm weight turns every logit after it into NaN,
/// and the reply into noise with nothing said).
pub fn finite_vector(path: &Path, name: &str, v: Vec<f32>) -> Result<Vec<f32>> {
    match v.iter().position(|x| !x.is_finite()) {
        Some(i) => Err(Error::model(path, format!("tensor {name} holds a NaN or infinite value (element {i}): the model file is corrupt"))),
        None => Ok(v),
    }
}

/// The first row of `w` with a non-finite value (f32/bf16 weights) or scale or offset (quantized: codes are
/// integers, so only the scales can be NaN or infinite), or `None`. A corrupt file's bytes make such values;
/// no trained model has them, and one would turn every logit after it into NaN.
fn non_finite_row(w: &WeightMatrix) -> Option<usize> {
    let bad = |v: &[f32]| v.iter().position(|x| !x.is_finite());
    let bad16 = |v: &[f16]| v.iter().position(|x| !x.is_finite());
    match w {
        WeightMatrix::F32 { cols, data, .. } => bad(data).map(|i| i / cols.max(&1)),
        WeightMatrix::Bf16 { cols, data, .. } => data.iter().position(|&x| x & 0x7f80 == 0x7f80).map(|i| i / cols.max(&1)),
        WeightMatrix::Q(m) => match &m.scales {
            GroupScales::F16 { scale, min } => {
                bad16(scale).or_else(|| min.as_deref().and_then(bad16)).map(|i| i / (m.cols / m.group).max(1))
            }
            GroupScales::SuperI8 { d, dmin, .. } => bad(d).or_else(|| bad(dmin)).map(|i| i / m.cols.div_ceil(256).max(1)),
        },
    }
}

/// Pack 32 codes (each `< 2^bits`) into one block: `lo` (16 bytes, or 32 for bits 8) and `hi`
/// (`4·(bits−4)` bytes for bits 5/6).
#[inline(always)]
fn pack_block(bits: u8, q: &[u8], lo: &mut [u8], hi: &mut [u8]) {
    if bits == 8 {
        lo[..QK].copy_from_slice(&q[..QK]);
        return;
    }
    for j in 0..16 {
        lo[j] = (q[j] & 15) | ((q[j + 16] & 15) << 4);
    }
    for p in 0..(bits as usize).saturating_sub(4).min(2) {
        let mut w = 0u32;
        for (j, &c) in q[..QK].iter().enumerate() {
            w |= (((c >> (4 + p)) & 1) as u32) << j;
        }
        hi[4 * p..4 * p + 4].copy_from_slice(&w.to_le_bytes());
    }
}

#[inline(always)]
fn f16_bits_at(b: &[u8], at: usize) -> f16 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]]))
}

/// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: codes and f16 scales (and offsets) carried over as they are.
fn import_legacy(t: u32, rows: usize, cols: usize, n: usize, bytes: &[u8]) -> QMatrix {
    let (bb, bits, has_min) = match t {
        gt::Q4_0 => (18, 4u8, false),
        gt::Q4_1 => (20, 4, true),
        gt::Q5_0 => (22, 5, false),
        gt::Q5_1 => (24, 5, true),
        _ => (34, 8, false),
    };
    let nb = n / QK;
    let lo_len = if bits == 8 { QK } else { QK / 2 };
    let planes = (bits == 5) as usize;
    let mut lo = vec![0u8; nb * lo_len];
    let mut hi = vec![0u8; nb * 4 * planes];
    let mut scale = Vec::with_capacity(nb);
    let mut min = Vec::with_capacity(if has_min { nb } else { 0 });
    let at = if has_min { 4 } else { 2 };
    for (i, (blk, lo_b)) in bytes.chunks_exact(bb).zip(lo.chunks_exact_mut(lo_len)).enumerate() {
        scale.push(f16_bits_at(blk, 0));
        if has_min {
            min.push(f16_bits_at(blk, 2));
        }
        match bits {
            8 => {
                for (o, &b) in lo_b.iter_mut().zip(&blk[2..34]) {
                    *o = b ^ 0x80; // (q as i8 + 128) as u8
                }
            }
            4 => lo_b.copy_from_slice(&blk[at..at + 16]),
            _ => {
                hi[4 * i..4 * i + 4].copy_from_slice(&blk[at..at + 4]);
                lo_b.copy_from_slice(&blk[at + 4..at + 20]);
            }
        }
    }
    QMatrix {
        rows,
        cols,
        bits,
        group: QK,
        lo,
        hi,
        scales: GroupScales::F16 { scale, min: has_min.then_some(min) },
        packed: None,
        rotation: Default::default(),
    }
}

/// Q4_K, Q5_K (group 32, scale and offset multipliers) and Q6_K (group 16, implicit offset).
fn import_k(t: u32, rows: usize, cols: usize, n: usize, bytes: &[u8]) -> QMatrix {
    let (bb, bits, group) = match t {
        gt::Q4_K => (144, 4u8, 32),
        gt::Q5_K => (176, 5, 32),
        _ => (210, 6, 16),
    };
    let q6 = t == gt::Q6_K;
    let nsb = n / 256;
    let planes = bits as usize - 4;
    let ng = n / group;
    let mut lo = vec![0u8; n / 2];
    let mut hi = vec![0u8; n / QK * 4 * planes];
    let mut sc = vec![0i8; ng];
    let mut mn = vec![0i8; if q6 { 0 } else { ng }];
    let mut d = vec![0f32; nsb];
    let mut dmin = vec![0f32; if q6 { 0 } else { nsb }];
    let mut q = [0u8; 256];
    for (s, blk) in bytes.chunks_exact(bb).enumerate() {
        if q6 {
            d[s] = f16_at(blk, 208);
            for (o, c) in q.iter_mut().zip(q6k_codes(blk)) {
                *o = (c + 32) as u8;
            }
            for g in 0..16 {
                sc[16 * s + g] = blk[192 + g] as i8;
            }
        } else {
            d[s] = f16_at(blk, 0);
            dmin[s] = -f16_at(blk, 2);
            let (scs, ms) = k_scale_min(&blk[4..16]);
            for g in 0..8 {
                sc[8 * s + g] = scs[g] as i8;
                mn[8 * s + g] = ms[g] as i8;
            }
            if t == gt::Q5_K {
                q = q5k_codes(&blk[16..48], &blk[48..176]);
            } else {
                for sub in 0..8 {
                    let chunk = &blk[16 + 32 * (sub / 2)..][..32];
                    let sh = 4 * (sub % 2);
                    for i in 0..32 {
                        q[32 * sub + i] = (chunk[i] >> sh) & 15;
                    }
                }
            }
        }
        for b in 0..8 {
            let blk_i = 8 * s + b;
            pack_block(bits, &q[32 * b..][..32], &mut lo[16 * blk_i..][..16], &mut hi[4 * planes * blk_i..][..4 * planes]);
        }
    }
    QMatrix {
        rows,
        cols,
        bits,
        group,
        lo,
        hi,
        scales: GroupScales::SuperI8 { sc, mn: (!q6).then_some(mn), d, dmin },
        packed: None,
        rotation: Default::default(),
    }
}

/// Quantize a row-major `rows × cols` f32 matrix (e.g. from safetensors, for `--quant q8|q4`): group 32,
/// no rotation, by [`super::rtn::quantize`].
///
/// [`QuantKind::Q8`]: [`QMatrix`] bits 8, group 32, implicit offset, f16 scale `S ≥ max|w|/127` (the f16
/// at or above), codes `round(w/S) + 128` (error ≤ `S/2`).
/// [`QuantKind::Q4`]: bits 4, group 32, f16 offset `M ≤ min` (the f16 at or below the group's minimum),
/// f16 scale `S ≥ (max − M)/15`, `q = round((w − M)/S)` (error ≤ `S/2`; the min/max rule of
/// [`super::rtn::quantize_minmax`]: fast at load time, and what the transformers fixtures simulate; `eddy
/// quantize` searches each group's `(S, M)` instead). If `cols` is not a multiple of 32
/// the matrix is returned as `WeightMatrix::F32` unchanged. Non-finite inputs (or values beyond the f16
/// range) give meaningless codes (but no panic).
///
/// # Panics
/// If `data.len() != rows * cols`.
pub fn quantize_f32(rows: usize, cols: usize, data: &[f32], kind: QuantKind) -> WeightMatrix {
    let format = match kind {
        QuantKind::Q8 => super::rtn::Format::L,
        QuantKind::Q4 => super::rtn::Format::M,
    };
    super::rtn::quantize_minmax(rows, cols, data, format, QK, Default::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dims: Vec<u64>, ggml_type: u32) -> TensorInfo {
        TensorInfo { name: name.into(), dims, ggml_type, offset: 0, nbytes: 0 }
    }

    #[test]
    fn quantize_f32_round_trip_error_is_bounded() {
        let (rows, cols) = (3, 64);
        let data: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013).collect();
        for kind in [QuantKind::Q8, QuantKind::Q4] {
            let m = quantize_f32(rows, cols, &data, kind);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                m.dequant_row(r, &mut row);
                for g in 0..cols / QK {
                    let w = &data[r * cols + g * QK..][..QK];
                    let (lo, hi) = w.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                    let WeightMatrix::Q(q) = &m else { panic!("{kind:?}: not quantized") };
                    // Half a step of the stored (f16) scale; the stored scale is at most one f16 ulp
                    // above the ideal one.
                    let step = q.scale_min(r, g).0;
                    let back = &row[g * QK..][..QK];
                    let ideal = match kind {
                        QuantKind::Q8 => lo.abs().max(hi.abs()) / 127.0,
                        QuantKind::Q4 => (hi - lo) / 15.0,
                    };
                    assert!(step >= ideal && step <= ideal * 1.002 + 1e-7, "{kind:?}: scale {step} vs {ideal}");
                    for (a, b) in back.iter().zip(w) {
                        assert!((a - b).abs() <= step * 0.5001 + 1e-7, "{kind:?}: {a} vs {b}");
                    }
                }
            }
        }
        assert!(matches!(quantize_f32(1, 31, &[0.5; 31], QuantKind::Q4), WeightMatrix::F32 { .. }));
        assert!(matches!(quantize_f32(2, 32, &[0.0; 64], QuantKind::Q8), WeightMatrix::Q(QMatrix { bits: 8, .. })));
    }

    /// A corrupt file's bytes (here 0xFF, an f16 NaN) in a scale or an f32/f16 value make the import fail,
    /// naming the tensor and the row; the same tensor with finite bytes imports.
    #[test]
    fn non_finite_scales_and_values_are_refused() {
        let path = Path::new("m.gguf");
        // Q4_K: 3 rows of 256; super-block scale d at bytes 0..2 of each 144-byte block.
        let mut q4k = vec![0x11u8; 3 * 144];
        for b in 0..3 {
            q4k[144 * b..144 * b + 4].copy_from_slice(&[0x00, 0x3c, 0x00, 0x3c]);
        }
        // Q8_0: 2 rows of 32; f16 scale at bytes 0..2 of each 34-byte block.
        let mut q8 = vec![0x05u8; 2 * 34];
        q8[0..2].copy_from_slice(&[0x00, 0x3c]);
        q8[34..36].copy_from_slice(&[0x00, 0x3c]);
        // F16: 2 rows of 4.
        let mut f16s = [0x00u8, 0x3c].repeat(8);
        for (t, dims, bytes, at) in
            [(gt::Q4_K, vec![256u64, 3], &mut q4k, 2 * 144), (gt::Q8_0, vec![32, 2], &mut q8, 34), (gt::F16, vec![4, 2], &mut f16s, 8 + 2)]
        {
            let i = info("blk.0.w", dims, t);
            assert!(import_matrix(path, &i, bytes).is_ok(), "{}", gt::name(t));
            bytes[at..at + 2].copy_from_slice(&[0xff, 0xff]);
            let e = import_matrix(path, &i, bytes).err().unwrap_or_else(|| panic!("{}: NaN accepted", gt::name(t))).to_string();
            let row = at / (bytes.len() / i.dims[1] as usize);
            assert!(e.contains("blk.0.w") && e.contains("corrupt") && e.contains(&format!("row {row}")), "{}: {e}", gt::name(t));
        }
    }

    #[test]
    fn row_length_not_multiple_of_32_falls_back_to_f32() {
        // Two rows of 16 Q4_0 values would need blocks that straddle rows: the total is one block.
        let mut blk = vec![0u8; 18];
        blk[..2].copy_from_slice(&half::f16::from_f32(0.5).to_bits().to_le_bytes());
        for (j, b) in blk[2..].iter_mut().enumerate() {
            *b = j as u8 | ((15 - j as u8) << 4);
        }
        let i = info("t", vec![16, 2], gt::Q4_0);
        let m = import_matrix(Path::new("m.gguf"), &i, &blk).unwrap();
        let WeightMatrix::F32 { rows: 2, cols: 16, data, .. } = m else { panic!("expected F32") };
        assert_eq!(data, dequantize_blocks(gt::Q4_0, &blk, 32).unwrap());
    }

    #[test]
    fn garbage_never_panics() {
        let mut x = 12345u64;
        for &t in SUPPORTED_TYPES.iter() {
            let (bv, bb) = gt::block_size(t).unwrap();
            let nb = 8 * 32 / bv.clamp(1, 32);
            let bytes: Vec<u8> = (0..bb * nb)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 56) as u8
                })
                .collect();
            let n = bytes.len() / bb * bv;
            let i = info("g", vec![n as u64 / 2, 2], t);
            // Random bytes may spell NaN or infinite scales: then the import is an error saying so.
            if let Err(e) = import_matrix(Path::new("g"), &i, &bytes) {
                assert!(e.to_string().contains("corrupt"), "{}: {e}", gt::name(t));
            }
            let _ = dequantize(Path::new("g"), &i, &bytes).unwrap();
            assert!(import_matrix(Path::new("g"), &i, &bytes[1..]).is_err());
            let odd = info("g", vec![u64::MAX, 3], t);
            assert!(import_matrix(Path::new("g"), &odd, &bytes).is_err());
        }
    }
}
