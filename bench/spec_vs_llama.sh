#!/usr/bin/env bash
# Speculative decoding on this machine, one script, one run (issue 4). Target Qwen2.5-Coder-1.5B-Instruct
# Q4_K_M, draft Qwen2.5-Coder-0.5B-Instruct; the first NUM HumanEval prompts and NUM ShareGPT first turns,
# chat, temperature 0, MAX_TOKENS tokens; `eddy bench` is the client of every server:
#   eddy serve plain | eddy serve --speculator suffix | eddy serve --speculator draft | eddy serve
#   --speculator auto (suffix + draft) (all with the auto budget) | llama-server plain | llama-server --spec-type draft-simple (n-max 4 and 8) |
#   llama-server --spec-type ngram-mod | with a DFlash drafter (DFLASH, default the trained one in the models
#   folder): eddy serve --speculator dflash (best-first tree) / dflash-chain / auto (suffix + dflash, what
#   eddy serve does by default when the drafter sits next to the model) | llama-server --spec-type
#   draft-dflash with the same drafter converted by llama.cpp's own converter (tools/dflash/to_llama_gguf.sh),
#   on a llama-server built with the one statement its qwen2 graph lacks for DFlash (bench/llama_cpp_dflash_env.sh)
# Then eddy's acceptance profile by depth (from /metrics, per dataset) and the verify-cost curve: one
# target pass over trees of 1..64 nodes vs that many decode steps.
#
# usage: bench/spec_vs_llama.sh   THREADS=2 NUM=20 MAX_TOKENS=256 PORT=8112 OUT=target/spec-bench
#        CONFIGS="eddy-plain eddy-suffix ... verify" runs a subset (a quick look; ratios are against
#        llama-plain when it ran, else against the first config).
#        DEVICE=cuda: both servers on the GPU (eddy serve --device cuda, its draft model on the GPU too;
#        llama-server -ngl 99 -fa on, its draft model -ngld 99); eddy's DFlash drafter runs on the GPU too.
#        On a machine prepared by hand (the lent GPU: no registry, no build): SETUP=0 skips fetching and
#        building, EDDY=path of the eddy binary, LLAMA_BIN=folder of llama-server (then not built either),
#        EDDY_MODELS / EDDY_DATA as usual (a ShareGPT file cut after its first conversations is enough).
#        TARGET=another GGUF of the same family (e.g. the 0.5B; then no draft model is smaller: drop the
#        draft configs).
set -euo pipefail
cd "$(dirname "$0")/.."
THREADS=${THREADS:-2}
NUM=${NUM:-20}
MAX_TOKENS=${MAX_TOKENS:-256}
PORT=${PORT:-8112}
OUT=${OUT:-target/spec-bench}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
TARGET=${TARGET:-$MODELS_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
DRAFT="$MODELS_DIR/qwen2.5-coder-0.5b-instruct.gguf"
DFLASH=${DFLASH:-$MODELS_DIR/dflash-qwen2.5-coder-1.5b}

DEVICE=${DEVICE:-cpu}
if [ -n "${LLAMA_BIN:-}" ]; then
  export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  . bench/llama_cpp_env.sh
fi
if [ "${SETUP:-1}" != 0 ]; then
  tools/fetch_models.sh qwen05 >&2
  tools/fetch_models.sh qwen15 >&2
  tools/fetch_datasets.sh >&2
  cargo build --release -q -p eddy-cli
fi
EDDY=${EDDY:-target/release/eddy}
mkdir -p "$OUT"

. bench/server_ctl.sh
CONFIGS=${CONFIGS:-eddy-plain eddy-suffix eddy-draft eddy-spec eddy-dflash eddy-dflash-chain eddy-dflash-auto llama-plain llama-draft4 llama-draft8 llama-ngram llama-dflash llama-dflash4 verify}
case " $CONFIGS " in *" eddy-dflash"* | *" llama-dflash"*)
  [ -f "$DFLASH/config.json" ] || { echo "DFlash drafter $DFLASH missing (set DFLASH or drop the dflash configs)" >&2; exit 1; } ;;
esac
run_server() { # label, command...
  local label=$1; shift
  case " $CONFIGS " in *" $label "*) ;; *) return 0 ;; esac
  "$@" > "$OUT/$label.log" 2>&1 &
  server_pid=$!
  wait_ready "$OUT/$label.log"
  for ds in humaneval sharegpt; do
    $EDDY bench --endpoint "http://127.0.0.1:$PORT/v1" --dataset $ds --num "$NUM" --max-tokens "$MAX_TOKENS" \
      --warmup 1 --label "$label" --out "$OUT/$label.$ds.json" >&2
    # cumulative counters after this dataset (the warm-up request included)
    curl -sf "http://127.0.0.1:$PORT/metrics" > "$OUT/$label.$ds.metrics" 2>/dev/null || true
  done
  stop_server
}

LS=("$LLAMA_BIN/llama-server" -m "$TARGET" -t "$THREADS" -c 4096 -np 1 --jinja --host 127.0.0.1 --port "$PORT")
ES=($EDDY serve --model "$TARGET" --threads "$THREADS" --ctx 4096 --port "$PORT" --device "$DEVICE")
LD=()  # llama-server's draft-model placement
if [ "$DEVICE" = cuda ]; then
  LS+=(-ngl 99 -fa on)
  LD=(-ngld 99)
fi
# Explicitly plain: eddy serve speculates by default when a DFlash drafter sits next to the model.
run_server eddy-plain "${ES[@]}" --speculator none
run_server eddy-suffix "${ES[@]}" --speculator suffix --spec-budget auto
run_server eddy-draft "${ES[@]}" --speculator draft --draft-model "$DRAFT" --spec-budget auto
run_server eddy-spec "${ES[@]}" --speculator auto --draft-model "$DRAFT" --spec-budget auto
run_server llama-plain "${LS[@]}"
run_server llama-draft4 "${LS[@]}" --spec-type draft-simple -md "$DRAFT" --spec-draft-n-max 4 -td "$THREADS" "${LD[@]}"
run_server llama-draft8 "${LS[@]}" --spec-type draft-simple -md "$DRAFT" --spec-draft-n-max 8 -td "$THREADS" "${LD[@]}"
run_server llama-ngram "${LS[@]}" --spec-type ngram-mod
run_server eddy-dflash "${ES[@]}" --speculator dflash --draft-model "$DFLASH" --spec-budget auto
run_server eddy-dflash-chain "${ES[@]}" --speculator dflash-chain --draft-model "$DFLASH" --spec-budget auto
run_server eddy-dflash-auto "${ES[@]}" --speculator auto --draft-model "$DFLASH" --spec-budget auto
case " $CONFIGS " in *" llama-dflash"*)
  DFLASH_GGUF="$OUT/dflash-drafter.gguf"
  [ -f "$DFLASH_GGUF" ] || tools/dflash/to_llama_gguf.sh "$DFLASH" "$TARGET" "$DFLASH_GGUF" >&2
  # llama.cpp 11434's qwen2 graph does not expose the layer inputs DFlash reads: a one-statement patched build
  # (bench/llama_cpp_dflash_env.sh says why and what).
  . bench/llama_cpp_dflash_env.sh
  LS[0]="$LLAMA_DFLASH_BIN/llama-server" ;;
esac
run_server llama-dflash "${LS[@]}" --spec-type draft-dflash -md "${DFLASH_GGUF:-}" --spec-draft-n-max 15 -td "$THREADS" "${LD[@]}"
# n-max 15 is the drafter's block; on a CPU verifying 16 tokens costs several decode steps, so also 4.
run_server llama-dflash4 "${LS[@]}" --spec-type draft-dflash -md "${DFLASH_GGUF:-}" --spec-draft-n-max 4 -td "$THREADS" "${LD[@]}"

rm -f "$OUT/verify.jsonl"
case " $CONFIGS " in *" verify "*)
  # -n 16: a decode step to set the DFlash pass against (the dflash_pass line, when the drafter exists).
  dflash_arg=(); [ -f "$DFLASH/config.json" ] && dflash_arg=(--draft-model "$DFLASH")
  $EDDY speed --model "$TARGET" --device "$DEVICE" --threads "$THREADS" -p 256 -n 16 -r 3 --verify-sizes 1,2,3,4,6,8,12,16,24,32,48,64 "${dflash_arg[@]}" > "$OUT/verify.jsonl" ;;
esac

python3 - "$OUT" "$NUM" "$MAX_TOKENS" "$THREADS" "$CONFIGS" "$DEVICE" "$(basename "$TARGET")" <<'PY'
import json, os, re, sys
out, num, max_tokens, threads, configs, device, target = sys.argv[1:]
labels = [l for l in configs.split() if os.path.exists(f"{out}/{l}.humaneval.json")]
names = {"eddy-plain": "eddy serve, no speculation", "eddy-suffix": "eddy serve --speculator suffix",
         "eddy-draft": "eddy serve --speculator draft (0.5B draft)", "eddy-spec": "eddy serve --speculator auto (suffix + 0.5B draft)",
         "llama-plain": "llama-server", "llama-draft4": "llama-server draft-simple 0.5B, n-max 4",
         "llama-draft8": "llama-server draft-simple 0.5B, n-max 8", "llama-ngram": "llama-server ngram-mod",
         "eddy-dflash": "eddy serve --speculator dflash (best-first tree)", "eddy-dflash-chain": "eddy serve --speculator dflash-chain",
         "eddy-dflash-auto": "eddy serve --speculator auto (suffix + dflash tree)", "llama-dflash": "llama-server draft-dflash, n-max 15",
         "llama-dflash4": "llama-server draft-dflash, n-max 4"}
where = "on the GPU (eddy --device cuda; llama.cpp -ngl 99 -fa on)" if device == "cuda" else f"{threads} threads"
print(f"{target}, {num} prompts per set, chat, temperature 0, max_tokens {max_tokens}, {where}\n")
for ds in ["humaneval", "sharegpt"]:
    R = {l: json.load(open(f"{out}/{l}.{ds}.json")) for l in labels}
    base = R["llama-plain" if "llama-plain" in R else labels[0]]["summary"]["decode_tps"]["median"]
    eplain = R["eddy-plain"]["summary"]["decode_tps"]["median"] if "eddy-plain" in R else None
    print(f"**{ds}**\n")
    print("| server | decode tok/s median (p10–p90) | vs llama-server plain | vs eddy plain | tokens/pass | TTFT s median |")
    print("|---|---|---|---|---|---|")
    for l in labels:
        s = R[l]["summary"]
        d = s["decode_tps"]
        tpp = s.get("tokens_per_pass", {}).get("median") if isinstance(s.get("tokens_per_pass"), dict) else None
        tpp = f"{tpp:.2f}" if tpp else "–"
        vs_e = f"{d['median']/eplain:.2f}×" if eplain else "–"
        print(f"| {names[l]} | {d['median']:.1f} ({d['p10']:.1f}–{d['p90']:.1f}) | {d['median']/base:.2f}× | {vs_e} | {tpp} | {s['ttft_s']['median']:.2f} |")
    print()
def depth_counts(path):
    acc, prop = {}, {}
    if not os.path.exists(path):
        return acc, prop
    for line in open(path):
        m = re.match(r'eddy_spec_(accepted|proposed)_at_depth_total\{depth="(\d+)"\} (\d+)', line)
        if m:
            (acc if m[1] == "accepted" else prop)[int(m[2])] = int(m[3])
    return acc, prop
spec = [l for l in labels if l.startswith("eddy-") and l != "eddy-plain"]
if spec:
    print("**eddy acceptance by depth** (verify passes whose tree reached depth d, and the share of them that accepted at least d draft tokens)\n")
    print("| server | dataset | " + " | ".join(f"d={d}" for d in range(1, 16)) + " |")
    print("|---|---|" + "---|" * 15)
    for l in spec:
        prev = ({}, {})
        for ds in ["humaneval", "sharegpt"]:
            acc, prop = depth_counts(f"{out}/{l}.{ds}.metrics")
            cells = []
            for d in range(1, 16):
                p = prop.get(d, 0) - prev[1].get(d, 0)
                a = acc.get(d, 0) - prev[0].get(d, 0)
                cells.append(f"{a/p:.2f} ({p})" if p else "–")
            print(f"| {l} | {ds} | " + " | ".join(cells) + " |")
            prev = (acc, prop)
    print()
if not os.path.exists(f"{out}/verify.jsonl"):
    sys.exit(0)
print("**verify cost** (one target pass over a tree of n nodes after a 256-token prompt)\n")
print("| nodes | ms | vs 1 node | vs n sequential decode steps |")
print("|---|---|---|---|")
dflash = None
for line in open(f"{out}/verify.jsonl"):
    j = json.loads(line)
    if j.get("test", "").startswith("verify"):
        print(f"| {j['nodes']} | {j['ms']:.1f} | {j['vs_one_node']:.2f} | {j['vs_sequential_decode']:.2f} |")
    elif j.get("test") == "dflash_pass":
        dflash = j
if dflash:
    print(f"\n**DFlash draft pass** (context 256): {dflash['ms']:.1f} ms = {dflash.get('vs_decode_step', float('nan')):.2f} of a decode step")
PY
