#!/usr/bin/env bash
# Rejoin the pieces a device call brought back (collect.sh's /tmp/ret/TAG.tar.NN and their .sha256), check
# them, install the drafter and write the held-out samples:
#
#   tools/dflash/unpack.sh PIECES_DIR TAG        TAG = 1.5b | 0.5b
#
#   ~/.cache/eddy/models/dflash-qwen2.5-coder-TAG/   config.json, model.safetensors (bf16), metrics.json,
#                                                    draft_vocab.json
#   tools/dflash/heldout_TAG.json                    the held-out sequences the target generated greedily
#                                                    (benchmark prompts): [{id, src, prompt_ids, response_ids}]
set -euo pipefail
P=$1
TAG=$2
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${EDDY_MODELS:-$HOME/.cache/eddy/models}/dflash-qwen2.5-coder-$TAG
tmp=$(mktemp -d)
cat $(ls "$P/$TAG".tar.[0-9][0-9] | sort) > "$tmp/$TAG.tar"
(cd "$tmp" && sha256sum -c "$P/$TAG.tar.sha256")
tar xf "$tmp/$TAG.tar" -C "$tmp"
rm -rf "$DEST" && mkdir -p "$(dirname "$DEST")" && cp -r "$tmp/$TAG-hf" "$DEST"
python3 - "$tmp/heldout.jsonl" "$HERE/heldout_$TAG.json" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
rows.sort(key=lambda r: (r["src"], int(r["id"].split("/")[-1])))
out = [{k: r[k] for k in ("id", "src", "prompt_ids", "response_ids")} for r in rows]
with open(sys.argv[2], "w") as f:
    json.dump(out, f, separators=(",", ":"))
print(f"{sys.argv[2]}: {len(out)} sequences")
PY
cp "$tmp/train.log" "$tmp/regen.log" "$P/" 2>/dev/null || true
(cd "$DEST" && sha256sum config.json model.safetensors)
rm -rf "$tmp"
