#!/usr/bin/env bash
# The GPU checklist (tools/gpu_checklist.sh) fitted to one device call of a 15-minute lease (about 8 minutes, so a
# second call can follow): the kernel tests' fast tier compiled (test_gpu.py's cases and every kernel family's),
# the benchmark's quick sweep, the divergence head's benchmark at GPU token counts, the memory step measured; then
# the kernel tests' slow tier in the time left. Each step is time-boxed, and everything is packed into one archive,
# $OUT/gpu-checklist.tgz (the device tool returns at most 8 files), beside checklist.md.
#
# BENCH_ARGS, DIVERGENCE_ARGS (default --tokens 4096,16384) and the budgets pass through (tools/gpu_checklist.sh).
# Here: download the peers' wheels into .whl/ (bench/README.md); then one device run, carry [".whl"],
# timeout_s 520:   bash tools/gpu_lease.sh
set -uo pipefail
cd "$(dirname "$0")/.."
LEASE_SECONDS="${LEASE_SECONDS:-460}"          # this script ends within it (the archive included)
RESULTS="/tmp/gpu-checklist-$(date -u +%Y%m%dT%H%M%SZ)"
RETURN="${OUT:-$PWD/runs/gpu-lease}"
mkdir -p "$RESULTS" "$RETURN"
export TRITON_CACHE_DIR=/tmp/triton-cache     # shared by the workers and the steps: each variant compiled once
KERNEL_TESTS=(tests/test_gpu.py tests/test_linear_logprobs.py tests/test_frozen_head.py tests/test_lora_head.py
  tests/test_confident_tokens.py tests/test_nonfinite.py tests/test_grpo_token.py tests/test_loss_types.py
  tests/test_api.py tests/test_softmax_stats.py tests/test_large_offsets.py tests/test_gemm.py tests/test_grad_scale.py
  tests/test_divergence.py tests/test_divergence_boundary.py tests/test_loss_with_teacher.py tests/test_compile.py
  tests/test_host_syncs.py)
WORKERS=(-n 14 --dist worksteal)
# the checklist's tests: the fast tier, the slow one after the other steps in the time left; FIRST_TIER="slow or not
# slow": both tiers first (a rerun after fixes)
FIRST_TIER="${FIRST_TIER:-not slow}"

OUT="$RESULTS" BENCH_MODE=quick BENCH_BUDGET="${BENCH_BUDGET:-75}" TESTS_LIMIT="${TESTS_LIMIT:-110}" \
  DIVERGENCE_BUDGET="${DIVERGENCE_BUDGET:-40}" DIVERGENCE_ARGS="${DIVERGENCE_ARGS:---tokens 4096,16384}" \
  MEMORY_LIMIT="${MEMORY_LIMIT:-50}" BENCH_ARGS="${BENCH_ARGS:-}" \
  timeout -s INT -k 10 $((LEASE_SECONDS - 40)) bash tools/gpu_checklist.sh "${WORKERS[@]}" -m "$FIRST_TIER" \
  "${KERNEL_TESTS[@]}"
echo "== checklist exit $? after ${SECONDS} s"

left=$((LEASE_SECONDS - 25 - SECONDS))
if [ "$FIRST_TIER" = "not slow" ] && [ "$left" -gt 30 ]; then
  echo "== $(date -u +%FT%TZ) the kernel tests' slow tier, compiled, within ${left} s"
  PYTHONPATH="/tmp/site:$PWD" timeout -s INT -k 10 "$left" python3 -m pytest -p no:cacheprovider -q -rfE \
    "${WORKERS[@]}" -m slow --junitxml="$RESULTS/pytest-slow.xml" "${KERNEL_TESTS[@]}" 2>&1 \
    | tee "$RESULTS/pytest-slow.log" | tail -n 40
fi
tar czf "$RETURN/gpu-checklist.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"
cp "$RESULTS/checklist.md" "$RETURN/" 2>/dev/null
echo "== packed after ${SECONDS} s: $RETURN/gpu-checklist.tgz"
