#!/usr/bin/env bash
# The GPU benchmark in one command, on any machine with a CUDA GPU (python3 with torch and triton; grpo_fast runs from
# the source tree, no install), writing <device>-<date>.json/.md/.png and bench.log into $OUT (default bench/results).
#
# From the repository root (bench/README.md has the whole procedure; tools/gpu_checklist.sh runs it as one step):
#   bash bench/gpu_run.sh            # the full sweep, within a 400 s budget
#   bash bench/gpu_run.sh quick      # Qwen2.5-1.5B at 4k and 16k tokens, within a 240 s budget
#   bash bench/gpu_run.sh full --shapes qwen2.5-1.5b --tokens 16k   # extra arguments go to python -m bench
# Environment: BENCH_BUDGET (seconds: the sweep's time budget, default 400 full, 240 quick), OUT (the results folder),
# BENCH_COMMIT (the commit stamped on the results, for a copy of the tree without its .git), WHEELS (default .whl:
# wheels installed first with pip --no-index --no-deps into /tmp/site, for a machine without network; liger-kernel
# and trl with datasets, dill and multiprocess, which trl imports: bench/README.md has the download command). Without
# liger-kernel or trl their rows read "unavailable". The sweep runs the goals' point (Qwen2.5-1.5B, 16k tokens, dense
# then padded) first, then the rest by priority; what the budget leaves out is recorded as "skipped", and the files
# are rewritten after every point.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO="$PWD"
OUT="${OUT:-$REPO/bench/results}"
mkdir -p "$OUT"
MODE="${1:-full}"
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
exec > >(tee -a "$OUT/bench.log") 2>&1

echo "== $(date -u +%FT%TZ) gpu_run.sh $MODE $*"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv || true

# the wheels brought to a machine without network (liger-kernel, trl and what trl imports), without their dependencies
WHEELS="${WHEELS:-.whl}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# grpo_fast (its kernels included) runs from the source tree: no install
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
(cd "$REPO" && python3 -c "
import torch, triton, grpo_fast, grpo_fast.kernels
print('torch', torch.__version__, 'triton', triton.__version__, 'grpo_fast', grpo_fast.__file__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')
import importlib, importlib.metadata as m
for dist, modules in (('liger-kernel', ('liger_kernel.chunked_loss',)), ('trl', ('trl.kernels', 'trl.trainer.utils')),
                      ('cut-cross-entropy', ('cut_cross_entropy',))):
    try:
        for module in modules:
            importlib.import_module(module)
        print(dist, m.version(dist))
    except Exception as e:
        print(dist, 'not importable:', type(e).__name__, e)
")

case "$MODE" in
  quick) ARGS=(--quick --time-budget "${BENCH_BUDGET:-240}") ;;
  full) ARGS=(--time-budget "${BENCH_BUDGET:-400}") ;;
  *) echo "usage: bash bench/gpu_run.sh [full|quick] [python -m bench options]"; exit 2 ;;
esac
(cd "$REPO" && python3 -m bench "${ARGS[@]}" --out "$OUT" --no-progress "$@")
rc=$?
echo "== exit $rc"
ls -la "$OUT"
exit $rc
