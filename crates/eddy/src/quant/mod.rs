//! eddy's weight formats and the import of GGUF block types into them.
//!
//! A weight matrix has `rows` output features and `cols` input features, stored row-major and
//! quantized along `cols` in groups (the group never straddles rows):
//!
//! * [`Int4Matrix`]: unsigned 4-bit codes `q ∈ [0, 15]` with an f32 scale `s` and an f32 offset `m` per
//!   group of 32: `w = s·q + m` (equivalently a zero point `z = −m/s`). Imports Q4_0, Q4_1 and Q4_K exactly.
//! * [`Int8Matrix`]: signed 8-bit codes with one f32 scale per group of 32 (or 16 for Q6_K):
//!   `w = s·q`. Imports Q8_0, Q5_0 and Q6_K exactly; Q5_1/Q5_K are requantized (nearly exact).
//! * `F32` / `Bf16`: small or unquantized tensors.
//!
//! Products against these run with int8 activations ([`crate::backend::cpu::QuantizedActivations`]),
//! see `backend::cpu::matmul`.

pub mod import;

/// Number of values that share one activation scale, and the int4 group size.
pub const QK: usize = 32;

/// int4 weights with a scale and offset per group of [`QK`] along each row.
#[derive(Debug, Clone)]
pub struct Int4Matrix {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// `rows * cols / 2` bytes. Group g of row r occupies bytes `[(r*cols + g*32)/2, +16)`; byte `j` of a
    /// group holds element `j` in its low nibble and element `j + 16` in its high nibble.
    pub packed: Vec<u8>,
    /// Per group scale `s`, `rows * cols / 32` entries, row-major.
    pub scale: Vec<f32>,
    /// Per group offset `m` (the value of code 0), same indexing as `scale`.
    pub min: Vec<f32>,
}

/// int8 weights with one symmetric scale per group.
#[derive(Debug, Clone)]
pub struct Int8Matrix {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Group size along a row: 32 or 16.
    pub group: usize,
    /// `rows * cols` codes in `[-127, 127]` (Q6_K imports use `[-32, 31]`), row-major.
    pub q: Vec<i8>,
    /// Per group scale, `rows * cols / group` entries.
    pub scale: Vec<f32>,
    /// Per group sum of the codes, same indexing as `scale` (lets kernels that shift activations to
    /// unsigned undo the shift: `Σ q·x = Σ q·(x+128) − 128·Σ q`).
    pub qsum: Vec<i32>,
}

/// A 2-D weight in one of eddy's formats.
#[derive(Debug, Clone)]
pub enum WeightMatrix {
    /// `rows × cols` f32, row-major.
    F32 { rows: usize, cols: usize, data: Vec<f32> },
    /// `rows × cols` bf16 bit patterns, row-major.
    Bf16 { rows: usize, cols: usize, data: Vec<u16> },
    /// See [`Int4Matrix`].
    Int4(Int4Matrix),
    /// See [`Int8Matrix`].
    Int8(Int8Matrix),
}

impl WeightMatrix {
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            WeightMatrix::F32 { rows, .. } | WeightMatrix::Bf16 { rows, .. } => *rows,
            WeightMatrix::Int4(m) => m.rows,
            WeightMatrix::Int8(m) => m.rows,
        }
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            WeightMatrix::F32 { cols, .. } | WeightMatrix::Bf16 { cols, .. } => *cols,
            WeightMatrix::Int4(m) => m.cols,
            WeightMatrix::Int8(m) => m.cols,
        }
    }
    /// Bytes the weights occupy in memory (codes plus scales); what one GEMV streams.
    pub fn nbytes(&self) -> usize {
        match self {
            WeightMatrix::F32 { data, .. } => data.len() * 4,
            WeightMatrix::Bf16 { data, .. } => data.len() * 2,
            WeightMatrix::Int4(m) => m.packed.len() + 8 * m.scale.len(),
            WeightMatrix::Int8(m) => m.q.len() + 8 * m.scale.len(),
        }
    }
    /// Dequantize row `r` into `out` (`cols` values). Used for embedding lookup and as the reference.
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let cols = self.cols();
        assert_eq!(out.len(), cols);
        match self {
            WeightMatrix::F32 { data, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            WeightMatrix::Bf16 { data, .. } => {
                for (o, &b) in out.iter_mut().zip(&data[r * cols..(r + 1) * cols]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            WeightMatrix::Int4(m) => {
                let gpr = cols / QK;
                for g in 0..gpr {
                    let gi = r * gpr + g;
                    let bytes = &m.packed[(r * cols + g * QK) / 2..][..QK / 2];
                    let (s, mn) = (m.scale[gi], m.min[gi]);
                    for j in 0..QK / 2 {
                        out[g * QK + j] = s * (bytes[j] & 15) as f32 + mn;
                        out[g * QK + j + 16] = s * (bytes[j] >> 4) as f32 + mn;
                    }
                }
            }
            WeightMatrix::Int8(m) => {
                let gpr = cols / m.group;
                for g in 0..gpr {
                    let s = m.scale[r * gpr + g];
                    for j in 0..m.group {
                        out[g * m.group + j] = s * m.q[r * cols + g * m.group + j] as f32;
                    }
                }
            }
        }
    }
}
