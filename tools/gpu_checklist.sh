#!/usr/bin/env bash
# The GPU checklist in one command, on any machine with a CUDA GPU: the test suite compiled (tests/conftest.py turns
# the Triton interpreter on only without CUDA, so every kernel test runs on the GPU), the GPU benchmark
# (bench/gpu_run.sh), the divergence head's benchmark and the memory step, with the python / torch / triton / CUDA /
# driver versions and the device recorded beside the results. Run it from a checkout (grpo_fast runs from the
# source tree) in an environment with the test extra (pip install -e ".[test]").
#
#   bash tools/gpu_checklist.sh                      # the whole suite, the benchmark's quick sweep, divergence, memory
#   bash tools/gpu_checklist.sh --bench full         # the benchmark's full sweep instead of its quick one
#   bash tools/gpu_checklist.sh --quick --workers 8  # a short check of about 8 minutes (below)
#   bash tools/gpu_checklist.sh --bench none --no-divergence --no-memory -- tests/test_linear_logprobs.py -k frozen
#
# Options (each also read from the environment variable in brackets; a flag wins over its variable). Times are in
# seconds; a step that runs out of time is stopped (exit 124) and the other steps still run.
#   --out DIR                 the results folder [OUT] (default bench/results/gpu-checklist-<UTC date and time>)
#   --tests-limit S           time limit of the test step [TESTS_LIMIT] (default none)
#   --workers N               pytest-xdist workers sharing the GPU, or auto [WORKERS] (default 1: one process;
#                             with --quick, --dist worksteal)
#   --bench quick|full|none   the benchmark's sweep [BENCH_MODE] (default quick)
#   --bench-budget S          the sweep's time budget, points left out recorded as skipped [BENCH_BUDGET] (default:
#                             bench/gpu_run.sh's, 240 quick, 400 full); the step is given 90 s more for its set-up
#   --bench-args "..."        more options for python -m bench [BENCH_ARGS]
#   --divergence-budget S     the divergence benchmark's time budget [DIVERGENCE_BUDGET] (default 120)
#   --divergence-args "..."   more options for python -m bench.divergence [DIVERGENCE_ARGS]
#   --no-divergence           without the divergence benchmark [DIVERGENCE=0]
#   --memory-limit S          time limit of the memory step, both recipes together [MEMORY_LIMIT] (default none)
#   --no-memory               without the memory step [MEMORY=0]
#   --recipe-steps N          the GPU recipe's training steps to run (0: none) [RECIPE_STEPS] (default 2; 0 with
#                             --quick): examples/train_gsm8k.py --preset gpu on random Qwen2.5-1.5B weights with
#                             LoRA, --max-memory-gb 24, full-length completions; examples/step_report.py then tables
#                             each step's time by phase, the loss head's share and the peak beside the memory step's
#                             estimate (recipe.md)
#   --recipe-limit S          time limit of the recipe step [RECIPE_LIMIT] (default none)
#   --tune                    also time the tile candidates [TUNE=1] (default off): tools/gpu_tune.py for layer 1's
#                             forward and the trained head's chunk at Qwen2.5-1.5B's head, and for the divergence
#                             head and the fused distillation loss (student D 896, teacher 1536, 4096 tokens), each
#                             beside cuBLAS's products (tune-*.json, tune.log)
#   --tune-limit S            time limit of the tune step, its four runs together [TUNE_LIMIT] (default 300)
#   --total S                 the whole run ends within S: each step gets at most the time left [TOTAL_LIMIT]
#                             (default none; 480 with --quick)
#   --quick                   a short check [QUICK=1]: the kernel tests only (KERNEL_TESTS in this script), their
#                             fast tier first (-m "not slow"), then the benchmark's quick sweep, the divergence
#                             benchmark at 4096 and 16384 tokens and the memory step, then the kernel tests' slow tier
#                             in the time left. Its defaults, each overridden by its flag: --total 480, --workers auto,
#                             --tests-limit 110, --bench-budget 75, --divergence-budget 40, --memory-limit 50
#   --first-tier EXPR         with --quick: the -m expression of the first test step [FIRST_TIER] (default "not
#                             slow"; "slow or not slow": both tiers first, no second test step, e.g. after a fix)
#   --wheels DIR              wheels to install first [WHEELS] (default .whl): for a machine without network, the
#                             packages it lacks (trl and what trl imports, liger-kernel: bench/README.md), installed
#                             with pip --no-index --no-deps into /tmp/site, which goes on PYTHONPATH
#   --commit SHA              the commit stamped on the results [BENCH_COMMIT] (default git rev-parse HEAD): for a
#                             copy of the tree without its .git
#   -h, --help                this text
# Other arguments (after --, or any argument that is not an option above) go to pytest; by default the whole suite,
# both tiers (the kernel test files with --quick). A test file whose imports are missing is reported as a collection
# error and the others still run.
#
# Writes into the results folder: checklist.md (the versions, each step's exit, the failed tests, the memory tables),
# environment.json, pytest.log and pytest.xml (JUnit; with --quick also pytest-slow.log / .xml), the benchmark's
# files and bench.log, divergence.log and its files, tune.log and tune-*.json (--tune),
# memory-<recipe>.{json,md,png}. The memory step: both committed recipes' steps (bench/results/memory-4090-*)
# estimated over fake tensors and measured on this GPU (python examples/memory_gsm8k.py --measure:
# torch.cuda.max_memory_allocated / reserved of the same step, random weights); it needs transformers and peft, and
# includes TRL's head where trl imports. Exit status 0 when every step that ran passed
# (--quick's slow tier, which has the time left: when no test failed before its time ran out).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
REPO="$PWD"

usage() { sed -n '2,/^set -uo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
fail_usage() { echo "gpu_checklist.sh: $1 (--help lists the options)" >&2; exit 2; }

# the kernel tests (--quick): every kernel family's tests and the GPU-only cases
KERNEL_TESTS=(tests/test_gpu.py tests/test_linear_logprobs.py tests/test_frozen_head.py tests/test_lora_head.py
  tests/test_confident_tokens.py tests/test_nonfinite.py tests/test_grpo_token.py tests/test_loss_types.py
  tests/test_api.py tests/test_softmax_stats.py tests/test_large_offsets.py tests/test_gemm.py tests/test_grad_scale.py
  tests/test_divergence.py tests/test_divergence_boundary.py tests/test_loss_with_teacher.py tests/test_compile.py
  tests/test_host_syncs.py)

PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) usage; exit 0 ;;
    --quick) QUICK=1 ;;
    --no-divergence) DIVERGENCE=0 ;;
    --no-memory) MEMORY=0 ;;
    --tune) TUNE=1 ;;
    --out | --tests-limit | --workers | --bench | --bench-budget | --bench-args | --divergence-budget | \
      --divergence-args | --memory-limit | --recipe-steps | --recipe-limit | --tune-limit | --total | --first-tier | \
      --wheels | --commit)
      [ $# -ge 2 ] || fail_usage "$1 needs a value"
      case "$1" in
        --out) OUT="$2" ;;
        --tests-limit) TESTS_LIMIT="$2" ;;
        --workers) WORKERS="$2" ;;
        --bench) BENCH_MODE="$2" ;;
        --bench-budget) BENCH_BUDGET="$2" ;;
        --bench-args) BENCH_ARGS="$2" ;;
        --divergence-budget) DIVERGENCE_BUDGET="$2" ;;
        --divergence-args) DIVERGENCE_ARGS="$2" ;;
        --memory-limit) MEMORY_LIMIT="$2" ;;
        --recipe-steps) RECIPE_STEPS="$2" ;;
        --tune-limit) TUNE_LIMIT="$2" ;;
        --recipe-limit) RECIPE_LIMIT="$2" ;;
        --total) TOTAL_LIMIT="$2" ;;
        --first-tier) FIRST_TIER="$2" ;;
        --wheels) WHEELS="$2" ;;
        --commit) BENCH_COMMIT="$2" ;;
      esac
      shift ;;
    --) shift; PYTEST_ARGS+=("$@"); break ;;
    *) PYTEST_ARGS+=("$1") ;;
  esac
  shift
done

QUICK="${QUICK:-0}"
if [ "$QUICK" = 1 ]; then
  TOTAL_LIMIT="${TOTAL_LIMIT:-480}" WORKERS="${WORKERS:-auto}" TESTS_LIMIT="${TESTS_LIMIT:-110}"
  BENCH_BUDGET="${BENCH_BUDGET:-75}" DIVERGENCE_BUDGET="${DIVERGENCE_BUDGET:-40}" MEMORY_LIMIT="${MEMORY_LIMIT:-50}"
  DIVERGENCE_ARGS="${DIVERGENCE_ARGS:---tokens 4096,16384}" FIRST_TIER="${FIRST_TIER:-not slow}"
  RECIPE_STEPS="${RECIPE_STEPS:-0}"
  [ ${#PYTEST_ARGS[@]} -gt 0 ] || PYTEST_ARGS=("${KERNEL_TESTS[@]}")
fi
OUT="${OUT:-$REPO/bench/results/gpu-checklist-$(date -u +%Y%m%dT%H%M%SZ)}"
BENCH_MODE="${BENCH_MODE:-quick}"
DIVERGENCE="${DIVERGENCE:-1}" MEMORY="${MEMORY:-1}" DIVERGENCE_BUDGET="${DIVERGENCE_BUDGET:-120}"
TESTS_LIMIT="${TESTS_LIMIT:-}" BENCH_BUDGET="${BENCH_BUDGET:-}" MEMORY_LIMIT="${MEMORY_LIMIT:-}"
TOTAL_LIMIT="${TOTAL_LIMIT:-}" WORKERS="${WORKERS:-1}" WHEELS="${WHEELS:-.whl}"
RECIPE_STEPS="${RECIPE_STEPS:-2}" RECIPE_LIMIT="${RECIPE_LIMIT:-}"
TUNE="${TUNE:-0}" TUNE_LIMIT="${TUNE_LIMIT:-300}"
case "$BENCH_MODE" in
  quick | full | none) ;;
  *) fail_usage "--bench takes quick, full or none, not '$BENCH_MODE'" ;;
esac
[[ "$RECIPE_STEPS" =~ ^[0-9]+$ ]] || fail_usage "--recipe-steps takes a whole number, not '$RECIPE_STEPS'"
for value in "$TESTS_LIMIT" "$BENCH_BUDGET" "$DIVERGENCE_BUDGET" "$MEMORY_LIMIT" "$RECIPE_LIMIT" "$TOTAL_LIMIT" \
  "$TUNE_LIMIT"; do
  [[ -z "$value" || "$value" =~ ^[0-9]+$ ]] || fail_usage "a time is a whole number of seconds, not '$value'"
done
[[ "$WORKERS" =~ ^([0-9]+|auto)$ ]] || fail_usage "--workers takes a number or auto, not '$WORKERS'"
XDIST=()
[ "$WORKERS" = 1 ] || XDIST=(-n "$WORKERS")
# the kernel test files are few and long: their cases are shared out one by one, not a file to a worker
[ "$WORKERS" = 1 ] || [ "$QUICK" != 1 ] || XDIST+=(--dist worksteal)
mkdir -p "$OUT"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1 WHEELS

if compgen -G "$WHEELS/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
[ -z "${BENCH_COMMIT:-}" ] || export BENCH_COMMIT

# the versions and the device, before anything can fail
python3 - "$OUT/environment.json" <<'EOF' || exit 1
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

SUMMARY_SECONDS=20  # kept for the summary when --total is set
# time_left: the seconds --total leaves (after the summary's share); nothing when --total is unset
time_left() { [ -z "$TOTAL_LIMIT" ] || echo $((TOTAL_LIMIT - SUMMARY_SECONDS - SECONDS)); }
# capped LIMIT: the smaller of LIMIT and the time left (either may be empty: no limit)
capped() {
  local limit="$1" left
  left="$(time_left)"
  if [ -z "$left" ] || { [ -n "$limit" ] && [ "$limit" -le "$left" ]; }; then echo "$limit"; else echo "$left"; fi
}
# time_limit SECONDS COMMAND...: COMMAND under timeout when SECONDS is set (exit 124: it ran out); SIGINT first, so
# pytest prints its summary and writes the JUnit file for the tests that ran
time_limit() { local limit="$1"; shift; if [ -n "$limit" ]; then timeout -s INT -k 20 "$limit" "$@"; else "$@"; fi; }
NO_TIME="not run (no time left)"

FIRST=()
SHOWN="${PYTEST_ARGS[*]:-(the whole suite)}"  # the command's arguments, as checklist.md shows them
[ "$QUICK" = 1 ] && FIRST=(-m "$FIRST_TIER") && SHOWN="-m \"$FIRST_TIER\" $SHOWN"
[ "$WORKERS" = 1 ] || SHOWN="${XDIST[*]} $SHOWN"
tests_rc="$NO_TIME"
limit="$(capped "$TESTS_LIMIT")"
if [ -z "$limit" ] || [ "$limit" -gt 10 ]; then
  echo "== $(date -u +%FT%TZ) pytest (compiled) $SHOWN"
  time_limit "$limit" python3 -m pytest -p no:cacheprovider -q -rfEs --continue-on-collection-errors \
    --junitxml="$OUT/pytest.xml" "${XDIST[@]}" "${FIRST[@]}" "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/pytest.log"
  tests_rc=${PIPESTATUS[0]}
fi

bench_rc="not run"
if [ "$BENCH_MODE" != none ]; then
  budget="${BENCH_BUDGET:-$([ "$BENCH_MODE" = quick ] && echo 240 || echo 400)}"
  limit="$(capped $((budget + 90)))"
  bench_rc="$NO_TIME"
  if [ "$((limit - 90))" -lt "$budget" ]; then budget=$((limit - 90)); fi
  if [ "$budget" -gt 10 ]; then
    echo "== $(date -u +%FT%TZ) bench/gpu_run.sh $BENCH_MODE (budget $budget s)"
    stamp="${BENCH_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    # shellcheck disable=SC2086  # BENCH_ARGS: options split on spaces
    OUT="$OUT" BENCH_BUDGET="$budget" BENCH_COMMIT="$stamp" time_limit "$limit" \
      bash bench/gpu_run.sh "$BENCH_MODE" ${BENCH_ARGS:-}
    bench_rc=$?
  fi
fi

divergence_rc="not run"
if [ "$DIVERGENCE" != 0 ]; then
  budget="$DIVERGENCE_BUDGET"
  limit="$(capped $((budget + 60)))"
  divergence_rc="$NO_TIME"
  if [ "$((limit - 60))" -lt "$budget" ]; then budget=$((limit - 60)); fi
  if [ "$budget" -gt 10 ]; then
    echo "== $(date -u +%FT%TZ) python -m bench.divergence --time-budget $budget ${DIVERGENCE_ARGS:-}"
    # shellcheck disable=SC2086  # DIVERGENCE_ARGS: options split on spaces
    time_limit "$limit" python3 -m bench.divergence --out "$OUT" --no-progress --time-budget "$budget" \
      ${DIVERGENCE_ARGS:-} 2>&1 | tee "$OUT/divergence.log"
    divergence_rc=${PIPESTATUS[0]}
  fi
fi

# the served-teacher loss (bench/served.py): with the divergence bench, at its default point (N 4096, K 8 and 256)
served_rc="not run"
if [ "$DIVERGENCE" != 0 ]; then
  limit="$(capped 300)"
  served_rc="$NO_TIME"
  if [ "$limit" -gt 60 ]; then
    echo "== $(date -u +%FT%TZ) python -m bench.served"
    time_limit "$limit" python3 -m bench.served --out "$OUT" --no-progress 2>&1 | tee "$OUT/served.log"
    served_rc=${PIPESTATUS[0]}
  fi
fi

tune_rc="not run"
if [ "$TUNE" != 0 ] && [ "$(capped "$TUNE_LIMIT")" -le 20 ]; then
  tune_rc="$NO_TIME"
elif [ "$TUNE" != 0 ]; then
  limit="$(capped "$TUNE_LIMIT")"
  echo "== $(date -u +%FT%TZ) tools/gpu_tune.py: layer 1's forward, the trained head's chunk, the divergence head," \
    "the fused distillation loss"
  {
    worst=0
    for head in logprobs trained divergence distillation; do
      time_limit "$((limit / 4))" python3 tools/gpu_tune.py --head "$head" --out "$OUT/tune-$head.json"
      rc=$?
      [ "$rc" -gt "$worst" ] && worst=$rc
    done
    exit "$worst"
  } 2>&1 | tee "$OUT/tune.log"
  tune_rc=${PIPESTATUS[0]}
fi

memory_rc="not run"
if [ "$MEMORY" != 0 ] && ! python3 -c "import transformers, peft" 2>/dev/null; then
  memory_rc="not run (transformers or peft missing)"
elif [ "$MEMORY" != 0 ]; then
  heads=eager,grpo_fast
  python3 -c "import trl.kernels" 2>/dev/null && heads=eager,trl,grpo_fast
  memory_rc=0
  for recipe in qwen2.5-1.5b-lora qwen2.5-0.5b-full; do
    limit="$(capped "${MEMORY_LIMIT:+$((MEMORY_LIMIT / 2))}")"
    if [ -n "$limit" ] && [ "$limit" -le 10 ]; then
      memory_rc="$NO_TIME for $recipe"
      break
    fi
    echo "== $(date -u +%FT%TZ) memory: $recipe ($heads), estimated and measured"
    time_limit "$limit" python3 examples/memory_gsm8k.py --recipe "$recipe" --heads "$heads" --measure \
      --out "$OUT/memory-$recipe" || memory_rc=$?
  done
fi

recipe_rc="not run"
if [ "$RECIPE_STEPS" -gt 0 ] && ! python3 -c "import transformers, peft" 2>/dev/null; then
  recipe_rc="not run (transformers or peft missing)"
elif [ "$RECIPE_STEPS" -gt 0 ]; then
  limit="$(capped "$RECIPE_LIMIT")"
  if [ -n "$limit" ] && [ "$limit" -le 30 ]; then
    recipe_rc="$NO_TIME"
  else
    echo "== $(date -u +%FT%TZ) the GPU recipe: $RECIPE_STEPS steps, Qwen2.5-1.5B LoRA, 24 GB"
    rm -rf "$OUT/recipe"
    time_limit "$limit" python3 examples/train_gsm8k.py --preset gpu --random-init --config-from qwen2.5-1.5b \
      --lora-r 16 --max-memory-gb 24 --force-full-length --max-steps "$RECIPE_STEPS" --eval-samples 0 \
      --save-every 0 --output-dir "$OUT/recipe" --memory-report "$OUT/recipe-memory.jsonl" 2>&1 \
      | tee "$OUT/recipe.log"
    recipe_rc=${PIPESTATUS[0]}
    if [ -f "$OUT/recipe/metrics.jsonl" ]; then
      estimate=()
      [ -f "$OUT/memory-qwen2.5-1.5b-lora.json" ] && estimate=(--estimate "$OUT/memory-qwen2.5-1.5b-lora.json")
      python3 examples/step_report.py "$OUT/recipe" --memory-report "$OUT/recipe-memory.jsonl" "${estimate[@]}" \
        --out "$OUT/recipe.md"
    fi
  fi
fi

slow_rc="not run"
if [ "$QUICK" = 1 ] && [ "$FIRST_TIER" = "not slow" ]; then
  limit="$(time_left)"
  slow_rc="$NO_TIME"
  if [ -z "$limit" ] || [ "$limit" -gt 30 ]; then
    echo "== $(date -u +%FT%TZ) pytest (compiled) -m slow, within ${limit:-no limit} s"
    time_limit "$limit" python3 -m pytest -p no:cacheprovider -q -rfE --continue-on-collection-errors \
      --junitxml="$OUT/pytest-slow.xml" "${XDIST[@]}" -m slow "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/pytest-slow.log"
    slow_rc=${PIPESTATUS[0]}
  fi
fi

exit_of() { if [ "$1" = 124 ]; then echo "exit 124 (out of time)"; else echo "exit $1"; fi; }
failures() { grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed)" "$1" | tail -n 40; }
{
  echo "# GPU checklist, $(date -u +%F)"
  echo
  echo "| | |"
  echo "|---|---|"
  python3 -c "import json, sys; [print(f'| {k} | {v} |') for k, v in json.load(open(sys.argv[1])).items()]" \
    "$OUT/environment.json"
  echo
  echo "pytest (compiled, \`$SHOWN\`): $(exit_of "$tests_rc")"
  echo
  echo '```'
  [ -f "$OUT/pytest.log" ] && failures "$OUT/pytest.log"
  echo '```'
  if [ "$slow_rc" != "not run" ]; then
    echo
    echo "pytest (compiled, the slow tier, \`-m slow\`): $(exit_of "$slow_rc")"
    echo
    echo '```'
    [ -f "$OUT/pytest-slow.log" ] && failures "$OUT/pytest-slow.log"
    echo '```'
  fi
  echo
  echo "bench/gpu_run.sh $BENCH_MODE: $(exit_of "$bench_rc")"
  echo
  echo "python -m bench.divergence: $(exit_of "$divergence_rc")"
  echo
  echo "python -m bench.served (served.md): $(exit_of "$served_rc")"
  echo
  echo "tools/gpu_tune.py, the tile candidates (tune.log): $(exit_of "$tune_rc")"
  [ -f "$OUT/tune.log" ] && { echo; echo '```'; cat "$OUT/tune.log"; echo '```'; }
  echo
  echo "memory (estimate beside the measured peak: memory-<recipe>.md): $(exit_of "$memory_rc")"
  for f in "$OUT"/memory-*.md; do [ -f "$f" ] && { echo; sed -n '/^| GiB |/,/^$/p' "$f"; }; done
  echo
  echo "the GPU recipe, $RECIPE_STEPS steps (recipe.md): $(exit_of "$recipe_rc")"
  [ -f "$OUT/recipe.md" ] && { echo; tail -n +3 "$OUT/recipe.md"; }
} > "$OUT/checklist.md"
cat "$OUT/checklist.md"
echo "== results in $OUT after $SECONDS s"
# passed: every step that ran exited 0 (a step with no time left to run counts as not passed), but for --quick's slow
# tier, which has the time left: stopped by its limit (124), it passes if no test failed before
ok() { [[ "$1" == 0 || "$1" == "not run" || "$1" == "not run (transformers or peft missing)" ]]; }
slow_ok() {
  ok "$slow_rc" || [ "$slow_rc" = "$NO_TIME" ] \
    || { [ "$slow_rc" = 124 ] && ! grep -q -E "^(FAILED|ERROR)" "$OUT/pytest-slow.log"; }
}
ok "$tests_rc" && slow_ok && ok "$bench_rc" && ok "$divergence_rc" && ok "$served_rc" && ok "$tune_rc" && ok "$memory_rc" \
  && ok "$recipe_rc"
