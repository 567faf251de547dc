#!/usr/bin/env bash
# The first command to run on a GPU machine (experiments/README.md says how). Under 8
# minutes on an H100. In order, each part timed, every part run even when one before it
# failed:
#   1. install  the package without network (pip install -e --no-deps --no-index
#               --no-build-isolation; where pip cannot, setup.py build_ext --inplace and
#               a dos_jax/kernels link); versions; whether the native kernel loads
#   2. pjrt     tests/test_pjrt_register.py: the native kernel inside a GPU host region
#               (on a GPU its three host-region cases must pass, not skip)
#   3. compiled the compile checks CI runs: the step compiled for an H100/H200 target
#               with no GPU (JAX_PLATFORMS=cpu pytest -m compiled_gpu)
#   4. step     the runner's step compiled by JAX for this GPU: the same schedule facts
#               read off the program the GPU runs, then 20 steps timed per policy
#               (experiments/compile_gpu.py --run; step_*.json)
#   5. gpu      the rest of `pytest -m gpu`
#   6. pallas   Pallas AdamW bandwidth vs device copies of its bytes, and vs
#               jit(optax.adamw), at 16M and 256M (bench_kernels.py --gpu-only)
#   7. update   bench_update.py per policy on 1B bf16 params vs jit(optax.adamw)
#   8. overlap  a jax.profiler trace of one Stride(2) step (1B bf16) and how long host
#               and device update work overlapped in it (trace_overlap.py)
#   9. migrate  what a plan change costs against a full copy of the state: time, new
#               buffers, host and device memory added (bench_migration.py, 1B bf16)
#  10. early_update bench_update (Stride(2), a resident mix): the early host calls by the
#               rule against one host call (--early both)
#  11. early_step the runner's step, early host calls off (one host call, `early=()` via
#               dos_jax.migrate: compile_gpu.py --early none) and as built (the default)
#  12. train    `dos-jax train` itself on this GPU: 30 steps of the packaged tiny config,
#               Stride(2) (the trainer's own path: the one construction)
#  13. train_trace the runner's own profiler trace (track.profile_steps) of steps 6-7 of a
#               10-step Stride(2) run, and the host/device overlap in it (trace_overlap.py
#               on the run's profile/ folder; docs/runner.md says how to read it)
# Writes under $OUT (default experiments/gpu_check_out/, git-ignored): report.md (each
# part's output and wall time, a summary table at the end), logs/, update.json,
# pallas.json, migration.json, early_update.json, trace/, step.hlo.txt and train_trace/ (the
# run folder of part 13, its trace in profile/). Exits 1 if any part failed.
#
#   bash experiments/gpu_check.sh            # the GPU machine
#   bash experiments/gpu_check.sh --small    # smoke test on any machine, CPU included:
#                                            # 1M params, Pallas in interpret mode (also
#                                            # --dry-run, or DOS_JAX_GPU_CHECK_SMALL=1)
# Environment: DOS_JAX_GPU_CHECK_BUDGET, seconds for all parts (default 540): a part's
# time limit is the smaller of its own cap and what is left, so a hang cannot eat the
# device tool's 10 minutes; DOS_JAX_GPU_CHECK_REINSTALL=1 reinstalls even if dos_jax
# already imports from this tree with its native kernel.
set -uo pipefail
cd "$(dirname "$0")/.."

SMALL="${DOS_JAX_GPU_CHECK_SMALL:-0}"
for arg in "$@"; do
  case "$arg" in
    --small|--dry-run) SMALL=1 ;;
    -h|--help) sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

OUT="${OUT:-experiments/gpu_check_out}"
mkdir -p "$OUT/logs"
OUT="$(cd "$OUT" && pwd)"; export OUT
REPORT="$OUT/report.md"
export LOGS="$OUT/logs" REINSTALL="${DOS_JAX_GPU_CHECK_REINSTALL:-0}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET="${DOS_JAX_GPU_CHECK_BUDGET:-540}"
DEADLINE=$((SECONDS + BUDGET))

if [ "$SMALL" = 1 ]; then
  PARAMS=1000000; SUBGROUP=250000
  PALLAS_ARGS=(--interpret --gpu-sizes 0.0625 --reps 3)
  UPDATE_ARGS=(--reps 2 --platform gpu); TRACE_ARGS=(--platform gpu)
  MIGRATE_ARGS=(--platform gpu); STEP_RUNS=2
else
  PARAMS=1000000000; SUBGROUP=100000000
  PALLAS_ARGS=(--gpu-sizes 16,256 --reps 20)
  UPDATE_ARGS=(--reps 3); TRACE_ARGS=(); MIGRATE_ARGS=(); STEP_RUNS=20
fi
# The runner's step at a size that fills a GPU's gemms: the 125m preset, 8 layers.
STEP_ARGS=(--set model.preset=125m --set model.n_layers=8 --set data.seq_len=512
           --set data.batch_size=8 --subgroup-size 4194304)
[ "$SMALL" = 1 ] && STEP_ARGS=()

# ----------------------------------------------------------------------------- parts

install_step() {  # the package importable from this tree, built if possible; versions
  local here='
import os, dos_jax.kernels as k
assert os.path.realpath(k.__file__).startswith(os.path.realpath(os.getcwd()) + os.sep), k.__file__'
  local importable="$here"'
assert k.rows_kernel_available(), k.host_adamw_rows.rows_kernel_unavailable_reason()
assert k.supported_isas(), "the instruction-set probe (_host_isa) is not built"'
  if [ "$REINSTALL" != 1 ] && python3 -c "$importable" 2>/dev/null; then
    echo "dos_jax imports from this tree with its native kernel: nothing to install"
  else
    echo "+ python3 -m pip install --no-deps --no-index --no-build-isolation -e ."
    timeout 300 python3 -m pip install --no-deps --no-index --no-build-isolation -e . \
      > "$LOGS/pip.log" 2>&1
    echo "pip exit $? (log: logs/pip.log)"
    grep -iE 'error|warning: build' "$LOGS/pip.log" | head -n 4 | sed 's/^ */  /'
    if ! python3 -c "$importable" 2>/dev/null; then
      # pip could not (e.g. an old setuptools without bdist_wheel) or the native build
      # failed: build in place, and make dos_jax.kernels importable from this tree.
      echo "+ python3 setup.py build_ext --inplace"
      timeout 300 python3 setup.py build_ext --inplace > "$LOGS/build_ext.log" 2>&1
      echo "build_ext exit $? (log: logs/build_ext.log)"
      tail -n 4 "$LOGS/build_ext.log" | sed 's/^/  /'
      if ! python3 -c "$here" 2>/dev/null && [ ! -e dos_jax/kernels ]; then
        echo "+ ln -s ../kernels dos_jax/kernels (what pyproject's package-dir maps)"
        ln -s ../kernels dos_jax/kernels
      fi
    fi
  fi
  python3 - <<'EOF'
import importlib.metadata, os, platform, sys
import jax, jaxlib
import dos_jax
from dos_jax.kernels import host_adamw_rows
dists = sorted({f"{d.metadata['Name']} {d.version}" for d in importlib.metadata.distributions()
                if any(s in (d.metadata['Name'] or '').lower() for s in ('jax', 'optax', 'flax'))})
dev = jax.devices()[0]
stats = dev.memory_stats() or {}
print(f'python {platform.python_version()}, {", ".join(dists)}')
print(f'backend {jax.default_backend()}: {len(jax.devices())} x {dev.device_kind}, '
      f'memory limit {stats.get("bytes_limit", 0) / 2**30:.1f} GiB, {os.cpu_count()} cores')
import dos_jax.kernels
print(f'dos_jax from {os.path.dirname(dos_jax.__file__)}, '
      f'dos_jax.kernels from {os.path.dirname(dos_jax.kernels.__file__)}')
ok = host_adamw_rows.rows_kernel_available()
print(f'rows_kernel_available(): {ok} {host_adamw_rows.rows_kernel_unavailable_reason()}')
in_gpu = host_adamw_rows.host_kernel_in_gpu_programs() if ok else (False, 'no kernel')
print(f'host_kernel_in_gpu_programs(): {in_gpu}')
with open(os.path.join(os.environ['LOGS'], 'backend'), 'w') as f:
  f.write(jax.default_backend())
print(f'SUMMARY jax {jax.__version__}, jaxlib {jaxlib.__version__}, {dev.device_kind} '
      f'({jax.default_backend()}), native kernel {ok}, in GPU programs {in_gpu[0]}')
EOF
}

pjrt_step() {  # the native kernel in a host region; on a GPU its 3 cases must pass
  python3 -m pytest -q -p no:cacheprovider -rA tests/test_pjrt_register.py 2>&1 \
    | tee "$LOGS/pjrt_pytest.log"
  local rc=${PIPESTATUS[0]} passed
  passed=$(grep -c '^PASSED .*test_native_kernel_runs_in_a_gpu_host_region' \
    "$LOGS/pjrt_pytest.log")
  if [ "$(cat "$LOGS/backend" 2>/dev/null)" = gpu ] && [ "$passed" -lt 3 ]; then
    echo "SUMMARY the GPU host-region test passed $passed of 3 cases (skipped or failed)"
    return 1
  fi
  echo "SUMMARY pytest exit $rc; GPU host-region cases passed: $passed of 3"
  return $rc
}
export -f install_step pjrt_step

# ----------------------------------------------------------------------------- runner

NAMES=(); STATUS=(); WALL=(); RESULT=(); FAILED=0

part() {  # part KEY TITLE CAP_SECONDS COMMAND...: run, log, time, add to the report
  local key="$1" title="$2" cap="$3"; shift 3
  local log="$LOGS/$key.log" start=$SECONDS left=$((DEADLINE - SECONDS)) rc status result
  local limit=$((cap < left ? cap : left))
  echo "=== $title (limit $limit s)"
  if [ "$limit" -lt 10 ]; then
    echo "not run: the time budget ($BUDGET s) is spent" | tee "$log"; rc=124
  else
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  fi
  local wall=$((SECONDS - start))
  case "$rc" in
    0) status=ok ;;
    124|137) status="TIMEOUT (${limit} s)"; FAILED=1 ;;
    *) status="FAILED (exit $rc)"; FAILED=1 ;;
  esac
  result="$(grep -a '^SUMMARY ' "$log" | tail -n 1 | sed 's/^SUMMARY //')"
  [ -n "$result" ] || result="$(grep -aE '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1)"
  [ -n "$result" ] || result="$(grep -av '^\s*$' "$log" | tail -n 1)"
  {
    echo; echo "## $title"; echo
    echo "\`$*\`: **$status**, ${wall} s"; echo; echo '```'
    if [ "$(wc -l < "$log")" -gt 200 ]; then
      head -n 40 "$log"; echo "[... $(wc -l < "$log") lines in all: logs/$key.log ...]"
      tail -n 150 "$log"
    else
      cat "$log"
    fi
    echo '```'
  } >> "$REPORT"
  NAMES+=("$title"); STATUS+=("$status"); WALL+=("$wall"); RESULT+=("${result//|/\\|}")
}

{
  echo "# dos_jax GPU check"; echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname), mode $([ "$SMALL" = 1 ] && echo small || echo full)"
  echo "(params $PARAMS, subgroup $SUBGROUP, budget $BUDGET s), commit" \
    "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$REPORT"

part install "1. install, versions, native kernel" 150 bash -c install_step
part pjrt "2. native kernel in a GPU host region (tests/test_pjrt_register.py)" 90 \
  bash -c pjrt_step
compiled_step() {  # pytest's exit 5 (all skipped: no CUDA plugin, e.g. --small on a CPU) is no failure
  JAX_PLATFORMS=cpu python3 -m pytest -q -p no:cacheprovider -rfEs -m compiled_gpu tests
  local rc=$?
  [ "$rc" = 5 ] && return 0
  return $rc
}
export -f compiled_step
part compiled "3. the step compiled for H100/H200 without a GPU (pytest -m compiled_gpu)" 150 \
  bash -c compiled_step
step_runs() {  # the runner's step on this machine's backend, per policy
  local rc=0 policy
  for policy in all_host stride device_fraction; do
    python3 experiments/compile_gpu.py --run "$STEP_RUNS" --policy "$policy" \
      $STEP_ARGS_STR --json "$OUT/step_$policy.json" || rc=1
  done
  return $rc
}
export -f step_runs
export STEP_RUNS STEP_ARGS_STR="${STEP_ARGS[*]}"
part step "4. the runner's step compiled for this GPU, schedule and time" 150 \
  bash -c 'step_runs'
part gpu "5. pytest -m gpu (the rest)" 150 \
  python3 -m pytest -q -p no:cacheprovider -rfEs -m gpu --ignore=tests/test_pjrt_register.py tests
part pallas "6. Pallas AdamW vs device copy and jit(optax.adamw)" 90 \
  python3 experiments/bench_kernels.py --gpu-only "${PALLAS_ARGS[@]}" --json "$OUT/pallas.json"
part update "7. bench_update per policy, bf16 params" 240 \
  python3 experiments/bench_update.py --params "$PARAMS" --subgroup-size "$SUBGROUP" \
  --dtype bf16 --policies 'AllHost,Stride(2),DeviceFraction(0.5),AllDevice' \
  "${UPDATE_ARGS[@]}" --json "$OUT/update.json"
part overlap "8. host/device overlap in a profiled Stride(2) step" 150 \
  python3 experiments/trace_overlap.py --params "$PARAMS" --subgroup-size "$SUBGROUP" \
  "${TRACE_ARGS[@]}" --out "$OUT"
part migrate "9. plan change against a full copy of the state" 90 \
  python3 experiments/bench_migration.py --params "$PARAMS" --subgroup-size "$SUBGROUP" \
  --dtype bf16 "${MIGRATE_ARGS[@]}" --json "$OUT/migration.json"
part early_update "10. bench_update, early host calls by the rule against one host call" 180 \
  python3 experiments/bench_update.py --params "$PARAMS" --subgroup-size "$SUBGROUP" \
  --dtype bf16 --policies 'Stride(2),ResidentFraction(0.3)' --early both \
  "${UPDATE_ARGS[@]}" --json "$OUT/early_update.json"
early_runs() {  # the runner's step with one host call and as built (early calls)
  local rc=0 policy early
  for policy in all_host stride; do
    for early in none default; do
      python3 experiments/compile_gpu.py --run "$STEP_RUNS" --policy "$policy" \
        --early "$early" $STEP_ARGS_STR --json "$OUT/early_${policy}_$early.json" || rc=1
    done
  done
  return $rc
}
export -f early_runs
part early_step "11. the runner's step, early host calls off (one host call) and the default" 240 \
  bash -c 'early_runs'
# The trainer itself, as a user runs it on one GPU: the params on a one-device mesh, the
# step built as unsharded (stream lanes and early host calls), compiled with the early
# windows' profile (once where XLA names the calls as predicted), the memory check; loss and metrics logged.
part train "12. dos-jax train on this GPU: 30 steps, Stride(2), the one construction" 120 \
  dos-jax train --set train.steps=30 --set train.eval_every=0 --set train.log_every=10 \
  --set offload.policy=stride --set "train.out_dir=$OUT/train"
train_trace() {  # the runner's trace of two steps, then what overlapped in it
  rm -rf "$OUT/train_trace"
  dos-jax train --set train.steps=10 --set train.eval_every=0 --set train.log_every=1 \
    --set offload.policy=stride --set 'track.profile_steps=[6, 7]' \
    --set "train.out_dir=$OUT/train_trace" || return 1
  python3 experiments/trace_overlap.py --trace-dir "$OUT/train_trace/profile"
}
export -f train_trace
part train_trace "13. the runner's profiler trace of steps 6-7 (track.profile_steps) and its overlap" \
  120 bash -c 'train_trace'

{
  echo; echo "## Summary"; echo
  echo "| part | status | wall s | result |"; echo "|---|---|---|---|"
  for i in "${!NAMES[@]}"; do
    echo "| ${NAMES[$i]} | ${STATUS[$i]} | ${WALL[$i]} | ${RESULT[$i]} |"
  done
  echo; echo "Total ${SECONDS} s; $([ "$FAILED" = 0 ] && echo 'every part passed' || echo 'a part failed')."
} >> "$REPORT"
sed -n '/^## Summary/,$p' "$REPORT"
echo "report: $REPORT"
exit "$FAILED"
