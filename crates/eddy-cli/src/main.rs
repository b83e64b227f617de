//! The `eddy` command: `eddy run` (chat with a model, streaming the reply, then a stats panel) and
//! `eddy perplexity` (perplexity of a text file over fixed windows).

use clap::{Args, Parser, Subcommand};
use eddy::chat::{encode_chat, ChatMessage};
use eddy::engine::{default_threads, Engine, EngineOptions, GenerateParams};
use eddy::load::{load, LoadedModel};
use eddy::model_dir::Quant;
use eddy::sampling::SamplerParams;
use eddy::stats::{peak_rss_bytes, EnergyMeter, GenerationStats};
use eddy::tokenizer::StreamDecoder;
use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser)]
#[command(name = "eddy", version, about = "eddy: fast local LLM inference")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a reply to one message, streamed to stdout; statistics go to stderr.
    Run(RunArgs),
    /// Perplexity of a text file: non-overlapping windows of --ctx tokens, tokens 1..n-1 of each scored.
    Perplexity(PplArgs),
    /// Raw model speed like llama-bench: prefill of -p tokens and decode of -n tokens (synthetic token
    /// ids, end-of-generation ignored), repeated -r times; prints the mean and spread as JSON lines.
    Speed(SpeedArgs),
    /// Memory read bandwidth with --threads workers (GB/s), the limit decode speed is measured against.
    Bandwidth {
        /// Worker threads (default: all available cores).
        #[arg(long, short = 't')]
        threads: Option<usize>,
    },
}

#[derive(Args)]
struct SpeedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens to prefill.
    #[arg(short = 'p', long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens to decode.
    #[arg(short = 'n', long, default_value_t = 64)]
    gen_tokens: usize,
    /// Repetitions.
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF file, Hugging Face model folder, or hub id org/name (default: Qwen2.5-Coder-0.5B-Instruct
    /// from the eddy models folder, see tools/fetch_models.sh).
    #[arg(long)]
    model: Option<String>,
    /// Worker threads (default: all available cores).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Context length in tokens (KV cache size).
    #[arg(long, default_value_t = 4096)]
    ctx: usize,
    /// Quantize a safetensors model's weights at load: q8 (int8) or q4 (int4 projections, int8 embedding
    /// and LM head); default: keep them as stored (f32 / bf16). Not for GGUF files.
    #[arg(long, value_name = "q8|q4")]
    quant: Option<Quant>,
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message; `-` reads it from stdin.
    #[arg(long = "message", short = 'm')]
    message: String,
    /// A system message placed before the user message.
    #[arg(long)]
    system: Option<String>,
    /// Send the message as raw text, without the chat template (BOS is added if the model wants one).
    #[arg(long)]
    raw: bool,
    /// Extra variables for the chat template as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON")]
    chat_template_kwargs: Option<String>,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Top-k filter (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Top-p (nucleus) filter (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Min-p filter relative to the most likely token (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty over the last 64 tokens (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Random seed (same seed, same output). Default: random.
    #[arg(long)]
    seed: Option<u64>,
    /// Most tokens to generate.
    #[arg(long, short = 'n', default_value_t = 1024)]
    max_tokens: usize,
    /// Print the statistics as one JSON object (on stderr) instead of the panel.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    file: std::path::PathBuf,
    /// Print the result as JSON.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Perplexity(a) => perplexity(a),
        Cmd::Speed(a) => speed(a),
        Cmd::Bandwidth { threads } => {
            let pool = eddy::backend::cpu::ThreadPool::new(threads.unwrap_or_else(default_threads).max(1));
            println!("{:.1}", eddy::backend::cpu::bandwidth::measure_read_bandwidth(&pool, 1 << 30, 5));
            Ok(())
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

fn load_with_progress(spec: Option<&str>, quant: Quant) -> eddy::Result<LoadedModel> {
    let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {elapsed}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let r = load(spec, quant, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    r
}

fn engine_for(m: &ModelArgs) -> eddy::Result<Engine> {
    if m.ctx < 2 {
        return Err(eddy::Error::Input("--ctx must be at least 2".into()));
    }
    let lm = load_with_progress(m.model.as_deref(), m.quant.unwrap_or_default())?;
    let opts = EngineOptions { threads: m.threads.unwrap_or_else(default_threads).max(1), ctx: m.ctx, ..Default::default() };
    Ok(Engine::new(lm, &opts))
}

fn run(a: RunArgs) -> eddy::Result<()> {
    let message = if a.message == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|e| eddy::Error::Input(format!("cannot read the message from stdin: {e}")))?;
        s
    } else {
        a.message.clone()
    };
    let kwargs = match &a.chat_template_kwargs {
        None => serde_json::Map::new(),
        Some(s) => match serde_json::from_str::<serde_json::Value>(s) {
            Ok(serde_json::Value::Object(m)) => m,
            _ => return Err(eddy::Error::Input("--chat-template-kwargs must be a JSON object".into())),
        },
    };
    let sampler = SamplerParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        repeat_last_n: 64,
        seed: a.seed.unwrap_or_else(random_seed),
    };
    sampler.validate().map_err(eddy::Error::Input)?;
    let mut engine = engine_for(&a.model)?;
    let lm = &engine.lm;
    let prompt = match (&lm.template, a.raw) {
        (Some(t), false) => {
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
            }
            msgs.push(ChatMessage { role: "user".into(), content: message });
            let text = t.render(&msgs, true, &kwargs)?;
            encode_chat(&lm.tokenizer, &text)?
        }
        (None, false) => {
            eprintln!("note: the model has no chat template; sending the message as raw text");
            lm.tokenizer.encode(&with_system(&a.system, &message), true)?
        }
        (_, true) => lm.tokenizer.encode(&with_system(&a.system, &message), true)?,
    };

    let energy = EnergyMeter::start();
    let mut e_first = None;
    let params = GenerateParams { max_tokens: a.max_tokens, sampler, ignore_eos: false };
    let tok = engine.lm.tokenizer.clone();
    let mut dec = StreamDecoder::new(&tok, true);
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let started = Instant::now();
    let stats = engine.generate(&prompt, &params, &mut |id| {
        if e_first.is_none() {
            e_first = Some(energy.as_ref().map(|m| m.joules()).unwrap_or(0.0));
        }
        match dec.push(id) {
            Ok(Some(text)) => {
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    write_err = Some(e);
                    return false;
                }
            }
            Ok(None) => {}
            Err(_) => {}
        }
        true
    })?;
    if let Ok(Some(text)) = dec.finish() {
        let _ = out.write_all(text.as_bytes());
    }
    let _ = writeln!(out);
    let _ = out.flush();
    drop(out);
    if let Some(e) = write_err {
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(eddy::Error::Input(format!("cannot write to stdout: {e}")));
        }
    }
    let _ = started;
    let total_j = energy.as_ref().ok().map(|m| m.joules());
    print_stats(&stats, energy.as_ref().err(), total_j, e_first.unwrap_or(0.0), a.json);
    Ok(())
}

fn with_system(system: &Option<String>, message: &str) -> String {
    match system {
        Some(s) => format!("{s}\n\n{message}"),
        None => message.to_string(),
    }
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

fn print_stats(s: &GenerationStats, energy_err: Option<&String>, total_j: Option<f64>, prefill_j: f64, json: bool) {
    let mem_gb = peak_rss_bytes().map(|b| b as f64 / 1e9);
    let (e_total, e_in, e_out) = match total_j {
        Some(t) => {
            let out_j = (t - prefill_j).max(0.0);
            (Some(t), Some(prefill_j / s.prompt_tokens.max(1) as f64), Some(out_j / s.generated_tokens.max(1) as f64))
        }
        None => (None, None, None),
    };
    if json {
        let v = serde_json::json!({
            "time_to_first_token_s": s.ttft.as_secs_f64(),
            "prefill_speed_tps": s.prefill_speed(),
            "generation_speed_tps": s.generation_speed(),
            "tokens_per_forward_pass": s.tokens_per_pass(),
            "memory_used_gb": mem_gb,
            "total_energy_j": e_total,
            "input_energy_per_token_j": e_in,
            "output_energy_per_token_j": e_out,
            "energy_unavailable_reason": energy_err,
            "duration_s": s.duration.as_secs_f64(),
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "decode_forward_passes": s.decode_passes,
            "finish_reason": format!("{:?}", s.finish).to_lowercase(),
        });
        eprintln!("{v}");
        return;
    }
    let na = |why: &str| format!("n/a ({why})");
    let why = energy_err.map(|s| s.as_str()).unwrap_or("unavailable");
    eprintln!("time to first token: {:.2} s", s.ttft.as_secs_f64());
    eprintln!("prefill speed: {:.2} t/s", s.prefill_speed());
    eprintln!("generation speed: {:.2} t/s", s.generation_speed());
    eprintln!("tokens per forward pass: {:.2} t/f", s.tokens_per_pass());
    eprintln!("memory used: {}", mem_gb.map(|g| format!("{g:.2} GB")).unwrap_or_else(|| na("no /proc/self/status")));
    eprintln!("total energy: {}", e_total.map(|j| format!("{j:.2} J")).unwrap_or_else(|| na(why)));
    eprintln!("input energy per token: {}", e_in.map(|j| format!("{j:.2} J/tok")).unwrap_or_else(|| na(why)));
    eprintln!("output energy per token: {}", e_out.map(|j| format!("{j:.2} J/tok")).unwrap_or_else(|| na(why)));
    eprintln!("duration: {:.2} s", s.duration.as_secs_f64());
}

fn perplexity(a: PplArgs) -> eddy::Result<()> {
    let text = std::fs::read_to_string(&a.file).map_err(|e| eddy::Error::Io { path: a.file.clone(), source: e })?;
    let window = a.model.ctx;
    let mut engine = engine_for(&ModelArgs { ctx: window, ..a.model })?;
    let tokens = engine.lm.tokenizer.encode(&text, true)?;
    let (ppl, n) = engine.perplexity(&tokens, window)?;
    if a.json {
        println!("{}", serde_json::json!({"perplexity": ppl, "scored_tokens": n, "window": window}));
    } else {
        println!("perplexity: {ppl:.4}");
        println!("scored tokens: {n}");
    }
    Ok(())
}

fn speed(a: SpeedArgs) -> eddy::Result<()> {
    if a.prompt_tokens == 0 || a.repetitions == 0 {
        return Err(eddy::Error::Input("-p and -r must be at least 1".into()));
    }
    let mut engine = engine_for(&a.model)?;
    let vocab = engine.lm.tokenizer.vocab_size().min(engine.lm.model.config.vocab_size) as u64;
    // Deterministic pseudo-random prompt (as llama-bench uses random tokens), avoiding the first 256 ids.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let prompt: Vec<u32> = (0..a.prompt_tokens)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (256 + x % (vocab - 256)) as u32
        })
        .collect();
    let params = GenerateParams { max_tokens: a.gen_tokens.max(1), sampler: SamplerParams::default(), ignore_eos: true };
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..a.repetitions {
        let s = engine.generate(&prompt, &params, &mut |_| true)?;
        pp.push(s.prefill_speed());
        if a.gen_tokens > 1 {
            tg.push(s.generation_speed());
        }
    }
    let summary = |v: &[f64]| {
        let n = v.len().max(1) as f64;
        let mean = v.iter().sum::<f64>() / n;
        let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        (mean, sd)
    };
    let (pm, ps) = summary(&pp);
    let (tm, ts) = summary(&tg);
    let model = engine.lm.source.display().to_string();
    let threads = a.model.threads.unwrap_or_else(default_threads);
    println!("{}", serde_json::json!({"model": model, "test": format!("pp{}", a.prompt_tokens), "threads": threads, "avg_ts": pm, "stddev_ts": ps}));
    if a.gen_tokens > 1 {
        println!("{}", serde_json::json!({"model": model, "test": format!("tg{}", a.gen_tokens), "threads": threads, "avg_ts": tm, "stddev_ts": ts,
            "weight_bytes": engine.lm.model.weight_bytes()}));
    }
    Ok(())
}
