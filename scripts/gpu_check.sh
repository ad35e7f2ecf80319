#!/usr/bin/env bash
# The GPU counterpart of .ci/run, for a CUDA machine (the H200): build every kernel family with
# ptxas reports, count HGMMA/HMMA in the SASS, run the GPU test suite, run the benchmarks.
# Logs go to $OUT (the device tool's return folder) or ./gpu_logs; a summary prints last.
#   bash scripts/gpu_check.sh                 # everything
#   bash scripts/gpu_check.sh --tests-only    # build + tests
#   bash scripts/gpu_check.sh --bench-only    # build + benchmarks
#   PYTEST_ARGS="-k sm90" bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
LOG="${OUT:-$PWD/gpu_logs}"
mkdir -p "$LOG"
WORK="$(mktemp -d)"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
# The device image lacks nvidia-cutlass: install the carried wheel (see the device tool's notes).
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  if ls .whl/nvidia_cutlass-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/nvidia_cutlass-*.whl || exit 1
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
  else
    echo "nvidia-cutlass is not installed and no .whl/ to install it from"; exit 1
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export MLA_AUTOGRAD_CACHE="${MLA_AUTOGRAD_CACHE:-/tmp/mla_autograd_cache}"
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } >"$WORK/env.txt" 2>&1
summary="$WORK/summary.txt"; : >"$summary"

echo "== build (ptxas -v)"; t=$(date +%s)
python3 -m mla_autograd.build --arch sm_80 sm_90a --ptxas-verbose --skip-missing >"$WORK/build.log" 2>&1
rc_build=$?
grep -E "^(OK|FAIL|SKIP)" "$WORK/build.log" | tee -a "$summary"
echo "build: rc=$rc_build in $(( $(date +%s) - t )) s" | tee -a "$summary"
{ echo "spill lines (non-zero):"; grep -E "bytes spill" "$WORK/build.log" | grep -vE " 0 bytes spill stores, 0 bytes spill loads" | sort | uniq -c | head -40; } >>"$summary"
for so in "$MLA_AUTOGRAD_CACHE"/*/*.so; do
  [ -f "$so" ] || continue
  n_h=$(cuobjdump --dump-sass "$so" 2>/dev/null | grep -c HGMMA); n_m=$(cuobjdump --dump-sass "$so" 2>/dev/null | grep -c "HMMA")
  n_l=$(cuobjdump --dump-sass "$so" 2>/dev/null | grep -cE "\bLDL|\bSTL")
  echo "sass $(basename "$(dirname "$so")"): HGMMA=$n_h HMMA=$n_m LDL/STL=$n_l" | tee -a "$summary"
done

if [ "$MODE" != "--bench-only" ]; then
  echo "== GPU tests"; t=$(date +%s)
  python3 -m pytest -q -m gpu ${PYTEST_ARGS:-} --junitxml="$WORK/pytest_gpu.xml" tests >"$WORK/pytest_gpu.log" 2>&1
  rc_tests=$?
  tail -n 40 "$WORK/pytest_gpu.log" | grep -E "passed|failed|FAILED|ERROR|skipped" | tail -25 | tee -a "$summary"
  echo "gpu tests: rc=$rc_tests in $(( $(date +%s) - t )) s" | tee -a "$summary"
fi

if [ "$MODE" != "--tests-only" ]; then
  echo "== benchmarks"; t=$(date +%s)
  for b in bench/bench_attention.py bench/bench_decode.py bench/bench_layer.py; do
    [ -f "$b" ] || continue
    timeout 400 python3 "$b" ${BENCH_ARGS:-} >"$WORK/$(basename "$b" .py).log" 2>&1
    echo "$b: rc=$?" | tee -a "$summary"
    tail -n 30 "$WORK/$(basename "$b" .py).log" >>"$summary"
  done
  cp bench/results/*.json bench/results/*.png "$WORK/" 2>/dev/null
  echo "benchmarks: $(( $(date +%s) - t )) s" | tee -a "$summary"
fi

tar czf "$LOG/gpu_logs.tgz" -C "$WORK" .
cp "$summary" "$LOG/summary.txt"
echo; echo "===== summary ====="; cat "$summary"
