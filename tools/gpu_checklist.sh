#!/usr/bin/env bash
# The GPU checklist in one command, on a lent CUDA machine: the test suite compiled (tests/conftest.py leaves the
# interpreter off where CUDA is present: every kernel test runs on the GPU), then the GPU benchmark
# (bench/gpu_run.sh), with torch / triton / CUDA / driver versions and the device name recorded beside the results.
#
# From the repository root on the GPU machine:
#   bash tools/gpu_checklist.sh                     # the whole suite, then the benchmark's quick mode
#   BENCH_MODE=full bash tools/gpu_checklist.sh     # the benchmark's full sweep (bench/gpu_run.sh full, ~8 min)
#   BENCH_MODE=none bash tools/gpu_checklist.sh tests/test_linear_logprobs.py   # chosen tests, no benchmark
#   MEMORY=0 bash tools/gpu_checklist.sh            # without the memory step (default MEMORY=1)
#   DIVERGENCE=0 bash tools/gpu_checklist.sh        # without the divergence head's benchmark (default DIVERGENCE=1)
# Time limits in seconds, so that one step running long leaves the others' results (tools/gpu_lease.sh sets them for
# one 10-minute call): TESTS_LIMIT (pytest), BENCH_BUDGET (bench/gpu_run.sh's sweep; the step gets 90 s more for its
# set-up), DIVERGENCE_BUDGET (default 120), MEMORY_LIMIT (both recipes). Unset: no limit. BENCH_ARGS and
# DIVERGENCE_ARGS: more options for python -m bench and python -m bench.divergence.
# Arguments go to pytest (default: the whole suite, slow tier included). Carried wheels in .whl/ (trl, its
# dependencies, liger-kernel: bench/README.md) are installed into /tmp/site first, as bench/gpu_run.sh does; a
# test file whose imports are missing there is reported as a collection error and the others still run.
# Writes into $OUT (default bench/results/gpu-checklist-<date>): checklist.md (versions, the pytest summary, the
# benchmark's exit), environment.json, pytest.log, pytest.xml (JUnit), and the benchmark's files.
# The memory step (MEMORY=1): both committed recipes' steps (bench/results/memory-4090-*) estimated over fake tensors
# and measured on this GPU (python -m grpo_fast.memory --measure: torch.cuda.max_memory_allocated / reserved of the
# same step, random weights), memory-<recipe>.{json,md,png}; the TRL head only where trl imports.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT="${OUT:-$REPO/bench/results/gpu-checklist-$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
BENCH_MODE="${BENCH_MODE:-quick}"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# the versions and the device, before anything can fail
python3 - "$OUT/environment.json" <<'EOF'
import json, os, platform, subprocess, sys
import numpy, torch, triton
env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
       "numpy": numpy.__version__, "cuda (torch build)": torch.version.cuda,
       "cuda available": torch.cuda.is_available()}
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    env.update({"device": props.name, "compute capability": f"{props.major}.{props.minor}",
                "memory GiB": round(props.total_memory / 2 ** 30, 1), "devices": torch.cuda.device_count()})
try:
    env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True, check=True).stdout.split("\n")[0].strip()
except (OSError, subprocess.CalledProcessError) as e:
    env["driver"] = f"unknown ({type(e).__name__})"
# BENCH_COMMIT first: the device tool sends the working tree with the git directory of the session's start
try:
    env["commit"] = os.environ.get("BENCH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
except (OSError, subprocess.CalledProcessError):
    env["commit"] = "unknown (no git here; BENCH_COMMIT unset)"
json.dump(env, open(sys.argv[1], "w"), indent=1)
print("\n".join(f"{k}: {v}" for k, v in env.items()))
if not torch.cuda.is_available():
    sys.exit("no CUDA device: this checklist compiles the kernels on a GPU (CI runs the interpreter's suite)")
EOF
[ $? -eq 0 ] || exit 1

echo "== $(date -u +%FT%TZ) pytest (compiled) $*"
# time_limit SECONDS COMMAND...: COMMAND under timeout when SECONDS is set (exit 124: it ran out)
# (SIGINT first: pytest then prints its summary and writes the JUnit file for the tests that ran)
time_limit() { local limit="$1"; shift; if [ -n "$limit" ]; then timeout -s INT -k 20 "$limit" "$@"; else "$@"; fi; }
time_limit "${TESTS_LIMIT:-}" python3 -m pytest -p no:cacheprovider -q -rfEs --continue-on-collection-errors \
  --junitxml="$OUT/pytest.xml" "$@" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

bench_rc="not run"
if [ "$BENCH_MODE" != none ]; then
  echo "== $(date -u +%FT%TZ) bench/gpu_run.sh $BENCH_MODE"
  OUT="$OUT" BENCH_COMMIT="${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" \
    time_limit "${BENCH_BUDGET:+$((BENCH_BUDGET + 90))}" bash bench/gpu_run.sh "$BENCH_MODE" ${BENCH_ARGS:-}
  bench_rc=$?
fi

divergence_rc="not run"
if [ "${DIVERGENCE:-1}" != 0 ]; then
  echo "== $(date -u +%FT%TZ) python -m bench.divergence ${DIVERGENCE_ARGS:-}"
  # shellcheck disable=SC2086  # DIVERGENCE_ARGS: options split on spaces
  time_limit "$(( ${DIVERGENCE_BUDGET:-120} + 60 ))" python3 -m bench.divergence --out "$OUT" --no-progress \
    --time-budget "${DIVERGENCE_BUDGET:-120}" ${DIVERGENCE_ARGS:-} 2>&1 | tee "$OUT/divergence.log"
  divergence_rc=${PIPESTATUS[0]}
fi

memory_rc="not run"
if [ "${MEMORY:-1}" != 0 ] && ! python3 -c "import transformers, peft" 2>/dev/null; then
  memory_rc="not run (transformers or peft missing)"
elif [ "${MEMORY:-1}" != 0 ]; then
  heads=eager,grpo_fast
  python3 -c "import trl.kernels" 2>/dev/null && heads=eager,trl,grpo_fast
  memory_rc=0
  for recipe in qwen2.5-1.5b-lora qwen2.5-0.5b-full; do
    echo "== $(date -u +%FT%TZ) memory: $recipe ($heads), estimated and measured"
    time_limit "${MEMORY_LIMIT:+$((MEMORY_LIMIT / 2))}" python3 -m grpo_fast.memory --recipe "$recipe" \
      --heads "$heads" --measure --out "$OUT/memory-$recipe" || memory_rc=$?
  done
fi

{
  echo "# GPU checklist, $(date -u +%F)"
  echo
  echo "| | |"
  echo "|---|---|"
  python3 -c "import json, sys; [print(f'| {k} | {v} |') for k, v in json.load(open(sys.argv[1])).items()]" \
    "$OUT/environment.json"
  echo
  echo "pytest (compiled, \`${*:-the whole suite}\`): exit $tests_rc"
  echo
  echo '```'
  grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT/pytest.log" | tail -n 40
  echo '```'
  echo
  echo "bench/gpu_run.sh $BENCH_MODE: exit $bench_rc"
  echo
  echo "python -m bench.divergence: exit $divergence_rc"
  echo
  echo "memory (estimate beside the measured peak: memory-<recipe>.md): exit $memory_rc"
  for f in "$OUT"/memory-*.md; do [ -f "$f" ] && { echo; sed -n '/^| |/,/^$/p' "$f"; }; done
} > "$OUT/checklist.md"
cat "$OUT/checklist.md"
[ "$tests_rc" -eq 0 ] && { [ "$bench_rc" = "not run" ] || [ "$bench_rc" -eq 0 ]; } \
  && { [ "$divergence_rc" = "not run" ] || [ "$divergence_rc" -eq 0 ]; } \
  && { [[ "$memory_rc" == "not run"* ]] || [ "$memory_rc" -eq 0 ]; }
