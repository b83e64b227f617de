#!/usr/bin/env bash
# Stage a training lease (no llama.cpp: gen.py regenerates on the GPU with PyTorch) as pieces that fit one
# device call each, under REPO/.devcarry/t2/pNN (REPO = the checkout the device tool sends):
#
#   tools/dflash/train_stage.sh REPO PROMPTS_DIR INIT_DRAFTER DRAFT_VOCAB [PIECE_BYTES]
#
#   p00        gen.py, train.py, train_pipeline.sh, collect_train.sh, the gguf wheel, the training prompts,
#              the committed responses (tools/dflash/data/1.5b-*.jsonl.gz) and their prompt ids, the draft
#              vocabulary, the starting drafter (config.json; its weights start the piece stream)
#   p01 .. pN  the rest of the starting drafter's model.safetensors, then the 1.5B GGUF
# Device calls, back to back (the machine is given back 30 s after a call):
#   carry [".devcarry/t2/pNN"]  command: mkdir -p /tmp/stage && mv .devcarry/t2/pNN/* /tmp/stage/
# after the last piece:  bash /tmp/stage/join.sh   (reassembles both files, checks sha256)
set -euo pipefail
REPO=$1
PROMPTS=$2
INIT=$3
VOCAB=$4
HERE=$(cd "$(dirname "$0")" && pwd)
M=~/.cache/eddy/models
GGUF=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
DEV=${DEVICE_SHARED:-/work/shared/device}
grep -qx '/.devcarry/' "$REPO/.git/info/exclude" 2>/dev/null || { mkdir -p "$REPO/.git/info"; echo '/.devcarry/' >> "$REPO/.git/info/exclude"; }
D=$REPO/.devcarry/${STAGE_NAME:-t2}  # STAGE_NAME: the folder under .devcarry (one per helper)
rm -rf "$D" && mkdir -p "$D/p00"
tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
piece=${5:-$(( 67108864 - tree - 6000000 ))}
echo "checkout $tree bytes; pieces of $piece bytes"
cp "$HERE"/gen.py "$HERE"/train.py "$HERE"/train_pipeline.sh "$HERE"/collect_train.sh "$D/p00/"
cp "$DEV"/wheels/gguf-*.whl "$D/p00/"
gzip -c "$PROMPTS/prompts_train.jsonl" > "$D/p00/prompts_train.jsonl.gz"
# every committed set of regenerated responses (tools/dflash/data/1.5b-*.jsonl.gz) travels; gen.py answers
# the prompts none of them answered first
zcat "$HERE"/data/1.5b-*.jsonl.gz | python3 -c 'import json,sys; [print(json.loads(l)["id"]) for l in sys.stdin]' > "$D/p00/used_ids.txt"
python3 - "$HERE/heldout_1.5b.json" "$D/p00/heldout.jsonl" <<'PY'
import json, sys
with open(sys.argv[2], "w") as f:
    for r in json.load(open(sys.argv[1])):
        f.write(json.dumps(r, separators=(",", ":")) + "\n")
PY
mkdir -p "$D/p00/data" && cp "$HERE"/data/1.5b-*.jsonl.gz "$D/p00/data/"
cp "$VOCAB" "$D/p00/draft_vocab.json"
cp "$INIT/config.json" "$D/p00/init-config.json"
cat > "$D/p00/join.sh" <<'J'
#!/usr/bin/env bash
# join.sh: reassemble the staged files from their parts and check them against the manifest
set -euo pipefail
cd /tmp/stage
for f in init-model.safetensors qwen2.5-coder-1.5b-instruct-q4_k_m.gguf; do
  cat $(ls "$f".part* | sort) > "$f" && rm -f "$f".part*
done
sha256sum -c manifest.txt
J
(cd "$INIT" && echo "$(sha256sum model.safetensors | cut -d' ' -f1)  init-model.safetensors") > "$D/p00/manifest.txt"
echo "$(sha256sum "$M/$GGUF" | cut -d' ' -f1)  $GGUF" >> "$D/p00/manifest.txt"
# one stream of pieces: the drafter's weights, then the GGUF
n=0
room=$(( piece - $(du -cb "$D/p00" | tail -1 | cut -f1) ))
for pair in "$INIT/model.safetensors:init-model.safetensors" "$M/$GGUF:$GGUF"; do
  src=${pair%%:*}; name=${pair##*:}
  size=$(stat -c %s "$src"); off=0; k=0
  while [ $off -lt $size ]; do
    if [ $room -le 0 ]; then n=$((n + 1)); mkdir -p "$(printf '%s/p%02d' "$D" $n)"; room=$piece; fi
    take=$(( size - off < room ? size - off : room ))
    dd if="$src" of="$(printf '%s/p%02d/%s.part%03d' "$D" $n "$name" $k)" bs=1M iflag=skip_bytes,count_bytes \
      skip=$off count=$take status=none
    off=$((off + take)); room=$((room - take)); k=$((k + 1))
  done
done
echo "last piece: p$(printf %02d $n)"
du -sb "$D"/p* | awk '{printf "%s %d  ", $2, $1} END {print ""}' | sed "s|$D/||g"
