#!/usr/bin/env bash
# The benchmark on a lent GPU machine (python3 there: torch 2.11, triton 3.6, no network), in one command that
# ends within about 8 minutes, writing <device>-<date>.json/.md/.png and bench.log into $OUT.
#
# From the repository root on the GPU machine (see bench/README.md for the whole procedure):
#   BENCH_COMMIT=<sha> bash bench/gpu_run.sh            # the full sweep, cut by a 400 s budget (BENCH_BUDGET)
#   BENCH_COMMIT=<sha> bash bench/gpu_run.sh quick      # Qwen2.5-1.5B at 4k and 16k tokens
#   BENCH_COMMIT=<sha> bash bench/gpu_run.sh full --shapes qwen2.5-1.5b --tokens 16k   # extra args go to bench
# liger-kernel and trl (with datasets, dill and multiprocess, which trl imports) travel as wheels in .whl/ (the run
# names .whl in carry; bench/README.md has the download command); without them the Liger / TRL rows read
# "unavailable". The sweep runs the goals' point (Qwen2.5-1.5B, 16k tokens, dense then padded) first, then the
# rest by priority; what the budget leaves out is recorded as "skipped", and the files are rewritten after every
# point.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-$REPO/bench/results}"
mkdir -p "$OUT"
MODE="${1:-full}"
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
exec > >(tee -a "$OUT/bench.log") 2>&1

echo "== $(date -u +%FT%TZ) gpu_run.sh $MODE $*"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv || true

# liger-kernel, trl and trl's missing dependencies (every carried wheel), the device README's way
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# grpo_fast (its kernels included) runs from the source tree: no install
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
(cd "$REPO" && python3 -c "
import torch, triton, grpo_fast, grpo_fast.kernels
print('torch', torch.__version__, 'triton', triton.__version__, 'grpo_fast', grpo_fast.__file__)
print('device', torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO CUDA')
import importlib, importlib.metadata as m
for dist, modules in (('liger-kernel', ('liger_kernel.chunked_loss',)), ('trl', ('trl.kernels', 'trl.trainer.utils'))):
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
