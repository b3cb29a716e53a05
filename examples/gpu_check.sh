#!/usr/bin/env bash
# The GPU check of the offload: CUDA tests and the >= 1B-parameter benchmark, on a machine with
# CUDA and its own torch. Build the abi3 wheel first (`make wheel`, on any machine: one wheel
# serves CPython >= 3.10), then run this from the repository root. Results go under $OUT.
set -euo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index --target /tmp/oa_site dist/offload_adam-*-abi3-*.whl
export PYTHONPATH=/tmp/oa_site${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import torch, offload_adam; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'simd', offload_adam.simd_path())" | tee "$OUT/env.txt"
# CUDA tests, and the streaming machinery on CPU parameters (same code paths, no CUDA).
python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_streaming.py 2>&1 | tee "$OUT/tests.txt"
python3 examples/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
python3 examples/train_gpt.py --steps 100 --plot "$OUT/breakdown.png" 2>&1 | tail -8 | tee "$OUT/demo.txt"
