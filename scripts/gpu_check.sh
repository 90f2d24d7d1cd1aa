#!/usr/bin/env bash
# ONE command for every GPU check of the PTX back end, on a machine with an NVIDIA H100/H200:
#   scripts/gpu_check.sh            (from anywhere; uses .venv if present, else python3; $PYTHON overrides)
# 1. makes sure what launching needs is importable: a CUDA build of torch, cuda-python, pyptx, transformers,
#    pytest. What is missing comes from wheels in .whl/ when that folder exists (machines with no network:
#    `pip download` them elsewhere), else from the package index;
# 2. runs all of tests/ptx_kernels: the ptxas/compile checks AND the gpu-marked parity tests (every kernel
#    kind against eager torch, the fp32 SIMT GEMM / any-head-dim attention / generated indexing kernels, and
#    the tiny Llama fp32 + bf16 end to end through torch.compile(target="ptx") vs eager CUDA), in parallel
#    and with a per-test time limit when pytest-xdist / pytest-timeout are there (a hung kernel fails its test);
# 3. runs the benchmark (python -m ptx_kernels.bench, at most CTPU_BENCH_TIMEOUT s, default 300) and writes
#    its JSON to ptx_bench.json.
# Exit status is non-zero if any test fails; the benchmark still runs so that its figures are kept.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${CTPU_GPU_CHECK_OUT:-.}"
mkdir -p "$OUT"

nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || { echo "no NVIDIA GPU"; exit 2; }
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -m pip install --upgrade torch --index-url https://download.pytorch.org/whl/cu128 || exit 2
fi
missing=()
for pair in cuda.bindings:cuda-python pyptx:pyptx==0.1.1 transformers:transformers pytest:pytest numpy:numpy; do
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ -d .whl ]; then
    SITE="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || exit 2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    "$PY" -m pip install --quiet --upgrade "${missing[@]}" || exit 2
  fi
fi
# backend="ctpu" is found through the package's entry point; where the package is not installed (another
# Python than the one pyproject pins), a metadata-only distribution on the path declares it
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if 'ctpu' in m.entry_points(group='torch_dynamo_backends').names else 1)"; then
  SHIM="$(mktemp -d)"
  mkdir -p "$SHIM/ctpu-0.1.0.dist-info"
  printf 'Metadata-Version: 2.1\nName: ctpu\nVersion: 0.1.0\n' > "$SHIM/ctpu-0.1.0.dist-info/METADATA"
  printf '[torch_dynamo_backends]\nctpu = torch_tpu_backend.dynamo:ctpu_backend\n' > "$SHIM/ctpu-0.1.0.dist-info/entry_points.txt"
  export PYTHONPATH="$SHIM:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v ptxas >/dev/null || echo "note: ptxas not on PATH; the ptxas checks will fail (install cuda-nvcc)"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL+=(-n 8)
"$PY" -c "import pytest_timeout" 2>/dev/null && PARALLEL+=(--timeout 180 --timeout-method thread)
status=0
# -rs lists every skip with its reason: on a Hopper GPU no gpu test may be skipped.
"$PY" -m pytest -q tests/ptx_kernels -rs "${PARALLEL[@]}" --junitxml="$OUT/ptx_gpu_tests.xml" -p no:cacheprovider \
  || status=1
# A hung kernel must not hold the machine: the bench gets its own time limit (~30 s on an H200).
timeout "${CTPU_BENCH_TIMEOUT:-300}" "$PY" -m ptx_kernels.bench | tee "$OUT/ptx_bench.json" || status=1
echo "gpu_check: tests + bench finished with status $status (junit: $OUT/ptx_gpu_tests.xml, bench: $OUT/ptx_bench.json)"
exit $status
