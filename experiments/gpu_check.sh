#!/usr/bin/env bash
# One command for a GPU machine (see experiments/README.md): the GPU tests (the native
# kernel inside a host region first), the Pallas kernel's bandwidth against a device
# copy, bench_update per policy on 1B bf16 params, and a profiled Stride(2) step's
# host/device overlap. Writes report.md (and the trace) under $OUT when it is set.
# Every part runs; the exit status is non-zero if any failed. Small mode for a smoke
# test on CPU: DOS_JAX_GPU_CHECK_SMALL=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-experiments/gpu_check_out}"
mkdir -p "$OUT"
REPORT="$OUT/report.md"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PARAMS=1000000000; SUBGROUP=100000000; SIZES=16,64,256
if [ "${DOS_JAX_GPU_CHECK_SMALL:-0}" = 1 ]; then PARAMS=2000000; SUBGROUP=500000; SIZES=1; fi
failed=0
part() {  # part NAME COMMAND...: run, time, append its output to the report
  local name="$1"; shift
  local start=$SECONDS
  echo "## $name" | tee -a "$REPORT"
  echo '```' >> "$REPORT"
  "$@" 2>&1 | tee -a "$REPORT"
  local rc=${PIPESTATUS[0]}
  echo '```' >> "$REPORT"
  echo "($name: exit $rc, $((SECONDS - start)) s)" | tee -a "$REPORT"
  [ "$rc" = 0 ] || failed=1
}
: > "$REPORT"
# The project's native kernel is built here; a failed build leaves XLA's host path.
[ -f kernels/_host_adamw_rows*.so ] || python3 setup.py build_ext --inplace >/dev/null 2>&1 || true
part versions python3 -c "import jax, jaxlib; print(jax.__version__, jaxlib.__version__, jax.devices()[0].device_kind); from dos_jax.kernels import host_adamw_rows as h; print('native host kernel:', h.rows_kernel_available(), h.rows_kernel_unavailable_reason()); print('in GPU programs:', h.host_kernel_in_gpu_programs())"
part "native kernel in a GPU host region" python3 -m pytest -q -p no:cacheprovider tests/test_pjrt_register.py
part "gpu tests" python3 -m pytest -q -p no:cacheprovider -m gpu tests
part "Pallas AdamW vs device copy" python3 experiments/bench_kernels.py --reps 5 --gpu-sizes "$SIZES" --size 1048576
part "bench_update bf16" python3 experiments/bench_update.py --params "$PARAMS" --subgroup-size "$SUBGROUP" --dtype bfloat16 --reps 3
part "Stride(2) host/device overlap" python3 experiments/trace_overlap.py --params "$PARAMS" --subgroup-size "$SUBGROUP" --out "$OUT"
echo "gpu_check: $([ $failed = 0 ] && echo all parts passed || echo some part failed); report: $REPORT"
exit $failed
