#!/usr/bin/env bash
# Speed of eddy's own formats against llama.cpp's nearest ones on the same model (issue 14's speed goals):
# eddy M (int4, `eddy quantize --format m`, the LM head in l) and the ≤ 5-bit recipe (m g32, the head in m g32,
# unrotated: README, `eddy quantize`) against llama.cpp's Q4_K_M, eddy L (int8) against Q8_0, and eddy on the
# Q4_K_M file itself (the GGUF path). One run, interleaved per pair, same thread count:
# prefill of 128 tokens (pp128) and decode of 64 (tg64) as llama-bench defines them; eddy's side is `eddy speed`.
#
# usage: bench/quant_speed.sh [GROUP]     (THREADS=2 REPS=3 by default; GROUP of eddy's formats, default 64)
# Builds the variants once into $WORK (default ~/.cache/eddy/quant-speed): eddy folders by `eddy quantize` from
# the Q4_K_M GGUF, Q8_0 by llama-quantize --allow-requantize from the same file (speed only: its quality is not
# measured here, bench/quant_quality.sh does that on grid-free sources).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
REPS=${REPS:-3}
GROUP=${1:-64}
WORK=${WORK:-$HOME/.cache/eddy/quant-speed}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
SRC=$MODELS_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

. bench/llama_cpp_env.sh
tools/fetch_models.sh qwen15 >&2
cargo build --release -q -p eddy-cli
EDDY=target/release/eddy
mkdir -p "$WORK"
for f in m l; do
  [ -d "$WORK/eddy-$f-g$GROUP" ] || $EDDY quantize --model "$SRC" --format $f --group "$GROUP" -o "$WORK/eddy-$f-g$GROUP" >&2
done
[ -d "$WORK/eddy-m-g32-recipe" ] || $EDDY quantize --model "$SRC" --format m --group 32 --head-format m --no-rotation \
  -o "$WORK/eddy-m-g32-recipe" >&2
[ -f "$WORK/q8_0.gguf" ] || "$LLAMA_BIN/llama-quantize" --allow-requantize "$SRC" "$WORK/q8_0.gguf" Q8_0 >&2

BW=$($EDDY bandwidth --threads "$THREADS")
echo "read bandwidth ($THREADS threads): $BW GB/s"
echo
echo "| pair | test | llama.cpp t/s | eddy t/s | eddy / llama.cpp | eddy weight bytes/token | eddy % of bandwidth limit |"
echo "|---|---|---|---|---|---|---|"
row() { # label, llama gguf, eddy model
  local lj ej
  lj=$("$LLAMA_BIN/llama-bench" -m "$2" -t "$THREADS" -p 128 -n 64 -r "$REPS" -o json 2>/dev/null)
  ej=$($EDDY speed --model "$3" --threads "$THREADS" -p 128 -n 64 -r "$REPS")
  python3 bench/speed_rows.py "$1" "$BW" "$lj" "$ej"
}
row "Q4_K_M vs eddy m g$GROUP" "$SRC" "$WORK/eddy-m-g$GROUP"
row "Q4_K_M vs eddy m g32 recipe (head m g32, unrotated)" "$SRC" "$WORK/eddy-m-g32-recipe"
row "Q8_0 vs eddy l g$GROUP" "$WORK/q8_0.gguf" "$WORK/eddy-l-g$GROUP"
row "Q4_K_M vs eddy on the Q4_K_M GGUF" "$SRC" "$SRC"
row "Q8_0 vs eddy on the Q8_0 GGUF" "$WORK/q8_0.gguf" "$WORK/q8_0.gguf"
