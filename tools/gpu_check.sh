#!/usr/bin/env bash
# The GPU checks in one run (`make gpu-check`), on a machine with an NVIDIA GPU
# and an environment that has CUDA torch and transformers (the project's `hf`
# and `dev` extras). Writes what it finds to $OUT (default /tmp/gpu-check):
#   env.txt      GPU, driver, Python, torch/CUDA and transformers versions
#   tests.log    the HF suites that place models on CUDA (bf16/fp16, records on
#                the CPU, memory given back at close, no host sync per step)
#   tests-vllm.log  the vLLM suites, when a (CUDA) vllm is installed
#   measures.txt the device's own count of synchronising calls per generation,
#                plain generate() against async-only probing (benchmarks.sync_count),
#                and cProfile of inline linear and capture-only on CUDA (benchmarks.profile)
#   scaling-*    the scaling set on CUDA (benchmarks.run --scaling-only --device cuda),
#                with vLLM's rows when vllm is installed; GPU_BATCHES (default "1 8 64")
#                and GPU_REPEATS (default 9; 6 is the fewest whose median interval reaches 95%)
#   stages.txt   (step "stages", not in the default) benchmarks.stage_timers on CUDA for
#                the async trajectory probe and the same probe inline: wall time and
#                each thread's CPU time per stage
# GPU_STEPS picks and orders the parts (default "tests syncs scaling"): with a few
# minutes of a lent machine, put first what the run is for, e.g.
#   GPU_STEPS="scaling tests" GPU_BATCHES=64 GPU_REPEATS=15 bash tools/gpu_check.sh
# Packages the machine lacks travel as wheels: tools/gpu_wheels.sh.
# Exit status: the tests' (0 when they did not run; the measurements only report).
set -u
OUT=${OUT:-/tmp/gpu-check}
PY=${PYTHON:-python3}
DTYPE=${GPU_DTYPE:-bfloat16}
REPEATS=${GPU_REPEATS:-9}
BATCHES=${GPU_BATCHES:-1 8 64}
STEPS=${GPU_STEPS:-tests syncs scaling}
for step in $STEPS; do
  case "$step" in
    tests|syncs|stages|scaling) ;;
    *) echo "gpu_check: unknown step '$step' in GPU_STEPS (tests, syncs, stages, scaling)" >&2
       exit 2 ;;
  esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
stamp() { echo "[gpu-check $(( $(date +%s) - started ))s] $*"; }

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  "$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0]);
print('torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(), torch.cuda.get_device_name(0));
print('transformers', transformers.__version__)"
  "$PY" -c "import nnsight; print('nnsight', nnsight.__version__)" 2>&1 | tail -1
  "$PY" -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

status=0
VLLM_FLAG=--no-vllm
if "$PY" -c "import vllm" >/dev/null 2>&1; then  # a CUDA build of vllm is installed
  VLLM_FLAG=--vllm
fi

run_tests() {
  stamp "tests"
  "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 600 \
    tests/adapters/test_hf_cuda.py tests/adapters/test_hf_equivalence.py \
    tests/adapters/test_hf_backend.py tests/adapters/test_hf_offload.py \
    tests/steering/test_hf_edits.py tests/test_forward_only.py \
    tests/probes/test_map_rows.py 2>&1 | tee "$OUT/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ "$VLLM_FLAG" = --vllm ]; then
    stamp "vLLM suites"
    "$PY" -m pytest -q -p no:cacheprovider -rs --timeout 900 tests/vllm 2>&1 \
      | tee "$OUT/tests-vllm.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
}

run_syncs() {
  stamp "sync count and profiles"
  {
    "$PY" -m benchmarks.sync_count --device cuda --dtype "$DTYPE" --model large --batch 64 \
      --layers all --offload auto
    # where the host's time goes on the GPU (the main thread's cProfile, over raw hooks)
    for scenario in uc_inline_linear uc_3_layers_capture_only; do
      "$PY" -m benchmarks.profile --device cuda --dtype "$DTYPE" --model tiny --batch 64 \
        --layers all --max-new-tokens 24 --scenario "$scenario" --top 25
    done
  } 2>&1 | grep -v "Loading weights" | tee "$OUT/measures.txt"
}

run_stages() {
  stamp "stage timers: async against the same probe inline"
  # Where async's extra cost goes on the GPU's host: each stage's wall time, then
  # each thread's CPU time in it (the delivery thread and the workers included).
  {
    for timing in "" --thread-time; do
      for scenario in uc_inline_trajectory uc_3_layers_async_trajectory; do
        # shellcheck disable=SC2086
        "$PY" -m benchmarks.stage_timers --device cuda --dtype "$DTYPE" --threads 0 \
          --model tiny --batch 64 --layers all --repeats 9 --scenario "$scenario" $timing
        echo "(${timing:-wall time})"
      done
    done
  } 2>&1 | grep -v "Loading weights" | tee "$OUT/stages.txt"
}

run_scaling() {
  stamp "scaling set"
  # (BATCHES unquoted: one argument per batch size)
  # shellcheck disable=SC2086
  "$PY" -m benchmarks.run --scaling-only "$VLLM_FLAG" --device cuda --dtype "$DTYPE" \
    --scaling-models large tiny --scaling-batch-sizes $BATCHES --repeats "$REPEATS" \
    --max-new-tokens 24 --job-timeout 420 --out "$OUT/scaling-run" 2>&1 \
    | grep -v "Loading weights" | tee "$OUT/scaling.log"
  for name in scaling.jsonl scaling.md environment.json; do
    cp "$OUT/scaling-run/$name" "$OUT/scaling-$name" 2>/dev/null
  done
  rm -rf "$OUT/scaling-run"
}

for step in $STEPS; do
  case "$step" in
    tests) run_tests ;;
    syncs) run_syncs ;;
    stages) run_stages ;;
    scaling) run_scaling ;;
  esac
done
stamp "done; tests exit status $status"
exit "$status"
