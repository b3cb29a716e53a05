#!/usr/bin/env bash
# The GPU check: what only a GPU shows, in one call of the machine lent for it (one H200; 10
# minutes a call, 15 in all, a start 1-2 of them), run from the repository root:
#
#     bash .ci/gpu_check.sh                  # results under $OUT (default gpu_out)
#
# Before it, here: `make wheel` (the abi3 wheel in dist/, and dist/offload_adam-commit.json beside it:
# the commit and a digest of the sources it was built from), and the peers that machine lacks as
# wheels in .whl/ (torchao for the quantized tests, the int8 placement cases and torchao's
# optimizer; diffusers for the group-offloading peers); carry dist and .whl. That machine's own
# python3 and torch are used: neither is installed here.
#
# GPU_CHECK_DRY=1 runs the same script without a GPU (CI runs it: .ci/run), so that a typo, an
# ImportError or a bad flag fails there and not on the one start: every step on the simulated
# device (offload_adam.testing.simulated_device()) at tiny sizes, the CUDA tests collected and
# skipped, CSAN skipped, each with a line saying so; the package is the one python3 imports (no
# wheel), and the stamp is made and checked for the tree alone. It exits non-zero on any error.
#
# The steps, in order, each under a fixed cap (DEADLINE_S, 480 s by default, scales the steps'
# caps), so that none can starve the ones after it; with the preflight's they sum to 475 s.
# A step that fails or runs out of its cap is recorded and the next one runs; the check exits
# non-zero if any did. GPU_CHECK_STEPS names a subset of the steps after the preflight.
#   preflight   60 s  versions, the wheel against this tree, CUDA: exits at once on any failure
#                     (60 s whatever DEADLINE_S: a fresh machine's first imports are slow)
#   tests      115 s  pytest -m cuda (the second CUDA review's hazards 1-5 among them), full log
#   weights     65 s  bench --weights: ours against accelerate's cpu_offload (and diffusers'), the
#                     model resident beside them: tokens/s, TTFT, peak GPU memory, tokens equal
#   placement   95 s  bench --gpu-placement: stream, cpu and auto on a 1B Llama, a quarter of it
#                     resident, bf16 and int8: TTFT, tokens/s, peak GPU memory, bytes, calls
#   optimizer  100 s  .ci/gpu_bench.py --steps 8: the step of 1.1B bf16 against torch fused,
#                     peak GPU memory per contender
#   csan        40 s  three tests under torch's CUDA stream sanitizer
# Results in $OUT, four files: env.txt (the preflight and the steps' outcome), tests.txt (pytest's
# full logs), bench.txt (the benches' output), bench.json (their results, one key per bench).
set -euo pipefail
OUT=${OUT:-gpu_out}
DRY=${GPU_CHECK_DRY:-0}
DEADLINE_S=${DEADLINE_S:-480}
STEPS=${GPU_CHECK_STEPS:-tests weights placement optimizer csan}  # the steps after the preflight (a subset: the test of the dry run)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
SIM=()
[ "$DRY" = 1 ] && SIM=(--simulate)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 OFFLOAD_ADAM_CACHE_DIR="$WORK/cache"  # auto's calibration: measured in this run, kept nowhere
: > "$OUT/env.txt"
: > "$OUT/tests.txt"
: > "$OUT/bench.txt"
start=$SECONDS
cap() { local c=$(($1 * DEADLINE_S / 480)); echo $((c < 1 ? 1 : c)); }  # a step's share of DEADLINE_S (timeout 0 would be none)
log() { echo "$*" | tee -a "$OUT/env.txt"; }
trap 'log "PREFLIGHT FAILED at line $LINENO (exit $?): see above"; exit 1' ERR

# -- preflight: exits at once on any failure ------------------------------------------------------
log "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): $([ "$DRY" = 1 ] && echo "DRY RUN (no GPU: the simulated device, tiny sizes)" || echo "on the GPU"), DEADLINE_S=$DEADLINE_S"
pre_end=$((SECONDS + 60))  # the preflight's 60 s in all (not scaled: a short DEADLINE_S still gets a real one)
pre() { local l=$((pre_end - SECONDS)); echo $((l < 1 ? 1 : l)); }  # what is left of it
if [ "$DRY" = 1 ]; then
  timeout "$(pre)" python3 .ci/gpu_preflight.py stamp --no-wheel --out "$WORK/offload_adam-commit.json" 2>&1 | tee -a "$OUT/env.txt"
  timeout "$(pre)" python3 .ci/gpu_preflight.py check --dry --stamp "$WORK/offload_adam-commit.json" 2>&1 | tee -a "$OUT/env.txt"
  log "dry run: nvidia-smi skipped (no GPU)"
else
  shopt -s nullglob
  wheels=(dist/offload_adam-*-abi3-*.whl)
  peers=(.whl/*.whl)
  shopt -u nullglob
  [ "${#wheels[@]}" -eq 1 ] || { log "PREFLIGHT FAILED: want one wheel in dist/ (make wheel), found ${#wheels[@]}"; exit 1; }
  SITE=$WORK/site  # the wheel and the peers, on PYTHONPATH for every step
  timeout "$(pre)" python3 -m pip install -q --no-deps --no-index --no-compile --no-cache-dir --target "$SITE" "${wheels[0]}" "${peers[@]}" 2>&1 | tee -a "$OUT/env.txt"
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  { timeout "$(pre)" nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; lscpu | grep -E "Model name|^CPU\(s\)" || true; } 2>&1 | tee -a "$OUT/env.txt"
  timeout "$(pre)" python3 .ci/gpu_preflight.py check --stamp dist/offload_adam-commit.json --site "$SITE" 2>&1 | tee -a "$OUT/env.txt"
fi
timeout "$(pre)" python3 -m offload_adam env 2>&1 | tee -a "$OUT/env.txt"
log "preflight: $((SECONDS - start)) s"
trap - ERR

# -- the steps: each under its cap, a failure recorded --------------------------------------------
summary=()
failed=0
# step NAME CAP FILE COMMAND...: COMMAND's output to the screen and appended to $OUT/FILE.
step() {
  local name=$1 limit=$2 file=$3 t0=$SECONDS rc=0 what
  shift 3
  echo "=== $name (cap ${limit} s): $*" | tee -a "$OUT/$file"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$OUT/$file" || rc=$?
  case $rc in
    0) what=ok ;;
    124 | 137) what="TIMED OUT (cap ${limit} s)"; failed=1 ;;
    *) what="FAILED (exit $rc)"; failed=1 ;;
  esac
  summary+=("$(printf '%-10s %-28s %4d s' "$name" "$what" $((SECONDS - t0)))")
  echo "=== $name: $what, $((SECONDS - t0)) s" | tee -a "$OUT/$file"
}
skip() {  # skip NAME FILE WHY
  echo "=== $1: skipped: $3" | tee -a "$OUT/$2"
  summary+=("$(printf '%-10s %-28s' "$1" "skipped ($3)")")
}
wants() { [[ " $STEPS " == *" $1 "* ]]; }
PYTEST=(python3 -m pytest -p no:cacheprovider -v -rfEs --durations=15 -o faulthandler_timeout=60)
# A hung test fails after 60 s and the next runs, where pytest-timeout is installed (the GPU
# machine's image has it); elsewhere faulthandler_timeout at least prints where it hangs.
if python3 -c "import pytest_timeout" 2>/dev/null; then PYTEST+=(--timeout=60); fi

if wants tests; then
  # The modules holding CUDA tests only (a quicker collection, and another module's import error
  # cannot stop it; --continue-on-collection-errors for theirs).
  mapfile -t cuda_files < <(grep -l "pytest.mark.cuda" tests/test_*.py)
  [ "$DRY" = 1 ] && echo "dry run: the CUDA tests are collected and skipped (no CUDA device)" | tee -a "$OUT/tests.txt"
  step tests "$(cap 115)" tests.txt "${PYTEST[@]}" --continue-on-collection-errors -m cuda "${cuda_files[@]}"
fi
if wants weights; then
  mkdir -p "$WORK/nvme"
  if [ "$DRY" = 1 ]; then
    step weights "$(cap 65)" bench.txt python3 -m offload_adam bench --weights "$WORK/nvme" --weights-gb 0.02 --rounds 1 --prefetch 1 --simulate --json "$WORK/weights.json"
  else
    step weights "$(cap 65)" bench.txt python3 -m offload_adam bench --weights "$WORK/nvme" --weights-gb 1 --rounds 3 --json "$WORK/weights.json"
  fi
fi
if wants placement; then
  step placement "$(cap 95)" bench.txt python3 -m offload_adam bench --gpu-placement "${SIM[@]}" --json "$WORK/placement.json"
fi
if wants optimizer; then
  if [ "$DRY" = 1 ]; then
    step optimizer "$(cap 100)" bench.txt python3 .ci/gpu_bench.py --device cpu --layers 2 --d-model 64 --heads 4 --vocab 256 --ctx 32 --batch 2 --steps 3 --json "$WORK/optimizer.json"
  else
    step optimizer "$(cap 100)" bench.txt python3 .ci/gpu_bench.py --steps 8 --json "$WORK/optimizer.json"
  fi
fi
if wants csan; then
  # torch's CUDA stream sanitizer (CSAN) on three tests, the quantized ones kept out: it calls
  # data_ptr() on every CUDA tensor argument, which a wrapper subclass (torchao's) has not. It
  # reports an access on one stream unordered with another's to the same pointer while both are
  # live, so it cannot see the second review's hazards 2 and 3 (nor the first review's 5 and 10):
  # it forgets a pointer's history when the memory is freed, and those are reuses of freed memory
  # (the lag tests above catch them); it keys accesses by each view's data_ptr(), so of a ring slot
  # only the part at offset 0 is matched against the slot's copy. It walks the Python stack at
  # every kernel launch: slow, hence three tests, the cheapest first.
  if [ "$DRY" = 1 ]; then
    skip csan tests.txt "CSAN needs CUDA; dry run"
  else
    step csan "$(cap 40)" tests.txt env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}" \
      "tests/test_cuda.py::test_cuda_weights_streamed_are_exact_and_bounded[1-cpu]" \
      "tests/test_cuda.py::test_cuda_activations_offloaded_are_exact_and_save_memory[cpu]" \
      "tests/test_cuda.py::test_cuda_training_with_streamed_weights_then_eval_and_generate_match_resident"
  fi
fi

# bench.json: each bench's results under its name (null: it wrote none), and the steps' outcome
python3 - "$WORK" "$OUT/bench.json" "${summary[@]}" <<'EOF' || failed=1
import json, os, sys
work, out, summary = sys.argv[1], sys.argv[2], sys.argv[3:]
res = {"steps": summary}
for name in ("weights", "placement", "optimizer"):
    p = os.path.join(work, name + ".json")
    try:
        with open(p) as f:
            res[name] = json.load(f)
    except FileNotFoundError:
        res[name] = None
    except ValueError as e:  # cut short mid-write
        res[name] = {"unreadable": str(e)}
with open(out, "w") as f:
    json.dump(res, f, indent=1, default=str)
EOF
log "--- steps"
for s in "${summary[@]}"; do log "$s"; done
log "gpu_check: $((SECONDS - start)) s, $([ "$failed" = 0 ] && echo "every step ok" || echo "FAILED (see above)")"
exit "$failed"
