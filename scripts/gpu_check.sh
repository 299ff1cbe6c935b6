#!/usr/bin/env bash
# Everything that needs the GPU, in one call on the H200 (device tool):
#   scripts/gpu_check.sh [build] [test] [sanitize] [bench] [tune] [profile] [ab]   (default: the first four)
# ab: AB_CASES="VARIANT:T:H ..." and AB_BUILDS="LABEL=PATH ..." ({v} in a path: the variant name),
#   builds made on the CPU machine with `scripts/fatbin_ab.py --build`; one scripts/fatbin_ab.py
#   process per case times every build side by side (AB_ARGS: more of its options; log: $OUT/ab.log).
# profile: PROFILE_VARIANTS="name ..." PROFILE_ARGS="--T 16384 --H 24" (ncu, one report per variant,
#   with its text details and a per-phase table from scripts/ncu_phases.py)
# test: SHARDS (default 8) pytest processes share the GPU (tests/conftest.py --shard; tests of
#   variants with the same inputs stay in one shard, so each Triton kernel compiles once), each
#   appending its measured errors to $OUT/errors_I.jsonl; a table of them follows (error_table).
#   Before sharding (2026-11-30): test_triton.py ~280 s, test_sm80.py ~200 s (804 tests), serially.
# sanitize (4 tools x ~25 variants, 6 at a time) ~300 s?, bench (kdagen bench: report in $OUT/bench/) ~4 min:
# more than one 600 s call holds, so run the stages in separate calls.
# build is cheap there when build/ is carried: artifacts whose content key matches are kept.
# Logs go under $OUT (the device tool brings them back). Runs from the source tree:
# the GPU machine has torch/triton/cuda-bindings; fla-core travels as a wheel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen_gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDAGEN_EAGER_FAILURES=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
STAGES=${*:-build test sanitize bench}
SPECS=${SPECS:-"specs/ci.yaml specs/a100.yaml specs/h800.yaml specs/sm90_dev.yaml specs/ascend950.yaml"}
rc=0
{
  # KDAGEN_COMMIT first: the device copy's .git need not be the tree it carries (session 30 printed an older HEAD)
  echo "date: $(date -u +%F) commit: ${KDAGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
for stage in $STAGES; do
  case $stage in
    build)
      for s in $SPECS; do
        [ -f "$s" ] || continue
        # the Ascend specs translate through the CANNBot DSL, which the GPU machine lacks
        if grep -q "target: ascend" "$s" && ! python3 -c "import cannbotdsl" 2>/dev/null; then
          echo "skip $s: no cannbot-dsl here" | tee -a "$OUT/build.log"; continue
        fi
        python3 -m kdagen.cli build --spec "$s" 2>&1 | tee -a "$OUT/build.log" || rc=1
      done ;;
    test)
      # -rfE and --tb=short: a failure's numbers must come back even when the run is cut short.
      n=${SHARDS:-8}
      pids=()
      rm -f "$OUT"/errors_*.jsonl
      for i in $(seq 0 $((n - 1))); do
        # KDAGEN_DISABLE_JIT: the carried builds are what is tested; a stale one must fail, not be
        # rebuilt from the default sources behind the test's back (a swapped-in A/B build was).
        KDAGEN_DISABLE_JIT=1 OMP_NUM_THREADS=2 KDAGEN_ERRORS="$OUT/errors_$i.jsonl" timeout "${TEST_TIMEOUT:-420}" \
          python3 -m pytest -m gpu -q -rfE --tb=short --maxfail="${MAXFAIL:-10}" --durations=5 \
          -p no:cacheprovider --shard="$i/$n" ${PYTEST_ARGS:-tests} > "$OUT/pytest_gpu_$i.log" 2>&1 &
        pids+=($!)
      done
      for i in "${!pids[@]}"; do
        wait "${pids[$i]}" || { rc=1; echo "shard $i/$n failed (pytest_gpu_$i.log)"; }
        tail -n 1 "$OUT/pytest_gpu_$i.log"
      done
      grep -h "^FAILED\|^ERROR" "$OUT"/pytest_gpu_*.log | head -40
      compgen -G "$OUT/errors_*.jsonl" >/dev/null && python3 -m kdagen_dev.error_table "$OUT"/errors_*.jsonl \
        | tee "$OUT/errors_table.txt" ;;
    sanitize)
      # Every compute-sanitizer tool on one ragged varlen case per kernel shape (sanitize_case.py
      # --list), each (tool, variant) in its own process (synccheck aborts a process at its first
      # error); fails on any error. --report-api-errors no: torch/cuda-bindings probe driver
      # symbols with cuGetProcAddress, which memcheck counts as errors (none in a kernel).
      # --num-cuda-barriers 1024: the tool's automatic count misses kda_recur's PTX mbarriers, and
      # synccheck then overflowed its tracking ("overflow of tracked cuda::barrier structures") and
      # killed the kernel on some launches; at 1024 and 16384 the same cases ran clean (session 30).
      # Summary: $OUT/sanitize_summary.md (copy it to benchmarks/results/).
      mkdir -p "$OUT/sanitize"
      python3 scripts/sanitize_case.py --list ${SANITIZE_ARGS:-} > "$OUT/sanitize/variants.txt" || rc=1
      for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck initcheck}; do
        xargs -P "${SANITIZE_JOBS:-6}" -I{} sh -c "timeout 240 compute-sanitizer --tool $tool --report-api-errors no \
          --num-cuda-barriers 1024 \
          --error-exitcode 9 --print-limit 20 python3 scripts/sanitize_case.py --variant {} \
          > '$OUT/sanitize/$tool-{}.log' 2>&1; echo \"\$? {}\" >> '$OUT/sanitize/$tool.rc'" \
          < "$OUT/sanitize/variants.txt"
      done
      python3 scripts/sanitize_summary.py "$OUT/sanitize" | tee "$OUT/sanitize_summary.md"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      # racecheck's blind spot that kda_recur's o hand-off works around (hazards per mode, for the record)
      nvcc -arch=sm_90 -lineinfo scripts/sanitizer/race_blind_spot.cu -o "$OUT/race_blind_spot" \
        && compute-sanitizer --tool racecheck --print-limit 100 "$OUT/race_blind_spot" > "$OUT/sanitize/blind_spot.log" 2>&1
      { echo; echo "racecheck on scripts/sanitizer/race_blind_spot.cu (hazard reports per kernel; all modes are correct):"
        for m in 0 1 3 4 5; do echo "  MODE $m: $(grep -c "handoff<(int)$m>" "$OUT/sanitize/blind_spot.log")"; done; } \
        | tee -a "$OUT/sanitize_summary.md"
      rm -f "$OUT/race_blind_spot" ;;
    bench)
      timeout "${BENCH_TIMEOUT:-330}" python3 -m kdagen.cli bench ${BENCH_ARGS:-} --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || rc=1 ;;
    tune)
      # this GPU's tuning file (kdagen tune, its default cases: ~4 min on an H100), then a bench of the
      # same cases dispatched by it; ship $OUT/tuned.json as kdagen/tuning_data/<GPU name>.json
      timeout "${TUNE_TIMEOUT:-330}" python3 -m kdagen.cli tune --out "$OUT/tuned.json" > "$OUT/tune.log" 2>&1 || rc=1
      tail -n 3 "$OUT/tune.log"
      [ -f "$OUT/tuned.json" ] && KDAGEN_TUNING="$OUT/tuned.json" timeout "${BENCH_TIMEOUT:-240}" python3 -m kdagen.cli \
        bench --cases "$(python3 -c 'from kdagen.bench import TUNE_CASES; print(TUNE_CASES)')" --compare none --no-graphs --out "$OUT/bench_tuned" \
        > "$OUT/bench_tuned.log" 2>&1 || rc=1
      grep -E "^Dispatch picked" "$OUT/bench_tuned/bench.md" 2>/dev/null ;;
    ab)
      for case in ${AB_CASES:-}; do
        IFS=: read -r v T H <<< "$case"
        timeout "${AB_TIMEOUT:-150}" python3 scripts/fatbin_ab.py --variant "$v" --T "$T" --H "$H" ${AB_ARGS:-} ${AB_BUILDS//\{v\}/$v} \
          2>&1 | tee -a "$OUT/ab.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      done ;;
    profile)
      # ncu on the last of 3 calls (kda_prep + kda_recur) of each PROFILE_VARIANTS entry.
      for pv in ${PROFILE_VARIANTS:-}; do
        timeout 120 ncu --launch-skip 4 --launch-count 2 -k regex:kda_ --section SpeedOfLight \
          --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
          --section LaunchStats --section ComputeWorkloadAnalysis --section SchedulerStats \
          --section SourceCounters --section InstructionStats \
          -o "$OUT/ncu_${PROFILE_TAG:-}$pv" --force-overwrite \
          python3 scripts/profile_case.py ${PROFILE_ARGS:-} "$pv" > "$OUT/ncu_run_${PROFILE_TAG:-}$pv.txt" 2>&1 || rc=1
        ncu -i "$OUT/ncu_${PROFILE_TAG:-}$pv.ncu-rep" > "$OUT/ncu_${PROFILE_TAG:-}$pv.txt" 2>&1
        grep -E "Duration|Throughput|Registers|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Ipc|Block Limit|One or More|No Eligible" "$OUT/ncu_${PROFILE_TAG:-}$pv.txt" | head -60
        # instructions and stall samples per phase (between block barriers), from the SASS source page
        ncu -i "$OUT/ncu_${PROFILE_TAG:-}$pv.ncu-rep" --page source --print-source sass --csv \
          > "$OUT/ncu_src_${PROFILE_TAG:-}$pv.csv" 2>&1 \
          && python3 scripts/ncu_phases.py "$OUT/ncu_src_${PROFILE_TAG:-}$pv.csv" | tee "$OUT/ncu_phases_${PROFILE_TAG:-}$pv.txt"
      done ;;
    *) echo "unknown stage $stage"; rc=2 ;;
  esac
done
# the device tool brings back at most 8 files: everything but the summaries goes into logs.tgz
# (PACK_LOGS=0: a caller running more after this packs itself)
[ "${PACK_LOGS:-1}" = 0 ] || ( cd "$OUT" && tar czf logs.tgz --remove-files --exclude=logs.tgz --exclude=errors_table.txt \
    --exclude=sanitize_summary.md --exclude='bench*' --exclude=env.txt -- * 2>/dev/null )
exit $rc
