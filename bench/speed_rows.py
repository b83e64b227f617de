"""Table rows for the vs-llama.cpp scripts: `python3 bench/speed_rows.py LABEL BANDWIDTH_GBs LLAMA_JSON EDDY_JSONL`.

LLAMA_JSON is `llama-bench -o json` output, EDDY_JSONL the JSON lines of `eddy speed`. One Markdown row per
test both measured: t/s of each, the ratio, and for decode rows eddy's weight bytes per token and its speed as a
share of the bandwidth limit (bandwidth / weight bytes)."""
import json
import sys

label, bw, lj, ej = sys.argv[1], float(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4]
llama = {("pp%d" % r["n_prompt"] if r["n_prompt"] else "tg%d" % r["n_gen"]): r["avg_ts"] for r in lj}
for e in (json.loads(l) for l in ej.splitlines() if l.strip()):
    t = e["test"]
    if t not in llama:
        continue
    if t.startswith("tg"):
        wb = e["weight_bytes"]
        limit = bw * 1e9 / wb
        extra = f"{wb/1e6:.0f} MB | {100*e['avg_ts']/limit:.0f}% (limit {limit:.1f} t/s)"
    else:
        extra = "| "
    print(f"| {label} | {t} | {llama[t]:.1f} | {e['avg_ts']:.1f} | {e['avg_ts']/llama[t]:.2f} | {extra} |")
