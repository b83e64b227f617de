//! Resolving `--model` to files and loading model, tokenizer and chat template.
//!
//! A model is named by a GGUF file path, a Hugging Face model folder (loaded by [`crate::model_dir`]), or a
//! hub id `org/name` (downloaded with hf-hub into the standard Hugging Face cache; `HF_HOME` and
//! `HF_HUB_OFFLINE` are honoured, `EDDY_OFFLINE` as well): a repository with `.gguf` files gives its GGUF (preferring Q4_K_M), any
//! other its safetensors folder (`config.json`, tokenizer files, chat template, `model.safetensors` or the
//! index and its shards). Without a name, the default model (Qwen2.5-Coder-0.5B-Instruct GGUF, fetched by
//! `tools/fetch_models.sh`) is used.

use crate::chat::ChatTemplate;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::model_dir::{self, Quant};
use crate::models::Model;
use crate::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

/// File name of the default model inside the models folder.
pub const DEFAULT_MODEL_FILE: &str = "qwen2.5-coder-0.5b-instruct.gguf";

/// The temporary sibling an atomic write of `path` (a file or a folder) fills before renaming it to `path`:
/// `.NAME.tmp-PID` in the same folder, so the rename stays on one file system; a caller that handles signals
/// removes it when interrupted (the CLI's `eddy quantize` and `eddy perplexity --save-logits`).
pub fn temp_sibling(path: &Path) -> PathBuf {
    let name = path.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp-{}", std::process::id()))
}

/// The folder `tools/fetch_models.sh` fills: `$EDDY_MODELS`, else `$HOME/.cache/eddy/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("EDDY_MODELS") {
        return PathBuf::from(d);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/eddy/models")
}

/// Path of the default model, or an error saying how to fetch it.
pub fn default_model_path() -> Result<PathBuf> {
    let p = models_dir().join(DEFAULT_MODEL_FILE);
    if p.is_file() {
        Ok(p)
    } else {
        Err(Error::model(&p, "default model not found; fetch it with `tools/fetch_models.sh qwen05` (or pass --model)"))
    }
}

/// A model with its tokenizer and (optional) chat template.
pub struct LoadedModel {
    /// Weights and configuration.
    pub model: Model,
    /// Tokenizer.
    pub tokenizer: Tokenizer,
    /// The model's chat template, if it has one.
    pub template: Option<ChatTemplate>,
    /// Where it was loaded from.
    pub source: PathBuf,
}

/// Load the model named by `spec` (see the module docs); `progress(done, total)` reports tensor import.
///
/// `quant` applies to safetensors folders (see [`Quant`]); GGUF files are used as they are quantized, and
/// asking to quantize one is an [`Error::Input`].
pub fn load(spec: Option<&str>, quant: Quant, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedModel> {
    let path = match spec {
        None => default_model_path()?,
        Some(s) => resolve(s)?,
    };
    if path.is_dir() {
        if !path.join(model_dir::CONFIG_FILE).exists() {
            // A folder of GGUF files (e.g. the eddy models folder) is a likely mistake: name them.
            let mut ggufs: Vec<String> = std::fs::read_dir(&path)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".gguf"))
                .collect();
            ggufs.sort();
            if !ggufs.is_empty() {
                return Err(Error::model(
                    &path,
                    format!(
                        "a folder without config.json, not a Hugging Face model folder; it holds {}: pass the GGUF file itself",
                        ggufs.join(", ")
                    ),
                ));
            }
        }
        return load_dir(&path, quant, progress);
    }
    if quant != Quant::None {
        return Err(Error::Input(format!(
            "{}: --quant {quant} is for Hugging Face safetensors folders; a GGUF file is used as quantized (leave --quant out)",
            path.display()
        )));
    }
    load_gguf(&path, progress)
}

/// Turn a `--model` argument into a local path: an existing path as it is, else a hub id.
fn resolve(spec: &str) -> Result<PathBuf> {
    let p = Path::new(spec);
    if spec.trim().is_empty() {
        return Err(Error::Input("--model: empty (give a GGUF file, a model folder or a hub id org/name)".into()));
    }
    if p.exists() {
        return Ok(p.to_path_buf());
    }
    // A link to nothing is a path that is missing, not a hub id.
    if p.symlink_metadata().is_ok() {
        return Err(Error::model(p, "is a symbolic link to nothing (or a link loop)"));
    }
    let looks_like_hub_id = spec.matches('/').count() == 1
        && !spec.starts_with('.')
        && !spec.starts_with('/')
        && !spec.ends_with(".gguf")
        && spec.split('/').all(|s| !s.is_empty());
    if !looks_like_hub_id {
        return Err(Error::model(p, "no such file or directory"));
    }
    hub_download(spec)
}

/// Download (or find in the Hugging Face cache) a hub repository's model, honouring HF_HOME and
/// HF_HUB_OFFLINE: its GGUF file when it has one, else its safetensors folder (the snapshot directory).
/// A cached copy is used without touching the network.
fn hub_download(repo_id: &str) -> Result<PathBuf> {
    let cache = hf_hub::Cache::from_env();
    let repo_dir = cache.path().join(format!("models--{}", repo_id.replace('/', "--")));
    if let Some(p) = cached_gguf(&repo_dir) {
        return Ok(p);
    }
    if let Some(p) = cached_folder(&repo_dir) {
        return Ok(p);
    }
    let set = |k: &str| std::env::var(k).is_ok_and(|v| ["1", "true", "yes"].iter().any(|t| v.eq_ignore_ascii_case(t)));
    if let Some(k) = ["HF_HUB_OFFLINE", "EDDY_OFFLINE"].into_iter().find(|k| set(k)) {
        return Err(Error::model(
            repo_id,
            format!(
                "no such file or folder here, and as a hub id: {k} is set and the model is not in the Hugging Face cache ({})",
                cache.path().display()
            ),
        ));
    }
    let api = hf_hub::api::sync::ApiBuilder::from_cache(cache)
        .build()
        .map_err(|e| Error::model(repo_id, format!("cannot start the hub client: {e}")))?;
    let repo = api.model(repo_id.to_string());
    let info = repo.info().map_err(|e| {
        Error::model(repo_id, format!("no such file or folder here, and as a hub id the Hugging Face hub could not be asked: {e}"))
    })?;
    let files: Vec<String> = info.siblings.iter().map(|s| s.rfilename.clone()).collect();
    let get = |f: &str| repo.get(f).map_err(|e| Error::model(repo_id, format!("download of {f} failed: {e}")));
    if let Some(gguf) = files.iter().filter(|f| f.ends_with(".gguf")).min_by_key(|f| (!f.to_lowercase().contains("q4_k_m"), f.len())) {
        return get(gguf);
    }
    let has = |f: &str| files.iter().any(|x| x == f);
    if !has(model_dir::CONFIG_FILE) {
        return Err(Error::model(repo_id, "the repository has neither a .gguf file nor a config.json (not a model repository?)"));
    }
    if !has(model_dir::TOKENIZER_FILE) {
        return Err(Error::model(repo_id, "the repository has no tokenizer.json (eddy needs the fast-tokenizer file)"));
    }
    let config = get(model_dir::CONFIG_FILE)?;
    let dir = config.parent().map(Path::to_path_buf).unwrap_or_default();
    for f in [model_dir::TOKENIZER_FILE, model_dir::TOKENIZER_CONFIG_FILE, "chat_template.jinja", "chat_template.json"] {
        if has(f) {
            get(f)?;
        }
    }
    if has(model_dir::WEIGHTS_FILE) {
        get(model_dir::WEIGHTS_FILE)?;
    } else if has(model_dir::WEIGHTS_INDEX_FILE) {
        let index = get(model_dir::WEIGHTS_INDEX_FILE)?;
        for shard in model_dir::shard_files(&index)? {
            get(&shard)?;
        }
    } else {
        return Err(Error::model(repo_id, "the repository has no .gguf file and no model.safetensors (or its index)"));
    }
    Ok(dir)
}

/// A `.gguf` in any snapshot of a cached hub repository (`models--org--name/snapshots/<rev>/`).
fn cached_gguf(repo_dir: &Path) -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir(repo_dir.join("snapshots"))
        .ok()?
        .flatten()
        .flat_map(|snap| std::fs::read_dir(snap.path()).into_iter().flatten().flatten())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "gguf"))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// A complete safetensors snapshot of a cached hub repository: the one `refs/main` names if complete,
/// else the first complete one in name order.
fn cached_folder(repo_dir: &Path) -> Option<PathBuf> {
    let snapshots = repo_dir.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo_dir.join("refs/main")) {
        let p = snapshots.join(rev.trim());
        if !rev.trim().is_empty() && model_dir::is_complete_dir(&p) {
            return Some(p);
        }
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&snapshots).ok()?.flatten().map(|e| e.path()).collect();
    dirs.sort();
    dirs.into_iter().find(|d| model_dir::is_complete_dir(d))
}

/// Load model, tokenizer and chat template from one GGUF file.
pub fn load_gguf(path: &Path, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedModel> {
    let g = GgufFile::open(path)?;
    crate::models::config_from_gguf(&g)?; // unknown architecture: say so before anything else
    let tokenizer = Tokenizer::from_gguf(&g)?;
    let model = Model::from_gguf(&g, progress)?;
    if tokenizer.vocab_size() > model.config.vocab_size {
        return Err(Error::model(
            path,
            format!("tokenizer has {} tokens but the embedding only {} rows", tokenizer.vocab_size(), model.config.vocab_size),
        ));
    }
    let template = ChatTemplate::from_gguf(&g, &tokenizer)?;
    Ok(LoadedModel { model, tokenizer, template, source: path.to_path_buf() })
}

/// Load model, tokenizer and chat template from a Hugging Face folder; `progress(done, total)` is called
/// as tensors are imported.
///
/// Errors ([`Error::Model`] naming the file at fault): missing or malformed `config.json`, unknown
/// `model_type`, unsupported settings, missing weights, tensors that are missing, of the wrong shape or of
/// an unsupported dtype, missing `tokenizer.json`, a tokenizer larger than the embedding.
pub fn load_dir(dir: &Path, quant: Quant, progress: &mut dyn FnMut(usize, usize)) -> Result<LoadedModel> {
    let tok_path = dir.join(model_dir::TOKENIZER_FILE);
    let tok_cfg = dir.join(model_dir::TOKENIZER_CONFIG_FILE);
    if !crate::models::qwen35::is_qwen35_dir(dir) {
        // A bad config.json is reported before a missing tokenizer.
        crate::models::hf::read_config(dir)?;
    }
    if !tok_path.is_file() {
        return Err(Error::model(&tok_path, "missing: eddy needs the fast-tokenizer file tokenizer.json"));
    }
    let model = crate::models::hf::load_model(dir, quant, progress)?;
    let tokenizer = Tokenizer::from_file(&tok_path, tok_cfg.is_file().then_some(tok_cfg.as_path()))?;
    if tokenizer.vocab_size() > model.config.vocab_size {
        return Err(Error::model(
            &tok_path,
            format!("tokenizer has {} tokens but the embedding only {} rows", tokenizer.vocab_size(), model.config.vocab_size),
        ));
    }
    let template = ChatTemplate::from_dir(dir, &tokenizer)?;
    Ok(LoadedModel { model, tokenizer, template, source: dir.to_path_buf() })
}
