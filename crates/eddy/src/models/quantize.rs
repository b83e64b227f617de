//! A loaded model re-quantized into eddy's own M/L formats (`docs/quant-formats.md`): every matrix a
//! forward pass multiplies by (and the token embedding) is dequantized to f32 (undoing any rotation it
//! carries), rotated and rounded to nearest by [`crate::quant::rtn::quantize`].
//!
//! Signs: matrices that read the same quantized activations must share their input signs (one activation
//! quantization serves them: q/k/v, gate/up, the Gated DeltaNet input projections); every input site gets
//! its own signs, and every matrix its own output signs, all drawn from one seed. The embedding and the
//! LM head are rotated on the input side only (an embedding lookup then undoes the rotation of one row:
//! `D_in·H·row`), and are stored in L (int8) under either format (llama.cpp's 4-bit types likewise keep
//! the output matrix at 6-8 bits; requantizing SmolLM2-135M's tied embedding to 4 bits alone costs
//! several times the KL of all the other matrices).
//!
//! Group: a matrix whose row length is not a multiple of the asked group (e.g. width 576 at group 128)
//! takes the largest of 64, 32 that divides it; a row length that is not a multiple of 32 stays f32.

use super::{Mixer, Model};
use crate::backend::Cpu;
use crate::quant::rotation::{splitmix64, Rotation, Signs};
use crate::quant::rtn::{self, Format};
use crate::quant::WeightMatrix;
use std::sync::Arc;

/// How [`quantize_model`] stores the matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantizeOptions {
    /// M (int4) or L (int8).
    pub format: Format,
    /// Values per scale: 32, 64 or 128.
    pub group: usize,
    /// Apply the block Hadamard rotation (both sides; input side only for the embedding / LM head).
    pub rotate: bool,
    /// Seed of the random signs.
    pub seed: u64,
}

/// What one input site is: its signs are drawn from `(seed, site)`.
fn site_signs(opts: &QuantizeOptions, site: u64, n: usize) -> Arc<Signs> {
    let mut s = opts.seed ^ site.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    Arc::new(Signs::random(n, splitmix64(&mut s)))
}

/// One matrix to convert: where it is, its input site, whether its output side is rotated.
struct Job<'a> {
    w: &'a mut WeightMatrix,
    site: u64,
    output: bool,
}

/// Re-quantize every matrix of `model` to `opts` (see the module docs), then upload them to the CPU
/// backend (prepack). `progress(done, total)` is called after each matrix. Returns the bits per weight
/// of the converted matrices (codes, scales and offsets over their weights; f32 leftovers count 32).
pub fn quantize_model(model: &mut Model, opts: &QuantizeOptions, progress: &mut dyn FnMut(usize, usize)) -> f64 {
    assert!(rtn::GROUPS.contains(&opts.group), "group {} (expected 32, 64 or 128)", opts.group);
    const HEAD: u64 = u64::MAX;
    let n_layers = model.layers.len() as u64;
    let mut jobs: Vec<Job> = Vec::new();
    jobs.push(Job { w: &mut model.embed, site: HEAD, output: false });
    if let Some(o) = &mut model.output {
        jobs.push(Job { w: o, site: HEAD, output: false });
    }
    let mtp = model.mtp.as_mut().map(|m| (&mut m.fc, &mut m.layer));
    let layers = model.layers.iter_mut().enumerate().map(|(l, layer)| (l as u64, layer));
    let mut all_layers: Vec<(u64, &mut super::Layer)> = layers.collect();
    if let Some((fc, layer)) = mtp {
        jobs.push(Job { w: fc, site: 4 * (n_layers + 1), output: true });
        all_layers.push((n_layers, layer));
    }
    for (l, layer) in all_layers {
        let (a_in, a_out, f_in, f_down) = (4 * l, 4 * l + 1, 4 * l + 2, 4 * l + 3);
        match &mut layer.mixer {
            Mixer::Attention(a) => {
                for w in [&mut a.wq, &mut a.wk, &mut a.wv] {
                    jobs.push(Job { w, site: a_in, output: true });
                }
                jobs.push(Job { w: &mut a.wo, site: a_out, output: true });
            }
            Mixer::DeltaNet(g) => {
                for w in [&mut g.w_qkv, &mut g.w_z, &mut g.w_b, &mut g.w_a] {
                    jobs.push(Job { w, site: a_in, output: true });
                }
                jobs.push(Job { w: &mut g.w_out, site: a_out, output: true });
            }
        }
        jobs.push(Job { w: &mut layer.w_gate, site: f_in, output: true });
        jobs.push(Job { w: &mut layer.w_up, site: f_in, output: true });
        jobs.push(Job { w: &mut layer.w_down, site: f_down, output: true });
    }
    let total = jobs.len();
    let (mut bits, mut weights) = (0f64, 0f64);
    for (i, job) in jobs.into_iter().enumerate() {
        let (rows, cols) = (job.w.rows(), job.w.cols());
        let mut data = vec![0f32; rows * cols];
        for (r, row) in data.chunks_exact_mut(cols).enumerate() {
            job.w.dequant_row(r, row);
        }
        let group = [opts.group, 64, 32].into_iter().find(|&g| g <= opts.group && cols.is_multiple_of(g));
        // The vocabulary matrices (embedding, LM head) stay at 8 bits: the most sensitive matrix, as
        // llama.cpp keeps its output at 6-8 bits in every 4-bit type.
        let format = if job.site == HEAD { Format::L } else { opts.format };
        let new = match group {
            Some(group) => {
                let rotation = if opts.rotate {
                    Rotation {
                        input: Some(site_signs(opts, job.site, cols)),
                        output: job.output.then(|| site_signs(opts, (1u64 << 40) + i as u64, rows)),
                    }
                } else {
                    Rotation::default()
                };
                rtn::quantize(rows, cols, &data, format, group, rotation)
            }
            None => WeightMatrix::F32 { rows, cols, data },
        };
        bits += match (&new, group) {
            (WeightMatrix::Q(_), Some(g)) => format.bits_per_weight(g),
            _ => 32.0,
        } * (rows * cols) as f64;
        weights += (rows * cols) as f64;
        *job.w = new;
        progress(i + 1, total);
    }
    Cpu::upload_all(model.matmul_weights_mut());
    bits / weights
}
