//! Chat template tests against transformers' `apply_chat_template` (fixtures from
//! `tools/make_text_fixtures.py`). Model files come from `$EDDY_MODELS` (default `~/.cache/eddy/models`); a
//! missing file fails the test (run `tools/fetch_models.sh all`) unless `EDDY_SKIP_MODEL_TESTS=1`.

use eddy::chat::{encode_chat, ChatMessage, ChatTemplate, CHATML_TEMPLATE};
use eddy::gguf::GgufFile;
use eddy::tokenizer::Tokenizer;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/text")
}

fn fixture(name: &str) -> Value {
    let p = fixtures().join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

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

fn messages(v: &Value) -> Vec<ChatMessage> {
    v.as_array().unwrap().iter().map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap())).collect()
}

fn kwargs(v: &Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Renders every conversation of a fixture and compares text and prompt ids; returns mismatches.
fn check_chats(tmpl: &ChatTemplate, tok: &Tokenizer, chats: &[Value]) -> Vec<String> {
    let mut bad = Vec::new();
    for c in chats {
        let name = format!("{} (add_generation_prompt={})", c["name"].as_str().unwrap(), c["add_generation_prompt"]);
        let text = tmpl.render(&messages(&c["messages"]), c["add_generation_prompt"].as_bool().unwrap(), &kwargs(&c["kwargs"]));
        let text = match text {
            Ok(t) => t,
            Err(e) => {
                bad.push(format!("{name}: render failed: {e}"));
                continue;
            }
        };
        let want = c["text"].as_str().unwrap();
        if text != want {
            bad.push(format!("{name}: rendered\n{text:?}\ntransformers\n{want:?}"));
        }
        let got = encode_chat(tok, &text).unwrap();
        if got != ids(&c["ids"]) {
            bad.push(format!("{name}: ids {got:?}\ntransformers {:?}", ids(&c["ids"])));
        }
    }
    bad
}

fn check_gguf_model(key: &str) {
    let fx = fixture(&format!("{key}.json"));
    let Some(path) = model_file(fx["model_file"].as_str().unwrap()) else { return };
    let g = GgufFile::open(&path).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let tmpl = ChatTemplate::from_gguf(&g, &tok).unwrap();
    let chats = fx["chat"].as_array().unwrap();
    assert_eq!(tmpl.is_some(), fx["has_chat_template"].as_bool().unwrap(), "{key}: chat template presence");
    let Some(tmpl) = tmpl else { return };
    assert!(chats.len() >= 6, "{key}: fixture has {} renders", chats.len());
    let bad = check_chats(&tmpl, &tok, chats);
    assert!(bad.is_empty(), "{key}: {} mismatches with transformers:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn smollm2_template_matches_transformers() {
    check_gguf_model("smollm2");
}

#[test]
fn qwen05_template_matches_transformers() {
    check_gguf_model("qwen05");
}

#[test]
fn qwen15_template_matches_transformers() {
    check_gguf_model("qwen15");
}

/// Gemma 3 270m is a base model: no template, so `eddy run` and `eddy serve` chat with it in ChatML.
#[test]
fn gemma3_has_no_template() {
    check_gguf_model("gemma3");
}

/// ChatML, llama.cpp's fallback for a model without a template: each message `<|im_start|>role\n…<|im_end|>\n`,
/// then the assistant's header as the generation prompt; the tokenizer's BOS first only where it adds one
/// (Gemma 3's does, SmolLM2's does not), as llama.cpp's prompt has it. Its end of turn is a stop text
/// ([`ChatTemplate::end_text`]) only where the vocabulary has no `<|im_end|>` token (Gemma 3's).
#[test]
fn chatml_is_the_fallback_template() {
    let t = ChatTemplate::new(CHATML_TEMPLATE, None, None).unwrap();
    let msgs = [
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "Hi"),
        ChatMessage::new("assistant", "Hello!"),
        ChatMessage::new("user", "Bye"),
    ];
    let turns = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n";
    assert_eq!(t.render(&msgs, true, &Map::new()).unwrap(), format!("{turns}<|im_start|>assistant\n"));
    assert_eq!(t.render(&msgs, false, &Map::new()).unwrap(), turns);
    for (file, bos, end) in [("gemma-3-270m-q4_k_m.gguf", "<bos>", Some("<|im_end|>")), ("SmolLM2-135M-Instruct.Q4_1.gguf", "", None)] {
        let Some(path) = model_file(file) else { return };
        let g = GgufFile::open(&path).unwrap();
        let tok = Tokenizer::from_gguf(&g).unwrap();
        let t = ChatTemplate::chatml(&tok);
        let want = format!("{bos}<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        assert_eq!(t.render(&msgs[1..2], true, &Map::new()).unwrap(), want, "{file}");
        assert_eq!(t.end_text(), end, "{file}");
        // The model's own template wins; none: ChatML.
        assert_eq!(ChatTemplate::or_chatml(None, &tok).source(), t.source(), "{file}");
        let own = ChatTemplate::from_gguf(&g, &tok).unwrap();
        let has_own = own.is_some();
        assert_eq!(ChatTemplate::or_chatml(own, &tok).source() != t.source(), has_own, "{file}");
    }
}

/// Templates exercising Jinja features (tojson, namespace, loop controls, Python methods, whitespace
/// control, raise_exception, printing of Python values), rendered by transformers' own renderer.
#[test]
fn synthetic_templates_match_transformers() {
    let fx = fixture("chat_synthetic.json");
    let mut bad = Vec::new();
    for c in fx.as_array().unwrap() {
        let name = format!("{} (add_generation_prompt={})", c["name"].as_str().unwrap(), c["add_generation_prompt"]);
        let tmpl = ChatTemplate::new(
            c["template"].as_str().unwrap(),
            c["bos_token"].as_str().map(str::to_string),
            c["eos_token"].as_str().map(str::to_string),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let got = tmpl.render(&messages(&c["messages"]), c["add_generation_prompt"].as_bool().unwrap(), &kwargs(&c["kwargs"]));
        match (got, c.get("text").and_then(Value::as_str), c.get("error").and_then(Value::as_str)) {
            (Ok(t), Some(want), _) if t == want => {}
            (Ok(t), Some(want), _) => bad.push(format!("{name}: rendered\n{t:?}\ntransformers\n{want:?}")),
            (Err(e), _, Some(msg)) if e.to_string().contains(msg) => {}
            (Err(e), _, Some(msg)) => bad.push(format!("{name}: error {e:?} does not carry {msg:?}")),
            (Err(e), Some(_), None) => bad.push(format!("{name}: render failed: {e}")),
            (Ok(t), None, _) => bad.push(format!("{name}: rendered {t:?} but transformers raised {:?}", c["error"])),
            (Err(e), None, None) => bad.push(format!("{name}: fixture has neither text nor error ({e})")),
        }
    }
    assert!(bad.is_empty(), "{} mismatches with transformers:\n{}", bad.len(), bad.join("\n"));
}

/// A Hugging Face folder: template from tokenizer_config.json's list form ("default" entry).
#[test]
fn hf_dir_template_matches_transformers() {
    let fx = fixture("tiny_hf.json");
    let dir = fixtures().join("tiny_hf");
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json"))).unwrap();
    let tmpl = ChatTemplate::from_dir(&dir, &tok).unwrap().expect("template in tokenizer_config.json");
    let bad = check_chats(&tmpl, &tok, fx["chat"].as_array().unwrap());
    assert!(bad.is_empty(), "{} mismatches with transformers:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn from_dir_prefers_chat_template_jinja_and_handles_absence() {
    let dir = std::env::temp_dir().join(format!("eddy-chat-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tiny = fixtures().join("tiny_hf");
    let tok = Tokenizer::from_file(&tiny.join("tokenizer.json"), Some(&tiny.join("tokenizer_config.json"))).unwrap();
    assert!(ChatTemplate::from_dir(&dir, &tok).unwrap().is_none());
    std::fs::write(dir.join("tokenizer_config.json"), r#"{"chat_template": "cfg:{{ messages[0].content }}"}"#).unwrap();
    let msgs = [ChatMessage::new("user", "hi")];
    let t = ChatTemplate::from_dir(&dir, &tok).unwrap().unwrap();
    assert_eq!(t.render(&msgs, false, &Map::new()).unwrap(), "cfg:hi");
    std::fs::write(dir.join("chat_template.jinja"), "jinja:{{ bos_token }}{{ messages[0].content }}\n").unwrap();
    let t = ChatTemplate::from_dir(&dir, &tok).unwrap().unwrap();
    assert_eq!(t.render(&msgs, false, &Map::new()).unwrap(), "jinja:<s>hi");
    // A template that does not compile is kept with its error, which rendering returns (a model whose chat
    // template is broken still runs raw prompts).
    std::fs::write(dir.join("chat_template.jinja"), "{% for %}").unwrap();
    let t = ChatTemplate::from_dir(&dir, &tok).unwrap().unwrap();
    assert!(t.compile_error().is_some_and(|e| e.contains("does not compile")));
    assert!(t.render(&msgs, false, &Map::new()).unwrap_err().to_string().contains("does not compile"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn strftime_now_and_errors() {
    let t = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None).unwrap();
    let before = chrono::Local::now().format("%Y-%m-%d").to_string();
    let got = t.render(&[], false, &Map::new()).unwrap();
    let after = chrono::Local::now().format("%Y-%m-%d").to_string();
    assert!(got == before || got == after, "{got}");
    // An invalid format is an error, not a panic.
    let t = ChatTemplate::new("{{ strftime_now('%Q %') }}", None, None).unwrap();
    assert!(t.render(&[], false, &Map::new()).is_err());
    // Syntax errors surface at compile time.
    assert!(ChatTemplate::new("{% if %}", None, None).is_err());
    // raise_exception carries the template's message.
    let t = ChatTemplate::new("{{ raise_exception('System role not supported') }}", None, None).unwrap();
    let e = t.render(&[], false, &Map::new()).unwrap_err().to_string();
    assert!(e.contains("System role not supported"), "{e}");
    // Kwargs reach the template; absent bos_token is undefined (renders empty).
    let t = ChatTemplate::new("[{{ bos_token }}]{{ enable_thinking }}", None, None).unwrap();
    let mut kw = Map::new();
    kw.insert("enable_thinking".into(), Value::Bool(false));
    assert_eq!(t.render(&[], false, &kw).unwrap(), "[]False");
}
