#!/usr/bin/env bash
# On a machine with an NVIDIA H100/H200: install what the PTX path needs, run the gpu-marked parity tests
# and the benchmark. Usage: scripts/gpu_check.sh   (from anywhere; uses .venv if present, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
# A CUDA build of torch and the driver API bindings; keep an existing CUDA torch as it is.
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -m pip install --upgrade torch --index-url https://download.pytorch.org/whl/cu128
fi
"$PY" -m pip install --upgrade "cuda-python>=12.6" numpy pytest "pyptx==0.1.1"
command -v ptxas >/dev/null || echo "note: ptxas not on PATH; the ptxas tests will fail (install cuda-nvcc)"

"$PY" -m pytest -q tests/ptx_kernels -m gpu -rs
"$PY" -m ptx_kernels.bench | tee ptx_bench.json
