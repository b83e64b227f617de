#!/usr/bin/env bash
# The CUDA backend's checks and timings on a lent GPU machine, in one call (docs/cuda.md, "Running them on the
# lent H200"). Run from the repository root on the GPU machine, after the model pieces were appended to
# $STAGE/<name>.gguf by earlier calls (`cat <carried piece> >> $STAGE/<name>.gguf`, one call per piece).
#
#   tools/cuda_h200_check.sh TEST_BINARY STAGE_DIR SHA256_OF_THE_0.5B [LLAMA_TGZ_OR_DIR] [EDDY_BINARY]
#
# Runs: the GPU tests (parity, products, batch invariance, the Qwen2.5-Coder-0.5B model test, one at a time;
# again with $TEST_ENVS set, a list of NAME=VALUE words, for the opt-in kernels),
# the phase-boundary probe (phase_boundary_timing), the decode / verify-curve / prefill timing with CUDA graphs and without (EDDY_CUDA_GRAPHS=0), and once more
# per NAME=VALUE word of $TIMING_ENVS (with that variable set: to compare settings in one call); when given
# llama.cpp's build for the GPU (its tarball, or the folder it was unpacked into, holding bin/llama-bench) and
# an eddy binary, `eddy speed --device cuda` and llama-bench on the same GGUF, alternated twice (pp512, tg128,
# 3 repetitions each; `eddy speed` also once per NAME=VALUE word of $SPEED_ENVS in each round); then, where ncu
# is present, the kernel-time split of a 64-token prefill pass, a 16-node verify and a decode step
# (tools/ncu_split.py, run from beside this script; caches flushed before each kernel unless
# $NCU_CACHE=none, which leaves them as the previous kernel left them). $SKIP_TESTS=1 skips the tests,
# $SKIP_NCU=1 the split. Output goes to stdout and to $OUT/check.log when $OUT is set.
set -u -o pipefail
bin=$1 stage=$2 sha=$3 llama=${4:-} eddy=${5:-}
log=${OUT:-/tmp}/check.log
exec > >(tee "$log") 2>&1
model=$stage/qwen2.5-coder-0.5b-instruct.gguf
echo "== model: $(sha256sum "$model" | cut -c1-64) (want $sha)"
[ "$(sha256sum "$model" | cut -c1-64)" = "$sha" ] || { echo "model checksum mismatch"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw --format=csv
export EDDY_MODELS=$stage
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== GPU tests"
    "$bin" --ignored --test-threads 1 --skip timing --skip profile --skip smollm2 --skip gemma3 --nocapture 2>&1 | grep -v "^$"
    # The opt-in kernels through whole models (decode steps against verify passes, bit for bit): once with
    # every NAME=VALUE word of $TEST_ENVS set together.
    if [ -n "${TEST_ENVS:-}" ]; then
        echo "== GPU tests with $TEST_ENVS"
        env $TEST_ENVS "$bin" --ignored --test-threads 1 --skip timing --skip profile --skip smollm2 --skip gemma3 2>&1 | grep -E "^test |test result|panicked"
    fi
fi
echo "== phase boundaries (kernel boundary vs grid and cluster barriers)"
timeout 300 "$bin" --ignored --exact phase_boundary_timing --nocapture 2>&1 | grep -E "µs|not run|panicked|device:"
timing() { "$bin" --ignored --test-threads 1 --nocapture decode_and_verify_timing 2>&1 | grep -E "decode|verify|queue|prefill|graph|empty"; }
echo "== timing, graphs on"
timing
echo "== timing, graphs off"
EDDY_CUDA_GRAPHS=0 timing
for v in ${TIMING_ENVS:-}; do
    echo "== timing, $v"
    env "$v" "$bin" --ignored --test-threads 1 --nocapture decode_and_verify_timing 2>&1 | grep -E "decode|verify|queue|prefill|graph|empty"
done
if [ -n "$llama" ]; then
    if [ -f "$llama" ]; then tar xzf "$llama" -C /tmp && llama=/tmp; fi
    for round in 1 2; do
        if [ -n "$eddy" ]; then
            echo "== eddy speed (round $round)"
            "$eddy" speed --device cuda --model "$model" -p 512 -n 128 -r 3 2>&1 | grep -v "^$"
            for v in ${SPEED_ENVS:-}; do
                echo "== eddy speed, $v (round $round)"
                env "$v" "$eddy" speed --device cuda --model "$model" -p 512 -n 128 -r 3 2>&1 | grep -v "^$"
            done
        fi
        echo "== llama-bench (round $round)"
        LD_LIBRARY_PATH=$llama/bin "$llama/bin/llama-bench" -m "$model" -ngl 99 -fa 1 -p 512 -n 128 -r 3
    done
fi
[ "${SKIP_NCU:-0}" = 1 ] && exit 0
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
if [ -x "$ncu" ]; then
    echo "== kernel-time split (ncu, cache control ${NCU_CACHE:-all}: with 'all' caches are flushed before each kernel and small kernels read high)"
    csv=${OUT:-/tmp}/ncu.csv
    EDDY_CUDA_GRAPHS=0 "$ncu" --clock-control none --cache-control "${NCU_CACHE:-all}" --profile-from-start off --metrics gpu__time_duration.sum --csv \
        --log-file "$csv" "$bin" --ignored --exact profile_prefill_verify_decode --nocapture 2>&1 | grep profiled
    python3 "$(dirname "$0")/ncu_split.py" "$csv" prefill64 verify16 decode
fi
