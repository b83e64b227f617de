//! The block-diagonal random Hadamard rotation (RHT) of eddy's M/L formats (`docs/quant-formats.md`).
//!
//! A weight matrix `W` (`rows × cols`, out × in) is stored as `W′ = H·D_out·W·D_in·H`, where `H` is
//! block-diagonal with normalized Sylvester–Hadamard blocks (symmetric, `H·H = I`) and `D_in`, `D_out`
//! are diagonal matrices of random ±1 signs stored with the weights. Rotating spreads a group's outliers
//! over the 32 values of its block, so a group's scale is not spent on one spike. At run time
//! `x̃ = H·(D_in ⊙ x)` (input side, fused into the int8 activation quantizer), `ỹ = W′·x̃`, and
//! `y = D_out ⊙ (H·ỹ)` (output side, fused into the product's epilogue), so `y = W·x` up to rounding.
//!
//! # Blocks
//! A vector of length `n` is cut into [`BLOCK`] = 32 values per block; a tail of `n % 32` values is cut
//! into power-of-two blocks in decreasing order (its binary digits: 24 → 16 + 8, 5 → 4 + 1), each with its
//! own normalized Hadamard (size 1 = identity). The matrix stays orthogonal and symmetric for every `n`,
//! so rows that are not a multiple of 32 are rotated too. (Columns are a multiple of 32 for every matrix
//! that is quantized, see [`crate::quant::rtn`].)

use std::sync::Arc;

/// Values per Hadamard block (the activation group of the int8 quantizer).
pub const BLOCK: usize = 32;

/// The normalized Hadamard blocks of a vector of length `n`: `(start, len)` in order (see the module docs).
pub fn blocks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    let full = n / BLOCK;
    let tail = n % BLOCK;
    let mut at = full * BLOCK;
    let tails = (0..5).rev().filter(move |b| tail & (1 << b) != 0).map(move |b| {
        let s = at;
        at += 1 << b;
        (s, 1usize << b)
    });
    (0..full).map(|i| (i * BLOCK, BLOCK)).chain(tails)
}

/// `v ← H_n·v` for one normalized Sylvester–Hadamard block (`n = v.len()` a power of two ≤ 32): the
/// fast Walsh–Hadamard butterfly `(a, b) → (a + b, a − b)` over strides 1, 2, …, n/2, then `× 1/√n`.
#[inline]
pub fn fwht(v: &mut [f32]) {
    let n = v.len();
    debug_assert!(n.is_power_of_two() && n <= BLOCK);
    let mut h = 1;
    while h < n {
        for i in (0..n).step_by(2 * h) {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
        }
        h *= 2;
    }
    if n > 1 {
        let s = 1.0 / (n as f32).sqrt();
        v.iter_mut().for_each(|x| *x *= s);
    }
}

/// `v ← H·v` with the block-diagonal `H` of `v.len()` (see the module docs).
pub fn hadamard(v: &mut [f32]) {
    for (s, n) in blocks(v.len()) {
        fwht(&mut v[s..s + n]);
    }
}

/// Random ±1 signs of one side of a rotation, with an identity for run-time checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Signs {
    /// A hash of the signs (never 0): the activation quantizer tags its output with the input signs'
    /// `id`, and a product checks it against its weights' (activations rotated for other weights are
    /// refused).
    pub id: u64,
    /// `±1.0` per feature.
    pub v: Vec<f32>,
}

impl Signs {
    /// Signs from their values (each must be `±1.0`; anything `< 0` counts as −1).
    pub fn new(v: Vec<f32>) -> Self {
        let v: Vec<f32> = v.into_iter().map(|s| if s < 0.0 { -1.0 } else { 1.0 }).collect();
        // FNV-1a over the sign bits and the length.
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        for b in v.iter().map(|&s| (s < 0.0) as u64).chain([v.len() as u64]) {
            h = (h ^ b).wrapping_mul(0x0100_0000_01b3);
        }
        Signs { id: h.max(1), v }
    }

    /// `n` random signs from `seed` (SplitMix64, one bit per sign): the same `(n, seed)` always gives the
    /// same signs.
    pub fn random(n: usize, seed: u64) -> Self {
        let mut s = seed;
        let mut bits = 0u64;
        let v = (0..n)
            .map(|i| {
                if i % 64 == 0 {
                    bits = splitmix64(&mut s);
                }
                if (bits >> (i % 64)) & 1 == 1 {
                    -1.0
                } else {
                    1.0
                }
            })
            .collect();
        Signs::new(v)
    }

    /// Number of features.
    pub fn len(&self) -> usize {
        self.v.len()
    }

    /// Whether there are no features.
    pub fn is_empty(&self) -> bool {
        self.v.is_empty()
    }
}

/// One step of SplitMix64 (Steele, Lea, Flood 2014).
pub fn splitmix64(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rotation of one weight matrix: `W′ = H·D_out·W·D_in·H`, either side optional (`None` = that side
/// is not rotated: `D = I` and no `H`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Rotation {
    /// `D_in` (`cols` signs); the activations must be rotated with the same signs.
    pub input: Option<Arc<Signs>>,
    /// `D_out` (`rows` signs).
    pub output: Option<Arc<Signs>>,
}

impl Rotation {
    /// `x ← H·(D_in ⊙ x)` for one activation row (`cols` values); no-op without input signs.
    pub fn rotate_input(&self, x: &mut [f32]) {
        if let Some(s) = &self.input {
            assert_eq!(x.len(), s.len(), "input rotation: row of {} values for {} signs", x.len(), s.len());
            x.iter_mut().zip(&s.v).for_each(|(x, s)| *x *= s);
            hadamard(x);
        }
    }

    /// `y ← D_out ⊙ (H·y)` for one output row (`rows` values); no-op without output signs.
    pub fn rotate_output(&self, y: &mut [f32]) {
        if let Some(s) = &self.output {
            assert_eq!(y.len(), s.len(), "output rotation: row of {} values for {} signs", y.len(), s.len());
            hadamard(y);
            y.iter_mut().zip(&s.v).for_each(|(y, s)| *y *= s);
        }
    }

    /// `w ← H·D_out·w·D_in·H` for a row-major `rows × cols` matrix (the offline transform).
    pub fn rotate_matrix(&self, w: &mut [f32], rows: usize, cols: usize) {
        assert_eq!(w.len(), rows * cols, "rotate_matrix: data is not rows × cols");
        if self.input.is_some() {
            // Row i of W·D_in·H is H·(D_in ⊙ row i) (H symmetric).
            w.chunks_exact_mut(cols).for_each(|row| self.rotate_input(row));
        }
        if let Some(s) = &self.output {
            assert_eq!(s.len(), rows, "output rotation: {rows} rows for {} signs", s.len());
            for (row, &sg) in w.chunks_exact_mut(cols).zip(&s.v) {
                row.iter_mut().for_each(|x| *x *= sg);
            }
            rows_hadamard(w, rows, cols);
        }
    }

    /// `w ← D_out·H·w·H·D_in` (the inverse of [`Rotation::rotate_matrix`]).
    pub fn unrotate_matrix(&self, w: &mut [f32], rows: usize, cols: usize) {
        assert_eq!(w.len(), rows * cols, "unrotate_matrix: data is not rows × cols");
        if let Some(s) = &self.output {
            assert_eq!(s.len(), rows, "output rotation: {rows} rows for {} signs", s.len());
            rows_hadamard(w, rows, cols);
            for (row, &sg) in w.chunks_exact_mut(cols).zip(&s.v) {
                row.iter_mut().for_each(|x| *x *= sg);
            }
        }
        if let Some(s) = &self.input {
            for row in w.chunks_exact_mut(cols) {
                hadamard(row);
                row.iter_mut().zip(&s.v).for_each(|(x, s)| *x *= s);
            }
        }
    }
}

/// `w ← H·w` along the row axis (each column transformed), butterflies on whole rows.
fn rows_hadamard(w: &mut [f32], rows: usize, cols: usize) {
    for (s, n) in blocks(rows) {
        let blk = &mut w[s * cols..(s + n) * cols];
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = blk.split_at_mut((j + h) * cols);
                    for (x, y) in a[j * cols..(j + 1) * cols].iter_mut().zip(&mut b[..cols]) {
                        let (p, q) = (*x, *y);
                        *x = p + q;
                        *y = p - q;
                    }
                }
            }
            h *= 2;
        }
        if n > 1 {
            let sc = 1.0 / (n as f32).sqrt();
            blk.iter_mut().for_each(|x| *x *= sc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dense `H` of size `n` (columns = `hadamard` of the unit vectors), in f64.
    fn dense(n: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|j| {
                let mut e = vec![0f32; n];
                e[j] = 1.0;
                hadamard(&mut e);
                e.into_iter().map(|v| v as f64).collect()
            })
            .collect()
    }

    fn rand_heavy(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                let u = (splitmix64(&mut s) >> 11) as f64 / (1u64 << 53) as f64;
                let sign = if splitmix64(&mut s) & 1 == 0 { 1.0 } else { -1.0 };
                // Student-t-like tail: |v| = 0.01 / (1 − u)^(1/2), never zero.
                (sign * 0.01 / (1.0 - u).max(1e-6).sqrt()) as f32
            })
            .collect()
    }

    #[test]
    fn blocks_cover_every_length_with_power_of_two_pieces() {
        assert_eq!(blocks(64).collect::<Vec<_>>(), vec![(0, 32), (32, 32)]);
        assert_eq!(blocks(56).collect::<Vec<_>>(), vec![(0, 32), (32, 16), (48, 8)]);
        assert_eq!(blocks(5).collect::<Vec<_>>(), vec![(0, 4), (4, 1)]);
        for n in 0..200 {
            let mut at = 0;
            for (s, len) in blocks(n) {
                assert_eq!(s, at);
                assert!(len.is_power_of_two() && len <= BLOCK);
                at += len;
            }
            assert_eq!(at, n);
        }
    }

    /// `H` is orthogonal and symmetric (so `H·H = I`) for full blocks and every tail shape, to f32 rounding.
    #[test]
    fn hadamard_is_orthogonal_and_symmetric() {
        for n in [1, 2, 7, 31, 32, 33, 56, 96, 100] {
            let h = dense(n);
            for i in 0..n {
                for j in 0..n {
                    assert!((h[i][j] - h[j][i]).abs() < 1e-7, "n {n}: not symmetric at {i},{j}");
                    let dot: f64 = (0..n).map(|k| h[i][k] * h[j][k]).sum();
                    let want = if i == j { 1.0 } else { 0.0 };
                    assert!((dot - want).abs() < 1e-6, "n {n}: H·Hᵀ[{i}][{j}] = {dot}");
                }
            }
            // Entries are ±1/√len of their block.
            let nz = h[0].iter().filter(|v| v.abs() > 1e-9).count();
            assert_eq!(nz, blocks(n).next().map_or(0, |b| b.1));
        }
    }

    #[test]
    fn random_signs_are_seeded_and_balanced() {
        let a = Signs::random(4096, 7);
        assert_eq!(a, Signs::random(4096, 7));
        let b = Signs::random(4096, 8);
        assert_ne!(a.id, b.id);
        let neg = a.v.iter().filter(|&&s| s < 0.0).count();
        assert!((1900..2200).contains(&neg), "{neg} negative signs of 4096");
        assert!(a.v.iter().all(|&s| s == 1.0 || s == -1.0));
    }

    /// `D_out·H·(W′·(H·D_in·x)) = W·x` up to f32 rounding, and `unrotate(rotate(W)) = W`, for shapes with
    /// partial row blocks.
    #[test]
    fn rotation_is_exactly_invertible() {
        for (rows, cols) in [(32, 64), (45, 96), (7, 32), (100, 160)] {
            let w = rand_heavy(rows * cols, rows as u64);
            let x = rand_heavy(cols, 99);
            let rot = Rotation { input: Some(Arc::new(Signs::random(cols, 1))), output: Some(Arc::new(Signs::random(rows, 2))) };
            let mut wr = w.clone();
            rot.rotate_matrix(&mut wr, rows, cols);
            assert!(wr.iter().zip(&w).any(|(a, b)| (a - b).abs() > 1e-3), "rotation changed nothing");
            let mut back = wr.clone();
            rot.unrotate_matrix(&mut back, rows, cols);
            let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in back.iter().zip(&w) {
                assert!((a - b).abs() <= 1e-6 * amax, "{a} vs {b}");
            }
            let mut xr = x.clone();
            rot.rotate_input(&mut xr);
            let mut y: Vec<f32> = wr.chunks_exact(cols).map(|r| r.iter().zip(&xr).map(|(a, b)| a * b).sum()).collect();
            rot.rotate_output(&mut y);
            for r in 0..rows {
                let want: f64 = (0..cols).map(|c| w[r * cols + c] as f64 * x[c] as f64).sum();
                let mag: f64 = (0..cols).map(|c| (w[r * cols + c] as f64 * x[c] as f64).abs()).sum();
                assert!((y[r] as f64 - want).abs() <= 1e-5 * mag, "{rows}x{cols} row {r}: {} vs {want}", y[r]);
            }
        }
    }

    /// A spike in one block is spread over the block: its largest value drops by about √32.
    #[test]
    fn rotation_spreads_an_outlier() {
        let mut v = rand_heavy(64, 5);
        v[3] = 100.0;
        let rot = Rotation { input: Some(Arc::new(Signs::random(64, 3))), output: None };
        rot.rotate_input(&mut v);
        let amax = v[..32].iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(amax < 100.0 / 32f32.sqrt() * 1.2, "max after rotation {amax}");
    }
}
