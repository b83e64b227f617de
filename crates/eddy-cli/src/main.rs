//! The `eddy` command: `eddy run` (chat with a model, streaming the reply, then a stats panel) and
//! `eddy perplexity` (perplexity of a text file over fixed windows), `eddy serve` (the OpenAI API) and
//! `eddy bench` (a streaming benchmark client for any OpenAI-compatible endpoint).

mod bench;
mod fetch;

use clap::{Args, Parser, Subcommand};
use eddy::chat::{encode_chat_guarded, ChatMessage, ChatTemplate};
use eddy::engine::{default_threads, Device, Engine, EngineOptions, GenerateParams};
use eddy::load::{load, LoadedModel};
use eddy::model_dir::Quant;
use eddy::sampling::SamplerParams;
use eddy::spec::dflash::{find_next_to, is_dflash_dir, DFlashDrafter};
use eddy::spec::{Budget, Drafter, SpeculatorKind};
use eddy::stats::{peak_rss_bytes, EnergyMeter, FinishReason, GenerationStats};
use eddy::tokenizer::StreamDecoder;
use std::io::{Read, Write};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "eddy", version, about = "eddy: fast local LLM inference")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate a reply to one message, streamed to stdout; statistics go to stderr. Without --message: a
    /// chat in the terminal (each line a message; the conversation is kept).
    #[command(allow_negative_numbers = true)]
    Run(RunArgs),
    /// Perplexity of a text file: non-overlapping windows of --ctx tokens, tokens 1..n-1 of each scored.
    #[command(allow_negative_numbers = true)]
    Perplexity(PplArgs),
    /// Re-quantize a GGUF file or a Hugging Face model folder into eddy's formats — M (int4, zero points), L
    /// (int8), K (int4, two-level scales), K6 (6-bit) — with the block Hadamard rotation (unless
    /// --no-rotation), written as an eddy model folder (docs/quant-formats.md) that --model loads.
    #[command(allow_negative_numbers = true)]
    Quantize(QuantizeArgs),
    /// Raw model speed like llama-bench: prefill of -p tokens and decode of -n tokens (synthetic token
    /// ids, end-of-generation ignored), repeated -r times; prints the mean and spread as JSON lines.
    #[command(allow_negative_numbers = true)]
    Speed(SpeedArgs),
    /// Serve the OpenAI-compatible HTTP API (chat and text completions, streaming) on --host:--port.
    #[command(allow_negative_numbers = true)]
    Serve {
        #[command(flatten)]
        model: ModelArgs,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on.
        #[arg(long, default_value_t = 8000)]
        port: u16,
        /// Requests that may wait for the engine; more are answered 503 (0: none wait, so a request that
        /// arrives while another one runs is answered 503).
        #[arg(long, default_value_t = 16)]
        max_queue: usize,
        /// Turn off the prefix cache (by default a request that starts with the tokens of the previous
        /// one reuses their KV and prefills only the rest; output is identical either way on the CPU, and on
        /// a GPU up to the last bits of the reused rows: docs/cuda.md, "Batch invariance").
        #[arg(long)]
        no_prefix_cache: bool,
        /// A name `/v1/models` lists for the model (repeatable, the first is the one responses carry);
        /// default: the model file's name. Requests naming any model are answered by the one served.
        #[arg(long = "alias", value_name = "NAME")]
        aliases: Vec<String>,
        /// An origin browsers may call the API from, e.g. http://localhost:3000 (repeatable; `*` = any):
        /// answers CORS preflight requests and adds the CORS headers.
        #[arg(long = "cors-origin", value_name = "ORIGIN")]
        cors_origins: Vec<String>,
        /// Longest wait, in seconds (fractions allowed, more than 0), for the next bytes of a request body:
        /// a client that stalls longer is answered 408 Request Timeout and its connection closed.
        #[arg(long, value_name = "SECONDS", default_value = "60", value_parser = parse_body_timeout)]
        body_timeout: std::time::Duration,
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Benchmark an OpenAI-compatible endpoint (eddy serve, llama-server, ...): per streamed request the
    /// time to first token, decode speed and tokens per pass; median, p10 and p90 as text and JSON.
    /// `--compare a.json b.json --plot out.svg` sets saved runs side by side.
    #[command(allow_negative_numbers = true)]
    Bench(bench::BenchArgs),
    /// Memory read bandwidth with --threads workers, printed as a bare number of GB/s (the limit decode
    /// speed is measured against).
    #[command(allow_negative_numbers = true)]
    Bandwidth {
        /// Worker threads (default: all available cores; more than the cores available are capped).
        #[arg(long, short = 't')]
        threads: Option<usize>,
    },
}

#[derive(Args)]
struct SpeedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens to prefill (at least 1; -p + -n must fit in --ctx).
    #[arg(short = 'p', long, default_value_t = 128)]
    prompt_tokens: usize,
    /// Tokens to generate: the first comes from the prefill, the decode speed is measured over the other
    /// n-1, so n >= 2 for a tg line; 0 = prefill only.
    #[arg(short = 'n', long, default_value_t = 64)]
    gen_tokens: usize,
    /// Tokens already in the context when the decode test starts (llama-bench's -d for its tg test): its
    /// prompt is max(d, 1) tokens, so its n-1 timed steps attend to d+1 … d+n-1 keys. Default 0, as
    /// llama-bench's tg128; the prefill test always starts from an empty context.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Repetitions (at least 1).
    #[arg(short = 'r', long, default_value_t = 3)]
    repetitions: usize,
    /// Also time one verify pass over token trees of these sizes (nodes, comma-separated, e.g.
    /// 1,2,4,8,16,32,64) after the -p prompt: the cost curve speculative decoding trades against.
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    verify_sizes: Vec<usize>,
    /// DFlash drafter folder whose block pass to time, on the model's device, at the decode test's context (-d;
    /// without a decode test, -p) (a `dflash_pass` line; default: a drafter found next to the model, as `eddy
    /// run` finds it).
    #[arg(long, value_name = "DIR")]
    draft_model: Option<std::path::PathBuf>,
}

#[derive(Args)]
struct ModelArgs {
    /// GGUF file, Hugging Face model folder (unquantized, or written by eddy quantize; GPTQ/AWQ/FP8 folders
    /// are refused), or hub id org/name (default: Qwen2.5-Coder-0.5B-Instruct from the eddy models folder, see
    /// tools/fetch_models.sh).
    #[arg(long)]
    model: Option<String>,
    /// Worker threads (default: all available cores; more than the cores available are capped).
    #[arg(long, short = 't')]
    threads: Option<usize>,
    /// Context length in tokens (KV cache size; at least 2, capped at the model's training context);
    /// default 4096. For `perplexity`, the window length (default 512), which must fit in the training
    /// context (not capped: a different window scores differently).
    #[arg(long)]
    ctx: Option<usize>,
    /// Quantize a safetensors model's weights at load: q8 (int8) or q4 (int4 projections, int8 embedding
    /// and LM head); default: keep them as stored (f32 / bf16). Not for GGUF files or folders written by `eddy
    /// quantize` (already quantized).
    #[arg(long, value_name = "q8|q4")]
    quant: Option<Quant>,
    /// Where the model runs: cuda (an NVIDIA GPU; builds with `--features cuda`), cpu, or auto (the GPU
    /// when this build has CUDA, a GPU is present and the model runs there, else the CPU).
    #[arg(long, value_name = "auto|cpu|cuda", default_value = "auto", value_parser = parse_device)]
    device: Device,
}

fn parse_device(s: &str) -> Result<Device, String> {
    match s {
        "auto" => Ok(Device::Auto),
        "cpu" => Ok(Device::Cpu),
        "cuda" | "gpu" => Ok(Device::Cuda),
        _ => Err(format!("unknown device '{s}' (auto, cpu or cuda)")),
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The user message (must not be empty unless --raw); `-` reads it from stdin (trailing newlines
    /// dropped); Ctrl-C stops its reply, prints the stats and exits 130. Without it: a chat, each line read from stdin a user message (a line ending in `\` goes
    /// on to the next), each reply streamed to stdout with a one-line summary on stderr; `/clear` starts
    /// over, `/exit` or end of input ends it, Ctrl-C stops a reply (at the prompt: ends the chat).
    #[arg(long = "message", short = 'm', allow_hyphen_values = true)]
    message: Option<String>,
    /// A system message placed before the user message (with --raw: prepended to the message, followed by
    /// a blank line). A model without a chat template chats in ChatML, as llama.cpp does.
    #[arg(long, allow_hyphen_values = true)]
    system: Option<String>,
    /// Send the message as raw text, without the chat template (BOS is added if the model wants one).
    #[arg(long)]
    raw: bool,
    /// Extra variables for the chat template as a JSON object, e.g. '{"enable_thinking": false}'.
    #[arg(long, value_name = "JSON", conflicts_with = "raw")]
    chat_template_kwargs: Option<String>,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Top-k filter: keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Top-p (nucleus) filter, in (0, 1]: keep the smallest set of tokens whose probability reaches p
    /// (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Min-p filter, in [0, 1]: drop tokens less likely than min-p times the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Repetition penalty over the last 64 tokens, > 0 (1 = off; above 1 discourages repeats).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Add BIAS (in [-100, 100]) to token ID's logit before sampling, as llama.cpp's `--logit-bias`: e.g.
    /// `--logit-bias 15043+1.5`, `15043-100` to all but ban it, `15043-inf` to ban it (repeatable, one per
    /// token).
    #[arg(long, short = 'l', value_name = "ID(+|-)BIAS", allow_hyphen_values = true, value_parser = parse_logit_bias)]
    logit_bias: Vec<LogitBias>,
    /// Random seed: the same seed and options give the same output. Default (or -1, as in llama.cpp and
    /// `eddy serve`'s `seed`): a random seed.
    #[arg(long, allow_negative_numbers = true, value_parser = parse_seed)]
    seed: Option<Seed>,
    /// Most tokens to generate (at least 1, or -1 for no limit, as llama.cpp's -n); generation also stops at
    /// an end-of-turn token or when the context is full.
    #[arg(long, short = 'n', default_value = "1024", allow_negative_numbers = true, value_parser = parse_max_tokens)]
    max_tokens: usize,
    /// End the reply where the text TEXT appears (not printed; the finish is a stop), as the API's `stop`;
    /// repeatable. Empty texts are refused.
    #[arg(long, value_name = "TEXT", allow_hyphen_values = true)]
    stop: Vec<String>,
    /// Print the statistics as one JSON object (on stderr) instead of the panel.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    spec: SpecArgs,
}

/// Speculative decoding options (output is identical with and without).
#[derive(Args, Clone)]
struct SpecArgs {
    /// Speculative decoding: none, suffix (lookup in the prompt and the text so far), draft (a smaller
    /// model with the same tokenizer, --draft-model), mtp (the model's own multi-token-prediction head,
    /// Qwen3.5), dflash / dflash-chain (a DFlash block drafter: the best-first tree of its marginals / its
    /// argmax chain), or auto (suffix, plus the MTP head if the model has one, plus the drafter if given or
    /// found). Default: auto when --draft-model is given or, on the CPU, when a DFlash drafter is found next
    /// to the model; else none (on a GPU a found drafter is not used unless asked for: there a verify pass
    /// costs too many decode steps for today's drafters to pay, BENCHMARKS.md, session 25).
    #[arg(long, value_name = "none|suffix|draft|mtp|dflash|dflash-chain|auto")]
    speculator: Option<String>,
    /// Drafter for --speculator draft|dflash|auto: a draft model (GGUF file, Hugging Face folder or hub id)
    /// or a DFlash drafter folder (config.json naming DFlashDraftModel; loaded as int8). Without it, a
    /// DFlash drafter next to the model is used: `<model stem>.dflash/` or `dflash-<prefix of the model's
    /// file name>/` (on a GPU only with --speculator). The drafter runs where the model runs (--device: on a
    /// GPU next to it).
    #[arg(long, value_name = "PATH")]
    draft_model: Option<String>,
    /// Draft tokens verified per target forward pass: a node count, or auto (chosen each step from the
    /// measured verify cost and the drafts' confidence). On a GPU at most 63 (a verify pass of 64 tokens is
    /// the largest whose rows equal plain decoding's bit for bit).
    #[arg(long, default_value = "auto", value_name = "N|auto")]
    spec_budget: String,
}

/// Parse the speculation flags (before any model is loaded); the kind is `None` when not given (auto
/// if a drafter turns up, else none).
fn spec_options(a: &SpecArgs) -> eddy::Result<(Option<SpeculatorKind>, Budget)> {
    let kind = a.speculator.as_deref().map(SpeculatorKind::parse).transpose().map_err(|e| bad("--speculator", e))?;
    let budget = Budget::parse(&a.spec_budget).map_err(|e| bad("--spec-budget", e))?;
    if kind == Some(SpeculatorKind::Draft) && a.draft_model.is_none() {
        return Err(bad("--speculator", "draft needs --draft-model PATH"));
    }
    if kind == Some(SpeculatorKind::None) && matches!(budget, Budget::Fixed(_)) {
        return Err(bad("--spec-budget", "has no effect with --speculator none"));
    }
    if a.draft_model.is_some() && kind.is_some_and(|k| !k.uses_drafter()) {
        return Err(bad("--draft-model", "is only used with --speculator draft, dflash, dflash-chain or auto"));
    }
    Ok((kind, budget))
}

/// The drafter to use: `--draft-model`, else (for kinds that run one) a DFlash drafter next to the model;
/// without `--speculator`, only on the CPU ([`implicit_drafter`]).
fn find_drafter(engine: &Engine, a: &SpecArgs, kind: Option<SpeculatorKind>) -> eddy::Result<Option<Drafter>> {
    if let Some(p) = &a.draft_model {
        let dir = std::path::Path::new(p);
        return Ok(Some(if is_dflash_dir(dir) {
            Drafter::DFlash(Box::new(DFlashDrafter::load(dir, Quant::Q8)?))
        } else {
            Drafter::Model(Box::new(load_with_progress(Some(p), Quant::default())?))
        }));
    }
    if !kind.is_none_or(|k| k.uses_drafter()) || (kind.is_none() && !implicit_drafter(engine.runs_on())) {
        return Ok(None);
    }
    match find_next_to(&engine.lm.source) {
        Some(dir) => Ok(Some(Drafter::DFlash(Box::new(DFlashDrafter::load(&dir, Quant::Q8)?)))),
        None => Ok(None),
    }
}

/// Whether a drafter found next to the model turns speculation on by itself (no `--speculator`, no
/// `--draft-model`) on `device` ([`Engine::runs_on`]): on the CPU, where it pays (issue 12's benchmark: 2.03× /
/// 1.29× plain decoding on HumanEval / ShareGPT); not on a GPU, where on the H200 the same default served
/// 0.92× / 0.97× plain decoding (a 16-node verify costs 1.9 decode steps there; BENCHMARKS.md, session 25).
fn implicit_drafter(device: Device) -> bool {
    device == Device::Cpu
}

/// Load the drafter (if any) and attach the speculators to `engine`.
fn attach_speculators(engine: &mut Engine, a: &SpecArgs, kind: Option<SpeculatorKind>, budget: Budget) -> eddy::Result<()> {
    let draft = find_drafter(engine, a, kind)?;
    let kind = kind.unwrap_or(if draft.is_some() { SpeculatorKind::Auto } else { SpeculatorKind::None });
    if kind == SpeculatorKind::None && matches!(budget, Budget::Fixed(_)) {
        let why = if !implicit_drafter(engine.runs_on()) && find_next_to(&engine.lm.source).is_some() {
            "a drafter next to the model runs on a GPU only when asked"
        } else {
            "no drafter found"
        };
        return Err(bad("--spec-budget", format!("has no effect: no speculator runs ({why}; name one with --speculator)")));
    }
    engine.speculate(kind, draft, budget)
}

#[derive(Args)]
struct QuantizeArgs {
    /// Source model: a GGUF file or a Hugging Face safetensors folder (llama, qwen2, qwen3, gemma3), or a DFlash
    /// drafter folder (written with its matrices as `--quant q8` loads them: needs `--format l --group 32
    /// --no-rotation`).
    #[arg(long)]
    model: String,
    /// m: 4-bit codes with an f16 scale and offset per group; l: 8-bit symmetric codes; k: 4-bit codes in
    /// groups of 32 with 6-bit scale and offset multipliers under f16 super-scales per 256 values (4.5 bits
    /// per weight; ignores --group); k6: 6-bit symmetric codes in groups of 16 with i8 scale multipliers under
    /// f16 super-scales per 256 values (6.5625 bits per weight; ignores --group; a `k6/32` rule of
    /// --tensor-format takes groups of 32: 6.3125 bits, a faster prefill). Rows not a multiple of 256 long
    /// end in a partial super-block.
    #[arg(long, value_name = "m|l|k|k6")]
    format: String,
    /// Values per scale: 32, 64 or 128 (a row length it does not divide takes 64 or 32).
    #[arg(long, default_value_t = 64)]
    group: usize,
    /// Quantize the weights as they are, without the block Hadamard rotation.
    #[arg(long)]
    no_rotation: bool,
    /// Leave these matrices unrotated (comma-separated; q_proj, k_proj and v_proj together, gate_proj and
    /// up_proj together, as they read one input; `none` rotates every matrix) [default: gate_proj,up_proj]:
    /// on both Qwen2.5-Coder models the rotation lowers the KL of the attention and down products but raises
    /// that of gate/up.
    #[arg(long, value_name = "NAMES")]
    no_rotation_for: Option<String>,
    /// Seed of the rotation's random signs.
    #[arg(long, default_value_t = 14)]
    seed: u64,
    /// Hessian-aware rounding (GPTQ/LDLQ) of the M matrices from this calibration text: the source model
    /// runs on it first (windows of 512 tokens) to collect each layer's input statistics.
    #[arg(long, value_name = "FILE")]
    calib: Option<std::path::PathBuf>,
    /// Tokens of the calibration text used (its first ones).
    #[arg(long, default_value_t = 2048, requires = "calib")]
    calib_tokens: usize,
    /// Run the calibration on this copy of the same model instead of the source (e.g. an eddy folder of it
    /// in l, whose int8 products are many times faster than the source's f32 ones; the Hessians come
    /// out nearly the same). Must have the source's layers and widths.
    #[arg(long, value_name = "MODEL", requires = "calib")]
    calib_model: Option<String>,
    /// GPTQ dampening: this fraction of the mean diagonal of each Hessian is added to its diagonal (1.0:
    /// measured best for a few thousand calibration tokens, docs/quant-formats.md).
    #[arg(long, default_value_t = eddy::quant::gptq::DAMP, requires = "calib")]
    calib_damp: f64,
    /// Format of the LM head (a tied embedding included): l (default), m, k or k6.
    #[arg(long, value_name = "m|l|k|k6", default_value = "l")]
    head_format: String,
    /// Values per scale of the LM head (default: --group).
    #[arg(long)]
    head_group: Option<usize>,
    /// Values per scale of an untied token embedding (default: --group).
    #[arg(long)]
    embed_group: Option<usize>,
    /// Per-tensor formats overriding the above, comma-separated `NAME[@LAYERS]=FORMAT[/GROUP]` (the last
    /// matching rule wins; repeatable): NAME one of embed_tokens, lm_head, q_proj, k_proj, v_proj,
    /// o_proj, gate_proj, up_proj, down_proj; LAYERS `+`-separated layers or ranges (`0-3+24-27`); FORMAT
    /// m, l, k or k6; GROUP 32, 64 or 128 for m and l (default --group), 16 (default) or 32 for k6, none for
    /// k. Example: `k_proj=l/32,v_proj=l/32,embed_tokens=m/128`.
    #[arg(long, value_name = "RULES")]
    tensor_format: Vec<String>,
    /// Output folder (must not exist; written atomically).
    #[arg(short = 'o', long = "out")]
    out: std::path::PathBuf,
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Text file to score.
    #[arg(long, short = 'f')]
    file: std::path::PathBuf,
    /// Print the result as one JSON object (perplexity, scored_tokens, window; with --kl-base also
    /// base_perplexity, kl_mean, kl_mean_se, kl_median, kl_p99, kl_max, top1_agreement).
    #[arg(long)]
    json: bool,
    /// A base model (GGUF file, model folder or hub id) to compare against on the same text: KL
    /// divergence of the model's next-token distributions from the base's (mean, median, p99, max, in
    /// nats) and top-1 agreement, like llama-perplexity's --kl-divergence. Same tokenizer required.
    /// BASE may also be a logits file written by --save-logits for the same text and --ctx.
    #[arg(long, value_name = "BASE")]
    kl_base: Option<String>,
    /// Also write the model's logits over the text's windows to FILE (f32, vocabulary × scored
    /// positions: 2.4 GB per 4k tokens of a 152k vocabulary), for later runs' --kl-base FILE.
    #[arg(long, value_name = "FILE", conflicts_with = "kl_base")]
    save_logits: Option<std::path::PathBuf>,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            let args: Vec<String> = std::env::args().skip(1).collect();
            let _ = writeln!(std::io::stderr(), "error: {}", clap_error_line(&e, &args));
            return ExitCode::from(2);
        }
    };
    let r = match cli.cmd {
        Cmd::Run(a) => run(a),
        Cmd::Perplexity(a) => perplexity(a),
        Cmd::Quantize(a) => quantize(a),
        Cmd::Speed(a) => speed(a),
        Cmd::Serve { model, host, port, max_queue, no_prefix_cache, aliases, cors_origins, body_timeout, spec } => {
            let opts = eddy_server::ServeOptions { max_queue, aliases, cors_origins, body_timeout, ..Default::default() };
            serve(model, &host, port, opts, !no_prefix_cache, &spec)
        }
        Cmd::Bandwidth { threads } => bandwidth(threads),
        Cmd::Bench(a) => bench::run(a).map_err(eddy::Error::Input),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Never panic on a closed stderr: the exit code still says what happened.
            let _ = writeln!(std::io::stderr(), "error: {}", one_line(&e.to_string()));
            ExitCode::from(2)
        }
    }
}

fn serve(
    model: ModelArgs,
    host: &str,
    port: u16,
    opts: eddy_server::ServeOptions,
    prefix_cache: bool,
    spec: &SpecArgs,
) -> eddy::Result<()> {
    let (spec_kind, spec_budget) = spec_options(spec)?;
    opts.validate().map_err(|e| eddy::Error::Input(e.to_string()))?;
    let (mut engine, _) = engine_with(&model, model.ctx.unwrap_or(DEFAULT_CTX), prefix_cache)?;
    attach_speculators(&mut engine, spec, spec_kind, spec_budget)?;
    eddy_server::run_blocking(host, port, engine, opts).map_err(|e| eddy::Error::Input(format!("server: {e}")))
}

/// `thing: problem`, an input error named after the option or input at fault.
fn bad(thing: &str, problem: impl std::fmt::Display) -> eddy::Error {
    eddy::Error::Input(format!("{thing}: {problem}"))
}

/// Error unless a file can be created next to `path` (in its folder), so that a command whose output
/// goes there fails before its work, not after: a probe file is created and removed.
/// On Ctrl-C, SIGTERM or SIGHUP: remove `paths` (the temporary files or folders a command writes before
/// renaming them into place), say which were there, and exit with 130 (128 + SIGINT, as shells report an interrupted
/// command). Installed once per process; a second call is ignored.
fn remove_on_signal(paths: Vec<std::path::PathBuf>) {
    let _ = ctrlc::set_handler(move || {
        let removed: Vec<String> = paths
            .iter()
            .filter(|p| if p.is_dir() { std::fs::remove_dir_all(p).is_ok() } else { std::fs::remove_file(p).is_ok() })
            .map(|p| p.display().to_string())
            .collect();
        let what = if removed.is_empty() { String::new() } else { format!(" (removed the partial {})", removed.join(", ")) };
        eprintln!("\ninterrupted{what}");
        std::process::exit(130);
    });
}

fn check_writable(flag: &str, path: &std::path::Path) -> eddy::Result<()> {
    if !path.exists() && path.symlink_metadata().is_ok() {
        return Err(bad(flag, format!("{} is a link to nothing (a dangling symbolic link): not written through", path.display())));
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    let probe = dir.join(format!(".eddy-write-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => Err(bad(flag, format!("cannot write into {}: {e}", dir.display()))),
    }
}

/// Most bytes a text input (a message from stdin, a perplexity or calibration file) may have: far past any
/// context (128k tokens are about 0.5 MB of text), and a stream that never ends (`/dev/zero`) is refused at
/// this size instead of filling the memory.
const MAX_TEXT_BYTES: u64 = 256 << 20;

/// All of `r`, at most [`MAX_TEXT_BYTES`]; `what` names the input in errors.
fn read_text_bytes(r: impl std::io::Read, what: &str) -> eddy::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(MAX_TEXT_BYTES + 1).read_to_end(&mut buf).map_err(|e| bad(what, format!("cannot read: {e}")))?;
    if buf.len() as u64 > MAX_TEXT_BYTES {
        return Err(bad(what, format!("more than {} MiB of text: refused", MAX_TEXT_BYTES >> 20)));
    }
    Ok(buf)
}

/// Collapse a message to one line (errors are one line, whatever the library or a parser wrote).
fn one_line(s: &str) -> String {
    s.split(['\n', '\r']).map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

/// A command-line parse error as one `thing: problem` line (clap's own rendering spans several lines and
/// a usage block). `args`: the command line after the program name (a stray word after `run` without
/// `-m` is most likely the message).
fn clap_error_line(e: &clap::Error, args: &[String]) -> String {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let get = |k: ContextKind| match e.get(k) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) if !v.is_empty() => Some(v.join(", ")),
        _ => None,
    };
    // "--threads <THREADS>" → "--threads"
    let flag = |s: &str| s.split(", ").map(|a| a.split_whitespace().next().unwrap_or(a).to_string()).collect::<Vec<_>>().join(", ");
    let hint = get(ContextKind::SuggestedArg)
        .or_else(|| get(ContextKind::SuggestedSubcommand))
        .map(|s| format!("; did you mean '{s}'?"))
        .unwrap_or_default();
    const COMMANDS: &str = "run, serve, bench, perplexity, quantize, speed or bandwidth";
    let specific = match e.kind() {
        ErrorKind::InvalidValue | ErrorKind::ValueValidation => get(ContextKind::InvalidArg).map(|arg| {
            let val = get(ContextKind::InvalidValue).unwrap_or_default();
            let why = match (e.kind(), std::error::Error::source(e)) {
                (ErrorKind::ValueValidation, Some(src)) => src.to_string(),
                _ if val.is_empty() => "a value is required".to_string(),
                _ => match get(ContextKind::ValidValue) {
                    Some(v) => format!("expected one of {v}"),
                    None => "not accepted".to_string(),
                },
            };
            if val.is_empty() {
                format!("{}: {why}", flag(&arg))
            } else {
                format!("{}: invalid value '{val}': {why}", flag(&arg))
            }
        }),
        ErrorKind::UnknownArgument => get(ContextKind::InvalidArg).map(|arg| {
            let has_message = args.iter().any(|a| a.starts_with("-m") || a.starts_with("--message"));
            let what = if arg.starts_with('-') {
                "unknown option"
            } else if args.first().is_some_and(|c| c == "run") && !has_message {
                "unexpected argument (a message goes after -m, quoted: eddy run -m \"...\")"
            } else {
                "unexpected argument (quote text with spaces)"
            };
            format!("{arg}: {what}{hint} (see --help)")
        }),
        ErrorKind::ArgumentConflict => get(ContextKind::InvalidArg).map(|arg| match get(ContextKind::PriorArg) {
            Some(prior) if flag(&prior) != flag(&arg) => format!("{}: cannot be used with {}", flag(&arg), flag(&prior)),
            _ => format!("{}: given more than once", flag(&arg)),
        }),
        ErrorKind::MissingRequiredArgument => {
            get(ContextKind::InvalidArg).map(|args| format!("{}: required but not given (see --help)", flag(&args)))
        }
        ErrorKind::InvalidSubcommand => {
            get(ContextKind::InvalidSubcommand).map(|c| format!("{c}: unknown command (commands: {COMMANDS}){hint}"))
        }
        ErrorKind::MissingSubcommand | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            Some(format!("eddy: no command given (commands: {COMMANDS}; see eddy --help)"))
        }
        _ => None,
    };
    specific.unwrap_or_else(|| {
        let text = e.render().to_string();
        let body: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("Usage:") && !l.starts_with("For more information"))
            .collect();
        format!("eddy: {}", body.join(" ").trim_start_matches("error: "))
    })
}

/// Print one line on stdout; a reader that went away (broken pipe) is not an error.
fn print_line(s: &str) -> eddy::Result<()> {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{s}").and_then(|_| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        Err(e) => Err(bad("stdout", format!("cannot write: {e}"))),
    }
}

/// Worker threads for `--threads`: at least 1, at most the cores available (a spinning pool with more
/// workers than cores is many times slower, not faster).
fn threads_for(requested: Option<usize>) -> eddy::Result<usize> {
    let cores = default_threads();
    match requested {
        None => Ok(cores),
        Some(0) => Err(bad("--threads", "must be at least 1 (leave it out to use all cores)")),
        Some(n) if n > cores => {
            let _ = writeln!(std::io::stderr(), "note: --threads {n} is more than the {cores} cores available; using {cores}");
            Ok(cores)
        }
        Some(n) => Ok(n),
    }
}

fn bandwidth(threads: Option<usize>) -> eddy::Result<()> {
    let pool = eddy::backend::cpu::ThreadPool::new(threads_for(threads)?);
    print_line(&format!("{:.1}", eddy::backend::cpu::bandwidth::measure_read_bandwidth(&pool, 1 << 30, 5)))
}

fn load_with_progress(spec: Option<&str>, quant: Quant) -> eddy::Result<LoadedModel> {
    if let Some(p) = spec.map(std::path::Path::new).filter(|p| eddy::spec::dflash::is_dflash_dir(p)) {
        return Err(eddy::Error::model(p, "is a DFlash drafter, not a model: pass it as --draft-model with its target as --model"));
    }
    if spec.is_none() && eddy::load::default_model_path().is_err() {
        // First use: download the default model into the models folder (unless offline).
        let dir = eddy::load::models_dir();
        if fetch::offline() {
            return Err(eddy::Error::model(
                dir.join(fetch::DEFAULT_MODEL.file),
                "default model not found and downloads are off (EDDY_OFFLINE/HF_HUB_OFFLINE); fetch it with `tools/fetch_models.sh qwen05` or pass --model",
            ));
        }
        fetch::fetch(&fetch::DEFAULT_MODEL, &dir).map_err(|e| eddy::Error::Input(format!("downloading the default model: {e}")))?;
    }
    let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {bar:40} {pos}/{len} tensors {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let r = load(spec, quant, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    });
    bar.finish_and_clear();
    r
}

/// Check the options of `m` (before the slow model load), then load the model and build the engine;
/// returns it with its number of worker threads.
fn engine_for(m: &ModelArgs) -> eddy::Result<(Engine, usize)> {
    engine_with_ctx(m, m.ctx.unwrap_or(DEFAULT_CTX))
}

/// Context length of `run`, `serve` and `speed` when --ctx is not given.
const DEFAULT_CTX: usize = 4096;
/// Perplexity window when --ctx is not given (llama-perplexity's default).
const DEFAULT_PPL_CTX: usize = 512;

fn engine_with_ctx(m: &ModelArgs, ctx: usize) -> eddy::Result<(Engine, usize)> {
    engine_with(m, ctx, EngineOptions::default().prefix_cache)
}

fn engine_with(m: &ModelArgs, ctx: usize, prefix_cache: bool) -> eddy::Result<(Engine, usize)> {
    if ctx < 2 {
        return Err(bad("--ctx", format!("must be at least 2 tokens, got {ctx}")));
    }
    let threads = threads_for(m.threads)?;
    let lm = load_with_progress(m.model.as_deref(), m.quant.unwrap_or_default())?;
    let opts = EngineOptions { threads, ctx, prefix_cache, ..Default::default() };
    // A context that can never be allocated is --ctx's fault (named as such before the device is tried).
    let cpu = m.device == Device::Cpu || (m.device == Device::Auto && !cfg!(feature = "cuda"));
    Engine::check_context(&lm, &opts, if cpu { Device::Cpu } else { m.device }).map_err(|e| bad("--ctx", e))?;
    Ok((Engine::on_device(lm, &opts, m.device).map_err(|e| bad("--device", e))?, threads))
}

/// The sampling options, each checked with the name of its flag.
fn sampler_params(a: &RunArgs) -> eddy::Result<SamplerParams> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(bad("--temperature", format!("must be a number >= 0 (0 = greedy), got {}", a.temperature)));
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        return Err(bad("--top-p", format!("must be in (0, 1] (1 = off), got {}", a.top_p)));
    }
    if !(0.0..=1.0).contains(&a.min_p) {
        return Err(bad("--min-p", format!("must be in [0, 1] (0 = off), got {}", a.min_p)));
    }
    if !(a.repetition_penalty.is_finite() && a.repetition_penalty > 0.0) {
        return Err(bad("--repetition-penalty", format!("must be a number > 0 (1 = off), got {}", a.repetition_penalty)));
    }
    let mut ids: Vec<u32> = a.logit_bias.iter().map(|b| b.0).collect();
    ids.sort_unstable();
    if let Some(w) = ids.windows(2).find(|w| w[0] == w[1]) {
        return Err(bad("--logit-bias", format!("token {} is given twice (one bias per token)", w[0])));
    }
    let sampler = SamplerParams {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repetition_penalty: a.repetition_penalty,
        repeat_last_n: 64,
        seed: a.seed.and_then(|s| s.0).unwrap_or_else(random_seed),
        logit_bias: a.logit_bias.iter().map(|b| (b.0, b.1)).collect(),
        ..SamplerParams::default()
    };
    sampler.validate().map_err(|e| bad("sampling", e))?;
    Ok(sampler)
}

fn run(a: RunArgs) -> eddy::Result<()> {
    // Everything the user typed is checked before the (slow) model load.
    let sampler = sampler_params(&a)?;
    if a.stop.iter().any(String::is_empty) {
        return Err(bad("--stop", "an empty text would end every reply before it starts"));
    }
    let kwargs = match &a.chat_template_kwargs {
        None => serde_json::Map::new(),
        Some(s) => match serde_json::from_str::<serde_json::Value>(s) {
            Ok(serde_json::Value::Object(m)) => m,
            Ok(v) => {
                return Err(bad("--chat-template-kwargs", format!("must be a JSON object like '{{\"enable_thinking\": false}}', got {v}")))
            }
            Err(e) => {
                return Err(bad(
                    "--chat-template-kwargs",
                    format!("invalid JSON ({e}); expected an object like '{{\"enable_thinking\": false}}'"),
                ))
            }
        },
    };
    let (message, source) = match a.message.as_deref() {
        None if a.raw => return Err(bad("--raw", "needs --message (a chat goes through the chat template)")),
        None => return chat(&a, sampler, &kwargs),
        Some("-") => {
            let buf = read_text_bytes(std::io::stdin(), "stdin")?;
            let s = String::from_utf8(buf).map_err(|e| bad("stdin", format!("the message is not UTF-8 text ({e})")))?;
            // `echo hi | eddy run -m -` sends "hi", not "hi\n".
            (s.trim_end_matches(['\n', '\r']).to_string(), "stdin")
        }
        Some(m) => (m.to_string(), "--message"),
    };
    if message.trim().is_empty() && !a.raw {
        return Err(bad(source, "the message is empty"));
    }
    let (spec_kind, spec_budget) = spec_options(&a.spec)?;
    let (mut engine, _) = engine_for(&a.model)?;
    attach_speculators(&mut engine, &a.spec, spec_kind, spec_budget)?;
    check_logit_bias(&engine, &a.logit_bias)?;
    let mut end_text = None;
    let prompt = if a.raw {
        engine.lm.tokenizer.encode(&with_system(&a.system, &message), true)?
    } else {
        let template = ChatTemplate::or_chatml(engine.lm.template.take(), &engine.lm.tokenizer);
        end_text = template.end_text().map(str::to_string);
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage { role: "system".into(), content: s.clone() });
        }
        msgs.push(ChatMessage { role: "user".into(), content: message });
        chat_prompt(&template, &engine.lm.tokenizer, &msgs, &kwargs)?
    };
    if prompt.is_empty() {
        return Err(bad(source, "the message is empty and the model adds no BOS token: nothing to generate from"));
    }

    let energy = EnergyMeter::start_with_gpu(engine.gpu_pci_bus_id().as_deref());
    let mut e_first = None;
    let params = GenerateParams { max_tokens: a.max_tokens, sampler, ignore_eos: false, logprobs: None };
    // Ctrl-C stops the reply and still prints the panel (as llama.cpp prints its timings), then exits 130.
    use std::sync::atomic::Ordering::SeqCst;
    stop_replies_on_sigint();
    GENERATING.store(true, SeqCst);
    let stop = || STOP_REPLY.load(SeqCst);
    let r = stream_reply(&mut engine, &prompt, &params, &stops(&a.stop, end_text.as_deref()), &stop, &mut || {
        if e_first.is_none() {
            e_first = Some(energy.as_ref().map(|m| m.joules()).unwrap_or(0.0));
        }
        !stop()
    });
    GENERATING.store(false, SeqCst);
    let stats = r?.stats;
    let total_j = energy.as_ref().ok().map(|m| (m.joules(), m.sources()));
    // No token generated: all of it was prefill.
    let prefill_j = e_first.or(total_j.as_ref().map(|t| t.0)).unwrap_or(0.0);
    print_stats(&stats, energy.as_ref().err(), total_j, prefill_j, a.json);
    if stop() {
        let _ = writeln!(std::io::stderr(), "interrupted");
        std::process::exit(130);
    }
    Ok(())
}

/// The texts that end a reply: the user's `--stop` texts, then the chat template's end text if it has one.
fn stops(user: &[String], end_text: Option<&str>) -> Vec<String> {
    user.iter().cloned().chain(end_text.map(str::to_string)).collect()
}

/// A reply [`stream_reply`] wrote to stdout.
struct Streamed {
    stats: GenerationStats,
    /// The reply's text as written.
    text: String,
    /// The reader of stdout went away (broken pipe): generation stopped there.
    broken_pipe: bool,
}

/// Generates the reply to `prompt`, writing its text to stdout as it comes and a newline after it; what is
/// still pending at the end, an incomplete character cut by --max-tokens, is left out rather than printed as
/// a U+FFFD the model never finished. `cancelled` is asked between prefill pieces (`true` stops before the
/// first token), `on_token` before each token is written (`false` stops). `stops` (the user's `--stop` texts
/// and the chat template's [`ChatTemplate::end_text`], [`stops`]) end the reply: the text is not written, and the reply's
/// finish is `Stop`. A reader that goes away (broken pipe) stops generation; other write errors are errors.
fn stream_reply(
    engine: &mut Engine,
    prompt: &[u32],
    params: &GenerateParams,
    stops: &[String],
    cancelled: &dyn Fn() -> bool,
    on_token: &mut dyn FnMut() -> bool,
) -> eddy::Result<Streamed> {
    let tok = engine.lm.tokenizer.clone();
    let mut dec = StreamDecoder::new(&tok, true);
    let mut ends = eddy::stop::StopMatcher::new(stops.to_vec());
    let mut out = std::io::stdout().lock();
    let mut write_err = None;
    let mut text = String::new();
    let mut ended = false;
    let mut write = |t: &str, text: &mut String| {
        text.push_str(t);
        out.write_all(t.as_bytes()).and_then(|_| out.flush())
    };
    let mut stats = engine.generate_cancellable(prompt, params, cancelled, &mut |id, _| {
        if !on_token() {
            return false;
        }
        if let Ok(Some(t)) = dec.push(id) {
            let (t, end) = ends.push(&t);
            if let Err(e) = write(&t, &mut text) {
                write_err = Some(e);
                return false;
            }
            ended = end;
        }
        !ended
    })?;
    if write_err.is_none() {
        if !ended {
            let rest = dec.finish().ok().flatten().map(|t| t.trim_end_matches('\u{FFFD}').to_string()).unwrap_or_default();
            let (t, end) = ends.push(&rest);
            ended = end;
            let _ = write(&if end { t } else { t + &ends.flush() }, &mut text);
        }
        if let Err(e) = writeln!(out).and_then(|_| out.flush()) {
            write_err = Some(e);
        }
    }
    if ended {
        stats.finish = FinishReason::Stop;
    }
    match write_err {
        Some(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(bad("stdout", format!("cannot write the reply: {e}"))),
        e => Ok(Streamed { stats, text, broken_pipe: e.is_some() }),
    }
}

/// The tokens of `messages` through `template` with a generation prompt. The messages' texts are read as
/// text: special-token text written in them (`<|im_end|>` in a question, or in a reply fed back into the
/// next turn) stays text, as in `eddy serve` ([`encode_chat_guarded`]).
fn chat_prompt(
    template: &ChatTemplate,
    tok: &eddy::tokenizer::Tokenizer,
    messages: &[ChatMessage],
    kwargs: &serde_json::Map<String, serde_json::Value>,
) -> eddy::Result<Vec<u32>> {
    let text = template.render(messages, true, kwargs)?;
    if text.is_empty() {
        return Err(bad("chat template", "renders the conversation to nothing (an empty template?)"));
    }
    let untrusted: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
    // Where they hold special-token text, the conversation rendered again with it defanged: the template's
    // markup told apart by position.
    encode_chat_guarded(tok, &text, &untrusted, || {
        let dm: Vec<ChatMessage> = messages
            .iter()
            .map(|m| ChatMessage::new(m.role.clone(), eddy::chat::defang(tok, &m.content).unwrap_or_else(|| m.content.clone())))
            .collect();
        template.render(&dm, true, kwargs).ok()
    })
}

/// Every --logit-bias id must be a token of the model's vocabulary.
fn check_logit_bias(engine: &Engine, biases: &[LogitBias]) -> eddy::Result<()> {
    let vocab = engine.lm.tokenizer.vocab_size().min(engine.lm.model.config.vocab_size);
    match biases.iter().find(|b| b.0 as usize >= vocab) {
        Some(b) => Err(bad("--logit-bias", format!("token id {} is out of range (the vocabulary has {vocab} tokens)", b.0))),
        None => Ok(()),
    }
}

/// Set by Ctrl-C while a reply is generated: the reply stops at the next token.
static STOP_REPLY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// A reply is being generated (Ctrl-C stops it; otherwise Ctrl-C ends the process as usual).
static GENERATING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Ctrl-C (SIGINT only: SIGTERM and SIGHUP keep their default, ending the process) stops the reply being
/// generated ([`GENERATING`] → [`STOP_REPLY`]), or at any other time ends the process as an unhandled SIGINT
/// would. The handler only touches atomics.
fn stop_replies_on_sigint() {
    use std::sync::atomic::Ordering::SeqCst;
    // SAFETY: both actions are async-signal-safe (atomic loads and stores; emulate_default_handler is
    // documented for use inside handlers).
    let _ = unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGINT, || {
            if GENERATING.load(SeqCst) {
                STOP_REPLY.store(true, SeqCst);
            } else {
                let _ = signal_hook::low_level::emulate_default_handler(signal_hook::consts::SIGINT);
            }
        })
    };
}

/// `eddy run` without --message: a conversation read from stdin, a line per user message (a line ending
/// in `\` continues on the next). The whole conversation is rendered through the chat template each turn;
/// the engine's prefix cache reuses the tokens it has already seen, so a turn prefills only what is new.
/// A turn that no longer fits the context is refused (the conversation is kept, `/clear` empties it).
fn chat(a: &RunArgs, sampler: SamplerParams, kwargs: &serde_json::Map<String, serde_json::Value>) -> eddy::Result<()> {
    use std::io::{BufRead, IsTerminal};
    use std::sync::atomic::Ordering::SeqCst;
    let (spec_kind, spec_budget) = spec_options(&a.spec)?;
    let (mut engine, _) = engine_for(&a.model)?;
    attach_speculators(&mut engine, &a.spec, spec_kind, spec_budget)?;
    check_logit_bias(&engine, &a.logit_bias)?;
    let template = ChatTemplate::or_chatml(engine.lm.template.take(), &engine.lm.tokenizer);
    stop_replies_on_sigint();
    // Notes go to stderr; a stderr that cannot be written is not an error.
    let note = |s: &str| {
        let _ = write!(std::io::stderr(), "{s}");
    };
    let tty = std::io::stdin().is_terminal();
    if tty {
        note("chat: a line is a message (end it with \\ to go on), /clear starts over, /exit or Ctrl-D ends; Ctrl-C stops a reply\n");
    }
    // A message longer than this surely overflows the context: refused before it is tokenized.
    let max_bytes = engine.lm.tokenizer.max_text_bytes(engine.ctx());
    let system: Vec<ChatMessage> = a.system.iter().map(|s| ChatMessage { role: "system".into(), content: s.clone() }).collect();
    let mut history = system.clone();
    let tok = engine.lm.tokenizer.clone();
    // With --json each turn reports its energy: one meter for the session (NVML starts once), read per turn.
    let energy = a.json.then(|| EnergyMeter::start_with_gpu(engine.gpu_pci_bus_id().as_deref()));
    let mut stdin = std::io::stdin().lock();
    loop {
        if tty {
            note("> ");
        }
        // One message: lines joined while they end in a backslash (decided on the raw bytes). What is read
        // is bounded by `max_bytes`: a longer message is read to its end and dropped, never held.
        let mut message = String::new();
        let (mut end, mut too_long) = (false, false);
        loop {
            let mut buf = Vec::new();
            let mut read = |buf: &mut Vec<u8>, limit: u64| {
                (&mut stdin).take(limit).read_until(b'\n', buf).map_err(|e| bad("stdin", format!("cannot read: {e}")))
            };
            if read(&mut buf, max_bytes as u64 + 2)? == 0 {
                end = true;
                break;
            }
            if !buf.ends_with(b"\n") && buf.len() > max_bytes {
                // The rest of an over-long line, read in bounded pieces and dropped.
                too_long = true;
                let mut rest = Vec::new();
                while {
                    rest.clear();
                    read(&mut rest, 1 << 16)? > 0 && !rest.ends_with(b"\n")
                } {}
                buf = rest;
            }
            let raw = buf.strip_suffix(b"\n").unwrap_or(&buf);
            let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
            let (text, more) = match raw.strip_suffix(b"\\") {
                Some(head) => (head, true),
                None => (raw, false),
            };
            match std::str::from_utf8(text) {
                Ok(_) if too_long || message.len() + text.len() > max_bytes => too_long = true,
                Ok(t) => message.push_str(t),
                Err(_) => note("that line is not UTF-8 text: left out of the message\n"),
            }
            if !more {
                break;
            }
            message.push('\n');
            if tty {
                note(". ");
            }
        }
        if too_long {
            note(&format!("that message cannot fit the context of {} tokens: dropped\n", engine.ctx()));
            continue;
        }
        match message.trim() {
            "" if end => break,
            "" => continue,
            "/exit" | "/quit" => break,
            "/clear" => {
                history = system.clone();
                continue;
            }
            _ => {}
        }
        history.push(ChatMessage { role: "user".into(), content: message });
        let prompt = chat_prompt(&template, &tok, &history, kwargs)?;
        if prompt.len() >= engine.ctx() {
            note(&format!(
                "the conversation would be {} tokens, more than the context of {} leaves room for: message dropped (/clear starts over, --ctx sets a larger context)\n",
                prompt.len(),
                engine.ctx()
            ));
            history.pop();
            continue;
        }
        let params = GenerateParams { max_tokens: a.max_tokens, sampler: sampler.clone(), ignore_eos: false, logprobs: None };
        STOP_REPLY.store(false, SeqCst);
        GENERATING.store(true, SeqCst);
        let stop = || STOP_REPLY.load(SeqCst);
        // The turn's energy, as a one-shot run measures it (--json prints it per turn): the session's meter
        // read at the turn's start, its first token and its end.
        let j0 = match &energy {
            Some(Ok(m)) => m.joules(),
            _ => 0.0,
        };
        let mut e_first = None;
        let r = stream_reply(&mut engine, &prompt, &params, &stops(&a.stop, template.end_text()), &stop, &mut || {
            if let (None, Some(Ok(m))) = (e_first, &energy) {
                e_first = Some(m.joules() - j0);
            }
            !stop()
        });
        GENERATING.store(false, SeqCst);
        let Streamed { stats, text: reply, broken_pipe } = r?;
        if broken_pipe {
            return Ok(());
        }
        // A reply stopped by Ctrl-C stays in the conversation as far as it got; one stopped before its
        // first token takes its message with it.
        if stats.generated_tokens == 0 {
            history.pop();
        } else {
            history.push(ChatMessage { role: "assistant".into(), content: reply });
        }
        if let Some(energy) = &energy {
            let total_j = energy.as_ref().ok().map(|m| (m.joules() - j0, m.sources()));
            let prefill_j = e_first.or(total_j.as_ref().map(|t| t.0)).unwrap_or(0.0);
            print_stats(&stats, energy.as_ref().err(), total_j, prefill_j, true);
        } else {
            let stopped = if STOP_REPLY.load(SeqCst) { ", stopped" } else { "" };
            note(&format!(
                "[{} tokens, {:.1} t/s, {:.2} tokens/pass, {} prompt tokens ({} cached), TTFT {:.2} s{stopped}]\n",
                stats.generated_tokens,
                stats.generation_speed(),
                stats.tokens_per_pass(),
                stats.prompt_tokens,
                stats.cached_tokens,
                stats.ttft.as_secs_f64()
            ));
        }
    }
    Ok(())
}

fn with_system(system: &Option<String>, message: &str) -> String {
    match system {
        Some(s) => format!("{s}\n\n{message}"),
        None => message.to_string(),
    }
}

/// `--logit-bias ID(+|-)BIAS`: a token id and the bias added to its logit.
#[derive(Debug, Clone, Copy)]
struct LogitBias(u32, f32);

/// `--logit-bias 15043+1.5` / `15043-100` / `15043-inf`: llama.cpp's spelling; the bias in [-100, 100],
/// or -inf (a ban).
fn parse_logit_bias(s: &str) -> Result<LogitBias, String> {
    let usage = || format!("`{s}` is not ID+BIAS or ID-BIAS (a token id, then a signed bias in [-100, 100] or -inf, e.g. 15043-100)");
    let t = s.trim();
    let at = t.find(['+', '-']).filter(|&i| i > 0 && t[..i].bytes().all(|b| b.is_ascii_digit())).ok_or_else(usage)?;
    let id = t[..at].parse::<u32>().map_err(|_| usage())?;
    let bias = t[at..].parse::<f32>().ok().filter(|b| (-100.0..=100.0).contains(b) || *b == f32::NEG_INFINITY).ok_or_else(usage)?;
    Ok(LogitBias(id, bias))
}

/// `--seed`: a fixed seed, or `None` for -1 (a random one).
#[derive(Debug, Clone, Copy)]
struct Seed(Option<u64>);

/// `--seed N`: an integer from 0 to 2^64 − 1, or -1 for a random seed.
/// `--max-tokens`: a count of at least 1, or -1 for no limit (the context bounds the reply).
fn parse_max_tokens(s: &str) -> Result<usize, String> {
    match s.trim() {
        "-1" => Ok(usize::MAX),
        t => t.parse().ok().filter(|&n| n >= 1).ok_or_else(|| format!("`{s}` is not a token count (at least 1, or -1 for no limit)")),
    }
}

fn parse_seed(s: &str) -> Result<Seed, String> {
    match s.trim() {
        "-1" => Ok(Seed(None)),
        t => t
            .parse()
            .map(|v| Seed(Some(v)))
            .map_err(|_| format!("`{s}` is not a seed (an integer from 0 to 2^64 - 1, or -1 for a random one)")),
    }
}

/// `--body-timeout SECONDS`: a positive, finite number of seconds.
fn parse_body_timeout(s: &str) -> Result<std::time::Duration, String> {
    s.trim()
        .parse::<f64>()
        .ok()
        .filter(|v| *v > 0.0)
        .and_then(|v| std::time::Duration::try_from_secs_f64(v).ok())
        .ok_or_else(|| format!("`{s}` is not a timeout (a number of seconds more than 0, e.g. 60 or 2.5)"))
}

fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

/// The stats panel (stderr); `total_j`: joules used and what measured them ([`EnergyMeter::sources`]).
fn print_stats(s: &GenerationStats, energy_err: Option<&String>, total_j: Option<(f64, String)>, prefill_j: f64, json: bool) {
    let mem_gb = peak_rss_bytes().map(|b| b as f64 / 1e9);
    let (total_j, sources) = match total_j {
        Some((j, src)) => (Some(j), Some(src)),
        None => (None, None),
    };
    let (e_total, e_in, e_out) = match total_j {
        Some(t) => {
            let out_j = (t - prefill_j).max(0.0);
            // Per prompt token prefilled (the prefix cache's tokens cost nothing).
            let prefilled = s.prompt_tokens.saturating_sub(s.cached_tokens).max(1);
            (Some(t), Some(prefill_j / prefilled as f64), Some(out_j / s.generated_tokens.max(1) as f64))
        }
        None => (None, None, None),
    };
    let mut err = std::io::stderr().lock();
    if json {
        let v = serde_json::json!({
            "time_to_first_token_s": s.ttft.as_secs_f64(),
            "speculation_calibration_s": s.calibration_time.as_secs_f64(),
            "prefill_speed_tps": s.prefill_speed(),
            // No decode pass (one token or none): no decode speed to report.
            "generation_speed_tps": (s.decode_passes > 0).then(|| s.generation_speed()),
            "tokens_per_forward_pass": (s.decode_passes > 0).then(|| s.tokens_per_pass()),
            "memory_used_gb": mem_gb,
            "total_energy_j": e_total,
            "input_energy_per_token_j": e_in,
            "output_energy_per_token_j": e_out,
            "energy_unavailable_reason": energy_err,
            "energy_sources": sources,
            "duration_s": s.duration.as_secs_f64(),
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "decode_forward_passes": s.decode_passes,
            "finish_reason": format!("{:?}", s.finish).to_lowercase(),
            "cached_tokens": s.cached_tokens,
            "draft_tokens": s.draft_tokens,
            "draft_accepted": s.draft_accepted,
            "proposed_at_depth": s.proposed_at_depth,
            "accepted_at_depth": s.accepted_at_depth,
        });
        let _ = writeln!(err, "{v}");
        return;
    }
    let na = |why: &str| format!("n/a ({why})");
    let why = energy_err.map(|s| s.as_str()).unwrap_or("unavailable");
    let calib = if s.calibration_time.is_zero() {
        String::new()
    } else {
        format!(" ({:.2} s of it measuring verify costs for speculation, once)", s.calibration_time.as_secs_f64())
    };
    let _ = writeln!(err, "time to first token: {:.2} s{calib}", s.ttft.as_secs_f64());
    let _ = writeln!(err, "prefill speed: {:.2} t/s", s.prefill_speed());
    if s.decode_passes > 0 {
        let _ = writeln!(err, "generation speed: {:.2} t/s", s.generation_speed());
        let _ = writeln!(err, "tokens per forward pass: {:.2} t/f", s.tokens_per_pass());
    } else {
        let _ = writeln!(err, "generation speed: {}", na("one token: no decode pass"));
        let _ = writeln!(err, "tokens per forward pass: {}", na("one token: no decode pass"));
    }
    let _ = writeln!(err, "memory used: {}", mem_gb.map(|g| format!("{g:.2} GB")).unwrap_or_else(|| na("no /proc/self/status")));
    let src = sources.map(|s| format!(" ({s})")).unwrap_or_default();
    let _ = writeln!(err, "total energy: {}", e_total.map(|j| format!("{j:.2} J{src}")).unwrap_or_else(|| na(why)));
    let _ = writeln!(err, "input energy per token: {}", e_in.map(|j| format!("{j:.2} J/tok")).unwrap_or_else(|| na(why)));
    let _ = writeln!(err, "output energy per token: {}", e_out.map(|j| format!("{j:.2} J/tok")).unwrap_or_else(|| na(why)));
    let _ = writeln!(err, "duration: {:.2} s", s.duration.as_secs_f64());
    if s.draft_tokens > 0 {
        let by_depth: Vec<String> = s
            .accepted_at_depth
            .iter()
            .zip(&s.proposed_at_depth)
            .take(8)
            .map(|(a, p)| format!("{:.2}", *a as f64 / (*p).max(1) as f64))
            .collect();
        let _ = writeln!(
            err,
            "draft tokens accepted: {}/{} ({:.0} %); acceptance by depth: {}",
            s.draft_accepted,
            s.draft_tokens,
            100.0 * s.draft_accepted as f64 / s.draft_tokens as f64,
            by_depth.join(" ")
        );
    }
}

fn perplexity(a: PplArgs) -> eddy::Result<()> {
    let file = a.file.display().to_string();
    let f = std::fs::File::open(&a.file).map_err(|e| eddy::Error::Io { path: a.file.clone(), source: e })?;
    let text = String::from_utf8(read_text_bytes(f, &file)?).map_err(|e| bad(&file, format!("not UTF-8 text ({e})")))?;
    if text.is_empty() {
        return Err(bad(&file, "the file is empty: nothing to score"));
    }
    if let Some(path) = &a.save_logits {
        check_writable("--save-logits", path)?;
    }
    if a.kl_base.as_ref().is_some_and(|b| b.trim().is_empty()) {
        return Err(bad("--kl-base", "empty: a model or a logits file written by --save-logits is needed"));
    }
    let window = a.model.ctx.unwrap_or(DEFAULT_PPL_CTX);
    let (mut engine, _) = engine_with_ctx(&a.model, window)?;
    if window > engine.ctx() {
        return Err(bad("--ctx", format!("a window of {window} tokens is longer than the model's training context of {}", engine.ctx())));
    }
    let tokens = engine.lm.tokenizer.encode(&text, true)?;
    if tokens.len() < 2 {
        return Err(bad(&file, format!("{} token(s): nothing to score (at least 2 are needed)", tokens.len())));
    }
    if let Some(path) = &a.save_logits {
        remove_on_signal(vec![eddy::load::temp_sibling(path)]);
        engine.save_logits(&tokens, window, path)?;
    }
    let logits_file = a.kl_base.as_ref().map(std::path::Path::new).filter(|p| eddy::engine::is_logits_file(p));
    if let Some(base) = &a.kl_base {
        let r = if let Some(path) = logits_file {
            engine.kl_divergence_file(path, &tokens, window)
        } else {
            let lm = load_with_progress(Some(base), Quant::default())?;
            let base_tokens = lm.tokenizer.encode(&text, true)?;
            if base_tokens != tokens {
                return Err(bad("--kl-base", "the base model tokenizes the text differently (a model with the same tokenizer is needed)"));
            }
            let opts = EngineOptions { threads: threads_for(a.model.threads)?, ctx: window, ..Default::default() };
            let mut base_engine = Engine::on_device(lm, &opts, a.model.device).map_err(|e| bad("--device", e))?;
            engine.kl_divergence(&mut base_engine, &tokens, window)
        };
        let r = r.map_err(|e| match e {
            eddy::Error::Input(m) => bad("--kl-base", m),
            e => e,
        })?;
        return if a.json {
            print_line(
                &serde_json::json!({"perplexity": r.perplexity, "scored_tokens": r.n, "window": window,
                    "base_perplexity": r.base_perplexity, "kl_mean": r.kl_mean, "kl_mean_se": r.kl_mean_se,
                    "kl_median": r.kl_median, "kl_p99": r.kl_p99, "kl_max": r.kl_max, "top1_agreement": r.top1})
                .to_string(),
            )
        } else {
            print_line(&format!(
                "perplexity: {:.4}\nbase perplexity: {:.4}\nscored tokens: {}\nKL divergence: mean {:.6} ± {:.6}, median {:.6}, p99 {:.6}, max {:.6}\ntop-1 agreement: {:.2} %",
                r.perplexity,
                r.base_perplexity,
                r.n,
                r.kl_mean,
                r.kl_mean_se,
                r.kl_median,
                r.kl_p99,
                r.kl_max,
                100.0 * r.top1
            ))
        };
    }
    // A running line per window on a terminal (llama-perplexity's `[i]ppl`); nothing when piped.
    let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} windows, {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let r = engine.perplexity_with(&tokens, window, &mut |done, total, ppl| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        bar.set_message(format!("perplexity {ppl:.4}"));
    });
    bar.finish_and_clear();
    let (ppl, n) = r?;
    if a.json {
        print_line(&serde_json::json!({"perplexity": ppl, "scored_tokens": n, "window": window}).to_string())
    } else {
        print_line(&format!("perplexity: {ppl:.4}\nscored tokens: {n}"))
    }
}

fn quantize(a: QuantizeArgs) -> eddy::Result<()> {
    use eddy::models::quantize::{gguf_to_hf_layout, quantize_model, write_folder, QuantizeOptions, Source, TensorRule};
    use eddy::quant::rtn::{Format, GROUPS};
    let parse = |flag: &str, v: &str| Format::parse(v).ok_or_else(|| bad(flag, format!("unknown format '{v}' (expected m, l, k or k6)")));
    let format = parse("--format", &a.format)?;
    let head_format = parse("--head-format", &a.head_format)?;
    // k and k6 have their own groups (k6/32 through a rule): a group flag for them would be ignored.
    let own = |f: Format| matches!(f, Format::K | Format::K6);
    if a.head_group.is_some() && own(head_format) {
        return Err(bad("--head-group", "has no effect on --head-format k or k6 (for k6 in groups of 32: --tensor-format lm_head=k6/32)"));
    }
    if a.embed_group.is_some() && own(format) {
        return Err(bad(
            "--embed-group",
            "has no effect with --format k or k6 (for k6 in groups of 32: --tensor-format embed_tokens=k6/32)",
        ));
    }
    let (head_group, embed_group) = (a.head_group.unwrap_or(a.group), a.embed_group.unwrap_or(a.group));
    for (flag, g) in [("--group", a.group), ("--head-group", head_group), ("--embed-group", embed_group)] {
        if !GROUPS.contains(&g) {
            return Err(bad(flag, format!("must be 32, 64 or 128, got {g}")));
        }
    }
    if !(a.calib_damp >= 0.0 && a.calib_damp.is_finite()) {
        return Err(bad("--calib-damp", format!("must be a finite fraction ≥ 0, got {}", a.calib_damp)));
    }
    if a.calib_tokens < 2 {
        return Err(bad("--calib-tokens", format!("at least 2 tokens are needed for input statistics, got {}", a.calib_tokens)));
    }
    let calib_text = match &a.calib {
        Some(p) => {
            let f = std::fs::File::open(p).map_err(|e| eddy::Error::Io { path: p.clone(), source: e })?;
            let name = p.display().to_string();
            let text = String::from_utf8(read_text_bytes(f, &name)?).map_err(|e| bad(&name, format!("not UTF-8 text ({e})")))?;
            if text.trim().is_empty() {
                return Err(bad(&p.display().to_string(), "the calibration text is empty"));
            }
            Some(text)
        }
        None => None,
    };
    if a.out.exists() {
        return Err(bad(&a.out.display().to_string(), "already exists (eddy quantize never overwrites)"));
    }
    check_writable("-o", &a.out)?;
    remove_on_signal(vec![eddy::load::temp_sibling(&a.out)]);
    let src = std::path::Path::new(&a.model);
    if src.is_dir() && eddy::spec::dflash::is_dflash_dir(src) {
        // A DFlash drafter runs with int8 matrices (groups of 32, no rotation): store exactly those.
        if format != Format::L || a.calib.is_some() || a.group != 32 || !a.no_rotation {
            return Err(bad(&a.model, "a DFlash drafter is written only as it runs: --format l --group 32 --no-rotation, no --calib"));
        }
        eddy::models::quantize::write_q8_folder(src, &a.out)?;
        return print_line(&format!("wrote {} (DFlash drafter, int8 matrices in groups of 32)", a.out.display()));
    }
    let is_gguf = src.is_file()
        && std::fs::File::open(src)
            .and_then(|mut f| {
                let mut magic = [0u8; 4];
                std::io::Read::read_exact(&mut f, &mut magic).map(|()| &magic == b"GGUF")
            })
            .unwrap_or(false);
    if is_gguf {
        // Cheap checks before the slow load: a truncated file or an unknown/hybrid architecture.
        let g = eddy::gguf::GgufFile::open(src)?;
        let config = eddy::models::config_from_gguf(&g)?;
        if config.arch == eddy::models::Arch::Qwen35 {
            return Err(bad(&a.model, "hybrid (Qwen3.5) models cannot be written as eddy folders yet"));
        }
    } else if !src.is_dir() {
        let what = if src.exists() {
            "unknown source type: give a GGUF file or a Hugging Face safetensors folder (config.json, model.safetensors, tokenizer.json)"
        } else {
            "no such file or folder"
        };
        return Err(bad(&a.model, what));
    } else if eddy::models::qwen35::is_qwen35_dir(src) {
        return Err(bad(&a.model, "hybrid (Qwen3.5) models cannot be written as eddy folders yet"));
    } else {
        eddy::models::quantize::refuse_quantized_source(src)?;
    }
    let mut lm = load_with_progress(Some(&a.model), Quant::None)?;
    if is_gguf {
        gguf_to_hf_layout(&mut lm.model)?;
    }
    let mut rules = Vec::new();
    for text in &a.tensor_format {
        let list = TensorRule::parse_list(text, a.group).map_err(|e| bad("--tensor-format", e.to_string()))?;
        if list.is_empty() {
            return Err(bad("--tensor-format", format!("'{text}' holds no rule (NAME[@LAYERS]=FORMAT[/GROUP],...)")));
        }
        rules.extend(list);
    }
    let n_layers = lm.model.config.n_layers;
    for r in &rules {
        if let Some(&(_, last)) = r.layers.iter().find(|&&(_, b)| b >= n_layers) {
            return Err(bad(
                "--tensor-format",
                format!("layer {last} of a rule is beyond the model's {n_layers} layers (0-{})", n_layers - 1),
            ));
        }
        if !r.layers.is_empty() && matches!(r.kind, eddy::models::quantize::TensorKind::Embed | eddy::models::quantize::TensorKind::Head) {
            return Err(bad("--tensor-format", "embed_tokens and lm_head take no @LAYERS"));
        }
    }
    let gptq_format = |f: Format| matches!(f, Format::M | Format::K);
    if a.calib.is_some() && !gptq_format(format) && !gptq_format(head_format) && !rules.iter().any(|r| gptq_format(r.format)) {
        return Err(bad("--calib", "GPTQ rounds m and k matrices only, and this run writes none (l and k6 are rounded to nearest)"));
    }
    let unrotated = match &a.no_rotation_for {
        Some(text) => eddy::models::quantize::TensorKind::parse_unrotated(text)?,
        None if a.no_rotation => Vec::new(),
        None => eddy::models::quantize::DEFAULT_UNROTATED.to_vec(),
    };
    if a.no_rotation && !unrotated.is_empty() {
        return Err(bad("--no-rotation-for", "has no effect with --no-rotation (nothing is rotated)"));
    }
    let opts = QuantizeOptions {
        format,
        group: a.group,
        head_format,
        head_group,
        embed_group,
        rotate: !a.no_rotation,
        unrotated,
        seed: a.seed,
        rules,
    };
    eddy::models::quantize::check_source(&mut lm.model, &opts)?;
    let calib = match &calib_text {
        Some(text) => {
            let mut tokens = lm.tokenizer.encode(text, true)?;
            tokens.truncate(a.calib_tokens);
            if tokens.len() < 2 {
                let p = a.calib.as_ref().map_or(String::new(), |p| p.display().to_string());
                return Err(bad(
                    &p,
                    format!("the calibration text is {} token long; at least 2 are needed for input statistics", tokens.len()),
                ));
            }
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            let t0 = std::time::Instant::now();
            eprintln!("calibrating on {} tokens ...", tokens.len());
            let other = match &a.calib_model {
                Some(spec) => {
                    let c = load_with_progress(Some(spec), Quant::None)?;
                    let shape = |m: &eddy::models::Model| (m.layers.len(), m.embed.rows(), m.embed.cols());
                    if shape(&c.model) != shape(&lm.model) {
                        return Err(bad("--calib-model", "not the source's shape (layers, vocabulary, width)"));
                    }
                    Some(c)
                }
                None => None,
            };
            let cm = other.as_ref().map_or(&lm.model, |c| &c.model);
            let mut c = eddy::models::quantize::calibrate(cm, &opts, &tokens, 512, threads)?;
            drop(other);
            c.set_damp(a.calib_damp);
            eprintln!("calibration: {} tokens in {:.1} s", c.tokens, t0.elapsed().as_secs_f64());
            Some(c)
        }
        None => None,
    };
    let t0 = std::time::Instant::now();
    let bar = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("quantizing {bar:40} {pos}/{len} matrices {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let bpw = quantize_model(&mut lm.model, &opts, calib.as_ref(), &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
        if !tty && (done % 16 == 0 || done == total) {
            eprintln!("quantized {done}/{total} matrices in {:.1} s", t0.elapsed().as_secs_f64());
        }
    });
    bar.finish_and_clear();
    drop(calib);
    eprintln!("quantized in {:.1} s", t0.elapsed().as_secs_f64());
    let source = if is_gguf {
        Source::Gguf { tokenizer: &lm.tokenizer, chat_template: lm.template.as_ref().map(|t| t.source()) }
    } else {
        Source::Hf(src)
    };
    write_folder(source, &lm.model, &opts, &a.out)?;
    print_line(&format!("wrote {} ({:.3} bits per weight over the matrices)", a.out.display(), bpw))
}

fn speed(a: SpeedArgs) -> eddy::Result<()> {
    if a.prompt_tokens == 0 {
        return Err(bad("-p/--prompt-tokens", "must be at least 1"));
    }
    if a.gen_tokens == 1 {
        return Err(bad(
            "-n/--gen-tokens",
            "1 token gives no decode measurement (the first comes from the prefill): use 0 for prefill only or at least 2",
        ));
    }
    if a.repetitions == 0 {
        return Err(bad("-r/--repetitions", "must be at least 1"));
    }
    if a.verify_sizes.contains(&0) || a.verify_sizes.iter().any(|&n| n > 1024) {
        return Err(bad("--verify-sizes", "tree sizes must be 1..=1024 nodes"));
    }
    let (mut engine, threads) = engine_for(&a.model)?;
    // The drafter is loaded and checked against the model before the runs (its errors come first).
    let dflash = match a.draft_model.clone().or_else(|| find_next_to(&engine.lm.source)) {
        Some(dir) => {
            if !is_dflash_dir(&dir) {
                return Err(bad("--draft-model", format!("{}: eddy speed times a DFlash drafter folder; this is not one", dir.display())));
            }
            let mut d = DFlashDrafter::load(&dir, Quant::Q8)?;
            d.bind(&engine.lm.model)?;
            Some((dir, d))
        }
        None => None,
    };
    // A run samples at least one token after its prompt (the prefill's), also with -n 0.
    if a.prompt_tokens + 1 > engine.ctx() {
        return Err(bad(
            "--ctx",
            format!(
                "-p {} tokens do not fit in the context of {} tokens (a run samples one token after the prompt)",
                a.prompt_tokens,
                engine.ctx()
            ),
        ));
    }
    // The decode test's prompt: the depth, at least one token (the first generated token is the prefill's).
    let tg_prompt_tokens = a.depth.max(1);
    if a.gen_tokens > 1 && tg_prompt_tokens + a.gen_tokens > engine.ctx() {
        return Err(bad(
            "--ctx",
            format!(
                "-d {} + -n {} tokens do not fit in the context of {} tokens (the decode test's prompt is max(d, 1) tokens)",
                a.depth,
                a.gen_tokens,
                engine.ctx()
            ),
        ));
    }
    if let Some(&largest) = a.verify_sizes.iter().max() {
        if a.prompt_tokens == 0 || a.prompt_tokens + largest > engine.ctx() {
            return Err(bad(
                "--verify-sizes",
                format!(
                    "the verify timing needs a prompt (-p ≥ 1) and room for it plus a tree of {largest} nodes: -p {} in a context of {}",
                    a.prompt_tokens,
                    engine.ctx()
                ),
            ));
        }
    }
    let vocab = engine.lm.tokenizer.vocab_size().min(engine.lm.model.config.vocab_size) as u64;
    // Deterministic pseudo-random prompt (as llama-bench uses random tokens), avoiding the first 256 ids
    // (bytes and special tokens) when the vocabulary is large enough.
    let (lo, span) = if vocab > 512 { (256, vocab - 256) } else { (0, vocab.max(1)) };
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let tokens: Vec<u32> = (0..a.prompt_tokens.max(tg_prompt_tokens))
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (lo + x % span) as u32
        })
        .collect();
    let prompt = &tokens[..a.prompt_tokens];
    let tg_prompt = &tokens[..tg_prompt_tokens];
    let params = |n: usize| GenerateParams { max_tokens: n, sampler: SamplerParams::default(), ignore_eos: true, logprobs: None };
    // One run gives both lines when the decode starts where the prefill test ends (-d equal to -p).
    let shared = a.depth == a.prompt_tokens;
    let (mut pp, mut tg) = (Vec::new(), Vec::new());
    for _ in 0..a.repetitions {
        // Every run prefills its whole prompt (no prefix-cache reuse).
        engine.clear_cache();
        let s = engine.generate(prompt, &params(if shared { a.gen_tokens.max(1) } else { 1 }), &mut |_| true)?;
        pp.push(s.prefill_speed());
        if a.gen_tokens > 1 {
            let s = if shared {
                s
            } else {
                engine.clear_cache();
                engine.generate(tg_prompt, &params(a.gen_tokens), &mut |_| true)?
            };
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
    print_line(
        &serde_json::json!({"model": model, "test": format!("pp{}", a.prompt_tokens), "device": engine.device(), "threads": threads, "avg_ts": pm, "stddev_ts": ps})
            .to_string(),
    )?;
    if a.gen_tokens > 1 {
        print_line(
            &serde_json::json!({"model": model, "test": format!("tg{}", a.gen_tokens), "depth": a.depth, "device": engine.device(), "threads": threads,
                "avg_ts": tm, "stddev_ts": ts, "weight_bytes": engine.lm.model.weight_bytes()})
            .to_string(),
        )?;
    }
    if let Some((dir, d)) = dflash {
        let step = if tm > 0.0 { Some(1.0 / tm) } else { None };
        // At the decode test's context when one ran (so that its ratio compares passes over the same keys),
        // else at the prefill test's.
        let context = if a.gen_tokens > 1 { tg_prompt_tokens } else { a.prompt_tokens };
        let ms = engine.time_dflash_pass(d, context, a.repetitions.max(5))? * 1e3;
        let mut j = serde_json::json!({"model": model, "test": "dflash_pass", "drafter": dir.display().to_string(), "device": engine.device(),
            "threads": threads, "context": context, "ms": ms});
        if let Some(step) = step {
            j["vs_decode_step"] = serde_json::json!(ms / (step * 1e3));
        }
        print_line(&j.to_string())?;
    }
    if !a.verify_sizes.is_empty() {
        let times = engine.verify_times(prompt, &a.verify_sizes, a.repetitions.max(3))?;
        let one = times.iter().find(|t| t.0 == 1).map(|t| t.1);
        for (n, secs) in times {
            let mut j = serde_json::json!({"model": model, "test": format!("verify{n}"), "device": engine.device(), "threads": threads,
                "nodes": n, "ms": secs * 1e3});
            if let Some(one) = one {
                j["vs_one_node"] = serde_json::json!(secs / one);
                j["vs_sequential_decode"] = serde_json::json!(secs / (one * n as f64));
            }
            print_line(&j.to_string())?;
        }
    }
    Ok(())
}
