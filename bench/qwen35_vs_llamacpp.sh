#!/usr/bin/env bash
# Qwen3.5 0.8B shape (the seeded synthetic model; no real Qwen3.5 weights are available here): eddy vs
# llama.cpp on the same GGUF files. eddy exports the f32 GGUF from the safetensors folder, llama.cpp's own
# llama-quantize makes Q4_K_M and Q8_0 from it, so both engines read identical files. Per file: pp128 and
# tg32 (REPS repetitions), and for Q4_K_M also pp512 and pp4096 (LONG_REPS, default 1: pp4096 takes minutes).
# Rows alternate llama.cpp / eddy per test so both see the same machine state.
#
# usage: bench/qwen35_vs_llamacpp.sh   (THREADS=2 REPS=3 LONG_REPS=1)
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
REPS=${REPS:-3}
LONG_REPS=${LONG_REPS:-1}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
F32="$MODELS_DIR/qwen35-0.8b-synthetic.gguf"

. bench/llama_cpp_env.sh
tools/fetch_models.sh qwen35 >&2
cargo build --release -q -p eddy-cli
EDDY=target/release/eddy
if [ ! -f "$F32" ]; then
  cargo test --release -q -p eddy --test qwen35 export_08b_gguf -- --ignored >&2
fi
for q in Q4_K_M Q8_0; do
  [ -f "$MODELS_DIR/qwen35-0.8b-synthetic-$q.gguf" ] ||
    "$LLAMA_BIN/llama-quantize" "$F32" "$MODELS_DIR/qwen35-0.8b-synthetic-$q.gguf" "$q" >/dev/null 2>&1
done

BW=$($EDDY bandwidth --threads "$THREADS")
echo "read bandwidth ($THREADS threads): $BW GB/s"
echo
echo "| file | test | llama.cpp t/s | eddy t/s | eddy / llama.cpp | eddy weight bytes/token | eddy % of bandwidth limit |"
echo "|---|---|---|---|---|---|---|"
row() { # label file p n reps
  local lj ej
  lj=$("$LLAMA_BIN/llama-bench" -m "$2" -t "$THREADS" -p "$3" -n "$4" -r "$5" -o json 2>/dev/null)
  ej=$($EDDY speed --model "$2" --threads "$THREADS" --ctx $(($3 + $4 + 8)) -p "$3" -n "$4" -r "$5")
  python3 bench/speed_rows.py "$1" "$BW" "$lj" "$ej"
}
for q in Q4_K_M Q8_0; do
  row "$q" "$MODELS_DIR/qwen35-0.8b-synthetic-$q.gguf" 128 32 "$REPS"
done
row Q4_K_M "$MODELS_DIR/qwen35-0.8b-synthetic-Q4_K_M.gguf" 512 0 "$LONG_REPS"
row Q4_K_M "$MODELS_DIR/qwen35-0.8b-synthetic-Q4_K_M.gguf" 4096 0 "$LONG_REPS"
