#!/usr/bin/env bash
# The GPU check, run from the repository root as `bash .ci/gpu_check.sh`, for a machine with CUDA
# and its own torch (python 3.12 there; torch is not installed by this script). Build the abi3 wheel first (`make wheel`, on any machine: one
# manylinux2014 wheel serves CPython >= 3.10), bring peers as wheels into .whl/ (torchao for the
# optimizer bench; accelerate, diffusers and transformers for the weights), then run this from the
# repository root. Results go under $OUT (at most 8 files, none in subfolders).
#
# The whole check fits in one call of 10 minutes: each step gets what is left of DEADLINE_S
# (default 540 s), in order of what is owed most: the CUDA tests, the 1.1B bf16 optimizer bench,
# the weights bench (tokens/s against accelerate and diffusers), generate.py with weights
# streamed and the training-with-streamed-weights bench, the demo (and with --offload-weights) on the GPU, the NVMe bench on that machine's disk, then the rest of the suite.
set -uo pipefail
OUT=${OUT:-gpu_out}
DEADLINE_S=${DEADLINE_S:-540}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
left() {  # seconds left, at most $1
  local l=$((DEADLINE_S - ($(date +%s) - start)))
  [ "$l" -gt "$1" ] && l=$1
  [ "$l" -lt 5 ] && l=5
  echo "$l"
}
python3 -m pip install -q --no-deps --no-index --target /tmp/oa_site dist/offload_adam-*-abi3-*.whl
ls .whl/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps --no-index --target /tmp/oa_site .whl/*.whl
export PYTHONPATH=/tmp/oa_site${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -m offload_adam env
} 2>&1 | tee "$OUT/env.txt"
# The CUDA tests first (what has never run on a GPU); the rest of the suite last, with what is left.
timeout "$(left 150)" python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda tests 2>&1 | tail -40 | tee "$OUT/tests.txt"
# Once more under torch's CUDA stream sanitizer (CSAN): it tracks kernel arguments, copies, events,
# waits and allocator frees, and reports an unordered access whatever the timing (the review's
# findings 1, 5 and 10 among them). Its reports go to stderr: the tail keeps them.
echo "--- TORCH_CUDA_SANITIZER=1" >> "$OUT/tests.txt"
TORCH_CUDA_SANITIZER=1 timeout "$(left 150)" python3 -m pytest -q -rfEs -p no:cacheprovider -m cuda -k "not second_gpu" tests/test_cuda.py 2>&1 | grep -E "CSAN|race|passed|failed|FAILED|Error" | tail -40 | tee -a "$OUT/tests.txt"
timeout "$(left 120)" python3 .ci/gpu_bench.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/gpu_bench.txt"
mkdir -p /tmp/oa_nvme
{
  timeout "$(left 90)" python3 -m offload_adam bench --weights /tmp/oa_nvme --weights-gb 2 --rounds 3 2>&1 | tail -12
  timeout "$(left 40)" python3 examples/generate.py --layers 16 --d-model 2048 --tokens 32 2>&1 | tail -8
  # training with streamed weights against the model resident and FSDP2 + CPUOffloadPolicy
  timeout "$(left 90)" python3 -m offload_adam bench --train-weights --rounds 3 2>&1 | tail -8
  # activations offloaded against save_on_cpu and torchtune's OffloadActivations
  timeout "$(left 60)" python3 -m offload_adam bench --activations --rounds 3 2>&1 | tail -8
} | tee "$OUT/weights.txt"
{
  timeout "$(left 40)" python3 examples/train_gpt.py --steps 100 --plot "$OUT/breakdown.png" 2>&1 | tail -8
  timeout "$(left 30)" python3 examples/train_gpt.py --steps 50 --offload-weights 2>&1 | tail -4
} | tee "$OUT/demo.txt"
# The NVMe tier against that machine's disk (raw O_DIRECT bandwidth first, same run).
timeout "$(left 60)" python3 -m offload_adam bench --nvme /tmp/oa_nvme --rounds 3 --raw-gb 1 2>&1 | tail -12 | tee "$OUT/nvme_bench.txt"
echo "--- the rest of the suite (not cuda), on this machine's CPU and torch" >> "$OUT/tests.txt"
timeout "$(left 600)" python3 -m pytest -q -rfEs -p no:cacheprovider -m "not cuda" tests 2>&1 | tail -40 | tee -a "$OUT/tests.txt"
echo "gpu_check: $(( $(date +%s) - start )) s" | tee -a "$OUT/env.txt"
