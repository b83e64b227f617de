#!/usr/bin/env bash
# Stage everything the DFlash pipeline needs on the GPU machine as pieces that fit one device call each.
# A device call sends the session's checkout plus at most 64 MiB of carried, git-ignored paths, so this cuts
# the inputs into pieces under REPO/.devcarry/dft/pNN (REPO = the checkout the device tool sends):
#
#   tools/dflash/stage.sh REPO PROMPTS_DIR
#
#   p00            scripts, prompts, gguf wheel, llama-cpp-cuda-sm90.tgz, and the start of the 1.5B GGUF
#   p01 .. pK      the rest of the 1.5B GGUF               (K printed at the end)
#   pK+1 .. pN     the 0.5B GGUF
# Device calls, back to back (the machine stays warm 30 s after a call):
#   carry [".devcarry/dft/pNN"]  command: mkdir -p /tmp/stage && mv .devcarry/dft/pNN/* /tmp/stage/
# after the last piece of a GGUF:  bash /tmp/stage/join.sh NAME   (reassembles, checks sha256)
set -euo pipefail
REPO=$1
PROMPTS=$2
HERE=$(cd "$(dirname "$0")" && pwd)
M=~/.cache/eddy/models
DEV=${DEVICE_SHARED:-/work/shared/device}
grep -qx '/.devcarry/' "$REPO/.git/info/exclude" 2>/dev/null || { mkdir -p "$REPO/.git/info"; echo '/.devcarry/' >> "$REPO/.git/info/exclude"; }
D=$REPO/.devcarry/dft
rm -rf "$D" && mkdir -p "$D"
tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
piece=$(( 67108864 - tree - 2500000 ))
echo "checkout $tree bytes; pieces of $piece bytes"
tmp=$(mktemp -d)
# the small files travel whole in p00
mkdir -p "$D/p00"
cp "$HERE"/regen.py "$HERE"/train.py "$HERE"/pipeline.sh "$HERE"/collect.sh "$D/p00/"
cp "$DEV"/wheels/gguf-*.whl "$DEV"/llama-cpp-cuda-sm90.tgz "$D/p00/"
gzip -c "$PROMPTS/prompts_train.jsonl" > "$D/p00/prompts_train.jsonl.gz"
cp "$PROMPTS/prompts_heldout.jsonl" "$D/p00/"
cat > "$D/p00/join.sh" <<'J'
#!/usr/bin/env bash
# join.sh NAME: reassemble /tmp/stage/NAME from its parts and check it against the manifest
set -euo pipefail
cd /tmp/stage
cat $(ls "$1".part* | sort) > "$1" && rm -f "$1".part*
grep " $1\$" manifest.txt | sha256sum -c -
J
: > "$D/p00/manifest.txt"
used=$(du -cb "$D/p00" | tail -1 | cut -f1)
n=0
first=$(( piece - used ))
for f in qwen2.5-coder-1.5b-instruct-q4_k_m.gguf qwen2.5-coder-0.5b-instruct.gguf; do
  echo "$(sha256sum "$M/$f" | cut -d' ' -f1)  $f" >> "$D/p00/manifest.txt"
  size=$(stat -c %s "$M/$f")
  off=0; k=0
  if [ "$f" = qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ]; then  # fill p00 first
    dd if="$M/$f" of="$D/p00/$f.part000" bs=1M iflag=count_bytes count=$first status=none
    off=$first; k=1
  fi
  while [ $off -lt $size ]; do
    n=$((n + 1)); p=$(printf '%s/p%02d' "$D" $n); mkdir -p "$p"
    dd if="$M/$f" of="$p/$(printf '%s.part%03d' "$f" $k)" bs=1M iflag=skip_bytes,count_bytes skip=$off count=$piece status=none
    off=$((off + piece)); k=$((k + 1))
  done
  echo "$f: last piece p$(printf %02d $n)"
done
du -sh "$D"/p* | tr '\n' ' '; echo
