#!/usr/bin/env bash
# Sampling on the device (docs/cuda.md, "Sampling on the device") on a lent GPU machine, in one call: the GPU
# tests of the candidates and of sampled generation, then `eddy run --device cuda` on the reference prompt
# with the candidates on the device and with the logits copied to the host (EDDY_DEVICE_SAMPLING=0), twice
# each, at the CLI's default filters (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and at temperature 1
# alone. Run from the repository root on the GPU machine after the Qwen2.5-Coder-0.5B GGUF was put together at
# $STAGE/qwen2.5-coder-0.5b-instruct.gguf.
#
#   tools/cuda_sampling_check.sh BIN_DIR STAGE_DIR SHA256_OF_THE_0.5B [EDDY_BEFORE]
#
# BIN_DIR holds `cudatest` (the stripped `--test cuda` binary) and `eddy` (the CLI built with `--features
# cuda`); EDDY_BEFORE, an `eddy` built before device sampling, runs the same commands for comparison. Output
# goes to stdout and to $OUT/sampling.log when $OUT is set.
set -u -o pipefail
bin=$1 stage=$2 sha=$3 before=${4:-}
log=${OUT:-/tmp}/sampling.log
exec > >(tee "$log") 2>&1
model=$stage/qwen2.5-coder-0.5b-instruct.gguf
[ "$(sha256sum "$model" | cut -c1-64)" = "$sha" ] || { echo "model checksum mismatch"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
export EDDY_MODELS=$stage
echo "== GPU tests"
"$bin/cudatest" --ignored --test-threads 1 --nocapture candidate_rows_match_the_host argmax_rows_match_the_host \
    device_sampling_generates_what_the_host_path_does 2>&1 | grep -v "^$"
prompt="Write a python function to merge two sorted lists."
for filters in "--top-k 40 --top-p 0.95 --min-p 0.05 --temperature 0.8" "--top-k 0 --top-p 1 --min-p 0 --temperature 1"; do
    echo "== eddy run --device cuda $filters --seed 42 -n 512"
    for run in before 0 1 before 0 1; do
        exe=$bin/eddy on=$run
        if [ "$run" = before ]; then
            [ -n "$before" ] || continue
            exe=$before on=0
        fi
        # shellcheck disable=SC2086
        EDDY_DEVICE_SAMPLING=$on "$exe" run --model "$model" --device cuda $filters --seed 42 -n 512 \
            --speculator none -m "$prompt" >/tmp/answer.txt 2>/tmp/stats.txt
        echo "$run: answer $(md5sum </tmp/answer.txt | cut -c1-12), $(wc -c </tmp/answer.txt) bytes;" \
            "$(grep -E 'generation speed|tokens per forward' /tmp/stats.txt | tr '\n' ' ')"
    done
done
