#!/usr/bin/env bash
# Issues 17 and 19 on GPUs, in one call from the source tree (results under $OUT):
#   scripts/scan_gpu.sh [tests] [bench] [cp]   (default: tests cp)
# tests: pytest -m gpu of the scan and cp tests (NCCL ranks where 2+ GPUs are visible, else two
#        ranks sharing one GPU over gloo);
# bench: scripts/scan_bench.py (issue 17's rows, accuracy);
# cp:    issue 19's run: with 2+ GPUs scripts/cp_bench.py over NCCL on 2, 4 and 8 ranks (as many as
#        there are GPUs), B1 T1048576 H8 D128, the planner's segments, mode "correct", against the
#        best one-GPU call (and with a checkpoint every 4096 tokens: time, peak memory, rows), then 2
#        ranks in the zigzag layout; with one GPU, one rank over NCCL (its collectives at world 1) and
#        two ranks sharing the GPU over gloo (the real collective path at full size: results, not a speedup).
# Tests use the carried build/ images (KDAGEN_DISABLE_JIT=1: a stale image fails rather than being
# rebuilt); fla-core travels as a wheel in .whl/. Expected on H200s: tests ~1-2 min, cp ~1-2 min a
# rank count, bench ~3-4 min.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kdagen_scan}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KDAGEN_EAGER_FAILURES=1 NCCL_NVLS_ENABLE=0 KDAGEN_DISABLE_JIT=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
STAGES=${*:-tests cp}
CP_ARGS=${CP_ARGS:-"--segments auto --modes correct --baseline-segments 6,12 --checkpoint-every 4096"}
n=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "date: $(date -u +%F) commit: ${KDAGEN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} GPUs: $n" \
  | tee "$OUT/env.txt"
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv 2>&1 | tee -a "$OUT/env.txt"
rc=0
for stage in $STAGES; do
  case $stage in
    tests)
      python3 -m pytest -m gpu -q -rfE --tb=short -p no:cacheprovider tests/test_scan_engine.py tests/test_cp.py \
        2>&1 | tee "$OUT/pytest_scan_gpu.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    bench)
      python3 scripts/scan_bench.py --rows all --accuracy --out "$OUT/scan_h200.md" 2>&1 | tee "$OUT/scan_bench.log"
      [ "${PIPESTATUS[0]}" = 0 ] || rc=1 ;;
    cp)
      if [ "$n" -ge 2 ]; then
        # one log for every run: $OUT returns at most 8 files
        for p in 2 4 8 zigzag; do
          layout=contiguous
          if [ "$p" = zigzag ]; then layout=zigzag; p=2; fi
          [ "$n" -ge "$p" ] || continue
          md="$OUT/cp_h200x$p.md"; [ "$layout" = zigzag ] && md="$OUT/cp_h200x2_zigzag.md"
          # shellcheck disable=SC2086
          torchrun --standalone --nproc_per_node "$p" scripts/cp_bench.py $CP_ARGS --layout "$layout" --out "$md" \
            2>&1 | tee -a "$OUT/cp_bench.log"
          [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        done
      else
        echo "cp: $n GPU; issue 19's speedup needs 2 or more. One rank over NCCL, then two ranks sharing it over gloo" \
          "(neither is a speedup)." | tee "$OUT/cp_bench_gloo.log"
        # world 1 over NCCL: the NCCL collectives kdagen.cp makes on 2+ GPUs (the maps' all_gather, the
        # checkpoints' all_reduce), run for real
        # shellcheck disable=SC2086
        torchrun --standalone --nproc_per_node 1 scripts/cp_bench.py $CP_ARGS --T 262144 \
          --out "$OUT/cp_nccl_world1.md" 2>&1 | tee -a "$OUT/cp_bench_gloo.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
        # shellcheck disable=SC2086
        torchrun --standalone --nproc_per_node 2 scripts/cp_bench.py --backend gloo $CP_ARGS \
          --out "$OUT/cp_h200_gloo.md" 2>&1 | tee -a "$OUT/cp_bench_gloo.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
      fi ;;
    *) echo "scan_gpu.sh: unknown stage '$stage' (expected tests, bench or cp)"; rc=2 ;;
  esac
done
exit $rc
