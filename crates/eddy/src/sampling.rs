//! Token sampling keyed by (seed, absolute position).
//!
//! The random number used to sample the token at absolute position `p` is `Philox4x32-10(key = seed,
//! counter = p)` (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"), so it depends on
//! nothing but the seed and the position. Plain decoding and speculative verification of any tree therefore
//! draw the same sample at the same position: the accept walk only has to follow the target's own samples.
//!
//! Pipeline (as llama.cpp / transformers order it): repetition penalty → presence and frequency
//! penalties → temperature → top-k → top-p → min-p → inverse-CDF draw. Temperature 0 is greedy (argmax, lowest id on ties).

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
        Ok(())
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

/// Reusable sampler state (candidate and token-count buffers, so sampling allocates nothing per token
/// once warm).
#[derive(Default)]
pub struct Sampler {
    cand: Vec<(f32, u32)>,
    generated: Vec<u32>,
}

impl Sampler {
    /// Sample the token at absolute position `pos` from `logits` (modified in place by the penalties),
    /// given `history` (all tokens before `pos`, prompt included; its first `p.prompt_len` are the
    /// prompt).
    pub fn sample(&mut self, p: &SamplerParams, logits: &mut [f32], history: &[u32], pos: usize) -> u32 {
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
        let c = &mut self.cand;
        c.clear();
        c.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l * inv_t, i as u32)));
        // A tiny temperature can overflow a scaled logit to +inf (then exp(inf - inf) = NaN would pick the
        // least likely candidate): that is greedy in the limit.
        if c.is_empty() || c.iter().any(|e| e.0 == f32::INFINITY) {
            return argmax(logits);
        }
        // Sort descending by logit, ties by id, after an O(n) top-k cut when one is asked for.
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
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
        // top-p: keep the smallest prefix whose mass reaches top_p.
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
        // min-p relative to the top probability (c[0] has weight 1 after the shift).
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
mod tests {
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
}
