//! The command line as a user meets it: every mistake gets one line `error: <file or option>: <problem>`
//! and exit code 2 (option checks come before the model load), help is complete, the reply on stdout is
//! valid UTF-8, the stats panel has its 9 lines, and closed pipes never panic the process.
//! Model runs use SmolLM2 (the fastest model) with one thread and a few tokens.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod common;

use common::smol;

fn tmp(name: &str) -> PathBuf {
    common::tmp("cli-usage", name)
}

fn eddy(args: &[&str]) -> Output {
    eddy_stdin(args, None)
}

fn eddy_stdin(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(bytes) = stdin {
        child.stdin.take().unwrap().write_all(bytes).unwrap();
    }
    child.wait_with_output().unwrap()
}

/// Exit code 2, no panic, and stderr is exactly one line `error: <thing>: <problem>` containing `needle`.
fn expect_error(args: &[&str], needle: &str) -> String {
    expect_error_stdin(args, None, needle)
}

fn expect_error_stdin(args: &[&str], stdin: Option<&[u8]>, needle: &str) -> String {
    let out = eddy_stdin(args, stdin);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line: {err}");
    let line = lines[0];
    assert!(line.starts_with("error: "), "{args:?}: {err}");
    let rest = &line["error: ".len()..];
    let (thing, problem) = rest.split_once(": ").unwrap_or_else(|| panic!("{args:?}: no 'thing: problem' in {err}"));
    assert!(!thing.trim().is_empty() && !problem.trim().is_empty(), "{args:?}: {err}");
    assert!(line.contains(needle), "{args:?}: expected '{needle}' in: {err}");
    assert!(out.stdout.is_empty(), "{args:?}: stdout: {}", String::from_utf8_lossy(&out.stdout));
    line.to_string()
}

/// A model path that does not exist: option errors must come before the model is even looked at.
const NO_MODEL: &str = "/nonexistent/eddy-test-model.gguf";

fn run_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec!["run", "--model", NO_MODEL, "--threads", "1", "-m", "hi"];
    v.extend_from_slice(extra);
    v
}

#[test]
fn parse_errors_are_one_line() {
    expect_error(&[], "no command given");
    expect_error(&["runn"], "runn: unknown command");
    expect_error(&["run", "--temp", "1", "-m", "hi"], "--temp: unknown option; did you mean '--temperature'");
    expect_error(&["run", "--model", NO_MODEL, "--raw"], "--raw: needs --message");
    expect_error(&["perplexity"], "--file: required");
    expect_error(&["run", "-m", "hi", "-n", "4", "-n", "5"], "--max-tokens: given more than once");
    expect_error(&["run", "-m", "hi", "--threads", "abc"], "--threads: invalid value 'abc'");
    // -1 is llama.cpp's "no limit" (taken: the model load fails next); other negatives are refused.
    expect_error(
        &["run", "-m", "hi", "-n", "-2"],
        "--max-tokens: invalid value '-2': `-2` is not a token count (at least 1, or -1 for no limit)",
    );
    expect_error(&run_args(&["-n", "-1"]), "eddy-test-model.gguf");
    expect_error(&["run", "-m", "hi", "--seed", "-5"], "--seed: invalid value '-5'");
    expect_error(&["run", "-m", "hi", "--seed", "x"], "or -1 for a random one");
    expect_error(&["run", "-m", "hi", "--quant", "q5"], "--quant: invalid value 'q5'");
    expect_error(&["run", "-m", "hi", "extra"], "extra: unexpected argument (quote text with spaces)");
    // Without -m, a word after `run` is taken for the message it was meant to be.
    expect_error(&["run", "hello world"], "hello world: unexpected argument (a message goes after -m, quoted: eddy run -m \"...\")");
    expect_error(&["run", "-m", "hi", "--temperature"], "--temperature: a value is required");
}

#[test]
fn bad_option_values_are_named_before_the_model_loads() {
    // Negative numbers reach eddy's own check (clap alone would say "unexpected argument '-1'").
    expect_error(&run_args(&["--temperature", "-1"]), "--temperature: must be a number >= 0");
    expect_error(&run_args(&["--temperature", "NaN"]), "--temperature:");
    expect_error(&run_args(&["--temperature", "inf"]), "--temperature:");
    expect_error(&run_args(&["--stop", "ok", "--stop", ""]), "--stop: an empty text");
    expect_error(&run_args(&["--top-p", "0"]), "--top-p: must be in (0, 1]");
    expect_error(&run_args(&["--top-p", "-0.5"]), "--top-p:");
    expect_error(&run_args(&["--min-p", "NaN"]), "--min-p:");
    expect_error(&run_args(&["--repetition-penalty", "0"]), "--repetition-penalty:");
    expect_error(&run_args(&["-n", "0"]), "--max-tokens: invalid value '0'");
    for v in ["15043", "x+1", "+1", "+7+1", "15043+101", "15043-nan", "15043+inf", "15043+1e400", "-5+1", "15043*2"] {
        expect_error(&run_args(&["--logit-bias", v]), "--logit-bias: invalid value");
    }
    expect_error(&run_args(&["-l", "7+1", "--logit-bias", "7-2"]), "--logit-bias: token 7 is given twice");
    // -inf (a ban) gets past the options.
    expect_error(&run_args(&["-l", "15043-inf"]), "eddy-test-model.gguf: no such file");
    expect_error(&run_args(&["--ctx", "1"]), "--ctx: must be at least 2");
    expect_error(&run_args(&["--ctx", "0"]), "--ctx:");
    expect_error(&["run", "--model", NO_MODEL, "--threads", "0", "-m", "hi"], "--threads: must be at least 1");
    expect_error(&run_args(&["--chat-template-kwargs", "{bad"]), "--chat-template-kwargs: invalid JSON");
    expect_error(&run_args(&["--chat-template-kwargs", "[1]"]), "--chat-template-kwargs: must be a JSON object");
    expect_error(&run_args(&["--chat-template-kwargs", ""]), "--chat-template-kwargs:");
    expect_error(&run_args(&["--raw", "--chat-template-kwargs", "{}"]), "--chat-template-kwargs");
    expect_error(
        &run_args(&["--speculator", "flash"]),
        "--speculator: speculator must be none, suffix, draft, mtp, dflash, dflash-chain or auto",
    );
    expect_error(&run_args(&["--speculator", "none", "--draft-model", "x"]), "--draft-model: is only used with --speculator draft, dflash");
    expect_error(&run_args(&["--speculator", "draft"]), "--speculator: draft needs --draft-model PATH");
    expect_error(&run_args(&["--speculator", "none", "--spec-budget", "8"]), "--spec-budget: has no effect with --speculator none");
    expect_error(&["run", "--model", NO_MODEL, "-m", ""], "--message: the message is empty");
    expect_error(&["run", "--model", NO_MODEL, "-m", "  \n"], "--message: the message is empty");
    expect_error_stdin(&["run", "--model", NO_MODEL, "-m", "-"], Some(b""), "stdin: the message is empty");
    expect_error_stdin(&["run", "--model", NO_MODEL, "-m", "-"], Some(b"\xff\xfe"), "stdin: the message is not UTF-8");
    expect_error(&["speed", "--model", NO_MODEL, "-p", "0"], "-p/--prompt-tokens: must be at least 1");
    expect_error(&["speed", "--model", NO_MODEL, "-n", "1"], "-n/--gen-tokens:");
    expect_error(&["speed", "--model", NO_MODEL, "-r", "0"], "-r/--repetitions: must be at least 1");
    expect_error(&["bandwidth", "--threads", "0"], "--threads: must be at least 1");
    expect_error(&["serve", "--port", "-1"], "--port: invalid value '-1'");
    expect_error(&["bench", "--num", "-3"], "--num: invalid value '-3'");
    // With valid options the model is what is wrong.
    expect_error(&run_args(&[]), "eddy-test-model.gguf: no such file");
    // --seed -1 is a random seed (llama.cpp's convention, and the server's): it gets past the options.
    expect_error(&run_args(&["--seed", "-1"]), "eddy-test-model.gguf: no such file");
}

#[test]
fn model_paths() {
    expect_error(&["run", "--model", "", "-m", "hi"], "--model: empty");
    let dir = tmp("garbage-dir");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), b"\x00\x01 not json").unwrap();
    expect_error(&["run", "--model", dir.to_str().unwrap(), "-m", "hi"], "config.json");
    let empty = tmp("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    expect_error(&["run", "--model", empty.to_str().unwrap(), "-m", "hi"], "empty.gguf: not a GGUF file");
    let text = tmp("notes.txt");
    std::fs::write(&text, "just some text, not a model\n").unwrap();
    expect_error(&["run", "--model", text.to_str().unwrap(), "-m", "hi"], "notes.txt: not a GGUF file");
    let hf_home = tmp("hf-home");
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", "foo/bar", "-m", "hi"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", &hf_home)
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("error: foo/bar: no such file or folder here, and as a hub id: HF_HUB_OFFLINE"), "{err}");

    // EDDY_OFFLINE keeps hub ids off the network as HF_HUB_OFFLINE does.
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", "foo/bar", "-m", "hi"])
        .env("EDDY_OFFLINE", "1")
        .env_remove("HF_HUB_OFFLINE")
        .env("HF_HOME", &hf_home)
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2)
            && err.starts_with("error: foo/bar: no such file or folder here, and as a hub id: EDDY_OFFLINE is set"),
        "{err}"
    );
    // A link to nothing is a missing path, not a hub id; a name that is neither says both.
    let link = tmp("dangling.gguf");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(tmp("nothing-here"), &link).unwrap();
    expect_error(&["run", "--model", link.to_str().unwrap(), "-m", "hi"], "symbolic link to nothing");
    expect_error(&["run", "--model", "tests/missing", "-m", "hi"], "no such file or folder here, and as a hub id: HF_HUB_OFFLINE is set");

    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    expect_error(&["run", "--model", s, "--quant", "q8", "-m", "hi"], "--quant q8 is for Hugging Face safetensors");
    let drafter = eddy::load::models_dir().join("dflash-qwen2.5-coder-1.5b");
    assert!(drafter.is_dir(), "{} is missing: run tools/fetch_models.sh", drafter.display());
    expect_error(&["run", "--model", drafter.to_str().unwrap(), "-m", "hi"], "is a DFlash drafter, not a model");
    // A NaN in a norm weight is a corrupt file, as one in a matrix is (it used to load and babble).
    let g = eddy::gguf::GgufFile::open(&smol).unwrap();
    let nan = f32::NAN.to_le_bytes().repeat(576);
    let tensors: Vec<(String, Vec<u64>, u32, &[u8])> = g
        .tensors
        .iter()
        .map(|t| {
            let data = if t.name == "output_norm.weight" { &nan[..] } else { g.tensor_data(t).unwrap() };
            (t.name.clone(), t.dims.clone(), t.ggml_type, data)
        })
        .collect();
    let bad = tmp("nan-norm.gguf");
    eddy::gguf::write_gguf(&bad, &g.metadata, &tensors).unwrap();
    expect_error(&["run", "--model", bad.to_str().unwrap(), "-m", "hi"], "tensor output_norm.weight holds a NaN");
    let _ = std::fs::remove_file(&bad);
    // A folder of GGUF files (such as the models folder) names the files to pass instead.
    let folder = tmp("gguf-folder");
    std::fs::create_dir_all(&folder).unwrap();
    let _ = std::fs::remove_file(folder.join("model.gguf"));
    std::os::unix::fs::symlink(&smol, folder.join("model.gguf")).unwrap();
    expect_error(&["run", "--model", folder.to_str().unwrap(), "-m", "hi"], "model.gguf: pass the GGUF file itself");
}

/// Every option of every command has a description in `--help`, and help exits 0.
#[test]
fn help_explains_every_option() {
    for cmd in [&[][..], &["run"], &["perplexity"], &["speed"], &["bandwidth"]] {
        let mut args: Vec<&str> = cmd.to_vec();
        args.push("--help");
        let out = eddy(&args);
        let help = String::from_utf8(out.stdout).unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        let lines: Vec<&str> = help.lines().collect();
        let mut options = 0;
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            if !(l.starts_with("  ") && t.starts_with('-')) {
                continue;
            }
            options += 1;
            // "  -t, --threads <THREADS>  Worker threads ..." or the description on the next, deeper line.
            let spec_end = t.find("  ").map(|j| t[j..].trim().len());
            let same_line = spec_end.is_some_and(|n| n > 0);
            let next_line = lines.get(i + 1).is_some_and(|n| {
                let nt = n.trim_start();
                n.len() - nt.len() > l.len() - t.len() && !nt.is_empty() && !nt.starts_with('-')
            });
            assert!(same_line || next_line, "{args:?}: option without a description: {l}\n{help}");
        }
        assert!(options >= 2, "{args:?}: {help}");
    }
}

const PANEL: [&str; 9] = [
    "time to first token: ",
    "prefill speed: ",
    "generation speed: ",
    "tokens per forward pass: ",
    "memory used: ",
    "total energy: ",
    "input energy per token: ",
    "output energy per token: ",
    "duration: ",
];

fn run_smol(smol: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["run", "--model", smol.to_str().unwrap(), "--threads", "1"];
    args.extend_from_slice(extra);
    let out = eddy(&args);
    assert_eq!(out.status.code(), Some(0), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    out
}

/// A model without a chat template (Gemma 3 270m, a base model) chats in ChatML, as llama.cpp falls back to,
/// after one warning line on stderr: a reply to `-m` and to a chat on stdin is the reply to a raw run of the
/// ChatML text (--raw adds the BOS this tokenizer wants, as the ChatML fallback writes it).
#[test]
fn a_model_without_a_chat_template_chats_in_chatml() {
    let Some(smol) = smol() else { return };
    let gemma = smol.with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(gemma.is_file(), "{} is missing: run `tools/fetch_models.sh gemma3`", gemma.display());
    let q = "Name three colors of the rainbow.";
    let chatml = format!("<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n");
    let base = ["run", "--model", gemma.to_str().unwrap(), "--threads", "1", "-n", "8", "--temperature", "0"];
    fn with<'a>(base: &[&'a str], extra: &[&'a str]) -> Vec<&'a str> {
        [base, extra].concat()
    }
    let raw = eddy(&with(&base, &["--raw", "-m", &chatml]));
    assert_eq!(raw.status.code(), Some(0), "{}", String::from_utf8_lossy(&raw.stderr));
    assert!(raw.stdout.len() > 1, "an empty reply");
    let warning = "warning: the model has no chat template; chatting in ChatML";
    assert!(!String::from_utf8_lossy(&raw.stderr).contains(warning), "--raw uses no template");
    for out in [eddy(&with(&base, &["-m", q])), eddy_stdin(&base, Some(format!("{q}\n").as_bytes()))] {
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert_eq!(err.lines().filter(|l| l.starts_with(warning)).count(), 1, "{err}");
        assert_eq!(String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&raw.stdout), "{err}");
    }
}

/// The ChatML fallback on a vocabulary without `<|im_end|>` (Gemma 3 270m) stops where the model writes that
/// text, which a raw run writes on past into invented turns: `-m` prints the raw reply's text before it, and
/// a chat on stdin keeps that reply in its history (the second reply is the raw run's on the conversation
/// with the first reply so cut).
#[test]
fn chatml_fallback_stops_at_im_end_text() {
    let Some(smol) = smol() else { return };
    let gemma = smol.with_file_name("gemma-3-270m-q4_k_m.gguf");
    assert!(gemma.is_file(), "{} is missing: run `tools/fetch_models.sh gemma3`", gemma.display());
    let base = ["run", "--model", gemma.to_str().unwrap(), "--threads", "1", "-n", "60", "--temperature", "0"];
    let raw_reply = |chatml: &str| -> String {
        let out = eddy(&[&base[..], &["--raw", "-m", chatml]].concat());
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let raw = String::from_utf8(out.stdout).unwrap();
        let end = raw.find("<|im_end|>").unwrap_or_else(|| panic!("the raw reply never writes <|im_end|>: {raw:?}"));
        raw[..end].to_string()
    };
    let (q1, q2) = ("Name three colors of the rainbow.", "And two more?");
    let turn = |role: &str, text: &str| format!("<|im_start|>{role}\n{text}<|im_end|>\n");
    let first = raw_reply(&format!("{}<|im_start|>assistant\n", turn("user", q1)));
    assert!(!first.trim().is_empty() && !first.contains("<|im_start|>"), "{first:?}");
    let out = eddy(&[&base[..], &["-m", q1]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{first}\n"));
    let second = raw_reply(&format!("{}{}{}<|im_start|>assistant\n", turn("user", q1), turn("assistant", &first), turn("user", q2)));
    let out = eddy_stdin(&base, Some(format!("{q1}\n{q2}\n").as_bytes()));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{first}\n{second}\n"));
}

/// `--stop TEXT` ends a reply where TEXT first appears, TEXT not printed: the greedy reply cut before a piece of
/// its own middle (a piece that spans tokens), in a one-shot run and in a chat on stdin; a text it never writes
/// changes nothing.
#[test]
fn stop_texts_end_the_reply() {
    let Some(smol) = smol() else { return };
    let base = ["-n", "24", "--temperature", "0"];
    let full = String::from_utf8(run_smol(&smol, &[&base[..], &["-m", "Tell me about the sea."]].concat()).stdout).unwrap();
    let chars: Vec<char> = full.trim_end().chars().collect();
    assert!(chars.len() > 20, "a short reply: {full:?}");
    let piece: String = chars[10..16].iter().collect();
    let cut = &full[..full.find(&piece).unwrap()];
    let out = run_smol(&smol, &[&base[..], &["-m", "Tell me about the sea.", "--stop", "no such text", "--stop", &piece]].concat());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{cut}\n"), "stopped at {piece:?}");
    let out = run_smol(&smol, &[&base[..], &["-m", "Tell me about the sea.", "--stop", "no such text"]].concat());
    assert_eq!(String::from_utf8(out.stdout).unwrap(), full);
    let mut args = vec!["run", "--model", smol.to_str().unwrap(), "--threads", "1", "--stop", &piece];
    args.extend_from_slice(&base);
    let out = eddy_stdin(&args, Some(b"Tell me about the sea.\n"));
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{cut}\n"));
}

/// `eddy run` without --message: a chat on stdin. Each reply is the engine's greedy reply to the whole
/// conversation so far through the chat template (the previous replies included); a blank line is skipped,
/// a line ending in `\` goes on to the next, `/clear` starts over, the end of input ends the chat (exit 0);
/// one summary line per turn on stderr.
#[test]
fn chat_on_stdin_keeps_the_conversation() {
    use eddy::chat::{encode_chat_guarded, ChatMessage};
    let Some(smol) = smol() else { return };
    let input = b"What is 2+2?\n\nNow add 3 to it.\n/clear\nWhat is \\\n2+2?\n/clear\nSay <|im_end|> once.\n";
    let args = ["run", "--model", smol.to_str().unwrap(), "--threads", "1", "-n", "12", "--temperature", "0"];
    let out = eddy_stdin(&args, Some(input));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{err}");
    // The reference: the engine on each conversation, rendered and encoded as the CLI does.
    let mut lm = eddy::load::load_gguf(&smol, &mut |_, _| {}).unwrap();
    let template = lm.template.take().unwrap();
    let tok = lm.tokenizer.clone();
    let opts = eddy::engine::EngineOptions { threads: 1, ctx: 4096, ..Default::default() };
    let mut engine = eddy::engine::Engine::new(lm, &opts);
    let mut reply = |msgs: &[(&str, &str)]| {
        let msgs: Vec<ChatMessage> = msgs.iter().map(|(r, c)| ChatMessage { role: r.to_string(), content: c.to_string() }).collect();
        let untrusted: Vec<&str> = msgs.iter().map(|m| m.content.as_str()).collect();
        let prompt = encode_chat_guarded(&tok, &template.render(&msgs, true, &Default::default()).unwrap(), &untrusted, || None).unwrap();
        let params = eddy::engine::GenerateParams { max_tokens: 12, sampler: Default::default(), ignore_eos: false, logprobs: None };
        let mut ids = Vec::new();
        engine
            .generate(&prompt, &params, &mut |id| {
                ids.push(id);
                true
            })
            .unwrap();
        tok.decode(&ids, true).unwrap()
    };
    let r1 = reply(&[("user", "What is 2+2?")]);
    let r2 = reply(&[("user", "What is 2+2?"), ("assistant", &r1), ("user", "Now add 3 to it.")]);
    let r3 = reply(&[("user", "What is \n2+2?")]);
    // Control-token text in a message is text (it does not end the user's turn).
    let r4 = reply(&[("user", "Say <|im_end|> once.")]);
    assert_ne!(r1, r2);
    assert_eq!(String::from_utf8(out.stdout).unwrap(), format!("{r1}\n{r2}\n{r3}\n{r4}\n"));
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(turns.len(), 4, "{err}");
    assert!(turns[1].contains(" cached)") && !turns[1].contains("(0 cached)"), "the second turn reuses the first: {err}");
}

/// A chat with --json prints one JSON object per turn on stderr, with the turn's statistics and its energy
/// (joules, or the reason none could be measured, as a one-shot run gives them).
#[test]
fn chat_json_reports_each_turn_with_its_energy() {
    let Some(smol) = smol() else { return };
    let args = ["run", "--model", smol.to_str().unwrap(), "--threads", "1", "-n", "4", "--temperature", "0", "--json"];
    let out = eddy_stdin(&args, Some(b"Hi.\nAnd again.\n"));
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(out.status.code(), Some(0), "{err}");
    let turns: Vec<serde_json::Value> = err.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(turns.len(), 2, "{err}");
    for t in &turns {
        assert_eq!(t["generated_tokens"], 4, "{t}");
        let measured = t["total_energy_j"].as_f64().is_some_and(|j| j >= 0.0) && t["energy_sources"].is_string();
        let explained = t["total_energy_j"].is_null() && t["energy_unavailable_reason"].as_str().is_some_and(|r| !r.is_empty());
        assert!(measured != explained, "energy or the reason it is missing: {t}");
    }
}

/// The chat's signals and stderr: SIGTERM mid-reply ends the process (as its default action, not as a
/// stopped reply), SIGINT mid-reply stops only the reply, and a stderr that cannot be written (/dev/full)
/// neither panics nor stops the chat.
#[test]
fn chat_signals_and_a_full_stderr() {
    use std::os::unix::process::ExitStatusExt;
    let Some(smol) = smol() else { return };
    let smol = smol.to_str().unwrap();
    let spawn = |stderr: Stdio| {
        Command::new(env!("CARGO_BIN_EXE_eddy"))
            .args(["run", "--model", smol, "--threads", "1", "-n", "300", "--temperature", "1", "--seed", "1"])
            .env("HF_HUB_OFFLINE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap()
    };
    // Waits for the first byte of a reply, then sends `sig`.
    let signal_mid_reply = |child: &mut std::process::Child, sig: &str| {
        child.stdin.as_mut().unwrap().write_all(b"Write a very long story about a fox.\n").unwrap();
        let mut byte = [0u8; 1];
        child.stdout.as_mut().unwrap().read_exact(&mut byte).unwrap();
        let ok = Command::new("kill").args([sig, &child.id().to_string()]).status().unwrap();
        assert!(ok.success());
    };
    let mut child = spawn(Stdio::null());
    signal_mid_reply(&mut child, "-TERM");
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(15), "{status:?}");
    // SIGINT stops the reply; the next message is answered; the end of input ends the chat (exit 0).
    let mut child = spawn(Stdio::piped());
    signal_mid_reply(&mut child, "-INT");
    child.stdin.as_mut().unwrap().write_all(b"Thanks!\n").unwrap();
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let turns: Vec<&str> = err.lines().filter(|l| l.starts_with('[')).collect();
    assert_eq!(turns.len(), 2, "{err}");
    assert!(turns[0].ends_with(", stopped]") && !turns[1].contains("stopped"), "{err}");
    // A line too long for the context is dropped unread (the chat goes on); an invalid UTF-8 line ends a
    // continued message as its raw bytes say (no trailing backslash), and is left out of it.
    let mut input = vec![b'a'; 200_000];
    input.extend_from_slice(b"\nSay hi \\\n\xff\nThanks\n");
    let out = eddy_stdin(&["run", "--model", smol, "--threads", "1", "-n", "3", "--ctx", "64", "--temperature", "0"], Some(&input));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(err.contains("cannot fit the context of 64 tokens: dropped") && err.contains("not UTF-8"), "{err}");
    assert_eq!(err.lines().filter(|l| l.starts_with('[')).count(), 2, "{err}");
    // /dev/full as stderr: both turns answered, exit 0.
    let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", smol, "--threads", "1", "-n", "3", "--temperature", "0"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(full)
        .spawn()
        .and_then(|mut c| {
            c.stdin.take().unwrap().write_all(b"hi\n\xff\nhello\n")?;
            c.wait_with_output()
        })
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout).lines().count(), 2, "{out:?}");
}

#[test]
fn panel_json_and_seeds() {
    let Some(smol) = smol() else { return };
    let out = run_smol(&smol, &["-n", "3", "--temperature", "0", "-m", "hi"]);
    let err = String::from_utf8(out.stderr).unwrap();
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 9, "{err}");
    for (l, p) in lines.iter().zip(PANEL) {
        assert!(l.starts_with(p), "expected '{p}…', got '{l}'");
    }
    // -n 1: one token, still the full panel, with no decode speed to report.
    let out = run_smol(&smol, &["-n", "1", "--temperature", "0", "-m", "hi"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 9);
    assert!(err.contains("generation speed: n/a (one token: no decode pass)"), "{err}");
    let out = run_smol(&smol, &["-n", "1", "--json", "-m", "hi"]);
    let v: serde_json::Value = serde_json::from_str(&String::from_utf8(out.stderr).unwrap()).unwrap();
    assert!(v["generation_speed_tps"].is_null() && v["tokens_per_forward_pass"].is_null(), "{v}");
    // --json: one JSON object on stderr.
    let out = run_smol(&smol, &["-n", "2", "--json", "-m", "hi"]);
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    let v: serde_json::Value = serde_json::from_str(&err).unwrap();
    assert_eq!(v["generated_tokens"].as_u64().map(|n| n <= 2), Some(true), "{v}");
    assert!(v["prefill_speed_tps"].as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "{v}");
    assert_eq!(v["speculation_calibration_s"], 0.0, "{v}");
    // With a speculator the first request measures the verify costs: inside the TTFT, outside prefill speed.
    let out = run_smol(&smol, &["-n", "2", "--json", "--speculator", "suffix", "-m", "hi"]);
    let v: serde_json::Value = serde_json::from_str(&String::from_utf8(out.stderr).unwrap()).unwrap();
    let (ttft, calib) = (v["time_to_first_token_s"].as_f64().unwrap(), v["speculation_calibration_s"].as_f64().unwrap());
    assert!(calib > 0.0 && calib < ttft, "{v}");
    let pp = v["prefill_speed_tps"].as_f64().unwrap();
    let prompt = v["prompt_tokens"].as_f64().unwrap();
    assert!((pp - prompt / (ttft - calib)).abs() <= 1e-6 * pp.max(1.0), "{v}");
    // Same seed, same output; the random default differs between runs only by chance.
    let story = ["-n", "12", "--seed", "7", "--temperature", "1.0", "-m", "Tell me a story about a fox."];
    let a = run_smol(&smol, &story).stdout;
    let b = run_smol(&smol, &story).stdout;
    assert_eq!(a, b);
    // A temperature so small that logits / temperature overflow is greedy, not a random junk token.
    let greedy = run_smol(&smol, &["-n", "6", "--temperature", "0", "-m", "What is 2+2?"]).stdout;
    for t in ["1e-38", "1e-45"] {
        let tiny = run_smol(&smol, &["-n", "6", "--seed", "1", "--temperature", t, "-m", "What is 2+2?"]).stdout;
        assert_eq!(String::from_utf8_lossy(&tiny), String::from_utf8_lossy(&greedy), "--temperature {t}");
    }
    // --logit-bias: +100 makes greedy decoding repeat a token; ids are checked against the vocabulary.
    let tok = eddy::tokenizer::Tokenizer::from_gguf(&eddy::gguf::GgufFile::open(&smol).unwrap()).unwrap();
    let x = tok.encode(" fox", false).unwrap()[0];
    let forced = run_smol(&smol, &["-n", "3", "--temperature", "0", "--logit-bias", &format!("{x}+100"), "-m", "hi"]).stdout;
    assert_eq!(String::from_utf8(forced).unwrap().trim_end(), tok.decode(&[x; 3], true).unwrap());
    let far = format!("{}-1", tok.vocab_size());
    let out = eddy(&["run", "--model", smol.to_str().unwrap(), "--threads", "1", "-n", "1", "-l", &far, "-m", "hi"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--logit-bias: token id"), "{out:?}");
    // --top-k 0 (off) works; stdin message, trailing newline dropped, equals the argument.
    run_smol(&smol, &["-n", "2", "--top-k", "0", "--seed", "1", "-m", "hi"]);
    let mut args = vec!["run", "--model", smol.to_str().unwrap(), "--threads", "1", "-n", "4", "--temperature", "0", "-m", "-"];
    let piped = eddy_stdin(&args, Some(b"What is 2+2?\n"));
    assert_eq!(piped.status.code(), Some(0));
    args.pop();
    args.push("What is 2+2?");
    assert_eq!(piped.stdout, eddy(&args).stdout);
}

#[test]
fn reply_is_valid_utf8_and_never_ends_in_a_broken_character() {
    let Some(smol) = smol() else { return };
    for n in 1..=6 {
        let n = n.to_string();
        let out = run_smol(&smol, &["-n", &n, "--temperature", "0", "-m", "Reply only with emoji: 🦀👨‍👩‍👧🎉 — naïve 你好"]);
        let text = String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("-n {n}: stdout is not UTF-8: {e}"));
        assert!(!text.contains('\u{FFFD}'), "-n {n}: replacement character in {text:?}");
        assert!(text.ends_with('\n'), "-n {n}: {text:?}");
    }
}

#[test]
fn closed_pipes_do_not_panic() {
    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    // stdout read for 10 bytes, then closed (`| head -c 10`): generation stops, exit 0, the panel still prints.
    let mut child = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", s, "--threads", "1", "-n", "60", "--temperature", "0", "-m", "Tell me a long story."])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut buf = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut buf).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked") && !err.contains("error"), "{err}");
    assert_eq!(err.lines().count(), 9, "{err}");
    // stderr closed before anything is written: the panel (or --json, or an error) cannot panic.
    for (extra, code) in [(&["-n", "3"][..], 0), (&["-n", "3", "--json"][..], 0), (&["-n", "0"][..], 2)] {
        let mut args = vec!["run", "--model", s, "--threads", "1", "--temperature", "0", "-m", "hi"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_eddy")).args(&args).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stderr.take());
        assert_eq!(child.wait().unwrap().code(), Some(code), "{args:?}");
    }
    // perplexity's result written to a closed stdout.
    let f = tmp("fox.txt");
    std::fs::write(&f, "The quick brown fox jumps over the lazy dog. ".repeat(4)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["perplexity", "--model", s, "--threads", "1", "-f", f.to_str().unwrap(), "--ctx", "16"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
}

/// Ctrl-C during a one-shot `eddy run -m` stops the reply, prints the stats panel all the same (as llama.cpp
/// prints its timings) and exits 130, as an interrupted command; the text so far stays on stdout.
#[test]
fn an_interrupted_run_prints_its_panel() {
    let Some(smol) = smol() else { return };
    let mut child = Command::new(env!("CARGO_BIN_EXE_eddy"))
        .args(["run", "--model", smol.to_str().unwrap(), "--threads", "1", "--raw", "-n", "-1", "--temperature", "0"])
        .args(["-m", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 16];
    stdout.read_exact(&mut first).unwrap();
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("generation speed") && err.trim_end().ends_with("interrupted"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn context_limits() {
    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    for ctx in ["2", "8"] {
        expect_error(
            &["run", "--model", s, "--threads", "1", "--ctx", ctx, "-m", "hi"],
            &format!("prompt: 31 tokens but the context holds {ctx}"),
        );
    }
    // --raw "hi" is one token: a context of 2 still generates.
    let out = run_smol(&smol, &["--ctx", "2", "--raw", "-n", "5", "--temperature", "0", "-m", "hi"]);
    assert!(!out.stdout.is_empty());
    // Larger than the model's training context: capped, not an allocation failure.
    run_smol(&smol, &["--ctx", "100000000000", "-n", "2", "--temperature", "0", "-m", "hi"]);
    // A prompt past the cap: the error says a longer --ctx cannot help.
    let long = "word ".repeat(9000);
    expect_error(
        &["run", "--model", s, "--threads", "1", "--ctx", "100000", "-m", &long],
        "(the model's training context, where --ctx is capped)",
    );
    // --raw with an empty message and no BOS token: nothing to generate from.
    expect_error(&["run", "--model", s, "--threads", "1", "--raw", "-m", ""], "--message: the message is empty and the model adds no BOS");
    // `speed` names --ctx where the prompt fills it, also without new tokens (the prefill samples one).
    expect_error(
        &["speed", "--model", s, "--threads", "1", "-p", "64", "-n", "0", "--ctx", "64"],
        "--ctx: -p 64 tokens do not fit in the context of 64 tokens (a run samples one token after the prompt)",
    );
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn perplexity_inputs() {
    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    let ppl = |f: &Path, extra: &[&str]| {
        let mut v = vec!["perplexity", "--model", s, "--threads", "1", "-f", f.to_str().unwrap()];
        v.extend_from_slice(extra);
        v.iter().map(|x| x.to_string()).collect::<Vec<String>>()
    };
    let empty = tmp("ppl-empty.txt");
    std::fs::write(&empty, "").unwrap();
    expect_error(&strs(&ppl(&empty, &[])), "ppl-empty.txt: the file is empty");
    let one = tmp("ppl-one.txt");
    std::fs::write(&one, "Hello").unwrap();
    expect_error(&strs(&ppl(&one, &[])), "ppl-one.txt: 1 token");
    let bin = tmp("ppl-bin.dat");
    std::fs::write(&bin, [0xffu8, 0xfe, 0x00, 0x80, 0xc3]).unwrap();
    expect_error(&strs(&ppl(&bin, &[])), "ppl-bin.dat: not UTF-8 text");
    let fox = tmp("ppl-fox.txt");
    std::fs::write(&fox, "The quick brown fox jumps over the lazy dog. ".repeat(3)).unwrap();
    expect_error(&strs(&ppl(&fox, &["--ctx", "1"])), "--ctx: must be at least 2");
    expect_error(&strs(&ppl(&fox, &["--ctx", "100000"])), "--ctx: a window of 100000 tokens is longer than the model's training context");
    expect_error(&strs(&ppl(&tmp("ppl-missing.txt"), &[])), "ppl-missing.txt:");
    // A stream that never ends is refused at the text limit instead of filling the memory.
    expect_error(&strs(&ppl(Path::new("/dev/zero"), &[])), "/dev/zero: more than 256 MiB of text");
    for ctx in ["2", "4096"] {
        let out = eddy(&strs(&ppl(&fox, &["--ctx", ctx, "--json"])));
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert!(v["perplexity"].as_f64().is_some_and(|p| p.is_finite() && p >= 1.0), "{v}");
    }
}

#[test]
fn speed_inputs() {
    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    expect_error(
        &["speed", "--model", s, "--threads", "1", "-p", "4", "-n", "100", "--ctx", "16"],
        "--ctx: -d 0 + -n 100 tokens do not fit in the context of 16 tokens",
    );
    expect_error(&["speed", "--model", s, "--threads", "1", "-p", "4", "-n", "8", "-d", "12", "--ctx", "16"], "--ctx: -d 12 + -n 8 tokens");
    // The decode test starts at its own depth (llama-bench's -d), apart from the prefill test's prompt.
    for (d, p) in [("0", "4"), ("6", "4"), ("4", "4")] {
        let out = eddy(&["speed", "--model", s, "--threads", "1", "-p", p, "-n", "3", "-d", d, "-r", "1", "--ctx", "16"]);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<serde_json::Value> =
            String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert_eq!(lines[0]["test"], "pp4");
        assert_eq!(lines[1]["test"], "tg3");
        assert_eq!(lines[1]["depth"].as_u64(), Some(d.parse().unwrap()), "{}", lines[1]);
        assert!(lines[1]["avg_ts"].as_f64().is_some_and(|t| t > 0.0), "{}", lines[1]);
    }
    let out = eddy(&["speed", "--model", s, "--threads", "1", "-p", "4", "-n", "0", "-r", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text.lines().count(), 1, "{text}");
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
    assert_eq!(v["test"], "pp4");
    assert_eq!(v["threads"], 1);
    // The verify-cost lines name the device they ran on, as the pp/tg lines do.
    let out = eddy(&["speed", "--model", s, "--threads", "1", "-p", "4", "-n", "0", "-r", "1", "--verify-sizes", "1,3"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> = String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let tests: Vec<&str> = lines.iter().map(|v| v["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp4", "verify1", "verify3"]);
    for v in &lines {
        assert_eq!(v["device"], lines[0]["device"], "{v}");
        assert!(v["device"].as_str().is_some_and(|d| !d.is_empty()), "{v}");
    }
    assert!(lines[2]["ms"].as_f64().is_some_and(|ms| ms > 0.0) && lines[2]["nodes"] == 3, "{}", lines[2]);
    // A --draft-model that is not a DFlash folder is refused before the runs (nothing on stdout).
    let out = eddy(&["speed", "--model", s, "--threads", "1", "-p", "4", "-n", "2", "-r", "1", "--draft-model", s]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.code() == Some(2) && err.contains("--draft-model") && err.contains("not one"), "{err}");
    assert!(out.stdout.is_empty());
    // The drafter's pass is timed at the decode test's context (-d), so that its ratio to a decode step compares
    // passes over the same keys; without a decode test, at the prefill test's (-p).
    let models = eddy::load::models_dir();
    let (target, drafter) = (models.join("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"), models.join("dflash-qwen2.5-coder-1.5b"));
    assert!(target.is_file() && drafter.is_dir(), "the 1.5B or its drafter is missing: run tools/fetch_models.sh");
    let (t, dr) = (target.to_str().unwrap(), drafter.to_str().unwrap());
    for (n, d, context) in [("3", "24", 24), ("0", "24", 6)] {
        let out =
            eddy(&["speed", "--model", t, "--threads", "2", "-p", "6", "-n", n, "-d", d, "-r", "1", "--ctx", "64", "--draft-model", dr]);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<serde_json::Value> =
            String::from_utf8_lossy(&out.stdout).lines().map(|l| serde_json::from_str(l).expect("a JSON line")).collect();
        let pass = lines.iter().find(|l| l["test"] == "dflash_pass").expect("a dflash_pass line");
        assert_eq!(pass["context"].as_u64(), Some(context), "-n {n} -d {d}: {pass}");
        assert!(pass["ms"].as_f64().is_some_and(|ms| ms > 0.0), "{pass}");
        assert_eq!(pass.get("vs_decode_step").is_some(), n != "0", "-n {n}: {pass}");
    }
}

/// `eddy serve` on SIGTERM drains: the stream in flight runs to its end (`[DONE]`), then the process exits 0.
#[test]
fn serve_drains_requests_in_flight_on_sigterm() {
    use std::io::BufRead;
    let Some(smol) = smol() else { return };
    let (mut child, addr, mut err) =
        common::spawn_serve(&["--model", smol.to_str().unwrap(), "--threads", "1", "--ctx", "512", "--port", "0"]);
    let mut line = String::new();
    let body = r#"{"messages":[{"role":"user","content":"List the numbers from 1 to 300, one per line."}],"stream":true,"max_tokens":200,"temperature":0}"#;
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = std::io::BufReader::new(conn);
    // Wait for the first content chunk, then signal.
    let mut seen = String::new();
    loop {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "stream ended early: {seen}");
        seen.push_str(&line);
        if line.starts_with("data: {") && line.contains("\"content\"") {
            break;
        }
    }
    let kill = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap();
    let after = rest.lines().filter(|l| l.starts_with("data: {")).count();
    assert!(rest.contains("data: [DONE]"), "the stream in flight was cut: {rest}");
    assert!(after >= 10, "the request ended before the signal; {after} chunks after it");
    let status = child.wait().unwrap();
    let mut log = String::new();
    err.read_to_string(&mut log).unwrap();
    assert_eq!(status.code(), Some(0), "{log}");
    assert!(log.contains("finishing the requests in flight") && log.contains("eddy serve: stopped"), "{log}");
}

/// `eddy serve --body-timeout 0.5` (listed in `--help`): a body whose bytes stop arriving is answered 408
/// after that wait, which the message names.
#[test]
fn serve_body_timeout_sets_the_408_wait() {
    let help = String::from_utf8(eddy(&["serve", "--help"]).stdout).unwrap();
    assert!(help.contains("--body-timeout <SECONDS>") && help.contains("408 Request Timeout"), "{help}");
    let Some(smol) = smol() else { return };
    let (mut child, addr, _err) =
        common::spawn_serve(&["--model", smol.to_str().unwrap(), "--threads", "1", "--ctx", "512", "--port", "0", "--body-timeout", "0.5"]);
    let mut conn = std::net::TcpStream::connect(&addr).unwrap();
    write!(conn, "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{")
        .unwrap();
    let mut reply = String::new();
    let _ = conn.read_to_string(&mut reply);
    let _ = child.kill();
    let _ = child.wait();
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains("no bytes of the request body arrived for 0.5 s"), "{reply}");
}

/// Options of `eddy serve` that need no model are refused before it loads (no "listening" line).
#[test]
fn serve_option_errors_come_before_listening() {
    let Some(smol) = smol() else { return };
    let s = smol.to_str().unwrap();
    let cases = [
        (&["--alias="][..], "--alias"),
        (&["--cors-origin", "localhost:3000"][..], "--cors-origin"),
        (&["--body-timeout", "0"][..], "--body-timeout"),
        (&["--body-timeout", "-1"][..], "--body-timeout"),
        (&["--body-timeout", "soon"][..], "--body-timeout"),
    ];
    for (args, needle) in cases {
        let mut all = vec!["serve", "--model", s, "--threads", "1", "--port", "0"];
        all.extend_from_slice(args);
        let out = eddy(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(2) && err.contains(needle) && !err.contains("listening"), "{args:?}: {err}");
    }
}
