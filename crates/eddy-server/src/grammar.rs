//! Constrained decoding with llguidance: JSON schemas (`response_format`) and tool-call grammars compiled
//! to a token mask applied at every sampled position ([`LogitMask`]).
//!
//! The bridge to llguidance is a token trie of the model's vocabulary: each token id's bytes (byte-level BPE
//! entries mapped back through the GPT-2 byte alphabet, SentencePiece `<0xHH>` entries as their byte and `▁`
//! as a space), special tokens marked as such (llguidance allows them only where a grammar names them),
//! and the ids the model has beyond the tokenizer as special placeholders. The end-of-sequence set is the
//! tokenizer's stop tokens: when the grammar is complete only they are allowed, so generation ends there.

use eddy::sampling::LogitMask;
use eddy::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;

/// Plain text to token ids, special-token spellings read as text.
pub(crate) type Tokenize = Box<dyn Fn(&str) -> Vec<TokenId> + Send + Sync>;

/// The tokenizer as llguidance sees it.
struct Env {
    trie: TokTrie,
    /// Text to token ids (plain text: no special tokens).
    tokenize: Tokenize,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// llguidance tokenizes the bytes a grammar forces, which may cut a character (an enum's `🦀` and `🦩`
    /// share their first three bytes): valid UTF-8 runs go through the tokenizer, the bytes between them
    /// through the trie's greedy byte matching — never a lossy decoding, whose U+FFFD is a real token the
    /// grammar then rejects (the reply would end mid-string).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |t| (self.tokenize)(t))
    }
}

/// Compiles grammars for one model (the token trie and llguidance's tables are built once).
pub struct Grammars {
    factory: ParserFactory,
    n_vocab: usize,
}

impl Grammars {
    /// For `tok` and a model with `n_vocab` logits per position (at least the tokenizer's vocabulary).
    pub fn new(tok: &Tokenizer, n_vocab: usize) -> Result<Grammars, String> {
        let n_vocab = n_vocab.max(tok.vocab_size());
        let words = token_bytes(tok, n_vocab);
        let tok = tok.clone();
        Grammars::from_vocab(words, &tok.stop_ids.clone(), Box::new(move |s| tok.encode_plain(s).unwrap_or_default()))
    }

    /// For a vocabulary given as each token id's bytes (special tokens as `0xFF` + their text), its
    /// end-of-sequence ids `stops` (the first is the main one) and its plain-text tokenizer.
    pub(crate) fn from_vocab(words: Vec<Vec<u8>>, stops: &[u32], tokenize: Tokenize) -> Result<Grammars, String> {
        let n_vocab = words.len();
        let stops: Vec<TokenId> = stops.iter().copied().filter(|&t| (t as usize) < n_vocab).collect();
        let Some(&eos) = stops.first() else {
            return Err("the tokenizer has no end-of-sequence token, so a constrained reply could not end".into());
        };
        let info = TokRxInfo::new(n_vocab as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if stops.len() > 1 {
            trie = trie.with_eos_tokens(&stops);
        }
        let env: TokEnv = Arc::new(Env { trie, tokenize });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| format!("llguidance: {e}"))?;
        factory.quiet();
        Ok(Grammars { factory, n_vocab })
    }

    /// A constraint to JSON matching `schema` (llguidance's JSON-schema subset; an unsupported or invalid
    /// schema is an error naming the problem).
    pub fn json_schema(&self, schema: &Value) -> Result<Constraint, String> {
        self.compile(TopLevelGrammar::from_json_schema(schema.clone()))
    }

    /// A constraint to a Lark grammar in llguidance's dialect (`%json {…}` embeds a JSON schema).
    pub fn lark(&self, source: String) -> Result<Constraint, String> {
        self.compile(TopLevelGrammar::from_lark(source))
    }

    fn compile(&self, g: TopLevelGrammar) -> Result<Constraint, String> {
        let parser = self.factory.create_parser(g).map_err(|e| e.to_string())?;
        let m = Matcher::new(Ok(parser));
        if let Some(e) = m.get_error() {
            return Err(e);
        }
        Ok(Constraint { m, n_vocab: self.n_vocab })
    }
}

/// One request's grammar state: the mask of the tokens allowed next.
pub struct Constraint {
    m: Matcher,
    n_vocab: usize,
}

impl LogitMask for Constraint {
    fn apply(&mut self, logits: &mut [f32]) -> bool {
        let Ok(allowed) = self.m.compute_mask_or_eos() else {
            return false;
        };
        if allowed.is_zero() {
            return false;
        }
        let words = allowed.as_slice();
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let bits = words.get(w).copied().unwrap_or(0);
            if bits == u32::MAX {
                continue;
            }
            for (i, l) in chunk.iter_mut().enumerate() {
                if bits & (1 << i) == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        debug_assert!(logits.len() <= self.n_vocab.next_multiple_of(32));
        true
    }

    fn consume(&mut self, token: u32) {
        // A token the grammar refuses (never sampled under the mask) leaves the matcher in its error
        // state: the next mask is empty and generation ends.
        let _ = self.m.consume_token(token);
    }

    fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        self.m.validate_tokens(tokens).unwrap_or(0)
    }
}

/// The bytes of every token id below `n_vocab`, special tokens as `0xFF` + their text (toktrie's
/// convention), ids without a vocabulary entry as special placeholders.
fn token_bytes(tok: &Tokenizer, n_vocab: usize) -> Vec<Vec<u8>> {
    let added = tok.inner().get_added_tokens_decoder();
    let byte_level = tok.is_byte_level();
    let alphabet = byte_alphabet();
    (0..n_vocab as u32)
        .map(|id| {
            let special = |name: &str| {
                let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                b.extend_from_slice(name.as_bytes());
                b
            };
            if let Some(t) = added.get(&id) {
                return if t.special { special(&t.content) } else { t.content.clone().into_bytes() };
            }
            let Some(entry) = tok.token_str(id) else {
                return special(&format!("<[{id}]>"));
            };
            if byte_level {
                entry.chars().map(|c| alphabet.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_else(|| special(&entry))
            } else if let Some(h) = entry.strip_prefix("<0x").and_then(|e| e.strip_suffix('>')).filter(|h| h.len() == 2) {
                u8::from_str_radix(h, 16).map(|b| vec![b]).unwrap_or_else(|_| special(&entry))
            } else {
                entry.replace('\u{2581}', " ").into_bytes()
            }
        })
        .collect()
}

/// GPT-2's byte alphabet, character → byte: printable Latin-1 bytes stand for themselves, the other 68
/// bytes, in order, for U+0100 and on.
fn byte_alphabet() -> std::collections::HashMap<char, u8> {
    let printable = |b: u8| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                next += 1;
                (char::from_u32(next - 1).unwrap_or('\0'), b)
            }
        })
        .collect()
}
