//! Text ↔ token ids, built to match what transformers does for the same model.
//!
//! The reference is `transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...)` (for GGUF files) and
//! `AutoTokenizer.from_pretrained(dir)` (for a Hugging Face folder with `tokenizer.json`). eddy wraps the
//! `tokenizers` crate, the same library transformers' fast tokenizers run on, and rebuilds the pipeline
//! transformers builds from GGUF metadata (`transformers/integrations/gguf/gguf_tokenizer_mapping.py`):
//!
//! * `tokenizer.ggml.model = "gpt2"` — byte-level BPE: tokens spelled in the GPT-2 byte alphabet (tokens using
//!   other characters are respelled byte by byte), merges from `tokenizer.ggml.merges`, pre-tokenizer
//!   `ByteLevel` with the GPT-2 split regex, or — when `tokenizer.ggml.pre` names a known split (qwen2,
//!   llama-bpe, …) — that regex followed by `ByteLevel` without regex; `ByteLevel` decoder.
//! * `"llama"` — SentencePiece-style BPE with byte fallback: `Metaspace` pre-tokenizer (prefix space on the
//!   first piece only) and a decoder that turns `▁` into spaces and strips the first one. For `gemma*`
//!   architectures the Gemma pipeline instead: spaces become `▁` in a normalizer, no prefix space, all-space
//!   tokens are respelled with `▁`, and since the file holds no merges they are rebuilt from the vocabulary
//!   in token order. `phi3` uses a `Prepend("▁")`+`Replace` normalizer.
//! * `"gemma4"` — the Gemma pipeline without BOS.
//!
//! Tokens marked CONTROL (type 3) become special added tokens, USER_DEFINED (type 4) plain added tokens, so
//! both are matched whole in text. BOS is added by a template post-processor when
//! `tokenizer.ggml.add_bos_token` says so (default on for `"llama"` vocabularies, as transformers does).

use crate::error::{Error, Result};
use crate::gguf::{GgufFile, GgufValue};
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use tokenizers as tk;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{NormalizerWrapper, Prepend, Replace};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

/// Names of end-of-generation tokens: when present as added tokens they join [`Tokenizer::stop_ids`]. The
/// fill-in-the-middle pad, repository and file separators end a reply too (llama.cpp's end-of-generation
/// set): a FIM model writes them after the middle it was asked for.
const STOP_TOKEN_NAMES: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|end|>",
    "<|eom_id|>",
    "<|return|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<fim_pad>",
    "<file_sep>",
    "<reponame>",
];

/// Fill-in-the-middle control tokens (prefix, suffix, middle) as FIM-trained code models name them:
/// Qwen2.5-Coder; StarCoder and SantaCoder; DeepSeek-Coder (begin, hole, end).
const FIM_NAMES: &[[&str; 3]] = &[
    ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"],
    ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"],
    ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
];

/// The control tokens of fill-in-the-middle prompts in PSM order (Bavarian et al. 2022, "Efficient
/// Training of Language Models to Fill in the Middle"): `prefix` + the code before the gap, `suffix` +
/// the code after it, `middle`; the model then writes the gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
}

/// Split regexes transformers applies for `tokenizer.ggml.pre` values (followed by `ByteLevel` without regex).
const LLAMA3_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split_regex_for(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" | "jina-v5-nano" | "dbrx"
        | "smaug-bpe" => LLAMA3_SPLIT,
        "tekken" => TEKKEN_SPLIT,
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" => QWEN2_SPLIT,
        "qwen35" => QWEN35_SPLIT,
        "gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2" => GPT4O_SPLIT,
        _ => return None,
    })
}

/// The GPT-2 byte-to-character table: printable Latin-1 bytes map to themselves, the others to U+0100…
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        let printable = (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            let c = char::from_u32(next).unwrap();
            next += 1;
            c
        };
    }
    table
}

/// Python's `str.isspace` (Rust's `char::is_whitespace` plus the ASCII separators U+001C–U+001F).
fn py_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// A tokenizer: encodes text to ids and decodes ids to text exactly as transformers does for the same model.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tk::Tokenizer,
    /// Where it was loaded from (for error messages).
    source: PathBuf,
    n_vocab: usize,
    /// transformers' `clean_up_tokenization_spaces`, which it only applies to non-BPE models.
    cleanup_spaces: bool,
    /// Beginning-of-sequence token id, if the model has one.
    pub bos_id: Option<u32>,
    /// End-of-sequence token id, if the model has one.
    pub eos_id: Option<u32>,
    /// Whether `encode(text, true)` prepends BOS (transformers' `add_bos_token`).
    pub add_bos: bool,
    /// Ids that end generation: EOS plus those of `<|im_end|>`, `<|endoftext|>`, `<end_of_turn>`, `<|eot_id|>`,
    /// `<|end_of_text|>`, `<|end|>`, `<|eom_id|>`, `<|return|>` that exist as added tokens.
    pub stop_ids: Vec<u32>,
    /// Ids a GGUF file marks UNUSED (placeholder rows that were never trained, e.g. Qwen2.5's
    /// `[PAD151665]`…`[PAD151935]`), ascending; constrained decoding never allows them.
    pub unused_ids: Vec<u32>,
    /// The fill-in-the-middle tokens, when the vocabulary has all three as added tokens ([`FIM_NAMES`]).
    pub fim: Option<FimTokens>,
    /// `inner` set to encode special-token text as plain text (built on first use, shared by clones).
    plain: std::sync::Arc<std::sync::OnceLock<tk::Tokenizer>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.n_vocab)
            .field("bos_id", &self.bos_id)
            .field("eos_id", &self.eos_id)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish()
    }
}

/// Which pipeline a SentencePiece-style (`"llama"`) vocabulary gets.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum SpFlavor {
    /// transformers' `LlamaTokenizer`: Metaspace prefix on the first piece, decoder strips one leading space.
    Llama,
    /// `LlamaTokenizer` with a `Prepend("▁")` + `Replace(" ", "▁")` normalizer instead of Metaspace.
    Phi3,
    /// `GemmaTokenizer`: `Replace(" ", "▁")` normalizer, no prefix space, `<unk>` fused; all-space tokens
    /// respelled with `▁` and merges ordered by token position when the file has none.
    Gemma,
    /// `GemmaTokenizer` for `tokenizer.ggml.model = "gemma4"`: no respelling, merges ordered by score.
    Gemma4,
}

/// Everything read from `tokenizer.ggml.*`.
struct GgufTok<'a> {
    tokens: Vec<&'a str>,
    token_types: Option<Vec<i64>>,
    merges: Option<Vec<&'a str>>,
    scores: Option<Vec<f64>>,
}

impl Tokenizer {
    /// Builds the tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, the way transformers
    /// does (see the module docs). Missing or malformed metadata, or an unsupported tokenizer model, is an
    /// [`Error::Model`] naming the file.
    pub fn from_gguf(g: &GgufFile) -> Result<Self> {
        let path = g.path.as_path();
        let bad = |problem: String| Error::model(path, problem);
        let model = g
            .get("tokenizer.ggml.model")
            .ok_or_else(|| bad("no tokenizer in this GGUF file (missing metadata tokenizer.ggml.model)".into()))?
            .as_str()
            .ok_or_else(|| bad("metadata tokenizer.ggml.model is not a string".into()))?;
        let arch = g.get("general.architecture").and_then(GgufValue::as_str).unwrap_or("");
        let pre = g.get("tokenizer.ggml.pre").and_then(GgufValue::as_str).unwrap_or("");

        let string_array = |key: &str, required: bool| -> Result<Option<Vec<&str>>> {
            let Some(v) = g.get(key) else {
                return if required { Err(bad(format!("missing tokenizer metadata {key}"))) } else { Ok(None) };
            };
            let arr = v.as_array().ok_or_else(|| bad(format!("metadata {key} is not an array")))?;
            arr.iter()
                .enumerate()
                .map(|(i, x)| x.as_str().ok_or_else(|| bad(format!("metadata {key}[{i}] is not a string"))))
                .collect::<Result<Vec<_>>>()
                .map(Some)
        };
        let tokens = string_array("tokenizer.ggml.tokens", true)?.unwrap_or_default();
        if tokens.is_empty() {
            return Err(bad("tokenizer.ggml.tokens is empty".into()));
        }
        let n = tokens.len();
        let merges = string_array("tokenizer.ggml.merges", false)?;
        let numeric_array = |key: &str| -> Result<Option<Vec<f64>>> {
            let Some(v) = g.get(key) else { return Ok(None) };
            let arr = v.as_array().ok_or_else(|| bad(format!("metadata {key} is not an array")))?;
            if arr.len() != n {
                return Err(bad(format!("metadata {key} has {} entries but there are {n} tokens", arr.len())));
            }
            arr.iter()
                .enumerate()
                .map(|(i, x)| x.as_f64().ok_or_else(|| bad(format!("metadata {key}[{i}] is not a number"))))
                .collect::<Result<Vec<_>>>()
                .map(Some)
        };
        let scores = numeric_array("tokenizer.ggml.scores")?;
        let token_types = numeric_array("tokenizer.ggml.token_type")?.map(|v| v.into_iter().map(|x| x as i64).collect());
        let special_id = |key: &str| -> Result<Option<u32>> {
            match g.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < n => Ok(Some(id as u32)),
                    _ => Err(bad(format!("metadata {key} = {v:?} is not a token id below {n}"))),
                },
            }
        };
        let bos_id = special_id("tokenizer.ggml.bos_token_id")?;
        let eos_id = special_id("tokenizer.ggml.eos_token_id")?;
        let unk_id = special_id("tokenizer.ggml.unknown_token_id")?;
        let pad_id = special_id("tokenizer.ggml.padding_token_id")?;
        let flag = |key: &str| g.get(key).and_then(GgufValue::as_bool);
        let mut add_bos = match model {
            "gemma4" => false,
            "llama" => flag("tokenizer.ggml.add_bos_token").unwrap_or(true),
            _ => flag("tokenizer.ggml.add_bos_token").unwrap_or(false),
        };
        let mut add_eos = flag("tokenizer.ggml.add_eos_token").unwrap_or(false);
        add_bos &= bos_id.is_some();
        add_eos &= eos_id.is_some();

        let t = GgufTok { tokens, token_types, merges, scores };
        let is_gemma_arch = matches!(arch, "gemma" | "gemma2" | "gemma3");
        let (mut inner, class_specials, byte_level): (tk::Tokenizer, &[&str], bool) = match model {
            "gpt2" => (build_byte_level(&t).map_err(bad)?, &["<|endoftext|>"], true),
            "llama" if is_gemma_arch => (build_sentencepiece(&t, SpFlavor::Gemma).map_err(bad)?, GEMMA_DEFAULTS, false),
            "llama" if arch == "phi3" => (build_sentencepiece(&t, SpFlavor::Phi3).map_err(bad)?, LLAMA_DEFAULTS, false),
            "llama" => (build_sentencepiece(&t, SpFlavor::Llama).map_err(bad)?, LLAMA_DEFAULTS, false),
            "gemma4" => (build_sentencepiece(&t, SpFlavor::Gemma4).map_err(bad)?, GEMMA_DEFAULTS, false),
            other => return Err(bad(format!("unsupported tokenizer model {other:?} (eddy supports gpt2, llama and gemma4 tokenizers)"))),
        };

        // Added tokens, in the order transformers adds them: the tokenizer class's own special-token
        // defaults, CONTROL tokens (special), USER_DEFINED tokens (not special), then the named special tokens.
        let alphabet: HashSet<char> = byte_alphabet().into_iter().collect();
        let mut to_add: Vec<(&str, bool)> = Vec::new();
        to_add.extend(class_specials.iter().map(|&s| (s, true)));
        if let Some(types) = &t.token_types {
            let control =
                t.tokens.iter().zip(types).filter(|&(tok, &ty)| ty == 3 && (!byte_level || tok.chars().all(|c| alphabet.contains(&c))));
            to_add.extend(control.map(|(&tok, _)| (tok, true)));
            let user = t.tokens.iter().zip(types).filter(|&(_, &ty)| ty == 4);
            to_add.extend(user.map(|(&tok, _)| (tok, false)));
        }
        to_add.extend([bos_id, eos_id, unk_id, pad_id].into_iter().flatten().map(|id| (t.tokens[id as usize], true)));
        if is_gemma_arch || model == "gemma4" {
            to_add.push(("<mask>", true));
        }
        // Each token once (its first role wins, as in transformers), and only if the vocabulary has it
        // (transformers would append a new id; eddy keeps the model's ids). Added in runs of the same kind:
        // every call rebuilds the added-token matcher.
        let mut seen: HashSet<&str> = HashSet::new();
        to_add.retain(|&(tok, _)| inner.token_to_id(tok).is_some() && seen.insert(tok));
        for run in to_add.chunk_by(|a, b| a.1 == b.1) {
            let special = run[0].1;
            let toks: Vec<AddedToken> = run.iter().map(|&(tok, _)| AddedToken::from(tok.to_string(), special).normalized(false)).collect();
            let r = if special { inner.add_special_tokens(toks) } else { inner.add_tokens(toks) };
            r.map_err(|e| bad(format!("cannot register added tokens: {e}")))?;
        }

        if let Some(regex) = split_regex_for(pre) {
            let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
                .map_err(|e| bad(format!("cannot compile the {pre} split regex: {e}")))?;
            let seq = PreSequence::new(vec![
                PreTokenizerWrapper::Split(split),
                PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
            ]);
            inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(seq)));
        }

        let bos = bos_id.map(|id| (t.tokens[id as usize].to_string(), id));
        let eos = eos_id.map(|id| (t.tokens[id as usize].to_string(), id));
        let pp = template_processor(add_bos.then_some(bos.as_ref()).flatten(), add_eos.then_some(eos.as_ref()).flatten()).map_err(bad)?;
        inner.with_post_processor(Some(pp));

        let mut tok = Self::finish(inner, path.to_path_buf(), n, false, bos_id, eos_id, add_bos);
        // GGUF token type 5: UNUSED.
        tok.unused_ids = t.token_types.iter().flatten().enumerate().filter(|&(_, &ty)| ty == 5).map(|(i, _)| i as u32).collect();
        Ok(tok)
    }

    /// Loads a Hugging Face tokenizer: `tokenizer.json` as it is (its post-processor decides what
    /// `add_special` adds; like transformers 5, `add_bos_token`/`add_eos_token` in the config are ignored),
    /// plus `tokenizer_config.json` when given for `bos_token`/`eos_token` and `clean_up_tokenization_spaces`.
    /// A missing or malformed file is an [`Error::Model`] naming it.
    pub fn from_file(tokenizer_json: &Path, tokenizer_config: Option<&Path>) -> Result<Self> {
        let bytes = std::fs::read(tokenizer_json).map_err(|e| Error::model(tokenizer_json, format!("cannot read: {e}")))?;
        let inner =
            tk::Tokenizer::from_bytes(&bytes).map_err(|e| Error::model(tokenizer_json, format!("malformed tokenizer.json: {e}")))?;
        let config: serde_json::Map<String, serde_json::Value> = match tokenizer_config {
            None => serde_json::Map::new(),
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|e| Error::model(p, format!("cannot read: {e}")))?;
                match serde_json::from_str(&text) {
                    Ok(serde_json::Value::Object(m)) => m,
                    Ok(_) => return Err(Error::model(p, "malformed tokenizer config: not a JSON object")),
                    Err(e) => return Err(Error::model(p, format!("malformed tokenizer config: {e}"))),
                }
            }
        };
        let token_name = |key: &str| -> Option<String> {
            match config.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        let bos = token_name("bos_token").and_then(|s| inner.token_to_id(&s).map(|id| (s, id)));
        let eos = token_name("eos_token").and_then(|s| inner.token_to_id(&s).map(|id| (s, id)));
        let cfg_flag = |key: &str| config.get(key).and_then(serde_json::Value::as_bool);
        // transformers 5 ignores add_bos_token/add_eos_token when there is a tokenizer.json: its
        // post-processor alone decides what add_special_tokens adds.
        let eos_id = eos.as_ref().map(|e| e.1);
        // What the post-processor puts first; without a configured BOS, a special token there is the BOS.
        let first = inner.encode_fast("", true).ok().and_then(|e| e.get_ids().first().copied());
        let bos_id =
            bos.as_ref().map(|b| b.1).or_else(|| first.filter(|id| inner.get_added_tokens_decoder().get(id).is_some_and(|t| t.special)));
        let add_bos = bos_id.is_some() && first == bos_id;
        let is_bpe = matches!(inner.get_model(), tk::ModelWrapper::BPE(_));
        let cleanup = !is_bpe && cfg_flag("clean_up_tokenization_spaces").unwrap_or(false);
        let max_added = inner.get_added_tokens_decoder().keys().max().map_or(0, |&m| m as usize + 1);
        let n = inner.get_vocab_size(false).max(max_added);
        Ok(Self::finish(inner, tokenizer_json.to_path_buf(), n, cleanup, bos_id, eos_id, add_bos))
    }

    fn finish(
        inner: tk::Tokenizer,
        source: PathBuf,
        n_vocab: usize,
        cleanup_spaces: bool,
        bos_id: Option<u32>,
        eos_id: Option<u32>,
        add_bos: bool,
    ) -> Self {
        let added = inner.get_added_tokens_decoder();
        let mut stop_ids: Vec<u32> = eos_id.into_iter().collect();
        for name in STOP_TOKEN_NAMES {
            if let Some(id) = inner.token_to_id(name) {
                if added.contains_key(&id) && !stop_ids.contains(&id) {
                    stop_ids.push(id);
                }
            }
        }
        let added_id = |name: &str| inner.token_to_id(name).filter(|id| added.contains_key(id));
        let fim =
            FIM_NAMES.iter().find_map(|[p, s, m]| Some(FimTokens { prefix: added_id(p)?, suffix: added_id(s)?, middle: added_id(m)? }));
        Tokenizer {
            inner,
            source,
            n_vocab,
            cleanup_spaces,
            bos_id,
            eos_id,
            add_bos,
            stop_ids,
            unused_ids: Vec::new(),
            fim,
            plain: Default::default(),
        }
    }

    /// Encodes `text`. With `add_special` the model's special tokens are added around it (BOS when
    /// [`add_bos`](Self::add_bos)), like transformers' `add_special_tokens=True`. Special and added tokens
    /// written in the text (e.g. `<|im_start|>`) are recognised as single tokens, as transformers does.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| Error::Text(format!("cannot tokenize text ({}): {e}", self.source.display())))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes `text` with special-token text read as plain text (transformers'
    /// `split_special_tokens=True`): `<|im_start|>` written in a message becomes the tokens of those
    /// characters, not the control token. No special tokens are added.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.plain.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc =
            plain.encode_fast(text, false).map_err(|e| Error::Text(format!("cannot tokenize text ({}): {e}", self.source.display())))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The prompt that asks a fill-in-the-middle model for the text between `prefix` and `suffix` (PSM
    /// order, [`FimTokens`]): BOS when the model adds one, the prefix token and `prefix`, the suffix token
    /// and `suffix`, then the middle token (the model writes what follows), the code encoded as plain text ([`encode_plain`](Self::encode_plain): control-token
    /// text in the code stays text). `None` when the vocabulary has no FIM tokens.
    pub fn fim_prompt(&self, prefix: &str, suffix: &str) -> Result<Option<Vec<u32>>> {
        let Some(f) = self.fim else {
            return Ok(None);
        };
        let mut ids: Vec<u32> = self.bos_id.filter(|_| self.add_bos).into_iter().collect();
        ids.push(f.prefix);
        ids.extend(self.encode_plain(prefix)?);
        ids.push(f.suffix);
        ids.extend(self.encode_plain(suffix)?);
        ids.push(f.middle);
        Ok(Some(ids))
    }

    /// The texts of the special (control) added tokens, e.g. `<|im_start|>`.
    pub fn special_token_texts(&self) -> Vec<String> {
        self.inner.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect()
    }

    /// Whether the vocabulary is byte-level BPE (entries written in the GPT-2 byte alphabet).
    pub fn is_byte_level(&self) -> bool {
        matches!(self.inner.get_decoder(), Some(tk::DecoderWrapper::ByteLevel(_)))
    }

    /// Decodes ids to text (transformers' `decode`); with `skip_special` special tokens are left out. Ids
    /// outside the vocabulary are skipped, as transformers does (models often have more logits than tokens).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special)
            .map_err(|e| Error::Text(format!("cannot decode token ids ({}): {e}", self.source.display())))?;
        Ok(if self.cleanup_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// The text token `id` adds after other tokens (llama.cpp's token piece; OpenAI's log-probability
    /// token): its one-token [`decode`](Self::decode), with the leading spaces of a SentencePiece entry
    /// (`▁Hello` → ` Hello`, `▁▁▁▁` → four spaces) put back where the decoder takes them from the start of a
    /// text (Llama 2, Mistral: a `Strip` decoder drops one, a `Metaspace` decoder every `▁` of the first
    /// token). Ids outside the vocabulary give `""`.
    ///
    /// # Errors
    /// [`Error::Text`] if the decoder fails.
    pub fn piece(&self, id: u32) -> Result<String> {
        let text = self.decode(&[id], false)?;
        if self.is_byte_level() {
            return Ok(text);
        }
        let entry_spaces = self.token_str(id).map_or(0, |e| e.chars().take_while(|&c| c == '\u{2581}').count());
        let text_spaces = text.chars().take_while(|&c| c == ' ').count();
        if entry_spaces <= text_spaces {
            return Ok(text);
        }
        let text = format!("{}{text}", " ".repeat(entry_spaces - text_spaces));
        Ok(if self.cleanup_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// A text longer than this many bytes has more than `tokens` tokens: no token's spelling is longer than
    /// the longest vocabulary entry (in its stored form, which is never shorter than the text it stands for:
    /// byte-level BPE and SentencePiece entries spell each byte with one to six bytes), with a factor of 4
    /// for normalizers that shorten text. Lets a text of megabytes be refused before it is tokenized
    /// (seconds of work and gigabytes of peak memory for an answer known in advance). O(vocabulary).
    pub fn max_text_bytes(&self, tokens: usize) -> usize {
        let longest = (0..self.n_vocab as u32).filter_map(|i| self.token_str(i)).map(|s| s.len()).max().unwrap_or(1).max(1);
        tokens.saturating_mul(longest).saturating_mul(4)
    }

    /// Number of token ids (the size of the id space, added tokens included).
    pub fn vocab_size(&self) -> usize {
        self.n_vocab
    }

    /// The vocabulary entry of `id` as stored (byte-level tokens in the GPT-2 alphabet, `▁` for spaces in
    /// SentencePiece vocabularies); special tokens read as written, e.g. `<|im_end|>`. `None` if out of range.
    pub fn token_str(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a vocabulary entry or added token, spelled as [`token_str`](Self::token_str) returns it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Whether `id` ends generation (is in [`stop_ids`](Self::stop_ids)).
    pub fn is_stop(&self, id: u32) -> bool {
        self.stop_ids.contains(&id)
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tk::Tokenizer {
        &self.inner
    }
}

/// The special tokens transformers' `GPT2Tokenizer`/`LlamaTokenizer`/`GemmaTokenizer` register by default;
/// they become special added tokens when the vocabulary has them.
const LLAMA_DEFAULTS: &[&str] = &["<unk>", "<s>", "</s>"];
const GEMMA_DEFAULTS: &[&str] = &["<unk>", "<bos>", "<eos>", "<pad>", "<mask>"];

/// transformers' `clean_up_tokenization` (only used for non-BPE models that ask for it).
fn clean_up_tokenization(s: &str) -> String {
    s.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

/// A `TemplateProcessing` post-processor adding `bos` before and `eos` after the sequence (either optional),
/// as transformers' `update_post_processor` builds it. Built from its serialized form so that token names
/// containing `:` or spaces are fine.
fn template_processor(bos: Option<&(String, u32)>, eos: Option<&(String, u32)>) -> std::result::Result<PostProcessorWrapper, String> {
    use serde_json::json;
    let special = |(name, _): &(String, u32), type_id: u32| json!({"SpecialToken": {"id": name, "type_id": type_id}});
    let seq = |id: &str, type_id: u32| json!({"Sequence": {"id": id, "type_id": type_id}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    if let Some(b) = bos {
        single.push(special(b, 0));
        pair.push(special(b, 0));
    }
    single.push(seq("A", 0));
    pair.push(seq("A", 0));
    if let Some(e) = eos {
        single.push(special(e, 0));
        pair.push(special(e, 0));
    }
    if let Some(b) = bos {
        pair.push(special(b, 1));
    }
    pair.push(seq("B", 1));
    if let Some(e) = eos {
        pair.push(special(e, 1));
    }
    let mut specials = serde_json::Map::new();
    for (name, id) in bos.into_iter().chain(eos) {
        specials.insert(name.clone(), json!({"id": name, "ids": [id], "tokens": [name]}));
    }
    let v = json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": specials});
    serde_json::from_value(v).map_err(|e| format!("cannot build the BOS/EOS post-processor: {e}"))
}

fn split_merges(merges: &[&str]) -> std::result::Result<Vec<(String, String)>, String> {
    merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let mut parts = m.split(' ');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(a), Some(b), None) => Ok((a.to_string(), b.to_string())),
                _ => Err(format!("malformed tokenizer.ggml.merges[{i}] = {m:?} (expected two tokens separated by a space)")),
            }
        })
        .collect()
}

/// Byte-level BPE (`tokenizer.ggml.model = "gpt2"`), as transformers' `GPT2Tokenizer`.
fn build_byte_level(t: &GgufTok) -> std::result::Result<tk::Tokenizer, String> {
    let table = byte_alphabet();
    let mut in_alphabet = vec![false; 0x180];
    for c in table {
        in_alphabet[c as usize] = true;
    }
    let spelled = |c: char| (c as usize) < in_alphabet.len() && in_alphabet[c as usize];
    let mut vocab = Vocab::with_capacity(t.tokens.len());
    for (i, tok) in t.tokens.iter().enumerate() {
        let key = if tok.chars().all(spelled) { tok.to_string() } else { tok.bytes().map(|b| table[b as usize]).collect() };
        vocab.insert(key, i as u32);
    }
    let merges = split_merges(t.merges.as_deref().ok_or("missing tokenizer metadata tokenizer.ggml.merges (needed by a gpt2 tokenizer)")?)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .continuing_subword_prefix(String::new())
        .end_of_word_suffix(String::new())
        .fuse_unk(false)
        .build()
        .map_err(|e| format!("invalid BPE vocabulary/merges: {e}"))?;
    let mut tok = tk::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, true))));
    tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::default())));
    Ok(tok)
}

/// SentencePiece-style BPE with byte fallback (`tokenizer.ggml.model = "llama"` / `"gemma4"`).
fn build_sentencepiece(t: &GgufTok, flavor: SpFlavor) -> std::result::Result<tk::Tokenizer, String> {
    let gemma = matches!(flavor, SpFlavor::Gemma | SpFlavor::Gemma4);
    // Gemma files store tokens of two or more spaces with real spaces; GemmaTokenizer looks them up as "▁▁".
    let tokens: Vec<std::borrow::Cow<str>> = t
        .tokens
        .iter()
        .map(|&tok| {
            if flavor == SpFlavor::Gemma && tok.contains(' ') && tok.chars().all(py_isspace) {
                std::borrow::Cow::Owned("\u{2581}".repeat(tok.chars().count()))
            } else {
                std::borrow::Cow::Borrowed(tok)
            }
        })
        .collect();
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (i, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.to_string(), i as u32);
    }
    let merges = match &t.merges {
        Some(m) => split_merges(m)?,
        None => {
            // Scores: Gemma's merge order is the token order; otherwise the file's scores.
            let scores: Vec<f64> = if flavor == SpFlavor::Gemma {
                (0..tokens.len()).map(|i| -(i as f64)).collect()
            } else {
                t.scores.clone().ok_or("missing tokenizer metadata: neither tokenizer.ggml.merges nor tokenizer.ggml.scores")?
            };
            generate_merges(&tokens, &vocab, &scores)
        }
    };
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).fuse_unk(true).byte_fallback(true);
    if gemma {
        builder = builder.unk_token("<unk>".to_string());
    }
    let bpe = builder.build().map_err(|e| format!("invalid BPE vocabulary/merges: {e}"))?;
    let mut tok = tk::Tokenizer::new(bpe);
    let replace = |from: &str, to: &str| Replace::new(from, to).map_err(|e| format!("{e}"));
    let mut decoders = vec![
        DecoderWrapper::Replace(replace("\u{2581}", " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    match flavor {
        SpFlavor::Gemma | SpFlavor::Gemma4 => {
            tok.with_normalizer(Some(NormalizerWrapper::Replace(replace(" ", "\u{2581}")?))).map_err(|e| format!("{e}"))?;
            let split = Split::new(SplitPattern::String(" ".into()), SplitDelimiterBehavior::MergedWithPrevious, false)
                .map_err(|e| format!("{e}"))?;
            tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Split(split)));
        }
        SpFlavor::Llama => {
            tok.with_pre_tokenizer(Some(PreTokenizerWrapper::Metaspace(Metaspace::new('\u{2581}', PrependScheme::First, false))));
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
        SpFlavor::Phi3 => {
            let norm = tokenizers::normalizers::Sequence::new(vec![
                NormalizerWrapper::Prepend(Prepend::new("\u{2581}".into())),
                NormalizerWrapper::Replace(replace(" ", "\u{2581}")?),
            ]);
            tok.with_normalizer(Some(NormalizerWrapper::Sequence(norm))).map_err(|e| format!("{e}"))?;
            decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
        }
    }
    tok.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(decoders))));
    Ok(tok)
}

/// Merges implied by a vocabulary (transformers' `generate_merges` with scores): every split of a token
/// into two vocabulary entries is a merge; merges are ordered by the token's score (highest first), then
/// by the lengths of the left and right pieces (longest first), ties keeping vocabulary order. For repeated
/// tokens the last occurrence's score counts.
fn generate_merges(tokens: &[std::borrow::Cow<str>], vocab: &Vocab, scores: &[f64]) -> Vec<(String, String)> {
    // (score, left chars, right chars, left, right), in the order Python builds them.
    let mut seen: HashSet<&str> = HashSet::with_capacity(tokens.len());
    let mut merges: Vec<(f64, usize, usize, &str, &str)> = Vec::new();
    let mut local: Vec<(u32, u32, usize, usize, &str, &str)> = Vec::new();
    for tok in tokens {
        let tok: &str = tok;
        if !seen.insert(tok) {
            continue;
        }
        let score = scores[vocab[tok] as usize];
        local.clear();
        let total_chars = tok.chars().count();
        for (nl, (pos, _)) in tok.char_indices().enumerate().skip(1) {
            let (l, r) = tok.split_at(pos);
            if let (Some(&il), Some(&ir)) = (vocab.get(l), vocab.get(r)) {
                local.push((il, ir, nl, total_chars - nl, l, r));
            }
        }
        local.sort_by_key(|x| (x.0, x.1));
        merges.extend(local.iter().map(|&(_, _, nl, nr, l, r)| (score, nl, nr, l, r)));
    }
    // Stable sort, descending on (score, len(left), len(right)), like Python's sorted(..., reverse=True).
    merges.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap_or(std::cmp::Ordering::Equal).then(b.1.cmp(&a.1)).then(b.2.cmp(&a.2)));
    merges.into_iter().map(|(_, _, _, l, r)| (l.to_string(), r.to_string())).collect()
}

/// Streaming detokenizer: push generated ids one at a time and get the new text. A delta never ends inside
/// a multi-byte UTF-8 character or an incomplete byte-fallback sequence (nothing is emitted until the
/// character is complete), and the concatenation of all deltas plus [`finish`](Self::finish) equals
/// [`Tokenizer::decode`] of all ids.
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Context ids (already emitted, kept so that decoding sees their neighbours) followed by pending ids.
    ids: Vec<u32>,
    /// Number of context ids at the front of `ids`.
    n_context: usize,
    /// `decode(ids[..n_context])`.
    context_text: String,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder over `tok`; `skip_special` as in [`Tokenizer::decode`].
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder { tok, skip_special, ids: Vec::new(), n_context: 0, context_text: String::new() }
    }

    /// A decoder whose text continues `context` (ids already shown, e.g. an echoed prompt's last few): the
    /// first new token decodes as it would after them (a SentencePiece word's leading space is kept,
    /// where a decode from nothing strips it).
    pub fn with_context(tok: &'a Tokenizer, skip_special: bool, context: &[u32]) -> Result<Self> {
        let context_text = tok.decode(context, skip_special)?;
        Ok(StreamDecoder { tok, skip_special, ids: context.to_vec(), n_context: context.len(), context_text })
    }

    /// Adds one id; returns the text it completes, or `None` when nothing new is complete yet.
    pub fn push(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        if text.len() <= self.context_text.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let delta = self.take_delta(text)?;
        // The ids just emitted become the context for the next ones.
        self.ids.drain(..self.n_context);
        self.n_context = self.ids.len();
        self.context_text = self.tok.decode(&self.ids, self.skip_special)?;
        Ok(Some(delta))
    }

    /// Flushes what is still pending (e.g. an incomplete character at the end, which decodes to U+FFFD as
    /// in [`Tokenizer::decode`]); `None` if nothing is.
    pub fn finish(&mut self) -> Result<Option<String>> {
        let text = self.tok.decode(&self.ids, self.skip_special)?;
        let delta = self.take_delta(text)?;
        self.ids.clear();
        self.n_context = 0;
        self.context_text.clear();
        Ok(if delta.is_empty() { None } else { Some(delta) })
    }

    fn take_delta(&self, text: String) -> Result<String> {
        match text.strip_prefix(self.context_text.as_str()) {
            Some(rest) => Ok(rest.to_string()),
            None => {
                Err(Error::Text(format!("streaming decode: text {text:?} does not continue the previous text {:?}", self.context_text)))
            }
        }
    }
}
