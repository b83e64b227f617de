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
//! bytes value-for-value in f32 (`==`, so `+0.0` and `−0.0` count as equal); measured on the fixtures of
//! `tests/quant_import.rs` and on every tensor of the real model files.
//!
//! * Q4_0 → [`Int4Matrix`], scale `d`, min `−8d`, nibbles copied as they are. Exact: `d·q` and `8d` need at
//!   most 15 significant bits, so `d·q + (−8d)` is the exact value of `d·(q−8)`; the one difference is
//!   the sign of zero (code 8 with `d < 0` gives `+0.0` where the reference gives `−0.0`).
//! * Q4_1 → Int4, scale `d`, min `m`. Exact (bit-for-bit: the same two f32 operations).
//! * Q4_K → Int4 group 32, scale `d·sc`, min `−(dmin·m)`, each computed in f32 as ggml does. Exact
//!   (bit-for-bit: `a·q + (−b)` is `a·q − b`).
//! * Q8_0 → [`Int8Matrix`] group 32, codes as they are, scale `d`. Exact (bit-for-bit).
//! * Q5_0 → Int8 group 32, codes `q − 16`, scale `d`. Exact (bit-for-bit).
//! * Q6_K → Int8 group 16, codes `q − 32`, scale `d·sc`. Exact (bit-for-bit).
//! * Q5_1, Q5_K (asymmetric, no exact symmetric form) → dequantized, then each group of 32 requantized to
//!   Int8 with scale `s = max|w| / 127` and `q = round(w / s)`: the error is at most `s/2 = max|w|/254` per
//!   element (plus rounding of the f32 product, a relative 2⁻²⁴).
//! * F32 → `WeightMatrix::F32`; F16 → `F32` (exact conversion); BF16 → `Bf16` (bits kept).
//!
//! A matrix whose row length (`dims[0]`) is not a multiple of 32 (or of the block size of its type) cannot
//! be stored in the grouped formats: it is imported as `WeightMatrix::F32` holding the exact dequantized
//! values instead.

// `x % k != 0` rather than `is_multiple_of`, which is newer than the workspace's rust-version (1.85).
#![allow(clippy::manual_is_multiple_of)]

use super::{Int4Matrix, Int8Matrix, WeightMatrix, QK};
use crate::error::{Error, Result};
use crate::gguf::{ggml_type as gt, TensorInfo};
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use std::path::Path;

/// The ggml types eddy imports.
pub const SUPPORTED_TYPES: [u32; 11] = [
    gt::F32,
    gt::F16,
    gt::BF16,
    gt::Q4_0,
    gt::Q4_1,
    gt::Q5_0,
    gt::Q5_1,
    gt::Q8_0,
    gt::Q4_K,
    gt::Q5_K,
    gt::Q6_K,
];

/// Whether [`import_matrix`] / [`dequantize`] accept tensors of this ggml type.
pub fn is_supported(ggml_type: u32) -> bool {
    SUPPORTED_TYPES.contains(&ggml_type)
}

/// How [`quantize_f32`] stores a matrix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// [`Int8Matrix`], symmetric, group 32, scale `max|w| / 127`.
    Q8,
    /// [`Int4Matrix`], asymmetric, group 32, scale `(max − min) / 15` and min the group's minimum.
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
            let q = q5_codes(
                u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]),
                &blk[6..22],
            );
            for (o, &q) in out.iter_mut().zip(&q) {
                *o = d * (q as i32 - 16) as f32;
            }
        }
        gt::Q5_1 => {
            let (d, m) = (f16_at(blk, 0), f16_at(blk, 2));
            let q = q5_codes(
                u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]),
                &blk[8..24],
            );
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
            let q5 = if ggml_type == gt::Q5_K {
                q5k_codes(&blk[16..48], &blk[48..176])
            } else {
                [0; 256]
            };
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
        tmp[..k]
            .reinterpret_cast::<half::f16>()
            .convert_to_f32_slice(dst);
    }
}

/// (rows, cols, n) of a tensor: `cols = dims[0]`, `rows` the product of the other dims (1 for a vector).
fn shape(path: &Path, info: &TensorInfo) -> Result<(usize, usize, usize)> {
    let bad = || {
        Error::model(
            path,
            format!(
                "tensor {} has impossible dimensions {:?}",
                info.name, info.dims
            ),
        )
    };
    let cols = usize::try_from(*info.dims.first().ok_or_else(bad)?).map_err(|_| bad())?;
    let mut rows = 1usize;
    for &d in info.dims.iter().skip(1) {
        rows = usize::try_from(d)
            .ok()
            .and_then(|d| rows.checked_mul(d))
            .ok_or_else(bad)?;
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
            format!(
                "tensor {} has type {}, which eddy does not import (supported: {})",
                info.name,
                gt::name(t),
                names.join(", ")
            ),
        ));
    }
    let (rows, cols, n) = shape(path, info)?;
    let Some(want) = byte_len(t, n) else {
        let bv = gt::block_size(t).map_or(1, |b| b.0);
        return Err(Error::model(
            path,
            format!(
                "tensor {} ({}, dims {:?}): {n} values is not a whole number of {bv}-value blocks",
                info.name,
                gt::name(t),
                info.dims
            ),
        ));
    };
    if bytes.len() != want {
        return Err(Error::model(
            path,
            format!(
                "tensor {} ({}, dims {:?}) should have {want} bytes of data, got {}",
                info.name,
                gt::name(t),
                info.dims,
                bytes.len()
            ),
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
    dequantize_blocks(info.ggml_type, bytes, n)
        .ok_or_else(|| Error::model(path, format!("tensor {}: cannot dequantize", info.name)))
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
    Ok(match t {
        gt::F32 | gt::F16 => WeightMatrix::F32 {
            rows,
            cols,
            data: dequantize(path, info, bytes)?,
        },
        gt::BF16 => WeightMatrix::Bf16 {
            rows,
            cols,
            data: bytes
                .chunks_exact(2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
                .collect(),
        },
        _ if !grouped => WeightMatrix::F32 {
            rows,
            cols,
            data: dequantize(path, info, bytes)?,
        },
        gt::Q4_0 | gt::Q4_1 => WeightMatrix::Int4(import_q4_0_1(t, rows, cols, n, bytes)),
        gt::Q4_K => WeightMatrix::Int4(import_q4_k(rows, cols, n, bytes)),
        gt::Q8_0 | gt::Q5_0 | gt::Q6_K => {
            WeightMatrix::Int8(import_int8_exact(t, rows, cols, n, bytes))
        }
        gt::Q5_1 | gt::Q5_K => WeightMatrix::Int8(import_requant(t, rows, cols, n, bytes)),
        _ => unreachable!("validate() accepts only supported types"),
    })
}

fn import_q4_0_1(t: u32, rows: usize, cols: usize, n: usize, bytes: &[u8]) -> Int4Matrix {
    let groups = n / QK;
    let mut packed = vec![0u8; n / 2];
    let mut scale = vec![0f32; groups];
    let mut min = vec![0f32; groups];
    let (bb, qs_at) = if t == gt::Q4_0 { (18, 2) } else { (20, 4) };
    for (((blk, p), s), m) in bytes
        .chunks_exact(bb)
        .zip(packed.chunks_exact_mut(16))
        .zip(&mut scale)
        .zip(&mut min)
    {
        let d = f16_at(blk, 0);
        *s = d;
        *m = if t == gt::Q4_0 {
            -8.0 * d
        } else {
            f16_at(blk, 2)
        };
        p.copy_from_slice(&blk[qs_at..qs_at + 16]);
    }
    Int4Matrix {
        rows,
        cols,
        packed,
        scale,
        min,
    }
}

fn import_q4_k(rows: usize, cols: usize, n: usize, bytes: &[u8]) -> Int4Matrix {
    let groups = n / QK;
    let mut packed = vec![0u8; n / 2];
    let mut scale = vec![0f32; groups];
    let mut min = vec![0f32; groups];
    for (((blk, p), s8), m8) in bytes
        .chunks_exact(144)
        .zip(packed.chunks_exact_mut(128))
        .zip(scale.chunks_exact_mut(8))
        .zip(min.chunks_exact_mut(8))
    {
        let blk: &[u8; 144] = blk.try_into().expect("chunks_exact(144)");
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        let (sc, m) = k_scale_min(&blk[4..16]);
        for s in 0..8 {
            s8[s] = d * sc[s] as f32;
            m8[s] = -(dmin * m[s] as f32);
        }
        for j in 0..4 {
            let q: &[u8; 32] = blk[16 + 32 * j..][..32].try_into().expect("32 bytes");
            let (lo, hi) = p[32 * j..][..32].split_at_mut(16);
            for k in 0..16 {
                // Sub-block 2j: low nibbles; eddy byte k = code k | code k+16 << 4.
                lo[k] = (q[k] & 15) | (q[k + 16] << 4);
                // Sub-block 2j+1: high nibbles.
                hi[k] = (q[k] >> 4) | (q[k + 16] & 0xF0);
            }
        }
    }
    Int4Matrix {
        rows,
        cols,
        packed,
        scale,
        min,
    }
}

/// Q8_0, Q5_0 (group 32) and Q6_K (group 16): codes and scales carried over exactly.
fn import_int8_exact(t: u32, rows: usize, cols: usize, n: usize, bytes: &[u8]) -> Int8Matrix {
    let group = if t == gt::Q6_K { 16 } else { 32 };
    let groups = n / group;
    let mut q = vec![0i8; n];
    let mut scale = vec![0f32; groups];
    let mut qsum = vec![0i32; groups];
    match t {
        gt::Q8_0 => {
            for (((blk, qo), s), sum) in bytes
                .chunks_exact(34)
                .zip(q.chunks_exact_mut(32))
                .zip(&mut scale)
                .zip(&mut qsum)
            {
                *s = f16_at(blk, 0);
                let mut acc = 0i32;
                for (o, &b) in qo.iter_mut().zip(&blk[2..34]) {
                    *o = b as i8;
                    acc += b as i8 as i32;
                }
                *sum = acc;
            }
        }
        gt::Q5_0 => {
            for (((blk, qo), s), sum) in bytes
                .chunks_exact(22)
                .zip(q.chunks_exact_mut(32))
                .zip(&mut scale)
                .zip(&mut qsum)
            {
                *s = f16_at(blk, 0);
                let codes = q5_codes(
                    u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]),
                    &blk[6..22],
                );
                let mut acc = 0i32;
                for (o, &c) in qo.iter_mut().zip(&codes) {
                    *o = c as i8 - 16;
                    acc += c as i32 - 16;
                }
                *sum = acc;
            }
        }
        _ => {
            for (((blk, qo), s16), sum16) in bytes
                .chunks_exact(210)
                .zip(q.chunks_exact_mut(256))
                .zip(scale.chunks_exact_mut(16))
                .zip(qsum.chunks_exact_mut(16))
            {
                let blk: &[u8; 210] = blk.try_into().expect("chunks_exact(210)");
                let d = f16_at(blk, 208);
                let codes = q6k_codes(blk);
                qo.copy_from_slice(&codes);
                for g in 0..16 {
                    s16[g] = d * blk[192 + g] as i8 as f32;
                    sum16[g] = codes[16 * g..][..16].iter().map(|&c| c as i32).sum();
                }
            }
        }
    }
    Int8Matrix {
        rows,
        cols,
        group,
        q,
        scale,
        qsum,
    }
}

/// Symmetric int8 quantization of one group: returns (scale, Σ codes). `q = round(w / s)`, `s = max|w|/127`.
#[inline(always)]
fn quantize_group_q8(w: &[f32], out: &mut [i8]) -> (f32, i32) {
    let amax = w.iter().fold(0f32, |a, &x| a.max(x.abs()));
    let s = amax / 127.0;
    if s == 0.0 || !s.is_finite() {
        out.fill(0);
        return (if s.is_finite() { s } else { 0.0 }, 0);
    }
    let mut acc = 0i32;
    for (o, &x) in out.iter_mut().zip(w) {
        let q = (x / s).round().clamp(-127.0, 127.0) as i8;
        *o = q;
        acc += q as i32;
    }
    (s, acc)
}

/// Q5_1, Q5_K: dequantize each block, requantize each group of 32 to symmetric int8.
fn import_requant(t: u32, rows: usize, cols: usize, n: usize, bytes: &[u8]) -> Int8Matrix {
    let (bv, bb) = gt::block_size(t).expect("supported type");
    let groups = n / QK;
    let mut q = vec![0i8; n];
    let mut scale = vec![0f32; groups];
    let mut qsum = vec![0i32; groups];
    let gpb = bv / QK;
    let mut w = [0f32; 256];
    for (((blk, qo), s), sum) in bytes
        .chunks_exact(bb)
        .zip(q.chunks_exact_mut(bv))
        .zip(scale.chunks_exact_mut(gpb))
        .zip(qsum.chunks_exact_mut(gpb))
    {
        dequant_block(t, blk, &mut w[..bv]);
        for g in 0..gpb {
            (s[g], sum[g]) = quantize_group_q8(&w[QK * g..][..QK], &mut qo[QK * g..][..QK]);
        }
    }
    Int8Matrix {
        rows,
        cols,
        group: QK,
        q,
        scale,
        qsum,
    }
}

/// Quantize a row-major `rows × cols` f32 matrix (e.g. from safetensors, for `--quant q8|q4`).
///
/// [`QuantKind::Q8`]: [`Int8Matrix`] group 32, `s = max|w|/127`, `q = round(w/s)` (error ≤ `s/2`).
/// [`QuantKind::Q4`]: [`Int4Matrix`] group 32, `min` = the group's minimum, `s = (max − min)/15`,
/// `q = round((w − min)/s)` (error ≤ `s/2`). If `cols` is not a multiple of 32 the matrix is returned as
/// `WeightMatrix::F32` unchanged. Non-finite inputs give meaningless codes (but no panic).
///
/// # Panics
/// If `data.len() != rows * cols`.
pub fn quantize_f32(rows: usize, cols: usize, data: &[f32], kind: QuantKind) -> WeightMatrix {
    assert_eq!(
        Some(data.len()),
        rows.checked_mul(cols),
        "quantize_f32: data is not rows × cols"
    );
    let n = data.len();
    if cols % QK != 0 {
        return WeightMatrix::F32 {
            rows,
            cols,
            data: data.to_vec(),
        };
    }
    let groups = n / QK;
    match kind {
        QuantKind::Q8 => {
            let mut q = vec![0i8; n];
            let mut scale = vec![0f32; groups];
            let mut qsum = vec![0i32; groups];
            for (((w, qo), s), sum) in data
                .chunks_exact(QK)
                .zip(q.chunks_exact_mut(QK))
                .zip(&mut scale)
                .zip(&mut qsum)
            {
                (*s, *sum) = quantize_group_q8(w, qo);
            }
            WeightMatrix::Int8(Int8Matrix {
                rows,
                cols,
                group: QK,
                q,
                scale,
                qsum,
            })
        }
        QuantKind::Q4 => {
            let mut packed = vec![0u8; n / 2];
            let mut scale = vec![0f32; groups];
            let mut min = vec![0f32; groups];
            for (((w, p), s), m) in data
                .chunks_exact(QK)
                .zip(packed.chunks_exact_mut(QK / 2))
                .zip(&mut scale)
                .zip(&mut min)
            {
                let (lo, hi) = w
                    .iter()
                    .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                        (lo.min(x), hi.max(x))
                    });
                let d = (hi - lo) / 15.0;
                *m = lo;
                if d == 0.0 || !d.is_finite() {
                    *s = 0.0;
                    p.fill(0);
                    continue;
                }
                *s = d;
                let code = |x: f32| ((x - lo) / d).round().clamp(0.0, 15.0) as u8;
                for k in 0..QK / 2 {
                    p[k] = code(w[k]) | (code(w[k + 16]) << 4);
                }
            }
            WeightMatrix::Int4(Int4Matrix {
                rows,
                cols,
                packed,
                scale,
                min,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(name: &str, dims: Vec<u64>, ggml_type: u32) -> TensorInfo {
        TensorInfo {
            name: name.into(),
            dims,
            ggml_type,
            offset: 0,
            nbytes: 0,
        }
    }

    #[test]
    fn quantize_f32_round_trip_error_is_bounded() {
        let (rows, cols) = (3, 64);
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for kind in [QuantKind::Q8, QuantKind::Q4] {
            let m = quantize_f32(rows, cols, &data, kind);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                m.dequant_row(r, &mut row);
                for g in 0..cols / QK {
                    let w = &data[r * cols + g * QK..][..QK];
                    let (lo, hi) = w
                        .iter()
                        .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                    let step = match kind {
                        QuantKind::Q8 => lo.abs().max(hi.abs()) / 127.0,
                        QuantKind::Q4 => (hi - lo) / 15.0,
                    };
                    for (a, b) in row[g * QK..][..QK].iter().zip(w) {
                        assert!(
                            (a - b).abs() <= step * 0.5001 + 1e-7,
                            "{kind:?}: {a} vs {b}"
                        );
                    }
                }
            }
            if let WeightMatrix::Int8(m) = &m {
                for (g, &s) in m.qsum.iter().enumerate() {
                    assert_eq!(
                        s,
                        m.q[g * 32..][..32].iter().map(|&q| q as i32).sum::<i32>()
                    );
                }
            }
        }
        assert!(matches!(
            quantize_f32(1, 31, &[0.5; 31], QuantKind::Q4),
            WeightMatrix::F32 { .. }
        ));
        assert!(matches!(
            quantize_f32(2, 32, &[0.0; 64], QuantKind::Q8),
            WeightMatrix::Int8(_)
        ));
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
        let WeightMatrix::F32 {
            rows: 2,
            cols: 16,
            data,
        } = m
        else {
            panic!("expected F32")
        };
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
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    (x >> 56) as u8
                })
                .collect();
            let n = bytes.len() / bb * bv;
            let i = info("g", vec![n as u64 / 2, 2], t);
            let _ = import_matrix(Path::new("g"), &i, &bytes).unwrap();
            let _ = dequantize(Path::new("g"), &i, &bytes).unwrap();
            assert!(import_matrix(Path::new("g"), &i, &bytes[1..]).is_err());
            let odd = info("g", vec![u64::MAX, 3], t);
            assert!(import_matrix(Path::new("g"), &odd, &bytes).is_err());
        }
    }
}
