#!/usr/bin/env bash
# The quality run of eddy's own formats against llama.cpp's (BENCHMARKS.md, "eddy quantize vs
# llama-quantize"). For each model:
#   1. a grid-free F16 source: the real GGUF dequantized, uniform noise of +-half the source's quantization
#      step per block of 32 added (tools/make_gridfree_gguf.py), written as F16 GGUF; its own KL against the
#      original is measured;
#   2. the source quantized by llama-quantize (Q4_K_M, Q4_0, IQ4_XS, Q8_0) and by eddy quantize (EDDY_VARIANTS:
#      m g64 and m g32 at <= 5 bits per weight, with and without the rotation, with and without GPTQ on the
#      calibration text CALIB; m g128; l g64; mixed precision by --tensor-format; k everywhere, and k with k6
#      for k/v/q/o and 22 ffn_down);
#   3. every variant scored by the same tool against the same source on held-out text:
#      eddy perplexity --kl-base SRC_LOGITS --ctx 512 (the source's logits saved once with --save-logits).
#      eddy cannot load IQ4_XS: that one is dequantized exactly to an F32 GGUF by gguf-py first (run with f32
#      weights and f32 activations, where the other variants use int8 activations: a small advantage).
#   4. bits per weight of every variant: bytes of all 2-D weight tensors (codes, scales, offsets, signs)
#      x 8 / their element count, embedding and LM head included.
# Every variant file is deleted once measured (disk); results go to $OUT/results/*.json and a table to stdout.
#
# usage: nice bench/quant_quality.sh [q15] [q05]     (default both; reruns skip finished results)
# env: QUANT_DIR (default ~/.cache/eddy/quant-quality), QUANT_VENV (a venv with gguf and numpy; created
#      with `pip install gguf==0.19.0 numpy` when missing), TEXT (held-out text; default the first 8500
#      bytes of CPython's Lib/fractions.py, ~2k tokens), CALIB (calibration text for --calib; default the
#      first 10000 bytes of CPython's Lib/argparse.py, ~2.2k tokens), EDDY_VARIANTS ("NAME|FLAGS ...", % for a space in FLAGS),
#      EDDY (default target/release/eddy), THREADS (2), LLAMA_TYPES (default "Q4_K_M Q4_0 IQ4_XS Q8_0"),
#      EDDY_WHOLE and EDDY_MIXES (mixed recipes assembled from whole-format folders, see the end of the loop).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${QUANT_DIR:-$HOME/.cache/eddy/quant-quality}
EDDY=${EDDY:-target/release/eddy}
THREADS=${THREADS:-2}
MODELS_DIR=${EDDY_MODELS:-$HOME/.cache/eddy/models}
QUANT_VENV=${QUANT_VENV:-$HOME/.cache/eddy/quant-venv}
mkdir -p "$OUT/results"
[ -x "$EDDY" ] || cargo build --release -p eddy-cli
if ! "$QUANT_VENV/bin/python" -c "import gguf, numpy" 2>/dev/null; then
  python3 -m venv "$QUANT_VENV"
  "$QUANT_VENV/bin/pip" install -q --disable-pip-version-check gguf==0.19.0 numpy
fi
PY="$QUANT_VENV/bin/python"
# shellcheck source=bench/llama_cpp_env.sh
source bench/llama_cpp_env.sh
TEXT=${TEXT:-$OUT/heldout.txt}
CALIB=${CALIB:-$OUT/calib.txt}
if [ ! -s "$CALIB" ]; then
  src=$(python3 -c "import argparse; print(argparse.__file__)")
  head -c 10000 "$src" >"$CALIB"
fi
if [ ! -s "$TEXT" ]; then
  src=$(python3 -c "import fractions; print(fractions.__file__)")
  head -c 8500 "$src" >"$TEXT"
fi
[ $# -gt 0 ] || set -- q15 q05

bpw() { # file or eddy folder -> bits per weight over the 2-D weight tensors
  "$PY" - "$1" <<'PY'
import json, os, struct, sys
p = sys.argv[1]
if os.path.isdir(p):
    f = open(os.path.join(p, "model.safetensors"), "rb")
    n = struct.unpack("<Q", f.read(8))[0]
    h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    size = lambda v: v["data_offsets"][1] - v["data_offsets"][0]
    side = (".scales", ".zero_points", ".super_scales", ".super_zero_points", ".high_bits", ".input_signs", ".output_signs")
    bits = elems = 0
    for k, v in h.items():
        if len(v["shape"]) != 2 or k.endswith(side):
            continue
        rows, cols = v["shape"]
        # M/K codes (two per byte) are the U8 matrices with zero points, K6's low nibbles those with high bits;
        # L codes one per byte.
        elems += rows * cols * (2 if v["dtype"] == "U8" and (k + ".zero_points" in h or k + ".high_bits" in h) else 1)
        bits += 8 * (size(v) + sum(size(h[k + e]) for e in side if k + e in h))
    print(f"{bits / elems:.3f}")
else:
    import gguf
    r = gguf.GGUFReader(p)
    ts = [t for t in r.tensors if len(t.shape) >= 2]
    print(f"{8 * sum(int(t.n_bytes) for t in ts) / sum(int(t.n_elements) for t in ts):.3f}")
PY
}

kl() { # name, model path, base (logits file or model) -> results/NAME.json
  local name=$1 model=$2 base=$3 res="$OUT/results/$1.json"
  [ -s "$res" ] && return
  local b
  b=$(bpw "$model")
  nice "$EDDY" perplexity --model "$model" --kl-base "$base" -f "$TEXT" --ctx 512 -t "$THREADS" --json 2>"$OUT/$name.err" |
    "$PY" -c "import json,sys; d=json.loads(sys.stdin.read()); d['variant']='$name'; d['bits_per_weight']=$b; print(json.dumps(d))" >"$res.part"
  mv "$res.part" "$res"
  echo "$name: $(cat "$res")" >&2
}

for m in "$@"; do
  case $m in
    q15) orig=$MODELS_DIR/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf ;;
    q05) orig=$MODELS_DIR/qwen2.5-coder-0.5b-instruct.gguf ;;
    *) echo "unknown model $m (q15, q05)" >&2; exit 2 ;;
  esac
  src=$OUT/$m-gridfree-f16.gguf
  [ -s "$src" ] || nice "$PY" tools/make_gridfree_gguf.py "$orig" "$src" 2>"$OUT/$m-gridfree.log"
  logits=$OUT/$m-src.logits
  if [ ! -s "$logits" ]; then
    nice "$EDDY" perplexity --model "$src" -f "$TEXT" --ctx 512 -t "$THREADS" --json --save-logits "$logits" >"$OUT/results/$m-source-ppl.json" 2>/dev/null
  fi
  # The source's own damage: the noisy F16 source against the original GGUF (the original as the base).
  kl "$m-source-vs-original" "$src" "$orig"
  for t in ${LLAMA_TYPES:-Q4_K_M Q4_0 IQ4_XS Q8_0}; do
    [ -s "$OUT/results/$m-$t.json" ] && continue
    f=$OUT/$m-$t.gguf
    [ -s "$f" ] || nice "$LLAMA_BIN/llama-quantize" "$src" "$f" "$t" "$THREADS" >"$OUT/$m-$t.log" 2>&1
    if [ "$t" = IQ4_XS ]; then
      # eddy reads no IQ4_XS: its exact values as F32 (gguf-py's dequantization), bits counted on the IQ4_XS file.
      b=$(bpw "$f")
      "$PY" - "$f" "$OUT/$m-$t-f32.gguf" <<'PY'
import sys, numpy as np, gguf
r = gguf.GGUFReader(sys.argv[1])
w = gguf.GGUFWriter(sys.argv[2], r.fields["general.architecture"].contents())
for name, f in r.fields.items():
    if name.startswith("GGUF.") or name == "general.architecture":
        continue
    vt = f.types[0]
    w.add_key_value(name, f.contents(), vt, sub_type=f.types[1] if vt == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None)
for t in r.tensors:
    w.add_tensor(t.name, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(x) for x in reversed(t.shape)]))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
PY
      rm -f "$f"
      kl "$m-$t" "$OUT/$m-$t-f32.gguf" "$logits"
      "$PY" - "$OUT/results/$m-$t.json" "$b" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); d["bits_per_weight"] = float(sys.argv[2]); d["note"] = "run as its exact f32 values"
json.dump(d, open(sys.argv[1], "w"))
PY
      rm -f "$OUT/$m-$t-f32.gguf"
    else
      kl "$m-$t" "$f" "$logits"
      rm -f "$f"
    fi
  done
  # eddy variants: NAME|FLAGS, % for a space in FLAGS. m at <= Q4_K_M's bits: g64 with the LM head in l (4.99-5.00 bits on the
  # 1.5B), g32 with the LM head in m g32 and the untied embedding in m g64 (4.94); each to nearest (with
  # the per-group scale search) and with GPTQ (--calib), rotated and not. "rot" variants rotate every matrix
  # (--no-rotation-for none; eddy quantize's default leaves gate/up unrotated since session 17).
  # Session 10's mixed precision (--tensor-format): m g32 with the LM head in m g32, unrotated, plus per-tensor
  # formats: k/v projections in l g32, the embedding in m g128, and more bits for q/o, down or fewer for gate/up;
  # Q4_K_M's own split (l g32 for k/v and for ffn_down of the layers llama.cpp's use_more_bits picks, m g64 for
  # the rest).
  M32="--format%m%--group%32%--head-format%m%--head-group%32%--no-rotation"
  KV8="k_proj=l/32,v_proj=l/32"
  Q4KM_DOWN="0-2+5+8+11+14+17+20+23+25-27"
  for v in ${EDDY_VARIANTS:-"l-g64-rot|--format%l%--group%64%--no-rotation-for%none" \
    "m-g64-rot|--format%m%--group%64%--no-rotation-for%none" "m-g64-norot|--format%m%--group%64%--no-rotation" \
    "m-g64-rot-gptq|--format%m%--group%64%--calib%CALIB%--no-rotation-for%none" "m-g64-norot-gptq|--format%m%--group%64%--no-rotation%--calib%CALIB" \
    "m-g32h32e64-rot|--format%m%--group%32%--head-format%m%--head-group%32%--embed-group%64%--no-rotation-for%none" \
    "m-g32h32e64-norot|--format%m%--group%32%--head-format%m%--head-group%32%--embed-group%64%--no-rotation" \
    "m-g32h32e64-rot-gptq|--format%m%--group%32%--head-format%m%--head-group%32%--embed-group%64%--calib%CALIB%--no-rotation-for%none" \
    "m-g32h32e64-norot-gptq|--format%m%--group%32%--head-format%m%--head-group%32%--embed-group%64%--no-rotation%--calib%CALIB" \
    "m-g128-norot-s|--format%m%--group%128%--no-rotation" "m-g128-rot-s|--format%m%--group%128%--no-rotation-for%none" \
    "m-g32-kv8-norot|$M32%--embed-group%64%--tensor-format%k_proj=l/32,v_proj=l/32" \
    "mix-m32kv8-e128|$M32%--tensor-format%$KV8,embed_tokens=m/128" \
    "mix-m32kv8-e128-d2|$M32%--tensor-format%$KV8,embed_tokens=m/128,down_proj@0+27=l/32" \
    "mix-m32kv8-e128-gu64|$M32%--tensor-format%$KV8,embed_tokens=m/128,gate_proj=m/64,up_proj=m/64" \
    "mix-m32kv8-e128-qo8|$M32%--tensor-format%$KV8,embed_tokens=m/128,q_proj=l/32,o_proj=l/32" \
    "mix-m32kv8-e128-down8|$M32%--tensor-format%$KV8,embed_tokens=m/128,down_proj=l/32" \
    "mix-q4kmlike-h64|--format%m%--group%64%--head-format%m%--head-group%64%--embed-group%128%--no-rotation%--tensor-format%$KV8,down_proj@$Q4KM_DOWN=l/32" \
    "k-all-norot|--format%k%--head-format%k%--no-rotation" \
    "k-k6mix-norot|--format%k%--head-format%k%--no-rotation%--tensor-format%k_proj=k6,v_proj=k6,q_proj=k6,o_proj=k6,down_proj@0-10+17-27=k6,embed_tokens=m/128" \
    "k-k6mix-rotnogu|--format%k%--head-format%k%--tensor-format%k_proj=k6,v_proj=k6,q_proj=k6,o_proj=k6,down_proj@0-10+17-27=k6,embed_tokens=m/128" \
    "mix-q4kmlike-h32|--format%m%--group%64%--head-format%m%--head-group%32%--embed-group%128%--no-rotation%--tensor-format%$KV8,down_proj@0-2+5+8+11+17+20+23+25-27=l/32"}; do
    name=$m-eddy-${v%%|*}
    flags=${v#*|}
    flags=${flags//%/ }
    flags=${flags//CALIB/$CALIB}
    [ -s "$OUT/results/$name.json" ] && continue
    d=$OUT/$name
    rm -rf "$d"
    # shellcheck disable=SC2086
    nice "$EDDY" quantize --model "$src" $flags -o "$d" >"$OUT/$name.log" 2>&1
    kl "$name" "$d" "$logits"
    rm -rf "$d"
  done
  # Mixed recipes assembled by bench/mix_folders.py from folders quantized whole, unrotated (a matrix's codes
  # then depend only on its own values and format, so a mix equals what `eddy quantize --tensor-format`
  # writes for the same rules). EDDY_WHOLE: "NAME|FLAGS ..." (% for a space), each quantized once into
  # $OUT/$m-whole-NAME; EDDY_MIXES: "NAME|BASE%RULE%RULE..." with BASE a whole NAME and RULE
  # WHOLE_NAME:TENSOR[@LAYERS] (mix_folders.py's rules). Each mix is scored as a variant ($m-mix-NAME) and
  # deleted; the whole folders are deleted once every mix is scored.
  if [ -n "${EDDY_MIXES:-}" ]; then
    for v in ${EDDY_WHOLE:-}; do
      d=$OUT/$m-whole-${v%%|*}
      [ -s "$d/model.safetensors" ] && continue
      flags=${v#*|}
      rm -rf "$d"
      # shellcheck disable=SC2086
      nice "$EDDY" quantize --model "$src" ${flags//%/ } -o "$d" >"$d.log" 2>&1
    done
    for v in $EDDY_MIXES; do
      name=$m-mix-${v%%|*}
      [ -s "$OUT/results/$name.json" ] && continue
      IFS=% read -r -a spec <<<"${v#*|}"
      rules=()
      for r in "${spec[@]:1}"; do rules+=("$OUT/$m-whole-$r"); done
      d=$OUT/$name
      rm -rf "$d" "$d.tmp"
      "$PY" bench/mix_folders.py "$d" "$OUT/$m-whole-${spec[0]}" "${rules[@]}" >/dev/null
      kl "$name" "$d" "$logits"
      rm -rf "$d"
    done
    [ -n "${EDDY_KEEP_WHOLE:-}" ] || for v in ${EDDY_WHOLE:-}; do rm -rf "$OUT/$m-whole-${v%%|*}"; done
  fi
done

"$PY" - "$OUT/results" <<'PY'
import glob, json, os, sys
print(f"| variant | bits/weight | KL mean ± se | KL p99 | top-1 | ppl (base ppl) |")
print("|---|---|---|---|---|---|")
for p in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    d = json.load(open(p))
    if "kl_mean" not in d:
        print(f"| {os.path.basename(p)[:-5]} | | | | | {d['perplexity']:.4f} |")
        continue
    print(f"| {d['variant']} | {d['bits_per_weight']:.3f} | {d['kl_mean']:.5f} ± {d['kl_mean_se']:.5f} | {d['kl_p99']:.4f} | "
          f"{100 * d['top1_agreement']:.2f} % | {d['perplexity']:.4f} ({d['base_perplexity']:.4f}) |")
PY
