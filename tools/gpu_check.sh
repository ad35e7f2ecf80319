#!/usr/bin/env bash
# The GPU counterpart of .ci/run, for a CUDA machine, in one command: build every kernel family with
# ptxas reports, count HGMMA/HMMA and local-memory ops in the SASS, run the GPU tests, run the
# benchmarks (their runs go to the results stores in bench/results/) and the training example. Each
# phase has a time limit; the summary is written to $OUT/summary.txt (or ./gpu_logs) as it goes, the
# full logs and the results stores to gpu_logs.tgz.
#   bash tools/gpu_check.sh                 # everything
#   bash tools/gpu_check.sh --tests-only
#   bash tools/gpu_check.sh --bench-only
#   PYTEST_ARGS="-k sm90" TEST_BUDGET=300 bash tools/gpu_check.sh
# Knobs (env): BUILD_FAMILIES, BUILD_BUDGET, SMOKE_BUDGET, SMOKE_GATE=1, SANITIZE=1 (+SANITIZE_BUDGET, SANITIZE_ARGS, SANITIZE_TOOLS), RACECHECK_PROBE=1, GPU_TEST_FILES,
# TEST_BUDGET, FILE_SHARE, PYTEST_ARGS, FWD_BENCH=1 (+FWD_ARGS), BWD_BENCH=1, HOST_PROFILE=1, ATTN_BUDGET, ATTN_ARGS, DECODE_BENCH=1 (+DECODE_BUDGET, DECODE_ARGS),
# LAYER_BUDGET, LAYER_ARGS, PROFILE_ARGS (+PROFILE_BUDGET), EXAMPLE_BUDGET, EXAMPLE_STEPS. A budget of 0 skips that phase.
# CUTLASS_WHEEL: an nvidia-cutlass wheel file to install (into the work folder) when the package is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-all}"
LOG="${OUT:-$PWD/gpu_logs}"
mkdir -p "$LOG"
WORK="$(mktemp -d)"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
summary="$LOG/summary.txt"; : >"$summary"
say() { echo "$*" | tee -a "$summary"; }
finish() { cp -r bench/results "$WORK/results" 2>/dev/null; tar czf "$LOG/gpu_logs.tgz" -C "$WORK" . 2>/dev/null; }
trap finish EXIT
# a machine without the package index: install nvidia-cutlass from a wheel file
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  if [ -n "${CUTLASS_WHEEL:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" $CUTLASS_WHEEL || exit 1
    export PYTHONPATH="$WORK/site:${PYTHONPATH:-}"
  else
    say "nvidia-cutlass is not installed: pip install it, or set CUTLASS_WHEEL to a wheel file"; exit 1
  fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
export MLA_AUTOGRAD_CACHE="${MLA_AUTOGRAD_CACHE:-${TMPDIR:-/tmp}/mla_autograd_cache}"
{ nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), 'cxx11abi', torch.compiled_with_cxx11_abi())";
  which c++ g++ gcc; c++ --version | head -1; echo "CXX=${CXX:-}"; } >"$WORK/env.txt" 2>&1
say "$(grep -m1 -E 'torch|^2\.' "$WORK/env.txt" | tail -1) | $(date -u +%FT%TZ) | commit ${MLA_COMMIT:-?}"

say "== build (ptxas -v)"; t=$(date +%s)
# one process per family, in parallel (each runs its own nvcc jobs): the build is the longest
# single phase of this script. BUILD_FAMILIES narrows it (default: every family for sm_80/sm_90a).
FAMS="${BUILD_FAMILIES:-$(python3 -c "from mla_autograd._build import FAMILIES as F; print(' '.join(n for n, f in sorted(F.items()) if any(f.matches_arch(a) for a in ('sm_80', 'sm_90a'))))")}"
for fam in $FAMS; do
  timeout "${BUILD_BUDGET:-300}" python3 -m mla_autograd.build --family "$fam" --ptxas-verbose --check-sass >"$WORK/build_$fam.log" 2>&1 &
done
wait
cat "$WORK"/build_*.log >"$WORK/build.log" 2>/dev/null
say "build of $FAMS: $(( $(date +%s) - t )) s"
grep -E "^(OK|FAIL|SKIP)" "$WORK/build.log" | tee -a "$summary"
grep -A30 "^FAIL" "$WORK/build.log" | grep -E "error" | head -10 | tee -a "$summary"
grep -E "bytes spill" "$WORK/build.log" | grep -vE " 0 bytes spill stores, 0 bytes spill loads" | sort | uniq -c | head -20 | sed 's/^/spill: /' | tee -a "$summary"
for so in "$MLA_AUTOGRAD_CACHE"/*/*.so; do
  [ -f "$so" ] || continue
  cuobjdump --dump-sass "$so" >"$WORK/sass.tmp" 2>/dev/null
  say "sass $(basename "$(dirname "$so")"): HGMMA=$(grep -c HGMMA "$WORK/sass.tmp") HMMA=$(grep -c HMMA "$WORK/sass.tmp") LDL/STL=$(grep -cE '\b(LDL|STL)\b' "$WORK/sass.tmp")"
done
rm -f "$WORK/sass.tmp"

if [ "$MODE" != "--bench-only" ]; then
  if grep -q "^OK   fmha_bwd_sm90" "$WORK/build.log"; then
    # small cases with a per-gradient report first: a wrong or hanging backward shows here in seconds
    say "== fmha_bwd_sm90 smoke"
    timeout "${SMOKE_BUDGET:-150}" python3 tools/kernel_smoke.py bwd >"$WORK/smoke.log" 2>&1
    rc=$?; say "smoke rc=$rc"; grep -vE "Warning|warn\(" "$WORK/smoke.log" | tail -n 80 >>"$summary"
    # SMOKE_GATE=1: a failing backward makes the later phases meaningless; stop and save device time
    if [ "$rc" -ne 0 ] && [ -n "${SMOKE_GATE:-}" ]; then say "smoke failed: stopping (SMOKE_GATE)"; exit 1; fi
  fi
  if [ -n "${SANITIZE:-}" ]; then
    say "== compute-sanitizer (tools/sanitize_small.py)"
    # the racecheck run's decode module (-DMLA_DECODE_QK_MBAR, a cache of its own), built outside the tool
    python3 tools/sanitize_small.py --qk-mbar --build-only >"$WORK/sanitize_build.log" 2>&1 || say "qk-mbar build failed"
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
      # racecheck: the decode module built in its mbarrier mode (--qk-mbar, same bits; see tools/sanitize_small.py)
      extra=""; [ "$tool" = racecheck ] && extra="--qk-mbar"
      timeout "${SANITIZE_BUDGET:-150}" compute-sanitizer --tool "$tool" python3 tools/sanitize_small.py ${SANITIZE_ARGS:-} $extra \
        >"$WORK/sanitize_$tool.log" 2>&1
      say "$tool rc=$?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_small:" "$WORK/sanitize_$tool.log" | tr '\n' ' ')"
      grep -E "^========= (Invalid|Race|Error|.*hazard)" "$WORK/sanitize_$tool.log" | sort | uniq -c | head -6 | tee -a "$summary"
    done
  fi
  if [ -n "${RACECHECK_PROBE:-}" ]; then  # does racecheck model named barriers? (tools/racecheck_probe.cu)
    say "== racecheck probe"
    nvcc -arch=sm_90 -lineinfo -o "$WORK/racecheck_probe" tools/racecheck_probe.cu >"$WORK/probe_build.log" 2>&1 || say "probe build failed"
    for k in 0 1 2 3 4 5 6; do
      compute-sanitizer --tool racecheck "$WORK/racecheck_probe" $k >"$WORK/probe_$k.log" 2>&1
      say "probe $k rc=$?: $(grep -E "racecheck_probe mode|RACECHECK SUMMARY" "$WORK/probe_$k.log" | tr '\n' ' ')"
    done
  fi
  say "== GPU tests"; t=$(date +%s)
  # most informative first; each file gets its own process so one crash cannot hide the rest
  for f in ${GPU_TEST_FILES:-tests/gpu/test_api_gpu.py tests/gpu/test_fmha_bwd_sm90.py tests/gpu/test_mla_decode_sm80.py \
           tests/nn/test_mla_gpu.py tests/gpu/test_fmha_fwd_sm90.py tests/gpu/test_fmha_bwd_sm90_mla.py \
           tests/gpu/test_fmha_fwd_sm90_mla.py tests/nn/test_rope_gpu.py tests/gpu/test_fmha_sm100.py}; do
    [ -f "$f" ] || continue
    left=$(( ${TEST_BUDGET:-300} - ($(date +%s) - t) )); [ "$left" -gt 10 ] || { say "$f: not run (test budget spent)"; continue; }
    cap=$(( left * ${FILE_SHARE:-100} / 100 )); [ "$cap" -lt 30 ] && cap=$left  # FILE_SHARE: % of what is left
    left=$cap
    timeout "$left" python3 -m pytest -q -m gpu ${PYTEST_ARGS:-} -p no:cacheprovider "$f" >"$WORK/$(basename "$f" .py).log" 2>&1
    rc=$?
    say "$f rc=$rc: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$WORK/$(basename "$f" .py).log" | tail -1)"
    grep -E "^FAILED|^ERROR" "$WORK/$(basename "$f" .py).log" | head -8 | tee -a "$summary"
  done
  say "gpu tests: $(( $(date +%s) - t )) s"
fi

if [ "$MODE" != "--tests-only" ]; then
  say "== benchmarks"
  if [ -n "${BWD_BENCH:-}" ]; then  # the backward kernel alone, also in deterministic mode, beside cuDNN
    timeout 200 python3 bench/bench_kernels.py bwd >"$WORK/bench_bwd.log" 2>&1
    say "bwd kernel bench rc=$?"; grep -E "^B=" "$WORK/bench_bwd.log" | tee -a "$summary"
  fi
  if [ -n "${FWD_BENCH:-}" ]; then  # the forward kernel alone, beside cuDNN
    timeout 120 python3 bench/bench_kernels.py fwd ${FWD_ARGS:-} >"$WORK/bench_fwd.log" 2>&1
    say "fwd kernel bench rc=$?"; grep -E "^B=|TF/s" "$WORK/bench_fwd.log" | tee -a "$summary"
  fi
  if [ "${ATTN_BUDGET:-240}" -gt 0 ]; then
    timeout "${ATTN_BUDGET:-240}" python3 bench/bench_attention.py ${ATTN_ARGS:-} >"$WORK/bench_attention.log" 2>&1
    say "bench_attention rc=$?"; sed -n '/^workload/,$p' "$WORK/bench_attention.log" | tee -a "$summary"
  fi
  if [ -n "${DECODE_BENCH:-}" ]; then
    timeout "${DECODE_BUDGET:-120}" python3 bench/bench_decode.py ${DECODE_ARGS:-} >"$WORK/bench_decode.log" 2>&1; say "bench_decode rc=$?"
    sed -n '/^mla_decode_sm80 on/,$p' "$WORK/bench_decode.log" | tee -a "$summary"
  fi
  if [ "${LAYER_BUDGET:-120}" -gt 0 ]; then
    timeout "${LAYER_BUDGET:-120}" python3 bench/bench_layer.py ${LAYER_ARGS:-} >"$WORK/bench_layer.log" 2>&1
    say "bench_layer rc=$?"; tail -n 14 "$WORK/bench_layer.log" | tee -a "$summary"
  fi
  if [ -n "${HOST_PROFILE:-}" ]; then  # host time per public decode call beside the extension's (tools/profile_host.py)
    timeout 120 python3 tools/profile_host.py >"$WORK/profile_host.log" 2>&1
    say "profile_host rc=$?"; grep -E "per call" "$WORK/profile_host.log" | tee -a "$summary"
  fi
  if [ -n "${PROFILE_ARGS:-}" ]; then  # per-kernel times of chosen calls (tools/profile_ops.py)
    timeout "${PROFILE_BUDGET:-150}" python3 tools/profile_ops.py $PROFILE_ARGS >"$WORK/profile.log" 2>&1
    say "profile_ops rc=$?"; grep -vE "Warning|warn\(" "$WORK/profile.log" | tail -n 120 | tee -a "$summary"
  fi
  [ "${EXAMPLE_BUDGET:-90}" -gt 0 ] && timeout "${EXAMPLE_BUDGET:-90}" python3 examples/train_mla.py --device cuda --steps "${EXAMPLE_STEPS:-200}" --out "$WORK/train_mla" >"$WORK/train_mla.log" 2>&1
  [ "${EXAMPLE_BUDGET:-90}" -gt 0 ] && { say "train_mla rc=$?"; tail -n 4 "$WORK/train_mla.log" | tee -a "$summary"; }
fi
say "== done $(date -u +%T)"
