#!/usr/bin/env bash
# ONE command for every GPU check of the PTX back end, on a machine with an NVIDIA H100/H200:
#   scripts/gpu_check.sh            (from anywhere; uses .venv if present, else python3; $PYTHON overrides)
# 1. installs what launching needs: a CUDA build of torch (kept if already present), cuda-python, pyptx;
# 2. runs all of tests/ptx_kernels: the ptxas/compile checks AND the gpu-marked parity tests (every kernel
#    kind against eager torch, the new fp32 SIMT GEMM / any-head-dim attention / generated indexing
#    kernels, and the tiny Llama fp32 + bf16 end to end through torch.compile(target="ptx") vs eager CUDA);
# 3. runs the benchmark (python -m ptx_kernels.bench) and writes its JSON to ptx_bench.json.
# Exit status is non-zero if any test fails; the benchmark still runs so that its figures are kept.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${CTPU_GPU_CHECK_OUT:-.}"
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || { echo "no NVIDIA GPU"; exit 2; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -m pip install --upgrade torch --index-url https://download.pytorch.org/whl/cu128 || exit 2
fi
"$PY" -m pip install --quiet --upgrade "cuda-python>=12.6" numpy pytest "pyptx==0.1.1" transformers || exit 2
command -v ptxas >/dev/null || echo "note: ptxas not on PATH; the ptxas checks will fail (install cuda-nvcc)"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

status=0
# -rs lists every skip with its reason: on a Hopper GPU no gpu test may be skipped.
"$PY" -m pytest -q tests/ptx_kernels -rs --junitxml="$OUT/ptx_gpu_tests.xml" -p no:cacheprovider || status=1
"$PY" -m ptx_kernels.bench | tee "$OUT/ptx_bench.json" || status=1
echo "gpu_check: tests + bench finished with status $status (junit: $OUT/ptx_gpu_tests.xml, bench: $OUT/ptx_bench.json)"
exit $status
