#!/usr/bin/env bash
# A/B of CUDA settings on a lent GPU machine, alternated in one call so that the machine's drift hits every setting
# alike (docs/cuda.md, "Measured on an NVIDIA H100: session 31's opt-ins, …"). Run from the repository root there:
#
#   tools/cuda_ab.sh MODEL_GGUF EDDY_BINARY TEST_BINARY [LLAMA_DIR]
#
# $SETTINGS: the settings to compare, separated by ';', each a list of NAME=VALUE words ("" or "X=1" for the
# defaults); default: the defaults against the session-31 decode kernels. $ROUNDS (3): rounds of
# `eddy speed --device cuda -p 512 -n 128 -d $DEPTH -r 3` over every setting, each round ending with llama-bench
# (pp512 from an empty context, tg128 at the same -d) when LLAMA_DIR (holding bin/llama-bench) is given. $DEPTH (0):
# the tokens in the context when the decode test starts, llama-bench's -d (0: its tg128 from an empty context;
# before 2026-12-06 this script measured eddy's tg128 after the 512-token prompt and llama.cpp's from an empty
# context). $TIMING_ROUNDS (1): rounds of `decode_and_verify_timing` (device argmax: the decode step and the 8-, 16-
# and 32-node verifies) over every setting. $VERIFY_SIZES (unset: none): tree sizes for `eddy speed --verify-sizes`
# in the same runs (e.g. 1,2,3,16), each verify's milliseconds printed with the run. Prints one line per run and, at
# the end, each setting's mean tg128 and verify times and their ratios to the first setting's.
set -u -o pipefail
model=$1 eddy=$2 bin=$3 llama=${4:-}
IFS=';' read -r -a settings <<< "${SETTINGS:-X=1;EDDY_CUDA_T1_UNROLL=2 EDDY_CUDA_ATT_CLUSTER=0}"
export EDDY_MODELS=$(dirname "$model")
echo "== $(basename "$model") on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
declare -A sum n vsum vn
vs=${VERIFY_SIZES:+--verify-sizes $VERIFY_SIZES}
for r in $(seq "${ROUNDS:-3}"); do
    for s in "${settings[@]}"; do
        line=$(env X=1 $s "$eddy" speed --device cuda --model "$model" -p 512 -n 128 -d "${DEPTH:-0}" -r 3 $vs 2>&1)
        tg=$(grep '"tg128"' <<< "$line" | grep -o '"avg_ts":[0-9.]*' | cut -d: -f2)
        pp=$(grep '"pp512"' <<< "$line" | grep -o '"avg_ts":[0-9.]*' | cut -d: -f2)
        # Each verify line holds "nodes":N and "ms":M (in either order): N:M.
        ver=$(grep '"test":"verify' <<< "$line" | while read -r l; do
            echo "$(grep -o '"nodes":[0-9]*' <<< "$l" | cut -d: -f2):$(grep -o '"ms":[0-9.e+-]*' <<< "$l" | cut -d: -f2)"
        done | tr '\n' ' ')
        echo "round $r [$s] tg128 ${tg:-?} pp512 ${pp:-?}${ver:+ verify nodes:ms $ver}"
        for v in $ver; do
            vsum["$s|${v%%:*}"]=$(awk -v a="${vsum["$s|${v%%:*}"]:-0}" -v b="${v#*:}" 'BEGIN { print a + b }')
            vn["$s|${v%%:*}"]=$(( ${vn["$s|${v%%:*}"]:-0} + 1 ))
        done
        if [ -n "$tg" ]; then
            sum[$s]=$(awk -v a="${sum[$s]:-0}" -v b="$tg" 'BEGIN { print a + b }')
            n[$s]=$(( ${n[$s]:-0} + 1 ))
        fi
    done
    if [ -n "$llama" ]; then
        # llama-bench's table: | model | size | params | backend | ngl | fa | test | t/s |. Its -d deepens every
        # test of a run, and eddy's pp512 starts from an empty context: so two runs.
        for test in "-p 512 -n 0 -d 0" "-p 0 -n 128 -d ${DEPTH:-0}"; do
            LD_LIBRARY_PATH=$llama/bin "$llama/bin/llama-bench" -m "$model" -ngl 99 -fa 1 $test -r 3 2>&1 |
                awk -F'|' -v r="$r" '$8 ~ /pp512|tg128/ { gsub(/ /, "", $8); print "round " r " llama.cpp " $8 " " $9 }'
        done
    fi
done
for t in $(seq "${TIMING_ROUNDS:-1}"); do
    for s in "${settings[@]}"; do
        echo "timing round $t [$s]"
        env X=1 $s EDDY_CUDA_MODEL=$(basename "$model") "$bin" --ignored --exact decode_and_verify_timing --nocapture 2>&1 |
            grep -E "device argmax: (decode|8-node verify|16-node verify|32-node verify)"
    done
done
first=${settings[0]}
for s in "${settings[@]}"; do
    [ -n "${n[$s]:-}" ] || continue
    awk -v s="$s" -v a="${sum[$s]}" -v k="${n[$s]}" -v f="${sum[$first]:-0}" -v fk="${n[$first]:-1}" -v base="$first" \
        'BEGIN { m = a / k; d = (f > 0) ? (m / (f / fk) - 1) * 100 : 0
                 printf "mean tg128 [%s] %.1f t/s (%d runs), %+.1f %% against [%s]\n", s, m, k, d, base }'
    sizes=${VERIFY_SIZES:-}
    for size in ${sizes//,/ }; do
        key="$s|$size" fkey="$first|$size"
        [ -n "${vn[$key]:-}" ] || continue
        awk -v s="$s" -v z="$size" -v a="${vsum[$key]}" -v k="${vn[$key]}" -v f="${vsum[$fkey]:-0}" -v fk="${vn[$fkey]:-1}" -v base="$first" \
            'BEGIN { m = a / k; d = (f > 0) ? (m / (f / fk) - 1) * 100 : 0
                     printf "mean %s-node verify [%s] %.3f ms (%d runs), %+.1f %% against [%s]\n", z, s, m, k, d, base }'
    done
done
