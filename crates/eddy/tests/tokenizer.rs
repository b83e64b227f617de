//! Tokenizer tests against transformers (the reference).
//!
//! Fixtures in tests/fixtures/text/ come from `tools/make_text_fixtures.py`, which loads each GGUF model's
//! tokenizer with `AutoTokenizer.from_pretrained(dir, gguf_file=...)` and records ids and decodes. The GGUF
//! files live in `$EDDY_MODELS` (default `~/.cache/eddy/models`); a missing file fails the test (fetch them
//! with `tools/fetch_models.sh all`) unless `EDDY_SKIP_MODEL_TESTS=1`.

use eddy::gguf::GgufFile;
use eddy::tokenizer::{StreamDecoder, Tokenizer};
use eddy::Error;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text")
}

fn fixture(name: &str) -> Value {
    let p = fixtures().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// The model file, or `None` (skip) when it is missing and EDDY_SKIP_MODEL_TESTS=1; otherwise a missing
/// file fails the test.
fn model_file(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("EDDY_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/eddy/models"));
    let p = dir.join(name);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("EDDY_SKIP_MODEL_TESTS").as_deref() == Ok("1") {
        eprintln!("skipping: {} is missing (EDDY_SKIP_MODEL_TESTS=1)", p.display());
        return None;
    }
    panic!("model file {} is missing: run `tools/fetch_models.sh all` (or set EDDY_SKIP_MODEL_TESTS=1 to skip)", p.display());
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

fn fnv1a64(text: &str) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in text.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}")
}

/// Concatenation of all StreamDecoder deltas for `ids`.
fn stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> String {
    let mut d = StreamDecoder::new(tok, skip);
    let mut out = String::new();
    for &id in ids {
        if let Some(s) = d.push(id).expect("push") {
            assert!(!s.is_empty(), "push returned an empty delta");
            out.push_str(&s);
        }
    }
    if let Some(s) = d.finish().expect("finish") {
        out.push_str(&s);
    }
    out
}

/// Compares eddy's tokenizer for one GGUF model to its fixture; returns the list of mismatches.
fn check_gguf_model(key: &str) {
    let fx = fixture(&format!("{key}.json"));
    let Some(path) = model_file(fx["model_file"].as_str().unwrap()) else { return };
    let g = GgufFile::open(&path).expect("open gguf");
    let t0 = Instant::now();
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer from gguf");
    eprintln!("{key}: Tokenizer::from_gguf took {:.3} s", t0.elapsed().as_secs_f64());
    let mut bad: Vec<String> = Vec::new();
    let mut check = |what: String, ok: bool| {
        if !ok {
            bad.push(what);
        }
    };

    check(format!("bos_id {:?} vs {}", tok.bos_id, fx["bos_token_id"]), tok.bos_id.map(u64::from) == fx["bos_token_id"].as_u64());
    check(format!("eos_id {:?} vs {}", tok.eos_id, fx["eos_token_id"]), tok.eos_id.map(u64::from) == fx["eos_token_id"].as_u64());
    check(format!("add_bos {} vs {}", tok.add_bos, fx["add_bos_token"]), Some(tok.add_bos) == fx["add_bos_token"].as_bool());
    check(format!("vocab_size {} vs {}", tok.vocab_size(), fx["len"]), tok.vocab_size() as u64 == fx["len"].as_u64().unwrap());
    check(format!("eos {:?} not a stop id", tok.eos_id), tok.eos_id.is_none_or(|e| tok.is_stop(e)));
    check(
        format!("bos token name {:?} vs {}", tok.bos_id.and_then(|b| tok.token_str(b)), fx["bos_token"]),
        tok.bos_id.and_then(|b| tok.token_str(b)).as_deref() == fx["bos_token"].as_str(),
    );

    // Fingerprints of the vocabulary, merges and added tokens.
    let inner = tok.inner();
    let mut vocab: Vec<(String, u32)> = inner.get_vocab(true).into_iter().collect();
    vocab.sort_by_key(|x| x.1);
    let vocab_text: String = vocab.iter().map(|(t, i)| format!("{i}\t{t}\n")).collect();
    check(format!("vocab entries {} vs {}", vocab.len(), fx["vocab_entries"]), vocab.len() as u64 == fx["vocab_entries"].as_u64().unwrap());
    check("vocab fingerprint".into(), fnv1a64(&vocab_text) == fx["vocab_fnv"].as_str().unwrap());
    let model_json = serde_json::to_value(inner.get_model()).expect("serialize model");
    let merges = model_json["merges"].as_array().cloned().unwrap_or_default();
    let merges_text: String = merges
        .iter()
        .map(|m| match m {
            Value::String(s) => format!("{s}\n"),
            Value::Array(p) => format!("{} {}\n", p[0].as_str().unwrap(), p[1].as_str().unwrap()),
            other => panic!("unexpected merge {other}"),
        })
        .collect();
    check(format!("merges count {} vs {}", merges.len(), fx["merges_count"]), merges.len() as u64 == fx["merges_count"].as_u64().unwrap());
    check("merges fingerprint".into(), fnv1a64(&merges_text) == fx["merges_fnv"].as_str().unwrap());
    let mut added: Vec<(u32, tokenizers::AddedToken)> = inner.get_added_tokens_decoder().into_iter().collect();
    added.sort_by_key(|x| x.0);
    let added_text: String = added.iter().map(|(i, t)| format!("{i}\t{}\t{}\n", t.content, t.special as u8)).collect();
    let n_special = added.iter().filter(|(_, t)| t.special).count();
    check(format!("added tokens {} vs {}", added.len(), fx["added_count"]), added.len() as u64 == fx["added_count"].as_u64().unwrap());
    check(
        format!("special added tokens {n_special} vs {}", fx["added_special_count"]),
        n_special as u64 == fx["added_special_count"].as_u64().unwrap(),
    );
    check("added tokens fingerprint".into(), fnv1a64(&added_text) == fx["added_fnv"].as_str().unwrap());

    let cases = fx["cases"].as_array().unwrap();
    assert!(cases.len() >= 24, "fixture has only {} strings", cases.len());
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let want_special = ids(&c["ids_special"]);
        let got = tok.encode(text, false).unwrap();
        check(format!("encode({text:?}, false) = {got:?}, transformers {want:?}"), got == want);
        let got = tok.encode(text, true).unwrap();
        check(format!("encode({text:?}, true) = {got:?}, transformers {want_special:?}"), got == want_special);
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip")] {
            let want = c[key].as_str().unwrap();
            let got = tok.decode(&want_special, skip).unwrap();
            check(format!("decode({want_special:?}, skip={skip}) = {got:?}, transformers {want:?}"), got == want);
            let got = stream(&tok, &want_special, skip);
            check(format!("stream decode of {text:?} (skip={skip}) = {got:?}, want {want:?}"), got == want);
        }
    }
    for d in fx["decodes"].as_array().unwrap() {
        let seq = ids(&d["ids"]);
        let name = d["name"].as_str().unwrap();
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip")] {
            let want = d[key].as_str().unwrap();
            let got = tok.decode(&seq, skip).unwrap();
            check(format!("decode {name} (skip={skip}) = {got:?}, transformers {want:?}"), got == want);
            let got = stream(&tok, &seq, skip);
            check(format!("stream decode {name} (skip={skip}) = {got:?}, want {want:?}"), got == want);
        }
    }
    assert!(bad.is_empty(), "{key}: {} mismatches with transformers:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn smollm2_matches_transformers() {
    check_gguf_model("smollm2");
}

#[test]
fn qwen05_matches_transformers() {
    check_gguf_model("qwen05");
}

#[test]
fn qwen15_matches_transformers() {
    check_gguf_model("qwen15");
}

#[test]
fn gemma3_matches_transformers() {
    check_gguf_model("gemma3");
}

/// Pushing the single-byte tokens of "😀" one by one yields nothing until the character is complete.
#[test]
fn stream_decoder_holds_split_emoji() {
    for key in ["smollm2", "qwen05", "gemma3"] {
        let fx = fixture(&format!("{key}.json"));
        let Some(path) = model_file(fx["model_file"].as_str().unwrap()) else { return };
        let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        let find = |name: &str| ids(&fx["decodes"].as_array().unwrap().iter().find(|d| d["name"] == name).unwrap()["ids"]);
        let bytes = find("emoji_bytes");
        assert_eq!(bytes.len(), 4, "{key}: the emoji takes four byte tokens");
        let mut d = StreamDecoder::new(&tok, false);
        for &id in &bytes[..3] {
            assert_eq!(d.push(id).unwrap(), None, "{key}: emitted text before the emoji was complete");
        }
        assert_eq!(d.push(bytes[3]).unwrap().as_deref(), Some("😀"), "{key}");
        assert_eq!(d.finish().unwrap(), None, "{key}");

        // Text, then an emoji split over tokens, then text: deltas never hold a partial character.
        let mut seq = tok.encode("ok ", false).unwrap();
        seq.extend(&bytes);
        seq.extend(tok.encode(" done", false).unwrap());
        let mut d = StreamDecoder::new(&tok, false);
        let deltas: Vec<String> = seq.iter().filter_map(|&id| d.push(id).unwrap()).collect();
        assert!(deltas.iter().any(|s| s.contains('😀')), "{key}: {deltas:?}");
        assert!(deltas.iter().all(|s| !s.contains('\u{FFFD}')), "{key}: {deltas:?}");
        assert_eq!(deltas.concat(), tok.decode(&seq, false).unwrap(), "{key}");

        // An incomplete character at the end comes out of finish() as decode() shows it.
        let trunc = &bytes[..3];
        let mut d = StreamDecoder::new(&tok, false);
        for &id in trunc {
            assert_eq!(d.push(id).unwrap(), None);
        }
        assert_eq!(d.finish().unwrap(), Some(tok.decode(trunc, false).unwrap()), "{key}");
    }
}

/// The 151k-token Qwen tokenizer loads from GGUF metadata (its load time: `cargo bench -p eddy --bench load`).
#[test]
fn qwen_tokenizer_loads() {
    let Some(path) = model_file("qwen2.5-coder-0.5b-instruct.gguf") else { return };
    let g = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    assert_eq!(tok.vocab_size(), 151936);
}

#[test]
fn stop_ids_cover_chat_end_tokens() {
    let Some(path) = model_file("qwen2.5-coder-0.5b-instruct.gguf") else { return };
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    for name in ["<|im_end|>", "<|endoftext|>"] {
        let id = tok.token_id(name).unwrap();
        assert!(tok.is_stop(id), "{name} is not a stop id");
    }
    assert!(!tok.is_stop(tok.encode("hello", false).unwrap()[0]));
}

/// Qwen2.5-Coder's fill-in-the-middle prompt is its documented `<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>`
/// (the same ids as that text encoded with its control tokens), control-token text inside the code stays
/// text, and the FIM pad/repo/file tokens end generation; models without FIM tokens have none.
#[test]
fn fim_prompt_is_psm_with_the_code_as_plain_text() {
    let Some(path) = model_file("qwen2.5-coder-0.5b-instruct.gguf") else { return };
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let f = tok.fim.expect("Qwen2.5-Coder has FIM tokens");
    assert_eq!(
        (tok.token_str(f.prefix), tok.token_str(f.suffix), tok.token_str(f.middle)),
        (Some("<|fim_prefix|>".into()), Some("<|fim_suffix|>".into()), Some("<|fim_middle|>".into()))
    );
    let (pre, suf) = ("def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n");
    let want = tok.encode(&format!("<|fim_prefix|>{pre}<|fim_suffix|>{suf}<|fim_middle|>"), false).unwrap();
    assert_eq!(tok.fim_prompt(pre, suf).unwrap().unwrap(), want);
    let ids = tok.fim_prompt("x = '<|im_start|>'", "").unwrap().unwrap();
    assert!(!ids.contains(&tok.token_id("<|im_start|>").unwrap()), "{ids:?}");
    assert_eq!(ids.last(), Some(&f.middle));
    for name in ["<|fim_pad|>", "<|file_sep|>", "<|repo_name|>"] {
        assert!(tok.is_stop(tok.token_id(name).unwrap()), "{name}");
    }
    for name in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"] {
        let Some(path) = model_file(name) else { return };
        let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
        assert_eq!(tok.fim, None, "{name}");
        assert_eq!(tok.fim_prompt("a", "b").unwrap(), None);
    }
}

/// A Hugging Face folder (tokenizer.json + tokenizer_config.json) loads as transformers loads it.
#[test]
fn hf_tokenizer_json_matches_transformers() {
    let fx = fixture("tiny_hf.json");
    let dir = fixtures().join("tiny_hf");
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json"))).unwrap();
    assert_eq!(tok.bos_id.map(u64::from), fx["bos_token_id"].as_u64());
    assert_eq!(tok.eos_id.map(u64::from), fx["eos_token_id"].as_u64());
    assert_eq!(Some(tok.add_bos), fx["add_bos_token"].as_bool());
    assert_eq!(tok.vocab_size() as u64, fx["len"].as_u64().unwrap());
    let mut bad = Vec::new();
    for c in fx["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let (want, want_special) = (ids(&c["ids"]), ids(&c["ids_special"]));
        if tok.encode(text, false).unwrap() != want || tok.encode(text, true).unwrap() != want_special {
            bad.push(format!("encode {text:?}"));
        }
        for (skip, key) in [(false, "decoded"), (true, "decoded_skip")] {
            let want = c[key].as_str().unwrap();
            if tok.decode(&want_special, skip).unwrap() != want || stream(&tok, &want_special, skip) != want {
                bad.push(format!("decode {text:?} skip={skip}"));
            }
        }
    }
    assert!(bad.is_empty(), "mismatches: {bad:?}");
}

#[test]
fn malformed_tokenizer_files_are_model_errors() {
    let dir = std::env::temp_dir().join(format!("eddy-tok-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    let bad_json = dir.join("tokenizer.json");
    std::fs::write(&bad_json, "{ not json").unwrap();
    match Tokenizer::from_file(&bad_json, None) {
        Err(Error::Model { path, problem }) => {
            assert_eq!(path, bad_json);
            assert!(problem.contains("tokenizer.json"), "{problem}");
        }
        other => panic!("expected a model error, got {other:?}"),
    }
    let missing = dir.join("nope.json");
    assert!(matches!(Tokenizer::from_file(&missing, None), Err(Error::Model { path, .. }) if path == missing));
    let good = fixtures().join("tiny_hf/tokenizer.json");
    let bad_cfg = dir.join("tokenizer_config.json");
    std::fs::write(&bad_cfg, "[1, 2").unwrap();
    assert!(matches!(Tokenizer::from_file(&good, Some(&bad_cfg)), Err(Error::Model { path, .. }) if path == bad_cfg));

    // A GGUF without tokenizer metadata, and one whose tokenizer lacks its tokens.
    let gguf = |name: &str, kvs: &[(&str, &str)]| -> PathBuf {
        let mut b: Vec<u8> = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (k, v) in kvs {
            b.extend((k.len() as u64).to_le_bytes());
            b.extend(k.as_bytes());
            b.extend(8u32.to_le_bytes());
            b.extend((v.len() as u64).to_le_bytes());
            b.extend(v.as_bytes());
        }
        let p = dir.join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let p = gguf("none.gguf", &[("general.architecture", "llama")]);
    match Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()) {
        Err(Error::Model { path, problem }) => {
            assert_eq!(path, p);
            assert!(problem.contains("tokenizer.ggml.model"), "{problem}");
        }
        other => panic!("expected a model error, got {other:?}"),
    }
    let p = gguf("notokens.gguf", &[("general.architecture", "llama"), ("tokenizer.ggml.model", "gpt2")]);
    match Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()) {
        Err(Error::Model { problem, .. }) => assert!(problem.contains("tokenizer.ggml.tokens"), "{problem}"),
        other => panic!("expected a model error, got {other:?}"),
    }
    let p = gguf("bert.gguf", &[("general.architecture", "bert"), ("tokenizer.ggml.model", "bert")]);
    assert!(matches!(Tokenizer::from_gguf(&GgufFile::open(&p).unwrap()), Err(Error::Model { .. })));
    std::fs::remove_dir_all(&dir).ok();
}

/// A token's piece (the text it adds after other tokens) keeps the leading space of a SentencePiece word-start
/// entry, which a one-token decode loses to the `Strip` decoder of Llama-2-style tokenizers; byte-fallback and
/// other entries read as their decode.
#[test]
fn sentencepiece_pieces_keep_their_leading_space() {
    let dir = std::env::temp_dir().join(format!("eddy-piece-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let replace = serde_json::json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "});
    let seq = |strip: bool| {
        let mut d = vec![replace.clone(), serde_json::json!({"type": "ByteFallback"}), serde_json::json!({"type": "Fuse"})];
        if strip {
            d.push(serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        serde_json::json!({"type": "Sequence", "decoders": d})
    };
    // Llama 2 (a Strip decoder), a Metaspace decoder, Gemma (neither: the spaces stay).
    let decoders = [
        ("strip", seq(true)),
        (
            "metaspace",
            serde_json::json!({"type": "Sequence", "decoders": [{"type": "ByteFallback"},
                {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false}]}),
        ),
        ("plain", seq(false)),
    ];
    for (label, decoder) in decoders {
        let path = dir.join(format!("{label}.json"));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false},
            "post_processor": null,
            "decoder": decoder,
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "\u{2581}Hello": 3, "\u{2581}world": 4, "\u{2581}": 5,
                          "<0x0A>": 6, "lo": 7, "\u{2581}\u{2581}\u{2581}\u{2581}": 8},
                "merges": []}
        });
        std::fs::write(&path, json.to_string()).unwrap();
        let tok = Tokenizer::from_file(&path, None).unwrap();
        assert!(!tok.is_byte_level());
        assert_eq!(tok.piece(3).unwrap(), " Hello", "{label}");
        assert_eq!(tok.piece(4).unwrap(), " world", "{label}");
        assert_eq!(tok.piece(5).unwrap(), " ", "{label}");
        assert_eq!(tok.piece(8).unwrap(), "    ", "{label}: an indentation token keeps all its spaces");
        assert_eq!(tok.piece(7).unwrap(), "lo", "{label}");
        assert_eq!(tok.piece(6).unwrap(), "\n", "{label}");
        assert_eq!(tok.piece(99).unwrap(), "", "{label}: ids outside the vocabulary read as nothing");
        // After a first token, each token adds its piece.
        let joined: String = [8u32, 4, 7].iter().map(|&i| tok.piece(i).unwrap()).collect();
        assert_eq!(tok.decode(&[3, 8, 4, 7], false).unwrap(), format!("{}{joined}", tok.decode(&[3], false).unwrap()), "{label}");
    }
    // With the Strip decoder a one-token decode loses the first space (what `piece` puts back).
    let strip = Tokenizer::from_file(&dir.join("strip.json"), None).unwrap();
    assert_eq!(strip.decode(&[3], false).unwrap(), "Hello");
    assert_eq!(strip.decode(&[8], false).unwrap(), "   ");
    // A byte-level vocabulary's pieces are its decodes.
    let q = Tokenizer::from_file(&fixtures().join("../hf/qwen2/tokenizer.json"), None).unwrap();
    assert!(q.is_byte_level());
    for id in 0..q.vocab_size() as u32 {
        assert_eq!(q.piece(id).unwrap(), q.decode(&[id], false).unwrap(), "id {id}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
