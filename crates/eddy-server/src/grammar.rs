//! Constrained decoding with llguidance: JSON schemas (`response_format`) and tool-call grammars compiled
//! to a token mask applied at every sampled position ([`LogitMask`]).
//!
//! The bridge to llguidance is a token trie of the model's vocabulary: each token id's bytes (byte-level BPE
//! entries mapped back through the GPT-2 byte alphabet, SentencePiece `<0xHH>` entries as their byte and `▁`
//! as a space), special tokens marked as such (llguidance allows them only where a grammar names them),
//! and the ids the model has beyond the tokenizer or that its GGUF marks UNUSED (Qwen2.5's `[PAD…]` rows,
//! text a JSON string would otherwise admit) as special placeholders. The end-of-sequence set is the
//! tokenizer's stop tokens: when the grammar is complete only they are allowed, so generation ends there.
//!
//! Two rules on top of the schemas, as llama.cpp's and vLLM's JSON grammars have them: a number's digit runs
//! are bounded ([`MAX_DIGITS`]: JSON's grammar lets a number run on forever, and small models do write
//! `1.000000…` until the token limit), and an object schema that lists `properties` admits no other keys
//! unless it says so ([`close_objects`]).

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

/// The longest run of ASCII digits a constrained reply may write outside JSON strings: a number's integer
/// part, its fraction and its exponent each have at most this many digits. 20 holds every 64-bit integer and
/// a double's 17 significant digits (llama.cpp's converter allows 16 in each part).
pub const MAX_DIGITS: u32 = 20;

/// Compiles grammars for one model (the token trie and llguidance's tables are built once).
pub struct Grammars {
    factory: ParserFactory,
    n_vocab: usize,
    lex: Arc<TokenLex>,
}

/// The tokens' bytes as the digit bound reads them.
struct TokenLex {
    /// Each token id's bytes (special tokens: `0xFF` + their text).
    words: Vec<Vec<u8>>,
    /// The ids whose bytes start with an ASCII digit, with how many digits lead.
    digit_led: Vec<(u32, u32)>,
    /// The most leading digits of any token.
    max_lead: u32,
    /// Bit `id` set: the token starts with a digit (the layout of llguidance's token masks).
    digit_bits: Vec<u32>,
}

impl TokenLex {
    fn new(words: Vec<Vec<u8>>) -> TokenLex {
        let digit_led: Vec<(u32, u32)> = words
            .iter()
            .enumerate()
            .filter(|(_, w)| w.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER))
            .map(|(i, w)| (i as u32, w.iter().take_while(|b| b.is_ascii_digit()).count() as u32))
            .filter(|&(_, n)| n > 0)
            .collect();
        let max_lead = digit_led.iter().map(|&(_, n)| n).max().unwrap_or(0);
        let mut digit_bits = vec![0u32; words.len().div_ceil(32)];
        for &(id, _) in &digit_led {
            digit_bits[id as usize / 32] |= 1 << (id % 32);
        }
        TokenLex { words, digit_led, max_lead, digit_bits }
    }

    /// Whether the token is digits only (a run it fills stays open after it).
    fn all_digits(&self, id: u32) -> bool {
        self.words.get(id as usize).is_some_and(|w| !w.is_empty() && w.iter().all(u8::is_ascii_digit))
    }

    fn lead(&self, id: u32) -> u32 {
        let w = self.words.get(id as usize).map_or(&[][..], |w| w.as_slice());
        if w.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
            return 0;
        }
        w.iter().take_while(|b| b.is_ascii_digit()).count() as u32
    }
}

/// Where a reply's bytes stand for the digit bound: inside a JSON string (after a backslash or not) or outside, and
/// the digits written since the last other byte outside strings.
#[derive(Clone, Copy, Default)]
struct Scan {
    in_string: bool,
    escape: bool,
    run: u32,
}

impl Scan {
    fn feed(&mut self, w: &[u8]) {
        if w.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
            self.run = 0;
            return;
        }
        for &b in w {
            if self.in_string {
                match (self.escape, b) {
                    (true, _) => self.escape = false,
                    (false, b'\\') => self.escape = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
            } else if b.is_ascii_digit() {
                self.run += 1;
            } else {
                self.run = 0;
                self.in_string = b == b'"';
            }
        }
    }

    /// Whether a token with `lead` leading digits would make a digit run longer than [`MAX_DIGITS`].
    fn refuses(&self, lead: u32) -> bool {
        !self.in_string && lead > 0 && self.run + lead > MAX_DIGITS
    }

    /// Whether a token with `lead` leading digits brings the run to exactly [`MAX_DIGITS`].
    fn fills(&self, lead: u32) -> bool {
        !self.in_string && lead > 0 && self.run + lead == MAX_DIGITS
    }
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
        let lex = Arc::new(TokenLex::new(words.clone()));
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
        Ok(Grammars { factory, n_vocab, lex })
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
        Ok(Constraint { m, n_vocab: self.n_vocab, lex: self.lex.clone(), scan: Scan::default(), dead_end: None })
    }
}

/// One request's grammar state: the mask of the tokens allowed next. A clone continues independently
/// (each choice of a request with `n` > 1 gets its own).
#[derive(Clone)]
pub struct Constraint {
    m: Matcher,
    n_vocab: usize,
    lex: Arc<TokenLex>,
    /// The reply so far, for the digit bound.
    scan: Scan,
    /// Set when the digit bound left no token (a number the schema wants longer than the bound).
    dead_end: Option<String>,
}

impl Constraint {
    /// The error of a grammar that fails before the reply's first free choice, else `None`: llguidance
    /// builds parts of a grammar lazily (its lexer), so one that compiles may fail at its first mask or at
    /// the mask after the tokens it forces (a string pattern fails once its opening quote is taken). Run on
    /// a clone: the constraint itself is untouched.
    pub fn early_failure(&self) -> Option<String> {
        let mut m = self.m.clone();
        let failed = |m: &Matcher, e: String| Some(m.get_error().unwrap_or(e));
        if let Err(e) = m.compute_mask() {
            return failed(&m, e.to_string());
        }
        let forced = m.compute_ff_tokens();
        if forced.is_empty() {
            return m.get_error();
        }
        if let Err(e) = m.consume_tokens(&forced) {
            return failed(&m, e.to_string());
        }
        if m.is_stopped() {
            return m.get_error();
        }
        m.compute_mask().err().and_then(|e| failed(&m, e.to_string()))
    }

    /// Whether the digit bound lets `tokens[last]` through, `tokens` continuing what was consumed and
    /// allowed by the grammar, `scan` the reply before the last: not past the bound, and a token that
    /// fills the run with digits only must leave the grammar a way to end the number (some next token
    /// that does not start with a digit, or the end), checked on a clone of the matcher.
    /// Without that look-ahead a number the schema keeps open (`multipleOf`, a `minimum` not yet
    /// reached) would run into the bound with nothing left to write.
    fn digits_allow(&self, scan: &Scan, tokens: &[u32]) -> bool {
        let Some(&t) = tokens.last() else {
            return true;
        };
        let lead = self.lex.lead(t);
        if scan.refuses(lead) {
            return false;
        }
        if !scan.fills(lead) || !self.lex.all_digits(t) {
            return true;
        }
        // On a clone: a failure there (a lazy-lexer limit after a token plain decoding would never
        // sample) must not touch the request's own matcher.
        let mut m = self.m.clone();
        m.try_consume_tokens(tokens).is_ok_and(|k| k == tokens.len())
            && (m.is_stopped()
                || m.compute_mask().is_ok_and(|mask| {
                    let (a, d) = (mask.as_slice(), &self.lex.digit_bits);
                    a.iter().zip(d).any(|(&a, &d)| a & !d != 0) || a.iter().skip(d.len()).any(|&a| a != 0)
                }))
    }
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
        if self.scan.in_string || self.scan.run + self.lex.max_lead < MAX_DIGITS {
            return true;
        }
        let lex = self.lex.clone();
        let scan = self.scan;
        let mut refused = false;
        for &(id, _) in &lex.digit_led {
            let open = logits.get(id as usize).is_some_and(|&l| l != f32::NEG_INFINITY);
            if open && !self.digits_allow(&scan, &[id]) {
                logits[id as usize] = f32::NEG_INFINITY;
                refused = true;
            }
        }
        if refused && logits.iter().all(|&l| l == f32::NEG_INFINITY) {
            self.dead_end = Some(format!("a number reached {MAX_DIGITS} digits where the schema allows no end"));
            return false;
        }
        true
    }

    fn consume(&mut self, token: u32) {
        // A token the grammar refuses (never sampled under the mask) leaves the matcher in its error
        // state: the next mask is empty and generation ends. Once the grammar has ended only the
        // end-of-sequence token was allowed; the matcher takes nothing more (it would call that an error).
        if !self.m.is_stopped() {
            let _ = self.m.consume_token(token);
        }
        if let Some(w) = self.lex.words.get(token as usize) {
            self.scan.feed(w);
        }
    }

    /// The grammar's accepted prefix, cut at the first token the digit bound refuses: the same tokens
    /// [`LogitMask::apply`] would let through one at a time, so speculation stays lossless.
    fn accepted_prefix(&mut self, tokens: &[u32]) -> usize {
        let n = self.m.validate_tokens(tokens).unwrap_or(0);
        let mut scan = self.scan;
        for i in 0..n {
            if !self.digits_allow(&scan, &tokens[..=i]) {
                return i;
            }
            if let Some(w) = self.lex.words.get(tokens[i] as usize) {
                scan.feed(w);
            }
        }
        n
    }

    /// The matcher's error (llguidance builds its lexer lazily, so a schema can compile and still prove too
    /// large at some position of the reply).
    fn failure(&self) -> Option<String> {
        self.m.get_error().or_else(|| self.dead_end.clone())
    }
}

/// Gives every object schema in `schema` that lists `properties` (or `patternProperties`) and says nothing
/// of `additionalProperties` / `unevaluatedProperties` an `"additionalProperties": false`, as llama.cpp's
/// converter and vLLM's default treat them (JSON Schema itself, and llguidance, let other keys through;
/// a small model then invents keys until the token limit). Left open: free-form objects (no `properties`),
/// and every object that llguidance merges with another (it merges `allOf` members, `anyOf`/`oneOf` members
/// with properties listed beside them, and `$ref` targets with their siblings, and a key listed by one side
/// falls under the other side's `additionalProperties`, so closing either would refuse the other's keys):
/// a node with `allOf`/`anyOf`/`oneOf`/`$ref`, an `allOf` member, an `anyOf`/`oneOf` member whose parent
/// lists properties, and a `$defs`/`definitions` entry that such a node refers to. Only schema positions
/// are visited: `enum`, `const`, `default` and `examples` values are data.
pub fn close_objects(schema: &mut Value) {
    let mut merged_refs = std::collections::HashSet::new();
    collect_merged_refs(schema, false, &mut merged_refs);
    close_walk(schema, false, &merged_refs);
}

/// Whether the object schema `o` is merged with other schemas by llguidance (composition or `$ref` here).
fn composes(o: &serde_json::Map<String, Value>) -> bool {
    ["allOf", "anyOf", "oneOf", "$ref"].iter().any(|k| o.contains_key(*k))
}

/// Whether `o` lists keys of its own.
fn lists(o: &serde_json::Map<String, Value>) -> bool {
    o.contains_key("properties") || o.contains_key("patternProperties")
}

/// Calls `f(child, merged)` on each subschema of the object schema `o`; `merged`: llguidance merges the
/// child with a sibling schema (an `allOf` member, an `anyOf`/`oneOf` member beside listed properties).
fn each_subschema(o: &mut serde_json::Map<String, Value>, f: &mut dyn FnMut(&str, &mut Value, bool)) {
    let with_properties = lists(o);
    for (k, sub) in o.iter_mut() {
        match k.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas" => {
                if let Value::Object(m) = sub {
                    for (name, s) in m.iter_mut() {
                        f(&format!("{k}/{name}"), s, false);
                    }
                }
            }
            "allOf" | "anyOf" | "oneOf" | "prefixItems" => {
                let merged = k == "allOf" || (k != "prefixItems" && with_properties);
                if let Value::Array(a) = sub {
                    a.iter_mut().for_each(|s| f(k, s, merged));
                }
            }
            "items" => match sub {
                Value::Array(a) => a.iter_mut().for_each(|s| f(k, s, false)),
                s => f(k, s, false),
            },
            "additionalProperties"
            | "additionalItems"
            | "contains"
            | "not"
            | "if"
            | "then"
            | "else"
            | "propertyNames"
            | "unevaluatedItems"
            | "unevaluatedProperties" => f(k, sub, false),
            _ => {}
        }
    }
}

/// The `$ref`s of nodes llguidance merges with something else (see [`close_objects`]).
fn collect_merged_refs(v: &mut Value, merged: bool, out: &mut std::collections::HashSet<String>) {
    let Value::Object(o) = v else {
        return;
    };
    if let Some(r) = o.get("$ref").and_then(Value::as_str) {
        let siblings = o.keys().any(|k| !matches!(k.as_str(), "$ref" | "description" | "title" | "default" | "examples" | "$comment"));
        if merged || siblings {
            out.insert(r.to_string());
        }
    }
    each_subschema(o, &mut |_, s, m| collect_merged_refs(s, m, out));
}

fn close_walk(v: &mut Value, merged: bool, merged_refs: &std::collections::HashSet<String>) {
    let Value::Object(o) = v else {
        return;
    };
    if lists(o) && !merged && !composes(o) && !o.contains_key("additionalProperties") && !o.contains_key("unevaluatedProperties") {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    each_subschema(o, &mut |at, s, m| {
        // A definition that a merged node refers to is merged too.
        let shared = (at.starts_with("$defs/") || at.starts_with("definitions/")) && merged_refs.contains(&format!("#/{at}"));
        close_walk(s, m || shared, merged_refs)
    });
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
            if tok.unused_ids.binary_search(&id).is_ok() {
                return special(&format!("<[{id}]>"));
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Grammars over a vocabulary of the 256 bytes, the two-byte tokens `"12"` and `"3,"`, and an
    /// end-of-sequence special token (the last id).
    fn grammars() -> (Grammars, u32) {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"12".to_vec());
        words.push(b"3,".to_vec());
        let mut eos = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        eos.extend_from_slice(b"</s>");
        words.push(eos);
        let eos = words.len() as u32 - 1;
        let g = Grammars::from_vocab(words, &[eos], Box::new(|s| s.bytes().map(u32::from).collect())).unwrap();
        (g, eos)
    }

    fn allowed(c: &mut Constraint, n: usize) -> Vec<bool> {
        let mut l = vec![0.0f32; n];
        c.apply(&mut l);
        l.iter().map(|&x| x != f32::NEG_INFINITY).collect()
    }

    /// A number's digit runs stop at MAX_DIGITS in `apply` and in `accepted_prefix` alike (speculation
    /// accepts what plain decoding would sample), each part of the number counted on its own, and digits
    /// inside strings are never counted.
    #[test]
    fn number_digit_runs_are_bounded() {
        let (g, eos) = grammars();
        let n = eos as usize + 1;
        let schema = json!({"type": "object", "properties": {"p": {"type": "number"}, "s": {"type": "string"}}, "required": ["p", "s"]});
        let mut c = g.json_schema(&schema).unwrap();
        for &b in br#"{"p":"# {
            c.consume(b as u32);
        }
        let digits: Vec<u32> = std::iter::repeat_n(b'7' as u32, 30).collect();
        assert_eq!(c.accepted_prefix(&digits), MAX_DIGITS as usize);
        for _ in 0..MAX_DIGITS - 1 {
            assert!(allowed(&mut c, n)[b'7' as usize]);
            c.consume(b'7' as u32);
        }
        // One digit left: the single digits pass, the two-digit token does not.
        let a = allowed(&mut c, n);
        assert!(a[b'7' as usize] && !a[256], "one digit left");
        assert_eq!(c.accepted_prefix(&[256]), 0);
        c.consume(b'7' as u32);
        let a = allowed(&mut c, n);
        assert!(!a[b'7' as usize] && !a[256] && !a[257], "the run is full");
        assert!(a[b'.' as usize] && a[b',' as usize], "the number may still end or go on to its fraction");
        c.consume(b'.' as u32);
        assert_eq!(c.accepted_prefix(&digits), MAX_DIGITS as usize, "the fraction has its own bound");
        c.consume(b'5' as u32);
        c.consume(257); // "3,": the run ends with the number
        for &b in br#""s":"# {
            c.consume(b as u32);
        }
        assert_eq!(c.accepted_prefix(&[b'"' as u32]), 1);
        c.consume(b'"' as u32);
        assert_eq!(c.accepted_prefix(&digits), 30, "digits in a string are text");
        for &b in br#"a"}"# {
            c.consume(b as u32);
        }
        // The grammar has ended: only end-of-sequence, and taking it is not a failure.
        let a = allowed(&mut c, n);
        assert_eq!(a.iter().filter(|&&x| x).count(), 1);
        assert!(a[eos as usize]);
        c.consume(eos);
        assert!(c.failure().is_none(), "{:?}", c.failure());
    }

    /// A number the schema keeps open (`multipleOf`) cannot run into the bound with nothing left: the
    /// digit that fills the run must be one after which the number can end, in `apply` and in
    /// `accepted_prefix` alike.
    /// A pattern too large for the lazy lexer compiles, then fails once its opening quote (forced) is
    /// taken: found before the reply, on a clone; a plain schema has no such failure.
    #[test]
    fn grammars_failing_before_the_first_choice_are_found_early() {
        let (g, eos) = grammars();
        let c = g.json_schema(&json!({"type": "string", "pattern": "^a{1000000}$"})).unwrap();
        let e = c.early_failure().expect("the lexer limit");
        assert!(e.contains("lexer"), "{e}");
        let mut c = g.json_schema(&json!({"type": "string", "pattern": "^a{3}$"})).unwrap();
        assert_eq!(c.early_failure(), None);
        // The constraint itself is untouched: it still starts at the quote.
        let mut logits = vec![0.0f32; eos as usize + 1];
        assert!(c.apply(&mut logits));
        assert!(logits[b'"' as usize].is_finite() && logits[b'a' as usize] == f32::NEG_INFINITY);
    }

    #[test]
    fn the_last_digit_lets_the_number_end() {
        let (g, eos) = grammars();
        let n = eos as usize + 1;
        let mut c = g.json_schema(&json!({"type": "integer", "multipleOf": 7})).unwrap();
        let mut value: u128 = 0;
        for _ in 0..MAX_DIGITS - 1 {
            c.consume(b'1' as u32);
            value = value * 10 + 1;
        }
        let a = allowed(&mut c, n);
        let ok: Vec<u128> = (0..10u128).filter(|&d| a[b'0' as usize + d as usize]).collect();
        assert!(!ok.is_empty() && ok.iter().all(|d| (value * 10 + d).is_multiple_of(7)), "{ok:?}");
        assert!(!a[256], "two digits would pass the bound");
        for d in 0..10u128 {
            let t = b'0' as u32 + d as u32;
            assert_eq!(c.accepted_prefix(&[t, eos]), if ok.contains(&d) { 2 } else { 0 }, "digit {d}");
        }
        c.consume(b'0' as u32 + ok[0] as u32);
        let a = allowed(&mut c, n);
        assert_eq!((a.iter().filter(|&&x| x).count(), a[eos as usize]), (1, true), "only the end is left");
        assert!(c.failure().is_none());
    }

    /// Object schemas that list properties are closed unless they say otherwise; free-form objects, data
    /// (`enum`, `const`, `default`) and the members of an `allOf` are left as they are.
    #[test]
    fn object_schemas_are_closed() {
        let mut s = json!({
            "type": "object",
            "properties": {
                "a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "free": {"type": "object"},
                "open": {"type": "object", "properties": {"y": {}}, "additionalProperties": true},
                "list": {"type": "array", "items": {"properties": {"z": {}}}},
                "either": {"anyOf": [{"properties": {"u": {}}}, {"type": "null"}]},
                "both": {"allOf": [{"properties": {"v": {}}}, {"properties": {"w": {}}}]},
                "data": {"const": {"properties": {"k": 1}}, "default": {"properties": {}}}
            },
            "$defs": {"D": {"type": "object", "properties": {"q": {}}}}
        });
        close_objects(&mut s);
        let p = &s["properties"];
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(p["a"]["additionalProperties"], false);
        assert!(p["free"].get("additionalProperties").is_none());
        assert_eq!(p["open"]["additionalProperties"], true);
        assert_eq!(p["list"]["items"]["additionalProperties"], false);
        assert_eq!(p["either"]["anyOf"][0]["additionalProperties"], false);
        assert!(p["both"]["allOf"][0].get("additionalProperties").is_none());
        assert_eq!(p["data"]["const"], json!({"properties": {"k": 1}}));
        assert_eq!(p["data"]["default"], json!({"properties": {}}));
        assert_eq!(s["$defs"]["D"]["additionalProperties"], false);
        // Through llguidance: the closed schema refuses a key it does not list.
        let (g, _) = grammars();
        let mut closed = json!({"type": "object", "properties": {"name": {"type": "string"}}});
        let text: Vec<u32> = br#"{"name": "x", "age": 3}"#.iter().map(|&b| b as u32).collect();
        let open_len = g.json_schema(&closed).unwrap().accepted_prefix(&text);
        close_objects(&mut closed);
        let closed_len = g.json_schema(&closed).unwrap().accepted_prefix(&text);
        assert_eq!(open_len, text.len());
        assert_eq!(closed_len, br#"{"name": "x""#.len(), "no room for another key: the object must close");
        // Schemas llguidance merges stay satisfiable: a $ref'd definition under allOf (OpenAPI's
        // inheritance), anyOf members beside listed properties, a one-member allOf beside properties.
        for (schema, instance) in [
            (
                json!({"$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}},
                       "allOf": [{"$ref": "#/$defs/Pet"}, {"properties": {"breed": {"type": "string"}}, "required": ["breed"]}]}),
                r#"{"name": "a", "breed": "b"}"#,
            ),
            (
                json!({"type": "object", "properties": {"kind": {"type": "string"}}, "required": ["kind"],
                       "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"properties": {"b": {"type": "integer"}}, "required": ["b"]}]}),
                r#"{"kind": "k", "a": 1}"#,
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "integer"}}, "allOf": [{"properties": {"b": {"type": "integer"}}}]}),
                r#"{"a": 1, "b": 2}"#,
            ),
        ] {
            let mut closed = schema.clone();
            close_objects(&mut closed);
            let text: Vec<u32> = instance.bytes().map(u32::from).collect();
            let c = g.json_schema(&closed);
            assert_eq!(c.map(|mut c| c.accepted_prefix(&text)), Ok(text.len()), "{closed}");
        }
    }
}
