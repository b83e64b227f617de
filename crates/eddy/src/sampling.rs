//! Token sampling keyed by (seed, absolute position).
//!
//! The random number used to sample the token at absolute position `p` is `Philox4x32-10(key = seed,
//! counter = p)` (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), so it depends on
//! nothing but the seed and the position. Plain decoding and speculative verification of any tree therefore
//! draw the same sample at the same position: the accept walk only has to follow the target's own samples.
//!
//! Pipeline (as llama.cpp / transformers order it): logit bias → repetition penalty → presence and frequency
//! penalties → temperature → top-k → top-p → min-p → inverse-CDF draw. Temperature 0 is greedy (argmax, lowest id on ties).
//!
//! After the penalties a row is reduced to its candidates ([`row_candidates`]: the first `k` scaled logits in
//! the sampler's order, the count of finite logits and the full row's mass, computed in a fixed order by
//! [`exp_det`] so that a GPU gets the same bits) and the draw reads only those ([`Sampler::sample_candidates`]);
//! a draw that reaches past them runs again over the whole row. A device can thus return the candidates
//! instead of the row and sample exactly what the host would (`docs/cuda.md`, "Sampling on the device").

/// Sampling parameters of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplerParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1 = off).
    pub top_p: f32,
    /// Drop tokens whose probability is below min_p × the top probability (0 = off).
    pub min_p: f32,
    /// CTRL-style repetition penalty (Keskar et al. 2019) over the last `repeat_last_n` tokens:
    /// positive logits are divided by it, negative ones multiplied (1 = off).
    pub repetition_penalty: f32,
    /// Window of previous tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// OpenAI's presence penalty, in [-2, 2]: subtracted once from the logit of every token that occurs
    /// among the generated tokens (0 = off).
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty, in [-2, 2]: subtracted from a token's logit once per occurrence among
    /// the generated tokens (0 = off).
    pub frequency_penalty: f32,
    /// Number of prompt tokens at the start of the history given to [`Sampler::sample`]: the presence
    /// and frequency penalties count only the tokens after them (those generated in this request).
    pub prompt_len: usize,
    /// Seed of the position-keyed generator.
    pub seed: u64,
    /// OpenAI's and llama.cpp's logit bias: `(token id, bias)` pairs, each bias (in [-100, 100], logit
    /// units, or −∞: a ban, llama.cpp's `ID-inf`) added to its token's raw logit before anything else;
    /// −100 all but bans a token, +100 all but forces it. Ids at or beyond a row's length are ignored (callers check them against the vocabulary);
    /// an id listed twice gets both biases. Empty = off.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            prompt_len: 0,
            seed: 0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplerParams {
    /// Check ranges; returns a one-line description of the first bad value.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be in [-2, 2], got {v}"));
            }
        }
        if let Some(&(t, b)) = self.logit_bias.iter().find(|e| !(-100.0..=100.0).contains(&e.1) && e.1 != f32::NEG_INFINITY) {
            return Err(format!("logit_bias of token {t} must be in [-100, 100] or -inf, got {b}"));
        }
        Ok(())
    }

    /// Whether anything changes a row's logits before the temperature (a penalty or a logit bias): then
    /// the sampler reads the whole row, and a device's argmax or candidates, taken from the raw row, cannot
    /// stand for it.
    pub fn modifies_logits(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || !self.logit_bias.is_empty()
    }
}

/// A constraint on the tokens that may be generated (a grammar: JSON schema, tool-call syntax), applied to
/// the logits of every sampled position before the sampler sees them.
///
/// The engine calls [`apply`](Self::apply) on a position's logits, samples, then [`consume`](Self::consume)s
/// the sample, so the mask always describes the position after the tokens consumed so far. With
/// speculation the engine also asks [`accepted_prefix`](Self::accepted_prefix) about each draft branch and
/// drops the nodes the constraint rejects before verifying; the walk samples each node under the mask as
/// plain decoding does, so the output is plain constrained decoding's token for token.
pub trait LogitMask: Send {
    /// Sets the logits of tokens not allowed next to `-inf` (`logits`: one position, the model's vocabulary
    /// size). Returns `false` when no token is allowed (the constraint cannot continue: generation ends).
    fn apply(&mut self, logits: &mut [f32]) -> bool;
    /// Advances past `token` (sampled under the mask).
    fn consume(&mut self, token: u32);
    /// How many leading tokens of `tokens`, continuing what was consumed, the constraint allows (its state
    /// unchanged).
    fn accepted_prefix(&mut self, tokens: &[u32]) -> usize;
    /// Why the constraint allowed no token, when that was a failure (its own error) rather than the end of
    /// what it accepts; `None` otherwise.
    fn failure(&self) -> Option<String> {
        None
    }
}

/// Philox4x32-10: 4×32-bit counter, 2×32-bit key, 10 rounds. Returns 4 random words.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = M0 * c[0] as u64;
        let p1 = M1 * c[2] as u64;
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
        k = [k[0].wrapping_add(W0), k[1].wrapping_add(W1)];
    }
    c
}

/// The uniform number in [0, 1) used at absolute position `pos` under `seed` (53 random bits).
pub fn position_uniform(seed: u64, pos: u64) -> f64 {
    let r = philox4x32([pos as u32, (pos >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    let bits = (((r[0] as u64) << 32) | r[1] as u64) >> 11;
    bits as f64 / (1u64 << 53) as f64
}

/// Index of the largest value (lowest index on ties; NaN never wins).
pub fn argmax(x: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut bv = f32::NEG_INFINITY;
    for (i, &v) in x.iter().enumerate() {
        if v > bv {
            bv = v;
            best = i;
        }
    }
    best as u32
}

/// Candidates a device reduces a logits row to when nothing asks for more ([`Sampler::candidate_count`]).
pub const DEVICE_CANDIDATES: usize = 64;
/// The most candidates a device keeps per row (a top-k above it samples from the full row).
pub const MAX_CANDIDATES: usize = 256;
/// Lanes of the full-vocabulary mass ([`row_candidates`]): value `i` joins lane `i mod MASS_LANES`.
pub const MASS_LANES: usize = 1024;

/// `e^x` for `x ≤ 0` by a fixed sequence of correctly rounded f32 multiplications and additions (no fused
/// ones, so it vectorizes on any x86-64 and a GPU kernel repeating them gets the same bits: `kernels.cu`'s
/// `exp_det`): `x = n·ln 2 + r` with `n = round(x·log₂e)` (to nearest even, by adding and subtracting
/// 1.5·2²³), `r` by Cody–Waite (`ln 2` split into a 15-bit head, whose product with `n` is exact, and a tail),
/// `e^r` by the degree-7 Taylor polynomial in Horner form (`|r| ≤ ln2/2`: truncation below 1e-8), times `2^n`
/// built from its bits: within a few ulp of `e^x`. `x < −87` (where `e^x` nears the smallest normal f32),
/// `−∞` and NaN give 0; `x > 0` is taken as 0.
pub fn exp_det(x: f32) -> f32 {
    const LOG2E: u32 = 0x3fb8_aa3b;
    const LN2_HI: u32 = 0x3f31_7200;
    const LN2_LO: u32 = 0x35bf_be8e;
    const ROUND: f32 = 12_582_912.0;
    /// 1/k! for k = 7, 6, …, 0, as f32.
    const C: [u32; 8] = [0x3950_0d01, 0x3ab6_0b61, 0x3c08_8889, 0x3d2a_aaab, 0x3e2a_aaab, 0x3f00_0000, 0x3f80_0000, 0x3f80_0000];
    let xc = x.clamp(-87.0, 0.0);
    let n = (xc * f32::from_bits(LOG2E) + ROUND) - ROUND;
    let r = xc - n * f32::from_bits(LN2_HI);
    let r = r - n * f32::from_bits(LN2_LO);
    let mut p = f32::from_bits(C[0]);
    for &c in &C[1..] {
        p = p * r + f32::from_bits(c);
    }
    // n ∈ [−126, 0]: 2^n is a normal f32, and so is the product (p > 1 where n = −126).
    let v = p * f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x >= -87.0 {
        v
    } else {
        0.0
    }
}

/// The sampler's order of candidates: scaled logit descending (`total_cmp`), then token id ascending.
fn by_logit(a: &(f32, u32), b: &(f32, u32)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// What sampling at one temperature needs of one logits row, without the row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CandidateRow<'a> {
    /// The first `min(k, n_finite)` candidates in the sampler's order: `(logit · inv_t, token id)`, scaled
    /// logit descending (`total_cmp`), ties by id ascending.
    pub top: &'a [(f32, u32)],
    /// How many logits of the row are finite (the rest never take part).
    pub n_finite: usize,
    /// The full row's mass `Σ exp_det(s_i − max)` over its finite scaled logits `s_i` (max = `top[0].0`),
    /// summed in f64 over [`MASS_LANES`] lanes (value `i` joins lane `i mod MASS_LANES` in index order),
    /// then the lanes in a halving tree (`lane[j] += lane[j + h]`, `h` = 512, 256, …, 1); 0 when the row has
    /// no finite value or its max is infinite.
    pub mass: f64,
}

/// [`CandidateRow`]s of several logits rows (`k` slots per row): a device's answer to a sampled step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Candidates {
    /// Slots per row.
    pub k: usize,
    /// Row `r`'s candidates in `top[r·k..r·k + min(k, n_finite[r])]`.
    pub top: Vec<(f32, u32)>,
    /// Per row: [`CandidateRow::n_finite`].
    pub n_finite: Vec<usize>,
    /// Per row: [`CandidateRow::mass`].
    pub mass: Vec<f64>,
}

impl Candidates {
    /// Room for `n` rows of `k` slots (contents unspecified until filled).
    pub fn reset(&mut self, n: usize, k: usize) {
        self.k = k;
        self.top.clear();
        self.top.resize(n * k, (0.0, 0));
        self.n_finite.clear();
        self.n_finite.resize(n, 0);
        self.mass.clear();
        self.mass.resize(n, 0.0);
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.n_finite.len()
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> CandidateRow<'_> {
        let m = self.k.min(self.n_finite[r]);
        CandidateRow { top: &self.top[r * self.k..r * self.k + m], n_finite: self.n_finite[r], mass: self.mass[r] }
    }

    /// Row `r` computed on the host from `logits` ([`row_candidates`]; `scratch` holds the scaled row).
    pub fn fill_row(&mut self, r: usize, logits: &[f32], inv_t: f32, scratch: &mut Vec<(f32, u32)>) {
        let k = self.k;
        let (n, mass) = row_candidates(logits, inv_t, k, scratch);
        let m = scratch.len();
        self.top[r * k..r * k + m].copy_from_slice(scratch);
        self.n_finite[r] = n;
        self.mass[r] = mass;
    }
}

/// The sampling candidates of one logits row at inverse temperature `inv_t` (the scalar reference of
/// [`crate::backend::Backend::candidate_rows`]): leaves in `top` the first `min(k, n_finite)` of the
/// finite logits scaled by `inv_t` (one f32 product each), in the sampler's order (scaled value descending
/// by `total_cmp`, ties by id ascending), and returns `(n_finite, mass)` as [`CandidateRow`] defines them.
pub fn row_candidates(logits: &[f32], inv_t: f32, k: usize, top: &mut Vec<(f32, u32)>) -> (usize, f64) {
    let n = row_top(logits, inv_t, k, top);
    let max = top.first().map_or(f32::NAN, |e| e.0);
    (n, row_mass(logits, inv_t, max))
}

/// [`row_candidates`] without the mass: the first `min(k, n_finite)` candidates into `top`; returns
/// `n_finite`.
///
/// For `k ≤` [`TOP_SCAN_MAX_K`] one pass in index order keeps the best `k` so far sorted in the sampler's
/// order and inserts a value only when it beats the current `k`-th (a float `<` against it rejects most
/// values; the rest are compared by the sampler's order itself), which leaves exactly the set and order a
/// sort of the whole row gives; larger `k` select and sort the whole scaled row.
pub fn row_top(logits: &[f32], inv_t: f32, k: usize, top: &mut Vec<(f32, u32)>) -> usize {
    top.clear();
    if k > TOP_SCAN_MAX_K {
        top.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l * inv_t, i as u32)));
        let n = top.len();
        if k < n {
            top.select_nth_unstable_by(k.max(1) - 1, by_logit);
            top.truncate(k);
        }
        top.sort_unstable_by(by_logit);
        return n;
    }
    let mut n = 0;
    for (i, &l) in logits.iter().enumerate() {
        if !l.is_finite() {
            continue;
        }
        n += 1;
        let e = (l * inv_t, i as u32);
        if top.len() == k {
            // `s < worst` (never true for a NaN on either side) means worse in the sampler's order too.
            if k == 0 || e.0 < top[k - 1].0 || by_logit(&e, &top[k - 1]) != std::cmp::Ordering::Less {
                continue;
            }
            top.pop();
        }
        let at = top.partition_point(|x| by_logit(x, &e) == std::cmp::Ordering::Less);
        top.insert(at, e);
    }
    n
}

/// Largest `k` for which [`row_top`] keeps a running sorted top-`k` (beyond it, a select over the row).
pub const TOP_SCAN_MAX_K: usize = 64;

/// [`CandidateRow::mass`] of a logits row whose largest finite scaled logit is `max`: 0 when `max` is not
/// finite. On CPUs with AVX2 (and `EDDY_KERNEL` not below it) eight values at a time, by the same f32
/// operations as [`exp_det`] and the same f64 lane additions in the same order, so the same bits.
pub fn row_mass(logits: &[f32], inv_t: f32, max: f32) -> f64 {
    if !max.is_finite() {
        return 0.0;
    }
    let mut lanes = [0f64; MASS_LANES];
    #[cfg(target_arch = "x86_64")]
    let simd = crate::backend::cpu::Kernel::active() >= crate::backend::cpu::Kernel::Avx2;
    #[cfg(not(target_arch = "x86_64"))]
    let simd = false;
    if simd {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 is available (the kernel path says so).
        unsafe {
            mass_lanes_avx2(logits, inv_t, max, &mut lanes)
        };
    } else {
        mass_lanes(logits, inv_t, max, &mut lanes);
    }
    let mut h = MASS_LANES / 2;
    while h > 0 {
        for j in 0..h {
            lanes[j] += lanes[j + h];
        }
        h /= 2;
    }
    lanes[0]
}

/// Add `exp_det(l·inv_t − max)` of every finite `l` to lane `i mod MASS_LANES` (index order), one at a time.
fn mass_lanes(logits: &[f32], inv_t: f32, max: f32, lanes: &mut [f64; MASS_LANES]) {
    // A non-finite logit adds 0 to its lane (a lane is never −0, so that leaves it unchanged).
    for chunk in logits.chunks(MASS_LANES) {
        for (lane, &l) in lanes.iter_mut().zip(chunk) {
            *lane += if l.is_finite() { exp_det(l * inv_t - max) as f64 } else { 0.0 };
        }
    }
}

/// [`mass_lanes`] eight values at a time: [`exp_det`]'s operations on eight lanes (no fused
/// multiply-adds; the clamp as `max`/`min`, whose result is masked out anyway for the NaN and `< −87`
/// inputs where it could differ), each result widened to f64 and added to its lane as the scalar loop adds
/// it. A chunk's tail of fewer than eight values goes through [`exp_det`].
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn mass_lanes_avx2(logits: &[f32], inv_t: f32, max: f32, lanes: &mut [f64; MASS_LANES]) {
    use std::arch::x86_64::*;
    let c = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let (log2e, ln2_hi, ln2_lo) = (c(0x3fb8_aa3b), c(0x3f31_7200), c(0x35bf_be8e));
    let round = _mm256_set1_ps(12_582_912.0);
    let poly = [0x3950_0d01u32, 0x3ab6_0b61, 0x3c08_8889, 0x3d2a_aaab, 0x3e2a_aaab, 0x3f00_0000, 0x3f80_0000, 0x3f80_0000];
    let (lo, hi) = (_mm256_set1_ps(-87.0), _mm256_setzero_ps());
    let (vt, vmax) = (_mm256_set1_ps(inv_t), _mm256_set1_ps(max));
    let inf = _mm256_set1_ps(f32::INFINITY);
    for chunk in logits.chunks(MASS_LANES) {
        let whole = chunk.len() / 8 * 8;
        for j in (0..whole).step_by(8) {
            let l = _mm256_loadu_ps(chunk.as_ptr().add(j));
            // |l| < ∞ is false for ±∞ and NaN: the finite lanes.
            let finite = _mm256_cmp_ps::<_CMP_LT_OQ>(_mm256_andnot_ps(_mm256_set1_ps(-0.0), l), inf);
            let x = _mm256_sub_ps(_mm256_mul_ps(l, vt), vmax);
            let xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
            let n = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(xc, log2e), round), round);
            let r = _mm256_sub_ps(xc, _mm256_mul_ps(n, ln2_hi));
            let r = _mm256_sub_ps(r, _mm256_mul_ps(n, ln2_lo));
            let mut p = c(poly[0]);
            for &k in &poly[1..] {
                p = _mm256_add_ps(_mm256_mul_ps(p, r), c(k));
            }
            let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)));
            let v = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
            // Kept where the logit is finite and x ≥ −87 (false for NaN), else +0.
            let keep = _mm256_and_ps(finite, _mm256_cmp_ps::<_CMP_GE_OQ>(x, lo));
            let v = _mm256_and_ps(v, keep);
            let a = lanes.as_mut_ptr().add(j);
            _mm256_storeu_pd(a, _mm256_add_pd(_mm256_loadu_pd(a), _mm256_cvtps_pd(_mm256_castps256_ps128(v))));
            _mm256_storeu_pd(a.add(4), _mm256_add_pd(_mm256_loadu_pd(a.add(4)), _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v))));
        }
        for (lane, &l) in lanes[whole..].iter_mut().zip(&chunk[whole..]) {
            *lane += if l.is_finite() { exp_det(l * inv_t - max) as f64 } else { 0.0 };
        }
    }
}

/// Reusable sampler state (candidate, weight and token-count buffers, so sampling allocates nothing per
/// token once warm).
/// Adds `bias` to `logits` (ids beyond the row ignored). Bans (−∞) that would leave the row without a
/// finite logit, such as a grammar that allows only the end of text when the end-of-text token is banned,
/// are not applied to that row: what the constraint allows wins over the ban, instead of a token nothing
/// allows.
fn apply_logit_bias(bias: &[(u32, f32)], logits: &mut [f32]) {
    let banned = |i: usize| bias.iter().any(|&(t, b)| t as usize == i && b == f32::NEG_INFINITY);
    let keep_bans = !bias.iter().any(|e| e.1 == f32::NEG_INFINITY) || logits.iter().enumerate().any(|(i, l)| l.is_finite() && !banned(i));
    for &(t, b) in bias {
        if let Some(l) = logits.get_mut(t as usize).filter(|_| keep_bans || b != f32::NEG_INFINITY) {
            *l += b;
        }
    }
}

#[derive(Default)]
pub struct Sampler {
    cand: Vec<(f32, u32)>,
    weights: Vec<f32>,
    generated: Vec<u32>,
}

impl Sampler {
    /// How many candidates per logits row decide sampling under `p` (the `k` of [`row_candidates`] and of
    /// [`crate::backend::Backend::candidate_rows`]): `p.top_k` when set, else [`DEVICE_CANDIDATES`]. `None`
    /// when candidates cannot stand for the row: greedy (temperature 0, or so small that `1/T` overflows:
    /// the argmax decides), a penalty or logit bias ([`SamplerParams::modifies_logits`]: they change logits
    /// the candidates were taken from), or a top-k above [`MAX_CANDIDATES`].
    pub fn candidate_count(p: &SamplerParams) -> Option<usize> {
        let plain = p.temperature > 0.0 && (1.0 / p.temperature).is_finite() && !p.modifies_logits() && p.top_k <= MAX_CANDIDATES;
        plain.then_some(if p.top_k > 0 { p.top_k } else { DEVICE_CANDIDATES })
    }

    /// Sample the token at absolute position `pos` from `logits` (modified in place by the logit bias and
    /// the penalties),
    /// given `history` (all tokens before `pos`, prompt included; its first `p.prompt_len` are the
    /// prompt).
    ///
    /// After the penalties the row is reduced to its candidates ([`row_candidates`]) and
    /// [`Sampler::sample_candidates`] draws from them; when the draw needs more than the first `k` (a
    /// nucleus or a draw reaching past them), it runs again over every finite logit. So a device that
    /// returns a row's candidates instead of the row gets this function's token whenever
    /// `sample_candidates` answers.
    pub fn sample(&mut self, p: &SamplerParams, logits: &mut [f32], history: &[u32], pos: usize) -> u32 {
        if !p.logit_bias.is_empty() {
            apply_logit_bias(&p.logit_bias, logits);
        }
        if p.repetition_penalty != 1.0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            // Each distinct token is penalized once, as in transformers and llama.cpp.
            let recent = &history[start..];
            for (i, &t) in recent.iter().enumerate() {
                if recent[..i].contains(&t) {
                    continue;
                }
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            self.presence_frequency(p, logits, history);
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let inv_t = 1.0 / p.temperature;
        if !inv_t.is_finite() {
            // A subnormal temperature: the limit of sampling as the temperature goes to 0 is greedy.
            return argmax(logits);
        }
        let k = if p.top_k > 0 { p.top_k } else { DEVICE_CANDIDATES };
        let mut top = std::mem::take(&mut self.cand);
        let n = row_top(logits, inv_t, k, &mut top);
        // The mass is read only without an active top-k.
        let mass = if p.top_k > 0 && p.top_k < n { 0.0 } else { row_mass(logits, inv_t, top.first().map_or(f32::NAN, |e| e.0)) };
        let mut y = self.sample_candidates(p, CandidateRow { top: &top, n_finite: n, mass }, pos);
        if y.is_none() && top.len() < n && top[0].0.is_finite() {
            // The draw reaches past the first k: the same draw over all candidates.
            row_top(logits, inv_t, n, &mut top);
            y = self.sample_candidates(p, CandidateRow { top: &top, n_finite: n, mass }, pos);
        }
        self.cand = top;
        // No finite logit, or one whose scaled value overflows to ±∞ at the top (exp(∞ − ∞) = NaN would pick
        // arbitrarily): the greedy limit.
        y.unwrap_or_else(|| argmax(logits))
    }

    /// Sample the token at absolute position `pos` from one row's candidates (`row`, taken at temperature
    /// `p.temperature` with at least `p.top_k` slots), or `None` when they do not decide it: the top-k set,
    /// the nucleus, the min-p survivors or the draw reach past `row.top`, the row has no finite logit, or its
    /// top scaled logit is infinite (then [`Sampler::sample`] on the full row decides).
    ///
    /// The pipeline after the penalties: weights `w_i = exp(s_i − s_0)` (f32) in the sampler's order; the
    /// normalizer is the f64 sum of the top-k weights in that order under an active top-k (`top_k < n`),
    /// else the row's [`CandidateRow::mass`]; top-p keeps the shortest prefix whose normalized running sum
    /// (f64) reaches `top_p`; min-p keeps the prefix with `w_i ≥ min_p` (at least one); the draw
    /// `u·total` (`u` = [`position_uniform`]; `total` = the mass when nothing was cut, else the f64 sum of the
    /// kept weights) is located by the running sum of the kept weights. Every number depends only on the
    /// candidates it reads and on the mass, so any `row.top` that is a prefix of the full order gives the
    /// full row's answer whenever it answers.
    pub fn sample_candidates(&mut self, p: &SamplerParams, row: CandidateRow<'_>, pos: usize) -> Option<u32> {
        let (top, n) = (row.top, row.n_finite);
        let m = top.len();
        if n == 0 || m == 0 || !top[0].0.is_finite() {
            return None;
        }
        let max = top[0].0;
        let top_k = p.top_k > 0 && p.top_k < n;
        let len = if top_k { p.top_k } else { n };
        let w = &mut self.weights;
        w.clear();
        w.extend(top[..len.min(m)].iter().map(|e| (e.0 - max).exp()));
        let sum = if top_k {
            if m < len {
                return None;
            }
            w.iter().fold(0f64, |a, &x| a + x as f64)
        } else {
            row.mass
        };
        // top-p: keep the smallest prefix whose mass reaches top_p.
        let mut keep = len;
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            for i in 0..len {
                acc += *w.get(i)? as f64 / sum;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        // min-p relative to the top probability (the first weight is 1).
        if p.min_p > 0.0 {
            let mut count = 0;
            while count < keep && *w.get(count)? >= p.min_p {
                count += 1;
            }
            keep = count.max(1);
        }
        let total = if keep == n { row.mass } else { w.get(..keep)?.iter().fold(0f64, |a, &x| a + x as f64) };
        let u = position_uniform(p.seed, pos as u64) * total;
        let mut acc = 0f64;
        for (&x, e) in w.iter().zip(top).take(keep) {
            acc += x as f64;
            if u < acc {
                return Some(e.1);
            }
        }
        if keep > w.len() {
            return None;
        }
        Some(top[keep - 1].1)
    }

    /// OpenAI's penalties: `logit[t] -= presence·[count_t > 0] + frequency·count_t`, with `count_t` the
    /// occurrences of `t` in `history` after the prompt.
    fn presence_frequency(&mut self, p: &SamplerParams, logits: &mut [f32], history: &[u32]) {
        let g = &mut self.generated;
        g.clear();
        g.extend_from_slice(history.get(p.prompt_len..).unwrap_or(&[]));
        g.sort_unstable();
        for run in g.chunk_by(|a, b| a == b) {
            if let Some(l) = logits.get_mut(run[0] as usize) {
                *l -= p.presence_penalty + p.frequency_penalty * run.len() as f32;
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn philox_known_answer() {
        // Known-answer vectors from the Random123 distribution (kat_vectors, philox4x32_10).
        assert_eq!(philox4x32([0, 0, 0, 0], [0, 0]), [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]);
        assert_eq!(philox4x32([0xffffffff; 4], [0xffffffff; 2]), [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]);
        assert_eq!(
            philox4x32([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0]),
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1]
        );
    }

    #[test]
    fn greedy_is_argmax_and_ties_pick_lowest() {
        let mut s = Sampler::default();
        let mut l = vec![0.5, 2.0, 2.0, -1.0];
        assert_eq!(s.sample(&SamplerParams::default(), &mut l, &[], 0), 1);
    }

    #[test]
    fn same_seed_and_position_same_token_and_distribution_is_right() {
        let mut s = Sampler::default();
        let p = SamplerParams { temperature: 1.0, seed: 7, ..Default::default() };
        let logits = vec![0.0f32, (2.0f32).ln(), (3.0f32).ln(), f32::NEG_INFINITY];
        let mut counts = [0usize; 4];
        for pos in 0..12000 {
            let a = s.sample(&p, &mut logits.clone(), &[], pos);
            let b = s.sample(&p, &mut logits.clone(), &[], pos);
            assert_eq!(a, b);
            counts[a as usize] += 1;
        }
        // Expected 1/6, 2/6, 3/6; never the -inf token.
        assert_eq!(counts[3], 0);
        for (i, want) in [2000.0, 4000.0, 6000.0].iter().enumerate() {
            assert!((counts[i] as f64 - want).abs() < 250.0, "{counts:?}");
        }
    }

    #[test]
    fn filters() {
        let mut s = Sampler::default();
        let logits = vec![3.0f32, 2.9, 0.0, -5.0];
        for pos in 0..200 {
            let t = s.sample(&SamplerParams { temperature: 1.0, top_k: 1, seed: 1, ..Default::default() }, &mut logits.clone(), &[], pos);
            assert_eq!(t, 0);
            let t = s.sample(&SamplerParams { temperature: 1.0, top_p: 0.5, seed: 1, ..Default::default() }, &mut logits.clone(), &[], pos);
            assert!(t <= 1);
            let t = s.sample(&SamplerParams { temperature: 1.0, min_p: 0.5, seed: 1, ..Default::default() }, &mut logits.clone(), &[], pos);
            assert!(t <= 1);
        }
        // A temperature so small that logit / temperature overflows is greedy, not the least likely token.
        for t in [1e-38f32, 1e-45] {
            let p = SamplerParams { temperature: t, seed: 3, ..Default::default() };
            for pos in 0..20 {
                assert_eq!(s.sample(&p, &mut [10.0f32, 30.0, -20.0, 29.0], &[], pos), 1);
            }
        }
        // Repetition penalty flips a near tie.
        let mut l = vec![1.0f32, 0.9];
        let p = SamplerParams { repetition_penalty: 1.5, ..Default::default() };
        assert_eq!(s.sample(&p, &mut l, &[0], 1), 1);
    }

    #[test]
    fn presence_and_frequency_penalties_count_generated_tokens_only() {
        // Vocabulary of 5; prompt [4, 1], generated [2, 3, 2, 2].
        let history = [4u32, 1, 2, 3, 2, 2];
        let p = SamplerParams { presence_penalty: 0.5, frequency_penalty: 0.25, prompt_len: 2, ..Default::default() };
        let mut s = Sampler::default();
        let mut l = vec![1.0f32, 1.0, 3.0, 2.0, 1.5];
        s.sample(&p, &mut l, &history, history.len());
        // 0, 1 (prompt only) and 4 (prompt only): unchanged; 2: 3 − (0.5 + 3·0.25) = 1.75;
        // 3: 2 − (0.5 + 0.25) = 1.25.
        assert_eq!(l, vec![1.0, 1.0, 1.75, 1.25, 1.5]);
        // Negative values raise the logits; presence alone is per distinct token.
        let p = SamplerParams { presence_penalty: -1.0, prompt_len: 2, ..Default::default() };
        let mut l = vec![0.0f32; 5];
        assert_eq!(s.sample(&p, &mut l, &history, history.len()), 2);
        assert_eq!(l, vec![0.0, 0.0, 1.0, 1.0, 0.0]);
        // Frequency alone, with the repetition penalty applied first (it sees the prompt too).
        let p = SamplerParams { frequency_penalty: 2.0, repetition_penalty: 2.0, prompt_len: 2, ..Default::default() };
        let mut l = vec![1.0f32, 4.0, 8.0, -1.0, 6.0];
        // 1: 4/2 = 2; 2: 8/2 − 3·2 = −2; 3: −1·2 − 2 = −4; 4: 6/2 = 3.
        assert_eq!(s.sample(&p, &mut l, &history, history.len()), 4);
        assert_eq!(l, vec![1.0, 2.0, -2.0, -4.0, 3.0]);
        // Out of range values are refused.
        let bad = SamplerParams { frequency_penalty: 2.5, ..Default::default() };
        assert!(bad.validate().unwrap_err().contains("frequency_penalty"));
    }

    #[test]
    fn logit_bias_is_added_first_and_needs_the_whole_row() {
        let mut s = Sampler::default();
        // Added to the raw logits, before the repetition penalty divides them: (2 + 4) / 2 = 3 beats 2.5;
        // the id beyond the row is ignored; an id listed twice gets both biases.
        let p =
            SamplerParams { repetition_penalty: 2.0, logit_bias: vec![(0, 4.0), (7, 100.0), (1, -1.0), (1, -0.25)], ..Default::default() };
        let mut l = vec![2.0f32, 1.0, 2.5];
        assert_eq!(s.sample(&p, &mut l, &[0], 1), 0);
        assert_eq!(l, vec![3.0, -0.25, 2.5]);
        // −100 bans the likeliest token at any position's draw; +100 forces an unlikely one.
        let logits = [9.0f32, 8.0, 0.5, -3.0];
        for pos in 0..50 {
            let ban = SamplerParams { temperature: 1.0, seed: 5, logit_bias: vec![(0, -100.0)], ..Default::default() };
            assert_ne!(s.sample(&ban, &mut logits.clone(), &[], pos), 0);
            let force = SamplerParams { temperature: 1.0, seed: 5, logit_bias: vec![(3, 100.0)], ..Default::default() };
            assert_eq!(s.sample(&force, &mut logits.clone(), &[], pos), 3);
        }
        // A device's candidates or argmax, taken from the raw row, cannot stand for a biased one.
        let biased = SamplerParams { temperature: 1.0, logit_bias: vec![(2, 0.5)], ..Default::default() };
        assert!(biased.modifies_logits());
        assert_eq!(Sampler::candidate_count(&biased), None);
        assert!(Sampler::candidate_count(&SamplerParams { logit_bias: vec![], ..biased }).is_some());
        // −∞ bans: never drawn, even when everything else is far less likely.
        let ban = SamplerParams { temperature: 1.0, seed: 5, logit_bias: vec![(0, f32::NEG_INFINITY)], ..Default::default() };
        for pos in 0..50 {
            assert_ne!(s.sample(&ban, &mut [50.0f32, -50.0, -60.0], &[], pos), 0);
        }
        assert!(ban.validate().is_ok());
        // A ban that would leave no token (a grammar that allows only the banned one) is not applied.
        let only = SamplerParams { temperature: 1.0, seed: 5, logit_bias: vec![(1, f32::NEG_INFINITY), (2, 3.0)], ..Default::default() };
        let mut row = [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY];
        assert_eq!(s.sample(&only, &mut row, &[], 0), 1);
        assert_eq!(row, [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY]);
        for b in [100.5f32, -101.0, f32::NAN, f32::INFINITY] {
            let bad = SamplerParams { logit_bias: vec![(3, 1.0), (9, b)], ..Default::default() };
            assert!(bad.validate().unwrap_err().starts_with("logit_bias of token 9"), "{b}");
        }
    }

    /// The sampler as it was before candidates (full row, sorted; std `exp`): the reference the
    /// candidate path must match bit for bit under an active top-k, and up to the mass's rounding otherwise.
    fn sample_before(p: &SamplerParams, logits: &[f32], pos: usize) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let mut c: Vec<(f32, u32)> =
            logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l * inv_t, i as u32)).collect();
        if c.is_empty() || c.iter().any(|e| e.0 == f32::INFINITY) {
            return argmax(logits);
        }
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        let max = c[0].0;
        let mut sum = 0f64;
        for e in c.iter_mut() {
            e.0 = (e.0 - max).exp();
            sum += e.0 as f64;
        }
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut acc = 0f64;
            for (i, e) in c.iter().enumerate() {
                acc += e.0 as f64 / sum;
                if acc >= p.top_p as f64 {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            keep = keep.min(c.iter().take_while(|e| e.0 >= p.min_p).count().max(1));
        }
        c.truncate(keep);
        let total: f64 = c.iter().map(|e| e.0 as f64).sum();
        let u = position_uniform(p.seed, pos as u64) * total;
        let mut acc = 0f64;
        for e in c.iter() {
            acc += e.0 as f64;
            if u < acc {
                return e.1;
            }
        }
        c[c.len() - 1].1
    }

    /// A random logits row of `n` values: smooth (distinct values), coarse (many ties: values on a grid of
    /// 0.5) or flat (all equal), with a few non-finite values sprinkled in when `holes`.
    pub(crate) fn random_row(rng: &mut u64, n: usize, kind: usize, holes: bool) -> Vec<f32> {
        let mut next = || {
            *rng ^= *rng << 13;
            *rng ^= *rng >> 7;
            *rng ^= *rng << 17;
            *rng
        };
        (0..n)
            .map(|_| {
                let r = next();
                let u = (r >> 40) as f32 / (1u64 << 24) as f32;
                if holes && r % 97 == 0 {
                    return [f32::NEG_INFINITY, f32::NAN, f32::INFINITY][(r >> 8) as usize % 3];
                }
                match kind {
                    0 => 12.0 * u - 4.0 + if r % 211 == 0 { 8.0 } else { 0.0 },
                    1 => ((16.0 * u) as i32 as f32) * 0.5 - 2.0,
                    _ => 1.25,
                }
            })
            .collect()
    }

    /// The running top-k of [`row_top`] against a sort of the whole scaled row, and the AVX2 mass against
    /// the scalar lanes bit for bit, on random rows (spread, heavy ties, constant; with and without
    /// non-finite holes; lengths that leave chunk tails; −0.0 among the logits).
    #[test]
    fn row_top_and_mass_match_their_references() {
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        for (len, kind, holes) in [(700, 0, false), (700, 1, true), (3000, 0, true), (2053, 2, false), (5, 1, true), (33000, 0, false)] {
            let mut row = random_row(&mut rng, len, kind, holes);
            row[len / 2] = -0.0;
            for inv_t in [1.0f32, 0.37, 1000.0] {
                let mut want: Vec<(f32, u32)> =
                    row.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l * inv_t, i as u32)).collect();
                want.sort_by(by_logit);
                let mut top = Vec::new();
                for k in [0, 1, 8, 40, TOP_SCAN_MAX_K, TOP_SCAN_MAX_K + 1, 10_000] {
                    let n = row_top(&row, inv_t, k, &mut top);
                    assert_eq!(n, want.len(), "len {len} kind {kind} k {k}");
                    let m = k.min(n);
                    assert!(top.len() == m && top.iter().zip(&want[..m]).all(|(a, b)| a.0.to_bits() == b.0.to_bits() && a.1 == b.1));
                }
                let max = want.first().map_or(f32::NAN, |e| e.0);
                if !max.is_finite() {
                    continue;
                }
                let mut lanes = [0f64; MASS_LANES];
                mass_lanes(&row, inv_t, max, &mut lanes);
                #[cfg(target_arch = "x86_64")]
                if std::arch::is_x86_feature_detected!("avx2") {
                    let mut simd = [0f64; MASS_LANES];
                    // SAFETY: AVX2 checked above.
                    unsafe { mass_lanes_avx2(&row, inv_t, max, &mut simd) };
                    assert!(lanes.iter().zip(&simd).all(|(a, b)| a.to_bits() == b.to_bits()), "len {len} kind {kind} inv_t {inv_t}");
                }
                assert!(lanes.iter().sum::<f64>() >= 1.0);
            }
        }
    }

    #[test]
    fn exp_det_is_close_to_exp() {
        assert_eq!(exp_det(0.0), 1.0);
        assert_eq!(exp_det(-0.0), 1.0);
        assert_eq!(exp_det(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_det(f32::NAN), 0.0);
        assert_eq!(exp_det(-87.5), 0.0);
        let mut x = -87.0f32;
        while x <= 0.0 {
            let (a, b) = (exp_det(x) as f64, (x as f64).exp());
            assert!(((a - b) / b).abs() < 2.5e-7, "exp_det({x}) = {a}, exp = {b}");
            x += 0.0137;
        }
    }

    #[test]
    fn candidates_sample_what_the_full_row_samples() {
        // Over random rows (distinct values, many ties, all equal, non-finite values, vocabularies below and
        // above k), settings and positions: whenever k candidates answer, their token is the full row's
        // (all finite logits as candidates, which always answer), and `sample` returns it. Under an active
        // top-k the token is also the one the sampler computed before candidates existed.
        let settings = [
            SamplerParams { temperature: 0.8, top_k: 40, top_p: 0.95, min_p: 0.05, ..Default::default() },
            SamplerParams { temperature: 1.0, ..Default::default() },
            SamplerParams { temperature: 0.7, top_p: 0.9, ..Default::default() },
            SamplerParams { temperature: 1.3, top_p: 0.5, ..Default::default() },
            SamplerParams { temperature: 0.6, min_p: 0.1, ..Default::default() },
            SamplerParams { temperature: 2.0, min_p: 0.02, top_p: 0.99, ..Default::default() },
            SamplerParams { temperature: 0.9, top_k: 5, ..Default::default() },
            SamplerParams { temperature: 0.5, top_k: 64, top_p: 0.8, ..Default::default() },
            SamplerParams { temperature: 3.0, top_k: 200, ..Default::default() },
        ];
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut s = Sampler::default();
        let (mut answered, mut fell_back, mut before_same, mut before_n) = (0usize, 0usize, 0usize, 0usize);
        let mut scratch = Vec::new();
        for trial in 0..600 {
            let n = [7, 50, 300, 3000, 20000][trial % 5];
            let row = random_row(&mut rng, n, (trial / 5) % 3, trial % 4 == 3);
            for (si, base) in settings.iter().enumerate() {
                let p = SamplerParams { seed: trial as u64 * 31 + si as u64, ..base.clone() };
                let pos = trial * 7 + si;
                let inv_t = 1.0 / p.temperature;
                let k = Sampler::candidate_count(&p).unwrap();
                let (nf, mass) = row_candidates(&row, inv_t, nf_all(&row), &mut scratch);
                let full = scratch.clone();
                let want = s.sample_candidates(&p, CandidateRow { top: &full, n_finite: nf, mass }, pos).unwrap_or_else(|| argmax(&row));
                let (nf2, mass2) = row_candidates(&row, inv_t, k, &mut scratch);
                assert_eq!((nf2, mass2.to_bits()), (nf, mass.to_bits()));
                assert_eq!(&scratch[..], &full[..k.min(nf)], "candidates are the full order's prefix");
                match s.sample_candidates(&p, CandidateRow { top: &scratch, n_finite: nf, mass }, pos) {
                    Some(y) => {
                        assert_eq!(y, want, "trial {trial} setting {si}");
                        answered += 1;
                    }
                    None => fell_back += 1,
                }
                assert_eq!(s.sample(&p, &mut row.clone(), &[], pos), want);
                if p.top_k > 0 && p.top_k < nf {
                    assert_eq!(want, sample_before(&p, &row, pos), "trial {trial} setting {si}: top-k path changed");
                } else {
                    before_n += 1;
                    before_same += (want == sample_before(&p, &row, pos)) as usize;
                }
            }
        }
        // Both outcomes occur, and without a top-k only the mass's rounding may move a draw.
        assert!(answered > 2000 && fell_back > 200, "answered {answered}, fell back {fell_back}");
        assert!(before_same * 1000 >= before_n * 999, "{before_same} of {before_n} as before");
    }

    fn nf_all(row: &[f32]) -> usize {
        row.iter().filter(|l| l.is_finite()).count().max(1)
    }

    #[test]
    fn candidates_of_a_row() {
        // Ties by id, ±0 ordered as total_cmp orders them, non-finite values left out, the mass by lanes.
        let row = [1.0f32, f32::NAN, 3.0, -0.0, 3.0, 0.0, f32::NEG_INFINITY, 2.0];
        let mut top = Vec::new();
        let (n, mass) = row_candidates(&row, 0.5, 4, &mut top);
        assert_eq!(n, 6);
        assert_eq!(top, vec![(1.5, 2), (1.5, 4), (1.0, 7), (0.5, 0)]);
        let want: f64 = [1.0f32, 3.0, -0.0, 3.0, 0.0, 2.0].iter().map(|&l| exp_det(l * 0.5 - 1.5) as f64).sum();
        assert!((mass - want).abs() < 1e-12, "{mass} vs {want}");
        let (_, _) = row_candidates(&row, 0.5, 10, &mut top);
        assert_eq!(&top[4..], &[(0.0, 5), (-0.0, 3)]);
    }
}
