#!/usr/bin/env bash
# Install NVIDIA's CUDA 13.0 compiler from PyPI into a virtual environment, for building eddy with
# `--features cuda` (crates/eddy/build.rs looks for nvcc in $NVCC, then PATH, then this venv).
# No GPU or driver is needed to compile; the 13.0 series matches the driver the kernels are run with
# (a newer toolkit's PTX may not load on a 13.0 driver). nvidia-nvvm (cicc) is pinned too: left to pip it
# comes in a newer series whose PTX the 13.0 ptxas rejects ("Unsupported .version").
#
#   tools/install_nvcc.sh            # venv at ~/.cache/eddy/cuda-venv (or $EDDY_CUDA_VENV)
#
# Prints the path of nvcc last.
set -euo pipefail
venv=${EDDY_CUDA_VENV:-$HOME/.cache/eddy/cuda-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  'nvidia-cuda-nvcc==13.0.*' 'nvidia-cuda-crt==13.0.*' 'nvidia-cuda-cccl==13.0.*' 'nvidia-cuda-runtime==13.0.*' 'nvidia-nvvm==13.0.*'
nvcc=$(find "$venv" -path '*/bin/nvcc' -type f | head -1)
[ -n "$nvcc" ] || { echo "install_nvcc.sh: nvcc not found under $venv after the install" >&2; exit 1; }
"$nvcc" --version | tail -2 >&2
echo "$nvcc"
