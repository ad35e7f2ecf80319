#!/usr/bin/env bash
# A/B of a kernel change on a CUDA machine, in one command: build A (this tree with the baseline copies of the
# changed files overlaid) and B (this tree) side by side, run B's GPU tests, then time both in alternating
# processes with tools/profile_ops.py (cuDNN runs in each process too, so every number has a same-process peer
# beside it). Why alternate processes: cuDNN's own backward moved by up to 6% between processes on the H200,
# more than the changes being measured.
#   Baseline files, in the tree layout under $BASELINE (default .ab/, keep it out of git):
#           mkdir -p .ab/csrc/sm90/fmha_bwd && git show main:csrc/sm90/fmha_bwd/fmha_bwd_sm90_kernel.cuh > .ab/csrc/sm90/fmha_bwd/fmha_bwd_sm90_kernel.cuh
#   Run:    FAMILY=fmha_bwd_sm90 PROFILE="--bwd 192 causal --bwd 128 causal" bash tools/ab_kernel.sh
#   Decode: FAMILY=mla_decode_sm80 TESTS=tests/gpu/test_mla_decode_sm80.py PROFILE="--decode 128 4096 128" bash tools/ab_kernel.sh
#           (or, for a launch option, bench/bench_decode.py --ab FIELD=VALUE,... in one process)
#   Decode beside FlashMLA: FLASHMLA=path/to/flashmla.py (a binding of its SM90 dense decode, as bench_decode's
#           --flashmla takes) DECODE_CASES="128,4096,128 64,8192,128,2": bench/bench_decode.py --flashmla in each
#           round, each side in its own process with FlashMLA beside it (PEER_ROUNDS alternating rounds inside).
#           SANITIZE=1 adds compute-sanitizer memcheck and racecheck of B on tools/sanitize_small.py
#           (SANITIZE_ARGS, e.g. --decode-only):
#           FAMILY=mla_decode_sm80 TESTS=tests/gpu/test_mla_decode_sm80.py FLASHMLA=$PWD/.peers/device/flashmla.py \
#             SANITIZE=1 SANITIZE_ARGS=--decode-only ROUNDS=1 bash tools/ab_kernel.sh
#   One build, two settings (a run-time knob such as MLA_BWD_SM90_KV_PREFETCH): no baseline files needed,
#           SAME_BUILD=1 ENV_A="MLA_BWD_SM90_KV_PREFETCH=0" bash tools/ab_kernel.sh
#   Beside FlashAttention-4 instead of cuDNN: FA4=1 (FA4_ARGS: --fwd or --bwd, default both;
#           FA4 importable as flash_attn.cute): tools/ab_fa4.py in each round, its rows
#           compared at the end (tools/ab_fa4.py --compare). Both families built: FAMILY=fmha_fwd_sm90
#           EXTRA_FAMILIES=fmha_bwd_sm90 (B), and for A too with the baseline of each.
# Knobs: FAMILY, EXTRA_FAMILIES (built for B, and for A when FA4=1, e.g. for the API tests), FA4, FA4_ARGS, TESTS (B's test files),
# TEST_T (seconds per file), ROUNDS (A/B pairs), PROFILE (tools/profile_ops.py arguments, run with --kernel-only),
# SAME_BUILD=1 (A is B's build), ENV_A / ENV_B (VAR=value words exported for A's / B's profile runs),
# BASELINE (the baseline files' folder), AB_WORK (A's tree and both kernel caches; default $TMPDIR/mla_ab),
# CUTLASS_WHEEL (an nvidia-cutlass wheel file to install when the package is missing), OUT (logs; default ./ab_logs),
# FLASHMLA, DECODE_CASES, PEER_ROUNDS, SANITIZE, SANITIZE_ARGS (above).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTD="${OUT:-$PWD/ab_logs}"; mkdir -p "$OUTD"
WORKD="${AB_WORK:-${TMPDIR:-/tmp}/mla_ab}"; mkdir -p "$WORKD"
BASE="${BASELINE:-.ab}"
SITE="$WORKD/site"
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  [ -n "${CUTLASS_WHEEL:-}" ] || { echo "nvidia-cutlass is not installed: pip install it, or set CUTLASS_WHEEL"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $CUTLASS_WHEEL || exit 1
fi
CALLER_PATH="${PYTHONPATH:+:$PYTHONPATH}"  # where the caller found nvidia-cutlass (the check above), kept
export PYTHONPATH="$SITE:$PWD$CALLER_PATH" MAX_JOBS="${MAX_JOBS:-16}" PYTHONUNBUFFERED=1
# FA4 compiles its kernels in every process (tens of seconds per round); its on-disk cache makes the first round pay alone
[ -z "${FA4:-}" ] || export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_DIR="$WORKD/fa4_cache"
FAMILY="${FAMILY:-fmha_bwd_sm90}"
TOOLS="$PWD/tools"
[ -z "${FLASHMLA:-}" ] || FLASHMLA="$(realpath "$FLASHMLA")"  # the rounds run from A's tree too
if [ -z "${SAME_BUILD:-}" ]; then
  [ -d "$BASE" ] || { echo "no $BASE/ with baseline files"; exit 1; }
  rm -rf "$WORKD/A" && mkdir -p "$WORKD/A" && cp -r mla_autograd csrc bench tests tools "$WORKD/A/" && cp -r "$BASE/." "$WORKD/A/"
  for f in "$FAMILY" ${FA4:+${EXTRA_FAMILIES:-}}; do
    (cd "$WORKD/A" && PYTHONPATH="$SITE:$WORKD/A$CALLER_PATH" MLA_AUTOGRAD_CACHE="$WORKD/cache_A" python3 -m mla_autograd.build --family "$f" >"$OUTD/build_A_$f.log" 2>&1) &
  done
fi
MLA_AUTOGRAD_CACHE="$WORKD/cache_B" python3 -m mla_autograd.build --family "$FAMILY" --ptxas-verbose >"$OUTD/build_B.log" 2>&1 &
for f in ${EXTRA_FAMILIES:-}; do MLA_AUTOGRAD_CACHE="$WORKD/cache_B" python3 -m mla_autograd.build --family "$f" >"$OUTD/build_$f.log" 2>&1 & done
wait
grep -hE "^(OK|FAIL)" "$OUTD"/build_*.log; grep -h "spill" "$OUTD/build_B.log" | sort | uniq -c
for f in ${TESTS:-tests/gpu/test_fmha_bwd_sm90.py}; do
  MLA_AUTOGRAD_CACHE="$WORKD/cache_B" timeout "${TEST_T:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider "$f" >"$OUTD/test_$(basename "$f" .py).txt" 2>&1
  echo "B $f: $(tail -1 "$OUTD/test_$(basename "$f" .py).txt")"; grep -E "^FAILED" "$OUTD/test_$(basename "$f" .py).txt" | head
done
if [ -n "${SANITIZE:-}" ]; then
  for tool in memcheck racecheck; do
    MLA_AUTOGRAD_CACHE="$WORKD/cache_B" timeout "${TEST_T:-120}" compute-sanitizer --tool "$tool" python3 tools/sanitize_small.py \
      ${SANITIZE_ARGS:-} >"$OUTD/san_$tool.txt" 2>&1
    echo "B $tool: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUTD/san_$tool.txt" | tr '\n' ' ')"
    grep -E "Race reported" "$OUTD/san_$tool.txt" | sed -E 's/.* at (void )?//; s/\(.*//' | sort | uniq -c | head -5
  done
fi
for r in $(seq "${ROUNDS:-2}"); do for v in A B; do
  d=$PWD; cache="$WORKD/cache_$v"; envs="${ENV_B:-}"
  if [ "$v" = A ]; then
    envs="${ENV_A:-}"
    if [ -n "${SAME_BUILD:-}" ]; then cache="$WORKD/cache_B"; else d="$WORKD/A"; fi
  fi
  if [ -n "${FLASHMLA:-}" ]; then
    cases=""; for c in ${DECODE_CASES:-128,4096,128 64,8192,128,2 8,8192,64}; do cases="$cases --case $c"; done
    (cd "$d" && { [ -z "$envs" ] || export $envs; } && PYTHONPATH="$SITE:$d$CALLER_PATH" MLA_AUTOGRAD_CACHE="$cache" timeout 300 \
       python3 bench/bench_decode.py --no-sdpa --no-api --flashmla "$FLASHMLA" $cases --peer-rounds "${PEER_ROUNDS:-3}" \
       --out "$OUTD/dec_$v$r.json" >"$OUTD/dec_$v$r.txt" 2>&1)
    echo "== $v round $r"
    sed -n '/beside FlashMLA/,$p' "$OUTD/dec_$v$r.txt" | grep -vE '^(wrote|plot)' | tail -n +3 | cut -c1-140
    continue
  fi
  if [ -n "${FA4:-}" ]; then
    # the baseline tree runs this tree's tools/ab_fa4.py, so that both sides time the same rows the same way
    (cd "$d" && { [ -z "$envs" ] || export $envs; } && PYTHONPATH="$SITE:$d$CALLER_PATH" MLA_AUTOGRAD_CACHE="$cache" timeout 300 python3 "$TOOLS/ab_fa4.py" \
       "$v$r" "$OUTD/fa4_$v$r.json" ${FA4_ARGS:-} 2>&1 | grep -E "^$v$r |Error|error" | cut -c1-140)
    continue
  fi
  (cd "$d" && { [ -z "$envs" ] || export $envs; } && PYTHONPATH="$SITE:$d$CALLER_PATH" MLA_AUTOGRAD_CACHE="$cache" timeout 150 python3 tools/profile_ops.py --kernel-only \
     ${PROFILE:---bwd 192 causal} >"$OUTD/prof_$v$r.txt" 2>&1)
  echo "== $v round $r"
  grep -E "^  (kernel entry|sdpa_cudnn)|^backward|fmha_bwd_sm90_|flash_bprop|dot_do_o|convert_dq|^decode |mla_decode_" "$OUTD/prof_$v$r.txt" \
    | sed -E 's/void fmha_bwd_sm90::fmha_bwd_sm90_//; s/cudnn_generated_fort_native_sdpa_sm90_//' | cut -c1-100
done; done
[ -z "${FA4:-}" ] || python3 tools/ab_fa4.py --compare "$OUTD"/fa4_*.json
