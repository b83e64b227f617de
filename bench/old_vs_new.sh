#!/usr/bin/env bash
# Old build against new build, same machine, same run (a refactor must not be slower): `eddy speed` on each
# model, the two binaries alternated ROUNDS times (old, new, old, new, ...) so both see the same machine
# state; prints per model and test the median t/s of each and new / old. Ratios, not absolute speeds, are
# what this measures; run it on a quiet machine for a verdict within a few percent.
#
# usage: bench/old_vs_new.sh OLD_EDDY NEW_EDDY MODEL [MODEL ...]
#        (THREADS=2 ROUNDS=5 P=128 N=64 REPS=2; EXTRA="--quant q4" adds arguments to every `eddy speed`)
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 OLD_EDDY NEW_EDDY MODEL [MODEL ...]" >&2; exit 2; }
OLD=$1 NEW=$2
shift 2
THREADS=${THREADS:-2}
ROUNDS=${ROUNDS:-5}
P=${P:-128}
N=${N:-64}
REPS=${REPS:-2}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for model in "$@"; do
  for r in $(seq "$ROUNDS"); do
    for which in old new; do
      bin=$OLD
      [ "$which" = new ] && bin=$NEW
      "$bin" speed --model "$model" ${EXTRA:-} --threads "$THREADS" --ctx $((P + N + 8)) -p "$P" -n "$N" -r "$REPS" |
        sed "s|^{|{\"build\":\"$which\",\"round\":$r,|" >>"$out"
    done
  done
done
python3 - "$out" <<'EOF'
import json, statistics, sys
rows = [r for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()) if "avg_ts" in r]
print("| model | test | old t/s (median) | new t/s (median) | new / old | per-round new/old (min–max) |")
print("|---|---|---|---|---|---|")
keys = sorted({(r["model"], r["test"]) for r in rows}, key=lambda k: (k[0], k[1][:2] != "pp", k[1]))
for m, t in keys:
    sel = [r for r in rows if r["model"] == m and r["test"] == t]
    old = {r["round"]: r["avg_ts"] for r in sel if r["build"] == "old"}
    new = {r["round"]: r["avg_ts"] for r in sel if r["build"] == "new"}
    per = [new[k] / old[k] for k in old if k in new]
    mo, mn = statistics.median(old.values()), statistics.median(new.values())
    name = m.rstrip("/").split("/")[-1]
    print(f"| {name} | {t} | {mo:.1f} | {mn:.1f} | **{mn / mo:.3f}** | {min(per):.3f}–{max(per):.3f} |")
EOF
