#!/usr/bin/env bash
# The GPU check: the whole test suite (CUDA tests included) and the >= 1B-parameter benchmark,
# on a machine with CUDA and its own torch. Build the abi3 wheel first (`make wheel`, on any
# machine: one wheel serves CPython >= 3.10), then run this from the repository root. Results
# go under $OUT (at most 8 files). The suite includes the NVMe tier's tests, and the NVMe bench runs last.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-index --target /tmp/oa_site dist/offload_adam-*-abi3-*.whl
# Optional peers carried as wheels (torchao's CPUOffloadOptimizer for the benchmark).
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index --target /tmp/oa_site .whl/*.whl
export PYTHONPATH=/tmp/oa_site${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import torch, offload_adam; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'simd', offload_adam.simd_path())"
} 2>&1 | tee "$OUT/env.txt"
# The whole suite: CUDA tests, and everything else on this machine's CPU and torch.
timeout 240 python3 -m pytest -q -rfEs -p no:cacheprovider tests 2>&1 | tail -60 | tee "$OUT/tests.txt"
timeout 200 python3 examples/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
timeout 60 python3 examples/train_gpt.py --steps 100 --plot "$OUT/breakdown.png" 2>&1 | tail -8 | tee "$OUT/demo.txt"
# The NVMe tier against that machine's disk (raw O_DIRECT bandwidth first, same run).
mkdir -p /tmp/oa_nvme && timeout 120 python3 -m offload_adam bench --nvme /tmp/oa_nvme --rounds 3 --raw-gb 1 2>&1 | tail -12 | tee "$OUT/nvme_bench.txt"
