#!/usr/bin/env bash
# Build the CUDA binaries for a lent GPU machine and pack them into one carry (docs/cuda.md, "Tests"). Run from
# the repository root, after ../shared/device/stage.sh (which empties .devcarry):
#
#   tools/cuda_device_pack.sh            builds, strips and packs into .devcarry/b/bins.tar.xz
#
# The pack holds bin/cuda-test (the GPU test binary), bin/eddy (the CLI with the `cuda` feature) and
# bin/cuda_ab.sh. On the machine, one call carrying [".devcarry/b"] unpacks it and can run the model-free tests:
#
#   mkdir -p /tmp/bin && tar xJf .devcarry/b/bins.tar.xz -C /tmp && /tmp/bin/cuda-test --include-ignored \
#     --skip timing --skip profile --skip matches_cpu --skip generates --skip lossless --test-threads 1
#
# Then the model tests (`EDDY_MODELS=/tmp/stage /tmp/bin/cuda-test --ignored matches_cpu generates lossless
# --skip smollm --skip gemma3 --test-threads 1`) and A/Bs (`SETTINGS=… VERIFY_SIZES=… /tmp/bin/cuda_ab.sh
# /tmp/stage/MODEL.gguf /tmp/bin/eddy /tmp/bin/cuda-test`). Every call carries the checkout too, which must stay
# under 64 MiB with the carry: the tracked DFlash drafter (drafters/*/model.safetensors, 72 MB) must be moved out
# of the work tree for those calls (and back, `sha256sum -c SHA256SUMS` in its folder, before a commit).
# Builds go to target-cuda/ (git-ignored through .git/info/exclude), without LTO or debug info (as CI's tests).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/target-cuda/' .git/info/exclude 2>/dev/null || echo '/target-cuda/' >> .git/info/exclude
grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
NVCC=${NVCC:-$(tools/install_nvcc.sh | tail -1)}
export NVCC CARGO_TARGET_DIR=$PWD/target-cuda CARGO_PROFILE_RELEASE_LTO=off CARGO_PROFILE_RELEASE_DEBUG=0
# The test binary's path: the last "Executable" line cargo prints for the `cuda` test target.
test_bin=$(cargo test --release -p eddy --features cuda --test cuda --no-run 2>&1 | tee /dev/stderr |
    sed -n 's/.*Executable tests\/cuda.rs (\(.*\))/\1/p' | tail -1)
[ -x "$test_bin" ] || { echo "no test binary found in cargo's output" >&2; exit 1; }
cargo build --release -p eddy-cli --features cuda
pack=$(mktemp -d)
mkdir -p "$pack/bin"
strip -o "$pack/bin/cuda-test" "$test_bin"
strip -o "$pack/bin/eddy" "$CARGO_TARGET_DIR/release/eddy"
cp tools/cuda_ab.sh "$pack/bin/"
mkdir -p .devcarry/b
tar cf - -C "$pack" bin | xz -1 -T2 > .devcarry/b/bins.tar.xz
rm -rf "$pack"
ls -l .devcarry/b/bins.tar.xz
echo "carry [\".devcarry/b\"], command: mkdir -p /tmp/bin && tar xJf .devcarry/b/bins.tar.xz -C /tmp && …"
