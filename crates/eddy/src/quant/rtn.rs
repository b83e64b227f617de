//! Round-to-nearest quantization of float matrices into eddy's M and L formats (`docs/quant-formats.md`).
//!
//! * **M** ([`Format::M`]): [`QMatrix`] bits 4, asymmetric: per group of `group` ∈ {32, 64, 128} values an
//!   f16 scale `S` and an f16 offset `M` (the zero point, stored as the value of code 0 rather than as a
//!   code: the kernels add `M·Σx` per group, and an f16 offset loses nothing to a rounded integer zero
//!   point), `w ≈ S·q + M`, `q ∈ 0..16`. `M` is the f16 at or below the group's minimum and `S` the f16
//!   at or above `(max − M)/15`, so every value is within `S/2` of its code. Bits per weight:
//!   `4 + 32/group` (5.0, 4.5, 4.25).
//! * **L** ([`Format::L`]): bits 8, symmetric: an f16 scale `S` (at or above `max|w|/127`) per group,
//!   `w ≈ S·(q − 128)`, `q ∈ 1..=255`; `8 + 16/group` bits per weight.
//!
//! Either can be taken after the rotation of [`super::rotation`] (`W′ = H·D_out·W·D_in·H`), which the
//! matrix then carries ([`QMatrix::rotation`]). Matrices whose row length is not a multiple of 32 cannot
//! hold codes (blocks of 32 never straddle rows) and stay `F32`, unrotated.

use super::rotation::Rotation;
use super::{GroupScales, QMatrix, WeightMatrix, QK};
use half::f16;

/// eddy's own weight formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// int4 codes with an f16 scale and offset per group.
    M,
    /// int8 symmetric codes with an f16 scale per group.
    L,
}

impl Format {
    /// Code width in bits.
    pub fn bits(self) -> u8 {
        match self {
            Format::M => 4,
            Format::L => 8,
        }
    }

    /// Bits per weight at `group` values per group (codes plus f16 scales and offsets).
    pub fn bits_per_weight(self, group: usize) -> f64 {
        match self {
            Format::M => 4.0 + 32.0 / group as f64,
            Format::L => 8.0 + 16.0 / group as f64,
        }
    }
}

/// Group sizes the formats (and kernels) support.
pub const GROUPS: [usize; 3] = [32, 64, 128];

/// The f16 nearest to `x` on its side: `≥ x` if `up`, else `≤ x` (finite `x` within f16 range).
pub(crate) fn f16_toward(x: f32, up: bool) -> f16 {
    let h = f16::from_f32(x);
    let v = h.to_f32();
    if !v.is_finite() || (up && v >= x) || (!up && v <= x) {
        return h;
    }
    let b = h.to_bits();
    f16::from_bits(if v == 0.0 {
        if up {
            0x0001
        } else {
            0x8001
        }
    } else if (v > 0.0) == up {
        b + 1
    } else {
        b - 1
    })
}

/// Quantize a row-major `rows × cols` f32 matrix to `format` with `group` values per scale, after
/// rotating it by `rotation` (`Rotation::default()` = none). `cols % 32 != 0` gives `WeightMatrix::F32`
/// of the unrotated data. Non-finite inputs (or values beyond the f16 range) give meaningless codes (but
/// no panic).
///
/// # Panics
/// If `data.len() != rows·cols`, `group` is not one of [`GROUPS`], or the rotation's signs do not match
/// the shape.
pub fn quantize(rows: usize, cols: usize, data: &[f32], format: Format, group: usize, rotation: Rotation) -> WeightMatrix {
    assert_eq!(Some(data.len()), rows.checked_mul(cols), "quantize: data is not rows × cols");
    assert!(GROUPS.contains(&group), "quantize: group {group} (expected 32, 64 or 128)");
    if !cols.is_multiple_of(QK) || !cols.is_multiple_of(group) {
        return WeightMatrix::F32 { rows, cols, data: data.to_vec() };
    }
    let rotated;
    let w = if rotation.input.is_some() || rotation.output.is_some() {
        let mut v = data.to_vec();
        rotation.rotate_matrix(&mut v, rows, cols);
        rotated = v;
        &rotated[..]
    } else {
        data
    };
    let mut m = match format {
        Format::M => quantize_m(rows, cols, w, group),
        Format::L => quantize_l(rows, cols, w, group),
    };
    m.rotation = rotation;
    m.check();
    WeightMatrix::Q(m)
}

/// M format codes of `w` (`rows × cols`, `cols % group == 0`, `group % 32 == 0`), no rotation.
pub(crate) fn quantize_m(rows: usize, cols: usize, w: &[f32], group: usize) -> QMatrix {
    let n = w.len();
    let mut lo = vec![0u8; n / 2];
    let mut scale = Vec::with_capacity(n / group);
    let mut min = Vec::with_capacity(n / group);
    for (g, wg) in w.chunks_exact(group).enumerate() {
        let (l, h) = wg.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)));
        let m16 = f16_toward(l, false);
        let m = m16.to_f32();
        let s16 = f16_toward((h - m) / 15.0, true);
        let s = s16.to_f32();
        min.push(m16);
        let codes = &mut lo[g * group / 2..(g + 1) * group / 2];
        if s == 0.0 || !s.is_finite() || !m.is_finite() {
            scale.push(f16::ZERO);
            codes.fill(0);
            continue;
        }
        scale.push(s16);
        let code = |x: f32| ((x - m) / s).round().clamp(0.0, 15.0) as u8;
        for (b, p) in wg.chunks_exact(QK).zip(codes.chunks_exact_mut(QK / 2)) {
            for k in 0..QK / 2 {
                p[k] = code(b[k]) | (code(b[k + 16]) << 4);
            }
        }
    }
    QMatrix {
        rows,
        cols,
        bits: 4,
        group,
        lo,
        hi: Vec::new(),
        scales: GroupScales::F16 { scale, min: Some(min) },
        packed: None,
        rotation: Rotation::default(),
    }
}

/// L format codes of `w` (`rows × cols`, `cols % group == 0`, `group % 32 == 0`), no rotation.
pub(crate) fn quantize_l(rows: usize, cols: usize, w: &[f32], group: usize) -> QMatrix {
    let n = w.len();
    let mut lo = vec![0u8; n];
    let mut scale = Vec::with_capacity(n / group);
    for (wg, qo) in w.chunks_exact(group).zip(lo.chunks_exact_mut(group)) {
        let amax = wg.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let s16 = f16_toward(amax / 127.0, true);
        let s = s16.to_f32();
        if s == 0.0 || !s.is_finite() {
            scale.push(if s.is_finite() { s16 } else { f16::ZERO });
            qo.fill(128);
            continue;
        }
        scale.push(s16);
        for (o, &x) in qo.iter_mut().zip(wg) {
            *o = ((x / s).round().clamp(-127.0, 127.0) as i32 + 128) as u8;
        }
    }
    QMatrix {
        rows,
        cols,
        bits: 8,
        group,
        lo,
        hi: Vec::new(),
        scales: GroupScales::F16 { scale, min: None },
        packed: None,
        rotation: Rotation::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::rotation::{splitmix64, Signs};
    use super::*;
    use std::sync::Arc;

    /// Heavy-tailed weights: mostly ±[0.001, 0.03), one in 64 an outlier up to ±1, never zero.
    fn heavy(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                let u = (splitmix64(&mut s) >> 40) as f32 / (1u64 << 24) as f32;
                let r = splitmix64(&mut s);
                let mag = if r.is_multiple_of(64) { 0.1 + 0.9 * u } else { 0.001 + 0.029 * u };
                if r & 2 == 0 {
                    mag
                } else {
                    -mag
                }
            })
            .collect()
    }

    fn dequant(m: &WeightMatrix) -> Vec<f32> {
        let (rows, cols) = (m.rows(), m.cols());
        let mut out = vec![0f32; rows * cols];
        for (r, row) in out.chunks_exact_mut(cols).enumerate() {
            m.dequant_row(r, row);
        }
        out
    }

    /// Every value is within half a step of the stored (f16) scale, and the scale is the ideal one to
    /// within one f16 rounding (M: `(max − min)/15`, L: `max|w|/127`), for every group size.
    #[test]
    fn rtn_error_is_within_half_a_step() {
        let (rows, cols) = (5, 256);
        let w = heavy(rows * cols, 11);
        for format in [Format::M, Format::L] {
            for group in GROUPS {
                let q = quantize(rows, cols, &w, format, group, Rotation::default());
                let WeightMatrix::Q(m) = &q else { panic!("not quantized") };
                assert_eq!((m.bits, m.group), (format.bits(), group));
                let back = dequant(&q);
                for r in 0..rows {
                    for g in 0..cols / group {
                        let at = r * cols + g * group;
                        let wg = &w[at..at + group];
                        let (lo, hi) = wg.iter().fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                        let step = m.scale_min(r, g).0;
                        let ideal = match format {
                            Format::M => (hi - lo) / 15.0,
                            Format::L => lo.abs().max(hi.abs()) / 127.0,
                        };
                        assert!(step >= ideal && step <= ideal * 1.002 + 1e-7, "{format:?}/{group}: scale {step} vs {ideal}");
                        for (a, b) in back[at..at + group].iter().zip(wg) {
                            assert!((a - b).abs() <= step * 0.5001 + 1e-7, "{format:?}/{group}: {a} vs {b}");
                        }
                    }
                }
            }
        }
        assert!(matches!(quantize(1, 48, &heavy(48, 1), Format::M, 32, Rotation::default()), WeightMatrix::F32 { .. }));
    }

    /// With the rotation the codes hold `W′`; un-rotating the dequantized `W′` gives `W` back within the
    /// quantization error, and on heavy-tailed weights that error is well below the unrotated one's
    /// (outliers no longer set whole groups' scales).
    #[test]
    fn rotation_lowers_the_error_on_heavy_tails() {
        let (rows, cols) = (100, 256);
        let w = heavy(rows * cols, 23);
        let rot = Rotation { input: Some(Arc::new(Signs::random(cols, 5))), output: Some(Arc::new(Signs::random(rows, 6))) };
        for (format, group) in [(Format::M, 32), (Format::M, 128), (Format::L, 32)] {
            let plain = dequant(&quantize(rows, cols, &w, format, group, Rotation::default()));
            let q = quantize(rows, cols, &w, format, group, rot.clone());
            let WeightMatrix::Q(m) = &q else { panic!("not quantized") };
            assert_eq!(m.rotation, rot);
            // dequant_row undoes the rotation; so does unrotating the stored rows of W′.
            let back = dequant(&q);
            let mut stored = vec![0f32; rows * cols];
            for (r, row) in stored.chunks_exact_mut(cols).enumerate() {
                q.stored_row(r, row);
            }
            rot.unrotate_matrix(&mut stored, rows, cols);
            let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert!(back.iter().zip(&stored).all(|(a, b)| (a - b).abs() <= 1e-6 * amax), "{format:?}/{group}: dequant_row");
            let mse = |v: &[f32]| v.iter().zip(&w).map(|(a, b)| ((a - b) as f64).powi(2)).sum::<f64>() / w.len() as f64;
            let (e_plain, e_rot) = (mse(&plain), mse(&back));
            assert!(e_rot < 0.7 * e_plain, "{format:?}/{group}: rotated MSE {e_rot:e} vs plain {e_plain:e}");
            // Bound: the rotation is orthogonal, so the total squared error equals that of W′, which is at
            // most Σ (S/2)² over its values.
            let mut bound = 0f64;
            for r in 0..rows {
                for g in 0..cols / group {
                    bound += (m.scale_min(r, g).0 as f64 / 2.0).powi(2) * group as f64;
                }
            }
            assert!(e_rot * w.len() as f64 <= bound * 1.001, "{format:?}/{group}: error above the bound");
        }
    }
}
