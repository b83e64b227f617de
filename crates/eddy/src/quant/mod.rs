//! eddy's weight formats and the import of GGUF block types into them.
//!
//! A weight matrix has `rows` output features and `cols` input features, stored row-major and
//! quantized along `cols` (groups never straddle rows):
//!
//! * [`QMatrix`]: unsigned `bits`-bit codes (`bits` ∈ {4, 5, 6, 8}) in blocks of 32 values, with a scale
//!   `S` and an offset `M` per group of `group` values (16, 32, 64 or 128): `w = S·q + M`. The scales are f16
//!   per group ([`GroupScales::F16`]) or the k-quant two-level form ([`GroupScales::SuperI8`]); the offset
//!   is explicit or the implicit `M = −2^(bits−1)·S` (symmetric codes). Every GGUF block type eddy reads
//!   is imported into it exactly and at (nearly) its original size, see [`import`]; eddy's own M/L formats
//!   ([`rtn`]) are QMatrix too, optionally with a block Hadamard [`rotation`] (`docs/quant-formats.md`).
//! * `F32` / `Bf16`: small or unquantized tensors.
//!
//! Products against these run with int8 activations ([`crate::backend::cpu::QuantizedActivations`]),
//! see `backend::cpu::matmul`.

pub mod gptq;
pub mod import;
pub mod rotation;
pub mod rtn;

use rotation::Rotation;

/// Values per code block, and per activation scale.
pub const QK: usize = 32;
/// Values per super-block of [`GroupScales::SuperI8`].
pub const QK_SUPER: usize = 256;

/// Super-blocks per row of `cols` values under [`GroupScales::SuperI8`]: each row is cut into super-blocks of
/// [`QK_SUPER`] values from its start, the last one partial (`cols % 256` values) when `cols` is not a
/// multiple of 256 (formats k/k6 on rows of e.g. 896 = 3·256 + 128).
pub const fn super_blocks(cols: usize) -> usize {
    cols.div_ceil(QK_SUPER)
}

/// Index of the super-block (into `d`, `dmin` of [`GroupScales::SuperI8`]) that holds value `(r, c)` of a
/// matrix of `cols` columns: row `r`'s [`super_blocks`] come one after the other.
pub const fn super_block(cols: usize, r: usize, c: usize) -> usize {
    r * super_blocks(cols) + c / QK_SUPER
}

/// Per group scale `S_g` and offset `M_g` of a [`QMatrix`]: `value = S_g·q + M_g`.
#[derive(Debug, Clone)]
pub enum GroupScales {
    /// f16 scale per group (`rows·cols/group` entries, row-major); f16 offset per group, or (`None`)
    /// the implicit `M = −2^(bits−1)·S` (symmetric codes).
    F16 {
        /// Per group scale.
        scale: Vec<half::f16>,
        /// Per group offset (the value of code 0), or `None` for the implicit one.
        min: Option<Vec<half::f16>>,
    },
    /// k-quant two-level scales: `S = d[sb]·sc[g]`, `M = dmin[sb]·mn[g]` (each one f32 product), or the
    /// implicit `M = −2^(bits−1)·S` when `mn` is `None`. `sb` indexes super-blocks of 256 values along
    /// the row (`cols % 256 == 0`; `rows·cols/256` entries, row-major); `sc`/`mn` have one entry per group.
    SuperI8 {
        /// Per group scale multiplier.
        sc: Vec<i8>,
        /// Per group offset multiplier, or `None` for the implicit offset.
        mn: Option<Vec<i8>>,
        /// Per super-block scale.
        d: Vec<f32>,
        /// Per super-block offset scale (empty when `mn` is `None`).
        dmin: Vec<f32>,
    },
}

/// Quantized weights: unsigned `bits`-bit codes in blocks of 32 values plus [`GroupScales`].
///
/// Block `b` of row `r` is block `r·cols/32 + b` of the matrix. Its codes:
/// * `bits` 4/5/6: the low 4 bits in `lo[16·block..][..16]`, byte `j` = element `j` (low nibble) |
///   element `j + 16` (high nibble); the higher bits in `hi[4·(bits−4)·block..]`: `bits − 4` planes of
///   4 bytes (little-endian u32), bit `j` of plane `p` = bit `4 + p` of element `j`.
/// * `bits` 8: `lo[32·block..][..32]`, one byte per code; `hi` is empty.
#[derive(Debug, Clone)]
pub struct QMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32; with [`GroupScales::SuperI8`] the last super-block of a row may be
    /// partial, [`super_blocks`]).
    pub cols: usize,
    /// Code width: 4, 5, 6 or 8; codes are `0 ≤ q < 2^bits`.
    pub bits: u8,
    /// Values per scale along a row: 32; 16 (only with an implicit offset); 64 or 128 (only with
    /// [`GroupScales::F16`]).
    pub group: usize,
    /// Low 4 bits (bits 4/5/6) or whole codes (bits 8); see the type docs.
    pub lo: Vec<u8>,
    /// Bit planes 4 and 5 (bits 5/6); empty otherwise.
    pub hi: Vec<u8>,
    /// Scales and offsets.
    pub scales: GroupScales,
    /// Lane-per-row copy for the AVX-512 kernels ([`QMatrix::prepack`]), or `None`.
    pub packed: Option<Box<Packed>>,
    /// The codes hold `W′ = H·D_out·W·D_in·H` of the matrix `W` they stand for ([`Rotation`]; the default
    /// is no rotation on either side).
    pub rotation: Rotation,
}

/// Rows per [`Packed`] block (one 32-bit vector lane per row).
pub const PACK_ROWS: usize = 16;

/// One 64-byte line of [`Packed`] codes (16 rows × 4 bytes).
#[repr(C, align(64))]
#[derive(Debug, Clone, Copy)]
pub struct Line(pub [u8; 64]);

/// A [`QMatrix`] in lane-per-row order, built once by [`QMatrix::prepack`] for the AVX-512 kernels:
/// 16-row blocks (rows past `rows` are zero codes with zero scales), and in each 32-bit lane `r` of a
/// 64-byte line the data of row `16·rb + r`. Per row block `rb` and code block `b` (32 values) the
/// [`Packed::lines_per_block`] lines at `lines[(rb·cols/32 + b)·L..]`, codes kept at their stored width:
/// * bits 4/5/6: 4 nibble lines; line `j` lane `r` byte `k` = code `8j + k` (low nibble) | code
///   `8j + 4 + k` (high nibble), i.e. the low nibbles are quad `2j`, the high ones quad `2j + 1`.
/// * bits 5: then one line, lane `r` byte `k` bit `i` = bit 4 of code `4i + k`.
/// * bits 6: then two lines `h`, lane `r` byte `k` bits `2i..2i+2` = bits 4..6 of code `4(4h + i) + k`.
/// * bits 8: 8 lines, line `j` lane `r` = codes `4j..4j+4`.
///
/// `scales` holds the same values as the matrix's, in lane order: per row block and group 16 entries
/// (`[rb][g][r]`), and for [`GroupScales::SuperI8`] `d`/`dmin` per row block and super-block 16 entries
/// (`[rb][sb][r]`). Same bytes per weight as the natural layout (plus the zero rows of a last partial
/// block).
#[derive(Debug, Clone)]
pub struct Packed {
    /// Code lines, see the type docs.
    pub lines: Vec<Line>,
    /// Scales and offsets in lane order.
    pub scales: GroupScales,
}

impl Packed {
    /// Lines per row block and code block of 32 values: 4 (bits 4), 5, 6, 8.
    pub const fn lines_per_block(bits: u8) -> usize {
        match bits {
            4 => 4,
            5 => 5,
            6 => 6,
            _ => 8,
        }
    }

    /// Bytes held.
    pub fn nbytes(&self) -> usize {
        64 * self.lines.len() + scales_nbytes(&self.scales)
    }
}

fn scales_nbytes(s: &GroupScales) -> usize {
    match s {
        GroupScales::F16 { scale, min } => 2 * scale.len() + min.as_ref().map_or(0, |m| 2 * m.len()),
        GroupScales::SuperI8 { sc, mn, d, dmin } => sc.len() + mn.as_ref().map_or(0, |m| m.len()) + 4 * (d.len() + dmin.len()),
    }
}

/// `v[row][i]` (`per_row` entries a row) in lane order `[rb][i][r]`, zero for rows past `rows`.
fn lane_order<T: Copy + Default>(v: &[T], rows: usize, per_row: usize) -> Vec<T> {
    let nrb = rows.div_ceil(PACK_ROWS);
    let mut out = vec![T::default(); nrb * per_row * PACK_ROWS];
    for r in 0..rows {
        let (rb, lane) = (r / PACK_ROWS, r % PACK_ROWS);
        for i in 0..per_row {
            out[(rb * per_row + i) * PACK_ROWS + lane] = v[r * per_row + i];
        }
    }
    out
}

impl QMatrix {
    /// Bit planes above the low nibble per block (1 for bits 5, 2 for bits 6, else 0).
    pub fn planes(&self) -> usize {
        if self.bits == 5 || self.bits == 6 {
            self.bits as usize - 4
        } else {
            0
        }
    }

    /// Whether the offset is the implicit `−2^(bits−1)·S`.
    pub fn implicit_min(&self) -> bool {
        match &self.scales {
            GroupScales::F16 { min, .. } => min.is_none(),
            GroupScales::SuperI8 { mn, .. } => mn.is_none(),
        }
    }

    /// The 32 codes of block `blk` (`(r·cols + c)/32` for element `c` of row `r`).
    #[inline]
    pub fn decode_block(&self, blk: usize) -> [u8; QK] {
        let mut q = [0u8; QK];
        if !self.has_natural() {
            return self.decode_packed_block(blk);
        }
        if self.bits == 8 {
            q.copy_from_slice(&self.lo[blk * QK..][..QK]);
            return q;
        }
        let lo = &self.lo[blk * 16..][..16];
        for j in 0..16 {
            q[j] = lo[j] & 15;
            q[j + 16] = lo[j] >> 4;
        }
        let p = self.planes();
        for k in 0..p {
            let at = 4 * (p * blk + k);
            let w = u32::from_le_bytes([self.hi[at], self.hi[at + 1], self.hi[at + 2], self.hi[at + 3]]);
            for (j, q) in q.iter_mut().enumerate() {
                *q |= (((w >> j) & 1) as u8) << (4 + k);
            }
        }
        q
    }

    /// Code of element `c` of row `r`.
    #[inline]
    pub fn code(&self, r: usize, c: usize) -> u8 {
        self.decode_block((r * self.cols + c) / QK)[c % QK]
    }

    /// `(S, M)` of group `g` of row `r` (`g < cols/group`); `M` is `None` for the implicit offset. Each is
    /// formed as the kernels form it (f16 → f32 exactly; `d·sc` and `dmin·mn` one f32 product each).
    #[inline]
    pub fn scale_min(&self, r: usize, g: usize) -> (f32, Option<f32>) {
        let gi = r * (self.cols / self.group) + g;
        match &self.scales {
            GroupScales::F16 { scale, min } => (scale[gi].to_f32(), min.as_ref().map(|m| m[gi].to_f32())),
            GroupScales::SuperI8 { sc, mn, d, dmin } => {
                let sb = super_block(self.cols, r, g * self.group);
                (d[sb] * sc[gi] as f32, mn.as_ref().map(|mn| dmin[sb] * mn[gi] as f32))
            }
        }
    }

    /// Bytes of codes plus scales that one product streams (the packed copy's once the natural codes
    /// are dropped; both layouts have the same size).
    pub fn nbytes(&self) -> usize {
        match &self.packed {
            Some(p) if !self.has_natural() => p.nbytes(),
            _ => self.lo.len() + self.hi.len() + scales_nbytes(&self.scales),
        }
    }

    /// Whether the natural-layout codes (`lo`/`hi`) are held; false after [`QMatrix::drop_natural`].
    pub fn has_natural(&self) -> bool {
        !self.lo.is_empty() || self.rows * self.cols == 0
    }

    /// Free the natural-layout codes of a prepacked matrix (the scales stay: they are small and
    /// [`QMatrix::scale_min`] reads them): the AVX-512 kernels run on the packed copy for every batch
    /// size and [`QMatrix::decode_block`] (embedding rows) reads it too, so memory is not doubled. The
    /// scalar and AVX2 kernels need the natural codes and refuse such a matrix.
    ///
    /// Panics if the matrix is not prepacked.
    pub fn drop_natural(&mut self) {
        assert!(self.packed.is_some(), "drop_natural needs a prepacked matrix");
        self.lo = Vec::new();
        self.hi = Vec::new();
    }

    /// [`QMatrix::decode_block`] from the packed copy (inverse of [`QMatrix::prepack`]'s layout).
    fn decode_packed_block(&self, blk: usize) -> [u8; QK] {
        let p = self.packed.as_ref().expect("QMatrix without codes");
        let nblk = self.cols / QK;
        let (r, b) = (blk / nblk, blk % nblk);
        let (rb, lane) = (r / PACK_ROWS, r % PACK_ROWS);
        let lpb = Packed::lines_per_block(self.bits);
        let ls = &p.lines[(rb * nblk + b) * lpb..][..lpb];
        let mut q = [0u8; QK];
        for k in 0..4 {
            let at = 4 * lane + k;
            if self.bits == 8 {
                for j in 0..8 {
                    q[4 * j + k] = ls[j].0[at];
                }
                continue;
            }
            for j in 0..4 {
                q[8 * j + k] = ls[j].0[at] & 15;
                q[8 * j + 4 + k] = ls[j].0[at] >> 4;
            }
            for i in 0..8 {
                let hb = match self.bits {
                    5 => (ls[4].0[at] >> i) & 1,
                    6 => (ls[4 + i / 4].0[at] >> (2 * (i % 4))) & 3,
                    _ => 0,
                };
                q[4 * i + k] |= hb << 4;
            }
        }
        q
    }

    /// Build [`QMatrix::packed`] (replacing any), the lane-per-row copy the AVX-512 kernels use when
    /// present. Panics if the matrix is inconsistent ([`QMatrix::check`]).
    pub fn prepack(&mut self) {
        self.check();
        self.packed = None;
        let (rows, cols) = (self.rows, self.cols);
        let nblk = cols / QK;
        let nrb = rows.div_ceil(PACK_ROWS);
        let lpb = Packed::lines_per_block(self.bits);
        let mut lines = vec![Line([0; 64]); nrb * nblk * lpb];
        for r in 0..rows {
            let (rb, lane) = (r / PACK_ROWS, r % PACK_ROWS);
            for b in 0..nblk {
                let q = self.decode_block(r * nblk + b);
                let ls = &mut lines[(rb * nblk + b) * lpb..][..lpb];
                for k in 0..4 {
                    let at = 4 * lane + k;
                    if self.bits == 8 {
                        for j in 0..8 {
                            ls[j].0[at] = q[4 * j + k];
                        }
                        continue;
                    }
                    for j in 0..4 {
                        ls[j].0[at] = (q[8 * j + k] & 15) | (q[8 * j + 4 + k] & 15) << 4;
                    }
                    for i in 0..8 {
                        let hb = q[4 * i + k] >> 4;
                        if self.bits == 5 {
                            ls[4].0[at] |= (hb & 1) << i;
                        } else if self.bits == 6 {
                            ls[4 + i / 4].0[at] |= (hb & 3) << (2 * (i % 4));
                        }
                    }
                }
            }
        }
        let wgpr = cols / self.group;
        let scales = match &self.scales {
            GroupScales::F16 { scale, min } => {
                GroupScales::F16 { scale: lane_order(scale, rows, wgpr), min: min.as_ref().map(|m| lane_order(m, rows, wgpr)) }
            }
            GroupScales::SuperI8 { sc, mn, d, dmin } => {
                let sbpr = super_blocks(cols);
                GroupScales::SuperI8 {
                    sc: lane_order(sc, rows, wgpr),
                    mn: mn.as_ref().map(|m| lane_order(m, rows, wgpr)),
                    d: lane_order(d, rows, sbpr),
                    dmin: if mn.is_some() { lane_order(dmin, rows, sbpr) } else { Vec::new() },
                }
            }
        };
        self.packed = Some(Box::new(Packed { lines, scales }));
    }

    /// Panics unless the buffers and parameters are consistent with `rows × cols`.
    pub fn check(&self) {
        let n = self.rows * self.cols;
        assert!(matches!(self.bits, 4 | 5 | 6 | 8), "QMatrix bits must be 4, 5, 6 or 8");
        assert!(self.cols.is_multiple_of(QK), "QMatrix cols must be a multiple of 32");
        let f16 = matches!(self.scales, GroupScales::F16 { .. });
        assert!(
            self.group == 32 || (self.group == 16 && self.bits != 8) || (matches!(self.group, 64 | 128) && f16),
            "QMatrix group must be 32, 16 with bits 4/5/6, or 64/128 with f16 scales"
        );
        assert!(self.cols.is_multiple_of(self.group), "QMatrix cols must be a multiple of the group");
        assert!(self.implicit_min() || (self.group >= 32 && self.bits != 8), "QMatrix: explicit offsets need group ≥ 32 and bits 4/5/6");
        assert!(self.rotation.input.as_ref().is_none_or(|s| s.len() == self.cols), "QMatrix: input signs must number cols");
        assert!(self.rotation.output.as_ref().is_none_or(|s| s.len() == self.rows), "QMatrix: output signs must number rows");
        let lo = if self.bits == 8 { n } else { n / 2 };
        if self.has_natural() {
            assert!(self.lo.len() >= lo && self.hi.len() >= n / QK * 4 * self.planes(), "QMatrix codes too short");
        } else {
            let lines = self.rows.div_ceil(PACK_ROWS) * (self.cols / QK) * Packed::lines_per_block(self.bits);
            assert!(self.packed.as_ref().is_some_and(|p| p.lines.len() >= lines), "QMatrix without natural codes needs its packed copy");
        }
        let ng = n / self.group;
        match &self.scales {
            GroupScales::F16 { scale, min } => {
                assert!(scale.len() >= ng && min.as_ref().is_none_or(|m| m.len() >= ng), "QMatrix scales too short")
            }
            GroupScales::SuperI8 { sc, mn, d, dmin } => {
                let nsb = self.rows * super_blocks(self.cols);
                assert!(sc.len() >= ng && d.len() >= nsb, "QMatrix scales too short");
                assert!(mn.as_ref().is_none_or(|m| m.len() >= ng && dmin.len() >= nsb), "QMatrix offsets too short");
            }
        }
    }
}

/// [`QMatrix::prepack`] every quantized matrix of `ws` not packed yet and drop its natural codes
/// ([`QMatrix::drop_natural`]), on up to `available_parallelism` threads.
pub fn prepack_all(ws: Vec<&mut WeightMatrix>) {
    let todo: Vec<std::sync::Mutex<&mut QMatrix>> = ws
        .into_iter()
        .filter_map(|w| match w {
            WeightMatrix::Q(m) if m.packed.is_none() => Some(std::sync::Mutex::new(m)),
            _ => None,
        })
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(todo.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(m) = todo.get(i) else { break };
                let mut m = m.lock().unwrap_or_else(|e| e.into_inner());
                m.prepack();
                m.drop_natural();
                drop(m);
                release_free_memory();
            });
        }
    });
}

/// Hand free heap pages back to the OS. The natural codes freed by [`prepack_all`] sit in the middle
/// of the allocator's heaps (allocated at import, between other buffers), so without this resident
/// memory would stay at both copies; done after every matrix, the peak stays near one copy.
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; no Rust object is affected.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A 2-D weight in one of eddy's formats.
#[derive(Debug, Clone)]
pub enum WeightMatrix {
    /// `rows × cols` f32, row-major. With a `rotation` ([`Rotation::default`] = none) the stored values
    /// are `W′ = H·D_out·W·D_in·H` and the products rotate their f32 input and output rows themselves
    /// (the rotation alone, without rounding: [`crate::models::quantize::rotate_model`], a check that the
    /// run-time rotations compose to the identity; the CPU runs it, the GPU refuses it).
    F32 { rows: usize, cols: usize, data: Vec<f32>, rotation: Rotation },
    /// `rows × cols` bf16 bit patterns, row-major.
    Bf16 { rows: usize, cols: usize, data: Vec<u16> },
    /// See [`QMatrix`].
    Q(QMatrix),
}

impl WeightMatrix {
    /// Unrotated f32 weights: `rows × cols` values, row-major.
    pub fn f32(rows: usize, cols: usize, data: Vec<f32>) -> WeightMatrix {
        WeightMatrix::F32 { rows, cols, data, rotation: Rotation::default() }
    }
    /// The rotation the stored values carry ([`QMatrix::rotation`], or a rotated f32 matrix's); `None`
    /// for bf16.
    pub fn rotation(&self) -> Option<&Rotation> {
        match self {
            WeightMatrix::F32 { rotation, .. } => Some(rotation),
            WeightMatrix::Bf16 { .. } => None,
            WeightMatrix::Q(m) => Some(&m.rotation),
        }
    }
    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            WeightMatrix::F32 { rows, .. } | WeightMatrix::Bf16 { rows, .. } => *rows,
            WeightMatrix::Q(m) => m.rows,
        }
    }
    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            WeightMatrix::F32 { cols, .. } | WeightMatrix::Bf16 { cols, .. } => *cols,
            WeightMatrix::Q(m) => m.cols,
        }
    }
    /// Bytes the weights occupy in memory (codes plus scales); what one GEMV streams.
    pub fn nbytes(&self) -> usize {
        match self {
            WeightMatrix::F32 { data, .. } => data.len() * 4,
            WeightMatrix::Bf16 { data, .. } => data.len() * 2,
            WeightMatrix::Q(m) => m.nbytes(),
        }
    }
    /// Row `r` of the matrix the weights stand for, into `out` (`cols` values): the embedding lookup and
    /// the reference. For a rotated [`QMatrix`] ([`QMatrix::rotation`]) that is a row of
    /// `W = D_out·H·W′·H·D_in`: the stored row of `W′` ([`WeightMatrix::stored_row`]) transformed by
    /// `D_in·H` (the output side mixes the stored rows of `r`'s Hadamard block, decoded into a temporary).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        let Some(rot) = self.rotation() else { return self.stored_row(r, out) };
        match &rot.output {
            None => self.stored_row(r, out),
            Some(signs) => {
                let (s, n) = rotation::blocks(self.rows()).find(|&(s, n)| r < s + n).expect("row inside the matrix");
                let mut tmp = vec![0f32; self.cols()];
                out.fill(0.0);
                let norm = 1.0 / (n as f32).sqrt();
                for j in 0..n {
                    self.stored_row(s + j, &mut tmp);
                    // H[i][j] of a Sylvester block: (−1)^popcount(i & j) / √n.
                    let h = if ((r - s) & j).count_ones().is_multiple_of(2) { norm } else { -norm };
                    out.iter_mut().zip(&tmp).for_each(|(o, &v)| *o += h * v);
                }
                out.iter_mut().for_each(|o| *o *= signs.v[r]);
            }
        }
        if let Some(signs) = &rot.input {
            rotation::hadamard(out);
            out.iter_mut().zip(&signs.v).for_each(|(o, s)| *o *= s);
        }
    }

    /// Dequantize stored row `r` into `out` (`cols` values), without undoing any rotation.
    ///
    /// [`QMatrix`]: `S·q + M` with an explicit offset; `S·(q − 2^(bits−1))` (one f32 product of an exact
    /// integer) with the implicit one.
    pub fn stored_row(&self, r: usize, out: &mut [f32]) {
        let cols = self.cols();
        assert_eq!(out.len(), cols);
        match self {
            WeightMatrix::F32 { data, .. } => out.copy_from_slice(&data[r * cols..(r + 1) * cols]),
            WeightMatrix::Bf16 { data, .. } => {
                for (o, &b) in out.iter_mut().zip(&data[r * cols..(r + 1) * cols]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
            WeightMatrix::Q(m) => {
                let half = 1i32 << (m.bits - 1);
                let mut q = [0u8; QK];
                for g in 0..cols / m.group {
                    let (s, mn) = m.scale_min(r, g);
                    for c in g * m.group..(g + 1) * m.group {
                        if c % QK == 0 || c == g * m.group {
                            q = m.decode_block((r * cols + c) / QK);
                        }
                        let q = q[c % QK];
                        out[c] = match mn {
                            Some(mn) => s * q as f32 + mn,
                            None => s * (q as i32 - half) as f32,
                        };
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(bits: u8, group: usize) -> QMatrix {
        let (rows, cols) = (2, 32);
        let n = rows * cols;
        QMatrix {
            rows,
            cols,
            bits,
            group,
            lo: vec![0x5a; if bits == 8 { n } else { n / 2 }],
            hi: Vec::new(),
            scales: GroupScales::F16 { scale: vec![half::f16::from_f32(0.5); n / group], min: None },
            packed: None,
            rotation: Rotation::default(),
        }
    }

    /// `check` accepts exactly the (bits, group) pairs the kernels implement: group 32 with bits 4/5/6/8,
    /// group 16 with bits 4/5/6.
    #[test]
    fn check_rejects_what_the_kernels_cannot_run() {
        matrix(4, 16).check();
        matrix(8, 32).check();
        matrix(4, 32).check();
        let bad = std::panic::catch_unwind(|| matrix(8, 16).check());
        assert!(bad.is_err(), "bits 8 with group 16 must be rejected");
    }
}
